//! `non_finite`: NaN or Inf in gradients, activations, outputs or the loss. Located where the
//! first non-finite value was born: a module's forward output, the loss computation, or the
//! backward pass.

use crate::engine::Run;
use crate::event::{EventType, SemanticEvent};
use crate::health::{LossHealth, State};

use super::super::episodes::Episode;
use super::super::vocab::Failure;
use super::{
    FailureRule, Link, Sentence, after_bad_data, at_onset, before_or_with, module_of, near,
};

pub(crate) struct NonFinite;

impl FailureRule for NonFinite {
    fn failure(&self) -> Failure {
        Failure::NonFinite
    }

    fn precedence(&self) -> u8 {
        5
    }

    /// A forward origin found on the onset step is the most precise location; then the loss
    /// (every module output was checked finite, yet the loss was not: no layer is to blame);
    /// then the backward pass (the latest layer in forward order whose gradient is
    /// non-finite); then any module.
    fn locate(
        &self,
        run: &Run,
        events: &[SemanticEvent],
        cluster: &[usize],
        onset: u64,
    ) -> (Option<usize>, Option<usize>) {
        let at_onset = at_onset(events, cluster, onset);
        let origin = at_onset
            .iter()
            .copied()
            .find(|&i| events[i].event_type == EventType::NonFiniteOutput);
        if let Some(i) = origin {
            return (Some(i), module_of(&events[i]));
        }
        if run.finite_forward.contains(&onset) {
            let loss = at_onset
                .iter()
                .copied()
                .find(|&i| events[i].to_state == State::Loss(LossHealth::NonFinite));
            if let Some(i) = loss {
                return (Some(i), None);
            }
        }
        let grad = at_onset
            .iter()
            .copied()
            .filter(|&i| events[i].event_type == EventType::GradientHealth)
            .max_by_key(|&i| module_of(&events[i]));
        if let Some(i) = grad {
            return (Some(i), module_of(&events[i]));
        }
        let act = at_onset
            .iter()
            .copied()
            .filter(|&i| events[i].event_type == EventType::ActivationHealth)
            .min_by_key(|&i| module_of(&events[i]));
        if let Some(i) = act {
            return (Some(i), module_of(&events[i]));
        }
        (at_onset.first().copied(), None)
    }

    fn probability(&self, _: &Run, e: &Episode) -> f64 {
        if e.to_end || e.duration >= 2 {
            0.99
        } else {
            0.7
        }
    }

    fn follows_from(&self, a: &Episode, e: &Episode, l: &Link<'_>) -> bool {
        after_bad_data(a, e, l)
            || match a.failure {
                Failure::ExplodingGradients => before_or_with(a, e) && near(a.onset, e.onset, 200),
                Failure::LossDivergence => a.onset < e.onset,
                _ => false,
            }
    }

    fn place(&self, s: &Sentence<'_>) -> String {
        let Some(name) = s.root_name() else {
            return if s.root_event_type() == Some(EventType::LossHealth) {
                ", in the loss computation (the model's outputs were finite)".into()
            } else {
                String::new()
            };
        };
        match s.root_event_type() {
            Some(EventType::NonFiniteOutput) => format!(", first in the forward output of {name}"),
            Some(EventType::GradientHealth) => format!(", entering the backward pass at {name}"),
            _ => format!(" in {name}"),
        }
    }
}
