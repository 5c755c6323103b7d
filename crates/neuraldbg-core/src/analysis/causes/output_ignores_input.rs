//! `output_ignores_input`: a forward pass that gives every sample the same output. Its input
//! never reaches the output (a mean or a broadcast over the batch dimension, an input
//! overwritten, every sample given the first one's features, a normalization over a single
//! value), so the model can learn only what all samples share: how often each class occurs, the
//! targets' mean. Measured, not inferred: the output's spread across the first batch
//! ([`LossSpec::output_batch_spread`](crate::model::LossSpec)).

use super::super::failures::not_learning;
use super::super::remedy::Remedy;
use super::super::vocab::{Cause, Failure};
use super::evidence::{Evidence, huge_inputs};
use super::{Case, CauseRule, RemedyCase, Votes, fmt_g};
use crate::engine::Run;
use crate::model::ParamRole;

pub(crate) struct OutputIgnoresInput;

/// An output whose spread across the batch is at most this share of its largest magnitude is
/// the same for every sample (rounding apart: identical rows of a matrix product may differ in
/// their last bits). An ordinary network at initialization spreads its outputs by a tenth of
/// their size or more.
const SAME_OUTPUT: f64 = 1e-4;

/// A dead or saturated layer with this share of its units off for the whole batch passes on
/// the same values for every sample.
const WHOLE_LAYER: f64 = 0.99;

/// An output layer whose first weights pass on less than this share of a variance-preserving
/// signal (`std(W)·sqrt(fan_in)`) all but zeroes what reaches it.
const NEAR_ZERO_GAIN: f64 = 1e-2;

/// The first step's output spread across the batch, when every sample got the same output and
/// nothing else measured makes it so by itself:
/// - an output layer whose first weights were (near) zero (initialized to zero, as some recipes
///   do, or far too small) gives every sample its bias until its updates grow it (one without a
///   bias gives every sample zero, and an output of zeros has no spread measured: a zero layer
///   without one whose output was measured is beside another, as `LoRA`'s `lora_B` beside its
///   frozen base, not the output's source);
/// - a stack of bounded activations that pass back little gradient (sigmoids) contracts the
///   samples' differences layer after layer until none is left, and so does a deep stack whose
///   gradients shrink geometrically from the first step (`network_depth`: 30 tanh layers at
///   `PyTorch`'s default initialization leave the output's spread at ~5e-7 of its size), where a
///   lost input leaves the layers before it their gradient;
/// - inputs all of one value are the data's (`bad_input_data`), and inputs on a raw scale
///   saturate a recurrent layer's gates alike for every sample;
/// - an output that does not fit the loss can be constant by itself (a softmax over one unit
///   is 1).
pub(crate) fn same_for_every_sample(run: &Run, ev: &Evidence) -> Option<f64> {
    let model = &run.model;
    let output_layer = model.layers.iter().rposition(|l| l.weight.is_some());
    let zero_output_layer = output_layer.is_some_and(|l| {
        let biased = model.layers[l]
            .params
            .iter()
            .any(|&p| model.spec.params[p].role == ParamRole::Bias);
        biased && run.layers[l].gain_first.is_some_and(|g| g < NEAR_ZERO_GAIN)
    });
    let contracting_stack =
        ev.depth >= super::evidence::DEEP_STACK && ev.geometric_profile(true).is_some();
    let explained = zero_output_layer
        || contracting_stack
        || super::saturating_activation::passes_little_gradient(run)
        || run.data.first_constant.is_some()
        || huge_inputs(run.data.first_scale).is_some()
        || super::output_loss_mismatch::found(run).is_some();
    if explained {
        return None;
    }
    model
        .spec
        .loss
        .as_ref()?
        .output_batch_spread
        .filter(|s| *s <= SAME_OUTPUT)
}

/// Whether the output was measured to vary across the first batch (its inputs reach it).
pub(crate) fn varies_with_input(run: &Run) -> bool {
    run.model
        .spec
        .loss
        .as_ref()
        .and_then(|l| l.output_batch_spread)
        .is_some_and(|s| s > SAME_OUTPUT)
}

impl CauseRule for OutputIgnoresInput {
    fn cause(&self) -> Cause {
        Cause::OutputIgnoresInput
    }

    fn phrase(&self) -> &'static str {
        "a forward pass whose output does not depend on its input"
    }

    fn explains(&self, failure: Failure) -> bool {
        matches!(
            failure,
            Failure::LossPlateau | Failure::VanishingGradients | Failure::DeadNeurons
        )
    }

    fn always_candidate(&self, _: Failure) -> bool {
        false
    }

    fn evidence(&self, c: &Case<'_>, v: &mut Votes) {
        // An output the same for every sample at the first step, and nothing learned since;
        // not where a layer has every unit dead or at its bound for the whole batch (it passes
        // on the same values for every sample by itself).
        let Some(spread) = same_for_every_sample(c.run, c.ev) else {
            return;
        };
        let whole_layer_off = c.episodes.iter().any(|e| {
            matches!(
                e.failure,
                Failure::DeadNeurons | Failure::SaturatedActivations
            ) && e.fraction >= WHOLE_LAYER
        });
        if not_learning(c.run).is_none() || whole_layer_off {
            return;
        }
        let same = if spread > 0.0 {
            format!(
                "the model's output on the first step was the same for every sample of the batch (it varied across the batch by {} of its largest value)",
                fmt_g(spread)
            )
        } else {
            "the model's output on the first step was the same for every sample of the batch, to the last bit".to_string()
        };
        match c.e.failure {
            Failure::LossPlateau => v.proof(
                5.0,
                format!(
                    "{same}: the inputs do not reach the output, so it can learn only what all samples share, and the loss stays where predicting that puts it"
                ),
            ),
            // Layers before the point where the input is lost get no gradient from the
            // first step on (a normalization over one value passes none back).
            Failure::VanishingGradients if Some(c.e.onset) == c.run.first_step => v.proof(
                5.0,
                format!(
                    "{same}: the input is lost on the way, and the layers before that point get no gradient through it"
                ),
            ),
            // Samples that reach a ReLU layer all alike make each unit zero for all of them
            // or for none: about half read as dead for the whole batch.
            Failure::DeadNeurons if c.e.fraction < WHOLE_LAYER => v.proof(
                5.0,
                format!(
                    "{same}: where every sample is alike, a unit is zero for all of them or for none, so about half read as dead for the whole batch"
                ),
            ),
            _ => {}
        }
    }

    fn remedies(&self, _: &RemedyCase<'_>) -> Vec<Remedy> {
        vec![Remedy::FindWhereInputIsLost]
    }
}
