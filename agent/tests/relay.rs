//! The node relay end to end, in one process: a real coordinator on 127.0.0.1:0, one relay per
//! node (as `muster-agent launch` starts them) and the SDK's `Accelerator` in one thread per
//! rank, connected to its node's relay through `RankInfo::agent_socket` and to the
//! coordinator through the relay's gateway beside it, as a worker under an agent is.
#![allow(clippy::unwrap_used, missing_docs)]

use muster::{Accelerator, Error, RankInfo};
use muster_agent::env::NodeAssignment;
use muster_agent::relay::Relay;
use muster_proto::v1 as pb;
use pb::rendezvous_client::RendezvousClient;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio::runtime::Runtime;

const HOST: &str = "127.0.0.1";

/// A coordinator and the relays of one job's nodes.
struct Cluster {
    _runtime: Runtime,
    addr: String,
    nodes: Vec<pb::JoinResponse>,
    relays: Vec<Option<Relay>>,
}

impl Cluster {
    /// Starts a coordinator, forms `job` from nodes of `local_sizes` ranks each, and starts one
    /// relay per node.
    fn start(job: &str, local_sizes: &[u32]) -> Self {
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
            muster_coordinator::serve(
                listener,
                muster_coordinator::Config::default(),
                std::future::pending(),
            )
            .await
            .unwrap();
        });
        let nodes = runtime.block_on(join(&addr, job, local_sizes));
        let relays = nodes
            .iter()
            .map(|n| {
                Some(
                    runtime
                        .block_on(Relay::start(&assignment(&addr, n)))
                        .unwrap(),
                )
            })
            .collect();
        Self {
            _runtime: runtime,
            addr,
            nodes,
            relays,
        }
    }

    /// Every rank's `RankInfo`, pointing at its node's relay and gateway.
    fn ranks(&self) -> Vec<RankInfo> {
        self.nodes
            .iter()
            .zip(&self.relays)
            .flat_map(|(node, relay)| {
                let socket: Option<std::path::PathBuf> = relay.as_ref().map(|r| r.socket().into());
                let coordinator = match &socket {
                    Some(socket) => muster_core::contract::agent_coordinator(socket),
                    None => self.addr.clone(),
                };
                (0..node.local_world_size).map(move |local| RankInfo {
                    coordinator: Some(coordinator.clone()),
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
                    agent_socket: socket.clone(),
                })
            })
            .collect()
    }

    /// Runs `work(rank info)` on one thread per rank and returns their results by rank.
    fn run<T: Send + 'static>(
        &self,
        work: impl Fn(RankInfo) -> T + Send + Sync + 'static,
    ) -> Vec<T> {
        let work = Arc::new(work);
        let threads: Vec<_> = self
            .ranks()
            .into_iter()
            .map(|info| {
                let work = Arc::clone(&work);
                std::thread::spawn(move || work(info))
            })
            .collect();
        threads.into_iter().map(|t| t.join().unwrap()).collect()
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        self.relays.clear();
    }
}

