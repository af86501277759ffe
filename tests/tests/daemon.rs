//! Daemon mode end to end: real `muster-agent serve` processes register with a real
//! coordinator; `muster-agent submit` starts a job on them, `status` shows it, `cancel` stops
//! it on every node, and an agent that registers while a job runs below its most nodes joins
//! it (an elastic membership change).

use muster_tests::coordinator::Coordinator;
use muster_tests::{Agent, SLOW, Stream, agent_bin};
use std::process::{Command, Output};
use std::time::{Duration, Instant};

fn cli(args: &[&str]) -> Output {
    Command::new(agent_bin())
        .args(args)
        .output()
        .expect("muster-agent runs")
}

fn text(o: &Output) -> String {
    format!(
        "{}\n--- stdout\n{}--- stderr\n{}",
        o.status,
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

fn serve(c: &Coordinator, id: &str, labels: &str) -> Agent {
    let agent = Agent::start(&[
        "serve",
        "--coordinator",
        &c.addr,
        "--agent-id",
        id,
        "--labels",
        labels,
        "--grace-period-ms",
        "1000",
    ]);
    agent.wait_for_lines(Stream::Stderr, 1, SLOW, |l| l.contains("serving as"));
    agent
}

/// Polls `status` until its output contains `want`.
fn wait_status(c: &Coordinator, job: Option<&str>, want: &str) -> String {
    let deadline = Instant::now() + SLOW;
    loop {
        let mut args = vec!["status", "--coordinator", &c.addr];
        args.extend(job);
        let out = cli(&args);
        let s = String::from_utf8_lossy(&out.stdout).into_owned();
        if s.contains(want) {
            return s;
        }
        assert!(
            Instant::now() < deadline,
            "status never showed {want:?}:\n{s}"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

#[test]
fn submitted_job_runs_on_registered_agents_and_finishes() {
    let c = Coordinator::start(&[]);
    let a = serve(&c, "agent-a", "pool=x");
    let b = serve(&c, "agent-b", "pool=x");
    let listing = wait_status(&c, None, "agent agent-b");
    assert!(listing.contains("agent agent-a"), "{listing}");
    assert!(listing.contains("labels [pool=x]"), "{listing}");
    let out = cli(&[
        "submit",
        "--coordinator",
        &c.addr,
        "--job-id",
        "sub1",
        "--nnodes",
        "2",
        "--nproc-per-node",
        "2",
        "--selector",
        "pool=x",
        "--env",
        "GREETING=hello",
        "--wait",
        "--",
        "sh",
        "-c",
        "echo $GREETING rank=$RANK world=$WORLD_SIZE",
    ]);
    assert!(out.status.success(), "{}", text(&out));
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        stdout.contains("job sub1 submitted to agent-a, agent-b"),
        "{stdout}"
    );
    assert!(stdout.contains("job sub1: finished"), "{stdout}");
    drop((a, b));
}

#[test]
fn submit_without_enough_agents_is_refused_and_names_the_counts() {
    let c = Coordinator::start(&[]);
    let _a = serve(&c, "only", "gpu=no");
    let out = cli(&[
        "submit",
        "--coordinator",
        &c.addr,
        "--nnodes",
        "2",
        "--nproc-per-node",
        "1",
        "--",
        "true",
    ]);
    assert_eq!(out.status.code(), Some(1), "{}", text(&out));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("needs at least 2 idle agents; 1 registered, 1 match, 1 of them idle"),
        "{err}"
    );
}

#[test]
fn cancel_stops_the_workers_on_every_node() {
    let c = Coordinator::start(&[]);
    let a = serve(&c, "agent-a", "pool=y");
    let b = serve(&c, "agent-b", "pool=y");
    let out = cli(&[
        "submit",
        "--coordinator",
        &c.addr,
        "--job-id",
        "long",
        "--nnodes",
        "2",
        "--nproc-per-node",
        "1",
        "--max-restarts",
        "3",
        "--",
        "sh",
        "-c",
        "echo running rank=$RANK; exec sleep 60",
    ]);
    assert!(out.status.success(), "{}", text(&out));
    for agent in [&a, &b] {
        agent.wait_for_lines(Stream::Stdout, 1, SLOW, |l| l.contains("running rank="));
    }
    wait_status(&c, Some("long"), "running");
    let t = Instant::now();
    let out = cli(&["cancel", "--coordinator", &c.addr, "long"]);
    assert!(out.status.success(), "{}", text(&out));
    for agent in [&a, &b] {
        agent.wait_for_lines(Stream::Stderr, 1, SLOW, |l| {
            l.contains("job long") && l.contains("cancelled by an operator")
        });
    }
    assert!(t.elapsed() < Duration::from_secs(5), "{:?}", t.elapsed());
    let s = wait_status(&c, Some("long"), "cancelled");
    assert!(s.contains("(over)"), "{s}");
    // The agents are idle again: a new job can use both.
    wait_status(&c, None, "jobs [], seen");
}

#[test]
fn a_late_agent_joins_a_running_elastic_job() {
    // A short last call: the first round closes with one node soon after it joins.
    let c = Coordinator::start(&["--last-call-ms", "300"]);
    let a = serve(&c, "agent-a", "pool=z");
    let out = cli(&[
        "submit",
        "--coordinator",
        &c.addr,
        "--job-id",
        "elastic",
        "--nnodes",
        "1:2",
        "--nproc-per-node",
        "1",
        "--",
        "sh",
        "-c",
        "echo world=$WORLD_SIZE gen=$MUSTER_GENERATION; exec sleep 60",
    ]);
    assert!(out.status.success(), "{}", text(&out));
    a.wait_for_lines(Stream::Stdout, 1, SLOW, |l| l.contains("world=1"));
    let b = serve(&c, "agent-b", "pool=z");
    // The new node's join supersedes generation 1; both nodes run generation 2 with 2 ranks.
    for agent in [&a, &b] {
        agent.wait_for_lines(Stream::Stdout, 1, SLOW, |l| l.contains("world=2 gen=2"));
    }
    let out = cli(&["cancel", "--coordinator", &c.addr, "elastic"]);
    assert!(out.status.success(), "{}", text(&out));
}

#[test]
fn bad_daemon_flags_exit_2_with_one_line() {
    for (args, message) in [
        (
            &["serve", "--coordinator", "127.0.0.1:1", "--labels", "nokey"][..],
            "--labels 'nokey' is malformed: expected KEY=VALUE",
        ),
        (
            &[
                "submit",
                "--coordinator",
                "127.0.0.1:1",
                "--nproc-per-node",
                "1",
                "--nnodes",
                "3:1",
                "--",
                "true",
            ][..],
            "--nnodes '3:1' is malformed",
        ),
        (
            &[
                "submit",
                "--coordinator",
                "127.0.0.1:1",
                "--nproc-per-node",
                "1",
                "--env",
                "=x",
                "--",
                "true",
            ][..],
            "--env '=x' has an empty key",
        ),
    ] {
        let out = cli(args);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {}", text(&out));
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(err.lines().count(), 1, "{args:?}: {err}");
        assert!(err.contains(message), "{args:?}: {err}");
    }
}

/// A submitted in-place job with `--max-spares 1` starts a third idle agent as its spare
/// (`status` says so); when a node's daemon is SIGKILLed, the spare takes its ranks in place
/// and the job finishes; `describe` names the replaced node and the spare.
#[test]
fn a_submitted_job_s_spare_agent_takes_a_lost_node_s_place() {
    let Some(trainer) = muster_tests::example_bin("ddp_train") else {
        eprintln!("skipped: no ddp_train example");
        return;
    };
    let c = Coordinator::start(&[]);
    let a = serve(&c, "agent-a", "pool=s");
    let b = serve(&c, "agent-b", "pool=s");
    let spare = serve(&c, "agent-c", "pool=s");
    wait_status(&c, None, "agent agent-c");
    let out = cli(&[
        "submit",
        "--coordinator",
        &c.addr,
        "--job-id",
        "subspare",
        "--nnodes",
        "2",
        "--nproc-per-node",
        "1",
        "--recovery",
        "in-place",
        "--max-restarts",
        "2",
        "--max-spares",
        "1",
        "--selector",
        "pool=s",
        "--env",
        "MUSTER_COMM_BACKEND=cpu",
        "--",
        trainer.to_str().expect("a UTF-8 path"),
        "--epochs",
        "6",
        "--samples",
        "512",
        "--batch-size",
        "32",
        "--eval-samples",
        "0",
        "--step-sleep-ms",
        "100",
    ]);
    assert!(out.status.success(), "{}", text(&out));
    let listing = wait_status(&c, None, "spare for [subspare]");
    assert!(
        listing
            .lines()
            .any(|l| l.starts_with("agent agent-c") && l.contains("spare for [subspare]")),
        "{listing}"
    );
    // Training is under way; then the daemon without rank 0 dies with its worker.
    let at_step = |agent: &Agent| {
        agent
            .lines(Stream::Stdout)
            .iter()
            .any(|l| l.contains("[rank 0] epoch=") && l.contains(" step=10 "))
    };
    let deadline = Instant::now() + SLOW;
    let (keep, mut lost, lost_id) = loop {
        if at_step(&a) {
            break (a, b, "agent-b");
        }
        if at_step(&b) {
            break (b, a, "agent-a");
        }
        assert!(Instant::now() < deadline, "no step 10 on either node");
        std::thread::sleep(Duration::from_millis(50));
    };
    lost.signal(nix::sys::signal::Signal::SIGKILL);
    spare.wait_for_lines(Stream::Stderr, 1, SLOW, |l| {
        l.contains("this spare takes node 1's place")
    });
    wait_status(&c, Some("subspare"), "finished");
    let view = cli(&["describe", "--coordinator", &c.addr, "subspare"]);
    let view = String::from_utf8_lossy(&view.stdout).into_owned();
    assert!(
        view.contains(&format!("replaced: node {lost_id}")),
        "{view}"
    );
    assert!(view.contains("on spare agent-c"), "{view}");
    assert!(lost.exited());
    drop((keep, spare));
}
