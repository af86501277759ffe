//! The model `ddp_train` trains: a two-layer perceptron (inputs -> tanh hidden layer -> one
//! output) with hand-written forward and backward passes, on a synthetic regression dataset
//! that every rank computes alike from the item index.

use muster::train::SeededRng;

/// Inputs per sample.
pub const INPUTS: usize = 8;

/// Weights or gradients, one buffer per tensor (so gradient bucketing has several to fuse).
#[derive(Debug, Clone, PartialEq)]
pub struct Params {
    /// Hidden x inputs, row-major.
    pub w1: Vec<f32>,
    /// Hidden.
    pub b1: Vec<f32>,
    /// Hidden.
    pub w2: Vec<f32>,
    /// One.
    pub b2: Vec<f32>,
}

impl Params {
    /// Zeros shaped for `hidden` units.
    pub fn zeros(hidden: usize) -> Self {
        Self {
            w1: vec![0.0; hidden * INPUTS],
            b1: vec![0.0; hidden],
            w2: vec![0.0; hidden],
            b2: vec![0.0; 1],
        }
    }

    /// Seeded initialisation (scaled normal draws), identical on every rank.
    pub fn init(hidden: usize, seed: u64) -> Self {
        let mut rng = SeededRng::new(seed);
        let mut p = Self::zeros(hidden);
        let s1 = 1.0 / (INPUTS as f32).sqrt();
        let s2 = 1.0 / (hidden as f32).sqrt();
        p.w1.iter_mut().for_each(|w| *w = rng.next_normal() * s1);
        p.w2.iter_mut().for_each(|w| *w = rng.next_normal() * s2);
        p
    }

    /// The tensors by name, in a fixed order (checkpoints and gradient buckets use it).
    pub fn named(&self) -> [(&'static str, &[f32]); 4] {
        [
            ("fc1.weight", &self.w1),
            ("fc1.bias", &self.b1),
            ("fc2.weight", &self.w2),
            ("fc2.bias", &self.b2),
        ]
    }

    /// The tensors, mutable, in [`Params::named`]'s order.
    pub fn buffers_mut(&mut self) -> [&mut [f32]; 4] {
        [&mut self.w1, &mut self.b1, &mut self.w2, &mut self.b2]
    }

    /// Shapes in [`Params::named`]'s order.
    pub fn shapes(&self) -> [Vec<usize>; 4] {
        let hidden = self.b1.len();
        [vec![hidden, INPUTS], vec![hidden], vec![1, hidden], vec![1]]
    }

    /// Sets every value to zero.
    pub fn zero(&mut self) {
        for b in self.buffers_mut() {
            b.fill(0.0);
        }
    }
}

/// Sample `index` of the dataset: inputs drawn from a generator seeded by the index, target a
/// smooth function of them plus a little noise.
pub fn sample(seed: u64, index: u64) -> ([f32; INPUTS], f32) {
    let mut rng = SeededRng::new(seed ^ index.wrapping_mul(0x9E37_79B9_7F4A_7C15));
    let mut x = [0.0f32; INPUTS];
    x.iter_mut().for_each(|v| *v = rng.next_normal());
    let a: f32 = x
        .iter()
        .enumerate()
        .map(|(k, v)| v * (k as f32 + 1.0) * 0.1)
        .sum();
    let y = a.sin() + 0.5 * x[0] * x[1] + 0.05 * rng.next_normal();
    (x, y)
}

/// The prediction for `x`, and the hidden activations the backward pass needs.
pub fn forward(p: &Params, x: &[f32; INPUTS], hidden: &mut [f32]) -> f32 {
    let mut out = p.b2[0];
    for (j, h) in hidden.iter_mut().enumerate() {
        let row = &p.w1[j * INPUTS..(j + 1) * INPUTS];
        let z: f32 = p.b1[j] + row.iter().zip(x).map(|(w, v)| w * v).sum::<f32>();
        *h = z.tanh();
        out += p.w2[j] * *h;
    }
    out
}

/// Adds `scale` times the gradient of the squared error of one sample to `g`; returns the
/// squared error.
pub fn backward(
    p: &Params,
    g: &mut Params,
    x: &[f32; INPUTS],
    y: f32,
    scale: f32,
    hidden: &mut [f32],
) -> f32 {
    let pred = forward(p, x, hidden);
    let err = pred - y;
    let d = 2.0 * err * scale;
    g.b2[0] += d;
    for (j, &h) in hidden.iter().enumerate() {
        g.w2[j] += d * h;
        let dz = d * p.w2[j] * (1.0 - h * h);
        g.b1[j] += dz;
        for (gw, v) in g.w1[j * INPUTS..(j + 1) * INPUTS].iter_mut().zip(x) {
            *gw += dz * v;
        }
    }
    err * err
}

/// SGD with momentum (torch's `SGD(momentum=...)`): the optimizer whose state checkpoints
/// carry.
#[derive(Debug, Clone, PartialEq)]
pub struct Sgd {
    /// Momentum buffers, shaped like the parameters.
    pub velocity: Params,
    /// Momentum factor.
    pub momentum: f32,
}

impl Sgd {
    /// Zero velocity for `hidden` units.
    pub fn new(hidden: usize, momentum: f32) -> Self {
        Self {
            velocity: Params::zeros(hidden),
            momentum,
        }
    }

    /// One step with learning rate `lr`.
    pub fn step(&mut self, p: &mut Params, g: &mut Params, lr: f32) {
        let momentum = self.momentum;
        let grads = g.buffers_mut();
        let vels = self.velocity.buffers_mut();
        for ((w, gr), v) in p.buffers_mut().into_iter().zip(grads).zip(vels) {
            for ((w, gr), v) in w.iter_mut().zip(gr.iter()).zip(v.iter_mut()) {
                *v = momentum * *v + gr;
                *w -= lr * *v;
            }
        }
    }
}

/// A linear warm-up then linear decay learning-rate schedule; its state is the step count.
#[derive(Debug, Clone, PartialEq)]
pub struct Schedule {
    /// Peak learning rate.
    pub peak: f32,
    /// Warm-up steps.
    pub warmup: u64,
    /// Total steps.
    pub total: u64,
    /// Steps taken.
    pub step: u64,
}

impl Schedule {
    /// The learning rate for the current step.
    pub fn lr(&self) -> f32 {
        let s = self.step as f32;
        if self.step < self.warmup {
            self.peak * (s + 1.0) / self.warmup as f32
        } else {
            let left = self.total.saturating_sub(self.step) as f32;
            let span = self.total.saturating_sub(self.warmup).max(1) as f32;
            self.peak * (left / span).max(0.05)
        }
    }
}
