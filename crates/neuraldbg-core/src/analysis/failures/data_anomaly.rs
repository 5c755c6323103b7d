//! `data_anomaly`: an input batch with NaN/Inf, or far out of the usual scale. No module is to
//! blame; it explains the failures of its step and the next (see [`super::follows_from`]).

use crate::config::Config;
use crate::engine::Run;
use crate::event::SemanticEvent;

use super::super::episodes::Episode;
use super::super::vocab::Failure;
use super::{FailureRule, Sentence, first_at_onset, sigmoid};

pub(crate) struct DataAnomaly;

impl FailureRule for DataAnomaly {
    fn failure(&self) -> Failure {
        Failure::DataAnomaly
    }

    fn precedence(&self) -> u8 {
        0
    }

    /// Targets outside the domain of their loss (see `causes::targets_outside_probabilities`)
    /// are an anomaly of every batch, from the first step.
    fn episodes(&self, run: &Run, _: &Config, found: &[Episode]) -> Vec<Episode> {
        if found.iter().any(|e| e.failure == Failure::DataAnomaly) {
            return Vec::new();
        }
        match (
            super::super::causes::targets_outside_probabilities(run),
            run.first_step,
            run.last_step,
        ) {
            (Some(_), Some(first), Some(last)) => vec![Episode {
                duration: last.saturating_sub(first) + 1,
                to_end: true,
                margin: f64::INFINITY,
                ..Episode::new(Failure::DataAnomaly, first)
            }],
            _ => Vec::new(),
        }
    }

    /// Targets outside their loss's domain are no batch's: every batch carries them.
    fn opening(&self, s: &Sentence<'_>) -> String {
        let e = s.episode();
        if e.root_event.is_none()
            && super::super::causes::targets_outside_probabilities(s.run).is_some()
        {
            return format!(
                "The loss's targets were outside its domain at step {}",
                e.onset
            );
        }
        super::phrase_at_step(s)
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
