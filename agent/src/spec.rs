//! The launch spec: everything one node of a job needs, validated. The command line
//! ([`crate::cli`]) and a job placed on a daemon agent ([`crate::daemon`]) both end here, through
//! the same validation, and [`crate::launch`] runs nothing else.

use crate::env::{Recovery, WorkerOptions};
use crate::gpu::GpuPlan;
use crate::program::Program;
use crate::security::Security;
use crate::worker::OutputSpec;
use std::fmt::Display;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

/// A node count range from `--nnodes`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct NodeRange {
    /// Fewest nodes the rendezvous may close with.
    pub min: u32,
    /// Most nodes the rendezvous takes.
    pub max: u32,
}

impl Display for NodeRange {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if self.min == self.max {
            write!(f, "{}", self.min)
        } else {
            write!(f, "{}:{}", self.min, self.max)
        }
    }
}

/// Everything `launch` needs, validated: nothing in here can be wrong in a way the agent
/// could have found out before starting.
#[derive(Debug, Clone)]
pub struct LaunchSpec {
    /// Workers on this node (1 to 4096).
    pub nproc_per_node: u32,
    /// An external coordinator's `host:port`, or its replicas' (comma-separated, without
    /// blanks or repeats); `None` runs the embedded one.
    pub coordinator: Option<String>,
    /// `--failover-timeout-ms`: how long calls are retried across a coordinator failover.
    pub failover_timeout: Duration,
    /// The job id (valid for the coordinator).
    pub job_id: String,
    /// `--nnodes`.
    pub nodes: NodeRange,
    /// `--node-rank`, below `nodes.max`.
    pub node_rank: Option<u32>,
    /// `--advertise-addr`: a host name or IP address without a port. `None`: the launch
    /// finds the local address that routes to the coordinator.
    pub advertise_addr: Option<String>,
    /// SIGTERM-to-SIGKILL grace period for stopping workers.
    pub grace_period: Duration,
    /// `--max-restarts`: restarts of the whole job after a failure.
    pub max_restarts: u32,
    /// `--recovery`: what a worker's death does (the job's first joiner fixes it).
    pub recovery: Recovery,
    /// `--spare`: this agent stands by as a spare until a lost node's ranks are assigned.
    pub spare: bool,
    /// `--max-spares`: spares the job admits (the job's first joiner fixes it).
    pub max_spares: u32,
    /// `--hang-timeout` and `--on-hang` (the job's first joiner fixes them).
    pub hang: muster_core::requests::Hang,
    /// `--sample-stacks`: stack samples a second per worker (0: only on demand).
    pub sample_hz: f64,
    /// torch's Flight Recorder on for the workers and read in stack dumps (`flight.rs`);
    /// off with `--no-flight-recorder`.
    pub flight_recorder: bool,
    /// How long the rendezvous waits for MIN nodes; `None`: the coordinator's default.
    pub join_timeout: Option<Duration>,
    /// How long a round with MIN nodes stays open for more; `None`: the coordinator's default.
    pub last_call: Option<Duration>,
    /// How long the node keeps its workers after losing the coordinator.
    pub lease: Duration,
    /// MASTER_ADDR instead of node rank 0's address.
    pub master_addr: Option<String>,
    /// MASTER_PORT instead of a free port on node rank 0 (never 0).
    pub master_port: Option<u16>,
    /// The workers' GPUs.
    pub gpus: GpuPlan,
    /// Where the workers' output goes.
    pub output: OutputSpec,
    /// ACCELERATE_MIXED_PRECISION (`no`, `fp16`, `bf16`, `fp8`).
    pub mixed_precision: Option<String>,
    /// ACCELERATE_USE_CPU=True.
    pub use_cpu: bool,
    /// ACCELERATE_DEBUG_MODE=true.
    pub debug: bool,
    /// ACCELERATE_CPU_AFFINITY=1.
    pub cpu_affinity: bool,
    /// The command line is `accelerate launch`'s (an Accelerate-only flag or a config file):
    /// the workers get the settings Accelerate's launcher always passes (see
    /// [`crate::env::WorkerOptions::accelerate`]).
    pub accelerate: bool,
    /// With `accelerate`: what Accelerate's launcher sets from its paradigm flags and
    /// config file ([`crate::cli::accelerate_flags::Resolved::env`]).
    pub accelerate_env: Vec<(&'static str, String)>,
    /// `-q`: the agent leaves out its informational lines.
    pub quiet: bool,
    /// Whether to run the node relay (not `--no-relay`).
    pub relay: bool,
    /// Whether each generation's workers get this node's agent store (torch's TCPStore
    /// protocol on a loopback port, backed by the job's key-value store) instead of rank 0's
    /// own TCPStore (not `--no-agent-store`).
    pub agent_store: bool,
    /// `--metrics-addr`: where to serve Prometheus metrics; `None`: nowhere.
    pub metrics_addr: Option<SocketAddr>,
    /// `--role`: the workers' ROLE_NAME.
    pub role: String,
    /// `--virtual-local-rank`: LOCAL_RANK=0 for every worker.
    pub virtual_local_rank: bool,
    /// Set when this agent may host the coordinator at `coordinator` (one `HOST:PORT`): it
    /// binds it if its machine can, else dials (see `launch::place_coordinator`).
    pub self_host: Option<SelfHost>,
    /// TLS and the cluster token for the coordinator given (plaintext for the embedded one);
    /// its `Debug` hides the token.
    pub security: Security,
    /// The worker program, resolved on `PATH`.
    pub program: Program,
    /// The node id the launch joins under; `None`: `<hostname>-<pid>`. A daemon agent joins
    /// under its agent id, so the coordinator matches each node to its registered machine
    /// (labels, host name) even when agents share an address.
    pub node_id: Option<String>,
}

impl LaunchSpec {
    /// What every worker's environment gets from this launch besides the rendezvous' answer
    /// (for [`crate::env::worker_env`]).
    pub fn worker_options(&self) -> WorkerOptions<'_> {
        WorkerOptions {
            gpus: &self.gpus,
            mixed_precision: self.mixed_precision.as_deref(),
            use_cpu: self.use_cpu,
            debug: self.debug,
            cpu_affinity: self.cpu_affinity,
            accelerate: self.accelerate,
            accelerate_env: Some(&self.accelerate_env),
            security: Some(&self.security),
            role: &self.role,
            virtual_local_rank: self.virtual_local_rank,
            agent_store: self.agent_store,
        }
    }
}

/// Whether and how this agent hosts the coordinator at the rendezvous endpoint.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SelfHost {
    /// `is_host=true`: failing to bind the endpoint is an error, not a reason to dial.
    pub must: bool,
    /// TLS and the cluster token the hosted coordinator serves with; `None`: plaintext and
    /// without authentication (warned about when the address is not loopback).
    pub secured: Option<ServerSecurity>,
}

/// The launch's `--tls-*` and `--auth-token-file`, read as a server's: the node's certificate
/// and key serve, its CA checks the clients' certificates (mutual TLS), the token file is the
/// cluster token.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ServerSecurity {
    /// `--tls-cert`: must name the endpoint's host (or `--tls-domain`) for the dialers.
    pub cert: PathBuf,
    /// `--tls-key`.
    pub key: PathBuf,
    /// `--tls-ca`.
    pub client_ca: PathBuf,
    /// `--auth-token-file`.
    pub token_file: PathBuf,
}
