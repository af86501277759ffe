//! The coordinator failover policy (the HA contract of `docs/contract.md`), written once for
//! the agent and the worker SDK: which failures are worth retrying and which prove that a
//! request was not applied, where the leader is, which replica to try next, how long to sleep
//! between attempts and for how long in all.
//!
//! Only decisions live here: the callers own their clients, channels, clocks and sleeps
//! (`agent/src/failover.rs`, `worker-sdk/src/failover.rs`), and hand this module what they
//! saw (a status, an elapsed time) to learn what to do next.

use std::error::Error as StdError;
use std::fmt;
use std::time::Duration;

use tonic::{Code, Status};

/// The response metadata key in which a follower names the leader's advertise address.
pub const LEADER_KEY: &str = "muster-leader";
/// The environment variable with the failover budget in milliseconds: the agent sets it for
/// its workers from its `--failover-timeout-ms`.
pub const BUDGET_ENV: &str = crate::contract::env::MUSTER_FAILOVER_TIMEOUT_MS;
/// The failover budget when nothing says otherwise, in milliseconds (the agent's
/// `--failover-timeout-ms` default).
pub const DEFAULT_BUDGET_MS: u64 = 30_000;
/// The failover budget when nothing says otherwise.
pub const DEFAULT_BUDGET: Duration = Duration::from_millis(DEFAULT_BUDGET_MS);
/// The first backoff sleep (before jitter); each later one doubles, up to [`MAX_BACKOFF`].
pub const FIRST_BACKOFF: Duration = Duration::from_millis(50);
/// The longest backoff sleep (before jitter): short, because a standby leads about one lease
/// TTL after the leader dies and every rank must be back before a global barrier completes;
/// a longer step adds up to its own length to the failover (measured: 1 s steps made it
/// TTL + 2.6 s, 250 ms steps TTL + 0.4 s).
pub const MAX_BACKOFF: Duration = Duration::from_millis(250);
/// The shortest time a call or a stream of a job's agent or workers keeps retrying after the
/// start of a round of the census in which every replica refused as not the leader
/// ([`call_hold`]): above the time a round takes, so that rounds that go on completing keep
/// such calls waiting through an etcd outage whatever their budget.
pub const MIN_CALL_HOLD: Duration = Duration::from_secs(5);

/// How long a call or a stream of a job's agent or workers, whose failover budget is
/// `budget`, keeps retrying after the start of the census's last complete round
/// ([`Census`]): its budget, and at least [`MIN_CALL_HOLD`].
pub fn call_hold(budget: Duration) -> Duration {
    budget.max(MIN_CALL_HOLD)
}

/// With several replicas, how often a connection that has heard nothing pings its replica
/// (HTTP/2 PING).
pub const SILENT_REPLICA_PING: Duration = Duration::from_secs(1);
/// With several replicas, how long a ping may stay unanswered before the connection is given
/// up: a replica that does not answer for that long has not run (SIGSTOP, a frozen machine)
/// or cannot be reached, and its streams fail over to the leader instead of waiting for it to
/// wake. Longer than the coordinator's default lease TTL (3 s), so that a replica given up
/// has already lost its lease and will not act on the streams it finds gone when it wakes.
/// With one address there is nobody else to go to, and the connection is left alone.
pub const SILENT_REPLICA_TIMEOUT: Duration = Duration::from_secs(5);
/// How long one attempt to open the connection to a coordinator address may take: a replica
/// that does not accept within it is down or cut off, and the next one may lead.
pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(2);
/// With one address, how often a connection that has heard nothing pings the coordinator, and
/// how long the ping may stay unanswered: a silently dead connection is noticed (a stopped
/// coordinator is waited for, since there is nobody else to go to).
const LONE_PING: (Duration, Duration) = (Duration::from_secs(10), Duration::from_secs(5));

/// How long a connection to a coordinator address takes at most to notice that the replica
/// went silent (it stopped running, or cannot be reached): the keep-alive's ping interval
/// plus the time a ping may stay unanswered, as [`endpoint`] sets them for `several`
/// replicas or one.
pub fn silence_noticed_within(several: bool) -> Duration {
    let (ping, timeout) = keep_alive(several);
    ping + timeout
}

/// The keep-alive of a connection to one of `several` replicas, or to a lone coordinator:
/// how often it pings, and how long a ping may stay unanswered.
fn keep_alive(several: bool) -> (Duration, Duration) {
    if several {
        (SILENT_REPLICA_PING, SILENT_REPLICA_TIMEOUT)
    } else {
        LONE_PING
    }
}

/// Of an attempt that ran `ran` before it failed, the part a streak of failures does not
/// count: all but its last `silence` ([`silence_noticed_within`]). Until then the replica
/// answered the connection's pings, so it was running and held the call on purpose (a long
/// poll: a spare's join, a value waited for), which says nothing against it; only the end
/// may have been spent on a replica gone silent.
pub fn held_alive(ran: Duration, silence: Duration) -> Duration {
    ran.saturating_sub(silence)
}

