//! Side-by-side recovery benchmark, in one run: the time from a worker's SIGKILL to the first
//! training step completed again at full world size, for `muster-agent launch --recovery
//! in-place` running `ddp_train` (the survivors keep their processes; the dead rank is respawned
//! and healed from a healthy rank over the data plane) and for `torchrun --max-restarts 3`
//! running the same model in PyTorch DDP (`bench/python/ddp_restart.py`: every process
//! restarts and reloads a checkpoint written after every step, so no work is lost and the
//! figure is the restart's own cost), for 4 and 8 processes on CPU. The last rank is killed
//! once rank 0 has printed `--kill-after` steps. Runs alternate between muster and torchrun;
//! figures are medians over rounds.
//!
//! muster's time is split from `ddp_train`'s `recovered` line (when rank 0 saw the failure,
//! how long its quorum call, communicator rebuild and healing took) and the agent's
//! `respawned in place ... N ms after its death` line; torchrun's from its `resumed` line
//! (every process restarted and the checkpoint loaded).
//!
//! Needs release builds (`cargo build --release -p muster-agent -p muster --examples -p
//! muster-bench`) and the peers' venv (`scripts/install-peers.sh`).
//!
//! A second table loses a whole node (issue 30): 2 nodes of `--node-procs` ranks on one
//! `muster-coordinator`, node 1's agent SIGKILLed (its workers die with it). muster in place
//! with a spare agent standing by (`--spare`, `--max-spares 1`): split into when rank 0 heard
//! of the loss, when the spare was given the place (its line), when its replacements started
//! (their `started` lines), and rank 0's quorum, rebuild and heal; against muster's restart mode
//! (`--recovery restart`, `ddp_train` checkpointing every step, node 1's agent started again at
//! once, as a supervisor would) and torchrun's restart plus reload of the first table at the
//! same world size (a worker's death: a node's loss costs torchrun at least that).
//!
//! A third table, with `--ettr-minutes M`, is the job's effective training time (ETTR, its own
//! account from rank 0's step markers) over an M-minute run that loses a node every
//! `--loss-every` seconds, in place with a spare and in restart mode, with the lost time split
//! by phase.
//!
//! `target/release/recovery [--rounds 3] [--procs 4,8] [--kill-after 20] [--node-procs 4]
//! [--ettr-minutes 10 --loss-every 120 [--ettr-only]]`

use anyhow::{Context, bail};
use clap::Parser;
use muster_bench::{CoordinatorProcess, bin_dir, field, load_average, peers_venv, quantile};
use muster_proto::v1 as pb;
use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;
use std::io::{BufRead, BufReader};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

#[derive(Parser)]
struct Args {
    /// Rounds per launcher and process count; medians are over rounds.
    #[arg(long, default_value_t = 3)]
    rounds: usize,
    /// Process counts.
    #[arg(long, value_delimiter = ',', default_value = "4,8")]
    procs: Vec<u32>,
    /// Steps rank 0 completes before the last rank is killed.
    #[arg(long, default_value_t = 20)]
    kill_after: u64,
    /// Hidden units of the model.
    #[arg(long, default_value_t = 256)]
    hidden: u32,
    /// Pause after each step (milliseconds), so that the kill lands mid-training.
    #[arg(long, default_value_t = 5)]
    step_sleep_ms: u32,
    /// The peers' venv.
    #[arg(long, env = "MUSTER_PEERS_VENV")]
    venv: Option<PathBuf>,
    /// Ranks per node of the node-loss table (2 nodes); 0 leaves it out.
    #[arg(long, default_value_t = 4)]
    node_procs: u32,
    /// Only the node-loss table.
    #[arg(long)]
    node_loss_only: bool,
    /// Minutes of the effective-training-time run (2 nodes of `--node-procs` ranks, a node lost
    /// every `--loss-every` seconds, in place with a spare and in restart mode); 0 leaves it
    /// out.
    #[arg(long, default_value_t = 0)]
    ettr_minutes: u64,
    /// Seconds between node losses in the ETTR run.
    #[arg(long, default_value_t = 120)]
    loss_every: u64,
    /// Only the ETTR run.
    #[arg(long)]
    ettr_only: bool,
}

/// One line of a launcher's output, with when it arrived.
struct Line {
    text: String,
    at: Instant,
}

/// A launcher under test: its process and its output lines (stdout and stderr merged).
struct Run {
    child: Child,
    lines: mpsc::Receiver<Line>,
    seen: Vec<Line>,
}

