//! The worker environment of `docs/contract.md`: muster's own `MUSTER_*` variables, the
//! torchrun-compatible set, the GPU assignment and Accelerate's `ACCELERATE_*` settings. A pure
//! function of the node's assignment and the launch's options, so that it is tested without
//! spawning anything. The variables' names are the contract's (`muster_core::contract::env`),
//! the same constants the worker SDK reads them by.

use crate::gpu::{GpuMapping, GpuPlan, VISIBLE_DEVICES_ENV};
use muster_core::contract::env as var;

/// The variable torchrun sets to 1 when several workers share a node (see [`worker_env`]).
pub use muster_core::contract::env::OMP_NUM_THREADS;

/// What a worker's death does to the job (`launch --recovery`, the config file's
/// `muster_recovery`, `submit --recovery`): the workers learn it as `MUSTER_RECOVERY`.
pub use muster_core::requests::Recovery;

/// What the agent knows about its node once the rendezvous round has closed: the inputs of
/// every worker's environment.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NodeAssignment {
    /// The coordinator's `host:port`, as workers should dial it, or its replicas'
    /// (comma-separated): the workers follow the leader among them.
    pub coordinator: String,
    /// How long workers retry across a coordinator failover (`MUSTER_FAILOVER_TIMEOUT_MS`).
    pub failover_timeout: std::time::Duration,
    /// The job id.
    pub job_id: String,
    /// This agent's node id (the coordinator checks it on the relay and failure reports: a
    /// node a spare replaced is refused).
    pub node_id: String,
    /// The generation (restart round), from 1.
    pub generation: u64,
    /// This node's rank.
    pub node_rank: u32,
    /// Nodes in the generation.
    pub num_nodes: u32,
    /// Global rank of this node's local rank 0.
    pub rank_offset: u32,
    /// Workers on this node.
    pub local_world_size: u32,
    /// Workers in the generation.
    pub world_size: u32,
    /// Restarts so far.
    pub restart_count: u32,
    /// `--max-restarts`.
    pub max_restarts: u32,
    /// The job's recovery mode, as the coordinator answered the join (`MUSTER_RECOVERY`).
    pub recovery: Recovery,
    /// In-place recovery: the membership epoch a respawned worker replaces its rank in
    /// (`MUSTER_EPOCH`); 0 for the generation's first workers, which do not get the variable.
    pub epoch: u64,
    /// The host this node advertised.
    pub host: String,
    /// Node rank 0's host; with the agent store, 127.0.0.1 (this node's agent serves it).
    pub master_addr: String,
    /// A free port on node rank 0's host, the same for every worker of the job; with the
    /// agent store, the port this node's agent serves torch's store on.
    pub master_port: u16,
    /// The node relay's socket (`MUSTER_AGENT_SOCKET`), when the agent runs one.
    pub agent_socket: Option<String>,
    /// The folder of this attempt's worker error files, when the agent has one: each worker
    /// gets `TORCHELASTIC_ERROR_FILE` (and `MUSTER_ERROR_FILE`) =
    /// [`crate::error_file::error_path`]`(dir, rank)`.
    pub error_dir: Option<std::path::PathBuf>,
    /// The launch's Flight Recorder folder ([`crate::flight::Flight`]), when the
    /// recorder is on: each worker gets [`crate::flight::worker_env`].
    pub flight_dir: Option<std::path::PathBuf>,
}

