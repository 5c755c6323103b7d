//! A self-contained HTML report of a run, for the researcher who opens it after a failed run:
//! the verdict first (the ranked hypotheses as sentences, with remedies), then a layers x steps
//! heatmap of gradient norms, the gradient-norm curves of the implicated layers, the event
//! timeline and the causal graph.
//!
//! The page needs no network: the data is embedded as JSON and drawn by a small hand-written
//! script (canvas and SVG, no library). Its size is bounded however long or wide the run was:
//! at most [`MAX_COLUMNS`] step columns and [`MAX_ROWS`] layer rows, neighbours merged by
//! their minimum and maximum so that a NaN or a spike is never averaged away, one byte per
//! extreme in the heatmap, and at most [`MAX_EVENTS`] events.
//!
//! ```
//! use neuraldbg_core::{Config, Engine, ModelSpec, Observation};
//!
//! let mut engine = Engine::new(Config::default()).unwrap();
//! let mut spec = ModelSpec::default();
//! let fc = spec.module("fc", "Linear");
//! spec.param(fc, "fc.weight", &[8, 8]);
//! spec.module("", "Net");
//! engine.register_model(spec).unwrap();
//! for step in 0..20 {
//!     let norm = if step < 10 { 0.1 } else { f32::NAN };
//!     engine.observe(&Observation { step, grad_norms: vec![norm], ..Default::default() }.view()).unwrap();
//! }
//! let html = neuraldbg_core::report::render_html(&engine, "my run");
//! assert!(html.starts_with("<!DOCTYPE html>") && html.contains("non-finite"));
//! ```

use std::collections::HashSet;
use std::fmt::Write as _;

use serde::{Serialize, Serializer};

use crate::analysis::{Analysis, CausalHypothesis, FAILURE_CONFIDENCE, Failure};
use crate::config::Config;
use crate::engine::{Engine, Global, Run};
use crate::event::{EventType, SemanticEvent, Subject};
use crate::history::Bucket;
use crate::model::{Model, display_name};

mod confirmation;
mod strip;
pub use confirmation::{ConfirmRun, Confirmation, Evidence, HealthParting, Parted, Verdict};
pub use strip::{HealthStrip, StripRow, health_strip};

/// Step columns at most (history buckets beyond are merged in groups).
pub const MAX_COLUMNS: usize = 512;
/// Layer rows at most in the heatmap (adjacent layers beyond are merged in groups).
pub const MAX_ROWS: usize = 1024;
/// Events embedded at most (the hypotheses' evidence and non-finite transitions first).
pub const MAX_EVENTS: usize = 1500;
/// Curves drawn: the root-cause layer, affected layers, one healthy reference.
const MAX_CURVES: usize = 6;
/// Hypotheses shown as the verdict; the rest are folded away.
const VERDICT_HYPOTHESES: usize = 3;

/// Heatmap byte codes: 0 no value, 1 zero, `2..=253` log scale, 255 NaN/Inf.
const CODE_EMPTY: u8 = 0;
const CODE_ZERO: u8 = 1;
const CODE_FIRST: u8 = 2;
const CODE_LEVELS: f64 = 251.0;
const CODE_NON_FINITE: u8 = 255;

const TEMPLATE: &str = include_str!("report.html");
const STYLE: &str = include_str!("report.css");
const SCRIPT: &str = include_str!("report.js");

/// Which parts of the report a page shows.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Sections {
    /// The whole report: verdict, heatmap, curves, event timeline, causal graph.
    #[default]
    All,
    /// The verdict and the heatmap, in a compact page meant to sit inside another one (a
    /// notebook cell's output).
    VerdictAndHeatmap,
    /// The verdict only (a list of hypotheses shown in a notebook).
    Verdict,
}

/// How [`render_html_with`] renders.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Options {
    pub sections: Sections,
    /// Only hypotheses about this failure in the verdict (as `explain_failure(failure)`).
    pub only: Option<Failure>,
}

/// Renders the report of everything `engine` has observed as one self-contained HTML page.
///
/// `title` heads the page (HTML-escaped). Works on any engine: one replayed from a trace, one
/// fed live, or one with no model registered (the page then says nothing was observed). The
/// output is deterministic for a given engine state (no timestamps), and its size is bounded
/// (see the module documentation): a few MB at most for 1,000 layers.
pub fn render_html(engine: &Engine, title: &str) -> String {
    render_html_with(engine, title, &Options::default())
}

/// [`render_html`] showing only some sections (same page, same data, same script: the others
/// are hidden), for notebooks.
pub fn render_html_with(engine: &Engine, title: &str, options: &Options) -> String {
    render(engine, title, *options, None)
}

