//! The stacks benchmark (issue 27, `docs/hangs.md`), side by side in one run:
//!
//! - **sampling overhead**: a torch gloo DDP loop (`bench/python/ddp_steps.py`, 2 processes)
//!   under `muster-agent launch` with stack sampling at its default rate and at 10/s, against
//!   `--sample-stacks 0`, rounds alternating; the median step time of each and the ratios
//!   (goal: the default costs at most 1%);
//! - **`describe --stacks`**: its wall time (the whole command, process start included) for 8
//!   Python workers on 1 node, for 2 nodes of 4 (two agents on one coordinator), and for 8
//!   torch gloo ranks whose Flight Recorders the agent reads too; goal <= 200 ms on 1 node;
//!   then `describe --stacks --native` on the 8 torch ranks: the first (which parses each
//!   worker's libraries) and the median of the later ones;
//! - **a dump at 1,000 simulated ranks**: 125 simulated nodes of 8 ranks (tasks holding a
//!   watch stream each, answering the dump with made-up 20-frame stacks) on one coordinator
//!   process; the `Ops.DumpStacks` call's median.
//!
//! Needs release builds (`cargo build --release -p muster-agent -p muster-coordinator -p
//! muster-bench --bins`) and the peers' venv (`scripts/install-peers.sh`).
//!
//! `target/release/stacks [--rounds 5] [--steps 300] [--ranks 1000] [--only overhead|describe|dump]`

use anyhow::Context;
use clap::Parser;
use muster_bench::{
    CoordinatorProcess, bin_dir, channels, cpu_model, field, load_average, peers_venv, quantile,
    rendezvous,
};
use muster_proto::v1 as pb;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;

#[derive(Parser)]
struct Args {
    /// Rounds of each comparison (medians are over rounds).
    #[arg(long, default_value_t = 5)]
    rounds: usize,
    /// Timed DDP steps per overhead run.
    #[arg(long, default_value_t = 300)]
    steps: u32,
    /// Simulated ranks for the dump (8 per simulated node).
    #[arg(long, default_value_t = 1000)]
    ranks: u32,
    /// Only one part.
    #[arg(long, value_parser = ["overhead", "describe", "dump"])]
    only: Option<String>,
    /// The peers' venv (default: scripts/install-peers.sh's).
    #[arg(long)]
    venv: Option<PathBuf>,
}

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    println!(
        "stacks benchmark: {} on {} cores, load {}; {} rounds",
        cpu_model(),
        std::thread::available_parallelism().map_or(0, |n| n.get()),
        load_average(),
        args.rounds
    );
    let part = |p: &str| args.only.as_deref().is_none_or(|o| o == p);
    let python = peers_venv(args.venv.clone()).join("bin/python");
    let root = bin_dir()
        .ancestors()
        .nth(2)
        .map(Path::to_path_buf)
        .unwrap_or_default();
    if part("overhead") {
        overhead(&python, &root, &args)?;
    }
    if part("describe") {
        describe_wall(&python, &args)?;
    }
    if part("dump") {
        let rt = tokio::runtime::Runtime::new()?;
        rt.block_on(dump_at_scale(args.ranks, args.rounds))?;
    }
    Ok(())
}

