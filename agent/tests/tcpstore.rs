//! The agent store against torch's own `TCPStore` client (`tests/python/tcpstore_client.py`,
//! and the conformance suite `tests/python/store_conformance.py`, which runs each sequence
//! against torch's own server too; both with the peers' venv): a real coordinator in-process on loopback with authentication
//! on, a job formed through the real rendezvous, the store's backend authenticated with the
//! job token as `launch` mints it, and real client processes. Without the venv, the tests that
//! need torch print `skipped: ...` and pass; the handshake tests need no Python.
#![allow(clippy::unwrap_used, clippy::expect_used)]

#[path = "../../tests/src/peers.rs"]
mod peers;

use std::{
    io::{Read, Write},
    net::TcpStream,
    path::{Path, PathBuf},
    process::{Command, Output},
    time::{Duration, Instant},
};

use muster::client::{ClientSecurity, Coordinator, Credentials, Kv};
use muster_agent::store::AgentStore;
use muster_proto::v1::{self as pb, rendezvous_client::RendezvousClient};

/// The cluster token the test coordinator trusts.
const CLUSTER_TOKEN: &str = "tcpstore-test-cluster-token-0123456789";

/// A coordinator and one job's agent store, as `launch` would run them.
struct Harness {
    coordinator: String,
    job: String,
    generation: u64,
    store: AgentStore,
}

impl Harness {
    /// Starts a coordinator (cluster token required), forms `job` with one node and starts
    /// the agent store on the job's generation, its backend carrying the job's token.
    async fn start(job: &str) -> Harness {
        Self::start_with(job, muster_coordinator::Config::default()).await
    }

    /// As [`Harness::start`], with the coordinator's `config` (its authentication set here).
    async fn start_with(job: &str, config: muster_coordinator::Config) -> Harness {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let coordinator = listener.local_addr().unwrap().to_string();
        let config = muster_coordinator::Config {
            auth: muster_coordinator::auth::Auth::with_cluster_token(CLUSTER_TOKEN.to_owned()),
            ..config
        };
        tokio::spawn(async move {
            muster_coordinator::serve(listener, config, std::future::pending())
                .await
                .unwrap()
        });
        let generation = join(&coordinator, job).await;
        let kv = job_kv(&coordinator, job, job);
        let store = AgentStore::start(kv, generation).unwrap();
        Harness {
            coordinator,
            job: job.to_owned(),
            generation,
            store,
        }
    }

    fn port(&self) -> String {
        self.store.port().to_string()
    }

    /// Sets `key` in the job's store as torch's client would (the SDK's door).
    async fn store_key(&self, key: &str, value: &[u8]) {
        job_kv(&self.coordinator, &self.job, &self.job)
            .set(&format!("torch/g{}/{key}", self.generation), value)
            .await
            .unwrap();
    }
}

/// A `Kv` on `job`'s store carrying the job token of `token_job` (as `launch` mints it).
fn job_kv(coordinator: &str, job: &str, token_job: &str) -> Kv {
    let token = muster_core::job_token::mint(CLUSTER_TOKEN, token_job);
    let security =
        ClientSecurity::plaintext().with_credentials(Credentials::bearer(&token).unwrap());
    Kv::new(
        Coordinator::connect_lazy_with(coordinator, security).unwrap(),
        job,
    )
}

