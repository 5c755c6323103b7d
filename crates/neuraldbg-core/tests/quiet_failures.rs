#![allow(clippy::unwrap_used)] // a test crate: a failed unwrap is a failed test
//! Runs that train badly without blowing up (issue 22), on synthetic observations: steps too
//! small to train (the measured update-to-weight ratio), a loss held at the level of a constant
//! prediction, and an output that does not fit the loss while the loss still falls.

use neuraldbg_core::analysis::explain;
use neuraldbg_core::{
    CausalHypothesis, Cause, Config, Engine, Failure, LossSpec, Measure, ModelSpec, Observation,
};

#[path = "support/mlp.rs"]
mod mlp;

/// The small MLP of the loop-mistake tests, with this loss description.
fn spec(loss: Option<LossSpec>) -> ModelSpec {
    let mut spec = mlp::spec();
    spec.loss = loss;
    spec
}

/// A mean squared error on an unbounded output whose first targets have this variance.
fn mse(target_var: f64) -> LossSpec {
    LossSpec {
        ops: vec!["MseLoss".into()],
        output_op: Some("Addmm".into()),
        output_units: Some(1),
        target_var: Some(target_var),
        ..LossSpec::default()
    }
}

/// Healthy gradients and weights; `update`: the measured update-to-weight ratio of every
/// parameter on the sampled steps (the first five, then every tenth), or none measured.
fn run(
    spec: ModelSpec,
    steps: u64,
    update: Option<f32>,
    loss: impl Fn(u64) -> f64,
) -> Vec<CausalHypothesis> {
    run_scaled(spec, steps, update, 1.0, loss)
}

/// [`run`] with the weights' norms `scale` times theirs.
fn run_scaled(
    spec: ModelSpec,
    steps: u64,
    update: Option<f32>,
    scale: f32,
    loss: impl Fn(u64) -> f64,
) -> Vec<CausalHypothesis> {
    run_full(spec, steps, update, scale, |_| 1e-4, loss)
}

/// [`run_scaled`] with the learning rate `lr(step)`.
fn run_full(
    spec: ModelSpec,
    steps: u64,
    update: Option<f32>,
    scale: f32,
    lr: impl Fn(u64) -> f64,
    loss: impl Fn(u64) -> f64,
) -> Vec<CausalHypothesis> {
    let mut engine = Engine::new(Config::default()).unwrap();
    engine.register_model(spec).unwrap();
    for step in 0..steps {
        let sampled = step < 5 || step % 10 == 0;
        let obs = Observation {
            step,
            grad_norms: vec![0.05, 0.01, 0.04, 0.01, 0.03, 0.01],
            weight_norms: sampled
                .then(|| [2.3, 0.2, 2.3, 0.2, 2.3, 0.2].map(|w| w * scale).to_vec()),
            loss: Some(loss(step)),
            lr: Some(lr(step)),
            measures: match (sampled, update) {
                (true, Some(r)) => vec![(Measure::UpdateRatio, vec![r; 6])],
                _ => Vec::new(),
            },
            ..Observation::default()
        };
        engine.observe(&obs.view()).unwrap();
    }
    explain(&engine, None)
}

/// A loss that falls by about 40% over 200 steps, slowly, with a little noise.
fn creeping(step: u64) -> f64 {
    2.3 * (1.0 - 0.4 * (step as f64 / 200.0)) + 0.01 * ((step % 3) as f64)
}

fn shown(h: &[CausalHypothesis]) -> Vec<String> {
    h.iter().map(ToString::to_string).collect()
}

/// The top hypothesis is `failure <- cause` at 0.5 or above, its sentence holds `words` and
/// its first remedy holds `remedy`.
fn assert_top(h: &[CausalHypothesis], failure: Failure, cause: Cause, words: &str, remedy: &str) {
    let top = &h[0];
    assert_eq!((top.failure, top.cause), (failure, cause), "{:?}", shown(h));
    assert!(top.confidence >= 0.5, "{top}");
    assert!(top.description.contains(words), "{}", top.description);
    assert!(top.remedies[0].contains(remedy), "{:?}", top.remedies);
}

/// No hypothesis blames the learning rate being too low above a trace (0.2).
fn not_the_learning_rate_too_low(h: &[CausalHypothesis]) {
    assert!(
        h.iter()
            .all(|h| h.cause != Cause::LearningRateTooLow || h.confidence < 0.2),
        "{:?}",
        shown(h)
    );
}

