//! The `muster-coordinator` command: parses flags, a config file and the environment, then
//! serves. `src/main.rs` and the Python package's `muster-coordinator` entry point both call
//! [`main`].

use crate::config::{Config, Endpoints, Layer, StoreKind};
use clap::Parser;
use std::ffi::OsString;
use std::net::SocketAddr;
use std::path::PathBuf;

/// muster's coordinator daemon: rendezvous, ranks, barriers, key-value store and NCCL unique
/// ids for distributed training jobs.
#[derive(Parser, Debug)]
#[command(name = "muster-coordinator", version)]
struct Args {
    /// Address to serve gRPC on [default: 127.0.0.1:29470; use 0.0.0.0:29470 for other hosts].
    #[arg(long)]
    listen: Option<SocketAddr>,
    /// TOML config file (keys: listen, heartbeat_timeout_ms, last_call_ms, join_timeout_ms,
    /// max_value_bytes, max_job_bytes, max_message_bytes, store, etcd_endpoints, etcd_prefix,
    /// etcd_ca, etcd_cert, etcd_key, etcd_user, etcd_password_file, advertise_addr,
    /// lease_ttl_ms, metrics_addr, web_addr, max_connections, max_streams_per_connection,
    /// max_connections_per_peer, handshake_timeout_ms, max_total_bytes, max_jobs,
    /// nccl_ranks_per_root, finished_job_ttl_ms, health_addr, tls_cert, tls_key, tls_client_ca, auth_token_file,
    /// insecure).
    #[arg(long, env = "MUSTER_COORDINATOR_CONFIG")]
    config: Option<PathBuf>,
    /// A worker silent for this long is marked failed [default: 10000].
    #[arg(long)]
    heartbeat_timeout_ms: Option<u64>,
    /// Default last-call window of a rendezvous round [default: 30000].
    #[arg(long)]
    last_call_ms: Option<u64>,
    /// Default join timeout of a rendezvous round [default: 600000].
    #[arg(long)]
    join_timeout_ms: Option<u64>,
    /// Where durable state (key-value data, unique ids, shared values) is kept: memory (lost
    /// on exit) or etcd [default: memory].
    #[arg(long, value_name = "memory|etcd")]
    store: Option<StoreKind>,
    /// etcd client endpoints, comma-separated: host:port (TLS when a TLS option is set) or
    /// http(s)://host:port. Required with --store etcd.
    #[arg(long, value_name = "HOST:PORT,...")]
    etcd_endpoints: Option<Endpoints>,
    /// Prefix of every etcd key this coordinator writes [default: /muster/].
    #[arg(long)]
    etcd_prefix: Option<String>,
    /// CA certificate (PEM) for etcd's server certificate; turns TLS on.
    #[arg(long)]
    etcd_ca: Option<PathBuf>,
    /// Client certificate (PEM) for mutual TLS with etcd (with --etcd-key).
    #[arg(long)]
    etcd_cert: Option<PathBuf>,
    /// Client private key (PEM) for mutual TLS with etcd (with --etcd-cert).
    #[arg(long)]
    etcd_key: Option<PathBuf>,
    /// etcd user name (with --etcd-password-file).
    #[arg(long)]
    etcd_user: Option<String>,
    /// File holding the etcd user's password (passwords are never taken on the command line).
    #[arg(long)]
    etcd_password_file: Option<PathBuf>,
    /// With --store etcd: the address clients reach this replica at, which the other
    /// replicas name when it leads [default: the listen address].
    #[arg(long, value_name = "HOST:PORT")]
    advertise_addr: Option<String>,
    /// With --store etcd: the leader election's lease TTL; a dead leader is replaced within
    /// about this long, and a leader cut off from etcd this long steps down [default: 3000].
    #[arg(long)]
    lease_ttl_ms: Option<u64>,
    /// Address to serve Prometheus metrics on (`GET /metrics`, plain HTTP) [default: none].
    #[arg(long, value_name = "HOST:PORT")]
    metrics_addr: Option<SocketAddr>,
    /// Address to serve the live web view on (`GET /`, plain HTTP, read-only: jobs, nodes,
    /// ranks, pending barriers and who they wait for) [default: none].
    #[arg(long, value_name = "HOST:PORT")]
    web_addr: Option<SocketAddr>,
    /// Address of a plaintext gRPC listener serving only grpc.health.v1, for probes that
    /// cannot speak TLS (Kubernetes' gRPC probes) [default: none].
    #[arg(long, value_name = "HOST:PORT")]
    health_addr: Option<SocketAddr>,
    /// Most client connections served at once; more wait in the listen backlog
    /// [default: 16384].
    #[arg(long)]
    max_connections: Option<usize>,
    /// Most concurrent gRPC streams (calls) per connection [default: 16384].
    #[arg(long)]
    max_streams_per_connection: Option<u32>,
    /// Most connections from one peer IP address; more from it are closed at once
    /// [default: 1024].
    #[arg(long)]
    max_connections_per_peer: Option<usize>,
    /// A connection that has not finished its TLS and HTTP/2 handshakes and sent its first
    /// call within this long is closed, freeing its slot [default: 5000].
    #[arg(long)]
    handshake_timeout_ms: Option<u64>,
    /// Largest gRPC message the coordinator accepts, in bytes (at most 1 GiB; at least twice
    /// max_value_bytes plus 64 KiB) [default: 25165824].
    #[arg(long)]
    max_message_bytes: Option<usize>,
    /// Largest value in a job's key-value store or a shared value, in bytes
    /// [default: 8388608, torch's TCPStore limit].
    #[arg(long)]
    max_value_bytes: Option<usize>,
    /// Largest total of one job's key-value store, in bytes [default: 67108864].
    #[arg(long)]
    max_job_bytes: Option<usize>,
    /// Largest total of stored bytes (key-value data and published values) over all jobs
    /// [default: 1073741824].
    #[arg(long)]
    max_total_bytes: Option<usize>,
    /// Most jobs held at once; creating more is refused until finished ones expire
    /// [default: 10000].
    #[arg(long)]
    max_jobs: Option<usize>,
    /// Ranks per NCCL bootstrap root: an NCCL communicator of more ranks bootstraps through
    /// one unique id per this many (ncclCommInitRankScalable, NCCL 2.23 or newer); 0 keeps
    /// one root at any size [default: 128, PyTorch's TORCH_NCCL_RANKS_PER_ROOT].
    #[arg(long)]
    nccl_ranks_per_root: Option<u32>,
    /// A finished, failed or cancelled job, or a rendezvous round no node waits in, is removed
    /// (with its record and stored data) this long after it got there; DescribeJob then says
    /// it expired [default: 3600000].
    #[arg(long)]
    finished_job_ttl_ms: Option<u64>,
    /// Server certificate chain (PEM): serve TLS (with --tls-key).
    #[arg(long, value_name = "FILE", help_heading = "Security")]
    tls_cert: Option<PathBuf>,
    /// Private key (PEM) of --tls-cert.
    #[arg(long, value_name = "FILE", help_heading = "Security")]
    tls_key: Option<PathBuf>,
    /// CA (PEM) that signed every client's certificate: require mutual TLS.
    #[arg(long, value_name = "FILE", help_heading = "Security")]
    tls_client_ca: Option<PathBuf>,
    /// File holding the cluster token (16+ printable characters): every call but health must
    /// then send `authorization: Bearer <token>`, or a job token derived from it for workers
    /// (tokens are never taken on the command line).
    #[arg(long, value_name = "FILE", help_heading = "Security")]
    auth_token_file: Option<PathBuf>,
    /// Serve a non-loopback address without TLS and authentication, which is otherwise
    /// refused (anyone who reaches it can join jobs and read their NCCL unique ids).
    #[arg(long, help_heading = "Security")]
    insecure: bool,
    /// Runtime threads: 1 runs everything on one thread, 0 means one per core [default: 0].
    #[arg(long, default_value_t = 0)]
    worker_threads: usize,
    /// Log filter (tracing's EnvFilter syntax), also read from RUST_LOG [default: info].
    #[arg(long)]
    log: Option<String>,
}

