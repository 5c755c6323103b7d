#![allow(clippy::unwrap_used)] // a test crate: a failed unwrap is a failed test
//! The command on real traces: same diagnosis as the live engine, exit codes, damage handling,
//! exports.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU32, Ordering};

use neuraldbg_cli::{EXIT_DAMAGED, EXIT_NEWER, EXIT_OK, EXIT_UNREADABLE, EXIT_USAGE, run_with};
use neuraldbg_core::analysis::Analysis;
use neuraldbg_core::output::{events_json, hypotheses_json};
use neuraldbg_core::trace::{TraceWriter, WriterOptions};
use neuraldbg_core::{Config, Engine, ModelSpec, Observation, Reduce};
use serde_json::{Map, Value};

fn temp_dir() -> PathBuf {
    static N: AtomicU32 = AtomicU32::new(0);
    let dir = std::env::temp_dir().join(format!(
        "ndbg-cli-test-{}-{}",
        std::process::id(),
        N.fetch_add(1, Ordering::Relaxed)
    ));
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

fn spec(depth: usize) -> ModelSpec {
    let mut spec = ModelSpec::default();
    for i in 0..depth {
        let fc = spec.module(format!("fc{i}"), "Linear");
        spec.param(fc, format!("fc{i}.weight"), &[16, 16]);
        spec.module(format!("act{i}"), "Tanh");
    }
    spec.module("", "Net");
    spec.optimizer = Some("SGD".into());
    spec
}

/// Gradients vanish in the first layers from step 10, then the last layer goes NaN.
fn observation(depth: usize, step: u64) -> Observation {
    Observation {
        step,
        grad_norms: (0..depth)
            .map(|l| match (step, l) {
                (s, l) if s >= 35 && l == depth - 1 => f32::NAN,
                (s, l) if s >= 10 && l < 2 => 1e-9,
                _ => 0.05,
            })
            .collect(),
        activations: Some(
            (0..depth)
                .flat_map(|_| [0.8, 0.1, f32::NAN, 0.5, 32.0])
                .collect(),
        ),
        inputs: vec![-3.0, 3.0, 0.0, 1.0],
        loss: Some(1.0),
        lr: Some(0.01),
        ..Observation::default()
    }
}

/// Writes a trace of a failing run; returns its path and the live engine.
fn failing_trace(dir: &Path) -> (PathBuf, Engine) {
    let depth = 4;
    let path = dir.join("run.ndbg");
    let mut live = Engine::new(Config::default()).unwrap();
    live.register_model(spec(depth)).unwrap();
    let mut w = TraceWriter::create(&path, Map::new(), WriterOptions::default()).unwrap();
    w.write_header(live.config(), &spec(depth)).unwrap();
    for step in 0..40 {
        let obs = observation(depth, step);
        live.observe(&obs.view()).unwrap();
        w.write_step(&obs.view()).unwrap();
    }
    w.close().unwrap();
    (path, live)
}

fn cli(args: &[&str]) -> (i32, String, String) {
    let (mut out, mut err) = (Vec::new(), Vec::new());
    let argv = std::iter::once("neuraldbg").chain(args.iter().copied());
    let code = run_with(argv, &mut out, &mut err, false);
    (
        code,
        String::from_utf8(out).unwrap(),
        String::from_utf8(err).unwrap(),
    )
}

#[test]
fn explain_and_events_are_the_live_engine_s() {
    let dir = temp_dir();
    let (path, live) = failing_trace(&dir);
    let p = path.to_str().unwrap();
    let analysis = Analysis::new(&live).unwrap();
    let hypotheses = analysis.hypotheses(None);
    assert!(hypotheses.len() >= 2);

    let (code, out, err) = cli(&["explain", p, "--json"]);
    assert_eq!(code, EXIT_OK, "{err}");
    let got: Value = serde_json::from_str(&out).unwrap();
    assert_eq!(got, hypotheses_json(&live, &hypotheses));
    assert!(err.is_empty(), "a clean trace gives no warning: {err}");

    let (_, out, err) = cli(&["explain", p]);
    assert_eq!(out.lines().count(), hypotheses.len());
    assert!(out.starts_with(&format!("[{:.2}] ", hypotheses[0].confidence)));
    assert!(err.is_empty(), "a failure needs no note: {err}");

    let (_, out, _) = cli(&["events", p, "--json"]);
    let got: Value = serde_json::from_str(&out).unwrap();
    assert_eq!(got, events_json(&live, &live.events()));

    let (_, out, _) = cli(&["events", p, "--kind", "NON_FINITE", "--layer", "fc3"]);
    assert_eq!(out.lines().count(), 1, "{out}");
    assert!(
        out.contains("fc3  gradient_health: HEALTHY -> NON_FINITE"),
        "{out}"
    );
    let (_, out, _) = cli(&["events", p, "--kind", "gradient_health", "--json"]);
    let n = serde_json::from_str::<Value>(&out)
        .unwrap()
        .as_array()
        .unwrap()
        .len();
    assert_eq!(n, 3, "fc0 and fc1 vanish, fc3 goes NaN");

    let (code, _, err) = cli(&["events", p, "--layer", "fc9"]);
    assert_eq!(code, EXIT_USAGE);
    assert!(err.contains("fc9") && err.contains("fc0"), "{err}");
    std::fs::remove_dir_all(dir).unwrap();
}

#[test]
fn exports_write_json_mermaid_and_tensorboard_records() {
    let dir = temp_dir();
    let (path, live) = failing_trace(&dir);
    let p = path.to_str().unwrap();

    let out_json = dir.join("out/x.json");
    let (code, _, err) = cli(&[
        "export",
        p,
        "--format",
        "json",
        "-o",
        out_json.to_str().unwrap(),
    ]);
    assert_eq!(code, EXIT_OK, "{err}");
    let doc: Value = serde_json::from_str(&std::fs::read_to_string(&out_json).unwrap()).unwrap();
    assert_eq!(doc["events"], events_json(&live, &live.events()));
    let (steps, _) = live
        .history(Some("fc2"), "grad_norm", Reduce::Last)
        .unwrap();
    assert_eq!(
        doc["history"]["layers"]["fc2"]["grad_norm"]["steps"],
        serde_json::json!(steps)
    );
    assert_eq!(doc["history"]["run"]["loss"]["values"][0], 1.0);
    assert_eq!(doc["trace"]["steps"], 40);

    let (_, out, _) = cli(&["export", p, "--format", "mermaid"]);
    assert_eq!(out.trim_end(), Analysis::new(&live).unwrap().mermaid());

    let tb = dir.join("tb");
    let (code, _, err) = cli(&["export", p, "-f", "tensorboard", "-o", tb.to_str().unwrap()]);
    assert_eq!(code, EXIT_OK, "{err}");
    let files: Vec<_> = std::fs::read_dir(&tb).unwrap().collect();
    assert_eq!(files.len(), 1);
    let file = files[0].as_ref().unwrap().path();
    assert!(
        file.file_name()
            .unwrap()
            .to_str()
            .unwrap()
            .contains("tfevents")
    );
    // TFRecord framing with masked CRC32C, record after record to the end of the file.
    let bytes = std::fs::read(&file).unwrap();
    let mask = |d: &[u8]| crc32c::crc32c(d).rotate_right(15).wrapping_add(0xa282_ead8);
    let mut rest = &bytes[..];
    let mut records = 0;
    while !rest.is_empty() {
        let len = u64::from_le_bytes(rest[..8].try_into().unwrap()) as usize;
        assert_eq!(rest[8..12], mask(&rest[..8]).to_le_bytes());
        assert_eq!(
            rest[12 + len..16 + len],
            mask(&rest[12..12 + len]).to_le_bytes()
        );
        rest = &rest[16 + len..];
        records += 1;
    }
    assert!(records > 40, "one event per step at least: {records}");
    // Exporting again replaces the same file.
    cli(&["export", p, "-f", "tensorboard", "-o", tb.to_str().unwrap()]);
    assert_eq!(std::fs::read_dir(&tb).unwrap().count(), 1);
    std::fs::remove_dir_all(dir).unwrap();
}

#[test]
fn damaged_newer_and_empty_traces() {
    let dir = temp_dir();
    let (path, _) = failing_trace(&dir);
    let bytes = std::fs::read(&path).unwrap();

    // A flipped byte near the end: everything before is used, the warning says where, and
    // --strict makes it exit code 5.
    let mut damaged = bytes.clone();
    let at = damaged.len() - 300;
    damaged[at] ^= 0x55;
    let bad = dir.join("damaged.ndbg");
    std::fs::write(&bad, &damaged).unwrap();
    let b = bad.to_str().unwrap();
    let (code, out, err) = cli(&["info", b, "--json"]);
    assert_eq!(code, EXIT_OK);
    assert!(err.contains("warning") && err.contains("checksum"), "{err}");
    let info: Value = serde_json::from_str(&out).unwrap();
    let offset = info["damage"]["offset"].as_u64().unwrap();
    assert!(offset <= at as u64 && at as u64 - offset < 1000);
    assert!(info["steps"].as_u64().unwrap() < 40);
    let (code, out, _) = cli(&["--strict", "explain", b]);
    assert_eq!(code, EXIT_DAMAGED);
    assert!(!out.is_empty(), "the recovered part is still explained");

    // A version from the future.
    let mut newer = bytes[..16].to_vec();
    newer[8] = 9;
    let crc = crc32c::crc32c(&newer[..12]);
    newer[12..].copy_from_slice(&crc.to_le_bytes());
    let future = dir.join("future.ndbg");
    std::fs::write(&future, &newer).unwrap();
    let (code, _, err) = cli(&["explain", future.to_str().unwrap()]);
    assert_eq!(code, EXIT_NEWER);
    assert!(
        err.contains("version 9") && err.contains("upgrade"),
        "{err}"
    );

    // Only a preamble: the run never got to a step.
    let empty = dir.join("empty.ndbg");
    std::fs::write(&empty, &bytes[..16]).unwrap();
    let (code, _, err) = cli(&["explain", empty.to_str().unwrap()]);
    assert_eq!(code, EXIT_UNREADABLE);
    assert!(err.contains("no model header"), "{err}");

    // A directory is not a trace.
    let (code, _, err) = cli(&["events", dir.to_str().unwrap()]);
    assert_eq!(code, EXIT_UNREADABLE);
    assert!(err.contains("directory"), "{err}");
    std::fs::remove_dir_all(dir).unwrap();
}

/// This machine's name, as `neuraldbg watch` reads it.
fn hostname() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .unwrap()
        .trim()
        .to_string()
}

