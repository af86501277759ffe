//! Helpers for muster's end-to-end tests (`tests/tests/*.rs`): finding the built binaries, and
//! running `muster-agent` (or any program, see [`Agent::spawn`]) as a real process whose
//! output can be awaited line by line.
//!
//! # Where the binaries come from
//!
//! The tests run what cargo built into the target directory of the test binary itself
//! (`target/debug/`, found from [`std::env::current_exe`], which lives in
//! `target/debug/deps/`): `muster-agent`, `muster-coordinator` and the worker SDK's examples
//! (`target/debug/examples/`). A plain `cargo test --workspace` builds them before any test
//! runs: cargo builds a package's binaries for its integration tests (`agent/tests/`) and
//! every package's examples. When one is missing (for example under
//! `cargo test -p muster-tests` on a fresh clone), [`agent_bin`], [`coordinator_bin`] and
//! [`example_bin`] build it once with `cargo build`. A binary that exists is used as it is: after changing the agent or
//! the SDK, run `cargo test --workspace` (or build them) rather than `-p muster-tests` alone.

pub mod cluster;
pub mod coordinator;
pub mod etcd;
pub mod faults;
pub mod linearizable;
pub mod peers;
pub mod replicas;
pub use peers::peers_python;
pub mod netns;
pub mod notify;
pub mod pki;
pub mod recovery;
pub mod sockets;

use std::io::{BufRead, BufReader, Read, Write};
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
    built_bin(&PATH, "muster-agent", "muster-agent")
}

/// The `muster-coordinator` binary (built if missing: `cargo test -p muster-tests` builds the
/// coordinator's library but not its binary).
pub fn coordinator_bin() -> PathBuf {
    static PATH: OnceLock<PathBuf> = OnceLock::new();
    built_bin(&PATH, "muster-coordinator", "muster-coordinator")
}

