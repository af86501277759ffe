//! Reads a worker's place in the job from the `MUSTER_*` environment that `muster-agent` sets
//! (see `docs/contract.md`), validated once so that nothing later has to second-guess it.
//!
//! How to reach the coordinator securely comes from the environment too ([`security_from_env`]):
//!
//! - `MUSTER_TOKEN`: the credential sent as `authorization: Bearer <token>` on every call: the
//!   job token (`mj1.…`) that `muster-agent` gives its workers, or the cluster token for tools
//!   run by hand. Unset: no credentials (a coordinator without authentication).
//! - `MUSTER_TLS_CA`: PEM file of the CA that signed the coordinator's certificate; set means
//!   TLS (`https`). Unset: plaintext.
//! - `MUSTER_TLS_CERT` and `MUSTER_TLS_KEY`: this process's certificate chain and key (PEM),
//!   for a coordinator that requires mutual TLS; both or neither, and only with
//!   `MUSTER_TLS_CA`.
//! - `MUSTER_TLS_DOMAIN`: the name to verify the coordinator's certificate against when it is
//!   not the host part of `MUSTER_COORDINATOR`; only with `MUSTER_TLS_CA`.
//!
//! Errors name the variable (and a file's path), never the token.

use std::path::{Path, PathBuf};

use muster_core::contract::env as var;
use muster_proto::security::{ClientSecurity, Credentials};

use crate::{Error, failover};

/// The job id used in single-process mode, where there is no coordinator to name a job.
pub const SINGLE_PROCESS_JOB_ID: &str = "local";

