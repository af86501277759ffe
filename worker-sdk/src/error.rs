//! The SDK's one error type, and the one place where wire errors (`BarrierError`, gRPC statuses)
//! become it.

use std::{error::Error as StdError, fmt, sync::Arc};

use muster_proto::v1::{self as pb, barrier_error::Kind as BarrierErrorKind};
use tonic::Code;

/// How many missing ranks a timeout message spells out before it says "and N more": a barrier
/// of thousands of ranks should not print thousands of lines.
const MISSING_SHOWN: usize = 16;

/// Everything that can go wrong in a muster call. Messages name the rank, node, host, barrier or
/// coordinator involved, so that printing the error is enough to know where to look.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A rank of this generation failed (crashed, was killed, lost its connection or stopped
    /// heartbeating), so the generation can never complete a collective step again; the agent
    /// restarts the job if restarts are left.
    #[error("{}", about_rank(*.rank, *.node_rank, .host, "failed", .reason))]
    RankFailed {
        /// The global rank that failed.
        rank: u32,
        /// Its node rank.
        node_rank: u32,
        /// The host it ran on.
        host: String,
        /// Why, as the coordinator or the agent saw it (the coordinator's message, which
        /// usually names the rank, job and generation itself).
        reason: String,
    },

    /// Ranks met at the same barrier sequence number under different names: the ranks run
    /// different code paths, which would otherwise be a silent hang or a wrong pairing.
    #[error("ranks diverged: {message}")]
    Diverged {
        /// The coordinator's description (which names were used by which ranks).
        message: String,
    },

    /// A wait with a deadline ran out; for barriers `missing` lists who had not arrived.
    #[error("timed out waiting for {what}{}", missing_suffix(.missing))]
    Timeout {
        /// What was being waited for ("global barrier 'train.rs:42' (seq 7)", "key 'x'").
        what: String,
        /// The ranks that had not arrived, when the coordinator says.
        missing: Vec<RankLocation>,
    },

    /// This process belongs to a generation that a newer rendezvous round superseded; it
    /// should exit so that its agent can start the new generation's workers.
    #[error("stale generation: {message}")]
    StaleGeneration {
        /// The coordinator's description (names the current generation).
        message: String,
    },

    /// An operator cancelled the job; the process should exit (its agent stops it anyway).
    #[error("job cancelled: {message}")]
    Cancelled {
        /// The coordinator's description (names the job and the reason).
        message: String,
    },

    /// A rank of the barrier already left the job cleanly, so the barrier can never complete.
    #[error("{}", about_rank(*.rank, *.node_rank, .host, "has already left the job", .message))]
    RankLeft {
        /// The global rank that left.
        rank: u32,
        /// Its node rank.
        node_rank: u32,
        /// The host it ran on.
        host: String,
        /// The coordinator's description.
        message: String,
    },

    /// The coordinator could not be reached, or the session stream to it broke; or the same for
    /// the agent's relay socket, through which barriers go under `muster-agent`. Every pending
    /// and later call of the session (or barrier, for the relay) fails with this.
    #[error("no connection to {}: {}", peer(.addr), describe(.source.as_ref()))]
    Connection {
        /// The coordinator's `host:port`, or the path of the agent's relay socket.
        addr: String,
        /// The underlying transport error or status (shared: one broken stream fails many
        /// waiters).
        #[source]
        source: Arc<dyn StdError + Send + Sync>,
    },

    /// The coordinator refused a call (unknown job, invalid argument, a value published twice
    /// with different bytes, a failed generation, ...); the status message says why.
    #[error("the muster coordinator answered {:?}: {}", .0.code(), .0.message())]
    Rpc(tonic::Status),

    /// The coordinator refused this process's credentials: none, or a token it does not
    /// accept (UNAUTHENTICATED), or one that does not open this call, such as another job's
    /// token (PERMISSION_DENIED). Retrying cannot help; `MUSTER_TOKEN` must change.
    #[error(
        "the muster coordinator at {addr} refused the credentials ({:?}): {}{}",
        .status.code(),
        .status.message(),
        credentials_hint(.status.code())
    )]
    Unauthorized {
        /// The coordinator's `host:port`.
        addr: String,
        /// Its answer (the message says what was wrong, never the token).
        status: tonic::Status,
    },

    /// The `MUSTER_*` environment is malformed (the message names the variable and value).
    #[error("bad muster environment: {0}")]
    Config(String),

    /// A shared value could not be encoded or decoded as JSON.
    #[error("could not encode or decode {what} as JSON: {source}")]
    Serialization {
        /// Which value.
        what: String,
        /// The serde_json error.
        #[source]
        source: serde_json::Error,
    },

    /// Something that a call needs does not exist and never will (in single-process mode
    /// nothing else can publish it), so failing beats hanging.
    #[error("{what} was not found")]
    NotFound {
        /// What was looked for.
        what: String,
    },

    /// Two calls tried to use the same barrier scope of one session at once. A rank passes
    /// its barriers of a scope one after another; entering two at once is a bug in the caller.
    #[error(
        "a {scope} barrier is already in progress on this session (rank {rank}); \
         barriers of one scope must be entered one at a time"
    )]
    BarrierBusy {
        /// The scope in use.
        scope: muster_core::model::Scope,
        /// This session's rank.
        rank: u32,
    },

    /// The SDK was used in a way it cannot support (the blocking [`crate::Accelerator`]
    /// created inside an async runtime, a call after `finish`); the message says what to do
    /// instead.
    #[error("unsupported use of the muster SDK: {0}")]
    Usage(String),

    /// The caller's interrupt check (a pending Ctrl-C in the Python SDK) ended a wait. The
    /// barrier it interrupted cannot be resumed: this process's later barriers fail with
    /// [`Error::Connection`] saying so.
    #[error("interrupted while waiting for {what}")]
    Interrupted {
        /// What was being waited for.
        what: String,
    },

    /// A peer of a collective disappeared (its connection closed or broke, or the coordinator
    /// reported it dead) while this rank was exchanging data with it: the collective can never
    /// complete, so it fails instead of hanging.
    #[error("{}", about_rank(*.rank, *.node_rank, .host, &format!("was lost during {}", .op), .reason))]
    PeerLost {
        /// The global rank of the peer.
        rank: u32,
        /// Its node rank.
        node_rank: u32,
        /// The host it ran on.
        host: String,
        /// The operation in progress ("all_reduce of 4096 f32").
        op: String,
        /// What was seen (end of stream, connection reset, the coordinator's failure message).
        reason: String,
    },

    /// An operation that needs the same shape on every rank was called with different shapes;
    /// the message lists every rank's shape so the odd one out is visible.
    #[error("{op}: shapes differ across ranks: {}", .shapes.iter().map(|(rank, shape)| format!("rank {rank}: {shape}")).collect::<Vec<_>>().join(", "))]
    ShapeMismatch {
        /// The operation ("all_reduce").
        op: String,
        /// Every rank's shape, by rank ("4096 f32").
        shapes: Vec<(u32, String)>,
    },

    /// A communication backend could not be created or used (NCCL library missing, no GPU,
    /// a listener that could not bind, an argument out of range such as a root rank beyond the
    /// world size); the message says which backend and why.
    #[error("{backend} backend: {message}")]
    Backend {
        /// "cpu" or "nccl".
        backend: &'static str,
        /// What went wrong.
        message: String,
    },

    /// Reading or writing a file (checkpoints, weights) failed; `what` names the path.
    #[error("{what}: {source}")]
    Io {
        /// What was being done, with the path ("writing checkpoint/model.safetensors").
        what: String,
        /// The I/O error.
        #[source]
        source: std::io::Error,
    },

    /// A checkpoint or weights file is malformed or does not fit what is being loaded into it
    /// (a missing tensor, a wrong shape or type); the message names the file and the tensor.
    #[error("bad checkpoint: {0}")]
    Checkpoint(String),

    /// In-place recovery: a rank of the generation died and is being replaced, so the
    /// membership changed under this call (a collective's peers, a barrier's ranks). The
    /// generation goes on: the caller discards its step and goes to its step boundary
    /// ([`crate::membership::Membership::quorum`]). Recoverable ([`Error::is_recoverable`]).
    #[error("{}", about_rank(*.rank, *.node_rank, .host, &died_in(*.epoch), .reason))]
    MembershipChanged {
        /// The membership epoch the death opened (0 when the coordinator did not say, as in a
        /// withdrawn barrier).
        epoch: u64,
        /// The global rank that died.
        rank: u32,
        /// Its node rank.
        node_rank: u32,
        /// The host it ran on.
        host: String,
        /// Why, as the coordinator saw it.
        reason: String,
    },

    /// The coordinator sent something the protocol does not allow (a unique id of the wrong
    /// size, an answer before registration, ...): a version mismatch or a bug.
    #[error("protocol error talking to the muster coordinator: {0}")]
    Protocol(String),
}

