//! `unknown`: the evidence points at no named cause. Always a candidate, at score 0, so a named
//! cause wins only by out-explaining it.

use super::super::remedy::Remedy;
use super::super::vocab::{Cause, Failure};
use super::{Case, CauseRule, RemedyCase, Votes};

pub(crate) struct Unknown;

impl CauseRule for Unknown {
    fn cause(&self) -> Cause {
        Cause::Unknown
    }

    fn phrase(&self) -> &'static str {
        "an undetermined cause"
    }

    fn explains(&self, _: Failure) -> bool {
        true
    }

    fn evidence(&self, _: &Case<'_>, _: &mut Votes) {}

    /// A model that learns nothing (its loss at its chance level) and no named cause: first
    /// the check that tells a pipeline that does not give the model its targets from a model
    /// that cannot learn them; a NaN's anomaly check is for the failures that have one.
    fn remedies(&self, c: &RemedyCase<'_>) -> Vec<Remedy> {
        let at_chance = c.e.failure == Failure::LossPlateau
            && super::super::failures::not_learning(c.run).is_some();
        if at_chance {
            vec![Remedy::OverfitOneBatch, Remedy::InspectHistory]
        } else {
            vec![Remedy::InspectHistory, Remedy::DetectAnomaly]
        }
    }
}
