//! deploy/: the systemd units pass `systemd-analyze verify`, the binaries speak systemd's
//! notify protocol (READY, WATCHDOG, STOPPING), the Kubernetes manifests parse and name only
//! flags, ports and variables the binaries have, and SIGTERM drains a coordinator with a
//! waiting client well within Kubernetes' grace period. Every deployment serves mutual TLS and
//! the cluster token: the files the configurations name are systemd credentials or mounted
//! Secrets, probes use the plaintext health port, and a coordinator and an agent started from
//! the systemd and Kubernetes files (with a test PKI in place of the credentials and Secrets)
//! find each other.
#![allow(clippy::unwrap_used, clippy::expect_used, missing_docs)]

use muster_coordinator::config::{Config, Layer};
use muster_proto::security::{ClientSecurity, Credentials, read_token_file};
use muster_proto::v1 as pb;
use muster_tests::notify::NotifySocket;
use muster_tests::pki::Pki;
use muster_tests::{
    agent_bin, coordinator::Coordinator, coordinator_bin, has_flag, help_of, workspace_root,
};
use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;
use std::collections::{BTreeSet, HashMap};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};
use yaml_rust2::{Yaml, YamlLoader};

/// How long a SIGTERMed coordinator may take to exit; the manifests' coordinator pods must
/// give at least this much (`terminationGracePeriodSeconds`), and Kubernetes' default is 30 s.
const COORDINATOR_DRAIN_BOUND: Duration = Duration::from_secs(5);
/// How long `muster-agent serve` takes beyond its workers' grace period to exit on SIGTERM
/// (daemon.rs waits grace + 3 s per job), plus a margin.
const AGENT_DRAIN_OVER_GRACE: Duration = Duration::from_secs(5);

/// A scratch directory removed on drop.
struct TempDir(PathBuf);

