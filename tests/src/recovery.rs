//! Helpers for the in-place recovery tests that run the `ddp_train` example under
//! `muster-agent launch --recovery in-place` (`tests/tests/recovery_in_place.rs`,
//! `tests/tests/recovery_ha.rs`, `tests/tests/recovery_soak.rs`): starting a run whose workers
//! print `started rank=R pid=P restarts=N` first, waiting for a step and killing a rank, and
//! reading its ranks' pids, recoveries and final checksum.

use crate::{Agent, Finished, Stream, example_bin};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Duration;

/// `ddp_train`, or `None` (after printing why) where the SDK has no such example.
pub fn ddp_train() -> Option<PathBuf> {
    let bin = example_bin("ddp_train");
    if bin.is_none() {
        eprintln!("skipped: worker-sdk/examples/ddp_train does not exist");
    }
    bin
}

/// Starts `ddp_train TRAIN` on `procs` processes under `muster-agent launch FLAGS`, with the
/// CPU backend and a fresh job id (returned). Each worker prints `started rank=R pid=P
/// restarts=N` first (`MUSTER_RESTART_COUNT`; the shell execs the trainer, so the pid is the
/// trainer's).
pub fn start(bin: &Path, procs: u32, flags: &[&str], train: &[&str]) -> (Agent, String) {
    let procs = procs.to_string();
    let job = format!(
        "recovery-{}-{}",
        std::process::id(),
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos())
    );
    let mut trainer = vec![bin.to_str().expect("a UTF-8 path").to_owned()];
    trainer.extend(train.iter().map(|s| (*s).to_owned()));
    let script = format!(
        "echo started rank=$RANK pid=$$ restarts=$MUSTER_RESTART_COUNT; exec {}",
        trainer.join(" ")
    );
    let mut all = vec!["launch"];
    all.extend_from_slice(flags);
    all.extend_from_slice(&["--nproc-per-node", &procs, "--job-id", &job, "--"]);
    all.extend_from_slice(&["sh", "-c", &script]);
    let agent = Agent::start_with_env(&all, &[("MUSTER_COMM_BACKEND", "cpu"), ("NO_COLOR", "1")]);
    (agent, job)
}

/// One `started` line: the rank's pid and restart count.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Started {
    /// The trainer's pid.
    pub pid: i32,
    /// `MUSTER_RESTART_COUNT` it was started with.
    pub restarts: u32,
}

/// Parses `started rank=R pid=P restarts=N` (without the agent's `[rank R] ` prefix).
fn parse_started(line: &str, rank: u32) -> Option<Started> {
    let rest = line.strip_prefix(&format!("started rank={rank} pid="))?;
    let (pid, restarts) = rest.split_once(" restarts=")?;
    Some(Started {
        pid: pid.parse().ok()?,
        restarts: restarts.trim().parse().ok()?,
    })
}

/// Every `started` line of a finished run, by rank, in order.
pub fn starts(run: &Finished, procs: u32) -> BTreeMap<u32, Vec<Started>> {
    let mut by_rank: BTreeMap<u32, Vec<Started>> = BTreeMap::new();
    for rank in 0..procs {
        for line in run.rank_stdout(rank) {
            if let Some(s) = parse_started(line, rank) {
                by_rank.entry(rank).or_default().push(s);
            }
        }
    }
    by_rank
}

/// The `nth` (from 1) start of `rank` in a running job, waited for at most `timeout`.
pub fn started(agent: &Agent, rank: u32, nth: usize, timeout: Duration) -> Started {
    let prefix = format!("[rank {rank}] ");
    let lines = agent.wait_for_lines(Stream::Stdout, nth, timeout, |l| {
        l.strip_prefix(&prefix)
            .is_some_and(|l| parse_started(l, rank).is_some())
    });
    lines[nth - 1]
        .strip_prefix(&prefix)
        .and_then(|l| parse_started(l, rank))
        .unwrap_or_else(|| panic!("no start in {:?}", lines[nth - 1]))
}

/// Waits (at most `timeout`) until rank 0 has printed `step=<step>`.
pub fn wait_for_step(agent: &Agent, step: u64, timeout: Duration) {
    let want = format!(" step={step} ");
    agent.wait_for_lines(Stream::Stdout, 1, timeout, |l| {
        l.starts_with("[rank 0] epoch=") && l.contains(&want)
    });
}

/// SIGKILLs a worker by pid.
pub fn sigkill(pid: i32) {
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(pid),
        nix::sys::signal::Signal::SIGKILL,
    )
    .expect("the worker can be killed");
}

/// The final checksum rank 0 printed (`checksum=<hex>`).
pub fn checksum(run: &Finished) -> String {
    run.rank_stdout(0)
        .iter()
        .find(|l| l.starts_with("final "))
        .and_then(|l| l.split(' ').find(|w| w.starts_with("checksum=")))
        .map(str::to_owned)
        .unwrap_or_else(|| panic!("no final line\n{}", run.dump()))
}

/// The `recovered ...` lines rank 0 printed (without the prefix).
pub fn recoveries(run: &Finished) -> Vec<String> {
    run.rank_stdout(0)
        .into_iter()
        .filter(|l| l.starts_with("recovered "))
        .map(str::to_owned)
        .collect()
}

/// The agent's `rank R respawned in place` lines, as the ranks they name, in order.
pub fn respawned(stderr: &[String]) -> Vec<u32> {
    stderr
        .iter()
        .filter_map(|l| {
            let (_, rest) = l.split_once(": rank ")?;
            let (rank, _) = rest.split_once(" respawned in place")?;
            rank.parse().ok()
        })
        .collect()
}
