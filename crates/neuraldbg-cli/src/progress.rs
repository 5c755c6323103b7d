//! A one-line progress indicator on standard error, for reads long enough to wonder about.

use std::io::Write;
use std::time::{Duration, Instant};

/// Nothing is drawn for reads shorter than this.
const DELAY: Duration = Duration::from_millis(300);
const REFRESH: Duration = Duration::from_millis(100);

#[derive(Debug)]
pub struct Progress {
    enabled: bool,
    label: &'static str,
    total: Option<u64>,
    start: Instant,
    last: Option<Instant>,
}

impl Progress {
    /// `enabled` should be true only when standard error is a terminal.
    pub fn new(enabled: bool, label: &'static str, total: Option<u64>) -> Self {
        Self {
            enabled,
            label,
            total,
            start: Instant::now(),
            last: None,
        }
    }

    pub fn update(&mut self, done: u64) {
        if !self.enabled || self.start.elapsed() < DELAY {
            return;
        }
        if self.last.is_some_and(|t| t.elapsed() < REFRESH) {
            return;
        }
        self.last = Some(Instant::now());
        let mb = |b: u64| b as f64 / 1e6;
        let line = match self.total.filter(|t| *t > 0) {
            Some(total) => format!(
                "{} {:>3.0}% ({:.1} of {:.1} MB)",
                self.label,
                100.0 * (done as f64 / total as f64).min(1.0),
                mb(done),
                mb(total)
            ),
            None => format!("{} {:.1} MB", self.label, mb(done)),
        };
        // \r and "erase line": redraw in place.
        let _ = write!(std::io::stderr().lock(), "\r\x1b[2K{line}");
    }

    /// Erases the line, if one was drawn.
    pub fn finish(&mut self) {
        if self.last.take().is_some() {
            let _ = write!(std::io::stderr().lock(), "\r\x1b[2K");
        }
    }
}

impl Drop for Progress {
    fn drop(&mut self) {
        self.finish();
    }
}
