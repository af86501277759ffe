//! The built `muster-agent launch --metrics-addr`: scraped over plain TCP while its workers
//! run, it shows them by state and counts a failed generation (its cause) and the restart
//! after it; a taken port fails the launch with one line.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::io::{Read as _, Write as _};
use std::net::{TcpListener, TcpStream};
use std::path::PathBuf;
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

/// How long a launch may take to reach the state a test waits for.
const PATIENCE: Duration = Duration::from_secs(30);

/// A port free on 127.0.0.1 now.
fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("a free port")
        .port()
}

/// A running agent, killed on drop unless it was waited for.
struct Launch {
    child: Option<Child>,
    metrics: String,
    done: PathBuf,
}

impl Launch {
    /// `muster-agent launch --metrics-addr 127.0.0.1:<free> --nproc-per-node N <flags> -- sh
    /// -c SCRIPT`, with `$DONE` naming a file the test creates when the workers may end.
    fn start(name: &str, n: u32, flags: &[&str], script: &str) -> Self {
        let metrics = format!("127.0.0.1:{}", free_port());
        let done =
            std::env::temp_dir().join(format!("muster-metrics-{}-{name}", std::process::id()));
        let _ = std::fs::remove_file(&done);
        let n = n.to_string();
        let child = Command::new(env!("CARGO_BIN_EXE_muster-agent"))
            .args(["launch", "--metrics-addr", &metrics, "--nproc-per-node", &n])
            .args(flags)
            .args(["--", "sh", "-c", script])
            .env("DONE", &done)
            .env_remove("CUDA_VISIBLE_DEVICES")
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("muster-agent starts");
        Self {
            child: Some(child),
            metrics,
            done,
        }
    }

    /// Scrapes until `ready` holds for the text (or the patience runs out: then panics with
    /// the last text and the agent's output).
    fn scrape_until(&mut self, ready: impl Fn(&str) -> bool) -> String {
        let deadline = Instant::now() + PATIENCE;
        let mut last = String::new();
        while Instant::now() < deadline {
            if let Some(text) = scrape(&self.metrics) {
                if ready(&text) {
                    return text;
                }
                last = text;
            }
            let exited = self
                .child
                .as_mut()
                .and_then(|c| c.try_wait().ok().flatten());
            if exited.is_some() {
                break;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        let out = self.finish();
        panic!(
            "the metrics never showed what was expected; last scrape:\n{last}\nagent: {:?}\n{}{}",
            out.status,
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }

    /// Lets the workers end and waits for the agent.
    fn finish(&mut self) -> Output {
        std::fs::write(&self.done, b"").unwrap();
        let mut child = self.child.take().expect("not waited for yet");
        let deadline = Instant::now() + PATIENCE;
        while child.try_wait().unwrap().is_none() && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(20));
        }
        let _ = child.kill();
        child.wait_with_output().unwrap()
    }
}

impl Drop for Launch {
    fn drop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
        let _ = std::fs::remove_file(&self.done);
    }
}

/// `GET /metrics` over a plain TCP connection; the body, or `None` if the endpoint does not
/// answer (yet).
fn scrape(addr: &str) -> Option<String> {
    let mut stream = TcpStream::connect(addr).ok()?;
    stream.set_read_timeout(Some(Duration::from_secs(5))).ok()?;
    stream
        .write_all(b"GET /metrics HTTP/1.1\r\nHost: agent\r\nConnection: close\r\n\r\n")
        .ok()?;
    let mut response = String::new();
    stream.read_to_string(&mut response).ok()?;
    let (head, body) = response.split_once("\r\n\r\n")?;
    assert!(head.starts_with("HTTP/1.1 200"), "{head}");
    assert!(
        head.to_ascii_lowercase()
            .contains("content-type: application/openmetrics-text"),
        "{head}"
    );
    Some(body.to_owned())
}

/// The value of the series `series` (`name{labels}`) in `text`, if it is there.
fn value(text: &str, series: &str) -> Option<f64> {
    text.lines()
        .find_map(|l| l.strip_prefix(series)?.strip_prefix(' '))
        .and_then(|v| v.parse().ok())
}