/// The endpoint of one coordinator address as every client opens it (the agent, the SDK,
/// `describe` and the operator's commands): `https://` with `security`'s TLS settings, else
/// `http://`; no Nagle delay; [`CONNECT_TIMEOUT`]; and HTTP/2 keep-alives. One of `several`
/// replicas is pinged every [`SILENT_REPLICA_PING`], idle or not, and given up after
/// [`SILENT_REPLICA_TIMEOUT`] without an answer, so that a frozen leader's streams fail over
/// to the new leader instead of waiting for it to wake.
pub fn endpoint(
    security: &muster_proto::security::ClientSecurity,
    addr: &str,
    several: bool,
) -> Result<tonic::transport::Endpoint, String> {
    let (ping, timeout) = keep_alive(several);
    Ok(security
        .endpoint(addr)?
        .connect_timeout(CONNECT_TIMEOUT)
        .tcp_nodelay(true)
        .http2_keep_alive_interval(ping)
        .keep_alive_timeout(timeout)
        .keep_alive_while_idle(several))
}

/// What a failed call, or the end of a stream, says about trying again.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    /// The request certainly never ran: a follower (or a coordinator without a leader)
    /// refused it before any handler, or the connection was never made. Any call may be
    /// sent again, even one that is not idempotent.
    NotApplied,
    /// The coordinator went away or is changing; the request may or may not have run. Only
    /// idempotent calls (and streams, which resume) are sent again.
    Unknown,
    /// A deliberate answer of the coordinator: it is the call's result.
    Final,
}

impl Verdict {
    /// Whether a call that is (or is not) `idempotent` is sent again after this verdict.
    pub fn retries(self, idempotent: bool) -> bool {
        match self {
            Verdict::NotApplied => true,
            Verdict::Unknown => idempotent,
            Verdict::Final => false,
        }
    }
}

/// Classifies the failure of a unary call: UNAVAILABLE (whatever its message) and any status
/// this client made from a transport error (whatever code tonic gave it) are retryable; every
/// other status came from a live coordinator on purpose and is its answer (a server-sent
/// INTERNAL or UNKNOWN included: sending the same request again gets the same answer, only
/// up to a budget later).
pub fn classify_call(status: &Status) -> Verdict {
    if not_applied(status) {
        Verdict::NotApplied
    } else if status.code() == Code::Unavailable || is_local(status) {
        Verdict::Unknown
    } else {
        Verdict::Final
    }
}

/// Classifies the end of a stream (an error while opening it or while reading it): everything
/// but a status the coordinator uses on purpose to end a stream is worth re-opening it for (a
/// server-sent INTERNAL or UNKNOWN there is a stream torn down by a replica going away).
pub fn classify_stream(status: &Status) -> Verdict {
    if not_applied(status) {
        Verdict::NotApplied
    } else if is_local(status) || !is_deliberate(status.code()) {
        Verdict::Unknown
    } else {
        Verdict::Final
    }
}

/// Whether the status proves that the request was not applied: a refusal by a coordinator
/// that is not the leader (it answers before any handler runs), or a connection that was never
/// established (tonic's [`tonic::ConnectError`] in the status's sources).
///
/// A refusal is recognised by its metadata, and else by its message: a coordinator that knows
/// no leader ("no leader is elected yet") has no address to put in the metadata, so the
/// message is the only signal it sends; those phrases are part of the HA contract.
pub fn not_applied(status: &Status) -> bool {
    not_leading(status) || has_source::<tonic::ConnectError>(status)
}

/// Whether the status was made on this side of the connection (tonic attaches the transport
/// error as its source: a broken connection, a CANCELLED made from "connection closed" when a
/// load balancer in front of a dead replica accepts and closes at once) rather than sent by
/// the coordinator, whose statuses never carry one.
pub fn is_local(status: &Status) -> bool {
    status.source().is_some()
}

/// Codes the coordinator sends on purpose to end a call or a stream.
fn is_deliberate(code: Code) -> bool {
    matches!(
        code,
        Code::Ok
            | Code::Cancelled
            | Code::InvalidArgument
            | Code::DeadlineExceeded
            | Code::NotFound
            | Code::AlreadyExists
            | Code::PermissionDenied
            | Code::ResourceExhausted
            | Code::FailedPrecondition
            | Code::Aborted
            | Code::OutOfRange
            | Code::Unimplemented
            | Code::Unauthenticated
    )
}

fn has_source<E: StdError + 'static>(status: &Status) -> bool {
    let mut next = status.source();
    while let Some(error) = next {
        if error.is::<E>() {
            return true;
        }
        next = error.source();
    }
    false
}

/// The leader's address named by a refusal: the [`LEADER_KEY`] metadata, else the
/// coordinator's message ("... the leader is host:port"). `None` when the status is not a
/// refusal or neither names a valid `host:port`.
pub fn leader_hint(status: &Status) -> Option<String> {
    if status.code() != Code::Unavailable {
        return None;
    }
    let from_metadata = status
        .metadata()
        .get(LEADER_KEY)
        .and_then(|value| value.to_str().ok())
        .map(str::trim)
        .filter(|addr| check_addr(addr).is_ok());
    let from_message = || {
        let (_, rest) = status.message().split_once("the leader is ")?;
        let addr = rest
            .split(|c: char| c.is_whitespace() || c == ',' || c == ';')
            .next()?;
        check_addr(addr).is_ok().then_some(addr)
    };
    from_metadata.or_else(from_message).map(str::to_owned)
}

