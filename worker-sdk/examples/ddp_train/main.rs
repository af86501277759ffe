//! `ddp_train`: a data-parallel training job in pure Rust on the muster SDK, what an
//! Accelerate training script does: each rank trains on its shard of a deterministic synthetic
//! dataset (split batches, seeded shuffling per epoch), gradients are accumulated over
//! `--grad-accum` batches and averaged across ranks in buckets at each sync step, clipped by
//! norm, and applied by SGD with momentum under a warm-up/decay schedule; each epoch ends
//! with an evaluation whose per-sample errors go through `gather_for_metrics`, and the whole
//! training state is checkpointed every `--checkpoint-every` steps and resumed from the newest
//! checkpoint when the job (re)starts.
//!
//! With the dataset a multiple of the global batch, 1 process and N processes train on the
//! same global batches, so they reach the same weights up to float summation order.
//!
//! ```text
//! muster-agent launch --nproc-per-node 4 -- target/debug/examples/ddp_train --epochs 3 \
//!     --checkpoint-dir /tmp/run --out /tmp/run/final
//! ```
//!
//! The main process prints `epoch=<e> step=<s> loss=<l> lr=<lr>` per optimizer step,
//! `eval epoch=<e> mse=<m> n=<items>` per epoch, `resumed from <dir> at epoch=<e> batch=<b>
//! step=<s>` after loading a checkpoint, and at the end `final steps=<s> checksum=<hex>
//! samples_per_s=<x>`.

mod model;

use std::{
    collections::BTreeMap,
    path::PathBuf,
    process::ExitCode,
    time::{Duration, Instant},
};

use model::{Params, Schedule, Sgd};
use muster::{
    Accelerator, Error,
    checkpoint::{self, CheckpointState, Checkpoints, DataPosition, StateDict, Stateful, Tensor},
    comm::{Communicator, ReduceOp},
    data::{ShardOptions, ShardedSampler, gather_for_metrics},
    train::{CommPrecision, GradientAccumulation, GradientSync, clip_grad_norm},
};

struct Args {
    samples: usize,
    eval_samples: usize,
    batch_size: usize,
    epochs: u64,
    hidden: usize,
    lr: f32,
    grad_accum: u32,
    clip: f32,
    seed: u64,
    bucket_bytes: usize,
    precision: CommPrecision,
    checkpoint_dir: Option<PathBuf>,
    checkpoint_every: u64,
    fail_at_step: Option<u64>,
    out: Option<PathBuf>,
    quiet: bool,
}

const USAGE: &str = "usage: ddp_train [--samples N] [--eval-samples N] [--batch-size GLOBAL] \
[--epochs N] [--hidden N] [--lr X] [--grad-accum N] [--clip X] [--seed N] [--bucket-bytes N] \
[--comm-precision f32|bf16|f16] [--checkpoint-dir DIR --checkpoint-every STEPS] \
[--fail-at-step STEP] [--out DIR] [--quiet]";

fn parse_args() -> Result<Args, String> {
    let mut args = Args {
        samples: 1024,
        eval_samples: 100,
        batch_size: 32,
        epochs: 3,
        hidden: 64,
        lr: 0.05,
        grad_accum: 2,
        clip: 1.0,
        seed: 7,
        bucket_bytes: 4096,
        precision: CommPrecision::F32,
        checkpoint_dir: None,
        checkpoint_every: 0,
        fail_at_step: None,
        out: None,
        quiet: false,
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        if flag == "--quiet" {
            args.quiet = true;
            continue;
        }
        let value = it.next().ok_or_else(|| format!("{flag} needs a value"))?;
        let num = |v: &str| -> Result<u64, String> {
            v.parse()
                .map_err(|_| format!("{flag}: {v:?} is not a non-negative integer"))
        };
        let float = |v: &str| -> Result<f32, String> {
            v.parse()
                .map_err(|_| format!("{flag}: {v:?} is not a number"))
        };
        match flag.as_str() {
            "--samples" => args.samples = num(&value)? as usize,
            "--eval-samples" => args.eval_samples = num(&value)? as usize,
            "--batch-size" => args.batch_size = num(&value)? as usize,
            "--epochs" => args.epochs = num(&value)?,
            "--hidden" => args.hidden = num(&value)? as usize,
            "--lr" => args.lr = float(&value)?,
            "--grad-accum" => args.grad_accum = num(&value)? as u32,
            "--clip" => args.clip = float(&value)?,
            "--seed" => args.seed = num(&value)?,
            "--bucket-bytes" => args.bucket_bytes = num(&value)? as usize,
            "--comm-precision" => {
                args.precision = match value.as_str() {
                    "f32" => CommPrecision::F32,
                    "bf16" => CommPrecision::BF16,
                    "f16" => CommPrecision::F16,
                    other => {
                        return Err(format!(
                            "--comm-precision: {other:?} is not f32, bf16 or f16"
                        ));
                    }
                }
            }
            "--checkpoint-dir" => args.checkpoint_dir = Some(PathBuf::from(value)),
            "--checkpoint-every" => args.checkpoint_every = num(&value)?,
            "--fail-at-step" => args.fail_at_step = Some(num(&value)?),
            "--out" => args.out = Some(PathBuf::from(value)),
            other => return Err(format!("unknown flag {other}\n{USAGE}")),
        }
    }
    if args.batch_size == 0 || args.hidden == 0 || args.samples == 0 {
        return Err("--batch-size, --hidden and --samples must be at least 1".to_owned());
    }
    if args.checkpoint_every > 0 && args.checkpoint_dir.is_none() {
        return Err("--checkpoint-every needs --checkpoint-dir".to_owned());
    }
    Ok(args)
}

