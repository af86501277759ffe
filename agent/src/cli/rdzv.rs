//! torchrun's rendezvous flags (`--rdzv-backend`, `--rdzv-endpoint`, `--rdzv-id`,
//! `--rdzv-conf`, `--standalone`, each also from its `PET_*` variable) and how they map onto
//! muster: the endpoint names where the job's coordinator runs, and the agent whose machine
//! can bind it hosts that coordinator (as torchrun's c10d agent hosts its TCPStore), so the
//! same command works on every node with no daemon started by hand.

use super::UsageError;
use super::torchrun::{no_effect, pet_bool};
use crate::spec::ServerSecurity;
use clap::{Args, ValueEnum};
use muster_core::model::JobId;
use std::time::Duration;

/// The `--help` heading of these flags.
const HEADING: &str = "Rendezvous";
/// torchrun's c10d port when `--rdzv-endpoint` gives none.
pub const C10D_PORT: u16 = 29400;

/// torchrun's rendezvous flags (flattened into `LaunchArgs`).
#[derive(Debug, Clone, Default, Args)]
pub struct RdzvArgs {
    /// torchrun's rendezvous backend. c10d and static: the coordinator runs at
    /// --rdzv-endpoint (or at the main machine's address, port 29470), hosted by the agent
    /// whose machine can bind it. etcd and etcd-v2: accepted with a note; the rendezvous runs
    /// in muster's coordinator (--coordinator), whose replicas can keep their state in etcd.
    /// Default: static, as with torchrun.
    #[arg(
        long,
        value_enum,
        value_name = "BACKEND",
        alias = "rdzv_backend",
        env = "PET_RDZV_BACKEND",
        help_heading = HEADING
    )]
    pub rdzv_backend: Option<Backend>,

    /// Where the job's coordinator runs, HOST[:PORT] (port 29400 when not given, as torchrun's
    /// c10d). Without --coordinator, the agent whose machine can bind it hosts the coordinator
    /// there and the other agents dial it.
    #[arg(
        long,
        value_name = "HOST[:PORT]",
        alias = "rdzv_endpoint",
        env = "PET_RDZV_ENDPOINT",
        help_heading = HEADING
    )]
    pub rdzv_endpoint: Option<String>,

    /// torchrun's job id: the job id when it is a valid one (1 to 128 characters of
    /// [A-Za-z0-9._-]), else one derived from it, the same on every node.
    #[arg(
        long,
        value_name = "ID",
        alias = "rdzv_id",
        env = "PET_RDZV_ID",
        help_heading = HEADING
    )]
    pub rdzv_id: Option<String>,

    /// torchrun's rendezvous settings, KEY=VALUE,... Used: join_timeout and
    /// last_call_timeout (seconds), is_host (whether this agent hosts the coordinator at
    /// --rdzv-endpoint). Every other key torchrun knows is accepted with a note.
    #[arg(
        long,
        value_name = "KEY=VALUE,...",
        alias = "rdzv_conf",
        env = "PET_RDZV_CONF",
        value_parser = parse_rdzv_conf,
        help_heading = HEADING
    )]
    pub rdzv_conf: Option<RdzvConf>,

    /// A single-node job with a rendezvous of its own, as torchrun's: the agent's own
    /// coordinator on 127.0.0.1 and a fresh job id (the default for a single node anyway).
    /// Overrides --rdzv-backend, --rdzv-endpoint and --rdzv-id, with a warning.
    #[arg(long, env = "PET_STANDALONE", value_parser = pet_bool, help_heading = HEADING)]
    pub standalone: bool,
}

/// torchrun's `--rdzv-backend` values.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Backend {
    /// The agent that can bind the endpoint hosts the rendezvous.
    C10d,
    /// Rendezvous at the main machine (`--master-addr`) or the endpoint.
    Static,
    /// An etcd server holds the rendezvous.
    Etcd,
    /// The same, over etcd's v2 API.
    #[value(name = "etcd-v2")]
    EtcdV2,
}