/// [`render_html`] with what `neuraldbg run --confirm` found: each hypothesis's verdict and
/// the numbers behind it in the verdict (the confirmed first), and the loss curves of the
/// re-runs side by side.
pub fn render_html_confirmed(engine: &Engine, title: &str, confirmation: &Confirmation) -> String {
    render(engine, title, Options::default(), Some(confirmation))
}

fn render(
    engine: &Engine,
    title: &str,
    options: Options,
    confirmation: Option<&Confirmation>,
) -> String {
    let analysis = Analysis::new(engine);
    let mut hypotheses = analysis
        .as_ref()
        .map(|a| a.hypotheses(options.only))
        .unwrap_or_default();
    if let Some(c) = confirmation {
        hypotheses = c.rank(&hypotheses).into_iter().cloned().collect();
    }
    let data = engine.run().map(|run| {
        let mut d = collect(engine, run, analysis.as_ref(), &hypotheses, title);
        d.confirm = confirmation.map(|c| confirm_chart(c, &d.columns));
        if options.sections != Sections::All {
            // Hidden sections need no data: a notebook's copy stays smaller than the report.
            d.curves.clear();
            d.loss = None;
            d.confirm = None;
            d.events.clear();
            d.graph.clear();
        }
        d
    });
    let json = data.map_or_else(
        || "null".to_string(),
        |d| serde_json::to_string(&d).unwrap_or_else(|_| "null".to_string()),
    );
    let view = match options.sections {
        Sections::All => "full",
        Sections::VerdictAndHeatmap => "inline",
        Sections::Verdict => "inline verdict-only",
    };
    fill(
        TEMPLATE,
        &[
            ("TITLE", &escape(title)),
            ("VIEW", view),
            ("SUMMARY", &summary(engine)),
            ("VERDICT", &verdict(engine, &hypotheses, confirmation)),
            ("STYLE", STYLE),
            ("SCRIPT", &script_safe(SCRIPT)),
            // `<` only occurs inside JSON strings, where \u003c means the same: the data can
            // then never close its script element or open a comment.
            ("DATA", &json.replace('<', "\\u003c")),
        ],
    )
}

/// Replaces each `{{KEY}}` of the template in one pass, so inserted text (a title, a layer
/// name) is never scanned for placeholders itself.
fn fill(template: &str, values: &[(&str, &str)]) -> String {
    let mut out =
        String::with_capacity(template.len() + values.iter().map(|(_, v)| v.len()).sum::<usize>());
    let mut rest = template;
    while let Some(open) = rest.find("{{") {
        out.push_str(&rest[..open]);
        let after = &rest[open + 2..];
        let found = after.find("}}").and_then(|close| {
            values
                .iter()
                .find(|(k, _)| *k == &after[..close])
                .map(|(_, v)| (close, v))
        });
        if let Some((close, v)) = found {
            out.push_str(v);
            rest = &after[close + 2..];
        } else {
            out.push_str("{{");
            rest = after;
        }
    }
    out.push_str(rest);
    out
}

// ------------------------------------------------------------------ embedded data

#[derive(Serialize)]
struct Data<'a> {
    title: &'a str,
    version: &'static str,
    thresholds: Thresholds,
    steps_observed: u64,
    /// `[first, last]` step of each column.
    columns: Vec<(u64, u64)>,
    /// History buckets merged into one column.
    buckets_per_column: usize,
    heatmap: Heatmap,
    curves: Vec<Curve>,
    loss: Option<Curve>,
    focus: Option<Focus>,
    events: Vec<Ev>,
    events_total: usize,
    events_suppressed: u64,
    graph: Vec<GraphRoot>,
    mermaid: String,
    /// The loss curves of `neuraldbg run --confirm`'s runs, in the report's columns.
    confirm: Option<ConfirmChart>,
}

#[derive(Serialize)]
struct ConfirmChart {
    /// Steps of each re-run.
    steps: u64,
    curves: Vec<Curve>,
}

#[derive(Serialize)]
struct Thresholds {
    vanishing: f64,
    saturated: f64,
    exploding: f64,
}

#[derive(Serialize)]
struct Heatmap {
    /// Rows in forward order.
    rows: Vec<Row>,
    /// Layers merged into one row.
    layers_per_row: usize,
    /// `log10` of the norm at code 2 and at code 253.
    log_lo: f64,
    log_hi: f64,
    /// Base64 of `rows x columns x [min code, max code]`, row-major.
    codes: String,
}

#[derive(Serialize)]
struct Row {
    name: String,
    kind: String,
    layers: usize,
}

