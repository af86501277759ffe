//! Training utilities that do not depend on how gradients travel: gradient accumulation
//! (when to synchronise), gradient bucketing (fusing many small buffers before an all-reduce),
//! clipping by value and by global norm, a dynamic loss scaler whose skip decision is the same
//! on every rank, and a seeded random generator every rank draws the same sequence from.
//!
//! The cross-process steps (the global norm's sum of squares, "did any rank overflow") take
//! the reduction as a closure, so that their arithmetic is tested without a communicator;
//! [`GradientSync`], [`clip_grad_norm_across`] and [`LossScaler::update_across`] are the same
//! steps over a [`Communicator`].

use std::ops::Range;

use half::{bf16, f16};

use crate::{
    Error,
    comm::{Communicator, ReduceOp},
};

/// Decides, batch by batch, whether gradients are synchronised (all-reduced and the optimizer
/// stepped) or only accumulated locally, as Accelerate's `accumulate` context does: every
/// `steps`-th batch synchronises, and so does the last batch of the data (a forced sync), so
/// no accumulated gradient is left behind at the end of an epoch.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GradientAccumulation {
    steps: u32,
    /// Batches accumulated since the last synchronisation.
    pending: u32,
    sync_gradients: bool,
}

impl GradientAccumulation {
    /// Synchronise every `steps` batches (1: every batch; 0 is taken as 1).
    pub fn new(steps: u32) -> Self {
        Self {
            steps: steps.max(1),
            pending: 0,
            sync_gradients: true,
        }
    }

    /// Accumulation steps.
    pub fn steps(&self) -> u32 {
        self.steps
    }

    /// Marks one more batch; `end_of_data` forces a synchronisation. Returns (and remembers, see
    /// [`Self::sync_gradients`]) whether this batch's gradients are synchronised.
    pub fn accumulate(&mut self, end_of_data: bool) -> bool {
        self.pending += 1;
        self.sync_gradients = self.pending >= self.steps || end_of_data;
        if self.sync_gradients {
            self.pending = 0;
        }
        self.sync_gradients
    }

    /// Whether the last batch synchronised (Accelerate's `accelerator.sync_gradients`).
    pub fn sync_gradients(&self) -> bool {
        self.sync_gradients
    }

    /// The factor to scale each batch's loss by so that accumulated gradients average over
    /// the accumulated batches (1/steps).
    pub fn loss_scale(&self) -> f32 {
        1.0 / self.steps as f32
    }

    /// Batches accumulated since the last synchronisation (for checkpoints).
    pub fn pending(&self) -> u32 {
        self.pending
    }

    /// Restores [`Self::pending`] from a checkpoint.
    pub fn set_pending(&mut self, pending: u32) {
        self.pending = pending.min(self.steps.saturating_sub(1));
    }
}

/// Groups buffers of the given lengths (in elements) into buckets of at most `cap` elements,
/// in order, as DDP's gradient bucketing does; a buffer larger than `cap` is a bucket of its
/// own. Each bucket is the range of buffer indices it holds.
pub fn buckets(lengths: &[usize], cap: usize) -> Vec<Range<usize>> {
    let cap = cap.max(1);
    let mut out = vec![];
    let mut start = 0;
    let mut size = 0usize;
    for (i, &len) in lengths.iter().enumerate() {
        if i > start && size + len > cap {
            out.push(start..i);
            start = i;
            size = 0;
        }
        size += len;
    }
    if start < lengths.len() {
        out.push(start..lengths.len());
    }
    out
}

/// Copies the buffers of one bucket into one contiguous vector (to all-reduce at once).
pub fn pack<T: Copy>(buffers: &[&[T]]) -> Vec<T> {
    let mut out = Vec::with_capacity(buffers.iter().map(|b| b.len()).sum());
    for b in buffers {
        out.extend_from_slice(b);
    }
    out
}

