//! `data_anomaly`: an input batch with NaN/Inf, or far out of the usual scale. No module is to
//! blame; it explains the failures of its step and the next (see [`super::follows_from`]).

use crate::engine::Run;
use crate::event::SemanticEvent;

use super::super::episodes::Episode;
use super::super::vocab::Failure;
use super::{FailureRule, first_at_onset, sigmoid};

pub(crate) struct DataAnomaly;

impl FailureRule for DataAnomaly {
    fn failure(&self) -> Failure {
        Failure::DataAnomaly
    }

    fn precedence(&self) -> u8 {
        0
    }

    fn locate(
        &self,
        _: &Run,
        events: &[SemanticEvent],
        cluster: &[usize],
        onset: u64,
    ) -> (Option<usize>, Option<usize>) {
        first_at_onset(events, cluster, onset)
    }

    fn probability(&self, _: &Run, e: &Episode) -> f64 {
        if e.margin.is_infinite() {
            0.97
        } else {
            // Margin is decades past the out-of-distribution factor (100x by default).
            sigmoid(2.0 * (e.margin + 2.0 - 2.5))
        }
    }
}
