//! The guardian: a tiny process per agent that kills the agent's workers, and everything they
//! started, when the agent dies without stopping them itself (SIGKILL, the OOM killer, a crash).
//!
//! The agent runs its own binary again with the hidden first argument [`GUARD_ARG`], its stdin
//! a pipe from the agent, in a process group of its own. The agent writes one line per event:
//! `+PGID` when a worker (and its process group) is spawned, `-PGID` once it has been reaped
//! and its output drained. The write end is close-on-exec (as every descriptor std opens), so
//! only the agent holds it: when the agent ends, however it ends, the kernel closes it and the
//! guardian reads end of file. It then kills what is still registered: SIGSTOP to each group
//! (nothing in it can fork any more), every descendant of those processes found through the
//! `/proc/*/stat` parent links and stopped in turn (so children that moved to another process
//! group or session are caught while their parent lives), then SIGKILL to the groups and to
//! every process collected. After a normal run every worker was reaped, nothing is registered
//! and the guardian exits quietly. Either way it then removes the agent's private folders under
//! the temporary folder that a killed agent leaves behind ([`remove_leftovers`]): the relay's
//! socket folders, the workers' error-file folder and the Flight Recorder's folder.
//!
//! Why not the alternatives: PR_SET_PDEATHSIG fires on the death of the parent *thread* and
//! reaches only direct children (a worker's own children escape); a child subreaper lets the
//! agent adopt orphans, but only while it lives, and a SIGKILLed agent cannot act at all;
//! process groups alone need someone alive to signal them. End of file on a pipe is the one
//! notice that survives SIGKILL, and it costs one process and one small write per worker.
//!
//! What it cannot catch: a process that left its worker's group *and* lost its parent before
//! the guardian walked the table is linked to nothing the guardian can see; only a cgroup holds
//! such a process. That is a daemon that double-forked, and (a race the guardian loses about
//! half the time) a child that left the group of a worker that was *stopped* when the agent
//! died: the kernel sends such a newly orphaned group SIGHUP at once, which may end the worker
//! before the guardian has read the table.

use nix::sys::signal::{SigSet, Signal, kill, killpg};
use nix::unistd::{Pid, getppid};
use std::collections::{BTreeSet, HashMap, HashSet};
use std::ffi::OsString;
use std::io::{BufRead, Write};
use std::os::unix::process::CommandExt;
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Mutex, PoisonError};
use std::time::Duration;

/// The hidden first argument that makes the agent's binary run as the guardian
/// (`muster-agent __guard <agent pid>`); `main.rs` dispatches it before parsing flags, so it
/// never shows in `--help`.
pub const GUARD_ARG: &str = "__guard";

/// An executable to run as the guardian (`<exe> __guard <pid>`) instead of the current one:
/// for programs that use the agent library without being `muster-agent` (tests), which set it
/// to the `muster-agent` binary. Without it such programs run without a guardian.
pub const GUARD_EXE_ENV: &str = "MUSTER_AGENT_GUARD_EXE";

/// How many times the process table is walked for new descendants before the kill.
const MAX_WALKS: usize = 16;
/// How many milliseconds the guardian waits, at most, for the dead agent's children to be
/// handed to a new parent.
const REPARENT_POLLS: u32 = 100;

/// Set by [`dispatch`]: this binary understands [`GUARD_ARG`].
static SELF_IS_GUARDIAN: AtomicBool = AtomicBool::new(false);
static GUARD: Mutex<State> = Mutex::new(State::NotStarted);

enum State {
    NotStarted,
    Running {
        child: Child,
        pipe: ChildStdin,
    },
    /// It could not start or has died; already said so.
    Unavailable,
}

/// Call first thing in `main`: when this process was started as the guardian, runs it and
/// returns its exit status; otherwise records that this binary can be run as the guardian
/// and returns `None`.
pub fn dispatch(args: &[OsString]) -> Option<u8> {
    let mut args = args.iter().skip(1);
    if args.next().is_some_and(|a| a == GUARD_ARG) {
        let agent = args.next().cloned().unwrap_or_else(|| OsString::from("?"));
        return Some(run(std::io::stdin().lock(), &agent.to_string_lossy()));
    }
    SELF_IS_GUARDIAN.store(true, Ordering::Relaxed);
    None
}