impl Run {
    fn start(mut cmd: Command) -> anyhow::Result<Self> {
        let mut child = cmd
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .process_group(0)
            .spawn()
            .with_context(|| format!("starting {cmd:?}"))?;
        let (tx, lines) = mpsc::channel();
        let out = child.stdout.take().context("stdout")?;
        let err = child.stderr.take().context("stderr")?;
        for stream in [
            Box::new(out) as Box<dyn std::io::Read + Send>,
            Box::new(err),
        ] {
            let tx = tx.clone();
            std::thread::spawn(move || {
                for text in BufReader::new(stream).lines().map_while(Result::ok) {
                    if tx
                        .send(Line {
                            text,
                            at: Instant::now(),
                        })
                        .is_err()
                    {
                        break;
                    }
                }
            });
        }
        Ok(Self {
            child,
            lines,
            seen: vec![],
        })
    }

    /// Waits for the next line matching `want`; its index in `seen`.
    fn until(&mut self, what: &str, want: impl Fn(&str) -> bool) -> anyhow::Result<usize> {
        let deadline = Instant::now() + Duration::from_secs(120);
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            let Ok(line) = self.lines.recv_timeout(left) else {
                bail!("no {what} within 120 s; last lines:\n{}", self.tail());
            };
            let hit = want(&line.text);
            self.seen.push(line);
            if hit {
                return Ok(self.seen.len() - 1);
            }
        }
    }

    fn tail(&self) -> String {
        let from = self.seen.len().saturating_sub(30);
        self.seen[from..]
            .iter()
            .map(|l| l.text.as_str())
            .collect::<Vec<_>>()
            .join("\n")
    }

    /// Stops the whole process group.
    fn stop(mut self) {
        let group = Pid::from_raw(-(self.child.id() as i32));
        let _ = kill(group, Signal::SIGKILL);
        let _ = self.child.wait();
    }
}

/// The process id in a `started rank=R pid=P` line from rank `rank`.
fn started_pid(line: &str, rank: u32) -> Option<i32> {
    let rest = line.split("started ").nth(1)?;
    let mut parts = rest.split(' ');
    (parts.next()? == format!("rank={rank}"))
        .then(|| parts.next()?.strip_prefix("pid=")?.parse().ok())
        .flatten()
}

/// The step of a rank-0 progress line (`... step=S ...` but not `resumed`/`recovered`).
fn step_of(line: &str) -> Option<u64> {
    if line.contains("recovered") || line.contains("resumed") || line.contains("muster-agent") {
        return None;
    }
    line.split(' ')
        .find_map(|w| w.strip_prefix("step="))
        .and_then(|s| s.parse().ok())
}

fn unix_ns() -> u128 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos())
}

/// Waits until every rank said it started and rank 0 finished `kill_after` steps, then
/// SIGKILLs the last rank; returns when (monotonic and wall clock) it was killed.
fn kill_last(run: &mut Run, procs: u32, kill_after: u64) -> anyhow::Result<(Instant, u128)> {
    // The ranks start in any order.
    let mut started = std::collections::BTreeMap::new();
    while started.len() < procs as usize {
        let at = run.until("a started line", |l| l.contains("started rank="))?;
        for rank in 0..procs {
            if let Some(pid) = started_pid(&run.seen[at].text, rank) {
                started.insert(rank, pid);
            }
        }
    }
    let pid = started.get(&(procs - 1)).copied();
    let pid = pid.context("no pid for the last rank")?;
    run.until("the kill step", |l| {
        step_of(l).is_some_and(|s| s >= kill_after)
    })?;
    let (at, wall) = (Instant::now(), unix_ns());
    kill(Pid::from_raw(pid), Signal::SIGKILL).context("killing the last rank")?;
    Ok((at, wall))
}

