//! In-place recovery inside the SDK, against a real coordinator in-process: the
//! `membership_changed` push (delivered here to each rank's session watch, as the session task
//! does when the coordinator sends it) ends a collective blocked on a dead rank within a second
//! naming it, flips `Membership::changed`, and a communicator rebuilt for the new epoch works
//! and ignores the push that led to it.
#![allow(clippy::unwrap_used)]

use std::{
    sync::{Arc, Barrier, mpsc},
    thread,
    time::{Duration, Instant},
};

use muster_proto::v1::{self as pb, rendezvous_client::RendezvousClient};

use crate::{
    Accelerator, Error, RankInfo,
    client::{Coordinator, FailureWatch, Quorum},
    comm::{BackendKind, Communicator, ReduceOp},
    env::{Recovery, RecoveryEnv},
};

/// A coordinator on its own runtime and one formed generation of `world` ranks on one node.
fn start(job: &str, world: u32) -> (tokio::runtime::Runtime, Vec<RankInfo>) {
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
    let joined = runtime.block_on(async {
        let coordinator = Coordinator::connect(&addr).await.unwrap();
        RendezvousClient::new(coordinator.channel())
            .join(pb::JoinRequest {
                job_id: job.to_owned(),
                node_id: "node-0".to_owned(),
                host: "127.0.0.1".to_owned(),
                local_world_size: world,
                requested_node_rank: Some(0),
                config: Some(pb::RendezvousConfig {
                    min_nodes: 1,
                    max_nodes: 1,
                    ..Default::default()
                }),
                request_id: format!("{job}-{:016x}", rand::random::<u64>()),
                watches: false,
                spare: false,
            })
            .await
            .unwrap()
            .into_inner()
    });
    let infos = (0..world)
        .map(|rank| RankInfo {
            coordinator: Some(addr.clone()),
            job_id: joined.job_id.clone(),
            generation: joined.generation,
            rank,
            local_rank: rank,
            world_size: world,
            local_world_size: world,
            node_rank: 0,
            num_nodes: 1,
            restart_count: 0,
            host: "127.0.0.1".to_owned(),
            agent_socket: None,
        })
        .collect();
    (runtime, infos)
}

fn in_place(info: RankInfo) -> Accelerator {
    let recovery = RecoveryEnv {
        mode: Recovery::InPlace,
        epoch: 0,
    };
    Accelerator::with_recovery(info, crate::client::ClientSecurity::plaintext(), recovery).unwrap()
}

fn cause(rank: u32) -> pb::BarrierError {
    pb::BarrierError {
        kind: pb::barrier_error::Kind::RankFailed as i32,
        message: format!(
            "rank {rank} (node 0, host 127.0.0.1) of job 'j' generation 1 failed: killed by SIGKILL"
        ),
        rank,
        node_rank: 0,
        host: "127.0.0.1".to_owned(),
        missing: Vec::new(),
    }
}

/// The per-step check's cost in ns per call (atomic loads only), checking it says `expected`.
fn per_call(membership: &crate::membership::Membership<'_>, expected: bool) -> f64 {
    let calls = 1_000_000u32;
    let timer = Instant::now();
    let mut seen = 0u32;
    for _ in 0..calls {
        seen += u32::from(std::hint::black_box(membership).changed());
    }
    let per_call = timer.elapsed().as_nanos() as f64 / f64::from(calls);
    assert_eq!(seen, if expected { calls } else { 0 });
    per_call
}

