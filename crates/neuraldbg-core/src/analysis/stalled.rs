//! Stalled layers: layers that do not learn while the rest of the model does. Two kinds, both
//! read from what the engine already tracks, with no event of their own:
//!
//! - **no gradient**: a layer whose module runs in the forward pass but whose parameters never
//!   received a gradient in the whole run, while other layers did: the graph is cut between it
//!   and the loss (`.detach()`, `torch.no_grad()`, `.data`). Or no layer at all did, while the
//!   optimizer stepped and no layer's weights moved: the loss is cut from the model's output
//!   (a loss rebuilt from `.item()`, `.detach()`, numpy) — see [`cut_from_the_loss`].
//! - **frozen**: a layer that receives real gradients but whose weight norm stayed exactly the
//!   same over the last samples (at least [`STILL_SAMPLES`] samples and [`STILL_STEPS`] steps),
//!   while another layer's weights moved in that time, and where an update of the size the
//!   learning rate implies would have changed the norm: no optimizer applies its updates.
//!
//! A layer of each kind is one episode (the layers of one kind together): for a cut graph the
//! root is the latest stalled layer in forward order (next to the cut), for frozen layers the
//! first one.

use crate::config::Config;
use crate::engine::{Global, Run};

use super::episodes::Episode;
use super::vocab::Failure;

/// Weight samples in a row that must be unchanged.
pub(crate) const STILL_SAMPLES: u32 = 3;
/// Steps the weights must stay unchanged (and steps a run must last to judge "no gradient").
pub(crate) const STILL_STEPS: u64 = 20;
/// Relative change of the weight norm below which an update may vanish in float32 rounding.
const VISIBLE_UPDATE: f64 = 1e-5;

pub(crate) fn episodes(run: &Run, config: &Config) -> Vec<Episode> {
    let (Some(first), Some(last)) = (run.first_step, run.last_step) else {
        return Vec::new();
    };
    let model = &run.model;
    let span = last - first + 1;
    let mut cut: Vec<usize> = Vec::new();
    let mut frozen: Vec<(usize, u64)> = Vec::new();
    let whole = cut_from_the_loss(run);
    let any_grad = whole || run.layers.iter().any(|t| t.observed > 0);
    for (l, t) in run.layers.iter().enumerate() {
        let m = model.layers[l].module;
        if t.observed == 0 || whole {
            // (A layer frozen on purpose gets no gradient: not a cut graph.)
            if any_grad
                && span >= STILL_STEPS
                && model.spec.modules[m].executed
                && !model.layer_frozen(l)
            {
                cut.push(l);
            }
            continue;
        }
        if t.weight_still < STILL_SAMPLES || last.saturating_sub(t.still_since) < STILL_STEPS {
            continue;
        }
        // Real gradients, and an update the optimizer would make visible.
        let g = t.grad_last;
        if !(g.is_finite() && g > config.threshold_vanishing) {
            continue;
        }
        let Some(w) = t.weight_last.filter(|w| *w > 0.0 && w.is_finite()) else {
            continue;
        };
        let visible = match (held(run, l), param_lr(run, l).or(run.lr_first)) {
            // No optimizer holds it, or its group has lr 0: that is the mistake itself.
            (Some(false), _) | (_, Some(0.0) | None) => true,
            (_, Some(lr)) => {
                let step = if model.adaptive_optimizer {
                    lr * (model.layers[l].numel as f64).sqrt()
                } else {
                    lr * g
                };
                step / w >= VISIBLE_UPDATE
            }
        };
        // Another layer moved while this one stood still.
        let others_moved = run
            .layers
            .iter()
            .enumerate()
            .any(|(k, o)| k != l && o.weight_moved.is_some_and(|s| s > t.still_since));
        if visible && others_moved {
            frozen.push((l, t.still_since));
        }
    }
    let mut out = Vec::new();
    if let Some(&root) = cut.last() {
        out.push(episode(run, &cut, root, first, true));
    }
    if let Some(&(root, since)) = frozen.first() {
        let layers: Vec<usize> = frozen.iter().map(|f| f.0).collect();
        // The weights stood still from the sample after their last move (or from the start).
        let onset = if run.layers[root].weight_moved.is_some() {
            since + 1
        } else {
            first
        };
        out.push(episode(run, &layers, root, onset, false));
    }
    out
}

