//! `neuraldbg diff A.ndbg B.ndbg`: where two runs part.
//!
//! Health is compared through the events, the engine's confirmed state changes: the state of
//! each (kind, subject) at a step is the one its last event at or before that step entered, or
//! the state the first event of either run left (the two runs began alike). The first step
//! where some state differs is where the runs part.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt::Write as _;
use std::path::Path;

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

/// Prints where runs `a` and `b` part, as text or JSON; with `html`, also writes the
/// comparison as a self-contained page there.
pub(crate) fn print(
    a: &Replay,
    b: &Replay,
    as_json: bool,
    html: Option<&Path>,
    io: &mut Io<'_>,
) -> Result<(), Stop> {
    let (ca, cb) = (changes(a), changes(b));
    let part = parting(&ca, &cb);
    let (only_a, only_b) = (only(&ca, &cb), only(&cb, &ca));
    let (la, lb) = (loss(a), loss(b));
    let loss_part = loss_parting(&la, &lb);
    if let Some(path) = html {
        let page = page(&Compared {
            a,
            b,
            part: part.as_ref(),
            only_a: &only_a,
            only_b: &only_b,
            la: &la,
            lb: &lb,
            loss_part,
        });
        crate::write_file(path, page.as_bytes())?;
        io.note(&format!("neuraldbg: wrote {}", path.display()));
    }
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

// ------------------------------------------------------------------ the page (`--html`)

/// Events listed at most per run on the page.
const PAGE_EVENTS: usize = 300;
/// The loss chart's size and margin, in pixels.
const CHART_W: f64 = 860.0;
const CHART_H: f64 = 260.0;
const MARGIN: f64 = 48.0;
const COLOUR_A: &str = "#34495e";
const COLOUR_B: &str = "#e67e22";

/// What the page shows: the same comparison as the text.
struct Compared<'a> {
    a: &'a Replay,
    b: &'a Replay,
    part: Option<&'a Parting>,
    only_a: &'a [&'a Change],
    only_b: &'a [&'a Change],
    la: &'a BTreeMap<u64, f64>,
    lb: &'a BTreeMap<u64, f64>,
    loss_part: Option<u64>,
}

fn escape(text: &str) -> String {
    text.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
        .replace('"', "&quot;")
}

/// The comparison as one self-contained HTML page: no script, nothing loaded.
fn page(c: &Compared<'_>) -> String {
    let title = format!("NeuralDBG diff: {} vs {}", c.a.origin, c.b.origin);
    let mut s = String::new();
    let _ = write!(
        s,
        "<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\"><meta name=\"generator\" \
         content=\"NeuralDBG\"><title>{t}</title><style>\
         body{{font:14px/1.45 system-ui,sans-serif;color:#1d2330;background:#f4f5f7;margin:0}}\
         main{{max-width:960px;margin:0 auto;padding:16px}}section{{background:#fff;border:1px solid #dde1e8;\
         border-radius:8px;padding:12px 16px;margin-bottom:14px}}h1{{font-size:20px}}h2{{font-size:16px;margin:0 0 8px}}\
         .a{{color:{COLOUR_A}}}.b{{color:{COLOUR_B}}}table{{border-collapse:collapse;font-size:13px}}\
         td,th{{padding:2px 10px;text-align:left;border-bottom:1px solid #eceff3}}code{{background:#f0f2f5;padding:0 3px}}\
         .parting{{font-size:16px;font-weight:600}}.note{{color:#5b6375;font-size:12px}}</style></head>\
         <body><main><h1>{t}</h1>",
        t = escape(&title)
    );
    let _ = write!(
        s,
        "<section><p><b class=\"a\">A</b> {} ({} steps)<br><b class=\"b\">B</b> {} ({} steps)</p>",
        escape(&c.a.origin),
        c.a.steps,
        escape(&c.b.origin),
        c.b.steps
    );
    match c.part {
        Some(p) => {
            let _ = write!(
                s,
                "<p class=\"parting\">The runs part at step {}: {} {} is {} in A, {} in B.</p>",
                p.step,
                escape(&subject(&p.key.1)),
                escape(&p.key.0),
                escape(&p.a),
                escape(&p.b)
            );
        }
        None => s.push_str(
            "<p class=\"parting\">Health never differs: both runs have the same events.</p>",
        ),
    }
    let _ = write!(
        s,
        "<p>{}</p></section>",
        match c.loss_part {
            Some(step) => format!(
                "The loss curves part at step {step} (more than {:.0}% apart).",
                LOSS_TOLERANCE * 100.0
            ),
            None if c.la.is_empty() && c.lb.is_empty() => "Neither run recorded a loss.".into(),
            None => "The loss curves agree at every step both have.".into(),
        }
    );
    s.push_str("<section><h2>Loss</h2>");
    s.push_str(&chart(c));
    s.push_str(
        "<p class=\"note\">A mark at the top is a non-finite loss. Dashed: where the losses part; \
         dotted: where health parts.</p></section>",
    );
    for (name, class, list) in [("A", "a", c.only_a), ("B", "b", c.only_b)] {
        let _ = write!(
            s,
            "<section><h2>Events only in <span class=\"{class}\">{name}</span> ({})</h2>",
            list.len()
        );
        if list.is_empty() {
            s.push_str("<p>None.</p>");
        } else {
            s.push_str(
                "<table><tr><th>step</th><th>subject</th><th>event</th><th>transition</th></tr>",
            );
            for ch in list.iter().take(PAGE_EVENTS) {
                let _ = write!(
                    s,
                    "<tr><td>{}</td><td>{}</td><td>{}</td><td>{} &rarr; {}</td></tr>",
                    ch.step,
                    escape(&subject(&ch.key.1)),
                    escape(&ch.key.0),
                    escape(&ch.from),
                    escape(&ch.to)
                );
            }
            s.push_str("</table>");
            if list.len() > PAGE_EVENTS {
                let _ = write!(
                    s,
                    "<p class=\"note\">and {} more (neuraldbg diff --json lists them all)</p>",
                    list.len() - PAGE_EVENTS
                );
            }
        }
        s.push_str("</section>");
    }
    s.push_str("<p class=\"note\">Generated by NeuralDBG (neuraldbg diff --html). Self-contained: it loads nothing.</p></main></body></html>\n");
    s
}

