//! GPUs: cheap discovery (no CUDA library, no `nvidia-smi`) and the plan that maps a node's
//! workers to devices through `CUDA_VISIBLE_DEVICES`.
//!
//! Discovery only reads the NVIDIA driver's `/proc/driver/nvidia/gpus/*/information` files,
//! falling back to counting `/dev/nvidia[0-9]*` device nodes. A machine with neither is taken
//! to have no NVIDIA GPU: workers then run on CPU without complaint, and a `--gpu-ids` list is
//! passed on as given (with a warning), since another vendor's stack (ROCm honours
//! `CUDA_VISIBLE_DEVICES` too) or a container without those files may still know better.

use std::collections::HashSet;
use std::fmt;
use std::path::Path;

/// The environment variable through which CUDA (and ROCm) learn which devices a process sees.
pub const VISIBLE_DEVICES_ENV: &str = "CUDA_VISIBLE_DEVICES";

/// One GPU found on this machine.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GpuInfo {
    /// Its index as `CUDA_VISIBLE_DEVICES` and `nvidia-smi` number it: the position in PCI bus
    /// order (CUDA's own order on machines with identical GPUs).
    pub index: u32,
    /// The model (`NVIDIA H100 80GB HBM3`), when the driver says.
    pub name: Option<String>,
    /// `GPU-...`, when the driver says; `CUDA_VISIBLE_DEVICES` accepts it too.
    pub uuid: Option<String>,
    /// The PCI bus location (`0000:19:00.0`), when known.
    pub bus: Option<String>,
}

/// What discovery found, and whether it could look at all.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Discovery {
    /// The GPUs, in index order.
    pub gpus: Vec<GpuInfo>,
    /// Whether an NVIDIA driver was seen (its `/proc` directory or device nodes): only then is
    /// an empty `gpus` proof that a listed id cannot exist.
    pub driver_seen: bool,
}

/// The GPUs of this machine, found cheaply; empty on a machine without NVIDIA GPUs. The
/// daemon mode reports this list when it registers a machine.
pub fn discover() -> Vec<GpuInfo> {
    probe().gpus
}

/// [`discover`], keeping whether a driver was seen at all.
pub fn probe() -> Discovery {
    probe_at(Path::new("/"))
}

/// Discovery under `root` (`/` on a real machine; a fake tree in tests).
pub fn probe_at(root: &Path) -> Discovery {
    let proc_dir = root.join("proc/driver/nvidia/gpus");
    if let Ok(entries) = std::fs::read_dir(&proc_dir) {
        // Directory names are PCI bus locations: sorted, they give nvidia-smi's numbering.
        let mut buses: Vec<String> = entries
            .filter_map(Result::ok)
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .collect();
        buses.sort();
        let gpus = buses
            .into_iter()
            .zip(0..)
            .map(|(bus, index)| {
                let info = std::fs::read_to_string(proc_dir.join(&bus).join("information"))
                    .unwrap_or_default();
                let field = |name: &str| {
                    info.lines()
                        .filter_map(|l| l.split_once(':'))
                        .find(|(k, _)| k.trim() == name)
                        .map(|(_, v)| v.trim().to_owned())
                        .filter(|v| !v.is_empty())
                };
                GpuInfo {
                    index,
                    name: field("Model"),
                    uuid: field("GPU UUID"),
                    bus: Some(bus),
                }
            })
            .collect();
        return Discovery {
            gpus,
            driver_seen: true,
        };
    }
    let mut minors: Vec<u32> = std::fs::read_dir(root.join("dev"))
        .into_iter()
        .flatten()
        .filter_map(Result::ok)
        .filter_map(|e| {
            let name = e.file_name();
            let digits = name.to_str()?.strip_prefix("nvidia")?;
            if digits.is_empty() || !digits.bytes().all(|b| b.is_ascii_digit()) {
                return None;
            }
            digits.parse().ok()
        })
        .collect();
    minors.sort_unstable();
    let driver_seen = !minors.is_empty() || root.join("dev/nvidiactl").exists();
    Discovery {
        gpus: (0..)
            .zip(minors)
            .map(|(index, _)| GpuInfo {
                index,
                name: None,
                uuid: None,
                bus: None,
            })
            .collect(),
        driver_seen,
    }
}

