//! `PlainStep`: the common host-mode step observed by the extension, with no Python of the
//! collector's on its path.
//!
//! On a 1-2 ms CPU step, watching cost ~250 lines of the collector's Python a step (0.2-0.5
//! µs each with the step's own code evicting them from the caches): its hooks, each reading
//! and writing the collector's per-step state. A step that needs nothing per module (CPU,
//! registered, the loss taken at the backward tap, not sampled) is taken here instead: the
//! collector's hooks hand the forward, the backward's start and end and the optimizer step to
//! this object, which keeps what it saw (the forward's call and input statistics, the loss
//! and its value, the sentinels' and the loop-facts probe's gradients, the gradient norms)
//! and, at the optimizer step, hands the step to the engine itself. The collector's own state
//! stays that of a step not yet begun.
//!
//! The collector arms the object for each coming step that may take this path
//! ([`PlainStep::arm`]). Anything the path does not cover (a second forward, a non-scalar or
//! scaled loss, a non-finite loss or gradient, a backward that did not reach the model,
//! another optimizer, a clip gradient missing) *spills*: what was seen so far is handed to the
//! collector's host reader, in order, with the values read when it happened, so the
//! collector's state is what its hooks would have made, and the event goes its usual way.
//!
//! Python talks to this object through one typed protocol, `PlainHost` in `_native.pyi`
//! (implemented by `neuraldbg._read_host.HostReader`): `take_forward`, `take_loss`,
//! `take_grads`, `backward_returned`, `backward_end`, `plain_done`, `fail`, `step` and
//! `plain_optimizer`; the loop facts it reads and writes are `PlainFacts` there.
//!
//! Never raises into the training loop: an error is handed to `PlainHost.fail` (which stops
//! monitoring with a warning), and the event counts as handled.

use neuraldbg_core::{Fact, StepView};
use numpy::{PyArrayDyn, PyArrayMethods};
use pyo3::exceptions::PyKeyboardInterrupt;
use pyo3::intern;
use pyo3::prelude::*;
use pyo3::types::{PyBool, PyFloat, PyInt, PyList, PyTuple};
use pyo3::{PyTraverseError, PyVisit};

use crate::PyEngine;
use crate::reader::{GRAD_NONFINITE, GRAD_ZERO, TensorReader};

/// Where the step is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
enum Stage {
    /// Nothing seen yet.
    #[default]
    Fresh,
    /// The model's forward ran.
    Forward,
    /// Its loss's backward started.
    Loss,
    /// That backward returned, having given the model gradients (read).
    Grads,
}

/// The model's forward call.
#[derive(Debug)]
struct Call {
    module: Py<PyAny>,
    args: Py<PyAny>,
    kwargs: Py<PyAny>,
    training: bool,
    /// The input's `min, max, mean, std` (None: an index batch, no float input).
    stats: Option<(f64, f64, f64, f64)>,
}

/// A gradient as a backward started: the tensor (None: no gradient) and its version.
#[derive(Debug)]
struct Mark {
    grad: Option<Py<PyAny>>,
    version: Option<i64>,
}

/// The loop facts' probe as a backward started (`LoopFacts.before_backward`): its gradient
/// and that gradient's identity `(data_ptr, version)` (None when unknown).
#[derive(Debug)]
struct ProbeMark {
    probe: Py<PyAny>,
    old: Option<Py<PyAny>>,
    key: Option<Py<PyAny>>,
}

/// One plain host step at a time (see the module docs).
#[pyclass(module = "neuraldbg._native", name = "PlainStep")]
#[derive(Debug)]
pub struct PlainStep {
    host: Py<PyAny>,
    reader: Py<TensorReader>,
    engine: Py<PyEngine>,
    /// The watched parameters (the collector's list), and its gradient-norm buffer.
    params: Py<PyList>,
    grads: Py<PyArrayDyn<f32>>,
    /// The collector's loop facts (`LoopFacts`).
    facts: Py<PyAny>,
    /// The sentinels (parameter indices) and the clipping check's parameter.
    sentinels: Vec<usize>,
    clip: Option<usize>,
    /// `torch.Tensor`, `torch.is_grad_enabled`, torch's any-autocast check.
    tensor: Py<PyAny>,
    grad_enabled: Py<PyAny>,
    any_autocast: Py<PyAny>,
    armed: bool,
    /// What was seen of the step under way.
    st: SoFar,
    /// Steps observed here.
    taken: u64,
}

