//! Helpers for muster's end-to-end tests (`tests/tests/*.rs`): finding the built binaries, and
//! running `muster-agent` as a real process whose output can be awaited line by line.
//!
//! # Where the binaries come from
//!
//! The tests run what cargo built into the target directory of the test binary itself
//! (`target/debug/`, found from [`std::env::current_exe`], which lives in
//! `target/debug/deps/`): `muster-agent` and the worker SDK's examples
//! (`target/debug/examples/`). A plain `cargo test --workspace` builds both before any test
//! runs: cargo builds a package's binaries for its integration tests (`agent/tests/`) and
//! every package's examples. When one is missing (for example under
//! `cargo test -p muster-tests` on a fresh clone), [`agent_bin`] and [`example_bin`] build it
//! once with `cargo build`. A binary that exists is used as it is: after changing the agent or
//! the SDK, run `cargo test --workspace` (or build them) rather than `-p muster-tests` alone.

pub mod coordinator;
pub mod netns;

use std::io::{BufRead, BufReader, Read};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::{Arc, Condvar, Mutex, OnceLock};
use std::time::{Duration, Instant};

/// The workspace root (the parent of this crate's directory).
pub fn workspace_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .map_or_else(|| PathBuf::from("."), Path::to_path_buf)
}

/// The profile directory the test binary was built into (`target/debug`).
pub fn profile_dir() -> PathBuf {
    let exe = std::env::current_exe().expect("the test binary knows its own path");
    let deps = exe.parent().expect("the test binary lives in a directory");
    let dir = if deps.file_name().is_some_and(|n| n == "deps") {
        deps.parent().unwrap_or(deps)
    } else {
        deps
    };
    dir.to_path_buf()
}

/// Runs `cargo build <args>` in the workspace, once per distinct `args` per test process.
fn cargo_build(args: &[&str]) {
    static BUILT: Mutex<Vec<String>> = Mutex::new(Vec::new());
    let key = args.join(" ");
    let mut built = BUILT
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    if built.contains(&key) {
        return;
    }
    eprintln!("muster-tests: building with `cargo build {key}`");
    let status = Command::new(env!("CARGO"))
        .arg("build")
        .args(args)
        .current_dir(workspace_root())
        .status()
        .expect("cargo runs");
    assert!(status.success(), "`cargo build {key}` failed: {status}");
    built.push(key);
}

/// The `muster-agent` binary (built if missing).
pub fn agent_bin() -> PathBuf {
    static PATH: OnceLock<PathBuf> = OnceLock::new();
    PATH.get_or_init(|| {
        let path = profile_dir().join("muster-agent");
        if !path.exists() {
            cargo_build(&["-p", "muster-agent", "--bin", "muster-agent"]);
        }
        assert!(
            path.exists(),
            "{} is missing after building it",
            path.display()
        );
        path
    })
    .clone()
}

/// The worker SDK example `name` (built if missing), or `None` when the SDK has no such
/// example (its source is absent).
pub fn example_bin(name: &str) -> Option<PathBuf> {
    let source = workspace_root()
        .join("worker-sdk/examples")
        .join(format!("{name}.rs"));
    if !source.exists() {
        return None;
    }
    let path = profile_dir().join("examples").join(name);
    if !path.exists() {
        cargo_build(&["-p", "muster", "--examples"]);
    }
    assert!(
        path.exists(),
        "{} is missing after building it",
        path.display()
    );
    Some(path)
}

/// Which output stream of the agent.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stream {
    /// Standard output (the workers' stdout, prefixed).
    Stdout,
    /// Standard error (the workers' stderr, prefixed, and the agent's own lines).
    Stderr,
}

#[derive(Debug, Default)]
struct Lines {
    stdout: Vec<String>,
    stderr: Vec<String>,
    /// Streams that reached end of file.
    closed: u8,
}

#[derive(Debug, Default)]
struct Captured {
    lines: Mutex<Lines>,
    changed: Condvar,
}

