//! Sustained ingest throughput: a fixed, large number of `Engine::observe` calls timed end to
//! end, so the rare costly steps (history coarsening, first touches of history pages) are in
//! the figure in their true proportion. The divan bench (`benches/observe.rs`) shows the
//! per-call distribution; this is the number the >= 20 M layer-observations/s target is about.
//!
//! `cargo run --release -p neuraldbg-core --example throughput`
#![allow(clippy::print_stdout)] // a benchmark binary reports on stdout

use std::time::Instant;

use neuraldbg_core::{Config, Engine};

#[path = "../benches/support/synthetic.rs"]
mod synthetic;

use synthetic::{Stream, mlp};

/// Layer-observations per run: enough steps that every size goes through several history
/// coarsenings (at 10 layers: 2 million steps).
const TOTAL: u64 = 20_000_000;

fn main() {
    for layers in [10usize, 1_000, 100_000] {
        for (label, sample_every) in [("gradients", u64::MAX), ("collector_default", 10)] {
            let mut engine = Engine::new(Config::default()).expect("default config");
            engine.register_model(mlp(layers)).expect("model");
            let stream = Stream::new(layers, sample_every);
            let steps = (TOTAL / layers as u64).max(200);
            let start = Instant::now();
            for step in 0..steps {
                engine.observe(&stream.view(step)).expect("observe");
            }
            let secs = start.elapsed().as_secs_f64();
            let rate = (steps * layers as u64) as f64 / secs / 1e6;
            println!(
                "{label:<18} {layers:>7} layers x {steps:>9} steps: {rate:6.1} M layer-observations/s ({:.0} ns per step)",
                secs / steps as f64 * 1e9
            );
        }
    }
}