async fn join(addr: &str, job: &str, local_sizes: &[u32]) -> Vec<pb::JoinResponse> {
    let channel = tonic::transport::Endpoint::from_shared(format!("http://{addr}"))
        .unwrap()
        .connect()
        .await
        .unwrap();
    let nodes = local_sizes.len() as u32;
    let joins: Vec<_> = local_sizes
        .iter()
        .enumerate()
        .map(|(i, &local_world_size)| {
            let mut client = RendezvousClient::new(channel.clone());
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
                ..Default::default()
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

fn assignment(addr: &str, n: &pb::JoinResponse) -> NodeAssignment {
    NodeAssignment {
        coordinator: addr.to_owned(),
        failover_timeout: std::time::Duration::from_secs(30),
        job_id: n.job_id.clone(),
        node_id: String::new(),
        generation: n.generation,
        node_rank: n.node_rank,
        num_nodes: n.num_nodes,
        rank_offset: n.rank_offset,
        local_world_size: n.local_world_size,
        world_size: n.world_size,
        restart_count: n.restart_count,
        max_restarts: 0,
        recovery: muster_agent::env::Recovery::from_answer(n.recovery),
        epoch: 0,
        host: HOST.to_owned(),
        master_addr: HOST.to_owned(),
        master_port: 1,
        agent_socket: None,
        error_dir: None,
        flight_dir: None,
    }
}

#[test]
fn global_and_node_barriers_through_two_relays() {
    let cluster = Cluster::start("loop", &[2, 2]);
    let sockets: Vec<String> = cluster
        .relays
        .iter()
        .map(|r| r.as_ref().unwrap().socket().to_owned())
        .collect();
    let times = cluster.run(|info| {
        let accelerator = Accelerator::new(info).unwrap();
        let start = Instant::now();
        for i in 0..100 {
            accelerator.wait_for_everyone().unwrap();
            if i % 10 == 0 {
                accelerator.wait_for_local().unwrap();
            }
        }
        accelerator
            .wait_for_everyone_timeout(Duration::from_secs(10))
            .unwrap();
        let elapsed = start.elapsed();
        accelerator.finish().unwrap();
        elapsed
    });
    eprintln!("100 global barriers of 4 ranks over 2 relays: {times:?}");
    // The sockets live in private directories that go away with their relays.
    for socket in &sockets {
        let dir = std::path::Path::new(socket).parent().unwrap();
        let mode = std::os::unix::fs::PermissionsExt::mode(&dir.metadata().unwrap().permissions());
        assert_eq!(mode & 0o777, 0o700, "{}", dir.display());
    }
    drop(cluster);
    for socket in &sockets {
        let dir = std::path::Path::new(socket).parent().unwrap();
        assert!(!dir.exists(), "{} is left behind", dir.display());
    }
}

#[test]
fn two_threads_of_a_rank_share_its_relay_connection() {
    let cluster = Cluster::start("threads", &[2, 2]);
    cluster.run(|info| {
        let accelerator = Accelerator::new(info).unwrap();
        // One thread's global barriers and another's node barriers interleave on one
        // connection; whichever thread reads hands the other its results.
        std::thread::scope(|s| {
            s.spawn(|| {
                for _ in 0..50 {
                    accelerator.wait_for_local().unwrap();
                }
            });
            for _ in 0..50 {
                accelerator.wait_for_everyone().unwrap();
            }
        });
        accelerator.finish().unwrap();
    });
}

#[test]
fn main_process_first_still_runs_the_main_process_first() {
    let cluster = Cluster::start("first", &[2, 2]);
    let events = Arc::new(Mutex::new(Vec::new()));
    let log = Arc::clone(&events);
    cluster.run(move |info| {
        let rank = info.rank;
        let accelerator = Accelerator::new(info).unwrap();
        accelerator
            .main_process_first(|| {
                log.lock().unwrap().push(format!("{rank} start"));
                if rank == 0 {
                    std::thread::sleep(Duration::from_millis(200));
                }
                log.lock().unwrap().push(format!("{rank} done"));
            })
            .unwrap();
        accelerator
            .local_main_process_first(|| log.lock().unwrap().push(format!("{rank} local")))
            .unwrap();
        accelerator.finish().unwrap();
    });
    let events = events.lock().unwrap();
    let at = |e: &str| events.iter().position(|x| x == e).unwrap();
    for rank in 1..4 {
        assert!(
            at("0 done") < at(&format!("{rank} start")),
            "rank {rank} started before rank 0 was done: {events:?}"
        );
    }
    // Per node, the local main process (ranks 0 and 2) goes first.
    assert!(at("0 local") < at("1 local"), "{events:?}");
    assert!(at("2 local") < at("3 local"), "{events:?}");
}

#[test]
fn timeouts_name_the_missing_ranks_and_retries_complete() {
    let cluster = Cluster::start("timeouts", &[2, 2]);
    let results = cluster.run(|info| {
        let rank = info.rank;
        let accelerator = Accelerator::new(info).unwrap();
        let mut errors = Vec::new();
        // Phase 1: node 1 is late; rank 0 gives up after 300 ms, rank 1 waits 60 s.
        // Phase 2: rank 1 is late; rank 0 gives up after 200 ms.
        for phase in 1..=2 {
            let late = match phase {
                1 => rank >= 2,
                _ => rank == 1,
            };
            if late {
                std::thread::sleep(Duration::from_millis(1000));
            }
            let timeout = Duration::from_millis(match (phase, rank) {
                (1, 0) => 300,
                (2, 0) => 200,
                _ => 60_000,
            });
            loop {
                match accelerator.wait_for_everyone_timeout(timeout) {
                    Ok(()) => break,
                    Err(Error::Timeout { missing, .. }) => {
                        let missing: Vec<u32> = missing.iter().map(|m| m.rank).collect();
                        errors.push((phase, missing));
                    }
                    Err(e) => panic!("rank {rank}: {e}"),
                }
            }
        }
        accelerator.finish().unwrap();
        errors
    });
    // Only rank 0 ever sees a timeout: rank 1's wait survives the node's withdrawals.
    assert!(results[1..].iter().all(Vec::is_empty), "{results:?}");
    let rank0 = &results[0];
    // Phase 1: the coordinator's view (node 1's ranks); phase 2: the local view (rank 1).
    assert!(rank0.contains(&(1, vec![2, 3])), "{rank0:?}");
    assert!(rank0.contains(&(2, vec![1])), "{rank0:?}");
}

#[test]
fn a_dead_rank_fails_the_others_within_two_seconds_naming_it() {
    let cluster = Cluster::start("death", &[2, 2]);
    let results = cluster.run(|info| {
        let rank = info.rank;
        let accelerator = Accelerator::new(info).unwrap();
        accelerator.wait_for_everyone().unwrap();
        if rank == 3 {
            std::thread::sleep(Duration::from_millis(200));
            // Unwinding drops the accelerator without `leave`, as a crash would: both its relay
            // connection and its coordinator session just end.
            let crash = std::panic::catch_unwind(std::panic::AssertUnwindSafe(move || {
                let _accelerator = accelerator;
                panic!("simulated crash of rank 3");
            }));
            assert!(crash.is_err());
            return None;
        }
        let start = Instant::now();
        let error = accelerator.wait_for_everyone().unwrap_err();
        Some((start.elapsed(), error))
    });
    for (rank, result) in results.iter().enumerate().take(3) {
        let (elapsed, error) = result.as_ref().unwrap();
        assert!(
            matches!(error, Error::RankFailed { rank: 3, .. }),
            "rank {rank}: {error:?}"
        );
        assert!(error.to_string().contains("rank 3"), "rank {rank}: {error}");
        assert!(
            *elapsed < Duration::from_secs(2),
            "rank {rank} learned after {elapsed:?}"
        );
        eprintln!("rank {rank} after {elapsed:?}: {error}");
    }
}

/// Everything but barriers goes through the gateway: registration, a key-value value bigger
/// than gRPC's default 4 MiB limit, NCCL unique ids and shared values; the coordinator's own
/// refusals come back unchanged.
#[test]
fn the_gateway_carries_every_call_of_its_workers() {
    let cluster = Cluster::start("gateway", &[2, 2]);
    let results = cluster.run(|info| {
        let rank = info.rank;
        let accelerator = Accelerator::new(info).unwrap();
        assert!(accelerator.session().unwrap().coordinator().through_agent());
        let big = vec![rank as u8; 6 << 20];
        accelerator.kv().set(&format!("big/{rank}"), big).unwrap();
        accelerator.wait_for_everyone().unwrap();
        let other = (rank + 1) % 4;
        let value = accelerator
            .kv()
            .get(&format!("big/{other}"))
            .unwrap()
            .unwrap();
        assert_eq!((value.len(), value[0]), (6 << 20, other as u8));
        let id = if rank == 0 {
            accelerator
                .publish_nccl_unique_id("world", &[7; 128])
                .unwrap();
            [7; 128]
        } else {
            accelerator.fetch_nccl_unique_id("world").unwrap()
        };
        let shared = accelerator
            .main_process_first_share(|| format!("from rank {rank}"))
            .unwrap();
        let refused = accelerator.kv().get(&"k".repeat(100_000)).unwrap_err();
        accelerator.wait_for_everyone().unwrap();
        accelerator.finish().unwrap();
        (id, shared, refused.to_string())
    });
    for (rank, (id, shared, refused)) in results.iter().enumerate() {
        assert_eq!(id, &[7; 128], "rank {rank}");
        assert_eq!(shared, "from rank 0", "rank {rank}");
        assert!(refused.contains("key"), "rank {rank}: {refused}");
    }
}

#[test]
fn a_relay_that_goes_away_is_a_connection_error_naming_its_socket() {
    let mut cluster = Cluster::start("gone", &[2]);
    let socket = cluster.relays[0].as_ref().unwrap().socket().to_owned();
    let info = cluster.ranks()[0].clone();
    let waiter = std::thread::spawn(move || {
        let accelerator = Accelerator::new(info).unwrap();
        // Rank 1 never comes: this waits until the relay goes away.
        let error = accelerator.wait_for_everyone().unwrap_err();
        (error, accelerator.wait_for_local().unwrap_err())
    });
    std::thread::sleep(Duration::from_millis(300));
    cluster.relays[0] = None;
    let (first, later) = waiter.join().unwrap();
    for error in [&first, &later] {
        assert!(
            matches!(error, Error::Connection { addr, .. } if *addr == socket),
            "{error:?}"
        );
        let text = error.to_string();
        assert!(
            text.contains(&format!("the muster agent's relay socket {socket}")),
            "{text}"
        );
    }
}

#[test]
fn a_missing_socket_is_a_connection_error_at_construction() {
    let cluster = Cluster::start("nosocket", &[1]);
    let info = RankInfo {
        agent_socket: Some("/nonexistent/muster/relay.sock".into()),
        ..cluster.ranks()[0].clone()
    };
    let error = Accelerator::new(info).unwrap_err();
    assert!(
        matches!(&error, Error::Connection { addr, .. } if addr == "/nonexistent/muster/relay.sock"),
        "{error:?}"
    );
}

#[test]
fn the_ops_view_shows_who_waits_in_a_relay_and_who_is_missing() {
    // A single-node job: every barrier completes in the relay, never at the coordinator.
    let cluster = Cluster::start("held", &[3]);
    let addr = cluster.addr.clone();
    let describe = move || {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        rt.block_on(async {
            pb::ops_client::OpsClient::connect(format!("http://{addr}"))
                .await
                .unwrap()
                .describe_job(pb::DescribeJobRequest {
                    job_id: "held".into(),
                    ..Default::default()
                })
                .await
                .unwrap()
                .into_inner()
        })
    };
    let seen = Arc::new(Mutex::new(None));
    let cleared = Arc::new(Mutex::new(false));
    let (seen_in, cleared_in) = (Arc::clone(&seen), Arc::clone(&cleared));
    cluster.run(move |info| {
        let rank = info.rank;
        let accelerator = Accelerator::new(info).unwrap();
        if rank == 2 {
            // Ranks 0 and 1 wait; rank 2 looks at the coordinator's view before it joins them.
            let deadline = Instant::now() + Duration::from_secs(10);
            let view = loop {
                let d = describe();
                if !d.barriers.is_empty() || Instant::now() > deadline {
                    break d;
                }
                std::thread::sleep(Duration::from_millis(100));
            };
            *seen_in.lock().unwrap() = Some(view);
        }
        accelerator.wait_for_everyone_named("checkpoint").unwrap();
        if rank == 2 {
            let deadline = Instant::now() + Duration::from_secs(10);
            while !describe().barriers.is_empty() && Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(100));
            }
            *cleared_in.lock().unwrap() = describe().barriers.is_empty();
        }
        accelerator.wait_for_everyone().unwrap();
        accelerator.finish().unwrap();
    });
    let view = seen.lock().unwrap().take().unwrap();
    assert_eq!(view.barriers.len(), 1, "{view:?}");
    let b = &view.barriers[0];
    assert_eq!(b.scope, pb::BarrierScope::Global as i32);
    assert_eq!(b.names[0].name, "checkpoint");
    let mut waiting = b.names[0].ranks.clone();
    waiting.sort_unstable();
    assert_eq!(waiting, [0, 1]);
    assert_eq!(b.missing.iter().map(|m| m.rank()).collect::<Vec<_>>(), [2]);
    assert!(b.waiting_ms >= 1000, "{b:?}");
    assert_eq!(view.ranks[0].state, pb::RankState::Waiting as i32);
    assert_eq!(view.ranks[2].state, pb::RankState::Running as i32);
    assert!(
        *cleared.lock().unwrap(),
        "the report was not cleared after the barrier"
    );
}