fn main() -> ExitCode {
    muster::install_error_hook();
    let args = match parse_args() {
        Ok(args) => args,
        Err(message) => {
            eprintln!("ddp_train: {message}");
            return ExitCode::from(2);
        }
    };
    match run(&args) {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("ddp_train: {error}");
            ExitCode::FAILURE
        }
    }
}

/// The model's weights (`fc1.weight`, ... like a torch state dict).
impl Stateful for Params {
    fn save(&self) -> Result<StateDict, Error> {
        to_state_dict(self)
    }

    fn load(&mut self, mut state: StateDict) -> Result<(), Error> {
        let shapes = self.shapes();
        let names = self.named().map(|(name, _)| name);
        for ((name, shape), buffer) in names.iter().zip(&shapes).zip(self.buffers_mut()) {
            let values: Vec<f32> = state.take(name, shape)?;
            buffer.copy_from_slice(&values);
        }
        Ok(())
    }
}

fn to_state_dict(params: &Params) -> Result<StateDict, Error> {
    let mut state = StateDict::new();
    for ((name, values), shape) in params.named().into_iter().zip(params.shapes()) {
        state.insert(name, Tensor::from_slice(&shape, values)?);
    }
    Ok(state)
}

/// The optimizer's momentum buffers, under the parameter names.
impl Stateful for Sgd {
    fn save(&self) -> Result<StateDict, Error> {
        to_state_dict(&self.velocity)
    }

    fn load(&mut self, state: StateDict) -> Result<(), Error> {
        self.velocity.load(state)
    }
}

/// The schedule's step count.
impl Stateful for Schedule {
    fn save(&self) -> Result<StateDict, Error> {
        StateDict::new().with_metadata(&BTreeMap::from([("step", self.step)]))
    }

    fn load(&mut self, state: StateDict) -> Result<(), Error> {
        let saved: BTreeMap<String, u64> = state.metadata_as()?;
        self.step = saved
            .get("step")
            .copied()
            .ok_or_else(|| Error::Checkpoint("scheduler state has no 'step'".to_owned()))?;
        Ok(())
    }
}

/// Registers everything a resumed run needs.
fn registry<'a>(
    params: &'a mut Params,
    sgd: &'a mut Sgd,
    schedule: &'a mut Schedule,
    position: &'a mut DataPosition,
) -> CheckpointState<'a> {
    let mut state = CheckpointState::new();
    state
        .register_model("model", params)
        .register_optimizer("optimizer", sgd)
        .register_scheduler("scheduler", schedule)
        .register_data_position("data", position);
    state
}

