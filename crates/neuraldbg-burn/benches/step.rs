//! What watching costs on a burn training step: the same loop (forward, backward, SGD step) on
//! the `NdArray` CPU backend, with the plain `ModuleOptimizer` and with it wrapped by `NeuralDbg`
//! (gradient norms every step, parameter norms on sampled steps, the loss), interleaved in
//! rounds so that both see the same machine state. Prints the median time per step of each and
//! their ratio.
//!
//! ```sh
//! cargo bench -p neuraldbg-burn --bench step     # or: make bench-burn
//! ```
#![allow(clippy::print_stdout)]

use std::time::Instant;

use burn::module::Module;
use burn::nn::{Linear, LinearConfig};
use burn::optim::{GradientsParams, ModuleOptimizer, SgdConfig};
use burn::tensor::{Device, Distribution, Tensor};
use neuraldbg_burn::{NeuralDbg, Options, WatchedOptimizer};

#[derive(Module, Debug)]
struct Mlp {
    layers: Vec<Linear>,
}

impl Mlp {
    fn forward(&self, x: Tensor<2>) -> Tensor<2> {
        self.layers.iter().fold(x, |x, l| l.forward(x).tanh())
    }
}

enum Optim {
    Plain(ModuleOptimizer),
    Watched(Box<WatchedOptimizer>),
}

struct Loop {
    model: Option<Mlp>,
    optim: Optim,
    x: Tensor<2>,
}

impl Loop {
    fn new(depth: usize, width: usize, batch: usize, watched: bool, device: &Device) -> Self {
        device.seed(0);
        let model = Mlp {
            layers: (0..depth)
                .map(|_| LinearConfig::new(width, width).init(device))
                .collect(),
        };
        let sgd = SgdConfig::new().init();
        let optim = if watched {
            let dbg = NeuralDbg::new(Options::default().optimizer("SGD")).expect("valid options");
            Optim::Watched(Box::new(dbg.watch(sgd)))
        } else {
            Optim::Plain(sgd)
        };
        Self {
            model: Some(model),
            optim,
            x: Tensor::random([batch, width], Distribution::Default, device),
        }
    }

    fn step(&mut self) {
        let model = self.model.take().expect("a model between steps");
        let loss = model.forward(self.x.clone()).square().mean();
        if let Optim::Watched(w) = &mut self.optim {
            w.record_loss(&loss);
        }
        let grads = GradientsParams::from_grads(loss.backward(), &model);
        self.model = Some(match &mut self.optim {
            Optim::Plain(o) => o.step(1e-3, model, grads),
            Optim::Watched(w) => w.step(1e-3, model, grads),
        });
    }

    /// Seconds per step over `n` steps; the last update is read back so that the time covers
    /// the work, whatever the backend defers.
    fn time(&mut self, n: usize) -> f64 {
        let start = Instant::now();
        for _ in 0..n {
            self.step();
        }
        let model = self.model.as_ref().expect("a model between steps");
        let _: Vec<f32> = model.layers[0]
            .weight
            .val()
            .into_data()
            .try_to_vec()
            .expect("f32");
        start.elapsed().as_secs_f64() / n as f64
    }
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn main() {
    let device = Device::default().autodiff();
    let rounds = 7;
    let steps = 30;
    println!("| model | params | plain step | watched step | ratio |");
    println!("|---|---|---|---|---|");
    for (depth, width, batch) in [(8, 64, 32), (64, 16, 32), (4, 256, 64)] {
        let mut plain = Loop::new(depth, width, batch, false, &device);
        let mut watched = Loop::new(depth, width, batch, true, &device);
        plain.time(10);
        watched.time(10);
        let (mut p, mut w) = (Vec::new(), Vec::new());
        for _ in 0..rounds {
            p.push(plain.time(steps));
            w.push(watched.time(steps));
        }
        let (p, w) = (median(p), median(w));
        let params = depth * (width * width + width);
        println!(
            "| {depth}x Linear({width}) + tanh, batch {batch} | {params} | {:.0} us | {:.0} us | {:.2}x |",
            p * 1e6,
            w * 1e6,
            w / p
        );
    }
}
