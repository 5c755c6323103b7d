//! `over_regularization`: a weight penalty that outweighs the fit to the data, so that the
//! optimizer mostly shrinks the weights. Written into the loss (`loss + l2 * sum(w.pow(2)
//! .sum() ...)`), the loss falls as the weights' squared norm falls, on a line whose slope is
//! the penalty's coefficient, the penalty being a large part of the loss at the start. As the
//! optimizer's `weight_decay` added to the gradient (`SGD`, `Adam`), the decay's pull on the
//! weights is many times the loss's own gradient from the start while they shrink. Either way
//! the weights, and with them the signal and its gradients, shrink towards zero.

use super::super::failures::chance_level;
use super::super::remedy::Remedy;
use super::super::text::show;
use super::super::vocab::{Cause, Failure};
use super::{Case, CauseRule, Facts, RemedyCase, Votes, fmt_g};
use crate::engine::Run;

pub(crate) struct OverRegularization;

/// Pairs of (weights' squared norm, loss) a judgment needs: the weights are measured on
/// sampled steps.
const MIN_PAIRS: u64 = 5;
/// How well the loss must follow the squared norm.
const MIN_R2: f64 = 0.9;
/// The penalty's share of the loss at the first step above which it outweighs the data (a
/// usual penalty, 1e-4 per weight, is a few percent of it), and at the last step above which
/// it still holds the loss up.
const MIN_SHARE_FIRST: f64 = 0.25;
const MIN_SHARE: f64 = 0.5;

/// A weight penalty in the loss that outweighed the fit to the data from the start, as
/// measured.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Penalty {
    /// Parameters the loss penalizes directly.
    pub params: u64,
    /// The loss per unit of the weights' squared norm (the penalty's coefficient).
    pub slope: f64,
    pub r2: f64,
    /// The penalty's share of the loss at the first and the last measurement (by the line).
    pub share_first: f64,
    pub share_last: f64,
    /// The weights' last squared norm over their first.
    pub kept: f64,
}

/// The loss holds a penalty on the weights (a fact from the framework), moves with their
/// squared norm, falling as it falls, and the penalty was a large part of it at the first
/// step.
pub(crate) fn penalty_dominated(run: &Run) -> Option<Penalty> {
    let params = run
        .model
        .spec
        .loss
        .as_ref()?
        .penalized_params
        .filter(|&n| n > 0)?;
    let fit = &run.loss_on_weights;
    let line = fit.line(MIN_PAIRS)?;
    let ((s0, l0), (s1, l1)) = (fit.first?, fit.last?);
    let shrinking = s1 < 0.9 * s0 && l1 < l0;
    if !(shrinking && line.slope > 0.0 && line.r2 >= MIN_R2 && l0 > 0.0 && l1 > 0.0) {
        return None;
    }
    let share_first = line.slope * s0 / l0;
    (share_first >= MIN_SHARE_FIRST).then(|| Penalty {
        params,
        slope: line.slope,
        r2: line.r2,
        share_first: share_first.min(1.0),
        share_last: (line.slope * s1 / l1).clamp(0.0, 1.0),
        kept: s1 / s0,
    })
}

/// The share of units above which dropout leaves too little of the network to fit anything
/// (0.1-0.5 is usual; 0.8 and 0.9 are keep probabilities given where a drop rate is asked).
const HEAVY_DROPOUT: f64 = 0.8;

/// Dropout modules that zero [`HEAVY_DROPOUT`] of their units or more, at each training step.
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct HeavyDropout {
    /// The largest share dropped, and the modules that drop that much or more.
    pub p: f64,
    pub modules: Vec<String>,
}

/// See [`HeavyDropout`]: dropout modules of the forward pass (by class name, any framework's)
/// whose `p` is at least [`HEAVY_DROPOUT`].
pub(crate) fn heavy_dropout(run: &Run) -> Option<HeavyDropout> {
    let mut p = 0.0_f64;
    let mut modules = Vec::new();
    for m in &run.model.spec.modules {
        let rate = m.attrs.iter().find(|(k, _)| k == "p").map(|(_, v)| *v);
        if let Some(rate) = rate.filter(|r| *r >= HEAVY_DROPOUT && m.executed) {
            if m.kind.contains("Dropout") {
                p = p.max(rate);
                modules.push(m.name.clone());
            }
        }
    }
    (!modules.is_empty()).then_some(HeavyDropout { p, modules })
}

/// The penalty `p` still holds most of the loss at the end, or it shrank the model to a
/// constant guess (the loss ends at its chance level, or at ln C): the loss cannot reach the data's
/// optimum (a plateau from the first step, see `loss_bounded_by_mistake`).
fn holds_the_loss(run: &Run, p: &Penalty) -> bool {
    p.share_last >= MIN_SHARE
        || chance_level(run).is_some_and(|c| {
            let end = run.loss.last_smoothed;
            [c.level, c.uniform]
                .iter()
                .any(|level| (0.9 * level..=1.1 * level).contains(&end))
        })
}

