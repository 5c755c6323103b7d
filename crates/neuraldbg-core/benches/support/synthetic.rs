//! Synthetic models and observation streams for the engine's benchmarks (shared by the divan
//! bench and the memory example through `#[path]`).

#![allow(dead_code)] // each user takes what it needs

use neuraldbg_core::{ModelSpec, StepView};

/// `layers` x (`Linear` with weight and bias, then `ReLU`), and the root: what the `PyTorch`
/// collector registers for an MLP.
pub fn mlp(layers: usize) -> ModelSpec {
    let mut spec = ModelSpec::default();
    for i in 0..layers {
        let fc = spec.module(format!("{}", 2 * i), "Linear");
        spec.param(fc, format!("{}.weight", 2 * i), &[32, 32]);
        spec.param(fc, format!("{}.bias", 2 * i), &[32]);
        spec.module(format!("{}", 2 * i + 1), "ReLU");
    }
    spec.module("", "Sequential");
    spec.optimizer = Some("Adam".into());
    spec
}

/// A small, fast, deterministic generator (xorshift64*).
#[derive(Debug)]
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Self {
        Self(seed.max(1))
    }

    /// Uniform in [0, 1).
    pub fn next_f32(&mut self) -> f32 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        let x = self.0.wrapping_mul(0x2545_F491_4F6C_DD1D);
        (x >> 40) as f32 / (1u64 << 24) as f32
    }
}

/// What the collector sends by default: gradient norms every step; parameter norms and
/// activation statistics every `sample_every`-th step; one input batch and the loss each step.
#[derive(Debug)]
pub struct Stream {
    pub layers: usize,
    pub sample_every: u64,
    /// A few precomputed gradient vectors, cycled (healthy: norms around 0.1 with jitter).
    pub grads: Vec<Vec<f32>>,
    pub weights: Vec<f32>,
    pub activations: Vec<f32>,
    pub inputs: [f32; 4],
}

impl Stream {
    pub fn new(layers: usize, sample_every: u64) -> Self {
        let mut rng = Rng::new(42);
        let grads = (0..8)
            .map(|_| {
                (0..2 * layers)
                    .map(|p| {
                        let scale = if p % 2 == 0 { 0.1 } else { 0.01 };
                        scale * (0.8 + 0.4 * rng.next_f32())
                    })
                    .collect()
            })
            .collect();
        let weights = (0..2 * layers)
            .map(|p| if p % 2 == 0 { 18.0 } else { 0.5 })
            .collect();
        // absmax, saturated (unused for ReLU), dead fraction, slope (none), samples per unit
        let activations = (0..layers)
            .flat_map(|_| [3.0, f32::NAN, 0.1, f32::NAN, 64.0])
            .collect();
        Self {
            layers,
            sample_every,
            grads,
            weights,
            activations,
            inputs: [-3.0, 3.0, 0.0, 1.0],
        }
    }

    /// The observation of `step`, with gradient norms from `grads`.
    pub fn view_with<'a>(&'a self, step: u64, grads: &'a [f32]) -> StepView<'a> {
        let sampled = step % self.sample_every == 0;
        StepView {
            outputs_checked: false,
            step,
            grad_norms: grads,
            weight_norms: sampled.then_some(&self.weights[..]),
            activations: sampled.then_some(&self.activations[..]),
            inputs: &self.inputs,
            loss: Some(2.0 / (1.0 + step as f64 * 1e-3)),
            lr: Some(1e-3),
            nonfinite_module: None,
            facts: &[],
            measures: &[],
        }
    }

    pub fn view(&self, step: u64) -> StepView<'_> {
        self.view_with(step, &self.grads[(step % 8) as usize])
    }
}

/// A failure planted in a synthetic run, and the event that must report it.
#[derive(Clone, Copy, Debug)]
pub struct Planted {
    pub what: &'static str,
    /// Layer (gradient failures) or activation (dead units) index.
    pub index: usize,
    pub from: u64,
    pub to: u64,
    /// The gradient norm (both parameters) or dead fraction during the failure.
    pub value: f32,
}

/// The failures the memory run plants, scaled to `layers` and `steps`.
pub fn planted(layers: usize, steps: u64) -> Vec<Planted> {
    let at = |f: f64| (steps as f64 * f) as u64 / 10 * 10; // on a sampled step
    vec![
        Planted {
            what: "VANISHING",
            index: layers * 1234 / 10_000,
            from: at(0.3),
            to: at(0.3) + 1_000,
            value: 1e-9,
        },
        Planted {
            what: "DEAD",
            index: layers / 4,
            from: at(0.5),
            to: at(0.5) + 100,
            value: 0.9,
        },
        Planted {
            what: "EXPLODING",
            index: layers * 7777 / 10_000,
            from: at(0.65),
            to: at(0.65) + 20,
            value: 1e5,
        },
        Planted {
            what: "NON_FINITE",
            index: layers * 4242 / 10_000,
            from: at(0.9),
            to: at(0.9) + 1,
            value: f32::NAN,
        },
    ]
}

/// Feeds `steps` steps of the default collector stream with `plants` into `engine`.
pub fn run_planted(
    engine: &mut neuraldbg_core::Engine,
    layers: usize,
    steps: u64,
    plants: &[Planted],
) {
    let stream = Stream::new(layers, 10);
    let mut grads = Vec::new();
    let mut acts = stream.activations.clone();
    for step in 0..steps {
        let active: Vec<&Planted> = plants
            .iter()
            .filter(|p| (p.from..p.to).contains(&step))
            .collect();
        let base = &stream.grads[(step % 8) as usize];
        let mut view = if active.iter().any(|p| p.what != "DEAD") {
            grads.clear();
            grads.extend_from_slice(base);
            for p in active.iter().filter(|p| p.what != "DEAD") {
                grads[2 * p.index] = p.value;
                grads[2 * p.index + 1] = p.value;
            }
            stream.view_with(step, &grads)
        } else {
            stream.view_with(step, base)
        };
        if let Some(p) = active.iter().find(|p| p.what == "DEAD") {
            if view.activations.is_some() {
                acts[5 * p.index + 2] = p.value;
                view.activations = Some(&acts);
            }
        }
        engine.observe(&view).expect("observe");
        if let Some(p) = active.iter().find(|p| p.what == "DEAD") {
            acts[5 * p.index + 2] = stream.activations[5 * p.index + 2];
        }
    }
}

/// Checks that each planted failure produced its event, dated at its first step, on its
/// module; returns a description of what is missing.
pub fn missing(engine: &neuraldbg_core::Engine, plants: &[Planted]) -> Vec<String> {
    let events = engine.events();
    plants
        .iter()
        .filter_map(|p| {
            let module = if p.what == "DEAD" {
                2 * p.index + 1
            } else {
                2 * p.index
            };
            let found = events.iter().any(|e| {
                e.step == p.from
                    && e.subject == neuraldbg_core::Subject::Module(module)
                    && e.to_state.as_str() == p.what
            });
            (!found).then(|| format!("{} of module {module} at step {}", p.what, p.from))
        })
        .collect()
}
