//! From events to failure episodes: which failures happened, when each began, which layer it
//! began in (root-cause search), how long and how badly, and which failure explains which.

use std::collections::HashMap;

use crate::config::Config;
use crate::engine::Run;
use crate::event::{EventType, SemanticEvent, Subject};
use crate::health::{
    ActivationHealth, DataHealth, GradientHealth, LossHealth, OutputHealth, ReplicaHealth, State,
};

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
    // Gradients exploding from the first step while the forward signal itself blew up inside
    // one module: every later layer's weight gradient is large because its input is, so the
    // explosion begins where the forward growth does, not at the end of the network.
    if let Some(g) = super::causes::forward_growth(run) {
        for e in &mut episodes {
            if e.failure == Failure::ExplodingGradients && e.onset <= g.step {
                e.root = Some(g.module);
                if !e.affected.contains(&g.module) {
                    e.affected.push(g.module);
                    e.affected.sort_unstable();
                }
            }
        }
    }
    episodes.extend(super::stalled::episodes(run, config));
    episodes.extend(super::functional::dead_units(run));
    if !episodes.iter().any(|e| e.failure == Failure::LossPlateau) {
        episodes.extend(floor_plateau(run));
    }
    for e in &mut episodes {
        e.p_failure = super::causes::base_probability(run, e);
    }
    link(run, events, &mut episodes, config);
    episodes
}

/// A loss that went flat below the plateau level (which otherwise tells a converged run from a
/// stuck one) is a plateau too when the loss provably cannot reach its optimum: the output does
/// not fit the loss, or the loss broadcasts the target (see `causes`).
fn floor_plateau(run: &Run) -> Option<Episode> {
    let since = run.loss.flat_since?;
    if !super::causes::loss_bounded_by_mistake(run) {
        return None;
    }
    let last = run.last_step?;
    Some(Episode {
        failure: Failure::LossPlateau,
        onset: since,
        events: Vec::new(),
        root: None,
        root_event: None,
        affected: Vec::new(),
        margin: 0.0,
        duration: last.saturating_sub(since) + 1,
        to_end: true,
        p_failure: 0.0,
        explained_by: None,
        fraction: f64::NAN,
        exact_zero: false,
        no_gradient: false,
    })
}

fn module_of(e: &SemanticEvent) -> Option<usize> {
    match e.subject {
        Subject::Module(m) => Some(m),
        _ => None,
    }
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

    let (root_event, root) = locate_root(run, events, failure, &cluster, onset);
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
    Episode {
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
    }
}

