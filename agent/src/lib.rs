//! muster's per-machine agent: joins a job's rendezvous at the coordinator (or runs one of its
//! own for a single-node job), starts the node's workers with the environment of
//! `docs/contract.md`, prefixes and forwards their output, and supervises them: a failed
//! worker is reported to the coordinator and stops the rest; SIGINT and SIGTERM are forwarded.
//! Unless told otherwise (`--no-relay`), it also relays its workers' barriers ([`relay`]):
//! node barriers complete in the agent and a global barrier costs the coordinator one message
//! per node.
//! A guardian process ([`guard`]) kills the workers and their children if the agent itself is
//! killed (SIGKILL included); a failed worker's structured error is read from its error file
//! ([`error_file`]).
//! With several coordinator replicas (`--coordinator a,b,c`), every call and stream follows
//! the leader across a failover within `--failover-timeout-ms` ([`failover`]).
//! With `--metrics-addr`, it serves Prometheus metrics of its workers ([`metrics`]).
//! With `--tls-ca` and `--auth-token-file` it connects with TLS and the cluster token, and
//! hands each worker a token for its job only ([`security`]).
//!
//! The binary (`main.rs`) only parses the command line ([`cli::parse`]) and calls
//! [`launch::run`]; tests call both directly. The command line and a job placed on a daemon
//! agent ([`daemon`]) both become one [`spec::LaunchSpec`] through the same validation
//! ([`cli::validate`]).

pub mod accelerate_config;
pub mod certs;
pub mod cli;
pub mod console;
pub mod daemon;
pub mod describe;
pub mod entry;
pub mod env;
pub mod error_file;
pub mod failover;
pub mod flight;
pub mod gpu;
pub mod guard;
pub mod launch;
pub mod metrics;
pub mod net;
pub mod operator;
pub mod procfs;
pub mod program;
pub mod relay;
pub mod security;
pub mod spec;
pub mod stacks;
pub mod store;
pub mod systemd;
pub mod watch;
pub mod worker;

pub use cli::{Parsed, UsageError};
pub use launch::{LaunchError, Outcome};
pub use spec::LaunchSpec;

/// Exit status for a bad command line (nothing was started).
pub const USAGE_EXIT: u8 = 2;
/// Exit status when the launch itself failed (coordinator unreachable, rendezvous refused).
pub const LAUNCH_ERROR_EXIT: u8 = 1;
