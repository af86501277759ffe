//! Validation of the launch flags into a [`LaunchSpec`], before anything is started. Every
//! problem found here is a [`UsageError`]: one line, exit status 2.
//!
//! A setting can come from torchrun's flag (muster's own spelling) or torchrun's `PET_<NAME>`
//! variable for it, from Accelerate's spelling of it, from an Accelerate config file
//! (`--config-file`), from the Slurm step `srun` started the agent in ([`super::slurm`]), or
//! from its default, in that order. Two flags that set one thing differently are an error
//! naming both; a flag beats the file.

use super::error::UsageError;
use super::launch_args::{LaunchArgs, Nproc};
use super::values::{coordinator_list, derived_job_id, fresh_job_id, parse_nnodes};
use super::{accelerate_flags, note, print_messages, rdzv, slurm, torchrun};
use crate::accelerate_config::{self, AccelerateConfig};
use crate::gpu::{self, Discovery, GpuError, GpuIds, GpuMapping, GpuPlan};
use crate::net::{host_port, plain_host};
use crate::program::{Program, PythonChoice};
use crate::security::Security;
use crate::spec::{LaunchSpec, NodeRange, SelfHost};

/// The hang timeout of a launch that sets none: half NCCL's 10-minute watchdog (a third of a
/// minute-long checkpoint write's worst case on a slow disk is still well inside it), and
/// long past any healthy stall, since a rank that computes (CPU) or moves (its stack
/// changes) is progress (docs/hangs.md).
pub const DEFAULT_HANG_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(300);

/// Stack samples a second per worker when nothing sets `--sample-stacks`: enough for the
/// progress rule and a straggler named within 30 s (60 samples a rank), at no measurable step
/// time (docs/benchmarks.md, "Stacks and hangs").
pub const DEFAULT_SAMPLE_HZ: f64 = 2.0;

/// The most stack samples a second `--sample-stacks` takes.
pub const MAX_SAMPLE_HZ: f64 = 100.0;
use muster_core::model::{self, JobId};
use std::ffi::OsStr;
use std::time::Duration;

/// The coordinator port a multi-node job's agents dial when only Accelerate's
/// `main_process_ip` names the main machine.
pub const DEFAULT_COORDINATOR_PORT: u16 = muster_proto::DEFAULT_COORDINATOR_PORT;
/// How long stopped workers get between SIGTERM and SIGKILL without --grace-period-ms or
/// --shutdown-timeout.
const DEFAULT_GRACE_PERIOD: Duration = Duration::from_millis(5000);
/// MASTER_PORT as Accelerate and torchrun default it (used to name a derived job id).
const ACCELERATE_MAIN_PORT: u16 = 29500;

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
    /// Accelerate's default config file, read in Accelerate's mode without `--config_file`
    /// ([`crate::accelerate_config::default_path`]).
    pub accelerate_default_config: Option<std::path::PathBuf>,
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
            accelerate_default_config: crate::accelerate_config::default_path(|name| {
                std::env::var(name).ok()
            }),
        }
    }
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

/// The main machine's address and port, and this node's own address, as given.
struct MainMachine {
    master_addr: Option<Given<String>>,
    advertise_addr: Option<String>,
    master_port: Option<u16>,
}

