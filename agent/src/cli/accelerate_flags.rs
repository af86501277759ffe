//! `accelerate launch`'s flags that muster's own set has no spelling for: TorchDynamo, FSDP,
//! DeepSpeed, Megatron-LM, FP8 and parallelism settings, `--num_cpu_threads_per_process`,
//! `--env` and `-q`, which reach the workers as the variables Accelerate's launcher sets; and
//! those accepted with a note because they have no effect under muster (`--tpu`,
//! `--mpirun_hostfile`, `--same_network`, ...). An Accelerate config file's sections
//! (`fsdp_config`, `deepspeed_config`, ...) go through the same [`AccelerateFlags::resolve`]
//! as these flags, so a setting has the same effect from either, and a flag beats the file.
//!
//! The flags are one table ([`FLAGS`], in [`table`]), read into clap by hand ([`clap::Args`]
//! below): each row names the flag (both spellings, as Accelerate's parser takes them), how argparse reads
//! its value, its default and the variable it becomes. What Accelerate's launcher does with
//! them is `accelerate/utils/launch.py` (`prepare_multi_gpu_env`,
//! `prepare_simple_launcher_cmd_env`, `prepare_deepspeed_cmd_env`, `setup_fp8_env`,
//! `prepare_extend_env_parallelism_config`) and `accelerate/commands/launch.py`
//! (`_validate_launch_command`, `launch_command`), accelerate 1.15.

use super::UsageError;
use super::torchrun::no_effect;
use crate::accelerate_config::{AccelerateConfig, PyValue};
use clap::{ArgMatches, Command};
use std::collections::{BTreeMap, BTreeSet};

mod table;
use table::{Emit, FLAGS, Group, Kind, dynamo_backend, on_command_line, row};

/// `accelerate launch`'s flags without a muster spelling (flattened into `LaunchArgs`): the
/// ones given, as argparse would have read them.
#[derive(Debug, Clone, Default)]
pub struct AccelerateFlags {
    given: Vec<(&'static str, PyValue)>,
}

impl AccelerateFlags {
    /// Whether any of these flags was given.
    pub fn any(&self) -> bool {
        !self.given.is_empty()
    }
}

impl clap::FromArgMatches for AccelerateFlags {
    fn from_arg_matches(matches: &ArgMatches) -> Result<Self, clap::Error> {
        let mut flags = Self::default();
        flags.update_from_arg_matches(matches)?;
        Ok(flags)
    }

    fn update_from_arg_matches(&mut self, matches: &ArgMatches) -> Result<(), clap::Error> {
        for flag in FLAGS.iter().filter(|f| on_command_line(f)) {
            let value = match flag.kind {
                Kind::Switch => matches.get_flag(flag.name).then_some(PyValue::Bool(true)),
                Kind::Append => matches
                    .get_many::<String>(flag.name)
                    .map(|values| PyValue::List(values.map(|v| PyValue::Str(v.clone())).collect())),
                _ => matches.get_one::<PyValue>(flag.name).cloned(),
            };
            if let Some(value) = value {
                self.given.retain(|(name, _)| *name != flag.name);
                self.given.push((flag.name, value));
            }
        }
        Ok(())
    }
}

impl clap::Args for AccelerateFlags {
    fn augment_args(cmd: Command) -> Command {
        FLAGS
            .iter()
            .filter(|f| on_command_line(f))
            .fold(cmd, |cmd, f| cmd.arg(f.arg()))
    }

    fn augment_args_for_update(cmd: Command) -> Command {
        Self::augment_args(cmd)
    }
}

/// What the rest of the command line and the config file say, for [`AccelerateFlags::resolve`].
#[derive(Debug, Clone, Copy)]
pub struct Inputs<'a> {
    /// `--cpu`: Accelerate's simple launcher, none of its paradigms.
    pub cpu: bool,
    /// `--multi_gpu`.
    pub multi_gpu: bool,
    /// The mixed precision mode (from `--mixed_precision` or the file).
    pub mixed_precision: Option<&'a str>,
    /// Whether it came from the file (DeepSpeed then lists it in ACCELERATE_CONFIG_DS_FIELDS).
    pub mixed_precision_from_file: bool,
    /// The config file's settings (the default when there is none).
    pub config: &'a AccelerateConfig,
    /// The config file, as given (for messages); `None`: no file.
    pub file: Option<&'a str>,
    /// The agent's PYTHONPATH and working directory: Accelerate's DeepSpeed launcher appends
    /// the directory to the path.
    pub pythonpath: Option<&'a str>,
    /// See `pythonpath`.
    pub cwd: &'a str,
}

/// What the flags and the file come to.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Resolved {
    /// The variables Accelerate's launcher would set, in its order; they replace any of the
    /// same name (OMP_NUM_THREADS) in the worker's environment.
    pub env: Vec<(&'static str, String)>,
    /// `--env KEY=VALUE`: added to every worker's environment.
    pub extra_env: Vec<(String, String)>,
    /// `-q`.
    pub quiet: bool,
    /// An `accelerate launch` flag of this set was given.
    pub given: bool,
    /// Notes and warnings to print (see [`super::note`]).
    pub messages: Vec<String>,
}

/// Which of Accelerate's launchers `accelerate launch` would have run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Launcher {
    /// `simple_launcher`: `--cpu`, or no paradigm.
    Simple,
    /// `multi_gpu_launcher`: `--multi_gpu`, `--use_fsdp`, `--use_megatron_lm`.
    MultiGpu,
    /// `deepspeed_launcher`.
    DeepSpeed,
}

