//! The engine: consumes one [`StepView`] per training step, keeps trackers and bounded history,
//! and emits [`SemanticEvent`]s on confirmed transitions. Analysis ([`crate::analysis`]) reads
//! its state on demand.

use crate::config::Config;
use crate::detector::Transition;
use crate::error::EngineError;
use crate::event::{EventType, SemanticEvent, Subject, event_confidence};
use crate::health::{
    ActivationHealth, ActivationSample, DataHealth, GradientHealth, OutputHealth, State,
};
use crate::history::{History, Reduce};
use crate::model::{ActivationProbe, FirstBatch, Model, ModelSpec};
use crate::observation::{ACTIVATION_STATS, Axis, Fact, INPUT_STATS, Measure, StepView};
use crate::replica::ReplicaTrack;
use crate::track::{ActTrack, DataTrack, Early, LayerTrack, LoopFacts, LossOnWeights, LossTrack};
use crate::training_loop::LoopTrack;

/// History metrics of a layer (a module owning parameters), for [`Engine::history`].
pub const LAYER_METRICS: [&str; 2] = ["grad_norm", "weight_norm"];
/// History metrics of an activation module.
pub const ACTIVATION_METRICS: [&str; 3] =
    ["saturated_fraction", "dead_fraction", "activation_absmax"];
/// Run-wide history metrics (`name` None).
pub const RUN_METRICS: [&str; 4] = ["grad_norm", "loss", "lr", "input_scale"];

/// A rank number carried in an f32 array (NaN or negative: none).
fn rank_of(r: f32) -> Option<u32> {
    // Ranks are small whole numbers carried exactly by f32.
    #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]
    (0.0..1e9).contains(&r).then_some(r as u32)
}

/// Global series stored after the per-layer ones in the gradient history.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Global {
    TotalGradNorm = 0,
    Loss = 1,
    Lr = 2,
    InputScale = 3,
}
const GLOBALS: usize = 4;

/// Everything observed for a registered model.
#[derive(Debug)]
pub(crate) struct Run {
    pub model: Model,
    pub layers: Vec<LayerTrack>,
    pub acts: Vec<ActTrack>,
    pub loss: LossTrack,
    pub data: DataTrack,
    pub output: OutputHealth,
    /// Whether a data-parallel job's replicas still match (distributed collectors only).
    pub replica: ReplicaTrack,
    /// Steps with NaN/Inf gradients or loss whose module outputs were all checked finite: the
    /// value was born in the loss computation or the backward pass (first few kept).
    pub finite_forward: Vec<u64>,
    pub events: Vec<SemanticEvent>,
    /// Events stored per module and event type, to cap a misbehaving layer's share.
    event_counts: Vec<[u32; 2]>,
    pub suppressed_events: u64,
    pub grads: History,
    pub weights: History,
    pub activations: History,
    pub steps_observed: u64,
    pub first_step: Option<u64>,
    pub last_step: Option<u64>,
    /// The first learning rate above zero (a warmup from zero starts at 0: its first step
    /// moves nothing, and "it was 0" says nothing of the rate the run trains with).
    pub lr_first: Option<f64>,
    /// The learning rate's course: its peak, its latest value, and where it fell far below
    /// the peak ([`LrCourse`]).
    pub lr_course: LrCourse,
    pub total_early: Early,
    /// Steps whose gradients or loss were not all finite.
    pub nonfinite_steps: u64,
    /// Largest total gradient norm (and its step) before anything went non-finite.
    pub total_peak: Option<(f64, u64)>,
    /// Skipped optimizer steps, loss scale and clipping (facts from the training loop).
    pub loop_track: LoopTrack,
    /// The first measured scale of each module's output (largest magnitude, per module; NaN
    /// where not measured) and its step.
    pub outputs_first: Option<(u64, Vec<f32>)>,
    /// Facts about the training loop (training mode, gradient accumulation), counted.
    pub loop_facts: LoopFacts,
    /// The loss against the weights' squared norm, at the steps both were measured.
    pub loss_on_weights: LossOnWeights,
    sums: Vec<f64>,
    present: Vec<bool>,
    /// Gradient transitions confirmed during the current step (reused buffer).
    fired: Vec<(usize, Transition<GradientHealth>)>,
}

/// The `NeuralDBG` engine.
#[derive(Debug)]
pub struct Engine {
    config: Config,
    run: Option<Run>,
}

impl Engine {
    /// An engine with a validated configuration.
    pub fn new(config: Config) -> Result<Self, EngineError> {
        config.validate()?;
        Ok(Self { config, run: None })
    }

    pub fn config(&self) -> &Config {
        &self.config
    }

