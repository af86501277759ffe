//! End-to-end restarts with the real `muster-agent launch`: a job whose worker fails on the
//! first attempts restarts with a new generation and new ranks until it succeeds or its
//! budget (`--max-restarts`, counted by the coordinator) is spent, and then prints the root
//! cause. Also several agents of one job on this machine (a coordinator of their own), where a
//! failure on one node restarts every node.

use muster_tests::coordinator::Coordinator;
use muster_tests::{Agent, SLOW};
use std::time::Duration;

/// Local rank 1 fails (exit 3, after a line on stderr) while the restart count is below
/// `fail_until`, 0.3 s after it starts (so that every other worker has printed its start
/// line); every other worker waits long enough to be stopped by the failure.
fn flaky(fail_until: u32) -> String {
    format!(
        "echo start rank=$RANK gen=$MUSTER_GENERATION restart=$TORCHELASTIC_RESTART_COUNT muster_restart=$MUSTER_RESTART_COUNT max=$TORCHELASTIC_MAX_RESTARTS; \
         if [ \"$LOCAL_RANK\" = 1 ] && [ \"$TORCHELASTIC_RESTART_COUNT\" -lt {fail_until} ]; then \
           sleep 0.3; echo \"boom on attempt $TORCHELASTIC_RESTART_COUNT\" >&2; exit 3; fi; \
         if [ \"$TORCHELASTIC_RESTART_COUNT\" -lt {fail_until} ]; then exec sleep 30; fi; \
         echo done rank=$RANK"
    )
}

fn launch(n: u32, max_restarts: u32, script: &str) -> Agent {
    let n = n.to_string();
    let m = max_restarts.to_string();
    Agent::start(&[
        "launch",
        "--nproc-per-node",
        &n,
        "--max-restarts",
        &m,
        "--grace-period-ms",
        "2000",
        "--",
        "sh",
        "-c",
        script,
    ])
}

#[test]
fn a_job_that_fails_twice_succeeds_on_its_third_generation() {
    let run = launch(2, 2, &flaky(2)).finish(SLOW);
    assert_eq!(run.code(), Some(0), "{}", run.dump());
    for rank in 0..2 {
        let lines = run.rank_stdout(rank);
        let starts: Vec<&&str> = lines.iter().filter(|l| l.starts_with("start")).collect();
        assert_eq!(
            starts,
            [
                &&*format!("start rank={rank} gen=1 restart=0 muster_restart=0 max=2"),
                &&*format!("start rank={rank} gen=2 restart=1 muster_restart=1 max=2"),
                &&*format!("start rank={rank} gen=3 restart=2 muster_restart=2 max=2"),
            ],
            "{}",
            run.dump()
        );
        assert!(
            lines.contains(&&*format!("done rank={rank}")),
            "{}",
            run.dump()
        );
    }
    let restarts = run
        .stderr
        .iter()
        .filter(|l| l.contains("joining again"))
        .count();
    assert_eq!(restarts, 2, "{}", run.dump());
    assert!(
        run.stderr
            .iter()
            .any(|l| l.contains("generation 3 (restart 2) running 2 workers")
                && l.contains("ms after generation 2 failed")),
        "{}",
        run.dump()
    );
}

#[test]
fn with_too_few_restarts_the_root_cause_is_printed() {
    let run = launch(2, 1, &flaky(2)).finish(SLOW);
    assert_eq!(run.code(), Some(1), "{}", run.dump());
    let gens = run
        .rank_stdout(0)
        .iter()
        .filter(|l| l.starts_with("start"))
        .count();
    assert_eq!(gens, 2, "exactly two generations ran\n{}", run.dump());
    let text = run.stderr.join("\n");
    assert!(
        text.contains("job failed: rank 1 (node 0, host 127.0.0.1) exited with status 3")
            || text.contains("failed: rank 1 (node 0, host 127.0.0.1) exited with status 3"),
        "{}",
        run.dump()
    );
    assert!(text.contains("boom on attempt 1"), "{}", run.dump());
    assert!(
        text.contains("no restarts left (1 of 1 used)"),
        "{}",
        run.dump()
    );
}

