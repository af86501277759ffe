//! Stacks and hangs, end to end (`docs/hangs.md`): real `muster-agent launch` processes with
//! their embedded coordinator (or two agents on one coordinator), real workers, and
//! `muster-agent describe --stacks`, which asks every node's agent through the coordinator to
//! read its workers' stacks from outside (py-spy), and prints them grouped.
//!
//! - an unmodified Accelerate script that hangs (rank 1 in its own slow data step, the others
//!   in `wait_for_everyone`), on one node and across two agents: the odd rank comes first,
//!   named, with its file, line, function and source; the waiting majority once; then the
//!   hang timeout reports the same view on the launch's stderr, in `describe` and in the
//!   coordinator's `muster_hangs_total`;
//! - `--on-hang fail`: the job ends within the hang timeout plus 5 s, exit status 4, the odd
//!   rank named as the root cause;
//! - a gloo script where rank 1 calls one all_reduce fewer: both collective call sites named
//!   with their ranks;
//! - the same with `--native`: the waiting ranks' native frames in torch's C++ below the
//!   barrier, the grouping unchanged;
//! - a Rust SDK worker at a barrier, a program that is not Python (`sleep`) and a worker that
//!   already exited, in one job: each gets its line with its native stack, and the SDK worker
//!   its barrier state;
//! - a worker that makes itself non-dumpable under an agent without CAP_SYS_PTRACE: one line
//!   naming the cause and the fix, the other ranks read as usual;
//! - a worker that stops itself (SIGSTOP): a note says its process is stopped.
//!
//! The Python cases need the peers' venv (`scripts/install-peers.sh`); without it they print
//! `skipped: ...` and pass.
#![allow(clippy::unwrap_used, missing_docs)]

use muster_tests::{Agent, Finished, SLOW, Stream, agent_bin, example_bin, free_port, http};
use muster_tests::{peers_python, workspace_root};
use std::process::Command;
use std::time::{Duration, Instant};

/// torch's import takes seconds on a 2-core machine, and every rank imports it at once.
const PYTHON_START: Duration = Duration::from_secs(120);

/// `muster-agent describe --coordinator ADDR JOB <extra>`, run to its end.
fn describe(addr: &str, job: &str, extra: &[&str]) -> Finished {
    let mut args = vec!["describe", "--coordinator", addr, job];
    args.extend_from_slice(extra);
    let mut cmd = Command::new(agent_bin());
    cmd.args(&args);
    Agent::spawn(cmd, format!("muster-agent {args:?}")).finish(SLOW)
}

/// Runs `describe --stacks` until its output satisfies `settled` (the stacks settle within a
/// second of the workers reaching their waits), and returns that output and how long that
/// run took; panics with the last output, saying `what` was expected, after [`SLOW`].
fn stacks_until(
    addr: &str,
    job: &str,
    what: &str,
    settled: impl Fn(&str) -> bool,
) -> (String, Duration) {
    let deadline = Instant::now() + SLOW;
    loop {
        let started = Instant::now();
        let run = describe(addr, job, &["--stacks"]);
        let took = started.elapsed();
        assert_eq!(run.code(), Some(0), "{}", run.dump());
        let text = run.stdout.join("\n");
        if settled(&text) {
            return (text, took);
        }
        assert!(Instant::now() < deadline, "{what}:\n{text}");
        std::thread::sleep(Duration::from_millis(300));
    }
}

/// The line number of the first line of `tests/python/<script>` that starts with `text`.
fn line_of(script: &str, text: &str) -> usize {
    let path = workspace_root().join("tests/python").join(script);
    let source = std::fs::read_to_string(&path).unwrap();
    1 + source
        .lines()
        .position(|l| l.starts_with(text))
        .unwrap_or_else(|| panic!("{text:?} is not in {}", path.display()))
}

/// `launch <flags> --nproc-per-node N --job-id JOB -- PYTHON tests/python/SCRIPT`.
fn launch_python(
    python: &std::path::Path,
    script: &str,
    job: &str,
    nproc: &str,
    flags: &[&str],
) -> Agent {
    let script = workspace_root().join("tests/python").join(script);
    let mut args = vec!["launch", "--nproc-per-node", nproc, "--job-id", job];
    args.extend_from_slice(flags);
    args.extend(["--", python.to_str().unwrap(), script.to_str().unwrap()]);
    Agent::start(&args)
}

