//! The coordinator's configuration: defaults, then a TOML file, then `MUSTER_*` environment
//! variables, then flags; validated once before anything starts.

use serde::Deserialize;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use crate::auth::Auth;

/// Everything the coordinator can be told. Built with [`Config::default`] and [`Layer`]s.
#[derive(Debug, Clone)]
pub struct Config {
    /// Where to serve gRPC.
    pub listen: SocketAddr,
    /// A worker session silent for this long is marked failed.
    pub heartbeat_timeout: Duration,
    /// Default last-call window of a rendezvous round (when the join does not say).
    pub last_call: Duration,
    /// Default join timeout of a rendezvous round (when the join does not say).
    pub join_timeout: Duration,
    /// Largest value in the key-value store, a shared value included.
    pub max_value_bytes: usize,
    /// Largest total of a job's key-value store.
    pub max_job_bytes: usize,
    /// Largest gRPC message the coordinator accepts.
    pub max_message_bytes: usize,
    /// Most client connections served at once; further ones wait in the listen backlog until
    /// one closes (see `serve_with_store`).
    pub max_connections: usize,
    /// Most concurrent HTTP/2 streams (calls and sessions) on one connection, announced in
    /// SETTINGS_MAX_CONCURRENT_STREAMS: clients queue calls beyond it. Simulated ranks and
    /// agents multiplex many sessions over few connections, so the default is generous.
    pub max_streams_per_connection: u32,
    /// Most connections from one peer IP address served at once; further ones from it are
    /// closed as soon as they are accepted, so one host cannot take every slot.
    pub max_connections_per_peer: usize,
    /// A connection must finish its TLS and HTTP/2 handshakes and send its first call within
    /// this long, or it is closed (and its slot freed): idle sockets cannot hold slots.
    pub handshake_timeout: Duration,
    /// Largest total of stored bytes (key-value data and published values) over all jobs.
    pub max_total_bytes: usize,
    /// Most jobs held at once; creating more is refused until finished ones expire.
    pub max_jobs: usize,
    /// Ranks per NCCL bootstrap root: a communicator of a larger world gets one unique id per
    /// this many ranks (`ncclCommInitRankScalable`, see `muster_core::nccl`); 0 keeps one root
    /// at any size.
    pub nccl_ranks_per_root: u32,
    /// A job in a final state (finished, failed or cancelled), or abandoned (its round open
    /// with no node waiting), is removed this long after it got there, its stored data and
    /// record included (see `retention.rs`).
    pub finished_job_ttl: Duration,
    /// Where durable state (key-value data, unique ids, shared values) is kept.
    pub store: StoreKind,
    /// How to reach etcd; set only with [`StoreKind::Etcd`] (checked by [`Config::validate`]).
    pub etcd: EtcdConfig,
    /// Where to serve Prometheus metrics (`GET /metrics`, plain HTTP); none when unset.
    pub metrics_addr: Option<SocketAddr>,
    /// Where to serve the live web view (`GET /` and `GET /api/view`, plain HTTP, read-only;
    /// see `web.rs`); none when unset. Exposed like the metrics: it shows what they count,
    /// by name, and never a credential or a unique id.
    pub web_addr: Option<SocketAddr>,
    /// A second, plaintext gRPC listener serving only `grpc.health.v1`, for probes that cannot
    /// speak TLS (Kubernetes' native gRPC probes); none when unset.
    pub health_addr: Option<SocketAddr>,
    /// TLS on the gRPC listener (`--tls-cert`, `--tls-key`, `--tls-client-ca`).
    pub tls: TlsConfig,
    /// File holding the cluster token (`--auth-token-file`); turns authentication on. Read
    /// when serving starts, unless [`Config::auth`] is already on.
    pub auth_token_file: Option<PathBuf>,
    /// The credential check in force; set programmatically by embedders (the agent's embedded
    /// coordinator, tests), or from [`Config::auth_token_file`] at start.
    pub auth: Auth,
    /// Serve on a non-loopback address without TLS and authentication (`--insecure`): refused
    /// otherwise, and warned about when given.
    pub insecure: bool,
}

/// The listener's TLS settings; all unset means plaintext.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TlsConfig {
    /// Server certificate chain (PEM).
    pub cert: Option<PathBuf>,
    /// The certificate's private key (PEM).
    pub key: Option<PathBuf>,
    /// CA (PEM) that must have signed every client's certificate: mutual TLS.
    pub client_ca: Option<PathBuf>,
}

impl TlsConfig {
    /// Whether the listener serves TLS.
    pub fn is_on(&self) -> bool {
        self.cert.is_some()
    }

    fn validate(&self) -> Result<(), String> {
        match (&self.cert, &self.key, &self.client_ca) {
            (Some(_), None, _) => Err("--tls-cert needs --tls-key".into()),
            (None, Some(_), _) => Err("--tls-key needs --tls-cert".into()),
            (None, None, Some(_)) => Err("--tls-client-ca needs --tls-cert and --tls-key".into()),
            _ => Ok(()),
        }
    }
}

/// Which [`Store`](crate::Store) implementation the coordinator runs on.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum StoreKind {
    /// In the coordinator's memory: lost when it exits (the default).
    #[default]
    Memory,
    /// In an etcd v3 cluster: survives coordinator restarts.
    Etcd,
}

impl std::str::FromStr for StoreKind {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "memory" => Ok(Self::Memory),
            "etcd" => Ok(Self::Etcd),
            _ => Err(format!("unknown store '{s}' (expected memory or etcd)")),
        }
    }
}

