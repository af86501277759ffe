//! Accelerate's config file (`accelerate config` writes it, `accelerate launch --config_file`
//! reads it), read by `muster-agent launch --config-file`: every key is checked, the ones muster
//! honours are returned, the ones it cannot honour are named in warnings, and a value of the
//! wrong kind is an error naming the key.
//!
//! The sections that configure Accelerate's training paradigms (`fsdp_config`,
//! `deepspeed_config`, `megatron_lm_config`, `dynamo_config`, `fp8_config`,
//! `parallelism_config`) and `distributed_type` are returned as Accelerate's launcher reads
//! them, as the `accelerate launch` flags they stand for ([`AccelerateConfig::launch_settings`]):
//! `cli::accelerate_flags` turns flags and file alike into the workers' variables, so a
//! setting has the same effect from either.
//!
//! The file is read as a YAML tree (YAML 1.2, so JSON files, which `accelerate config default`
//! writes, are read too). Booleans also take PyYAML's YAML 1.1 spellings (`yes`, `no`, `on`,
//! `off`), since Accelerate reads these files with PyYAML.

use crate::gpu::GpuIds;
use muster_core::model;
use yaml_rust2::{Yaml, YamlLoader};

/// The settings of an Accelerate config file that muster honours; `None` where the file does
/// not say (or says `null`).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct AccelerateConfig {
    /// `num_processes`: processes across all machines.
    pub num_processes: Option<u32>,
    /// `num_machines`.
    pub num_machines: Option<u32>,
    /// `machine_rank`: this machine's node rank.
    pub machine_rank: Option<u32>,
    /// `main_process_ip`: machine rank 0's address (MASTER_ADDR).
    pub main_process_ip: Option<String>,
    /// `main_process_port` (MASTER_PORT); 0 asks for a free one.
    pub main_process_port: Option<u16>,
    /// `gpu_ids`.
    pub gpu_ids: Option<GpuIds>,
    /// `mixed_precision`, lower case: `no`, `fp16`, `bf16` or `fp8`.
    pub mixed_precision: Option<String>,
    /// `use_cpu`.
    pub use_cpu: Option<bool>,
    /// `debug` (ACCELERATE_DEBUG_MODE).
    pub debug: Option<bool>,
    /// `enable_cpu_affinity` (ACCELERATE_CPU_AFFINITY).
    pub enable_cpu_affinity: Option<bool>,
    /// `max_restarts`.
    pub max_restarts: Option<u32>,
    /// `muster_agent_store` (muster's own key; `false` is `--no-agent-store`): whether the
    /// agent serves torch's store to the workers.
    pub muster_agent_store: Option<bool>,
    /// `muster_recovery` (muster's own key, as `--recovery`): `restart` or `in-place`.
    pub muster_recovery: Option<crate::env::Recovery>,
    /// `muster_hang_timeout` (muster's own key, as `--hang-timeout`): `90s`, `5m`, `off`;
    /// `Some(None)` is off.
    pub muster_hang_timeout: Option<Option<std::time::Duration>>,
    /// `muster_on_hang` (muster's own key, as `--on-hang`): `report`, `fail` or `restart`.
    pub muster_on_hang: Option<muster_core::requests::OnHang>,
    /// `muster_max_spares` (muster's own key, as `--max-spares`): spare agents admitted.
    pub muster_max_spares: Option<u32>,
    /// `muster_sample_stacks` (muster's own key, as `--sample-stacks`): samples a second.
    pub muster_sample_stacks: Option<f64>,
    /// `muster_flight_recorder` (muster's own key; `false` as `--no-flight-recorder`).
    pub muster_flight_recorder: Option<bool>,
    /// `monitor_interval`, in seconds: checked, not used (muster learns of exits at once).
    pub monitor_interval: Option<f64>,
    /// `distributed_type`, upper case (`FSDP`, `DEEPSPEED`, `MULTI_GPU`, ...).
    pub distributed_type: Option<String>,
    /// The settings of the paradigm sections under the names of the `accelerate launch`
    /// flags Accelerate copies them to (`fsdp_config: {sharding_strategy: X}` is
    /// `fsdp_sharding_strategy`, `dynamo_config: {mode: X}` is `dynamo_mode`), in file order,
    /// with the section they came from (for messages).
    pub launch_settings: Vec<LaunchSetting>,
    /// `deepspeed_config`'s keys as the file writes them: Accelerate passes them to the
    /// workers (ACCELERATE_CONFIG_DS_FIELDS) so that they beat a DeepSpeed JSON's `auto`.
    pub deepspeed_fields: Vec<String>,
    /// `parallelism_config` holds settings: Accelerate then uses it (as with
    /// `--use_parallelism_config`).
    pub parallelism_config: bool,
    /// What the file asks for that muster ignores, one line each, naming the key.
    pub warnings: Vec<String>,
}

