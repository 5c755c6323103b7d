//! # neuraldbg-core
//!
//! The `NeuralDBG` engine: a causal debugger for deep-learning training that knows nothing
//! about any framework. A collector (the `PyTorch` package, a candle loop, a trace reader) registers a
//! [`ModelSpec`] and feeds one [`StepView`] of small statistics per training step; the engine
//! classifies gradient and activation health ([`GradientHealth`], [`ActivationHealth`]), emits a
//! [`SemanticEvent`] on each confirmed transition (causal compression), and on demand explains
//! the failure as ranked [`CausalHypothesis`] values.
//!
//! ```
//! use neuraldbg_core::{Config, Engine, ModelSpec, Observation};
//! use neuraldbg_core::analysis::Analysis;
//!
//! let mut engine = Engine::new(Config::default()).unwrap();
//! let mut spec = ModelSpec::default();
//! let fc = spec.module("fc", "Linear");
//! spec.param(fc, "fc.weight", &[8, 8]);
//! spec.module("", "Net");
//! engine.register_model(spec).unwrap();
//! for step in 0..20 {
//!     let norm = if step < 10 { 0.1 } else { f32::NAN };
//!     engine.observe(&Observation { step, grad_norms: vec![norm], ..Default::default() }.view()).unwrap();
//! }
//! let analysis = Analysis::new(&engine).unwrap();
//! let top = &analysis.hypotheses(None)[0];
//! assert_eq!(top.failure.as_str(), "non_finite");
//! assert_eq!(top.step, Some(10));
//! ```
//!
//! ## Writing an adapter for a training framework
//!
//! An adapter (the `PyTorch` package, `neuraldbg-burn`) does four things, and only these:
//! the framework stays out of the engine, and the engine's decisions stay out of the adapter.
//!
//! 1. **Describe the model once**, at the first step: a [`ModelSpec`] listing every module by
//!    its qualified name and class name ([`ModelSpec::module`]), in forward-execution order
//!    with the root last, and every trainable parameter with its owning module and shape
//!    ([`ModelSpec::param`]). The class name matters: `Tanh`, `Sigmoid`, `ReLU`... make a
//!    module an activation, `*Norm` a normalization. Check `fan_in` where the framework's
//!    weight layout differs from `PyTorch`'s `[out, in, ...]` (burn's `Linear` is
//!    `[in, out]`). Set [`ModelSpec::optimizer`] when the optimizer's family is known.
//! 2. **Feed one [`StepView`] per optimizer step**, steps numbered from 0 by completed
//!    optimizer steps: the L2 norm of each parameter's gradient in the spec's order (negative
//!    for "no gradient this step", NaN/inf as they come), and whatever else is known: parameter
//!    norms on sampled steps, the loss, the learning rate, input batch statistics
//!    ([`INPUT_STATS`] per batch), activation statistics for the probes that
//!    [`Engine::register_model`] returned. Compute the norms on the framework's device and
//!    read them back in one transfer; the engine only ever sees these small arrays. On CPU,
//!    where each framework op costs microseconds, [`measure`] computes them straight from the
//!    tensors' memory instead.
//! 3. **Record the run** if asked: a [`trace::TraceWriter`] gets the header once the model is
//!    registered and each step after the engine accepted it; `neuraldbg explain` and
//!    [`trace::Replay`] then give exactly the live diagnosis.
//! 4. **Answer from the engine**: [`Engine::events`], [`Engine::history`], [`Analysis`]
//!    (hypotheses, root causes, couplings, causal chains), [`report::render_html`].
//!
//! ```
//! use neuraldbg_core::analysis::Analysis;
//! use neuraldbg_core::trace::{Replay, TraceReader, TraceWriter, WriterOptions};
//! use neuraldbg_core::{Config, Engine, ModelSpec, Reduce, StepView};
//!
//! // 1. The model: two Linear layers with a Tanh between them, the root last.
//! let mut spec = ModelSpec::default();
//! let fc1 = spec.module("fc1", "Linear");
//! spec.param(fc1, "fc1.weight", &[16, 8]);
//! spec.param(fc1, "fc1.bias", &[16]);
//! spec.module("act", "Tanh");
//! let fc2 = spec.module("fc2", "Linear");
//! spec.param(fc2, "fc2.weight", &[1, 16]);
//! spec.module("", "Net");
//! spec.optimizer = Some("SGD".into());
//!
//! let mut engine = Engine::new(Config::default()).unwrap();
//! let probes = engine.register_model(spec.clone()).unwrap();
//! assert_eq!(probes.len(), 1); // the Tanh: what to measure on its output, if the adapter can
//!
//! // 3. The trace, header first.
//! let path = std::env::temp_dir().join(format!("ndbg-adapter-{}.ndbg", std::process::id()));
//! let mut writer = TraceWriter::create(&path, serde_json::Map::new(), WriterOptions::default()).unwrap();
//! writer.write_header(engine.config(), &spec).unwrap();
//!
//! // 2. One view per optimizer step. Here fc1's gradient fades away from step 10 on.
//! for step in 0..40u64 {
//!     let fc1_norm = if step < 10 { 0.05 } else { 1e-9 };
//!     let grad_norms = [fc1_norm, fc1_norm / 10.0, 0.1];
//!     let view = StepView {
//!         step,
//!         grad_norms: &grad_norms,
//!         loss: Some(1.0),
//!         lr: Some(0.01),
//!         ..StepView::default()
//!     };
//!     engine.observe(&view).unwrap(); // refuses inconsistent input, with the reason
//!     writer.write_step(&view).unwrap();
//! }
//! writer.close().unwrap();
//!
//! // 4. The answers.
//! let top = &Analysis::new(&engine).unwrap().hypotheses(None)[0];
//! assert_eq!(top.failure.as_str(), "vanishing_gradients");
//! assert_eq!((top.layer.as_deref(), top.step), (Some("fc1"), Some(10)));
//! let (steps, norms) = engine.history(Some("fc1"), "grad_norm", Reduce::Last).unwrap();
//! assert_eq!(steps[10], 10); // a layer's norm: the L2 norm over its parameters' gradients
//! assert!((norms[0] - (0.05f64.powi(2) + 0.005f64.powi(2)).sqrt()).abs() < 1e-6);
//! let html = neuraldbg_core::report::render_html(&engine, "my run");
//! assert!(html.starts_with("<!DOCTYPE html>"));
//! let replay = Replay::read(TraceReader::open(&path).unwrap(), |_| {}).unwrap();
//! assert_eq!(replay.engine.events(), engine.events());
//! # std::fs::remove_file(&path).unwrap();
//! ```
#![forbid(unsafe_code)]

