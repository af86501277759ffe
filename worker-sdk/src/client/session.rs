//! A worker's session with the coordinator: one bidirectional stream that registers the rank,
//! keeps it alive with heartbeats, carries its barriers, re-attaches to the new leader after a
//! failover, and reports the generation's failure ([`FailureWatch`]).

use std::{
    collections::hash_map::DefaultHasher,
    error::Error as StdError,
    fmt,
    hash::{Hash, Hasher},
    sync::{
        Arc, Condvar, Mutex, MutexGuard, PoisonError,
        atomic::{AtomicU64, Ordering},
    },
    time::Duration,
};

use muster_proto::v1::{
    self as pb, CoordinatorMessage, WorkerMessage, barrier_error::Kind as BarrierErrorKind,
    coordinator_message, session_client::SessionClient, worker_message,
};
use tokio::{
    sync::{Notify, mpsc, oneshot},
    task::JoinHandle,
    time::{Instant, MissedTickBehavior},
};
use tokio_stream::wrappers::ReceiverStream;
use tonic::Streaming;
use tracing::Instrument as _;

use super::{Coordinator, Current, Kv, SharedValues, UniqueIds};
use crate::{
    Error,
    failover::{self, Retry, Verdict},
    trace_context,
};

/// Room for outgoing session messages: at most one barrier per scope, a heartbeat and `leave`
/// are ever in flight, so a little slack is plenty.
const OUTBOUND_CAPACITY: usize = 16;
/// Heartbeat period used if the coordinator says 0.
const DEFAULT_HEARTBEAT: Duration = Duration::from_secs(1);
/// How long [`Session::leave`] waits for the coordinator to close the stream after `leave`.
const LEAVE_GRACE: Duration = Duration::from_secs(5);

/// Which ranks a barrier spans: `Global` (every rank of the generation, `wait_for_everyone`)
/// or `Node` (the ranks of the caller's node, `wait_for_local`). The coordinator's type.
pub use muster_core::model::Scope;

/// Who a session registers as: the identity every call of a worker carries.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SessionConfig {
    /// The job id.
    pub job_id: String,
    /// The generation the worker belongs to (from 1).
    pub generation: u64,
    /// The worker's global rank.
    pub rank: u32,
    /// The worker's process id, shown in the ops view.
    pub pid: u32,
    /// The worker's host, shown in other ranks' error messages.
    pub host: String,
}

/// What the coordinator answered to `register`: the generation as it sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Registration {
    /// How often the session sends heartbeats.
    pub heartbeat_interval: Duration,
    /// Ranks in the generation.
    pub world_size: u32,
    /// This rank's node.
    pub node_rank: u32,
    /// Nodes in the generation.
    pub num_nodes: u32,
}

/// A worker's session with the coordinator: one bidirectional stream that registers the rank,
/// keeps it alive with heartbeats and carries its barriers.
///
/// One background task per session sends the heartbeats and routes barrier results to their
/// callers. When the stream breaks in a way a coordinator failover explains (a transport
/// error, UNAVAILABLE, or an end without `leave`), the task re-opens it on the leader with
/// `resume`, telling the coordinator the last barrier of each scope it was released from, and
/// sends again every barrier entry that was not answered: callers waiting in
/// [`Session::barrier`] only see a delay, and the [`FailureWatch`] does not fire. Only when
/// the failover budget ([`Coordinator::failover_timeout`]) runs out, or the coordinator
/// refuses the re-attach on purpose (the generation failed or was superseded, the job is
/// gone), is the session lost, as a broken stream was before.
///
/// [`Session::leave`] ends the session cleanly. Dropping a session without `leave` ends the
/// stream without it, which the coordinator treats as this rank failing — the same as a crash.
pub struct Session {
    coordinator: Coordinator,
    config: SessionConfig,
    registration: Registration,
    shared: Arc<Shared>,
    task: Option<JoinHandle<()>>,
    failures: FailureWatch,
}

impl fmt::Debug for Session {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Session")
            .field("coordinator", &self.coordinator)
            .field("config", &self.config)
            .field("registration", &self.registration)
            .finish_non_exhaustive()
    }
}

/// State shared between the callers and the session task; its lock is held for a few
/// instructions at a time, never across an await.
struct Shared {
    state: Mutex<RouterState>,
    /// Wakes the session task to send `leave` (see [`Session::leave`]).
    leaving: Notify,
}

struct RouterState {
    scopes: [Slot; 2],
    /// The request side of the current stream. `None` while the task re-attaches after a
    /// failover (entries recorded in the slots are sent when it is back), once `leave` went
    /// out and once the session is lost. Callers only borrow clones for a send.
    outbound: Option<mpsc::Sender<WorkerMessage>>,
    /// Counts the streams opened: room reserved on an earlier stream must not carry an entry,
    /// since a newer stream already got every entry recorded when it opened.
    stream: u64,
    leave: Leave,
    /// Set when the session ended or broke for good; every later call fails with it.
    lost: Option<Arc<dyn StdError + Send + Sync>>,
}

/// Where `leave` is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Leave {
    No,
    /// [`Session::leave`] asked for it; the session task sends it (on a re-attached stream
    /// if the current one breaks first).
    Requested,
    /// Handed to the stream: its end is now the session's end, not a failover.
    Sent,
}

/// One barrier scope: the next sequence number and what is known about the entry for it.
struct Slot {
    /// The seq of the next barrier to enter, or of the entry at the coordinator (from 1).
    next_seq: u64,
    /// Hash of the name of the entry at the coordinator, to tell a retry of a cancelled call
    /// from a new barrier.
    name_hash: u64,
    pending: Pending,
}

enum Pending {
    /// No entry at the coordinator.
    Idle,
    /// The entry for `next_seq` is at the coordinator (or will be sent when the stream is
    /// re-attached; it is sent again after every failover until answered). If the receiver is
    /// gone, its caller was cancelled and the entry is abandoned (see [`Session::barrier`]).
    Waiting(oneshot::Sender<Outcome>, pb::BarrierEnter),
    /// The result of the abandoned entry at this seq (the counter has already moved past it
    /// if the result consumed the seq).
    Parked(u64, Option<pb::BarrierError>),
}

