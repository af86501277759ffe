//! End-to-end tests of `muster-agent launch` with plain shell workers: ranks and environment,
//! output forwarding, failure handling, signals and bad input. See the crate docs for where the
//! binaries come from.

use muster_tests::{Agent, SLOW, Stream, group_alive};
use nix::sys::signal::Signal;
use std::collections::BTreeMap;
use std::time::Duration;

/// `muster-agent launch --nproc-per-node N <flags> -- sh -c SCRIPT`.
fn launch(n: u32, flags: &[&str], script: &str) -> Agent {
    let n = n.to_string();
    let mut args = vec!["launch", "--nproc-per-node", &n];
    args.extend_from_slice(flags);
    args.extend_from_slice(&["--", "sh", "-c", script]);
    Agent::start(&args)
}

/// The pids (= process groups) of workers that print `ready <pid>`.
fn ready_pids(agent: &Agent, n: usize) -> Vec<i32> {
    agent
        .wait_for_lines(Stream::Stdout, n, SLOW, |l| l.contains("] ready "))
        .iter()
        .map(|l| {
            l.rsplit(' ')
                .next()
                .and_then(|p| p.parse().ok())
                .unwrap_or_else(|| panic!("no pid in {l:?}"))
        })
        .collect()
}

#[test]
fn four_workers_get_their_ranks_and_prefixed_output() {
    let agent = launch(
        4,
        &[],
        "echo hello from $RANK of $WORLD_SIZE; echo complaint from $RANK >&2",
    );
    let run = agent.finish(SLOW);
    assert_eq!(run.code(), Some(0), "{}", run.dump());
    for rank in 0..4 {
        assert_eq!(
            run.rank_stdout(rank),
            [format!("hello from {rank} of 4")],
            "{}",
            run.dump()
        );
        let line = format!("[rank {rank}] complaint from {rank}");
        assert!(
            run.stderr.contains(&line),
            "{line:?} missing\n{}",
            run.dump()
        );
    }
    assert_eq!(run.stdout.len(), 4, "{}", run.dump());
    assert!(
        run.stderr.iter().any(|l| l.contains("4 workers exited 0")),
        "{}",
        run.dump()
    );
}

#[test]
fn workers_get_the_contract_environment() {
    let agent = launch(
        3,
        &["--job-id", "env-check"],
        "env | grep -E '^(MUSTER_|RANK=|LOCAL_RANK=|WORLD_SIZE=|LOCAL_WORLD_SIZE=|GROUP_|ROLE_|MASTER_|TORCHELASTIC_|TORCH_NCCL_ASYNC_ERROR_HANDLING=|OMP_NUM_THREADS=)'",
    );
    let run = agent.finish(SLOW);
    assert_eq!(run.code(), Some(0), "{}", run.dump());
    let mut master_ports = Vec::new();
    let mut agents = Vec::new();
    for rank in 0..3u32 {
        let env: BTreeMap<&str, &str> = run
            .rank_stdout(rank)
            .into_iter()
            .filter_map(|l| l.split_once('='))
            .collect();
        let r = rank.to_string();
        for (name, expected) in [
            ("RANK", r.as_str()),
            ("LOCAL_RANK", &r),
            ("WORLD_SIZE", "3"),
            ("LOCAL_WORLD_SIZE", "3"),
            ("GROUP_RANK", "0"),
            ("GROUP_WORLD_SIZE", "1"),
            ("ROLE_RANK", &r),
            ("ROLE_NAME", "default"),
            ("ROLE_WORLD_SIZE", "3"),
            ("MASTER_ADDR", "127.0.0.1"),
            ("TORCHELASTIC_RESTART_COUNT", "0"),
            ("TORCHELASTIC_MAX_RESTARTS", "0"),
            ("TORCHELASTIC_RUN_ID", "env-check"),
            ("TORCHELASTIC_USE_AGENT_STORE", "True"),
            ("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1"),
            ("OMP_NUM_THREADS", "1"),
            ("MUSTER_JOB_ID", "env-check"),
            ("MUSTER_GENERATION", "1"),
            ("MUSTER_RANK", &r),
            ("MUSTER_LOCAL_RANK", &r),
            ("MUSTER_WORLD_SIZE", "3"),
            ("MUSTER_LOCAL_WORLD_SIZE", "3"),
            ("MUSTER_NODE_RANK", "0"),
            ("MUSTER_NUM_NODES", "1"),
            ("MUSTER_RESTART_COUNT", "0"),
            ("MUSTER_HOST", "127.0.0.1"),
        ] {
            assert_eq!(
                env.get(name).copied(),
                Some(expected),
                "rank {rank} {name}\n{}",
                run.dump()
            );
        }
        let port: u16 = env
            .get("MASTER_PORT")
            .and_then(|p| p.parse().ok())
            .unwrap_or_else(|| panic!("rank {rank} has no numeric MASTER_PORT\n{}", run.dump()));
        assert_ne!(port, 0);
        master_ports.push(port);
        // A worker reaches the coordinator only through its agent: it gets the agent's
        // socket, not the coordinator's address.
        assert_eq!(
            env.get("MUSTER_COORDINATOR"),
            None,
            "rank {rank}\n{}",
            run.dump()
        );
        let socket = env.get("MUSTER_AGENT_SOCKET").copied().unwrap_or_default();
        assert!(
            socket.starts_with('/') && socket.ends_with("/relay.sock"),
            "rank {rank} MUSTER_AGENT_SOCKET={socket:?}"
        );
        agents.push(socket.to_owned());
    }
    master_ports.dedup();
    agents.dedup();
    assert_eq!(
        master_ports.len(),
        1,
        "every worker gets the same MASTER_PORT"
    );
    assert_eq!(agents.len(), 1, "every worker gets the same agent");
}