/// Binary `bin` of package `package` in the profile directory, built on the first call if
/// missing and remembered in `path`.
fn built_bin(path: &OnceLock<PathBuf>, package: &str, bin: &str) -> PathBuf {
    path.get_or_init(|| {
        let path = profile_dir().join(bin);
        if !path.exists() {
            cargo_build(&["-p", package, "--bin", bin]);
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
    let examples = workspace_root().join("worker-sdk/examples");
    // A one-file example, or one with modules (`<name>/main.rs`).
    if !examples.join(format!("{name}.rs")).exists()
        && !examples.join(name).join("main.rs").exists()
    {
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

/// Which output stream of a process.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stream {
    /// Standard output (for the agent: the workers' stdout, prefixed).
    Stdout,
    /// Standard error (for the agent: the workers' stderr, prefixed, and its own lines).
    Stderr,
}

#[derive(Debug, Default)]
struct Lines {
    stdout: Vec<String>,
    stderr: Vec<String>,
    /// The stderr lines again, each after the UTC time of day it was read at (`HH:MM:SS.mmm`,
    /// as the coordinator's log has it), to line them up with other processes' logs.
    timed: Vec<String>,
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

/// A running process (usually `muster-agent`, here or inside a [`netns::Net`] host) in a
/// process group of its own, its output collected by two reader threads so that tests can
/// await lines. Dropping it stops the process: SIGTERM, a grace period, then SIGKILL to its
/// group.
#[derive(Debug)]
pub struct Agent {
    child: Child,
    captured: Arc<Captured>,
    started: Instant,
    /// What runs, for panic messages.
    label: String,
}

/// A finished process run.
#[derive(Debug)]
pub struct Finished {
    /// The process's exit status.
    pub status: ExitStatus,
    /// Its stdout lines.
    pub stdout: Vec<String>,
    /// Its stderr lines.
    pub stderr: Vec<String>,
    /// From spawn to exit.
    pub elapsed: Duration,
}

impl Finished {
    /// The exit code (`None` if a signal ended the process).
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

/// How long the drop waits after SIGTERM before it SIGKILLs the process group.
const STOP_GRACE: Duration = Duration::from_secs(10);

impl Agent {
    /// Starts `muster-agent <args>`.
    pub fn start(args: &[&str]) -> Self {
        Self::start_with_env(args, &[])
    }

    /// Starts `muster-agent <args>` with extra environment variables.
    pub fn start_with_env(args: &[&str], env: &[(&str, &str)]) -> Self {
        let mut cmd = Command::new(agent_bin());
        cmd.args(args).envs(env.iter().copied());
        Self::spawn(cmd, format!("muster-agent {args:?}"))
    }

    /// Starts a prepared `cmd` (any program; [`netns::Net::spawn`] prepares one that runs
    /// inside a host) with stdin null, in a process group of its own, its stdout and stderr
    /// collected line by line. `label` names it in panic messages.
    pub fn spawn(mut cmd: Command, label: impl Into<String>) -> Self {
        let label = label.into();
        let mut child = cmd
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .process_group(0)
            .spawn()
            .unwrap_or_else(|e| {
                panic!(
                    "{label}: cannot start {}: {e}",
                    cmd.get_program().to_string_lossy()
                )
            });
        let captured = Arc::new(Captured::default());
        let out = child.stdout.take().expect("stdout is piped");
        let err = child.stderr.take().expect("stderr is piped");
        spawn_reader(out, Stream::Stdout, Arc::clone(&captured));
        spawn_reader(err, Stream::Stderr, Arc::clone(&captured));
        Self {
            child,
            captured,
            started: Instant::now(),
            label,
        }
    }

    /// The address of the coordinator a `launch` without `--coordinator` embeds, from the line
    /// it prints on stderr (its port is picked at random).
    pub fn embedded_coordinator(&self) -> String {
        let line = self
            .wait_for_lines(Stream::Stderr, 1, SLOW, |l| l.contains("coordinator at "))
            .remove(0);
        line.split("coordinator at ")
            .nth(1)
            .and_then(|rest| rest.split_whitespace().next())
            .unwrap_or_else(|| panic!("no address in {line:?}"))
            .to_owned()
    }

    /// The process's pid (also its process group).
    pub fn pid(&self) -> nix::unistd::Pid {
        nix::unistd::Pid::from_raw(i32::try_from(self.child.id()).expect("pids fit in i32"))
    }

    /// Sends `signal` to the process, not to its group (the agent forwards it to its workers).
    pub fn signal(&self, signal: nix::sys::signal::Signal) {
        nix::sys::signal::kill(self.pid(), signal).expect("the process can be signalled");
    }

    /// Whether the process has exited.
    pub fn exited(&mut self) -> bool {
        matches!(self.child.try_wait(), Ok(Some(_)))
    }

    /// The label and the output so far, for assertion messages.
    pub fn output(&self) -> String {
        let lines = self.captured.lock();
        format!(
            "{}\n--- stdout\n{}\n--- stderr\n{}",
            self.label,
            lines.stdout.join("\n"),
            lines.stderr.join("\n")
        )
    }

    /// The stderr lines so far, each after the UTC time of day it was read at.
    pub fn stderr_timed(&self) -> String {
        self.captured.lock().timed.join("\n")
    }

    /// The lines of `stream` so far.
    pub fn lines(&self, stream: Stream) -> Vec<String> {
        let lines = self.captured.lock();
        match stream {
            Stream::Stdout => lines.stdout.clone(),
            Stream::Stderr => lines.stderr.clone(),
        }
    }

    /// Waits until `count` lines of `stream` satisfy `matches`, and returns them; panics with
    /// the output so far after `timeout` or when the output ends first.
    pub fn wait_for_lines(
        &self,
        stream: Stream,
        count: usize,
        timeout: Duration,
        matches: impl Fn(&str) -> bool,
    ) -> Vec<String> {
        self.try_wait_for_lines(stream, count, timeout, matches)
            .unwrap_or_else(|found| {
                panic!(
                    "{count} matching {stream:?} lines did not come within {timeout:?} or before the output ended (found {found})\n{}",
                    self.output()
                )
            })
    }

    /// [`Agent::wait_for_lines`] that returns how many lines matched instead of panicking.
    pub fn try_wait_for_lines(
        &self,
        stream: Stream,
        count: usize,
        timeout: Duration,
        matches: impl Fn(&str) -> bool,
    ) -> Result<Vec<String>, usize> {
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
                return Ok(found);
            }
            let now = Instant::now();
            if now >= deadline || lines.closed == 2 {
                return Err(found.len());
            }
            lines = self
                .captured
                .changed
                .wait_timeout(lines, deadline - now)
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .0;
        }
    }

    /// Waits for the process to exit (at most `timeout` from its start) and its output to
    /// end; panics with the output so far otherwise (the drop then stops it).
    pub fn finish(self, timeout: Duration) -> Finished {
        let deadline = self.started + timeout;
        self.finish_by(deadline)
    }

    /// Waits for the process to exit by `deadline` and its output to end; panics with the
    /// output so far otherwise (the drop then stops it).
    pub fn finish_by(mut self, deadline: Instant) -> Finished {
        let status = loop {
            if let Some(status) = self
                .child
                .try_wait()
                .expect("the process can be waited for")
            {
                break status;
            }
            if Instant::now() >= deadline {
                panic!(
                    "still running after {:?}\n{}",
                    self.started.elapsed(),
                    self.output()
                );
            }
            std::thread::sleep(Duration::from_millis(5));
        };
        let elapsed = self.started.elapsed();
        // The pipes close with the process unless something it started holds them: bound it.
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
        if self.exited() {
            return;
        }
        let _ = nix::sys::signal::kill(self.pid(), nix::sys::signal::Signal::SIGTERM);
        let deadline = Instant::now() + STOP_GRACE;
        while Instant::now() < deadline {
            if self.exited() {
                return;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        // Not reaped yet, so its pid is still its group's id.
        let _ = nix::sys::signal::killpg(self.pid(), nix::sys::signal::Signal::SIGKILL);
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The UTC time of day now, `HH:MM:SS.mmm`.
fn time_of_day() -> String {
    let ms = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis())
        % 86_400_000;
    format!(
        "{:02}:{:02}:{:02}.{:03}",
        ms / 3_600_000,
        ms / 60_000 % 60,
        ms / 1000 % 60,
        ms % 1000
    )
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
                        Stream::Stderr => {
                            lines.timed.push(format!("{} {line}", time_of_day()));
                            lines.stderr.push(line);
                        }
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

/// A free loopback port below Linux's ephemeral range (32768 and up): a server restarted on
/// it can never find it taken by a client's source port (a client reconnecting to that very
/// port while the server is down can connect to itself and hold it).
pub fn free_port() -> u16 {
    use std::sync::atomic::{AtomicU32, Ordering};
    static NEXT: AtomicU32 = AtomicU32::new(0);
    let salt = std::process::id().wrapping_mul(7919);
    for _ in 0..2000 {
        let n = NEXT.fetch_add(1, Ordering::Relaxed);
        let port = 20_000 + (salt.wrapping_add(n.wrapping_mul(13)) % 12_000) as u16;
        if std::net::TcpListener::bind(("127.0.0.1", port)).is_ok() {
            return port;
        }
    }
    panic!("no free port in 20000..32000");
}

/// `--help` of a binary (`muster-coordinator`, or `muster-agent SUBCOMMAND`), cached: the tests
/// that hold documented command lines (deploy/, README.md) to the flags the binaries have.
pub fn help_of(binary: &str, subcommand: Option<&str>) -> String {
    use std::collections::HashMap;
    static CACHE: Mutex<Option<HashMap<String, String>>> = Mutex::new(None);
    let key = format!("{binary} {subcommand:?}");
    let mut cache = CACHE
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    if let Some(h) = cache.get_or_insert_with(HashMap::new).get(&key) {
        return h.clone();
    }
    let path = match binary {
        "muster-coordinator" => coordinator_bin(),
        "muster-agent" => agent_bin(),
        other => panic!("unknown binary {other}"),
    };
    let out = Command::new(path)
        .args(subcommand)
        .arg("--help")
        .output()
        .expect("the binary runs");
    assert!(out.status.success(), "{key} --help: {out:?}");
    let help = String::from_utf8(out.stdout).expect("--help is UTF-8");
    cache
        .get_or_insert_with(HashMap::new)
        .insert(key, help.clone());
    help
}

/// Whether `help` documents `flag` (as a whole word: `--listen` is not `--listen-x`).
pub fn has_flag(help: &str, flag: &str) -> bool {
    help.match_indices(flag).any(|(i, _)| {
        !help[i + flag.len()..]
            .chars()
            .next()
            .is_some_and(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_')
    })
}

/// One HTTP/1.0 request to `127.0.0.1:port` (etcd's JSON gateway, the coordinator's web
/// view); the whole answer, headers included.
pub fn http(port: u16, method: &str, path: &str, body: &str) -> std::io::Result<String> {
    let mut s = std::net::TcpStream::connect_timeout(
        &std::net::SocketAddr::from(([127, 0, 0, 1], port)),
        Duration::from_millis(200),
    )?;
    s.set_read_timeout(Some(Duration::from_secs(5)))?;
    write!(
        s,
        "{method} {path} HTTP/1.0\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    )?;
    let mut answer = String::new();
    s.read_to_string(&mut answer)?;
    Ok(answer)
}
