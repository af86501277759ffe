//! The node relay: the workers of this node send their barrier entries to the agent over a
//! Unix socket (`MUSTER_AGENT_SOCKET`) instead of their coordinator sessions. Node barriers
//! complete here; a global barrier goes to the coordinator as one `GroupEnter` per node on the
//! relay's own stream (`Relay.Attach`), and its one answer is fanned out to the node's ranks.
//! The socket's framing is the contract's (`muster_core::contract::frame`), shared with the SDK.
//! The workers' sessions (registration, liveness, pushes) and every other call they make go to
//! the agent's gateway beside the relay socket (`gateway.rs`), which registers them on this
//! relay's stream (`rank_register`, `rank_leave`, `rank_lost`) and forwards the rest: workers
//! hold no connection to the coordinator. The protocols are in `docs/contract.md` ("Node
//! relay", "The agent's gateway").
//!
//! Traces: a worker's barrier frame carries its W3C trace context in `BarrierEnter`'s
//! `trace_context` when it traces (the map is empty, and absent from the frame, otherwise),
//! and the `GroupEnter` passes one context on to the coordinator: see `Hub::send_group` for
//! which, and for the agent's own `muster.relay.barrier` span when it exports traces.
//!
//! # Threads and tasks
//!
//! The relay runs on an OS thread of its own ("muster-relay") with a `current_thread` tokio
//! runtime and a `LocalSet`: a worker's entry, the barrier bookkeeping and the writes of the
//! answers all happen on that one thread, with no cross-thread wakeup anywhere on the path.
//! The barrier state ([`hub::Hub`]) sits in an `Rc<RefCell<..>>` that is borrowed for the
//! span of one synchronous call, never across an `.await`. Answers are written straight to the
//! workers' sockets with non-blocking writes (a worker has at most one answer per scope
//! outstanding, so the socket buffer never fills in practice; when it does, the rest waits in
//! a per-connection backlog that a flush task drains). Worker sockets are registered for
//! readability only, so that a worker reading its answer does not wake this thread.
//!
//! Tasks (all on the relay thread, all dropped when the relay stops):
//! - "relay-accept": accepts worker connections; on an accept error, logs and retries.
//! - "relay-conn" (one per worker): reads frames; ends with the connection (a close without
//!   `leave` marks the rank dead).
//! - "relay-flush" (only when a write would block): drains one connection's backlog.
//! - "relay-timer": answers waits whose timeout passed.
//! - "relay-coordinator": reads the coordinator's answers. When the stream ends the way a
//!   coordinator that went away ends it (a failover), it registers again with the leader with
//!   `resume = true` and `released` = the last global seq the node got a result for, and sends
//!   the global barriers in flight again (same seq, groups and timeout): the workers never see
//!   the failover. When the coordinator refuses that deliberately, or no replica takes the
//!   relay back within the failover budget, every worker connection is closed with a farewell
//!   saying so, as when the stream breaks without failover.
//! - "relay-report": once a second, reports the waits held here that are a second old to the
//!   coordinator (for its ops view), and clears the report when none are left.

mod gateway;
mod hub;

use crate::env::NodeAssignment;
use crate::failover::{self, Coordinators, Retry};
use futures::channel::mpsc::{UnboundedSender, unbounded};
use gateway::Ranks;
use hub::{Hub, Sink, farewell};
use muster_core::contract::frame::{self, Frame, FrameError};
use muster_proto::v1 as pb;
use muster_proto::v1::relay_client::RelayClient;
use std::cell::{Cell, RefCell};
use std::io;
use std::io::{Read, Write};
use std::os::unix::fs::DirBuilderExt;
use std::path::PathBuf;
use std::rc::Rc;
use std::sync::Arc;
use std::sync::atomic::AtomicU64;
use std::time::{Duration, Instant};
use tokio::io::Interest;
use tokio::io::unix::AsyncFd;
use tokio::net::UnixListener;
use tokio::sync::{Notify, oneshot};
use tokio::task::{AbortHandle, spawn_local};
use tonic::{Status, Streaming};

/// The largest frame body either side accepts (bigger ones end the connection).
pub use muster_core::contract::frame::MAX_FRAME;
/// How long [`Relay::start`] waits for the relay to reach the coordinator.
pub const START_TIMEOUT: Duration = Duration::from_secs(5);
/// The relay socket's file name inside its private directory.
const SOCKET_NAME: &str = "relay.sock";
/// How old a wait held by the relay must be before the coordinator is told of it, and how
/// often the report is refreshed.
pub const REPORT_AFTER: Duration = Duration::from_secs(1);
/// The initial size of a connection's read buffer (entries are a few dozen bytes).
const READ_CHUNK: usize = 4096;
/// How often a connection's unwritten backlog is retried.
const FLUSH_RETRY: Duration = Duration::from_millis(1);

