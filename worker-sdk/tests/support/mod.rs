//! What the SDK's integration tests share: a real coordinator in-process on 127.0.0.1:0, a
//! job formed through the real rendezvous, and ranks run as threads, each with its own
//! `Accelerator` (and communicator).
//!
//! Each test file compiles this module on its own and uses part of it.
#![allow(dead_code, clippy::unwrap_used)]

use std::sync::Arc;

/// The peers' Python: the same source as `muster_tests::peers_python`.
#[path = "../../../tests/src/peers.rs"]
pub mod peers;

use muster::{
    Accelerator, RankInfo,
    client::Coordinator,
    comm::{BackendKind, Communicator},
};
use muster_proto::v1::{self as pb, rendezvous_client::RendezvousClient};
use tokio::runtime::Runtime;

/// The host every simulated node reports.
pub const HOST: &str = "127.0.0.1";

/// A coordinator on its own runtime, so that a test can kill it (drop every connection) at
/// will.
pub struct TestCoordinator {
    /// `127.0.0.1:<port>`.
    pub addr: String,
    runtime: Option<Runtime>,
}

impl TestCoordinator {
    /// With the default configuration.
    pub fn start() -> Self {
        Self::start_with(muster_coordinator::Config::default())
    }

    /// With `config`.
    pub fn start_with(config: muster_coordinator::Config) -> Self {
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .unwrap();
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        listener.set_nonblocking(true).unwrap();
        let addr = listener.local_addr().unwrap().to_string();
        runtime.spawn(async move {
            let listener = tokio::net::TcpListener::from_std(listener).unwrap();
            muster_coordinator::serve(listener, config, std::future::pending())
                .await
                .unwrap();
        });
        Self {
            addr,
            runtime: Some(runtime),
        }
    }

    /// Stops serving at once, dropping every connection.
    pub fn kill(&mut self) {
        if let Some(runtime) = self.runtime.take() {
            runtime.shutdown_background();
        }
    }
}

impl Drop for TestCoordinator {
    fn drop(&mut self) {
        self.kill();
    }
}

/// Forms one generation of `job` from nodes with the given local world sizes; returns each
/// node's assignment, in node order.
pub async fn join(addr: &str, job: &str, local_sizes: &[u32]) -> Vec<pb::JoinResponse> {
    let coordinator = Coordinator::connect(addr).await.unwrap();
    let nodes = local_sizes.len() as u32;
    let joins: Vec<_> = local_sizes
        .iter()
        .enumerate()
        .map(|(i, &local_world_size)| {
            let mut client = RendezvousClient::new(coordinator.channel().clone());
            let request = pb::JoinRequest {
                job_id: job.to_owned(),
                node_id: format!("node-{i}"),
                host: HOST.to_owned(),
                local_world_size,
                requested_node_rank: Some(i as u32),
                config: Some(pb::RendezvousConfig {
                    min_nodes: nodes,
                    max_nodes: nodes,
                    ..Default::default()
                }),
                // One per join attempt (the coordinator requires it, to make retries safe).
                request_id: format!("{job}-node-{i}-{:016x}", rand::random::<u64>()),
                watches: false,
                spare: false,
            };
            tokio::spawn(async move { client.join(request).await.unwrap().into_inner() })
        })
        .collect();
    let mut out = Vec::new();
    for join in joins {
        out.push(join.await.unwrap());
    }
    out.sort_by_key(|r| r.node_rank);
    out
}

/// Every rank's `RankInfo` for a formed generation.
pub fn rank_infos(addr: &str, nodes: &[pb::JoinResponse]) -> Vec<RankInfo> {
    nodes
        .iter()
        .flat_map(|node| {
            (0..node.local_world_size).map(move |local| RankInfo {
                coordinator: Some(addr.to_owned()),
                job_id: node.job_id.clone(),
                generation: node.generation,
                rank: node.rank_offset + local,
                local_rank: local,
                world_size: node.world_size,
                local_world_size: node.local_world_size,
                node_rank: node.node_rank,
                num_nodes: node.num_nodes,
                restart_count: node.restart_count,
                host: HOST.to_owned(),
                agent_socket: None,
            })
        })
        .collect()
}

/// Runs `body` once per rank of a fresh job of nodes with `local_sizes` ranks, each rank in its
/// own thread with its own `Accelerator`; returns what each returned, in rank order.
pub fn with_accelerators<T: Send + 'static>(
    job: &str,
    local_sizes: &[u32],
    body: impl Fn(Accelerator) -> T + Send + Sync + 'static,
) -> Vec<T> {
    with_accelerators_on(
        muster_coordinator::Config::default(),
        job,
        local_sizes,
        body,
    )
}

/// [`with_accelerators`] on a coordinator started with `config`.
pub fn with_accelerators_on<T: Send + 'static>(
    config: muster_coordinator::Config,
    job: &str,
    local_sizes: &[u32],
    body: impl Fn(Accelerator) -> T + Send + Sync + 'static,
) -> Vec<T> {
    let coordinator = TestCoordinator::start_with(config);
    let client = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let nodes = client.block_on(join(&coordinator.addr, job, local_sizes));
    let body = Arc::new(body);
    let threads: Vec<_> = rank_infos(&coordinator.addr, &nodes)
        .into_iter()
        .map(|info| {
            let body = body.clone();
            std::thread::spawn(move || body(Accelerator::new(info).unwrap()))
        })
        .collect();
    threads.into_iter().map(|t| t.join().unwrap()).collect()
}

/// [`with_accelerators`] with a CPU communicator per rank; a single node of one rank runs in
/// single-process mode, without a coordinator.
pub fn with_comms<T: Send + 'static>(
    job: &str,
    local_sizes: &[u32],
    body: impl Fn(&Accelerator, Communicator) -> T + Send + Sync + 'static,
) -> Vec<T> {
    let run = move |accelerator: Accelerator| {
        let comm = Communicator::with_backend(&accelerator, BackendKind::Cpu).unwrap();
        assert_eq!(comm.backend(), BackendKind::Cpu);
        body(&accelerator, comm)
    };
    if local_sizes == [1] {
        return vec![run(Accelerator::new(RankInfo::single_process()).unwrap())];
    }
    with_accelerators(job, local_sizes, run)
}
