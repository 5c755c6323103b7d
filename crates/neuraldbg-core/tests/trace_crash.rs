#![allow(clippy::unwrap_used)] // a test crate: a failed unwrap is a failed test
//! A writer process killed (SIGKILL) at random moments, many of them in the middle of a record: the
//! trace always reads back every step the process had finished writing, exactly, and nothing
//! after the torn record.

use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Instant;

use neuraldbg_core::trace::{
    DamageKind, Record, SyncPolicy, TraceReader, TraceWriter, WriterOptions,
};
use neuraldbg_core::{Config, ModelSpec, Observation};
use serde_json::Map;

const CHILD_ENV: &str = "NDBG_TRACE_CRASH_CHILD";
/// Input statistics per step: large records (1 MB) take long enough to write that kills often
/// land inside one.
const INPUTS: usize = 1 << 18;

fn spec() -> ModelSpec {
    let mut spec = ModelSpec::default();
    let big = spec.module("big", "Linear");
    spec.param(big, "big.weight", &[1, 1]);
    spec.module("", "Net");
    spec
}

/// The observation the child writes at `step`: the parent checks every value it reads back.
fn observation(step: u64) -> Observation {
    Observation {
        step,
        grad_norms: vec![0.1],
        inputs: (0..INPUTS).map(|i| i as f32).collect(),
        loss: Some(step as f64),
        ..Observation::default()
    }
}

/// The child: writes steps forever, telling the parent (stdout) after each one.
fn child(path: &Path) {
    let mut w = TraceWriter::create(
        path,
        Map::new(),
        WriterOptions {
            sync: SyncPolicy::OnClose,
        },
    )
    .unwrap();
    w.write_header(&Config::default(), &spec()).unwrap();
    let mut out = std::io::stdout().lock();
    let mut obs = observation(0);
    for step in 0.. {
        obs.step = step;
        obs.loss = Some(step as f64);
        w.write_step(&obs.view()).unwrap();
        writeln!(out, "{step}").unwrap();
        out.flush().unwrap();
    }
}

fn temp_dir() -> PathBuf {
    std::env::temp_dir().join(format!("ndbg-crash-test-{}", std::process::id()))
}

#[test]
fn sigkill_at_random_moments_leaves_every_finished_step_readable() {
    if let Some(path) = std::env::var_os(CHILD_ENV) {
        child(Path::new(&path));
        return;
    }
    let dir = temp_dir();
    let mut torn = 0;
    let rounds = 16u64;
    for round in 0..rounds {
        let path = dir.join(format!("killed-{round}.ndbg"));
        let mut proc = Command::new(std::env::current_exe().unwrap())
            .args([
                "--exact",
                "sigkill_at_random_moments_leaves_every_finished_step_readable",
                "--nocapture",
                "--test-threads=1",
            ])
            .env(CHILD_ENV, &path)
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        // Time a few steps, then kill late in a step's cycle, where its record is written
        // (encoding it comes first): about a third of the kills tear a record.
        let mut lines = BufReader::new(proc.stdout.take().unwrap()).lines();
        let mut finished = None;
        let mut marks = Vec::new();
        while marks.len() < 4 {
            let line = lines.next().unwrap().unwrap();
            if let Ok(step) = line.trim().parse::<u64>() {
                finished = Some(step);
                marks.push(Instant::now());
            }
        }
        let cycle = (marks[3] - marks[1]) / 2;
        let phase = (round as f64 * 0.618_034).fract();
        std::thread::sleep(cycle.mul_f64(0.8 + 0.25 * phase));
        proc.kill().unwrap(); // SIGKILL on Unix
        proc.wait().unwrap();
        // The last step the child reported as written before it was killed.
        let finished = lines
            .map_while(Result::ok)
            .filter_map(|l| l.trim().parse::<u64>().ok())
            .last()
            .or(finished)
            .unwrap();

        // Every recovered step is exactly what was written, and no step the child finished is
        // missing. (Replaying into the engine is tested on small traces in trace.rs.)
        let mut reader = TraceReader::open(&path).unwrap();
        let mut steps = 0;
        for record in reader.by_ref() {
            if let Record::Step(obs) = record {
                assert!(
                    obs == observation(steps),
                    "round {round}: step {steps} differs"
                );
                steps += 1;
            }
        }
        assert!(!reader.closed());
        assert!(
            steps > finished,
            "round {round}: {steps} steps read, step {finished} was finished"
        );
        if let Some(d) = reader.damage() {
            assert!(
                matches!(d.kind, DamageKind::Truncated { .. }),
                "round {round}: a kill can only cut the last record short: {d}"
            );
            torn += 1;
        }
        std::fs::remove_file(&path).unwrap();
    }
    std::fs::remove_dir_all(&dir).unwrap();
    // Timing decides how many kills land inside a record; shown with --nocapture.
    eprintln!("{torn} of {rounds} kills tore a record");
}
