//! Health states (the seed's `GradientHealth` and its siblings) and the rules that classify a
//! raw statistic into one of them.
//!
//! Classification is hysteretic: the state a series is currently in widens its own band by the
//! configured factor, so a value hovering at a threshold does not flip the state back and forth.

use serde::{Deserialize, Serialize};

use crate::named::named_enum;

use crate::config::Config;

named_enum! {
    /// Health of one layer's gradient, judged on the L2 norm of all its parameters' gradients.
    GradientHealth {
        /// Norm within `[threshold_vanishing, threshold_saturated]`.
        Healthy => "HEALTHY",
        /// Norm below `threshold_vanishing`: the layer barely learns.
        Vanishing => "VANISHING",
        /// Norm above `threshold_saturated`: large but not yet exploding; a warning.
        Saturated => "SATURATED",
        /// Norm above `threshold_exploding`.
        Exploding => "EXPLODING",
        /// NaN or infinite norm; never healthy.
        NonFinite => "NON_FINITE",
    }
}

named_enum! {
    /// Health of one activation module's output.
    ActivationHealth {
        Normal => "NORMAL",
        /// Most outputs of a bounded activation sit at its bounds, where its slope is ~0.
        Saturated => "SATURATED",
        /// Most units of a ReLU-family activation output zero for the whole batch.
        Dead => "DEAD",
        /// Output magnitudes jumped far beyond their own history.
        Anomalous => "ANOMALOUS",
        NonFinite => "NON_FINITE",
    }
}

named_enum! {
    /// Health of the training loss.
    LossHealth {
        Normal => "NORMAL",
        /// The smoothed loss rose far above its best value.
        Diverging => "DIVERGING",
        /// The loss stopped improving while still near its starting level.
        Plateau => "PLATEAU",
        NonFinite => "NON_FINITE",
    }
}

named_enum! {
    /// Health of the input batches the model is fed.
    DataHealth {
        Normal => "NORMAL",
        /// The batch's scale is orders of magnitude away from the batches before it.
        OutOfDistribution => "OUT_OF_DISTRIBUTION",
        NonFinite => "NON_FINITE",
    }
}

named_enum! {
    /// Whether a module's forward output is finite.
    OutputHealth {
        Finite => "FINITE",
        NonFinite => "NON_FINITE",
    }
}

named_enum! {
    /// Whether the replicas of a data-parallel job (DDP) still hold the same parameters and
    /// gradients.
    ReplicaHealth {
        Consistent => "CONSISTENT",
        /// Some rank's parameters or gradients differ from the others' beyond float tolerance.
        Diverged => "DIVERGED",
    }
}

/// Any of the health states, as carried by an event's `from_state`/`to_state`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(untagged)]
pub enum State {
    Gradient(GradientHealth),
    Activation(ActivationHealth),
    Loss(LossHealth),
    Data(DataHealth),
    Output(OutputHealth),
    Replica(ReplicaHealth),
}

impl State {
    pub fn as_str(self) -> &'static str {
        match self {
            State::Gradient(s) => s.as_str(),
            State::Activation(s) => s.as_str(),
            State::Loss(s) => s.as_str(),
            State::Data(s) => s.as_str(),
            State::Output(s) => s.as_str(),
            State::Replica(s) => s.as_str(),
        }
    }
}

impl std::fmt::Display for State {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Result of classifying one value: the state and how far past its threshold the value is, in
/// decades (log10 units) for norms or in fraction-of-range for fractions. Zero for healthy.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Classified<S> {
    pub state: S,
    pub margin: f64,
    /// The threshold the value crossed (NaN for healthy and non-finite).
    pub threshold: f64,
}