/// [`penalty_dominated`], when [`holds_the_loss`].
pub(crate) fn loss_held_by_penalty(run: &Run) -> Option<Penalty> {
    penalty_dominated(run).filter(|p| holds_the_loss(run, p))
}

/// A share of the loss in words.
fn share(x: f64) -> String {
    if x >= 0.995 {
        "nearly all".into()
    } else {
        format!("{:.0}%", 100.0 * x)
    }
}

impl CauseRule for OverRegularization {
    fn cause(&self) -> Cause {
        Cause::OverRegularization
    }

    fn phrase(&self) -> &'static str {
        "regularization that outweighs the fit to the data"
    }

    /// Shrinking weights hold the loss up, and shrink the signal, its gradients and the
    /// rectified units' inputs with them.
    fn explains(&self, failure: Failure) -> bool {
        matches!(
            failure,
            Failure::LossPlateau | Failure::VanishingGradients | Failure::DeadNeurons
        )
    }

    fn always_candidate(&self, _: Failure) -> bool {
        false
    }

    fn evidence(&self, c: &Case<'_>, v: &mut Votes) {
        // Dropout that zeroes most units trains a different sliver of the network at every
        // step, too little of it to fit the data: a loss that stays at its chance level. (A
        // training loss held up by that much dropout can still hide a model that does well
        // without it, in eval(): above its chance level, the dropout only leans on it.)
        if let Some(d) = heavy_dropout(c.run).filter(|_| c.e.failure == Failure::LossPlateau) {
            let shown: Vec<String> = d.modules.iter().take(3).map(|m| show(m)).collect();
            let at_chance = super::super::failures::not_learning(c.run).is_some();
            v.add(
                if at_chance { 3.5 } else { 1.5 },
                format!(
                    "dropout zeroes {:.0}% of the units at every training step ({}{}): each step trains a sliver of the network, too little of it to fit the data",
                    100.0 * d.p,
                    shown.join(", "),
                    if d.modules.len() > 3 { ", ..." } else { "" }
                ),
            );
        }
        if let Some(d) = c.ev.decay_outweighs() {
            v.add(
                4.0,
                format!(
                    "the optimizer's weight_decay of {wd} pulls each weight towards 0 with {wd} x its norm, {:.1}x the loss's own gradient at the first steps, and the weights shrank to {:.0}% of their first norm: they shrink faster than the data can grow them",
                    d.pull,
                    100.0 * d.kept,
                    wd = fmt_g(d.weight_decay),
                ),
            );
        }
        if let Some(p) = c.ev.penalty {
            let tensors = if p.params == 1 {
                "1 parameter tensor".to_string()
            } else {
                format!("{} parameter tensors", p.params)
            };
            let held = holds_the_loss(c.run, &p);
            let most = p.share_last >= MIN_SHARE;
            let reason = format!(
                "the loss adds a penalty on {tensors} and falls in step with their squared norm (loss = {} x the weights' sum of squares{}, r² {:.3}): the penalty is {} of the loss at the first step{}, so the optimizer shrinks the weights instead of fitting the data",
                fmt_g(p.slope),
                if most { "" } else { " + the data's part" },
                p.r2,
                share(p.share_first),
                if most {
                    format!(" and {} at the last", share(p.share_last))
                } else {
                    format!(
                        ", and it shrank the weights' sum of squares to {:.0}% of its first value",
                        100.0 * p.kept
                    )
                },
            );
            if held {
                v.proof(5.0, reason);
            } else {
                v.add(5.0, reason);
            }
        }
    }

    fn remedies(&self, c: &RemedyCase<'_>) -> Vec<Remedy> {
        let dropout = heavy_dropout(c.run).filter(|_| c.e.failure == Failure::LossPlateau);
        let decay = super::evidence::decay_pull(c.run).is_some();
        if let Some(d) = dropout.filter(|_| !decay && penalty_dominated(c.run).is_none()) {
            return vec![Remedy::LowerDropout { p: d.p }];
        }
        if penalty_dominated(c.run).is_some() {
            return vec![Remedy::LowerWeightPenalty, Remedy::FitWithoutPenalty];
        }
        vec![Remedy::LowerWeightDecay, Remedy::FitWithoutPenalty]
    }

    fn run_facts(&self, run: &Run) -> Facts {
        let mut out = Facts::new();
        let share = penalty_dominated(run).map_or(0.0, |p| p.share_first);
        out.insert("penalty_share".into(), share.into());
        out
    }
}