/// The etcd store's settings (`--etcd-*`). Unset fields are `None` or empty, so that
/// [`Config::validate`] can tell an etcd option given without `--store etcd`.
#[derive(Clone, Default, PartialEq, Eq)]
pub struct EtcdConfig {
    /// Client endpoints: `host:port` (plain, or TLS when a TLS option is set) or a URL with
    /// `http://` / `https://`.
    pub endpoints: Vec<String>,
    /// Key prefix of this coordinator's state [default: [`EtcdConfig::DEFAULT_PREFIX`]].
    pub prefix: Option<String>,
    /// CA certificate (PEM) that verifies etcd's server certificate; turns TLS on.
    pub ca: Option<PathBuf>,
    /// Client certificate (PEM) for mutual TLS, with [`EtcdConfig::key`].
    pub cert: Option<PathBuf>,
    /// Client private key (PEM) for mutual TLS, with [`EtcdConfig::cert`].
    pub key: Option<PathBuf>,
    /// etcd user name, with [`EtcdConfig::password_file`].
    pub user: Option<String>,
    /// File holding the etcd user's password (one line; never given on the command line).
    pub password_file: Option<PathBuf>,
    /// The address other replicas name this one by when it leads (clients connect to it)
    /// [default: the listen address].
    pub advertise_addr: Option<String>,
    /// The leader election's lease TTL in milliseconds [default: [`EtcdConfig::DEFAULT_LEASE_TTL_MS`]].
    pub lease_ttl_ms: Option<u64>,
}

// Written by hand so that no future field holding a secret can reach a log through `{:?}`.
impl std::fmt::Debug for EtcdConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EtcdConfig")
            .field("endpoints", &self.endpoints)
            .field("prefix", &self.prefix)
            .field("ca", &self.ca)
            .field("cert", &self.cert)
            .field("key", &self.key)
            .field("user", &self.user)
            .field("password_file", &self.password_file)
            .field("advertise_addr", &self.advertise_addr)
            .field("lease_ttl_ms", &self.lease_ttl_ms)
            .finish()
    }
}

impl EtcdConfig {
    /// The key prefix when none is given.
    pub const DEFAULT_PREFIX: &str = "/muster/";

    /// The election lease TTL when none is given: a dead leader is replaced within about
    /// this long.
    pub const DEFAULT_LEASE_TTL_MS: u64 = 3000;

    /// The election lease TTL in use.
    pub fn lease_ttl(&self) -> Duration {
        Duration::from_millis(self.lease_ttl_ms.unwrap_or(Self::DEFAULT_LEASE_TTL_MS))
    }

    /// The key prefix in use.
    pub fn prefix(&self) -> &str {
        self.prefix.as_deref().unwrap_or(Self::DEFAULT_PREFIX)
    }

    /// Whether any TLS option is set (then plain `host:port` endpoints use TLS).
    pub fn tls(&self) -> bool {
        self.ca.is_some() || self.cert.is_some() || self.key.is_some()
    }

    /// The flag of the first option that is set, if any.
    fn first_set(&self) -> Option<&'static str> {
        [
            (!self.endpoints.is_empty(), "--etcd-endpoints"),
            (self.prefix.is_some(), "--etcd-prefix"),
            (self.ca.is_some(), "--etcd-ca"),
            (self.cert.is_some(), "--etcd-cert"),
            (self.key.is_some(), "--etcd-key"),
            (self.user.is_some(), "--etcd-user"),
            (self.password_file.is_some(), "--etcd-password-file"),
            (self.advertise_addr.is_some(), "--advertise-addr"),
            (self.lease_ttl_ms.is_some(), "--lease-ttl-ms"),
        ]
        .into_iter()
        .find_map(|(set, flag)| set.then_some(flag))
    }

    fn validate(&self) -> Result<(), String> {
        if self.endpoints.is_empty() {
            return Err("--store etcd needs --etcd-endpoints (host:port,...)".into());
        }
        for e in &self.endpoints {
            let (scheme, rest) = match e.split_once("://") {
                Some((scheme, rest)) => (Some(scheme), rest),
                None => (None, e.as_str()),
            };
            let host_port = rest.strip_suffix('/').unwrap_or(rest);
            let port_ok = host_port
                .rsplit_once(':')
                .is_some_and(|(host, port)| !host.is_empty() && port.parse::<u16>().is_ok());
            if !port_ok || host_port.contains(['/', ' ', '\t']) {
                return Err(format!(
                    "--etcd-endpoints: '{e}' is not host:port (or http(s)://host:port)"
                ));
            }
            match scheme {
                None => {}
                Some("https") if self.ca.is_some() => {}
                Some("https") => {
                    return Err(format!(
                        "--etcd-endpoints: '{e}' is https, which needs --etcd-ca (the CA that signed etcd's certificate)"
                    ));
                }
                Some("http") if !self.tls() => {}
                Some("http") => {
                    return Err(format!(
                        "--etcd-endpoints: '{e}' is plain http, but TLS options are set"
                    ));
                }
                Some(other) => {
                    return Err(format!(
                        "--etcd-endpoints: '{e}' has scheme '{other}' (expected http or https)"
                    ));
                }
            }
        }
        if let Some(p) = &self.prefix
            && !(p.starts_with('/') && p.ends_with('/'))
        {
            return Err(format!(
                "--etcd-prefix must start and end with '/' (got '{p}'), so that prefixes never overlap"
            ));
        }
        if let Some(ms) = self.lease_ttl_ms
            && !(1000..=600_000).contains(&ms)
        {
            return Err(format!(
                "--lease-ttl-ms must be between 1000 and 600000 (got {ms})"
            ));
        }
        if let Some(a) = &self.advertise_addr {
            let ok = a
                .rsplit_once(':')
                .is_some_and(|(host, port)| !host.is_empty() && port.parse::<u16>().is_ok())
                && !a.contains(['/', ' ', ',']);
            if !ok {
                return Err(format!("--advertise-addr: '{a}' is not host:port"));
            }
        }
        match (&self.cert, &self.key) {
            (Some(_), None) => return Err("--etcd-cert needs --etcd-key".into()),
            (None, Some(_)) => return Err("--etcd-key needs --etcd-cert".into()),
            _ => {}
        }
        match (&self.user, &self.password_file) {
            (Some(_), None) => return Err("--etcd-user needs --etcd-password-file".into()),
            (None, Some(_)) => return Err("--etcd-password-file needs --etcd-user".into()),
            (Some(u), Some(_)) if u.is_empty() => {
                return Err("--etcd-user must not be empty".into());
            }
            _ => {}
        }
        Ok(())
    }
}