/// What a launch adds to every worker's environment besides the rendezvous' answer: its GPUs
/// and Accelerate's settings (see [`crate::cli::LaunchSpec::worker_options`]).
#[derive(Debug, Clone, Copy)]
pub struct WorkerOptions<'a> {
    /// Which GPUs the workers see and use.
    pub gpus: &'a GpuPlan,
    /// `ACCELERATE_MIXED_PRECISION` (`no`, `fp16`, `bf16`, `fp8`), when asked for.
    pub mixed_precision: Option<&'a str>,
    /// `ACCELERATE_USE_CPU=True` when set.
    pub use_cpu: bool,
    /// `ACCELERATE_DEBUG_MODE=true` when set.
    pub debug: bool,
    /// `ACCELERATE_CPU_AFFINITY=1` when set.
    pub cpu_affinity: bool,
    /// An `accelerate launch` command line: as Accelerate's launcher does, every worker gets
    /// `ACCELERATE_MIXED_PRECISION` (`no` unless asked for) and the `ACCELERATE_DYNAMO_*`
    /// settings (their defaults: no TorchDynamo), so `Accelerator()` reads what it would read
    /// under `accelerate launch`.
    pub accelerate: bool,
    /// With `accelerate`: the variables Accelerate's launcher sets from its TorchDynamo,
    /// FSDP, DeepSpeed, Megatron-LM, FP8 and parallelism flags (or config file), from
    /// [`crate::cli::accelerate_flags`]; they replace [`ACCELERATE_DYNAMO_DEFAULTS`] and any
    /// variable of the same name set before them (OMP_NUM_THREADS from
    /// `--num_cpu_threads_per_process`). `None`: the defaults.
    pub accelerate_env: Option<&'a [(&'static str, String)]>,
    /// How the workers reach the coordinator: `MUSTER_TOKEN` (a job token) and `MUSTER_TLS_*`
    /// ([`crate::security::Security::worker_env`]); `None`: nothing of the kind.
    pub security: Option<&'a crate::security::Security>,
    /// torchrun's `--role`: `ROLE_NAME` (torchrun's default is `default`).
    pub role: &'a str,
    /// torchrun's `--virtual-local-rank`: every worker gets `LOCAL_RANK=0` (its GPU, alone in
    /// its `CUDA_VISIBLE_DEVICES`, is device 0); `MUSTER_LOCAL_RANK` keeps the real one.
    pub virtual_local_rank: bool,
    /// `TORCHELASTIC_USE_AGENT_STORE=True`: the agent serves torch's store at `MASTER_ADDR`:
    /// `MASTER_PORT`, so torch's `env://` makes every rank a client and no rank a server.
    pub agent_store: bool,
}

impl Default for WorkerOptions<'_> {
    /// No GPU plan (`CUDA_VISIBLE_DEVICES` passes through) and no Accelerate settings.
    fn default() -> Self {
        static NO_GPUS: GpuPlan = GpuPlan {
            mapping: GpuMapping::LocalRank,
            devices: Vec::new(),
            set_visible_devices: false,
        };
        Self {
            gpus: &NO_GPUS,
            mixed_precision: None,
            use_cpu: false,
            debug: false,
            cpu_affinity: false,
            security: None,
            role: DEFAULT_ROLE,
            virtual_local_rank: false,
            accelerate: false,
            accelerate_env: None,
            agent_store: false,
        }
    }
}

/// `ROLE_NAME` when no `--role` is given, as under torchrun.
pub const DEFAULT_ROLE: &str = "default";

/// What Accelerate's launcher sets for TorchDynamo when no `--dynamo_*` flag is given (checked
/// against accelerate 1.x, `accelerate/utils/launch.py`).
pub const ACCELERATE_DYNAMO_DEFAULTS: [(&str, &str); 5] = [
    ("ACCELERATE_DYNAMO_BACKEND", "NO"),
    ("ACCELERATE_DYNAMO_MODE", "default"),
    ("ACCELERATE_DYNAMO_USE_FULLGRAPH", "False"),
    ("ACCELERATE_DYNAMO_USE_DYNAMIC", "False"),
    ("ACCELERATE_DYNAMO_USE_REGIONAL_COMPILATION", "False"),
];

