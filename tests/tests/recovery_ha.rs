//! In-place recovery through a coordinator failover: `ddp_train` on 4 processes under
//! `muster-agent launch --recovery in-place --max-restarts 2`, the agent pointed at three
//! coordinator replicas on a real etcd (`muster_tests::replicas`), one worker SIGKILLed and the
//! coordinator leader SIGKILLed during its recovery: once the agent has respawned the worker
//! (the quorum then forms on the new leader), right after the worker's kill (its death is
//! reported to a dying leader or to none), and just before the worker's kill (the death and the
//! quorum happen while the standbys elect a new leader). Each run must end with exit 0 within
//! its limit, the survivors' pids unchanged, exactly one respawn of the killed rank (a new
//! leader must not replace it again), one restart counted (the replacement's
//! `MUSTER_RESTART_COUNT` and `describe`'s `restarts 1/2`), and the final checksum of a
//! failure-free run. A last test holds the budget across the failover: with `--max-restarts 1`
//! spent before the leader's death, a second worker's death fails the job on the new leader,
//! naming the rank, with no second respawn.
//!
//! Every test skips, printing why, where etcd is not installed. They run one at a time (a lock
//! in this file): each starts etcd, three coordinators and four trainers.

use muster_tests::etcd::Etcd;
use muster_tests::recovery::{
    checksum, ddp_train, recoveries, respawned, sigkill, start, started, starts, wait_for_step,
};
use muster_tests::replicas::Replicas;
use muster_tests::{Agent, SLOW, Stream, agent_bin};
use std::path::Path;
use std::process::Command;
use std::sync::Mutex;
use std::time::{Duration, Instant};

const PROCS: u32 = 4;
/// The election lease TTL (etcd's smallest practical TTL is 2 s).
const TTL: Duration = Duration::from_secs(2);
/// How long a run may take, failover included, on a loaded 2-core machine.
const LIMIT: Duration = Duration::from_secs(120);
/// 3 epochs of 16 steps, paced so that the failover happens mid-run.
const TRAIN: &[&str] = &[
    "--epochs",
    "3",
    "--samples",
    "512",
    "--batch-size",
    "32",
    "--eval-samples",
    "0",
    "--step-sleep-ms",
    "60",
];

static SERIAL: Mutex<()> = Mutex::new(());

/// When the leader dies, relative to the worker's SIGKILL.
#[derive(Debug, Clone, Copy)]
enum LeaderDies {
    /// Once the agent has printed `respawned in place` for the worker: the quorum is left to
    /// the new leader.
    AfterTheRespawn,
    /// Right after the worker's SIGKILL: the agent reports the death to a dying leader.
    RightAfterTheKill,
    /// Just before the worker's SIGKILL: the death is reported, and the quorum asked for,
    /// while the standbys elect a new leader.
    JustBeforeTheKill,
}

/// The failure-free reference checksum (the agent's own coordinator: the checksum does not
/// depend on which coordinator serves the job).
fn reference(bin: &Path) -> String {
    let mut train = TRAIN.to_vec();
    train.extend(["--quiet", "--step-sleep-ms", "0"]);
    let (agent, _) = start(bin, PROCS, &[], &train);
    let run = agent.finish(LIMIT);
    assert_eq!(run.code(), Some(0), "{}", run.dump());
    checksum(&run)
}

/// A `recovered ... healed=1,2 from=0 ...` line's healed ranks and their source.
fn healed_from(line: &str) -> (Vec<u32>, Option<u32>) {
    let field = |name: &str| {
        line.split_whitespace()
            .find_map(|w| w.strip_prefix(name))
            .unwrap_or_default()
            .to_owned()
    };
    let healed = field("healed=")
        .split(',')
        .filter_map(|r| r.parse().ok())
        .collect();
    (healed, field("from=").parse().ok())
}

/// `muster-agent describe --coordinator ADDRS JOB`'s output (exit 0 asserted).
fn describe(addrs: &str, job: &str) -> String {
    let mut cmd = Command::new(agent_bin());
    cmd.args(["describe", "--coordinator", addrs, job]);
    let run = Agent::spawn(cmd, format!("muster-agent describe {job}")).finish(SLOW);
    assert_eq!(run.code(), Some(0), "{}", run.dump());
    run.stdout.join("\n")
}

