#![allow(clippy::unwrap_used)] // a test crate: a failed unwrap is a failed test
//! Mistakes in the training loop on synthetic observations: stalled layers (cut from the
//! graph, or never stepped) and the loss/output facts of `ModelSpec::loss`.

use neuraldbg_core::analysis::explain;
use neuraldbg_core::{
    CausalHypothesis, Cause, Config, Engine, Fact, Failure, LossSpec, Measure, ModelSpec,
    Observation,
};

#[path = "support/mlp.rs"]
mod mlp;
use mlp::spec;

/// `grad(layer, step)`: the layer's gradient norm (None: no gradient); `moves(layer)`: whether
/// its weights change from step to step. Weight norms measured every step; loss falls slowly.
fn run(
    spec: ModelSpec,
    steps: u64,
    grad: impl Fn(usize, u64) -> Option<f32>,
    moves: impl Fn(usize) -> bool,
    loss: impl Fn(u64) -> f64,
) -> Vec<CausalHypothesis> {
    run_amended(spec, &[], steps, grad, moves, loss)
}

/// [`run`], with `(step, lrs)`: before that step, another optimizer's per-parameter lrs reach
/// the engine ([`Engine::amend_param_lr`]).
fn run_amended(
    spec: ModelSpec,
    amend: &[(u64, Vec<Option<f64>>)],
    steps: u64,
    grad: impl Fn(usize, u64) -> Option<f32>,
    moves: impl Fn(usize) -> bool,
    loss: impl Fn(u64) -> f64,
) -> Vec<CausalHypothesis> {
    run_on(spec, amend, &[], steps, grad, moves, loss)
}

/// [`run_amended`], with each step's input batch statistics (`[min, max, mean, std]`).
fn run_on(
    spec: ModelSpec,
    amend: &[(u64, Vec<Option<f64>>)],
    inputs: &[f32],
    steps: u64,
    grad: impl Fn(usize, u64) -> Option<f32>,
    moves: impl Fn(usize) -> bool,
    loss: impl Fn(u64) -> f64,
) -> Vec<CausalHypothesis> {
    let mut engine = Engine::new(Config::default()).unwrap();
    engine.register_model(spec).unwrap();
    for step in 0..steps {
        for (_, lrs) in amend.iter().filter(|(at, _)| *at == step) {
            engine.amend_param_lr(Some(lrs)).unwrap();
        }
        let mut grads = Vec::new();
        let mut weights = Vec::new();
        for l in 0..3 {
            let g = grad(l, step).unwrap_or(-1.0);
            grads.extend([g, if g < 0.0 { -1.0 } else { g / 4.0 }]);
            let w = if moves(l) {
                2.0 + 0.001 * step as f32
            } else {
                2.0
            };
            weights.extend([w, 0.1]);
        }
        let obs = Observation {
            step,
            grad_norms: grads,
            weight_norms: Some(weights),
            loss: Some(loss(step)),
            lr: Some(0.05),
            inputs: inputs.to_vec(),
            ..Observation::default()
        };
        engine.observe(&obs.view()).unwrap();
    }
    explain(&engine, None)
}

fn falling(step: u64) -> f64 {
    2.0 * (-0.01 * step as f64).exp()
}

#[test]
fn a_layer_cut_from_the_graph_is_stalled_for_lack_of_gradient() {
    // fc0 and fc1 run but never get a gradient (a .detach() after fc1); fc2 trains.
    let h = run(
        spec(),
        60,
        |l, _| (l == 2).then_some(0.1),
        |l| l == 2,
        falling,
    );
    let top = &h[0];
    assert_eq!(top.failure, Failure::StalledLayer, "{top}");
    assert_eq!(top.cause, Cause::ParametersNotUpdated, "{top}");
    // The latest layer before the cut is the root.
    assert_eq!(top.layer.as_deref(), Some("fc1"), "{top}");
    assert_eq!(top.step, Some(0));
    assert!(top.confidence >= 0.8, "{top}");
    assert!(top.description.contains("no gradient"), "{top}");
    assert!(top.remedies[0].contains(".detach()"), "{:?}", top.remedies);
}

