//! The quick benchmark check, run by hand before resolving an issue that touches a hot path
//! (not in CI): each headline against its peer in the same run, alternating muster and the
//! peer, medians over rounds, with the goal and PASS/FAIL. About 3 minutes on 2 cores.
//!
//! - launch: 8 trivial Python workers (no torch import), `muster-agent launch` against
//!   `torchrun`; goal muster / torchrun <= 0.1x.
//! - barrier: rank 0's p50 at 8 processes, the SDK's barrier through the agent relay
//!   (`barrier_loop`) against torch's TCPStore add+wait barrier; goal <= 0.5x.
//! - restart: one node of 8 workers, a worker's death to the last worker of the new
//!   generation running, against `torchrun --max-restarts 1`. The goal, <= 0.1x, is on the
//!   launcher's own time: each figure less the floor, 8 interpreters of the same worker started
//!   directly in the same round (on 2 cores the floor alone is ~0.2x of torchrun's whole
//!   restart). The whole-restart ratio is printed beside it, and muster's figure with
//!   `--no-flight-recorder` (what the Flight Recorder's start-up hook costs; about 0.15 ms a
//!   worker once its bytecode is cached). Each round's figures go to stderr.
//! - all_reduce: CPU, 64 MiB of f32 on 2 processes, muster's communicator against gloo;
//!   goal muster busbw >= 3x gloo's (the same size and process count, so the ratio of the
//!   median times).
//!
//! Needs release builds (`cargo build --release -p muster-agent -p muster-coordinator -p
//! muster-bench --bins` and `cargo build --release -p muster --examples`;
//! `scripts/bench-quick.sh` builds and runs) and the peers' venv (`scripts/install-peers.sh`).
//! Exits 1 when a goal is missed or a part fails, after printing every line.
//!
//! `target/release/quick [--rounds 5] [--launch-runs 7] [--iters 200] [--only restart ...]`

use anyhow::Context;
use clap::Parser;
use muster_bench::{
    GLOO_ALLREDUCE_SCRIPT, RESTART_WORKER, allreduce_p50_us, bin_dir, command_line, cpu_model,
    floor_ms, free_port, load_average, muster_restart_round, peers_venv, quantile, rank0_latency,
    run_output, torch_barrier_latency, torch_restart_round,
};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Instant;

#[derive(Parser)]
struct Args {
    /// Rounds of the barrier, restart and all_reduce comparisons (each runs muster and the
    /// peer once); medians are over rounds.
    #[arg(long, default_value_t = 5)]
    rounds: usize,
    /// Launches per launcher in the launch comparison.
    #[arg(long, default_value_t = 7)]
    launch_runs: usize,
    /// Timed barriers per barrier run.
    #[arg(long, default_value_t = 200)]
    iters: u32,
    /// Measure only these headlines (launch, barrier, restart, all_reduce; repeat the flag for
    /// several); all four when absent.
    #[arg(long, value_parser = ["launch", "barrier", "restart", "all_reduce"])]
    only: Vec<String>,
    /// The peers' venv.
    #[arg(long, env = "MUSTER_PEERS_VENV")]
    venv: Option<PathBuf>,
    /// The shared/ folder beside the checkout (for `peers/torch_peer.py`).
    #[arg(long, default_value = concat!(env!("CARGO_MANIFEST_DIR"), "/../../shared"))]
    shared: PathBuf,
}

/// Which way a goal goes.
#[derive(Clone, Copy)]
enum Goal {
    /// muster's figure / the peer's at most this (times: lower is better).
    AtMost(f64),
    /// the peer's time / muster's at least this (speed: higher is better).
    SpeedAtLeast(f64),
}

/// One headline's medians: muster's, the peer's, and the floor both stand on where the goal is
/// on the launcher's own time.
struct Figures {
    muster: f64,
    peer: f64,
    floor: Option<f64>,
    /// Restart only: muster's median with `--no-flight-recorder` (no start-up hook in the
    /// workers), printed beside the headline.
    without_hook: Option<f64>,
}

