//! `saturating_activation`: bounded activations (tanh, sigmoid) pinned at their bounds, where
//! their slope, and so the gradient they pass back, is ~0.

use super::super::remedy::Remedy;
use super::super::vocab::{Cause, Failure};
use super::{Case, CauseRule, RemedyCase, Votes, fmt_g};

pub(crate) struct SaturatingActivation;

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
        let (ev, f) = (c.ev, c.f);
        match c.e.failure {
            Failure::VanishingGradients => {
                if let Some(j) = f.saturation {
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
                    ev.slope_first
                } else {
                    ev.slope_min
                };
                if let Some(s) = slope.filter(|s| *s < 0.5) {
                    let kind = ev.bounded_kind.as_deref().unwrap_or("bounded");
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
                }
            }
            _ => {}
        }
    }

    fn remedies(&self, _: &RemedyCase<'_>) -> Vec<Remedy> {
        vec![
            Remedy::ReplaceSaturating,
            Remedy::XavierAndNormalizeInputs,
            Remedy::NormBeforeSaturating,
        ]
    }
}