/// What the Accelerate hang's stacks must say, for ranks `waiting` and the stuck `stuck`.
fn assert_accelerate_hang(text: &str, stuck: u32, waiting: &str, world: u32) {
    let sleep_line = line_of("hang_accelerate.py", "    time.sleep(600)");
    let call_line = line_of("hang_accelerate.py", "    slow_data_step()");
    let wait_line = line_of("hang_accelerate.py", "accelerator.wait_for_everyone()");
    let odd = format!(
        "rank {stuck} is elsewhere: hang_accelerate.py:{sleep_line} slow_data_step (time.sleep(600)) <- hang_accelerate.py:{call_line} <module>"
    );
    let lines: Vec<&str> = text.lines().map(str::trim).collect();
    let first = lines
        .iter()
        .position(|l| l.starts_with("rank ") || l.starts_with("ranks "))
        .unwrap_or_else(|| panic!("no group line in:\n{text}"));
    assert!(
        lines[first].starts_with(&odd),
        "the odd rank is not first:\n{text}"
    );
    let majority = format!(
        "ranks {waiting} ({} of {world}): torch.distributed.barrier <- ",
        world - 1
    );
    let m = lines[first + 1];
    assert!(m.starts_with(&majority), "no waiting majority in:\n{text}");
    assert!(
        m.contains("accelerate.Accelerator.wait_for_everyone <- ")
            && m.contains(&format!(
                "hang_accelerate.py:{wait_line} <module> (accelerator.wait_for_everyone())"
            )),
        "{text}"
    );
    // torch's Flight Recorder, on by default: the stuck rank never reached the barrier.
    let recorded = format!(
        "flight recorder (default_pg): ranks {waiting} last called collective #1 gloo:barrier (scheduled)"
    );
    let behind = format!(
        "flight recorder: rank {stuck} is behind in default_pg: it has called no collective yet, the others reached #1"
    );
    assert!(
        lines.contains(&recorded.as_str()) && lines.contains(&behind.as_str()),
        "{text}"
    );
}

/// One node, three ranks: `describe --stacks` names rank 1 in its slow data step first and
/// the others at the barrier once, in well under a second; the hang timeout then prints the
/// same view on the launch's stderr, `describe` shows it, and the coordinator counts it.
#[test]
fn an_unmodified_accelerate_hang_is_explained_and_reported() {
    let Some(python) = peers_python(&["torch", "accelerate"]) else {
        return;
    };
    let metrics = free_port();
    let metrics_addr = format!("127.0.0.1:{metrics}");
    let coordinator =
        muster_tests::coordinator::Coordinator::start(&["--metrics-addr", &metrics_addr]);
    let addr = coordinator.addr.clone();
    let agent = launch_python(
        &python,
        "hang_accelerate.py",
        "stacks-acc",
        "3",
        &["--coordinator", &addr, "--hang-timeout", "6s"],
    );
    agent.wait_for_lines(Stream::Stdout, 3, PYTHON_START, |l| {
        l.contains("] ready rank=")
    });
    // Until the waiting ranks are inside the barrier.
    let (text, took) = stacks_until(&addr, "stacks-acc", "no grouped stacks", |t| {
        t.contains("is elsewhere") && t.contains("torch.distributed.barrier")
    });
    eprintln!("describe --stacks took {took:?}");
    assert!(took < Duration::from_secs(5), "{took:?}");
    assert_accelerate_hang(&text, 1, "0,2", 3);
    // With native frames: the waiting ranks stand in torch's C++ below the Python barrier,
    // the grouping and the odd rank unchanged.
    let started = Instant::now();
    let run = describe(&addr, "stacks-acc", &["--stacks", "--native"]);
    eprintln!("describe --stacks --native took {:?}", started.elapsed());
    assert_eq!(run.code(), Some(0), "{}", run.dump());
    let native = run.stdout.join("\n");
    let waiting = native
        .lines()
        .find(|l| l.trim_start().starts_with("ranks 0,2 (2 of 3): "))
        .unwrap_or_else(|| panic!("no waiting group:\n{native}"));
    assert!(
        waiting.contains("(libtorch_cpu.so)") && waiting.contains("torch.distributed.barrier"),
        "{waiting}"
    );
    assert!(native.contains("rank 1 is elsewhere: "), "{native}");
    assert!(!native.contains("no native frames"), "{native}");
    // A later native dump only unwinds: the libraries were parsed by the first.
    let started = Instant::now();
    let again = describe(&addr, "stacks-acc", &["--stacks", "--native"]);
    let took = started.elapsed();
    eprintln!("a second describe --stacks --native took {took:?}");
    assert_eq!(again.code(), Some(0), "{}", again.dump());
    assert!(took < Duration::from_secs(2), "{took:?}");

    // The hang timeout: reported once on the launch's stderr, with the same groups.
    let headline = agent
        .wait_for_lines(Stream::Stderr, 1, SLOW, |l| {
            l.contains("no progress in generation") && l.contains("(hang timeout 6 s): reported")
        })
        .remove(0);
    assert!(
        headline.starts_with("muster-agent: job stacks-acc: no progress in generation 1 for "),
        "{headline}"
    );
    let report = agent.wait_for_lines(Stream::Stderr, 1, SLOW, |l| l.contains("is elsewhere"));
    assert!(report[0].contains("rank 1 is elsewhere"), "{report:?}");
    // The hang report carries the Flight Recorder's verdict too.
    agent.wait_for_lines(Stream::Stderr, 1, SLOW, |l| {
        l.trim() == "flight recorder: rank 1 is behind in default_pg: it has called no collective yet, the others reached #1"
    });
    let view = describe(&addr, "stacks-acc", &[]);
    let text = view.stdout.join("\n");
    assert!(
        text.contains("\nHANG: no progress in generation 1 for "),
        "{text}"
    );
    // Sampled from outside: a rank without a muster session reads as running.
    assert!(
        text.contains("running without a muster session (its agent samples it: waiting in "),
        "{text}"
    );
    assert!(text.contains("rank 1 is elsewhere"), "{text}");
    let scraped = http(metrics, "GET", "/metrics", "").unwrap();
    assert!(
        scraped.contains("muster_hangs_total{action=\"report\"} 1"),
        "{scraped}"
    );
    // Reported once: the job goes on and nothing more is printed for this stall.
    std::thread::sleep(Duration::from_secs(2));
    let reports = agent
        .lines(Stream::Stderr)
        .iter()
        .filter(|l| l.contains("no progress in generation"))
        .count();
    assert_eq!(reports, 1, "{}", agent.output());
}