/// A rank and where it runs, as error messages show it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RankLocation {
    /// The global rank.
    pub rank: u32,
    /// Its node rank.
    pub node_rank: u32,
    /// The host it runs on.
    pub host: String,
}

impl fmt::Display for RankLocation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "rank {} (node {}, host {})",
            self.rank, self.node_rank, self.host
        )
    }
}

impl From<pb::RankLocation> for RankLocation {
    fn from(location: pb::RankLocation) -> Self {
        Self {
            rank: location.rank(),
            node_rank: location.node_rank(),
            host: location.host,
        }
    }
}

/// "rank R (node N, host H) <verb>: <message>", or just the message when it already starts by
/// naming the rank (as the coordinator's messages do).
fn about_rank(rank: u32, node_rank: u32, host: &str, verb: &str, message: &str) -> String {
    if message.starts_with(&format!("rank {rank} ")) {
        message.to_owned()
    } else {
        format!("rank {rank} (node {node_rank}, host {host}) {verb}: {message}")
    }
}

/// What a membership change says the rank did ("died", with the epoch it opened if known).
fn died_in(epoch: u64) -> String {
    if epoch == 0 {
        "died".to_owned()
    } else {
        format!("died (membership epoch {epoch})")
    }
}

/// Renders an error and its sources on one line ("transport error: tcp connect error:
/// Connection refused"), showing a gRPC status by its code and message rather than its verbose
/// `Display`, and skipping a source that only repeats its parent.
fn describe(error: &(dyn StdError + 'static)) -> String {
    let mut parts: Vec<String> = Vec::new();
    let mut next = Some(error);
    while let Some(error) = next {
        let part = match error.downcast_ref::<tonic::Status>() {
            Some(status) if status.message().is_empty() => format!("{:?}", status.code()),
            Some(status) => format!("{:?}: {}", status.code(), status.message()),
            None => error.to_string(),
        };
        if parts.last().is_none_or(|last| !last.contains(&part)) {
            parts.push(part);
        }
        next = error.source();
    }
    parts.join(": ")
}

/// Names the other end of a connection: the agent's relay socket (a path) or the coordinator.
fn peer(addr: &str) -> String {
    if addr.starts_with('/') {
        format!("the muster agent's relay socket {addr}")
    } else {
        format!("the muster coordinator at {addr}")
    }
}

/// What to check after a refusal of the credentials.
fn credentials_hint(code: Code) -> &'static str {
    match code {
        Code::Unauthenticated => {
            " (MUSTER_TOKEN must hold this job's token, which muster-agent sets for its workers)"
        }
        _ => "",
    }
}