/// Splits a coordinator address list (`host:port,host:port`, blanks around entries allowed)
/// into its entries, dropping repeats. The error names the bad entry and why.
pub fn parse_addrs(list: &str) -> Result<Vec<String>, String> {
    let mut addrs: Vec<String> = Vec::new();
    for entry in list.split(',') {
        let entry = entry.trim();
        check_addr(entry).map_err(|why| {
            if list.contains(',') {
                format!("entry {entry:?} {why}")
            } else {
                why.to_owned()
            }
        })?;
        if !addrs.iter().any(|a| a == entry) {
            addrs.push(entry.to_owned());
        }
    }
    Ok(addrs)
}

/// One coordinator address: `host:port` with no scheme, a host without blanks or `/` (an IPv6
/// host in brackets, so that its port is not ambiguous), and a port in 1..=65535.
pub fn check_addr(addr: &str) -> Result<(), &'static str> {
    if addr.is_empty() {
        return Err("is empty");
    }
    if addr.contains("://") {
        return Err("has a scheme; expected host:port");
    }
    let Some((host, port)) = addr.rsplit_once(':') else {
        return Err("is not host:port");
    };
    let host_ok = !host.is_empty()
        && !host.contains(|c: char| c.is_whitespace() || c == '/')
        && (!host.contains(':') || (host.starts_with('[') && host.ends_with(']')));
    if host_ok && matches!(port.parse::<u16>(), Ok(p) if p > 0) {
        Ok(())
    } else {
        Err("is not host:port")
    }
}

/// The failover budget from [`BUDGET_ENV`]'s value, if set: milliseconds, 0 meaning no
/// retries at all; [`DEFAULT_BUDGET`] if unset.
pub fn budget_from(value: Option<&str>) -> Result<Duration, BadBudget> {
    let Some(value) = value else {
        return Ok(DEFAULT_BUDGET);
    };
    value
        .trim()
        .parse::<u64>()
        .map(Duration::from_millis)
        .map_err(|source| BadBudget {
            value: value.to_owned(),
            source,
        })
}

/// A [`BUDGET_ENV`] value that is not a number of milliseconds.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BadBudget {
    value: String,
    source: std::num::ParseIntError,
}

impl fmt::Display for BadBudget {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{BUDGET_ENV}={:?} is not a number of milliseconds: {}",
            self.value, self.source
        )
    }
}

impl StdError for BadBudget {}

/// The replicas of a coordinator and which one calls go to: the one believed to lead. A
/// failure moves to the leader a follower named, else round robin through the list. Callers
/// keep their channels beside it, keyed by address.
#[derive(Debug, Clone)]
pub struct Rotation {
    /// The addresses given, in order.
    addrs: Vec<String>,
    /// The address calls go to (one of `addrs`, or a leader a follower named).
    current: String,
    /// The index in `addrs` the round robin moves on from.
    index: usize,
    /// Counts the moves, so that many calls failing on one replica move only once.
    epoch: u64,
}

impl Rotation {
    /// The replicas `addrs`, the first tried first.
    pub fn new(addrs: Vec<String>) -> Self {
        let current = addrs.first().cloned().unwrap_or_default();
        Self {
            addrs,
            current,
            index: 0,
            epoch: 0,
        }
    }

    /// The addresses as given.
    pub fn addrs(&self) -> &[String] {
        &self.addrs
    }

    /// The address calls go to now.
    pub fn current(&self) -> &str {
        &self.current
    }

    /// How many times calls moved to another replica: a failure seen at an older epoch is
    /// stale (another call already moved on).
    pub fn epoch(&self) -> u64 {
        self.epoch
    }

    /// Makes `addr` (which answered) the address calls go to.
    pub fn settle(&mut self, addr: &str) {
        if self.current != addr {
            self.current = addr.to_owned();
            self.epoch += 1;
        }
        if let Some(i) = self.addrs.iter().position(|a| a == addr) {
            self.index = i;
        }
    }

    /// A call to `addr` failed retryably: the next one goes to `hint` (the leader a follower
    /// named) or else to the next address of the list. If calls already moved on from `addr`,
    /// nothing changes. Returns the address calls go to now.
    pub fn failed(&mut self, addr: &str, hint: Option<&str>) -> &str {
        if self.current == addr {
            self.advance(hint);
        }
        &self.current
    }

    /// [`Rotation::failed`] for a failure seen while calls went to the replica of `epoch`.
    pub fn failed_at(&mut self, epoch: u64, hint: Option<&str>) -> &str {
        if self.epoch == epoch {
            self.advance(hint);
        }
        &self.current
    }

