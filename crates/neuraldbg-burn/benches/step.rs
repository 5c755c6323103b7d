//! What watching costs on a burn training step: the same loop (forward, backward, SGD step) on
//! the `NdArray` CPU backend, with the plain `ModuleOptimizer` and with it wrapped by `NeuralDbg`
//! (gradient norms every step, parameter norms on sampled steps, the loss), interleaved by
//! blocks of 10 steps so that all arms see the same machine state. Prints the median block time
//! (the thread's CPU time) of each arm over that of the plain one; a second plain arm (A/A) shows
//! the noise.
//!
//! ```sh
//! cargo bench -p neuraldbg-burn --bench step     # or: make bench-burn (ROUNDS=30 blocks)
//! ```
#![allow(clippy::print_stdout)]

use std::time::Instant;

/// This thread's CPU time (Linux: `/proc/thread-self/schedstat`, nanoseconds), else wall time.
/// burn's `NdArray` backend computes on the calling thread, so its CPU time is the step's cost,
/// and time other processes held the core is not counted (as `bench/overhead.py --clock
/// thread`).
enum Clock {
    Thread(f64),
    Wall(Instant),
}

impl Clock {
    fn thread_seconds() -> Option<f64> {
        let text = std::fs::read_to_string("/proc/thread-self/schedstat").ok()?;
        let ns: f64 = text.split_whitespace().next()?.parse().ok()?;
        Some(ns * 1e-9)
    }

    fn now() -> Self {
        Self::thread_seconds().map_or_else(|| Self::Wall(Instant::now()), Self::Thread)
    }

    /// Seconds since `self`.
    fn elapsed(&self) -> f64 {
        match self {
            Self::Thread(start) => Self::thread_seconds().map_or(f64::NAN, |now| now - start),
            Self::Wall(start) => start.elapsed().as_secs_f64(),
        }
    }
}

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
        let start = Clock::now();
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
        start.elapsed() / n as f64
    }
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// Steps per timed block: the period of the debugger's sampled parameter norms, so that every
/// block carries the same share of periodic work.
const BLOCK: usize = 10;

fn main() {
    let rounds: usize = std::env::var("ROUNDS")
        .ok()
        .and_then(|r| r.parse().ok())
        .unwrap_or(30);
    let device = Device::default().autodiff();
    println!("| model | parameters | plain step | A/A | watched |");
    println!("|---|---|---|---|---|");
    for (depth, width, batch) in [(8, 64, 32), (64, 16, 32), (4, 256, 64)] {
        // Arms: plain, a second plain one (A/A: the noise of the measurement), watched. They
        // take turns by blocks in a rotating order, after a warm-up that covers registration
        // and the debugger's dense first steps.
        let mut arms = [
            Loop::new(depth, width, batch, false, &device),
            Loop::new(depth, width, batch, false, &device),
            Loop::new(depth, width, batch, true, &device),
        ];
        for arm in &mut arms {
            arm.time(2 * BLOCK);
        }
        let mut times: [Vec<f64>; 3] = Default::default();
        for round in 0..rounds {
            for k in 0..3 {
                let a = (round + k) % 3;
                times[a].push(arms[a].time(BLOCK));
            }
        }
        let [plain, aa, watched] = times.map(median);
        let params = depth * (width * width + width);
        println!(
            "| {depth} x (Linear {width}x{width} + tanh), batch {batch} | {params} | {:.0} us | {:.3}x | **{:.3}x** |",
            plain * 1e6,
            aa / plain,
            watched / plain
        );
    }
}
