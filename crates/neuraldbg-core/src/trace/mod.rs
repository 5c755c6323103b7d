//! Traces: a run's engine inputs on disk, written while training runs and replayed post-mortem.
//!
//! A trace records exactly what the engine was given — the [`Config`], the [`ModelSpec`] of
//! [`crate::Engine::register_model`] and one [`Observation`] per step — so replaying it
//! ([`Replay`]) rebuilds the engine state bit for bit and yields exactly the live run's events
//! and hypotheses. Events are not stored: replay is their source of truth.
//!
//! The format (docs/trace-format.md) is a 16-byte preamble (magic, version, checksum) followed
//! by framed records, each with a CRC32C over its header and one over its payload. Each record
//! reaches the operating system in one `write` as soon as it is produced, so a process killed
//! at any moment leaves every complete record readable; the reader stops at the first damaged
//! record and says where ([`Damage`]), and never returns anything after it.
//!
//! ```
//! use neuraldbg_core::trace::{Replay, TraceReader, TraceWriter, WriterOptions};
//! use neuraldbg_core::{Config, Engine, ModelSpec, Observation};
//!
//! let dir = std::env::temp_dir().join(format!("ndbg-doc-{}", std::process::id()));
//! let path = dir.join("run.ndbg");
//! let mut spec = ModelSpec::default();
//! let fc = spec.module("fc", "Linear");
//! spec.param(fc, "fc.weight", &[2, 2]);
//! let mut live = Engine::new(Config::default()).unwrap();
//! live.register_model(spec.clone()).unwrap();
//! let mut writer = TraceWriter::create(&path, serde_json::Map::new(), WriterOptions::default()).unwrap();
//! writer.write_header(live.config(), &spec).unwrap();
//! for step in 0..5 {
//!     let obs = Observation { step, grad_norms: vec![1e-9], ..Default::default() };
//!     live.observe(&obs.view()).unwrap();
//!     writer.write_step(&obs.view()).unwrap();
//! }
//! writer.close().unwrap();
//!
//! let replay = Replay::read(TraceReader::open(&path).unwrap(), |_| {}).unwrap();
//! assert!(replay.damage.is_none() && replay.closed);
//! assert_eq!(replay.engine.events(), live.events());
//! # std::fs::remove_dir_all(dir).unwrap();
//! ```

mod format;
mod reader;
mod replay;
mod writer;

use std::path::PathBuf;

use thiserror::Error;

#[cfg(doc)]
use crate::{Config, ModelSpec, Observation};

pub use format::{FRAME_OVERHEAD, MAGIC, MAX_PAYLOAD, PREAMBLE_LEN, VERSION};
pub use reader::{Record, TraceHeader, TraceReader};
pub use replay::Replay;
pub use writer::{SyncPolicy, TraceWriter, WriterOptions};

/// Steps the run went through without them being observed (monitoring stopped: a peer rank
/// left, an internal error), recorded so that readers say so instead of taking the last
/// recorded step for the end of the run.
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct Unobserved {
    /// The first step not observed.
    pub first: u64,
    /// The last one, when known (None: to the end of the run).
    pub last: Option<u64>,
    /// Why, in a sentence.
    pub reason: String,
}

/// When a step was written: seconds since the Unix epoch. Readers place the other steps in
/// time between two of these.
#[derive(Clone, Copy, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct Clock {
    pub step: u64,
    pub time: f64,
}

/// The wall-clock time of `step` from a trace's clocks (in step order): interpolated between
/// the two around it, the nearest one outside them, None without any.
pub fn wall_time(clocks: &[Clock], step: u64) -> Option<f64> {
    let after = clocks.partition_point(|c| c.step < step);
    match (after.checked_sub(1).map(|i| clocks[i]), clocks.get(after)) {
        (_, Some(b)) if b.step == step => Some(b.time),
        (Some(a), Some(b)) => {
            #[allow(clippy::cast_precision_loss)]
            let f = (step - a.step) as f64 / (b.step - a.step) as f64;
            Some(a.time + f * (b.time - a.time))
        }
        (Some(a), None) => Some(a.time),
        (None, Some(b)) => Some(b.time),
        (None, None) => None,
    }
}

