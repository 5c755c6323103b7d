#![allow(clippy::unwrap_used)] // a test crate: a failed unwrap is a failed test
//! End-to-end tests of the engine on synthetic observations: the reasoning rules of design.md
//! (root cause along the backward pass, a dead layer as the root, forward order for non-finite
//! values), and that healthy noise never produces a confident hypothesis.

use neuraldbg_core::CouplingKind::{Structural, Temporal};
use neuraldbg_core::analysis::Analysis;
use neuraldbg_core::{
    ACTIVATION_STATS, CausalHypothesis, Cause, Config, Engine, EventType, Failure, GradientHealth,
    INPUT_STATS, Measure, ModelSpec, Observation, State,
};
use proptest::prelude::*;

/// `depth` blocks of Linear + activation, then a head and the root, in forward order:
/// modules `fc0, act0, fc1, act1, ..., head, <root>`.
fn mlp(depth: usize, act: &str, optimizer: &str) -> ModelSpec {
    let mut spec = ModelSpec::default();
    let linear = |spec: &mut ModelSpec, name: &str| {
        let m = spec.module(name, "Linear");
        spec.param(m, format!("{name}.weight"), &[32, 32]);
        spec.param(m, format!("{name}.bias"), &[32]);
    };
    for i in 0..depth {
        linear(&mut spec, &format!("fc{i}"));
        spec.module(format!("act{i}"), act);
    }
    linear(&mut spec, "head");
    spec.module("", "Net");
    spec.optimizer = Some(optimizer.into());
    spec
}

/// Linear layers of `mlp(depth, ..)`: fc0..fc{depth-1}, head.
fn layers(depth: usize) -> usize {
    depth + 1
}

struct Step {
    layer_norms: Vec<f32>,
    acts: Option<Vec<[f32; ACTIVATION_STATS]>>,
    weight_gain: Option<f32>,
    input: Option<[f32; INPUT_STATS]>,
    loss: Option<f64>,
    lr: f64,
    nonfinite_module: Option<usize>,
}

fn observation(step: u64, s: &Step) -> Observation {
    Observation {
        step,
        // The whole layer norm on the weight, zero on the bias.
        grad_norms: s.layer_norms.iter().flat_map(|n| [*n, 0.0]).collect(),
        // weight norm = gain * sqrt(numel / fan_in) = gain * sqrt(32)
        weight_norms: s.weight_gain.map(|g| {
            s.layer_norms
                .iter()
                .flat_map(|_| [g * 32f32.sqrt(), 0.1])
                .collect()
        }),
        activations: s
            .acts
            .as_ref()
            .map(|rows| rows.iter().flat_map(|r| r.iter().copied()).collect()),
        inputs: s.input.map(|r| r.to_vec()).unwrap_or_default(),
        loss: s.loss,
        lr: Some(s.lr),
        nonfinite_module: s.nonfinite_module,
        // The collector scans outputs exactly on steps with NaN/Inf gradients or loss.
        outputs_checked: s.layer_norms.iter().any(|n| !n.is_finite())
            || s.loss.is_some_and(|l| !l.is_finite()),
        ..Observation::default()
    }
}

fn run(spec: ModelSpec, steps: u64, mut f: impl FnMut(u64) -> Step) -> Engine {
    let mut engine = Engine::new(Config::default()).unwrap();
    engine.register_model(spec).unwrap();
    for step in 0..steps {
        engine.observe(&observation(step, &f(step)).view()).unwrap();
    }
    engine
}

fn explain(engine: &Engine) -> Vec<CausalHypothesis> {
    Analysis::new(engine).unwrap().hypotheses(None)
}

fn relu_row(dead: f32) -> [f32; ACTIVATION_STATS] {
    [1.0, f32::NAN, dead, f32::NAN, 64.0]
}

/// Rows of rectified units for `mlp(depth, "ReLU", ..)`: `act1` with this dead share, the others at 5%.
fn act1_dead(depth: usize, share: f32) -> Vec<[f32; ACTIVATION_STATS]> {
    (0..depth)
        .map(|a| relu_row(if a == 1 { share } else { 0.05 }))
        .collect()
}

fn healthy_input() -> [f32; INPUT_STATS] {
    [-3.0, 3.0, 0.0, 1.0]
}

#[test]
fn dead_layer_is_the_root_not_the_layers_that_vanish_behind_it() {
    // act2 (module index 5) dies at step 10: fc0..fc2 get exactly zero gradient from then on.
    let depth = 4;
    let engine = run(mlp(depth, "ReLU", "SGD"), 60, |step| {
        let dead = step >= 10;
        Step {
            layer_norms: (0..layers(depth))
                .map(|l| if dead && l <= 2 { 0.0 } else { 0.05 })
                .collect(),
            acts: Some(
                (0..depth)
                    .map(|a| relu_row(if dead && a == 2 { 1.0 } else { 0.05 }))
                    .collect(),
            ),
            weight_gain: Some(0.6),
            input: Some(healthy_input()),
            loss: Some(1.0 - 0.001 * step as f64),
            lr: 0.01,
            nonfinite_module: None,
        }
    });
    let h = explain(&engine);
    let top = &h[0];
    assert_eq!(top.failure, Failure::DeadNeurons, "{top}");
    assert_eq!(top.cause, Cause::DyingRelu, "{top}");
    assert_eq!(top.layer.as_deref(), Some("act2"), "{top}");
    assert_eq!(top.step, Some(10));
    // The vanishing gradients are explained by it, located at the dead layer, and rank below.
    let v = h
        .iter()
        .find(|h| h.failure == Failure::VanishingGradients)
        .expect("vanishing is reported too");
    assert_eq!(v.layer.as_deref(), Some("act2"));
    assert!(v.confidence < top.confidence);
    // Asking for one failure changes which hypotheses come back, not their confidence: the
    // vanishing stays capped under the dead layer that explains it.
    let only = Analysis::new(&engine)
        .unwrap()
        .hypotheses(Some(Failure::VanishingGradients));
    assert_eq!(
        only,
        h.iter()
            .filter(|x| x.failure == Failure::VanishingGradients)
            .cloned()
            .collect::<Vec<_>>()
    );
    let roots = Analysis::new(&engine).unwrap().root_causes();
    assert_eq!(roots.len(), 1, "{roots:?}");
    // (The loss, 6% lower after 60 steps and still falling as fast as it began, creeps: that
    // follows from the dead layer too.)
    assert_eq!(
        roots[0].consequences,
        vec![Failure::VanishingGradients, Failure::LossPlateau]
    );
}