    /// Registers the watched model; returns what to measure on each activation module.
    pub fn register_model(&mut self, spec: ModelSpec) -> Result<Vec<ActivationProbe>, EngineError> {
        if self.run.is_some() {
            return Err(EngineError::ModelAlreadyRegistered);
        }
        let model = Model::new(spec)?;
        let probes = model.probes(self.config.activation_saturation_band);
        let n_layers = model.layers.len();
        let n_acts = model.activations.len();
        let cap = history_capacity(&self.config, n_layers + GLOBALS + n_layers + 3 * n_acts);
        self.run = Some(Run {
            layers: vec![LayerTrack::default(); n_layers],
            acts: vec![ActTrack::default(); n_acts],
            loss: LossTrack::default(),
            data: DataTrack::default(),
            output: OutputHealth::Finite,
            replica: ReplicaTrack::default(),
            finite_forward: Vec::new(),
            events: Vec::new(),
            event_counts: vec![[0; 2]; model.spec.modules.len()],
            suppressed_events: 0,
            grads: History::new(n_layers + GLOBALS, cap),
            weights: History::new(n_layers, cap),
            activations: History::new(n_acts * 3, cap),
            steps_observed: 0,
            first_step: None,
            last_step: None,
            lr_first: None,
            lr_course: LrCourse::default(),
            total_early: Early::default(),
            nonfinite_steps: 0,
            total_peak: None,
            loop_track: LoopTrack::default(),
            loop_facts: LoopFacts::default(),
            loss_on_weights: LossOnWeights::default(),
            outputs_first: None,
            sums: vec![0.0; n_layers],
            present: vec![false; n_layers],
            fired: Vec::new(),
            model,
        });
        Ok(probes)
    }

    /// Another optimizer was seen stepping the model after it was registered: merges its
    /// per-parameter lrs into the model's ([`ModelSpec::merge_param_lr`]; `lrs` None: its lrs
    /// cannot be read). Returns whether the model's facts changed. A trace records the call
    /// ([`crate::trace::TraceWriter::write_param_lr`]) and its replay makes it again.
    pub fn amend_param_lr(&mut self, lrs: Option<&[Option<f64>]>) -> Result<bool, EngineError> {
        let run = self.run.as_mut().ok_or(EngineError::NoModel)?;
        run.model.spec.merge_param_lr(lrs)
    }

    /// The first training batch's facts, read by a collector that had to register the model
    /// before it ran (the Keras callback): fills those the model lacks
    /// ([`ModelSpec::merge_first_batch`]). Returns whether the model's facts changed. A trace
    /// records the call ([`crate::trace::TraceWriter::write_first_batch`]) and its replay makes
    /// it again.
    pub fn amend_first_batch(&mut self, facts: &FirstBatch) -> Result<bool, EngineError> {
        let run = self.run.as_mut().ok_or(EngineError::NoModel)?;
        run.model.spec.merge_first_batch(facts)
    }

    /// The registered model, if any.
    pub fn model(&self) -> Option<&Model> {
        self.run.as_ref().map(|r| &r.model)
    }

    pub(crate) fn run(&self) -> Option<&Run> {
        self.run.as_ref()
    }

    /// Whether some activation module shows a new state not yet confirmed: a collector that
    /// samples activations should measure the next steps densely, so that the change is
    /// confirmed (or dismissed) within `persistence` steps instead of `persistence` samples.
    pub fn activation_pending(&self) -> bool {
        self.run
            .as_ref()
            .is_some_and(|r| r.acts.iter().any(|a| a.detector.pending()))
    }

    /// Number of steps observed so far.
    pub fn steps_observed(&self) -> u64 {
        self.run.as_ref().map_or(0, |r| r.steps_observed)
    }

    /// The last observed step.
    pub fn last_step(&self) -> Option<u64> {
        self.run.as_ref().and_then(|r| r.last_step)
    }

    /// Number of events so far: a cheap way for a collector to notice that something new was
    /// confirmed (and only then ask for the analysis).
    pub fn event_count(&self) -> usize {
        self.run.as_ref().map_or(0, |r| r.events.len())
    }

    /// Events in step order (ties: in the order they were confirmed).
    pub fn events(&self) -> Vec<SemanticEvent> {
        let mut events = self
            .run
            .as_ref()
            .map(|r| r.events.clone())
            .unwrap_or_default();
        events.sort_by_key(|e| e.step);
        events
    }

    /// Name of the subject of an event: a qualified module name (`""` for the root module),
    /// [`Subject::INPUT_NAME`] or [`Subject::LOSS_NAME`].
    pub fn subject_name(&self, subject: Subject) -> String {
        match (subject, self.model()) {
            (Subject::Module(m), Some(model)) if m < model.spec.modules.len() => {
                model.spec.modules[m].name.clone()
            }
            (Subject::Module(m), _) => format!("(module {m})"),
            (Subject::Input, _) => Subject::INPUT_NAME.into(),
            (Subject::Loss, _) => Subject::LOSS_NAME.into(),
        }
    }

    /// Feeds one step.
    pub fn observe(&mut self, view: &StepView<'_>) -> Result<(), EngineError> {
        let config = &self.config;
        let run = self.run.as_mut().ok_or(EngineError::NoModel)?;
        run.check(view)?;
        run.observe(view, config);
        Ok(())
    }