/// One setting of a paradigm section, as the `accelerate launch` flag it stands for.
#[derive(Debug, Clone, PartialEq)]
pub struct LaunchSetting {
    /// The section (`fsdp_config`), or `""` for a top-level key (the old `dynamo_backend`).
    pub section: &'static str,
    /// The key as written in the file.
    pub key: String,
    /// The flag's name, snake case without dashes (`fsdp_sharding_strategy`).
    pub flag: String,
    /// The value as Python holds it after PyYAML read it.
    pub value: PyValue,
}

/// A value as Python holds it after PyYAML or argparse read it. Accelerate's launcher passes
/// `str(value)` (sometimes lower-cased) to the workers, so the variables keep Python's
/// spellings: `True`, `1.0`, `None`.
#[derive(Debug, Clone, PartialEq)]
pub enum PyValue {
    /// `None`.
    None,
    /// A `bool`.
    Bool(bool),
    /// An `int`.
    Int(i64),
    /// A `float`.
    Float(f64),
    /// A `str`.
    Str(String),
    /// A list or tuple (`fp8_override_linear_precision`).
    List(Vec<PyValue>),
}

impl PyValue {
    /// Python's `str(value)`.
    pub fn py_str(&self) -> String {
        match self {
            Self::None => "None".to_owned(),
            Self::Bool(true) => "True".to_owned(),
            Self::Bool(false) => "False".to_owned(),
            Self::Int(i) => i.to_string(),
            Self::Float(f) => py_float(*f),
            Self::Str(s) => s.clone(),
            Self::List(items) => {
                let items: Vec<String> = items.iter().map(Self::py_repr).collect();
                format!("[{}]", items.join(", "))
            }
        }
    }

    /// Python's `repr(value)` (a list's items are shown so).
    fn py_repr(&self) -> String {
        match self {
            Self::Str(s) => format!("'{s}'"),
            v => v.py_str(),
        }
    }

    /// Python's truth value (`bool(value)`).
    pub fn truthy(&self) -> bool {
        match self {
            Self::None => false,
            Self::Bool(b) => *b,
            Self::Int(i) => *i != 0,
            Self::Float(f) => *f != 0.0,
            Self::Str(s) => !s.is_empty(),
            Self::List(l) => !l.is_empty(),
        }
    }

    /// The value as a number, for Accelerate's comparisons (`cp_size > 1`).
    pub fn as_f64(&self) -> Option<f64> {
        match self {
            Self::Bool(b) => Some(f64::from(u8::from(*b))),
            Self::Int(i) => Some(*i as f64),
            Self::Float(f) => Some(*f),
            _ => None,
        }
    }

    /// The value PyYAML gives a node (YAML 1.1: `yes`, `no`, `on` and `off` are booleans).
    fn from_yaml(v: &Yaml) -> Self {
        match v {
            Yaml::Null | Yaml::BadValue | Yaml::Alias(_) => Self::None,
            Yaml::Boolean(b) => Self::Bool(*b),
            Yaml::Integer(i) => Self::Int(*i),
            Yaml::Real(r) => r
                .parse::<f64>()
                .map_or_else(|_| Self::Str(r.clone()), Self::Float),
            Yaml::String(s) => match s.as_str() {
                "yes" | "Yes" | "YES" | "on" | "On" | "ON" => Self::Bool(true),
                "no" | "No" | "NO" | "off" | "Off" | "OFF" => Self::Bool(false),
                _ => Self::Str(s.clone()),
            },
            Yaml::Array(items) => Self::List(items.iter().map(Self::from_yaml).collect()),
            Yaml::Hash(_) => Self::Str(shown(v)),
        }
    }
}

/// Python's `repr(float)`: the shortest digits that read back the same, in positional
/// notation from 1e-4 up to 1e16 (with at least one decimal), else as `1e+16`.
pub fn py_float(f: f64) -> String {
    if f.is_nan() {
        return "nan".to_owned();
    }
    if f.is_infinite() {
        return if f > 0.0 { "inf" } else { "-inf" }.to_owned();
    }
    // Rust's `{:e}` gives the same shortest digits: `d.ddddde-7`.
    let sci = format!("{f:e}");
    let (mantissa, exp) = sci.split_once('e').unwrap_or((&sci, "0"));
    let exp: i32 = exp.parse().unwrap_or(0);
    if (-4..16).contains(&exp) {
        let s = format!("{f}");
        if s.contains('.') { s } else { format!("{s}.0") }
    } else {
        let sign = if exp < 0 { '-' } else { '+' };
        format!("{mantissa}e{sign}{:02}", exp.abs())
    }
}

/// Why a config file cannot be used. The caller names the file.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ConfigError {
    /// The file cannot be read.
    #[error("cannot read it: {0}")]
    Read(String),
    /// Not YAML (or JSON).
    #[error("is not valid YAML: {0}")]
    Yaml(String),
    /// YAML, but not one mapping of settings.
    #[error("{0}; expected `key: value` settings as `accelerate config` writes them")]
    Shape(String),
    /// A value of the wrong kind or out of range.
    #[error("{key}: {why}")]
    Invalid {
        /// The key.
        key: String,
        /// What is wrong with its value.
        why: String,
    },
}