    fn advance(&mut self, hint: Option<&str>) {
        let failed = std::mem::take(&mut self.current);
        self.epoch += 1;
        if let Some(leader) = hint.filter(|h| *h != failed) {
            // `index` stays on the replica the round robin reached, so that a named leader
            // that cannot be reached is passed by the walk, which goes on to the next address
            // after the follower that named it: never back to that follower and its hint (a
            // hint nobody can reach would bounce calls between the two for the whole budget;
            // found by issue 14's fault suite), and never stuck on the first followers of the
            // list while others are not asked (the census of an etcd outage asks them all).
            self.current = leader.to_owned();
            return;
        }
        let n = self.addrs.len().max(1);
        // The next address of the walk, past the one that just failed.
        for _ in 0..n {
            self.index = (self.index + 1) % n;
            if self.addrs.get(self.index).is_some_and(|a| *a != failed) || n == 1 {
                break;
            }
        }
        self.current = self.addrs.get(self.index).cloned().unwrap_or_default();
    }
}

/// Jittered exponential backoff: [`FIRST_BACKOFF`] doubling to [`MAX_BACKOFF`], each sleep
/// uniform in [0.5x, 1.5x) so that the ranks of a job do not knock on the new leader in
/// lockstep.
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

    /// The next sleep; the one after it is twice as long (up to [`MAX_BACKOFF`] before jitter).
    pub fn next_sleep(&mut self) -> Duration {
        let sleep = self.base * self.factor() / 1024;
        self.base = (self.base * 2).min(MAX_BACKOFF);
        sleep
    }

    /// Back to the first step, after a success.
    pub fn reset(&mut self) {
        self.base = FIRST_BACKOFF;
    }

    /// A uniform jitter factor in [512, 1536) (x/1024): xorshift64, enough to spread sleeps
    /// between processes and calls; not for secrets.
    fn factor(&mut self) -> u32 {
        self.rng ^= self.rng << 13;
        self.rng ^= self.rng >> 7;
        self.rng ^= self.rng << 17;
        512 + u32::try_from(self.rng >> 54).unwrap_or(512)
    }
}

/// One streak of failures: a backoff and a budget counted from the streak's first failure (a
/// wait that legitimately lasts long is not cut short by the budget). The caller keeps the
/// clock and sleeps; this says for how long.
#[derive(Debug, Clone)]
pub struct Streak {
    budget: Duration,
    backoff: Backoff,
}

impl Streak {
    /// A streak with `budget`.
    pub fn new(budget: Duration) -> Self {
        Self {
            budget,
            backoff: Backoff::default(),
        }
    }

    /// The budget this streak runs under.
    pub fn budget(&self) -> Duration {
        self.budget
    }

    /// How long to sleep before the next attempt, `elapsed` after the streak began: `None`
    /// when the budget is spent. The last sleep is cut short at the budget's end, so that one
    /// more attempt is made right at it.
    pub fn pause(&mut self, elapsed: Duration) -> Option<Duration> {
        self.pause_until(elapsed, self.budget)
    }

    /// [`Streak::pause`] with the streak ending at `deadline` (from its start) if that is
    /// later than the budget: while a [`Census`] proves that no replica leads.
    pub fn pause_until(&mut self, elapsed: Duration, deadline: Duration) -> Option<Duration> {
        let left = deadline
            .max(self.budget)
            .checked_sub(elapsed)
            .filter(|l| !l.is_zero())?;
        Some(self.backoff.next_sleep().min(left))
    }
}

/// Whether a status is a replica's refusal to serve because it does not lead: UNAVAILABLE,
/// sent by the coordinator's gate (not made locally), as a follower (naming the leader or
/// not), a replica that knows no leader ("no leader is elected yet") or one whose term's
/// lease lapsed ("is not the leader: its leader lease lapsed").
/// Such a replica decides nothing for any job when it answers: it can act on one only after it
/// is elected, loads the job and gives every node and rank the heartbeat timeout to re-attach
/// (docs/contract.md, "Coordinator failover"). A replica still loading its state to take over
/// ("taking over as leader") does not count: it may have armed a job's timeout already.
pub fn not_leading(status: &Status) -> bool {
    status.code() == Code::Unavailable
        && !is_local(status)
        && (status.metadata().contains_key(LEADER_KEY)
            || status.message().contains("is not the leader")
            || status.message().contains("no leader"))
}

