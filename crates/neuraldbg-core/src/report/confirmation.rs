//! What `neuraldbg run --confirm` found for one model: each hypothesis's verdict with the
//! numbers behind it, and the loss curves of the runs it compared (the first run, the unchanged
//! re-run, one per remedy). The Python command writes it as JSON next to the model's trace
//! (`<trace stem>.confirm.json`, see docs/trace-format.md); `explain` and `report` show it.
//!
//! ```
//! use neuraldbg_core::report::Confirmation;
//!
//! let c = Confirmation::from_json(r#"{"format": "neuraldbg-confirm", "version": 1, "model": "Net",
//!     "steps": 3, "verdicts": [{"failure": "non_finite", "cause": "learning_rate_too_high",
//!     "layer": null, "step": 2, "verdict": "confirmed", "intervention": "learning rate x0.1",
//!     "evidence": {"why": "the failure did not recur", "loss": 0.5, "loss_unchanged": null}}],
//!     "runs": [{"name": "unchanged re-run", "intervention": null, "steps": [0, 1, 2],
//!     "loss": [1.0, 9.0, null]}]}"#).unwrap();
//! assert_eq!(c.verdicts[0].verdict, "confirmed");
//! assert!(c.runs[0].loss[2].is_none());
//! ```

use std::fmt::Write as _;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::analysis::CausalHypothesis;

/// The `format` field of the file.
pub const FORMAT: &str = "neuraldbg-confirm";
/// The newest `version` this reader understands.
pub const VERSION: u64 = 1;

/// The verdicts and curves of one model's `--confirm` runs.
#[derive(Clone, Debug, Deserialize)]
pub struct Confirmation {
    /// The model (its name in `neuraldbg run`'s output).
    #[serde(default)]
    pub model: String,
    /// Steps of each re-run.
    pub steps: u64,
    pub verdicts: Vec<Verdict>,
    pub runs: Vec<ConfirmRun>,
}

/// One hypothesis's verdict, keyed by the hypothesis's failure, cause, layer and step.
#[derive(Clone, Debug, Deserialize)]
pub struct Verdict {
    pub failure: String,
    pub cause: String,
    pub layer: Option<String>,
    pub step: Option<u64>,
    /// `confirmed`, `refuted`, `inconclusive` or `untested`.
    pub verdict: String,
    /// What was changed in the re-run, None when nothing was tried.
    pub intervention: Option<String>,
    #[serde(default)]
    pub evidence: Evidence,
}

/// The numbers behind a verdict. A loss is None when it went non-finite or was not seen.
#[derive(Clone, Debug, Default, Deserialize, Serialize)]
pub struct Evidence {
    /// The verdict's reason, one sentence.
    #[serde(default)]
    pub why: String,
    pub failure_recurred: Option<bool>,
    pub failure_in_unchanged: Option<bool>,
    /// Final loss (mean of the last steps) with the remedy, of the unchanged re-run, of the
    /// first run, and how far the two identical runs differ.
    pub loss: Option<f64>,
    pub loss_unchanged: Option<f64>,
    pub loss_first_run: Option<f64>,
    pub spread: Option<f64>,
    /// Where the run with the remedy parts from the unchanged re-run (`neuraldbg diff`).
    #[serde(default)]
    pub parts_from_unchanged: Option<Parted>,
}

/// Where two runs part, as `neuraldbg diff` says: the first step their losses differ, and the
/// first step and layer whose health differs.
#[derive(Clone, Debug, Default, Deserialize, Serialize)]
pub struct Parted {
    pub loss_step: Option<u64>,
    pub health: Option<HealthParting>,
}

/// The first health difference between two runs.
#[derive(Clone, Debug, Deserialize, Serialize)]
pub struct HealthParting {
    pub step: u64,
    pub kind: String,
    pub layer: String,
    /// The state in the unchanged re-run, and with the remedy.
    pub a: String,
    pub b: String,
}