#[test]
fn a_loss_cut_from_the_models_output_is_named_when_no_layer_gets_a_gradient() {
    // Every layer runs, the optimizer steps 60 times, no layer ever gets a gradient and no
    // weight moves (a loss rebuilt from `.item()`): the backward pass never reaches the model.
    let h = run(spec(), 60, |_, _| None, |_| false, |_| 1.609);
    let top = &h[0];
    assert_eq!(top.failure, Failure::StalledLayer, "{top}");
    assert_eq!(top.cause, Cause::ParametersNotUpdated, "{top}");
    assert!(top.confidence >= 0.8, "{top}");
    assert!(
        top.description.contains(
            "the optimizer stepped 60 times, but no parameter received a gradient and no weight moved: the loss is cut from the model's output"
        ),
        "{top}"
    );
    assert!(
        top.remedies[0].contains("no .item(), .detach()"),
        "{:?}",
        top.remedies
    );
    // Weights that move without a gradient the collector saw (a model trained through
    // `torch.func`): not a cut.
    let h = run(spec(), 60, |_, _| None, |_| true, |_| 1.609);
    assert!(
        !h.iter().any(|x| x.description.contains("cut")),
        "{:?}",
        h.iter().map(ToString::to_string).collect::<Vec<_>>()
    );
    // Too short a run to say.
    let h = run(spec(), 10, |_, _| None, |_| false, |_| 1.609);
    assert!(!h.iter().any(|x| x.failure == Failure::StalledLayer));
    // Gradients of exactly zero everywhere (`jax.grad` through a `stop_gradient`): the same
    // finding, said without the certainty of a gradient that never came.
    let h = run(spec(), 60, |_, _| Some(0.0), |_| false, |_| 1.609);
    let top = &h[0];
    assert_eq!(top.cause, Cause::ParametersNotUpdated, "{top}");
    assert!(
        top.description
            .contains("every gradient was exactly zero and no weight moved"),
        "{top}"
    );
    // ... but not at a loss of exactly zero: a run that starts converged.
    let h = run(spec(), 60, |_, _| Some(0.0), |_| false, |_| 0.0);
    assert!(
        !h.iter().any(|x| x.failure == Failure::StalledLayer),
        "{h:?}"
    );
}

#[test]
fn a_layer_no_optimizer_holds_is_stalled_with_that_reason() {
    // fc1 gets gradients but its weights never move; the optimizer does not hold it.
    let mut s = spec();
    s.param_lr = Some(
        (0..6)
            .map(|p| if p / 2 == 1 { None } else { Some(0.05) })
            .collect(),
    );
    let h = run(s, 60, |_, _| Some(0.1), |l| l != 1, falling);
    let top = &h[0];
    assert_eq!(top.failure, Failure::StalledLayer, "{top}");
    assert_eq!(top.cause, Cause::ParametersNotUpdated, "{top}");
    assert_eq!(top.layer.as_deref(), Some("fc1"), "{top}");
    assert!(
        top.description.contains("no optimizer holds"),
        "{}",
        top.description
    );
    assert!(top.remedies[0].contains("optimizer"), "{:?}", top.remedies);
}

#[test]
fn a_layer_a_second_optimizer_holds_is_not_said_to_be_held_by_none() {
    // fc1 is trained by a second optimizer at lr 0.05 (fc0 and fc2 by the first); its
    // gradient (1e-5) is real but so small that lr * grad / |W| is far below what the weight
    // norm can show, so its weights look still while fc0 and fc2 move.
    let mut s = spec();
    let first: Vec<Option<f64>> = (0..6)
        .map(|p| if p / 2 == 1 { None } else { Some(0.05) })
        .collect();
    s.param_lr = Some(first.clone());
    let second: Vec<Option<f64>> = first
        .iter()
        .map(|lr| if lr.is_some() { None } else { Some(0.05) })
        .collect();
    let grad = |l: usize, _| Some(if l == 1 { 1e-5 } else { 0.1 });
    let names = |h: &[CausalHypothesis]| h.iter().map(ToString::to_string).collect::<Vec<_>>();
    // Told only of the first optimizer, the engine takes fc1 for held by none: a stall.
    let h = run(s.clone(), 60, grad, |l| l != 1, falling);
    assert!(
        h.iter().any(|h| h.cause == Cause::ParametersNotUpdated
            && h.layer.as_deref() == Some("fc1")
            && h.description.contains("no optimizer holds")),
        "{:?}",
        names(&h)
    );
    // Told of the second, at the first step or only from step 5 on: held, and an update
    // too small to show is no stall.
    for at in [0, 5] {
        let h = run_amended(
            s.clone(),
            &[(at, second.clone())],
            60,
            grad,
            |l| l != 1,
            falling,
        );
        assert!(
            h.iter()
                .all(|h| h.failure != Failure::StalledLayer
                    && h.cause != Cause::ParametersNotUpdated),
            "amended at {at}: {:?}",
            names(&h)
        );
    }
    // The first optimizer built without fc0: a layer neither holds is still named, with that
    // reason.
    s.param_lr.as_mut().unwrap()[..2].fill(None);
    let h = run_amended(s, &[(5, second)], 60, grad, |l| l == 2, falling);
    let top = &h[0];
    assert_eq!(top.failure, Failure::StalledLayer, "{top}");
    assert_eq!(top.cause, Cause::ParametersNotUpdated, "{top}");
    assert_eq!(top.layer.as_deref(), Some("fc0"), "{top}");
    assert!(top.description.contains("no optimizer holds"), "{top}");
}