const EX_USAGE: u8 = 64;

fn load(args: &Args) -> Result<Config, String> {
    let mut config = Config::default();
    if let Some(path) = &args.config {
        config = config.apply(&Layer::from_file(path)?);
    }
    config = config.apply(&Layer::from_env(|k| std::env::var(k).ok())?);
    config = config.apply(&Layer {
        listen: args.listen,
        heartbeat_timeout_ms: args.heartbeat_timeout_ms,
        last_call_ms: args.last_call_ms,
        join_timeout_ms: args.join_timeout_ms,
        store: args.store,
        etcd_endpoints: args.etcd_endpoints.clone(),
        etcd_prefix: args.etcd_prefix.clone(),
        etcd_ca: args.etcd_ca.clone(),
        etcd_cert: args.etcd_cert.clone(),
        etcd_key: args.etcd_key.clone(),
        etcd_user: args.etcd_user.clone(),
        etcd_password_file: args.etcd_password_file.clone(),
        advertise_addr: args.advertise_addr.clone(),
        lease_ttl_ms: args.lease_ttl_ms,
        metrics_addr: args.metrics_addr,
        web_addr: args.web_addr,
        max_connections: args.max_connections,
        max_streams_per_connection: args.max_streams_per_connection,
        max_connections_per_peer: args.max_connections_per_peer,
        handshake_timeout_ms: args.handshake_timeout_ms,
        max_message_bytes: args.max_message_bytes,
        max_value_bytes: args.max_value_bytes,
        max_job_bytes: args.max_job_bytes,
        max_total_bytes: args.max_total_bytes,
        max_jobs: args.max_jobs,
        nccl_ranks_per_root: args.nccl_ranks_per_root,
        finished_job_ttl_ms: args.finished_job_ttl_ms,
        health_addr: args.health_addr,
        tls_cert: args.tls_cert.clone(),
        tls_key: args.tls_key.clone(),
        tls_client_ca: args.tls_client_ca.clone(),
        auth_token_file: args.auth_token_file.clone(),
        insecure: args.insecure.then_some(true),
    });
    config.validate()?;
    // Read now, so that a missing or weak token exits 64 like any bad setting.
    if let Some(path) = &config.auth_token_file {
        let token = muster_proto::security::read_token_file(path)?;
        config.auth = crate::auth::Auth::with_cluster_token(token);
    }
    Ok(config)
}

