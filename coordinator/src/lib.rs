//! muster's coordinator: rendezvous, global and local rank assignment, worker sessions with
//! liveness, barriers, a per-job key-value store and NCCL unique-id distribution, served over
//! gRPC (`muster.v1`) with reflection and `grpc.health.v1`.
//!
//! The binary (`main.rs`) only parses configuration and calls [`serve`]; tests and the agent's
//! embedded coordinator call [`serve`] directly on a listener of their own.

pub mod config;
pub mod election;
pub mod ha;
pub mod job;
pub mod limits;
pub mod metrics;
pub mod model;
pub mod pool;
pub mod service;
pub mod store;
pub mod systemd;
pub mod telemetry;

pub use config::Config;
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
    config.validate().map_err(anyhow::Error::msg)?;
    let max = config.max_message_bytes;
    let (max_connections, max_streams) =
        (config.max_connections, config.max_streams_per_connection);
    let addr = listener.local_addr()?;
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
    let store = store::timed(store);
    let coordinator = Coordinator::new(config, Arc::clone(&store));
    let durable = store.as_etcd().is_some();
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
    if durable {
        let (coordinator, store, gate, me) = (
            Arc::clone(&coordinator),
            Arc::clone(&store),
            gate.clone(),
            me.clone(),
        );
        // Task "leadership": campaigns, loads the state, serves while leading, again after
        // every lost term. Ends with the runtime.
        tokio::spawn(async move {
            if let Some(etcd) = store.as_etcd() {
                ha::lead(coordinator, etcd, me, ttl, gate).await;
            }
        });
    }
    let open = move |request: tonic::Request<()>| gate.check().map(|()| request);

    // Task "metrics": answers GET /metrics; aborted when serving ends.
    let metrics_task = metrics_listener.map(|listener| {
        if let Ok(a) = listener.local_addr() {
            tracing::info!(addr = %a, "metrics endpoint serving");
        }
        let coordinator = Arc::clone(&coordinator);
        tokio::spawn(metrics::serve_http(listener, move || {
            let coordinator = Arc::clone(&coordinator);
            async move { metrics::render(&coordinator).await }
        }))
    });
    let values = ValuesService(Arc::clone(&coordinator));
    tracing::info!(%addr, advertise = %me, store = if durable { "etcd" } else { "memory" }, "coordinator serving");
    let served = tonic::transport::Server::builder()
        .tcp_nodelay(true)
        .http2_keepalive_interval(Some(std::time::Duration::from_secs(10)))
        .http2_keepalive_timeout(Some(std::time::Duration::from_secs(5)))
        // Resource limits, all explicit (ARCHITECTURE.md, "Resource limits"): streams per
        // connection (clients queue calls beyond it), the header list of one call, message
        // sizes per service below, and connections at the acceptor. No per-call timeout:
        // joins, barriers and value fetches are long polls bounded by their own deadlines.
        .max_concurrent_streams(Some(max_streams))
        .http2_max_header_list_size(Some(Config::MAX_HEADER_LIST_BYTES))
        .layer(metrics::RpcLatencyLayer)
        // A span per call, child of the caller's W3C trace context (telemetry.rs).
        .trace_fn(telemetry::server_span)
        .add_service(health)
        .add_service(reflection)
        .add_service(reflection_alpha)
        .add_service(InterceptedService::new(
            pb::rendezvous_server::RendezvousServer::new(RendezvousService(Arc::clone(
                &coordinator,
            )))
            .max_decoding_message_size(max),
            open.clone(),
        ))
        .add_service(InterceptedService::new(
            pb::session_server::SessionServer::new(SessionService(Arc::clone(&coordinator)))
                .max_decoding_message_size(max),
            open.clone(),
        ))
        .add_service(InterceptedService::new(
            pb::relay_server::RelayServer::new(RelayService(Arc::clone(&coordinator)))
                .max_decoding_message_size(max),
            open.clone(),
        ))
        .add_service(InterceptedService::new(
            pb::key_value_server::KeyValueServer::new(values.clone())
                .max_decoding_message_size(max),
            open.clone(),
        ))
        .add_service(InterceptedService::new(
            pb::unique_ids_server::UniqueIdsServer::new(values.clone())
                .max_decoding_message_size(max),
            open.clone(),
        ))
        .add_service(InterceptedService::new(
            pb::shared_values_server::SharedValuesServer::new(values)
                .max_decoding_message_size(max),
            open.clone(),
        ))
        .add_service(InterceptedService::new(
            pb::agents_server::AgentsServer::new(AgentsService(Arc::clone(&coordinator)))
                .max_decoding_message_size(max),
            open.clone(),
        ))
        .add_service(InterceptedService::new(
            pb::ops_server::OpsServer::new(OpsService(coordinator)).max_decoding_message_size(max),
            open,
        ))
        .serve_with_incoming_shutdown(
            // TCP_NODELAY on every accepted connection: barrier results are small writes.
            limits::limit_connections(
                tonic::transport::server::TcpIncoming::from(listener).with_nodelay(Some(true)),
                max_connections,
            ),
            shutdown,
        )
        .await;
    if let Some(task) = metrics_task {
        task.abort();
    }
    served?;
    tracing::info!("coordinator stopped");
    Ok(())
}

/// The muster services, by their gRPC names (for health reporting).
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
