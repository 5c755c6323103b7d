//! Post-hoc analysis of an engine's state: failure episodes, root causes, couplings and ranked
//! causal hypotheses.
//!
//! The pipeline is one direction: events -> episodes (clusters of failure events, each with a
//! root located by its failure's rule in `failures`) -> links (which episode is a consequence
//! of which, also the failures' rules) -> evidence -> scored causes (one rule per cause in
//! `causes`) -> hypotheses sorted by confidence, with their remedies (`remedy`).

mod causes;
mod episodes;
mod failures;
mod functional;
mod remedy;
mod stalled;
mod text;
mod vocab;

use std::fmt::Write as _;

use serde::{Deserialize, Serialize};

use crate::engine::{Engine, Run};
use crate::error::EngineError;
use crate::event::{EventType, SemanticEvent, Subject};

pub use text::num as format_number;
pub use vocab::{Cause, Failure};

use episodes::Episode;

/// One ranked explanation of a failure.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct CausalHypothesis {
    pub failure: Failure,
    pub cause: Cause,
    /// Root-cause layer (qualified module name), None when no single layer is to blame.
    pub layer: Option<String>,
    /// Step the failure began.
    pub step: Option<u64>,
    /// `P(failure is real) x P(cause | evidence)`, in [0, 1].
    pub confidence: f64,
    /// One sentence: what failed, where, from when, and why.
    pub description: String,
    /// The events that support it, root first.
    pub evidence: Vec<SemanticEvent>,
    /// Cause to consequences, one line each.
    pub causal_chain: Vec<String>,
    pub remedies: Vec<String>,
}

/// One line, exactly as Python's `str(h)` (and the CLI) print it.
impl std::fmt::Display for CausalHypothesis {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let layer = self
            .layer
            .as_deref()
            .map_or("-", crate::model::display_name);
        let step = self.step.map_or_else(|| "-".to_string(), |s| s.to_string());
        write!(
            f,
            "[{:.2}] {} <- {} (layer {layer}, step {step}): {}",
            self.confidence, self.failure, self.cause, self.description
        )
    }
}

/// The root of one failure episode that no other failure explains.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct RootCause {
    pub failure: Failure,
    pub layer: Option<String>,
    pub step: u64,
    /// The event at the root.
    pub event: Option<SemanticEvent>,
    /// Modules that showed the failure, in forward order.
    pub affected: Vec<String>,
    /// Failures that followed from it.
    pub consequences: Vec<Failure>,
}

/// How two events are coupled.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum CouplingKind {
    /// In adjacent monitored modules (layer N and N-1 in forward order) within the window.
    Structural,
    /// Within the window in steps, anywhere in the model.
    Temporal,
}

/// Two failure events close in steps.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Coupling {
    pub kind: CouplingKind,
    pub first: SemanticEvent,
    pub second: SemanticEvent,
    /// Steps from the first to the second.
    pub lag: u64,
}

/// Highest confidence of a hypothesis whose cause is `unknown`.
const UNKNOWN_CAP: f64 = 0.49;

/// Couplings reported at most (the closest pairs are kept).
const MAX_COUPLINGS: usize = 10_000;

/// An analysis snapshot of an engine.
pub struct Analysis<'a> {
    run: &'a Run,
    events: Vec<SemanticEvent>,
    episodes: Vec<Episode>,
    evidence: causes::Evidence,
}

impl std::fmt::Debug for Analysis<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Analysis")
            .field("events", &self.events.len())
            .field("episodes", &self.episodes.len())
            .finish_non_exhaustive()
    }
}

impl<'a> Analysis<'a> {
    /// Analyses the engine's current state. Returns None when no model is registered.
    pub fn new(engine: &'a Engine) -> Option<Self> {
        let run = engine.run()?;
        let events = engine.events();
        let mut episodes = episodes::build(run, &events, engine.config());
        let p: Vec<f64> = (0..episodes.len())
            .map(|k| failures::corroborated(&episodes, k))
            .collect();
        for (e, p) in episodes.iter_mut().zip(p) {
            e.p_failure = p;
        }
        let evidence = causes::Evidence::gather(run);
        Some(Self {
            run,
            events,
            episodes,
            evidence,
        })
    }

    fn name(&self, m: usize) -> String {
        self.run.model.module_name(m).to_string()
    }