/// Runs the command with `args` (the program name first) and returns its exit status: a bad
/// flag is one line and 64, like every bad setting (`--help` and `--version` print and exit
/// 0).
pub fn main(args: impl IntoIterator<Item = OsString>) -> u8 {
    let args = match Args::try_parse_from(args) {
        Ok(args) => args,
        Err(e) => {
            use clap::error::ErrorKind;
            if matches!(e.kind(), ErrorKind::DisplayHelp | ErrorKind::DisplayVersion) {
                // Nothing useful to do when stdout is gone.
                let _ = e.print();
                return 0;
            }
            eprintln!(
                "muster-coordinator: {}",
                muster_core::error_chain::usage_line(&e.to_string())
            );
            return EX_USAGE;
        }
    };
    let filter = args
        .log
        .clone()
        .or_else(|| std::env::var("RUST_LOG").ok())
        .unwrap_or_else(|| "info".into());
    // Flushes unexported spans when main returns (the runtime below is gone by then; the
    // exporter runs on its own).
    let _telemetry = muster_telemetry::traces::init(
        "muster-coordinator",
        tracing_subscriber::EnvFilter::new(filter),
    );
    let config = match load(&args) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("muster-coordinator: {e}");
            return EX_USAGE;
        }
    };
    let runtime = match args.worker_threads {
        1 => tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build(),
        0 => tokio::runtime::Builder::new_multi_thread()
            .enable_all()
            .build(),
        n => tokio::runtime::Builder::new_multi_thread()
            .worker_threads(n)
            .enable_all()
            .build(),
    };
    let runtime = match runtime {
        Ok(r) => r,
        Err(e) => {
            eprintln!("muster-coordinator: cannot start the runtime: {e}");
            return 1;
        }
    };
    let result = runtime.block_on(async move {
        // The store first: a coordinator whose etcd refuses it (its user, its prefix) never
        // listens. One that etcd does not answer yet serves as a follower, refusing every
        // call as not the leader until it is elected (`store::open`).
        let store = crate::store::open(&config).await?;
        let listener = tokio::net::TcpListener::bind(config.listen)
            .await
            .map_err(|e| anyhow::anyhow!("cannot listen on {}: {e}", config.listen))?;
        // Handlers are installed before serving, so a signal never meets the default action.
        let shutdown = shutdown_signal()?;
        // systemd (Type=notify): ready once bound (over etcd, after the store's first answer
        // or its bounded wait); STOPPING=1 when a signal starts the drain. No-ops outside
        // systemd.
        let _watchdog = muster_telemetry::systemd::spawn_watchdog();
        muster_telemetry::systemd::ready(&format!("listening on {}", config.listen));
        // After the signal, in-flight calls get DRAIN_GRACE to finish; long waits (joins,
        // barriers, waiting gets) cannot, so returning then drops them with the runtime and
        // their clients see the connection close (and retry elsewhere) well within
        // Kubernetes' 30 s and the units' TimeoutStopSec. Over etcd a leader resigns at the
        // signal, within DRAIN_GRACE (`ha::RESIGN_TIMEOUT`), so a standby takes over at once.
        const DRAIN_GRACE: std::time::Duration = std::time::Duration::from_secs(2);
        let (signalled, drain_started) = tokio::sync::oneshot::channel::<()>();
        let shutdown = async move {
            shutdown.await;
            muster_telemetry::systemd::stopping("draining in-flight calls");
            let _ = signalled.send(());
        };
        let serving = crate::serve_with_store(listener, config, store, shutdown);
        tokio::select! {
            result = serving => result,
            Ok(()) = async move {
                drain_started.await?;
                tokio::time::sleep(DRAIN_GRACE).await;
                Ok::<(), tokio::sync::oneshot::error::RecvError>(())
            } => {
                tracing::warn!("calls still in flight {DRAIN_GRACE:?} after the signal: cut");
                Ok(())
            }
        }
    });
    match result {
        Ok(()) => 0,
        Err(e) => {
            eprintln!("muster-coordinator: {e:#}");
            1
        }
    }
}

/// Installs SIGINT and SIGTERM handlers; the future completes on either.
fn shutdown_signal() -> anyhow::Result<impl std::future::Future<Output = ()>> {
    use tokio::signal::unix::{SignalKind, signal};
    let mut term = signal(SignalKind::terminate())?;
    let mut int = signal(SignalKind::interrupt())?;
    Ok(async move {
        tokio::select! {
            _ = term.recv() => tracing::info!("SIGTERM: shutting down"),
            _ = int.recv() => tracing::info!("SIGINT: shutting down"),
        }
    })
}
