//! `missing_normalization`: nothing rescales the signal between layers.

use super::super::remedy::Remedy;
use super::super::vocab::{Cause, Failure};
use super::evidence::{DEEP_STACK, MEASURED_TOO_LARGE, TRAINING_UPDATE};
use super::{Case, CauseRule, Facts, RemedyCase, Votes};

pub(crate) struct MissingNormalization;

impl CauseRule for MissingNormalization {
    fn cause(&self) -> Cause {
        Cause::MissingNormalization
    }

    fn phrase(&self) -> &'static str {
        "missing normalization"
    }

    fn explains(&self, failure: Failure) -> bool {
        matches!(
            failure,
            Failure::ExplodingGradients
                | Failure::VanishingGradients
                | Failure::SaturatedActivations
                | Failure::LossPlateau
        )
    }

    /// A plateau is this cause's only with evidence (below), not by default.
    fn always_candidate(&self, failure: Failure) -> bool {
        failure != Failure::LossPlateau
    }

    fn evidence(&self, c: &Case<'_>, v: &mut Votes) {
        let ev = c.ev;
        if c.run.model.has_normalization {
            return;
        }
        match c.e.failure {
            Failure::ExplodingGradients | Failure::VanishingGradients => {
                // Gradients changing geometrically over a deep stack at the start.
                let shrinking = c.e.failure == Failure::VanishingGradients;
                if c.f.at_start && ev.depth >= 8 && ev.geometric_profile(shrinking).is_some() {
                    v.add(
                        1.0,
                        "no normalization layer rescales the signal between layers",
                    );
                }
            }
            Failure::SaturatedActivations => {
                v.add(0.5, "no normalization keeps pre-activations in range");
            }
            Failure::LossPlateau => plateau_of_a_deep_stack(c, v),
            _ => {}
        }
    }

    fn run_facts(&self, run: &crate::engine::Run) -> Facts {
        let mut out = Facts::new();
        out.insert("has_norm".into(), run.model.has_normalization.into());
        out
    }

    fn remedies(&self, _: &RemedyCase<'_>) -> Vec<Remedy> {
        vec![Remedy::AddNormalization, Remedy::InitKeepsScale]
    }
}

/// A deep stack with no normalization layer that does not learn, where the other causes of a
/// plateau are each ruled out by a measurement: inputs at a normalized scale, weights at a
/// variance-preserving one, steps of a size that trains, and no other failure stopping it.
fn plateau_of_a_deep_stack(c: &Case<'_>, v: &mut Votes) {
    let (ev, f) = (c.ev, c.f);
    // (Within 10x of a training step's ~1e-3.)
    let Some(step) = ev.measured_step_within(TRAINING_UPDATE / 10.0, MEASURED_TOO_LARGE) else {
        return;
    };
    if ev.depth < DEEP_STACK
        || f.root_cause.is_some()
        || f.vanishing_or_dead.is_some()
        || !ev.ordinary_inputs()
        || !ev.gain_normal()
    {
        return;
    }
    v.add(
        3.0,
        format!(
            "{} weighted layers with no normalization layer between them do not learn, though the inputs are at a normalized scale, the weights at a variance-preserving one and each step moves them by {} of their size, as training steps do: nothing rescales each layer's input for the next",
            ev.depth,
            super::fmt_g(step)
        ),
    );
}
