//! The node's workers' stacks, read from outside their processes: every Python thread's
//! frames through py-spy (as a library, reading the worker's memory with
//! `process_vm_readv`; nothing is installed in the worker and the worker is never paused), a
//! line saying what a worker that is not Python is doing, or a line naming why a rank cannot
//! be read and what fixes it.
//!
//! One sampler thread per generation (`stack-sampler`) owns the readers: it reads every
//! worker at the sampling rate (`--sample-stacks`), keeps for each rank since when its stack
//! has been as it is and the share of samples it spent in a wait, and tells the watch when
//! the node made progress ([`Sampler::progress`], the coordinator's hang timeout starts
//! again). A dump the coordinator asks for ([`Sampler::dump`]) is read fresh on the same
//! thread. The supervisor keeps the list of running workers ([`Workers`]) as it spawns and
//! reaps them.
//!
//! Progress, as this node sees it (the rule of `docs/hangs.md`): a rank's stack changed
//! between two samples, a worker started or ended, or a rank whose main thread is not in a
//! wait ([`muster_core::stacks::is_wait`]) used at least [`BUSY_SHARE`] of a CPU since the
//! last sample (a long healthy step inside one native call: a big matmul, a checkpoint
//! write). A rank in `time.sleep`, or blocked in a collective, a barrier or a lock, makes
//! none.
//!
//! Thread "stack-sampler" (one per generation): on error (a worker that cannot be read),
//! records the reason in that rank's answer and goes on; on shutdown, ends when its
//! [`Sampler`] is dropped (its command channel closes).

mod native;

use muster_proto::v1 as pb;
use py_spy::{Config, PythonSpy};
use std::collections::{BTreeMap, HashMap};
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc as std_mpsc;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio::sync::{mpsc, oneshot};

/// A rank outside any wait that used this share of one CPU between two samples is working:
/// progress, even when its Python stack stands still.
pub const BUSY_SHARE: f64 = 0.25;

/// The sampler tells the watch about progress at most this often.
const PROGRESS_EVERY: Duration = Duration::from_secs(1);

/// The sampler sends its ranks' recent samples this often.
const SAMPLES_EVERY: Duration = Duration::from_secs(2);

/// How many recent samples per rank the straggler view is over (30 s at the default 2 Hz).
const WINDOW: usize = 60;

/// What the sampler tells the watch.
#[derive(Debug)]
pub enum Notice {
    /// The node's workers made progress.
    Progress,
    /// Each rank's recent samples, summed up.
    Samples(Vec<pb::RankSample>),
}

/// The kernel's unit for a process's CPU times in `/proc/PID/stat` (`USER_HZ`, 100 on every
/// Linux architecture this runs on).
const USER_HZ: f64 = 100.0;

/// A running worker of this node, as the sampler reads it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WorkerRef {
    /// Its rank within the node.
    pub local_rank: u32,
    /// Its process id.
    pub pid: u32,
}

/// The node's running workers by global rank, kept by the supervisor (spawn, respawn, reap)
/// and read by the sampler.
#[derive(Debug, Clone, Default)]
pub struct Workers(Arc<Mutex<BTreeMap<u32, WorkerRef>>>);

impl Workers {
    /// `rank` runs as `worker` (a spawn or a respawn in place).
    pub fn started(&self, rank: u32, worker: WorkerRef) {
        self.lock().insert(rank, worker);
    }

    /// `rank`'s process `pid` was reaped (a later respawn's entry is left alone).
    pub fn ended(&self, rank: u32, pid: u32) {
        let mut map = self.lock();
        if map.get(&rank).is_some_and(|w| w.pid == pid) {
            map.remove(&rank);
        }
    }

    fn snapshot(&self) -> BTreeMap<u32, WorkerRef> {
        self.lock().clone()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, BTreeMap<u32, WorkerRef>> {
        // A panic elsewhere while holding it leaves a plain map: still usable.
        self.0.lock().unwrap_or_else(|e| e.into_inner())
    }
}

enum Command {
    /// Read every worker now; `bool`: with Python ranks' native frames.
    Dump(oneshot::Sender<Vec<pb::RankStack>>, bool),
    /// Count the barriers the node relay completes (see [`Sampler::with_barriers`]).
    Barriers(Arc<AtomicU64>),
}

/// The handle of a generation's sampler thread; dropping it ends the thread.
pub struct Sampler {
    commands: std_mpsc::Sender<Command>,
    progress: Option<mpsc::UnboundedReceiver<Notice>>,
    /// The generation's Flight Recorder folder, read in every dump ([`crate::flight`]).
    flight: Option<std::path::PathBuf>,
}

impl Sampler {
    /// Starts the sampler over `workers`, sampling `hz` times a second (0: only on demand, so
    /// the node reports no progress of its own).
    pub fn start(workers: Workers, hz: f64) -> std::io::Result<Self> {
        quiet_sampler_panics();
        let (commands, rx) = std_mpsc::channel();
        let (progress_tx, progress) = mpsc::unbounded_channel();
        let interval = (hz > 0.0).then(|| Duration::from_secs_f64(1.0 / hz));
        std::thread::Builder::new()
            .name("stack-sampler".into())
            .spawn(move || {
                let mut state = State::new(workers, progress_tx);
                state.run(&rx, interval);
            })?;
        Ok(Self {
            commands,
            progress: Some(progress),
            flight: None,
        })
    }

    /// Dumps also read each rank's Flight Recorder from the sockets in `dir`.
    #[must_use]
    pub fn with_flight(mut self, dir: Option<std::path::PathBuf>) -> Self {
        self.flight = dir;
        self
    }