/// Why the relay could not start. The agent then runs its workers without it (their barriers
/// go through their coordinator sessions).
#[derive(Debug, thiserror::Error)]
pub enum RelayError {
    /// The private socket directory could not be created.
    #[error("cannot create a private directory under {}: {source}", .base.display())]
    Dir {
        /// The temporary directory it was created in.
        base: PathBuf,
        /// Why.
        #[source]
        source: io::Error,
    },
    /// The socket path is not UTF-8, so it cannot be passed in the environment as text.
    #[error("the relay socket path {} is not UTF-8", .0.display())]
    Path(PathBuf),
    /// Binding the socket failed (a path longer than a Unix socket allows, ...).
    #[error("cannot listen on {}: {source}", .path.display())]
    Listen {
        /// The socket path.
        path: PathBuf,
        /// Why.
        #[source]
        source: io::Error,
    },
    /// The relay thread or its runtime could not be started.
    #[error("cannot start the relay thread: {0}")]
    Thread(#[source] io::Error),
    /// The coordinator could not be reached.
    #[error("cannot reach the coordinator at {addr}: {why}")]
    Connect {
        /// The coordinator's address.
        addr: String,
        /// Why.
        why: String,
    },
    /// The coordinator refused the relay (an older coordinator without `Relay`, a stale
    /// generation, a second relay for the node).
    #[error("the coordinator at {addr} refused the relay of node {node_rank}: {why}")]
    Attach {
        /// The coordinator's address.
        addr: String,
        /// The node.
        node_rank: u32,
        /// The coordinator's answer.
        why: String,
    },
    /// The relay did not get going within [`START_TIMEOUT`].
    #[error("the relay did not start within {:.1}s", START_TIMEOUT.as_secs_f64())]
    Timeout,
    /// The relay thread ended before saying whether it started.
    #[error("the relay thread ended unexpectedly")]
    Ended,
}

/// A running relay. Dropping it stops the relay thread (waiting for it) and removes the socket
/// directory.
#[derive(Debug)]
pub struct Relay {
    dir: PathBuf,
    socket: String,
    /// The barriers completed for the node's ranks ([`Relay::completed`]).
    completed: Arc<AtomicU64>,
    stop: Option<oneshot::Sender<()>>,
    thread: Option<std::thread::JoinHandle<()>>,
    /// Stops the gateway ([`gateway::serve`]).
    stop_gateway: Option<oneshot::Sender<()>>,
    /// Stops the step socket's reader ([`gateway::steps`]).
    stop_steps: Option<oneshot::Sender<()>>,
}

impl Relay {
    /// Starts the relay of `node`'s generation on a thread of its own: creates the socket in a
    /// fresh private directory (mode 0700) under the temporary directory, connects
    /// `Relay.Attach` to the coordinator (the leader among `node.coordinator`'s replicas) and
    /// registers the node. Returns once workers may connect.
    pub async fn start(node: &NodeAssignment) -> Result<Self, RelayError> {
        let coordinators =
            failover::from_list(&node.coordinator, node.failover_timeout).waiting_out_outages();
        Self::start_with(node, &coordinators).await
    }