impl Default for Config {
    fn default() -> Self {
        Self {
            listen: SocketAddr::from(([127, 0, 0, 1], muster_proto::DEFAULT_COORDINATOR_PORT)),
            heartbeat_timeout: Duration::from_secs(10),
            last_call: Duration::from_secs(30),
            join_timeout: Duration::from_secs(600),
            max_value_bytes: 8 << 20,
            max_job_bytes: 64 << 20,
            max_message_bytes: 24 << 20,
            max_connections: Self::DEFAULT_MAX_CONNECTIONS,
            max_streams_per_connection: Self::DEFAULT_MAX_STREAMS_PER_CONNECTION,
            max_connections_per_peer: Self::DEFAULT_MAX_CONNECTIONS_PER_PEER,
            handshake_timeout: Self::DEFAULT_HANDSHAKE_TIMEOUT,
            max_total_bytes: Self::DEFAULT_MAX_TOTAL_BYTES,
            max_jobs: Self::DEFAULT_MAX_JOBS,
            nccl_ranks_per_root: muster_core::nccl::DEFAULT_RANKS_PER_ROOT,
            finished_job_ttl: Self::DEFAULT_FINISHED_JOB_TTL,
            store: StoreKind::Memory,
            etcd: EtcdConfig::default(),
            metrics_addr: None,
            web_addr: None,
            health_addr: None,
            tls: TlsConfig::default(),
            auth_token_file: None,
            auth: Auth::off(),
            insecure: false,
        }
    }
}

/// One layer of settings (a file, the environment or the flags): only what it sets.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Layer {
    /// `listen = "0.0.0.0:29470"`.
    pub listen: Option<SocketAddr>,
    /// `heartbeat_timeout_ms = 10000`.
    pub heartbeat_timeout_ms: Option<u64>,
    /// `last_call_ms = 30000`.
    pub last_call_ms: Option<u64>,
    /// `join_timeout_ms = 600000`.
    pub join_timeout_ms: Option<u64>,
    /// `max_value_bytes = 8388608`.
    pub max_value_bytes: Option<usize>,
    /// `max_job_bytes = 67108864`.
    pub max_job_bytes: Option<usize>,
    /// `max_message_bytes = 25165824`.
    pub max_message_bytes: Option<usize>,
    /// `max_connections = 16384`.
    pub max_connections: Option<usize>,
    /// `max_streams_per_connection = 16384`.
    pub max_streams_per_connection: Option<u32>,
    /// `max_connections_per_peer = 1024`.
    pub max_connections_per_peer: Option<usize>,
    /// `handshake_timeout_ms = 5000`.
    pub handshake_timeout_ms: Option<u64>,
    /// `max_total_bytes = 1073741824`.
    pub max_total_bytes: Option<usize>,
    /// `max_jobs = 10000`.
    pub max_jobs: Option<usize>,
    /// `nccl_ranks_per_root = 128`.
    pub nccl_ranks_per_root: Option<u32>,
    /// `finished_job_ttl_ms = 3600000`.
    pub finished_job_ttl_ms: Option<u64>,
    /// `store = "etcd"` (or `"memory"`).
    pub store: Option<StoreKind>,
    /// `etcd_endpoints = ["10.0.0.1:2379", "10.0.0.2:2379"]` (or one comma-separated string).
    pub etcd_endpoints: Option<Endpoints>,
    /// `etcd_prefix = "/muster/"`.
    pub etcd_prefix: Option<String>,
    /// `etcd_ca = "/etc/muster/etcd-ca.pem"`.
    pub etcd_ca: Option<PathBuf>,
    /// `etcd_cert = "/etc/muster/etcd-client.pem"`.
    pub etcd_cert: Option<PathBuf>,
    /// `etcd_key = "/etc/muster/etcd-client-key.pem"`.
    pub etcd_key: Option<PathBuf>,
    /// `etcd_user = "muster"`.
    pub etcd_user: Option<String>,
    /// `etcd_password_file = "/run/secrets/etcd-password"`.
    pub etcd_password_file: Option<PathBuf>,
    /// `advertise_addr = "10.0.0.5:29470"`.
    pub advertise_addr: Option<String>,
    /// `lease_ttl_ms = 3000`.
    pub lease_ttl_ms: Option<u64>,
    /// `metrics_addr = "0.0.0.0:29471"`.
    pub metrics_addr: Option<SocketAddr>,
    /// `web_addr = "127.0.0.1:29473"`.
    pub web_addr: Option<SocketAddr>,
    /// `health_addr = "0.0.0.0:29472"`.
    pub health_addr: Option<SocketAddr>,
    /// `tls_cert = "/etc/muster/tls/server.pem"`.
    pub tls_cert: Option<PathBuf>,
    /// `tls_key = "/etc/muster/tls/server-key.pem"`.
    pub tls_key: Option<PathBuf>,
    /// `tls_client_ca = "/etc/muster/tls/ca.pem"` (mutual TLS).
    pub tls_client_ca: Option<PathBuf>,
    /// `auth_token_file = "/run/credentials/muster-coordinator.service/cluster-token"`.
    pub auth_token_file: Option<PathBuf>,
    /// `insecure = true`: serve a non-loopback address without TLS and authentication.
    pub insecure: Option<bool>,
}

/// etcd endpoints as a config file writes them: a list, or one comma-separated string (as on
/// the command line and in the environment).
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(untagged)]
pub enum Endpoints {
    /// `["a:2379", "b:2379"]`.
    List(Vec<String>),
    /// `"a:2379,b:2379"`.
    Joined(String),
}

impl Endpoints {
    /// The endpoints, trimmed, empty entries dropped.
    pub fn to_vec(&self) -> Vec<String> {
        let items: Vec<&str> = match self {
            Self::List(v) => v.iter().flat_map(|s| s.split(',')).collect(),
            Self::Joined(s) => s.split(',').collect(),
        };
        items
            .into_iter()
            .map(str::trim)
            .filter(|s| !s.is_empty())
            .map(str::to_owned)
            .collect()
    }
}