impl TempDir {
    fn new(tag: &str) -> Self {
        static NEXT: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
        let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let dir =
            std::env::temp_dir().join(format!("muster-deploy-{tag}-{}-{n}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        Self(dir)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// A child process killed on drop (unless it was waited for).
struct Proc(Child);

impl Proc {
    fn pid(&self) -> Pid {
        Pid::from_raw(i32::try_from(self.0.id()).unwrap())
    }

    fn signal(&self, s: Signal) {
        kill(self.pid(), s).unwrap();
    }

    /// Waits up to `limit` for the exit; `None` if it is still running then.
    fn wait_within(&mut self, limit: Duration) -> Option<ExitStatus> {
        let t = Instant::now();
        while t.elapsed() < limit {
            if let Some(status) = self.0.try_wait().unwrap() {
                return Some(status);
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        None
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

fn wait_until_accepting(addr: &str, limit: Duration) {
    let t = Instant::now();
    while std::net::TcpStream::connect(addr).is_err() {
        assert!(t.elapsed() < limit, "{addr} accepts no connection");
        std::thread::sleep(Duration::from_millis(10));
    }
}

// ----------------------------------------------------------------------------------------
// systemd
// ----------------------------------------------------------------------------------------

/// Copies deploy/systemd's units (and their drop-in directories) into a scratch directory with
/// ExecStart pointing at the built binaries, as `systemd-analyze verify` checks that it exists.
fn units_with_built_binaries(dir: &Path) -> Vec<PathBuf> {
    let src = workspace_root().join("deploy/systemd");
    let coordinator = coordinator_bin();
    let agent = agent_bin();
    let mut units = vec![];
    for entry in std::fs::read_dir(&src).unwrap() {
        let path = entry.unwrap().path();
        let name = path.file_name().unwrap().to_owned();
        if path.is_dir() && path.extension().is_some_and(|e| e == "d") {
            std::fs::create_dir_all(dir.join(&name)).unwrap();
            for f in std::fs::read_dir(&path).unwrap() {
                let f = f.unwrap().path();
                std::fs::copy(&f, dir.join(&name).join(f.file_name().unwrap())).unwrap();
            }
        } else if path.extension().is_some_and(|e| e == "service") {
            let text = std::fs::read_to_string(&path).unwrap();
            assert!(
                text.starts_with('#'),
                "{} starts with a comment",
                path.display()
            );
            let rewritten = text
                .replace(
                    "/usr/local/bin/muster-coordinator",
                    coordinator.to_str().unwrap(),
                )
                .replace("/usr/local/bin/muster-agent", agent.to_str().unwrap());
            assert_ne!(
                rewritten,
                text,
                "{} runs /usr/local/bin/muster-*",
                path.display()
            );
            let out = dir.join(&name);
            std::fs::write(&out, rewritten).unwrap();
            units.push(out);
        }
    }
    units.sort();
    units
}

/// The value of every `Key=` line of a unit file.
fn unit_values<'a>(text: &'a str, key: &str) -> Vec<&'a str> {
    text.lines()
        .filter_map(|l| l.trim().strip_prefix(key)?.strip_prefix('='))
        .collect()
}

#[test]
fn systemd_units_pass_systemd_analyze_verify() {
    if Command::new("systemd-analyze")
        .arg("--version")
        .output()
        .is_err()
    {
        eprintln!(
            "skipped: systemd-analyze is not installed (scripts/install-deps.sh installs it)"
        );
        return;
    }
    let dir = TempDir::new("units");
    let units = units_with_built_binaries(&dir.0);
    let names: Vec<_> = units
        .iter()
        .map(|u| u.file_name().unwrap().to_str().unwrap().to_owned())
        .collect();
    assert_eq!(
        names,
        ["muster-agent.service", "muster-coordinator.service"],
        "the units under deploy/systemd"
    );
    let out = Command::new("systemd-analyze")
        .arg("verify")
        .args(&units)
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "systemd-analyze verify: {stderr}");
    // verify exits 0 on unknown keys and unparsable values (it ignores them): any line about
    // our units or drop-ins is a mistake.
    let ours: Vec<_> = stderr
        .lines()
        .filter(|l| l.contains(dir.0.to_str().unwrap()) || l.contains("muster-"))
        .collect();
    assert!(ours.is_empty(), "systemd-analyze verify warns:\n{stderr}");

    for unit in &units {
        let text = std::fs::read_to_string(unit).unwrap();
        let name = unit.display();
        assert_eq!(unit_values(&text, "Type"), ["notify"], "{name}");
        assert_eq!(unit_values(&text, "NotifyAccess"), ["main"], "{name}");
        let watchdog: Vec<u64> = unit_values(&text, "WatchdogSec")
            .iter()
            .map(|v| v.parse().unwrap())
            .collect();
        assert!(
            watchdog.len() == 1 && watchdog[0] > 0,
            "{name}: WatchdogSec {watchdog:?}"
        );
        assert_eq!(unit_values(&text, "Restart"), ["on-failure"], "{name}");
        for key in [
            "NoNewPrivileges",
            "ProtectKernelTunables",
            "ProtectKernelModules",
            "ProtectControlGroups",
        ] {
            assert_eq!(unit_values(&text, key), ["yes"], "{name}: {key}");
        }
        assert!(!unit_values(&text, "SystemCallFilter").is_empty(), "{name}");
        // Every flag of ExecStart exists.
        let exec = unit_values(&text, "ExecStart");
        assert_eq!(exec.len(), 1, "{name}");
        let words: Vec<&str> = exec[0].split_whitespace().collect();
        let help = if words[0].ends_with("muster-agent") {
            help_of("muster-agent", Some(words[1]))
        } else {
            help_of("muster-coordinator", None)
        };
        for flag in words.iter().filter(|w| w.starts_with("--")) {
            assert!(has_flag(&help, flag), "{name}: {flag} is not in --help");
        }
        // Stopping waits long enough for the drain.
        let stop: u64 = unit_values(&text, "TimeoutStopSec")[0].parse().unwrap();
        let needed = if words[0].ends_with("muster-agent") {
            Duration::from_millis(5000) + AGENT_DRAIN_OVER_GRACE
        } else {
            COORDINATOR_DRAIN_BOUND
        };
        assert!(
            Duration::from_secs(stop) >= needed,
            "{name}: TimeoutStopSec"
        );
    }
    // The coordinator runs without privileges; the agent's workers may need what a training
    // job needs (JIT, GPUs), so it must not forbid those.
    let coordinator = std::fs::read_to_string(&units[1]).unwrap();
    assert_eq!(unit_values(&coordinator, "MemoryDenyWriteExecute"), ["yes"]);
    assert_eq!(unit_values(&coordinator, "CapabilityBoundingSet"), [""]);
    assert!(
        unit_values(&coordinator, "RestrictAddressFamilies")
            .iter()
            .any(|v| v.contains("AF_INET6") && v.contains("AF_UNIX"))
    );
    let agent = std::fs::read_to_string(&units[0]).unwrap();
    for key in [
        "MemoryDenyWriteExecute",
        "PrivateDevices",
        "RestrictAddressFamilies",
    ] {
        assert!(unit_values(&agent, key).is_empty(), "the agent sets {key}");
    }
    assert!(
        unit_values(&agent, "SystemCallFilter")
            .iter()
            .all(|v| v.starts_with('~')),
        "the agent's system call filter is a deny list"
    );
}

/// `LoadCredential=NAME:SOURCE` of a unit file (or drop-in): NAME to SOURCE.
fn loaded_credentials(text: &str) -> HashMap<String, String> {
    unit_values(text, "LoadCredential")
        .into_iter()
        .map(|v| {
            let (name, source) = v
                .split_once(':')
                .unwrap_or_else(|| panic!("LoadCredential={v} has no source"));
            (name.to_owned(), source.to_owned())
        })
        .collect()
}

/// The credential a path names, if it is in `unit`'s credentials directory (literally, or as
/// the `%d` specifier).
fn credential_name<'a>(path: &'a str, unit: &str) -> Option<&'a str> {
    path.strip_prefix("%d/").or_else(|| {
        path.strip_prefix("/run/credentials/")?
            .strip_prefix(unit)?
            .strip_prefix('/')
    })
}

/// The files a coordinator configuration reads (TLS, token, etcd), by config key.
fn coordinator_files(config: &Config) -> Vec<(&'static str, PathBuf)> {
    [
        ("tls_cert", &config.tls.cert),
        ("tls_key", &config.tls.key),
        ("tls_client_ca", &config.tls.client_ca),
        ("auth_token_file", &config.auth_token_file),
        ("etcd_ca", &config.etcd.ca),
        ("etcd_cert", &config.etcd.cert),
        ("etcd_key", &config.etcd.key),
        ("etcd_password_file", &config.etcd.password_file),
    ]
    .into_iter()
    .filter_map(|(key, p)| Some((key, p.clone()?)))
    .collect()
}

/// A deployed coordinator serves mutual TLS and requires the cluster token.
fn assert_secured(at: &str, config: &Config) {
    assert!(!config.insecure, "{at}: insecure");
    assert!(config.tls.is_on(), "{at}: no tls_cert/tls_key");
    assert!(
        config.tls.client_ca.is_some(),
        "{at}: no tls_client_ca (mutual TLS)"
    );
    assert!(config.auth_token_file.is_some(), "{at}: no auth_token_file");
}

#[test]
fn systemd_config_files_are_valid_coordinator_configurations() {
    let dir = workspace_root().join("deploy/systemd");
    // What the unit hands over, and what its etcd drop-in adds.
    let unit = std::fs::read_to_string(dir.join("muster-coordinator.service")).unwrap();
    let unit_credentials = loaded_credentials(&unit);
    let mut with_drop_ins = unit_credentials.clone();
    for entry in std::fs::read_dir(dir.join("muster-coordinator.service.d")).unwrap() {
        let text = std::fs::read_to_string(entry.unwrap().path()).unwrap();
        with_drop_ins.extend(loaded_credentials(&text));
    }
    let mut seen = 0;
    for entry in std::fs::read_dir(&dir).unwrap() {
        let path = entry.unwrap().path();
        if path.extension().is_none_or(|e| e != "toml") {
            continue;
        }
        let at = path.display().to_string();
        let layer = Layer::from_file(&path).unwrap_or_else(|e| panic!("{e}"));
        let config = Config::default().apply(&layer);
        config.validate().unwrap_or_else(|e| panic!("{at}: {e}"));
        assert_eq!(config.listen.port(), 29470, "{at}");
        assert!(
            !config.listen.ip().is_loopback(),
            "{at}: listens on loopback"
        );
        assert_secured(&at, &config);
        // Every file is a credential the unit (its own, or with the drop-in for etcd) loads.
        for (key, file) in coordinator_files(&config) {
            let file = file.to_str().unwrap();
            let name = credential_name(file, "muster-coordinator.service").unwrap_or_else(|| {
                panic!("{at}: {key} {file} is not in the unit's credentials directory")
            });
            let loaded = if key.starts_with("etcd_") {
                &with_drop_ins
            } else {
                &unit_credentials
            };
            assert!(
                loaded.contains_key(name),
                "{at}: {key} {file}: no LoadCredential={name}:... ({loaded:?})"
            );
        }
        seen += 1;
    }
    assert_eq!(seen, 2, "coordinator.toml and coordinator-etcd.toml");
}

/// The value of each `--flag` among `words` that is followed by one.
fn security_flag_values<'a>(words: &[&'a str]) -> HashMap<&'static str, &'a str> {
    [
        "--tls-ca",
        "--tls-cert",
        "--tls-key",
        "--tls-domain",
        "--auth-token-file",
    ]
    .into_iter()
    .filter_map(|flag| {
        let i = words.iter().position(|w| *w == flag)?;
        Some((flag, *words.get(i + 1)?))
    })
    .collect()
}

#[test]
fn systemd_agent_connects_with_its_credentials() {
    let dir = workspace_root().join("deploy/systemd");
    let agent = std::fs::read_to_string(dir.join("muster-agent.service")).unwrap();
    let coordinator = std::fs::read_to_string(dir.join("muster-coordinator.service")).unwrap();
    let loaded = loaded_credentials(&agent);
    let exec = unit_values(&agent, "ExecStart");
    let words: Vec<&str> = exec[0].split_whitespace().collect();
    let flags = security_flag_values(&words);
    for flag in ["--tls-ca", "--tls-cert", "--tls-key", "--auth-token-file"] {
        let value = flags
            .get(flag)
            .unwrap_or_else(|| panic!("muster-agent.service: ExecStart has no {flag}"));
        let name = credential_name(value, "muster-agent.service").unwrap_or_else(|| {
            panic!("muster-agent.service: {flag} {value} is not in its credentials directory")
        });
        assert!(
            loaded.contains_key(name),
            "muster-agent.service: {flag} {value}: no LoadCredential={name}:... ({loaded:?})"
        );
    }
    // Both sides read one cluster token file.
    let config = Config::default()
        .apply(&Layer::from_file(&dir.join("coordinator.toml")).unwrap_or_else(|e| panic!("{e}")));
    let file = config.auth_token_file.unwrap();
    let coordinator_token = credential_name(file.to_str().unwrap(), "muster-coordinator.service")
        .and_then(|name| loaded_credentials(&coordinator).remove(name));
    let agent_token = credential_name(flags["--auth-token-file"], "muster-agent.service")
        .and_then(|name| loaded.get(name).cloned());
    assert!(agent_token.is_some());
    assert_eq!(
        agent_token, coordinator_token,
        "the agent and the coordinator load different cluster tokens"
    );
}

#[test]
fn coordinator_notifies_ready_watchdog_and_stopping() {
    let sock = NotifySocket::bind("coord");
    let path = sock.path();
    let addr = format!("127.0.0.1:{}", free_port());
    let mut coordinator = Proc(
        Command::new(coordinator_bin())
            .args(["--listen", &addr])
            .env("NOTIFY_SOCKET", path)
            // Pings every 150 ms.
            .env("WATCHDOG_USEC", "300000")
            .stdin(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap(),
    );
    let first = sock.receive_until("READY=1", Duration::from_secs(10));
    assert!(first[0].contains("STATUS=listening on"), "{first:?}");
    // READY comes after the listener is bound: it accepts at once.
    std::net::TcpStream::connect(&addr).expect("ready means accepting");
    let t = Instant::now();
    for _ in 0..3 {
        sock.receive_until("WATCHDOG=1", Duration::from_secs(2));
    }
    assert!(
        t.elapsed() < Duration::from_secs(2),
        "3 pings at 150 ms took {:?}",
        t.elapsed()
    );
    coordinator.signal(Signal::SIGTERM);
    sock.receive_until("STOPPING=1", Duration::from_secs(5));
    let status = coordinator.wait_within(COORDINATOR_DRAIN_BOUND);
    assert!(status.is_some_and(|s| s.success()), "{status:?}");

    // A watchdog meant for another process (WATCHDOG_PID) is not ours: no pings.
    let mut other = Proc(
        Command::new(coordinator_bin())
            .args(["--listen", &format!("127.0.0.1:{}", free_port())])
            .env("NOTIFY_SOCKET", path)
            .env("WATCHDOG_USEC", "100000")
            .env("WATCHDOG_PID", "1")
            .stdin(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap(),
    );
    sock.receive_until("READY=1", Duration::from_secs(10));
    std::thread::sleep(Duration::from_millis(500));
    while let Some(msg) = sock.recv() {
        assert!(
            !msg.contains("WATCHDOG=1"),
            "pinged another process's watchdog"
        );
    }
    other.signal(Signal::SIGTERM);
    assert!(
        other
            .wait_within(COORDINATOR_DRAIN_BOUND)
            .is_some_and(|s| s.success())
    );
}

#[test]
fn agent_serve_notifies_ready_watchdog_and_stopping() {
    let coordinator = Coordinator::start(&[]);
    let sock = NotifySocket::bind("agent");
    let path = sock.path();
    let mut agent = Proc(
        Command::new(agent_bin())
            .args(["serve", "--coordinator", &coordinator.addr])
            .args(["--agent-id", "deploy-test", "--advertise-addr", "127.0.0.1"])
            .env("NOTIFY_SOCKET", path)
            .env("WATCHDOG_USEC", "300000")
            .stdin(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap(),
    );
    let first = sock.receive_until("READY=1", Duration::from_secs(10));
    assert!(
        first[0].contains(&format!("coordinator {}", coordinator.addr)),
        "{first:?}"
    );
    for _ in 0..3 {
        sock.receive_until("WATCHDOG=1", Duration::from_secs(2));
    }
    agent.signal(Signal::SIGTERM);
    let t = Instant::now();
    let stopping = sock.receive_until("STOPPING=1", Duration::from_secs(10));
    assert!(
        stopping.last().unwrap().contains("exit status 0"),
        "{stopping:?}"
    );
    let status = agent.wait_within(Duration::from_millis(5000) + AGENT_DRAIN_OVER_GRACE);
    assert!(status.is_some_and(|s| s.success()), "{status:?}");
    assert!(t.elapsed() < Duration::from_secs(10), "{:?}", t.elapsed());
}

// ----------------------------------------------------------------------------------------
// SIGTERM with a waiting client
// ----------------------------------------------------------------------------------------

#[test]
fn sigterm_drains_a_coordinator_with_a_waiting_client() {
    let addr = format!("127.0.0.1:{}", free_port());
    let mut coordinator = Proc(
        Command::new(coordinator_bin())
            .args(["--listen", &addr])
            .stdin(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap(),
    );
    wait_until_accepting(&addr, Duration::from_secs(10));
    let rt = tokio::runtime::Runtime::new().unwrap();
    // One node of two joins: its Join waits for the second (up to 120 s).
    let join = rt.spawn({
        let addr = addr.clone();
        async move {
            let mut client =
                pb::rendezvous_client::RendezvousClient::connect(format!("http://{addr}"))
                    .await
                    .unwrap();
            client
                .join(pb::JoinRequest {
                    job_id: "drain".into(),
                    node_id: "n0".into(),
                    host: "127.0.0.1".into(),
                    local_world_size: 1,
                    requested_node_rank: None,
                    config: Some(pb::RendezvousConfig {
                        min_nodes: 2,
                        max_nodes: 2,
                        last_call_ms: 0,
                        join_timeout_ms: 120_000,
                        max_restarts: None,
                        recovery: 0,
                        ..Default::default()
                    }),
                    request_id: String::new(),
                    watches: false,
                    spare: false,
                })
                .await
        }
    });
    std::thread::sleep(Duration::from_millis(500));
    assert!(!join.is_finished(), "the join waits for a second node");
    let t = Instant::now();
    coordinator.signal(Signal::SIGTERM);
    let status = coordinator.wait_within(COORDINATOR_DRAIN_BOUND);
    assert!(
        status.is_some_and(|s| s.success()),
        "not exited 0 within {COORDINATOR_DRAIN_BOUND:?} of SIGTERM: {status:?}"
    );
    eprintln!("coordinator exited {:?} after SIGTERM", t.elapsed());
    // The waiting client got an answer (an error), not a hang.
    let answer = rt
        .block_on(async { tokio::time::timeout(Duration::from_secs(5), join).await })
        .expect("the waiting join ends when the coordinator exits")
        .unwrap();
    assert!(answer.is_err(), "{answer:?}");
}

// ----------------------------------------------------------------------------------------
// Kubernetes
// ----------------------------------------------------------------------------------------

/// The `MUSTER_COORDINATOR_*` variables the coordinator reads: `Layer::from_env`'s, and the
/// `[env: ...]` of its flags.
fn coordinator_env_vars() -> BTreeSet<String> {
    let source =
        std::fs::read_to_string(workspace_root().join("coordinator/src/config.rs")).unwrap();
    let start = source.find("fn from_env").expect("Layer::from_env");
    let rest = &source[start..];
    let end = rest[1..]
        .find("\n    pub fn ")
        .map_or(rest.len(), |e| e + 1);
    let mut vars: BTreeSet<String> = quoted_with_prefix(&rest[..end], "MUSTER_COORDINATOR_");
    let help = help_of("muster-coordinator", None);
    for part in help.split("[env: ").skip(1) {
        let name: String = part
            .chars()
            .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
            .collect();
        vars.insert(name);
    }
    assert!(vars.len() > 10, "found {vars:?}");
    vars
}

/// Every `"PREFIX..."` string literal in `text`.
fn quoted_with_prefix(text: &str, prefix: &str) -> BTreeSet<String> {
    text.split('"')
        .skip(1)
        .step_by(2)
        .filter(|s| s.starts_with(prefix))
        .map(str::to_owned)
        .collect()
}

/// The gRPC service names the coordinator reports on grpc.health.v1 (lib.rs's SERVICES).
fn coordinator_health_services() -> BTreeSet<String> {
    let source = std::fs::read_to_string(workspace_root().join("coordinator/src/lib.rs")).unwrap();
    let start = source.find("const SERVICES").expect("SERVICES in lib.rs");
    let end = start + source[start..].find("];").unwrap();
    let names = quoted_with_prefix(&source[start..end], "muster.v1.");
    assert!(names.contains("muster.v1.Session"), "{names:?}");
    names
}

fn manifests() -> Vec<(String, Yaml)> {
    let dir = workspace_root().join("deploy/kubernetes");
    let mut docs = vec![];
    let mut files: Vec<_> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "yaml" || e == "yml"))
        .collect();
    files.sort();
    assert!(files.len() >= 3, "{files:?}");
    for file in files {
        let text = std::fs::read_to_string(&file).unwrap();
        assert!(
            text.starts_with('#'),
            "{} starts with a comment",
            file.display()
        );
        let parsed =
            YamlLoader::load_from_str(&text).unwrap_or_else(|e| panic!("{}: {e}", file.display()));
        assert!(!parsed.is_empty(), "{}", file.display());
        let name = file.file_name().unwrap().to_string_lossy().into_owned();
        for doc in parsed {
            assert!(doc["apiVersion"].as_str().is_some(), "{name}: apiVersion");
            assert!(doc["kind"].as_str().is_some(), "{name}: kind");
            assert!(doc["metadata"]["name"].as_str().is_some(), "{name}: name");
            docs.push((name.clone(), doc));
        }
    }
    docs
}

fn strings(y: &Yaml) -> Vec<String> {
    y.as_vec()
        .map(|v| {
            v.iter()
                .map(|s| match s {
                    Yaml::String(s) => s.clone(),
                    Yaml::Integer(i) => i.to_string(),
                    other => panic!("not a string: {other:?}"),
                })
                .collect()
        })
        .unwrap_or_default()
}

fn labels(y: &Yaml) -> Vec<(String, String)> {
    y.as_hash()
        .map(|h| {
            h.iter()
                .map(|(k, v)| {
                    (
                        k.as_str().unwrap().to_owned(),
                        v.as_str().unwrap().to_owned(),
                    )
                })
                .collect()
        })
        .unwrap_or_default()
}

/// A port reference: a number, or a container port's name.
fn port_ref(y: &Yaml) -> String {
    match y {
        Yaml::Integer(i) => i.to_string(),
        Yaml::String(s) => s.clone(),
        other => panic!("not a port: {other:?}"),
    }
}

/// The value after `flag` in `args` (`--flag V` or `--flag=V`).
fn flag_value<'a>(args: &'a [String], flag: &str) -> Option<&'a str> {
    args.iter().enumerate().find_map(|(i, a)| {
        if a == flag {
            args.get(i + 1).map(String::as_str)
        } else {
            a.strip_prefix(flag)?.strip_prefix('=')
        }
    })
}

fn port_of(host_port: &str) -> u16 {
    host_port
        .rsplit_once(':')
        .and_then(|(_, p)| p.parse().ok())
        .unwrap_or_else(|| panic!("no port in {host_port}"))
}

/// The keys of every Secret in the manifests, by name.
fn secret_keys(docs: &[(String, Yaml)]) -> HashMap<String, BTreeSet<String>> {
    docs.iter()
        .filter(|(_, d)| d["kind"].as_str() == Some("Secret"))
        .map(|(file, d)| {
            let name = d["metadata"]["name"].as_str().unwrap().to_owned();
            let keys: BTreeSet<String> = ["stringData", "data"]
                .iter()
                .flat_map(|k| d[*k].as_hash().into_iter().flatten())
                .map(|(k, _)| k.as_str().unwrap().to_owned())
                .collect();
            if d["type"].as_str() == Some("kubernetes.io/tls") {
                for key in ["tls.crt", "tls.key"] {
                    assert!(
                        keys.contains(key),
                        "{file}: Secret {name} of type kubernetes.io/tls has no {key}"
                    );
                }
            }
            (name, keys)
        })
        .collect()
}

/// Where `path` comes from in container `c` of pod `spec`: the Secret and key mounted there
/// (read-only, as a directory).
fn secret_file(
    at: &str,
    what: &str,
    path: &str,
    c: &Yaml,
    spec: &Yaml,
    secrets: &HashMap<String, BTreeSet<String>>,
) -> (String, String) {
    for m in c["volumeMounts"].as_vec().into_iter().flatten() {
        let mount = m["mountPath"].as_str().unwrap().trim_end_matches('/');
        let Some(key) = path.strip_prefix(mount).and_then(|r| r.strip_prefix('/')) else {
            continue;
        };
        let volume = m["name"].as_str().unwrap();
        let secret = spec["volumes"]
            .as_vec()
            .into_iter()
            .flatten()
            .find(|v| v["name"].as_str() == Some(volume))
            .and_then(|v| v["secret"]["secretName"].as_str())
            .unwrap_or_else(|| panic!("{at}: {what} {path} is in volume {volume}, not a Secret"));
        assert_eq!(
            m["readOnly"].as_bool(),
            Some(true),
            "{at}: Secret {secret} is mounted writable"
        );
        assert!(
            m["subPath"].is_badvalue(),
            "{at}: Secret {secret} by subPath is never updated"
        );
        let keys = secrets
            .get(secret)
            .unwrap_or_else(|| panic!("{at}: no Secret {secret} in deploy/kubernetes"));
        assert!(
            keys.contains(key),
            "{at}: {what} {path}: Secret {secret} has no key {key} ({keys:?})"
        );
        return (secret.to_owned(), key.to_owned());
    }
    panic!("{at}: {what} {path} is not in a mounted volume");
}

/// The coordinator settings a container's flags give (those the manifests use).
fn coordinator_flags(at: &str, args: &[String]) -> Layer {
    fn parse<T: std::str::FromStr>(at: &str, args: &[String], flag: &str) -> Option<T> {
        flag_value(args, flag).map(|v| v.parse().unwrap_or_else(|_| panic!("{at}: {flag} {v}")))
    }
    let path = |flag: &str| flag_value(args, flag).map(PathBuf::from);
    Layer {
        listen: parse(at, args, "--listen"),
        store: parse(at, args, "--store"),
        health_addr: parse(at, args, "--health-addr"),
        metrics_addr: parse(at, args, "--metrics-addr"),
        tls_cert: path("--tls-cert"),
        tls_key: path("--tls-key"),
        tls_client_ca: path("--tls-client-ca"),
        auth_token_file: path("--auth-token-file"),
        insecure: args.iter().any(|a| a == "--insecure").then_some(true),
        ..Layer::default()
    }
}

/// A pod template's containers with what the checks need.
struct Pod<'a> {
    file: String,
    workload: String,
    labels: Vec<(String, String)>,
    spec: &'a Yaml,
}