#[test]
fn vanishing_begins_where_it_starts_along_the_backward_pass() {
    // Geometric decay from the head towards the input; fc0..fc5 below 1e-6 from step 0.
    let depth = 20;
    let engine = run(mlp(depth, "Tanh", "SGD"), 40, |_| Step {
        layer_norms: (0..layers(depth))
            .map(|l| (0.1 * 10f64.powf(-0.4 * (layers(depth) - 1 - l) as f64)) as f32)
            .collect(),
        acts: Some(
            (0..depth)
                .map(|_| [0.5, 0.0, f32::NAN, 0.9, 64.0])
                .collect(),
        ),
        weight_gain: Some(0.58),
        input: Some(healthy_input()),
        loss: None,
        lr: 0.01,
        nonfinite_module: None,
    });
    let top = &explain(&engine)[0];
    assert_eq!(top.failure, Failure::VanishingGradients, "{top}");
    // 0.1 * 10^(-0.4 k) < 1e-6 for k >= 13: layers fc0..fc7 (k = 20..13) vanish; fc7 is last.
    assert_eq!(top.layer.as_deref(), Some("fc7"), "{top}");
    assert_eq!(top.step, Some(0));
    assert_eq!(top.cause, Cause::NetworkDepth, "{top}");
}

#[test]
fn nan_in_a_module_output_is_located_there_on_its_step() {
    let depth = 3;
    let engine = run(mlp(depth, "GELU", "Adam"), 40, |step| {
        let bad = step >= 25;
        Step {
            layer_norms: (0..layers(depth))
                .map(|_| if bad { f32::NAN } else { 0.1 })
                .collect(),
            acts: None,
            weight_gain: None,
            input: Some(healthy_input()),
            loss: Some(if bad { f64::NAN } else { 1.0 }),
            lr: 1e-3,
            // module 2 is fc1
            nonfinite_module: (step == 25).then_some(2),
        }
    });
    let top = &explain(&engine)[0];
    assert_eq!(top.failure, Failure::NonFinite, "{top}");
    assert_eq!(top.cause, Cause::NumericalInstability, "{top}");
    assert_eq!(top.layer.as_deref(), Some("fc1"));
    assert_eq!(top.step, Some(25));
}

#[test]
fn nan_born_in_the_loss_function_is_no_layers_fault() {
    // Every module output finite (checked), the loss NaN: log(0) in the criterion.
    let depth = 3;
    let engine = run(mlp(depth, "ReLU", "SGD"), 30, |step| {
        let bad = step >= 14;
        Step {
            layer_norms: (0..layers(depth))
                .map(|_| if bad { f32::NAN } else { 0.1 })
                .collect(),
            acts: None,
            weight_gain: None,
            input: Some(healthy_input()),
            loss: Some(if bad { f64::INFINITY } else { 1.0 }),
            lr: 0.01,
            nonfinite_module: None,
        }
    });
    let top = &explain(&engine)[0];
    assert_eq!(top.failure, Failure::NonFinite, "{top}");
    assert_eq!(top.cause, Cause::NumericalInstability, "{top}");
    assert_eq!(top.step, Some(14));
    assert_eq!(top.layer, None, "{top}");
    assert!(top.description.contains("loss computation"), "{top}");
}

#[test]
fn a_nan_batch_is_the_data_not_the_first_layer() {
    let depth = 3;
    let engine = run(mlp(depth, "ReLU", "SGD"), 30, |step| {
        let bad = step >= 12;
        Step {
            layer_norms: (0..layers(depth))
                .map(|_| if bad { f32::NAN } else { 0.1 })
                .collect(),
            acts: None,
            weight_gain: None,
            input: Some(if step == 12 {
                [f32::NAN, f32::NAN, f32::NAN, f32::NAN]
            } else {
                healthy_input()
            }),
            loss: Some(if bad { f64::NAN } else { 1.0 }),
            lr: 0.01,
            nonfinite_module: (step == 12).then_some(0),
        }
    });
    let h = explain(&engine);
    assert_eq!(h[0].failure, Failure::DataAnomaly, "{}", h[0]);
    assert_eq!(h[0].cause, Cause::BadInputData);
    assert_eq!(h[0].step, Some(12));
    let nf = h.iter().find(|h| h.failure == Failure::NonFinite).unwrap();
    assert_eq!(nf.cause, Cause::BadInputData);
    assert_eq!(
        nf.layer, None,
        "NaN that came with the data is no layer's fault"
    );
}

/// Healthy for 30 steps, then the lr rises 100x and the gradients grow 4x per step.
fn blow_up_after_a_lr_raise() -> Engine {
    let depth = 3;
    run(mlp(depth, "ReLU", "SGD"), 60, |step| {
        let g = if step < 30 {
            0.2
        } else {
            0.2 * 10f32.powf((step - 29) as f32 * 0.6)
        };
        Step {
            layer_norms: (0..layers(depth)).map(|_| g).collect(),
            acts: None,
            weight_gain: Some(0.6),
            input: Some(healthy_input()),
            loss: Some(if step < 30 { 1.0 } else { f64::from(g) }),
            lr: if step < 30 { 0.01 } else { 1.0 },
            nonfinite_module: None,
        }
    })
}

#[test]
fn healthy_start_then_blow_up_points_to_the_learning_rate() {
    let engine = blow_up_after_a_lr_raise();
    let top = &explain(&engine)[0];
    assert_eq!(top.failure, Failure::ExplodingGradients, "{top}");
    assert_eq!(top.cause, Cause::LearningRateTooHigh, "{top}");
    // 0.2 * 10^(0.6 k) > 1e3 first for k = 7 -> step 36.
    assert_eq!(top.step, Some(36));
}

#[test]
fn failure_present_at_step_zero_points_to_initialization() {
    let depth = 3;
    let engine = run(mlp(depth, "ReLU", "SGD"), 30, |_| Step {
        layer_norms: (0..layers(depth)).map(|_| 5e4).collect(),
        acts: None,
        weight_gain: Some(20.0),
        input: Some(healthy_input()),
        loss: Some(1e4),
        lr: 1e-4,
        nonfinite_module: None,
    });
    let top = &explain(&engine)[0];
    assert_eq!(top.failure, Failure::ExplodingGradients, "{top}");
    assert_eq!(top.cause, Cause::PoorInitialization, "{top}");
    assert_eq!(top.step, Some(0));
}

/// The hypothesis on gradient norms high (not exploding) from the first step to the last, while
/// the loss falls, under weights of this gain and inputs of these statistics.
fn high_norms_from_the_start(gain: f32, input: [f32; INPUT_STATS]) -> CausalHypothesis {
    let depth = 3;
    let engine = run(mlp(depth, "ReLU", "SGD"), 60, |step| Step {
        layer_norms: vec![4.0; layers(depth)],
        acts: None,
        weight_gain: Some(gain),
        input: Some(input),
        loss: Some(2.0 / (1.0 + 0.02 * step as f64)),
        lr: 1e-3,
        nonfinite_module: None,
    });
    first_of(&explain(&engine), Failure::SaturatedGradients)
}

