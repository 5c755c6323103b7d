//! `vanishing_gradients`: gradient norms below the vanishing threshold. Located where the
//! failure begins along the backward pass.

use crate::engine::Run;
use crate::event::SemanticEvent;

use super::super::episodes::Episode;
use super::super::vocab::Failure;
use super::{FailureRule, Link, Sentence, after_bad_data, breadth, more_of_the_same};

pub(crate) struct VanishingGradients;

/// Steps a gradient may stay tiny at the start of a run and still be a normal beginning.
const BEGINNING_STEPS: u64 = 20;

/// Update-to-weight ratio at or below which the optimizer's steps are far too small to train
/// (a hundredth of a training step's ~1e-3).
const FAR_TOO_SMALL_UPDATE: f64 = 1e-5;

/// A gradient that is zero or tiny at the first steps and recovers while the loss falls is how
/// some models start, not a failure: an adapter whose other half is zero-initialised (`LoRA`'s
/// `lora_B`) passes no gradient to its first half until that half moves, and attention's query
/// and key get almost none while the scores are near uniform at initialization. It recovers
/// within [`BEGINNING_STEPS`], or later when the optimizer's steps are measured far too small
/// to move the other half sooner (a learning rate too low, the run's finding then).
pub(crate) fn normal_beginning(run: &Run, e: &Episode) -> bool {
    let first = run.first_step.unwrap_or(0);
    let falls = run.loss.initial.is_some_and(|initial| {
        initial.is_finite() && run.loss.best.is_finite() && run.loss.best < 0.9 * initial
    });
    let slow_steps =
        super::super::causes::measured_update_ratio(run).is_some_and(|r| r <= FAR_TOO_SMALL_UPDATE);
    e.failure == Failure::VanishingGradients
        && e.onset <= first + 1
        && !e.to_end
        && (e.duration <= BEGINNING_STEPS || slow_steps)
        && falls
}

/// A loss that was exactly zero from its first step to its last: the model sat at the loss's
/// floor, where every gradient is zero because nothing is left to learn (a run that starts
/// converged), not because the gradients vanished on their way back.
fn at_zero_loss(run: &Run) -> bool {
    let l = &run.loss;
    l.observed > 0 && l.initial == Some(0.0) && l.best == 0.0 && l.last_smoothed == 0.0
}

impl FailureRule for VanishingGradients {
    fn failure(&self) -> Failure {
        Failure::VanishingGradients
    }

    fn precedence(&self) -> u8 {
        3
    }

    fn locate(
        &self,
        run: &Run,
        events: &[SemanticEvent],
        cluster: &[usize],
        onset: u64,
    ) -> (Option<usize>, Option<usize>) {
        super::exploding_gradients::backward_root(run, events, cluster, onset)
    }

    fn probability(&self, run: &Run, e: &Episode) -> f64 {
        let d = e.duration as f64;
        let end = if e.to_end { 1.0 } else { 0.0 };
        let x = 0.5 * e.margin.min(2.0) + d.min(30.0) / 10.0 + 2.0 * breadth(run, e) + end;
        let mut p = 1.0 - (-x).exp();
        // Gradients that fade everywhere together long after a healthy start, while the
        // loss approaches zero, are a converged run, not a failure.
        if let (Some(initial), true) = (run.loss.initial, run.loss.observed > 0) {
            if initial > 0.0 && run.loss.best < 1e-3 * initial && e.onset > 0 {
                p *= 0.2;
            }
        }
        if normal_beginning(run, e) || at_zero_loss(run) {
            p *= 0.1;
        }
        p
    }

    fn follows_from(&self, a: &Episode, e: &Episode, l: &Link<'_>) -> bool {
        after_bad_data(a, e, l)
            || match a.failure {
                // A (nearly) completely dead layer explains vanishing gradients in the layers
                // before it. (Dead units behind a functional activation are rooted at their own
                // layer.)
                Failure::DeadNeurons => {
                    let vanishing_root = e.root.unwrap_or(usize::MAX);
                    a.fraction >= 0.9
                        && (a.affected.iter().any(|&m| m > vanishing_root)
                            || (a.root.is_some() && a.root == e.root))
                        && a.onset <= e.onset + l.tol
                }
                // A loss that diverged first moved the weights to where the gradients vanish
                // (saturated or dead units): the blow-up is the finding, the vanishing that
                // began while it lasted is its consequence.
                Failure::LossDivergence => {
                    a.p_failure >= 0.5
                        && a.onset < e.onset
                        && (a.to_end || e.onset <= a.onset + a.duration)
                }
                // Layers the backward pass never reached (a loss cut from the model's output:
                // `jax.grad` then returns exact zeros): the cut is the finding.
                Failure::StalledLayer => {
                    a.no_gradient
                        && a.onset <= e.onset + l.tol
                        && e.affected.iter().all(|m| a.affected.contains(m))
                }
                _ => more_of_the_same(a, e),
            }
    }

    fn place(&self, s: &Sentence<'_>) -> String {
        super::exploding_gradients::along_the_backward_pass(s)
    }
}
