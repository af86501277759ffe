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
//! samples_per_s=<x>` (in in-place mode followed by ` check_ns=<n> step_us=<u>`: what the
//! per-step membership check costs, measured over a million calls, and the mean step time).
//!
//! In-place recovery: under `muster-agent launch --recovery in-place` (`MUSTER_RECOVERY`; no
//! option of its own), a rank's death does not end the run. The training loop is re-entrant
//! from the committed state (weights, optimizer, schedule, data position, evaluations done): a
//! step whose loss or gradient all_reduce fails with a recoverable error is discarded
//! (gradients and accumulators zeroed), the rank takes part in a quorum, rebuilds its
//! communicator, heals or is healed, and redoes the step. A step is committed on a rank when
//! its gradient all_reduce returned there (its last collective, so its result had every rank's
//! gradient); the quorum adopts the highest committed step, so a step some rank applied is
//! applied by all. A replacement starts with a quorum and is healed before its first step. The
//! main process prints `recovered epoch=<E> step=<S> healed=<ranks> from=<sources>
//! quorum_ms=<q> rebuild_ms=<r> heal_ms=<h> failed_unix_ns=<when it saw the change>` after each recovery. Reductions run in rank
//! order, so the final weights are bit-identical to a run without failures (a healed main
//! process does not print the loss lines of the steps it received).

mod model;

use std::{
    collections::BTreeMap,
    path::PathBuf,
    process::ExitCode,
    time::{Duration, Instant, SystemTime, UNIX_EPOCH},
};

use model::{Params, Schedule, Sgd};
use muster::{
    Accelerator, Error, Recovery,
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
    /// A pause after each step (tests and benchmarks pace the run to kill ranks mid-way).
    step_sleep: Duration,
}

const USAGE: &str = "usage: ddp_train [--samples N] [--eval-samples N] [--batch-size GLOBAL] \
[--epochs N] [--hidden N] [--lr X] [--grad-accum N] [--clip X] [--seed N] [--bucket-bytes N] \
[--comm-precision f32|bf16|f16] [--checkpoint-dir DIR --checkpoint-every STEPS] \
[--fail-at-step STEP] [--step-sleep-ms MS] [--out DIR] [--quiet]";

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
        step_sleep: Duration::ZERO,
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
            "--step-sleep-ms" => args.step_sleep = Duration::from_millis(num(&value)?),
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

/// In-place recovery's extra state: the evaluations done, so that an evaluation interrupted by
/// a death is redone by every rank, and one that some rank finished is skipped by all.
struct Progress {
    evals_done: u64,
}

impl Stateful for Progress {
    fn save(&self) -> Result<StateDict, Error> {
        StateDict::new().with_metadata(&BTreeMap::from([("evals_done", self.evals_done)]))
    }

    fn load(&mut self, state: StateDict) -> Result<(), Error> {
        let saved: BTreeMap<String, u64> = state.metadata_as()?;
        self.evals_done = saved
            .get("evals_done")
            .copied()
            .ok_or_else(|| Error::Checkpoint("progress state has no 'evals_done'".to_owned()))?;
        Ok(())
    }
}

/// Everything a step starts from and commits.
struct Trainer {
    params: Params,
    grads: Params,
    sgd: Sgd,
    schedule: Schedule,
    position: DataPosition,
    progress: Progress,
    /// Samples of committed steps.
    trained: u64,
    /// False in a replacement until it is healed: it has no committed state to report.
    has_state: bool,
}

impl Trainer {
    /// What the quorum compares: committed optimizer steps plus evaluations done (`None` in a
    /// replacement not healed yet).
    fn committed(&self) -> Option<u64> {
        self.has_state
            .then(|| self.schedule.step + self.progress.evals_done)
    }

    /// The registry a healthy rank sends and a healed rank loads.
    fn heal_registry(&mut self) -> CheckpointState<'_> {
        let mut state = registry(
            &mut self.params,
            &mut self.sgd,
            &mut self.schedule,
            &mut self.position,
        );
        state.register_custom("progress", &mut self.progress);
        state
    }
}

/// How a pass of the training loop ended.
enum Flow {
    /// Every epoch trained and evaluated: the samples every rank trained on, summed.
    Done(u64),
    /// The membership changed at a step boundary: recover before going on.
    Recover,
}