    /// Every episode's candidate causes, scored, with the per-episode facts the rules weighed;
    /// root episodes first, so a consequence can inherit its root's top cause.
    fn rankings(&self) -> Vec<(causes::Features, Vec<(causes::Scored, f64)>)> {
        let n = self.episodes.len();
        let depth = |mut k: usize| {
            let mut d = 0;
            while let Some(j) = self.episodes[k].explained_by {
                k = j;
                d += 1;
                if d > n {
                    break;
                }
            }
            d
        };
        let mut order: Vec<usize> = (0..n).collect();
        order.sort_by_key(|&k| depth(k));
        let mut out: Vec<(causes::Features, Vec<(causes::Scored, f64)>)> =
            vec![(causes::Features::default(), Vec::new()); n];
        for k in order {
            let mut f = causes::features(self.run, &self.evidence, &self.events, &self.episodes, k);
            f.root_cause = self.episodes[k]
                .explained_by
                .and_then(|j| out[j].1.first().map(|(s, _)| (s.cause, j)));
            let ranked = causes::rank_causes(
                self.run,
                &self.evidence,
                &self.events,
                &self.episodes,
                k,
                &f,
            );
            out[k] = (f, ranked);
        }
        out
    }

    /// What the ranking weighed, for fitting and inspecting the cause weights: the run-wide
    /// evidence, and per episode its failure, onset, root layer, probability of being real,
    /// the facts its causes looked at and every candidate cause with its score (the sum of its
    /// evidence weights), its probability and its reasons.
    pub fn evidence_features(&self) -> serde_json::Value {
        let episodes: Vec<serde_json::Value> = self
            .rankings()
            .into_iter()
            .enumerate()
            .map(|(k, (f, ranked))| {
                let e = &self.episodes[k];
                let case = causes::Case::new(
                    self.run,
                    &self.evidence,
                    &f,
                    &self.events,
                    &self.episodes,
                    k,
                );
                let mut features = causes::facts_of(&f);
                features.extend(case.own_facts());
                let causes: Vec<serde_json::Value> = ranked
                    .into_iter()
                    .map(|(s, p)| {
                        serde_json::json!({
                            "cause": s.cause,
                            "score": s.score,
                            "p": p,
                            "reasons": s.reasons,
                        })
                    })
                    .collect();
                serde_json::json!({
                    "failure": e.failure,
                    "onset": e.onset,
                    "layer": e.root.map(|m| self.name(m)),
                    "p_failure": e.p_failure,
                    "explained_by": e.explained_by,
                    "duration": e.duration,
                    "to_end": e.to_end,
                    "margin": e.margin,
                    "breadth": e.affected.len() as f64 / self.run.model.layers.len().max(1) as f64,
                    "features": features,
                    "causes": causes,
                })
            })
            .collect();
        let mut run = causes::facts_of(&self.evidence);
        run.extend(causes::own_run_facts(self.run));
        serde_json::json!({ "run": run, "episodes": episodes })
    }

