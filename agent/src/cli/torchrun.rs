//! torchrun's flags that muster's own set has no spelling for: how the program is run (`-m`,
//! `--no-python`, `--run-path`), `--role`, `--shutdown-timeout`, `--local-addr`,
//! `--virtual-local-rank`, and those accepted with a note because they have no effect under
//! muster (`--start-method`, `--event-log-handler`, `--numa-binding`, ...). Each is read from
//! torchrun's `PET_<NAME>` variable too, as torchrun does; a flag beats the variable.

use super::UsageError;
use crate::program::Form;
use clap::{Args, ValueEnum};

/// The `--help` heading of torchrun's flags that muster takes in torchrun's spelling only.
const HEADING: &str = "torchrun compatibility";

/// The signals torchrun handles by default, which the agent always handles: each stops the
/// workers (see `launch.rs`).
const HANDLED_SIGNALS: [&str; 4] = ["SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT"];

/// torchrun's flags without a muster spelling (flattened into `LaunchArgs`).
#[derive(Debug, Clone, Default, Args)]
pub struct TorchrunArgs {
    /// Run the program as a Python module: `python -u -m MODULE ARGS`.
    #[arg(short = 'm', long, env = "PET_MODULE",
        value_parser = pet_bool, help_heading = HEADING)]
    pub module: bool,

    /// Run the program directly, not with Python, even a `.py` script (it must be
    /// executable).
    #[arg(long, alias = "no_python", env = "PET_NO_PYTHON",
        value_parser = pet_bool, help_heading = HEADING)]
    pub no_python: bool,

    /// Run the program with Python whatever its name (torchrun's runpy.run_path: the same
    /// sys.argv and __main__); beats --no-python.
    #[arg(long, alias = "run_path", env = "PET_RUN_PATH",
        value_parser = pet_bool, help_heading = HEADING)]
    pub run_path: bool,

    /// The workers' role: their ROLE_NAME. Default: `default`, as with torchrun.
    #[arg(long, value_name = "ROLE", env = "PET_ROLE", help_heading = HEADING)]
    pub role: Option<String>,

    /// Seconds workers get between SIGTERM and SIGKILL when they are stopped (the same as
    /// --grace-period-ms, in seconds).
    #[arg(
        long,
        value_name = "SECS",
        alias = "shutdown_timeout",
        env = "PET_SHUTDOWN_TIMEOUT",
        help_heading = HEADING
    )]
    pub shutdown_timeout: Option<u64>,

    /// This node's address for the other nodes (the same as --advertise-addr).
    #[arg(
        long,
        value_name = "HOST",
        alias = "local_addr",
        env = "PET_LOCAL_ADDR",
        help_heading = HEADING
    )]
    pub local_addr: Option<String>,

    /// Every worker gets LOCAL_RANK=0 and only its own GPU in CUDA_VISIBLE_DEVICES (as
    /// --gpu-mapping one-per-process, which it implies).
    #[arg(
        long,
        alias = "virtual_local_rank",
        env = "PET_VIRTUAL_LOCAL_RANK",
        value_parser = pet_bool,
        help_heading = HEADING
    )]
    pub virtual_local_rank: bool,

    /// No effect under muster: every worker is a freshly started process, as with spawn.
    #[arg(
        long,
        value_enum,
        value_name = "METHOD",
        alias = "start_method",
        env = "PET_START_METHOD",
        help_heading = HEADING
    )]
    pub start_method: Option<StartMethod>,

    /// No effect under muster: the agent reports events in its log and its Prometheus
    /// metrics (--metrics-addr).
    #[arg(
        long,
        value_name = "NAME",
        alias = "event_log_handler",
        env = "PET_EVENT_LOG_HANDLER",
        help_heading = HEADING
    )]
    pub event_log_handler: Option<String>,

    /// No effect under muster: workers are not pinned to CPUs (Accelerate's
    /// --enable_cpu_affinity asks Accelerate to do it).
    #[arg(
        long,
        value_enum,
        value_name = "MODE",
        alias = "numa_binding",
        help_heading = HEADING
    )]
    pub numa_binding: Option<NumaBinding>,

    /// Signals that stop the workers; the agent always handles SIGTERM, SIGINT, SIGHUP and
    /// SIGQUIT, and no other (a different list has no effect).
    #[arg(
        long,
        value_name = "SIG,...",
        alias = "signals_to_handle",
        env = "PET_SIGNALS_TO_HANDLE",
        help_heading = HEADING
    )]
    pub signals_to_handle: Option<String>,

    /// No effect under muster: muster-agent has no completion script; prints a note and
    /// exits 1, as torchrun does without its `shtab` package.
    #[arg(
        long,
        value_enum,
        value_name = "SHELL",
        alias = "print_completion",
        help_heading = HEADING
    )]
    pub print_completion: Option<Shell>,
}

