//! `neuraldbg diff A.ndbg B.ndbg`: where two runs part.
//!
//! Health is compared through the events, the engine's confirmed state changes: the state of
//! each (kind, subject) at a step is the one its last event at or before that step entered, or
//! the state the first event of either run left (the two runs began alike). The first step
//! where some state differs is where the runs part.

use std::collections::{BTreeMap, BTreeSet};

use neuraldbg_core::trace::Replay;
use neuraldbg_core::{Reduce, display_name};
use serde_json::{Value, json};

use crate::{Io, Stop, to_json};

/// Two losses closer than this fraction of the larger are the same.
const LOSS_TOLERANCE: f64 = 0.01;
/// Rows of the loss table.
const LOSS_ROWS: usize = 12;

/// What an event is about: its kind and subject.
type Key = (String, String);

/// One event, as the comparison sees it.
struct Change {
    step: u64,
    key: Key,
    from: String,
    to: String,
}

/// Where the runs' health first differs.
struct Parting {
    step: u64,
    key: Key,
    a: String,
    b: String,
}

fn changes(replay: &Replay) -> Vec<Change> {
    let engine = &replay.engine;
    engine
        .events()
        .into_iter()
        .map(|e| Change {
            step: e.step,
            key: (
                e.event_type.as_str().to_string(),
                engine.subject_name(e.subject),
            ),
            from: e.from_state.to_string(),
            to: e.to_state.to_string(),
        })
        .collect()
}

fn state<'a>(run: &'a [Change], other: &'a [Change], key: &Key, step: u64) -> &'a str {
    if let Some(c) = run.iter().rev().find(|c| &c.key == key && c.step <= step) {
        return &c.to;
    }
    run.iter()
        .chain(other)
        .filter(|c| &c.key == key)
        .min_by_key(|c| c.step)
        .map_or("", |c| c.from.as_str())
}

fn parting(a: &[Change], b: &[Change]) -> Option<Parting> {
    let steps: BTreeSet<u64> = a.iter().chain(b).map(|c| c.step).collect();
    let keys: BTreeSet<&Key> = a.iter().chain(b).map(|c| &c.key).collect();
    for step in steps {
        for key in &keys {
            let (x, y) = (state(a, b, key, step), state(b, a, key, step));
            if x != y {
                return Some(Parting {
                    step,
                    key: (*key).clone(),
                    a: x.to_string(),
                    b: y.to_string(),
                });
            }
        }
    }
    None
}

/// The events of `run` that `other` does not have (same kind, subject and states; any step).
fn only<'a>(run: &'a [Change], other: &[Change]) -> Vec<&'a Change> {
    let mut left: BTreeMap<(&Key, &str, &str), usize> = BTreeMap::new();
    for c in other {
        *left
            .entry((&c.key, c.from.as_str(), c.to.as_str()))
            .or_default() += 1;
    }
    run.iter()
        .filter(
            |c| match left.get_mut(&(&c.key, c.from.as_str(), c.to.as_str())) {
                Some(n) if *n > 0 => {
                    *n -= 1;
                    false
                }
                _ => true,
            },
        )
        .collect()
}

fn loss(replay: &Replay) -> BTreeMap<u64, f64> {
    replay
        .engine
        .history(None, "loss", Reduce::Last)
        .map(|(steps, values)| steps.into_iter().zip(values).collect())
        .unwrap_or_default()
}

fn same(x: f64, y: f64) -> bool {
    if !x.is_finite() || !y.is_finite() {
        // Both NaN, or the same infinity.
        return x.is_nan() && y.is_nan() || x.is_infinite() && x.to_bits() == y.to_bits();
    }
    (x - y).abs() <= LOSS_TOLERANCE * x.abs().max(y.abs())
}

/// The first step both runs have a loss for where the two differ by more than the tolerance.
fn loss_parting(a: &BTreeMap<u64, f64>, b: &BTreeMap<u64, f64>) -> Option<u64> {
    a.iter()
        .find(|(s, x)| b.get(s).is_some_and(|y| !same(**x, *y)))
        .map(|(s, _)| *s)
}

