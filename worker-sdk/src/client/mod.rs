//! The async core: a connection to the coordinator ([`Coordinator`], here), a worker's session
//! (liveness and barriers: `session.rs`) and thin typed wrappers over the key-value
//! (`kv.rs`), unique-id and shared-value (`values.rs`) services and in-place recovery's
//! quorum call (`quorum.rs`), all of whose calls go through
//! one helper ([`Coordinator::unary`]) that applies the failover policy and maps errors.
//!
//! The [`crate::Accelerator`] is built on this; benchmarks use it directly to run thousands of
//! simulated ranks as tasks that share a few [`Coordinator`] connections.

mod kv;
mod quorum;
mod session;
mod values;

pub use kv::{CasOutcome, Kv, KvLane};
pub use quorum::{Heal, QUORUM_POLL, Quorum, QuorumAsk};
pub use session::{FailureWatch, Registration, Reports, Scope, Session, SessionConfig};
pub(crate) use session::{barrier_error, consumes_seq, register_message};
pub use values::{SharedValues, UniqueIds};

use std::{
    collections::HashMap,
    fmt,
    sync::{Arc, Mutex, MutexGuard, PoisonError},
    time::Duration,
};

use muster_core::contract::unix_socket;
use tonic::transport::Channel;

/// The largest message taken from the coordinator, or passed on by an agent's gateway: a
/// key-value value is up to the coordinator's `max_value_bytes` (8 MiB by default, torch's
/// limit), and a `List` carries a whole prefix's values (up to the job's `max_job_bytes`);
/// gRPC's default of 4 MiB would refuse both. The cap is the coordinator's own upper bound on
/// a message.
pub const MAX_MESSAGE_BYTES: usize = 1 << 30;

/// How a [`Coordinator`] connects (TLS or plaintext) and the credentials it sends: re-exported
/// so that SDK users need not depend on `muster-proto`.
pub use muster_proto::security::{AuthChannel, ClientSecurity, Credentials};

use crate::{
    Error,
    failover::{self, Census, Retry, Rotation},
    trace_context,
};

/// A connection to the coordinator, cheap to clone and share: tonic multiplexes every call and
/// session stream of all clones over one HTTP/2 connection per coordinator replica. It is
/// muster's one coordinator client: the workers', the agent's (its joins, watch, relay, store
/// and operator commands, `describe` among them) and the benchmarks'.
///
/// Every connection uses the same [`ClientSecurity`]: TLS (or plaintext) and the credentials
/// sent with every call and stream (`authorization: Bearer <token>`). [`Coordinator::connect`]
/// takes them from the environment (`MUSTER_TLS_*`, `MUSTER_TOKEN`: see [`crate::env`]);
/// [`Coordinator::connect_with`] takes them explicitly.
///
/// With several replicas (`host:port,host:port`), it talks to the one it believes is the
/// leader and fails over when a call or stream fails in a way worth retrying: to the address a
/// refusing follower names in its `muster-leader` metadata, else to the next address in the
/// list, with a jittered exponential backoff, for at most the failover budget
/// (`MUSTER_FAILOVER_TIMEOUT_MS`, 30 s by default). Clones share the choice of leader, so
/// one failover serves every call.
#[derive(Clone)]
pub struct Coordinator {
    inner: Arc<Replicas>,
}

/// The replicas a [`Coordinator`] knows and which of them is in use. The lock is held for a
/// few instructions, never across an await.
struct Replicas {
    /// The address list as given, for messages.
    addrs: Arc<str>,
    /// TLS and credentials, for every replica (including a leader named later).
    security: ClientSecurity,
    state: Mutex<ReplicaState>,
    /// The origin of the census's clock.
    born: tokio::time::Instant,
    /// Whether failures are retried past the budget while the census proves that no replica
    /// leads ([`Coordinator::held_until`]): a job member's client (a worker's, a running job's
    /// agent's) does; an operator's command keeps its budget and says what failed.
    outages: bool,
}

struct ReplicaState {
    /// Which replica is in use and where a failure moves (the policy's epoch tells a stale
    /// failure from a fresh one, so that many calls failing on one replica switch only once).
    rotation: Rotation,
    /// A channel for every address the rotation has been on (made on first use: lazily
    /// connected, so a connection failure shows up as the call's UNAVAILABLE).
    channels: HashMap<String, AuthChannel>,
    /// How long calls and sessions keep retrying after a failure.
    failover_timeout: Duration,
    /// Whether every replica refused lately as not the leader (an etcd outage), from the
    /// failures of every call and session of this connection.
    census: Census,
}

