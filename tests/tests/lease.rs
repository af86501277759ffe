//! The node's lease (issue 14, finding 7): a node cut off from its only coordinator stops its
//! workers once it has not heard the coordinator for `--lease-ms`, as docs/ha.md promises,
//! not after the failover budget (`--failover-timeout-ms`), which never keeps running workers
//! (only a finishing node's `finished` is delivered within it). Real processes: one `muster-coordinator`, one
//! `muster-agent launch` whose workers sleep, and the coordinator SIGKILLed (its connections
//! close: the watch stream breaks) or SIGSTOPped (its connections stay open and silent).
//!
//! And the coordinator's side (finding 1): a coordinator that did not run for longer than its
//! heartbeat timeout does not blame the nodes and ranks it could not hear; once it runs again
//! it reads their heartbeats, queued meanwhile, and the job goes on.
#![allow(clippy::unwrap_used, missing_docs)]

use muster_tests::coordinator::Coordinator;
use muster_tests::{Agent, Stream, example_bin};
use nix::sys::signal::Signal;
use std::time::{Duration, Instant};

/// The node's lease.
const LEASE: Duration = Duration::from_secs(2);
/// The failover budget: far longer than the lease, so that a node that waits it out is told
/// apart from one that keeps its lease with an order of magnitude of margin.
const BUDGET: Duration = Duration::from_secs(120);
/// How long after the fault the node must have stopped its workers: ten leases (scheduling on
/// a loaded machine, the SIGTERM grace period), and still a small part of the budget.
const BOUND: Duration = Duration::from_secs(20);

/// Runs one node of two sleeping workers on `coordinator`, applies `fault` to the coordinator
/// once the workers run, and checks that the agent stops them and exits naming the lost
/// coordinator within [`BOUND`].
fn the_node_gives_up_after_its_lease(coordinator: &Coordinator, job: &str, fault: Signal) {
    let lease = LEASE.as_millis().to_string();
    let budget = BUDGET.as_millis().to_string();
    let mut agent = Agent::start_with_env(
        &[
            "launch",
            "--coordinator",
            &coordinator.addr,
            "--job-id",
            job,
            "--nproc-per-node",
            "2",
            "--lease-ms",
            &lease,
            "--failover-timeout-ms",
            &budget,
            "--grace-period-ms",
            "1000",
            "--",
            "sh",
            "-c",
            "echo ready pid=$$; exec sleep 600",
        ],
        &[("NO_COLOR", "1")],
    );
    let ready = agent.wait_for_lines(Stream::Stdout, 2, Duration::from_secs(30), |l| {
        l.contains("] ready pid=")
    });
    let workers: Vec<i32> = ready
        .iter()
        .map(|l| l.rsplit("pid=").next().unwrap().trim().parse().unwrap())
        .collect();
    assert!(!agent.exited(), "the agent ended early\n{}", agent.output());

    let pid = nix::unistd::Pid::from_raw(i32::try_from(coordinator.pid()).unwrap());
    nix::sys::signal::kill(pid, fault).unwrap();
    let fault_at = Instant::now();
    let run = agent.finish_by(fault_at + BOUND);
    let took = fault_at.elapsed();
    eprintln!(
        "{fault}: the node stopped its workers {took:?} after the fault (lease {LEASE:?}, failover budget {BUDGET:?})"
    );
    if fault == Signal::SIGSTOP {
        nix::sys::signal::kill(pid, Signal::SIGCONT).unwrap();
    }
    assert_eq!(run.code(), Some(1), "{}", run.dump());
    assert!(
        run.stderr.iter().any(|l| l.starts_with(&format!(
            "muster-agent: job {job} failed: this node lost the coordinator"
        ))),
        "{}",
        run.dump()
    );
    // The lease counts from the coordinator's last heartbeat (every quarter lease), which
    // came a little before the fault.
    assert!(
        took >= LEASE / 2,
        "the node gave up before its lease: {took:?}"
    );
    for worker in workers {
        assert!(
            !std::path::Path::new(&format!("/proc/{worker}")).exists(),
            "worker {worker} outlived its agent"
        );
    }
}

/// The only coordinator dies: the watch stream breaks at once, and there is no other replica
/// to fail over to, so the lease decides, not the failover budget.
#[test]
fn a_node_whose_only_coordinator_dies_stops_its_workers_after_the_lease() {
    let coordinator = Coordinator::start(&[]);
    the_node_gives_up_after_its_lease(&coordinator, "lease-kill", Signal::SIGKILL);
}

/// The only coordinator freezes: its connections stay open and silent; the lease decides.
#[test]
fn a_node_whose_only_coordinator_freezes_stops_its_workers_after_the_lease() {
    let coordinator = Coordinator::start(&[]);
    the_node_gives_up_after_its_lease(&coordinator, "lease-stop", Signal::SIGSTOP);
}

/// A single coordinator is stopped, three times, for three times its heartbeat timeout while a job's ranks
/// enter barriers through it (no relay: every barrier and heartbeat goes to the coordinator)
/// and the node's lease is long: when it runs again, its liveness timers are all due, yet it
/// fails no rank and no node, and the job ends normally.
#[test]
fn a_coordinator_that_did_not_run_blames_no_node() {
    let Some(barrier_loop) = example_bin("barrier_loop") else {
        println!("skipped: worker-sdk/examples/barrier_loop.rs does not exist");
        return;
    };
    let coordinator = Coordinator::start(&["--heartbeat-timeout-ms", "1000"]);
    let script = format!(
        "echo ready; exec {} --iters 10000 --warmup 5",
        barrier_loop.display()
    );
    let mut agent = Agent::start_with_env(
        &[
            "launch",
            "--coordinator",
            &coordinator.addr,
            "--job-id",
            "paused",
            "--nproc-per-node",
            "2",
            "--no-relay",
            "--lease-ms",
            "60000",
            "--",
            "sh",
            "-c",
            &script,
        ],
        &[("NO_COLOR", "1")],
    );
    agent.wait_for_lines(Stream::Stdout, 2, Duration::from_secs(30), |l| {
        l.contains("] ready")
    });
    let pid = nix::unistd::Pid::from_raw(i32::try_from(coordinator.pid()).unwrap());
    // Which task runs first when the coordinator wakes is up to its scheduler: several pauses
    // make a wrong order show. Each lasts 3 s, then the job runs for 1 s (these sleeps are
    // the fault schedule, not waits for something to happen).
    for pause in 0..3 {
        assert!(
            !agent.exited(),
            "the job ended before pause {pause}: raise --iters\n{}",
            agent.output()
        );
        nix::sys::signal::kill(pid, Signal::SIGSTOP).unwrap();
        std::thread::sleep(Duration::from_secs(3));
        nix::sys::signal::kill(pid, Signal::SIGCONT).unwrap();
        std::thread::sleep(Duration::from_secs(1));
    }
    let run = agent.finish(Duration::from_secs(120));
    assert_eq!(run.code(), Some(0), "{}", run.dump());
    let results = run
        .stdout
        .iter()
        .filter(|l| l.contains("iters=10000"))
        .count();
    assert_eq!(results, 2, "{}", run.dump());
}