impl AccelerateFlags {
    /// Whether `name` was given on the command line.
    fn has(&self, name: &str) -> bool {
        self.given.iter().any(|(n, _)| *n == name)
    }

    /// Turns the flags and the config file into the workers' variables, as
    /// `accelerate launch` would: defaults, then the file's settings for what no flag gives,
    /// then the launcher's rules. Errors are Accelerate's own (`--use_fsdp` with
    /// `--use_deepspeed`, ...), and a file's setting Accelerate would refuse.
    pub fn resolve(&self, inputs: &Inputs<'_>) -> Result<Resolved, UsageError> {
        let mut out = Resolved {
            given: !self.given.is_empty(),
            quiet: self.has("quiet"),
            ..Resolved::default()
        };
        self.check_paradigms(inputs)?;

        // The namespace argparse leaves, then the file's settings where no flag was given.
        let mut ns: BTreeMap<&'static str, PyValue> = FLAGS
            .iter()
            .map(|f| (f.name, f.default.value(f.kind)))
            .collect();
        let explicit: BTreeSet<&str> = self.given.iter().map(|(n, _)| *n).collect();
        for (name, value) in &self.given {
            ns.insert(*name, value.clone());
        }
        let config = inputs.config;
        let on =
            |ns: &BTreeMap<&str, PyValue>, name: &str| ns.get(name).is_some_and(PyValue::truthy);
        let mut multi_gpu = inputs.multi_gpu;
        let paradigm_given = multi_gpu
            || [
                "tpu",
                "tpu_cluster",
                "use_deepspeed",
                "use_fsdp",
                "use_megatron_lm",
            ]
            .iter()
            .any(|n| explicit.contains(n));
        if let Some(t) = &config.distributed_type
            && !paradigm_given
        {
            let t = t.as_str();
            ns.insert("use_deepspeed", PyValue::Bool(t == "DEEPSPEED"));
            ns.insert("use_fsdp", PyValue::Bool(t == "FSDP"));
            ns.insert("use_megatron_lm", PyValue::Bool(t == "MEGATRON_LM"));
            ns.insert(
                "use_parallelism_config",
                PyValue::Bool(config.parallelism_config),
            );
            multi_gpu = t.starts_with("MULTI_") && t != "MULTI_CPU";
        }
        let shown_file = inputs.file.unwrap_or_default();
        for setting in &config.launch_settings {
            let from = if setting.section.is_empty() {
                setting.key.clone()
            } else {
                format!("{}: {}", setting.section, setting.key)
            };
            match row(&setting.flag) {
                Some(flag) if flag.group != Group::Quiet && flag.group != Group::Env => {
                    if flag.name == "dynamo_backend"
                        && let Err(why) = dynamo_backend(&setting.value.py_str())
                    {
                        return Err(UsageError::Invalid(format!(
                            "--config-file '{shown_file}': {from}: {why}"
                        )));
                    }
                    if !explicit.contains(flag.name) {
                        ns.insert(flag.name, setting.value.clone());
                    }
                }
                _ => out.messages.push(format!(
                    "--config-file '{shown_file}': {from}: unknown key, ignored"
                )),
            }
        }

        let launcher = if inputs.cpu {
            Launcher::Simple
        } else if on(&ns, "use_deepspeed") {
            Launcher::DeepSpeed
        } else if multi_gpu || on(&ns, "use_fsdp") || on(&ns, "use_megatron_lm") {
            Launcher::MultiGpu
        } else {
            Launcher::Simple
        };
        let fp8 = inputs.mixed_precision == Some("fp8");
        let fsdp = launcher == Launcher::MultiGpu && on(&ns, "use_fsdp");
        let megatron = launcher == Launcher::MultiGpu && on(&ns, "use_megatron_lm");
        let parallelism = launcher != Launcher::Simple && on(&ns, "use_parallelism_config");
        let value = |name: &str| ns.get(name).cloned().unwrap_or(PyValue::None);
        let emit_group = |env: &mut Vec<(&'static str, String)>, group: Group| {
            for f in FLAGS.iter().filter(|f| f.group == group) {
                let v = value(f.name);
                let s = match f.emit {
                    Emit::Never => continue,
                    Emit::Always => v.py_str(),
                    Emit::AlwaysLower => v.py_str().to_lowercase(),
                    Emit::IfSet | Emit::IfSetLower if v == PyValue::None => continue,
                    Emit::IfSet => v.py_str(),
                    Emit::IfSetLower => v.py_str().to_lowercase(),
                    Emit::WhenAboveOne(gate) => {
                        if value(gate).as_f64().is_none_or(|n| n <= 1.0) {
                            continue;
                        }
                        v.py_str()
                    }
                };
                env.push((f.var, s));
            }
        };

        let env = &mut out.env;
        if launcher == Launcher::DeepSpeed {
            let mut paths: Vec<&str> = inputs
                .pythonpath
                .unwrap_or_default()
                .split(':')
                .filter(|p| !p.is_empty())
                .collect();
            paths.push(inputs.cwd);
            env.push(("PYTHONPATH", paths.join(":")));
        }
        if fp8 {
            // setup_fp8_env: every fp8_* setting that is not None.
            for f in FLAGS.iter().filter(|f| f.group == Group::Fp8) {
                match (f.name, value(f.name)) {
                    (_, PyValue::None) => {}
                    ("fp8_override_linear_precision", PyValue::List(items)) => {
                        for (var, item) in [
                            "ACCELERATE_FP8_OVERRIDE_FPROP",
                            "ACCELERATE_FP8_OVERRIDE_DGRAD",
                            "ACCELERATE_FP8_OVERRIDE_WGRAD",
                        ]
                        .into_iter()
                        .zip(items)
                        {
                            env.push((var, item.py_str()));
                        }
                    }
                    (_, v) if !f.var.is_empty() => env.push((f.var, v.py_str())),
                    _ => {}
                }
            }
            // Its default, (False, False, False), is not run through `type`.
            if value("fp8_override_linear_precision") == PyValue::None {
                for var in [
                    "ACCELERATE_FP8_OVERRIDE_FPROP",
                    "ACCELERATE_FP8_OVERRIDE_DGRAD",
                    "ACCELERATE_FP8_OVERRIDE_WGRAD",
                ] {
                    env.push((var, "False".to_owned()));
                }
            }
        }
        if launcher == Launcher::DeepSpeed {
            let mut fields = config.deepspeed_fields.clone();
            if inputs.mixed_precision_from_file {
                fields.push("mixed_precision".to_owned());
            }
            env.push((
                "ACCELERATE_CONFIG_DS_FIELDS",
                fields.join(",").to_lowercase(),
            ));
            env.push(("ACCELERATE_USE_DEEPSPEED", "true".to_owned()));
            emit_group(env, Group::DeepSpeed);
        } else {
            let backend = match value("dynamo_backend") {
                PyValue::None => "NO".to_owned(),
                v => dynamo_backend(&v.py_str()).map_err(UsageError::Invalid)?,
            };
            env.push(("ACCELERATE_DYNAMO_BACKEND", backend));
            emit_group(env, Group::Dynamo);
        }
        if fsdp {
            if on(&ns, "fsdp_cpu_ram_efficient_loading") && !on(&ns, "fsdp_sync_module_states") {
                return Err(UsageError::Invalid(
                    "--fsdp_cpu_ram_efficient_loading needs --fsdp_sync_module_states true (as under accelerate launch)"
                        .to_owned(),
                ));
            }
            env.push(("ACCELERATE_USE_FSDP", "true".to_owned()));
            emit_group(env, Group::Fsdp);
        }
        if megatron {
            env.push(("ACCELERATE_USE_MEGATRON_LM", "true".to_owned()));
            emit_group(env, Group::Megatron);
        }
        if launcher != Launcher::DeepSpeed
            && let Some(n) = self.value("num_cpu_threads_per_process")
        {
            env.push((crate::env::OMP_NUM_THREADS, n.py_str()));
        }
        if inputs.cpu {
            // prepare_simple_launcher_cmd_env, for Intel's OpenMP on the CPU.
            env.push(("KMP_AFFINITY", "granularity=fine,compact,1,0".to_owned()));
            env.push(("KMP_BLOCKTIME", "1".to_owned()));
        }
        if parallelism {
            env.push(("ACCELERATE_USE_PARALLELISM_CONFIG", "true".to_owned()));
            emit_group(env, Group::Parallelism);
        }

        for (name, value) in &self.given {
            if *name == "env" {
                for pair in list_of(value) {
                    out.extra_env.push(env_pair(&pair)?);
                }
            }
        }
        if !out.quiet {
            out.messages
                .extend(self.notes(launcher, fp8, fsdp, megatron, parallelism));
        }
        Ok(out)
    }

