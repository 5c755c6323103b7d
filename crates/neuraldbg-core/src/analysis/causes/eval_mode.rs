//! `eval_mode`: the model is optimized while in `eval()` mode. Only a mistake that can make
//! training fail counts: `BatchNorm` layers then normalize with running statistics that never
//! update (their initial mean 0, variance 1), so they no longer rescale the signal, and the
//! failures of an unnormalized network follow. Dropout in eval mode only removes
//! regularization: no alarm.

use super::super::remedy::Remedy;
use super::super::vocab::{Cause, Failure};
use super::{Case, CauseRule, RemedyCase, Votes};

pub(crate) struct EvalMode;

/// Modules whose behaviour differs between train and eval mode in a way that changes what the
/// network computes in training.
fn batch_statistics(kind: &str) -> bool {
    kind.starts_with("BatchNorm") || kind.starts_with("SyncBatchNorm")
}

impl CauseRule for EvalMode {
    fn cause(&self) -> Cause {
        Cause::EvalMode
    }

    fn phrase(&self) -> &'static str {
        "training in eval() mode"
    }

    fn explains(&self, failure: Failure) -> bool {
        !matches!(
            failure,
            Failure::DataAnomaly
                | Failure::SaturatedGradients
                | Failure::StalledLayer
                | Failure::LossScaleCollapse
        )
    }

    fn always_candidate(&self, _: Failure) -> bool {
        false
    }

    fn evidence(&self, c: &Case<'_>, v: &mut Votes) {
        let facts = &c.run.loop_facts;
        let Some(share) = facts.eval_share() else {
            return;
        };
        if share < 0.5 {
            return;
        }
        let norms: Vec<&str> = c
            .run
            .model
            .spec
            .modules
            .iter()
            .filter(|m| batch_statistics(&m.kind))
            .map(|m| m.name.as_str())
            .collect();
        if norms.is_empty() {
            return;
        }
        v.proof(
            4.0,
            format!(
                "the model was in eval() mode on {:.0}% of the training steps, so its {} BatchNorm layer(s) normalized with frozen running statistics instead of the batch's",
                100.0 * share,
                norms.len()
            ),
        );
    }

    fn remedies(&self, _: &RemedyCase<'_>) -> Vec<Remedy> {
        vec![Remedy::CallTrain, Remedy::RestoreModeAfterEval]
    }
}