fn missing_suffix(missing: &[RankLocation]) -> String {
    if missing.is_empty() {
        return String::new();
    }
    let shown: Vec<String> = missing
        .iter()
        .take(MISSING_SHOWN)
        .map(ToString::to_string)
        .collect();
    let mut suffix = format!("; missing {}: {}", missing.len(), shown.join(", "));
    if missing.len() > MISSING_SHOWN {
        suffix.push_str(&format!(" and {} more", missing.len() - MISSING_SHOWN));
    }
    suffix
}

impl Error {
    /// Maps the coordinator's answer to a failed barrier or wait. `what` names the thing waited
    /// for, used by timeouts.
    pub(crate) fn from_barrier_error(
        error: pb::BarrierError,
        what: impl FnOnce() -> String,
    ) -> Self {
        match BarrierErrorKind::try_from(error.kind) {
            Ok(BarrierErrorKind::RankFailed) => Error::RankFailed {
                rank: error.rank,
                node_rank: error.node_rank,
                host: error.host,
                reason: error.message,
            },
            Ok(BarrierErrorKind::Diverged) => Error::Diverged {
                message: error.message,
            },
            Ok(BarrierErrorKind::Timeout) => Error::Timeout {
                what: what(),
                missing: error.missing.into_iter().map(RankLocation::from).collect(),
            },
            Ok(BarrierErrorKind::StaleGeneration) => Error::StaleGeneration {
                message: error.message,
            },
            Ok(BarrierErrorKind::RankLeft) => Error::RankLeft {
                rank: error.rank,
                node_rank: error.node_rank,
                host: error.host,
                message: error.message,
            },
            Ok(BarrierErrorKind::Cancelled) => Error::Cancelled {
                message: error.message,
            },
            Ok(BarrierErrorKind::MembershipChanged) => Error::MembershipChanged {
                epoch: 0,
                rank: error.rank,
                node_rank: error.node_rank,
                host: error.host,
                reason: error.message,
            },
            Ok(BarrierErrorKind::Unspecified) => Error::Protocol(format!(
                "the coordinator rejected {}: {}",
                what(),
                error.message
            )),
            Err(_) => Error::Protocol(format!(
                "barrier error of unknown kind {} for {}: {}",
                error.kind,
                what(),
                error.message
            )),
        }
    }