#[test]
fn weights_that_stop_moving_midway_date_the_stall() {
    // fc0's weights move until step 29, then stand still (its param group's lr set to 0).
    let mut s = spec();
    s.param_lr = Some(vec![Some(0.05); 6]);
    let mut engine = Engine::new(Config::default()).unwrap();
    engine.register_model(s).unwrap();
    for step in 0..80u64 {
        let w0 = 2.0 + 0.001 * step.min(29) as f32;
        let w = 2.0 + 0.001 * step as f32;
        let obs = Observation {
            step,
            grad_norms: vec![0.1, 0.02, 0.1, 0.02, 0.1, 0.02],
            weight_norms: Some(vec![w0, 0.1, w, 0.1, w, 0.1]),
            loss: Some(falling(step)),
            lr: Some(0.05),
            ..Observation::default()
        };
        engine.observe(&obs.view()).unwrap();
    }
    let h = explain(&engine, None);
    let top = &h[0];
    assert_eq!(top.failure, Failure::StalledLayer, "{top}");
    assert_eq!(top.layer.as_deref(), Some("fc0"), "{top}");
    assert_eq!(top.step, Some(30), "{top}");
}

#[test]
fn a_model_whose_weights_all_stand_still_has_no_stalled_layer() {
    // Nothing moves anywhere (e.g. weight norms too coarse to see the updates): not a stalled
    // layer, whatever else it may be.
    let h = run(spec(), 60, |_, _| Some(0.1), |_| false, falling);
    assert!(
        h.iter().all(|h| h.failure != Failure::StalledLayer),
        "{:?}",
        h.iter().map(ToString::to_string).collect::<Vec<_>>()
    );
    // A short run (under 20 steps) with a layer that gets no gradient: too early to say.
    let h = run(
        spec(),
        10,
        |l, _| (l == 2).then_some(0.1),
        |l| l == 2,
        falling,
    );
    assert!(h.iter().all(|h| h.failure != Failure::StalledLayer));
}

#[test]
fn tiny_updates_the_norm_cannot_show_are_not_a_stall() {
    // fc0's gradient is so small that lr * grad / |W| is far below float32 resolution.
    let h = run(
        spec(),
        60,
        |l, _| Some(if l == 0 { 1e-5 } else { 0.1 }),
        |l| l != 0,
        falling,
    );
    assert!(h.iter().all(|h| h.failure != Failure::StalledLayer));
}

fn plateau(step: u64) -> f64 {
    1.0 + 0.001 * ((step % 3) as f64)
}

fn with_loss(loss: LossSpec) -> ModelSpec {
    let mut s = spec();
    s.loss = Some(loss);
    s
}

fn ops(names: &[&str]) -> Vec<String> {
    names.iter().map(|s| (*s).to_string()).collect()
}

#[test]
fn softmax_before_cross_entropy_explains_a_plateau() {
    let s = with_loss(LossSpec {
        ops: ops(&["NllLoss", "LogSoftmax"]),
        output_op: Some("Softmax".into()),
        output_units: Some(10),
        ..LossSpec::default()
    });
    let h = run(s, 200, |_, _| Some(0.01), |_| true, plateau);
    let top = &h[0];
    assert_eq!(top.failure, Failure::LossPlateau, "{top}");
    assert_eq!(top.cause, Cause::OutputLossMismatch, "{top}");
    assert!(top.remedies[0].contains("Softmax"), "{:?}", top.remedies);
}

#[test]
fn tanh_logits_into_cross_entropy_are_a_mismatch() {
    let s = with_loss(LossSpec {
        ops: ops(&["NllLoss", "LogSoftmax"]),
        output_op: Some("Tanh".into()),
        output_units: Some(10),
        ..LossSpec::default()
    });
    let h = run(s, 200, |_, _| Some(0.01), |_| true, plateau);
    assert_eq!(h[0].cause, Cause::OutputLossMismatch, "{}", h[0]);
    assert!(h[0].remedies[0].contains("Tanh"), "{:?}", h[0].remedies);
}

