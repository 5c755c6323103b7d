//! Semantic events: the seed's causal compression. One event per confirmed health transition,
//! never one per step.

use serde::{Deserialize, Serialize};

use crate::health::State;
use crate::named::named_enum;

named_enum! {
    /// What kind of signal an event is about. `from_state`/`to_state` say which transition.
    EventType {
        /// A layer's gradient health changed (states: [`crate::GradientHealth`]).
        GradientHealth => "gradient_health",
        /// An activation module's output health changed ([`crate::ActivationHealth`]).
        ActivationHealth => "activation_health",
        /// A module was the first, in forward order, whose output was not finite.
        NonFiniteOutput => "non_finite_output",
        /// The input batches changed health ([`crate::DataHealth`]).
        DataAnomaly => "data_anomaly",
        /// The loss changed health ([`crate::LossHealth`]).
        LossHealth => "loss_health",
        /// Replicas that should be identical (DDP) stopped being so ([`crate::ReplicaHealth`]).
        ReplicaDivergence => "replica_divergence",
    }
}

/// What an event is about.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(tag = "kind", content = "index", rename_all = "snake_case")]
pub enum Subject {
    /// A module, by index into [`crate::ModelSpec::modules`].
    Module(usize),
    /// The model's input batches.
    Input,
    /// The training loss.
    Loss,
}

impl Subject {
    /// The name events about the input batches carry as their layer name.
    pub const INPUT_NAME: &'static str = "(input)";
    /// The name events about the loss carry as their layer name.
    pub const LOSS_NAME: &'static str = "(loss)";
}

/// A confirmed transition.
///
/// `confidence` is `1 - exp(-(margin / 0.5 + persistence / 3))`: how far past its threshold the
/// value was (`margin`, in decades for norms, in share of the remaining range for fractions)
/// and for how many consecutive observations it held when confirmed. A value right at its
/// threshold held for the default 3 observations scores 0.63; a non-finite value scores 1.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct SemanticEvent {
    /// The step the new state began (the first observation of the run that confirmed it).
    pub step: u64,
    pub event_type: EventType,
    pub subject: Subject,
    pub from_state: State,
    pub to_state: State,
    pub confidence: f64,
    /// The observed value at onset (gradient norm, fraction, loss, batch scale).
    pub value: f64,
    /// The threshold it crossed (NaN when none applies, e.g. non-finite values).
    pub threshold: f64,
    /// The step at which the transition was confirmed (>= `step`).
    pub confirmed_step: u64,
    /// Consecutive observations in the new state when it was confirmed.
    pub persistence: u32,
    /// Distance past the threshold (see the type's documentation).
    pub margin: f64,
    /// In a distributed job, the rank the signal came from when it is one rank's own (its input
    /// batch, its forward pass, its replica); None when it is the whole job's.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rank: Option<u32>,
}

/// Confidence of a transition from its margin and persistence (see [`SemanticEvent`]).
pub fn event_confidence(margin: f64, persistence: u32) -> f64 {
    if !margin.is_finite() {
        return 1.0;
    }
    let x = margin.max(0.0) / 0.5 + f64::from(persistence) / 3.0;
    (1.0 - (-x).exp()).clamp(0.0, 1.0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn confidence_grows_with_margin_and_persistence() {
        let at_threshold = event_confidence(0.0, 3);
        assert!((at_threshold - (1.0 - (-1.0f64).exp())).abs() < 1e-12);
        assert!(event_confidence(1.0, 3) > at_threshold);
        assert!(event_confidence(0.0, 6) > at_threshold);
        assert!((event_confidence(f64::INFINITY, 1) - 1.0).abs() < 1e-12);
        assert!(event_confidence(0.0, 1) < 0.5);
    }

    #[test]
    fn event_type_names_round_trip() {
        for e in EventType::ALL {
            assert_eq!(EventType::parse(e.as_str()), Some(*e));
        }
    }
}
