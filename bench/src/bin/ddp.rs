//! `ddp_train` throughput: samples per second of the pure-Rust data-parallel training example
//! (worker-sdk/examples/ddp_train) under `muster-agent launch` with 1, 2 and 4 processes on
//! the CPU backend, median over rounds. The model is small, so the figure shows what the
//! SDK's per-step work (gradient all-reduce in buckets, loss all-reduce) costs next to the
//! computation, and how the processes scale on this machine's cores.
//!
//! Needs release builds (`cargo build --release -p muster-agent -p muster --examples -p
//! muster-bench`).
//!
//! `target/release/ddp [--rounds 3] [--procs 1,2,4] [--epochs 4] [--hidden 256]`

use anyhow::{Context, bail};
use clap::Parser;
use muster_bench::{bin_dir, quantile};
use std::process::Command;

#[derive(Parser)]
struct Args {
    /// Rounds per process count; the median is reported.
    #[arg(long, default_value_t = 3)]
    rounds: usize,
    /// Process counts.
    #[arg(long, value_delimiter = ',', default_value = "1,2,4")]
    procs: Vec<u32>,
    /// Epochs of 8,192 samples.
    #[arg(long, default_value_t = 4)]
    epochs: u32,
    /// Hidden units of the model (its size: 10 x hidden parameters).
    #[arg(long, default_value_t = 256)]
    hidden: u32,
    /// Global batch size.
    #[arg(long, default_value_t = 64)]
    batch_size: u32,
}

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let bin = bin_dir();
    let agent = bin.join("muster-agent");
    let worker = bin.join("examples/ddp_train");
    for path in [&agent, &worker] {
        if !path.exists() {
            bail!(
                "{} is missing: run `cargo build --release -p muster-agent -p muster --examples`",
                path.display()
            );
        }
    }
    println!(
        "ddp_train: {} epochs of 8192 samples, global batch {}, hidden {}, grad-accum 2, {} rounds",
        args.epochs, args.batch_size, args.hidden, args.rounds
    );
    println!("| processes | samples/s (median) | speed-up vs 1 |");
    println!("|---|---|---|");
    let mut base = None;
    for &procs in &args.procs {
        let mut rates = vec![];
        for round in 0..args.rounds {
            let out = Command::new(&agent)
                .args(["launch", "--nproc-per-node", &procs.to_string()])
                .args(["--job-id", &format!("ddp-bench-{procs}-{round}"), "--"])
                .arg(&worker)
                .args(["--quiet", "--samples", "8192", "--eval-samples", "0"])
                .args(["--epochs", &args.epochs.to_string()])
                .args(["--hidden", &args.hidden.to_string()])
                .args(["--batch-size", &args.batch_size.to_string()])
                .env("MUSTER_COMM_BACKEND", "cpu")
                .output()
                .context("running muster-agent")?;
            let stdout = String::from_utf8_lossy(&out.stdout);
            if !out.status.success() {
                bail!(
                    "ddp_train on {procs} processes failed ({}):\n{stdout}\n{}",
                    out.status,
                    String::from_utf8_lossy(&out.stderr)
                );
            }
            let rate: f64 = stdout
                .split_whitespace()
                .find_map(|w| w.strip_prefix("samples_per_s="))
                .context("no samples_per_s in the output")?
                .parse()?;
            rates.push(rate);
        }
        let median = quantile(&mut rates, 0.5);
        let base = *base.get_or_insert(median);
        println!("| {procs} | {median:.0} | {:.2}x |", median / base);
    }
    Ok(())
}
