//! `replica_divergence`: a data-parallel replica no longer holds the same values as the others
//! (see `crate::replica`). A fault in the job's code that no cause of the vocabulary names: the
//! cause rules do not rank it, and its remedies say where such code usually is.

use crate::engine::Run;
use crate::event::SemanticEvent;

use super::super::episodes::Episode;
use super::super::remedy::Remedy;
use super::super::vocab::{Cause, Failure};
use super::{FailureRule, at_onset, module_of};

pub(crate) struct ReplicaDivergence;

impl FailureRule for ReplicaDivergence {
    fn failure(&self) -> Failure {
        Failure::ReplicaDivergence
    }

    fn precedence(&self) -> u8 {
        10
    }

    fn ranked_by_cause_rules(&self) -> bool {
        false
    }

    /// The first parameter (forward order) found to differ across replicas.
    fn locate(
        &self,
        _: &Run,
        events: &[SemanticEvent],
        cluster: &[usize],
        onset: u64,
    ) -> (Option<usize>, Option<usize>) {
        let i = at_onset(events, cluster, onset).first().copied();
        (i, i.and_then(|i| module_of(&events[i])))
    }

    /// Replicas differ far beyond float noise (margin: decades past the tolerance); more
    /// certain the longer it lasts.
    fn probability(&self, _: &Run, e: &Episode) -> f64 {
        let persist = if e.to_end || e.duration >= 3 {
            0.1
        } else {
            0.0
        };
        (0.6 + 0.1 * e.margin.min(3.0) + persist).min(0.97)
    }

    fn remedies(&self, _: Cause, _: Vec<Remedy>) -> Vec<Remedy> {
        vec![
            Remedy::FindRankOnlyCode,
            Remedy::SameStepsOnEveryRank,
            Remedy::NothingOutsideDdp,
        ]
    }
}
