#![allow(clippy::unwrap_used)] // a test crate: a failed unwrap is a failed test
//! Traces: exact replay, and recovery from truncation and corruption at every byte.

use std::path::PathBuf;
use std::sync::atomic::{AtomicU32, Ordering};

use neuraldbg_core::analysis::Analysis;
use neuraldbg_core::output::{events_json, hypotheses_json, root_causes_json};
use neuraldbg_core::trace::{
    DamageKind, Record, Replay, SyncPolicy, TraceError, TraceReader, TraceWriter, WriterOptions,
};
use neuraldbg_core::{
    ACTIVATION_STATS, Config, Engine, Fact, FirstBatch, LossSpec, ModelSpec, Observation, Reduce,
};
use proptest::prelude::*;
use serde_json::{Map, Value, json};

/// A fresh path in the system's temporary directory (removed by the caller when it matters).
fn temp_path(name: &str) -> PathBuf {
    static N: AtomicU32 = AtomicU32::new(0);
    std::env::temp_dir()
        .join(format!(
            "ndbg-trace-test-{}-{}",
            std::process::id(),
            N.fetch_add(1, Ordering::Relaxed)
        ))
        .join(name)
}

/// `depth` Linear + activation blocks and the root, in forward order.
fn mlp(depth: usize, act: &str) -> ModelSpec {
    let mut spec = ModelSpec::default();
    for i in 0..depth {
        let fc = spec.module(format!("fc{i}"), "Linear");
        spec.param(fc, format!("fc{i}.weight"), &[32, 32]);
        spec.param(fc, format!("fc{i}.bias"), &[32]);
        spec.module(format!("act{i}"), act);
    }
    spec.module("", "Net");
    spec.optimizer = Some("SGD".into());
    spec
}

/// A small deterministic noise source, so failures are reproducible.
struct Lcg(u64);

impl Lcg {
    fn next(&mut self) -> f32 {
        self.0 = self
            .0
            .wrapping_mul(6_364_136_223_846_793_005)
            .wrapping_add(1_442_695_040_888_963_407);
        ((self.0 >> 40) as f32) / ((1u64 << 24) as f32)
    }
}

/// A run of a deep tanh net whose gradients vanish from the bottom up, saturate, and finally
/// go NaN: every kind of array and optional value appears.
fn failing_run(depth: usize, steps: u64, seed: u64) -> Vec<Observation> {
    let mut rng = Lcg(seed);
    (0..steps)
        .map(|step| {
            let decay = if step > 20 { 1e-4f32 } else { 1.0 };
            let grad_norms = (0..depth)
                .flat_map(|l| {
                    let depth_factor = 0.5f32.powf((depth - l) as f32);
                    let g = 0.1 * depth_factor * decay * (0.5 + rng.next());
                    let g = if step >= steps - 5 && l == depth - 1 {
                        f32::NAN
                    } else {
                        g
                    };
                    [g, g * 0.1]
                })
                .collect();
            let sat = if step > 15 { 0.9 } else { 0.05 };
            let activations = (step % 2 == 0).then(|| {
                (0..depth)
                    .flat_map(|_| [0.99, sat + 0.01 * rng.next(), f32::NAN, 0.1, 64.0])
                    .collect::<Vec<f32>>()
            });
            Observation {
                step: step * 2, // gaps are allowed
                grad_norms,
                weight_norms: (step % 5 == 0).then(|| vec![3.0; 2 * depth]),
                activations,
                inputs: vec![-3.0, 3.0, 0.01 * rng.next(), 1.0],
                loss: Some(2.0 - f64::from(rng.next()) * 0.01),
                lr: Some(0.01),
                nonfinite_module: (step >= steps - 5).then_some(2 * depth - 2),
                outputs_checked: step >= steps - 5,
                facts: vec![(Fact::Training, f64::from(u8::from(step % 3 != 0)))],
                measures: Vec::new(),
            }
        })
        .collect()
}

/// Runs the live engine and writes the trace beside it, like the Python binding does.
fn record(path: &PathBuf, spec: &ModelSpec, obs: &[Observation], close: bool) -> Engine {
    let mut live = Engine::new(Config {
        threshold_vanishing: 1.2345e-7,
        ..Config::default()
    })
    .unwrap();
    live.register_model(spec.clone()).unwrap();
    let mut meta = Map::new();
    meta.insert("producer".into(), json!("trace tests"));
    let mut writer = TraceWriter::create(path, meta, WriterOptions::default()).unwrap();
    writer.write_header(live.config(), spec).unwrap();
    for o in obs {
        live.observe(&o.view()).unwrap();
        writer.write_step(&o.view()).unwrap();
    }
    if close {
        writer.close().unwrap();
    } else {
        std::mem::forget(writer); // as if the process died: no end record
    }
    live
}

