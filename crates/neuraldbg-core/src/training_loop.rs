//! What the training loop did around the optimizer step, from the facts a collector sends:
//! steps a mixed-precision `GradScaler` skipped for an overflow, the loss scale, gradient
//! clipping between the backward pass and the update, and gradients cleared there (the
//! optimizer received none: `zero_grad()` between `backward()` and `step()`).
//!
//! A skipped step is routine under mixed precision (the scaler halves its scale and retries), so
//! it is never a failure by itself: its non-finite gradients do not feed the health trackers. A
//! loss scale that keeps collapsing is one: the scaler skips step after step and shrinks the
//! scale below 1 (the gradients overflow even unamplified), so the model stops learning.

use crate::observation::{Fact, StepView};

/// Consecutive skipped steps, with the scale below this, confirm a collapse.
const COLLAPSE_SCALE: f64 = 1.0;
/// Consecutive skipped steps that confirm a collapse (with the scale below [`COLLAPSE_SCALE`]).
const COLLAPSE_SKIPS: u64 = 3;
/// Consecutive skipped steps that confirm a collapse whatever the scale.
const COLLAPSE_SKIPS_ANY_SCALE: u64 = 64;
/// A step counts as clipped when the gradient the optimizer received is below this share of the
/// one the backward pass produced.
const CLIPPED_BELOW: f64 = 0.99;
/// A clipped step this close to the latest stretch of clipped steps extends it.
const CLIP_GAP: u64 = 8;
/// Stretches of clipped steps kept (memory stays bounded: past this, the latest one grows).
const CLIP_STRETCHES: usize = 256;

/// Consecutive (within [`CLIP_GAP`]) steps whose gradients were clipped.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct ClipStretch {
    pub first: u64,
    pub last: u64,
    /// Clipped steps in the stretch.
    pub steps: u64,
    /// Smallest ratio of clipped to produced gradient norm in the stretch.
    pub ratio_min: f64,
}

/// A loss scale that collapsed: the scaler skipped every step from `onset`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct ScaleCollapse {
    /// First step of the run of skipped steps.
    pub onset: u64,
    /// Step at which the collapse was confirmed.
    pub confirmed: u64,
    /// Module (spec index) where values first overflowed, when it was found.
    pub module: Option<usize>,
    /// Loss scale when confirmed.
    pub scale: f64,
    /// Skipped steps in the run when confirmed.
    pub skips: u64,
}

/// Skips, loss scale and clipping of one run.
#[derive(Clone, Debug, Default)]
pub struct LoopTrack {
    /// Steps the optimizer skipped (mixed-precision overflow).
    pub skipped_steps: u64,
    /// Length and first step of the current run of consecutive skipped steps.
    run_len: u64,
    run_start: u64,
    /// Where values first overflowed in the current run of skips.
    run_module: Option<usize>,
    pub loss_scale_first: Option<f64>,
    pub loss_scale_last: Option<f64>,
    pub loss_scale_min: Option<f64>,
    /// First (and, if any, the latest) collapse of the loss scale.
    pub collapse: Option<ScaleCollapse>,
    /// Steps whose gradients were rescaled (clipped) between backward and the update.
    pub clipped_steps: u64,
    /// Smallest ratio of clipped to produced gradient norm.
    pub clip_ratio_min: Option<f64>,
    /// Sum of the clipped steps' log ratios (their geometric mean: [`Self::clip_ratio_typical`]).
    clip_log_sum: f64,
    /// Where the clipped steps were, as stretches in step order.
    pub clipped: Vec<ClipStretch>,
    /// Steps whose gradient reaching the optimizer was read ([`Fact::ClipRatio`]), and those
    /// where none reached it (a ratio of exactly 0: the gradients were cleared after the
    /// backward pass).
    pub checked_steps: u64,
    pub cleared_steps: u64,
}