#[test]
fn a_creeping_loss_under_measured_tiny_steps_is_a_learning_rate_too_low() {
    let h = run(spec(None), 200, Some(3e-5), creeping);
    let top = &h[0];
    assert_eq!(top.failure, Failure::LossPlateau, "{:?}", shown(&h));
    assert_eq!(top.cause, Cause::LearningRateTooLow, "{top}");
    assert!(top.confidence >= 0.5, "{top}");
    assert_eq!(top.step, Some(0), "{top}");
    assert!(top.description.contains("creeping"), "{}", top.description);
    assert!(top.description.contains("(measured"), "{}", top.description);
}

#[test]
fn the_same_loss_under_steps_of_a_training_size_is_no_failure() {
    // The loss curve alone does not make the finding: steps of ~1e-3 of the weights train.
    let h = run(spec(None), 200, Some(2e-3), creeping);
    assert!(h.iter().all(|h| h.confidence < 0.5), "{:?}", shown(&h));
    // Nor do tiny steps under a loss that fell by more than two thirds (a converged run).
    let h = run(spec(None), 200, Some(3e-5), |s| {
        2.3 * (-0.02 * s as f64).exp() + 0.01
    });
    assert!(
        h.iter()
            .all(|h| h.confidence < 0.5 || h.cause != Cause::LearningRateTooLow),
        "{:?}",
        shown(&h)
    );
}

#[test]
fn a_regression_loss_held_at_the_targets_variance_is_not_learning() {
    let loss = mse(4.0);
    let h = run(spec(Some(loss)), 200, None, |s| {
        4.0 + 0.02 * ((s % 5) as f64)
    });
    let top = &h[0];
    assert_eq!(top.failure, Failure::LossPlateau, "{:?}", shown(&h));
    assert!(
        top.description.contains("variance of its targets"),
        "{}",
        top.description
    );
}

fn mismatched(ops: &[&str], output: &str) -> ModelSpec {
    spec(Some(LossSpec {
        ops: ops.iter().map(|s| (*s).to_string()).collect(),
        output_op: Some(output.into()),
        output_units: Some(10),
        ..LossSpec::default()
    }))
}

#[test]
fn an_output_that_does_not_fit_the_loss_is_a_finding_from_the_first_step_while_the_loss_falls() {
    for (ops, output, says) in [
        (
            &["NllLoss", "LogSoftmax"][..],
            "Softmax",
            "log-softmax again",
        ),
        (&["NllLoss", "LogSoftmax"][..], "Relu", "cut to 0"),
        (
            &["Mean", "Neg", "Sum", "Mul", "LogSoftmax", "Softmax"][..],
            "Addmm",
            "log-softmax again",
        ),
        (
            &["Mean", "Neg", "Sum", "Mul", "Log", "Clamp"][..],
            "Addmm",
            "takes the log",
        ),
    ] {
        // Falling all along: no plateau of its own, and nothing else wrong.
        let h = run(mismatched(ops, output), 200, Some(2e-3), |s| {
            2.3 * (-0.005 * s as f64).exp()
        });
        let top = &h[0];
        assert_eq!(
            top.cause,
            Cause::OutputLossMismatch,
            "{output}: {:?}",
            shown(&h)
        );
        assert_eq!(top.step, Some(0), "{top}");
        assert!(top.confidence >= 0.5, "{top}");
        assert!(top.description.contains(says), "{}", top.description);
    }
}

#[test]
fn a_log_of_probabilities_or_a_regression_is_no_mismatch() {
    for (ops, output) in [
        (
            &["Mean", "Neg", "Sum", "Mul", "Log", "Clamp"][..],
            "Softmax",
        ),
        (&["Mean", "Neg", "Sum", "Mul", "Log"][..], "Sigmoid"),
        // The softmax written into the loss, between the log and the logits.
        (
            &["Sum", "Mean", "Neg", "Mul", "Log", "Clamp", "Softmax"][..],
            "Addmm",
        ),
        (&["NllLoss", "LogSoftmax"][..], "Addmm"),
    ] {
        let h = run(mismatched(ops, output), 200, Some(2e-3), |s| {
            2.3 * (-0.005 * s as f64).exp()
        });
        assert!(
            h.iter().all(|h| h.cause != Cause::OutputLossMismatch),
            "{output}: {:?}",
            shown(&h)
        );
    }
}