fn run(args: &Args) -> Result<(), Error> {
    let accelerator = Accelerator::from_env()?;
    let comm = Communicator::new(&accelerator)?;
    let main = accelerator.is_main_process();
    let options = ShardOptions::new(args.batch_size).split_batches(true);
    let mut sampler = ShardedSampler::for_accelerator(args.samples, options, &accelerator)?
        .with_shuffle(args.seed);
    let steps_per_epoch = (sampler.len() as u64).div_ceil(u64::from(args.grad_accum.max(1)));

    let mut params = Params::init(args.hidden, args.seed);
    let mut grads = Params::zeros(args.hidden);
    let mut sgd = Sgd::new(args.hidden, 0.9);
    let mut schedule = Schedule {
        peak: args.lr,
        warmup: steps_per_epoch.min(10),
        total: steps_per_epoch * args.epochs,
        step: 0,
    };
    let mut position = DataPosition::default();
    let mut checkpoints = match &args.checkpoint_dir {
        Some(dir) => Some(Checkpoints::new(dir)?.with_total_limit(2)),
        None => None,
    };
    if let Some(checkpoints) = &mut checkpoints {
        let mut state = registry(&mut params, &mut sgd, &mut schedule, &mut position);
        if let Some(dir) = checkpoints.load_latest(&accelerator, &mut state)? {
            drop(state);
            if main {
                println!(
                    "resumed from {} at epoch={} batch={} step={}",
                    dir.display(),
                    position.epoch,
                    position.step,
                    schedule.step
                );
            }
        }
    }

    let sync = GradientSync::new()
        .bucket_bytes(args.bucket_bytes)
        .precision(args.precision);
    let mut accumulation = GradientAccumulation::new(args.grad_accum);
    let mut hidden = vec![0.0f32; args.hidden];
    let started = Instant::now();
    let mut trained = 0u64;
    let (mut loss_sum, mut loss_items) = (0.0f64, 0usize);
    for epoch in position.epoch..args.epochs {
        sampler.set_epoch(epoch);
        let skip = if epoch == position.epoch {
            position.step as usize
        } else {
            0
        };
        let last = sampler.len().saturating_sub(1);
        for batch in sampler.iter().skip(skip) {
            // The loss of each batch is averaged over its items and over the accumulated
            // batches, so the summed gradient is the mean over the global batch.
            let scale = accumulation.loss_scale() / batch.indices.len().max(1) as f32;
            for &i in &batch.indices {
                let (x, y) = model::sample(args.seed, i as u64);
                let squared = model::backward(&params, &mut grads, &x, y, scale, &mut hidden);
                loss_sum += f64::from(squared);
                loss_items += 1;
            }
            trained += batch.indices.len() as u64;
            if !accumulation.accumulate(batch.step == last) {
                continue;
            }
            sync.average(&comm, &mut grads.buffers_mut())?;
            // Averaged gradients are the same on every rank: the local norm is the global one.
            clip_grad_norm(&mut grads.buffers_mut(), args.clip, Ok::<_, Error>)?;
            let lr = schedule.lr();
            sgd.step(&mut params, &mut grads, lr);
            grads.zero();
            schedule.step += 1;
            let mut loss = [loss_sum / loss_items.max(1) as f64];
            comm.all_reduce(&mut loss, ReduceOp::Avg)?;
            (loss_sum, loss_items) = (0.0, 0);
            if main && !args.quiet {
                println!(
                    "epoch={epoch} step={} loss={:.6} lr={lr:.5}",
                    schedule.step, loss[0]
                );
            }
            position = DataPosition {
                epoch,
                step: batch.step as u64 + 1,
            };
            if position.step as usize == sampler.len() {
                position = DataPosition {
                    epoch: epoch + 1,
                    step: 0,
                };
            }
            if let Some(checkpoints) = &mut checkpoints
                && args.checkpoint_every > 0
                && schedule.step.is_multiple_of(args.checkpoint_every)
            {
                let state = registry(&mut params, &mut sgd, &mut schedule, &mut position);
                checkpoints.save(&accelerator, &state)?;
            }
            if args.fail_at_step == Some(schedule.step)
                && accelerator.restart_count() == 0
                && accelerator.process_index() + 1 == accelerator.num_processes()
            {
                eprintln!(
                    "rank {} aborting at step {} (--fail-at-step)",
                    accelerator.process_index(),
                    schedule.step
                );
                std::process::abort();
            }
        }
        evaluate(args, &accelerator, &comm, &params, epoch, &mut hidden)?;
    }
    let elapsed = started.elapsed().max(Duration::from_micros(1));
    let mut samples = [trained as i64];
    comm.all_reduce(&mut samples, ReduceOp::Sum)?;
    if let Some(out) = &args.out {
        checkpoint::save_model(&accelerator, out, &to_state_dict(&params)?, u64::MAX)?;
    }
    if main {
        println!(
            "final steps={} checksum={:016x} samples_per_s={:.0}",
            schedule.step,
            checksum(&params),
            samples[0] as f64 / elapsed.as_secs_f64()
        );
    }
    accelerator.finish()
}

/// Mean squared error over the evaluation set (items after the training set), through
/// `gather_for_metrics`: the padding that evens out the last batch is dropped, so every
/// process count averages exactly `--eval-samples` errors.
fn evaluate(
    args: &Args,
    accelerator: &Accelerator,
    comm: &Communicator,
    params: &Params,
    epoch: u64,
    hidden: &mut [f32],
) -> Result<(), Error> {
    if args.eval_samples == 0 {
        return Ok(());
    }
    let options = ShardOptions::new(args.batch_size);
    let sampler = ShardedSampler::for_accelerator(args.eval_samples, options, accelerator)?;
    let (mut sum, mut n) = (0.0f64, 0usize);
    for batch in sampler.iter() {
        let errors: Vec<f64> = batch
            .indices
            .iter()
            .map(|&i| {
                let (x, y) = model::sample(args.seed, (args.samples + i) as u64);
                let err = model::forward(params, &x, hidden) - y;
                f64::from(err * err)
            })
            .collect();
        let all = gather_for_metrics(comm, &errors, &batch.state)?;
        sum += all.iter().sum::<f64>();
        n += all.len();
    }
    if accelerator.is_main_process() {
        println!("eval epoch={epoch} mse={:.6} n={n}", sum / n.max(1) as f64);
    }
    Ok(())
}

/// FNV-1a over the weights' bits: equal only for bit-identical weights.
fn checksum(params: &Params) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for (_, values) in params.named() {
        for v in values {
            for b in v.to_bits().to_le_bytes() {
                h = (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3);
            }
        }
    }
    h
}