/// The variables to set for local rank `local_rank`, on top of the agent's own environment.
/// `inherited(name)` says whether the agent's environment already has `name`: the
/// "unless already set" variables are then left as they are.
///
/// `TORCHELASTIC_ERROR_FILE` is not one of those: as torchrun does, every worker gets a file of
/// its own even when the agent inherited the variable, which then names the agent's own error
/// file (where a launcher above the agent expects the root cause), not the workers'.
///
/// `OMP_NUM_THREADS=1` is torchrun's rule: only with more than one worker on the node, and only
/// when the agent's environment has no `OMP_NUM_THREADS` (one worker keeps every core).
///
/// `CUDA_VISIBLE_DEVICES` is set only when the GPU plan says so (a `--gpu-ids` list, or one GPU
/// per process); otherwise the agent's own value passes through. `ACCELERATE_*` variables are
/// set only when asked for, so that an inherited value survives a plain torchrun-style launch.
///
/// With the launch's security settings, `MUSTER_TOKEN` is the worker's job token: a secret,
/// which nothing in the agent logs or prints (keep it so).
pub fn worker_env(
    node: &NodeAssignment,
    local_rank: u32,
    options: &WorkerOptions<'_>,
    inherited: impl Fn(&str) -> bool,
) -> Vec<(&'static str, String)> {
    let rank = node.rank_offset + local_rank;
    let mut env = vec![
        (var::MUSTER_JOB_ID, node.job_id.clone()),
        (var::MUSTER_GENERATION, node.generation.to_string()),
        (var::MUSTER_RANK, rank.to_string()),
        (var::MUSTER_LOCAL_RANK, local_rank.to_string()),
        (var::MUSTER_WORLD_SIZE, node.world_size.to_string()),
        (
            var::MUSTER_LOCAL_WORLD_SIZE,
            node.local_world_size.to_string(),
        ),
        (var::MUSTER_NODE_RANK, node.node_rank.to_string()),
        (var::MUSTER_NUM_NODES, node.num_nodes.to_string()),
        (var::MUSTER_RESTART_COUNT, node.restart_count.to_string()),
        (var::MUSTER_HOST, node.host.clone()),
        (
            var::MUSTER_FAILOVER_TIMEOUT_MS,
            node.failover_timeout.as_millis().to_string(),
        ),
        (var::MUSTER_RECOVERY, node.recovery.as_str().to_owned()),
    ];
    if node.epoch > 0 {
        env.push((var::MUSTER_EPOCH, node.epoch.to_string()));
    }
    // Under the relay, a worker reaches the coordinator through the agent's gateway beside
    // the socket, and gets no address of its own.
    match &node.agent_socket {
        Some(socket) => {
            env.push((var::MUSTER_AGENT_SOCKET, socket.clone()));
            env.push((var::MUSTER_AGENT_PID, std::process::id().to_string()));
            if rank == 0 {
                // Rank 0's steps, for a script that marks none itself (`_muster_steps.py`).
                let steps =
                    std::path::Path::new(socket).with_file_name(muster_core::contract::STEP_SOCKET);
                env.push((
                    var::MUSTER_STEP_SOCKET,
                    steps.to_string_lossy().into_owned(),
                ));
            }
        }
        None => env.insert(0, (var::MUSTER_COORDINATOR, node.coordinator.clone())),
    }
    let error_file = node.error_dir.as_deref().map(|dir| {
        crate::error_file::error_path(dir, rank)
            .to_string_lossy()
            .into_owned()
    });
    if let Some(path) = &error_file {
        env.push((var::MUSTER_ERROR_FILE, path.clone()));
    }
    env.extend([
        (var::RANK, rank.to_string()),
        (
            var::LOCAL_RANK,
            if options.virtual_local_rank {
                0
            } else {
                local_rank
            }
            .to_string(),
        ),
        (var::WORLD_SIZE, node.world_size.to_string()),
        (var::LOCAL_WORLD_SIZE, node.local_world_size.to_string()),
        (var::GROUP_RANK, node.node_rank.to_string()),
        (var::GROUP_WORLD_SIZE, node.num_nodes.to_string()),
        (var::ROLE_RANK, rank.to_string()),
        (var::ROLE_NAME, options.role.to_owned()),
        (var::ROLE_WORLD_SIZE, node.world_size.to_string()),
        (var::MASTER_ADDR, node.master_addr.clone()),
        (var::MASTER_PORT, node.master_port.to_string()),
        (
            var::TORCHELASTIC_RESTART_COUNT,
            node.restart_count.to_string(),
        ),
        (
            var::TORCHELASTIC_MAX_RESTARTS,
            node.max_restarts.to_string(),
        ),
        (var::TORCHELASTIC_RUN_ID, node.job_id.clone()),
        (
            var::TORCHELASTIC_USE_AGENT_STORE,
            // Python's `str(bool)`: torch compares the value with `str(True)`.
            if options.agent_store { "True" } else { "False" }.to_owned(),
        ),
    ]);
    if let Some(path) = error_file {
        env.push((var::TORCHELASTIC_ERROR_FILE, path));
    }
    if !inherited(var::TORCH_NCCL_ASYNC_ERROR_HANDLING) {
        env.push((var::TORCH_NCCL_ASYNC_ERROR_HANDLING, "1".to_owned()));
    }
    if let Some(dir) = &node.flight_dir {
        let python_path = std::env::var(crate::flight::PYTHONPATH).ok();
        env.extend(crate::flight::worker_env(
            dir,
            rank,
            &inherited,
            python_path.as_deref(),
        ));
    }
    if node.local_world_size > 1 && !inherited(OMP_NUM_THREADS) {
        env.push((OMP_NUM_THREADS, "1".to_owned()));
    }
    let gpus = options.gpus;
    if let Some(visible) = gpus.visible_devices(local_rank) {
        env.push((VISIBLE_DEVICES_ENV, visible));
    } else if options.virtual_local_rank && !inherited(VISIBLE_DEVICES_ENV) {
        // torchrun's --virtual-local-rank with no GPU list to pick from: device `local_rank`
        // (torch/distributed/elastic/agent/server/local_elastic_agent.py).
        env.push((VISIBLE_DEVICES_ENV, local_rank.to_string()));
    }
    if let Some((gpu, index)) = gpus.assigned(local_rank) {
        env.push((var::MUSTER_GPU_IDS, gpu.to_owned()));
        env.push((var::MUSTER_CUDA_DEVICE, index.to_string()));
    }
    match (options.mixed_precision, options.accelerate) {
        (Some(mp), _) => env.push((var::ACCELERATE_MIXED_PRECISION, mp.to_owned())),
        (None, true) => env.push((var::ACCELERATE_MIXED_PRECISION, "no".to_owned())),
        (None, false) => {}
    }
    if options.accelerate {
        match options.accelerate_env {
            Some(vars) => set_accelerate_env(&mut env, vars),
            // accelerate/utils/launch.py, prepare_multi_gpu_env and
            // prepare_simple_launcher_cmd_env, with no --dynamo_* flag given.
            None => env.extend(
                ACCELERATE_DYNAMO_DEFAULTS
                    .iter()
                    .map(|(k, v)| (*k, (*v).to_owned())),
            ),
        }
    }
    if options.use_cpu {
        env.push((var::ACCELERATE_USE_CPU, "True".to_owned()));
    }
    if options.debug {
        env.push((var::ACCELERATE_DEBUG_MODE, "true".to_owned()));
    }
    if options.cpu_affinity {
        env.push((var::ACCELERATE_CPU_AFFINITY, "1".to_owned()));
    }
    if let Some(security) = options.security {
        env.extend(security.worker_env(&node.job_id));
    }
    env
}

