//! `learning_rate_too_high`: updates so large they blow the weights (and with them gradients,
//! activations or the loss) up after a healthy start.

use crate::engine::Run;

use super::super::failures::dead_share_at_start;
use super::super::remedy::Remedy;
use super::super::vocab::{Cause, Failure};
use super::evidence::{
    DIED_AFTER_UPDATES, Evidence, MEASURED_TOO_LARGE, TRAINING_UPDATE, decades_ratio,
    measured_step, outlasted_cut, times,
};
use super::{Case, CauseRule, Facts, RemedyCase, Votes, climbing, facts_of, fmt_g};

pub(crate) struct LearningRateTooHigh;

/// What only the step size explains in one episode.
#[derive(serde::Serialize)]
struct Steps {
    /// Learning rate around the onset relative to the first one.
    lr_spike: f64,
    /// Decades the root layer's weight norm grew from its first measurement.
    weight_growth: f64,
}

impl Steps {
    fn of(c: &Case<'_>) -> Self {
        let run = c.run;
        let onset = c.e.onset;
        let lr_spike = match (
            c.ev.lr_first,
            run.lr_between(onset.saturating_sub(5), onset),
        ) {
            (Some(first), Some(now)) if first > 0.0 && now.is_finite() => now / first,
            _ => 1.0,
        };
        let weight_growth =
            c.e.root
                .and_then(|m| run.model.module_layer[m])
                .and_then(|l| {
                    let t = &run.layers[l];
                    Some(decades_ratio(t.weight_last?, t.weight_first?))
                })
                .unwrap_or(0.0);
        Self {
            lr_spike,
            weight_growth,
        }
    }
}

/// The loss' largest smoothed value relative to the best before it (at the plateau, when
/// there is one): how far the steps overshoot.
pub(crate) fn loss_peak_ratio(run: &Run) -> f64 {
    run.loss.peak_at_plateau.unwrap_or(run.loss.peak_ratio)
}

impl CauseRule for LearningRateTooHigh {
    fn cause(&self) -> Cause {
        Cause::LearningRateTooHigh
    }

