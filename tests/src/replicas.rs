//! Several `muster-coordinator --store etcd` processes (replicas) on one etcd, for the
//! high-availability tests: find the leader through `grpc.health.v1`, SIGKILL, SIGSTOP,
//! SIGCONT or restart a replica, and dump every replica's log when something goes wrong.
//!
//! Each replica listens on a free loopback port and advertises that address, so followers
//! name it as the leader. Its stderr (tracing output) goes to a log file in a temporary
//! directory (appended to across restarts); [`Replicas::logs`] returns the tails for panic
//! messages. Dropping a [`Replicas`] SIGKILLs every replica and removes the directory.
//!
//! The health check is a hand-made gRPC call (`/grpc.health.v1.Health/Check` over a tonic
//! [`Channel`]): this crate has no `tonic-health` or `prost` dependency, and the two messages
//! are small enough to encode by hand.

use std::fs::OpenOptions;
use std::os::unix::process::CommandExt;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

use nix::sys::signal::Signal;
use tonic::transport::{Channel, Endpoint};

use crate::etcd::Etcd;

/// How long one health check may take: a SIGSTOPped replica accepts TCP connections (the
/// kernel does) but never answers, so every check is bounded.
const CHECK_TIMEOUT: Duration = Duration::from_millis(1000);

/// How long a (re)started replica may take to accept connections.
const START_TIMEOUT: Duration = Duration::from_secs(15);

/// What a replica's `grpc.health.v1` says about a service.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Health {
    /// SERVING: the leader (with its store reachable).
    Serving,
    /// NOT_SERVING: a follower, a replica without a leader, or one whose store is unreachable.
    NotServing,
    /// Any other answer: UNKNOWN, SERVICE_UNKNOWN, a gRPC error status or no answer at all
    /// (connection refused, a stopped process, a timeout), with what happened.
    Other(String),
}

/// One coordinator replica.
#[derive(Debug)]
struct Replica {
    /// `127.0.0.1:PORT`, listened on and advertised.
    addr: String,
    log: PathBuf,
    /// `None` while killed.
    child: Option<Child>,
    /// Whether it is SIGSTOPped (so that checks skip it and the drop can kill it cleanly).
    stopped: bool,
}

/// K coordinator replicas on one etcd.
#[derive(Debug)]
pub struct Replicas {
    replicas: Vec<Replica>,
    /// The flags every replica gets besides `--listen` and `--advertise-addr`.
    args: Vec<String>,
    dir: PathBuf,
    /// The host each replica advertises instead of 127.0.0.1 (same port), if any.
    advertise_host: Option<String>,
}

impl Replicas {
    /// Starts `k` replicas `muster-coordinator --store etcd --etcd-endpoints <etcd>
    /// --lease-ttl-ms <ttl> --listen <own> --advertise-addr <own> <extra>`, and waits until each
    /// accepts connections (not until one leads: see [`Replicas::wait_leader`]).
    pub fn start(etcd: &Etcd, k: usize, ttl: Duration, extra: &[&str]) -> Self {
        Self::start_advertising(etcd, k, ttl, extra, None)
    }