/// Classifies a gradient norm. `current` is the state the series is in now; its band is widened
/// by `config.hysteresis` so leaving it takes a clear move.
pub fn classify_gradient(
    norm: f64,
    current: GradientHealth,
    config: &Config,
) -> Classified<GradientHealth> {
    if !norm.is_finite() {
        return Classified {
            state: GradientHealth::NonFinite,
            margin: f64::INFINITY,
            threshold: f64::NAN,
        };
    }
    let h = config.hysteresis;
    let vanishing = if current == GradientHealth::Vanishing {
        config.threshold_vanishing * h
    } else {
        config.threshold_vanishing
    };
    let exploding = if current == GradientHealth::Exploding {
        config.threshold_exploding / h
    } else {
        config.threshold_exploding
    };
    let saturated = if matches!(
        current,
        GradientHealth::Saturated | GradientHealth::Exploding
    ) {
        config.threshold_saturated / h
    } else {
        config.threshold_saturated
    };
    if norm < vanishing {
        Classified {
            state: GradientHealth::Vanishing,
            margin: decades(config.threshold_vanishing, norm),
            threshold: config.threshold_vanishing,
        }
    } else if norm > exploding {
        Classified {
            state: GradientHealth::Exploding,
            margin: decades(norm, config.threshold_exploding),
            threshold: config.threshold_exploding,
        }
    } else if norm > saturated {
        Classified {
            state: GradientHealth::Saturated,
            margin: decades(norm, config.threshold_saturated),
            threshold: config.threshold_saturated,
        }
    } else {
        Classified {
            state: GradientHealth::Healthy,
            margin: 0.0,
            threshold: f64::NAN,
        }
    }
}

/// `log10(high / low)`, clamped at zero and capped for exact zeros (a zero gradient is "very far"
/// below any threshold: 12 decades).
pub fn decades(high: f64, low: f64) -> f64 {
    if low <= 0.0 {
        return 12.0;
    }
    (high / low).log10().clamp(0.0, 12.0)
}

/// What an activation function can do wrong, decided from its kind.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct ActivationTraits {
    /// `(lo, hi)` when the function is bounded on both sides and flat near its bounds
    /// (tanh, sigmoid, hardtanh...): it can saturate.
    pub bounded: Option<(f64, f64)>,
    /// True for ReLU-family units whose output is exactly zero on half the line: they can die.
    pub can_die: bool,
    /// How to compute the derivative from the output, for functions where it is a function of
    /// the output alone.
    pub slope: Option<SlopeFormula>,
}

/// Derivative of an activation expressed through its output `y`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum SlopeFormula {
    /// tanh: `1 - y^2`.
    Tanh,
    /// sigmoid: `y (1 - y)` (never above 0.25).
    Sigmoid,
    /// softsign: `(1 - |y|)^2`.
    Softsign,
}

/// Per-step statistics of one activation module's output.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct ActivationSample {
    /// Largest |output| (NaN or inf when the output is not finite).
    pub absmax: f64,
    /// Fraction of outputs inside the saturation band (NaN when not measured).
    pub saturated_fraction: f64,
    /// Fraction of units that output zero over the whole batch (NaN when not measured).
    pub dead_fraction: f64,
    /// Mean derivative of the activation at its outputs (bounded activations; NaN otherwise):
    /// how much of the gradient the activation passes back on average.
    pub mean_slope: f64,
    /// Batch x spatial samples behind each unit's death verdict.
    pub samples_per_unit: f64,
}

/// Classifies an activation sample. `median_absmax` is the module's running median of earlier
/// `absmax` values (None until there is enough history).
pub fn classify_activation(
    sample: &ActivationSample,
    traits: ActivationTraits,
    current: ActivationHealth,
    median_absmax: Option<f64>,
    config: &Config,
) -> Classified<ActivationHealth> {
    if !sample.absmax.is_finite() {
        return Classified {
            state: ActivationHealth::NonFinite,
            margin: f64::INFINITY,
            threshold: f64::NAN,
        };
    }
    // Fractions use a linear hysteresis band: leaving a state needs the fraction to fall below
    // threshold / hysteresis.
    let h = config.hysteresis;
    if traits.can_die
        && sample.dead_fraction.is_finite()
        && sample.samples_per_unit >= f64::from(config.activation_min_samples)
    {
        let t = config.activation_dead_fraction;
        let t_eff = if current == ActivationHealth::Dead {
            t / h
        } else {
            t
        };
        if sample.dead_fraction >= t_eff {
            return Classified {
                state: ActivationHealth::Dead,
                margin: fraction_margin(sample.dead_fraction, t),
                threshold: t,
            };
        }
    }
    if traits.bounded.is_some() && sample.saturated_fraction.is_finite() {
        let t = config.activation_saturated_fraction;
        let t_eff = if current == ActivationHealth::Saturated {
            t / h
        } else {
            t
        };
        if sample.saturated_fraction >= t_eff {
            return Classified {
                state: ActivationHealth::Saturated,
                margin: fraction_margin(sample.saturated_fraction, t),
                threshold: t,
            };
        }
    }
    if traits.bounded.is_none() {
        if let Some(median) = median_absmax.filter(|m| *m > 0.0) {
            let factor = if current == ActivationHealth::Anomalous {
                config.activation_anomalous_factor / h
            } else {
                config.activation_anomalous_factor
            };
            if sample.absmax > median * factor {
                return Classified {
                    state: ActivationHealth::Anomalous,
                    margin: decades(sample.absmax, median * config.activation_anomalous_factor),
                    threshold: median * config.activation_anomalous_factor,
                };
            }
        }
    }
    Classified {
        state: ActivationHealth::Normal,
        margin: 0.0,
        threshold: f64::NAN,
    }
}

