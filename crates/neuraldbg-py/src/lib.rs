//! `neuraldbg._native`: thin `PyO3` wrappers around `neuraldbg-core`.
//!
//! Only conversions live here: numpy arrays in, JSON strings and numpy arrays out, and engine
//! errors mapped to the package's exception classes (`neuraldbg.errors`) in one place
//! (`to_py_err`). Structured results cross as JSON so this crate never mirrors core types.

// PyO3 extracts arguments by value; the borrow checker, not clippy, decides here.
#![allow(clippy::needless_pass_by_value)]

use std::ffi::CString;

mod plain;
mod reader;

use neuraldbg_core::analysis::{self, Analysis, parse_failure};
use neuraldbg_core::trace::{Replay, SyncPolicy, TraceReader, TraceWriter, WriterOptions};
use neuraldbg_core::{
    Config, ConfigError, Engine, EngineError, Fact, FirstBatch, Measure, ModelSpec, Reduce,
    StepView, output,
};
use numpy::{IntoPyArray, PyArray1, PyReadonlyArray1};
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList};

/// Converts an engine error into the matching `neuraldbg.errors` exception.
fn to_py_err(py: Python<'_>, err: &EngineError) -> PyErr {
    let class = match err {
        EngineError::Config(_) => "ConfigError",
        EngineError::Unknown { .. } => "UnknownNameError",
        EngineError::Model(_) => "ModelError",
        _ => "EngineError",
    };
    raise(py, class, &err.to_string())
}

fn raise(py: Python<'_>, class: &str, message: &str) -> PyErr {
    match py
        .import("neuraldbg.errors")
        .and_then(|m| m.getattr(class))
        .and_then(|cls| cls.call1((message,)))
    {
        Ok(exc) => PyErr::from_value(exc),
        Err(e) => e,
    }
}

fn config_err(py: Python<'_>, err: &ConfigError) -> PyErr {
    raise(py, "ConfigError", &err.to_string())
}

fn slice<'a>(py: Python<'_>, name: &str, a: &'a PyReadonlyArray1<'_, f32>) -> PyResult<&'a [f32]> {
    a.as_slice().map_err(|_| {
        raise(
            py,
            "EngineError",
            &format!("{name} must be a contiguous 1-D float32 array"),
        )
    })
}

/// Parses a vocabulary name given from Python (`what` says which vocabulary, for the error).
fn vocab<T>(
    py: Python<'_>,
    what: &'static str,
    name: &str,
    parse: impl Fn(&str) -> Option<T>,
    names: impl Fn() -> String,
) -> PyResult<T> {
    parse(name).ok_or_else(|| {
        to_py_err(
            py,
            &EngineError::Unknown {
                what,
                name: name.to_string(),
                expected: names(),
            },
        )
    })
}

/// `{name: value}` facts of a step, in the dict's order.
fn facts(py: Python<'_>, d: Option<&Bound<'_, PyDict>>) -> PyResult<Vec<(Fact, f64)>> {
    let Some(d) = d else { return Ok(Vec::new()) };
    d.iter()
        .map(|(k, v)| {
            let name: String = k.extract()?;
            Ok((
                vocab(py, "fact", &name, Fact::parse, Fact::names)?,
                v.extract()?,
            ))
        })
        .collect()
}

/// `{name: float32 array}` measures of a step, in the dict's order.
fn measures(py: Python<'_>, d: Option<&Bound<'_, PyDict>>) -> PyResult<Vec<(Measure, Vec<f32>)>> {
    let Some(d) = d else { return Ok(Vec::new()) };
    d.iter()
        .map(|(k, v)| {
            let name: String = k.extract()?;
            let measure = vocab(py, "measure", &name, Measure::parse, Measure::names)?;
            let a: PyReadonlyArray1<'_, f32> = v.extract()?;
            Ok((measure, slice(py, measure.as_str(), &a)?.to_vec()))
        })
        .collect()
}

/// `(steps, values)` of a history series.
type Series<'py> = (Bound<'py, PyArray1<u64>>, Bound<'py, PyArray1<f64>>);

/// `neuraldbg_core::table::HistoryTable`: the series keys `(group, module, metric)`, then the
/// columns series index, first step, step, value, min, max.
type Table<'py> = (
    Vec<(&'static str, Option<String>, &'static str)>,
    Bound<'py, PyArray1<u32>>,
    Bound<'py, PyArray1<u64>>,
    Bound<'py, PyArray1<u64>>,
    Bound<'py, PyArray1<f64>>,
    Bound<'py, PyArray1<f64>>,
    Bound<'py, PyArray1<f64>>,
);

