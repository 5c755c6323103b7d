//! `saturating_activation`: bounded activations (tanh, sigmoid) pinned at their bounds, where
//! their slope, and so the gradient they pass back, is ~0.

use crate::engine::Run;
use crate::track::median;

use super::super::remedy::Remedy;
use super::super::vocab::{Cause, Failure};
use super::{Case, CauseRule, Facts, RemedyCase, Votes, facts_of, fmt_g};

pub(crate) struct SaturatingActivation;

/// How much gradient the bounded activations pass back: the median of their mean slopes at
/// their first measurement and the median of their lowest, and their class name.
#[derive(serde::Serialize)]
struct Slopes {
    slope_first: Option<f64>,
    slope_min: Option<f64>,
    bounded_kind: Option<String>,
}

impl Slopes {
    fn of(run: &Run) -> Self {
        let slopes = |f: fn(&crate::track::ActTrack) -> f64| {
            let v: Vec<f64> = run.acts.iter().map(f).filter(|s| s.is_finite()).collect();
            median(&v)
        };
        Self {
            slope_first: slopes(|a| a.first_slope),
            slope_min: slopes(|a| a.min_slope),
            bounded_kind: run
                .model
                .activations
                .iter()
                .find(|a| a.traits.bounded.is_some())
                .map(|a| a.kind.clone()),
        }
    }
}

/// Bounded activations between weighted layers whose slope is low from the first step (a
/// sigmoid's is at most 1/4): each one scales the gradient that crosses it down by that much.
struct FlatSlopes {
    layers: usize,
    kind: String,
    /// The median of their first mean slopes.
    slope: f64,
}

/// A mean slope at or below this from the first step (a sigmoid's, at most 0.25; a tanh at
/// initialization passes back most of the gradient).
const FLAT_SLOPE: f64 = 0.3;

/// Bounded activations between weighted layers pass back little of the gradient from the
/// first step: what slows learning may be them.
pub(crate) fn passes_little_gradient(run: &Run) -> bool {
    hidden_flat_slopes(run).is_some_and(|f| f.layers > 0)
}

fn hidden_flat_slopes(run: &Run) -> Option<FlatSlopes> {
    let model = &run.model;
    let last_weighted = model
        .layers
        .iter()
        .filter(|l| l.weight.is_some())
        .map(|l| l.module)
        .max()?;
    let flat: Vec<(&str, f64)> = model
        .activations
        .iter()
        .zip(&run.acts)
        .filter(|(a, _)| a.traits.bounded.is_some() && a.module < last_weighted)
        .map(|(a, t)| (a.kind.as_str(), t.first_slope))
        .filter(|(_, s)| s.is_finite() && *s <= FLAT_SLOPE)
        .collect();
    let slopes: Vec<f64> = flat.iter().map(|(_, s)| *s).collect();
    Some(FlatSlopes {
        layers: flat.len(),
        kind: flat.first()?.0.to_string(),
        slope: median(&slopes)?,
    })
}

impl CauseRule for SaturatingActivation {
    fn cause(&self) -> Cause {
        Cause::SaturatingActivation
    }

    fn phrase(&self) -> &'static str {
        "a saturating activation"
    }

    fn explains(&self, failure: Failure) -> bool {
        matches!(
            failure,
            Failure::VanishingGradients | Failure::SaturatedActivations | Failure::LossPlateau
        )
    }

    fn evidence(&self, c: &Case<'_>, v: &mut Votes) {
        let f = c.f;
        match c.e.failure {
            Failure::VanishingGradients => {
                let own = Slopes::of(c.run);
                // (A saturation the raw inputs made from the first step is the data's.)
                if let Some(j) = f
                    .saturation
                    .filter(|&j| super::bad_input_data::saturated_by_inputs(c, j).is_none())
                {
                    v.add(
                        3.0,
                        format!(
                            "bounded activations were saturated ({:.0}% of outputs at their bounds) by step {}",
                            100.0 * c.episodes[j].fraction,
                            c.episodes[j].onset
                        ),
                    );
                }
                let slope = if f.at_start {
                    own.slope_first
                } else {
                    own.slope_min
                };
                if let Some(s) = slope.filter(|s| *s < 0.5) {
                    let kind = own.bounded_kind.as_deref().unwrap_or("bounded");
                    v.add(
                        3.0 * ((0.5 - s) / 0.25).clamp(0.0, 1.0),
                        format!(
                            "the {kind} activations pass back only {:.0}% of the gradient on average (mean slope {})",
                            100.0 * s,
                            fmt_g(s)
                        ),
                    );
                }
            }
            Failure::SaturatedActivations => {
                v.add(
                    2.5,
                    format!(
                        "{:.0}% of the outputs sit at the activation's bounds, where its slope is ~0",
                        100.0 * c.e.fraction
                    ),
                );
            }
            Failure::LossPlateau => {
                if let Some((Cause::SaturatingActivation, why)) = c.stalled_by() {
                    v.add(super::STALLED, why);
                } else if let Some(h) = hidden_flat_slopes(c.run) {
                    // Surer when the model learned nothing at all.
                    let (weight, what) = if super::super::failures::not_learning(c.run).is_some() {
                        (2.5, "the loss stays at its chance level")
                    } else {
                        (2.0, "the loss flattened")
                    };
                    v.add(
                        weight,
                        format!(
                            "{what} behind {} hidden {} layer(s) that each pass back at most {:.0}% of the gradient from the start (mean slope {})",
                            h.layers,
                            h.kind,
                            100.0 * h.slope,
                            fmt_g(h.slope)
                        ),
                    );
                }
            }
            _ => {}
        }
    }

    fn run_facts(&self, run: &Run) -> Facts {
        facts_of(&Slopes::of(run))
    }

    fn remedies(&self, _: &RemedyCase<'_>) -> Vec<Remedy> {
        vec![
            Remedy::ReplaceSaturating,
            Remedy::XavierAndNormalizeInputs,
            Remedy::NormBeforeSaturating,
        ]
    }
}