    /// A flag's value, when it was given.
    fn value(&self, name: &str) -> Option<&PyValue> {
        self.given.iter().find(|(n, _)| *n == name).map(|(_, v)| v)
    }

    /// Accelerate's own refusals (`_validate_launch_command`): one paradigm at a time.
    fn check_paradigms(&self, inputs: &Inputs<'_>) -> Result<(), UsageError> {
        let mut chosen: Vec<&str> = Vec::new();
        if inputs.cpu {
            chosen.push("--cpu");
        }
        if inputs.multi_gpu {
            chosen.push("--multi_gpu");
        }
        for name in ["use_deepspeed", "use_fsdp"] {
            if self.has(name) {
                chosen.push(if name == "use_fsdp" {
                    "--use_fsdp"
                } else {
                    "--use_deepspeed"
                });
            }
        }
        if chosen.len() > 1 && (self.has("use_deepspeed") || self.has("use_fsdp")) {
            return Err(UsageError::Invalid(format!(
                "{} conflicts with {}: Accelerate runs one of --cpu, --multi_gpu, --use_deepspeed, --use_fsdp at a time",
                chosen[1], chosen[0]
            )));
        }
        if self.has("use_parallelism_config") && !self.has("use_fsdp") {
            return Err(UsageError::Invalid(
                "--use_parallelism_config needs --use_fsdp (and --fsdp_version 2), as under accelerate launch"
                    .to_owned(),
            ));
        }
        Ok(())
    }