/// Emits a `neuraldbg.NeuralDbgWarning` (best effort: a warning filter that raises is ignored,
/// monitoring must not break training).
fn warn(py: Python<'_>, message: &str) {
    let Ok(category) = py
        .import("neuraldbg.errors")
        .and_then(|m| m.getattr("NeuralDbgWarning"))
    else {
        return;
    };
    let message = CString::new(message.replace('\0', " ")).unwrap_or_default();
    if let Err(e) = PyErr::warn(py, &category, &message, 2)
        && e.is_instance_of::<pyo3::exceptions::PyKeyboardInterrupt>(py)
    {
        // A Ctrl-C landed while the warning was shown: the user's, raised again at the first
        // Python line after we return (where SIGINT is handled by Python; dropped otherwise,
        // as the signal itself would be).
        // SAFETY: called with the GIL held (`py`).
        unsafe { pyo3::ffi::PyErr_SetInterrupt() };
    }
}

/// The engine. One per watched model.
#[pyclass(module = "neuraldbg._native", name = "Engine")]
pub(crate) struct PyEngine {
    inner: Engine,
    /// Where the engine's inputs are recorded, when a trace is open.
    trace: Option<TraceWriter>,
}

impl PyEngine {
    /// Feeds one step built in the extension (`PlainStep`); as `observe`.
    pub(crate) fn observe_view(&mut self, py: Python<'_>, view: &StepView<'_>) -> PyResult<bool> {
        self.inner.observe(view).map_err(|e| to_py_err(py, &e))?;
        self.traced(py, "writing a step", |_, w| w.write_step(view));
        Ok(self.inner.activation_pending())
    }

    /// A JSON list computed from the analysis; empty before a model is registered.
    fn analysed(&self, f: impl FnOnce(&Analysis<'_>) -> serde_json::Value) -> String {
        Analysis::new(&self.inner).map_or_else(|| "[]".to_string(), |a| f(&a).to_string())
    }

    /// Runs one trace write; on failure stops tracing with a warning, and the live diagnosis
    /// goes on.
    fn traced(
        &mut self,
        py: Python<'_>,
        what: &str,
        write: impl FnOnce(&Engine, &mut TraceWriter) -> Result<(), neuraldbg_core::trace::TraceError>,
    ) {
        let Some(writer) = self.trace.as_mut() else {
            return;
        };
        if let Err(e) = write(&self.inner, writer) {
            let steps = writer.steps();
            self.trace = None;
            warn(
                py,
                &format!(
                    "NeuralDBG stopped writing the trace: {what} failed ({e}); the trace keeps its first {steps} steps, the live diagnosis continues"
                ),
            );
        }
    }
}

#[pymethods]
impl PyEngine {
    /// Creates an engine from a JSON object of configuration overrides.
    #[new]
    fn new(py: Python<'_>, config_json: &str) -> PyResult<Self> {
        let config = Config::from_json(config_json).map_err(|e| config_err(py, &e))?;
        let inner = Engine::new(config).map_err(|e| to_py_err(py, &e))?;
        Ok(Self { inner, trace: None })
    }

    /// Replays a trace file into a new engine: `(engine, facts_json)`, the facts being the
    /// reading's outcome (steps, closed, damage) and the header's metadata.
    #[staticmethod]
    fn load_trace(py: Python<'_>, path: std::path::PathBuf) -> PyResult<(Self, String)> {
        let replay = py
            .detach(|| TraceReader::open(&path).and_then(|r| Replay::read(r, |_| {})))
            .map_err(|e| raise(py, "TraceError", &e.to_string()))?;
        let facts = serde_json::json!({
            "path": replay.origin,
            "steps": replay.steps,
            "first_step": replay.first_step,
            "closed": replay.closed,
            "damage": replay.damage.as_ref().map(ToString::to_string),
            "unobserved": replay.unobserved.iter().map(ToString::to_string).collect::<Vec<_>>(),
            "meta": replay.header.meta,
        });
        Ok((
            Self {
                inner: replay.engine,
                trace: None,
            },
            facts.to_string(),
        ))
    }

