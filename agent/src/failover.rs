//! Coordinator failover for the agent's own calls (the HA contract, `notes/ha-contract.md`):
//! which replica of a comma-separated `--coordinator` list to talk to, which failures mean
//! "try again, maybe elsewhere", and how long to keep trying (`--failover-timeout-ms`).
//!
//! The policy: calls go to the replica believed to lead. A retryable failure (UNAVAILABLE,
//! a transport or connect error, a stream that ended without a deliberate status) moves to
//! the address the refusal named in its `muster-leader` metadata, else to the next address of
//! the list (round robin), after a jittered exponential backoff (50 ms doubling to 250 ms, each
//! sleep uniform in [0.5x, 1.5x]); after the failover budget the last error surfaces as it
//! would have without failover. One address works the same way (a restarted coordinator is
//! waited for, within the budget).
//!
//! Every call the agent makes is idempotent (Join carries a request id; KV Set and Get,
//! ReportFailure and Ops reads are idempotent by nature), so [`call`] retries any retryable
//! failure. `Ops.SubmitJob` is not: [`not_applied`] says when a refusal proves it was not
//! applied, and only those are retried.
//!
//! The channels are lazily connected and cached per [`Coordinators`]; a tonic channel runs
//! its connection on the runtime it was made on, so a thread with a runtime of its own (the
//! node relay) uses a [`Coordinators::fork`] of its own. Every channel handed out is an
//! [`AuthChannel`]: it connects with the agent's TLS settings and adds its credentials to
//! every call ([`Coordinators::with_security`]), so no client of the agent can forget them.

use muster_proto::security::{AuthChannel, ClientSecurity};
use std::collections::HashMap;
use std::fmt;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;
use tokio::time::Instant;
use tonic::transport::{Channel, Endpoint};
use tonic::{Code, Status};

/// The default failover budget (`--failover-timeout-ms`, `MUSTER_FAILOVER_TIMEOUT_MS`).
pub const DEFAULT_BUDGET: Duration = Duration::from_secs(30);
/// The response metadata key in which a follower names the leader's address.
pub const LEADER_KEY: &str = "muster-leader";
/// The worker environment variable that carries the failover budget, in milliseconds.
pub const BUDGET_ENV: &str = "MUSTER_FAILOVER_TIMEOUT_MS";
/// The first backoff sleep (before jitter).
const FIRST_BACKOFF: Duration = Duration::from_millis(50);
/// The longest backoff sleep (before jitter): short, because a standby leads about one lease
/// TTL after the leader dies, and a longer sleep adds up to its own length to the failover.
const MAX_BACKOFF: Duration = Duration::from_millis(250);
/// How long one connection attempt may take.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(2);
/// With several replicas, how often a connection that has heard nothing pings its replica.
const SILENT_REPLICA_PING: Duration = Duration::from_secs(1);
/// With several replicas, how long a ping may stay unanswered before the replica is given up
/// (a frozen or unreachable leader). Longer than the coordinator's default lease TTL (3 s):
/// a leader given up has already lost its lease, so it will not act on the streams it finds
/// gone when it wakes. The SDK uses the same values (`worker-sdk/src/failover.rs`).
pub const SILENT_REPLICA_TIMEOUT: Duration = Duration::from_secs(5);

/// How long a node keeps its workers re-attaching after its watch stream broke, beyond its
/// lease: the failover budget when there are several replicas (a standby may take a while to
/// lead; the workers keep running through the failover), nothing with one address (there is
/// nobody else to fail over to, so the lease alone decides, as the README promises).
pub fn reattach_budget(coordinators: &Coordinators) -> Duration {
    if coordinators.len() > 1 {
        coordinators.budget()
    } else {
        Duration::ZERO
    }
}

/// Splits a `--coordinator` value into its addresses (`host:port,host:port`, blanks around
/// items ignored). Returns `None` if an item is empty; the caller checks each address.
pub fn split_list(list: &str) -> Option<Vec<String>> {
    let items: Vec<String> = list.split(',').map(|s| s.trim().to_owned()).collect();
    if items.iter().any(String::is_empty) {
        return None;
    }
    let mut out: Vec<String> = Vec::with_capacity(items.len());
    for item in items {
        if !out.contains(&item) {
            out.push(item);
        }
    }
    Some(out)
}