    /// A series for plotting: `(steps, values)`. `name` is a layer or activation module's
    /// qualified name, or None for run-wide series. Metrics: `grad_norm`, `weight_norm` (layers);
    /// `saturated_fraction`, `dead_fraction`, `activation_absmax` (activations); `loss`, `lr`,
    /// `grad_norm` (total), `input_scale` (run-wide).
    pub fn history(
        &self,
        name: Option<&str>,
        metric: &str,
        reduce: Reduce,
    ) -> Result<(Vec<u64>, Vec<f64>), EngineError> {
        let unknown_metric = |expected: &str| EngineError::Unknown {
            what: "metric",
            name: metric.to_string(),
            expected: expected.to_string(),
        };
        let Some(name) = name else {
            let g = match metric {
                "grad_norm" => Global::TotalGradNorm,
                "loss" => Global::Loss,
                "lr" => Global::Lr,
                "input_scale" => Global::InputScale,
                _ => return Err(unknown_metric(&RUN_METRICS.join(", "))),
            };
            // A run that observed no step has an empty run-wide history.
            return Ok(self.run.as_ref().map_or_else(
                || (Vec::new(), Vec::new()),
                |run| run.grads.read(run.global_series(g), reduce),
            ));
        };
        let run = self.run.as_ref().ok_or(EngineError::NoModel)?;
        let model = &run.model;
        let module = model
            .module_index(name)
            .ok_or_else(|| EngineError::Unknown {
                what: "layer",
                name: name.to_string(),
                expected: candidates(name, model.spec.modules.iter().map(|m| m.name.as_str())),
            })?;
        match metric {
            "grad_norm" | "weight_norm" => {
                let (layer, _tied) =
                    model
                        .layer_of_module(module)
                        .ok_or_else(|| EngineError::Unknown {
                            what: "layer with parameters",
                            name: name.to_string(),
                            expected: candidates(
                                name,
                                model.layers.iter().map(|l| l.name.as_str()),
                            ),
                        })?;
                Ok(if metric == "grad_norm" {
                    run.grads.read(layer, reduce)
                } else {
                    run.weights.read(layer, reduce)
                })
            }
            "saturated_fraction" | "dead_fraction" | "activation_absmax" => {
                let a = model.module_activation[module].ok_or_else(|| EngineError::Unknown {
                    what: "activation module",
                    name: name.to_string(),
                    expected: candidates(name, model.activations.iter().map(|a| a.name.as_str())),
                })?;
                let offset = match metric {
                    "saturated_fraction" => 0,
                    "dead_fraction" => 1,
                    _ => 2,
                };
                Ok(run.activations.read(3 * a + offset, reduce))
            }
            _ => Err(unknown_metric(
                &[&LAYER_METRICS[..], &ACTIVATION_METRICS[..]]
                    .concat()
                    .join(", "),
            )),
        }
    }

    /// Bytes reserved by the histories (at most `history_max_bytes`, plus one bucket's steps).
    pub fn history_bytes(&self) -> usize {
        self.run.as_ref().map_or(0, |r| {
            r.grads.heap_bytes() + r.weights.heap_bytes() + r.activations.heap_bytes()
        })
    }

    /// Bytes held by histories and events (for memory accounting).
    pub fn heap_bytes(&self) -> usize {
        self.run.as_ref().map_or(0, |r| {
            self.history_bytes()
                + r.events.capacity() * std::mem::size_of::<SemanticEvent>()
                + r.layers.capacity() * std::mem::size_of::<LayerTrack>()
                + r.acts.capacity() * std::mem::size_of::<ActTrack>()
        })
    }
}

/// Buckets per history: `history_capacity`, fewer when the model is so large that all its
/// series together would exceed `history_max_bytes`.
fn history_capacity(config: &Config, series: usize) -> usize {
    let per_bucket = series * History::CELL_BYTES + std::mem::size_of::<u64>();
    let fit = config.history_max_bytes / per_bucket.max(1);
    config.history_capacity.min(fit).max(16)
}

/// The names closest to an unknown `name` first (the same name under a wrapper such as DDP's
/// `module.`, then names containing it), then the others, as a short list.
fn candidates<'a>(name: &str, names: impl Iterator<Item = &'a str>) -> String {
    let dotted = format!(".{name}");
    let rank = |n: &str| {
        if n.ends_with(&dotted) {
            0
        } else if !name.is_empty() && n.contains(name) {
            1
        } else {
            2
        }
    };
    let mut names: Vec<&str> = names.filter(|n| !n.is_empty()).collect();
    names.sort_by_key(|n| rank(n));
    short_list(names.into_iter())
}

fn short_list<'a>(names: impl Iterator<Item = &'a str>) -> String {
    let names: Vec<&str> = names.collect();
    let shown: Vec<String> = names.iter().take(8).map(|n| format!("{n:?}")).collect();
    if names.len() > 8 {
        format!("{}, ... ({} in all)", shown.join(", "), names.len())
    } else {
        shown.join(", ")
    }
}

impl Run {
    fn check(&self, v: &StepView<'_>) -> Result<(), EngineError> {
        if let Some(last) = self.last_step {
            if v.step <= last {
                return Err(EngineError::StepOrder { step: v.step, last });
            }
        }
        let n_params = self.model.spec.params.len();
        if v.grad_norms.len() != n_params {
            return Err(EngineError::Length {
                what: "grad_norms",
                got: v.grad_norms.len(),
                expected: n_params,
            });
        }
        if let Some(w) = v.weight_norms {
            if w.len() != n_params {
                return Err(EngineError::Length {
                    what: "weight_norms",
                    got: w.len(),
                    expected: n_params,
                });
            }
        }
        if let Some(a) = v.activations {
            let expected = self.model.activations.len() * ACTIVATION_STATS;
            if a.len() != expected {
                return Err(EngineError::Length {
                    what: "activations",
                    got: a.len(),
                    expected,
                });
            }
        }
        for (k, (fact, _)) in v.facts.iter().enumerate() {
            if v.facts[..k].iter().any(|(f, _)| f == fact) {
                return Err(EngineError::Duplicate {
                    what: "fact",
                    name: fact.as_str(),
                });
            }
        }
        for (k, (measure, values)) in v.measures.iter().enumerate() {
            if v.measures[..k].iter().any(|(m, _)| m == measure) {
                return Err(EngineError::Duplicate {
                    what: "measure",
                    name: measure.as_str(),
                });
            }
            let expected = match measure.axis() {
                Axis::Params => n_params,
                Axis::Modules => self.model.spec.modules.len(),
                Axis::Free => values.len(),
            };
            if values.len() != expected {
                return Err(EngineError::Length {
                    what: measure.as_str(),
                    got: values.len(),
                    expected,
                });
            }
        }
        if v.inputs.len() % INPUT_STATS != 0 {
            return Err(EngineError::Length {
                what: "inputs",
                got: v.inputs.len(),
                expected: v.inputs.len().next_multiple_of(INPUT_STATS),
            });
        }
        if let Some(m) = v.nonfinite_module {
            if m >= self.model.spec.modules.len() {
                return Err(EngineError::ModuleIndex {
                    index: m,
                    count: self.model.spec.modules.len(),
                });
            }
        }
        Ok(())
    }