/// Writes the failing run of [`failing_trace`] step by step from another thread, as a training
/// process would, with `meta` in the header; closes the trace at the end when `close`.
fn write_slowly(
    path: PathBuf,
    meta: Map<String, Value>,
    close: bool,
) -> std::thread::JoinHandle<()> {
    std::thread::spawn(move || {
        let depth = 4;
        let mut w = TraceWriter::create(&path, meta, WriterOptions::default()).unwrap();
        std::thread::sleep(std::time::Duration::from_millis(50));
        w.write_header(&Config::default(), &spec(depth)).unwrap();
        for step in 0..40 {
            w.write_step(&observation(depth, step).view()).unwrap();
            std::thread::sleep(std::time::Duration::from_millis(3));
        }
        if close {
            w.close().unwrap();
        } else {
            // A killed process closes nothing: the file ends after its last step.
            std::mem::forget(w);
        }
    })
}

#[cfg(target_os = "linux")]
#[test]
fn watch_plain_follows_a_trace_being_written() {
    let dir = temp_dir();
    let path = dir.join("live.ndbg");
    let mut meta = Map::new();
    meta.insert("pid".into(), std::process::id().into());
    meta.insert("host".into(), hostname().into());
    meta.insert("model".into(), "Net".into());
    // The watcher starts before the file exists.
    let writer = write_slowly(path.clone(), meta, true);
    let p = path.to_str().unwrap();
    let (code, out, err) = cli(&["watch", p, "--plain", "--interval", "0.01"]);
    writer.join().unwrap();
    assert_eq!(code, EXIT_OK, "{err}");
    assert!(
        err.contains("watching") && err.contains("4 layers"),
        "{err}"
    );
    // One line per event (in the order they were confirmed), then the verdict: the same
    // lines `events` and `explain` print from the finished trace.
    let (_, events, _) = cli(&["events", p]);
    let (_, verdict, _) = cli(&["explain", p]);
    let mut lines: Vec<&str> = out.lines().collect();
    let tail = lines.split_off(lines.len() - verdict.lines().count());
    assert_eq!(tail, verdict.lines().collect::<Vec<_>>());
    let mut sorted = lines.clone();
    sorted.sort_unstable();
    let mut expected: Vec<&str> = events.lines().collect();
    expected.sort_unstable();
    assert!(!expected.is_empty());
    assert_eq!(sorted, expected);
    std::fs::remove_dir_all(dir).unwrap();
}