#[test]
fn max_restarts_zero_fails_at_once_with_the_root_cause() {
    let run = launch(2, 0, &flaky(1)).finish(SLOW);
    assert_eq!(run.code(), Some(1), "{}", run.dump());
    let text = run.stderr.join("\n");
    assert!(
        text.contains("rank 1 (node 0, host 127.0.0.1) exited with status 3"),
        "{}",
        run.dump()
    );
    assert!(
        !text.contains("joining again"),
        "no restart with --max-restarts 0\n{}",
        run.dump()
    );
}

#[test]
fn a_failure_on_one_node_restarts_every_node() {
    let c = Coordinator::start(&[]);
    let node = |rank: &str| {
        Agent::start(&[
            "launch",
            "--coordinator",
            &c.addr,
            "--job-id",
            "two-nodes",
            "--nnodes",
            "2",
            "--node-rank",
            rank,
            "--nproc-per-node",
            "2",
            "--max-restarts",
            "1",
            "--grace-period-ms",
            "2000",
            "--",
            "sh",
            "-c",
            // Global rank 3 (node 1, local rank 1) fails on the first attempt only.
            "echo start rank=$RANK gen=$MUSTER_GENERATION restart=$TORCHELASTIC_RESTART_COUNT; \
             if [ \"$RANK\" = 3 ] && [ \"$TORCHELASTIC_RESTART_COUNT\" = 0 ]; then sleep 0.3; exit 5; fi; \
             if [ \"$TORCHELASTIC_RESTART_COUNT\" = 0 ]; then exec sleep 30; fi; echo done",
        ])
    };
    let a = node("0");
    let b = node("1");
    let (ra, rb) = (a.finish(SLOW), b.finish(SLOW));
    assert_eq!(ra.code(), Some(0), "{}", ra.dump());
    assert_eq!(rb.code(), Some(0), "{}", rb.dump());
    // Node 0 restarted because of node 1's failure, which it names.
    assert!(
        ra.stderr
            .iter()
            .any(|l| l.contains("rank 3 (node 1") && l.contains("exited with status 5")),
        "{}",
        ra.dump()
    );
    for (run, ranks) in [(&ra, [0, 1]), (&rb, [2, 3])] {
        for rank in ranks {
            let starts: Vec<String> = run
                .rank_stdout(rank)
                .iter()
                .filter(|l| l.starts_with("start"))
                .map(|l| (*l).to_owned())
                .collect();
            assert_eq!(
                starts,
                [
                    format!("start rank={rank} gen=1 restart=0"),
                    format!("start rank={rank} gen=2 restart=1")
                ],
                "{}",
                run.dump()
            );
        }
    }
}

#[test]
fn a_cancelled_job_stops_on_every_node() {
    let c = Coordinator::start(&[]);
    let agent = Agent::start(&[
        "launch",
        "--coordinator",
        &c.addr,
        "--job-id",
        "to-cancel",
        "--nproc-per-node",
        "2",
        "--max-restarts",
        "3",
        "--grace-period-ms",
        "1000",
        "--",
        "sh",
        "-c",
        "echo ready; exec sleep 30",
    ]);
    agent.wait_for_lines(muster_tests::Stream::Stdout, 2, SLOW, |l| {
        l.contains("ready")
    });
    let cancel = std::process::Command::new(muster_tests::agent_bin())
        .args(["cancel", "--coordinator", &c.addr, "to-cancel"])
        .output()
        .expect("muster-agent cancel runs");
    assert!(cancel.status.success(), "{cancel:?}");
    let run = agent.finish(Duration::from_secs(10));
    // Cancelled, not failed: exit 3 (tests/tests/cancel.rs).
    assert_eq!(run.code(), Some(3), "{}", run.dump());
    assert!(
        run.stderr
            .iter()
            .any(|l| l.contains("cancelled by an operator: no reason given")),
        "{}",
        run.dump()
    );
    assert!(
        !run.stderr.iter().any(|l| l.contains("joining again")),
        "a cancel is not restarted\n{}",
        run.dump()
    );
}