/// `--rdzv-conf`: what muster uses of torchrun's rendezvous settings, and notes for the rest.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct RdzvConf {
    /// `join_timeout`.
    pub join_timeout: Option<Duration>,
    /// `last_call_timeout`.
    pub last_call: Option<Duration>,
    /// `is_host`: whether this agent hosts the coordinator at the endpoint (torchrun's
    /// default guesses from the host name; muster's tries to bind it).
    pub is_host: Option<bool>,
    /// One note per key accepted without effect.
    pub notes: Vec<String>,
}

/// Why each torchrun key muster accepts without effect has none.
const NO_EFFECT: &[(&str, &str)] = &[
    (
        "close_timeout",
        "the coordinator closes a round as soon as it is complete and ends it when every node is done",
    ),
    (
        "read_timeout",
        "agents hold streams to the coordinator instead of timed store reads",
    ),
    (
        "timeout",
        "the join timeout is join_timeout (or --join-timeout-ms)",
    ),
    (
        "keep_alive_interval",
        "a node's liveness is its agent's lease (--lease-ms)",
    ),
    (
        "keep_alive_max_attempt",
        "a node's liveness is its agent's lease (--lease-ms)",
    ),
    (
        "heartbeat",
        "a node's liveness is its agent's lease (--lease-ms)",
    ),
    (
        "store_type",
        "the rendezvous is muster's coordinator, not a torch store",
    ),
    (
        "use_libuv",
        "the rendezvous is muster's coordinator, not a torch store",
    ),
    (
        "use_agent_store",
        "the workers' MASTER_PORT store is their own; the agents use the coordinator",
    ),
    (
        "rank",
        "the node rank is --node-rank (static rendezvous), else the coordinator's",
    ),
    ("protocol", "muster does not rendezvous through etcd"),
    ("cacert", "muster does not rendezvous through etcd"),
    ("cert", "muster does not rendezvous through etcd"),
    ("key", "muster does not rendezvous through etcd"),
    ("ca_cert", "muster does not rendezvous through etcd"),
    ("ssl_cert", "muster does not rendezvous through etcd"),
    ("ssl_cert_key", "muster does not rendezvous through etcd"),
    ("etcd_prefix", "muster does not rendezvous through etcd"),
    (
        "cas_backoff_max_seconds",
        "muster does not rendezvous through etcd",
    ),
];

/// Parses `join_timeout=600,last_call_timeout=30,is_host=1,read_timeout=60` (seconds). A key
/// torchrun does not read either is accepted, as torchrun accepts it, with a note.
pub fn parse_rdzv_conf(s: &str) -> Result<RdzvConf, String> {
    let mut conf = RdzvConf::default();
    for item in s.split(',').map(str::trim).filter(|i| !i.is_empty()) {
        let Some((key, value)) = item.split_once('=') else {
            return Err(format!("'{item}' is not KEY=VALUE"));
        };
        let (key, value) = (key.trim(), value.trim());
        let secs = || {
            value
                .parse::<f64>()
                .ok()
                .filter(|v| *v >= 0.0)
                .and_then(|v| Duration::try_from_secs_f64(v).ok())
                .ok_or_else(|| format!("{key}={value}: expected a number of seconds"))
        };
        match key {
            "join_timeout" => conf.join_timeout = Some(secs()?),
            "last_call_timeout" => conf.last_call = Some(secs()?),
            "is_host" => {
                // torchrun's get_as_bool: 1/true/yes, 0/false/no, any case.
                conf.is_host = Some(match value.to_ascii_lowercase().as_str() {
                    "1" | "true" | "t" | "yes" | "y" => true,
                    "0" | "false" | "f" | "no" | "n" => false,
                    _ => return Err(format!("is_host={value}: expected true or false")),
                });
            }
            _ => {
                let why = NO_EFFECT
                    .iter()
                    .find(|(k, _)| *k == key)
                    .map_or("torchrun's rendezvous does not read it either", |(_, w)| w);
                conf.notes
                    .push(no_effect(&format!("--rdzv-conf {key}"), why));
            }
        }
    }
    Ok(conf)
}

