//! The seed's demo in burn: a deep Tanh network whose gradients vanish, watched by `NeuralDBG`.
//!
//! A 30-layer Tanh MLP with burn's default initialization trains on a small synthetic
//! classification task (`NdArray` backend, CPU). The loop is burn's own; the only change is that
//! the optimizer is wrapped. After training, `explain_failure` says what failed, where, from
//! which step, why, and what to change.
//!
//! ```sh
//! cargo run -p neuraldbg-burn --example vanishing_gradients
//! ```
#![allow(clippy::print_stdout)]

use burn::module::Module;
use burn::nn::loss::CrossEntropyLossConfig;
use burn::nn::{Linear, LinearConfig};
use burn::optim::{GradientsParams, SgdConfig};
use burn::tensor::{Device, Int, Tensor, TensorData};
use neuraldbg_burn::neuraldbg_core::display_name;
use neuraldbg_burn::{NeuralDbg, Options};

const DEPTH: usize = 30;
const WIDTH: usize = 32;
const INPUTS: usize = 16;
const CLASSES: usize = 4;
const STEPS: usize = 100;
const BATCH: usize = 64;

#[derive(Module, Debug)]
struct DeepTanh {
    layers: Vec<Linear>,
    head: Linear,
}

impl DeepTanh {
    fn new(device: &Device) -> Self {
        let mut layers = vec![LinearConfig::new(INPUTS, WIDTH).init(device)];
        layers.extend((1..DEPTH).map(|_| LinearConfig::new(WIDTH, WIDTH).init(device)));
        Self {
            layers,
            head: LinearConfig::new(WIDTH, CLASSES).init(device),
        }
    }

    fn forward(&self, x: Tensor<2>) -> Tensor<2> {
        let x = self
            .layers
            .iter()
            .fold(x, |x, layer| layer.forward(x).tanh());
        self.head.forward(x)
    }
}

/// A fixed teacher labels Gaussian inputs by their argmax projection (deterministic).
struct Data {
    state: u64,
    teacher: Vec<f32>,
}

impl Data {
    fn new(seed: u64) -> Self {
        let mut data = Self {
            state: seed,
            teacher: Vec::new(),
        };
        data.teacher = (0..INPUTS * CLASSES).map(|_| data.normal()).collect();
        data
    }

    /// xorshift64* and Box-Muller: reproducible without a random-number crate.
    fn uniform(&mut self) -> f32 {
        self.state ^= self.state >> 12;
        self.state ^= self.state << 25;
        self.state ^= self.state >> 27;
        let bits = self.state.wrapping_mul(0x2545_F491_4F6C_DD1D) >> 40;
        (bits as f32 + 0.5) / (1u64 << 24) as f32
    }

    fn normal(&mut self) -> f32 {
        let (u, v) = (self.uniform(), self.uniform());
        (-2.0 * u.ln()).sqrt() * (std::f32::consts::TAU * v).cos()
    }

    fn batch(&mut self, device: &Device) -> (Tensor<2>, Tensor<1, Int>) {
        let x: Vec<f32> = (0..BATCH * INPUTS).map(|_| self.normal()).collect();
        let y: Vec<i64> = x
            .chunks(INPUTS)
            .map(|row| {
                let score = |c: usize| {
                    (0..INPUTS)
                        .map(|i| row[i] * self.teacher[i * CLASSES + c])
                        .sum::<f32>()
                };
                (0..CLASSES)
                    .max_by(|&a, &b| score(a).total_cmp(&score(b)))
                    .map_or(0, |c| i64::try_from(c).unwrap_or(0))
            })
            .collect();
        (
            Tensor::from_data(TensorData::new(x, [BATCH, INPUTS]), device),
            Tensor::from_data(TensorData::new(y, [BATCH]), device),
        )
    }
}

fn main() -> Result<(), neuraldbg_burn::Error> {
    let device = Device::default().autodiff();
    device.seed(0);
    let mut model = DeepTanh::new(&device);
    let criterion = CrossEntropyLossConfig::new().init(&device);
    let mut data = Data::new(0x5EED);

    let options = Options::default()
        .optimizer("SGD")
        .trace("runs/burn_vanishing_gradients.ndbg");
    let mut optim = NeuralDbg::new(options)?.watch(SgdConfig::new().init());
    for _ in 0..STEPS {
        let (x, y) = data.batch(&device);
        optim.record_input(&x);
        let loss = criterion.forward(model.forward(x), y);
        optim.record_loss(&loss);
        let grads = GradientsParams::from_grads(loss.backward(), &model);
        model = optim.step(0.05, model, grads);
    }
    let (_, mut dbg) = optim.into_parts();

    let (_, losses) = dbg.history(None, "loss")?;
    println!(
        "Trained {} steps; final loss {:.3} (chance level is {:.3}).",
        dbg.step(),
        losses.last().copied().unwrap_or(f64::NAN),
        (CLASSES as f64).ln()
    );
    let mut first = Vec::new();
    for i in 0..DEPTH {
        first.push(dbg.history(Some(&format!("layers.{i}")), "grad_norm")?.1[0]);
    }
    first.push(dbg.history(Some("head"), "grad_norm")?.1[0]);
    println!("\nGradient norm per Linear layer at step 0 (input -> output, log scale):");
    println!(
        "  {}   {:.1e} ... {:.1e}",
        sparkline(&first),
        first[0],
        first[first.len() - 1]
    );

    let events = dbg.events();
    println!(
        "\n{} semantic events (transitions only), the first few:",
        events.len()
    );
    let engine = dbg.engine();
    for e in events.iter().take(5) {
        println!(
            "  step {:>3}  {}  {}: {} -> {} (confidence {:.2})",
            e.step,
            display_name(&engine.subject_name(e.subject)),
            e.event_type,
            e.from_state,
            e.to_state,
            e.confidence
        );
    }

    println!("\nDiagnosis (most likely first):");
    let hypotheses = dbg.explain_failure(None);
    for h in hypotheses.iter().take(3) {
        println!("  {h}");
    }
    if let Some(top) = hypotheses.first() {
        println!("\nCausal chain:");
        for line in &top.causal_chain {
            println!("  - {line}");
        }
        println!("What to change:");
        for r in &top.remedies {
            println!("  - {r}");
        }
    }
    println!("\nCausal graph (Mermaid):");
    println!("{}", dbg.export_mermaid_causal_graph());

    dbg.save_report("runs/burn_vanishing_gradients.html")?;
    dbg.close()?;
    println!("\nReport: runs/burn_vanishing_gradients.html (open it in a browser)");
    println!(
        "Trace:  runs/burn_vanishing_gradients.ndbg (try: neuraldbg explain runs/burn_vanishing_gradients.ndbg)"
    );
    Ok(())
}

/// log10 gradient norms as a one-line bar chart.
fn sparkline(values: &[f64]) -> String {
    const BARS: [char; 9] = [' ', '▁', '▂', '▃', '▄', '▅', '▆', '▇', '█'];
    let logs: Vec<f64> = values
        .iter()
        .map(|&v| if v > 0.0 { v.log10() } else { -12.0 })
        .collect();
    let lo = logs.iter().copied().fold(f64::INFINITY, f64::min);
    let hi = logs.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    logs.iter()
        .map(|v| BARS[((v - lo) / (hi - lo + 1e-12) * 8.0) as usize])
        .collect()
}