/// Under weights initialized at 5.7x a variance-preserving scale, the warning names the
/// weights; under ordinary weights and inputs nothing explains it.
#[test]
fn gradients_running_high_from_the_first_step_under_large_weights_name_them() {
    let h = high_norms_from_the_start(5.7, healthy_input());
    assert_eq!(h.cause, Cause::PoorInitialization, "{h}");
    assert_eq!(h.step, Some(0), "{h}");
    assert!(h.description.contains("initial weights are 5.7x"), "{h}");
    assert!(h.confidence < 0.5, "a warning, not a failure: {h}");
    assert_eq!(
        high_norms_from_the_start(0.6, healthy_input()).cause,
        Cause::Unknown
    );
}

/// Under ordinary weights and raw pixels (0-255), the warning names the data.
#[test]
fn gradients_running_high_from_the_first_step_under_raw_inputs_name_the_data() {
    let h = high_norms_from_the_start(0.6, [0.0, 255.0, 100.0, 80.0]);
    assert_eq!(h.cause, Cause::BadInputData, "{h}");
    assert!(h.description.contains("inputs reach magnitude 255"), "{h}");
}

#[test]
fn raw_inputs_exploding_at_the_first_step_are_the_data_even_after_a_huge_first_update() {
    // Raw pixels (0..255) and ordinary weights: the first SGD step is so large that the weight
    // norms read at its end are 20x a variance-preserving scale. They describe the update, not
    // the initialization.
    let depth = 3;
    let engine = run(mlp(depth, "ReLU", "SGD"), 30, |_| Step {
        layer_norms: (0..layers(depth)).map(|_| 5e4).collect(),
        acts: None,
        weight_gain: Some(20.0),
        input: Some([0.0, 255.0, 100.0, 80.0]),
        loss: Some(1e4),
        lr: 0.1,
        nonfinite_module: None,
    });
    let top = &explain(&engine)[0];
    assert_eq!(top.failure, Failure::ExplodingGradients, "{top}");
    assert_eq!(top.cause, Cause::BadInputData, "{top}");
    assert_eq!(top.step, Some(0));
}

/// A 4-layer sigmoid MLP whose activations saturate from step `saturated_from` and whose
/// first three layers' gradients vanish from step `vanishing_from`.
fn sigmoids_saturating(saturated_from: u64, vanishing_from: u64, steps: u64) -> Engine {
    let depth = 4;
    run(mlp(depth, "Sigmoid", "SGD"), steps, |step| Step {
        layer_norms: (0..layers(depth))
            .map(|l| {
                if step >= vanishing_from && l < 3 {
                    1e-8
                } else {
                    0.05
                }
            })
            .collect(),
        acts: Some(
            (0..depth)
                .map(|_| {
                    if step >= saturated_from {
                        [1.0, 0.95, f32::NAN, 0.01, 64.0]
                    } else {
                        [0.7, 0.0, f32::NAN, 0.22, 64.0]
                    }
                })
                .collect(),
        ),
        weight_gain: Some(1.0),
        input: Some(healthy_input()),
        loss: None,
        lr: 0.1,
        nonfinite_module: None,
    })
}

#[test]
fn saturation_before_vanishing_points_to_the_activation() {
    let engine = sigmoids_saturating(5, 5, 30);
    let h = explain(&engine);
    assert_eq!(h[0].failure, Failure::VanishingGradients, "{}", h[0]);
    assert_eq!(h[0].cause, Cause::SaturatingActivation, "{}", h[0]);
    assert_eq!(h[0].step, Some(5));
    let chain = Analysis::new(&engine)
        .unwrap()
        .causal_chain(Failure::VanishingGradients);
    assert!(
        chain
            .iter()
            .any(|e| e.event_type == EventType::GradientHealth)
    );
}

/// Sigmoids saturate from step 3; the gradients behind them vanish from step 12. The saturation
/// ranks under the vanishing it brings about, and its evidence says so in time order.
#[test]
fn a_saturation_that_began_first_leads_to_the_vanishing_it_ranks_under() {
    let h = explain(&sigmoids_saturating(3, 12, 40));
    assert_eq!(h[0].failure, Failure::VanishingGradients, "{:?}", shown(&h));
    assert_eq!(h[0].step, Some(12), "{:?}", shown(&h));
    let s = first_of(&h, Failure::SaturatedActivations);
    assert_eq!(s.step, Some(3), "{s}");
    assert!(
        s.description
            .contains("it leads to the vanishing gradients at step 12"),
        "{s}"
    );
    assert!(!s.description.contains("it follows from"), "{s}");
}

/// Raw inputs (magnitude 5,000) into a tanh MLP with ordinary weights: the first tanh is
/// saturated from the first step and the gradients behind it vanish. The inputs are the cause;
/// the same run on normalized inputs that saturate only later is the activation's.
#[test]
fn tanh_units_saturated_from_the_first_step_by_raw_inputs_blame_the_data() {
    let depth = 4;
    let run_with = |input: [f32; INPUT_STATS], saturated_from: u64| {
        let engine = run(mlp(depth, "Tanh", "SGD"), 40, |step| {
            let sat = step >= saturated_from;
            Step {
                layer_norms: (0..layers(depth))
                    .map(|l| if step >= 10 && l < 3 { 1e-8 } else { 0.05 })
                    .collect(),
                acts: Some(
                    (0..depth)
                        .map(|_| {
                            if sat {
                                [1.0, 0.98, f32::NAN, 0.01, 64.0]
                            } else {
                                [0.7, 0.0, f32::NAN, 0.6, 64.0]
                            }
                        })
                        .collect(),
                ),
                weight_gain: Some(1.0),
                input: Some(input),
                loss: None,
                lr: 0.1,
                nonfinite_module: None,
            }
        });
        explain(&engine)
    };
    let h = run_with([-5000.0, 5000.0, 40.0, 900.0], 0);
    assert_eq!(h[0].failure, Failure::VanishingGradients, "{:?}", shown(&h));
    assert_eq!(h[0].cause, Cause::BadInputData, "{:?}", shown(&h));
    assert!(
        h[0].description
            .contains("inputs reach magnitude 5000 (not normalized)"),
        "{}",
        h[0]
    );
    let h = run_with(healthy_input(), 3);
    assert_eq!(h[0].cause, Cause::SaturatingActivation, "{:?}", shown(&h));
}

#[test]
fn only_one_failure_kind_when_asked_and_mermaid_names_it() {
    let depth = 3;
    let engine = run(mlp(depth, "ReLU", "SGD"), 30, |step| Step {
        layer_norms: (0..layers(depth))
            .map(|_| if step >= 10 { f32::INFINITY } else { 0.1 })
            .collect(),
        acts: None,
        weight_gain: None,
        input: None,
        loss: None,
        lr: 0.01,
        nonfinite_module: None,
    });
    let a = Analysis::new(&engine).unwrap();
    let only = a.hypotheses(Some(Failure::NonFinite));
    assert!(!only.is_empty() && only.iter().all(|h| h.failure == Failure::NonFinite));
    assert!(a.hypotheses(Some(Failure::LossPlateau)).is_empty());
    assert!(a.mermaid().contains("non_finite"));
    // The gradient went non-finite in every layer at once: the backward pass brought it in at
    // the layer latest in forward order.
    assert_eq!(only[0].layer.as_deref(), Some("head"));
}

