//! Whether this replica may still act as the leader, and how long this process did not run:
//! the two rules that keep a leader woken past its lease from deciding anything. Shared by
//! the service, every job and the leadership loop (`ha.rs`), and depends on none of them.
//!
//! # A leader that did not run
//!
//! A leader can be stopped (SIGSTOP, a long pause, a starved machine) past its lease while a
//! standby takes over. When it runs again, every timer it had armed is due at once, and the
//! tokio tasks that fire them may run before the one that notices the lost lease: the old
//! leader would then fail nodes whose agents it merely did not read ("no heartbeat for 10 s")
//! and push that to the clients still connected to it. Two rules prevent it:
//!
//! - [`Tenure`]: every decision (failing a rank or node, a timer's verdict, a barrier entry,
//!   a push to a client stream) is taken only while the term's lease deadline has not passed
//!   (`Leadership::is_current`, the same local deadline `store/election.rs` steps down at). A job
//!   whose tenure lapsed counts as retired (`Job::retired`), its streams' pushes become one
//!   UNAVAILABLE ([`Tenure::guard`]) so clients move to the new leader, and the stream loops
//!   stop taking messages. With the memory store the tenure never lapses.
//! - [`within`]: liveness timeouts count only the time this process ran. A `stall-clock`
//!   thread ticks every 50 ms; a tick late by more than 200 ms means the process (or its
//!   machine) did not run for that long, and that time is not silence from the peer: the
//!   timeout is re-armed for what is left, so heartbeats that queued in the socket while the
//!   process slept are read before anyone is declared lost.

use crate::store::election::Leadership;
use std::future::Future;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock, PoisonError, RwLock};
use std::time::Duration;
use tokio::sync::mpsc;
use tonic::Status;

/// Whether this replica may act as the leader *now*: take a liveness decision, fail or
/// complete anything, push to a client. Shared by the coordinator and every job; the
/// leadership loop sets the term it leads under. See the module comment.
#[derive(Clone)]
pub struct Tenure {
    /// `false` with the memory store: the only coordinator always leads.
    elected: bool,
    term: Arc<RwLock<Option<Leadership>>>,
}

impl Tenure {
    /// A tenure that never lapses (the memory store).
    pub fn always() -> Self {
        Self {
            elected: false,
            term: Arc::new(RwLock::new(None)),
        }
    }

    /// A tenure held only under a term set by the leadership loop (the etcd store); none yet.
    pub fn elected() -> Self {
        Self {
            elected: true,
            term: Arc::new(RwLock::new(None)),
        }
    }

    /// Whether this replica leads now: always with the memory store; with etcd, while its
    /// term has not stepped down and the term's lease deadline has not passed by the local
    /// clock (whether or not the election task has run since).
    pub fn current(&self) -> bool {
        !self.elected
            || self
                .term
                .read()
                .unwrap_or_else(PoisonError::into_inner)
                .as_ref()
                .is_some_and(Leadership::is_current)
    }

    /// Acts under `term` from now on (`None`: under no term; nothing is decided).
    pub(crate) fn hold(&self, term: Option<Leadership>) {
        *self.term.write().unwrap_or_else(PoisonError::into_inner) = term;
    }

    /// The status a client gets instead of a decision this replica may no longer take: the
    /// client re-attaches to whoever leads now.
    pub fn lapsed() -> Status {
        Status::unavailable(
            "this coordinator's leadership lapsed (it is stepping down, or its lease deadline \
             passed while it did not run or could not reach etcd); re-attach to the leader",
        )
    }

    /// The stream a client reads from `rx`, ended with [`Tenure::lapsed`] in place of the
    /// first answer due once the tenure has lapsed: nothing decided by a deposed leader reaches
    /// a client, and the client learns to move on. A status already in `rx` (the stream's
    /// deliberate end, such as `Job::retire`'s) passes as it is.
    pub fn guard<T: Send + 'static>(
        &self,
        rx: mpsc::UnboundedReceiver<Result<T, Status>>,
    ) -> impl tokio_stream::Stream<Item = Result<T, Status>> + Send + 'static {
        use futures::StreamExt as _;
        let tenure = self.clone();
        tokio_stream::wrappers::UnboundedReceiverStream::new(rx).scan(false, move |ended, item| {
            let next = if *ended {
                None
            } else if item.is_err() || tenure.current() {
                Some(item)
            } else {
                *ended = true;
                Some(Err(Self::lapsed()))
            };
            std::future::ready(next)
        })
    }
}

/// How often the `stall-clock` thread ticks.
const STALL_TICK: Duration = Duration::from_millis(50);
/// How late a tick must be to count as time the process did not run.
const STALL_SLACK: Duration = Duration::from_millis(200);

/// Nanoseconds since the stall clock's start at its last tick.
static LAST_TICK_NS: AtomicU64 = AtomicU64::new(0);
/// Nanoseconds this process did not run, summed over the stalls the clock has seen.
static STALLED_NS: AtomicU64 = AtomicU64::new(0);