    /// A barrier that the node relay completed since the last sample (`completed` counts
    /// them: [`crate::relay::Relay::completed`]) is progress too. The coordinator sees only
    /// the barriers it completes; a single-node job's barriers, and node barriers, complete
    /// in the relay, and a job whose ranks spend their time waiting in them (the fault
    /// suite's probes, a loop paced by sleeps) was reported as hung after 5 minutes.
    #[must_use]
    pub fn with_barriers(self, completed: Arc<AtomicU64>) -> Self {
        let _ = self.commands.send(Command::Barriers(completed));
        self
    }

    /// Every running worker's stacks, read now (with their Flight Recorders; `native`: with
    /// Python ranks' native frames, pausing each worker for the read). A worker that is not
    /// Python always has its native stack. Empty if the thread has gone.
    pub async fn dump(&self, native: bool) -> Vec<pb::RankStack> {
        self.dumper().dump(native).await
    }

    /// A handle that asks for dumps (the watch's answers run as tasks of their own).
    pub fn dumper(&self) -> Dumper {
        Dumper {
            commands: self.commands.clone(),
            flight: self.flight.clone(),
        }
    }

    /// The notices: progress (once per [`PROGRESS_EVERY`] at most) and the ranks' samples
    /// (every [`SAMPLES_EVERY`]); taken once.
    pub fn progress(&mut self) -> Option<mpsc::UnboundedReceiver<Notice>> {
        self.progress.take()
    }
}

/// A panic on the sampler thread is py-spy's on a torn read (caught: one failed sample), so
/// it is logged at debug level instead of printed on the agent's stderr; every other thread's
/// panics print as before. Installed once per process.
fn quiet_sampler_panics() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        let default = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            if std::thread::current().name() == Some("stack-sampler") {
                tracing::debug!("a stack read failed: {info}");
                return;
            }
            default(info);
        }));
    });
}

/// Asks a [`Sampler`] for dumps; it does not keep the thread alive once the sampler is dropped.
#[derive(Clone)]
pub struct Dumper {
    commands: std_mpsc::Sender<Command>,
    flight: Option<std::path::PathBuf>,
}

impl Dumper {
    /// As [`Sampler::dump`].
    pub async fn dump(&self, native: bool) -> Vec<pb::RankStack> {
        let (tx, rx) = oneshot::channel();
        if self.commands.send(Command::Dump(tx, native)).is_err() {
            return Vec::new();
        }
        let mut stacks = rx.await.unwrap_or_default();
        if let Some(dir) = &self.flight {
            crate::flight::annotate(dir, &mut stacks).await;
        }
        stacks
    }
}

/// What the sampler keeps about one rank's process.
struct Tracked {
    pid: u32,
    /// The reader, once attached (attaching parses the interpreter's binaries: milliseconds).
    spy: Option<PythonSpy>,
    /// The program, once known not to be Python (not attached again).
    native: Option<String>,
    /// The reader of its native frames, once a dump asked for them ([`native`]): py-spy's
    /// blocking reader of a Python worker, or the unwinder of a program that is not Python.
    native_spy: Option<PythonSpy>,
    program: Option<native::Program>,
    fingerprint: Option<u64>,
    since: Instant,
    samples: u64,
    waiting: u64,
    cpu_ticks: Option<(u64, Instant)>,
    /// The recent samples: whether the main thread stood where ranks sync, and where.
    window: std::collections::VecDeque<(bool, String)>,
}

struct State {
    workers: Workers,
    tracked: HashMap<u32, Tracked>,
    progress: mpsc::UnboundedSender<Notice>,
    last_progress_sent: Option<Instant>,
    last_samples_sent: Instant,
    sources: HashMap<(String, u32), String>,
    /// The relay's count of completed barriers, and its value at the last sample.
    barriers: Option<(Arc<AtomicU64>, u64)>,
}

impl State {
    fn new(workers: Workers, progress: mpsc::UnboundedSender<Notice>) -> Self {
        Self {
            workers,
            tracked: HashMap::new(),
            progress,
            last_progress_sent: None,
            last_samples_sent: Instant::now(),
            sources: HashMap::new(),
            barriers: None,
        }
    }

    fn run(&mut self, rx: &std_mpsc::Receiver<Command>, interval: Option<Duration>) {
        let mut next = interval.map(|i| Instant::now() + i);
        loop {
            let command = match next {
                Some(due) => match rx.recv_timeout(due.saturating_duration_since(Instant::now())) {
                    Ok(c) => Some(c),
                    Err(std_mpsc::RecvTimeoutError::Timeout) => None,
                    Err(std_mpsc::RecvTimeoutError::Disconnected) => return,
                },
                None => match rx.recv() {
                    Ok(c) => Some(c),
                    Err(_) => return,
                },
            };
            match command {
                Some(Command::Dump(reply, native)) => {
                    let stacks = self.read_all(false, native);
                    let _ = reply.send(stacks);
                }
                Some(Command::Barriers(completed)) => {
                    self.barriers = Some((completed, 0));
                }
                None => {
                    self.read_all(true, false);
                    if let (Some(i), Some(due)) = (interval, next.as_mut()) {
                        // A late wake (a stopped agent) does not make up for the lost samples.
                        *due = (*due + i).max(Instant::now());
                    }
                }
            }
        }
    }