/// `--on-hang fail`: the job ends within the hang timeout plus 5 s of the hang, exit status
/// 4, and the root cause names the odd rank and where it is.
#[test]
fn on_hang_fail_ends_the_job_naming_the_odd_rank() {
    let Some(python) = peers_python(&["torch", "accelerate"]) else {
        return;
    };
    let agent = launch_python(
        &python,
        "hang_accelerate.py",
        "stacks-fail",
        "3",
        &[
            "--hang-timeout",
            "4s",
            "--on-hang",
            "fail",
            "--grace-period-ms",
            "500",
        ],
    );
    agent.wait_for_lines(Stream::Stdout, 3, PYTHON_START, |l| {
        l.contains("] ready rank=")
    });
    let hung_at = Instant::now();
    let run = agent.finish_by(hung_at + Duration::from_secs(4 + 5 + 5));
    let took = hung_at.elapsed();
    assert_eq!(run.code(), Some(4), "{}", run.dump());
    // The ranks were ready a little before the last of them printed it; the agent's own stop
    // (grace period) comes on top of the timeout.
    assert!(
        took <= Duration::from_secs(4 + 5),
        "{took:?}\n{}",
        run.dump()
    );
    let cause = run
        .stderr
        .iter()
        .find(|l| l.contains("job stacks-fail failed"))
        .unwrap_or_else(|| panic!("no root cause:\n{}", run.dump()));
    assert!(
        cause.contains("rank 1 (node 0") && cause.contains("the job hung: no progress for"),
        "{cause}"
    );
    assert!(
        cause.contains("rank 1 is elsewhere: hang_accelerate.py:"),
        "{cause}"
    );
}

/// A gloo script where rank 1 calls one all_reduce fewer: ranks 0 and 2 wait in the second
/// all_reduce, rank 1 in the barrier after it. Both call sites are named with their ranks,
/// rank 1's as the one elsewhere.
#[test]
fn ranks_at_two_collective_call_sites_are_named_with_their_sites() {
    let Some(python) = peers_python(&["torch"]) else {
        return;
    };
    let agent = launch_python(
        &python,
        "fewer_all_reduce.py",
        "stacks-fewer",
        "3",
        &["--hang-timeout", "off"],
    );
    let addr = agent.embedded_coordinator();
    agent.wait_for_lines(Stream::Stdout, 3, PYTHON_START, |l| {
        l.contains("] ready rank=")
    });
    let second = line_of("fewer_all_reduce.py", "    dist.all_reduce(t)");
    let barrier = line_of("fewer_all_reduce.py", "dist.barrier()");
    let odd = format!(
        "rank 1 is elsewhere: torch.distributed.barrier <- fewer_all_reduce.py:{barrier} <module> (dist.barrier())"
    );
    let majority = format!(
        "ranks 0,2 (2 of 3): torch.distributed.all_reduce <- fewer_all_reduce.py:{second} <module> (dist.all_reduce(t))"
    );
    stacks_until(&addr, "stacks-fewer", "not both sites", |text| {
        let lines: Vec<&str> = text.lines().map(str::trim).collect();
        let at = lines
            .iter()
            .position(|l| l.starts_with("rank 1 is elsewhere"));
        at.is_some_and(|i| {
            lines[i].starts_with(&odd) && lines.get(i + 1).is_some_and(|l| l.starts_with(&majority))
        })
    });
    // torch's Flight Recorder: the same sequence number, two different collectives.
    let (text, _) = stacks_until(&addr, "stacks-fewer", "no disagreement", |text| {
        text.contains("flight recorder: the ranks disagree on collective #2 of default_pg: 0,2 gloo:all_reduce [1]; 1 gloo:barrier")
    });
    assert!(
        text.contains("flight recorder (default_pg): ranks 0,2 last called collective #2 gloo:all_reduce [1] (scheduled)"),
        "{text}"
    );
}