    /// [`Relay::start`], beginning with the replica `coordinators` believes leads (the relay
    /// thread then follows the leader on its own).
    pub async fn start_with(
        node: &NodeAssignment,
        coordinators: &Coordinators,
    ) -> Result<Self, RelayError> {
        let dir = private_dir()?;
        // From here on, dropping `relay` cleans up.
        let mut relay = Relay {
            socket: String::new(),
            dir,
            completed: Arc::default(),
            stop: None,
            thread: None,
            stop_gateway: None,
            stop_steps: None,
        };
        let path = relay.dir.join(SOCKET_NAME);
        relay.socket = path
            .to_str()
            .ok_or_else(|| RelayError::Path(path.clone()))?
            .to_owned();
        let listener = std::os::unix::net::UnixListener::bind(&path)
            .and_then(|l| l.set_nonblocking(true).map(|()| l))
            .map_err(|source| RelayError::Listen {
                path: path.clone(),
                source,
            })?;
        let gateway_path = relay.dir.join(muster_core::contract::AGENT_GATEWAY_SOCKET);
        let gateway =
            tokio::net::UnixListener::bind(&gateway_path).map_err(|source| RelayError::Listen {
                path: gateway_path,
                source,
            })?;
        let steps_path = relay.dir.join(muster_core::contract::STEP_SOCKET);
        let steps =
            tokio::net::UnixDatagram::bind(&steps_path).map_err(|source| RelayError::Listen {
                path: steps_path,
                source,
            })?;
        let ranks = Arc::new(Ranks::default());
        let (stop_steps, steps_stopped) = oneshot::channel();
        relay.stop_steps = Some(stop_steps);
        // Task "step-socket", one per relay, on the agent's runtime; ends when the relay is
        // dropped.
        tokio::spawn(gateway::steps(steps, Arc::clone(&ranks), steps_stopped));
        let (ready_tx, ready_rx) = oneshot::channel();
        let (stop_tx, stop_rx) = oneshot::channel();
        relay.stop = Some(stop_tx);
        let (stop_gateway, gateway_stopped) = oneshot::channel();
        relay.stop_gateway = Some(stop_gateway);
        // Task policy: one per relay, on the agent's runtime; ends when the relay is dropped.
        tokio::spawn(gateway::serve(
            gateway,
            Arc::clone(&ranks),
            coordinators.clone(),
            gateway_stopped,
        ));
        let node = node.clone();
        // Channels of the relay's own (they run on its thread's runtime).
        let coordinators = coordinators.fork();
        let completed = Arc::clone(&relay.completed);
        relay.thread = Some(
            std::thread::Builder::new()
                .name("muster-relay".to_owned())
                .spawn(move || {
                    relay_thread(
                        node,
                        coordinators,
                        listener,
                        (completed, ranks),
                        ready_tx,
                        stop_rx,
                    )
                })
                .map_err(RelayError::Thread)?,
        );
        match tokio::time::timeout(START_TIMEOUT, ready_rx).await {
            Ok(Ok(Ok(()))) => Ok(relay),
            Ok(Ok(Err(e))) => Err(e),
            Ok(Err(_)) => Err(RelayError::Ended),
            Err(_) => Err(RelayError::Timeout),
        }
    }

    /// How many barriers the relay has completed for the node's ranks, counting on: the
    /// stack sampler takes a change for progress ([`crate::stacks::Sampler::with_barriers`]).
    pub fn completed(&self) -> Arc<AtomicU64> {
        Arc::clone(&self.completed)
    }

    /// The socket workers connect to (the value of `MUSTER_AGENT_SOCKET`).
    pub fn socket(&self) -> &str {
        &self.socket
    }
}

impl Drop for Relay {
    /// Stops the relay thread (it ends at its next wakeup, within microseconds), waits for it,
    /// and removes the socket directory.
    fn drop(&mut self) {
        if let Some(stop) = self.stop_gateway.take() {
            let _ = stop.send(());
        }
        if let Some(stop) = self.stop_steps.take() {
            let _ = stop.send(());
        }
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        if let Some(thread) = self.thread.take()
            && thread.join().is_err()
        {
            tracing::warn!("the relay thread panicked");
        }
        if let Err(e) = std::fs::remove_dir_all(&self.dir) {
            tracing::debug!(dir = %self.dir.display(), %e, "cannot remove the relay directory");
        }
    }
}

/// The relay thread: a `current_thread` runtime and a `LocalSet` running the relay until
/// `stop` (or until it fails to start, after saying why on `ready`); every task of the relay
/// is dropped with them.
fn relay_thread(
    node: NodeAssignment,
    coordinators: Coordinators,
    listener: std::os::unix::net::UnixListener,
    shared: (Arc<AtomicU64>, Arc<Ranks>),
    ready: oneshot::Sender<Result<(), RelayError>>,
    stop: oneshot::Receiver<()>,
) {
    let runtime = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(runtime) => runtime,
        Err(e) => {
            let _ = ready.send(Err(RelayError::Thread(e)));
            return;
        }
    };
    let tasks = tokio::task::LocalSet::new();
    tasks.block_on(&runtime, async move {
        tokio::select! {
            _ = stop => {}
            () = relay_main(node, coordinators, listener, shared, ready) => {}
        }
    });
}