/// The rendezvous flags, checked: what the rest of the launch's validation needs.
#[derive(Debug, Default)]
pub struct Rendezvous {
    /// `--standalone`: single node on the agent's own loopback coordinator.
    pub standalone: bool,
    /// `--rdzv-endpoint` as `(host, port)`, for c10d and static.
    pub endpoint: Option<(String, u16)>,
    /// The job id from `--rdzv-id` (valid, or derived from it).
    pub job_id: Option<String>,
    /// `--rdzv-conf` (its notes already moved to the warnings).
    pub conf: RdzvConf,
}

impl RdzvArgs {
    /// Checks the flags; notes and warnings go to `warnings`.
    pub fn resolve(self, warnings: &mut Vec<String>) -> Result<Rendezvous, UsageError> {
        let mut conf = self.rdzv_conf.unwrap_or_default();
        warnings.append(&mut conf.notes);
        if self.standalone {
            let given: Vec<&str> = [
                ("--rdzv-backend", self.rdzv_backend.is_some()),
                ("--rdzv-endpoint", self.rdzv_endpoint.is_some()),
                ("--rdzv-id", self.rdzv_id.is_some()),
            ]
            .into_iter()
            .filter_map(|(flag, given)| given.then_some(flag))
            .collect();
            if !given.is_empty() {
                warnings.push(format!(
                    "--standalone overrides {}: the job runs on this node with its own coordinator on 127.0.0.1 and a fresh id, as torchrun's",
                    given.join(", ")
                ));
            }
            return Ok(Rendezvous {
                standalone: true,
                conf,
                ..Rendezvous::default()
            });
        }
        let backend = self.rdzv_backend.unwrap_or(Backend::Static);
        let endpoint = match (backend, self.rdzv_endpoint.as_deref().map(str::trim)) {
            (_, None | Some("")) => None,
            (Backend::Etcd | Backend::EtcdV2, Some(e)) => {
                warnings.push(no_effect(
                    &format!("--rdzv-endpoint {e}"),
                    "it names an etcd server, and muster does not rendezvous through etcd",
                ));
                None
            }
            (_, Some(e)) => Some(parse_endpoint(e)?),
        };
        if matches!(backend, Backend::Etcd | Backend::EtcdV2) {
            let name = if backend == Backend::Etcd {
                "etcd"
            } else {
                "etcd-v2"
            };
            warnings.push(no_effect(
                &format!("--rdzv-backend {name}"),
                "the rendezvous runs in muster's coordinator (--coordinator, or the main machine's with --master-addr), whose replicas can keep their state in etcd (muster-coordinator --store etcd)",
            ));
        }
        let job_id = self.rdzv_id.map(|id| {
            let valid = job_id_from(&id);
            if valid != id {
                warnings.push(super::note(&format!(
                    "--rdzv-id '{id}' is not a muster job id (1 to 128 characters of [A-Za-z0-9._-]): the job id is '{valid}' on every node"
                )));
            }
            valid
        });
        Ok(Rendezvous {
            standalone: false,
            endpoint,
            job_id,
            conf,
        })
    }
}