fn number(v: Option<&f64>) -> String {
    match v {
        None => "-".to_string(),
        Some(v) if v.is_finite() && (v.abs() >= 1e5 || (v.abs() < 1e-3 && *v != 0.0)) => {
            format!("{v:.4e}")
        }
        Some(v) => format!("{v:.5}"),
    }
}

fn subject(name: &str) -> String {
    if name.starts_with('(') {
        name.to_string()
    } else {
        format!("`{}`", display_name(name))
    }
}

fn change_text(c: &Change) -> String {
    format!(
        "step {:>6}  {} {}: {} -> {}",
        c.step,
        subject(&c.key.1),
        c.key.0,
        c.from,
        c.to
    )
}

fn change_json(c: &Change) -> Value {
    json!({"step": c.step, "kind": c.key.0, "layer": c.key.1, "from_state": c.from, "to_state": c.to})
}

/// Prints where runs `a` and `b` part, as text or JSON.
pub(crate) fn print(a: &Replay, b: &Replay, as_json: bool, io: &mut Io<'_>) -> Result<(), Stop> {
    let (ca, cb) = (changes(a), changes(b));
    let part = parting(&ca, &cb);
    let (only_a, only_b) = (only(&ca, &cb), only(&cb, &ca));
    let (la, lb) = (loss(a), loss(b));
    let loss_part = loss_parting(&la, &lb);
    if as_json {
        let curve = |l: &BTreeMap<u64, f64>| json!({"steps": l.keys().collect::<Vec<_>>(), "values": l.values().collect::<Vec<_>>()});
        let value = json!({
            "a": {"trace": a.origin, "steps": a.steps},
            "b": {"trace": b.origin, "steps": b.steps},
            "parting": part.as_ref().map(|p| json!({
                "step": p.step, "kind": p.key.0, "layer": p.key.1, "a": p.a, "b": p.b,
            })),
            "only_a": only_a.iter().map(|c| change_json(c)).collect::<Vec<_>>(),
            "only_b": only_b.iter().map(|c| change_json(c)).collect::<Vec<_>>(),
            "loss_parting_step": loss_part,
            "loss": {"a": curve(&la), "b": curve(&lb)},
        });
        return io.print(&to_json(&value));
    }
    io.print(&format!("A: {} ({} steps)", a.origin, a.steps))?;
    io.print(&format!("B: {} ({} steps)", b.origin, b.steps))?;
    match &part {
        Some(p) => io.print(&format!(
            "The runs part at step {}: {} {} is {} in A, {} in B",
            p.step,
            subject(&p.key.1),
            p.key.0,
            p.a,
            p.b
        ))?,
        None => io.print("Health never differs: both runs have the same events")?,
    }
    for (name, list) in [("A", &only_a), ("B", &only_b)] {
        if !list.is_empty() {
            io.print(&format!("Events only in {name}:"))?;
            for c in list {
                io.print(&format!("  {}", change_text(c)))?;
            }
        }
    }
    match loss_part {
        Some(s) => io.print(&format!(
            "Loss: the curves part at step {s} (more than {:.0}% apart)",
            LOSS_TOLERANCE * 100.0
        ))?,
        None if la.is_empty() && lb.is_empty() => io.print("Loss: neither run recorded one")?,
        None => io.print("Loss: the curves agree at every step both have")?,
    }
    let steps: Vec<u64> = la
        .keys()
        .chain(lb.keys())
        .copied()
        .collect::<BTreeSet<_>>()
        .into_iter()
        .collect();
    if !steps.is_empty() {
        io.print(&format!(
            "  {:>8}  {:>12}  {:>12}",
            "step", "loss A", "loss B"
        ))?;
        let stride = steps.len().div_ceil(LOSS_ROWS).max(1);
        let mut rows: Vec<u64> = steps.iter().step_by(stride).copied().collect();
        for s in [loss_part, steps.last().copied()].into_iter().flatten() {
            if !rows.contains(&s) {
                rows.push(s);
            }
        }
        rows.sort_unstable();
        for s in rows {
            io.print(&format!(
                "  {s:>8}  {:>12}  {:>12}",
                number(la.get(&s)),
                number(lb.get(&s))
            ))?;
        }
    }
    Ok(())
}