impl std::str::FromStr for Endpoints {
    type Err = std::convert::Infallible;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Ok(Self::Joined(s.to_owned()))
    }
}

impl Layer {
    /// Reads a TOML file; errors name the file and the problem.
    pub fn from_file(path: &Path) -> Result<Self, String> {
        let text = std::fs::read_to_string(path)
            .map_err(|e| format!("cannot read config file {}: {e}", path.display()))?;
        Self::from_toml_str(&text).map_err(|e| format!("config file {}: {e}", path.display()))
    }

    /// Parses a config file's text (the fuzz target `config` feeds it arbitrary input); the
    /// error is the parser's message, one line.
    pub fn from_toml_str(text: &str) -> Result<Self, String> {
        toml::from_str(text).map_err(|e: toml::de::Error| {
            e.message().split_whitespace().collect::<Vec<_>>().join(" ")
        })
    }

    /// Reads `MUSTER_COORDINATOR_<FIELD>` variables through `get` (the process environment in
    /// production, a map in tests).
    pub fn from_env(get: impl Fn(&str) -> Option<String>) -> Result<Self, String> {
        fn parse<T: std::str::FromStr>(
            get: &impl Fn(&str) -> Option<String>,
            name: &str,
        ) -> Result<Option<T>, String>
        where
            T::Err: std::fmt::Display,
        {
            match get(name) {
                None => Ok(None),
                Some(v) => v
                    .parse()
                    .map(Some)
                    .map_err(|e| format!("environment variable {name}={v:?}: {e}")),
            }
        }
        Ok(Self {
            listen: parse(&get, "MUSTER_COORDINATOR_LISTEN")?,
            heartbeat_timeout_ms: parse(&get, "MUSTER_COORDINATOR_HEARTBEAT_TIMEOUT_MS")?,
            last_call_ms: parse(&get, "MUSTER_COORDINATOR_LAST_CALL_MS")?,
            join_timeout_ms: parse(&get, "MUSTER_COORDINATOR_JOIN_TIMEOUT_MS")?,
            max_value_bytes: parse(&get, "MUSTER_COORDINATOR_MAX_VALUE_BYTES")?,
            max_job_bytes: parse(&get, "MUSTER_COORDINATOR_MAX_JOB_BYTES")?,
            max_message_bytes: parse(&get, "MUSTER_COORDINATOR_MAX_MESSAGE_BYTES")?,
            max_connections: parse(&get, "MUSTER_COORDINATOR_MAX_CONNECTIONS")?,
            max_streams_per_connection: parse(
                &get,
                "MUSTER_COORDINATOR_MAX_STREAMS_PER_CONNECTION",
            )?,
            max_connections_per_peer: parse(&get, "MUSTER_COORDINATOR_MAX_CONNECTIONS_PER_PEER")?,
            handshake_timeout_ms: parse(&get, "MUSTER_COORDINATOR_HANDSHAKE_TIMEOUT_MS")?,
            max_total_bytes: parse(&get, "MUSTER_COORDINATOR_MAX_TOTAL_BYTES")?,
            max_jobs: parse(&get, "MUSTER_COORDINATOR_MAX_JOBS")?,
            nccl_ranks_per_root: parse(&get, "MUSTER_COORDINATOR_NCCL_RANKS_PER_ROOT")?,
            finished_job_ttl_ms: parse(&get, "MUSTER_COORDINATOR_FINISHED_JOB_TTL_MS")?,
            store: parse(&get, "MUSTER_COORDINATOR_STORE")?,
            etcd_endpoints: parse(&get, "MUSTER_COORDINATOR_ETCD_ENDPOINTS")?,
            etcd_prefix: get("MUSTER_COORDINATOR_ETCD_PREFIX"),
            etcd_ca: get("MUSTER_COORDINATOR_ETCD_CA").map(PathBuf::from),
            etcd_cert: get("MUSTER_COORDINATOR_ETCD_CERT").map(PathBuf::from),
            etcd_key: get("MUSTER_COORDINATOR_ETCD_KEY").map(PathBuf::from),
            etcd_user: get("MUSTER_COORDINATOR_ETCD_USER"),
            etcd_password_file: get("MUSTER_COORDINATOR_ETCD_PASSWORD_FILE").map(PathBuf::from),
            advertise_addr: get("MUSTER_COORDINATOR_ADVERTISE_ADDR"),
            lease_ttl_ms: parse(&get, "MUSTER_COORDINATOR_LEASE_TTL_MS")?,
            metrics_addr: parse(&get, "MUSTER_COORDINATOR_METRICS_ADDR")?,
            web_addr: parse(&get, "MUSTER_COORDINATOR_WEB_ADDR")?,
            health_addr: parse(&get, "MUSTER_COORDINATOR_HEALTH_ADDR")?,
            tls_cert: get("MUSTER_COORDINATOR_TLS_CERT").map(PathBuf::from),
            tls_key: get("MUSTER_COORDINATOR_TLS_KEY").map(PathBuf::from),
            tls_client_ca: get("MUSTER_COORDINATOR_TLS_CLIENT_CA").map(PathBuf::from),
            auth_token_file: get("MUSTER_COORDINATOR_AUTH_TOKEN_FILE").map(PathBuf::from),
            insecure: parse(&get, "MUSTER_COORDINATOR_INSECURE")?,
        })
    }
}

impl Config {
    /// Connections served at once unless configured: far above one agent per machine plus
    /// admins, far below the file descriptors a coordinator is given (see deploy/).
    pub const DEFAULT_MAX_CONNECTIONS: usize = 16384;

    /// Streams per connection unless configured: enough for the scale bench (10 000 nodes'
    /// joins or 4096 ranks' sessions over 8 connections) with room to spare.
    pub const DEFAULT_MAX_STREAMS_PER_CONNECTION: u32 = 16384;