#[test]
fn a_noisy_regression_loss_that_never_gets_below_its_targets_variance_is_not_learning() {
    // The variance of the first batch's targets overestimates the data's (5.97 vs ~5.1), and
    // the loss is too noisy to count as flat: it still never gets clearly below the level.
    let loss = mse(5.97);
    let h = run(spec(Some(loss)), 200, None, |s| {
        5.1 + 0.8 * (((s * 7919) % 11) as f64 / 5.0 - 1.0)
    });
    let top = &h[0];
    assert_eq!(top.failure, Failure::LossPlateau, "{:?}", shown(&h));
    assert!(
        top.description.contains("variance of its targets"),
        "{}",
        top.description
    );
}

#[test]
fn a_loss_at_its_targets_variance_under_steps_a_few_times_too_small_is_a_learning_rate_too_low() {
    // Steps of 2.5e-4 of the weights: four times less than a training step, not ten. With the
    // model not learning, that leans on the learning rate; steps of a training size do not.
    let flat = |s: u64| 4.0 + 0.02 * ((s % 5) as f64);
    let h = run(spec(Some(mse(4.0))), 200, Some(2.5e-4), flat);
    let top = &h[0];
    assert_eq!(top.failure, Failure::LossPlateau, "{:?}", shown(&h));
    assert_eq!(top.cause, Cause::LearningRateTooLow, "{:?}", shown(&h));
    assert!(
        top.description.contains("about 4x less"),
        "{}",
        top.description
    );
    let h = run(spec(Some(mse(4.0))), 200, Some(2e-3), flat);
    assert_eq!(h[0].failure, Failure::LossPlateau, "{:?}", shown(&h));
    not_the_learning_rate_too_low(&h);
}

#[test]
fn small_steps_beside_weights_far_too_large_do_not_say_the_learning_rate_is_too_low() {
    // The same flat loss and ratio, with weights 20x a variance-preserving scale: the steps
    // are small because the weights are large, so the ratio is no evidence about the rate.
    let flat = |s: u64| 4.0 + 0.02 * ((s % 5) as f64);
    let h = run_scaled(spec(Some(mse(4.0))), 200, Some(2.5e-4), 20.0, flat);
    assert!(
        h.iter()
            .all(|h| !h.description.contains("of their size (measured")),
        "{:?}",
        shown(&h)
    );
    assert_ne!(h[0].cause, Cause::LearningRateTooLow, "{:?}", shown(&h));
}

/// A regression loss that falls from 3x its targets' variance (4) for 100 steps, then stays at
/// `end` times it.
fn down_to(end: f64) -> impl Fn(u64) -> f64 {
    move |s: u64| {
        let t = (s.min(100) as f64) / 100.0;
        4.0 * (3.0 + (end - 3.0) * t) + 0.02 * ((s % 5) as f64)
    }
}

#[test]
fn a_regression_that_ends_worse_than_its_targets_mean_is_not_learning_however_it_got_there() {
    // Flat for the last half only, at twice the variance: worse than predicting the mean.
    // With weights 10x a variance-preserving scale and a first loss at 3x the variance (before
    // any update), that is the initialization's doing.
    let h = run_scaled(spec(Some(mse(4.0))), 200, Some(2e-3), 10.0, down_to(2.0));
    let top = &h[0];
    assert_eq!(top.failure, Failure::LossPlateau, "{:?}", shown(&h));
    assert!(
        top.description.contains(
            "at 2.0x the variance of its targets (4): the model predicts worse than their mean"
        ),
        "{}",
        top.description
    );
    assert_eq!(top.cause, Cause::PoorInitialization, "{:?}", shown(&h));
    assert!(top.confidence >= 0.5, "{top}");
    assert!(
        top.description.contains(
            "the loss starts at 12, 3.0x the variance of its targets (4), before any update"
        ),
        "{}",
        top.description
    );
    // Ordinarily scaled weights: the same plateau, not blamed on them.
    let h = run(spec(Some(mse(4.0))), 200, Some(2e-3), down_to(2.0));
    assert_eq!(h[0].failure, Failure::LossPlateau, "{:?}", shown(&h));
    assert!(
        h.iter()
            .all(|h| h.cause != Cause::PoorInitialization || h.confidence < 0.2),
        "{:?}",
        shown(&h)
    );
    // A regression that got to half its targets' variance and stayed there learned a
    // little: no finding, whatever the weights.
    let h = run_scaled(spec(Some(mse(4.0))), 200, Some(2e-3), 10.0, down_to(0.5));
    assert!(h.iter().all(|h| h.confidence < 0.5), "{:?}", shown(&h));
}

/// 2.3 -> ~1.9 in 200 steps, in a straight line, with a little noise.
fn straight_line(s: u64) -> f64 {
    2.3 - 0.002 * s as f64 + 0.005 * ((s % 3) as f64)
}