impl Parted {
    /// In words, for the report.
    pub fn text(&self) -> String {
        let loss = self.loss_step.map_or_else(
            || "the losses never differ".to_string(),
            |s| format!("the losses part at step {s}"),
        );
        let health = self.health.as_ref().map_or_else(
            || "health never differs".to_string(),
            |h| {
                format!(
                    "health parts at step {}: {} {} is {} unchanged, {} with the remedy",
                    h.step,
                    crate::model::display_name(&h.layer),
                    h.kind,
                    h.a,
                    h.b
                )
            },
        );
        format!("{loss}; {health}")
    }
}

/// One run's loss curve; a None loss is a non-finite one.
#[derive(Clone, Debug, Deserialize)]
pub struct ConfirmRun {
    /// `first run`, `unchanged re-run`, or the remedy.
    pub name: String,
    pub intervention: Option<String>,
    pub steps: Vec<u64>,
    pub loss: Vec<Option<f64>>,
}

#[derive(Deserialize)]
struct Header {
    format: Option<String>,
    version: Option<u64>,
}

impl Confirmation {
    /// Parses the file's text; an error says what is wrong with it.
    pub fn from_json(text: &str) -> Result<Self, String> {
        let header: Header = serde_json::from_str(text).map_err(|e| e.to_string())?;
        if header.format.as_deref() != Some(FORMAT) {
            return Err(format!("not a {FORMAT} file"));
        }
        match header.version {
            Some(v) if v <= VERSION => {}
            v => {
                return Err(format!(
                    "version {v:?} is newer than this reader's {VERSION}"
                ));
            }
        }
        serde_json::from_str(text).map_err(|e| e.to_string())
    }

    /// Where `neuraldbg run --confirm` writes the file of the model traced to `trace`.
    pub fn path_for(trace: &Path) -> PathBuf {
        trace.with_extension("confirm.json")
    }

    /// The file next to `trace`, when there is one: `Ok(None)` when there is none, an error
    /// naming the file when it cannot be read.
    pub fn next_to(trace: &Path) -> Result<Option<Self>, String> {
        let path = Self::path_for(trace);
        match std::fs::read_to_string(&path) {
            Ok(text) => Self::from_json(&text)
                .map(Some)
                .map_err(|e| format!("{}: {e}", path.display())),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
            Err(e) => Err(format!("{}: {e}", path.display())),
        }
    }

    /// The verdict of `h`, when it was judged.
    pub fn verdict_for(&self, h: &CausalHypothesis) -> Option<&Verdict> {
        self.verdicts.iter().find(|v| {
            v.failure == h.failure.as_str()
                && v.cause == h.cause.as_str()
                && v.layer == h.layer
                && v.step == h.step
        })
    }

    /// `hypotheses` with the confirmed ones first, each group in its order (as `--confirm`
    /// ranks them).
    pub fn rank<'a>(&self, hypotheses: &'a [CausalHypothesis]) -> Vec<&'a CausalHypothesis> {
        let confirmed = |h: &CausalHypothesis| {
            self.verdict_for(h)
                .is_some_and(|v| v.verdict == "confirmed")
        };
        let mut out: Vec<&CausalHypothesis> = hypotheses.iter().filter(|h| confirmed(h)).collect();
        out.extend(hypotheses.iter().filter(|h| !confirmed(h)));
        out
    }
}

impl Verdict {
    /// `confirmed`, `refuted` or `inconclusive`.
    pub fn tried(&self) -> bool {
        self.intervention.is_some() && self.verdict != "untested"
    }

    /// One line: the verdict, what was tried, and the numbers, as `neuraldbg run` prints it.
    pub fn line(&self) -> String {
        let mut s = self.verdict.to_uppercase();
        if let Some(i) = &self.intervention {
            let e = &self.evidence;
            let _ = write!(
                s,
                ": {i}; loss {} vs {} unchanged (spread {})",
                loss_text(e.loss),
                loss_text(e.loss_unchanged),
                e.spread
                    .map_or_else(|| "-".into(), crate::analysis::format_number),
            );
        }
        if !self.evidence.why.is_empty() {
            let _ = write!(s, " — {}", self.evidence.why);
        }
        s
    }
}

/// A final loss in words: None is a loss that went non-finite (or was not seen).
pub fn loss_text(v: Option<f64>) -> String {
    v.map_or_else(|| "non-finite".into(), crate::analysis::format_number)
}