/// The replica a call is made on.
pub struct Current {
    /// The channel to it, carrying the credentials.
    pub channel: AuthChannel,
    /// Its address.
    pub addr: Arc<str>,
    /// The rotation's epoch when it was chosen: a failure on it is reported with this
    /// ([`Coordinator::fail_over`]), so that a stale failure moves nothing.
    pub epoch: u64,
}

/// A unary call that failed for good: its last status and the replica that gave it.
pub struct Failed {
    /// The last status.
    pub status: tonic::Status,
    /// The replica that gave it.
    pub addr: Arc<str>,
}

impl Failed {
    /// The SDK's error for it; `what` names the thing the call was about.
    fn error(self, what: impl FnOnce() -> String) -> Error {
        Error::from_status(self.status, &self.addr, what)
    }
}

impl fmt::Debug for Coordinator {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // Without the TLS settings: tonic's `Debug` of a client identity shows its private key.
        f.debug_struct("Coordinator")
            .field("addrs", &self.inner.addrs)
            .field("leader", &self.leader_addr())
            .field("tls", &self.inner.security.is_tls())
            .field("outages", &self.inner.outages)
            .finish_non_exhaustive()
    }
}

impl Coordinator {
    /// Connects to the coordinator at `addrs` (`host:port`, or a comma-separated list of the
    /// replicas' addresses, as in `MUSTER_COORDINATOR`) with TCP_NODELAY (barriers are
    /// latency-bound) and no request timeout (barriers and fetches wait as long as the
    /// generation is alive). Tries the addresses in order and fails only when none accepts a
    /// connection; the others are connected on first use. Reads the failover budget from
    /// `MUSTER_FAILOVER_TIMEOUT_MS`, and TLS and credentials from `MUSTER_TLS_*` and
    /// `MUSTER_TOKEN` ([`crate::env::security_from_env`]: plaintext without credentials when
    /// none is set).
    pub async fn connect(addrs: &str) -> Result<Self, Error> {
        Self::connect_with(addrs, crate::env::security_from_env()?).await
    }

    /// Like [`Coordinator::connect`], with explicit TLS settings and credentials instead of
    /// the environment's. With TLS, a coordinator whose certificate does not verify (another
    /// CA, another name, expired) fails the connection here, with the TLS error as the cause.
    pub async fn connect_with(addrs: &str, security: ClientSecurity) -> Result<Self, Error> {
        let list = parse_list(addrs)?;
        let failover_timeout = failover::timeout_from_env()?;
        let mut last = None;
        for addr in &list {
            match connect_now(&security, addr, list.len() > 1)?.await {
                Ok(channel) => {
                    let coordinator =
                        Self::lazy(addrs, list.clone(), failover_timeout, security, true)?;
                    coordinator.settle(addr, channel);
                    return Ok(coordinator);
                }
                Err(e) => {
                    tracing::debug!(%addr, error = %e, "coordinator replica unreachable");
                    last = Some((addr.clone(), e));
                }
            }
        }
        let (addr, source) = last.ok_or_else(|| Error::Config("no coordinator address".into()))?;
        let addr = if list.len() == 1 {
            addr
        } else {
            addrs.trim().to_owned()
        };
        Err(Error::Connection {
            addr,
            source: Arc::new(source),
        })
    }

    /// Like [`Coordinator::connect`], but connects on first use; errors then show up in the
    /// first call. Must be called inside a tokio runtime.
    pub fn connect_lazy(addrs: &str) -> Result<Self, Error> {
        Self::connect_lazy_with(addrs, crate::env::security_from_env()?)
    }

    /// Like [`Coordinator::connect_lazy`], with explicit TLS settings and credentials. A
    /// connection (or TLS handshake) that fails is retried within the failover budget, then
    /// surfaces as [`Error::Connection`] from the call that needed it.
    pub fn connect_lazy_with(addrs: &str, security: ClientSecurity) -> Result<Self, Error> {
        let list = parse_list(addrs)?;
        Self::lazy(addrs, list, failover::timeout_from_env()?, security, true)
    }

    /// The replicas `list` (checked `host:port` items, the first tried first), connected on
    /// first use, with the failover budget `budget` and `security`: the agent's constructor,
    /// which takes its budget from `--failover-timeout-ms` rather than the environment. Its
    /// failures do not wait out an etcd outage past the budget (an operator's command); see
    /// [`Coordinator::waiting_out_outages`] for a running job's agent.
    pub fn replicas(list: Vec<String>, budget: Duration, security: ClientSecurity) -> Self {
        let addrs = list.join(",");
        Self::build(&addrs, Rotation::new(list), budget, security, false)
    }

