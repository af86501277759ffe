//! Reads a worker's place in the job from the `MUSTER_*` environment that `muster-agent` sets
//! (see `docs/contract.md`), validated once so that nothing later has to second-guess it.

use std::path::PathBuf;

use crate::{Error, failover};

/// The job id used in single-process mode, where there is no coordinator to name a job.
pub const SINGLE_PROCESS_JOB_ID: &str = "local";

/// Where this process sits in the job: its ranks, its world and how to reach the coordinator.
/// Parsed from the environment by [`RankInfo::from_env`], or built by hand for tests and
/// benchmarks.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RankInfo {
    /// The coordinator's `host:port`, or a comma-separated list of its replicas' addresses;
    /// `None` means single-process mode (no launcher, no network: every call succeeds
    /// locally, as Accelerate does without `accelerate launch`).
    pub coordinator: Option<String>,
    /// The job id.
    pub job_id: String,
    /// The restart round this process belongs to, from 1.
    pub generation: u64,
    /// Global rank, `0..world_size`.
    pub rank: u32,
    /// Rank within the node, `0..local_world_size`.
    pub local_rank: u32,
    /// Number of processes in the job.
    pub world_size: u32,
    /// Number of processes on this node.
    pub local_world_size: u32,
    /// This node's rank, `0..num_nodes`.
    pub node_rank: u32,
    /// Number of nodes.
    pub num_nodes: u32,
    /// Restarts so far (0 in the first generation).
    pub restart_count: u32,
    /// The host this node advertises (shown in other ranks' error messages).
    pub host: String,
    /// The agent's relay socket (`MUSTER_AGENT_SOCKET`): when set, barriers go to the agent
    /// over it instead of through the coordinator session. `None` without an agent relay
    /// (`muster-agent launch --no-relay`, or a rank started by hand).
    pub agent_socket: Option<PathBuf>,
}

impl RankInfo {
    /// Rank 0 of 1 on node 0 of 1 with no coordinator: what a script run without a launcher is.
    pub fn single_process() -> Self {
        Self {
            coordinator: None,
            job_id: SINGLE_PROCESS_JOB_ID.to_owned(),
            generation: 1,
            rank: 0,
            local_rank: 0,
            world_size: 1,
            local_world_size: 1,
            node_rank: 0,
            num_nodes: 1,
            restart_count: 0,
            host: local_hostname(),
            agent_socket: None,
        }
    }

    /// Reads the process environment. No `MUSTER_COORDINATOR` means single-process mode (the
    /// other `MUSTER_*` variables are then ignored); with it, every variable of the contract
    /// must be present and well-formed (`MUSTER_RESTART_COUNT` defaults to 0 and `MUSTER_HOST`
    /// to this machine's hostname; `MUSTER_AGENT_SOCKET` is optional, and so is
    /// `MUSTER_FAILOVER_TIMEOUT_MS`, the coordinator failover budget, 30000 by default).
    pub fn from_env() -> Result<Self, Error> {
        Self::from_lookup(|name| std::env::var_os(name).map(|v| v.to_string_lossy().into_owned()))
    }

    /// Like [`RankInfo::from_env`], reading variables through `lookup`, so that parsing can be
    /// tested without touching the process environment.
    pub fn from_lookup(lookup: impl Fn(&str) -> Option<String>) -> Result<Self, Error> {
        let Some(coordinator) = lookup("MUSTER_COORDINATOR") else {
            return Ok(Self::single_process());
        };
        check_coordinator_addr(&coordinator)?;
        // Read again when connecting; checked here so that a bad value fails at start.
        failover::timeout_from(lookup(failover::TIMEOUT_ENV).as_deref())?;
        let vars = Vars { lookup: &lookup };
        let info = Self {
            coordinator: Some(coordinator),
            job_id: vars.string("MUSTER_JOB_ID")?,
            generation: vars.number("MUSTER_GENERATION")?,
            rank: vars.number("MUSTER_RANK")?,
            local_rank: vars.number("MUSTER_LOCAL_RANK")?,
            world_size: vars.number("MUSTER_WORLD_SIZE")?,
            local_world_size: vars.number("MUSTER_LOCAL_WORLD_SIZE")?,
            node_rank: vars.number("MUSTER_NODE_RANK")?,
            num_nodes: vars.number("MUSTER_NUM_NODES")?,
            restart_count: vars.optional_number("MUSTER_RESTART_COUNT")?.unwrap_or(0),
            host: match lookup("MUSTER_HOST") {
                Some(host) if host.trim().is_empty() => {
                    return Err(Error::Config("MUSTER_HOST is set but empty".to_owned()));
                }
                Some(host) => host,
                None => local_hostname(),
            },
            agent_socket: match lookup("MUSTER_AGENT_SOCKET") {
                Some(path) if path.trim().is_empty() => {
                    return Err(Error::Config(
                        "MUSTER_AGENT_SOCKET is set but empty".to_owned(),
                    ));
                }
                Some(path) => Some(PathBuf::from(path)),
                None => None,
            },
        };
        info.validate()?;
        Ok(info)
    }