/// The run of every test here: rank `victim` SIGKILLed at step 10 and the leader SIGKILLed
/// `when`.
fn leader_killed(victim: u32, when: LeaderDies) {
    let Some(bin) = ddp_train() else {
        return;
    };
    let _serial = SERIAL
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    let Some(etcd) = Etcd::start(1) else {
        return;
    };
    let expected = reference(&bin);
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("a tokio runtime");
    let mut replicas = Replicas::start(&etcd, 3, TTL, &[]);
    let leader = runtime.block_on(replicas.wait_leader(LIMIT, &[]));
    let addrs = replicas.addrs();
    let (agent, job) = start(
        &bin,
        PROCS,
        &[
            "--coordinator",
            &addrs,
            "--recovery",
            "in-place",
            "--max-restarts",
            "2",
        ],
        TRAIN,
    );
    let before: Vec<i32> = (0..PROCS)
        .map(|rank| started(&agent, rank, 1, LIMIT).pid)
        .collect();
    wait_for_step(&agent, 10, LIMIT);
    let killed = Instant::now();
    match when {
        LeaderDies::AfterTheRespawn => {
            sigkill(before[victim as usize]);
            let line = format!("rank {victim} respawned in place");
            agent.wait_for_lines(Stream::Stderr, 1, LIMIT, |l| l.contains(&line));
            replicas.kill(leader);
        }
        LeaderDies::RightAfterTheKill => {
            sigkill(before[victim as usize]);
            replicas.kill(leader);
        }
        LeaderDies::JustBeforeTheKill => {
            replicas.kill(leader);
            sigkill(before[victim as usize]);
        }
    }
    let new = runtime.block_on(replicas.wait_leader(LIMIT, &[leader]));
    eprintln!(
        "{when:?}: replica {new} leads {:?} after the kills",
        killed.elapsed()
    );
    let run = agent.finish(LIMIT);
    let context = || format!("{}\n{}", run.dump(), replicas.logs());
    assert_eq!(run.code(), Some(0), "{}", context());
    // The survivors kept their processes; the victim started twice, its replacement with one
    // restart counted.
    let starts = starts(&run, PROCS);
    for rank in (0..PROCS).filter(|r| *r != victim) {
        let pids: Vec<i32> = starts[&rank].iter().map(|s| s.pid).collect();
        assert_eq!(pids, [before[rank as usize]], "rank {rank}\n{}", context());
    }
    let again = &starts[&victim];
    assert_eq!(again.len(), 2, "{}", context());
    assert_eq!(again[1].restarts, 1, "{}", context());
    // Exactly one respawn, and one recovery that healed the victim from a survivor. Survivors
    // may be healed too: a rank whose part of the interrupted all_reduce had completed applied
    // the step the others lost, and the quorum heals everyone behind it from it.
    assert_eq!(respawned(&run.stderr), [victim], "{}", context());
    let recovered = recoveries(&run);
    assert_eq!(recovered.len(), 1, "{recovered:?}\n{}", context());
    let (healed, from) = healed_from(&recovered[0]);
    assert!(
        healed.contains(&victim) && from.is_some_and(|f| f != victim && !healed.contains(&f)),
        "{recovered:?}\n{}",
        context()
    );
    // The new leader counts one restart of the two allowed, and one recovery.
    let view = describe(&addrs, &job);
    assert!(view.contains("restarts 1/2"), "{view}\n{}", replicas.logs());
    let listed: Vec<&str> = view.lines().filter(|l| l.starts_with("RECOVER")).collect();
    assert_eq!(listed.len(), 1, "{view}");
    assert!(
        listed[0].starts_with(&format!("RECOVERED epoch 1: rank {victim} ")),
        "{view}"
    );
    // The time from the death to the replacement's registration is kept through the failover
    // (no respawn takes 0 ms: a process starts and registers).
    let respawn = listed[0]
        .split_once(" after ")
        .and_then(|(_, rest)| rest.split_once(','))
        .map(|(took, _)| took);
    assert!(
        respawn.is_some_and(|took| took != "0 ms"),
        "{respawn:?} in {view}"
    );
    // Rank 0's step markers reached the new leader through its agent's gateway: the job's
    // effective training time is in the view (counted since that leader took over).
    assert!(
        view.lines().any(|l| l.starts_with("training: ETTR ")),
        "{view}"
    );
    assert_eq!(checksum(&run), expected, "{}", context());
    eprintln!("{when:?}: the run took {:?}; {}", run.elapsed, recovered[0]);
}

#[test]
fn the_leader_killed_after_the_respawn() {
    leader_killed(2, LeaderDies::AfterTheRespawn);
}

#[test]
fn the_leader_killed_right_after_the_workers_kill() {
    leader_killed(1, LeaderDies::RightAfterTheKill);
}

#[test]
fn the_leader_killed_just_before_the_workers_kill() {
    leader_killed(3, LeaderDies::JustBeforeTheKill);
}

