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

    fn remedies(&self, _: &RemedyCase<'_>) -> Vec<Remedy> {
        vec![Remedy::InspectHistory, Remedy::DetectAnomaly]
    }
}