#[test]
fn a_node_that_cannot_hear_the_coordinator_stops_its_workers_after_its_lease() {
    let c = Coordinator::start(&[]);
    let agent = Agent::start(&[
        "launch",
        "--coordinator",
        &c.addr,
        "--job-id",
        "lease",
        "--nproc-per-node",
        "2",
        "--lease-ms",
        "1500",
        "--grace-period-ms",
        "500",
        "--",
        "sh",
        "-c",
        "echo ready; exec sleep 60",
    ]);
    agent.wait_for_lines(muster_tests::Stream::Stdout, 2, SLOW, |l| {
        l.contains("ready")
    });
    // The coordinator freezes: connections stay open but nothing answers.
    let pid = nix::unistd::Pid::from_raw(c.pid() as i32);
    nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGSTOP).expect("stop the coordinator");
    let t = std::time::Instant::now();
    let run = agent.finish(Duration::from_secs(15));
    let _ = nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGCONT);
    assert_eq!(run.code(), Some(1), "{}", run.dump());
    assert!(
        t.elapsed() >= Duration::from_millis(1000) && t.elapsed() < Duration::from_secs(5),
        "{:?}\n{}",
        t.elapsed(),
        run.dump()
    );
    assert!(
        run.stderr
            .iter()
            .any(|l| l.contains("lost the coordinator") && l.contains("lease")),
        "{}",
        run.dump()
    );
}

#[test]
fn a_silent_node_fails_the_generation_for_the_others() {
    let c = Coordinator::start(&["--heartbeat-timeout-ms", "1000"]);
    let node = |rank: &str| {
        Agent::start(&[
            "launch",
            "--coordinator",
            &c.addr,
            "--job-id",
            "silent",
            "--nnodes",
            "2",
            "--node-rank",
            rank,
            "--nproc-per-node",
            "1",
            "--grace-period-ms",
            "500",
            "--",
            "sh",
            "-c",
            "echo ready; exec sleep 60",
        ])
    };
    let a = node("0");
    let b = node("1");
    for agent in [&a, &b] {
        agent.wait_for_lines(muster_tests::Stream::Stdout, 1, SLOW, |l| {
            l.contains("ready")
        });
    }
    b.signal(nix::sys::signal::Signal::SIGSTOP);
    let t = std::time::Instant::now();
    let run = a.finish(Duration::from_secs(15));
    b.signal(nix::sys::signal::Signal::SIGCONT);
    assert_eq!(run.code(), Some(1), "{}", run.dump());
    assert!(t.elapsed() < Duration::from_secs(5), "{:?}", t.elapsed());
    assert!(
        run.stderr
            .iter()
            .any(|l| l.contains("node 1") && l.contains("no heartbeat from its agent")),
        "{}",
        run.dump()
    );
}

#[test]
fn a_workers_error_file_is_the_root_cause_and_reaches_the_agents_own_error_file() {
    let dir = std::env::temp_dir().join(format!("muster-errfile-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temp dir");
    let agent_file = dir.join("agent-error.json");
    let _ = std::fs::remove_file(&agent_file);
    // What PyTorch's @record writes for an uncaught exception.
    let script = r#"if [ "$RANK" = 1 ]; then
  printf '%s' '{"message": {"message": "ValueError: learning rate must be positive", "extraInfo": {"py_callstack": "Traceback (most recent call last):\n  File \"train.py\", line 7, in <module>\nValueError: learning rate must be positive", "timestamp": "1700000000"}}}' > "$TORCHELASTIC_ERROR_FILE"
  exit 1
fi
exec sleep 30"#;
    let run = Agent::start_with_env(
        &["launch", "--nproc-per-node", "2", "--", "sh", "-c", script],
        &[(
            "TORCHELASTIC_ERROR_FILE",
            agent_file.to_str().expect("utf-8 path"),
        )],
    )
    .finish(SLOW);
    assert_eq!(run.code(), Some(1), "{}", run.dump());
    let text = run.stderr.join("\n");
    assert!(
        text.contains("muster-agent: error: ValueError: learning rate must be positive"),
        "{}",
        run.dump()
    );
    assert!(text.contains("File \"train.py\", line 7"), "{}", run.dump());
    let copied = std::fs::read_to_string(&agent_file).expect("the agent wrote its error file");
    let json: serde_json::Value = serde_json::from_str(&copied).expect("JSON");
    assert_eq!(
        json["message"]["message"],
        "ValueError: learning rate must be positive"
    );
    let _ = std::fs::remove_dir_all(&dir);
}
