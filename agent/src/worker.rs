//! One worker process: spawned in a process group of its own with its environment, its output
//! pumped line by line to the agent's stdout and stderr under a `[rank R] ` prefix (and to
//! per-rank log files with `--log-dir`), signalled as a group, and killed (the whole group) if
//! the agent drops it while it still runs.

use crate::program::Program;
use nix::sys::signal::{Signal, killpg};
use nix::unistd::Pid;
use std::collections::VecDeque;
use std::fs::File;
use std::io::Write;
use std::os::unix::process::ExitStatusExt;
use std::path::{Path, PathBuf};
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

/// Where workers' output goes (`--log-dir`, `--local-ranks-filter`): validated once, then
/// turned into an [`AttemptOutput`] for each generation's workers.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct OutputSpec {
    /// Per-rank log files under `DIR/<job>/attempt_<restart>/rank_<R>/{stdout,stderr}.log`, as
    /// torchrun's `--log-dir` (but named by global rank, so nodes can share one folder).
    pub log_dir: Option<PathBuf>,
    /// The local ranks whose output reaches the console (prefixed); `None`: all of them. Log
    /// files and the stderr tail kept for failure reports are not filtered.
    pub console_ranks: Option<Vec<u32>>,
}

impl OutputSpec {
    /// The output of one generation: `restart_count` names its log folder.
    pub fn for_attempt(&self, job_id: &str, restart_count: u32) -> AttemptOutput<'_> {
        AttemptOutput {
            spec: self,
            dir: self.attempt_dir(job_id, restart_count),
        }
    }

    /// `DIR/<job>/attempt_<restart_count>`, when there is a log folder.
    pub fn attempt_dir(&self, job_id: &str, restart_count: u32) -> Option<PathBuf> {
        // A job id is [A-Za-z0-9._-]; one made only of dots must not climb out of DIR.
        let job = if job_id.bytes().all(|b| b == b'.') {
            format!("job{job_id}")
        } else {
            job_id.to_owned()
        };
        self.log_dir
            .as_ref()
            .map(|d| d.join(job).join(format!("attempt_{restart_count}")))
    }

    /// Whether local rank `local_rank`'s output reaches the console.
    pub fn on_console(&self, local_rank: u32) -> bool {
        self.console_ranks
            .as_ref()
            .is_none_or(|ranks| ranks.contains(&local_rank))
    }
}

/// [`OutputSpec`] for one generation's workers (what [`Worker::spawn`] takes).
#[derive(Debug, Clone)]
pub struct AttemptOutput<'a> {
    spec: &'a OutputSpec,
    dir: Option<PathBuf>,
}

impl AttemptOutput<'_> {
    /// The rank's folder of log files, when there is one.
    pub fn rank_dir(&self, rank: u32) -> Option<PathBuf> {
        self.dir.as_ref().map(|d| d.join(format!("rank_{rank}")))
    }

    /// Creates the rank's log folder and its (truncated) `stdout.log` and `stderr.log`.
    fn open_logs(&self, rank: u32) -> std::io::Result<Option<(Log, Log)>> {
        let Some(dir) = self.rank_dir(rank) else {
            return Ok(None);
        };
        let context = |path: &Path, e: std::io::Error| {
            std::io::Error::new(e.kind(), format!("cannot create {}: {e}", path.display()))
        };
        std::fs::create_dir_all(&dir).map_err(|e| context(&dir, e))?;
        let open = |name: &str| {
            let path = dir.join(name);
            match File::create(&path) {
                Ok(file) => Ok(Log { file, path }),
                Err(e) => Err(context(&path, e)),
            }
        };
        Ok(Some((open("stdout.log")?, open("stderr.log")?)))
    }
}

/// An open log file and its path (for the message if writing to it fails).
#[derive(Debug)]
struct Log {
    file: File,
    path: PathBuf,
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
    /// into pump tasks that write to the console (unless `output` filters the rank out) and to
    /// the rank's log files (created first, so a folder that cannot be written is an error
    /// before anything runs). Returns the handle and a future that resolves when the worker
    /// has exited and its output has been written out (bounded by [`OUTPUT_DRAIN`]); the
    /// future is `'static` so that the supervisor can poll many at once.
    pub fn spawn(
        program: &Program,
        env: &[(&'static str, String)],
        rank: u32,
        local_rank: u32,
        output: &AttemptOutput<'_>,
    ) -> std::io::Result<(Self, impl Future<Output = Exit> + Send + 'static)> {
        let (out_log, err_log) = output.open_logs(rank)?.unzip();
        let console = output.spec.on_console(local_rank);
        let mut child = Command::new(&program.path)
            .arg0(&program.name)
            .args(&program.args)
            .envs(program.env.iter().map(|(k, v)| (k, v)))
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
        crate::guard::register(pid);
        let prefix: Arc<[u8]> = format!("[rank {rank}] ").into_bytes().into();
        let tail: Tail = Arc::new(Mutex::new(VecDeque::with_capacity(STDERR_TAIL_LINES)));
        let mut pumps = Vec::with_capacity(2);
        if let Some(out) = child.stdout.take() {
            pumps.push(tokio::spawn(pump(
                out,
                Arc::clone(&prefix),
                console.then_some(Sink::Stdout),
                out_log,
                None,
            )));
        }
        if let Some(err) = child.stderr.take() {
            pumps.push(tokio::spawn(pump(
                err,
                prefix,
                console.then_some(Sink::Stderr),
                err_log,
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
    // Reaped and drained (or its group killed): nothing is left for the guardian to kill.
    crate::guard::unregister(pid);
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

/// Copies `src` line by line to `sink` (when given), each line prefixed and written whole
/// under the stream's lock, and to `log` (when given) as it came; lines already buffered are
/// batched into one write. Keeps the last lines in `tail` when given, whatever is shown. Ends
/// at end of file or on a read error. The log file is written with blocking calls, like the
/// console: both are local, buffered writes of up to 64 KiB.
async fn pump(
    src: impl AsyncRead + Unpin,
    prefix: Arc<[u8]>,
    sink: Option<Sink>,
    mut log: Option<Log>,
    tail: Option<Tail>,
) {
    let mut reader = BufReader::with_capacity(64 * 1024, src);
    let mut line = Vec::with_capacity(256);
    let mut out = Vec::with_capacity(4096);
    let mut raw = Vec::with_capacity(if log.is_some() { 4096 } else { 0 });
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
        if sink.is_some() {
            out.extend_from_slice(&prefix);
            out.extend_from_slice(&line);
        }
        if log.is_some() {
            raw.extend_from_slice(&line);
        }
        if let Some(tail) = &tail {
            remember(tail, &line);
        }
        if out.len().max(raw.len()) >= 64 * 1024 || !reader.buffer().contains(&b'\n') {
            flush(sink, &mut out, &mut log, &mut raw);
        }
    }
    flush(sink, &mut out, &mut log, &mut raw);
}

/// Writes out and empties the pending console and log bytes. A log file that fails is closed
/// (with one message) so that the worker's output keeps flowing to the console.
fn flush(sink: Option<Sink>, out: &mut Vec<u8>, log: &mut Option<Log>, raw: &mut Vec<u8>) {
    if let Some(sink) = sink
        && !out.is_empty()
    {
        write(sink, out);
    }
    out.clear();
    if let Some(Log { file, path }) = log
        && !raw.is_empty()
        && let Err(e) = file.write_all(raw)
    {
        eprintln!(
            "muster-agent: cannot write {}: {e}; the rest of this output is not logged there",
            path.display()
        );
        *log = None;
    }
    raw.clear();
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