    fn push_event(&mut self, event: SemanticEvent, config: &Config) {
        if let Subject::Module(m) = event.subject {
            let slot = usize::from(event.event_type == EventType::ActivationHealth);
            let count = &mut self.event_counts[m][slot];
            // Non-finite transitions are always kept: they are the ones that must never be missed.
            let critical = matches!(
                event.to_state,
                State::Gradient(GradientHealth::NonFinite)
                    | State::Activation(ActivationHealth::NonFinite)
            );
            if *count as usize >= config.max_events_per_layer && !critical {
                self.suppressed_events += 1;
                return;
            }
            *count += 1;
        }
        self.events.push(event);
    }

    fn event_from<S: Copy>(
        t: &Transition<S>,
        event_type: EventType,
        subject: Subject,
        wrap: impl Fn(S) -> State,
    ) -> SemanticEvent {
        SemanticEvent {
            step: t.onset,
            event_type,
            subject,
            from_state: wrap(t.from),
            to_state: wrap(t.to),
            confidence: event_confidence(t.margin, t.persistence),
            value: t.value,
            threshold: t.threshold,
            confirmed_step: t.confirmed,
            persistence: t.persistence,
            margin: t.margin,
            rank: None,
        }
    }

    fn observe(&mut self, v: &StepView<'_>, config: &Config) {
        let step = v.step;
        self.first_step.get_or_insert(step);
        self.last_step = Some(step);
        self.steps_observed += 1;
        // A step the optimizer skipped (a mixed-precision overflow) is recorded, but its
        // non-finite gradients and loss are the scaler's business, not a failure: they do not
        // feed the health trackers.
        let overflow = if v.fact(Fact::OptimizerSkipped).is_some_and(|s| s >= 0.5) {
            v.nonfinite_module
                .or_else(|| self.overflow_module(v.grad_norms))
        } else {
            None
        };
        let skipped = self.loop_track.observe(v, overflow);

        // Parameter norms -> layer norms (L2 over all of a layer's parameters). Negative means
        // "no gradient"; NaN and infinities are not negative and flow through.
        let n_layers = self.model.layers.len();
        self.grads.begin(step);
        let mut total = 0.0f64;
        let mut any_grad = false;
        let mut all_finite = true;
        let mut fired = std::mem::take(&mut self.fired);
        {
            let mut row = self.grads.row();
            let layers = &mut self.layers;
            let mut layer_step = |l: usize, sum: f64| {
                let norm = sum.sqrt();
                any_grad = true;
                total += sum;
                all_finite &= norm.is_finite() || skipped;
                row.record(l, norm as f32);
                if skipped {
                    return;
                }
                if let Some((t, _)) = layers[l].observe(step, norm, config) {
                    fired.push((l, t));
                }
            };
            if let Some(ranges) = &self.model.layer_ranges {
                for (l, &(a, b)) in ranges.iter().enumerate() {
                    let mut sum = 0.0f64;
                    let mut present = false;
                    for &g in &v.grad_norms[a..b] {
                        if g < 0.0 {
                            continue;
                        }
                        sum += f64::from(g) * f64::from(g);
                        present = true;
                    }
                    if present {
                        layer_step(l, sum);
                    }
                }
            } else {
                self.sums.fill(0.0);
                self.present.fill(false);
                for (i, &g) in v.grad_norms.iter().enumerate() {
                    if g < 0.0 {
                        continue;
                    }
                    let l = self.model.param_layer[i];
                    self.sums[l] += f64::from(g) * f64::from(g);
                    self.present[l] = true;
                }
                for l in 0..n_layers {
                    if self.present[l] {
                        layer_step(l, self.sums[l]);
                    }
                }
            }
        }
        for (l, t) in fired.drain(..) {
            let subject = Subject::Module(self.model.layers[l].module);
            let e = Self::event_from(&t, EventType::GradientHealth, subject, State::Gradient);
            self.push_event(e, config);
        }
        self.fired = fired;
        if any_grad && skipped {
            self.grads.record(
                self.global_series(Global::TotalGradNorm),
                total.sqrt() as f32,
            );
        } else if any_grad {
            let total = total.sqrt();
            self.grads
                .record(self.global_series(Global::TotalGradNorm), total as f32);
            self.total_early.push(total);
            if self.nonfinite_steps == 0
                && all_finite
                && self.total_peak.is_none_or(|(p, _)| total > p)
            {
                self.total_peak = Some((total, step));
            }
        }

        let weights_sq = v.weight_norms.map(|w| self.observe_weights(step, w));
        if let Some(a) = v.activations {
            self.observe_activations(step, a, config);
        }
        if !v.inputs.is_empty() {
            self.observe_inputs(step, v.inputs, v.measure(Measure::InputRank), config);
        }
        if let (Some(sq), Some(loss)) = (weights_sq, v.loss) {
            self.loss_on_weights.add(sq, loss);
        }
        if let Some(loss) = v.loss {
            all_finite &= loss.is_finite() || skipped;
            self.grads
                .record(self.global_series(Global::Loss), loss as f32);
            if skipped && !loss.is_finite() {
                // An overflowed forward pass of a skipped step: no loss to judge.
            } else if let Some(t) = self.loss.observe(step, loss, config) {
                let e = Self::event_from(&t, EventType::LossHealth, Subject::Loss, State::Loss);
                self.push_event(e, config);
            }
        }
        self.loop_facts.observe(v.facts);
        for (measure, values) in v.measures {
            let zero_rows = match measure {
                Measure::GradZeroRows => true,
                Measure::GradZeroCols => false,
                Measure::UpdateRatio => {
                    self.observe_updates(values, |t| &mut t.update_early);
                    continue;
                }
                Measure::UpdateDirection => {
                    self.observe_updates(values, |t| &mut t.direction_early);
                    continue;
                }
                // Read where their analysis needs them (output scale, replicas, input ranks).
                Measure::OutputAbsMax
                | Measure::InputRank
                | Measure::ReplicaGradSpread
                | Measure::ReplicaWeightSpread
                | Measure::RankGradSumsq
                | Measure::RankWeightSumsq => continue,
            };
            for (l, layer) in self.model.layers.iter().enumerate() {
                let Some((p, _)) = layer.weight else { continue };
                let share = f64::from(values[p]);
                let track = &mut self.layers[l];
                if zero_rows {
                    track.zero_rows.observe(step, share);
                } else {
                    track.zero_cols.observe(step, share);
                }
            }
        }
        if self.outputs_first.is_none() {
            if let Some((_, values)) = v.measures.iter().find(|(m, _)| *m == Measure::OutputAbsMax)
            {
                if values.iter().any(|x| x.is_finite()) {
                    self.outputs_first = Some((step, values.clone()));
                }
            }
        }
        if let Some(lr) = v.lr.filter(|lr| lr.is_finite()) {
            if lr > 0.0 {
                self.lr_first.get_or_insert(lr);
            }
            let loss = &self.loss;
            self.lr_course.observe(step, lr, || loss.halves());
            self.grads.record(self.global_series(Global::Lr), lr as f32);
        }
        if !all_finite {
            self.nonfinite_steps += 1;
            if v.outputs_checked && v.nonfinite_module.is_none() && self.finite_forward.len() < 64 {
                self.finite_forward.push(step);
            }
        }
        if let Some(e) = self.replica.observe(
            &self.model,
            step,
            [
                v.measure(Measure::ReplicaGradSpread),
                v.measure(Measure::ReplicaWeightSpread),
            ],
            [
                v.measure(Measure::RankGradSumsq),
                v.measure(Measure::RankWeightSumsq),
            ],
        ) {
            self.push_event(e, config);
        }
        if !skipped {
            self.observe_output(
                step,
                v.nonfinite_module,
                v.fact(Fact::NonFiniteRank).and_then(|r| rank_of(r as f32)),
                all_finite && v.nonfinite_module.is_none(),
                config,
            );
        }
    }