    /// A client named `addrs` with this rotation, budget, security and outage rule, no
    /// channel yet and a census of its own: every constructor's one body.
    fn build(
        addrs: &str,
        rotation: Rotation,
        budget: Duration,
        security: ClientSecurity,
        outages: bool,
    ) -> Self {
        let state = ReplicaState {
            census: Census::new(rotation.addrs().len()),
            rotation,
            channels: HashMap::new(),
            failover_timeout: budget,
        };
        Self {
            inner: Arc::new(Replicas {
                addrs: addrs.into(),
                security,
                state: Mutex::new(state),
                born: tokio::time::Instant::now(),
                outages,
            }),
        }
    }

    /// [`Coordinator::replicas`] from a list as given, each address's channel made now (so
    /// that a bad address fails here).
    fn lazy(
        addrs: &str,
        list: Vec<String>,
        budget: Duration,
        security: ClientSecurity,
        outages: bool,
    ) -> Result<Self, Error> {
        let channels = list
            .iter()
            .map(|addr| {
                let channel = open(&security, addr, list.len() > 1)?;
                Ok((addr.clone(), security.wrap(channel)))
            })
            .collect::<Result<_, Error>>()?;
        let coordinator = Self::build(addrs.trim(), Rotation::new(list), budget, security, outages);
        coordinator.state().channels = channels;
        Ok(coordinator)
    }

    /// The same replicas, budget and leader, with `security` and the outage rule `outages`,
    /// and with channels and census of its own.
    fn rebuilt(&self, security: ClientSecurity, outages: bool) -> Self {
        let (rotation, budget) = {
            let state = self.state();
            (state.rotation.clone(), state.failover_timeout)
        };
        Self::build(&self.inner.addrs, rotation, budget, security, outages)
    }

    /// The same replicas, whose calls and streams wait out an outage of etcd: past the budget
    /// for as long as every replica refuses as not the leader ([`Coordinator::held_until`]).
    /// For a running job's agent (its watch, relay, store and joins).
    #[must_use]
    pub fn waiting_out_outages(self) -> Self {
        self.rebuilt(self.inner.security.clone(), true)
    }

    /// Whether these replicas' calls and streams wait out an outage of etcd.
    pub fn waits_out_outages(&self) -> bool {
        self.inner.outages
    }

    /// The same replicas, budget and current leader, with channels of its own: for a thread
    /// that runs a runtime of its own (a tonic channel runs its connection on the runtime it
    /// was made on).
    pub fn fork(&self) -> Self {
        self.rebuilt(self.inner.security.clone(), self.inner.outages)
    }

    /// The same replicas and budget, connected with `security` (TLS settings, credentials),
    /// with channels of their own.
    #[must_use]
    pub fn with_security(self, security: ClientSecurity) -> Self {
        self.rebuilt(security, self.inner.outages)
    }

    /// Wraps a channel built elsewhere (custom transport, tests); `addr` names the coordinator
    /// in errors. Failures are retried on the same channel (and on a leader a follower names).
    /// Sends no credentials: see [`Coordinator::from_channel_with`].
    pub fn from_channel(channel: Channel, addr: impl Into<Arc<str>>) -> Self {
        Self::from_channel_with(channel, addr, ClientSecurity::plaintext())
    }

    /// Like [`Coordinator::from_channel`], sending `security`'s credentials with every call;
    /// its TLS settings only serve a leader a follower names (the channel has its own).
    pub fn from_channel_with(
        channel: Channel,
        addr: impl Into<Arc<str>>,
        security: ClientSecurity,
    ) -> Self {
        let addr: Arc<str> = addr.into();
        let coordinator = Self::build(
            &addr,
            Rotation::new(vec![addr.to_string()]),
            failover::DEFAULT_TIMEOUT,
            security,
            true,
        );
        coordinator.settle(&addr, channel);
        coordinator
    }

