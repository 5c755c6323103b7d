//! The heatmap's newest columns as health states, for views with a few characters per layer
//! (`neuraldbg watch`).

use crate::engine::Engine;
use crate::health::{GradientHealth, classify_gradient};
use crate::history::Bucket;

/// The newest columns of the gradient-norm heatmap, one row per layer in forward order, each
/// cell the health of the worst value of the history bucket it covers (as the report's
/// heatmap: a NaN/Inf always shows, then a vanishing minimum, else the maximum).
#[derive(Clone, Debug, PartialEq)]
pub struct HealthStrip {
    pub rows: Vec<StripRow>,
    /// `[first, last]` step of each column, oldest first.
    pub columns: Vec<(u64, u64)>,
}

/// One layer of a [`HealthStrip`].
#[derive(Clone, Debug, PartialEq)]
pub struct StripRow {
    /// Qualified module name.
    pub name: String,
    /// Module class (`Linear`, `Conv2d`...).
    pub kind: String,
    /// None where the layer had no gradient norm in that bucket.
    pub cells: Vec<Option<GradientHealth>>,
}

/// The health of the worst value of a bucket.
fn worst(b: &Bucket, engine: &Engine) -> GradientHealth {
    let config = engine.config();
    if b.non_finite() {
        return GradientHealth::NonFinite;
    }
    let low = f64::from(b.min);
    if low.is_finite() && low < config.threshold_vanishing {
        return GradientHealth::Vanishing;
    }
    classify_gradient(f64::from(b.max), GradientHealth::Healthy, config).state
}

/// The last `columns` history buckets of every layer's gradient norm; None before a model is
/// registered.
pub fn health_strip(engine: &Engine, columns: usize) -> Option<HealthStrip> {
    let run = engine.run()?;
    let steps = run.grads.steps();
    let from = steps.len().saturating_sub(columns);
    let first = run.first_step.unwrap_or(0);
    let spans = (from..steps.len())
        .map(|b| {
            let start = if b == 0 { first } else { steps[b - 1] + 1 };
            (start, steps[b])
        })
        .collect();
    let rows = run
        .model
        .layers
        .iter()
        .enumerate()
        .map(|(l, layer)| StripRow {
            name: layer.name.clone(),
            kind: layer.kind.clone(),
            cells: run.grads.buckets(l)[from..]
                .iter()
                .map(|b| b.as_ref().map(|b| worst(b, engine)))
                .collect(),
        })
        .collect();
    Some(HealthStrip {
        rows,
        columns: spans,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{Config, ModelSpec, Observation};

    #[test]
    fn strip_shows_each_layer_state_in_its_newest_columns() {
        use GradientHealth::{Healthy, NonFinite, Saturated, Vanishing};
        let mut engine = Engine::new(Config::default()).unwrap();
        let mut spec = ModelSpec::default();
        for name in ["a", "b"] {
            let m = spec.module(name, "Linear");
            spec.param(m, format!("{name}.weight"), &[4, 4]);
        }
        engine.register_model(spec).unwrap();
        assert!(health_strip(&Engine::new(Config::default()).unwrap(), 4).is_none());
        // Layer a: healthy, then vanishing from step 6; layer b: saturated, NaN at step 8.
        for step in 0..10u64 {
            let a = if step < 6 { 0.1 } else { 1e-9 };
            let b = if step == 8 { f32::NAN } else { 5.0 };
            let obs = Observation {
                step,
                grad_norms: vec![a, b],
                ..Default::default()
            };
            engine.observe(&obs.view()).unwrap();
        }
        let strip = health_strip(&engine, 5).unwrap();
        assert_eq!(strip.columns, [(5, 5), (6, 6), (7, 7), (8, 8), (9, 9)]);
        assert_eq!(strip.rows[0].name, "a");
        assert_eq!(
            strip.rows[0].cells,
            [
                Some(Healthy),
                Some(Vanishing),
                Some(Vanishing),
                Some(Vanishing),
                Some(Vanishing)
            ]
        );
        assert_eq!(
            strip.rows[1].cells,
            [
                Some(Saturated),
                Some(Saturated),
                Some(Saturated),
                Some(NonFinite),
                Some(Saturated)
            ]
        );
        // Asking for more columns than there are buckets gives them all.
        assert_eq!(health_strip(&engine, 100).unwrap().columns.len(), 10);
    }
}