/// One series per column: `min`, `max` (NaN when the column held a NaN/Inf) and `last`.
#[derive(Serialize)]
struct Curve {
    name: String,
    role: &'static str,
    min: Vec<Num>,
    max: Vec<Num>,
    last: Vec<Num>,
}

/// What the page highlights: the top hypothesis.
#[derive(Serialize)]
struct Focus {
    failure: &'static str,
    cause: &'static str,
    layer: Option<String>,
    kind: Option<String>,
    step: Option<u64>,
    /// `[from, to)` in heatmap rows; `from == to` marks the boundary between two rows (a module
    /// without parameters, such as an activation, sits between layers).
    rows: Option<(f64, f64)>,
}

#[derive(Serialize)]
struct Ev {
    step: u64,
    kind: &'static str,
    who: String,
    from: &'static str,
    to: &'static str,
    confidence: Num,
    value: Num,
}

#[derive(Serialize)]
struct GraphRoot {
    cause: &'static str,
    confidence: f64,
    failure: &'static str,
    layer: Option<String>,
    step: u64,
    affected: usize,
    consequences: Vec<&'static str>,
    chain: Vec<String>,
}

/// A number for the page: `null` for no value, strings for non-finite values (JSON has none),
/// shortest round-trip text otherwise (f32 history values print as f32: shorter JSON).
#[derive(Clone, Copy)]
enum Num {
    None,
    F32(f32),
    F64(f64),
}

impl Serialize for Num {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let v = match *self {
            Num::None => return s.serialize_none(),
            Num::F32(v) if v.is_finite() => return s.serialize_f32(v),
            Num::F64(v) if v.is_finite() => return s.serialize_f64(v),
            Num::F32(v) => f64::from(v),
            Num::F64(v) => v,
        };
        s.serialize_str(crate::output::non_finite_name(v))
    }
}

fn collect<'a>(
    engine: &Engine,
    run: &Run,
    analysis: Option<&Analysis<'_>>,
    hypotheses: &[CausalHypothesis],
    title: &'a str,
) -> Data<'a> {
    let config = engine.config();
    let model = &run.model;
    let n_layers = model.layers.len();
    let first = run.first_step.unwrap_or(0);
    let (columns, groups) = columns(run.grads.steps(), first);
    let per_column = groups.first().map_or(1, std::ops::Range::len);

    // Per layer, per column: the merged bucket.
    let grid: Vec<Vec<Option<Bucket>>> = (0..n_layers)
        .map(|l| merge_columns(&run.grads.buckets(l), &groups))
        .collect();
    let per_row = n_layers.div_ceil(MAX_ROWS).max(1);
    let heatmap = heatmap(model, &grid, per_row, columns.len());

    let top = hypotheses
        .first()
        .filter(|h| h.confidence >= FAILURE_CONFIDENCE);
    let focus = top.map(|h| {
        let module = h.layer.as_deref().and_then(|n| model.module_index(n));
        Focus {
            failure: h.failure.as_str(),
            cause: h.cause.as_str(),
            layer: h.layer.clone(),
            kind: module.map(|m| model.spec.modules[m].kind.clone()),
            step: h.step,
            rows: module.map(|m| {
                let (a, b) = layer_span(model, m);
                (a as f64 / per_row as f64, b as f64 / per_row as f64)
            }),
        }
    });
    let curves = curves(model, analysis, top, &grid, config);
    let loss = {
        let b = merge_columns(&run.grads.buckets(run.global_series(Global::Loss)), &groups);
        b.iter()
            .any(Option::is_some)
            .then(|| curve("loss", "loss", &b))
    };
    let all_events = engine.events();
    let events = pick_events(engine, &all_events, hypotheses);
    Data {
        title,
        version: env!("CARGO_PKG_VERSION"),
        thresholds: Thresholds {
            vanishing: config.threshold_vanishing,
            saturated: config.threshold_saturated,
            exploding: config.threshold_exploding,
        },
        steps_observed: run.steps_observed,
        columns,
        buckets_per_column: per_column,
        heatmap,
        curves,
        loss,
        focus,
        events,
        events_total: all_events.len(),
        events_suppressed: run.suppressed_events,
        graph: analysis.map(|a| graph(a, hypotheses)).unwrap_or_default(),
        mermaid: analysis.map(Analysis::mermaid).unwrap_or_default(),
        confirm: None,
    }
}

