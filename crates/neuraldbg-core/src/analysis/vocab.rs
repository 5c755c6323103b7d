//! The failure and cause vocabularies of design.md.

use crate::named::named_enum;

named_enum! {
    /// What went wrong.
    Failure {
        VanishingGradients => "vanishing_gradients",
        ExplodingGradients => "exploding_gradients",
        SaturatedGradients => "saturated_gradients",
        SaturatedActivations => "saturated_activations",
        DeadNeurons => "dead_neurons",
        NonFinite => "non_finite",
        DataAnomaly => "data_anomaly",
        LossDivergence => "loss_divergence",
        LossPlateau => "loss_plateau",
        /// Mixed precision: the `GradScaler` skips step after step and its loss scale
        /// collapses below 1, so training stops making progress.
        LossScaleCollapse => "loss_scale_collapse",
        /// A layer whose parameters never change, or never receive a gradient, while the rest
        /// of the model trains.
        StalledLayer => "stalled_layer",
        ReplicaDivergence => "replica_divergence",
    }
}

named_enum! {
    /// Why it went wrong.
    Cause {
        SaturatingActivation => "saturating_activation",
        PoorInitialization => "poor_initialization",
        LearningRateTooHigh => "learning_rate_too_high",
        LearningRateTooLow => "learning_rate_too_low",
        DyingRelu => "dying_relu",
        BadInputData => "bad_input_data",
        NumericalInstability => "numerical_instability",
        NetworkDepth => "network_depth",
        MissingNormalization => "missing_normalization",
        Unknown => "unknown",
        // Mistakes in the training loop.
        /// Gradients accumulate across steps: `.grad` is never zeroed.
        MissingZeroGrad => "missing_zero_grad",
        /// Parameters that are in no optimizer, in a param group with lr 0, or cut from the
        /// graph (`.detach()`, `torch.no_grad()`, `.data`).
        ParametersNotUpdated => "parameters_not_updated",
        /// The model is optimized while in `eval()` mode.
        EvalMode => "eval_mode",
        /// The output activation does not fit the loss.
        OutputLossMismatch => "output_loss_mismatch",
        /// A loss that broadcasts `(N, 1)` against `(N,)`.
        TargetShapeMismatch => "target_shape_mismatch",
        /// A weight penalty written into the loss that outweighs the fit to the data.
        OverRegularization => "over_regularization",
        /// The forward pass gives every sample the same output: its input does not reach it
        /// (a reduction over the batch, an input overwritten, a normalization over one value).
        OutputIgnoresInput => "output_ignores_input",
        /// The optimizer's steps move the weights up their gradients (a negated gradient, an
        /// update written with `+=`).
        FlippedUpdateSign => "flipped_update_sign",
        /// A layer that reads its input's first dimension as the sequence (an RNN or attention
        /// layer built without `batch_first=True`) was given the batch there: it runs across
        /// the samples instead of along each one.
        BatchAxisMismatch => "batch_axis_mismatch",
        /// The model reads a recurrent layer's output at the start of the sequence only
        /// (`out[:, 0]`): a layer that runs one way has seen only the first steps there.
        SequenceStartReadout => "sequence_start_readout",
    }
}

impl Failure {
    /// How the failure reads in a sentence.
    pub fn phrase(self) -> &'static str {
        match self {
            Failure::VanishingGradients => "Gradients vanished",
            Failure::ExplodingGradients => "Gradients exploded",
            Failure::SaturatedGradients => "Gradient norms ran high",
            Failure::SaturatedActivations => "Activations saturated",
            Failure::DeadNeurons => "ReLU units died",
            Failure::NonFinite => "Values became non-finite (NaN/Inf)",
            Failure::DataAnomaly => "An anomalous input batch reached the model",
            Failure::LossDivergence => "The loss diverged",
            Failure::LossPlateau => "The loss plateaued",
            Failure::LossScaleCollapse => "The mixed-precision loss scale collapsed",
            Failure::StalledLayer => "A layer stopped training",
            Failure::ReplicaDivergence => "A data-parallel replica diverged from the others",
        }
    }

    /// Whether the cause rules (`analysis/causes/`) rank this failure's causes (its rule in
    /// `analysis/failures/` says).
    pub fn ranked_by_cause_rules(self) -> bool {
        super::failures::rule(self).ranked_by_cause_rules()
    }

    /// Gradient failures are located where they begin along the backward pass; the others at
    /// the first module in forward order that shows them.
    pub fn is_gradient(self) -> bool {
        matches!(
            self,
            Failure::VanishingGradients | Failure::ExplodingGradients | Failure::SaturatedGradients
        )
    }
}

impl Cause {
    /// How the cause reads in a sentence (each cause's rule in `causes` says it).
    pub fn phrase(self) -> &'static str {
        super::causes::rule(self).phrase()
    }
}