    /// Starts recording this engine's inputs to a trace file (directories are created, an
    /// existing file is replaced). The header is written once the model is registered.
    /// `sync_interval`: seconds between syncs to disk; 0 syncs every step, infinity only on
    /// close, None the default.
    #[pyo3(signature = (path, meta_json="{}", sync_interval=None))]
    fn open_trace(
        &mut self,
        py: Python<'_>,
        path: std::path::PathBuf,
        meta_json: &str,
        sync_interval: Option<f64>,
    ) -> PyResult<()> {
        if self.trace.is_some() {
            return Err(raise(py, "EngineError", "a trace is already open"));
        }
        let meta: serde_json::Map<String, serde_json::Value> = serde_json::from_str(meta_json)
            .map_err(|e| raise(py, "ConfigError", &format!("trace metadata: {e}")))?;
        let sync = match sync_interval {
            None => WriterOptions::default().sync,
            Some(s) => SyncPolicy::every(s).ok_or_else(|| {
                raise(
                    py,
                    "ConfigError",
                    &format!("sync_interval must be >= 0 seconds, got {s}"),
                )
            })?,
        };
        let mut writer = TraceWriter::create(&path, meta, WriterOptions { sync })
            .map_err(|e| raise(py, "ConfigError", &e.to_string()))?;
        if let Some(model) = self.inner.model() {
            writer
                .write_header(self.inner.config(), &model.spec)
                .map_err(|e| raise(py, "EngineError", &e.to_string()))?;
        }
        self.trace = Some(writer);
        Ok(())
    }

    /// Records in the trace (if one is open) that steps `first..=last` (`last` None: to the
    /// end) were not observed, and why.
    #[pyo3(signature = (first, last, reason))]
    fn record_unobserved(&mut self, py: Python<'_>, first: u64, last: Option<u64>, reason: String) {
        let gap = neuraldbg_core::trace::Unobserved {
            first,
            last,
            reason,
        };
        self.traced(py, "recording unobserved steps", |_, w| {
            w.write_unobserved(&gap)
        });
    }

    /// Closes the trace: `(path, steps, bytes, has_header)`, or None when no trace was open.
    fn close_trace(&mut self, py: Python<'_>) -> PyResult<Option<(String, u64, u64, bool)>> {
        let Some(mut writer) = self.trace.take() else {
            return Ok(None);
        };
        writer
            .close()
            .map_err(|e| raise(py, "EngineError", &e.to_string()))?;
        Ok(Some((
            writer.path().display().to_string(),
            writer.steps(),
            writer.bytes(),
            writer.has_header(),
        )))
    }

    /// Registers the model (JSON `ModelSpec`); returns the activation probes as JSON.
    fn register_model(&mut self, py: Python<'_>, spec_json: &str) -> PyResult<String> {
        let spec: ModelSpec = serde_json::from_str(spec_json)
            .map_err(|e| raise(py, "ModelError", &format!("invalid model description: {e}")))?;
        let probes = self
            .inner
            .register_model(spec)
            .map_err(|e| to_py_err(py, &e))?;
        self.traced(py, "writing the header", |engine, w| {
            let model = &engine.model().expect("just registered").spec;
            w.write_header(engine.config(), model)
        });
        serde_json::to_string(&probes).map_err(|e| raise(py, "EngineError", &e.to_string()))
    }

    /// Another optimizer was seen stepping the model: merges its per-parameter lrs (None where
    /// it holds the parameter in no group; `lrs` None: its lrs cannot be read) into the
    /// registered model's and, when they changed them, records them in the trace. Returns
    /// whether the facts changed.
    fn amend_param_lr(&mut self, py: Python<'_>, lrs: Option<Vec<Option<f64>>>) -> PyResult<bool> {
        let changed = self
            .inner
            .amend_param_lr(lrs.as_deref())
            .map_err(|e| to_py_err(py, &e))?;
        if changed {
            self.traced(
                py,
                "recording another optimizer's learning rates",
                |_, w| w.write_param_lr(lrs.as_deref()),
            );
        }
        Ok(changed)
    }

    /// The first training batch's facts (JSON `FirstBatch`), read after the model was
    /// registered: fills those the model lacks and, when that changed it, records them in the
    /// trace. Returns whether the facts changed.
    fn amend_first_batch(&mut self, py: Python<'_>, facts_json: &str) -> PyResult<bool> {
        let facts: FirstBatch = serde_json::from_str(facts_json)
            .map_err(|e| raise(py, "ModelError", &format!("invalid first-batch facts: {e}")))?;
        let changed = self
            .inner
            .amend_first_batch(&facts)
            .map_err(|e| to_py_err(py, &e))?;
        if changed {
            self.traced(py, "recording the first batch's facts", |_, w| {
                w.write_first_batch(&facts)
            });
        }
        Ok(changed)
    }

