//! `poor_initialization`: initial weights scaled far from what keeps the signal's scale, so the
//! failure is there before any update.

use crate::engine::Run;
use crate::track::median;

use super::super::failures::dead_share_at_start;
use super::super::remedy::Remedy;
use super::super::vocab::{Cause, Failure};
use super::evidence::{DIED_AFTER_UPDATES, Evidence, TRAINING_UPDATE};
use super::{Case, CauseRule, Facts, RemedyCase, Votes, fmt_g};

pub(crate) struct PoorInitialization;

impl CauseRule for PoorInitialization {
    fn cause(&self) -> Cause {
        Cause::PoorInitialization
    }

    fn phrase(&self) -> &'static str {
        "poor weight initialization"
    }

    fn explains(&self, failure: Failure) -> bool {
        !matches!(
            failure,
            Failure::DataAnomaly | Failure::StalledLayer | Failure::LossScaleCollapse
        )
    }

    /// High gradient norms are a warning with many causes: the weights' scale competes for
    /// them only when it is off.
    fn always_candidate(&self, failure: Failure) -> bool {
        failure != Failure::SaturatedGradients
    }

    fn evidence(&self, c: &Case<'_>, v: &mut Votes) {
        let (ev, f) = (c.ev, c.f);
        if let Some(s) = identical_units(c.run) {
            v.add(4.0, s.sentence(c.run));
        }
        match c.e.failure {
            Failure::ExplodingGradients => {
                if !f.at_start {
                    v.against(1.0);
                    return;
                }
                v.add(
                    2.5,
                    "gradients were already exploding at the first step, before any update",
                );
                compounding(c, v, false);
                // Ordinary weights that do not amplify the signal, yet a huge loss or huge
                // inputs: the data is off scale (unnormalized inputs or regression targets).
                let data_off_scale =
                    ev.loss_initial.is_some_and(|l| l > 1e3) || ev.huge_inputs().is_some();
                if ev.gain_not_off_scale() && ev.network_gain() < 1.0 && data_off_scale {
                    v.against(1.0);
                }
                large_weights(v, ev, 1.5);
                per_layer(v, ev, false);
                forward_blowup(c, v);
            }
            Failure::VanishingGradients => {
                if !f.at_start {
                    v.against(1.0);
                    return;
                }
                v.add(
                    2.0,
                    "gradients vanished from the first step, before any update",
                );
                small_weights(v, ev, 2.0);
                per_layer(v, ev, true);
                compounding(c, v, true);
            }
            Failure::NonFinite => {
                if f.at_start {
                    v.add(
                        1.5,
                        "values were non-finite from the first step, before any update",
                    );
                    if ev.gain_too_large() || ev.gain_too_small() {
                        v.add(
                            1.0,
                            "the initial weight scale is far from variance-preserving",
                        );
                    }
                }
            }
            Failure::DeadNeurons => {
                if f.at_start {
                    // Only some of them when most died after updates.
                    match dead_share_at_start(c.run, c.e)
                        .filter(|first| c.e.fraction - first >= DIED_AFTER_UPDATES)
                    {
                        Some(first) => v.add(
                            1.0,
                            format!(
                                "{:.0}% of the units were dead at the first step, before any update",
                                100.0 * first
                            ),
                        ),
                        None => v.add(
                            2.0,
                            "the units were dead at the first step, before any update",
                        ),
                    }
                    small_weights(v, ev, 2.0);
                } else if f.healthy_start {
                    sgd_steps_of_large_weights(v, ev);
                }
            }
            Failure::SaturatedActivations => {
                if f.at_start {
                    v.add(
                        1.0,
                        "the activations were saturated at the first step, before any update",
                    );
                    large_weights(v, ev, 2.0);
                }
            }
            Failure::LossDivergence => {
                if f.at_start {
                    v.add(1.0, "the loss rose from the first steps");
                }
            }
            Failure::LossPlateau => {
                if f.at_start && ev.gain_too_small() {
                    // Weights far too small shrink the signal layer after layer: the output
                    // starts out constant, and the loss at what a constant guess scores.
                    small_weights(v, ev, 2.0);
                    compounding(c, v, true);
                } else if f.at_start && ev.gain_too_large() {
                    v.add(
                        1.0,
                        "the initial weight scale is far from variance-preserving",
                    );
                } else if !f.at_start {
                    // Weights that start far too small learn slowly long after the first
                    // steps (and make every step large beside them).
                    small_weights(v, ev, 2.0);
                    // Weights far too large, and a loss that never got below what a constant
                    // guess scores: flat late, but failing from the first step.
                    if super::super::failures::not_learning(c.run).is_some() {
                        large_weights(v, ev, 2.0);
                    }
                }
                confidently_wrong_start(c, v);
            }
            Failure::SaturatedGradients => {
                // Norms high from the first step, under weights that amplify the signal.
                if f.at_start && ev.gain_too_large() {
                    v.add(1.0, super::evidence::HIGH_FROM_THE_START);
                    large_weights(v, ev, 2.0);
                    compounding(c, v, false);
                }
            }
            Failure::DataAnomaly
            | Failure::LossScaleCollapse
            | Failure::StalledLayer
            | Failure::ReplicaDivergence => {}
        }
    }

    fn run_facts(&self, run: &Run) -> Facts {
        let mut out = Facts::new();
        out.insert("act_attenuation".into(), act_attenuation(run).into());
        out
    }

    fn remedies(&self, c: &RemedyCase<'_>) -> Vec<Remedy> {
        if let Some(s) = identical_units(c.run) {
            let layer = Some(
                c.run
                    .model
                    .module_name(c.run.model.layers[s.layer].module)
                    .to_string(),
            );
            return vec![Remedy::RandomInit { layer }, Remedy::InitForActivation];
        }
        let root_kind = c.e.root.map(|m| c.run.model.spec.modules[m].kind.as_str());
        if root_kind.is_some_and(is_recurrent) {
            return vec![
                Remedy::OrthogonalRecurrentInit { layer: c.layer() },
                Remedy::BoundedRecurrence,
                Remedy::ClipGradients,
            ];
        }
        vec![
            Remedy::InitForActivation,
            Remedy::CheckCustomInit { layer: c.layer() },
        ]
    }
}

