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
#![forbid(unsafe_code)]

pub mod analysis;
mod config;
mod detector;
mod engine;
mod error;
mod event;
mod health;
mod history;
mod model;
mod named;
mod observation;
pub mod output;
pub mod report;
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
    ActivationProbe, LossSpec, Model, ModelSpec, ModuleSpec, ParamRole, ParamSpec,
    activation_traits, display_name,
};
pub use observation::{ACTIVATION_STATS, Axis, Fact, INPUT_STATS, Measure, Observation, StepView};