/// Everything a user can ask an engine, as JSON.
fn diagnosis(engine: &Engine) -> Value {
    let a = Analysis::new(engine).unwrap();
    let layers: Vec<Value> = engine
        .model()
        .unwrap()
        .layers
        .iter()
        .map(|l| {
            let (s, v) = engine
                .history(Some(&l.name), "grad_norm", Reduce::Last)
                .unwrap();
            json!([s, v.iter().map(|x| x.to_bits()).collect::<Vec<_>>()])
        })
        .collect();
    json!({
        "hypotheses": hypotheses_json(engine, &a.hypotheses(None)),
        "events": events_json(engine, &engine.events()),
        "roots": root_causes_json(engine, &a.root_causes()),
        "mermaid": a.mermaid(),
        "history": layers,
    })
}

#[test]
fn replay_gives_exactly_the_live_diagnosis() {
    let path = temp_path("run.ndbg");
    let spec = mlp(8, "Tanh");
    let obs = failing_run(8, 120, 7);
    let live = record(&path, &spec, &obs, true);
    let live_diag = diagnosis(&live);
    assert!(
        !live_diag["hypotheses"].as_array().unwrap().is_empty(),
        "the run must fail for the test to mean something"
    );
    assert!(live_diag["events"].as_array().unwrap().len() > 3);

    let replay = Replay::read(TraceReader::open(&path).unwrap(), |_| {}).unwrap();
    assert!(replay.damage.is_none());
    assert!(replay.closed);
    assert_eq!(replay.steps, 120);
    assert_eq!(replay.header.meta["producer"], "trace tests");
    assert_eq!(replay.engine.config(), live.config());
    // Debug form: NaN values compare equal there, as they should for an exact replay.
    assert_eq!(
        format!("{:?}", replay.engine.events()),
        format!("{:?}", live.events())
    );
    assert_eq!(diagnosis(&replay.engine), live_diag);
    assert_eq!(replay.bytes, std::fs::metadata(&path).unwrap().len());
    std::fs::remove_dir_all(path.parent().unwrap()).unwrap();
}

#[test]
fn killed_run_without_end_record_still_replays_and_says_so() {
    let path = temp_path("killed.ndbg");
    let spec = mlp(3, "ReLU");
    let obs = failing_run(3, 40, 1);
    let live = record(&path, &spec, &obs, false);
    let replay = Replay::read(TraceReader::open(&path).unwrap(), |_| {}).unwrap();
    assert!(!replay.closed);
    assert!(replay.damage.is_none());
    assert_eq!(diagnosis(&replay.engine), diagnosis(&live));
    std::fs::remove_dir_all(path.parent().unwrap()).unwrap();
}

#[test]
fn empty_runs_header_only_and_no_header() {
    // The model was registered but no step arrived: a valid trace of zero steps.
    let path = temp_path("header-only.ndbg");
    let spec = mlp(2, "Tanh");
    record(&path, &spec, &[], true);
    let replay = Replay::read(TraceReader::open(&path).unwrap(), |_| {}).unwrap();
    assert_eq!(replay.steps, 0);
    assert!(replay.closed && replay.damage.is_none());
    assert_eq!(replay.header.model, spec);

    // Never registered: the file has a preamble and the reader says what that means.
    let path = temp_path("no-header.ndbg");
    TraceWriter::create(&path, Map::new(), WriterOptions::default())
        .unwrap()
        .close()
        .unwrap();
    let err = Replay::read(TraceReader::open(&path).unwrap(), |_| {}).unwrap_err();
    assert!(matches!(err, TraceError::NoModel { .. }), "{err}");
    assert!(err.to_string().contains("no model header"), "{err}");
}

#[test]
fn foreign_missing_newer_and_unwritable_files_are_clear_errors() {
    let dir = temp_path("x");
    let dir = dir.parent().unwrap();
    std::fs::create_dir_all(dir).unwrap();

    let json = dir.join("run.json");
    std::fs::write(&json, b"{\"not\": \"a trace\"}").unwrap();
    let err = TraceReader::open(&json).unwrap_err();
    assert!(matches!(err, TraceError::NotATrace { .. }), "{err}");
    assert!(err.to_string().contains("run.json"), "{err}");

    let err = TraceReader::open(dir.join("missing.ndbg")).unwrap_err();
    assert!(matches!(err, TraceError::Io { .. }), "{err}");
    assert!(err.to_string().contains("missing.ndbg"), "{err}");

    let newer = dir.join("newer.ndbg");
    let mut bytes = neuraldbg_core::trace::MAGIC.to_vec();
    bytes.extend_from_slice(&(neuraldbg_core::trace::VERSION + 1).to_le_bytes());
    bytes.extend_from_slice(&[0, 0]);
    bytes.extend_from_slice(&crc32c::crc32c(&bytes).to_le_bytes());
    std::fs::write(&newer, &bytes).unwrap();
    let err = TraceReader::open(&newer).unwrap_err();
    assert!(
        matches!(
            err,
            TraceError::NewerVersion {
                found: 3,
                supported: 2,
                ..
            }
        ),
        "{err}"
    );
    assert!(err.to_string().contains("upgrade"), "{err}");

    // A regular file where a directory should be: creating the trace fails with the path.
    let blocker = dir.join("file");
    std::fs::write(&blocker, b"").unwrap();
    let err = TraceWriter::create(
        blocker.join("run.ndbg"),
        Map::new(),
        WriterOptions::default(),
    )
    .unwrap_err();
    assert!(matches!(err, TraceError::Io { .. }), "{err}");
    assert!(err.to_string().contains("file"), "{err}");
    let err = TraceWriter::create(dir, Map::new(), WriterOptions::default()).unwrap_err();
    assert!(err.to_string().contains("directory"), "{err}");

    // Directories are created.
    let nested = dir.join("a/b/c/run.ndbg");
    TraceWriter::create(&nested, Map::new(), WriterOptions::default()).unwrap();
    assert!(nested.exists());
    std::fs::remove_dir_all(dir).unwrap();
}