/// Each `--confirm` run's loss in the report's step columns: per column the smallest and
/// largest value and the last (NaN when the loss was non-finite there), like the run's loss.
fn confirm_chart(c: &Confirmation, columns: &[(u64, u64)]) -> ConfirmChart {
    let curves = c
        .runs
        .iter()
        .map(|r| {
            let (mut min, mut max, mut last) = (Vec::new(), Vec::new(), Vec::new());
            for &(a, b) in columns {
                let cell: Vec<f64> = r
                    .steps
                    .iter()
                    .zip(&r.loss)
                    .filter(|(s, _)| (a..=b).contains(*s))
                    .map(|(_, v)| v.unwrap_or(f64::NAN))
                    .collect();
                let finite = cell.iter().copied().filter(|v| v.is_finite());
                let pick = |v: Option<f64>| v.map_or(Num::None, Num::F64);
                min.push(pick(finite.clone().reduce(f64::min)));
                max.push(if cell.iter().any(|v| v.is_nan()) {
                    Num::F64(f64::NAN)
                } else {
                    pick(finite.reduce(f64::max))
                });
                last.push(pick(cell.last().copied()));
            }
            Curve {
                name: r.name.clone(),
                role: run_role(c, r),
                min,
                max,
                last,
            }
        })
        .collect();
    ConfirmChart {
        steps: c.steps,
        curves,
    }
}

/// A run's role in the chart: the verdict its remedy earned, or what it compares against.
fn run_role(c: &Confirmation, r: &ConfirmRun) -> &'static str {
    let Some(i) = &r.intervention else {
        return "";
    };
    let verdicts = c
        .verdicts
        .iter()
        .filter(|v| v.intervention.as_ref() == Some(i));
    let mut role = "";
    for v in verdicts {
        role = match (role, v.verdict.as_str()) {
            (_, "confirmed") | ("confirmed", _) => "confirmed",
            (_, "inconclusive") | ("inconclusive", _) => "inconclusive",
            (_, "refuted") | ("refuted", _) => "refuted",
            _ => "untested",
        };
    }
    role
}

/// Groups history buckets into at most [`MAX_COLUMNS`] columns; returns each column's step
/// range and bucket range.
fn columns(steps: &[u64], first: u64) -> (Vec<(u64, u64)>, Vec<std::ops::Range<usize>>) {
    let per = steps.len().div_ceil(MAX_COLUMNS).max(1);
    let mut ranges = Vec::new();
    let mut groups = Vec::new();
    let mut start = first;
    for g in (0..steps.len()).step_by(per) {
        let end_bucket = (g + per).min(steps.len());
        let end = steps[end_bucket - 1];
        ranges.push((start.min(end), end));
        groups.push(g..end_bucket);
        start = end + 1;
    }
    (ranges, groups)
}

fn merge_all(cells: impl Iterator<Item = Option<Bucket>>) -> Option<Bucket> {
    cells.fold(None, |acc, b| match (acc, b) {
        (Some(a), Some(b)) => Some(a.merge(b)),
        (a, b) => a.or(b),
    })
}

fn merge_columns(
    buckets: &[Option<Bucket>],
    groups: &[std::ops::Range<usize>],
) -> Vec<Option<Bucket>> {
    groups
        .iter()
        .map(|g| merge_all(buckets[g.clone()].iter().copied()))
        .collect()
}

fn heatmap(model: &Model, grid: &[Vec<Option<Bucket>>], per_row: usize, cols: usize) -> Heatmap {
    let n_layers = grid.len();
    let rows: Vec<Vec<Option<Bucket>>> = (0..n_layers)
        .step_by(per_row)
        .map(|l0| {
            let l1 = (l0 + per_row).min(n_layers);
            (0..cols)
                .map(|c| merge_all(grid[l0..l1].iter().map(|r| r[c])))
                .collect()
        })
        .collect();
    // The colour range spans the data and, with margin, the thresholds it is judged against.
    let (mut lo, mut hi) = (f64::INFINITY, f64::NEG_INFINITY);
    for b in rows.iter().flatten().flatten() {
        for v in [b.min, b.max] {
            if v.is_finite() && v > 0.0 {
                lo = lo.min(f64::from(v).log10());
                hi = hi.max(f64::from(v).log10());
            }
        }
    }
    let log_lo = lo.min(-8.0).floor().max(-45.0);
    let log_hi = hi.max(4.0).ceil().min(39.0);
    let code = |v: f32| -> u8 {
        if v.is_nan() || v == f32::INFINITY {
            CODE_NON_FINITE
        } else if v <= 0.0 {
            CODE_ZERO
        } else {
            let x = (f64::from(v).log10() - log_lo) / (log_hi - log_lo);
            CODE_FIRST + (x * CODE_LEVELS).round().clamp(0.0, CODE_LEVELS) as u8
        }
    };
    let mut bytes = Vec::with_capacity(rows.len() * cols * 2);
    for row in &rows {
        for cell in row {
            match cell {
                None => bytes.extend([CODE_EMPTY, CODE_EMPTY]),
                Some(b) => bytes.extend([code(b.min), code(b.max)]),
            }
        }
    }
    let row_info = (0..n_layers)
        .step_by(per_row)
        .map(|l0| {
            let l1 = (l0 + per_row).min(n_layers);
            let (a, b) = (&model.layers[l0], &model.layers[l1 - 1]);
            Row {
                name: if l1 - l0 == 1 {
                    display_name(&a.name).to_string()
                } else {
                    format!("{} … {}", display_name(&a.name), display_name(&b.name))
                },
                kind: a.kind.clone(),
                layers: l1 - l0,
            }
        })
        .collect();
    Heatmap {
        rows: row_info,
        layers_per_row: per_row,
        log_lo,
        log_hi,
        codes: base64(&bytes),
    }
}