#[test]
fn inherited_omp_num_threads_is_kept() {
    let agent = Agent::start_with_env(
        &[
            "launch",
            "--nproc-per-node",
            "1",
            "--",
            "sh",
            "-c",
            "echo omp=$OMP_NUM_THREADS nccl=$TORCH_NCCL_ASYNC_ERROR_HANDLING",
        ],
        &[
            ("OMP_NUM_THREADS", "7"),
            ("TORCH_NCCL_ASYNC_ERROR_HANDLING", "0"),
        ],
    );
    let run = agent.finish(SLOW);
    assert_eq!(run.code(), Some(0), "{}", run.dump());
    assert_eq!(run.rank_stdout(0), ["omp=7 nccl=0"], "{}", run.dump());
}

#[test]
fn interleaved_output_stays_in_whole_lines() {
    const LINES: usize = 20_000;
    let agent = launch(
        4,
        &[],
        &format!("seq 1 {LINES} | sed \"s/^/rank-$RANK-line-/\"; printf 'no newline at the end'"),
    );
    let run = agent.finish(SLOW);
    assert_eq!(run.code(), Some(0), "{}", run.dump());
    for rank in 0..4 {
        let lines = run.rank_stdout(rank);
        assert_eq!(lines.len(), LINES + 1, "rank {rank}");
        for (i, line) in lines.iter().take(LINES).enumerate() {
            assert_eq!(*line, format!("rank-{rank}-line-{}", i + 1));
        }
        assert_eq!(lines[LINES], "no newline at the end");
    }
    let strays: Vec<&String> = run
        .stdout
        .iter()
        .filter(|l| !l.starts_with("[rank "))
        .collect();
    assert!(strays.is_empty(), "lines without a prefix: {strays:?}");
}

