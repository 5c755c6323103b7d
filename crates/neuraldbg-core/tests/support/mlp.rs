//! The small model the loop-mistake and quiet-failure tests observe.

use neuraldbg_core::ModelSpec;

/// fc0 -> relu0 -> fc1 -> relu1 -> fc2 -> root, each Linear with weight and bias, under SGD.
pub fn spec() -> ModelSpec {
    let mut spec = ModelSpec::default();
    for i in 0..3 {
        let m = spec.module(format!("fc{i}"), "Linear");
        spec.param(m, format!("fc{i}.weight"), &[16, 16]);
        spec.param(m, format!("fc{i}.bias"), &[16]);
        if i < 2 {
            spec.module(format!("relu{i}"), "ReLU");
        }
    }
    spec.module("", "Net");
    spec.optimizer = Some("SGD".into());
    spec
}