#[test]
fn a_membership_push_ends_a_blocked_collective_and_the_rebuilt_communicator_works() {
    let world = 3;
    let (_coordinator, infos) = start("recovery-push", world);
    let (watches_tx, watches_rx) = mpsc::channel::<FailureWatch>();
    let rebuilt = Arc::new(Barrier::new(world as usize));
    let ranks: Vec<_> = infos
        .into_iter()
        .map(|info| {
            let watches_tx = watches_tx.clone();
            let rebuilt = rebuilt.clone();
            thread::spawn(move || {
                let rank = info.rank;
                let accelerator = in_place(info);
                let comm = Communicator::with_backend(&accelerator, BackendKind::Cpu).unwrap();
                let membership = accelerator.membership();
                assert!(!membership.changed(), "no push yet");
                let quiet = per_call(&membership, false);
                watches_tx.send(accelerator.failure_watch()).unwrap();
                // Rank 2 stands for the dead rank: it never enters the collective.
                let interrupted = if rank < 2 {
                    let mut data = vec![1.0f32; 4096];
                    let started = Instant::now();
                    let error = comm.all_reduce(&mut data, ReduceOp::Sum).unwrap_err();
                    Some((error, started.elapsed()))
                } else {
                    while !membership.changed() {
                        thread::sleep(Duration::from_millis(5));
                    }
                    None
                };
                assert!(membership.changed());
                assert_eq!(membership.pushed_epoch(), 1);
                let pushed = per_call(&membership, true);
                // Everyone rebuilds for the quorum of epoch 1 (as the coordinator answers it).
                let quorum = Quorum {
                    epoch: 1,
                    world_size: world,
                    step: Some(0),
                    heal: Vec::new(),
                    released: (0, 0),
                    members: Vec::new(),
                };
                rebuilt.wait();
                accelerator
                    .membership
                    .current
                    .store(1, std::sync::atomic::Ordering::Release);
                assert!(
                    !membership.changed(),
                    "the quorum's epoch is the pushed one"
                );
                comm.reconfigure(&accelerator, &quorum).unwrap();
                assert_eq!(comm.epoch(), 1);
                let mut data = vec![f32::from(rank as u8 + 1); 4096];
                comm.all_reduce(&mut data, ReduceOp::Sum).unwrap();
                assert!(data.iter().all(|&v| v == 6.0), "{:?}", &data[..4]);
                // The heal protocol on bytes: rank 2 receives rank 0's, rank 1 nothing.
                let quorum = Quorum {
                    heal: vec![crate::membership::Heal { rank: 2, source: 0 }],
                    ..quorum
                };
                if rank == 0 {
                    let refused = comm.heal_bytes(&quorum, None).unwrap_err();
                    assert!(
                        refused.to_string().contains("no state to send"),
                        "{refused}"
                    );
                }
                let payload = format!("state of rank {rank}").into_bytes();
                let received = comm.heal_bytes(&quorum, Some(&payload)).unwrap();
                assert_eq!(received, (rank == 2).then(|| b"state of rank 0".to_vec()));
                (interrupted, quiet, pushed)
            })
        })
        .collect();
    drop(watches_tx);
    let watches: Vec<FailureWatch> = watches_rx.iter().take(world as usize).collect();
    thread::sleep(Duration::from_millis(300));
    // What each session task does on `membership_changed { epoch: 1, cause: rank 2 }`.
    for watch in &watches {
        watch.membership_changed(1, cause(2));
    }
    for (rank, handle) in ranks.into_iter().enumerate() {
        let (interrupted, quiet, pushed) = handle.join().unwrap();
        eprintln!(
            "rank {rank}: Membership::changed() costs {quiet:.1} ns per call with no push, \
             {pushed:.1} ns after one"
        );
        assert!(
            quiet < 1_000.0 && pushed < 1_000.0,
            "{quiet} and {pushed} ns per call"
        );
        if let Some((error, took)) = interrupted {
            assert!(
                matches!(
                    &error,
                    Error::MembershipChanged {
                        epoch: 1,
                        rank: 2,
                        ..
                    }
                ),
                "rank {rank}: {error:?}"
            );
            assert!(error.to_string().contains("rank 2 "), "{error}");
            assert!(error.is_recoverable(Recovery::InPlace));
            // Blocked from before the push (300 ms) to just after it.
            assert!(
                took < Duration::from_millis(1300),
                "rank {rank} took {took:?}"
            );
        }
    }
}