/// Mixed precision modes Accelerate knows.
pub const MIXED_PRECISION: [&str; 4] = ["no", "fp16", "bf16", "fp8"];

/// Checks a mixed precision mode (`--mixed-precision`, the `mixed_precision` key), returning
/// it in lower case.
pub fn mixed_precision(s: &str) -> Result<String, String> {
    let lower = s.trim().to_ascii_lowercase();
    if MIXED_PRECISION.contains(&lower.as_str()) {
        Ok(lower)
    } else {
        Err(format!(
            "expected one of {}, found {s:?}",
            MIXED_PRECISION.join(", ")
        ))
    }
}

/// Where `accelerate launch` looks for its config file without `--config_file` (what
/// `accelerate config` writes): `$HF_HOME/accelerate/default_config.yaml`, `$HF_HOME` being
/// `$XDG_CACHE_HOME/huggingface` or `~/.cache/huggingface` when unset, a leading `~`
/// expanded as Python's `os.path.expanduser` does (accelerate/commands/config/config_args.py).
/// `None` where `~` cannot be expanded (no `HOME`). `var` reads the environment.
pub fn default_path(var: impl Fn(&str) -> Option<String>) -> Option<std::path::PathBuf> {
    let hf_home = var("HF_HOME").unwrap_or_else(|| {
        let cache = var("XDG_CACHE_HOME").unwrap_or_else(|| "~/.cache".to_owned());
        format!("{cache}/huggingface")
    });
    let expanded = match hf_home.strip_prefix('~') {
        Some(rest) if rest.is_empty() || rest.starts_with('/') => {
            format!("{}{rest}", var("HOME").filter(|h| !h.is_empty())?)
        }
        _ => hf_home,
    };
    Some(
        std::path::Path::new(&expanded)
            .join("accelerate")
            .join("default_config.yaml"),
    )
}

/// Reads and checks the file at `path`.
pub fn load(path: &std::path::Path) -> Result<AccelerateConfig, ConfigError> {
    let text = std::fs::read_to_string(path).map_err(|e| ConfigError::Read(e.to_string()))?;
    parse(&text)
}

/// Checks the text of a config file.
pub fn parse(text: &str) -> Result<AccelerateConfig, ConfigError> {
    let docs = YamlLoader::load_from_str(text).map_err(|e| ConfigError::Yaml(e.to_string()))?;
    let root = match docs.as_slice() {
        [] => return Err(ConfigError::Shape("the file is empty".to_owned())),
        [root] => root,
        more => {
            return Err(ConfigError::Shape(format!(
                "the file holds {} YAML documents",
                more.len()
            )));
        }
    };
    let Yaml::Hash(settings) = root else {
        return Err(ConfigError::Shape(format!(
            "the file holds {}, not a mapping",
            shown(root)
        )));
    };
    let mut config = AccelerateConfig::default();
    for (key, value) in settings {
        let Yaml::String(key) = key else {
            config
                .warnings
                .push(format!("key {} is not a setting name; ignored", shown(key)));
            continue;
        };
        read_setting(&mut config, key, value)?;
    }
    Ok(config)
}

/// Settings muster cannot honour: a warning when they ask for something.
const IGNORED_SECTIONS: [&str; 3] = ["ipex_config", "mpirun_config", "sagemaker_config"];

/// The sections Accelerate's launcher copies into its flags, and the prefix it gives a key
/// that lacks it (`accelerate/commands/launch.py`, `_validate_launch_command`).
const PARADIGM_SECTIONS: [(&str, &str); 6] = [
    ("fsdp_config", "fsdp"),
    ("fp8_config", "fp8"),
    ("dynamo_config", "dynamo_"),
    ("deepspeed_config", ""),
    ("megatron_lm_config", ""),
    ("parallelism_config", ""),
];

/// Reads a paradigm section into `config.launch_settings`.
fn read_section(
    config: &mut AccelerateConfig,
    section: &'static str,
    prefix: &str,
    value: &Yaml,
) -> Result<(), ConfigError> {
    let settings = match value {
        Yaml::Null => return Ok(()),
        Yaml::Hash(h) => h,
        v => {
            return Err(ConfigError::Invalid {
                key: section.to_owned(),
                why: format!("expected a mapping of settings, found {}", shown(v)),
            });
        }
    };
    for (key, value) in settings {
        let Yaml::String(key) = key else {
            config.warnings.push(format!(
                "{section}: key {} is not a setting name; ignored",
                shown(key)
            ));
            continue;
        };
        if section == "deepspeed_config" {
            config.deepspeed_fields.push(key.clone());
        }
        if section == "parallelism_config" {
            config.parallelism_config = true;
        }
        // Accelerate: `fsdp_` + key unless the key starts with `fsdp` (so `fsdp_version`
        // stays), likewise `fp8`, and `dynamo_` for dynamo_config.
        let flag = if prefix.is_empty() || key.starts_with(prefix) {
            key.clone()
        } else if prefix.ends_with('_') {
            format!("{prefix}{key}")
        } else {
            format!("{prefix}_{key}")
        };
        config.launch_settings.push(LaunchSetting {
            section,
            key: key.clone(),
            flag,
            value: PyValue::from_yaml(value),
        });
    }
    Ok(())
}