pub mod analysis;
mod config;
mod detector;
mod engine;
mod error;
mod event;
mod health;
mod history;
pub mod measure;
mod model;
mod named;
mod observation;
pub mod output;
mod replica;
pub mod report;
pub mod table;
pub mod trace;
mod track;
pub mod training_loop;

pub use analysis::{Analysis, CausalHypothesis, Cause, Coupling, CouplingKind, Failure, RootCause};
pub use config::Config;
pub use detector::{Debounce, Transition};
pub use engine::{ACTIVATION_METRICS, Engine, LAYER_METRICS, RUN_METRICS};
pub use error::{ConfigError, EngineError};
pub use event::{EventType, SemanticEvent, Subject, event_confidence};
pub use health::{
    ActivationHealth, ActivationSample, ActivationTraits, DataHealth, GradientHealth, LossHealth,
    OutputHealth, ReplicaHealth, SlopeFormula, State, classify_activation, classify_gradient,
};
pub use history::{Bucket, History, Reduce};
pub use model::{
    ActivationProbe, FirstBatch, LossSpec, Model, ModelSpec, ModuleSpec, ParamRole, ParamSpec,
    SequenceFirstInput, SequenceReadout, activation_traits, display_name,
};
pub use observation::{ACTIVATION_STATS, Axis, Fact, INPUT_STATS, Measure, Observation, StepView};
