//! From events to failure episodes: which failures happened, when each began, which layer it
//! began in (root-cause search), how long and how badly, and which failure explains which.

use std::collections::HashMap;

use crate::config::Config;
use crate::engine::Run;
use crate::event::{EventType, SemanticEvent, Subject};
use crate::health::{
    ActivationHealth, DataHealth, GradientHealth, LossHealth, OutputHealth, ReplicaHealth, State,
};

use super::failures::{self, module_of};
use super::vocab::Failure;

/// Events further apart than this (in steps) belong to separate episodes of a failure.
const CLUSTER_GAP: u64 = 50;

/// One occurrence of a failure.
#[derive(Clone, Debug)]
pub(crate) struct Episode {
    pub failure: Failure,
    /// Step the failure began (its first event's onset).
    pub onset: u64,
    /// Indices into the analysis' sorted events.
    pub events: Vec<usize>,
    /// Root-cause module (index into the model's modules), None when no single module is to
    /// blame (data, loss).
    pub root: Option<usize>,
    pub root_event: Option<usize>,
    /// Modules that showed the failure, in forward order.
    pub affected: Vec<usize>,
    /// Largest margin past the threshold among its events.
    pub margin: f64,
    /// Steps the root subject stayed in the failure state.
    pub duration: u64,
    /// Still in the failure state at the last observed step.
    pub to_end: bool,
    /// Probability that this is a real failure rather than noise: the base probability while
    /// linking, then corroborated by its consequences (see `causes`).
    pub p_failure: f64,
    /// The episode that explains this one (its consequence chain starts there).
    pub explained_by: Option<usize>,
    /// Worst fraction seen (dead or saturated share) for activation failures.
    pub fraction: f64,
    /// Gradient norms of the affected layers were exactly zero at onset.
    pub exact_zero: bool,
    /// For a stalled layer: it never received a gradient (rather than receiving gradients
    /// its weights never followed).
    pub no_gradient: bool,
}

impl Episode {
    /// An episode of `failure` from `onset` that no event marks, lasting one step, not yet
    /// weighed or linked.
    pub fn new(failure: Failure, onset: u64) -> Self {
        Self {
            failure,
            onset,
            events: Vec::new(),
            root: None,
            root_event: None,
            affected: Vec::new(),
            margin: 0.0,
            duration: 1,
            to_end: false,
            p_failure: 0.0,
            explained_by: None,
            fraction: f64::NAN,
            exact_zero: false,
            no_gradient: false,
        }
    }

    /// An episode of `failure` from `onset` to the run's last step `last`, still on there.
    pub fn to_end(failure: Failure, onset: u64, last: u64) -> Self {
        Self {
            duration: last.saturating_sub(onset) + 1,
            to_end: true,
            ..Self::new(failure, onset)
        }
    }
}

/// The failure an event signals, if any (recoveries and warnings that are not failures map to
/// None).
pub(crate) fn failure_of(e: &SemanticEvent) -> Option<Failure> {
    Some(match e.to_state {
        State::Gradient(GradientHealth::Vanishing) => Failure::VanishingGradients,
        State::Gradient(GradientHealth::Exploding) => Failure::ExplodingGradients,
        State::Gradient(GradientHealth::Saturated) => Failure::SaturatedGradients,
        State::Gradient(GradientHealth::NonFinite)
        | State::Activation(ActivationHealth::NonFinite)
        | State::Loss(LossHealth::NonFinite)
        | State::Output(OutputHealth::NonFinite) => Failure::NonFinite,
        State::Activation(ActivationHealth::Saturated) => Failure::SaturatedActivations,
        State::Activation(ActivationHealth::Dead) => Failure::DeadNeurons,
        State::Data(DataHealth::NonFinite | DataHealth::OutOfDistribution) => Failure::DataAnomaly,
        State::Loss(LossHealth::Diverging) => Failure::LossDivergence,
        State::Loss(LossHealth::Plateau) => Failure::LossPlateau,
        State::Replica(ReplicaHealth::Diverged) => Failure::ReplicaDivergence,
        _ => return None,
    })
}

/// Events indexed by subject, for duration lookups.
pub(crate) struct Timeline<'a> {
    events: &'a [SemanticEvent],
    by_subject: HashMap<(Subject, EventType), Vec<usize>>,
    last_step: u64,
}

impl<'a> Timeline<'a> {
    pub fn new(events: &'a [SemanticEvent], last_step: u64) -> Self {
        let mut by_subject: HashMap<(Subject, EventType), Vec<usize>> = HashMap::new();
        for (i, e) in events.iter().enumerate() {
            by_subject
                .entry((e.subject, e.event_type))
                .or_default()
                .push(i);
        }
        Self {
            events,
            by_subject,
            last_step,
        }
    }

    /// How long the subject of event `i` stayed in that event's `to_state`, and whether it was
    /// still there at the end.
    pub fn duration(&self, i: usize) -> (u64, bool) {
        let e = &self.events[i];
        if e.event_type == EventType::NonFiniteOutput {
            // A one-shot marker: it lasts as long as the run stays non-finite, which the other
            // events of its episode describe.
            return (1, false);
        }
        let list = &self.by_subject[&(e.subject, e.event_type)];
        let next = list
            .iter()
            .map(|&j| &self.events[j])
            .find(|n| n.step > e.step && n.from_state == e.to_state);
        match next {
            Some(n) => (n.step - e.step, false),
            None => (self.last_step - e.step + 1, true),
        }
    }
}