    /// Reads every running worker; a sample (`sample`) also counts waits and decides progress,
    /// a dump (not `sample`) adds native frames: a non-Python worker's always, a Python
    /// worker's when `native`. The stack's fingerprint is taken before, so that a dump does
    /// not look like a change to the next sample.
    fn read_all(&mut self, sample: bool, native: bool) -> Vec<pb::RankStack> {
        let workers = self.workers.snapshot();
        let mut progressed = false;
        // Workers that ended, or were replaced by a new process.
        let before = self.tracked.len();
        self.tracked
            .retain(|rank, t| workers.get(rank).is_some_and(|w| w.pid == t.pid));
        progressed |= self.tracked.len() != before;
        if sample && let Some((completed, seen)) = self.barriers.as_mut() {
            let now = completed.load(Ordering::Relaxed);
            progressed |= now != *seen;
            *seen = now;
        }
        let mut out = Vec::with_capacity(workers.len());
        for (&rank, w) in &workers {
            let now = Instant::now();
            let t = self.tracked.entry(rank).or_insert_with(|| {
                progressed = true;
                Tracked {
                    pid: w.pid,
                    spy: None,
                    native: None,
                    native_spy: None,
                    program: None,
                    fingerprint: None,
                    since: now,
                    samples: 0,
                    waiting: 0,
                    cpu_ticks: None,
                    window: std::collections::VecDeque::with_capacity(WINDOW),
                }
            });
            let mut stack = read(t, w, &mut self.sources);
            stack.rank = Some(rank);
            stack.local_rank = Some(w.local_rank);
            // A program that is not Python is fingerprinted by the program alone: its state
            // and kernel wait channel change under a dump's ptrace stop without it moving.
            let line = match &t.native {
                Some(exe) => std::mem::replace(&mut stack.native, exe.clone()),
                None => String::new(),
            };
            let fingerprint = muster_core::stacks::fingerprint(&stack);
            if t.native.is_some() {
                stack.native = line;
            }
            if t.fingerprint != Some(fingerprint) {
                if t.fingerprint.is_some() {
                    progressed = true;
                }
                t.fingerprint = Some(fingerprint);
                t.since = now;
            }
            let waiting = stack
                .threads
                .first()
                .is_some_and(|main| muster_core::stacks::is_wait(&main.frames));
            if sample {
                t.samples += 1;
                t.waiting += u64::from(waiting);
                let main = stack.threads.first().map_or(&[][..], |m| &m.frames[..]);
                let sync = muster_core::stacks::is_sync(main);
                let at = match (main.is_empty(), sync) {
                    (true, _) => String::new(),
                    (false, true) => muster_core::stacks::wait_site(main),
                    (false, false) => muster_core::stacks::site(main),
                };
                if t.window.len() == WINDOW {
                    t.window.pop_front();
                }
                t.window.push_back((sync, at));
                let ticks = cpu_ticks(w.pid);
                if let (Some(ticks), Some((was, at))) = (ticks, t.cpu_ticks) {
                    let used = ticks.saturating_sub(was) as f64 / USER_HZ;
                    let span = now.saturating_duration_since(at).as_secs_f64();
                    // A rank that cannot be read counts by its CPU alone (nothing says it waits).
                    if !waiting && span > 0.0 && used / span >= BUSY_SHARE {
                        progressed = true;
                    }
                }
                t.cpu_ticks = ticks.map(|n| (n, now));
            }
            if t.samples > 0 {
                stack.waiting_share = t.waiting as f64 / t.samples as f64;
                stack.unchanged_ms = now.saturating_duration_since(t.since).as_millis() as u64;
            }
            if !sample {
                add_native(t, &mut stack, native, &mut self.sources);
            }
            out.push(stack);
        }
        if sample && progressed {
            let due = self
                .last_progress_sent
                .is_none_or(|at| at.elapsed() >= PROGRESS_EVERY);
            if due {
                self.last_progress_sent = Some(Instant::now());
                let _ = self.progress.send(Notice::Progress);
            }
        }
        if sample && self.last_samples_sent.elapsed() >= SAMPLES_EVERY {
            self.last_samples_sent = Instant::now();
            let mut ranks: Vec<(u32, pb::RankSample)> = self
                .tracked
                .iter()
                .map(|(&rank, t)| (rank, summary(rank, &t.window)))
                .collect();
            ranks.sort_by_key(|(r, _)| *r);
            let _ = self
                .progress
                .send(Notice::Samples(ranks.into_iter().map(|(_, s)| s).collect()));
        }
        out
    }
}

/// A dump's native frames for one rank: a program that is not Python gets its native
/// threads (or why not, after what it is doing); a Python rank's threads get their native
/// frames merged in when `python` (or `native` says why not).
fn add_native(
    t: &mut Tracked,
    stack: &mut pb::RankStack,
    python: bool,
    sources: &mut HashMap<(String, u32), String>,
) {
    if !stack.error.is_empty() {
        return;
    }
    if t.native.is_some() {
        match native::program_threads(&mut t.program, stack.pid) {
            Ok(threads) => stack.threads = threads,
            Err(why) => stack.native.push_str(&format!(" ({why})")),
        }
    } else if python && !stack.threads.is_empty() {
        match native::python_threads(&mut t.native_spy, stack.pid) {
            Ok(mut threads) => {
                for th in &mut threads {
                    annotate_source(&mut th.frames, sources);
                }
                stack.threads = threads;
            }
            Err(why) => stack.native = why,
        }
    }
}

/// A rank's recent samples, summed up: the share in syncs, and the most frequent spot in and
/// outside them.
fn summary(rank: u32, window: &std::collections::VecDeque<(bool, String)>) -> pb::RankSample {
    let n = window.len();
    let most = |sync: bool| {
        let mut counts: HashMap<&str, usize> = HashMap::new();
        for (s, at) in window {
            if *s == sync && !at.is_empty() {
                *counts.entry(at.as_str()).or_default() += 1;
            }
        }
        counts
            .into_iter()
            .max_by(|a, b| a.1.cmp(&b.1).then(b.0.cmp(a.0)))
            .map(|(at, c)| (at.to_owned(), c))
    };
    let waits = window.iter().filter(|(s, _)| *s).count();
    let share = |c: usize| if n == 0 { 0.0 } else { c as f64 / n as f64 };
    let (busy_at, busy) = most(false).unwrap_or_default();
    pb::RankSample {
        rank: Some(rank),
        samples: u32::try_from(n).unwrap_or(u32::MAX),
        waiting_share: share(waits),
        busy_at,
        busy_share: share(busy),
        waiting_at: most(true).map(|(at, _)| at).unwrap_or_default(),
    }
}

