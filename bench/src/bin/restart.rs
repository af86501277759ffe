//! Side-by-side restart benchmark, in one run: the time from a worker's death to every worker
//! of the new generation running, for `muster-agent launch` and `torchrun` with the same
//! failing Python worker (rank 1 exits 3 on the first attempt; the others wait), for one
//! node of 8 workers and for 3 nodes on this machine (3 agents against one rendezvous: a
//! `muster-coordinator` for muster, torchrun's c10d store for torchrun). Each worker appends
//! `start <restart> <wall-ns>` to a shared file when it starts; the failing one appends
//! `death <wall-ns>` just before it exits. Runs alternate between muster and torchrun; figures
//! are medians over rounds.
//!
//! Needs release builds (`cargo build --release -p muster-agent -p muster-coordinator -p
//! muster-bench`) and the peers' venv (`scripts/install-peers.sh`).
//!
//! `target/release/restart [--rounds 5] [--procs 8] [--nodes 3 --node-procs 2]`

use clap::Parser;
use muster_bench::{
    CoordinatorProcess, RESTART_WORKER, bin_dir, floor_ms, muster_restart_round, peers_venv,
    quantile, torch_restart_round,
};
use std::path::PathBuf;

use std::time::Duration;

#[derive(Parser)]
struct Args {
    /// Rounds per launcher and shape; medians are over rounds.
    #[arg(long, default_value_t = 5)]
    rounds: usize,
    /// Workers of the single-node case.
    #[arg(long, default_value_t = 8)]
    procs: u32,
    /// Nodes of the multi-node case.
    #[arg(long, default_value_t = 3)]
    nodes: u32,
    /// Workers per node in the multi-node case.
    #[arg(long, default_value_t = 2)]
    node_procs: u32,
    /// The peers' venv.
    #[arg(long, env = "MUSTER_PEERS_VENV")]
    venv: Option<PathBuf>,
}

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let venv = peers_venv(args.venv.clone());
    let torchrun = venv.join("bin/torchrun");
    let python = venv.join("bin/python3");
    anyhow::ensure!(
        torchrun.exists(),
        "no torchrun at {}: run scripts/install-peers.sh",
        torchrun.display()
    );
    let agent = bin_dir().join("muster-agent");
    anyhow::ensure!(
        agent.exists(),
        "missing {}: build with --release first",
        agent.display()
    );
    let dir = std::env::temp_dir().join(format!("muster-restart-bench-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    let worker = dir.join("worker.py");
    std::fs::write(&worker, RESTART_WORKER)?;

    println!(
        "## Restart time (a worker's death to every worker of the new generation running; median of {} rounds)\n",
        args.rounds
    );
    println!(
        "| shape | muster-agent | torchrun | muster / torchrun | floor: starting the workers directly |"
    );
    println!("| --- | --- | --- | --- | --- |");
    let shapes = [(1, args.procs), (args.nodes, args.node_procs)];
    for (nodes, per_node) in shapes {
        let workers = nodes * per_node;
        let (mut m, mut t, mut f) = (vec![], vec![], vec![]);
        for round in 0..args.rounds {
            f.push(floor_ms(
                &python,
                &worker,
                &dir.join(format!("floor-{nodes}-{round}.log")),
                workers,
            )?);
            let log = dir.join(format!("muster-{nodes}-{round}.log"));
            let coordinator = if nodes > 1 {
                Some(CoordinatorProcess::start()?)
            } else {
                None
            };
            m.push(muster_restart_round(
                &agent,
                &python,
                &worker,
                &log,
                (nodes, per_node),
                coordinator.as_ref(),
                round,
                &[],
            )?);
            drop(coordinator);

            let log = dir.join(format!("torch-{nodes}-{round}.log"));
            t.push(torch_restart_round(
                &torchrun,
                &worker,
                &log,
                (nodes, per_node),
                round,
            )?);
            std::thread::sleep(Duration::from_millis(200));
        }
        let (m, t, f) = (
            quantile(&mut m, 0.5),
            quantile(&mut t, 0.5),
            quantile(&mut f, 0.5),
        );
        let shape = if nodes == 1 {
            format!("1 node, {workers} workers")
        } else {
            format!("{nodes} nodes x {per_node} workers")
        };
        println!(
            "| {shape} | {m:.0} ms | {t:.0} ms | {:.3}x | {f:.0} ms |",
            m / t
        );
    }
    let _ = std::fs::remove_dir_all(&dir);
    Ok(())
}