/// Creates `<tmp>/muster-<pid>-<random>` with mode 0700.
fn private_dir() -> Result<PathBuf, RelayError> {
    let base = std::env::temp_dir();
    let mut last = io::Error::other("no attempt");
    for _ in 0..16 {
        let dir = base.join(format!(
            "muster-{}-{:016x}",
            std::process::id(),
            random_u64()
        ));
        match std::fs::DirBuilder::new().mode(0o700).create(&dir) {
            Ok(()) => return Ok(dir),
            Err(e) if e.kind() == io::ErrorKind::AlreadyExists => last = e,
            Err(e) => {
                last = e;
                break;
            }
        }
    }
    Err(RelayError::Dir { base, source: last })
}

use failover::random_u64;

/// Encodes `msg` as one frame into `out`, replacing what was there (the contract's framing).
pub use muster_core::contract::frame::encode as encode_frame;

/// The relay's state: the barrier hub, the wires its answers go out on, and the ranks
/// registered through the gateway.
struct State {
    hub: Hub,
    wires: Wires,
    ranks: Arc<Ranks>,
}

impl State {
    /// An event from the coordinator: a rank's for the gateway, the rest for the hub.
    fn on_event(&mut self, event: pb::RelayEvent) {
        match event.kind {
            Some(pb::relay_event::Kind::Rank(rank)) => self.ranks.deliver(rank),
            _ => self.hub.on_event(event, &mut self.wires),
        }
    }
}

type Shared = Rc<RefCell<State>>;

/// Attaches to the coordinator, then serves workers forever (returns only if it could not
/// start, after saying why on `ready`).
async fn relay_main(
    node: NodeAssignment,
    coordinators: Coordinators,
    listener: std::os::unix::net::UnixListener,
    (completed, ranks): (Arc<AtomicU64>, Arc<Ranks>),
    ready: oneshot::Sender<Result<(), RelayError>>,
) {
    let started = first_attach(&coordinators, &node)
        .await
        .and_then(|attached| {
            UnixListener::from_std(listener)
                .map(|listener| (attached, listener))
                .map_err(|source| RelayError::Listen {
                    path: PathBuf::from(SOCKET_NAME),
                    source,
                })
        });
    let ((to_coordinator, inbound, early), listener) = match started {
        Ok(started) => started,
        Err(e) => {
            let _ = ready.send(Err(e));
            return;
        }
    };
    ranks.attached(to_coordinator.clone(), None);
    let timer = Rc::new(Notify::new());
    let state: Shared = Rc::new(RefCell::new(State {
        hub: Hub::new(&node).counting(completed),
        wires: Wires {
            conns: (0..node.local_world_size).map(|_| None).collect(),
            frame: Vec::with_capacity(256),
            coordinator: to_coordinator,
            timer: Rc::clone(&timer),
        },
        ranks,
    }));
    {
        let st = &mut *state.borrow_mut();
        for event in early {
            st.on_event(event);
        }
    }
    spawn_local(timer_loop(Rc::clone(&state), timer));
    spawn_local(report_loop(Rc::clone(&state)));
    spawn_local(coordinator_loop(
        Rc::clone(&state),
        inbound,
        coordinators,
        node,
    ));
    let _ = ready.send(Ok(()));
    accept_loop(state, listener).await;
}

type Attached = (
    UnboundedSender<pb::RelayMessage>,
    Streaming<pb::RelayEvent>,
    Vec<pb::RelayEvent>,
);

/// Why an attach failed: the address it went to and the coordinator's (or transport's) answer.
type AttachFailure = (String, Status);

/// The first attach, when the relay starts: retried across a failover within the budget (cut
/// short to leave [`START_TIMEOUT`] room to say why it failed).
async fn first_attach(
    coordinators: &Coordinators,
    node: &NodeAssignment,
) -> Result<Attached, RelayError> {
    let budget = coordinators
        .failover_timeout()
        .min(START_TIMEOUT.saturating_sub(Duration::from_secs(1)));
    let mut retry = Retry::new(budget);
    loop {
        match attach(coordinators, node, false, 0).await {
            Ok(attached) => return Ok(attached),
            Err((addr, status)) => {
                if failover::retryable(&status) && retry.pause().await {
                    continue;
                }
                return Err(match status.code() {
                    tonic::Code::Unavailable if status.message().contains("connect") => {
                        RelayError::Connect {
                            addr,
                            why: crate::security::explain(&status),
                        }
                    }
                    _ => RelayError::Attach {
                        addr,
                        node_rank: node.node_rank,
                        why: crate::security::explain(&status),
                    },
                });
            }
        }
    }
}