/// Whether a failed call or a stream's end may succeed on a retry (perhaps on another
/// replica): UNAVAILABLE (a follower's refusal, a connection that could not be made or
/// broke), and the codes tonic gives transport failures (UNKNOWN, INTERNAL). The statuses a
/// coordinator sends deliberately (FAILED_PRECONDITION, NOT_FOUND, INVALID_ARGUMENT,
/// ALREADY_EXISTS, ABORTED, PERMISSION_DENIED, CANCELLED, ...) are answers, not failures.
pub fn retryable(status: &Status) -> bool {
    match status.code() {
        Code::Unavailable | Code::Unknown | Code::Internal => true,
        // A CANCELLED the client made itself from a transport error ("operation was canceled:
        // transport error: connection closed": a load balancer in front of a dead replica
        // accepts and closes at once) carries that error as its source; a coordinator's
        // deliberate CANCELLED (the job was cancelled) comes over the wire without one.
        Code::Cancelled => std::error::Error::source(status).is_some(),
        _ => false,
    }
}

/// Whether a refusal proves that the request was not applied, so that even a call that is
/// not idempotent may be sent again: a follower's refusal (it names the leader, or says that
/// it is not the leader or that there is none), or a connection that could not be made.
pub fn not_applied(status: &Status) -> bool {
    if status.code() != Code::Unavailable {
        return false;
    }
    let message = status.message();
    leader_hint(status).is_some()
        || message.contains("is not the leader")
        || message.contains("no leader")
        || message.contains("tcp connect error")
        || message.contains("Connection refused")
}

/// The leader's address a follower named in its refusal, if any.
pub fn leader_hint(status: &Status) -> Option<String> {
    let value = status.metadata().get(LEADER_KEY)?.to_str().ok()?.trim();
    (!value.is_empty()).then(|| value.to_owned())
}

/// 64 random bits from the standard library's per-process hash keys, the clock and the
/// process id (good enough for jitter and request ids; not for secrets).
pub fn random_u64() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u128(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos())
            .unwrap_or_default(),
    );
    h.write_u32(std::process::id());
    h.finish()
}

/// A fresh join request id: 16 random bytes in hex.
pub fn request_id() -> String {
    format!("{:016x}{:016x}", random_u64(), random_u64())
}

/// The coordinator's replicas, which one is believed to lead, the failover budget, and a
/// channel per address. Cheap to clone; clones share what they learn.
#[derive(Clone, Debug)]
pub struct Coordinators {
    inner: Arc<Inner>,
}

struct Inner {
    /// The addresses given, in order.
    addrs: Vec<String>,
    budget: Duration,
    /// TLS settings and credentials of every channel.
    security: ClientSecurity,
    state: Mutex<State>,
}

impl fmt::Debug for Inner {
    /// Without the TLS settings: tonic's `Debug` of a client identity shows its private key.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Inner")
            .field("addrs", &self.addrs)
            .field("budget", &self.budget)
            .field("tls", &self.security.is_tls())
            .field("credentials", self.security.credentials())
            .field("state", &self.state)
            .finish()
    }
}

#[derive(Debug)]
struct State {
    /// The address calls go to (one of `addrs`, or a leader a follower named).
    current: String,
    /// The index in `addrs` the round robin moves on from.
    index: usize,
    channels: HashMap<String, Channel>,
}

impl Coordinators {
    /// The replicas `addrs` (not empty; the first is tried first) with this budget, over
    /// plaintext and without credentials.
    pub fn new(addrs: Vec<String>, budget: Duration) -> Self {
        Self::secured(addrs, budget, ClientSecurity::plaintext())
    }

    /// The same replicas and budget, connected with `security` (TLS settings, credentials);
    /// starts afresh (no channel, the first address).
    pub fn with_security(self, security: ClientSecurity) -> Self {
        Self::secured(self.inner.addrs.clone(), self.inner.budget, security)
    }

    fn secured(addrs: Vec<String>, budget: Duration, security: ClientSecurity) -> Self {
        let current = addrs.first().cloned().unwrap_or_default();
        Self {
            inner: Arc::new(Inner {
                addrs,
                budget,
                security,
                state: Mutex::new(State {
                    current,
                    index: 0,
                    channels: HashMap::new(),
                }),
            }),
        }
    }

