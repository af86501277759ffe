//! The rules every muster part shares: the coordinator, the agent and the worker SDK (Rust and,
//! through it, Python) each link this crate and none of them writes these rules again.
//!
//! Nothing here does I/O, spawns a task or names a server dependency: every module is plain
//! data and decisions, so each is tested with plain unit tests.

/// The barrier table: arrivals, completion, divergence and every barrier error text.
pub mod barrier;
/// The worker-agent contract: environment names and the node relay's framing.
pub mod contract;
/// The domain error, and its one mapping to a gRPC status.
pub mod error;
/// An error and its sources, on one line.
pub mod error_chain;
/// The failover policy: what to retry, where the leader is, backoff and budget.
pub mod failover;
/// A rank's or node's failure as every part reports it.
pub mod failure;
/// Job tokens: minted by the agent, verified by the coordinator.
pub mod job_token;
/// Validated domain types: ids, names, hosts, waits, barrier scopes and their limits.
pub mod model;
/// NCCL's bootstrap at scale: which ranks make a communicator's unique ids.
pub mod nccl;
/// Requests from the wire turned into domain values (`TryFrom`), checked once at the edge.
pub mod requests;
/// Ranks' stacks folded and grouped: where a hang's ranks stand, and which are elsewhere.
pub mod stacks;
