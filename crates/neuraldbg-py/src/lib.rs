//! `neuraldbg._native`: thin `PyO3` wrappers around `neuraldbg-core`.
//!
//! Only conversions live here: numpy arrays in, JSON strings and numpy arrays out, and engine
//! errors mapped to the package's exception classes (`neuraldbg.errors`) in one place
//! ([`to_py_err`]). Structured results cross as JSON so this crate never mirrors core types.

// PyO3 extracts arguments by value; the borrow checker, not clippy, decides here.
#![allow(clippy::needless_pass_by_value)]

use neuraldbg_core::analysis::{Analysis, parse_failure};
use neuraldbg_core::{
    Config, ConfigError, Engine, EngineError, ModelSpec, Reduce, StepView, output,
};
use numpy::{IntoPyArray, PyArray1, PyReadonlyArray1};
use pyo3::prelude::*;

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

/// `(steps, values)` of a history series.
type Series<'py> = (Bound<'py, PyArray1<u64>>, Bound<'py, PyArray1<f64>>);

/// The engine. One per watched model.
#[pyclass(module = "neuraldbg._native", name = "Engine", unsendable)]
struct PyEngine {
    inner: Engine,
}

#[pymethods]
impl PyEngine {
    /// Creates an engine from a JSON object of configuration overrides.
    #[new]
    fn new(py: Python<'_>, config_json: &str) -> PyResult<Self> {
        let config = Config::from_json(config_json).map_err(|e| config_err(py, &e))?;
        let inner = Engine::new(config).map_err(|e| to_py_err(py, &e))?;
        Ok(Self { inner })
    }

    /// Registers the model (JSON `ModelSpec`); returns the activation probes as JSON.
    fn register_model(&mut self, py: Python<'_>, spec_json: &str) -> PyResult<String> {
        let spec: ModelSpec = serde_json::from_str(spec_json)
            .map_err(|e| raise(py, "ModelError", &format!("invalid model description: {e}")))?;
        let probes = self
            .inner
            .register_model(spec)
            .map_err(|e| to_py_err(py, &e))?;
        serde_json::to_string(&probes).map_err(|e| raise(py, "EngineError", &e.to_string()))
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

    /// Whether an activation module shows an unconfirmed new state (measure densely).
    #[getter]
    fn activation_pending(&self) -> bool {
        self.inner.activation_pending()
    }

    /// Feeds one step of statistics.
    #[pyo3(signature = (step, grad_norms, weight_norms=None, activations=None, inputs=None, loss=None, lr=None, nonfinite_module=None))]
    #[allow(clippy::too_many_arguments)]
    fn observe(
        &mut self,
        py: Python<'_>,
        step: u64,
        grad_norms: PyReadonlyArray1<'_, f32>,
        weight_norms: Option<PyReadonlyArray1<'_, f32>>,
        activations: Option<PyReadonlyArray1<'_, f32>>,
        inputs: Option<PyReadonlyArray1<'_, f32>>,
        loss: Option<f64>,
        lr: Option<f64>,
        nonfinite_module: Option<usize>,
    ) -> PyResult<()> {
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
            inputs: inputs
                .as_ref()
                .map(|a| slice(py, "inputs", a))
                .transpose()?
                .unwrap_or(&[]),
            loss,
            lr,
            nonfinite_module,
        };
        self.inner.observe(&view).map_err(|e| to_py_err(py, &e))
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
        let json = py.detach(|| {
            Analysis::new(engine).map_or_else(
                || "[]".to_string(),
                |a| output::hypotheses_json(engine, &a.hypotheses(only)).to_string(),
            )
        });
        Ok(json)
    }

    fn root_causes_json(&self) -> String {
        Analysis::new(&self.inner).map_or_else(
            || "[]".to_string(),
            |a| output::root_causes_json(&self.inner, &a.root_causes()).to_string(),
        )
    }

    fn couplings_json(&self, window: u64) -> String {
        Analysis::new(&self.inner).map_or_else(
            || "[]".to_string(),
            |a| output::couplings_json(&self.inner, &a.couplings(window)).to_string(),
        )
    }

    fn causal_chain_json(&self, py: Python<'_>, failure: &str) -> PyResult<String> {
        let f = parse_failure(failure).map_err(|e| to_py_err(py, &e))?;
        Ok(Analysis::new(&self.inner).map_or_else(
            || "[]".to_string(),
            |a| output::events_json(&self.inner, &a.causal_chain(f)).to_string(),
        ))
    }

    fn mermaid(&self) -> String {
        Analysis::new(&self.inner).map_or_else(
            || "graph TD\n    healthy[\"no steps observed\"]".to_string(),
            |a| a.mermaid(),
        )
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

#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PyEngine>()?;
    m.add_function(wrap_pyfunction!(default_config_json, m)?)?;
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    Ok(())
}
