//! One worker process: spawned in a process group of its own with its environment, its output
//! pumped line by line to the agent's stdout and stderr under a prefix (`[rank R] ` unless
//! `--log-line-prefix-template` or `--no-prefix` say otherwise), to per-rank log files with
//! `--log-dir`, `--redirects` or `--tee`, and to torchrun's filtered files with
//! `--duplicate-std{out,err}-filters`; signalled as a group, and killed (the whole group) if the
//! agent drops it while it still runs.

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

/// One of a worker's two output streams.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stream {
    /// Its stdout.
    Stdout,
    /// Its stderr.
    Stderr,
}

/// torchrun's `Std`: a set of a worker's streams, written as 0 (none), 1 (stdout), 2 (stderr)
/// or 3 (both), as `--redirects` and `--tee` take it.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Streams(u8);

impl Streams {
    /// Neither stream (0).
    pub const NONE: Self = Self(0);
    /// Stdout (1).
    pub const OUT: Self = Self(1);
    /// Stderr (2).
    pub const ERR: Self = Self(2);
    /// Both (3).
    pub const ALL: Self = Self(3);

    /// `0`..`3` as torchrun numbers them; `None` for anything else.
    pub fn from_digit(s: &str) -> Option<Self> {
        match s {
            "0" => Some(Self::NONE),
            "1" => Some(Self::OUT),
            "2" => Some(Self::ERR),
            "3" => Some(Self::ALL),
            _ => None,
        }
    }

    /// Whether `stream` is in the set.
    pub fn has(self, stream: Stream) -> bool {
        let bit = match stream {
            Stream::Stdout => 1,
            Stream::Stderr => 2,
        };
        self.0 & bit != 0
    }
}

/// A [`Streams`] setting per local rank, as torchrun's `--redirects` and `--tee` take it: one
/// value for every rank (`3`), or `R:V` pairs (`0:1,1:2`) where an unlisted rank gets none.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PerRank {
    /// The same streams for every local rank.
    All(Streams),
    /// These local ranks' streams; the others get none.
    Each(Vec<(u32, Streams)>),
}

impl Default for PerRank {
    fn default() -> Self {
        Self::All(Streams::NONE)
    }
}

impl PerRank {
    /// Local rank `local_rank`'s setting.
    pub fn of(&self, local_rank: u32) -> Streams {
        match self {
            Self::All(s) => *s,
            Self::Each(pairs) => pairs
                .iter()
                .find(|(r, _)| *r == local_rank)
                .map_or(Streams::NONE, |(_, s)| *s),
        }
    }

    /// Whether no rank gets any stream (torchrun's default `0`).
    pub fn is_none(&self) -> bool {
        match self {
            Self::All(s) => *s == Streams::NONE,
            Self::Each(pairs) => pairs.iter().all(|(_, s)| *s == Streams::NONE),
        }
    }
}

/// The console prefix of a worker's lines, from torchrun's `--log-line-prefix-template`
/// (Python `string.Template` syntax: `${name}` or `$name`, `$$` for a dollar) with its
/// placeholders `${role_name}`, `${rank}`, `${local_rank}` and `${hostname}`. Empty: no prefix.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PrefixTemplate {
    pieces: Vec<Piece>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
enum Piece {
    Text(String),
    RoleName,
    Rank,
    LocalRank,
    Hostname,
}

impl Default for PrefixTemplate {
    /// muster's own prefix, `[rank ${rank}] `: `[rank 3] `.
    fn default() -> Self {
        Self {
            pieces: vec![
                Piece::Text("[rank ".into()),
                Piece::Rank,
                Piece::Text("] ".into()),
            ],
        }
    }
}

impl PrefixTemplate {
    /// No prefix at all (`--no-prefix`).
    pub fn none() -> Self {
        Self { pieces: Vec::new() }
    }