    /// Where a backward pass overflowed: gradients are non-finite from the layer where the
    /// overflow happened back to the input, so it is the non-finite layer latest in forward
    /// order. Module index in the spec.
    fn overflow_module(&self, grad_norms: &[f32]) -> Option<usize> {
        let mut latest: Option<usize> = None;
        for (i, &g) in grad_norms.iter().enumerate() {
            if !g.is_finite() {
                let l = self.model.param_layer[i];
                latest = Some(latest.map_or(l, |k: usize| k.max(l)));
            }
        }
        latest.map(|l| self.model.layers[l].module)
    }

    /// One per-parameter measure of the optimizer update at each layer's `weight` parameter, kept
    /// in the layer's `early` record (how far it moved, in which direction).
    fn observe_updates(&mut self, values: &[f32], early: impl Fn(&mut LayerTrack) -> &mut Early) {
        for (l, layer) in self.model.layers.iter().enumerate() {
            let Some((p, _)) = layer.weight else { continue };
            let r = f64::from(values[p]);
            if r.is_finite() {
                early(&mut self.layers[l]).push(r);
            }
        }
    }

    /// Records a step's parameter norms per layer; returns the sum of their squares.
    fn observe_weights(&mut self, step: u64, w: &[f32]) -> f64 {
        self.weights.begin(step);
        self.sums.fill(0.0);
        self.present.fill(false);
        for (i, &n) in w.iter().enumerate() {
            if n < 0.0 {
                continue;
            }
            let l = self.model.param_layer[i];
            self.sums[l] += f64::from(n) * f64::from(n);
            self.present[l] = true;
        }
        for (l, layer) in self.model.layers.iter().enumerate() {
            if !self.present[l] {
                continue;
            }
            let norm = self.sums[l].sqrt();
            self.weights.record(l, norm as f32);
            let track = &mut self.layers[l];
            track.observe_weight(step, norm);
            if track.gain_first.is_none() {
                // std(W) * sqrt(fan_in) of each weight (assuming zero mean); the largest counts.
                track.gain_first = layer
                    .weights
                    .iter()
                    .filter_map(|&(p, fan_in)| {
                        let wn = f64::from(w[p]);
                        let numel = self.model.spec.params[p].numel as f64;
                        (wn.is_finite() && wn >= 0.0 && numel > 0.0)
                            .then(|| wn / numel.sqrt() * (fan_in as f64).sqrt())
                    })
                    .reduce(f64::max);
            }
        }
        self.sums.iter().sum()
    }