/// What [`PlainStep`] saw of the step under way.
#[derive(Debug, Default)]
struct SoFar {
    stage: Stage,
    call: Option<Call>,
    loss: Option<(Py<PyAny>, f64)>,
    marks: Vec<Mark>,
    probe: Option<ProbeMark>,
    accumulated: Option<bool>,
    flags: i32,
    clip_seen: Option<(Py<PyAny>, Option<i64>)>,
}

/// `g._version`, None when it has none.
fn version(g: &Bound<'_, PyAny>) -> Option<i64> {
    g.getattr(intern!(g.py(), "_version")).ok()?.extract().ok()
}

/// `p.grad`, None for None.
fn grad_of<'py>(p: &Bound<'py, PyAny>) -> PyResult<Option<Bound<'py, PyAny>>> {
    let g = p.getattr(intern!(p.py(), "grad"))?;
    Ok((!g.is_none()).then_some(g))
}

/// `_loop.grad_changed`: whether `p.grad` is another tensor than `before`, or `before` at
/// another version than `then` (an unknown one counts as changed).
fn changed(p: &Bound<'_, PyAny>, before: Option<&Py<PyAny>>, then: Option<i64>) -> PyResult<bool> {
    Ok(match (grad_of(p)?, before) {
        (None, None) => false,
        (Some(now), Some(before)) => {
            !now.is(before) || then.is_none() || version(before.bind(p.py())) != then
        }
        _ => true,
    })
}

/// `_loop._grad_key`: `(g.data_ptr(), g._version)`, or `(id(g), g._version)`, else None.
fn grad_key(g: &Bound<'_, PyAny>) -> Option<Py<PyAny>> {
    let py = g.py();
    let v = g.getattr(intern!(py, "_version")).ok()?;
    let id = g
        .call_method0(intern!(py, "data_ptr"))
        .or_else(|_| py.import("builtins")?.getattr("id")?.call1((g,)))
        .ok()?;
    PyTuple::new(py, [id, v])
        .ok()
        .map(|t| t.into_any().unbind())
}

/// `_transfer.clip_ratio`: `after / before` when both are finite and `before > 0`; 0 when the
/// optimizer received no gradient (`after` < 0: `.grad` set to None in between).
fn clip_ratio(before: f64, after: f64) -> Option<f64> {
    (before > 0.0 && before.is_finite() && after.is_finite()).then(|| after.max(0.0) / before)
}