/// Layers whose output units all had the same weights when the model was registered
/// (`ParamSpec::identical_units`): the first in forward order, and how many there are.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) struct IdenticalUnits {
    pub layer: usize,
    pub units: u64,
    pub layers: usize,
}

impl IdenticalUnits {
    fn sentence(&self, run: &Run) -> String {
        let name =
            super::super::text::show(run.model.module_name(run.model.layers[self.layer].module));
        let more = match self.layers {
            1 => String::new(),
            2 => " (and so do those of one more layer)".into(),
            n => format!(" (and so do those of {} more layers)", n - 1),
        };
        format!(
            "all {} units of {name} have the same weights{more}, as a constant initialization leaves them: they compute the same output, get the same gradient and stay identical, so {name} trains like a single unit",
            self.units
        )
    }
}

pub(crate) fn identical_units(run: &Run) -> Option<IdenticalUnits> {
    let spec = &run.model.spec;
    let mut found = run
        .model
        .layers
        .iter()
        .enumerate()
        .filter_map(|(l, layer)| {
            layer.params.iter().find_map(|&p| {
                let ps = &spec.params[p];
                let fan_in = ps.fan_in.filter(|f| *f > 0)?;
                ps.identical_units.then_some((l, ps.numel / fan_in))
            })
        });
    let (layer, units) = found.next()?;
    Some(IdenticalUnits {
        layer,
        units,
        layers: 1 + found.count(),
    })
}

/// A classifier whose loss starts far above its chance level, on inputs of an ordinary scale:
/// before any update, the initial weights already make confident wrong predictions (an
/// initialized classifier should start near ln C). A regression's, at twice its targets'
/// variance or more, under weights far above a variance-preserving scale, likewise.
fn confidently_wrong_start(c: &Case<'_>, v: &mut Votes) {
    let Some(chance) = super::super::failures::chance_level(c.run) else {
        return;
    };
    if chance.regression {
        // Targets off centre make a first loss far above their variance too: only under
        // weights far above scale is it theirs.
        if let Some(l) = c
            .run
            .loss
            .first_value()
            .filter(|l| *l >= 2.0 * chance.level && c.ev.gain_too_large())
        {
            v.add(
                2.0,
                format!(
                    "the loss starts at {}, {:.1}x the variance of its targets ({}), before any update: the initial weights make large wrong predictions",
                    fmt_g(l),
                    l / chance.level,
                    fmt_g(chance.level)
                ),
            );
        }
        return;
    }
    let ordinary_inputs =
        c.ev.input_scale_first
            .is_some_and(|x| x <= super::evidence::HUGE_INPUTS);
    // The first loss alone is before any update (the initial level is the median of three).
    if let Some(l) = c
        .run
        .loss
        .first_value()
        .filter(|l| *l >= 2.0 * chance.uniform)
    {
        if ordinary_inputs {
            v.add(
                2.0,
                format!(
                    "the loss starts at {}, {:.1}x its chance level (ln {} = {}), before any update: the initial weights make confident wrong predictions",
                    fmt_g(l),
                    l / chance.uniform,
                    chance.classes,
                    fmt_g(chance.uniform)
                ),
            );
        }
    }
}

