//! muster's worker SDK: what a distributed training process uses to learn its rank, wait for
//! the other ranks, let the main process go first, share values and NCCL unique ids, and use a
//! job-wide key-value store — Hugging Face Accelerate's process model on top of muster's
//! coordinator.
//!
//! - [`Accelerator`] is the synchronous, Accelerate-shaped API for training scripts, built from
//!   the `MUSTER_*` environment that `muster-agent` sets ([`RankInfo`]). Without a
//!   coordinator it runs as a single process and every call succeeds locally.
//! - [`relay`] carries the barriers of a worker launched by `muster-agent` to the agent over
//!   a local socket (`MUSTER_AGENT_SOCKET`), so that a node's barriers cost the coordinator one
//!   message per node. Everything else such a worker asks of the coordinator goes to the
//!   agent's gateway socket beside it (`unix:<dir>/coordinator.sock`): a worker under an agent
//!   holds no connection to the coordinator.
//! - [`client`] is the async core ([`client::Coordinator`], [`client::Session`] and typed
//!   wrappers over the key-value, unique-id and shared-value services), for async code and for
//!   benchmarks that simulate many ranks in one process. It fails over between coordinator
//!   replicas (`MUSTER_COORDINATOR=host:port,host:port`) by the policy shared with the agent
//!   (`muster_core::failover`): running sessions re-attach to the new leader without their
//!   callers noticing.
//! - Security: every connection to the coordinator uses TLS when `MUSTER_TLS_CA` is set (the
//!   CA that signed the coordinator's certificate; `MUSTER_TLS_CERT` and `MUSTER_TLS_KEY` add
//!   a client certificate for mutual TLS, `MUSTER_TLS_DOMAIN` overrides the name verified),
//!   and every call and session stream carries `MUSTER_TOKEN` (the job token `muster-agent`
//!   gives its workers) as `authorization: Bearer <token>`. See [`env`](mod@env); async code passes
//!   them explicitly with [`client::Coordinator::connect_with`]. A refused token is
//!   [`Error::Unauthorized`]; a coordinator whose certificate does not verify is
//!   [`Error::Connection`] with the TLS error as its cause.
//! - [`install_error_hook`] and [`record_error`] hand a fatal error (a panic's message and
//!   backtrace) to the agent in the JSON file PyTorch's `@record` writes
//!   (`TORCHELASTIC_ERROR_FILE`), so the agent reports it as the root cause.
//! - Traces: a barrier is a `muster.barrier` span, and when the application records spans
//!   with `tracing-opentelemetry`, barriers on a coordinator session and key-value,
//!   unique-id and shared-value calls carry the W3C trace context to the coordinator, whose
//!   spans join the worker's trace. Barriers sent to the agent's relay do not (yet).
//! - [`membership`]: in-place recovery (`MUSTER_RECOVERY=in-place`): the per-step check
//!   [`membership::Membership::changed`] (atomic loads, no coordinator call), the quorum call
//!   after a rank died, and with [`comm::Communicator::reconfigure`] and
//!   [`comm::Communicator::heal`] the rebuilt communicator and the healed replacement.
//! - [`Error`] is the one error type; its messages name the rank, node, host or barrier at
//!   fault.
//!
//! ```no_run
//! let accelerator = muster::Accelerator::from_env()?;
//! let vocabulary: Vec<String> =
//!     accelerator.main_process_first_share(|| vec!["hello".to_owned(), "world".to_owned()])?;
//! accelerator.wait_for_everyone()?;
//! muster::print!(accelerator, "rank {} has {} words", accelerator.process_index(), vocabulary.len());
//! accelerator.finish()?;
//! # Ok::<(), muster::Error>(())
//! ```

pub mod accelerator;
pub mod checkpoint;
pub mod client;
pub mod comm;
pub mod data;
pub mod dtype;
pub mod env;
pub mod error;
pub mod error_file;
pub mod failover;
pub mod interrupt;
pub mod membership;
pub mod relay;
mod trace_context;
pub mod train;

pub use accelerator::{Accelerator, KvStore};
pub use client::{CasOutcome, FailureWatch, Scope};
pub use env::{RankInfo, Recovery};
pub use error::{Error, RankLocation};
pub use error_file::{install_error_hook, record_error};
pub use muster_proto::NCCL_UNIQUE_ID_BYTES;

/// Prints a formatted line once per machine (on the local main process), like Accelerate's
/// `accelerator.print`: `muster::print!(accelerator, "loss {loss:.3}")`.
#[macro_export]
macro_rules! print {
    ($accelerator:expr, $($arg:tt)*) => {
        $accelerator.print(::std::format_args!($($arg)*))
    };
}
