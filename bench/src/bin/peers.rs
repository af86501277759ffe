//! Side-by-side benchmark against the peers, in one run: barrier latency of muster's
//! `wait_for_everyone` (the `barrier_loop` example under `muster-agent launch`) against torch's
//! gloo barrier and TCPStore add+wait barrier (`shared/peers/torch_peer.py` under torchrun), and
//! launch overhead of `muster-agent launch` against `torchrun` with the same trivial worker.
//! Runs alternate between muster and the peer; every figure is a median over rounds.
//!
//! Needs release builds (`cargo build --release -p muster-agent -p muster --examples` and this
//! binary) and the peers' venv (`shared/peers/setup.sh`).
//!
//! `target/release/peers [--procs 2,8,32] [--launch-procs 8,32] [--rounds 3]`

use clap::Parser;
use muster_bench::{
    bin_dir, peers_venv, quantile, rank0_latency, run_output as run, torch_barrier_latency,
};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Instant;

#[derive(Parser)]
struct Args {
    /// Process counts for the barrier comparison.
    #[arg(long, value_delimiter = ',', default_value = "2,8,32")]
    procs: Vec<u32>,
    /// Process counts for the launch-overhead comparison.
    #[arg(long, value_delimiter = ',', default_value = "8")]
    launch_procs: Vec<u32>,
    /// Timed barriers per run.
    #[arg(long, default_value_t = 200)]
    iters: u32,
    /// Rounds (each runs muster and the peer once); medians are over rounds.
    #[arg(long, default_value_t = 3)]
    rounds: usize,
    /// Launches per launcher per process count in the overhead comparison.
    #[arg(long, default_value_t = 10)]
    launch_runs: usize,
    /// The peers' venv.
    #[arg(long, env = "MUSTER_PEERS_VENV")]
    venv: Option<PathBuf>,
    /// The shared/ folder beside the checkout.
    #[arg(long, default_value = concat!(env!("CARGO_MANIFEST_DIR"), "/../../shared"))]
    shared: PathBuf,
}

struct Barrier {
    muster: (Vec<f64>, Vec<f64>),
    gloo: (Vec<f64>, Vec<f64>),
    store: (Vec<f64>, Vec<f64>),
}

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let venv = peers_venv(args.venv.clone());
    let torchrun = venv.join("bin/torchrun");
    anyhow::ensure!(
        torchrun.exists(),
        "no torchrun at {}: run shared/peers/setup.sh",
        torchrun.display()
    );
    let peer = args.shared.join("peers/torch_peer.py");
    let bins = bin_dir();
    let agent = bins.join("muster-agent");
    let barrier_loop = bins.join("examples/barrier_loop");
    for p in [&agent, &barrier_loop, &peer] {
        anyhow::ensure!(
            p.exists(),
            "missing {}: build with --release first",
            p.display()
        );
    }

    println!(
        "## Barrier latency (rank 0's p50/p99 over {} barriers; median of {} rounds)\n",
        args.iters, args.rounds
    );
    println!(
        "| processes | muster p50 | muster p99 | torch TCPStore p50 | torch gloo p50 | muster / TCPStore | muster / gloo |"
    );
    println!("| --- | --- | --- | --- | --- | --- | --- |");
    for &n in &args.procs {
        let mut b = Barrier {
            muster: (vec![], vec![]),
            gloo: (vec![], vec![]),
            store: (vec![], vec![]),
        };
        for _ in 0..args.rounds {
            let (out, _) = run(Command::new(&agent)
                .args(["launch", "--nproc-per-node", &n.to_string(), "--"])
                .arg(&barrier_loop)
                .args(["--iters", &args.iters.to_string(), "--warmup", "20"]))?;
            let (p50, p99) = rank0_latency(&out)?;
            b.muster.0.push(p50);
            b.muster.1.push(p99);
            let (out, _) = run(Command::new(&torchrun)
                .args(["--nproc-per-node", &n.to_string()])
                .arg(&peer)
                .args(["--iters", &args.iters.to_string(), "--sizes", "0.001"])
                .env("OMP_NUM_THREADS", "1"))?;
            let (gloo, store) = torch_barrier_latency(&out)?;
            b.gloo.0.push(gloo.0);
            b.gloo.1.push(gloo.1);
            b.store.0.push(store.0);
            b.store.1.push(store.1);
        }
        let m50 = quantile(&mut b.muster.0, 0.5);
        let m99 = quantile(&mut b.muster.1, 0.5);
        let s50 = quantile(&mut b.store.0, 0.5);
        let g50 = quantile(&mut b.gloo.0, 0.5);
        println!(
            "| {n} | {m50:.0} us | {m99:.0} us | {s50:.0} us | {g50:.0} us | {:.2}x | {:.2}x |",
            m50 / s50,
            m50 / g50
        );
    }

    let dir = std::env::temp_dir().join(format!("muster-bench-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    let trivial = dir.join("trivial.py");
    // torchrun starts workers with its own interpreter; every launcher here uses that one.
    let python = venv.join("bin/python3");
    std::fs::write(
        &trivial,
        "import os\nprint('rank', os.environ.get('RANK'))\n",
    )?;
    println!(
        "\n## Launch overhead (wall time of the whole launch; median of {} runs)\n",
        args.launch_runs
    );
    println!(
        "| workers | muster-agent launch | torchrun | direct spawn (no launcher) | muster / torchrun |"
    );
    println!("| --- | --- | --- | --- | --- |");
    for &n in &args.launch_procs {
        let (mut m, mut t, mut d) = (vec![], vec![], vec![]);
        for _ in 0..args.launch_runs {
            m.push(
                run(Command::new(&agent)
                    .args(["launch", "--nproc-per-node", &n.to_string(), "--"])
                    .arg(&python)
                    .arg(&trivial))?
                .1,
            );
            t.push(
                run(Command::new(&torchrun)
                    .args(["--nproc-per-node", &n.to_string()])
                    .arg(&trivial))?
                .1,
            );
            d.push(direct(n, &python, &trivial)?);
        }
        let (m, t, d) = (
            quantile(&mut m, 0.5),
            quantile(&mut t, 0.5),
            quantile(&mut d, 0.5),
        );
        println!(
            "| {n} | {:.3} s | {:.3} s | {:.3} s | {:.3}x |",
            m,
            t,
            d,
            m / t
        );
    }
    let _ = std::fs::remove_dir_all(&dir);
    Ok(())
}

/// Spawns `n` workers directly and waits for all: the floor any launcher adds to.
fn direct(n: u32, python: &Path, script: &Path) -> anyhow::Result<f64> {
    let t = Instant::now();
    let children: Vec<_> = (0..n)
        .map(|r| {
            Command::new(python)
                .arg(script)
                .env("RANK", r.to_string())
                .stdout(Stdio::null())
                .spawn()
        })
        .collect::<Result<_, _>>()?;
    for mut c in children {
        c.wait()?;
    }
    Ok(t.elapsed().as_secs_f64())
}