    /// [`Coordinators::new`] from a comma-separated list (already validated).
    pub fn from_list(list: &str, budget: Duration) -> Self {
        Self::new(
            split_list(list).unwrap_or_else(|| vec![list.to_owned()]),
            budget,
        )
    }

    /// The same replicas, budget and current leader, with channels of its own: for a thread
    /// that runs a runtime of its own.
    pub fn fork(&self) -> Self {
        let fork = Self::secured(
            self.inner.addrs.clone(),
            self.inner.budget,
            self.inner.security.clone(),
        );
        {
            let mine = self.lock();
            let mut theirs = fork.lock();
            theirs.current.clone_from(&mine.current);
            theirs.index = mine.index;
        }
        fork
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.inner
            .state
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
    }

    /// The failover budget.
    pub fn budget(&self) -> Duration {
        self.inner.budget
    }

    /// The addresses as given, comma-separated (what workers get).
    pub fn list(&self) -> String {
        self.inner.addrs.join(",")
    }

    /// How many addresses were given.
    pub fn len(&self) -> usize {
        self.inner.addrs.len()
    }

    /// Whether no address was given (never, for a validated list).
    pub fn is_empty(&self) -> bool {
        self.inner.addrs.is_empty()
    }

    /// The address calls go to now.
    pub fn current(&self) -> String {
        self.lock().current.clone()
    }

    /// The security settings of the channels.
    pub fn security(&self) -> &ClientSecurity {
        &self.inner.security
    }

    /// The current address and a channel to it (lazily connected: a connection failure shows
    /// up as the call's UNAVAILABLE), carrying the credentials. Must be called within a tokio
    /// runtime.
    pub fn channel(&self) -> Result<(String, AuthChannel), Status> {
        let mut state = self.lock();
        let addr = state.current.clone();
        if let Some(channel) = state.channels.get(&addr) {
            return Ok((addr, self.inner.security.wrap(channel.clone())));
        }
        let channel = endpoint(&addr, &self.inner.security, self.len() > 1)?.connect_lazy();
        state.channels.insert(addr.clone(), channel.clone());
        Ok((addr, self.inner.security.wrap(channel)))
    }

    /// Makes `addr` (which answered) the current address, with its connected `channel`.
    pub fn settle(&self, addr: &str, channel: Channel) {
        let mut state = self.lock();
        state.current = addr.to_owned();
        if let Some(i) = self.inner.addrs.iter().position(|a| a == addr) {
            state.index = i;
        }
        state.channels.insert(addr.to_owned(), channel);
    }

    /// A call to `addr` failed retryably: the next call goes to `hint` (the leader a follower
    /// named), or else to the next address of the list. Another task may already have moved
    /// on from `addr`; then nothing changes. Returns the address calls go to now.
    pub fn failed(&self, addr: &str, hint: Option<&str>) -> String {
        let mut state = self.lock();
        if state.current != addr {
            return state.current.clone();
        }
        match hint.filter(|h| *h != addr) {
            Some(leader) => {
                state.current = leader.to_owned();
                if let Some(i) = self.inner.addrs.iter().position(|a| a == leader) {
                    state.index = i;
                }
            }
            None => {
                let n = self.inner.addrs.len().max(1);
                // An address a follower named is not in the list: go on past that follower
                // (`index` still points at it), never back to it, or a hint nobody can reach
                // would bounce the agent between the two for the whole budget.
                state.index = match self.inner.addrs.iter().position(|a| a == addr) {
                    Some(i) => (i + 1) % n,
                    None => (state.index + 1) % n,
                };
                state.current = self
                    .inner
                    .addrs
                    .get(state.index)
                    .cloned()
                    .unwrap_or_default();
            }
        }
        state.current.clone()
    }

