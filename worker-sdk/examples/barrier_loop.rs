//! Barrier latency from a worker's point of view: `K` timed `wait_for_everyone` calls, then one
//! line per rank with percentiles. Run it under `muster-agent` (or alone: single-process mode).
//!
//! Usage: `barrier_loop [--iters K] [--warmup N]` (defaults: 100 and 10).

use std::{process::ExitCode, time::Instant};

fn main() -> ExitCode {
    match run() {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("barrier_loop: {e}");
            ExitCode::FAILURE
        }
    }
}

fn run() -> Result<(), Box<dyn std::error::Error>> {
    let mut iters: usize = 100;
    let mut warmup: usize = 10;
    let mut args = std::env::args().skip(1);
    while let Some(arg) = args.next() {
        let mut value = |name: &str| -> Result<usize, String> {
            let v = args.next().ok_or(format!("{name} needs a value"))?;
            v.parse().map_err(|e| format!("{name} {v:?}: {e}"))
        };
        match arg.as_str() {
            "--iters" => iters = value("--iters")?,
            "--warmup" => warmup = value("--warmup")?,
            other => {
                return Err(format!(
                    "unknown argument {other:?}; usage: barrier_loop [--iters K] [--warmup N]"
                )
                .into());
            }
        }
    }

    let accelerator = muster::Accelerator::from_env()?;
    for _ in 0..warmup {
        accelerator.wait_for_everyone()?;
    }
    let mut samples_us = Vec::with_capacity(iters);
    let start = Instant::now();
    for _ in 0..iters {
        let t = Instant::now();
        accelerator.wait_for_everyone()?;
        samples_us.push(t.elapsed().as_secs_f64() * 1e6);
    }
    let total = start.elapsed();
    samples_us.sort_by(f64::total_cmp);
    println!(
        "rank={} iters={iters} p50_us={:.1} p99_us={:.1} total_ms={:.1}",
        accelerator.process_index(),
        percentile(&samples_us, 0.50),
        percentile(&samples_us, 0.99),
        total.as_secs_f64() * 1e3,
    );
    accelerator.finish()?;
    Ok(())
}

/// The nearest-rank percentile of sorted samples (0 for none).
fn percentile(sorted: &[f64], q: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    let rank = (q * sorted.len() as f64).ceil() as usize;
    sorted[rank.clamp(1, sorted.len()) - 1]
}
