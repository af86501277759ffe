//! `muster-agent launch` as a drop-in for torchrun and `accelerate launch`: each command line of
//! a table runs once under the real peer (from the peers' venv) and once under
//! `muster-agent launch` with the same arguments (only the launcher word swapped), with one
//! worker, `tests/scripts/dump_worker.py`, that writes per rank what it was given (argv, how it
//! was started, the launcher's environment variables). The two sets of files and the exit
//! statuses must be equal; a failure lists every difference of every row.
//!
//! It needs the peers' virtual environment (PyTorch, Accelerate): `$MUSTER_PEERS_VENV`, else
//! `~/.cache/muster-peers`, made by `scripts/install-peers.sh`. Without it the test prints
//! `skipped: ...` and passes.

use muster_tests::{Agent, Finished, agent_bin, free_port, peers_python, workspace_root};
use serde_json::Value;
use std::collections::BTreeMap;
use std::path::PathBuf;
use std::process::Command;
use std::sync::Mutex;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

/// torchrun alone takes ~2 s here and `accelerate launch` ~3 s; two rows run at once on two
/// cores, each starting up to four Python processes.
const LAUNCH_LIMIT: Duration = Duration::from_secs(90);

/// Rows running at once: the machine has two cores, and more would slow every launch down.
const PARALLEL_ROWS: usize = 2;

/// Held while a row that names no port runs: its launchers use the default one (29500), and
/// two such rows at once collide (the peer's store fails with EADDRINUSE).
static DEFAULT_PORT: Mutex<()> = Mutex::new(());

/// The launcher a row's command line was written for.
#[derive(Debug, Clone, Copy)]
enum Peer {
    /// `torchrun ARGS` against `muster-agent launch ARGS`.
    Torchrun,
    /// `accelerate launch ARGS` against `muster-agent launch ARGS`.
    Accelerate,
}

/// What of the two runs' rank files is compared.
#[derive(Debug, Clone, Copy)]
enum Compare {
    /// Every rank file, every recorded field.
    Everything,
    /// `accelerate launch --cpu` runs ONE plain process (no RANK) on a machine without GPUs
    /// whatever `--num_processes` says (mpirun is its multi-CPU path), where muster runs the
    /// whole world over gloo (see tests/interop.rs): compare that one process's argv, start and
    /// ACCELERATE_*/FSDP_* variables with each of muster's ranks.
    AccelerateSettings,
}

/// One command line, run under both launchers.
struct Row {
    /// Names the row in the report.
    name: &'static str,
    peer: Peer,
    /// The launcher's arguments. `{python}`: the venv's Python; `{scripts}`: the absolute
    /// `tests/scripts`; `{port}`: a free port (one per run); `{node}`: the launcher's index
    /// among the `nodes` started at once.
    args: &'static [&'static str],
    /// Environment variables of the launcher, with the same substitutions.
    env: &'static [(&'static str, &'static str)],
    /// Launchers started at once on this host with the same arguments (a multi-node job).
    nodes: u32,
    /// The rank that exits 3 (once the other ranks of its node have written their files).
    fail_rank: Option<&'static str>,
    /// Extra environment variables the worker records (beyond dump_worker.py's own list).
    keys: &'static [&'static str],
    compare: Compare,
    /// Variables muster's workers must have with these values, left out of the comparison:
    /// the row's comment says why the peer differs.
    muster_sets: &'static [(&'static str, &'static str)],
}