/// Where this process sits in the job: its ranks, its world and how to reach the coordinator.
/// Parsed from the environment by [`RankInfo::from_env`], or built by hand for tests and
/// benchmarks.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RankInfo {
    /// The coordinator's `host:port`, a comma-separated list of its replicas' addresses, or
    /// under an agent its gateway socket (`unix:<dir>/coordinator.sock`); `None` means
    /// single-process mode (no launcher, no network: every call succeeds
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

    /// Reads the process environment. Neither `MUSTER_AGENT_SOCKET` nor `MUSTER_COORDINATOR`
    /// means single-process mode (the other `MUSTER_*` variables are then ignored). Under an
    /// agent (`MUSTER_AGENT_SOCKET`), the coordinator is reached through the agent's gateway
    /// socket beside it ([`muster_core::contract::agent_coordinator`]) and `MUSTER_COORDINATOR`
    /// is not read; a rank started by hand names the coordinator in `MUSTER_COORDINATOR`.
    /// Every other variable of the contract must then be present and well-formed
    /// (`MUSTER_RESTART_COUNT` defaults to 0, `MUSTER_HOST` to this machine's hostname, and
    /// `MUSTER_FAILOVER_TIMEOUT_MS`, the coordinator failover budget, to 30000).
    pub fn from_env() -> Result<Self, Error> {
        Self::from_lookup(|name| std::env::var_os(name).map(|v| v.to_string_lossy().into_owned()))
    }

    /// Like [`RankInfo::from_env`], reading variables through `lookup`, so that parsing can be
    /// tested without touching the process environment.
    pub fn from_lookup(lookup: impl Fn(&str) -> Option<String>) -> Result<Self, Error> {
        let agent_socket = match lookup(var::MUSTER_AGENT_SOCKET) {
            Some(path) if path.trim().is_empty() => {
                return Err(Error::Config(format!(
                    "{} is set but empty",
                    var::MUSTER_AGENT_SOCKET
                )));
            }
            Some(path) => Some(PathBuf::from(path)),
            None => None,
        };
        // Under an agent, the coordinator is the agent's gateway socket: a coordinator
        // address in the environment (inherited by the agent, say) is not used.
        let coordinator = match (&agent_socket, lookup(var::MUSTER_COORDINATOR)) {
            (Some(socket), _) => muster_core::contract::agent_coordinator(socket),
            (None, Some(coordinator)) => {
                check_coordinator_addr(&coordinator)?;
                coordinator
            }
            (None, None) => return Ok(Self::single_process()),
        };
        // Read again when connecting; checked here so that a bad value fails at start.
        failover::timeout_from(lookup(var::MUSTER_FAILOVER_TIMEOUT_MS).as_deref())?;
        let vars = Vars { lookup: &lookup };
        let info = Self {
            coordinator: Some(coordinator),
            job_id: vars.string(var::MUSTER_JOB_ID)?,
            generation: vars.number(var::MUSTER_GENERATION)?,
            rank: vars.number(var::MUSTER_RANK)?,
            local_rank: vars.number(var::MUSTER_LOCAL_RANK)?,
            world_size: vars.number(var::MUSTER_WORLD_SIZE)?,
            local_world_size: vars.number(var::MUSTER_LOCAL_WORLD_SIZE)?,
            node_rank: vars.number(var::MUSTER_NODE_RANK)?,
            num_nodes: vars.number(var::MUSTER_NUM_NODES)?,
            restart_count: vars
                .optional_number(var::MUSTER_RESTART_COUNT)?
                .unwrap_or(0),
            host: match lookup(var::MUSTER_HOST) {
                Some(host) if host.trim().is_empty() => {
                    return Err(Error::Config(format!(
                        "{} is set but empty",
                        var::MUSTER_HOST
                    )));
                }
                Some(host) => host,
                None => local_hostname(),
            },
            agent_socket,
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
            return Err(Error::Config(format!(
                "{}=0: generations start at 1",
                var::MUSTER_GENERATION
            )));
        }
        below(
            var::MUSTER_RANK,
            self.rank,
            var::MUSTER_WORLD_SIZE,
            self.world_size,
        )?;
        below(
            var::MUSTER_LOCAL_RANK,
            self.local_rank,
            var::MUSTER_LOCAL_WORLD_SIZE,
            self.local_world_size,
        )?;
        below(
            var::MUSTER_NODE_RANK,
            self.node_rank,
            var::MUSTER_NUM_NODES,
            self.num_nodes,
        )?;
        if self.local_world_size > self.world_size {
            return Err(Error::Config(format!(
                "{}={} is larger than {}={}",
                var::MUSTER_LOCAL_WORLD_SIZE,
                self.local_world_size,
                var::MUSTER_WORLD_SIZE,
                self.world_size
            )));
        }
        if self.num_nodes > self.world_size {
            return Err(Error::Config(format!(
                "{}={} is larger than {}={}",
                var::MUSTER_NUM_NODES,
                self.num_nodes,
                var::MUSTER_WORLD_SIZE,
                self.world_size
            )));
        }
        Ok(())
    }

    /// Whether there is a coordinator (several processes) or not (single-process mode).
    pub fn is_distributed(&self) -> bool {
        self.coordinator.is_some()
    }
}

/// What a worker's death does to the job (`MUSTER_RECOVERY`, set by `muster-agent` from the
/// job's recovery mode): `Restart` (the generation ends and every worker restarts from its last
/// checkpoint, torchrun's model; the default, and what an unset variable means) or `InPlace`
/// (only the dead worker is respawned; the survivors keep their processes, agree on a new
/// membership at a step boundary, [`crate::membership::Membership`], and heal it). The
/// coordinator's type.
pub use muster_core::requests::Recovery;

/// A worker's recovery settings: the job's mode and, for a worker respawned in place, the
/// membership epoch it replaces its rank in (`MUSTER_EPOCH`). Kept apart from [`RankInfo`]
/// (whose fields are public and built by hand in many places): the [`crate::Accelerator`]
/// reads both.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct RecoveryEnv {
    /// `MUSTER_RECOVERY`: `restart` (or unset) or `in-place`.
    pub mode: Recovery,
    /// `MUSTER_EPOCH`: 0 (or unset) for a worker of the generation's first membership; more
    /// for a replacement, which registers as one and takes its state from a healthy rank.
    pub epoch: u64,
}

