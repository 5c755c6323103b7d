//! `parameters_not_updated`: parameters the optimizer never changes: in no optimizer, in a
//! param group with lr 0, cut from the graph so they never receive a gradient, with their
//! gradients cleared between the backward pass and the optimizer step, or updates computed and
//! never applied to the weights the model runs with.

use super::super::remedy::Remedy;
use super::super::stalled;
use super::super::vocab::{Cause, Failure};
use super::evidence::{lr_collapse, lr_collapse_words, thousands, weighted_tracks};
use super::{Case, CauseRule, RemedyCase, Votes, fmt_g};
use crate::analysis::stalled::Unreached;
use crate::engine::Run;

pub(crate) struct ParametersNotUpdated;

impl CauseRule for ParametersNotUpdated {
    fn cause(&self) -> Cause {
        Cause::ParametersNotUpdated
    }

    fn phrase(&self) -> &'static str {
        "parameters the optimizer never updates"
    }

    fn explains(&self, failure: Failure) -> bool {
        // A plateau inherits it from the stalled layer that explains it. Gradients cleared
        // before every step leave the network as it was made: whatever it then shows (a
        // gradient that never grows past a zero-initialized layer, units dead from the start)
        // is that, and the evidence says so only then.
        !matches!(
            failure,
            Failure::DataAnomaly | Failure::NonFinite | Failure::LossScaleCollapse
        )
    }

    fn always_candidate(&self, _: Failure) -> bool {
        false
    }

    fn evidence(&self, c: &Case<'_>, v: &mut Votes) {
        let episode = c.e;
        let run = c.run;
        if let Some(share) = cleared(run) {
            v.proof(
                5.0,
                format!(
                    "on {:.0}% of the steps the optimizer step received no gradient: .grad was cleared after backward() and before step() (zero_grad() in between, or step() called before backward() in the loop), so the steps changed nothing",
                    100.0 * share
                ),
            );
            return;
        }
        if unmoved(run) {
            v.proof(
                5.0,
                "every measured update left every measured weight exactly where it was (a step size of 0, read from the weights themselves), though the gradients were healthy: the updates the optimizer computed never reached the weights the model runs with",
            );
            return;
        }
        if let Some(stray) = unregistered(run).filter(|_| episode.failure == Failure::LossPlateau) {
            v.proof(5.0, stray.words());
            return;
        }
        if episode.failure != Failure::StalledLayer {
            return;
        }
        let Some(layer) = episode.root.and_then(|m| run.model.module_layer[m]) else {
            return;
        };
        let track = &run.layers[layer];
        let steps = episode.duration;
        match crate::analysis::stalled::unreached(run).filter(|_| episode.no_gradient) {
            Some(Unreached::NoGradient) => {
                v.proof(
                    5.0,
                    format!(
                        "the model ran its forward pass and the optimizer stepped {steps} times, but no parameter received a gradient and no weight moved: the loss is cut from the model's output"
                    ),
                );
                return;
            }
            Some(Unreached::ZeroGradient) => {
                v.add(
                    4.0,
                    format!(
                        "the model ran its forward pass and the optimizer stepped {steps} times, but every gradient was exactly zero and no weight moved: the loss does not reach the model's output (a stop_gradient or detach between them), or something after the last layer zeroes every gradient"
                    ),
                );
                return;
            }
            None => {}
        }
        if episode.no_gradient {
            v.add(
                4.0,
                format!(
                    "it ran in the forward pass but its parameters received no gradient in {steps} steps, while other layers did: the graph is cut between it and the loss"
                ),
            );
            return;
        }
        v.add(
            3.5,
            format!(
                "it receives gradients (norm {}) but its weight norm stayed exactly {} for {} samples over {steps} steps, while other layers' weights moved",
                fmt_g(track.grad_last),
                fmt_g(track.weight_last.unwrap_or(f64::NAN)),
                track.weight_still + 1
            ),
        );
        match (stalled::held(run, layer), stalled::param_lr(run, layer)) {
            (Some(false), _) => v.add(1.5, "no optimizer holds its parameters"),
            (_, Some(0.0)) => {
                v.add(1.5, "the param group that holds its parameters has lr 0");
            }
            _ => {}
        }
        if let Some(collapse) = lr_collapse(run, episode.onset) {
            v.add(1.5, lr_collapse_words(&collapse));
        }
    }

    fn remedies(&self, c: &RemedyCase<'_>) -> Vec<Remedy> {
        if cleared(c.run).is_some() {
            return vec![Remedy::ZeroGradBeforeBackward];
        }
        if unmoved(c.run) {
            return vec![Remedy::ApplyTheUpdates];
        }
        if c.e.failure == Failure::LossPlateau && unregistered(c.run).is_some() {
            return vec![Remedy::RegisterLayers];
        }
        if let Some(collapse) = lr_collapse(c.run, c.e.onset) {
            return vec![collapse.remedy()];
        }
        // A failure that follows from a stalled layer has that layer's remedies.
        let e =
            c.by.filter(|b| b.failure == Failure::StalledLayer)
                .unwrap_or(c.e);
        let layer = e.root.map(|m| c.run.model.module_name(m).to_string());
        // (Every failure of a model the backward pass never reaches has this one fix.)
        if crate::analysis::stalled::cut_from_the_loss(c.run) {
            return vec![Remedy::LossFromTheOutput];
        }
        if e.failure == Failure::StalledLayer && e.no_gradient {
            return vec![
                Remedy::FindGraphCut {
                    layer: layer.clone(),
                },
                Remedy::FreezeOnPurpose { layer, cut: true },
            ];
        }
        vec![
            Remedy::PassToOptimizer {
                layer: layer.clone(),
            },
            Remedy::CheckParamGroupLr,
            Remedy::FreezeOnPurpose { layer, cut: false },
        ]
    }
}

