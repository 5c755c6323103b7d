//! Errors of the engine. Every message names the offending value so a user can fix it.

use thiserror::Error;

/// A configuration value is out of range.
#[derive(Debug, Error, Clone, PartialEq)]
pub enum ConfigError {
    #[error("{name} must be a positive finite number, got {value}")]
    NotPositive { name: &'static str, value: f64 },
    #[error("{name} must be in (0, 1], got {value}")]
    NotFraction { name: &'static str, value: f64 },
    #[error("{name} must be at least {min}, got {value}")]
    TooSmall {
        name: &'static str,
        value: f64,
        min: f64,
    },
    #[error("{low} ({low_value}) must be smaller than {high} ({high_value})")]
    Order {
        low: &'static str,
        low_value: f64,
        high: &'static str,
        high_value: f64,
    },
    #[error("invalid configuration: {0}")]
    Parse(String),
}

/// The engine was fed something inconsistent with the registered model or its own history.
#[derive(Debug, Error, Clone, PartialEq)]
pub enum EngineError {
    #[error(transparent)]
    Config(#[from] ConfigError),
    #[error("invalid model description: {0}")]
    Model(String),
    #[error("no model registered: call register_model before observing steps")]
    NoModel,
    #[error("a model is already registered with this engine")]
    ModelAlreadyRegistered,
    #[error("{what} has {got} values, expected {expected}")]
    Length {
        what: &'static str,
        got: usize,
        expected: usize,
    },
    #[error("step {step} is not after the last observed step {last}: steps must increase")]
    StepOrder { step: u64, last: u64 },
    #[error("module index {index} is out of range (the model has {count} modules)")]
    ModuleIndex { index: usize, count: usize },
    #[error("{what} {name:?} is given more than once in one step")]
    Duplicate {
        what: &'static str,
        name: &'static str,
    },
    #[error("unknown {what} {name:?}; expected one of: {expected}")]
    Unknown {
        what: &'static str,
        name: String,
        expected: String,
    },
}