    /// Parses a template; the error says what is wrong with it (an unknown placeholder, or a
    /// `$` that starts none), as Python's `Template.substitute` would refuse it.
    pub fn parse(template: &str) -> Result<Self, String> {
        let mut pieces = Vec::new();
        let mut text = String::new();
        let mut rest = template;
        while let Some(found) = rest.find('$') {
            // The byte offset in the whole template, for messages.
            let at = template.len() - rest.len() + found;
            text.push_str(&rest[..found]);
            let after = &rest[found + 1..];
            let (name, next) = if let Some(r) = after.strip_prefix('$') {
                text.push('$');
                rest = r;
                continue;
            } else if let Some(r) = after.strip_prefix('{') {
                let Some(close) = r.find('}') else {
                    return Err(format!("'${{' at byte {at} is not closed"));
                };
                (&r[..close], &r[close + 1..])
            } else {
                let len = after
                    .char_indices()
                    .find(|&(i, c)| {
                        !(c == '_' || c.is_ascii_alphabetic() || (i > 0 && c.is_ascii_digit()))
                    })
                    .map_or(after.len(), |(i, _)| i);
                (&after[..len], &after[len..])
            };
            let piece = match name {
                "role_name" => Piece::RoleName,
                "rank" => Piece::Rank,
                "local_rank" => Piece::LocalRank,
                "hostname" => Piece::Hostname,
                "" => {
                    return Err(format!(
                        "'$' at byte {at} starts no placeholder (write $$ for a dollar sign)"
                    ));
                }
                other => {
                    return Err(format!(
                        "unknown placeholder '${{{other}}}' (known: ${{role_name}}, ${{rank}}, ${{local_rank}}, ${{hostname}})"
                    ));
                }
            };
            if !text.is_empty() {
                pieces.push(Piece::Text(std::mem::take(&mut text)));
            }
            pieces.push(piece);
            rest = next;
        }
        text.push_str(rest);
        if !text.is_empty() {
            pieces.push(Piece::Text(text));
        }
        Ok(Self { pieces })
    }

    /// Whether the template renders to nothing.
    pub fn is_empty(&self) -> bool {
        self.pieces.is_empty()
    }

    /// The prefix of one worker; `hostname` is only called when the template names it.
    pub fn render(
        &self,
        role_name: &str,
        rank: u32,
        local_rank: u32,
        hostname: impl FnOnce() -> String,
    ) -> String {
        let mut hostname = Some(hostname);
        let mut host = String::new();
        let mut out = String::new();
        for piece in &self.pieces {
            match piece {
                Piece::Text(t) => out.push_str(t),
                Piece::RoleName => out.push_str(role_name),
                Piece::Rank => out.push_str(&rank.to_string()),
                Piece::LocalRank => out.push_str(&local_rank.to_string()),
                Piece::Hostname => {
                    if let Some(h) = hostname.take() {
                        host = h();
                    }
                    out.push_str(&host);
                }
            }
        }
        out
    }
}

/// Where workers' output goes (`--log-dir`, `--local-ranks-filter`, `--redirects`, `--tee`,
/// the prefix, the duplicate filters): validated once, then turned into an [`AttemptOutput`]
/// for each generation's workers.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct OutputSpec {
    /// Per-rank log files under `DIR/<job>/attempt_<restart>/rank_<R>/{stdout,stderr}.log`, as
    /// torchrun's `--log-dir` (but named by global rank, so nodes can share one folder). Every
    /// stream of every rank is written there, whatever `redirects` and `tee` say.
    pub log_dir: Option<PathBuf>,
    /// The local ranks whose output reaches the console (prefixed); `None`: all of them. Log
    /// files and the stderr tail kept for failure reports are not filtered.
    pub console_ranks: Option<Vec<u32>>,
    /// torchrun's `--redirects`: these streams go to the log files only, not the console.
    pub redirects: PerRank,
    /// torchrun's `--tee`: these streams go to the log files and the console (it wins over
    /// `redirects`, as in torchrun).
    pub tee: PerRank,
    /// The console prefix of each line.
    pub prefix: PrefixTemplate,
    /// torchrun's `--duplicate-stdout-filters`: console stdout lines that contain any of these
    /// are also written (prefixed) to `<attempt>/filtered_stdout.log`, all ranks together.
    pub duplicate_stdout_filters: Vec<String>,
    /// The same for stderr, into `<attempt>/filtered_stderr.log`.
    pub duplicate_stderr_filters: Vec<String>,
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

    /// Whether local rank `local_rank`'s output reaches the console at all.
    pub fn on_console(&self, local_rank: u32) -> bool {
        self.console_ranks
            .as_ref()
            .is_none_or(|ranks| ranks.contains(&local_rank))
    }

    /// Whether local rank `local_rank`'s `stream` reaches the console: its rank is shown, and
    /// the stream is tee'd or not redirected.
    pub fn console(&self, local_rank: u32, stream: Stream) -> bool {
        self.on_console(local_rank)
            && (self.tee.of(local_rank).has(stream) || !self.redirects.of(local_rank).has(stream))
    }

    /// The duplicate filters of `stream`.
    fn filters(&self, stream: Stream) -> &[String] {
        match stream {
            Stream::Stdout => &self.duplicate_stdout_filters,
            Stream::Stderr => &self.duplicate_stderr_filters,
        }
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

    /// The attempt's filtered file of `stream` (`filtered_stdout.log`, `filtered_stderr.log`)
    /// when it has duplicate filters: created empty by local rank 0 (spawned first), and opened
    /// for appending by each rank whose `stream` reaches the console (torchrun duplicates
    /// only tee'd, shown lines), so that all ranks' lines land whole in one file.
    fn open_filtered(&self, stream: Stream, local_rank: u32) -> std::io::Result<Option<Dup>> {
        let needles = self.spec.filters(stream);
        let Some(dir) = self.dir.as_ref().filter(|_| !needles.is_empty()) else {
            return Ok(None);
        };
        let path = dir.join(match stream {
            Stream::Stdout => "filtered_stdout.log",
            Stream::Stderr => "filtered_stderr.log",
        });
        let context = |e: std::io::Error| {
            std::io::Error::new(e.kind(), format!("cannot create {}: {e}", path.display()))
        };
        if local_rank == 0 {
            std::fs::create_dir_all(dir).map_err(context)?;
            File::create(&path).map_err(context)?;
        }
        if !self.spec.console(local_rank, stream) {
            return Ok(None);
        }
        let file = std::fs::OpenOptions::new()
            .append(true)
            .create(true)
            .open(&path)
            .map_err(context)?;
        Ok(Some(Dup {
            log: Log { file, path },
            needles: needles.into(),
        }))
    }
}