    fn observe_activations(&mut self, step: u64, a: &[f32], config: &Config) {
        self.activations.begin(step);
        for (i, row) in a.chunks_exact(ACTIVATION_STATS).enumerate() {
            let sample = ActivationSample {
                absmax: f64::from(row[0]),
                saturated_fraction: f64::from(row[1]),
                dead_fraction: f64::from(row[2]),
                mean_slope: f64::from(row[3]),
                samples_per_unit: f64::from(row[4]),
            };
            if sample.samples_per_unit.is_nan() {
                continue; // not measured this step
            }
            self.activations.record(3 * i, row[1]);
            self.activations.record(3 * i + 1, row[2]);
            self.activations.record(3 * i + 2, row[0]);
            let traits = self.model.activations[i].traits;
            if let Some((t, _)) = self.acts[i].observe(step, &sample, traits, config) {
                let subject = Subject::Module(self.model.activations[i].module);
                let e =
                    Self::event_from(&t, EventType::ActivationHealth, subject, State::Activation);
                self.push_event(e, config);
            }
        }
    }

    /// `ranks`: in a distributed job, the rank each row of `inputs` came from.
    fn observe_inputs(
        &mut self,
        step: u64,
        inputs: &[f32],
        ranks: Option<&[f32]>,
        config: &Config,
    ) {
        let mut worst = DataHealth::Normal;
        let mut worst_ratio = 1.0f64;
        let mut worst_row = 0usize;
        let mut scale = 0.0f64;
        for (k, row) in inputs.chunks_exact(INPUT_STATS).enumerate() {
            let row = [
                f64::from(row[0]),
                f64::from(row[1]),
                f64::from(row[2]),
                f64::from(row[3]),
            ];
            let (state, ratio) = self.data.judge(row, config);
            let s = row[0].abs().max(row[1].abs());
            scale = if s.is_nan() { f64::NAN } else { scale.max(s) };
            let rank = |d: DataHealth| match d {
                DataHealth::Normal => 0,
                DataHealth::OutOfDistribution => 1,
                DataHealth::NonFinite => 2,
            };
            if rank(state) > rank(worst) || (state == worst && ratio > worst_ratio) {
                worst = state;
                worst_ratio = ratio;
                worst_row = k;
            }
        }
        self.grads
            .record(self.global_series(Global::InputScale), scale as f32);
        if let Some((from, to, ratio)) = self.data.step(worst, worst_ratio) {
            let margin = if to == DataHealth::NonFinite {
                f64::INFINITY
            } else if to == DataHealth::OutOfDistribution {
                crate::health::decades(ratio, config.data_ood_factor)
            } else {
                0.0
            };
            let e = SemanticEvent {
                step,
                event_type: EventType::DataAnomaly,
                subject: Subject::Input,
                from_state: State::Data(from),
                to_state: State::Data(to),
                confidence: event_confidence(margin, 1).max(if to == DataHealth::Normal {
                    0.5
                } else {
                    0.0
                }),
                value: ratio,
                threshold: config.data_ood_factor,
                confirmed_step: step,
                persistence: 1,
                margin,
                rank: ranks
                    .and_then(|r| r.get(worst_row))
                    .and_then(|&r| rank_of(r))
                    .filter(|_| to != DataHealth::Normal),
            };
            self.push_event(e, config);
        }
    }

    /// `rank`: in a distributed job, the rank whose forward pass produced the value.
    fn observe_output(
        &mut self,
        step: u64,
        module: Option<usize>,
        rank: Option<u32>,
        clean: bool,
        config: &Config,
    ) {
        match (module, self.output) {
            (Some(m), OutputHealth::Finite) => {
                self.output = OutputHealth::NonFinite;
                let e = SemanticEvent {
                    step,
                    event_type: EventType::NonFiniteOutput,
                    subject: Subject::Module(m),
                    from_state: State::Output(OutputHealth::Finite),
                    to_state: State::Output(OutputHealth::NonFinite),
                    confidence: 1.0,
                    value: f64::NAN,
                    threshold: f64::NAN,
                    confirmed_step: step,
                    persistence: 1,
                    margin: f64::INFINITY,
                    rank,
                };
                self.push_event(e, config);
            }
            (None, OutputHealth::NonFinite) if clean => self.output = OutputHealth::Finite,
            _ => {}
        }
    }

    /// Index in `grads` of a run-wide series (they follow the per-layer ones).
    pub(crate) fn global_series(&self, g: Global) -> usize {
        self.model.layers.len() + g as usize
    }

    /// Largest learning rate recorded in the buckets around `[from, to]`.
    pub fn lr_between(&self, from: u64, to: u64) -> Option<f64> {
        self.grads
            .max_between(self.global_series(Global::Lr), from, to)
    }
}

/// A learning rate this far below its peak moves nothing (float32 weights of ~1 do not change
/// under steps of lr x gradient ~1e-7 of the peak's).
const LR_COLLAPSED: f64 = 1e-3;

