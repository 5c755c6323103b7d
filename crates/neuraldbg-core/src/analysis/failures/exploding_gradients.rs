//! `exploding_gradients`: gradient norms above the exploding threshold. Located where the
//! failure begins along the backward pass, or where the forward signal blew up.

use std::fmt::Write as _;

use crate::engine::Run;
use crate::event::SemanticEvent;

use super::super::episodes::Episode;
use super::super::remedy::Remedy;
use super::super::vocab::{Cause, Failure};
use super::{
    FailureRule, Link, Sentence, after_bad_data, at_onset, breadth, module_of, more_of_the_same,
};

pub(crate) struct ExplodingGradients;

/// Steps within which an explosion at the start must end by itself to count as absorbed.
const ABSORBED_STEPS: u64 = 10;

/// Gradients large from the first step that came down by themselves within a few steps, with
/// nothing non-finite ever and a loss that then fell below a tenth of where it began: they were
/// large because the loss was (summed over the batch, targets on their own scale), and the
/// first updates absorbed it. Not a failure of training, whatever the threshold says.
pub(crate) fn absorbed(run: &Run, e: &Episode) -> bool {
    let l = &run.loss;
    e.onset <= run.first_step.unwrap_or(0) + 1
        && !e.to_end
        && e.duration <= ABSORBED_STEPS
        && run.nonfinite_steps == 0
        && l.initial.is_some_and(|i| {
            i > 0.0 && i.is_finite() && l.last_smoothed.is_finite() && l.last_smoothed < 0.1 * i
        })
}

impl FailureRule for ExplodingGradients {
    fn failure(&self) -> Failure {
        Failure::ExplodingGradients
    }

    fn precedence(&self) -> u8 {
        2
    }

    fn locate(
        &self,
        run: &Run,
        events: &[SemanticEvent],
        cluster: &[usize],
        onset: u64,
    ) -> (Option<usize>, Option<usize>) {
        backward_root(run, events, cluster, onset)
    }

    /// Gradients exploding from the first step while the forward signal itself blew up inside
    /// one module: every later layer's weight gradient is large because its input is, so the
    /// explosion begins where the forward growth does, not at the end of the network.
    fn settle(&self, run: &Run, e: &mut Episode) {
        if let Some(g) = super::super::causes::forward_growth(run) {
            if e.onset <= g.step {
                e.root = Some(g.module);
                if !e.affected.contains(&g.module) {
                    e.affected.push(g.module);
                    e.affected.sort_unstable();
                }
            }
        }
    }

    fn probability(&self, run: &Run, e: &Episode) -> f64 {
        let d = e.duration as f64;
        let end = if e.to_end { 1.0 } else { 0.0 };
        let x = 1.2 * e.margin.min(3.0) + d.min(20.0) / 5.0 + 2.0 * breadth(run, e) + 0.5 * end
            - if !e.to_end && e.duration <= 2 {
                0.8
            } else {
                0.0
            };
        let p = 1.0 - (-x.max(0.0)).exp();
        if absorbed(run, e) { 0.3 * p } else { p }
    }

    fn follows_from(&self, a: &Episode, e: &Episode, l: &Link<'_>) -> bool {
        after_bad_data(a, e, l) || more_of_the_same(a, e)
    }

    fn place(&self, s: &Sentence<'_>) -> String {
        along_the_backward_pass(s)
    }

    /// An explosion not due to the learning rate: clip while the cause is fixed.
    fn remedies(&self, cause: Cause, mut of_cause: Vec<Remedy>) -> Vec<Remedy> {
        if cause != Cause::LearningRateTooHigh {
            of_cause.push(Remedy::ClipWhileFixing);
        }
        of_cause
    }
}

/// Root-cause search of a gradient failure: among the layers that failed at the onset step,
/// take the longest run of adjacent layers (the structural coupling of layer N and N-1) and,
/// within it, the layer latest in forward order: everything before it in forward order fails
/// because the gradient reaching it already had.
pub(crate) fn backward_root(
    run: &Run,
    events: &[SemanticEvent],
    cluster: &[usize],
    onset: u64,
) -> (Option<usize>, Option<usize>) {
    let at_onset = at_onset(events, cluster, onset);
    let model = &run.model;
    let mut layers: Vec<(usize, usize)> = at_onset
        .iter()
        .filter_map(|&i| module_of(&events[i]).and_then(|m| model.module_layer[m].map(|l| (l, i))))
        .collect();
    layers.sort_unstable();
    // Runs of consecutive layer indices.
    let mut best: Option<(usize, usize)> = None; // (len, index into layers of run end)
    let mut start = 0;
    for k in 0..layers.len() {
        let end_of_run = k + 1 == layers.len() || layers[k + 1].0 != layers[k].0 + 1;
        if end_of_run {
            let len = k + 1 - start;
            if best.is_none_or(|(bl, _)| len >= bl) {
                best = Some((len, k));
            }
            start = k + 1;
        }
    }
    best.map_or((at_onset.first().copied(), None), |(_, k)| {
        let (l, i) = layers[k];
        (Some(i), Some(model.layers[l].module))
    })
}

/// Where a gradient failure is in the sentence: where it began along the backward pass and how
/// far it reached, or the layers behind the dead layer that blocks them.
pub(crate) fn along_the_backward_pass(s: &Sentence<'_>) -> String {
    let e = s.episode();
    let Some(name) = s.root_name() else {
        return String::new();
    };
    let mut out = String::new();
    if let Some(j) = e
        .explained_by
        .filter(|&j| s.episodes[j].failure == Failure::DeadNeurons)
    {
        let _ = write!(
            out,
            " in {} layer(s) behind the dead layer {name} (dead from step {})",
            e.affected.len(),
            s.episodes[j].onset
        );
    } else {
        let _ = write!(out, ", beginning in {name}");
        let extra = e.affected.len().saturating_sub(1);
        if extra > 0 {
            let _ = write!(out, " and reaching {extra} more layer(s)");
        }
    }
    out
}