    /// Whether a model has been registered.
    #[getter]
    fn registered(&self) -> bool {
        self.inner.model().is_some()
    }

    #[getter]
    fn steps_observed(&self) -> u64 {
        self.inner.steps_observed()
    }

    #[getter]
    fn last_step(&self) -> Option<u64> {
        self.inner.last_step()
    }

    /// Number of events so far (cheap: for noticing new ones).
    #[getter]
    fn event_count(&self) -> usize {
        self.inner.event_count()
    }

    /// Whether an activation module shows an unconfirmed new state (measure densely).
    #[getter]
    fn activation_pending(&self) -> bool {
        self.inner.activation_pending()
    }

    /// Feeds one step of statistics; returns whether an activation module now shows an
    /// unconfirmed new state (`activation_pending`: measure densely).
    #[pyo3(signature = (step, grad_norms, weight_norms=None, activations=None, inputs=None, loss=None, lr=None, nonfinite_module=None, outputs_checked=false, facts=None, measures=None))]
    #[allow(clippy::too_many_arguments)]
    fn observe(
        &mut self,
        py: Python<'_>,
        step: u64,
        grad_norms: PyReadonlyArray1<'_, f32>,
        weight_norms: Option<PyReadonlyArray1<'_, f32>>,
        activations: Option<PyReadonlyArray1<'_, f32>>,
        inputs: Option<Bound<'_, PyAny>>,
        loss: Option<f64>,
        lr: Option<f64>,
        nonfinite_module: Option<usize>,
        outputs_checked: bool,
        facts: Option<Bound<'_, PyDict>>,
        measures: Option<Bound<'_, PyDict>>,
    ) -> PyResult<bool> {
        let facts = self::facts(py, facts.as_ref())?;
        let measures = self::measures(py, measures.as_ref())?;
        // Input statistics: a float32 array, or a sequence of floats (the host path's list,
        // told apart first: a failed array extraction costs an exception object per step).
        let input_array = match &inputs {
            Some(a) if !a.is_instance_of::<PyList>() => {
                a.extract::<PyReadonlyArray1<'_, f32>>().ok()
            }
            _ => None,
        };
        let input_list: Vec<f32> = match (&inputs, &input_array) {
            (Some(a), None) => a.extract().map_err(|_| {
                raise(
                    py,
                    "EngineError",
                    "inputs must be a contiguous 1-D float32 array or a sequence of floats",
                )
            })?,
            _ => Vec::new(),
        };
        let view = StepView {
            step,
            grad_norms: slice(py, "grad_norms", &grad_norms)?,
            weight_norms: weight_norms
                .as_ref()
                .map(|a| slice(py, "weight_norms", a))
                .transpose()?,
            activations: activations
                .as_ref()
                .map(|a| slice(py, "activations", a))
                .transpose()?,
            inputs: match &input_array {
                Some(a) => slice(py, "inputs", a)?,
                None => &input_list,
            },
            loss,
            lr,
            nonfinite_module,
            outputs_checked,
            facts: &facts,
            measures: &measures,
        };
        self.observe_view(py, &view)
    }

    /// All events, in step order, as a JSON list.
    fn events_json(&self) -> String {
        output::events_json(&self.inner, &self.inner.events()).to_string()
    }

    /// Ranked hypotheses as a JSON list (optionally for one failure).
    #[pyo3(signature = (failure=None))]
    fn explain_json(&self, py: Python<'_>, failure: Option<&str>) -> PyResult<String> {
        let only = failure
            .map(parse_failure)
            .transpose()
            .map_err(|e| to_py_err(py, &e))?;
        let engine = &self.inner;
        Ok(py.detach(|| {
            output::hypotheses_json(engine, &analysis::explain(engine, only)).to_string()
        }))
    }

    /// What the cause ranking weighed, per failure episode, as a JSON object (for fitting the
    /// cause weights on a corpus: bench/corpus).
    fn evidence_json(&self, py: Python<'_>) -> String {
        let engine = &self.inner;
        py.detach(|| analysis::evidence_features(engine).to_string())
    }

    fn root_causes_json(&self) -> String {
        self.analysed(|a| output::root_causes_json(&self.inner, &a.root_causes()))
    }