/// Both loss curves on one SVG chart (log scale when every loss is positive and they span
/// more than 100x).
fn chart(c: &Compared<'_>) -> String {
    let finite: Vec<f64> =
        c.la.values()
            .chain(c.lb.values())
            .copied()
            .filter(|v| v.is_finite())
            .collect();
    let steps: Vec<u64> = c.la.keys().chain(c.lb.keys()).copied().collect();
    let (Some(&s0), Some(&s1)) = (steps.iter().min(), steps.iter().max()) else {
        return "<p>No loss was recorded.</p>".into();
    };
    let lo = finite.iter().copied().fold(f64::INFINITY, f64::min);
    let hi = finite.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    let log = !finite.is_empty() && lo > 0.0 && hi / lo > 100.0;
    let scale = |v: f64| if log { v.log10() } else { v };
    let (mut y0, mut y1) = if finite.is_empty() {
        (0.0, 1.0)
    } else {
        (scale(lo), scale(hi))
    };
    if y1 <= y0 {
        y0 -= 0.5;
        y1 += 0.5;
    }
    let x_of = |step: u64| {
        MARGIN + (step - s0) as f64 / ((s1 - s0).max(1) as f64) * (CHART_W - 2.0 * MARGIN)
    };
    let y_of =
        |v: f64| CHART_H - MARGIN + (scale(v) - y0) / (y1 - y0) * (2.0 * MARGIN - CHART_H + 12.0);
    let mut s = format!(
        "<svg width=\"{CHART_W}\" height=\"{CHART_H}\" viewBox=\"0 0 {CHART_W} {CHART_H}\" role=\"img\" \
         aria-label=\"loss of both runs\"><rect x=\"{MARGIN}\" y=\"12\" width=\"{}\" height=\"{}\" fill=\"none\" \
         stroke=\"#c3c8d2\"/>",
        CHART_W - 2.0 * MARGIN,
        CHART_H - MARGIN - 12.0
    );
    let label = |v: f64| {
        let shown = if log { 10f64.powf(v) } else { v };
        number(Some(&shown))
    };
    for (v, anchor) in [(y0, CHART_H - MARGIN), (y1, 16.0)] {
        let _ = write!(
            s,
            "<text x=\"{}\" y=\"{anchor}\" font-size=\"11\" text-anchor=\"end\">{}</text>",
            MARGIN - 4.0,
            label(v)
        );
    }
    for (step, anchor) in [(s0, "start"), (s1, "end")] {
        let _ = write!(
            s,
            "<text x=\"{}\" y=\"{}\" font-size=\"11\" text-anchor=\"{anchor}\">step {step}</text>",
            x_of(step),
            CHART_H - MARGIN + 16.0
        );
    }
    let marks = [(c.loss_part, "6 4"), (c.part.map(|p| p.step), "2 3")];
    for (step, dash) in marks {
        if let Some(step) = step.filter(|st| (s0..=s1).contains(st)) {
            let _ = write!(
                s,
                "<line x1=\"{0:.1}\" x2=\"{0:.1}\" y1=\"12\" y2=\"{1}\" stroke=\"#111\" stroke-dasharray=\"{dash}\"/>",
                x_of(step),
                CHART_H - MARGIN
            );
        }
    }
    for (curve, colour) in [(c.la, COLOUR_A), (c.lb, COLOUR_B)] {
        let mut path = String::new();
        let mut pen = false;
        for (&step, &v) in curve {
            if v.is_finite() {
                let _ = write!(
                    path,
                    "{}{:.1},{:.1}",
                    if pen { "L" } else { "M" },
                    x_of(step),
                    y_of(v)
                );
                pen = true;
            } else {
                pen = false;
                let _ = write!(
                    s,
                    "<path d=\"M{0:.1},13L{1:.1},13L{2:.1},20Z\" fill=\"{colour}\"/>",
                    x_of(step) - 3.0,
                    x_of(step) + 3.0,
                    x_of(step)
                );
            }
        }
        let _ = write!(
            s,
            "<path d=\"{path}\" fill=\"none\" stroke=\"{colour}\" stroke-width=\"1.6\"/>"
        );
    }
    s.push_str("</svg>");
    s
}