/// Where module `m` sits among the layers, as `[from, to)` in layer rows: the layer itself, the
/// layers inside it (a block), or, for a module without parameters (an activation), the
/// boundary after the last layer that ran before it.
fn layer_span(model: &Model, m: usize) -> (usize, usize) {
    if let Some(l) = model.module_layer[m] {
        return (l, l + 1);
    }
    let name = &model.spec.modules[m].name;
    let inside: Vec<usize> = model
        .layers
        .iter()
        .enumerate()
        .filter(|(_, l)| name.is_empty() || l.name.starts_with(&format!("{name}.")))
        .map(|(i, _)| i)
        .collect();
    if let (Some(&a), Some(&b)) = (inside.first(), inside.last()) {
        return (a, b + 1);
    }
    let before = model.layers.iter().filter(|l| l.module < m).count();
    (before, before)
}

/// The layer whose gradient shows module `m`'s health best: itself, its first layer, or the
/// layer that feeds it.
fn layer_of(model: &Model, m: usize) -> Option<usize> {
    let (a, b) = layer_span(model, m);
    if b > a { Some(a) } else { a.checked_sub(1) }
}

fn curve(name: &str, role: &'static str, cells: &[Option<Bucket>]) -> Curve {
    let pick = |f: fn(&Bucket) -> Num| {
        cells
            .iter()
            .map(|c| c.as_ref().map_or(Num::None, f))
            .collect()
    };
    Curve {
        name: name.to_string(),
        role,
        min: pick(|b| {
            if b.min.is_finite() {
                Num::F32(b.min)
            } else {
                Num::None
            }
        }),
        max: pick(|b| Num::F32(b.max)),
        last: pick(|b| Num::F32(b.last)),
    }
}

/// How far a column sits outside the healthy band, for ranking layers.
fn anomaly(b: &Bucket, vanishing: f32, exploding: f32) -> u32 {
    u32::from(b.non_finite()) * 4 + u32::from(b.max > exploding) * 2 + u32::from(b.min < vanishing)
}

