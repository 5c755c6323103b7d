//! Engine configuration: the seed's thresholds plus the knobs of event detection.
//!
//! Every field has a default that matches the seed (`threshold_*`) or was chosen from how
//! gradients and activations behave in ordinary training; [`Config::validate`] rejects values
//! that would make the classification meaningless.

use serde::{Deserialize, Serialize};

use crate::error::ConfigError;

/// Thresholds and detection parameters. Construct with [`Config::default`] and override fields.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Config {
    /// A layer gradient norm below this is VANISHING (seed: 1e-6).
    pub threshold_vanishing: f64,
    /// A layer gradient norm above this is EXPLODING (seed: 1e3).
    pub threshold_exploding: f64,
    /// A layer gradient norm above this (and not exploding) is SATURATED, a warning (seed: 1.0).
    pub threshold_saturated: f64,
    /// Consecutive observations a new state must hold before a transition is confirmed.
    /// The event is still dated at the first of those observations (its onset).
    pub persistence: u32,
    /// A state this many decades (powers of ten) past its threshold is confirmed at once,
    /// without waiting for `persistence` observations.
    pub immediate_decades: f64,
    /// Hysteresis factor: to leave a state back towards healthy, the value must be this factor
    /// inside the threshold it crossed (e.g. 2.0: leave VANISHING only above 2e-6).
    pub hysteresis: f64,
    /// Fraction of a bounded activation's outputs within the saturation band that makes the
    /// module SATURATED.
    pub activation_saturated_fraction: f64,
    /// Width of the saturation band, as a fraction of the activation's range (tanh: |y| > 0.98).
    pub activation_saturation_band: f64,
    /// Fraction of a ReLU-family module's units that output zero over the whole batch that
    /// makes the module DEAD.
    pub activation_dead_fraction: f64,
    /// Samples per unit (batch x spatial positions) needed before death is judged at all: with
    /// fewer, a healthy unit is silent over the batch by chance too often.
    pub activation_min_samples: u32,
    /// An activation whose largest magnitude exceeds its running median by this factor is
    /// ANOMALOUS.
    pub activation_anomalous_factor: f64,
    /// An input batch whose scale (std or max magnitude) differs from the running median by this
    /// factor, either way, is out of distribution.
    pub data_ood_factor: f64,
    /// Input batches needed before out-of-distribution is judged.
    pub data_baseline_batches: u32,
    /// The loss diverges when its smoothed value exceeds this factor times its best smoothed
    /// value (and exceeds its starting level).
    pub loss_divergence_factor: f64,
    /// Steps over which the loss must fail to improve to count as a plateau.
    pub loss_plateau_window: u32,
    /// Relative improvement over `loss_plateau_window` below which the loss is flat.
    pub loss_plateau_tolerance: f64,
    /// A flat loss is a plateau (a failure) only while it stays above this fraction of its
    /// starting level; below, the run has converged.
    pub loss_plateau_level: f64,
    /// Buckets kept per history series; older buckets are merged pairwise so memory stays
    /// bounded however long training runs.
    pub history_capacity: usize,
    /// Upper bound on the bytes all histories may hold together. A model so large that
    /// `history_capacity` buckets per series would exceed it gets fewer buckets (coarser plots),
    /// never more memory: 10,000 layers keep ~200 buckets in the default 128 MiB.
    pub history_max_bytes: usize,
    /// Events kept per layer and event type; transitions beyond it are counted, not stored.
    pub max_events_per_layer: usize,
    /// Steps within which two events count as temporally coupled.
    pub coupling_window: u64,
}

impl Default for Config {
    fn default() -> Self {
        Self {
            threshold_vanishing: 1e-6,
            threshold_exploding: 1e3,
            threshold_saturated: 1.0,
            persistence: 3,
            immediate_decades: 1.0,
            hysteresis: 2.0,
            activation_saturated_fraction: 0.5,
            activation_saturation_band: 0.01,
            activation_dead_fraction: 0.5,
            activation_min_samples: 16,
            activation_anomalous_factor: 100.0,
            data_ood_factor: 100.0,
            data_baseline_batches: 8,
            loss_divergence_factor: 3.0,
            loss_plateau_window: 50,
            loss_plateau_tolerance: 0.01,
            loss_plateau_level: 0.8,
            history_capacity: 512,
            history_max_bytes: 128 << 20,
            max_events_per_layer: 64,
            coupling_window: 5,
        }
    }
}

fn positive(name: &'static str, value: f64) -> Result<(), ConfigError> {
    if value.is_finite() && value > 0.0 {
        Ok(())
    } else {
        Err(ConfigError::NotPositive { name, value })
    }
}

fn fraction(name: &'static str, value: f64) -> Result<(), ConfigError> {
    if value.is_finite() && value > 0.0 && value <= 1.0 {
        Ok(())
    } else {
        Err(ConfigError::NotFraction { name, value })
    }
}

fn at_least(name: &'static str, value: f64, min: f64) -> Result<(), ConfigError> {
    if value.is_finite() && value >= min {
        Ok(())
    } else {
        Err(ConfigError::TooSmall { name, value, min })
    }
}

