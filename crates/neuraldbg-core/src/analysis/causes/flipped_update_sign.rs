//! `flipped_update_sign`: the optimizer's steps move the weights up their gradients instead of
//! down them: a gradient negated between the backward pass and the step (`p.grad.neg_()`,
//! `apply_gradients(zip([-g for g in grads], ...))`), an update written `p += lr * grad`. Every
//! step then raises the loss it was meant to lower, until the weights and gradients blow up.
//! Measured, not inferred: the cosine between a sampled step's move of each weight and the
//! gradient its backward pass produced (`update_direction`) is -1 for SGD and below 0 for every
//! optimizer that descends (Adam, `RMSprop`, momentum); above 0 the step climbed. An optimizer
//! told to maximize (`maximize=True`) climbs on purpose and is not measured.

use super::super::remedy::Remedy;
use super::super::vocab::{Cause, Failure};
use super::evidence::measured_update_direction;
use super::{Case, CauseRule, Facts, RemedyCase, Votes};
use crate::engine::Run;

pub(crate) struct FlippedUpdateSign;

/// The median cosine (over the layers' first measured steps) from which the steps climb the
/// gradient: a descending optimizer is below 0 from its first step (Adam's sign-like step
/// about -0.8 against a Gaussian gradient, SGD's -1); Adam climbing a negated gradient was
/// measured at +0.54 over its first five steps, as its momentum turns.
const CLIMBS: f64 = 0.25;

/// The median direction of the first measured steps, when they climbed the gradient.
pub(crate) fn climbing(run: &Run) -> Option<f64> {
    measured_update_direction(run).filter(|&d| d >= CLIMBS)
}

impl CauseRule for FlippedUpdateSign {
    fn cause(&self) -> Cause {
        Cause::FlippedUpdateSign
    }

    fn phrase(&self) -> &'static str {
        "updates that climb the gradient instead of descending it"
    }

    fn explains(&self, failure: Failure) -> bool {
        !matches!(
            failure,
            Failure::DataAnomaly
                | Failure::StalledLayer
                | Failure::LossScaleCollapse
                | Failure::ReplicaDivergence
        )
    }

    fn always_candidate(&self, _: Failure) -> bool {
        false
    }

    fn evidence(&self, c: &Case<'_>, v: &mut Votes) {
        let Some(d) = climbing(c.run) else {
            return;
        };
        v.proof(
            5.0,
            format!(
                "each measured optimizer step moved the weights up their gradients, not down them (cosine {d:+.2} between a step's move and the gradient the backward pass gave: an optimizer that descends is at -1 for SGD and below 0 for any other), so every step raised the loss"
            ),
        );
    }

    fn remedies(&self, _: &RemedyCase<'_>) -> Vec<Remedy> {
        vec![Remedy::StepDownTheGradient]
    }

    fn run_facts(&self, run: &Run) -> Facts {
        let mut out = Facts::new();
        if let Some(d) = measured_update_direction(run) {
            out.insert("update_direction".into(), d.into());
        }
        out
    }
}