/// Forms `job` with one node, as an agent does; returns the generation.
async fn join(coordinator: &str, job: &str) -> u64 {
    let security =
        ClientSecurity::plaintext().with_credentials(Credentials::bearer(CLUSTER_TOKEN).unwrap());
    let channel = security.wrap(
        tonic::transport::Endpoint::from_shared(format!("http://{coordinator}"))
            .unwrap()
            .connect()
            .await
            .unwrap(),
    );
    let response = RendezvousClient::new(channel)
        .join(pb::JoinRequest {
            job_id: job.to_owned(),
            node_id: "node-0".to_owned(),
            host: "127.0.0.1".to_owned(),
            local_world_size: 1,
            requested_node_rank: Some(0),
            config: Some(pb::RendezvousConfig {
                min_nodes: 1,
                max_nodes: 1,
                ..Default::default()
            }),
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    response.generation
}

fn script() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/python/tcpstore_client.py")
}

/// Runs the client script with `args`, off the runtime's threads.
async fn client(python: &Path, args: &[&str]) -> Output {
    let mut command = Command::new(python);
    command.arg(script()).args(args);
    tokio::task::spawn_blocking(move || command.output().unwrap())
        .await
        .unwrap()
}

fn stdout(output: &Output) -> String {
    assert!(
        output.status.success(),
        "client failed: {}\nstdout: {}\nstderr: {}",
        output.status,
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
    String::from_utf8_lossy(&output.stdout).into_owned()
}

fn torch() -> Option<PathBuf> {
    peers::peers_python(&["torch"])
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn torch_client_runs_every_operation() {
    let Some(python) = torch() else { return };
    let h = Harness::start("tcpstore-ops").await;
    let out = stdout(&client(&python, &[&h.port(), "ops"]).await);
    assert!(out.contains("every operation ok"), "{out}");
    // torch's client strips its own `/` from the keys the agent lists.
    assert!(
        out.contains("list_keys ['fresh', 'k', 'log', 'm1', 'm2', 'n']"),
        "{out}"
    );
}

/// The conformance suite (`tests/python/store_conformance.py`): every sequence, run against
/// torch's own TCPStore server and against the agent store with torch's client, observes the
/// same results and the same exception types; among them torch's largest key and value, and
/// one byte past each (the connection is closed, nothing is stored, a new client is served),
/// 16 concurrent clients and waiters woken by another client's set.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_agent_store_conforms_to_torchs_tcpstore() {
    let Some(python) = torch() else { return };
    let h = Harness::start("tcpstore-conformance").await;
    let conformance =
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/python/store_conformance.py");
    let mut command = Command::new(&python);
    command.arg(conformance).arg(h.port());
    let out = tokio::task::spawn_blocking(move || command.output().unwrap())
        .await
        .unwrap();
    let text = stdout(&out);
    assert!(
        text.contains("conformance: 7 of 7 sequences equal"),
        "{text}"
    );
}

/// What this test binary logs (the agent store's `tracing` events), for the tests that
/// assert on a log line; installed once.
fn logs() -> std::sync::Arc<std::sync::Mutex<Vec<u8>>> {
    static LOGS: std::sync::OnceLock<std::sync::Arc<std::sync::Mutex<Vec<u8>>>> =
        std::sync::OnceLock::new();
    LOGS.get_or_init(|| {
        let buffer = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
        let writer = std::sync::Arc::clone(&buffer);
        tracing_subscriber::fmt()
            .with_max_level(tracing::Level::WARN)
            .with_ansi(false)
            .with_writer(move || Capture(std::sync::Arc::clone(&writer)))
            .init();
        buffer
    })
    .clone()
}

struct Capture(std::sync::Arc<std::sync::Mutex<Vec<u8>>>);

impl Write for Capture {
    fn write(&mut self, bytes: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(bytes);
        Ok(bytes.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// A set the coordinator refuses (a value within torch's limits but over the coordinator's
/// `max_value_bytes`, set low here) is never dropped quietly: torch's set gets no reply, so
/// the agent closes the client's connection (its next call raises `DistNetworkError`, as
/// after a refusal by torch's own server), stores nothing, and logs why.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_refused_set_closes_the_connection_and_is_logged() {
    let Some(python) = torch() else { return };
    let logs = logs();
    let config = muster_coordinator::Config {
        max_value_bytes: 16 << 10,
        ..muster_coordinator::Config::default()
    };
    let h = Harness::start_with("tcpstore-refused", config).await;
    let out = stdout(&client(&python, &[&h.port(), "refused-set", "32768"]).await);
    assert!(out.contains("next call DistNetworkError"), "{out}");
    assert!(out.contains("stored False"), "{out}");
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let text = String::from_utf8_lossy(&logs.lock().unwrap()).into_owned();
        if text.contains("agent store connection closed")
            && text.contains("value is 32768 bytes; the limit is 16384 (max_value_bytes)")
        {
            break;
        }
        assert!(Instant::now() < deadline, "not logged:\n{text}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Runs `program` with `args` detached from this process (`setsid -f`: its parent exits, so
/// it is no descendant of the test, which plays the agent; it starts only once it is not),
/// its stdout into a file; returns that output once it has a line.
async fn outsider(program: &Path, args: &[&str], name: &str) -> String {
    let dir = std::env::temp_dir().join(format!("muster-outsider-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    // Writable by another user, for the outsider run as one.
    std::fs::set_permissions(&dir, std::os::unix::fs::PermissionsExt::from_mode(0o777)).unwrap();
    let out = dir.join("out");
    // It says its pid, then waits for `go`, which comes once it is no longer a descendant of
    // this process (`setsid -f`'s parent may not have exited yet when it starts).
    let mut command = Command::new("setsid");
    command
        .arg("-f")
        .arg("sh")
        .arg("-c")
        .arg(
            r#"dir="$1"; shift; echo $$ > "$dir/pid"; while [ ! -e "$dir/go" ]; do sleep 0.01; done; exec "$@" > "$dir/out" 2>/dev/null"#,
        )
        .arg("sh")
        .arg(&dir)
        .arg(program)
        .args(args);
    let status = command.status().unwrap();
    assert!(status.success(), "setsid -f: {status}");
    let deadline = Instant::now() + Duration::from_secs(60);
    let pid: u32 = loop {
        let text = std::fs::read_to_string(dir.join("pid")).unwrap_or_default();
        if let Ok(pid) = text.trim().parse() {
            break pid;
        }
        assert!(Instant::now() < deadline, "the outsider never started");
        tokio::time::sleep(Duration::from_millis(10)).await;
    };
    while muster_agent::procfs::descendants(std::process::id()).contains(&pid) {
        assert!(Instant::now() < deadline, "pid {pid} stayed a descendant");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    std::fs::write(dir.join("go"), b"go").unwrap();
    loop {
        let text = std::fs::read_to_string(&out).unwrap_or_default();
        if text.ends_with('\n') {
            let _ = std::fs::remove_dir_all(&dir);
            return text;
        }
        assert!(
            Instant::now() < deadline,
            "the outsider never answered: {text:?}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Only the agent's own workers and their children use the job's store: a process of the same
/// user that is not one of them (torch's client, detached from the agent) gets torch's
/// connection error, as does one of another user (a raw client); the agent logs each with
/// its pid and uid; its own children (every other test here) are served.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_outsiders_connection_is_refused_and_named() {
    let logs = logs();
    let h = Harness::start("tcpstore-outsider").await;
    h.store_key("secret", b"job data").await;
    let port = h.port();
    // A refusal names the pids holding the socket (a shell's children inherit it) and uid.
    let logged = |pid: String, uid: u32| {
        let logs = std::sync::Arc::clone(&logs);
        async move {
            let names = |l: &str| {
                l.contains("refused a connection")
                    && l.contains(&format!(" (uid {uid}), "))
                    && l.split([' ', ',']).any(|w| w == pid)
            };
            let deadline = Instant::now() + Duration::from_secs(10);
            loop {
                let text = String::from_utf8_lossy(&logs.lock().unwrap()).into_owned();
                if text.lines().any(names) {
                    return;
                }
                assert!(
                    Instant::now() < deadline,
                    "no refusal naming pid {pid}, uid {uid}:\n{text}"
                );
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
    };
    let uid = std::os::unix::fs::MetadataExt::uid(&std::fs::metadata("/proc/self").unwrap());
    // The same user, with torch's own client.
    if let Some(python) = torch() {
        let script = script();
        let out = outsider(
            &python,
            &[script.to_str().unwrap(), &port, "try", "secret"],
            "torch",
        )
        .await;
        let pid = out
            .trim()
            .strip_prefix("raised DistNetworkError pid ")
            .unwrap_or_else(|| panic!("the outsider was served: {out}"));
        logged(pid.to_owned(), uid).await;
    }
    // Another user, with a raw client (bash's /dev/tcp): the handshake and a ping get no
    // answer, the connection is closed.
    let raw = format!(
        r#"exec 3<>/dev/tcp/127.0.0.1/{port} || {{ echo cannot connect; exit; }}; printf '\x00\xce\xf7\x85\x3c\x0d\x2a\x00\x00\x00' >&3; if [ -n "$(timeout 5 head -c 4 <&3 | od -An -tx1)" ]; then echo "answered $$"; else echo "closed $$"; fi"#
    );
    if uid == 0 && Command::new("setpriv").arg("--version").output().is_ok() {
        let out = outsider(
            Path::new("setpriv"),
            &[
                "--reuid=65534",
                "--regid=65534",
                "--clear-groups",
                "bash",
                "-c",
                &raw,
            ],
            "nobody",
        )
        .await;
        let pid = out
            .trim()
            .strip_prefix("closed ")
            .unwrap_or_else(|| panic!("the outsider was answered: {out}"));
        logged(pid.to_owned(), 65534).await;
    } else {
        eprintln!("skipped: another user's outsider needs root and setpriv");
    }
    // The same user, raw, for the record of what it sees.
    let out = outsider(Path::new("bash"), &["-c", &raw], "raw").await;
    assert!(out.starts_with("closed "), "{out}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn blocking_get_and_wait_time_out_with_torchs_error() {
    let Some(python) = torch() else { return };
    let h = Harness::start("tcpstore-timeout").await;
    let out = stdout(&client(&python, &[&h.port(), "wait-timeout"]).await);
    for what in ["get", "wait"] {
        let line = out
            .lines()
            .find(|l| l.starts_with(&format!("{what} ")))
            .unwrap_or_else(|| panic!("no {what} line: {out}"));
        assert!(line.contains("DistStoreError after"), "{line}");
        let seconds: f64 = line
            .split_whitespace()
            .nth(3)
            .and_then(|s| s.parse().ok())
            .unwrap_or_else(|| panic!("{line}"));
        // The client's timeout is 1 s: its error comes at that time, not after a hang.
        assert!((0.9..3.0).contains(&seconds), "{line}");
    }
    assert!(out.contains("after 1"), "{out}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_blocked_get_returns_when_another_client_sets_the_key() {
    let Some(python) = torch() else { return };
    let h = Harness::start("tcpstore-wakeup").await;
    let port = h.port();
    let waiter = {
        let python = python.clone();
        let port = port.clone();
        tokio::spawn(async move { client(&python, &[&port, "wait-for", "late"]).await })
    };
    tokio::time::sleep(Duration::from_secs(3)).await;
    stdout(&client(&python, &[&port, "set", "late", "here"]).await);
    let out = stdout(&waiter.await.unwrap());
    assert!(out.starts_with("got here after"), "{out}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrent_adds_from_eight_processes_are_exact() {
    let Some(python) = torch() else { return };
    let h = Harness::start("tcpstore-adds").await;
    let port = h.port();
    let clients: Vec<_> = (0..8)
        .map(|_| {
            let python = python.clone();
            let port = port.clone();
            tokio::spawn(async move { client(&python, &[&port, "add", "count", "25"]).await })
        })
        .collect();
    for c in clients {
        stdout(&c.await.unwrap());
    }
    let kv = job_kv(&h.coordinator, &h.job, &h.job);
    let key = format!("torch/g{}/count", h.generation);
    assert_eq!(kv.get(&key).await.unwrap(), Some(b"200".to_vec()));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn compare_set_races_have_exactly_one_winner() {
    let Some(python) = torch() else { return };
    let h = Harness::start("tcpstore-cas").await;
    let port = h.port();
    let clients: Vec<_> = (0..8)
        .map(|i| {
            let python = python.clone();
            let port = port.clone();
            tokio::spawn(async move {
                client(&python, &[&port, "cas", "leader", &format!("rank{i}")]).await
            })
        })
        .collect();
    let mut winners = 0;
    for c in clients {
        let out = stdout(&c.await.unwrap());
        if out.trim() == "won" {
            winners += 1;
        } else {
            assert_eq!(out.trim(), "lost");
        }
    }
    assert_eq!(winners, 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn torch_and_the_sdk_see_the_same_keys() {
    let Some(python) = torch() else { return };
    let h = Harness::start("tcpstore-doors").await;
    let kv = job_kv(&h.coordinator, &h.job, &h.job);
    let prefix = format!("torch/g{}/", h.generation);
    // torch -> SDK: a value and a counter.
    stdout(&client(&python, &[&h.port(), "set", "from-torch", "t"]).await);
    assert_eq!(
        kv.get(&format!("{prefix}from-torch")).await.unwrap(),
        Some(b"t".to_vec())
    );
    stdout(&client(&python, &[&h.port(), "add", "shared-count", "3"]).await);
    assert_eq!(
        kv.add(&format!("{prefix}shared-count"), 1).await.unwrap(),
        4
    );
    // SDK -> torch.
    kv.set(&format!("{prefix}from-sdk"), "s").await.unwrap();
    let out = stdout(&client(&python, &[&h.port(), "get", "from-sdk"]).await);
    assert_eq!(out.trim(), "value s");
    let out = stdout(&client(&python, &[&h.port(), "get", "shared-count"]).await);
    assert_eq!(out.trim(), "value 4");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_blocked_queue_pop_gets_a_later_push() {
    let Some(python) = torch() else { return };
    let h = Harness::start("tcpstore-queue").await;
    let port = h.port();
    let popper = {
        let python = python.clone();
        let port = port.clone();
        tokio::spawn(async move { client(&python, &[&port, "pop", "jobs"]).await })
    };
    tokio::time::sleep(Duration::from_secs(3)).await;
    stdout(&client(&python, &[&port, "push", "jobs", "item"]).await);
    assert_eq!(stdout(&popper.await.unwrap()).trim(), "popped item");
}

/// Sends `bytes` on a fresh connection and reads until the agent closes it.
fn refused(port: u16, bytes: &[u8]) -> (String, Duration) {
    let started = Instant::now();
    let mut socket = TcpStream::connect(("127.0.0.1", port)).unwrap();
    socket
        .set_read_timeout(Some(Duration::from_secs(10)))
        .unwrap();
    socket.write_all(bytes).unwrap();
    let mut reply = Vec::new();
    socket
        .read_to_end(&mut reply)
        .expect("the agent closes the connection, it does not hang");
    (
        String::from_utf8_lossy(&reply).into_owned(),
        started.elapsed(),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_bad_handshake_is_refused_at_once_and_others_are_still_served() {
    let h = Harness::start("tcpstore-handshake").await;
    let port = h.store.port();
    tokio::task::spawn_blocking(move || {
        // A bad magic number.
        let mut bad = vec![0u8];
        bad.extend_from_slice(&0xDEAD_BEEFu32.to_le_bytes());
        let (text, took) = refused(port, &bad);
        assert!(text.contains("expected 0x3C85F7CE"), "{text}");
        assert!(took < Duration::from_secs(2), "{took:?}");
        // Another protocol (an HTTP request): no handshake at all.
        let (text, _) = refused(port, b"GET / HTTP/1.1\r\n\r\n");
        assert!(text.contains("VALIDATE"), "{text}");
        // A validated client with a query type this protocol does not have: closed without
        // a word (torch's client would read text as its reply), as torch's server does.
        let mut unknown = vec![0u8];
        unknown.extend_from_slice(&0x3C85_F7CEu32.to_le_bytes());
        unknown.push(99);
        let (text, took) = refused(port, &unknown);
        assert!(text.is_empty(), "{text}");
        assert!(took < Duration::from_secs(2), "{took:?}");
        // A good client after all that: validate, then ping is echoed.
        let mut socket = TcpStream::connect(("127.0.0.1", port)).unwrap();
        let mut hello = vec![0u8];
        hello.extend_from_slice(&0x3C85_F7CEu32.to_le_bytes());
        hello.push(13);
        hello.extend_from_slice(&42u32.to_le_bytes());
        socket.write_all(&hello).unwrap();
        let mut nonce = [0u8; 4];
        socket.read_exact(&mut nonce).unwrap();
        assert_eq!(u32::from_le_bytes(nonce), 42);
    })
    .await
    .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_store_listens_on_loopback_and_stops_on_shutdown() {
    let h = Harness::start("tcpstore-stop").await;
    assert!(h.store.addr().ip().is_loopback());
    let port = h.store.port();
    h.store.shutdown().await;
    assert!(TcpStream::connect(("127.0.0.1", port)).is_err());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_store_holding_another_jobs_token_cannot_touch_this_jobs_keys() {
    let Some(python) = torch() else { return };
    let h = Harness::start("tcpstore-mine").await;
    // A store for this job whose backend carries the token of another job.
    let foreign = AgentStore::start(
        job_kv(&h.coordinator, &h.job, "tcpstore-other"),
        h.generation,
    )
    .unwrap();
    let port = foreign.port().to_string();
    let output = client(&python, &[&port, "get", "anything"]).await;
    assert!(
        !output.status.success(),
        "{}",
        String::from_utf8_lossy(&output.stdout)
    );
    // The refused client did not stop the job's own store.
    stdout(&client(&python, &[&h.port(), "set", "still", "served"]).await);
    let kv = job_kv(&h.coordinator, &h.job, &h.job);
    let key = format!("torch/g{}/still", h.generation);
    assert_eq!(kv.get(&key).await.unwrap(), Some(b"served".to_vec()));
}
