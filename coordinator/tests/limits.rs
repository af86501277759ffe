//! The coordinator's resource limits, on a real server: an oversized message is refused (naming
//! the limit and its flag) and changes nothing, connections beyond `max_connections` wait until
//! one closes, connections that send nothing are closed after the handshake timeout, one peer
//! cannot take more than `max_connections_per_peer` slots, and calls beyond
//! `max_streams_per_connection` on one connection wait for a free stream.
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
        max_message_bytes: 80 << 10,
        // A message must hold a compare-and-set of two largest values.
        max_value_bytes: 1000,
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
            ..Default::default()
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
        ..Default::default()
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

/// A health check on a fresh connection, bounded by `within`.
async fn health_check(channel: Channel, within: Duration) -> Result<(), String> {
    use tonic_health::pb::{HealthCheckRequest, health_client::HealthClient};
    let mut client = HealthClient::new(channel);
    let check = client.check(HealthCheckRequest::default());
    match tokio::time::timeout(within, check).await {
        Ok(Ok(_)) => Ok(()),
        Ok(Err(status)) => Err(format!("{status:?}")),
        Err(_) => Err(format!("no answer within {within:?}")),
    }
}

/// Opens `n` TCP connections to `addr` that never send a byte.
async fn idle_connections(addr: std::net::SocketAddr, n: usize) -> Vec<tokio::net::TcpStream> {
    let mut v = vec![];
    for _ in 0..n {
        v.push(tokio::net::TcpStream::connect(addr).await.unwrap());
    }
    v
}

/// Whether the server closed `stream` within `within` (a read sees the end or an error).
async fn closed_within(stream: &mut tokio::net::TcpStream, within: Duration) -> bool {
    use tokio::io::AsyncReadExt as _;
    let mut buf = [0u8; 256];
    let deadline = tokio::time::Instant::now() + within;
    loop {
        match tokio::time::timeout_at(deadline, stream.read(&mut buf)).await {
            Err(_) => return false,
            Ok(Ok(0)) | Ok(Err(_)) => return true,
            // The server's HTTP/2 settings: keep reading until it closes.
            Ok(Ok(_)) => {}
        }
    }
}

/// A channel whose connections come from `source` (another loopback address: another peer).
fn channel_from(source: std::net::IpAddr, addr: std::net::SocketAddr) -> Channel {
    #[derive(Clone)]
    struct From(std::net::IpAddr, std::net::SocketAddr);
    impl tower_service::Service<http::Uri> for From {
        type Response = hyper_util::rt::TokioIo<tokio::net::TcpStream>;
        type Error = std::io::Error;
        type Future = std::pin::Pin<
            Box<dyn std::future::Future<Output = Result<Self::Response, Self::Error>> + Send>,
        >;
        fn poll_ready(
            &mut self,
            _: &mut std::task::Context<'_>,
        ) -> std::task::Poll<Result<(), Self::Error>> {
            std::task::Poll::Ready(Ok(()))
        }
        fn call(&mut self, _: http::Uri) -> Self::Future {
            let (source, addr) = (self.0, self.1);
            Box::pin(async move {
                let socket = tokio::net::TcpSocket::new_v4()?;
                socket.bind(std::net::SocketAddr::new(source, 0))?;
                Ok(hyper_util::rt::TokioIo::new(socket.connect(addr).await?))
            })
        }
    }
    tonic::transport::Endpoint::from_shared(format!("http://{addr}"))
        .unwrap()
        .connect_with_connector_lazy(From(source, addr))
}