fn read_setting(config: &mut AccelerateConfig, key: &str, value: &Yaml) -> Result<(), ConfigError> {
    if let Some((section, prefix)) = PARADIGM_SECTIONS.iter().find(|(s, _)| *s == key) {
        return read_section(config, section, prefix, value);
    }
    let v = Value { key, value };
    match key {
        "num_processes" => config.num_processes = v.int(1, u64::from(u32::MAX))?,
        "num_machines" => config.num_machines = v.int(1, u64::from(model::MAX_NODES))?,
        "machine_rank" => config.machine_rank = v.int(0, u64::from(model::MAX_NODES) - 1)?,
        "max_restarts" => config.max_restarts = v.int(0, u64::from(u32::MAX))?,
        "muster_max_spares" => config.muster_max_spares = v.int(0, u64::from(u32::MAX))?,
        "main_process_port" => config.main_process_port = v.int(0, u64::from(u16::MAX))?,
        "main_process_ip" => {
            config.main_process_ip = match v.string()? {
                Some("") | None => None,
                Some(s) => Some(
                    crate::net::plain_host(s)
                        .map_err(|why| v.invalid(&why))?
                        .to_owned(),
                ),
            };
        }
        "gpu_ids" => config.gpu_ids = v.gpu_ids()?,
        "mixed_precision" => {
            config.mixed_precision = match value {
                // PyYAML reads an unquoted `no` as false.
                Yaml::Boolean(false) => Some("no".to_owned()),
                _ => match v.string()? {
                    Some(s) => Some(mixed_precision(s).map_err(|why| v.invalid(&why))?),
                    None => None,
                },
            };
        }
        "use_cpu" => config.use_cpu = v.boolean()?,
        "debug" => config.debug = v.boolean()?,
        "enable_cpu_affinity" => config.enable_cpu_affinity = v.boolean()?,
        "muster_agent_store" => config.muster_agent_store = v.boolean()?,
        "muster_flight_recorder" => config.muster_flight_recorder = v.boolean()?,
        "muster_recovery" => {
            config.muster_recovery = match v.string()? {
                Some(s) => Some(crate::env::Recovery::parse(s).map_err(|why| v.invalid(&why))?),
                None => None,
            };
        }
        "muster_hang_timeout" => {
            // A bare number is seconds, as on the command line.
            let text = match v.value {
                Yaml::Integer(i) => Some(i.to_string()),
                _ => v.string()?.map(str::to_owned),
            };
            config.muster_hang_timeout = match text {
                Some(s) => {
                    Some(crate::cli::values::parse_duration(&s).map_err(|why| v.invalid(&why))?)
                }
                None => None,
            };
        }
        "muster_on_hang" => {
            config.muster_on_hang = match v.string()? {
                Some(s) => {
                    Some(muster_core::requests::OnHang::parse(s).map_err(|why| v.invalid(&why))?)
                }
                None => None,
            };
        }
        // A rate is a non-negative number, as a number of seconds is.
        "muster_sample_stacks" => config.muster_sample_stacks = v.seconds()?,
        "monitor_interval" => config.monitor_interval = v.seconds()?,
        "distributed_type" => {
            if let Some(t) = v.string()? {
                let upper = t.to_ascii_uppercase();
                if ![
                    "NO",
                    "MULTI_CPU",
                    "MULTI_GPU",
                    "FSDP",
                    "DEEPSPEED",
                    "MEGATRON_LM",
                ]
                .contains(&upper.as_str())
                {
                    config.warnings.push(format!(
                        "distributed_type {t} is not supported and is ignored: the workers get the plain torch.distributed environment, as with MULTI_GPU or MULTI_CPU"
                    ));
                }
                config.distributed_type = Some(upper);
            }
        }
        // Accelerate's older spelling of dynamo_config's dynamo_backend.
        "dynamo_backend" => {
            if let Some(b) = v.string()?
                && !b.eq_ignore_ascii_case("no")
            {
                config.launch_settings.push(LaunchSetting {
                    section: "",
                    key: key.to_owned(),
                    flag: key.to_owned(),
                    value: PyValue::Str(b.to_owned()),
                });
            }
        }

        "compute_environment" => {
            if let Some(e) = v.string()?
                && !e.eq_ignore_ascii_case("LOCAL_MACHINE")
            {
                config.warnings.push(format!(
                    "compute_environment {e} is ignored: muster runs the processes on the machines its agents run on"
                ));
            }
        }
        // Accepted and checked; nothing for muster to do with them.
        "rdzv_backend" | "main_training_function" => {
            v.string()?;
        }
        "same_network" => {
            v.boolean()?;
        }
        "downcast_bf16" => {
            // `accelerate config` writes 'no' / 'yes'; newer versions write booleans.
            if !matches!(value, Yaml::String(_)) {
                v.boolean()?;
            }
        }
        _ if key.starts_with("tpu_") || IGNORED_SECTIONS.contains(&key) => {
            if asks_for_something(value) {
                config.warnings.push(format!(
                    "{key} is ignored: it configures Accelerate's TPU, SageMaker, IPEX or mpirun launchers, which muster does not use"
                ));
            }
        }
        _ => config
            .warnings
            .push(format!("unknown key {key} is ignored")),
    }
    Ok(())
}