/// One worker's stacks: its Python threads (main first), else what it is, else why not; and
/// the state of the process read (the Python child of a wrapper, where it has one) when the
/// kernel does not have it running or sleeping as usual.
fn read(
    t: &mut Tracked,
    w: &WorkerRef,
    sources: &mut HashMap<(String, u32), String>,
) -> pb::RankStack {
    let mut stack = read_stacks(t, w, sources);
    stack.process_state = unusual_state(stack.pid);
    stack
}

/// [`read`]'s stacks.
fn read_stacks(
    t: &mut Tracked,
    w: &WorkerRef,
    sources: &mut HashMap<(String, u32), String>,
) -> pb::RankStack {
    let mut stack = pb::RankStack {
        pid: w.pid,
        ..Default::default()
    };
    if !Path::new(&format!("/proc/{}", w.pid)).exists() {
        stack.error = format!("process {} exited while it was being read", w.pid);
        return stack;
    }
    if let Some(exe) = &t.native {
        // A wrapper may exec its Python later, or start it as a child (a shim that is still
        // resolving it): the verdict holds while the program is the same and has no Python
        // child.
        let now = std::fs::read_link(format!("/proc/{}/exe", w.pid))
            .map(|p| p.display().to_string())
            .unwrap_or_default();
        let target = if now == *exe {
            python_descendant(w.pid)
        } else {
            Some(w.pid)
        };
        match target.and_then(|pid| attach(pid).ok()) {
            Some(spy) => {
                t.spy = Some(spy);
                t.native = None;
            }
            None => {
                stack.native = native_line(w.pid, exe);
                return stack;
            }
        }
    }
    if t.spy.is_none() {
        match attach(w.pid) {
            Ok(spy) => t.spy = Some(spy),
            Err(Unreadable::NotPython(exe)) => {
                // A wrapper (a pyenv shim, `sh -c` without exec, `conda run`) may run the
                // Python as its child: read that one.
                let child = python_descendant(w.pid).and_then(|pid| attach(pid).ok());
                match child {
                    Some(spy) => t.spy = Some(spy),
                    None => {
                        stack.native = native_line(w.pid, &exe);
                        t.native = Some(exe);
                        return stack;
                    }
                }
            }
            Err(Unreadable::Error(why)) => {
                stack.error = why;
                return stack;
            }
        }
    }
    let Some(spy) = t.spy.as_mut() else {
        return stack;
    };
    stack.pid = u32::try_from(spy.pid).unwrap_or(w.pid);
    // A read races with the running worker (py-spy's non-blocking mode): memory read half
    // before and half after a change can make py-spy itself panic (an index or an overflow on
    // a torn structure). That is one failed sample, never the end of the sampler.
    let read = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| spy.get_stack_traces()));
    let read =
        read.unwrap_or_else(|_| Err(anyhow::anyhow!("a read raced with the running worker")));
    match read {
        Ok(traces) => {
            stack.threads = frames_of(&traces, stack.pid);
            for th in &mut stack.threads {
                annotate_source(&mut th.frames, sources);
            }
        }
        Err(e) => {
            // Attached earlier, unreadable now: the process is ending or changed under us.
            t.spy = None;
            stack.error = if Path::new(&format!("/proc/{}", w.pid)).exists() {
                format!("py-spy could not read process {}: {e}", w.pid)
            } else {
                format!("process {} exited while it was being read", w.pid)
            };
        }
    }
    stack
}

/// py-spy's traces of process `pid` as threads, the main thread first (its OS thread id is
/// the process id). A native frame (merged in by py-spy's `native` mode) names its module;
/// one py-spy could not name (it shows its address) has no function.
fn frames_of(traces: &[py_spy::StackTrace], pid: u32) -> Vec<pb::ThreadStack> {
    let mut threads: Vec<pb::ThreadStack> = traces
        .iter()
        .map(|trace| pb::ThreadStack {
            thread_id: trace.os_thread_id.unwrap_or(trace.thread_id),
            name: trace.thread_name.clone().unwrap_or_default(),
            active: trace.active,
            frames: trace.frames.iter().map(frame_of).collect(),
        })
        .collect();
    threads.sort_by_key(|th| (th.thread_id != u64::from(pid), th.thread_id));
    threads
}

fn frame_of(f: &py_spy::Frame) -> pb::StackFrame {
    let Some(module) = &f.module else {
        return pb::StackFrame {
            function: f.name.clone(),
            file: f.filename.clone(),
            line: u32::try_from(f.line).unwrap_or(0),
            source: String::new(),
            module: String::new(),
        };
    };
    let unnamed = f
        .name
        .strip_prefix("0x")
        .is_some_and(|hex| hex.bytes().all(|b| b.is_ascii_hexdigit()));
    let file = (f.filename != *module).then(|| f.filename.clone());
    pb::StackFrame {
        function: if unnamed {
            String::new()
        } else {
            native::demangle(&f.name)
        },
        line: if file.is_some() {
            u32::try_from(f.line).unwrap_or(0)
        } else {
            0
        },
        file: file.unwrap_or_default(),
        source: String::new(),
        module: module.clone(),
    }
}

/// The source text of the innermost frame of the user's own code (not a library's), read
/// from the file on this machine, so that `train.py:9 slow_data_step` says what line 9 does.
fn annotate_source(frames: &mut [pb::StackFrame], sources: &mut HashMap<(String, u32), String>) {
    let Some(f) = frames.iter_mut().find(|f| {
        f.module.is_empty() && !f.file.is_empty() && !muster_core::stacks::is_library(&f.file)
    }) else {
        return;
    };
    if f.line == 0 {
        return;
    }
    let key = (f.file.clone(), f.line);
    if let Some(text) = sources.get(&key) {
        f.source = text.clone();
        return;
    }
    let text = std::fs::read_to_string(&f.file)
        .ok()
        .and_then(|s| {
            s.lines()
                .nth(f.line as usize - 1)
                .map(|l| l.trim().to_owned())
        })
        .map(|mut l| {
            if l.chars().count() > 80 {
                l = l.chars().take(77).collect::<String>() + "...";
            }
            l
        })
        .unwrap_or_default();
    sources.insert(key, text.clone());
    f.source = text;
}