/// `--gpu-ids`: which GPUs the node's workers may use.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum GpuIds {
    /// Every GPU the agent itself can see (`CUDA_VISIBLE_DEVICES` is passed through).
    All,
    /// These, as `CUDA_VISIBLE_DEVICES` names them: indices, `GPU-...` or `MIG-...` UUIDs.
    List(Vec<String>),
}

impl GpuIds {
    /// Parses `all` or a comma-separated list (`0,1`, `GPU-8f6e...`); `what` names the flag or
    /// key in errors.
    pub fn parse(what: &str, s: &str) -> Result<Self, String> {
        let s = s.trim();
        if s.eq_ignore_ascii_case("all") {
            return Ok(Self::All);
        }
        let ids: Vec<&str> = s.split(',').map(str::trim).collect();
        Self::from_items(what, s, &ids)
    }

    /// A list given item by item (a YAML sequence).
    pub fn from_items(what: &str, shown: &str, ids: &[&str]) -> Result<Self, String> {
        if ids.iter().all(|i| i.is_empty()) {
            return Err(format!(
                "{what} '{shown}' is empty: give `all` or GPU indices, as in 0,1"
            ));
        }
        let mut seen = HashSet::new();
        for id in ids {
            let ok = if id.bytes().all(|b| b.is_ascii_digit()) {
                !id.is_empty() && id.parse::<u32>().is_ok()
            } else {
                (id.starts_with("GPU-") || id.starts_with("MIG-"))
                    && id
                        .bytes()
                        .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'/')
            };
            if !ok {
                return Err(format!(
                    "{what} '{shown}': '{id}' is not a GPU index or a GPU-/MIG- UUID"
                ));
            }
            if !seen.insert(*id) {
                return Err(format!("{what} '{shown}' lists GPU {id} twice"));
            }
        }
        Ok(Self::List(ids.iter().map(|s| (*s).to_owned()).collect()))
    }
}

/// `--gpu-mapping`: how a worker finds its GPU.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum)]
pub enum GpuMapping {
    /// Every worker sees all the node's GPUs and uses the one at index `LOCAL_RANK`, as under
    /// torchrun and `accelerate launch` (what unmodified scripts expect).
    #[default]
    LocalRank,
    /// Each worker sees only its own GPU (`CUDA_VISIBLE_DEVICES` = one id), as device 0; more
    /// workers than GPUs is an error. For programs that use "the" GPU: scripts that pick
    /// `cuda:LOCAL_RANK` fail under it.
    OnePerProcess,
}

impl fmt::Display for GpuMapping {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::LocalRank => "local-rank",
            Self::OnePerProcess => "one-per-process",
        })
    }
}

/// How the node's workers get their GPUs: validated once, then read for every worker by
/// [`crate::env::worker_env`].
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct GpuPlan {
    /// The mapping.
    pub mapping: GpuMapping,
    /// The node's GPUs as `CUDA_VISIBLE_DEVICES` names them, in device order: the
    /// `--gpu-ids` list, else the inherited `CUDA_VISIBLE_DEVICES`, else the GPUs discovered.
    /// Empty: no GPU known, workers run on CPU.
    pub devices: Vec<String>,
    /// Whether muster sets `CUDA_VISIBLE_DEVICES` (a `--gpu-ids` list, or one GPU per
    /// process); otherwise the agent's own value, if any, passes through untouched.
    pub set_visible_devices: bool,
}

/// A problem with the GPU flags: a usage error.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum GpuError {
    /// An index beyond the GPUs the driver lists.
    #[error("GPU {id} does not exist: {found}")]
    NoSuchGpu {
        /// The id given.
        id: String,
        /// What the machine has ("this machine has 2 GPUs (0..2)").
        found: String,
    },
    /// More workers than GPUs with one GPU per process.
    #[error(
        "--gpu-mapping one-per-process gives each worker a GPU of its own, but there are {workers} workers for {} ({list}); run fewer workers, list more GPUs, or use --gpu-mapping local-rank",
        count(*gpus)
    )]
    TooFewGpus {
        /// `--nproc-per-node`.
        workers: u32,
        /// How many GPUs there are.
        gpus: usize,
        /// Them.
        list: String,
    },
}

impl GpuPlan {
    /// No GPU: workers run on CPU and `CUDA_VISIBLE_DEVICES` passes through.
    pub fn cpu() -> Self {
        Self::default()
    }

