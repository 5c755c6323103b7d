//! # neuraldbg-burn
//!
//! `NeuralDBG`, the causal debugger for deep-learning training, on a [burn](https://burn.dev)
//! training loop. Wrap the optimizer; the loop is otherwise unchanged, and after training
//! [`NeuralDbg::explain_failure`] says what failed, in which layer, from which step, why, and
//! what to change: the same engine, events, history, trace and HTML report as the `PyTorch`
//! package.
//!
//! ```
//! use burn::module::Module;
//! use burn::nn::{Linear, LinearConfig};
//! use burn::optim::{GradientsParams, SgdConfig};
//! use burn::tensor::{Device, Distribution, Tensor};
//! use neuraldbg_burn::{NeuralDbg, Options};
//!
//! #[derive(Module, Debug)]
//! struct Net {
//!     fc1: Linear,
//!     fc2: Linear,
//! }
//!
//! let device = Device::default().autodiff();
//! let mut model = Net {
//!     fc1: LinearConfig::new(4, 8).init(&device),
//!     fc2: LinearConfig::new(8, 1).init(&device),
//! };
//! // One line: the optimizer, watched.
//! let mut optim = NeuralDbg::new(Options::default())?.watch(SgdConfig::new().init());
//! for _ in 0..20 {
//!     let x = Tensor::<2>::random([16, 4], Distribution::Default, &device);
//!     let loss = model.fc2.forward(model.fc1.forward(x).tanh()).powi_scalar(2).mean();
//!     optim.record_loss(&loss); // optional: loss-level diagnosis (divergence, plateaus)
//!     let grads = GradientsParams::from_grads(loss.backward(), &model);
//!     model = optim.step(1e-2, model, grads); // the gradients are observed here
//! }
//! let dbg = optim.debugger();
//! assert_eq!(dbg.step(), 20);
//! assert!(dbg.explain_failure(None).iter().all(|h| h.confidence < 0.5)); // a healthy run
//! let (steps, norms) = dbg.history(Some("fc1"), "grad_norm")?;
//! assert_eq!((steps.len(), norms.len()), (20, 20));
//! # Ok::<(), neuraldbg_burn::Error>(())
//! ```
//!
//! What is observed, at each [`WatchedOptimizer::step`] (one optimizer step is one step, the
//! first is step 0):
//!
//! - the L2 norm of every trainable parameter's gradient, from the [`GradientsParams`] the step
//!   receives (before the optimizer's gradient clipping), named by module path (`blocks.3.fc`);
//! - on the first `dense_steps` steps and every `weight_every`-th after, every parameter's
//!   norm;
//! - the loss given to [`WatchedOptimizer::record_loss`] and the batch given to
//!   [`WatchedOptimizer::record_input`], when the loop gives them;
//! - the learning rate the step applies.
//!
//! The norms are reduced on the tensors' device and concatenated there with the loss and input
//! statistics, so a step costs one device-to-host transfer of a few floats per parameter.
//!
//! Activation statistics (saturated tanh units, dead `ReLU`s) are not observed: burn has no
//! forward hooks, and its activations are usually functions (`tensor.tanh()`), not modules.
//!
//! The module walk lists modules children first, in the order of their fields: declare a model's
//! fields in the order `forward` uses them (as most burn models do), since the engine reads
//! that as the forward order that locates a failure's root layer.
//!
//! ## With burn's `Learner`
//!
//! The `Learner` owns its `ModuleOptimizer`, so it cannot be handed a [`WatchedOptimizer`].
//! Override `TrainStep::optimize` instead and call [`NeuralDbg::observe`] with the same
//! module, gradients and learning rate before stepping (keep the debugger in an
//! `Arc<Mutex<NeuralDbg>>` shared with the code that reads the diagnosis).
//!
//! ## Versions
//!
//! Built for burn 0.22 (`burn = "0.22.1"`, default features off: `std` and `optim`; the backend
//! is the application's choice). The adapter uses burn's module walk ([`ModuleVisitor`]),
//! [`GradientsParams::get`], [`ModuleOptimizer::step`] and float tensor reductions; moving to a
//! newer burn means bumping the workspace's `burn` requirement and following those four in its
//! changelog.
//!
//! [`ModuleVisitor`]: burn::module::ModuleVisitor
#![forbid(unsafe_code)]