enum Unreadable {
    /// Not a Python process: its program.
    NotPython(String),
    /// Cannot be read: the cause and the fix (one line).
    Error(String),
}

fn attach(pid: u32) -> Result<PythonSpy, Unreadable> {
    let config = Config {
        // Never pause the worker: a sample is read while it runs.
        blocking: py_spy::config::LockingStrategy::NonBlocking,
        include_idle: true,
        collect_thread_names: true,
        dump_locals: 0,
        ..Config::default()
    };
    // As for a read, a panic of py-spy's on memory that changed under it is a failed attach.
    let spy = std::panic::catch_unwind(|| PythonSpy::new(pid as py_spy::Pid, &config));
    match spy.unwrap_or_else(|_| Err(anyhow::anyhow!("an attach raced with the starting worker"))) {
        Ok(spy) => Ok(spy),
        Err(e) => Err(explain(pid, &e)),
    }
}

/// Why py-spy could not attach to `pid`, as one line with the fix.
fn explain(pid: u32, e: &anyhow::Error) -> Unreadable {
    let chain = format!("{e:#}");
    let proc_dir = format!("/proc/{pid}");
    if !Path::new(&proc_dir).exists() {
        return Unreadable::Error(format!("process {pid} exited while it was being read"));
    }
    let denied = e.chain().any(|c| {
        c.downcast_ref::<std::io::Error>().is_some_and(|io| {
            matches!(io.kind(), std::io::ErrorKind::PermissionDenied)
                || io.raw_os_error() == Some(1)
        })
    }) || chain.contains("Permission denied")
        || chain.contains("Operation not permitted")
        || chain.contains("os error 1)");
    if denied {
        return Unreadable::Error(permission_cause(pid));
    }
    let exe = std::fs::read_link(format!("{proc_dir}/exe"))
        .map(|p| p.display().to_string())
        .unwrap_or_default();
    if !is_python(pid) {
        return Unreadable::NotPython(exe);
    }
    Unreadable::Error(format!(
        "py-spy cannot read this Python (pid {pid}, {exe}): {chain} (an interpreter still starting is read at the next sample; a Python version this agent's py-spy does not know stays unreadable until the agent is upgraded)"
    ))
}

/// The first Python process among `pid`'s descendants (three generations at most), for a
/// worker that runs its Python under a wrapper.
fn python_descendant(pid: u32) -> Option<u32> {
    let mut level = vec![pid];
    for _ in 0..3 {
        let next: Vec<u32> = level
            .into_iter()
            .flat_map(crate::procfs::children)
            .collect();
        if let Some(&python) = next.iter().find(|&&c| is_python(c)) {
            return Some(python);
        }
        if next.is_empty() {
            return None;
        }
        level = next;
    }
    None
}

/// Whether `pid` runs a Python interpreter: its program is `python*`, or it maps libpython.
fn is_python(pid: u32) -> bool {
    let exe = std::fs::read_link(format!("/proc/{pid}/exe")).unwrap_or_default();
    exe.file_name()
        .and_then(|n| n.to_str())
        .is_some_and(|n| n.starts_with("python"))
        || std::fs::read_to_string(format!("/proc/{pid}/maps"))
            .is_ok_and(|m| m.contains("libpython"))
}

/// The cause of a refused read of `pid`'s memory, and what fixes it.
fn permission_cause(pid: u32) -> String {
    let scope = std::fs::read_to_string("/proc/sys/kernel/yama/ptrace_scope")
        .ok()
        .and_then(|s| s.trim().parse::<u32>().ok());
    if let Some(n) = scope.filter(|&n| n >= 2) {
        return format!(
            "cannot read process {pid}'s memory: kernel.yama.ptrace_scope is {n}; set it to 1 (sysctl kernel.yama.ptrace_scope=1) or give the agent CAP_SYS_PTRACE"
        );
    }
    let ours = uid_of("/proc/self/status");
    let theirs = uid_of(&format!("/proc/{pid}/status"));
    if ours.is_some() && theirs.is_some() && ours != theirs {
        return format!(
            "cannot read process {pid}'s memory: it runs as uid {} and the agent as uid {}; run them as one user or give the agent CAP_SYS_PTRACE",
            theirs.unwrap_or_default(),
            ours.unwrap_or_default()
        );
    }
    format!(
        "cannot read process {pid}'s memory: it is not dumpable (it called prctl(PR_SET_DUMPABLE, 0), or runs a setuid or setgid program) and the agent lacks CAP_SYS_PTRACE; give the agent CAP_SYS_PTRACE (in Kubernetes, securityContext.capabilities.add: [SYS_PTRACE]), or leave the worker dumpable"
    )
}

fn uid_of(status: &str) -> Option<u32> {
    let text = std::fs::read_to_string(status).ok()?;
    let line = text.lines().find(|l| l.starts_with("Uid:"))?;
    line.split_whitespace().nth(2)?.parse().ok()
}

/// Process `pid`'s state letter from `/proc/<pid>/stat` (`R`, `S`, `D`, `T`, `t`, `Z`, ...).
fn state_letter(pid: u32) -> Option<String> {
    let stat = crate::procfs::stat(pid)?;
    crate::procfs::stat_fields(&stat)?.next().map(str::to_owned)
}

/// The kernel function process `pid` waits in, if it waits in one.
fn wchan(pid: u32) -> Option<String> {
    let w = std::fs::read_to_string(format!("/proc/{pid}/wchan")).ok()?;
    let w = w.trim();
    (!w.is_empty() && w != "0").then(|| w.to_owned())
}