    /// Resolves the flags against what this machine has. `inherited` is the agent's own
    /// `CUDA_VISIBLE_DEVICES`. Returns the plan and warnings to print.
    pub fn resolve(
        ids: &GpuIds,
        mapping: GpuMapping,
        workers: u32,
        found: &Discovery,
        inherited: Option<&str>,
    ) -> Result<(Self, Vec<String>), GpuError> {
        let mut warnings = Vec::new();
        let explicit = match ids {
            GpuIds::List(list) => {
                check_exist(list, found, &mut warnings)?;
                true
            }
            GpuIds::All => false,
        };
        let devices = candidates(ids, found, inherited);
        let set_visible_devices = match mapping {
            GpuMapping::LocalRank => {
                let n = devices.len();
                if explicit && (workers as usize) > n {
                    let last = workers - 1;
                    let missing = if n + 1 == workers as usize {
                        format!("local rank {last} has")
                    } else {
                        format!("local ranks {n} to {last} have")
                    };
                    warnings.push(format!(
                        "--gpu-ids lists {} for {workers} workers: {missing} no GPU at index LOCAL_RANK",
                        count(n)
                    ));
                }
                explicit
            }
            GpuMapping::OnePerProcess if devices.is_empty() => {
                warnings.push(
                    "--gpu-mapping one-per-process: no GPU found on this machine; the workers run without one".to_owned(),
                );
                false
            }
            GpuMapping::OnePerProcess => {
                if (workers as usize) > devices.len() {
                    return Err(GpuError::TooFewGpus {
                        workers,
                        gpus: devices.len(),
                        list: devices.join(","),
                    });
                }
                true
            }
        };
        Ok((
            Self {
                mapping,
                devices,
                set_visible_devices,
            },
            warnings,
        ))
    }

    /// `CUDA_VISIBLE_DEVICES` for the worker with local rank `local_rank`; `None` leaves the
    /// inherited value alone.
    pub fn visible_devices(&self, local_rank: u32) -> Option<String> {
        if !self.set_visible_devices {
            return None;
        }
        match self.mapping {
            GpuMapping::LocalRank => Some(self.devices.join(",")),
            GpuMapping::OnePerProcess => self.device_of(local_rank).map(str::to_owned),
        }
    }

    /// The GPU the worker with local rank `local_rank` is meant to use, and its CUDA device
    /// index inside that worker's `CUDA_VISIBLE_DEVICES`; `None` for a worker without one.
    pub fn assigned(&self, local_rank: u32) -> Option<(&str, u32)> {
        let gpu = self.device_of(local_rank)?;
        let index = match self.mapping {
            GpuMapping::LocalRank => local_rank,
            GpuMapping::OnePerProcess if self.set_visible_devices => 0,
            GpuMapping::OnePerProcess => return None,
        };
        Some((gpu, index))
    }

    fn device_of(&self, local_rank: u32) -> Option<&str> {
        self.devices
            .get(usize::try_from(local_rank).ok()?)
            .map(String::as_str)
    }
}

/// The node's GPUs as `CUDA_VISIBLE_DEVICES` names them, in device order: the `--gpu-ids`
/// list, else the agent's own `CUDA_VISIBLE_DEVICES` (`inherited`), else the GPUs found.
/// (`--nproc-per-node gpu` counts these.)
pub fn candidates(ids: &GpuIds, found: &Discovery, inherited: Option<&str>) -> Vec<String> {
    match (ids, inherited) {
        (GpuIds::List(list), _) => list.clone(),
        (GpuIds::All, Some(v)) => v
            .split(',')
            .map(str::trim)
            .filter(|s| !s.is_empty())
            .map(str::to_owned)
            .collect(),
        (GpuIds::All, None) => found.gpus.iter().map(|g| g.index.to_string()).collect(),
    }
}

/// "1 GPU", "2 GPUs".
fn count(n: usize) -> String {
    if n == 1 {
        "1 GPU".to_owned()
    } else {
        format!("{n} GPUs")
    }
}

