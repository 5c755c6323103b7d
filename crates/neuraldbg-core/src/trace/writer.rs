//! Writing a trace while training runs.

use std::fs::File;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use serde_json::{Map, Value, json};

use super::TraceError;

/// Seconds between two clock records: enough to place steps in time for plots, a few bytes a
/// second.
const CLOCK_EVERY: Duration = Duration::from_secs(1);
use super::format::{self, Kind, MAX_PAYLOAD};
use crate::config::Config;
use crate::model::ModelSpec;
use crate::observation::StepView;

/// When the writer asks the operating system to put the trace on stable storage (`fdatasync`).
///
/// Whatever the policy, every record is handed to the operating system (one `write`) as soon
/// as it is produced, so a killed or crashed process never loses a complete record: syncing
/// only matters if the machine itself goes down.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SyncPolicy {
    /// After the header and on close only.
    OnClose,
    /// Also on the first write at least this long after the previous sync.
    Interval(Duration),
    /// After every record (costs a disk flush per step).
    EveryRecord,
}

impl SyncPolicy {
    /// The policy of syncing every `seconds`: 0 is every record, infinity only on close.
    /// None for a negative or NaN interval.
    pub fn every(seconds: f64) -> Option<Self> {
        if seconds == 0.0 {
            Some(Self::EveryRecord)
        } else if seconds == f64::INFINITY {
            Some(Self::OnClose)
        } else if seconds > 0.0 && seconds.is_finite() {
            Some(Self::Interval(Duration::from_secs_f64(seconds)))
        } else {
            None
        }
    }
}

/// How a [`TraceWriter`] behaves.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct WriterOptions {
    pub sync: SyncPolicy,
}

impl Default for WriterOptions {
    /// Syncs at most every 10 s: a power loss costs at most the last 10 s of steps, and the
    /// flush (about a millisecond on a local disk) is amortised over thousands of steps.
    fn default() -> Self {
        Self {
            sync: SyncPolicy::Interval(Duration::from_secs(10)),
        }
    }
}

/// Writes one trace. Create it, write the header once the model is known, then one step per
/// observation; [`Self::close`] (or drop) marks the trace complete.
#[derive(Debug)]
pub struct TraceWriter {
    file: File,
    path: PathBuf,
    options: WriterOptions,
    meta: Map<String, Value>,
    frame: Vec<u8>,
    payload: Vec<u8>,
    bytes: u64,
    steps: u64,
    last_step: Option<u64>,
    header: bool,
    last_sync: Instant,
    /// When the last clock record was written (None: none yet).
    last_clock: Option<Instant>,
    /// Set after a failed write: the file may end in a partial record, so nothing more is
    /// appended after it.
    failed: bool,
    closed: bool,
}

impl TraceWriter {
    /// Creates (or truncates) the trace at `path`, creating missing directories, and writes
    /// its preamble. `meta` (producer, framework versions, start time...) goes into the header.
    pub fn create(
        path: impl AsRef<Path>,
        meta: Map<String, Value>,
        options: WriterOptions,
    ) -> Result<Self, TraceError> {
        let path = path.as_ref().to_path_buf();
        let io = |op: &'static str, path: &Path| {
            let path = path.to_path_buf();
            move |source| TraceError::Io { op, path, source }
        };
        if path.as_os_str().is_empty() || path.is_dir() {
            return Err(TraceError::Usage {
                path,
                message: "the path is a directory; give a file name such as runs/run.ndbg".into(),
            });
        }
        let parent = path
            .parent()
            .filter(|p| !p.as_os_str().is_empty())
            .map(Path::to_path_buf);
        if let Some(dir) = &parent {
            std::fs::create_dir_all(dir).map_err(io("create the directory", dir))?;
        }
        let mut file = File::create(&path).map_err(io("create", &path))?;
        file.write_all(&format::preamble())
            .map_err(io("write", &path))?;
        let mut writer = Self {
            file,
            path,
            options,
            meta,
            frame: Vec::new(),
            payload: Vec::new(),
            bytes: format::PREAMBLE_LEN as u64,
            steps: 0,
            last_step: None,
            header: false,
            last_sync: Instant::now(),
            last_clock: None,
            failed: false,
            closed: false,
        };
        writer.sync()?;
        // The new directory entry must survive a power loss too. Best effort: not every
        // platform lets a directory be opened and synced.
        if let Some(dir) = parent.and_then(|d| File::open(d).ok()) {
            let _ = dir.sync_all();
        }
        Ok(writer)
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Bytes written so far.
    pub fn bytes(&self) -> u64 {
        self.bytes
    }