#[test]
fn kubernetes_manifests_match_the_binaries() {
    let docs = manifests();
    let env_vars = coordinator_env_vars();
    let health = coordinator_health_services();
    let secrets = secret_keys(&docs);
    let config_maps: HashMap<&str, &Yaml> = docs
        .iter()
        .filter(|(_, d)| d["kind"].as_str() == Some("ConfigMap"))
        .map(|(_, d)| (d["metadata"]["name"].as_str().unwrap(), &d["data"]))
        .collect();
    let pods: Vec<Pod<'_>> = docs
        .iter()
        .filter(|(_, d)| {
            matches!(
                d["kind"].as_str(),
                Some("Deployment" | "StatefulSet" | "DaemonSet")
            )
        })
        .map(|(file, d)| Pod {
            file: file.clone(),
            workload: format!(
                "{} {}",
                d["kind"].as_str().unwrap(),
                d["metadata"]["name"].as_str().unwrap()
            ),
            labels: labels(&d["spec"]["template"]["metadata"]["labels"]),
            spec: &d["spec"]["template"]["spec"],
        })
        .collect();
    assert!(
        pods.len() >= 3,
        "coordinator (memory), coordinator (etcd), agent"
    );

    // Per pod: binary, flags, ports, env; remembered for the Services below.
    let mut pod_ports: Vec<(usize, Vec<(String, i64)>)> = vec![];
    let mut coordinators = 0;
    let mut agent_targets = vec![];
    let mut agent_domains = vec![];
    for (i, pod) in pods.iter().enumerate() {
        let at = format!("{}: {}", pod.file, pod.workload);
        let grace = pod.spec["terminationGracePeriodSeconds"]
            .as_i64()
            .unwrap_or(30);
        let containers = pod.spec["containers"].as_vec().unwrap();
        let mut ports = vec![];
        for c in containers {
            let at = format!("{at} container {}", c["name"].as_str().unwrap());
            let command = strings(&c["command"]);
            // The image's ENTRYPOINT (Dockerfile) is the coordinator.
            let binary = command
                .first()
                .map_or("muster-coordinator", |c| c.rsplit('/').next().unwrap())
                .to_owned();
            let mut args: Vec<String> = command.iter().skip(1).cloned().collect();
            args.extend(strings(&c["args"]));
            let subcommand = (binary == "muster-agent").then(|| {
                args.iter()
                    .find(|a| !a.starts_with('-'))
                    .unwrap_or_else(|| panic!("{at}: muster-agent without a subcommand"))
                    .clone()
            });
            let help = help_of(&binary, subcommand.as_deref());
            let flags: Vec<&str> = args
                .iter()
                .filter(|a| a.starts_with("--"))
                .map(|a| a.split('=').next().unwrap())
                .collect();
            for flag in &flags {
                assert!(
                    has_flag(&help, flag),
                    "{at}: {flag} is not in `{binary} {} --help`",
                    subcommand.as_deref().unwrap_or("")
                );
            }
            for p in c["ports"].as_vec().into_iter().flatten() {
                ports.push((
                    p["name"].as_str().unwrap_or("").to_owned(),
                    p["containerPort"].as_i64().unwrap(),
                ));
            }
            for e in c["env"].as_vec().into_iter().flatten() {
                let name = e["name"].as_str().unwrap();
                if name.starts_with("MUSTER_COORDINATOR_") {
                    assert_eq!(binary, "muster-coordinator", "{at}: {name}");
                    assert!(
                        env_vars.contains(name),
                        "{at}: the coordinator does not read {name} (it reads {env_vars:?})"
                    );
                }
            }
            // Probes name a container port.
            for probe in ["readinessProbe", "livenessProbe", "startupProbe"] {
                let p = &c[probe];
                if p.is_badvalue() {
                    continue;
                }
                let target = ["grpc", "tcpSocket", "httpGet"]
                    .iter()
                    .find(|k| !p[**k].is_badvalue())
                    .unwrap_or_else(|| panic!("{at}: {probe} has no handler"));
                let port = port_ref(&p[*target]["port"]);
                assert!(
                    ports
                        .iter()
                        .any(|(n, num)| *n == port || num.to_string() == port),
                    "{at}: {probe} port {port} is not a container port {ports:?}"
                );
                if *target == "grpc" {
                    let service = p["grpc"]["service"].as_str().unwrap_or("");
                    assert!(
                        service.is_empty() || health.contains(service),
                        "{at}: {probe} asks for {service}, which the coordinator does not report"
                    );
                }
            }

            match binary.as_str() {
                "muster-coordinator" => {
                    coordinators += 1;
                    // The listen port: the flag, else the mounted ConfigMap's `listen`.
                    let mut listen = flag_value(&args, "--listen").map(port_of);
                    let mut config = Config::default();
                    for v in pod.spec["volumes"].as_vec().into_iter().flatten() {
                        let Some(name) = v["configMap"]["name"].as_str() else {
                            continue;
                        };
                        let data = config_maps
                            .get(name)
                            .unwrap_or_else(|| panic!("{at}: no ConfigMap {name}"));
                        let toml = data["coordinator.toml"].as_str().unwrap();
                        let dir = TempDir::new("configmap");
                        let path = dir.0.join("coordinator.toml");
                        std::fs::write(&path, toml).unwrap();
                        let layer = Layer::from_file(&path)
                            .unwrap_or_else(|e| panic!("{at}: ConfigMap {name}: {e}"));
                        config = config.apply(&layer);
                        let from_file = config.listen.port();
                        listen = listen.or(Some(from_file));
                        assert_eq!(
                            Some(from_file),
                            listen,
                            "{at}: ConfigMap {name} listens elsewhere than --listen"
                        );
                        // It is mounted where --config reads it.
                        let volume = v["name"].as_str().unwrap();
                        let mount = c["volumeMounts"]
                            .as_vec()
                            .into_iter()
                            .flatten()
                            .find(|m| m["name"].as_str() == Some(volume))
                            .unwrap_or_else(|| panic!("{at}: ConfigMap {name} is not mounted"));
                        let mounted = match mount["subPath"].as_str() {
                            Some(_) => mount["mountPath"].as_str().unwrap().to_owned(),
                            None => {
                                format!("{}/coordinator.toml", mount["mountPath"].as_str().unwrap())
                            }
                        };
                        assert_eq!(
                            flag_value(&args, "--config"),
                            Some(mounted.as_str()),
                            "{at}: ConfigMap {name} is mounted but not read"
                        );
                    }
                    // Then the environment and the flags, as the coordinator layers them.
                    let env: HashMap<&str, &str> = c["env"]
                        .as_vec()
                        .into_iter()
                        .flatten()
                        .filter_map(|e| Some((e["name"].as_str()?, e["value"].as_str()?)))
                        .collect();
                    config = config
                        .apply(
                            &Layer::from_env(|k| env.get(k).map(|v| (*v).to_owned()))
                                .unwrap_or_else(|e| panic!("{at}: {e}")),
                        )
                        .apply(&coordinator_flags(&at, &args));
                    config
                        .validate()
                        .unwrap_or_else(|e| panic!("{at}: configuration: {e}"));
                    let listen = listen.unwrap_or_else(|| panic!("{at}: no listen address"));
                    // The gRPC port serves mutual TLS and the cluster token, from Secrets.
                    assert!(
                        !config.listen.ip().is_loopback(),
                        "{at}: listens on loopback"
                    );
                    assert_secured(&at, &config);
                    for (key, file) in coordinator_files(&config) {
                        secret_file(&at, key, file.to_str().unwrap(), c, pod.spec, &secrets);
                    }
                    // Kubernetes' gRPC probes cannot speak TLS: they ask the plaintext
                    // health-only listener (--health-addr), a container port of its own.
                    let health_port = config
                        .health_addr
                        .unwrap_or_else(|| panic!("{at}: no --health-addr for the probes"))
                        .port();
                    assert_ne!(health_port, listen, "{at}: health port");
                    assert!(
                        ports.iter().any(|(_, p)| *p == i64::from(health_port)),
                        "{at}: the health port {health_port} is not a container port {ports:?}"
                    );
                    for probe in ["readinessProbe", "livenessProbe", "startupProbe"] {
                        let grpc = &c[probe]["grpc"];
                        if !grpc.is_badvalue() {
                            assert_eq!(
                                grpc["port"].as_i64(),
                                Some(i64::from(health_port)),
                                "{at}: {probe} is not on the health port (--health-addr)"
                            );
                        }
                    }
                    assert!(
                        ports.iter().any(|(_, p)| *p == i64::from(listen)),
                        "{at}: listens on {listen}, not a container port {ports:?}"
                    );
                    // Readiness must follow leadership: a muster service, not "" alone.
                    let ready = c["readinessProbe"]["grpc"]["service"].as_str();
                    assert!(
                        ready.is_some_and(|s| health.contains(s)),
                        "{at}: readiness is not on a muster service: {ready:?}"
                    );
                    assert!(
                        Duration::from_secs(u64::try_from(grace).unwrap())
                            >= COORDINATOR_DRAIN_BOUND,
                        "{at}: terminationGracePeriodSeconds {grace} is shorter than the drain"
                    );
                    // Over etcd, a follower is NOT_SERVING on every health name, so liveness
                    // must not ask grpc.health.v1.
                    if flag_value(&args, "--store") == Some("etcd") {
                        assert!(
                            c["livenessProbe"]["grpc"].is_badvalue(),
                            "{at}: a grpc liveness probe would restart every follower"
                        );
                    }
                }
                "muster-agent" => {
                    let grace_ms: u64 =
                        flag_value(&args, "--grace-period-ms").map_or(5000, |v| v.parse().unwrap());
                    assert!(
                        Duration::from_secs(u64::try_from(grace).unwrap())
                            >= Duration::from_millis(grace_ms) + AGENT_DRAIN_OVER_GRACE,
                        "{at}: terminationGracePeriodSeconds {grace} is shorter than the drain"
                    );
                    if subcommand.as_deref() == Some("serve") {
                        let list = flag_value(&args, "--coordinator")
                            .unwrap_or_else(|| panic!("{at}: serve without --coordinator"));
                        for target in list.split(',') {
                            agent_targets.push((at.clone(), target.to_owned()));
                        }
                        // Mutual TLS and the cluster token, from Secrets.
                        for flag in ["--tls-ca", "--tls-cert", "--tls-key", "--auth-token-file"] {
                            let file = flag_value(&args, flag)
                                .unwrap_or_else(|| panic!("{at}: serve without {flag}"));
                            secret_file(&at, flag, file, c, pod.spec, &secrets);
                        }
                        if let Some(domain) = flag_value(&args, "--tls-domain") {
                            agent_domains.push((at.clone(), domain.to_owned()));
                        }
                    }
                }
                other => panic!("{at}: runs {other}, not a muster binary"),
            }
        }
        pod_ports.push((i, ports));
    }
    assert!(coordinators >= 2, "a memory and an etcd coordinator");
    assert!(
        !agent_targets.is_empty(),
        "an agent DaemonSet running serve"
    );

    // Services select pods and name their ports.
    let mut services: Vec<(String, i64)> = vec![];
    for (file, d) in docs
        .iter()
        .filter(|(_, d)| d["kind"].as_str() == Some("Service"))
    {
        let name = d["metadata"]["name"].as_str().unwrap();
        let selector = labels(&d["spec"]["selector"]);
        let selected: Vec<_> = pod_ports
            .iter()
            .filter(|(i, _)| {
                pods[*i].file == *file && selector.iter().all(|kv| pods[*i].labels.contains(kv))
            })
            .collect();
        assert!(
            !selected.is_empty(),
            "{file}: Service {name} selects no pod"
        );
        for p in d["spec"]["ports"].as_vec().unwrap() {
            let port = p["port"].as_i64().unwrap();
            let target = if p["targetPort"].is_badvalue() {
                port.to_string()
            } else {
                port_ref(&p["targetPort"])
            };
            for (i, ports) in &selected {
                assert!(
                    ports
                        .iter()
                        .any(|(n, num)| *n == target || num.to_string() == target),
                    "{file}: Service {name} targets {target}, not a port of {}",
                    pods[*i].workload
                );
            }
            services.push((name.to_owned(), port));
        }
    }
    // Agents reach a coordinator Service on its port.
    for (at, target) in agent_targets {
        let host = target.rsplit_once(':').unwrap().0;
        let service = host.split('.').next().unwrap();
        let port = i64::from(port_of(&target));
        assert!(
            services.iter().any(|(n, p)| n == service && *p == port),
            "{at}: --coordinator {target} is no Service port {services:?}"
        );
    }
    // The name agents verify is a coordinator Service's.
    for (at, domain) in agent_domains {
        let service = domain.split('.').next().unwrap();
        assert!(
            services.iter().any(|(n, _)| n == service),
            "{at}: --tls-domain {domain} is no Service {services:?}"
        );
    }
}

