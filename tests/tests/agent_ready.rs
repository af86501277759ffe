//! `muster-agent serve` under systemd (`Type=notify`, a fake `$NOTIFY_SOCKET`): READY=1 comes
//! once the coordinator has accepted the agent's registration, not when the process starts.
//! With no coordinator listening the agent says nothing; once one is up, READY=1 (naming it)
//! arrives, then the watchdog pings, and SIGTERM brings STOPPING=1.
#![allow(clippy::unwrap_used, missing_docs)]

use muster_tests::notify::NotifySocket;
use muster_tests::{Agent, Stream, coordinator_bin, free_port};
use nix::sys::signal::Signal;
use std::process::Command;
use std::time::{Duration, Instant};

fn has_line(messages: &[String], want: &str) -> bool {
    messages.iter().any(|m| m.lines().any(|l| l == want))
}

#[test]
fn agent_serve_is_ready_only_once_registered() {
    let notify = NotifySocket::bind("agent-ready");
    // Nothing listens here until the coordinator below starts.
    let addr = format!("127.0.0.1:{}", free_port());
    let socket = notify.path().to_str().unwrap().to_owned();
    let mut agent = Agent::start_with_env(
        &[
            "serve",
            "--coordinator",
            &addr,
            "--agent-id",
            "ready-test",
            "--advertise-addr",
            "127.0.0.1",
        ],
        // Watchdog pings every 150 ms once they start.
        &[("NOTIFY_SOCKET", &socket), ("WATCHDOG_USEC", "300000")],
    );

    let early = notify.receive_for(Duration::from_millis(1200));
    assert!(
        !has_line(&early, "READY=1"),
        "READY=1 with no coordinator reachable: {early:?}\n{}",
        agent.output()
    );
    assert!(
        !has_line(&early, "WATCHDOG=1"),
        "watchdog pings before READY=1: {early:?}"
    );
    assert!(
        !agent.exited(),
        "the agent gave up without a coordinator\n{}",
        agent.output()
    );

    let mut cmd = Command::new(coordinator_bin());
    cmd.args(["--listen", &addr]);
    let _coordinator = Agent::spawn(cmd, "muster-coordinator");
    let t = Instant::now();
    let got = notify.receive_until("READY=1", Duration::from_secs(20));
    eprintln!(
        "READY=1 {:?} after the coordinator started; received {got:?}",
        t.elapsed()
    );
    assert!(
        got.last()
            .unwrap()
            .contains(&format!("STATUS=serving jobs for coordinator {addr}")),
        "{got:?}"
    );
    // Registered by then: the agent says so on stderr just before READY=1.
    agent.wait_for_lines(Stream::Stderr, 1, Duration::from_secs(5), |l| {
        l.starts_with("muster-agent: serving as ready-test")
    });
    for _ in 0..3 {
        notify.receive_until("WATCHDOG=1", Duration::from_secs(2));
    }

    agent.signal(Signal::SIGTERM);
    let stopping = notify.receive_until("STOPPING=1", Duration::from_secs(10));
    assert!(
        stopping.last().unwrap().contains("exit status 0"),
        "{stopping:?}"
    );
    assert!(
        !has_line(&stopping, "READY=1"),
        "READY=1 twice: {stopping:?}"
    );
    let finished = agent.finish(Duration::from_secs(30));
    assert!(finished.status.success(), "{:?}", finished.status);
}
