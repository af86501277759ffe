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
pub use session::{FailureWatch, Registration, Scope, Session, SessionConfig};
pub(crate) use session::{barrier_error, consumes_seq, register_message};
pub use values::{SharedValues, UniqueIds};

use std::{
    collections::HashMap,
    fmt,
    sync::{Arc, Mutex, MutexGuard, PoisonError},
    time::Duration,
};

use tonic::transport::Channel;

/// How a [`Coordinator`] connects (TLS or plaintext) and the credentials it sends: re-exported
/// so that SDK users need not depend on `muster-proto`.
pub use muster_proto::security::{AuthChannel, ClientSecurity, Credentials};

use crate::{
    Error,
    failover::{self, Census, Retry, Rotation},
    trace_context,
};

/// A connection to the coordinator, cheap to clone and share: tonic multiplexes every call and
/// session stream of all clones over one HTTP/2 connection per coordinator replica.
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
}

struct ReplicaState {
    /// Which replica is in use and where a failure moves (the policy's epoch tells a stale
    /// failure from a fresh one, so that many calls failing on one replica switch only once).
    rotation: Rotation,
    /// A channel for every address the rotation can be on: the configured ones, then any
    /// leader named by a follower that was not among them (added before the rotation moves
    /// there).
    channels: HashMap<String, AuthChannel>,
    /// How long calls and sessions keep retrying after a failure.
    failover_timeout: Duration,
    /// Whether every replica refused lately as not the leader (an etcd outage), from the
    /// failures of every call and session of this connection.
    census: Census,
}

/// The replica a call is made on.
pub(crate) struct Current {
    pub(crate) channel: AuthChannel,
    pub(crate) addr: Arc<str>,
    pub(crate) epoch: u64,
}

/// A unary call that failed for good: its last status and the replica that gave it.
pub(crate) struct Failed {
    status: tonic::Status,
    addr: Arc<str>,
}

impl Failed {
    /// The SDK's error for it; `what` names the thing the call was about.
    fn error(self, what: impl FnOnce() -> String) -> Error {
        Error::from_status(self.status, &self.addr, what)
    }
}