/// One launch of the DDP loop at `hz` samples a second; rank 0's median step in ms.
fn ddp_round(python: &Path, root: &Path, hz: &str, steps: u32) -> anyhow::Result<f64> {
    let script = root.join("bench/python/ddp_steps.py");
    let out = Command::new(bin_dir().join("muster-agent"))
        .args([
            "launch",
            "-q",
            "--nproc-per-node",
            "2",
            "--sample-stacks",
            hz,
        ])
        .arg("--")
        .arg(python)
        .arg(&script)
        .args(["--steps", &steps.to_string()])
        .stdin(Stdio::null())
        .output()
        .context("muster-agent launch")?;
    let text = String::from_utf8_lossy(&out.stdout);
    anyhow::ensure!(
        out.status.success(),
        "the DDP run failed: {}\n{text}{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    text.lines()
        .find_map(|l| field(l, "step_ms_p50="))
        .with_context(|| format!("no step_ms_p50 in: {text}"))
}

fn overhead(python: &Path, root: &Path, args: &Args) -> anyhow::Result<()> {
    println!(
        "\nsampling overhead: torch gloo DDP, 2 processes, {} timed steps a run",
        args.steps
    );
    let rates = ["0", "2", "10"];
    let mut times: Vec<Vec<f64>> = vec![Vec::new(); rates.len()];
    for round in 0..args.rounds {
        // Alternate the order, so that a drift of the machine hits every rate alike.
        let order: Vec<usize> = if round % 2 == 0 {
            (0..rates.len()).collect()
        } else {
            (0..rates.len()).rev().collect()
        };
        for i in order {
            times[i].push(ddp_round(python, root, rates[i], args.steps)?);
        }
    }
    let off = quantile(&mut times[0].clone(), 0.5);
    for (i, rate) in rates.iter().enumerate() {
        let m = quantile(&mut times[i], 0.5);
        println!(
            "  --sample-stacks {rate:>2}: step p50 {m:.3} ms (rounds: {}), {:.4}x off",
            times[i]
                .iter()
                .map(|t| format!("{t:.3}"))
                .collect::<Vec<_>>()
                .join(" "),
            m / off
        );
    }
    Ok(())
}

/// A worker that waits in a Python function, as a rank blocked in a collective would.
const WAITER: &str = "import threading\n\ndef wait_for_peers():\n    threading.Event().wait()\n\nprint('waiting', flush=True)\nwait_for_peers()\n";

/// The same after one gloo `all_reduce` in a torch process group: the dump also reads each
/// rank's Flight Recorder.
const TORCH_WAITER: &str = "import threading\nimport torch\nimport torch.distributed as dist\n\ndist.init_process_group('gloo')\ndist.all_reduce(torch.ones(4))\n\ndef wait_for_peers():\n    threading.Event().wait()\n\nprint('waiting', flush=True)\nwait_for_peers()\n";

/// Starts a launch of `nproc` waiters on `coordinator` (one node of `nnodes`).
fn waiters(python: &Path, coordinator: &str, job: &str, nnodes: u32, nproc: u32) -> Child {
    launch_script(python, coordinator, job, (nnodes, nproc), WAITER)
}

/// Starts a launch of `nproc` workers running `script` (`python -c`) on `coordinator` (one
/// node of `nnodes`).
fn launch_script(
    python: &Path,
    coordinator: &str,
    job: &str,
    (nnodes, nproc): (u32, u32),
    script: &str,
) -> Child {
    Command::new(bin_dir().join("muster-agent"))
        .args([
            "launch",
            "-q",
            "--coordinator",
            coordinator,
            "--job-id",
            job,
        ])
        .args(["--nnodes", &nnodes.to_string()])
        .args(["--nproc-per-node", &nproc.to_string()])
        .args(["--advertise-addr", "127.0.0.1", "--hang-timeout", "off"])
        .arg("--")
        .arg(python)
        .args(["-c", script])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("muster-agent launch")
}

/// One `describe --stacks` (and `extra`): its wall time in ms and its output.
fn describe_once(coordinator: &str, job: &str, extra: &[&str]) -> (f64, std::process::Output) {
    let t = Instant::now();
    let out = Command::new(bin_dir().join("muster-agent"))
        .args(["describe", "--coordinator", coordinator, job, "--stacks"])
        .args(extra)
        .output()
        .expect("muster-agent describe");
    (t.elapsed().as_secs_f64() * 1000.0, out)
}

/// `describe --stacks`, `rounds` times once every rank reads as waiting (and `also` is in the
/// view): the median wall time in ms.
fn describe_runs(
    coordinator: &str,
    job: &str,
    ranks: u32,
    rounds: usize,
    also: &str,
) -> anyhow::Result<f64> {
    let run = || describe_once(coordinator, job, &[]);
    let want = format!("({ranks} of {ranks}): threading.Condition.wait");
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let (_, out) = run();
        let text = String::from_utf8_lossy(&out.stdout);
        if text.contains(&want) && text.contains(also) {
            break;
        }
        anyhow::ensure!(
            Instant::now() < deadline,
            "the workers never all waited:\n{}",
            String::from_utf8_lossy(&out.stdout)
        );
        std::thread::sleep(Duration::from_millis(200));
    }
    let mut walls: Vec<f64> = (0..rounds.max(5)).map(|_| run().0).collect();
    Ok(quantile(&mut walls, 0.5))
}