    /// Step records written so far.
    pub fn steps(&self) -> u64 {
        self.steps
    }

    pub fn has_header(&self) -> bool {
        self.header
    }

    /// Writes the header: the engine's configuration, the registered model and the metadata.
    /// Synced at once: without it nothing replays.
    pub fn write_header(&mut self, config: &Config, model: &ModelSpec) -> Result<(), TraceError> {
        if self.header {
            return Err(self.usage("the header is already written"));
        }
        let header = json!({
            "format": format::VERSION,
            "config": config,
            "model": model,
            "meta": self.meta,
        });
        let text = serde_json::to_vec(&header).map_err(|e| self.usage(&e.to_string()))?;
        // Replay is exact only if every number reads back as the same bits.
        let back: super::TraceHeader =
            serde_json::from_slice(&text).map_err(|e| self.usage(&e.to_string()))?;
        if back.config != *config || back.model != *model {
            return Err(self.usage("the configuration does not survive a JSON round trip"));
        }
        self.payload = text;
        self.write_record(Kind::Header)?;
        self.header = true;
        self.sync()
    }

    /// Appends one step. Steps must increase, as they do for the engine.
    pub fn write_step(&mut self, view: &StepView<'_>) -> Result<(), TraceError> {
        if !self.header {
            return Err(self.usage("write the header before the first step"));
        }
        if let Some(last) = self.last_step.filter(|last| view.step <= *last) {
            return Err(self.usage(&format!(
                "step {} is not after the last written step {last}",
                view.step
            )));
        }
        format::encode_step(&mut self.payload, view).map_err(|e| {
            self.usage(&match e {
                format::TooLarge::Array(what, n) => format!("{what} has {n} values"),
                format::TooLarge::Module(m) => format!("module index {m} is too large"),
                format::TooLarge::Payload(n) => format!("a step of {n} bytes is too large"),
                format::TooLarge::Block(what, n) => format!("{n} {what} in one step"),
            })
        })?;
        self.write_record(Kind::Step)?;
        self.steps += 1;
        self.last_step = Some(view.step);
        if self.last_clock.is_none_or(|t| t.elapsed() >= CLOCK_EVERY) {
            self.write_clock(view.step)?;
        }
        if let SyncPolicy::Interval(every) = self.options.sync {
            if self.last_sync.elapsed() >= every {
                self.sync()?;
            }
        }
        Ok(())
    }