/// The forward signal blew up inside one layer at the start: its weights amplify what passes
/// through them (a recurrent layer applies them once per time step, compounding).
fn forward_blowup(c: &Case<'_>, v: &mut Votes) {
    let Some(g) = c.ev.forward else { return };
    let run = c.run;
    let name = super::super::text::show(run.model.module_name(g.module));
    let kind = &run.model.spec.modules[g.module].kind;
    let gain = run.model.module_layer[g.module].and_then(|l| run.layers[l].gain_first);
    if is_recurrent(kind) {
        v.add(
            2.5,
            format!(
                "{name} is recurrent: it applies its weights{} once per time step, and its output reaches {} from inputs of at most {}: the state is amplified through time",
                gain.map(|g| format!(" (scale {}x variance-preserving)", fmt_g(g)))
                    .unwrap_or_default(),
                fmt_g(g.to),
                fmt_g(g.from)
            ),
        );
    } else {
        v.add(
            2.0,
            format!(
                "the forward signal grows {}x inside {name} (its output reaches {} from at most {} before it): the layers after it get large gradients because their inputs are large",
                fmt_g(10f64.powf(g.jump)),
                fmt_g(g.to),
                fmt_g(g.from)
            ),
        );
    }
}

/// Median `log10(mean slope)` of the bounded activations at the start: decades per layer the
/// activations themselves take off the gradient (0 without bounded activations).
fn act_attenuation(run: &Run) -> f64 {
    let attenuations: Vec<f64> = run
        .acts
        .iter()
        .map(|a| a.first_slope)
        .filter(|s| s.is_finite() && *s > 0.0)
        .map(f64::log10)
        .collect();
    median(&attenuations).unwrap_or(0.0)
}

/// Recurrent layers, by class name.
pub(crate) fn is_recurrent(kind: &str) -> bool {
    matches!(
        kind,
        "RNN" | "LSTM" | "GRU" | "RNNCell" | "LSTMCell" | "GRUCell"
    )
}

/// Initial weights far below a variance-preserving scale.
fn small_weights(v: &mut Votes, ev: &Evidence, weight: f64) {
    if let Some(g) = ev.gain_median.filter(|_| ev.gain_too_small()) {
        let said = if g == 0.0 {
            "initial weights are all zero: no signal passes forward, and no gradient back past the last layer".to_string()
        } else {
            format!(
                "initial weights are only {}x a variance-preserving scale",
                fmt_g(g)
            )
        };
        v.add(weight, said);
    }
}

/// Under a plain gradient step (SGD), weights far above a variance-preserving scale make the
/// gradients, and so the steps, large: units alive at first that died after such steps died of
/// the initialization (`learning_rate_too_high` leaves that step size to it).
fn sgd_steps_of_large_weights(v: &mut Votes, ev: &Evidence) {
    let Some(r) = ev
        .update_ratio
        .filter(|r| ev.update_measured && *r >= 10.0 * TRAINING_UPDATE)
    else {
        return;
    };
    let Some(g) = ev.sgd_steps_of_large_weights() else {
        return;
    };
    v.add(
        3.5,
        format!(
            "the units were alive at first and died after updates: under a plain gradient step, initial weights {}x a variance-preserving scale make the gradients large, and each step moves the weights by ~{} of their size (measured)",
            fmt_g(g),
            fmt_g(r)
        ),
    );
}

/// Initial weights far above a variance-preserving scale.
fn large_weights(v: &mut Votes, ev: &Evidence, weight: f64) {
    if let Some((g, _)) = ev.gain_max.filter(|_| ev.gain_too_large()) {
        v.add(
            weight,
            format!(
                "initial weights are {}x a variance-preserving scale",
                fmt_g(g)
            ),
        );
    }
}

/// Gradients that change geometrically along the layers by a decade or more per layer: the
/// weights are far off scale (a milder change compounded over many layers is the depth's).
fn per_layer(v: &mut Votes, ev: &Evidence, shrinking: bool) {
    let Some(p) = ev.geometric_profile(shrinking) else {
        return;
    };
    let per_layer = p.slope.abs();
    if per_layer >= 1.0 {
        v.add(
            1.0,
            format!(
                "each layer changes the gradient {:.0}x: the weights are far off scale",
                10f64.powf(per_layer)
            ),
        );
    }
}

/// Weights mis-scaled for their activation, compounded over the layers, explain a failure at
/// the start in a network of moderate depth (in a very deep one, even a mild per-layer error is
/// the depth's doing) when the weights, not the activations, carry most of the per-layer change.
fn compounding(c: &Case<'_>, v: &mut Votes, shrinking: bool) {
    let ev = c.ev;
    let Some(w) = ev.init_error else { return };
    let right_way = if shrinking { w < 0.0 } else { w > 0.0 };
    let compounded = w * ev.depth as f64;
    if right_way
        && w.abs() >= 0.12
        && w.abs() >= act_attenuation(c.run).abs()
        && compounded.abs() >= 1.5
        && ev.depth < 16
    {
        v.add(
            2.0,
            format!(
                "each layer's weights scale the signal {}x away from what its activation keeps stable, {:.1} decades over {} layers",
                fmt_g(10f64.powf(w)),
                compounded.abs(),
                ev.depth
            ),
        );
    }
}