/// Adds Accelerate's launcher variables ([`WorkerOptions::accelerate_env`]), each replacing
/// one of the same name already in `env`: Accelerate's launcher overwrites what it sets.
fn set_accelerate_env(env: &mut Vec<(&'static str, String)>, vars: &[(&'static str, String)]) {
    env.retain(|(name, _)| !vars.iter().any(|(v, _)| v == name));
    env.extend(vars.iter().cloned());
}

#[cfg(test)]
mod tests {
    use super::*;

    fn node() -> NodeAssignment {
        NodeAssignment {
            coordinator: "10.0.0.1:29470,10.0.0.2:29470".into(),
            failover_timeout: std::time::Duration::from_millis(2500),
            job_id: "job7".into(),
            node_id: String::new(),
            generation: 3,
            node_rank: 1,
            num_nodes: 2,
            rank_offset: 4,
            local_world_size: 2,
            world_size: 6,
            restart_count: 2,
            max_restarts: 0,
            recovery: Recovery::Restart,
            epoch: 0,
            host: "node-b".into(),
            master_addr: "node-a".into(),
            master_port: 29500,
            agent_socket: Some("/tmp/muster-1-2/relay.sock".into()),
            error_dir: None,
            flight_dir: None,
        }
    }

    /// `expected` lists `NAME=value` lines in the order the function returns them.
    fn check(node: &NodeAssignment, local_rank: u32, inherited: &[&str], expected: &str) {
        let got: Vec<String> = worker_env(node, local_rank, &WorkerOptions::default(), |n| {
            inherited.contains(&n)
        })
        .into_iter()
        .map(|(k, v)| format!("{k}={v}"))
        .collect();
        let expected: Vec<&str> = expected.split_whitespace().collect();
        assert_eq!(
            got, expected,
            "local rank {local_rank}, inherited {inherited:?}"
        );
    }

    /// Global rank 0 alone gets the step socket, beside its relay socket.
    #[test]
    fn only_global_rank_0_gets_the_step_socket() {
        let first = NodeAssignment {
            rank_offset: 0,
            node_rank: 0,
            ..node()
        };
        let steps = |n: &NodeAssignment, local_rank| {
            worker_env(n, local_rank, &WorkerOptions::default(), |_| false)
                .into_iter()
                .find(|(k, _)| *k == var::MUSTER_STEP_SOCKET)
                .map(|(_, v)| v)
        };
        assert_eq!(
            steps(&first, 0).as_deref(),
            Some("/tmp/muster-1-2/steps.sock")
        );
        assert_eq!(steps(&first, 1), None);
        assert_eq!(steps(&node(), 0), None, "rank 4 on node 1");
    }