/// torchrun's `--start-method`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum StartMethod {
    /// A fresh interpreter per worker.
    Spawn,
    /// A fork of the launcher.
    Fork,
    /// Forks of a fork server.
    Forkserver,
}

/// torchrun's `--numa-binding` modes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum NumaBinding {
    /// The GPU's NUMA node.
    Node,
    /// The GPU's socket.
    Socket,
    /// CPUs of its own per worker.
    Exclusive,
    /// The GPU's core complex.
    CoreComplex,
}

/// torchrun's `--print-completion` shells.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Shell {
    /// bash.
    Bash,
    /// zsh.
    Zsh,
    /// tcsh.
    Tcsh,
}

/// A switch's `PET_*` value as torchrun reads it (`bool(int(value))`: 0 is off, any other
/// number on), and the words clap gives a switch on the command line. For every torchrun
/// switch with a `PET_*` variable (`value_parser = torchrun::pet_bool`).
pub fn pet_bool(s: &str) -> Result<bool, String> {
    match s.trim() {
        "true" => Ok(true),
        "false" => Ok(false),
        n => n
            .parse::<i64>()
            .map(|n| n != 0)
            .map_err(|_| format!("expected a number (0 is off), found '{s}'")),
    }
}

/// A note for a flag accepted without effect: `--X has no effect under muster: WHY`.
pub fn no_effect(flag: &str, why: &str) -> String {
    super::note(&format!("{flag} has no effect under muster: {why}"))
}

impl TorchrunArgs {
    /// How the program is run, from `-m`, `--no-python` and `--run-path` (torchrun's
    /// precedence: `--run-path` first; `--no-python` with `-m` is an error, as there).
    pub fn form(&self) -> Result<Form, UsageError> {
        Ok(match (self.run_path, self.no_python, self.module) {
            (true, _, _) => Form::RunPath,
            (false, true, true) => {
                return Err(UsageError::Conflict(
                    "--no-python".to_owned(),
                    "--module (a module is run by Python)".to_owned(),
                ));
            }
            (false, true, false) => Form::NoPython,
            (false, false, true) => Form::Module,
            (false, false, false) => Form::Implied,
        })
    }

    /// The notes for the flags given that have no effect under muster.
    pub fn notes(&self) -> Vec<String> {
        let mut notes = Vec::new();
        if let Some(method) = self.start_method
            && method != StartMethod::Spawn
        {
            let name = method.to_possible_value().map(|v| v.get_name().to_owned());
            notes.push(no_effect(
                &format!("--start-method {}", name.unwrap_or_default()),
                "every worker is a freshly started process, as with spawn",
            ));
        }
        if let Some(handler) = &self.event_log_handler
            && handler != "null"
        {
            notes.push(no_effect(
                "--event-log-handler",
                "the agent reports events in its log and its Prometheus metrics (--metrics-addr)",
            ));
        }
        if self.numa_binding.is_some() {
            notes.push(no_effect(
                "--numa-binding",
                "workers are not pinned to CPUs (Accelerate's --enable_cpu_affinity asks Accelerate to do it)",
            ));
        }
        if let Some(list) = &self.signals_to_handle {
            let mut given: Vec<&str> = list
                .split(',')
                .map(str::trim)
                .filter(|s| !s.is_empty())
                .collect();
            given.sort_unstable();
            given.dedup();
            let mut handled = HANDLED_SIGNALS.to_vec();
            handled.sort_unstable();
            if given != handled {
                notes.push(no_effect(
                    "--signals-to-handle",
                    "the agent always stops its workers on SIGTERM, SIGINT, SIGHUP and SIGQUIT, and on no other signal",
                ));
            }
        }
        notes
    }

    /// `--print-completion`'s note, when it was given: the launch prints it and exits 1.
    pub fn completion_note(&self) -> Option<String> {
        self.print_completion.map(|_| {
            no_effect(
                "--print-completion",
                "muster-agent has no shell completion script to print",
            )
        })
    }
}

