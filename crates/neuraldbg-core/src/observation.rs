//! One training step's statistics, as handed to the engine.
//!
//! Everything is a small flat array of numbers, so any collector (`PyTorch`, candle, a trace file)
//! can produce it and the engine never sees a tensor.

use serde::{Deserialize, Serialize};

use crate::named::named_enum;

/// Columns of one row of [`StepView::inputs`]: `min, max, mean, std` of one input batch.
pub const INPUT_STATS: usize = 4;
/// Columns of one row of [`StepView::activations`]:
/// `absmax, saturated_fraction, dead_fraction, mean_slope, samples_per_unit`.
pub const ACTIVATION_STATS: usize = 5;

named_enum! {
    /// A named scalar fact about one step that only the training framework knows (training
    /// mode, a skipped optimizer step, the rank...). Collectors send the facts they know; the
    /// engine decides what they mean. Grouped by the concern that reads them: add a new fact
    /// in its group, with its meaning and unit.
    Fact {
        // --- The training loop: optimizers, clipping, mixed precision.
        /// The optimizer step of this iteration was skipped (1.0), e.g. by a `GradScaler` that
        /// found an overflow; 0.0 when it ran.
        OptimizerSkipped => "optimizer_skipped",
        /// The mixed-precision loss scale in force for this step's backward pass.
        LossScale => "loss_scale",
        /// Ratio of the gradient norm the optimizer step received to the norm the backward
        /// pass produced, read on one parameter (the largest up to 64k elements); below 1.0 when something
        /// (gradient clipping) rescaled the gradients in between.
        ClipRatio => "clip_ratio",

        // --- Distributed training.
        /// Number of processes in the job.
        WorldSize => "world_size",
        /// The rank of the process that made this observation.
        Rank => "rank",
        /// The rank whose forward pass produced this step's first non-finite module output
        /// (the module is [`StepView::nonfinite_module`]).
        NonFiniteRank => "nonfinite_rank",

        // --- Loop mistakes and framework state.
        /// Whether the model was in training mode during the step's forward pass (1.0) or in
        /// `eval()` mode (0.0).
        Training => "training",
        /// Whether this step's gradients were added onto gradients left over from the previous
        /// step (1.0: `.grad` was neither zeroed nor set to None since the last optimizer step)
        /// or started from nothing (0.0).
        GradAccumulated => "grad_accumulated",
    }
}

named_enum! {
    /// A named array of numbers measured in one step, beyond the fixed arrays of [`StepView`].
    /// Each has an [`Axis`] that fixes its length. Grouped like [`Fact`].
    Measure {
        // --- Forward-pass scale.
        /// Largest magnitude of each module's output in the step's forward pass, per module
        /// (NaN: not measured).
        OutputAbsMax => "output_absmax",

        // --- Units that never fire (functional activations).
        /// Per parameter: the share of the gradient's rows (output units, dim 0) that are
        /// exactly zero in this step (NaN: not measured, or fewer than 2 dimensions).
        GradZeroRows => "grad_zero_rows",
        /// Per parameter: the share of the gradient's columns (input units, dim 1) that are
        /// exactly zero in this step (NaN: not measured, or fewer than 2 dimensions).
        GradZeroCols => "grad_zero_cols",

        // --- Step sizes.
        /// Per parameter, on steps whose parameter norms are measured: how far this step's
        /// optimizer update moved it relative to its size, `|W_after - W_before| / |W_before|`
        /// (NaN: not measured; infinite: the parameter was all zeros before the step).
        UpdateRatio => "update_ratio",
        /// Per parameter, on the same steps: the cosine between the optimizer update's move of
        /// the parameter and the gradient the backward pass gave it (-1: straight down the
        /// gradient, as SGD steps; above 0: up it). NaN: not measured, or the optimizer was
        /// told to maximize.
        UpdateDirection => "update_direction",

        // --- Distributed training.
        /// The rank each row of [`StepView::inputs`] came from.
        InputRank => "input_rank",
        /// Per parameter, how far its gradient norm differs across the ranks that should hold
        /// identical replicas of it (DDP): `(max - min) / max`, NaN when not a replica or not
        /// measured.
        ReplicaGradSpread => "replica_grad_spread",
        /// The same for the parameter's own norm (on steps whose parameter norms are measured).
        ReplicaWeightSpread => "replica_weight_spread",
        /// Per rank: the sum of squares of its replicated gradients.
        RankGradSumsq => "rank_grad_sumsq",
        /// Per rank: the sum of squares of its replicated parameters.
        RankWeightSumsq => "rank_weight_sumsq",
    }
}

/// What one value of a [`Measure`] stands for, and so how long the array is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Axis {
    /// One value per parameter, in [`crate::ModelSpec::params`] order.
    Params,
    /// One value per module, in [`crate::ModelSpec::modules`] order.
    Modules,
    /// Any length (e.g. one value per rank).
    Free,
}