/// Opens `Relay.Attach` on the current coordinator and registers the node (`resume` and
/// `released` when it re-registers after a failover). Returns the outbound sender, the inbound
/// stream, and the events that came before `registered` (a `failed` one, if the generation
/// already failed). A retryable failure has moved `coordinators` on to the next address.
async fn attach(
    coordinators: &Coordinators,
    node: &NodeAssignment,
    resume: bool,
    released: u64,
) -> Result<Attached, AttachFailure> {
    let (addr, channel) = failover::channel(coordinators);
    let failed = |status: Status| {
        if failover::retryable(&status) {
            coordinators.failed(&addr, failover::leader_hint(&status).as_deref());
        }
        (addr.clone(), status)
    };
    let (tx, rx) = unbounded();
    let _ = tx.unbounded_send(pb::RelayMessage {
        kind: Some(pb::relay_message::Kind::Register(pb::RelayRegister {
            job_id: node.job_id.clone(),
            generation: node.generation,
            node_rank: node.node_rank,
            resume,
            released,
            node_id: node.node_id.clone(),
        })),
    });
    let mut inbound = RelayClient::new(channel)
        .attach(rx)
        .await
        .map_err(failed)?
        .into_inner();
    let mut early = Vec::new();
    loop {
        match inbound.message().await {
            Ok(Some(pb::RelayEvent {
                kind: Some(pb::relay_event::Kind::Registered(_)),
            })) => return Ok((tx, inbound, early)),
            Ok(Some(event)) => early.push(event),
            Ok(None) => {
                return Err(failed(Status::unavailable(
                    "the stream ended before `registered`",
                )));
            }
            Err(status) => return Err(failed(status)),
        }
    }
}