/// `--max-restarts 1`: rank 2 SIGKILLed and the leader right after, rank 2 replaced and healed
/// through the failover; then rank 1 SIGKILLed. The new leader knows the one restart is spent:
/// the job fails naming rank 1, which is not respawned.
#[test]
fn the_budget_holds_across_the_failover() {
    let Some(bin) = ddp_train() else {
        return;
    };
    let _serial = SERIAL
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    let Some(etcd) = Etcd::start(1) else {
        return;
    };
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("a tokio runtime");
    let mut replicas = Replicas::start(&etcd, 3, TTL, &[]);
    let leader = runtime.block_on(replicas.wait_leader(LIMIT, &[]));
    let addrs = replicas.addrs();
    let (agent, job) = start(
        &bin,
        PROCS,
        &[
            "--coordinator",
            &addrs,
            "--recovery",
            "in-place",
            "--max-restarts",
            "1",
        ],
        TRAIN,
    );
    let before: Vec<i32> = (0..PROCS)
        .map(|rank| started(&agent, rank, 1, LIMIT).pid)
        .collect();
    wait_for_step(&agent, 10, LIMIT);
    sigkill(before[2]);
    replicas.kill(leader);
    agent.wait_for_lines(Stream::Stdout, 1, LIMIT, |l| {
        l.starts_with("[rank 0] recovered ")
    });
    sigkill(before[1]);
    let run = agent.finish(LIMIT);
    let context = || format!("{}\n{}", run.dump(), replicas.logs());
    assert_ne!(run.code(), Some(0), "{}", context());
    assert_eq!(respawned(&run.stderr), [2], "{}", context());
    assert!(
        run.stderr
            .iter()
            .any(|l| l.contains("failed: rank 1 ") && l.contains("signal 9")),
        "{}",
        context()
    );
    assert!(
        run.stderr
            .iter()
            .any(|l| l.contains("no restarts left (1 of 1 used)")),
        "{}",
        context()
    );
    let view = describe(&addrs, &job);
    assert!(view.contains("restarts 1/1"), "{view}\n{}", replicas.logs());
}

/// Three rounds, each a random rank SIGKILLed and the leader SIGKILLed right after (the killed
/// replica started again once a new leader leads, so that three replicas stand for the next
/// round): three recoveries through three failovers, each rank respawned once per kill, the
/// budget counting three of three, and the failure-free checksum.
#[test]
fn three_recoveries_through_three_failovers() {
    let Some(bin) = ddp_train() else {
        return;
    };
    let _serial = SERIAL
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    let Some(etcd) = Etcd::start(1) else {
        return;
    };
    let expected = reference(&bin);
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("a tokio runtime");
    let mut replicas = Replicas::start(&etcd, 3, TTL, &[]);
    let addrs = replicas.addrs();
    let (agent, job) = start(
        &bin,
        PROCS,
        &[
            "--coordinator",
            &addrs,
            "--recovery",
            "in-place",
            "--max-restarts",
            "3",
        ],
        TRAIN,
    );
    let mut pids: Vec<i32> = (0..PROCS)
        .map(|rank| started(&agent, rank, 1, LIMIT).pid)
        .collect();
    wait_for_step(&agent, 5, LIMIT);
    // Ranks 3, 0 and 3 again: the main process and a replacement among them.
    let victims = [3u32, 0, 3];
    for (round, victim) in victims.iter().enumerate() {
        let leader = runtime.block_on(replicas.wait_leader(LIMIT, &[]));
        sigkill(pids[*victim as usize]);
        replicas.kill(leader);
        agent.wait_for_lines(Stream::Stdout, round + 1, LIMIT, |l| {
            l.starts_with("[rank 0] recovered ")
        });
        let nth = 1 + victims[..=round].iter().filter(|v| *v == victim).count();
        pids[*victim as usize] = started(&agent, *victim, nth, LIMIT).pid;
        replicas.restart(leader);
    }
    let run = agent.finish(LIMIT);
    let context = || format!("{}\n{}", run.dump(), replicas.logs());
    assert_eq!(run.code(), Some(0), "{}", context());
    assert_eq!(respawned(&run.stderr), victims, "{}", context());
    let starts = starts(&run, PROCS);
    let counts: Vec<usize> = (0..PROCS).map(|r| starts[&r].len()).collect();
    assert_eq!(counts, [2, 1, 1, 3], "{}", context());
    assert_eq!(recoveries(&run).len(), 3, "{}", context());
    let view = describe(&addrs, &job);
    assert!(view.contains("restarts 3/3"), "{view}\n{}", replicas.logs());
    // Each leader kept the recoveries of the leaders before it.
    let listed = view.lines().filter(|l| l.starts_with("RECOVERED ")).count();
    assert_eq!(listed, 3, "{view}");
    assert_eq!(checksum(&run), expected, "{}", context());
}