    /// Connections from one peer address unless configured: an agent and its workers (one
    /// connection each) fit many times over, yet one host cannot take more than a sixteenth
    /// of [`Config::DEFAULT_MAX_CONNECTIONS`].
    pub const DEFAULT_MAX_CONNECTIONS_PER_PEER: usize = 1024;

    /// How long a new connection may take to finish its TLS and HTTP/2 handshakes and send
    /// its first call unless configured: far above a real client's round trips.
    pub const DEFAULT_HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(5);

    /// Stored bytes over all jobs unless configured: 16 jobs at the per-job default.
    pub const DEFAULT_MAX_TOTAL_BYTES: usize = 1 << 30;

    /// Jobs held at once unless configured.
    pub const DEFAULT_MAX_JOBS: usize = 10_000;

    /// How long a job in a final state is kept unless configured: long enough for operators
    /// and `submit --wait` to read its outcome.
    pub const DEFAULT_FINISHED_JOB_TTL: Duration = Duration::from_secs(3600);

    /// Largest HTTP/2 header list (all metadata of one call) the coordinator accepts; muster's
    /// clients send a few hundred bytes.
    pub const MAX_HEADER_LIST_BYTES: u32 = 16 << 10;

    /// Applies a layer on top of this configuration.
    pub fn apply(mut self, l: &Layer) -> Self {
        let ms = Duration::from_millis;
        if let Some(v) = l.listen {
            self.listen = v;
        }
        if let Some(v) = l.heartbeat_timeout_ms {
            self.heartbeat_timeout = ms(v);
        }
        if let Some(v) = l.last_call_ms {
            self.last_call = ms(v);
        }
        if let Some(v) = l.join_timeout_ms {
            self.join_timeout = ms(v);
        }
        if let Some(v) = l.max_value_bytes {
            self.max_value_bytes = v;
        }
        if let Some(v) = l.max_job_bytes {
            self.max_job_bytes = v;
        }
        if let Some(v) = l.max_message_bytes {
            self.max_message_bytes = v;
        }
        if let Some(v) = l.max_connections {
            self.max_connections = v;
        }
        if let Some(v) = l.max_streams_per_connection {
            self.max_streams_per_connection = v;
        }
        if let Some(v) = l.max_connections_per_peer {
            self.max_connections_per_peer = v;
        }
        if let Some(v) = l.handshake_timeout_ms {
            self.handshake_timeout = ms(v);
        }
        if let Some(v) = l.max_total_bytes {
            self.max_total_bytes = v;
        }
        if let Some(v) = l.max_jobs {
            self.max_jobs = v;
        }
        if let Some(v) = l.nccl_ranks_per_root {
            self.nccl_ranks_per_root = v;
        }
        if let Some(v) = l.finished_job_ttl_ms {
            self.finished_job_ttl = ms(v);
        }
        if let Some(v) = l.store {
            self.store = v;
        }
        if let Some(v) = &l.etcd_endpoints {
            self.etcd.endpoints = v.to_vec();
        }
        let etcd = &mut self.etcd;
        for (to, from) in [
            (&mut etcd.ca, &l.etcd_ca),
            (&mut etcd.cert, &l.etcd_cert),
            (&mut etcd.key, &l.etcd_key),
            (&mut etcd.password_file, &l.etcd_password_file),
        ] {
            if from.is_some() {
                to.clone_from(from);
            }
        }
        if l.etcd_prefix.is_some() {
            etcd.prefix.clone_from(&l.etcd_prefix);
        }
        if l.etcd_user.is_some() {
            etcd.user.clone_from(&l.etcd_user);
        }
        if l.advertise_addr.is_some() {
            etcd.advertise_addr.clone_from(&l.advertise_addr);
        }
        if l.lease_ttl_ms.is_some() {
            etcd.lease_ttl_ms = l.lease_ttl_ms;
        }
        if l.metrics_addr.is_some() {
            self.metrics_addr = l.metrics_addr;
        }
        if l.health_addr.is_some() {
            self.health_addr = l.health_addr;
        }
        if l.web_addr.is_some() {
            self.web_addr = l.web_addr;
        }
        for (to, from) in [
            (&mut self.tls.cert, &l.tls_cert),
            (&mut self.tls.key, &l.tls_key),
            (&mut self.tls.client_ca, &l.tls_client_ca),
            (&mut self.auth_token_file, &l.auth_token_file),
        ] {
            if from.is_some() {
                to.clone_from(from);
            }
        }
        if let Some(v) = l.insecure {
            self.insecure = v;
        }
        self
    }

    /// The safe default: a listener on `addr` that other machines can reach (not loopback)
    /// needs TLS and authentication, unless `--insecure` says otherwise.
    pub fn check_exposure(&self, addr: SocketAddr) -> Result<(), String> {
        let auth = self.auth.is_on() || self.auth_token_file.is_some();
        if addr.ip().is_loopback() || self.insecure || (self.tls.is_on() && auth) {
            return Ok(());
        }
        let missing = match (self.tls.is_on(), auth) {
            (false, false) => "TLS (--tls-cert, --tls-key) and authentication (--auth-token-file)",
            (false, true) => "TLS (--tls-cert, --tls-key)",
            _ => "authentication (--auth-token-file)",
        };
        Err(format!(
            "refusing to serve {addr} without {missing}: anyone who can reach it could join jobs and read their NCCL unique ids; pass --insecure to do it anyway"
        ))
    }

