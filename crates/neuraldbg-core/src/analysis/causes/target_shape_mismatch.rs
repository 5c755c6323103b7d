//! `target_shape_mismatch`: a loss that broadcasts the output against a differently shaped
//! target (`(N, 1)` against `(N,)` gives `(N, N)`): every output is compared with every target,
//! so the best it can do is predict their mean.

use super::super::remedy::{Framework, Remedy};
use super::super::vocab::{Cause, Failure};
use super::{Case, CauseRule, RemedyCase, Votes};

pub(crate) struct TargetShapeMismatch;

/// Output elements and the (larger) number the loss compared, when the loss broadcast.
pub(crate) fn broadcast(c: &crate::engine::Run) -> Option<(u64, u64)> {
    let loss = c.model.spec.loss.as_ref()?;
    if !loss.reads_output_units() {
        return None;
    }
    let (out, compared) = (loss.output_numel?, loss.compared_numel?);
    (out > 1 && compared >= 2 * out).then_some((out, compared))
}

impl CauseRule for TargetShapeMismatch {
    fn cause(&self) -> Cause {
        Cause::TargetShapeMismatch
    }

    fn phrase(&self) -> &'static str {
        "a loss that broadcasts the output against a differently shaped target"
    }

    fn explains(&self, failure: Failure) -> bool {
        matches!(failure, Failure::LossPlateau | Failure::LossDivergence)
    }

    fn always_candidate(&self, _: Failure) -> bool {
        false
    }

    fn evidence(&self, c: &Case<'_>, v: &mut Votes) {
        if let Some((out, compared)) = broadcast(c.run) {
            v.proof(
                5.0,
                format!(
                    "the loss compared {compared} pairs from an output of {out} elements: it broadcast the output against a target of another shape, so every output is fitted to every target and only their mean can be learned"
                ),
            );
        }
    }

    /// `PyTorch` warns of the broadcast (burn's wording is its); optax and Keras do not.
    fn remedies(&self, c: &RemedyCase<'_>) -> Vec<Remedy> {
        if matches!(c.framework(), Framework::Jax | Framework::Keras) {
            return vec![Remedy::MatchTargetShape];
        }
        vec![Remedy::MatchTargetShape, Remedy::KeepShapeWarning]
    }
}
