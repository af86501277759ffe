//! The coordinator's resource limits, on a real server: an oversized message is refused and
//! changes nothing, connections beyond `max_connections` wait until one closes, and calls
//! beyond `max_streams_per_connection` on one connection wait for a free stream.
#![allow(clippy::unwrap_used, missing_docs)]

mod common;

use muster_coordinator::Config;
use muster_proto::v1 as pb;
use pb::key_value_client::KeyValueClient;
use std::time::Duration;
use tonic::Code;
use tonic::transport::Channel;

/// Creates job `job` (one node, one worker) so that its key-value store exists.
async fn make_job(ch: &Channel, job: &str) {
    let answer = common::spawn_join(ch, common::join_req(job, "n0", 1, 1, 1));
    answer.await.unwrap().unwrap();
}

fn get(job: &str, key: &str, wait_ms: u64) -> pb::GetRequest {
    pb::GetRequest {
        job_id: job.into(),
        key: key.into(),
        wait_ms,
    }
}

/// A plain channel that does not retry, so that a refused or queued connection shows.
async fn raw_channel(addr: std::net::SocketAddr) -> Channel {
    Channel::from_shared(format!("http://{addr}"))
        .unwrap()
        .connect_lazy()
}

#[tokio::test]
async fn oversized_message_is_refused_and_changes_nothing() {
    let server = common::start(Config {
        max_message_bytes: 64 << 10,
        ..Config::default()
    })
    .await;
    make_job(&server.channel, "big").await;
    let mut kv = KeyValueClient::new(server.channel.clone());
    let err = kv
        .set(pb::SetRequest {
            job_id: "big".into(),
            key: "k".into(),
            value: vec![7; 100 << 10],
        })
        .await
        .unwrap_err();
    assert!(
        matches!(err.code(), Code::ResourceExhausted | Code::OutOfRange),
        "{err:?}"
    );
    let missing = kv.get(get("big", "k", 0)).await.unwrap_err();
    assert_eq!(missing.code(), Code::NotFound, "{missing:?}");
    // The connection is still good: a message under the limit goes through.
    kv.set(pb::SetRequest {
        job_id: "big".into(),
        key: "k".into(),
        value: vec![7; 1000],
    })
    .await
    .unwrap();
    assert_eq!(
        kv.get(get("big", "k", 0))
            .await
            .unwrap()
            .into_inner()
            .value
            .len(),
        1000
    );
}

#[tokio::test]
async fn connections_beyond_the_cap_wait_until_one_closes() {
    // The helper's own channel takes one of the two slots.
    let server = common::start(Config {
        max_connections: 2,
        ..Config::default()
    })
    .await;
    make_job(&server.channel, "conns").await;
    let second = raw_channel(server.addr).await;
    KeyValueClient::new(second.clone())
        .list(pb::ListRequest {
            job_id: "conns".into(),
            prefix: String::new(),
        })
        .await
        .unwrap();
    // The third connection is not served while both slots are held.
    let third = raw_channel(server.addr).await;
    let mut third_kv = KeyValueClient::new(third);
    let list = pb::ListRequest {
        job_id: "conns".into(),
        prefix: String::new(),
    };
    let waiting = tokio::time::timeout(Duration::from_millis(500), third_kv.list(list.clone()));
    assert!(
        waiting.await.is_err(),
        "a third connection was served over a cap of 2"
    );
    // Closing one frees its slot; the third is then served.
    drop(second);
    let served = tokio::time::timeout(Duration::from_secs(10), third_kv.list(list)).await;
    served
        .expect("the queued connection was never served")
        .unwrap();
}

#[tokio::test]
async fn streams_beyond_the_cap_wait_for_a_free_one() {
    let server = common::start(Config {
        max_streams_per_connection: 2,
        ..Config::default()
    })
    .await;
    make_job(&server.channel, "streams").await;
    // Two long polls hold both streams of the connection.
    let polls: Vec<_> = (0..2)
        .map(|i| {
            let mut kv = KeyValueClient::new(server.channel.clone());
            tokio::spawn(async move { kv.get(get("streams", &format!("never-{i}"), 60_000)).await })
        })
        .collect();
    tokio::time::sleep(Duration::from_millis(200)).await;
    // A third call on the same connection is queued by the client (h2 honours the server's
    // SETTINGS_MAX_CONCURRENT_STREAMS), not refused.
    let mut kv = KeyValueClient::new(server.channel.clone());
    let queued = tokio::time::timeout(Duration::from_millis(500), kv.get(get("streams", "x", 0)));
    assert!(queued.await.is_err(), "a third stream ran over a cap of 2");
    // When one long poll ends, the queued call runs.
    polls[0].abort();
    let served = tokio::time::timeout(Duration::from_secs(10), kv.get(get("streams", "x", 0)))
        .await
        .expect("the queued call never ran");
    assert_eq!(served.unwrap_err().code(), Code::NotFound);
    polls[1].abort();
}