/// Starts the guardian now (if it is not running yet), before the agent creates its private
/// folders: the guardian removes them if the agent is killed, also before any worker exists.
pub fn start_now() {
    let mut state = GUARD.lock().unwrap_or_else(PoisonError::into_inner);
    if matches!(*state, State::NotStarted) {
        *state = start();
    }
}

/// Registers a worker's process group with the guardian, starting the guardian on first use.
/// If the guardian cannot run, says so once; the workers then still die with their groups on
/// every path the agent lives through.
pub fn register(pgid: Pid) {
    send('+', pgid);
}

/// Unregisters a process group once its worker has been reaped and nothing of it is left to
/// kill, so that the guardian never signals a group id the system may hand out again.
pub fn unregister(pgid: Pid) {
    send('-', pgid);
}

fn send(sign: char, pgid: Pid) {
    let mut state = GUARD.lock().unwrap_or_else(PoisonError::into_inner);
    if matches!(*state, State::NotStarted) {
        if sign == '-' {
            return;
        }
        *state = start();
    }
    let State::Running { child, pipe } = &mut *state else {
        return;
    };
    if let Err(e) = pipe.write_all(format!("{sign}{pgid}\n").as_bytes()) {
        eprintln!(
            "muster-agent: the guardian process ({}) is gone ({e}); workers may outlive the agent if it is killed",
            child.id()
        );
        let _ = child.try_wait();
        *state = State::Unavailable;
    }
}

fn start() -> State {
    let mut command = if let Some(exe) = std::env::var_os(GUARD_EXE_ENV).filter(|e| !e.is_empty()) {
        Command::new(exe)
    } else if SELF_IS_GUARDIAN.load(Ordering::Relaxed) {
        // The running image itself, even if its file has been replaced or deleted since.
        let mut command = Command::new("/proc/self/exe");
        if let Some(name) = std::env::args_os().next() {
            command.arg0(name);
        }
        command
    } else {
        tracing::debug!(
            "no guardian process: this program is not muster-agent and {GUARD_EXE_ENV} is unset"
        );
        return State::Unavailable;
    };
    let spawned = command
        .arg(GUARD_ARG)
        .arg(std::process::id().to_string())
        .stdin(Stdio::piped())
        .stdout(Stdio::null())
        // The real stderr, not the agent's relay pipe (console.rs): the guardian outlives it.
        .stderr(crate::console::child_stderr())
        .process_group(0)
        .spawn();
    match spawned {
        Ok(mut child) => match child.stdin.take() {
            Some(pipe) => State::Running { child, pipe },
            None => State::Unavailable,
        },
        Err(e) => {
            eprintln!(
                "muster-agent: cannot start the guardian process ({:?}: {e}); workers may outlive the agent if it is killed",
                command.get_program()
            );
            State::Unavailable
        }
    }
}

/// What the agent said about a process group.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Event {
    Add(i32),
    Remove(i32),
}

/// `+PGID` or `-PGID`; anything else (and a group id that could mean "my own group", "every
/// process" or init) is ignored.
fn parse(line: &[u8]) -> Option<Event> {
    let text = std::str::from_utf8(line).ok()?.trim_end();
    let (sign, number) = (text.get(..1)?, text.get(1..)?);
    let pgid: i32 = number.parse().ok().filter(|p| *p > 1)?;
    match sign {
        "+" => Some(Event::Add(pgid)),
        "-" => Some(Event::Remove(pgid)),
        _ => None,
    }
}

