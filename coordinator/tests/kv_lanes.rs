//! Key-value lanes against a real coordinator: a `Set`, `Add`, `CompareAndSet` or `Delete`
//! that names a `client_id` and a `sequence` is applied at most once per (lane, sequence), so
//! a client may retry it after a failover. A retry gets the first answer without applying again, an older
//! sequence or a used one with another call is refused and changes nothing, lanes are
//! independent, and lane records count towards the job's byte cap.
#![allow(clippy::unwrap_used, missing_docs)]

mod common;
use common::*;
use muster_coordinator::Config;
use muster_proto::v1 as pb;
use pb::key_value_client::KeyValueClient;
use tonic::Code;
use tonic::transport::Channel;

const JOB: &str = "lanes";

fn kv(ch: &Channel) -> KeyValueClient<Channel> {
    KeyValueClient::new(ch.clone())
}

async fn add(
    ch: &Channel,
    lane: &str,
    sequence: u64,
    key: &str,
    delta: i64,
) -> Result<i64, tonic::Status> {
    kv(ch)
        .add(pb::AddRequest {
            job_id: JOB.into(),
            key: key.into(),
            delta,
            client_id: lane.into(),
            sequence,
        })
        .await
        .map(|r| r.into_inner().value)
}

async fn cas(
    ch: &Channel,
    lane: &str,
    sequence: u64,
    key: &str,
    expected: Option<&[u8]>,
    desired: &[u8],
) -> Result<(bool, Option<Vec<u8>>), tonic::Status> {
    kv(ch)
        .compare_and_set(pb::CompareAndSetRequest {
            job_id: JOB.into(),
            key: key.into(),
            expected: expected.map(<[u8]>::to_vec),
            desired: desired.to_vec(),
            client_id: lane.into(),
            sequence,
        })
        .await
        .map(|r| {
            let r = r.into_inner();
            (r.swapped, r.current)
        })
}

async fn set(
    ch: &Channel,
    lane: &str,
    sequence: u64,
    key: &str,
    value: &[u8],
) -> Result<(), tonic::Status> {
    kv(ch)
        .set(pb::SetRequest {
            job_id: JOB.into(),
            key: key.into(),
            value: value.to_vec(),
            client_id: lane.into(),
            sequence,
        })
        .await
        .map(|_| ())
}

async fn delete(ch: &Channel, lane: &str, sequence: u64, key: &str) -> Result<bool, tonic::Status> {
    kv(ch)
        .delete(pb::DeleteRequest {
            job_id: JOB.into(),
            key: key.into(),
            client_id: lane.into(),
            sequence,
        })
        .await
        .map(|r| r.into_inner().existed)
}

async fn value(ch: &Channel, key: &str) -> Option<Vec<u8>> {
    match kv(ch)
        .get(pb::GetRequest {
            job_id: JOB.into(),
            key: key.into(),
            wait_ms: 0,
        })
        .await
    {
        Ok(r) => Some(r.into_inner().value),
        Err(e) if e.code() == Code::NotFound => None,
        Err(e) => panic!("get '{key}': {e}"),
    }
}

async fn started(config: Config) -> Server {
    let s = start(config).await;
    form(&s.channel, JOB, 1, 1).await;
    s
}

#[tokio::test]
async fn a_retried_add_gets_its_first_answer_and_counts_once() {
    let s = started(Config::default()).await;
    let ch = &s.channel;
    assert_eq!(add(ch, "a", 1, "n", 2).await.unwrap(), 2);
    // The retry of sequence 1 (the first attempt's answer was lost in a failover).
    assert_eq!(add(ch, "a", 1, "n", 2).await.unwrap(), 2);
    assert_eq!(value(ch, "n").await.unwrap(), b"2");
    // Another client's add in between: a retry still answers what the call itself saw.
    assert_eq!(add(ch, "b", 1, "n", 10).await.unwrap(), 12);
    assert_eq!(add(ch, "a", 1, "n", 2).await.unwrap(), 2);
    assert_eq!(add(ch, "a", 2, "n", 3).await.unwrap(), 15);
    assert_eq!(add(ch, "a", 2, "n", 3).await.unwrap(), 15);
    assert_eq!(value(ch, "n").await.unwrap(), b"15");
    // Calls without a lane are applied every time, as before lanes.
    for _ in 0..2 {
        kv(ch)
            .add(pb::AddRequest {
                job_id: JOB.into(),
                key: "n".into(),
                delta: 1,
                ..Default::default()
            })
            .await
            .unwrap();
    }
    assert_eq!(value(ch, "n").await.unwrap(), b"17");
}