/// Two agents on one coordinator, two ranks each; rank 2 (node 1) is stuck: `describe
/// --stacks` gathers both nodes' stacks through the coordinator.
#[test]
fn an_accelerate_hang_across_two_agents_names_the_odd_rank_on_its_node() {
    let Some(python) = peers_python(&["torch", "accelerate"]) else {
        return;
    };
    let coordinator = muster_tests::coordinator::Coordinator::start(&[]);
    let addr = coordinator.addr.clone();
    let script = workspace_root().join("tests/python/hang_accelerate.py");
    let node = || {
        Agent::start_with_env(
            &[
                "launch",
                "--coordinator",
                &addr,
                "--job-id",
                "stacks-two",
                "--nnodes",
                "2",
                "--nproc-per-node",
                "2",
                "--advertise-addr",
                "127.0.0.1",
                "--hang-timeout",
                "off",
                "--",
                python.to_str().unwrap(),
                script.to_str().unwrap(),
            ],
            &[("STUCK_RANK", "2")],
        )
    };
    let agents = [node(), node()];
    for a in &agents {
        a.wait_for_lines(Stream::Stdout, 2, PYTHON_START, |l| {
            l.contains("] ready rank=")
        });
    }
    let (text, took) = stacks_until(&addr, "stacks-two", "no grouped stacks", |t| {
        t.contains("is elsewhere") && t.contains("torch.distributed.barrier")
    });
    eprintln!("describe --stacks over 2 nodes took {took:?}");
    assert_accelerate_hang(&text, 2, "0-1,3", 4);
    // Off: no hang is reported, however long the job stands.
    assert!(!text.contains("HANG"), "{text}");
}

/// One job of three ranks: a Rust SDK worker waiting at a barrier (rank 0), a program that is
/// not Python (rank 1, `sleep`), and a worker that already exited 0 (rank 2). Each gets its
/// line; the SDK worker's barrier state is shown; the view does not fail.
#[test]
fn native_workers_and_exited_ones_get_a_line_each() {
    let Some(barrier_loop) = example_bin("barrier_loop") else {
        eprintln!("skipped: worker-sdk/examples/barrier_loop.rs is missing");
        return;
    };
    let script = format!(
        "case $RANK in 0) exec {} --iters 1 --warmup 0;; 1) echo sleeping; exec sleep 300;; *) echo done; exit 0;; esac",
        barrier_loop.display()
    );
    let agent = Agent::start(&[
        "launch",
        "--nproc-per-node",
        "3",
        "--job-id",
        "stacks-native",
        "--",
        "sh",
        "-c",
        &script,
    ]);
    let addr = agent.embedded_coordinator();
    agent.wait_for_lines(Stream::Stdout, 1, SLOW, |l| l == "[rank 1] sleeping");
    agent.wait_for_lines(Stream::Stdout, 1, SLOW, |l| l == "[rank 2] done");
    let (text, _) = stacks_until(&addr, "stacks-native", "not settled", |t| {
        t.contains("muster: rank 0 is waiting at") && t.contains("is sleeping")
    });
    let bin = barrier_loop.display().to_string();
    let rust = text
        .lines()
        .find(|l| l.contains(&format!("not Python: {bin} (pid ")))
        .unwrap_or_else(|| panic!("rank 0 (Rust) is not named as native:\n{text}"));
    // Its native stack, named from its symbols, with source lines from its line tables.
    assert!(rust.contains(" (barrier_loop"), "{rust}");
    assert!(rust.contains(".rs:"), "{rust}");
    let sleep = text
        .lines()
        .find(|l| l.contains("not Python: /usr/bin/sleep (pid "))
        .unwrap_or_else(|| panic!("no line for sleep:\n{text}"));
    assert!(sleep.contains("it is sleeping"), "{sleep}");
    assert!(sleep.contains("sleep (libc.so.6)"), "{sleep}");
    assert!(
        text.contains("rank 2") && text.contains("cannot read: no stack from its agent: "),
        "the exited rank has no line:\n{text}"
    );
}

