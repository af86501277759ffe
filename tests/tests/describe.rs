//! `muster-agent describe`, end to end: a real coordinator process (one with TLS and the
//! cluster token, one plain), two real `muster-agent launch` processes of one job, and a job
//! that hangs because rank 1 never reaches the barrier that rank 0 waits at (rank 1 sleeps
//! instead of starting its worker). `describe` must name the barrier, the missing rank, its
//! node and what it is doing; `--watch` must redraw until the job is over; a wrong job, an
//! unreachable coordinator and a missing token are one-line errors.
#![allow(clippy::unwrap_used, missing_docs)]

use muster_proto::v1 as pb;
use muster_tests::coordinator::Coordinator;
use muster_tests::pki::Pki;
use muster_tests::{Agent, Finished, SLOW, Stream, agent_bin, example_bin};
use pb::ops_client::OpsClient;
use std::process::Command;
use std::time::{Duration, Instant};

/// What `--watch` prints before each frame (as `watch(1)`).
const CLEAR: &str = "\x1b[H\x1b[2J";

/// The worker: rank 1 says so and sleeps (the hang), every other rank runs one
/// `wait_for_everyone` (the SDK's `barrier_loop`), which waits for rank 1 forever.
fn stuck_script() -> Option<String> {
    stuck_script_with("echo stuck; exec sleep 300")
}

/// As [`stuck_script`], with `rank1` (shell) as rank 1's hang.
fn stuck_script_with(rank1: &str) -> Option<String> {
    let Some(bin) = example_bin("barrier_loop") else {
        eprintln!("skipped: worker-sdk/examples/barrier_loop.rs is missing");
        return None;
    };
    Some(format!(
        "if [ \"$RANK\" = 1 ]; then {rank1}; fi; exec {} --iters 1 --warmup 0",
        bin.display()
    ))
}

/// One node of a two-node job running `script`, with `flags` (security) added.
fn node(addr: &str, job: &str, flags: &[String], script: &str) -> Agent {
    let mut args: Vec<&str> = vec![
        "launch",
        "--coordinator",
        addr,
        "--job-id",
        job,
        "--nnodes",
        "2",
        "--nproc-per-node",
        "1",
        "--advertise-addr",
        "127.0.0.1",
        "--grace-period-ms",
        "500",
    ];
    args.extend(flags.iter().map(String::as_str));
    args.extend(["--", "sh", "-c", script]);
    Agent::start(&args)
}

/// `muster-agent describe <args>`, run to its end.
fn describe(args: &[&str]) -> Finished {
    let mut all = vec!["describe"];
    all.extend_from_slice(args);
    let mut cmd = Command::new(agent_bin());
    cmd.args(&all);
    Agent::spawn(cmd, format!("muster-agent {all:?}")).finish(SLOW)
}

/// Runs `describe` until its view shows a pending barrier, and returns that view.
fn describe_until_waiting(args: &[&str]) -> String {
    let deadline = Instant::now() + SLOW;
    loop {
        let run = describe(args);
        assert_eq!(run.code(), Some(0), "{}", run.dump());
        let text = run.stdout.join("\n");
        if text.contains("\nWAITING ") {
            return text;
        }
        assert!(
            Instant::now() < deadline,
            "no pending barrier within {SLOW:?}; last view:\n{text}"
        );
        std::thread::sleep(Duration::from_millis(200));
    }
}

