//! Training outlives an outage of etcd itself (issue 28, item 7): 3 coordinator replicas on a
//! real etcd, 2 `muster-agent launch` nodes of 2 `fault_probe` workers (barriers, unique ids,
//! the key-value store), and etcd SIGKILLed for 2 minutes, four times the failover budget.
//! Every replica answers "no leader is elected" meanwhile, which proves that nobody can hand
//! the nodes' ranks to others (docs/ha.md, "An etcd outage"): the workers wait in their
//! barrier, keep their pids, go on once etcd is back, and the job exits 0 in one generation.
//! The workers' history passes the fault suite's checker (`muster_tests::faults`).
//!
//! Its other side, one agent cut off from every replica while a leader lives (its workers stop
//! at its lease, before any replacement starts), is `lease.rs`'s and the fault suite's
//! `link-cut`; `etcd-outage-long` is a kind of the fault suite. Skipped, printing why, where
//! etcd is not installed.
#![allow(clippy::unwrap_used, missing_docs)]

use std::path::Path;
use std::time::{Duration, Instant};

use muster::client::{Coordinator, Kv};
use muster_tests::etcd::Etcd;
use muster_tests::faults::{self, Event, WorkerEvent};
use muster_tests::replicas::Replicas;
use muster_tests::{Agent, example_bin};

/// The election lease TTL of the replicas (etcd's smallest practical TTL is 2 s).
const TTL: Duration = Duration::from_secs(2);
/// How long etcd stays down: the 2 minutes.
const OUTAGE: Duration = Duration::from_secs(120);
/// Nodes and workers per node.
const NODES: usize = 2;
const NPROC: usize = 2;

/// The last barrier every rank of generation `generation` completed, from the history.
fn progress(path: &Path) -> (Option<u64>, Vec<u64>) {
    let (events, _) = faults::read_history(path).unwrap_or_default();
    let mut generation = None;
    let mut done = vec![0u64; NODES * NPROC];
    for e in &events {
        if let Event::Worker {
            generation: g,
            rank,
            event,
            ..
        } = e
        {
            generation.get_or_insert(*g);
            if let WorkerEvent::BarrierExit { seq, .. } = event
                && let Some(d) = done.get_mut(*rank as usize)
            {
                *d = (*d).max(*seq);
            }
        }
    }
    (generation, done)
}

fn min_progress(path: &Path) -> u64 {
    progress(path).1.into_iter().min().unwrap_or(0)
}