#[tokio::test]
async fn idle_connections_are_closed_after_the_handshake_timeout() {
    // Issue 14, finding 4: as many silent TCP connections as the cap used to lock every
    // client out for as long as they stayed open.
    let server = common::start(Config {
        max_connections: 20,
        handshake_timeout: Duration::from_millis(500),
        ..Config::default()
    })
    .await;
    let mut idle = idle_connections(server.addr, 20).await;
    // A real client gets in once the silent ones are closed: within the handshake timeout
    // plus a margin, not never.
    let started = tokio::time::Instant::now();
    health_check(raw_channel(server.addr).await, Duration::from_secs(10))
        .await
        .expect("a health check behind 20 idle connections");
    assert!(started.elapsed() < Duration::from_secs(10));
    for s in &mut idle {
        assert!(
            closed_within(s, Duration::from_secs(5)).await,
            "a silent connection outlived the handshake timeout"
        );
    }
    // A client that finished its handshakes and calls is not cut: it makes calls well past
    // the handshake timeout on the same connection.
    let channel = raw_channel(server.addr).await;
    health_check(channel.clone(), Duration::from_secs(5))
        .await
        .unwrap();
    let mut kv = KeyValueClient::new(channel.clone());
    make_job(&channel, "after").await;
    let polled = kv.get(get("after", "late", 1200)).await.unwrap_err();
    assert_eq!(polled.code(), Code::DeadlineExceeded, "{polled:?}");
    health_check(channel, Duration::from_secs(5)).await.unwrap();
}

#[tokio::test]
async fn one_peer_cannot_take_every_slot() {
    // A long handshake timeout, so that only the per-peer cap can be what lets others in.
    let server = common::start(Config {
        max_connections: 50,
        max_connections_per_peer: 3,
        handshake_timeout: Duration::from_secs(120),
        ..Config::default()
    })
    .await;
    // The helper's channel is one of 127.0.0.1's three; two more are let in, the rest are
    // closed at once.
    let mut idle = idle_connections(server.addr, 6).await;
    for s in &mut idle[2..] {
        assert!(
            closed_within(s, Duration::from_secs(5)).await,
            "a connection over the per-peer cap was kept"
        );
    }
    for s in &mut idle[..2] {
        assert!(!closed_within(s, Duration::from_millis(300)).await);
    }
    // Another peer is served at once; 127.0.0.1 is not, until one of its slots frees.
    health_check(
        channel_from("127.0.0.2".parse().unwrap(), server.addr),
        Duration::from_secs(5),
    )
    .await
    .expect("another peer was locked out");
    let refused = health_check(raw_channel(server.addr).await, Duration::from_secs(5)).await;
    assert!(
        refused.is_err(),
        "a fourth connection from one peer was served"
    );
    drop(idle);
    health_check(raw_channel(server.addr).await, Duration::from_secs(10))
        .await
        .expect("the peer's slots were not given back");
}

#[tokio::test]
async fn an_oversized_request_names_the_limit_and_its_flag() {
    let server = common::start(Config::default()).await;
    make_job(&server.channel, "huge").await;
    let limit = Config::default().max_message_bytes;
    let big = limit + (1 << 20);
    let check = |e: tonic::Status| {
        assert_eq!(e.code(), Code::OutOfRange, "{e:?}");
        let m = e.message();
        assert!(
            m.contains(&format!("the coordinator's limit is {limit} bytes"))
                && m.contains("max_message_bytes")
                && m.contains("--max-message-bytes"),
            "{m}"
        );
        assert!(!m.contains("decoded message length too large"), "{m}");
    };
    // A unary call.
    let err = KeyValueClient::new(server.channel.clone())
        .set(pb::SetRequest {
            job_id: "huge".into(),
            key: "k".into(),
            value: vec![1; big],
            ..Default::default()
        })
        .await
        .unwrap_err();
    check(err);
    // A stream's message: a session whose register is too large.
    let (tx, rx) = tokio::sync::mpsc::channel(1);
    tx.send(pb::WorkerMessage {
        kind: Some(pb::worker_message::Kind::Register(pb::Register {
            job_id: "huge".into(),
            generation: 1,
            host: "h".repeat(big),
            ..Default::default()
        })),
    })
    .await
    .unwrap();
    let attached = pb::session_client::SessionClient::new(server.channel.clone())
        .attach(tokio_stream::wrappers::ReceiverStream::new(rx))
        .await;
    let err = match attached {
        Err(e) => e,
        Ok(response) => response.into_inner().message().await.unwrap_err(),
    };
    check(err);
}
