//! `loss_divergence`: the loss rose far above its best.

use crate::config::Config;
use crate::engine::Run;
use crate::event::SemanticEvent;

use super::super::episodes::Episode;
use super::super::vocab::Failure;
use super::{FailureRule, Link, Sentence, after_bad_data, first_at_onset, near, phrase_at_step};

pub(crate) struct LossDivergence;

impl FailureRule for LossDivergence {
    fn failure(&self) -> Failure {
        Failure::LossDivergence
    }

    fn precedence(&self) -> u8 {
        6
    }

    /// A loss with no minimum, below zero and falling without end (see
    /// `output_loss_mismatch::falls_without_end`), diverges from the first step.
    fn episodes(&self, run: &Run, _: &Config, found: &[Episode]) -> Vec<Episode> {
        if found.iter().any(|e| e.failure == Failure::LossDivergence)
            || !super::super::causes::falls_without_end(run)
        {
            return Vec::new();
        }
        match (run.first_step, run.last_step) {
            (Some(first), Some(last)) => {
                vec![Episode::to_end(Failure::LossDivergence, first, last)]
            }
            _ => Vec::new(),
        }
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

    /// A loss with no minimum did not rise: it fell without end.
    fn opening(&self, s: &Sentence<'_>) -> String {
        if super::super::causes::falls_without_end(s.run) {
            return format!(
                "The loss fell without bound from step {}",
                s.episode().onset
            );
        }
        phrase_at_step(s)
    }

    fn probability(&self, _: &Run, e: &Episode) -> f64 {
        let d = e.duration as f64;
        let end = if e.to_end { 1.0 } else { 0.0 };
        let x = 1.0 + 2.0 * e.margin.min(3.0) + d.min(20.0) / 10.0 + 0.5 * end;
        let p = 1.0 - (-x).exp();
        // A spike the run recovered from within a few steps is a warning more than a failure.
        if !e.to_end && e.duration <= 5 {
            p.min(0.6)
        } else {
            p
        }
    }

    fn follows_from(&self, a: &Episode, e: &Episode, l: &Link<'_>) -> bool {
        after_bad_data(a, e, l)
            || match a.failure {
                // Exploding gradients and a diverging loss are one blow-up seen twice; the
                // gradients locate it.
                Failure::ExplodingGradients => near(a.onset, e.onset, 20),
                Failure::NonFinite => a.onset <= e.onset,
                _ => false,
            }
    }
}