/// One muster round: (total, detection, quorum, rebuild, heal, respawn) in milliseconds.
fn muster_round(
    agent: &Path,
    ddp_train: &Path,
    procs: u32,
    args: &Args,
    round: usize,
) -> anyhow::Result<[f64; 6]> {
    let script = format!(
        "echo started rank=$RANK pid=$$; exec {} --epochs 100000 --samples 8192 --batch-size 64 --hidden {} --eval-samples 0 --step-sleep-ms {}",
        ddp_train.display(),
        args.hidden,
        args.step_sleep_ms
    );
    let mut cmd = Command::new(agent);
    cmd.args(["launch", "--recovery", "in-place", "--max-restarts", "1"])
        .args(["--nproc-per-node", &procs.to_string()])
        .args([
            "--job-id",
            &format!("recovery-{}-{round}", std::process::id()),
        ])
        .args(["--", "sh", "-c", &script])
        .env("MUSTER_COMM_BACKEND", "cpu")
        .env("OMP_NUM_THREADS", "1");
    let mut run = Run::start(cmd)?;
    let result = (|| {
        let (killed, killed_wall) = kill_last(&mut run, procs, args.kill_after)?;
        let recovered = run.until("the recovered line", |l| l.contains("recovered epoch="))?;
        let line = run.seen[recovered].text.clone();
        run.until("a step after the recovery", |l| step_of(l).is_some())?;
        let first = run.seen.last().map_or(killed, |l| l.at);
        let respawn = run
            .seen
            .iter()
            .find(|l| l.text.contains("respawned in place"))
            .and_then(|l| {
                let ms = l.text.split(") ").nth(1)?.split(" ms").next()?;
                ms.trim().parse::<f64>().ok()
            })
            .unwrap_or(f64::NAN);
        let failed_ns = field(&line, "failed_unix_ns=").context("no failed_unix_ns")?;
        let detect = (failed_ns - killed_wall as f64) / 1e6;
        Ok([
            first.duration_since(killed).as_secs_f64() * 1000.0,
            detect,
            field(&line, "quorum_ms=").context("no quorum_ms")?,
            field(&line, "rebuild_ms=").context("no rebuild_ms")?,
            field(&line, "heal_ms=").context("no heal_ms")?,
            respawn,
        ])
    })();
    run.stop();
    result
}

/// The per-step membership check of a failure-free in-place run of `ddp_train`:
/// (nanoseconds per check, microseconds per step), from its final line.
fn check_round(
    agent: &Path,
    ddp_train: &Path,
    procs: u32,
    args: &Args,
) -> anyhow::Result<[f64; 2]> {
    let out = Command::new(agent)
        .args(["launch", "--recovery", "in-place", "--max-restarts", "1"])
        .args(["--nproc-per-node", &procs.to_string()])
        .args([
            "--job-id",
            &format!("recovery-check-{}", std::process::id()),
        ])
        .arg("--")
        .arg(ddp_train)
        .args([
            "--epochs",
            "4",
            "--samples",
            "8192",
            "--batch-size",
            "64",
            "--quiet",
        ])
        .args(["--hidden", &args.hidden.to_string(), "--eval-samples", "0"])
        .env("MUSTER_COMM_BACKEND", "cpu")
        .env("OMP_NUM_THREADS", "1")
        .output()?;
    let text = String::from_utf8_lossy(&out.stdout);
    let line = text
        .lines()
        .find(|l| l.contains("final steps="))
        .with_context(|| format!("no final line:\n{text}"))?;
    Ok([
        field(line, "check_ns=").context("no check_ns")?,
        field(line, "step_us=").context("no step_us")?,
    ])
}

/// One torchrun round: (total, restart until the checkpoint is loaded) in milliseconds.
fn torch_round(
    torchrun: &Path,
    script: &Path,
    procs: u32,
    args: &Args,
    dir: &Path,
    round: usize,
) -> anyhow::Result<[f64; 2]> {
    let checkpoint = dir.join(format!("ckpt-{procs}-{round}.pt"));
    let _ = std::fs::remove_file(&checkpoint);
    let mut cmd = Command::new(torchrun);
    cmd.args(["--standalone", "--nproc-per-node", &procs.to_string()])
        // Three: on this machine torchrun's restarted gloo group sometimes fails to connect
        // (a peer that starts late is refused), and torchrun then restarts again; the time
        // counts every attempt until a step completes.
        .args(["--max-restarts", "3"])
        .arg(script)
        .args(["--hidden", &args.hidden.to_string()])
        .args(["--step-sleep-ms", &args.step_sleep_ms.to_string()])
        .arg("--checkpoint")
        .arg(&checkpoint)
        .env("OMP_NUM_THREADS", "1");
    let mut run = Run::start(cmd)?;
    let result = (|| {
        let (killed, _) = kill_last(&mut run, procs, args.kill_after)?;
        let resumed = run.until("the resumed line", |l| l.contains("resumed step="))?;
        let resumed_at = run.seen[resumed].at;
        run.until("a step after the restart", |l| step_of(l).is_some())?;
        let first = run.seen.last().map_or(killed, |l| l.at);
        Ok([
            first.duration_since(killed).as_secs_f64() * 1000.0,
            resumed_at.duration_since(killed).as_secs_f64() * 1000.0,
        ])
    })();
    run.stop();
    result
}