/// Whether an ignored setting holds more than the defaults `accelerate config` writes
/// (`tpu_env: []`, `tpu_use_cluster: false`, `mpirun_config: {}`).
fn asks_for_something(value: &Yaml) -> bool {
    match value {
        Yaml::Null | Yaml::Boolean(false) => false,
        Yaml::String(s) => !s.is_empty(),
        Yaml::Array(a) => !a.is_empty(),
        Yaml::Hash(h) => !h.is_empty(),
        _ => true,
    }
}

/// A value as an error message shows it.
fn shown(v: &Yaml) -> String {
    match v {
        Yaml::String(s) => format!("{s:?}"),
        Yaml::Integer(i) => i.to_string(),
        Yaml::Real(r) => r.clone(),
        Yaml::Boolean(b) => b.to_string(),
        Yaml::Array(_) => "a list".to_owned(),
        Yaml::Hash(_) => "a mapping".to_owned(),
        Yaml::Null => "null".to_owned(),
        Yaml::Alias(_) | Yaml::BadValue => "an unreadable value".to_owned(),
    }
}

/// One setting's value, with its key for errors.
struct Value<'a> {
    key: &'a str,
    value: &'a Yaml,
}

impl<'a> Value<'a> {
    fn invalid(&self, why: &str) -> ConfigError {
        ConfigError::Invalid {
            key: self.key.to_owned(),
            why: why.to_owned(),
        }
    }

    fn int<T: TryFrom<u64>>(&self, min: u64, max: u64) -> Result<Option<T>, ConfigError> {
        let bad = || {
            self.invalid(&format!(
                "expected a whole number from {min} to {max}, found {}",
                shown(self.value)
            ))
        };
        match self.value {
            Yaml::Null => Ok(None),
            Yaml::Integer(i) => {
                let n = u64::try_from(*i).map_err(|_| bad())?;
                if n < min || n > max {
                    return Err(bad());
                }
                T::try_from(n).map(Some).map_err(|_| bad())
            }
            _ => Err(bad()),
        }
    }

    fn boolean(&self) -> Result<Option<bool>, ConfigError> {
        match self.value {
            Yaml::Null => Ok(None),
            Yaml::Boolean(b) => Ok(Some(*b)),
            Yaml::String(s) => match s.to_ascii_lowercase().as_str() {
                "true" | "yes" | "y" | "on" => Ok(Some(true)),
                "false" | "no" | "n" | "off" => Ok(Some(false)),
                _ => Err(self.not_bool()),
            },
            _ => Err(self.not_bool()),
        }
    }

    fn not_bool(&self) -> ConfigError {
        self.invalid(&format!(
            "expected true or false, found {}",
            shown(self.value)
        ))
    }

