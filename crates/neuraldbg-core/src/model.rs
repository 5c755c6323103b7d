//! What the engine knows about the watched model: its modules in forward-execution order,
//! which of them own parameters (the "layers" whose gradient health is tracked), which are
//! activations, and how each parameter maps to its layer.
//!
//! The description is framework-neutral: `PyTorch`'s collector builds it from
//! `model.named_modules()`, a Rust training loop can build it by hand.

use serde::{Deserialize, Serialize};

use crate::error::EngineError;
use crate::health::{ActivationTraits, SlopeFormula};

/// One module of the model, as described by the collector.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ModuleSpec {
    /// Qualified name (`encoder.layers.0.linear1`); the root module is `""`.
    pub name: String,
    /// Class name (`Linear`, `Tanh`, `MyBlock`); decides activation traits and normalization.
    pub kind: String,
    /// Numeric attributes that change a module's behaviour (`min_val`, `max_val` of Hardtanh,
    /// `p` of Dropout: the share of units it zeroes). Empty for most modules.
    #[serde(default)]
    pub attrs: Vec<(String, f64)>,
    /// False when the module never ran in the forward pass that fixed the order (its position
    /// then follows its parent).
    #[serde(default = "yes")]
    pub executed: bool,
}

fn yes() -> bool {
    true
}

/// A module that reads its input's first dimension as the sequence, and the shape of the input
/// it was first given ([`ModelSpec::sequence_first_inputs`]).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct SequenceFirstInput {
    /// The module's qualified name, as in [`ModuleSpec::name`].
    pub module: String,
    pub shape: Vec<u64>,
}

/// A recurrent module whose output the model reads only at chosen time steps
/// ([`ModelSpec::sequence_readouts`]).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct SequenceReadout {
    /// The module's qualified name, as in [`ModuleSpec::name`].
    pub module: String,
    /// The time steps of the sequence it was first given.
    pub steps: u64,
    /// The steps the model reads its output at, from 0.
    pub steps_read: Vec<u64>,
    /// Whether it runs both ways along the sequence.
    #[serde(default)]
    pub bidirectional: bool,
}

/// What a parameter is to its layer.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ParamRole {
    Weight,
    Bias,
    Other,
}

/// One trainable parameter, in the order of the per-step gradient-norm array.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ParamSpec {
    /// Index into [`ModelSpec::modules`] of the module that owns the parameter.
    pub module: usize,
    /// Qualified parameter name (`fc1.weight`).
    pub name: String,
    pub numel: u64,
    pub role: ParamRole,
    /// Inputs feeding one output unit (`Linear`: `in_features`; `Conv`: `in_channels / groups x kernel`).
    #[serde(default)]
    pub fan_in: Option<u64>,
    /// Other modules that hold this very parameter (tied weights: a language model's output
    /// head and its input embedding). Their names resolve to this parameter's layer.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub tied: Vec<usize>,
    /// Frozen (`requires_grad=False`) when the model was registered: it gets no gradient until
    /// it is unfrozen, and a layer of frozen parameters is not a stalled layer.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub frozen: bool,
    /// Every output unit of the layer had the same weights, not all zero, when the model was
    /// registered (a constant initialization): the units compute the same, get the same
    /// gradient and never become different.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub identical_units: bool,
}

