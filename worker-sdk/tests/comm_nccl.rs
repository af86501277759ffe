//! The NCCL backend through the public communicator API: every reduction and element type on
//! one rank against a reference, and a 2-rank job whose second rank dies before it joins NCCL,
//! which must abort the first rank's NCCL communicator and name the dead rank instead of
//! hanging. Without a CUDA device or libnccl every test prints `skipped: <reason>` and passes
//! (CI machines have no GPU). A one-rank communicator rebuilt for a new membership epoch (in-place
//! recovery) reduces again. The finer-grained GPU tests (a hung collective aborted by a
//! failure report, growing device buffers, bad arguments) are unit tests in `comm/nccl.rs`.
#![allow(clippy::unwrap_used)]

mod support;

use std::{
    fmt::Debug,
    time::{Duration, Instant},
};

use muster::{
    Accelerator, Error, RankInfo,
    comm::{BackendKind, Communicator, Element, ReduceOp},
};
use support::{HOST, TestCoordinator, join, rank_infos};

fn single_process(job: &str) -> RankInfo {
    RankInfo {
        coordinator: None,
        job_id: job.to_owned(),
        generation: 1,
        rank: 0,
        local_rank: 0,
        world_size: 1,
        local_world_size: 1,
        node_rank: 0,
        num_nodes: 1,
        restart_count: 0,
        host: HOST.to_owned(),
        agent_socket: None,
    }
}

/// An NCCL communicator of a single-process accelerator, or `None` (after printing why) when
/// this machine cannot run NCCL: the backend's error says what is missing.
fn nccl_or_skip(accelerator: &Accelerator) -> Option<Communicator> {
    match Communicator::with_backend(accelerator, BackendKind::Nccl) {
        Ok(comm) => Some(comm),
        Err(Error::Backend { backend, message }) => {
            assert_eq!(backend, "nccl");
            assert!(!message.is_empty());
            println!("skipped: {message}");
            None
        }
        Err(other) => panic!("expected a nccl backend error, got {other:?}"),
    }
}

/// With one rank every reduction is the identity (the mean divides by 1).
fn check_identity<T: Element + Copy + Debug>(comm: &Communicator, values: &[T]) {
    for op in [
        ReduceOp::Sum,
        ReduceOp::Avg,
        ReduceOp::Min,
        ReduceOp::Max,
        ReduceOp::Product,
    ] {
        let mut buf = values.to_vec();
        comm.all_reduce(&mut buf, op).unwrap();
        assert_eq!(
            buf,
            values,
            "all_reduce {op:?} of {} {}",
            values.len(),
            T::DTYPE
        );
    }
}

#[test]
fn one_rank_reduces_every_type_like_the_reference() {
    let accelerator = Accelerator::new(single_process("nccl-one-rank")).unwrap();
    let Some(comm) = nccl_or_skip(&accelerator) else {
        return;
    };
    for n in [1usize, 17, 4096, 100_003] {
        let ints: Vec<i32> = (0..n).map(|i| (i % 23) as i32 - 11).collect();
        check_identity(&comm, &ints.iter().map(|&v| v as f32).collect::<Vec<_>>());
        check_identity(
            &comm,
            &ints.iter().map(|&v| f64::from(v)).collect::<Vec<_>>(),
        );
        check_identity(
            &comm,
            &ints
                .iter()
                .map(|&v| half::f16::from_f32(v as f32))
                .collect::<Vec<_>>(),
        );
        check_identity(
            &comm,
            &ints
                .iter()
                .map(|&v| half::bf16::from_f32(v as f32))
                .collect::<Vec<_>>(),
        );
        check_identity(&comm, &ints);
        check_identity(
            &comm,
            &ints.iter().map(|&v| i64::from(v)).collect::<Vec<_>>(),
        );
        check_identity(
            &comm,
            &ints
                .iter()
                .map(|&v| v.unsigned_abs() as u8)
                .collect::<Vec<_>>(),
        );
    }
}

/// Rank 1 of a 2-rank job registers with the coordinator but dies before it joins NCCL. Rank 0
/// is then waiting inside NCCL's communicator setup for a peer that will never come; the
/// coordinator's failure report must abort it (`ncclCommAbort`) and the error must name rank 1.
/// One GPU is enough: rank 1 never touches it.
#[test]
fn a_rank_that_dies_before_joining_nccl_aborts_the_others() {
    if nccl_or_skip(&Accelerator::new(single_process("nccl-probe")).unwrap()).is_none() {
        return;
    }
    let coordinator = TestCoordinator::start();
    let client = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let nodes = client.block_on(join(&coordinator.addr, "nccl-abort", &[2]));
    let infos = rank_infos(&coordinator.addr, &nodes);

    let dead = infos[1].clone();
    let dying = std::thread::spawn(move || {
        let _accelerator = Accelerator::new(dead).unwrap();
        // Long enough for rank 0 to be inside the NCCL join; then crash. A panic drops the
        // accelerator without a clean `leave`, so the coordinator marks rank 1 failed (a plain
        // drop would leave cleanly).
        std::thread::sleep(Duration::from_secs(2));
        panic!("simulated crash of rank 1");
    });
    let survivor = infos[0].clone();
    let started = Instant::now();
    let error = std::thread::spawn(move || {
        let accelerator = Accelerator::new(survivor).unwrap();
        Communicator::with_backend(&accelerator, BackendKind::Nccl).map(|_| ())
    })
    .join()
    .unwrap()
    .expect_err("the NCCL join cannot succeed without rank 1");
    assert!(dying.join().is_err(), "rank 1 was meant to crash");

    assert!(
        started.elapsed() < Duration::from_secs(60),
        "took {:?}",
        started.elapsed()
    );
    println!("rank 0 got: {error}");
    match &error {
        Error::PeerLost { rank: 1, host, .. } | Error::RankFailed { rank: 1, host, .. } => {
            assert_eq!(host, HOST)
        }
        other => panic!("expected rank 1 to be named, got {other:?}"),
    }
    assert!(error.to_string().contains("rank 1"), "{error}");
}

/// In-place recovery's rebuild: the old NCCL communicator is aborted and a new one joins under
/// the epoch's unique id, and it reduces. One rank, so no coordinator quorum is needed.
#[test]
fn a_reconfigured_communicator_joins_under_the_new_epoch() {
    let accelerator = Accelerator::new(single_process("nccl-reconfigure")).unwrap();
    let Some(comm) = nccl_or_skip(&accelerator) else {
        return;
    };
    check_identity(&comm, &[1.5f32, -2.0, 3.25]);
    let quorum = accelerator.membership().quorum(Some(3)).unwrap();
    let rebuilt = muster::membership::Quorum {
        epoch: quorum.epoch + 1,
        ..quorum
    };
    comm.reconfigure(&accelerator, &rebuilt).unwrap();
    assert_eq!(comm.epoch(), rebuilt.epoch);
    check_identity(&comm, &[1.5f32, -2.0, 3.25]);
    check_identity(&comm, &[7i64, -9]);
}