/// A worker that makes itself non-dumpable, under an agent that lacks CAP_SYS_PTRACE (setpriv
/// drops it): its rank gets one line naming the cause and the fix; the other rank is read.
#[test]
fn a_non_dumpable_worker_gets_a_line_naming_the_cause_and_the_fix() {
    let Some(python) = peers_python(&[]) else {
        return;
    };
    if Command::new("setpriv").arg("--version").output().is_err() {
        eprintln!("skipped: setpriv (util-linux) is not installed");
        return;
    }
    let script = workspace_root().join("tests/python/not_dumpable.py");
    // Rank 0 is made non-dumpable; rank 1 sleeps in Python and stays readable.
    let worker = format!(
        "if [ \"$RANK\" = 0 ]; then exec {py} {script}; else exec {py} -c 'import time; print(\"readable\", flush=True); time.sleep(600)'; fi",
        py = python.display(),
        script = script.display()
    );
    let mut cmd = Command::new("setpriv");
    cmd.args(["--inh-caps=-sys_ptrace", "--bounding-set=-sys_ptrace", "--"])
        .arg(agent_bin())
        .args([
            "launch",
            "--nproc-per-node",
            "2",
            "--job-id",
            "stacks-dumpable",
            "--",
            "sh",
            "-c",
            &worker,
        ]);
    let agent = Agent::spawn(cmd, "setpriv muster-agent launch");
    let addr = agent.embedded_coordinator();
    agent.wait_for_lines(Stream::Stdout, 1, SLOW, |l| l == "[rank 0] not dumpable");
    agent.wait_for_lines(Stream::Stdout, 1, SLOW, |l| l == "[rank 1] readable");
    let run = describe(&addr, "stacks-dumpable", &["--stacks"]);
    assert_eq!(run.code(), Some(0), "{}", run.dump());
    let text = run.stdout.join("\n");
    assert!(
        text.contains("cannot read: cannot read process ")
            && text.contains("it is not dumpable")
            && text.contains("give the agent CAP_SYS_PTRACE"),
        "{text}"
    );
    assert!(
        text.contains("rank 1 (1 of 2): <string>:1 <module>"),
        "rank 1 was not read:\n{text}"
    );
}

/// A worker that stops itself (SIGSTOP): its rank's stack is read as usual and a note says its
/// process is stopped, so a stack that looks busy is not taken for a running one; after
/// SIGCONT it runs on.
#[test]
fn a_stopped_worker_is_said_to_be_stopped() {
    let Some(python) = peers_python(&[]) else {
        return;
    };
    let worker = format!(
        "if [ \"$RANK\" = 1 ]; then exec {py} -c 'import os, signal; print(\"stopping\", os.getpid(), flush=True); os.kill(os.getpid(), signal.SIGSTOP); print(\"resumed\", flush=True)'; else exec {py} -c 'import time; print(\"waiting\", flush=True); time.sleep(600)'; fi",
        py = python.display(),
    );
    let agent = Agent::start(&[
        "launch",
        "--nproc-per-node",
        "2",
        "--job-id",
        "stacks-stopped",
        "--",
        "sh",
        "-c",
        &worker,
    ]);
    let addr = agent.embedded_coordinator();
    agent.wait_for_lines(Stream::Stdout, 1, SLOW, |l| l == "[rank 0] waiting");
    let stopping = agent
        .wait_for_lines(Stream::Stdout, 1, SLOW, |l| {
            l.starts_with("[rank 1] stopping ")
        })
        .remove(0);
    let pid: i32 = stopping.rsplit(' ').next().unwrap().parse().unwrap();
    let (text, _) = stacks_until(&addr, "stacks-stopped", "rank 1 said to be stopped", |t| {
        t.contains("rank 1: its process is stopped")
    });
    assert!(
        text.contains(
            "rank 1: its process is stopped (by SIGSTOP, a terminal's Ctrl-Z or a debugger): it runs nothing until it gets SIGCONT"
        ),
        "{text}"
    );
    assert!(
        !text.contains("rank 0: its process"),
        "rank 0 runs:\n{text}"
    );
    assert!(
        Command::new("kill")
            .args(["-CONT", &pid.to_string()])
            .status()
            .unwrap()
            .success()
    );
    agent.wait_for_lines(Stream::Stdout, 1, SLOW, |l| l == "[rank 1] resumed");
}
