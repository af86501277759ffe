//! The agent under signals that stop or kill processes without asking: a SIGKILLed agent's
//! private folders are removed by its guardian, a worker that is stopped (SIGSTOP) when the
//! agent stops the job ends at once instead of sitting out the grace period, and an agent that
//! was itself stopped and resumed names that (this process did not run) instead of blaming the
//! coordinator.

use muster_tests::coordinator::Coordinator;
use muster_tests::{Agent, SLOW, Stream};
use nix::sys::signal::Signal;
use std::path::PathBuf;
use std::time::{Duration, Instant};

/// The agent's private folders in the temporary folder: the relay's `muster-<pid>-<hex>`, the
/// error-file folder `muster-agent-<pid>-<job>` and the Flight Recorder's `muster-fr-<pid>-<n>`.
fn private_folders(agent: &Agent) -> Vec<PathBuf> {
    let pid = agent.pid().as_raw();
    let prefixes = prefixes(pid);
    std::fs::read_dir(std::env::temp_dir())
        .map(|dir| {
            dir.filter_map(|e| e.ok())
                .filter(|e| {
                    e.file_name()
                        .to_str()
                        .is_some_and(|n| prefixes.iter().any(|p| n.starts_with(p.as_str())))
                })
                .map(|e| e.path())
                .collect()
        })
        .unwrap_or_default()
}

fn prefixes(pid: i32) -> [String; 3] {
    [
        format!("muster-{pid}-"),
        format!("muster-agent-{pid}-"),
        format!("muster-fr-{pid}-"),
    ]
}

