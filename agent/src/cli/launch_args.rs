//! The `launch` subcommand's flags, as clap reads them (torchrun's, muster's own and
//! Accelerate's spellings); [`super::validate`] turns them into a [`crate::spec::LaunchSpec`].

use super::{accelerate_flags, output, rdzv, torchrun};
use crate::accelerate_config;
use crate::env::Recovery;
use crate::gpu::GpuMapping;
use crate::security::SecurityArgs;
use clap::{Args, FromArgMatches};
use muster_core::requests::OnHang;
use std::ffi::OsString;
use std::net::SocketAddr;
use std::path::PathBuf;

/// `muster-agent launch`: the flags follow torchrun's where torchrun has one (both
/// `--dash-case` and `--snake_case`), and Accelerate's launch flags are accepted too.
#[derive(Debug, Args)]
pub struct LaunchArgs {
    /// Workers to run on this node: a number, `gpu` (one per GPU), `cpu` (one per CPU core the
    /// agent may use) or `auto` (`gpu` on a machine with GPUs, else `cpu`). Default: 1, as with
    /// torchrun, or num_processes / num_machines from --config-file.
    #[arg(
        long,
        value_name = "N",
        alias = "nproc_per_node",
        env = "PET_NPROC_PER_NODE",
        value_parser = parse_nproc
    )]
    pub nproc_per_node: Option<Nproc>,

    /// The coordinator's HOST:PORT, or its replicas' as a comma-separated list (the agent
    /// and its workers follow the leader among them). Default: a coordinator of the agent's
    /// own on 127.0.0.1 (single-node jobs); for a multi-node job with a main machine's address
    /// (--master-addr, --main_process_ip or main_process_ip in --config-file), that address,
    /// port 29470, or --rdzv-endpoint: the agent whose machine can bind it hosts the
    /// coordinator there for the whole job, the others dial it.
    #[arg(long, value_name = "HOST:PORT[,HOST:PORT...]")]
    pub coordinator: Option<String>,

    /// How long the agent and its workers keep retrying calls and re-attaching their streams
    /// when the coordinator fails over (or restarts), before giving up as without failover.
    /// The workers get it as MUSTER_FAILOVER_TIMEOUT_MS.
    #[arg(
        long,
        value_name = "MS",
        default_value_t = muster_core::failover::DEFAULT_BUDGET_MS,
        alias = "failover_timeout_ms"
    )]
    pub failover_timeout_ms: u64,

    /// The job id (1 to 128 characters of [A-Za-z0-9._-]). Every node of a job gives the same
    /// one. Default: a fresh id for a single-node job; for a multi-node job with a main
    /// machine's address, `muster-<ADDR>-<PORT>` from it and the master port (29500 when not
    /// given), so that every machine of an Accelerate-style launch derives the same one.
    #[arg(long, value_name = "ID", alias = "job_id")]
    pub job_id: Option<String>,

    /// How many nodes the job has: MIN or MIN:MAX. Default: 1 (or num_machines, or the
    /// step's node count under srun).
    #[arg(long, value_name = "MIN[:MAX]", env = "PET_NNODES")]
    pub nnodes: Option<String>,

    /// The node rank this node asks for. Default: any free one (or machine_rank, or
    /// SLURM_NODEID under srun).
    #[arg(long, value_name = "R", alias = "node_rank", env = "PET_NODE_RANK")]
    pub node_rank: Option<u32>,

    /// The address other nodes reach this node at (MASTER_ADDR when it is node 0): a host name
    /// or IP address, without a port. Default: the local address that routes to the
    /// coordinator (127.0.0.1 with the agent's own coordinator).
    #[arg(
        long,
        value_name = "HOST",
        visible_alias = "host",
        alias = "advertise_addr"
    )]
    pub advertise_addr: Option<String>,

    /// Restarts allowed after a failure, for the whole job: every node's workers are stopped
    /// and all nodes rendezvous again with fresh ranks. Default: 0 (or max_restarts).
    #[arg(
        long,
        value_name = "N",
        alias = "max_restarts",
        env = "PET_MAX_RESTARTS"
    )]
    pub max_restarts: Option<u32>,

    /// What a worker's death does: `restart` (every worker of the job is stopped and all
    /// nodes rendezvous again, as under torchrun) or `in-place` (only the dead worker is
    /// respawned, counted against --max-restarts; the others keep running and heal it at
    /// their next step boundary). The workers get it as MUSTER_RECOVERY. Default: restart (or
    /// muster_recovery in --config-file).
    #[arg(long, value_enum, value_name = "MODE", alias = "recovery_mode")]
    pub recovery: Option<Recovery>,

    /// Join as a spare: take no ranks, stand by, and take a lost node's ranks in place when
    /// the coordinator assigns them (an in-place job that admits spares, --max-spares). Give
    /// it the job's --nproc-per-node, coordinator and program, as its nodes have.
    #[arg(long)]
    pub spare: bool,

    /// How many spare agents (--spare) the job admits, standing by to take a lost node's
    /// ranks in place (--recovery in-place). The job's first node sets it. Default: 0 (or
    /// muster_max_spares in --config-file).
    #[arg(long, value_name = "N")]
    pub max_spares: Option<u32>,

    /// How long the job may make no progress before it is a hang (`90s`, `5m`, `off`):
    /// progress is a muster barrier completing, a worker's sampled stack changing, or a
    /// worker outside any wait using the CPU (docs/hangs.md). A hang is reported with every
    /// rank's stack, grouped, and the odd rank named (`--on-hang`). The job's first node
    /// sets it. Default: 5m (or muster_hang_timeout in --config-file); off when
    /// --sample-stacks is 0.
    #[arg(long, value_name = "DURATION", value_parser = super::values::parse_limit)]
    pub hang_timeout: Option<super::values::Limit>,

    /// What a hang does: `report` (print and record the grouped stacks; the job goes on),
    /// `fail` (end the job with the report as its root cause, exit status 4) or `restart`
    /// (restart the job, counted against --max-restarts). Default: report (or muster_on_hang
    /// in --config-file).
    #[arg(long, value_name = "ACTION", value_parser = OnHang::parse)]
    pub on_hang: Option<OnHang>,

    /// How often the agent samples its workers' stacks (times a second; 0: only on demand).
    /// Samples tell progress (the hang timeout) and the share of time each rank waits; a
    /// sample reads the worker's memory without stopping it. Default: 2 (or
    /// muster_sample_stacks in --config-file).
    #[arg(long, value_name = "HZ")]
    pub sample_stacks: Option<f64>,

    /// Do not turn on torch's Flight Recorder. By default every worker gets
    /// TORCH_FR_BUFFER_SIZE=2000 (unless set) and torch's worker server on a socket of the
    /// agent's, so that stack dumps and hang reports show each rank's last collectives and
    /// name the rank behind the others (docs/hangs.md). Also muster_flight_recorder: false in
    /// --config-file.
    #[arg(long)]
    pub no_flight_recorder: bool,

    /// How long workers get between SIGTERM and SIGKILL when they are stopped. Default:
    /// 5000 (or --shutdown-timeout, in seconds).
    #[arg(long, value_name = "MS", alias = "grace_period_ms")]
    pub grace_period_ms: Option<u64>,

    /// Do not run the node relay. By default the agent relays its workers' barriers: they send
    /// them over a local Unix socket (MUSTER_AGENT_SOCKET), node barriers complete in the agent
    /// and each global barrier costs the coordinator one message per node. With this flag each
    /// worker sends its barriers over its own coordinator session (slower; for comparison and
    /// debugging).
    #[arg(long)]
    pub no_relay: bool,

    /// Give the workers rank 0's own torch TCPStore (on the shared MASTER_PORT of node rank
    /// 0), as under plain torchrun. By default each node's agent serves torch's store on a
    /// loopback port of its own (MASTER_ADDR=127.0.0.1, TORCHELASTIC_USE_AGENT_STORE=True),
    /// backed by the job's key-value store at the coordinator: no worker opens a store server,
    /// and the store outlives rank 0. Also MUSTER_NO_AGENT_STORE=1, or
    /// `muster_agent_store: false` in --config-file.
    #[arg(
        long,
        alias = "no_agent_store",
        env = "MUSTER_NO_AGENT_STORE",
        value_parser = torchrun::pet_bool
    )]
    pub no_agent_store: bool,

    /// Where to serve Prometheus metrics (`GET /metrics`, plain HTTP), as an IP address and
    /// port (0.0.0.0:29472): this node's workers by state, restarts, failures by cause,
    /// coordinator failovers and the relay's barrier latency. Default: none.
    #[arg(long, value_name = "IP:PORT", alias = "metrics_addr")]
    pub metrics_addr: Option<SocketAddr>,

    /// How long the rendezvous waits for MIN nodes before failing. Default: the
    /// coordinator's.
    #[arg(
        long,
        value_name = "MS",
        alias = "join_timeout_ms",
        help_heading = "Rendezvous"
    )]
    pub join_timeout_ms: Option<u64>,

    /// Once MIN nodes have joined, how long the round stays open for more (up to MAX).
    /// Default: the coordinator's.
    #[arg(
        long,
        value_name = "MS",
        alias = "last_call_ms",
        help_heading = "Rendezvous"
    )]
    pub last_call_ms: Option<u64>,

    /// torchrun's rendezvous flags (`--rdzv-*`, `--standalone`).
    #[command(flatten)]
    pub rdzv: rdzv::RdzvArgs,

    /// How long this node keeps its workers running after losing the coordinator.
    #[arg(
        long,
        value_name = "MS",
        default_value_t = 10_000,
        alias = "lease_ms",
        help_heading = "Rendezvous"
    )]
    pub lease_ms: u64,

    /// torchrun's and Accelerate's worker polling period, in seconds: checked, and not needed
    /// (the agent learns of a worker's exit as it happens).
    #[arg(
        long,
        value_name = "SECS",
        alias = "monitor_interval",
        env = "PET_MONITOR_INTERVAL",
        help_heading = "Rendezvous"
    )]
    pub monitor_interval: Option<f64>,

    /// MASTER_ADDR for the workers. Default: node rank 0's advertised address (under srun:
    /// the step's first host).
    #[arg(
        long,
        value_name = "HOST",
        alias = "master_addr",
        env = "PET_MASTER_ADDR",
        help_heading = "Rendezvous"
    )]
    pub master_addr: Option<String>,

    /// MASTER_PORT for the workers. Default (and 0): a free port on node rank 0.
    #[arg(
        long,
        value_name = "PORT",
        alias = "master_port",
        env = "PET_MASTER_PORT",
        help_heading = "Rendezvous"
    )]
    pub master_port: Option<u16>,

    /// The GPUs of this node the workers use: `all`, or a list of indices or GPU-/MIG- UUIDs
    /// (0,1), which then becomes their CUDA_VISIBLE_DEVICES. Default: all, leaving
    /// CUDA_VISIBLE_DEVICES as the agent has it.
    #[arg(
        long,
        value_name = "all|ID,...",
        alias = "gpu_ids",
        help_heading = "GPUs"
    )]
    pub gpu_ids: Option<String>,

    /// How a worker finds its GPU. Default: local-rank (one-per-process with
    /// --virtual-local-rank).
    #[arg(
        long,
        value_enum,
        value_name = "MAPPING",
        alias = "gpu_mapping",
        help_heading = "GPUs"
    )]
    pub gpu_mapping: Option<GpuMapping>,

    /// Where the workers' output goes (console prefix, log files, filters).
    #[command(flatten)]
    pub output: output::OutputArgs,

    /// An Accelerate config file (the YAML or JSON `accelerate config` writes): its
    /// num_processes, num_machines, machine_rank, main_process_ip, main_process_port, gpu_ids,
    /// mixed_precision, use_cpu, debug, enable_cpu_affinity, max_restarts (and muster's own
    /// muster_agent_store and muster_recovery) are used, and its
    /// distributed_type and fsdp_config, deepspeed_config, megatron_lm_config, dynamo_config,
    /// fp8_config and parallelism_config as the flags of the same names; flags override it;
    /// what muster cannot honour is named in a warning.
    #[arg(
        long,
        value_name = "PATH",
        alias = "config_file",
        help_heading = "Accelerate compatibility"
    )]
    pub config_file: Option<PathBuf>,

    /// Processes across all machines (per node: TOTAL / the number of machines).
    #[arg(
        long = "num_processes",
        value_name = "TOTAL",
        alias = "num-processes",
        help_heading = "Accelerate compatibility"
    )]
    pub num_processes: Option<u32>,

    /// The number of machines (--nnodes N).
    #[arg(
        long = "num_machines",
        value_name = "N",
        alias = "num-machines",
        help_heading = "Accelerate compatibility"
    )]
    pub num_machines: Option<u32>,

    /// This machine's rank (--node-rank).
    #[arg(
        long = "machine_rank",
        value_name = "R",
        alias = "machine-rank",
        help_heading = "Accelerate compatibility"
    )]
    pub machine_rank: Option<u32>,

    /// Machine rank 0's address (--master-addr).
    #[arg(
        long = "main_process_ip",
        value_name = "HOST",
        alias = "main-process-ip",
        help_heading = "Accelerate compatibility"
    )]
    pub main_process_ip: Option<String>,

    /// The port on machine rank 0 (--master-port).
    #[arg(
        long = "main_process_port",
        value_name = "PORT",
        alias = "main-process-port",
        help_heading = "Accelerate compatibility"
    )]
    pub main_process_port: Option<u16>,

    /// ACCELERATE_MIXED_PRECISION for the workers: no, fp16, bf16 or fp8.
    #[arg(
        long,
        value_name = "MODE",
        alias = "mixed_precision",
        value_parser = parse_mixed_precision,
        help_heading = "Accelerate compatibility"
    )]
    pub mixed_precision: Option<String>,

    /// Train on CPU (ACCELERATE_USE_CPU=True).
    #[arg(
        long,
        visible_alias = "use_cpu",
        alias = "use-cpu",
        help_heading = "Accelerate compatibility"
    )]
    pub cpu: bool,

    /// Accepted for compatibility, no effect: the workers get the distributed environment
    /// anyway.
    #[arg(
        long = "multi_gpu",
        alias = "multi-gpu",
        help_heading = "Accelerate compatibility"
    )]
    pub multi_gpu: bool,

    /// Accelerate's debug checks in the workers (ACCELERATE_DEBUG_MODE=true).
    #[arg(long, help_heading = "Accelerate compatibility")]
    pub debug: bool,

    /// Accelerate pins each worker to the CPUs near its GPU (ACCELERATE_CPU_AFFINITY=1).
    #[arg(
        long = "enable_cpu_affinity",
        alias = "enable-cpu-affinity",
        help_heading = "Accelerate compatibility"
    )]
    pub enable_cpu_affinity: bool,

    /// `accelerate launch`'s other flags (`--use_fsdp`, `--dynamo_backend`, `-q`, `--tpu`, ...).
    #[command(flatten)]
    pub accelerate_flags: accelerate_flags::AccelerateFlags,

    /// torchrun's flags without a muster spelling (`-m`, `--no-python`, `--role`, ...).
    #[command(flatten)]
    pub torchrun: torchrun::TorchrunArgs,

    /// TLS and authentication towards the coordinator (`--tls-*`, `--auth-token-file`).
    #[command(flatten)]
    pub security: SecurityArgs,

    /// The training script or program, then its arguments (`--` before it is optional). A
    /// Python script (`train.py`) runs with the first python3 or python in PATH (or
    /// MUSTER_PYTHON), as torchrun runs it with its own; any other program runs directly.
    #[arg(value_name = "PROGRAM", trailing_var_arg = true)]
    pub command: Vec<OsString>,
}

