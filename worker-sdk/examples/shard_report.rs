//! Which items of the dataset `0..L` each rank sees at each step, and what
//! `gather_for_metrics` returns: muster's data sharding side by side with Accelerate's
//! (`tests/python/shard_report.py` prints the same report from Accelerate's own classes).
//!
//! ```text
//! muster-agent launch --nproc-per-node 2 --job-id x -- \
//!     target/debug/examples/shard_report --len 10 --batch-size 4
//! ```
//!
//! Every rank prints `rank=<r> step=<s> batch=<items>` for each of its batches, and rank 0
//! prints `step=<s> gathered=<items>` after each step (items comma-separated, nothing after
//! `=` when empty). `--seed S` shuffles (rank 0 then first prints `order=<permutation>`),
//! `--epoch E` picks the epoch. `--iterable` streams the dataset through `IterableShard`
//! (Accelerate's `IterableDatasetShard`) instead of sampling indices; its length is not
//! declared, so `gather_for_metrics` keeps the padding there, as Accelerate's does.
//! `--simulate P` prints the report of P ranks from one process, without an agent: the same
//! library code, with the gather's truncation done locally (`metrics_from_gathered`).
//! `--cases` reads one such flag line per stdin line and prints `case <line>` before each
//! report (`error: <message>` for a refused configuration): a whole comparison grid from one
//! process. Bad flags are a one-line error and status 2.

use std::process::ExitCode;

use muster::Accelerator;
use muster::comm::Communicator;
use muster::data::{
    GradientState, IterableShard, ShardOptions, ShardedSampler, gather_for_metrics,
    metrics_from_gathered,
};

const USAGE: &str = "usage: shard_report --len L --batch-size B [--split-batches] \
                     [--no-even-batches] [--drop-last] [--iterable] [--seed S] [--epoch E] [--simulate P]";

/// The parsed flags.
#[derive(Debug)]
struct Args {
    len: usize,
    options: ShardOptions,
    iterable: bool,
    seed: Option<u64>,
    epoch: u64,
    simulate: Option<usize>,
}

fn main() -> ExitCode {
    let argv: Vec<String> = std::env::args().skip(1).collect();
    if argv == ["--cases"] {
        return cases();
    }
    let args = match parse(argv.into_iter()) {
        Ok(Some(args)) => args,
        Ok(None) => {
            println!("{USAGE}");
            return ExitCode::SUCCESS;
        }
        Err(message) => {
            eprintln!("shard_report: {message}");
            return ExitCode::from(2);
        }
    };
    let result = match args.simulate {
        Some(world) => report(&args, world).map(|lines| {
            for line in lines {
                println!("{line}");
            }
        }),
        None => launched(&args),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(muster::Error::Usage(message)) => {
            eprintln!("shard_report: {message}");
            ExitCode::from(2)
        }
        Err(e) => {
            eprintln!("shard_report: {e}");
            ExitCode::FAILURE
        }
    }
}

/// `--cases`: one case per stdin line (flags with `--simulate P`); prints `case <line>`, then
/// its report or `error: <message>`. A whole grid from one process, for the comparison with
/// Accelerate (`tests/python/shard_report.py --cases` reads the same lines).
fn cases() -> ExitCode {
    for line in std::io::stdin().lines() {
        let Ok(line) = line else {
            return ExitCode::FAILURE;
        };
        let line = line.trim();
        if line.is_empty() {
            continue;
        }
        println!("case {line}");
        let args = match parse(line.split_whitespace().map(str::to_owned)) {
            Ok(Some(args)) => args,
            Ok(None) => continue,
            Err(message) => {
                println!("error: {message}");
                continue;
            }
        };
        match report(&args, args.simulate.unwrap_or(1)) {
            Ok(lines) => lines.iter().for_each(|l| println!("{l}")),
            Err(e) => println!("error: {e}"),
        }
    }
    ExitCode::SUCCESS
}