/// Waits until `done` holds, at most `limit`; returns whether it did.
fn within(limit: Duration, done: impl Fn() -> bool) -> bool {
    let deadline = Instant::now() + limit;
    loop {
        if done() {
            return true;
        }
        if Instant::now() >= deadline {
            return false;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// The state letter of `/proc/<pid>/stat` (`T` when stopped).
fn state(pid: i32) -> Option<String> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let (_, rest) = stat.rsplit_once(')')?;
    rest.split_whitespace().next().map(str::to_owned)
}

#[test]
fn the_guardian_removes_a_sigkilled_agents_private_folders() {
    let agent = Agent::start(&[
        "launch",
        "--job-id",
        "killed",
        "--nproc-per-node",
        "1",
        "--",
        "sh",
        "-c",
        "echo ready; exec sleep 60",
    ]);
    agent.wait_for_lines(Stream::Stdout, 1, SLOW, |l| l.contains("ready"));
    let folders = private_folders(&agent);
    let pid = agent.pid().as_raw();
    for prefix in prefixes(pid) {
        assert!(
            folders.iter().any(|f| f
                .file_name()
                .and_then(|n| n.to_str())
                .is_some_and(|n| n.starts_with(prefix.as_str()))),
            "no {prefix}* folder while the job runs: {folders:?}"
        );
    }
    agent.signal(Signal::SIGKILL);
    let gone = within(Duration::from_secs(5), || {
        folders.iter().all(|f| !f.exists())
    });
    let left: Vec<&PathBuf> = folders.iter().filter(|f| f.exists()).collect();
    let run = agent.finish(SLOW);
    assert!(gone, "left behind after SIGKILL: {left:?}\n{}", run.dump());
    assert_eq!(run.status.code(), None, "{}", run.dump());
}

#[test]
fn a_stopped_worker_ends_at_once_when_the_agent_stops_the_job() {
    // Local rank 0 stops itself (with a child in its process group); rank 1 just waits. The
    // grace period is long: the stopped worker must not sit it out.
    let agent = Agent::start(&[
        "launch",
        "--nproc-per-node",
        "2",
        "--shutdown-timeout",
        "30",
        "--",
        "sh",
        "-c",
        "case $LOCAL_RANK in 0) sleep 60 & echo ready $$; kill -STOP $$;; *) echo ready $$; exec sleep 60;; esac",
    ]);
    let ready = agent.wait_for_lines(Stream::Stdout, 2, SLOW, |l| l.contains("] ready "));
    let stopped: i32 = ready
        .iter()
        .find_map(|l| l.strip_prefix("[rank 0] ready "))
        .and_then(|pid| pid.trim().parse().ok())
        .unwrap_or_else(|| panic!("no pid from rank 0: {ready:?}"));
    assert!(
        within(SLOW, || state(stopped).as_deref() == Some("T")),
        "rank 0 (pid {stopped}) never stopped\n{}",
        agent.output()
    );
    let t = Instant::now();
    agent.signal(Signal::SIGTERM);
    let run = agent.finish(SLOW);
    let took = t.elapsed();
    assert_eq!(run.code(), Some(143), "{}", run.dump());
    assert!(took < Duration::from_secs(10), "{took:?}\n{}", run.dump());
    assert!(
        !run.stderr.iter().any(|l| l.contains("sending SIGKILL")),
        "{}",
        run.dump()
    );
}

/// A job whose one worker runs until `marker` exists, against a coordinator that waits
/// `heartbeat_timeout_ms` for a silent node, with this agent's `lease_ms`.
fn stalled_job(c: &Coordinator, job: &str, lease_ms: &str, marker: &std::path::Path) -> Agent {
    let script = format!(
        "echo ready; while [ ! -e {} ]; do sleep 0.05; done; echo done",
        marker.display()
    );
    Agent::start(&[
        "launch",
        "--coordinator",
        &c.addr,
        "--job-id",
        job,
        "--nproc-per-node",
        "1",
        "--max-restarts",
        "0",
        "--lease-ms",
        lease_ms,
        "--grace-period-ms",
        "500",
        "--",
        "sh",
        "-c",
        &script,
    ])
}

/// Stops the agent for `for_` (the fault's length, not a synchronisation), then resumes it.
fn stop_and_resume(agent: &Agent, for_: Duration) {
    agent.signal(Signal::SIGSTOP);
    std::thread::sleep(for_);
    agent.signal(Signal::SIGCONT);
}

fn marker(tag: &str) -> PathBuf {
    std::env::temp_dir().join(format!("muster-agent-signals-{}-{tag}", std::process::id()))
}

#[test]
fn a_resumed_agent_names_its_own_stall_and_keeps_a_coordinator_that_still_counts_it() {
    // The coordinator waits a minute for a silent node: it still counts this one when the
    // agent resumes after 4 s, twice its 2 s lease.
    let c = Coordinator::start(&["--heartbeat-timeout-ms", "60000"]);
    let marker = marker("kept");
    let _ = std::fs::remove_file(&marker);
    let agent = stalled_job(&c, "stalled", "2000", &marker);
    agent.wait_for_lines(Stream::Stdout, 1, SLOW, |l| l.contains("ready"));
    stop_and_resume(&agent, Duration::from_secs(4));
    agent.wait_for_lines(Stream::Stderr, 1, SLOW, |l| {
        l.contains("this agent did not run for")
    });
    std::fs::write(&marker, b"").expect("marker");
    let run = agent.finish(SLOW);
    let _ = std::fs::remove_file(&marker);
    assert_eq!(run.code(), Some(0), "{}", run.dump());
    assert_eq!(run.rank_stdout(0), ["ready", "done"], "{}", run.dump());
    let stall: Vec<&String> = run
        .stderr
        .iter()
        .filter(|l| l.contains("this agent did not run for"))
        .collect();
    assert_eq!(stall.len(), 1, "{}", run.dump());
    let seconds: f64 = stall[0]
        .split("did not run for ")
        .nth(1)
        .and_then(|rest| rest.split('s').next())
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("no duration in {:?}", stall[0]));
    assert!((3.5..30.0).contains(&seconds), "{seconds}\n{}", run.dump());
    assert!(
        !run.stderr.iter().any(|l| l.contains("was not heard")),
        "{}",
        run.dump()
    );
}

#[test]
fn a_resumed_agent_whose_node_was_failed_meanwhile_names_its_stall() {
    // The coordinator gives up on the node after 1 s of silence: the generation fails while
    // the agent is stopped (no restarts left), and the agent hears why when it resumes.
    let c = Coordinator::start(&["--heartbeat-timeout-ms", "1000"]);
    let marker = marker("failed");
    let agent = stalled_job(&c, "stalled-failed", "1000", &marker);
    agent.wait_for_lines(Stream::Stdout, 1, SLOW, |l| l.contains("ready"));
    stop_and_resume(&agent, Duration::from_secs(3));
    let run = agent.finish(SLOW);
    assert_eq!(run.code(), Some(1), "{}", run.dump());
    assert!(
        run.stderr
            .iter()
            .any(|l| l.contains("this agent did not run for")),
        "{}",
        run.dump()
    );
    assert!(
        !run.stderr.iter().any(|l| l.contains("was not heard")),
        "{}",
        run.dump()
    );
}
