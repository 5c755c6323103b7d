//! `saturated_activations`: bounded activations (tanh, sigmoid) with most outputs at their
//! bounds. Located at the first module in forward order that shows it.

use crate::engine::Run;
use crate::event::SemanticEvent;

use super::super::episodes::Episode;
use super::super::vocab::Failure;
use super::{FailureRule, Link, after_bad_data, more_of_the_same, persistence, sigmoid};

pub(crate) struct SaturatedActivations;

/// A loss that ended at this share of its start or below has learned.
const LEARNED_SHARE: f64 = 0.2;
/// What a saturation beside such a loss is at most: a warning.
const LEARNED_CAP: f64 = 0.4;

impl FailureRule for SaturatedActivations {
    fn failure(&self) -> Failure {
        Failure::SaturatedActivations
    }

    fn precedence(&self) -> u8 {
        4
    }

    fn locate(
        &self,
        run: &Run,
        events: &[SemanticEvent],
        cluster: &[usize],
        _onset: u64,
    ) -> (Option<usize>, Option<usize>) {
        super::dead_neurons::forward_root(run, events, cluster, |t| t.max_saturated)
    }

    fn probability(&self, run: &Run, e: &Episode) -> f64 {
        if e.root.is_some_and(|m| confident_output(run, m)) {
            return 0.0;
        }
        let t = 0.5;
        // Severity: the share of saturated outputs, or how little gradient the activation
        // still passes back (1 - 2 x mean slope), whichever is worse.
        let slope = e
            .root
            .and_then(|m| run.model.module_activation[m])
            .map_or(f64::NAN, |a| run.acts[a].min_slope);
        let by_slope = if slope.is_finite() {
            (1.0 - 2.0 * slope).clamp(0.0, 1.0)
        } else {
            0.0
        };
        let base = ((e.fraction - t) / (1.0 - t)).clamp(0.0, 1.0).max(by_slope);
        let p = sigmoid(6.0 * (base - 0.5)) * persistence(e);
        // Units at their bounds while the loss fell to a fifth of its first value (not of a
        // jump in the first steps) and is off its chance level: the network learns around
        // them, a warning rather than a failure that stops training.
        let learned = run
            .loss
            .first_value()
            .is_some_and(|i| i > 0.0 && run.loss.last_smoothed <= LEARNED_SHARE * i)
            && super::not_learning(run).is_none();
        if learned { p.min(LEARNED_CAP) } else { p }
    }

    fn follows_from(&self, a: &Episode, e: &Episode, l: &Link<'_>) -> bool {
        after_bad_data(a, e, l)
            || match a.failure {
                // Saturation is the mechanism of the vanishing it precedes: the vanishing is the
                // failure users see, so the saturation episode ranks under it.
                Failure::VanishingGradients => e.onset <= a.onset + l.tol,
                _ => more_of_the_same(a, e),
            }
    }
}

/// Module `m` is the model's output activation, under a loss that takes its log: a sigmoid
/// under a binary cross-entropy of probabilities, a softmax under the log of a negative
/// log-likelihood or cross-entropy. The loss's gradient at the logits is then the error itself
/// (p - y) whatever the activation's slope, so outputs at its bounds are confident predictions,
/// not a saturation that stops learning.
fn confident_output(run: &Run, m: usize) -> bool {
    let model = &run.model;
    let (Some(loss), Some(a)) = (model.spec.loss.as_ref(), model.module_activation[m]) else {
        return false;
    };
    let kind = model.activations[a].kind.as_str();
    let has = |op: &str| loss.ops.iter().any(|o| o == op);
    let last = model.activations.last().is_some_and(|l| l.module == m)
        && model.layers.iter().all(|l| l.module < m);
    let cancels = match kind {
        "Sigmoid" => has("BinaryCrossEntropy"),
        "Softmax" => has("Log") && !has("LogSoftmax"),
        _ => false,
    };
    last && cancels && loss.output_op.as_deref() == Some(kind)
}