#[test]
fn logits_into_cross_entropy_and_log_softmax_into_nll_are_no_mismatch() {
    for (loss_ops, out) in [
        (&["NllLoss", "LogSoftmax"][..], "Addmm"),
        (&["NllLoss"][..], "LogSoftmax"),
        (&["BinaryCrossEntropy"][..], "Sigmoid"),
        (&["MseLoss"][..], "Tanh"),
    ] {
        let s = with_loss(LossSpec {
            ops: ops(loss_ops),
            output_op: Some(out.into()),
            output_units: Some(10),
            output_numel: Some(320),
            compared_numel: Some(320),
            target_range: Some((-0.9, 0.9)),
            ..LossSpec::default()
        });
        let h = run(s, 200, |_, _| Some(0.01), |_| true, plateau);
        assert!(
            h.iter()
                .all(|h| h.cause != Cause::OutputLossMismatch
                    && h.cause != Cause::TargetShapeMismatch),
            "{out}: {:?}",
            h.iter().map(ToString::to_string).collect::<Vec<_>>()
        );
    }
}

#[test]
fn a_bounded_output_regressing_targets_beyond_its_range_is_a_mismatch() {
    let s = with_loss(LossSpec {
        ops: ops(&["MseLoss"]),
        output_op: Some("Sigmoid".into()),
        output_units: Some(1),
        target_range: Some((0.0, 40.0)),
        ..LossSpec::default()
    });
    let h = run(s, 200, |_, _| Some(0.01), |_| true, plateau);
    assert_eq!(h[0].cause, Cause::OutputLossMismatch, "{}", h[0]);
    assert!(h[0].description.contains("[0, 40]"), "{}", h[0].description);
}

/// An autoencoder fed raw pixels: inputs and targets span 0-255 and its sigmoid output [0, 1].
/// The output was chosen for normalized data: the data is the cause, the mismatch its evidence.
/// The same targets under normalized inputs stay the output's mismatch.
#[test]
fn a_bounded_output_regressing_targets_on_the_raw_scale_of_its_inputs_blames_the_data() {
    let s = || {
        with_loss(LossSpec {
            ops: ops(&["MseLoss"]),
            output_op: Some("Sigmoid".into()),
            output_units: Some(784),
            target_range: Some((0.0, 255.0)),
            ..LossSpec::default()
        })
    };
    let raw = [0.0, 255.0, 33.0, 78.0];
    let h = run_on(s(), &[], &raw, 200, |_, _| Some(0.01), |_| true, plateau);
    assert_eq!(h[0].cause, Cause::BadInputData, "{}", h[0]);
    assert!(
        h[0].description.contains("[0, 255]"),
        "{}",
        h[0].description
    );
    assert!(
        h[0].remedies[0].contains("normalize inputs"),
        "{:?}",
        h[0].remedies
    );
    let h = run_on(
        s(),
        &[],
        &[-2.0, 2.0, 0.0, 1.0],
        200,
        |_, _| Some(0.01),
        |_| true,
        plateau,
    );
    assert_eq!(h[0].cause, Cause::OutputLossMismatch, "{}", h[0]);
}

#[test]
fn a_broadcasting_regression_loss_is_a_target_shape_mismatch() {
    let s = with_loss(LossSpec {
        ops: ops(&["MseLoss", "Expand"]),
        output_op: Some("Addmm".into()),
        output_units: Some(1),
        output_numel: Some(64),
        compared_numel: Some(64 * 64),
        ..LossSpec::default()
    });
    let h = run(s, 200, |_, _| Some(0.01), |_| true, plateau);
    assert_eq!(h[0].failure, Failure::LossPlateau, "{}", h[0]);
    assert_eq!(h[0].cause, Cause::TargetShapeMismatch, "{}", h[0]);
    assert!(h[0].remedies[0].contains("squeeze"), "{:?}", h[0].remedies);
}