    #[test]
    fn second_node_second_worker() {
        check(
            &node(),
            1,
            &[],
            &format!("MUSTER_JOB_ID=job7 MUSTER_GENERATION=3
             MUSTER_RANK=5 MUSTER_LOCAL_RANK=1 MUSTER_WORLD_SIZE=6 MUSTER_LOCAL_WORLD_SIZE=2
             MUSTER_NODE_RANK=1 MUSTER_NUM_NODES=2 MUSTER_RESTART_COUNT=2 MUSTER_HOST=node-b
             MUSTER_FAILOVER_TIMEOUT_MS=2500 MUSTER_RECOVERY=restart
             MUSTER_AGENT_SOCKET=/tmp/muster-1-2/relay.sock MUSTER_AGENT_PID={}
             RANK=5 LOCAL_RANK=1 WORLD_SIZE=6 LOCAL_WORLD_SIZE=2 GROUP_RANK=1 GROUP_WORLD_SIZE=2
             ROLE_RANK=5 ROLE_NAME=default ROLE_WORLD_SIZE=6 MASTER_ADDR=node-a MASTER_PORT=29500
             TORCHELASTIC_RESTART_COUNT=2 TORCHELASTIC_MAX_RESTARTS=0 TORCHELASTIC_RUN_ID=job7
             TORCHELASTIC_USE_AGENT_STORE=False TORCH_NCCL_ASYNC_ERROR_HANDLING=1 OMP_NUM_THREADS=1",
                std::process::id()
            ),
        );
    }

    /// The recovery mode reaches every worker; only a respawned one (in place) gets its
    /// epoch, with the restart count of its respawn in both spellings.
    #[test]
    fn recovery_mode_and_epoch() {
        let get = |node: &NodeAssignment| {
            let env = worker_env(node, 1, &WorkerOptions::default(), |_| false);
            let find = |k: &str| env.iter().find(|(n, _)| *n == k).map(|(_, v)| v.clone());
            [
                find("MUSTER_RECOVERY"),
                find("MUSTER_EPOCH"),
                find("MUSTER_RESTART_COUNT"),
                find("TORCHELASTIC_RESTART_COUNT"),
            ]
        };
        let some = |v: &str| Some(v.to_owned());
        assert_eq!(get(&node()), [some("restart"), None, some("2"), some("2")]);
        let first = NodeAssignment {
            recovery: Recovery::InPlace,
            ..node()
        };
        assert_eq!(get(&first), [some("in-place"), None, some("2"), some("2")]);
        let respawned = NodeAssignment {
            epoch: 4,
            restart_count: 3,
            ..first
        };
        assert_eq!(
            get(&respawned),
            [some("in-place"), some("4"), some("3"), some("3")]
        );
    }

    /// With the agent store, torch's `env://` must see exactly Python's `str(True)`.
    #[test]
    fn the_agent_store_tells_torch_to_connect_as_a_client() {
        let get = |agent_store: bool| {
            let options = WorkerOptions {
                agent_store,
                ..WorkerOptions::default()
            };
            worker_env(&node(), 0, &options, |_| false)
                .into_iter()
                .find(|(k, _)| *k == "TORCHELASTIC_USE_AGENT_STORE")
                .map(|(_, v)| v)
        };
        assert_eq!(get(true).as_deref(), Some("True"));
        assert_eq!(get(false).as_deref(), Some("False"));
    }