impl Captured {
    fn lock(&self) -> std::sync::MutexGuard<'_, Lines> {
        self.lines
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

/// A running `muster-agent` in a process group of its own, its output collected by two reader
/// threads. Dropping it stops the agent (SIGTERM, then SIGKILL).
#[derive(Debug)]
pub struct Agent {
    child: Child,
    captured: Arc<Captured>,
    started: Instant,
    args: Vec<String>,
}

/// A finished agent run.
#[derive(Debug)]
pub struct Finished {
    /// The agent's exit status.
    pub status: ExitStatus,
    /// Its stdout lines.
    pub stdout: Vec<String>,
    /// Its stderr lines.
    pub stderr: Vec<String>,
    /// From spawn to exit.
    pub elapsed: Duration,
}

impl Finished {
    /// The exit code (`None` if a signal ended the agent).
    pub fn code(&self) -> Option<i32> {
        self.status.code()
    }

    /// Both streams, for assertion messages.
    pub fn dump(&self) -> String {
        format!(
            "status {}, {:?}\n--- stdout\n{}\n--- stderr\n{}",
            self.status,
            self.elapsed,
            self.stdout.join("\n"),
            self.stderr.join("\n")
        )
    }

    /// The stdout lines of `rank` without their `[rank R] ` prefix.
    pub fn rank_stdout(&self, rank: u32) -> Vec<&str> {
        let prefix = format!("[rank {rank}] ");
        self.stdout
            .iter()
            .filter_map(|l| l.strip_prefix(&prefix))
            .collect()
    }
}

impl Agent {
    /// Starts `muster-agent <args>`.
    pub fn start(args: &[&str]) -> Self {
        Self::start_with_env(args, &[])
    }

    /// Starts `muster-agent <args>` with extra environment variables.
    pub fn start_with_env(args: &[&str], env: &[(&str, &str)]) -> Self {
        let mut child = Command::new(agent_bin())
            .args(args)
            .envs(env.iter().copied())
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .process_group(0)
            .spawn()
            .expect("muster-agent starts");
        let captured = Arc::new(Captured::default());
        let out = child.stdout.take().expect("stdout is piped");
        let err = child.stderr.take().expect("stderr is piped");
        spawn_reader(out, Stream::Stdout, Arc::clone(&captured));
        spawn_reader(err, Stream::Stderr, Arc::clone(&captured));
        Self {
            child,
            captured,
            started: Instant::now(),
            args: args.iter().map(|s| (*s).to_owned()).collect(),
        }
    }

    /// The agent's pid.
    pub fn pid(&self) -> nix::unistd::Pid {
        nix::unistd::Pid::from_raw(i32::try_from(self.child.id()).expect("pids fit in i32"))
    }

    /// Sends `signal` to the agent (not to its group: the agent forwards it).
    pub fn signal(&self, signal: nix::sys::signal::Signal) {
        nix::sys::signal::kill(self.pid(), signal).expect("the agent can be signalled");
    }

    /// Waits until `count` lines of `stream` satisfy `matches`, and returns them; panics with
    /// the output so far after `timeout`.
    pub fn wait_for_lines(
        &self,
        stream: Stream,
        count: usize,
        timeout: Duration,
        matches: impl Fn(&str) -> bool,
    ) -> Vec<String> {
        let deadline = Instant::now() + timeout;
        let mut lines = self.captured.lock();
        loop {
            let found: Vec<String> = match stream {
                Stream::Stdout => &lines.stdout,
                Stream::Stderr => &lines.stderr,
            }
            .iter()
            .filter(|l| matches(l))
            .cloned()
            .collect();
            if found.len() >= count {
                return found;
            }
            let now = Instant::now();
            if now >= deadline || lines.closed == 2 {
                panic!(
                    "muster-agent {:?}: {count} matching {stream:?} lines did not come within {timeout:?} (found {})\n--- stdout\n{}\n--- stderr\n{}",
                    self.args,
                    found.len(),
                    lines.stdout.join("\n"),
                    lines.stderr.join("\n")
                );
            }
            lines = self
                .captured
                .changed
                .wait_timeout(lines, deadline - now)
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .0;
        }
    }

