//! The public JSON shapes of events and hypotheses (design.md), shared by the Python package
//! and the CLI so both print exactly the same thing.

use serde_json::{Value, json};

use crate::analysis::{CausalHypothesis, Coupling, RootCause};
use crate::engine::Engine;
use crate::event::SemanticEvent;

/// How a non-finite value is spelled in JSON, which has no NaN or infinity: `"NaN"`, `"inf"`,
/// `"-inf"` (the Python package reads them back as floats).
pub fn non_finite_name(v: f64) -> &'static str {
    if v.is_nan() {
        "NaN"
    } else if v > 0.0 {
        "inf"
    } else {
        "-inf"
    }
}

/// A float for JSON: non-finite values become [`non_finite_name`] strings, so nothing is
/// silently turned into `null`.
pub fn float(v: f64) -> Value {
    if v.is_finite() {
        json!(v)
    } else {
        json!(non_finite_name(v))
    }
}

/// An event with its subject resolved to a layer name.
pub fn event_json(engine: &Engine, e: &SemanticEvent) -> Value {
    let mut v = json!({
        "event_type": e.event_type.as_str(),
        "layer_name": engine.subject_name(e.subject),
        "step": e.step,
        "from_state": e.from_state.as_str(),
        "to_state": e.to_state.as_str(),
        "confidence": float(e.confidence),
        "metadata": {
            "value": float(e.value),
            "threshold": float(e.threshold),
            "confirmed_step": e.confirmed_step,
            "persistence": e.persistence,
            "margin": float(e.margin),
        },
    });
    if let Some(rank) = e.rank {
        v["metadata"]["rank"] = json!(rank);
    }
    v
}

pub fn events_json(engine: &Engine, events: &[SemanticEvent]) -> Value {
    Value::Array(events.iter().map(|e| event_json(engine, e)).collect())
}

/// A hypothesis with the `CausalHypothesis` fields of design.md.
pub fn hypothesis_json(engine: &Engine, h: &CausalHypothesis) -> Value {
    json!({
        "failure": h.failure.as_str(),
        "cause": h.cause.as_str(),
        "layer": h.layer,
        "step": h.step,
        "confidence": float(h.confidence),
        "description": h.description,
        "evidence": events_json(engine, &h.evidence),
        "causal_chain": h.causal_chain,
        "remedies": h.remedies,
    })
}

pub fn hypotheses_json(engine: &Engine, hs: &[CausalHypothesis]) -> Value {
    Value::Array(hs.iter().map(|h| hypothesis_json(engine, h)).collect())
}

pub fn root_causes_json(engine: &Engine, roots: &[RootCause]) -> Value {
    Value::Array(
        roots
            .iter()
            .map(|r| {
                json!({
                    "failure": r.failure.as_str(),
                    "layer": r.layer,
                    "step": r.step,
                    "event": r.event.as_ref().map(|e| event_json(engine, e)),
                    "affected": r.affected,
                    "consequences": r.consequences.iter().map(|f| f.as_str()).collect::<Vec<_>>(),
                })
            })
            .collect(),
    )
}

pub fn couplings_json(engine: &Engine, couplings: &[Coupling]) -> Value {
    Value::Array(
        couplings
            .iter()
            .map(|c| {
                json!({
                    "kind": match c.kind {
                        crate::analysis::CouplingKind::Structural => "structural",
                        crate::analysis::CouplingKind::Temporal => "temporal",
                    },
                    "first": event_json(engine, &c.first),
                    "second": event_json(engine, &c.second),
                    "lag": c.lag,
                })
            })
            .collect(),
    )
}
