//! Memory benchmark: 10,000 layers x 1,000,000 steps of synthetic observations (what the
//! `PyTorch` collector sends by default), with four planted failures. Reports throughput and
//! peak resident memory (`VmHWM` of /proc/self/status) and fails unless the peak stays under
//! 256 MiB and every planted failure is found, dated at its first step.
//!
//! `cargo run --release -p neuraldbg-core --example memory [LAYERS] [STEPS]` (a few minutes).
#![allow(clippy::print_stdout)] // a benchmark binary reports on stdout

use std::time::Instant;

use neuraldbg_core::analysis::Analysis;
use neuraldbg_core::{Config, Engine};

#[path = "../benches/support/synthetic.rs"]
mod synthetic;

fn peak_rss_kib() -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with("VmHWM:"))?;
    line.split_whitespace().nth(1)?.parse().ok()
}

fn main() {
    let mut args = std::env::args().skip(1);
    let layers: usize = args.next().and_then(|a| a.parse().ok()).unwrap_or(10_000);
    let steps: u64 = args
        .next()
        .and_then(|a| a.parse().ok())
        .unwrap_or(1_000_000);
    let budget_mib = 256;

    let mut engine = Engine::new(Config::default()).expect("default config");
    engine
        .register_model(synthetic::mlp(layers))
        .expect("model");
    let plants = synthetic::planted(layers, steps);
    let t0 = Instant::now();
    synthetic::run_planted(&mut engine, layers, steps, &plants);
    let seconds = t0.elapsed().as_secs_f64();
    let t1 = Instant::now();
    let hypotheses = Analysis::new(&engine)
        .map(|a| a.hypotheses(None))
        .unwrap_or_default();
    let analysis_seconds = t1.elapsed().as_secs_f64();
    let peak = peak_rss_kib().unwrap_or(0) as f64 / 1024.0;

    println!(
        "{layers} layers x {steps} steps in {seconds:.1} s: {:.1} M layer-observations/s",
        layers as f64 * steps as f64 / seconds / 1e6
    );
    println!(
        "engine heap (histories, trackers, events): {:.1} MiB; {} events",
        engine.heap_bytes() as f64 / 1_048_576.0,
        engine.events().len()
    );
    println!("peak RSS (VmHWM): {peak:.1} MiB (budget {budget_mib} MiB)");
    println!("analysis: {analysis_seconds:.2} s; top hypotheses:");
    for h in hypotheses.iter().take(4) {
        println!(
            "  [{:.2}] {} {:?} layer {:?} step {:?}",
            h.confidence,
            h.failure.as_str(),
            h.cause.as_str(),
            h.layer,
            h.step
        );
    }
    let missing = synthetic::missing(&engine, &plants);
    for p in &plants {
        println!(
            "planted {:<10} index {:>5} steps {}..{}: {}",
            p.what,
            p.index,
            p.from,
            p.to,
            if missing.iter().any(|m| m.starts_with(p.what)) {
                "MISSED"
            } else {
                "found"
            }
        );
    }
    assert!(
        missing.is_empty(),
        "planted failures not found: {missing:?}"
    );
    assert!(
        peak > 0.0 && peak < f64::from(budget_mib),
        "peak RSS {peak:.1} MiB is over {budget_mib} MiB"
    );
}