/// Healthy gradients and weights, steps of a training size, the learning rate `lr(step)`.
fn run_lr(steps: u64, lr: impl Fn(u64) -> f64, loss: impl Fn(u64) -> f64) -> Vec<CausalHypothesis> {
    run_full(spec(None), steps, Some(2e-3), 1.0, lr, loss)
}

#[test]
fn a_loss_still_falling_as_fast_as_it_began_under_large_steps_is_not_the_learning_rate_too_low() {
    // The straight line, with every step moving the weights by 1e-2 of their size (ten
    // training steps): slow, but not for want of step size.
    let h = run_full(spec(None), 200, Some(1e-2), 1.0, |_| 1e-4, straight_line);
    not_the_learning_rate_too_low(&h);
}

#[test]
fn a_loss_still_falling_as_fast_as_it_began_far_from_where_it_started_is_a_learning_rate_too_low() {
    // 2.3 -> ~1.9 in 200 steps, in a straight line: 17% lower, and the second half fell as
    // much as the first.
    let h = run_lr(200, |_| 1e-4, straight_line);
    let top = &h[0];
    assert_eq!(top.failure, Failure::LossPlateau, "{:?}", shown(&h));
    assert_eq!(top.cause, Cause::LearningRateTooLow, "{:?}", shown(&h));
    assert!(
        top.description.contains(
            "creeping: at best 17% lower after 200 steps, and still falling as fast as it began"
        ),
        "{}",
        top.description
    );
    assert!(
        top.description.contains("over the first half")
            && top.description.contains("over the second"),
        "{}",
        top.description
    );
    // The same fall, levelling off (most of it in the first half): flat at 83% of where it
    // began, a plateau, but not one still falling, and nothing says the learning rate.
    let levelling = |s: u64| 1.9 + 0.4 * (-(s as f64) / 30.0).exp() + 0.005 * ((s % 3) as f64);
    let h = run_lr(200, |_| 1e-4, levelling);
    assert!(
        h.iter()
            .all(|h| h.cause != Cause::LearningRateTooLow
                && !h.description.contains("still falling")),
        "{:?}",
        shown(&h)
    );
    // The straight line under a learning rate still warming up (10x over the run): a slow
    // start is what a warmup makes.
    let h = run_lr(
        200,
        |s| 1e-5 * (1.0 + 9.0 * s as f64 / 200.0),
        straight_line,
    );
    assert!(
        h.iter().all(|h| h.failure != Failure::LossPlateau),
        "{:?}",
        shown(&h)
    );
}

/// A step schedule that cuts the rate 10x every 30 steps, from 0.1: a per-epoch scheduler
/// stepped every batch. Below a hundredth of its peak from step 90, a thousandth from 120.
fn cut_every_30_steps(step: u64) -> f64 {
    0.1 * 0.1f64.powi(i32::try_from(step / 30).unwrap())
}

/// A loss that falls from 2.3 towards 0.5 until step `until`, then stays where it got to, with
/// a little noise.
fn falls_until(until: u64) -> impl Fn(u64) -> f64 {
    move |step| {
        let t = step.min(until) as f64;
        0.5 + 1.8 * (-t / 40.0).exp() + 0.01 * ((step % 3) as f64)
    }
}

#[test]
fn a_loss_frozen_where_the_schedule_took_the_rate_away_is_a_plateau_of_the_schedule() {
    // Still falling when the rate reached a hundredth of its peak (step 90), flat from there,
    // at ~0.9: far from the ~0.5 it was heading for.
    let h = run_full(
        spec(None),
        400,
        None,
        1.0,
        cut_every_30_steps,
        falls_until(90),
    );
    let top = &h[0];
    assert_eq!(top.failure, Failure::LossPlateau, "{:?}", shown(&h));
    assert_eq!(top.cause, Cause::LearningRateTooLow, "{top}");
    assert!(top.confidence >= 0.5, "{top}");
    assert_eq!(top.step, Some(90), "{top}");
    for words in [
        "frozen: it was still falling",
        "below a thousandth of its peak from step 120 on: a schedule that decays it far too fast",
    ] {
        assert!(top.description.contains(words), "{}", top.description);
    }
}

