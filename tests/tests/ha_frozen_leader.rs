//! A frozen leader (issue 14, finding 1): three coordinator replicas on a real etcd, two
//! `muster-agent launch` nodes running the `barrier_loop` example, and the leader SIGSTOPped
//! for longer than its lease, then SIGCONTed (three times, each time the replica that leads). A standby takes over while it sleeps; the agents
//! and workers move to it without waiting for the old leader to wake, and the old leader,
//! once woken, decides nothing (no "node ... was lost", no failure pushed to the clients still
//! connected to it) before stepping down. The job ends normally: every worker exits 0, none
//! restarts, and the new leader never records the job as failed. Skips, printing why, where
//! etcd or the example is missing.
#![allow(clippy::unwrap_used, missing_docs)]

use muster_proto::v1 as pb;
use muster_tests::etcd::Etcd;
use muster_tests::replicas::Replicas;
use muster_tests::{Agent, Stream, example_bin};
use std::time::{Duration, Instant};
use tonic::Code;

/// The election lease TTL (etcd's smallest practical TTL is 2 s).
const TTL: Duration = Duration::from_secs(2);
/// How long the leader stays stopped: past its lease (a standby leads after about TTL), and
/// past the time the standby gives every rank to re-attach once it leads (the heartbeat
/// timeout, 10 s), so that clients must move to the standby while the old leader sleeps; and
/// every liveness timer of the old leader has expired when it wakes.
const FROZEN: Duration = Duration::from_secs(15);
/// How many times a leader is frozen.
const CYCLES: usize = 2;
/// Barrier iterations per worker: enough that the loop is still running when the leader is
/// stopped (the loop does not advance while no coordinator answers).
const ITERS: &str = "20000";

/// DescribeJob at `addr`, retried while it answers UNAVAILABLE (a leader still loading).
async fn describe(addr: &str, job: &str) -> pb::DescribeJobResponse {
    let channel = tonic::transport::Channel::from_shared(format!("http://{addr}"))
        .unwrap()
        .connect_timeout(Duration::from_secs(2))
        .connect()
        .await
        .unwrap_or_else(|e| panic!("cannot connect to {addr}: {e}"));
    let mut ops = pb::ops_client::OpsClient::new(channel);
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        match ops
            .describe_job(pb::DescribeJobRequest {
                job_id: job.into(),
                ..Default::default()
            })
            .await
        {
            Ok(r) => return r.into_inner(),
            Err(s) if s.code() == Code::Unavailable && Instant::now() < deadline => {
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            Err(s) => panic!("DescribeJob({job}) at {addr}: {s:?}"),
        }
    }
}

