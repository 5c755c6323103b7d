#![allow(clippy::unwrap_used)] // a test crate: a failed unwrap is a failed test
//! Planted failures and a healthy run on burn's `NdArray` backend, each with its ground truth
//! computed independently of the adapter and the engine: the gradient norms are read back on
//! the host and summed in f64 here, per layer, straight from burn's gradients.

use burn::module::{Module, Param};
use burn::nn::{Linear, LinearConfig};
use burn::optim::{GradientsParams, SgdConfig};
use burn::tensor::activation::relu;
use burn::tensor::{Device, Tensor, TensorData};
use neuraldbg_burn::neuraldbg_core::trace::{Replay, TraceReader};
use neuraldbg_burn::{NeuralDbg, Options};

const IN: usize = 8;
const WIDTH: usize = 16;
const BATCH: usize = 32;

#[derive(Module, Debug)]
struct Mlp {
    layers: Vec<Linear>,
    head: Linear,
}

impl Mlp {
    fn new(depth: usize, device: &Device) -> Self {
        let mut layers = vec![LinearConfig::new(IN, WIDTH).init(device)];
        layers.extend((1..depth).map(|_| LinearConfig::new(WIDTH, WIDTH).init(device)));
        Self {
            layers,
            head: LinearConfig::new(WIDTH, 1).init(device),
        }
    }

    fn forward(&self, x: Tensor<2>) -> Tensor<2> {
        let x = self.layers.iter().fold(x, |x, l| relu(l.forward(x)));
        self.head.forward(x)
    }

    /// Every Linear with its name, in forward order.
    fn linears(&self) -> Vec<(String, &Linear)> {
        let mut out: Vec<(String, &Linear)> = self
            .layers
            .iter()
            .enumerate()
            .map(|(i, l)| (format!("layers.{i}"), l))
            .collect();
        out.push(("head".into(), &self.head));
        out
    }
}

/// Deterministic regression data: y = sum of x (xorshift, no random crate).
struct Data(u64);

impl Data {
    fn next(&mut self) -> f32 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        (self.0 >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0
    }

    fn batch(&mut self, device: &Device) -> (Tensor<2>, Tensor<2>) {
        let x: Vec<f32> = (0..BATCH * IN).map(|_| self.next()).collect();
        let y: Vec<f32> = x.chunks(IN).map(|r| r.iter().sum()).collect();
        (
            Tensor::from_data(TensorData::new(x, [BATCH, IN]), device),
            Tensor::from_data(TensorData::new(y, [BATCH, 1]), device),
        )
    }
}

/// The L2 norm of a parameter's gradient, read to the host and summed in f64.
fn host_norm<const D: usize>(grads: &GradientsParams, param: &Param<Tensor<D>>) -> f64 {
    let g = grads
        .get::<D>(param.id)
        .expect("every parameter has a gradient");
    let values: Vec<f32> = g.into_data().try_to_vec::<f32>().expect("f32 gradient");
    values
        .iter()
        .map(|&v| f64::from(v) * f64::from(v))
        .sum::<f64>()
}

/// Per-layer gradient norms of each step, computed here (the ground truth), and the debugger.
struct Run {
    norms: Vec<Vec<f64>>,
    losses: Vec<f64>,
    names: Vec<String>,
    dbg: NeuralDbg,
}

/// Trains `steps` SGD steps at `lr(step)`, watched; records the ground truth on the side.
fn train(steps: usize, lr: impl Fn(usize) -> f64, options: Options) -> Run {
    let device = Device::default().autodiff();
    device.seed(7);
    let mut model = Mlp::new(3, &device);
    let mut data = Data(0x9E37_79B9_7F4A_7C15);
    let mut optim = NeuralDbg::new(options.optimizer("SGD"))
        .expect("options are valid")
        .watch(SgdConfig::new().init());
    let mut norms = Vec::new();
    let mut losses = Vec::new();
    for step in 0..steps {
        let (x, y) = data.batch(&device);
        let loss = (model.forward(x) - y).square().mean();
        optim.record_loss(&loss);
        losses.push(f64::from(loss.clone().into_scalar::<f32>()));
        let grads = GradientsParams::from_grads(loss.backward(), &model);
        norms.push(
            model
                .linears()
                .iter()
                .map(|(_, l)| {
                    let bias = l.bias.as_ref().map_or(0.0, |b| host_norm(&grads, b));
                    (host_norm(&grads, &l.weight) + bias).sqrt()
                })
                .collect(),
        );
        model = optim.step(lr(step), model, grads);
    }
    let names = model.linears().into_iter().map(|(n, _)| n).collect();
    let (_, dbg) = optim.into_parts();
    Run {
        norms,
        losses,
        names,
        dbg,
    }
}