/// The model as the engine sees it.
///
/// A native training loop builds it with [`ModelSpec::module`] and [`ModelSpec::param`]:
///
/// ```
/// use neuraldbg_core::{ModelSpec, ParamRole};
///
/// let mut spec = ModelSpec::default();
/// let fc = spec.module("fc", "Linear");
/// spec.param(fc, "fc.weight", &[10, 32]); // role Weight, fan_in 32
/// spec.param(fc, "fc.bias", &[10]);       // role Bias
/// spec.module("act", "ReLU");
/// spec.module("", "Net"); // the root completes last
/// assert_eq!(spec.params[0].fan_in, Some(32));
/// assert_eq!(spec.params[1].role, ParamRole::Bias);
/// ```
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct ModelSpec {
    /// Every module, in forward-execution order (the order their forward calls completed in
    /// the first observed forward pass).
    pub modules: Vec<ModuleSpec>,
    /// Trainable parameters; the gradient-norm array of each step follows this order.
    pub params: Vec<ParamSpec>,
    /// Class name of the optimizer that steps the model (`Adam`, `SGD`), when known: adaptive
    /// optimizers move each weight by about the learning rate whatever the gradient's size.
    #[serde(default)]
    pub optimizer: Option<String>,
    /// Learning rate of the optimizer param group that holds each parameter (same order as
    /// `params`; the largest where several optimizers hold it), `None` for a parameter no
    /// optimizer holds. Absent when the collector did not look (or saw no optimizer). An
    /// optimizer first seen after registration adds its parameters through
    /// [`crate::Engine::amend_param_lr`].
    #[serde(default)]
    pub param_lr: Option<Vec<Option<f64>>>,
    /// Weight decay the optimizer adds to each parameter's gradient before its update (the
    /// `weight_decay` of `SGD`, `Adam`, `RMSprop`: an L2 penalty of half that coefficient),
    /// same order as `params`; 0 where there is none or where the decay is applied to the
    /// weights apart from the gradient (`AdamW`). Absent when the collector did not look.
    #[serde(default)]
    pub param_weight_decay: Option<Vec<f64>>,
    /// The learning rate the optimizer was built with, where a scheduler has set its own since
    /// (the `initial_lr` of the optimizer's first param group, which a torch `LRScheduler`
    /// writes when it is made, when it differs from the group's `lr`). Absent without one.
    #[serde(default)]
    pub base_lr: Option<f64>,
    /// Shapes of parameters the model's output depends on that are not among the model's
    /// parameters and that no optimizer holds (layers kept in a plain Python list or built
    /// inside `forward()`: never registered, so never trained). Absent when the collector did
    /// not look or found none.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub unregistered_params: Option<Vec<Vec<u64>>>,
    /// Modules that read their input's first dimension as the sequence (`PyTorch`'s RNNs and
    /// attention layers without `batch_first=True`), with the shape of the input each was
    /// first given. Absent when the collector did not look or the model has none.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sequence_first_inputs: Option<Vec<SequenceFirstInput>>,
    /// Recurrent modules whose output the model's output reads only at chosen time steps
    /// (`out[:, -1]`, `out[:, 0]`), never their final state, as the first step's autograd
    /// graph shows it. Absent when the collector did not look or found none.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sequence_readouts: Option<Vec<SequenceReadout>>,
    /// What the loss does with the model's output, when the collector could see it.
    #[serde(default)]
    pub loss: Option<LossSpec>,
    /// The largest magnitude of each feature of the first step's input batch, when that batch
    /// is a table (a 2-D batch of a few features; the `PyTorch` collector: 2 to 256 float
    /// features). Absent otherwise; `None` for a feature whose values in the batch were not
    /// all finite.
    #[serde(default)]
    pub input_feature_scales: Option<Vec<Option<f64>>>,
    /// The framework the user's training code is written in (`torch`, `keras`, `jax`, `burn`),
    /// as the collector says: the remedies name its functions. Absent: `torch`.
    #[serde(default)]
    pub framework: Option<String>,
}

/// Facts of the first training batch that a collector reads only after it registered the
/// model (the Keras callback registers it when `fit` starts, before any batch): the targets'
/// range and variance and the output's range (facts of [`LossSpec`], taken where the spec has
/// a loss), and the input table's feature scales ([`ModelSpec::input_feature_scales`]). See
/// [`crate::Engine::amend_first_batch`]. A spoke that learns the loss itself only when the
/// step first runs (JAX: while the step is traced) sends it here too.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct FirstBatch {
    /// The loss, taken where the registered spec has none.
    #[serde(default)]
    pub loss: Option<LossSpec>,
    /// The operation that made the model's output ([`LossSpec::output_op`]), where only the
    /// running model says (the Keras callback: a subclassed model's output layer).
    #[serde(default)]
    pub output_op: Option<String>,
    #[serde(default)]
    pub target_range: Option<(f64, f64)>,
    #[serde(default)]
    pub target_var: Option<f64>,
    #[serde(default)]
    pub output_range: Option<(f64, f64)>,
    /// The range of the targets' class indices (a loss given class indices), and the elements
    /// of the model's output (batch x units): facts of [`LossSpec`].
    #[serde(default)]
    pub class_range: Option<(f64, f64)>,
    /// [`LossSpec::class_entropy`], measured with the first batch.
    #[serde(default)]
    pub class_entropy: Option<f64>,
    /// [`LossSpec::class_entropy_se`], measured with the first batch.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub class_entropy_se: Option<f64>,
    /// [`LossSpec::output_batch_spread`], measured with the first batch.
    #[serde(default)]
    pub output_batch_spread: Option<f64>,
    #[serde(default)]
    pub output_numel: Option<u64>,
    /// [`LossSpec::labels_per_sample`], measured with the first batch.
    #[serde(default)]
    pub labels_per_sample: Option<u64>,
    #[serde(default)]
    pub input_feature_scales: Option<Vec<Option<f64>>>,
}