/// What a process that is not Python is doing, in one line: its program, its state and where
/// the kernel has it waiting.
fn native_line(pid: u32, exe: &str) -> String {
    let state = match state_letter(pid).as_deref() {
        Some("R") => "running",
        Some("S") => "sleeping",
        Some("D") => "in uninterruptible I/O",
        Some("T" | "t") => "stopped",
        Some("Z") => "a zombie",
        _ => "in state ?",
    };
    let program = if exe.is_empty() {
        "an unknown program"
    } else {
        exe
    };
    let mut line = format!("{program} (pid {pid}) is not Python; it is {state}");
    if let Some(wchan) = wchan(pid) {
        line.push_str(&format!(" in the kernel at {wchan}"));
    }
    line
}

/// `RankStack.process_state` for process `pid`: what it is when the kernel does not have it
/// running or sleeping as usual (a stopped process runs no code, whatever its stack shows);
/// empty otherwise.
fn unusual_state(pid: u32) -> String {
    match state_letter(pid).as_deref() {
        Some("T" | "t") => "stopped (by SIGSTOP, a terminal's Ctrl-Z or a debugger): it runs \
                           nothing until it gets SIGCONT"
            .to_owned(),
        Some("D") => match wchan(pid) {
            Some(at) => format!("in uninterruptible I/O in the kernel at {at}"),
            None => "in uninterruptible I/O".to_owned(),
        },
        Some("Z") => "a zombie: it exited and was not reaped yet".to_owned(),
        _ => String::new(),
    }
}