impl Measure {
    /// What the measure's values stand for.
    pub fn axis(self) -> Axis {
        match self {
            Measure::OutputAbsMax => Axis::Modules,
            Measure::GradZeroRows
            | Measure::GradZeroCols
            | Measure::UpdateRatio
            | Measure::UpdateDirection
            | Measure::ReplicaGradSpread
            | Measure::ReplicaWeightSpread => Axis::Params,
            Measure::InputRank | Measure::RankGradSumsq | Measure::RankWeightSumsq => Axis::Free,
        }
    }
}

/// A step's statistics, borrowed. Build one from slices the collector already has.
#[derive(Clone, Copy, Debug, Default)]
pub struct StepView<'a> {
    /// The step: completed optimizer steps before this one (0 for the first).
    pub step: u64,
    /// L2 norm of each parameter's gradient, in [`crate::ModelSpec::params`] order. NaN or
    /// infinity for a non-finite gradient; any negative value for "no gradient this step".
    pub grad_norms: &'a [f32],
    /// L2 norm of each parameter (same order), on steps where the collector measured them.
    pub weight_norms: Option<&'a [f32]>,
    /// One row of [`ACTIVATION_STATS`] per activation module (model order), on steps where the
    /// collector measured them; a row of NaN means "not measured".
    pub activations: Option<&'a [f32]>,
    /// One row of [`INPUT_STATS`] per forward pass in the step (gradient accumulation gives
    /// several).
    pub inputs: &'a [f32],
    /// The training loss, when known.
    pub loss: Option<f64>,
    /// The learning rate the optimizer is about to apply.
    pub lr: Option<f64>,
    /// Index of the first module (in forward order) whose output was not finite in this step's
    /// forward pass, when the collector looked.
    pub nonfinite_module: Option<usize>,
    /// The collector scanned this step's module outputs (so `nonfinite_module: None` means they
    /// were all finite, and a NaN/Inf came from the loss computation or the backward pass).
    pub outputs_checked: bool,
    /// Facts the collector knows about this step (each fact at most once).
    pub facts: &'a [(Fact, f64)],
    /// Further named measurements of this step (each measure at most once).
    pub measures: &'a [(Measure, Vec<f32>)],
}

/// A step's statistics, owned: what a trace stores and replays.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Observation {
    pub step: u64,
    pub grad_norms: Vec<f32>,
    #[serde(default)]
    pub weight_norms: Option<Vec<f32>>,
    #[serde(default)]
    pub activations: Option<Vec<f32>>,
    #[serde(default)]
    pub inputs: Vec<f32>,
    #[serde(default)]
    pub loss: Option<f64>,
    #[serde(default)]
    pub lr: Option<f64>,
    #[serde(default)]
    pub nonfinite_module: Option<usize>,
    #[serde(default)]
    pub outputs_checked: bool,
    #[serde(default)]
    pub facts: Vec<(Fact, f64)>,
    #[serde(default)]
    pub measures: Vec<(Measure, Vec<f32>)>,
}

impl Observation {
    /// Borrows this observation for [`crate::Engine::observe`].
    pub fn view(&self) -> StepView<'_> {
        StepView {
            step: self.step,
            grad_norms: &self.grad_norms,
            weight_norms: self.weight_norms.as_deref(),
            activations: self.activations.as_deref(),
            inputs: &self.inputs,
            loss: self.loss,
            lr: self.lr,
            nonfinite_module: self.nonfinite_module,
            outputs_checked: self.outputs_checked,
            facts: &self.facts,
            measures: &self.measures,
        }
    }
}

impl<'a> StepView<'a> {
    /// Copies the view into an owned [`Observation`].
    pub fn to_owned(&self) -> Observation {
        Observation {
            step: self.step,
            grad_norms: self.grad_norms.to_vec(),
            weight_norms: self.weight_norms.map(<[f32]>::to_vec),
            activations: self.activations.map(<[f32]>::to_vec),
            inputs: self.inputs.to_vec(),
            loss: self.loss,
            lr: self.lr,
            nonfinite_module: self.nonfinite_module,
            outputs_checked: self.outputs_checked,
            facts: self.facts.to_vec(),
            measures: self.measures.to_vec(),
        }
    }

    /// The value of a fact, when the collector gave it.
    pub fn fact(&self, fact: Fact) -> Option<f64> {
        self.facts.iter().find(|(f, _)| *f == fact).map(|(_, v)| *v)
    }

    /// A measure's values, when the collector gave them.
    pub fn measure(&self, measure: Measure) -> Option<&'a [f32]> {
        self.measures
            .iter()
            .find(|(m, _)| *m == measure)
            .map(|(_, v)| v.as_slice())
    }
}
