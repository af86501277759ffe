//! muster's coordinator: rendezvous, global and local rank assignment, worker sessions with
//! liveness, barriers, a per-job key-value store and NCCL unique-id distribution, served over
//! gRPC (`muster.v1`) with reflection and `grpc.health.v1`.
//!
//! The binary (`main.rs`) only parses configuration and calls [`serve`]; tests and the agent's
//! embedded coordinator call [`serve`] directly on a listener of their own.

pub mod auth;
pub mod cli;
pub mod config;
pub mod ha;
pub mod job;
pub mod limits;
pub mod metrics;
pub mod pool;
pub mod retention;
pub mod service;
pub mod store;
pub mod tenure;
pub mod web;

pub use config::Config;
/// Traces (`muster_telemetry::traces`), under the name the coordinator's modules use.
use muster_telemetry::traces as telemetry;
pub use store::election;
pub use store::{EtcdStore, MemoryStore, Store, StoreError};

use muster_proto::v1 as pb;
use service::{
    AgentsService, Coordinator, OpsService, RelayService, RendezvousService, SessionService,
    ValuesService,
};
use std::future::Future;
use std::sync::Arc;
use tokio::net::TcpListener;
use tonic::service::interceptor::InterceptedService;

/// Serves the coordinator on `listener` with an in-memory store until `shutdown` completes.
pub async fn serve(
    listener: TcpListener,
    config: Config,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> anyhow::Result<()> {
    serve_with_store(listener, config, Arc::new(MemoryStore::default()), shutdown).await
}

/// Serves the coordinator on `listener` over `store` until `shutdown` completes; in-flight
/// calls are then given until they finish (long waits are cut when the runtime ends).
///
/// Over etcd, the replica serves only while it leads (see [`ha`]); over memory, always.
pub async fn serve_with_store(
    listener: TcpListener,
    config: Config,
    store: Arc<dyn Store>,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> anyhow::Result<()> {
    let mut config = config;
    config.validate().map_err(anyhow::Error::msg)?;
    let addr = listener.local_addr()?;
    if config.auth_token_file.is_some() && !config.auth.is_on() {
        let path = config
            .auth_token_file
            .as_deref()
            .unwrap_or(std::path::Path::new(""));
        let token = muster_proto::security::read_token_file(path).map_err(anyhow::Error::msg)?;
        config.auth = auth::Auth::with_cluster_token(token);
    }
    // The listener actually bound decides, not the configured address (embedders bind their
    // own): see `Config::check_exposure`.
    config.check_exposure(addr).map_err(anyhow::Error::msg)?;
    let tls = server_tls(&config.tls)?;
    let secured = tls.is_some() && config.auth.is_on();
    if !addr.ip().is_loopback() && !secured {
        tracing::warn!(%addr, tls = tls.is_some(), auth = config.auth.is_on(),
            "--insecure: serving a non-loopback address without TLS and authentication; anyone who can reach it can join jobs and read their NCCL unique ids");
    }
    let auth = config.auth.clone();
    let max = config.max_message_bytes;
    let max_streams = config.max_streams_per_connection;
    // An unanswered HTTP/2 ping closes a connection, and a closed watch is a lost node at
    // once: so a ping may go unanswered for as long as a silent node is waited for
    // (heartbeat_timeout), or a stopped and resumed agent would be judged by the ping, not
    // by the timeout its operator chose.
    let ping_timeout = config
        .heartbeat_timeout
        .max(std::time::Duration::from_secs(5));
    let connection_limits = limits::ConnectionLimits {
        max: config.max_connections,
        per_peer: config.max_connections_per_peer,
        handshake_timeout: config.handshake_timeout,
    };
    let me = config
        .etcd
        .advertise_addr
        .clone()
        .unwrap_or_else(|| addr.to_string());
    let ttl = config.etcd.lease_ttl();
    // Bound before anything starts, so that a taken metrics port fails the start.
    let metrics_listener = match config.metrics_addr {
        Some(a) => Some(
            TcpListener::bind(a)
                .await
                .map_err(|e| anyhow::anyhow!("cannot listen on metrics address {a}: {e}"))?,
        ),
        None => None,
    };
    let web_listener = match config.web_addr {
        Some(a) => Some(
            TcpListener::bind(a)
                .await
                .map_err(|e| anyhow::anyhow!("cannot listen on web address {a}: {e}"))?,
        ),
        None => None,
    };
    let health_listener = match config.health_addr {
        Some(a) => Some(
            TcpListener::bind(a)
                .await
                .map_err(|e| anyhow::anyhow!("cannot listen on health address {a}: {e}"))?,
        ),
        None => None,
    };
    let store = store::timed(store, metrics::store_op);
    let coordinator = Coordinator::new(config, Arc::clone(&store));
    let durable = store.durable();
    let gate = ha::Gate::new(
        if durable {
            ha::Readiness::Following(None)
        } else {
            ha::Readiness::Serving
        },
        &me,
    );

    // Reflection in both versions: grpc.reflection.v1, and v1alpha for older grpcurl and
    // for grpcio-reflection's ready-made Python client.
    let reflection_builder = || {
        tonic_reflection::server::Builder::configure()
            .register_encoded_file_descriptor_set(muster_proto::FILE_DESCRIPTOR_SET)
            .register_encoded_file_descriptor_set(tonic_health::pb::FILE_DESCRIPTOR_SET)
    };
    let reflection = reflection_builder().build_v1()?;
    let reflection_alpha = reflection_builder().build_v1alpha()?;
    let (health_reporter, health) = tonic_health::server::health_reporter();
    // Task "health": mirrors the gate into grpc.health.v1 for "" and every muster service.
    // Ends with the runtime.
    let mut readiness = gate.subscribe();
    tokio::spawn(async move {
        loop {
            let status = match *readiness.borrow_and_update() {
                ha::Readiness::Serving => tonic_health::ServingStatus::Serving,
                ha::Readiness::Following(_) => tonic_health::ServingStatus::NotServing,
            };
            for name in std::iter::once("").chain(SERVICES.iter().copied()) {
                health_reporter.set_service_status(name, status).await;
            }
            if readiness.changed().await.is_err() {
                return;
            }
        }
    });
    // Cancelled when `shutdown` completes: the leadership resigns while calls drain.
    let stopping = tokio_util::sync::CancellationToken::new();
    let leadership = durable.then(|| {
        let (coordinator, store, gate, me, stop) = (
            Arc::clone(&coordinator),
            Arc::clone(&store),
            gate.clone(),
            me.clone(),
            stopping.clone(),
        );
        // Task "leadership": campaigns, loads the state, serves while leading, again after
        // every lost term; on shutdown resigns (within `ha::RESIGN_TIMEOUT`) and ends, and
        // serving waits for it.
        tokio::spawn(async move {
            ha::lead(coordinator, store.as_ref(), me, ttl, gate, stop).await;
        })
    });
    let shutdown = {
        let stopping = stopping.clone();
        async move {
            shutdown.await;
            stopping.cancel();
        }
    };
    // Every muster service: credentials first (so that strangers learn nothing, not even the
    // leader), then the HA gate. Reflection needs any valid credential (grpcurl sends `-H
    // authorization`) but no leadership; health is open to everyone, for probes.
    let guard = |service: &'static str, scope: auth::Scope| {
        let (auth, gate) = (auth.clone(), gate.clone());
        move |request: tonic::Request<()>| {
            let request = auth.check(request, service, scope)?;
            gate.check().map(|()| request)
        }
    };
    use auth::Scope::{Cluster, Job};
    let described = |service: &'static str| {
        let auth = auth.clone();
        move |request: tonic::Request<()>| auth.check(request, service, Job)
    };

    // Task "metrics": answers GET /metrics; aborted when serving ends.
    let metrics_task = metrics_listener.map(|listener| {
        if let Ok(a) = listener.local_addr() {
            tracing::info!(addr = %a, "metrics endpoint serving");
        }
        let coordinator = Arc::clone(&coordinator);
        tokio::spawn(muster_telemetry::metrics::serve_http(listener, move || {
            let coordinator = Arc::clone(&coordinator);
            async move { metrics::render(&state_snapshot(&coordinator).await) }
        }))
    });
    // Task "web": the live web view (web.rs); aborted when serving ends.
    let web_task = web_listener.map(|listener| {
        if let Ok(a) = listener.local_addr() {
            tracing::info!(addr = %a, "web view serving");
        }
        let view = web::View::new(Arc::clone(&coordinator), gate.clone());
        tokio::spawn(web::serve(listener, view))
    });
    // Task "health-listener": plaintext grpc.health.v1 only (no muster service, so no
    // credentials needed and nothing to protect); aborted when serving ends.
    let health_task = health_listener.map(|listener| {
        if let Ok(a) = listener.local_addr() {
            tracing::info!(addr = %a, "plaintext health endpoint serving");
        }
        let health = health.clone();
        tokio::spawn(async move {
            let served = tonic::transport::Server::builder()
                .add_service(health)
                .serve_with_incoming(tonic::transport::server::TcpIncoming::from(listener))
                .await;
            if let Err(e) = served {
                tracing::error!(%e, "the health endpoint failed");
            }
        })
    });
    // Task "expiry": removes jobs that have been finished, failed or cancelled for
    // --finished-job-ttl-ms (and their stored data); aborted when serving ends.
    let expiry_task = {
        let coordinator = Arc::clone(&coordinator);
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(coordinator.sweep_interval());
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                tick.tick().await;
                coordinator.expire_finished().await;
            }
        })
    };
    // Task "hang-watch": every HANG_TICK, finds jobs whose running generation made no
    // progress for their hang timeout, dumps their stacks and records the hang (a task per
    // hang, so one slow dump delays no other job); aborted when serving ends.
    let hang_task = {
        let coordinator = Arc::clone(&coordinator);
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(HANG_TICK);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                tick.tick().await;
                for job in coordinator.job_list() {
                    if let Some(due) = job.hang_due() {
                        tokio::spawn(async move {
                            if let Ok(dump) = job.dump_stacks(Default::default()).await {
                                job.record_hang(&due, &dump);
                            }
                        });
                    }
                }
            }
        })
    };
    let values = ValuesService(Arc::clone(&coordinator));
    tracing::info!(%addr, advertise = %me, store = if durable { "etcd" } else { "memory" }, "coordinator serving");
    let mut server = tonic::transport::Server::builder();
    if let Some(tls) = tls {
        server = server.tls_config(tls)?;
    }
    let served = server
        .tcp_nodelay(true)
        .http2_keepalive_interval(Some(std::time::Duration::from_secs(10)))
        .http2_keepalive_timeout(Some(ping_timeout))
        // Resource limits, all explicit (ARCHITECTURE.md, "Resource limits"): streams per
        // connection (clients queue calls beyond it), the header list of one call, message
        // sizes per service below, and connections at the acceptor. No per-call timeout:
        // joins, barriers and value fetches are long polls bounded by their own deadlines.
        .max_concurrent_streams(Some(max_streams))
        .http2_max_header_list_size(Some(Config::MAX_HEADER_LIST_BYTES))
        .layer(metrics::rpc_latency_layer())
        // A connection's first call disarms its handshake deadline (limits.rs).
        .layer(limits::FirstCallLayer)
        // An oversized request is refused naming max_message_bytes and its flag.
        .layer(limits::MessageSizeLayer { max })
        // A span per call, child of the caller's W3C trace context (telemetry.rs).
        .trace_fn(telemetry::server_span)
        .add_service(health)
        .add_service(InterceptedService::new(
            reflection,
            described("grpc.reflection.v1.ServerReflection"),
        ))
        .add_service(InterceptedService::new(
            reflection_alpha,
            described("grpc.reflection.v1alpha.ServerReflection"),
        ))
        .add_service(InterceptedService::new(
            pb::rendezvous_server::RendezvousServer::new(RendezvousService(Arc::clone(
                &coordinator,
            )))
            .max_decoding_message_size(max),
            // A job token's workers call Quorum (in-place recovery); every other method
            // refuses it in its handler (`auth::cluster_only`).
            guard("muster.v1.Rendezvous", Job),
        ))
        .add_service(InterceptedService::new(
            pb::session_server::SessionServer::new(SessionService(Arc::clone(&coordinator)))
                .max_decoding_message_size(max),
            guard("muster.v1.Session", Job),
        ))
        .add_service(InterceptedService::new(
            pb::relay_server::RelayServer::new(RelayService(Arc::clone(&coordinator)))
                .max_decoding_message_size(max),
            guard("muster.v1.Relay", Cluster),
        ))
        .add_service(InterceptedService::new(
            pb::key_value_server::KeyValueServer::new(values.clone())
                .max_decoding_message_size(max),
            guard("muster.v1.KeyValue", Job),
        ))
        .add_service(InterceptedService::new(
            pb::unique_ids_server::UniqueIdsServer::new(values.clone())
                .max_decoding_message_size(max),
            guard("muster.v1.UniqueIds", Job),
        ))
        .add_service(InterceptedService::new(
            pb::shared_values_server::SharedValuesServer::new(values)
                .max_decoding_message_size(max),
            guard("muster.v1.SharedValues", Job),
        ))
        .add_service(InterceptedService::new(
            pb::agents_server::AgentsServer::new(AgentsService(Arc::clone(&coordinator)))
                .max_decoding_message_size(max),
            guard("muster.v1.Agents", Cluster),
        ))
        .add_service(InterceptedService::new(
            pb::ops_server::OpsServer::new(OpsService(coordinator)).max_decoding_message_size(max),
            guard("muster.v1.Ops", Cluster),
        ))
        .serve_with_incoming_shutdown(
            // TCP_NODELAY on every accepted connection: barrier results are small writes.
            // Connections: a global cap, a per-peer cap and a handshake deadline.
            limits::limit_connections(
                tonic::transport::server::TcpIncoming::from(listener).with_nodelay(Some(true)),
                connection_limits,
            ),
            shutdown,
        )
        .await;
    expiry_task.abort();
    hang_task.abort();
    for task in [metrics_task, web_task, health_task].into_iter().flatten() {
        task.abort();
    }
    // Serving can also end on an error: resign then too. The task is bounded by
    // `ha::RESIGN_TIMEOUT` once stopped.
    stopping.cancel();
    if let Some(task) = leadership
        && let Err(e) = task.await
    {
        tracing::error!(%e, "the leadership task failed");
    }
    served?;
    tracing::info!("coordinator stopped");
    Ok(())
}