impl PlainStep {
    fn param<'py>(&self, py: Python<'py>, k: usize) -> PyResult<Bound<'py, PyAny>> {
        self.params.bind(py).get_item(k)
    }

    /// Runs `f`; an error stops monitoring (`PlainHost.fail`, which warns) and the event
    /// counts as handled (`done`). A Ctrl-C is not an error of ours: its `KeyboardInterrupt`,
    /// met in Python code the step called (or in `fail`), goes on to the user's loop as raised
    /// (handed to `fail`, it stopped monitoring and training went on).
    fn guard<R>(
        &mut self,
        py: Python<'_>,
        done: R,
        f: impl FnOnce(&mut Self, Python<'_>) -> PyResult<R>,
    ) -> PyResult<R> {
        let e = match f(self, py) {
            Ok(r) => return Ok(r),
            Err(e) => e,
        };
        self.reset();
        self.armed = false;
        if e.is_instance_of::<PyKeyboardInterrupt>(py) {
            return Err(e);
        }
        let host = self.host.clone_ref(py);
        if let Err(e) = host
            .bind(py)
            .call_method1(intern!(py, "fail"), (e.into_value(py),))
        {
            if e.is_instance_of::<PyKeyboardInterrupt>(py) {
                return Err(e);
            }
            e.write_unraisable(py, None);
        }
        Ok(done)
    }

    fn reset(&mut self) {
        self.st = SoFar::default();
    }

    /// Hands what was seen of this step to the collector (see the module docs) and stops
    /// taking it: the forward, the loss, and (when `grads`) the gradients read and the loop
    /// facts' probe.
    fn spill(&mut self, py: Python<'_>, grads: bool) -> PyResult<()> {
        self.armed = false;
        let SoFar {
            stage,
            call,
            loss,
            flags,
            accumulated,
            clip_seen,
            ..
        } = std::mem::take(&mut self.st);
        let c = self.host.bind(py);
        if let Some(call) = call {
            let seen = (call.training, true, call.stats);
            c.call_method1(
                intern!(py, "take_forward"),
                (call.module, call.args, call.kwargs, seen),
            )?;
        }
        if let Some((tensor, _)) = &loss {
            c.call_method1(intern!(py, "take_loss"), (tensor,))?;
        }
        if grads && stage == Stage::Grads {
            c.call_method1(
                intern!(py, "take_grads"),
                (loss.map(|(t, _)| t), flags, clip_seen, accumulated),
            )?;
        } else if let Some(a) = accumulated {
            self.facts.bind(py).setattr(intern!(py, "accumulated"), a)?;
        }
        Ok(())
    }

    /// The marks in the collector's own form (`Collector.on_backward`'s answer).
    fn py_marks<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyTuple>> {
        let sentinels = PyList::empty(py);
        for (k, m) in self.sentinels.iter().zip(&self.st.marks) {
            sentinels.append((*k, m.grad.as_ref().map(|g| g.clone_ref(py)), m.version))?;
        }
        let probe = match &self.st.probe {
            Some(p) => Some((
                p.old.as_ref().map(|g| g.clone_ref(py)),
                p.key.as_ref().map(|k| k.clone_ref(py)),
            ))
            .into_pyobject(py)?
            .into_any(),
            None => py.None().into_bound(py),
        };
        PyTuple::new(py, [sentinels.into_any(), probe])
    }

    fn forward_inner(
        &mut self,
        py: Python<'_>,
        module: &Bound<'_, PyAny>,
        args: &Bound<'_, PyAny>,
        kwargs: &Bound<'_, PyAny>,
    ) -> PyResult<bool> {
        if self.st.stage != Stage::Fresh {
            self.spill(py, true)?; // a second forward in the step: the collector's way
            return Ok(false);
        }
        self.armed = false; // (until this forward is known to be a plain one)
        if self.any_autocast.bind(py).call0()?.is_truthy()?
            || !self.grad_enabled.bind(py).call0()?.is_truthy()?
        {
            return Ok(false);
        }
        let Ok(tuple) = args.cast::<PyTuple>() else {
            return Ok(false);
        };
        let Ok(x) = tuple.get_item(0) else {
            return Ok(false);
        };
        if !x.get_type().is(self.tensor.bind(py)) {
            return Ok(false);
        }
        let stats = self.reader.borrow_mut(py).stats(&x);
        if stats.is_none() {
            // Not a readable float tensor. Taken only as the one input, holding no float (token
            // ids): the collector then reads no input statistics either.
            let alone = tuple.len() == 1 && (kwargs.is_none() || kwargs.len()? == 0);
            if !alone
                || x.call_method0(intern!(py, "is_floating_point"))?
                    .is_truthy()?
            {
                return Ok(false);
            }
        }
        let training = module.getattr(intern!(py, "training"))?.is_truthy()?;
        self.st.call = Some(Call {
            module: module.clone().unbind(),
            args: args.clone().unbind(),
            kwargs: kwargs.clone().unbind(),
            training,
            stats,
        });
        self.st.stage = Stage::Forward;
        self.armed = true;
        Ok(true)
    }

    fn backward_inner(&mut self, py: Python<'_>, tensors: &Bound<'_, PyAny>) -> PyResult<bool> {
        if self.st.stage != Stage::Forward {
            self.spill(py, true)?;
            return Ok(false);
        }
        let scalar = tensors.get_type().is(self.tensor.bind(py))
            && tensors
                .call_method0(intern!(py, "numel"))?
                .extract::<usize>()?
                == 1;
        let scaled = scalar
            && tensors
                .getattr(intern!(py, "grad_fn"))?
                .get_type()
                .name()?
                .to_cow()?
                == "MulBackward0";
        let value = if scalar && !scaled {
            self.reader
                .borrow_mut(py)
                .scalar(tensors)
                .filter(|v| v.is_finite())
        } else {
            None
        };
        let Some(value) = value else {
            self.spill(py, true)?; // not a plain loss (or a non-finite one): the collector's way
            return Ok(false);
        };
        self.st.marks.clear();
        for &k in &self.sentinels {
            let g = grad_of(&self.param(py, k)?)?;
            let v = g.as_ref().and_then(version);
            self.st.marks.push(Mark {
                grad: g.map(Bound::unbind),
                version: v,
            });
        }
        let facts = self.facts.bind(py);
        let probe = facts.getattr(intern!(py, "probe"))?;
        self.st.probe = if facts.getattr(intern!(py, "armed"))?.is_truthy()? && !probe.is_none() {
            let old = grad_of(&probe)?;
            let key = old.as_ref().and_then(grad_key);
            Some(ProbeMark {
                probe: probe.unbind(),
                old: old.map(Bound::unbind),
                key,
            })
        } else {
            None
        };
        self.st.loss = Some((tensors.clone().unbind(), value));
        self.st.stage = Stage::Loss;
        Ok(true)
    }

    fn after_inner(&mut self, py: Python<'_>) -> PyResult<()> {
        if self.st.stage != Stage::Loss {
            return Ok(());
        }
        let mut reached = false;
        for (&k, m) in self.sentinels.iter().zip(&self.st.marks) {
            if changed(&self.param(py, k)?, m.grad.as_ref(), m.version)? {
                reached = true;
                break;
            }
        }
        let c = self.host.clone_ref(py);
        let c = c.bind(py);
        if !reached {
            // Not this model's backward (or it reached none of its parameters): the
            // collector's way, from the marks it would have taken.
            let marks = self.py_marks(py)?;
            self.spill(py, false)?;
            c.call_method1(intern!(py, "backward_returned"), (marks,))?;
            return Ok(());
        }
        if let Some(p) = &self.st.probe {
            // LoopFacts.after_backward: what the probe's backward found in its .grad.
            let then = match &p.key {
                Some(k) => k.bind(py).get_item(1)?.extract::<Option<i64>>()?,
                None => None,
            };
            if changed(p.probe.bind(py), p.old.as_ref(), then)? {
                let facts = self.facts.bind(py);
                facts.setattr(intern!(py, "armed"), false)?;
                facts.setattr(intern!(py, "grads_kept"), p.old.is_some())?;
                let before = facts.getattr(intern!(py, "after_step_grad"))?;
                // `old is not None and before is not None and key == before`
                self.st.accumulated = Some(match (&p.old, &p.key) {
                    (Some(_), Some(key)) if !before.is_none() => key.bind(py).eq(&before)?,
                    _ => false,
                });
            }
        }
        let flags = {
            let grads = self.grads.bind(py).readwrite();
            let params = self.params.bind(py).clone().into_any();
            self.reader
                .borrow_mut(py)
                .grad_norms(&params, grads, -1.0, None, None)?
        };
        let kept = self.facts.bind(py).getattr(intern!(py, "grads_kept"))?;
        let zero_unclear = flags & GRAD_ZERO != 0 && !kept.is(&*PyBool::new(py, false));
        if flags < 0 || flags & GRAD_NONFINITE != 0 || zero_unclear {
            // Non-finite, unreadable, or exact-zero gradients that may be leftovers: the
            // collector reads and judges them itself.
            self.spill(py, false)?;
            c.call_method0(intern!(py, "backward_end"))?;
            return Ok(());
        }
        self.st.clip_seen = match self.clip {
            Some(k) => grad_of(&self.param(py, k)?)?.map(|g| {
                let v = version(&g);
                (g.unbind(), v)
            }),
            None => None,
        };
        self.st.flags = flags;
        self.st.stage = Stage::Grads;
        Ok(())
    }

    fn step_inner(&mut self, py: Python<'_>, optimizer: &Bound<'_, PyAny>) -> PyResult<bool> {
        let c = self.host.clone_ref(py);
        let c = c.bind(py);
        if self.st.stage != Stage::Grads
            || !optimizer.is(&c.getattr(intern!(py, "plain_optimizer"))?)
        {
            // Another optimizer's step: the collector's way.
            self.spill(py, true)?;
            return Ok(false);
        }
        let lr = optimizer
            .getattr(intern!(py, "param_groups"))?
            .get_item(0)?
            .call_method1(intern!(py, "get"), (intern!(py, "lr"),))?;
        let lr = if lr.is_instance_of::<PyFloat>() || lr.is_instance_of::<PyInt>() {
            lr.extract::<f64>()?
        } else {
            self.spill(py, true)?; // (a tensor lr: the collector reads it)
            return Ok(false);
        };
        let Some((training, s)) = self.st.call.as_ref().map(|c| (c.training, c.stats)) else {
            self.spill(py, true)?;
            return Ok(false);
        };
        let mut facts = Vec::with_capacity(3);
        facts.push((Fact::Training, if training { 1.0 } else { 0.0 }));
        if let Some(a) = self.st.accumulated {
            facts.push((Fact::GradAccumulated, if a { 1.0 } else { 0.0 }));
        }
        let array = self.grads.bind(py).clone();
        if let Some(k) = self.clip {
            // HostReader.read_clipped: the same tensor at the same version is what the
            // backward produced; else (rescaled in place: clipping) it is read again.
            let before = array
                .readonly()
                .as_slice()?
                .get(k)
                .copied()
                .map_or(f64::NAN, f64::from);
            let same = match &self.st.clip_seen {
                Some((g, Some(v))) => match grad_of(&self.param(py, k)?)? {
                    Some(now) => now.is(g) && version(&now) == Some(*v),
                    None => false,
                },
                _ => false,
            };
            let after = if same {
                Some(before)
            } else {
                let p = self.param(py, k)?;
                self.reader
                    .borrow_mut(py)
                    .norm(&p, Some(intern!(py, "grad")))
            };
            let Some(after) = after else {
                self.spill(py, true)?;
                return Ok(false);
            };
            if let Some(r) = clip_ratio(before, after) {
                facts.push((Fact::ClipRatio, r));
            }
        }
        let step: u64 = c.getattr(intern!(py, "step"))?.extract()?;
        let inputs = s.map(|s| [s.0 as f32, s.1 as f32, s.2 as f32, s.3 as f32]);
        let grads_ro = array.readonly();
        let view = StepView {
            step,
            grad_norms: grads_ro.as_slice()?,
            weight_norms: None,
            activations: None,
            inputs: inputs.as_ref().map_or(&[], |i| i.as_slice()),
            loss: self.st.loss.as_ref().map(|l| l.1),
            lr: Some(lr),
            nonfinite_module: None,
            outputs_checked: false,
            facts: &facts,
            measures: &[],
        };
        let observed = self.engine.borrow_mut(py).observe_view(py, &view);
        drop(grads_ro);
        self.reset();
        let pending = match observed {
            Ok(p) => Some(p),
            Err(e) => {
                c.call_method1(intern!(py, "fail"), (e.into_value(py),))?;
                None
            }
        };
        self.taken += 1;
        self.armed = c
            .call_method1(intern!(py, "plain_done"), (pending, step))?
            .is_truthy()?;
        Ok(true)
    }
}