// ----------------------------------------------------------------------------------------
// The deployments run: TLS, the cluster token, the health port
// ----------------------------------------------------------------------------------------

/// A child whose stderr goes to a log file, shown when a check fails.
struct Logged {
    proc: Proc,
    log: PathBuf,
}

impl Logged {
    fn spawn(cmd: &mut Command, log: PathBuf) -> Self {
        let file = std::fs::File::create(&log).unwrap();
        let child = cmd
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(file)
            .spawn()
            .unwrap();
        Self {
            proc: Proc(child),
            log,
        }
    }

    fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// SIGTERM, then an exit 0 within `limit`.
    fn stop(mut self, limit: Duration) {
        self.proc.signal(Signal::SIGTERM);
        let status = self.proc.wait_within(limit);
        assert!(
            status.is_some_and(|s| s.success()),
            "{status:?} after SIGTERM:\n{}",
            self.log()
        );
    }
}

/// Polls `check` every 100 ms for up to 20 s; panics with the last error and the logs.
fn eventually<F, Fut>(what: &str, logs: &[&Logged], mut check: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<(), String>>,
{
    let rt = tokio::runtime::Runtime::new().unwrap();
    let t = Instant::now();
    loop {
        let err = match rt.block_on(check()) {
            Ok(()) => return,
            Err(e) => e,
        };
        if t.elapsed() > Duration::from_secs(20) {
            let logs: Vec<String> = logs.iter().map(|l| l.log()).collect();
            panic!("{what}: {err}\n{}", logs.join("\n----\n"));
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// Whether the plaintext grpc.health.v1 endpoint at `addr` reports `service` SERVING (what a
/// Kubernetes gRPC probe asks).
async fn health_serving(addr: &str, service: &str) -> Result<(), String> {
    use tonic_health::pb::{HealthCheckRequest, health_client::HealthClient};
    let channel = tonic::transport::Endpoint::from_shared(format!("http://{addr}"))
        .unwrap()
        .connect_timeout(Duration::from_secs(2))
        .connect()
        .await
        .map_err(|e| format!("{e:?}"))?;
    let status = HealthClient::new(channel)
        .check(HealthCheckRequest {
            service: service.into(),
        })
        .await
        .map_err(|e| e.to_string())?
        .into_inner()
        .status;
    if status == tonic_health::pb::health_check_response::ServingStatus::Serving as i32 {
        Ok(())
    } else {
        Err(format!("{service} status {status}"))
    }
}

/// Whether the coordinator at `addr` lists agent `agent_id`, asked over mutual TLS with the
/// cluster token.
async fn agent_listed(
    addr: &str,
    tls: (&Path, &Path, &Path),
    domain: Option<&str>,
    token_file: &Path,
    agent_id: &str,
) -> Result<(), String> {
    let (ca, cert, key) = tls;
    let security = ClientSecurity::plaintext()
        .with_tls(ca, Some((cert, key)), domain)?
        .with_credentials(Credentials::bearer(&read_token_file(token_file)?)?);
    let channel = security
        .endpoint(addr)?
        .connect_timeout(Duration::from_secs(2))
        .connect()
        .await
        .map_err(|e| format!("{e:?}"))?;
    let agents = pb::ops_client::OpsClient::new(security.wrap(channel))
        .list_agents(pb::ListAgentsRequest {})
        .await
        .map_err(|e| e.to_string())?
        .into_inner()
        .agents;
    let ids: Vec<&str> = agents
        .iter()
        .filter_map(|a| Some(a.machine.as_ref()?.agent_id.as_str()))
        .collect();
    if ids.contains(&agent_id) {
        Ok(())
    } else {
        Err(format!("agents {ids:?}"))
    }
}

/// Sets the value of `flag` in `args` (which must have it).
fn set_flag(args: &mut [String], flag: &str, value: &str) {
    let i = args
        .iter()
        .position(|a| a == flag)
        .unwrap_or_else(|| panic!("no {flag} in {args:?}"));
    args[i + 1] = value.to_owned();
}

#[test]
fn systemd_coordinator_and_agent_run_with_their_credentials() {
    let src = workspace_root().join("deploy/systemd");
    let dir = TempDir::new("systemd-run");
    let pki = Pki::generate(&dir.0.join("pki"), &[]);
    // What the operator puts where the units' LoadCredential= read.
    let source = |path: &str| match path {
        "/etc/muster/tls/ca.pem" => &pki.ca,
        "/etc/muster/tls/coordinator.pem" => &pki.server_cert,
        "/etc/muster/tls/coordinator-key.pem" => &pki.server_key,
        "/etc/muster/tls/agent.pem" => &pki.client_cert,
        "/etc/muster/tls/agent-key.pem" => &pki.client_key,
        "/etc/muster/cluster-token" => &pki.token_file,
        other => panic!("no test file for LoadCredential source {other}"),
    };
    // systemd's part: each unit's credentials directory.
    let credentials = |unit: &str| {
        let text = std::fs::read_to_string(src.join(unit)).unwrap();
        let creds = dir.0.join(unit);
        std::fs::create_dir_all(&creds).unwrap();
        for (name, from) in loaded_credentials(&text) {
            std::fs::copy(source(&from), creds.join(name)).unwrap();
        }
        (text, creds)
    };

    let (_, coordinator_creds) = credentials("muster-coordinator.service");
    let config = std::fs::read_to_string(src.join("coordinator.toml"))
        .unwrap()
        .replace(
            "/run/credentials/muster-coordinator.service",
            coordinator_creds.to_str().unwrap(),
        );
    let config_path = dir.0.join("coordinator.toml");
    std::fs::write(&config_path, config).unwrap();
    let port = free_port();
    // On 0.0.0.0 as configured (refused without TLS and the token), on a free port.
    let coordinator = Logged::spawn(
        Command::new(coordinator_bin())
            .arg("--config")
            .arg(&config_path)
            .args(["--listen", &format!("0.0.0.0:{port}")]),
        dir.0.join("coordinator.log"),
    );

    let (agent_unit, agent_creds) = credentials("muster-agent.service");
    let mut env: HashMap<String, String> = unit_values(&agent_unit, "Environment")
        .iter()
        .filter_map(|v| v.split_once('='))
        .map(|(k, v)| (k.to_owned(), v.to_owned()))
        .collect();
    env.insert("COORDINATOR".into(), format!("localhost:{port}"));
    env.insert("METRICS_ADDR".into(), format!("127.0.0.1:{}", free_port()));
    let exec = unit_values(&agent_unit, "ExecStart")[0];
    let mut words: Vec<String> = exec
        .split_whitespace()
        .skip(1)
        .map(|w| {
            let mut w = w.replace("%d", agent_creds.to_str().unwrap());
            for (k, v) in &env {
                w = w.replace(&format!("${{{k}}}"), v);
            }
            w
        })
        .collect();
    words.extend(["--agent-id".into(), "systemd-node".into()]);
    let agent = Logged::spawn(
        Command::new(agent_bin()).args(&words),
        dir.0.join("agent.log"),
    );

    let addr = format!("127.0.0.1:{port}");
    let flags = |flag: &str| PathBuf::from(flag_value(&words, flag).unwrap());
    let (ca, cert, key, token) = (
        flags("--tls-ca"),
        flags("--tls-cert"),
        flags("--tls-key"),
        flags("--auth-token-file"),
    );
    eventually(
        "the agent registers over TLS",
        &[&coordinator, &agent],
        || {
            agent_listed(
                &addr,
                (&ca, &cert, &key),
                Some("localhost"),
                &token,
                "systemd-node",
            )
        },
    );
    agent.stop(Duration::from_millis(5000) + AGENT_DRAIN_OVER_GRACE);
    coordinator.stop(COORDINATOR_DRAIN_BOUND);
}

#[test]
fn kubernetes_coordinator_and_agent_run_with_their_secrets() {
    let docs = manifests();
    let secrets = secret_keys(&docs);
    let dir = TempDir::new("k8s-run");
    let pki = Pki::generate(&dir.0.join("pki"), &["muster-coordinator.default.svc"]);
    // What the operator puts in the Secrets.
    let content = |secret: &str, key: &str| match (secret, key) {
        ("muster-coordinator-tls" | "muster-agent-tls", "ca.crt") => &pki.ca,
        ("muster-coordinator-tls", "tls.crt") => &pki.server_cert,
        ("muster-coordinator-tls", "tls.key") => &pki.server_key,
        ("muster-agent-tls", "tls.crt") => &pki.client_cert,
        ("muster-agent-tls", "tls.key") => &pki.client_key,
        ("muster-cluster-token", "cluster-token") => &pki.token_file,
        other => panic!("no test content for Secret key {other:?}"),
    };
    // The container's file system: /etc/muster/... under `root`.
    let root = dir.0.join("root");
    let rewrite = |s: &str| s.replace("/etc/muster/", &format!("{}/etc/muster/", root.display()));
    let find = |kind: &str, name: &str| {
        let (_, d) = docs
            .iter()
            .find(|(_, d)| {
                d["kind"].as_str() == Some(kind) && d["metadata"]["name"].as_str() == Some(name)
            })
            .unwrap_or_else(|| panic!("no {kind} {name}"));
        let spec = &d["spec"]["template"]["spec"];
        let c = &spec["containers"][0];
        // Kubernetes' part: the Secrets' files at their mount paths.
        for m in c["volumeMounts"].as_vec().into_iter().flatten() {
            let volume = spec["volumes"]
                .as_vec()
                .unwrap()
                .iter()
                .find(|v| v["name"] == m["name"])
                .unwrap();
            let Some(secret) = volume["secret"]["secretName"].as_str() else {
                continue;
            };
            let at = PathBuf::from(rewrite(&format!("{}/", m["mountPath"].as_str().unwrap())));
            std::fs::create_dir_all(&at).unwrap();
            for key in &secrets[secret] {
                std::fs::copy(content(secret, key), at.join(key)).unwrap();
            }
        }
        let mut args: Vec<String> = strings(&c["command"]).into_iter().skip(1).collect();
        args.extend(strings(&c["args"]).iter().map(|a| rewrite(a)));
        let env: Vec<(String, String)> = c["env"]
            .as_vec()
            .into_iter()
            .flatten()
            .filter_map(|e| {
                Some((
                    e["name"].as_str()?.to_owned(),
                    e["value"].as_str()?.to_owned(),
                ))
            })
            .collect();
        (spec, args, env)
    };

    let (spec, mut args, env) = find("Deployment", "muster-coordinator");
    let config_map = spec["volumes"]
        .as_vec()
        .unwrap()
        .iter()
        .find_map(|v| v["configMap"]["name"].as_str())
        .unwrap();
    let toml = docs
        .iter()
        .find(|(_, d)| {
            d["kind"].as_str() == Some("ConfigMap")
                && d["metadata"]["name"].as_str() == Some(config_map)
        })
        .unwrap()
        .1["data"]["coordinator.toml"]
        .as_str()
        .unwrap();
    let config_path = flag_value(&args, "--config").unwrap().to_owned();
    std::fs::write(&config_path, rewrite(toml)).unwrap();
    let port = free_port();
    let health_port = free_port();
    set_flag(&mut args, "--listen", &format!("0.0.0.0:{port}"));
    set_flag(
        &mut args,
        "--health-addr",
        &format!("127.0.0.1:{health_port}"),
    );
    let coordinator = Logged::spawn(
        Command::new(coordinator_bin()).args(&args).envs(env),
        dir.0.join("coordinator.log"),
    );
    // The readiness probe's question, in plaintext on the health port.
    let service = spec["containers"][0]["readinessProbe"]["grpc"]["service"]
        .as_str()
        .unwrap();
    let health = format!("127.0.0.1:{health_port}");
    eventually("the readiness probe passes", &[&coordinator], || {
        health_serving(&health, service)
    });

    let (_, mut args, _) = find("DaemonSet", "muster-agent");
    let addr = format!("127.0.0.1:{port}");
    set_flag(&mut args, "--coordinator", &addr);
    set_flag(
        &mut args,
        "--metrics-addr",
        &format!("127.0.0.1:{}", free_port()),
    );
    let args: Vec<String> = args
        .iter()
        .map(|a| {
            a.replace("$(NODE_NAME)", "k8s-node")
                .replace("$(NODE_IP)", "127.0.0.1")
        })
        .collect();
    let agent = Logged::spawn(
        Command::new(agent_bin()).args(&args),
        dir.0.join("agent.log"),
    );
    let flags = |flag: &str| PathBuf::from(flag_value(&args, flag).unwrap());
    let (ca, cert, key, token) = (
        flags("--tls-ca"),
        flags("--tls-cert"),
        flags("--tls-key"),
        flags("--auth-token-file"),
    );
    let domain = flag_value(&args, "--tls-domain");
    eventually(
        "the agent registers over TLS",
        &[&coordinator, &agent],
        || agent_listed(&addr, (&ca, &cert, &key), domain, &token, "k8s-node"),
    );
    agent.stop(Duration::from_millis(10_000) + AGENT_DRAIN_OVER_GRACE);
    coordinator.stop(COORDINATOR_DRAIN_BOUND);
}