#[cfg(target_os = "linux")]
#[test]
fn watch_plain_says_when_the_writer_was_killed() {
    let dir = temp_dir();
    let path = dir.join("killed.ndbg");
    // A process that has exited: the trace it "wrote" was never closed.
    let mut child = std::process::Command::new("true").spawn().unwrap();
    let pid = child.id();
    child.wait().unwrap();
    let mut meta = Map::new();
    meta.insert("pid".into(), pid.into());
    meta.insert("host".into(), hostname().into());
    write_slowly(path.clone(), meta, false).join().unwrap();
    let (code, out, err) = cli(&["watch", path.to_str().unwrap(), "--interval", "0.01"]);
    assert_eq!(code, EXIT_OK, "{err}");
    assert!(
        err.contains(&format!("process {pid}")) && err.contains("without closing"),
        "{err}"
    );
    assert!(
        out.contains("exploding_gradients") || out.contains("non_finite"),
        "{out}"
    );
    std::fs::remove_dir_all(dir).unwrap();
}

#[test]
fn watch_refuses_a_file_that_is_not_a_trace() {
    let manifest = concat!(env!("CARGO_MANIFEST_DIR"), "/Cargo.toml");
    let (code, _, err) = cli(&["watch", manifest]);
    assert_eq!(code, EXIT_UNREADABLE);
    assert!(err.contains("not a NeuralDBG trace"), "{err}");
    let (code, _, err) = cli(&["watch", manifest, "--interval", "0"]);
    assert_eq!(code, EXIT_USAGE, "{err}");
}

