//! `learning_rate_too_low`: healthy gradients, yet steps too small to move the loss.

use super::super::remedy::Remedy;
use super::super::vocab::{Cause, Failure};
use super::evidence::{
    TRAINING_UPDATE, endless_warmup, held_by_schedule, lr_collapse, lr_collapse_words, tight_clip,
    times,
};
use super::{Case, CauseRule, RemedyCase, Votes, fmt_g};

pub(crate) struct LearningRateTooLow;

impl CauseRule for LearningRateTooLow {
    fn cause(&self) -> Cause {
        Cause::LearningRateTooLow
    }

    fn phrase(&self) -> &'static str {
        "a learning rate that is too low"
    }

    fn explains(&self, failure: Failure) -> bool {
        failure == Failure::LossPlateau
    }

    fn evidence(&self, c: &Case<'_>, v: &mut Votes) {
        let (ev, f) = (c.ev, c.f);
        if f.root_cause.is_some() || f.vanishing_or_dead.is_some() {
            // Another failure stops learning.
            v.against(2.0);
        } else if ev.update_ratio.is_none_or(|r| r < 1e-3) {
            v.add(1.0, "gradients are healthy, yet the loss does not move");
        }
        // Still falling as fast as it began, far above where it started to: each step
        // gets the loss a little lower, and the run ends long before it levels off. The
        // learning rate's doing when its steps are not large (under 5x a training step: steps
        // that large are not why the loss is slow) and nothing in the network or the data
        // slows it: no layer that passes back little gradient, weights and inputs on ordinary
        // scales, no mistake in the program that holds the loss up.
        let large_steps = ev.update_ratio.is_some_and(|r| r >= 5.0 * TRAINING_UPDATE);
        let slowed = large_steps
            || super::saturating_activation::passes_little_gradient(c.run)
            || super::loss_bounded_by_mistake(c.run)
            || !ev.gain_not_off_scale()
            || ev.huge_inputs().is_some()
            || ev.tiny_inputs().is_some()
            || ev.feature_spread.is_some();
        if let Some(p) = super::super::failures::steady_descent(c.run).filter(|_| !slowed) {
            v.add(
                2.5,
                format!(
                    "the loss still falls as fast as it began ({} -> {} over the first half, {} -> {} over the second): far from levelling off, each step takes it only a little lower",
                    fmt_g(p.start),
                    fmt_g(p.mid),
                    fmt_g(p.mid),
                    fmt_g(p.end)
                ),
            );
        }
        if ev.tiny_inputs().is_some() {
            // The steps are small because the gradients are: the inputs are.
            v.against(1.5);
        }
        if let Some(collapse) = lr_collapse(c.run, c.e.onset) {
            v.add(3.0, lr_collapse_words(&collapse));
        }
        if let Some(h) = held_by_schedule(c.run) {
            v.add(
                2.0,
                format!(
                    "the optimizer was built with lr {}, but its scheduler set {} ({}x less) and never changed it: the scheduler is never stepped",
                    fmt_g(h.base),
                    fmt_g(h.held),
                    times(h.base / h.held)
                ),
            );
        }
        if let Some(w) = endless_warmup(c.run) {
            v.add(
                2.0,
                format!(
                    "the learning rate rose from {} to {} (step {}) and was still rising at the end: a warmup far longer than the run",
                    fmt_g(w.first),
                    fmt_g(w.last.1),
                    w.last.0
                ),
            );
        }
        if let Some(clip) = tight_clip(c.run) {
            v.add(
                2.5,
                format!(
                    "gradient clipping cut the gradient on {:.0}% of the steps, typically to 1/{} of its norm, and each SGD step is the clipped gradient's: the clip keeps the steps small{}",
                    100.0 * clip.share,
                    times(1.0 / clip.ratio),
                    clip.loss_scale.map_or(String::new(), |s| format!(
                        "; that cut is what the loss scale ({s:.0}) makes of ordinary gradients: the clip ran before scaler.unscale_(optimizer)"
                    ))
                ),
            );
        }
        if super::parameters_not_updated::cleared(c.run).is_some()
            || super::parameters_not_updated::unmoved(c.run)
        {
            // The steps are zero because the optimizer found no gradient, or its updates never
            // reached the weights, whatever the rate: a rate too low still moves them.
            v.against(5.0);
            return;
        }
        // Weights far above a variance-preserving scale make every step small beside them:
        // then the ratio measures the weights, not the learning rate.
        if let Some(r) = ev.update_ratio.filter(|_| !ev.gain_too_large()) {
            // Measured, the step size is the learning rate's own signature; estimated (from the
            // lr and the first norms), it can be off by the optimizer's scaling.
            // Measured, each decade below a training step weighs 2.5 (capped at 3): a tenth
            // of one is the learning rate's signature, a third of one leans on it (from half
            // of one, where the difference starts to say something).
            let weight = match (r, ev.update_measured) {
                (r, true) if r < 0.5 * TRAINING_UPDATE => {
                    (2.5 * (TRAINING_UPDATE / r).log10()).min(3.0)
                }
                (r, false) if r < 1e-5 => 2.5,
                (r, false) if r < 1e-4 => 1.0,
                _ => return,
            };
            let how = if ev.update_measured {
                "measured"
            } else {
                "estimated"
            };
            let lr = ev
                .lr_first
                .map_or(String::new(), |lr| format!(", lr {}", fmt_g(lr)));
            let words = if r > 0.0 {
                format!(
                    "each step moves the weights by ~{} of their size ({how}{lr}): about {}x less than the ~1e-3 of a learning rate that trains",
                    fmt_g(r),
                    times(TRAINING_UPDATE / r)
                )
            } else {
                format!(
                    "each step left the weights exactly where they were ({how}{lr}), where a learning rate that trains moves them by ~1e-3 of their size"
                )
            };
            v.add(weight, words);
        }
    }

    fn remedies(&self, c: &RemedyCase<'_>) -> Vec<Remedy> {
        if let Some(collapse) = lr_collapse(c.run, c.e.onset) {
            return vec![collapse.remedy()];
        }
        if let Some(h) = held_by_schedule(c.run) {
            return vec![Remedy::StepTheScheduler {
                base: h.base,
                held: h.held,
            }];
        }
        if let Some(w) = endless_warmup(c.run) {
            return vec![Remedy::ShortenWarmup {
                steps: w.last.0 + 1,
                reached: w.last.1,
            }];
        }
        if let Some(clip) = tight_clip(c.run) {
            if let Some(scale) = clip.loss_scale {
                return vec![Remedy::UnscaleBeforeClip {
                    scale,
                    ratio: clip.ratio,
                }];
            }
            return vec![Remedy::LoosenClip { ratio: clip.ratio }];
        }
        vec![
            Remedy::RaiseLr { lr: c.lr() },
            Remedy::LrRangeTest,
            Remedy::AdaptiveOptimizer,
        ]
    }
}
