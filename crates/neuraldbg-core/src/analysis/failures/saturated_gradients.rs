//! `saturated_gradients`: gradient norms above 1 and below the exploding threshold. A warning
//! more than a failure: its probability stays low.

use crate::engine::Run;
use crate::event::SemanticEvent;

use super::super::episodes::Episode;
use super::super::vocab::Failure;
use super::{FailureRule, Link, Sentence, after_bad_data, before_or_with, breadth, near};

pub(crate) struct SaturatedGradients;

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

    fn probability(&self, run: &Run, e: &Episode) -> f64 {
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