#[test]
fn parquet_export_writes_every_history_row() {
    use parquet::file::reader::{FileReader, SerializedFileReader};
    let dir = temp_dir();
    let (path, live) = failing_trace(&dir);
    let out = dir.join("pq");
    let (code, _, err) = cli(&[
        "export",
        path.to_str().unwrap(),
        "--format",
        "parquet",
        "-o",
        out.to_str().unwrap(),
    ]);
    assert_eq!(code, EXIT_OK, "{err}");
    let rows = |name: &str| {
        let file = std::fs::File::open(out.join(name)).unwrap();
        let n = SerializedFileReader::new(file)
            .unwrap()
            .metadata()
            .file_metadata()
            .num_rows();
        usize::try_from(n).unwrap()
    };
    let table = neuraldbg_core::table::history_table(&live);
    assert!(!table.is_empty());
    assert_eq!(rows("history.parquet"), table.len());
    assert_eq!(rows("events.parquet"), live.events().len());
    let hypotheses = neuraldbg_core::analysis::explain(&live, None);
    assert_eq!(rows("hypotheses.parquet"), hypotheses.len());
    std::fs::remove_dir_all(dir).unwrap();
}

/// The run of [`observation`] for `steps` steps (fewer than 35: gradients vanish, nothing goes
/// NaN), written to `dir/name` with `meta` in the header; closed when `close`.
fn run_trace(dir: &Path, name: &str, steps: u64, meta: Map<String, Value>, close: bool) -> PathBuf {
    let path = dir.join(name);
    let mut w = TraceWriter::create(&path, meta, WriterOptions::default()).unwrap();
    w.write_header(&Config::default(), &spec(4)).unwrap();
    for step in 0..steps {
        w.write_step(&observation(4, step).view()).unwrap();
    }
    if close {
        w.close().unwrap();
    } else {
        std::mem::forget(w);
    }
    path
}