/// Task "relay-accept": one "relay-conn" task per worker connection.
async fn accept_loop(state: Shared, listener: UnixListener) {
    loop {
        match listener.accept().await {
            Ok((stream, _)) => {
                // Readable interest only: with EPOLLOUT registered too, every read of an answer
                // by a worker (which frees space in this socket's send buffer) would wake this
                // thread for nothing.
                let fd = match stream.into_std().and_then(watch_readable) {
                    Ok(fd) => fd,
                    Err(e) => {
                        tracing::warn!(%e, "the relay cannot watch a worker connection");
                        continue;
                    }
                };
                let conn = Rc::new(Conn {
                    fd,
                    backlog: RefCell::new(Vec::new()),
                    flushing: Cell::new(false),
                    reader: RefCell::new(None),
                });
                let task = spawn_local(serve_conn(Rc::clone(&state), Rc::clone(&conn)));
                *conn.reader.borrow_mut() = Some(task.abort_handle());
            }
            Err(e) => {
                tracing::warn!(%e, "the relay cannot accept a worker connection");
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        }
    }
}

/// Registers a worker socket with the runtime for readability only.
///
/// tokio 1.54 deprecates the safe `AsyncFd` constructors because a generic `AsRawFd` type may
/// close or swap its descriptor behind the registration (tokio PR #8587); the replacement is
/// `unsafe`, which this workspace denies. A `std::os::unix::net::UnixStream` owns its
/// descriptor and never changes it, which is exactly the condition the unsafe constructor
/// asks for, so the safe one is sound here.
#[allow(deprecated)]
fn watch_readable(
    stream: std::os::unix::net::UnixStream,
) -> io::Result<AsyncFd<std::os::unix::net::UnixStream>> {
    AsyncFd::with_interest(stream, Interest::READABLE)
}

/// Task "relay-timer": sleeps until the earliest wait deadline and answers the expired waits.
async fn timer_loop(state: Shared, wake: Rc<Notify>) {
    loop {
        let next = state.borrow_mut().hub.arm();
        match next {
            Some(at) => {
                tokio::select! {
                    () = tokio::time::sleep_until(at.into()) => {
                        let st = &mut *state.borrow_mut();
                        st.hub.expire(Instant::now(), &mut st.wires);
                    }
                    () = wake.notified() => {}
                }
            }
            None => wake.notified().await,
        }
    }
}

/// Task "relay-report": once a second, tells the coordinator which waits this relay holds
/// that are at least [`REPORT_AFTER`] old (and once more, empty, when none are left), so its
/// ops view shows who waits where even for barriers that never reach it. Ends with the relay.
async fn report_loop(state: Shared) {
    let mut reported = false;
    loop {
        tokio::time::sleep(REPORT_AFTER).await;
        let st = &mut *state.borrow_mut();
        let barriers = st.hub.waiting_report(Instant::now(), REPORT_AFTER);
        if barriers.is_empty() && !reported {
            continue;
        }
        reported = !barriers.is_empty();
        st.wires.coordinator(pb::RelayMessage {
            kind: Some(pb::relay_message::Kind::Waiting(pb::WaitingReport {
                barriers,
            })),
        });
    }
}

/// Task "relay-coordinator": hands the coordinator's events to the hub. When the stream ends
/// the way a coordinator that went away ends it, re-registers with the leader and re-sends the
/// global barriers in flight (see the module doc); when that fails for good, closes every
/// worker connection with a farewell naming the coordinator.
async fn coordinator_loop(
    state: Shared,
    mut inbound: Streaming<pb::RelayEvent>,
    coordinators: Coordinators,
    node: NodeAssignment,
) {
    let why = 'relay: loop {
        let addr = coordinators.leader_addr();
        let ended = loop {
            match inbound.message().await {
                Ok(Some(event)) => state.borrow_mut().on_event(event),
                Ok(None) => break Status::unavailable("the coordinator ended the stream"),
                Err(status) => break status,
            }
        };
        let why = format!("{:?}: {}", ended.code(), ended.message());
        if !failover::retryable(&ended) {
            break 'relay format!(
                "the node relay lost its stream to the coordinator at {addr}: {why}"
            );
        }
        coordinators.failed(&addr, failover::leader_hint(&ended).as_deref());
        eprintln!(
            "muster-agent: job {}: the node relay lost its stream to the coordinator at {addr} ({why}); re-registering with the leader",
            node.job_id
        );
        let lost_at = Instant::now();
        // Through an etcd outage (every replica refuses as not the leader) the relay
        // keeps its workers' connections and waits; the node's watch decides whether the
        // workers keep running.
        let mut retry = Retry::new(coordinators.failover_timeout());
        loop {
            if !retry.pause_until(coordinators.held_until_for_calls()).await {
                break 'relay format!(
                    "the node relay lost its stream to the coordinator at {addr} ({why}) and no replica took it back within {} ms",
                    coordinators.failover_timeout().as_millis()
                );
            }
            let released = state.borrow().hub.released();
            match attach(&coordinators, &node, true, released).await {
                Ok((tx, stream, early)) => {
                    let st = &mut *state.borrow_mut();
                    // The ranks first: the leader takes a node's entries only of ranks it
                    // knows.
                    st.ranks.attached(tx.clone(), Some(st.hub.released_seqs()));
                    st.wires.coordinator = tx;
                    for event in early {
                        st.on_event(event);
                    }
                    st.hub.resend(&mut st.wires);
                    inbound = stream;
                    crate::metrics::failover(crate::metrics::Stream::Relay);
                    eprintln!(
                        "muster-agent: job {}: node relay re-registered with the coordinator at {} {:.0} ms after losing {addr}",
                        node.job_id,
                        coordinators.leader_addr(),
                        lost_at.elapsed().as_secs_f64() * 1000.0
                    );
                    continue 'relay;
                }
                Err((to, status)) if failover::retryable(&status) => {
                    coordinators.saw(&to, &status);
                    tracing::debug!(%to, %status, "the node relay could not re-register yet");
                }
                Err((to, status)) => {
                    break 'relay format!(
                        "the node relay lost its stream to the coordinator at {addr} ({why}), and the coordinator at {to} refused it back: {}",
                        crate::security::explain(&status)
                    );
                }
            }
        }
    };
    tracing::warn!(%why, "the node relay gives up");
    let st = &mut *state.borrow_mut();
    st.ranks.close(&why);
    st.hub.coordinator_lost(why, &mut st.wires);
}

/// One worker connection as the writers see it.
struct Conn {
    /// The socket, non-blocking, registered for readability only.
    fd: AsyncFd<std::os::unix::net::UnixStream>,
    /// Bytes that could not be written yet, in order; written before anything newer.
    backlog: RefCell<Vec<u8>>,
    /// Whether a "relay-flush" task is draining the backlog.
    flushing: Cell<bool>,
    /// The "relay-conn" task reading this connection.
    reader: RefCell<Option<AbortHandle>>,
}