#[test]
fn a_loss_that_levelled_off_before_the_rate_was_taken_away_is_no_failure() {
    // The same schedule over a loss at its floor by step ~40, while the rate still moved it
    // (a run that converged): no finding.
    let converged =
        |step: u64| 0.5 + 1.8 * (-(step as f64) / 8.0).exp() + 0.01 * ((step % 3) as f64);
    let h = run_full(spec(None), 400, None, 1.0, cut_every_30_steps, converged);
    assert!(h.iter().all(|h| h.confidence < 0.5), "{:?}", shown(&h));
    // A loss flat from step 90 at ~0.9 under a rate cut only from step 150 on (a scheduler
    // that reacts to a plateau), to a thousandth of its peak from 180: no finding either.
    let reacting = |step: u64| {
        if step < 150 {
            0.1
        } else {
            cut_every_30_steps(step - 120)
        }
    };
    let h = run_full(spec(None), 400, None, 1.0, reacting, falls_until(90));
    assert!(h.iter().all(|h| h.confidence < 0.5), "{:?}", shown(&h));
}

#[test]
fn a_rate_a_scheduler_holds_far_below_the_optimizers_is_a_scheduler_never_stepped() {
    // Tiny steps under a creeping loss at lr 1e-4 every step, where the optimizer was built
    // with 0.1 (a warmup scheduler made, never stepped): the remedy steps the scheduler.
    let mut held = spec(None);
    held.base_lr = Some(0.1);
    let h = run_full(held.clone(), 200, Some(3e-5), 1.0, |_| 1e-4, creeping);
    let top = &h[0];
    assert_eq!(top.cause, Cause::LearningRateTooLow, "{:?}", shown(&h));
    assert!(top.confidence >= 0.5, "{top}");
    assert!(
        top.description
            .contains("the optimizer was built with lr 0.1, but its scheduler set 1.00e-4 (1,000x less) and never changed it"),
        "{}",
        top.description
    );
    assert!(
        top.remedies[0].starts_with("call scheduler.step()"),
        "{:?}",
        top.remedies
    );
    // Without the optimizer's own rate, or with a rate that moves (a scheduler stepped): the
    // usual remedy.
    for (spec, lr) in [(spec(None), 1e-4), (held, 2e-4)] {
        let h = run_full(
            spec,
            200,
            Some(3e-5),
            1.0,
            |s| if s < 100 { 1e-4 } else { lr },
            creeping,
        );
        let top = &h[0];
        assert_eq!(top.cause, Cause::LearningRateTooLow, "{:?}", shown(&h));
        assert!(
            !top.description.contains("never changed"),
            "{}",
            top.description
        );
        assert!(
            top.remedies[0].starts_with("raise the learning rate"),
            "{:?}",
            top.remedies
        );
    }
}

#[test]
fn updates_that_never_reach_the_weights_are_parameters_not_updated_whatever_the_rate() {
    // A step size of exactly 0 on every measured update under healthy gradients and a rate of
    // 1e-3: the optimizer's updates were computed and never applied. Not a rate too low, whose
    // steps are small, not zero.
    let h = run_full(spec(None), 200, Some(0.0), 1.0, |_| 1e-3, creeping);
    let top = &h[0];
    assert_eq!(
        (top.failure, top.cause),
        (Failure::LossPlateau, Cause::ParametersNotUpdated),
        "{:?}",
        shown(&h)
    );
    assert!(top.confidence >= 0.5, "{top}");
    assert!(
        top.description.contains("never reached the weights"),
        "{}",
        top.description
    );
    not_the_learning_rate_too_low(&h);
    // Under a rate of 0, or one too small to change float32 weights: the rate's doing.
    for lr in [0.0, 1e-9] {
        let h = run_full(spec(None), 200, Some(0.0), 1.0, |_| lr, creeping);
        assert!(
            h.iter()
                .all(|h| !h.description.contains("never reached the weights")),
            "{lr}: {:?}",
            shown(&h)
        );
    }
}

#[test]
fn steps_that_left_the_weights_where_they_were_are_said_so_not_infinitely_small() {
    // A rate of 0 (a param group given lr 0): the step size is measured at exactly 0.
    let h = run_full(spec(None), 200, Some(0.0), 1.0, |_| 0.0, creeping);
    let top = &h[0];
    assert_eq!(top.cause, Cause::LearningRateTooLow, "{:?}", shown(&h));
    assert!(
        top.description
            .contains("each step left the weights exactly where they were (measured"),
        "{}",
        top.description
    );
    assert!(
        h.iter().all(|h| !h.description.contains("infx")),
        "{:?}",
        shown(&h)
    );
}