#[test]
fn two_writers_of_one_file_leave_an_unreadable_trace_and_explain_says_so() {
    // Two ranks of a torchrun job with distributed="off" and one trace path, as a user ran
    // it: both create the file and append to it; no step survives.
    let dir = temp_dir();
    let path = dir.join("x.ndbg");
    let rank = |r: u32| {
        let mut meta = Map::new();
        meta.insert("rank".into(), r.into());
        meta.insert(
            "host".into(),
            format!("node-{}", "x".repeat((1 - r) as usize * 7)).into(),
        );
        meta
    };
    let mut a = TraceWriter::create(&path, rank(0), WriterOptions::default()).unwrap();
    let mut b = TraceWriter::create(&path, rank(1), WriterOptions::default()).unwrap();
    for w in [&mut a, &mut b] {
        w.write_header(&Config::default(), &spec(4)).unwrap();
    }
    // Rank 1 runs ahead; rank 0's steps then land inside rank 1's records.
    for w in [&mut b, &mut a] {
        for step in 0..5 {
            w.write_step(&observation(4, step).view()).unwrap();
        }
    }
    let p = path.to_str().unwrap();
    let (code, out, err) = cli(&["explain", p]);
    assert_eq!(code, EXIT_UNREADABLE, "{out}{err}");
    assert!(
        err.contains("before its first step") && err.contains("trace_rank=None"),
        "{err}"
    );
    assert!(!err.contains("no step before"), "{err}");
    // `info` still describes the damage.
    let (code, out, _) = cli(&["info", p]);
    assert_eq!(code, EXIT_OK);
    assert!(out.contains("the trace is damaged"), "{out}");
    std::fs::remove_dir_all(dir).unwrap();
}

#[cfg(target_os = "linux")]
#[test]
fn a_trace_still_being_written_is_not_called_crashed() {
    let dir = temp_dir();
    let mut meta = Map::new();
    meta.insert("pid".into(), std::process::id().into()); // this process: alive
    meta.insert("host".into(), hostname().into());
    meta.insert("world_size".into(), 2.into());
    meta.insert("started".into(), 1_764_658_800.5.into());
    let p = run_trace(&dir, "live.ndbg", 20, meta, false);
    let p = p.to_str().unwrap();
    for cmd in ["explain", "info"] {
        let (code, out, err) = cli(&[cmd, p]);
        assert_eq!(code, EXIT_OK, "{err}");
        let all = format!("{out}{err}");
        assert!(
            all.contains("still being written")
                && all.contains(&format!("process {}", std::process::id())),
            "{all}"
        );
        assert!(!all.contains("crashed"), "{all}");
    }
    // `info` keeps its columns whatever the key, and shows when the run started.
    let (_, out, _) = cli(&["info", p]);
    let column = |key: &str| {
        let line = out.lines().find(|l| l.starts_with(key)).unwrap();
        line.len() - line[key.len()..].trim_start().len()
    };
    assert_eq!(column("world_size"), column("trace"), "{out}");
    assert_eq!(column("started"), column("closed"), "{out}");
    assert!(out.contains("2025-12-02 07:00:00 UTC"), "{out}");
    std::fs::remove_dir_all(dir).unwrap();
}

#[test]
fn watch_plain_ends_on_a_text_file_and_on_a_run_closed_before_its_first_step() {
    let dir = temp_dir();
    let text = dir.join("text.ndbg");
    std::fs::write(&text, "hello world\n").unwrap(); // 12 bytes, shorter than a preamble
    let (code, _, err) = cli(&[
        "watch",
        text.to_str().unwrap(),
        "--plain",
        "--interval",
        "0.01",
    ]);
    assert_eq!(code, EXIT_UNREADABLE, "{err}");
    assert!(err.contains("not a NeuralDBG trace"), "{err}");

    // A run that ended without a step: its writer closes a trace with no header.
    let none = dir.join("none.ndbg");
    let mut w = TraceWriter::create(&none, Map::new(), WriterOptions::default()).unwrap();
    w.close().unwrap();
    let (code, out, err) = cli(&[
        "watch",
        none.to_str().unwrap(),
        "--plain",
        "--interval",
        "0.01",
    ]);
    assert_eq!(code, EXIT_OK, "{err}");
    assert!(out.contains("no training step"), "{out}");
    let (code, _, err) = cli(&["explain", none.to_str().unwrap()]);
    assert_eq!(code, EXIT_UNREADABLE);
    assert!(err.contains("no model header"), "{err}");
    std::fs::remove_dir_all(dir).unwrap();
}

