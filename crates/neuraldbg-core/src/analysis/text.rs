//! Human-facing text: the hypothesis sentence, the causal chain and the remedies.

use std::fmt::Write as _;

use crate::engine::Run;
use crate::event::{EventType, SemanticEvent, Subject};
use crate::health::State;

use super::episodes::Episode;
use super::vocab::Cause;

/// A number in 3 significant digits, scientific outside [1e-3, 1e4).
pub fn num(v: f64) -> String {
    if !v.is_finite() {
        return if v.is_nan() {
            "NaN".into()
        } else if v > 0.0 {
            "inf".into()
        } else {
            "-inf".into()
        };
    }
    let a = v.abs();
    if a == 0.0 {
        "0".into()
    } else if !(1e-3..1e4).contains(&a) {
        format!("{v:.2e}")
    } else if a >= 100.0 {
        format!("{v:.0}")
    } else if a >= 1.0 {
        format!("{v:.3}")
            .trim_end_matches('0')
            .trim_end_matches('.')
            .to_string()
    } else {
        format!("{v:.4}")
            .trim_end_matches('0')
            .trim_end_matches('.')
            .to_string()
    }
}

/// A module name as shown in sentences (the root module, whose name is empty, is the model's
/// output).
pub fn show(name: &str) -> String {
    if name.is_empty() {
        return "the model's output".into();
    }
    format!("`{name}`")
}

/// One line describing an event.
pub fn event_line(run: &Run, e: &SemanticEvent) -> String {
    let who = subject(run, e.subject);
    match e.event_type {
        EventType::NonFiniteOutput => {
            format!(
                "step {}: {who} produced the first non-finite output of the forward pass{}",
                e.step,
                on_rank(e)
            )
        }
        EventType::DataAnomaly => match e.to_state {
            State::Data(crate::health::DataHealth::NonFinite) => {
                format!(
                    "step {}: the input batch{} contained NaN/Inf",
                    e.step,
                    of_rank(e)
                )
            }
            State::Data(crate::health::DataHealth::OutOfDistribution) => format!(
                "step {}: the input batch{}'s scale was {}x off the usual",
                e.step,
                of_rank(e),
                num(e.value)
            ),
            _ => format!("step {}: input batches back to normal", e.step),
        },
        EventType::ReplicaDivergence => match e.to_state {
            State::Replica(crate::health::ReplicaHealth::Diverged) => format!(
                "step {}: the replicas of {who} differ by {}% across ranks{}",
                e.step,
                num(100.0 * e.value),
                e.rank
                    .map(|r| format!(" (rank {r} is the odd one out)"))
                    .unwrap_or_default()
            ),
            _ => format!("step {}: replicas identical again", e.step),
        },
        _ => {
            let kind = match e.event_type {
                EventType::GradientHealth => " gradient",
                EventType::ActivationHealth => " activation",
                _ => "",
            };
            let value = match e.to_state {
                State::Activation(
                    crate::health::ActivationHealth::Dead
                    | crate::health::ActivationHealth::Saturated,
                ) => format!(" ({:.0}% of units/outputs)", 100.0 * e.value),
                _ if e.value.is_finite() => format!(" ({})", num(e.value)),
                _ => String::new(),
            };
            format!(
                "step {}: {who}{kind} {} -> {}{value}",
                e.step, e.from_state, e.to_state
            )
        }
    }
}

/// `" on rank 3"` for an event that is one rank's own, else nothing.
fn on_rank(e: &SemanticEvent) -> String {
    e.rank.map(|r| format!(" on rank {r}")).unwrap_or_default()
}

fn of_rank(e: &SemanticEvent) -> String {
    e.rank.map(|r| format!(" of rank {r}")).unwrap_or_default()
}

fn subject(run: &Run, s: Subject) -> String {
    match s {
        Subject::Module(m) => show(run.model.module_name(m)),
        Subject::Input => "input".into(),
        Subject::Loss => "loss".into(),
    }
}

/// The hypothesis sentence: what failed, where (its failure's rule says), from when, for how
/// long, and why.
pub fn describe(
    run: &Run,
    episodes: &[Episode],
    k: usize,
    events: &[SemanticEvent],
    cause: Cause,
    reasons: &[String],
) -> String {
    let e = &episodes[k];
    let rule = super::failures::rule(e.failure);
    let sentence = super::failures::Sentence {
        run,
        episodes,
        k,
        events,
    };
    if let Some(s) = rule.sentence(&sentence) {
        return s;
    }
    let mut s = rule.opening(&sentence);
    s.push_str(&rule.place(&sentence));
    if let Some(r) = e.root_event.and_then(|i| events[i].rank) {
        let _ = write!(s, ", on rank {r}");
    }
    s.push_str(&lasted(e, ", and it persisted to the end"));
    let _ = write!(s, ". Likely cause: {}", cause.phrase());
    if !reasons.is_empty() {
        s.push_str(" — ");
        s.push_str(&reasons.join("; "));
    }
    s.push('.');
    s
}

/// How long episode `e` lasted: `to_end` when it lasted to the end of the run, ", for N
/// steps" when it lasted more than one, else nothing.
pub(crate) fn lasted(e: &Episode, to_end: &str) -> String {
    if e.to_end {
        to_end.to_string()
    } else if e.duration > 1 {
        format!(", for {} steps", e.duration)
    } else {
        String::new()
    }
}

#[cfg(test)]
mod show_tests {
    #[test]
    fn the_root_module_reads_as_the_model_s_output_in_sentences() {
        assert_eq!(super::show(""), "the model's output");
        assert_eq!(super::show("encoder.0"), "`encoder.0`");
    }
}