/// Copies a packed bucket back into its buffers (the inverse of [`pack`]). Returns false,
/// changing nothing, when the lengths do not add up.
pub fn unpack<T: Copy>(packed: &[T], buffers: &mut [&mut [T]]) -> bool {
    if packed.len() != buffers.iter().map(|b| b.len()).sum::<usize>() {
        return false;
    }
    let mut at = 0;
    for b in buffers.iter_mut() {
        let n = b.len();
        b.copy_from_slice(&packed[at..at + n]);
        at += n;
    }
    true
}

/// Clamps every gradient element to `[-clip, clip]` (torch's `clip_grad_value_`). Local: with
/// synchronised gradients every rank clamps the same values.
pub fn clip_grad_value(grads: &mut [&mut [f32]], clip: f32) {
    let clip = clip.abs();
    for g in grads.iter_mut() {
        for x in g.iter_mut() {
            *x = x.clamp(-clip, clip);
        }
    }
}

/// Scales gradients so that their global L2 norm is at most `max_norm` (torch's
/// `clip_grad_norm_`), and returns the norm before clipping. `sum_across` adds this process's
/// sum of squares to every other process's (an all-reduce of one value; the identity for one
/// process, or for gradients already synchronised where every rank holds the same values,
/// pass `Ok`): the norm is that of the gradients of every process together.
pub fn clip_grad_norm<E>(
    grads: &mut [&mut [f32]],
    max_norm: f32,
    sum_across: impl FnOnce(f64) -> Result<f64, E>,
) -> Result<f32, E> {
    let local: f64 = grads
        .iter()
        .flat_map(|g| g.iter())
        .map(|&x| f64::from(x) * f64::from(x))
        .sum();
    let norm = sum_across(local)?.sqrt() as f32;
    // torch adds 1e-6 to the norm so that a zero norm never divides by zero.
    let coef = max_norm / (norm + 1e-6);
    if coef < 1.0 {
        for g in grads.iter_mut() {
            for x in g.iter_mut() {
                *x *= coef;
            }
        }
    }
    Ok(norm)
}

/// Whether any gradient element is infinite or NaN (an fp16 overflow).
pub fn has_inf_or_nan(grads: &[&[f32]]) -> bool {
    grads.iter().any(|g| g.iter().any(|x| !x.is_finite()))
}

/// A dynamic loss scaler (torch's `GradScaler`): the loss is multiplied by `scale` before the
/// backward pass; when any rank's gradients overflowed, every rank skips the step and the
/// scale backs off; after `growth_interval` clean steps it grows.
#[derive(Debug, Clone, PartialEq)]
pub struct LossScaler {
    scale: f32,
    growth_factor: f32,
    backoff_factor: f32,
    growth_interval: u32,
    clean_steps: u32,
}

impl Default for LossScaler {
    /// torch's defaults: scale 65536, growth 2x every 2000 clean steps, backoff 0.5x.
    fn default() -> Self {
        Self::new(65536.0, 2.0, 0.5, 2000)
    }
}

impl LossScaler {
    /// A scaler starting at `scale`.
    pub fn new(scale: f32, growth_factor: f32, backoff_factor: f32, growth_interval: u32) -> Self {
        Self {
            scale,
            growth_factor,
            backoff_factor,
            growth_interval: growth_interval.max(1),
            clean_steps: 0,
        }
    }

    /// The current scale.
    pub fn scale(&self) -> f32 {
        self.scale
    }

    /// Divides gradients by the scale (before clipping and the optimizer step).
    pub fn unscale(&self, grads: &mut [&mut [f32]]) {
        let inv = 1.0 / self.scale;
        for g in grads.iter_mut() {
            for x in g.iter_mut() {
                *x *= inv;
            }
        }
    }