#[test]
fn a_loss_held_at_chance_by_parameters_no_one_trains_is_theirs() {
    // A 10-class cross-entropy held at ln 10 under steps of a training size, where the output
    // also depends on parameters the model does not hold and no optimizer steps (layers kept
    // in a plain list): the plateau is theirs, with the fix that registers them. A few such
    // values beside the model's (under a tenth of the total) explain nothing.
    let ce = || LossSpec {
        ops: vec!["NllLoss".into(), "LogSoftmax".into()],
        output_op: Some("Addmm".into()),
        output_units: Some(10),
        class_entropy: Some(10f64.ln()),
        ..LossSpec::default()
    };
    let at_chance = |step: u64| 10f64.ln() + 0.01 * ((step % 3) as f64);
    let mut stray = spec(Some(ce()));
    stray.unregistered_params = Some(vec![vec![64, 32], vec![64], vec![64, 64], vec![64]]);
    let h = run(stray, 200, Some(2e-3), at_chance);
    assert_top(
        &h,
        Failure::LossPlateau,
        Cause::ParametersNotUpdated,
        "depends on 4 parameter tensor(s) (6,272 values, 88% of those it depends on; shapes 64x32, 64, 64x64, 64)",
        "nn.ModuleList",
    );
    let mut few = spec(Some(ce()));
    few.unregistered_params = Some(vec![vec![1]]);
    let h = run(few, 200, Some(2e-3), at_chance);
    assert!(
        h.iter().all(|h| h.cause != Cause::ParametersNotUpdated),
        "{:?}",
        shown(&h)
    );
}

#[test]
fn regression_targets_far_beyond_the_first_outputs_are_on_their_raw_scale() {
    // Prices of ~2e5 regressed by a network whose first outputs are within 0.3 of zero: the
    // loss sits at the targets' own square, far above their variance, and the steps train.
    // The plateau is the data's, with the remedy that standardizes the targets (not "check
    // that each target belongs to its input"). Targets of a few units: no such evidence.
    let prices = LossSpec {
        target_range: Some((1.4e5, 2.6e5)),
        output_range: Some((-0.2, 0.3)),
        ..mse(2.1e9)
    };
    let h = run(spec(Some(prices)), 200, Some(2e-3), |step| {
        4.1e10 + 1e8 * ((step % 3) as f64)
    });
    assert_top(
        &h,
        Failure::LossPlateau,
        Cause::BadInputData,
        "the regression targets span [1.40e5, 2.60e5], 866,700x the model's first outputs ([-0.2, 0.3]): they are on their raw scale",
        "standardize the regression targets",
    );
    let units = LossSpec {
        target_range: Some((-3.0, 3.0)),
        output_range: Some((-0.2, 0.3)),
        ..mse(1.0)
    };
    let h = run(spec(Some(units)), 200, Some(2e-3), |step| {
        1.0 + 0.01 * ((step % 3) as f64)
    });
    assert!(
        h.iter().all(|h| !h.description.contains("raw scale")),
        "{:?}",
        shown(&h)
    );
}

#[test]
fn a_loss_with_no_minimum_falling_below_zero_diverges_from_the_first_step() {
    // Raw logits into a negative log-likelihood: the loss is minus the target's logit, and it
    // falls without end below zero. A divergence from the first step, the mismatch's; not a
    // plateau "held above its optimum". The same loss on log-probabilities: no finding.
    let nll = |output_op: &str| LossSpec {
        ops: vec!["NllLoss".into()],
        output_op: Some(output_op.into()),
        output_units: Some(10),
        ..LossSpec::default()
    };
    let falling = |step: u64| -0.1 * step as f64;
    let h = run(spec(Some(nll("Addmm"))), 200, Some(2e-3), falling);
    let top = &h[0];
    assert_eq!(
        (top.failure, top.cause, top.step),
        (Failure::LossDivergence, Cause::OutputLossMismatch, Some(0)),
        "{:?}",
        shown(&h)
    );
    assert!(top.confidence >= 0.5, "{top}");
    assert!(
        top.description
            .starts_with("The loss fell without bound from step 0"),
        "{top}"
    );
    assert!(
        h.iter().all(|h| h.failure != Failure::LossPlateau),
        "{:?}",
        shown(&h)
    );
    let learns = |step: u64| 2.3 * (-(step as f64) / 50.0).exp() + 0.05;
    let h = run(spec(Some(nll("LogSoftmax"))), 200, Some(2e-3), learns);
    assert!(h.iter().all(|h| h.confidence < 0.5), "{:?}", shown(&h));
}

