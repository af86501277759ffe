//! End-to-end tests of in-place recovery (`muster-agent launch --recovery in-place`) with the
//! `ddp_train` example on 4 processes: a killed rank is respawned alone while the survivors keep
//! their processes, the ranks agree on a new membership at a step boundary, the replacement is
//! healed from a healthy rank over the data plane, and the discarded step is redone at full world
//! size, so the final weights are bit-identical to a failure-free run's. Faults: a rank that
//! aborts (`--fail-at-step`), two ranks SIGKILLed at once, the healing source SIGKILLed while it
//! heals, the replacement SIGKILLed as it starts, and no restart left.

use muster_tests::{Agent, Finished, SLOW, Stream, example_bin};
use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;
use std::collections::BTreeMap;
use std::path::PathBuf;

const PROCS: u32 = 4;

/// `ddp_train`'s arguments for every run here: 3 epochs of 16 steps.
const COMMON: &[&str] = &[
    "--epochs",
    "3",
    "--samples",
    "512",
    "--batch-size",
    "32",
    "--eval-samples",
    "0",
];

fn ddp_train() -> Option<PathBuf> {
    let bin = example_bin("ddp_train");
    if bin.is_none() {
        eprintln!("skipped: worker-sdk/examples/ddp_train does not exist");
    }
    bin
}

/// Starts `ddp_train COMMON EXTRA` on [`PROCS`] processes under `muster-agent launch FLAGS`,
/// each worker printing `started rank=R pid=P` first (the shell execs the trainer, so the pid is
/// the trainer's).
fn start(bin: &std::path::Path, flags: &[&str], extra: &[&str]) -> Agent {
    let procs = PROCS.to_string();
    let job = format!(
        "recovery-{}-{}",
        std::process::id(),
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos())
    );
    let mut trainer = vec![bin.to_str().expect("a UTF-8 path").to_owned()];
    trainer.extend(COMMON.iter().chain(extra).map(|s| (*s).to_owned()));
    let script = format!("echo started rank=$RANK pid=$$; exec {}", trainer.join(" "));
    let mut all = vec!["launch"];
    all.extend_from_slice(flags);
    all.extend_from_slice(&["--nproc-per-node", &procs, "--job-id", &job, "--"]);
    all.extend_from_slice(&["sh", "-c", &script]);
    Agent::start_with_env(&all, &[("MUSTER_COMM_BACKEND", "cpu")])
}

/// The final checksum rank 0 printed.
fn checksum(run: &Finished) -> String {
    run.rank_stdout(0)
        .iter()
        .find(|l| l.starts_with("final "))
        .and_then(|l| l.split(' ').find(|w| w.starts_with("checksum=")))
        .map(str::to_owned)
        .unwrap_or_else(|| panic!("no final line\n{}", run.dump()))
}

/// The failure-free reference: the same training, without any fault.
fn reference(bin: &std::path::Path) -> String {
    let run = start(bin, &[], &["--quiet"]).finish(SLOW);
    assert_eq!(run.code(), Some(0), "{}", run.dump());
    checksum(&run)
}

/// Every `started` line, by rank: the pids each rank ran as, in order.
fn starts(run: &Finished) -> BTreeMap<u32, Vec<i32>> {
    let mut by_rank: BTreeMap<u32, Vec<i32>> = BTreeMap::new();
    for rank in 0..PROCS {
        for line in run.rank_stdout(rank) {
            if let Some(pid) = line
                .strip_prefix(&format!("started rank={rank} pid="))
                .and_then(|p| p.parse().ok())
            {
                by_rank.entry(rank).or_default().push(pid);
            }
        }
    }
    by_rank
}

/// The pid a running job's `rank` started as (its latest start).
fn pid_of(agent: &Agent, rank: u32, nth: usize) -> i32 {
    let prefix = format!("[rank {rank}] started rank={rank} pid=");
    let lines = agent.wait_for_lines(Stream::Stdout, nth, SLOW, |l| l.starts_with(&prefix));
    lines[nth - 1]
        .strip_prefix(&prefix)
        .and_then(|p| p.parse().ok())
        .unwrap_or_else(|| panic!("no pid in {:?}", lines[nth - 1]))
}

/// Waits until rank 0 has printed `step=<step>`.
fn wait_for_step(agent: &Agent, step: u64) {
    let want = format!(" step={step} ");
    agent.wait_for_lines(Stream::Stdout, 1, SLOW, |l| {
        l.starts_with("[rank 0] epoch=") && l.contains(&want)
    });
}

fn sigkill(pid: i32) {
    kill(Pid::from_raw(pid), Signal::SIGKILL).expect("the worker can be killed");
}

/// The `recovered` lines rank 0 printed.
fn recoveries(run: &Finished) -> Vec<String> {
    run.rank_stdout(0)
        .into_iter()
        .filter(|l| l.starts_with("recovered "))
        .map(str::to_owned)
        .collect()
}

