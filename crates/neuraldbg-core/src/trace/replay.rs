//! Replaying a trace into a fresh engine.

use std::io::Read;

use super::reader::{Record, TraceHeader, TraceReader};
use super::{Damage, TraceError};
use crate::engine::Engine;

/// Records between two progress callbacks.
const PROGRESS_EVERY: u64 = 1024;

/// An engine rebuilt from a trace, and what the reading found.
#[derive(Debug)]
pub struct Replay {
    /// The engine after every recovered step: query it like the live one (events, analysis,
    /// history).
    pub engine: Engine,
    pub header: TraceHeader,
    /// Name of the input (the path).
    pub origin: String,
    /// Steps replayed.
    pub steps: u64,
    /// The first step replayed.
    pub first_step: Option<u64>,
    /// Bytes of the step records replayed, framing included: what each step costs on disk.
    pub step_bytes: u64,
    /// Bytes of the trace that were used (up to the end of the last good record).
    pub bytes: u64,
    /// Size of the file, when read from one.
    pub file_len: Option<u64>,
    /// Where reading stopped early, if it did; nothing after it was used.
    pub damage: Option<Damage>,
    /// Whether the writer closed the trace (false: the run was killed or crashed, or the trace
    /// is damaged).
    pub closed: bool,
    /// Steps the run took that the writer recorded as not observed, and why.
    pub unobserved: Vec<super::Unobserved>,
    /// When steps were written (about one a second; none in traces from before they were
    /// recorded).
    pub clocks: Vec<super::Clock>,
}

impl Replay {
    /// Replays every readable step of `reader`. `progress` is called now and then with the bytes
    /// read so far.
    ///
    /// Fails only when nothing can be replayed: no readable header, or a header the engine
    /// refuses. Damage after the header ends the replay early and is reported in
    /// [`Replay::damage`].
    pub fn read<R: Read>(
        mut reader: TraceReader<R>,
        mut progress: impl FnMut(u64),
    ) -> Result<Self, TraceError> {
        let origin = reader.origin().to_string();
        let header = match reader.next_record() {
            Some(Record::Header(h)) => *h,
            // The reader only ever returns a header first.
            Some(_) | None => {
                return Err(match reader.damage() {
                    Some(d) => TraceError::Unrecoverable {
                        origin,
                        damage: d.clone(),
                    },
                    None => TraceError::NoModel { origin },
                });
            }
        };
        let bad = |e: crate::EngineError| TraceError::BadHeader {
            origin: origin.clone(),
            message: e.to_string(),
        };
        let mut engine = Engine::new(header.config.clone()).map_err(bad)?;
        engine.register_model(header.model.clone()).map_err(bad)?;
        let mut steps = 0u64;
        let mut first_step = None;
        let mut step_bytes = 0;
        let mut unobserved = Vec::new();
        let mut clocks = Vec::new();
        let mut start = reader.offset();
        while let Some(record) = reader.next_record() {
            let size = reader.offset() - start;
            start = reader.offset();
            if let Record::Unobserved(gap) = record {
                unobserved.push(gap);
            } else if let Record::Clock(clock) = record {
                clocks.push(clock);
            } else if let Record::ParamLr(lrs) = record {
                if let Err(e) = engine.amend_param_lr(lrs.as_deref()) {
                    reader.reject_last(e.to_string());
                    break;
                }
            } else if let Record::FirstBatch(facts) = record {
                if let Err(e) = engine.amend_first_batch(&facts) {
                    reader.reject_last(e.to_string());
                    break;
                }
            } else if let Record::Step(obs) = record {
                if let Err(e) = engine.observe(&obs.view()) {
                    reader.reject_last(e.to_string());
                    break;
                }
                first_step.get_or_insert(obs.step);
                step_bytes += size;
                steps += 1;
                if steps % PROGRESS_EVERY == 0 {
                    progress(reader.offset());
                }
            }
        }
        progress(reader.offset());
        let damage = reader.damage().cloned();
        let bytes = damage.as_ref().map_or(reader.offset(), |d| d.offset);
        Ok(Self {
            engine,
            header,
            origin,
            steps,
            first_step,
            step_bytes,
            bytes,
            file_len: reader.len(),
            damage,
            closed: reader.closed(),
            unobserved,
            clocks,
        })
    }
}
