//! `learning_rate_too_low`: healthy gradients, yet steps too small to move the loss.

use super::super::remedy::Remedy;
use super::super::vocab::{Cause, Failure};
use super::{Case, CauseRule, RemedyCase, Votes, fmt_g};

pub(crate) struct LearningRateTooLow;

/// An update-to-weight ratio typical of a learning rate that trains (about 1e-3 per step).
const TRAINING_UPDATE: f64 = 1e-3;

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
        if let Some(r) = ev.update_ratio {
            // Measured, the step size is the learning rate's own signature; estimated (from the
            // lr and the first norms), it can be off by the optimizer's scaling.
            let weight = match (r, ev.update_measured) {
                (r, true) if r < 1e-5 => 3.0,
                (r, true) if r < 1e-4 => 2.5,
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
            v.add(
                weight,
                format!(
                    "each step moves the weights by ~{} of their size ({how}{lr}): about {}x less than the ~1e-3 of a learning rate that trains",
                    fmt_g(r),
                    times(TRAINING_UPDATE / r)
                ),
            );
        }
    }

    fn remedies(&self, c: &RemedyCase<'_>) -> Vec<Remedy> {
        vec![
            Remedy::RaiseLr { lr: c.lr() },
            Remedy::LrRangeTest,
            Remedy::AdaptiveOptimizer,
        ]
    }
}

/// A large factor as a reader would say it: "26,500" up to a million, "3.2e7" beyond.
fn times(x: f64) -> String {
    if x < 1e6 {
        let n = (x / 100.0).round() as u64 * 100;
        let s = n.to_string();
        let mut out = String::new();
        for (i, ch) in s.chars().enumerate() {
            if i > 0 && (s.len() - i) % 3 == 0 {
                out.push(',');
            }
            out.push(ch);
        }
        if n == 0 { fmt_g(x) } else { out }
    } else {
        fmt_g(x)
    }
}