/// How far a fraction is past its threshold, as a share of the remaining range (0 at the
/// threshold, 1 when the fraction is 1).
fn fraction_margin(value: f64, threshold: f64) -> f64 {
    if threshold >= 1.0 {
        return 1.0;
    }
    ((value - threshold) / (1.0 - threshold)).clamp(0.0, 1.0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gradient_classes_follow_seed_thresholds() {
        let c = Config::default();
        let h = GradientHealth::Healthy;
        assert_eq!(
            classify_gradient(1e-7, h, &c).state,
            GradientHealth::Vanishing
        );
        assert_eq!(
            classify_gradient(1e-6, h, &c).state,
            GradientHealth::Healthy
        );
        assert_eq!(classify_gradient(1.0, h, &c).state, GradientHealth::Healthy);
        assert_eq!(
            classify_gradient(1.5, h, &c).state,
            GradientHealth::Saturated
        );
        assert_eq!(
            classify_gradient(1e3, h, &c).state,
            GradientHealth::Saturated
        );
        assert_eq!(
            classify_gradient(1.1e3, h, &c).state,
            GradientHealth::Exploding
        );
        assert_eq!(
            classify_gradient(f64::NAN, h, &c).state,
            GradientHealth::NonFinite
        );
        assert_eq!(
            classify_gradient(f64::INFINITY, h, &c).state,
            GradientHealth::NonFinite
        );
        assert_eq!(
            classify_gradient(0.0, h, &c).state,
            GradientHealth::Vanishing
        );
    }

    #[test]
    fn hysteresis_holds_the_current_state() {
        let c = Config::default();
        // Just above the vanishing threshold: healthy from healthy, still vanishing from vanishing.
        assert_eq!(
            classify_gradient(1.5e-6, GradientHealth::Healthy, &c).state,
            GradientHealth::Healthy
        );
        assert_eq!(
            classify_gradient(1.5e-6, GradientHealth::Vanishing, &c).state,
            GradientHealth::Vanishing
        );
        assert_eq!(
            classify_gradient(900.0, GradientHealth::Exploding, &c).state,
            GradientHealth::Exploding
        );
        assert_eq!(
            classify_gradient(400.0, GradientHealth::Exploding, &c).state,
            GradientHealth::Saturated
        );
    }

    #[test]
    fn linear_like_output_is_never_saturated() {
        let c = Config::default();
        let unbounded = ActivationTraits {
            bounded: None,
            can_die: false,
            slope: None,
        };
        let s = ActivationSample {
            absmax: 1.0,
            saturated_fraction: 1.0,
            dead_fraction: 1.0,
            mean_slope: f64::NAN,
            samples_per_unit: 64.0,
        };
        assert_eq!(
            classify_activation(&s, unbounded, ActivationHealth::Normal, None, &c).state,
            ActivationHealth::Normal
        );
    }

    #[test]
    fn death_needs_enough_samples_per_unit() {
        let c = Config::default();
        let relu = ActivationTraits {
            bounded: None,
            can_die: true,
            slope: None,
        };
        let mut s = ActivationSample {
            absmax: 1.0,
            saturated_fraction: f64::NAN,
            dead_fraction: 0.9,
            mean_slope: f64::NAN,
            samples_per_unit: 4.0,
        };
        assert_eq!(
            classify_activation(&s, relu, ActivationHealth::Normal, None, &c).state,
            ActivationHealth::Normal
        );
        s.samples_per_unit = 64.0;
        assert_eq!(
            classify_activation(&s, relu, ActivationHealth::Normal, None, &c).state,
            ActivationHealth::Dead
        );
    }

    #[test]
    fn state_names_round_trip() {
        for s in GradientHealth::ALL {
            assert_eq!(GradientHealth::parse(s.as_str()), Some(*s));
        }
        for s in ActivationHealth::ALL {
            assert_eq!(ActivationHealth::parse(s.as_str()), Some(*s));
        }
    }
}