/// The coordinator's state as the metrics' gauges show it, read at scrape time through the ops
/// API's own handlers (so they show what `muster-agent status` shows). Here rather than in
/// `metrics.rs`, so that the metrics do not depend on the service that feeds them.
async fn state_snapshot(coordinator: &Arc<Coordinator>) -> metrics::StateSnapshot {
    use pb::ops_server::Ops as _;
    let ops = OpsService(Arc::clone(coordinator));
    let jobs = ops
        .list_jobs(tonic::Request::new(pb::ListJobsRequest {}))
        .await
        .map(|r| r.into_inner().jobs)
        .unwrap_or_default();
    let (mut ranks, mut training) = (vec![], vec![]);
    for s in &jobs {
        // As the gauges count them: jobs in a known state that have a generation.
        let known = !matches!(
            pb::RoundState::try_from(s.state),
            Err(_) | Ok(pb::RoundState::Unspecified)
        );
        if !known || s.world_size == 0 {
            continue;
        }
        let request = tonic::Request::new(pb::DescribeJobRequest {
            job_id: s.job_id.clone(),
            ..Default::default()
        });
        if let Ok(d) = ops.describe_job(request).await {
            let d = d.into_inner();
            if let Some(t) = d.training {
                training.push((s.job_id.clone(), t.ettr));
            }
            ranks.extend(d.ranks);
        }
    }
    let agents = ops
        .list_agents(tonic::Request::new(pb::ListAgentsRequest {}))
        .await
        .ok()
        .map(|a| a.get_ref().agents.len());
    metrics::StateSnapshot {
        jobs,
        ranks,
        agents,
        training,
    }
}