/// What the session task hands a barrier caller.
enum Outcome {
    /// The coordinator's result: `None` on success.
    Done(Option<pb::BarrierError>),
    /// The session was lost.
    Lost(Arc<dyn StdError + Send + Sync>),
}

/// Why the stream ended when the coordinator closed it without an error status.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
struct StreamEnded(&'static str);

/// Why a session could not be re-attached after its stream broke: what the session's callers
/// get, with the last failure as its source.
#[derive(Debug)]
enum ReattachError {
    /// The failover budget ran out; the source is the last attempt's failure.
    OutOfTime {
        budget: Duration,
        source: Arc<dyn StdError + Send + Sync>,
    },
    /// A replica answered the re-attach with a deliberate status (the source).
    Refused {
        addr: Arc<str>,
        source: tonic::Status,
    },
    /// A replica answered something the protocol does not allow.
    Protocol(String),
}

impl fmt::Display for ReattachError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let prefix = "the session stream broke and could not re-attach after failover";
        match self {
            ReattachError::OutOfTime { budget, .. } => write!(
                f,
                "{prefix} within {:.1} s (MUSTER_FAILOVER_TIMEOUT_MS)",
                budget.as_secs_f64()
            ),
            ReattachError::Refused { addr, .. } => {
                write!(f, "{prefix}: the coordinator at {addr} refused it")
            }
            ReattachError::Protocol(message) => write!(f, "{prefix}: {message}"),
        }
    }
}

impl StdError for ReattachError {
    fn source(&self) -> Option<&(dyn StdError + 'static)> {
        // The inner error itself (not the `Arc`), so that a status in it is shown by its code.
        match self {
            ReattachError::OutOfTime { source, .. } => Some(&**source),
            ReattachError::Refused { source, .. } => Some(source),
            ReattachError::Protocol(_) => None,
        }
    }
}

/// Sends a session's one-way reports: no answer and no wait; a report that finds the stream
/// full, or away during a failover, is dropped (see [`Session::step_begun`]).
#[derive(Clone)]
pub struct Reports(Arc<Shared>);

impl fmt::Debug for Reports {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Reports").finish_non_exhaustive()
    }
}

impl Reports {
    /// Says that this rank finished healing for the quorum of membership epoch `epoch` (it
    /// received its source's state): the recovery's timeline (`describe`) records when.
    pub fn healed(&self, epoch: u64) {
        self.0
            .report(worker_message::Kind::Healed(pb::Healed { epoch }));
    }
}

impl Shared {
    /// Sends a one-way report on the current stream, if there is one and it has room.
    fn report(&self, kind: worker_message::Kind) {
        let state = self.lock();
        if let Some(outbound) = &state.outbound {
            let _ = outbound.try_send(message(kind));
        }
    }

    fn new() -> Self {
        Self {
            state: Mutex::new(RouterState {
                scopes: [Slot::new(), Slot::new()],
                outbound: None,
                stream: 0,
                leave: Leave::No,
                lost: None,
            }),
            leaving: Notify::new(),
        }
    }

    fn lock(&self) -> MutexGuard<'_, RouterState> {
        // A panic while holding this lock cannot leave the state half-updated in a way that
        // matters more than losing the session, so poisoning is ignored.
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Routes one barrier result to its caller, or parks it if the caller was cancelled.
    fn route(&self, result: pb::BarrierResult) {
        let Some(scope) = Scope::from_wire(result.scope).ok() else {
            tracing::warn!(
                scope = result.scope,
                seq = result.seq,
                "barrier result with an unknown scope"
            );
            return;
        };
        let mut state = self.lock();
        let slot = &mut state.scopes[scope.index()];
        if result.seq != slot.next_seq
            || matches!(slot.pending, Pending::Idle | Pending::Parked(..))
        {
            tracing::debug!(%scope, seq = result.seq, next = slot.next_seq, "dropping a barrier result nobody waits for");
            return;
        }
        let seq = result.seq;
        if consumes_seq(result.error.as_ref()) {
            slot.next_seq += 1;
        }
        match std::mem::replace(&mut slot.pending, Pending::Idle) {
            Pending::Waiting(tx, _) => {
                if let Err(Outcome::Done(error)) = tx.send(Outcome::Done(result.error)) {
                    slot.pending = Pending::Parked(seq, error);
                }
            }
            Pending::Idle | Pending::Parked(..) => {}
        }
    }

    /// Marks the session lost, closes its stream and fails every waiting caller.
    fn lose(&self, reason: Arc<dyn StdError + Send + Sync>) {
        let mut state = self.lock();
        if state.lost.is_some() {
            return;
        }
        state.outbound = None;
        for slot in &mut state.scopes {
            if let Pending::Waiting(tx, _) = std::mem::replace(&mut slot.pending, Pending::Idle) {
                let _ = tx.send(Outcome::Lost(reason.clone()));
            }
        }
        state.lost = Some(reason);
    }

    /// The current stream's sender, for one send.
    fn sender(&self) -> Option<mpsc::Sender<WorkerMessage>> {
        self.lock().outbound.clone()
    }

    /// The stream broke: until it is re-attached, callers only record their entries.
    fn detach(&self) {
        self.lock().outbound = None;
    }

    /// The last seq of each scope (global, node) this rank was released from: every seq below
    /// `next_seq` got a result that consumed it.
    fn released(&self) -> (u64, u64) {
        let state = self.lock();
        let released = |scope: Scope| state.scopes[scope.index()].next_seq - 1;
        (released(Scope::Global), released(Scope::Node))
    }