impl RecoveryEnv {
    /// Reads `MUSTER_RECOVERY` and `MUSTER_EPOCH` from the process environment.
    pub fn from_env() -> Result<Self, Error> {
        Self::from_lookup(|name| std::env::var_os(name).map(|v| v.to_string_lossy().into_owned()))
    }

    /// Like [`RecoveryEnv::from_env`], reading variables through `lookup`. A mode other than
    /// `restart` or `in-place`, an epoch that is not a number, or a nonzero epoch outside
    /// in-place mode is [`Error::Config`] naming the variable and its value.
    pub fn from_lookup(lookup: impl Fn(&str) -> Option<String>) -> Result<Self, Error> {
        let mode = match lookup(var::MUSTER_RECOVERY) {
            None => Recovery::Restart,
            Some(v) => Recovery::parse(v.trim())
                .map_err(|why| Error::Config(format!("{}: {why}", var::MUSTER_RECOVERY)))?,
        };
        let vars = Vars { lookup: &lookup };
        let epoch: u64 = vars.optional_number(var::MUSTER_EPOCH)?.unwrap_or(0);
        if epoch > 0 && mode != Recovery::InPlace {
            return Err(Error::Config(format!(
                "{}={epoch} names a replacement, which only exists with {}=in-place (it is {})",
                var::MUSTER_EPOCH,
                var::MUSTER_RECOVERY,
                mode
            )));
        }
        Ok(Self { mode, epoch })
    }

    /// Whether this process replaces a rank that died (it was spawned with a nonzero epoch).
    pub fn is_replacement(&self) -> bool {
        self.epoch > 0
    }
}

/// How to connect to the coordinator as the process environment says: TLS settings from
/// `MUSTER_TLS_*` and the credentials in `MUSTER_TOKEN` (see the [module docs](self)); with
/// none of them set, plaintext without credentials. The files are read and checked now, so
/// that a bad value fails at start with one line naming the variable.
pub fn security_from_env() -> Result<ClientSecurity, Error> {
    security_from_lookup(|name| std::env::var_os(name).map(|v| v.to_string_lossy().into_owned()))
}