impl fmt::Debug for Coordinator {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Coordinator")
            .field("addrs", &self.inner.addrs)
            .field("leader", &self.leader_addr())
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
        let mut connected = None;
        for (index, addr) in list.iter().enumerate() {
            match endpoint(&security, addr, list.len() > 1)?.connect().await {
                Ok(channel) => {
                    connected = Some((index, channel));
                    break;
                }
                Err(e) => {
                    tracing::debug!(%addr, error = %e, "coordinator replica unreachable");
                    last = Some((addr.clone(), e));
                }
            }
        }
        let Some((current, channel)) = connected else {
            let (addr, source) =
                last.ok_or_else(|| Error::Config("no coordinator address".into()))?;
            let addr = if list.len() == 1 {
                addr
            } else {
                addrs.trim().to_owned()
            };
            return Err(Error::Connection {
                addr,
                source: Arc::new(source),
            });
        };
        let mut channel = Some(channel);
        let channels = list
            .iter()
            .enumerate()
            .map(|(index, addr)| {
                let channel = match channel.take_if(|_| index == current) {
                    Some(channel) => channel,
                    None => endpoint(&security, addr, list.len() > 1)?.connect_lazy(),
                };
                Ok((addr.clone(), security.wrap(channel)))
            })
            .collect::<Result<_, Error>>()?;
        let mut rotation = Rotation::new(list.clone());
        rotation.settle(&list[current]);
        Ok(Self::with_channels(
            addrs,
            security,
            rotation,
            channels,
            failover_timeout,
        ))
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
        let failover_timeout = failover::timeout_from_env()?;
        let channels = list
            .iter()
            .map(|addr| {
                let channel = endpoint(&security, addr, list.len() > 1)?.connect_lazy();
                Ok((addr.clone(), security.wrap(channel)))
            })
            .collect::<Result<_, Error>>()?;
        Ok(Self::with_channels(
            addrs,
            security,
            Rotation::new(list),
            channels,
            failover_timeout,
        ))
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
        let channels = HashMap::from([(addr.to_string(), security.wrap(channel))]);
        let rotation = Rotation::new(vec![addr.to_string()]);
        Self::with_channels(
            &addr,
            security,
            rotation,
            channels,
            failover::DEFAULT_TIMEOUT,
        )
    }

    fn with_channels(
        addrs: &str,
        security: ClientSecurity,
        rotation: Rotation,
        channels: HashMap<String, AuthChannel>,
        failover_timeout: Duration,
    ) -> Self {
        Self {
            inner: Arc::new(Replicas {
                addrs: addrs.trim().into(),
                security,
                state: Mutex::new(ReplicaState {
                    census: Census::new(rotation.addrs().len()),
                    rotation,
                    channels,
                    failover_timeout,
                }),
                born: tokio::time::Instant::now(),
            }),
        }
    }

    fn state(&self) -> MutexGuard<'_, ReplicaState> {
        // Every update of the state is a single assignment or push: nothing to repair after a
        // panic elsewhere.
        self.inner
            .state
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
    }

    pub(crate) fn current(&self) -> Current {
        let mut state = self.state();
        let addr = state.rotation.current().to_owned();
        let channel = match state.channels.get(&addr) {
            Some(channel) => channel.clone(),
            // Not reached: every address the rotation moves to has a channel. Should it be,
            // a lazy channel reports a bad address as the call's error.
            None => {
                let security = &self.inner.security;
                let channel = security.wrap(
                    security
                        .endpoint(&addr)
                        .unwrap_or_else(|_| Channel::from_static("http://[::]:1"))
                        .connect_lazy(),
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
    /// a follower named it, else to the next address in the list. Does nothing if another call
    /// already moved on since.
    pub(crate) fn fail_over(&self, epoch: u64, leader: Option<&str>) {
        let mut state = self.state();
        if state.rotation.epoch() != epoch {
            return;
        }
        let leader = leader.filter(|leader| {
            if state.channels.contains_key(*leader) {
                return true;
            }
            // A leader outside the list (its advertise address spelled differently): add it.
            let security = &self.inner.security;
            let Ok(endpoint) = endpoint(security, leader, true) else {
                return false;
            };
            let channel = security.wrap(endpoint.connect_lazy());
            state.channels.insert((*leader).to_owned(), channel);
            true
        });
        state.rotation.failed_at(epoch, leader);
    }

    /// Runs a unary call under the failover policy. `attempt` makes one attempt on the channel
    /// it is given. Failures that prove the request was not applied are retried for every
    /// call; other retryable failures only when `idempotent`. On giving up, the error names
    /// the replica that answered last.
    pub(crate) async fn call<T, F, Fut>(
        &self,
        idempotent: bool,
        mut attempt: F,
    ) -> Result<T, Failed>
    where
        F: FnMut(AuthChannel) -> Fut,
        Fut: Future<Output = Result<T, tonic::Status>>,
    {
        let mut retry: Option<Retry> = None;
        loop {
            let current = self.current();
            let status = match attempt(current.channel).await {
                Ok(value) => return Ok(value),
                Err(status) => status,
            };
            if !failover::classify_call(&status).retries(idempotent) {
                return Err(Failed {
                    status,
                    addr: current.addr,
                });
            }
            let retry = retry.get_or_insert_with(|| Retry::new(self.failover_timeout()));
            self.saw(&current.addr, &status);
            let leader = failover::leader_hint(&status);
            self.fail_over(current.epoch, leader.as_deref());
            if !retry.wait(self.held_until()).await {
                return Err(Failed {
                    status,
                    addr: current.addr,
                });
            }
            tracing::debug!(
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

    /// The address of the replica in use: the leader, as far as this client knows.
    pub fn leader_addr(&self) -> Arc<str> {
        self.current().addr
    }

    /// How long calls and sessions keep retrying after a failure before it surfaces.
    pub fn failover_timeout(&self) -> Duration {
        self.state().failover_timeout
    }

    /// A call or a session's attach on `addr` failed with `status`: the census of the
    /// replicas counts it ([`Census`]).
    pub(crate) fn saw(&self, addr: &str, status: &tonic::Status) {
        let at = self.inner.born.elapsed();
        self.state().census.saw(addr, status, at);
    }

    /// Until when failures go on being retried past the budget because every replica refused
    /// lately as not the leader: the failover budget (at least 5 s) again after the start of the
    /// census's last complete round (docs/ha.md, "An etcd outage"; `muster_core::failover::Census`).
    /// The agent's node watch decides whether the worker keeps running meanwhile.
    pub(crate) fn held_until(&self) -> Option<tokio::time::Instant> {
        let state = self.state();
        let proven = state.census.proven()?;
        Some(self.inner.born + proven + muster_core::failover::call_hold(state.failover_timeout))
    }

    /// Changes the failover budget of this connection and all its clones (0: no retries);
    /// `connect` reads it from `MUSTER_FAILOVER_TIMEOUT_MS`.
    pub fn set_failover_timeout(&self, timeout: Duration) {
        self.state().failover_timeout = timeout;
    }
}

fn parse_list(addrs: &str) -> Result<Vec<String>, Error> {
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

/// `None` (wait as long as the generation lives) is 0 on the wire; a real wait is at least 1 ms
/// so that it never turns into "forever".
pub(crate) fn wait_ms(wait: Option<Duration>) -> u64 {
    wait.map_or(0, |w| {
        u64::try_from(w.as_millis()).unwrap_or(u64::MAX).max(1)
    })
}
