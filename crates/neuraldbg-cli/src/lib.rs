//! # neuraldbg-cli
//!
//! The `neuraldbg` command: reads a trace written by `NeuralDbg(model, trace="run.ndbg")` (or
//! by [`neuraldbg_core::trace::TraceWriter`]), replays it into the engine, and explains,
//! lists or exports the diagnosis. Replay makes every answer exactly the live run's.
//!
//! The binary (`cargo install --path crates/neuraldbg-cli`) and the Python package's script
//! (`pip install .`, through `neuraldbg._native.cli_main`) both call [`run`].
//!
//! ```text
//! neuraldbg explain runs/x.ndbg [--json] [--failure FAILURE]
//! neuraldbg events runs/x.ndbg [--layer L] [--kind K] [--json]
//! neuraldbg export runs/x.ndbg --format json|mermaid|tensorboard|parquet [-o OUT]
//! neuraldbg info runs/x.ndbg [--json]
//! neuraldbg watch runs/x.ndbg [--plain]
//! ```

mod cli;
mod diff;
mod export;
mod parquet;
mod progress;
mod tensorboard;
mod text;
mod watch;

use std::ffi::OsString;
use std::io::{IsTerminal, Write};
use std::path::Path;

use clap::Parser;
use neuraldbg_core::analysis::{FAILURE_CONFIDENCE, explain as ranked, parse_failure};
use neuraldbg_core::output::{events_json, hypotheses_json};
use neuraldbg_core::report::Confirmation;
use neuraldbg_core::trace::{Replay, TraceError, TraceReader};
use neuraldbg_core::{CausalHypothesis, Engine, EventType, SemanticEvent, Subject, display_name};
use serde_json::Value;

use cli::{Cli, Command, Format};

pub use cli::EXIT_CODES;

pub const EXIT_OK: i32 = 0;
/// The output could not be written.
pub const EXIT_OUTPUT: i32 = 1;
/// Invalid arguments (clap uses 2 too).
pub const EXIT_USAGE: i32 = 2;
/// The trace cannot be read at all.
pub const EXIT_UNREADABLE: i32 = 3;
/// The trace needs a newer `NeuralDBG`.
pub const EXIT_NEWER: i32 = 4;
/// `--strict` and the trace is damaged.
pub const EXIT_DAMAGED: i32 = 5;
/// A bug in `neuraldbg` itself (a panic, caught so it is reported rather than aborting).
pub const EXIT_INTERNAL: i32 = 70;

/// Why a command stopped: the exit code and the message for standard error (none: stop
/// quietly).
#[derive(Debug)]
struct Stop {
    code: i32,
    message: Option<String>,
}

impl Stop {
    fn new(code: i32, message: impl Into<String>) -> Self {
        Self {
            code,
            message: Some(message.into()),
        }
    }
}

impl From<TraceError> for Stop {
    fn from(e: TraceError) -> Self {
        let code = match e {
            TraceError::NewerVersion { .. } => EXIT_NEWER,
            TraceError::Usage { .. } => EXIT_OUTPUT,
            _ => EXIT_UNREADABLE,
        };
        Self::new(code, e.to_string())
    }
}

/// Where a command writes: standard output and error, or buffers in tests.
struct Io<'a> {
    out: &'a mut dyn Write,
    err: &'a mut dyn Write,
    /// Draw progress on the real standard error.
    progress: bool,
    /// Standard output is a terminal (`watch` then draws its terminal UI).
    tty: bool,
}

impl Io<'_> {
    fn print(&mut self, text: &str) -> Result<(), Stop> {
        writeln!(self.out, "{text}").map_err(|e| output_error(&e))
    }

    /// A note on standard error; failing to write it is not worth failing the command.
    fn note(&mut self, text: &str) {
        let _ = writeln!(self.err, "{text}");
    }
}

fn output_error(e: &std::io::Error) -> Stop {
    // A closed pipe (`neuraldbg events x | head`) is the reader's choice, not an error.
    if e.kind() == std::io::ErrorKind::BrokenPipe {
        return Stop {
            code: EXIT_OK,
            message: None,
        };
    }
    Stop::new(EXIT_OUTPUT, format!("cannot write the output: {e}"))
}