impl FirstBatch {
    /// Refuses a fact that is not what it says: a range of finite numbers, lowest first; a
    /// variance, an entropy and a spread finite and >= 0; feature scales finite and >= 0.
    pub fn check(&self) -> Result<(), EngineError> {
        let loss = self.loss.as_ref();
        for (what, range) in [
            ("target_range", self.target_range),
            ("output_range", self.output_range),
            ("class_range", self.class_range),
            ("loss.target_range", loss.and_then(|l| l.target_range)),
            ("loss.output_range", loss.and_then(|l| l.output_range)),
            ("loss.class_range", loss.and_then(|l| l.class_range)),
        ] {
            if let Some((lo, hi)) = range {
                if !(lo.is_finite() && hi.is_finite() && lo <= hi) {
                    return Err(EngineError::Model(format!(
                        "{what} is [{lo}, {hi}]: a range is two finite numbers, the lowest first"
                    )));
                }
            }
        }
        // (Each from the record itself or from its loss.)
        for (what, value, kind) in [
            (
                "target_var",
                self.target_var.or(loss.and_then(|l| l.target_var)),
                "a variance",
            ),
            (
                "class_entropy",
                self.class_entropy.or(loss.and_then(|l| l.class_entropy)),
                "an entropy",
            ),
            (
                "class_entropy_se",
                self.class_entropy_se
                    .or(loss.and_then(|l| l.class_entropy_se)),
                "a standard error",
            ),
            (
                "output_batch_spread",
                self.output_batch_spread
                    .or(loss.and_then(|l| l.output_batch_spread)),
                "a spread",
            ),
        ] {
            if let Some(x) = value.filter(|x| !(x.is_finite() && *x >= 0.0)) {
                return Err(EngineError::Model(format!(
                    "{what} is {x}: {kind} is a finite number >= 0"
                )));
            }
        }
        check_feature_scales(self.input_feature_scales.as_deref())
    }
}

/// Feature scales are finite numbers >= 0 (null where the batch's values were not all finite).
fn check_feature_scales(scales: Option<&[Option<f64>]>) -> Result<(), EngineError> {
    match scales
        .into_iter()
        .flatten()
        .flatten()
        .find(|x| !(x.is_finite() && **x >= 0.0))
    {
        Some(x) => Err(EngineError::Model(format!(
            "input_feature_scales holds {x}: a feature's largest magnitude is a finite number >= 0 (null where the batch's values were not all finite)"
        ))),
        None => Ok(()),
    }
}

/// The loss as the framework computed it on the first step: facts, not judgements.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct LossSpec {
    /// The operations the loss applied to the model's output, from the loss value back to the
    /// output, as the framework names them (`["NllLoss", "LogSoftmax"]` for cross-entropy,
    /// `["MseLoss", "Expand"]` for a broadcasting MSE).
    #[serde(default)]
    pub ops: Vec<String>,
    /// The operation that produced the model's output (`Softmax`, `Sigmoid`, `Addmm`...).
    #[serde(default)]
    pub output_op: Option<String>,
    /// The shape of the model's output on the first step.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub output_shape: Option<Vec<u64>>,
    /// A binary cross-entropy's targets: the most labels marked present (>= 0.5) in one sample
    /// of the first batch (along their last dimension). 2 or more: a multi-label task.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub labels_per_sample: Option<u64>,
    /// The classes of a negative log-likelihood, where the framework says: the size of its
    /// input's class axis (`PyTorch`: dim 1), which is not the output's last dimension for a
    /// segmentation map `(N, C, H, W)` or a contrastive loss's similarities `(N, N)`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub class_units: Option<u64>,
    /// Size of the output's last dimension.
    #[serde(default)]
    pub output_units: Option<u64>,
    /// Elements of the model's output, and of the tensor the loss compared with the target
    /// (larger when the loss broadcast the output against a differently shaped target).
    #[serde(default)]
    pub output_numel: Option<u64>,
    #[serde(default)]
    pub compared_numel: Option<u64>,
    /// Smallest and largest target value of the first step (regression losses).
    #[serde(default)]
    pub target_range: Option<(f64, f64)>,
    /// Variance of the first step's targets (regression losses): the loss of predicting their
    /// mean, for a mean squared error.
    #[serde(default)]
    pub target_var: Option<f64>,
    /// Smallest and largest class index among the first step's targets (a classification
    /// loss given class indices, as cross-entropy is).
    #[serde(default)]
    pub class_range: Option<(f64, f64)>,
    /// The entropy (nats) of how often each class occurs among the first step's class-index
    /// targets: the cross-entropy of a model that predicts those frequencies and nothing of
    /// the input (ln C when the classes are balanced).
    #[serde(default)]
    pub class_entropy: Option<f64>,
    /// The standard error of [`LossSpec::class_entropy`] as an estimate of the classes'
    /// frequencies over the run, from the one batch it was measured on.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub class_entropy_se: Option<f64>,
    /// A binary cross-entropy's targets' own entropy: the mean, over the first batch's targets,
    /// of each one's binary entropy (nats), the loss of a model that predicts every target
    /// exactly; 0 for targets that are all 0 or 1, more for soft ones (probabilities, pixel
    /// intensities).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub target_entropy: Option<f64>,
    /// Smallest and largest value of the model's output on the first step.
    #[serde(default)]
    pub output_range: Option<(f64, f64)>,
    /// How far the model's output on the first step varies across the batch: the largest
    /// range over the batch (its first dimension) of any one output element, over the output's
    /// largest magnitude. 0 when every sample got the same output.
    #[serde(default)]
    pub output_batch_spread: Option<f64>,
    /// How the loss reduced over the batch, where the framework says: `mean`, `sum`, `none`.
    #[serde(default)]
    pub reduction: Option<String>,
    /// A softmax (or log-softmax) on the way from the output to the loss was taken over the
    /// first dimension of the output, the batch, not over the classes.
    #[serde(default)]
    pub softmax_over_batch: bool,
    /// Parameters the loss penalizes directly: a weight penalty written into it (`loss +
    /// l2 * sum(w.pow(2).sum() ...)`), reached from the loss through sums, scalings and norms,
    /// not through the model's output.
    #[serde(default)]
    pub penalized_params: Option<u64>,
}

