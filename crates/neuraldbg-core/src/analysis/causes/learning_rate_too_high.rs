//! `learning_rate_too_high`: updates so large they blow the weights (and with them gradients,
//! activations or the loss) up after a healthy start.

use super::super::remedy::Remedy;
use super::super::vocab::{Cause, Failure};
use super::{Case, CauseRule, RemedyCase, Votes, fmt_g};

pub(crate) struct LearningRateTooHigh;

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
                step_size(c, v);
            }
            Failure::VanishingGradients => {
                if f.at_start {
                    return;
                }
                if f.healthy_start && (f.prior_explosion.is_some() || f.weight_growth >= 0.5) {
                    v.add(
                        1.5,
                        format!(
                            "gradients were healthy at first and weights grew {:.1}x before they vanished",
                            10f64.powf(f.weight_growth)
                        ),
                    );
                }
                if f.lr_spike >= 3.0 {
                    v.add(
                        1.0,
                        format!("the learning rate rose {:.0}x just before", f.lr_spike),
                    );
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
                    step_size(c, v);
                }
                if f.at_start {
                    v.against(1.5);
                }
            }
            Failure::DeadNeurons => {
                if !f.at_start && f.healthy_start {
                    v.add(1.5, "the units were alive at first and died after updates");
                    step_size(c, v);
                }
            }
            Failure::SaturatedActivations => {
                if !f.at_start && f.healthy_start {
                    v.add(
                        1.5,
                        "the activations were in range at first and saturated after updates",
                    );
                    if f.weight_growth >= 0.3 {
                        v.add(
                            1.0,
                            format!(
                                "the weights before them grew {:.1}x",
                                10f64.powf(f.weight_growth)
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
                step_size(c, v);
                if f.growth >= 1.0 || f.prior_explosion.is_some() {
                    v.add(1.0, "gradient norms grew with it");
                }
            }
            Failure::LossPlateau => {
                if ev.loss_peak_ratio >= 2.0 {
                    v.add(
                        1.5,
                        format!(
                            "the loss jumped to {:.1}x its best before it flattened: the steps overshoot",
                            ev.loss_peak_ratio
                        ),
                    );
                }
                if let Some(r) = ev.update_ratio.filter(|r| *r > 0.5) {
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

    fn remedies(&self, c: &RemedyCase<'_>) -> Vec<Remedy> {
        vec![
            Remedy::LowerLr { lr: c.lr() },
            Remedy::ClipGradients,
            Remedy::Warmup,
        ]
    }
}

/// A learning rate that rose, or steps large relative to the weights.
fn step_size(c: &Case<'_>, v: &mut Votes) {
    if c.f.lr_spike >= 3.0 {
        v.add(
            1.5,
            format!(
                "the learning rate had risen {:.0}x from its first value",
                c.f.lr_spike
            ),
        );
    }
    if let Some(r) = c.ev.update_ratio {
        if r > 1.0 {
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