/// The engine's per-layer gradient norms equal the ones computed here, step by step.
fn assert_norms_match(run: &Run) {
    for (layer, name) in run.names.iter().enumerate() {
        let (steps, values) = run.dbg.history(Some(name), "grad_norm").unwrap();
        assert_eq!(steps.len(), run.norms.len(), "{name}: one value per step");
        for (s, (&got, truth)) in values.iter().zip(&run.norms).enumerate() {
            let want = truth[layer];
            if want.is_finite() {
                assert!(
                    (got - want).abs() <= 1e-4 * want.abs() + 1e-12,
                    "{name} step {s}: engine {got}, direct {want}"
                );
            } else {
                assert!(
                    !got.is_finite(),
                    "{name} step {s}: engine {got}, direct {want}"
                );
            }
        }
    }
}

#[test]
fn planted_learning_rate_explosion_is_found_with_its_onset_and_cause() {
    const SPIKE_AT: usize = 20;
    let run = train(
        40,
        |s| if s >= SPIKE_AT { 10.0 } else { 0.01 },
        Options::default(),
    );

    // Ground truth, from the norms computed here: healthy before the lr change, and the first
    // step at which some layer's gradient norm exceeds the exploding threshold (1e3).
    assert!(
        run.norms[..SPIKE_AT].iter().flatten().all(|&n| n < 10.0),
        "healthy before the lr change"
    );
    let onset = run
        .norms
        .iter()
        .position(|layers| layers.iter().any(|&n| n > 1e3 || !n.is_finite()))
        .expect("the gradients explode after the lr change") as u64;
    assert!(onset > SPIKE_AT as u64, "the explosion follows the change");

    assert_norms_match(&run);
    let hypotheses = run.dbg.explain_failure(None);
    let top = &hypotheses[0];
    assert_eq!(top.failure.as_str(), "exploding_gradients", "{top}");
    assert_eq!(top.cause.as_str(), "learning_rate_too_high", "{top}");
    assert_eq!(top.step, Some(onset), "{top}");
    assert!(top.confidence >= 0.5, "{top}");
    // The fixes name burn's API, not PyTorch's.
    assert!(
        top.remedies
            .iter()
            .any(|r| r.contains("GradientClippingConfig::Norm(1.0)")),
        "{:?}",
        top.remedies
    );
    assert!(
        !top.remedies.iter().any(|r| r.contains("torch")),
        "{:?}",
        top.remedies
    );
    assert!(run.dbg.error().is_none());
}

#[test]
fn healthy_run_has_no_confident_hypothesis() {
    let run = train(40, |_| 0.01, Options::default());
    // Ground truth: every norm stays in the healthy band and the loss goes down.
    assert!(
        run.norms
            .iter()
            .flatten()
            .all(|&n| (1e-6..=1e3).contains(&n)),
        "norms stay between the thresholds"
    );
    let (first, last) = (
        run.losses[..5].iter().sum::<f64>(),
        run.losses[35..].iter().sum::<f64>(),
    );
    assert!(last < first, "the loss decreases: {first} -> {last}");

    assert_norms_match(&run);
    let hypotheses = run.dbg.explain_failure(None);
    assert!(
        hypotheses.iter().all(|h| h.confidence < 0.5),
        "{:?}",
        hypotheses
            .iter()
            .map(ToString::to_string)
            .collect::<Vec<_>>()
    );
    let (steps, loss) = run.dbg.history(None, "loss").unwrap();
    assert_eq!(steps, (0..40).collect::<Vec<u64>>());
    for (got, want) in loss.iter().zip(&run.losses) {
        assert!(
            (got - want).abs() <= 1e-6 * want.abs(),
            "loss {got} vs {want}"
        );
    }
    let (_, lr) = run.dbg.history(None, "lr").unwrap();
    assert!(lr.iter().all(|&l| (l - 0.01).abs() < 1e-8), "{lr:?}");
}