#[test]
fn couplings_distinguish_adjacent_layers_from_mere_timing() {
    let depth = 4;
    let engine = run(mlp(depth, "ReLU", "SGD"), 30, |step| Step {
        // fc0 and fc1 vanish at step 5; act0 (between them) dies at step 7.
        layer_norms: (0..layers(depth))
            .map(|l| if step >= 5 && l <= 1 { 1e-9 } else { 0.1 })
            .collect(),
        acts: Some(
            (0..depth)
                .map(|a| relu_row(if step >= 7 && a == 0 { 1.0 } else { 0.05 }))
                .collect(),
        ),
        weight_gain: None,
        input: None,
        loss: None,
        lr: 0.01,
        nonfinite_module: None,
    });
    let c = Analysis::new(&engine).unwrap().couplings(5);
    let kinds: Vec<_> = c
        .iter()
        .map(|c| {
            (
                engine.subject_name(c.first.subject),
                engine.subject_name(c.second.subject),
                c.kind,
                c.lag,
            )
        })
        .collect();
    // fc0-fc1: same step but act0 sits between them; fc0-act0 and act0-fc1 are adjacent.
    assert!(
        kinds.contains(&("fc0".into(), "fc1".into(), Temporal, 0)),
        "{kinds:?}"
    );
    assert!(
        kinds.contains(&("fc0".into(), "act0".into(), Structural, 2)),
        "{kinds:?}"
    );
    assert!(
        kinds.contains(&("fc1".into(), "act0".into(), Structural, 2)),
        "{kinds:?}"
    );
    assert_eq!(kinds.len(), 3, "{kinds:?}");
    assert!(Analysis::new(&engine).unwrap().couplings(1).len() == 1);
}

#[test]
fn replaying_the_same_observations_gives_the_same_diagnosis() {
    let depth = 3;
    let make = |step: u64| Step {
        layer_norms: (0..layers(depth))
            .map(|l| {
                if step > 20 && l == 0 {
                    1e-9
                } else {
                    0.1 / (1.0 + l as f32)
                }
            })
            .collect(),
        acts: Some((0..depth).map(|_| relu_row(0.1)).collect()),
        weight_gain: Some(0.6),
        input: Some(healthy_input()),
        loss: Some(2.0 / (1.0 + step as f64)),
        lr: 0.01,
        nonfinite_module: None,
    };
    let a = run(mlp(depth, "ReLU", "SGD"), 50, make);
    let b = run(mlp(depth, "ReLU", "SGD"), 50, make);
    assert_eq!(explain(&a), explain(&b));
    assert_eq!(a.events(), b.events());
}

/// fc0's gradient is `at_start` for the first `tiny_for` steps, then healthy; the loss falls
/// (or stays flat).
fn tiny_gradient_at_the_start(tiny_for: u64, at_start: f32, loss_falls: bool) -> Engine {
    let depth = 3;
    run(mlp(depth, "ReLU", "Adam"), 80, |step| Step {
        layer_norms: (0..layers(depth))
            .map(|l| {
                if l == 0 && step < tiny_for {
                    at_start
                } else {
                    0.05
                }
            })
            .collect(),
        acts: None,
        weight_gain: Some(0.6),
        input: Some(healthy_input()),
        loss: Some(if loss_falls {
            0.7 * (-(step as f64) / 30.0).exp() + 0.05
        } else {
            0.7
        }),
        lr: 1e-3,
        nonfinite_module: None,
    })
}

#[test]
fn a_gradient_tiny_at_the_start_that_recovers_while_the_loss_falls_is_a_normal_beginning() {
    // LoRA's lora_A: exactly zero at the first step (lora_B starts at zero); attention's
    // query/key: about 4e-7 for the first steps.
    for (tiny_for, at_start) in [(1, 0.0), (3, 0.0), (10, 4e-7)] {
        let engine = tiny_gradient_at_the_start(tiny_for, at_start, true);
        let h = explain(&engine);
        assert!(
            h.iter()
                .all(|h| h.failure != Failure::VanishingGradients || h.confidence < 0.3),
            "{tiny_for} steps at {at_start}: {}",
            h[0]
        );
        assert!(h.first().is_none_or(|h| h.confidence < 0.5), "{}", h[0]);
    }
    // Not a beginning: tiny for longer than the first steps, or while the loss stays flat.
    let long = tiny_gradient_at_the_start(60, 0.0, true);
    let v = explain(&long);
    assert!(
        v.iter().any(|h| h.failure == Failure::VanishingGradients
            && h.layer.as_deref() == Some("fc0")
            && h.confidence
                > explain(&tiny_gradient_at_the_start(10, 0.0, true))
                    .iter()
                    .filter(|h| h.failure == Failure::VanishingGradients)
                    .map(|h| h.confidence)
                    .fold(0.0, f64::max)),
        "{v:?}"
    );
    let flat = explain(&tiny_gradient_at_the_start(10, 0.0, false));
    let recovered = explain(&tiny_gradient_at_the_start(10, 0.0, true));
    let best = |h: &[CausalHypothesis]| {
        h.iter()
            .filter(|h| h.failure == Failure::VanishingGradients)
            .map(|h| h.confidence)
            .fold(0.0, f64::max)
    };
    assert!(best(&flat) > best(&recovered), "{flat:?}");
}

#[test]
fn a_later_episode_of_the_same_failure_is_evidence_of_the_first_not_a_rival() {
    // fc1 vanishes from step 0 to the end; fc3 vanishes at step 52 for 7 steps.
    let depth = 5;
    let engine = run(mlp(depth, "Sigmoid", "SGD"), 120, |step| Step {
        layer_norms: (0..layers(depth))
            .map(|l| match l {
                0 | 1 => 1e-8,
                3 if (52..59).contains(&step) => 1e-8,
                _ => 1e-3,
            })
            .collect(),
        acts: None,
        weight_gain: Some(0.6),
        input: Some(healthy_input()),
        loss: Some(0.69),
        lr: 0.1,
        nonfinite_module: None,
    });
    let h = explain(&engine);
    let top = &h[0];
    assert_eq!(top.failure, Failure::VanishingGradients, "{top}");
    assert_eq!(top.step, Some(0), "{top}");
    assert_eq!(top.layer.as_deref(), Some("fc1"), "{top}");
    // One failure, one finding: the later episode is no hypothesis of its own, the first
    // finding's sentence tells it.
    assert!(
        h.iter()
            .all(|h| h.failure != Failure::VanishingGradients || h.step == Some(0)),
        "{h:?}"
    );
    assert!(
        top.description.ends_with(
            "It appeared again later, part of the same failure: at step 52 in `fc3`, for 7 steps."
        ),
        "{}",
        top.description
    );
    // Its root event is part of the first finding's chain.
    assert!(
        top.causal_chain.iter().any(|l| l.contains("fc3")),
        "{:?}",
        top.causal_chain
    );
}

