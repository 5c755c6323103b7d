//! `missing_zero_grad`: gradients accumulate across steps because `.grad` is never zeroed, so
//! each update applies the sum of every gradient so far: steps grow with time until training
//! blows up or thrashes.

use super::super::remedy::Remedy;
use super::super::vocab::{Cause, Failure};
use super::{Case, CauseRule, RemedyCase, Votes};

pub(crate) struct MissingZeroGrad;

impl CauseRule for MissingZeroGrad {
    fn cause(&self) -> Cause {
        Cause::MissingZeroGrad
    }

    fn phrase(&self) -> &'static str {
        "gradients never zeroed between steps"
    }

    fn explains(&self, failure: Failure) -> bool {
        !matches!(
            failure,
            Failure::DataAnomaly | Failure::StalledLayer | Failure::LossScaleCollapse
        )
    }

    fn always_candidate(&self, _: Failure) -> bool {
        false
    }

    fn evidence(&self, c: &Case<'_>, v: &mut Votes) {
        let facts = &c.run.loop_facts;
        let Some(share) = facts.accumulated_share() else {
            return;
        };
        if share < 0.5 {
            return;
        }
        v.proof(
            5.0,
            format!(
                "on {:.0}% of the steps the new gradients were added onto the previous step's instead of replacing them (.grad was not zeroed)",
                100.0 * share
            ),
        );
        if c.f.healthy_start && c.f.root_growth >= 1.0 {
            v.add(
                1.0,
                format!(
                    "the gradient norm grew {:.1} decades as the sums built up",
                    c.f.root_growth
                ),
            );
        }
    }

    fn remedies(&self, _: &RemedyCase<'_>) -> Vec<Remedy> {
        vec![Remedy::ZeroGradEachStep, Remedy::AccumulateOnPurpose]
    }
}
