//! What to do about a failure: each remedy is a value with its parameters (a layer, a learning
//! rate, a step), chosen by the cause and failure rules and rendered to text here, in one place.

use super::text::{num, show};

/// The framework a remedy is said for: the functions it names are that framework's.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Framework {
    /// `PyTorch`, and a spec that names no framework.
    Torch,
    Keras,
    Jax,
    /// burn: where a remedy names no function of burn's, it reads as `PyTorch`'s.
    Burn,
}

impl Framework {
    /// From `ModelSpec::framework`.
    pub(crate) fn of(name: Option<&str>) -> Self {
        match name {
            Some("keras") => Framework::Keras,
            Some("jax") => Framework::Jax,
            Some("burn") => Framework::Burn,
            _ => Framework::Torch,
        }
    }

    /// The one of three wordings for this framework (burn reads `PyTorch`'s).
    pub(crate) fn pick(self, torch: &str, keras: &str, jax: &str) -> String {
        self.pick4(torch, keras, jax, torch)
    }

    /// The one of four wordings for this framework.
    fn pick4(self, torch: &str, keras: &str, jax: &str, burn: &str) -> String {
        match self {
            Framework::Torch => torch,
            Framework::Keras => keras,
            Framework::Jax => jax,
            Framework::Burn => burn,
        }
        .to_string()
    }
}

/// One concrete change to the user's code. Layers are qualified module names; rates and steps
/// are the run's own values.
#[derive(Clone, Debug, PartialEq)]
pub(crate) enum Remedy {
    // Step size.
    LowerLr {
        lr: Option<f64>,
    },
    RaiseLr {
        lr: Option<f64>,
    },
    /// The learning rate fell to nothing long before the end: a schedule decaying too fast.
    ScheduleDecaysTooFast {
        peak: f64,
        last: f64,
    },
    /// A scheduler holds the rate at `held`, its first value, far below the `base` the
    /// optimizer was built with: it is never stepped.
    StepTheScheduler {
        base: f64,
        held: f64,
    },
    /// The warmup had not ended when the run did: after `steps` steps the rate had reached only
    /// `reached`.
    ShortenWarmup {
        steps: u64,
        reached: f64,
    },
    /// The loss does not reach the model's output through the framework's operations.
    LossFromTheOutput,
    /// Dropout zeroes a share `p` of the units, far more than is usual.
    LowerDropout {
        p: f64,
    },
    /// Gradient clipping cut every step's gradient to `ratio` of its norm (typically).
    LoosenClip {
        ratio: f64,
    },
    /// The clip ran on gradients still multiplied by the loss scale `scale`, cutting them
    /// `1 / ratio` times.
    UnscaleBeforeClip {
        scale: f64,
        ratio: f64,
    },
    /// The optimizer's updates were computed and never applied to the weights the model runs with.
    ApplyTheUpdates,
    /// Clip gradient norms before the optimizer step.
    ClipGradients,
    /// Clip while the cause of an explosion is fixed.
    ClipWhileFixing,
    Warmup,
    LrRangeTest,
    AdaptiveOptimizer,
    // Activations.
    ReplaceRelu {
        layer: Option<String>,
    },
    CheckBiasInit,
    BatchNormBeforeRelu,
    ReplaceSaturating,
    XavierAndNormalizeInputs,
    NormBeforeSaturating,
    // Normalization and depth.
    AddNormalization,
    InitKeepsScale,
    ResidualConnections,
    NormBetweenBlocks,
    ReduceDepth,
    // Initialization.
    InitForActivation,
    /// Random weights instead of a constant: units that start identical stay identical.
    RandomInit {
        layer: Option<String>,
    },
    CheckCustomInit {
        layer: Option<String>,
    },
    OrthogonalRecurrentInit {
        layer: Option<String>,
    },
    BoundedRecurrence,
    // Numerics.
    GuardUnstableOp {
        layer: Option<String>,
    },
    Float32ForOp,
    DetectAnomalyStep,
    TrainInBfloat16,
    KeepModuleInFloat32,
    LowerLrOrNormalize,
    // Data.
    InspectBatch {
        step: u64,
    },
    NormalizeInputs,
    StandardizeEachFeature,
    ShuffleData,
    PairTargetsWithInputs,
    OverfitOneBatch,
    FindWhereInputIsLost,
    CheckInputsVary,
    // Loop mistakes.
    ZeroGradEachStep,
    ZeroGradBeforeBackward,
    AccumulateOnPurpose,
    CallTrain,
    RestoreModeAfterEval,
    PassToOptimizer {
        layer: Option<String>,
    },
    CheckParamGroupLr,
    FindGraphCut {
        layer: Option<String>,
    },
    /// `cut`: the layer gets no gradient (the graph is cut), rather than one it never follows.
    FreezeOnPurpose {
        layer: Option<String>,
        cut: bool,
    },
    MatchTargetShape,
    KeepShapeWarning,
    StepDownTheGradient,
    // A weight penalty in the loss.
    LowerWeightPenalty,
    LowerWeightDecay,
    FitWithoutPenalty,
    // Output activation and loss.
    CheckOutputActivation,
    OneUnitSoftmax,
    OneUnitCrossEntropy,
    /// Class indices reach `hi`, the output has `units`.
    OneUnitPerClass {
        hi: f64,
        units: u64,
    },
    SoftmaxOverClasses,
    RemoveSoftmaxBeforeCrossEntropy,
    NllOnLogSoftmax,
    LogSoftmaxForNll,
    LogSoftmaxBeforeNll,
    /// Layers the model uses but does not hold (unregistered parameters).
    RegisterLayers,
    /// `module` reads the batch as the sequence.
    BatchFirst {
        module: String,
    },
    /// The model reads `module`'s output at the start of the sequence only.
    ReadLastStep {
        module: String,
    },
    /// The log of a binary cross-entropy taken of raw outputs.
    SigmoidForBinaryLog,
    RemoveSigmoidBeforeLogitsLoss,
    RemoveSoftmaxBeforeLogitsLoss,
    /// Labels that are not exclusive: one sigmoid each.
    SigmoidPerLabel,
    OneSigmoid,
    KeepSigmoidUseBce,
    /// `output`: the bounding operation, as the framework names it.
    RemoveBoundedLogits {
        output: Option<String>,
    },
    RemoveBoundedRegression {
        output: Option<String>,
    },
    ScaleTargetsIntoRange,
    /// Regression targets on their raw scale.
    StandardizeTargets,
    /// A binary cross-entropy's targets span [`lo`, `hi`], outside [0, 1].
    TargetsIntoProbabilities {
        lo: f64,
        hi: f64,
    },
    // Data-parallel replicas.
    FindRankOnlyCode,
    SameStepsOnEveryRank,
    NothingOutsideDdp,
    // Nothing named.
    InspectHistory,
    DetectAnomaly,
}

