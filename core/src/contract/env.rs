//! The names of the worker environment: every variable `muster-agent` sets for a worker (or
//! passes through to it) that the worker SDK, torchrun-style scripts or Accelerate read. Each
//! constant is named after the variable it spells, so that code reads as the contract does.

// --- muster's own variables: the worker's place in the job -------------------------------

/// The coordinator's `host:port`, or its replicas' as a comma-separated list; unset means the
/// worker runs as a single process.
pub const MUSTER_COORDINATOR: &str = "MUSTER_COORDINATOR";
/// How long workers retry across a coordinator failover, in milliseconds (0: no retrying).
pub const MUSTER_FAILOVER_TIMEOUT_MS: &str = "MUSTER_FAILOVER_TIMEOUT_MS";
/// The job id.
pub const MUSTER_JOB_ID: &str = "MUSTER_JOB_ID";
/// The generation (restart round) the worker belongs to, from 1.
pub const MUSTER_GENERATION: &str = "MUSTER_GENERATION";
/// The worker's global rank, `0..MUSTER_WORLD_SIZE`.
pub const MUSTER_RANK: &str = "MUSTER_RANK";
/// The worker's rank on its node (the real one, even under torchrun's `--virtual-local-rank`).
pub const MUSTER_LOCAL_RANK: &str = "MUSTER_LOCAL_RANK";
/// Workers in the generation.
pub const MUSTER_WORLD_SIZE: &str = "MUSTER_WORLD_SIZE";
/// Workers on this node.
pub const MUSTER_LOCAL_WORLD_SIZE: &str = "MUSTER_LOCAL_WORLD_SIZE";
/// This node's rank, `0..MUSTER_NUM_NODES`.
pub const MUSTER_NODE_RANK: &str = "MUSTER_NODE_RANK";
/// Nodes in the generation.
pub const MUSTER_NUM_NODES: &str = "MUSTER_NUM_NODES";
/// Restarts so far (0 in the first generation).
pub const MUSTER_RESTART_COUNT: &str = "MUSTER_RESTART_COUNT";
/// What a worker's death does: `restart` (the generation ends and every worker restarts) or
/// `in-place` (only the dead worker is respawned; the others agree on a new membership at a
/// step boundary and heal it). Set by the agent from the job's recovery mode.
pub const MUSTER_RECOVERY: &str = "MUSTER_RECOVERY";
/// In-place recovery: the membership epoch a respawned worker replaces its rank in (unset, or
/// 0, for a worker of the generation's first membership).
pub const MUSTER_EPOCH: &str = "MUSTER_EPOCH";
/// The host the worker's node advertised (named in other ranks' error messages).
pub const MUSTER_HOST: &str = "MUSTER_HOST";
/// The node relay's Unix socket, when the agent runs one: barriers go there instead of through
/// the worker's coordinator session (framing in [`super::frame`]).
pub const MUSTER_AGENT_SOCKET: &str = "MUSTER_AGENT_SOCKET";
/// The process id of the agent that started the worker, set with [`MUSTER_AGENT_SOCKET`]: the
/// Python SDK connects to the agent as soon as it is imported in a process whose parent that
/// is (the worker itself, not a child or a helper that a wrapper script runs first).
pub const MUSTER_AGENT_PID: &str = "MUSTER_AGENT_PID";
/// The agent's step socket ([`super::STEP_SOCKET`]), given to global rank 0's worker only:
/// the agent's Python start-up hook sends each optimizer step there.
pub const MUSTER_STEP_SOCKET: &str = "MUSTER_STEP_SOCKET";
/// Where the worker writes its structured error (the same path as `TORCHELASTIC_ERROR_FILE`).
pub const MUSTER_ERROR_FILE: &str = "MUSTER_ERROR_FILE";
/// The GPU id assigned to the worker, as the node names it.
pub const MUSTER_GPU_IDS: &str = "MUSTER_GPU_IDS";
/// The index of the worker's GPU among the devices it sees (`cuda:<index>`).
pub const MUSTER_CUDA_DEVICE: &str = "MUSTER_CUDA_DEVICE";

// --- How to reach the coordinator securely (defined with the wire's security rules) --------

