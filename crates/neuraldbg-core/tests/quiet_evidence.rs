#![allow(clippy::unwrap_used)] // a test crate: a failed unwrap is a failed test
//! The evidence that tells quiet causes apart (issue 22), on synthetic observations: an
//! explosion at the start that training absorbs, a classifier confidently wrong from its first
//! step, units that die under steps far too large, and inputs far below a normalized scale.

use neuraldbg_core::analysis::explain;
use neuraldbg_core::{
    CausalHypothesis, Cause, Config, Engine, Failure, LossSpec, Measure, ModelSpec, Observation,
};

#[path = "support/mlp.rs"]
mod mlp;

/// The small MLP of the loop-mistake tests (three 16x16 Linear layers, two `ReLU`s, SGD) with a
/// cross-entropy over ten classes.
fn classifier() -> ModelSpec {
    let mut spec = mlp::spec();
    spec.loss = Some(LossSpec {
        ops: vec!["NllLoss".into(), "LogSoftmax".into()],
        output_op: Some("Addmm".into()),
        output_units: Some(10),
        ..LossSpec::default()
    });
    spec
}

/// One step of healthy statistics: gradient norms, weight norms giving `PyTorch`'s default
/// Linear gain (`std(W) * sqrt(fan_in)` = 2.3 / 16 * 4 ~ 0.58), inputs in [-1, 1], live
/// `ReLU` units, an lr of 0.01; every step measured.
fn healthy(step: u64, loss: f64) -> Observation {
    Observation {
        step,
        grad_norms: vec![0.05, 0.01, 0.04, 0.01, 0.03, 0.01],
        weight_norms: Some(vec![2.3, 0.2, 2.3, 0.2, 2.3, 0.2]),
        activations: Some(vec![1.5, 0.0, 0.1, 0.9, 64.0, 1.5, 0.0, 0.1, 0.9, 64.0]),
        inputs: vec![-1.0, 1.0, 0.0, 0.5],
        loss: Some(loss),
        lr: Some(0.01),
        ..Observation::default()
    }
}

fn diagnose(
    spec: ModelSpec,
    steps: u64,
    obs: impl Fn(u64) -> Observation,
) -> Vec<CausalHypothesis> {
    let mut engine = Engine::new(Config::default()).unwrap();
    engine.register_model(spec).unwrap();
    for step in 0..steps {
        engine.observe(&obs(step).view()).unwrap();
    }
    explain(&engine, None)
}

fn shown(h: &[CausalHypothesis]) -> Vec<String> {
    h.iter().map(ToString::to_string).collect()
}

/// Gradients 10x past the exploding threshold for the first four steps, then ordinary; the
/// loss starts at 2,000 (summed over the batch) and falls 200x.
fn large_start(step: u64) -> Observation {
    let mut o = healthy(step, 2000.0 * (-0.05 * step as f64).exp() + 10.0);
    if step < 4 {
        o.grad_norms = vec![1e4; 6];
    }
    o
}

#[test]
fn an_explosion_at_the_start_that_training_absorbs_is_no_failure() {
    let h = diagnose(classifier(), 200, large_start);
    assert!(
        h.iter()
            .all(|h| h.failure != Failure::ExplodingGradients || h.confidence < 0.5),
        "{:?}",
        shown(&h)
    );
    // The same start, but the run goes non-finite later: the explosion was the beginning.
    let h = diagnose(classifier(), 200, |s| {
        let mut o = large_start(s);
        if s >= 6 {
            o.grad_norms = vec![f32::NAN; 6];
            o.loss = Some(f64::NAN);
        }
        o
    });
    assert!(h[0].confidence >= 0.5, "{:?}", shown(&h));
    assert!(
        h.iter()
            .any(|h| h.failure == Failure::ExplodingGradients && h.confidence >= 0.5),
        "{:?}",
        shown(&h)
    );
}