/// Like [`security_from_env`], reading variables through `lookup`.
pub fn security_from_lookup(
    lookup: impl Fn(&str) -> Option<String>,
) -> Result<ClientSecurity, Error> {
    let set = |name: &str| -> Result<Option<String>, Error> {
        match lookup(name) {
            Some(value) if value.trim().is_empty() => {
                Err(Error::Config(format!("{name} is set but empty")))
            }
            Some(value) => Ok(Some(value.trim().to_owned())),
            None => Ok(None),
        }
    };
    let (ca, cert, key, domain) = (
        set(var::MUSTER_TLS_CA)?,
        set(var::MUSTER_TLS_CERT)?,
        set(var::MUSTER_TLS_KEY)?,
        set(var::MUSTER_TLS_DOMAIN)?,
    );
    let mut security = ClientSecurity::plaintext();
    match ca {
        Some(ca) => {
            let identity = match (cert, key) {
                (Some(cert), Some(key)) => Some((PathBuf::from(cert), PathBuf::from(key))),
                (Some(_), None) => return Err(needs(var::MUSTER_TLS_CERT, var::MUSTER_TLS_KEY)),
                (None, Some(_)) => return Err(needs(var::MUSTER_TLS_KEY, var::MUSTER_TLS_CERT)),
                (None, None) => None,
            };
            let ca = PathBuf::from(ca);
            check_pem(
                var::MUSTER_TLS_CA,
                &ca,
                "-----BEGIN CERTIFICATE-----",
                "certificate",
            )?;
            if let Some((cert, key)) = &identity {
                check_pem(
                    var::MUSTER_TLS_CERT,
                    cert,
                    "-----BEGIN CERTIFICATE-----",
                    "certificate",
                )?;
                check_pem(var::MUSTER_TLS_KEY, key, "PRIVATE KEY-----", "private key")?;
            }
            if let Some(domain) = &domain
                && (domain.contains(char::is_whitespace) || domain.contains(['/', ':']))
            {
                return Err(Error::Config(format!(
                    "{}={domain:?} is not a host name",
                    var::MUSTER_TLS_DOMAIN
                )));
            }
            let named = if identity.is_some() {
                format!(
                    "{}, {} and {}",
                    var::MUSTER_TLS_CA,
                    var::MUSTER_TLS_CERT,
                    var::MUSTER_TLS_KEY
                )
            } else {
                var::MUSTER_TLS_CA.to_owned()
            };
            security = security
                .with_tls(
                    &ca,
                    identity.as_ref().map(|(c, k)| (c.as_path(), k.as_path())),
                    domain.as_deref(),
                )
                .map_err(|why| Error::Config(format!("{named}: {why}")))?;
            // Builds the TLS client once: certificates, key and name are parsed now rather
            // than at the first connection.
            security.endpoint("localhost:1").map_err(|_| {
                Error::Config(format!(
                    "{named}{}: the TLS settings cannot be used (a malformed certificate or \
                         key, or a key that does not match the certificate)",
                    if domain.is_some() {
                        format!(", {}", var::MUSTER_TLS_DOMAIN)
                    } else {
                        String::new()
                    }
                ))
            })?;
        }
        None => {
            for name in [
                var::MUSTER_TLS_CERT,
                var::MUSTER_TLS_KEY,
                var::MUSTER_TLS_DOMAIN,
            ] {
                if lookup(name).is_some() {
                    return Err(Error::Config(format!(
                        "{name} is set but {} is not (TLS needs the CA that signed the \
                         coordinator's certificate)",
                        var::MUSTER_TLS_CA
                    )));
                }
            }
        }
    }
    if let Some(token) = set(var::MUSTER_TOKEN)? {
        // The token's value never goes into an error: check_token's reasons do not show it.
        let credentials = Credentials::bearer(&token)
            .map_err(|why| Error::Config(format!("{}: {why}", var::MUSTER_TOKEN)))?;
        security = security.with_credentials(credentials);
    }
    Ok(security)
}

fn needs(set: &str, missing: &str) -> Error {
    Error::Config(format!(
        "{set} is set but {missing} is not: both or neither"
    ))
}

/// Checks that the file `name` points at can be read and holds a PEM `what` (`marker`); the
/// error names the variable and the path, never the content.
fn check_pem(name: &str, path: &Path, marker: &str, what: &str) -> Result<(), Error> {
    let text = std::fs::read(path)
        .map_err(|e| Error::Config(format!("{name}={}: cannot read it: {e}", path.display())))?;
    if !String::from_utf8_lossy(&text).contains(marker) {
        return Err(Error::Config(format!(
            "{name}={}: no PEM {what} in the file",
            path.display()
        )));
    }
    Ok(())
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
        "{name} is not set, but {coordinator} is (muster-agent sets both; \
         unset {coordinator} to run as a single process)",
        coordinator = var::MUSTER_COORDINATOR
    ))
}