fn curves(
    model: &Model,
    analysis: Option<&Analysis<'_>>,
    top: Option<&CausalHypothesis>,
    grid: &[Vec<Option<Bucket>>],
    config: &Config,
) -> Vec<Curve> {
    let mut chosen: Vec<(usize, &'static str)> = Vec::new();
    let push = |l: usize, role: &'static str, chosen: &mut Vec<(usize, &'static str)>| {
        if chosen.len() < MAX_CURVES && !chosen.iter().any(|(c, _)| *c == l) {
            chosen.push((l, role));
        }
    };
    if let Some(h) = top {
        let root = h.layer.as_deref().and_then(|n| model.module_index(n));
        if let Some(l) = root.and_then(|m| layer_of(model, m)) {
            let role = if root.and_then(|m| model.module_layer[m]).is_some() {
                "root"
            } else {
                "feeds root"
            };
            push(l, role, &mut chosen);
        }
        // Affected layers of the top hypothesis' episode, spread along the depth.
        let affected: Vec<usize> = analysis
            .map(Analysis::root_causes)
            .unwrap_or_default()
            .into_iter()
            .find(|r| r.failure == h.failure && r.layer == h.layer)
            .map(|r| {
                let mut ls: Vec<usize> = r
                    .affected
                    .iter()
                    .filter_map(|n| model.module_index(n))
                    .filter_map(|m| layer_of(model, m))
                    .collect();
                ls.dedup();
                ls
            })
            .unwrap_or_default();
        let affected: Vec<usize> = affected
            .into_iter()
            .filter(|l| !chosen.iter().any(|(c, _)| c == l))
            .collect();
        let want = 3.min(affected.len());
        for i in 0..want {
            let idx = if want == 1 {
                0
            } else {
                i * (affected.len() - 1) / (want - 1)
            };
            push(affected[idx], "affected", &mut chosen);
        }
    }
    // Then the most anomalous layers, and one healthy layer to compare against.
    let (v, e) = (
        config.threshold_vanishing as f32,
        config.threshold_exploding as f32,
    );
    // A layer that ever went NaN/Inf ranks first, then one that exploded, then by how long it
    // was out of the healthy band.
    let score = |l: usize| -> (bool, bool, u32) {
        let cells = grid[l].iter().flatten();
        (
            cells.clone().any(Bucket::non_finite),
            cells.clone().any(|b| b.max > e),
            cells.map(|b| anomaly(b, v, e)).sum::<u32>(),
        )
    };
    let mut ranked: Vec<((bool, bool, u32), usize)> =
        (0..grid.len()).map(|l| (score(l), l)).collect();
    ranked.sort_by(|a, b| b.0.cmp(&a.0).then(a.1.cmp(&b.1)));
    // Only while the hypothesis named few layers, and not right next to one already drawn
    // (its curve would mostly repeat it).
    for &((_, _, s), l) in &ranked {
        if chosen.len() >= MAX_CURVES - 2 || s == 0 {
            break;
        }
        if !chosen.iter().any(|(c, _)| c.abs_diff(l) <= 1) {
            push(l, "anomalous", &mut chosen);
        }
    }
    if let Some(&(_, l)) = ranked
        .iter()
        .rev()
        .find(|(_, l)| !chosen.iter().any(|(c, _)| c == l))
    {
        let role = if chosen.is_empty() {
            "layer"
        } else {
            "reference"
        };
        push(l, role, &mut chosen);
    }
    chosen
        .into_iter()
        .map(|(l, role)| curve(display_name(&model.layers[l].name), role, &grid[l]))
        .collect()
}

/// At most [`MAX_EVENTS`] events, in step order: the hypotheses' evidence and every
/// non-finite transition first, then the earliest others.
fn pick_events(
    engine: &Engine,
    events: &[SemanticEvent],
    hypotheses: &[CausalHypothesis],
) -> Vec<Ev> {
    type Key = (u64, u64, Subject, EventType);
    let key = |e: &SemanticEvent| -> Key { (e.step, e.confirmed_step, e.subject, e.event_type) };
    let mut keep: Vec<usize> = if events.len() <= MAX_EVENTS {
        (0..events.len()).collect()
    } else {
        let evidence: HashSet<Key> = hypotheses
            .iter()
            .take(10)
            .flat_map(|h| h.evidence.iter().map(key))
            .collect();
        let first: Vec<usize> = (0..events.len())
            .filter(|&i| {
                evidence.contains(&key(&events[i])) || events[i].to_state.as_str() == "NON_FINITE"
            })
            .take(MAX_EVENTS)
            .collect();
        let chosen: HashSet<usize> = first.iter().copied().collect();
        let rest = (0..events.len()).filter(|i| !chosen.contains(i));
        let mut keep = first.clone();
        keep.extend(rest.take(MAX_EVENTS - first.len()));
        keep.sort_unstable();
        keep
    };
    keep.dedup();
    keep.into_iter()
        .map(|i| {
            let e = &events[i];
            Ev {
                step: e.step,
                kind: e.event_type.as_str(),
                who: display_name(&engine.subject_name(e.subject)).to_string(),
                from: e.from_state.as_str(),
                to: e.to_state.as_str(),
                confidence: Num::F64(e.confidence),
                value: Num::F64(e.value),
            }
        })
        .collect()
}

fn graph(analysis: &Analysis<'_>, hypotheses: &[CausalHypothesis]) -> Vec<GraphRoot> {
    let mut out: Vec<GraphRoot> = analysis
        .root_causes()
        .into_iter()
        .filter_map(|r| {
            let h = hypotheses
                .iter()
                .find(|h| h.failure == r.failure && h.layer == r.layer)?;
            (h.confidence >= 0.3).then(|| GraphRoot {
                cause: h.cause.as_str(),
                confidence: h.confidence,
                failure: r.failure.as_str(),
                layer: r.layer.as_deref().map(|l| display_name(l).to_string()),
                step: r.step,
                affected: r.affected.len(),
                consequences: r.consequences.iter().map(|f| f.as_str()).collect(),
                chain: h.causal_chain.clone(),
            })
        })
        .collect();
    out.sort_by(|a, b| b.confidence.total_cmp(&a.confidence));
    out.truncate(6);
    out
}