/// Runs the command line `args` (program name first) on the process's standard output and
/// error; returns the exit code. Never panics on bad input.
pub fn run<I, T>(args: I) -> i32
where
    I: IntoIterator<Item = T>,
    T: Into<OsString> + Clone,
{
    let stdout = std::io::stdout();
    let stderr = std::io::stderr();
    let progress = stderr.is_terminal();
    let tty = stdout.is_terminal();
    let code = run_inner(args, &mut stdout.lock(), &mut stderr.lock(), progress, tty);
    let _ = std::io::stdout().flush();
    code
}

/// [`run`] with explicit output streams. `progress`: draw progress on standard error (only
/// sensible when it is a terminal).
pub fn run_with<I, T>(args: I, out: &mut dyn Write, err: &mut dyn Write, progress: bool) -> i32
where
    I: IntoIterator<Item = T>,
    T: Into<OsString> + Clone,
{
    run_inner(args, out, err, progress, false)
}

fn run_inner<I, T>(
    args: I,
    out: &mut dyn Write,
    err: &mut dyn Write,
    progress: bool,
    tty: bool,
) -> i32
where
    I: IntoIterator<Item = T>,
    T: Into<OsString> + Clone,
{
    let cli = match Cli::try_parse_from(args) {
        Ok(cli) => cli,
        Err(e) => {
            // Help and version go to standard output with code 0, errors to standard error.
            let text = e.render().to_string();
            let _ = if e.use_stderr() {
                write!(err, "{text}")
            } else {
                write!(out, "{text}").and_then(|()| out.flush())
            };
            return e.exit_code();
        }
    };
    let mut io = Io {
        out,
        err,
        progress: progress && !cli.quiet,
        tty,
    };
    // Malformed traces are errors, never panics; should a bug panic anyway, say so plainly
    // (the default hook has already printed where).
    let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| dispatch(&cli, &mut io)))
        .unwrap_or_else(|_| {
            Err(Stop::new(
                EXIT_INTERNAL,
                "internal error (a bug in neuraldbg): please report it with the trace",
            ))
        });
    let flushed = io.out.flush();
    match result.and_then(|code| flushed.map(|()| code).map_err(|e| output_error(&e))) {
        Ok(code) => code,
        Err(stop) => {
            if let Some(message) = &stop.message {
                io.note(&format!("neuraldbg: error: {message}"));
            }
            stop.code
        }
    }
}

fn dispatch(cli: &Cli, io: &mut Io<'_>) -> Result<i32, Stop> {
    let path = match &cli.command {
        Command::Explain(a) => &a.trace,
        Command::Events(a) => &a.trace,
        Command::Export(a) => &a.trace,
        Command::Report(a) => &a.trace,
        Command::Info(a) => &a.trace,
        Command::Watch(a) => {
            let interval = std::time::Duration::from_secs_f64(a.interval);
            let follow = if a.plain || !io.tty {
                watch::plain(&a.trace, interval, io)?
            } else {
                watch::interactive(&a.trace, interval, io)?
            };
            return Ok(if cli.strict && follow.damage.is_some() {
                EXIT_DAMAGED
            } else {
                EXIT_OK
            });
        }
        Command::Diff(a) => {
            let first = load(&a.a, io)?;
            let second = load(&a.b, io)?;
            diff::print(&first, &second, a.json, a.html.as_deref(), io)?;
            return Ok(EXIT_OK);
        }
        Command::Run(_) => {
            return Err(Stop::new(
                EXIT_USAGE,
                "`neuraldbg run` runs Python: use the `neuraldbg` command installed by `pip install neuraldbg`, or `python -m neuraldbg run [OPTIONS] SCRIPT [ARGS...]`",
            ));
        }
    };
    // Arguments that need no trace are checked before a possibly long read.
    if let Command::Export(a) = &cli.command {
        if a.format == Format::Tensorboard && a.output.is_none() {
            return Err(Stop::new(
                EXIT_USAGE,
                "--format tensorboard writes a directory of event files: give it with -o DIR",
            ));
        }
        if a.format == Format::Parquet && a.output.is_none() {
            return Err(Stop::new(
                EXIT_USAGE,
                "--format parquet writes three tables (history, events, hypotheses): give their directory with -o DIR",
            ));
        }
    }
    let replay = load(path, io)?;
    if let (Some(d), 0, false) = (
        &replay.damage,
        replay.steps,
        matches!(cli.command, Command::Info(_)),
    ) {
        // Nothing to explain, list or export: as the exit codes say, not a success.
        return Err(Stop::new(
            EXIT_UNREADABLE,
            format!(
                "{} is damaged before its first step ({d}): no step can be read (two processes writing one file? each rank of a job writes its own trace with trace_rank=None)",
                replay.origin
            ),
        ));
    }
    match &cli.command {
        Command::Explain(a) => explain(&replay, a, io)?,
        Command::Events(a) => events(&replay, a, io)?,
        Command::Export(a) => export(&replay, a, io)?,
        Command::Report(a) => report(&replay, a, io)?,
        Command::Info(a) => info(&replay, a, io)?,
        Command::Watch(_) | Command::Diff(_) | Command::Run(_) => {}
    }
    Ok(if cli.strict && replay.damage.is_some() {
        EXIT_DAMAGED
    } else {
        EXIT_OK
    })
}

