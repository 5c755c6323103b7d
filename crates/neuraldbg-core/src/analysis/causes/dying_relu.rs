//! `dying_relu`: ReLU-family units that output zero for every sample, so nothing flows back
//! through them.

use super::super::remedy::Remedy;
use super::super::vocab::{Cause, Failure};
use super::evidence::{activation_tolerance, earliest};
use super::{Case, CauseRule, Facts, RemedyCase, Votes};

pub(crate) struct DyingRelu;

/// A (nearly) completely dead layer around the onset of episode `c.k`, if any.
fn dead_layer(c: &Case<'_>) -> Option<usize> {
    let reach = c.e.onset + activation_tolerance(c.ev);
    earliest(c.episodes, c.k, Failure::DeadNeurons, &|o| {
        o.onset <= reach && o.fraction >= 0.9
    })
}

impl CauseRule for DyingRelu {
    fn cause(&self) -> Cause {
        Cause::DyingRelu
    }

    fn phrase(&self) -> &'static str {
        "dying ReLU units"
    }

    fn explains(&self, failure: Failure) -> bool {
        matches!(
            failure,
            Failure::VanishingGradients | Failure::DeadNeurons | Failure::LossPlateau
        )
    }

    fn evidence(&self, c: &Case<'_>, v: &mut Votes) {
        let e = c.e;
        match e.failure {
            Failure::VanishingGradients => {
                if let Some(j) = dead_layer(c) {
                    v.add(
                        4.0,
                        format!(
                            "{:.0}% of the units of a ReLU layer downstream output zero for the whole batch",
                            100.0 * c.episodes[j].fraction
                        ),
                    );
                }
                // Exactly-zero gradients look like a blocked ReLU path only if the model can
                // have one: ReLU-family modules, or no activation modules at all (functional
                // ReLUs).
                let model = &c.run.model;
                let may_have_relu = model.activations.is_empty()
                    || model.activations.iter().any(|a| a.traits.can_die);
                if e.exact_zero && may_have_relu {
                    v.add(
                        1.0,
                        "the gradients are exactly zero, as behind a blocked (dead) path",
                    );
                }
            }
            Failure::DeadNeurons => {
                v.add(
                    3.0,
                    format!(
                        "{:.0}% of the layer's units output zero for every sample of the batch",
                        100.0 * e.fraction
                    ),
                );
            }
            Failure::LossPlateau => {
                if let Some((Cause::DyingRelu, why)) = c.stalled_by() {
                    v.add(super::STALLED, why);
                }
            }
            _ => {}
        }
    }

    fn episode_facts(&self, c: &Case<'_>) -> Facts {
        let mut out = Facts::new();
        out.insert("dead".into(), dead_layer(c).into());
        out
    }

    fn remedies(&self, c: &RemedyCase<'_>) -> Vec<Remedy> {
        vec![
            Remedy::ReplaceRelu { layer: c.layer() },
            Remedy::LowerLr { lr: c.lr() },
            Remedy::CheckBiasInit,
            Remedy::BatchNormBeforeRelu,
        ]
    }
}
