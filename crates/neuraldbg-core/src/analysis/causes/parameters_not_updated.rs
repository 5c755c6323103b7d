//! `parameters_not_updated`: parameters the optimizer never changes: in no optimizer, in a
//! param group with lr 0, or cut from the graph so they never receive a gradient.

use super::super::remedy::Remedy;
use super::super::stalled;
use super::super::vocab::{Cause, Failure};
use super::{Case, CauseRule, RemedyCase, Votes, fmt_g};

pub(crate) struct ParametersNotUpdated;

impl CauseRule for ParametersNotUpdated {
    fn cause(&self) -> Cause {
        Cause::ParametersNotUpdated
    }

    fn phrase(&self) -> &'static str {
        "parameters the optimizer never updates"
    }

    fn explains(&self, failure: Failure) -> bool {
        // A plateau inherits it from the stalled layer that explains it.
        matches!(failure, Failure::StalledLayer | Failure::LossPlateau)
    }

    fn always_candidate(&self, _: Failure) -> bool {
        false
    }

    fn evidence(&self, c: &Case<'_>, v: &mut Votes) {
        let episode = c.e;
        if episode.failure != Failure::StalledLayer {
            return;
        }
        let run = c.run;
        let Some(layer) = episode.root.and_then(|m| run.model.module_layer[m]) else {
            return;
        };
        let track = &run.layers[layer];
        let steps = episode.duration;
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
    }

    fn remedies(&self, c: &RemedyCase<'_>) -> Vec<Remedy> {
        let layer = c.layer();
        if c.e.failure == Failure::StalledLayer && c.e.no_gradient {
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
