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
        }
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