#[test]
fn evidence_features_list_what_the_ranking_weighed() {
    let engine = blow_up_after_a_lr_raise();
    let a = Analysis::new(&engine).unwrap();
    let top = &a.hypotheses(None)[0];
    let ev = a.evidence_features();
    assert_eq!(ev["run"]["lr_first"].as_f64(), Some(0.01));
    let e = ev["episodes"]
        .as_array()
        .unwrap()
        .iter()
        .find(|e| e["failure"] == top.failure.as_str() && e["onset"].as_u64() == top.step)
        .expect("the top hypothesis' episode is listed");
    let causes = e["causes"].as_array().unwrap();
    // Ranked as the hypotheses are: the top cause first, probabilities a softmax of the scores.
    assert_eq!(causes[0]["cause"], top.cause.as_str());
    let p: Vec<f64> = causes.iter().map(|c| c["p"].as_f64().unwrap()).collect();
    let score: Vec<f64> = causes
        .iter()
        .map(|c| c["score"].as_f64().unwrap())
        .collect();
    assert!((p.iter().sum::<f64>() - 1.0).abs() < 1e-9, "{p:?}");
    assert!(score.windows(2).all(|w| w[0] >= w[1]), "{score:?}");
    assert!(!causes[0]["reasons"].as_array().unwrap().is_empty());
    assert!(e["features"]["lr_spike"].as_f64().unwrap() > 10.0, "{e}");
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(48))]

    /// Healthy training: gradient norms wander inside the healthy band (with occasional >1
    /// "saturated" warnings), activations alive and unsaturated, the loss noisy but falling.
    /// No hypothesis may reach confidence 0.5.
    #[test]
    fn healthy_noise_is_never_a_confident_failure(
        seed in 0u64..1_000_000,
        depth in 2usize..12,
        steps in 30u64..300,
        scale in 1e-4f64..0.5,
    ) {
        let mut x = seed;
        let mut rand = move || {
            x ^= x << 13; x ^= x >> 7; x ^= x << 17;
            (x % 1_000_000) as f64 / 1_000_000.0
        };
        let engine = run(mlp(depth, "ReLU", "Adam"), steps, |step| Step {
            layer_norms: (0..layers(depth))
                .map(|_| (scale * (0.3 + 4.0 * rand())) as f32)
                .collect(),
            acts: Some((0..depth).map(|_| relu_row((0.2 * rand()) as f32)).collect()),
            weight_gain: Some(0.6),
            input: Some([
                (-3.0 - rand()) as f32, (3.0 + rand()) as f32, (0.1 * rand()) as f32,
                (1.0 + 0.1 * rand()) as f32,
            ]),
            loss: Some(2.3 * (-(step as f64) / 100.0).exp() + 0.2 + 0.1 * rand()),
            lr: 1e-3,
            nonfinite_module: None,
        });
        let h = explain(&engine);
        let top = h.first().map_or(0.0, |h| h.confidence);
        prop_assert!(top < 0.5, "{}", h[0]);
    }

    /// Whatever the run, a hypothesis of unknown cause is never a finding on its own.
    #[test]
    fn unknown_cause_is_never_at_half_or_above(
        seed in 0u64..1_000_000,
        depth in 2usize..8,
        blow_up in 0u64..60,
        vanish_from in 0u64..60,
    ) {
        let mut x = seed | 1;
        let mut rand = move || {
            x ^= x << 13; x ^= x >> 7; x ^= x << 17;
            (x % 1_000_000) as f64 / 1_000_000.0
        };
        let engine = run(mlp(depth, "Tanh", "SGD"), 60, |step| Step {
            layer_norms: (0..layers(depth))
                .map(|l| {
                    let base = if step >= blow_up && l % 2 == 0 {
                        10f64.powf(3.0 + 3.0 * rand())
                    } else if step >= vanish_from && l % 2 == 1 {
                        1e-9 * rand()
                    } else {
                        0.1 * rand()
                    };
                    base as f32
                })
                .collect(),
            acts: None,
            weight_gain: Some((0.1 + 3.0 * rand()) as f32),
            input: Some(healthy_input()),
            loss: Some(1.0 + 10.0 * rand()),
            lr: 1e-2,
            nonfinite_module: None,
        });
        for h in explain(&engine) {
            prop_assert!(h.cause != Cause::Unknown || h.confidence < 0.5, "{}", h);
        }
    }

    /// A gradient norm that hovers around the vanishing threshold, inside the hysteresis band,
    /// yields at most one transition per layer, whatever the jitter.
    #[test]
    fn hovering_at_a_threshold_does_not_flood_events(jitter in proptest::collection::vec(0.55f64..1.9, 50..400)) {
        let depth = 2;
        let n = jitter.len() as u64;
        let engine = run(mlp(depth, "ReLU", "SGD"), n, |step| Step {
            layer_norms: (0..layers(depth)).map(|_| (jitter[step as usize] * 1e-6) as f32).collect(),
            acts: None, weight_gain: None, input: None, loss: None, lr: 0.01, nonfinite_module: None,
        });
        let grad_events = engine
            .events()
            .into_iter()
            .filter(|e| e.event_type == EventType::GradientHealth)
            .count();
        prop_assert!(grad_events <= layers(depth), "{grad_events} events");
        for e in engine.events() {
            prop_assert!(matches!(e.to_state, State::Gradient(GradientHealth::Vanishing)));
        }
    }
}

/// A classifier over 10 classes (cross-entropy on raw logits).
fn classifier(depth: usize) -> ModelSpec {
    let mut spec = mlp(depth, "ReLU", "SGD");
    spec.loss = Some(neuraldbg_core::LossSpec {
        ops: vec!["NllLoss".into(), "LogSoftmax".into()],
        output_op: Some("Addmm".into()),
        output_units: Some(10),
        ..Default::default()
    });
    spec
}

/// A small deterministic noise in [-1, 1).
fn wobble(step: u64) -> f64 {
    let x = step.wrapping_mul(2_654_435_761) % 1000;
    x as f64 / 500.0 - 1.0
}

fn healthy_step(depth: usize, loss: f64) -> Step {
    Step {
        layer_norms: (0..layers(depth)).map(|_| 0.05).collect(),
        acts: Some((0..depth).map(|_| relu_row(0.05)).collect()),
        weight_gain: Some(0.6),
        input: Some(healthy_input()),
        loss: Some(loss),
        lr: 0.01,
        nonfinite_module: None,
    }
}