    fn state(&self) -> MutexGuard<'_, ReplicaState> {
        // Every update of the state is a single assignment or push: nothing to repair after a
        // panic elsewhere.
        self.inner
            .state
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
    }

    /// The replica calls go to now and a channel to it (made on first use). Must be called
    /// within a tokio runtime.
    pub fn current(&self) -> Current {
        let mut state = self.state();
        let addr = state.rotation.current().to_owned();
        let channel = match state.channels.get(&addr) {
            Some(channel) => channel.clone(),
            None => {
                // A lazy channel reports a bad address (never one the rotation moves to: the
                // list is checked and a named leader is taken only if it makes an endpoint)
                // as the call's error.
                let security = &self.inner.security;
                let several = state.rotation.addrs().len() > 1;
                let channel = security.wrap(
                    open(security, &addr, several)
                        .unwrap_or_else(|_| Channel::from_static("http://[::]:1").connect_lazy()),
                );
                state.channels.insert(addr.clone(), channel.clone());
                channel
            }
        };
        Current {
            channel,
            addr: addr.into(),
            epoch: state.rotation.epoch(),
        }
    }

    /// Moves to another replica after a failure seen on the replica of `epoch`: to `leader` if
    /// a follower named it (and it makes an endpoint), else to the next address in the list.
    /// Does nothing if another call already moved on since.
    pub fn fail_over(&self, epoch: u64, leader: Option<&str>) {
        let leader = leader.filter(|leader| self.usable(leader));
        self.state().rotation.failed_at(epoch, leader);
    }

    /// [`Coordinator::fail_over`] for a failure seen on `addr`: nothing moves if calls already
    /// went on from it. Returns the address calls go to now.
    pub fn failed(&self, addr: &str, leader: Option<&str>) -> Arc<str> {
        let leader = leader.filter(|leader| self.usable(leader));
        self.state().rotation.failed(addr, leader).into()
    }

    /// Whether a leader a follower named makes an endpoint (its channel is made on first use).
    /// Never through an agent's gateway: the agent follows the leader for its workers.
    fn usable(&self, leader: &str) -> bool {
        if self.through_agent() {
            return false;
        }
        self.state().channels.contains_key(leader)
            || endpoint(&self.inner.security, leader, true).is_ok()
    }

    /// Whether this client reaches the coordinator through its agent's gateway socket (a
    /// worker under `muster-agent`) rather than over TCP.
    pub fn through_agent(&self) -> bool {
        unix_socket(&self.inner.addrs).is_some()
    }

    /// Makes `addr` (which answered) the address calls go to, with its connected `channel`.
    pub fn settle(&self, addr: &str, channel: Channel) {
        let mut state = self.state();
        state.rotation.settle(addr);
        let channel = self.inner.security.wrap(channel);
        state.channels.insert(addr.to_owned(), channel);
    }

    /// Runs a unary call under the failover policy. `attempt` makes one attempt on the channel
    /// it is given. Failures that prove the request was not applied are retried for every
    /// call; other retryable failures only when `idempotent`. On giving up, the error names
    /// the replica that answered last.
    pub async fn call<T, F, Fut>(&self, idempotent: bool, attempt: F) -> Result<T, Failed>
    where
        F: FnMut(AuthChannel) -> Fut,
        Fut: Future<Output = Result<T, tonic::Status>>,
    {
        self.call_if(
            "call",
            |status| failover::classify_call(status).retries(idempotent),
            attempt,
        )
        .await
    }

    /// [`Coordinator::call`], retrying the failures `retry_on` accepts; `what` names the call
    /// in the log. An attempt that ran longer than the budget (a long poll that broke) starts
    /// a new streak of failures. Of a shorter one, the streak counts only the end that the
    /// connection's keep-alive may have spent on a silent replica
    /// (`muster_core::failover::held_alive`); for a worker under an agent, nothing of an
    /// attempt the agent answered (the agent retried under its own budget).
    pub async fn call_if<T, F, Fut>(
        &self,
        what: &str,
        retry_on: impl Fn(&tonic::Status) -> bool,
        mut attempt: F,
    ) -> Result<T, Failed>
    where
        F: FnMut(AuthChannel) -> Fut,
        Fut: Future<Output = Result<T, tonic::Status>>,
    {
        let mut streak: Option<Retry> = None;
        let mut census_named = false;
        loop {
            let current = self.current();
            let started = tokio::time::Instant::now();
            let status = match attempt(current.channel).await {
                Ok(value) => return Ok(value),
                Err(status) => status,
            };
            if !retry_on(&status) {
                tracing::debug!(
                    call = what,
                    failed = %current.addr,
                    code = ?status.code(),
                    message = status.message(),
                    local = failover::is_local(&status),
                    "a coordinator call failed with an answer that is not retried"
                );
                return Err(Failed {
                    status,
                    addr: current.addr,
                });
            }
            let budget = self.failover_timeout();
            let ran = started.elapsed();
            if ran >= budget {
                streak = None;
            }
            if let Some(retry) = &mut streak {
                retry.excluding(if self.through_agent() && !failover::is_local(&status) {
                    // An attempt that the worker's agent answered (rather than a socket that
                    // broke) spent the agent's budget, not this one's: the agent held it
                    // while it retried the coordinator (through a failover, or an etcd
                    // outage it waited out), and says so when its own budget ran out or the
                    // leader died with the call in flight.
                    ran
                } else {
                    // A long poll held by a running replica (a spare's parked join) spends
                    // nothing until the replica goes silent or answers.
                    failover::held_alive(ran, failover::silence_noticed_within(self.len() > 1))
                });
            }
            let retry = streak.get_or_insert_with(|| Retry::new(budget));
            self.saw(&current.addr, &status);
            let leader = failover::leader_hint(&status);
            self.fail_over(current.epoch, leader.as_deref());
            let held = self.held_until_for_calls();
            if held.is_some_and(|h| h > retry.deadline()) && !census_named {
                census_named = true;
                tracing::warn!(
                    call = what,
                    "no coordinator replica leads (each one refused as not the leader: is etcd reachable?); waiting while they all answer so"
                );
            }
            if !retry.pause_until(held).await {
                tracing::debug!(
                    call = what,
                    failed = %current.addr,
                    code = ?status.code(),
                    message = status.message(),
                    streak_ms = retry.elapsed().as_millis() as u64,
                    "a coordinator call gave up: its failover budget is spent"
                );
                return Err(Failed {
                    status,
                    addr: current.addr,
                });
            }
            tracing::debug!(
                call = what,
                failed = %current.addr,
                next = %self.leader_addr(),
                code = ?status.code(),
                message = status.message(),
                "retrying a coordinator call on another replica"
            );
        }
    }

    /// One typed unary RPC under the failover policy, written once for [`Kv`], [`UniqueIds`]
    /// and [`SharedValues`]: `request` builds the message for each attempt (a wait shrinks by
    /// the time already spent), `rpc` sends it with the caller's trace context on the channel
    /// it is given, and the reply's body is returned. A failure that is not retried, or that
    /// outlives the budget, comes back as [`Failed`], for the caller to name what it was about.
    pub(crate) async fn unary<Req, Resp, F, Fut>(
        &self,
        idempotent: bool,
        request: impl Fn() -> Req,
        rpc: F,
    ) -> Result<Resp, Failed>
    where
        F: Fn(AuthChannel, tonic::Request<Req>) -> Fut,
        Fut: Future<Output = Result<tonic::Response<Resp>, tonic::Status>>,
    {
        let response = self
            .call(idempotent, |channel| {
                rpc(channel, trace_context::request(request()))
            })
            .await?;
        Ok(response.into_inner())
    }

    /// The channel to the replica in use, for calling services this module does not wrap
    /// (Ops). Calls made on it carry this connection's credentials, but are not retried.
    pub fn channel(&self) -> AuthChannel {
        self.current().channel
    }

    /// The TLS settings and credentials every connection of this coordinator uses.
    pub fn security(&self) -> &ClientSecurity {
        &self.inner.security
    }

    /// The coordinator's `host:port`, or the comma-separated list of its replicas' addresses,
    /// as given.
    pub fn addr(&self) -> &str {
        &self.inner.addrs
    }

    /// How many replica addresses were given.
    pub fn len(&self) -> usize {
        self.state().rotation.addrs().len()
    }

    /// Whether no address was given (never, for a checked list).
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The address of the replica in use: the leader, as far as this client knows.
    pub fn leader_addr(&self) -> Arc<str> {
        self.state().rotation.current().into()
    }

    /// How long calls and sessions keep retrying after a failure before it surfaces.
    pub fn failover_timeout(&self) -> Duration {
        self.state().failover_timeout
    }

    /// A call or a stream's attach on `addr` failed with `status`: the census of the replicas
    /// counts it ([`Census`]).
    pub fn saw(&self, addr: &str, status: &tonic::Status) {
        let at = self.inner.born.elapsed();
        self.state().census.saw(addr, status, at);
    }

    /// Until when failures may go on being retried past the budget because every replica
    /// refused lately as not the leader: `hold` after the start of the census's last complete
    /// round (docs/ha.md, "An etcd outage"; `muster_core::failover::Census`); `None` without
    /// such a round, or for a client that does not
    /// [`wait out outages`](Coordinator::waits_out_outages). No leader fails a node or a rank
    /// before that start plus the coordinator's heartbeat timeout; the agent's node watch
    /// decides whether the workers keep running meanwhile.
    pub fn held_until(&self, hold: Duration) -> Option<tokio::time::Instant> {
        if !self.inner.outages {
            return None;
        }
        let proven = self.state().census.proven()?;
        Some(failover::later(self.inner.born + proven, hold))
    }

    /// [`Coordinator::held_until`] for calls and sessions: the failover budget, at least 5 s
    /// ([`muster_core::failover::call_hold`]).
    pub fn held_until_for_calls(&self) -> Option<tokio::time::Instant> {
        self.held_until(muster_core::failover::call_hold(self.failover_timeout()))
    }

    /// Changes the failover budget of this connection and all its clones (0: no retries);
    /// `connect` reads it from `MUSTER_FAILOVER_TIMEOUT_MS`.
    pub fn set_failover_timeout(&self, timeout: Duration) {
        self.state().failover_timeout = timeout;
    }
}