/// Every layer's gradient norm `grad(step)`, weights growing by `drift` a step, the loss of
/// `loss(step)` and the loop facts of each step.
fn uniform(
    spec: ModelSpec,
    facts: &[(Fact, f64)],
    steps: u64,
    grad: impl Fn(u64) -> f32,
    drift: f32,
    loss: impl Fn(u64) -> f64,
) -> Vec<CausalHypothesis> {
    let mut engine = Engine::new(Config::default()).unwrap();
    engine.register_model(spec).unwrap();
    for step in 0..steps {
        let (g, w) = (grad(step), 2.0 + drift * step as f32);
        let obs = Observation {
            step,
            grad_norms: (0..3).flat_map(|_| [g, g / 4.0]).collect(),
            weight_norms: Some((0..3).flat_map(|_| [w, 0.1]).collect()),
            loss: Some(loss(step)),
            lr: Some(0.05),
            facts: facts.to_vec(),
            ..Observation::default()
        };
        engine.observe(&obs.view()).unwrap();
    }
    explain(&engine, None)
}

/// Gradients that grow quadratically from a healthy start until they explode (what summing
/// every step's gradient does), with the loop facts of each step.
fn growing(spec: ModelSpec, facts: &[(Fact, f64)], steps: u64) -> Vec<CausalHypothesis> {
    let grad = |step: u64| 0.5 * (step + 1) as f32 * (step + 1) as f32;
    uniform(spec, facts, steps, grad, 0.01, |step| {
        1.0 + 0.001 * (step * step) as f64
    })
}

#[test]
fn gradients_that_accumulate_across_steps_are_missing_zero_grad() {
    let h = growing(spec(), &[(Fact::GradAccumulated, 1.0)], 60);
    let top = &h[0];
    assert_eq!(top.failure, Failure::ExplodingGradients, "{top}");
    assert_eq!(top.cause, Cause::MissingZeroGrad, "{top}");
    assert!(top.remedies[0].contains("zero_grad"), "{:?}", top.remedies);
    // The same growth in a loop that zeroes its gradients is not blamed on zeroing.
    let h = growing(spec(), &[(Fact::GradAccumulated, 0.0)], 60);
    assert_ne!(h[0].cause, Cause::MissingZeroGrad, "{}", h[0]);
    assert!(h.iter().all(|h| h.cause != Cause::MissingZeroGrad));
}

fn with_module(kind: &str) -> ModelSpec {
    let mut s = ModelSpec::default();
    for i in 0..3 {
        let m = s.module(format!("fc{i}"), "Linear");
        s.param(m, format!("fc{i}.weight"), &[16, 16]);
        s.param(m, format!("fc{i}.bias"), &[16]);
        if i < 2 {
            s.module(format!("norm{i}"), kind);
            s.module(format!("relu{i}"), "ReLU");
        }
    }
    s.module("", "Net");
    s.optimizer = Some("SGD".into());
    s
}

#[test]
fn eval_mode_explains_a_failure_only_with_batch_statistics() {
    let eval = [(Fact::Training, 0.0)];
    let h = growing(with_module("BatchNorm1d"), &eval, 60);
    assert_eq!(h[0].cause, Cause::EvalMode, "{}", h[0]);
    assert!(
        h[0].remedies[0].contains("model.train()"),
        "{:?}",
        h[0].remedies
    );
    // Dropout in eval mode only removes regularization: not the cause of anything.
    let h = growing(with_module("Dropout"), &eval, 60);
    assert!(h.iter().all(|h| h.cause != Cause::EvalMode), "{}", h[0]);
    // Trained in train mode: not eval mode.
    let h = growing(with_module("BatchNorm1d"), &[(Fact::Training, 1.0)], 60);
    assert!(h.iter().all(|h| h.cause != Cause::EvalMode), "{}", h[0]);
}

/// Every layer's gradient norm `g` over 200 steps, weights moving a little each step.
fn steady(
    spec: ModelSpec,
    facts: &[(Fact, f64)],
    g: f32,
    loss: impl Fn(u64) -> f64,
) -> Vec<CausalHypothesis> {
    uniform(spec, facts, 200, |_| g, 0.001, loss)
}

#[test]
fn two_mistakes_found_in_the_program_are_two_causes_not_rivals() {
    let s = with_loss(LossSpec {
        ops: ops(&["NllLoss", "LogSoftmax"]),
        output_op: Some("Softmax".into()),
        output_units: Some(10),
        ..LossSpec::default()
    });
    let confidence = |h: &[CausalHypothesis], cause: Cause| {
        h.iter()
            .filter(|h| h.failure == Failure::LossPlateau && h.cause == cause)
            .map(|h| h.confidence)
            .fold(0.0, f64::max)
    };
    let alone = steady(s.clone(), &[], 0.01, plateau);
    let both = steady(s, &[(Fact::GradAccumulated, 1.0)], 0.01, plateau);
    let text = |h: &[CausalHypothesis]| h.iter().map(ToString::to_string).collect::<Vec<_>>();
    // Each is named at 0.5 or above, and the second takes nothing from the first.
    let mismatch = confidence(&alone, Cause::OutputLossMismatch);
    assert!(mismatch >= 0.5, "{:?}", text(&alone));
    assert!(
        (confidence(&both, Cause::OutputLossMismatch) - mismatch).abs() < 0.02,
        "{:?}",
        text(&both)
    );
    assert!(
        confidence(&both, Cause::MissingZeroGrad) >= 0.5,
        "{:?}",
        text(&both)
    );
}