/// How the backward pass failed to reach any layer (see [`unreached`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Unreached {
    /// No parameter got a gradient at all (`PyTorch` leaves `.grad` unset): the loss is cut
    /// from the model's output.
    NoGradient,
    /// Every gradient was exactly zero (`jax.grad` through a `stop_gradient`, or something
    /// after the last layer whose slope is zero on every sample).
    ZeroGradient,
}

/// No layer received a gradient in a run of at least [`STILL_STEPS`] optimizer steps, or only
/// exact zeros, while the model ran its forward passes, no layer's weights moved, the loss
/// (where known) was not exactly zero (a run that starts converged has zero gradients too), and
/// no output that does not fit the loss explains the zeros (a one-unit softmax, a rectified
/// output cut to 0): the backward pass never reached the model. (A model trained by other means
/// than `.grad`, `torch.func` say, moves its weights.)
pub(crate) fn unreached(run: &Run) -> Option<Unreached> {
    let (first, last) = (run.first_step?, run.last_step?);
    let model = &run.model;
    let trainable =
        |l: usize| model.spec.modules[model.layers[l].module].executed && !model.layer_frozen(l);
    let how = if run.layers.iter().all(|t| t.observed == 0) {
        Unreached::NoGradient
    } else if run
        .grads
        .max_between(run.global_series(Global::TotalGradNorm), first, last)
        .is_some_and(|m| m <= 0.0)
        && super::causes::output_mismatch(run).is_none()
    {
        Unreached::ZeroGradient
    } else {
        return None;
    };
    let converged = run.loss.initial.is_some() && run.loss.best <= 0.0;
    (last - first + 1 >= STILL_STEPS
        && (0..run.layers.len()).any(trainable)
        && !converged
        && run.layers.iter().all(|t| t.weight_moved.is_none()))
    .then_some(how)
}

/// See [`unreached`].
pub(crate) fn cut_from_the_loss(run: &Run) -> bool {
    unreached(run).is_some()
}

/// The learning rate of the largest group holding layer `l`'s parameters, when known (None
/// also when no optimizer holds them).
pub(crate) fn param_lr(run: &Run, l: usize) -> Option<f64> {
    let lrs = run.model.spec.param_lr.as_ref()?;
    run.model.layers[l]
        .params
        .iter()
        .filter_map(|&p| lrs[p])
        .reduce(f64::max)
}

/// Whether some optimizer holds any of layer `l`'s parameters (None when not known).
pub(crate) fn held(run: &Run, l: usize) -> Option<bool> {
    let lrs = run.model.spec.param_lr.as_ref()?;
    Some(run.model.layers[l].params.iter().any(|&p| lrs[p].is_some()))
}

fn episode(run: &Run, layers: &[usize], root: usize, onset: u64, no_gradient: bool) -> Episode {
    let last = run.last_step.unwrap_or(onset);
    let module = |l: usize| run.model.layers[l].module;
    let mut affected: Vec<usize> = layers.iter().map(|&l| module(l)).collect();
    affected.sort_unstable();
    Episode {
        failure: Failure::StalledLayer,
        onset,
        events: Vec::new(),
        root: Some(module(root)),
        root_event: None,
        affected,
        margin: 0.0,
        duration: last.saturating_sub(onset) + 1,
        to_end: true,
        p_failure: 0.0,
        explained_by: None,
        fraction: f64::NAN,
        exact_zero: false,
        no_gradient,
    }
}