/// Replays the trace, with progress on long reads and a warning when it is damaged or was not
/// closed.
fn load(path: &Path, io: &mut Io<'_>) -> Result<Replay, Stop> {
    let reader = TraceReader::open(path)?;
    let mut bar = progress::Progress::new(io.progress, "reading trace", reader.len());
    let replay = Replay::read(reader, |done| bar.update(done))?;
    bar.finish();
    let steps = match (replay.first_step, replay.engine.last_step()) {
        (Some(a), Some(b)) if a == b => format!("1 step (step {a})"),
        (Some(a), Some(b)) => format!("{} steps (steps {a} to {b})", replay.steps),
        _ => "no step".to_string(),
    };
    if let Some(d) = &replay.damage {
        if replay.steps > 0 {
            io.note(&format!(
                "neuraldbg: warning: {} is damaged at {d}; using the {steps} before it",
                replay.origin
            ));
        }
    } else if !replay.closed {
        let note = match watch::writer_of(&replay.header) {
            watch::Writer::Alive(pid) => format!(
                "is still being written (process {pid} is running); the {steps} written so far are used"
            ),
            _ => format!(
                "was not closed (the run was killed or crashed); all {steps} written are used"
            ),
        };
        io.note(&format!("neuraldbg: note: {} {note}", replay.origin));
    }
    for gap in &replay.unobserved {
        io.note(&format!("neuraldbg: note: {gap}"));
    }
    Ok(replay)
}

fn to_json(value: &Value) -> String {
    serde_json::to_string_pretty(value).unwrap_or_else(|_| value.to_string())
}

fn explain(replay: &Replay, a: &cli::Explain, io: &mut Io<'_>) -> Result<(), Stop> {
    let engine = &replay.engine;
    let only = a
        .failure
        .as_deref()
        .map(parse_failure)
        .transpose()
        .map_err(|e| Stop::new(EXIT_USAGE, e.to_string()))?;
    let confirmation = confirmation(&a.trace, io);
    let mut hypotheses = ranked(engine, only);
    if let Some(c) = &confirmation {
        hypotheses = c.rank(&hypotheses).into_iter().cloned().collect();
    }
    if a.json {
        let mut out = hypotheses_json(engine, &hypotheses);
        if let (Some(c), Value::Array(items)) = (&confirmation, &mut out) {
            for (item, h) in items.iter_mut().zip(&hypotheses) {
                if let (Some(v), Value::Object(o)) = (c.verdict_for(h), item) {
                    o.insert("verdict".into(), Value::from(v.verdict.clone()));
                    o.insert("intervention".into(), Value::from(v.intervention.clone()));
                    o.insert(
                        "evidence".into(),
                        serde_json::to_value(&v.evidence).unwrap_or(Value::Null),
                    );
                }
            }
        }
        return io.print(&to_json(&out));
    }
    if hypotheses.is_empty() {
        let unseen = if replay.unobserved.is_empty() {
            String::new()
        } else {
            " (later steps were not observed, see above)".to_string()
        };
        let Some(only) = only else {
            io.note(&format!(
                "neuraldbg: no failure found in {} observed steps{unseen}",
                replay.steps
            ));
            return Ok(());
        };
        // Say what the run did show, so a wrong guess at the failure is not a dead end.
        let found = ranked(engine, None);
        let instead = found.first().map_or_else(
            || "nor any other failure".to_string(),
            |h| {
                format!(
                    "what was found: {} (neuraldbg explain {} for the full ranking)",
                    h.failure, replay.origin
                )
            },
        );
        io.note(&format!(
            "neuraldbg: no {only} found in {} observed steps{unseen}; {instead}",
            replay.steps
        ));
    }
    let confirmed = |h: &CausalHypothesis| {
        confirmation
            .as_ref()
            .and_then(|c| c.verdict_for(h))
            .is_some_and(|v| v.verdict == "confirmed")
    };
    if !hypotheses.is_empty()
        && !hypotheses
            .iter()
            .any(|h| h.confidence >= FAILURE_CONFIDENCE || confirmed(h))
    {
        // Weaker signals only: say first that they are not a verdict.
        let what = only.map_or("failure".to_string(), |f| f.to_string());
        io.note(&format!(
            "neuraldbg: no {what} found in {} observed steps (no hypothesis reaches confidence \
             {FAILURE_CONFIDENCE}); weaker signals:",
            replay.steps
        ));
    }
    for h in &hypotheses {
        io.print(&text::hypothesis_line(h))?;
        if let Some(v) = confirmation.as_ref().and_then(|c| c.verdict_for(h)) {
            io.print(&format!("    {}", v.line()))?;
        }
    }
    Ok(())
}

