//! The rules every muster part shares: the coordinator, the agent and the worker SDK (Rust and,
//! through it, Python) each link this crate and none of them writes these rules again.
//!
//! Nothing here does I/O, spawns a task or names a server dependency: every module is plain
//! data and decisions, so each is tested with plain unit tests.

pub mod error;
pub mod failure;
pub mod model;
pub mod requests;

/// The barrier table: arrivals, completion, divergence and every barrier error text.
pub mod barrier;
/// The worker-agent contract: environment names and the node relay's framing.
pub mod contract;
pub mod failover;

pub mod error_chain;
pub mod job_token;