/// A parse error naming the setting it is about (serde's says only where in the text it is).
fn parse_error(text: &str, e: &serde_json::Error) -> ConfigError {
    let object: serde_json::Map<String, serde_json::Value> = match serde_json::from_str(text) {
        Ok(o) => o,
        Err(_) => return ConfigError::Parse(e.to_string()),
    };
    for (key, value) in object {
        let one = serde_json::Value::Object([(key.clone(), value.clone())].into_iter().collect());
        if let Err(e) = serde_json::from_value::<Config>(one) {
            return ConfigError::Parse(format!("{key} = {value}: {e}"));
        }
    }
    ConfigError::Parse(e.to_string())
}

impl Config {
    /// Parses a configuration from JSON (unknown keys are rejected) and validates it.
    pub fn from_json(text: &str) -> Result<Self, ConfigError> {
        let config: Self = serde_json::from_str(text).map_err(|e| parse_error(text, &e))?;
        config.validate()?;
        Ok(config)
    }

    /// Checks that every value is in range and the thresholds are ordered
    /// `vanishing < saturated <= exploding`.
    pub fn validate(&self) -> Result<(), ConfigError> {
        positive("threshold_vanishing", self.threshold_vanishing)?;
        positive("threshold_exploding", self.threshold_exploding)?;
        positive("threshold_saturated", self.threshold_saturated)?;
        if self.threshold_vanishing >= self.threshold_exploding {
            return Err(ConfigError::Order {
                low: "threshold_vanishing",
                low_value: self.threshold_vanishing,
                high: "threshold_exploding",
                high_value: self.threshold_exploding,
            });
        }
        if self.threshold_vanishing >= self.threshold_saturated {
            return Err(ConfigError::Order {
                low: "threshold_vanishing",
                low_value: self.threshold_vanishing,
                high: "threshold_saturated",
                high_value: self.threshold_saturated,
            });
        }
        if self.threshold_saturated > self.threshold_exploding {
            return Err(ConfigError::Order {
                low: "threshold_saturated",
                low_value: self.threshold_saturated,
                high: "threshold_exploding",
                high_value: self.threshold_exploding,
            });
        }
        at_least("persistence", f64::from(self.persistence), 1.0)?;
        positive("immediate_decades", self.immediate_decades)?;
        at_least("hysteresis", self.hysteresis, 1.0)?;
        fraction(
            "activation_saturated_fraction",
            self.activation_saturated_fraction,
        )?;
        fraction(
            "activation_saturation_band",
            self.activation_saturation_band,
        )?;
        fraction("activation_dead_fraction", self.activation_dead_fraction)?;
        at_least(
            "activation_min_samples",
            f64::from(self.activation_min_samples),
            1.0,
        )?;
        at_least(
            "activation_anomalous_factor",
            self.activation_anomalous_factor,
            1.0,
        )?;
        at_least("data_ood_factor", self.data_ood_factor, 1.0)?;
        at_least(
            "data_baseline_batches",
            f64::from(self.data_baseline_batches),
            1.0,
        )?;
        at_least("loss_divergence_factor", self.loss_divergence_factor, 1.0)?;
        at_least(
            "loss_plateau_window",
            f64::from(self.loss_plateau_window),
            2.0,
        )?;
        fraction("loss_plateau_tolerance", self.loss_plateau_tolerance)?;
        fraction("loss_plateau_level", self.loss_plateau_level)?;
        at_least("history_capacity", self.history_capacity as f64, 16.0)?;
        at_least(
            "history_max_bytes",
            self.history_max_bytes as f64,
            f64::from(1u32 << 20),
        )?;
        at_least(
            "max_events_per_layer",
            self.max_events_per_layer as f64,
            1.0,
        )?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_are_the_seed_thresholds_and_valid() {
        let c = Config::default();
        assert!((c.threshold_vanishing - 1e-6).abs() < 1e-18);
        assert!((c.threshold_exploding - 1e3).abs() < 1e-9);
        assert!((c.threshold_saturated - 1.0).abs() < 1e-12);
        c.validate().unwrap();
    }

    #[test]
    fn rejects_negative_and_misordered_thresholds() {
        let c = Config {
            threshold_vanishing: -1.0,
            ..Config::default()
        };
        let err = c.validate().unwrap_err().to_string();
        assert!(err.contains("threshold_vanishing"), "{err}");

        let c = Config {
            threshold_vanishing: 1e4,
            ..Config::default()
        };
        let err = c.validate().unwrap_err().to_string();
        assert!(err.contains("threshold_exploding"), "{err}");

        let c = Config {
            threshold_saturated: 1e5,
            ..Config::default()
        };
        assert!(c.validate().is_err());
        let c = Config {
            threshold_exploding: f64::NAN,
            ..Config::default()
        };
        assert!(c.validate().is_err());
    }

    #[test]
    fn json_round_trip_and_unknown_keys() {
        let c = Config::from_json(r#"{"threshold_vanishing": 1e-7}"#).unwrap();
        assert!((c.threshold_vanishing - 1e-7).abs() < 1e-20);
        let err = Config::from_json(r#"{"threshold_vanish": 1e-7}"#).unwrap_err();
        assert!(err.to_string().contains("threshold_vanish"), "{err}");
    }
}