    /// Checks the whole configuration; the error is one line naming the setting.
    pub fn validate(&self) -> Result<(), String> {
        if self.heartbeat_timeout < Duration::from_millis(100) {
            return Err(format!(
                "heartbeat_timeout_ms must be at least 100 (got {})",
                self.heartbeat_timeout.as_millis()
            ));
        }
        if self.join_timeout.is_zero() {
            return Err("join_timeout_ms must be greater than 0".into());
        }
        if self.max_value_bytes == 0 || self.max_value_bytes > self.max_job_bytes {
            return Err(format!(
                "max_value_bytes ({}) must be between 1 and max_job_bytes ({})",
                self.max_value_bytes, self.max_job_bytes
            ));
        }
        if self.max_message_bytes < 2 * self.max_value_bytes + (64 << 10) {
            return Err(format!(
                "max_message_bytes ({}) must be at least twice max_value_bytes ({}) plus 65536, so that a compare-and-set of two largest values and its key fit in one message",
                self.max_message_bytes, self.max_value_bytes
            ));
        }
        if self.max_message_bytes < 64 << 10 {
            return Err(format!(
                "max_message_bytes must be at least 65536 (got {})",
                self.max_message_bytes
            ));
        }
        if self.max_message_bytes > 1 << 30 {
            return Err(format!(
                "max_message_bytes must be at most 1073741824 (got {})",
                self.max_message_bytes
            ));
        }
        if !(1..=1 << 20).contains(&self.max_connections) {
            return Err(format!(
                "max_connections must be between 1 and 1048576 (got {})",
                self.max_connections
            ));
        }
        if !(1..=1 << 20).contains(&self.max_streams_per_connection) {
            return Err(format!(
                "max_streams_per_connection must be between 1 and 1048576 (got {})",
                self.max_streams_per_connection
            ));
        }
        if !(1..=1 << 20).contains(&self.max_connections_per_peer) {
            return Err(format!(
                "max_connections_per_peer must be between 1 and 1048576 (got {})",
                self.max_connections_per_peer
            ));
        }
        if !(Duration::from_millis(10)..=Duration::from_secs(600)).contains(&self.handshake_timeout)
        {
            return Err(format!(
                "handshake_timeout_ms must be between 10 and 600000 (got {})",
                self.handshake_timeout.as_millis()
            ));
        }
        if self.max_total_bytes < self.max_job_bytes {
            return Err(format!(
                "max_total_bytes ({}) must be at least max_job_bytes ({})",
                self.max_total_bytes, self.max_job_bytes
            ));
        }
        if !(1..=1_000_000).contains(&self.max_jobs) {
            return Err(format!(
                "max_jobs must be between 1 and 1000000 (got {})",
                self.max_jobs
            ));
        }
        if !(Duration::from_millis(1)..=Duration::from_secs(30 * 24 * 3600))
            .contains(&self.finished_job_ttl)
        {
            return Err(format!(
                "finished_job_ttl_ms must be between 1 and 2592000000 (30 days; got {})",
                self.finished_job_ttl.as_millis()
            ));
        }
        if let Some(m) = self.metrics_addr
            && m.port() != 0
            && m == self.listen
        {
            return Err(format!(
                "metrics_addr ({m}) must differ from the gRPC listen address"
            ));
        }
        if let Some(h) = self.health_addr
            && h.port() != 0
            && (h == self.listen || Some(h) == self.metrics_addr)
        {
            return Err(format!(
                "health_addr ({h}) must differ from the gRPC listen and metrics addresses"
            ));
        }
        if let Some(w) = self.web_addr
            && w.port() != 0
            && (w == self.listen || Some(w) == self.metrics_addr || Some(w) == self.health_addr)
        {
            return Err(format!(
                "web_addr ({w}) must differ from the gRPC listen, metrics and health addresses"
            ));
        }
        self.tls.validate()?;
        self.check_exposure(self.listen)?;
        match self.store {
            StoreKind::Memory => {
                if let Some(flag) = self.etcd.first_set() {
                    return Err(format!("{flag} needs --store etcd"));
                }
            }
            StoreKind::Etcd => self.etcd.validate()?,
        }
        Ok(())
    }

