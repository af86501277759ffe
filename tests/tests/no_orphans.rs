//! No orphans, ever: whatever way `muster-agent` ends, nothing of its process tree outlives it.
//! SIGKILL to the agent is the hard case (the agent can do nothing; its guardian process does
//! it); workers that ignore SIGTERM or are stopped test the grace period's SIGKILL. Each test
//! records every process of the agent's tree (walking `/proc` parent links) before the end and
//! checks that none of them is alive afterwards.

use muster_tests::{Agent, SLOW, Stream};
use nix::sys::signal::Signal;
use std::time::{Duration, Instant};

/// One process, as `/proc/<pid>/stat` shows it.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Proc {
    pid: i32,
    comm: String,
    state: String,
    ppid: i32,
    pgid: i32,
    sid: i32,
    /// Start time (clock ticks after boot): tells a pid reused by another process apart.
    start: u64,
}

fn stat(pid: i32) -> Option<Proc> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let (head, rest) = text.rsplit_once(')')?;
    let comm = head.split_once('(')?.1.to_owned();
    let fields: Vec<&str> = rest.split_whitespace().collect();
    Some(Proc {
        pid,
        comm,
        state: (*fields.first()?).to_owned(),
        ppid: fields.get(1)?.parse().ok()?,
        pgid: fields.get(2)?.parse().ok()?,
        sid: fields.get(3)?.parse().ok()?,
        // Field 22 of the line; `fields` starts at field 3.
        start: fields.get(19)?.parse().ok()?,
    })
}

fn processes() -> Vec<Proc> {
    std::fs::read_dir("/proc")
        .map(|dir| {
            dir.filter_map(|e| e.ok()?.file_name().to_str()?.parse().ok())
                .filter_map(stat)
                .collect()
        })
        .unwrap_or_default()
}

/// Every descendant of `root` (not `root` itself).
fn tree(root: i32) -> Vec<Proc> {
    let all = processes();
    let mut found: Vec<Proc> = Vec::new();
    let mut parents = vec![root];
    while let Some(parent) = parents.pop() {
        for p in all.iter().filter(|p| p.ppid == parent) {
            if !found.iter().any(|f| f.pid == p.pid) {
                parents.push(p.pid);
                found.push(p.clone());
            }
        }
    }
    found
}

/// Whether `p` still runs: the same process (same start time), not a zombie.
fn alive(p: &Proc) -> bool {
    stat(p.pid).is_some_and(|now| now.start == p.start && now.state != "Z" && now.state != "X")
}

