//! The client half of coordinator failover (several coordinator replicas, one leader): which
//! failures are worth retrying, which prove that a call was not applied, where the leader is,
//! how long to wait between attempts and for how long in all.
//!
//! Pure policy with no I/O besides sleeping, so that [`crate::client`] applies one rule to
//! unary calls and to the session stream, and the rule is tested here.

use std::{
    error::Error as StdError,
    sync::atomic::{AtomicU64, Ordering},
    time::{Duration, SystemTime, UNIX_EPOCH},
};

use tokio::time::Instant;
use tonic::{Code, Status};

use crate::Error;

/// Response metadata in which a coordinator that is not the leader names the leader's
/// advertise address.
pub(crate) const LEADER_METADATA: &str = "muster-leader";
/// The environment variable with the failover budget in milliseconds (the agent sets it from
/// its `--failover-timeout-ms`).
pub(crate) const TIMEOUT_ENV: &str = "MUSTER_FAILOVER_TIMEOUT_MS";
/// The failover budget when [`TIMEOUT_ENV`] is not set.
pub(crate) const DEFAULT_TIMEOUT: Duration = Duration::from_secs(30);
/// The first backoff step; each later one doubles, up to [`BACKOFF_MAX`].
const BACKOFF_START: Duration = Duration::from_millis(50);
/// The longest step: short, because a standby leads about one lease TTL after the leader dies
/// and every rank must be back before a global barrier completes; a longer step adds up to
/// its own length to the failover (measured: 1 s steps made it TTL + 2.6 s, 250 ms steps
/// TTL + 0.4 s).
const BACKOFF_MAX: Duration = Duration::from_millis(250);

/// With several replicas, how often a connection that has heard nothing pings the replica
/// (HTTP/2 PING), and how long the ping may stay unanswered before the connection is given
/// up: a replica that does not answer a ping for [`SILENT_REPLICA_TIMEOUT`] has not run for
/// that long (SIGSTOP, a frozen machine) or cannot be reached, and its streams fail over to
/// the leader (the session re-attaches with `resume`) instead of waiting for it to wake.
/// Longer than the coordinator's default lease TTL (3 s), so that a replica given up has
/// already lost its lease and will not act on the session it finds gone when it wakes. With
/// one address there is no one else to go to, and the connection is left alone.
pub(crate) const SILENT_REPLICA_PING: Duration = Duration::from_secs(1);
/// See [`SILENT_REPLICA_PING`].
pub(crate) const SILENT_REPLICA_TIMEOUT: Duration = Duration::from_secs(5);

/// What a failed call says about retrying it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Verdict {
    /// The request certainly never ran: a follower (or a coordinator without a leader)
    /// refused it before any handler, or the connection was never made. Any call may be
    /// retried, even one that is not idempotent.
    NotApplied,
    /// The coordinator went away or is changing; the request may or may not have run. Only
    /// idempotent calls (and streams, which resume) are retried.
    Unknown,
    /// A deliberate answer of the coordinator: it is the call's result.
    Final,
}

/// Classifies the failure of a unary call: retried on UNAVAILABLE (any message) and on
/// transport and connect errors, whatever code tonic gave them.
pub(crate) fn classify_call(status: &Status) -> Verdict {
    if not_applied(status) {
        Verdict::NotApplied
    } else if status.code() == Code::Unavailable || is_local(status) {
        Verdict::Unknown
    } else {
        Verdict::Final
    }
}

/// Classifies the end of a stream (an error while opening it or while reading it): everything
/// except a deliberate status of the coordinator is worth re-opening the stream for.
pub(crate) fn classify_stream(status: &Status) -> Verdict {
    if not_applied(status) {
        Verdict::NotApplied
    } else if is_local(status) || !is_deliberate(status.code()) {
        Verdict::Unknown
    } else {
        Verdict::Final
    }
}

/// Whether the status proves that the request was not applied: a refusal by a coordinator
/// that is not the leader (which answers before any handler runs), or a connection that was
/// never established.
fn not_applied(status: &Status) -> bool {
    let refused = status.code() == Code::Unavailable
        && !is_local(status)
        && (status.metadata().contains_key(LEADER_METADATA)
            || status.message().contains("is not the leader")
            || status.message().contains("no leader"));
    refused || has_source::<tonic::ConnectError>(status)
}

/// Whether the status was made on this side of the connection (tonic attaches the transport
/// error as its source) rather than sent by the coordinator, whose statuses never carry one.
fn is_local(status: &Status) -> bool {
    status.source().is_some()
}

