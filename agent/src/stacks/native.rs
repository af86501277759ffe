//! Native frames of a node's workers, read on a dump (never while sampling): a Python
//! worker's stacks with its native frames merged in (py-spy's `native` mode, libunwind), and
//! the native stack of a worker that is not Python (framehop over its binaries' `.eh_frame`;
//! libunwind 1.6 loses Rust binaries linked by lld after their first frame). Both are named
//! by py-spy's symbolicator (`remoteprocess`). x86-64 only: elsewhere a program's threads come
//! without frames.
//!
//! Both pause the worker for the read: each of its threads is seized with ptrace, stopped,
//! unwound and let go (about a millisecond). The first read of a process parses its binaries'
//! symbol tables (about a second for a torch worker); the readers are kept per process, so
//! later reads only unwind.
//!
//! The agent is its workers' parent, so the stops are awaited here ([`Stopped`]) rather than
//! by py-spy's and remoteprocess's own lock: theirs waits with `waitpid`, which also reaps a
//! worker that exits meanwhile, and the supervisor would then lose its exit status. Ours waits
//! with `waitid(WSTOPPED)`, which reports stops only. The supervisor learns of an exit through
//! the worker's pidfd, which a stop does not make readable.

use super::{frames_of, permission_cause};
use framehop::x86_64::{CacheX86_64, UnwindRegsX86_64, UnwinderX86_64};
use framehop::{ExplicitModuleSectionInfo, FrameAddress, Module, Unwinder};
use muster_proto::v1 as pb;
use nix::errno::Errno;
use nix::sys::ptrace;
use nix::sys::wait::{Id, WaitPidFlag, WaitStatus, waitid};
use nix::unistd::Pid;
use py_spy::{Config, PythonSpy};
use std::collections::HashSet;
use std::os::unix::fs::FileExt;
use std::path::Path;
use std::time::{Duration, Instant};

/// How long a seized thread may take to stop before the read gives up on the process.
const STOP_WAIT: Duration = Duration::from_millis(500);

/// The most frames a native thread's stack keeps (an unwinder lost in a corrupt stack
/// stops here).
const MAX_FRAMES: usize = 256;

/// A Python worker's threads with their native frames, read with `spy` (attached on first
/// use), the main thread first; or why they cannot be read, in one line.
pub fn python_threads(
    spy: &mut Option<PythonSpy>,
    pid: u32,
) -> Result<Vec<pb::ThreadStack>, String> {
    if spy.is_none() {
        let config = Config {
            native: true,
            // Stopped here ([`Stopped`]), not by py-spy's lock, which could reap the worker.
            blocking: py_spy::config::LockingStrategy::AlreadyLocked,
            include_idle: true,
            collect_thread_names: true,
            dump_locals: 0,
            ..Config::default()
        };
        let attached = std::panic::catch_unwind(|| PythonSpy::new(pid as py_spy::Pid, &config))
            .unwrap_or_else(|_| Err(anyhow::anyhow!("an attach raced with the running worker")));
        *spy = Some(attached.map_err(|e| why(pid, &format!("{e:#}")))?);
    }
    let Some(reader) = spy.as_mut() else {
        return Err(why(pid, "no reader"));
    };
    let stopped = Stopped::stop(pid).map_err(|e| why(pid, &e))?;
    let read = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| reader.get_stack_traces()))
        .unwrap_or_else(|_| Err(anyhow::anyhow!("a read raced with the running worker")));
    drop(stopped);
    match read {
        Ok(traces) => Ok(frames_of(&traces, pid)),
        Err(e) => {
            *spy = None;
            Err(why(pid, &format!("{e:#}")))
        }
    }
}

/// What unwinds a program that is not Python, kept across dumps: its binaries' unwind
/// sections and symbols are parsed once (a binary mapped later is added at the next dump).
pub struct Program {
    unwinder: UnwinderX86_64<Vec<u8>>,
    cache: CacheX86_64,
    /// The executable mappings added to `unwinder`: (start address, path).
    modules: HashSet<(u64, String)>,
    symbols: remoteprocess::Symbolicator,
    /// The process's memory, for the unwinder's stack reads.
    memory: std::fs::File,
}

