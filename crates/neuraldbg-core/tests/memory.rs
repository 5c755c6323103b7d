//! The memory benchmark (`examples/memory.rs`) scaled down to a test: planted failures in a
//! long synthetic run are found, dated at their first step, and the engine's memory stays
//! within its history budget however many layers the model has.

use neuraldbg_core::{Config, Engine};

#[path = "../benches/support/synthetic.rs"]
mod synthetic;

#[test]
fn planted_failures_are_found_in_a_long_run() {
    let (layers, steps) = (500, 10_000);
    let mut engine = Engine::new(Config::default()).unwrap();
    engine.register_model(synthetic::mlp(layers)).unwrap();
    let plants = synthetic::planted(layers, steps);
    synthetic::run_planted(&mut engine, layers, steps, &plants);
    assert_eq!(synthetic::missing(&engine, &plants), Vec::<String>::new());
    // Healthy layers produce no event: each planted failure starts and ends one episode.
    assert!(
        engine.events().len() <= 2 * plants.len(),
        "{:?}",
        engine.events()
    );
}

#[test]
fn history_memory_is_bounded_by_the_budget() {
    let budget = 1 << 20;
    let config = Config {
        history_max_bytes: budget,
        ..Config::default()
    };
    let layers = 1_000;
    let mut engine = Engine::new(config).unwrap();
    engine.register_model(synthetic::mlp(layers)).unwrap();
    let stream = synthetic::Stream::new(layers, 10);
    for step in 0..3_000 {
        engine.observe(&stream.view(step)).unwrap();
    }
    let trackers = engine.heap_bytes() - history_bytes(&engine);
    assert!(
        history_bytes(&engine) <= budget,
        "{} > {budget}",
        history_bytes(&engine)
    );
    assert!(trackers < 2_000 * 1_024, "{trackers}");
    // Plots still cover the whole run, coarser.
    let (steps, _) = engine
        .history(Some("0"), "grad_norm", neuraldbg_core::Reduce::Max)
        .unwrap();
    assert!(
        steps.len() >= 8 && *steps.last().unwrap() == 2_999,
        "{steps:?}"
    );
}

fn history_bytes(engine: &Engine) -> usize {
    engine.history_bytes()
}
