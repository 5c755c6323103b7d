//! One training step's statistics, as handed to the engine.
//!
//! Everything is a small flat array of numbers, so any collector (`PyTorch`, candle, a trace file)
//! can produce it and the engine never sees a tensor.

use serde::{Deserialize, Serialize};

/// Columns of one row of [`StepView::inputs`]: `min, max, mean, std` of one input batch.
pub const INPUT_STATS: usize = 4;
/// Columns of one row of [`StepView::activations`]:
/// `absmax, saturated_fraction, dead_fraction, mean_slope, samples_per_unit`.
pub const ACTIVATION_STATS: usize = 5;

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
        }
    }
}

impl StepView<'_> {
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
        }
    }
}