impl LossSpec {
    /// Whether the loss reads the output's units as its own, element for element: its classes,
    /// its elements compared with the targets. Not when a matrix product lies between them: a
    /// contrastive loss (CLIP, `InfoNCE`) scores every sample against every other with `z @ z.T`,
    /// and a head applied outside the model (tied embeddings, `h @ emb.T`) makes the classes.
    pub fn reads_output_units(&self) -> bool {
        !self.ops.iter().any(|o| {
            matches!(
                o.as_str(),
                "Mm" | "Bmm" | "Addmm" | "Baddbmm" | "Matmul" | "Mv" | "Addmv" | "Dot" | "Linear"
            )
        })
    }

    /// The classes of a loss over classes: where the framework said ([`LossSpec::class_units`]),
    /// else the output's last dimension when the loss reads the output's units as its own.
    pub fn classes(&self) -> Option<u64> {
        self.class_units
            .or(self.output_units.filter(|_| self.reads_output_units()))
    }

    /// A binary cross-entropy, on logits or on probabilities (its targets must be in [0, 1],
    /// its chance level is ln 2).
    pub fn is_binary_cross_entropy(&self) -> bool {
        self.ops
            .iter()
            .any(|o| o == "BinaryCrossEntropyWithLogits" || o == "BinaryCrossEntropy")
    }
}

impl ModelSpec {
    /// Appends a module (modules are listed in forward-execution order); returns its index.
    pub fn module(&mut self, name: impl Into<String>, kind: impl Into<String>) -> usize {
        self.modules.push(ModuleSpec {
            name: name.into(),
            kind: kind.into(),
            attrs: Vec::new(),
            executed: true,
        });
        self.modules.len() - 1
    }

    /// Appends a trainable parameter of `module` with this shape; returns its index (its place
    /// in each step's gradient-norm array). As in `PyTorch`, the last component of the name
    /// gives the role (`weight...`, `bias...`, else other) and a weight of rank 2 or more has
    /// `fan_in = shape[1] x shape[2..]` (set `fan_in` to None afterwards for lookup tables).
    pub fn param(&mut self, module: usize, name: impl Into<String>, shape: &[u64]) -> usize {
        let name = name.into();
        let leaf = name.rsplit('.').next().unwrap_or_default();
        let role = if leaf.starts_with("weight") {
            ParamRole::Weight
        } else if leaf.starts_with("bias") {
            ParamRole::Bias
        } else {
            ParamRole::Other
        };
        let fan_in =
            (role == ParamRole::Weight && shape.len() >= 2).then(|| shape[1..].iter().product());
        self.params.push(ParamSpec {
            module,
            name,
            numel: shape.iter().product(),
            role,
            fan_in,
            tied: Vec::new(),
            frozen: false,
            identical_units: false,
        });
        self.params.len() - 1
    }

    /// Fills the facts of the first training batch the spec does not have yet (a fact it has
    /// stays, the loss too; target and output facts need a loss); returns whether any changed. Refuses facts
    /// that are not what they say ([`FirstBatch::check`]).
    pub fn merge_first_batch(&mut self, facts: &FirstBatch) -> Result<bool, EngineError> {
        fn fill<T>(slot: &mut Option<T>, value: Option<T>) -> bool {
            let new = slot.is_none() && value.is_some();
            if new {
                *slot = value;
            }
            new
        }
        facts.check()?;
        let mut changed = fill(&mut self.loss, facts.loss.clone());
        if let Some(loss) = self.loss.as_mut() {
            changed |= fill(&mut loss.target_range, facts.target_range);
            changed |= fill(&mut loss.target_var, facts.target_var);
            changed |= fill(&mut loss.output_range, facts.output_range);
            changed |= fill(&mut loss.class_range, facts.class_range);
            changed |= fill(&mut loss.class_entropy, facts.class_entropy);
            changed |= fill(&mut loss.class_entropy_se, facts.class_entropy_se);
            changed |= fill(&mut loss.output_batch_spread, facts.output_batch_spread);
            changed |= fill(&mut loss.output_numel, facts.output_numel);
            changed |= fill(&mut loss.labels_per_sample, facts.labels_per_sample);
            changed |= fill(&mut loss.output_op, facts.output_op.clone());
        }
        changed |= fill(
            &mut self.input_feature_scales,
            facts.input_feature_scales.clone(),
        );
        Ok(changed)
    }

