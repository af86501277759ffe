//! Defaults under Slurm: `srun muster-agent launch --nproc-per-node 4 train.py` on every node
//! of a step needs no per-node flags. The node count, this node's rank, the main machine (the
//! step's first host) and a job id every node derives alike come from the `SLURM_*` variables
//! `srun` sets; explicit flags and `PET_*` variables beat them.

use std::fmt;

/// The `SLURM_*` variables the defaults are made from, as the agent's environment has them
/// (read once by [`SlurmEnv::of_process`]; tests fill it in).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SlurmEnv {
    /// `SLURM_JOB_ID` (or the older `SLURM_JOBID`).
    pub job_id: Option<String>,
    /// `SLURM_STEP_ID` (or `SLURM_STEPID`): set by `srun` only, so it tells a step from the
    /// batch script itself.
    pub step_id: Option<String>,
    /// `SLURM_STEP_NUM_NODES`, else `SLURM_NNODES` (which `srun` sets to the step's count).
    pub nnodes: Option<String>,
    /// `SLURM_NODEID`: this node's index in the step.
    pub node_id: Option<String>,
    /// `SLURM_STEP_NODELIST`, else `SLURM_JOB_NODELIST`, else `SLURM_NODELIST`: a hostlist.
    pub nodelist: Option<String>,
    /// `SLURM_STEP_NUM_TASKS`, else `SLURM_NTASKS`: more tasks than nodes means several agents
    /// per node.
    pub ntasks: Option<String>,
}

impl SlurmEnv {
    /// Reads the variables with `var` (the process's: `std::env::var`).
    pub fn from_vars(var: impl Fn(&str) -> Option<String>) -> Self {
        let first = |names: &[&str]| names.iter().find_map(|n| var(n).filter(|v| !v.is_empty()));
        Self {
            job_id: first(&["SLURM_JOB_ID", "SLURM_JOBID"]),
            step_id: first(&["SLURM_STEP_ID", "SLURM_STEPID"]),
            nnodes: first(&["SLURM_STEP_NUM_NODES", "SLURM_NNODES"]),
            node_id: first(&["SLURM_NODEID"]),
            nodelist: first(&[
                "SLURM_STEP_NODELIST",
                "SLURM_JOB_NODELIST",
                "SLURM_NODELIST",
            ]),
            ntasks: first(&["SLURM_STEP_NUM_TASKS", "SLURM_NTASKS"]),
        }
    }

    /// This process's variables.
    pub fn of_process() -> Self {
        Self::from_vars(|name| std::env::var(name).ok())
    }

    /// The defaults, when this is a Slurm step (`SLURM_JOB_ID` and `SLURM_STEP_ID` set) whose
    /// variables all parse; `None` otherwise (outside Slurm, or in a batch script outside
    /// `srun`, nothing is assumed). An error when `srun` started more than one task per node:
    /// several agents would claim one node rank.
    pub fn defaults(&self) -> Result<Option<SlurmDefaults>, String> {
        let (Some(job), Some(step), Some(nnodes), Some(node_id), Some(list)) = (
            &self.job_id,
            &self.step_id,
            &self.nnodes,
            &self.node_id,
            &self.nodelist,
        ) else {
            return Ok(None);
        };
        let (Ok(nnodes), Ok(node_rank), Ok(master_addr)) = (
            nnodes.trim().parse::<u32>(),
            node_id.trim().parse::<u32>(),
            first_host(list),
        ) else {
            return Ok(None);
        };
        if nnodes == 0 || node_rank >= nnodes {
            return Ok(None);
        }
        if let Some(tasks) = self
            .ntasks
            .as_deref()
            .and_then(|t| t.trim().parse::<u32>().ok())
            && tasks > nnodes
        {
            return Err(format!(
                "Slurm step {job}.{step} runs {tasks} tasks on {nnodes} nodes: run one \
                 muster-agent per node (srun --ntasks-per-node=1), it starts the node's workers"
            ));
        }
        let id = super::job_id_chars(&format!("slurm-{}-{}", job.trim(), step.trim()));
        Ok(Some(SlurmDefaults {
            nnodes,
            node_rank,
            master_addr,
            job_id: id,
        }))
    }
}

/// What a Slurm step says about the launch, for what the command line leaves unsaid.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SlurmDefaults {
    /// `--nnodes`: the step's node count.
    pub nnodes: u32,
    /// `--node-rank`: `SLURM_NODEID`.
    pub node_rank: u32,
    /// `--master-addr`: the first host of the step's node list.
    pub master_addr: String,
    /// `--job-id`: `slurm-<SLURM_JOB_ID>-<SLURM_STEP_ID>`, the same on every node of the step.
    pub job_id: String,
}