impl LaunchArgs {
    /// The flags of a launch that gives none: clap's defaults and the `PET_*` variables, as
    /// for `muster-agent launch` alone. A job placed on a daemon agent starts from these
    /// ([`super::daemon_args::ServeArgs::launch_args`]), so a flag it does not set means
    /// there what it means on the command line.
    pub fn defaults() -> Result<Self, String> {
        let command = Self::augment_args(clap::Command::new("launch")).no_binary_name(true);
        command
            .try_get_matches_from(std::iter::empty::<OsString>())
            .and_then(|m| Self::from_arg_matches(&m))
            .map_err(|e| super::first_line(&e.to_string()))
    }
}

/// `--nproc-per-node`: a count, or one of torchrun's words for "as many as there are".
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Nproc {
    /// This many.
    Count(u32),
    /// One per GPU.
    Gpu,
    /// One per CPU core the agent may use.
    Cpu,
    /// `Gpu` on a machine with GPUs, else `Cpu`.
    Auto,
}

fn parse_nproc(s: &str) -> Result<Nproc, String> {
    match s {
        "gpu" => Ok(Nproc::Gpu),
        "cpu" => Ok(Nproc::Cpu),
        "auto" => Ok(Nproc::Auto),
        n => n
            .parse()
            .map(Nproc::Count)
            .map_err(|_| "expected a number, gpu, cpu or auto".to_owned()),
    }
}

fn parse_mixed_precision(s: &str) -> Result<String, String> {
    accelerate_config::mixed_precision(s)
}