    /// Ranked hypotheses, optionally for one failure only.
    pub fn hypotheses(&self, only: Option<Failure>) -> Vec<CausalHypothesis> {
        let rankings: Vec<Vec<(causes::Scored, f64)>> =
            self.rankings().into_iter().map(|(_, r)| r).collect();
        let mut out: Vec<(CausalHypothesis, usize)> = Vec::new();
        // Every episode is ranked and capped, the filter applies last: a hypothesis has the
        // same confidence whether or not the failure that explains it is asked for.
        for (k, ranked) in rankings.into_iter().enumerate() {
            let e = &self.episodes[k];
            if e.explained_by
                .is_some_and(|j| self.episodes[j].failure == e.failure)
            {
                // A later episode of the failure that explains it: one failure, one finding;
                // the recurrence is told in the first episode's sentence.
                continue;
            }
            let recurred = self.recurrences(k);
            let discount = if e.explained_by.is_some() { 0.9 } else { 1.0 };
            // The same evidence and chain for each cause of one episode.
            let evidence = self.evidence_of(k);
            let causal_chain = self.chain_lines(k);
            for (scored, p_cause) in ranked.into_iter().take(3) {
                let mut confidence = (e.p_failure * p_cause * discount).clamp(0.0, 1.0);
                // "We don't know why" is not a finding on its own: it stays below the level at
                // which a run counts as failed, wherever named causes compete. Not where the
                // failure itself is the finding: a diverged replica (no named cause explains
                // it), values gone NaN/Inf (no healthy run has them; a spoke that does not see
                // the inputs cannot tell a bad batch from an unstable operation, and halt_on
                // must still stop the run).
                if scored.cause == Cause::Unknown
                    && e.failure.ranked_by_cause_rules()
                    && e.failure != Failure::NonFinite
                {
                    confidence = confidence.min(UNKNOWN_CAP);
                }
                if confidence < 0.02 {
                    continue;
                }
                let description = text::describe(
                    self.run,
                    &self.episodes,
                    k,
                    &self.events,
                    scored.cause,
                    &scored.reasons,
                ) + &recurred;
                let mut remedies = failures::rule(e.failure).remedies(
                    scored.cause,
                    causes::rule(scored.cause).remedies(&causes::RemedyCase {
                        run: self.run,
                        e,
                        by: e.explained_by.map(|j| &self.episodes[j]),
                    }),
                );
                let mut h = CausalHypothesis {
                    failure: e.failure,
                    cause: scored.cause,
                    layer: e.root.map(|m| self.name(m)),
                    step: Some(e.onset),
                    confidence,
                    description,
                    evidence: evidence.clone(),
                    causal_chain: causal_chain.clone(),
                    remedies: Vec::new(),
                };
                if self.note_clipping(&mut h, e) {
                    // Clipping was on: advice to clip is moot.
                    remedies.retain(|r| !r.clips());
                }
                let framework = remedy::Framework::of(self.run.model.spec.framework.as_deref());
                h.remedies = remedies.iter().map(|r| r.text(framework)).collect();
                out.push((h, k));
            }
        }
        // A consequence never outranks the failure that explains it.
        let best_of = |k: usize, out: &[(CausalHypothesis, usize)]| {
            out.iter()
                .filter(|(_, j)| *j == k)
                .map(|(h, _)| h.confidence)
                .fold(0.0f64, f64::max)
        };
        let caps: Vec<Option<f64>> = out
            .iter()
            .map(|(_, k)| {
                self.root_of(*k)
                    .filter(|r| r != k)
                    .map(|r| best_of(r, &out))
                    .filter(|c| *c > 0.0)
            })
            .collect();
        for ((h, _), cap) in out.iter_mut().zip(caps) {
            if let Some(cap) = cap {
                h.confidence = h.confidence.min(cap * 0.97);
            }
        }
        // Keep the best hypothesis per (failure, cause, layer).
        out.sort_by(|a, b| {
            b.0.confidence
                .total_cmp(&a.0.confidence)
                .then(a.1.cmp(&b.1))
        });
        let mut seen = std::collections::HashSet::new();
        out.into_iter()
            .filter(|(h, _)| seen.insert((h.failure, h.cause, h.layer.clone())))
            .map(|(h, _)| h)
            .filter(|h| only.is_none_or(|f| f == h.failure))
            .collect()
    }

    /// Gradients were clipped during a gradient failure: the norms are those the backward pass
    /// produced, so the explosion is real even though the update was bounded. Says so in the
    /// hypothesis; returns whether clipping was on.
    fn note_clipping(&self, h: &mut CausalHypothesis, e: &Episode) -> bool {
        if !e.failure.is_gradient() {
            return false;
        }
        let last = e.onset + e.duration.saturating_sub(1);
        let Some(clip) = self.run.loop_track.clipping_during(e.onset, last) else {
            return false;
        };
        let ratio = clip.ratio_min;
        let _ = write!(
            h.description,
            " Gradient clipping was on: it scaled the update's gradients down by up to {}x, \
             which bounds the step but hides the explosion from the loss; the norms shown are \
             those the backward pass produced, before clipping.",
            text::num(1.0 / ratio.max(1e-30))
        );
        h.causal_chain.push(format!(
            "gradient clipping rescaled gradients on {} step(s) around the failure (first at step {})",
            clip.steps, clip.first
        ));
        true
    }

    /// The episode at the start of `k`'s consequence chain.
    /// " It appeared again later, part of the same failure: at step 61 in `6.0`, for 11 steps." for the later
    /// episodes of episode `k`'s failure that it explains (empty when there are none).
    fn recurrences(&self, k: usize) -> String {
        let failure = self.episodes[k].failure;
        let again: Vec<String> = self
            .episodes
            .iter()
            .filter(|o| o.explained_by == Some(k) && o.failure == failure)
            .map(|o| {
                let place = o
                    .root
                    .map(|m| format!(" in {}", text::show(&self.name(m))))
                    .unwrap_or_default();
                format!(
                    "at step {}{place}{}",
                    o.onset,
                    text::lasted(o, ", to the end")
                )
            })
            .collect();
        if again.is_empty() {
            return String::new();
        }
        format!(
            " It appeared again later, part of the same failure: {}.",
            again.join("; ")
        )
    }

    fn root_of(&self, mut k: usize) -> Option<usize> {
        let mut guard = 0;
        while let Some(j) = self.episodes[k].explained_by {
            k = j;
            guard += 1;
            if guard > self.episodes.len() {
                return None;
            }
        }
        Some(k)
    }