/// Codes the coordinator sends on purpose to end a call or a stream; retrying would only get
/// the same answer.
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

/// The leader's address named by a refusal: the `muster-leader` metadata, else the
/// coordinator's message ("... the leader is host:port"). `None` when neither names a valid
/// `host:port`.
pub(crate) fn leader_hint(status: &Status) -> Option<String> {
    if status.code() != Code::Unavailable {
        return None;
    }
    let from_metadata = status
        .metadata()
        .get(LEADER_METADATA)
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

/// Splits a coordinator address list (`host:port,host:port`, spaces around entries allowed)
/// into its entries, dropping repeats. The error names the bad entry and why.
pub(crate) fn parse_addrs(list: &str) -> Result<Vec<String>, String> {
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

/// One coordinator address must be `host:port` with no scheme, as the agent writes it.
fn check_addr(addr: &str) -> Result<(), &'static str> {
    if addr.is_empty() {
        return Err("is empty");
    }
    if addr.contains("://") {
        return Err("has a scheme; expected host:port");
    }
    match addr.rsplit_once(':') {
        Some((host, port))
            if !host.is_empty()
                && !host.contains(char::is_whitespace)
                && port.parse::<u16>().is_ok() =>
        {
            Ok(())
        }
        _ => Err("is not host:port"),
    }
}

/// The failover budget from the process environment ([`TIMEOUT_ENV`], else 30 s).
pub(crate) fn timeout_from_env() -> Result<Duration, Error> {
    timeout_from(std::env::var(TIMEOUT_ENV).ok().as_deref())
}

/// The failover budget from [`TIMEOUT_ENV`]'s value, if set: milliseconds, 0 meaning no
/// retries at all.
pub(crate) fn timeout_from(value: Option<&str>) -> Result<Duration, Error> {
    let Some(value) = value else {
        return Ok(DEFAULT_TIMEOUT);
    };
    value
        .trim()
        .parse::<u64>()
        .map(Duration::from_millis)
        .map_err(|e| {
            Error::Config(format!(
                "{TIMEOUT_ENV}={value:?} is not a number of milliseconds: {e}"
            ))
        })
}

/// Exponential backoff from 50 ms doubling to 250 ms, each step jittered uniformly in
/// [0.5x, 1.5x] so that the ranks of a job do not knock on the new leader in lockstep.
#[derive(Debug)]
pub(crate) struct Backoff {
    next: Duration,
    rng: XorShift,
}

impl Backoff {
    pub(crate) fn new() -> Self {
        Self {
            next: BACKOFF_START,
            rng: XorShift::seeded(),
        }
    }

    /// The next sleep.
    pub(crate) fn next_delay(&mut self) -> Duration {
        let base = self.next;
        self.next = (self.next * 2).min(BACKOFF_MAX);
        base.mul_f64(0.5 + self.rng.unit())
    }
}

/// The retries of one call or one re-attach: a backoff and a deadline, which starts at the
/// first failure (a wait that legitimately lasts long is not cut short by the budget).
#[derive(Debug)]
pub(crate) struct Retry {
    backoff: Backoff,
    started: Instant,
    budget: Duration,
}

impl Retry {
    pub(crate) fn new(budget: Duration) -> Self {
        Self {
            backoff: Backoff::new(),
            started: Instant::now(),
            budget,
        }
    }

    /// Sleeps before the next attempt, never past the deadline. `false`: the budget is spent
    /// and the caller should give up.
    ///
    /// Cancel-safe: dropping it only skips the sleep.
    pub(crate) async fn wait(&mut self) -> bool {
        let deadline = self.started + self.budget;
        let now = Instant::now();
        if now >= deadline {
            return false;
        }
        let delay = self.backoff.next_delay().min(deadline - now);
        tokio::time::sleep(delay).await;
        true
    }

    /// Time since the first failure.
    pub(crate) fn elapsed(&self) -> Duration {
        self.started.elapsed()
    }

    /// The budget this retry runs under.
    pub(crate) fn budget(&self) -> Duration {
        self.budget
    }
}

/// A cheap, non-cryptographic generator (xorshift64*) for jitter: `rand` is not a
/// dependency of the library, and jitter needs only to differ between processes and calls.
#[derive(Debug)]
struct XorShift(u64);

impl XorShift {
    /// Seeded from the time, the process id and a per-process counter, mixed by splitmix64.
    fn seeded() -> Self {
        static CALLS: AtomicU64 = AtomicU64::new(0);
        let nanos = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos() as u64);
        let seed = nanos
            ^ (u64::from(std::process::id()) << 32)
            ^ CALLS
                .fetch_add(1, Ordering::Relaxed)
                .wrapping_mul(0x9E37_79B9_7F4A_7C15);
        Self::from_seed(seed)
    }

    fn from_seed(seed: u64) -> Self {
        let mut z = seed.wrapping_add(0x9E37_79B9_7F4A_7C15);
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^= z >> 31;
        // xorshift must not start at zero.
        Self(if z == 0 { 0x2545_F491_4F6C_DD1D } else { z })
    }

    fn next(&mut self) -> u64 {
        let mut x = self.0;
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        self.0 = x;
        x.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }

    /// Uniform in [0, 1).
    fn unit(&mut self) -> f64 {
        (self.next() >> 11) as f64 / (1u64 << 53) as f64
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn with_leader(mut status: Status, leader: &str) -> Status {
        status.metadata_mut().insert(
            LEADER_METADATA,
            leader.parse().expect("a valid metadata value"),
        );
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
    impl std::fmt::Display for Wrapped {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
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
            (
                "deliberate precondition",
                Status::failed_precondition("generation 2 failed"),
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
                Status::cancelled("x"),
                Final,
                Final,
            ),
            ("deadline", Status::deadline_exceeded("x"), Final, Final),
            // A server-sent INTERNAL or UNKNOWN ends a unary call, but a stream is re-opened.
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
    fn leader_hints() {
        let check = |status: Status, expected: Option<&str>| {
            assert_eq!(leader_hint(&status).as_deref(), expected, "{status:?}");
        };
        check(
            with_leader(Status::unavailable("not the leader"), "10.0.0.2:29470"),
            Some("10.0.0.2:29470"),
        );
        // Metadata wins over the message.
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
        bad("a:1,b:x", "entry \"b:x\" is not host:port");
        bad("a:1,:2", "entry \":2\" is not host:port");
        bad("a b:1", "is not host:port");
    }

    #[test]
    fn timeouts() {
        assert_eq!(timeout_from(None).ok(), Some(DEFAULT_TIMEOUT));
        assert_eq!(
            timeout_from(Some(" 1500 ")).ok(),
            Some(Duration::from_millis(1500))
        );
        assert_eq!(timeout_from(Some("0")).ok(), Some(Duration::ZERO));
        let error = timeout_from(Some("5s")).err().map(|e| e.to_string());
        assert_eq!(
            error.as_deref(),
            Some(
                "bad muster environment: MUSTER_FAILOVER_TIMEOUT_MS=\"5s\" is not a number of \
                 milliseconds: invalid digit found in string"
            )
        );
    }

    #[test]
    fn backoff_doubles_to_a_quarter_second_with_jitter() {
        let mut backoff = Backoff::new();
        let bases = [50, 100, 200, 250, 250, 250];
        for base in bases {
            let base = Duration::from_millis(base);
            let delay = backoff.next_delay();
            assert!(
                delay >= base / 2 && delay <= base.mul_f64(1.5),
                "{delay:?} outside [{:?}, {:?}]",
                base / 2,
                base.mul_f64(1.5)
            );
        }
    }

    #[test]
    fn jitter_is_spread_over_its_range() {
        let mut rng = XorShift::from_seed(7);
        let samples: Vec<f64> = (0..10_000).map(|_| rng.unit()).collect();
        assert!(samples.iter().all(|u| (0.0..1.0).contains(u)));
        let mean = samples.iter().sum::<f64>() / samples.len() as f64;
        assert!((mean - 0.5).abs() < 0.02, "mean {mean}");
        let low = samples.iter().filter(|u| **u < 0.1).count();
        assert!((800..1200).contains(&low), "{low} of 10000 below 0.1");
        // Two generators seeded at once differ.
        assert_ne!(XorShift::seeded().next(), XorShift::seeded().next());
    }

    #[tokio::test]
    async fn retries_stop_at_the_budget() {
        let budget = Duration::from_millis(400);
        let mut retry = Retry::new(budget);
        let mut attempts = 0;
        while retry.wait().await {
            attempts += 1;
        }
        let elapsed = retry.elapsed();
        assert!(elapsed >= budget, "gave up after {elapsed:?}");
        assert!(
            elapsed < budget + Duration::from_millis(200),
            "slept past the deadline: {elapsed:?}"
        );
        // 50, 100, 200, 400 ms steps (each x0.5..1.5), the last one cut at the deadline.
        assert!((3..=6).contains(&attempts), "{attempts} attempts");

        let mut none = Retry::new(Duration::ZERO);
        assert!(!none.wait().await, "a zero budget never retries");
    }
}