#[test]
fn weaker_signals_alone_are_said_not_to_be_a_failure() {
    // A run that learns with gradient norms a little above 1 throughout: the seed's SATURATED
    // band, a warning the engine weighs low.
    let dir = temp_dir();
    let path = dir.join("healthy.ndbg");
    let mut live = Engine::new(Config::default()).unwrap();
    live.register_model(spec(4)).unwrap();
    let mut w = TraceWriter::create(&path, Map::new(), WriterOptions::default()).unwrap();
    w.write_header(live.config(), &spec(4)).unwrap();
    for step in 0..60 {
        let obs = Observation {
            step,
            grad_norms: vec![2.0; 4],
            loss: Some(2.0 / (1.0 + step as f64 / 10.0)),
            lr: Some(0.01),
            ..Observation::default()
        };
        live.observe(&obs.view()).unwrap();
        w.write_step(&obs.view()).unwrap();
    }
    w.close().unwrap();
    let hypotheses = neuraldbg_core::analysis::explain(&live, None);
    assert!(
        !hypotheses.is_empty(),
        "the run has a weaker signal to list"
    );
    assert!(
        hypotheses.iter().all(|h| h.confidence < 0.5),
        "{hypotheses:?}"
    );

    let (code, out, err) = cli(&["explain", path.to_str().unwrap()]);
    assert_eq!(code, EXIT_OK);
    assert_eq!(out.lines().count(), hypotheses.len(), "still listed");
    assert!(
        err.contains(
            "no failure found in 60 observed steps (no hypothesis reaches confidence 0.5); weaker signals:"
        ),
        "{err}"
    );
    let only = hypotheses[0].failure.to_string();
    let (_, _, err) = cli(&["explain", path.to_str().unwrap(), "--failure", &only]);
    assert!(
        err.contains(&format!("no {only} found in 60 observed steps")),
        "{err}"
    );
    std::fs::remove_dir_all(dir).unwrap();
}

#[test]
fn explain_for_a_failure_the_run_does_not_have_says_what_it_has() {
    let dir = temp_dir();
    let p = run_trace(&dir, "vanishing.ndbg", 30, Map::new(), true);
    let (code, out, err) = cli(&[
        "explain",
        p.to_str().unwrap(),
        "--failure",
        "exploding_gradients",
    ]);
    assert_eq!(code, EXIT_OK);
    assert!(out.is_empty(), "{out}");
    assert!(
        err.contains("no exploding_gradients found in 30 observed steps")
            && err.contains("what was found: vanishing_gradients"),
        "{err}"
    );
    // Event kinds in any case; `export --help` names every format.
    let (code, upper, _) = cli(&["events", p.to_str().unwrap(), "--kind", "VANISHING"]);
    assert_eq!(code, EXIT_OK);
    let (code, lower, err) = cli(&["events", p.to_str().unwrap(), "--kind", "vanishing"]);
    assert_eq!(code, EXIT_OK, "{err}");
    assert!(!upper.is_empty());
    assert_eq!(upper, lower);
    let (_, help, _) = cli(&["export", "--help"]);
    assert!(help.lines().next().unwrap().contains("Parquet"), "{help}");
    std::fs::remove_dir_all(dir).unwrap();
}

#[test]
fn steps_not_observed_are_recorded_and_reported() {
    let dir = temp_dir();
    let path = dir.join("gap.ndbg");
    let mut w = TraceWriter::create(&path, Map::new(), WriterOptions::default()).unwrap();
    w.write_header(&Config::default(), &spec(4)).unwrap();
    for step in 0..8 {
        w.write_step(&observation(4, step).view()).unwrap();
    }
    let why =
        "rank 1 left its `with NeuralDbg(...)` block after step 8 (it raised KeyError('planted'))";
    w.write_unobserved(&neuraldbg_core::trace::Unobserved {
        first: 8,
        last: Some(19),
        reason: why.into(),
    })
    .unwrap();
    w.close().unwrap();
    let p = path.to_str().unwrap();
    let (code, out, err) = cli(&["info", p]);
    assert_eq!(code, EXIT_OK, "{err}");
    assert!(
        out.contains(&format!("steps 8 to 19 were not observed: {why}")),
        "{out}"
    );
    assert!(out.contains("closed      yes"), "{out}");
    let (code, _, err) = cli(&["explain", p]);
    assert_eq!(code, EXIT_OK);
    assert!(err.contains("steps 8 to 19 were not observed"), "{err}");
    std::fs::remove_dir_all(dir).unwrap();
}