#[pymethods]
impl PlainStep {
    #[new]
    #[allow(clippy::too_many_arguments)]
    #[pyo3(signature = (host, reader, engine, params, grads, facts, sentinels, clip, tensor, grad_enabled, any_autocast))]
    fn new(
        host: Py<PyAny>,
        reader: Py<TensorReader>,
        engine: Py<PyEngine>,
        params: Py<PyList>,
        grads: Py<PyArrayDyn<f32>>,
        facts: Py<PyAny>,
        sentinels: Vec<usize>,
        clip: Option<usize>,
        tensor: Py<PyAny>,
        grad_enabled: Py<PyAny>,
        any_autocast: Py<PyAny>,
    ) -> Self {
        Self {
            host,
            reader,
            engine,
            params,
            grads,
            facts,
            sentinels,
            clip,
            tensor,
            grad_enabled,
            any_autocast,
            armed: false,
            st: SoFar::default(),
            taken: 0,
        }
    }

    /// The Python objects held (the collector holds this object: a cycle the garbage
    /// collector can break).
    fn __traverse__(&self, visit: PyVisit<'_>) -> Result<(), PyTraverseError> {
        visit.call(&self.host)?;
        visit.call(&self.reader)?;
        visit.call(&self.engine)?;
        visit.call(&self.params)?;
        visit.call(&self.grads)?;
        visit.call(&self.facts)?;
        if let Some(call) = &self.st.call {
            visit.call(&call.module)?;
            visit.call(&call.args)?;
            visit.call(&call.kwargs)?;
        }
        if let Some((t, _)) = &self.st.loss {
            visit.call(t)?;
        }
        Ok(())
    }

