//! muster's coordinator: rendezvous, global and local rank assignment, worker sessions with
//! liveness, barriers, a per-job key-value store and NCCL unique-id distribution, served over
//! gRPC (`muster.v1`) with reflection and `grpc.health.v1`.
//!
//! The binary (`main.rs`) only parses configuration and calls [`serve`]; tests and the agent's
//! embedded coordinator call [`serve`] directly on a listener of their own.

pub mod config;
pub mod election;
pub mod job;
pub mod model;
pub mod pool;
pub mod service;
pub mod store;

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
pub async fn serve_with_store(
    listener: TcpListener,
    config: Config,
    store: Arc<dyn Store>,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> anyhow::Result<()> {
    config.validate().map_err(anyhow::Error::msg)?;
    let max = config.max_message_bytes;
    let coordinator = Coordinator::new(config, store);

    let reflection = tonic_reflection::server::Builder::configure()
        .register_encoded_file_descriptor_set(muster_proto::FILE_DESCRIPTOR_SET)
        .register_encoded_file_descriptor_set(tonic_health::pb::FILE_DESCRIPTOR_SET)
        .build_v1()?;
    let (health_reporter, health) = tonic_health::server::health_reporter();
    health_reporter
        .set_serving::<pb::session_server::SessionServer<SessionService>>()
        .await;
    health_reporter
        .set_service_status("", tonic_health::ServingStatus::Serving)
        .await;

    let values = ValuesService(Arc::clone(&coordinator));
    let addr = listener.local_addr()?;
    tracing::info!(%addr, "coordinator serving");
    tonic::transport::Server::builder()
        .tcp_nodelay(true)
        .http2_keepalive_interval(Some(std::time::Duration::from_secs(10)))
        .http2_keepalive_timeout(Some(std::time::Duration::from_secs(5)))
        .max_concurrent_streams(Some(1 << 20))
        .add_service(health)
        .add_service(reflection)
        .add_service(
            pb::rendezvous_server::RendezvousServer::new(RendezvousService(Arc::clone(
                &coordinator,
            )))
            .max_decoding_message_size(max),
        )
        .add_service(
            pb::session_server::SessionServer::new(SessionService(Arc::clone(&coordinator)))
                .max_decoding_message_size(max),
        )
        .add_service(
            pb::relay_server::RelayServer::new(RelayService(Arc::clone(&coordinator)))
                .max_decoding_message_size(max),
        )
        .add_service(
            pb::key_value_server::KeyValueServer::new(values.clone())
                .max_decoding_message_size(max),
        )
        .add_service(
            pb::unique_ids_server::UniqueIdsServer::new(values.clone())
                .max_decoding_message_size(max),
        )
        .add_service(
            pb::shared_values_server::SharedValuesServer::new(values)
                .max_decoding_message_size(max),
        )
        .add_service(
            pb::agents_server::AgentsServer::new(AgentsService(Arc::clone(&coordinator)))
                .max_decoding_message_size(max),
        )
        .add_service(
            pb::ops_server::OpsServer::new(OpsService(coordinator)).max_decoding_message_size(max),
        )
        .serve_with_incoming_shutdown(
            // TCP_NODELAY on every accepted connection: barrier results are small writes.
            tonic::transport::server::TcpIncoming::from(listener).with_nodelay(Some(true)),
            shutdown,
        )
        .await?;
    tracing::info!("coordinator stopped");
    Ok(())
}