/// The proof that no replica leads (docs/ha.md, "An etcd outage"): rounds of answers, each
/// complete when every replica of the list has refused since the round began because it does
/// not lead ([`not_leading`]); any other failure (a replica that cannot be reached, that does
/// not answer, or whose stream broke) starts the round again.
///
/// Only a replica can lead, and a replica that refused at time `a` holds no job then: it can
/// act on one only after it leads and loads it, and then fails a node or a rank only once that
/// has not re-attached for the coordinator's heartbeat timeout `H` since (docs/contract.md).
/// So after a complete round that began at `s`, no leader fails anything before `s + H`. A
/// node that keeps its workers until `s + hold`, with `hold` below `H`, has stopped them
/// before any leader can hand their ranks to others, even one it cannot reach. While every
/// replica keeps refusing (etcd is down, or back and electing), rounds keep completing and the
/// hold moves on: an outage of etcd itself costs the job nothing but the waits it makes. A
/// leader that serves ends the streak: the client attaches to it.
///
/// The node's watch holds with half `H`. The other calls and streams of a job's agent and
/// workers decide nothing about whether the workers run (the watch does), so they hold with
/// their whole failover budget, at least [`MIN_CALL_HOLD`] ([`call_hold`]): the budget runs
/// again from the start of the last complete round. A leader elected after an outage and
/// frozen at once (the fault suite's seeds 99953116125801 and 135528328082080) stops the
/// rounds; with a 5 s hold, a relay or a worker's session gave up before the next leader could
/// take it back, while the node's lease still held.
#[derive(Debug, Clone)]
pub struct Census {
    replicas: usize,
    /// The replicas that refused in the round under way.
    answered: std::collections::BTreeSet<String>,
    /// When the round under way began (its first refusal).
    began: Option<Duration>,
    /// When the last complete round began.
    proven: Option<Duration>,
}

impl Census {
    /// A census of `replicas` replicas (the addresses given). One census serves every call
    /// and stream of a client: which replica one call happens to reach depends on the
    /// others, but together they ask every replica.
    pub fn new(replicas: usize) -> Self {
        Self {
            replicas: replicas.max(1),
            answered: std::collections::BTreeSet::new(),
            began: None,
            proven: None,
        }
    }

    /// `addr` answered `status` at `at` (on the owner's clock).
    pub fn saw(&mut self, addr: &str, status: &Status, at: Duration) {
        if !not_leading(status) {
            self.answered.clear();
            self.began = None;
            return;
        }
        let began = *self.began.get_or_insert(at);
        self.answered.insert(addr.to_owned());
        if self.answered.len() >= self.replicas {
            self.proven = Some(began);
            self.answered.clear();
            self.began = None;
        }
    }

    /// When the last complete round began: no replica leads a job before that plus the
    /// coordinator's heartbeat timeout, so a caller may go on until that plus its hold.
    pub fn proven(&self) -> Option<Duration> {
        self.proven
    }
}