#[test]
fn gradients_high_to_the_end_because_they_are_never_zeroed_are_a_failure() {
    let summed = steady(spec(), &[(Fact::GradAccumulated, 1.0)], 3.0, falling);
    let top = &summed[0];
    assert_eq!(top.failure, Failure::SaturatedGradients, "{top}");
    assert_eq!(top.cause, Cause::MissingZeroGrad, "{top}");
    assert!(top.confidence >= 0.5, "{top}");
    // The same norms in a loop that zeroes its gradients stay a warning.
    let zeroed = steady(spec(), &[(Fact::GradAccumulated, 0.0)], 3.0, falling);
    assert!(zeroed.iter().all(|h| h.confidence < 0.5), "{}", zeroed[0]);
}

/// A regression whose loss holds a weight penalty of coefficient `l2` (the framework saw
/// `penalized_params` parameters penalized) on a model whose data term stays at `data(step)`:
/// the weights shrink by `shrink` a step (measured every 10 steps), and the loss is the data
/// term plus `l2` times their sum of squares.
fn penalized(
    penalized_params: Option<u64>,
    l2: f64,
    shrink: f64,
    data: impl Fn(u64) -> f64,
) -> Vec<CausalHypothesis> {
    penalized_under(
        LossSpec {
            ops: ops(&["Add", "Mean", "Pow", "Sub"]),
            output_op: Some("Addmm".into()),
            output_units: Some(1),
            target_var: Some(0.05),
            penalized_params,
            ..LossSpec::default()
        },
        l2,
        shrink,
        data,
    )
}

/// [`penalized`], under any loss.
fn penalized_under(
    loss: LossSpec,
    l2: f64,
    shrink: f64,
    data: impl Fn(u64) -> f64,
) -> Vec<CausalHypothesis> {
    let mut engine = Engine::new(Config::default()).unwrap();
    engine.register_model(with_loss(loss)).unwrap();
    for step in 0..200u64 {
        let w = 4.0 * shrink.powf(step as f64);
        let sq = 3.0 * (w * w + 0.01);
        let obs = Observation {
            step,
            grad_norms: vec![0.5, 0.1, 0.5, 0.1, 0.5, 0.1],
            weight_norms: (step % 10 == 0)
                .then(|| vec![w as f32, 0.1, w as f32, 0.1, w as f32, 0.1]),
            loss: Some(data(step) + l2 * sq),
            lr: Some(1e-3),
            ..Observation::default()
        };
        engine.observe(&obs.view()).unwrap();
    }
    explain(&engine, None)
}

#[test]
fn a_weight_penalty_that_outweighs_the_data_is_over_regularization() {
    // l2 0.1 on weights of norm 4 -> 2.7: a penalty of ~4.8 -> 2.2 over a data term of 0.05.
    let h = penalized(Some(3), 0.1, 0.998, |_| 0.05);
    let top = &h[0];
    assert_eq!(top.failure, Failure::LossPlateau, "{top}");
    assert_eq!(top.cause, Cause::OverRegularization, "{top}");
    assert!(top.confidence >= 0.5, "{top}");
    assert!(
        top.description.contains("x the weights' sum of squares"),
        "{top}"
    );
    // The penalty's coefficient is read off the run: 0.1.
    assert!(top.description.contains("loss = 0.1 x"), "{top}");
    // Without the framework's fact that the loss penalizes the weights, the same numbers name
    // no penalty: a loss can fall with the weights' norm for other reasons.
    let h = penalized(None, 0.1, 0.998, |_| 0.05);
    assert!(
        h.iter().all(|h| h.cause != Cause::OverRegularization),
        "{}",
        h[0]
    );
    // A usual penalty (1e-5) under a data term that is fitted is no finding.
    let h = penalized(Some(3), 1e-5, 0.998, |s| {
        0.05 * (-(s as f64) / 40.0).exp() + 1e-4
    });
    assert!(
        h.iter().all(|h| h.cause != Cause::OverRegularization),
        "{}",
        h[0]
    );
    assert!(h.iter().all(|h| h.confidence < 0.5), "{}", h[0]);
}