    /// Checks that the numbers agree with each other (a rank inside its world, ...).
    pub fn validate(&self) -> Result<(), Error> {
        let below = |name: &str, value: u32, bound_name: &str, bound: u32| {
            if value < bound {
                Ok(())
            } else {
                Err(Error::Config(format!(
                    "{name}={value} must be below {bound_name}={bound}"
                )))
            }
        };
        if self.generation == 0 {
            return Err(Error::Config(
                "MUSTER_GENERATION=0: generations start at 1".to_owned(),
            ));
        }
        below(
            "MUSTER_RANK",
            self.rank,
            "MUSTER_WORLD_SIZE",
            self.world_size,
        )?;
        below(
            "MUSTER_LOCAL_RANK",
            self.local_rank,
            "MUSTER_LOCAL_WORLD_SIZE",
            self.local_world_size,
        )?;
        below(
            "MUSTER_NODE_RANK",
            self.node_rank,
            "MUSTER_NUM_NODES",
            self.num_nodes,
        )?;
        if self.local_world_size > self.world_size {
            return Err(Error::Config(format!(
                "MUSTER_LOCAL_WORLD_SIZE={} is larger than MUSTER_WORLD_SIZE={}",
                self.local_world_size, self.world_size
            )));
        }
        if self.num_nodes > self.world_size {
            return Err(Error::Config(format!(
                "MUSTER_NUM_NODES={} is larger than MUSTER_WORLD_SIZE={}",
                self.num_nodes, self.world_size
            )));
        }
        Ok(())
    }

    /// Whether there is a coordinator (several processes) or not (single-process mode).
    pub fn is_distributed(&self) -> bool {
        self.coordinator.is_some()
    }
}

/// Reads required variables and names the variable and value in every error.
struct Vars<'a, F> {
    lookup: &'a F,
}

impl<F: Fn(&str) -> Option<String>> Vars<'_, F> {
    fn string(&self, name: &str) -> Result<String, Error> {
        match (self.lookup)(name) {
            None => Err(missing(name)),
            Some(value) if value.trim().is_empty() => {
                Err(Error::Config(format!("{name} is set but empty")))
            }
            Some(value) => Ok(value),
        }
    }

    fn number<T: std::str::FromStr>(&self, name: &str) -> Result<T, Error>
    where
        T::Err: std::fmt::Display,
    {
        self.optional_number(name)?.ok_or_else(|| missing(name))
    }

    fn optional_number<T: std::str::FromStr>(&self, name: &str) -> Result<Option<T>, Error>
    where
        T::Err: std::fmt::Display,
    {
        let Some(value) = (self.lookup)(name) else {
            return Ok(None);
        };
        value.trim().parse().map(Some).map_err(|e| {
            Error::Config(format!(
                "{name}={value:?} is not a valid non-negative integer: {e}"
            ))
        })
    }
}

fn missing(name: &str) -> Error {
    Error::Config(format!(
        "{name} is not set, but MUSTER_COORDINATOR is (muster-agent sets both; \
         unset MUSTER_COORDINATOR to run as a single process)"
    ))
}

/// The coordinator address must be `host:port` with no scheme, as the agent writes it, or a
/// comma-separated list of such addresses (the replicas of a highly available coordinator).
fn check_coordinator_addr(addr: &str) -> Result<(), Error> {
    if addr.trim().is_empty() {
        return Err(Error::Config(format!(
            "MUSTER_COORDINATOR={addr:?} is empty (unset it to run as a single process)"
        )));
    }
    let separator = if addr.contains(',') { ": " } else { " " };
    failover::parse_addrs(addr)
        .map(drop)
        .map_err(|why| Error::Config(format!("MUSTER_COORDINATOR={addr:?}{separator}{why}")))
}

