//! The async core: a connection to the coordinator, a worker's session (liveness and barriers)
//! and thin typed wrappers over the key-value, unique-id and shared-value services.
//!
//! The [`crate::Accelerator`] is built on this; benchmarks use it directly to run thousands of
//! simulated ranks as tasks that share a few [`Coordinator`] connections.

use std::{
    collections::hash_map::DefaultHasher,
    error::Error as StdError,
    fmt,
    hash::{Hash, Hasher},
    sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError},
    time::Duration,
};

use muster_proto::{
    NCCL_UNIQUE_ID_BYTES,
    v1::{
        self as pb, BarrierScope, CoordinatorMessage, WorkerMessage,
        barrier_error::Kind as BarrierErrorKind, coordinator_message,
        key_value_client::KeyValueClient, session_client::SessionClient,
        shared_values_client::SharedValuesClient, unique_ids_client::UniqueIdsClient,
        worker_message,
    },
};
use tokio::{
    sync::{mpsc, oneshot},
    task::JoinHandle,
    time::{Instant, MissedTickBehavior},
};
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Streaming, transport::Channel};

use crate::Error;

/// How long [`Coordinator::connect`] tries to open the TCP connection.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);
/// Room for outgoing session messages: at most one barrier per scope, a heartbeat and `leave`
/// are ever in flight, so a little slack is plenty.
const OUTBOUND_CAPACITY: usize = 16;
/// Heartbeat period used if the coordinator says 0.
const DEFAULT_HEARTBEAT: Duration = Duration::from_secs(1);
/// How long [`Session::leave`] waits for the coordinator to close the stream after `leave`.
const LEAVE_GRACE: Duration = Duration::from_secs(5);

/// A connection to the coordinator, cheap to clone and share: tonic multiplexes every call and
/// session stream of all clones over one HTTP/2 connection. It remembers the address so that
/// connection errors can name it.
#[derive(Clone)]
pub struct Coordinator {
    channel: Channel,
    addr: Arc<str>,
}

impl fmt::Debug for Coordinator {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Coordinator")
            .field("addr", &self.addr)
            .finish_non_exhaustive()
    }
}

impl Coordinator {
    /// Connects to the coordinator at `addr` (`host:port`, as in `MUSTER_COORDINATOR`) with
    /// TCP_NODELAY (barriers are latency-bound) and no request timeout (barriers and fetches
    /// wait as long as the generation is alive).
    pub async fn connect(addr: &str) -> Result<Self, Error> {
        let endpoint = Self::endpoint(addr)?;
        let channel = endpoint.connect().await.map_err(|e| Error::Connection {
            addr: addr.to_owned(),
            source: Arc::new(e),
        })?;
        Ok(Self {
            channel,
            addr: addr.into(),
        })
    }

    /// Like [`Coordinator::connect`], but connects on first use; errors then show up in the
    /// first call. Must be called inside a tokio runtime.
    pub fn connect_lazy(addr: &str) -> Result<Self, Error> {
        let channel = Self::endpoint(addr)?.connect_lazy();
        Ok(Self {
            channel,
            addr: addr.into(),
        })
    }

    /// Wraps a channel built elsewhere (custom transport, tests); `addr` is only used to name
    /// the coordinator in errors.
    pub fn from_channel(channel: Channel, addr: impl Into<Arc<str>>) -> Self {
        Self {
            channel,
            addr: addr.into(),
        }
    }

    fn endpoint(addr: &str) -> Result<tonic::transport::Endpoint, Error> {
        let endpoint = tonic::transport::Endpoint::from_shared(format!("http://{addr}"))
            .map_err(|e| Error::Config(format!("coordinator address {addr:?} is invalid: {e}")))?;
        Ok(endpoint.tcp_nodelay(true).connect_timeout(CONNECT_TIMEOUT))
    }

    /// The underlying channel, for calling services this module does not wrap (Ops).
    pub fn channel(&self) -> &Channel {
        &self.channel
    }

    /// The coordinator's `host:port`.
    pub fn addr(&self) -> &str {
        &self.addr
    }

    fn status_error(&self, status: tonic::Status, what: impl FnOnce() -> String) -> Error {
        Error::from_status(status, &self.addr, what)
    }
}