    /// Ends a step: `local_overflow` is whether this rank's gradients hold an inf or NaN, and
    /// `any_across` turns it into "did any rank overflow" (an all-reduce max of 0/1). Returns
    /// whether the optimizer step must be skipped, the same answer on every rank, and updates
    /// the scale.
    pub fn update<E>(
        &mut self,
        local_overflow: bool,
        any_across: impl FnOnce(bool) -> Result<bool, E>,
    ) -> Result<bool, E> {
        let overflow = any_across(local_overflow)?;
        if overflow {
            self.scale = (self.scale * self.backoff_factor).max(f32::MIN_POSITIVE);
            self.clean_steps = 0;
        } else {
            self.clean_steps += 1;
            if self.clean_steps >= self.growth_interval {
                self.scale *= self.growth_factor;
                self.clean_steps = 0;
            }
        }
        Ok(overflow)
    }

    /// The scale and the clean-step count, for checkpoints.
    pub fn state(&self) -> (f32, u32) {
        (self.scale, self.clean_steps)
    }

    /// Restores [`Self::state`].
    pub fn set_state(&mut self, scale: f32, clean_steps: u32) {
        self.scale = scale;
        self.clean_steps = clean_steps;
    }
}

/// What gradients travel as during their all-reduce: full precision, or half the bytes on
/// request (the values are pre-divided by the world size, as DDP's fp16 hook does, so that a
/// sum of many ranks stays in range, and rounded once per hop).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum CommPrecision {
    /// f32 (exact up to summation order).
    #[default]
    F32,
    /// bfloat16: f32's range, 8 bits of mantissa.
    BF16,
    /// IEEE half: 11 bits of mantissa, range up to 65504.
    F16,
}

/// Averages gradients across the ranks like DDP's reducer: the buffers are fused into buckets
/// of at most `bucket_bytes` (25 MiB by default, DDP's `bucket_cap_mb`), so that a model of
/// many small tensors costs a few large all-reduces instead of one per tensor, and each bucket
/// travels in the requested [`CommPrecision`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GradientSync {
    bucket_bytes: usize,
    precision: CommPrecision,
}

impl Default for GradientSync {
    fn default() -> Self {
        Self {
            bucket_bytes: Self::DEFAULT_BUCKET_BYTES,
            precision: CommPrecision::F32,
        }
    }
}

impl GradientSync {
    /// DDP's default bucket size.
    pub const DEFAULT_BUCKET_BYTES: usize = 25 << 20;

    /// 25 MiB buckets in f32.
    pub fn new() -> Self {
        Self::default()
    }

    /// Caps each bucket at `bytes` of f32 gradients (a buffer larger than that is a bucket of
    /// its own).
    pub fn bucket_bytes(mut self, bytes: usize) -> Self {
        self.bucket_bytes = bytes.max(4);
        self
    }

    /// Sends gradients in `precision`.
    pub fn precision(mut self, precision: CommPrecision) -> Self {
        self.precision = precision;
        self
    }

    /// How the buffers of these lengths are bucketed (indices into `grads`).
    pub fn plan(&self, lengths: &[usize]) -> Vec<Range<usize>> {
        buckets(lengths, self.bucket_bytes / 4)
    }

    /// Replaces every gradient by its mean over the ranks. Every rank must pass buffers of the
    /// same lengths in the same order (a mismatch is reported by the communicator with every
    /// rank's shape). One process: nothing to do.
    pub fn average(&self, comm: &Communicator, grads: &mut [&mut [f32]]) -> Result<(), Error> {
        let world = comm.world_size();
        if world == 1 {
            return Ok(());
        }
        let lengths: Vec<usize> = grads.iter().map(|g| g.len()).collect();
        let inv = 1.0 / world as f32;
        for bucket in self.plan(&lengths) {
            let members = &mut grads[bucket];
            let mut packed = pack(&members.iter().map(|g| &**g).collect::<Vec<&[f32]>>());
            match self.precision {
                CommPrecision::F32 => comm.all_reduce(&mut packed, ReduceOp::Avg)?,
                CommPrecision::BF16 => {
                    let mut wire: Vec<bf16> =
                        packed.iter().map(|&x| bf16::from_f32(x * inv)).collect();
                    comm.all_reduce(&mut wire, ReduceOp::Sum)?;
                    for (x, w) in packed.iter_mut().zip(&wire) {
                        *x = w.to_f32();
                    }
                }
                CommPrecision::F16 => {
                    let mut wire: Vec<f16> =
                        packed.iter().map(|&x| f16::from_f32(x * inv)).collect();
                    comm.all_reduce(&mut wire, ReduceOp::Sum)?;
                    for (x, w) in packed.iter_mut().zip(&wire) {
                        *x = w.to_f32();
                    }
                }
            }
            unpack(&packed, members);
        }
        Ok(())
    }
}