#[test]
fn a_weight_penalty_that_shrank_a_classifier_to_a_constant_guess_is_over_regularization() {
    // Penalty 0.05 x ~48 = 2.4 against a cross-entropy of ln 10 = 2.3 at the first step; the
    // weights shrink to ~0 and the loss ends at the chance level, the penalty a few percent.
    let loss = LossSpec {
        ops: ops(&["Add", "NllLoss", "LogSoftmax"]),
        output_op: Some("Addmm".into()),
        output_units: Some(10),
        penalized_params: Some(3),
        ..LossSpec::default()
    };
    let h = penalized_under(loss.clone(), 0.05, 0.97, |_| 10f64.ln());
    let top = &h[0];
    assert_eq!(top.failure, Failure::LossPlateau, "{top}");
    assert_eq!(top.cause, Cause::OverRegularization, "{top}");
    assert!(top.confidence >= 0.5, "{top}");
    assert!(
        top.description
            .contains("shrank the weights' sum of squares to"),
        "{top}"
    );
    // A penalty a few percent of the loss at the start (1e-3 x 48 against 2.3) is usual.
    let h = penalized_under(loss, 1e-3, 0.97, |_| 10f64.ln());
    assert!(
        h.iter().all(|h| h.cause != Cause::OverRegularization),
        "{}",
        h[0]
    );
}

/// A 5-class classifier whose loss stays at ln 5 while the optimizer decays its weights
/// (`param_weight_decay`) through the gradient: the weights (norm 4 at first) are multiplied
/// by `kept_per_step` each step; the loss's own gradient norm is 0.2.
fn decayed(weight_decay: f64, kept_per_step: f64) -> Vec<CausalHypothesis> {
    let mut s = with_loss(LossSpec {
        ops: ops(&["NllLoss", "LogSoftmax"]),
        output_op: Some("Addmm".into()),
        output_units: Some(5),
        ..LossSpec::default()
    });
    s.param_weight_decay = Some(vec![weight_decay; s.params.len()]);
    let mut engine = Engine::new(Config::default()).unwrap();
    engine.register_model(s).unwrap();
    for step in 0..200u64 {
        let w = (4.0 * kept_per_step.powf(step as f64)) as f32;
        let obs = Observation {
            step,
            grad_norms: vec![0.2, 0.05, 0.2, 0.05, 0.2, 0.05],
            weight_norms: (step % 10 == 0).then(|| vec![w, 0.1, w, 0.1, w, 0.1]),
            loss: Some(5f64.ln() + 0.01 * ((step % 3) as f64 - 1.0)),
            lr: Some(1e-3),
            ..Observation::default()
        };
        engine.observe(&obs.view()).unwrap();
    }
    explain(&engine, None)
}

#[test]
fn a_weight_decay_that_outweighs_the_gradient_while_the_weights_shrink_is_over_regularization() {
    // weight_decay 1 x |W| 4 = 4: 20x the gradient; the weights end at 2% of their norm.
    let h = decayed(1.0, 0.98);
    let top = &h[0];
    assert_eq!(top.cause, Cause::OverRegularization, "{top}");
    assert!(top.confidence >= 0.5, "{top}");
    assert!(top.description.contains("weight_decay of 1 "), "{top}");
    // The same pull on weights that keep their norm (a small gradient, not a strong decay).
    let h = decayed(1.0, 1.0);
    assert!(
        h.iter().all(|h| h.cause != Cause::OverRegularization),
        "{}",
        h[0]
    );
    // A usual decay on the same shrinking weights pulls far less than the gradient.
    let h = decayed(5e-4, 0.98);
    assert!(
        h.iter().all(|h| h.cause != Cause::OverRegularization),
        "{}",
        h[0]
    );
}

#[test]
fn a_weight_decay_that_is_not_a_finite_non_negative_number_is_refused() {
    let mut s = spec();
    s.param_weight_decay = Some(vec![f64::NAN; s.params.len()]);
    let mut engine = Engine::new(Config::default()).unwrap();
    let err = engine.register_model(s).unwrap_err().to_string();
    assert!(err.contains("param_weight_decay"), "{err}");
    let mut s = spec();
    s.param_weight_decay = Some(vec![0.0]);
    let err = Engine::new(Config::default())
        .unwrap()
        .register_model(s)
        .unwrap_err()
        .to_string();
    assert!(err.contains("entries"), "{err}");
}