    /// Makes `outbound`, the request side of a freshly registered stream, the current one and
    /// sends on it, before any caller can, every entry that is not answered yet (or `leave`,
    /// if it was asked for in the meantime).
    fn attach(&self, outbound: mpsc::Sender<WorkerMessage>) {
        let mut state = self.lock();
        if state.lost.is_some() {
            return;
        }
        state.stream += 1;
        // The channel is fresh and holds at most `register`, so these sends find room; if the
        // new stream is already gone, the task sees it break and re-attaches again.
        if state.leave == Leave::Requested {
            let _ = outbound.try_send(message(worker_message::Kind::Leave(pb::Leave {})));
            state.leave = Leave::Sent;
            return;
        }
        for slot in &state.scopes {
            if let Pending::Waiting(_, entry) = &slot.pending {
                let _ = outbound.try_send(message(worker_message::Kind::Barrier(entry.clone())));
            }
        }
        state.outbound = Some(outbound);
    }

    /// Sends `leave` on the current stream if [`Session::leave`] asked for it.
    async fn send_leave(&self) {
        let outbound = {
            let mut state = self.lock();
            if state.leave != Leave::Requested {
                return;
            }
            state.leave = Leave::Sent;
            state.outbound.take()
        };
        let sent = match outbound {
            Some(outbound) => outbound
                .send(message(worker_message::Kind::Leave(pb::Leave {})))
                .await
                .is_ok(),
            None => false,
        };
        if !sent {
            // The stream is already gone: send it on the re-attached one.
            self.lock().leave = Leave::Requested;
        }
    }
}

/// What `barrier` decided under the lock.
enum Step {
    /// Enter the barrier with this entry.
    Enter(pb::BarrierEnter, oneshot::Receiver<Outcome>),
    /// Wait for the result of an abandoned entry at `seq`; `same` says whether it had this
    /// call's name.
    Resume(u64, bool, oneshot::Receiver<Outcome>),
    /// The result of an abandoned entry at `seq` already came.
    Parked(u64, bool, Option<pb::BarrierError>),
}

/// A registered session stream.
struct Opened {
    inbound: Streaming<CoordinatorMessage>,
    registered: pb::Registered,
    /// The replica it is on, and the [`Coordinator`]'s epoch when it was opened.
    addr: Arc<str>,
    epoch: u64,
}

/// Why a session stream could not be opened, on which replica.
struct OpenFailure {
    error: OpenError,
    addr: Arc<str>,
    epoch: u64,
}

enum OpenError {
    /// The call or the stream failed with this status.
    Status(tonic::Status),
    /// The stream ended before `registered`.
    Ended,
    /// Something other than `registered` came first.
    Protocol(String),
}

impl OpenError {
    fn verdict(&self) -> (Verdict, Option<String>) {
        match self {
            OpenError::Status(status) => (
                failover::classify_stream(status),
                failover::leader_hint(status),
            ),
            OpenError::Ended => (Verdict::Unknown, None),
            OpenError::Protocol(_) => (Verdict::Final, None),
        }
    }
}

/// Opens a session stream on the replica in use and registers with `register`; returns the
/// stream and its request side.
async fn open(
    coordinator: &Coordinator,
    register: pb::Register,
) -> Result<(Opened, mpsc::Sender<WorkerMessage>), OpenFailure> {
    let Current {
        channel,
        addr,
        epoch,
    } = coordinator.current();
    let fail = |error| OpenFailure {
        error,
        addr: addr.clone(),
        epoch,
    };
    let (outbound, rx) = mpsc::channel(OUTBOUND_CAPACITY);
    outbound
        .try_send(message(worker_message::Kind::Register(register)))
        .map_err(|_| {
            fail(OpenError::Protocol(
                "the session stream closed before register".into(),
            ))
        })?;
    let mut inbound = SessionClient::new(channel)
        .attach(ReceiverStream::new(rx))
        .await
        .map_err(|status| fail(OpenError::Status(status)))?
        .into_inner();
    let registered = match inbound.message().await {
        Ok(Some(CoordinatorMessage {
            kind: Some(coordinator_message::Kind::Registered(registered)),
        })) => registered,
        Ok(Some(other)) => {
            return Err(fail(OpenError::Protocol(format!(
                "expected `registered` as the first session message, got {other:?}"
            ))));
        }
        Ok(None) => return Err(fail(OpenError::Ended)),
        Err(status) => return Err(fail(OpenError::Status(status))),
    };
    let opened = Opened {
        inbound,
        registered,
        addr: addr.clone(),
        epoch,
    };
    Ok((opened, outbound))
}

fn heartbeat_interval(registered: &pb::Registered) -> Duration {
    match registered.heartbeat_interval_ms {
        0 => DEFAULT_HEARTBEAT,
        ms => Duration::from_millis(ms),
    }
}

/// The `register` message of `config`: `resume` (the released seqs) when re-attaching after a
/// failover; `replacement` (the epoch it was spawned for) for the first registration of a rank
/// respawned in place (a re-attach never says it: the coordinator has accepted it by then).
pub(crate) fn register_message(
    config: &SessionConfig,
    resume: Option<(u64, u64)>,
    replacement: u64,
) -> pb::Register {
    let (released_global, released_node) = resume.unwrap_or_default();
    pb::Register {
        job_id: config.job_id.clone(),
        generation: config.generation,
        rank: config.rank,
        pid: config.pid,
        host: config.host.clone(),
        resume: resume.is_some(),
        released_global,
        released_node,
        replacement: replacement > 0,
        epoch: replacement,
    }
}

impl Session {
    /// Registers `config` with the coordinator and starts the session's background task.
    ///
    /// Fails with the coordinator's status when it refuses the registration (unknown job:
    /// NOT_FOUND; stale generation: FAILED_PRECONDITION; rank outside the world:
    /// INVALID_ARGUMENT; rank registered twice: ALREADY_EXISTS), or with
    /// [`Error::Connection`] when no replica registers it within the failover budget
    /// (followers and unreachable replicas are retried as [`Coordinator`] describes).
    pub async fn attach(coordinator: &Coordinator, config: SessionConfig) -> Result<Self, Error> {
        Self::attach_as(coordinator, config, 0).await
    }