/// The guardian's life: follow the registrations until end of file, then kill what is left.
fn run(input: impl BufRead, agent: &str) -> u8 {
    ignore_job_control_signals();
    let parent = getppid();
    let mut groups = BTreeSet::new();
    for line in input.split(b'\n') {
        // A read error means the agent's end is gone too.
        let Ok(line) = line else { break };
        match parse(&line) {
            Some(Event::Add(g)) => {
                groups.insert(g);
            }
            Some(Event::Remove(g)) => {
                groups.remove(&g);
            }
            None => {}
        }
    }
    groups.remove(&std::process::id().cast_signed());
    if !groups.is_empty() {
        let killed = kill_all(&groups, parent);
        if killed > 0 {
            eprintln!(
                "muster-agent: the agent (pid {agent}) ended without stopping its workers; its guardian killed {killed} process(es) left in {} worker process group(s) and their descendants",
                groups.len()
            );
        }
    }
    // After the kill: a worker may have been writing its error file there.
    if let Ok(pid) = agent.parse::<u32>() {
        remove_leftovers(&std::env::temp_dir(), pid);
    }
    0
}

/// Removes the dead agent's private folders in `base` (the temporary folder, which the
/// guardian inherits from the agent): the relay's socket folders, `muster-<pid>-<16 hex
/// digits>` (`relay.rs`), the workers' error-file folder, `muster-agent-<pid>-<job>`
/// (`launch.rs`), and the Flight Recorder's, `muster-fr-<pid>-<n>` (`flight.rs`). The agent removes them itself whenever it lives to; after a SIGKILL only the
/// guardian can. Only real folders (not links) owned by this user are touched. The log folder
/// (`--log-dir`, or `muster-logs-<pid>`) is the user's and stays.
fn remove_leftovers(base: &std::path::Path, agent: u32) {
    let Ok(dir) = std::fs::read_dir(base) else {
        return;
    };
    use std::os::unix::fs::MetadataExt as _;
    // proc(5): `/proc/<pid>` belongs to the process's effective user.
    let Ok(me) = std::fs::metadata("/proc/self").map(|m| m.uid()) else {
        return;
    };
    for entry in dir.flatten() {
        let name = entry.file_name();
        if !name.to_str().is_some_and(|n| is_leftover(n, agent)) {
            continue;
        }
        let path = entry.path();
        let ours = std::fs::symlink_metadata(&path).is_ok_and(|m| m.is_dir() && m.uid() == me);
        if ours && let Err(e) = std::fs::remove_dir_all(&path) {
            eprintln!(
                "muster-agent guardian: cannot remove {} left by the agent (pid {agent}): {e}",
                path.display()
            );
        }
    }
}

/// Whether `name` is one of agent `agent`'s private folders (see [`remove_leftovers`]).
fn is_leftover(name: &str, agent: u32) -> bool {
    if let Some(random) = name.strip_prefix(&format!("muster-{agent}-")) {
        return random.len() == 16 && random.bytes().all(|b| b.is_ascii_hexdigit());
    }
    if let Some(n) = name.strip_prefix(&format!("muster-fr-{agent}-")) {
        return !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit());
    }
    name.strip_prefix(&format!("muster-agent-{agent}-"))
        .is_some_and(|job| !job.is_empty())
}