    /// Maps a gRPC status from a unary call or the session stream. UNAVAILABLE, or any status
    /// tonic made from a transport error, means the coordinator at `addr` could not be
    /// reached; DEADLINE_EXCEEDED means a wait with a deadline (for `what`) ran out — the
    /// coordinator's message only repeats that; UNAUTHENTICATED and PERMISSION_DENIED are a
    /// refusal of the credentials ([`Error::Unauthorized`]). Everything else keeps the status
    /// and shows its message: in particular FAILED_PRECONDITION (stale or failed generation)
    /// stays `Rpc`, since its message is the only thing that tells those apart.
    pub(crate) fn from_status(
        status: tonic::Status,
        addr: &str,
        what: impl FnOnce() -> String,
    ) -> Self {
        // A status with a source was made on this side from a transport error (a broken or
        // refused connection, an HTTP/2 protocol error such as plaintext against a TLS port):
        // the coordinator never answered, whatever code tonic gave it.
        if status.source().is_some() {
            return Error::Connection {
                addr: addr.to_owned(),
                source: Arc::new(status),
            };
        }
        match status.code() {
            Code::Unavailable => Error::Connection {
                addr: addr.to_owned(),
                source: Arc::new(status),
            },
            Code::DeadlineExceeded => Error::Timeout {
                what: what(),
                missing: Vec::new(),
            },
            Code::Unauthenticated | Code::PermissionDenied => Error::Unauthorized {
                addr: addr.to_owned(),
                status,
            },
            _ => Error::Rpc(status),
        }
    }

    /// Whether this error is a barrier timeout: the one barrier failure after which the same
    /// barrier may be entered again.
    pub fn is_timeout(&self) -> bool {
        matches!(self, Error::Timeout { .. })
    }

    /// Whether a step that failed with this error can be discarded and redone after a new
    /// quorum, without restarting the process: always for [`Error::MembershipChanged`], and
    /// for [`Error::PeerLost`] when the job recovers in place (`recovery` is the job's mode,
    /// [`crate::Accelerator::recovery`]). In restart mode nothing is: the generation is over
    /// and the process should exit.
    pub fn is_recoverable(&self, recovery: muster_core::requests::Recovery) -> bool {
        match self {
            Error::MembershipChanged { .. } => true,
            Error::PeerLost { .. } => recovery == muster_core::requests::Recovery::InPlace,
            _ => false,
        }
    }