#[cfg(test)]
mod tests {
    use super::super::tests::{check, check_on, machine, one_node, summary};
    use super::super::{Cli, Context, Parsed, parse_in};
    use crate::program::PythonChoice;
    use clap::CommandFactory;
    use std::ffi::{OsStr, OsString};
    use std::os::unix::fs::PermissionsExt;
    use std::path::PathBuf;

    /// A folder with a stand-in `python3` in `bin/` and programs of every kind; removed on
    /// drop.
    struct Scripts {
        dir: PathBuf,
        path_var: OsString,
    }

    impl Scripts {
        fn new(name: &str) -> Self {
            let dir =
                std::env::temp_dir().join(format!("muster-torchrun-{}-{name}", std::process::id()));
            let _ = std::fs::remove_dir_all(&dir);
            std::fs::create_dir_all(dir.join("bin")).expect("bin folder");
            std::fs::create_dir_all(dir.join("pkg")).expect("pkg folder");
            for (file, text, mode) in [
                ("bin/python3", "#!/bin/sh\n", 0o755),
                ("train.py", "print('hi')\n", 0o644),
                ("tool", "#!/bin/sh\n", 0o755),
                ("shebang", "#!/usr/bin/env python3\nprint()\n", 0o644),
                ("notes.txt", "plain text\n", 0o644),
                ("pkg/__main__.py", "print()\n", 0o644),
            ] {
                let path = dir.join(file);
                std::fs::write(&path, text).expect("write a script");
                std::fs::set_permissions(&path, std::fs::Permissions::from_mode(mode))
                    .expect("chmod");
            }
            let path_var = format!("{}/bin:/usr/bin:/bin", dir.display()).into();
            Self { dir, path_var }
        }

        fn ctx(&self) -> Context<'_> {
            Context {
                path_var: Some(&self.path_var),
                ..machine(None)
            }
        }