impl Remedy {
    /// Whether the remedy is to clip gradients (moot when clipping was already on).
    pub fn clips(&self) -> bool {
        matches!(self, Remedy::ClipGradients | Remedy::ClipWhileFixing)
    }

    /// The remedy as the user of `framework` reads it.
    #[allow(clippy::too_many_lines)]
    pub fn text(&self, framework: Framework) -> String {
        let fw = |torch: &str, keras: &str, jax: &str| framework.pick(torch, keras, jax);
        let fw4 = |torch: &str, keras: &str, jax: &str, burn: &str| {
            framework.pick4(torch, keras, jax, burn)
        };
        let of = |layer: &Option<String>, before: &str| {
            layer
                .as_deref()
                .map(|l| format!("{before}{}", show(l)))
                .unwrap_or_default()
        };
        let the_layer = |layer: &Option<String>| {
            layer
                .as_deref()
                .map_or_else(|| "the layer".to_string(), show)
        };
        let op = |o: &Option<String>| o.clone().unwrap_or_else(|| "activation".into());
        match self {
            Remedy::LowerLr { lr } => lr.map_or_else(
                || "lower the learning rate 10x".to_string(),
                |lr| format!("lower the learning rate 10x (it was {})", num(lr)),
            ),
            Remedy::RaiseLr { lr } => lr.map_or_else(
                || "raise the learning rate 10x".to_string(),
                |lr| format!("raise the learning rate 10x (it was {})", num(lr)),
            ),
            Remedy::ScheduleDecaysTooFast { peak, last } => format!(
                "{} (the learning rate went from {} to {})",
                fw(
                    "step the scheduler as often as it was written for: StepLR, MultiStepLR and ExponentialLR decay at every scheduler.step(), so call it once per epoch, not per batch (or set step_size/gamma for batches)",
                    "give the schedule decay_steps counted in optimizer updates (batches), not epochs",
                    "give the optax schedule its decay in optimizer updates (transition_steps, decay_steps), not epochs",
                ),
                num(*peak),
                num(*last)
            ),
            Remedy::StepTheScheduler { base, held } => format!(
                "call scheduler.step() after each optimizer.step() (or once per epoch, as the scheduler counts): until it is stepped it holds the learning rate at {}, its first value, not the optimizer's {}",
                num(*held),
                num(*base)
            ),
            Remedy::ShortenWarmup { steps, reached } => format!(
                "shorten the learning-rate warmup, counted in optimizer steps (batches), not epochs or samples: after {steps} steps it had reached only {}",
                num(*reached)
            ),
            Remedy::LossFromTheOutput => fw(
                "compute the loss from the model's output with torch operations: no .item(), .detach(), .data, .numpy() or torch.tensor(...) between the output and loss.backward()",
                "compute the loss from the model's output with keras.ops inside the GradientTape or train_step: no .numpy() or float() between them",
                "compute the loss from the model's output inside the function jax.grad differentiates: no jax.lax.stop_gradient, float() or numpy between them",
            ),
            Remedy::LowerDropout { p } => format!(
                "{} ({} zeroes {:.0}% of the units at each step; 0.1-0.5 is usual)",
                fw(
                    "lower Dropout's p: it is the share of units dropped, not kept",
                    "lower Dropout's rate: it is the share of units dropped, not kept (TensorFlow 1's keep_prob was the opposite)",
                    "lower nnx.Dropout's rate: it is the share of units dropped, not kept",
                ),
                num(*p),
                100.0 * p
            ),
            Remedy::UnscaleBeforeClip { scale, ratio } => format!(
                "call scaler.unscale_(optimizer) before clip_grad_norm_, then scaler.step(optimizer): the clip saw the gradients multiplied by the loss scale ({scale:.0}) and cut them ~{}x",
                super::causes::times(1.0 / ratio)
            ),
            Remedy::LoosenClip { ratio } => format!(
                "{} (it cut the gradient ~{}x on almost every step): clip near the gradient norms the run produces, or not at all",
                fw4(
                    "raise max_norm in clip_grad_norm_",
                    "raise the optimizer's clipnorm / global_clipnorm",
                    "raise optax.clip_by_global_norm's max_norm",
                    "raise the norm of the optimizer's GradientClippingConfig",
                ),
                super::causes::times(1.0 / ratio)
            ),
            Remedy::ClipGradients => fw4(
                "clip gradients: torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0) before optimizer.step()",
                "clip gradients: give the optimizer global_clipnorm=1.0 (e.g. keras.optimizers.Adam(..., global_clipnorm=1.0))",
                "clip gradients: optax.chain(optax.clip_by_global_norm(1.0), tx)",
                "clip gradients: the optimizer's config .with_grad_clipping(Some(GradientClippingConfig::Norm(1.0)))",
            ),
            Remedy::ClipWhileFixing => "clip gradients at 1.0 while you fix the cause".into(),
            Remedy::Warmup => "add a learning-rate warmup over the first few hundred steps".into(),
            Remedy::LrRangeTest => "run a learning-rate range test (increase lr each step and watch the loss)".into(),
            Remedy::AdaptiveOptimizer => "switch to an adaptive optimizer such as Adam".into(),
            Remedy::ReplaceRelu { layer } => {
                let at = layer.as_deref().map(|l| format!(" ({})", show(l))).unwrap_or_default();
                format!("replace ReLU{at} with LeakyReLU(0.01) or GELU")
            }
            Remedy::CheckBiasInit => "check the bias initialization of the layer before it (negative biases switch units off)".into(),
            Remedy::BatchNormBeforeRelu => "add BatchNorm before the ReLU".into(),
            Remedy::ReplaceSaturating => "replace tanh/sigmoid with ReLU, GELU or SiLU in hidden layers".into(),
            Remedy::XavierAndNormalizeInputs => format!(
                "use {} initialization and normalize the inputs so pre-activations stay near zero",
                fw4(
                    "xavier_normal_",
                    "glorot_normal (kernel_initializer=\"glorot_normal\")",
                    "glorot_normal (kernel_init=nnx.initializers.glorot_normal())",
                    "Xavier normal (.with_initializer(Initializer::XavierNormal { gain: 1.0 }))",
                )
            ),
            Remedy::NormBeforeSaturating => "add LayerNorm or BatchNorm before the saturating activations".into(),
            Remedy::AddNormalization => "add BatchNorm (CNNs) or LayerNorm (MLPs, transformers) between layers".into(),
            Remedy::InitKeepsScale => "initialize weights for the activation so the signal keeps its scale".into(),
            Remedy::ResidualConnections => "add residual (skip) connections so gradients bypass the deep stack".into(),
            Remedy::NormBetweenBlocks => "add normalization (LayerNorm/BatchNorm) between blocks".into(),
            Remedy::ReduceDepth => "reduce the depth, or initialize for depth (e.g. scaled or orthogonal init)".into(),
            Remedy::InitForActivation => format!("initialize weights for the activation: {}", fw4(
                "kaiming_normal_ for ReLU, xavier_normal_ (gain 5/3 for tanh) otherwise",
                "kernel_initializer=\"he_normal\" for ReLU, \"glorot_normal\" otherwise",
                "kernel_init=nnx.initializers.he_normal() for ReLU, glorot_normal() otherwise",
                "Initializer::KaimingNormal for ReLU, Initializer::XavierNormal (gain 5/3 for tanh) otherwise",
            )),
            Remedy::RandomInit { layer } => format!(
                "initialize {} randomly ({}), not with a constant: units that start with the same weights get the same gradient and stay the same",
                layer.as_deref().map_or_else(|| "the weights".into(), |l| format!("the weights of {}", show(l))),
                fw4(
                    "kaiming_normal_ for ReLU, xavier_normal_ otherwise",
                    "\"he_normal\" for ReLU, \"glorot_normal\" otherwise",
                    "nnx.initializers.he_normal() for ReLU, glorot_normal() otherwise",
                    "Initializer::KaimingNormal for ReLU, Initializer::XavierNormal otherwise",
                )
            ),
            Remedy::CheckCustomInit { layer } => format!(
                "check custom init code{} for weights scaled far from 1/sqrt(fan_in)",
                of(layer, " of ")
            ),
            Remedy::OrthogonalRecurrentInit { layer } => format!(
                "initialize the recurrent weights of {} so they do not amplify the state: {}",
                layer.as_deref().map_or_else(|| "the recurrent layer".into(), show),
                fw(
                    "torch.nn.init.orthogonal_ on each weight_hh block (gain 1), or keep PyTorch's default",
                    "recurrent_initializer=\"orthogonal\" (Keras' default)",
                    "an orthogonal initializer (nnx.initializers.orthogonal()) for the recurrent kernel",
                )
            ),
            Remedy::BoundedRecurrence => "use a bounded recurrence (nonlinearity='tanh', or LSTM/GRU) instead of a ReLU RNN".into(),
            Remedy::GuardUnstableOp { layer } => format!(
                "look for log, division, sqrt, exp or pow on unbounded values in the forward{}; add an eps or clamp",
                of(layer, " of ")
            ),
            Remedy::Float32ForOp => "compute that operation in float32 if it runs in half precision".into(),
            Remedy::DetectAnomalyStep => format!("run that one step {} to get the exact operation", nan_check(framework)),
            Remedy::TrainInBfloat16 => format!("train in bfloat16 ({}): float32's range, no loss scaling needed", fw(
                "torch.autocast(dtype=torch.bfloat16)",
                "keras.mixed_precision.set_global_policy(\"mixed_bfloat16\")",
                "dtype=jnp.bfloat16 with param_dtype=jnp.float32",
            )),
            Remedy::KeepModuleInFloat32 => fw(
                "keep the overflowing module in float32 (wrap it in torch.autocast(enabled=False))",
                "keep the overflowing layer in float32 (dtype=\"float32\" for that layer)",
                "keep the overflowing module in float32 (dtype=jnp.float32 for it)",
            ),
            Remedy::LowerLrOrNormalize => "lower the learning rate, or normalize the activations that grow (LayerNorm)".into(),
            Remedy::InspectBatch { step } => format!(
                "inspect the batch of step {step}: assert {} in the data pipeline",
                fw4("torch.isfinite(x).all()", "np.isfinite(x).all()", "np.isfinite(x).all()", "!x.is_nan().any()")
            ),
            Remedy::NormalizeInputs => "normalize inputs (zero mean, unit variance) and filter corrupt samples".into(),
            Remedy::StandardizeEachFeature => "standardize each feature on its own (subtract its mean and divide by its standard deviation over the training set, e.g. sklearn's StandardScaler), once: not by one scale for all, not twice".into(),
            Remedy::StepDownTheGradient => fw(
                "step down the gradient: remove whatever negates it between loss.backward() and optimizer.step() (p.grad.neg_(), p.grad = -p.grad), write an update by hand as p -= lr * p.grad, and give an optimizer maximize=True only for a quantity meant to grow",
                "apply the gradients as the tape gives them: optimizer.apply_gradients(zip(grads, model.trainable_variables)), not their negation; an update by hand is variable.assign_sub(lr * grad)",
                "apply the updates optax returns as they are, optax.apply_updates(params, updates), not their negation; an update by hand is params - lr * grads; optax.masked passes the masked-out leaves' gradients through as their updates: freeze them with optax.multi_transform and optax.set_to_zero()",
            ),
            Remedy::ZeroGradEachStep => "call optimizer.zero_grad() once per step, before loss.backward() (or model.zero_grad() when parameters are stepped by hand)".into(),
            Remedy::ShuffleData => fw(
                "shuffle the training data every epoch: DataLoader(dataset, batch_size=..., shuffle=True)",
                "shuffle the training data: fit(..., shuffle=True) on arrays, or dataset.shuffle(len(dataset)) before .batch() in a tf.data pipeline",
                "shuffle the training data every epoch: index it with jax.random.permutation(key, n) before cutting batches",
            ),
            Remedy::PairTargetsWithInputs => fw(
                "check that each target belongs to its input: shuffle inputs and targets with one permutation (one Dataset indexed by one index), take the label column the task means, and look at a few samples with their labels",
                "check that each target belongs to its input: shuffle x and y together (one permutation, or fit(x, y, shuffle=True) on the pair), take the label column the task means, and look at a few samples with their labels",
                "check that each target belongs to its input: index x and y with one jax.random.permutation, take the label column the task means, and look at a few samples with their labels",
            ),
            Remedy::CheckInputsVary => "print the first few inputs as the model receives them (x[:4]): every value the same means the data pipeline lost them; look for values in [0, 1) cast to integers (x.long(), astype(int)), a normalization divided by a spread of 0, a mask or transform that zeroes everything".into(),
            Remedy::FindWhereInputIsLost => fw(
                "print model(x[:4]) for four different samples: identical rows mean the forward pass loses its input; look for a mean, sum or expand over dim 0 (the batch), an input overwritten or replaced by one sample's, a LayerNorm or BatchNorm over a dimension of size 1, features cast to integers",
                "print model.predict(x[:4]) for four different samples: identical rows mean the forward pass loses its input; look for a reduction over axis 0 (the batch) in a Lambda layer or call(), an input overwritten or replaced by one sample's, a LayerNormalization over a single feature, features cast to integers",
                "print model(x[:4]) for four different samples: identical rows mean the forward pass loses its input; look for jnp.mean/sum or a broadcast over axis 0 (the batch), an input overwritten or replaced by one sample's, a LayerNorm over a dimension of size 1, features cast to integers",
            ),
            Remedy::OverfitOneBatch => "train on one small batch (e.g. 32 samples) for a few hundred steps: a model that cannot drive the loss to ~0 there is not being given its targets".into(),
            Remedy::ApplyTheUpdates => fw4(
                "make optimizer.step() move the weights the model runs with: build the optimizer from this model's parameters after the model is final (not from a copy or an earlier instance), and do not reload or reassign the weights inside the loop",
                "apply the gradients to the weights the model runs with (optimizer.apply(grads, model.trainable_variables)), and do not reset them (set_weights, load_weights) between batches",
                "apply the updates and carry them: params = optax.apply_updates(params, updates), returned from the step and passed into the next one with the new optimizer state (nnx: optimizer.update(model, grads)); do not re-initialize the parameters inside the loop",
                "assign the optimizer's result: model = optimizer.step(lr, model, grads), and train the model it returns",
            ),
            Remedy::ZeroGradBeforeBackward => "in each iteration: optimizer.zero_grad(), the forward pass, loss.backward(), then optimizer.step(); never zero_grad() between backward() and step(), and never step() before backward(): either way the step finds the gradients cleared".into(),
            Remedy::AccumulateOnPurpose => "when accumulating on purpose over k micro-batches, zero after every optimizer.step() and divide the loss by k".into(),
            Remedy::CallTrain => "call model.train() before the training loop (and again after every evaluation that calls model.eval())".into(),
            // (Keras passes the mode to each call: only PyTorch's and nnx's modules keep one.)
            Remedy::RestoreModeAfterEval if framework == Framework::Jax => "end every evaluation with model.train(): nnx keeps the mode in each BatchNorm (use_running_average) and Dropout (deterministic), and a step jitted after model.eval() is compiled in it".into(),
            Remedy::RestoreModeAfterEval => "wrap evaluation in a helper that restores the mode: was = model.training; model.eval(); ...; model.train(was)".into(),
            Remedy::PassToOptimizer { layer } => format!(
                "pass the parameters of {} to the optimizer: build it from model.parameters() after every layer is created (an optimizer made before a layer was added or replaced does not hold it)",
                the_layer(layer)
            ),
            Remedy::CheckParamGroupLr => "check every param group's lr (print [g['lr'] for g in optimizer.param_groups]) and the scheduler: a group with lr 0 never moves".into(),
            Remedy::FindGraphCut { layer } => format!(
                "find where the output of {} leaves the graph on its way to the loss: a .detach(), a torch.no_grad() block, .data, .item() or a numpy round trip; remove it",
                the_layer(layer)
            ),
            Remedy::FreezeOnPurpose { layer, cut: true } => format!(
                "if {} is meant to stay frozen, say so: call requires_grad_(False) on its parameters",
                the_layer(layer)
            ),
            Remedy::FreezeOnPurpose { layer, cut: false } => format!(
                "if {} is meant to stay frozen, call requires_grad_(False) on its parameters so no gradient is computed for it",
                the_layer(layer)
            ),
            Remedy::MatchTargetShape => fw(
                "make the output and the target the same shape before the loss: criterion(output.squeeze(-1), y) or criterion(output, y.unsqueeze(-1)) (or y.view_as(output))",
                "give the targets the shape of the model's output: y.reshape(-1, 1) for one output unit",
                "make the output and the targets the same shape before the loss: loss(logits[:, 0], labels) or loss(logits, labels[:, None]) (optax broadcasts them without a word)",
            ),
            Remedy::LowerWeightPenalty => "lower the weight penalty's coefficient 100-1000x (L2 of 1e-4 to 1e-5 per weight is usual), or use the optimizer's weight_decay (AdamW) instead of a term in the loss".into(),
            Remedy::LowerWeightDecay => "lower the optimizer's weight_decay 10-100x (5e-4 with SGD is usual), or switch to AdamW, whose decay does not pass through the gradient".into(),
            Remedy::FitWithoutPenalty => "train once without the penalty: the model should fit the training batches; then add it back at a strength that keeps that fit".into(),
            Remedy::KeepShapeWarning => "PyTorch warns about this (\"Using a target size that is different to the input size\"): do not silence that warning".into(),
            Remedy::CheckOutputActivation => "check that the model's last activation is the one the loss expects".into(),
            Remedy::OneUnitSoftmax => format!("a softmax over one unit is always 1: for a binary target drop the softmax and {}", fw(
                "use BCEWithLogitsLoss on the single logit, or output 2 units with CrossEntropyLoss",
                "use BinaryCrossentropy(from_logits=True) on the single logit, or output 2 units with a categorical cross-entropy",
                "use optax.sigmoid_binary_cross_entropy on the single logit, or output 2 units with optax.softmax_cross_entropy",
            )),
            Remedy::OneUnitCrossEntropy => format!("a cross-entropy over classes needs one output unit per class: {}", fw(
                "output 2 units for a binary target (CrossEntropyLoss), or keep 1 and use BCEWithLogitsLoss",
                "give the output layer one unit per class (Dense(2) for a binary target, with a sparse categorical cross-entropy), or keep Dense(1) and use a binary cross-entropy (from_logits=True on a linear output, or a sigmoid with from_logits=False)",
                "output one unit per class for optax.softmax_cross_entropy, or keep 1 and use optax.sigmoid_binary_cross_entropy",
            )),
            Remedy::OneUnitPerClass { hi, units } => format!(
                "give the output one unit per class ({} for class indices up to {}), or count the labels from 0 if they were counted from 1 (y - 1), so that every index names a unit (the output has {units})",
                *hi as u64 + 1,
                num(*hi)
            ),
            Remedy::SoftmaxOverClasses => fw(
                "take the softmax over the classes, the last dimension (softmax(logits, dim=-1) or dim=1), not over the batch (dim=0)",
                "take the softmax over the classes, the last axis (axis=-1), not over the batch (axis=0)",
                "take the softmax over the classes, the last axis (jax.nn.softmax(logits, axis=-1)), not over the batch (axis=0)",
            ),
            Remedy::RemoveSoftmaxBeforeCrossEntropy => fw(
                "remove the final Softmax (or .softmax()) from the model: CrossEntropyLoss takes raw logits; apply softmax only at inference",
                "a cross-entropy with from_logits=True takes raw logits: remove the final softmax (activation=None); apply softmax only at inference",
                "remove the final softmax from the model: optax.softmax_cross_entropy takes raw logits; apply softmax only at inference",
            ),
            Remedy::NllOnLogSoftmax => fw(
                "or keep the model's output and switch to NLLLoss on torch.log_softmax(...) instead of softmax",
                "or keep the softmax and set from_logits=False",
                "or make the model's last operation jax.nn.log_softmax instead of softmax: the loss's own log-softmax leaves log-probabilities as they are",
            ),
            Remedy::LogSoftmaxForNll => fw(
                "replace the final Softmax with LogSoftmax(dim=-1), or drop it and use CrossEntropyLoss on the logits",
                "give the output layer activation=\"softmax\" (a cross-entropy with from_logits=False takes the log of probabilities), or keep the raw output and set from_logits=True",
                "take the log of probabilities (jax.nn.log_softmax as the last operation), or drop the log and use optax.softmax_cross_entropy on the logits",
            ),
            Remedy::LogSoftmaxBeforeNll => fw(
                "take log_softmax of the logits before NLLLoss (F.nll_loss(F.log_softmax(logits, dim=1), y)), or use CrossEntropyLoss / F.cross_entropy on the logits, which does both",
                "use a cross-entropy with from_logits=True on the logits",
                "use optax.softmax_cross_entropy_with_integer_labels on the logits, or take jax.nn.log_softmax before the negative log-likelihood",
            ),
            Remedy::BatchFirst { module } => fw(
                &format!("build {} with batch_first=True, so that it reads (batch, sequence, features) as your data is laid out (nn.LSTM(..., batch_first=True); its output then comes back the same way), or give it x.transpose(0, 1) and take its output's steps along dim 0", show(module)),
                &format!("give {} its input as (batch, sequence, features)", show(module)),
                &format!("give {} its input as (batch, sequence, features), or scan it over the sequence axis", show(module)),
            ),
            Remedy::ReadLastStep { module } => fw(
                &format!("read {}'s output at the last step, where it has seen the whole sequence (out[:, -1] with batch_first=True, out[-1] otherwise), or its final hidden state (h_n[-1]); if the first step must be read, build it with bidirectional=True", show(module)),
                &format!("give {} return_sequences=False (its output is then the last step's), or read output[:, -1]", show(module)),
                &format!("read {}'s carry after the last step (the final state of its scan), or outputs[:, -1]", show(module)),
            ),
            Remedy::RegisterLayers => fw(
                "register every layer the forward uses: keep sub-layers in nn.ModuleList / nn.ModuleDict (not a Python list or dict), create them in __init__ (not in forward()), and wrap a bare tensor weight in nn.Parameter; then build the optimizer from model.parameters()",
                "create every layer the model calls in __init__ or build(), as an attribute of the model, so that model.trainable_variables holds it",
                "keep every parameter the model uses in the pytree (or nnx Module) that the optimizer updates",
            ),
            Remedy::SigmoidForBinaryLog => fw(
                "end the model with a sigmoid (the binary cross-entropy takes probabilities), or drop the hand-written log and use BCEWithLogitsLoss on the raw output",
                "give the output layer activation=\"sigmoid\" (a binary cross-entropy with from_logits=False takes probabilities), or keep the raw output and set from_logits=True",
                "use optax.sigmoid_binary_cross_entropy on the raw output, or apply jax.nn.sigmoid before taking the log",
            ),
            Remedy::RemoveSigmoidBeforeLogitsLoss => fw(
                "remove the final Sigmoid (or torch.sigmoid) from the model: BCEWithLogitsLoss applies it; apply sigmoid only at inference",
                "a binary cross-entropy with from_logits=True applies the sigmoid itself: remove the final sigmoid (activation=None); apply it only at inference",
                "remove the final sigmoid from the model: optax.sigmoid_binary_cross_entropy applies it; apply sigmoid only at inference",
            ),
            Remedy::RemoveSoftmaxBeforeLogitsLoss => fw(
                "remove the final Softmax from the model: BCEWithLogitsLoss applies a sigmoid to each raw logit on its own (labels that are not exclusive); for one class per sample, use CrossEntropyLoss on the logits instead",
                "remove the final softmax (activation=None): a binary cross-entropy with from_logits=True applies a sigmoid to each logit on its own; for one class per sample, use a categorical cross-entropy with from_logits=True instead",
                "remove the final softmax: optax.sigmoid_binary_cross_entropy applies a sigmoid to each logit on its own; for one class per sample, use optax.softmax_cross_entropy on the logits instead",
            ),
            Remedy::SigmoidPerLabel => fw(
                "the labels are not exclusive: end the model with nn.Sigmoid (one probability per label) under BCELoss, or drop the softmax and use BCEWithLogitsLoss on the raw logits",
                "the labels are not exclusive: give the output layer activation=\"sigmoid\" (one probability per label) under the binary cross-entropy, or no activation with from_logits=True",
                "the labels are not exclusive: use jax.nn.sigmoid per label, or optax.sigmoid_binary_cross_entropy on the raw logits, not a softmax",
            ),
            Remedy::OneSigmoid => fw(
                "apply the sigmoid once: the model already ends in one, so drop the torch.sigmoid before the loss (or end the model on the logits and use BCEWithLogitsLoss)",
                "apply the sigmoid once: the model already ends in one, so drop the second (or give the output layer no activation and set from_logits=True)",
                "apply the sigmoid once: the model already ends in one, so drop the second (or output logits and use optax.sigmoid_binary_cross_entropy)",
            ),
            Remedy::KeepSigmoidUseBce => fw("or keep the sigmoid and use BCELoss", "or keep the sigmoid and set from_logits=False", "or keep the sigmoid and take the binary cross-entropy of probabilities"),
            Remedy::RemoveBoundedLogits { output } => format!(
                "remove the final {} from the model: {} take raw, unbounded logits ({})",
                op(output),
                fw("CrossEntropyLoss and BCEWithLogitsLoss", "cross-entropies with from_logits=True", "optax's cross-entropies"),
                fw("a plain Linear output", "a Dense output with no activation", "a plain Linear output"),
            ),
            Remedy::RemoveBoundedRegression { output } => format!(
                "remove the final {} so the output is unbounded ({}) for regression",
                op(output),
                fw("a plain Linear", "a Dense with no activation", "a plain Linear")
            ),
            Remedy::StandardizeTargets => format!(
                "standardize the regression targets with the training set's statistics, y = (y - y.mean()) / y.std(), and invert it on the predictions (pred * std + mean); or {}",
                fw(
                    "start the output layer's bias at the targets' mean",
                    "give the output Dense bias_initializer=keras.initializers.Constant(the targets' mean)",
                    "start the output layer's bias at the targets' mean",
                )
            ),
            Remedy::ScaleTargetsIntoRange => "or scale the targets into the output's range (e.g. min-max to [0, 1] for a sigmoid) and invert the scaling at inference".into(),
            Remedy::TargetsIntoProbabilities { lo, hi } => format!(
                "scale the binary cross-entropy's targets into [0, 1] (they span [{}, {}]): divide a 0/255 mask by 255, map labels of -1/+1 to 0/1",
                num(*lo),
                num(*hi)
            ),
            Remedy::FindRankOnlyCode => "look for code that changes parameters, gradients or buffers on some ranks only (under `if rank == ...`, outside the DDP-wrapped model, or between forward and optimizer.step())".into(),
            Remedy::SameStepsOnEveryRank => "make sure every rank runs the same optimizer steps (a rank that skips or repeats optimizer.step() drifts apart)".into(),
            Remedy::NothingOutsideDdp => "check that no part of the model is updated outside DDP (a submodule or parameter not registered in the wrapped module)".into(),
            Remedy::InspectHistory => "inspect the gradient-norm history of the first failing layer (dbg.history)".into(),
            Remedy::DetectAnomaly => format!("rerun the failing step {}", nan_check(framework)),
        }
    }
}

