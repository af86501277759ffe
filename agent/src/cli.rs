//! The command line: clap definitions, and their validation into a [`LaunchSpec`] before
//! anything is started. Every problem found here is a [`UsageError`]: one line, exit status 2.
//!
//! A setting can come from torchrun's flag (muster's own spelling) or torchrun's `PET_<NAME>`
//! variable for it, from Accelerate's spelling of it, from an Accelerate config file
//! (`--config-file`), from the Slurm step `srun` started the agent in ([`slurm`]), or from its
//! default, in that order. torchrun's flags without a muster spelling are in [`torchrun`].
//! Two flags that set one thing differently are an error naming both; a flag beats the file.

use crate::accelerate_config::{self, AccelerateConfig, ConfigError};
use crate::env::WorkerOptions;
use crate::gpu::{self, Discovery, GpuError, GpuIds, GpuMapping, GpuPlan};
use crate::program::{Program, ProgramError, PythonChoice};
use crate::security::{Security, SecurityArgs};
use crate::worker::OutputSpec;

pub mod accelerate_flags;
pub mod output;
pub mod rdzv;
pub mod slurm;
pub mod torchrun;
use clap::{Args, Parser, Subcommand};
use muster_core::model::{self, JobId};
use std::ffi::{OsStr, OsString};
use std::fmt::Display;
use std::net::{Ipv6Addr, SocketAddr};
use std::path::PathBuf;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// `muster-agent`: one per machine; joins a job's rendezvous and runs the machine's workers.
#[derive(Debug, Parser)]
#[command(name = "muster-agent", version, about, long_about = None)]
pub struct Cli {
    /// What to do.
    #[command(subcommand)]
    pub command: Command,
}

/// The agent's subcommands.
// Parsed once per process: boxing the big flag sets would buy nothing.
#[allow(clippy::large_enum_variant)]
#[derive(Debug, Subcommand)]
pub enum Command {
    /// Join a job's rendezvous and run this node's workers until they finish.
    Launch(LaunchArgs),
    /// Run as this machine's daemon agent: register with the coordinator and run the jobs it
    /// places here.
    Serve(crate::daemon::ServeArgs),
    /// Submit a job to the coordinator's daemon agents.
    Submit(crate::daemon::SubmitArgs),
    /// Show the coordinator's jobs and agents, or one job.
    Status(crate::daemon::StatusArgs),
    /// Cancel a job: its workers are stopped on every node.
    Cancel(crate::daemon::CancelArgs),
}

/// The coordinator port a multi-node job's agents dial when only Accelerate's
/// `main_process_ip` names the main machine.
pub const DEFAULT_COORDINATOR_PORT: u16 = muster_proto::DEFAULT_COORDINATOR_PORT;
/// How long stopped workers get between SIGTERM and SIGKILL without --grace-period-ms or
/// --shutdown-timeout.
const DEFAULT_GRACE_PERIOD: Duration = Duration::from_millis(5000);
/// MASTER_PORT as Accelerate and torchrun default it (used to name a derived job id).
const ACCELERATE_MAIN_PORT: u16 = 29500;

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
        default_value_t = 30_000,
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
    /// mixed_precision, use_cpu, debug, enable_cpu_affinity and max_restarts are used, and its
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
    /// config file ([`accelerate_flags::Resolved::env`]).
    pub accelerate_env: Vec<(&'static str, String)>,
    /// `-q`: the agent leaves out its informational lines.
    pub quiet: bool,
    /// Whether to run the node relay (not `--no-relay`).
    pub relay: bool,
    /// `--metrics-addr`: where to serve Prometheus metrics; `None`: nowhere.
    pub metrics_addr: Option<SocketAddr>,
    /// `--role`: the workers' ROLE_NAME.
    pub role: String,
    /// `--virtual-local-rank`: LOCAL_RANK=0 for every worker.
    pub virtual_local_rank: bool,
    /// Set when this agent may host the coordinator at `coordinator` (one `HOST:PORT`): it
    /// binds it if its machine can, else dials (see `launch::place_coordinator`).
    pub self_host: Option<rdzv::SelfHost>,
    /// TLS and the cluster token for the coordinator given (plaintext for the embedded one);
    /// its `Debug` hides the token.
    pub security: Security,
    /// The worker program, resolved on `PATH`.
    pub program: Program,
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
        }
    }
}

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

/// What the command line asks for.
// Made once per process and matched right away: boxing the spec would buy nothing.
#[allow(clippy::large_enum_variant)]
#[derive(Debug)]
pub enum Parsed {
    /// Launch a job.
    Launch(LaunchSpec),
    /// A daemon-mode or operator command (`serve`, `submit`, `status`, `cancel`).
    Daemon(crate::daemon::Request),
    /// Help or version was asked for (and printed); exit with this status.
    Exit(i32),
}

/// What validation reads besides the arguments: the agent's environment and machine.
#[derive(Debug, Clone, Default)]
pub struct Context<'a> {
    /// `PATH`, to resolve the program.
    pub path_var: Option<&'a OsStr>,
    /// The GPUs found.
    pub gpus: Discovery,
    /// The agent's own `CUDA_VISIBLE_DEVICES`.
    pub cuda_visible_devices: Option<String>,
    /// CPU cores the agent may use (`--nproc-per-node cpu`).
    pub cpus: u32,
    /// The agent's own `OMP_NUM_THREADS`: without it, several workers per node get 1.
    pub omp_num_threads: Option<String>,
    /// The interpreter for Python scripts (`MUSTER_PYTHON`, `PYTHON_EXEC`, else `PATH`).
    pub python: PythonChoice,
    /// The `SLURM_*` variables, for the defaults under `srun`.
    pub slurm: slurm::SlurmEnv,
}

impl<'a> Context<'a> {
    /// This process's context, with `PATH` = `path_var`.
    pub fn of_process(path_var: Option<&'a OsStr>) -> Self {
        Self {
            path_var,
            gpus: gpu::probe(),
            cuda_visible_devices: std::env::var(gpu::VISIBLE_DEVICES_ENV).ok(),
            cpus: std::thread::available_parallelism()
                .map_or(1, |n| u32::try_from(n.get()).unwrap_or(u32::MAX)),
            omp_num_threads: std::env::var(crate::env::OMP_NUM_THREADS).ok(),
            python: PythonChoice::from_vars(|name| std::env::var_os(name)),
            slurm: slurm::SlurmEnv::of_process(),
        }
    }
}

/// Parses and validates the command line (`args` includes the program name) against the
/// `PATH` given and this machine. Help and version requests are printed here, and so are
/// warnings (`muster-agent: warning: ...` on stderr) when the command line is valid.
pub fn parse<I, T>(args: I, path_var: Option<&OsStr>) -> Result<Parsed, UsageError>
where
    I: IntoIterator<Item = T>,
    T: Into<OsString> + Clone,
{
    let (parsed, warnings) = parse_in(args, &Context::of_process(path_var))?;
    print_messages(&warnings);
    Ok(parsed)
}

/// Marks a message of the warnings list as a note: something accepted that has no effect, or
/// a default taken from the environment; printed as `muster-agent: note: ...`.
pub const NOTE: &str = "note: ";

/// `text` as a note for the warnings list.
pub fn note(text: &str) -> String {
    format!("{NOTE}{text}")
}

/// Prints warnings (`muster-agent: warning: ...`) and notes (`muster-agent: note: ...`).
fn print_messages(messages: &[String]) {
    for m in messages {
        match m.strip_prefix(NOTE) {
            Some(n) => eprintln!("muster-agent: note: {n}"),
            None => eprintln!("muster-agent: warning: {m}"),
        }
    }
}

/// argparse drops a `--` right after torchrun's script when none came before it
/// (`torchrun train.py -- --lr 1` gives `sys.argv == ["train.py", "--lr", "1"]`); clap keeps
/// it. `raw` is the whole command line, which ends with `command`.
fn drop_argparse_separator(raw: &[OsString], command: &mut Vec<OsString>) {
    let before = raw
        .len()
        .checked_sub(command.len() + 1)
        .and_then(|i| raw.get(i));
    if before.is_some_and(|a| a != "--") && command.get(1).is_some_and(|a| a == "--") {
        command.remove(1);
    }
}