#[test]
fn a_sequence_layer_given_the_batch_as_its_sequence_holds_the_loss_at_chance() {
    // An LSTM built without batch_first=True given (64 samples, 20 steps, 8 features): it reads
    // the 64 samples as the steps of 20 sequences, and the classifier's loss stays at ln 2.
    // Named with the remedy batch_first=True. The same loss with the data laid out as the layer
    // reads it (20, 64, 8), with an output that keeps the layout (a sequence-first tagger's
    // (64, 20, 2)), or with a square input (64, 64, 8) that says nothing: no finding of it.
    let case = |input: [u64; 3], output: Vec<u64>| {
        let mut s = spec(Some(LossSpec {
            ops: vec!["NllLoss".into(), "LogSoftmax".into()],
            output_op: Some("Addmm".into()),
            output_units: output.last().copied(),
            output_shape: Some(output),
            ..LossSpec::default()
        }));
        s.module("rnn", "LSTM");
        s.sequence_first_inputs = Some(vec![neuraldbg_core::SequenceFirstInput {
            module: "rnn".into(),
            shape: input.to_vec(),
        }]);
        run(s, 200, Some(2e-3), |step| 0.69 + 0.01 * ((step % 3) as f64))
    };
    assert_top(
        &case([64, 20, 8], vec![64, 2]),
        Failure::LossPlateau,
        Cause::BatchAxisMismatch,
        "64 samples by 20 steps, read as 20 sequences of 64 steps",
        "with batch_first=True",
    );
    for (input, output) in [
        ([20, 64, 8], vec![64, 2]),
        ([64, 20, 8], vec![64, 20, 2]),
        ([64, 64, 8], vec![64, 2]),
    ] {
        let h = case(input, output);
        assert!(
            h.iter().all(|h| h.cause != Cause::BatchAxisMismatch),
            "{input:?}: {:?}",
            shown(&h)
        );
    }
}

#[test]
fn a_binary_cross_entropy_on_soft_targets_has_no_chance_level_near_their_own_entropy() {
    // An autoencoder's binary cross-entropy on grey pixels: a model that reconstructs every
    // pixel exactly ends at the targets' own entropy (0.65), near ln 2 (0.69). A loss flat at
    // 0.67 says nothing of a constant guess there. On 0/1 targets (their entropy 0) the same
    // loss is at its chance level.
    let bce = |own: f64| LossSpec {
        ops: vec!["BinaryCrossEntropy".into()],
        output_op: Some("Sigmoid".into()),
        output_units: Some(64),
        target_range: Some((0.0, 1.0)),
        target_entropy: Some(own),
        ..LossSpec::default()
    };
    let flat = |step: u64| 0.67 + 0.005 * ((step % 3) as f64);
    let h = run(spec(Some(bce(0.65))), 200, Some(2e-3), flat);
    assert!(
        h.iter().all(|h| !h.description.contains("chance level")),
        "{:?}",
        shown(&h)
    );
    let h = run(spec(Some(bce(0.0))), 200, Some(2e-3), flat);
    assert!(
        h[0].description
            .contains("at its chance level (0.6931 = ln 2 for 2 classes, binary cross-entropy)"),
        "{:?}",
        shown(&h)
    );
    // From ln 2 down to 0.657 and flat there: over 80% of the way to the targets' own
    // entropy, a converged run, not a plateau worth a hypothesis. Were that entropy 0.5, the
    // same loss would have come 19% of the way: a plateau.
    let settling =
        |step: u64| 0.657 + 0.036 * (-(step as f64) / 15.0).exp() + 0.001 * ((step % 3) as f64);
    let h = run(spec(Some(bce(0.65))), 200, Some(2e-3), settling);
    assert!(h.iter().all(|h| h.confidence < 0.2), "{:?}", shown(&h));
    let h = run(spec(Some(bce(0.5))), 200, Some(2e-3), settling);
    assert!(
        h.iter()
            .any(|h| h.failure == Failure::LossPlateau && h.confidence >= 0.3),
        "{:?}",
        shown(&h)
    );
}

