//! Which process and thread a call comes from, answered without a system call: every wait asks
//! both (a forked child must not use its parent's connection; only the main thread answers
//! signals), and at a barrier's rate the `getpid`/`gettid` calls were a measurable share of a
//! Python barrier's own time.
//!
//! A fork is counted by a `pthread_atfork` child handler, so an [`Owner`] made before a fork
//! knows it is in a child afterwards; the main-thread answer is kept per thread and asked again
//! after a fork (a thread that forked is its child's main thread).

use std::{
    cell::Cell,
    sync::{
        Once,
        atomic::{AtomicU64, Ordering},
    },
};

/// Forks this process's line has gone through since the module was loaded: each child's
/// handler adds one, so a child's count differs from its parent's at the time of the fork.
static FORKS: AtomicU64 = AtomicU64::new(0);

extern "C" fn forked_child() {
    // Only an atomic add: async-signal-safe, as a handler that runs after fork must be.
    FORKS.fetch_add(1, Ordering::Relaxed);
}

fn forks() -> u64 {
    static REGISTER: Once = Once::new();
    REGISTER.call_once(|| {
        // SAFETY: pthread_atfork only records the handlers; `forked_child` is a plain
        // `extern "C"` function that lives as long as the process (the module is never
        // unloaded by CPython) and does nothing that is unsafe after a fork.
        #[allow(unsafe_code)]
        let rc = unsafe { nix::libc::pthread_atfork(None, None, Some(forked_child)) };
        // It fails only without memory for the handler; then every check below falls back
        // to comparing process ids.
        if rc != 0 {
            FORKS.store(u64::MAX, Ordering::Relaxed);
        }
    });
    FORKS.load(Ordering::Relaxed)
}

/// The process that made an object (an accelerator or a communicator), which only it may use.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Owner {
    /// Its process id, for messages.
    pub(crate) pid: u32,
    forks: u64,
}

impl Owner {
    /// This process.
    pub(crate) fn current() -> Self {
        Self {
            pid: std::process::id(),
            forks: forks(),
        }
    }

    /// Whether the caller runs in the process that made it (not in a forked child).
    pub(crate) fn is_current(&self) -> bool {
        let forks = forks();
        if forks == u64::MAX {
            return std::process::id() == self.pid;
        }
        forks == self.forks
    }
}

/// Whether this is the process's main thread (the one CPython runs signal handlers on).
pub(crate) fn on_main_thread() -> bool {
    thread_local! {
        /// (the fork count when asked, the answer then).
        static MAIN: Cell<Option<(u64, bool)>> = const { Cell::new(None) };
    }
    let now = forks();
    MAIN.with(|main| match main.get() {
        Some((asked, answer)) if asked == now && now != u64::MAX => answer,
        _ => {
            let answer = nix::unistd::gettid() == nix::unistd::getpid();
            main.set(Some((now, answer)));
            answer
        }
    })
}