    fn evidence_of(&self, k: usize) -> Vec<SemanticEvent> {
        let e = &self.episodes[k];
        let mut idx: Vec<usize> = Vec::new();
        if let Some(r) = e.root_event {
            idx.push(r);
        }
        if let Some(j) = e.explained_by {
            idx.extend(self.episodes[j].root_event);
        }
        for &i in &e.events {
            if !idx.contains(&i) && idx.len() < 20 {
                idx.push(i);
            }
        }
        idx.into_iter().map(|i| self.events[i].clone()).collect()
    }

    fn chain_episodes(&self, k: usize) -> Vec<usize> {
        // Walk up to the root, then list the root's consequences in onset order.
        let root = self.root_of(k).unwrap_or(k);
        let mut chain = vec![root];
        let mut frontier = vec![root];
        while let Some(r) = frontier.pop() {
            let mut kids: Vec<usize> = (0..self.episodes.len())
                .filter(|&j| self.episodes[j].explained_by == Some(r) && !chain.contains(&j))
                .collect();
            kids.sort_by_key(|&j| self.episodes[j].onset);
            chain.extend(&kids);
            frontier.extend(kids);
        }
        chain
    }

    fn chain_lines(&self, k: usize) -> Vec<String> {
        let mut lines = Vec::new();
        for j in self.chain_episodes(k) {
            let e = &self.episodes[j];
            if let Some(told) = failures::rule(e.failure).chain(self.run, e) {
                lines.extend(told);
                continue;
            }
            if let Some(i) = e.root_event {
                lines.push(text::event_line(self.run, &self.events[i]));
            }
            if e.affected.len() > 1 {
                let names: Vec<String> = e
                    .affected
                    .iter()
                    .filter(|&&m| Some(m) != e.root)
                    .take(6)
                    .map(|&m| text::show(self.run.model.module_name(m)))
                    .collect();
                let more = e.affected.len() - 1 - names.len().min(e.affected.len() - 1);
                lines.push(format!(
                    "then {} in {}{}",
                    e.failure.phrase().to_lowercase(),
                    names.join(", "),
                    if more > 0 {
                        format!(" and {more} more")
                    } else {
                        String::new()
                    }
                ));
            }
        }
        lines
    }

    /// The root of every failure episode no other failure explains, in step order.
    pub fn root_causes(&self) -> Vec<RootCause> {
        let mut out: Vec<RootCause> = self
            .episodes
            .iter()
            .enumerate()
            .filter(|(_, e)| e.explained_by.is_none() && e.p_failure >= 0.3)
            .map(|(k, e)| RootCause {
                failure: e.failure,
                layer: e.root.map(|m| self.name(m)),
                step: e.onset,
                event: e.root_event.map(|i| self.events[i].clone()),
                affected: e.affected.iter().map(|&m| self.name(m)).collect(),
                consequences: self
                    .chain_episodes(k)
                    .into_iter()
                    .skip(1)
                    .map(|j| self.episodes[j].failure)
                    .collect(),
            })
            .collect();
        out.sort_by_key(|r| r.step);
        out
    }

    /// The events of the most significant episode of `failure`, from its root cause through
    /// its consequences.
    pub fn causal_chain(&self, failure: Failure) -> Vec<SemanticEvent> {
        let Some(k) = (0..self.episodes.len())
            .filter(|&k| self.episodes[k].failure == failure)
            .max_by(|&a, &b| {
                self.episodes[a]
                    .p_failure
                    .total_cmp(&self.episodes[b].p_failure)
            })
        else {
            return Vec::new();
        };
        let mut out: Vec<usize> = Vec::new();
        for j in self.chain_episodes(k) {
            let e = &self.episodes[j];
            if let Some(r) = e.root_event {
                if !out.contains(&r) {
                    out.push(r);
                }
            }
            let mut rest: Vec<usize> = e
                .events
                .iter()
                .copied()
                .filter(|i| !out.contains(i))
                .collect();
            rest.sort_by_key(|&i| self.events[i].step);
            out.extend(rest);
        }
        out.into_iter().map(|i| self.events[i].clone()).collect()
    }

