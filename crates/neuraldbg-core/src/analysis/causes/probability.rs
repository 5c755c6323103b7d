//! How likely an episode is to be a real failure (independent of its cause).

use crate::engine::Run;

use super::super::episodes::Episode;
use super::super::vocab::Failure;

/// Probability that an episode is a real failure, from how far past its threshold it went, how
/// long it lasted and how much of the model it reached.
#[allow(clippy::many_single_char_names)]
pub(crate) fn base_probability(run: &Run, e: &Episode) -> f64 {
    let n_layers = run.model.layers.len().max(1) as f64;
    let breadth = e.affected.len() as f64 / n_layers;
    let d = e.duration as f64;
    let end = if e.to_end { 1.0 } else { 0.0 };
    let sig = |x: f64| 1.0 / (1.0 + (-x).exp());
    let p = match e.failure {
        // Never an episode: confirmed by the loop track, its hypothesis is built directly.
        Failure::LossScaleCollapse => 0.9,
        Failure::NonFinite => {
            if e.to_end || e.duration >= 2 {
                0.99
            } else {
                0.7
            }
        }
        Failure::ExplodingGradients => {
            let x = 1.2 * e.margin.min(3.0) + d.min(20.0) / 5.0 + 2.0 * breadth + 0.5 * end
                - if !e.to_end && e.duration <= 2 {
                    0.8
                } else {
                    0.0
                };
            1.0 - (-x.max(0.0)).exp()
        }
        Failure::VanishingGradients => {
            let x = 0.5 * e.margin.min(2.0) + d.min(30.0) / 10.0 + 2.0 * breadth + end;
            let mut p = 1.0 - (-x).exp();
            // Gradients that fade everywhere together long after a healthy start, while the
            // loss approaches zero, are a converged run, not a failure.
            if let (Some(initial), true) = (run.loss.initial, run.loss.observed > 0) {
                if initial > 0.0 && run.loss.best < 1e-3 * initial && e.onset > 0 {
                    p *= 0.2;
                }
            }
            if normal_beginning(run, e) {
                p *= 0.1;
            }
            p
        }
        Failure::DeadNeurons => {
            let t = 0.5;
            let base = ((e.fraction - t) / (1.0 - t)).clamp(0.0, 1.0);
            let persist = if e.to_end || e.duration >= 10 {
                1.0
            } else {
                0.6
            };
            sig(6.0 * (base - 0.4)) * persist
        }
        Failure::SaturatedActivations => {
            let t = 0.5;
            // Severity: the share of saturated outputs, or how little gradient the activation
            // still passes back (1 - 2 x mean slope), whichever is worse.
            let slope = e
                .root
                .and_then(|m| run.model.module_activation[m])
                .map_or(f64::NAN, |a| run.acts[a].min_slope);
            let by_slope = if slope.is_finite() {
                (1.0 - 2.0 * slope).clamp(0.0, 1.0)
            } else {
                0.0
            };
            let base = ((e.fraction - t) / (1.0 - t)).clamp(0.0, 1.0).max(by_slope);
            let persist = if e.to_end || e.duration >= 10 {
                1.0
            } else {
                0.6
            };
            sig(6.0 * (base - 0.5)) * persist
        }
        Failure::SaturatedGradients => (0.1 + 0.25 * breadth * end).min(0.35),
        // Replicas differ far beyond float noise (margin: decades past the tolerance); more
        // certain the longer it lasts.
        Failure::ReplicaDivergence => {
            let persist = if e.to_end || e.duration >= 3 {
                0.1
            } else {
                0.0
            };
            (0.6 + 0.1 * e.margin.min(3.0) + persist).min(0.97)
        }
        Failure::DataAnomaly => {
            if e.margin.is_infinite() {
                0.97
            } else {
                // Margin is decades past the out-of-distribution factor (100x by default).
                sig(2.0 * (e.margin + 2.0 - 2.5))
            }
        }
        Failure::LossDivergence => {
            let x = 1.0 + 2.0 * e.margin.min(3.0) + d.min(20.0) / 10.0 + 0.5 * end;
            let p = 1.0 - (-x).exp();
            // A spike the run recovered from within a few steps is a warning more than a failure.
            if !e.to_end && e.duration <= 5 {
                p.min(0.6)
            } else {
                p
            }
        }
        // Detected only over at least 20 steps (see `stalled`); surer the longer it lasts.
        Failure::StalledLayer => 0.5 + 0.45 * (d / 60.0).min(1.0),
        Failure::LossPlateau => {
            let w = 100.0;
            let stuck = run
                .loss
                .initial
                .is_some_and(|i| run.loss.last_smoothed >= 0.95 * i);
            0.35 + 0.2 * (d / w).min(1.0) + if stuck { 0.2 } else { 0.0 } + 0.1 * end
        }
    };
    p.clamp(0.0, 0.99)
}

/// Steps a gradient may stay tiny at the start of a run and still be a normal beginning.
const BEGINNING_STEPS: u64 = 20;

/// A gradient that is zero or tiny at the first steps and recovers within
/// [`BEGINNING_STEPS`] while the loss falls is how some models start, not a failure: an
/// adapter whose other half is zero-initialised (`LoRA`'s `lora_B`) passes no gradient to its
/// first half until that half moves, and attention's query and key get almost none while the
/// scores are near uniform at initialization.
pub(crate) fn normal_beginning(run: &Run, e: &Episode) -> bool {
    let first = run.first_step.unwrap_or(0);
    let falls = run.loss.initial.is_some_and(|initial| {
        initial.is_finite() && run.loss.best.is_finite() && run.loss.best < 0.9 * initial
    });
    e.failure == Failure::VanishingGradients
        && e.onset <= first + 1
        && !e.to_end
        && e.duration <= BEGINNING_STEPS
        && falls
}

/// The base probability, corroborated by each failure this one explains.
pub(crate) fn failure_probability(episodes: &[Episode], k: usize) -> f64 {
    let p = episodes[k].p_failure;
    let consequences = episodes
        .iter()
        .filter(|o| o.explained_by == Some(k))
        .count() as f64;
    (p + 0.1 * consequences * (1.0 - p)).clamp(0.0, 0.99)
}