/// Which ranks a barrier spans.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Scope {
    /// Every rank of the generation (`wait_for_everyone`).
    Global,
    /// The ranks of the caller's node (`wait_for_local`).
    Node,
}

impl Scope {
    pub(crate) fn index(self) -> usize {
        match self {
            Scope::Global => 0,
            Scope::Node => 1,
        }
    }

    pub(crate) fn to_proto(self) -> BarrierScope {
        match self {
            Scope::Global => BarrierScope::Global,
            Scope::Node => BarrierScope::Node,
        }
    }

    pub(crate) fn from_proto(scope: i32) -> Option<Self> {
        match BarrierScope::try_from(scope) {
            Ok(BarrierScope::Global) => Some(Scope::Global),
            Ok(BarrierScope::Node) => Some(Scope::Node),
            _ => None,
        }
    }
}

impl fmt::Display for Scope {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Scope::Global => "global",
            Scope::Node => "node",
        })
    }
}

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
/// callers. [`Session::leave`] ends the session cleanly. Dropping a session without `leave`
/// ends the stream without it, which the coordinator treats as this rank failing — the same as
/// a crash.
pub struct Session {
    coordinator: Coordinator,
    config: SessionConfig,
    registration: Registration,
    shared: Arc<Shared>,
    /// The only strong sender: dropping it ends the request stream. `None` once leaving.
    outbound: Option<mpsc::Sender<WorkerMessage>>,
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
}

struct RouterState {
    scopes: [Slot; 2],
    /// Set when the stream ended or broke; every later call fails with it.
    lost: Option<Arc<dyn StdError + Send + Sync>>,
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
    /// An entry for `next_seq` is at the coordinator. If the receiver is gone, its caller was
    /// cancelled and the entry is abandoned (see [`Session::barrier`]).
    Waiting(oneshot::Sender<Outcome>),
    /// The result of the abandoned entry at this seq (the counter has already moved past it
    /// if the result consumed the seq).
    Parked(u64, Option<pb::BarrierError>),
}

/// What the session task hands a barrier caller.
enum Outcome {
    /// The coordinator's result: `None` on success.
    Done(Option<pb::BarrierError>),
    /// The stream ended or broke.
    Lost(Arc<dyn StdError + Send + Sync>),
}