/// Why a hostlist does not parse.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HostlistError(pub String);

impl fmt::Display for HostlistError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// One piece of a host pattern: text, or a bracketed set of numbers.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Piece {
    Text(String),
    /// `(low, high, width)` ranges: `07-10` is `(7, 10, 2)`; numbers are zero-padded to
    /// `width` digits, as Slurm writes them.
    Numbers(Vec<(u64, u64, usize)>),
}

/// Splits a hostlist at the commas outside brackets and parses each host pattern.
fn patterns(list: &str) -> Result<Vec<Vec<Piece>>, HostlistError> {
    let bad = |why: &str| HostlistError(format!("hostlist '{list}': {why}"));
    let mut hosts = Vec::new();
    let mut pieces = Vec::new();
    let mut text = String::new();
    let mut chars = list.trim().chars();
    while let Some(c) = chars.next() {
        match c {
            ',' => {
                if !text.is_empty() {
                    pieces.push(Piece::Text(std::mem::take(&mut text)));
                }
                if pieces.is_empty() {
                    return Err(bad("empty host name"));
                }
                hosts.push(std::mem::take(&mut pieces));
            }
            '[' => {
                if !text.is_empty() {
                    pieces.push(Piece::Text(std::mem::take(&mut text)));
                }
                let mut inside = String::new();
                loop {
                    match chars.next() {
                        Some(']') => break,
                        Some('[') | None => return Err(bad("unbalanced '['")),
                        Some(c) => inside.push(c),
                    }
                }
                let mut ranges = Vec::new();
                for part in inside.split(',').map(str::trim) {
                    let (low, high) = part.split_once('-').unwrap_or((part, part));
                    let number = |s: &str| {
                        if s.is_empty() || !s.bytes().all(|b| b.is_ascii_digit()) {
                            return Err(bad(&format!(
                                "'[{inside}]' holds '{part}', not a number or range"
                            )));
                        }
                        s.parse::<u64>()
                            .map_err(|_| bad(&format!("'{s}' is too large")))
                    };
                    let (lo, hi) = (number(low)?, number(high)?);
                    if hi < lo {
                        return Err(bad(&format!("range '{part}' ends before it starts")));
                    }
                    ranges.push((lo, hi, low.len()));
                }
                pieces.push(Piece::Numbers(ranges));
            }
            ']' => return Err(bad("unbalanced ']'")),
            c if c.is_whitespace() => return Err(bad("blank inside a host name")),
            c => text.push(c),
        }
    }
    if !text.is_empty() {
        pieces.push(Piece::Text(text));
    }
    if pieces.is_empty() {
        return Err(bad("empty host name"));
    }
    hosts.push(pieces);
    Ok(hosts)
}

/// The first host of a Slurm hostlist (`node[01-03,7],gpu-a` gives `node01`), without
/// expanding the rest.
pub fn first_host(list: &str) -> Result<String, HostlistError> {
    let hosts = patterns(list)?;
    let mut host = String::new();
    for piece in hosts.first().into_iter().flatten() {
        match piece {
            Piece::Text(t) => host.push_str(t),
            Piece::Numbers(ranges) => {
                let (low, _, width) = ranges[0];
                host.push_str(&format!("{low:0width$}"));
            }
        }
    }
    Ok(host)
}