/// The measured step size is exactly 0 on every weighted layer (the median of each layer's
/// first measurements) though every one of them got gradients (a median of its first norms of
/// at least 1e-6) and the rate was not too small to show: unknown or peaking at 1e-6 or more,
/// and under a plain gradient step (SGD) one that makes steps of at least 1e-5 of the weights
/// (`lr x gradient / weight`, median over the layers: float32 weights register that). Not when
/// the step found the gradients cleared ([`cleared`]). An update computed and never applied: a
/// JAX step that does not return `optax.apply_updates`' result, parameters re-initialized
/// inside the loop, a model whose weights are reloaded between steps.
pub(crate) fn unmoved(run: &Run) -> bool {
    let weighted: Vec<_> = weighted_tracks(run).collect();
    let measured = weighted.iter().any(|t| t.update_early.median().is_some());
    let still = weighted
        .iter()
        .filter_map(|t| t.update_early.median())
        .all(|r| r == 0.0);
    let fed = weighted
        .iter()
        .all(|t| t.early.median().is_some_and(|g| g >= 1e-6));
    let lr = run.lr_course.peak.map(|(_, lr)| lr);
    let shows = match lr {
        None => true,
        Some(lr) if lr < 1e-6 => false,
        Some(_) if run.model.adaptive_optimizer => true,
        Some(lr) => {
            let steps: Vec<f64> = weighted
                .iter()
                .filter_map(|t| Some(lr * t.early.median()? / t.weight_first.filter(|w| *w > 0.0)?))
                .collect();
            crate::track::median(&steps).is_some_and(|s| s >= 1e-5)
        }
    };
    measured && still && fed && shows && cleared(run).is_none()
}

/// The share of the steps whose optimizer step received no gradient, when it is most of them
/// (the collector read one parameter's gradient again at the step: see
/// [`crate::training_loop::LoopTrack::cleared_share`]).
pub(crate) fn cleared(run: &Run) -> Option<f64> {
    run.loop_track.cleared_share().filter(|s| *s >= 0.5)
}

/// Parameters the model's output depends on that are not the model's and that no optimizer
/// holds ([`crate::ModelSpec::unregistered_params`]), when they are at least a tenth of the
/// values the output depends on: they keep their initial values whatever the loss says.
pub(crate) struct Unregistered {
    shapes: Vec<Vec<u64>>,
    values: u64,
    share: f64,
}

/// The share of the values the output depends on from which unregistered parameters hold it
/// back: a stray scale or bias of a few values beside a network of thousands does not.
const UNREGISTERED_SHARE: f64 = 0.1;

pub(crate) fn unregistered(run: &Run) -> Option<Unregistered> {
    let shapes = run.model.spec.unregistered_params.clone()?;
    let values: u64 = shapes.iter().map(|s| s.iter().product::<u64>()).sum();
    let own: u64 = run.model.spec.params.iter().map(|p| p.numel).sum();
    let share = values as f64 / (values + own).max(1) as f64;
    (!shapes.is_empty() && share >= UNREGISTERED_SHARE).then_some(Unregistered {
        shapes,
        values,
        share,
    })
}

impl Unregistered {
    fn words(&self) -> String {
        let shown: Vec<String> = self
            .shapes
            .iter()
            .take(6)
            .map(|s| s.iter().map(u64::to_string).collect::<Vec<_>>().join("x"))
            .collect();
        let more = if self.shapes.len() > shown.len() {
            ", ..."
        } else {
            ""
        };
        format!(
            "the model's output depends on {} parameter tensor(s) ({} values, {:.0}% of those it depends on; shapes {}{more}) that are not among the model's parameters and that no optimizer holds: they keep their initial values, whatever the loss says",
            self.shapes.len(),
            thousands(self.values),
            100.0 * self.share,
            shown.join(", ")
        )
    }
}