#[test]
fn a_classifier_confidently_wrong_from_its_first_step_is_not_learning_from_poor_initialization() {
    // ln 10 = 2.30; the loss sits at ~5.8 from the first step; the weights are 8x PyTorch's
    // default scale (gain ~4.6).
    let h = diagnose(classifier(), 200, |s| {
        let mut o = healthy(s, 5.8 + 0.02 * ((s % 3) as f64));
        o.weight_norms = Some(vec![18.4, 0.2, 18.4, 0.2, 18.4, 0.2]);
        o
    });
    let top = &h[0];
    assert_eq!(top.failure, Failure::LossPlateau, "{:?}", shown(&h));
    assert_eq!(top.cause, Cause::PoorInitialization, "{:?}", shown(&h));
    assert!(top.confidence >= 0.5, "{top}");
    assert!(
        top.description.contains("above its chance level"),
        "{}",
        top.description
    );
    assert!(
        top.description.contains("2.5x its chance level"),
        "{}",
        top.description
    );
    // A loss at the chance level itself reads as "at", not "above".
    let h = diagnose(classifier(), 200, |s| {
        healthy(s, 2.31 + 0.01 * ((s % 3) as f64))
    });
    assert!(
        h[0].description.contains(", at its chance level"),
        "{}",
        h[0].description
    );
}

/// Units alive for three steps, then the first `ReLU` layer dead for the rest of the run, with
/// this measured update-to-weight ratio on every step.
fn dying(update: f32) -> Vec<CausalHypothesis> {
    dying_on(update, 1.0, "SGD")
}

/// The same, on inputs reaching magnitude `scale`, under `optimizer`.
fn dying_on(update: f32, scale: f32, optimizer: &str) -> Vec<CausalHypothesis> {
    let mut spec = classifier();
    spec.optimizer = Some(optimizer.into());
    diagnose(spec, 100, |s| {
        let mut o = healthy(s, 2.3 * (-0.001 * s as f64).exp());
        o.inputs = vec![0.0, scale, scale / 2.0, scale / 4.0];
        if s >= 3 {
            o.activations = Some(vec![0.0, 0.0, 1.0, 0.0, 64.0, 1.5, 0.0, 0.1, 0.9, 64.0]);
        }
        o.measures = vec![(Measure::UpdateRatio, vec![update; 6])];
        o
    })
}

fn dead(h: &[CausalHypothesis]) -> &CausalHypothesis {
    h.iter()
        .find(|h| h.failure == Failure::DeadNeurons)
        .unwrap_or_else(|| panic!("{:?}", shown(h)))
}

/// The same steps far too large, under SGD on raw pixels (0..255): a plain gradient step grows
/// with the inputs of the first layer, so the step size is the data's, and the same learning
/// rate trains them normalized. Under Adam the step does not grow with the gradient: it stays
/// the learning rate's.
#[test]
fn units_that_die_under_sgd_steps_grown_by_raw_inputs_are_the_datas_doing() {
    let h = dying_on(0.05, 255.0, "SGD");
    let d = dead(&h);
    assert_eq!(d.cause, Cause::BadInputData, "{:?}", shown(&h));
    assert!(
        d.description.contains(
            "inputs reach magnitude 255 (not normalized): under plain gradient steps the first layer's gradient grows with them, and each step moves the weights by ~0.05 of their size (measured, lr 0.01)"
        ),
        "{}",
        d.description
    );
    let h = dying_on(0.05, 255.0, "Adam");
    assert_eq!(
        dead(&h).cause,
        Cause::LearningRateTooHigh,
        "{:?}",
        shown(&h)
    );
}

#[test]
fn units_that_die_under_steps_far_too_large_are_the_learning_rates_doing() {
    let h = dying(0.05);
    let d = dead(&h);
    assert_eq!(d.cause, Cause::LearningRateTooHigh, "{:?}", shown(&h));
    assert!(
        d.description.contains("(measured, lr 0.01): about 50x"),
        "{}",
        d.description
    );
    // Under steps of an ordinary size the units died of something else.
    let h = dying(3e-3);
    assert_eq!(dead(&h).cause, Cause::DyingRelu, "{:?}", shown(&h));
}

