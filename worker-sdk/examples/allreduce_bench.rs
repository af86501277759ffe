//! all_reduce bandwidth and latency from a worker's point of view: for each size, f32
//! `all_reduce(Sum)` on the job's communicator, timed iteration by iteration between two
//! barriers. Run it under `muster-agent launch` (the `allreduce` benchmark in `bench/` does, and
//! runs torch's gloo the same way beside it).
//!
//! For each size: one checked all_reduce (rank r contributes r + 1 everywhere, every element
//! must come back as N(N+1)/2), W untimed warm-up all_reduces of zeros, a barrier, `iters`
//! back-to-back all_reduces each timed on its own, a barrier. `iters` = clamp(B / size, 3, K)
//! (so large sizes do not take minutes), W = clamp(iters / 10, 1, 10). Rank 0 prints one line
//! per size:
//!
//! `size_bytes=<n> iters=<k> time_us_p50=<median> time_us_mean=<total/k> algbw_gbs=<n/p50>
//! busbw_gbs=<algbw x 2(N-1)/N>`
//!
//! Bandwidths come from the **median** of the per-iteration times (robust to a rank being
//! descheduled on a machine with fewer cores than ranks); the mean (total / iters, what
//! nccl-tests and `shared/peers/torch_peer.py` report) is printed beside it. busbw is
//! nccl-tests' bus bandwidth for all_reduce: algbw x 2(N-1)/N. A last line gives rank 0's peak
//! resident memory.
//!
//! Usage: `allreduce_bench [--sizes 4,4KiB,64KiB,1MiB,16MiB,64MiB,256MiB] [--iters K]
//! [--bytes-per-size B]` (defaults: those sizes, K = 200, B = 1 GiB; sizes in bytes, with an
//! optional KiB/MiB/GiB suffix).

use std::{process::ExitCode, time::Instant};

use muster::comm::{Communicator, ReduceOp};

const USAGE: &str =
    "usage: allreduce_bench [--sizes BYTES,...] [--iters K] [--bytes-per-size B] [--warmup W]";

fn main() -> ExitCode {
    match run() {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("allreduce_bench: {e}");
            ExitCode::FAILURE
        }
    }
}

struct Args {
    sizes: Vec<usize>,
    iters: usize,
    bytes_per_size: usize,
    /// Fixed warm-up count; `None`: clamp(iters / 10, 1, 10).
    warmup: Option<usize>,
}

fn parse_args() -> Result<Args, String> {
    let mut parsed = Args {
        sizes: ["4", "4KiB", "64KiB", "1MiB", "16MiB", "64MiB", "256MiB"]
            .iter()
            .map(|s| parse_bytes(s))
            .collect::<Result<_, _>>()?,
        iters: 200,
        bytes_per_size: 1 << 30,
        warmup: None,
    };
    let mut args = std::env::args().skip(1);
    while let Some(arg) = args.next() {
        let mut value = |name: &str| args.next().ok_or(format!("{name} needs a value; {USAGE}"));
        match arg.as_str() {
            "--sizes" => {
                parsed.sizes = value("--sizes")?
                    .split(',')
                    .map(parse_bytes)
                    .collect::<Result<_, _>>()?;
            }
            "--iters" => parsed.iters = parse_bytes(&value("--iters")?)?,
            "--bytes-per-size" => parsed.bytes_per_size = parse_bytes(&value("--bytes-per-size")?)?,
            "--warmup" => parsed.warmup = Some(parse_bytes(&value("--warmup")?)?),
            other => return Err(format!("unknown argument {other:?}; {USAGE}")),
        }
    }
    if parsed.iters == 0 {
        return Err("--iters must be at least 1".into());
    }
    Ok(parsed)
}

/// `4096`, `4KiB`, `64MiB`, `1GiB` (binary multiples; `K`, `M`, `G` alone mean the same).
fn parse_bytes(s: &str) -> Result<usize, String> {
    let s = s.trim();
    let digits = s.find(|c: char| !c.is_ascii_digit()).unwrap_or(s.len());
    let (number, suffix) = s.split_at(digits);
    let number: usize = number.parse().map_err(|e| format!("{s:?}: {e}"))?;
    let shift = match suffix {
        "" | "B" => 0,
        "K" | "KiB" => 10,
        "M" | "MiB" => 20,
        "G" | "GiB" => 30,
        other => return Err(format!("{s:?}: unknown suffix {other:?} (KiB, MiB, GiB)")),
    };
    number
        .checked_mul(1 << shift)
        .ok_or_else(|| format!("{s:?} is too large"))
}

fn run() -> Result<(), Box<dyn std::error::Error>> {
    let args = parse_args()?;
    let accelerator = muster::Accelerator::from_env()?;
    let comm = Communicator::new(&accelerator)?;
    let rank = accelerator.process_index();
    let world = accelerator.num_processes();
    if rank == 0 {
        println!(
            "allreduce_bench world_size={world} dtype=f32 op=sum bandwidth_from=median_of_iterations"
        );
    }
    let expected = (world * (world + 1) / 2) as f32;
    for &size in &args.sizes {
        let numel = (size / 4).max(1);
        let bytes = numel * 4;
        let iters = (args.bytes_per_size / bytes).clamp(3.min(args.iters), args.iters);
        let warmup = args.warmup.unwrap_or((iters / 10).clamp(1, 10));

        let mut buf = vec![(rank + 1) as f32; numel];
        comm.all_reduce(&mut buf, ReduceOp::Sum)?;
        if let Some((i, v)) = buf.iter().enumerate().find(|&(_, &v)| v != expected) {
            return Err(format!(
                "rank {rank}: all_reduce of {bytes} bytes is wrong at element {i}: {v} != {expected}"
            )
            .into());
        }
        // Zeros from here on: the sums stay finite and every iteration does the same work.
        buf.fill(0.0);
        for _ in 0..warmup {
            comm.all_reduce(&mut buf, ReduceOp::Sum)?;
        }
        let mut samples_us = Vec::with_capacity(iters);
        comm.barrier()?;
        let start = Instant::now();
        for _ in 0..iters {
            let t = Instant::now();
            comm.all_reduce(&mut buf, ReduceOp::Sum)?;
            samples_us.push(t.elapsed().as_secs_f64() * 1e6);
        }
        let total_us = start.elapsed().as_secs_f64() * 1e6;
        comm.barrier()?;
        if rank == 0 {
            let p50 = median(&mut samples_us);
            let algbw = bytes as f64 / p50 / 1e3; // bytes per microsecond / 1e3 = GB/s
            let busbw = algbw * 2.0 * (world - 1) as f64 / world as f64;
            println!(
                "size_bytes={bytes} iters={iters} time_us_p50={p50:.1} time_us_mean={:.1} \
                 algbw_gbs={algbw:.3} busbw_gbs={busbw:.3}",
                total_us / iters as f64
            );
        }
    }
    if rank == 0 {
        println!("peak_rss_mib={:.0}", peak_rss_kib() as f64 / 1024.0);
    }
    drop(comm);
    accelerator.finish()?;
    Ok(())
}

/// The median of `samples` (sorted in place; the mean of the middle two for an even count).
fn median(samples: &mut [f64]) -> f64 {
    samples.sort_by(f64::total_cmp);
    match samples.len() {
        0 => 0.0,
        n if n % 2 == 1 => samples[n / 2],
        n => (samples[n / 2 - 1] + samples[n / 2]) / 2.0,
    }
}

/// This process's peak resident memory (`VmHWM`), 0 where /proc does not say.
fn peak_rss_kib() -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .unwrap_or_default()
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap_or(0)
}