fn run(args: &Args) -> Result<(), Error> {
    let accelerator = Accelerator::from_env()?;
    let in_place = accelerator.recovery() == Recovery::InPlace;
    // A replacement has no place in the membership yet: quorum first, then its communicator.
    let first_quorum = if accelerator.is_replacement() {
        let started = Instant::now();
        Some((accelerator.membership().quorum(None)?, started))
    } else {
        None
    };
    let comm = Communicator::new(&accelerator)?;
    let main = accelerator.is_main_process();
    let options = ShardOptions::new(args.batch_size).split_batches(true);
    let sampler = ShardedSampler::for_accelerator(args.samples, options, &accelerator)?;
    let steps_per_epoch = (sampler.len() as u64).div_ceil(u64::from(args.grad_accum.max(1)));

    let mut params = Params::init(args.hidden, args.seed);
    let grads = Params::zeros(args.hidden);
    let mut sgd = Sgd::new(args.hidden, 0.9);
    let mut schedule = Schedule {
        peak: args.lr,
        warmup: steps_per_epoch.min(10),
        total: steps_per_epoch * args.epochs,
        step: 0,
    };
    let mut position = DataPosition::default();
    let mut progress = Progress { evals_done: 0 };
    let mut checkpoints = match &args.checkpoint_dir {
        Some(dir) => Some(Checkpoints::new(dir)?.with_total_limit(2)),
        None => None,
    };
    // A replacement is healed from a live rank instead (no disk).
    if let Some(checkpoints) = checkpoints
        .as_mut()
        .filter(|_| !accelerator.is_replacement())
    {
        let mut state = registry(&mut params, &mut sgd, &mut schedule, &mut position);
        if let Some(dir) = checkpoints.load_latest(&accelerator, &mut state)? {
            drop(state);
            // Every epoch before the one resumed in was evaluated before its checkpoint.
            progress.evals_done = position.epoch;
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

    let mut trainer = Trainer {
        params,
        grads,
        sgd,
        schedule,
        position,
        progress,
        trained: 0,
        has_state: !accelerator.is_replacement(),
    };
    let started = Instant::now();
    if let Some((quorum, asked)) = first_quorum {
        match heal_after(&accelerator, &comm, &mut trainer, quorum, asked) {
            Ok(()) => {}
            // Its source died while healing it: a new quorum names another.
            Err(error) if error.is_recoverable(Recovery::InPlace) => {
                report_interrupt(&accelerator, &error);
                recover(&accelerator, &comm, &mut trainer)?;
            }
            Err(error) => return Err(error),
        }
    }
    let samples = loop {
        let error = match train(args, &accelerator, &comm, &mut trainer, &mut checkpoints) {
            Ok(Flow::Done(samples)) => break samples,
            Ok(Flow::Recover) => None,
            Err(error) if in_place && error.is_recoverable(Recovery::InPlace) => Some(error),
            Err(error) => return Err(error),
        };
        if let Some(error) = &error {
            report_interrupt(&accelerator, error);
        }
        recover(&accelerator, &comm, &mut trainer)?;
    };
    let elapsed = started.elapsed().max(Duration::from_micros(1));
    if let Some(out) = &args.out {
        checkpoint::save_model(
            &accelerator,
            out,
            &to_state_dict(&trainer.params)?,
            u64::MAX,
        )?;
    }
    if main {
        println!(
            "final steps={} checksum={:016x} samples_per_s={:.0}{}",
            trainer.schedule.step,
            checksum(&trainer.params),
            samples as f64 / elapsed.as_secs_f64(),
            if in_place {
                check_cost(&accelerator, elapsed, trainer.schedule.step)
            } else {
                String::new()
            }
        );
    }
    accelerator.finish()
}

/// In in-place mode, what the per-step membership check costs next to a step: the mean of a
/// million calls of `Membership::changed` (the call every step makes) and the mean step time
/// of this run, as ` check_ns=<ns> step_us=<us>` for the final line.
fn check_cost(accelerator: &Accelerator, elapsed: Duration, steps: u64) -> String {
    const CALLS: u32 = 1_000_000;
    let membership = accelerator.membership();
    let started = Instant::now();
    let mut changed = 0u32;
    for _ in 0..CALLS {
        changed += u32::from(std::hint::black_box(&membership).changed());
    }
    std::hint::black_box(changed);
    let check_ns = started.elapsed().as_nanos() as f64 / f64::from(CALLS);
    let step_us = elapsed.as_secs_f64() * 1e6 / steps.max(1) as f64;
    format!(" check_ns={check_ns:.1} step_us={step_us:.1}")
}

/// Says on stderr which error interrupted the step (every rank: the survivors' logs show
/// who died).
fn report_interrupt(accelerator: &Accelerator, error: &Error) {
    eprintln!(
        "rank {}: step interrupted, recovering in place: {error}",
        accelerator.process_index()
    );
}

/// Takes part in quorums until one ends with this rank's communicator rebuilt and every
/// healed rank healed; a death during the recovery starts it again.
fn recover(
    accelerator: &Accelerator,
    comm: &Communicator,
    trainer: &mut Trainer,
) -> Result<(), Error> {
    loop {
        let asked = Instant::now();
        let quorum = accelerator.membership().quorum(trainer.committed())?;
        match heal_after(accelerator, comm, trainer, quorum, asked) {
            Ok(()) => return Ok(()),
            Err(error) if error.is_recoverable(Recovery::InPlace) => {
                report_interrupt(accelerator, &error);
            }
            Err(error) => return Err(error),
        }
    }
}

/// After `quorum` (asked for at `asked`): rebuilds the communicator, heals, and reports the
/// times on the main process.
fn heal_after(
    accelerator: &Accelerator,
    comm: &Communicator,
    trainer: &mut Trainer,
    quorum: muster::membership::Quorum,
    asked: Instant,
) -> Result<(), Error> {
    let quorum_ms = asked.elapsed().as_millis();
    // When this rank saw the membership change, on the wall clock (a benchmark that killed the
    // rank measures the detection from it).
    let failed_unix_ns = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap_or_default()
        .saturating_sub(asked.elapsed())
        .as_nanos();
    let rebuild = Instant::now();
    comm.reconfigure(accelerator, &quorum)?;
    let rebuild_ms = rebuild.elapsed().as_millis();
    let heal = Instant::now();
    comm.heal(&quorum, &mut trainer.heal_registry())?;
    let heal_ms = heal.elapsed().as_millis();
    trainer.grads.zero();
    trainer.has_state = true;
    if accelerator.is_main_process() {
        let list = |ranks: Vec<u32>| {
            if ranks.is_empty() {
                "none".to_owned()
            } else {
                ranks
                    .iter()
                    .map(u32::to_string)
                    .collect::<Vec<_>>()
                    .join(",")
            }
        };
        let mut sources: Vec<u32> = quorum.heal.iter().map(|h| h.source).collect();
        sources.sort_unstable();
        sources.dedup();
        println!(
            "recovered epoch={} step={} healed={} from={} quorum_ms={quorum_ms} \
             rebuild_ms={rebuild_ms} heal_ms={heal_ms} failed_unix_ns={failed_unix_ns}",
            quorum.epoch,
            quorum.step.map_or("none".to_owned(), |s| s.to_string()),
            list(quorum.heal.iter().map(|h| h.rank).collect()),
            list(sources),
        );
    }
    Ok(())
}

/// The training loop from the committed state in `trainer` to the end: every step not yet
/// committed, the evaluations not yet done, and the final count of samples. In restart mode it runs once, exactly as a loop without recovery. In
/// in-place mode an error leaves `trainer` at its last committed step (a step's changes are
/// made only once its last collective returned), and [`Flow::Recover`] says the membership
/// changed at a step boundary.
fn train(
    args: &Args,
    accelerator: &Accelerator,
    comm: &Communicator,
    trainer: &mut Trainer,
    checkpoints: &mut Option<Checkpoints>,
) -> Result<Flow, Error> {
    let main = accelerator.is_main_process();
    let membership = accelerator.membership();
    let options = ShardOptions::new(args.batch_size).split_batches(true);
    let mut sampler = ShardedSampler::for_accelerator(args.samples, options, accelerator)?
        .with_shuffle(args.seed);
    let sync = GradientSync::new()
        .bucket_bytes(args.bucket_bytes)
        .precision(args.precision);
    let mut accumulation = GradientAccumulation::new(args.grad_accum);
    let mut hidden = vec![0.0f32; args.hidden];
    let (mut loss_sum, mut loss_items, mut step_samples) = (0.0f64, 0usize, 0u64);
    trainer.grads.zero();
    // An epoch whose training was committed but whose evaluation was interrupted.
    if trainer.progress.evals_done < trainer.position.epoch {
        evaluate(
            args,
            accelerator,
            comm,
            &trainer.params,
            trainer.position.epoch - 1,
            &mut hidden,
        )?;
        trainer.progress.evals_done += 1;
    }
    let mut boundary = true;
    for epoch in trainer.position.epoch..args.epochs {
        sampler.set_epoch(epoch);
        let skip = if epoch == trainer.position.epoch {
            trainer.position.step as usize
        } else {
            0
        };
        let last = sampler.len().saturating_sub(1);
        for batch in sampler.iter().skip(skip) {
            if boundary {
                // The per-step check: atomic loads only, no coordinator call.
                if membership.changed() {
                    return Ok(Flow::Recover);
                }
                // The step marker, for the job's effective training time.
                accelerator.begin_step(trainer.schedule.step);
            }
            boundary = false;
            let (params, grads) = (&trainer.params, &mut trainer.grads);
            // The loss of each batch is averaged over its items and over the accumulated
            // batches, so the summed gradient is the mean over the global batch.
            let scale = accumulation.loss_scale() / batch.indices.len().max(1) as f32;
            for &i in &batch.indices {
                let (x, y) = model::sample(args.seed, i as u64);
                let squared = model::backward(params, grads, &x, y, scale, &mut hidden);
                loss_sum += f64::from(squared);
                loss_items += 1;
            }
            step_samples += batch.indices.len() as u64;
            if !accumulation.accumulate(batch.step == last) {
                continue;
            }
            boundary = true;
            // The loss first and the gradients last: the gradient all_reduce returning is
            // what commits the step on this rank.
            let mut loss = [loss_sum / loss_items.max(1) as f64];
            comm.all_reduce(&mut loss, ReduceOp::Avg)?;
            sync.average(comm, &mut trainer.grads.buffers_mut())?;
            // Averaged gradients are the same on every rank: the local norm is the global one.
            clip_grad_norm(&mut trainer.grads.buffers_mut(), args.clip, Ok::<_, Error>)?;
            let lr = trainer.schedule.lr();
            trainer
                .sgd
                .step(&mut trainer.params, &mut trainer.grads, lr);
            trainer.grads.zero();
            trainer.schedule.step += 1;
            trainer.trained += step_samples;
            (loss_sum, loss_items, step_samples) = (0.0, 0, 0);
            if main && !args.quiet {
                println!(
                    "epoch={epoch} step={} loss={:.6} lr={lr:.5}",
                    trainer.schedule.step, loss[0]
                );
            }
            trainer.position = DataPosition {
                epoch,
                step: batch.step as u64 + 1,
            };
            if !args.step_sleep.is_zero() {
                std::thread::sleep(args.step_sleep);
            }
            if trainer.position.step as usize == sampler.len() {
                trainer.position = DataPosition {
                    epoch: epoch + 1,
                    step: 0,
                };
            }
            if let Some(checkpoints) = checkpoints
                && args.checkpoint_every > 0
                && trainer.schedule.step.is_multiple_of(args.checkpoint_every)
            {
                let state = registry(
                    &mut trainer.params,
                    &mut trainer.sgd,
                    &mut trainer.schedule,
                    &mut trainer.position,
                );
                checkpoints.save(accelerator, &state)?;
            }
            if args.fail_at_step == Some(trainer.schedule.step)
                && accelerator.restart_count() == 0
                && accelerator.process_index() + 1 == accelerator.num_processes()
            {
                eprintln!(
                    "rank {} aborting at step {} (--fail-at-step)",
                    accelerator.process_index(),
                    trainer.schedule.step
                );
                std::process::abort();
            }
        }
        evaluate(args, accelerator, comm, &trainer.params, epoch, &mut hidden)?;
        trainer.progress.evals_done = epoch + 1;
    }
    let mut samples = [trainer.trained as i64];
    comm.all_reduce(&mut samples, ReduceOp::Sum)?;
    Ok(Flow::Done(samples[0] as u64))
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