/// A learning rate this far below its peak is small: a run whose loss only levels off once its
/// rate got there was still learning when the rate was taken away.
const LR_SMALL: f64 = 1e-2;

/// The learning rate over the run: its peak and where, its latest value, the first step after
/// the peak at which it was below half of it (a cut: a step schedule's, a reaction to a
/// plateau's, a decay's), and the first steps from which it stayed below [`LR_SMALL`] and
/// [`LR_COLLAPSED`] of the peak (None while it has not, or once it rose again: a warm restart).
/// With the fall below [`LR_SMALL`], how the loss moved over the window before it (see
/// `LossTrack::halves`): whether it was still falling when the rate was taken away.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct LrCourse {
    pub peak: Option<(u64, f64)>,
    pub last: Option<(u64, f64)>,
    pub first_cut: Option<u64>,
    pub small_from: Option<u64>,
    pub collapsed_from: Option<u64>,
    pub loss_at_small: Option<[(f64, f64); 2]>,
}

impl LrCourse {
    /// Takes a step's rate; `loss` reads how the loss moved, asked only when the rate first
    /// falls below [`LR_SMALL`] of its peak.
    fn observe(&mut self, step: u64, lr: f64, loss: impl FnOnce() -> Option<[(f64, f64); 2]>) {
        if self.peak.is_none_or(|(_, p)| lr > p) {
            self.peak = Some((step, lr));
            self.first_cut = None;
        }
        self.last = Some((step, lr));
        let peak = self.peak.map_or(lr, |(_, p)| p);
        if lr < 0.5 * peak {
            self.first_cut.get_or_insert(step);
        }
        if lr < LR_SMALL * peak && self.small_from.is_none() {
            self.loss_at_small = loss();
        }
        for (below, from) in [
            (LR_SMALL, &mut self.small_from),
            (LR_COLLAPSED, &mut self.collapsed_from),
        ] {
            if lr < below * peak {
                from.get_or_insert(step);
            } else {
                *from = None;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_learning_rates_course_keeps_where_it_fell_and_forgets_it_on_a_restart() {
        let mut c = LrCourse::default();
        // Warmup from a tiny rate is no collapse: the peak rises with it.
        for (step, lr) in [
            (0, 1e-6),
            (1, 1e-3),
            (2, 0.1),
            (3, 0.05),
            (4, 5e-5),
            (5, 1e-6),
        ] {
            c.observe(step, lr, || None);
        }
        assert_eq!(c.peak, Some((2, 0.1)));
        assert_eq!(c.first_cut, Some(4)); // 0.05 is half the peak, not below it
        assert_eq!((c.small_from, c.collapsed_from), (Some(4), Some(4)));
        assert_eq!(c.last, Some((5, 1e-6)));
        c.observe(6, 0.05, || None); // a warm restart
        assert_eq!((c.small_from, c.collapsed_from), (None, None));
        c.observe(7, 0.2, || None); // a new peak: its cuts are still to come
        assert_eq!(c.first_cut, None);
    }
    use crate::model::tests::mlp_spec;
    use crate::observation::{Fact, Measure, Observation};

    fn engine(depth: usize, act: &str) -> Engine {
        let mut e = Engine::new(Config::default()).unwrap();
        e.register_model(mlp_spec(depth, act)).unwrap();
        e
    }

    fn obs(step: u64, layer_norms: &[f32]) -> Observation {
        // Each layer has a weight and a bias; put the whole norm on the weight.
        let grad_norms = layer_norms.iter().flat_map(|n| [*n, 0.0]).collect();
        Observation {
            step,
            grad_norms,
            ..Observation::default()
        }
    }

    #[test]
    fn rejects_wrong_lengths_and_step_order() {
        let mut e = engine(2, "Tanh");
        let err = e
            .observe(
                &Observation {
                    step: 0,
                    grad_norms: vec![1.0],
                    ..Default::default()
                }
                .view(),
            )
            .unwrap_err();
        assert!(
            err.to_string()
                .contains("grad_norms has 1 values, expected 4"),
            "{err}"
        );
        e.observe(&obs(3, &[0.1, 0.1]).view()).unwrap();
        let err = e.observe(&obs(3, &[0.1, 0.1]).view()).unwrap_err();
        assert!(matches!(err, EngineError::StepOrder { .. }));
        let mut fresh = Engine::new(Config::default()).unwrap();
        assert_eq!(
            fresh.observe(&obs(0, &[0.1]).view()).unwrap_err(),
            EngineError::NoModel
        );
    }

    #[test]
    fn checks_facts_and_measures() {
        let mut e = engine(2, "Tanh");
        let n_modules = mlp_spec(2, "Tanh").modules.len();
        let mut o = obs(0, &[0.1, 0.1]);
        o.facts = vec![(Fact::Training, 1.0), (Fact::Training, 0.0)];
        let err = e.observe(&o.view()).unwrap_err();
        assert!(
            err.to_string()
                .contains("\"training\" is given more than once"),
            "{err}"
        );
        o.facts = vec![(Fact::Training, 1.0)];
        o.measures = vec![(Measure::OutputAbsMax, vec![1.0; n_modules + 1])];
        let err = e.observe(&o.view()).unwrap_err();
        assert_eq!(
            err,
            EngineError::Length {
                what: "output_absmax",
                got: n_modules + 1,
                expected: n_modules
            }
        );
        o.measures = vec![(Measure::OutputAbsMax, vec![1.0; n_modules])];
        e.observe(&o.view()).unwrap();
    }

    /// A distributed step: two ranks' input rows with their ranks.
    fn job_obs(step: u64, bad_rank: Option<usize>) -> Observation {
        let mut o = obs(step, &[0.1, 0.1]);
        let mut inputs = Vec::new();
        for r in 0..4 {
            let row = if Some(r) == bad_rank {
                [f32::NAN, 1.0, 0.0, 1.0]
            } else {
                [-1.0, 1.0, 0.0, 0.5]
            };
            inputs.extend_from_slice(&row);
        }
        o.inputs = inputs;
        o.measures = vec![(Measure::InputRank, vec![0.0, 1.0, 2.0, 3.0])];
        o
    }

    #[test]
    fn a_bad_batch_is_dated_and_named_with_its_rank() {
        let mut e = engine(2, "Tanh");
        for step in 0..8 {
            let bad = (step == 5).then_some(2);
            e.observe(&job_obs(step, bad).view()).unwrap();
        }
        let bad: Vec<_> = e
            .events()
            .into_iter()
            .filter(|ev| ev.to_state == State::Data(DataHealth::NonFinite))
            .collect();
        assert_eq!(bad.len(), 1);
        assert_eq!((bad[0].step, bad[0].rank), (5, Some(2)));
        let top = &crate::analysis::explain(&e, None)[0];
        assert!(top.description.contains("on rank 2"), "{}", top.description);
        // Without ranks (one process) nothing names a rank.
        let mut single = engine(2, "Tanh");
        let mut o = job_obs(0, Some(1));
        o.measures.clear();
        single.observe(&o.view()).unwrap();
        assert_eq!(single.events()[0].rank, None);
    }

    #[test]
    fn a_non_finite_output_names_its_rank() {
        let mut e = engine(2, "Tanh");
        e.observe(&obs(0, &[0.1, 0.1]).view()).unwrap();
        let mut o = obs(1, &[f32::NAN, f32::NAN]);
        o.nonfinite_module = Some(2);
        o.outputs_checked = true;
        o.facts = vec![(Fact::NonFiniteRank, 3.0)];
        e.observe(&o.view()).unwrap();
        let out: Vec<_> = e
            .events()
            .into_iter()
            .filter(|ev| ev.event_type == EventType::NonFiniteOutput)
            .collect();
        assert_eq!((out[0].subject, out[0].rank), (Subject::Module(2), Some(3)));
    }

    #[test]
    fn a_diverged_replica_is_a_failure_naming_the_layer_and_the_rank() {
        let mut e = engine(3, "Tanh");
        let n = mlp_spec(3, "Tanh").params.len();
        for step in 0..10u64 {
            let mut o = obs(step, &[0.1, 0.1, 0.1]);
            let mut spread = vec![0.0f32; n];
            let mut totals = vec![4.0f32; 4];
            if step >= 6 {
                spread[2] = 0.2; // fc1.weight
                spread[4] = 0.1; // fc2.weight: later in forward order
                totals[1] = 9.0;
            }
            // Float noise far below the tolerance is not a divergence.
            spread[0] = 1e-7;
            o.measures = vec![
                (Measure::ReplicaWeightSpread, spread),
                (Measure::RankWeightSumsq, totals),
            ];
            e.observe(&o.view()).unwrap();
        }
        let hs = crate::analysis::explain(&e, None);
        let top = &hs[0];
        assert_eq!(top.failure, crate::Failure::ReplicaDivergence);
        assert_eq!(top.step, Some(6));
        assert_eq!(top.layer.as_deref(), Some("fc1"));
        assert!(top.confidence >= 0.5, "{top:?}");
        assert_eq!(top.evidence[0].rank, Some(1));
        assert!(top.description.contains("on rank 1"), "{}", top.description);
        assert!(
            top.remedies[0].contains("some ranks only"),
            "{:?}",
            top.remedies
        );
    }

    #[test]
    fn vanishing_transition_becomes_one_event_at_onset() {
        let mut e = engine(3, "Tanh");
        for step in 0..40u64 {
            let low = if step >= 10 { 1e-8 } else { 0.1 };
            e.observe(&obs(step, &[low, 0.1, 0.1]).view()).unwrap();
        }
        let events = e.events();
        assert_eq!(events.len(), 1, "{events:?}");
        let ev = &events[0];
        assert_eq!(ev.step, 10);
        assert_eq!(ev.subject, Subject::Module(0));
        assert_eq!(ev.to_state, State::Gradient(GradientHealth::Vanishing));
        assert!(ev.confidence > 0.9, "{}", ev.confidence);
    }

    #[test]
    fn history_is_bounded_and_readable_by_name() {
        let mut e = engine(2, "ReLU");
        for step in 0..10_000u64 {
            e.observe(&obs(step, &[0.5, 0.25]).view()).unwrap();
        }
        let (steps, values) = e.history(Some("fc1"), "grad_norm", Reduce::Last).unwrap();
        assert!(steps.len() <= 512);
        assert_eq!(*steps.last().unwrap(), 9_999);
        assert!(values.iter().all(|v| (*v - 0.25).abs() < 1e-6));
        let err = e
            .history(Some("nope"), "grad_norm", Reduce::Last)
            .unwrap_err();
        assert!(err.to_string().contains("nope"));
        let err = e
            .history(Some("act0"), "grad_norm", Reduce::Last)
            .unwrap_err();
        assert!(err.to_string().contains("fc0"), "{err}");
    }
}