    #[test]
    fn single_node_and_inherited_defaults() {
        let single = NodeAssignment {
            coordinator: "127.0.0.1:40000".into(),
            failover_timeout: crate::failover::DEFAULT_BUDGET,
            job_id: "j".into(),
            node_id: String::new(),
            generation: 1,
            node_rank: 0,
            num_nodes: 1,
            rank_offset: 0,
            local_world_size: 1,
            world_size: 1,
            restart_count: 0,
            max_restarts: 0,
            recovery: Recovery::Restart,
            epoch: 0,
            host: "127.0.0.1".into(),
            master_addr: "127.0.0.1".into(),
            master_port: 1234,
            agent_socket: None,
            error_dir: None,
            flight_dir: None,
        };
        let common = "MUSTER_COORDINATOR=127.0.0.1:40000 MUSTER_JOB_ID=j MUSTER_GENERATION=1
             MUSTER_RANK=0 MUSTER_LOCAL_RANK=0 MUSTER_WORLD_SIZE=1 MUSTER_LOCAL_WORLD_SIZE=1
             MUSTER_NODE_RANK=0 MUSTER_NUM_NODES=1 MUSTER_RESTART_COUNT=0 MUSTER_HOST=127.0.0.1
             MUSTER_FAILOVER_TIMEOUT_MS=30000 MUSTER_RECOVERY=restart
             RANK=0 LOCAL_RANK=0 WORLD_SIZE=1 LOCAL_WORLD_SIZE=1 GROUP_RANK=0 GROUP_WORLD_SIZE=1
             ROLE_RANK=0 ROLE_NAME=default ROLE_WORLD_SIZE=1 MASTER_ADDR=127.0.0.1
             MASTER_PORT=1234 TORCHELASTIC_RESTART_COUNT=0 TORCHELASTIC_MAX_RESTARTS=0
             TORCHELASTIC_RUN_ID=j TORCHELASTIC_USE_AGENT_STORE=False";
        // One worker on the node: OMP_NUM_THREADS is left alone, as torchrun does.
        for (inherited, tail) in [
            (&[][..], "TORCH_NCCL_ASYNC_ERROR_HANDLING=1"),
            (
                &["OMP_NUM_THREADS"][..],
                "TORCH_NCCL_ASYNC_ERROR_HANDLING=1",
            ),
            (&["TORCH_NCCL_ASYNC_ERROR_HANDLING"][..], ""),
            (
                &["OMP_NUM_THREADS", "TORCH_NCCL_ASYNC_ERROR_HANDLING", "RANK"][..],
                "",
            ),
        ] {
            check(&single, 0, inherited, &format!("{common} {tail}"));
        }
    }

    #[test]
    fn omp_num_threads_only_with_several_workers() {
        // (local world size, inherited, OMP_NUM_THREADS given to the worker)
        for (local_world_size, inherited, expected) in [
            (1, false, None),
            (1, true, None),
            (2, false, Some("1")),
            (2, true, None),
            (8, false, Some("1")),
        ] {
            let n = NodeAssignment {
                local_world_size,
                ..node()
            };
            let env = worker_env(&n, 0, &WorkerOptions::default(), |name| {
                inherited && name == OMP_NUM_THREADS
            });
            let got = env.iter().find(|(k, _)| *k == OMP_NUM_THREADS);
            assert_eq!(
                got.map(|(_, v)| v.as_str()),
                expected,
                "{local_world_size} workers, inherited: {inherited}"
            );
        }
    }

    #[test]
    fn role_and_virtual_local_rank() {
        let own = GpuPlan {
            mapping: GpuMapping::OnePerProcess,
            devices: vec!["4".into(), "5".into()],
            set_visible_devices: true,
        };
        let options = WorkerOptions {
            gpus: &own,
            role: "trainer",
            virtual_local_rank: true,
            ..WorkerOptions::default()
        };
        for local in 0..2 {
            let env = worker_env(&node(), local, &options, |_| false);
            let get = |k: &str| env.iter().find(|(n, _)| *n == k).map(|(_, v)| v.as_str());
            assert_eq!(get("LOCAL_RANK"), Some("0"));
            assert_eq!(get("MUSTER_LOCAL_RANK"), Some(local.to_string().as_str()));
            assert_eq!(get("ROLE_NAME"), Some("trainer"));
            assert_eq!(
                get("CUDA_VISIBLE_DEVICES"),
                Some(["4", "5"][local as usize])
            );
            assert_eq!(get("RANK"), Some((4 + local).to_string().as_str()));
        }
        // No GPU found: torchrun's rule, device `local_rank` (or the agent's own list).
        let options = WorkerOptions {
            virtual_local_rank: true,
            ..WorkerOptions::default()
        };
        for local in 0..2 {
            let env = worker_env(&node(), local, &options, |_| false);
            let get = |k: &str| env.iter().find(|(n, _)| *n == k).map(|(_, v)| v.as_str());
            assert_eq!(
                get("CUDA_VISIBLE_DEVICES"),
                Some(local.to_string().as_str())
            );
            let env = worker_env(&node(), local, &options, |k| k == VISIBLE_DEVICES_ENV);
            assert!(env.iter().all(|(n, _)| *n != VISIBLE_DEVICES_ENV));
        }
    }