/// Where the job is coordinated, and under which id.
struct Coordination {
    coordinator: Option<String>,
    self_host: Option<SelfHost>,
    job_id: String,
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
    ///
    /// The steps run in this order so that the first problem reported, and the order of the
    /// warnings, stay those of the command line read from left to right by topic.
    pub fn validate_in(
        mut self,
        ctx: &Context<'_>,
    ) -> Result<(LaunchSpec, Vec<String>), UsageError> {
        let mut warnings = Vec::new();
        // `accelerate launch`'s rule: without --config_file, its default file is read if it
        // exists, unless --cpu is given; here only in Accelerate's mode (an Accelerate flag on
        // the command line), since torchrun reads no file.
        if self.config_file.is_none()
            && !self.cpu
            && (self.accelerate_only() || self.accelerate_flags.any())
            && let Some(path) = ctx
                .accelerate_default_config
                .as_ref()
                .filter(|p| p.is_file())
        {
            tracing::info!(file = %path.display(), "Accelerate's default config file");
            self.config_file = Some(path.clone());
        }
        let shown_file = self
            .config_file
            .as_ref()
            .map(|p| p.to_string_lossy().into_owned());
        let config = self.config(shown_file.as_deref(), &mut warnings)?;
        let file = FileNamer(shown_file.as_deref());
        let slurm = self.slurm_defaults(ctx)?;
        let nodes = self.nodes(&config, &file, slurm.as_ref())?;
        let node_rank = self.node_rank(&config, &file, slurm.as_ref(), &nodes)?;

        // GPUs (before the worker count: `--nproc-per-node gpu` counts them).
        let gpu_ids = self.gpu_ids(&config, &file)?;
        let ids = gpu_ids.as_ref().map_or(GpuIds::All, |g| g.value.clone());
        let nproc = self.workers_per_node(&config, &file, &nodes, &ids, ctx)?;
        // torchrun's OMP_NUM_THREADS warning, once per launch, unless the thread count is given
        // (the user's variable, or `--num_cpu_threads_per_process`: decided below).
        let omp_warning_at = (nproc > 1 && ctx.omp_num_threads.is_none()).then_some(warnings.len());
        warnings.extend(self.torchrun.notes());
        let output = self.output.validate(nproc)?;
        warnings.extend(self.output.notes());
        let use_cpu = self.use_cpu(&config, &file, gpu_ids.as_ref())?;
        let gpus = self.gpu_plan(&ids, gpu_ids.as_ref(), nproc, ctx, &mut warnings)?;
        let grace_period = self.grace_period()?;

        // Accelerate's settings.
        let mixed_precision = self
            .mixed_precision
            .clone()
            .or(config.mixed_precision.clone());
        let acc = self.accelerate_settings(
            &config,
            shown_file.as_deref(),
            mixed_precision.as_deref(),
            omp_warning_at,
            &mut warnings,
        )?;
        let accelerate = self.accelerate_only() || acc.given;
        let max_restarts = self.max_restarts.or(config.max_restarts).unwrap_or(0);
        let recovery = self.recovery.or(config.muster_recovery).unwrap_or_default();
        let max_spares = self.max_spares.or(config.muster_max_spares).unwrap_or(0);
        self.check_spares(recovery, max_spares)?;
        let (hang, sample_hz) = self.hang(&config)?;
        self.check_monitor_interval()?;

        // The rendezvous, the main machine, and where the job is coordinated.
        let rdzv = std::mem::take(&mut self.rdzv).resolve(&mut warnings)?;
        let (join_timeout, last_call) = self.rendezvous_waits(&rdzv)?;
        if self.lease_ms == 0 {
            return Err(UsageError::Invalid(
                "--lease-ms 0: a node needs some time to keep its workers without the coordinator"
                    .to_owned(),
            ));
        }
        let main = self.main_machine(&config, &file, slurm.as_ref(), &nodes)?;
        if let Some(s) = &slurm {
            self.take_slurm_job_id(s, &nodes, node_rank.as_ref(), &main, &rdzv, &mut warnings);
        }
        let place = self.coordination(&rdzv, &nodes, &main, &mut warnings)?;
        if self.spare && place.coordinator.is_none() {
            return Err(UsageError::Invalid(
                "--spare stands by for a job other agents run: give it that job's coordinator (--coordinator or --rdzv-endpoint)".to_owned(),
            ));
        }
        if self.spare && node_rank.is_some() {
            return Err(UsageError::Invalid(
                "--spare takes no node rank: a spare is given a lost node's place".to_owned(),
            ));
        }
        let security = self.security_for(place.coordinator.as_deref(), &mut warnings)?;

        if self.command.is_empty() {
            return Err(UsageError::NoProgram);
        }
        let form = self.torchrun.form()?;
        let mut program = Program::for_launch(form, self.command, &ctx.python, ctx.path_var)?;
        program.env.extend(acc.extra_env);
        let spec = LaunchSpec {
            nproc_per_node: nproc,
            coordinator: place.coordinator,
            self_host: place.self_host,
            failover_timeout: Duration::from_millis(self.failover_timeout_ms),
            job_id: place.job_id,
            nodes: nodes.value,
            node_rank: node_rank.map(|r| r.value),
            advertise_addr: main.advertise_addr,
            grace_period,
            max_restarts,
            recovery,
            spare: self.spare,
            max_spares,
            hang,
            sample_hz,
            flight_recorder: !self.no_flight_recorder
                && config.muster_flight_recorder != Some(false),
            join_timeout,
            last_call,
            lease: Duration::from_millis(self.lease_ms),
            master_addr: main.master_addr.map(|g| g.value),
            master_port: main.master_port,
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
            // The flag (or its variable) and the config file can each only opt out.
            agent_store: !self.no_agent_store && config.muster_agent_store != Some(false),
            metrics_addr: self.metrics_addr,
            role: self
                .torchrun
                .role
                .unwrap_or_else(|| crate::env::DEFAULT_ROLE.to_owned()),
            virtual_local_rank: self.torchrun.virtual_local_rank,
            security,
            program,
            node_id: None,
        };
        Ok((spec, warnings))
    }

