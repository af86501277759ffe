//! The key-value store, NCCL unique ids and shared values against a real coordinator, and bad
//! input that must be rejected with the right status without changing anything.
#![allow(clippy::unwrap_used, missing_docs)]

mod common;
use common::*;
use muster_coordinator::Config;
use muster_proto::v1 as pb;
use pb::key_value_client::KeyValueClient;
use pb::shared_values_client::SharedValuesClient;
use pb::unique_ids_client::UniqueIdsClient;
use std::time::{Duration, Instant};
use tonic::Code;
use tonic::transport::Channel;

fn kv(ch: &Channel) -> KeyValueClient<Channel> {
    KeyValueClient::new(ch.clone())
}

async fn set(ch: &Channel, job: &str, key: &str, value: &[u8]) -> Result<(), tonic::Status> {
    kv(ch)
        .set(pb::SetRequest {
            job_id: job.into(),
            key: key.into(),
            value: value.to_vec(),
            ..Default::default()
        })
        .await
        .map(|_| ())
}

async fn get(ch: &Channel, job: &str, key: &str, wait_ms: u64) -> Result<Vec<u8>, tonic::Status> {
    kv(ch)
        .get(pb::GetRequest {
            job_id: job.into(),
            key: key.into(),
            wait_ms,
        })
        .await
        .map(|r| r.into_inner().value)
}

async fn list(ch: &Channel, job: &str, prefix: &str) -> Vec<(String, Vec<u8>)> {
    kv(ch)
        .list(pb::ListRequest {
            job_id: job.into(),
            prefix: prefix.into(),
        })
        .await
        .unwrap()
        .into_inner()
        .items
        .into_iter()
        .map(|i| (i.key, i.value))
        .collect()
}

