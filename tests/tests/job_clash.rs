//! Two `muster-agent launch` processes given the same job id on one coordinator (issue 14,
//! finding 3): the job's generation is full (one node of at most one), so the second agent's
//! join is refused with one line naming the job, and the first agent's workers run once,
//! undisturbed. Before, each join superseded the other's running generation: the workers were
//! started thousands of times, the restart count stayed 0 and the coordinator logged without
//! end.

use muster_tests::{Agent, Finished, SLOW, Stream, coordinator_bin};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

/// A coordinator process whose log (stderr) the test reads, on a free loopback port.
fn coordinator() -> (Agent, String) {
    let addr = format!("127.0.0.1:{}", muster_tests::free_port());
    let mut cmd = Command::new(coordinator_bin());
    cmd.args(["--listen", &addr]).env("NO_COLOR", "1");
    let c = Agent::spawn(cmd, "muster-coordinator");
    let deadline = Instant::now() + Duration::from_secs(15);
    while std::net::TcpStream::connect(&addr).is_err() {
        assert!(
            Instant::now() < deadline,
            "the coordinator does not accept connections\n{}",
            c.output()
        );
        std::thread::sleep(Duration::from_millis(10));
    }
    (c, addr)
}

/// A file the workers wait for before they exit 0 (so the test decides when the job ends).
fn release_flag(job: &str) -> PathBuf {
    let flag = std::env::temp_dir().join(format!("muster-clash-{}-{job}", std::process::id()));
    let _ = std::fs::remove_file(&flag);
    flag
}

/// `muster-agent launch --coordinator <addr> --job-id <job> --nproc-per-node 2`, as in the
/// issue; each worker prints one start line and waits for `flag`.
fn launch(addr: &str, job: &str, flag: &Path) -> Agent {
    let script = format!(
        "echo start rank=$RANK gen=$MUSTER_GENERATION restart=$TORCHELASTIC_RESTART_COUNT; \
         while [ ! -e {} ]; do sleep 0.05; done; echo done rank=$RANK",
        flag.display()
    );
    Agent::start_with_env(
        &[
            "launch",
            "--coordinator",
            addr,
            "--job-id",
            job,
            "--nproc-per-node",
            "2",
            "--max-restarts",
            "0",
            "--grace-period-ms",
            "1000",
            "--",
            "sh",
            "-c",
            &script,
        ],
        &[("NO_COLOR", "1")],
    )
}

/// The workers' start lines.
fn starts(run: &Finished) -> Vec<&String> {
    run.stdout
        .iter()
        .filter(|l| l.contains("] start "))
        .collect()
}

/// The refused agent: exit status non-zero, no worker started, and one line saying why,
/// naming the job, its node count and that it runs.
fn check_refused(run: &Finished, job: &str) {
    assert_ne!(run.code(), Some(0), "{}", run.dump());
    assert!(starts(run).is_empty(), "workers started\n{}", run.dump());
    let why: Vec<&String> = run
        .stderr
        .iter()
        .filter(|l| l.contains(&format!("job '{job}' is running")))
        .collect();
    assert_eq!(why.len(), 1, "{}", run.dump());
    assert!(
        why[0].contains("1 of at most 1 nodes") && why[0].contains("generation 1"),
        "{}",
        run.dump()
    );
    // It waited as a spare first (an agent restarted after a crash the coordinator has not
    // noticed yet gets its old node's place that way), saying so once.
    let spare: Vec<&String> = run
        .stderr
        .iter()
        .filter(|l| l.contains("as a spare"))
        .collect();
    assert_eq!(spare.len(), 1, "{}", run.dump());
    assert!(
        run.stderr.len() <= 4,
        "more than a few lines for one refusal\n{}",
        run.dump()
    );
}

/// The agent that ran the job: exit 0, each of its 2 workers started exactly once, in
/// generation 1 without a restart.
fn check_ran_once(run: &Finished) {
    assert_eq!(run.code(), Some(0), "{}", run.dump());
    let mut lines: Vec<&str> = starts(run)
        .iter()
        .map(|l| l.split("] ").nth(1).unwrap_or(""))
        .collect();
    lines.sort_unstable();
    assert_eq!(
        lines,
        [
            "start rank=0 gen=1 restart=0",
            "start rank=1 gen=1 restart=0"
        ],
        "{}",
        run.dump()
    );
}

/// The coordinator logged a few lines for the whole run, not one per superseded generation.
fn check_quiet(coordinator: &Agent) {
    let log = coordinator.output();
    let lines = log.lines().count();
    assert!(lines < 60, "the coordinator logged {lines} lines\n{log}");
    assert!(
        log.contains("join refused: the running generation is full"),
        "{log}"
    );
}

#[test]
fn a_second_agent_on_a_running_job_id_is_refused_and_the_first_runs_undisturbed() {
    let (c, addr) = coordinator();
    let flag = release_flag("clash");
    let first = launch(&addr, "clash", &flag);
    first.wait_for_lines(Stream::Stdout, 2, SLOW, |l| l.contains("] start "));
    let second = launch(&addr, "clash", &flag).finish(SLOW);
    check_refused(&second, "clash");
    std::fs::write(&flag, b"").expect("write the release flag");
    let first = first.finish(SLOW);
    let _ = std::fs::remove_file(&flag);
    check_ran_once(&first);
    check_quiet(&c);
}

#[test]
fn two_agents_started_together_on_one_job_id_run_it_once() {
    let (c, addr) = coordinator();
    let flag = release_flag("clash-together");
    let agents = [
        launch(&addr, "clash-together", &flag),
        launch(&addr, "clash-together", &flag),
    ];
    // One of them runs the job: wait for its two workers, whichever it is.
    let deadline = Instant::now() + SLOW;
    let winner = loop {
        if let Some(i) = (0..2).find(|&i| {
            agents[i]
                .try_wait_for_lines(Stream::Stdout, 2, Duration::from_millis(50), |l| {
                    l.contains("] start ")
                })
                .is_ok()
        }) {
            break i;
        }
        assert!(
            Instant::now() < deadline,
            "no agent started its workers\n{}\n{}",
            agents[0].output(),
            agents[1].output()
        );
    };
    let [a, b] = agents;
    let (winner, loser) = if winner == 0 { (a, b) } else { (b, a) };
    let loser = loser.finish(SLOW);
    check_refused(&loser, "clash-together");
    std::fs::write(&flag, b"").expect("write the release flag");
    let winner = winner.finish(SLOW);
    let _ = std::fs::remove_file(&flag);
    check_ran_once(&winner);
    check_quiet(&c);
}