/// The verdicts `neuraldbg run --confirm` wrote next to `trace`, when it did (a file that
/// cannot be read is reported and left out).
fn confirmation(trace: &Path, io: &mut Io<'_>) -> Option<Confirmation> {
    match Confirmation::next_to(trace) {
        Ok(Some(c)) => {
            io.note(&format!(
                "neuraldbg: verdicts of neuraldbg run --confirm from {}",
                Confirmation::path_for(trace).display()
            ));
            Some(c)
        }
        Ok(None) => None,
        Err(e) => {
            io.note(&format!(
                "neuraldbg: warning: the --confirm verdicts are left out: {e}"
            ));
            None
        }
    }
}

/// Whether an event matches `--kind`: its type, or the state it enters (in any case).
fn kind_matches(e: &SemanticEvent, kind: &str) -> bool {
    let kind = cli::kind_list()
        .into_iter()
        .find(|k| k.eq_ignore_ascii_case(kind))
        .unwrap_or(kind);
    match EventType::parse(kind) {
        Some(t) => e.event_type == t,
        None => e.to_state.as_str() == kind,
    }
}

/// The name `--layer` refers to, checked against the model.
fn resolve_layer(engine: &Engine, layer: &str) -> Result<String, Stop> {
    let name = if layer == display_name("") { "" } else { layer };
    let known = |n: &str| {
        n == Subject::LOSS_NAME
            || n == Subject::INPUT_NAME
            || engine.model().is_some_and(|m| m.module_index(n).is_some())
    };
    if known(name) {
        return Ok(name.to_string());
    }
    let mut names: Vec<String> = engine
        .model()
        .map(|m| {
            m.spec
                .modules
                .iter()
                .filter(|x| !x.name.is_empty())
                .map(|x| x.name.clone())
                .take(12)
                .collect()
        })
        .unwrap_or_default();
    names.extend([display_name(""), Subject::LOSS_NAME, Subject::INPUT_NAME].map(String::from));
    Err(Stop::new(
        EXIT_USAGE,
        format!(
            "unknown layer {layer:?}; expected a module name from the trace such as {}",
            names.join(", ")
        ),
    ))
}

fn events(replay: &Replay, a: &cli::Events, io: &mut Io<'_>) -> Result<(), Stop> {
    let engine = &replay.engine;
    let layer = a
        .layer
        .as_deref()
        .map(|l| resolve_layer(engine, l))
        .transpose()?;
    let events: Vec<SemanticEvent> = engine
        .events()
        .into_iter()
        .filter(|e| {
            layer
                .as_ref()
                .is_none_or(|l| engine.subject_name(e.subject) == *l)
        })
        .filter(|e| a.kind.as_ref().is_none_or(|k| kind_matches(e, k)))
        .collect();
    if a.json {
        return io.print(&to_json(&events_json(engine, &events)));
    }
    for e in &events {
        io.print(&text::event_line(engine, e))?;
    }
    Ok(())
}

/// Writes a file, creating its directory.
fn write_file(path: &Path, bytes: &[u8]) -> Result<(), Stop> {
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir)
            .map_err(|e| Stop::new(EXIT_OUTPUT, format!("cannot create {}: {e}", dir.display())))?;
    }
    std::fs::write(path, bytes)
        .map_err(|e| Stop::new(EXIT_OUTPUT, format!("cannot write {}: {e}", path.display())))
}

