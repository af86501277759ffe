//! A coordinator that loses its state must never rerun a job's workers behind the user's back:
//! an in-memory coordinator killed with SIGKILL and started again on the same port no longer
//! knows the job, and every agent whose generation ran stops its workers and exits 1 with one
//! line naming the coordinator, the job and `--store etcd` (docs/contract.md, "A coordinator
//! that lost the job").

use muster_tests::{Agent, SLOW, Stream, coordinator_bin, free_port};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// `muster-coordinator --listen <addr> --store memory`, once it accepts connections.
fn memory_coordinator(addr: &str) -> Child {
    let bin = coordinator_bin();
    let child = Command::new(&bin)
        .args(["--listen", addr, "--store", "memory"])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap_or_else(|e| panic!("cannot start {}: {e}", bin.display()));
    let deadline = Instant::now() + SLOW;
    while std::net::TcpStream::connect(addr).is_err() {
        assert!(
            Instant::now() < deadline,
            "the coordinator never listened on {addr}"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
    child
}

/// Kills the coordinator on drop (the test may panic with it running).
struct Killed(Child);

impl Drop for Killed {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

#[test]
fn a_restarted_memory_coordinator_stops_the_job_instead_of_rerunning_it() {
    let addr = format!("127.0.0.1:{}", free_port());
    let mut first = Killed(memory_coordinator(&addr));
    let node = |rank: &str| {
        Agent::start(&[
            "launch",
            "--coordinator",
            &addr,
            "--job-id",
            "forgotten",
            "--nnodes",
            "2",
            "--node-rank",
            rank,
            "--nproc-per-node",
            "1",
            "--max-restarts",
            "0",
            "--grace-period-ms",
            "2000",
            "--",
            "sh",
            "-c",
            "echo started generation=$MUSTER_GENERATION; exec sleep 60",
        ])
    };
    let agents = [node("0"), node("1")];
    for agent in &agents {
        agent.wait_for_lines(Stream::Stdout, 1, SLOW, |l| l.contains("started"));
    }
    // SIGKILL: its in-memory state is gone; the same port serves a coordinator that never
    // heard of the job.
    first.0.kill().expect("SIGKILL the coordinator");
    first.0.wait().expect("reap the coordinator");
    let _second = Killed(memory_coordinator(&addr));
    let t = Instant::now();
    for agent in agents {
        let run = agent.finish(SLOW);
        assert_eq!(run.code(), Some(1), "{}", run.dump());
        let started: Vec<&String> = run
            .stdout
            .iter()
            .filter(|l| l.contains("started"))
            .collect();
        assert_eq!(started.len(), 1, "the workers ran again:\n{}", run.dump());
        let lost: Vec<&String> = run
            .stderr
            .iter()
            .filter(|l| l.contains("lost the job's state"))
            .collect();
        assert_eq!(lost.len(), 1, "{}", run.dump());
        let line = lost[0];
        for part in ["job forgotten", &addr, "generation 1", "--store etcd"] {
            assert!(
                line.contains(part),
                "no {part:?} in {line:?}\n{}",
                run.dump()
            );
        }
        for absent in ["joining again", "guardian"] {
            assert!(
                !run.stderr.iter().any(|l| l.contains(absent)),
                "{absent:?}:\n{}",
                run.dump()
            );
        }
    }
    assert!(t.elapsed() < Duration::from_secs(15), "{:?}", t.elapsed());
}