    /// Pairs of failure events within `window` steps of each other; structural when they are in
    /// adjacent monitored modules (forward order), temporal otherwise.
    pub fn couplings(&self, window: u64) -> Vec<Coupling> {
        let model = &self.run.model;
        // Position of each monitored module (layer or activation) in forward order.
        let mut position = vec![None; model.spec.modules.len()];
        let mut next = 0usize;
        for (m, slot) in position.iter_mut().enumerate() {
            if model.module_layer[m].is_some() || model.module_activation[m].is_some() {
                *slot = Some(next);
                next += 1;
            }
        }
        let failing: Vec<&SemanticEvent> = self
            .events
            .iter()
            .filter(|e| episodes::failure_of(e).is_some_and(|f| f != Failure::SaturatedGradients))
            .collect();
        let mut out = Vec::new();
        for (a_i, a) in failing.iter().enumerate() {
            for b in &failing[a_i + 1..] {
                if b.step > a.step + window {
                    break;
                }
                if a.subject == b.subject {
                    continue;
                }
                let adjacent = match (a.subject, b.subject) {
                    (Subject::Module(x), Subject::Module(y)) => match (position[x], position[y]) {
                        (Some(px), Some(py)) => px.abs_diff(py) == 1,
                        _ => false,
                    },
                    _ => false,
                };
                out.push(Coupling {
                    kind: if adjacent {
                        CouplingKind::Structural
                    } else {
                        CouplingKind::Temporal
                    },
                    first: (*a).clone(),
                    second: (*b).clone(),
                    lag: b.step - a.step,
                });
                if out.len() >= MAX_COUPLINGS {
                    return out;
                }
            }
        }
        out
    }

    /// The causal graph as a Mermaid flowchart: root causes, the failures they lead to, and
    /// the layers involved.
    pub fn mermaid(&self) -> String {
        let hyps = self.hypotheses(None);
        let mut lines = vec!["graph TD".to_string()];
        let esc = |s: &str| s.replace('"', "'");
        let mut done = std::collections::HashSet::new();
        for h in hyps.iter().filter(|h| h.confidence >= 0.3) {
            if !done.insert(h.failure) {
                continue;
            }
            let cause_id = format!("cause_{}", h.cause.as_str());
            let fail_id = format!("fail_{}", h.failure.as_str());
            lines.push(format!(
                "    {cause_id}[\"cause: {}\"] -->|{:.2}| {fail_id}[\"{} at step {}{}\"]",
                esc(h.cause.as_str()),
                h.confidence,
                esc(h.failure.as_str()),
                h.step.map_or("-".into(), |s| s.to_string()),
                h.layer
                    .as_deref()
                    .map(|l| format!(" in {}", esc(crate::model::display_name(l))))
                    .unwrap_or_default()
            ));
        }
        for (k, e) in self.episodes.iter().enumerate() {
            if let Some(j) = e.explained_by {
                let (a, b) = (self.episodes[j].failure, self.episodes[k].failure);
                if a != b && done.contains(&a) && done.contains(&b) {
                    lines.push(format!("    fail_{} --> fail_{}", a.as_str(), b.as_str()));
                }
            }
        }
        if lines.len() == 1 {
            lines.push("    healthy[\"no failure detected\"]".into());
        }
        lines.join("\n")
    }
}

/// A hypothesis at or above this confidence is a failure: a healthy run has none (design.md).
/// Below it a hypothesis is a weaker signal, listed but not a verdict.
pub const FAILURE_CONFIDENCE: f64 = 0.5;

/// Ranked hypotheses of `engine` (none before a model is registered), optionally for one
/// failure: what `dbg.explain_failure()` and `neuraldbg explain` print.
pub fn explain(engine: &Engine, only: Option<Failure>) -> Vec<CausalHypothesis> {
    Analysis::new(engine).map_or_else(Vec::new, |a| a.hypotheses(only))
}

/// What the ranking of `engine`'s failures weighed (see [`Analysis::evidence_features`]); an
/// empty object before a model is registered.
pub fn evidence_features(engine: &Engine) -> serde_json::Value {
    Analysis::new(engine).map_or_else(|| serde_json::json!({}), |a| a.evidence_features())
}

/// The causal graph of `engine` as a Mermaid flowchart (a one-node graph before any model is
/// registered).
pub fn mermaid(engine: &Engine) -> String {
    Analysis::new(engine).map_or_else(
        || "graph TD\n    healthy[\"no steps observed\"]".to_string(),
        |a| a.mermaid(),
    )
}

/// Parses a failure name with a helpful error.
pub fn parse_failure(name: &str) -> Result<Failure, EngineError> {
    Failure::parse(name).ok_or_else(|| EngineError::Unknown {
        what: "failure",
        name: name.to_string(),
        expected: Failure::names(),
    })
}

/// Parses an event type name with a helpful error.
pub fn parse_event_type(name: &str) -> Result<EventType, EngineError> {
    EventType::parse(name).ok_or_else(|| EngineError::Unknown {
        what: "event type",
        name: name.to_string(),
        expected: EventType::names(),
    })
}