/// The flags, `None` for `--help`.
fn parse(mut argv: impl Iterator<Item = String>) -> Result<Option<Args>, String> {
    let (mut len, mut batch_size) = (None, None);
    let mut options = ShardOptions::new(1);
    let (mut seed, mut epoch, mut simulate, mut iterable) = (None, 0, None, false);
    while let Some(flag) = argv.next() {
        let mut value = |name: &str| -> Result<u64, String> {
            let v = argv.next().ok_or_else(|| format!("{name} needs a value"))?;
            v.parse()
                .map_err(|_| format!("{name} wants a non-negative integer, not {v:?}"))
        };
        match flag.as_str() {
            "--len" => len = Some(value("--len")? as usize),
            "--batch-size" => batch_size = Some(value("--batch-size")? as usize),
            "--seed" => seed = Some(value("--seed")?),
            "--epoch" => epoch = value("--epoch")?,
            "--simulate" => simulate = Some(value("--simulate")? as usize),
            "--split-batches" => options.split_batches = true,
            "--no-even-batches" => options.even_batches = false,
            "--drop-last" => options.drop_last = true,
            "--iterable" => iterable = true,
            "-h" | "--help" => return Ok(None),
            other => return Err(format!("unknown flag {other:?} ({USAGE})")),
        }
    }
    let len = len.ok_or("--len is required")?;
    options.batch_size = batch_size.ok_or("--batch-size is required")?;
    if simulate == Some(0) {
        return Err("--simulate wants at least 1 process".into());
    }
    if iterable && seed.is_some() {
        return Err("--seed does not apply to --iterable (a stream is read in order)".into());
    }
    Ok(Some(Args {
        len,
        options,
        iterable,
        seed,
        epoch,
        simulate,
    }))
}

/// A sampler for `rank` of `world` as the flags ask.
fn sampler(args: &Args, world: usize, rank: usize) -> Result<ShardedSampler, muster::Error> {
    let mut sampler = ShardedSampler::new(args.len, args.options, world, rank)?;
    if let Some(seed) = args.seed {
        sampler = sampler.with_shuffle(seed);
    }
    sampler.set_epoch(args.epoch);
    Ok(sampler)
}

/// One step of a rank's epoch: its batch (`None` past its last one) and the state that
/// `gather_for_metrics` uses.
type Step = (Option<Vec<i64>>, GradientState);

/// Rank `rank`'s steps: as many as the epoch has (rank 0's count), so that every rank takes
/// part in every step's gather.
fn steps(args: &Args, world: usize, rank: usize) -> Result<Vec<Step>, muster::Error> {
    if args.iterable {
        let mut shard = IterableShard::new(0..args.len as i64, args.options, world, rank)?;
        let mut steps = Vec::new();
        while let Some(batch) = shard.next() {
            steps.push((Some(batch), shard.gradient_state()));
        }
        return Ok(steps);
    }
    let sampler = sampler(args, world, rank)?;
    Ok((0..sampler.global_len())
        .map(|step| {
            let batch = sampler.batch(step).map(|b| items(&b));
            (batch, sampler.gradient_state(step))
        })
        .collect())
}

/// The dataset `0..L`: item `i` is `i`.
fn items(indices: &[usize]) -> Vec<i64> {
    indices.iter().map(|&i| i as i64).collect()
}

fn join<T: ToString>(items: &[T]) -> String {
    items
        .iter()
        .map(ToString::to_string)
        .collect::<Vec<_>>()
        .join(",")
}

/// Under `muster-agent launch` (or alone, as one process): this rank's batches, and the
/// collective `gather_for_metrics` at every step of the epoch.
fn launched(args: &Args) -> Result<(), muster::Error> {
    let accelerator = Accelerator::from_env()?;
    let (rank, world) = (accelerator.process_index(), accelerator.num_processes());
    let steps = steps(args, world, rank)?;
    let comm = Communicator::new(&accelerator)?;
    if args.seed.is_some() && accelerator.is_main_process() {
        println!("order={}", join(&sampler(args, world, rank)?.order()));
    }
    for (step, (batch, state)) in steps.into_iter().enumerate() {
        if let Some(batch) = &batch {
            println!("rank={rank} step={step} batch={}", join(batch));
        }
        let local = batch.unwrap_or_default();
        let gathered = gather_for_metrics(&comm, &local, &state)?;
        if accelerator.is_main_process() {
            println!("step={step} gathered={}", join(&gathered));
        }
    }
    drop(comm);
    accelerator.finish()
}

/// `--simulate P`: every rank's report from one process, step by step.
fn report(args: &Args, world: usize) -> Result<Vec<String>, muster::Error> {
    let ranks = (0..world)
        .map(|rank| steps(args, world, rank))
        .collect::<Result<Vec<_>, _>>()?;
    let mut lines = Vec::new();
    if args.seed.is_some() {
        lines.push(format!("order={}", join(&sampler(args, world, 0)?.order())));
    }
    for step in 0..ranks[0].len() {
        let mut per_rank = Vec::with_capacity(world);
        for (rank, steps) in ranks.iter().enumerate() {
            let batch = steps.get(step).and_then(|(batch, _)| batch.clone());
            if let Some(batch) = &batch {
                lines.push(format!("rank={rank} step={step} batch={}", join(batch)));
            }
            per_rank.push(batch.unwrap_or_default());
        }
        let gathered = metrics_from_gathered(&per_rank, &ranks[0][step].1);
        lines.push(format!("step={step} gathered={}", join(&gathered)));
    }
    Ok(lines)
}