#[test]
fn a_failing_worker_stops_the_others_and_fails_the_job() {
    let agent = launch(
        4,
        &["--job-id", "fails"],
        "if [ \"$RANK\" = 1 ]; then echo first words >&2; echo last words >&2; exit 3; fi; echo ready $$; exec sleep 60",
    );
    let run = agent.finish(SLOW);
    assert_eq!(run.code(), Some(1), "{}", run.dump());
    assert!(
        run.elapsed < Duration::from_secs(20),
        "the sleeping workers were not stopped promptly: {:?}",
        run.elapsed
    );
    let summary =
        "muster-agent: job fails failed: rank 1 (node 0, host 127.0.0.1) exited with status 3";
    let at = run
        .stderr
        .iter()
        .position(|l| l == summary)
        .unwrap_or_else(|| panic!("no summary line\n{}", run.dump()));
    assert_eq!(
        run.stderr[at + 1..],
        [
            "muster-agent: last stderr lines of rank 1:",
            "    first words",
            "    last words"
        ],
        "{}",
        run.dump()
    );
    for line in &run.stdout {
        if let Some(pid) = line
            .strip_prefix("[rank ")
            .and_then(|l| l.split("] ready ").nth(1))
        {
            let pid: i32 = pid.parse().unwrap_or_default();
            assert!(!group_alive(pid), "worker group {pid} survived the agent");
        }
    }
}

#[test]
fn a_worker_killed_by_a_signal_is_reported_with_the_signal() {
    let run = launch(
        2,
        &["--job-id", "sig"],
        "if [ \"$RANK\" = 0 ]; then kill -KILL $$; fi; exec sleep 60",
    )
    .finish(SLOW);
    assert_eq!(run.code(), Some(1), "{}", run.dump());
    let summary = "muster-agent: job sig failed: rank 0 (node 0, host 127.0.0.1) killed by signal 9 (SIGKILL)";
    assert!(run.stderr.iter().any(|l| l == summary), "{}", run.dump());
}

#[test]
fn sigterm_to_the_agent_stops_the_workers_and_exits_143() {
    let agent = launch(4, &[], "echo ready $$; exec sleep 60");
    let pids = ready_pids(&agent, 4);
    agent.signal(Signal::SIGTERM);
    let run = agent.finish(SLOW);
    assert_eq!(run.code(), Some(143), "{}", run.dump());
    assert!(run.elapsed < Duration::from_secs(20), "{}", run.dump());
    for pid in pids {
        assert!(!group_alive(pid), "worker group {pid} survived the agent");
    }
}

#[test]
fn sigint_to_the_agent_exits_130() {
    let agent = launch(2, &[], "echo ready $$; exec sleep 60");
    let pids = ready_pids(&agent, 2);
    agent.signal(Signal::SIGINT);
    let run = agent.finish(SLOW);
    assert_eq!(run.code(), Some(130), "{}", run.dump());
    for pid in pids {
        assert!(!group_alive(pid), "worker group {pid} survived the agent");
    }
}

#[test]
fn a_worker_ignoring_sigterm_is_killed_after_the_grace_period() {
    let grace = Duration::from_millis(800);
    let agent = launch(
        2,
        &["--grace-period-ms", "800"],
        "trap '' TERM; echo ready $$; sleep 60; echo survived",
    );
    let pids = ready_pids(&agent, 2);
    let signalled = std::time::Instant::now();
    agent.signal(Signal::SIGTERM);
    let run = agent.finish(SLOW);
    let stop_time = signalled.elapsed();
    assert_eq!(run.code(), Some(143), "{}", run.dump());
    assert!(
        stop_time >= grace,
        "SIGKILL came before the grace period: {stop_time:?}"
    );
    assert!(
        stop_time < grace + Duration::from_secs(10),
        "{stop_time:?}\n{}",
        run.dump()
    );
    assert!(
        run.stderr
            .iter()
            .any(|l| l.contains("still running 800 ms after SIGTERM; sending SIGKILL")),
        "{}",
        run.dump()
    );
    assert!(
        !run.stdout.iter().any(|l| l.contains("survived")),
        "{}",
        run.dump()
    );
    for pid in pids {
        assert!(!group_alive(pid), "worker group {pid} survived the agent");
    }
}

