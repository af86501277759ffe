//! One worker process: spawned in a process group of its own with its environment, its output
//! pumped line by line to the agent's stdout and stderr under a `[rank R] ` prefix, signalled
//! as a group, and killed (the whole group) if the agent drops it while it still runs.

use crate::program::Program;
use nix::sys::signal::{Signal, killpg};
use nix::unistd::Pid;
use std::collections::VecDeque;
use std::io::Write;
use std::os::unix::process::ExitStatusExt;
use std::process::{ExitStatus, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::io::{AsyncBufReadExt, AsyncRead, BufReader};
use tokio::process::{Child, Command};
use tokio::task::JoinHandle;

/// How many of a worker's last stderr lines are kept for failure reports.
pub const STDERR_TAIL_LINES: usize = 20;
/// Longest stderr line kept in the tail (longer ones are cut).
const TAIL_LINE_CHARS: usize = 1000;
/// After a worker exits, how long its output may keep flowing (from processes it left
/// behind that hold its pipes) before the rest of its group is killed and the output dropped.
pub const OUTPUT_DRAIN: Duration = Duration::from_secs(1);

/// A running worker as the supervisor sees it: enough to signal its process group. Dropping
/// it SIGKILLs the group unless the worker has already been reaped.
#[derive(Debug)]
pub struct Worker {
    /// Global rank.
    pub rank: u32,
    /// Rank within the node.
    pub local_rank: u32,
    /// The worker's pid, which is also its process group id.
    pub pid: Pid,
    reaped: Arc<AtomicBool>,
}

/// How a worker ended.
#[derive(Debug)]
pub struct Exit {
    /// Global rank.
    pub rank: u32,
    /// Rank within the node.
    pub local_rank: u32,
    /// The wait status (an error only if waiting itself failed).
    pub status: std::io::Result<ExitStatus>,
    /// The last lines it wrote to stderr (at most [`STDERR_TAIL_LINES`]).
    pub stderr_tail: Vec<String>,
}

impl Exit {
    /// Whether the worker exited with status 0.
    pub fn success(&self) -> bool {
        matches!(&self.status, Ok(s) if s.success())
    }

    /// "exited with status 3", "killed by signal 9 (SIGKILL)".
    pub fn reason(&self) -> String {
        match &self.status {
            Ok(s) => describe(*s),
            Err(e) => format!("could not be waited for: {e}"),
        }
    }

    /// The exit code, when the worker exited.
    pub fn code(&self) -> Option<i32> {
        self.status.as_ref().ok().and_then(ExitStatus::code)
    }

    /// The signal number, when a signal ended the worker.
    pub fn signal(&self) -> Option<i32> {
        self.status.as_ref().ok().and_then(ExitStatus::signal)
    }
}

/// "exited with status 3" or "killed by signal 9 (SIGKILL)".
pub fn describe(status: ExitStatus) -> String {
    match (status.code(), status.signal()) {
        (Some(code), _) => format!("exited with status {code}"),
        (None, Some(sig)) => format!("killed by signal {sig} ({})", signal_name(sig)),
        (None, None) => format!("ended with wait status {}", status.into_raw()),
    }
}

/// `SIGKILL` for 9; `signal N` for numbers nix does not know (real-time signals).
pub fn signal_name(sig: i32) -> String {
    Signal::try_from(sig).map_or_else(|_| format!("signal {sig}"), |s| s.as_str().to_owned())
}

/// Where a pumped stream goes.
#[derive(Debug, Clone, Copy)]
enum Sink {
    Stdout,
    Stderr,
}

type Tail = Arc<Mutex<VecDeque<String>>>;

impl Worker {
    /// Spawns one worker: its own process group, stdin from /dev/null, stdout and stderr piped
    /// into pump tasks. Returns the handle and a future that resolves when the worker has
    /// exited and its output has been written out (bounded by [`OUTPUT_DRAIN`]); the future
    /// is `'static` so that the supervisor can poll many at once.
    pub fn spawn(
        program: &Program,
        env: &[(&'static str, String)],
        rank: u32,
        local_rank: u32,
    ) -> std::io::Result<(Self, impl Future<Output = Exit> + Send + 'static)> {
        let mut child = Command::new(&program.path)
            .arg0(&program.name)
            .args(&program.args)
            .envs(env.iter().map(|(k, v)| (k, v)))
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .process_group(0)
            .kill_on_drop(true)
            .spawn()?;
        let raw_pid = child
            .id()
            .and_then(|p| i32::try_from(p).ok())
            .ok_or_else(|| std::io::Error::other("the spawned worker has no pid"))?;
        let pid = Pid::from_raw(raw_pid);
        let prefix: Arc<[u8]> = format!("[rank {rank}] ").into_bytes().into();
        let tail: Tail = Arc::new(Mutex::new(VecDeque::with_capacity(STDERR_TAIL_LINES)));
        let mut pumps = Vec::with_capacity(2);
        if let Some(out) = child.stdout.take() {
            pumps.push(tokio::spawn(pump(
                out,
                Arc::clone(&prefix),
                Sink::Stdout,
                None,
            )));
        }
        if let Some(err) = child.stderr.take() {
            pumps.push(tokio::spawn(pump(
                err,
                prefix,
                Sink::Stderr,
                Some(Arc::clone(&tail)),
            )));
        }
        let reaped = Arc::new(AtomicBool::new(false));
        let worker = Self {
            rank,
            local_rank,
            pid,
            reaped: Arc::clone(&reaped),
        };
        let exit = wait(child, pid, reaped, pumps, tail, rank, local_rank);
        Ok((worker, exit))
    }

    /// Whether the worker has exited (and been reaped).
    pub fn exited(&self) -> bool {
        self.reaped.load(Ordering::Acquire)
    }

    /// Sends `signal` to the worker's process group, unless the worker has been reaped (its
    /// pid could then belong to someone else). Best effort: a group that is already gone is
    /// not an error.
    pub fn signal(&self, signal: Signal) {
        if self.exited() {
            return;
        }
        if let Err(e) = killpg(self.pid, signal) {
            tracing::debug!(rank = self.rank, %e, ?signal, "killpg failed");
        }
    }
}

impl Drop for Worker {
    fn drop(&mut self) {
        self.signal(Signal::SIGKILL);
    }
}

/// Waits for the child, marks it reaped, then lets its output drain (bounded).
async fn wait(
    mut child: Child,
    pid: Pid,
    reaped: Arc<AtomicBool>,
    pumps: Vec<JoinHandle<()>>,
    tail: Tail,
    rank: u32,
    local_rank: u32,
) -> Exit {
    let status = child.wait().await;
    reaped.store(true, Ordering::Release);
    let mut pumps = pumps;
    let drain = async {
        for p in &mut pumps {
            // A pump task only ends by returning; a join error means it panicked, and its
            // output is lost either way.
            let _ = p.await;
        }
    };
    if tokio::time::timeout(OUTPUT_DRAIN, drain).await.is_err() {
        // Something the worker started still holds its output open: most likely a member
        // of its process group (which cannot have been reused while it has members).
        eprintln!(
            "muster-agent: rank {rank} exited but its output is still open after {} ms; killing what is left of its process group",
            OUTPUT_DRAIN.as_millis()
        );
        let _ = killpg(pid, Signal::SIGKILL);
        for p in &pumps {
            p.abort();
        }
    }
    let stderr_tail = tail
        .lock()
        .map(|t| t.iter().cloned().collect())
        .unwrap_or_default();
    Exit {
        rank,
        local_rank,
        status,
        stderr_tail,
    }
}

/// Copies `src` line by line to `sink`, each line prefixed and written whole under the
/// stream's lock; lines already buffered are batched into one write. Keeps the last lines in
/// `tail` when given. Ends at end of file or on a read error.
async fn pump(src: impl AsyncRead + Unpin, prefix: Arc<[u8]>, sink: Sink, tail: Option<Tail>) {
    let mut reader = BufReader::with_capacity(64 * 1024, src);
    let mut line = Vec::with_capacity(256);
    let mut out = Vec::with_capacity(4096);
    loop {
        line.clear();
        match reader.read_until(b'\n', &mut line).await {
            Ok(0) => break,
            Ok(_) => {}
            Err(e) => {
                tracing::debug!(%e, "reading worker output failed");
                break;
            }
        }
        if line.last() != Some(&b'\n') {
            line.push(b'\n');
        }
        out.extend_from_slice(&prefix);
        out.extend_from_slice(&line);
        if let Some(tail) = &tail {
            remember(tail, &line);
        }
        if out.len() >= 64 * 1024 || !reader.buffer().contains(&b'\n') {
            write(sink, &out);
            out.clear();
        }
    }
    if !out.is_empty() {
        write(sink, &out);
    }
}

/// Writes whole lines to the agent's stdout or stderr. A closed or failing stream loses the
/// output but does not stop the worker.
fn write(sink: Sink, bytes: &[u8]) {
    let result = match sink {
        Sink::Stdout => {
            let mut out = std::io::stdout().lock();
            out.write_all(bytes).and_then(|()| out.flush())
        }
        Sink::Stderr => std::io::stderr().lock().write_all(bytes),
    };
    if let Err(e) = result {
        tracing::debug!(%e, "writing worker output failed");
    }
}

fn remember(tail: &Tail, line: &[u8]) {
    let text = String::from_utf8_lossy(line.strip_suffix(b"\n").unwrap_or(line));
    let text = text.strip_suffix('\r').unwrap_or(&text);
    let text: String = text.chars().take(TAIL_LINE_CHARS).collect();
    if let Ok(mut tail) = tail.lock() {
        if tail.len() == STDERR_TAIL_LINES {
            tail.pop_front();
        }
        tail.push_back(text);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn status(raw: i32) -> ExitStatus {
        ExitStatus::from_raw(raw)
    }

    #[test]
    fn descriptions() {
        for (raw, expected) in [
            (0, "exited with status 0"),
            (3 << 8, "exited with status 3"),
            (9, "killed by signal 9 (SIGKILL)"),
            (15, "killed by signal 15 (SIGTERM)"),
            (11 | 0x80, "killed by signal 11 (SIGSEGV)"),
            (40, "killed by signal 40 (signal 40)"),
        ] {
            assert_eq!(describe(status(raw)), expected, "raw status {raw}");
        }
    }

    #[test]
    fn tail_keeps_the_last_lines() {
        let tail: Tail = Arc::default();
        for i in 0..25 {
            remember(&tail, format!("line {i}\r\n").as_bytes());
        }
        remember(&tail, b"no newline");
        let kept: Vec<String> = tail
            .lock()
            .map(|t| t.iter().cloned().collect())
            .unwrap_or_default();
        assert_eq!(kept.len(), STDERR_TAIL_LINES);
        assert_eq!(kept.first().map(String::as_str), Some("line 6"));
        assert_eq!(kept.last().map(String::as_str), Some("no newline"));
    }
}
