//! Debounced transition detection: the state machine behind every semantic event.
//!
//! A series has a confirmed ("stable") state. A new raw classification becomes a *candidate*;
//! the candidate is confirmed when it has held for `persistence` consecutive observations, when
//! it is at least `immediate_decades` past its threshold, or at once when it is non-finite.
//! Combined with the hysteresis band of [`crate::health`], a value sitting on a threshold cannot
//! produce a stream of flip-flop events: to flip back it must both cross the widened band and
//! hold there. The transition is dated at the candidate's first observation (its onset), so
//! debouncing delays the *report* but never shifts the *step*.

use crate::config::Config;
use crate::health::Classified;

/// A confirmed change of state.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Transition<S> {
    pub from: S,
    pub to: S,
    /// Step of the first observation in the new state.
    pub onset: u64,
    /// Step at which it was confirmed.
    pub confirmed: u64,
    /// Consecutive observations in the new state at confirmation.
    pub persistence: u32,
    /// Value observed at onset.
    pub value: f64,
    /// Largest margin past the threshold seen while the candidate was pending.
    pub margin: f64,
    pub threshold: f64,
}

#[derive(Clone, Copy, Debug, PartialEq)]
struct Candidate<S> {
    state: S,
    onset: u64,
    count: u32,
    value: f64,
    margin: f64,
    threshold: f64,
}

/// The debounced state of one series.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Debounce<S> {
    stable: S,
    candidate: Option<Candidate<S>>,
}

impl<S: Copy + PartialEq> Debounce<S> {
    /// A series that starts in `initial` (the healthy state: a layer is presumed healthy until
    /// observed otherwise).
    pub fn new(initial: S) -> Self {
        Self {
            stable: initial,
            candidate: None,
        }
    }

    /// The confirmed state.
    pub fn state(&self) -> S {
        self.stable
    }

    /// Whether a new state has been observed but not yet confirmed.
    pub fn pending(&self) -> bool {
        self.candidate.is_some()
    }

    /// Feeds one classified observation. `urgent` confirms a new state at once (non-finite
    /// values are never debounced).
    pub fn update(
        &mut self,
        step: u64,
        value: f64,
        c: Classified<S>,
        urgent: bool,
        config: &Config,
    ) -> Option<Transition<S>> {
        if c.state == self.stable {
            self.candidate = None;
            return None;
        }
        let cand = match &mut self.candidate {
            Some(cand) if cand.state == c.state => {
                cand.count += 1;
                if c.margin > cand.margin {
                    cand.margin = c.margin;
                }
                cand
            }
            slot => slot.insert(Candidate {
                state: c.state,
                onset: step,
                count: 1,
                value,
                margin: c.margin,
                threshold: c.threshold,
            }),
        };
        let confirmed =
            urgent || cand.count >= config.persistence || cand.margin >= config.immediate_decades;
        if !confirmed {
            return None;
        }
        let t = Transition {
            from: self.stable,
            to: cand.state,
            onset: cand.onset,
            confirmed: step,
            persistence: cand.count,
            value: cand.value,
            margin: cand.margin,
            threshold: cand.threshold,
        };
        self.stable = cand.state;
        self.candidate = None;
        Some(t)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::health::{GradientHealth, classify_gradient};
    use proptest::prelude::*;

    fn feed(values: &[f64]) -> Vec<Transition<GradientHealth>> {
        let config = Config::default();
        let mut d = Debounce::new(GradientHealth::Healthy);
        let mut out = Vec::new();
        for (step, v) in values.iter().enumerate() {
            let c = classify_gradient(*v, d.state(), &config);
            let urgent = c.state == GradientHealth::NonFinite;
            if let Some(t) = d.update(step as u64, *v, c, urgent, &config) {
                out.push(t);
            }
        }
        out
    }

    #[test]
    fn persistent_change_is_dated_at_its_onset() {
        let t = feed(&[0.1, 0.1, 5e-7, 5e-7, 5e-7, 5e-7]);
        assert_eq!(t.len(), 1);
        assert_eq!(t[0].to, GradientHealth::Vanishing);
        assert_eq!(t[0].onset, 2);
        assert_eq!(t[0].confirmed, 4);
    }

    #[test]
    fn one_step_blip_is_ignored_but_a_far_one_is_not() {
        assert!(feed(&[0.1, 5e-7, 0.1, 0.1]).is_empty());
        let t = feed(&[0.1, 1e-9, 0.1, 0.1, 0.1]);
        assert_eq!(t.len(), 2, "{t:?}");
        assert_eq!(t[0].onset, 1);
    }

    #[test]
    fn nan_is_confirmed_immediately() {
        let t = feed(&[0.1, f64::NAN]);
        assert_eq!(t.len(), 1);
        assert_eq!(t[0].to, GradientHealth::NonFinite);
        assert_eq!(t[0].onset, 1);
    }

    proptest! {
        /// A value oscillating around the vanishing threshold by less than the hysteresis band
        /// produces at most one event, however long it goes on.
        #[test]
        fn no_flip_flop_at_threshold(jitter in proptest::collection::vec(0.6f64..1.9, 10..400)) {
            let values: Vec<f64> = jitter.iter().map(|j| j * 1e-6).collect();
            let t = feed(&values);
            prop_assert!(t.len() <= 2, "{} events for {:?}", t.len(), &values[..10]);
        }

        /// Every confirmed transition changes state, is dated no later than its confirmation,
        /// and consecutive transitions chain (to of one is from of the next).
        #[test]
        fn transitions_chain(values in proptest::collection::vec(prop_oneof![
            1e-9f64..1e-6, 1e-6f64..1.0, 1.0f64..1e3, 1e3f64..1e6, Just(f64::NAN)], 1..200)) {
            let t = feed(&values);
            let mut state = GradientHealth::Healthy;
            let mut last_onset = 0;
            for tr in &t {
                prop_assert_eq!(tr.from, state);
                prop_assert_ne!(tr.from, tr.to);
                prop_assert!(tr.onset <= tr.confirmed);
                prop_assert!(tr.onset >= last_onset);
                last_onset = tr.confirmed;
                state = tr.to;
            }
        }
    }
}