mod layout;

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use burn::module::{Module, ModuleVisitor, Param, ParamId};
use burn::optim::lr_scheduler::module_lr_scheduler::ModuleLearningRate;
use burn::optim::{GradientsParams, ModuleOptimizer};
use burn::tensor::{DType, Device, FloatDType, Tensor};
use neuraldbg_core::analysis::Analysis;
use neuraldbg_core::trace::{TraceError, TraceWriter, WriterOptions};
use neuraldbg_core::{
    CausalHypothesis, Config, Coupling, Engine, EngineError, Failure, INPUT_STATS, Observation,
    Reduce, RootCause, SemanticEvent,
};

use layout::Layout;

pub use neuraldbg_core;

/// What can go wrong while watching a run.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A bad option, or the engine refused the model or a step.
    #[error(transparent)]
    Engine(#[from] EngineError),
    /// The trace could not be created or written.
    #[error(transparent)]
    Trace(#[from] TraceError),
    /// The step's statistics could not be read back from the device.
    #[error("cannot read the step's statistics from the device: {0}")]
    Read(String),
    /// The report could not be written.
    #[error("cannot write the report {}: {source}", path.display())]
    Report {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
}

/// How a run is watched. Every field has a default; build with [`Options::default`] and the
/// setters.
///
/// ```
/// use neuraldbg_burn::Options;
///
/// let options = Options::default()
///     .threshold_vanishing(1e-7)
///     .optimizer("Adam")
///     .trace("runs/train.ndbg");
/// assert_eq!(options.config.threshold_vanishing, 1e-7);
/// ```
#[derive(Clone, Debug)]
pub struct Options {
    /// The engine's settings: the seed's thresholds and event detection.
    pub config: Config,
    /// Where to record the run (`neuraldbg explain PATH` reads it, also after a crash).
    pub trace: Option<PathBuf>,
    /// Steps at the start whose parameter norms are always measured.
    pub dense_steps: u64,
    /// Parameter norms every this many steps after `dense_steps` (at least 1).
    pub weight_every: u64,
    /// The optimizer's family (`"Adam"`, `"SGD"`): adaptive optimizers move every weight by about
    /// the learning rate, which changes how a learning-rate cause is judged. burn's
    /// `ModuleOptimizer` does not say which it is.
    pub optimizer: Option<String>,
}

impl Default for Options {
    fn default() -> Self {
        Self {
            config: Config::default(),
            trace: None,
            dense_steps: 10,
            weight_every: 10,
            optimizer: None,
        }
    }
}

impl Options {
    /// A layer gradient norm below this is VANISHING (seed: 1e-6).
    #[must_use]
    pub fn threshold_vanishing(mut self, value: f64) -> Self {
        self.config.threshold_vanishing = value;
        self
    }

    /// A layer gradient norm above this is EXPLODING (seed: 1e3).
    #[must_use]
    pub fn threshold_exploding(mut self, value: f64) -> Self {
        self.config.threshold_exploding = value;
        self
    }

    /// A layer gradient norm above this (and not exploding) is SATURATED, a warning (seed: 1.0).
    #[must_use]
    pub fn threshold_saturated(mut self, value: f64) -> Self {
        self.config.threshold_saturated = value;
        self
    }

    /// Records the run to a trace file (missing directories are created, an existing file is
    /// replaced).
    #[must_use]
    pub fn trace(mut self, path: impl Into<PathBuf>) -> Self {
        self.trace = Some(path.into());
        self
    }

    /// The optimizer's family, e.g. `"Adam"` or `"SGD"`.
    #[must_use]
    pub fn optimizer(mut self, name: impl Into<String>) -> Self {
        self.optimizer = Some(name.into());
        self
    }
}

/// The debugger of one burn training run: collects each step's statistics, feeds the engine
/// and answers its questions. Usually reached through [`WatchedOptimizer::debugger`].
#[derive(Debug)]
pub struct NeuralDbg {
    engine: Engine,
    options: Options,
    writer: Option<TraceWriter>,
    layout: Option<Layout>,
    step: u64,
    losses: Vec<Tensor<1>>,
    inputs: Vec<Tensor<1>>,
    /// The first failure: of the observation (which then stopped) or of the trace (which
    /// then stopped, the observation going on).
    error: Option<Error>,
    stopped: bool,
}

impl NeuralDbg {
    /// A debugger with these options; creates the trace file now, if one is asked for.
    pub fn new(options: Options) -> Result<Self, Error> {
        if options.weight_every == 0 {
            return Err(EngineError::Config(neuraldbg_core::ConfigError::TooSmall {
                name: "weight_every",
                value: 0.0,
                min: 1.0,
            })
            .into());
        }
        let engine = Engine::new(options.config.clone())?;
        let writer = options
            .trace
            .as_ref()
            .map(|path| TraceWriter::create(path, trace_meta(), WriterOptions::default()))
            .transpose()?;
        Ok(Self {
            engine,
            options,
            writer,
            layout: None,
            step: 0,
            losses: Vec::new(),
            inputs: Vec::new(),
            error: None,
            stopped: false,
        })
    }

    /// Wraps `optimizer` so that each of its steps is observed.
    pub fn watch(self, optimizer: ModuleOptimizer) -> WatchedOptimizer {
        WatchedOptimizer {
            inner: optimizer,
            dbg: self,
        }
    }

    /// Observes one optimizer step about to be taken on `module` with `grads` at learning rate
    /// `lr`, and counts it. [`WatchedOptimizer::step`] calls this; call it yourself where the
    /// optimizer is not yours to wrap (burn's `Learner`: in `TrainStep::optimize`).
    ///
    /// The first call reads the model's layout. A failure (the engine refuses the step, the
    /// statistics cannot be read back) is kept in [`Self::error`] and stops the observation;
    /// training is never interrupted.
    pub fn observe<M: Module>(&mut self, module: &M, grads: &GradientsParams, lr: Option<f64>) {
        let step = self.step;
        self.step += 1;
        let losses = std::mem::take(&mut self.losses);
        let inputs = std::mem::take(&mut self.inputs);
        if self.stopped {
            return;
        }
        if let Err(e) = self.observe_inner(step, module, grads, lr, losses, inputs) {
            self.stopped = true;
            self.error.get_or_insert(e);
        }
    }

    fn observe_inner<M: Module>(
        &mut self,
        step: u64,
        module: &M,
        grads: &GradientsParams,
        lr: Option<f64>,
        losses: Vec<Tensor<1>>,
        inputs: Vec<Tensor<1>>,
    ) -> Result<(), Error> {
        if self.layout.is_none() {
            let mut layout = Layout::of(module);
            layout.spec.optimizer.clone_from(&self.options.optimizer);
            self.engine.register_model(layout.spec.clone())?;
            if let Some(w) = self.writer.as_mut()
                && let Err(e) = w.write_header(self.engine.config(), &layout.spec)
            {
                self.writer = None;
                self.error.get_or_insert(e.into());
            }
            self.layout = Some(layout);
        }
        let n_params = self.layout.as_ref().map_or(0, |l| l.position.len());
        let weights =
            step < self.options.dense_steps || step.is_multiple_of(self.options.weight_every);

        // Everything reduced on the device, concatenated, and read back once.
        let layout = self.layout.as_ref().expect("registered above");
        let mut stats = Stats {
            grads,
            weights,
            position: &layout.position,
            grad_parts: vec![None; n_params],
            weight_parts: vec![None; if weights { n_params } else { 0 }],
            unknown: 0,
        };
        module.visit(&mut stats);
        let Stats {
            grad_parts,
            weight_parts,
            unknown,
            ..
        } = stats;
        let missing_weights = weight_parts.iter().filter(|w| w.is_none()).count();
        if unknown > 0 || missing_weights > 0 {
            return Err(Error::Engine(EngineError::Model(format!(
                "the module stepped has {unknown} trainable parameters the watched model did not have, and lacks {missing_weights} it had: a watched optimizer serves one model"
            ))));
        }
        let grad_present: Vec<bool> = grad_parts.iter().map(Option::is_some).collect();
        let grads: Vec<Tensor<1>> = grad_parts.into_iter().flatten().collect();
        let weights: Vec<Tensor<1>> = weight_parts.into_iter().flatten().collect();
        let n_losses = losses.len();
        let n_inputs = inputs.len();
        let mut parts: Vec<Tensor<1>> = grads.iter().chain(&weights).map(sum_of_squares).collect();
        parts.extend(losses);
        parts.extend(inputs);
        // Host layout: [sum of squares of each present gradient...], then, when sampled,
        // [sum of squares of each parameter...], then the losses, then the input rows.
        let host = read_back(parts)?;
        let (sums, rest) = host.split_at(grads.len() + weights.len());
        let norms = norms_of(&grads, &weights, sums)?;
        let mut present = norms[..grads.len()].iter();
        let grad_norms: Vec<f32> = grad_present
            .iter()
            .map(|&p| {
                if p {
                    *present.next().expect("one per gradient")
                } else {
                    -1.0
                }
            })
            .collect();
        let weight_norms = (!weights.is_empty()).then(|| norms[grads.len()..].to_vec());
        let (losses, inputs) = rest.split_at(n_losses);
        let loss = (n_losses > 0)
            .then(|| losses.iter().map(|&l| f64::from(l)).sum::<f64>() / n_losses as f64);
        debug_assert_eq!(inputs.len(), n_inputs * INPUT_STATS);
        let inputs = inputs.to_vec();
        let observation = Observation {
            step,
            grad_norms,
            weight_norms,
            inputs,
            loss,
            lr,
            ..Observation::default()
        };
        self.engine.observe(&observation.view())?;
        // A trace that cannot be written stops, and the live diagnosis goes on (as in Python).
        if let Some(w) = self.writer.as_mut()
            && let Err(e) = w.write_step(&observation.view())
        {
            self.writer = None;
            self.error.get_or_insert(e.into());
        }
        Ok(())
    }

    /// Queues this step's loss; it travels with the step's other statistics (no extra
    /// transfer). Several calls in one step (gradient accumulation) are averaged.
    pub fn record_loss<const D: usize>(&mut self, loss: &Tensor<D>) {
        self.losses
            .push(to_f32(loss.clone().inner()).mean().reshape([1]));
    }

    /// Queues `min, max, mean, std` of this step's input batch: the engine flags batches with
    /// NaN/Inf or 100x off the usual scale, and names bad input data as a cause.
    pub fn record_input<const D: usize>(&mut self, batch: &Tensor<D>) {
        let x = to_f32(batch.clone().inner()).reshape([-1]);
        let n = x.dims()[0];
        let mean = x.clone().mean();
        // Population standard deviation (divided by n), as the PyTorch collector measures it.
        let var = (x.clone() - mean.clone())
            .square()
            .sum()
            .div_scalar(n.max(1) as f64);
        self.inputs.push(Tensor::cat(
            vec![x.clone().min(), x.max(), mean, var.sqrt()],
            0,
        ));
    }

    /// Completed optimizer steps (0 before the first).
    pub fn step(&self) -> u64 {
        self.step
    }

    /// The first failure, if any: of the observation (which then stopped) or of the trace
    /// (which then stopped while the observation went on).
    pub fn error(&self) -> Option<&Error> {
        self.error.as_ref()
    }

    /// The engine, for everything this type does not wrap.
    pub fn engine(&self) -> &Engine {
        &self.engine
    }

    /// The semantic events, in step order.
    pub fn events(&self) -> Vec<SemanticEvent> {
        self.engine.events()
    }

    /// Causal hypotheses, most likely first; with `only`, those explaining that failure. A
    /// healthy run has none with confidence 0.5 or more.
    pub fn explain_failure(&self, only: Option<Failure>) -> Vec<CausalHypothesis> {
        Analysis::new(&self.engine).map_or_else(Vec::new, |a| a.hypotheses(only))
    }

    /// The root cause of each failure the run shows.
    pub fn get_root_causes(&self) -> Vec<RootCause> {
        Analysis::new(&self.engine).map_or_else(Vec::new, |a| a.root_causes())
    }

    /// Failures that occur together within `window` steps.
    pub fn detect_coupled_failures(&self, window: u64) -> Vec<Coupling> {
        Analysis::new(&self.engine).map_or_else(Vec::new, |a| a.couplings(window))
    }

    /// The events leading to a failure, in causal order.
    pub fn trace_causal_chain(&self, failure: Failure) -> Vec<SemanticEvent> {
        Analysis::new(&self.engine).map_or_else(Vec::new, |a| a.causal_chain(failure))
    }

    /// The causal graph as a Mermaid flowchart.
    pub fn export_mermaid_causal_graph(&self) -> String {
        neuraldbg_core::analysis::mermaid(&self.engine)
    }

    /// `(steps, values)` of a metric for plotting: `layer` is a module path (`"blocks.3.fc"`)
    /// with `grad_norm` or `weight_norm`, or None for the run-wide `grad_norm`, `loss`, `lr`.
    /// One value per step until the history's buckets fill; then each bucket's last value (see
    /// [`Engine::history`] for the minimum or maximum).
    pub fn history(
        &self,
        layer: Option<&str>,
        metric: &str,
    ) -> Result<(Vec<u64>, Vec<f64>), Error> {
        Ok(self.engine.history(layer, metric, Reduce::Last)?)
    }

    /// The self-contained HTML report (verdict, gradient heatmap, curves, events, causal graph).
    pub fn report_html(&self, title: &str) -> String {
        neuraldbg_core::report::render_html(&self.engine, title)
    }

    /// Writes [`Self::report_html`] to `path`.
    pub fn save_report(&self, path: impl AsRef<Path>) -> Result<(), Error> {
        let path = path.as_ref();
        let title = path
            .file_stem()
            .map_or_else(|| "NeuralDBG".into(), |s| s.to_string_lossy().into_owned());
        std::fs::write(path, self.report_html(&title)).map_err(|source| Error::Report {
            path: path.to_path_buf(),
            source,
        })
    }

    /// Closes the trace (it is also closed on drop); returns the first failure of the run, if
    /// any, so that a run whose observation stopped does not pass unnoticed.
    pub fn close(&mut self) -> Result<(), Error> {
        if let Some(mut w) = self.writer.take() {
            w.close()?;
        }
        match self.error.take() {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }
}

/// A burn optimizer whose steps are observed: use it where the `ModuleOptimizer` was used.
pub struct WatchedOptimizer {
    inner: ModuleOptimizer,
    dbg: NeuralDbg,
}

impl std::fmt::Debug for WatchedOptimizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("WatchedOptimizer")
            .field("dbg", &self.dbg)
            .finish_non_exhaustive()
    }
}

impl WatchedOptimizer {
    /// Observes the step (gradient norms before clipping, the learning rate, the queued loss
    /// and inputs), then lets the optimizer update `module` exactly as it would unwatched.
    pub fn step<M: Module>(
        &mut self,
        lr: impl Into<ModuleLearningRate>,
        module: M,
        grads: GradientsParams,
    ) -> M {
        let lr = lr.into();
        self.dbg.observe(&module, &grads, Some(lr.base()));
        self.inner.step(lr, module, grads)
    }

    /// See [`NeuralDbg::record_loss`].
    pub fn record_loss<const D: usize>(&mut self, loss: &Tensor<D>) {
        self.dbg.record_loss(loss);
    }

    /// See [`NeuralDbg::record_input`].
    pub fn record_input<const D: usize>(&mut self, batch: &Tensor<D>) {
        self.dbg.record_input(batch);
    }

    pub fn debugger(&self) -> &NeuralDbg {
        &self.dbg
    }

    pub fn debugger_mut(&mut self) -> &mut NeuralDbg {
        &mut self.dbg
    }

    /// The wrapped optimizer (to save its state, for instance).
    pub fn optimizer(&self) -> &ModuleOptimizer {
        &self.inner
    }

    pub fn into_parts(self) -> (ModuleOptimizer, NeuralDbg) {
        (self.inner, self.dbg)
    }
}

/// Header metadata of a trace written from burn.
fn trace_meta() -> serde_json::Map<String, serde_json::Value> {
    let mut meta = serde_json::Map::new();
    meta.insert(
        "producer".into(),
        format!("neuraldbg {} (burn)", env!("CARGO_PKG_VERSION")).into(),
    );
    meta.insert("burn".into(), "0.22".into());
    if let Ok(t) = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH) {
        meta.insert("started".into(), t.as_secs_f64().into());
    }
    meta
}