impl Row {
    const fn new(name: &'static str, peer: Peer, args: &'static [&'static str]) -> Self {
        Self {
            name,
            peer,
            args,
            env: &[],
            nodes: 1,
            fail_rank: None,
            keys: &[],
            compare: Compare::Everything,
            muster_sets: &[],
        }
    }
}

/// The table: the command lines of issue 13 (items 2, 4, 5, 6 and the PET_* variables).
const ROWS: &[Row] = &[
    // 2: the implied interpreter, as every torchrun user types it.
    Row::new(
        "script",
        Peer::Torchrun,
        &["--nproc-per-node", "2", "dump_worker.py", "--lr", "1"],
    ),
    Row::new(
        "dot_slash_script_not_executable",
        Peer::Torchrun,
        &["--nproc-per-node", "2", "./dump_worker.py"],
    ),
    // 4: -m/--module, --no-python, --run-path, both spellings.
    Row::new(
        "module",
        Peer::Torchrun,
        &["--nproc-per-node", "2", "-m", "compat_pkg.dump", "--x", "1"],
    ),
    Row::new(
        "module_underscore_spelling",
        Peer::Torchrun,
        &["--nproc_per_node=2", "--module", "compat_pkg.dump"],
    ),
    Row::new(
        "no_python",
        Peer::Torchrun,
        &[
            "--no-python",
            "--nproc-per-node",
            "2",
            "{python}",
            "dump_worker.py",
            "--y",
            "2",
        ],
    ),
    Row::new(
        "run_path",
        Peer::Torchrun,
        &[
            "--nproc-per-node",
            "2",
            "--run-path",
            "{scripts}/dump_worker.py",
            "--z",
            "3",
        ],
    ),
    // 4: torchrun's other flags, a row per owner (process, output, rendezvous) so that one
    // refused flag does not hide the others. (--numa-binding is left out: torchrun itself fails
    // with "No accelerator available for NUMA binding" on a machine without GPUs.)
    Row::new(
        "torchrun_process_flags",
        Peer::Torchrun,
        &[
            "--nproc-per-node",
            "2",
            "--role",
            "trainer",
            "--start-method",
            "spawn",
            "--monitor-interval",
            "0.1",
            "--local-addr",
            "127.0.0.1",
            "--shutdown-timeout",
            "5",
            "--signals-to-handle",
            "SIGTERM,SIGINT",
            "--event-log-handler",
            "null",
            "dump_worker.py",
        ],
    ),
    Row::new(
        "torchrun_output_flags",
        Peer::Torchrun,
        &[
            "--nproc-per-node",
            "2",
            "-r",
            "0",
            "-t",
            "3",
            "--log-line-prefix-template",
            "[${role_name}${rank}]:",
            "--duplicate-stdout-filters",
            "warn",
            "--duplicate-stderr-filters",
            "error",
            "dump_worker.py",
        ],
    ),
    Row::new(
        "standalone",
        Peer::Torchrun,
        &[
            "--standalone",
            "--nproc-per-node",
            "2",
            "--rdzv-conf",
            "read_timeout=60",
            "dump_worker.py",
        ],
    ),
    Row::new(
        "virtual_local_rank",
        Peer::Torchrun,
        &[
            "--nproc-per-node",
            "2",
            "--virtual-local-rank",
            "dump_worker.py",
        ],
    ),
    // 3: the rendezvous flags on one node (the two-node case runs in network namespaces).
    Row::new(
        "c10d_rendezvous_one_node",
        Peer::Torchrun,
        &[
            "--nnodes",
            "1",
            "--nproc-per-node",
            "2",
            "--rdzv-backend",
            "c10d",
            "--rdzv-endpoint",
            "127.0.0.1:{port}",
            "--rdzv-id",
            "compat",
            "dump_worker.py",
        ],
    ),
    // 6: one process per node leaves OMP_NUM_THREADS unset.
    Row::new(
        "one_per_node",
        Peer::Torchrun,
        &["--nproc-per-node", "1", "dump_worker.py"],
    ),
    Row {
        env: &[("OMP_NUM_THREADS", "3")],
        ..Row::new(
            "omp_num_threads_from_the_user",
            Peer::Torchrun,
            &["--nproc-per-node", "2", "dump_worker.py"],
        )
    },
    // The multi-node form of every README: static rendezvous at a master address.
    Row {
        nodes: 2,
        ..Row::new(
            "static_two_nodes",
            Peer::Torchrun,
            &[
                "--nnodes",
                "2",
                "--node-rank",
                "{node}",
                "--master-addr",
                "127.0.0.1",
                "--master-port",
                "{port}",
                "--nproc-per-node",
                "2",
                "dump_worker.py",
            ],
        )
    },
    Row {
        fail_rank: Some("1"),
        ..Row::new(
            "worker_exits_3",
            Peer::Torchrun,
            &["--nproc-per-node", "2", "dump_worker.py"],
        )
    },
    // The PET_* variables (Kubeflow Trainer's), no flags.
    Row {
        env: &[("PET_NPROC_PER_NODE", "2")],
        ..Row::new("pet_nproc_per_node", Peer::Torchrun, &["dump_worker.py"])
    },
    Row {
        env: &[
            ("PET_NNODES", "1"),
            ("PET_NPROC_PER_NODE", "2"),
            ("PET_NODE_RANK", "0"),
            ("PET_MASTER_ADDR", "127.0.0.1"),
            ("PET_MASTER_PORT", "{port}"),
        ],
        ..Row::new("pet_one_node", Peer::Torchrun, &["dump_worker.py"])
    },
    Row {
        env: &[
            ("PET_NNODES", "2"),
            ("PET_NPROC_PER_NODE", "2"),
            ("PET_NODE_RANK", "{node}"),
            ("PET_MASTER_ADDR", "127.0.0.1"),
            ("PET_MASTER_PORT", "{port}"),
        ],
        nodes: 2,
        ..Row::new("pet_two_nodes", Peer::Torchrun, &["dump_worker.py"])
    },
    // 5: `accelerate launch` flags from generated commands. On a machine without GPUs,
    // Accelerate runs `--num_processes 2` as ONE process unless the job is multi-GPU, FSDP or
    // DeepSpeed: the rows say `--multi_gpu` or `--use_fsdp`, as `accelerate config` writes on a
    // machine with GPUs. Left out, because Accelerate itself fails here: `--use_deepspeed`
    // (DeepSpeed is not in the peers' venv), `--mixed_precision fp8 --fp8_backend` ("FP8 is not
    // available on this machine"), `--tpu` (torch_xla), `--mpirun_hostfile` (mpirun).
    Row {
        keys: &["K"],
        // Accelerate applies `--env` to TPU pods only; muster gives it to the workers.
        muster_sets: &[("K", "V")],
        ..Row::new(
            "accelerate_fsdp",
            Peer::Accelerate,
            &[
                "--num_processes",
                "2",
                "-q",
                "--num_cpu_threads_per_process",
                "2",
                "--dynamo_backend",
                "no",
                "--gradient_accumulation_steps",
                "4",
                "--use_fsdp",
                "--fsdp_sharding_strategy",
                "FULL_SHARD",
                "--fsdp_offload_params",
                "true",
                "--fsdp_state_dict_type",
                "SHARDED_STATE_DICT",
                "--env",
                "K=V",
                "dump_worker.py",
                "--x",
                "1",
            ],
        )
    },
    // The same settings from the file `accelerate config` writes: the config file's sections
    // become the same variables as the flags.
    Row::new(
        "accelerate_fsdp_config_file",
        Peer::Accelerate,
        &["--config_file", "fsdp_config.yaml", "dump_worker.py"],
    ),
    // The same file as Accelerate's default (`$HF_HOME/accelerate/default_config.yaml`), read
    // by both without --config_file when an Accelerate flag is given: a side that did not read
    // it would run 1 rank, not 2, without the FSDP variables.
    Row {
        env: &[("HF_HOME", "{scripts}/hf_home")],
        ..Row::new(
            "accelerate_default_config_file",
            Peer::Accelerate,
            &["--mixed_precision", "bf16", "dump_worker.py"],
        )
    },
    Row::new(
        "accelerate_generated",
        Peer::Accelerate,
        &[
            "--multi_gpu",
            "--num_processes",
            "2",
            "--num_machines",
            "1",
            "--machine_rank",
            "0",
            "--mixed_precision",
            "bf16",
            "--dynamo_backend",
            "inductor",
            "--dynamo_mode",
            "max-autotune",
            "--same_network",
            "--main_training_function",
            "main",
            "--downcast_bf16",
            "--gradient_accumulation_steps",
            "2",
            "dump_worker.py",
        ],
    ),
    Row::new(
        "accelerate_module",
        Peer::Accelerate,
        &[
            "--multi_gpu",
            "--num_processes",
            "2",
            "--module",
            "compat_pkg.dump",
            "--x",
            "1",
        ],
    ),
    Row::new(
        "accelerate_no_python",
        Peer::Accelerate,
        &[
            "--multi_gpu",
            "--num_processes",
            "2",
            "--no_python",
            "{python}",
            "dump_worker.py",
            "--y",
            "2",
        ],
    ),
    Row {
        compare: Compare::AccelerateSettings,
        ..Row::new(
            "accelerate_cpu_bf16",
            Peer::Accelerate,
            &[
                "--num_processes",
                "2",
                "--mixed_precision",
                "bf16",
                "--cpu",
                "dump_worker.py",
            ],
        )
    },
    Row {
        nodes: 2,
        ..Row::new(
            "accelerate_two_machines",
            Peer::Accelerate,
            &[
                "--multi_gpu",
                "--num_machines",
                "2",
                "--machine_rank",
                "{node}",
                "--main_process_ip",
                "127.0.0.1",
                "--main_process_port",
                "{port}",
                "--num_processes",
                "4",
                "dump_worker.py",
            ],
        )
    },
    Row {
        fail_rank: Some("1"),
        ..Row::new(
            "accelerate_worker_exits_3",
            Peer::Accelerate,
            &["--multi_gpu", "--num_processes", "2", "dump_worker.py"],
        )
    },
];

/// Where a row's launchers run and what they share.
struct Setup {
    /// The peers' venv `bin/` (torchrun, accelerate, python).
    venv_bin: PathBuf,
    /// `tests/scripts`: the launchers' working directory (so `-m compat_pkg.dump` imports).
    scripts: PathBuf,
    /// An empty HF_HOME, so that no `accelerate config` default file changes a run.
    hf_home: PathBuf,
    /// A scratch directory for the rank files.
    scratch: PathBuf,
}

/// One rank file, flattened: `argv`, `entry`, `env.RANK`, ... to their JSON values.
type Record = BTreeMap<String, Value>;

/// One launcher side of a row.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Side {
    Peer,
    Muster,
}

