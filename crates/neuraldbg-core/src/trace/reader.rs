//! Reading a trace record by record, recovering everything before the first damage.

use std::fs::File;
use std::io::{BufReader, ErrorKind, Read, Seek, SeekFrom};
use std::path::Path;

use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

use super::format::{self, BadHeader, FRAME_HEADER_LEN, Kind, OPTIONAL_KINDS, Preamble};
use super::{Damage, DamageKind, TraceError};
use crate::config::Config;
use crate::model::ModelSpec;
use crate::observation::Observation;

/// The first record of a trace: what replay needs to rebuild the engine.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct TraceHeader {
    /// Format version of the writer.
    pub format: u16,
    pub config: Config,
    pub model: ModelSpec,
    /// Free-form facts about the run (producer, framework versions, start time...).
    #[serde(default)]
    pub meta: Map<String, Value>,
}

/// One record of a trace.
#[derive(Clone, Debug, PartialEq)]
pub enum Record {
    Header(Box<TraceHeader>),
    Step(Observation),
    /// The writer closed the trace after this many steps.
    End {
        steps: u64,
    },
    /// Steps the run took without observing them.
    Unobserved(super::Unobserved),
    /// When a step was written.
    Clock(super::Clock),
    /// The per-parameter lrs of an optimizer first seen after the header was written (None:
    /// its lrs cannot be read), for [`crate::Engine::amend_param_lr`].
    ParamLr(Option<Vec<Option<f64>>>),
    /// The first training batch's facts, read after the header, for
    /// [`crate::Engine::amend_first_batch`].
    FirstBatch(Box<crate::FirstBatch>),
}

/// Reads records in order. Iteration ends at the end of the file or at the first damaged
/// record; [`Self::damage`] then says which.
#[derive(Debug)]
pub struct TraceReader<R> {
    inner: R,
    origin: String,
    version: u16,
    len: Option<u64>,
    /// Offset of the next record.
    offset: u64,
    /// Index of the next record.
    record: u64,
    /// Offset and index of the last record returned.
    last: (u64, u64),
    header_seen: bool,
    last_step: Option<u64>,
    steps: u64,
    ended: bool,
    done: bool,
    damage: Option<Damage>,
    buf: Vec<u8>,
}

impl TraceReader<BufReader<File>> {
    /// Opens a trace file and checks its preamble.
    pub fn open(path: impl AsRef<Path>) -> Result<Self, TraceError> {
        let path = path.as_ref();
        let io = |source| TraceError::Io {
            op: "open",
            path: path.to_path_buf(),
            source,
        };
        let file = File::open(path).map_err(io)?;
        let meta = file.metadata().map_err(io)?;
        if meta.is_dir() {
            return Err(io(std::io::Error::new(
                ErrorKind::IsADirectory,
                "it is a directory, not a trace file",
            )));
        }
        let mut reader = Self::new(
            BufReader::with_capacity(1 << 18, file),
            &path.display().to_string(),
        )?;
        reader.len = Some(meta.len());
        Ok(reader)
    }
}

impl<R: Read + Seek> TraceReader<R> {
    /// Follows a trace that is still being written (`neuraldbg watch`): when iteration stopped
    /// at the end of the input, or at a record cut short at the end (the writer has not
    /// finished writing it yet), rewinds to the end of the last complete record so that the
    /// next [`Self::next_record`] reads what was appended since. Returns false when the stop is
    /// final: the trace was closed, or a record is damaged (checksum, malformed, rejected).
    pub fn resume(&mut self) -> Result<bool, TraceError> {
        if self.ended {
            return Ok(false);
        }
        match &self.damage {
            None
            | Some(Damage {
                kind: DamageKind::Truncated { .. },
                ..
            }) => {}
            Some(_) => return Ok(false),
        }
        if !self.done {
            return Ok(true);
        }
        self.inner
            .seek(SeekFrom::Start(self.offset))
            .map_err(|source| TraceError::Read {
                origin: self.origin.clone(),
                source,
            })?;
        self.damage = None;
        self.done = false;
        Ok(true)
    }
}