/// [`parse`] in a given context, returning the warnings instead of printing them.
pub fn parse_in<I, T>(args: I, ctx: &Context<'_>) -> Result<(Parsed, Vec<String>), UsageError>
where
    I: IntoIterator<Item = T>,
    T: Into<OsString> + Clone,
{
    let raw: Vec<OsString> = args.into_iter().map(Into::into).collect();
    let cli = match Cli::try_parse_from(&raw) {
        Ok(cli) => cli,
        Err(e) => {
            use clap::error::ErrorKind;
            return match e.kind() {
                ErrorKind::DisplayHelp
                | ErrorKind::DisplayVersion
                | ErrorKind::DisplayHelpOnMissingArgumentOrSubcommand => {
                    let code = e.exit_code();
                    // Nothing useful to do when stdout is gone.
                    let _ = e.print();
                    Ok((Parsed::Exit(code), Vec::new()))
                }
                _ => Err(UsageError::Parse(first_line(&e.to_string()))),
            };
        }
    };
    match cli.command {
        Command::Launch(mut args) => {
            if let Some(note) = args.torchrun.completion_note() {
                return Ok((Parsed::Exit(1), vec![note]));
            }
            drop_argparse_separator(&raw, &mut args.command);
            args.validate_in(ctx)
                .map(|(spec, warnings)| (Parsed::Launch(spec), warnings))
        }
        Command::Serve(a) => {
            crate::daemon::pairs("--labels", &a.labels).map_err(UsageError::Invalid)?;
            a.security.resolve().map_err(UsageError::Invalid)?;
            Ok((Parsed::Daemon(crate::daemon::Request::Serve(a)), vec![]))
        }
        Command::Submit(a) => {
            a.check().map_err(UsageError::Invalid)?;
            a.security.resolve().map_err(UsageError::Invalid)?;
            Ok((Parsed::Daemon(crate::daemon::Request::Submit(a)), vec![]))
        }
        Command::Status(a) => {
            a.security.resolve().map_err(UsageError::Invalid)?;
            Ok((Parsed::Daemon(crate::daemon::Request::Status(a)), vec![]))
        }
        Command::Cancel(a) => {
            a.security.resolve().map_err(UsageError::Invalid)?;
            Ok((Parsed::Daemon(crate::daemon::Request::Cancel(a)), vec![]))
        }
    }
}

/// Clap's message on one line, without the `error: ` label, the usage block and the help
/// hint; the indented lines right under the first (a list of missing arguments, the possible
/// values) are kept.
fn first_line(message: &str) -> String {
    let mut lines = message.lines();
    let first = lines.next().unwrap_or_default();
    let mut line = first
        .strip_prefix("error: ")
        .unwrap_or(first)
        .trim()
        .to_owned();
    let more: Vec<&str> = lines
        .take_while(|l| l.starts_with(char::is_whitespace) && !l.trim().is_empty())
        .map(str::trim)
        .collect();
    if !more.is_empty() {
        let separator = if line.ends_with(':') { ", " } else { " " };
        line = format!("{line} {}", more.join(separator));
    }
    line
}

/// A setting's value and how to name where it came from (`--num_machines 2`,
/// `num_machines 2 in 'accelerate.yaml'`).
#[derive(Debug, Clone)]
struct Given<T> {
    value: T,
    name: String,
}

impl<T: PartialEq> Given<T> {
    fn flag(flag: &str, value: Option<T>, shown: impl Fn(&T) -> String) -> Option<Self> {
        value.map(|value| Self {
            name: format!("{flag} {}", shown(&value)),
            value,
        })
    }

    /// The one of two flags given; both and different: a conflict naming both.
    fn either(a: Option<Self>, b: Option<Self>) -> Result<Option<Self>, UsageError> {
        match (a, b) {
            (Some(a), Some(b)) if a.value != b.value => Err(UsageError::Conflict(a.name, b.name)),
            (a, b) => Ok(a.or(b)),
        }
    }
}

/// Names a config file's setting in messages.
struct FileNamer<'a>(Option<&'a str>);

impl FileNamer<'_> {
    fn given<T>(
        &self,
        key: &str,
        value: Option<T>,
        shown: impl Fn(&T) -> String,
    ) -> Option<Given<T>> {
        let file = self.0?;
        value.map(|value| Given {
            name: format!("{key} {} in '{file}'", shown(&value)),
            value,
        })
    }
}

impl LaunchArgs {
    /// Checks everything that can be checked before starting, in this process's context
    /// (see [`Context::of_process`]); warnings are printed.
    pub fn validate(self, path_var: Option<&OsStr>) -> Result<LaunchSpec, UsageError> {
        let (spec, warnings) = self.validate_in(&Context::of_process(path_var))?;
        print_messages(&warnings);
        Ok(spec)
    }