    fn string(&self) -> Result<Option<&'a str>, ConfigError> {
        match self.value {
            Yaml::Null => Ok(None),
            Yaml::String(s) => Ok(Some(s)),
            v => Err(self.invalid(&format!("expected a string, found {}", shown(v)))),
        }
    }

    fn seconds(&self) -> Result<Option<f64>, ConfigError> {
        let secs = match self.value {
            Yaml::Null => return Ok(None),
            Yaml::Integer(i) => Some(*i as f64),
            Yaml::Real(r) => r.parse::<f64>().ok(),
            _ => None,
        };
        match secs {
            Some(s) if s.is_finite() && s >= 0.0 => Ok(Some(s)),
            _ => Err(self.invalid(&format!(
                "expected a number of seconds, found {}",
                shown(self.value)
            ))),
        }
    }

    fn gpu_ids(&self) -> Result<Option<GpuIds>, ConfigError> {
        let ids = match self.value {
            Yaml::Null => return Ok(None),
            Yaml::String(s) => GpuIds::parse(self.key, s),
            Yaml::Integer(i) => GpuIds::parse(self.key, &i.to_string()),
            Yaml::Array(items) => {
                let items: Option<Vec<String>> = items
                    .iter()
                    .map(|i| match i {
                        Yaml::Integer(i) => Some(i.to_string()),
                        Yaml::String(s) => Some(s.clone()),
                        _ => None,
                    })
                    .collect();
                match items {
                    Some(items) => {
                        let shown = items.join(",");
                        let refs: Vec<&str> = items.iter().map(String::as_str).collect();
                        GpuIds::from_items(self.key, &shown, &refs)
                    }
                    None => Err("a list of GPU indices".to_owned()),
                }
            }
            v => Err(shown(v)),
        };
        // GpuIds's messages start with the key already; strip it, the error adds it back.
        ids.map(Some).map_err(|why| {
            let why = why
                .strip_prefix(self.key)
                .map_or(why.as_str(), str::trim_start)
                .to_owned();
            self.invalid(&format!(
                "expected `all` or GPU indices as in \"0,1\": {why}"
            ))
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Parses `yaml` and renders what was read (settings that are `Some`, then warnings), or
    /// the error.
    fn check(yaml: &str, expected: &str) {
        let got = match parse(yaml) {
            Ok(c) => {
                let mut parts = Vec::new();
                let mut add = |name: &str, v: Option<String>| {
                    if let Some(v) = v {
                        parts.push(format!("{name}={v}"));
                    }
                };
                add("procs", c.num_processes.map(|v| v.to_string()));
                add("machines", c.num_machines.map(|v| v.to_string()));
                add("rank", c.machine_rank.map(|v| v.to_string()));
                add("ip", c.main_process_ip.clone());
                add("port", c.main_process_port.map(|v| v.to_string()));
                add(
                    "gpus",
                    c.gpu_ids.as_ref().map(|g| match g {
                        GpuIds::All => "all".to_owned(),
                        GpuIds::List(l) => l.join(","),
                    }),
                );
                add("mp", c.mixed_precision.clone());
                add("cpu", c.use_cpu.map(|v| v.to_string()));
                add("debug", c.debug.map(|v| v.to_string()));
                add("affinity", c.enable_cpu_affinity.map(|v| v.to_string()));
                add("restarts", c.max_restarts.map(|v| v.to_string()));
                add("agent_store", c.muster_agent_store.map(|v| v.to_string()));
                add("flight", c.muster_flight_recorder.map(|v| v.to_string()));
                add("recovery", c.muster_recovery.map(|v| v.to_string()));
                add("hang", c.muster_hang_timeout.map(|v| format!("{v:?}")));
                add("on_hang", c.muster_on_hang.map(|v| v.to_string()));
                add("spares", c.muster_max_spares.map(|v| v.to_string()));
                add("sample", c.muster_sample_stacks.map(|v| v.to_string()));
                add("monitor", c.monitor_interval.map(|v| v.to_string()));
                for w in &c.warnings {
                    parts.push(format!("warning: {w}"));
                }
                parts.join(" | ")
            }
            Err(e) => format!("error: {e}"),
        };
        assert_eq!(got, expected, "\n{yaml}");
    }

    #[test]
    fn what_accelerate_config_writes() {
        // A single machine with two GPUs, as in `accelerate config`'s own output.
        check(
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
            "procs=2 | machines=1 | rank=0 | gpus=all | mp=fp16 | cpu=false",
        );
        // Two machines.
        check(
            "distributed_type: MULTI_GPU
machine_rank: 1
main_process_ip: 10.0.0.1
main_process_port: 29501
num_machines: 2
num_processes: 16
gpu_ids: 0,1,2,3,4,5,6,7
mixed_precision: bf16
max_restarts: 3
monitor_interval: 0.5
",
            "procs=16 | machines=2 | rank=1 | ip=10.0.0.1 | port=29501 | gpus=0,1,2,3,4,5,6,7 | mp=bf16 | restarts=3 | monitor=0.5",
        );
        // `accelerate config default` writes JSON.
        check(
            r#"{
  "compute_environment": "LOCAL_MACHINE",
  "debug": false,
  "distributed_type": "MULTI_GPU",
  "downcast_bf16": false,
  "enable_cpu_affinity": false,
  "machine_rank": 0,
  "main_training_function": "main",
  "mixed_precision": "no",
  "num_machines": 1,
  "num_processes": 8,
  "rdzv_backend": "static",
  "same_network": false,
  "tpu_use_cluster": false,
  "tpu_use_sudo": false,
  "use_cpu": false
}"#,
            "procs=8 | machines=1 | rank=0 | mp=no | cpu=false | debug=false | affinity=false",
        );
        // A CPU job; nulls are as good as absent; PyYAML's booleans.
        check(
            "distributed_type: MULTI_CPU
use_cpu: yes
debug: On
num_processes: 4
main_process_ip: null
main_process_port: ~
mixed_precision: NO
fsdp_config: {}
deepspeed_config: {}
dynamo_config:
  dynamo_backend: 'NO'
",
            "procs=4 | mp=no | cpu=true | debug=true",
        );
        check("gpu_ids: 3", "gpus=3");
        check("gpu_ids: [0, 2]", "gpus=0,2");
        check("gpu_ids: \"1, 0\"", "gpus=1,0");
        check("main_process_port: 0", "port=0");
        check("mixed_precision: false", "mp=no");
        check("monitor_interval: 1", "monitor=1");
    }

    /// muster's own key: `false` opts out of the agent store; it is a boolean like the others.
    #[test]
    fn the_agent_store_key() {
        check("muster_agent_store: false", "agent_store=false");
        check("muster_agent_store: true", "agent_store=true");
        check("muster_agent_store: off", "agent_store=false");
        check("muster_agent_store: ~", "");
        check("muster_flight_recorder: false", "flight=false");
        check("muster_flight_recorder: true", "flight=true");
        let got = parse("muster_agent_store: sometimes").map(|c| c.muster_agent_store);
        assert!(
            got.as_ref()
                .is_err_and(|e| e.to_string().contains("muster_agent_store")),
            "{got:?}"
        );
    }

    /// muster's own keys for `--hang-timeout` and `--on-hang`, with the flags' spellings.
    #[test]
    fn the_hang_keys() {
        check("muster_max_spares: 2", "spares=2");
        check("muster_hang_timeout: 90s", "hang=Some(90s)");
        check("muster_hang_timeout: 5m", "hang=Some(300s)");
        check("muster_hang_timeout: \"off\"", "hang=None");
        check("muster_hang_timeout: 0", "hang=None");
        check("muster_on_hang: fail", "on_hang=fail");
        check("muster_sample_stacks: 10", "sample=10");
        check("muster_sample_stacks: 0.5", "sample=0.5");
        check(
            "muster_on_hang: stop",
            "error: muster_on_hang: 'stop' is not a hang action: expected report, fail or restart",
        );
        check(
            "muster_hang_timeout: soon",
            "error: muster_hang_timeout: 'soon' is not a duration: expected e.g. 90s, 5m, 1h, 500ms or off",
        );
    }

    /// muster's own key for `--recovery`, with the flag's spellings.
    #[test]
    fn the_recovery_key() {
        check("muster_recovery: in-place", "recovery=in-place");
        check("muster_recovery: restart", "recovery=restart");
        check("muster_recovery: ~", "");
        check(
            "muster_recovery: inplace",
            "error: muster_recovery: 'inplace' is not a recovery mode: expected restart or in-place",
        );
        let got = parse("muster_recovery: 2").map(|c| c.muster_recovery);
        assert!(
            got.as_ref()
                .is_err_and(|e| e.to_string().starts_with("muster_recovery: ")),
            "{got:?}"
        );
    }

    #[test]
    fn ignored_and_unknown_keys_warn() {
        check(
            "num_processes: 2
distributed_type: XLA
tpu_name: my-tpu
compute_environment: AMAZON_SAGEMAKER
my_setting: 3
mpirun_config:
  mpirun_hostfile: hosts
",
            "procs=2 \
             | warning: distributed_type XLA is not supported and is ignored: the workers get the plain torch.distributed environment, as with MULTI_GPU or MULTI_CPU \
             | warning: tpu_name is ignored: it configures Accelerate's TPU, SageMaker, IPEX or mpirun launchers, which muster does not use \
             | warning: compute_environment AMAZON_SAGEMAKER is ignored: muster runs the processes on the machines its agents run on \
             | warning: unknown key my_setting is ignored \
             | warning: mpirun_config is ignored: it configures Accelerate's TPU, SageMaker, IPEX or mpirun launchers, which muster does not use",
        );
        check("1: x", "warning: key 1 is not a setting name; ignored");
    }

    #[test]
    fn paradigm_sections_become_launch_settings() {
        let c = match parse(
            "distributed_type: fsdp
fsdp_config:
  sharding_strategy: FULL_SHARD
  fsdp_offload_params: yes
  fsdp_min_num_params: 1000
fp8_config:
  backend: TE
  override_linear_precision: [false, false, true]
dynamo_config:
  mode: max-autotune
  dynamo_use_fullgraph: true
deepspeed_config:
  zero_stage: 2
  gradient_clipping: 1.0
megatron_lm_config: {}
parallelism_config:
  parallelism_config_tp_size: 2
",
        ) {
            Ok(c) => c,
            Err(e) => panic!("{e}"),
        };
        assert_eq!(c.distributed_type.as_deref(), Some("FSDP"));
        let got: Vec<String> = c
            .launch_settings
            .iter()
            .map(|s| {
                format!(
                    "{}.{} -> {} = {}",
                    s.section,
                    s.key,
                    s.flag,
                    s.value.py_str()
                )
            })
            .collect();
        assert_eq!(
            got,
            [
                "fsdp_config.sharding_strategy -> fsdp_sharding_strategy = FULL_SHARD",
                "fsdp_config.fsdp_offload_params -> fsdp_offload_params = True",
                "fsdp_config.fsdp_min_num_params -> fsdp_min_num_params = 1000",
                "fp8_config.backend -> fp8_backend = TE",
                "fp8_config.override_linear_precision -> fp8_override_linear_precision = [False, False, True]",
                "dynamo_config.mode -> dynamo_mode = max-autotune",
                "dynamo_config.dynamo_use_fullgraph -> dynamo_use_fullgraph = True",
                "deepspeed_config.zero_stage -> zero_stage = 2",
                "deepspeed_config.gradient_clipping -> gradient_clipping = 1.0",
                "parallelism_config.parallelism_config_tp_size -> parallelism_config_tp_size = 2",
            ]
        );
        assert_eq!(c.deepspeed_fields, ["zero_stage", "gradient_clipping"]);
        assert!(c.parallelism_config);
        assert!(c.warnings.is_empty(), "{:?}", c.warnings);
        check(
            "fsdp_config: [1]",
            "error: fsdp_config: expected a mapping of settings, found a list",
        );
    }

    #[test]
    fn bad_values_name_the_key() {
        for (yaml, expected) in [
            (
                "num_processes: two",
                "num_processes: expected a whole number from 1 to 4294967295, found \"two\"",
            ),
            (
                "num_processes: 0",
                "num_processes: expected a whole number from 1 to 4294967295, found 0",
            ),
            (
                "num_processes: 2.5",
                "num_processes: expected a whole number from 1 to 4294967295, found 2.5",
            ),
            (
                "num_machines: -1",
                "num_machines: expected a whole number from 1 to 100000, found -1",
            ),
            (
                "machine_rank: [0]",
                "machine_rank: expected a whole number from 0 to 99999, found a list",
            ),
            (
                "main_process_port: 70000",
                "main_process_port: expected a whole number from 0 to 65535, found 70000",
            ),
            (
                "main_process_ip: 10.0.0.1:29500",
                "main_process_ip: '10.0.0.1:29500' must be a host name or IP address, without a port",
            ),
            (
                "main_process_ip: 5",
                "main_process_ip: expected a string, found 5",
            ),
            (
                "mixed_precision: fp32",
                "mixed_precision: expected one of no, fp16, bf16, fp8, found \"fp32\"",
            ),
            (
                "use_cpu: maybe",
                "use_cpu: expected true or false, found \"maybe\"",
            ),
            ("debug: 1", "debug: expected true or false, found 1"),
            (
                "gpu_ids: cuda0",
                "gpu_ids: expected `all` or GPU indices as in \"0,1\": 'cuda0': 'cuda0' is not a GPU index or a GPU-/MIG- UUID",
            ),
            (
                "gpu_ids: [0, 0]",
                "gpu_ids: expected `all` or GPU indices as in \"0,1\": '0,0' lists GPU 0 twice",
            ),
            (
                "gpu_ids: {a: 1}",
                "gpu_ids: expected `all` or GPU indices as in \"0,1\": a mapping",
            ),
            (
                "max_restarts: -2",
                "max_restarts: expected a whole number from 0 to 4294967295, found -2",
            ),
            (
                "monitor_interval: fast",
                "monitor_interval: expected a number of seconds, found \"fast\"",
            ),
            (
                "monitor_interval: -1",
                "monitor_interval: expected a number of seconds, found -1",
            ),
            (
                "distributed_type: 3",
                "distributed_type: expected a string, found 3",
            ),
            (
                "same_network: sometimes",
                "same_network: expected true or false, found \"sometimes\"",
            ),
        ] {
            check(yaml, &format!("error: {expected}"));
        }
    }

    #[test]
    fn files_that_are_not_settings() {
        check(
            "",
            "error: the file is empty; expected `key: value` settings as `accelerate config` writes them",
        );
        check(
            "- a\n- b\n",
            "error: the file holds a list, not a mapping; expected `key: value` settings as `accelerate config` writes them",
        );
        check(
            "a: 1\n---\nb: 2\n",
            "error: the file holds 2 YAML documents; expected `key: value` settings as `accelerate config` writes them",
        );
        let Err(ConfigError::Yaml(why)) = parse("num_processes: [1, 2\n") else {
            panic!("invalid YAML accepted");
        };
        assert!(why.contains("line"), "{why}");
    }

    #[test]
    fn accelerates_default_path_follows_hf_home_then_xdg_then_home() {
        let env = |pairs: &'static [(&'static str, &'static str)]| {
            move |name: &str| {
                pairs
                    .iter()
                    .find(|(k, _)| *k == name)
                    .map(|(_, v)| (*v).to_owned())
            }
        };
        let path = |p: Option<std::path::PathBuf>| p.map(|p| p.to_string_lossy().into_owned());
        assert_eq!(
            path(default_path(env(&[("HF_HOME", "/hf"), ("HOME", "/h")]))),
            Some("/hf/accelerate/default_config.yaml".to_owned())
        );
        assert_eq!(
            path(default_path(env(&[("HF_HOME", "~/hf"), ("HOME", "/h")]))),
            Some("/h/hf/accelerate/default_config.yaml".to_owned())
        );
        assert_eq!(
            path(default_path(env(&[
                ("XDG_CACHE_HOME", "/x"),
                ("HOME", "/h")
            ]))),
            Some("/x/huggingface/accelerate/default_config.yaml".to_owned())
        );
        assert_eq!(
            path(default_path(env(&[("HOME", "/h")]))),
            Some("/h/.cache/huggingface/accelerate/default_config.yaml".to_owned())
        );
        assert_eq!(path(default_path(env(&[]))), None);
    }
}
