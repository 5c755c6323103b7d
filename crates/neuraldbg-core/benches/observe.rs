//! Engine ingest throughput: `Engine::observe` per step, counted in layer-observations (one
//! layer's gradient norm classified, debounced, and written to history), for models of 10,
//! 1,000 and 100,000 layers (`Linear` + `ReLU` each).
//!
//! `cargo bench -p neuraldbg-core --bench observe`
//!
//! * `gradients`: gradient norms only, every step.
//! * `collector_default`: what the `PyTorch` collector sends by default: gradients every step,
//!   parameter norms and activation statistics every 10th, input statistics, loss and lr.

use divan::{Bencher, counter::ItemsCount};
use neuraldbg_core::{Config, Engine};

#[path = "support/synthetic.rs"]
mod synthetic;

use synthetic::{Stream, mlp};

fn main() {
    divan::main();
}

const LAYERS: &[usize] = &[10, 1_000, 100_000];

fn run(bencher: Bencher<'_, '_>, layers: usize, sample_every: u64) {
    let mut engine = Engine::new(Config::default()).expect("default config");
    engine.register_model(mlp(layers)).expect("model");
    let stream = Stream::new(layers, sample_every);
    let mut step = 0u64;
    // Warm past the first history coarsening so the steady state is measured.
    for _ in 0..2_000 {
        engine.observe(&stream.view(step)).expect("observe");
        step += 1;
    }
    bencher.counter(ItemsCount::new(layers)).bench_local(|| {
        engine.observe(&stream.view(step)).expect("observe");
        step += 1;
    });
}

#[divan::bench(args = LAYERS)]
fn gradients(bencher: Bencher<'_, '_>, layers: usize) {
    run(bencher, layers, u64::MAX);
}

#[divan::bench(args = LAYERS)]
fn collector_default(bencher: Bencher<'_, '_>, layers: usize) {
    run(bencher, layers, 10);
}