/// A classifier's loss held at its chance level under measured tiny steps, with inputs whose
/// largest magnitude is `scale`.
fn flat_with_inputs(scale: f32) -> Vec<CausalHypothesis> {
    diagnose(classifier(), 200, |s| {
        let mut o = healthy(s, 2.3 + 0.01 * ((s % 3) as f64));
        o.inputs = vec![0.0, scale, scale / 2.0, scale / 4.0];
        o.measures = vec![(Measure::UpdateRatio, vec![3e-5; 6])];
        o
    })
}

#[test]
fn a_plateau_on_inputs_far_below_a_normalized_scale_is_the_datas() {
    let h = flat_with_inputs(0.0039);
    let top = &h[0];
    assert_eq!(top.failure, Failure::LossPlateau, "{:?}", shown(&h));
    assert_eq!(top.cause, Cause::BadInputData, "{:?}", shown(&h));
    assert!(
        top.description.contains("inputs reach only 0.0039"),
        "{}",
        top.description
    );
    // The same plateau on inputs of an ordinary scale: the steps are the learning rate's.
    let h = flat_with_inputs(1.0);
    assert_eq!(h[0].cause, Cause::LearningRateTooLow, "{:?}", shown(&h));
    assert!(
        h.iter().all(|h| h.cause != Cause::BadInputData),
        "{:?}",
        shown(&h)
    );
}

/// Every gradient exactly zero from the first step, under this constant loss.
fn zero_gradients(loss: f64) -> Vec<CausalHypothesis> {
    diagnose(classifier(), 20, |s| {
        let mut o = healthy(s, loss);
        o.grad_norms = vec![0.0; 6];
        o
    })
}

#[test]
fn zero_gradients_at_a_loss_of_exactly_zero_are_a_run_that_starts_converged() {
    let h = zero_gradients(0.0);
    assert!(
        h.iter()
            .all(|h| h.failure != Failure::VanishingGradients || h.confidence < 0.5),
        "{:?}",
        shown(&h)
    );
    // The same gradients under a loss with something left to learn: they vanished.
    let h = zero_gradients(2.3);
    assert!(
        h.iter()
            .any(|h| h.failure == Failure::VanishingGradients && h.confidence >= 0.5),
        "{:?}",
        shown(&h)
    );
}

/// A classifier whose cross-entropy is written out with these operations, its loss held at
/// ln 10 for 60 steps.
fn written_out(ops: &[&str]) -> Vec<CausalHypothesis> {
    let mut spec = classifier();
    spec.loss = Some(LossSpec {
        ops: ops.iter().map(|s| (*s).to_string()).collect(),
        output_op: Some("Addmm".into()),
        output_units: Some(10),
        ..LossSpec::default()
    });
    diagnose(spec, 60, |s| healthy(s, 2.3 + 0.01 * ((s % 3) as f64)))
}

#[test]
fn a_cross_entropy_written_out_has_a_chance_level_unless_summed_over_the_batch() {
    let h = written_out(&["Neg", "Mean", "Sum", "Mul", "LogSoftmax"]);
    assert_eq!(h[0].failure, Failure::LossPlateau, "{:?}", shown(&h));
    assert!(
        h[0].description
            .contains("at its chance level (2.303 = ln 10"),
        "{}",
        h[0].description
    );
    // Summed over the batch (no mean): its level is the batch size times ln 10, not known.
    let h = written_out(&["Neg", "Sum", "Mul", "LogSoftmax"]);
    assert!(
        h.iter().all(|h| !h.description.contains("chance level")),
        "{:?}",
        shown(&h)
    );
}

/// A regression whose loss falls from 3 to 1.2 over 150 steps, healthy otherwise, with `fc0`
/// and `fc1` flagged (or not) as having identical units.
fn symmetric(flagged: bool) -> Vec<CausalHypothesis> {
    let mut spec = mlp::spec();
    spec.loss = Some(LossSpec {
        ops: vec!["MseLoss".into()],
        output_op: Some("Addmm".into()),
        output_units: Some(1),
        target_var: Some(4.0),
        ..LossSpec::default()
    });
    for p in [0, 2] {
        spec.params[p].identical_units = flagged;
    }
    diagnose(spec, 150, |s| {
        healthy(s, 1.2 + 1.8 * (-0.03 * s as f64).exp())
    })
}