    /// The Accelerate config file (`--config-file`), its warnings added; empty without one.
    fn config(
        &self,
        shown_file: Option<&str>,
        warnings: &mut Vec<String>,
    ) -> Result<AccelerateConfig, UsageError> {
        let Some(path) = &self.config_file else {
            return Ok(AccelerateConfig::default());
        };
        let file = shown_file.unwrap_or_default().to_owned();
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
        Ok(config)
    }

    /// A Slurm step's defaults, for what neither the flags (nor PET_*) nor the file say. A
    /// step whose variables do not parse is an error only when nothing else names the nodes.
    fn slurm_defaults(
        &self,
        ctx: &Context<'_>,
    ) -> Result<Option<slurm::SlurmDefaults>, UsageError> {
        match ctx.slurm.defaults() {
            Ok(defaults) => Ok(defaults),
            Err(e) if self.nnodes.is_none() && self.node_rank.is_none() => {
                Err(UsageError::Invalid(e))
            }
            Err(_) => Ok(None),
        }
    }

    /// The node count: `--nnodes`, `--num_machines`, the file's `num_machines`, the Slurm
    /// step's, else 1.
    fn nodes(
        &self,
        config: &AccelerateConfig,
        file: &FileNamer<'_>,
        slurm: Option<&slurm::SlurmDefaults>,
    ) -> Result<Given<NodeRange>, UsageError> {
        let num = |n: &u32| n.to_string();
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
        Ok(Given::either(nnodes, flag_machines)?
            .or_else(|| {
                file.given("num_machines", config.num_machines, num)
                    .map(|g| Given {
                        value: machines(g.value),
                        name: g.name,
                    })
            })
            .or_else(|| {
                slurm.map(|s| Given {
                    value: machines(s.nnodes),
                    name: format!("SLURM_NNODES {}", s.nnodes),
                })
            })
            .unwrap_or(Given {
                value: NodeRange { min: 1, max: 1 },
                name: "--nnodes 1".to_owned(),
            }))
    }

