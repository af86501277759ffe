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
//! `target/release/recovery [--rounds 3] [--procs 4,8] [--kill-after 20]`

use anyhow::{Context, bail};
use clap::Parser;
use muster_bench::{bin_dir, field, load_average, peers_venv, quantile};
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
            let a = muster_round(&agent, &ddp_train, procs, &args, round)
                .with_context(|| format!("muster, {procs} processes, round {round}"))?;
            for (v, x) in m.iter_mut().zip(a) {
                v.push(x);
            }
            // A torchrun round that never trains again is a result, not a harness error: it
            // is counted and said, and its time is left out of the median.
            match torch_round(&torchrun, &script, procs, &args, &dir, round) {
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
            let [c, s] = check_round(&agent, &ddp_train, procs, &args)?;
            check.push(c);
            step.push(s);
        }
        let (c, s) = (median(&mut check), median(&mut step));
        println!(
            "| {procs} | {c:.1} ns | {s:.0} us | {:.5}% |",
            c / (s * 1000.0) * 100.0
        );
    }
    let _ = std::fs::remove_dir_all(&dir);
    Ok(())
}