#[test]
fn writer_refuses_steps_out_of_order_and_before_the_header() {
    let path = temp_path("order.ndbg");
    let mut w = TraceWriter::create(
        &path,
        Map::new(),
        WriterOptions {
            sync: SyncPolicy::EveryRecord,
        },
    )
    .unwrap();
    let obs = |step| Observation {
        step,
        grad_norms: vec![0.1; 4],
        ..Observation::default()
    };
    assert!(w.write_step(&obs(0).view()).is_err());
    w.write_header(&Config::default(), &mlp(2, "Tanh")).unwrap();
    assert!(w.write_header(&Config::default(), &mlp(2, "Tanh")).is_err());
    w.write_step(&obs(3).view()).unwrap();
    let err = w.write_step(&obs(3).view()).unwrap_err();
    assert!(err.to_string().contains("step 3"), "{err}");
    w.write_step(&obs(4).view()).unwrap();
    assert_eq!(w.steps(), 2);
    w.close().unwrap();
    let closed_at = w.bytes();
    assert!(w.write_step(&obs(5).view()).is_err());
    w.close().unwrap(); // closing twice is harmless
    drop(w); // and so is dropping a closed writer
    assert_eq!(std::fs::metadata(&path).unwrap().len(), closed_at);
    let replay = Replay::read(TraceReader::open(&path).unwrap(), |_| {}).unwrap();
    assert!(replay.closed);
    assert_eq!(replay.engine.last_step(), Some(4));
}

#[test]
fn sync_policy_from_seconds() {
    use std::time::Duration;
    assert_eq!(SyncPolicy::every(0.0), Some(SyncPolicy::EveryRecord));
    assert_eq!(SyncPolicy::every(f64::INFINITY), Some(SyncPolicy::OnClose));
    assert_eq!(
        SyncPolicy::every(2.5),
        Some(SyncPolicy::Interval(Duration::from_millis(2500)))
    );
    assert_eq!(SyncPolicy::every(-1.0), None);
    assert_eq!(SyncPolicy::every(f64::NAN), None);
}

/// A closed trace of a small failing run, its records, and where each record starts.
fn sample_trace() -> (Vec<u8>, Vec<Record>, Vec<u64>) {
    let path = temp_path("sample.ndbg");
    let spec = mlp(2, "Tanh");
    record(&path, &spec, &failing_run(2, 12, 3), true);
    let bytes = std::fs::read(&path).unwrap();
    std::fs::remove_dir_all(path.parent().unwrap()).unwrap();
    let mut reader = TraceReader::new(&bytes[..], "sample").unwrap();
    let mut records = Vec::new();
    let mut starts = vec![reader.offset()];
    while let Some(r) = reader.next_record() {
        records.push(r);
        starts.push(reader.offset());
    }
    assert!(reader.damage().is_none() && reader.closed());
    assert_eq!(*starts.last().unwrap(), bytes.len() as u64);
    (bytes, records, starts)
}

/// Reads a byte image; returns the records and the damage.
fn read_all(
    bytes: &[u8],
) -> Result<(Vec<Record>, Option<neuraldbg_core::trace::Damage>), TraceError> {
    let mut reader = TraceReader::new(bytes, "image")?;
    let records: Vec<Record> = reader.by_ref().collect();
    Ok((records, reader.damage().cloned()))
}

/// Records compared by their exact debug form (NaN != NaN otherwise).
fn same(a: &[Record], b: &[Record]) -> bool {
    format!("{a:?}") == format!("{b:?}")
}