#[tokio::test]
async fn kv_has_tcpstore_semantics() {
    let s = start_default().await;
    let ch = &s.channel;
    form(ch, "kv", 1, 1).await;
    set(ch, "kv", "a/1", b"one").await.unwrap();
    assert_eq!(get(ch, "kv", "a/1", 0).await.unwrap(), b"one");
    let e = get(ch, "kv", "missing", 0).await.unwrap_err();
    assert_eq!(e.code(), Code::NotFound);
    assert!(e.message().contains("'missing'"), "{}", e.message());
    // get waits for the key to appear.
    let waiter = {
        let ch = ch.clone();
        tokio::spawn(async move { get(&ch, "kv", "later", 5000).await })
    };
    tokio::time::sleep(Duration::from_millis(100)).await;
    set(ch, "kv", "later", b"here").await.unwrap();
    assert_eq!(waiter.await.unwrap().unwrap(), b"here");
    // ... and times out with DEADLINE_EXCEEDED naming the key.
    let t = Instant::now();
    let e = get(ch, "kv", "never", 200).await.unwrap_err();
    assert_eq!(e.code(), Code::DeadlineExceeded);
    assert!(e.message().contains("'never'"));
    assert!(t.elapsed() < Duration::from_secs(2));
    // add is an atomic counter, also under concurrency.
    let adders: Vec<_> = (0..20)
        .map(|_| {
            let ch = ch.clone();
            tokio::spawn(async move {
                kv(&ch)
                    .add(pb::AddRequest {
                        job_id: "kv".into(),
                        key: "n".into(),
                        delta: 2,
                        ..Default::default()
                    })
                    .await
                    .unwrap()
            })
        })
        .collect();
    for a in adders {
        a.await.unwrap();
    }
    let v = kv(ch)
        .add(pb::AddRequest {
            job_id: "kv".into(),
            key: "n".into(),
            delta: -1,
            ..Default::default()
        })
        .await
        .unwrap();
    assert_eq!(v.into_inner().value, 39);
    assert_eq!(get(ch, "kv", "n", 0).await.unwrap(), b"39");
    let e = kv(ch)
        .add(pb::AddRequest {
            job_id: "kv".into(),
            key: "a/1".into(),
            delta: 1,
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::FailedPrecondition);
    // compare-and-set.
    let cas = |expected: Option<&[u8]>, desired: &[u8]| pb::CompareAndSetRequest {
        job_id: "kv".into(),
        key: "c".into(),
        expected: expected.map(<[u8]>::to_vec),
        desired: desired.to_vec(),
        ..Default::default()
    };
    let r = kv(ch)
        .compare_and_set(cas(None, b"v1"))
        .await
        .unwrap()
        .into_inner();
    assert!(r.swapped);
    let r = kv(ch)
        .compare_and_set(cas(None, b"v2"))
        .await
        .unwrap()
        .into_inner();
    assert!(!r.swapped);
    assert_eq!(r.current.as_deref(), Some(&b"v1"[..]));
    let r = kv(ch)
        .compare_and_set(cas(Some(b"v1"), b"v2"))
        .await
        .unwrap()
        .into_inner();
    assert!(r.swapped);
    // delete and list by prefix.
    set(ch, "kv", "a/2", b"two").await.unwrap();
    set(ch, "kv", "b/1", b"x").await.unwrap();
    assert_eq!(
        list(ch, "kv", "a/").await,
        [
            ("a/1".into(), b"one".to_vec()),
            ("a/2".into(), b"two".to_vec())
        ]
    );
    let d = kv(ch)
        .delete(pb::DeleteRequest {
            job_id: "kv".into(),
            key: "a/1".into(),
            ..Default::default()
        })
        .await
        .unwrap();
    assert!(d.into_inner().existed);
    let d = kv(ch)
        .delete(pb::DeleteRequest {
            job_id: "kv".into(),
            key: "a/1".into(),
            ..Default::default()
        })
        .await
        .unwrap();
    assert!(!d.into_inner().existed);
    assert_eq!(list(ch, "kv", "a/").await.len(), 1);
}

#[tokio::test]
async fn kv_caps_values_and_jobs_without_partial_writes() {
    let config = Config {
        max_value_bytes: 1000,
        max_job_bytes: 2500,
        ..Config::default()
    };
    let s = start(config).await;
    let ch = &s.channel;
    form(ch, "cap", 1, 1).await;
    let e = set(ch, "cap", "big", &[0; 1001]).await.unwrap_err();
    assert_eq!(e.code(), Code::ResourceExhausted);
    assert!(e.message().contains("1001 bytes"), "{}", e.message());
    set(ch, "cap", "a", &[1; 1000]).await.unwrap();
    set(ch, "cap", "b", &[2; 1000]).await.unwrap();
    let e = set(ch, "cap", "c", &[3; 1000]).await.unwrap_err();
    assert_eq!(e.code(), Code::ResourceExhausted);
    assert!(e.message().contains("max_job_bytes"), "{}", e.message());
    assert_eq!(
        list(ch, "cap", "").await.len(),
        2,
        "the rejected write left a key behind"
    );
    // Replacing a value with one of the same size fits; freeing space makes room again.
    set(ch, "cap", "a", &[9; 1000]).await.unwrap();
    kv(ch)
        .delete(pb::DeleteRequest {
            job_id: "cap".into(),
            key: "b".into(),
            ..Default::default()
        })
        .await
        .unwrap();
    set(ch, "cap", "c", &[3; 1000]).await.unwrap();
}

fn publish_id(
    job: &str,
    generation: u64,
    rank: u32,
    comm: &str,
    id: Vec<u8>,
) -> pb::PublishUniqueIdRequest {
    pb::PublishUniqueIdRequest {
        job_id: job.into(),
        generation,
        rank,
        communicator: comm.into(),
        unique_id: id,
        ..Default::default()
    }
}

fn fetch_id(
    job: &str,
    generation: u64,
    rank: u32,
    comm: &str,
    wait_ms: u64,
) -> pb::FetchUniqueIdRequest {
    pb::FetchUniqueIdRequest {
        job_id: job.into(),
        generation,
        rank,
        communicator: comm.into(),
        wait_ms,
        ..Default::default()
    }
}

#[tokio::test]
async fn unique_ids_are_published_once_per_generation_and_communicator() {
    let s = start_default().await;
    let ch = &s.channel;
    form(ch, "nccl", 1, 4).await;
    let mut c = UniqueIdsClient::new(ch.clone());
    // Fetchers wait for the root.
    let fetchers: Vec<_> = (1..4)
        .map(|rank| {
            let mut c = c.clone();
            tokio::spawn(async move {
                c.fetch(fetch_id("nccl", 1, rank, "world", 0))
                    .await
                    .unwrap()
                    .into_inner()
            })
        })
        .collect();
    tokio::time::sleep(Duration::from_millis(100)).await;
    let id: Vec<u8> = (0..128).map(|i| i as u8).collect();
    c.publish(publish_id("nccl", 1, 0, "world", id.clone()))
        .await
        .unwrap();
    for f in fetchers {
        let r = f.await.unwrap();
        assert_eq!(r.unique_id, id);
        assert_eq!(r.root_rank, 0);
    }
    // The same bytes again is fine; different bytes are not.
    c.publish(publish_id("nccl", 1, 0, "world", id.clone()))
        .await
        .unwrap();
    let e = c
        .publish(publish_id("nccl", 1, 0, "world", vec![7; 128]))
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::AlreadyExists);
    assert!(e.message().contains("rank 0"), "{}", e.message());
    // Several communicators per job.
    c.publish(publish_id("nccl", 1, 2, "tp-0", vec![2; 128]))
        .await
        .unwrap();
    assert_eq!(
        c.fetch(fetch_id("nccl", 1, 3, "tp-0", 0))
            .await
            .unwrap()
            .into_inner()
            .unique_id,
        vec![2; 128]
    );
    assert_eq!(
        c.fetch(fetch_id("nccl", 1, 3, "world", 0))
            .await
            .unwrap()
            .into_inner()
            .unique_id,
        id
    );
    // Wrong size, outsider, unknown job.
    for (req, code, needle) in [
        (
            publish_id("nccl", 1, 0, "x", vec![0; 127]),
            Code::InvalidArgument,
            "127 bytes",
        ),
        (
            publish_id("nccl", 1, 9, "x", vec![0; 128]),
            Code::InvalidArgument,
            "rank 9 is outside",
        ),
        (
            publish_id("nope", 1, 0, "x", vec![0; 128]),
            Code::NotFound,
            "job 'nope'",
        ),
        (
            publish_id("nccl", 0, 0, "x", vec![0; 128]),
            Code::InvalidArgument,
            "generation",
        ),
        (
            publish_id("nccl", 1, 0, "bad name", vec![0; 128]),
            Code::InvalidArgument,
            "communicator",
        ),
    ] {
        let e = c.publish(req).await.unwrap_err();
        assert_eq!(e.code(), code, "{}", e.message());
        assert!(
            e.message().contains(needle),
            "{} should name {needle}",
            e.message()
        );
    }
    let e = c.fetch(fetch_id("nccl", 1, 0, "x", 100)).await.unwrap_err();
    assert_eq!(
        e.code(),
        Code::DeadlineExceeded,
        "rejected publishes must not have stored 'x'"
    );
}