#[test]
fn units_with_identical_weights_hold_the_loss_above_its_optimum_from_the_first_step() {
    let h = symmetric(true);
    let top = &h[0];
    assert_eq!(
        (top.failure, top.cause, top.step),
        (Failure::LossPlateau, Cause::PoorInitialization, Some(0)),
        "{:?}",
        shown(&h)
    );
    assert!(top.confidence >= 0.5, "{:?}", shown(&h));
    assert!(
        top.description.contains(
            "all 16 units of `fc0` have the same weights (and so do those of one more layer)"
        ),
        "{}",
        top.description
    );
    assert!(
        top.remedies[0].starts_with("initialize the weights of `fc0` randomly"),
        "{:?}",
        top.remedies
    );
    // The same run without the fact: a loss that falls and settles is no failure.
    let h = symmetric(false);
    assert!(h.iter().all(|h| h.confidence < 0.5), "{:?}", shown(&h));
}

/// Eight 16x16 Linear layers with `ReLU`s between them (and a parameter-free `LayerNorm` after
/// the first when `norm`), Adam, cross-entropy over ten classes; the loss at its chance level
/// for 60 steps, inputs in [-1, 1], weights at He scale (`std(W) * sqrt(16)` = 1.41), each
/// step moving them by the measured `update` of their size.
fn deep_at_chance(norm: bool, update: f32) -> Vec<CausalHypothesis> {
    at_chance(8, norm, update)
}

/// [`deep_at_chance`] with `layers` Linear layers.
fn at_chance(layers: usize, norm: bool, update: f32) -> Vec<CausalHypothesis> {
    at_chance_with(layers, norm, update, None, "ReLU", |_| {})
}

/// [`at_chance`] with the first batch's output spread across the batch
/// (`LossSpec::output_batch_spread`), `act` between the layers, each step's observation changed
/// by `tweak`.
fn at_chance_with(
    layers: usize,
    norm: bool,
    update: f32,
    spread: Option<f64>,
    act: &str,
    tweak: impl Fn(&mut Observation),
) -> Vec<CausalHypothesis> {
    let mut spec = ModelSpec::default();
    for i in 0..layers {
        let m = spec.module(format!("fc{i}"), "Linear");
        spec.param(m, format!("fc{i}.weight"), &[16, 16]);
        spec.param(m, format!("fc{i}.bias"), &[16]);
        if i == 0 && norm {
            spec.module("norm", "LayerNorm");
        }
        if i + 1 < layers {
            spec.module(format!("act{i}"), act);
        }
    }
    spec.module("", "Net");
    spec.optimizer = Some("Adam".into());
    spec.loss = classifier().loss;
    if let Some(loss) = spec.loss.as_mut() {
        loss.output_batch_spread = spread;
    }
    diagnose(spec, 60, |s| {
        let mut o = healthy(s, 2.3 + 0.01 * ((s % 3) as f64));
        o.grad_norms = [0.03, 0.01].repeat(layers);
        o.weight_norms = Some([5.66, 0.2].repeat(layers));
        o.activations = Some([1.5, 0.0, 0.1, 0.9, 64.0].repeat(layers - 1));
        o.lr = Some(1e-3);
        o.measures = vec![(Measure::UpdateRatio, vec![update; 2 * layers])];
        tweak(&mut o);
        o
    })
}

#[test]
fn a_deep_stack_without_normalization_that_does_not_learn_for_no_other_reason() {
    let h = deep_at_chance(false, 1.2e-3);
    let top = &h[0];
    assert_eq!(
        (top.failure, top.cause),
        (Failure::LossPlateau, Cause::MissingNormalization),
        "{:?}",
        shown(&h)
    );
    assert!(top.confidence >= 0.5, "{top}");
    assert!(
        top.description
            .contains("8 weighted layers with no normalization layer between them do not learn"),
        "{}",
        top.description
    );
    // With a normalization layer, or with steps far too small to train, it is not the cause.
    for h in [deep_at_chance(true, 1.2e-3), deep_at_chance(false, 1e-5)] {
        assert!(
            h.iter().all(|h| h.cause != Cause::MissingNormalization),
            "{:?}",
            shown(&h)
        );
    }
}

