//! `learning_rate_too_low`: healthy gradients, yet steps too small to move the loss.

use super::super::remedy::Remedy;
use super::super::vocab::{Cause, Failure};
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
        if let Some(r) = ev.update_ratio {
            if r < 1e-5 {
                v.add(
                    2.5,
                    format!(
                        "each step moves the weights by only ~{} of their size{}",
                        fmt_g(r),
                        c.lr_txt
                    ),
                );
            } else if r < 1e-4 {
                v.add(
                    1.0,
                    format!(
                        "each step moves the weights by ~{} of their size{}",
                        fmt_g(r),
                        c.lr_txt
                    ),
                );
            }
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