/// A communicator above `nccl_ranks_per_root` ranks is planned with several bootstrap roots
/// (NCCL's blocks: 5 ranks at 2 per root are made by ranks 0, 2 and 4), every rank is told the
/// same plan, only a root may publish its id, and a fetch of them all waits for every one.
/// Refused publishes store nothing; a world within one root keeps the one-id protocol.
#[tokio::test]
async fn a_communicator_above_one_root_is_planned_and_fetched_whole() {
    let s = start(Config {
        nccl_ranks_per_root: 2,
        ..Config::default()
    })
    .await;
    let ch = &s.channel;
    form(ch, "roots", 1, 5).await;
    let mut c = UniqueIdsClient::new(ch.clone());
    let roots = |rank| pb::UniqueIdRootsRequest {
        job_id: "roots".into(),
        generation: 1,
        rank,
        communicator: "world".into(),
    };
    for rank in [3, 0, 4] {
        let plan = c.roots(roots(rank)).await.unwrap().into_inner();
        assert_eq!((plan.roots, plan.ranks_per_root), (vec![0, 2, 4], 2));
    }
    let all = |rank, wait_ms| pb::FetchUniqueIdRequest {
        all: true,
        ..fetch_id("roots", 1, rank, "world", wait_ms)
    };
    let fetcher = {
        let mut c = c.clone();
        tokio::spawn(async move { c.fetch(all(1, 0)).await.unwrap().into_inner() })
    };
    let root = |rank, root, byte| pb::PublishUniqueIdRequest {
        root,
        ..publish_id("roots", 1, rank, "world", vec![byte; 128])
    };
    c.publish(root(0, 0, 10)).await.unwrap();
    c.publish(root(2, 1, 12)).await.unwrap();
    let e = c.fetch(all(3, 100)).await.unwrap_err();
    assert_eq!(e.code(), Code::DeadlineExceeded, "{}", e.message());
    for (request, code, needle) in [
        (root(1, 2, 99), Code::PermissionDenied, "rank 4 is"),
        (root(4, 3, 99), Code::InvalidArgument, "roots 0 to 2"),
    ] {
        let e = c.publish(request).await.unwrap_err();
        assert_eq!(e.code(), code, "{}", e.message());
        assert!(e.message().contains(needle), "{}", e.message());
    }
    c.publish(root(4, 2, 14)).await.unwrap();
    let whole = fetcher.await.unwrap();
    assert_eq!(
        whole.unique_ids,
        vec![vec![10; 128], vec![12; 128], vec![14; 128]]
    );
    assert_eq!((whole.unique_id, whole.root_rank), (vec![10; 128], 0));

    // Two ranks fit one root: the plan is rank 0 alone, and the one-id calls are unchanged.
    form(ch, "one-root", 1, 2).await;
    let plan = c
        .roots(pb::UniqueIdRootsRequest {
            job_id: "one-root".into(),
            ..roots(1)
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(plan.roots, vec![0]);
    c.publish(publish_id("one-root", 1, 0, "world", vec![5; 128]))
        .await
        .unwrap();
    let one = c
        .fetch(fetch_id("one-root", 1, 1, "world", 0))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(one.unique_id, vec![5; 128]);
}

#[tokio::test]
async fn a_new_generation_never_sees_the_old_unique_id_or_shared_value() {
    let s = start_default().await;
    let ch = &s.channel;
    // The second round below is the same node joining again: a restart, so budget one.
    let mut first = join_req("fresh", "n0", 2, 1, 1);
    first.config.as_mut().unwrap().max_restarts = Some(1);
    spawn_join(ch, first).await.unwrap().unwrap();
    let mut ids = UniqueIdsClient::new(ch.clone());
    let mut shared = SharedValuesClient::new(ch.clone());
    ids.publish(publish_id("fresh", 1, 0, "world", vec![1; 128]))
        .await
        .unwrap();
    shared
        .publish(pb::PublishValueRequest {
            job_id: "fresh".into(),
            generation: 1,
            rank: 0,
            name: "global/data.rs:3#1".into(),
            value: b"old".to_vec(),
        })
        .await
        .unwrap();
    form(ch, "fresh", 1, 2).await;
    let e = ids
        .fetch(fetch_id("fresh", 2, 1, "world", 200))
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::DeadlineExceeded);
    let e = shared
        .fetch(pb::FetchValueRequest {
            job_id: "fresh".into(),
            generation: 2,
            rank: 1,
            name: "global/data.rs:3#1".into(),
            wait_ms: 200,
        })
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::DeadlineExceeded);
    // Asking for the old generation is fenced, not served.
    let e = ids
        .fetch(fetch_id("fresh", 1, 1, "world", 0))
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::FailedPrecondition);
}