/// This machine's hostname, for error messages only: best effort, never an error.
fn local_hostname() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .ok()
        .map(|name| name.trim().to_owned())
        .filter(|name| !name.is_empty())
        .or_else(|| std::env::var("HOSTNAME").ok())
        .unwrap_or_else(|| "localhost".to_owned())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A complete, valid environment: rank 5 of 8, local rank 1 of 4, node 1 of 2.
    const VALID: &[(&str, &str)] = &[
        ("MUSTER_COORDINATOR", "coord.example:29470"),
        ("MUSTER_JOB_ID", "job-1"),
        ("MUSTER_GENERATION", "3"),
        ("MUSTER_RANK", "5"),
        ("MUSTER_LOCAL_RANK", "1"),
        ("MUSTER_WORLD_SIZE", "8"),
        ("MUSTER_LOCAL_WORLD_SIZE", "4"),
        ("MUSTER_NODE_RANK", "1"),
        ("MUSTER_NUM_NODES", "2"),
        ("MUSTER_RESTART_COUNT", "2"),
        ("MUSTER_HOST", "node-b"),
        ("MUSTER_AGENT_SOCKET", "/tmp/muster-7-ab/relay.sock"),
    ];

    /// Parses VALID with `changes` applied (`None` removes the variable) and compares the
    /// outcome to `expected`: `Ok(check)` runs `check` on the parsed info, `Err(text)` expects
    /// a Config error containing `text`.
    type Changes<'a> = &'a [(&'a str, Option<&'a str>)];

    fn check(changes: Changes<'_>, expected: Result<fn(&RankInfo), &str>) {
        let mut vars: Vec<(String, String)> = VALID
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        for (name, value) in changes {
            vars.retain(|(k, _)| k != name);
            if let Some(value) = value {
                vars.push((name.to_string(), value.to_string()));
            }
        }
        let got = RankInfo::from_lookup(|name| {
            vars.iter().find(|(k, _)| k == name).map(|(_, v)| v.clone())
        });
        match (got, expected) {
            (Ok(info), Ok(check)) => check(&info),
            (Err(Error::Config(text)), Err(want)) => {
                assert!(
                    text.contains(want),
                    "changes {changes:?}: {text:?} lacks {want:?}"
                )
            }
            (got, expected) => panic!("changes {changes:?}: got {got:?}, expected {expected:?}"),
        }
    }

    #[test]
    fn valid_environments() {
        check(
            &[],
            Ok(|info| {
                assert_eq!(
                    *info,
                    RankInfo {
                        coordinator: Some("coord.example:29470".into()),
                        job_id: "job-1".into(),
                        generation: 3,
                        rank: 5,
                        local_rank: 1,
                        world_size: 8,
                        local_world_size: 4,
                        node_rank: 1,
                        num_nodes: 2,
                        restart_count: 2,
                        host: "node-b".into(),
                        agent_socket: Some("/tmp/muster-7-ab/relay.sock".into()),
                    }
                )
            }),
        );
        check(
            &[("MUSTER_RESTART_COUNT", None)],
            Ok(|info| assert_eq!(info.restart_count, 0)),
        );
        check(
            &[("MUSTER_HOST", None)],
            Ok(|info| assert!(!info.host.is_empty())),
        );
        check(
            &[("MUSTER_AGENT_SOCKET", None)],
            Ok(|info| assert_eq!(info.agent_socket, None)),
        );
        check(
            &[("MUSTER_RANK", Some(" 7 "))],
            Ok(|info| assert_eq!(info.rank, 7)),
        );
        check(
            &[("MUSTER_COORDINATOR", Some("10.0.0.1:1"))],
            Ok(|info| assert!(info.is_distributed())),
        );
        check(&[("MUSTER_COORDINATOR", Some("[::1]:29470"))], Ok(|_| {}));
        check(
            &[("MUSTER_COORDINATOR", Some("10.0.0.1:1,10.0.0.2:1, [::1]:2"))],
            Ok(|info| {
                assert_eq!(
                    info.coordinator.as_deref(),
                    Some("10.0.0.1:1,10.0.0.2:1, [::1]:2")
                )
            }),
        );
        check(&[("MUSTER_FAILOVER_TIMEOUT_MS", Some("5000"))], Ok(|_| {}));
    }

    #[test]
    fn no_coordinator_means_single_process() {
        let single = |info: &RankInfo| {
            assert!(!info.is_distributed());
            assert_eq!((info.rank, info.world_size), (0, 1));
            assert_eq!((info.local_rank, info.local_world_size), (0, 1));
            assert_eq!((info.node_rank, info.num_nodes), (0, 1));
            assert_eq!((info.generation, info.restart_count), (1, 0));
        };
        check(&[("MUSTER_COORDINATOR", None)], Ok(single));
        // The other variables do not matter then, even when malformed.
        check(
            &[("MUSTER_COORDINATOR", None), ("MUSTER_RANK", Some("x"))],
            Ok(single),
        );
        assert_eq!(
            RankInfo::from_lookup(|_| None).ok(),
            Some(RankInfo::single_process())
        );
    }

    #[test]
    fn malformed_environments_name_the_variable_and_value() {
        let cases: &[(Changes<'_>, &str)] = &[
            (
                &[("MUSTER_COORDINATOR", Some(""))],
                "MUSTER_COORDINATOR=\"\" is empty",
            ),
            (
                &[("MUSTER_COORDINATOR", Some("http://c:1"))],
                "MUSTER_COORDINATOR=\"http://c:1\" has a scheme",
            ),
            (
                &[("MUSTER_COORDINATOR", Some("coord"))],
                "MUSTER_COORDINATOR=\"coord\" is not host:port",
            ),
            (
                &[("MUSTER_COORDINATOR", Some("coord:http"))],
                "is not host:port",
            ),
            (
                &[("MUSTER_COORDINATOR", Some(":29470"))],
                "is not host:port",
            ),
            (
                &[("MUSTER_COORDINATOR", Some("a:1,b"))],
                "MUSTER_COORDINATOR=\"a:1,b\": entry \"b\" is not host:port",
            ),
            (
                &[("MUSTER_COORDINATOR", Some("a:1,,b:2"))],
                "MUSTER_COORDINATOR=\"a:1,,b:2\": entry \"\" is empty",
            ),
            (
                &[("MUSTER_COORDINATOR", Some("a:1,http://b:2"))],
                "entry \"http://b:2\" has a scheme",
            ),
            (
                &[("MUSTER_FAILOVER_TIMEOUT_MS", Some("soon"))],
                "MUSTER_FAILOVER_TIMEOUT_MS=\"soon\" is not a number of milliseconds",
            ),
            (
                &[("MUSTER_RANK", Some("x"))],
                "MUSTER_RANK=\"x\" is not a valid non-negative integer",
            ),
            (&[("MUSTER_RANK", Some("-1"))], "MUSTER_RANK=\"-1\""),
            (&[("MUSTER_RANK", Some(""))], "MUSTER_RANK=\"\""),
            (
                &[("MUSTER_WORLD_SIZE", Some("4294967296"))],
                "MUSTER_WORLD_SIZE=\"4294967296\"",
            ),
            (
                &[("MUSTER_GENERATION", Some("1.5"))],
                "MUSTER_GENERATION=\"1.5\"",
            ),
            (
                &[("MUSTER_RESTART_COUNT", Some("many"))],
                "MUSTER_RESTART_COUNT=\"many\"",
            ),
            (&[("MUSTER_RANK", None)], "MUSTER_RANK is not set"),
            (&[("MUSTER_JOB_ID", None)], "MUSTER_JOB_ID is not set"),
            (
                &[("MUSTER_JOB_ID", Some(" "))],
                "MUSTER_JOB_ID is set but empty",
            ),
            (&[("MUSTER_HOST", Some(""))], "MUSTER_HOST is set but empty"),
            (
                &[("MUSTER_AGENT_SOCKET", Some(" "))],
                "MUSTER_AGENT_SOCKET is set but empty",
            ),
            (&[("MUSTER_NUM_NODES", None)], "MUSTER_NUM_NODES is not set"),
            (&[("MUSTER_GENERATION", Some("0"))], "MUSTER_GENERATION=0"),
            (
                &[("MUSTER_RANK", Some("8"))],
                "MUSTER_RANK=8 must be below MUSTER_WORLD_SIZE=8",
            ),
            (
                &[("MUSTER_LOCAL_RANK", Some("4"))],
                "MUSTER_LOCAL_RANK=4 must be below MUSTER_LOCAL_WORLD_SIZE=4",
            ),
            (
                &[("MUSTER_NODE_RANK", Some("2"))],
                "MUSTER_NODE_RANK=2 must be below MUSTER_NUM_NODES=2",
            ),
            (
                &[("MUSTER_LOCAL_WORLD_SIZE", Some("9"))],
                "MUSTER_LOCAL_WORLD_SIZE=9 is larger than MUSTER_WORLD_SIZE=8",
            ),
            (
                &[
                    ("MUSTER_NUM_NODES", Some("9")),
                    ("MUSTER_NODE_RANK", Some("0")),
                ],
                "MUSTER_NUM_NODES=9 is larger",
            ),
        ];
        for (changes, want) in cases {
            check(changes, Err(want));
        }
    }
}