/// Checks listed ids against the driver's list, when there is one.
fn check_exist(
    list: &[String],
    found: &Discovery,
    warnings: &mut Vec<String>,
) -> Result<(), GpuError> {
    if !found.driver_seen {
        warnings.push(format!(
            "--gpu-ids {}: no NVIDIA GPU found on this machine (no /proc/driver/nvidia/gpus, no /dev/nvidia*); passing the list on as given",
            list.join(",")
        ));
        return Ok(());
    }
    let n = found.gpus.len();
    let have = match n {
        0 => "the NVIDIA driver lists no GPU on this machine".to_owned(),
        1 => "this machine has 1 GPU (index 0)".to_owned(),
        n => format!("this machine has {n} GPUs (indices 0 to {})", n - 1),
    };
    for id in list {
        let exists = match id.parse::<usize>() {
            Ok(i) => i < n,
            // A UUID: checkable only when the driver gave them.
            Err(_) if id.starts_with("GPU-") && found.gpus.iter().all(|g| g.uuid.is_some()) => {
                found.gpus.iter().any(|g| g.uuid.as_deref() == Some(id))
            }
            Err(_) => n > 0,
        };
        if !exists {
            return Err(GpuError::NoSuchGpu {
                id: id.clone(),
                found: have,
            });
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn discovered(n: u32) -> Discovery {
        Discovery {
            gpus: (0..n)
                .map(|index| GpuInfo {
                    index,
                    name: None,
                    uuid: Some(format!("GPU-{index}")),
                    bus: None,
                })
                .collect(),
            driver_seen: true,
        }
    }

    /// Resolves and renders the plan as `CUDA_VISIBLE_DEVICES` and assignment per local rank
    /// (`-` for unset), then the warnings; or the error.
    fn check(
        ids: &str,
        mapping: GpuMapping,
        workers: u32,
        found: &Discovery,
        inherited: Option<&str>,
        expected: &str,
    ) {
        let got = GpuIds::parse("--gpu-ids", ids)
            .and_then(|ids| {
                GpuPlan::resolve(&ids, mapping, workers, found, inherited)
                    .map_err(|e| e.to_string())
            })
            .map(|(plan, warnings)| {
                let mut out: Vec<String> = (0..workers)
                    .map(|i| {
                        format!(
                            "{}:{}",
                            plan.visible_devices(i).unwrap_or_else(|| "-".into()),
                            plan.assigned(i)
                                .map_or_else(|| "-".into(), |(g, idx)| format!("{g}@{idx}"))
                        )
                    })
                    .collect();
                out.extend(warnings.into_iter().map(|w| format!("warning: {w}")));
                out.join(" | ")
            });
        let got = match got {
            Ok(s) => s,
            Err(e) => format!("error: {e}"),
        };
        assert_eq!(
            got, expected,
            "--gpu-ids {ids} --gpu-mapping {mapping} x{workers} {found:?} inherited {inherited:?}"
        );
    }

    #[test]
    fn local_rank_mapping() {
        use GpuMapping::LocalRank as L;
        // Default: nothing set; the worker's GPU is the discovered one at its local rank.
        check("all", L, 2, &discovered(2), None, "-:0@0 | -:1@1");
        check("all", L, 3, &discovered(2), None, "-:0@0 | -:1@1 | -:-");
        // The inherited list decides what the worker's index points at.
        check("all", L, 2, &discovered(8), Some("4,6"), "-:4@0 | -:6@1");
        // No GPU: CPU, no error.
        check("all", L, 2, &Discovery::default(), None, "-:- | -:-");
        // A list: every worker sees all of it.
        check("1,0", L, 2, &discovered(2), None, "1,0:1@0 | 1,0:0@1");
        check(
            "3",
            L,
            2,
            &discovered(4),
            Some("0"),
            "3:3@0 | 3:- | warning: --gpu-ids lists 1 GPU for 2 workers: local rank 1 has no GPU at index LOCAL_RANK",
        );
        check("GPU-1", L, 1, &discovered(2), None, "GPU-1:GPU-1@0");
    }

    #[test]
    fn one_per_process_mapping() {
        use GpuMapping::OnePerProcess as P;
        check("all", P, 2, &discovered(2), None, "0:0@0 | 1:1@0");
        check("all", P, 1, &discovered(2), Some("3,2"), "3:3@0");
        check("2,3", P, 2, &discovered(4), None, "2:2@0 | 3:3@0");
        check(
            "all",
            P,
            3,
            &discovered(2),
            None,
            "error: --gpu-mapping one-per-process gives each worker a GPU of its own, but there are 3 workers for 2 GPUs (0,1); run fewer workers, list more GPUs, or use --gpu-mapping local-rank",
        );
        check(
            "all",
            P,
            2,
            &Discovery::default(),
            None,
            "-:- | -:- | warning: --gpu-mapping one-per-process: no GPU found on this machine; the workers run without one",
        );
    }

    #[test]
    fn listed_ids_are_checked_when_the_driver_can_tell() {
        use GpuMapping::LocalRank as L;
        check(
            "0,2",
            L,
            1,
            &discovered(2),
            None,
            "error: GPU 2 does not exist: this machine has 2 GPUs (indices 0 to 1)",
        );
        check(
            "0",
            L,
            1,
            &Discovery {
                gpus: vec![],
                driver_seen: true,
            },
            None,
            "error: GPU 0 does not exist: the NVIDIA driver lists no GPU on this machine",
        );
        check(
            "GPU-9",
            L,
            1,
            &discovered(1),
            None,
            "error: GPU GPU-9 does not exist: this machine has 1 GPU (index 0)",
        );
        // No driver: trusted, with a warning.
        check(
            "0,1",
            L,
            2,
            &Discovery::default(),
            None,
            "0,1:0@0 | 0,1:1@1 | warning: --gpu-ids 0,1: no NVIDIA GPU found on this machine (no /proc/driver/nvidia/gpus, no /dev/nvidia*); passing the list on as given",
        );
    }

    #[test]
    fn id_lists() {
        for (input, expected) in [
            ("all", Ok(GpuIds::All)),
            (" ALL ", Ok(GpuIds::All)),
            ("0", Ok(GpuIds::List(vec!["0".into()]))),
            ("0, 1", Ok(GpuIds::List(vec!["0".into(), "1".into()]))),
            (
                "MIG-GPU-abc/1/0",
                Ok(GpuIds::List(vec!["MIG-GPU-abc/1/0".into()])),
            ),
            (
                "",
                Err("--gpu-ids '' is empty: give `all` or GPU indices, as in 0,1"),
            ),
            (
                "0,,1",
                Err("--gpu-ids '0,,1': '' is not a GPU index or a GPU-/MIG- UUID"),
            ),
            (
                "-1",
                Err("--gpu-ids '-1': '-1' is not a GPU index or a GPU-/MIG- UUID"),
            ),
            (
                "cuda:0",
                Err("--gpu-ids 'cuda:0': 'cuda:0' is not a GPU index or a GPU-/MIG- UUID"),
            ),
            ("1,1", Err("--gpu-ids '1,1' lists GPU 1 twice")),
        ] {
            assert_eq!(
                GpuIds::parse("--gpu-ids", input),
                expected.map_err(str::to_owned),
                "{input:?}"
            );
        }
    }

    #[test]
    fn discovery_reads_the_driver_files_or_device_nodes() {
        let root = std::env::temp_dir().join(format!("muster-gpu-test-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&root);
        // Nothing: no driver.
        std::fs::create_dir_all(root.join("dev")).expect("temp dir");
        assert_eq!(probe_at(&root), Discovery::default());
        // Device nodes only.
        for name in [
            "nvidia1",
            "nvidia0",
            "nvidiactl",
            "nvidia-uvm",
            "nvidia-caps",
        ] {
            std::fs::write(root.join("dev").join(name), "").expect("fake node");
        }
        let found = probe_at(&root);
        assert!(found.driver_seen);
        assert_eq!(
            found.gpus.iter().map(|g| g.index).collect::<Vec<_>>(),
            vec![0, 1]
        );
        // The driver's /proc files win, in PCI order.
        for (bus, model, uuid) in [
            ("0000:b3:00.0", "NVIDIA A40", "GPU-b"),
            ("0000:19:00.0", "NVIDIA H200", "GPU-a"),
        ] {
            let dir = root.join("proc/driver/nvidia/gpus").join(bus);
            std::fs::create_dir_all(&dir).expect("fake proc dir");
            std::fs::write(
                dir.join("information"),
                format!(
                    "Model: \t\t {model}\nIRQ:   \t\t 42\nGPU UUID: \t {uuid}\nBus Location: \t {bus}\n"
                ),
            )
            .expect("fake information");
        }
        let found = probe_at(&root);
        assert_eq!(
            found.gpus,
            vec![
                GpuInfo {
                    index: 0,
                    name: Some("NVIDIA H200".into()),
                    uuid: Some("GPU-a".into()),
                    bus: Some("0000:19:00.0".into()),
                },
                GpuInfo {
                    index: 1,
                    name: Some("NVIDIA A40".into()),
                    uuid: Some("GPU-b".into()),
                    bus: Some("0000:b3:00.0".into()),
                },
            ]
        );
        let _ = std::fs::remove_dir_all(&root);
    }
}