/// How the node id of the agent whose worker is rank 1 ends (launch's default id is the host
/// name and the agent's pid), once that worker has said it is stuck.
fn node_id_of_rank_1(agents: &[Agent]) -> String {
    let deadline = Instant::now() + SLOW;
    loop {
        if let Some(a) = agents
            .iter()
            .find(|a| a.output().contains("[rank 1] stuck"))
        {
            return format!("-{}", a.pid());
        }
        assert!(Instant::now() < deadline, "rank 1 never started");
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Through TLS and the cluster token: `describe` names the pending barrier (global #1, one of
/// two arrived: rank 0), the missing rank 1, its node (node 1 and its agent's id), its host
/// and what it is doing (no session: it never connected); the tables list both nodes and
/// ranks. Without the token, and for a job that does not exist, one line and exit 1.
#[test]
fn describe_names_the_missing_rank_its_node_and_what_it_does() {
    let Some(script) = stuck_script() else {
        return;
    };
    let dir = std::env::temp_dir().join(format!("muster-describe-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let pki = Pki::generate(&dir, &[]);
    let ca = pki.ca.to_str().unwrap().to_owned();
    let token = pki.token_file.to_str().unwrap().to_owned();
    let coordinator = Coordinator::start(&[
        "--tls-cert",
        pki.server_cert.to_str().unwrap(),
        "--tls-key",
        pki.server_key.to_str().unwrap(),
        "--auth-token-file",
        &token,
    ]);
    let addr = coordinator.addr.clone();
    let security = vec![
        "--tls-ca".to_owned(),
        ca.clone(),
        "--auth-token-file".to_owned(),
        token.clone(),
    ];
    let job = "hang-tls";
    let agents: Vec<Agent> = (0..2)
        .map(|_| node(&addr, job, &security, &script))
        .collect();
    let node_id = node_id_of_rank_1(&agents);

    let flags = [
        "--coordinator",
        &addr,
        "--tls-ca",
        &ca,
        "--auth-token-file",
        &token,
    ];
    let mut args = flags.to_vec();
    args.push(job);
    let view = describe_until_waiting(&args);
    eprintln!("the view:\n{view}");
    let lines: Vec<&str> = view.lines().collect();
    assert_eq!(
        lines[0],
        format!("job {job}: running, generation 1, 2 nodes, 2 ranks, restarts 0/0"),
        "{view}"
    );
    let waiting = lines.iter().find(|l| l.starts_with("WAITING ")).unwrap();
    assert!(
        waiting.starts_with("WAITING global barrier #1 '")
            && waiting.ends_with(": 1 of 2 arrived (ranks 0), 1 missing"),
        "{view}"
    );
    let missing = lines
        .iter()
        .find(|l| l.starts_with("  missing rank 1 on node 1 ("))
        .unwrap_or_else(|| panic!("no line for rank 1:\n{view}"));
    assert!(
        missing.contains(&format!(
            "{node_id}), host 127.0.0.1, no pid yet: no session yet"
        )),
        "{view}"
    );
    // The node table: node 1 is the stuck rank's agent; the rank table: rank 0 waits with its pid.
    assert!(
        lines
            .iter()
            .any(|l| l.starts_with("  1 ") && l.contains("running") && l.ends_with(&node_id)),
        "{view}"
    );
    assert!(
        lines.iter().any(|l| l.starts_with("  0     0     0      ")
            && l.contains(" waiting ")
            && l.contains("waiting at global barrier #1")),
        "{view}"
    );

    // Without the token: refused, in one line.
    let run = describe(&["--coordinator", &addr, "--tls-ca", &ca, job]);
    assert_eq!(run.code(), Some(1), "{}", run.dump());
    assert_eq!(run.stderr.len(), 1, "{}", run.dump());
    assert!(run.stderr[0].contains("UNAUTHENTICATED"), "{}", run.dump());
    assert!(run.stdout.is_empty(), "{}", run.dump());

    // A job that does not exist.
    let mut args = flags.to_vec();
    args.push("no-such-job");
    let run = describe(&args);
    assert_eq!(run.code(), Some(1), "{}", run.dump());
    assert_eq!(
        run.stderr,
        [format!(
            "muster-agent: job 'no-such-job' is not known to the coordinator at {addr}: job 'no-such-job' not found (no node has joined it)"
        )],
        "{}",
        run.dump()
    );
    drop(agents);
    drop(coordinator);
    let _ = std::fs::remove_dir_all(&dir);
}

/// `--watch` redraws the view (each frame after a clear-screen, as `watch(1)`) while the job
/// hangs, and exits once the job is over (1: it did not finish), or at Ctrl-C (0). `--json`
/// prints rank 0 and node rank 0: the DescribeJob reply carries rank 0 and node rank 0 as present fields (proto3 `optional`), so that JSON views
/// that drop zero scalars (grpcurl) still show them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn watch_redraws_until_the_job_is_over() {
    let Some(script) = stuck_script() else {
        return;
    };
    let c = Coordinator::start(&[]);
    let job = "hang-watch";
    let agents: Vec<Agent> = (0..2).map(|_| node(&c.addr, job, &[], &script)).collect();
    node_id_of_rank_1(&agents);
    let mut cmd = Command::new(agent_bin());
    cmd.args(["describe", "--coordinator", &c.addr, job, "--watch", "0.2"]);
    let watch = Agent::spawn(cmd, "muster-agent describe --watch");
    // Two frames that both show the hang.
    watch.wait_for_lines(Stream::Stdout, 2, SLOW, |l| {
        l.starts_with(&format!("{CLEAR}Every 0.2s: muster-agent describe {job}"))
    });
    watch.wait_for_lines(Stream::Stdout, 2, SLOW, |l| {
        l.starts_with("  missing rank 1 on node 1 ")
    });

    let mut ops = OpsClient::connect(format!("http://{}", c.addr))
        .await
        .unwrap();
    let d = ops
        .describe_job(pb::DescribeJobRequest {
            job_id: job.into(),
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    // Decoded as Some(0) only if the coordinator put rank 0 on the wire: field presence.
    let r0 = d.ranks.iter().find(|r| r.rank == Some(0)).unwrap();
    assert_eq!(
        (r0.local_rank, r0.state),
        (Some(0), pb::RankState::Waiting as i32)
    );
    assert!(d.nodes.iter().any(|n| n.node_rank == Some(0)), "{d:?}");
    let b = &d.barriers[0];
    assert_eq!(b.node_rank, None, "a global barrier names no node: {b:?}");
    assert_eq!(b.missing_detail[0].rank, Some(1));

    // `--json`: the same reply as grpcurl's JSON, rank 0 and node 0 included.
    let run = describe(&["--coordinator", &c.addr, job, "--json"]);
    assert_eq!(
        (run.code(), run.stdout.len()),
        (Some(0), 1),
        "{}",
        run.dump()
    );
    let v: serde_json::Value = serde_json::from_str(&run.stdout[0]).unwrap();
    let r0 = v["ranks"]
        .as_array()
        .unwrap()
        .iter()
        .find(|r| r["rank"] == 0)
        .unwrap_or_else(|| panic!("no rank 0 in {v}"));
    assert_eq!(r0["nodeRank"], 0, "{v}");
    assert_eq!(v["barriers"][0]["missingDetail"][0]["rank"], 1, "{v}");

    // Ctrl-C ends a watch cleanly (0), the job untouched.
    let mut cmd = Command::new(agent_bin());
    cmd.args(["describe", "--coordinator", &c.addr, job, "--watch"]);
    let interrupted = Agent::spawn(cmd, "muster-agent describe --watch (Ctrl-C)");
    interrupted.wait_for_lines(Stream::Stdout, 1, SLOW, |l| l.starts_with(CLEAR));
    interrupted.signal(nix::sys::signal::Signal::SIGINT);
    let run = interrupted.finish(SLOW);
    assert_eq!(run.code(), Some(0), "{}", run.dump());

    ops.cancel_job(pb::CancelJobRequest {
        job_id: job.into(),
        reason: "describe test over".into(),
    })
    .await
    .unwrap();
    let run = watch.finish(SLOW);
    assert_eq!(run.code(), Some(1), "{}", run.dump());
    let frames = run.stdout.iter().filter(|l| l.starts_with(CLEAR)).count();
    assert!(frames >= 2, "{}", run.dump());
    // The last frame is the job's end.
    let last = run
        .stdout
        .iter()
        .rposition(|l| l.starts_with(CLEAR))
        .unwrap();
    assert!(run.stdout[last + 2].contains("(over)"), "{}", run.dump());
    drop(agents);
}

/// The usual hang: rank 1 connected (a muster Python worker with its session open) but is
/// busy elsewhere and never calls `wait_for_everyone`. `describe` shows it running, with the
/// pid of the Python process, on node 1. Skipped with a printed reason without the peers'
/// venv and its `muster` package.
#[test]
fn a_connected_rank_that_never_arrives_shows_its_pid() {
    let Some(python) = muster_tests::peers::peers_python(&["muster"]) else {
        return;
    };
    let hang = format!(
        "exec {} -c 'import muster, os, time; a = muster.Accelerator(); print(\"stuck pid=%d\" % os.getpid(), flush=True); time.sleep(300)'",
        python.display()
    );
    let Some(script) = stuck_script_with(&hang) else {
        return;
    };
    let c = Coordinator::start(&[]);
    let job = "hang-busy";
    let agents: Vec<Agent> = (0..2).map(|_| node(&c.addr, job, &[], &script)).collect();
    node_id_of_rank_1(&agents);
    let pid = agents
        .iter()
        .find_map(|a| {
            let out = a.output();
            let at = out.find("[rank 1] stuck pid=")?;
            let rest = &out[at + "[rank 1] stuck pid=".len()..];
            Some(rest.lines().next()?.trim().to_owned())
        })
        .unwrap();
    let view = describe_until_waiting(&["--coordinator", &c.addr, job]);
    assert!(
        view.lines()
            .any(|l| l.starts_with("  missing rank 1 on node 1 (")
                && l.contains(&format!(
                    ", host 127.0.0.1, pid {pid}: running outside barriers ("
                ))),
        "{view}"
    );
    drop(agents);
}

/// A job that failed for good: the view says so on its first line, and names the failure
/// (rank, node, host, the worker's exit code) below the tables.
#[test]
fn a_failed_job_shows_its_failure() {
    let Some(bin) = example_bin("fail_at") else {
        eprintln!("skipped: worker-sdk/examples/fail_at.rs is missing");
        return;
    };
    let script = format!("exec {} --rank 1 --code 3", bin.display());
    let c = Coordinator::start(&[]);
    let job = "failed-once";
    let agents: Vec<Agent> = (0..2).map(|_| node(&c.addr, job, &[], &script)).collect();
    for a in agents {
        let run = a.finish(SLOW);
        assert_eq!(run.code(), Some(1), "{}", run.dump());
    }
    let run = describe(&["--coordinator", &c.addr, job]);
    assert_eq!(run.code(), Some(0), "{}", run.dump());
    let view = run.stdout.join("\n");
    eprintln!("the view:\n{view}");
    assert!(
        run.stdout[0].starts_with(&format!("job {job}: failed (over), generation 1, 2 nodes")),
        "{view}"
    );
    assert!(
        run.stdout
            .iter()
            .any(|l| l
                == "FAILED generation 1: rank 1 (node 1, host 127.0.0.1) exited with status 3"),
        "{view}"
    );
}

/// Bad input changes nothing and says what is wrong in one line: an unreachable coordinator
/// (exit 1), a `--watch` that is not a number of seconds (exit 2, before connecting).
#[test]
fn describe_errors_are_one_line() {
    let port = muster_tests::free_port();
    let addr = format!("127.0.0.1:{port}");
    let started = Instant::now();
    let run = describe(&["--coordinator", &addr, "some-job"]);
    assert_eq!(run.code(), Some(1), "{}", run.dump());
    assert_eq!(run.stderr.len(), 1, "{}", run.dump());
    assert!(
        run.stderr[0].starts_with("muster-agent: "),
        "{}",
        run.dump()
    );
    assert!(run.stderr[0].contains(&addr), "{}", run.dump());
    assert!(started.elapsed() < SLOW, "{}", run.dump());

    let run = describe(&["--coordinator", &addr, "--watch=soon", "some-job"]);
    assert_eq!(run.code(), Some(2), "{}", run.dump());
    assert_eq!(run.stderr.len(), 1, "{}", run.dump());
    assert!(
        run.stderr[0].contains("'soon' is not a number of seconds"),
        "{}",
        run.dump()
    );
}

/// A local job (the agent's embedded coordinator, on a port picked at random) prints the
/// `describe` command for itself when it starts; run as printed, it finds the missing rank.
#[test]
fn a_local_job_prints_the_describe_line_that_finds_its_hang() {
    let Some(script) = stuck_script() else {
        return;
    };
    let job = "local-hang";
    let agent = Agent::start(&[
        "launch",
        "--job-id",
        job,
        "--nproc-per-node",
        "2",
        "--grace-period-ms",
        "500",
        "--",
        "sh",
        "-c",
        &script,
    ]);
    let deadline = Instant::now() + SLOW;
    let command = loop {
        let found = agent.lines(Stream::Stderr).into_iter().find_map(|l| {
            let at = l.find("`muster-agent describe ")?;
            let rest = &l[at + 1..];
            Some(rest[..rest.find('`')?].to_owned())
        });
        if let Some(c) = found {
            break c;
        }
        assert!(
            Instant::now() < deadline,
            "no describe line\n{}",
            agent.output()
        );
        std::thread::sleep(Duration::from_millis(50));
    };
    let words: Vec<&str> = command.split_whitespace().collect();
    assert_eq!(
        words[..3],
        ["muster-agent", "describe", "--coordinator"],
        "{command}"
    );
    assert!(words[3].starts_with("127.0.0.1:"), "{command}");
    assert_eq!(words[4..], [job], "{command}");
    let view = describe_until_waiting(&words[2..]);
    assert!(
        view.lines()
            .any(|l| l.starts_with("  missing rank 1 on node 0 (")),
        "{view}"
    );
    drop(agent);
}