/// PEM file of the CA that signed the coordinator's certificate; set means TLS.
pub use muster_proto::security::env::TLS_CA as MUSTER_TLS_CA;
/// PEM certificate chain of the worker, for a coordinator that requires mutual TLS.
pub use muster_proto::security::env::TLS_CERT as MUSTER_TLS_CERT;
/// The name to verify the coordinator's certificate against, when not the address's host.
pub use muster_proto::security::env::TLS_DOMAIN as MUSTER_TLS_DOMAIN;
/// PEM private key of `MUSTER_TLS_CERT`.
pub use muster_proto::security::env::TLS_KEY as MUSTER_TLS_KEY;
/// The worker's credential: its job token (`mj1.…`), sent as `authorization: Bearer`.
pub use muster_proto::security::env::TOKEN as MUSTER_TOKEN;

// --- The SDK's own settings, set by the user and passed through by the agent ---------------

/// The collective backend (`cpu` or `nccl`), overriding the SDK's choice.
pub const MUSTER_COMM_BACKEND: &str = "MUSTER_COMM_BACKEND";
/// The CPU backend's transport between ranks (`tcp` forces TCP on one machine too).
pub const MUSTER_COMM_TRANSPORT: &str = "MUSTER_COMM_TRANSPORT";

// --- torchrun's names, so that scripts written for torchrun run unchanged ------------------

/// Global rank.
pub const RANK: &str = "RANK";
/// Rank on the node (0 for every worker under `--virtual-local-rank`).
pub const LOCAL_RANK: &str = "LOCAL_RANK";
/// Workers in the job.
pub const WORLD_SIZE: &str = "WORLD_SIZE";
/// Workers on the node.
pub const LOCAL_WORLD_SIZE: &str = "LOCAL_WORLD_SIZE";
/// The node's rank.
pub const GROUP_RANK: &str = "GROUP_RANK";
/// Nodes in the job.
pub const GROUP_WORLD_SIZE: &str = "GROUP_WORLD_SIZE";
/// Rank among the workers of the same role (muster has one role, so the global rank).
pub const ROLE_RANK: &str = "ROLE_RANK";
/// torchrun's `--role`.
pub const ROLE_NAME: &str = "ROLE_NAME";
/// Workers of the same role.
pub const ROLE_WORLD_SIZE: &str = "ROLE_WORLD_SIZE";
/// Node rank 0's host, for `torch.distributed`'s own rendezvous; `127.0.0.1` with the agent
/// store (each node's agent serves it on loopback).
pub const MASTER_ADDR: &str = "MASTER_ADDR";
/// A free port on node rank 0's host, the same for every worker; with the agent store, the
/// port of this node's agent store.
pub const MASTER_PORT: &str = "MASTER_PORT";
/// Restarts so far.
pub const TORCHELASTIC_RESTART_COUNT: &str = "TORCHELASTIC_RESTART_COUNT";
/// The restart budget (`--max-restarts`).
pub const TORCHELASTIC_MAX_RESTARTS: &str = "TORCHELASTIC_MAX_RESTARTS";
/// The run id: the job id.
pub const TORCHELASTIC_RUN_ID: &str = "TORCHELASTIC_RUN_ID";
/// `True` when the agent serves torch's store at `MASTER_ADDR:MASTER_PORT` (the default), so
/// torch's `env://` opens no store server in any worker; `False` with `--no-agent-store`.
pub const TORCHELASTIC_USE_AGENT_STORE: &str = "TORCHELASTIC_USE_AGENT_STORE";
/// The JSON file PyTorch's `@record` writes a fatal error to, read back by the agent.
pub const TORCHELASTIC_ERROR_FILE: &str = "TORCHELASTIC_ERROR_FILE";
/// `1` unless inherited: NCCL errors abort the process instead of hanging it.
pub const TORCH_NCCL_ASYNC_ERROR_HANDLING: &str = "TORCH_NCCL_ASYNC_ERROR_HANDLING";
/// `1` when several workers share a node and the agent's environment has none.
pub const OMP_NUM_THREADS: &str = "OMP_NUM_THREADS";

// --- Accelerate's settings, as `accelerate launch` sets them --------------------------------

/// `no`, `fp16`, `bf16` or `fp8`.
pub const ACCELERATE_MIXED_PRECISION: &str = "ACCELERATE_MIXED_PRECISION";
/// `True`: train on the CPU even when a GPU is present.
pub const ACCELERATE_USE_CPU: &str = "ACCELERATE_USE_CPU";
/// `true`: Accelerate's debug checks of collective shapes.
pub const ACCELERATE_DEBUG_MODE: &str = "ACCELERATE_DEBUG_MODE";
/// `1`: pin each worker to the CPUs near its GPU.
pub const ACCELERATE_CPU_AFFINITY: &str = "ACCELERATE_CPU_AFFINITY";