    /// Connects to one of the addresses, trying them in turn with backoff for at most
    /// `window`; the one that answered becomes the current address. The error is the last
    /// connection failure. With TLS, a failed handshake counts as a connection failure.
    pub async fn connect(&self, window: Duration) -> Result<(String, AuthChannel), ConnectError> {
        let mut retry = Retry::new(window);
        loop {
            let addr = self.current();
            let endpoint = endpoint(&addr, &self.inner.security, self.len() > 1).map_err(|e| {
                ConnectError::Address {
                    addr: addr.clone(),
                    why: e.message().to_owned(),
                }
            })?;
            match endpoint.connect().await {
                Ok(channel) => {
                    if self.inner.security.is_tls() {
                        probe(&addr, &channel).await?;
                    }
                    self.settle(&addr, channel.clone());
                    return Ok((addr, self.inner.security.wrap(channel)));
                }
                Err(e) => {
                    let why = crate::launch::chain(&e);
                    if crate::security::is_tls_failure(&why) {
                        // A configuration error: retrying changes nothing.
                        return Err(ConnectError::Tls { addr, why });
                    }
                    tracing::debug!(%why, addr, "coordinator not reachable yet; retrying");
                    self.failed(&addr, None);
                    if !retry.pause().await {
                        return Err(ConnectError::Unreachable {
                            addrs: self.list(),
                            why,
                        });
                    }
                }
            }
        }
    }
}

/// One health check on a freshly connected TLS channel. With TLS 1.3 the client's handshake
/// completes before the coordinator has checked the client certificate; a coordinator that
/// rejects it closes the connection then, and without this probe the first real call would
/// fail with a bare "connection closed". A coordinator that answers anything (even an error)
/// accepted the handshake.
async fn probe(addr: &str, channel: &Channel) -> Result<(), ConnectError> {
    use tonic_health::pb::HealthCheckRequest;
    use tonic_health::pb::health_client::HealthClient;
    let mut client = HealthClient::new(channel.clone());
    let check = client.check(HealthCheckRequest {
        service: String::new(),
    });
    match tokio::time::timeout(CONNECT_TIMEOUT, check).await {
        Err(_) | Ok(Ok(_)) => Ok(()),
        Ok(Err(status))
            if matches!(
                status.code(),
                Code::Unknown | Code::Cancelled | Code::Unavailable | Code::Internal
            ) && std::error::Error::source(&status).is_some() =>
        {
            Err(ConnectError::Tls {
                addr: addr.to_owned(),
                why: format!(
                    "the coordinator closed the connection after the handshake ({}): it does not \
                     accept this agent's client certificate (--tls-cert, --tls-key), or requires one",
                    crate::security::explain(&status)
                ),
            })
        }
        Ok(Err(_)) => Ok(()),
    }
}

/// Why [`Coordinators::connect`] found no coordinator.
#[derive(Debug, thiserror::Error)]
pub enum ConnectError {
    /// The address is not usable as an endpoint.
    #[error("bad coordinator address '{addr}': {why}")]
    Address {
        /// The address.
        addr: String,
        /// Why.
        why: String,
    },
    /// The TLS handshake failed (an untrusted certificate, a rejected client certificate).
    #[error("TLS handshake with the coordinator at {addr} failed: {why}")]
    Tls {
        /// The address.
        addr: String,
        /// The handshake error.
        why: String,
    },
    /// None answered within the window.
    #[error("cannot reach the coordinator at {addrs}: {why}")]
    Unreachable {
        /// The addresses tried, comma-separated.
        addrs: String,
        /// The last connection error.
        why: String,
    },
}

/// The endpoint of one coordinator address, with the agent's connection settings (`https://`
/// and the TLS settings of `security` when it has them; HTTP/2 keep-alive, so that a silently
/// dead connection is noticed). One of `several` replicas is given up sooner, after
/// [`SILENT_REPLICA_TIMEOUT`] without an answer to a ping: a frozen leader's streams (the
/// watch, the relay) then fail over to the new leader instead of waiting for it to wake.
pub fn endpoint(addr: &str, security: &ClientSecurity, several: bool) -> Result<Endpoint, Status> {
    let (ping, timeout) = if several {
        (SILENT_REPLICA_PING, SILENT_REPLICA_TIMEOUT)
    } else {
        (Duration::from_secs(10), Duration::from_secs(5))
    };
    Ok(security
        .endpoint(addr)
        .map_err(Status::invalid_argument)?
        .connect_timeout(CONNECT_TIMEOUT)
        .tcp_nodelay(true)
        .http2_keep_alive_interval(ping)
        .keep_alive_timeout(timeout)
        .keep_alive_while_idle(several))
}

/// Jittered exponential backoff: 50 ms doubling to 250 ms, each sleep uniform in [0.5x, 1.5x].
#[derive(Debug, Clone)]
pub struct Backoff {
    base: Duration,
    rng: u64,
}