/// The stall clock's start; the first call starts its thread. Thread "stall-clock": one per
/// process, sleeps `STALL_TICK` at a time and records late wakeups for ever (it holds
/// nothing, and ends with the process).
fn stall_base() -> std::time::Instant {
    static BASE: OnceLock<std::time::Instant> = OnceLock::new();
    *BASE.get_or_init(|| {
        let spawned = std::thread::Builder::new()
            .name("stall-clock".into())
            .spawn(|| {
                let mut last = nanos_since_base();
                loop {
                    std::thread::sleep(STALL_TICK);
                    let now = nanos_since_base();
                    let gap = now.saturating_sub(last);
                    if gap > nanos(STALL_TICK + STALL_SLACK) {
                        // Counted before the tick moves, so a reader in between over-counts
                        // (a later verdict), never under-counts.
                        STALLED_NS.fetch_add(gap - nanos(STALL_TICK), Ordering::SeqCst);
                    }
                    LAST_TICK_NS.store(now, Ordering::SeqCst);
                    last = now;
                }
            });
        if let Err(e) = spawned {
            tracing::warn!("cannot start the stall clock; liveness timeouts ignore pauses: {e}");
        }
        std::time::Instant::now()
    })
}

fn nanos(d: Duration) -> u64 {
    u64::try_from(d.as_nanos()).unwrap_or(u64::MAX)
}

fn nanos_since_base() -> u64 {
    nanos(stall_base().elapsed())
}

/// Starts the stall clock (idempotent), so that pauses are measured from now on.
pub fn start_stall_clock() {
    let _ = stall_base();
}

/// How long this process has not run since the stall clock started, including a stall in
/// progress that the clock's thread has not seen end yet (the process just woke up).
pub fn stalled() -> Duration {
    let recorded = STALLED_NS.load(Ordering::SeqCst);
    let since_tick = nanos_since_base().saturating_sub(LAST_TICK_NS.load(Ordering::SeqCst));
    let in_progress = if since_tick > nanos(STALL_TICK + STALL_SLACK) {
        since_tick - nanos(STALL_TICK)
    } else {
        0
    };
    Duration::from_nanos(recorded.saturating_add(in_progress))
}

/// `fut`'s output, or `None` once `limit` has passed *while this process ran*: time it spent
/// stopped or starved (see [`stalled`]) does not count, so a peer is never declared silent for
/// a pause of our own. Cancel-safe if `fut` is.
pub async fn within<F: Future>(limit: Duration, fut: F) -> Option<F::Output> {
    let start = tokio::time::Instant::now();
    let mark = stalled();
    tokio::pin!(fut);
    let mut until = start + limit;
    loop {
        tokio::select! {
            biased;
            out = &mut fut => return Some(out),
            () = tokio::time::sleep_until(until) => {
                let slept = stalled().saturating_sub(mark);
                let ran = start.elapsed().saturating_sub(slept);
                if ran >= limit {
                    return None;
                }
                tracing::debug!(
                    slept_ms = slept.as_millis() as u64,
                    "a liveness timeout came due while this process did not run; re-armed"
                );
                until = tokio::time::Instant::now() + (limit - ran);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use futures::StreamExt as _;

    #[tokio::test]
    async fn a_running_process_times_out_after_the_limit() {
        start_stall_clock();
        let start = tokio::time::Instant::now();
        let out = within(Duration::from_millis(300), std::future::pending::<()>()).await;
        let took = start.elapsed();
        assert_eq!(out, None);
        assert!(took >= Duration::from_millis(300), "{took:?}");
        // The answer wins when it comes first.
        let answer = async {
            tokio::time::sleep(Duration::from_millis(20)).await;
            7
        };
        assert_eq!(within(Duration::from_secs(5), answer).await, Some(7));
    }

    #[tokio::test]
    async fn a_lapsed_tenure_ends_its_streams_instead_of_pushing() {
        // Memory store: the tenure never lapses; everything passes.
        let (tx, rx) = mpsc::unbounded_channel::<Result<u32, Status>>();
        tx.send(Ok(1)).unwrap();
        drop(tx);
        let items: Vec<_> = Tenure::always().guard(rx).collect().await;
        assert_eq!(items.len(), 1);
        assert_eq!(*items[0].as_ref().unwrap(), 1);
        assert!(Tenure::always().current());

        // Elected, with no term (or a term whose lease deadline passed): the first push
        // becomes UNAVAILABLE, and the stream ends there.
        let tenure = Tenure::elected();
        assert!(!tenure.current());
        let (tx, rx) = mpsc::unbounded_channel::<Result<u32, Status>>();
        tx.send(Ok(1)).unwrap();
        tx.send(Ok(2)).unwrap();
        drop(tx);
        let items: Vec<_> = tenure.guard(rx).collect().await;
        assert_eq!(items.len(), 1, "{items:?}");
        let status = items[0].as_ref().unwrap_err();
        assert_eq!(status.code(), tonic::Code::Unavailable);
        assert!(status.message().contains("leadership lapsed"), "{status:?}");

        // A deliberate end already queued (a step-down's own message) passes as it is.
        let (tx, rx) = mpsc::unbounded_channel::<Result<u32, Status>>();
        tx.send(Err(Status::unavailable("coordinator a:1 is shutting down")))
            .unwrap();
        drop(tx);
        let items: Vec<_> = tenure.guard(rx).collect().await;
        let status = items[0].as_ref().unwrap_err();
        assert_eq!(status.message(), "coordinator a:1 is shutting down");
    }
}
