//! `stalled_layer`: a layer whose parameters never change, or never get a gradient, while the
//! rest of the model trains. Found from the layers' tracks, not from events (see `stalled`).

use crate::config::Config;
use crate::engine::Run;
use crate::event::SemanticEvent;

use super::super::episodes::Episode;
use super::super::vocab::Failure;
use super::{FailureRule, Link, Sentence, after_bad_data, first_at_onset};

pub(crate) struct StalledLayer;

impl FailureRule for StalledLayer {
    fn failure(&self) -> Failure {
        Failure::StalledLayer
    }

    fn precedence(&self) -> u8 {
        1
    }

    fn episodes(&self, run: &Run, config: &Config, _: &[Episode]) -> Vec<Episode> {
        super::super::stalled::episodes(run, config)
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

    /// A cut between the loss and the model's output stops every layer: the model did not train.
    fn opening(&self, s: &Sentence<'_>) -> String {
        if whole_model(s) {
            return format!(
                "No layer of the model trained from step {}",
                s.episode().onset
            );
        }
        super::phrase_at_step(s)
    }

    fn place(&self, s: &Sentence<'_>) -> String {
        if whole_model(s) {
            return String::new();
        }
        super::in_modules(s)
    }

    /// Weights that stopped moving once the schedule had taken the learning rate away follow
    /// from the loss it froze (see `frozen_by_the_schedule`): one collapse, seen in the loss
    /// first and in the weights once steps no longer change them.
    fn follows_from(&self, a: &Episode, e: &Episode, l: &Link<'_>) -> bool {
        after_bad_data(a, e, l)
            || a.failure == Failure::LossPlateau
                && !e.no_gradient
                && a.onset <= e.onset
                && super::frozen_plateau(l.run, a.onset).is_some()
    }

    /// Detected only over at least 20 steps (see `stalled`); surer the longer it lasts.
    fn probability(&self, _: &Run, e: &Episode) -> f64 {
        0.5 + 0.45 * (e.duration as f64 / 60.0).min(1.0)
    }
}

/// The episode is every layer's: the backward pass reached none (see `stalled::unreached`).
fn whole_model(s: &Sentence<'_>) -> bool {
    s.episode().no_gradient && super::super::stalled::cut_from_the_loss(s.run)
}