    /// Checks everything that can be checked before starting: the config file, ranges,
    /// formats, conflicts, GPUs against the machine's, and that the program resolves on
    /// `ctx.path_var` to an executable file. Returns the spec and warnings to print.
    pub fn validate_in(
        mut self,
        ctx: &Context<'_>,
    ) -> Result<(LaunchSpec, Vec<String>), UsageError> {
        let mut warnings = Vec::new();
        let shown_file = self
            .config_file
            .as_ref()
            .map(|p| p.to_string_lossy().into_owned());
        let config = match &self.config_file {
            Some(path) => {
                let file = shown_file.clone().unwrap_or_default();
                let config = accelerate_config::load(path).map_err(|error| UsageError::Config {
                    file: file.clone(),
                    error,
                })?;
                warnings.extend(
                    config
                        .warnings
                        .iter()
                        .map(|w| format!("--config-file '{file}': {w}")),
                );
                config
            }
            None => AccelerateConfig::default(),
        };
        let file = FileNamer(shown_file.as_deref());
        let num = |n: &u32| n.to_string();

        // A Slurm step's defaults, for what neither the flags (nor PET_*) nor the file say.
        let slurm = match ctx.slurm.defaults() {
            Ok(defaults) => defaults,
            Err(e) if self.nnodes.is_none() && self.node_rank.is_none() => {
                return Err(UsageError::Invalid(e));
            }
            Err(_) => None,
        };

        // Nodes.
        let nnodes = match &self.nnodes {
            Some(s) => Some(Given {
                value: parse_nnodes(s)?,
                name: format!("--nnodes {s}"),
            }),
            None => None,
        };
        let machines = |n: u32| NodeRange { min: n, max: n };
        let flag_machines = Given::flag("--num_machines", self.num_machines, num);
        if let Some(m) = &flag_machines
            && (m.value == 0 || m.value > model::MAX_NODES)
        {
            return Err(UsageError::Invalid(format!(
                "{} is out of range 1..={}",
                m.name,
                model::MAX_NODES
            )));
        }
        let flag_machines = flag_machines.map(|m| Given {
            value: machines(m.value),
            name: m.name,
        });
        let nodes = Given::either(nnodes, flag_machines)?
            .or_else(|| {
                file.given("num_machines", config.num_machines, num)
                    .map(|g| Given {
                        value: machines(g.value),
                        name: g.name,
                    })
            })
            .or_else(|| {
                slurm.as_ref().map(|s| Given {
                    value: machines(s.nnodes),
                    name: format!("SLURM_NNODES {}", s.nnodes),
                })
            })
            .unwrap_or(Given {
                value: NodeRange { min: 1, max: 1 },
                name: "--nnodes 1".to_owned(),
            });

        // Node rank.
        let node_rank = Given::either(
            Given::flag("--node-rank", self.node_rank, num),
            Given::flag("--machine_rank", self.machine_rank, num),
        )?
        .or_else(|| file.given("machine_rank", config.machine_rank, num))
        .or_else(|| {
            slurm.as_ref().map(|s| Given {
                value: s.node_rank,
                name: format!("SLURM_NODEID {}", s.node_rank),
            })
        });
        if let Some(rank) = &node_rank
            && rank.value >= nodes.value.max
        {
            return Err(UsageError::NodeRank {
                rank: rank.name.clone(),
                nodes: nodes.name.clone(),
                max: nodes.value.max,
            });
        }

        // GPUs (before the worker count: `--nproc-per-node gpu` counts them).
        let gpu_ids = match &self.gpu_ids {
            Some(s) => Some(Given {
                value: GpuIds::parse("--gpu-ids", s).map_err(UsageError::Invalid)?,
                name: format!("--gpu-ids {s}"),
            }),
            None => file.given("gpu_ids", config.gpu_ids.clone(), |ids| match ids {
                GpuIds::All => "all".to_owned(),
                GpuIds::List(l) => l.join(","),
            }),
        };
        let inherited = ctx.cuda_visible_devices.as_deref();
        let ids = gpu_ids.as_ref().map_or(GpuIds::All, |g| g.value.clone());

        // Workers per node, and where their output goes.
        let nproc = self.workers_per_node(&config, &file, &nodes, &ids, ctx)?;
        // torchrun's OMP_NUM_THREADS warning, once per launch, unless the thread count is given
        // (the user's variable, or `--num_cpu_threads_per_process`: decided below).
        let omp_warning_at = (nproc > 1 && ctx.omp_num_threads.is_none()).then_some(warnings.len());
        warnings.extend(self.torchrun.notes());
        let output = self.output.validate(nproc)?;
        warnings.extend(self.output.notes());

        // Accelerate's settings.
        let use_cpu = if self.cpu {
            Some("--cpu".to_owned())
        } else if config.use_cpu == Some(true) {
            file.given("use_cpu", Some(true), bool::to_string)
                .map(|g| g.name)
        } else {
            None
        };
        if let (Some(cpu), Some(ids)) = (&use_cpu, &gpu_ids)
            && matches!(ids.value, GpuIds::List(_))
        {
            return Err(UsageError::Conflict(cpu.clone(), ids.name.clone()));
        }
        // torchrun's --virtual-local-rank is one GPU per process with LOCAL_RANK=0.
        let virtual_local_rank = self.torchrun.virtual_local_rank;
        let mapping = match (self.gpu_mapping, virtual_local_rank) {
            (Some(GpuMapping::LocalRank), true) => {
                return Err(UsageError::Conflict(
                    "--gpu-mapping local-rank".to_owned(),
                    "--virtual-local-rank".to_owned(),
                ));
            }
            (Some(mapping), _) => mapping,
            (None, true) => GpuMapping::OnePerProcess,
            (None, false) => GpuMapping::default(),
        };
        let implied = |m: String| {
            if virtual_local_rank && self.gpu_mapping.is_none() {
                m.replace("--gpu-mapping one-per-process", "--virtual-local-rank")
            } else {
                m
            }
        };
        let (gpus, gpu_warnings) = GpuPlan::resolve(&ids, mapping, nproc, &ctx.gpus, inherited)
            .map_err(|e| match (&e, &gpu_ids) {
                (GpuError::NoSuchGpu { .. }, Some(ids)) => {
                    UsageError::Invalid(format!("{}: {e}", ids.name))
                }
                _ => UsageError::Invalid(implied(e.to_string())),
            })?;
        warnings.extend(gpu_warnings.into_iter().map(implied));

        // How long stopped workers get before SIGKILL.
        let grace_period = Given::either(
            Given::flag(
                "--grace-period-ms",
                self.grace_period_ms.map(Duration::from_millis),
                |d| d.as_millis().to_string(),
            ),
            Given::flag(
                "--shutdown-timeout",
                self.torchrun.shutdown_timeout.map(Duration::from_secs),
                |d| d.as_secs().to_string(),
            ),
        )?
        .map_or(DEFAULT_GRACE_PERIOD, |g| g.value);
        // Flags only `accelerate launch` has, or its config file: the workers then get what
        // Accelerate's launcher always sets.
        let accelerate = self.config_file.is_some()
            || self.num_processes.is_some()
            || self.num_machines.is_some()
            || self.machine_rank.is_some()
            || self.main_process_ip.is_some()
            || self.main_process_port.is_some()
            || self.mixed_precision.is_some()
            || self.cpu
            || self.multi_gpu
            || self.enable_cpu_affinity;
        let mixed_precision_from_file = self.mixed_precision.is_none();
        let mixed_precision = self.mixed_precision.or(config.mixed_precision.clone());
        // `accelerate launch`'s other flags and the file's paradigm sections.
        let (pythonpath, cwd) = (std::env::var("PYTHONPATH").ok(), std::env::current_dir());
        let cwd = cwd
            .map(|d| d.to_string_lossy().into_owned())
            .unwrap_or_default();
        let acc = self.accelerate_flags.resolve(&accelerate_flags::Inputs {
            cpu: self.cpu,
            multi_gpu: self.multi_gpu,
            mixed_precision: mixed_precision.as_deref(),
            mixed_precision_from_file: mixed_precision_from_file && mixed_precision.is_some(),
            config: &config,
            file: shown_file.as_deref(),
            pythonpath: pythonpath.as_deref(),
            cwd: &cwd,
        })?;
        warnings.extend(acc.messages.iter().cloned());
        let threads_given = acc
            .env
            .iter()
            .any(|(k, _)| *k == crate::env::OMP_NUM_THREADS);
        if let Some(at) = omp_warning_at.filter(|_| !threads_given) {
            warnings.insert(
                at,
                "Setting OMP_NUM_THREADS environment variable for each process to be 1 in \
                 default, to avoid your system being overloaded, please further tune the \
                 variable for optimal performance in your application as needed."
                    .to_owned(),
            );
        }
        let accelerate = accelerate || acc.given;
        let max_restarts = self.max_restarts.or(config.max_restarts).unwrap_or(0);
        if let Some(secs) = self.monitor_interval
            && !(secs.is_finite() && secs >= 0.0)
        {
            return Err(UsageError::Invalid(format!(
                "--monitor-interval {secs} is not a number of seconds"
            )));
        }

        // Rendezvous timing.
        let rdzv = self.rdzv.resolve(&mut warnings)?;
        let ms = |d: &Duration| d.as_millis().to_string();
        let secs = |d: &Duration| d.as_secs_f64().to_string();
        let join_timeout = Given::either(
            Given::flag(
                "--join-timeout-ms",
                self.join_timeout_ms.map(Duration::from_millis),
                ms,
            ),
            rdzv.conf.join_timeout.map(|d| Given {
                name: format!("--rdzv-conf join_timeout={}", secs(&d)),
                value: d,
            }),
        )?;
        let last_call = Given::either(
            Given::flag(
                "--last-call-ms",
                self.last_call_ms.map(Duration::from_millis),
                ms,
            ),
            rdzv.conf.last_call.map(|d| Given {
                name: format!("--rdzv-conf last_call_timeout={}", secs(&d)),
                value: d,
            }),
        )?;
        for (wait, least) in [
            (&join_timeout, Duration::from_millis(1)),
            (&last_call, Duration::ZERO),
        ] {
            if let Some(w) = wait
                && (w.value < least || w.value > model::MAX_WAIT)
            {
                return Err(UsageError::Invalid(format!(
                    "{} is out of range: {} to {} hours",
                    w.name,
                    if least.is_zero() { "0" } else { "1 ms" },
                    model::MAX_WAIT.as_secs() / 3600
                )));
            }
        }
        if self.lease_ms == 0 {
            return Err(UsageError::Invalid(
                "--lease-ms 0: a node needs some time to keep its workers without the coordinator"
                    .to_owned(),
            ));
        }

        // The main machine.
        let host = |flag: &str, v: Option<String>| -> Result<Option<Given<String>>, UsageError> {
            match v {
                Some(h) => {
                    plain_host(&h).map_err(|why| UsageError::Invalid(format!("{flag} {why}")))?;
                    Ok(Given::flag(flag, Some(h), Clone::clone))
                }
                None => Ok(None),
            }
        };
        let master_addr = Given::either(
            host("--master-addr", self.master_addr)?,
            host("--main_process_ip", self.main_process_ip)?,
        )?
        .or_else(|| {
            file.given(
                "main_process_ip",
                config.main_process_ip.clone(),
                Clone::clone,
            )
        })
        .or_else(|| {
            slurm
                .as_ref()
                .filter(|_| nodes.value.max > 1)
                .map(|s| Given {
                    value: s.master_addr.clone(),
                    name: format!("the Slurm step's first host {}", s.master_addr),
                })
        });
        let advertise_addr = Given::either(
            host("--advertise-addr", self.advertise_addr.clone())?,
            host("--local-addr", self.torchrun.local_addr.clone())?,
        )?
        .map(|g| g.value);
        let port = |p: &u16| p.to_string();
        let master_port = Given::either(
            Given::flag("--master-port", self.master_port, port),
            Given::flag("--main_process_port", self.main_process_port, port),
        )?
        .or_else(|| file.given("main_process_port", config.main_process_port, port))
        .map(|p| p.value)
        .filter(|p| *p != 0);

        // Under srun, every node of the step derives the same job id.
        if let Some(s) = &slurm {
            let mut taken = Vec::new();
            if nodes.name.starts_with("SLURM_") {
                taken.push(format!("--nnodes {}", s.nnodes));
            }
            if node_rank
                .as_ref()
                .is_some_and(|r| r.name.starts_with("SLURM_"))
            {
                taken.push(format!("--node-rank {}", s.node_rank));
            }
            if master_addr
                .as_ref()
                .is_some_and(|a| a.name.starts_with("the Slurm"))
            {
                taken.push(format!("--master-addr {}", s.master_addr));
            }
            if self.job_id.is_none() && rdzv.job_id.is_none() {
                self.job_id = Some(s.job_id.clone());
                taken.push(format!("--job-id {}", s.job_id));
            }
            if !taken.is_empty() {
                warnings.push(note(&format!(
                    "Slurm step: {} (flags and PET_* variables override these)",
                    taken.join(" ")
                )));
            }
        }

        // Where the job is coordinated, and under which id.
        let given_coordinator = match &self.coordinator {
            Some(c) => Some(coordinator_list(c)?),
            None => None,
        };
        if Duration::from_millis(self.failover_timeout_ms) > model::MAX_WAIT {
            return Err(UsageError::Invalid(format!(
                "--failover-timeout-ms {} is out of range: 0 to {} hours",
                self.failover_timeout_ms,
                model::MAX_WAIT.as_secs() / 3600
            )));
        }
        let multi_node = nodes.value.max > 1;
        if rdzv.standalone {
            if let Some(c) = &given_coordinator {
                return Err(UsageError::Conflict(
                    "--standalone".to_owned(),
                    format!("--coordinator {c}"),
                ));
            }
            if multi_node {
                return Err(UsageError::Invalid(format!(
                    "--standalone conflicts with {}: a standalone job has one node",
                    nodes.name
                )));
            }
        }
        // Without --coordinator, the rendezvous endpoint (or the main machine's address, port
        // 29470, for a multi-node job) is hosted by the agent whose machine can bind it.
        let endpoint = match (&given_coordinator, &rdzv.endpoint) {
            (Some(_), Some((host, port))) => {
                warnings.push(torchrun::no_effect(
                    &format!("--rdzv-endpoint {}", host_port(host, *port)),
                    "--coordinator names the coordinator",
                ));
                None
            }
            (_, endpoint) => endpoint.clone(),
        };
        let (coordinator, hosted) = match (given_coordinator, &endpoint, &master_addr) {
            (Some(c), _, _) => (Some(c), false),
            (None, Some((host, port)), _) => (Some(host_port(host, *port)), true),
            (None, None, Some(addr)) if multi_node => {
                (Some(host_port(&addr.value, DEFAULT_COORDINATOR_PORT)), true)
            }
            (None, None, _) if multi_node => {
                return Err(UsageError::MultiNode(
                    nodes.name,
                    "--coordinator (or --rdzv-endpoint, or the main machine's address: --master-addr, --main_process_ip)",
                ));
            }
            (None, None, _) => (None, false),
        };
        let self_host = match (hosted, rdzv.conf.is_host) {
            (false, Some(_)) | (true, Some(false)) | (false, None) => None,
            (true, must) => {
                let must = must == Some(true);
                let at = coordinator.clone().unwrap_or_default();
                match rdzv::server_security(&self.security) {
                    Ok(secured) => Some(rdzv::SelfHost { must, secured }),
                    Err(missing) if must => {
                        return Err(UsageError::Invalid(format!(
                            "--rdzv-conf is_host=1: hosting the rendezvous at {at} securely needs {missing}"
                        )));
                    }
                    Err(missing) => {
                        warnings.push(note(&format!(
                            "this agent does not host the rendezvous at {at}: serving it securely needs {missing} (it dials)"
                        )));
                        None
                    }
                }
            }
        };
        let job_id = Given::either(
            Given::flag("--job-id", self.job_id, Clone::clone),
            rdzv.job_id.map(|id| Given {
                name: format!("--rdzv-id {id}"),
                value: id,
            }),
        )?
        .map(|g| g.value);
        let job_id = match (job_id, &endpoint, &master_addr) {
            (Some(id), _, _) => JobId::parse(&id)
                .map_err(|e| UsageError::JobId(e.0))?
                .as_str()
                .to_owned(),
            (None, Some((host, port)), _) => derived_job_id(host, *port),
            (None, None, Some(addr)) if multi_node => {
                derived_job_id(&addr.value, master_port.unwrap_or(ACCELERATE_MAIN_PORT))
            }
            (None, None, _) if multi_node => {
                return Err(UsageError::MultiNode(
                    nodes.name,
                    "--job-id (or --rdzv-id, or the main machine's address: --master-addr, --main_process_ip)",
                ));
            }
            (None, None, _) => fresh_job_id(),
        };
        if let Some(h) = &self.advertise_addr {
            plain_host(h).map_err(|why| UsageError::Invalid(format!("--advertise-addr {why}")))?;
        }
        let mut security = self.security.resolve().map_err(UsageError::Invalid)?;
        if coordinator.is_none() && self.security.any() {
            warnings.push(
                "--tls-* and --auth-token-file have no use without --coordinator: the agent's \
                 own coordinator listens on 127.0.0.1 without TLS or authentication"
                    .to_owned(),
            );
            security = Security::plaintext();
        }

        if self.command.is_empty() {
            return Err(UsageError::NoProgram);
        }
        let form = self.torchrun.form()?;
        let mut program = Program::for_launch(form, self.command, &ctx.python, ctx.path_var)?;
        program.env.extend(acc.extra_env);
        let spec = LaunchSpec {
            nproc_per_node: nproc,
            coordinator,
            self_host,
            failover_timeout: Duration::from_millis(self.failover_timeout_ms),
            job_id,
            nodes: nodes.value,
            node_rank: node_rank.map(|r| r.value),
            advertise_addr,
            grace_period,
            max_restarts,
            join_timeout: join_timeout.map(|g| g.value),
            last_call: last_call.map(|g| g.value),
            lease: Duration::from_millis(self.lease_ms),
            master_addr: master_addr.map(|g| g.value),
            master_port,
            gpus,
            output,
            mixed_precision,
            use_cpu: use_cpu.is_some(),
            debug: self.debug || config.debug == Some(true),
            cpu_affinity: self.enable_cpu_affinity || config.enable_cpu_affinity == Some(true),
            accelerate,
            accelerate_env: acc.env,
            quiet: acc.quiet,
            relay: !self.no_relay,
            metrics_addr: self.metrics_addr,
            role: self
                .torchrun
                .role
                .unwrap_or_else(|| crate::env::DEFAULT_ROLE.to_owned()),
            virtual_local_rank,
            security,
            program,
        };
        Ok((spec, warnings))
    }