#[test]
fn a_shallow_model_that_learns_nothing_though_everything_measured_works_has_unrelated_targets() {
    let h = at_chance(3, false, 1.2e-3);
    let top = &h[0];
    assert_eq!(
        (top.failure, top.cause),
        (Failure::LossPlateau, Cause::BadInputData),
        "{:?}",
        shown(&h)
    );
    assert!(top.confidence >= 0.5, "{top}");
    assert!(
        top.description
            .contains("each step moves them by 0.0012 of their size as training steps do"),
        "{}",
        top.description
    );
    assert!(
        top.remedies[0].contains("one permutation"),
        "{:?}",
        top.remedies
    );
    // Steps of 2e-2, as small networks under Adam train with, under a loss that does not
    // bounce: still the targets.
    let h = at_chance(3, false, 2e-2);
    assert_eq!(h[0].cause, Cause::BadInputData, "{:?}", shown(&h));
    // With steps too small to train, the steps are why; with steps far too large, not the
    // targets either.
    for update in [1e-5, 2e-4, 0.5] {
        let h = at_chance(3, false, update);
        assert!(
            h.iter().all(|h| h.cause != Cause::BadInputData),
            "{update}: {:?}",
            shown(&h)
        );
    }
}

#[test]
fn a_model_whose_output_was_the_same_for_every_sample_ignores_its_input() {
    let same = |spread: f64, tweak: fn(&mut Observation)| {
        at_chance_with(3, false, 1.2e-3, Some(spread), "ReLU", tweak)
    };
    // The first batch's output identical across the batch, and nothing learned: the forward
    // pass loses the input, whatever else looks healthy.
    for spread in [0.0, 3e-7] {
        let h = same(spread, |_| {});
        let top = &h[0];
        assert_eq!(
            (top.failure, top.cause),
            (Failure::LossPlateau, Cause::OutputIgnoresInput),
            "{spread}: {:?}",
            shown(&h)
        );
        assert!(top.confidence >= 0.7, "{top}");
        assert!(
            top.description
                .contains("the same for every sample of the batch"),
            "{}",
            top.description
        );
        assert!(
            top.remedies[0].contains("model(x[:4])"),
            "{:?}",
            top.remedies
        );
        assert!(
            h.iter().all(|h| h.cause != Cause::BadInputData),
            "{:?}",
            shown(&h)
        );
    }
    // Samples all alike at a ReLU layer: about half its units read as dead for the batch,
    // which the lost input explains.
    let h = same(0.0, |o| {
        o.activations = Some([1.5, 0.0, 0.5, 0.9, 64.0].repeat(2));
    });
    let dead = h.iter().find(|h| h.failure == Failure::DeadNeurons);
    assert!(
        dead.is_some_and(|d| d.cause == Cause::OutputIgnoresInput),
        "{:?}",
        shown(&h)
    );
    // An output that varied across the batch: the targets, and the sentence says the inputs
    // reach the output; unmeasured, both possibilities.
    let h = same(0.4, |_| {});
    assert_eq!(h[0].cause, Cause::BadInputData, "{:?}", shown(&h));
    assert!(
        h[0].description.contains("(they reach the output")
            && !h[0].description.contains("do not reach"),
        "{}",
        h[0].description
    );
    let h = at_chance(3, false, 1.2e-3);
    assert!(
        h[0].description
            .contains("or inputs that do not reach the output"),
        "{}",
        h[0].description
    );
    // What makes an output constant by itself is not the forward pass' doing: a last layer
    // whose weights start at zero (its initialization), inputs on a raw scale (they saturate
    // alike), a stack of sigmoids passing back a fifth of the gradient (it contracts the
    // samples' differences away).
    let zero_head: fn(&mut Observation) = |o| {
        if let Some(w) = o.weight_norms.as_mut() {
            w[4] = 0.0;
        }
    };
    let raw: fn(&mut Observation) = |o| o.inputs = vec![0.0, 255.0, 120.0, 60.0];
    // Inputs that are all 0: the data gives the model nothing to tell samples apart by.
    let h = same(0.0, |o| o.inputs = vec![0.0, 0.0, 0.0, 0.0]);
    assert_eq!(
        (h[0].failure, h[0].cause),
        (Failure::LossPlateau, Cause::BadInputData),
        "{:?}",
        shown(&h)
    );
    assert!(
        h[0].description
            .contains("every input value of the first batch is 0"),
        "{}",
        h[0].description
    );
    // ... and every ReLU unit dead from the first step (biases at zero, as Keras starts them)
    // is the data's doing too, not dying units'.
    let h = same(0.0, |o| {
        o.inputs = vec![0.0, 0.0, 0.0, 0.0];
        o.activations = Some([0.0, 0.0, 1.0, 0.0, 64.0].repeat(2));
    });
    let dead = h.iter().find(|h| h.failure == Failure::DeadNeurons);
    assert!(
        dead.is_some_and(|d| d.cause == Cause::BadInputData),
        "{:?}",
        shown(&h)
    );
    for (what, tweak) in [("zero head", zero_head), ("raw inputs", raw)] {
        let h = same(0.0, tweak);
        assert!(
            h.iter().all(|h| h.cause != Cause::OutputIgnoresInput),
            "{what}: {:?}",
            shown(&h)
        );
    }
    let h = at_chance_with(3, false, 1.2e-3, Some(0.0), "Sigmoid", |o| {
        o.activations = Some([0.9, 0.0, f32::NAN, 0.2, 64.0].repeat(2));
    });
    assert!(
        h.iter().all(|h| h.cause != Cause::OutputIgnoresInput),
        "sigmoids: {:?}",
        shown(&h)
    );
}