    /// This node's rank, if anything says, below the most nodes.
    fn node_rank(
        &self,
        config: &AccelerateConfig,
        file: &FileNamer<'_>,
        slurm: Option<&slurm::SlurmDefaults>,
        nodes: &Given<NodeRange>,
    ) -> Result<Option<Given<u32>>, UsageError> {
        let num = |n: &u32| n.to_string();
        let node_rank = Given::either(
            Given::flag("--node-rank", self.node_rank, num),
            Given::flag("--machine_rank", self.machine_rank, num),
        )?
        .or_else(|| file.given("machine_rank", config.machine_rank, num))
        .or_else(|| {
            slurm.map(|s| Given {
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
        Ok(node_rank)
    }

    /// `--gpu-ids`, else the file's `gpu_ids`.
    fn gpu_ids(
        &self,
        config: &AccelerateConfig,
        file: &FileNamer<'_>,
    ) -> Result<Option<Given<GpuIds>>, UsageError> {
        Ok(match &self.gpu_ids {
            Some(s) => Some(Given {
                value: GpuIds::parse("--gpu-ids", s).map_err(UsageError::Invalid)?,
                name: format!("--gpu-ids {s}"),
            }),
            None => file.given("gpu_ids", config.gpu_ids.clone(), |ids| match ids {
                GpuIds::All => "all".to_owned(),
                GpuIds::List(l) => l.join(","),
            }),
        })
    }

    /// Where `--cpu` (or the file's `use_cpu`) comes from, if anywhere; it conflicts with a
    /// list of GPUs.
    fn use_cpu(
        &self,
        config: &AccelerateConfig,
        file: &FileNamer<'_>,
        gpu_ids: Option<&Given<GpuIds>>,
    ) -> Result<Option<String>, UsageError> {
        let use_cpu = if self.cpu {
            Some("--cpu".to_owned())
        } else if config.use_cpu == Some(true) {
            file.given("use_cpu", Some(true), bool::to_string)
                .map(|g| g.name)
        } else {
            None
        };
        if let (Some(cpu), Some(ids)) = (&use_cpu, gpu_ids)
            && matches!(ids.value, GpuIds::List(_))
        {
            return Err(UsageError::Conflict(cpu.clone(), ids.name.clone()));
        }
        Ok(use_cpu)
    }

    /// The workers' GPUs: the ids and mapping given, against the machine's GPUs and the
    /// agent's own CUDA_VISIBLE_DEVICES.
    fn gpu_plan(
        &self,
        ids: &GpuIds,
        gpu_ids: Option<&Given<GpuIds>>,
        nproc: u32,
        ctx: &Context<'_>,
        warnings: &mut Vec<String>,
    ) -> Result<GpuPlan, UsageError> {
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
        let inherited = ctx.cuda_visible_devices.as_deref();
        let (gpus, gpu_warnings) = GpuPlan::resolve(ids, mapping, nproc, &ctx.gpus, inherited)
            .map_err(|e| match (&e, gpu_ids) {
                (GpuError::NoSuchGpu { .. }, Some(ids)) => {
                    UsageError::Invalid(format!("{}: {e}", ids.name))
                }
                _ => UsageError::Invalid(implied(e.to_string())),
            })?;
        warnings.extend(gpu_warnings.into_iter().map(implied));
        Ok(gpus)
    }

    /// How long stopped workers get before SIGKILL.
    fn grace_period(&self) -> Result<Duration, UsageError> {
        Ok(Given::either(
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
        .map_or(DEFAULT_GRACE_PERIOD, |g| g.value))
    }

    /// Whether a flag only `accelerate launch` has, or its config file, is given: the workers
    /// then get what Accelerate's launcher always sets.
    fn accelerate_only(&self) -> bool {
        self.config_file.is_some()
            || self.num_processes.is_some()
            || self.num_machines.is_some()
            || self.machine_rank.is_some()
            || self.main_process_ip.is_some()
            || self.main_process_port.is_some()
            || self.mixed_precision.is_some()
            || self.cpu
            || self.multi_gpu
            || self.enable_cpu_affinity
    }

    /// `accelerate launch`'s other flags and the file's paradigm sections; torchrun's
    /// OMP_NUM_THREADS warning goes in at `omp_warning_at` unless they set the thread count.
    fn accelerate_settings(
        &self,
        config: &AccelerateConfig,
        shown_file: Option<&str>,
        mixed_precision: Option<&str>,
        omp_warning_at: Option<usize>,
        warnings: &mut Vec<String>,
    ) -> Result<accelerate_flags::Resolved, UsageError> {
        let (pythonpath, cwd) = (std::env::var("PYTHONPATH").ok(), std::env::current_dir());
        let cwd = cwd
            .map(|d| d.to_string_lossy().into_owned())
            .unwrap_or_default();
        let acc = self.accelerate_flags.resolve(&accelerate_flags::Inputs {
            cpu: self.cpu,
            multi_gpu: self.multi_gpu,
            mixed_precision,
            mixed_precision_from_file: self.mixed_precision.is_none() && mixed_precision.is_some(),
            config,
            file: shown_file,
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
        Ok(acc)
    }

    /// Hang detection (`--hang-timeout`, `--on-hang`, their config keys) and the sampling
    /// rate. The default timeout is [`DEFAULT_HANG_TIMEOUT`] with sampling on, off without
    /// (nothing but barriers would tell progress).
    fn hang(
        &self,
        config: &AccelerateConfig,
    ) -> Result<(muster_core::requests::Hang, f64), UsageError> {
        let hz = self
            .sample_stacks
            .or(config.muster_sample_stacks)
            .unwrap_or(DEFAULT_SAMPLE_HZ);
        if !hz.is_finite() || !(0.0..=MAX_SAMPLE_HZ).contains(&hz) {
            return Err(UsageError::Invalid(format!(
                "--sample-stacks {hz}: expected 0 (only on demand) to {MAX_SAMPLE_HZ} samples a second"
            )));
        }
        let default = (hz > 0.0).then_some(DEFAULT_HANG_TIMEOUT);
        let timeout = self
            .hang_timeout
            .map(|l| l.0)
            .or(config.muster_hang_timeout)
            .unwrap_or(default);
        if let Some(t) = timeout
            && t < muster_core::requests::MIN_HANG_TIMEOUT
        {
            return Err(UsageError::Invalid(format!(
                "--hang-timeout {:?}: the least is {}s (or off)",
                t,
                muster_core::requests::MIN_HANG_TIMEOUT.as_secs()
            )));
        }
        let action = self.on_hang.or(config.muster_on_hang).unwrap_or_default();
        Ok((muster_core::requests::Hang { timeout, action }, hz))
    }

    /// Spares recover a lost node in place: `--spare` and `--max-spares` need
    /// `--recovery in-place`.
    fn check_spares(
        &self,
        recovery: crate::env::Recovery,
        max_spares: u32,
    ) -> Result<(), UsageError> {
        if recovery != crate::env::Recovery::InPlace && (self.spare || max_spares > 0) {
            let flag = if self.spare {
                "--spare"
            } else {
                "--max-spares"
            };
            return Err(UsageError::Invalid(format!(
                "{flag}: spares take a lost node's ranks in place; it needs --recovery in-place"
            )));
        }
        Ok(())
    }

    /// `--monitor-interval` is accepted (torchrun's) but must be a number of seconds.
    fn check_monitor_interval(&self) -> Result<(), UsageError> {
        if let Some(secs) = self.monitor_interval
            && !(secs.is_finite() && secs >= 0.0)
        {
            return Err(UsageError::Invalid(format!(
                "--monitor-interval {secs} is not a number of seconds"
            )));
        }
        Ok(())
    }

    /// The rendezvous' join timeout and last call, from muster's flags or `--rdzv-conf`, each
    /// within the coordinator's range.
    fn rendezvous_waits(
        &self,
        rdzv: &rdzv::Rendezvous,
    ) -> Result<(Option<Duration>, Option<Duration>), UsageError> {
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
        Ok((join_timeout.map(|g| g.value), last_call.map(|g| g.value)))
    }

    /// The main machine's address and port (MASTER_ADDR, MASTER_PORT) and this node's own
    /// address, each checked to be a host without a port.
    fn main_machine(
        &self,
        config: &AccelerateConfig,
        file: &FileNamer<'_>,
        slurm: Option<&slurm::SlurmDefaults>,
        nodes: &Given<NodeRange>,
    ) -> Result<MainMachine, UsageError> {
        let host = |flag: &str, v: &Option<String>| -> Result<Option<Given<String>>, UsageError> {
            match v {
                Some(h) => {
                    plain_host(h).map_err(|why| UsageError::Invalid(format!("{flag} {why}")))?;
                    Ok(Given::flag(flag, Some(h.clone()), Clone::clone))
                }
                None => Ok(None),
            }
        };
        let master_addr = Given::either(
            host("--master-addr", &self.master_addr)?,
            host("--main_process_ip", &self.main_process_ip)?,
        )?
        .or_else(|| {
            file.given(
                "main_process_ip",
                config.main_process_ip.clone(),
                Clone::clone,
            )
        })
        .or_else(|| {
            slurm.filter(|_| nodes.value.max > 1).map(|s| Given {
                value: s.master_addr.clone(),
                name: format!("the Slurm step's first host {}", s.master_addr),
            })
        });
        let advertise_addr = Given::either(
            host("--advertise-addr", &self.advertise_addr)?,
            host("--local-addr", &self.torchrun.local_addr)?,
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
        Ok(MainMachine {
            master_addr,
            advertise_addr,
            master_port,
        })
    }

    /// Under srun, every node of the step derives the same job id; the note says which of
    /// the step's defaults were taken.
    fn take_slurm_job_id(
        &mut self,
        s: &slurm::SlurmDefaults,
        nodes: &Given<NodeRange>,
        node_rank: Option<&Given<u32>>,
        main: &MainMachine,
        rdzv: &rdzv::Rendezvous,
        warnings: &mut Vec<String>,
    ) {
        let mut taken = Vec::new();
        if nodes.name.starts_with("SLURM_") {
            taken.push(format!("--nnodes {}", s.nnodes));
        }
        if node_rank.is_some_and(|r| r.name.starts_with("SLURM_")) {
            taken.push(format!("--node-rank {}", s.node_rank));
        }
        if main
            .master_addr
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

    /// Where the job is coordinated, and under which id: `--coordinator`, else the
    /// rendezvous endpoint (or the main machine's address, port 29470, for a multi-node job),
    /// hosted by the agent whose machine can bind it; else the agent's own coordinator.
    fn coordination(
        &self,
        rdzv: &rdzv::Rendezvous,
        nodes: &Given<NodeRange>,
        main: &MainMachine,
        warnings: &mut Vec<String>,
    ) -> Result<Coordination, UsageError> {
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
        let master_addr = main.master_addr.as_ref();
        let (coordinator, hosted) = match (given_coordinator, &endpoint, master_addr) {
            (Some(c), _, _) => (Some(c), false),
            (None, Some((host, port)), _) => (Some(host_port(host, *port)), true),
            (None, None, Some(addr)) if multi_node => {
                (Some(host_port(&addr.value, DEFAULT_COORDINATOR_PORT)), true)
            }
            (None, None, _) if multi_node => {
                return Err(UsageError::MultiNode(
                    nodes.name.clone(),
                    "--coordinator (or --rdzv-endpoint, or the main machine's address: --master-addr, --main_process_ip)",
                ));
            }
            (None, None, _) => (None, false),
        };
        let self_host = self.self_host(hosted, rdzv, coordinator.as_deref(), warnings)?;
        let job_id = Given::either(
            Given::flag("--job-id", self.job_id.clone(), Clone::clone),
            rdzv.job_id.clone().map(|id| Given {
                name: format!("--rdzv-id {id}"),
                value: id,
            }),
        )?
        .map(|g| g.value);
        let job_id = match (job_id, &endpoint, master_addr) {
            (Some(id), _, _) => JobId::parse(&id)
                .map_err(|e| UsageError::JobId(e.0))?
                .as_str()
                .to_owned(),
            (None, Some((host, port)), _) => derived_job_id(host, *port),
            (None, None, Some(addr)) if multi_node => derived_job_id(
                &addr.value,
                main.master_port.unwrap_or(ACCELERATE_MAIN_PORT),
            ),
            (None, None, _) if multi_node => {
                return Err(UsageError::MultiNode(
                    nodes.name.clone(),
                    "--job-id (or --rdzv-id, or the main machine's address: --master-addr, --main_process_ip)",
                ));
            }
            (None, None, _) => fresh_job_id(),
        };
        if let Some(h) = &self.advertise_addr {
            plain_host(h).map_err(|why| UsageError::Invalid(format!("--advertise-addr {why}")))?;
        }
        Ok(Coordination {
            coordinator,
            self_host,
            job_id,
        })
    }

    /// Whether this agent may host the coordinator at the rendezvous endpoint, and with which
    /// security: hosting needs the server's files when any security flag is given.
    fn self_host(
        &self,
        hosted: bool,
        rdzv: &rdzv::Rendezvous,
        coordinator: Option<&str>,
        warnings: &mut Vec<String>,
    ) -> Result<Option<SelfHost>, UsageError> {
        Ok(match (hosted, rdzv.conf.is_host) {
            (false, Some(_)) | (true, Some(false)) | (false, None) => None,
            (true, must) => {
                let must = must == Some(true);
                let at = coordinator.unwrap_or_default();
                match rdzv::server_security(&self.security) {
                    Ok(secured) => Some(SelfHost { must, secured }),
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
        })
    }

    /// TLS and the token for `coordinator`; plaintext (with a warning if any was given) for
    /// the agent's own.
    fn security_for(
        &self,
        coordinator: Option<&str>,
        warnings: &mut Vec<String>,
    ) -> Result<Security, UsageError> {
        let security = self.security.resolve().map_err(UsageError::Invalid)?;
        if coordinator.is_none() && self.security.any() {
            warnings.push(
                "--tls-* and --auth-token-file have no use without --coordinator: the agent's \
                 own coordinator listens on 127.0.0.1 without TLS or authentication"
                    .to_owned(),
            );
            return Ok(Security::plaintext());
        }
        Ok(security)
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