/// Waits up to `timeout` for every process of `procs` to die; returns those still alive.
fn survivors(procs: &[Proc], timeout: Duration) -> Vec<Proc> {
    let deadline = Instant::now() + timeout;
    loop {
        let left: Vec<Proc> = procs.iter().filter(|p| alive(p)).cloned().collect();
        if left.is_empty() || Instant::now() >= deadline {
            return left;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// Waits until the agent's tree satisfies `ready`, and returns it.
fn tree_when(agent: &Agent, what: &str, ready: impl Fn(&[Proc]) -> bool) -> Vec<Proc> {
    let deadline = Instant::now() + SLOW;
    loop {
        let procs = tree(agent.pid().as_raw());
        if ready(&procs) {
            return procs;
        }
        assert!(Instant::now() < deadline, "{what} never came: {procs:#?}");
        std::thread::sleep(Duration::from_millis(10));
    }
}

fn command_line(pid: i32) -> String {
    std::fs::read(format!("/proc/{pid}/cmdline"))
        .map(|b| String::from_utf8_lossy(&b).replace('\0', " "))
        .unwrap_or_default()
}

/// The targets of `pid`'s open descriptors (`pipe:[123]`, paths, ...).
fn descriptors(pid: i32) -> Vec<String> {
    std::fs::read_dir(format!("/proc/{pid}/fd"))
        .map(|dir| {
            dir.filter_map(|e| std::fs::read_link(e.ok()?.path()).ok())
                .map(|l| l.to_string_lossy().into_owned())
                .collect()
        })
        .unwrap_or_default()
}

fn launch(n: u32, flags: &[&str], script: &str) -> Agent {
    let n = n.to_string();
    let mut args = vec!["launch", "--nproc-per-node", &n];
    args.extend_from_slice(flags);
    args.extend_from_slice(&["--", "sh", "-c", script]);
    Agent::start(&args)
}

/// Each worker starts a child, a grandchild (through another shell) and a child that leaves
/// the worker's process group and session (`setsid`), then waits.
const FAMILY: &str = "sleep 60 & sh -c 'sleep 60 & wait' & setsid sleep 60 & echo ready $$; wait";

#[test]
fn sigkill_to_the_agent_kills_the_workers_and_everything_they_started() {
    let agent = launch(2, &["--job-id", "sigkill"], FAMILY);
    agent.wait_for_lines(Stream::Stdout, 2, SLOW, |l| l.contains("] ready "));
    let agent_pid = agent.pid().as_raw();
    let procs = tree_when(
        &agent,
        "3 sleeps per worker, one in a session of its own",
        |t| {
            let sleeps = t.iter().filter(|p| p.comm == "sleep");
            sleeps.clone().count() == 6 && sleeps.filter(|p| p.sid == p.pid).count() == 2
        },
    );

    // The guardian: the agent's child in a group of its own, reading a pipe that only the
    // agent writes (no worker inherited its end).
    let guardian = procs
        .iter()
        .find(|p| p.ppid == agent_pid && command_line(p.pid).contains("__guard"))
        .unwrap_or_else(|| panic!("no guardian process among {procs:#?}"));
    assert_eq!(
        guardian.pgid, guardian.pid,
        "the guardian leads its own group"
    );
    let pipe = std::fs::read_link(format!("/proc/{}/fd/0", guardian.pid))
        .map(|l| l.to_string_lossy().into_owned())
        .unwrap_or_default();
    assert!(pipe.starts_with("pipe:"), "guardian stdin: {pipe:?}");
    assert!(
        descriptors(agent_pid).contains(&pipe),
        "the agent writes it"
    );
    for p in procs.iter().filter(|p| p.pid != guardian.pid) {
        assert!(
            !descriptors(p.pid).contains(&pipe),
            "{p:?} inherited the guardian's pipe"
        );
    }

    agent.signal(Signal::SIGKILL);
    let killed = Instant::now();
    let left = survivors(&procs, Duration::from_secs(3));
    assert!(
        left.is_empty(),
        "alive {:?} after SIGKILL to the agent: {left:#?}",
        killed.elapsed()
    );
    eprintln!(
        "{} processes gone {:?} after SIGKILL to the agent",
        procs.len(),
        killed.elapsed()
    );
    let run = agent.finish(SLOW);
    assert_eq!(run.status.code(), None, "{}", run.dump());
    assert!(
        run.stderr
            .iter()
            .any(|l| l.contains("its guardian killed") && l.contains("in 2 worker process group")),
        "{}",
        run.dump()
    );
}

#[test]
fn a_normal_exit_leaves_no_guardian_and_says_nothing_of_it() {
    let agent = launch(2, &["--job-id", "quiet"], "echo ready $$; sleep 0.5");
    let procs = tree_when(&agent, "the guardian", |t| {
        t.iter().any(|p| command_line(p.pid).contains("__guard"))
    });
    let run = agent.finish(SLOW);
    assert_eq!(run.code(), Some(0), "{}", run.dump());
    let left = survivors(&procs, Duration::from_secs(3));
    assert!(left.is_empty(), "{left:#?}");
    assert!(
        !run.stderr.iter().any(|l| l.contains("guardian")),
        "{}",
        run.dump()
    );
}

/// Rank 0 ignores SIGTERM (and so does its child): it ends only with the SIGKILL after the
/// grace period, with its child. Rank 1 has stopped itself: the SIGCONT that follows every
/// SIGTERM wakes it to act on the SIGTERM. `trigger` makes the agent stop them.
fn stubborn_workers_are_killed(
    grace_ms: u64,
    extra_rank: Option<&str>,
    trigger: impl FnOnce(&Agent),
) -> (muster_tests::Finished, Duration) {
    let grace = grace_ms.to_string();
    let script = format!(
        "case $RANK in \
         0) trap '' TERM; sleep 60 & echo ready $$; wait;; \
         1) sleep 60 & echo ready $$; kill -STOP $$;; \
         *) {};; esac",
        extra_rank.unwrap_or("true")
    );
    let n = if extra_rank.is_some() { 3 } else { 2 };
    let agent = launch(n, &["--grace-period-ms", &grace], &script);
    agent.wait_for_lines(Stream::Stdout, 2, SLOW, |l| l.contains("] ready "));
    let procs = tree_when(&agent, "rank 1 stopped", |t| {
        t.iter()
            .filter(|p| command_line(p.pid).starts_with("sleep 60"))
            .count()
            == 2
            && t.iter().any(|p| p.comm == "sh" && p.state == "T")
    });
    let started = Instant::now();
    trigger(&agent);
    let run = agent.finish(SLOW);
    let took = started.elapsed();
    let left = survivors(&procs, Duration::from_secs(2));
    assert!(left.is_empty(), "{left:#?}\n{}", run.dump());
    (run, took)
}

#[test]
fn a_failure_kills_a_stopped_worker_and_one_ignoring_sigterm_after_the_grace_period() {
    let dir = std::env::temp_dir().join(format!("muster-no-orphans-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temp dir");
    let marker = dir.join("fail-now");
    let fail = format!(
        "while [ ! -e {} ]; do sleep 0.02; done; exit 3",
        marker.display()
    );
    let (run, took) = stubborn_workers_are_killed(500, Some(&fail), |_| {
        std::fs::write(&marker, b"").expect("marker");
    });
    let _ = std::fs::remove_dir_all(&dir);
    assert_eq!(run.code(), Some(1), "{}", run.dump());
    // The others get FAILURE_SETTLE (capped by the grace period, 500 ms) to end on their own,
    // then SIGTERM and the grace period.
    eprintln!("failure to agent exit with a 500 ms grace period: {took:?}");
    assert!(
        took >= Duration::from_millis(1000) && took < Duration::from_millis(3500),
        "{took:?}\n{}",
        run.dump()
    );
    assert!(
        run.stderr
            .iter()
            .any(|l| l.contains("rank 2 (local rank 2) exited with status 3")),
        "{}",
        run.dump()
    );
}

#[test]
fn sigterm_kills_a_stopped_worker_and_one_ignoring_sigterm_after_the_grace_period() {
    let (run, took) = stubborn_workers_are_killed(500, None, |agent| agent.signal(Signal::SIGTERM));
    assert_eq!(run.code(), Some(143), "{}", run.dump());
    eprintln!("SIGTERM to agent exit with a 500 ms grace period: {took:?}");
    assert!(
        took >= Duration::from_millis(500) && took < Duration::from_millis(3000),
        "{took:?}\n{}",
        run.dump()
    );
}