/// A filtered file: the console lines that contain any of `needles` are also written there.
#[derive(Debug)]
struct Dup {
    log: Log,
    needles: Arc<[String]>,
}

/// Whether `line` contains any of `needles` (torchrun's `any(needle in line ...)`).
fn matches_any(needles: &[String], line: &[u8]) -> bool {
    needles.iter().any(|n| {
        let n = n.as_bytes();
        line.windows(n.len()).any(|w| w == n)
    })
}

/// An open log file and its path (for the message if writing to it fails).
#[derive(Debug)]
struct Log {
    file: File,
    path: PathBuf,
}

type Tail = Arc<Mutex<VecDeque<String>>>;

impl Worker {
    /// Spawns one worker: its own process group, stdin from /dev/null, stdout and stderr piped
    /// into pump tasks that write to the console under the rank's prefix (unless `output`
    /// filters the rank out or redirects the stream), to the rank's log files and to the
    /// attempt's filtered files (created first, so a folder that cannot be written is an error
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
        let out_dup = output.open_filtered(Stream::Stdout, local_rank)?;
        let err_dup = output.open_filtered(Stream::Stderr, local_rank)?;
        let spec = output.spec;
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
        // The role as the worker sees it (its ROLE_NAME), for `${role_name}`.
        let role = env
            .iter()
            .rev()
            .find(|(k, _)| *k == muster_core::contract::env::ROLE_NAME)
            .map(|(_, v)| v.as_str())
            .or_else(|| {
                program
                    .env
                    .iter()
                    .rev()
                    .find(|(k, _)| k == muster_core::contract::env::ROLE_NAME)
                    .map(|(_, v)| v.as_str())
            })
            .unwrap_or("");
        let prefix: Arc<[u8]> = spec
            .prefix
            .render(role, rank, local_rank, || {
                nix::unistd::gethostname()
                    .map(|h| h.to_string_lossy().into_owned())
                    .unwrap_or_default()
            })
            .into_bytes()
            .into();
        let tail: Tail = Arc::new(Mutex::new(VecDeque::with_capacity(STDERR_TAIL_LINES)));
        let mut pumps = Vec::with_capacity(2);
        if let Some(out) = child.stdout.take() {
            pumps.push(tokio::spawn(pump(
                out,
                Arc::clone(&prefix),
                spec.console(local_rank, Stream::Stdout)
                    .then_some(Stream::Stdout),
                out_log,
                out_dup,
                None,
            )));
        }
        if let Some(err) = child.stderr.take() {
            pumps.push(tokio::spawn(pump(
                err,
                prefix,
                spec.console(local_rank, Stream::Stderr)
                    .then_some(Stream::Stderr),
                err_log,
                err_dup,
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
    ///
    /// A signal a process can act on (SIGTERM) is followed by SIGCONT to the group: a stopped
    /// process (SIGSTOP, a debugger, Ctrl-Z) keeps such a signal pending and would otherwise
    /// sit out the whole grace period until SIGKILL. SIGCONT wakes it with the signal pending,
    /// so it ends (or runs its handler) at once; to a running process it is a no-op.
    pub fn signal(&self, signal: Signal) {
        if self.exited() {
            return;
        }
        if let Err(e) = killpg(self.pid, signal) {
            tracing::debug!(rank = self.rank, %e, ?signal, "killpg failed");
            return;
        }
        if !matches!(signal, Signal::SIGKILL | Signal::SIGSTOP | Signal::SIGCONT)
            && let Err(e) = killpg(self.pid, Signal::SIGCONT)
        {
            tracing::debug!(rank = self.rank, %e, "killpg SIGCONT failed");
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
/// under the stream's lock, to `log` (when given) as it came, and to `dup` (when given) the
/// console lines that match its filters; lines already buffered are batched into one write.
/// Keeps the last lines in `tail` when given, whatever is shown. Ends at end of file or on a
/// read error. The files are written with blocking calls, like the console: all are local,
/// buffered writes of up to 64 KiB.
async fn pump(
    src: impl AsyncRead + Unpin,
    prefix: Arc<[u8]>,
    sink: Option<Stream>,
    log: Option<Log>,
    dup: Option<Dup>,
    tail: Option<Tail>,
) {
    let mut reader = BufReader::with_capacity(64 * 1024, src);
    let mut line = Vec::with_capacity(256);
    let (dup_log, needles) = dup.map_or((None, Arc::from([])), |d| (Some(d.log), d.needles));
    let mut pending = Pending {
        out: Vec::with_capacity(4096),
        log,
        raw: Vec::new(),
        dup_log,
        needles,
        dup_raw: Vec::new(),
    };
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
            pending.out.extend_from_slice(&prefix);
            pending.out.extend_from_slice(&line);
        }
        if pending.log.is_some() {
            pending.raw.extend_from_slice(&line);
        }
        if pending.dup_log.is_some() && matches_any(&pending.needles, &line) {
            pending.dup_raw.extend_from_slice(&prefix);
            pending.dup_raw.extend_from_slice(&line);
        }
        if let Some(tail) = &tail {
            remember(tail, &line);
        }
        if pending.len() >= 64 * 1024 || !reader.buffer().contains(&b'\n') {
            pending.flush(sink);
        }
    }
    pending.flush(sink);
}

/// A pump's bytes not yet written: to the console, the log file, the filtered file.
struct Pending {
    out: Vec<u8>,
    log: Option<Log>,
    raw: Vec<u8>,
    dup_log: Option<Log>,
    needles: Arc<[String]>,
    dup_raw: Vec<u8>,
}

impl Pending {
    fn len(&self) -> usize {
        self.out.len().max(self.raw.len()).max(self.dup_raw.len())
    }

    /// Writes out and empties the pending bytes. A file that fails is closed (with one
    /// message) so that the worker's output keeps flowing elsewhere.
    fn flush(&mut self, sink: Option<Stream>) {
        if let Some(sink) = sink
            && !self.out.is_empty()
        {
            write(sink, &self.out);
        }
        self.out.clear();
        write_log(&mut self.log, &mut self.raw);
        write_log(&mut self.dup_log, &mut self.dup_raw);
    }
}

/// Writes `bytes` to `log` and empties them; a failing log is closed with one message.
fn write_log(log: &mut Option<Log>, bytes: &mut Vec<u8>) {
    if let Some(Log { file, path }) = log
        && !bytes.is_empty()
        && let Err(e) = file.write_all(bytes)
    {
        log_failed(path, &e);
        *log = None;
    }
    bytes.clear();
}

fn log_failed(path: &Path, e: &std::io::Error) {
    eprintln!(
        "muster-agent: cannot write {}: {e}; the rest of this output is not logged there",
        path.display()
    );
}

/// Writes whole lines to the agent's stdout or stderr. A closed or failing stream loses the
/// output but does not stop the worker.
fn write(sink: Stream, bytes: &[u8]) {
    let result = match sink {
        Stream::Stdout => {
            let mut out = std::io::stdout().lock();
            out.write_all(bytes).and_then(|()| out.flush())
        }
        Stream::Stderr => std::io::stderr().lock().write_all(bytes),
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