/// A loss that falls by 40% over the run and then creeps.
fn slow(step: u64) -> f64 {
    0.6 + 0.4 * (-(step as f64) / 60.0).exp()
}

/// A spec whose first input batch had features of these scales (NaN: not all finite).
fn with_features(scales: &[f64]) -> ModelSpec {
    let mut s = spec();
    s.input_feature_scales = Some(scales.iter().map(|x| (!x.is_nan()).then_some(*x)).collect());
    s
}

#[test]
fn a_loss_that_creeps_under_features_on_scales_thousands_apart_blames_the_data() {
    // (The steps move each weight by ~5e-4 of its size: not small enough to creep for the
    // learning rate's sake.)
    let h = run(
        with_features(&[f64::NAN, 0.8, 2.5e-4, 1.0, 0.0]),
        200,
        |_, _| Some(0.05),
        |_| true,
        slow,
    );
    let top = &h[0];
    assert_eq!(top.failure, Failure::LossPlateau, "{top}");
    assert_eq!(top.cause, Cause::BadInputData, "{top}");
    assert!(top.confidence >= 0.5, "{top}");
    assert!(
        top.description.contains(
            "features are on scales 4,000x apart (feature 2 reaches 2.50e-4, feature 3 1)"
        ),
        "{top}"
    );
    assert!(
        top.remedies[0].contains("standardize each feature"),
        "{:?}",
        top.remedies
    );
    // Features within a few times of each other (a feature all zero in the batch has no
    // scale): the same loss is no finding.
    for scales in [&[1.0, 0.2, 0.5][..], &[1.0, 0.0, 0.01][..]] {
        let h = run(
            with_features(scales),
            200,
            |_, _| Some(0.05),
            |_| true,
            slow,
        );
        assert!(h.iter().all(|h| h.confidence < 0.5), "{scales:?}: {h:?}");
    }
}

#[test]
fn a_negative_or_infinite_feature_scale_is_refused() {
    let err = Engine::new(Config::default())
        .unwrap()
        .register_model(with_features(&[1.0, -0.5]))
        .unwrap_err()
        .to_string();
    assert!(err.contains("input_feature_scales"), "{err}");
    let err = Engine::new(Config::default())
        .unwrap()
        .register_model(with_features(&[1.0, f64::INFINITY]))
        .unwrap_err()
        .to_string();
    assert!(err.contains("input_feature_scales"), "{err}");
}

/// Weights and gradients that grow from a healthy start until they explode, with each of the
/// first five steps' update measured `direction` against the gradient (the cosine).
fn climbing_run(direction: f32) -> Vec<CausalHypothesis> {
    let mut engine = Engine::new(Config::default()).unwrap();
    let spec = spec();
    let params = spec.params.len();
    engine.register_model(spec).unwrap();
    for step in 0..60u64 {
        let g = 0.5 * 1.15f32.powi(step as i32);
        let w = 2.0 * 1.02f32.powi(step as i32);
        let mut obs = Observation {
            step,
            grad_norms: (0..3).flat_map(|_| [g, g / 4.0]).collect(),
            weight_norms: Some((0..3).flat_map(|_| [w, 0.1]).collect()),
            loss: Some(1.0 + 0.1 * step as f64 * step as f64),
            lr: Some(0.05),
            ..Observation::default()
        };
        if step < 5 {
            obs.measures = vec![
                (Measure::UpdateRatio, vec![0.02; params]),
                (Measure::UpdateDirection, vec![direction; params]),
            ];
        }
        engine.observe(&obs.view()).unwrap();
    }
    explain(&engine, None)
}

#[test]
fn steps_that_climb_the_gradient_are_a_flipped_update_sign() {
    let h = climbing_run(0.9);
    let top = &h[0];
    assert_eq!(top.cause, Cause::FlippedUpdateSign, "{top}");
    assert!(top.confidence >= 0.8, "{top}");
    assert!(top.description.contains("up their gradients"), "{top}");
    assert!(
        top.remedies[0].contains("step down the gradient"),
        "{:?}",
        top.remedies
    );
    // The same blow-up under steps that descend (SGD's -1, Adam's sign-like -0.8): another
    // cause, and no hypothesis names this one.
    for direction in [-1.0, -0.8] {
        let h = climbing_run(direction);
        assert!(!h.is_empty());
        assert!(
            h.iter().all(|h| h.cause != Cause::FlippedUpdateSign),
            "{}",
            h[0]
        );
    }
}