/// Waits until the job runs at `addr` with its 4 ranks registered.
fn wait_running(runtime: &tokio::runtime::Runtime, addr: &str) {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let job = runtime.block_on(describe(addr, "frozen"));
        let running = job
            .summary
            .as_ref()
            .is_some_and(|s| s.state == pb::RoundState::Running as i32 && s.world_size == 4);
        let live = [pb::RankState::Running as i32, pb::RankState::Waiting as i32];
        let registered = job.ranks.len() == 4 && job.ranks.iter().all(|r| live.contains(&r.state));
        if running && registered {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "the job does not run with 4 registered ranks at {addr}: {job:?}"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Every replica's whole log (`Replicas::logs` has only their tails; it names the files).
fn full_logs(replicas: &Replicas) -> String {
    replicas
        .logs()
        .lines()
        .filter_map(|l| l.strip_prefix("--- replica "))
        .filter_map(|l| l.rsplit_once(", ")?.1.strip_suffix(')').map(str::to_owned))
        .map(|path| {
            let text = std::fs::read_to_string(&path).unwrap_or_default();
            format!("--- {path}\n{text}")
        })
        .collect::<Vec<_>>()
        .join("\n")
}

#[test]
fn a_leader_frozen_past_its_lease_fails_nothing_when_it_wakes() {
    let Some(barrier_loop) = example_bin("barrier_loop") else {
        println!("skipped: worker-sdk/examples/barrier_loop.rs does not exist");
        return;
    };
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let Some(etcd) = Etcd::start(1) else { return };
    let started = Instant::now();
    let mut replicas = Replicas::start(&etcd, 3, TTL, &[]);
    let leader = runtime.block_on(replicas.wait_leader(Duration::from_secs(15), &[]));
    let addrs = replicas.addrs();
    let script = format!(
        "echo ready rank=$RANK restarts=$TORCHELASTIC_RESTART_COUNT; exec {} --iters {ITERS} --warmup 5",
        barrier_loop.display()
    );
    let mut agents: Vec<Agent> = (0..2)
        .map(|node| {
            let node = node.to_string();
            Agent::start_with_env(
                &[
                    "launch",
                    "--coordinator",
                    &addrs,
                    "--job-id",
                    "frozen",
                    "--nnodes",
                    "2",
                    "--node-rank",
                    &node,
                    "--nproc-per-node",
                    "2",
                    "--grace-period-ms",
                    "1000",
                    "--",
                    "sh",
                    "-c",
                    &script,
                ],
                &[("NO_COLOR", "1")],
            )
        })
        .collect();
    for agent in &agents {
        agent.wait_for_lines(Stream::Stdout, 2, Duration::from_secs(30), |l| {
            l.contains("] ready ")
        });
    }
    // Each cycle freezes the replica that leads then: which of the old leader's tasks runs
    // first when it wakes is up to the scheduler, so one freeze may not show a wrong order.
    let mut leader = leader;
    for cycle in 0..CYCLES {
        // The generation runs at the leader with every rank registered (sessions, relays and
        // watches attached to it) before it is frozen.
        wait_running(&runtime, replicas.addr(leader));
        for (i, agent) in agents.iter_mut().enumerate() {
            assert!(
                !agent.exited(),
                "agent {i} finished before freeze {cycle}: raise ITERS\n{}",
                agent.output()
            );
        }
        let stopped = Instant::now();
        replicas.stop(leader);
        let new = runtime.block_on(replicas.wait_leader(Duration::from_secs(10), &[leader]));
        eprintln!(
            "freeze {cycle}: replica {new} leads {:?} after the SIGSTOP of replica {leader}",
            stopped.elapsed()
        );
        // The fault itself lasts FROZEN (this sleep is the length of the freeze, not a wait
        // for something to happen).
        std::thread::sleep(FROZEN.saturating_sub(stopped.elapsed()));
        replicas.cont(leader);
        eprintln!(
            "freeze {cycle}: replica {leader} resumed after {:?}",
            stopped.elapsed()
        );
        leader = new;
    }

    let deadline = Instant::now() + Duration::from_secs(120);
    let runs: Vec<_> = agents.into_iter().map(|a| a.finish_by(deadline)).collect();
    let logs = full_logs(&replicas);
    for (i, run) in runs.iter().enumerate() {
        assert_eq!(run.code(), Some(0), "agent {i}: {}\n{logs}", run.dump());
    }
    let ready: Vec<&String> = runs
        .iter()
        .flat_map(|r| &r.stdout)
        .filter(|l| l.contains("] ready "))
        .collect();
    assert_eq!(ready.len(), 4, "workers restarted: {ready:#?}\n{logs}");
    assert!(ready.iter().all(|l| l.contains("restarts=0")), "{ready:#?}");
    let results = runs
        .iter()
        .flat_map(|r| &r.stdout)
        .filter(|l| l.contains(&format!("iters={ITERS}")))
        .count();
    assert_eq!(results, 4, "not every worker finished its loop\n{logs}");
    assert!(
        !logs.contains("was lost") && !logs.contains("no heartbeat"),
        "a replica failed a node or rank across the freeze:\n{logs}"
    );

    // The replica that leads now (the standby, or the old leader again after a later
    // election) has never recorded the job as failed.
    let now = runtime.block_on(replicas.wait_leader(Duration::from_secs(15), &[]));
    let job = runtime.block_on(describe(replicas.addr(now), "frozen"));
    let summary = job.summary.unwrap();
    assert_ne!(
        summary.state,
        pb::RoundState::Failed as i32,
        "the job is FAILED at replica {now}: {summary:?}\n{logs}"
    );
    assert_eq!(summary.restart_count, 0, "{summary:?}");
    eprintln!("test took {:?}", started.elapsed());
}