/// What one side of a row produced.
struct Outcome {
    /// Each launcher's run (one per node).
    runs: Vec<Finished>,
    /// Rank file name (`rank1.json`) to its record, flattened to `field` -> JSON value.
    ranks: BTreeMap<String, Record>,
}

/// Variables a launch must not inherit from the test's own environment (a CI job under
/// torchrun or Slurm, a developer's Accelerate settings).
fn inherited_launcher_variable(name: &str) -> bool {
    const PREFIXES: &[&str] = &[
        "PET_",
        "SLURM_",
        "ACCELERATE_",
        "FSDP_",
        "TORCHELASTIC_",
        "MUSTER_",
    ];
    const NAMES: &[&str] = &[
        "RANK",
        "LOCAL_RANK",
        "WORLD_SIZE",
        "LOCAL_WORLD_SIZE",
        "GROUP_RANK",
        "GROUP_WORLD_SIZE",
        "ROLE_NAME",
        "ROLE_RANK",
        "ROLE_WORLD_SIZE",
        "MASTER_ADDR",
        "MASTER_PORT",
        "OMP_NUM_THREADS",
        "PYTHON_EXEC",
    ];
    PREFIXES.iter().any(|p| name.starts_with(p)) || NAMES.contains(&name)
}

fn substitute(text: &str, setup: &Setup, port: u16, node: u32) -> String {
    text.replace("{python}", &setup.venv_bin.join("python").to_string_lossy())
        .replace("{scripts}", &setup.scripts.to_string_lossy())
        .replace("{port}", &port.to_string())
        .replace("{node}", &node.to_string())
}