// ------------------------------------------------------------------ static HTML

fn escape(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for c in text.chars() {
        match c {
            '&' => out.push_str("&amp;"),
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '"' => out.push_str("&quot;"),
            '\'' => out.push_str("&#39;"),
            _ => out.push(c),
        }
    }
    out
}

/// Escaped text with `` `names` `` set as code, as the engine's sentences write them.
fn rich(text: &str) -> String {
    escape(text)
        .split('`')
        .enumerate()
        .map(|(i, part)| {
            if i % 2 == 1 {
                format!("<code>{part}</code>")
            } else {
                part.to_string()
            }
        })
        .collect()
}

/// Text that is safe inside `<script>`: no `</script>`, no `<!--`.
fn script_safe(text: &str) -> String {
    text.replace("</", "<\\/").replace("<!--", "<\\!--")
}

fn summary(engine: &Engine) -> String {
    let Some(model) = engine.model() else {
        return "No model was registered: nothing was observed.".into();
    };
    let steps = match (engine.run().and_then(|r| r.first_step), engine.last_step()) {
        (Some(a), Some(b)) => format!("steps {a}–{b} ({} observed)", engine.steps_observed()),
        _ => "no steps observed".into(),
    };
    format!(
        "{} layers with parameters, {} modules · {steps} · {} events{}{}",
        model.layers.len(),
        model.spec.modules.len(),
        engine.events().len(),
        model
            .spec
            .optimizer
            .as_deref()
            .map(|o| format!(" · optimizer {}", escape(o)))
            .unwrap_or_default(),
        engine.run().map(loop_summary).unwrap_or_default()
    )
}

/// What the training loop did around the optimizer: skipped (overflow) steps, loss scale,
/// clipping. Empty when the collector sent no such fact.
fn loop_summary(run: &crate::engine::Run) -> String {
    use std::fmt::Write as _;
    let t = &run.loop_track;
    let mut out = String::new();
    if let Some(scale) = t.loss_scale_last {
        let _ = write!(
            out,
            " · {} step(s) skipped by the GradScaler (overflow), loss scale {}",
            t.skipped_steps,
            crate::analysis::format_number(scale)
        );
    }
    if t.clipped_steps > 0 {
        let _ = write!(
            out,
            " · gradients clipped on {} step(s), down to {}x",
            t.clipped_steps,
            crate::analysis::format_number(t.clip_ratio_min.unwrap_or(1.0))
        );
    }
    out
}

fn hypothesis_card(h: &CausalHypothesis, top: bool, judged: Option<&Verdict>) -> String {
    let mut s = String::new();
    let pct = (h.confidence * 100.0).round();
    let _ = write!(
        s,
        "<article class=\"hyp{}\"><div class=\"conf\" title=\"confidence\"><b>{:.2}</b>\
         <span class=\"bar\"><span style=\"width:{pct}%\"></span></span></div>\
         <div class=\"body\"><p class=\"sentence\">{}</p><dl>\
         <dt>failure</dt><dd><code>{}</code></dd><dt>cause</dt><dd><code>{}</code></dd>\
         <dt>layer</dt><dd>{}</dd><dt>step</dt><dd>{}</dd></dl>",
        if top { " top" } else { "" },
        h.confidence,
        rich(&h.description),
        h.failure.as_str(),
        h.cause.as_str(),
        h.layer.as_deref().map_or_else(
            || "—".to_string(),
            |l| format!("<code>{}</code>", escape(display_name(l)))
        ),
        h.step.map_or_else(|| "—".to_string(), |s| s.to_string()),
    );
    if let Some(v) = judged {
        s.push_str(&verdict_block(v));
    }
    if !h.remedies.is_empty() {
        s.push_str("<div class=\"remedies\"><h4>What to do</h4><ul>");
        for r in &h.remedies {
            let _ = write!(s, "<li>{}</li>", rich(r));
        }
        s.push_str("</ul></div>");
    }
    s.push_str("</div></article>");
    s
}