/// The process's CPU time so far (user and system, all threads), in clock ticks.
fn cpu_ticks(pid: u32) -> Option<u64> {
    let stat = crate::procfs::stat(pid)?;
    // After the command: state is field 3; utime and stime are fields 14 and 15.
    let mut fields = crate::procfs::stat_fields(&stat)?.skip(11);
    let utime: u64 = fields.next()?.parse().ok()?;
    let stime: u64 = fields.next()?.parse().ok()?;
    Some(utime + stime)
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    /// A program that is not Python gets a line naming it and its state, not an error, and
    /// its native stack, unwound and named from its libraries' symbols.
    #[tokio::test]
    async fn a_program_that_is_not_python_is_named_with_its_state_and_native_stack() {
        let mut child = std::process::Command::new("sleep")
            .arg("30")
            .spawn()
            .expect("sleep");
        let workers = Workers::default();
        workers.started(
            0,
            WorkerRef {
                local_rank: 0,
                pid: child.id(),
            },
        );
        let sampler = Sampler::start(workers, 0.0).expect("sampler");
        // Until it reached its sleep (a loaded machine may still be loading the program).
        let deadline = Instant::now() + Duration::from_secs(20);
        let stacks = loop {
            let stacks = sampler.dump(false).await;
            let asleep = stacks.first().is_some_and(|s| {
                s.native.contains("it is sleeping")
                    && s.threads.first().is_some_and(|t| {
                        t.frames
                            .iter()
                            .take(3)
                            .any(|f| f.function.contains("sleep") && f.module.contains("libc"))
                    })
            });
            if asleep || Instant::now() > deadline {
                break stacks;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        };
        let _ = child.kill();
        let _ = child.wait();
        assert_eq!(stacks.len(), 1);
        let s = &stacks[0];
        assert_eq!(s.rank, Some(0));
        assert!(s.error.is_empty(), "{s:?}");
        assert!(
            s.native.contains("sleep") && s.native.contains("is not Python; it is sleeping"),
            "{}",
            s.native
        );
        assert_eq!(s.threads.len(), 1, "{s:?}");
        let main = &s.threads[0];
        assert_eq!(main.thread_id, u64::from(s.pid));
        // Innermost: libc's sleep, named by its dynamic symbols (the program itself is
        // stripped: its frames are there, unnamed, with their module).
        let sleep = main
            .frames
            .iter()
            .position(|f| f.function.contains("sleep") && f.module.contains("libc"))
            .unwrap_or_else(|| panic!("no libc sleep in {:?}", main.frames));
        assert!(sleep <= 2, "{:?}", main.frames);
        assert!(
            main.frames.iter().all(|f| !f.module.is_empty()),
            "{:?}",
            main.frames
        );
        assert!(
            main.frames.iter().any(|f| f.module.ends_with("/sleep")),
            "{:?}",
            main.frames
        );
    }

    /// A rank whose process is gone says so.
    #[tokio::test]
    async fn an_exited_worker_is_named_as_exited() {
        let mut child = std::process::Command::new("true").spawn().expect("true");
        let pid = child.id();
        child.wait().expect("wait");
        let workers = Workers::default();
        workers.started(3, WorkerRef { local_rank: 1, pid });
        let sampler = Sampler::start(workers, 0.0).expect("sampler");
        let stacks = sampler.dump(false).await;
        assert_eq!(stacks.len(), 1);
        assert_eq!(
            stacks[0].error,
            format!("process {pid} exited while it was being read")
        );
    }

    /// A Python worker that is stopped (SIGSTOP) is read as usual and said to be stopped; once
    /// it runs again, nothing is said.
    #[tokio::test]
    async fn a_stopped_python_worker_is_said_to_be_stopped() {
        use nix::sys::signal::{Signal, kill};
        let child = spawn(
            "python3",
            &["-c", "import time\nwhile True: time.sleep(0.05)"],
        );
        let sampler = sampler_of(&child, 0.0);
        let deadline = Instant::now() + Duration::from_secs(20);
        // Under a pyenv shim the Python is the shim's child: the process read is the one
        // stopped.
        let python = loop {
            let s = sampler.dump(false).await.remove(0);
            if !s.threads.is_empty() {
                assert_eq!(s.process_state, "", "{s:?}");
                break s.pid;
            }
            assert!(Instant::now() < deadline, "never read: {s:?}");
            tokio::time::sleep(Duration::from_millis(100)).await;
        };
        let pid = nix::unistd::Pid::from_raw(python as i32);
        kill(pid, Signal::SIGSTOP).unwrap();
        let stopped = loop {
            let s = sampler.dump(false).await.remove(0);
            if !s.process_state.is_empty() {
                break s;
            }
            assert!(Instant::now() < deadline, "never said stopped: {s:?}");
            tokio::time::sleep(Duration::from_millis(50)).await;
        };
        kill(pid, Signal::SIGCONT).unwrap();
        assert_eq!(
            stopped.process_state,
            "stopped (by SIGSTOP, a terminal's Ctrl-Z or a debugger): it runs nothing until it gets SIGCONT"
        );
        assert!(!stopped.threads.is_empty(), "{stopped:?}");
        let running = loop {
            let s = sampler.dump(false).await.remove(0);
            if s.process_state.is_empty() {
                break s;
            }
            assert!(Instant::now() < deadline, "still said stopped: {s:?}");
            tokio::time::sleep(Duration::from_millis(50)).await;
        };
        assert!(running.error.is_empty(), "{running:?}");
    }

    /// A child process, killed and reaped on drop.
    struct Child(std::process::Child);

    impl Drop for Child {
        fn drop(&mut self) {
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }

    fn spawn(program: &str, args: &[&str]) -> Child {
        Child(
            std::process::Command::new(program)
                .args(args)
                .spawn()
                .expect("spawn"),
        )
    }

    fn sampler_of(child: &Child, hz: f64) -> Sampler {
        let workers = Workers::default();
        workers.started(
            0,
            WorkerRef {
                local_rank: 0,
                pid: child.0.id(),
            },
        );
        Sampler::start(workers, hz).expect("sampler")
    }

    /// A Python worker's main thread is read from outside, innermost frame first, with the
    /// source of the user's line; nothing in the worker imports anything for it.
    #[tokio::test]
    async fn a_python_workers_stack_is_read_with_its_source_line() {
        let dir = std::env::temp_dir().join(format!("muster-stacks-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let script = dir.join("slow.py");
        std::fs::write(
            &script,
            "import time\n\n\ndef slow_data_step():\n    time.sleep(60)\n\n\nslow_data_step()\n",
        )
        .unwrap();
        let child = spawn("python3", &[script.to_str().unwrap()]);
        let sampler = sampler_of(&child, 0.0);
        let deadline = Instant::now() + Duration::from_secs(20);
        let stack = loop {
            let stacks = sampler.dump(false).await;
            let s = stacks.into_iter().next().expect("one rank");
            let settled = s.threads.first().is_some_and(|t| {
                t.frames
                    .first()
                    .is_some_and(|f| f.function == "slow_data_step")
            });
            if settled {
                break s;
            }
            assert!(Instant::now() < deadline, "never read: {s:?}");
            tokio::time::sleep(Duration::from_millis(100)).await;
        };
        let _ = std::fs::remove_dir_all(&dir);
        let main = &stack.threads[0];
        // Under a pyenv shim the Python is the shim's child: that one is read.
        assert_eq!(
            main.thread_id,
            u64::from(stack.pid),
            "the main thread first"
        );
        let f = &main.frames[0];
        assert_eq!((f.line, f.source.as_str()), (5, "time.sleep(60)"));
        assert!(f.file.ends_with("slow.py"), "{f:?}");
        assert_eq!(main.frames[1].function, "<module>");
        assert_eq!(main.frames[1].line, 8);
        assert!(
            main.frames[1].source.is_empty(),
            "only the innermost user frame"
        );
    }

    /// A native dump merges a Python worker's native frames into its stack: the C call
    /// `time.sleep` is in, then the Python frames, as py-spy's `--native` shows them.
    #[tokio::test]
    async fn a_python_workers_native_frames_are_merged_in_on_request() {
        let child = spawn(
            "python3",
            &["-c", "import time\nwhile True:\n    time.sleep(60)\n"],
        );
        let sampler = sampler_of(&child, 0.0);
        let deadline = Instant::now() + Duration::from_secs(20);
        let main = loop {
            let s = sampler.dump(true).await.remove(0);
            let main = s.threads.into_iter().next();
            // Settled once the innermost Python frame is the loop's sleep (not the
            // interpreter's start-up imports, whose frames may stand at any line).
            let settled = |m: &pb::ThreadStack| {
                m.frames
                    .iter()
                    .find(|f| f.module.is_empty())
                    .is_some_and(|f| f.function == "<module>" && f.line == 3)
            };
            if let Some(main) = main.filter(settled) {
                assert!(s.native.is_empty(), "{}", s.native);
                break main;
            }
            assert!(Instant::now() < deadline, "never read: {}", s.native);
            tokio::time::sleep(Duration::from_millis(100)).await;
        };
        let python = main
            .frames
            .iter()
            .position(|f| f.module.is_empty())
            .unwrap_or_else(|| panic!("no Python frame in {:?}", main.frames));
        assert_eq!(
            (
                main.frames[python].function.as_str(),
                main.frames[python].line
            ),
            ("<module>", 3)
        );
        let inner = &main.frames[..python];
        assert!(
            inner
                .iter()
                .any(|f| f.function.contains("sleep") && f.module.contains("libc")),
            "no libc sleep before the Python frame: {:?}",
            main.frames
        );
        // Without `native`, the same worker reads as Python frames only.
        let plain = sampler.dump(false).await.remove(0);
        assert!(
            plain.threads[0].frames.iter().all(|f| f.module.is_empty()),
            "{:?}",
            plain.threads[0].frames
        );
    }

    /// The progress rule's boundary: a worker that uses the CPU outside any wait makes
    /// progress even with a constant stack; one that sleeps makes none after it started.
    #[tokio::test]
    async fn a_busy_worker_makes_progress_and_a_sleeping_one_does_not() {
        let busy = spawn("sh", &["-c", "while :; do :; done"]);
        let mut sampler = sampler_of(&busy, 20.0);
        let mut progress = sampler.progress().unwrap();
        // Its start, then its CPU use, at most once a second.
        for _ in 0..2 {
            tokio::time::timeout(Duration::from_secs(3), next_progress(&mut progress))
                .await
                .expect("a busy worker makes progress");
        }
        drop(busy);

        let idle = spawn("sleep", &["30"]);
        let mut sampler = sampler_of(&idle, 20.0);
        let mut progress = sampler.progress().unwrap();
        tokio::time::timeout(Duration::from_secs(3), next_progress(&mut progress))
            .await
            .expect("its start is progress");
        // A dump (with its native stack) between samples is not a change of stack.
        let dumped = sampler.dump(true).await;
        assert!(!dumped[0].threads.is_empty(), "{:?}", dumped[0]);
        let more =
            tokio::time::timeout(Duration::from_millis(2500), next_progress(&mut progress)).await;
        assert!(more.is_err(), "a sleeping worker made progress");
        let stacks = sampler.dump(false).await;
        assert!(stacks[0].unchanged_ms >= 2000, "{:?}", stacks[0]);
    }

    /// A sleeping worker whose node relay completes barriers makes progress: a single-node
    /// job's barriers never reach the coordinator, which was all the hang detector counted.
    #[tokio::test]
    async fn barriers_the_relay_completes_are_progress() {
        let idle = spawn("sleep", &["30"]);
        let completed = Arc::new(AtomicU64::new(0));
        let mut sampler = sampler_of(&idle, 20.0).with_barriers(Arc::clone(&completed));
        let mut progress = sampler.progress().unwrap();
        tokio::time::timeout(Duration::from_secs(3), next_progress(&mut progress))
            .await
            .expect("its start is progress");
        let quiet =
            tokio::time::timeout(Duration::from_millis(1500), next_progress(&mut progress)).await;
        assert!(quiet.is_err(), "a sleeping worker made progress");
        completed.fetch_add(1, Ordering::Relaxed);
        tokio::time::timeout(Duration::from_secs(3), next_progress(&mut progress))
            .await
            .expect("a completed barrier is progress");
        let quiet =
            tokio::time::timeout(Duration::from_millis(1500), next_progress(&mut progress)).await;
        assert!(quiet.is_err(), "progress without a new barrier");
    }

    /// The next progress notice (sample summaries skipped).
    async fn next_progress(rx: &mut mpsc::UnboundedReceiver<Notice>) {
        loop {
            if let Notice::Progress = rx.recv().await.unwrap() {
                return;
            }
        }
    }

    /// A rank's window sums up to its share in syncs and its most frequent spots.
    #[test]
    fn a_window_sums_up_to_shares_and_spots() {
        let mut w = std::collections::VecDeque::new();
        for i in 0..10 {
            w.push_back((
                i < 7,
                if i < 7 {
                    "torch.autograd.backward"
                } else {
                    "train.py:9 load"
                }
                .to_owned(),
            ));
        }
        let s = summary(3, &w);
        assert_eq!(s.rank, Some(3));
        assert_eq!(s.samples, 10);
        assert!((s.waiting_share - 0.7).abs() < 1e-9);
        assert_eq!((s.busy_at.as_str(), s.busy_share), ("train.py:9 load", 0.3));
        assert_eq!(s.waiting_at, "torch.autograd.backward");
    }

    /// A Python worker that exits while it is being sampled and dumped, with and without its
    /// native frames: every read answers (a stack, or a line saying it exited), none fails the
    /// sampler, and the exit is left for its parent to reap (ptrace's stops never reap it).
    #[tokio::test]
    async fn a_worker_that_exits_while_sampled_is_named_as_exited() {
        let child = spawn(
            "python3",
            &[
                "-c",
                "import time\nfor _ in range(30):\n    time.sleep(0.01)\n",
            ],
        );
        let pid = child.0.id();
        let sampler = sampler_of(&child, 50.0);
        let deadline = Instant::now() + Duration::from_secs(20);
        let mut child = Some(child);
        for native in [false, true].into_iter().cycle() {
            let s = sampler.dump(native).await.remove(0);
            // A stack, a program (a zombie before it is reaped), no Python thread (the
            // interpreter finalizing), or why not.
            assert!(
                !s.threads.is_empty()
                    || !s.native.is_empty()
                    || (s.error.is_empty() && s.threads.is_empty())
                    || s.error.starts_with(&format!("process {pid} exited"))
                    || s.error.starts_with("py-spy could not read process")
                    || s.error.starts_with("py-spy cannot read this Python"),
                "{s:?}"
            );
            // A native read that lost the race says why, after the stack.
            assert!(
                s.native.is_empty()
                    || s.native.contains("not Python")
                    || s.native.starts_with("no native frames")
                    || s.native.contains("exited"),
                "{s:?}"
            );
            if let Some(c) = child.as_mut()
                && let Ok(Some(_)) = c.0.try_wait()
            {
                child = None;
            }
            if child.is_none() && s.error == format!("process {pid} exited while it was being read")
            {
                return;
            }
            assert!(Instant::now() < deadline, "{s:?}");
        }
    }

    /// The registry forgets a reaped worker, but not its respawn.
    #[test]
    fn a_respawn_outlives_its_predecessors_reaping() {
        let workers = Workers::default();
        workers.started(
            1,
            WorkerRef {
                local_rank: 1,
                pid: 10,
            },
        );
        workers.started(
            1,
            WorkerRef {
                local_rank: 1,
                pid: 11,
            },
        );
        workers.ended(1, 10);
        assert_eq!(workers.snapshot().get(&1).map(|w| w.pid), Some(11));
        workers.ended(1, 11);
        assert!(workers.snapshot().is_empty());
    }

    #[test]
    fn cpu_ticks_read_this_process() {
        assert!(cpu_ticks(std::process::id()).is_some());
    }
}
