//! `sequence_start_readout`: the model reads a recurrent layer's output only at the start of
//! the sequence (`out[:, 0]` where `out[:, -1]` was meant, a habit from encoders whose first
//! position is a summary token). A layer that runs one way (`PyTorch`'s `nn.LSTM`, `nn.GRU`,
//! `nn.RNN` unless `bidirectional=True`) has seen only the steps up to the one read, so the
//! rest of each sequence never reaches the loss. Nothing fails loudly; the loss stays where
//! the first steps alone can take it, near chance when the target depends on the rest. Read
//! from the collector's [`crate::ModelSpec::sequence_readouts`].

use super::super::remedy::Remedy;
use super::super::vocab::{Cause, Failure};
use super::{Case, CauseRule, RemedyCase, Votes};
use crate::engine::Run;

pub(crate) struct SequenceStartReadout;

/// A one-way recurrent module read only in the first half of its sequence: its name, kind,
/// steps, and how many of them the latest step read has seen.
pub(crate) struct Found<'a> {
    pub module: &'a str,
    pub kind: &'a str,
    pub steps: u64,
    pub seen: u64,
    pub first_only: bool,
}

/// The first recurrent module (as the collector lists them) that runs one way and whose
/// output the model reads only at steps that have seen at most half of the sequence.
pub(crate) fn found(run: &Run) -> Option<Found<'_>> {
    let spec = &run.model.spec;
    spec.sequence_readouts.as_deref()?.iter().find_map(|r| {
        let seen = r.steps_read.iter().max()? + 1;
        if r.bidirectional || r.steps < 2 || 2 * seen > r.steps {
            return None;
        }
        let m = run.model.module_index(&r.module)?;
        Some(Found {
            module: &r.module,
            kind: &spec.modules[m].kind,
            steps: r.steps,
            seen,
            first_only: seen == 1,
        })
    })
}

impl CauseRule for SequenceStartReadout {
    fn cause(&self) -> Cause {
        Cause::SequenceStartReadout
    }

    fn phrase(&self) -> &'static str {
        "a recurrent layer read at the start of its sequence"
    }

    fn explains(&self, failure: Failure) -> bool {
        failure == Failure::LossPlateau
    }

    fn always_candidate(&self, _: Failure) -> bool {
        false
    }

    fn evidence(&self, c: &Case<'_>, v: &mut Votes) {
        let Some(f) = found(c.run) else {
            return;
        };
        let read = if f.first_only {
            format!(
                "only at its first step: a layer that runs one way has seen only the first of the {} input steps there",
                f.steps
            )
        } else {
            format!(
                "only up to step {}: a layer that runs one way has seen only the first {} of the {} input steps there",
                f.seen - 1,
                f.seen,
                f.steps
            )
        };
        v.proof(
            5.0,
            format!(
                "the model reads the output of {} ({}, {} steps) {read}, so the rest of each sequence never reaches the loss",
                super::super::text::show(f.module),
                f.kind,
                f.steps
            ),
        );
    }

    fn remedies(&self, c: &RemedyCase<'_>) -> Vec<Remedy> {
        found(c.run).map_or_else(Vec::new, |f| {
            vec![Remedy::ReadLastStep {
                module: f.module.to_string(),
            }]
        })
    }
}
