//! `over_regularization`: a weight penalty that outweighs the fit to the data, so that the
//! optimizer mostly shrinks the weights. Written into the loss (`loss + l2 * sum(w.pow(2)
//! .sum() ...)`), the loss falls as the weights' squared norm falls, on a line whose slope is
//! the penalty's coefficient. As the optimizer's `weight_decay` added to the gradient (`SGD`,
//! `Adam`), the decay's pull on the weights is many times the loss's own gradient from the
//! start: the weights, and with them the signal and its gradients, shrink.

use super::super::remedy::Remedy;
use super::super::vocab::{Cause, Failure};
use super::{Case, CauseRule, Facts, RemedyCase, Votes, fmt_g};
use crate::engine::Run;

pub(crate) struct OverRegularization;

/// Pairs of (weights' squared norm, loss) a judgment needs: the weights are measured on
/// sampled steps.
const MIN_PAIRS: u64 = 5;
/// How well the loss must follow the squared norm.
const MIN_R2: f64 = 0.9;
/// The penalty's share of the loss, at the first and the last pair, above which it outweighs
/// the data.
const MIN_SHARE: f64 = 0.5;

/// A weight penalty that outweighs the fit to the data, as measured.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Penalty {
    /// Parameters the loss penalizes directly.
    pub params: u64,
    /// The loss per unit of the weights' squared norm (the penalty's coefficient).
    pub slope: f64,
    pub r2: f64,
    /// The penalty's share of the loss at the first and the last measurement.
    pub share_first: f64,
    pub share_last: f64,
    /// What is left of the last loss without the penalty: the fit to the data.
    pub data_last: f64,
}

/// The loss holds a penalty on the weights (a fact from the framework) and moves with their
/// squared norm, falling as it falls, the penalty being most of it from the first step to
/// the last.
pub(crate) fn dominant_penalty(run: &Run) -> Option<Penalty> {
    let params = run
        .model
        .spec
        .loss
        .as_ref()?
        .penalized_params
        .filter(|&n| n > 0)?;
    let fit = &run.loss_on_weights;
    let line = fit.line(MIN_PAIRS)?;
    let ((s0, l0), (s1, l1)) = (fit.first?, fit.last?);
    let shrinking = s1 < 0.9 * s0 && l1 < l0;
    if !(shrinking && line.slope > 0.0 && line.r2 >= MIN_R2 && l0 > 0.0 && l1 > 0.0) {
        return None;
    }
    let (share_first, share_last) = (line.slope * s0 / l0, line.slope * s1 / l1);
    (share_first >= MIN_SHARE && share_last >= MIN_SHARE).then(|| Penalty {
        params,
        slope: line.slope,
        r2: line.r2,
        share_first: share_first.min(1.0),
        share_last: share_last.min(1.0),
        data_last: (l1 - line.slope * s1).max(0.0),
    })
}

/// A share of the loss in words.
fn share(x: f64) -> String {
    if x >= 0.995 {
        "nearly all".into()
    } else {
        format!("{:.0}%", 100.0 * x)
    }
}

impl CauseRule for OverRegularization {
    fn cause(&self) -> Cause {
        Cause::OverRegularization
    }

    fn phrase(&self) -> &'static str {
        "a weight penalty that outweighs the fit to the data"
    }

    fn explains(&self, failure: Failure) -> bool {
        matches!(failure, Failure::LossPlateau | Failure::VanishingGradients)
    }

    fn always_candidate(&self, _: Failure) -> bool {
        false
    }

    fn evidence(&self, c: &Case<'_>, v: &mut Votes) {
        if let Some(d) = c.ev.decay_outweighs() {
            v.add(
                4.0,
                format!(
                    "the optimizer's weight_decay of {wd} pulls each weight towards 0 with {wd} x its norm, {:.1}x the loss's own gradient at the first steps, and the weights shrank to {:.0}% of their first norm: they shrink faster than the data can grow them",
                    d.pull,
                    100.0 * d.kept,
                    wd = fmt_g(d.weight_decay),
                ),
            );
        }
        if c.e.failure != Failure::LossPlateau {
            return;
        }
        if let Some(p) = dominant_penalty(c.run) {
            let tensors = if p.params == 1 {
                "1 parameter tensor".to_string()
            } else {
                format!("{} parameter tensors", p.params)
            };
            v.proof(
                5.0,
                format!(
                    "the loss adds a penalty on {tensors} and falls in step with their squared norm (loss = {} x the weights' sum of squares{}, r² {:.3}): the penalty is {} of the loss at the first step, so the optimizer shrinks the weights instead of fitting the data",
                    fmt_g(p.slope),
                    if p.data_last > 0.01 * p.slope { format!(" + {}", fmt_g(p.data_last)) } else { String::new() },
                    p.r2,
                    share(p.share_first),
                ),
            );
        }
    }

    fn remedies(&self, c: &RemedyCase<'_>) -> Vec<Remedy> {
        if dominant_penalty(c.run).is_some() {
            return vec![Remedy::LowerWeightPenalty, Remedy::FitWithoutPenalty];
        }
        vec![Remedy::LowerWeightDecay, Remedy::FitWithoutPenalty]
    }

    fn run_facts(&self, run: &Run) -> Facts {
        let mut out = Facts::new();
        let share = dominant_penalty(run).map_or(0.0, |p| p.share_last);
        out.insert("penalty_share".into(), share.into());
        out
    }
}
