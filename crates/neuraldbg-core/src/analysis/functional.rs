//! Dead units behind functional activations (`F.relu`, `torch.relu` written inline), which have
//! no module to observe. A unit that outputs zero for the whole batch passes no gradient back:
//! the row of its producing layer's weight gradient is exactly zero, and so is its column in the
//! gradient of the layer that consumes it (whose input it is). Both together, on at least 90%
//! of the units and persisting to the end, are dead units of the producing layer, provided the
//! consumer still gets a gradient itself (through its bias at least); either alone is not (a
//! zero row can also be a path blocked behind it).

use crate::engine::Run;
use crate::track::ZeroShare;

use super::episodes::Episode;
use super::vocab::Failure;

pub(crate) fn dead_units(run: &Run) -> Vec<Episode> {
    let model = &run.model;
    let Some(last) = run.last_step else {
        return Vec::new();
    };
    let weighted: Vec<usize> = (0..model.layers.len())
        .filter(|&l| model.layers[l].weight.is_some())
        .collect();
    let mut out = Vec::new();
    for pair in weighted.windows(2) {
        let (producer, consumer) = (pair[0], pair[1]);
        let (ml, mn) = (model.layers[producer].module, model.layers[consumer].module);
        // An activation module between them is observed directly.
        if (ml + 1..mn).any(|m| model.module_activation[m].is_some()) {
            continue;
        }
        // The producer's output units are the consumer's input units (a convolution consumer
        // sees each one through its kernel: a multiple).
        let (Some((weight, fan_l)), Some((_, fan_n))) =
            (model.layers[producer].weight, model.layers[consumer].weight)
        else {
            continue;
        };
        let units = model.spec.params[weight].numel / fan_l.max(1);
        if units == 0 || fan_n % units != 0 {
            continue;
        }
        let (rows, cols) = (
            &run.layers[producer].zero_rows,
            &run.layers[consumer].zero_cols,
        );
        let (Some(rows_since), Some(cols_since)) = (rows.since, cols.since) else {
            continue;
        };
        // Zero columns mean zero inputs only while the consumer itself gets a gradient (its
        // bias does, even when every input is zero).
        let consumer_grad = run.layers[consumer].grad_last;
        if !(consumer_grad.is_finite() && consumer_grad > 0.0) {
            continue;
        }
        let fraction = rows.last.unwrap_or(0.0).min(cols.last.unwrap_or(0.0));
        if fraction < ZeroShare::DEAD {
            continue;
        }
        let onset = rows_since.max(cols_since);
        out.push(Episode {
            failure: Failure::DeadNeurons,
            onset,
            events: Vec::new(),
            root: Some(ml),
            root_event: None,
            affected: vec![ml],
            margin: fraction,
            duration: last.saturating_sub(onset) + 1,
            to_end: true,
            p_failure: 0.0,
            explained_by: None,
            fraction,
            exact_zero: false,
            no_gradient: false,
        });
    }
    out
}