    /// `--nproc-per-node`, or Accelerate's total (`--num_processes`, `num_processes`) divided
    /// by the node count; 1 when nothing says.
    fn workers_per_node(
        &self,
        config: &AccelerateConfig,
        file: &FileNamer<'_>,
        nodes: &Given<NodeRange>,
        ids: &GpuIds,
        ctx: &Context<'_>,
    ) -> Result<u32, UsageError> {
        let per_node = |total: &Given<u32>| -> Result<u32, UsageError> {
            let NodeRange { min, max } = nodes.value;
            if min != max {
                return Err(UsageError::Invalid(format!(
                    "{} is a total across machines: it needs a fixed number of machines, not {}",
                    total.name, nodes.name
                )));
            }
            if !total.value.is_multiple_of(max) {
                return Err(UsageError::Invalid(format!(
                    "{} is not a multiple of {}",
                    total.name, nodes.name
                )));
            }
            let n = total.value / max;
            if n == 0 || n > model::MAX_LOCAL_WORLD_SIZE {
                return Err(UsageError::Invalid(format!(
                    "{} over {} is {n} workers per node, out of range 1..={}",
                    total.name,
                    nodes.name,
                    model::MAX_LOCAL_WORLD_SIZE
                )));
            }
            Ok(n)
        };
        let total = Given::flag("--num_processes", self.num_processes, |n| n.to_string());
        let Some(nproc) = self.nproc_per_node else {
            return match total {
                Some(total) => per_node(&total),
                None => {
                    match file.given("num_processes", config.num_processes, |n| n.to_string()) {
                        Some(total) => per_node(&total),
                        None => Ok(1),
                    }
                }
            };
        };
        let gpus = || gpu::candidates(ids, &ctx.gpus, ctx.cuda_visible_devices.as_deref()).len();
        let counted = |n: usize, what: &str| {
            u32::try_from(n).ok().filter(|n| *n > 0).ok_or_else(|| {
                UsageError::Invalid(format!(
                    "--nproc-per-node {what}: {}",
                    match what {
                        "gpu" => "no GPU found on this machine",
                        _ => "no CPU core available",
                    }
                ))
            })
        };
        let n = match nproc {
            Nproc::Count(n) => n,
            Nproc::Gpu => counted(gpus(), "gpu")?,
            Nproc::Cpu => counted(ctx.cpus as usize, "cpu")?,
            Nproc::Auto => match gpus() {
                0 => counted(ctx.cpus as usize, "cpu")?,
                n => counted(n, "gpu")?,
            },
        };
        if n == 0 || n > model::MAX_LOCAL_WORLD_SIZE {
            return Err(UsageError::NprocPerNode(n));
        }
        if let Some(total) = total {
            let agrees = nodes.value.min == nodes.value.max
                && u64::from(n) * u64::from(nodes.value.max) == u64::from(total.value);
            if !agrees {
                return Err(UsageError::Conflict(
                    format!("--nproc-per-node {n}"),
                    format!("{} (with {})", total.name, nodes.name),
                ));
            }
        }
        Ok(n)
    }
}

/// Checks a host name or IP address given without a port (`--advertise-addr`,
/// `--master-addr`, `main_process_ip`); the error says what is wrong with it.
pub fn plain_host(s: &str) -> Result<&str, String> {
    let bad = || format!("'{s}' must be a host name or IP address, without a port");
    if s.contains(':') {
        // Only an IPv6 address has colons.
        return s.parse::<Ipv6Addr>().map(|_| s).map_err(|_| bad());
    }
    if s.is_empty() || s.len() > 253 {
        return Err(format!("'{s}' is not a host name or IP address"));
    }
    match s
        .chars()
        .find(|c| !(c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-')))
    {
        Some(c) => Err(format!(
            "'{s}' is not a host name or IP address (it contains {c:?})"
        )),
        None => Ok(s),
    }
}

/// `host:port`, with brackets around an IPv6 address.
fn host_port(host: &str, port: u16) -> String {
    if host.contains(':') {
        format!("[{host}]:{port}")
    } else {
        format!("{host}:{port}")
    }
}

/// `s` with every character a job id cannot hold ([A-Za-z0-9._-] only) replaced by `-`, for
/// job ids derived from addresses, rendezvous ids and Slurm's variables.
pub(crate) fn job_id_chars(s: &str) -> String {
    s.chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-') {
                c
            } else {
                '-'
            }
        })
        .collect()
}

/// The job id every machine of a multi-node launch derives from the main machine's address
/// and port: `muster-<addr>-<port>`, with characters a job id cannot hold replaced by `-`.
fn derived_job_id(addr: &str, port: u16) -> String {
    let addr = job_id_chars(addr);
    let mut id = format!("muster-{addr}-{port}");
    id.truncate(128);
    id
}

/// Parses `MIN` or `MIN:MAX` with `1 <= MIN <= MAX <= MAX_NODES`.
pub fn parse_nnodes(s: &str) -> Result<NodeRange, UsageError> {
    let bad = |why| UsageError::Nnodes(s.to_owned(), why);
    let number = |part: &str| {
        part.trim()
            .parse::<u32>()
            .map_err(|_| bad("expected MIN or MIN:MAX, as in 2 or 1:4"))
    };
    let (min, max) = match s.split_once(':') {
        Some((min, max)) => (number(min)?, number(max)?),
        None => {
            let n = number(s)?;
            (n, n)
        }
    };
    if min == 0 {
        return Err(bad("a job needs at least 1 node"));
    }
    if max < min {
        return Err(bad("MAX is below MIN"));
    }
    if max > model::MAX_NODES {
        return Err(bad("more nodes than the coordinator allows (100000)"));
    }
    Ok(NodeRange { min, max })
}

/// A `--coordinator` value: one `host:port` or a comma-separated list of them; returned
/// without blanks or repeats.
pub fn coordinator_list(value: &str) -> Result<String, UsageError> {
    match crate::failover::split_list(value) {
        Some(addrs) if addrs.iter().all(|a| is_host_port(a)) => Ok(addrs.join(",")),
        _ => Err(UsageError::Coordinator(value.to_owned())),
    }
}

/// `host:port` with a non-empty host and a port in 1..=65535 (`[v6]:port` included).
fn is_host_port(s: &str) -> bool {
    let Some((host, port)) = s.rsplit_once(':') else {
        return false;
    };
    let host_ok = !host.is_empty()
        && !host.contains('/')
        && (!host.contains(':') || (host.starts_with('[') && host.ends_with(']')));
    host_ok && matches!(port.parse::<u16>(), Ok(p) if p > 0)
}