#[test]
fn a_rank_that_aborts_is_replaced_in_place_and_the_weights_are_bit_identical() {
    let Some(bin) = ddp_train() else {
        return;
    };
    let expected = reference(&bin);
    let run = start(
        &bin,
        &["--recovery", "in-place", "--max-restarts", "1"],
        &["--fail-at-step", "15"],
    )
    .finish(SLOW);
    assert_eq!(run.code(), Some(0), "{}", run.dump());
    // The survivors' processes never changed; only the last rank started twice.
    let starts = starts(&run);
    for rank in 0..PROCS - 1 {
        assert_eq!(starts[&rank].len(), 1, "rank {rank}\n{}", run.dump());
    }
    assert_eq!(starts[&(PROCS - 1)].len(), 2, "{}", run.dump());
    assert!(
        run.stderr
            .iter()
            .any(|l| l.contains("rank 3 respawned in place")),
        "{}",
        run.dump()
    );
    // One recovery, the replacement healed from a survivor.
    let recovered = recoveries(&run);
    assert_eq!(recovered.len(), 1, "{}", run.dump());
    assert!(recovered[0].contains("healed=3"), "{}", recovered[0]);
    assert_eq!(checksum(&run), expected, "{}", run.dump());
}

#[test]
fn two_ranks_killed_at_once_are_both_replaced() {
    let Some(bin) = ddp_train() else {
        return;
    };
    let expected = reference(&bin);
    let agent = start(
        &bin,
        &["--recovery", "in-place", "--max-restarts", "2"],
        &["--step-sleep-ms", "30"],
    );
    let (one, two) = (pid_of(&agent, 1, 1), pid_of(&agent, 2, 1));
    wait_for_step(&agent, 10);
    sigkill(one);
    sigkill(two);
    let run = agent.finish(SLOW);
    assert_eq!(run.code(), Some(0), "{}", run.dump());
    let starts = starts(&run);
    assert_eq!(starts[&0].len(), 1, "{}", run.dump());
    assert_eq!(starts[&3].len(), 1, "{}", run.dump());
    assert_eq!(starts[&1].len(), 2, "{}", run.dump());
    assert_eq!(starts[&2].len(), 2, "{}", run.dump());
    assert_eq!(checksum(&run), expected, "{}", run.dump());
}

#[test]
fn the_healing_source_killed_while_it_heals_is_replaced_too() {
    let Some(bin) = ddp_train() else {
        return;
    };
    let expected = reference(&bin);
    let agent = start(
        &bin,
        &["--recovery", "in-place", "--max-restarts", "2"],
        &["--step-sleep-ms", "30"],
    );
    let (source, last) = (pid_of(&agent, 0, 1), pid_of(&agent, 3, 1));
    wait_for_step(&agent, 10);
    sigkill(last);
    // Rank 0 is the lowest healthy rank, so it heals the replacement: kill it as the
    // replacement starts, before or while it sends the state.
    pid_of(&agent, 3, 2);
    sigkill(source);
    let run = agent.finish(SLOW);
    assert_eq!(run.code(), Some(0), "{}", run.dump());
    let starts = starts(&run);
    assert_eq!(starts[&0].len(), 2, "{}", run.dump());
    assert_eq!(starts[&3].len(), 2, "{}", run.dump());
    assert_eq!(starts[&1].len(), 1, "{}", run.dump());
    assert_eq!(starts[&2].len(), 1, "{}", run.dump());
    assert_eq!(checksum(&run), expected, "{}", run.dump());
}

#[test]
fn a_replacement_killed_as_it_starts_is_replaced_again() {
    let Some(bin) = ddp_train() else {
        return;
    };
    let expected = reference(&bin);
    let agent = start(
        &bin,
        &["--recovery", "in-place", "--max-restarts", "2"],
        &["--step-sleep-ms", "30"],
    );
    let first = pid_of(&agent, 2, 1);
    wait_for_step(&agent, 10);
    sigkill(first);
    let second = pid_of(&agent, 2, 2);
    sigkill(second);
    let run = agent.finish(SLOW);
    assert_eq!(run.code(), Some(0), "{}", run.dump());
    let starts = starts(&run);
    assert_eq!(starts[&2].len(), 3, "{}", run.dump());
    for rank in [0, 1, 3] {
        assert_eq!(starts[&rank].len(), 1, "rank {rank}\n{}", run.dump());
    }
    assert_eq!(checksum(&run), expected, "{}", run.dump());
}

#[test]
fn without_restarts_left_an_in_place_job_fails_naming_the_rank() {
    let Some(bin) = ddp_train() else {
        return;
    };
    let run = start(
        &bin,
        &["--recovery", "in-place", "--max-restarts", "0"],
        &["--fail-at-step", "5", "--quiet"],
    )
    .finish(SLOW);
    assert_ne!(run.code(), Some(0), "{}", run.dump());
    assert!(
        run.stderr
            .iter()
            .any(|l| l.contains("rank 3") && l.contains("signal 6")),
        "{}",
        run.dump()
    );
    assert!(
        !run.stderr.iter().any(|l| l.contains("respawned in place")),
        "{}",
        run.dump()
    );
}