/// Runs `row` under one launcher: its `nodes` launchers at once, each to the end.
fn run_side(row: &Row, side: Side, setup: &Setup) -> Outcome {
    let out = setup.scratch.join(format!("{}-{side:?}", row.name));
    std::fs::create_dir_all(&out).expect("the scratch directory can be created");
    let port = free_port();
    let path = std::env::var_os("PATH").unwrap_or_default();
    let mut path_list = vec![setup.venv_bin.clone()];
    path_list.extend(std::env::split_paths(&path));
    let path = std::env::join_paths(path_list).expect("PATH entries without ':'");
    let agents: Vec<Agent> = (0..row.nodes)
        .map(|node| {
            let (program, mut args) = match (side, row.peer) {
                (Side::Peer, Peer::Torchrun) => (setup.venv_bin.join("torchrun"), vec![]),
                (Side::Peer, Peer::Accelerate) => {
                    (setup.venv_bin.join("accelerate"), vec!["launch".to_owned()])
                }
                (Side::Muster, _) => (agent_bin(), vec!["launch".to_owned()]),
            };
            args.extend(row.args.iter().map(|a| substitute(a, setup, port, node)));
            let mut cmd = Command::new(&program);
            for (name, _) in std::env::vars_os() {
                if inherited_launcher_variable(&name.to_string_lossy()) {
                    cmd.env_remove(name);
                }
            }
            cmd.args(&args)
                .current_dir(&setup.scripts)
                // As a user who activated the venv: `python` is the venv's.
                .env("PATH", &path)
                .env("HF_HOME", &setup.hf_home)
                .env("MUSTER_COMPAT_OUT", &out)
                .env("MUSTER_COMPAT_KEYS", row.keys.join(","));
            if let Some(rank) = row.fail_rank {
                cmd.env("MUSTER_COMPAT_FAIL_RANK", rank);
            }
            for (name, value) in row.env {
                cmd.env(name, substitute(value, setup, port, node));
            }
            let label = format!("{} {}", program.display(), args.join(" "));
            Agent::spawn(cmd, label)
        })
        .collect();
    let runs = agents
        .into_iter()
        .map(|agent| agent.finish(LAUNCH_LIMIT))
        .collect();
    let mut ranks = BTreeMap::new();
    for entry in std::fs::read_dir(&out).expect("the rank directory is readable") {
        let entry = entry.expect("a rank directory entry");
        let name = entry.file_name().to_string_lossy().into_owned();
        if !name.ends_with(".json") {
            continue;
        }
        let text = std::fs::read_to_string(entry.path()).expect("a rank file is readable");
        let record: Value = serde_json::from_str(&text).expect("a rank file is JSON");
        ranks.insert(name, flatten(&record));
    }
    Outcome { runs, ranks }
}