fn report(replay: &Replay, a: &cli::Report, io: &mut Io<'_>) -> Result<(), Stop> {
    let title = a.title.clone().unwrap_or_else(|| {
        a.trace.file_name().map_or_else(
            || a.trace.display().to_string(),
            |n| n.to_string_lossy().into_owned(),
        )
    });
    let html = match confirmation(&a.trace, io) {
        Some(c) => neuraldbg_core::report::render_html_confirmed(&replay.engine, &title, &c),
        None => neuraldbg_core::report::render_html(&replay.engine, &title),
    };
    write_file(&a.output, html.as_bytes())?;
    io.note(&format!("neuraldbg: wrote {}", a.output.display()));
    Ok(())
}

fn export(replay: &Replay, a: &cli::Export, io: &mut Io<'_>) -> Result<(), Stop> {
    let text = match a.format {
        Format::Json => to_json(&export::json(replay)),
        Format::Mermaid => neuraldbg_core::analysis::mermaid(&replay.engine),
        Format::Tensorboard => {
            let dir = a.output.as_deref().unwrap_or(Path::new("."));
            let wall = started(replay);
            let path = dir.join(format!("events.out.tfevents.{}.neuraldbg", wall as u64));
            // Each step at the time it was written (traces without clocks: the start time).
            let at = |step| neuraldbg_core::trace::wall_time(&replay.clocks, step).unwrap_or(wall);
            write_file(&path, &export::tensorboard(replay).to_bytes(wall, at))?;
            io.note(&format!(
                "neuraldbg: wrote {} (view with: tensorboard --logdir {})",
                path.display(),
                dir.display()
            ));
            return Ok(());
        }
        Format::Parquet => {
            let dir = a.output.as_deref().unwrap_or(Path::new("."));
            std::fs::create_dir_all(dir).map_err(|e| {
                Stop::new(EXIT_OUTPUT, format!("cannot create {}: {e}", dir.display()))
            })?;
            let written =
                parquet::export(&replay.engine, dir).map_err(|e| Stop::new(EXIT_OUTPUT, e))?;
            let names: Vec<String> = written.iter().map(|p| p.display().to_string()).collect();
            io.note(&format!("neuraldbg: wrote {}", names.join(", ")));
            return Ok(());
        }
    };
    match &a.output {
        Some(path) => write_file(path, format!("{text}\n").as_bytes()),
        None => io.print(&text),
    }
}

/// When the run started (seconds since the epoch): the trace's `started` metadata, else the
/// file's modification time. Fixed per trace, so exporting again replaces the same file.
fn started(replay: &Replay) -> f64 {
    replay
        .header
        .meta
        .get("started")
        .and_then(Value::as_f64)
        .or_else(|| {
            std::fs::metadata(&replay.origin)
                .and_then(|m| m.modified())
                .ok()
                .and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok())
                .map(|d| d.as_secs_f64())
        })
        .unwrap_or(0.0)
}