impl LoopTrack {
    /// Reads one step's facts. `overflow_module` is where values first overflowed in this
    /// step, when known. Returns whether the optimizer skipped the step.
    pub fn observe(&mut self, v: &StepView<'_>, overflow_module: Option<usize>) -> bool {
        if let Some(scale) = v.fact(Fact::LossScale).filter(|s| s.is_finite()) {
            self.loss_scale_first.get_or_insert(scale);
            self.loss_scale_last = Some(scale);
            self.loss_scale_min = Some(self.loss_scale_min.map_or(scale, |m| m.min(scale)));
        }
        if let Some(r) = v.fact(Fact::ClipRatio).filter(|r| r.is_finite()) {
            self.checked_steps += 1;
            if r == 0.0 {
                self.cleared_steps += 1;
            } else if r < CLIPPED_BELOW {
                self.clipped_steps += 1;
                self.clip_ratio_min = Some(self.clip_ratio_min.map_or(r, |m| m.min(r)));
                self.clip_log_sum += r.ln();
                self.note_clipped(v.step, r);
            }
        }
        let skipped = v.fact(Fact::OptimizerSkipped).is_some_and(|s| s >= 0.5);
        if !skipped {
            self.run_len = 0;
            self.run_module = None;
            return false;
        }
        self.skipped_steps += 1;
        if self.run_len == 0 {
            self.run_start = v.step;
        }
        self.run_len += 1;
        if self.run_module.is_none() {
            self.run_module = overflow_module;
        }
        let scale = self.loss_scale_last.unwrap_or(f64::NAN);
        let collapsed = (self.run_len >= COLLAPSE_SKIPS && scale < COLLAPSE_SCALE)
            || self.run_len >= COLLAPSE_SKIPS_ANY_SCALE;
        if collapsed && self.collapse.is_none_or(|c| c.onset != self.run_start) {
            self.collapse = Some(ScaleCollapse {
                onset: self.run_start,
                confirmed: v.step,
                module: self.run_module,
                scale,
                skips: self.run_len,
            });
        }
        true
    }

    /// The typical ratio of clipped to produced gradient norm over the clipped steps (their
    /// geometric mean), when any step was clipped.
    pub fn clip_ratio_typical(&self) -> Option<f64> {
        (self.clipped_steps > 0).then(|| (self.clip_log_sum / self.clipped_steps as f64).exp())
    }

    /// Share of the steps whose gradient reached the optimizer (checked and not cleared) that
    /// clipping rescaled.
    pub fn clipped_share(&self) -> Option<f64> {
        let reached = self.checked_steps.saturating_sub(self.cleared_steps);
        (reached > 0).then(|| self.clipped_steps as f64 / reached as f64)
    }

    fn note_clipped(&mut self, step: u64, ratio: f64) {
        let full = self.clipped.len() >= CLIP_STRETCHES;
        match self.clipped.last_mut() {
            Some(s) if full || step <= s.last + CLIP_GAP => {
                s.last = step;
                s.steps += 1;
                s.ratio_min = s.ratio_min.min(ratio);
            }
            _ => self.clipped.push(ClipStretch {
                first: step,
                last: step,
                steps: 1,
                ratio_min: ratio,
            }),
        }
    }

    /// The share of the checked steps whose optimizer step received no gradient (None before
    /// any was checked).
    pub fn cleared_share(&self) -> Option<f64> {
        (self.checked_steps > 0).then(|| self.cleared_steps as f64 / self.checked_steps as f64)
    }