    fn phrase(&self) -> &'static str {
        "a learning rate that is too high"
    }

    fn explains(&self, failure: Failure) -> bool {
        !matches!(
            failure,
            Failure::DataAnomaly | Failure::StalledLayer | Failure::LossScaleCollapse
        )
    }

    fn evidence(&self, c: &Case<'_>, v: &mut Votes) {
        let (ev, f) = (c.ev, c.f);
        if climbing(c.run).is_some() {
            // Steps that climb the gradient blow up at any learning rate: a lower one climbs
            // slower, it does not descend.
            v.against(3.0);
        }
        let own = Steps::of(c);
        match c.e.failure {
            Failure::ExplodingGradients => {
                if f.at_start {
                    v.against(2.0);
                    return;
                }
                if f.healthy_start {
                    v.add(
                        2.0,
                        "gradients were healthy at the start and blew up after updates",
                    );
                }
                if f.root_growth >= 1.0 {
                    v.add(
                        1.0,
                        format!(
                            "the gradient norm grew {:.1} decades before the threshold",
                            f.root_growth
                        ),
                    );
                }
                if f.prior_divergence.is_some() {
                    v.add(1.0, "the loss diverged with it");
                }
                step_size(c, &own, v);
            }
            Failure::VanishingGradients => {
                if f.at_start {
                    return;
                }
                if f.healthy_start && (f.prior_explosion.is_some() || own.weight_growth >= 0.5) {
                    v.add(
                        1.5,
                        format!(
                            "gradients were healthy at first and weights grew {:.1}x before they vanished",
                            10f64.powf(own.weight_growth)
                        ),
                    );
                }
                if own.lr_spike >= 3.0 {
                    v.add(
                        1.0,
                        format!("the learning rate rose {:.0}x just before", own.lr_spike),
                    );
                } else if f.healthy_start && f.prior_divergence.is_none() {
                    // Gradients that were healthy vanish after steps too large for the weights
                    // (after a divergence, the step size is the divergence's evidence).
                    step_size(c, &own, v);
                }
            }
            Failure::NonFinite => {
                if f.blew_up() && f.root_cause.is_none() {
                    let why = if let Some(j) = f.prior_explosion {
                        format!(
                            "gradients exploded from step {} before the first NaN/Inf",
                            c.episodes[j].onset
                        )
                    } else if let Some(j) = f.prior_divergence {
                        format!(
                            "the loss diverged from step {} before the first NaN/Inf",
                            c.episodes[j].onset
                        )
                    } else {
                        format!(
                            "the total gradient norm grew {:.1} decades before the first NaN/Inf",
                            f.growth
                        )
                    };
                    v.add(2.5, why);
                    step_size(c, &own, v);
                }
                if f.at_start {
                    v.against(1.5);
                }
            }
            Failure::DeadNeurons => {
                // Dead at the first measurement: nothing says the updates killed them (a
                // GRU's head on raw inputs is half dead before any update and loses more
                // under a learning rate its base trains well with), unless the inputs are
                // ordinary and each step was measured far larger than a training one: then
                // the share that died after updates says so.
                if f.at_start && !(ev.ordinary_inputs() && measured_too_large(ev).is_some()) {
                    return;
                }
                if f.healthy_start {
                    v.add(1.5, "the units were alive at first and died after updates");
                    step_size(c, &own, v);
                } else if let Some(first) = dead_share_at_start(c.run, c.e)
                    .filter(|first| c.e.fraction - first >= DIED_AFTER_UPDATES)
                {
                    // Some units of a layer can be dead from initialization (a ReLU behind a
                    // recurrent layer's bounded output): the rest dying after updates is the
                    // same evidence.
                    v.add(
                        1.5,
                        format!(
                            "{:.0}% of the units were dead at first and {:.0}% after updates",
                            100.0 * first,
                            100.0 * c.e.fraction
                        ),
                    );
                    step_size(c, &own, v);
                }
            }
            Failure::SaturatedActivations => {
                if !f.at_start && f.healthy_start {
                    v.add(
                        1.5,
                        "the activations were in range at first and saturated after updates",
                    );
                    if own.weight_growth >= 0.3 {
                        v.add(
                            1.0,
                            format!(
                                "the weights before them grew {:.1}x",
                                10f64.powf(own.weight_growth)
                            ),
                        );
                    }
                }
            }
            Failure::LossDivergence => {
                if !f.at_start {
                    v.add(
                        2.0,
                        "the loss rose after a healthy start, i.e. after updates",
                    );
                }
                step_size(c, &own, v);
                if f.growth >= 1.0 || f.prior_explosion.is_some() {
                    v.add(1.0, "gradient norms grew with it");
                }
            }
            Failure::LossPlateau => {
                if super::super::failures::frozen_plateau(c.run, c.e.onset).is_some() {
                    // The loss came down while the rate was cut and stopped once it was a
                    // hundredth of its peak: steps too small to move it, not steps that overshoot.
                    v.against(3.0);
                    return;
                }
                if outlasted_cut(c.run, c.e).is_some() {
                    // Steps that overshoot bring the loss down once they are 10x smaller; this
                    // loss stayed where it was.
                    v.against(3.0);
                    return;
                }
                let peak = loss_peak_ratio(c.run);
                if peak >= 2.0 {
                    v.add(
                        1.5,
                        format!(
                            "the loss jumped to {peak:.1}x its best before it flattened: the steps overshoot"
                        ),
                    );
                }
                if let Some((alternation, swing)) = c.run.loss.oscillation() {
                    v.add(
                        2.0,
                        format!(
                            "the loss reverses direction on {:.0}% of the steps, by ~{:.0}% of its level each time: the steps overshoot the minimum back and forth instead of descending",
                            100.0 * alternation,
                            100.0 * swing
                        ),
                    );
                }
                if measured_too_large(ev).is_some() {
                    // Steps measured far larger than a training one keep the loss from settling.
                    step_size(c, &own, v);
                } else if let Some(r) = step_ratio(ev).filter(|r| *r > 0.5) {
                    v.add(
                        1.5,
                        format!(
                            "each step moves the weights by ~{} of their size{}",
                            fmt_g(r),
                            c.lr_txt
                        ),
                    );
                }
            }
            Failure::SaturatedGradients => {
                if f.root_growth >= 1.0 {
                    v.add(0.5, "gradient norms grew after updates");
                }
            }
            Failure::DataAnomaly
            | Failure::LossScaleCollapse
            | Failure::StalledLayer
            | Failure::ReplicaDivergence => {}
        }
    }

    fn run_facts(&self, run: &Run) -> Facts {
        let mut out = Facts::new();
        out.insert("loss_peak_ratio".into(), loss_peak_ratio(run).into());
        out.insert("loss_alternation".into(), run.loss.alternation().into());
        out.insert("loss_swing".into(), run.loss.relative_swing().into());
        out
    }

    fn episode_facts(&self, c: &Case<'_>) -> Facts {
        facts_of(&Steps::of(c))
    }

    fn remedies(&self, c: &RemedyCase<'_>) -> Vec<Remedy> {
        vec![
            Remedy::LowerLr { lr: c.lr() },
            Remedy::ClipGradients,
            Remedy::Warmup,
        ]
    }
}

