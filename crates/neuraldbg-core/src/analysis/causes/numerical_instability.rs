//! `numerical_instability`: one operation (log, division, exp, ...) produced NaN/Inf from
//! finite, stable inputs.

use crate::event::EventType;

use super::super::remedy::Remedy;
use super::super::vocab::{Cause, Failure};
use super::{Case, CauseRule, Facts, RemedyCase, Votes, facts_of};

pub(crate) struct NumericalInstability;

/// Where the first NaN/Inf of the episode was born, when that is known.
#[derive(serde::Serialize)]
#[allow(clippy::struct_field_names)]
struct Origin {
    /// In a module's forward output.
    forward_origin: bool,
    /// In the backward pass: the forward pass was checked finite, a gradient was not.
    backward_origin: bool,
    /// In the loss computation: the model's outputs were checked finite, the loss was not.
    loss_origin: bool,
}

impl Origin {
    fn of(c: &Case<'_>) -> Self {
        let root = c.e.root_event.map(|i| c.events[i].event_type);
        let forward_origin = root == Some(EventType::NonFiniteOutput);
        let checked_finite = c.run.finite_forward.contains(&c.e.onset);
        Self {
            forward_origin,
            backward_origin: !forward_origin
                && checked_finite
                && root == Some(EventType::GradientHealth),
            loss_origin: checked_finite && root == Some(EventType::LossHealth),
        }
    }
}

impl CauseRule for NumericalInstability {
    fn cause(&self) -> Cause {
        Cause::NumericalInstability
    }

    fn phrase(&self) -> &'static str {
        "a numerically unstable operation"
    }

    fn explains(&self, failure: Failure) -> bool {
        matches!(
            failure,
            Failure::NonFinite | Failure::LossDivergence | Failure::LossScaleCollapse
        )
    }

    fn evidence(&self, c: &Case<'_>, v: &mut Votes) {
        let f = c.f;
        match c.e.failure {
            Failure::NonFinite => {
                // Not the end of a blow-up: where the first NaN/Inf appeared.
                if f.blew_up() && f.root_cause.is_none() {
                    return;
                }
                let origin = Origin::of(c);
                if origin.forward_origin {
                    // Inputs are named only when they were observed (a batch that never passed
                    // through a watched module's call is not known to be finite).
                    v.add(
                        2.5,
                        if c.ev.input_scale_first.is_some() {
                            "a module's forward output went non-finite while gradients and inputs were finite and stable"
                        } else {
                            "a module's forward output went non-finite while gradients were finite and stable (the inputs were not observed)"
                        },
                    );
                } else if origin.loss_origin {
                    v.add(
                        2.5,
                        "the model's outputs were finite: the loss computation itself produced the first NaN/Inf (log of 0, a division by zero...)",
                    );
                } else if origin.backward_origin {
                    v.add(
                        1.5,
                        "the forward pass was finite; the gradient went non-finite inside the backward pass",
                    );
                }
                if f.at_start {
                    v.add(0.5, "values were non-finite from the first step");
                }
            }
            // Confirmed by the loop track: the scaler skipped step after step.
            Failure::LossScaleCollapse => v.add(
                6.0,
                "gradients overflowed float16 at every loss scale the GradScaler tried",
            ),
            Failure::LossDivergence if f.growth < 1.0 && f.prior_explosion.is_none() => {
                v.add(0.5, "gradient norms did not grow with it");
            }
            _ => {}
        }
    }

    fn episode_facts(&self, c: &Case<'_>) -> Facts {
        facts_of(&Origin::of(c))
    }

    fn remedies(&self, c: &RemedyCase<'_>) -> Vec<Remedy> {
        vec![
            Remedy::GuardUnstableOp { layer: c.layer() },
            Remedy::Float32ForOp,
            Remedy::DetectAnomalyStep,
        ]
    }
}