/// The native threads of `pid`, a program that is not Python, read with `program` (made on
/// first use), the main thread first; or why they cannot be read, in one line.
pub fn program_threads(
    program: &mut Option<Program>,
    pid: u32,
) -> Result<Vec<pb::ThreadStack>, String> {
    if program.is_none() {
        let symbols = remoteprocess::Symbolicator::new(pid as remoteprocess::Pid)
            .map_err(|e| why(pid, &e.to_string()))?;
        let memory = std::fs::File::open(format!("/proc/{pid}/mem"))
            .map_err(|e| why(pid, &format!("cannot open its memory: {e}")))?;
        *program = Some(Program {
            unwinder: UnwinderX86_64::new(),
            cache: CacheX86_64::new(),
            modules: HashSet::new(),
            symbols,
            memory,
        });
    }
    let Some(p) = program.as_mut() else {
        return Err(why(pid, "no unwinder"));
    };
    if add_modules(p, pid) {
        let _ = p.symbols.reload();
    }
    let stopped = Stopped::stop(pid).map_err(|e| why(pid, &e))?;
    let threads: Vec<(u64, Vec<FrameAddress>)> = stopped
        .threads
        .iter()
        .map(|&tid| {
            (
                u64::try_from(tid.as_raw()).unwrap_or_default(),
                unwind(p, tid),
            )
        })
        .collect();
    drop(stopped);
    let mut out: Vec<pb::ThreadStack> = threads
        .into_iter()
        .map(|(tid, addresses)| pb::ThreadStack {
            thread_id: tid,
            name: std::fs::read_to_string(format!("/proc/{pid}/task/{tid}/comm"))
                .map(|n| n.trim().to_owned())
                .unwrap_or_default(),
            active: false,
            frames: addresses
                .iter()
                .flat_map(|a| symbolize(&p.symbols, a.address_for_lookup()))
                .collect(),
        })
        .collect();
    out.sort_by_key(|t| (t.thread_id != u64::from(pid), t.thread_id));
    Ok(out)
}

/// The stopped thread `tid`'s frames, innermost first: from its registers, through each
/// binary's call frame information (frame pointers where there is none). A thread whose
/// registers cannot be read has none.
fn unwind(p: &mut Program, tid: Pid) -> Vec<FrameAddress> {
    let Some((rip, rsp, rbp)) = registers(tid) else {
        return Vec::new();
    };
    let memory = &p.memory;
    let mut read_stack = |address: u64| {
        let mut word = [0u8; 8];
        memory
            .read_exact_at(&mut word, address)
            .map(|()| u64::from_le_bytes(word))
            .map_err(|_| ())
    };
    let mut frames = Vec::new();
    let mut iter = p.unwinder.iter_frames(
        rip,
        UnwindRegsX86_64::new(rip, rsp, rbp),
        &mut p.cache,
        &mut read_stack,
    );
    // An error ends the stack where the unwinder could not go on.
    while let Ok(Some(frame)) = iter.next() {
        frames.push(frame);
        if frames.len() == MAX_FRAMES {
            break;
        }
    }
    frames
}

/// The stopped thread's instruction, stack and frame pointers.
#[cfg(target_arch = "x86_64")]
fn registers(tid: Pid) -> Option<(u64, u64, u64)> {
    let regs = ptrace::getregs(tid).ok()?;
    Some((regs.rip, regs.rsp, regs.rbp))
}

/// Not unwound on other architectures (see the module's doc).
#[cfg(not(target_arch = "x86_64"))]
fn registers(_tid: Pid) -> Option<(u64, u64, u64)> {
    None
}

