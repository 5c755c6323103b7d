//! `neuraldbg export`: the diagnosis of a replayed trace in other formats.

use neuraldbg_core::analysis::explain;
use neuraldbg_core::output::{events_json, float, hypotheses_json};
use neuraldbg_core::trace::Replay;
use neuraldbg_core::{
    ACTIVATION_METRICS, Engine, LAYER_METRICS, RUN_METRICS, Reduce, display_name,
};
use serde_json::{Map, Value, json};

use crate::tensorboard::{self, EventFile};
use crate::text;

/// Who a series is about.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Group {
    /// A module owning parameters.
    Layer,
    Activation,
    /// The whole run (loss, learning rate, total gradient norm, input scale).
    Run,
}

/// One plottable series: the last value of each history bucket, NaN where nothing was
/// measured.
#[derive(Debug)]
struct Series {
    group: Group,
    /// The module's qualified name; None for run-wide series.
    name: Option<String>,
    metric: &'static str,
    steps: Vec<u64>,
    values: Vec<f64>,
}

/// Every series the engine keeps.
fn series(engine: &Engine) -> Vec<Series> {
    let mut out = Vec::new();
    let Some(model) = engine.model() else {
        return out;
    };
    let mut add = |group, name: Option<&str>, metric| {
        if let Ok((steps, values)) = engine.history(name, metric, Reduce::Last) {
            out.push(Series {
                group,
                name: name.map(str::to_string),
                metric,
                steps,
                values,
            });
        }
    };
    for layer in &model.layers {
        for metric in LAYER_METRICS {
            add(Group::Layer, Some(&layer.name), metric);
        }
    }
    for act in &model.activations {
        for metric in ACTIVATION_METRICS {
            add(Group::Activation, Some(&act.name), metric);
        }
    }
    for metric in RUN_METRICS {
        add(Group::Run, None, metric);
    }
    out
}

/// Trace facts shared by `info` and the JSON export.
pub fn trace_json(replay: &Replay) -> Value {
    let engine = &replay.engine;
    let model = engine.model();
    json!({
        "path": replay.origin,
        "format_version": replay.header.format,
        "bytes": replay.file_len,
        "steps": replay.steps,
        "first_step": replay.first_step,
        "last_step": engine.last_step(),
        "step_bytes": replay.step_bytes,
        "bytes_per_step": (replay.steps > 0).then(|| replay.step_bytes as f64 / replay.steps as f64),
        "closed": replay.closed,
        "damage": replay.damage.as_ref().map(|d| json!({
            "offset": d.offset,
            "record": d.record,
            "message": d.to_string(),
        })),
        "model": model.map(|m| json!({
            "modules": m.spec.modules.len(),
            "parameters": m.spec.params.len(),
            "layers": m.layers.len(),
            "activations": m.activations.len(),
            "optimizer": m.spec.optimizer,
        })),
        "meta": replay.header.meta,
        "config": engine.config(),
    })
}

/// Events, hypotheses and every history series in one document.
pub fn json(replay: &Replay) -> Value {
    let engine = &replay.engine;
    let hypotheses = hypotheses_json(engine, &explain(engine, None));
    let mut groups: Map<String, Value> = ["layers", "activations", "run"]
        .iter()
        .map(|g| ((*g).to_string(), Value::Object(Map::new())))
        .collect();
    for s in series(engine) {
        let entry = json!({
            "steps": s.steps,
            "values": s.values.into_iter().map(float).collect::<Vec<_>>(),
        });
        let key = match s.group {
            Group::Layer => "layers",
            Group::Activation => "activations",
            Group::Run => "run",
        };
        let Some(Value::Object(g)) = groups.get_mut(key) else {
            continue;
        };
        let metric = s.metric;
        match s.name {
            Some(name) => {
                let per = g.entry(name).or_insert_with(|| Value::Object(Map::new()));
                if let Value::Object(per) = per {
                    per.insert(metric.to_string(), entry);
                }
            }
            None => {
                g.insert(metric.to_string(), entry);
            }
        }
    }
    json!({
        "trace": trace_json(replay),
        "events": events_json(engine, &engine.events()),
        "hypotheses": hypotheses,
        "history": groups,
    })
}

/// One event file: every series as scalars (NaN points, i.e. buckets without a value, are left
/// out), each step's events as a text list, and the ranked hypotheses as text at the last step.
pub fn tensorboard(replay: &Replay) -> EventFile {
    let engine = &replay.engine;
    let mut file = EventFile::default();
    for s in series(engine) {
        let metric = s.metric;
        let tag = match (s.group, &s.name) {
            (Group::Run, _) | (_, None) => format!("run/{metric}"),
            (Group::Layer, Some(n)) => format!("{metric}/{}", display_name(n)),
            (Group::Activation, Some(n)) => format!("activation/{metric}/{}", display_name(n)),
        };
        for (step, v) in s.steps.into_iter().zip(s.values) {
            if !v.is_nan() {
                file.add(step, tensorboard::scalar(&tag, v as f32));
            }
        }
    }
    let events = engine.events();
    let mut i = 0;
    while i < events.len() {
        let step = events[i].step;
        let mut lines = Vec::new();
        while i < events.len() && events[i].step == step {
            lines.push(format!("- `{}`", text::event_line(engine, &events[i])));
            i += 1;
        }
        file.add(step, tensorboard::text("events", &lines.join("\n")));
    }
    if engine.model().is_some() {
        let hypotheses = explain(engine, None);
        let body = if hypotheses.is_empty() {
            "no failure detected".to_string()
        } else {
            hypotheses
                .iter()
                .map(|h| format!("1. {}", text::hypothesis_line(h)))
                .collect::<Vec<_>>()
                .join("\n")
        };
        file.add(
            engine.last_step().unwrap_or(0),
            tensorboard::text("diagnosis", &body),
        );
    }
    file
}