    /// [`Session::attach`] for a worker respawned in place to replace its rank, which died in
    /// membership `epoch` (`MUSTER_EPOCH`; 0 is an ordinary worker, as [`Session::attach`]).
    /// The coordinator refuses it (FAILED_PRECONDITION) unless that rank awaits a replacement.
    /// Its barrier sequence numbers start over: after its first quorum,
    /// [`Session::continue_from`] moves them to where the other ranks are.
    pub async fn attach_replacement(
        coordinator: &Coordinator,
        config: SessionConfig,
        epoch: u64,
    ) -> Result<Self, Error> {
        Self::attach_as(coordinator, config, epoch).await
    }

    async fn attach_as(
        coordinator: &Coordinator,
        config: SessionConfig,
        replacement: u64,
    ) -> Result<Self, Error> {
        let mut retry: Option<Retry> = None;
        let (opened, outbound) = loop {
            let register = register_message(&config, None, replacement);
            let failure = match open(coordinator, register).await {
                Ok(opened) => break opened,
                Err(failure) => failure,
            };
            let (verdict, leader) = failure.error.verdict();
            let retried = verdict != Verdict::Final && {
                let retry = retry.get_or_insert_with(|| Retry::new(coordinator.failover_timeout()));
                if let OpenError::Status(status) = &failure.error {
                    coordinator.saw(&failure.addr, status);
                }
                coordinator.fail_over(failure.epoch, leader.as_deref());
                retry.pause_until(coordinator.held_until_for_calls()).await
            };
            if !retried {
                return Err(match failure.error {
                    OpenError::Status(status) => Error::from_status(status, &failure.addr, || {
                        format!(
                            "registration of rank {} in job {}",
                            config.rank, config.job_id
                        )
                    }),
                    OpenError::Ended => Error::Protocol(format!(
                        "the coordinator closed the session of rank {} without answering register",
                        config.rank
                    )),
                    OpenError::Protocol(message) => Error::Protocol(message),
                });
            }
        };
        let registration = Registration {
            heartbeat_interval: heartbeat_interval(&opened.registered),
            world_size: opened.registered.world_size,
            node_rank: opened.registered.node_rank,
            num_nodes: opened.registered.num_nodes,
        };
        let shared = Arc::new(Shared::new());
        shared.attach(outbound);
        let failures = FailureWatch::default();
        let link = Link {
            shared: shared.clone(),
            failures: failures.clone(),
            coordinator: coordinator.clone(),
            config: config.clone(),
        };
        let task = tokio::spawn(session_task(link, opened));
        Ok(Self {
            coordinator: coordinator.clone(),
            config,
            registration,
            shared,
            task: Some(task),
            failures,
        })
    }

    /// The highest membership epoch pushed to this session, as the atomic the session task
    /// stores it in: [`crate::membership::Membership::changed`] loads it directly.
    pub(crate) fn pushed_epoch_atomic(&self) -> &AtomicU64 {
        &self.failures.inner.pushed
    }

    /// Fires when the coordinator reports that this session's generation failed: what
    /// collectives watch so that a dead peer aborts them instead of hanging them. A
    /// coordinator failover does not fire it.
    pub fn failure_watch(&self) -> FailureWatch {
        self.failures.clone()
    }

    /// Waits until every rank of `scope` has entered this barrier (its n-th of the scope, under
    /// the same `name`), or until `timeout` passes (`None`: as long as every rank is alive).
    ///
    /// This is the hot path: one channel send and one oneshot per call. Errors: a failed,
    /// departed or superseded rank; diverging names; a timeout listing the missing ranks
    /// (after which the counter stays, so calling again retries the same barrier); a lost
    /// session; [`Error::BarrierBusy`] if another call on this scope is in progress. A
    /// coordinator failover is not an error: the entry is sent again to the new leader.
    ///
    /// # Cancel safety
    ///
    /// Cancel-safe. There is no way to withdraw an entry, so dropping the future after the
    /// entry was sent leaves this rank arrived at that barrier, and the next call on the same
    /// scope takes it up instead of entering a new one: with the same `name` it is a retry that
    /// waits for (or returns) that barrier's result without sending anything; with another
    /// name, it first waits for the abandoned barrier to complete and then enters the new one
    /// at the next sequence number. So `tokio::time::timeout(d, s.barrier(..))` in a loop
    /// keeps waiting on one barrier, and giving up on a barrier to move on to the next one
    /// keeps the ranks' sequence numbers aligned. A dropped future whose entry was never sent
    /// leaves nothing behind.
    ///
    /// The wait is a `muster.barrier` span (INFO); when the application records spans with
    /// OpenTelemetry, the entry carries the span's W3C trace context to the coordinator, whose
    /// span for it joins the same trace.
    pub async fn barrier(
        &self,
        scope: Scope,
        name: &str,
        timeout: Option<Duration>,
    ) -> Result<(), Error> {
        let span = tracing::info_span!(
            "muster.barrier",
            otel.kind = "client",
            scope = ?scope,
            name,
            rank = self.config.rank,
        );
        self.enter_barrier(scope, name, timeout)
            .instrument(span)
            .await
    }