/// The update-to-weight ratio, as evidence of the learning rate: not when the weights started
/// far below a variance-preserving scale (every step is large beside them: the ratio then
/// measures the weights), nor, under a plain gradient step (SGD), far above it (the gradients
/// grow with the weights of the layers around each one, and the steps with them: the ratio
/// then measures the initialization) or on inputs far off a normalized scale (the same with
/// the inputs: it measures the data, see `bad_input_data`), nor when a weight penalty
/// outweighs the data (the steps are then the penalty's).
fn step_ratio(ev: &Evidence) -> Option<f64> {
    let init_made_it = ev.gain_too_small() || ev.sgd_steps_of_large_weights().is_some();
    let data_made_it = ev.sgd_steps_of_huge_inputs().is_some();
    ev.update_ratio
        .filter(|_| !init_made_it && !data_made_it && !ev.steps_are_the_penalty())
}

/// That ratio, measured, when it is at least [`MEASURED_TOO_LARGE`].
fn measured_too_large(ev: &Evidence) -> Option<f64> {
    step_ratio(ev).filter(|r| ev.update_measured && *r >= MEASURED_TOO_LARGE)
}

/// A learning rate that rose, or steps large relative to the weights.
fn step_size(c: &Case<'_>, own: &Steps, v: &mut Votes) {
    if own.lr_spike >= 3.0 {
        v.add(
            1.5,
            format!(
                "the learning rate had risen {:.0}x from its first value",
                own.lr_spike
            ),
        );
    }
    if let Some(r) = step_ratio(c.ev) {
        if measured_too_large(c.ev).is_some() {
            v.add(
                2.0,
                format!(
                    "each step moves the weights by {}: about {}x the ~1e-3 of a learning rate that trains",
                    measured_step(r, c.ev.lr_first),
                    times(r / TRAINING_UPDATE)
                ),
            );
        } else if r > 1.0 {
            v.add(
                1.0,
                format!(
                    "each step moves the weights by ~{}x their size{}",
                    fmt_g(r),
                    c.lr_txt
                ),
            );
        } else if r > 0.1 {
            v.add(
                0.5,
                format!(
                    "each step moves the weights by ~{} of their size{}",
                    fmt_g(r),
                    c.lr_txt
                ),
            );
        }
    }
}