/// 64 random bits from the standard library's per-process hash keys (fresh for every call),
/// the clock and the process id: good enough for jitter and request ids; not for secrets.
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

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]
    use super::*;

    fn with_leader(mut status: Status, leader: &str) -> Status {
        status
            .metadata_mut()
            .insert(LEADER_KEY, leader.parse().expect("a valid metadata value"));
        status
    }

    /// A status as tonic makes it for a connection it could not open.
    fn connect_error() -> Status {
        let io = std::io::Error::from(std::io::ErrorKind::ConnectionRefused);
        Status::from_error(Box::new(tonic::ConnectError(Box::new(io))))
    }

    /// A status as tonic makes it for a connection that broke under a call.
    fn transport_error(code: Code) -> Status {
        let io = std::io::Error::from(std::io::ErrorKind::ConnectionReset);
        let mut status = Status::from_error(Box::new(io));
        if code != status.code() {
            // Keep the source (what makes it local) under another code, as h2 resets do.
            status = Status::from_error(Box::new(Wrapped(code, status)));
        }
        status
    }

    /// Wraps a status so that `Status::from_error` finds it and keeps the chain as source.
    #[derive(Debug)]
    struct Wrapped(Code, Status);
    impl fmt::Display for Wrapped {
        fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
            write!(f, "wrapped {:?}", self.0)
        }
    }
    impl StdError for Wrapped {
        fn source(&self) -> Option<&(dyn StdError + 'static)> {
            Some(&self.1)
        }
    }

    #[test]
    fn classification() {
        use Verdict::*;
        // A CANCELLED made from a transport error, as the agent saw it behind a balancer.
        let mut dropped = Status::new(Code::Cancelled, "operation was canceled");
        dropped.set_source(std::sync::Arc::new(std::io::Error::other(
            "transport error: connection closed",
        )));
        let cases: Vec<(&str, Status, Verdict, Verdict)> = vec![
            (
                "follower with metadata",
                with_leader(Status::unavailable("x"), "10.0.0.2:1"),
                NotApplied,
                NotApplied,
            ),
            (
                "follower by message",
                Status::unavailable(
                    "coordinator 127.0.0.1:5001 is not the leader; the leader is 127.0.0.1:5002",
                ),
                NotApplied,
                NotApplied,
            ),
            (
                "no leader yet",
                Status::unavailable("no leader is elected yet"),
                NotApplied,
                NotApplied,
            ),
            ("connect error", connect_error(), NotApplied, NotApplied),
            (
                "store unreachable",
                Status::unavailable("state store unreachable: timeout"),
                Unknown,
                Unknown,
            ),
            (
                "a body that broke",
                Status::unavailable("error reading a body from connection"),
                Unknown,
                Unknown,
            ),
            // The agent's copy matched these messages; the message of a status made by a
            // follower carries no such words, and a real connect failure is found by type.
            (
                "connect words from the server",
                Status::unavailable("tcp connect error: Connection refused"),
                Unknown,
                Unknown,
            ),
            (
                "broken connection",
                transport_error(Code::Unknown),
                Unknown,
                Unknown,
            ),
            (
                "local cancel of a broken connection",
                transport_error(Code::Cancelled),
                Unknown,
                Unknown,
            ),
            ("balancer closed the connection", dropped, Unknown, Unknown),
            (
                "deliberate precondition",
                Status::failed_precondition("generation 2 failed"),
                Final,
                Final,
            ),
            (
                "not the leader, but not a refusal",
                Status::failed_precondition("is not the leader"),
                Final,
                Final,
            ),
            ("unknown job", Status::not_found("job j"), Final, Final),
            ("bad argument", Status::invalid_argument("x"), Final, Final),
            (
                "registered twice",
                Status::already_exists("x"),
                Final,
                Final,
            ),
            ("aborted", Status::aborted("x"), Final, Final),
            ("denied", Status::permission_denied("x"), Final, Final),
            (
                "cancelled by the server",
                Status::cancelled("job 'j' was cancelled: bad lr"),
                Final,
                Final,
            ),
            ("deadline", Status::deadline_exceeded("x"), Final, Final),
            ("ok", Status::new(Code::Ok, "x"), Final, Final),
            // A server-sent INTERNAL or UNKNOWN ends a unary call (the agent's copy retried
            // it), but a stream is re-opened.
            ("server internal", Status::internal("x"), Final, Unknown),
            ("server unknown", Status::unknown("x"), Final, Unknown),
        ];
        for (name, status, call, stream) in cases {
            assert_eq!(classify_call(&status), call, "call: {name}: {status:?}");
            assert_eq!(
                classify_stream(&status),
                stream,
                "stream: {name}: {status:?}"
            );
        }
    }

    #[test]
    fn what_each_verdict_retries() {
        assert!(Verdict::NotApplied.retries(false));
        assert!(Verdict::NotApplied.retries(true));
        assert!(!Verdict::Unknown.retries(false));
        assert!(Verdict::Unknown.retries(true));
        assert!(!Verdict::Final.retries(true));
    }

    #[test]
    fn leader_hints() {
        let check = |status: Status, expected: Option<&str>| {
            assert_eq!(leader_hint(&status).as_deref(), expected, "{status:?}");
        };
        check(
            with_leader(Status::unavailable("not the leader"), "10.0.0.2:29470"),
            Some("10.0.0.2:29470"),
        );
        // Metadata wins over the message, trimmed.
        check(
            with_leader(
                Status::unavailable("x is not the leader; the leader is 10.0.0.3:1"),
                " 10.0.0.2:2 ",
            ),
            Some("10.0.0.2:2"),
        );
        check(
            Status::unavailable(
                "coordinator 127.0.0.1:5001 is not the leader; the leader is 127.0.0.1:5002",
            ),
            Some("127.0.0.1:5002"),
        );
        check(
            Status::unavailable("the leader is [::1]:5002, ask it"),
            Some("[::1]:5002"),
        );
        check(Status::unavailable("no leader is elected yet"), None);
        check(with_leader(Status::unavailable("x"), ""), None);
        check(Status::unavailable(""), None);
        check(with_leader(Status::unavailable("x"), "garbage"), None);
        check(with_leader(Status::unavailable("x"), "http://a:1"), None);
        // Only refusals carry hints.
        check(with_leader(Status::not_found("x"), "10.0.0.2:1"), None);
    }

    #[test]
    fn address_lists() {
        let ok = |list: &str, expected: &[&str]| {
            let expected: Vec<String> = expected.iter().map(|a| a.to_string()).collect();
            assert_eq!(parse_addrs(list), Ok(expected), "{list:?}");
        };
        ok("a:1", &["a:1"]);
        ok("a:1,b:2", &["a:1", "b:2"]);
        ok(" a:1 , b:2 ,a:1", &["a:1", "b:2"]);
        ok(
            "[::1]:29470,10.0.0.1:29470",
            &["[::1]:29470", "10.0.0.1:29470"],
        );
        let bad = |list: &str, expected: &str| {
            assert_eq!(parse_addrs(list), Err(expected.to_owned()), "{list:?}");
        };
        bad("", "is empty");
        bad("a", "is not host:port");
        bad("http://a:1", "has a scheme; expected host:port");
        bad("a:1,b", "entry \"b\" is not host:port");
        bad("a:1,", "entry \"\" is empty");
        bad("a:1,,b:2", "entry \"\" is empty");
        bad("a:1,b:x", "entry \"b:x\" is not host:port");
        bad("a:1,:2", "entry \":2\" is not host:port");
        bad("a b:1", "is not host:port");
        // The SDK's copy took these; nothing can connect to them.
        bad("a:0", "is not host:port");
        bad("::1:5000", "is not host:port");
        bad("a/b:1", "is not host:port");
    }

    #[test]
    fn budgets() {
        assert_eq!(budget_from(None), Ok(DEFAULT_BUDGET));
        assert_eq!(budget_from(Some(" 1500 ")), Ok(Duration::from_millis(1500)));
        assert_eq!(budget_from(Some("0")), Ok(Duration::ZERO));
        assert_eq!(
            budget_from(Some("5s")).unwrap_err().to_string(),
            "MUSTER_FAILOVER_TIMEOUT_MS=\"5s\" is not a number of milliseconds: invalid digit \
             found in string"
        );
    }

    #[test]
    fn the_next_address_is_the_named_leader_else_round_robin() {
        let mut r = Rotation::new(vec!["a:1".into(), "b:2".into(), "c:3".into()]);
        assert_eq!(r.current(), "a:1");
        assert_eq!(r.failed("a:1", None), "b:2");
        assert_eq!(r.failed("b:2", None), "c:3");
        assert_eq!(r.failed("c:3", None), "a:1");
        // A follower names the leader.
        assert_eq!(r.failed("a:1", Some("c:3")), "c:3");
        // A stale failure (another call already moved on) changes nothing.
        assert_eq!(r.failed("a:1", None), "c:3");
        // A hint naming the address that failed is no hint: the walk goes on from a:1, the
        // follower that named c:3.
        assert_eq!(r.failed("c:3", Some("c:3")), "b:2");
        // A leader outside the list is followed; if it cannot be reached, the round robin
        // goes on past the follower that named it, not back to it (the SDK's copy went back
        // to the list's start, and so to that follower and its unreachable hint again).
        assert_eq!(r.failed("b:2", Some("d:4")), "d:4");
        assert_eq!(r.failed("d:4", None), "c:3");
        assert_eq!(r.failed("c:3", Some("d:4")), "d:4");
        assert_eq!(r.failed("d:4", None), "a:1");
        // Followers that name a leader inside the list which refuses (its term lapsed while
        // etcd was away): every replica is still asked in turn, none skipped.
        let mut r = Rotation::new(vec!["a:1".into(), "b:2".into(), "c:3".into()]);
        let mut asked = vec![r.current().to_owned()];
        for _ in 0..8 {
            let at = r.current().to_owned();
            let hint = (at != "a:1").then_some("a:1");
            asked.push(r.failed(&at, hint).to_owned());
        }
        assert_eq!(
            asked,
            [
                "a:1", "b:2", "a:1", "c:3", "a:1", "b:2", "a:1", "c:3", "a:1"
            ]
        );
        // One address: always that one.
        let mut one = Rotation::new(vec!["a:1".into()]);
        assert_eq!(one.failed("a:1", None), "a:1");
    }

    #[test]
    fn stale_failures_are_told_by_epoch() {
        let mut r = Rotation::new(vec!["a:1".into(), "b:2".into()]);
        let seen = r.epoch();
        assert_eq!(r.failed_at(seen, None), "b:2");
        // Two calls failed on a:1; only the first moves.
        assert_eq!(r.failed_at(seen, None), "b:2");
        // b:2 fails, then a:1 again: a failure seen on the first a:1 is still stale, though
        // the address is the same again.
        let seen_b = r.epoch();
        assert_eq!(r.failed_at(seen_b, None), "a:1");
        assert_eq!(r.failed_at(seen, None), "a:1");
        // Settling on the replica that answered moves too.
        let before = r.epoch();
        r.settle("b:2");
        assert_eq!(r.current(), "b:2");
        assert_ne!(r.epoch(), before);
        assert_eq!(r.failed("b:2", None), "a:1");
        assert_eq!(r.addrs(), ["a:1", "b:2"]);
    }

    #[test]
    fn backoff_doubles_to_a_quarter_second_with_jitter() {
        for seed in [1, 7, 0xdead_beef, u64::MAX] {
            let mut b = Backoff::seeded(seed);
            for base in [50, 100, 200, 250, 250, 250, 250, 250] {
                let base = Duration::from_millis(base);
                let sleep = b.next_sleep();
                assert!(
                    sleep >= base / 2 && sleep < base * 3 / 2,
                    "{sleep:?} vs {base:?}"
                );
            }
            b.reset();
            assert!(b.next_sleep() < FIRST_BACKOFF * 3 / 2);
        }
    }

    #[test]
    fn jitter_is_spread_over_its_range() {
        let mut b = Backoff::seeded(7);
        let samples: Vec<u32> = (0..10_000).map(|_| b.factor()).collect();
        assert!(samples.iter().all(|f| (512..1536).contains(f)));
        let mean = samples.iter().map(|f| f64::from(*f)).sum::<f64>() / 10_000.0;
        assert!((mean - 1024.0).abs() < 20.0, "mean {mean}");
        let low = samples.iter().filter(|f| **f < 512 + 102).count();
        assert!(
            (800..1200).contains(&low),
            "{low} of 10000 in the lowest tenth"
        );
        // Two backoffs made at once differ.
        let sleeps = |mut b: Backoff| (0..4).map(|_| b.next_sleep()).collect::<Vec<_>>();
        assert_ne!(sleeps(Backoff::default()), sleeps(Backoff::default()));
    }

    #[test]
    fn a_streak_ends_with_its_budget() {
        let budget = Duration::from_millis(3000);
        let mut streak = Streak::new(budget);
        let mut elapsed = Duration::ZERO;
        let mut pauses = 0;
        while let Some(sleep) = streak.pause(elapsed) {
            assert!(elapsed + sleep <= budget, "slept past the budget");
            elapsed += sleep;
            pauses += 1;
        }
        assert_eq!(elapsed, budget);
        // 50+100+200 ms, then 250 ms steps, jittered x0.5-1.5: about a dozen attempts.
        assert!((7..=30).contains(&pauses), "{pauses}");
        assert_eq!(Streak::new(Duration::ZERO).pause(Duration::ZERO), None);
        assert_eq!(Streak::new(budget).pause(budget * 2), None);
    }

    fn no_leader(addr: &str) -> Status {
        Status::unavailable(format!(
            "coordinator {addr} is not the leader and no leader is elected yet (is etcd reachable?); retry shortly"
        ))
    }

    #[test]
    fn a_replica_that_refuses_as_a_follower_does_not_lead() {
        assert!(not_leading(&no_leader("a:1")));
        let follower = with_leader(
            Status::unavailable("coordinator a:1 is not the leader; the leader is b:1"),
            "b:1",
        );
        assert!(not_leading(&follower));
        // A leader whose term's lease lapsed refuses as not leading, before any handler runs.
        let lapsed = Status::unavailable(
            "coordinator a:1 is not the leader: its leader lease lapsed (etcd answered no keep-alive within the lease TTL) and it is stepping down; retry shortly",
        );
        assert!(not_leading(&lapsed) && not_applied(&lapsed));
        assert!(!not_leading(&Status::unavailable(
            "coordinator a:1 is taking over as leader (loading state); retry shortly"
        )));
        assert!(!not_leading(&connect_error()));
        assert!(!not_leading(&transport_error(Code::Unavailable)));
        assert!(!not_leading(&Status::unavailable("leadership lapsed")));
        assert!(!not_leading(&Status::failed_precondition("no leader")));
    }

    #[test]
    fn a_census_proves_only_after_every_replica_refused() {
        let ms = Duration::from_millis;
        let mut census = Census::new(3);
        census.saw("a:1", &no_leader("a:1"), ms(1000));
        census.saw("b:1", &no_leader("b:1"), ms(1100));
        // Two of three, and the same one twice, prove nothing.
        census.saw("b:1", &no_leader("b:1"), ms(1200));
        assert_eq!(census.proven(), None);
        // The third completes the round that began at 1 s.
        census.saw("c:1", &no_leader("c:1"), ms(1300));
        assert_eq!(census.proven(), Some(ms(1000)));
        // Rounds that go on completing move the proof on, each counted from its own start.
        for round in 0..20u64 {
            let t = ms(2_000 + round * 2_000);
            for (i, addr) in ["a:1", "b:1", "c:1"].into_iter().enumerate() {
                census.saw(addr, &no_leader(addr), t + ms(i as u64 * 100));
            }
        }
        assert_eq!(census.proven(), Some(ms(40_000)));
        // An unreachable replica breaks the round under way; the last proof stands.
        census.saw("a:1", &no_leader("a:1"), ms(42_000));
        census.saw("b:1", &connect_error(), ms(42_100));
        census.saw("c:1", &no_leader("c:1"), ms(42_200));
        census.saw("a:1", &no_leader("a:1"), ms(42_300));
        assert_eq!(census.proven(), Some(ms(40_000)));
        // A follower that names a leader does not lead either (etcd is back and the old
        // leader's key not yet expired): it completes the round.
        let mut named = Census::new(2);
        named.saw("a:1", &no_leader("a:1"), ms(10));
        named.saw(
            "b:1",
            &with_leader(
                Status::unavailable("coordinator b:1 is not the leader; the leader is a:1"),
                "a:1",
            ),
            ms(20),
        );
        assert_eq!(named.proven(), Some(ms(10)));
        // A reply that is not a refusal (a stream torn down, no answer) starts the round
        // again.
        let mut torn = Census::new(2);
        torn.saw("a:1", &no_leader("a:1"), ms(10));
        torn.saw("b:1", &Status::unavailable("leadership lapsed"), ms(20));
        torn.saw("a:1", &no_leader("a:1"), ms(30));
        assert_eq!(torn.proven(), None);
        // One address is a census of one.
        let mut one = Census::new(1);
        one.saw("a:1", &no_leader("a:1"), ms(200));
        assert_eq!(one.proven(), Some(ms(200)));
    }

    #[test]
    fn a_streak_goes_on_to_a_later_deadline() {
        let ms = Duration::from_millis;
        let mut streak = Streak::new(ms(1000));
        assert!(streak.pause_until(ms(3000), ms(4000)).is_some());
        assert!(streak.pause_until(ms(3999), ms(4000)).unwrap() <= ms(1));
        assert_eq!(streak.pause_until(ms(4000), ms(4000)), None);
        // An earlier deadline does not cut the budget short.
        assert!(streak.pause_until(ms(500), ms(100)).is_some());
    }

    #[test]
    fn random_bits_are_fresh() {
        assert_ne!(random_u64(), random_u64());
    }
}