#[tokio::test]
async fn a_fetch_waiting_on_a_dead_main_fails_naming_it() {
    let s = start_default().await;
    let ch = &s.channel;
    form(ch, "orphan", 1, 2).await;
    let mut r = attach_all(ch, "orphan", 1, 2).await;
    let waiter = {
        let mut shared = SharedValuesClient::new(ch.clone());
        tokio::spawn(async move {
            shared
                .fetch(pb::FetchValueRequest {
                    job_id: "orphan".into(),
                    generation: 1,
                    rank: 1,
                    name: "global/cache".into(),
                    wait_ms: 0,
                })
                .await
        })
    };
    tokio::time::sleep(Duration::from_millis(100)).await;
    let t = Instant::now();
    r.remove(0).kill();
    let e = waiter.await.unwrap().unwrap_err();
    assert_eq!(e.code(), Code::Aborted);
    assert!(e.message().contains("rank 0 (node 0"), "{}", e.message());
    assert!(t.elapsed() < Duration::from_secs(2));
}

#[tokio::test]
async fn bad_sessions_are_rejected_and_change_nothing() {
    let s = start_default().await;
    let ch = &s.channel;
    form(ch, "bad", 1, 2).await;
    let _r0 = Raw::attach(ch, "bad", 1, 0).await.unwrap();
    for (job, generation, rank, code, needle) in [
        ("bad", 1, 0, Code::AlreadyExists, "already registered"),
        ("bad", 1, 2, Code::InvalidArgument, "outside"),
        ("bad", 2, 1, Code::FailedPrecondition, "does not exist"),
        ("bad", 0, 1, Code::InvalidArgument, "generation"),
        ("nope", 1, 1, Code::NotFound, "job 'nope'"),
        ("", 1, 1, Code::InvalidArgument, "job_id"),
    ] {
        let e = Raw::attach(ch, job, generation, rank).await.err().unwrap();
        assert_eq!(e.code(), code, "{}", e.message());
        assert!(
            e.message().contains(needle),
            "{} should contain {needle}",
            e.message()
        );
    }
    let d = describe(ch, "bad").await;
    let states: Vec<i32> = d.ranks.iter().map(|r| r.state).collect();
    assert_eq!(
        states,
        [pb::RankState::Running as i32, pb::RankState::Pending as i32]
    );
    assert!(d.failure.is_none());
    // A bad join leaves the job as it was.
    let mut rz = pb::rendezvous_client::RendezvousClient::new(ch.clone());
    for (req, code) in [
        (join_req("bad", "x", 0, 1, 1), Code::InvalidArgument),
        (join_req("bad", "x", 5000, 1, 1), Code::InvalidArgument),
        (join_req("bad", "", 1, 1, 1), Code::InvalidArgument),
        (join_req("bad", "x", 1, 3, 2), Code::InvalidArgument),
        (join_req("bad", "x", 1, 2, 2), Code::FailedPrecondition),
        (join_req("bad/x", "x", 1, 1, 1), Code::InvalidArgument),
    ] {
        let e = rz.join(req).await.unwrap_err();
        assert_eq!(e.code(), code, "{}", e.message());
    }
    let after = describe(ch, "bad").await;
    assert_eq!(
        after.summary.unwrap().generation,
        1,
        "a rejected join opened a round"
    );
    // Oversized messages are refused by the transport, not buffered.
    let huge = Config::default().max_message_bytes + (1 << 20);
    let e = set(ch, "bad", "huge", &vec![0; huge]).await.unwrap_err();
    assert_eq!(e.code(), Code::OutOfRange, "{}", e.message());
}