    /// Notes for the flags given that have no effect: under muster at all, or in this launch
    /// (an FSDP setting without FSDP), as under `accelerate launch`.
    fn notes(
        &self,
        launcher: Launcher,
        fp8: bool,
        fsdp: bool,
        megatron: bool,
        parallelism: bool,
    ) -> Vec<String> {
        let mut notes = Vec::new();
        for (name, _) in &self.given {
            let Some(flag) = row(name) else { continue };
            let why = match flag.group {
                Group::NoEffect(why) => why,
                Group::DeepSpeed if launcher != Launcher::DeepSpeed => {
                    "it applies with --use_deepspeed only, as under accelerate launch"
                }
                Group::Fsdp if !fsdp => {
                    "it applies with --use_fsdp only, as under accelerate launch"
                }
                Group::Megatron if !megatron => {
                    "it applies with --use_megatron_lm only, as under accelerate launch"
                }
                Group::Fp8 if !fp8 => {
                    "it applies with --mixed_precision fp8 only, as under accelerate launch"
                }
                Group::Parallelism if !parallelism => {
                    "it applies with --use_parallelism_config only, as under accelerate launch"
                }
                Group::Dynamo | Group::Threads if launcher == Launcher::DeepSpeed => {
                    "Accelerate's DeepSpeed launcher does not pass it on either"
                }
                _ => continue,
            };
            notes.push(no_effect(&flag.shown(), why));
        }
        notes
    }
}

/// The strings of a list value (`--env`).
fn list_of(v: &PyValue) -> Vec<String> {
    match v {
        PyValue::List(items) => items.iter().map(PyValue::py_str).collect(),
        v => vec![v.py_str()],
    }
}