        /// Parses `args` (with `$D` for the folder) on `ctx`; the outcome with `$D` again.
        fn run(&self, ctx: &Context<'_>, args: &str) -> Result<String, String> {
            let d = self.dir.to_string_lossy();
            let argv = ["muster-agent", "launch"]
                .into_iter()
                .map(str::to_owned)
                .chain(args.split_whitespace().map(|a| a.replace("$D", &d)));
            match parse_in(argv, ctx) {
                Ok((Parsed::Launch(s), warnings)) => Ok(summary(&s, &warnings).replace(&*d, "$D")),
                Ok((other, _)) => Ok(format!("{other:?}")),
                Err(e) => Err(e.to_string().replace(&*d, "$D")),
            }
        }
    }

    impl Drop for Scripts {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.dir);
        }
    }

    #[test]
    fn program_forms() {
        let scripts = Scripts::new("forms");
        let ctx = scripts.ctx();
        let spec = |prog: &str, args: &str| {
            format!(
                "n=1 nodes=1:1 rank=None coord=None job=<fresh> grace=5000ms relay=true prog={prog} args=[{args}]"
            )
        };
        let python = |args: &str| spec("$D/bin/python3", args);
        for (args, expected) in [
            // Implied: a Python script runs with Python, anything else directly.
            (
                "$D/train.py --lr 1",
                Ok(python(r#""-u", "$D/train.py", "--lr", "1""#)),
            ),
            (
                "-- $D/train.py --lr",
                Ok(python(r#""-u", "$D/train.py", "--lr""#)),
            ),
            // argparse drops a `--` right after the script, unless one came before it.
            (
                "$D/train.py -- --lr",
                Ok(python(r#""-u", "$D/train.py", "--lr""#)),
            ),
            (
                "-- $D/train.py -- --lr",
                Ok(python(r#""-u", "$D/train.py", "--", "--lr""#)),
            ),
            (
                "$D/train.py a -- b",
                Ok(python(r#""-u", "$D/train.py", "a", "--", "b""#)),
            ),
            ("$D/shebang x", Ok(python(r#""-u", "$D/shebang", "x""#))),
            ("$D/pkg", Ok(python(r#""-u", "$D/pkg""#))),
            ("$D/tool a", Ok(spec("$D/tool", r#""a""#))),
            ("sh -c true", Ok(spec("sh", r#""-c", "true""#))),
            // -m, --no-python, --run-path.
            (
                "-m pkg.mod --x",
                Ok(python(r#""-u", "-m", "pkg.mod", "--x""#)),
            ),
            ("--module pkg.mod", Ok(python(r#""-u", "-m", "pkg.mod""#))),
            ("--no-python $D/tool", Ok(spec("$D/tool", ""))),
            ("--no_python sh", Ok(spec("sh", ""))),
            (
                "--run-path $D/notes.txt",
                Ok(python(r#""-u", "$D/notes.txt""#)),
            ),
            (
                "--run_path --no-python $D/train.py",
                Ok(python(r#""-u", "$D/train.py""#)),
            ),
            (
                "--no-python $D/train.py",
                Err("program '$D/train.py' is not executable".to_owned()),
            ),
            (
                "-m --no-python pkg.mod",
                Err("--no-python conflicts with --module (a module is run by Python)".to_owned()),
            ),
            (
                "--run-path $D/missing.py",
                Err("program '$D/missing.py' does not exist".to_owned()),
            ),
            (
                "$D/missing.py",
                Err("program '$D/missing.py' does not exist".to_owned()),
            ),
            (
                "$D/notes.txt",
                Err("program '$D/notes.txt' is not executable".to_owned()),
            ),
            (
                "no-such-train.py",
                Err("program 'no-such-train.py' does not exist".to_owned()),
            ),
        ] {
            assert_eq!(scripts.run(&ctx, args), expected, "{args}");
        }

        // Where the interpreter comes from.
        let bare = Context {
            path_var: Some(OsStr::new("/nonexistent")),
            ..scripts.ctx()
        };
        assert_eq!(
            scripts.run(&bare, "$D/train.py"),
            Err("script '$D/train.py' needs a Python interpreter, and no python3 or python was found in PATH (activate the environment, or set MUSTER_PYTHON to the interpreter)".to_owned())
        );
        assert_eq!(
            scripts.run(&bare, "-m pkg"),
            Err("module 'pkg' needs a Python interpreter, and no python3 or python was found in PATH (activate the environment, or set MUSTER_PYTHON to the interpreter)".to_owned())
        );
        let tool = scripts.dir.join("tool").into_os_string();
        let chosen = |pairs: Vec<(&'static str, OsString)>| {
            PythonChoice::from_vars(|name| {
                pairs
                    .iter()
                    .find(|(k, _)| *k == name)
                    .map(|(_, v)| v.clone())
            })
        };
        for (vars, expected) in [
            (
                vec![
                    ("MUSTER_PYTHON", tool.clone()),
                    ("PYTHON_EXEC", "/nope".into()),
                ],
                Ok(spec("$D/tool", r#""-u", "$D/train.py""#)),
            ),
            (
                vec![("PYTHON_EXEC", tool.clone())],
                Ok(spec("$D/tool", r#""-u", "$D/train.py""#)),
            ),
            (
                vec![
                    ("MUSTER_PYTHON", "".into()),
                    ("PYTHON_EXEC", "python3".into()),
                ],
                Ok(python(r#""-u", "$D/train.py""#)),
            ),
            (
                vec![("PYTHON_EXEC", "/nope".into())],
                Err("PYTHON_EXEC '/nope': does not exist".to_owned()),
            ),
        ] {
            let ctx = Context {
                python: chosen(vars.clone()),
                ..scripts.ctx()
            };
            assert_eq!(scripts.run(&ctx, "$D/train.py"), expected, "{vars:?}");
        }
    }

    #[test]
    fn flags_with_a_meaning() {
        let grace = |ms: &str, rest: &str| one_node(1, rest).replace("grace=5000ms", ms);
        for (args, expected) in [
            ("--role trainer", Ok(one_node(1, " role=trainer"))),
            ("--shutdown-timeout 30", Ok(grace("grace=30000ms", ""))),
            (
                "--shutdown_timeout 5 --grace-period-ms 5000",
                Ok(one_node(1, "")),
            ),
            ("--grace-period-ms 250", Ok(grace("grace=250ms", ""))),
            (
                "--shutdown-timeout 5 --grace-period-ms 100",
                Err("--grace-period-ms 100 conflicts with --shutdown-timeout 5".to_owned()),
            ),
            (
                "--local-addr 10.0.0.5",
                Ok(one_node(1, " advertise=10.0.0.5")),
            ),
            (
                "--local_addr h --advertise-addr h",
                Ok(one_node(1, " advertise=h")),
            ),
            (
                "--local-addr a --advertise-addr b",
                Err("--advertise-addr b conflicts with --local-addr a".to_owned()),
            ),
            (
                "--local-addr a:1",
                Err(
                    "--local-addr 'a:1' must be a host name or IP address, without a port"
                        .to_owned(),
                ),
            ),
        ] {
            let expected = expected.as_deref().map_err(String::as_str);
            check(&format!("{args} -- sh"), expected);
        }

        // --virtual-local-rank: one GPU per worker, LOCAL_RANK=0 (env.rs).
        let two = machine(Some(2));
        for (args, expected) in [
            (
                "--nproc-per-node 2 --virtual-local-rank",
                Ok(one_node(2, " gpus=0,1/set/one-per-process virtual-local-rank")),
            ),
            (
                "--nproc-per-node 2 --virtual_local_rank --gpu-mapping one-per-process",
                Ok(one_node(2, " gpus=0,1/set/one-per-process virtual-local-rank")),
            ),
            (
                "--virtual-local-rank --gpu-mapping local-rank",
                Err("--gpu-mapping local-rank conflicts with --virtual-local-rank".to_owned()),
            ),
            (
                "--nproc-per-node 3 --virtual-local-rank",
                Err("--virtual-local-rank gives each worker a GPU of its own, but there are 3 workers for 2 GPUs (0,1); run fewer workers, list more GPUs, or use --gpu-mapping local-rank".to_owned()),
            ),
        ] {
            let expected = expected.as_deref().map_err(String::as_str);
            check_on(&two, &format!("{args} -- sh"), expected);
        }
        check(
            "--virtual-local-rank -- sh",
            Ok(&one_node(
                1,
                " gpus=/one-per-process virtual-local-rank | warning: --virtual-local-rank: no GPU found on this machine; the workers run without one",
            )),
        );
    }

    #[test]
    fn flags_without_effect_are_accepted_with_a_note() {
        let note =
            |flag: &str, why: &str| format!(" | note: {flag} has no effect under muster: {why}");
        check(
            "--start-method fork --event-log-handler console --numa-binding core-complex \
             --signals-to-handle SIGTERM,SIGUSR1 -- sh",
            Ok(&one_node(
                1,
                &[
                    note("--start-method fork", "every worker is a freshly started process, as with spawn"),
                    note("--event-log-handler", "the agent reports events in its log and its Prometheus metrics (--metrics-addr)"),
                    note("--numa-binding", "workers are not pinned to CPUs (Accelerate's --enable_cpu_affinity asks Accelerate to do it)"),
                    note("--signals-to-handle", "the agent always stops its workers on SIGTERM, SIGINT, SIGHUP and SIGQUIT, and on no other signal"),
                ]
                .concat(),
            )),
        );
        // torchrun's defaults, in the other spelling: what muster does anyway, so no note.
        check(
            "--start_method spawn --event_log_handler null --numa_binding node \
             --signals_to_handle SIGINT,SIGTERM,SIGHUP,SIGQUIT -- sh",
            Ok(&one_node(
                1,
                &note(
                    "--numa-binding",
                    "workers are not pinned to CPUs (Accelerate's --enable_cpu_affinity asks Accelerate to do it)",
                ),
            )),
        );
        check(
            "--start-method thread -- sh",
            Err(
                "invalid value 'thread' for '--start-method <METHOD>' [possible values: spawn, fork, forkserver] (see `muster-agent launch --help`)",
            ),
        );
        // --print-completion prints its note and exits 1 without launching.
        let argv = ["muster-agent", "launch", "--print-completion", "zsh"];
        let (parsed, notes) = parse_in(argv, &machine(None)).expect("accepted");
        assert!(matches!(parsed, Parsed::Exit(1)), "{parsed:?}");
        assert_eq!(
            notes,
            [
                "note: --print-completion has no effect under muster: muster-agent has no shell completion script to print"
            ]
        );
    }

    #[test]
    fn omp_num_threads_warning_with_several_workers() {
        let unset = Context {
            omp_num_threads: None,
            ..machine(None)
        };
        let warning = " | warning: Setting OMP_NUM_THREADS environment variable for each process to be 1 in default, to avoid your system being overloaded, please further tune the variable for optimal performance in your application as needed.";
        check_on(
            &unset,
            "--nproc-per-node 2 -- sh",
            Ok(&one_node(2, warning)),
        );
        check_on(&unset, "--nproc-per-node 1 -- sh", Ok(&one_node(1, "")));
        check_on(
            &machine(None),
            "--nproc-per-node 2 -- sh",
            Ok(&one_node(2, "")),
        );
    }

    /// `--num_cpu_threads_per_process` gives the thread count, so torchrun's warning that it
    /// was set to 1 would be false.
    #[test]
    fn no_omp_num_threads_warning_when_the_thread_count_is_given() {
        let unset = Context {
            omp_num_threads: None,
            ..machine(None)
        };
        let argv = [
            "muster-agent",
            "launch",
            "--nproc-per-node",
            "2",
            "--num_cpu_threads_per_process",
            "4",
            "--",
            "sh",
        ];
        let (_, notes) = parse_in(argv, &unset).expect("accepted");
        assert!(
            notes.iter().all(|n| !n.contains("OMP_NUM_THREADS")),
            "{notes:?}"
        );
    }

    #[test]
    fn pet_switch_values() {
        for (value, expected) in [
            ("1", Ok(true)),
            ("0", Ok(false)),
            ("2", Ok(true)),
            (" 0 ", Ok(false)),
            ("true", Ok(true)),
            ("false", Ok(false)),
            (
                "yes",
                Err("expected a number (0 is off), found 'yes'".to_owned()),
            ),
        ] {
            assert_eq!(super::pet_bool(value), expected, "{value}");
        }
    }

    /// Every torchrun flag muster has reads torchrun's `PET_<NAME>` variable, and takes both
    /// spellings. (The output flags and the rendezvous flags are checked where they live.)
    #[test]
    fn pet_variables_and_spellings() {
        let command = Cli::command();
        let launch = command
            .find_subcommand("launch")
            .expect("the launch subcommand");
        for (flag, alias, pet) in [
            ("nnodes", None, Some("PET_NNODES")),
            (
                "nproc-per-node",
                Some("nproc_per_node"),
                Some("PET_NPROC_PER_NODE"),
            ),
            (
                "max-restarts",
                Some("max_restarts"),
                Some("PET_MAX_RESTARTS"),
            ),
            (
                "monitor-interval",
                Some("monitor_interval"),
                Some("PET_MONITOR_INTERVAL"),
            ),
            (
                "start-method",
                Some("start_method"),
                Some("PET_START_METHOD"),
            ),
            (
                "event-log-handler",
                Some("event_log_handler"),
                Some("PET_EVENT_LOG_HANDLER"),
            ),
            ("role", None, Some("PET_ROLE")),
            ("module", None, Some("PET_MODULE")),
            ("no-python", Some("no_python"), Some("PET_NO_PYTHON")),
            ("run-path", Some("run_path"), Some("PET_RUN_PATH")),
            ("node-rank", Some("node_rank"), Some("PET_NODE_RANK")),
            ("master-addr", Some("master_addr"), Some("PET_MASTER_ADDR")),
            ("master-port", Some("master_port"), Some("PET_MASTER_PORT")),
            ("local-addr", Some("local_addr"), Some("PET_LOCAL_ADDR")),
            (
                "signals-to-handle",
                Some("signals_to_handle"),
                Some("PET_SIGNALS_TO_HANDLE"),
            ),
            (
                "shutdown-timeout",
                Some("shutdown_timeout"),
                Some("PET_SHUTDOWN_TIMEOUT"),
            ),
            (
                "virtual-local-rank",
                Some("virtual_local_rank"),
                Some("PET_VIRTUAL_LOCAL_RANK"),
            ),
            // torchrun reads no variable for these two.
            ("numa-binding", Some("numa_binding"), None),
            ("print-completion", Some("print_completion"), None),
        ] {
            let arg = launch
                .get_arguments()
                .find(|a| a.get_long() == Some(flag))
                .unwrap_or_else(|| panic!("--{flag} is missing"));
            assert_eq!(arg.get_env(), pet.map(OsStr::new), "--{flag}");
            if let Some(alias) = alias {
                let aliases = arg.get_all_aliases().unwrap_or_default();
                assert!(
                    aliases.contains(&alias),
                    "--{flag} lacks --{alias}: {aliases:?}"
                );
            }
        }
        let module = launch
            .get_arguments()
            .find(|a| a.get_long() == Some("module"))
            .expect("--module");
        assert_eq!(module.get_short(), Some('m'));
    }
}
