//! `loss_plateau`: the loss stopped improving above the level of a converged run, or at the
//! floor of a loss that provably cannot reach its optimum.

use crate::config::Config;
use crate::engine::Run;
use crate::event::SemanticEvent;

use super::super::episodes::Episode;
use super::super::vocab::Failure;
use super::{FailureRule, Link, after_bad_data, first_at_onset};

pub(crate) struct LossPlateau;

impl FailureRule for LossPlateau {
    fn failure(&self) -> Failure {
        Failure::LossPlateau
    }

    fn precedence(&self) -> u8 {
        8
    }

    /// A loss that went flat below the plateau level (which otherwise tells a converged run
    /// from a stuck one) is a plateau too when the loss provably cannot reach its optimum: the
    /// output does not fit the loss, or the loss broadcasts the target (see `causes`).
    fn episodes(&self, run: &Run, _: &Config, found: &[Episode]) -> Vec<Episode> {
        if found.iter().any(|e| e.failure == Failure::LossPlateau) {
            return Vec::new();
        }
        let (Some(since), Some(last)) = (run.loss.flat_since, run.last_step) else {
            return Vec::new();
        };
        if !super::super::causes::loss_bounded_by_mistake(run) {
            return Vec::new();
        }
        vec![Episode {
            duration: last.saturating_sub(since) + 1,
            to_end: true,
            ..Episode::new(Failure::LossPlateau, since)
        }]
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

    fn probability(&self, run: &Run, e: &Episode) -> f64 {
        let w = 100.0;
        let stuck = run
            .loss
            .initial
            .is_some_and(|i| run.loss.last_smoothed >= 0.95 * i);
        let end = if e.to_end { 1.0 } else { 0.0 };
        0.35 + 0.2 * (e.duration as f64 / w).min(1.0) + if stuck { 0.2 } else { 0.0 } + 0.1 * end
    }

    /// A failure that stops learning explains a flat loss, if it is itself a real failure (the
    /// plateau's onset is back-dated to the start of its flat window); a layer that does not
    /// learn can hold the loss flat too.
    fn follows_from(&self, a: &Episode, e: &Episode, l: &Link<'_>) -> bool {
        after_bad_data(a, e, l)
            || matches!(
                a.failure,
                Failure::DeadNeurons
                    | Failure::VanishingGradients
                    | Failure::SaturatedActivations
                    | Failure::StalledLayer
            ) && a.p_failure >= 0.5
                && a.onset <= e.onset + u64::from(l.config.loss_plateau_window)
    }
}