    /// The error a `membership_changed` push (or a withdrawn wait) stands for: `cause` names
    /// the rank that died.
    pub(crate) fn membership_changed(epoch: u64, cause: &pb::BarrierError) -> Self {
        Error::MembershipChanged {
            epoch,
            rank: cause.rank,
            node_rank: cause.node_rank,
            host: cause.host.clone(),
            reason: cause.message.clone(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn location(rank: u32) -> pb::RankLocation {
        pb::RankLocation {
            rank: Some(rank),
            node_rank: Some(rank / 2),
            host: format!("host-{}", rank / 2),
        }
    }

    #[test]
    fn barrier_errors_name_ranks_and_hosts() {
        let check = |kind: BarrierErrorKind, expected: &str| {
            let error = pb::BarrierError {
                kind: kind as i32,
                message: "why".to_owned(),
                rank: 3,
                node_rank: 1,
                host: "host-b".to_owned(),
                missing: vec![location(4), location(5)],
            };
            let got = Error::from_barrier_error(error, || "global barrier 'a.rs:1' (seq 2)".into());
            assert_eq!(got.to_string(), expected, "{kind:?}");
        };
        check(
            BarrierErrorKind::RankFailed,
            "rank 3 (node 1, host host-b) failed: why",
        );
        check(BarrierErrorKind::Diverged, "ranks diverged: why");
        check(
            BarrierErrorKind::Timeout,
            "timed out waiting for global barrier 'a.rs:1' (seq 2); missing 2: \
             rank 4 (node 2, host host-2), rank 5 (node 2, host host-2)",
        );
        check(BarrierErrorKind::StaleGeneration, "stale generation: why");
        check(BarrierErrorKind::Cancelled, "job cancelled: why");
        check(
            BarrierErrorKind::RankLeft,
            "rank 3 (node 1, host host-b) has already left the job: why",
        );
        check(
            BarrierErrorKind::MembershipChanged,
            "rank 3 (node 1, host host-b) died: why",
        );
        check(
            BarrierErrorKind::Unspecified,
            "protocol error talking to the muster coordinator: the coordinator rejected global \
             barrier 'a.rs:1' (seq 2): why",
        );
    }

    #[test]
    fn recoverable_errors_depend_on_the_mode() {
        use muster_core::requests::Recovery;
        let changed = Error::MembershipChanged {
            epoch: 2,
            rank: 1,
            node_rank: 0,
            host: "h".into(),
            reason: "rank 1 (node 0, host h) of job 'j' generation 1 failed: killed".into(),
        };
        assert_eq!(
            changed.to_string(),
            "rank 1 (node 0, host h) of job 'j' generation 1 failed: killed"
        );
        let lost = Error::PeerLost {
            rank: 1,
            node_rank: 0,
            host: "h".into(),
            op: "all_reduce of 4 f32".into(),
            reason: "it closed its connection".into(),
        };
        assert!(changed.is_recoverable(Recovery::InPlace));
        assert!(changed.is_recoverable(Recovery::Restart));
        assert!(lost.is_recoverable(Recovery::InPlace));
        assert!(!lost.is_recoverable(Recovery::Restart));
        assert!(!Error::Usage("x".into()).is_recoverable(Recovery::InPlace));
    }

    #[test]
    fn self_describing_messages_are_not_repeated() {
        let message =
            "rank 3 (node 1, host b) of job 'j' generation 2 failed: exited with status 3";
        let error = Error::RankFailed {
            rank: 3,
            node_rank: 1,
            host: "b".into(),
            reason: message.into(),
        };
        assert_eq!(error.to_string(), message);
    }

    #[test]
    fn long_missing_lists_are_cut() {
        let missing: Vec<RankLocation> = (0..40).map(|r| location(r).into()).collect();
        let text = Error::Timeout {
            what: "x".into(),
            missing,
        }
        .to_string();
        assert!(
            text.starts_with("timed out waiting for x; missing 40: rank 0 (node 0, host host-0)")
        );
        assert!(
            text.ends_with("rank 15 (node 7, host host-7) and 24 more"),
            "{text}"
        );
    }

    #[test]
    fn statuses_map_by_code() {
        let addr = "coord:29470";
        let got = Error::from_status(tonic::Status::unavailable("refused"), addr, String::new);
        assert!(matches!(&got, Error::Connection { addr, .. } if addr == "coord:29470"));
        assert!(got.to_string().contains("coord:29470"), "{got}");

        // A path is the agent's relay socket.
        let got = Error::Connection {
            addr: "/tmp/muster-1-ab/relay.sock".into(),
            source: Arc::new(std::io::Error::from(std::io::ErrorKind::ConnectionRefused)),
        };
        assert_eq!(
            got.to_string(),
            "no connection to the muster agent's relay socket /tmp/muster-1-ab/relay.sock: \
             connection refused"
        );

        let got = Error::from_status(tonic::Status::deadline_exceeded("5 s"), addr, || {
            "key 'k'".into()
        });
        assert_eq!(got.to_string(), "timed out waiting for key 'k'");

        let got = Error::from_status(
            tonic::Status::unauthenticated("KeyValue needs credentials"),
            addr,
            String::new,
        );
        assert!(matches!(&got, Error::Unauthorized { status, .. }
                if status.code() == Code::Unauthenticated));
        assert_eq!(
            got.to_string(),
            "the muster coordinator at coord:29470 refused the credentials (Unauthenticated): \
             KeyValue needs credentials (MUSTER_TOKEN must hold this job's token, which \
             muster-agent sets for its workers)"
        );
        let got = Error::from_status(
            tonic::Status::permission_denied("the job token is for job 'a', not job 'b'"),
            addr,
            String::new,
        );
        assert_eq!(
            got.to_string(),
            "the muster coordinator at coord:29470 refused the credentials (PermissionDenied): \
             the job token is for job 'a', not job 'b'"
        );

        let got = Error::from_status(
            tonic::Status::failed_precondition("generation 2 failed: rank 1 exited"),
            addr,
            String::new,
        );
        assert_eq!(
            got.to_string(),
            "the muster coordinator answered FailedPrecondition: generation 2 failed: rank 1 exited"
        );
    }
}