    /// Merges what another optimizer says about the parameters into [`Self::param_lr`]: per
    /// parameter, the lr of its param group that holds it, None where it holds none (`lrs`
    /// None: an optimizer whose lrs cannot be read steps the model). A model trained by several
    /// optimizers (an encoder and a decoder, a separate head) has each parameter held by some of
    /// them: a parameter any optimizer holds is held, at the largest lr of the groups holding
    /// it (as [`crate::Engine`]'s stalled-layer analysis reads a layer's lr). Unknown lrs stay
    /// unknown, and an unreadable optimizer makes them unknown. Returns whether anything
    /// changed.
    pub fn merge_param_lr(&mut self, lrs: Option<&[Option<f64>]>) -> Result<bool, EngineError> {
        let Some(lrs) = lrs else {
            return Ok(self.param_lr.take().is_some());
        };
        if lrs.len() != self.params.len() {
            return Err(EngineError::Length {
                what: "param_lr",
                got: lrs.len(),
                expected: self.params.len(),
            });
        }
        let Some(known) = self.param_lr.as_mut() else {
            return Ok(false);
        };
        let mut changed = false;
        for (old, new) in known.iter_mut().zip(lrs) {
            let merged = match (*old, *new) {
                (Some(a), Some(b)) => Some(a.max(b)),
                (a, b) => a.or(b),
            };
            // (Bits, so that a NaN left as it was is not a change.)
            changed |= merged.map(f64::to_bits) != old.map(f64::to_bits);
            *old = merged;
        }
        Ok(changed)
    }
}

/// A module that owns parameters: the unit of gradient health.
#[derive(Clone, Debug, PartialEq)]
pub struct Layer {
    /// Index into [`ModelSpec::modules`].
    pub module: usize,
    pub name: String,
    pub kind: String,
    /// Parameters of this layer (indices into [`ModelSpec::params`]).
    pub params: Vec<usize>,
    /// The first weight parameter with a fan-in (its presence makes the layer "weighted").
    pub weight: Option<(usize, u64)>,
    /// Every weight parameter with a fan-in (an LSTM has input and recurrent weights), whose
    /// scale is judged against its fan-in.
    pub weights: Vec<(usize, u64)>,
    /// Total number of parameter elements.
    pub numel: u64,
}

/// An activation module.
#[derive(Clone, Debug, PartialEq)]
pub struct Activation {
    pub module: usize,
    pub name: String,
    pub kind: String,
    pub traits: ActivationTraits,
}

/// What the collector should measure on one activation module's output.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ActivationProbe {
    /// Index into [`ModelSpec::modules`].
    pub module: usize,
    /// `(center, half_width)`: an output `y` is saturated when `|y - center| > half_width`.
    pub saturation: Option<(f64, f64)>,
    /// Whether to count units that output zero over the whole batch.
    pub death: bool,
    /// How to compute the mean derivative from the outputs, when it can be.
    pub slope: Option<SlopeFormula>,
}

/// The validated model with derived indices.
#[derive(Clone, Debug, PartialEq)]
pub struct Model {
    pub spec: ModelSpec,
    pub layers: Vec<Layer>,
    /// Layer index of each parameter.
    pub param_layer: Vec<usize>,
    pub activations: Vec<Activation>,
    /// Layer index of each module (None for modules without parameters).
    pub module_layer: Vec<Option<usize>>,
    /// Activation index of each module.
    pub module_activation: Vec<Option<usize>>,
    /// The layer of each module that holds only parameters another module owns (tied
    /// weights), by module index.
    pub module_tied: Vec<Option<usize>>,
    /// True when some module normalizes activations (`BatchNorm`, `LayerNorm`, `GroupNorm`...).
    pub has_normalization: bool,
    /// Layers with a weight matrix or kernel (the depth that gradients travel through).
    pub weighted_depth: usize,
    /// Module index by qualified name.
    by_name: std::collections::HashMap<String, usize>,
    /// The optimizer scales each update to about the learning rate (Adam and its family).
    pub adaptive_optimizer: bool,
    /// Each layer's parameters as a range of the parameter list, when every layer's
    /// parameters are contiguous there (collectors list a module's parameters together): the
    /// engine then sums each layer's norms in one pass instead of scattering per parameter.
    pub layer_ranges: Option<Vec<(usize, usize)>>,
}

/// How a module name is shown to people: the root module, whose qualified name is `""`, is
/// `<model>`.
pub fn display_name(name: &str) -> &str {
    if name.is_empty() { "<model>" } else { name }
}