/// `{"argv": [...], "env": {"RANK": "1"}}` as `argv` -> `[...]`, `env.RANK` -> `"1"`.
fn flatten(record: &Value) -> Record {
    let mut fields = BTreeMap::new();
    if let Value::Object(top) = record {
        for (key, value) in top {
            match value {
                Value::Object(inner) => {
                    for (name, v) in inner {
                        fields.insert(format!("{key}.{name}"), v.clone());
                    }
                }
                other => {
                    fields.insert(key.clone(), other.clone());
                }
            }
        }
    }
    fields
}

/// Fields that differ legitimately, left out of every comparison. MASTER_PORT,
/// TORCHELASTIC_RUN_ID and MASTER_ADDR are recorded as present/absent only by the worker (a
/// free port, a generated run id, a resolved host name are each launcher's own).
fn excluded(field: &str, peer: Option<&Value>, muster: Option<&Value>) -> bool {
    // On a machine without GPUs muster adds ACCELERATE_USE_CPU=True (launch.rs, spawn_all) so
    // that an Accelerate script under it runs as one world over gloo, where Accelerate would
    // run each process alone; torchrun sets nothing Accelerate-specific.
    field == "env.ACCELERATE_USE_CPU"
        && peer.is_none()
        && muster == Some(&Value::String("True".into()))
}