#[tokio::test]
async fn a_retried_swap_answers_swapped_and_does_not_swap_again() {
    let s = started(Config::default()).await;
    let ch = &s.channel;
    let swapped = (true, Some(b"one".to_vec()));
    assert_eq!(cas(ch, "c", 1, "k", None, b"one").await.unwrap(), swapped);
    // Applied again, this would answer "not swapped, the value is one".
    assert_eq!(cas(ch, "c", 1, "k", None, b"one").await.unwrap(), swapped);
    // An append as a compare-and-set loop: the retry of an applied swap must not append again.
    let appended = (true, Some(b"one-two".to_vec()));
    let step = |seq| cas(ch, "c", seq, "k", Some(b"one"), b"one-two");
    assert_eq!(step(2).await.unwrap(), appended);
    assert_eq!(step(2).await.unwrap(), appended);
    assert_eq!(value(ch, "k").await.unwrap(), b"one-two");
    // A compare-and-set that did not swap changed nothing and is not recorded: its retry
    // decides again (here, after another client made it match).
    assert_eq!(
        cas(ch, "c", 3, "k", Some(b"three"), b"four").await.unwrap(),
        (false, Some(b"one-two".to_vec()))
    );
    kv(ch)
        .set(pb::SetRequest {
            job_id: JOB.into(),
            key: "k".into(),
            value: b"three".to_vec(),
            ..Default::default()
        })
        .await
        .unwrap();
    assert_eq!(
        cas(ch, "c", 3, "k", Some(b"three"), b"four").await.unwrap(),
        (true, Some(b"four".to_vec()))
    );
}

/// The fault suite's finding: a set whose answer was lost, retried after another client read
/// it and deleted the key, must not write the key again; a delete's retry must not delete
/// what was set since, and answers whether the key existed when it was applied.
#[tokio::test]
async fn a_retried_set_or_delete_is_not_applied_again_over_another_clients_write() {
    let s = started(Config::default()).await;
    let ch = &s.channel;
    set(ch, "a", 1, "k", b"mine").await.unwrap();
    assert!(delete(ch, "b", 1, "k").await.unwrap());
    // The retry of the set: answered, the key stays deleted.
    set(ch, "a", 1, "k", b"mine").await.unwrap();
    assert_eq!(value(ch, "k").await, None);
    // A retry of the delete after another client set the key: it existed when the delete
    // was applied, and the new value stays.
    set(ch, "c", 1, "k", b"theirs").await.unwrap();
    assert!(delete(ch, "b", 1, "k").await.unwrap());
    assert_eq!(value(ch, "k").await.unwrap(), b"theirs");
    // A delete of a missing key is recorded too: its retry still says it did not exist.
    assert!(!delete(ch, "b", 2, "gone").await.unwrap());
    set(ch, "c", 2, "gone", b"back").await.unwrap();
    assert!(!delete(ch, "b", 2, "gone").await.unwrap());
    assert_eq!(value(ch, "gone").await.unwrap(), b"back");
    // The next call of a lane is applied; a set's sequence reused for another value, or for a
    // delete, is refused and changes nothing.
    set(ch, "a", 2, "k", b"second").await.unwrap();
    assert_eq!(value(ch, "k").await.unwrap(), b"second");
    for (what, e) in [
        (
            "another value",
            set(ch, "a", 2, "k", b"other").await.unwrap_err(),
        ),
        (
            "another kind",
            delete(ch, "a", 2, "k").await.map(|_| ()).unwrap_err(),
        ),
        ("stale", set(ch, "a", 1, "k", b"mine").await.unwrap_err()),
    ] {
        assert_eq!(e.code(), Code::FailedPrecondition, "{what}: {e:?}");
    }
    assert_eq!(value(ch, "k").await.unwrap(), b"second");
    // Bad lanes are refused as for an add.
    let e = set(ch, "a/b", 1, "k", b"x").await.unwrap_err();
    assert_eq!(e.code(), Code::InvalidArgument, "{e:?}");
    let e = delete(ch, "", 3, "k").await.unwrap_err();
    assert_eq!(e.code(), Code::InvalidArgument, "{e:?}");
    assert_eq!(value(ch, "k").await.unwrap(), b"second");
}