impl Conn {
    /// Writes one frame without waiting: straight to the socket, or behind the backlog.
    fn send(self: &Rc<Self>, frame: &[u8]) {
        let mut backlog = self.backlog.borrow_mut();
        if backlog.is_empty() {
            match self.fd.get_ref().write(frame) {
                Ok(n) if n == frame.len() => return,
                Ok(n) => backlog.extend_from_slice(&frame[n..]),
                Err(e) if retry_write(&e) => backlog.extend_from_slice(frame),
                // The connection is broken; its reader sees that and reports it.
                Err(_) => return,
            }
        } else {
            backlog.extend_from_slice(frame);
        }
        if !self.flushing.replace(true) {
            spawn_local(flush(Rc::clone(self)));
        }
    }

    /// Stops reading; the socket closes once the backlog is written (or at once).
    fn close(&self) {
        if let Some(reader) = self.reader.borrow_mut().take() {
            reader.abort();
        }
    }
}

/// Whether a failed non-blocking write may succeed later.
fn retry_write(e: &io::Error) -> bool {
    matches!(
        e.kind(),
        io::ErrorKind::WouldBlock | io::ErrorKind::Interrupted
    )
}

/// Task "relay-flush": writes a connection's backlog as the socket accepts it; ends when it is
/// empty or the connection breaks. It retries every [`FLUSH_RETRY`] rather than waiting for
/// writability, which the socket is not registered for: a worker has at most one answer per
/// scope outstanding, so a full socket buffer means a worker that stopped reading.
async fn flush(conn: Rc<Conn>) {
    loop {
        tokio::time::sleep(FLUSH_RETRY).await;
        let mut backlog = conn.backlog.borrow_mut();
        match conn.fd.get_ref().write(&backlog) {
            Ok(n) => {
                backlog.drain(..n);
                if backlog.is_empty() {
                    break;
                }
            }
            Err(e) if retry_write(&e) => {}
            Err(_) => {
                backlog.clear();
                break;
            }
        }
    }
    conn.flushing.set(false);
}

/// The relay's side of the [`Sink`]: worker sockets and the coordinator stream.
struct Wires {
    /// Each local rank's connection, once registered.
    conns: Vec<Option<Rc<Conn>>>,
    /// The encoded frame being sent (reused).
    frame: Vec<u8>,
    coordinator: UnboundedSender<pb::RelayMessage>,
    timer: Rc<Notify>,
}

impl Sink for Wires {
    fn workers(&mut self, to: &[u32], msg: &pb::CoordinatorMessage) {
        encode_frame(msg, &mut self.frame);
        for &local in to {
            if let Some(Some(conn)) = self.conns.get(local as usize) {
                conn.send(&self.frame);
            }
        }
    }

    fn coordinator(&mut self, msg: pb::RelayMessage) {
        // A closed stream is reported by "relay-coordinator".
        let _ = self.coordinator.unbounded_send(msg);
    }

    fn close(&mut self, local: u32, why: &str) {
        if let Some(conn) = self.conns.get_mut(local as usize).and_then(Option::take) {
            encode_frame(&farewell(why), &mut self.frame);
            conn.send(&self.frame);
            conn.close();
        }
    }

    fn wake_timer(&mut self) {
        self.timer.notify_one();
    }
}

/// Where a worker connection stands.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Peer {
    /// Connected, `register` not yet received.
    New,
    /// Registered as this local rank.
    Rank(u32),
    /// Sent `leave`; nothing more is expected.
    Left,
}

/// Task "relay-conn": reads one worker's frames and hands them to the hub. A connection that
/// ends while registered and not left marks its rank dead.
async fn serve_conn(state: Shared, conn: Rc<Conn>) {
    let mut input = InBuf::default();
    let mut peer = Peer::New;
    let why = 'conn: loop {
        let mut ready = match conn.fd.readable().await {
            Ok(ready) => ready,
            Err(e) => break format!("lost its connection to the agent ({e})"),
        };
        let space = input.space();
        let room = space.len();
        match ready.try_io(|fd| fd.get_ref().read(space)) {
            Ok(Ok(0)) => {
                break "lost its connection to the agent (process exited or was killed)".into();
            }
            Ok(Ok(n)) => {
                input.end += n;
                if n < room {
                    // A short read drained the socket: skip the read that would only say
                    // WouldBlock (new input raises readiness again).
                    ready.clear_ready();
                }
            }
            Ok(Err(e)) if e.kind() == io::ErrorKind::Interrupted => continue,
            Ok(Err(e)) => break format!("lost its connection to the agent ({e})"),
            Err(_would_block) => continue,
        }
        loop {
            let (msg, used) = match frame::decode::<pb::WorkerMessage>(input.data()) {
                Ok(Frame::Complete { message, len }) => (message, len),
                Ok(Frame::Partial { .. }) => break,
                Err(FrameError::TooLarge(len)) => {
                    break 'conn format!(
                        "sent a frame of {len} bytes to the agent (the limit is {MAX_FRAME})"
                    );
                }
                Err(FrameError::Malformed(e)) => {
                    break 'conn format!("sent a malformed frame to the agent ({e})");
                }
            };
            input.consume(used);
            if let Err(why) = handle(&state, &conn, &mut peer, msg) {
                break 'conn why;
            }
            if peer == Peer::Left {
                return;
            }
        }
    };
    let Peer::Rank(local) = peer else {
        return;
    };
    let st = &mut *state.borrow_mut();
    if let Some(slot) = st.wires.conns.get_mut(local as usize) {
        *slot = None;
    }
    st.hub.lost(local, &why, Instant::now(), &mut st.wires);
}