fn parse_list(addrs: &str) -> Result<Vec<String>, Error> {
    let addrs = addrs.trim();
    if unix_socket(addrs).is_some() {
        return Ok(vec![addrs.to_owned()]);
    }
    failover::parse_addrs(addrs).map_err(|why| {
        Error::Config(if addrs.contains(',') {
            format!("coordinator address list {addrs:?}: {why}")
        } else {
            format!("coordinator address {addrs:?} {why}")
        })
    })
}

/// The endpoint of one replica, as every client opens it ([`muster_core::failover::endpoint`]:
/// the agent's is the same).
fn endpoint(
    security: &ClientSecurity,
    addr: &str,
    several: bool,
) -> Result<tonic::transport::Endpoint, Error> {
    muster_core::failover::endpoint(security, addr, several).map_err(Error::Config)
}

/// A channel to `addr`, connected on first use: [`endpoint`]'s, or the agent's gateway socket
/// for a `unix:` address (plaintext and without the TCP settings: the socket is in the agent's
/// private directory).
fn open(security: &ClientSecurity, addr: &str, several: bool) -> Result<Channel, Error> {
    Ok(match unix_socket(addr) {
        Some(path) => gateway().connect_with_connector_lazy(UnixConnector(path.into())),
        None => endpoint(security, addr, several)?.connect_lazy(),
    })
}