/// The listener's TLS settings, read from the PEM files (errors name the file).
fn server_tls(
    tls: &config::TlsConfig,
) -> anyhow::Result<Option<tonic::transport::ServerTlsConfig>> {
    use tonic::transport::{Certificate, Identity, ServerTlsConfig};
    let read = |p: &std::path::Path| {
        std::fs::read(p).map_err(|e| anyhow::anyhow!("cannot read {}: {e}", p.display()))
    };
    let (Some(cert), Some(key)) = (&tls.cert, &tls.key) else {
        return Ok(None);
    };
    let mut config = ServerTlsConfig::new().identity(Identity::from_pem(read(cert)?, read(key)?));
    if let Some(ca) = &tls.client_ca {
        // Mutual TLS: a client without a certificate from this CA fails the handshake.
        config = config.client_ca_root(Certificate::from_pem(read(ca)?));
    }
    Ok(Some(config))
}

/// The muster services, by their gRPC names (for health reporting).
/// How often the "hang-watch" task looks for jobs past their hang timeout: a hang is
/// reported at most this long after its timeout.
const HANG_TICK: std::time::Duration = std::time::Duration::from_millis(500);

const SERVICES: &[&str] = &[
    "muster.v1.Rendezvous",
    "muster.v1.Session",
    "muster.v1.Relay",
    "muster.v1.KeyValue",
    "muster.v1.UniqueIds",
    "muster.v1.SharedValues",
    "muster.v1.Agents",
    "muster.v1.Ops",
];