/// [`clip_grad_norm`] for gradients sharded across the ranks (each rank holds a disjoint part,
/// as with ZeRO/FSDP): the norm is that of every rank's part together, found with one
/// all-reduce of a single f64, and every rank scales its part by the same factor. Gradients
/// that DDP already averaged are identical on every rank; call [`clip_grad_norm`] with `Ok`
/// for those (an all-reduce would count them once per rank).
pub fn clip_grad_norm_across(
    comm: &Communicator,
    grads: &mut [&mut [f32]],
    max_norm: f32,
) -> Result<f32, Error> {
    clip_grad_norm(grads, max_norm, |local| {
        let mut sum = [local];
        comm.all_reduce(&mut sum, ReduceOp::Sum)?;
        Ok(sum[0])
    })
}

impl LossScaler {
    /// [`LossScaler::update`] over a communicator: this rank's gradients are checked for
    /// inf/NaN and one all-reduce (max of a byte) tells every rank whether any overflowed, so
    /// every rank skips the same steps. Returns whether to skip this step.
    pub fn update_across(&mut self, comm: &Communicator, grads: &[&[f32]]) -> Result<bool, Error> {
        self.update(has_inf_or_nan(grads), |local| {
            let mut any = [u8::from(local)];
            comm.all_reduce(&mut any, ReduceOp::Max)?;
            Ok(any[0] != 0)
        })
    }
}

/// A small seeded generator (SplitMix64): every rank that seeds it alike draws the same
/// sequence, so shuffles and initialisations agree without communication. Its state is one
/// `u64`, saved and restored with checkpoints.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SeededRng {
    state: u64,
}

impl SeededRng {
    /// A generator seeded with `seed`.
    pub fn new(seed: u64) -> Self {
        Self { state: seed }
    }

    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.state = self.state.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.state;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// A uniform float in [0, 1).
    pub fn next_f32(&mut self) -> f32 {
        (self.next_u64() >> 40) as f32 / (1u64 << 24) as f32
    }

    /// A uniform integer in `0..n` (n > 0), without modulo bias.
    pub fn below(&mut self, n: u64) -> u64 {
        let n = n.max(1);
        let zone = u64::MAX - u64::MAX % n;
        loop {
            let x = self.next_u64();
            if x < zone {
                return x % n;
            }
        }
    }

    /// Shuffles `items` in place (Fisher–Yates).
    pub fn shuffle<T>(&mut self, items: &mut [T]) {
        for i in (1..items.len()).rev() {
            let j = self.below(i as u64 + 1) as usize;
            items.swap(i, j);
        }
    }

    /// A standard normal draw (Box–Muller), for weight initialisation.
    pub fn next_normal(&mut self) -> f32 {
        // 1 - u is in (0, 1], so the logarithm is finite.
        let u = 1.0 - f64::from(self.next_f32());
        let v = f64::from(self.next_f32());
        ((-2.0 * u.ln()).sqrt() * (std::f64::consts::TAU * v).cos()) as f32
    }