/// How a node-loss round recovers.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum NodeMode {
    /// `--recovery in-place` with a spare standing by.
    Spare,
    /// `--recovery restart`, checkpoints every step, the lost agent started again at once.
    Restart,
}

/// One node-loss round: in milliseconds from node 1's agent SIGKILL, [first step again at
/// full world size, rank 0 heard of it, the spare given the place, its replacements started,
/// quorum, rebuild, heal] (NaN where the mode has no such phase).
fn node_round(
    agent: &Path,
    ddp_train: &Path,
    args: &Args,
    mode: NodeMode,
    dir: &Path,
    round: usize,
) -> anyhow::Result<[f64; 7]> {
    let coordinator = node_coordinator()?;
    let job = format!("node-loss-{}-{round}", std::process::id());
    let addr = coordinator.addr.to_string();
    let node = node_agent(agent, ddp_train, args, mode, &addr, &job, dir, 1);
    let mut n0 = node(&["--node-rank", "0"])?;
    let n1 = node(&["--node-rank", "1"])?;
    let mut spare = match mode {
        NodeMode::Spare => Some(node(&["--spare"])?),
        NodeMode::Restart => None,
    };
    let result = (|| {
        if let Some(spare) = &mut spare {
            spare.until("the spare standing by", |l| {
                l.contains("standing by as a spare")
            })?;
        }
        n0.until("the kill step", |l| {
            step_of(l).is_some_and(|s| s >= args.kill_after)
        })?;
        let (killed, killed_wall) = (Instant::now(), unix_ns());
        kill(Pid::from_raw(n1.child.id() as i32), Signal::SIGKILL).context("killing node 1")?;
        let ms = |at: Instant| at.duration_since(killed).as_secs_f64() * 1000.0;
        match &mut spare {
            Some(spare) => {
                let placed =
                    spare.until("the spare's place", |l| l.contains("takes node 1's place"))?;
                let placed = spare.seen[placed].at;
                let started =
                    spare.until("a replacement started", |l| l.contains("started rank="))?;
                let started = spare.seen[started].at;
                let recovered =
                    n0.until("the recovered line", |l| l.contains("recovered epoch="))?;
                let line = n0.seen[recovered].text.clone();
                n0.until("a step after the recovery", |l| step_of(l).is_some())?;
                let first = n0.seen.last().map_or(killed, |l| l.at);
                let failed_ns = field(&line, "failed_unix_ns=").context("no failed_unix_ns")?;
                Ok([
                    ms(first),
                    (failed_ns - killed_wall as f64) / 1e6,
                    ms(placed),
                    ms(started),
                    field(&line, "quorum_ms=").context("no quorum_ms")?,
                    field(&line, "rebuild_ms=").context("no rebuild_ms")?,
                    field(&line, "heal_ms=").context("no heal_ms")?,
                ])
            }
            None => {
                // The lost machine's agent, started again by its supervisor.
                let n1b = node(&["--node-rank", "1"])?;
                let out = (|| {
                    n0.until("the resumed line", |l| l.contains("resumed from"))?;
                    n0.until("a step after the restart", |l| step_of(l).is_some())?;
                    let first = n0.seen.last().map_or(killed, |l| l.at);
                    Ok([
                        ms(first),
                        f64::NAN,
                        f64::NAN,
                        f64::NAN,
                        f64::NAN,
                        f64::NAN,
                        f64::NAN,
                    ])
                })();
                n1b.stop();
                out
            }
        }
    })();
    n0.stop();
    n1.stop();
    if let Some(spare) = spare {
        spare.stop();
    }
    drop(coordinator);
    result
}

/// The coordinator of a node-loss run: a lost node's agent is declared lost after 2 s of
/// silence (a SIGKILLed agent's stream breaks at once).
fn node_coordinator() -> anyhow::Result<CoordinatorProcess> {
    CoordinatorProcess::start_with(|c| {
        c.args(["--heartbeat-timeout-ms", "2000"]);
    })
}