impl From<(f64, f64)> for Figures {
    fn from((muster, peer): (f64, f64)) -> Self {
        Self {
            muster,
            peer,
            floor: None,
            without_hook: None,
        }
    }
}

/// One headline's medians, or why it could not be measured.
struct Headline {
    name: &'static str,
    unit: &'static str,
    goal: Goal,
    figures: anyhow::Result<Figures>,
}

impl Headline {
    /// Prints its line; whether the goal was met.
    fn print(&self) -> bool {
        let Figures {
            muster,
            peer,
            floor,
            without_hook,
        } = match &self.figures {
            Ok(f) => f,
            Err(e) => {
                println!("{:<46} FAIL: not measured: {e:#}", self.name);
                return false;
            }
        };
        let (muster, peer, base) = (*muster, *peer, floor.unwrap_or(0.0));
        let (ratio, met, goal) = match self.goal {
            Goal::AtMost(g) => {
                let r = (muster - base).max(0.0) / (peer - base);
                (r, r <= g, format!("<= {g}x"))
            }
            Goal::SpeedAtLeast(g) => (peer / muster, peer / muster >= g, format!(">= {g}x speed")),
        };
        let unit = self.unit;
        println!(
            "{:<46} muster {muster:>9.3} {unit:<2}  peer {peer:>9.3} {unit:<2}  ratio {ratio:>6.3}x  goal {goal:<13} {}",
            self.name,
            if met { "PASS" } else { "FAIL" }
        );
        if let Some(floor) = floor {
            println!(
                "{:<46} (ratio above the floor of {floor:.3} {unit} for starting the workers \
                 directly; whole times {:.3}x)",
                "",
                muster / peer
            );
        }
        if let (Some(off), Some(floor)) = (without_hook, floor) {
            println!(
                "{:<46} (with --no-flight-recorder: {off:.3} {unit}, ratio above the floor {:.3}x)",
                "",
                (off - floor).max(0.0) / (peer - floor)
            );
        }
        met
    }
}

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let started = Instant::now();
    let venv = peers_venv(args.venv.clone());
    let torchrun = venv.join("bin/torchrun");
    let python = venv.join("bin/python3");
    let bins = bin_dir();
    let agent = bins.join("muster-agent");
    let barrier_loop = bins.join("examples/barrier_loop");
    let allreduce_bench = bins.join("examples/allreduce_bench");
    let torch_peer = args.shared.join("peers/torch_peer.py");
    anyhow::ensure!(
        torchrun.exists(),
        "no torchrun at {}: run scripts/install-peers.sh",
        torchrun.display()
    );
    for p in [&agent, &barrier_loop, &allreduce_bench, &torch_peer] {
        anyhow::ensure!(
            p.exists(),
            "missing {}: build with `cargo build --release -p muster-agent -p \
             muster-coordinator -p muster-bench --bins` and `cargo build --release -p muster \
             --examples` first (or run scripts/bench-quick.sh)",
            p.display()
        );
    }
    let dir = std::env::temp_dir().join(format!("muster-quick-bench-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;

    println!("muster quick benchmark check");
    println!(
        "date:    {}",
        command_line("date", &["-u", "+%Y-%m-%d %H:%M:%S UTC"])
    );
    println!(
        "commit:  {}",
        command_line("git", &["rev-parse", "--short", "HEAD"])
    );
    println!(
        "machine: {} CPUs, {}",
        std::thread::available_parallelism().map_or(0, |n| n.get()),
        cpu_model()
    );
    println!("load:    {} (1, 5, 15 min at start)\n", load_average());

    let wanted = |key: &str| args.only.is_empty() || args.only.iter().any(|o| o == key);
    let mut headlines = vec![];
    if wanted("launch") {
        headlines.push(Headline {
            name: "launch, 8 trivial Python workers (vs torchrun)",
            unit: "s",
            goal: Goal::AtMost(0.1),
            figures: launch(&args, &agent, &torchrun, &python, &dir).map(Figures::from),
        });
    }
    if wanted("barrier") {
        headlines.push(Headline {
            name: "barrier p50, 8 processes (vs TCPStore)",
            unit: "us",
            goal: Goal::AtMost(0.5),
            figures: barrier(&args, &agent, &barrier_loop, &torchrun, &torch_peer)
                .map(Figures::from),
        });
    }
    if wanted("restart") {
        headlines.push(Headline {
            name: "restart, 1 node x 8 workers (vs torchrun)",
            unit: "ms",
            goal: Goal::AtMost(0.1),
            figures: restart(&args, &agent, &torchrun, &python, &dir),
        });
    }
    if wanted("all_reduce") {
        headlines.push(Headline {
            name: "CPU all_reduce 64 MiB, 2 processes (vs gloo)",
            unit: "ms",
            goal: Goal::SpeedAtLeast(3.0),
            figures: allreduce(&args, &agent, &allreduce_bench, &torchrun, &dir).map(Figures::from),
        });
    }
    let _ = std::fs::remove_dir_all(&dir);
    let mut all_met = true;
    for h in &headlines {
        all_met &= h.print();
    }
    println!(
        "\n(medians; launch over {} runs each, the others over {} rounds; muster and the peer \
         alternate; load at end {}; whole check {:.0} s)",
        args.launch_runs,
        args.rounds,
        load_average(),
        started.elapsed().as_secs_f64()
    );
    if !all_met {
        std::process::exit(1);
    }
    Ok(())
}

/// Wall time of a whole launch of 8 trivial workers (the venv's interpreter for both
/// launchers): medians in seconds of muster's and torchrun's.
fn launch(
    args: &Args,
    agent: &Path,
    torchrun: &Path,
    python: &Path,
    dir: &Path,
) -> anyhow::Result<(f64, f64)> {
    let trivial = dir.join("trivial.py");
    std::fs::write(
        &trivial,
        "import os\nprint('rank', os.environ.get('RANK'))\n",
    )?;
    let (mut m, mut t) = (vec![], vec![]);
    for i in 0..args.launch_runs {
        eprintln!("launch {}/{}", i + 1, args.launch_runs);
        m.push(
            run_output(
                Command::new(agent)
                    .args(["launch", "--nproc-per-node", "8", "--"])
                    .arg(python)
                    .arg(&trivial),
            )?
            .1,
        );
        t.push(
            run_output(
                Command::new(torchrun)
                    .args(["--nproc-per-node", "8"])
                    .arg(&trivial),
            )?
            .1,
        );
    }
    Ok((quantile(&mut m, 0.5), quantile(&mut t, 0.5)))
}

/// Rank 0's barrier p50 at 8 processes: medians in microseconds of muster's (`barrier_loop`)
/// and TCPStore's (`torch_peer.py`).
fn barrier(
    args: &Args,
    agent: &Path,
    barrier_loop: &Path,
    torchrun: &Path,
    torch_peer: &Path,
) -> anyhow::Result<(f64, f64)> {
    let iters = args.iters.to_string();
    let (mut m, mut s) = (vec![], vec![]);
    for round in 0..args.rounds {
        eprintln!("barrier round {}/{}", round + 1, args.rounds);
        let (out, _) = run_output(
            Command::new(agent)
                .args(["launch", "--nproc-per-node", "8", "--"])
                .arg(barrier_loop)
                .args(["--iters", &iters, "--warmup", "20"]),
        )?;
        m.push(rank0_latency(&out)?.0);
        let (out, _) = run_output(
            Command::new(torchrun)
                .args(["--nproc-per-node", "8"])
                .arg(torch_peer)
                .args(["--iters", &iters, "--sizes", "0.001"])
                .env("OMP_NUM_THREADS", "1"),
        )?;
        s.push(torch_barrier_latency(&out)?.1.0);
    }
    Ok((quantile(&mut m, 0.5), quantile(&mut s, 0.5)))
}

/// One node of 8 workers, rank 1 dying: medians in milliseconds from the death to the last
/// worker of the new generation starting, muster's and torchrun's, and the floor: the same 8
/// workers started directly.
fn restart(
    args: &Args,
    agent: &Path,
    torchrun: &Path,
    python: &Path,
    dir: &Path,
) -> anyhow::Result<Figures> {
    let worker = dir.join("restart_worker.py");
    std::fs::write(&worker, RESTART_WORKER)?;
    let (mut m, mut t, mut f, mut off) = (vec![], vec![], vec![], vec![]);
    for round in 0..args.rounds {
        eprintln!("restart round {}/{}", round + 1, args.rounds);
        f.push(floor_ms(
            python,
            &worker,
            &dir.join(format!("floor-{round}.log")),
            8,
        )?);
        let muster = |name: &str, extra: &[&str]| {
            let log = dir.join(format!("{name}-{round}.log"));
            muster_restart_round(agent, python, &worker, &log, (1, 8), None, round, extra)
        };
        m.push(muster("muster-restart", &[])?);
        // The same without torch's Flight Recorder: what its start-up hook costs.
        off.push(muster("muster-restart-off", &["--no-flight-recorder"])?);
        let log = dir.join(format!("torch-restart-{round}.log"));
        t.push(torch_restart_round(torchrun, &worker, &log, (1, 8), round)?);
        let last = |v: &[f64]| v.last().copied().unwrap_or(f64::NAN);
        eprintln!(
            "  muster {:.1} ms, without the hook {:.1} ms, torchrun {:.1} ms, floor {:.1} ms",
            last(&m),
            last(&off),
            last(&t),
            last(&f)
        );
    }
    Ok(Figures {
        muster: quantile(&mut m, 0.5),
        peer: quantile(&mut t, 0.5),
        floor: Some(quantile(&mut f, 0.5)),
        without_hook: Some(quantile(&mut off, 0.5)),
    })
}

/// 64 MiB CPU all_reduce on 2 processes: medians in milliseconds of rank 0's median time,
/// muster's (`allreduce_bench`, the CPU communicator) and gloo's.
fn allreduce(
    args: &Args,
    agent: &Path,
    allreduce_bench: &Path,
    torchrun: &Path,
    dir: &Path,
) -> anyhow::Result<(f64, f64)> {
    const SIZE: usize = 64 << 20;
    let script = dir.join("allreduce_gloo.py");
    std::fs::write(&script, GLOO_ALLREDUCE_SCRIPT)?;
    let size = SIZE.to_string();
    // 8 timed iterations per run: clamp(512 MiB / 64 MiB, 3, iters).
    let per_run = ["--iters", "100", "--bytes-per-size", "536870912"];
    let (mut m, mut g) = (vec![], vec![]);
    for round in 0..args.rounds {
        eprintln!("all_reduce round {}/{}", round + 1, args.rounds);
        let (out, _) = run_output(
            Command::new(agent)
                .args(["launch", "--nproc-per-node", "2", "--"])
                .arg(allreduce_bench)
                .args(["--sizes", &size])
                .args(per_run)
                .env("MUSTER_COMM_BACKEND", "cpu"),
        )?;
        m.push(allreduce_p50_us(&out, SIZE).context("no 64 MiB line in muster's output")? / 1e3);
        let (out, _) = run_output(
            Command::new(torchrun)
                .args(["--nproc-per-node", "2", "--master-addr", "127.0.0.1"])
                .args(["--master-port", &free_port()?.to_string()])
                .arg(&script)
                .args(["--sizes", &size])
                .args(per_run)
                .env("OMP_NUM_THREADS", "1"),
        )?;
        g.push(allreduce_p50_us(&out, SIZE).context("no 64 MiB line in gloo's output")? / 1e3);
    }
    Ok((quantile(&mut m, 0.5), quantile(&mut g, 0.5)))
}