/// Half-precision statistics would overflow at 65504: reduce in f32.
fn to_f32<const D: usize>(t: Tensor<D>) -> Tensor<D> {
    match t.dtype() {
        DType::F32 => t,
        _ => t.cast(FloatDType::F32),
    }
}

fn sum_of_squares(t: &Tensor<1>) -> Tensor<1> {
    t.clone().square().sum()
}

/// L2 norms from sums of squares taken in f32. A sum that overflowed (a norm above ~1.8e19,
/// long after a gradient explosion began) is taken again in f64, in a second transfer on that
/// step only, so that a large finite gradient is not mistaken for an infinite one.
fn norms_of(grads: &[Tensor<1>], weights: &[Tensor<1>], sums: &[f32]) -> Result<Vec<f32>, Error> {
    let mut norms: Vec<f32> = sums.iter().map(|s| s.sqrt()).collect();
    let overflowed: Vec<usize> = (0..sums.len())
        .filter(|&i| sums[i] == f32::INFINITY)
        .collect();
    if overflowed.is_empty() {
        return Ok(norms);
    }
    let tensor = |i: usize| {
        if i < grads.len() {
            &grads[i]
        } else {
            &weights[i - grads.len()]
        }
    };
    let parts: Vec<Tensor<1>> = overflowed
        .iter()
        .map(|&i| tensor(i).clone().cast(FloatDType::F64).square().sum())
        .collect();
    let device = parts[0].device();
    let parts = parts.into_iter().map(|p| p.to_device(&device)).collect();
    let wide = Tensor::cat(parts, 0)
        .try_into_vec_as::<f64>()
        .map_err(|e| Error::Read(e.to_string()))?;
    for (&i, s) in overflowed.iter().zip(wide) {
        // Still infinite in f64: the gradient holds an infinity. Finite: clamp to f32's range.
        norms[i] = if s.is_finite() {
            s.sqrt().min(f64::from(f32::MAX)) as f32
        } else {
            f32::INFINITY
        };
    }
    Ok(norms)
}

