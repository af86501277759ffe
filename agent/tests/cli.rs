//! The built `muster-agent` binary's command line: help, bad input (one line, exit status 2,
//! nothing started), Accelerate config files, and a few minimal launches that check the
//! workers' environment and output. (This file also makes `cargo test --workspace` build the
//! binary that the end-to-end tests in `tests/` run.)

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

fn agent(args: &[&str]) -> Output {
    agent_in(args, &[])
}

/// Runs the agent with extra environment variables (`env`), without the test's
/// CUDA_VISIBLE_DEVICES so that its GPU checks see the machine as it is, and without the
/// torchrun (`PET_*`) and Slurm variables of the test's own environment, which set flags.
fn agent_in(args: &[&str], env: &[(&str, &str)]) -> Output {
    agent_at(None, args, env)
}

/// [`agent_in`] in the folder `dir`.
fn agent_at(dir: Option<&Path>, args: &[&str], env: &[(&str, &str)]) -> Output {
    let mut command = Command::new(env!("CARGO_BIN_EXE_muster-agent"));
    command.args(args).env_remove("CUDA_VISIBLE_DEVICES");
    for (name, _) in std::env::vars_os() {
        let name = name.to_string_lossy();
        if name.starts_with("PET_") || name.starts_with("SLURM_") {
            command.env_remove(&*name);
        }
    }
    if let Some(dir) = dir {
        command.current_dir(dir);
    }
    command
        .envs(env.iter().copied())
        .output()
        .expect("muster-agent runs")
}

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

/// A fresh scratch folder for one test, removed when dropped.
struct Scratch(PathBuf);

