//! Coordinator failover for the agent's own calls (the HA contract, `docs/contract.md`): the
//! agent reaches the coordinator through the SDK's client, [`muster::client::Coordinator`]
//! (here [`Coordinators`]), the one client of workers, agents and `describe`, with the one
//! policy of [`muster_core::failover`]. This module adds what only the agent needs: its
//! constructors from a `--coordinator` list and `--failover-timeout-ms`, the first connect of
//! a command within a window (with the TLS probe that names a rejected client certificate),
//! and the retry loop's `Status` form for the agent's calls.
//!
//! The policy: calls go to the replica believed to lead. A retryable failure moves to the
//! address the refusal named in its `muster-leader` metadata, else to the next address of the
//! list (round robin), after a jittered exponential backoff (50 ms doubling to 250 ms); after
//! the failover budget the last error surfaces as it would have without failover. One address
//! works the same way (a restarted coordinator is waited for, within the budget).
//!
//! Every call the agent makes is idempotent (Join carries a request id; KV Set and Get,
//! ReportFailure and Ops reads are idempotent by nature), so [`call`] retries any retryable
//! failure. `Ops.SubmitJob` is not: [`not_applied`] says when a refusal proves it was not
//! applied, and only those are retried.
//!
//! The channels are lazily connected and cached per client; a tonic channel runs its
//! connection on the runtime it was made on, so a thread with a runtime of its own (the node
//! relay) uses a [`Coordinators::fork`] of its own. Every channel handed out carries the
//! agent's TLS settings and credentials ([`Coordinators::with_security`]), so no client of the
//! agent can forget them.

use muster_core::failover::{self as policy, Verdict};
use muster_proto::security::{AuthChannel, ClientSecurity};
use std::time::Duration;
use tonic::transport::{Channel, Endpoint};
use tonic::{Code, Status};

pub use muster::failover::{Retry, later};
pub use muster_core::failover::{
    BUDGET_ENV, Backoff, DEFAULT_BUDGET, LEADER_KEY, SILENT_REPLICA_TIMEOUT, call_hold,
    leader_hint, not_applied, random_u64,
};

use muster_core::failover::CONNECT_TIMEOUT;

/// The coordinator's replicas, which one is believed to lead, the failover budget, and a
/// channel per address: the SDK's client. Cheap to clone; clones share what they learn.
pub type Coordinators = muster::client::Coordinator;

/// The replicas `addrs` (not empty; the first is tried first) with this budget, over
/// plaintext and without credentials ([`Coordinators::with_security`] adds them).
pub fn replicas(addrs: Vec<String>, budget: Duration) -> Coordinators {
    Coordinators::replicas(addrs, budget, ClientSecurity::plaintext())
}

/// [`replicas`] from a comma-separated list (already validated).
pub fn from_list(list: &str, budget: Duration) -> Coordinators {
    replicas(
        split_list(list).unwrap_or_else(|| vec![list.to_owned()]),
        budget,
    )
}

/// How long a finishing node (every worker exited 0) goes on re-attaching after its watch
/// stream broke, beyond its lease, to deliver `finished`: the failover budget when there are
/// several replicas (a standby may take a while to lead), nothing with one address (there is
/// nobody else to fail over to). Running workers are kept by the lease and the census alone
/// (`watch.rs`; docs/ha.md).
pub fn reattach_budget(coordinators: &Coordinators) -> Duration {
    if coordinators.len() > 1 {
        coordinators.failover_timeout()
    } else {
        Duration::ZERO
    }
}

/// Splits and checks a `--coordinator` value (`host:port,host:port`, blanks around items
/// ignored, repeats dropped); `None` if an item is empty or not `host:port`.
pub fn split_list(list: &str) -> Option<Vec<String>> {
    policy::parse_addrs(list).ok()
}

/// Whether a failed call or a stream's end may succeed on a retry (perhaps on another
/// replica): the stream rule of [`policy::classify_stream`] (UNAVAILABLE, a transport or
/// connect error whatever its code, a CANCELLED made from one, a stream torn down without a
/// deliberate status). The statuses a coordinator sends deliberately (FAILED_PRECONDITION,
/// NOT_FOUND, INVALID_ARGUMENT, ALREADY_EXISTS, ABORTED, PERMISSION_DENIED, CANCELLED, ...)
/// are answers, not failures.
pub fn retryable(status: &Status) -> bool {
    policy::classify_stream(status) != Verdict::Final
}