#[test]
fn a_classifier_whose_loss_stays_at_chance_is_not_learning() {
    // The loss falls from a badly scaled start to ln 10 (the class prior) and stays there:
    // below 90% of where it started, so no ordinary plateau, yet it learned nothing.
    let depth = 3;
    let chance = 10f64.ln();
    let engine = run(classifier(depth), 300, |step| {
        let start = 6.0 * (-(step as f64) / 5.0).exp();
        healthy_step(depth, chance + start + 0.01 * wobble(step))
    });
    let plateau = first_of(&explain(&engine), Failure::LossPlateau);
    assert!(plateau.description.contains("chance level"), "{plateau}");
    assert!(plateau.step.is_some_and(|s| s < 60), "{plateau}");
    // The same run that keeps learning below chance is no plateau.
    let engine = run(classifier(depth), 300, |step| {
        let start = 6.0 * (-(step as f64) / 5.0).exp();
        healthy_step(
            depth,
            chance * (-(step as f64) / 80.0).exp() + start + 0.01 * wobble(step),
        )
    });
    let h = explain(&engine);
    assert!(h.iter().all(|h| h.failure != Failure::LossPlateau), "{h:?}");
    assert!(h.iter().all(|h| h.confidence < 0.5), "{h:?}");
}

#[test]
fn a_loss_that_begins_at_chance_and_creeps_along_it_learned_nothing() {
    // Just above ln 10 at the first step, creeping 2.5% lower every 50 steps to just below it
    // by step 110, flat after that: the loss counts as flat only from step ~90, the last
    // third of the run, yet the model never got better than a constant guess.
    let depth = 3;
    let chance = 10f64.ln();
    let engine = run(classifier(depth), 150, |step| {
        let level = 1.04 - 0.0005 * step.min(110) as f64;
        healthy_step(depth, chance * level + 0.005 * wobble(step))
    });
    let plateau = first_of(&explain(&engine), Failure::LossPlateau);
    assert!(
        plateau.description.contains("at its chance level"),
        "{plateau}"
    );
}

/// A classifier at its chance level from the first step to the last, under weights initialized
/// at 0.006x a variance-preserving scale: the signal shrinks ~170x per layer, the output starts
/// out constant. The plateau is the initialization's; under ordinary weights it is not.
#[test]
fn a_plateau_at_chance_from_the_start_under_tiny_weights_blames_them() {
    let depth = 3;
    let chance = 10f64.ln();
    let run_with = |gain: f32| {
        let engine = run(classifier(depth), 150, |step| Step {
            weight_gain: Some(gain),
            ..healthy_step(depth, chance + 0.01 * wobble(step))
        });
        first_of(&explain(&engine), Failure::LossPlateau)
    };
    let h = run_with(0.006);
    assert_eq!(h.cause, Cause::PoorInitialization, "{h}");
    assert_eq!(h.step, Some(0), "{h}");
    assert!(h.confidence >= 0.5, "{h}");
    assert!(h.description.contains("only 0.006x"), "{h}");
    assert_ne!(run_with(0.6).cause, Cause::PoorInitialization);
}

#[test]
fn a_loss_that_bounces_instead_of_descending_points_at_the_learning_rate() {
    // Steps that overshoot: each step's loss swings to the other side of its level
    // (negatively correlated changes), around a level that creeps up instead of falling.
    let depth = 3;
    let mut x = 0.0f64;
    let engine = run(classifier(depth), 400, |step| {
        x = -0.85 * x + 0.5 * wobble(step);
        healthy_step(depth, 2.0 + 0.002 * step as f64 + x)
    });
    let a = Analysis::new(&engine).unwrap();
    let h = a.hypotheses(Some(Failure::LossPlateau));
    let top = h
        .first()
        .unwrap_or_else(|| panic!("no plateau: {:?} {:?}", explain(&engine), engine.events()));
    assert_eq!(top.cause, Cause::LearningRateTooHigh, "{top}");
    assert!(top.description.contains("reverses direction"), "{top}");
    let run = &a.evidence_features()["run"];
    assert!(run["loss_alternation"].as_f64().unwrap() > 0.85, "{run}");
}

#[test]
fn a_layer_that_settles_where_default_relus_sit_is_judged_by_its_end_not_its_peak() {
    // act1 is 80% dead over steps 5-14, then `end` dead to the end; gradients healthy.
    let depth = 3;
    let run_with = |end: f32| {
        run(mlp(depth, "ReLU", "Adam"), 120, |step| Step {
            layer_norms: vec![0.05; layers(depth)],
            acts: Some(act1_dead(
                depth,
                match step {
                    5..15 => 0.8,
                    15.. => end,
                    _ => 0.05,
                },
            )),
            weight_gain: Some(0.6),
            input: Some(healthy_input()),
            loss: Some(1.0 - 0.005 * step as f64),
            lr: 1e-3,
            nonfinite_module: None,
        })
    };
    let dead = |h: &[CausalHypothesis]| {
        h.iter()
            .filter(|h| h.failure == Failure::DeadNeurons)
            .map(|h| h.confidence)
            .fold(0.0, f64::max)
    };
    // Settled at 60% (about where a default-initialized ReLU layer can sit): no alarm, and
    // the sentence gives both shares.
    let h = explain(&run_with(0.6));
    assert!(
        dead(&h) < 0.5,
        "{:?}",
        h.iter().map(ToString::to_string).collect::<Vec<_>>()
    );
    let d = h
        .iter()
        .find(|h| h.failure == Failure::DeadNeurons)
        .expect("still listed");
    assert!(
        d.description.contains("(80% at worst, 60% at the end)"),
        "{}",
        d.description
    );
    // Still 95% dead at the end: a dead layer.
    let h = explain(&run_with(0.95));
    assert!(
        dead(&h) >= 0.5,
        "{:?}",
        h.iter().map(ToString::to_string).collect::<Vec<_>>()
    );
}

/// [`run`], with the measured update-to-weight ratio of every parameter (`update`) on the
/// sampled steps (the first five, then every tenth).
fn run_measured(
    spec: ModelSpec,
    steps: u64,
    update: f32,
    mut f: impl FnMut(u64) -> Step,
) -> Engine {
    let params = spec.params.len();
    let mut engine = Engine::new(Config::default()).unwrap();
    engine.register_model(spec).unwrap();
    for step in 0..steps {
        let mut obs = observation(step, &f(step));
        if step < 5 || step % 10 == 0 {
            obs.measures = vec![(Measure::UpdateRatio, vec![update; params])];
        }
        engine.observe(&obs.view()).unwrap();
    }
    engine
}

fn shown(h: &[CausalHypothesis]) -> Vec<String> {
    h.iter().map(ToString::to_string).collect()
}

/// The most confident hypothesis of `failure`; the test fails when there is none.
fn first_of(h: &[CausalHypothesis], failure: Failure) -> CausalHypothesis {
    h.iter()
        .find(|h| h.failure == failure)
        .cloned()
        .unwrap_or_else(|| panic!("no {failure}: {:?}", shown(h)))
}