/// Groups failure events into episodes and locates each one's root.
pub(crate) fn build(run: &Run, events: &[SemanticEvent], config: &Config) -> Vec<Episode> {
    let last_step = run.last_step.unwrap_or(0);
    let timeline = Timeline::new(events, last_step);
    let mut by_failure: HashMap<Failure, Vec<usize>> = HashMap::new();
    for (i, e) in events.iter().enumerate() {
        if let Some(f) = failure_of(e) {
            by_failure.entry(f).or_default().push(i);
        }
    }
    let mut episodes = Vec::new();
    let mut failures: Vec<_> = by_failure.into_iter().collect();
    failures.sort_by_key(|(f, _)| *f);
    for (failure, idx) in failures {
        let mut cluster: Vec<usize> = Vec::new();
        let mut last = 0u64;
        for i in idx {
            let s = events[i].step;
            if !cluster.is_empty() && s > last + CLUSTER_GAP {
                let done = std::mem::take(&mut cluster);
                episodes.push(episode(run, events, &timeline, failure, done));
            }
            last = if cluster.is_empty() { s } else { last.max(s) };
            cluster.push(i);
        }
        if !cluster.is_empty() {
            episodes.push(episode(run, events, &timeline, failure, cluster));
        }
    }
    for rule in failures::RULES {
        let found = rule.episodes(run, config, &episodes);
        episodes.extend(found);
    }
    for e in &mut episodes {
        e.p_failure = failures::rule(e.failure)
            .probability(run, e)
            .clamp(0.0, 0.99);
    }
    link(run, events, &mut episodes, config);
    episodes
}

fn episode(
    run: &Run,
    events: &[SemanticEvent],
    timeline: &Timeline<'_>,
    failure: Failure,
    cluster: Vec<usize>,
) -> Episode {
    let onset = cluster.iter().map(|&i| events[i].step).min().unwrap_or(0);
    let margin = cluster
        .iter()
        .map(|&i| events[i].margin)
        .fold(0.0f64, f64::max);
    let mut affected: Vec<usize> = cluster
        .iter()
        .filter_map(|&i| module_of(&events[i]))
        .collect();
    affected.sort_unstable();
    affected.dedup();

    let rule = failures::rule(failure);
    let (root_event, root) = rule.locate(run, events, &cluster, onset);
    // An activation failure is dated where its root module's failure began.
    let onset = match (failure, root_event) {
        (Failure::SaturatedActivations | Failure::DeadNeurons, Some(i)) => events[i].step,
        _ => onset,
    };
    let (duration, to_end) = root_event.map_or_else(
        || {
            cluster
                .iter()
                .map(|&i| timeline.duration(i))
                .max_by_key(|(d, _)| *d)
                .unwrap_or((1, false))
        },
        |i| {
            // The failure lasts as long as any of its subjects is still in it.
            let (d, end) = timeline.duration(i);
            cluster
                .iter()
                .map(|&j| timeline.duration(j))
                .fold((d, end), |(d, e), (dj, ej)| (d.max(dj), e || ej))
        },
    );
    // Worst share reached by the root module (dead or saturated units).
    let fraction = root
        .and_then(|m| run.model.module_activation[m])
        .map_or(f64::NAN, |a| match failure {
            Failure::DeadNeurons => run.acts[a].max_dead,
            Failure::SaturatedActivations => run.acts[a].max_saturated,
            _ => f64::NAN,
        });
    let exact_zero = failure == Failure::VanishingGradients
        && cluster
            .iter()
            .filter(|&&i| events[i].step == onset)
            .all(|&i| events[i].value == 0.0);
    let mut episode = Episode {
        failure,
        onset,
        events: cluster,
        root,
        root_event,
        affected,
        margin,
        duration,
        to_end,
        p_failure: 0.0,
        explained_by: None,
        fraction,
        exact_zero,
        no_gradient: false,
    };
    rule.settle(run, &mut episode);
    episode
}

/// Steps between activation measurements (activation statistics may be sampled).
pub(crate) fn activation_gap(run: &Run) -> u64 {
    let observed = run.acts.iter().map(|a| a.observed).max().unwrap_or(0);
    match (run.first_step, run.last_step) {
        (Some(f), Some(l)) if observed > 1 => (l - f) / (observed - 1).max(1),
        _ => 1,
    }
}

/// Decides which episodes are consequences of which, and moves a gradient failure's root to the
/// dead layer that blocks it.
fn link(run: &Run, events: &[SemanticEvent], episodes: &mut [Episode], config: &Config) {
    let ctx = failures::Link {
        run,
        events,
        tol: config.coupling_window.max(activation_gap(run)),
        config,
    };
    let n = episodes.len();
    for i in 0..n {
        let mut best: Option<usize> = None;
        for j in 0..n {
            if i == j {
                continue;
            }
            if failures::follows_from(&episodes[j], &episodes[i], &ctx)
                && best.is_none_or(|b| episodes[j].onset < episodes[b].onset)
            {
                best = Some(j);
            }
        }
        if let Some(j) = best {
            // Never link both ways: the earlier (or, at a tie, the more fundamental) wins.
            if episodes[j].explained_by != Some(i) {
                episodes[i].explained_by = Some(j);
            }
        }
    }
    for i in 0..n {
        let Some(j) = episodes[i].explained_by else {
            continue;
        };
        match (episodes[j].failure, episodes[i].failure) {
            // A dead layer that blocks the backward pass is the root of the vanishing below it.
            (Failure::DeadNeurons, Failure::VanishingGradients) => {
                episodes[i].root = episodes[j].root;
            }
            // NaN/Inf that came in with the data is no module's fault.
            (Failure::DataAnomaly, Failure::NonFinite) => episodes[i].root = None,
            _ => {}
        }
    }
}
