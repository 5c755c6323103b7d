//! `missing_normalization`: nothing rescales the signal between layers.

use super::super::remedy::Remedy;
use super::super::vocab::{Cause, Failure};
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
        )
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