    #[test]
    fn every_worker_gets_its_own_error_file() {
        let n = NodeAssignment {
            error_dir: Some("/tmp/muster-agent-9-job7/attempt_2".into()),
            ..node()
        };
        for local in 0..n.local_world_size {
            // Even when the agent inherited one (torchrun does the same).
            let env = worker_env(&n, local, &WorkerOptions::default(), |name| {
                name == "TORCHELASTIC_ERROR_FILE"
            });
            let get = |k: &str| env.iter().find(|(n, _)| *n == k).map(|(_, v)| v.clone());
            let path = format!("/tmp/muster-agent-9-job7/attempt_2/rank_{}.json", 4 + local);
            assert_eq!(get("TORCHELASTIC_ERROR_FILE"), Some(path.clone()));
            assert_eq!(get("MUSTER_ERROR_FILE"), Some(path));
        }
        let env = worker_env(&node(), 0, &WorkerOptions::default(), |_| false);
        assert!(
            !env.iter()
                .any(|(k, _)| *k == "TORCHELASTIC_ERROR_FILE" || *k == "MUSTER_ERROR_FILE"),
            "no error folder, no error file"
        );
    }

    #[test]
    fn ranks_are_offset_per_node() {
        let n = node();
        for local in 0..n.local_world_size {
            let env = worker_env(&n, local, &WorkerOptions::default(), |_| false);
            let get = |k: &str| env.iter().find(|(n, _)| *n == k).map(|(_, v)| v.clone());
            assert_eq!(get("RANK"), Some((4 + local).to_string()));
            assert_eq!(get("MUSTER_RANK"), get("RANK"));
            assert_eq!(get("ROLE_RANK"), get("RANK"));
            assert_eq!(get("LOCAL_RANK"), Some(local.to_string()));
        }
    }

    /// The variables `worker_env` adds for `options` (after the common ones), per local rank.
    fn added(options: &WorkerOptions<'_>, local_rank: u32) -> String {
        let base = worker_env(&node(), local_rank, &WorkerOptions::default(), |_| false).len();
        worker_env(&node(), local_rank, options, |_| false)
            .into_iter()
            .skip(base)
            .map(|(k, v)| format!("{k}={v}"))
            .collect::<Vec<_>>()
            .join(" ")
    }

    #[test]
    fn accelerate_launcher_variables_replace_the_defaults() {
        let vars = [
            ("ACCELERATE_DYNAMO_BACKEND", "INDUCTOR".to_owned()),
            ("ACCELERATE_USE_FSDP", "true".to_owned()),
            (OMP_NUM_THREADS, "3".to_owned()),
        ];
        let options = WorkerOptions {
            accelerate: true,
            accelerate_env: Some(&vars),
            ..WorkerOptions::default()
        };
        // node() has two workers, so torchrun's OMP_NUM_THREADS=1 would be set: the flag's
        // value replaces it, and no TorchDynamo default is added.
        let env = worker_env(&node(), 0, &options, |_| false);
        let shown: Vec<String> = env
            .iter()
            .filter(|(k, _)| k.starts_with("ACCELERATE_") || *k == OMP_NUM_THREADS)
            .map(|(k, v)| format!("{k}={v}"))
            .collect();
        assert_eq!(
            shown,
            [
                "ACCELERATE_MIXED_PRECISION=no",
                "ACCELERATE_DYNAMO_BACKEND=INDUCTOR",
                "ACCELERATE_USE_FSDP=true",
                "OMP_NUM_THREADS=3"
            ]
        );
        // Without `accelerate` (a torchrun command line), none of them.
        let options = WorkerOptions {
            accelerate_env: Some(&vars),
            ..WorkerOptions::default()
        };
        let env = worker_env(&node(), 0, &options, |_| false);
        assert!(!env.iter().any(|(k, _)| k.starts_with("ACCELERATE_")));
    }