    /// How often workers should send heartbeats: a third of the timeout
    /// ([`muster_core::failure::HEARTBEATS_PER_TIMEOUT`]).
    pub fn heartbeat_interval(&self) -> Duration {
        self.heartbeat_timeout / muster_core::failure::HEARTBEATS_PER_TIMEOUT
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use std::collections::HashMap;

    #[test]
    fn layers_apply_in_order() {
        let file: Layer =
            toml::from_str("listen = \"0.0.0.0:1\"\nheartbeat_timeout_ms = 5000\ninsecure = true")
                .unwrap();
        let env: HashMap<&str, &str> = [("MUSTER_COORDINATOR_HEARTBEAT_TIMEOUT_MS", "2000")].into();
        let env = Layer::from_env(|k| env.get(k).map(|v| v.to_string())).unwrap();
        let c = Config::default().apply(&file).apply(&env);
        assert_eq!(c.listen.port(), 1);
        assert_eq!(c.heartbeat_timeout, Duration::from_secs(2));
        c.validate().unwrap();
    }

    #[test]
    fn security_settings_layer_and_validate() {
        let file: Layer = toml::from_str(
            "listen = \"0.0.0.0:29470\"\ntls_cert = \"/c.pem\"\ntls_key = \"/k.pem\"\nhealth_addr = \"0.0.0.0:29472\"",
        )
        .unwrap();
        let c = Config::default().apply(&file);
        assert!(c.tls.is_on());
        let e = c.validate().unwrap_err();
        assert!(
            e.starts_with("refusing to serve 0.0.0.0:29470 without authentication"),
            "{e}"
        );
        let env: HashMap<&str, &str> = [
            ("MUSTER_COORDINATOR_AUTH_TOKEN_FILE", "/run/token"),
            ("MUSTER_COORDINATOR_TLS_CLIENT_CA", "/ca.pem"),
        ]
        .into();
        let c = c.apply(&Layer::from_env(|k| env.get(k).map(|v| v.to_string())).unwrap());
        c.validate().unwrap();
        assert_eq!(c.tls.client_ca.as_deref(), Some(Path::new("/ca.pem")));
        for (layer, error) in [
            ("tls_cert = \"/c\"", "--tls-cert needs --tls-key"),
            ("tls_key = \"/k\"", "--tls-key needs --tls-cert"),
            ("tls_client_ca = \"/a\"", "--tls-client-ca needs"),
            (
                "health_addr = \"127.0.0.1:29470\"",
                "health_addr (127.0.0.1:29470) must differ",
            ),
        ] {
            let c = Config::default().apply(&toml::from_str(layer).unwrap());
            assert!(c.validate().unwrap_err().contains(error), "{layer}");
        }
        // Loopback needs nothing; --insecure opens the rest.
        Config::default().validate().unwrap();
        let insecure = Layer::from_env(|k| {
            (k == "MUSTER_COORDINATOR_INSECURE" || k == "MUSTER_COORDINATOR_LISTEN").then(|| {
                if k.ends_with("INSECURE") {
                    "true"
                } else {
                    "0.0.0.0:1"
                }
                .into()
            })
        })
        .unwrap();
        Config::default().apply(&insecure).validate().unwrap();
    }

    #[test]
    fn bad_settings_are_named() {
        assert!(toml::from_str::<Layer>("nonsense = 1").is_err());
        let env = Layer::from_env(|k| (k == "MUSTER_COORDINATOR_LISTEN").then(|| "x".into()));
        assert!(env.unwrap_err().contains("MUSTER_COORDINATOR_LISTEN"));
        let c = Config::default().apply(&Layer {
            heartbeat_timeout_ms: Some(1),
            ..Layer::default()
        });
        assert!(c.validate().unwrap_err().contains("heartbeat_timeout_ms"));
    }

    #[test]
    fn store_settings_layer_and_validate() {
        let file: Layer = toml::from_str(
            "store = \"etcd\"\netcd_endpoints = [\"10.0.0.1:2379\", \"https://e2:2379\"]\netcd_prefix = \"/a/\"\netcd_ca = \"/ca.pem\"",
        )
        .unwrap();
        let c = Config::default().apply(&file);
        assert_eq!(c.store, StoreKind::Etcd);
        assert_eq!(c.etcd.endpoints, ["10.0.0.1:2379", "https://e2:2379"]);
        assert_eq!(c.etcd.prefix(), "/a/");
        c.validate().unwrap();
        // The environment overrides the file; a joined string is split.
        let env: HashMap<&str, &str> = [
            ("MUSTER_COORDINATOR_ETCD_ENDPOINTS", " e1:1, e2:2 ,"),
            ("MUSTER_COORDINATOR_ETCD_USER", "muster"),
            ("MUSTER_COORDINATOR_ETCD_PASSWORD_FILE", "/run/pw"),
        ]
        .into();
        let env = Layer::from_env(|k| env.get(k).map(|v| v.to_string())).unwrap();
        let c = c.apply(&env);
        assert_eq!(c.etcd.endpoints, ["e1:1", "e2:2"]);
        assert_eq!(c.etcd.user.as_deref(), Some("muster"));
        c.validate().unwrap();
        assert_eq!(Config::default().etcd.prefix(), EtcdConfig::DEFAULT_PREFIX);
        assert!(toml::from_str::<Layer>("store = \"disk\"").is_err());
    }

    #[test]
    fn metrics_addr_layers_and_validates() {
        let file: Layer = toml::from_str("metrics_addr = \"127.0.0.1:9100\"").unwrap();
        let c = Config::default().apply(&file);
        assert_eq!(c.metrics_addr, Some("127.0.0.1:9100".parse().unwrap()));
        c.validate().unwrap();
        let env: HashMap<&str, &str> = [("MUSTER_COORDINATOR_METRICS_ADDR", "0.0.0.0:9101")].into();
        let c = c.apply(&Layer::from_env(|k| env.get(k).map(|v| v.to_string())).unwrap());
        assert_eq!(c.metrics_addr.unwrap().port(), 9101);
        let bad: HashMap<&str, &str> = [("MUSTER_COORDINATOR_METRICS_ADDR", "nowhere")].into();
        let e = Layer::from_env(|k| bad.get(k).map(|v| v.to_string())).unwrap_err();
        assert!(e.contains("MUSTER_COORDINATOR_METRICS_ADDR"), "{e}");
        let same = Config {
            metrics_addr: Some(Config::default().listen),
            ..Config::default()
        };
        assert!(same.validate().unwrap_err().contains("metrics_addr"));
    }

    #[test]
    fn web_addr_layers_and_validates() {
        let file: Layer = toml::from_str("web_addr = \"127.0.0.1:9200\"").unwrap();
        let c = Config::default().apply(&file);
        assert_eq!(c.web_addr, Some("127.0.0.1:9200".parse().unwrap()));
        c.validate().unwrap();
        let env: HashMap<&str, &str> = [("MUSTER_COORDINATOR_WEB_ADDR", "0.0.0.0:9201")].into();
        let c = c.apply(&Layer::from_env(|k| env.get(k).map(|v| v.to_string())).unwrap());
        assert_eq!(c.web_addr.unwrap().port(), 9201);
        let bad: HashMap<&str, &str> = [("MUSTER_COORDINATOR_WEB_ADDR", "nowhere")].into();
        let e = Layer::from_env(|k| bad.get(k).map(|v| v.to_string())).unwrap_err();
        assert!(e.contains("MUSTER_COORDINATOR_WEB_ADDR"), "{e}");
        let m: SocketAddr = "127.0.0.1:9100".parse().unwrap();
        for clash in [
            Config {
                web_addr: Some(Config::default().listen),
                ..Config::default()
            },
            Config {
                metrics_addr: Some(m),
                web_addr: Some(m),
                ..Config::default()
            },
            Config {
                health_addr: Some(m),
                web_addr: Some(m),
                ..Config::default()
            },
        ] {
            let e = clash.validate().unwrap_err();
            assert!(e.starts_with("web_addr (127.0.0.1:"), "{e}");
        }
        // Port 0 (any free port) never clashes.
        Config {
            metrics_addr: Some("127.0.0.1:0".parse().unwrap()),
            web_addr: Some("127.0.0.1:0".parse().unwrap()),
            ..Config::default()
        }
        .validate()
        .unwrap();
    }

    #[test]
    fn limits_layer_and_validate() {
        let file =
            Layer::from_toml_str("max_connections = 8\nmax_streams_per_connection = 4").unwrap();
        let c = Config::default().apply(&file);
        assert_eq!((c.max_connections, c.max_streams_per_connection), (8, 4));
        c.validate().unwrap();
        let env: HashMap<&str, &str> = [
            ("MUSTER_COORDINATOR_MAX_CONNECTIONS", "2"),
            ("MUSTER_COORDINATOR_MAX_STREAMS_PER_CONNECTION", "3"),
        ]
        .into();
        let c = c.apply(&Layer::from_env(|k| env.get(k).map(|v| v.to_string())).unwrap());
        assert_eq!((c.max_connections, c.max_streams_per_connection), (2, 3));
        let file = Layer::from_toml_str(
            "max_connections_per_peer = 7\nhandshake_timeout_ms = 250\nmax_total_bytes = 134217728\nmax_jobs = 9\nfinished_job_ttl_ms = 60000\nnccl_ranks_per_root = 2",
        )
        .unwrap();
        let c = Config::default().apply(&file);
        assert_eq!(c.nccl_ranks_per_root, 2);
        assert_eq!(c.max_connections_per_peer, 7);
        assert_eq!(c.handshake_timeout, Duration::from_millis(250));
        assert_eq!((c.max_total_bytes, c.max_jobs), (128 << 20, 9));
        assert_eq!(c.finished_job_ttl, Duration::from_secs(60));
        c.validate().unwrap();
        let env: HashMap<&str, &str> = [
            ("MUSTER_COORDINATOR_MAX_JOBS", "5"),
            ("MUSTER_COORDINATOR_FINISHED_JOB_TTL_MS", "10"),
            ("MUSTER_COORDINATOR_HANDSHAKE_TIMEOUT_MS", "100"),
            ("MUSTER_COORDINATOR_NCCL_RANKS_PER_ROOT", "0"),
        ]
        .into();
        let c = c.apply(&Layer::from_env(|k| env.get(k).map(|v| v.to_string())).unwrap());
        assert_eq!(c.nccl_ranks_per_root, 0);
        assert_eq!(
            (c.max_jobs, c.finished_job_ttl),
            (5, Duration::from_millis(10))
        );
        assert_eq!(c.handshake_timeout, Duration::from_millis(100));
        for (toml, field) in [
            ("max_connections = 0", "max_connections"),
            (
                "max_streams_per_connection = 0",
                "max_streams_per_connection",
            ),
            ("max_message_bytes = 2147483648", "max_message_bytes"),
            // The old default: too small for the default largest value (torch's 8 MiB).
            ("max_message_bytes = 4194304", "max_value_bytes"),
            ("max_connections_per_peer = 0", "max_connections_per_peer"),
            ("handshake_timeout_ms = 0", "handshake_timeout_ms"),
            ("max_total_bytes = 1024", "max_total_bytes"),
            ("max_jobs = 0", "max_jobs"),
            ("finished_job_ttl_ms = 0", "finished_job_ttl_ms"),
        ] {
            let c = Config::default().apply(&Layer::from_toml_str(toml).unwrap());
            let e = c.validate().unwrap_err();
            assert!(e.contains(field) && !e.contains('\n'), "{e}");
        }
        let e = Layer::from_toml_str("max_connections = -1\n[x\n").unwrap_err();
        assert!(!e.contains('\n'), "{e}");
    }

    #[test]
    fn bad_store_settings_are_named() {
        let etcd = |f: &dyn Fn(&mut EtcdConfig)| {
            let mut c = Config {
                store: StoreKind::Etcd,
                ..Config::default()
            };
            c.etcd.endpoints = vec!["127.0.0.1:2379".into()];
            f(&mut c.etcd);
            c.validate().err().unwrap_or_default()
        };
        let memory = |f: &dyn Fn(&mut EtcdConfig)| {
            let mut c = Config::default();
            f(&mut c.etcd);
            c.validate().err().unwrap_or_default()
        };
        assert_eq!(etcd(&|_| {}), "");
        assert!(etcd(&|e| e.endpoints.clear()).contains("needs --etcd-endpoints"));
        assert!(etcd(&|e| e.endpoints = vec!["h".into()]).contains("'h' is not host:port"));
        assert!(etcd(&|e| e.endpoints = vec![":1".into()]).contains("not host:port"));
        assert!(etcd(&|e| e.endpoints = vec!["h:1/x".into()]).contains("not host:port"));
        assert_eq!(etcd(&|e| e.endpoints = vec!["http://h:1/".into()]), "");
        assert!(etcd(&|e| e.endpoints = vec!["unix://h:1".into()]).contains("scheme 'unix'"));
        assert!(
            etcd(&|e| {
                e.endpoints = vec!["http://h:1".into()];
                e.ca = Some("/ca".into());
            })
            .contains("plain http")
        );
        assert!(etcd(&|e| e.endpoints = vec!["https://h:1".into()]).contains("needs --etcd-ca"));
        assert_eq!(
            etcd(&|e| {
                e.endpoints = vec!["https://h:1".into()];
                e.ca = Some("/ca".into());
            }),
            ""
        );
        assert!(etcd(&|e| e.prefix = Some("/a".into())).contains("--etcd-prefix"));
        assert!(etcd(&|e| e.prefix = Some(String::new())).contains("--etcd-prefix"));
        assert!(etcd(&|e| e.cert = Some("/c".into())).contains("--etcd-cert needs --etcd-key"));
        assert!(etcd(&|e| e.key = Some("/k".into())).contains("--etcd-key needs --etcd-cert"));
        assert!(etcd(&|e| e.user = Some("u".into())).contains("needs --etcd-password-file"));
        assert!(etcd(&|e| e.password_file = Some("/p".into())).contains("needs --etcd-user"));
        assert_eq!(memory(&|_| {}), "");
        assert_eq!(
            memory(&|e| e.endpoints = vec!["a:1".into()]),
            "--etcd-endpoints needs --store etcd"
        );
        assert_eq!(
            memory(&|e| e.password_file = Some("/p".into())),
            "--etcd-password-file needs --store etcd"
        );
    }
}