/// Activation traits of a module class, or None when it is not an activation.
pub fn activation_traits(kind: &str, attrs: &[(String, f64)]) -> Option<ActivationTraits> {
    let attr = |key: &str| attrs.iter().find(|(k, _)| k == key).map(|(_, v)| *v);
    let bounded = |lo, hi, slope| ActivationTraits {
        bounded: Some((lo, hi)),
        can_die: false,
        slope,
    };
    let plain = ActivationTraits {
        bounded: None,
        can_die: false,
        slope: None,
    };
    Some(match kind {
        "Tanh" => bounded(-1.0, 1.0, Some(SlopeFormula::Tanh)),
        "Softsign" => bounded(-1.0, 1.0, Some(SlopeFormula::Softsign)),
        "Sigmoid" => bounded(0.0, 1.0, Some(SlopeFormula::Sigmoid)),
        "Hardsigmoid" => bounded(0.0, 1.0, None),
        "Hardtanh" => bounded(
            attr("min_val").unwrap_or(-1.0),
            attr("max_val").unwrap_or(1.0),
            None,
        ),
        // ReLU6's lower flat region is where it dies; judging "saturation" there would call half
        // of every healthy batch saturated.
        "ReLU" | "ReLU6" => ActivationTraits {
            bounded: None,
            can_die: true,
            slope: None,
        },
        "LeakyReLU" | "PReLU" | "RReLU" | "ELU" | "CELU" | "SELU" | "GELU" | "SiLU" | "Mish"
        | "Softplus" | "Hardswish" | "Softshrink" | "Hardshrink" | "Tanhshrink" => plain,
        _ => return None,
    })
}

/// Optimizers whose per-weight step is normalized by a running gradient scale.
fn is_adaptive(optimizer: &str) -> bool {
    let o = optimizer.to_ascii_lowercase();
    [
        "adam",
        "amsgrad",
        "adabelief",
        "adan",
        "yogi",
        "novograd",
        "sm3",
        "rmsprop",
        "adagrad",
        "adadelta",
        "adafactor",
        "lion",
        "lamb",
        "radam",
        "nadam",
    ]
    .iter()
    .any(|a| o.contains(a))
}

fn is_normalization(kind: &str) -> bool {
    kind.contains("Norm") && kind != "LocalResponseNorm"
}

impl Model {
    /// Validates a description and derives the layer and activation tables.
    pub fn new(spec: ModelSpec) -> Result<Self, EngineError> {
        let n_modules = spec.modules.len();
        if n_modules == 0 {
            return Err(EngineError::Model("the model has no modules".into()));
        }
        let mut module_layer = vec![None; n_modules];
        let mut layers: Vec<Layer> = Vec::new();
        let mut param_layer = Vec::with_capacity(spec.params.len());
        // Layers are ordered like their modules (forward order), not like the parameter list.
        let mut owners: Vec<usize> = spec.params.iter().map(|p| p.module).collect();
        for (i, p) in spec.params.iter().enumerate() {
            if p.module >= n_modules {
                return Err(EngineError::Model(format!(
                    "parameter {} (#{i}) names module {} but the model has {n_modules} modules",
                    p.name, p.module
                )));
            }
        }
        if let Some(lrs) = &spec.param_lr {
            if lrs.len() != spec.params.len() {
                return Err(EngineError::Model(format!(
                    "param_lr has {} entries for {} parameters",
                    lrs.len(),
                    spec.params.len()
                )));
            }
        }
        if let Some(wds) = &spec.param_weight_decay {
            if wds.len() != spec.params.len() {
                return Err(EngineError::Model(format!(
                    "param_weight_decay has {} entries for {} parameters",
                    wds.len(),
                    spec.params.len()
                )));
            }
            if let Some(wd) = wds.iter().find(|wd| !(wd.is_finite() && **wd >= 0.0)) {
                return Err(EngineError::Model(format!(
                    "param_weight_decay holds {wd}: a weight decay is a finite number >= 0"
                )));
            }
        }
        if let Some(lr) = spec.base_lr.filter(|lr| !(lr.is_finite() && *lr > 0.0)) {
            return Err(EngineError::Model(format!(
                "base_lr is {lr}: the learning rate an optimizer was built with is a finite number > 0"
            )));
        }
        check_feature_scales(spec.input_feature_scales.as_deref())?;
        owners.sort_unstable();
        owners.dedup();
        for m in owners {
            module_layer[m] = Some(layers.len());
            layers.push(Layer {
                module: m,
                name: spec.modules[m].name.clone(),
                kind: spec.modules[m].kind.clone(),
                params: Vec::new(),
                weight: None,
                weights: Vec::new(),
                numel: 0,
            });
        }
        for (i, p) in spec.params.iter().enumerate() {
            let l = module_layer[p.module].expect("every owner module has a layer");
            param_layer.push(l);
            let layer = &mut layers[l];
            layer.params.push(i);
            layer.numel += p.numel;
            if p.role == ParamRole::Weight {
                if let Some(fan_in) = p.fan_in.filter(|f| *f > 0) {
                    layer.weight.get_or_insert((i, fan_in));
                    layer.weights.push((i, fan_in));
                }
            }
        }
        let mut module_tied = vec![None; n_modules];
        for (i, p) in spec.params.iter().enumerate() {
            for &m in &p.tied {
                if m >= n_modules {
                    return Err(EngineError::Model(format!(
                        "parameter {} (#{i}) is tied to module {m} but the model has {n_modules} modules",
                        p.name
                    )));
                }
                if module_layer[m].is_none() {
                    module_tied[m].get_or_insert(param_layer[i]);
                }
            }
        }
        let mut module_activation = vec![None; n_modules];
        let mut activations = Vec::new();
        for (m, module) in spec.modules.iter().enumerate() {
            if let Some(traits) = activation_traits(&module.kind, &module.attrs) {
                if let Some((lo, hi)) = traits.bounded {
                    if !(lo.is_finite() && hi.is_finite() && lo < hi) {
                        return Err(EngineError::Model(format!(
                            "activation {:?} has bounds ({lo}, {hi}); expected finite lo < hi",
                            module.name
                        )));
                    }
                }
                module_activation[m] = Some(activations.len());
                activations.push(Activation {
                    module: m,
                    name: module.name.clone(),
                    kind: module.kind.clone(),
                    traits,
                });
            }
        }
        let has_normalization = spec.modules.iter().any(|m| is_normalization(&m.kind));
        let weighted_depth = layers.iter().filter(|l| l.weight.is_some()).count();
        let adaptive_optimizer = spec.optimizer.as_deref().is_some_and(is_adaptive);
        let by_name = spec
            .modules
            .iter()
            .enumerate()
            .map(|(i, m)| (m.name.clone(), i))
            .collect();
        let layer_ranges = layers
            .iter()
            .map(|l| {
                let (first, last) = (*l.params.first()?, *l.params.last()?);
                (last + 1 - first == l.params.len()).then_some((first, last + 1))
            })
            .collect();
        Ok(Self {
            spec,
            layers,
            param_layer,
            activations,
            module_layer,
            module_activation,
            module_tied,
            has_normalization,
            weighted_depth,
            by_name,
            adaptive_optimizer,
            layer_ranges,
        })
    }