fn describe_wall(python: &Path, args: &Args) -> anyhow::Result<()> {
    println!("\ndescribe --stacks wall time (the whole command), Python workers waiting");
    let coordinator = CoordinatorProcess::start()?;
    let addr = coordinator.addr.to_string();
    let mut one = waiters(python, &addr, "stacks-bench-1", 1, 8);
    let m1 = describe_runs(&addr, "stacks-bench-1", 8, args.rounds, "");
    let _ = one.kill();
    let _ = one.wait();
    println!("  8 ranks on 1 node: p50 {:.1} ms (goal <= 200 ms)", m1?);
    let mut two = [
        waiters(python, &addr, "stacks-bench-2", 2, 4),
        waiters(python, &addr, "stacks-bench-2", 2, 4),
    ];
    let m2 = describe_runs(&addr, "stacks-bench-2", 8, args.rounds, "");
    for c in &mut two {
        let _ = c.kill();
        let _ = c.wait();
    }
    println!("  8 ranks on 2 nodes of 4: p50 {:.1} ms", m2?);
    let mut torch = launch_script(python, &addr, "stacks-bench-3", (1, 8), TORCH_WAITER);
    let measured = torch_describes(&addr, args.rounds);
    let _ = torch.kill();
    let _ = torch.wait();
    let (m3, first, native) = measured?;
    println!(
        "  8 torch gloo ranks on 1 node, each rank's Flight Recorder read too: p50 {m3:.1} ms"
    );
    println!(
        "  the same with --native (each worker paused for its read): first {first:.0} ms (parses each worker's libraries), then p50 {native:.1} ms"
    );
    Ok(())
}

/// On 8 waiting torch ranks: `describe --stacks`'s median, then with `--native` the first
/// (which parses each worker's libraries) and the median of the later ones, in ms.
fn torch_describes(addr: &str, rounds: usize) -> anyhow::Result<(f64, f64, f64)> {
    let plain = describe_runs(
        addr,
        "stacks-bench-3",
        8,
        rounds,
        "flight recorder (default_pg): ranks 0-7 last called collective #1 gloo:all_reduce",
    )?;
    let (first, out) = describe_once(addr, "stacks-bench-3", &["--native"]);
    let text = String::from_utf8_lossy(&out.stdout);
    anyhow::ensure!(
        text.contains("(libpython"),
        "no native frames in the view:\n{text}"
    );
    let mut later: Vec<f64> = (0..rounds.max(5))
        .map(|_| describe_once(addr, "stacks-bench-3", &["--native"]).0)
        .collect();
    Ok((plain, first, quantile(&mut later, 0.5)))
}

/// A made-up stack of 20 frames, as deep as a DDP step's.
fn synthetic_stack(rank: u32) -> pb::RankStack {
    let frames = (0..20)
        .map(|i| pb::StackFrame {
            function: format!("f{i}"),
            file: if i < 10 {
                format!("/venv/lib/python3.11/site-packages/torch/nn/m{i}.py")
            } else {
                "/home/u/train.py".to_owned()
            },
            line: 10 + i,
            ..Default::default()
        })
        .collect();
    pb::RankStack {
        rank: Some(rank),
        local_rank: Some(rank % 8),
        pid: 1000 + rank,
        threads: vec![pb::ThreadStack {
            thread_id: u64::from(1000 + rank),
            name: "MainThread".into(),
            active: false,
            frames,
        }],
        unchanged_ms: 5000,
        ..Default::default()
    }
}

