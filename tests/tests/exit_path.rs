//! The exit path: a launch (embedded or external coordinator, success or failure) and a
//! `submit --wait` end right after the workers do. Each worker prints the wall clock as it
//! exits; the lag to the agent's (or `submit`'s) own exit must stay under [`MAX_LAG`]. A
//! healthy lag is a few tens of milliseconds; the regression this guards against waited out a
//! fixed 2 s for a stream the agent itself owned.

use muster_tests::coordinator::Coordinator;
use muster_tests::{Agent, SLOW, Stream, agent_bin};
use std::process::Command;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// An order of magnitude above a healthy lag on a loaded 2-core machine, half the old wait.
const MAX_LAG: Duration = Duration::from_millis(1000);

/// The workers: sleep a little (so the lag is not hidden in start-up), print the time in
/// nanoseconds, exit with `code`.
fn script(code: u32) -> String {
    format!("sleep 0.2; echo stamp $(date +%s%N); exit {code}")
}

fn now_ns() -> u128 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .expect("after 1970")
        .as_nanos()
}

/// The latest `stamp NS` among `lines`.
fn last_stamp<'a>(lines: impl IntoIterator<Item = &'a String>) -> u128 {
    lines
        .into_iter()
        .filter_map(|l| l.split("stamp ").nth(1))
        .filter_map(|ns| ns.trim().parse::<u128>().ok())
        .max()
        .expect("a worker printed its stamp")
}

fn assert_prompt(what: &str, exited_ns: u128, stamp: u128, dump: &str) {
    let lag =
        Duration::from_nanos(u64::try_from(exited_ns.saturating_sub(stamp)).unwrap_or(u64::MAX));
    assert!(
        lag < MAX_LAG,
        "{what}: exited {lag:?} after its last worker (at most {MAX_LAG:?})\n{dump}"
    );
}

fn launch_and_time(what: &str, flags: &[&str], code: u32, want: i32) {
    let script = script(code);
    let mut args = vec!["launch", "--nproc-per-node", "2"];
    args.extend_from_slice(flags);
    args.extend_from_slice(&["--", "sh", "-c", &script]);
    let run = Agent::start(&args).finish(SLOW);
    let exited = now_ns();
    assert_eq!(run.code(), Some(want), "{what}: {}", run.dump());
    assert_prompt(what, exited, last_stamp(&run.stdout), &run.dump());
}

#[test]
fn a_launch_with_its_own_coordinator_exits_with_its_workers() {
    launch_and_time("embedded, success", &[], 0, 0);
    launch_and_time("embedded, failure", &[], 3, 1);
}

#[test]
fn a_launch_on_an_external_coordinator_exits_with_its_workers() {
    let c = Coordinator::start(&[]);
    for (job, code, want) in [("exit-ok", 0, 0), ("exit-failed", 3, 1)] {
        launch_and_time(
            &format!("external, job {job}"),
            &["--coordinator", &c.addr, "--job-id", job],
            code,
            want,
        );
    }
}

#[test]
fn submit_wait_exits_with_the_job() {
    let c = Coordinator::start(&[]);
    let serve = Agent::start(&["serve", "--coordinator", &c.addr, "--agent-id", "exit-a"]);
    serve.wait_for_lines(Stream::Stderr, 1, SLOW, |l| l.contains("serving as"));
    let script = script(0);
    let out = Command::new(agent_bin())
        .args(["submit", "--coordinator", &c.addr, "--job-id", "exit-sub"])
        .args(["--nproc-per-node", "2", "--wait", "--", "sh", "-c", &script])
        .output()
        .expect("muster-agent runs");
    let exited = now_ns();
    let text = format!(
        "{}\n{}{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(out.status.success(), "{text}");
    let stamps = serve.wait_for_lines(Stream::Stdout, 2, SLOW, |l| l.contains("stamp "));
    assert_prompt("submit --wait", exited, last_stamp(&stamps), &text);
}
