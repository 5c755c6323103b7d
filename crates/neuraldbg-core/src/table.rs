//! Every history series of a run as one long ("tidy") table: what `dbg.to_pandas()` returns
//! and `neuraldbg export --format parquet` writes, so both give the same rows.
//!
//! One row per series and history bucket that holds a value. A bucket covers one step until the
//! run outgrows the history's capacity; then each covers several (`first_step..=step`), and
//! `min`/`max` keep its extremes so a spike or a NaN is never averaged away.

use crate::engine::{Engine, Global};
use crate::history::History;

/// Who a series is about.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Group {
    /// A module owning parameters.
    Layer,
    /// An activation module.
    Activation,
    /// The whole run (loss, learning rate, total gradient norm, input scale).
    Run,
}

impl Group {
    pub fn as_str(self) -> &'static str {
        match self {
            Group::Layer => "layer",
            Group::Activation => "activation",
            Group::Run => "run",
        }
    }
}

/// One series of the table.
#[derive(Clone, Debug, PartialEq)]
pub struct SeriesKey {
    pub group: Group,
    /// The module's qualified name (`""` is the root module); None for run-wide series.
    pub module: Option<String>,
    /// As [`Engine::history`] names it (`grad_norm`, `loss`, `dead_fraction`...).
    pub metric: &'static str,
}

/// The table, column by column. Every column has one entry per row.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct HistoryTable {
    /// The series, referred to by [`Self::series`] by index.
    pub keys: Vec<SeriesKey>,
    /// Index into [`Self::keys`] of each row.
    pub series: Vec<u32>,
    /// First and last step the row's bucket covers.
    pub first_step: Vec<u64>,
    pub step: Vec<u64>,
    /// The last value observed in the bucket (NaN/Inf when it was not finite).
    pub value: Vec<f64>,
    /// Smallest finite value in the bucket (NaN when none was finite).
    pub min: Vec<f64>,
    /// Largest value in the bucket; NaN when the bucket held a NaN/Inf.
    pub max: Vec<f64>,
}

impl HistoryTable {
    pub fn len(&self) -> usize {
        self.step.len()
    }

    pub fn is_empty(&self) -> bool {
        self.step.is_empty()
    }

    /// Appends the buckets of `series` of `history` that hold a value.
    fn add(&mut self, key: SeriesKey, history: &History, series: usize, first: u64) {
        let index = self.keys.len() as u32;
        self.keys.push(key);
        let steps = history.steps();
        for (b, bucket) in history.buckets(series).into_iter().enumerate() {
            let Some(bucket) = bucket else { continue };
            self.series.push(index);
            self.first_step
                .push(if b == 0 { first } else { steps[b - 1] + 1 });
            self.step.push(steps[b]);
            self.value.push(f64::from(bucket.last));
            self.min.push(if bucket.min.is_finite() {
                f64::from(bucket.min)
            } else {
                f64::NAN
            });
            self.max.push(if bucket.non_finite() {
                f64::NAN
            } else {
                f64::from(bucket.max)
            });
        }
    }
}

/// Every series the engine keeps, layers in forward order, then activations, then run-wide
/// series. Empty before a model is registered.
pub fn history_table(engine: &Engine) -> HistoryTable {
    let mut table = HistoryTable::default();
    let Some(run) = engine.run() else {
        return table;
    };
    let first = run.first_step.unwrap_or(0);
    let model = &run.model;
    for (l, layer) in model.layers.iter().enumerate() {
        for (metric, history) in [("grad_norm", &run.grads), ("weight_norm", &run.weights)] {
            let key = SeriesKey {
                group: Group::Layer,
                module: Some(layer.name.clone()),
                metric,
            };
            table.add(key, history, l, first);
        }
    }
    for (a, act) in model.activations.iter().enumerate() {
        for (offset, metric) in crate::engine::ACTIVATION_METRICS.iter().enumerate() {
            let key = SeriesKey {
                group: Group::Activation,
                module: Some(act.name.clone()),
                metric,
            };
            table.add(key, &run.activations, 3 * a + offset, first);
        }
    }
    for (g, metric) in [
        (Global::TotalGradNorm, "grad_norm"),
        (Global::Loss, "loss"),
        (Global::Lr, "lr"),
        (Global::InputScale, "input_scale"),
    ] {
        let key = SeriesKey {
            group: Group::Run,
            module: None,
            metric,
        };
        table.add(key, &run.grads, run.global_series(g), first);
    }
    table
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{Config, Observation, Reduce};

    #[test]
    fn table_rows_are_the_history_buckets_with_a_value() {
        let mut engine = Engine::new(Config::default()).unwrap();
        assert!(history_table(&engine).is_empty());
        engine
            .register_model(crate::model::tests::mlp_spec(2, "ReLU"))
            .unwrap();
        let n = engine.model().unwrap().spec.params.len();
        for step in 0..12u64 {
            let obs = Observation {
                step,
                grad_norms: vec![if step == 7 { f32::NAN } else { 0.5 }; n],
                weight_norms: (step % 5 == 0).then(|| vec![2.0; n]),
                loss: Some(1.0 / (step + 1) as f64),
                ..Default::default()
            };
            engine.observe(&obs.view()).unwrap();
        }
        let t = history_table(&engine);
        let rows = |group: Group, module: Option<&str>, metric: &str| -> Vec<usize> {
            (0..t.len())
                .filter(|&r| {
                    let k = &t.keys[t.series[r] as usize];
                    k.group == group && k.module.as_deref() == module && k.metric == metric
                })
                .collect()
        };
        let layer = engine.model().unwrap().layers[0].name.clone();
        let grads = rows(Group::Layer, Some(&layer), "grad_norm");
        assert_eq!(grads.len(), 12);
        let (steps, values) = engine
            .history(Some(&layer), "grad_norm", Reduce::Last)
            .unwrap();
        assert_eq!(grads.iter().map(|&r| t.step[r]).collect::<Vec<_>>(), steps);
        assert!(t.value[grads[7]].is_nan() && t.max[grads[7]].is_nan() && values[7].is_nan());
        assert!((t.value[grads[3]] - values[3]).abs() < 1e-12);
        // Weights were measured on steps 0, 5 and 10 only: no row for the other steps.
        let weights = rows(Group::Layer, Some(&layer), "weight_norm");
        assert_eq!(
            weights.iter().map(|&r| t.step[r]).collect::<Vec<_>>(),
            [0, 5, 10]
        );
        let loss = rows(Group::Run, None, "loss");
        assert_eq!(loss.len(), 12);
        assert!((t.value[loss[3]] - 0.25).abs() < 1e-6);
        assert!(t.first_step.iter().zip(&t.step).all(|(a, b)| a <= b));
    }
}