    /// Whether the coming step may be taken here (`on`), or not: what was seen of a step
    /// under way is then handed to the collector first.
    fn arm(&mut self, py: Python<'_>, on: bool) -> PyResult<()> {
        self.guard(py, (), |me, py| {
            if me.st.stage != Stage::Fresh {
                me.spill(py, true)?;
            }
            me.armed = on;
            Ok(())
        })
    }

    /// Steps observed here so far.
    #[getter]
    fn taken(&self) -> u64 {
        self.taken
    }

    /// The model's forward pre-hook (after the collector's compile check): True when taken
    /// here, False when the collector's own hook goes on (having been handed the step so
    /// far, if any).
    fn forward(
        &mut self,
        py: Python<'_>,
        module: &Bound<'_, PyAny>,
        args: &Bound<'_, PyAny>,
        kwargs: &Bound<'_, PyAny>,
    ) -> PyResult<bool> {
        if !self.armed {
            return Ok(false);
        }
        self.guard(py, true, |me, py| {
            me.forward_inner(py, module, args, kwargs)
        })
    }

    /// A backward starts (`Collector.on_backward`): True when it is this step's loss, taken
    /// here (the collector answers the tap with True, and hands its end to
    /// [`Self::after_backward`]).
    fn backward(&mut self, py: Python<'_>, tensors: &Bound<'_, PyAny>) -> PyResult<bool> {
        if !self.armed {
            return Ok(false);
        }
        // (An error answers False: `_fail` has stopped the collector, whose hook returns.)
        self.guard(py, false, |me, py| me.backward_inner(py, tensors))
    }

    /// The backward [`Self::backward`] took has returned: its gradients are read, or the
    /// collector is handed the step.
    fn after_backward(&mut self, py: Python<'_>) -> PyResult<()> {
        self.guard(py, (), PlainStep::after_inner)
    }

    /// The optimizer stepped (`StepBoundary.on_optimizer_step`): True when the step was
    /// observed here.
    fn step(&mut self, py: Python<'_>, optimizer: &Bound<'_, PyAny>) -> PyResult<bool> {
        if self.st.stage == Stage::Fresh {
            return Ok(false);
        }
        self.guard(py, true, |me, py| me.step_inner(py, optimizer))
    }
}