#[test]
fn a_death_during_the_rebuild_ends_it_naming_the_rank() {
    let world = 3;
    let (_coordinator, infos) = start("recovery-rebuild", world);
    let (watches_tx, watches_rx) = mpsc::channel::<FailureWatch>();
    let ranks: Vec<_> = infos
        .into_iter()
        .map(|info| {
            let watches_tx = watches_tx.clone();
            thread::spawn(move || {
                let rank = info.rank;
                let accelerator = in_place(info);
                let comm = Communicator::with_backend(&accelerator, BackendKind::Cpu).unwrap();
                watches_tx.send(accelerator.failure_watch()).unwrap();
                if rank == 0 {
                    // Rank 0 dies before it publishes its epoch-1 address: ranks 1 and 2 wait
                    // for its record until the coordinator reports the death.
                    while !accelerator.membership().changed() {
                        thread::sleep(Duration::from_millis(5));
                    }
                    return None;
                }
                let quorum = Quorum {
                    epoch: 1,
                    world_size: world,
                    step: Some(4),
                    heal: Vec::new(),
                    released: (0, 0),
                    members: Vec::new(),
                };
                let started = Instant::now();
                let error = comm.reconfigure(&accelerator, &quorum).unwrap_err();
                let took = started.elapsed();
                // Unusable until a later quorum's rebuild succeeds.
                let mut data = [1.0f32];
                assert!(comm.all_reduce(&mut data, ReduceOp::Sum).is_err());
                Some((error, took))
            })
        })
        .collect();
    drop(watches_tx);
    let watches: Vec<FailureWatch> = watches_rx.iter().take(world as usize).collect();
    thread::sleep(Duration::from_millis(300));
    for watch in &watches {
        watch.membership_changed(2, cause(0));
    }
    for (rank, handle) in ranks.into_iter().enumerate() {
        let Some((error, took)) = handle.join().unwrap() else {
            continue;
        };
        assert!(
            matches!(
                &error,
                Error::MembershipChanged {
                    epoch: 2,
                    rank: 0,
                    ..
                }
            ),
            "rank {rank}: {error:?}"
        );
        assert!(
            took < Duration::from_millis(1300),
            "rank {rank} took {took:?}"
        );
    }
}

#[test]
fn a_death_while_the_mesh_forms_leaves_a_communicator_that_fails_recoverably() {
    let world = 3;
    let (_coordinator, infos) = start("recovery-create", world);
    let (watches_tx, watches_rx) = mpsc::channel::<FailureWatch>();
    let ranks: Vec<_> = infos
        .into_iter()
        .map(|info| {
            let watches_tx = watches_tx.clone();
            thread::spawn(move || {
                let rank = info.rank;
                let accelerator = in_place(info);
                watches_tx.send(accelerator.failure_watch()).unwrap();
                if rank == 0 {
                    // Rank 0 dies before it publishes its address: ranks 1 and 2 wait for its
                    // record until the coordinator reports the death.
                    while !accelerator.membership().changed() {
                        thread::sleep(Duration::from_millis(5));
                    }
                    return None;
                }
                // The communicator exists (it keeps its place in the order of creation), built
                // for epoch 0, and fails every call recoverably until a quorum rebuilds it.
                let comm = Communicator::with_backend(&accelerator, BackendKind::Cpu).unwrap();
                let mut data = [1.0f32];
                let error = comm.all_reduce(&mut data, ReduceOp::Sum).unwrap_err();
                Some((comm.epoch(), error))
            })
        })
        .collect();
    drop(watches_tx);
    let watches: Vec<FailureWatch> = watches_rx.iter().take(world as usize).collect();
    thread::sleep(Duration::from_millis(300));
    for watch in &watches {
        watch.membership_changed(1, cause(0));
    }
    for (rank, handle) in ranks.into_iter().enumerate() {
        let Some((epoch, error)) = handle.join().unwrap() else {
            continue;
        };
        assert_eq!(epoch, 0, "rank {rank}");
        assert!(
            matches!(
                &error,
                Error::MembershipChanged {
                    epoch: 1,
                    rank: 0,
                    ..
                }
            ),
            "rank {rank}: {error:?}"
        );
        assert!(error.is_recoverable(Recovery::InPlace), "rank {rank}");
    }
}
