//! `dead_neurons`: ReLU-family units that output zero for every sample of the batch. Located
//! at the first module in forward order that shows it; units behind a functional activation
//! (no module of their own) are found from their layer's zero gradient rows.

use crate::config::Config;
use crate::engine::Run;
use crate::event::SemanticEvent;
use crate::track::ActTrack;

use super::super::episodes::Episode;
use super::super::vocab::Failure;
use super::{FailureRule, Link, after_bad_data, module_of, more_of_the_same, persistence, sigmoid};

pub(crate) struct DeadNeurons;

impl FailureRule for DeadNeurons {
    fn failure(&self) -> Failure {
        Failure::DeadNeurons
    }

    fn precedence(&self) -> u8 {
        1
    }

    fn episodes(&self, run: &Run, _: &Config, _: &[Episode]) -> Vec<Episode> {
        super::super::functional::dead_units(run)
    }

    fn locate(
        &self,
        run: &Run,
        events: &[SemanticEvent],
        cluster: &[usize],
        _onset: u64,
    ) -> (Option<usize>, Option<usize>) {
        forward_root(run, events, cluster, |t| t.max_dead)
    }

    /// The larger the share of the layer dead, the likelier; for units dead to the end, the
    /// share still dead at the last measurement rather than the worst one: a layer that
    /// peaked at 78% and settled at 62% ends much like a default-initialized `ReLU` layer, about
    /// half of whose units can be zero for a whole batch.
    fn probability(&self, run: &Run, e: &Episode) -> f64 {
        let t = 0.5;
        let fraction = share_at_end(run, e).map_or(e.fraction, |d| d.min(e.fraction));
        let base = ((fraction - t) / (1.0 - t)).clamp(0.0, 1.0);
        sigmoid(6.0 * (base - 0.4)) * persistence(e)
    }

    fn follows_from(&self, a: &Episode, e: &Episode, l: &Link<'_>) -> bool {
        after_bad_data(a, e, l) || more_of_the_same(a, e)
    }
}

/// Root of an activation failure: the first module in forward order that shows it during the
/// episode, preferring modules that went (nearly) all the way by `worst` (their largest dead
/// or saturated share): a layer with >= 90% of its units dead blocks the gradient; one
/// flickering around half does not.
pub(crate) fn forward_root(
    run: &Run,
    events: &[SemanticEvent],
    cluster: &[usize],
    worst: fn(&ActTrack) -> f64,
) -> (Option<usize>, Option<usize>) {
    let share = |i: usize| {
        module_of(&events[i])
            .and_then(|m| run.model.module_activation[m])
            .map_or(0.0, |a| worst(&run.acts[a]))
    };
    let severe: Vec<usize> = cluster
        .iter()
        .copied()
        .filter(|&i| share(i) >= 0.9)
        .collect();
    let pool = if severe.is_empty() {
        cluster
    } else {
        &severe[..]
    };
    let i = pool
        .iter()
        .copied()
        .min_by_key(|&i| (module_of(&events[i]), events[i].step));
    (i, i.and_then(|i| module_of(&events[i])))
}

/// The activation track of a dead-units episode's own module, if it has one.
fn own_track<'r>(run: &'r Run, e: &Episode) -> Option<&'r crate::track::ActTrack> {
    if e.failure != Failure::DeadNeurons {
        return None;
    }
    Some(&run.acts[run.model.module_activation[e.root?]?])
}

/// For units dead to the end in a module of their own: the share of its units still dead at the
/// last measurement.
pub(crate) fn share_at_end(run: &Run, e: &Episode) -> Option<f64> {
    let last = own_track(run, e).filter(|_| e.to_end)?.last_dead;
    (!last.is_nan()).then_some(last)
}

/// For dead units in a module of their own: the share of its units dead at its first
/// measurement (before any update has had an effect when that is step 0).
pub(crate) fn share_at_start(run: &Run, e: &Episode) -> Option<f64> {
    let first = own_track(run, e)?.first_dead;
    (!first.is_nan()).then_some(first)
}