/// Adds the process's executable mappings not added yet to the unwinder; whether any was.
/// A binary that cannot be read or parsed is left out (its frames then end the stack, or are
/// stepped over by frame pointers).
fn add_modules(p: &mut Program, pid: u32) -> bool {
    let Ok(maps) = std::fs::read_to_string(format!("/proc/{pid}/maps")) else {
        return false;
    };
    let mut added = false;
    for line in maps.lines() {
        // start-end perms offset dev inode path
        let mut fields = line.split_whitespace();
        let (Some(range), Some(perms), Some(offset)) =
            (fields.next(), fields.next(), fields.next())
        else {
            continue;
        };
        let path = fields.nth(2).unwrap_or_default();
        if !perms.contains('x') || !path.starts_with('/') {
            continue;
        }
        let Some((start, end)) = range.split_once('-') else {
            continue;
        };
        let (Ok(start), Ok(end), Ok(offset)) = (
            u64::from_str_radix(start, 16),
            u64::from_str_radix(end, 16),
            u64::from_str_radix(offset, 16),
        ) else {
            continue;
        };
        if !p.modules.insert((start, path.to_owned())) {
            continue;
        }
        if let Some(module) = module(path, start..end, offset) {
            p.unwinder.add_module(module);
            added = true;
        }
    }
    added
}

/// The unwinder's view of the binary at `path`, mapped executable at `avma` from file offset
/// `offset`: its load bias and its text and unwind sections.
fn module(path: &str, avma: std::ops::Range<u64>, offset: u64) -> Option<Module<Vec<u8>>> {
    use object::{Object, ObjectSection, ObjectSegment};
    // Read on demand: only the headers and the sections below, not the whole binary.
    let file = object::ReadCache::new(std::fs::File::open(path).ok()?);
    let elf = object::File::parse(&file).ok()?;
    // The executable segment the mapping holds gives the load bias. The mapping starts at a
    // page boundary at or before the segment's file offset, and a segment's address need not
    // equal its file offset (lld, Rust's default linker, shifts them apart): the bias is the
    // segment's address less its file offset's distance past the mapping's.
    let svma = elf.segments().find_map(|s| {
        let (file_start, size) = s.file_range();
        let executable = matches!(s.flags(), object::SegmentFlags::Elf { p_flags, .. } if p_flags.0 & object::elf::PF_X.0 != 0);
        (executable && file_start & !0xfff <= offset && offset < file_start + size)
            .then(|| s.address().wrapping_sub(file_start.wrapping_sub(offset)))
    })?;
    let bias = avma.start.wrapping_sub(svma);
    let section = |name: &str| {
        elf.section_by_name(name).and_then(|s| {
            let range = s.address()..s.address() + s.size();
            s.uncompressed_data().ok().map(|d| (range, d.into_owned()))
        })
    };
    let (text_svma, text) = section(".text").unzip();
    let (eh_frame_svma, eh_frame) = section(".eh_frame").unzip();
    let (eh_frame_hdr_svma, eh_frame_hdr) = section(".eh_frame_hdr").unzip();
    let got_svma = elf
        .section_by_name(".got")
        .map(|s| s.address()..s.address() + s.size());
    let debug_frame = section(".debug_frame").map(|(_, d)| d);
    Some(Module::new(
        path.to_owned(),
        avma,
        bias,
        ExplicitModuleSectionInfo {
            base_svma: 0,
            text_svma,
            text,
            got_svma,
            eh_frame_svma,
            eh_frame,
            eh_frame_hdr_svma,
            eh_frame_hdr,
            debug_frame,
            ..Default::default()
        },
    ))
}

/// A process with every thread seized and stopped by this thread (ptrace), let go when
/// dropped. It never reaps the process (see the module's doc).
struct Stopped {
    threads: Vec<Pid>,
}

impl Stopped {
    /// Stops every thread of `pid`, again for threads started meanwhile; a thread that ends
    /// meanwhile is left out. Errors name the cause (`EPERM`: no permission, or another
    /// tracer holds it).
    fn stop(pid: u32) -> Result<Stopped, String> {
        let mut stopped = Stopped {
            threads: Vec::new(),
        };
        loop {
            let tasks = std::fs::read_dir(format!("/proc/{pid}/task"))
                .map_err(|e| format!("cannot list its threads: {e}"))?;
            let new: Vec<Pid> = tasks
                .flatten()
                .filter_map(|t| t.file_name().to_str()?.parse::<i32>().ok())
                .map(Pid::from_raw)
                .filter(|t| !stopped.threads.contains(t))
                .collect();
            if new.is_empty() {
                break;
            }
            for tid in new {
                match ptrace::seize(tid, ptrace::Options::PTRACE_O_TRACEEXIT) {
                    Ok(()) => stopped.threads.push(tid),
                    // Ended meanwhile (an exiting thread answers EPERM).
                    Err(Errno::ESRCH) => continue,
                    Err(Errno::EPERM) if !thread_exists(pid, tid) => continue,
                    Err(e) => return Err(format!("cannot seize thread {tid}: {e}")),
                }
                if !stop_one(tid)? {
                    stopped.threads.retain(|t| *t != tid);
                    let _ = ptrace::detach(tid, None);
                }
            }
        }
        if stopped.threads.is_empty() {
            return Err("it has no thread left to read".to_owned());
        }
        Ok(stopped)
    }
}