/// Concatenates the step's reductions on the device and reads them back in one transfer.
fn read_back(parts: Vec<Tensor<1>>) -> Result<Vec<f32>, Error> {
    let Some(first) = parts.first() else {
        return Ok(Vec::new());
    };
    let device: Device = first.device();
    let parts: Vec<Tensor<1>> = parts
        .into_iter()
        .map(|p| {
            if p.device() == device {
                p
            } else {
                p.to_device(&device)
            }
        })
        .collect();
    Tensor::cat(parts, 0)
        .try_into_vec_as::<f32>()
        .map_err(|e| Error::Read(e.to_string()))
}

/// Walks the module and collects, for each trainable parameter (in the engine's order), its
/// gradient and, on sampled steps, its value, flattened (views, no copies).
struct Stats<'a> {
    grads: &'a GradientsParams,
    weights: bool,
    position: &'a HashMap<ParamId, usize>,
    grad_parts: Vec<Option<Tensor<1>>>,
    weight_parts: Vec<Option<Tensor<1>>>,
    /// Trainable parameters the watched model did not have.
    unknown: usize,
}

impl ModuleVisitor for Stats<'_> {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
        if !param.is_require_grad() {
            return;
        }
        let Some(&i) = self.position.get(&param.id) else {
            self.unknown += 1;
            return;
        };
        if let Some(g) = self.grads.get::<D>(param.id) {
            self.grad_parts[i] = Some(to_f32(g).reshape([-1]));
        }
        if self.weights {
            self.weight_parts[i] = Some(to_f32(param.val().inner()).reshape([-1]));
        }
    }
}