/// Why the stream ended when the coordinator closed it without an error status.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
struct StreamEnded(&'static str);

impl Shared {
    fn lock(&self) -> MutexGuard<'_, RouterState> {
        // A panic while holding this lock cannot leave the state half-updated in a way that
        // matters more than losing the session, so poisoning is ignored.
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Routes one barrier result to its caller, or parks it if the caller was cancelled.
    fn route(&self, result: pb::BarrierResult) {
        let Some(scope) = Scope::from_proto(result.scope) else {
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
            Pending::Waiting(tx) => {
                if let Err(Outcome::Done(error)) = tx.send(Outcome::Done(result.error)) {
                    slot.pending = Pending::Parked(seq, error);
                }
            }
            Pending::Idle | Pending::Parked(..) => {}
        }
    }

    /// Marks the session lost and fails every waiting caller.
    fn lose(&self, reason: Arc<dyn StdError + Send + Sync>) {
        let mut state = self.lock();
        if state.lost.is_some() {
            return;
        }
        for slot in &mut state.scopes {
            if let Pending::Waiting(tx) = std::mem::replace(&mut slot.pending, Pending::Idle) {
                let _ = tx.send(Outcome::Lost(reason.clone()));
            }
        }
        state.lost = Some(reason);
    }
}

/// What `barrier` decided under the lock.
enum Step {
    /// Enter the barrier at `seq`.
    Enter(u64, oneshot::Receiver<Outcome>),
    /// Wait for the result of an abandoned entry at `seq`; `same` says whether it had this
    /// call's name.
    Resume(u64, bool, oneshot::Receiver<Outcome>),
    /// The result of an abandoned entry at `seq` already came.
    Parked(u64, bool, Option<pb::BarrierError>),
}

impl Session {
    /// Registers `config` with the coordinator and starts the session's background task.
    ///
    /// Fails with the coordinator's status when it refuses the registration (unknown job:
    /// NOT_FOUND; stale generation: FAILED_PRECONDITION; rank outside the world:
    /// INVALID_ARGUMENT; rank registered twice: ALREADY_EXISTS), or with
    /// [`Error::Connection`] when it cannot be reached.
    pub async fn attach(coordinator: &Coordinator, config: SessionConfig) -> Result<Self, Error> {
        let (outbound, rx) = mpsc::channel(OUTBOUND_CAPACITY);
        let register = pb::Register {
            job_id: config.job_id.clone(),
            generation: config.generation,
            rank: config.rank,
            pid: config.pid,
            host: config.host.clone(),
        };
        let what = || {
            format!(
                "registration of rank {} in job {}",
                config.rank, config.job_id
            )
        };
        outbound
            .send(message(worker_message::Kind::Register(register)))
            .await
            .map_err(|_| Error::Protocol("the session stream closed before register".into()))?;
        let mut client = SessionClient::new(coordinator.channel.clone());
        let mut inbound = client
            .attach(ReceiverStream::new(rx))
            .await
            .map_err(|status| coordinator.status_error(status, what))?
            .into_inner();
        let registered = match inbound.message().await {
            Ok(Some(CoordinatorMessage {
                kind: Some(coordinator_message::Kind::Registered(registered)),
            })) => registered,
            Ok(Some(other)) => {
                return Err(Error::Protocol(format!(
                    "expected `registered` as the first session message, got {other:?}"
                )));
            }
            Ok(None) => {
                return Err(Error::Protocol(format!(
                    "the coordinator closed the session of rank {} without answering register",
                    config.rank
                )));
            }
            Err(status) => return Err(coordinator.status_error(status, what)),
        };
        let heartbeat_interval = match registered.heartbeat_interval_ms {
            0 => DEFAULT_HEARTBEAT,
            ms => Duration::from_millis(ms),
        };
        let registration = Registration {
            heartbeat_interval,
            world_size: registered.world_size,
            node_rank: registered.node_rank,
            num_nodes: registered.num_nodes,
        };
        let shared = Arc::new(Shared {
            state: Mutex::new(RouterState {
                scopes: [Slot::new(), Slot::new()],
                lost: None,
            }),
        });
        let failures = FailureWatch::default();
        let task = tokio::spawn(session_task(
            shared.clone(),
            failures.clone(),
            coordinator.addr.clone(),
            config.rank,
            inbound,
            outbound.downgrade(),
            heartbeat_interval,
        ));
        Ok(Self {
            coordinator: coordinator.clone(),
            config,
            registration,
            shared,
            outbound: Some(outbound),
            task: Some(task),
            failures,
        })
    }

    /// Fires when the coordinator reports that this session's generation failed: what
    /// collectives watch so that a dead peer aborts them instead of hanging them.
    pub fn failure_watch(&self) -> FailureWatch {
        self.failures.clone()
    }

    /// Waits until every rank of `scope` has entered this barrier (its n-th of the scope, under
    /// the same `name`), or until `timeout` passes (`None`: as long as every rank is alive).
    ///
    /// This is the hot path: one channel send and one oneshot per call. Errors: a failed,
    /// departed or superseded rank; diverging names; a timeout listing the missing ranks
    /// (after which the counter stays, so calling again retries the same barrier); a lost
    /// connection; [`Error::BarrierBusy`] if another call on this scope is in progress.
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
    pub async fn barrier(
        &self,
        scope: Scope,
        name: &str,
        timeout: Option<Duration>,
    ) -> Result<(), Error> {
        let outbound = self
            .outbound
            .as_ref()
            .ok_or_else(|| self.lost_error(None))?;
        let hash = name_hash(name);
        loop {
            // Reserve room first, so that once the slot says an entry is at the coordinator,
            // the send below cannot fail or be cancelled.
            let permit = outbound
                .reserve()
                .await
                .map_err(|_| self.lost_error(None))?;
            let step = {
                let mut state = self.shared.lock();
                if let Some(lost) = &state.lost {
                    return Err(self.lost_error(Some(lost.clone())));
                }
                let slot = &mut state.scopes[scope.index()];
                let seq = slot.next_seq;
                match std::mem::replace(&mut slot.pending, Pending::Idle) {
                    Pending::Idle => {
                        let (tx, rx) = oneshot::channel();
                        slot.pending = Pending::Waiting(tx);
                        slot.name_hash = hash;
                        Step::Enter(seq, rx)
                    }
                    Pending::Waiting(tx) if !tx.is_closed() => {
                        slot.pending = Pending::Waiting(tx);
                        return Err(Error::BarrierBusy {
                            scope,
                            rank: self.config.rank,
                        });
                    }
                    Pending::Waiting(_) => {
                        let (tx, rx) = oneshot::channel();
                        slot.pending = Pending::Waiting(tx);
                        Step::Resume(seq, slot.name_hash == hash, rx)
                    }
                    Pending::Parked(seq, error) => Step::Parked(seq, slot.name_hash == hash, error),
                }
            };
            let (seq, same, error) = match step {
                Step::Enter(seq, rx) => {
                    let timeout_ms = timeout.map_or(0, |t| {
                        u64::try_from(t.as_millis()).unwrap_or(u64::MAX).max(1)
                    });
                    permit.send(message(worker_message::Kind::Barrier(pb::BarrierEnter {
                        scope: scope.to_proto() as i32,
                        seq,
                        name: name.to_owned(),
                        timeout_ms,
                    })));
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
            addr: self.coordinator.addr.to_string(),
            source: reason,
        }
    }

    /// The sequence number the next barrier of `scope` will use (for diagnostics and tests).
    pub fn next_seq(&self, scope: Scope) -> u64 {
        self.shared.lock().scopes[scope.index()].next_seq
    }

    /// Ends the session cleanly: sends `leave`, closes the stream and waits briefly for the
    /// coordinator to close its side. Other ranks waiting on this one then learn it left
    /// instead of waiting forever.
    pub async fn leave(mut self) -> Result<(), Error> {
        let Some(outbound) = self.outbound.take() else {
            return Ok(());
        };
        if let Some(lost) = self.shared.lock().lost.clone() {
            return Err(self.lost_error(Some(lost)));
        }
        let sent = outbound
            .send(message(worker_message::Kind::Leave(pb::Leave {})))
            .await;
        drop(outbound);
        if sent.is_err() {
            return Err(self.lost_error(None));
        }
        if let Some(mut task) = self.task.take()
            && tokio::time::timeout(LEAVE_GRACE, &mut task).await.is_err()
        {
            tracing::debug!(
                rank = self.config.rank,
                "coordinator did not close the session after leave"
            );
            task.abort();
        }
        Ok(())
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

/// Whether a barrier result uses up its sequence number. A timeout does not (the same seq may
/// be entered again), nor does a rejection of the entry itself (unspecified kind: a malformed
/// or misnumbered entry the coordinator did not record); everything else does.
pub(crate) fn consumes_seq(error: Option<&pb::BarrierError>) -> bool {
    match error.map(|e| BarrierErrorKind::try_from(e.kind)) {
        None => true,
        Some(Ok(BarrierErrorKind::Timeout | BarrierErrorKind::Unspecified) | Err(_)) => false,
        Some(Ok(_)) => true,
    }
}

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

/// The session's one background task: sends heartbeats while the session is alive and routes
/// incoming barrier results. Policy: on a broken or ended stream it marks the session lost
/// (failing every waiter) and exits; it is aborted when the session is dropped.
async fn session_task(
    shared: Arc<Shared>,
    failures: FailureWatch,
    addr: Arc<str>,
    rank: u32,
    mut inbound: Streaming<CoordinatorMessage>,
    outbound: mpsc::WeakSender<WorkerMessage>,
    interval: Duration,
) {
    let mut ticker = tokio::time::interval_at(Instant::now() + interval, interval);
    ticker.set_missed_tick_behavior(MissedTickBehavior::Delay);
    let mut leaving = false;
    loop {
        tokio::select! {
            _ = ticker.tick(), if !leaving => match outbound.upgrade() {
                // A full queue already carries traffic; a skipped heartbeat does not matter.
                Some(tx) => { let _ = tx.try_send(message(worker_message::Kind::Heartbeat(pb::Heartbeat {}))); }
                // The session dropped its sender: it is leaving or gone.
                None => leaving = true,
            },
            // `Streaming::message` is cancel-safe: its state lives in the stream.
            received = inbound.message() => match received {
                Ok(Some(CoordinatorMessage { kind: Some(coordinator_message::Kind::Barrier(result)) })) => {
                    shared.route(result);
                }
                Ok(Some(CoordinatorMessage { kind: Some(coordinator_message::Kind::GenerationFailed(error)) })) => {
                    tracing::debug!(rank, failed = error.rank, "the generation failed");
                    failures.fire(error);
                }
                Ok(Some(other)) => tracing::debug!(rank, ?other, "ignoring an unexpected session message"),
                Ok(None) => {
                    tracing::debug!(rank, %addr, "the coordinator closed the session stream");
                    shared.lose(Arc::new(StreamEnded("the coordinator closed the session stream")));
                    return;
                }
                Err(status) => {
                    tracing::debug!(rank, %addr, %status, "the session stream broke");
                    shared.lose(Arc::new(status));
                    return;
                }
            },
        }
    }
}

/// Whether the coordinator has reported this rank's generation failed (a peer crashed, was
/// killed, lost its connection or stopped heartbeating). Clones share one state; waiting on it
/// works from any thread, inside or outside an async runtime. One made with `default()` (a
/// single process) never fires.
#[derive(Debug, Clone, Default)]
pub struct FailureWatch {
    inner: Arc<(Mutex<Option<pb::BarrierError>>, Condvar)>,
}

impl FailureWatch {
    /// Records the generation's failure (the first one wins) and wakes every waiter.
    pub(crate) fn fire(&self, error: pb::BarrierError) {
        let (state, cvar) = &*self.inner;
        let mut state = state.lock().unwrap_or_else(PoisonError::into_inner);
        if state.is_none() {
            *state = Some(error);
        }
        cvar.notify_all();
    }

    /// The failure ([`Error::RankFailed`] naming the rank, its node and why), if it happened.
    pub fn failed(&self) -> Option<Error> {
        let (state, _) = &*self.inner;
        let state = state.lock().unwrap_or_else(PoisonError::into_inner);
        state.clone().map(failure_error)
    }

    /// Blocks until the failure is reported or `timeout` passes; `None` on timeout.
    pub fn wait_timeout(&self, timeout: Duration) -> Option<Error> {
        let (state, cvar) = &*self.inner;
        let state = state.lock().unwrap_or_else(PoisonError::into_inner);
        let (state, _) = cvar
            .wait_timeout_while(state, timeout, |s| s.is_none())
            .unwrap_or_else(PoisonError::into_inner);
        state.clone().map(failure_error)
    }
}

fn failure_error(error: pb::BarrierError) -> Error {
    Error::from_barrier_error(error, || "the generation".to_owned())
}

/// The outcome of [`Kv::compare_and_set`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CasOutcome {
    /// Whether the value was replaced.
    pub swapped: bool,
    /// The value after the call (`None`: the key does not exist).
    pub current: Option<Vec<u8>>,
}

/// The job's key-value store (TCPStore parity): small coordination data that user code shares
/// between ranks. Every method is a single RPC and cancel-safe.
#[derive(Debug, Clone)]
pub struct Kv {
    coordinator: Coordinator,
    client: KeyValueClient<Channel>,
    job_id: String,
}

impl Kv {
    /// The store of `job_id` on `coordinator`.
    pub fn new(coordinator: Coordinator, job_id: impl Into<String>) -> Self {
        let client = KeyValueClient::new(coordinator.channel.clone());
        Self {
            coordinator,
            client,
            job_id: job_id.into(),
        }
    }

    fn error(&self, status: tonic::Status, key: &str) -> Error {
        self.coordinator
            .status_error(status, || format!("key '{key}' in job {}", self.job_id))
    }

    /// Sets `key`, replacing any value.
    pub async fn set(&self, key: &str, value: impl Into<Vec<u8>>) -> Result<(), Error> {
        let request = pb::SetRequest {
            job_id: self.job_id.clone(),
            key: key.to_owned(),
            value: value.into(),
        };
        self.client
            .clone()
            .set(request)
            .await
            .map_err(|s| self.error(s, key))?;
        Ok(())
    }

    /// The value of `key`, or `None` if it is not set.
    pub async fn get(&self, key: &str) -> Result<Option<Vec<u8>>, Error> {
        let request = pb::GetRequest {
            job_id: self.job_id.clone(),
            key: key.to_owned(),
            wait_ms: 0,
        };
        match self.client.clone().get(request).await {
            Ok(response) => Ok(Some(response.into_inner().value)),
            Err(status) if status.code() == tonic::Code::NotFound => Ok(None),
            Err(status) => Err(self.error(status, key)),
        }
    }

    /// The value of `key`, waiting up to `wait` for another rank to set it
    /// ([`Error::Timeout`] after).
    pub async fn get_wait(&self, key: &str, wait: Duration) -> Result<Vec<u8>, Error> {
        let wait_ms = u64::try_from(wait.as_millis()).unwrap_or(u64::MAX).max(1);
        let request = pb::GetRequest {
            job_id: self.job_id.clone(),
            key: key.to_owned(),
            wait_ms,
        };
        let response = self
            .client
            .clone()
            .get(request)
            .await
            .map_err(|s| self.error(s, key))?;
        Ok(response.into_inner().value)
    }

    /// Adds `delta` to the counter at `key` (absent counts as 0) and returns the new value.
    pub async fn add(&self, key: &str, delta: i64) -> Result<i64, Error> {
        let request = pb::AddRequest {
            job_id: self.job_id.clone(),
            key: key.to_owned(),
            delta,
        };
        let response = self
            .client
            .clone()
            .add(request)
            .await
            .map_err(|s| self.error(s, key))?;
        Ok(response.into_inner().value)
    }

    /// Sets `key` to `desired` only if its value is `expected` (`None`: only if the key does
    /// not exist), atomically.
    pub async fn compare_and_set(
        &self,
        key: &str,
        expected: Option<&[u8]>,
        desired: impl Into<Vec<u8>>,
    ) -> Result<CasOutcome, Error> {
        let request = pb::CompareAndSetRequest {
            job_id: self.job_id.clone(),
            key: key.to_owned(),
            expected: expected.map(<[u8]>::to_vec),
            desired: desired.into(),
        };
        let response = self
            .client
            .clone()
            .compare_and_set(request)
            .await
            .map_err(|s| self.error(s, key))?;
        let response = response.into_inner();
        Ok(CasOutcome {
            swapped: response.swapped,
            current: response.current,
        })
    }

    /// Deletes `key`; says whether it existed.
    pub async fn delete(&self, key: &str) -> Result<bool, Error> {
        let request = pb::DeleteRequest {
            job_id: self.job_id.clone(),
            key: key.to_owned(),
        };
        let response = self
            .client
            .clone()
            .delete(request)
            .await
            .map_err(|s| self.error(s, key))?;
        Ok(response.into_inner().existed)
    }

    /// The keys and values under `prefix`, in key order.
    pub async fn list(&self, prefix: &str) -> Result<Vec<(String, Vec<u8>)>, Error> {
        let request = pb::ListRequest {
            job_id: self.job_id.clone(),
            prefix: prefix.to_owned(),
        };
        let response = self.client.clone().list(request).await.map_err(|s| {
            self.coordinator.status_error(s, || {
                format!("keys under '{prefix}' in job {}", self.job_id)
            })
        })?;
        Ok(response
            .into_inner()
            .items
            .into_iter()
            .map(|item| (item.key, item.value))
            .collect())
    }
}

/// NCCL unique ids of one generation: the communicator's root publishes its id, the other
/// ranks fetch it. Fenced by generation, so a restarted job never reuses an old id.
#[derive(Debug, Clone)]
pub struct UniqueIds {
    coordinator: Coordinator,
    client: UniqueIdsClient<Channel>,
    job_id: String,
    generation: u64,
    rank: u32,
}

impl UniqueIds {
    /// The unique ids of `job_id`'s `generation`, as seen by `rank`.
    pub fn new(
        coordinator: Coordinator,
        job_id: impl Into<String>,
        generation: u64,
        rank: u32,
    ) -> Self {
        let client = UniqueIdsClient::new(coordinator.channel.clone());
        Self {
            coordinator,
            client,
            job_id: job_id.into(),
            generation,
            rank,
        }
    }

    /// Publishes `communicator`'s id. Publishing the same bytes again is fine; different bytes
    /// are refused (ALREADY_EXISTS).
    pub async fn publish(
        &self,
        communicator: &str,
        id: &[u8; NCCL_UNIQUE_ID_BYTES],
    ) -> Result<(), Error> {
        let request = pb::PublishUniqueIdRequest {
            job_id: self.job_id.clone(),
            generation: self.generation,
            rank: self.rank,
            communicator: communicator.to_owned(),
            unique_id: id.to_vec(),
        };
        self.client.clone().publish(request).await.map_err(|s| {
            self.coordinator
                .status_error(s, || format!("publishing unique id '{communicator}'"))
        })?;
        Ok(())
    }

    /// Fetches `communicator`'s id, waiting until it is published, the generation fails or
    /// `wait` passes (`None`: as long as the generation is alive).
    pub async fn fetch(
        &self,
        communicator: &str,
        wait: Option<Duration>,
    ) -> Result<[u8; NCCL_UNIQUE_ID_BYTES], Error> {
        let request = pb::FetchUniqueIdRequest {
            job_id: self.job_id.clone(),
            generation: self.generation,
            rank: self.rank,
            communicator: communicator.to_owned(),
            wait_ms: wait_ms(wait),
        };
        let response = self.client.clone().fetch(request).await.map_err(|s| {
            self.coordinator
                .status_error(s, || format!("NCCL unique id '{communicator}'"))
        })?;
        let bytes = response.into_inner().unique_id;
        <[u8; NCCL_UNIQUE_ID_BYTES]>::try_from(bytes.as_slice()).map_err(|_| {
            Error::Protocol(format!(
                "unique id '{communicator}' has {} bytes, expected {NCCL_UNIQUE_ID_BYTES}",
                bytes.len()
            ))
        })
    }
}

/// Values computed once per generation and shared (`main_process_first_share`): the publisher
/// stores bytes under a name, the others fetch them instead of computing them again.
#[derive(Debug, Clone)]
pub struct SharedValues {
    coordinator: Coordinator,
    client: SharedValuesClient<Channel>,
    job_id: String,
    generation: u64,
    rank: u32,
}

impl SharedValues {
    /// The shared values of `job_id`'s `generation`, as seen by `rank`.
    pub fn new(
        coordinator: Coordinator,
        job_id: impl Into<String>,
        generation: u64,
        rank: u32,
    ) -> Self {
        let client = SharedValuesClient::new(coordinator.channel.clone());
        Self {
            coordinator,
            client,
            job_id: job_id.into(),
            generation,
            rank,
        }
    }

    /// Publishes `value` under `name`. The same bytes again are fine; different bytes are
    /// refused (ALREADY_EXISTS).
    pub async fn publish(&self, name: &str, value: impl Into<Vec<u8>>) -> Result<(), Error> {
        let request = pb::PublishValueRequest {
            job_id: self.job_id.clone(),
            generation: self.generation,
            rank: self.rank,
            name: name.to_owned(),
            value: value.into(),
        };
        self.client.clone().publish(request).await.map_err(|s| {
            self.coordinator
                .status_error(s, || format!("publishing shared value '{name}'"))
        })?;
        Ok(())
    }

    /// Fetches the value under `name`, waiting until it is published, the generation fails or
    /// `wait` passes (`None`: as long as the generation is alive).
    pub async fn fetch(&self, name: &str, wait: Option<Duration>) -> Result<Vec<u8>, Error> {
        let request = pb::FetchValueRequest {
            job_id: self.job_id.clone(),
            generation: self.generation,
            rank: self.rank,
            name: name.to_owned(),
            wait_ms: wait_ms(wait),
        };
        let response = self.client.clone().fetch(request).await.map_err(|s| {
            self.coordinator
                .status_error(s, || format!("shared value '{name}'"))
        })?;
        Ok(response.into_inner().value)
    }
}

/// `None` (wait as long as the generation lives) is 0 on the wire; a real wait is at least 1 ms
/// so that it never turns into "forever".
fn wait_ms(wait: Option<Duration>) -> u64 {
    wait.map_or(0, |w| {
        u64::try_from(w.as_millis()).unwrap_or(u64::MAX).max(1)
    })
}