    async fn enter_barrier(
        &self,
        scope: Scope,
        name: &str,
        timeout: Option<Duration>,
    ) -> Result<(), Error> {
        let hash = name_hash(name);
        // Empty, without allocating, unless an OpenTelemetry layer records this span.
        let trace_context = trace_context::carrier();
        loop {
            let (outbound, stream) = {
                let state = self.shared.lock();
                if let Some(lost) = &state.lost {
                    return Err(self.lost_error(Some(lost.clone())));
                }
                (state.outbound.clone(), state.stream)
            };
            // Reserve room first, so that once the slot says an entry is at the coordinator,
            // the send below cannot fail or be cancelled. Without a stream (the session task is
            // re-attaching, or will be: reserving failed), the entry is only recorded, and the
            // task sends it when the stream is back.
            let permit = match &outbound {
                Some(outbound) => outbound.reserve().await.ok(),
                None => None,
            };
            let step = {
                let mut state = self.shared.lock();
                if let Some(lost) = &state.lost {
                    return Err(self.lost_error(Some(lost.clone())));
                }
                if state.stream != stream {
                    // A new stream opened meanwhile and took the recorded entries: the room
                    // reserved on the old one is worthless.
                    continue;
                }
                let slot = &mut state.scopes[scope.index()];
                let seq = slot.next_seq;
                match std::mem::replace(&mut slot.pending, Pending::Idle) {
                    Pending::Idle => {
                        let (tx, rx) = oneshot::channel();
                        let entry = pb::BarrierEnter {
                            scope: scope.to_wire(),
                            seq,
                            name: name.to_owned(),
                            timeout_ms: timeout.map_or(0, |t| {
                                u64::try_from(t.as_millis()).unwrap_or(u64::MAX).max(1)
                            }),
                            trace_context: trace_context.clone(),
                        };
                        slot.pending = Pending::Waiting(tx, entry.clone());
                        slot.name_hash = hash;
                        Step::Enter(entry, rx)
                    }
                    Pending::Waiting(tx, entry) if !tx.is_closed() => {
                        slot.pending = Pending::Waiting(tx, entry);
                        return Err(Error::BarrierBusy {
                            scope,
                            rank: self.config.rank,
                        });
                    }
                    Pending::Waiting(_, entry) => {
                        let (tx, rx) = oneshot::channel();
                        slot.pending = Pending::Waiting(tx, entry);
                        Step::Resume(seq, slot.name_hash == hash, rx)
                    }
                    Pending::Parked(seq, error) => Step::Parked(seq, slot.name_hash == hash, error),
                }
            };
            let (seq, same, error) = match step {
                Step::Enter(entry, rx) => {
                    let seq = entry.seq;
                    if let Some(permit) = permit {
                        permit.send(message(worker_message::Kind::Barrier(entry)));
                    }
                    return match self.wait(rx).await? {
                        None => Ok(()),
                        Some(error) => Err(barrier_error(error, scope, name, seq)),
                    };
                }
                Step::Resume(seq, same, rx) => {
                    drop(permit);
                    (seq, same, self.wait(rx).await?)
                }
                Step::Parked(seq, same, error) => {
                    drop(permit);
                    (seq, same, error)
                }
            };
            // An abandoned entry completed. A retry under the same name takes its result; a
            // different barrier passes through it and enters next. A timed-out entry is gone,
            // so either call enters afresh at the same seq.
            match error {
                None if same => return Ok(()),
                None => continue,
                Some(error) if error.kind == BarrierErrorKind::Timeout as i32 => continue,
                Some(error) => {
                    return Err(barrier_error(error, scope, "(of a cancelled call)", seq));
                }
            }
        }
    }

    async fn wait(
        &self,
        rx: oneshot::Receiver<Outcome>,
    ) -> Result<Option<pb::BarrierError>, Error> {
        match rx.await {
            Ok(Outcome::Done(error)) => Ok(error),
            Ok(Outcome::Lost(reason)) => Err(self.lost_error(Some(reason))),
            Err(_) => Err(self.lost_error(None)),
        }
    }

    fn lost_error(&self, reason: Option<Arc<dyn StdError + Send + Sync>>) -> Error {
        let reason = reason
            .or_else(|| self.shared.lock().lost.clone())
            .unwrap_or_else(|| Arc::new(StreamEnded("the session stream is closed")));
        Error::Connection {
            addr: self.coordinator.leader_addr().to_string(),
            source: reason,
        }
    }

    /// The last barrier sequence number of each scope (global, node) this rank was released
    /// from: what a quorum request carries, so that a replacement can continue from them.
    pub fn released(&self) -> (u64, u64) {
        self.shared.released()
    }

    /// Moves the barrier sequence numbers on so that the next barrier of each scope is the one
    /// after `released` (global, node): what a replacement does after its first quorum, whose
    /// answer carries the seqs its healthy source was released from. A scope with a barrier
    /// in progress, or already past `released`, is left as it is.
    pub fn continue_from(&self, released: (u64, u64)) {
        let mut state = self.shared.lock();
        for (scope, released) in [(Scope::Global, released.0), (Scope::Node, released.1)] {
            let slot = &mut state.scopes[scope.index()];
            if matches!(slot.pending, Pending::Idle) && slot.next_seq <= released {
                slot.next_seq = released.saturating_add(1);
            }
        }
    }

    /// Says that this rank began training step `step` (the job's effective training time
    /// counts rank 0's markers: `describe`'s training line). No answer and no wait: a marker
    /// that finds the stream full, or away during a failover, is dropped, and the next one
    /// counts the time since.
    pub fn step_begun(&self, step: u64) {
        self.shared
            .report(worker_message::Kind::Step(pb::StepBegun { step }));
    }

    /// A handle that sends this session's one-way reports from elsewhere (a communicator's
    /// heal), for as long as the session lives.
    pub fn reports(&self) -> Reports {
        Reports(Arc::clone(&self.shared))
    }

    /// The sequence number the next barrier of `scope` will use (for diagnostics and tests).
    pub fn next_seq(&self, scope: Scope) -> u64 {
        self.shared.lock().scopes[scope.index()].next_seq
    }

    /// Ends the session cleanly: sends `leave`, closes the stream and waits briefly for the
    /// coordinator to close its side. Other ranks waiting on this one then learn it left
    /// instead of waiting forever. During a failover, `leave` goes to the new leader once the
    /// session is re-attached (waiting up to the failover budget for that).
    pub async fn leave(mut self) -> Result<(), Error> {
        let Some(mut task) = self.task.take() else {
            return Ok(());
        };
        let grace = {
            let mut state = self.shared.lock();
            if let Some(lost) = state.lost.clone() {
                drop(state);
                return Err(self.lost_error(Some(lost)));
            }
            state.leave = Leave::Requested;
            if state.outbound.is_some() {
                LEAVE_GRACE
            } else {
                self.coordinator.failover_timeout() + LEAVE_GRACE
            }
        };
        self.shared.leaving.notify_one();
        if tokio::time::timeout(grace, &mut task).await.is_err() {
            tracing::debug!(
                rank = self.config.rank,
                "coordinator did not close the session after leave"
            );
            task.abort();
        }
        if self.shared.lock().leave == Leave::Sent {
            Ok(())
        } else {
            Err(self.lost_error(None))
        }
    }