#[tokio::test]
async fn stale_and_reused_sequences_are_refused_and_change_nothing() {
    let s = started(Config::default()).await;
    let ch = &s.channel;
    assert_eq!(add(ch, "a", 1, "n", 1).await.unwrap(), 1);
    assert_eq!(add(ch, "a", 5, "n", 1).await.unwrap(), 2);
    // A call the client gave up on arriving after a later one was applied.
    let e = add(ch, "a", 4, "n", 1).await.unwrap_err();
    assert_eq!(e.code(), Code::FailedPrecondition, "{e:?}");
    assert_eq!(
        e.message(),
        "add: sequence 4 of lane 'a' in job 'lanes' is stale: the lane already applied \
         sequence 5 (a lane numbers its calls upwards and sends each after the one before it \
         answered)"
    );
    let e = cas(ch, "a", 1, "k", None, b"x").await.unwrap_err();
    assert_eq!(e.code(), Code::FailedPrecondition, "{e:?}");
    assert!(
        e.message().starts_with("compare_and_set: sequence 1"),
        "{e}"
    );
    // The sequence of the last call, sent with another call: not that call's retry.
    for (what, result) in [
        ("another delta", add(ch, "a", 5, "n", 2).await.map(|_| ())),
        ("another key", add(ch, "a", 5, "m", 1).await.map(|_| ())),
        (
            "another kind",
            cas(ch, "a", 5, "n", None, b"x").await.map(|_| ()),
        ),
    ] {
        let e = result.unwrap_err();
        assert_eq!(e.code(), Code::FailedPrecondition, "{what}: {e:?}");
        assert!(
            e.message()
                .contains("sequence 5 of lane 'a' in job 'lanes' was already used by another call"),
            "{what}: {e}"
        );
    }
    assert_eq!(value(ch, "n").await.unwrap(), b"2");
    assert_eq!(value(ch, "m").await, None);
    assert_eq!(value(ch, "k").await, None);
    // The lane goes on from where it was.
    assert_eq!(add(ch, "a", 6, "n", 1).await.unwrap(), 3);
}

#[tokio::test]
async fn lanes_are_independent() {
    let s = started(Config::default()).await;
    let ch = &s.channel;
    // The same sequence on two lanes: two calls, both applied.
    assert_eq!(add(ch, "x", 1, "n", 1).await.unwrap(), 1);
    assert_eq!(add(ch, "y", 1, "n", 1).await.unwrap(), 2);
    // A lane far ahead makes no other lane's call stale.
    assert_eq!(add(ch, "x", 100, "n", 1).await.unwrap(), 3);
    assert_eq!(add(ch, "y", 2, "n", 1).await.unwrap(), 4);
    // Concurrent lanes, each retrying every call once: every add counted exactly once.
    let tasks: Vec<_> = (0..8)
        .map(|lane| {
            let ch = ch.clone();
            tokio::spawn(async move {
                let lane = format!("lane-{lane}");
                for seq in 1..=10 {
                    let first = add(&ch, &lane, seq, "c", 1).await.unwrap();
                    assert_eq!(add(&ch, &lane, seq, "c", 1).await.unwrap(), first);
                }
            })
        })
        .collect();
    for t in tasks {
        t.await.unwrap();
    }
    assert_eq!(value(ch, "c").await.unwrap(), b"80");
}

#[tokio::test]
async fn bad_lanes_are_refused_and_change_nothing() {
    let s = started(Config::default()).await;
    let ch = &s.channel;
    let long = "z".repeat(65);
    for (lane, seq, expected) in [
        (
            "a/b",
            1,
            "client_id \"a/b\" must be 1 to 64 characters of [0-9A-Za-z_-]",
        ),
        (&long, 1, "must be 1 to 64 characters"),
        ("a", 0, "client_id 'a' needs a sequence of 1 or more"),
        ("", 3, "sequence 3 without a client_id"),
    ] {
        let e = add(ch, lane, seq, "n", 1).await.unwrap_err();
        assert_eq!(e.code(), Code::InvalidArgument, "{lane:?}: {e:?}");
        assert!(e.message().contains(expected), "{lane:?}: {e}");
        let e = cas(ch, lane, seq, "k", None, b"v").await.unwrap_err();
        assert_eq!(e.code(), Code::InvalidArgument, "{lane:?}: {e:?}");
    }
    assert_eq!(value(ch, "n").await, None);
    assert_eq!(value(ch, "k").await, None);
}

#[tokio::test]
async fn lane_records_count_towards_the_jobs_byte_cap() {
    let s = started(Config {
        max_value_bytes: 1000,
        max_job_bytes: 2000,
        ..Config::default()
    })
    .await;
    let ch = &s.channel;
    // One counter; every new lane adds a record of its own (its id and about 45 bytes).
    let mut lanes = 0;
    let refused = loop {
        match add(ch, &format!("{lanes:032x}"), 1, "n", 1).await {
            Ok(n) => assert_eq!(n, lanes + 1),
            Err(e) => break e,
        }
        lanes += 1;
        assert!(lanes < 100, "2000 bytes held {lanes} lanes");
    };
    assert!(lanes > 10, "only {lanes} lanes fit in 2000 bytes");
    assert_eq!(refused.code(), Code::ResourceExhausted, "{refused:?}");
    assert!(
        refused.message().contains("max_job_bytes"),
        "{}",
        refused.message()
    );
    // The refused call changed nothing, and an existing lane still works (its record is
    // overwritten, not added to).
    assert_eq!(value(ch, "n").await.unwrap(), lanes.to_string().as_bytes());
    assert_eq!(
        add(ch, &format!("{:032x}", 0), 2, "n", 1).await.unwrap(),
        lanes + 1
    );
}