/// Reads until `buf` is full or the input ends; returns the bytes read.
fn fill(r: &mut impl Read, buf: &mut [u8]) -> std::io::Result<usize> {
    let mut n = 0;
    while n < buf.len() {
        match r.read(&mut buf[n..]) {
            Ok(0) => break,
            Ok(k) => n += k,
            Err(e) if e.kind() == ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(n)
}

impl<R: Read> TraceReader<R> {
    /// Reads the preamble from `inner`; `origin` names the input in messages.
    pub fn new(mut inner: R, origin: &str) -> Result<Self, TraceError> {
        let origin = origin.to_string();
        let mut pre = [0u8; format::PREAMBLE_LEN];
        let n = fill(&mut inner, &mut pre).map_err(|source| TraceError::Read {
            origin: origin.clone(),
            source,
        })?;
        let version = match format::check_preamble(&pre[..n]) {
            Preamble::Foreign => return Err(TraceError::NotATrace { origin }),
            Preamble::Damaged => {
                return Err(TraceError::Unrecoverable {
                    origin,
                    damage: Damage {
                        offset: 0,
                        record: 0,
                        kind: DamageKind::Preamble,
                    },
                });
            }
            Preamble::Trace(v) if v > format::VERSION => {
                return Err(TraceError::NewerVersion {
                    origin,
                    found: v,
                    supported: format::VERSION,
                });
            }
            Preamble::Trace(v) => v,
        };
        Ok(Self {
            inner,
            origin,
            version,
            len: None,
            offset: format::PREAMBLE_LEN as u64,
            record: 0,
            last: (0, 0),
            header_seen: false,
            last_step: None,
            steps: 0,
            ended: false,
            done: false,
            damage: None,
            buf: Vec::new(),
        })
    }

    /// The name of the input, as given to [`Self::new`] or the path.
    pub fn origin(&self) -> &str {
        &self.origin
    }

    pub fn version(&self) -> u16 {
        self.version
    }

    /// Bytes consumed: the end of the last record read.
    pub fn offset(&self) -> u64 {
        self.offset
    }

    /// The file's size, when read from a file.
    pub fn len(&self) -> Option<u64> {
        self.len
    }

    /// Whether the file holds nothing but its preamble (unknown when not read from a file).
    pub fn is_empty(&self) -> Option<bool> {
        self.len.map(|l| l <= format::PREAMBLE_LEN as u64)
    }

    /// Records read so far (including skipped optional ones).
    pub fn records(&self) -> u64 {
        self.record
    }

    /// Whether the end record was read: the writer closed the trace.
    pub fn closed(&self) -> bool {
        self.ended
    }

    /// The first damage met, once iteration stopped at it.
    pub fn damage(&self) -> Option<&Damage> {
        self.damage.as_ref()
    }

    /// Marks the last record returned as unusable (e.g. the engine refused its step) and stops.
    pub fn reject_last(&mut self, why: String) {
        let (offset, record) = self.last;
        self.damage = Some(Damage {
            offset,
            record,
            kind: DamageKind::Rejected(why),
        });
        self.done = true;
    }

    fn stop(&mut self, kind: DamageKind) -> Option<Record> {
        self.damage = Some(Damage {
            offset: self.offset,
            record: self.record,
            kind,
        });
        self.done = true;
        None
    }

    /// The next record, or None at the end of the trace or at the first damage.
    pub fn next_record(&mut self) -> Option<Record> {
        loop {
            if self.done {
                return None;
            }
            let mut head = [0u8; FRAME_HEADER_LEN];
            let n = match fill(&mut self.inner, &mut head) {
                Ok(n) => n,
                Err(e) => return self.stop(DamageKind::Unreadable(e.to_string())),
            };
            if n == 0 {
                self.done = true;
                return None;
            }
            if n < FRAME_HEADER_LEN {
                return self.stop(DamageKind::Truncated {
                    needed: FRAME_HEADER_LEN as u64,
                    available: n as u64,
                });
            }
            let frame = match format::parse_frame_header(&head) {
                Ok(f) => f,
                Err(BadHeader::Checksum) => return self.stop(DamageKind::HeaderChecksum),
                Err(BadHeader::Reserved) => {
                    return self.stop(DamageKind::Malformed(
                        "reserved header bytes are not zero".into(),
                    ));
                }
                Err(BadHeader::TooLong(len)) => {
                    return self.stop(DamageKind::Malformed(format!(
                        "a record length of {len} bytes exceeds the maximum"
                    )));
                }
            };
            let body = u64::from(frame.len) + 4;
            self.buf.clear();
            let got = match (&mut self.inner).take(body).read_to_end(&mut self.buf) {
                Ok(n) => n as u64,
                Err(e) => return self.stop(DamageKind::Unreadable(e.to_string())),
            };
            if got < body {
                return self.stop(DamageKind::Truncated {
                    needed: FRAME_HEADER_LEN as u64 + body,
                    available: FRAME_HEADER_LEN as u64 + got,
                });
            }
            let (payload, crc) = self.buf.split_at(frame.len as usize);
            if !format::payload_ok(payload, [crc[0], crc[1], crc[2], crc[3]]) {
                return self.stop(DamageKind::PayloadChecksum);
            }
            let record = match self.decode(frame.kind) {
                Ok(Some(r)) => r,
                Ok(None) => {
                    // An optional record of a later writer: skip it.
                    self.advance(body);
                    continue;
                }
                Err(why) => return self.stop(DamageKind::Malformed(why)),
            };
            self.advance(body);
            return Some(record);
        }
    }

    fn advance(&mut self, body: u64) {
        self.last = (self.offset, self.record);
        self.offset += FRAME_HEADER_LEN as u64 + body;
        self.record += 1;
    }

    /// Decodes the payload in `self.buf`; None for an optional kind this build does not know.
    fn decode(&mut self, kind: u8) -> Result<Option<Record>, String> {
        let payload = &self.buf[..self.buf.len() - 4];
        if self.ended {
            return Err("a record follows the end record".into());
        }
        let Some(kind) = Kind::from_u8(kind) else {
            return if kind >= OPTIONAL_KINDS {
                Ok(None)
            } else {
                Err(format!("unknown record kind {kind}"))
            };
        };
        if kind == Kind::Unobserved && self.header_seen {
            let gap = serde_json::from_slice(payload)
                .map_err(|e| format!("unreadable record of unobserved steps: {e}"))?;
            return Ok(Some(Record::Unobserved(gap)));
        }
        if kind == Kind::Clock && self.header_seen {
            let clock = serde_json::from_slice(payload)
                .map_err(|e| format!("unreadable clock record: {e}"))?;
            return Ok(Some(Record::Clock(clock)));
        }
        if kind == Kind::ParamLr && self.header_seen {
            let record: format::ParamLrPayload = serde_json::from_slice(payload)
                .map_err(|e| format!("unreadable param-lr record: {e}"))?;
            return Ok(Some(Record::ParamLr(record.param_lr)));
        }
        if kind == Kind::FirstBatch && self.header_seen {
            let facts = serde_json::from_slice(payload)
                .map_err(|e| format!("unreadable first-batch record: {e}"))?;
            return Ok(Some(Record::FirstBatch(Box::new(facts))));
        }
        if kind == Kind::End && !self.header_seen && format::decode_end(payload)? == 0 {
            // Closed before any step: the writer ends a header-less trace so that readers
            // following it know no model will come.
            self.ended = true;
            return Ok(Some(Record::End { steps: 0 }));
        }
        if (kind == Kind::Header) == self.header_seen {
            return Err(if self.header_seen {
                "a second header".into()
            } else {
                "the first record is not the header".into()
            });
        }
        Ok(Some(match kind {
            Kind::Header => {
                let header: TraceHeader = serde_json::from_slice(payload)
                    .map_err(|e| format!("unreadable header: {e}"))?;
                self.header_seen = true;
                Record::Header(Box::new(header))
            }
            Kind::Step => {
                let obs = format::decode_step(payload)?;
                if let Some(last) = self.last_step.filter(|l| obs.step <= *l) {
                    return Err(format!("step {} follows step {last}", obs.step));
                }
                self.last_step = Some(obs.step);
                self.steps += 1;
                Record::Step(obs)
            }
            Kind::End => {
                let steps = format::decode_end(payload)?;
                if steps != self.steps {
                    return Err(format!(
                        "the end record counts {steps} steps but {} precede it",
                        self.steps
                    ));
                }
                self.ended = true;
                Record::End { steps }
            }
            Kind::Unobserved | Kind::Clock | Kind::ParamLr | Kind::FirstBatch => {
                unreachable!("handled above")
            }
        }))
    }
}

impl<R: Read> Iterator for TraceReader<R> {
    type Item = Record;

    fn next(&mut self) -> Option<Record> {
        self.next_record()
    }
}

#[cfg(test)]
mod tests {
    use std::io::{Cursor, Write};

    use super::*;
    use crate::trace::{TraceWriter, WriterOptions};
    use crate::{Config, ModelSpec};

    /// The bytes of a closed trace of `steps` steps.
    fn trace_bytes(steps: u64) -> Vec<u8> {
        let dir = std::env::temp_dir().join(format!("ndbg-resume-{}-{steps}", std::process::id()));
        let path = dir.join("run.ndbg");
        let mut spec = ModelSpec::default();
        let fc = spec.module("fc", "Linear");
        spec.param(fc, "fc.weight", &[2, 2]);
        let mut w = TraceWriter::create(&path, Map::new(), WriterOptions::default()).unwrap();
        w.write_header(&Config::default(), &spec).unwrap();
        for step in 0..steps {
            let obs = Observation {
                step,
                grad_norms: vec![0.5],
                ..Default::default()
            };
            w.write_step(&obs.view()).unwrap();
        }
        w.close().unwrap();
        let bytes = std::fs::read(&path).unwrap();
        std::fs::remove_dir_all(dir).unwrap();
        bytes
    }

    /// A growing input: the bytes written so far, read through a cursor that sees appends.
    fn kinds(reader: &mut TraceReader<Cursor<Vec<u8>>>) -> Vec<&'static str> {
        std::iter::from_fn(|| reader.next_record())
            .map(|r| match r {
                Record::Header(_) => "header",
                Record::Step(_) => "step",
                Record::End { .. } => "end",
                Record::Unobserved(_) => "unobserved",
                Record::Clock(_) => "clock",
                Record::ParamLr(_) => "param_lr",
                Record::FirstBatch(_) => "first_batch",
            })
            .collect()
    }

    #[test]
    fn resume_follows_a_trace_cut_anywhere() {
        let full = trace_bytes(4);
        // Wherever the writer is when the reader looks (inside the header, between records,
        // inside a step), the reader picks up exactly where the last whole record ended.
        for cut in format::PREAMBLE_LEN..full.len() {
            let mut reader =
                TraceReader::new(Cursor::new(full[..cut].to_vec()), "growing").unwrap();
            let mut all = kinds(&mut reader);
            assert!(!reader.closed());
            assert!(
                matches!(
                    reader.damage().map(|d| &d.kind),
                    Some(DamageKind::Truncated { .. }) | None
                ),
                "cut at {cut}: {:?}",
                reader.damage()
            );
            reader.inner.get_mut().write_all(&full[cut..]).unwrap();
            assert!(reader.resume().unwrap(), "cut at {cut}");
            all.extend(kinds(&mut reader));
            // (The writer records the first step's time after it.)
            assert_eq!(
                all,
                ["header", "step", "clock", "step", "step", "step", "end"],
                "cut at {cut}"
            );
            assert!(reader.closed() && reader.damage().is_none());
            // Closed: nothing more will come.
            assert!(!reader.resume().unwrap());
        }
    }

    #[test]
    fn resume_refuses_real_damage() {
        let mut bytes = trace_bytes(3);
        let last = bytes.len() - 10;
        bytes[last] ^= 0xff;
        let mut reader = TraceReader::new(Cursor::new(bytes), "corrupt").unwrap();
        let _ = kinds(&mut reader);
        assert!(reader.damage().is_some());
        assert!(!reader.resume().unwrap());
    }
}