/// A classifier's loss at its chance level from the first step, bouncing by 20% of it on every
/// step (what steps that overshoot do); the learning rate cut 10x every 40 steps from step 60 (a
/// scheduler that reacts to the plateau, `ReduceLROnPlateau`) when `cut`, else held at 0.01.
fn bouncing_at_chance(cut: bool) -> Vec<CausalHypothesis> {
    diagnose(classifier(), 200, |step| {
        let swing = if step % 2 == 0 { 0.92 } else { 1.12 };
        let mut o = healthy(step, 10f64.ln() * swing);
        if cut && step >= 60 {
            o.lr = Some(0.01 * 0.1f64.powi(1 + (step as i32 - 60) / 40));
        }
        o
    })
}

#[test]
fn a_plateau_that_outlasts_a_learning_rate_cut_is_not_the_learning_rates() {
    // Held at 0.01, a loss that reverses on every step is the steps overshooting.
    let held = bouncing_at_chance(false);
    assert_eq!(held[0].failure, Failure::LossPlateau, "{:?}", shown(&held));
    assert_eq!(
        held[0].cause,
        Cause::LearningRateTooHigh,
        "{:?}",
        shown(&held)
    );
    // Cut 10x from step 60, and 10,000x by the end, the loss did not move: not the steps'
    // size, too high or (a cut that followed the plateau) too low.
    let cut = bouncing_at_chance(true);
    let plateau = cut
        .iter()
        .find(|h| h.failure == Failure::LossPlateau)
        .unwrap();
    assert!(
        plateau.description.contains(
            "cutting the learning rate from 0.01 to 1.00e-6 (first at step 60) did not move it"
        ),
        "{:?}",
        shown(&cut)
    );
    for h in cut.iter().filter(|h| h.failure == Failure::LossPlateau) {
        assert!(
            !(h.cause == Cause::LearningRateTooHigh && h.confidence >= 0.2),
            "{:?}",
            shown(&cut)
        );
        assert!(
            !h.description.contains("below a thousandth of its peak"),
            "{:?}",
            shown(&cut)
        );
    }
}