impl Default for Backoff {
    fn default() -> Self {
        Self::seeded(random_u64())
    }
}

impl Backoff {
    /// A backoff whose jitter comes from `seed` (tests use a fixed one).
    pub fn seeded(seed: u64) -> Self {
        Self {
            base: FIRST_BACKOFF,
            // xorshift must not start at 0.
            rng: seed | 1,
        }
    }

    /// The next sleep; the one after it is twice as long (up to 250 ms before jitter).
    pub fn next_sleep(&mut self) -> Duration {
        // xorshift64.
        self.rng ^= self.rng << 13;
        self.rng ^= self.rng >> 7;
        self.rng ^= self.rng << 17;
        // A uniform factor in [0.5, 1.5), in 1/1024 steps.
        let factor = 512 + (self.rng >> 54);
        let sleep = self.base * u32::try_from(factor).unwrap_or(1024) / 1024;
        self.base = (self.base * 2).min(MAX_BACKOFF);
        sleep
    }

    /// Back to the first step, after a success.
    pub fn reset(&mut self) {
        self.base = FIRST_BACKOFF;
    }
}

/// One streak of failures: sleeps with [`Backoff`] until the budget, counted from the streak's
/// start, is spent.
#[derive(Debug)]
pub struct Retry {
    deadline: Instant,
    backoff: Backoff,
}

impl Retry {
    /// A streak that starts now with `budget`.
    pub fn new(budget: Duration) -> Self {
        Self {
            deadline: later(Instant::now(), budget),
            backoff: Backoff::default(),
        }
    }

    /// When the budget runs out.
    pub fn deadline(&self) -> Instant {
        self.deadline
    }

    /// Sleeps before the next attempt; `false` (at once) when the budget is spent. The last
    /// sleep is cut short at the deadline, so one more attempt is made right at it.
    pub async fn pause(&mut self) -> bool {
        let now = Instant::now();
        if now >= self.deadline {
            return false;
        }
        let sleep = self.backoff.next_sleep();
        tokio::time::sleep_until(later(now, sleep).min(self.deadline)).await;
        true
    }
}

/// `t + d`, saturating far in the future instead of overflowing.
pub fn later(t: Instant, d: Duration) -> Instant {
    t.checked_add(d)
        .unwrap_or_else(|| t + Duration::from_secs(100 * 365 * 24 * 3600))
}

/// Runs `attempt` on the current coordinator until it succeeds, fails with a status that is
/// not [`retryable`], or the budget of a streak of failures is spent (then its last error is
/// returned). `what` names the call in the log. An attempt that ran longer than the budget
/// (a long poll that broke) starts a new streak. For idempotent calls only.
pub async fn call<T, F, Fut>(
    coordinators: &Coordinators,
    what: &str,
    attempt: F,
) -> Result<T, Status>
where
    F: FnMut(AuthChannel) -> Fut,
    Fut: Future<Output = Result<T, Status>>,
{
    call_if(coordinators, what, retryable, attempt).await
}