/// Waits until every rank completed barrier `seq`.
fn wait_progress(path: &Path, seq: u64, timeout: Duration, agents: &mut [Agent], what: &str) {
    let deadline = Instant::now() + timeout;
    while min_progress(path) < seq {
        for (i, a) in agents.iter_mut().enumerate() {
            assert!(!a.exited(), "agent {i} exited {what}:\n{}", a.output());
        }
        assert!(
            Instant::now() < deadline,
            "the ranks did not all pass barrier {seq} within {timeout:?} {what}: {:?}",
            progress(path).1
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// Restarts etcd member 0, retrying a few times (its ports can be briefly held by a client's
/// self-connect; see `ha_failover.rs`).
fn restart_etcd(etcd: &mut Etcd) {
    const ATTEMPTS: u32 = 5;
    for attempt in 1..=ATTEMPTS {
        match std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| etcd.restart(0))) {
            Ok(()) => return,
            Err(panic) if attempt == ATTEMPTS => std::panic::resume_unwind(panic),
            Err(_) => {
                eprintln!("etcd did not restart (attempt {attempt}); trying again");
                std::thread::sleep(Duration::from_millis(300));
            }
        }
    }
}

#[test]
fn a_job_outlives_a_two_minute_etcd_outage() {
    let Some(probe) = example_bin("fault_probe") else {
        println!("skipped: worker-sdk/examples/fault_probe.rs does not exist");
        return;
    };
    let Some(mut etcd) = Etcd::start(1) else {
        return;
    };
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let started = Instant::now();
    let replicas = Replicas::start(&etcd, 3, TTL, &[]);
    rt.block_on(replicas.wait_leader(Duration::from_secs(20), &[]));
    let addrs = replicas.addrs();
    let dir = std::env::temp_dir().join(format!("muster-etcd-outage-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let history = dir.join("history.jsonl");
    let history_arg = history.display().to_string();
    let probe_arg = probe.display().to_string();
    let job = "etcd-outage";
    let mut agents: Vec<Agent> = (0..NODES)
        .map(|node| {
            let node = node.to_string();
            Agent::start_with_env(
                &[
                    "launch",
                    "--coordinator",
                    &addrs,
                    "--job-id",
                    job,
                    "--nnodes",
                    &NODES.to_string(),
                    "--node-rank",
                    &node,
                    "--nproc-per-node",
                    &NPROC.to_string(),
                    "--max-restarts",
                    "0",
                    "--grace-period-ms",
                    "1000",
                    "--",
                    &probe_arg,
                ],
                &[
                    ("NO_COLOR", "1"),
                    ("MUSTER_FAULT_HISTORY", &history_arg),
                    ("MUSTER_FAULT_PACE_MS", "100"),
                ],
            )
        })
        .collect();
    wait_progress(
        &history,
        5,
        Duration::from_secs(60),
        &mut agents,
        "before the outage",
    );

    let before = progress(&history).1;
    let killed = Instant::now();
    etcd.kill(0);
    eprintln!("etcd SIGKILLed; barriers done per rank: {before:?}");
    while killed.elapsed() < OUTAGE {
        for (i, a) in agents.iter_mut().enumerate() {
            assert!(
                !a.exited(),
                "agent {i} exited {:?} into the etcd outage:\n{}\n{}",
                killed.elapsed(),
                a.output(),
                replicas.logs()
            );
        }
        std::thread::sleep(Duration::from_millis(500));
    }
    let stalled = progress(&history).1;
    restart_etcd(&mut etcd);
    let restarted = Instant::now();
    eprintln!(
        "etcd restarted after {:?}; barriers done per rank: {stalled:?}",
        killed.elapsed()
    );
    let resume_at = stalled.iter().copied().max().unwrap_or(0) + 3;
    wait_progress(
        &history,
        resume_at,
        Duration::from_secs(60),
        &mut agents,
        "after etcd came back",
    );
    eprintln!(
        "every rank passed barrier {resume_at} {:?} after etcd restarted",
        restarted.elapsed()
    );

    rt.block_on(async {
        let kv = Kv::new(Coordinator::connect(&addrs).await.unwrap(), job.to_owned());
        kv.set("fault-stop", "1").await.unwrap();
    });
    let deadline = Instant::now() + Duration::from_secs(60);
    let runs: Vec<_> = agents.into_iter().map(|a| a.finish_by(deadline)).collect();
    for (i, run) in runs.iter().enumerate() {
        assert_eq!(
            run.code(),
            Some(0),
            "agent {i}: {}\n{}",
            run.dump(),
            replicas.logs()
        );
    }
    // Each agent said why it kept its workers.
    for (i, run) in runs.iter().enumerate() {
        assert!(
            run.stderr
                .iter()
                .any(|l| l.contains("no coordinator replica leads")),
            "agent {i} did not name the leaderless replicas:\n{}",
            run.dump()
        );
    }

    let (events, bad) = faults::read_history(&history).unwrap();
    assert!(bad.is_empty(), "lines that did not parse: {bad:?}");
    let mut starts = Vec::new();
    let mut exits = Vec::new();
    for e in &events {
        if let Event::Worker {
            generation,
            rank,
            pid,
            event,
            ..
        } = e
        {
            match event {
                WorkerEvent::Start { restart_count, .. } => {
                    starts.push((*generation, *rank, *pid, *restart_count));
                }
                WorkerEvent::Exit { status, .. } => exits.push((*rank, *status)),
                _ => {}
            }
        }
    }
    starts.sort_unstable();
    assert_eq!(
        starts.len(),
        NODES * NPROC,
        "a worker started again: {starts:?}"
    );
    assert!(
        starts.iter().all(|s| s.0 == starts[0].0 && s.3 == 0),
        "not one generation: {starts:?}"
    );
    exits.sort_unstable();
    assert_eq!(
        exits,
        (0..u32::try_from(NODES * NPROC).unwrap())
            .map(|r| (r, 0))
            .collect::<Vec<_>>(),
        "not every worker exited 0"
    );
    let mut violations = faults::check_unique_ranks(&events);
    violations.extend(faults::check_barriers(&events));
    violations.extend(faults::check_unique_ids(&events));
    assert!(
        violations.is_empty(),
        "{}",
        violations
            .iter()
            .map(ToString::to_string)
            .collect::<Vec<_>>()
            .join("\n")
    );
    let _ = std::fs::remove_dir_all(&dir);
    eprintln!(
        "the job exited 0 after a {OUTAGE:?} etcd outage; test took {:?}",
        started.elapsed()
    );
}