/// Every difference between the peer's rank files and muster's, one line each.
fn differences(row: &Row, peer: &Outcome, muster: &Outcome) -> Vec<String> {
    let mut diffs = Vec::new();
    let codes = |o: &Outcome| o.runs.iter().map(Finished::code).collect::<Vec<_>>();
    if codes(peer) != codes(muster) {
        diffs.push(format!(
            "exit status: peer {:?}, muster {:?}",
            codes(peer),
            codes(muster)
        ));
    }
    let mut muster_ranks = muster.ranks.clone();
    for (file, fields) in &mut muster_ranks {
        for (name, expected) in row.muster_sets {
            let key = format!("env.{name}");
            let got = fields.remove(&key);
            if got.as_ref().and_then(Value::as_str) != Some(expected) {
                diffs.push(format!(
                    "{file}: {key}: muster {got:?}, expected {expected:?}"
                ));
            }
        }
    }
    let mut peer_ranks = peer.ranks.clone();
    for fields in peer_ranks.values_mut() {
        for (name, _) in row.muster_sets {
            fields.remove(&format!("env.{name}"));
        }
    }
    let pairs: Vec<(String, &Record, &Record)> = match row.compare {
        Compare::Everything => {
            let peer_files: Vec<_> = peer_ranks.keys().collect();
            let muster_files: Vec<_> = muster_ranks.keys().collect();
            if peer_files != muster_files {
                diffs.push(format!(
                    "rank files: peer {peer_files:?}, muster {muster_files:?}"
                ));
            }
            peer_ranks
                .iter()
                .filter_map(|(file, p)| muster_ranks.get(file).map(|m| (file.clone(), p, m)))
                .collect()
        }
        Compare::AccelerateSettings => {
            let Some(only) = peer_ranks.values().next().filter(|_| peer_ranks.len() == 1) else {
                diffs.push(format!(
                    "the peer wrote {} rank files where Accelerate's --cpu runs one process",
                    peer_ranks.len()
                ));
                return diffs;
            };
            if muster_ranks.is_empty() {
                diffs.push("muster's workers wrote no rank file".to_owned());
            }
            muster_ranks
                .iter()
                .map(|(file, m)| (file.clone(), only, m))
                .collect()
        }
    };
    let compared = |field: &str| match row.compare {
        Compare::Everything => true,
        Compare::AccelerateSettings => {
            ["argv", "entry", "prefix", "cwd"].contains(&field)
                || field.starts_with("env.ACCELERATE_")
                || field.starts_with("env.FSDP_")
        }
    };
    // The same difference in several rank files is one line naming them all.
    let mut grouped: BTreeMap<String, Vec<String>> = BTreeMap::new();
    for (file, p, m) in pairs {
        let fields: std::collections::BTreeSet<&String> = p.keys().chain(m.keys()).collect();
        for field in fields {
            let (pv, mv) = (p.get(field), m.get(field));
            if pv == mv || !compared(field) || excluded(field, pv, mv) {
                continue;
            }
            let show =
                |v: Option<&Value>| v.map_or_else(|| "(absent)".to_owned(), Value::to_string);
            let diff = format!("{field}: peer {}, muster {}", show(pv), show(mv));
            grouped.entry(diff).or_default().push(file.clone());
        }
    }
    for (diff, files) in grouped {
        diffs.push(format!("{}: {diff}", files.join(" ")));
    }
    diffs
}

/// The last lines of a run's stderr, for a failing row's report.
fn tail(run: &Finished) -> String {
    let skip = run.stderr.len().saturating_sub(8);
    run.stderr[skip..].join("\n      ")
}