/// Starts one agent of a 2-node `ddp_train` job in `mode` (its extra `flags`: a node rank,
/// or `--spare`); restart mode checkpoints every step under `dir`.
#[allow(clippy::too_many_arguments)]
fn node_agent<'a>(
    agent: &'a Path,
    ddp_train: &Path,
    args: &'a Args,
    mode: NodeMode,
    addr: &'a str,
    job: &'a str,
    dir: &Path,
    max_restarts: u32,
) -> impl Fn(&[&str]) -> anyhow::Result<Run> + 'a {
    let mut script = format!(
        "echo started rank=$RANK pid=$$; exec {} --epochs 100000 --samples 8192 --batch-size 64 --hidden {} --eval-samples 0 --step-sleep-ms {}",
        ddp_train.display(),
        args.hidden,
        args.step_sleep_ms
    );
    if mode == NodeMode::Restart {
        script.push_str(&format!(
            " --checkpoint-dir {} --checkpoint-every 1",
            dir.join(job).display()
        ));
    }
    move |flags: &[&str]| {
        let mut cmd = Command::new(agent);
        cmd.args(["launch", "--coordinator", addr, "--job-id", job])
            .args([
                "--nnodes",
                "2",
                "--nproc-per-node",
                &args.node_procs.to_string(),
            ])
            .args(["--max-restarts", &max_restarts.to_string()])
            .args(match mode {
                NodeMode::Spare => ["--recovery", "in-place", "--max-spares", "1"].as_slice(),
                NodeMode::Restart => ["--recovery", "restart"].as_slice(),
            })
            .args(flags)
            .args(["--", "sh", "-c", &script])
            .env("MUSTER_COMM_BACKEND", "cpu")
            .env("OMP_NUM_THREADS", "1");
        Run::start(cmd)
    }
}

/// One effective-training-time run in `mode`: the job trains for `--ettr-minutes`, and every
/// `--loss-every` seconds the agent of node 1, then node 0, and so on, is SIGKILLed (its
/// workers die with it). In place, the spare takes its place and a new agent stands by as the
/// next spare (the machine replaced); in restart mode the lost agent is started again at once
/// (a supervisor), and the generation restarts from the last step's checkpoint. Returns the
/// job's own account (`DescribeJob.training`) at the end, and the losses.
fn ettr_run(
    agent: &Path,
    ddp_train: &Path,
    args: &Args,
    mode: NodeMode,
    dir: &Path,
) -> anyhow::Result<(pb::TrainingTime, u32)> {
    let coordinator = node_coordinator()?;
    let addr = coordinator.addr.to_string();
    let job = format!("ettr-{}-{mode:?}", std::process::id()).to_lowercase();
    let node = node_agent(agent, ddp_train, args, mode, &addr, &job, dir, 1000);
    let mut nodes = [node(&["--node-rank", "0"])?, node(&["--node-rank", "1"])?];
    let mut spare = match mode {
        NodeMode::Spare => Some(node(&["--spare"])?),
        NodeMode::Restart => None,
    };
    let result = (|| {
        nodes[0].until("the first step", |l| step_of(l).is_some())?;
        let start = Instant::now();
        let end = start + Duration::from_secs(args.ettr_minutes * 60);
        let every = Duration::from_secs(args.loss_every);
        let mut losses = 0u32;
        while start + every * (losses + 1) < end {
            std::thread::sleep(
                (start + every * (losses + 1)).saturating_duration_since(Instant::now()),
            );
            let k = (losses as usize + 1) % 2;
            kill(Pid::from_raw(nodes[k].child.id() as i32), Signal::SIGKILL)
                .with_context(|| format!("killing node {k}'s agent"))?;
            let fresh = match spare.take() {
                Some(mut s) => {
                    let place = format!("takes node {k}'s place");
                    s.until("the spare's place", |l| l.contains(&place))?;
                    spare = Some(node(&["--spare"])?);
                    s
                }
                None => node(&["--node-rank", &k.to_string()])?,
            };
            std::mem::replace(&mut nodes[k], fresh).stop();
            losses += 1;
            eprintln!(
                "ETTR run, {mode:?}: node {k} lost at {:.0} s",
                start.elapsed().as_secs_f64()
            );
        }
        std::thread::sleep(end.saturating_duration_since(Instant::now()));
        let training = tokio::runtime::Runtime::new()?.block_on(async {
            let mut ops = pb::ops_client::OpsClient::connect(format!("http://{addr}")).await?;
            let d = ops
                .describe_job(pb::DescribeJobRequest {
                    job_id: job.clone(),
                    ..Default::default()
                })
                .await?
                .into_inner();
            anyhow::Ok(d.training)
        })?;
        Ok((
            training.context("the job reported no training time")?,
            losses,
        ))
    })();
    for n in nodes {
        n.stop();
    }
    if let Some(s) = spare {
        s.stop();
    }
    drop(coordinator);
    result
}