impl Drop for Stopped {
    fn drop(&mut self) {
        for &tid in &self.threads {
            // A thread that ended while stopped is gone already.
            let _ = ptrace::detach(tid, None);
        }
    }
}

/// Interrupts the seized `tid` and waits for its stop; `false` when it ended instead. A
/// signal that arrives first is passed on.
fn stop_one(tid: Pid) -> Result<bool, String> {
    match ptrace::interrupt(tid) {
        Ok(()) => {}
        Err(Errno::ESRCH) => return Ok(false),
        Err(e) => return Err(format!("cannot stop thread {tid}: {e}")),
    }
    let deadline = Instant::now() + STOP_WAIT;
    loop {
        let flags = WaitPidFlag::WSTOPPED | WaitPidFlag::__WALL | WaitPidFlag::WNOHANG;
        match waitid(Id::Pid(tid), flags) {
            Ok(WaitStatus::PtraceEvent(..)) => return Ok(true),
            Ok(WaitStatus::Stopped(_, signal)) => {
                // A signal-delivery stop before our interrupt's: deliver it and wait on.
                if ptrace::cont(tid, signal).is_err() {
                    return Ok(false);
                }
            }
            Ok(_) => {
                if Instant::now() >= deadline {
                    return Ok(false);
                }
                std::thread::sleep(Duration::from_micros(200));
            }
            Err(Errno::ECHILD | Errno::ESRCH) => return Ok(false),
            Err(e) => return Err(format!("cannot wait for thread {tid} to stop: {e}")),
        }
    }
}

fn thread_exists(pid: u32, tid: Pid) -> bool {
    Path::new(&format!("/proc/{pid}/task/{tid}")).exists()
}

/// The frames at `ip` (more than one where calls were inlined), innermost first; an address
/// in no known binary is one frame with no name.
fn symbolize(symbols: &remoteprocess::Symbolicator, ip: u64) -> Vec<pb::StackFrame> {
    let mut frames = Vec::new();
    let _ = symbols.symbolicate(ip, true, &mut |f| frames.push(frame(f)));
    if frames.is_empty() {
        frames.push(pb::StackFrame::default());
    }
    frames
}

fn frame(f: &remoteprocess::StackFrame) -> pb::StackFrame {
    let file = f.filename.clone().filter(|name| *name != f.module);
    pb::StackFrame {
        function: f.function.as_deref().map(demangle).unwrap_or_default(),
        line: file
            .as_ref()
            .and(f.line)
            .and_then(|l| u32::try_from(l).ok())
            .unwrap_or(0),
        file: file.unwrap_or_default(),
        source: String::new(),
        module: f.module.clone(),
    }
}

/// A Rust symbol's name demangled (legacy or v0 mangling, without the hash); any other name
/// as it is (py-spy's symbolicator demangles C++ itself).
pub fn demangle(name: &str) -> String {
    match rustc_demangle::try_demangle(name) {
        Ok(d) => format!("{d:#}"),
        Err(_) => name.to_owned(),
    }
}

/// Why `pid`'s native frames cannot be read, as one line with the fix where there is one.
fn why(pid: u32, error: &str) -> String {
    if !Path::new(&format!("/proc/{pid}")).exists() {
        return format!("process {pid} exited while it was being read");
    }
    if error.contains("EPERM") || error.contains("Operation not permitted") {
        return format!(
            "no native frames: {} (or another tracer, a debugger or py-spy, holds it)",
            permission_cause(pid)
        );
    }
    format!("no native frames: {error}")
}