    /// The state, for checkpoints ([`SeededRng::new`] with it resumes the sequence).
    pub fn state(&self) -> u64 {
        self.state
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use std::convert::Infallible;

    #[test]
    fn accumulation_syncs_every_n_and_at_the_end() {
        let mut a = GradientAccumulation::new(3);
        let syncs: Vec<bool> = (0..7).map(|i| a.accumulate(i == 6)).collect();
        assert_eq!(syncs, [false, false, true, false, false, true, true]);
        assert!(a.sync_gradients());
        assert_eq!(a.pending(), 0);
        let mut one = GradientAccumulation::new(0);
        assert!(one.accumulate(false));
        assert!((GradientAccumulation::new(4).loss_scale() - 0.25).abs() < 1e-7);
    }

    #[test]
    fn buckets_fill_in_order_and_big_buffers_stand_alone() {
        assert_eq!(
            buckets(&[2, 2, 2, 10, 1, 1], 4),
            vec![0..2, 2..3, 3..4, 4..6]
        );
        assert_eq!(buckets(&[], 4), Vec::<Range<usize>>::new());
        assert_eq!(buckets(&[5], 4), vec![0..1]);
        let (a, b) = ([1.0f32, 2.0], [3.0f32]);
        let packed = pack(&[&a, &b]);
        assert_eq!(packed, [1.0, 2.0, 3.0]);
        let (mut x, mut y) = ([0.0f32; 2], [0.0f32; 1]);
        assert!(unpack(&packed, &mut [&mut x, &mut y]));
        assert_eq!((x, y), ([1.0, 2.0], [3.0]));
        assert!(!unpack(&packed[..2], &mut [&mut x, &mut y]));
    }

    #[test]
    fn clipping_by_value_and_by_global_norm() {
        let mut g = [3.0f32, -4.0, 0.5];
        clip_grad_value(&mut [&mut g], 1.0);
        assert_eq!(g, [1.0, -1.0, 0.5]);

        // Two "ranks" of one gradient each: [3] and [4] make a global norm of 5.
        let mut a = [3.0f32];
        let norm = clip_grad_norm(&mut [&mut a], 1.0, |local| {
            Ok::<_, Infallible>(local + 16.0)
        })
        .unwrap();
        assert!((norm - 5.0).abs() < 1e-6);
        assert!((a[0] - 0.6).abs() < 1e-5, "{a:?}");
        // Below the limit nothing changes.
        let mut b = [0.1f32, 0.1];
        clip_grad_norm(&mut [&mut b], 1.0, Ok::<_, Infallible>).unwrap();
        assert_eq!(b, [0.1, 0.1]);
    }

    #[test]
    fn the_loss_scaler_skips_on_any_overflow_backs_off_and_grows() {
        let mut s = LossScaler::new(1024.0, 2.0, 0.5, 2);
        // This rank is clean but another overflowed: skip, back off.
        assert!(s.update(false, |_| Ok::<_, Infallible>(true)).unwrap());
        assert_eq!(s.scale(), 512.0);
        assert!(!s.update(false, Ok::<_, Infallible>).unwrap());
        assert!(!s.update(false, Ok::<_, Infallible>).unwrap());
        assert_eq!(s.scale(), 1024.0);
        assert!(has_inf_or_nan(&[&[1.0, f32::INFINITY]]));
        assert!(!has_inf_or_nan(&[&[1.0, 2.0]]));
        let mut g = [1024.0f32];
        s.unscale(&mut [&mut g]);
        assert_eq!(g, [1.0]);
    }

    #[test]
    fn seeded_generators_agree_and_shuffle_everything() {
        let (mut a, mut b) = (SeededRng::new(42), SeededRng::new(42));
        let xs: Vec<u64> = (0..5).map(|_| a.next_u64()).collect();
        let ys: Vec<u64> = (0..5).map(|_| b.next_u64()).collect();
        assert_eq!(xs, ys);
        let mut v: Vec<u32> = (0..100).collect();
        SeededRng::new(7).shuffle(&mut v);
        let mut w: Vec<u32> = (0..100).collect();
        SeededRng::new(7).shuffle(&mut w);
        assert_eq!(v, w);
        assert_ne!(v, (0..100).collect::<Vec<u32>>());
        v.sort_unstable();
        assert_eq!(v, (0..100).collect::<Vec<u32>>());
        let f = SeededRng::new(1).next_f32();
        assert!((0.0..1.0).contains(&f));
    }
}