/// Whether a unary call that failed with `status` is sent again ([`call`]): the call rule of
/// [`policy::classify_call`] for an idempotent call.
fn call_retryable(status: &Status) -> bool {
    policy::classify_call(status).retries(true)
}

/// A fresh join request id: 16 random bytes in hex.
pub fn request_id() -> String {
    format!("{:016x}{:016x}", random_u64(), random_u64())
}

/// The current address and a channel to it (lazily connected: a connection failure shows up
/// as the call's UNAVAILABLE), carrying the credentials. Must be called within a tokio
/// runtime.
pub fn channel(coordinators: &Coordinators) -> (String, AuthChannel) {
    let current = coordinators.current();
    (current.addr.to_string(), current.channel)
}

/// Connects to one of the addresses, trying them in turn with backoff for at most `window`;
/// the one that answered becomes the current address. The error is the last connection
/// failure. With TLS, a failed handshake counts as a connection failure.
pub async fn connect(
    coordinators: &Coordinators,
    window: Duration,
) -> Result<(String, AuthChannel), ConnectError> {
    let mut retry = Retry::new(window);
    let security = coordinators.security();
    loop {
        let addr = coordinators.leader_addr().to_string();
        let endpoint = endpoint(&addr, security, coordinators.len() > 1).map_err(|e| {
            ConnectError::Address {
                addr: addr.clone(),
                why: e.message().to_owned(),
            }
        })?;
        match endpoint.connect().await {
            Ok(channel) => {
                if security.is_tls() {
                    probe(&addr, &channel).await?;
                }
                coordinators.settle(&addr, channel.clone());
                return Ok((addr, security.wrap(channel)));
            }
            Err(e) => {
                let why = muster_core::error_chain::chain(&e);
                if crate::security::is_tls_failure(&why) {
                    // A configuration error: retrying changes nothing.
                    return Err(ConnectError::Tls { addr, why });
                }
                tracing::debug!(%why, addr, "coordinator not reachable yet; retrying");
                coordinators.failed(&addr, None);
                if !retry.pause().await {
                    return Err(ConnectError::Unreachable {
                        addrs: coordinators.addr().to_owned(),
                        why,
                    });
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

/// The endpoint of one coordinator address, as every client opens it
/// ([`muster_core::failover::endpoint`]; the SDK's is the same).
pub fn endpoint(addr: &str, security: &ClientSecurity, several: bool) -> Result<Endpoint, Status> {
    policy::endpoint(security, addr, several).map_err(Status::invalid_argument)
}

/// Runs `attempt` on the current coordinator until it succeeds, fails with a status the policy
/// does not retry for an idempotent call ([`policy::classify_call`]), or the budget of a
/// streak of failures is spent (then its last error is returned). `what` names the call in
/// the log. An attempt that ran longer than the budget (a long poll that broke) starts a new
/// streak. For idempotent calls only.
pub async fn call<T, F, Fut>(
    coordinators: &Coordinators,
    what: &str,
    attempt: F,
) -> Result<T, Status>
where
    F: FnMut(AuthChannel) -> Fut,
    Fut: Future<Output = Result<T, Status>>,
{
    call_if(coordinators, what, call_retryable, attempt).await
}

/// [`call`], retrying only the failures `retry_on` accepts (see [`not_applied`]): the SDK
/// client's one loop ([`Coordinators::call_if`]), its last status as the error.
pub async fn call_if<T, F, Fut>(
    coordinators: &Coordinators,
    what: &str,
    retry_on: impl Fn(&Status) -> bool,
    attempt: F,
) -> Result<T, Status>
where
    F: FnMut(AuthChannel) -> Fut,
    Fut: Future<Output = Result<T, Status>>,
{
    coordinators
        .call_if(what, retry_on, attempt)
        .await
        .map_err(|failed| failed.status)
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use std::sync::{Arc, Mutex};
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
        let c = replicas(
            vec!["a:1".into(), "b:2".into(), "c:3".into()],
            DEFAULT_BUDGET,
        );
        assert_eq!(&*c.leader_addr(), "a:1");
        assert_eq!(c.addr(), "a:1,b:2,c:3");
        assert_eq!(&*c.failed("a:1", None), "b:2");
        assert_eq!(&*c.failed("b:2", None), "c:3");
        assert_eq!(&*c.failed("c:3", None), "a:1");
        // A follower names the leader.
        assert_eq!(&*c.failed("a:1", Some("c:3")), "c:3");
        // A stale failure (another task already moved on) changes nothing.
        assert_eq!(&*c.failed("a:1", None), "c:3");
        // A hint naming the address that failed is no hint: the walk goes on past a:1, the
        // follower that named c:3.
        assert_eq!(&*c.failed("c:3", Some("c:3")), "b:2");
        // A leader outside the list is followed; if it cannot be reached, the round robin
        // goes on past the follower that named it (not back to it: issue 14's fault suite
        // found an agent bouncing between a follower and its unreachable hint).
        assert_eq!(&*c.failed("b:2", Some("d:4")), "d:4");
        assert_eq!(&*c.failed("d:4", None), "c:3");
        assert_eq!(&*c.failed("c:3", Some("d:4")), "d:4");
        assert_eq!(&*c.failed("d:4", None), "a:1");
        assert_eq!(&*c.failed("a:1", None), "b:2");
        assert_eq!(&*c.failed("b:2", None), "c:3");
        // One address: always that one.
        let one = replicas(vec!["a:1".into()], DEFAULT_BUDGET);
        assert_eq!(&*one.failed("a:1", None), "a:1");
        // A fork starts where its parent is and learns on its own.
        let fork = c.fork();
        assert_eq!(&*fork.leader_addr(), "c:3");
        assert_eq!(&*fork.failed("c:3", None), "a:1");
        assert_eq!(&*c.leader_addr(), "c:3");
    }

    #[test]
    fn only_a_jobs_replicas_wait_out_an_outage() {
        let refusal = |addr: &str| {
            Status::unavailable(format!(
                "coordinator {addr} is not the leader and no leader is elected yet (is etcd reachable?)"
            ))
        };
        let addrs = vec!["a:1".to_owned(), "b:2".to_owned()];
        let operator = replicas(addrs.clone(), DEFAULT_BUDGET);
        let job = replicas(addrs, DEFAULT_BUDGET).waiting_out_outages();
        for c in [&operator, &job] {
            c.saw("a:1", &refusal("a:1"));
            c.saw("b:2", &refusal("b:2"));
        }
        // An operator's command keeps its budget; a job's agent goes on while all refuse.
        assert!(operator.held_until(DEFAULT_BUDGET).is_none());
        let held = job
            .held_until(DEFAULT_BUDGET)
            .expect("every replica refused");
        assert!(held > tokio::time::Instant::now());
        // Its forks (the relay's thread) and a change of security keep the choice.
        assert!(job.fork().waits_out_outages());
        assert!(
            job.clone()
                .with_security(ClientSecurity::plaintext())
                .waits_out_outages()
        );
        assert!(!operator.fork().waits_out_outages());
    }

    #[test]
    fn request_ids_are_fresh_hex() {
        let (a, b) = (request_id(), request_id());
        assert_eq!(a.len(), 32);
        assert!(a.chars().all(|c| c.is_ascii_hexdigit()));
        assert_ne!(a, b);
    }

    #[tokio::test(start_paused = true)]
    async fn calls_are_retried_on_the_leader_within_the_budget() {
        use std::sync::atomic::{AtomicU32, Ordering};
        let c = replicas(vec!["a:1".into(), "b:2".into()], Duration::from_secs(1));
        // a refuses naming b; b answers.
        let seen = Arc::new(Mutex::new(Vec::new()));
        let answer = call(&c, "test", |_| {
            let addr = c.leader_addr().to_string();
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
        let start = tokio::time::Instant::now();
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