impl Scratch {
    fn new(name: &str) -> Self {
        let dir = std::env::temp_dir().join(format!("muster-cli-{}-{name}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("scratch folder");
        Self(dir)
    }

    fn file(&self, name: &str, contents: &str) -> String {
        let path = self.0.join(name);
        std::fs::write(&path, contents).expect("scratch file");
        path.to_string_lossy().into_owned()
    }

    fn path(&self, name: &str) -> PathBuf {
        self.0.join(name)
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

#[test]
fn help_mentions_the_launch_flags() {
    let out = agent(&["launch", "--help"]);
    assert!(out.status.success());
    let help = text(&out.stdout);
    for flag in [
        "--nproc-per-node",
        "--coordinator",
        "--job-id",
        "--nnodes",
        "--node-rank",
        "--advertise-addr",
        "--max-restarts",
        "--grace-period-ms",
        "--no-relay",
        "--join-timeout-ms",
        "--last-call-ms",
        "--rdzv-conf",
        "--lease-ms",
        "--failover-timeout-ms",
        "--master-addr",
        "--master-port",
        "--gpu-ids",
        "--gpu-mapping",
        "--log-dir",
        "--local-ranks-filter",
        "--config-file",
        "--num_processes",
        "--num_machines",
        "--machine_rank",
        "--main_process_ip",
        "--main_process_port",
        "--mixed-precision",
        "--cpu",
        "--multi_gpu",
        "--metrics-addr",
        "torchrun compatibility:",
        "-m, --module",
        "--no-python",
        "--run-path",
        "--role",
        "--shutdown-timeout",
        "--local-addr",
        "--virtual-local-rank",
        "--start-method",
        "--signals-to-handle",
        "[env: PET_NNODES=]",
        "[env: PET_NPROC_PER_NODE=]",
        "No effect under muster",
    ] {
        assert!(help.contains(flag), "{flag} missing from\n{help}");
    }
}

/// Runs a launch that must be refused: exit status 2, exactly `expected` on stderr, nothing on
/// stdout, and no worker started (the program would create `marker`).
fn refused(args: &[&str], expected: &str) {
    let scratch = Scratch::new("refused");
    let marker = scratch.path("marker");
    let touch = format!("touch {}", marker.display());
    let mut argv = args.to_vec();
    argv.extend(["--", "sh", "-c", &touch]);
    let out = agent(&argv);
    assert_eq!(
        out.status.code(),
        Some(2),
        "{args:?}: {}",
        text(&out.stderr)
    );
    assert_eq!(
        text(&out.stderr),
        format!("muster-agent: {expected}\n"),
        "{args:?}"
    );
    assert!(out.stdout.is_empty(), "{args:?}");
    assert!(!marker.exists(), "{args:?} started a worker");
}

#[test]
fn bad_input_is_one_line_and_status_2() {
    for (args, expected) in [
        (
            &["launch", "--nproc-per-node", "0", "--", "true"][..],
            "muster-agent: --nproc-per-node 0 is out of range 1..=4096\n",
        ),
        (
            &[
                "launch",
                "--nproc-per-node",
                "1",
                "--",
                "no-such-program-for-muster",
            ][..],
            "muster-agent: program 'no-such-program-for-muster' was not found in PATH\n",
        ),
    ] {
        let out = agent(args);
        assert_eq!(out.status.code(), Some(2), "{args:?}");
        assert_eq!(text(&out.stderr), expected, "{args:?}");
        assert!(out.stdout.is_empty());
    }
    refused(
        &["launch", "--nproc-per-node", "4", "--num_processes", "6"],
        "--nproc-per-node 4 conflicts with --num_processes 6 (with --nnodes 1)",
    );
    refused(
        &[
            "launch",
            "--join-timeout-ms",
            "1",
            "--rdzv-conf",
            "join_timeout=2",
        ],
        "--join-timeout-ms 1 conflicts with --rdzv-conf join_timeout=2",
    );
    refused(
        &["launch", "--rdzv-conf", "is_host=2"],
        "invalid value 'is_host=2' for '--rdzv-conf <KEY=VALUE,...>': is_host=2: expected true or false (see `muster-agent launch --help`)",
    );
    refused(
        &[
            "launch",
            "--nproc-per-node",
            "2",
            "--local-ranks-filter",
            "5",
        ],
        "--local-ranks-filter '5': local rank 5 does not exist (local ranks are 0..2)",
    );
    refused(
        &["launch", "--metrics-addr", "localhost:9100"],
        "invalid value 'localhost:9100' for '--metrics-addr <IP:PORT>': invalid socket address syntax (see `muster-agent launch --help`)",
    );
    let out = agent(&[
        "serve",
        "--coordinator",
        "127.0.0.1:1",
        "--metrics-addr",
        "9100",
    ]);
    assert_eq!(out.status.code(), Some(2));
    assert_eq!(
        text(&out.stderr),
        "muster-agent: invalid value '9100' for '--metrics-addr <IP:PORT>': invalid socket address syntax (see `muster-agent launch --help`)\n"
    );
}

#[test]
fn bad_config_files_are_refused_before_anything_runs() {
    let scratch = Scratch::new("bad-config");
    let missing = scratch.path("missing.yaml");
    let missing = missing.to_string_lossy();
    refused(
        &["launch", "--config-file", &missing],
        &format!(
            "--config-file '{missing}': cannot read it: No such file or directory (os error 2)"
        ),
    );
    let bad = scratch.file("bad.yaml", "num_processes: two\nmixed_precision: fp16\n");
    refused(
        &["launch", "--config_file", &bad],
        &format!(
            "--config-file '{bad}': num_processes: expected a whole number from 1 to 4294967295, found \"two\""
        ),
    );
    let indivisible = scratch.file(
        "indivisible.yaml",
        "num_processes: 3\nnum_machines: 2\nmain_process_ip: 10.0.0.1\n",
    );
    refused(
        &["launch", "--config-file", &indivisible],
        &format!(
            "num_processes 3 in '{indivisible}' is not a multiple of num_machines 2 in '{indivisible}'"
        ),
    );
    let precision = scratch.file("precision.yaml", "mixed_precision: fp12\n");
    refused(
        &["launch", "--config-file", &precision],
        &format!(
            "--config-file '{precision}': mixed_precision: expected one of no, fp16, bf16, fp8, found \"fp12\""
        ),
    );
    let unreadable = scratch.file("list.yaml", "[1, 2\n");
    let out = agent(&["launch", "--config-file", &unreadable, "--", "true"]);
    assert_eq!(out.status.code(), Some(2));
    let stderr = text(&out.stderr);
    assert!(
        stderr.starts_with(&format!(
            "muster-agent: --config-file '{unreadable}': is not valid YAML: "
        )) && stderr.lines().count() == 1,
        "{stderr}"
    );
}

#[test]
fn one_worker_runs_and_its_output_is_prefixed() {
    let out = agent(&[
        "launch",
        "--nproc-per-node",
        "1",
        "--",
        "sh",
        "-c",
        "echo hi",
    ]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert_eq!(text(&out.stdout), "[rank 0] hi\n");
}

#[test]
fn a_config_file_sets_workers_and_accelerate_variables() {
    let scratch = Scratch::new("good-config");
    let config = scratch.file(
        "accelerate.yaml",
        "compute_environment: LOCAL_MACHINE
distributed_type: MULTI_CPU
mixed_precision: bf16
num_machines: 1
num_processes: 2
use_cpu: true
some_future_key: 1
",
    );
    let out = agent(&[
        "launch",
        "--config-file",
        &config,
        "--local-ranks-filter",
        "1",
        "--",
        "sh",
        "-c",
        "echo $RANK/$WORLD_SIZE $ACCELERATE_MIXED_PRECISION $ACCELERATE_USE_CPU",
    ]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert_eq!(text(&out.stdout), "[rank 1] 1/2 bf16 True\n");
    assert!(
        text(&out.stderr).contains(&format!(
            "muster-agent: warning: --config-file '{config}': unknown key some_future_key is ignored\n"
        )),
        "{}",
        text(&out.stderr)
    );
}

#[test]
fn gpu_ids_reach_the_workers() {
    // Whatever this machine has, an id list is what the workers see (on a machine without an
    // NVIDIA driver, with a warning); one GPU per process gives each worker its own.
    let has_two =
        muster_agent::gpu::probe().gpus.len() >= 2 || !muster_agent::gpu::probe().driver_seen;
    if !has_two {
        eprintln!("skipped: this machine has an NVIDIA driver but fewer than 2 GPUs");
        return;
    }
    let show = "echo $LOCAL_RANK:$CUDA_VISIBLE_DEVICES:$MUSTER_GPU_IDS:$MUSTER_CUDA_DEVICE";
    let out = agent(&[
        "launch",
        "--nproc-per-node",
        "2",
        "--gpu-ids",
        "1,0",
        "--local-ranks-filter",
        "1",
        "--",
        "sh",
        "-c",
        show,
    ]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert_eq!(text(&out.stdout), "[rank 1] 1:1,0:0:1\n");
    let out = agent(&[
        "launch",
        "--nproc-per-node",
        "2",
        "--gpu_ids",
        "1,0",
        "--gpu-mapping",
        "one-per-process",
        "--local-ranks-filter",
        "1",
        "--",
        "sh",
        "-c",
        show,
    ]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert_eq!(text(&out.stdout), "[rank 1] 1:0:0:0\n");
    // Without --gpu-ids the agent's own CUDA_VISIBLE_DEVICES passes through.
    let out = agent_in(
        &["launch", "--", "sh", "-c", show],
        &[("CUDA_VISIBLE_DEVICES", "7")],
    );
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert_eq!(text(&out.stdout), "[rank 0] 0:7:7:0\n");
}

fn read(path: &Path) -> String {
    std::fs::read_to_string(path).unwrap_or_else(|e| panic!("cannot read {}: {e}", path.display()))
}

#[test]
fn log_dir_keeps_every_rank_and_the_filter_picks_the_console() {
    let scratch = Scratch::new("logs");
    let dir = scratch.path("logs");
    let out = agent(&[
        "launch",
        "--nproc-per-node",
        "2",
        "--job-id",
        "logged",
        "--log-dir",
        &dir.to_string_lossy(),
        "--local-ranks-filter",
        "0",
        "--",
        "sh",
        "-c",
        "echo out $RANK; echo err $RANK >&2; printf 'no newline'",
    ]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert_eq!(text(&out.stdout), "[rank 0] out 0\n[rank 0] no newline\n");
    assert!(text(&out.stderr).contains("[rank 0] err 0\n"));
    assert!(
        !text(&out.stderr).contains("[rank 1]"),
        "{}",
        text(&out.stderr)
    );
    let attempt = dir.join("logged").join("attempt_0");
    for rank in 0..2 {
        let rank_dir = attempt.join(format!("rank_{rank}"));
        assert_eq!(
            read(&rank_dir.join("stdout.log")),
            format!("out {rank}\nno newline\n")
        );
        assert_eq!(read(&rank_dir.join("stderr.log")), format!("err {rank}\n"));
    }
}

/// A stand-in interpreter that prints what it was given, so that the tests need no Python.
fn fake_python(scratch: &Scratch) -> String {
    let path = scratch.file(
        "fakepy",
        "#!/bin/sh\necho \"$LOCAL_RANK $ROLE_NAME ${OMP_NUM_THREADS-unset}: $*\"\n",
    );
    std::fs::set_permissions(&path, std::os::unix::fs::PermissionsExt::from_mode(0o755))
        .expect("chmod");
    path
}

/// The workers' output lines, sorted (the ranks print concurrently).
fn lines(out: &Output) -> Vec<String> {
    let mut lines: Vec<String> = text(&out.stdout).lines().map(str::to_owned).collect();
    lines.sort();
    lines
}

#[test]
fn a_python_script_runs_with_python_as_under_torchrun() {
    let scratch = Scratch::new("implied");
    let python = fake_python(&scratch);
    scratch.file("train.py", "print('hi')\n");
    let env = [("MUSTER_PYTHON", python.as_str()), ("OMP_NUM_THREADS", "3")];
    // No `--`: the script's flags are its own.
    let out = agent_at(
        Some(&scratch.0),
        &["launch", "--nproc-per-node", "2", "train.py", "--lr", "1"],
        &env,
    );
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert_eq!(
        lines(&out),
        [
            "[rank 0] 0 default 3: -u train.py --lr 1",
            "[rank 1] 1 default 3: -u train.py --lr 1"
        ]
    );
    // -m and --role; --no-python runs the program itself.
    let out = agent_at(
        Some(&scratch.0),
        &["launch", "--role", "trainer", "-m", "pkg.train", "--x"],
        &env,
    );
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert_eq!(lines(&out), ["[rank 0] 0 trainer 3: -u -m pkg.train --x"]);
    let out = agent_at(
        Some(&scratch.0),
        &["launch", "--no-python", &python, "a"],
        &env,
    );
    assert_eq!(lines(&out), ["[rank 0] 0 default 3: a"]);
    let out = agent_at(
        Some(&scratch.0),
        &["launch", "--no_python", "train.py"],
        &env,
    );
    assert_eq!(out.status.code(), Some(2));
    assert_eq!(
        text(&out.stderr),
        "muster-agent: program 'train.py' was not found in PATH\n"
    );
}

#[test]
fn pet_variables_set_flags_and_flags_win() {
    let scratch = Scratch::new("pet");
    let python = fake_python(&scratch);
    scratch.file("train.py", "");
    let env = [
        ("MUSTER_PYTHON", python.as_str()),
        ("PET_NPROC_PER_NODE", "2"),
        ("PET_ROLE", "from-pet"),
        ("PET_MAX_RESTARTS", "0"),
        ("OMP_NUM_THREADS", "3"),
    ];
    let out = agent_at(Some(&scratch.0), &["launch", "train.py"], &env);
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert_eq!(
        lines(&out),
        [
            "[rank 0] 0 from-pet 3: -u train.py",
            "[rank 1] 1 from-pet 3: -u train.py"
        ]
    );
    let out = agent_at(
        Some(&scratch.0),
        &[
            "launch",
            "--nproc-per-node",
            "1",
            "--role",
            "flag",
            "train.py",
        ],
        &env,
    );
    assert_eq!(lines(&out), ["[rank 0] 0 flag 3: -u train.py"]);
    // torchrun's boolean variables: PET_NO_PYTHON=1 is --no-python.
    let out = agent_at(
        Some(&scratch.0),
        &["launch", &python, "x"],
        &[
            ("PET_NO_PYTHON", "1"),
            ("PET_NPROC_PER_NODE", "1"),
            ("OMP_NUM_THREADS", "3"),
        ],
    );
    assert_eq!(lines(&out), ["[rank 0] 0 default 3: x"]);
    let out = agent_at(
        Some(&scratch.0),
        &["launch", "train.py"],
        &[
            ("PET_NO_PYTHON", "0"),
            ("MUSTER_PYTHON", python.as_str()),
            ("OMP_NUM_THREADS", "3"),
        ],
    );
    assert_eq!(lines(&out), ["[rank 0] 0 default 3: -u train.py"]);
    let out = agent_in(&["launch", "--", "true"], &[("PET_NNODES", "0")]);
    assert_eq!(out.status.code(), Some(2));
    assert_eq!(
        text(&out.stderr),
        "muster-agent: --nnodes '0' is malformed: a job needs at least 1 node\n"
    );
}

#[test]
fn omp_num_threads_only_with_several_workers_and_notes_for_the_rest() {
    let scratch = Scratch::new("omp");
    let python = fake_python(&scratch);
    let run = |n: &str, extra: &[&str]| {
        let mut args = vec!["launch", "--nproc-per-node", n];
        args.extend(extra);
        args.extend(["--no-python", python.as_str()]);
        let mut command = Command::new(env!("CARGO_BIN_EXE_muster-agent"));
        command.args(&args).env_remove("OMP_NUM_THREADS");
        for (name, _) in std::env::vars_os() {
            let name = name.to_string_lossy();
            if name.starts_with("PET_") || name.starts_with("SLURM_") {
                command.env_remove(&*name);
            }
        }
        command.output().expect("muster-agent runs")
    };
    let out = run("1", &[]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert_eq!(lines(&out), ["[rank 0] 0 default unset: "]);
    assert!(
        !text(&out.stderr).contains("OMP_NUM_THREADS"),
        "{}",
        text(&out.stderr)
    );
    let out = run("2", &["--start-method", "forkserver"]);
    assert_eq!(
        lines(&out),
        ["[rank 0] 0 default 1: ", "[rank 1] 1 default 1: "]
    );
    let stderr = text(&out.stderr);
    let warning = "muster-agent: warning: Setting OMP_NUM_THREADS environment variable for each process to be 1 in default";
    assert_eq!(stderr.matches(warning).count(), 1, "{stderr}");
    assert!(
        stderr.contains("muster-agent: note: --start-method forkserver has no effect under muster: every worker is a freshly started process, as with spawn\n"),
        "{stderr}"
    );
}

#[test]
fn srun_steps_need_no_per_node_flags() {
    let out = agent_in(
        &[
            "launch",
            "--",
            "sh",
            "-c",
            "echo $TORCHELASTIC_RUN_ID $GROUP_RANK $GROUP_WORLD_SIZE",
        ],
        &[
            ("SLURM_JOB_ID", "77"),
            ("SLURM_STEP_ID", "3"),
            ("SLURM_NNODES", "1"),
            ("SLURM_NODEID", "0"),
            ("SLURM_STEP_NODELIST", "localhost"),
        ],
    );
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert_eq!(text(&out.stdout), "[rank 0] slurm-77-3 0 1\n");
    assert!(
        text(&out.stderr).starts_with("muster-agent: note: Slurm step: --nnodes 1 --node-rank 0 --job-id slurm-77-3 (flags and PET_* variables override these)\n"),
        "{}",
        text(&out.stderr)
    );
}