fn info(replay: &Replay, a: &cli::Info, io: &mut Io<'_>) -> Result<(), Stop> {
    let facts = export::trace_json(replay);
    if a.json {
        return io.print(&to_json(&facts));
    }
    let field = |key: &str| match &facts[key] {
        Value::Null => "-".to_string(),
        Value::String(s) => s.clone(),
        v => v.to_string(),
    };
    let model = &facts["model"];
    let mut rows: Vec<(String, String)> = vec![
        (
            "trace".into(),
            format!(
                "{} (format {}, {} bytes)",
                field("path"),
                field("format_version"),
                field("bytes")
            ),
        ),
        (
            "model".into(),
            format!(
                "{} modules, {} parameters, {} layers, {} activations, optimizer {}",
                model["modules"],
                model["parameters"],
                model["layers"],
                model["activations"],
                model["optimizer"].as_str().unwrap_or("-")
            ),
        ),
        (
            "steps".into(),
            format!(
                "{} (steps {} to {})",
                field("steps"),
                field("first_step"),
                field("last_step")
            ),
        ),
    ];
    if let Some(per) = facts["bytes_per_step"].as_f64() {
        rows.push(("per step".into(), format!("{per:.0} bytes")));
    }
    let closed = if replay.closed {
        "yes".to_string()
    } else if replay.damage.is_some() {
        "no (the trace is damaged)".to_string()
    } else if let watch::Writer::Alive(pid) = watch::writer_of(&replay.header) {
        format!("no: still being written (process {pid} is running)")
    } else {
        "no (the run was killed or crashed)".to_string()
    };
    rows.push(("closed".into(), closed));
    rows.push((
        "damage".into(),
        replay
            .damage
            .as_ref()
            .map_or("none".to_string(), ToString::to_string),
    ));
    for gap in &replay.unobserved {
        rows.push(("unobserved".into(), gap.to_string()));
    }
    if let Value::Object(meta) = &facts["meta"] {
        for (k, v) in meta {
            let v = match (k.as_str(), v.as_f64()) {
                ("started", Some(t)) => utc(t),
                _ => v.as_str().map_or_else(|| v.to_string(), str::to_string),
            };
            rows.push((k.clone(), v));
        }
    }
    let width = rows
        .iter()
        .map(|(k, _)| k.chars().count())
        .max()
        .unwrap_or(0);
    let lines: Vec<String> = rows
        .iter()
        .map(|(k, v)| format!("{k:<width$}  {v}"))
        .collect();
    io.print(&lines.join("\n"))
}

/// Seconds since the epoch as a UTC date and time (`2026-12-02 07:05:31 UTC`).
fn utc(secs: f64) -> String {
    if !secs.is_finite() || secs < 0.0 {
        return secs.to_string();
    }
    #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]
    let t = secs as u64;
    let (days, rest) = (t / 86_400, t % 86_400);
    // Days to a civil date (Howard Hinnant's algorithm), for days since 1970-01-01.
    #[allow(clippy::cast_possible_wrap)]
    let z = days as i64 + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    format!(
        "{year:04}-{month:02}-{day:02} {:02}:{:02}:{:02} UTC",
        rest / 3600,
        rest % 3600 / 60,
        rest % 60
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run_capture(args: &[&str]) -> (i32, String, String) {
        let (mut out, mut err) = (Vec::new(), Vec::new());
        let mut argv = vec!["neuraldbg"];
        argv.extend_from_slice(args);
        let code = run_with(argv, &mut out, &mut err, false);
        (
            code,
            String::from_utf8(out).unwrap(),
            String::from_utf8(err).unwrap(),
        )
    }

    #[test]
    fn help_lists_subcommands_and_exit_codes() {
        let (code, out, _) = run_capture(&["--help"]);
        assert_eq!(code, 0);
        for word in [
            "explain",
            "events",
            "export",
            "info",
            "watch",
            "Exit codes",
            "--strict",
        ] {
            assert!(out.contains(word), "{word} missing from:\n{out}");
        }
        let (code, out, _) = run_capture(&["events", "--help"]);
        assert_eq!(code, 0);
        assert!(
            out.contains("VANISHING") && out.contains("gradient_health"),
            "{out}"
        );
    }

    #[test]
    fn bad_arguments_are_usage_errors() {
        let (code, _, err) = run_capture(&["explain"]);
        assert_eq!(code, EXIT_USAGE, "{err}");
        let (code, _, err) = run_capture(&["events", "x.ndbg", "--kind", "VANISHNG"]);
        assert_eq!(code, EXIT_USAGE);
        assert!(err.contains("VANISHING"), "a suggestion is expected: {err}");
        let (code, _, err) = run_capture(&["export", "x.ndbg", "--format", "tensorboard"]);
        assert_eq!(code, EXIT_USAGE);
        assert!(err.contains("-o DIR"), "{err}");
    }

    #[test]
    fn missing_and_foreign_files_are_unreadable() {
        let (code, out, err) = run_capture(&["explain", "/nonexistent/run.ndbg"]);
        assert_eq!(code, EXIT_UNREADABLE);
        assert!(out.is_empty());
        assert!(
            err.contains("/nonexistent/run.ndbg") && err.contains("No such file"),
            "{err}"
        );
        let manifest = concat!(env!("CARGO_MANIFEST_DIR"), "/Cargo.toml");
        let (code, _, err) = run_capture(&["info", manifest]);
        assert_eq!(code, EXIT_UNREADABLE);
        assert!(err.contains("not a NeuralDBG trace"), "{err}");
    }
}