/// The first layer's gradient at 1e-9 for its first `zero_for` steps (an adapter whose
/// zero-initialized other half has not moved yet), then healthy; the loss creeps 40% lower over
/// 150 steps; each step moves the weights by `update` of their size.
fn late_adapter(zero_for: u64, update: f32) -> Vec<CausalHypothesis> {
    diagnose(classifier(), 150, |s| {
        let mut o = healthy(s, 2.3 * (1.0 - 0.4 * s as f64 / 150.0));
        if s < zero_for {
            o.grad_norms[0] = 1e-9;
            o.grad_norms[1] = 1e-9;
        }
        o.measures = vec![(Measure::UpdateRatio, vec![update; 6])];
        o
    })
}

#[test]
fn an_adapters_zero_start_prolonged_by_steps_far_too_small_is_a_beginning_not_vanishing() {
    // Steps 1e5x too small keep the other half at zero for 34 steps: still the adapter's
    // beginning; the run's finding is the learning rate.
    let slow = late_adapter(34, 1e-8);
    assert!(
        slow.iter()
            .all(|h| h.failure != Failure::VanishingGradients || h.confidence < 0.3),
        "{:?}",
        shown(&slow)
    );
    assert_eq!(
        (slow[0].failure, slow[0].cause),
        (Failure::LossPlateau, Cause::LearningRateTooLow),
        "{:?}",
        shown(&slow)
    );
    // Under steps of a training size the same 34 steps of no gradient are no beginning.
    let trained = late_adapter(34, 1e-3);
    assert!(
        trained
            .iter()
            .any(|h| h.failure == Failure::VanishingGradients && h.confidence >= 0.3),
        "{:?}",
        shown(&trained)
    );
}

/// Three Linear layers at chance, the output the same for every sample (spread 0), the last
/// layer's weights zero at the first step (growing from there); `biased`: whether that layer
/// has a bias.
fn zero_last_layer(biased: bool) -> Vec<CausalHypothesis> {
    let mut spec = ModelSpec::default();
    for i in 0..3 {
        let m = spec.module(format!("fc{i}"), "Linear");
        spec.param(m, format!("fc{i}.weight"), &[16, 16]);
        if i < 2 || biased {
            spec.param(m, format!("fc{i}.bias"), &[16]);
        }
        if i < 2 {
            spec.module(format!("act{i}"), "ReLU");
        }
    }
    spec.module("", "Net");
    spec.optimizer = Some("Adam".into());
    spec.loss = classifier().loss;
    if let Some(loss) = spec.loss.as_mut() {
        loss.output_batch_spread = Some(0.0);
    }
    let n = if biased { 6 } else { 5 };
    diagnose(spec, 60, |s| {
        let mut o = healthy(s, 2.3 + 0.01 * ((s % 3) as f64));
        o.grad_norms = [0.03, 0.01, 0.03, 0.01, 0.03, 0.01][..n].to_vec();
        let (w, last) = (5.66 + 1e-3 * s as f32, 0.01 * s as f32);
        o.weight_norms = Some([w, 0.2, w, 0.2, last, 0.2][..n].to_vec());
        o.activations = Some([1.5, 0.0, 0.1, 0.9, 64.0].repeat(2));
        o.lr = Some(1e-3);
        o.measures = vec![(Measure::UpdateRatio, vec![1.2e-3; n])];
        o
    })
}

#[test]
fn a_zero_layer_without_a_bias_is_beside_the_output_not_its_source() {
    // With a bias, a zero last layer gives every sample its bias: that is why the output was
    // the same, not a lost input.
    let head = zero_last_layer(true);
    assert!(
        head.iter().all(|h| h.cause != Cause::OutputIgnoresInput),
        "{:?}",
        shown(&head)
    );
    // Without one it gives every sample zero, and an output of zeros has no spread measured:
    // the measured output came from beside it (LoRA's `lora_B` beside its frozen base), so the
    // same output for every sample is the forward pass's.
    let beside = zero_last_layer(false);
    assert_eq!(
        (beside[0].failure, beside[0].cause),
        (Failure::LossPlateau, Cause::OutputIgnoresInput),
        "{:?}",
        shown(&beside)
    );
}