    /// What the coordinator answered at registration.
    pub fn registration(&self) -> &Registration {
        &self.registration
    }

    /// Who this session registered as.
    pub fn config(&self) -> &SessionConfig {
        &self.config
    }

    /// The connection this session runs on.
    pub fn coordinator(&self) -> &Coordinator {
        &self.coordinator
    }

    /// The job's key-value store.
    pub fn kv(&self) -> Kv {
        Kv::new(self.coordinator.clone(), self.config.job_id.clone())
    }

    /// NCCL unique ids of this session's generation.
    pub fn unique_ids(&self) -> UniqueIds {
        UniqueIds::new(
            self.coordinator.clone(),
            self.config.job_id.clone(),
            self.config.generation,
            self.config.rank,
        )
    }

    /// Shared values of this session's generation.
    pub fn shared_values(&self) -> SharedValues {
        SharedValues::new(
            self.coordinator.clone(),
            self.config.job_id.clone(),
            self.config.generation,
            self.config.rank,
        )
    }
}

impl Drop for Session {
    fn drop(&mut self) {
        if let Some(task) = self.task.take() {
            task.abort();
        }
    }
}

impl Slot {
    fn new() -> Self {
        Self {
            next_seq: 1,
            name_hash: 0,
            pending: Pending::Idle,
        }
    }
}

/// Whether a barrier result uses up its sequence number: the coordinator's rule, from its one
/// home.
pub(crate) use muster_core::barrier::consumes_seq;

fn message(kind: worker_message::Kind) -> WorkerMessage {
    WorkerMessage { kind: Some(kind) }
}

fn name_hash(name: &str) -> u64 {
    let mut hasher = DefaultHasher::new();
    name.hash(&mut hasher);
    hasher.finish()
}

/// The SDK's error for a failed barrier: one mapping for the session and the relay paths.
pub(crate) fn barrier_error(error: pb::BarrierError, scope: Scope, name: &str, seq: u64) -> Error {
    Error::from_barrier_error(error, || format!("{scope} barrier '{name}' (seq {seq})"))
}

/// What the session task works with besides its stream.
struct Link {
    shared: Arc<Shared>,
    failures: FailureWatch,
    coordinator: Coordinator,
    config: SessionConfig,
}

/// Why a session stream ended.
enum StreamEnd {
    /// For good: after `leave`, after the generation failed, or by a deliberate status.
    Over(Arc<dyn StdError + Send + Sync>),
    /// In a way a failover may repair; with the leader a refusal named, if any.
    Broken(Arc<dyn StdError + Send + Sync>, Option<String>),
}

/// The session's one background task: sends heartbeats while the session is alive, routes
/// incoming barrier results, sends `leave` when asked, and re-attaches after a failover.
/// Policy: when the stream ends for good, or cannot be re-attached within the failover budget,
/// it marks the session lost (failing every waiter) and exits; it is aborted when the session
/// is dropped.
async fn session_task(link: Link, mut opened: Opened) {
    let rank = link.config.rank;
    loop {
        let interval = heartbeat_interval(&opened.registered);
        let (reason, leader) = match pump(&link, &mut opened.inbound, interval).await {
            StreamEnd::Over(reason) => {
                tracing::debug!(rank, addr = %opened.addr, %reason, "the session stream ended");
                link.shared.lose(reason);
                return;
            }
            StreamEnd::Broken(reason, leader) => (reason, leader),
        };
        tracing::debug!(rank, addr = %opened.addr, %reason, "the session stream broke; failing over");
        match reattach(&link, opened.epoch, reason, leader).await {
            Ok(next) => opened = next,
            Err(error) => {
                tracing::warn!(rank, job = %link.config.job_id, "{error}: {}", error_chain(&error));
                link.shared.lose(Arc::new(error));
                return;
            }
        }
    }
}

/// Runs one stream until it ends.
async fn pump(
    link: &Link,
    inbound: &mut Streaming<CoordinatorMessage>,
    interval: Duration,
) -> StreamEnd {
    let rank = link.config.rank;
    let mut ticker = tokio::time::interval_at(Instant::now() + interval, interval);
    ticker.set_missed_tick_behavior(MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = ticker.tick() => {
                // A full queue already carries traffic; a skipped heartbeat does not matter.
                if let Some(outbound) = link.shared.sender() {
                    let _ = outbound.try_send(message(worker_message::Kind::Heartbeat(pb::Heartbeat {})));
                }
            }
            () = link.shared.leaving.notified() => link.shared.send_leave().await,
            // `Streaming::message` is cancel-safe: its state lives in the stream.
            received = inbound.message() => match received {
                Ok(Some(CoordinatorMessage { kind: Some(coordinator_message::Kind::Barrier(result)) })) => {
                    link.shared.route(result);
                }
                Ok(Some(CoordinatorMessage { kind: Some(coordinator_message::Kind::GenerationFailed(error)) })) => {
                    tracing::debug!(rank, failed = error.rank, "the generation failed");
                    link.failures.fire(error);
                }
                Ok(Some(CoordinatorMessage { kind: Some(coordinator_message::Kind::MembershipChanged(change)) })) => {
                    let cause = change.cause.unwrap_or_default();
                    tracing::debug!(rank, epoch = change.epoch, died = cause.rank, "the membership changed");
                    link.failures.membership_changed(change.epoch, cause);
                }
                Ok(Some(other)) => tracing::debug!(rank, ?other, "ignoring an unexpected session message"),
                Ok(None) if link.ended_for_good() => {
                    return StreamEnd::Over(Arc::new(StreamEnded("the coordinator closed the session stream")));
                }
                Ok(None) => {
                    return StreamEnd::Broken(
                        Arc::new(StreamEnded("the coordinator ended the session stream without leave")),
                        None,
                    );
                }
                Err(status) => {
                    if link.ended_for_good() || failover::classify_stream(&status) == Verdict::Final {
                        return StreamEnd::Over(Arc::new(status));
                    }
                    let leader = failover::leader_hint(&status);
                    return StreamEnd::Broken(Arc::new(status), leader);
                }
            },
        }
    }
}

