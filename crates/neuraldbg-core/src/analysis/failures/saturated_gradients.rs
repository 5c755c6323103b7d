//! `saturated_gradients`: gradient norms above 1 and below the exploding threshold. A warning
//! more than a failure: its probability stays low, unless the norms are the running sums of a
//! loop that never zeroes `.grad`.

use crate::engine::Run;
use crate::event::SemanticEvent;

use super::super::episodes::Episode;
use super::super::vocab::Failure;
use super::{FailureRule, Link, Sentence, after_bad_data, before_or_with, breadth, near};

pub(crate) struct SaturatedGradients;

/// Probability of high norms to the end of a run whose `.grad` was never zeroed.
const SUMMED: f64 = 0.7;

impl FailureRule for SaturatedGradients {
    fn failure(&self) -> Failure {
        Failure::SaturatedGradients
    }

    fn precedence(&self) -> u8 {
        7
    }

    fn locate(
        &self,
        run: &Run,
        events: &[SemanticEvent],
        cluster: &[usize],
        onset: u64,
    ) -> (Option<usize>, Option<usize>) {
        super::exploding_gradients::backward_root(run, events, cluster, onset)
    }

    /// High norms alone are weak evidence, except where the loop never zeroed `.grad` (a fact
    /// of the loop, on at least half of the steps): the norms are then those of the running
    /// sums the optimizer applies, and norms high to the end are the failure itself.
    fn probability(&self, run: &Run, e: &Episode) -> f64 {
        let summed = run.loop_facts.accumulated_share().is_some_and(|s| s >= 0.5);
        if summed && e.to_end {
            return SUMMED;
        }
        let end = if e.to_end { 1.0 } else { 0.0 };
        (0.1 + 0.25 * breadth(run, e) * end).min(0.35)
    }

    fn follows_from(&self, a: &Episode, e: &Episode, l: &Link<'_>) -> bool {
        after_bad_data(a, e, l)
            || match a.failure {
                Failure::ExplodingGradients => before_or_with(a, e) && near(a.onset, e.onset, 200),
                // A diverging loss explains the large gradients that come with it.
                Failure::LossDivergence => near(a.onset, e.onset, 20),
                Failure::NonFinite => a.onset <= e.onset,
                _ => false,
            }
    }

    fn place(&self, s: &Sentence<'_>) -> String {
        super::exploding_gradients::along_the_backward_pass(s)
    }
}