/// `HOST[:PORT]` (torchrun's `parse_rendezvous_endpoint`: IPv6 in brackets, port 29400 when
/// none); the host is checked as `--master-addr` is.
pub fn parse_endpoint(s: &str) -> Result<(String, u16), UsageError> {
    let bad = |why: String| UsageError::Invalid(format!("--rdzv-endpoint '{s}' {why}"));
    let (host, port) = if let Some(rest) = s.strip_prefix('[') {
        match rest.split_once(']') {
            Some((h, "")) => (h, None),
            Some((h, p)) => match p.strip_prefix(':') {
                Some(p) => (h, Some(p)),
                None => return Err(bad("is malformed: expected HOST[:PORT]".into())),
            },
            None => return Err(bad("is malformed: expected HOST[:PORT]".into())),
        }
    } else if s.matches(':').count() > 1 {
        return Err(bad("is malformed: put an IPv6 address in brackets".into()));
    } else {
        match s.split_once(':') {
            Some((h, p)) => (h, Some(p)),
            None => (s, None),
        }
    };
    crate::net::plain_host(host)
        .map_err(|why| UsageError::Invalid(format!("--rdzv-endpoint {why}")))?;
    let port = match port {
        None => C10D_PORT,
        Some(p) => match p.parse::<u16>() {
            Ok(p) if p > 0 => p,
            _ => return Err(bad(format!("has no valid port ('{p}')"))),
        },
    };
    Ok((host.to_owned(), port))
}

/// `id` when it is a valid job id; else the same characters with the others replaced by `-`,
/// cut to fit, and a hash of the whole id, so that different ids stay different and every
/// node derives the same one.
pub fn job_id_from(id: &str) -> String {
    if JobId::parse(id).is_ok() {
        return id.to_owned();
    }
    // FNV-1a: stable across machines and releases, unlike std's hasher.
    let hash = id.bytes().fold(0xcbf2_9ce4_8422_2325_u64, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
    });
    let mut clean = super::job_id_chars(id);
    clean.truncate(128 - 17);
    format!("{clean}-{hash:016x}")
}