fn verdict(
    engine: &Engine,
    hypotheses: &[CausalHypothesis],
    confirmation: Option<&Confirmation>,
) -> String {
    let mut s = String::new();
    if engine.model().is_none() || engine.steps_observed() == 0 {
        s.push_str("<p class=\"healthy\">Nothing to judge: no training step was observed.</p>");
        return s;
    }
    let judged = |h: &CausalHypothesis| confirmation.and_then(|c| c.verdict_for(h));
    let confirmed = |h: &CausalHypothesis| judged(h).is_some_and(|v| v.verdict == "confirmed");
    let failing = hypotheses
        .iter()
        .take_while(|h| h.confidence >= FAILURE_CONFIDENCE || confirmed(h))
        .count();
    if let Some(c) = confirmation {
        let tried = c.runs.iter().filter(|r| r.intervention.is_some()).count();
        let _ = write!(
            s,
            "<p class=\"confirm-note\">The remedies were tried by <code>neuraldbg run --confirm</code>: \
             {tried} remed{} in fresh runs of {} steps, against an unchanged re-run. \
             <i>Confirmed</i>: the failure did not recur and the loss beat the unchanged re-run by \
             more than two identical runs differ.</p>",
            if tried == 1 { "y" } else { "ies" },
            c.steps
        );
    }
    if failing == 0 {
        let _ = write!(
            s,
            "<p class=\"healthy\"><b>No failure detected.</b> No hypothesis reaches confidence \
             {FAILURE_CONFIDENCE} over {} observed steps.</p>",
            engine.steps_observed()
        );
    }
    let shown = if failing == 0 {
        0
    } else {
        failing.min(VERDICT_HYPOTHESES)
    };
    for (i, h) in hypotheses.iter().take(shown).enumerate() {
        s.push_str(&hypothesis_card(h, i == 0, judged(h)));
    }
    let rest = &hypotheses[shown..hypotheses.len().min(shown + 10)];
    if !rest.is_empty() {
        let _ = write!(
            s,
            "<details class=\"more\"><summary>{} {} hypothes{} (confidence {:.2}–{:.2})</summary>",
            if shown == 0 { "Weak" } else { "Other" },
            rest.len(),
            if rest.len() == 1 { "is" } else { "es" },
            rest.iter()
                .map(|h| h.confidence)
                .fold(f64::INFINITY, f64::min),
            rest.iter().map(|h| h.confidence).fold(0.0, f64::max),
        );
        for h in rest {
            s.push_str(&hypothesis_card(h, false, judged(h)));
        }
        s.push_str("</details>");
    }
    s
}

/// A hypothesis's `--confirm` verdict: what was tried, and the numbers behind the verdict.
fn verdict_block(v: &Verdict) -> String {
    let class = match v.verdict.as_str() {
        "confirmed" | "refuted" | "inconclusive" => v.verdict.as_str(),
        _ => "untested",
    };
    let mut s = format!(
        "<div class=\"tried {class}\"><p><b class=\"badge\">{}</b> {}</p>",
        escape(&v.verdict.to_uppercase()),
        escape(&v.evidence.why)
    );
    if let (true, Some(i)) = (v.tried(), &v.intervention) {
        let e = &v.evidence;
        let yes_no = |b: Option<bool>| match b {
            Some(true) => "yes",
            Some(false) => "no",
            None => "—",
        };
        let _ = write!(
            s,
            "<dl><dt>tried</dt><dd>{}</dd><dt>failure recurred</dt><dd>{}</dd>\
             <dt>in the unchanged re-run</dt><dd>{}</dd><dt>final loss</dt><dd>{} with it, {} \
             unchanged, {} first run</dd><dt>spread of identical runs</dt><dd>{}</dd></dl>",
            escape(i),
            yes_no(e.failure_recurred),
            yes_no(e.failure_in_unchanged),
            confirmation::loss_text(e.loss),
            confirmation::loss_text(e.loss_unchanged),
            confirmation::loss_text(e.loss_first_run),
            e.spread
                .map_or_else(|| "—".into(), crate::analysis::format_number),
        );
        if let Some(p) = &e.parts_from_unchanged {
            let _ = write!(
                s,
                "<p class=\"parted\">Against the unchanged re-run: {}.</p>",
                escape(&p.text())
            );
        }
    }
    s.push_str("</div>");
    s
}

fn base64(bytes: &[u8]) -> String {
    const ALPHABET: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let mut out = String::with_capacity(bytes.len().div_ceil(3) * 4);
    for chunk in bytes.chunks(3) {
        let b = [
            chunk[0],
            chunk.get(1).copied().unwrap_or(0),
            chunk.get(2).copied().unwrap_or(0),
        ];
        let n = (u32::from(b[0]) << 16) | (u32::from(b[1]) << 8) | u32::from(b[2]);
        for i in 0..4 {
            if i <= chunk.len() {
                out.push(char::from(ALPHABET[(n >> (18 - 6 * i)) as usize & 63]));
            } else {
                out.push('=');
            }
        }
    }
    out
}

#[cfg(test)]
mod tests;
