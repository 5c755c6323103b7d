//! The failures, one rule each: everything about a failure apart from its causes.
//!
//! A [`FailureRule`] says where an episode of its failure begins (its root module and event),
//! the episodes that no event marks (a layer that never moved, a collapsed loss scale), how
//! likely an episode is to be a real failure, which other failure it can follow from, how it
//! reads in the hypothesis sentence and how its remedies differ from its cause's. [`RULES`]
//! lists them; a test checks every failure has exactly one rule. What caused a failure is the
//! cause rules' business (`causes`).

mod data_anomaly;
mod dead_neurons;
mod exploding_gradients;
mod loss_divergence;
mod loss_plateau;
mod loss_scale_collapse;
mod non_finite;
mod replica_divergence;
mod saturated_activations;
mod saturated_gradients;
mod stalled_layer;
mod vanishing_gradients;

pub(crate) use dead_neurons::share_at_start as dead_share_at_start;
pub(crate) use loss_plateau::{
    Chance, chance_level, creeping, frozen_plateau, not_learning, pace, steady_descent,
};

use std::fmt::Write as _;

use crate::config::Config;
use crate::engine::Run;
use crate::event::{EventType, SemanticEvent, Subject};
use crate::health::{DataHealth, State};

use super::episodes::Episode;
use super::remedy::Remedy;
use super::text::show;
use super::vocab::{Cause, Failure};

/// What a rule may look at when it decides whether one episode follows from another.
pub(crate) struct Link<'a> {
    pub run: &'a Run,
    pub events: &'a [SemanticEvent],
    /// Steps within which failures count as simultaneous (the coupling window, or the gap
    /// between activation measurements when wider).
    pub tol: u64,
    pub config: &'a Config,
}

/// What the hypothesis sentence of episode `episodes[k]` may refer to.
pub(crate) struct Sentence<'a> {
    pub run: &'a Run,
    pub episodes: &'a [Episode],
    pub k: usize,
    pub events: &'a [SemanticEvent],
}

impl Sentence<'_> {
    pub fn episode(&self) -> &Episode {
        &self.episodes[self.k]
    }

    /// The root module as shown in sentences.
    pub fn root_name(&self) -> Option<String> {
        self.episode()
            .root
            .map(|m| show(self.run.model.module_name(m)))
    }

    /// The root event's type.
    pub fn root_event_type(&self) -> Option<EventType> {
        self.episode().root_event.map(|i| self.events[i].event_type)
    }
}

/// One failure: where it begins, how likely it is real, what it follows from, how it reads.
pub(crate) trait FailureRule: Sync {
    fn failure(&self) -> Failure;
    /// Causal precedence among failures that begin on the same step (lower explains higher).
    fn precedence(&self) -> u8;
    /// Whether the cause rules rank its causes (the default). When not, `unknown` is its only
    /// candidate and its remedies say where to look.
    fn ranked_by_cause_rules(&self) -> bool {
        true
    }
    /// Episodes of this failure that no event marks; `found` holds the episodes built so far.
    fn episodes(&self, _run: &Run, _config: &Config, _found: &[Episode]) -> Vec<Episode> {
        Vec::new()
    }
    /// The root of an episode made of the events `cluster` that began at `onset`: its root
    /// event and its root module.
    fn locate(
        &self,
        run: &Run,
        events: &[SemanticEvent],
        cluster: &[usize],
        onset: u64,
    ) -> (Option<usize>, Option<usize>);
    /// Adjusts an episode once built from its events (the default: nothing).
    fn settle(&self, _run: &Run, _e: &mut Episode) {}
    /// Probability that an episode is a real failure rather than noise, from how far past its
    /// threshold it went, how long it lasted and how much of the model it reached.
    fn probability(&self, run: &Run, e: &Episode) -> f64;
    /// Whether `e`, an episode of this failure, is a consequence of `a` (the default: of bad
    /// data only).
    fn follows_from(&self, a: &Episode, e: &Episode, l: &Link<'_>) -> bool {
        after_bad_data(a, e, l)
    }
    /// Where the failure is, in the hypothesis sentence (after "... at step N").
    fn place(&self, s: &Sentence<'_>) -> String {
        in_modules(s)
    }
    /// How the sentence opens, before the place (the default: [`phrase_at_step`]).
    fn opening(&self, s: &Sentence<'_>) -> String {
        phrase_at_step(s)
    }
    /// The whole sentence, for a failure that reads its own way (the default: the common form).
    fn sentence(&self, _s: &Sentence<'_>) -> Option<String> {
        None
    }
    /// Cause to consequences, for a failure that no event tells (the default: from events).
    fn chain(&self, _run: &Run, _e: &Episode) -> Option<Vec<String>> {
        None
    }
    /// The remedies of an episode blamed on `cause`, from the cause's own (the default: those).
    fn remedies(&self, _cause: Cause, of_cause: Vec<Remedy>) -> Vec<Remedy> {
        of_cause
    }
}

/// Every failure's rule.
pub(crate) static RULES: &[&dyn FailureRule] = &[
    &vanishing_gradients::VanishingGradients,
    &exploding_gradients::ExplodingGradients,
    &saturated_gradients::SaturatedGradients,
    &saturated_activations::SaturatedActivations,
    &non_finite::NonFinite,
    &data_anomaly::DataAnomaly,
    &loss_divergence::LossDivergence,
    // Episodes no event marks are found in this order: layers that never moved, units dead
    // behind a functional activation, a plateau at the floor of a broken loss, a collapsed
    // loss scale.
    &stalled_layer::StalledLayer,
    &dead_neurons::DeadNeurons,
    &loss_plateau::LossPlateau,
    &loss_scale_collapse::LossScaleCollapse,
    &replica_divergence::ReplicaDivergence,
];