#[test]
fn bad_input_exits_2_with_one_line_and_spawns_nothing() {
    let dir = std::env::temp_dir().join(format!("muster-bad-input-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temp dir");
    let marker = dir.join("spawned");
    let touch = format!("touch {}", marker.display());
    let cases: &[(&[&str], &str)] = &[
        (
            &["--nproc-per-node", "0", "--", "sh", "-c", &touch],
            "--nproc-per-node 0 is out of range",
        ),
        (&["--nproc-per-node", "2", "--"], "no program to launch"),
        (&["--nproc-per-node", "2"], "no program to launch"),
        (
            &["--nproc-per-node", "2", "--", "no-such-program-for-muster"],
            "was not found in PATH",
        ),
        (
            &["--nproc-per-node", "2", "--", "/etc/passwd"],
            "is not executable",
        ),
        (
            &[
                "--nproc-per-node",
                "2",
                "--nnodes",
                "2:1",
                "--",
                "sh",
                "-c",
                &touch,
            ],
            "--nnodes '2:1' is malformed",
        ),
        (
            &[
                "--nproc-per-node",
                "2",
                "--nnodes",
                "x",
                "--",
                "sh",
                "-c",
                &touch,
            ],
            "--nnodes 'x' is malformed",
        ),
        (
            &[
                "--nproc-per-node",
                "2",
                "--node-rank",
                "1",
                "--",
                "sh",
                "-c",
                &touch,
            ],
            "--node-rank 1 is out of range",
        ),
        (
            &["--nproc-per-node", "two", "--", "sh", "-c", &touch],
            "invalid value 'two'",
        ),
        (
            &[
                "--nproc-per-node",
                "2",
                "--coordinator",
                "nohost",
                "--",
                "sh",
                "-c",
                &touch,
            ],
            "--coordinator 'nohost' is malformed",
        ),
    ];
    for (args, message) in cases {
        let mut all = vec!["launch"];
        all.extend_from_slice(args);
        let run = Agent::start(&all).finish(SLOW);
        assert_eq!(run.code(), Some(2), "{all:?}\n{}", run.dump());
        assert_eq!(run.stderr.len(), 1, "{all:?}: not one line\n{}", run.dump());
        assert!(
            run.stderr[0].starts_with("muster-agent: ") && run.stderr[0].contains(message),
            "{all:?}: expected {message:?}\n{}",
            run.dump()
        );
        assert!(run.stdout.is_empty(), "{all:?}\n{}", run.dump());
        assert!(!marker.exists(), "{all:?} spawned a worker");
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// Launch overhead: 8 workers of `true`. The bound is loose (loaded CI machines); the time is
/// printed for the record.
#[test]
fn launching_eight_trivial_workers_is_fast() {
    let run = launch(8, &[], "true").finish(SLOW);
    assert_eq!(run.code(), Some(0), "{}", run.dump());
    eprintln!("muster-agent launch of 8 `true` workers: {:?}", run.elapsed);
    assert!(run.elapsed < Duration::from_secs(5), "{:?}", run.elapsed);
}

/// Issue 29: during an 8-worker job at an external coordinator (run in process), no worker
/// holds a TCP connection to the coordinator, and the agent at most 2 (its own and its
/// relay's), seen in the kernel's socket table while the workers train (registered, with
/// barriers, collectives and the key-value store behind them).
#[test]
fn eight_workers_hold_no_connection_to_the_coordinator_and_their_agent_at_most_two() {
    let Some(bin) = muster_tests::example_bin("ddp_train") else {
        eprintln!("skipped: worker-sdk/examples/ddp_train does not exist");
        return;
    };
    let runtime = tokio::runtime::Runtime::new().expect("runtime");
    let listener = runtime
        .block_on(tokio::net::TcpListener::bind("127.0.0.1:0"))
        .expect("bind");
    let port = listener.local_addr().expect("addr").port();
    let addr = format!("127.0.0.1:{port}");
    runtime.spawn(muster_coordinator::serve(
        listener,
        muster_coordinator::Config::default(),
        std::future::pending(),
    ));
    let job = format!("connections-{}", std::process::id());
    let mut agent = Agent::start_with_env(
        &[
            "launch",
            "--coordinator",
            &addr,
            "--job-id",
            &job,
            "--nproc-per-node",
            "8",
            "--",
            bin.to_str().expect("a UTF-8 target path"),
            "--epochs",
            "2",
            "--step-sleep-ms",
            "20",
            "--quiet",
        ],
        &[("MUSTER_COMM_BACKEND", "cpu")],
    );
    let agent_pid = agent.pid().as_raw() as u32;
    let mut busiest = 0;
    while !agent.exited() {
        let workers = muster_agent::procfs::children(agent_pid);
        let connections = muster_tests::sockets::connected_to(port);
        for holders in &connections {
            assert!(
                holders.iter().all(|pid| !workers.contains(pid)),
                "a worker holds a connection to the coordinator: {holders:?} (workers {workers:?})\n{}",
                agent.output()
            );
        }
        let of_agent = connections
            .iter()
            .filter(|holders| holders.contains(&agent_pid))
            .count();
        assert!(
            of_agent <= 2,
            "the agent holds {of_agent} connections to the coordinator\n{}",
            agent.output()
        );
        // The agent's children: its 8 workers (and any helper it runs).
        if workers.len() >= 8 {
            busiest = busiest.max(of_agent);
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    let run = agent.finish(SLOW);
    assert_eq!(run.code(), Some(0), "{}", run.dump());
    assert!(
        busiest >= 1,
        "the socket table was never read while 8 workers ran\n{}",
        run.dump()
    );
}

/// Two agents on this machine form one two-node job at an external coordinator (run in
/// process): dense node ranks, contiguous global ranks, and with `--no-agent-store` node 0's
/// host as MASTER_ADDR and one MASTER_PORT for both nodes.
#[test]
fn two_agents_form_one_job_at_an_external_coordinator() {
    let runtime = tokio::runtime::Runtime::new().expect("runtime");
    let listener = runtime
        .block_on(tokio::net::TcpListener::bind("127.0.0.1:0"))
        .expect("bind");
    let addr = listener.local_addr().expect("addr").to_string();
    runtime.spawn(muster_coordinator::serve(
        listener,
        muster_coordinator::Config::default(),
        std::future::pending(),
    ));
    let script = "echo rank=$RANK local=$LOCAL_RANK node=$GROUP_RANK of=$GROUP_WORLD_SIZE world=$WORLD_SIZE master=$MASTER_ADDR:$MASTER_PORT host=$MUSTER_HOST";
    // Node 0's MASTER_PORT is shared only on opt-out: with the agent store each node serves
    // its own loopback port (tests/tests/agent_store_launch.rs).
    let common = [
        "--coordinator",
        &addr,
        "--job-id",
        "two-nodes",
        "--nnodes",
        "2",
        "--no-agent-store",
    ];
    let mut second = common.to_vec();
    second.extend_from_slice(&["--node-rank", "1", "--host", "127.0.0.2"]);
    let node1 = launch(2, &second, script);
    node1.wait_for_lines(Stream::Stderr, 1, SLOW, |l| {
        l.starts_with("muster-agent: waiting for nodes: 1/2 joined (job two-nodes")
    });
    let mut first = common.to_vec();
    first.extend_from_slice(&["--host", "127.0.0.1"]);
    let node0 = launch(3, &first, script);
    let run0 = node0.finish(SLOW);
    let run1 = node1.finish(SLOW);
    assert_eq!(run0.code(), Some(0), "{}", run0.dump());
    assert_eq!(run1.code(), Some(0), "{}", run1.dump());
    let port = run0.rank_stdout(0)[0]
        .split("master=127.0.0.1:")
        .nth(1)
        .and_then(|s| s.split(' ').next())
        .unwrap_or_else(|| panic!("no MASTER_PORT\n{}", run0.dump()))
        .to_owned();
    let expect = |rank: u32, local: u32, node: u32, host: &str| {
        vec![format!(
            "rank={rank} local={local} node={node} of=2 world=5 master=127.0.0.1:{port} host={host}"
        )]
    };
    for local in 0..3 {
        assert_eq!(
            run0.rank_stdout(local),
            expect(local, local, 0, "127.0.0.1"),
            "{}",
            run0.dump()
        );
    }
    for local in 0..2 {
        assert_eq!(
            run1.rank_stdout(3 + local),
            expect(3 + local, local, 1, "127.0.0.2"),
            "{}",
            run1.dump()
        );
    }
}