#[test]
fn units_half_dead_from_initialization_that_all_die_under_huge_steps_blame_the_learning_rate() {
    // act1 is half dead from the first step (a ReLU behind a bounded layer can sit there: the
    // first measurement counts as dead) and 100% dead from step 3; the weights move by
    // `update` of their size per step.
    let depth = 3;
    let run_with = |update: f32| {
        let engine = run_measured(mlp(depth, "ReLU", "SGD"), 120, update, |step| Step {
            layer_norms: vec![0.05; layers(depth)],
            acts: Some(act1_dead(
                depth,
                match step {
                    0 => 0.5,
                    1..3 => 0.45,
                    _ => 1.0,
                },
            )),
            weight_gain: Some(0.6),
            input: Some(healthy_input()),
            loss: Some(1.0 - 0.002 * step as f64),
            lr: 0.5,
            nonfinite_module: None,
        });
        explain(&engine)
    };
    // Steps of 0.3 of the weights' size: the learning rate, with both shares in the sentence.
    let h = run_with(0.3);
    let top = first_of(&h, Failure::DeadNeurons);
    assert_eq!(top.cause, Cause::LearningRateTooHigh, "{:?}", shown(&h));
    assert!(
        top.description
            .contains("50% of the units were dead at first and 100% after updates"),
        "{top}"
    );
    // The same deaths under steps of a training size: the units died, nothing says why.
    let h = run_with(1e-3);
    assert_eq!(
        first_of(&h, Failure::DeadNeurons).cause,
        Cause::DyingRelu,
        "{:?}",
        shown(&h)
    );
}

/// The same layer dead from the first measurement on (half, then all from the second step),
/// an episode at the start: on ordinary inputs, steps measured 300x a training one name the
/// learning rate; on raw inputs (magnitude 2,000) nothing says the updates killed them.
#[test]
fn units_dead_from_the_first_step_that_all_die_under_huge_steps_blame_them_on_ordinary_inputs() {
    let depth = 3;
    let run_with = |input: [f32; INPUT_STATS]| {
        let engine = run_measured(mlp(depth, "ReLU", "Adam"), 120, 0.3, |step| Step {
            layer_norms: vec![0.05; layers(depth)],
            acts: Some(act1_dead(
                depth,
                match step {
                    0 => 0.5,
                    _ => 1.0,
                },
            )),
            weight_gain: Some(0.6),
            input: Some(input),
            loss: Some(1.0 - 0.002 * step as f64),
            lr: 5.0,
            nonfinite_module: None,
        });
        first_of(&explain(&engine), Failure::DeadNeurons)
    };
    let top = run_with(healthy_input());
    assert_eq!(top.step, Some(0), "{top}");
    assert_eq!(top.cause, Cause::LearningRateTooHigh, "{top}");
    assert!(
        top.description
            .contains("50% of the units were dead at first and 100% after updates"),
        "{top}"
    );
    let top = run_with([-2000.0, 2000.0, 0.0, 500.0]);
    assert_ne!(top.cause, Cause::LearningRateTooHigh, "{top}");
}

#[test]
fn gradients_that_vanish_after_a_healthy_start_under_huge_steps_blame_the_learning_rate() {
    // Healthy gradients until step 4, then vanished in every layer to the end; the loss stays
    // where it got to.
    let depth = 3;
    let run_with = |update: f32| {
        let engine = run_measured(mlp(depth, "ReLU", "SGD"), 120, update, |step| Step {
            layer_norms: vec![if step < 4 { 0.05 } else { 1e-9 }; layers(depth)],
            acts: None,
            weight_gain: Some(0.6),
            input: Some(healthy_input()),
            loss: Some(if step < 4 {
                1.0 - 0.01 * step as f64
            } else {
                0.96
            }),
            lr: 0.3,
            nonfinite_module: None,
        });
        explain(&engine)
    };
    let h = run_with(0.3);
    let v = first_of(&h, Failure::VanishingGradients);
    assert_eq!(v.cause, Cause::LearningRateTooHigh, "{:?}", shown(&h));
    assert!(v.confidence >= 0.5, "{v}");
    assert!(v.description.contains("300x the ~1e-3"), "{v}");
    // Steps of a training size: nothing says the learning rate.
    let h = run_with(1e-3);
    assert_ne!(
        first_of(&h, Failure::VanishingGradients).cause,
        Cause::LearningRateTooHigh,
        "{:?}",
        shown(&h)
    );
}

#[test]
fn gradients_that_vanish_while_the_loss_diverges_are_its_consequence() {
    // The loss diverges from step 10 to the end; the gradients vanish from step 60.
    let depth = 3;
    let engine = run_measured(mlp(depth, "ReLU", "SGD"), 150, 1e-3, |step| Step {
        layer_norms: vec![if step < 60 { 0.05 } else { 1e-9 }; layers(depth)],
        acts: None,
        weight_gain: Some(0.6),
        input: Some(healthy_input()),
        loss: Some(if step < 10 {
            1.0 - 0.01 * step as f64
        } else {
            0.9 * 1.08f64.powi((step - 10).min(40) as i32)
        }),
        lr: 0.3,
        nonfinite_module: None,
    });
    let h = explain(&engine);
    let top = &h[0];
    assert_eq!(top.failure, Failure::LossDivergence, "{:?}", shown(&h));
    let v = first_of(&h, Failure::VanishingGradients);
    assert!(v.confidence < top.confidence, "{:?}", shown(&h));
    assert!(
        v.description
            .contains("it follows from the loss divergence at step"),
        "{v}"
    );
}

/// The plateau hypotheses of 150 healthy steps of a rectified MLP of `depth` under `optimizer`
/// whose loss `flattened`, each step measured to move the weights by `update` of their size,
/// weights at `gain` of a variance-preserving scale, learning rate `lr`.
fn flattened_under(
    depth: usize,
    optimizer: &str,
    update: f32,
    gain: f32,
    lr: f64,
) -> Vec<CausalHypothesis> {
    let engine = run_measured(mlp(depth, "ReLU", optimizer), 150, update, |step| Step {
        layer_norms: vec![0.05; layers(depth)],
        acts: None,
        weight_gain: Some(gain),
        input: Some(healthy_input()),
        loss: Some(flattened(step)),
        lr,
        nonfinite_module: None,
    });
    Analysis::new(&engine)
        .unwrap()
        .hypotheses(Some(Failure::LossPlateau))
}

/// A loss that falls for 20 steps, then stays flat (a little noise) to step 150.
fn flattened(step: u64) -> f64 {
    if step < 20 {
        2.0 - 0.02 * step as f64
    } else {
        1.6 + 0.002 * (step % 3) as f64
    }
}