/// The rule of `failure`.
pub(crate) fn rule(failure: Failure) -> &'static dyn FailureRule {
    RULES
        .iter()
        .copied()
        .find(|r| r.failure() == failure)
        .expect("every failure has a rule")
}

/// The probability of episode `k`, corroborated by each failure it explains.
pub(crate) fn corroborated(episodes: &[Episode], k: usize) -> f64 {
    let p = episodes[k].p_failure;
    let consequences = episodes
        .iter()
        .filter(|o| o.explained_by == Some(k))
        .count() as f64;
    (p + 0.1 * consequences * (1.0 - p)).clamp(0.0, 0.99)
}

/// Does episode `a` explain episode `b` (is `b` a consequence of `a`)? Its failure's rule says.
pub(crate) fn follows_from(a: &Episode, b: &Episode, l: &Link<'_>) -> bool {
    rule(b.failure).follows_from(a, b, l)
}

/// Bad data at (or one step before) a failure explains it (a plateau only when the batch held
/// NaN/Inf).
pub(crate) fn after_bad_data(a: &Episode, b: &Episode, l: &Link<'_>) -> bool {
    if a.failure != Failure::DataAnomaly {
        return false;
    }
    let nonfinite_batch = a
        .events
        .iter()
        .any(|&i| l.events[i].to_state == State::Data(DataHealth::NonFinite));
    (nonfinite_batch || b.failure != Failure::LossPlateau)
        && a.onset <= b.onset
        && b.onset <= a.onset + 1
}

/// `a` began before `b`, or with it and is more fundamental.
pub(crate) fn before_or_with(a: &Episode, b: &Episode) -> bool {
    a.onset < b.onset
        || (a.onset == b.onset && rule(a.failure).precedence() < rule(b.failure).precedence())
}

/// Steps `x` and `y` are within `w` of each other.
pub(crate) fn near(x: u64, y: u64, w: u64) -> bool {
    x <= y + w && y <= x + w
}

/// One failure per failure: a later episode `b` of the failure of `a`, begun while `a` (a real
/// one) was still going, is more of it (its evidence), not a rival finding.
pub(crate) fn more_of_the_same(a: &Episode, b: &Episode) -> bool {
    a.failure == b.failure
        && a.p_failure >= 0.5
        && a.onset < b.onset
        && (a.to_end || b.onset <= a.onset + a.duration)
}

pub(crate) fn module_of(e: &SemanticEvent) -> Option<usize> {
    match e.subject {
        Subject::Module(m) => Some(m),
        _ => None,
    }
}

/// The events of `cluster` on step `onset`.
pub(crate) fn at_onset(events: &[SemanticEvent], cluster: &[usize], onset: u64) -> Vec<usize> {
    cluster
        .iter()
        .copied()
        .filter(|&i| events[i].step == onset)
        .collect()
}

/// The common root: the first event of the onset step, and no module.
pub(crate) fn first_at_onset(
    events: &[SemanticEvent],
    cluster: &[usize],
    onset: u64,
) -> (Option<usize>, Option<usize>) {
    (at_onset(events, cluster, onset).first().copied(), None)
}

/// The probability that the failure persisted: certain to the end or over 10 steps, 0.6 if
/// shorter.
pub(crate) fn persistence(e: &Episode) -> f64 {
    if e.to_end || e.duration >= 10 {
        1.0
    } else {
        0.6
    }
}

pub(crate) fn sigmoid(x: f64) -> f64 {
    1.0 / (1.0 + (-x).exp())
}

/// The share of the model's layers the episode reached.
pub(crate) fn breadth(run: &Run, e: &Episode) -> f64 {
    e.affected.len() as f64 / run.model.layers.len().max(1) as f64
}

/// "Gradients vanished at step 12": the failure's phrase and the step it began, the common
/// opening of a hypothesis sentence.
pub(crate) fn phrase_at_step(s: &Sentence<'_>) -> String {
    let e = s.episode();
    format!("{} at step {}", e.failure.phrase(), e.onset)
}

/// " in `m` (95%) and 2 more module(s)": the sentence's place for failures rooted in one module.
pub(crate) fn in_modules(s: &Sentence<'_>) -> String {
    let e = s.episode();
    let mut out = String::new();
    if let Some(name) = s.root_name() {
        let extra = e.affected.len().saturating_sub(1);
        let _ = write!(out, " in {name}");
        match dead_neurons::share_at_end(s.run, e) {
            Some(end) if e.fraction.is_finite() && end < e.fraction - 0.05 => {
                let _ = write!(
                    out,
                    " ({:.0}% at worst, {:.0}% at the end)",
                    100.0 * e.fraction,
                    100.0 * end
                );
            }
            _ if e.fraction.is_finite() => {
                let _ = write!(out, " ({:.0}%)", 100.0 * e.fraction);
            }
            _ => {}
        }
        if extra > 0 {
            let _ = write!(out, " and {extra} more module(s)");
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_failure_has_exactly_one_rule() {
        for &failure in Failure::ALL {
            let n = RULES.iter().filter(|r| r.failure() == failure).count();
            assert_eq!(n, 1, "{failure} has {n} rules");
        }
        assert_eq!(RULES.len(), Failure::ALL.len());
    }
}