/// How to run a step so that it stops at the operation that made a NaN, in the framework's terms.
fn nan_check(framework: Framework) -> String {
    framework.pick4(
        "under torch.autograd.detect_anomaly()",
        "with the backend's NaN check: jax.config.update(\"jax_debug_nans\", True) on JAX, tf.debugging.enable_check_numerics() on TensorFlow, torch.autograd.detect_anomaly() on PyTorch",
        "with jax.config.update(\"jax_debug_nans\", True)",
        "checking each intermediate tensor of the forward pass with .is_nan().any() (burn has no anomaly mode)",
    )
}

#[cfg(test)]
mod tests {
    use super::{Framework, Remedy};

    /// Every remedy a Keras or JAX run can be given names no `PyTorch` function (the loop
    /// mistakes only a `PyTorch` collector reports aside); a spec that says no framework reads
    /// as `PyTorch`'s.
    #[test]
    fn remedies_are_said_in_the_frameworks_terms() {
        let layer = Some("fc1".to_string());
        let output = Some("Sigmoid".to_string());
        let all = [
            Remedy::ClipGradients,
            Remedy::XavierAndNormalizeInputs,
            Remedy::InitForActivation,
            Remedy::RandomInit {
                layer: layer.clone(),
            },
            Remedy::OrthogonalRecurrentInit { layer },
            Remedy::DetectAnomalyStep,
            Remedy::DetectAnomaly,
            Remedy::TrainInBfloat16,
            Remedy::KeepModuleInFloat32,
            Remedy::InspectBatch { step: 5 },
            Remedy::OneUnitSoftmax,
            Remedy::SoftmaxOverClasses,
            Remedy::RemoveSoftmaxBeforeCrossEntropy,
            Remedy::RemoveSigmoidBeforeLogitsLoss,
            Remedy::RemoveSoftmaxBeforeLogitsLoss,
            Remedy::SigmoidPerLabel,
            Remedy::KeepSigmoidUseBce,
            Remedy::RemoveBoundedLogits {
                output: output.clone(),
            },
            Remedy::RemoveBoundedRegression { output },
        ];
        for r in &all {
            let jax = r.text(Framework::Jax);
            assert!(!jax.contains("torch"), "{jax}");
            let keras = r.text(Framework::Keras);
            // (Keras' NaN check names each backend's, PyTorch's among them.)
            if !matches!(r, Remedy::DetectAnomaly | Remedy::DetectAnomalyStep) {
                assert!(
                    !keras.contains("torch") && !keras.contains("Loss"),
                    "{keras}"
                );
            }
            assert_eq!(r.text(Framework::of(None)), r.text(Framework::Torch));
            let burn = r.text(Framework::of(Some("burn")));
            if matches!(
                r,
                Remedy::ClipGradients
                    | Remedy::XavierAndNormalizeInputs
                    | Remedy::InitForActivation
                    | Remedy::RandomInit { .. }
                    | Remedy::InspectBatch { .. }
                    | Remedy::DetectAnomaly
                    | Remedy::DetectAnomalyStep
            ) {
                assert!(!burn.contains("torch") && !burn.contains("_("), "{burn}");
            }
        }
        assert!(
            Remedy::ClipGradients
                .text(Framework::of(Some("keras")))
                .contains("global_clipnorm=1.0")
        );
        assert!(
            Remedy::ClipGradients
                .text(Framework::Torch)
                .contains("clip_grad_norm_")
        );
    }
}
