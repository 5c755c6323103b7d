//! `network_depth`: a mild change of the gradient per layer, compounded over many layers.

use super::super::remedy::Remedy;
use super::super::vocab::{Cause, Failure};
use super::{Case, CauseRule, RemedyCase, Votes};

pub(crate) struct NetworkDepth;

impl CauseRule for NetworkDepth {
    fn cause(&self) -> Cause {
        Cause::NetworkDepth
    }

    fn phrase(&self) -> &'static str {
        "the depth of the network"
    }

    fn explains(&self, failure: Failure) -> bool {
        matches!(
            failure,
            Failure::ExplodingGradients | Failure::VanishingGradients | Failure::LossPlateau
        )
    }

    fn evidence(&self, c: &Case<'_>, v: &mut Votes) {
        let ev = c.ev;
        match c.e.failure {
            Failure::ExplodingGradients | Failure::VanishingGradients if c.f.at_start => {
                let shrinking = c.e.failure == Failure::VanishingGradients;
                let Some(p) = ev.geometric_profile(shrinking) else {
                    return;
                };
                if ev.depth < super::evidence::DEEP_STACK {
                    return;
                }
                let way = if shrinking { "shrink" } else { "grow" };
                let per_layer = p.slope.abs();
                v.add(
                    1.5,
                    format!(
                        "gradient norms {way} geometrically, {:.1} decades over {} layers",
                        p.span.abs(),
                        ev.depth
                    ),
                );
                if ev.gain_normal() {
                    v.add(0.5, "the initial weight scale is ordinary");
                }
                if ev.depth >= 16 && per_layer < 0.5 {
                    v.add(
                        1.0,
                        format!(
                            "each layer changes the gradient by only {per_layer:.2} decades: it is the number of layers that compounds it"
                        ),
                    );
                }
            }
            Failure::LossPlateau => {
                if let Some((Cause::NetworkDepth, why)) = c.stalled_by() {
                    v.add(super::STALLED, why);
                }
            }
            _ => {}
        }
    }

    fn remedies(&self, _: &RemedyCase<'_>) -> Vec<Remedy> {
        vec![
            Remedy::ResidualConnections,
            Remedy::NormBetweenBlocks,
            Remedy::ReduceDepth,
        ]
    }
}