    /// [`Replicas::start`], each replica advertising `host:<its port>` (the leader hint
    /// followers give) instead of its listening address: for clients that reach the replicas
    /// through a forwarder on `host` (`tests/tests/fault_injection.rs`).
    pub fn start_advertising(
        etcd: &Etcd,
        k: usize,
        ttl: Duration,
        extra: &[&str],
        advertise_host: Option<&str>,
    ) -> Self {
        assert!(k >= 1, "at least one replica");
        static NEXT: AtomicU32 = AtomicU32::new(0);
        let dir = std::env::temp_dir().join(format!(
            "muster-replicas-{}-{}",
            std::process::id(),
            NEXT.fetch_add(1, Ordering::Relaxed)
        ));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir)
            .unwrap_or_else(|e| panic!("cannot create {}: {e}", dir.display()));
        let mut args: Vec<String> = vec![
            "--store".into(),
            "etcd".into(),
            "--etcd-endpoints".into(),
            etcd.endpoints_arg(),
            "--lease-ttl-ms".into(),
            ttl.as_millis().to_string(),
        ];
        args.extend(extra.iter().map(|s| (*s).to_owned()));
        let replicas = (0..k)
            .map(|i| Replica {
                addr: format!("127.0.0.1:{}", crate::free_port()),
                log: dir.join(format!("coordinator-{i}.log")),
                child: None,
                stopped: false,
            })
            .collect();
        let mut this = Self {
            replicas,
            args,
            dir,
            advertise_host: advertise_host.map(str::to_owned),
        };
        for i in 0..k {
            this.spawn(i);
        }
        for i in 0..k {
            this.wait_accepting(i);
        }
        this
    }

    /// How many replicas there are (running or not).
    pub fn len(&self) -> usize {
        self.replicas.len()
    }

    /// Whether there are none (never: [`Replicas::start`] starts at least one).
    pub fn is_empty(&self) -> bool {
        self.replicas.is_empty()
    }

    /// Replica `i`'s `127.0.0.1:PORT`.
    pub fn addr(&self, i: usize) -> &str {
        &self.replicas[i].addr
    }

    /// Every replica's address, comma-joined in replica order: what clients are given.
    pub fn addrs(&self) -> String {
        self.replicas
            .iter()
            .map(|r| r.addr.as_str())
            .collect::<Vec<_>>()
            .join(",")
    }

    /// Replica `i`'s pid (panics if it is killed).
    pub fn pid(&self, i: usize) -> u32 {
        self.replicas[i]
            .child
            .as_ref()
            .unwrap_or_else(|| panic!("replica {i} is not running"))
            .id()
    }

    /// Whether replica `i` runs (started and not killed; a stopped one runs).
    pub fn running(&self, i: usize) -> bool {
        self.replicas[i].child.is_some()
    }

    /// SIGKILLs replica `i` and reaps it. Killing a killed replica does nothing.
    pub fn kill(&mut self, i: usize) {
        let replica = &mut self.replicas[i];
        if let Some(mut child) = replica.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
        replica.stopped = false;
    }

    /// SIGSTOPs replica `i` (it keeps its connections and its port, and answers nothing), and
    /// returns once every thread of it has stopped: `kill` returns before the signal is acted
    /// on, and a request sent in between would be served by a replica the test believes
    /// stopped (`ha_failover`'s paused-leader test once saw its "paused" write applied).
    pub fn stop(&mut self, i: usize) {
        self.signal(i, Signal::SIGSTOP);
        self.replicas[i].stopped = true;
        let tasks = format!("/proc/{}/task", self.pid(i));
        let deadline = Instant::now() + Duration::from_secs(5);
        loop {
            let running = std::fs::read_dir(&tasks)
                .into_iter()
                .flatten()
                .flatten()
                .filter_map(|t| std::fs::read_to_string(t.path().join("stat")).ok())
                .filter(|stat| {
                    // `pid (comm) S ...`: the state follows the last ')'.
                    let state = stat.rsplit_once(')').map(|(_, rest)| rest.trim_start());
                    !state.is_some_and(|s| s.starts_with('T') || s.starts_with('t'))
                })
                .count();
            if running == 0 {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "replica {i}: {running} thread(s) still run 5 s after SIGSTOP"
            );
            std::thread::sleep(Duration::from_millis(1));
        }
    }

    /// SIGCONTs replica `i` after [`Replicas::stop`].
    pub fn cont(&mut self, i: usize) {
        self.signal(i, Signal::SIGCONT);
        self.replicas[i].stopped = false;
    }

    fn signal(&self, i: usize, signal: Signal) {
        let pid = i32::try_from(self.pid(i)).expect("pids fit in i32");
        nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid), signal)
            .unwrap_or_else(|e| panic!("cannot send {signal} to replica {i}: {e}"));
    }

    /// Kills replica `i` (if it runs) and starts it again with the same port and flags; returns
    /// once it accepts connections. The port is retried for a while if it is still held.
    pub fn restart(&mut self, i: usize) {
        self.kill(i);
        self.spawn(i);
        self.wait_accepting(i);
    }

    /// What replica `i` says about `service` ("" is the whole server).
    pub async fn health(&self, i: usize, service: &str) -> Health {
        if self.replicas[i].child.is_none() {
            return Health::Other("killed".into());
        }
        if self.replicas[i].stopped {
            return Health::Other("stopped".into());
        }
        health(&self.replicas[i].addr, service).await
    }

    /// The replicas that report SERVING for service "" right now (stopped and killed ones are
    /// not asked).
    pub async fn serving(&self) -> Vec<usize> {
        let mut out = Vec::new();
        for i in 0..self.replicas.len() {
            if self.health(i, "").await == Health::Serving {
                out.push(i);
            }
        }
        out
    }

    /// Waits until exactly one replica other than those in `except` reports SERVING, and
    /// returns it; panics with every replica's health and log after `timeout`.
    pub async fn wait_leader(&self, timeout: Duration, except: &[usize]) -> usize {
        let deadline = Instant::now() + timeout;
        loop {
            let serving: Vec<usize> = self
                .serving()
                .await
                .into_iter()
                .filter(|i| !except.contains(i))
                .collect();
            if let [leader] = serving[..] {
                return leader;
            }
            if Instant::now() >= deadline {
                panic!(
                    "no single leader (besides {except:?}) within {timeout:?}; serving: {serving:?}\n{}\n{}",
                    self.describe().await,
                    self.logs()
                );
            }
            tokio::time::sleep(Duration::from_millis(25)).await;
        }
    }

    /// Every replica's address and health, one per line, for messages.
    pub async fn describe(&self) -> String {
        let mut out = Vec::new();
        for i in 0..self.replicas.len() {
            out.push(format!(
                "replica {i} ({}): {:?}",
                self.replicas[i].addr,
                self.health(i, "").await
            ));
        }
        out.join("\n")
    }

    /// The last 8 KiB of every replica's log, for panic messages.
    pub fn logs(&self) -> String {
        self.replicas
            .iter()
            .enumerate()
            .map(|(i, r)| {
                format!(
                    "--- replica {i} ({}, {})\n{}",
                    r.addr,
                    r.log.display(),
                    crate::etcd::read_tail(&r.log)
                )
            })
            .collect::<Vec<_>>()
            .join("\n")
    }

    /// Starts replica `i` (not running).
    fn spawn(&mut self, i: usize) {
        let replica = &self.replicas[i];
        let log = OpenOptions::new()
            .create(true)
            .append(true)
            .open(&replica.log)
            .unwrap_or_else(|e| panic!("cannot open {}: {e}", replica.log.display()));
        let advertised = match &self.advertise_host {
            Some(host) => {
                let port = replica.addr.rsplit_once(':').map_or("", |(_, p)| p);
                format!("{host}:{port}")
            }
            None => replica.addr.clone(),
        };
        let bin = crate::coordinator_bin();
        let child = Command::new(&bin)
            .args(["--listen", &replica.addr, "--advertise-addr", &advertised])
            .args(&self.args)
            .env("NO_COLOR", "1")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::from(log))
            // Out of the test's process group: a Ctrl-C meant for cargo does not reach the
            // replicas before `Drop` does.
            .process_group(0)
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start {}: {e}", bin.display()));
        self.replicas[i].child = Some(child);
        self.replicas[i].stopped = false;
    }

    /// Waits until replica `i` accepts TCP connections; respawns it while it exits at startup
    /// (its port still held by a dying predecessor), and panics with the logs after
    /// [`START_TIMEOUT`].
    fn wait_accepting(&mut self, i: usize) {
        let deadline = Instant::now() + START_TIMEOUT;
        loop {
            if std::net::TcpStream::connect(&self.replicas[i].addr).is_ok() {
                return;
            }
            let exited = self.replicas[i]
                .child
                .as_mut()
                .and_then(|c| c.try_wait().ok().flatten());
            if Instant::now() >= deadline {
                panic!(
                    "replica {i} ({}) does not accept connections within {START_TIMEOUT:?} (exit: {exited:?})\n{}",
                    self.replicas[i].addr,
                    self.logs()
                );
            }
            if exited.is_some() {
                self.replicas[i].child = None;
                std::thread::sleep(Duration::from_millis(200));
                self.spawn(i);
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }
}

impl Drop for Replicas {
    fn drop(&mut self) {
        for i in 0..self.replicas.len() {
            self.kill(i);
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// What the coordinator at `addr` says about `service` in `grpc.health.v1` (one call on a
/// fresh connection, at most [`CHECK_TIMEOUT`]).
pub async fn health(addr: &str, service: &str) -> Health {
    match tokio::time::timeout(CHECK_TIMEOUT, check(addr, service)).await {
        Ok(Ok(status)) => match status {
            1 => Health::Serving,
            2 => Health::NotServing,
            0 => Health::Other("UNKNOWN".into()),
            3 => Health::Other("SERVICE_UNKNOWN".into()),
            n => Health::Other(format!("status {n}")),
        },
        Ok(Err(e)) => Health::Other(e),
        Err(_) => Health::Other(format!("no answer within {CHECK_TIMEOUT:?}")),
    }
}

/// One `/grpc.health.v1.Health/Check` call: the response's `status` field, or what failed.
async fn check(addr: &str, service: &str) -> Result<i32, String> {
    use std::future::poll_fn;
    use tonic::codegen::{Body as _, Service as _};

    let channel: Channel = Endpoint::from_shared(format!("http://{addr}"))
        .map_err(|e| e.to_string())?
        .connect_timeout(CHECK_TIMEOUT)
        .connect()
        .await
        .map_err(|e| format!("connect: {e}"))?;
    // HealthCheckRequest { string service = 1 }, in one uncompressed gRPC frame. The body is a
    // `String` (every byte is ASCII while names are shorter than 128 bytes).
    assert!(service.len() < 128 && service.is_ascii());
    let mut message = String::new();
    if !service.is_empty() {
        message.push('\n'); // field 1, length-delimited
        message.push(char::from(u8::try_from(service.len()).unwrap_or(0)));
        message.push_str(service);
    }
    let mut frame = String::from("\0\0\0\0");
    frame.push(char::from(u8::try_from(message.len()).unwrap_or(0)));
    frame.push_str(&message);
    let request = tonic::codegen::http::Request::builder()
        .method("POST")
        .uri(format!("http://{addr}/grpc.health.v1.Health/Check"))
        .header("content-type", "application/grpc")
        .header("te", "trailers")
        .body(tonic::body::Body::new(frame))
        .map_err(|e| e.to_string())?;
    let mut svc = channel;
    poll_fn(|cx| svc.poll_ready(cx))
        .await
        .map_err(|e| format!("not ready: {e}"))?;
    let response = svc.call(request).await.map_err(|e| format!("call: {e}"))?;
    let (parts, body) = response.into_parts();
    let mut body = std::pin::pin!(body);
    let mut data = Vec::new();
    let mut grpc_status = parts
        .headers
        .get("grpc-status")
        .and_then(|v| v.to_str().ok())
        .map(str::to_owned);
    let mut grpc_message = parts
        .headers
        .get("grpc-message")
        .and_then(|v| v.to_str().ok())
        .map(str::to_owned);
    while let Some(frame) = poll_fn(|cx| body.as_mut().poll_frame(cx)).await {
        let frame = frame.map_err(|e| format!("body: {e}"))?;
        match frame.into_data() {
            Ok(bytes) => data.extend_from_slice(&bytes),
            Err(frame) => {
                if let Ok(trailers) = frame.into_trailers() {
                    if let Some(v) = trailers.get("grpc-status").and_then(|v| v.to_str().ok()) {
                        grpc_status = Some(v.to_owned());
                    }
                    if let Some(v) = trailers.get("grpc-message").and_then(|v| v.to_str().ok()) {
                        grpc_message = Some(v.to_owned());
                    }
                }
            }
        }
    }
    match grpc_status.as_deref() {
        Some("0") => {}
        other => {
            return Err(format!(
                "grpc-status {other:?}: {}",
                grpc_message.unwrap_or_default()
            ));
        }
    }
    // HealthCheckResponse { ServingStatus status = 1 }: after the 5-byte frame header, either
    // nothing (UNKNOWN) or 0x08 and a one-byte varint.
    match data.get(5..) {
        Some([]) => Ok(0),
        Some([0x08, status, ..]) if *status < 0x80 => Ok(i32::from(*status)),
        _ => Err(format!("unexpected health response {data:?}")),
    }
}