/// The ETTR table (see [`ettr_run`]).
fn ettr_table(agent: &Path, ddp_train: &Path, args: &Args, dir: &Path) -> anyhow::Result<()> {
    println!(
        "\n## Effective training time, {} min, a node lost every {} s, 2 nodes x {} ranks (the job's own account; load {})\n",
        args.ettr_minutes,
        args.loss_every,
        args.node_procs,
        load_average()
    );
    println!(
        "| mode | losses | ETTR | wall | lost | detecting | respawn or spare | healing | restarts | steps begun again or redone |"
    );
    println!("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |");
    for mode in [NodeMode::Spare, NodeMode::Restart] {
        let (t, losses) = ettr_run(agent, ddp_train, args, mode, dir)
            .with_context(|| format!("the ETTR run in {mode:?} mode"))?;
        let s = |ms: u64| format!("{:.2} s", ms as f64 / 1000.0);
        println!(
            "| {} | {losses} | {:.2}% | {} | {} | {} | {} | {} | {} | {} |",
            match mode {
                NodeMode::Spare => "in place, spare",
                NodeMode::Restart => "restart + reload",
            },
            t.ettr * 100.0,
            s(t.wall_ms),
            s(t.lost_ms),
            s(t.detection_ms),
            s(t.respawn_ms),
            s(t.heal_ms),
            s(t.restarts_ms),
            s(t.lost_ms.saturating_sub(t.recoveries_ms + t.restarts_ms)),
        );
    }
    Ok(())
}

fn median(xs: &mut [f64]) -> f64 {
    quantile(xs, 0.5)
}

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let venv = peers_venv(args.venv.clone());
    let torchrun = venv.join("bin/torchrun");
    anyhow::ensure!(
        torchrun.exists(),
        "no torchrun at {}: run scripts/install-peers.sh",
        torchrun.display()
    );
    let bin = bin_dir();
    let agent = bin.join("muster-agent");
    let ddp_train = bin.join("examples/ddp_train");
    for needed in [&agent, &ddp_train] {
        anyhow::ensure!(
            needed.exists(),
            "missing {}: build with --release first",
            needed.display()
        );
    }
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("python/ddp_restart.py");
    let dir = std::env::temp_dir().join(format!("muster-recovery-bench-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    if !args.node_loss_only && !args.ettr_only {
        worker_tables(&args, &agent, &ddp_train, &torchrun, &script, &dir)?;
    }
    if args.node_procs > 0 && !args.ettr_only {
        node_table(&args, &agent, &ddp_train, &torchrun, &script, &dir)?;
    }
    if args.ettr_minutes > 0 {
        ettr_table(&agent, &ddp_train, &args, &dir)?;
    }
    let _ = std::fs::remove_dir_all(&dir);
    Ok(())
}

/// The node-loss table (see the module's docs).
fn node_table(
    args: &Args,
    agent: &Path,
    ddp_train: &Path,
    torchrun: &Path,
    script: &Path,
    dir: &Path,
) -> anyhow::Result<()> {
    let procs = args.node_procs * 2;
    println!(
        "\n## Node loss, 2 nodes x {} ranks (SIGKILL of node 1's agent to the first step completed again at full world size; median of {} rounds; load {})\n",
        args.node_procs,
        args.rounds,
        load_average()
    );
    println!(
        "| muster in place, spare | rank 0 told | spare given the place | replacements started | quorum | rebuild | heal | muster restart + reload | torchrun restart + reload ({procs} procs, a worker's death) | spare / muster restart | spare / torchrun |"
    );
    println!("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |");
    let (mut spare, mut restart, mut torch): ([Vec<f64>; 7], Vec<f64>, Vec<f64>) =
        Default::default();
    for round in 0..args.rounds {
        let a = node_round(agent, ddp_train, args, NodeMode::Spare, dir, round)
            .with_context(|| format!("node loss with a spare, round {round}"))?;
        for (v, x) in spare.iter_mut().zip(a) {
            v.push(x);
        }
        let b = node_round(agent, ddp_train, args, NodeMode::Restart, dir, round)
            .with_context(|| format!("node loss with a restart, round {round}"))?;
        restart.push(b[0]);
        let t = torch_round(torchrun, script, procs, args, dir, round + 1000);
        match &t {
            Ok(t) => torch.push(t[0]),
            Err(e) => eprintln!("torchrun did not train again: {e:#}"),
        }
        eprintln!(
            "node loss, round {round}: spare {:.0} ms, muster restart {:.0} ms, torchrun {}",
            a[0],
            b[0],
            t.map_or_else(|_| "failed".to_owned(), |t| format!("{:.0} ms", t[0]))
        );
    }
    let [total, told, placed, started, quorum, rebuild, heal] = spare.each_mut().map(|v| median(v));
    let (r, t) = (median(&mut restart), median(&mut torch));
    println!(
        "| {total:.0} ms | {told:.1} ms | {placed:.0} ms | {started:.0} ms | {quorum:.0} ms | {rebuild:.1} ms | {heal:.1} ms | {r:.0} ms | {t:.0} ms | {:.3}x | {:.3}x |",
        total / r,
        total / t
    );
    Ok(())
}