/// The coordinator address must be `host:port` with no scheme, as the agent writes it, or a
/// comma-separated list of such addresses (the replicas of a highly available coordinator).
fn check_coordinator_addr(addr: &str) -> Result<(), Error> {
    if addr.trim().is_empty() {
        return Err(Error::Config(format!(
            "{}={addr:?} is empty (unset it to run as a single process)",
            var::MUSTER_COORDINATOR
        )));
    }
    let separator = if addr.contains(',') { ": " } else { " " };
    failover::parse_addrs(addr).map(drop).map_err(|why| {
        Error::Config(format!(
            "{}={addr:?}{separator}{why}",
            var::MUSTER_COORDINATOR
        ))
    })
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

    #[test]
    fn recovery_settings_parse() {
        let parse = |vars: &[(&str, &str)]| {
            RecoveryEnv::from_lookup(|name| {
                vars.iter()
                    .find(|(k, _)| *k == name)
                    .map(|(_, v)| (*v).to_owned())
            })
        };
        assert_eq!(parse(&[]).ok(), Some(RecoveryEnv::default()));
        assert_eq!(
            parse(&[("MUSTER_RECOVERY", "restart")]).ok(),
            Some(RecoveryEnv {
                mode: Recovery::Restart,
                epoch: 0
            })
        );
        let replacement = parse(&[("MUSTER_RECOVERY", "in-place"), ("MUSTER_EPOCH", "3")]);
        assert_eq!(
            replacement.as_ref().ok(),
            Some(&RecoveryEnv {
                mode: Recovery::InPlace,
                epoch: 3
            })
        );
        assert!(replacement.is_ok_and(|r| r.is_replacement()));
        let error = |vars: &[(&str, &str)]| parse(vars).err().map(|e| e.to_string());
        assert_eq!(
            error(&[("MUSTER_RECOVERY", "inplace")]).as_deref(),
            Some(
                "bad muster environment: MUSTER_RECOVERY: 'inplace' is not a recovery mode: \
                 expected restart or in-place"
            )
        );
        assert!(
            error(&[("MUSTER_RECOVERY", "in-place"), ("MUSTER_EPOCH", "x")])
                .is_some_and(|e| e.contains("MUSTER_EPOCH=\"x\""))
        );
        assert!(
            error(&[("MUSTER_EPOCH", "2")])
                .is_some_and(|e| e.contains("MUSTER_EPOCH=2") && e.contains("MUSTER_RECOVERY"))
        );
    }

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
                        agent_socket: None,
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
        // Under an agent, the coordinator is its gateway, whatever MUSTER_COORDINATOR says.
        for coordinator in [None, Some("coord.example:29470"), Some("bad")] {
            check(
                &[
                    ("MUSTER_AGENT_SOCKET", Some("/tmp/muster-7-ab/relay.sock")),
                    ("MUSTER_COORDINATOR", coordinator),
                ],
                Ok(|info| {
                    assert_eq!(
                        info.agent_socket.as_deref(),
                        Some(Path::new("/tmp/muster-7-ab/relay.sock"))
                    );
                    assert_eq!(
                        info.coordinator.as_deref(),
                        Some("unix:/tmp/muster-7-ab/coordinator.sock")
                    );
                }),
            );
        }
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

    /// Parses the security variables in `vars`.
    fn security(vars: &[(&str, &str)]) -> Result<ClientSecurity, Error> {
        security_from_lookup(|name| {
            vars.iter()
                .find(|(k, _)| *k == name)
                .map(|(_, v)| (*v).to_owned())
        })
    }

    #[test]
    fn security_defaults_to_plaintext_and_reads_the_token() {
        let plain = security(&[]).expect("nothing set is fine");
        assert!(!plain.is_tls() && !plain.credentials().is_set());
        let token = "mj1.6a6f622d61.0123456789abcdef";
        let with_token = security(&[("MUSTER_TOKEN", token)]).expect("a valid token");
        assert!(!with_token.is_tls() && with_token.credentials().is_set());
        assert!(!format!("{with_token:?}").contains("0123456789abcdef"));
        // A trailing newline (a token read from a file into the variable) is not part of it.
        let newline = format!("{token}\n");
        assert!(security(&[("MUSTER_TOKEN", &newline)]).is_ok());
    }

    #[test]
    fn bad_security_variables_name_the_variable_and_never_the_token() {
        let dir = std::env::temp_dir().join(format!("muster-env-test-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("temp dir");
        let not_pem = dir.join("not-pem.txt");
        std::fs::write(&not_pem, "hello").expect("write");
        let not_pem = not_pem.to_str().expect("utf-8 path");
        let fake_cert = dir.join("cert.pem");
        std::fs::write(
            &fake_cert,
            "-----BEGIN CERTIFICATE-----\nAAAA\n-----END CERTIFICATE-----\n",
        )
        .expect("write");
        let fake_cert = fake_cert.to_str().expect("utf-8 path");
        let fake_key = dir.join("key.pem");
        std::fs::write(
            &fake_key,
            "-----BEGIN PRIVATE KEY-----\nAAAA\n-----END PRIVATE KEY-----\n",
        )
        .expect("write");
        let fake_key = fake_key.to_str().expect("utf-8 path");
        let secret = "s3cr3t-value";
        let cases: &[(&[(&str, &str)], &str)] = &[
            (&[("MUSTER_TOKEN", "")], "MUSTER_TOKEN is set but empty"),
            (
                &[("MUSTER_TOKEN", secret)],
                "MUSTER_TOKEN: the token is 12 characters",
            ),
            (
                &[("MUSTER_TOKEN", "s3cr3t value with spaces")],
                "MUSTER_TOKEN: the token must be printable ASCII",
            ),
            (&[("MUSTER_TLS_CA", " ")], "MUSTER_TLS_CA is set but empty"),
            (
                &[("MUSTER_TLS_CERT", "/c.pem"), ("MUSTER_TLS_KEY", "/k.pem")],
                "MUSTER_TLS_CERT is set but MUSTER_TLS_CA is not",
            ),
            (
                &[("MUSTER_TLS_KEY", "/k.pem")],
                "MUSTER_TLS_KEY is set but MUSTER_TLS_CA is not",
            ),
            (
                &[("MUSTER_TLS_DOMAIN", "coord.svc")],
                "MUSTER_TLS_DOMAIN is set but MUSTER_TLS_CA is not",
            ),
            (
                &[("MUSTER_TLS_CA", fake_cert), ("MUSTER_TLS_CERT", fake_cert)],
                "MUSTER_TLS_CERT is set but MUSTER_TLS_KEY is not: both or neither",
            ),
            (
                &[("MUSTER_TLS_CA", fake_cert), ("MUSTER_TLS_KEY", not_pem)],
                "MUSTER_TLS_KEY is set but MUSTER_TLS_CERT is not: both or neither",
            ),
            (
                &[("MUSTER_TLS_CA", "/nonexistent/ca.pem")],
                "MUSTER_TLS_CA=/nonexistent/ca.pem: cannot read it",
            ),
            (&[("MUSTER_TLS_CA", not_pem)], "MUSTER_TLS_CA="),
            (
                &[
                    ("MUSTER_TLS_CA", fake_cert),
                    ("MUSTER_TLS_CERT", fake_cert),
                    ("MUSTER_TLS_KEY", not_pem),
                ],
                "MUSTER_TLS_KEY=",
            ),
            (
                &[("MUSTER_TLS_CA", fake_cert), ("MUSTER_TLS_DOMAIN", "a b")],
                "MUSTER_TLS_DOMAIN=\"a b\" is not a host name",
            ),
            // Keys are parsed now, not at the first connection.
            (
                &[
                    ("MUSTER_TLS_CA", fake_cert),
                    ("MUSTER_TLS_CERT", fake_cert),
                    ("MUSTER_TLS_KEY", fake_key),
                ],
                "MUSTER_TLS_CA, MUSTER_TLS_CERT and MUSTER_TLS_KEY: the TLS settings cannot be \
                 used",
            ),
        ];
        for (vars, want) in cases {
            match security(vars) {
                Err(Error::Config(text)) => {
                    assert!(text.contains(want), "{vars:?}: {text:?} lacks {want:?}");
                    assert!(!text.contains(secret), "{vars:?}: {text:?} shows the token");
                    assert!(!text.contains('\n'), "{vars:?}: {text:?} is not one line");
                }
                other => panic!("{vars:?}: expected a config error, got {other:?}"),
            }
        }
        let _ = std::fs::remove_dir_all(&dir);
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
