//! `batch_axis_mismatch`: a layer that reads its input's first dimension as the sequence
//! (`PyTorch`'s `nn.LSTM`, `nn.GRU`, `nn.RNN`, `nn.MultiheadAttention` and the transformer
//! layers, all built with `batch_first=False` unless told otherwise) was given batch-first
//! data, `(batch, sequence, features)`. It then runs along the batch, one sequence whose steps
//! are the samples (an LSTM: each sample's output depends on the samples before it; attention:
//! on every sample of the batch), and the loss cannot reach its optimum. Nothing fails loudly
//! (the shapes line up); the loss stays near its chance level. Read from the facts the collector sends: the shape
//! each such module was first given ([`crate::ModelSpec::sequence_first_inputs`]) against the
//! model's output ([`crate::LossSpec::output_shape`]).

use super::super::remedy::Remedy;
use super::super::vocab::{Cause, Failure};
use super::{Case, CauseRule, RemedyCase, Votes};
use crate::engine::Run;

pub(crate) struct BatchAxisMismatch;

/// A module reading the batch as the sequence: its name, kind, and its input's first two
/// dimensions (the batch it read as the sequence, the sequence it read as the batch).
pub(crate) struct Found<'a> {
    pub module: &'a str,
    pub kind: &'a str,
    pub batch: u64,
    pub sequence: u64,
}

/// The first module (in forward order, as the collector lists them) whose input's first
/// dimension is the batch: the model's output has as many rows, the second dimension differs
/// (two equal sizes say nothing), and the output does not keep the input's second dimension
/// (a sequence-first tagger's output `(sequence, batch, classes)` does).
pub(crate) fn found(run: &Run) -> Option<Found<'_>> {
    let spec = &run.model.spec;
    let out = spec.loss.as_ref()?.output_shape.as_deref()?;
    let rows = *out.first()?;
    spec.sequence_first_inputs.as_deref()?.iter().find_map(|s| {
        let (&a, &b) = (s.shape.first()?, s.shape.get(1)?);
        if s.shape.len() < 3 || a != rows || a == b || out.get(1) == Some(&b) {
            return None;
        }
        let m = run.model.module_index(&s.module)?;
        Some(Found {
            module: &s.module,
            kind: &spec.modules[m].kind,
            batch: a,
            sequence: b,
        })
    })
}

impl CauseRule for BatchAxisMismatch {
    fn cause(&self) -> Cause {
        Cause::BatchAxisMismatch
    }

    fn phrase(&self) -> &'static str {
        "a layer that reads the batch as the sequence"
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
        v.proof(
            5.0,
            format!(
                "{} ({}) reads its input's first dimension as the sequence (batch_first=False) and was given the batch there: {} samples by {} steps, read as {} sequences of {} steps: it runs along the batch, mixing the samples, instead of along each sample's sequence",
                super::super::text::show(f.module),
                f.kind,
                f.batch,
                f.sequence,
                f.sequence,
                f.batch
            ),
        );
    }

    fn remedies(&self, c: &RemedyCase<'_>) -> Vec<Remedy> {
        found(c.run).map_or_else(Vec::new, |f| {
            vec![Remedy::BatchFirst {
                module: f.module.to_string(),
            }]
        })
    }
}