#[test]
fn torchrun_and_accelerate_command_lines_give_the_workers_the_same_under_muster() {
    let Some(python) = peers_python(&["torch", "accelerate"]) else {
        return;
    };
    let venv_bin = python.parent().expect("the venv's bin").to_path_buf();
    for tool in ["torchrun", "accelerate"] {
        if !venv_bin.join(tool).exists() {
            eprintln!("skipped: the peers' venv has no {tool} (run scripts/install-peers.sh)");
            return;
        }
    }
    let scratch = std::env::temp_dir().join(format!("muster-launch-compat-{}", std::process::id()));
    let setup = Setup {
        venv_bin,
        scripts: workspace_root().join("tests/scripts"),
        hf_home: scratch.join("hf-home"),
        scratch: scratch.clone(),
    };
    std::fs::create_dir_all(&setup.hf_home).expect("the scratch directory can be created");
    // Each row's rank files go to a directory named after it.
    let mut names: Vec<&str> = ROWS.iter().map(|r| r.name).collect();
    names.sort_unstable();
    names.dedup();
    assert_eq!(
        names.len(),
        ROWS.len(),
        "two rows of the table share a name"
    );
    // Build the agent before the threads race to.
    let _ = agent_bin();

    let next = AtomicUsize::new(0);
    let reports: Mutex<Vec<(usize, String, Vec<String>)>> = Mutex::new(Vec::new());
    std::thread::scope(|scope| {
        for _ in 0..PARALLEL_ROWS {
            scope.spawn(|| {
                loop {
                    let index = next.fetch_add(1, Ordering::Relaxed);
                    let Some(row) = ROWS.get(index) else { break };
                    let names_a_port = row.args.iter().any(|a| a.contains("{port}"))
                        || row.env.iter().any(|(_, v)| v.contains("{port}"));
                    let _default_port = (!names_a_port).then(|| {
                        DEFAULT_PORT
                            .lock()
                            .unwrap_or_else(std::sync::PoisonError::into_inner)
                    });
                    let peer = run_side(row, Side::Peer, &setup);
                    let muster = run_side(row, Side::Muster, &setup);
                    let diffs = differences(row, &peer, &muster);
                    let timing = |o: &Outcome| {
                        o.runs
                            .iter()
                            .map(|r| format!("{:.2}s", r.elapsed.as_secs_f64()))
                            .collect::<Vec<_>>()
                            .join("+")
                    };
                    let mut line = format!(
                        "{:<32} {:<10} peer {} muster {}: {}",
                        row.name,
                        format!("{:?}", row.peer),
                        timing(&peer),
                        timing(&muster),
                        if diffs.is_empty() {
                            "same".to_owned()
                        } else {
                            format!("{} differences", diffs.len())
                        }
                    );
                    eprintln!("{line}");
                    if !diffs.is_empty() {
                        for (side, outcome) in [("peer", &peer), ("muster", &muster)] {
                            // The peer's output only where it failed unasked.
                            let quiet = side == "peer" && row.fail_rank.is_none();
                            for run in &outcome.runs {
                                if quiet && run.code() == Some(0) {
                                    continue;
                                }
                                line.push_str(&format!(
                                    "\n    {side} exit {:?}, stderr tail:\n      {}",
                                    run.code(),
                                    tail(run)
                                ));
                            }
                        }
                    }
                    reports
                        .lock()
                        .unwrap_or_else(std::sync::PoisonError::into_inner)
                        .push((index, line, diffs));
                }
            });
        }
    });
    let _ = std::fs::remove_dir_all(&scratch);
    let mut reports = reports
        .into_inner()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    reports.sort_by_key(|(index, _, _)| *index);
    let failed: Vec<String> = reports
        .iter()
        .filter(|(_, _, diffs)| !diffs.is_empty())
        .map(|(_, line, diffs)| format!("{line}\n  - {}", diffs.join("\n  - ")))
        .collect();
    assert!(
        failed.is_empty(),
        "{} of {} rows differ between the peer and muster:\n{}",
        failed.len(),
        ROWS.len(),
        failed.join("\n")
    );
}