/// Every host of a Slurm hostlist, in Slurm's order: `node[01-03,7],gpu-a` is `node01`,
/// `node02`, `node03`, `node7`, `gpu-a`; `r[1-2]n[1-2]` is `r1n1`, `r1n2`, `r2n1`, `r2n2`.
/// More than `limit` hosts is an error.
pub fn expand_hostlist(list: &str, limit: usize) -> Result<Vec<String>, HostlistError> {
    let mut out = Vec::new();
    for pattern in patterns(list)? {
        let mut hosts = vec![String::new()];
        for piece in pattern {
            match piece {
                Piece::Text(t) => hosts.iter_mut().for_each(|h| h.push_str(&t)),
                Piece::Numbers(ranges) => {
                    let mut next = Vec::new();
                    for h in &hosts {
                        for &(low, high, width) in &ranges {
                            for n in low..=high {
                                if out.len() + next.len() >= limit {
                                    return Err(HostlistError(format!(
                                        "hostlist '{list}' has more than {limit} hosts"
                                    )));
                                }
                                next.push(format!("{h}{n:0width$}"));
                            }
                        }
                    }
                    hosts = next;
                }
            }
        }
        out.extend(hosts);
        if out.len() > limit {
            return Err(HostlistError(format!(
                "hostlist '{list}' has more than {limit} hosts"
            )));
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hostlists() {
        for (list, expected) in [
            ("node01", Ok("node01")),
            (
                "node[01-03,7],gpu-a",
                Ok("node01 node02 node03 node7 gpu-a"),
            ),
            ("a,b,c", Ok("a b c")),
            ("node[8-11]", Ok("node8 node9 node10 node11")),
            ("node[08-11]", Ok("node08 node09 node10 node11")),
            ("r[1-2]n[01-02]", Ok("r1n01 r1n02 r2n01 r2n02")),
            ("n[3],m[1-2].ib", Ok("n3 m1.ib m2.ib")),
            ("[1-2]x", Ok("1x 2x")),
            ("gpu-[009-010]-a", Ok("gpu-009-a gpu-010-a")),
            (" 10.0.0.1,10.0.0.2 ", Ok("10.0.0.1 10.0.0.2")),
            ("node[1-", Err("hostlist 'node[1-': unbalanced '['")),
            ("node]", Err("hostlist 'node]': unbalanced ']'")),
            (
                "node[3-1]",
                Err("hostlist 'node[3-1]': range '3-1' ends before it starts"),
            ),
            (
                "node[a-b]",
                Err("hostlist 'node[a-b]': '[a-b]' holds 'a-b', not a number or range"),
            ),
            ("a,,b", Err("hostlist 'a,,b': empty host name")),
            ("", Err("hostlist '': empty host name")),
            (
                "n[1-100]",
                Err("hostlist 'n[1-100]' has more than 10 hosts"),
            ),
        ] {
            let got = expand_hostlist(list, 10).map(|h| h.join(" "));
            assert_eq!(got.as_deref().map_err(|e| e.0.as_str()), expected, "{list}");
            if let Ok(all) = expected {
                let first = all.split(' ').next().unwrap_or_default();
                assert_eq!(first_host(list).as_deref(), Ok(first), "{list}");
            }
        }
        // The first host of a huge list, without expanding it.
        assert_eq!(first_host("n[0000001-9999999]").as_deref(), Ok("n0000001"));
    }

    fn step(nnodes: &str, node_id: &str, list: &str) -> SlurmEnv {
        SlurmEnv {
            job_id: Some("4242".into()),
            step_id: Some("0".into()),
            nnodes: Some(nnodes.into()),
            node_id: Some(node_id.into()),
            nodelist: Some(list.into()),
            ntasks: None,
        }
    }

    #[test]
    fn defaults_only_in_a_step_whose_variables_parse() {
        let ok = SlurmDefaults {
            nnodes: 3,
            node_rank: 1,
            master_addr: "node07".into(),
            job_id: "slurm-4242-0".into(),
        };
        assert_eq!(
            step("3", "1", "node[07-09]").defaults(),
            Ok(Some(ok.clone()))
        );
        // One task per node is fine.
        let tasks = SlurmEnv {
            ntasks: Some("3".into()),
            ..step("3", "1", "node[07-09]")
        };
        assert_eq!(tasks.defaults(), Ok(Some(ok)));
        for env in [
            SlurmEnv::default(),
            // A batch script: no step.
            SlurmEnv {
                step_id: None,
                ..step("3", "1", "n[1-3]")
            },
            SlurmEnv {
                job_id: None,
                ..step("3", "1", "n[1-3]")
            },
            step("three", "1", "n[1-3]"),
            step("3", "x", "n[1-3]"),
            step("3", "3", "n[1-3]"),
            step("0", "0", "n[1-3]"),
            step("3", "1", "n[1-3"),
        ] {
            assert_eq!(env.defaults(), Ok(None), "{env:?}");
        }
        let crowded = SlurmEnv {
            ntasks: Some("8".into()),
            ..step("2", "0", "n[1-2]")
        };
        assert_eq!(
            crowded.defaults(),
            Err("Slurm step 4242.0 runs 8 tasks on 2 nodes: run one muster-agent per node (srun --ntasks-per-node=1), it starts the node's workers".to_owned())
        );
    }

    #[test]
    fn variables_and_their_fallbacks() {
        let vars = |pairs: &'static [(&'static str, &'static str)]| {
            SlurmEnv::from_vars(|name| {
                pairs
                    .iter()
                    .find(|(k, _)| *k == name)
                    .map(|(_, v)| (*v).to_owned())
            })
        };
        let env = vars(&[
            ("SLURM_JOBID", "7"),
            ("SLURM_STEPID", "2"),
            ("SLURM_NNODES", "4"),
            ("SLURM_STEP_NUM_NODES", "2"),
            ("SLURM_NODEID", "1"),
            ("SLURM_JOB_NODELIST", "a[1-4]"),
            ("SLURM_STEP_NODELIST", "a[3-4]"),
        ]);
        assert_eq!(
            env.defaults(),
            Ok(Some(SlurmDefaults {
                nnodes: 2,
                node_rank: 1,
                master_addr: "a3".into(),
                job_id: "slurm-7-2".into(),
            }))
        );
        let env = vars(&[
            ("SLURM_JOB_ID", "7"),
            ("SLURM_STEP_ID", "0"),
            ("SLURM_NNODES", "1"),
            ("SLURM_NODEID", "0"),
            ("SLURM_NODELIST", "solo"),
        ]);
        assert_eq!(
            env.defaults().map(|d| d.map(|d| d.master_addr)),
            Ok(Some("solo".to_owned()))
        );
    }
}

/// The defaults as the command line sees them (`cli::validate_in`).
#[cfg(test)]
mod launch_tests {
    use super::super::Context;
    use super::super::tests::{check_on, machine};
    use super::SlurmEnv;

    fn under(nnodes: &str, node_id: &str, list: &str, ntasks: Option<&str>) -> Context<'static> {
        Context {
            slurm: SlurmEnv {
                job_id: Some("4242".into()),
                step_id: Some("0".into()),
                nnodes: Some(nnodes.into()),
                node_id: Some(node_id.into()),
                nodelist: Some(list.into()),
                ntasks: ntasks.map(str::to_owned),
            },
            ..machine(None)
        }
    }

    #[test]
    fn srun_needs_no_per_node_flags() {
        let three = under("3", "1", "node[07-09],gpu-a", Some("3"));
        check_on(
            &three,
            "--nproc-per-node 4 -- sh",
            Ok(
                r#"n=4 nodes=3:3 rank=Some(1) coord=Some("node07:29470") job=slurm-4242-0 grace=5000ms relay=true prog=sh args=[] master=Some("node07"):None | note: Slurm step: --nnodes 3 --node-rank 1 --master-addr node07 --job-id slurm-4242-0 (flags and PET_* variables override these)"#,
            ),
        );
        // Flags beat Slurm, one by one.
        check_on(
            &three,
            "--nnodes 2 --master-addr m --master-port 7 -- sh",
            Ok(
                r#"n=1 nodes=2:2 rank=Some(1) coord=Some("m:29470") job=slurm-4242-0 grace=5000ms relay=true prog=sh args=[] master=Some("m"):Some(7) | note: Slurm step: --node-rank 1 --job-id slurm-4242-0 (flags and PET_* variables override these)"#,
            ),
        );
        check_on(
            &three,
            "--nnodes 2 --node-rank 0 --coordinator c:1 --job-id j -- sh",
            Ok(
                r#"n=1 nodes=2:2 rank=Some(0) coord=Some("c:1") job=j grace=5000ms relay=true prog=sh args=[] master=Some("node07"):None | note: Slurm step: --master-addr node07 (flags and PET_* variables override these)"#,
            ),
        );
        check_on(
            &three,
            "--nnodes 1 -- sh",
            Err("SLURM_NODEID 1 is out of range for --nnodes 1 (node ranks are 0..1)"),
        );
        // One node: the agent's own coordinator, the step's job id.
        check_on(
            &under("1", "0", "solo", None),
            "-- sh",
            Ok(
                "n=1 nodes=1:1 rank=Some(0) coord=None job=slurm-4242-0 grace=5000ms relay=true prog=sh args=[] | note: Slurm step: --nnodes 1 --node-rank 0 --job-id slurm-4242-0 (flags and PET_* variables override these)",
            ),
        );
        // Several agents per node would share a rank.
        check_on(
            &under("2", "0", "n[1-2]", Some("8")),
            "-- sh",
            Err(
                "Slurm step 4242.0 runs 8 tasks on 2 nodes: run one muster-agent per node (srun --ntasks-per-node=1), it starts the node's workers",
            ),
        );
        // Outside a step (a batch script), nothing is assumed.
        let batch = Context {
            slurm: SlurmEnv {
                step_id: None,
                ..under("3", "1", "n[1-3]", None).slurm
            },
            ..machine(None)
        };
        check_on(
            &batch,
            "-- sh",
            Ok(
                "n=1 nodes=1:1 rank=None coord=None job=<fresh> grace=5000ms relay=true prog=sh args=[]",
            ),
        );
    }
}