/// The worker-death tables (see the module's docs).
fn worker_tables(
    args: &Args,
    agent: &Path,
    ddp_train: &Path,
    torchrun: &Path,
    script: &Path,
    dir: &Path,
) -> anyhow::Result<()> {
    println!(
        "## Recovery time (SIGKILL of the last rank to the first step completed again at full world size; median of {} rounds; load {})\n",
        args.rounds,
        load_average()
    );
    println!(
        "| processes | muster in place | detection | quorum (incl. respawn) | respawn | communicator rebuild | heal | torchrun restart + reload | of which restart + load | muster / torchrun |"
    );
    println!("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |");
    for &procs in &args.procs {
        let mut m: [Vec<f64>; 6] = Default::default();
        let mut t: [Vec<f64>; 2] = Default::default();
        let mut torch_failed = 0;
        for round in 0..args.rounds {
            let a = muster_round(agent, ddp_train, procs, args, round)
                .with_context(|| format!("muster, {procs} processes, round {round}"))?;
            for (v, x) in m.iter_mut().zip(a) {
                v.push(x);
            }
            // A torchrun round that never trains again is a result, not a harness error: it
            // is counted and said, and its time is left out of the median.
            match torch_round(torchrun, script, procs, args, dir, round) {
                Ok(b) => {
                    for (v, x) in t.iter_mut().zip(b) {
                        v.push(x);
                    }
                    eprintln!(
                        "{procs} processes, round {round}: muster {:.0} ms, torchrun {:.0} ms",
                        a[0], b[0]
                    );
                }
                Err(error) => {
                    torch_failed += 1;
                    let why = format!("{error:#}");
                    eprintln!(
                        "{procs} processes, round {round}: muster {:.0} ms, torchrun did not train again: {}",
                        a[0],
                        why.lines().next().unwrap_or_default()
                    );
                }
            }
        }
        let [total, detect, quorum, rebuild, heal, respawn] = m.each_mut().map(|v| median(v));
        let [ttotal, trestart] = t.each_mut().map(|v| median(v));
        println!(
            "| {procs} | {total:.0} ms | {detect:.1} ms | {quorum:.0} ms | {respawn:.0} ms | {rebuild:.1} ms | {heal:.1} ms | {ttotal:.0} ms | {trestart:.0} ms | {:.3}x |{}",
            total / ttotal,
            if torch_failed > 0 {
                format!(
                    " torchrun did not train again in {torch_failed} of {} rounds",
                    args.rounds
                )
            } else {
                String::new()
            }
        );
    }
    println!(
        "\n## Per-step membership check when nothing fails (`Membership::changed`, no coordinator call; median of {} runs)\n",
        args.rounds
    );
    println!("| processes | check | ddp_train step | check / step |");
    println!("| --- | --- | --- | --- |");
    for &procs in &args.procs {
        let (mut check, mut step) = (vec![], vec![]);
        for _ in 0..args.rounds {
            let [c, s] = check_round(agent, ddp_train, procs, args)?;
            check.push(c);
            step.push(s);
        }
        let (c, s) = (median(&mut check), median(&mut step));
        println!(
            "| {procs} | {c:.1} ns | {s:.0} us | {:.5}% |",
            c / (s * 1000.0) * 100.0
        );
    }
    Ok(())
}