#[test]
fn tensorboard_scalars_carry_the_time_their_step_was_written() {
    let dir = temp_dir();
    let path = dir.join("timed.ndbg");
    let mut meta = Map::new();
    meta.insert("started".into(), 1_000.0.into()); // long before: not what the steps get
    let mut w = TraceWriter::create(&path, meta, WriterOptions::default()).unwrap();
    w.write_header(&Config::default(), &spec(4)).unwrap();
    w.write_step(&observation(4, 0).view()).unwrap();
    std::thread::sleep(std::time::Duration::from_millis(1100));
    for step in 1..3 {
        w.write_step(&observation(4, step).view()).unwrap();
    }
    w.close().unwrap();
    let tb = dir.join("tb");
    let (code, _, err) = cli(&[
        "export",
        path.to_str().unwrap(),
        "-f",
        "tensorboard",
        "-o",
        tb.to_str().unwrap(),
    ]);
    assert_eq!(code, EXIT_OK, "{err}");
    let file = std::fs::read_dir(&tb)
        .unwrap()
        .next()
        .unwrap()
        .unwrap()
        .path();
    let bytes = std::fs::read(file).unwrap();
    // Each record's Event starts with its wall_time (field 1, a double: tag byte 0x09).
    let mut rest = &bytes[..];
    let mut times = Vec::new();
    while !rest.is_empty() {
        let len = u64::from_le_bytes(rest[..8].try_into().unwrap()) as usize;
        let data = &rest[12..12 + len];
        assert_eq!(data[0], 0x09);
        times.push(f64::from_le_bytes(data[1..9].try_into().unwrap()));
        rest = &rest[16 + len..];
    }
    let (version, steps) = times.split_first().unwrap();
    assert!((version - 1_000.0).abs() < 1e-9, "{times:?}");
    assert!(steps.len() >= 3, "{times:?}");
    assert!(steps[0] > 1_700_000_000.0, "{times:?}");
    assert!(steps[1] - steps[0] >= 1.0, "{times:?}");
    std::fs::remove_dir_all(dir).unwrap();
}

/// Writes the failing run's trace with every step healthy (same model, same loss).
fn healthy_trace(dir: &Path) -> PathBuf {
    let depth = 4;
    let path = dir.join("healthy.ndbg");
    let mut w = TraceWriter::create(&path, Map::new(), WriterOptions::default()).unwrap();
    w.write_header(&Config::default(), &spec(depth)).unwrap();
    for step in 0..40 {
        let mut obs = observation(depth, step);
        obs.grad_norms = vec![0.05; depth];
        w.write_step(&obs.view()).unwrap();
    }
    w.close().unwrap();
    path
}

#[test]
fn diff_names_the_step_and_layer_where_two_runs_part() {
    let dir = temp_dir();
    let (bad, _) = failing_trace(&dir);
    let good = healthy_trace(&dir);
    let (good, bad) = (good.to_str().unwrap(), bad.to_str().unwrap());
    let (code, out, err) = cli(&["diff", good, bad, "--json"]);
    assert_eq!(code, EXIT_OK, "{err}");
    let v: Value = serde_json::from_str(&out).unwrap();
    // The planted vanishing begins at step 10 in the first two layers.
    let part = &v["parting"];
    assert_eq!(part["step"], 10, "{out}");
    assert!(
        ["fc0", "fc1"].contains(&part["layer"].as_str().unwrap()),
        "{out}"
    );
    assert_eq!(part["a"], "HEALTHY");
    assert_eq!(part["b"], "VANISHING");
    assert!(v["only_a"].as_array().unwrap().is_empty());
    assert!(
        v["only_b"]
            .as_array()
            .unwrap()
            .iter()
            .any(|e| e["to_state"] == "NON_FINITE")
    );
    assert!(v["loss_parting_step"].is_null(), "both losses are 1.0");
    let (code, out, _) = cli(&["diff", bad, bad]);
    assert_eq!(code, EXIT_OK);
    assert!(out.contains("Health never differs"), "{out}");
    let (code, _, err) = cli(&["run", "train.py"]);
    assert_eq!(code, EXIT_USAGE);
    assert!(err.contains("python -m neuraldbg run"), "{err}");
}