    /// What the collector should measure for each activation module, in activation order.
    pub fn probes(&self, saturation_band: f64) -> Vec<ActivationProbe> {
        self.activations
            .iter()
            .map(|a| ActivationProbe {
                module: a.module,
                saturation: a.traits.bounded.map(|(lo, hi)| {
                    let half = (hi - lo) / 2.0;
                    (lo + half, half - saturation_band * (hi - lo))
                }),
                death: a.traits.can_die,
                slope: a.traits.slope,
            })
            .collect()
    }

    /// Index of the module with this qualified name.
    pub fn module_index(&self, name: &str) -> Option<usize> {
        self.by_name.get(name).copied()
    }

    /// The layer whose gradients module `m` reports: its own, or, for a module that holds only
    /// tied parameters, the layer that owns them (with `true`).
    pub fn layer_of_module(&self, m: usize) -> Option<(usize, bool)> {
        self.module_layer[m]
            .map(|l| (l, false))
            .or_else(|| self.module_tied[m].map(|l| (l, true)))
    }

    /// Whether every parameter of layer `l` was frozen when the model was registered.
    pub fn layer_frozen(&self, l: usize) -> bool {
        self.layers[l]
            .params
            .iter()
            .all(|&p| self.spec.params[p].frozen)
    }

    /// Position of a module in forward order (its index).
    pub fn module_name(&self, index: usize) -> &str {
        &self.spec.modules[index].name
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// A Linear/activation stack of `depth` blocks: modules `fc{i}`, `act{i}`, root last.
    pub fn mlp_spec(depth: usize, act: &str) -> ModelSpec {
        let mut spec = ModelSpec::default();
        for i in 0..depth {
            let fc = spec.module(format!("fc{i}"), "Linear");
            spec.param(fc, format!("fc{i}.weight"), &[32, 32]);
            spec.param(fc, format!("fc{i}.bias"), &[32]);
            spec.module(format!("act{i}"), act);
        }
        spec.module("", "Sequential");
        spec.optimizer = Some("SGD".into());
        spec
    }

    #[test]
    fn layers_follow_forward_order_and_params_map_to_them() {
        let m = Model::new(mlp_spec(3, "Tanh")).unwrap();
        assert_eq!(m.layers.len(), 3);
        assert_eq!(m.layers[1].name, "fc1");
        assert_eq!(m.param_layer, vec![0, 0, 1, 1, 2, 2]);
        assert_eq!(m.layer_ranges, Some(vec![(0, 2), (2, 4), (4, 6)]));
        assert_eq!(m.activations.len(), 3);
        assert_eq!(m.weighted_depth, 3);
        assert!(!m.has_normalization);
        let probes = m.probes(0.01);
        let (c, h) = probes[0].saturation.unwrap();
        assert!((c - 0.0).abs() < 1e-12 && (h - 0.98).abs() < 1e-12);
        assert!(!probes[0].death);
    }

    #[test]
    fn relu_dies_but_does_not_saturate_and_linear_is_not_an_activation() {
        let m = Model::new(mlp_spec(2, "ReLU")).unwrap();
        let probes = m.probes(0.01);
        assert!(probes[0].saturation.is_none());
        assert!(probes[0].death);
        assert!(activation_traits("Linear", &[]).is_none());
        let sig = activation_traits("Sigmoid", &[]).unwrap();
        assert_eq!(sig.bounded, Some((0.0, 1.0)));
    }

    #[test]
    fn a_module_holding_only_tied_parameters_resolves_to_their_layer() {
        let mut spec = ModelSpec::default();
        let emb = spec.module("emb", "Embedding");
        spec.param(emb, "emb.weight", &[64, 16]);
        let head = spec.module("head", "Linear");
        spec.module("", "Net");
        spec.params[0].tied = vec![head];
        let m = Model::new(spec.clone()).unwrap();
        assert_eq!(m.layers.len(), 1, "the head is not a layer of its own");
        assert_eq!(m.layer_of_module(emb), Some((0, false)));
        assert_eq!(m.layer_of_module(head), Some((0, true)));
        assert_eq!(m.layer_of_module(2), None);
        spec.params[0].tied = vec![9];
        assert!(
            Model::new(spec)
                .unwrap_err()
                .to_string()
                .contains("tied to module 9")
        );
    }

    #[test]
    fn a_layer_is_frozen_when_all_its_parameters_were() {
        let mut spec = mlp_spec(2, "ReLU");
        spec.params[0].frozen = true;
        let m = Model::new(spec.clone()).unwrap();
        assert!(!m.layer_frozen(0), "its bias was trainable");
        spec.params[1].frozen = true;
        let m = Model::new(spec.clone()).unwrap();
        assert!(m.layer_frozen(0) && !m.layer_frozen(1));
        // Old descriptions (no such fields) read as nothing tied, nothing frozen.
        let json = serde_json::to_string(&mlp_spec(1, "ReLU")).unwrap();
        assert!(!json.contains("tied") && !json.contains("frozen"));
        let back: ModelSpec = serde_json::from_str(&json).unwrap();
        assert!(back.params.iter().all(|p| p.tied.is_empty() && !p.frozen));
    }

    #[test]
    fn interleaved_parameters_have_no_ranges() {
        let mut spec = mlp_spec(2, "ReLU");
        spec.params.swap(1, 2); // fc0.weight, fc1.weight, fc0.bias, fc1.bias
        let m = Model::new(spec).unwrap();
        assert_eq!(m.layer_ranges, None);
        assert_eq!(m.param_layer, vec![0, 1, 0, 1]);
    }

    #[test]
    fn bad_param_owner_is_an_error() {
        let mut spec = mlp_spec(1, "ReLU");
        spec.params[0].module = 99;
        let err = Model::new(spec).unwrap_err().to_string();
        assert!(err.contains("fc0.weight"), "{err}");
    }

    #[test]
    fn param_lrs_of_several_optimizers_merge_to_held_by_any_at_the_largest_lr() {
        // Four parameters. The first optimizer holds p0 at 0.1 and p2 in a group at lr 0; the
        // second holds p1 at 0.01 and p2 at 0.05; none holds p3.
        let mut spec = mlp_spec(2, "Tanh");
        spec.param_lr = Some(vec![Some(0.1), None, Some(0.0), None]);
        let second = [None, Some(0.01), Some(0.05), None];
        assert_eq!(spec.merge_param_lr(Some(&second)), Ok(true));
        assert_eq!(
            spec.param_lr,
            Some(vec![Some(0.1), Some(0.01), Some(0.05), None])
        );
        // Told again (or in the other order): the same facts, no change.
        assert_eq!(spec.merge_param_lr(Some(&second)), Ok(false));
        let first = [Some(0.1), None, Some(0.0), None];
        assert_eq!(spec.merge_param_lr(Some(&first)), Ok(false));
        // A smaller lr elsewhere does not lower a parameter's lr.
        let third = [Some(1e-4), Some(1e-4), None, None];
        assert_eq!(spec.merge_param_lr(Some(&third)), Ok(false));
        assert_eq!(
            spec.param_lr,
            Some(vec![Some(0.1), Some(0.01), Some(0.05), None])
        );
        // One lr per parameter, or the call is refused and nothing changes.
        let err = spec.merge_param_lr(Some(&[Some(1.0)])).unwrap_err();
        assert_eq!(err.to_string(), "param_lr has 1 values, expected 4");
        assert_eq!(spec.param_lr.as_ref().map(Vec::len), Some(4));
        // An optimizer whose lrs cannot be read: the lrs are not known any more, and stay so.
        assert_eq!(spec.merge_param_lr(None), Ok(true));
        assert_eq!(spec.param_lr, None);
        assert_eq!(spec.merge_param_lr(Some(&second)), Ok(false));
        assert_eq!(spec.param_lr, None);
    }

    #[test]
    fn the_rate_an_optimizer_was_built_with_is_a_positive_number() {
        for bad in [0.0, -0.1, f64::NAN, f64::INFINITY] {
            let spec = ModelSpec {
                base_lr: Some(bad),
                ..mlp_spec(2, "ReLU")
            };
            let err = Model::new(spec).unwrap_err().to_string();
            assert!(err.contains("base_lr is"), "{err}");
        }
        let spec = ModelSpec {
            base_lr: Some(0.1),
            ..mlp_spec(2, "ReLU")
        };
        assert!(Model::new(spec).is_ok());
    }
}