/// `--env KEY=VALUE`.
fn env_pair(s: &str) -> Result<(String, String), UsageError> {
    match s.split_once('=') {
        Some((key, value)) if !key.is_empty() && !key.contains('\0') && !value.contains('\0') => {
            Ok((key.to_owned(), value.to_owned()))
        }
        _ => Err(UsageError::Invalid(format!(
            "--env '{s}': expected KEY=VALUE"
        ))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::accelerate_config::{self, py_float};
    use clap::Parser;
    use table::{SAGEMAKER, TPU};

    /// `muster-agent launch`'s Accelerate flags alone, for parsing tests.
    #[derive(Debug, Parser)]
    struct Cli {
        #[command(flatten)]
        flags: AccelerateFlags,
    }

    fn parse(line: &str) -> Result<AccelerateFlags, String> {
        Cli::try_parse_from(std::iter::once("x").chain(line.split_whitespace()))
            .map(|c| c.flags)
            .map_err(|e| e.to_string().lines().next().unwrap_or_default().to_owned())
    }

    /// `KEY=value` lines, sorted, then the messages; or the error.
    fn render(r: &Result<Resolved, UsageError>) -> String {
        match r {
            Ok(r) => {
                let mut lines: Vec<String> =
                    r.env.iter().map(|(k, v)| format!("{k}={v}")).collect();
                lines.sort();
                lines.extend(r.extra_env.iter().map(|(k, v)| format!("env {k}={v}")));
                if r.quiet {
                    lines.push("quiet".to_owned());
                }
                lines.extend(r.messages.iter().cloned());
                lines.join("\n")
            }
            Err(e) => format!("error: {e}"),
        }
    }

    /// Resolves `flags` (`--cpu`, `--multi_gpu` and `--mixed_precision X` are `LaunchArgs`'
    /// and are read here for the inputs) against the config file text `yaml`.
    fn resolve(flags: &str, yaml: &str) -> Result<Resolved, UsageError> {
        let mut rest = Vec::new();
        let (mut cpu, mut multi_gpu, mut mp) = (false, false, None);
        let mut words = flags.split_whitespace();
        while let Some(w) = words.next() {
            match w {
                "--cpu" => cpu = true,
                "--multi_gpu" | "--multi-gpu" => multi_gpu = true,
                "--mixed_precision" => mp = words.next().map(str::to_owned),
                w => rest.push(w),
            }
        }
        let parsed = parse(&rest.join(" ")).unwrap_or_else(|e| panic!("{flags}: {e}"));
        let config = if yaml.is_empty() {
            AccelerateConfig::default()
        } else {
            accelerate_config::parse(yaml).unwrap_or_else(|e| panic!("{yaml}: {e}"))
        };
        let from_file = mp.is_none() && config.mixed_precision.is_some();
        let mp = mp.or(config.mixed_precision.clone());
        parsed.resolve(&Inputs {
            cpu,
            multi_gpu,
            mixed_precision: mp.as_deref(),
            mixed_precision_from_file: from_file,
            config: &config,
            file: (!yaml.is_empty()).then_some("a.yaml"),
            pythonpath: Some("/lib/py"),
            cwd: "/job",
        })
    }

    /// `expected`: `NAME=value` lines in any order (they are compared sorted), then
    /// `env KEY=VALUE` lines for `--env`, `quiet`, and the messages, in order.
    fn check(flags: &str, yaml: &str, expected: &str) {
        let got = render(&resolve(flags, yaml));
        let lines: Vec<&str> = expected
            .lines()
            .map(str::trim)
            .filter(|l| !l.is_empty())
            .collect();
        let is_var = |l: &&str| {
            l.split_once('=').is_some_and(|(k, _)| {
                !k.is_empty()
                    && k.bytes()
                        .all(|b| b.is_ascii_uppercase() || b.is_ascii_digit() || b == b'_')
            })
        };
        let (mut vars, rest): (Vec<&str>, Vec<&str>) = lines.into_iter().partition(is_var);
        vars.sort_unstable();
        vars.extend(rest);
        assert_eq!(got, vars.join("\n"), "\nflags: {flags}\nfile:\n{yaml}");
    }

    /// What `accelerate launch` sets with no paradigm (and its launcher's defaults).
    const DYNAMO_NONE: &str = "
        ACCELERATE_DYNAMO_BACKEND=NO
        ACCELERATE_DYNAMO_MODE=default
        ACCELERATE_DYNAMO_USE_DYNAMIC=False
        ACCELERATE_DYNAMO_USE_FULLGRAPH=False
        ACCELERATE_DYNAMO_USE_REGIONAL_COMPILATION=False";

    /// FSDP's variables with Accelerate's defaults, less FSDP_VERSION.
    const FSDP_DEFAULTS: &str = "
        FSDP_ACTIVATION_CHECKPOINTING=false
        FSDP_ACTIVATION_CHECKPOINTING_OFFLOAD=false
        FSDP_CPU_RAM_EFFICIENT_LOADING=true
        FSDP_FORWARD_PREFETCH=false";

    #[test]
    fn every_flag_in_both_spellings() {
        for flag in FLAGS.iter().filter(|f| on_command_line(f)) {
            let value = match flag.kind {
                Kind::Switch => "",
                Kind::Int => "3",
                Kind::Float => "0.5",
                Kind::Choice(c) => c[0],
                Kind::DynamoBackend => "inductor",
                Kind::StrToBool => "yes",
                Kind::BoolTriple => "true,false,1",
                Kind::Text | Kind::Append | Kind::PyBool => "x",
            };
            let mut spellings = vec![format!("--{}", flag.name)];
            if !flag.dash.is_empty() {
                spellings.push(format!("--{}", flag.dash));
            }
            if let Some(c) = flag.short {
                spellings.push(format!("-{c}"));
            }
            for spelling in spellings {
                let parsed = parse(&format!("{spelling} {value}"))
                    .unwrap_or_else(|e| panic!("{spelling} {value}: {e}"));
                assert!(parsed.has(flag.name), "{spelling} {value}");
            }
        }
    }

    #[test]
    fn values_are_read_as_argparse_reads_them() {
        for (line, name, expected) in [
            ("--zero_stage 2", "zero_stage", PyValue::Int(2)),
            (
                "--gradient_clipping 1",
                "gradient_clipping",
                PyValue::Float(1.0),
            ),
            (
                "--megatron_lm_no_load_optim False",
                "megatron_lm_no_load_optim",
                PyValue::Bool(true),
            ),
            (
                "--fp8_pad_inner_dim off",
                "fp8_pad_inner_dim",
                PyValue::Int(0),
            ),
            (
                "--fp8_override_linear_precision true,false,1",
                "fp8_override_linear_precision",
                PyValue::List(vec![PyValue::Int(1), PyValue::Int(0), PyValue::Int(1)]),
            ),
            (
                "--env A=1 --env B=2",
                "env",
                PyValue::List(vec![PyValue::Str("A=1".into()), PyValue::Str("B=2".into())]),
            ),
            (
                "--dynamo-backend INDUCTOR",
                "dynamo_backend",
                PyValue::Str("INDUCTOR".into()),
            ),
        ] {
            let flags = parse(line).unwrap_or_else(|e| panic!("{line}: {e}"));
            assert_eq!(flags.value(name), Some(&expected), "{line}");
        }
        for (line, error) in [
            ("--zero_stage two", "expected a whole number, found 'two'"),
            ("--dynamo_backend fast", "expected one of no, eager,"),
            (
                "--dynamo_mode fast",
                "expected one of default, reduce-overhead, max-autotune",
            ),
            (
                "--fp8_backend TE",
                "expected one of ao, te, msamp, found 'TE'",
            ),
            (
                "--fp8_pad_inner_dim maybe",
                "expected true or false, found 'maybe'",
            ),
            ("--fsdp_version 3", "expected one of 1, 2, found '3'"),
        ] {
            let Err(e) = parse(line) else {
                panic!("{line} accepted");
            };
            assert!(e.contains(error), "{line}: {e}");
        }
    }

    #[test]
    fn flags_become_accelerates_variables() {
        // Each verified against `accelerate launch` 1.15 with the same flags (a worker
        // dumping its ACCELERATE_*, FSDP_*, MEGATRON_LM_*, PARALLELISM_CONFIG_*, OMP_* and
        // KMP_* variables), but for OMP_NUM_THREADS, which Accelerate also sets without the
        // flag (see the module's notes in the report).
        check(
            "--multi_gpu --dynamo_backend inductor --dynamo_mode max-autotune --dynamo_use_fullgraph --dynamo_use_dynamic --num_cpu_threads_per_process 3",
            "",
            "ACCELERATE_DYNAMO_BACKEND=INDUCTOR
             ACCELERATE_DYNAMO_MODE=max-autotune
             ACCELERATE_DYNAMO_USE_DYNAMIC=True
             ACCELERATE_DYNAMO_USE_FULLGRAPH=True
             ACCELERATE_DYNAMO_USE_REGIONAL_COMPILATION=False
             OMP_NUM_THREADS=3",
        );
        check(
            "--use_fsdp --fsdp_version 2 --fsdp_auto_wrap_policy TRANSFORMER_BASED_WRAP --fsdp_transformer_layer_cls_to_wrap Block --fsdp_backward_prefetch BACKWARD_PRE --fsdp_state_dict_type SHARDED_STATE_DICT --fsdp-min-num-params 5 --fsdp-offload-params True",
            "",
            &format!(
                "{DYNAMO_NONE}
                 ACCELERATE_USE_FSDP=true
                 {FSDP_DEFAULTS}
                 FSDP_AUTO_WRAP_POLICY=TRANSFORMER_BASED_WRAP
                 FSDP_BACKWARD_PREFETCH=BACKWARD_PRE
                 FSDP_MIN_NUM_PARAMS=5
                 FSDP_OFFLOAD_PARAMS=true
                 FSDP_RESHARD_AFTER_FORWARD=true
                 FSDP_SHARDING_STRATEGY=FULL_SHARD
                 FSDP_STATE_DICT_TYPE=SHARDED_STATE_DICT
                 FSDP_SYNC_MODULE_STATES=true
                 FSDP_TRANSFORMER_CLS_TO_WRAP=Block
                 FSDP_USE_ORIG_PARAMS=true
                 FSDP_VERSION=2"
            ),
        );
        check(
            "--use_megatron_lm --megatron_lm_tp_degree 2 --megatron_lm_no_load_optim False --megatron_lm_gradient_clipping 1 --megatron_lm_num_micro_batches 4 --megatron-lm-attention-dropout 0.1",
            "",
            &format!(
                "{DYNAMO_NONE}
                 ACCELERATE_USE_MEGATRON_LM=true
                 MEGATRON_LM_ATTENTION_DROPOUT=0.1
                 MEGATRON_LM_EOD_MASK_LOSS=False
                 MEGATRON_LM_GRADIENT_CLIPPING=1.0
                 MEGATRON_LM_NO_LOAD_OPTIM=True
                 MEGATRON_LM_NO_SAVE_OPTIM=False
                 MEGATRON_LM_NUM_MICRO_BATCHES=4
                 MEGATRON_LM_OPTIMIZER_CPU_OFFLOAD=False
                 MEGATRON_LM_OVERLAP_CPU_OPTIMIZER_D2H_H2D=False
                 MEGATRON_LM_PP_DEGREE=1
                 MEGATRON_LM_TP_DEGREE=2
                 MEGATRON_LM_USE_CUSTOM_FSDP=False
                 MEGATRON_LM_USE_PRECISION_AWARE_OPTIMIZER=False"
            ),
        );
        check(
            "--use_fsdp --fsdp_version 2 --use_parallelism_config --parallelism_config_tp_size 2 --parallelism_config_cp_size 2 --parallelism_config_sp_size 1",
            "",
            &format!(
                "{DYNAMO_NONE}
                 ACCELERATE_USE_FSDP=true
                 ACCELERATE_USE_PARALLELISM_CONFIG=true
                 {FSDP_DEFAULTS}
                 FSDP_MIN_NUM_PARAMS=100000000
                 FSDP_OFFLOAD_PARAMS=false
                 FSDP_RESHARD_AFTER_FORWARD=true
                 FSDP_SHARDING_STRATEGY=FULL_SHARD
                 FSDP_SYNC_MODULE_STATES=true
                 FSDP_USE_ORIG_PARAMS=true
                 FSDP_VERSION=2
                 PARALLELISM_CONFIG_CP_BACKEND=torch
                 PARALLELISM_CONFIG_CP_COMM_STRATEGY=allgather
                 PARALLELISM_CONFIG_CP_SIZE=2
                 PARALLELISM_CONFIG_DP_REPLICATE_SIZE=1
                 PARALLELISM_CONFIG_DP_SHARD_SIZE=1
                 PARALLELISM_CONFIG_SP_BACKEND=deepspeed
                 PARALLELISM_CONFIG_SP_SIZE=1
                 PARALLELISM_CONFIG_TP_SIZE=2"
            ),
        );
        // --cpu: the simple launcher, with Intel OpenMP's settings.
        check(
            "--cpu -q",
            "",
            &format!(
                "{DYNAMO_NONE}
                 KMP_AFFINITY=granularity=fine,compact,1,0
                 KMP_BLOCKTIME=1
                 quiet"
            ),
        );
    }

    #[test]
    fn deepspeed_and_fp8_as_accelerates_source_says() {
        // DeepSpeed and FP8 cannot run here (neither is installed with the peers), so these
        // follow prepare_deepspeed_cmd_env and setup_fp8_env line by line: no TorchDynamo
        // variables and no OMP_NUM_THREADS under DeepSpeed, lower-cased devices and flags.
        check(
            "--use_deepspeed --zero_stage 3 --offload_optimizer_device CPU --gradient_accumulation_steps 4 --gradient_clipping 1 --zero3_init_flag True --deepspeed_config_file ds.json --num_cpu_threads_per_process 2 --dynamo_backend eager",
            "",
            "ACCELERATE_CONFIG_DS_FIELDS=
             ACCELERATE_DEEPSPEED_CONFIG_FILE=ds.json
             ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_DEVICE=cpu
             ACCELERATE_DEEPSPEED_ZERO3_INIT=true
             ACCELERATE_DEEPSPEED_ZERO_STAGE=3
             ACCELERATE_GRADIENT_ACCUMULATION_STEPS=4
             ACCELERATE_GRADIENT_CLIPPING=1.0
             ACCELERATE_USE_DEEPSPEED=true
             PYTHONPATH=/lib/py:/job
             note: --num_cpu_threads_per_process has no effect under muster: Accelerate's DeepSpeed launcher does not pass it on either
             note: --dynamo_backend has no effect under muster: Accelerate's DeepSpeed launcher does not pass it on either",
        );
        check(
            "--multi_gpu --mixed_precision fp8 --fp8_backend te --fp8_format E4M3 --fp8_override_linear_precision false,false,true",
            "",
            "ACCELERATE_DYNAMO_BACKEND=NO
                 ACCELERATE_DYNAMO_MODE=default
                 ACCELERATE_DYNAMO_USE_DYNAMIC=False
                 ACCELERATE_DYNAMO_USE_FULLGRAPH=False
                 ACCELERATE_DYNAMO_USE_REGIONAL_COMPILATION=False
                 ACCELERATE_FP8_AMAX_COMPUTE_ALGO=most_recent
                 ACCELERATE_FP8_AMAX_HISTORY_LEN=1024
                 ACCELERATE_FP8_BACKEND=te
                 ACCELERATE_FP8_ENABLE_FSDP_FLOAT8_ALL_GATHER=1
                 ACCELERATE_FP8_FORMAT=E4M3
                 ACCELERATE_FP8_INTERVAL=1
                 ACCELERATE_FP8_MARGIN=0
                 ACCELERATE_FP8_OPT_LEVEL=O2
                 ACCELERATE_FP8_OVERRIDE_DGRAD=0
                 ACCELERATE_FP8_OVERRIDE_FPROP=0
                 ACCELERATE_FP8_OVERRIDE_WGRAD=1
                 ACCELERATE_FP8_PAD_INNER_DIM=1
                 ACCELERATE_FP8_USE_AUTOCAST_DURING_EVAL=False",
        );
    }

    #[test]
    fn a_config_file_gives_what_the_flags_give() {
        // Verified against `accelerate launch --config_file` 1.15: the file's sections become
        // the same variables as the flags, and a flag beats the file.
        let fsdp_file = "distributed_type: FSDP
fsdp_config:
  fsdp_sharding_strategy: SHARD_GRAD_OP
  fsdp_offload_params: true
  fsdp_version: 2
  fsdp_min_num_params: 1000
  fsdp_sync_module_states: true
";
        let fsdp_env = format!(
            "{DYNAMO_NONE}
             ACCELERATE_USE_FSDP=true
             {FSDP_DEFAULTS}
             FSDP_MIN_NUM_PARAMS=1000
             FSDP_OFFLOAD_PARAMS=true
             FSDP_RESHARD_AFTER_FORWARD=true
             FSDP_SHARDING_STRATEGY=SHARD_GRAD_OP
             FSDP_SYNC_MODULE_STATES=true
             FSDP_USE_ORIG_PARAMS=true
             FSDP_VERSION=2"
        );
        check("", fsdp_file, &fsdp_env);
        check(
            "--use_fsdp --fsdp_sharding_strategy SHARD_GRAD_OP --fsdp_offload_params true --fsdp_version 2 --fsdp_min_num_params 1000 --fsdp_sync_module_states true",
            "",
            &fsdp_env,
        );
        check(
            "--fsdp_offload_params false",
            fsdp_file,
            &fsdp_env.replace("FSDP_OFFLOAD_PARAMS=true", "FSDP_OFFLOAD_PARAMS=false"),
        );
        // A file's TorchDynamo and Megatron-LM sections, then flags over them.
        let file = "distributed_type: MEGATRON_LM
dynamo_config:
  dynamo_backend: INDUCTOR
  dynamo_mode: reduce-overhead
  dynamo_use_fullgraph: true
megatron_lm_config:
  megatron_lm_tp_degree: 2
  megatron_lm_gradient_clipping: 0.5
  megatron_lm_sequence_parallelism: true
  megatron_lm_num_micro_batches: 2
";
        let megatron = "ACCELERATE_DYNAMO_USE_DYNAMIC=False
             ACCELERATE_DYNAMO_USE_FULLGRAPH=True
             ACCELERATE_DYNAMO_USE_REGIONAL_COMPILATION=False
             ACCELERATE_USE_MEGATRON_LM=true
             MEGATRON_LM_EOD_MASK_LOSS=False
             MEGATRON_LM_GRADIENT_CLIPPING=0.5
             MEGATRON_LM_NO_LOAD_OPTIM=False
             MEGATRON_LM_NO_SAVE_OPTIM=False
             MEGATRON_LM_NUM_MICRO_BATCHES=2
             MEGATRON_LM_OPTIMIZER_CPU_OFFLOAD=False
             MEGATRON_LM_OVERLAP_CPU_OPTIMIZER_D2H_H2D=False
             MEGATRON_LM_PP_DEGREE=1
             MEGATRON_LM_SEQUENCE_PARALLELISM=True";
        check(
            "",
            file,
            &format!(
                "ACCELERATE_DYNAMO_BACKEND=INDUCTOR
                 ACCELERATE_DYNAMO_MODE=reduce-overhead
                 {megatron}
                 MEGATRON_LM_TP_DEGREE=2
                 MEGATRON_LM_USE_CUSTOM_FSDP=False
                 MEGATRON_LM_USE_PRECISION_AWARE_OPTIMIZER=False"
            ),
        );
        check(
            "--dynamo_mode default --megatron_lm_tp_degree 4",
            file,
            &format!(
                "ACCELERATE_DYNAMO_BACKEND=INDUCTOR
                 ACCELERATE_DYNAMO_MODE=default
                 {megatron}
                 MEGATRON_LM_TP_DEGREE=4
                 MEGATRON_LM_USE_CUSTOM_FSDP=False
                 MEGATRON_LM_USE_PRECISION_AWARE_OPTIMIZER=False"
            ),
        );
        // A paradigm flag beats the file's distributed_type; section keys without their
        // prefix get it, as Accelerate gives it; DeepSpeed lists the file's keys.
        check(
            "--multi_gpu",
            "distributed_type: FSDP\nfsdp_config:\n  sharding_strategy: NO_SHARD\n",
            DYNAMO_NONE,
        );
        check(
            "",
            "distributed_type: DEEPSPEED
mixed_precision: bf16
deepspeed_config:
  zero_stage: 2
  offload_optimizer_device: none
  gradient_accumulation_steps: 1
  zero3_init_flag: false
  deepspeed_multinode_launcher: standard
  mystery: 1
",
            "ACCELERATE_CONFIG_DS_FIELDS=zero_stage,offload_optimizer_device,gradient_accumulation_steps,zero3_init_flag,deepspeed_multinode_launcher,mystery,mixed_precision
             ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_DEVICE=none
             ACCELERATE_DEEPSPEED_ZERO3_INIT=false
             ACCELERATE_DEEPSPEED_ZERO_STAGE=2
             ACCELERATE_GRADIENT_ACCUMULATION_STEPS=1
             ACCELERATE_USE_DEEPSPEED=true
             PYTHONPATH=/lib/py:/job
             --config-file 'a.yaml': deepspeed_config: mystery: unknown key, ignored",
        );
        // The older top-level dynamo_backend.
        check(
            "",
            "dynamo_backend: EAGER\n",
            &DYNAMO_NONE.replace("BACKEND=NO", "BACKEND=EAGER"),
        );
        check(
            "",
            "dynamo_config:\n  dynamo_backend: WARP\n",
            "error: --config-file 'a.yaml': dynamo_config: dynamo_backend: expected one of no, eager, aot_eager, inductor, aot_ts_nvfuser, nvprims_nvfuser, cudagraphs, ofi, fx2trt, onnxrt, tensorrt, aot_torchxla_trace_once, torchxla_trace_once, tvm, hpu_backend, neuron, found 'WARP'",
        );
    }

    #[test]
    fn no_effect_flags_are_noted() {
        check(
            "--multi_gpu --gradient_accumulation_steps 4 --downcast_bf16 --same_network --main_training_function foo --tpu_use_sudo --vm x --env FOO=1 --env BAR=a=b --aws_access_key_id a --gradient_clipping 1.5 --zero_stage 2 --fsdp_version 2 --mpirun-hostfile h --tpu --megatron_lm_tp_degree 2 --fp8_backend te --parallelism_config_tp_size 2",
            "",
            &format!(
                "{DYNAMO_NONE}
                 env FOO=1
                 env BAR=a=b
                 note: --same_network has no effect under muster: muster's rendezvous goes through its coordinator whether or not the machines share a network
                 note: --tpu has no effect under muster: {TPU}
                 note: --tpu_use_sudo has no effect under muster: {TPU}
                 note: --vm has no effect under muster: {TPU}
                 note: --main_training_function has no effect under muster: only Accelerate's TPU launcher calls a function by name; muster runs the script
                 note: --downcast_bf16 has no effect under muster: it applies on TPUs only (XLA_DOWNCAST_BF16)
                 note: --zero_stage has no effect under muster: it applies with --use_deepspeed only, as under accelerate launch
                 note: --gradient_accumulation_steps has no effect under muster: it applies with --use_deepspeed only, as under accelerate launch
                 note: --gradient_clipping has no effect under muster: it applies with --use_deepspeed only, as under accelerate launch
                 note: --fsdp_version has no effect under muster: it applies with --use_fsdp only, as under accelerate launch
                 note: --megatron_lm_tp_degree has no effect under muster: it applies with --use_megatron_lm only, as under accelerate launch
                 note: --fp8_backend has no effect under muster: it applies with --mixed_precision fp8 only, as under accelerate launch
                 note: --aws_access_key_id has no effect under muster: {SAGEMAKER}
                 note: --mpirun_hostfile has no effect under muster: muster starts each node's processes itself: run the agent on every host (or under srun)
                 note: --parallelism_config_tp_size has no effect under muster: it applies with --use_parallelism_config only, as under accelerate launch"
            )
            ,
        );
        // -q leaves the notes out.
        check("-q --tpu", "", &format!("{DYNAMO_NONE}\nquiet"));
    }

    #[test]
    fn accelerates_refusals() {
        for (flags, error) in [
            (
                "--use_fsdp --use_deepspeed",
                "--use_fsdp conflicts with --use_deepspeed: Accelerate runs one of --cpu, --multi_gpu, --use_deepspeed, --use_fsdp at a time",
            ),
            (
                "--cpu --use_fsdp",
                "--use_fsdp conflicts with --cpu: Accelerate runs one of --cpu, --multi_gpu, --use_deepspeed, --use_fsdp at a time",
            ),
            (
                "--use_parallelism_config",
                "--use_parallelism_config needs --use_fsdp (and --fsdp_version 2), as under accelerate launch",
            ),
            ("--env FOO", "--env 'FOO': expected KEY=VALUE"),
            ("--env =1", "--env '=1': expected KEY=VALUE"),
        ] {
            assert_eq!(
                render(&resolve(flags, "")),
                format!("error: {error}"),
                "{flags}"
            );
        }
        // Accelerate's check on a falsy sync_module_states (a file's `false`).
        assert_eq!(
            render(&resolve(
                "",
                "distributed_type: FSDP\nfsdp_config:\n  fsdp_sync_module_states: false\n"
            )),
            "error: --fsdp_cpu_ram_efficient_loading needs --fsdp_sync_module_states true (as under accelerate launch)"
        );
    }

    #[test]
    fn python_spellings() {
        for (f, s) in [
            (1.0, "1.0"),
            (0.5, "0.5"),
            (1e-5, "1e-05"),
            (1e16, "1e+16"),
            (123_456.0, "123456.0"),
            (0.0001, "0.0001"),
            (-2.5, "-2.5"),
        ] {
            assert_eq!(py_float(f), s);
        }
    }
}