impl Link {
    /// Whether the end of the stream is the session's end rather than a failover: `leave` went
    /// out, the generation failed (there is nothing to resume), or the session is with the
    /// worker's agent (which carries it across coordinator failovers itself: its end is the
    /// agent's).
    fn ended_for_good(&self) -> bool {
        self.shared.lock().leave == Leave::Sent
            || self.failures.has_fired()
            || self.coordinator.through_agent()
    }
}

/// Re-opens the session on the leader after its stream (opened at the coordinator's `epoch`)
/// broke for `reason`, within the failover budget: registers with `resume` and the released
/// seqs, then hands the new stream the unanswered entries.
async fn reattach(
    link: &Link,
    epoch: u64,
    reason: Arc<dyn StdError + Send + Sync>,
    leader: Option<String>,
) -> Result<Opened, ReattachError> {
    link.shared.detach();
    let coordinator = &link.coordinator;
    let mut retry = Retry::new(coordinator.failover_timeout());
    let (mut epoch, mut leader, mut last) = (epoch, leader, reason);
    loop {
        coordinator.fail_over(epoch, leader.as_deref());
        if !retry.pause_until(coordinator.held_until_for_calls()).await {
            return Err(ReattachError::OutOfTime {
                budget: retry.budget(),
                source: last,
            });
        }
        let released = link.shared.released();
        let failure = match open(
            coordinator,
            register_message(&link.config, Some(released), 0),
        )
        .await
        {
            Ok((opened, outbound)) => {
                link.shared.attach(outbound);
                tracing::info!(
                    rank = link.config.rank,
                    job = %link.config.job_id,
                    addr = %opened.addr,
                    took_ms = retry.elapsed().as_millis() as u64,
                    "session re-attached to the coordinator at {} after a failover ({} ms)",
                    opened.addr,
                    retry.elapsed().as_millis()
                );
                return Ok(opened);
            }
            Err(failure) => failure,
        };
        let (verdict, hint) = failure.error.verdict();
        tracing::debug!(rank = link.config.rank, addr = %failure.addr, ?verdict, "re-attach attempt failed");
        match &failure.error {
            OpenError::Status(status) => coordinator.saw(&failure.addr, status),
            _ => coordinator.saw(&failure.addr, &tonic::Status::unavailable("no answer")),
        }
        match failure.error {
            OpenError::Status(status) if verdict == Verdict::Final => {
                return Err(ReattachError::Refused {
                    addr: failure.addr,
                    source: status,
                });
            }
            OpenError::Status(status) => last = Arc::new(status),
            OpenError::Ended => {
                last = Arc::new(StreamEnded(
                    "the coordinator ended the session stream before answering register",
                ))
            }
            OpenError::Protocol(message) => return Err(ReattachError::Protocol(message)),
        }
        (epoch, leader) = (failure.epoch, hint);
    }
}

/// An error's sources on one line, for the log.
fn error_chain(error: &dyn StdError) -> String {
    let mut parts = Vec::new();
    let mut next = error.source();
    while let Some(error) = next {
        parts.push(match error.downcast_ref::<tonic::Status>() {
            Some(status) => format!("{:?}: {}", status.code(), status.message()),
            None => error.to_string(),
        });
        next = error.source();
    }
    parts.join(": ")
}

/// Whether the coordinator has reported this rank's generation failed (a peer crashed, was
/// killed, lost its connection or stopped heartbeating), or, in an in-place job, that the
/// membership changed past this watch's epoch (a `membership_changed` push: a rank died and is
/// being replaced). Clones share one state; waiting on it works from any thread, inside or
/// outside an async runtime. One made with `default()` (a single process) never fires.
///
/// A watch has an epoch ([`FailureWatch::at_epoch`]): the membership a communicator was built
/// for. It fires for a membership change only when the pushed epoch is above it, so that a
/// communicator rebuilt for the new membership is not torn down by the push that led to it.
/// In restart mode no membership change is ever pushed, and a watch only fires for the
/// generation's failure, as before.
#[derive(Debug, Clone, Default)]
pub struct FailureWatch {
    inner: Arc<WatchInner>,
    /// The membership epoch this watch belongs to: pushes at or below it do not fire it.
    epoch: u64,
}

#[derive(Debug, Default)]
struct WatchInner {
    state: Mutex<WatchState>,
    cvar: Condvar,
    /// The highest membership epoch pushed so far: what [`crate::membership::Membership`]'s
    /// fast path loads, without the lock.
    pushed: AtomicU64,
}

#[derive(Debug, Default)]
struct WatchState {
    /// The generation's failure (the first report wins).
    failed: Option<pb::BarrierError>,
    /// The latest membership change: its epoch and who died.
    changed: Option<(u64, pb::BarrierError)>,
}

impl WatchState {
    fn error(&self, floor: u64) -> Option<Error> {
        if let Some(failed) = &self.failed {
            return Some(failure_error(failed.clone()));
        }
        match &self.changed {
            Some((epoch, cause)) if *epoch > floor => {
                Some(Error::membership_changed(*epoch, cause))
            }
            _ => None,
        }
    }
}

impl FailureWatch {
    /// Records the generation's failure (the first one wins) and wakes every waiter.
    pub(crate) fn fire(&self, error: pb::BarrierError) {
        let mut state = self.lock();
        if state.failed.is_none() {
            state.failed = Some(error);
        }
        self.inner.cvar.notify_all();
    }