/// End of file comes when the dying agent closes its descriptors, a moment before the kernel
/// hands its children (the workers, and this process) to a new parent and signals the worker
/// groups it orphans. Waits (briefly) for that, so that what its SIGCONT woke can be stopped
/// again.
fn await_reparenting(parent: Pid) {
    for _ in 0..REPARENT_POLLS {
        if getppid() != parent {
            return;
        }
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// A Ctrl-C, a closed terminal or a stray SIGTERM must not end the guardian before the agent:
/// it lives in a process group of its own, and blocks these (a blocked signal stays pending,
/// and the guardian never unblocks them). Only SIGKILL ends it early.
fn ignore_job_control_signals() {
    let mut set = SigSet::empty();
    for signal in [
        Signal::SIGINT,
        Signal::SIGTERM,
        Signal::SIGHUP,
        Signal::SIGQUIT,
        Signal::SIGTSTP,
        Signal::SIGTTIN,
        Signal::SIGTTOU,
    ] {
        set.add(signal);
    }
    // Single-threaded: the thread's mask is the process's.
    if let Err(e) = set.thread_block() {
        eprintln!("muster-agent guardian: cannot block signals: {e}");
    }
}

/// One line of `/proc/<pid>/stat`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Entry {
    pid: i32,
    ppid: i32,
    pgid: i32,
    zombie: bool,
}

/// Collects the groups' members and every descendant of theirs, stopping each, then kills them
/// all; returns how many live processes were killed. `parent` is the agent's pid.
///
/// The first walk comes before any signal and as early as possible: when the dying agent hands
/// its children to a new parent, the kernel sends SIGHUP and SIGCONT to each worker group that
/// has a stopped member (an orphaned process group), and a worker that dies of that SIGHUP
/// hands its own children to init, where no parent link leads to them any more. Recorded by
/// pid first, they are killed wherever they went; what the SIGCONT woke is stopped again.
fn kill_all(groups: &BTreeSet<i32>, parent: Pid) -> usize {
    let me = std::process::id().cast_signed();
    let mut doomed: HashMap<i32, bool> = HashMap::new();
    let stop_all = |doomed: &HashMap<i32, bool>| {
        for &g in groups {
            // A group that no longer exists is the good case.
            let _ = killpg(Pid::from_raw(g), Signal::SIGSTOP);
        }
        for &pid in doomed.keys() {
            let _ = kill(Pid::from_raw(pid), Signal::SIGSTOP);
        }
    };
    for walk in 0..MAX_WALKS {
        let found = descendants(&process_table(), groups, &doomed, me);
        if walk > 0 && found.is_empty() {
            break;
        }
        for entry in found {
            // Stopped, it can fork no more while the table is walked again.
            let _ = kill(Pid::from_raw(entry.pid), Signal::SIGSTOP);
            doomed.insert(entry.pid, !entry.zombie);
        }
        if walk == 0 {
            stop_all(&doomed);
            await_reparenting(parent);
            stop_all(&doomed);
        }
    }
    for &g in groups {
        let _ = killpg(Pid::from_raw(g), Signal::SIGKILL);
    }
    for &pid in doomed.keys() {
        let _ = kill(Pid::from_raw(pid), Signal::SIGKILL);
    }
    doomed.values().filter(|live| **live).count()
}

/// The processes of `table` not yet in `known` that are members of `groups` or descendants
/// of such members (or of `known` processes), except `me`.
fn descendants(
    table: &[Entry],
    groups: &BTreeSet<i32>,
    known: &HashMap<i32, bool>,
    me: i32,
) -> Vec<Entry> {
    let mut children: HashMap<i32, Vec<&Entry>> = HashMap::new();
    for entry in table {
        children.entry(entry.ppid).or_default().push(entry);
    }
    let mut seen: HashSet<i32> = HashSet::new();
    let mut queue: Vec<&Entry> = table
        .iter()
        .filter(|e| groups.contains(&e.pgid) || known.contains_key(&e.pid))
        .collect();
    let mut found = Vec::new();
    while let Some(entry) = queue.pop() {
        if entry.pid == me || !seen.insert(entry.pid) {
            continue;
        }
        if !known.contains_key(&entry.pid) {
            found.push(*entry);
        }
        if let Some(kids) = children.get(&entry.pid) {
            queue.extend(kids.iter().copied());
        }
    }
    found
}

/// Every process in `/proc` (those that vanish while it is read are skipped).
fn process_table() -> Vec<Entry> {
    let Ok(dir) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    dir.filter_map(|e| {
        let pid: i32 = e.ok()?.file_name().to_str()?.parse().ok()?;
        let stat = crate::procfs::stat(u32::try_from(pid).ok()?)?;
        parse_stat(pid, &stat)
    })
    .collect()
}

/// `pid (comm) state ppid pgrp ...`; `comm` may hold spaces and parentheses.
fn parse_stat(pid: i32, stat: &str) -> Option<Entry> {
    let mut fields = crate::procfs::stat_fields(stat)?;
    let state = fields.next()?;
    let ppid = fields.next()?.parse().ok()?;
    let pgid = fields.next()?.parse().ok()?;
    Some(Entry {
        pid,
        ppid,
        pgid,
        zombie: matches!(state, "Z" | "X"),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn events() {
        for (line, expected) in [
            ("+123", Some(Event::Add(123))),
            ("-123\n", Some(Event::Remove(123))),
            ("+2", Some(Event::Add(2))),
            ("+1", None),
            ("+0", None),
            ("+-5", None),
            ("-", None),
            ("", None),
            ("*12", None),
            ("+12x", None),
            ("+99999999999", None),
        ] {
            assert_eq!(parse(line.as_bytes()), expected, "{line:?}");
        }
    }

    #[test]
    fn leftovers_are_the_agents_own_folders() {
        for (name, expected) in [
            ("muster-42-00112233aabbccdd", true),
            ("muster-42-00112233AABBCCDD", true),
            ("muster-agent-42-train", true),
            ("muster-fr-42-0", true),
            ("muster-fr-42-17", true),
            ("muster-fr-42-", false),
            ("muster-fr-42-x", false),
            ("muster-fr-420-0", false),
            ("muster-agent-42-", false),
            ("muster-42-00112233aabbccd", false),
            ("muster-42-00112233aabbccddee", false),
            ("muster-42-00112233aabbccdz", false),
            ("muster-420-00112233aabbccdd", false),
            ("muster-4-00112233aabbccdd", false),
            ("muster-agent-420-train", false),
            ("muster-logs-42", false),
            ("muster-agent-4-2-x", false),
            ("other", false),
        ] {
            assert_eq!(is_leftover(name, 42), expected, "{name}");
        }
    }

    #[test]
    fn stat_lines() {
        assert_eq!(
            parse_stat(42, "42 (sh) S 7 42 42 0 -1 4194560 ..."),
            Some(Entry {
                pid: 42,
                ppid: 7,
                pgid: 42,
                zombie: false
            })
        );
        assert_eq!(
            parse_stat(43, "43 (a) b (c)) Z 42 9 9 0"),
            Some(Entry {
                pid: 43,
                ppid: 42,
                pgid: 9,
                zombie: true
            })
        );
        assert_eq!(parse_stat(44, "44 (cut"), None);
        assert_eq!(parse_stat(44, "44 (x) S"), None);
    }

    fn entry(pid: i32, ppid: i32, pgid: i32) -> Entry {
        Entry {
            pid,
            ppid,
            pgid,
            zombie: false,
        }
    }

    /// The agent (10) and its guardian (11); worker 20 with a child in its group (21), a
    /// grandchild in a group of its own (22), and a great-grandchild in a new session (23);
    /// worker 30 already gone, its orphan 31 adopted by init; an unrelated process 40 whose
    /// group number is a worker's pid that is not registered.
    fn table() -> Vec<Entry> {
        vec![
            entry(1, 0, 1),
            entry(10, 1, 10),
            entry(11, 10, 11),
            entry(20, 10, 20),
            entry(21, 20, 20),
            entry(22, 21, 22),
            entry(23, 22, 23),
            entry(31, 1, 30),
            entry(40, 1, 50),
        ]
    }

    fn pids(found: &[Entry]) -> Vec<i32> {
        let mut pids: Vec<i32> = found.iter().map(|e| e.pid).collect();
        pids.sort_unstable();
        pids
    }

    #[test]
    fn descendants_follow_parents_across_groups_and_sessions() {
        let groups = BTreeSet::from([20, 30]);
        let found = descendants(&table(), &groups, &HashMap::new(), 11);
        assert_eq!(pids(&found), [20, 21, 22, 23, 31]);
        // Known processes are not found again, but their children still are.
        let known = HashMap::from([(20, true), (22, true)]);
        let mut grown = table();
        grown.push(entry(24, 22, 24));
        assert_eq!(
            pids(&descendants(&grown, &groups, &known, 11)),
            [21, 23, 24, 31]
        );
        // The guardian never picks itself.
        let odd = vec![entry(11, 20, 20), entry(20, 10, 20)];
        assert_eq!(pids(&descendants(&odd, &groups, &HashMap::new(), 11)), [20]);
    }
}
