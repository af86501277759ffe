//! The domain error of a job's rules, and its one mapping to a gRPC status.
//!
//! The job code decides *what* went wrong and words the message (naming the job, generation,
//! rank or node); this file alone decides which status code each kind of refusal becomes, so
//! that a client's retry rules (`UNAVAILABLE`: ask the leader; `FAILED_PRECONDITION`: do not
//! retry) follow one table.

use tonic::Status;

/// The metadata key set on a join refused because its node was drained, so that an agent can
/// tell a drain (stop for good) from a job that is over.
pub const DRAINED_METADATA: &str = "muster-drained";

/// The metadata key set on a join refused (or ended) because an operator cancelled the job,
/// so that an agent can tell a cancel (stop, exit with the cancelled status) from a failure.
pub const CANCELLED_METADATA: &str = "muster-cancelled";

/// The metadata key set on a spare's join answered because its job finished without needing
/// it, so that a spare agent exits 0 rather than as a failure.
pub const FINISHED_METADATA: &str = "muster-finished";

/// Why a job refused or could not complete a call. Each variant carries the whole message the
/// caller reads.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Error {
    /// A request value outside what the job allows: a field, or a rank or node rank outside
    /// the generation.
    #[error("{0}")]
    InvalidArgument(String),
    /// The generation named is not the running one (stale, still forming, or not yet made).
    #[error("{0}")]
    WrongGeneration(String),
    /// The job's state refuses the call: the job is over, full, or the node is not drainable.
    #[error("{0}")]
    FailedPrecondition(String),
    /// The node was drained from the job by an operator and may not join it again.
    #[error("{0}")]
    Drained(String),
    /// An operator cancelled the job: a join is refused, or a joiner of the open round is
    /// sent away. The message carries the operator's reason.
    #[error("{0}")]
    Cancelled(String),
    /// The job finished: a spare standing by is sent away (it was not needed).
    #[error("{0}")]
    Finished(String),
    /// The place asked for is taken: a node already joined, a rank already registered, a
    /// relay already attached, a job already created.
    #[error("{0}")]
    AlreadyExists(String),
    /// The caller is not the node the job has at that node rank.
    #[error("{0}")]
    WrongNode(String),
    /// No such job.
    #[error("{0}")]
    NotFound(String),
    /// This coordinator does not (or no longer) lead; the caller asks the leader.
    #[error("{0}")]
    Unavailable(String),
    /// A wait ran out: a rendezvous round timed out.
    #[error("{0}")]
    DeadlineExceeded(String),
    /// The generation failed or the job was cancelled while the call waited.
    #[error("{0}")]
    Aborted(String),
    /// A coordinator-wide limit (jobs, bytes) is reached.
    #[error("{0}")]
    ResourceExhausted(String),
}

impl Error {
    /// The message the caller reads (as the status message).
    pub fn message(&self) -> &str {
        match self {
            Self::InvalidArgument(m)
            | Self::WrongGeneration(m)
            | Self::FailedPrecondition(m)
            | Self::Drained(m)
            | Self::Cancelled(m)
            | Self::Finished(m)
            | Self::AlreadyExists(m)
            | Self::WrongNode(m)
            | Self::NotFound(m)
            | Self::Unavailable(m)
            | Self::DeadlineExceeded(m)
            | Self::Aborted(m)
            | Self::ResourceExhausted(m) => m,
        }
    }
}

impl From<crate::model::Invalid> for Status {
    /// Through [`Error`], whose mapping is the one table of status codes.
    fn from(e: crate::model::Invalid) -> Self {
        Error::from(e).into()
    }
}

impl From<crate::model::Invalid> for Error {
    fn from(e: crate::model::Invalid) -> Self {
        Self::InvalidArgument(e.0)
    }
}

impl From<Error> for Status {
    fn from(e: Error) -> Self {
        match e {
            Error::InvalidArgument(m) => Status::invalid_argument(m),
            Error::WrongGeneration(m) | Error::FailedPrecondition(m) => {
                Status::failed_precondition(m)
            }
            Error::Drained(m) => {
                let mut status = Status::failed_precondition(m);
                status.metadata_mut().insert(
                    DRAINED_METADATA,
                    tonic::metadata::MetadataValue::from_static("1"),
                );
                status
            }
            Error::Cancelled(m) => {
                let mut status = Status::failed_precondition(m);
                status.metadata_mut().insert(
                    CANCELLED_METADATA,
                    tonic::metadata::MetadataValue::from_static("1"),
                );
                status
            }
            Error::Finished(m) => {
                let mut status = Status::failed_precondition(m);
                status.metadata_mut().insert(
                    FINISHED_METADATA,
                    tonic::metadata::MetadataValue::from_static("1"),
                );
                status
            }
            Error::AlreadyExists(m) => Status::already_exists(m),
            Error::WrongNode(m) => Status::permission_denied(m),
            Error::NotFound(m) => Status::not_found(m),
            Error::Unavailable(m) => Status::unavailable(m),
            Error::DeadlineExceeded(m) => Status::deadline_exceeded(m),
            Error::Aborted(m) => Status::aborted(m),
            Error::ResourceExhausted(m) => Status::resource_exhausted(m),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every kind keeps its message and lands on the code clients' retry rules expect.
    #[test]
    fn each_kind_maps_to_its_status_code() {
        use tonic::Code;
        let cases = [
            (Error::InvalidArgument("a".into()), Code::InvalidArgument),
            (Error::WrongGeneration("b".into()), Code::FailedPrecondition),
            (
                Error::FailedPrecondition("c".into()),
                Code::FailedPrecondition,
            ),
            (Error::Drained("d".into()), Code::FailedPrecondition),
            (Error::Cancelled("l".into()), Code::FailedPrecondition),
            (Error::Finished("m".into()), Code::FailedPrecondition),
            (Error::AlreadyExists("e".into()), Code::AlreadyExists),
            (Error::WrongNode("f".into()), Code::PermissionDenied),
            (Error::NotFound("g".into()), Code::NotFound),
            (Error::Unavailable("h".into()), Code::Unavailable),
            (Error::DeadlineExceeded("i".into()), Code::DeadlineExceeded),
            (Error::Aborted("j".into()), Code::Aborted),
            (
                Error::ResourceExhausted("k".into()),
                Code::ResourceExhausted,
            ),
        ];
        for (error, code) in cases {
            let message = error.message().to_owned();
            let status = Status::from(error);
            assert_eq!((status.code(), status.message()), (code, message.as_str()));
            assert_eq!(
                status.metadata().contains_key(DRAINED_METADATA),
                message == "d"
            );
            assert_eq!(
                status.metadata().contains_key(CANCELLED_METADATA),
                message == "l"
            );
        }
    }
}
