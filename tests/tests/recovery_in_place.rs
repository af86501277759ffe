//! End-to-end tests of in-place recovery (`muster-agent launch --recovery in-place`) with the
//! `ddp_train` example on 4 processes: a killed rank is respawned alone while the survivors keep
//! their processes, the ranks agree on a new membership at a step boundary, the replacement is
//! healed from a healthy rank over the data plane, and the discarded step is redone at full world
//! size, so the final weights are bit-identical to a failure-free run's. Faults: a rank that
//! aborts (`--fail-at-step`), two ranks SIGKILLed at once, the healing source SIGKILLed while it
//! heals, the replacement SIGKILLed as it starts, and no restart left.

use muster_tests::recovery::{
    checksum, ddp_train, recoveries, sigkill, start, started, starts, wait_for_step,
};
use muster_tests::{Agent, Finished, SLOW};
use std::collections::BTreeMap;
use std::path::Path;

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

/// Starts `ddp_train COMMON EXTRA` on [`PROCS`] processes under `muster-agent launch FLAGS`.
fn launch(bin: &Path, flags: &[&str], extra: &[&str]) -> Agent {
    let train: Vec<&str> = COMMON.iter().chain(extra).copied().collect();
    start(bin, PROCS, flags, &train).0
}

/// The failure-free reference: the same training, without any fault.
fn reference(bin: &Path) -> String {
    let run = launch(bin, &[], &["--quiet"]).finish(SLOW);
    assert_eq!(run.code(), Some(0), "{}", run.dump());
    checksum(&run)
}

/// How many times each rank started in a finished run.
fn start_counts(run: &Finished) -> BTreeMap<u32, usize> {
    starts(run, PROCS)
        .into_iter()
        .map(|(rank, s)| (rank, s.len()))
        .collect()
}

/// The pid of `rank`'s `nth` (from 1) start in a running job.
fn pid_of(agent: &Agent, rank: u32, nth: usize) -> i32 {
    started(agent, rank, nth, SLOW).pid
}

#[test]
fn a_rank_that_aborts_is_replaced_in_place_and_the_weights_are_bit_identical() {
    let Some(bin) = ddp_train() else {
        return;
    };
    let expected = reference(&bin);
    let run = launch(
        &bin,
        &["--recovery", "in-place", "--max-restarts", "1"],
        &["--fail-at-step", "15"],
    )
    .finish(SLOW);
    assert_eq!(run.code(), Some(0), "{}", run.dump());
    // The survivors' processes never changed; only the last rank started twice.
    let starts = start_counts(&run);
    for rank in 0..PROCS - 1 {
        assert_eq!(starts[&rank], 1, "rank {rank}\n{}", run.dump());
    }
    assert_eq!(starts[&(PROCS - 1)], 2, "{}", run.dump());
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
    let agent = launch(
        &bin,
        &["--recovery", "in-place", "--max-restarts", "2"],
        &["--step-sleep-ms", "30"],
    );
    let (one, two) = (pid_of(&agent, 1, 1), pid_of(&agent, 2, 1));
    wait_for_step(&agent, 10, SLOW);
    sigkill(one);
    sigkill(two);
    let run = agent.finish(SLOW);
    assert_eq!(run.code(), Some(0), "{}", run.dump());
    let starts = start_counts(&run);
    assert_eq!(starts[&0], 1, "{}", run.dump());
    assert_eq!(starts[&3], 1, "{}", run.dump());
    assert_eq!(starts[&1], 2, "{}", run.dump());
    assert_eq!(starts[&2], 2, "{}", run.dump());
    assert_eq!(checksum(&run), expected, "{}", run.dump());
}

#[test]
fn the_healing_source_killed_while_it_heals_is_replaced_too() {
    let Some(bin) = ddp_train() else {
        return;
    };
    let expected = reference(&bin);
    let agent = launch(
        &bin,
        &["--recovery", "in-place", "--max-restarts", "2"],
        &["--step-sleep-ms", "30"],
    );
    let (source, last) = (pid_of(&agent, 0, 1), pid_of(&agent, 3, 1));
    wait_for_step(&agent, 10, SLOW);
    sigkill(last);
    // Rank 0 is the lowest healthy rank, so it heals the replacement: kill it as the
    // replacement starts, before or while it sends the state.
    pid_of(&agent, 3, 2);
    sigkill(source);
    let run = agent.finish(SLOW);
    assert_eq!(run.code(), Some(0), "{}", run.dump());
    let starts = start_counts(&run);
    assert_eq!(starts[&0], 2, "{}", run.dump());
    assert_eq!(starts[&3], 2, "{}", run.dump());
    assert_eq!(starts[&1], 1, "{}", run.dump());
    assert_eq!(starts[&2], 1, "{}", run.dump());
    assert_eq!(checksum(&run), expected, "{}", run.dump());
}

#[test]
fn a_replacement_killed_as_it_starts_is_replaced_again() {
    let Some(bin) = ddp_train() else {
        return;
    };
    let expected = reference(&bin);
    let agent = launch(
        &bin,
        &["--recovery", "in-place", "--max-restarts", "2"],
        &["--step-sleep-ms", "30"],
    );
    let first = pid_of(&agent, 2, 1);
    wait_for_step(&agent, 10, SLOW);
    sigkill(first);
    let second = pid_of(&agent, 2, 2);
    sigkill(second);
    let run = agent.finish(SLOW);
    assert_eq!(run.code(), Some(0), "{}", run.dump());
    let starts = start_counts(&run);
    assert_eq!(starts[&2], 3, "{}", run.dump());
    for rank in [0, 1, 3] {
        assert_eq!(starts[&rank], 1, "rank {rank}\n{}", run.dump());
    }
    assert_eq!(checksum(&run), expected, "{}", run.dump());
}

#[test]
fn without_restarts_left_an_in_place_job_fails_naming_the_rank() {
    let Some(bin) = ddp_train() else {
        return;
    };
    let run = launch(
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
