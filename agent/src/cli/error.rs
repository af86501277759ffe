//! The command line's one error type: every problem found before anything starts is one
//! line and exit status 2, whether it came from clap, a flag's value, a conflict or the
//! Accelerate config file.

use crate::accelerate_config::ConfigError;
use crate::program::ProgramError;
use muster_core::model;

/// A problem with the command line; the agent prints `muster-agent: <problem>` and exits 2.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum UsageError {
    /// Clap could not parse the arguments (its message, first line only).
    #[error("{0} (see `muster-agent launch --help`)")]
    Parse(String),
    /// No program after the flags.
    #[error(
        "no program to launch: give it after the flags, as in `muster-agent launch --nproc-per-node 2 train.py`"
    )]
    NoProgram,
    /// The program cannot be run.
    #[error(transparent)]
    Program(#[from] ProgramError),
    /// `--nproc-per-node` is 0 or too large.
    #[error("--nproc-per-node {0} is out of range 1..={max}", max = model::MAX_LOCAL_WORLD_SIZE)]
    NprocPerNode(u32),
    /// `--nnodes` does not parse or makes no sense.
    #[error("--nnodes '{0}' is malformed: {1}")]
    Nnodes(String, &'static str),
    /// The node rank is not below the most nodes the job can have.
    #[error("{rank} is out of range for {nodes} (node ranks are 0..{max})")]
    NodeRank {
        /// The requested rank, as given (`--node-rank 3`).
        rank: String,
        /// The node count, as given (`--nnodes 2:3`).
        nodes: String,
        /// The most nodes.
        max: u32,
    },
    /// `--job-id` is not a valid job id.
    #[error("--job-id: {0}")]
    JobId(String),
    /// `--coordinator` is not `host:port`.
    #[error(
        "--coordinator '{0}' is malformed: expected HOST:PORT, as in 10.0.0.1:29470, or a comma-separated list of them"
    )]
    Coordinator(String),
    /// A multi-node job needs what only the user can give.
    #[error("{0} needs {1}: every node must name the same one")]
    MultiNode(String, &'static str),
    /// Two settings of the same thing disagree.
    #[error("{0} conflicts with {1}")]
    Conflict(String, String),
    /// A flag's value (or a combination) makes no sense; the message names the flag.
    #[error("{0}")]
    Invalid(String),
    /// The Accelerate config file cannot be used.
    #[error("--config-file '{file}': {error}")]
    Config {
        /// The path, as given.
        file: String,
        /// What is wrong.
        error: ConfigError,
    },
}