    /// The clipping of the stretches that overlap steps `[from, to]` (both included): clipped
    /// steps, the first one, and the smallest ratio. None when none overlaps.
    pub fn clipping_during(&self, from: u64, to: u64) -> Option<ClipStretch> {
        self.clipped
            .iter()
            .filter(|s| s.first <= to && s.last >= from)
            .copied()
            .reduce(|a, b| ClipStretch {
                first: a.first,
                last: b.last,
                steps: a.steps + b.steps,
                ratio_min: a.ratio_min.min(b.ratio_min),
            })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::observation::Observation;

    fn step(
        step: u64,
        skipped: bool,
        scale: f64,
        module: Option<usize>,
    ) -> (Observation, Option<usize>) {
        let facts = vec![
            (Fact::OptimizerSkipped, if skipped { 1.0 } else { 0.0 }),
            (Fact::LossScale, scale),
        ];
        (
            Observation {
                step,
                facts,
                ..Default::default()
            },
            module,
        )
    }

    #[test]
    fn routine_skips_are_not_a_collapse() {
        let mut t = LoopTrack::default();
        // The scaler calibrates down from 65536 (a few skips), then trains.
        let mut scale = 65536.0;
        for s in 0..40 {
            let skip = s < 6 || s == 20;
            let (o, m) = step(s, skip, scale, None);
            assert_eq!(t.observe(&o.view(), m), skip);
            if skip {
                scale /= 2.0;
            }
        }
        assert_eq!(t.skipped_steps, 7);
        assert!(t.collapse.is_none());
        assert_eq!(t.loss_scale_min, Some(512.0));
    }

    #[test]
    fn a_scale_that_keeps_collapsing_is_confirmed_with_its_module() {
        let mut t = LoopTrack::default();
        let mut scale = 4.0;
        for s in 0..10 {
            let (o, m) = step(s, s >= 2, scale, if s == 3 { Some(5) } else { None });
            t.observe(&o.view(), m);
            if s >= 2 {
                scale /= 2.0;
            }
        }
        let c = t.collapse.expect("collapsed");
        assert_eq!(c.onset, 2);
        assert_eq!(c.module, Some(5));
        assert!(c.scale < 1.0);
        assert!(
            c.confirmed >= 4 && c.confirmed <= 6,
            "confirmed at {}",
            c.confirmed
        );
    }

    #[test]
    fn clipping_is_counted_when_it_bites() {
        let mut t = LoopTrack::default();
        for (s, r) in [(0, 1.0), (1, 0.999), (2, 0.4), (3, 0.1), (4, 1.0)] {
            let o = Observation {
                step: s,
                facts: vec![(Fact::ClipRatio, r)],
                ..Default::default()
            };
            t.observe(&o.view(), None);
        }
        assert_eq!(t.clipped_steps, 2);
        assert_eq!(t.clip_ratio_min, Some(0.1));
        // The geometric mean of 0.4 and 0.1, over 2 of the 5 steps.
        assert!((t.clip_ratio_typical().expect("clipped") - 0.2).abs() < 1e-12);
        assert_eq!(t.clipped_share(), Some(0.4));
        assert_eq!(t.cleared_share(), Some(0.0));
        let during = t.clipping_during(0, 2).expect("clipped at step 2");
        assert_eq!((during.first, during.last, during.steps), (2, 3, 2));
        assert!(t.clipping_during(4, 9).is_none());
    }

    #[test]
    fn clipping_far_from_an_episode_is_not_clipping_during_it() {
        // Clipped at steps 2 and 100 only: an explosion at steps 30-50 was not clipped.
        let mut t = LoopTrack::default();
        for s in 0..=120u64 {
            let r = if s == 2 || s == 100 { 0.5 } else { 1.0 };
            let o = Observation {
                step: s,
                facts: vec![(Fact::ClipRatio, r)],
                ..Default::default()
            };
            t.observe(&o.view(), None);
        }
        assert!(t.clipping_during(30, 50).is_none());
        assert_eq!(t.clipping_during(90, 110).map(|c| c.steps), Some(1));
        assert_eq!(t.clipped.len(), 2);
    }

    #[test]
    fn clipping_stretches_stay_bounded() {
        let mut t = LoopTrack::default();
        for k in 0..10_000u64 {
            let o = Observation {
                step: k * 100,
                facts: vec![(Fact::ClipRatio, 0.5)],
                ..Default::default()
            };
            t.observe(&o.view(), None);
        }
        assert_eq!(t.clipped.len(), CLIP_STRETCHES);
        assert_eq!(
            t.clipping_during(0, u64::MAX).map(|c| c.steps),
            Some(10_000)
        );
    }

    #[test]
    fn gradients_cleared_before_the_step_are_counted_apart_from_clipping() {
        let mut t = LoopTrack::default();
        assert_eq!(t.cleared_share(), None);
        for (s, r) in [(0, 0.0), (1, 0.0), (2, 0.5), (3, 0.0)] {
            let o = Observation {
                step: s,
                facts: vec![(Fact::ClipRatio, r)],
                ..Default::default()
            };
            t.observe(&o.view(), None);
        }
        assert_eq!((t.cleared_steps, t.checked_steps), (3, 4));
        assert_eq!(t.cleared_share(), Some(0.75));
        assert_eq!(t.clipped_steps, 1, "only the rescaled step is clipping");
    }
}