#[test]
fn a_recurrent_layer_read_at_the_start_of_its_sequence_holds_the_loss_at_chance() {
    // A classifier's head on out[:, 0] of a one-way LSTM over 20 steps: its output there has
    // seen only the first step, and the loss stays at ln 2. Named with the remedy to read the
    // last step. Read at the last step, at two steps of which the later has seen more than
    // half of the sequence, or at the first step of a bidirectional layer: no finding of it.
    let case = |steps_read: Vec<u64>, bidirectional: bool| {
        let mut s = spec(Some(LossSpec {
            ops: vec!["NllLoss".into(), "LogSoftmax".into()],
            output_op: Some("Addmm".into()),
            output_units: Some(2),
            output_shape: Some(vec![64, 2]),
            ..LossSpec::default()
        }));
        s.module("rnn", "LSTM");
        s.sequence_readouts = Some(vec![neuraldbg_core::SequenceReadout {
            module: "rnn".into(),
            steps: 20,
            steps_read,
            bidirectional,
        }]);
        run(s, 200, Some(2e-3), |step| 0.69 + 0.01 * ((step % 3) as f64))
    };
    assert_top(
        &case(vec![0], false),
        Failure::LossPlateau,
        Cause::SequenceStartReadout,
        "only at its first step: a layer that runs one way has seen only the first of the 20 input steps",
        "out[:, -1]",
    );
    assert_top(
        &case(vec![0, 4], false),
        Failure::LossPlateau,
        Cause::SequenceStartReadout,
        "only up to step 4: a layer that runs one way has seen only the first 5 of the 20",
        "h_n[-1]",
    );
    for (read, bidirectional) in [(vec![19], false), (vec![0, 12], false), (vec![0], true)] {
        let h = case(read.clone(), bidirectional);
        assert!(
            h.iter().all(|h| h.cause != Cause::SequenceStartReadout),
            "{read:?} {bidirectional}: {:?}",
            shown(&h)
        );
    }
}

#[test]
fn a_classifier_held_at_its_unbalanced_classes_frequencies_is_not_learning() {
    // Four classes of which one is 80%: a model that learns how often each occurs and nothing
    // of its input ends at their entropy (0.70 nats), far below ln 4 (1.39), where the chance
    // level read at ln C sees a loss that fell by half. Measured on 256 targets, to within
    // 0.06: the plateau is at its chance level, said as the frequencies' entropy.
    let ce = |entropy: f64, se: f64| LossSpec {
        ops: vec!["NllLoss".into(), "LogSoftmax".into()],
        output_op: Some("Addmm".into()),
        output_units: Some(4),
        output_numel: Some(1024),
        compared_numel: Some(1024),
        class_entropy: Some(entropy),
        class_entropy_se: Some(se),
        ..LossSpec::default()
    };
    // ln 4 at the start, the frequencies' entropy from step 40 on (or half of it: learning).
    let settles_at = |end: f64| {
        move |step: u64| {
            let t = (step as f64 / 40.0).min(1.0);
            4f64.ln() * (1.0 - t) + end * t + 0.01 * ((step % 3) as f64)
        }
    };
    let h = run(
        spec(Some(ce(0.70, 0.06))),
        200,
        Some(2e-3),
        settles_at(0.71),
    );
    let top = &h[0];
    // (No cause is measured in this run: the failure, with its level corrected for the
    // batch's size, 0.70 + 3 / 512, and the check that tells a pipeline that does not give the
    // model its targets from a model that cannot learn them.)
    assert_eq!(top.failure, Failure::LossPlateau, "{:?}", shown(&h));
    assert!(
        top.remedies[0].contains("train on one small batch"),
        "{:?}",
        top.remedies
    );
    assert!(
        top.description.contains(
            "at its chance level (0.7059: the entropy of how often each class occurs in its targets, which are unbalanced; ln 4 = 1.386 were they balanced)"
        ),
        "{}",
        top.description
    );
    // The same loss where the classes are balanced is a model that learned (ln 4 -> 0.71).
    let quiet = |h: &[CausalHypothesis]| {
        assert!(
            h.iter().all(|h| !h.description.contains("chance level")),
            "{:?}",
            shown(h)
        );
    };
    quiet(&run(
        spec(Some(ce(1.38, 0.01))),
        200,
        Some(2e-3),
        settles_at(0.71),
    ));
    // A frequency measured too roughly (a rare class counted on one small batch) is not read.
    quiet(&run(
        spec(Some(ce(0.70, 0.2))),
        200,
        Some(2e-3),
        settles_at(0.71),
    ));
    // Nor one entropy of a first batch of one class or two (labels sorted): not a level.
    quiet(&run(
        spec(Some(ce(0.1, 0.01))),
        200,
        Some(2e-3),
        settles_at(0.1),
    ));
    // Unbalanced classes and a model that learned beyond their frequencies: quiet.
    quiet(&run(
        spec(Some(ce(0.70, 0.06))),
        200,
        Some(2e-3),
        settles_at(0.35),
    ));
}