impl std::fmt::Display for Unobserved {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.last {
            Some(last) if last > self.first => {
                write!(f, "steps {} to {last} were not observed", self.first)?;
            }
            Some(_) => write!(f, "step {} was not observed", self.first)?,
            None => write!(f, "steps from {} on were not observed", self.first)?,
        }
        write!(f, ": {}", self.reason)
    }
}

/// A trace cannot be written, or cannot be read at all.
///
/// Damage after a readable header is not an error: the reader recovers everything before it and
/// reports it as [`Damage`].
#[derive(Debug, Error)]
pub enum TraceError {
    #[error("cannot {op} {}: {source}", path.display())]
    Io {
        op: &'static str,
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{origin} is not a NeuralDBG trace (it does not start with the trace signature)")]
    NotATrace { origin: String },
    #[error(
        "{origin} was written by a newer NeuralDBG (trace format version {found}; this build reads versions up to {supported}): upgrade neuraldbg to read it"
    )]
    NewerVersion {
        origin: String,
        found: u16,
        supported: u16,
    },
    #[error("{origin}: {damage}; nothing before it can be recovered")]
    Unrecoverable { origin: String, damage: Damage },
    #[error(
        "{origin} holds no model header: the run ended before its first observed step (no optimizer step was taken on the watched model), so there is nothing to replay"
    )]
    NoModel { origin: String },
    #[error("{origin}: the header does not describe a valid run: {message}")]
    BadHeader { origin: String, message: String },
    #[error("cannot read {origin}: {source}")]
    Read {
        origin: String,
        #[source]
        source: std::io::Error,
    },
    #[error("cannot write the trace {}: {message}", path.display())]
    Usage { path: PathBuf, message: String },
}

/// Where a trace stops being readable, and why. Everything before `offset` was recovered.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Damage {
    /// Byte offset of the first record that could not be used.
    pub offset: u64,
    /// Index of that record (the header is record 0).
    pub record: u64,
    pub kind: DamageKind,
}

/// What is wrong with a damaged record.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum DamageKind {
    /// The file ends inside the record: a write cut short by a crash, or a truncated copy.
    Truncated { needed: u64, available: u64 },
    /// The record's header (length and kind) fails its checksum.
    HeaderChecksum,
    /// The record's payload fails its checksum.
    PayloadChecksum,
    /// The checksums hold but the content makes no sense (a writer bug, or a checksum collision).
    Malformed(String),
    /// The record (a step, a param-lr amendment) is well-formed but the engine refused it on
    /// replay.
    Rejected(String),
    /// The preamble is cut short or fails its checksum.
    Preamble,
    /// The operating system could not read the bytes (an I/O error, not the file's content).
    Unreadable(String),
}

impl std::fmt::Display for Damage {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "record {} at byte {}: ", self.record, self.offset)?;
        match &self.kind {
            DamageKind::Truncated { needed, available } => write!(
                f,
                "the file ends {available} bytes into this {needed}-byte record (a write cut short by a crash, or a truncated copy)"
            ),
            DamageKind::HeaderChecksum => f.write_str("record header checksum mismatch"),
            DamageKind::PayloadChecksum => f.write_str("record payload checksum mismatch"),
            DamageKind::Malformed(why) => write!(f, "malformed record: {why}"),
            DamageKind::Rejected(why) => write!(f, "the engine refused this record: {why}"),
            DamageKind::Preamble => f.write_str("the trace preamble is cut short or corrupted"),
            DamageKind::Unreadable(why) => write!(f, "cannot read: {why}"),
        }
    }
}

#[cfg(test)]
mod clock_tests {
    use super::{Clock, wall_time};

    #[test]
    fn wall_time_interpolates_between_clocks_and_holds_outside() {
        let clocks = [
            Clock {
                step: 10,
                time: 100.0,
            },
            Clock {
                step: 20,
                time: 110.0,
            },
        ];
        assert_eq!(wall_time(&[], 5), None);
        assert_eq!(wall_time(&clocks, 0), Some(100.0));
        assert_eq!(wall_time(&clocks, 10), Some(100.0));
        assert_eq!(wall_time(&clocks, 15), Some(105.0));
        assert_eq!(wall_time(&clocks, 20), Some(110.0));
        assert_eq!(wall_time(&clocks, 99), Some(110.0));
    }
}