#[test]
fn the_trace_replays_to_the_live_diagnosis() {
    let dir = std::env::temp_dir().join(format!("ndbg-burn-{}", std::process::id()));
    let path = dir.join("explosion.ndbg");
    let mut run = train(
        30,
        |s| if s >= 15 { 10.0 } else { 0.01 },
        Options::default().trace(&path),
    );
    run.dbg.close().unwrap();
    let replay = Replay::read(TraceReader::open(&path).unwrap(), |_| {}).unwrap();
    assert!(replay.damage.is_none() && replay.closed);
    // Debug text: NaN fields (a non-finite event's threshold) compare unequal as floats.
    assert_eq!(
        format!("{:?}", replay.engine.events()),
        format!("{:?}", run.dbg.events())
    );
    let live: Vec<String> = run
        .dbg
        .explain_failure(None)
        .iter()
        .map(ToString::to_string)
        .collect();
    let replayed: Vec<String> =
        neuraldbg_burn::neuraldbg_core::analysis::explain(&replay.engine, None)
            .iter()
            .map(ToString::to_string)
            .collect();
    assert_eq!(live, replayed);
    std::fs::remove_dir_all(dir).unwrap();
}

/// Sum of squares of a tensor's values, on the host in f64.
fn host_sum_sq<const D: usize>(t: Tensor<D>) -> f64 {
    let values: Vec<f32> = t.into_data().try_to_vec::<f32>().unwrap();
    values.iter().map(|&v| f64::from(v) * f64::from(v)).sum()
}