    /// Waits for the agent to exit and its output to end; panics with the output so far after
    /// `timeout` (the agent is then killed by the drop).
    pub fn finish(mut self, timeout: Duration) -> Finished {
        let deadline = self.started + timeout;
        let status = loop {
            if let Some(status) = self.child.try_wait().expect("the agent can be waited for") {
                break status;
            }
            if Instant::now() >= deadline {
                let lines = self.captured.lock();
                panic!(
                    "muster-agent {:?} still running after {timeout:?}\n--- stdout\n{}\n--- stderr\n{}",
                    self.args,
                    lines.stdout.join("\n"),
                    lines.stderr.join("\n")
                );
            }
            std::thread::sleep(Duration::from_millis(5));
        };
        let elapsed = self.started.elapsed();
        // The pipes close with the agent; bound the wait anyway.
        let output_deadline = Instant::now() + Duration::from_secs(10);
        let mut lines = self.captured.lock();
        while lines.closed < 2 && Instant::now() < output_deadline {
            lines = self
                .captured
                .changed
                .wait_timeout(lines, Duration::from_millis(100))
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .0;
        }
        Finished {
            status,
            stdout: std::mem::take(&mut lines.stdout),
            stderr: std::mem::take(&mut lines.stderr),
            elapsed,
        }
    }
}

impl Drop for Agent {
    fn drop(&mut self) {
        if matches!(self.child.try_wait(), Ok(Some(_))) {
            return;
        }
        let _ = nix::sys::signal::kill(self.pid(), nix::sys::signal::Signal::SIGTERM);
        let deadline = Instant::now() + Duration::from_secs(10);
        while Instant::now() < deadline {
            if matches!(self.child.try_wait(), Ok(Some(_))) {
                return;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn spawn_reader(src: impl Read + Send + 'static, stream: Stream, captured: Arc<Captured>) {
    std::thread::spawn(move || {
        let mut reader = BufReader::new(src);
        let mut buf = Vec::new();
        loop {
            buf.clear();
            match reader.read_until(b'\n', &mut buf) {
                Ok(0) | Err(_) => break,
                Ok(_) => {
                    let line = String::from_utf8_lossy(&buf)
                        .trim_end_matches('\n')
                        .to_owned();
                    let mut lines = captured.lock();
                    match stream {
                        Stream::Stdout => lines.stdout.push(line),
                        Stream::Stderr => lines.stderr.push(line),
                    }
                    captured.changed.notify_all();
                }
            }
        }
        captured.lock().closed += 1;
        captured.changed.notify_all();
    });
}

/// Live (not zombie) processes of process group `pgid`, from `/proc`.
pub fn group_members(pgid: i32) -> Vec<i32> {
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    entries
        .filter_map(|e| e.ok()?.file_name().to_str()?.parse::<i32>().ok())
        .filter(|pid| {
            // /proc/<pid>/stat: "pid (comm) state ppid pgrp ..."; comm may hold spaces.
            let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
                return false;
            };
            let Some((_, rest)) = stat.rsplit_once(')') else {
                return false;
            };
            let fields: Vec<&str> = rest.split_whitespace().collect();
            fields
                .first()
                .is_some_and(|state| *state != "Z" && *state != "X")
                && fields.get(2).and_then(|g| g.parse::<i32>().ok()) == Some(pgid)
        })
        .collect()
}

/// Whether process group `pgid` still has live members 5 s from now (a SIGKILLed process
/// takes a moment to die, and an orphan a moment to be reaped).
pub fn group_alive(pgid: i32) -> bool {
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        if group_members(pgid).is_empty() {
            return false;
        }
        if Instant::now() >= deadline {
            return true;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// Generous limit for things that take milliseconds on an idle machine: the tests run on
/// loaded 2-core CI machines, in parallel.
pub const SLOW: Duration = Duration::from_secs(30);