/// How this agent serves a coordinator it hosts, from the launch's security flags: `Ok(None)`
/// with none of them (plaintext), the server's files with all four, and the missing ones'
/// names otherwise (such an agent cannot serve as the others dial, so it only dials).
pub fn server_security(
    s: &crate::security::SecurityArgs,
) -> Result<Option<ServerSecurity>, String> {
    if !s.any() {
        return Ok(None);
    }
    match (&s.tls_cert, &s.tls_key, &s.tls_ca, &s.auth_token_file) {
        (Some(cert), Some(key), Some(ca), Some(token)) => Ok(Some(ServerSecurity {
            cert: cert.clone(),
            key: key.clone(),
            client_ca: ca.clone(),
            token_file: token.clone(),
        })),
        _ => {
            let missing: Vec<&str> = [
                ("--tls-ca", s.tls_ca.is_none()),
                ("--tls-cert", s.tls_cert.is_none()),
                ("--tls-key", s.tls_key.is_none()),
                ("--auth-token-file", s.auth_token_file.is_none()),
            ]
            .into_iter()
            .filter_map(|(flag, missing)| missing.then_some(flag))
            .collect();
            Err(missing.join(", "))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::tests::{machine, summary};
    use super::super::{Parsed, parse_in};
    use super::*;

    /// Parses `args` (with `sh` as the program) and returns the spec's rendezvous fields and
    /// the messages, or the error.
    fn run(args: &str) -> Result<String, String> {
        let argv = ["muster-agent", "launch"]
            .into_iter()
            .map(str::to_owned)
            .chain(args.split_whitespace().map(str::to_owned))
            .chain(["sh".to_owned()]);
        match parse_in(argv, &machine(None)) {
            Ok((Parsed::Launch(s), warnings)) => {
                let host = match &s.self_host {
                    None => "dial".to_owned(),
                    Some(h) => format!(
                        "host{}{}",
                        if h.must { "(must)" } else { "" },
                        if h.secured.is_some() { "(tls)" } else { "" }
                    ),
                };
                let line = summary(&s, &[]);
                let coord = line
                    .split(' ')
                    .find(|p| p.starts_with("coord="))
                    .unwrap_or_default()
                    .to_owned();
                let job = if s.job_id.starts_with("job-") {
                    "<fresh>"
                } else {
                    &s.job_id
                };
                let mut out = format!("{coord} job={job} {host}");
                if let Some(j) = s.join_timeout {
                    out.push_str(&format!(" join={}ms", j.as_millis()));
                }
                for w in warnings {
                    out.push_str(" | ");
                    out.push_str(&w);
                }
                Ok(out)
            }
            Ok((other, _)) => Ok(format!("{other:?}")),
            Err(e) => Err(e.to_string()),
        }
    }

    fn check(args: &str, expected: Result<&str, &str>) {
        let got = run(args);
        assert_eq!(
            got.as_deref().map_err(String::as_str),
            expected,
            "muster-agent launch {args}"
        );
    }

    #[test]
    fn endpoints_and_hosting() {
        for (args, expected) in [
            // torchrun's c10d multi-node form: the endpoint is hosted by whoever binds it.
            (
                "--nnodes 2 --rdzv-backend c10d --rdzv-endpoint 10.0.0.1:29400 --rdzv-id job1",
                Ok(r#"coord=Some("10.0.0.1:29400") job=job1 host"#),
            ),
            (
                "--nnodes 2 --rdzv_backend=c10d --rdzv_endpoint=node0 --rdzv_id=j",
                Ok(r#"coord=Some("node0:29400") job=j host"#),
            ),
            (
                "--nnodes 2 --rdzv-endpoint [fd00::1]:7000 --rdzv-id j",
                Ok(r#"coord=Some("[fd00::1]:7000") job=j host"#),
            ),
            // No id: derived from the endpoint, the same on every node.
            (
                "--nnodes 2 --rdzv-endpoint 10.0.0.1",
                Ok(r#"coord=Some("10.0.0.1:29400") job=muster-10.0.0.1-29400 host"#),
            ),
            // Accelerate's and torchrun's static form: hosted at the main machine, port 29470.
            (
                "--nnodes 2 --master-addr 10.0.0.9",
                Ok(r#"coord=Some("10.0.0.9:29470") job=muster-10.0.0.9-29500 host"#),
            ),
            (
                "--num_machines 2 --main_process_ip 10.0.0.9 --num_processes 2",
                Ok(r#"coord=Some("10.0.0.9:29470") job=muster-10.0.0.9-29500 host"#),
            ),
            // --coordinator names a coordinator run by hand: dial only.
            (
                "--nnodes 2 --coordinator 10.0.0.1:1 --job-id j",
                Ok(r#"coord=Some("10.0.0.1:1") job=j dial"#),
            ),
            (
                "--nnodes 2 --coordinator 10.0.0.1:1 --rdzv-endpoint 10.0.0.2 --rdzv-id j",
                Ok(
                    r#"coord=Some("10.0.0.1:1") job=j dial | note: --rdzv-endpoint 10.0.0.2:29400 has no effect under muster: --coordinator names the coordinator"#,
                ),
            ),
            // Single node: the agent's own coordinator, unless an endpoint is given.
            ("", Ok("coord=None job=<fresh> dial")),
            ("--rdzv-backend c10d", Ok("coord=None job=<fresh> dial")),
            (
                "--rdzv-endpoint 127.0.0.1:0",
                Err("--rdzv-endpoint '127.0.0.1:0' has no valid port ('0')"),
            ),
            (
                "--rdzv-endpoint 127.0.0.1:5000 --rdzv-conf is_host=0",
                Ok(r#"coord=Some("127.0.0.1:5000") job=muster-127.0.0.1-5000 dial"#),
            ),
            (
                "--nnodes 2 --rdzv-endpoint h:5 --rdzv-id j --rdzv-conf is_host=true",
                Ok(r#"coord=Some("h:5") job=j host(must)"#),
            ),
            (
                "--nnodes 2 --rdzv-backend c10d",
                Err(
                    "--nnodes 2 needs --coordinator (or --rdzv-endpoint, or the main machine's address: --master-addr, --main_process_ip): every node must name the same one",
                ),
            ),
            (
                "--rdzv-endpoint a/b:1",
                Err("--rdzv-endpoint 'a/b' is not a host name or IP address (it contains '/')"),
            ),
            (
                "--rdzv-endpoint fd00::1:5",
                Err("--rdzv-endpoint 'fd00::1:5' is malformed: put an IPv6 address in brackets"),
            ),
            (
                "--rdzv-endpoint h:x",
                Err("--rdzv-endpoint 'h:x' has no valid port ('x')"),
            ),
        ] {
            check(args, expected);
        }
    }

    #[test]
    fn ids_backends_and_standalone() {
        for (args, expected) in [
            (
                "--nnodes 2 --rdzv-endpoint h --rdzv-id a/b",
                Ok(
                    r#"coord=Some("h:29400") job=a-b-e620c3190468cf61 host | note: --rdzv-id 'a/b' is not a muster job id (1 to 128 characters of [A-Za-z0-9._-]): the job id is 'a-b-e620c3190468cf61' on every node"#,
                ),
            ),
            (
                "--nnodes 2 --rdzv-endpoint h --rdzv-id a --job-id b",
                Err("--job-id b conflicts with --rdzv-id a"),
            ),
            (
                "--nnodes 2 --rdzv-endpoint h --rdzv-id a --job-id a",
                Ok(r#"coord=Some("h:29400") job=a host"#),
            ),
            ("--standalone", Ok("coord=None job=<fresh> dial")),
            (
                "--standalone --rdzv-backend c10d --rdzv-endpoint h:1 --rdzv-id x",
                Ok(
                    "coord=None job=<fresh> dial | --standalone overrides --rdzv-backend, --rdzv-endpoint, --rdzv-id: the job runs on this node with its own coordinator on 127.0.0.1 and a fresh id, as torchrun's",
                ),
            ),
            (
                "--standalone --nnodes 2",
                Err("--standalone conflicts with --nnodes 2: a standalone job has one node"),
            ),
            (
                "--standalone --coordinator 10.0.0.1:1",
                Err("--standalone conflicts with --coordinator 10.0.0.1:1"),
            ),
            (
                "--nnodes 2 --rdzv-backend etcd --rdzv-endpoint etcd0:2379 --coordinator c:1 --job-id j",
                Ok(
                    r#"coord=Some("c:1") job=j dial | note: --rdzv-endpoint etcd0:2379 has no effect under muster: it names an etcd server, and muster does not rendezvous through etcd | note: --rdzv-backend etcd has no effect under muster: the rendezvous runs in muster's coordinator (--coordinator, or the main machine's with --master-addr), whose replicas can keep their state in etcd (muster-coordinator --store etcd)"#,
                ),
            ),
            (
                "--rdzv-backend etcd-v2",
                Ok(
                    "coord=None job=<fresh> dial | note: --rdzv-backend etcd-v2 has no effect under muster: the rendezvous runs in muster's coordinator (--coordinator, or the main machine's with --master-addr), whose replicas can keep their state in etcd (muster-coordinator --store etcd)",
                ),
            ),
            (
                "--rdzv-backend zookeeper",
                Err(
                    "invalid value 'zookeeper' for '--rdzv-backend <BACKEND>' [possible values: c10d, static, etcd, etcd-v2] (see `muster-agent launch --help`)",
                ),
            ),
        ] {
            check(args, expected);
        }
    }

    #[test]
    fn conf_keys() {
        for (args, expected) in [
            (
                "--rdzv-conf join_timeout=10",
                Ok("coord=None job=<fresh> dial join=10000ms"),
            ),
            (
                "--rdzv-conf read_timeout=60",
                Ok(
                    "coord=None job=<fresh> dial | note: --rdzv-conf read_timeout has no effect under muster: agents hold streams to the coordinator instead of timed store reads",
                ),
            ),
            (
                "--rdzv-conf timeout=900,keep_alive_interval=5,store_type=tcp",
                Ok(
                    "coord=None job=<fresh> dial | note: --rdzv-conf timeout has no effect under muster: the join timeout is join_timeout (or --join-timeout-ms) | note: --rdzv-conf keep_alive_interval has no effect under muster: a node's liveness is its agent's lease (--lease-ms) | note: --rdzv-conf store_type has no effect under muster: the rendezvous is muster's coordinator, not a torch store",
                ),
            ),
            (
                "--rdzv-conf something_new=1",
                Ok(
                    "coord=None job=<fresh> dial | note: --rdzv-conf something_new has no effect under muster: torchrun's rendezvous does not read it either",
                ),
            ),
            (
                "--rdzv-conf is_host=maybe",
                Err(
                    "invalid value 'is_host=maybe' for '--rdzv-conf <KEY=VALUE,...>': is_host=maybe: expected true or false (see `muster-agent launch --help`)",
                ),
            ),
        ] {
            check(args, expected);
        }
    }

    #[test]
    fn security_of_a_hosted_coordinator() {
        let dir = std::env::temp_dir().join(format!("muster-rdzv-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("temp dir");
        let token = dir.join("token");
        std::fs::write(&token, "0123456789abcdef0123456789abcdef\n").expect("token");
        let t = token.display();
        // Only a token: this agent cannot serve TLS, so it dials.
        check(
            &format!("--nnodes 2 --rdzv-endpoint h --rdzv-id j --auth-token-file {t}"),
            Ok(
                r#"coord=Some("h:29400") job=j dial | note: this agent does not host the rendezvous at h:29400: serving it securely needs --tls-ca, --tls-cert, --tls-key (it dials)"#,
            ),
        );
        check(
            &format!(
                "--nnodes 2 --rdzv-endpoint h --rdzv-id j --auth-token-file {t} --rdzv-conf is_host=1"
            ),
            Err(
                "--rdzv-conf is_host=1: hosting the rendezvous at h:29400 securely needs --tls-ca, --tls-cert, --tls-key",
            ),
        );
        let files = server_security(&crate::security::SecurityArgs {
            tls_ca: Some("ca.pem".into()),
            tls_cert: Some("node.pem".into()),
            tls_key: Some("node.key".into()),
            auth_token_file: Some(token.clone()),
            tls_domain: None,
        });
        assert_eq!(
            files,
            Ok(Some(ServerSecurity {
                cert: "node.pem".into(),
                key: "node.key".into(),
                client_ca: "ca.pem".into(),
                token_file: token,
            }))
        );
        assert_eq!(
            server_security(&crate::security::SecurityArgs::default()),
            Ok(None)
        );
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn conf_values() {
        assert_eq!(parse_rdzv_conf(""), Ok(RdzvConf::default()));
        assert_eq!(
            parse_rdzv_conf(" join_timeout = 600 , last_call_timeout=30,is_host=False"),
            Ok(RdzvConf {
                join_timeout: Some(Duration::from_secs(600)),
                last_call: Some(Duration::from_secs(30)),
                is_host: Some(false),
                notes: Vec::new(),
            })
        );
        assert_eq!(
            parse_rdzv_conf("last_call_timeout=-1"),
            Err("last_call_timeout=-1: expected a number of seconds".to_owned())
        );
        assert_eq!(
            parse_rdzv_conf("join_timeout"),
            Err("'join_timeout' is not KEY=VALUE".to_owned())
        );
    }

    #[test]
    fn derived_ids_are_valid_and_stable() {
        for id in ["job1", "a.b-c_d", &"x".repeat(128)] {
            assert_eq!(job_id_from(id), id);
        }
        for id in ["", "my job", "ü", &"y".repeat(129), "a/b"] {
            let derived = job_id_from(id);
            assert!(JobId::parse(&derived).is_ok(), "{id:?} -> {derived:?}");
            assert_eq!(derived, job_id_from(id), "{id:?}");
        }
        assert_ne!(job_id_from("a b"), job_id_from("a/b"));
    }
}