    fn couplings_json(&self, window: u64) -> String {
        self.analysed(|a| output::couplings_json(&self.inner, &a.couplings(window)))
    }

    fn causal_chain_json(&self, py: Python<'_>, failure: &str) -> PyResult<String> {
        let f = parse_failure(failure).map_err(|e| to_py_err(py, &e))?;
        Ok(self.analysed(|a| output::events_json(&self.inner, &a.causal_chain(f))))
    }

    fn mermaid(&self) -> String {
        analysis::mermaid(&self.inner)
    }

    /// The self-contained HTML report of the run (`neuraldbg_core::report::render_html_with`):
    /// `sections` is `all`, `verdict_heatmap` or `verdict`; `failure` restricts the verdict.
    #[pyo3(signature = (title, sections="all", failure=None))]
    fn report_html(
        &self,
        py: Python<'_>,
        title: &str,
        sections: &str,
        failure: Option<&str>,
    ) -> PyResult<String> {
        use neuraldbg_core::report::{Options, Sections};
        let sections = match sections {
            "all" => Sections::All,
            "verdict_heatmap" => Sections::VerdictAndHeatmap,
            "verdict" => Sections::Verdict,
            other => {
                return Err(raise(
                    py,
                    "UnknownNameError",
                    &format!(
                        "unknown sections {other:?}; expected all, verdict_heatmap or verdict"
                    ),
                ));
            }
        };
        let only = failure
            .map(parse_failure)
            .transpose()
            .map_err(|e| to_py_err(py, &e))?;
        let engine = &self.inner;
        let options = Options { sections, only };
        Ok(py.detach(|| neuraldbg_core::report::render_html_with(engine, title, &options)))
    }

    /// `(steps, values)` of a series as numpy arrays.
    #[pyo3(signature = (name, metric, reduce="last"))]
    fn history<'py>(
        &self,
        py: Python<'py>,
        name: Option<&str>,
        metric: &str,
        reduce: &str,
    ) -> PyResult<Series<'py>> {
        let reduce = Reduce::parse(reduce).ok_or_else(|| {
            raise(
                py,
                "UnknownNameError",
                &format!("unknown reduce {reduce:?}; expected one of: last, min, max"),
            )
        })?;
        let (steps, values) = self
            .inner
            .history(name, metric, reduce)
            .map_err(|e| to_py_err(py, &e))?;
        Ok((steps.into_pyarray(py), values.into_pyarray(py)))
    }

    /// Every history series as one long table (`neuraldbg_core::table::history_table`).
    fn history_table<'py>(&self, py: Python<'py>) -> Table<'py> {
        let t = neuraldbg_core::table::history_table(&self.inner);
        let keys = t
            .keys
            .into_iter()
            .map(|k| (k.group.as_str(), k.module, k.metric))
            .collect();
        (
            keys,
            t.series.into_pyarray(py),
            t.first_step.into_pyarray(py),
            t.step.into_pyarray(py),
            t.value.into_pyarray(py),
            t.min.into_pyarray(py),
            t.max.into_pyarray(py),
        )
    }

    /// Bytes held by the engine's histories and events.
    fn heap_bytes(&self) -> usize {
        self.inner.heap_bytes()
    }
}

/// The default configuration as JSON (the Python package reads its defaults from here).
#[pyfunction]
fn default_config_json() -> String {
    serde_json::to_string(&Config::default()).unwrap_or_default()
}

/// Runs the `neuraldbg` command line with `argv` (program name first); returns its exit code.
#[pyfunction]
fn cli_main(py: Python<'_>, argv: Vec<String>) -> i32 {
    py.detach(|| neuraldbg_cli::run(argv))
}

#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PyEngine>()?;
    m.add_class::<reader::TensorReader>()?;
    m.add_class::<reader::OutputMaxima>()?;
    m.add_class::<plain::PlainStep>()?;
    m.add_class::<reader::LayerRecord>()?;
    m.add_class::<reader::SlotRecord>()?;
    m.add("GRAD_NONFINITE", reader::GRAD_NONFINITE)?;
    m.add("GRAD_ZERO", reader::GRAD_ZERO)?;
    m.add("GRAD_MISSING", reader::GRAD_MISSING)?;
    m.add_function(wrap_pyfunction!(default_config_json, m)?)?;
    m.add_function(wrap_pyfunction!(cli_main, m)?)?;
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    Ok(())
}