/// One simulated node's agent: attaches its watch, heartbeats, and answers every dump.
async fn simulated_agent(
    ch: tonic::transport::Channel,
    job: String,
    node_rank: u32,
    node_id: String,
    local: u32,
) -> anyhow::Result<()> {
    let (tx, rx) = mpsc::channel(16);
    tx.send(pb::NodeMessage {
        kind: Some(pb::node_message::Kind::Attach(pb::NodeAttach {
            job_id: job,
            generation: 1,
            node_rank,
            node_id,
            resume: false,
            attempt: 0,
        })),
    })
    .await?;
    let mut events = pb::rendezvous_client::RendezvousClient::new(ch)
        .watch(ReceiverStream::new(rx))
        .await?
        .into_inner();
    let mut tick = tokio::time::interval(Duration::from_millis(500));
    loop {
        tokio::select! {
            _ = tick.tick() => {
                let _ = tx.try_send(pb::NodeMessage {
                    kind: Some(pb::node_message::Kind::Heartbeat(pb::Heartbeat {})),
                });
            }
            e = events.message() => match e?.and_then(|e| e.kind) {
                Some(pb::node_event::Kind::DumpStacks(cmd)) => {
                    let ranks = (0..local).map(|l| synthetic_stack(node_rank * local + l)).collect();
                    tx.send(pb::NodeMessage {
                        kind: Some(pb::node_message::Kind::Stacks(pb::NodeStacks {
                            request_id: cmd.request_id,
                            ranks,
                        })),
                    })
                    .await?;
                }
                Some(_) => {}
                None => return Ok(()),
            }
        }
    }
}

async fn dump_at_scale(ranks: u32, rounds: usize) -> anyhow::Result<()> {
    let local = 8;
    let nodes = ranks.div_ceil(local);
    println!(
        "\nOps.DumpStacks at {} simulated ranks ({nodes} nodes of {local}, one coordinator process)",
        nodes * local
    );
    let coordinator = CoordinatorProcess::start()?;
    let chs = channels(coordinator.addr, 8).await?;
    let job = "stacks-scale";
    rendezvous(&chs, job, nodes, local).await?;
    // Each simulated node attaches under the node rank the round gave its id.
    let placed = pb::ops_client::OpsClient::new(chs[0].clone())
        .describe_job(pb::DescribeJobRequest {
            job_id: job.into(),
            ..Default::default()
        })
        .await?
        .into_inner()
        .nodes;
    for (i, n) in placed.into_iter().enumerate() {
        let ch = chs[i % chs.len()].clone();
        let rank = n.node_rank();
        tokio::spawn(simulated_agent(ch, job.to_owned(), rank, n.node_id, local));
    }
    tokio::time::sleep(Duration::from_secs(1)).await;
    let mut ops = pb::ops_client::OpsClient::new(chs[0].clone());
    let mut times = Vec::new();
    let mut groups = 0;
    let mut bytes = 0;
    for _ in 0..rounds.max(5) {
        let t = Instant::now();
        let r = ops
            .dump_stacks(pb::DumpStacksRequest {
                job_id: job.into(),
                ..Default::default()
            })
            .await?
            .into_inner();
        times.push(t.elapsed().as_secs_f64() * 1000.0);
        anyhow::ensure!(
            r.unanswered.is_empty(),
            "unanswered nodes: {:?}",
            &r.unanswered[..r.unanswered.len().min(3)]
        );
        anyhow::ensure!(r.ranks.len() as u32 == nodes * local, "ranks missing");
        groups = r.groups.len();
        bytes = prost::Message::encoded_len(&r);
    }
    println!(
        "  p50 {:.1} ms, max {:.1} ms ({groups} group(s), a {:.0} KiB reply)",
        quantile(&mut times.clone(), 0.5),
        quantile(&mut times, 1.0),
        bytes as f64 / 1024.0
    );
    Ok(())
}
