//! `numerical_instability`: one operation (log, division, exp, ...) produced NaN/Inf from
//! finite, stable inputs.

use super::super::remedy::Remedy;
use super::super::vocab::{Cause, Failure};
use super::{Case, CauseRule, RemedyCase, Votes};

pub(crate) struct NumericalInstability;

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
                if f.forward_origin {
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
                } else if f.loss_origin {
                    v.add(
                        2.5,
                        "the model's outputs were finite: the loss computation itself produced the first NaN/Inf (log of 0, a division by zero...)",
                    );
                } else if f.backward_origin {
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

    fn remedies(&self, c: &RemedyCase<'_>) -> Vec<Remedy> {
        vec![
            Remedy::GuardUnstableOp { layer: c.layer() },
            Remedy::Float32ForOp,
            Remedy::DetectAnomalyStep,
        ]
    }
}