    /// Records a membership change to `epoch` (an older one than already known is ignored)
    /// and wakes every waiter: watches of a lower epoch fire.
    pub(crate) fn membership_changed(&self, epoch: u64, cause: pb::BarrierError) {
        let mut state = self.lock();
        if state
            .changed
            .as_ref()
            .is_none_or(|(known, _)| epoch > *known)
        {
            state.changed = Some((epoch, cause));
            self.inner.pushed.fetch_max(epoch, Ordering::AcqRel);
        }
        self.inner.cvar.notify_all();
    }

    /// This watch for a communicator of membership `epoch`: shares the state, fires for the
    /// generation's failure and for membership changes above `epoch`.
    pub fn at_epoch(&self, epoch: u64) -> FailureWatch {
        FailureWatch {
            inner: self.inner.clone(),
            epoch,
        }
    }

    /// The membership epoch this watch belongs to.
    pub fn epoch(&self) -> u64 {
        self.epoch
    }

    /// The highest membership epoch pushed so far (0: none), read with one atomic load.
    pub fn pushed_epoch(&self) -> u64 {
        self.inner.pushed.load(Ordering::Acquire)
    }

    fn lock(&self) -> MutexGuard<'_, WatchState> {
        self.inner
            .state
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
    }

    /// Whether the generation's failure was reported, without building its error (a
    /// membership change does not count: the generation goes on).
    pub(crate) fn has_fired(&self) -> bool {
        self.lock().failed.is_some()
    }

    /// The failure ([`Error::RankFailed`] naming the rank, its node and why), or the
    /// membership change past this watch's epoch ([`Error::MembershipChanged`] naming the
    /// rank that died), if it happened.
    pub fn failed(&self) -> Option<Error> {
        self.lock().error(self.epoch)
    }

    /// Blocks until [`FailureWatch::failed`] has something or `timeout` passes; `None` on
    /// timeout.
    pub fn wait_timeout(&self, timeout: Duration) -> Option<Error> {
        let state = self.lock();
        let (state, _) = self
            .inner
            .cvar
            .wait_timeout_while(state, timeout, |s| s.error(self.epoch).is_none())
            .unwrap_or_else(PoisonError::into_inner);
        state.error(self.epoch)
    }
}

fn failure_error(error: pb::BarrierError) -> Error {
    Error::from_barrier_error(error, || "the generation".to_owned())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cause(rank: u32) -> pb::BarrierError {
        pb::BarrierError {
            kind: BarrierErrorKind::RankFailed as i32,
            message: format!("rank {rank} (node 0, host h) of job 'j' generation 1 failed: killed"),
            rank,
            node_rank: 0,
            host: "h".into(),
            missing: Vec::new(),
        }
    }

    #[test]
    fn only_a_replacements_first_registration_says_so() {
        let config = SessionConfig {
            job_id: "j".into(),
            generation: 2,
            rank: 3,
            pid: 9,
            host: "h".into(),
        };
        let first = register_message(&config, None, 4);
        assert!(first.replacement && !first.resume);
        assert_eq!((first.epoch, first.rank, first.generation), (4, 3, 2));
        // Re-attaching after a failover: the coordinator has accepted the replacement.
        let again = register_message(&config, Some((5, 1)), 0);
        assert!(again.resume && !again.replacement);
        assert_eq!(
            (again.released_global, again.released_node, again.epoch),
            (5, 1, 0)
        );
        let ordinary = register_message(&config, None, 0);
        assert!(!ordinary.replacement && !ordinary.resume);
    }

    #[test]
    fn a_withdrawn_wait_leaves_its_seq_to_be_entered_again() {
        let kind = |kind: BarrierErrorKind| pb::BarrierError {
            kind: kind as i32,
            ..Default::default()
        };
        assert!(!consumes_seq(Some(&kind(
            BarrierErrorKind::MembershipChanged
        ))));
        assert!(!consumes_seq(Some(&kind(BarrierErrorKind::Timeout))));
        assert!(consumes_seq(Some(&kind(BarrierErrorKind::RankFailed))));
        assert!(consumes_seq(None));
    }

    #[test]
    fn a_watch_fires_for_membership_changes_above_its_epoch() {
        let watch = FailureWatch::default();
        let rebuilt = watch.at_epoch(1);
        assert!(watch.failed().is_none());
        assert_eq!(watch.pushed_epoch(), 0);
        watch.membership_changed(1, cause(2));
        assert_eq!(watch.pushed_epoch(), 1);
        assert!(
            matches!(
                watch.failed(),
                Some(Error::MembershipChanged {
                    epoch: 1,
                    rank: 2,
                    ..
                })
            ),
            "{:?}",
            watch.failed()
        );
        assert!(
            rebuilt.failed().is_none(),
            "the epoch-1 watch ignores epoch 1"
        );
        assert!(rebuilt.wait_timeout(Duration::from_millis(10)).is_none());
        // An older push is ignored; a newer one fires the rebuilt watch too.
        watch.membership_changed(0, cause(3));
        assert_eq!(watch.pushed_epoch(), 1);
        let waiter = {
            let rebuilt = rebuilt.clone();
            std::thread::spawn(move || rebuilt.wait_timeout(Duration::from_secs(10)))
        };
        std::thread::sleep(Duration::from_millis(20));
        let started = std::time::Instant::now();
        watch.membership_changed(2, cause(1));
        let woke = waiter.join().ok().flatten();
        assert!(started.elapsed() < Duration::from_secs(1));
        assert!(
            matches!(
                woke,
                Some(Error::MembershipChanged {
                    epoch: 2,
                    rank: 1,
                    ..
                })
            ),
            "{woke:?}"
        );
        assert!(
            !watch.has_fired(),
            "a membership change is not the generation's failure"
        );
        // The generation's failure fires every watch, whatever its epoch.
        watch.fire(cause(0));
        assert!(watch.has_fired());
        assert!(matches!(
            rebuilt.at_epoch(9).failed(),
            Some(Error::RankFailed { rank: 0, .. })
        ));
    }
}