#[test]
fn truncation_at_every_byte_recovers_every_complete_record() {
    let (bytes, records, starts) = sample_trace();
    for cut in 0..=bytes.len() {
        let image = &bytes[..cut];
        let result = read_all(image);
        if cut < starts[0] as usize {
            let err = result.unwrap_err();
            assert!(
                matches!(
                    err,
                    TraceError::NotATrace { .. } | TraceError::Unrecoverable { .. }
                ),
                "cut {cut}: {err}"
            );
            continue;
        }
        let (got, damage) = result.unwrap();
        // Records that end at or before the cut.
        let complete = starts[1..].iter().filter(|&&e| e <= cut as u64).count();
        assert!(same(&got, &records[..complete]), "cut {cut}");
        let at_boundary = starts.contains(&(cut as u64));
        match damage {
            None => assert!(at_boundary, "cut {cut}: damage not reported"),
            Some(d) => {
                assert!(!at_boundary, "cut {cut}: spurious {d}");
                assert_eq!(d.record, complete as u64, "cut {cut}");
                assert_eq!(d.offset, starts[complete], "cut {cut}");
                assert!(
                    matches!(d.kind, DamageKind::Truncated { .. }),
                    "cut {cut}: {d}"
                );
            }
        }
        // Replay never fails once the header is complete, and never reads past the cut.
        if complete >= 1 {
            let replay = Replay::read(TraceReader::new(image, "image").unwrap(), |_| {}).unwrap();
            assert!(replay.bytes <= cut as u64);
            let steps = records[..complete]
                .iter()
                .filter(|r| matches!(r, Record::Step(_)))
                .count();
            assert_eq!(replay.steps, steps as u64);
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    /// Any single corrupted byte is detected in the record that holds it: everything before is
    /// returned intact, nothing from it or after it is.
    #[test]
    fn a_flipped_byte_is_caught_in_its_own_record(pos_frac in 0.0f64..1.0, mask in 1u8..=255) {
        let (mut bytes, records, starts) = sample_trace_cached();
        let pos = ((bytes.len() as f64) * pos_frac) as usize;
        bytes[pos] ^= mask;
        match read_all(&bytes) {
            Err(_) => prop_assert!(pos < starts[0] as usize),
            Ok((got, damage)) => {
                let hit = starts.iter().rposition(|&s| s as usize <= pos).unwrap();
                prop_assert!(same(&got, &records[..hit]), "pos {}", pos);
                let d = damage.unwrap();
                prop_assert_eq!(d.record, hit as u64);
                prop_assert_eq!(d.offset, starts[hit]);
            }
        }
    }

    /// Several corrupted bytes, or garbage appended: never a panic, and what is returned is
    /// always a prefix of the real records ending before the first corrupted byte.
    #[test]
    fn corruption_never_panics_and_returns_only_a_clean_prefix(
        flips in proptest::collection::vec((0.0f64..1.0, 1u8..=255), 1..8),
        tail in proptest::collection::vec(any::<u8>(), 0..64),
    ) {
        let (mut bytes, records, starts) = sample_trace_cached();
        let clean = bytes.len();
        let mut first = usize::MAX;
        for (frac, mask) in flips {
            let pos = ((clean as f64) * frac) as usize;
            bytes[pos] ^= mask;
            first = first.min(pos);
        }
        bytes.extend_from_slice(&tail);
        if let Ok((got, _)) = read_all(&bytes) {
            let before = starts.iter().rposition(|&s| s as usize <= first).unwrap();
            prop_assert!(got.len() <= before);
            prop_assert!(same(&got, &records[..got.len()]));
        }
        if let Ok(reader) = TraceReader::new(&bytes[..], "image") {
            let _ = Replay::read(reader, |_| {});
        }
    }

    /// Random bytes behind a valid preamble never panic the reader or the replay.
    #[test]
    fn garbage_after_the_preamble_never_panics(body in proptest::collection::vec(any::<u8>(), 0..512)) {
        let (bytes, _, starts) = sample_trace_cached();
        let mut image = bytes[..starts[0] as usize].to_vec();
        image.extend_from_slice(&body);
        if let Ok(reader) = TraceReader::new(&image[..], "image") {
            let _ = Replay::read(reader, |_| {});
        }
    }
}

fn sample_trace_cached() -> (Vec<u8>, Vec<Record>, Vec<u64>) {
    static CACHE: std::sync::OnceLock<(Vec<u8>, Vec<Record>, Vec<u64>)> =
        std::sync::OnceLock::new();
    CACHE.get_or_init(sample_trace).clone()
}

#[test]
fn optional_records_of_later_writers_are_skipped_and_unknown_mandatory_ones_are_damage() {
    let (bytes, records, starts) = sample_trace();
    // Insert a frame of kind `kind` after the header.
    let with = |kind: u8| {
        let mut out = bytes[..starts[1] as usize].to_vec();
        let payload = b"future";
        let mut head = [0u8; 12];
        head[..4].copy_from_slice(&(payload.len() as u32).to_le_bytes());
        head[4] = kind;
        let crc = crc32c::crc32c(&head[..8]);
        head[8..].copy_from_slice(&crc.to_le_bytes());
        out.extend_from_slice(&head);
        out.extend_from_slice(payload);
        out.extend_from_slice(&crc32c::crc32c(payload).to_le_bytes());
        out.extend_from_slice(&bytes[starts[1] as usize..]);
        out
    };
    let (got, damage) = read_all(&with(0x90)).unwrap();
    assert!(damage.is_none());
    assert!(same(&got, &records));
    let (got, damage) = read_all(&with(0x40)).unwrap();
    assert_eq!(got.len(), 1);
    let d = damage.unwrap();
    assert_eq!((d.record, d.offset), (1, starts[1]));
    assert!(d.to_string().contains("unknown record kind 64"), "{d}");
}

#[test]
fn a_step_the_engine_refuses_ends_the_replay_there() {
    let path = temp_path("refused.ndbg");
    let spec = mlp(2, "Tanh");
    let mut w = TraceWriter::create(&path, Map::new(), WriterOptions::default()).unwrap();
    w.write_header(&Config::default(), &spec).unwrap();
    for step in 0..3 {
        // The third step has the wrong number of activation values.
        let acts = if step == 2 { 3 } else { 2 * ACTIVATION_STATS };
        let obs = Observation {
            step,
            grad_norms: vec![0.1; 4],
            activations: Some(vec![0.5; acts]),
            ..Observation::default()
        };
        w.write_step(&obs.view()).unwrap();
    }
    w.close().unwrap();
    let replay = Replay::read(TraceReader::open(&path).unwrap(), |_| {}).unwrap();
    assert_eq!(replay.steps, 2);
    let d = replay.damage.unwrap();
    assert_eq!(
        d.record, 4,
        "header, step 0, its clock record, step 1, step 2"
    );
    assert!(matches!(d.kind, DamageKind::Rejected(_)), "{d}");
    assert!(d.to_string().contains("activations has 3 values"), "{d}");
    std::fs::remove_dir_all(path.parent().unwrap()).unwrap();
}

/// Steps of a 3-layer net whose fc1 gets a real but tiny gradient and whose weight norm never
/// changes while fc0's and fc2's move.
fn quiet_fc1_run(steps: u64) -> Vec<Observation> {
    (0..steps)
        .map(|step| {
            let w = 2.0 + 0.001 * step as f32;
            Observation {
                step,
                grad_norms: vec![0.1, 0.02, 1e-5, 1e-6, 0.1, 0.02],
                weight_norms: Some(vec![w, 0.1, 2.0, 0.1, w, 0.1]),
                loss: Some(2.0 * (-0.01 * step as f64).exp()),
                lr: Some(0.05),
                ..Observation::default()
            }
        })
        .collect()
}

#[test]
fn a_second_optimizers_lrs_survive_writing_and_replay() {
    // The header says what the first optimizer holds (fc0, fc2); from step 5 on a second one
    // steps fc1 at lr 0.05.
    let path = temp_path("amended.ndbg");
    let mut spec = mlp(3, "ReLU");
    spec.param_lr = Some(vec![
        Some(0.05),
        Some(0.05),
        None,
        None,
        Some(0.01),
        Some(0.01),
    ]);
    let second = [None, None, Some(0.05), Some(0.05), Some(0.1), None];
    let merged = vec![
        Some(0.05),
        Some(0.05),
        Some(0.05),
        Some(0.05),
        Some(0.1),
        Some(0.01),
    ];
    let mut live = Engine::new(Config::default()).unwrap();
    live.register_model(spec.clone()).unwrap();
    let mut w = TraceWriter::create(&path, Map::new(), WriterOptions::default()).unwrap();
    w.write_header(live.config(), &spec).unwrap();
    for o in quiet_fc1_run(60) {
        if o.step == 5 {
            assert!(live.amend_param_lr(Some(&second)).unwrap());
            w.write_param_lr(Some(&second)).unwrap();
        }
        live.observe(&o.view()).unwrap();
        w.write_step(&o.view()).unwrap();
    }
    w.close().unwrap();
    assert_eq!(live.model().unwrap().spec.param_lr.as_ref(), Some(&merged));
    let live_diag = diagnosis(&live);

    // The record sits between steps 4 and 5, and replay amends the model there.
    let bytes = std::fs::read(&path).unwrap();
    let records: Vec<Record> = TraceReader::new(&bytes[..], "amended").unwrap().collect();
    let at = records
        .iter()
        .position(|r| matches!(r, Record::ParamLr(_)))
        .unwrap();
    assert_eq!(records[at], Record::ParamLr(Some(second.to_vec())));
    assert!(matches!(&records[at - 1], Record::Step(o) if o.step == 4));
    assert!(matches!(&records[at + 1], Record::Step(o) if o.step == 5));
    let replay = Replay::read(TraceReader::open(&path).unwrap(), |_| {}).unwrap();
    assert!(replay.damage.is_none() && replay.closed);
    assert_eq!(
        replay.header.model, spec,
        "the header keeps what registration said"
    );
    let model = &replay.engine.model().unwrap().spec;
    assert_eq!(model.param_lr.as_ref(), Some(&merged));
    assert_eq!(diagnosis(&replay.engine), live_diag);
    // fc1 is held: no hypothesis says that no optimizer holds it.
    let text = live_diag["hypotheses"].to_string();
    assert!(!text.contains("no optimizer holds"), "{text}");

    // A reader that skips the record (one that predates it) reads the header's lrs: fc1 held
    // by none. The trace stays readable, and the record is what makes the difference.
    let without = without_record(&bytes, at);
    let old = Replay::read(TraceReader::new(&without[..], "old").unwrap(), |_| {}).unwrap();
    assert!(old.damage.is_none() && old.closed);
    assert_eq!(old.steps, 60);
    assert_eq!(old.engine.model().unwrap().spec.param_lr, spec.param_lr);
    let text = diagnosis(&old.engine)["hypotheses"].to_string();
    assert!(text.contains("no optimizer holds"), "{text}");
    std::fs::remove_dir_all(path.parent().unwrap()).unwrap();
}

/// A trace's bytes without record `index`, as a reader that skips it reads them.
fn without_record(bytes: &[u8], index: usize) -> Vec<u8> {
    let start = usize::try_from(record_start(bytes, index)).unwrap();
    let end = usize::try_from(record_start(bytes, index + 1)).unwrap();
    [&bytes[..start], &bytes[end..]].concat()
}

/// Where record `index` (the header is 0) starts in a trace's bytes.
fn record_start(bytes: &[u8], index: usize) -> u64 {
    let mut reader = TraceReader::new(bytes, "trace").unwrap();
    for _ in 0..index {
        reader.next_record().unwrap();
    }
    reader.offset()
}

#[test]
fn param_lr_records_the_engine_refuses_or_cannot_read_end_the_replay_there() {
    let path = temp_path("bad-amend.ndbg");
    let spec = mlp(2, "Tanh");
    let mut w = TraceWriter::create(&path, Map::new(), WriterOptions::default()).unwrap();
    assert!(
        w.write_param_lr(Some(&[None; 4])).is_err(),
        "before the header"
    );
    w.write_header(&Config::default(), &spec).unwrap();
    let obs = |step| Observation {
        step,
        grad_norms: vec![0.1; 4],
        ..Observation::default()
    };
    w.write_step(&obs(0).view()).unwrap();
    // An lr that JSON cannot carry is refused by the writer, not written wrong.
    let err = w.write_param_lr(Some(&[Some(f64::NAN), None, None, None]));
    assert!(err.unwrap_err().to_string().contains("round trip"));
    w.write_param_lr(None).unwrap(); // (lrs unknown: a valid record)
    w.write_step(&obs(1).view()).unwrap();
    w.write_param_lr(Some(&[Some(0.1)])).unwrap(); // one lr for four parameters
    w.write_step(&obs(2).view()).unwrap();
    w.close().unwrap();
    let replay = Replay::read(TraceReader::open(&path).unwrap(), |_| {}).unwrap();
    assert_eq!(replay.steps, 2);
    let d = replay.damage.unwrap();
    assert!(matches!(d.kind, DamageKind::Rejected(_)), "{d}");
    assert!(
        d.to_string().contains("param_lr has 1 values, expected 4"),
        "{d}"
    );

    // A param-lr record without its key is malformed, not read as "lrs unknown".
    let bytes = std::fs::read(&path).unwrap();
    let mut frame = Vec::new();
    let payload = b"{}";
    let mut head = [0u8; 12];
    head[..4].copy_from_slice(&u32::try_from(payload.len()).unwrap().to_le_bytes());
    head[4] = 0x83;
    let crc = crc32c::crc32c(&head[..8]);
    head[8..].copy_from_slice(&crc.to_le_bytes());
    frame.extend_from_slice(&head);
    frame.extend_from_slice(payload);
    frame.extend_from_slice(&crc32c::crc32c(payload).to_le_bytes());
    let at = usize::try_from(record_start(&bytes, 2)).unwrap(); // after step 0
    let mut broken = bytes[..at].to_vec();
    broken.extend_from_slice(&frame);
    broken.extend_from_slice(&bytes[at..]);
    let replay = Replay::read(TraceReader::new(&broken[..], "broken").unwrap(), |_| {}).unwrap();
    assert_eq!(replay.steps, 1);
    let d = replay.damage.unwrap();
    assert!(d.to_string().contains("missing field `param_lr`"), "{d}");
    std::fs::remove_dir_all(path.parent().unwrap()).unwrap();
}

/// A regression whose loss stays at twice its targets' variance: what the first batch's facts
/// (read after the header, as the Keras callback reads them) make of it, live and replayed.
#[test]
fn first_batch_facts_survive_writing_and_replay() {
    let path = temp_path("first-batch.ndbg");
    let mut spec = mlp(3, "ReLU");
    spec.loss = Some(LossSpec {
        ops: vec!["MseLoss".into()],
        output_units: Some(1),
        ..LossSpec::default()
    });
    let facts = FirstBatch {
        target_range: Some((-2.0, 3.0)),
        target_var: Some(1.0),
        output_range: Some((-0.1, 0.2)),
        class_range: Some((0.0, 4.0)),
        class_entropy: Some(1.38),
        class_entropy_se: Some(0.02),
        output_batch_spread: Some(0.25),
        output_numel: Some(64),
        labels_per_sample: Some(2),
        input_feature_scales: Some(vec![Some(1.5), None, Some(2.0)]),
        loss: None,
        output_op: Some("Identity".into()),
    };
    let mut live = Engine::new(Config::default()).unwrap();
    live.register_model(spec.clone()).unwrap();
    let mut w = TraceWriter::create(&path, Map::new(), WriterOptions::default()).unwrap();
    w.write_header(live.config(), &spec).unwrap();
    for (k, mut o) in quiet_fc1_run(120).into_iter().enumerate() {
        o.grad_norms = vec![0.1, 0.02, 0.1, 0.02, 0.1, 0.02];
        o.loss = Some(2.0 + 0.01 * (k % 3) as f64);
        if o.step == 1 {
            assert!(live.amend_first_batch(&facts).unwrap());
            assert!(
                !live.amend_first_batch(&facts).unwrap(),
                "a fact it has stays"
            );
            w.write_first_batch(&facts).unwrap();
        }
        live.observe(&o.view()).unwrap();
        w.write_step(&o.view()).unwrap();
    }
    w.close().unwrap();
    let model = &live.model().unwrap().spec;
    assert_eq!(model.loss.as_ref().unwrap().target_var, Some(1.0));
    assert_eq!(model.loss.as_ref().unwrap().target_range, Some((-2.0, 3.0)));
    assert_eq!(model.loss.as_ref().unwrap().class_range, Some((0.0, 4.0)));
    assert_eq!(model.loss.as_ref().unwrap().output_numel, Some(64));
    assert_eq!(model.loss.as_ref().unwrap().labels_per_sample, Some(2));
    assert_eq!(model.loss.as_ref().unwrap().class_entropy_se, Some(0.02));
    assert_eq!(model.loss.as_ref().unwrap().output_batch_spread, Some(0.25));
    assert_eq!(
        model.loss.as_ref().unwrap().output_op.as_deref(),
        Some("Identity")
    );
    assert_eq!(model.input_feature_scales, facts.input_feature_scales);
    let live_diag = diagnosis(&live);
    let text = live_diag["hypotheses"].to_string();
    assert!(text.contains("the variance of its targets"), "{text}");

    let replay = Replay::read(TraceReader::open(&path).unwrap(), |_| {}).unwrap();
    assert!(replay.damage.is_none() && replay.closed);
    assert_eq!(
        replay.header.model, spec,
        "the header keeps what registration said"
    );
    assert_eq!(&replay.engine.model().unwrap().spec, model);
    assert_eq!(diagnosis(&replay.engine), live_diag);

    // A reader that skips the record reads the model as registered: no chance level.
    let bytes = std::fs::read(&path).unwrap();
    let records: Vec<Record> = TraceReader::new(&bytes[..], "amended").unwrap().collect();
    let at = records
        .iter()
        .position(|r| matches!(r, Record::FirstBatch(_)))
        .unwrap();
    assert_eq!(records[at], Record::FirstBatch(Box::new(facts)));
    assert!(matches!(&records[at + 1], Record::Step(o) if o.step == 1));
    let without = without_record(&bytes, at);
    let old = Replay::read(TraceReader::new(&without[..], "old").unwrap(), |_| {}).unwrap();
    assert!(old.damage.is_none() && old.closed);
    let text = diagnosis(&old.engine)["hypotheses"].to_string();
    assert!(!text.contains("the variance of its targets"), "{text}");
    std::fs::remove_dir_all(path.parent().unwrap()).unwrap();
}

/// A loss a spoke learns only once the step runs (JAX: while it is traced) is taken where the
/// registered spec has none, kept against a later one, and replayed; its facts are checked
/// like the batch's.
#[test]
fn a_loss_learned_after_registration_is_taken_once_and_replayed() {
    let path = temp_path("late-loss.ndbg");
    let spec = mlp(3, "ReLU");
    assert!(spec.loss.is_none());
    let softmax_into_ce = LossSpec {
        ops: vec!["NllLoss".into(), "LogSoftmax".into()],
        output_op: Some("Softmax".into()),
        output_units: Some(4),
        ..LossSpec::default()
    };
    let facts = FirstBatch {
        loss: Some(softmax_into_ce.clone()),
        ..FirstBatch::default()
    };
    let mut live = Engine::new(Config::default()).unwrap();
    live.register_model(spec.clone()).unwrap();
    let mut w = TraceWriter::create(&path, Map::new(), WriterOptions::default()).unwrap();
    w.write_header(live.config(), &spec).unwrap();
    for (k, mut o) in quiet_fc1_run(80).into_iter().enumerate() {
        o.loss = Some(1.0 + 0.01 * (k % 3) as f64);
        if o.step == 1 {
            assert!(live.amend_first_batch(&facts).unwrap());
            let other = FirstBatch {
                loss: Some(LossSpec {
                    ops: vec!["MseLoss".into()],
                    ..LossSpec::default()
                }),
                ..FirstBatch::default()
            };
            assert!(
                !live.amend_first_batch(&other).unwrap(),
                "the first loss stays"
            );
            w.write_first_batch(&facts).unwrap();
        }
        live.observe(&o.view()).unwrap();
        w.write_step(&o.view()).unwrap();
    }
    w.close().unwrap();
    assert_eq!(live.model().unwrap().spec.loss, Some(softmax_into_ce));
    let live_diag = diagnosis(&live);
    let text = live_diag["hypotheses"].to_string();
    assert!(text.contains("output_loss_mismatch"), "{text}");
    let replay = Replay::read(TraceReader::open(&path).unwrap(), |_| {}).unwrap();
    assert!(replay.damage.is_none() && replay.closed);
    assert_eq!(
        replay.header.model, spec,
        "the header keeps what registration said"
    );
    assert_eq!(diagnosis(&replay.engine), live_diag);

    let mut engine = Engine::new(Config::default()).unwrap();
    engine.register_model(mlp(2, "Tanh")).unwrap();
    let bad = FirstBatch {
        loss: Some(LossSpec {
            ops: vec!["MseLoss".into()],
            target_var: Some(-1.0),
            ..LossSpec::default()
        }),
        ..FirstBatch::default()
    };
    let err = engine.amend_first_batch(&bad).unwrap_err().to_string();
    assert!(err.contains("a variance is a finite number >= 0"), "{err}");
    assert!(engine.model().unwrap().spec.loss.is_none());
    std::fs::remove_dir_all(path.parent().unwrap()).unwrap();
}

#[test]
fn first_batch_facts_that_are_not_what_they_say_are_refused() {
    let mut engine = Engine::new(Config::default()).unwrap();
    let bad = FirstBatch {
        target_range: Some((3.0, -2.0)),
        ..FirstBatch::default()
    };
    assert!(engine.amend_first_batch(&bad).is_err(), "no model yet");
    engine.register_model(mlp(2, "Tanh")).unwrap();
    let err = engine.amend_first_batch(&bad).unwrap_err().to_string();
    assert!(err.contains("target_range is [3, -2]"), "{err}");
    let err = engine
        .amend_first_batch(&FirstBatch {
            target_var: Some(-1.0),
            ..FirstBatch::default()
        })
        .unwrap_err()
        .to_string();
    assert!(err.contains("a variance is a finite number >= 0"), "{err}");
    let err = engine
        .amend_first_batch(&FirstBatch {
            loss: Some(LossSpec {
                class_entropy: Some(f64::NAN),
                ..LossSpec::default()
            }),
            ..FirstBatch::default()
        })
        .unwrap_err()
        .to_string();
    assert!(err.contains("an entropy is a finite number >= 0"), "{err}");
    let err = engine
        .amend_first_batch(&FirstBatch {
            class_entropy: Some(-0.5),
            ..FirstBatch::default()
        })
        .unwrap_err()
        .to_string();
    assert!(err.contains("class_entropy is -0.5"), "{err}");
    let err = engine
        .amend_first_batch(&FirstBatch {
            class_entropy_se: Some(f64::INFINITY),
            ..FirstBatch::default()
        })
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("class_entropy_se is inf: a standard error is a finite number >= 0"),
        "{err}"
    );
    for bad in [f64::NAN, -1e-3, f64::INFINITY] {
        let err = engine
            .amend_first_batch(&FirstBatch {
                output_batch_spread: Some(bad),
                ..FirstBatch::default()
            })
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("a spread is a finite number >= 0"),
            "{bad}: {err}"
        );
    }
    // Without a loss in the spec, target facts have nothing to describe.
    assert!(
        !engine
            .amend_first_batch(&FirstBatch {
                target_var: Some(1.0),
                ..FirstBatch::default()
            })
            .unwrap()
    );
    // A fact JSON cannot carry is refused by the writer, not written wrong.
    let path = temp_path("bad-first-batch.ndbg");
    let mut w = TraceWriter::create(&path, Map::new(), WriterOptions::default()).unwrap();
    w.write_header(&Config::default(), &mlp(2, "Tanh")).unwrap();
    let nan = FirstBatch {
        target_var: Some(f64::NAN),
        ..FirstBatch::default()
    };
    let err = w.write_first_batch(&nan).unwrap_err().to_string();
    assert!(err.contains("round trip"), "{err}");
    w.close().unwrap();
    std::fs::remove_dir_all(path.parent().unwrap()).unwrap();
}