/// Root-cause search within one episode.
///
/// Gradient failures begin where they first appear along the backward pass: among the layers
/// that failed at the onset step, take the longest run of adjacent layers (the structural
/// coupling of layer N and N-1) and, within it, the layer latest in forward order: everything
/// before it in forward order fails because the gradient reaching it already had. Non-finite
/// values and activation failures begin at the first module in forward order that shows them.
fn locate_root(
    run: &Run,
    events: &[SemanticEvent],
    failure: Failure,
    cluster: &[usize],
    onset: u64,
) -> (Option<usize>, Option<usize>) {
    let at_onset: Vec<usize> = cluster
        .iter()
        .copied()
        .filter(|&i| events[i].step == onset)
        .collect();
    match failure {
        Failure::VanishingGradients | Failure::ExplodingGradients | Failure::SaturatedGradients => {
            let model = &run.model;
            let mut layers: Vec<(usize, usize)> = at_onset
                .iter()
                .filter_map(|&i| {
                    module_of(&events[i]).and_then(|m| model.module_layer[m].map(|l| (l, i)))
                })
                .collect();
            layers.sort_unstable();
            // Runs of consecutive layer indices.
            let mut best: Option<(usize, usize)> = None; // (len, index into layers of run end)
            let mut start = 0;
            for k in 0..layers.len() {
                let end_of_run = k + 1 == layers.len() || layers[k + 1].0 != layers[k].0 + 1;
                if end_of_run {
                    let len = k + 1 - start;
                    if best.is_none_or(|(bl, _)| len >= bl) {
                        best = Some((len, k));
                    }
                    start = k + 1;
                }
            }
            best.map_or((at_onset.first().copied(), None), |(_, k)| {
                let (l, i) = layers[k];
                (Some(i), Some(model.layers[l].module))
            })
        }
        Failure::NonFinite => {
            // A forward origin found on the onset step is the most precise location; then the
            // backward pass (the latest layer in forward order whose gradient is non-finite);
            // then any module.
            let origin = at_onset
                .iter()
                .copied()
                .find(|&i| events[i].event_type == EventType::NonFiniteOutput);
            if let Some(i) = origin {
                return (Some(i), module_of(&events[i]));
            }
            // Every module output was checked finite, yet the loss was not: the loss
            // computation itself made it. No layer is to blame.
            if run.finite_forward.contains(&onset) {
                let loss = at_onset
                    .iter()
                    .copied()
                    .find(|&i| events[i].to_state == State::Loss(LossHealth::NonFinite));
                if let Some(i) = loss {
                    return (Some(i), None);
                }
            }
            let grad = at_onset
                .iter()
                .copied()
                .filter(|&i| events[i].event_type == EventType::GradientHealth)
                .max_by_key(|&i| module_of(&events[i]));
            if let Some(i) = grad {
                return (Some(i), module_of(&events[i]));
            }
            let act = at_onset
                .iter()
                .copied()
                .filter(|&i| events[i].event_type == EventType::ActivationHealth)
                .min_by_key(|&i| module_of(&events[i]));
            if let Some(i) = act {
                return (Some(i), module_of(&events[i]));
            }
            (at_onset.first().copied(), None)
        }
        Failure::SaturatedActivations | Failure::DeadNeurons => {
            // The first module in forward order that shows the failure during the episode,
            // preferring modules that went (nearly) all the way: a layer with >= 90% of its
            // units dead blocks the gradient; one flickering around half does not.
            let worst = |i: usize| {
                module_of(&events[i])
                    .and_then(|m| run.model.module_activation[m])
                    .map_or(0.0, |a| {
                        let t = &run.acts[a];
                        if failure == Failure::DeadNeurons {
                            t.max_dead
                        } else {
                            t.max_saturated
                        }
                    })
            };
            let severe: Vec<usize> = cluster
                .iter()
                .copied()
                .filter(|&i| worst(i) >= 0.9)
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
        Failure::DataAnomaly
        | Failure::LossDivergence
        | Failure::LossPlateau
        | Failure::LossScaleCollapse
        | Failure::StalledLayer => (at_onset.first().copied(), None),
        // The first parameter (forward order) found to differ across replicas.
        Failure::ReplicaDivergence => {
            let i = at_onset.first().copied();
            (i, i.and_then(|i| module_of(&events[i])))
        }
    }
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
    let tol = config.coupling_window.max(activation_gap(run));
    let n = episodes.len();
    for i in 0..n {
        let mut best: Option<usize> = None;
        for j in 0..n {
            if i == j {
                continue;
            }
            if explains(events, &episodes[j], &episodes[i], tol, config)
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

/// Causal precedence for failures that begin together (lower explains higher).
fn precedence(f: Failure) -> u8 {
    match f {
        Failure::DataAnomaly => 0,
        Failure::DeadNeurons | Failure::StalledLayer => 1,
        Failure::ExplodingGradients => 2,
        Failure::VanishingGradients => 3,
        Failure::SaturatedActivations => 4,
        Failure::NonFinite => 5,
        Failure::LossDivergence => 6,
        Failure::SaturatedGradients => 7,
        Failure::LossPlateau => 8,
        Failure::LossScaleCollapse => 9,
        Failure::ReplicaDivergence => 10,
    }
}

/// Does episode `a` explain episode `b` (is `b` a consequence of `a`)?
fn explains(events: &[SemanticEvent], a: &Episode, b: &Episode, tol: u64, config: &Config) -> bool {
    use Failure as F;
    let near = |x: u64, y: u64, w: u64| x <= y + w && y <= x + w;
    let before_or_with =
        a.onset < b.onset || (a.onset == b.onset && precedence(a.failure) < precedence(b.failure));
    match (a.failure, b.failure) {
        // Bad data at (or one step before) a failure explains it.
        (F::DataAnomaly, _) => {
            let nonfinite_batch = a
                .events
                .iter()
                .any(|&i| events[i].to_state == State::Data(DataHealth::NonFinite));
            (nonfinite_batch || b.failure != F::LossPlateau)
                && a.onset <= b.onset
                && b.onset <= a.onset + 1
        }
        // A (nearly) completely dead layer explains vanishing gradients in the layers before it.
        (F::DeadNeurons, F::VanishingGradients) => {
            let vanishing_root = b.root.unwrap_or(usize::MAX);
            // (Dead units behind a functional activation are rooted at their own layer.)
            a.fraction >= 0.9
                && (a.affected.iter().any(|&m| m > vanishing_root)
                    || (a.root.is_some() && a.root == b.root))
                && a.onset <= b.onset + tol
        }
        // Saturation is the mechanism of the vanishing it precedes: the vanishing is the failure
        // users see, so the saturation episode ranks under it.
        (F::VanishingGradients, F::SaturatedActivations) => b.onset <= a.onset + tol,
        (F::ExplodingGradients, F::NonFinite | F::SaturatedGradients) => {
            before_or_with && near(a.onset, b.onset, 200)
        }
        // Exploding gradients and a diverging loss are one blow-up seen twice; the gradients
        // locate it. A diverging loss also explains the large gradients that come with it.
        (F::ExplodingGradients, F::LossDivergence) | (F::LossDivergence, F::SaturatedGradients) => {
            near(a.onset, b.onset, 20)
        }
        (F::LossDivergence, F::NonFinite) => a.onset < b.onset,
        // A failure that stops learning explains a flat loss, if it is itself a real failure.
        // (The plateau's onset is back-dated to the start of its flat window.)
        // A layer that does not learn can hold the loss flat too.
        (
            F::DeadNeurons | F::VanishingGradients | F::SaturatedActivations | F::StalledLayer,
            F::LossPlateau,
        ) => a.p_failure >= 0.5 && a.onset <= b.onset + u64::from(config.loss_plateau_window),
        (F::NonFinite, F::LossDivergence | F::SaturatedGradients) => a.onset <= b.onset,
        // One failure per failure: a later episode of the same failure, begun while an earlier
        // real one was still going, is more of it (its evidence), not a rival finding.
        (
            F::VanishingGradients
            | F::ExplodingGradients
            | F::DeadNeurons
            | F::SaturatedActivations,
            _,
        ) if a.failure == b.failure => {
            a.p_failure >= 0.5 && a.onset < b.onset && (a.to_end || b.onset <= a.onset + a.duration)
        }
        _ => false,
    }
}
