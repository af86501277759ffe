//! The SDK against the real coordinator, started in-process on 127.0.0.1:0: sessions,
//! barriers (sequence numbers, timeouts, cancellation, failures, departures), lost connections,
//! the key-value store, unique ids, shared values, and the `Accelerator` with several ranks as
//! threads.
#![allow(clippy::unwrap_used)]

mod support;

use std::{
    sync::{
        Arc, Mutex,
        atomic::{AtomicUsize, Ordering},
    },
    time::{Duration, Instant},
};

use muster::{
    Error, Scope,
    client::{Coordinator, Session, SessionConfig},
};
use support::{HOST, TestCoordinator, join, rank_infos, with_accelerators, with_accelerators_on};

/// One session per rank of a fresh single-node job of `n` ranks.
async fn sessions(addr: &str, job: &str, n: u32) -> (Coordinator, Vec<Session>) {
    let nodes = join(addr, job, &[n]).await;
    let coordinator = Coordinator::connect(addr).await.unwrap();
    let mut out = Vec::new();
    for rank in 0..n {
        let config = session_config(job, nodes[0].generation, rank);
        out.push(Session::attach(&coordinator, config).await.unwrap());
    }
    (coordinator, out)
}

fn session_config(job: &str, generation: u64, rank: u32) -> SessionConfig {
    SessionConfig {
        job_id: job.to_owned(),
        generation,
        rank,
        pid: std::process::id(),
        host: HOST.to_owned(),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn barriers_number_per_scope_and_complete_across_nodes() {
    let coordinator = TestCoordinator::start();
    let nodes = join(&coordinator.addr, "barriers", &[2, 2]).await;
    let connection = Coordinator::connect(&coordinator.addr).await.unwrap();
    let mut tasks = Vec::new();
    for info in rank_infos(&coordinator.addr, &nodes) {
        let config = session_config("barriers", info.generation, info.rank);
        let session = Session::attach(&connection, config).await.unwrap();
        assert_eq!(session.registration().world_size, 4);
        assert_eq!(session.registration().node_rank, info.node_rank);
        tasks.push(tokio::spawn(async move {
            for i in 0..20 {
                session.barrier(Scope::Global, "loop", None).await.unwrap();
                if i % 4 == 0 {
                    session
                        .barrier(Scope::Node, "node-loop", None)
                        .await
                        .unwrap();
                }
            }
            assert_eq!(session.next_seq(Scope::Global), 21);
            assert_eq!(session.next_seq(Scope::Node), 6);
            session.leave().await.unwrap();
        }));
    }
    for task in tasks {
        task.await.unwrap();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_rank_fails_waiters_with_its_rank_and_host() {
    let coordinator = TestCoordinator::start();
    let (_c, mut sessions) = sessions(&coordinator.addr, "failure", 3).await;
    let crashed = sessions.pop().unwrap();
    let waiters: Vec<_> = sessions
        .into_iter()
        .map(|s| tokio::spawn(async move { s.barrier(Scope::Global, "b", None).await }))
        .collect();
    tokio::time::sleep(Duration::from_millis(100)).await;
    // Dropping without leave is what a crash looks like to the coordinator.
    drop(crashed);
    for waiter in waiters {
        let error = waiter.await.unwrap().unwrap_err();
        match &error {
            Error::RankFailed { rank: 2, host, .. } => assert_eq!(host, HOST),
            other => panic!("expected rank 2 to fail, got {other:?}"),
        }
        let text = error.to_string();
        assert!(text.contains("rank 2") && text.contains(HOST), "{text}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_rank_fires_every_live_sessions_failure_watch() {
    let coordinator = TestCoordinator::start();
    let (_c, mut sessions) = sessions(&coordinator.addr, "watch", 3).await;
    let crashed = sessions.pop().unwrap();
    let watches: Vec<_> = sessions.iter().map(Session::failure_watch).collect();
    assert!(watches.iter().all(|w| w.failed().is_none()));
    // Nobody is in a barrier: only the pushed report can tell them.
    drop(crashed);
    for watch in watches {
        let watch2 = watch.clone();
        let error =
            tokio::task::spawn_blocking(move || watch2.wait_timeout(Duration::from_secs(5)))
                .await
                .unwrap()
                .expect("the failure is reported within 5 s");
        match &error {
            Error::RankFailed { rank: 2, host, .. } => assert_eq!(host, HOST),
            other => panic!("expected rank 2 to fail, got {other:?}"),
        }
        assert!(matches!(
            watch.failed(),
            Some(Error::RankFailed { rank: 2, .. })
        ));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_timeout_lists_the_missing_and_the_same_barrier_can_be_retried() {
    let coordinator = TestCoordinator::start();
    let (_c, sessions) = sessions(&coordinator.addr, "timeout", 2).await;
    let error = sessions[0]
        .barrier(Scope::Global, "t", Some(Duration::from_millis(200)))
        .await
        .unwrap_err();
    match &error {
        Error::Timeout { missing, .. } => {
            assert_eq!(missing.iter().map(|m| m.rank).collect::<Vec<_>>(), [1]);
        }
        other => panic!("expected a timeout, got {other:?}"),
    }
    assert!(
        error
            .to_string()
            .contains("rank 1 (node 0, host 127.0.0.1)"),
        "{error}"
    );
    assert_eq!(sessions[0].next_seq(Scope::Global), 1);
    let (a, b) = tokio::join!(
        sessions[0].barrier(Scope::Global, "t", None),
        sessions[1].barrier(Scope::Global, "t", None)
    );
    a.unwrap();
    b.unwrap();
    assert_eq!(sessions[0].next_seq(Scope::Global), 2);
    assert_eq!(sessions[1].next_seq(Scope::Global), 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cancelled_barrier_is_resumed_or_passed_through() {
    let coordinator = TestCoordinator::start();
    let (_c, sessions) = sessions(&coordinator.addr, "cancel", 2).await;
    let (s0, s1) = (&sessions[0], &sessions[1]);
    let short = Duration::from_millis(100);

    // Same name again: a retry that takes up the abandoned entry.
    assert!(
        tokio::time::timeout(short, s0.barrier(Scope::Global, "a", None))
            .await
            .is_err()
    );
    s1.barrier(Scope::Global, "a", None).await.unwrap();
    s0.barrier(Scope::Global, "a", None).await.unwrap();
    assert_eq!(
        (s0.next_seq(Scope::Global), s1.next_seq(Scope::Global)),
        (2, 2)
    );

    // Same name, resumed before the others arrive.
    assert!(
        tokio::time::timeout(short, s0.barrier(Scope::Global, "b", None))
            .await
            .is_err()
    );
    let (r0, r1) = tokio::join!(
        s0.barrier(Scope::Global, "b", None),
        s1.barrier(Scope::Global, "b", None)
    );
    r0.unwrap();
    r1.unwrap();

    // Another name: the abandoned barrier counts as passed, then the new one is entered.
    assert!(
        tokio::time::timeout(short, s0.barrier(Scope::Global, "c", None))
            .await
            .is_err()
    );
    let (r0, r1) = tokio::join!(s0.barrier(Scope::Global, "d", None), async {
        s1.barrier(Scope::Global, "c", None).await?;
        s1.barrier(Scope::Global, "d", None).await
    });
    r0.unwrap();
    r1.unwrap();
    assert_eq!(
        (s0.next_seq(Scope::Global), s1.next_seq(Scope::Global)),
        (5, 5)
    );

    // Two calls on one scope at once are a caller bug, reported rather than misnumbered.
    let (r0, r1) = tokio::join!(s0.barrier(Scope::Global, "e", None), async {
        tokio::time::sleep(Duration::from_millis(50)).await;
        let busy = s0.barrier(Scope::Global, "e", None).await;
        s1.barrier(Scope::Global, "e", None).await.unwrap();
        busy
    });
    r0.unwrap();
    assert!(
        matches!(
            r1,
            Err(Error::BarrierBusy {
                scope: Scope::Global,
                rank: 0
            })
        ),
        "{r1:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rank_that_left_ends_the_barriers_it_cannot_reach() {
    let coordinator = TestCoordinator::start();
    let (_c, mut sessions) = sessions(&coordinator.addr, "leave", 2).await;
    sessions.pop().unwrap().leave().await.unwrap();
    let error = sessions[0]
        .barrier(Scope::Global, "x", None)
        .await
        .unwrap_err();
    assert!(
        matches!(error, Error::RankLeft { rank: 1, .. }),
        "{error:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn heartbeats_keep_an_idle_session_alive() {
    let config = muster_coordinator::Config {
        heartbeat_timeout: Duration::from_millis(300),
        ..Default::default()
    };
    let coordinator = TestCoordinator::start_with(config);
    let (_c, sessions) = sessions(&coordinator.addr, "idle", 2).await;
    tokio::time::sleep(Duration::from_millis(1200)).await;
    let (a, b) = tokio::join!(
        sessions[0].barrier(Scope::Global, "after-idle", None),
        sessions[1].barrier(Scope::Global, "after-idle", None)
    );
    a.unwrap();
    b.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn registration_errors_keep_the_coordinators_status() {
    let coordinator = TestCoordinator::start();
    let (connection, _sessions) = sessions(&coordinator.addr, "reg", 2).await;
    let code = |result: Result<Session, Error>| match result {
        Err(Error::Rpc(status)) => status.code(),
        other => panic!("expected a refused registration, got {other:?}"),
    };
    let attach = |job: &str, generation, rank| {
        Session::attach(&connection, session_config(job, generation, rank))
    };
    assert_eq!(
        code(attach("no-such-job", 1, 0).await),
        tonic::Code::NotFound
    );
    assert_eq!(
        code(attach("reg", 1, 7).await),
        tonic::Code::InvalidArgument
    );
    assert_eq!(code(attach("reg", 1, 0).await), tonic::Code::AlreadyExists);
    assert_eq!(
        code(attach("reg", 5, 0).await),
        tonic::Code::FailedPrecondition
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lost_coordinator_fails_pending_and_later_calls_naming_its_address() {
    let mut coordinator = TestCoordinator::start();
    let addr = coordinator.addr.clone();
    let (connection, sessions) = sessions(&addr, "lost", 2).await;
    // Calls and sessions retry a lost coordinator within the failover budget (30 s by
    // default), in case another replica takes over; here none will.
    connection.set_failover_timeout(Duration::from_millis(500));
    let sessions = Arc::new(sessions);
    let waiter = {
        let sessions = sessions.clone();
        tokio::spawn(async move { sessions[0].barrier(Scope::Global, "b", None).await })
    };
    tokio::time::sleep(Duration::from_millis(100)).await;
    coordinator.kill();
    let check = |result: Result<(), Error>| match result {
        Err(error @ Error::Connection { .. }) => {
            assert!(error.to_string().contains(&addr), "{error}");
        }
        other => panic!("expected a connection error, got {other:?}"),
    };
    check(
        tokio::time::timeout(Duration::from_secs(10), waiter)
            .await
            .unwrap()
            .unwrap(),
    );
    // Give the other session's task time to see the stream break.
    tokio::time::sleep(Duration::from_millis(100)).await;
    check(sessions[1].barrier(Scope::Global, "b", None).await);

    let error = Coordinator::connect(&addr).await.unwrap_err();
    assert!(
        matches!(&error, Error::Connection { addr: a, .. } if *a == addr),
        "{error:?}"
    );
    assert!(error.to_string().contains(&addr), "{error}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kv_unique_ids_and_shared_values_round_trip() {
    let coordinator = TestCoordinator::start();
    let (_c, sessions) = sessions(&coordinator.addr, "values", 2).await;
    let kv = sessions[0].kv();
    let other = sessions[1].kv();
    assert_eq!(kv.get("a").await.unwrap(), None);
    kv.set("a", b"1".to_vec()).await.unwrap();
    assert_eq!(other.get("a").await.unwrap(), Some(b"1".to_vec()));
    let waiter = tokio::spawn(async move { other.get_wait("late", Duration::from_secs(5)).await });
    tokio::time::sleep(Duration::from_millis(50)).await;
    kv.set("late", "here").await.unwrap();
    assert_eq!(waiter.await.unwrap().unwrap(), b"here");
    let error = kv
        .get_wait("never", Duration::from_millis(100))
        .await
        .unwrap_err();
    assert!(error.is_timeout(), "{error:?}");
    // A batch: every value in the order asked, each waited for; one unset key fails it.
    let keys = ["late".to_owned(), "a".to_owned(), "later".to_owned()];
    let other = sessions[1].kv();
    let waiter =
        tokio::spawn(async move { other.get_wait_many(&keys, Duration::from_secs(5)).await });
    tokio::time::sleep(Duration::from_millis(50)).await;
    kv.set("later", "too").await.unwrap();
    assert_eq!(
        waiter.await.unwrap().unwrap(),
        [b"here".to_vec(), b"1".to_vec(), b"too".to_vec()]
    );
    let error = kv
        .get_wait_many(
            &["a".to_owned(), "never".to_owned()],
            Duration::from_millis(100),
        )
        .await
        .unwrap_err();
    assert!(
        error.is_timeout() && error.to_string().contains("never"),
        "{error}"
    );
    assert_eq!(kv.add("n", 5).await.unwrap(), 5);
    assert_eq!(kv.add("n", -2).await.unwrap(), 3);
    let cas = kv.compare_and_set("c", None, "x").await.unwrap();
    assert!(cas.swapped && cas.current.as_deref() == Some(&b"x"[..]));
    let cas = kv.compare_and_set("c", Some(b"y"), "z").await.unwrap();
    assert!(!cas.swapped && cas.current.as_deref() == Some(&b"x"[..]));
    assert!(kv.delete("c").await.unwrap());
    assert!(!kv.delete("c").await.unwrap());
    kv.set("p/2", "b").await.unwrap();
    kv.set("p/1", "a").await.unwrap();
    let listed = kv.list("p/").await.unwrap();
    assert_eq!(
        listed,
        [
            ("p/1".to_owned(), b"a".to_vec()),
            ("p/2".to_owned(), b"b".to_vec())
        ]
    );

    let id = [7u8; 128];
    let fetcher = {
        let ids = sessions[1].unique_ids();
        tokio::spawn(async move { ids.fetch("world", None).await })
    };
    sessions[0]
        .unique_ids()
        .publish("world", &id)
        .await
        .unwrap();
    assert_eq!(fetcher.await.unwrap().unwrap(), id);
    let error = sessions[0]
        .unique_ids()
        .publish("world", &[8u8; 128])
        .await
        .unwrap_err();
    assert!(
        matches!(&error, Error::Rpc(s) if s.code() == tonic::Code::AlreadyExists),
        "{error:?}"
    );

    sessions[0]
        .shared_values()
        .publish("global/x", b"{}".to_vec())
        .await
        .unwrap();
    assert_eq!(
        sessions[1]
            .shared_values()
            .fetch("global/x", None)
            .await
            .unwrap(),
        b"{}"
    );
    let error = sessions[1]
        .shared_values()
        .fetch("global/never", Some(Duration::from_millis(100)))
        .await
        .unwrap_err();
    assert!(error.is_timeout(), "{error:?}");
}

#[test]
fn accelerators_go_main_first_share_and_distribute_unique_ids() {
    let events = Arc::new(Mutex::new(Vec::<(usize, &'static str)>::new()));
    let computed = Arc::new(AtomicUsize::new(0));
    let node_computed = Arc::new(AtomicUsize::new(0));
    let results = {
        let (events, computed, node_computed) =
            (events.clone(), computed.clone(), node_computed.clone());
        with_accelerators("accelerate", &[2, 1], move |accelerator| {
            let rank = accelerator.process_index();
            assert_eq!(accelerator.num_processes(), 3);
            assert_eq!(accelerator.num_nodes(), 2);
            assert_eq!(accelerator.is_last_process(), rank == 2);

            let ran = accelerator
                .main_process_first(|| {
                    events.lock().unwrap().push((rank, "start"));
                    if rank == 0 {
                        std::thread::sleep(Duration::from_millis(200));
                    }
                    events.lock().unwrap().push((rank, "done"));
                    rank
                })
                .unwrap();
            assert_eq!(ran, rank);

            // Three calls from one line get three values.
            let mut shared = Vec::new();
            for i in 0..3 {
                shared.push(
                    accelerator
                        .main_process_first_share(|| {
                            computed.fetch_add(1, Ordering::SeqCst);
                            format!("value {i} from rank {rank}")
                        })
                        .unwrap(),
                );
            }
            let local: (usize, u32) = accelerator
                .local_main_process_first_share(|| {
                    node_computed.fetch_add(1, Ordering::SeqCst);
                    (accelerator.node_rank(), 42)
                })
                .unwrap();
            assert_eq!(local, (accelerator.node_rank(), 42));

            accelerator.local_main_process_first(|| ()).unwrap();
            accelerator.wait_for_local().unwrap();

            if accelerator.is_main_process() {
                accelerator
                    .publish_nccl_unique_id("world", &[rank as u8 + 9; 128])
                    .unwrap();
            }
            let id = accelerator.fetch_nccl_unique_id("world").unwrap();
            // A world within one bootstrap root: one id, made by rank 0 alone.
            let plain = accelerator
                .nccl_unique_ids("plain", || Ok([rank as u8 + 1; 128]))
                .unwrap();
            assert_eq!(plain, [[1u8; 128]]);

            let kv = accelerator.kv();
            kv.add("arrived", 1).unwrap();
            accelerator.wait_for_everyone().unwrap();
            assert_eq!(kv.get("arrived").unwrap(), Some(b"3".to_vec()));
            accelerator
                .wait_for_everyone_timeout(Duration::from_secs(10))
                .unwrap();
            accelerator.finish().unwrap();
            (shared, id)
        })
    };
    for (shared, id) in &results {
        assert_eq!(
            shared,
            &[
                "value 0 from rank 0",
                "value 1 from rank 0",
                "value 2 from rank 0"
            ]
        );
        assert_eq!(id, &[9u8; 128]);
    }
    assert_eq!(
        computed.load(Ordering::SeqCst),
        3,
        "only the main process computes"
    );
    assert_eq!(
        node_computed.load(Ordering::SeqCst),
        2,
        "one computation per node"
    );

    // The main process finished its block before any other process started its own.
    let events = events.lock().unwrap();
    let main_done = events.iter().position(|e| *e == (0, "done")).unwrap();
    let first_other = events.iter().position(|(rank, _)| *rank != 0).unwrap();
    assert!(main_done < first_other, "{events:?}");
    assert_eq!(events.len(), 6, "every process runs the block: {events:?}");
}

#[test]
fn dropping_an_accelerator_leaves_and_different_lines_diverge() {
    let results = with_accelerators("drop", &[3], |accelerator| {
        let rank = accelerator.process_index();
        // Ranks 0 and 1 call from different lines: a divergence, not a hang. The two arms
        // are identical on purpose; only their lines differ.
        #[allow(clippy::if_same_then_else)]
        let first = if rank == 0 {
            accelerator.wait_for_everyone()
        } else {
            accelerator.wait_for_everyone()
        };
        if rank == 2 {
            // Leaves without `finish`: the others are told it left, not that it failed.
            drop(accelerator);
            return (first.map_err(|e| e.to_string()), Ok(()));
        }
        std::thread::sleep(Duration::from_millis(200));
        let second = accelerator.wait_for_everyone_named("after-drop");
        (
            first.map_err(|e| e.to_string()),
            second.map_err(|e| e.to_string()),
        )
    });
    for (rank, (first, second)) in results.iter().enumerate() {
        let first = first.as_ref().unwrap_err();
        assert!(first.contains("diverged"), "rank {rank}: {first}");
        if rank < 2 {
            let second = second.as_ref().unwrap_err();
            // Rank 2 left first; a rank may also see rank 0 or 1 that left after its error.
            assert!(second.contains("has left"), "rank {rank}: {second}");
        }
    }
}

#[test]
fn main_process_first_makes_the_others_wait() {
    let started = Instant::now();
    let waits = with_accelerators("wait", &[3], move |accelerator| {
        accelerator
            .main_process_first(|| {
                if accelerator.is_main_process() {
                    std::thread::sleep(Duration::from_millis(300));
                }
                started.elapsed()
            })
            .unwrap()
    });
    assert!(waits[1] >= Duration::from_millis(300) && waits[2] >= Duration::from_millis(300));
}

/// Above the coordinator's ranks per root, a communicator bootstraps through several unique
/// ids (`ncclCommInitRankScalable`): the coordinator plans the roots as NCCL's blocks (5 ranks,
/// 2 per root: ranks 0, 2 and 4), only those ranks make an id, and every rank gets all three
/// in root order.
#[test]
fn a_world_above_one_root_gets_one_unique_id_per_planned_root() {
    let made = Arc::new(Mutex::new(Vec::new()));
    let config = muster_coordinator::Config {
        nccl_ranks_per_root: 2,
        ..Default::default()
    };
    let ids = {
        let made = made.clone();
        with_accelerators_on(config, "scalable", &[2, 2, 1], move |accelerator| {
            let rank = accelerator.process_index();
            let ids = accelerator
                .nccl_unique_ids("world", || {
                    made.lock().unwrap().push(rank);
                    Ok([rank as u8 + 10; 128])
                })
                .unwrap();
            accelerator.finish().unwrap();
            ids
        })
    };
    for got in &ids {
        assert_eq!(got, &[[10u8; 128], [12u8; 128], [14u8; 128]]);
    }
    let mut made = made.lock().unwrap().clone();
    made.sort_unstable();
    assert_eq!(made, [0, 2, 4], "only the planned roots make an id");
}