/// Workers wait for `$DONE` and exit 0.
const WAIT_FOR_DONE: &str = "while [ ! -e \"$DONE\" ]; do sleep 0.05; done";

#[test]
fn running_workers_are_scraped_while_they_run() {
    let mut launch = Launch::start("running", 2, &[], WAIT_FOR_DONE);
    let text =
        launch.scrape_until(|t| value(t, "muster_agent_workers{state=\"running\"}") == Some(2.0));
    for series in [
        "muster_agent_workers{state=\"starting\"}",
        "muster_agent_workers{state=\"exited\"}",
        "muster_agent_workers{state=\"failed\"}",
        "muster_agent_workers{state=\"stopped\"}",
        "muster_agent_restarts_total",
        "muster_agent_worker_failures_total{cause=\"exit_code\"}",
        "muster_agent_worker_failures_total{cause=\"signal\"}",
        "muster_agent_worker_failures_total{cause=\"lost\"}",
        "muster_agent_worker_failures_total{cause=\"spawn\"}",
        "muster_agent_coordinator_failovers_total{stream=\"watch\"}",
        "muster_agent_coordinator_failovers_total{stream=\"relay\"}",
        "muster_agent_relay_barrier_seconds_count{scope=\"node\"}",
        "muster_agent_relay_barrier_seconds_count{scope=\"global\"}",
    ] {
        assert_eq!(value(&text, series), Some(0.0), "{series} in\n{text}");
    }
    assert!(
        text.contains("# TYPE muster_agent_relay_barrier_seconds histogram"),
        "{text}"
    );
    assert!(text.ends_with("# EOF\n"), "{text}");
    // Anything but /metrics is not found.
    let mut stream = TcpStream::connect(&launch.metrics).unwrap();
    stream
        .write_all(b"GET / HTTP/1.1\r\nHost: agent\r\nConnection: close\r\n\r\n")
        .unwrap();
    let mut response = String::new();
    stream.read_to_string(&mut response).unwrap();
    assert!(response.starts_with("HTTP/1.1 404"), "{response}");
    let out = launch.finish();
    assert_eq!(
        out.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

#[test]
fn a_worker_exiting_3_counts_as_a_failure_and_the_generation_restarts() {
    // Rank 1 exits 3 in the first generation; the second one runs until the test is done.
    let script = format!(
        "if [ \"$RANK\" = 1 ] && [ \"$TORCHELASTIC_RESTART_COUNT\" = 0 ]; then exit 3; fi; {WAIT_FOR_DONE}"
    );
    let mut launch = Launch::start("fails", 2, &["--max-restarts", "1"], &script);
    let text = launch.scrape_until(|t| {
        value(t, "muster_agent_restarts_total") == Some(1.0)
            && value(t, "muster_agent_workers{state=\"running\"}") == Some(2.0)
    });
    let failures = |cause: &str| {
        value(
            &text,
            &format!("muster_agent_worker_failures_total{{cause=\"{cause}\"}}"),
        )
    };
    assert_eq!(failures("exit_code"), Some(1.0), "{text}");
    assert_eq!(failures("signal"), Some(0.0), "{text}");
    assert_eq!(failures("lost"), Some(0.0), "{text}");
    // The failed generation's workers are gone from the gauge; the new one's run.
    for state in ["starting", "exited", "failed", "stopped"] {
        assert_eq!(
            value(&text, &format!("muster_agent_workers{{state=\"{state}\"}}")),
            Some(0.0),
            "{state} in\n{text}"
        );
    }
    let out = launch.finish();
    assert_eq!(
        out.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

#[test]
fn a_taken_metrics_port_fails_the_launch_with_one_line() {
    let taken = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = taken.local_addr().unwrap().to_string();
    let out = Command::new(env!("CARGO_BIN_EXE_muster-agent"))
        .args(["launch", "--metrics-addr", &addr, "--", "true"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.starts_with(&format!(
            "muster-agent: cannot listen on --metrics-addr {addr}: "
        )) && stderr.lines().count() == 1,
        "{stderr}"
    );
}