/// A job id that no other launch on this machine uses: `job-<pid>-<unix millis>`.
fn fresh_job_id() -> String {
    let millis = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis())
        .unwrap_or_default();
    format!("job-{}-{millis}", std::process::id())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gpu::GpuInfo;

    /// A machine with `gpus` GPUs (none: no driver at all), 4 CPU cores and
    /// `PATH=/usr/bin:/bin`.
    ///
    /// Its OMP_NUM_THREADS is set, so that several workers bring no warning (the one given
    /// without it is tested in `cli::torchrun`).
    pub(super) fn machine(gpus: Option<u32>) -> Context<'static> {
        Context {
            path_var: Some(OsStr::new("/usr/bin:/bin")),
            gpus: Discovery {
                gpus: (0..gpus.unwrap_or(0))
                    .map(|index| GpuInfo {
                        index,
                        name: None,
                        uuid: None,
                        bus: None,
                    })
                    .collect(),
                driver_seen: gpus.is_some(),
            },
            cuda_visible_devices: None,
            cpus: 4,
            omp_num_threads: Some("2".to_owned()),
            ..Context::default()
        }
    }

    /// The spec in one line: the original fields, then the others only where they differ
    /// from their defaults, then the warnings.
    pub(super) fn summary(s: &LaunchSpec, warnings: &[String]) -> String {
        let mut out = format!(
            "n={} nodes={}:{} rank={:?} coord={:?} job={} grace={}ms relay={} prog={} args={:?}",
            s.nproc_per_node,
            s.nodes.min,
            s.nodes.max,
            s.node_rank,
            s.coordinator,
            if s.job_id.starts_with("job-") {
                "<fresh>"
            } else {
                &s.job_id
            },
            s.grace_period.as_millis(),
            s.relay,
            s.program.name.to_string_lossy(),
            s.program.args,
        );
        let mut add = |part: String| {
            out.push(' ');
            out.push_str(&part);
        };
        if let Some(a) = &s.advertise_addr {
            add(format!("advertise={a}"));
        }
        if let Some(a) = &s.metrics_addr {
            add(format!("metrics={a}"));
        }
        if s.max_restarts > 0 {
            add(format!("restarts={}", s.max_restarts));
        }
        if let Some(d) = s.join_timeout {
            add(format!("join={}ms", d.as_millis()));
        }
        if let Some(d) = s.last_call {
            add(format!("last_call={}ms", d.as_millis()));
        }
        if s.lease != Duration::from_secs(10) {
            add(format!("lease={}ms", s.lease.as_millis()));
        }
        if s.failover_timeout != Duration::from_secs(30) {
            add(format!("failover={}ms", s.failover_timeout.as_millis()));
        }
        if s.master_addr.is_some() || s.master_port.is_some() {
            add(format!("master={:?}:{:?}", s.master_addr, s.master_port));
        }
        if s.gpus != GpuPlan::cpu() {
            add(format!(
                "gpus={}{}{}",
                s.gpus.devices.join(","),
                if s.gpus.set_visible_devices {
                    "/set"
                } else {
                    ""
                },
                if s.gpus.mapping == GpuMapping::OnePerProcess {
                    "/one-per-process"
                } else {
                    ""
                }
            ));
        }
        if let Some(d) = &s.output.log_dir {
            add(format!("log_dir={}", d.display()));
        }
        if let Some(r) = &s.output.console_ranks {
            add(format!("console={r:?}"));
        }
        if let Some(mp) = &s.mixed_precision {
            add(format!("mp={mp}"));
        }
        if !s.security.is_plaintext() {
            add(format!("{:?}", s.security));
        }
        for (on, name) in [
            (s.use_cpu, "cpu"),
            (s.debug, "debug"),
            (s.cpu_affinity, "affinity"),
        ] {
            if on {
                add(name.to_owned());
            }
        }
        if s.role != crate::env::DEFAULT_ROLE {
            add(format!("role={}", s.role));
        }
        if s.virtual_local_rank {
            add("virtual-local-rank".to_owned());
        }
        for w in warnings {
            match w.strip_prefix(NOTE) {
                Some(n) => add(format!("| note: {n}")),
                None => add(format!("| warning: {w}")),
            }
        }
        out
    }

    /// Parses `args` (after `muster-agent launch`) on `ctx` and compares the outcome:
    /// `Ok(summary)` of the spec, or `Err(message)`.
    pub(super) fn check_on(ctx: &Context<'_>, args: &str, expected: Result<&str, &str>) {
        let argv = ["muster-agent", "launch"]
            .into_iter()
            .map(str::to_owned)
            .chain(args.split_whitespace().map(str::to_owned));
        let got = match parse_in(argv, ctx) {
            Ok((Parsed::Launch(s), warnings)) => Ok(summary(&s, &warnings)),
            Ok((Parsed::Exit(code), _)) => Ok(format!("exit {code}")),
            Ok((Parsed::Daemon(r), _)) => Ok(format!("{r:?}")),
            Err(e) => Err(e.to_string()),
        };
        let got = got.as_deref().map_err(String::as_str);
        assert_eq!(got, expected, "muster-agent launch {args}");
    }

    /// [`check`] with the arguments given one by one (for values with blanks).
    fn check_args(args: &[&str], expected: Result<&str, &str>) {
        let argv = ["muster-agent", "launch"]
            .iter()
            .chain(args)
            .map(|a| (*a).to_owned());
        let got = match parse_in(argv, &machine(None)) {
            Ok((Parsed::Launch(s), warnings)) => Ok(summary(&s, &warnings)),
            Ok((other, _)) => Ok(format!("{other:?}")),
            Err(e) => Err(e.to_string()),
        };
        assert_eq!(got.as_deref().map_err(String::as_str), expected, "{args:?}");
    }

    /// [`check_on`] a machine without GPUs.
    pub(super) fn check(args: &str, expected: Result<&str, &str>) {
        check_on(&machine(None), args, expected);
    }

    #[test]
    fn valid_command_lines() {
        check(
            "--nproc-per-node 4 -- sh -c true",
            Ok(
                r#"n=4 nodes=1:1 rank=None coord=None job=<fresh> grace=5000ms relay=true prog=sh args=["-c", "true"]"#,
            ),
        );
        check(
            "--nproc_per_node=2 --grace-period-ms 10 --job-id a.b-c_1 sh",
            Ok(
                r#"n=2 nodes=1:1 rank=None coord=None job=a.b-c_1 grace=10ms relay=true prog=sh args=[]"#,
            ),
        );
        check(
            "--nproc-per-node 1 --nnodes 2:4 --node-rank 3 --coordinator 10.0.0.1:29470 --job-id j -- sh -x --flag",
            Ok(
                r#"n=1 nodes=2:4 rank=Some(3) coord=Some("10.0.0.1:29470") job=j grace=5000ms relay=true prog=sh args=["-x", "--flag"]"#,
            ),
        );
        // Coordinator replicas: a list, blanks and repeats dropped.
        check(
            "--nproc-per-node 1 --nnodes 2 --coordinator 10.0.0.1:1,10.0.0.2:1,[::1]:1,10.0.0.1:1 --job-id j -- sh",
            Ok(
                r#"n=1 nodes=2:2 rank=None coord=Some("10.0.0.1:1,10.0.0.2:1,[::1]:1") job=j grace=5000ms relay=true prog=sh args=[]"#,
            ),
        );
        check_args(
            &[
                "--nproc-per-node",
                "2",
                "--coordinator",
                "a:1, b:2",
                "--failover-timeout-ms",
                "1500",
                "--",
                "sh",
            ],
            Ok(
                r#"n=2 nodes=1:1 rank=None coord=Some("a:1,b:2") job=<fresh> grace=5000ms relay=true prog=sh args=[] failover=1500ms"#,
            ),
        );
        check(
            "--nproc-per-node 1 --nnodes 2 --coordinator [::1]:1 --job-id j -- /bin/sh",
            Ok(
                r#"n=1 nodes=2:2 rank=None coord=Some("[::1]:1") job=j grace=5000ms relay=true prog=/bin/sh args=[]"#,
            ),
        );
        check(
            "--nproc-per-node 1 --max-restarts 0 -- sh",
            Ok(
                r#"n=1 nodes=1:1 rank=None coord=None job=<fresh> grace=5000ms relay=true prog=sh args=[]"#,
            ),
        );
        check(
            "--nproc-per-node 1 --no-relay -- sh",
            Ok(
                r#"n=1 nodes=1:1 rank=None coord=None job=<fresh> grace=5000ms relay=false prog=sh args=[]"#,
            ),
        );
        check(
            "--nproc-per-node 1 --node-rank 0 -- sh",
            Ok(
                r#"n=1 nodes=1:1 rank=Some(0) coord=None job=<fresh> grace=5000ms relay=true prog=sh args=[]"#,
            ),
        );
        // torchrun's default: one worker.
        check(
            "-- sh",
            Ok(
                r#"n=1 nodes=1:1 rank=None coord=None job=<fresh> grace=5000ms relay=true prog=sh args=[]"#,
            ),
        );
    }

    /// The common prefix of a one-node spec with `n` workers running `sh`.
    pub(super) fn one_node(n: u32, rest: &str) -> String {
        format!(
            "n={n} nodes=1:1 rank=None coord=None job=<fresh> grace=5000ms relay=true prog=sh args=[]{rest}"
        )
    }

    #[test]
    fn supervision_and_rendezvous_flags() {
        for (args, rest) in [
            ("--max-restarts 3", " restarts=3"),
            ("--max_restarts 2", " restarts=2"),
            ("--advertise-addr 10.1.2.3", " advertise=10.1.2.3"),
            ("--host node-a.example", " advertise=node-a.example"),
            ("--advertise_addr fe80::1", " advertise=fe80::1"),
            ("--metrics-addr 0.0.0.0:29472", " metrics=0.0.0.0:29472"),
            ("--metrics_addr [::1]:9100", " metrics=[::1]:9100"),
            (
                "--join-timeout-ms 5000 --last-call-ms 0",
                " join=5000ms last_call=0ms",
            ),
            (
                "--rdzv-conf join_timeout=10,last_call_timeout=2.5",
                " join=10000ms last_call=2500ms",
            ),
            // Both forms, agreeing.
            (
                "--rdzv_conf join_timeout=10 --join-timeout-ms 10000",
                " join=10000ms",
            ),
            ("--lease-ms 2500", " lease=2500ms"),
            ("--failover-timeout-ms 5000", " failover=5000ms"),
            ("--failover_timeout_ms 0", " failover=0ms"),
            ("--failover-timeout-ms 30000", ""),
            ("--monitor-interval 0.1", ""),
            ("--monitor_interval 5", ""),
            (
                "--master-addr 10.0.0.9 --master_port 29600",
                r#" master=Some("10.0.0.9"):Some(29600)"#,
            ),
            ("--master-port 0", ""),
            (
                "--master_addr h --main_process_ip h --main_process_port 7",
                r#" master=Some("h"):Some(7)"#,
            ),
        ] {
            check(&format!("{args} -- sh"), Ok(&one_node(1, rest)));
        }
    }

    #[test]
    fn invalid_supervision_and_rendezvous_flags() {
        for (args, expected) in [
            (
                "--advertise-addr 10.0.0.1:5",
                "--advertise-addr '10.0.0.1:5' must be a host name or IP address, without a port",
            ),
            (
                "--advertise-addr [::1]",
                "--advertise-addr '[::1]' must be a host name or IP address, without a port",
            ),
            (
                "--master-addr a/b",
                "--master-addr 'a/b' is not a host name or IP address (it contains '/')",
            ),
            (
                "--join-timeout-ms 5000 --rdzv-conf join_timeout=10",
                "--join-timeout-ms 5000 conflicts with --rdzv-conf join_timeout=10",
            ),
            (
                "--last-call-ms 1 --rdzv-conf last_call_timeout=0.5",
                "--last-call-ms 1 conflicts with --rdzv-conf last_call_timeout=0.5",
            ),
            (
                "--rdzv-conf join_timeout",
                "invalid value 'join_timeout' for '--rdzv-conf <KEY=VALUE,...>': 'join_timeout' is not KEY=VALUE (see `muster-agent launch --help`)",
            ),
            (
                "--rdzv-conf join_timeout=soon",
                "invalid value 'join_timeout=soon' for '--rdzv-conf <KEY=VALUE,...>': join_timeout=soon: expected a number of seconds (see `muster-agent launch --help`)",
            ),
            (
                "--rdzv-conf last_call_timeout=1e30",
                "invalid value 'last_call_timeout=1e30' for '--rdzv-conf <KEY=VALUE,...>': last_call_timeout=1e30: expected a number of seconds (see `muster-agent launch --help`)",
            ),
            (
                "--join-timeout-ms 0",
                "--join-timeout-ms 0 is out of range: 1 ms to 24 hours",
            ),
            (
                "--rdzv-conf last_call_timeout=90000",
                "--rdzv-conf last_call_timeout=90000 is out of range: 0 to 24 hours",
            ),
            (
                "--lease-ms 0",
                "--lease-ms 0: a node needs some time to keep its workers without the coordinator",
            ),
            (
                "--failover-timeout-ms 86400001",
                "--failover-timeout-ms 86400001 is out of range: 0 to 24 hours",
            ),
            (
                "--monitor-interval NaN",
                "--monitor-interval NaN is not a number of seconds",
            ),
            (
                "--master-addr a --main_process_ip b",
                "--master-addr a conflicts with --main_process_ip b",
            ),
            (
                "--master-port 1 --main_process_port 2",
                "--master-port 1 conflicts with --main_process_port 2",
            ),
            (
                "--master-port 70000",
                "invalid value '70000' for '--master-port <PORT>': 70000 is not in 0..=65535 (see `muster-agent launch --help`)",
            ),
        ] {
            check(&format!("{args} -- sh"), Err(expected));
        }
    }

    #[test]
    fn accelerate_flags() {
        let multi = r#"n=4 nodes=2:2 rank=Some(1) coord=Some("10.0.0.1:29470") job=muster-10.0.0.1-29501 grace=5000ms relay=true prog=sh args=[] master=Some("10.0.0.1"):Some(29501)"#;
        for (args, expected) in [
            ("--num_processes 4", one_node(4, "")),
            ("--num-processes 2 --multi_gpu", one_node(2, "")),
            ("--nproc-per-node 4 --num_processes 4", one_node(4, "")),
            (
                "--num_processes 8 --num_machines 2 --machine_rank 1 --main_process_ip 10.0.0.1 --main_process_port 29501",
                multi.to_owned(),
            ),
            (
                "--nproc-per-node 4 --nnodes 2 --num_machines 2 --node-rank 1 --machine_rank 1 --master-addr 10.0.0.1 --master-port 29501",
                multi.to_owned(),
            ),
            (
                "--nproc-per-node 3 --num_processes 6 --nnodes 2 --coordinator h:1 --job-id j",
                r#"n=3 nodes=2:2 rank=None coord=Some("h:1") job=j grace=5000ms relay=true prog=sh args=[]"#.to_owned(),
            ),
            // The coordinator and job id follow from the main machine's address.
            (
                "--nnodes 2 --master-addr node0",
                r#"n=1 nodes=2:2 rank=None coord=Some("node0:29470") job=muster-node0-29500 grace=5000ms relay=true prog=sh args=[] master=Some("node0"):None"#.to_owned(),
            ),
            (
                "--nnodes 1:2 --main_process_ip fe80::1 --coordinator c:9",
                r#"n=1 nodes=1:2 rank=None coord=Some("c:9") job=muster-fe80--1-29500 grace=5000ms relay=true prog=sh args=[] master=Some("fe80::1"):None"#.to_owned(),
            ),
            (
                "--nnodes 2 --main_process_ip fe80::1",
                r#"n=1 nodes=2:2 rank=None coord=Some("[fe80::1]:29470") job=muster-fe80--1-29500 grace=5000ms relay=true prog=sh args=[] master=Some("fe80::1"):None"#.to_owned(),
            ),
            (
                "--mixed-precision BF16 --debug --enable_cpu_affinity",
                one_node(1, " mp=bf16 debug affinity"),
            ),
            ("--mixed_precision no --cpu", one_node(1, " mp=no cpu")),
            ("--use_cpu", one_node(1, " cpu")),
            ("--use-cpu --gpu-ids all", one_node(1, " cpu")),
            ("--nproc-per-node cpu", one_node(4, "")),
            ("--nproc-per-node auto", one_node(4, "")),
        ] {
            check(&format!("{args} -- sh"), Ok(&expected));
        }
    }

    #[test]
    fn invalid_accelerate_flags() {
        for (args, expected) in [
            (
                "--num_processes 6 --num_machines 4 --coordinator h:1 --job-id j",
                "--num_processes 6 is not a multiple of --num_machines 4",
            ),
            (
                "--nproc-per-node 4 --num_processes 6",
                "--nproc-per-node 4 conflicts with --num_processes 6 (with --nnodes 1)",
            ),
            (
                "--nproc-per-node 2 --num_processes 4 --nnodes 1:2 --coordinator h:1 --job-id j",
                "--nproc-per-node 2 conflicts with --num_processes 4 (with --nnodes 1:2)",
            ),
            (
                "--num_processes 4 --nnodes 1:2 --coordinator h:1 --job-id j",
                "--num_processes 4 is a total across machines: it needs a fixed number of machines, not --nnodes 1:2",
            ),
            (
                "--num_processes 9000",
                "--num_processes 9000 over --nnodes 1 is 9000 workers per node, out of range 1..=4096",
            ),
            (
                "--num_processes 0",
                "--num_processes 0 over --nnodes 1 is 0 workers per node, out of range 1..=4096",
            ),
            (
                "--nnodes 1:2 --num_machines 2",
                "--nnodes 1:2 conflicts with --num_machines 2",
            ),
            (
                "--num_machines 0",
                "--num_machines 0 is out of range 1..=100000",
            ),
            (
                "--node-rank 0 --machine_rank 1 --nnodes 2 --coordinator h:1 --job-id j",
                "--node-rank 0 conflicts with --machine_rank 1",
            ),
            (
                "--machine_rank 2 --num_machines 2 --main_process_ip h",
                "--machine_rank 2 is out of range for --num_machines 2 (node ranks are 0..2)",
            ),
            (
                "--mixed_precision fp32",
                "invalid value 'fp32' for '--mixed-precision <MODE>': expected one of no, fp16, bf16, fp8, found \"fp32\" (see `muster-agent launch --help`)",
            ),
            ("--cpu --gpu-ids 0", "--cpu conflicts with --gpu-ids 0"),
            (
                "--nproc-per-node gpu",
                "--nproc-per-node gpu: no GPU found on this machine",
            ),
            (
                "--nproc-per-node many",
                "invalid value 'many' for '--nproc-per-node <N>': expected a number, gpu, cpu or auto (see `muster-agent launch --help`)",
            ),
        ] {
            check(&format!("{args} -- sh"), Err(expected));
        }
    }

    #[test]
    fn gpus_and_output() {
        let two = machine(Some(2));
        for (args, expected) in [
            ("", Ok(one_node(1, " gpus=0,1"))),
            ("--nproc-per-node gpu", Ok(one_node(2, " gpus=0,1"))),
            ("--nproc-per-node auto", Ok(one_node(2, " gpus=0,1"))),
            (
                "--nproc-per-node gpu --gpu-ids 1",
                Ok(one_node(1, " gpus=1/set")),
            ),
            ("--gpu_ids 1,0", Ok(one_node(1, " gpus=1,0/set"))),
            (
                "--nproc-per-node 2 --gpu-mapping one-per-process",
                Ok(one_node(2, " gpus=0,1/set/one-per-process")),
            ),
            (
                "--nproc-per-node 3 --gpu-mapping one-per-process",
                Err(
                    "--gpu-mapping one-per-process gives each worker a GPU of its own, but there are 3 workers for 2 GPUs (0,1); run fewer workers, list more GPUs, or use --gpu-mapping local-rank".to_owned(),
                ),
            ),
            (
                "--gpu-ids 0,3",
                Err(
                    "--gpu-ids 0,3: GPU 3 does not exist: this machine has 2 GPUs (indices 0 to 1)"
                        .to_owned(),
                ),
            ),
            (
                "--gpu-ids 0,0",
                Err("--gpu-ids '0,0' lists GPU 0 twice".to_owned()),
            ),
            (
                "--gpu-mapping sideways",
                Err("invalid value 'sideways' for '--gpu-mapping <MAPPING>' [possible values: local-rank, one-per-process] (see `muster-agent launch --help`)".to_owned()),
            ),
            (
                "--nproc-per-node 2 --log-dir /tmp/muster-logs --local-ranks-filter 1",
                Ok(one_node(2, " gpus=0,1 log_dir=/tmp/muster-logs console=[1]")),
            ),
            (
                "--nproc-per-node 2 --local_ranks_filter 0,1 --log_dir rel",
                Ok(one_node(2, " gpus=0,1 log_dir=rel console=[0, 1]")),
            ),
            (
                "--nproc-per-node 2 --local-ranks-filter 2",
                Err("--local-ranks-filter '2': local rank 2 does not exist (local ranks are 0..2)".to_owned()),
            ),
            (
                "--local-ranks-filter 0,x",
                Err("--local-ranks-filter '0,x': 'x' is not a local rank".to_owned()),
            ),
            (
                "--log-dir /etc/passwd",
                Err("--log-dir '/etc/passwd' is not a directory".to_owned()),
            ),
        ] {
            let expected = expected.as_deref().map_err(String::as_str);
            check_on(&two, &format!("{args} -- sh"), expected);
        }
        // No driver: a list is trusted, with a warning; one GPU per process runs on CPU.
        check(
            "--gpu-ids 0,1 -- sh",
            Ok(&one_node(
                1,
                " gpus=0,1/set | warning: --gpu-ids 0,1: no NVIDIA GPU found on this machine (no /proc/driver/nvidia/gpus, no /dev/nvidia*); passing the list on as given",
            )),
        );
        check(
            "--gpu-mapping one-per-process -- sh",
            Ok(&one_node(
                1,
                " gpus=/one-per-process | warning: --gpu-mapping one-per-process: no GPU found on this machine; the workers run without one",
            )),
        );
        // The agent's own CUDA_VISIBLE_DEVICES is what `gpu` counts and one-per-process hands out.
        let slurm = Context {
            cuda_visible_devices: Some("2,3".to_owned()),
            ..machine(Some(4))
        };
        check_on(
            &slurm,
            "--nproc-per-node gpu --gpu-mapping one-per-process -- sh",
            Ok(&one_node(2, " gpus=2,3/set/one-per-process")),
        );
    }

    /// Writes an Accelerate config file for a test and removes it when dropped.
    struct ConfigFile(PathBuf);

    impl ConfigFile {
        fn new(name: &str, text: &str) -> Self {
            let path = std::env::temp_dir().join(format!(
                "muster-cli-test-{}-{name}.yaml",
                std::process::id()
            ));
            std::fs::write(&path, text).expect("temp file");
            Self(path)
        }

        fn path(&self) -> String {
            self.0.to_string_lossy().into_owned()
        }
    }

    impl Drop for ConfigFile {
        fn drop(&mut self) {
            let _ = std::fs::remove_file(&self.0);
        }
    }

    #[test]
    fn accelerate_config_files() {
        let single = ConfigFile::new(
            "single",
            "compute_environment: LOCAL_MACHINE
distributed_type: MULTI_GPU
downcast_bf16: 'no'
gpu_ids: all
machine_rank: 0
main_training_function: main
mixed_precision: fp16
num_machines: 1
num_processes: 2
rdzv_backend: static
same_network: true
tpu_env: []
tpu_use_cluster: false
tpu_use_sudo: false
use_cpu: false
",
        );
        let p = single.path();
        let single_node = |n: u32, rest: &str| {
            format!(
                "n={n} nodes=1:1 rank=Some(0) coord=None job=<fresh> grace=5000ms relay=true prog=sh args=[] mp=fp16{rest}"
            )
        };
        check(&format!("--config-file {p} -- sh"), Ok(&single_node(2, "")));
        // Flags override the file.
        check(
            &format!("--config_file {p} --nproc-per-node 3 --mixed-precision bf16 -- sh"),
            Ok(&single_node(3, "").replace("fp16", "bf16")),
        );
        check(
            &format!("--config-file {p} --num_processes 4 --cpu -- sh"),
            Ok(&single_node(4, " cpu")),
        );

        let multi = ConfigFile::new(
            "multi",
            "distributed_type: MULTI_GPU
machine_rank: 1
main_process_ip: 10.0.0.1
main_process_port: 29501
num_machines: 2
num_processes: 16
max_restarts: 2
debug: true
enable_cpu_affinity: true
my_key: 1
",
        );
        let p = multi.path();
        let warning = format!("| warning: --config-file '{p}': unknown key my_key is ignored");
        check(
            &format!("--config-file {p} -- sh"),
            Ok(&format!(
                r#"n=8 nodes=2:2 rank=Some(1) coord=Some("10.0.0.1:29470") job=muster-10.0.0.1-29501 grace=5000ms relay=true prog=sh args=[] restarts=2 master=Some("10.0.0.1"):Some(29501) debug affinity {warning}"#
            )),
        );
        // A flag's machine count divides the file's total; its rank and address win.
        check(
            &format!(
                "--config-file {p} --num_machines 4 --machine_rank 3 --master-addr m --coordinator c:1 --job-id j --max-restarts 0 -- sh"
            ),
            Ok(&format!(
                r#"n=4 nodes=4:4 rank=Some(3) coord=Some("c:1") job=j grace=5000ms relay=true prog=sh args=[] master=Some("m"):Some(29501) debug affinity {warning}"#
            )),
        );
        check(
            &format!("--config-file {p} --nnodes 3 -- sh"),
            Err(&format!(
                "num_processes 16 in '{p}' is not a multiple of --nnodes 3"
            )),
        );
    }

    #[test]
    fn bad_accelerate_config_files() {
        for (name, text, expected) in [
            (
                "indivisible",
                "num_processes: 6\nnum_machines: 4\nmain_process_ip: h\n",
                "num_processes 6 in '{p}' is not a multiple of num_machines 4 in '{p}'",
            ),
            (
                "rank",
                "num_machines: 2\nmachine_rank: 2\nmain_process_ip: h\n",
                "machine_rank 2 in '{p}' is out of range for num_machines 2 in '{p}' (node ranks are 0..2)",
            ),
            (
                "precision",
                "mixed_precision: fp64\n",
                "--config-file '{p}': mixed_precision: expected one of no, fp16, bf16, fp8, found \"fp64\"",
            ),
            (
                "procs",
                "num_processes: -1\n",
                "--config-file '{p}': num_processes: expected a whole number from 1 to 4294967295, found -1",
            ),
            (
                "multinode",
                "num_machines: 2\n",
                "num_machines 2 in '{p}' needs --coordinator (or --rdzv-endpoint, or the main machine's address: --master-addr, --main_process_ip): every node must name the same one",
            ),
            (
                "cpu-gpu",
                "use_cpu: true\ngpu_ids: 0\n",
                "use_cpu true in '{p}' conflicts with gpu_ids 0 in '{p}'",
            ),
            (
                "shape",
                "just text\n",
                "--config-file '{p}': the file holds \"just text\", not a mapping; expected `key: value` settings as `accelerate config` writes them",
            ),
        ] {
            let file = ConfigFile::new(name, text);
            let p = file.path();
            check(
                &format!("--config-file {p} -- sh"),
                Err(&expected.replace("{p}", &p)),
            );
        }
        let file = ConfigFile::new("gpus", "gpu_ids: 0,5\n");
        let p = file.path();
        check_on(
            &machine(Some(2)),
            &format!("--config-file {p} -- sh"),
            Err(&format!(
                "gpu_ids 0,5 in '{p}': GPU 5 does not exist: this machine has 2 GPUs (indices 0 to 1)"
            )),
        );
        check(
            "--config-file /no/such/accelerate.yaml -- sh",
            Err(
                "--config-file '/no/such/accelerate.yaml': cannot read it: No such file or directory (os error 2)",
            ),
        );
        let broken = ConfigFile::new("broken", "num_processes: [1, 2\n");
        let p = broken.path();
        let argv = ["muster-agent", "launch", "--config-file", &p, "--", "sh"];
        let Err(e) = parse_in(argv, &machine(None)) else {
            panic!("invalid YAML accepted");
        };
        let message = e.to_string();
        assert!(
            message.starts_with(&format!("--config-file '{p}': is not valid YAML: ")),
            "{message}"
        );
    }

    #[test]
    fn invalid_command_lines() {
        check(
            "--nproc-per-node 2 --",
            Err(
                "no program to launch: give it after the flags, as in `muster-agent launch --nproc-per-node 2 train.py`",
            ),
        );
        check(
            "--nproc-per-node 2",
            Err(
                "no program to launch: give it after the flags, as in `muster-agent launch --nproc-per-node 2 train.py`",
            ),
        );
        check(
            "--nproc-per-node 0 -- sh",
            Err("--nproc-per-node 0 is out of range 1..=4096"),
        );
        check(
            "--nproc-per-node 4097 -- sh",
            Err("--nproc-per-node 4097 is out of range 1..=4096"),
        );
        check(
            "--nproc-per-node 1 -- no-such-program-muster-test",
            Err("program 'no-such-program-muster-test' was not found in PATH"),
        );
        check(
            "--nproc-per-node 1 -- /no/such/program",
            Err("program '/no/such/program' does not exist"),
        );
        check(
            "--nproc-per-node 1 -- /etc/passwd",
            Err("program '/etc/passwd' is not executable"),
        );
        check("--nproc-per-node 1 -- /", Err("program '/' is a directory"));
        for bad in ["0", "0:2", "2:1", "a", "1:", ":2", "1:2:3", "100001"] {
            let Err(err) = parse_nnodes(bad) else {
                panic!("--nnodes {bad} was accepted");
            };
            check(
                &format!("--nproc-per-node 1 --nnodes {bad} -- sh"),
                Err(&err.to_string()),
            );
        }
        check(
            "--nproc-per-node 1 --nnodes 0 -- sh",
            Err("--nnodes '0' is malformed: a job needs at least 1 node"),
        );
        check(
            "--nproc-per-node 1 --nnodes 2:1 -- sh",
            Err("--nnodes '2:1' is malformed: MAX is below MIN"),
        );
        check(
            "--nproc-per-node 1 --nnodes 1:x -- sh",
            Err("--nnodes '1:x' is malformed: expected MIN or MIN:MAX, as in 2 or 1:4"),
        );
        check(
            "--nproc-per-node 1 --node-rank 1 -- sh",
            Err("--node-rank 1 is out of range for --nnodes 1 (node ranks are 0..1)"),
        );
        check(
            "--nproc-per-node 1 --nnodes 2:3 --node-rank 3 --coordinator h:1 --job-id j -- sh",
            Err("--node-rank 3 is out of range for --nnodes 2:3 (node ranks are 0..3)"),
        );
        check(
            "--nproc-per-node 1 --job-id a/b -- sh",
            Err(
                r#"--job-id: job_id "a/b" contains '/'; allowed are letters, digits, '.', '_', '-'"#,
            ),
        );
        for bad in [
            "host",
            "host:",
            ":1",
            "host:0",
            "host:70000",
            "http://h:1",
            "::1:5",
            "a:1,",
            "a:1,,b:2",
            "a:1,b",
            ",a:1",
        ] {
            check(
                &format!("--nproc-per-node 1 --coordinator {bad} -- sh"),
                Err(&format!(
                    "--coordinator '{bad}' is malformed: expected HOST:PORT, as in 10.0.0.1:29470, or a comma-separated list of them"
                )),
            );
        }
        check(
            "--nproc-per-node 1 --nnodes 2 -- sh",
            Err(
                "--nnodes 2 needs --coordinator (or --rdzv-endpoint, or the main machine's address: --master-addr, --main_process_ip): every node must name the same one",
            ),
        );
        check(
            "--nproc-per-node 1 --nnodes 1:2 --coordinator h:1 -- sh",
            Err(
                "--nnodes 1:2 needs --job-id (or --rdzv-id, or the main machine's address: --master-addr, --main_process_ip): every node must name the same one",
            ),
        );
        for bad in ["localhost:9100", "9100", "1.2.3.4", "1.2.3.4:99999"] {
            check(
                &format!("--metrics-addr={bad} -- sh"),
                Err(&format!(
                    "invalid value '{bad}' for '--metrics-addr <IP:PORT>': invalid socket address syntax (see `muster-agent launch --help`)"
                )),
            );
        }
        check(
            "--nproc-per-node 1 --bogus -- sh",
            Err("unexpected argument '--bogus' found (see `muster-agent launch --help`)"),
        );
    }

    #[test]
    fn host_names() {
        for ok in ["a", "node-1.example.com", "10.0.0.1", "::1", "fe80::1:2"] {
            assert_eq!(plain_host(ok), Ok(ok));
        }
        for bad in ["", "a:1", "[::1]", "a b", "fe80::1%eth0"] {
            assert!(plain_host(bad).is_err(), "{bad} accepted");
        }
        assert_eq!(derived_job_id("fe80::1", 29500), "muster-fe80--1-29500");
    }

    /// A directory with a CA, a client certificate and key (their content is read, not
    /// parsed, at this stage), a good token file and a short one; removed on drop.
    struct SecurityFiles(PathBuf);

    impl SecurityFiles {
        const TOKEN: &str = "cli-test-cluster-token-0123456789";

        fn new(name: &str) -> Self {
            let dir = std::env::temp_dir()
                .join(format!("muster-agent-cli-{}-{name}", std::process::id()));
            std::fs::create_dir_all(&dir).expect("create a temporary directory");
            for (file, content) in [
                ("ca.pem", "CA"),
                ("client.pem", "CERT"),
                ("client-key.pem", "KEY"),
                ("token", &format!("{}\n", Self::TOKEN)),
                ("short", "abc\n"),
            ] {
                std::fs::write(dir.join(file), content).expect("write a file");
            }
            Self(dir)
        }

        fn path(&self, file: &str) -> String {
            self.0.join(file).to_string_lossy().into_owned()
        }
    }

    impl Drop for SecurityFiles {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }

    #[test]
    fn security_flags() {
        let f = SecurityFiles::new("launch");
        let (ca, cert, key, token) = (
            f.path("ca.pem"),
            f.path("client.pem"),
            f.path("client-key.pem"),
            f.path("token"),
        );
        let remote = "--nproc-per-node 1 --coordinator 10.0.0.1:29470";
        let base = r#"n=1 nodes=1:1 rank=None coord=Some("10.0.0.1:29470") job=<fresh> grace=5000ms relay=true prog=sh args=[]"#;
        // Mutual TLS and the token; the token is never shown.
        check(
            &format!(
                "{remote} --tls-ca {ca} --tls-cert {cert} --tls-key {key} --tls-domain coord.svc \
                 --auth-token-file {token} -- sh"
            ),
            Ok(&format!(
                r#"{base} Security {{ tls: Some(TlsFiles {{ ca: "{ca}", identity: Some(("{cert}", "{key}")), domain: Some("coord.svc") }}), token: Some(<redacted>) }}"#
            )),
        );
        // TLS without a client certificate; the token alone (snake_case spellings too).
        check(
            &format!("{remote} --tls_ca {ca} -- sh"),
            Ok(&format!(
                r#"{base} Security {{ tls: Some(TlsFiles {{ ca: "{ca}", identity: None, domain: None }}), token: None }}"#
            )),
        );
        check(
            &format!("{remote} --auth_token_file {token} -- sh"),
            Ok(&format!(
                "{base} Security {{ tls: None, token: Some(<redacted>) }}"
            )),
        );
        // The agent's own coordinator is plaintext: the flags are checked, then unused.
        check(
            &format!("--nproc-per-node 1 --tls-ca {ca} --auth-token-file {token} -- sh"),
            Ok(&one_node(
                1,
                " | warning: --tls-* and --auth-token-file have no use without --coordinator: \
                 the agent's own coordinator listens on 127.0.0.1 without TLS or authentication",
            )),
        );
        // Misuse.
        for (flags, error) in [
            (
                format!("--tls-cert {cert} --tls-key {key}"),
                "--tls-cert needs --tls-ca (the CA that signed the coordinator's certificate)"
                    .to_owned(),
            ),
            (
                format!("--tls-key {key}"),
                "--tls-key needs --tls-ca (the CA that signed the coordinator's certificate)"
                    .to_owned(),
            ),
            (
                "--tls-domain coord.svc".to_owned(),
                "--tls-domain needs --tls-ca (the CA that signed the coordinator's certificate)"
                    .to_owned(),
            ),
            (
                format!("--tls-ca {ca} --tls-cert {cert}"),
                "--tls-cert needs --tls-key (the certificate's private key)".to_owned(),
            ),
            (
                format!("--tls-ca {ca} --tls-key {key}"),
                "--tls-key needs --tls-cert (the client certificate)".to_owned(),
            ),
            (
                format!("--tls-ca {ca} --tls-domain a:b"),
                "--tls-domain 'a:b' is not a host name".to_owned(),
            ),
            (
                "--tls-ca /nonexistent/ca.pem".to_owned(),
                "TLS: cannot read /nonexistent/ca.pem: No such file or directory (os error 2)"
                    .to_owned(),
            ),
            (
                "--auth-token-file /nonexistent/token".to_owned(),
                "--auth-token-file: cannot read token file /nonexistent/token: No such file or \
                 directory (os error 2)"
                    .to_owned(),
            ),
            (
                format!("--auth-token-file {}", f.path("short")),
                format!(
                    "--auth-token-file: token file {}: the token is 3 characters; at least 16 \
                     are required",
                    f.path("short")
                ),
            ),
        ] {
            check(&format!("{remote} {flags} -- sh"), Err(&error));
        }
        // The same checks for the daemon and the operator commands.
        for command in [
            "serve --coordinator a:1",
            "submit --coordinator a:1 --nproc-per-node 1",
            "status --coordinator a:1",
            "cancel --coordinator a:1 j",
        ] {
            let argv = |extra: &str| {
                let mut argv = vec!["muster-agent".to_owned()];
                argv.extend(command.split_whitespace().map(str::to_owned));
                argv.extend(extra.split_whitespace().map(str::to_owned));
                if command.starts_with("submit") {
                    argv.extend(["--".to_owned(), "sh".to_owned()]);
                }
                argv
            };
            let Err(err) = parse_in(argv(&format!("--tls-cert {cert}")), &machine(None)) else {
                panic!("{command}: --tls-cert without --tls-ca accepted");
            };
            assert_eq!(
                err.to_string(),
                "--tls-cert needs --tls-ca (the CA that signed the coordinator's certificate)",
                "{command}"
            );
            let (parsed, _) = parse_in(
                argv(&format!("--tls-ca {ca} --auth-token-file {token}")),
                &machine(None),
            )
            .unwrap_or_else(|e| panic!("{command}: {e}"));
            let shown = format!("{parsed:?}");
            assert!(shown.contains(&token), "{shown}");
            assert!(!shown.contains(SecurityFiles::TOKEN), "{shown}");
        }
    }
}
