//! The `muster-coordinator` binary: bad configuration and bad flags exit 64 with one line;
//! SIGTERM stops it cleanly.
#![allow(clippy::unwrap_used, missing_docs)]

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

const BIN: &str = env!("CARGO_BIN_EXE_muster-coordinator");

fn check_rejected(args: &[&str], env: &[(&str, &str)], needle: &str) {
    let out = Command::new(BIN)
        .args(args)
        .envs(env.iter().copied())
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(64), "{args:?}: {out:?}");
    let stderr = String::from_utf8(out.stderr).unwrap();
    assert_eq!(
        stderr.trim_end().lines().count(),
        1,
        "not one line: {stderr}"
    );
    assert!(stderr.contains(needle), "{stderr} should name {needle}");
}

#[test]
fn bad_configuration_is_one_line_and_exit_64() {
    let dir = std::env::temp_dir().join(format!("muster-coord-test-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let unknown = dir.join("unknown.toml");
    std::fs::write(&unknown, "listen = \"127.0.0.1:0\"\nbogus = 1\n").unwrap();
    let bad_value = dir.join("bad.toml");
    std::fs::write(&bad_value, "heartbeat_timeout_ms = 5\n").unwrap();
    check_rejected(&["--config", unknown.to_str().unwrap()], &[], "bogus");
    check_rejected(
        &["--config", bad_value.to_str().unwrap()],
        &[],
        "heartbeat_timeout_ms",
    );
    check_rejected(
        &["--config", "/nonexistent/muster.toml"],
        &[],
        "/nonexistent/muster.toml",
    );
    check_rejected(
        &[],
        &[("MUSTER_COORDINATOR_LISTEN", "nowhere")],
        "MUSTER_COORDINATOR_LISTEN",
    );
    check_rejected(
        &[],
        &[("MUSTER_COORDINATOR_METRICS_ADDR", "nowhere")],
        "MUSTER_COORDINATOR_METRICS_ADDR",
    );
    check_rejected(
        &[
            "--listen",
            "127.0.0.1:29999",
            "--metrics-addr",
            "127.0.0.1:29999",
        ],
        &[],
        "metrics_addr",
    );
    check_rejected(
        &[],
        &[("MUSTER_COORDINATOR_WEB_ADDR", "nowhere")],
        "MUSTER_COORDINATOR_WEB_ADDR",
    );
    check_rejected(
        &[
            "--metrics-addr",
            "127.0.0.1:29998",
            "--web-addr",
            "127.0.0.1:29998",
        ],
        &[],
        "web_addr",
    );
    // Bad flags too, as the README promises (issue 19): one line naming the flag, not clap's
    // three-line usage block and status 2.
    check_rejected(&["--listen", "not-an-address"], &[], "--listen");
    check_rejected(&["--bogus"], &[], "unexpected argument '--bogus'");
    check_rejected(&["--store", "redis"], &[], "--store");
    check_rejected(&["--max-jobs", "lots"], &[], "--max-jobs");
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn help_and_version_still_exit_0() {
    for flag in ["--help", "--version"] {
        let out = Command::new(BIN).arg(flag).output().unwrap();
        assert_eq!(out.status.code(), Some(0), "{flag}: {out:?}");
        assert!(!out.stdout.is_empty(), "{flag}: {out:?}");
    }
}

#[test]
fn sigterm_stops_the_daemon_cleanly() {
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let mut child = Command::new(BIN)
        .args(["--listen", &format!("127.0.0.1:{port}")])
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(child.stderr.take().unwrap()).lines();
    let serving = lines
        .by_ref()
        .map_while(Result::ok)
        .any(|l| l.contains("coordinator serving"));
    assert!(serving, "no 'coordinator serving' log line");
    let t = Instant::now();
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(child.id() as i32),
        nix::sys::signal::Signal::SIGTERM,
    )
    .unwrap();
    let status = child.wait().unwrap();
    assert!(status.success(), "{status:?}");
    assert!(t.elapsed() < Duration::from_secs(5));
    assert!(lines.map_while(Result::ok).any(|l| l.contains("SIGTERM")));
}