#[test]
fn each_step_records_what_the_host_computes_and_leaves_training_unchanged() {
    use neuraldbg_burn::neuraldbg_core::trace::Record;

    let dir = std::env::temp_dir().join(format!("ndbg-burn-steps-{}", std::process::id()));
    let path = dir.join("steps.ndbg");
    let device = Device::default().autodiff();
    device.seed(3);
    let mut model = Mlp::new(2, &device);
    let mut plain_model = model.clone();
    let mut plain = SgdConfig::new().init();
    let options = Options {
        dense_steps: 2,
        weight_every: 3,
        ..Options::default()
    };
    let mut optim = NeuralDbg::new(options.trace(&path))
        .unwrap()
        .watch(SgdConfig::new().init());
    let mut data = Data(42);
    let mut expected = Vec::new();
    for step in 0..6u64 {
        let (x, y) = data.batch(&device);
        // The host's view of the step: input statistics, loss, parameter norms before the update.
        let xs: Vec<f32> = x.to_data().try_to_vec::<f32>().unwrap();
        let n = xs.len() as f64;
        let mean = xs.iter().map(|&v| f64::from(v)).sum::<f64>() / n;
        let var = xs
            .iter()
            .map(|&v| (f64::from(v) - mean).powi(2))
            .sum::<f64>()
            / n; // population variance, as torch.std_mean(correction=0)
        let (lo, hi) = xs
            .iter()
            .fold((f32::MAX, f32::MIN), |(a, b), &v| (a.min(v), b.max(v)));
        let weights: Vec<f64> = model
            .linears()
            .iter()
            .flat_map(|(_, l)| {
                let b = l.bias.as_ref().map(Param::val);
                std::iter::once(host_sum_sq(l.weight.val())).chain(b.map(host_sum_sq))
            })
            .map(f64::sqrt)
            .collect();

        optim.record_input(&x);
        let loss = (model.forward(x.clone()) - y.clone()).square().mean();
        optim.record_loss(&loss);
        let loss_value = f64::from(loss.clone().into_scalar::<f32>());
        let grads = GradientsParams::from_grads(loss.backward(), &model);
        expected.push((
            step,
            [f64::from(lo), f64::from(hi), mean, var.sqrt()],
            loss_value,
            weights,
        ));
        model = optim.step(0.05, model, grads);

        let plain_loss = (plain_model.forward(x) - y).square().mean();
        let plain_grads = GradientsParams::from_grads(plain_loss.backward(), &plain_model);
        plain_model = plain.step(0.05, plain_model, plain_grads);
    }
    // The watched optimizer updates the model exactly as the plain one does.
    for ((_, a), (_, b)) in model.linears().iter().zip(plain_model.linears().iter()) {
        let (a, b): (Vec<f32>, Vec<f32>) = (
            a.weight.val().into_data().try_to_vec().unwrap(),
            b.weight.val().into_data().try_to_vec().unwrap(),
        );
        assert_eq!(a, b);
    }
    let (_, mut dbg) = optim.into_parts();
    dbg.close().unwrap();

    let mut reader = TraceReader::open(&path).unwrap();
    let Some(Record::Header(header)) = reader.next_record() else {
        panic!("a header first")
    };
    let names: Vec<&str> = header
        .model
        .params
        .iter()
        .map(|p| p.name.as_str())
        .collect();
    assert_eq!(
        names,
        [
            "layers.0.weight",
            "layers.0.bias",
            "layers.1.weight",
            "layers.1.bias",
            "head.weight",
            "head.bias"
        ]
    );
    let close = |a: f64, b: f64| (a - b).abs() <= 1e-5 * b.abs().max(1e-3);
    // Step records, past the writer's clock records between them.
    let mut steps = std::iter::from_fn(|| reader.next_record()).filter_map(|r| match r {
        Record::Step(obs) => Some(obs),
        _ => None,
    });
    for (step, inputs, loss, weights) in expected {
        let Some(obs) = steps.next() else {
            panic!("step {step} recorded")
        };
        assert_eq!(obs.step, step);
        assert_eq!(obs.lr, Some(0.05));
        assert!(
            close(obs.loss.unwrap(), loss),
            "step {step}: loss {:?} vs {loss}",
            obs.loss
        );
        assert_eq!(obs.inputs.len(), 4);
        for (got, want) in obs.inputs.iter().zip(inputs) {
            assert!(
                close(f64::from(*got), want),
                "step {step}: inputs {:?} vs {inputs:?}",
                obs.inputs
            );
        }
        // Parameter norms on the dense steps (0, 1) and every third step after (3).
        assert_eq!(
            obs.weight_norms.is_some(),
            matches!(step, 0 | 1 | 3),
            "step {step}"
        );
        if let Some(w) = obs.weight_norms {
            for (got, want) in w.iter().zip(&weights) {
                assert!(
                    close(f64::from(*got), *want),
                    "step {step}: weights {w:?} vs {weights:?}"
                );
            }
        }
    }
    std::fs::remove_dir_all(dir).unwrap();
}

#[test]
fn a_failure_is_kept_and_never_interrupts_training() {
    let device = Device::default().autodiff();
    let model = Mlp::new(2, &device);
    let other = Mlp::new(2, &device); // same shape, other parameters
    let mut optim = NeuralDbg::new(Options::default())
        .unwrap()
        .watch(SgdConfig::new().init());
    let mut data = Data(1);
    let (x, y) = data.batch(&device);
    let grads = GradientsParams::from_grads(
        (model.forward(x.clone()) - y.clone())
            .square()
            .mean()
            .backward(),
        &model,
    );
    let _model = optim.step(0.1, model, grads);
    assert!(optim.debugger().error().is_none());

    // A watched optimizer serves one model: stepping another one is refused by the adapter,
    // and the step is still taken.
    let before: Vec<f32> = other.head.weight.val().into_data().try_to_vec().unwrap();
    let grads =
        GradientsParams::from_grads((other.forward(x) - y).square().mean().backward(), &other);
    let other = optim.step(0.1, other, grads);
    let after: Vec<f32> = other.head.weight.val().into_data().try_to_vec().unwrap();
    assert_ne!(before, after, "the optimizer stepped");
    let (_, mut dbg) = optim.into_parts();
    assert_eq!(dbg.step(), 2);
    let err = dbg.error().unwrap().to_string();
    assert!(err.contains("serves one model"), "{err}");
    assert_eq!(dbg.engine().steps_observed(), 1);
    assert!(dbg.close().is_err(), "close returns the kept failure");
}