/// A connection's received bytes not yet decoded: `buf[start..end]`.
struct InBuf {
    buf: Vec<u8>,
    start: usize,
    end: usize,
}

impl Default for InBuf {
    fn default() -> Self {
        Self {
            buf: vec![0; READ_CHUNK],
            start: 0,
            end: 0,
        }
    }
}

impl InBuf {
    fn data(&self) -> &[u8] {
        &self.buf[self.start..self.end]
    }

    fn consume(&mut self, n: usize) {
        self.start += n;
        if self.start == self.end {
            self.start = 0;
            self.end = 0;
        }
    }

    /// Free room after the data: moves the data to the front, or grows the buffer when the
    /// data fills it (a frame longer than the buffer; frames are at most [`MAX_FRAME`]).
    fn space(&mut self) -> &mut [u8] {
        if self.end == self.buf.len() {
            if self.start > 0 {
                self.buf.copy_within(self.start..self.end, 0);
                self.end -= self.start;
                self.start = 0;
            } else {
                self.buf.resize(self.buf.len() * 2, 0);
            }
        }
        &mut self.buf[self.end..]
    }
}

/// Handles one worker message. An error ends the connection (and, for a registered rank,
/// marks it dead with that reason).
fn handle(
    state: &Shared,
    conn: &Rc<Conn>,
    peer: &mut Peer,
    msg: pb::WorkerMessage,
) -> Result<(), String> {
    use pb::worker_message::Kind;
    let st = &mut *state.borrow_mut();
    match (*peer, msg.kind) {
        (Peer::Rank(local), Some(Kind::Barrier(entry))) => {
            st.hub.enter(local, entry, Instant::now(), &mut st.wires);
        }
        (Peer::Rank(local), Some(Kind::Leave(_))) => {
            st.hub.leave(local, &mut st.wires);
            if let Some(slot) = st.wires.conns.get_mut(local as usize) {
                *slot = None;
            }
            *peer = Peer::Left;
        }
        (_, Some(Kind::Heartbeat(_))) => {}
        (Peer::New, Some(Kind::Register(reg))) => match st.hub.register(&reg) {
            Ok(local) => {
                encode_frame(&st.hub.registered(), &mut st.wires.frame);
                conn.send(&st.wires.frame);
                st.wires.conns[local as usize] = Some(Rc::clone(conn));
                *peer = Peer::Rank(local);
            }
            Err(why) => {
                tracing::warn!(rank = reg.rank, %why, "the relay refused a worker");
                encode_frame(&farewell(&why), &mut st.wires.frame);
                conn.send(&st.wires.frame);
                *peer = Peer::Left;
            }
        },
        (Peer::New, _) => {
            encode_frame(
                &farewell("the first message must be `register`"),
                &mut st.wires.frame,
            );
            conn.send(&st.wires.frame);
            *peer = Peer::Left;
        }
        (Peer::Rank(local), Some(Kind::Register(reg))) => {
            // In place, a replacement may send its quorum's seqs in a second `register`.
            st.hub.reregister(local, &reg)?;
            encode_frame(&st.hub.registered(), &mut st.wires.frame);
            conn.send(&st.wires.frame);
        }
        (Peer::Rank(_), None) => return Err("sent an empty message to the agent".into()),
        (Peer::Rank(_), Some(Kind::Step(_))) => {
            return Err("sent a step marker on the relay socket; it goes on the session".into());
        }
        (Peer::Rank(_), Some(Kind::Healed(_))) => {
            return Err("sent a heal report on the relay socket; it goes on the session".into());
        }
        (Peer::Left, _) => {}
    }
    Ok(())
}