#[test]
fn a_plateau_behind_hidden_sigmoids_that_pass_back_a_quarter_blames_the_activation() {
    // Three bounded hidden layers whose mean slope is `slope` from the first step.
    let depth = 3;
    let run_with = |act: &str, slope: f32| {
        let engine = run(mlp(depth, act, "Adam"), 150, |step| Step {
            layer_norms: vec![0.05; layers(depth)],
            acts: Some(vec![[0.9, 0.0, f32::NAN, slope, 64.0]; depth]),
            weight_gain: Some(0.6),
            input: Some(healthy_input()),
            loss: Some(flattened(step)),
            lr: 1e-3,
            nonfinite_module: None,
        });
        Analysis::new(&engine)
            .unwrap()
            .hypotheses(Some(Failure::LossPlateau))
    };
    let h = run_with("Sigmoid", 0.245);
    let top = h
        .first()
        .unwrap_or_else(|| panic!("no plateau: {:?}", shown(&h)));
    assert_eq!(top.cause, Cause::SaturatingActivation, "{:?}", shown(&h));
    assert!(
        top.description
            .contains("behind 3 hidden Sigmoid layer(s) that each pass back at most 25%"),
        "{top}"
    );
    // Tanh layers that pass back most of the gradient say nothing about the plateau.
    let h = run_with("Tanh", 0.9);
    assert!(
        h.iter()
            .all(|h| h.cause != Cause::SaturatingActivation || h.confidence < 0.1),
        "{:?}",
        shown(&h)
    );
}

#[test]
fn a_plateau_under_steps_measured_a_hundred_times_too_large_blames_the_learning_rate() {
    let depth = 3;
    let run_with = |update: f32| flattened_under(depth, "SGD", update, 0.6, 0.5);
    let h = run_with(0.1);
    let top = h
        .first()
        .unwrap_or_else(|| panic!("no plateau: {:?}", shown(&h)));
    assert_eq!(top.cause, Cause::LearningRateTooHigh, "{:?}", shown(&h));
    assert!(top.description.contains("about 100x the ~1e-3"), "{top}");
    // Steps of a training size: the learning rate is not named.
    let h = run_with(2e-3);
    assert!(
        h.iter()
            .all(|h| h.cause != Cause::LearningRateTooHigh || h.confidence < 0.1),
        "{:?}",
        shown(&h)
    );
}

/// Adam moves tiny weights by a large share of their size: under weights initialized at 0.01x
/// a variance-preserving scale, a step of 0.4 of the weights says the weights are small, not
/// that the learning rate is large, and the plateau is the initialization's.
#[test]
fn a_plateau_under_tiny_initial_weights_blames_them_not_the_large_relative_steps() {
    let depth = 3;
    let run_with = |gain: f32| flattened_under(depth, "Adam", 0.4, gain, 1e-3);
    let h = run_with(0.01);
    let top = h
        .first()
        .unwrap_or_else(|| panic!("no plateau: {:?}", shown(&h)));
    assert_eq!(top.cause, Cause::PoorInitialization, "{:?}", shown(&h));
    assert!(
        top.description.contains("initial weights are only 0.01x"),
        "{top}"
    );
    assert!(
        h.iter()
            .all(|h| h.cause != Cause::LearningRateTooHigh || h.confidence < 0.1),
        "{:?}",
        shown(&h)
    );
    // The same steps on weights of an ordinary scale: they are too large.
    let h = run_with(0.6);
    assert_eq!(h[0].cause, Cause::LearningRateTooHigh, "{:?}", shown(&h));
}

/// Weights read after a first step that moved them by 30x their size: a large reading is the
/// step's, not the initialization's (Adam's first step moves every weight by about the
/// learning rate); a reading still far below a variance-preserving scale bounds the initial
/// one, and stays evidence.
#[test]
fn weights_read_after_a_first_step_larger_than_them_describe_the_init_only_when_still_small() {
    let depth = 3;
    let gain_after = |gain: f32| {
        let spec = mlp(depth, "ReLU", "Adam");
        let params = spec.params.len();
        let mut engine = Engine::new(Config::default()).unwrap();
        engine.register_model(spec).unwrap();
        for step in 0..40 {
            let mut obs = observation(
                step,
                &Step {
                    layer_norms: vec![0.05; layers(depth)],
                    acts: None,
                    weight_gain: Some(gain),
                    input: Some(healthy_input()),
                    loss: Some(1.0),
                    lr: 5.0,
                    nonfinite_module: None,
                },
            );
            let ratio = if step == 0 { 30.0 } else { 0.3 };
            obs.measures = vec![(Measure::UpdateRatio, vec![ratio; params])];
            engine.observe(&obs.view()).unwrap();
        }
        Analysis::new(&engine).unwrap().evidence_features()["run"]["gain_median"].as_f64()
    };
    assert_eq!(gain_after(20.0), None);
    assert!(gain_after(0.01).is_some_and(|g| g < 0.25));
}

/// The loss "before any update" is the first one: a classifier that starts at its chance level
/// and jumps to 100x it after two huge steps made no confident wrong predictions at init.
#[test]
fn a_start_far_above_chance_is_read_on_the_first_loss_alone() {
    let depth = 3;
    let run_with = |first: f64| {
        let engine = run(classifier(depth), 120, |step| Step {
            loss: Some(match step {
                0 => first,
                1..=30 => 230.0,
                _ => 230.0 + wobble(step),
            }),
            ..healthy_step(depth, 0.0)
        });
        explain(&engine)
    };
    let said = |h: &[CausalHypothesis]| {
        h.iter().any(|h| {
            h.description
                .contains("before any update: the initial weights make")
        })
    };
    assert!(!said(&run_with(2.3)), "{:?}", shown(&run_with(2.3)));
    assert!(said(&run_with(230.0)), "{:?}", shown(&run_with(230.0)));
}

#[test]
fn units_partly_dead_before_any_update_are_said_with_their_share() {
    // act1 is half dead at the first step and entirely from the second: the initialization
    // explains the half, not the whole layer.
    let depth = 3;
    let run_with = |first: f32| {
        let engine = run(mlp(depth, "ReLU", "SGD"), 120, |step| Step {
            layer_norms: vec![0.05; layers(depth)],
            acts: Some(act1_dead(
                depth,
                match step {
                    0 => first,
                    _ => 1.0,
                },
            )),
            weight_gain: Some(0.6),
            input: Some(healthy_input()),
            loss: Some(1.0 - 0.002 * step as f64),
            lr: 1e-3,
            nonfinite_module: None,
        });
        Analysis::new(&engine)
            .unwrap()
            .hypotheses(Some(Failure::DeadNeurons))
    };
    let init = |h: &[CausalHypothesis]| {
        h.iter()
            .find(|h| h.cause == Cause::PoorInitialization)
            .cloned()
            .unwrap_or_else(|| panic!("no initialization: {:?}", shown(h)))
    };
    let half = init(&run_with(0.5));
    assert!(
        half.description
            .contains("50% of the units were dead at the first step, before any update"),
        "{half}"
    );
    // Dead from the first step: the whole layer, and a surer initialization.
    let whole = init(&run_with(1.0));
    assert!(
        whole
            .description
            .contains("the units were dead at the first step, before any update"),
        "{whole}"
    );
    assert!(whole.confidence > half.confidence, "{whole} / {half}");
}