    /// Records when `step` was written, so that exports can place steps in time.
    fn write_clock(&mut self, step: u64) -> Result<(), TraceError> {
        self.last_clock = Some(Instant::now());
        let time = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0.0, |d| d.as_secs_f64());
        self.payload = serde_json::to_vec(&super::Clock { step, time })
            .map_err(|e| self.usage(&e.to_string()))?;
        self.write_record(Kind::Clock)
    }

    /// Records steps the run took that were not observed, and why (written before the end
    /// record; readers report them). Does nothing before the header: there is no step to
    /// speak of.
    pub fn write_unobserved(&mut self, gap: &super::Unobserved) -> Result<(), TraceError> {
        if !self.header {
            return Ok(());
        }
        self.payload = serde_json::to_vec(gap).map_err(|e| self.usage(&e.to_string()))?;
        self.write_record(Kind::Unobserved)
    }

    /// Records [`crate::Engine::amend_param_lr`]'s input, so that replay amends the model at
    /// the same point between steps. Like the header, checked to read back as the same bits.
    pub fn write_param_lr(&mut self, lrs: Option<&[Option<f64>]>) -> Result<(), TraceError> {
        if !self.header {
            return Err(self.usage("write the header before amending it"));
        }
        let record = format::ParamLrPayload {
            param_lr: lrs.map(<[Option<f64>]>::to_vec),
        };
        let text = serde_json::to_vec(&record).map_err(|e| self.usage(&e.to_string()))?;
        let back: format::ParamLrPayload =
            serde_json::from_slice(&text).map_err(|e| self.usage(&e.to_string()))?;
        let bits = |v: &Option<Vec<Option<f64>>>| {
            v.as_ref()
                .map(|v| v.iter().map(|x| x.map(f64::to_bits)).collect::<Vec<_>>())
        };
        if bits(&back.param_lr) != bits(&record.param_lr) {
            return Err(self.usage("a learning rate does not survive a JSON round trip"));
        }
        self.payload = text;
        self.write_record(Kind::ParamLr)
    }

    /// Records [`crate::Engine::amend_first_batch`]'s input, so that replay amends the model at
    /// the same point between steps (checked to read back the same, like the header).
    pub fn write_first_batch(&mut self, facts: &crate::FirstBatch) -> Result<(), TraceError> {
        if !self.header {
            return Err(self.usage("write the header before amending it"));
        }
        let text = serde_json::to_vec(facts).map_err(|e| self.usage(&e.to_string()))?;
        let back: crate::FirstBatch =
            serde_json::from_slice(&text).map_err(|e| self.usage(&e.to_string()))?;
        if &back != facts {
            return Err(self.usage("a first-batch fact does not survive a JSON round trip"));
        }
        self.payload = text;
        self.write_record(Kind::FirstBatch)
    }

    /// Writes the end record and syncs; later calls do nothing and later writes fail. A trace
    /// without an end record is still readable; the reader then reports that the run did not
    /// close it (it was killed or crashed).
    pub fn close(&mut self) -> Result<(), TraceError> {
        if self.closed || self.failed {
            return Ok(());
        }
        // A trace without a header ends with zero steps: readers say "no model", and one
        // following it knows that none will come.
        self.payload = format::encode_end(self.steps).to_vec();
        self.write_record(Kind::End)?;
        self.closed = true;
        self.sync()
    }

    fn usage(&self, message: &str) -> TraceError {
        TraceError::Usage {
            path: self.path.clone(),
            message: message.to_string(),
        }
    }

    fn write_record(&mut self, kind: Kind) -> Result<(), TraceError> {
        if self.failed {
            return Err(self.usage("writing stopped after an earlier error"));
        }
        if self.closed {
            return Err(self.usage("the trace is closed"));
        }
        if self.payload.len() > MAX_PAYLOAD as usize {
            return Err(self.usage("the record is too large"));
        }
        self.frame.clear();
        format::frame(&mut self.frame, kind as u8, &self.payload);
        // One write per record, no user-space buffer: once this returns, a killed process
        // cannot lose the record.
        if let Err(source) = self.file.write_all(&self.frame) {
            self.failed = true;
            return Err(TraceError::Io {
                op: "write",
                path: self.path.clone(),
                source,
            });
        }
        self.bytes += self.frame.len() as u64;
        if self.options.sync == SyncPolicy::EveryRecord {
            self.sync()?;
        }
        Ok(())
    }

    /// Asks the operating system to put everything written so far on stable storage.
    pub fn sync(&mut self) -> Result<(), TraceError> {
        self.last_sync = Instant::now();
        self.file.sync_data().map_err(|source| TraceError::Io {
            op: "sync",
            path: self.path.clone(),
            source,
        })
    }
}

impl Drop for TraceWriter {
    /// Closes the trace like [`TraceWriter::close`], ignoring errors (nobody can receive them).
    fn drop(&mut self) {
        let _ = self.close();
    }
}