/// [`open`], connecting now: the future fails if `addr` cannot be reached.
fn connect_now(
    security: &ClientSecurity,
    addr: &str,
    several: bool,
) -> Result<impl Future<Output = Result<Channel, tonic::transport::Error>> + use<>, Error> {
    let (endpoint, unix) = match unix_socket(addr) {
        Some(path) => (gateway(), Some(UnixConnector(path.into()))),
        None => (endpoint(security, addr, several)?, None),
    };
    Ok(async move {
        match unix {
            Some(connector) => endpoint.connect_with_connector(connector).await,
            None => endpoint.connect().await,
        }
    })
}

/// The endpoint an agent's gateway socket is reached through (its URI only names the
/// HTTP/2 authority; [`UnixConnector`] makes the connection).
fn gateway() -> tonic::transport::Endpoint {
    tonic::transport::Endpoint::from_static("http://muster-agent")
}

/// Connects to a Unix socket, for tonic's channel.
#[derive(Clone)]
struct UnixConnector(Arc<std::path::Path>);

impl tower_service::Service<http::Uri> for UnixConnector {
    type Response = hyper_util::rt::TokioIo<tokio::net::UnixStream>;
    type Error = std::io::Error;
    type Future = std::pin::Pin<
        Box<dyn Future<Output = Result<Self::Response, Self::Error>> + Send + 'static>,
    >;

    fn poll_ready(
        &mut self,
        _: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Result<(), Self::Error>> {
        std::task::Poll::Ready(Ok(()))
    }

    fn call(&mut self, _: http::Uri) -> Self::Future {
        let path = Arc::clone(&self.0);
        Box::pin(async move {
            tokio::net::UnixStream::connect(&*path)
                .await
                .map(hyper_util::rt::TokioIo::new)
        })
    }
}

/// `None` (wait as long as the generation lives) is 0 on the wire; a real wait is at least 1 ms
/// so that it never turns into "forever".
pub(crate) fn wait_ms(wait: Option<Duration>) -> u64 {
    wait.map_or(0, |w| {
        u64::try_from(w.as_millis()).unwrap_or(u64::MAX).max(1)
    })
}