/// [`call`], retrying only the failures `retry_on` accepts (see [`not_applied`]).
pub async fn call_if<T, F, Fut>(
    coordinators: &Coordinators,
    what: &str,
    retry_on: impl Fn(&Status) -> bool,
    mut attempt: F,
) -> Result<T, Status>
where
    F: FnMut(AuthChannel) -> Fut,
    Fut: Future<Output = Result<T, Status>>,
{
    let budget = coordinators.budget();
    let mut streak: Option<Retry> = None;
    loop {
        let (addr, channel) = coordinators.channel()?;
        let started = Instant::now();
        let status = match attempt(channel).await {
            Ok(v) => return Ok(v),
            Err(status) => status,
        };
        if !retry_on(&status) {
            return Err(status);
        }
        let hint = leader_hint(&status);
        let next = coordinators.failed(&addr, hint.as_deref());
        if started.elapsed() >= budget {
            streak = None;
        }
        let retry = streak.get_or_insert_with(|| Retry::new(budget));
        if !retry.pause().await {
            return Err(status);
        }
        tracing::info!(
            call = what,
            from = %addr,
            to = %next,
            code = ?status.code(),
            message = status.message(),
            "coordinator call failed; retrying"
        );
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use tonic::metadata::MetadataValue;

    fn refusal(leader: Option<&str>, message: &str) -> Status {
        let mut s = Status::unavailable(message);
        if let Some(l) = leader {
            s.metadata_mut()
                .insert(LEADER_KEY, MetadataValue::try_from(l).unwrap());
        }
        s
    }

    #[test]
    fn lists() {
        assert_eq!(split_list("a:1").unwrap(), ["a:1"]);
        assert_eq!(split_list("a:1, b:2,a:1").unwrap(), ["a:1", "b:2"]);
        assert_eq!(split_list("a:1,,b:2"), None);
        assert_eq!(split_list(""), None);
        assert_eq!(split_list("a:1,"), None);
    }

    #[test]
    fn what_is_retried() {
        for code in [Code::Unavailable, Code::Unknown, Code::Internal] {
            assert!(retryable(&Status::new(code, "x")), "{code:?}");
        }
        for code in [
            Code::FailedPrecondition,
            Code::NotFound,
            Code::InvalidArgument,
            Code::AlreadyExists,
            Code::Aborted,
            Code::PermissionDenied,
            Code::Cancelled,
            Code::DeadlineExceeded,
            Code::Ok,
        ] {
            assert!(!retryable(&Status::new(code, "x")), "{code:?}");
        }
        // A CANCELLED made from a transport error (a balancer closing the connection of a
        // dead replica) is a failure to retry; the coordinator's own CANCELLED is an answer.
        let mut dropped = Status::new(Code::Cancelled, "operation was canceled");
        dropped.set_source(std::sync::Arc::new(std::io::Error::other(
            "transport error: connection closed",
        )));
        assert!(retryable(&dropped));
        assert!(!retryable(&Status::cancelled(
            "job 'j' was cancelled: bad lr"
        )));
        // Only a refusal that proves the request was not applied retries a non-idempotent call.
        assert!(not_applied(&refusal(Some("b:2"), "whatever")));
        assert!(not_applied(&refusal(
            None,
            "coordinator a:1 is not the leader; the leader is b:2"
        )));
        assert!(not_applied(&refusal(None, "no leader is elected yet")));
        assert!(!not_applied(&refusal(
            None,
            "error reading a body from connection"
        )));
        assert!(!not_applied(&Status::unknown("transport error")));
        assert!(!not_applied(&Status::failed_precondition(
            "is not the leader"
        )));
        assert_eq!(
            leader_hint(&refusal(Some(" b:2 "), "")).as_deref(),
            Some("b:2")
        );
        assert_eq!(leader_hint(&refusal(Some(""), "")), None);
        assert_eq!(leader_hint(&refusal(None, "")), None);
    }

    #[test]
    fn the_next_address_is_the_named_leader_else_round_robin() {
        let c = Coordinators::new(
            vec!["a:1".into(), "b:2".into(), "c:3".into()],
            DEFAULT_BUDGET,
        );
        assert_eq!(c.current(), "a:1");
        assert_eq!(c.list(), "a:1,b:2,c:3");
        assert_eq!(c.failed("a:1", None), "b:2");
        assert_eq!(c.failed("b:2", None), "c:3");
        assert_eq!(c.failed("c:3", None), "a:1");
        // A follower names the leader.
        assert_eq!(c.failed("a:1", Some("c:3")), "c:3");
        // A stale failure (another task already moved on) changes nothing.
        assert_eq!(c.failed("a:1", None), "c:3");
        // A hint naming the address that failed is no hint.
        assert_eq!(c.failed("c:3", Some("c:3")), "a:1");
        // A leader outside the list is followed; if it cannot be reached, the round robin
        // goes on past the follower that named it (not back to it: issue 14's fault suite
        // found an agent bouncing between a follower and its unreachable hint).
        assert_eq!(c.failed("a:1", Some("d:4")), "d:4");
        assert_eq!(c.failed("d:4", None), "b:2");
        assert_eq!(c.failed("b:2", Some("d:4")), "d:4");
        assert_eq!(c.failed("d:4", None), "c:3");
        // One address: always that one.
        let one = Coordinators::new(vec!["a:1".into()], DEFAULT_BUDGET);
        assert_eq!(one.failed("a:1", None), "a:1");
        // A fork starts where its parent is and learns on its own.
        let fork = c.fork();
        assert_eq!(fork.current(), "c:3");
        assert_eq!(fork.failed("c:3", None), "a:1");
        assert_eq!(c.current(), "c:3");
    }

    #[test]
    fn backoff_doubles_to_a_second_with_jitter() {
        for seed in [1, 7, 0xdead_beef, u64::MAX] {
            let mut b = Backoff::seeded(seed);
            let mut base = FIRST_BACKOFF;
            for _ in 0..12 {
                let sleep = b.next_sleep();
                assert!(
                    sleep >= base / 2 && sleep < base * 3 / 2,
                    "{sleep:?} vs {base:?}"
                );
                base = (base * 2).min(MAX_BACKOFF);
            }
            b.reset();
            assert!(b.next_sleep() < FIRST_BACKOFF * 3 / 2);
        }
        // The jitter is spread, not constant.
        let mut b = Backoff::seeded(42);
        let sleeps: Vec<Duration> = (0..20)
            .map(|_| {
                let s = b.next_sleep();
                b.reset();
                s
            })
            .collect();
        assert!(sleeps.iter().any(|s| *s != sleeps[0]));
    }

    #[test]
    fn request_ids_are_fresh_hex() {
        let (a, b) = (request_id(), request_id());
        assert_eq!(a.len(), 32);
        assert!(a.chars().all(|c| c.is_ascii_hexdigit()));
        assert_ne!(a, b);
    }

    #[tokio::test]
    async fn a_streak_ends_with_its_budget() {
        let start = Instant::now();
        let mut retry = Retry::new(Duration::from_millis(3000));
        let mut pauses = 0;
        while retry.pause().await {
            pauses += 1;
        }
        let spent = start.elapsed();
        assert!(
            spent >= Duration::from_secs(3) && spent < Duration::from_millis(3500),
            "{spent:?}"
        );
        // 50+100+200 ms, then 250 ms steps, jittered x0.5-1.5: about a dozen attempts.
        assert!((7..=30).contains(&pauses), "{pauses}");
        let mut none = Retry::new(Duration::ZERO);
        assert!(!none.pause().await);
    }

    #[tokio::test]
    async fn calls_are_retried_on_the_leader_within_the_budget() {
        use std::sync::atomic::{AtomicU32, Ordering};
        let c = Coordinators::new(vec!["a:1".into(), "b:2".into()], Duration::from_secs(1));
        // a refuses naming b; b answers.
        let seen = Arc::new(Mutex::new(Vec::new()));
        let answer = call(&c, "test", |_| {
            let addr = c.current();
            seen.lock().unwrap().push(addr.clone());
            async move {
                if addr == "a:1" {
                    Err(refusal(Some("b:2"), "coordinator a:1 is not the leader"))
                } else {
                    Ok(7)
                }
            }
        })
        .await;
        assert_eq!(answer.unwrap(), 7);
        assert_eq!(*seen.lock().unwrap(), ["a:1", "b:2"]);
        // A deliberate answer is not retried.
        let tries = AtomicU32::new(0);
        let err = call(&c, "test", |_| {
            tries.fetch_add(1, Ordering::Relaxed);
            async { Err::<(), _>(Status::not_found("no such job")) }
        })
        .await
        .unwrap_err();
        assert_eq!(err.code(), Code::NotFound);
        assert_eq!(tries.load(Ordering::Relaxed), 1);
        // Nobody answers: the last error surfaces once the budget is spent.
        let start = Instant::now();
        let err = call(&c, "test", |_| async {
            Err::<(), _>(Status::unavailable("tcp connect error"))
        })
        .await
        .unwrap_err();
        assert_eq!(err.code(), Code::Unavailable);
        let spent = start.elapsed();
        assert!(
            spent >= Duration::from_secs(1) && spent < Duration::from_millis(1500),
            "{spent:?}"
        );
        // A non-idempotent call is retried only when the refusal proves it was not applied.
        let tries = AtomicU32::new(0);
        let err = call_if(&c, "test", not_applied, |_| {
            tries.fetch_add(1, Ordering::Relaxed);
            async { Err::<(), _>(Status::unavailable("error reading a body")) }
        })
        .await
        .unwrap_err();
        assert_eq!(err.code(), Code::Unavailable);
        assert_eq!(tries.load(Ordering::Relaxed), 1);
    }
}