    #[test]
    fn gpus_and_accelerate_settings() {
        let plan = |mapping, devices: &[&str], set| GpuPlan {
            mapping,
            devices: devices.iter().map(|d| (*d).to_owned()).collect(),
            set_visible_devices: set,
        };
        // Nothing asked for: nothing added, CUDA_VISIBLE_DEVICES passes through.
        assert_eq!(added(&WorkerOptions::default(), 1), "");
        // GPUs discovered (or inherited), local-rank mapping: only muster's variables.
        let found = plan(GpuMapping::LocalRank, &["0", "1"], false);
        let options = WorkerOptions {
            gpus: &found,
            ..WorkerOptions::default()
        };
        assert_eq!(added(&options, 1), "MUSTER_GPU_IDS=1 MUSTER_CUDA_DEVICE=1");
        // --gpu-ids 2,3: every worker sees both and uses the one at LOCAL_RANK.
        let listed = plan(GpuMapping::LocalRank, &["2", "3"], true);
        let options = WorkerOptions {
            gpus: &listed,
            ..WorkerOptions::default()
        };
        assert_eq!(
            added(&options, 0),
            "CUDA_VISIBLE_DEVICES=2,3 MUSTER_GPU_IDS=2 MUSTER_CUDA_DEVICE=0"
        );
        assert_eq!(
            added(&options, 1),
            "CUDA_VISIBLE_DEVICES=2,3 MUSTER_GPU_IDS=3 MUSTER_CUDA_DEVICE=1"
        );
        // One GPU per process: each sees only its own, as device 0.
        let own = plan(GpuMapping::OnePerProcess, &["2", "3"], true);
        let options = WorkerOptions {
            gpus: &own,
            mixed_precision: Some("bf16"),
            use_cpu: false,
            debug: true,
            cpu_affinity: true,
            security: None,
            role: DEFAULT_ROLE,
            virtual_local_rank: false,
            accelerate: false,
            accelerate_env: None,
            agent_store: false,
        };
        assert_eq!(
            added(&options, 1),
            "CUDA_VISIBLE_DEVICES=3 MUSTER_GPU_IDS=3 MUSTER_CUDA_DEVICE=0 \
             ACCELERATE_MIXED_PRECISION=bf16 ACCELERATE_DEBUG_MODE=true ACCELERATE_CPU_AFFINITY=1"
        );
        // A CPU job with Accelerate's settings.
        let options = WorkerOptions {
            mixed_precision: Some("no"),
            use_cpu: true,
            ..WorkerOptions::default()
        };
        assert_eq!(
            added(&options, 0),
            "ACCELERATE_MIXED_PRECISION=no ACCELERATE_USE_CPU=True"
        );
        // An `accelerate launch` command line: Accelerate's launcher's defaults as well.
        let options = WorkerOptions {
            use_cpu: true,
            accelerate: true,
            ..WorkerOptions::default()
        };
        assert_eq!(
            added(&options, 0),
            "ACCELERATE_MIXED_PRECISION=no ACCELERATE_DYNAMO_BACKEND=NO \
             ACCELERATE_DYNAMO_MODE=default ACCELERATE_DYNAMO_USE_FULLGRAPH=False \
             ACCELERATE_DYNAMO_USE_DYNAMIC=False ACCELERATE_DYNAMO_USE_REGIONAL_COMPILATION=False \
             ACCELERATE_USE_CPU=True"
        );
    }

    #[test]
    fn security_settings() {
        use crate::security::SecurityArgs;
        let dir = std::env::temp_dir().join(format!("muster-agent-env-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap_or_else(|e| panic!("{e}"));
        let token = "env-test-cluster-token-0123456789";
        for (file, content) in [
            ("ca.pem", "CA"),
            ("c.pem", "C"),
            ("k.pem", "K"),
            ("t", token),
        ] {
            std::fs::write(dir.join(file), content).unwrap_or_else(|e| panic!("{e}"));
        }
        let args = SecurityArgs {
            tls_ca: Some(dir.join("ca.pem")),
            tls_cert: Some(dir.join("c.pem")),
            tls_key: Some(dir.join("k.pem")),
            tls_domain: Some("coord.svc".into()),
            auth_token_file: Some(dir.join("t")),
        };
        let security = args.resolve().unwrap_or_else(|e| panic!("{e}"));
        let _ = std::fs::remove_dir_all(&dir);
        let options = WorkerOptions {
            security: Some(&security),
            ..WorkerOptions::default()
        };
        let d = dir.to_string_lossy();
        let job_token = muster_core::job_token::mint(token, "job7");
        assert!(job_token.starts_with("mj1."), "{job_token}");
        assert_eq!(
            added(&options, 0),
            format!(
                "MUSTER_TOKEN={job_token} MUSTER_TLS_CA={d}/ca.pem MUSTER_TLS_CERT={d}/c.pem \
                 MUSTER_TLS_KEY={d}/k.pem MUSTER_TLS_DOMAIN=coord.svc"
            )
        );
        // Plaintext adds nothing.
        let plain = crate::security::Security::plaintext();
        let options = WorkerOptions {
            security: Some(&plain),
            ..WorkerOptions::default()
        };
        assert_eq!(added(&options, 0), "");
    }
}
