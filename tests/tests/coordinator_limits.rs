//! The coordinator's bounds where they need this crate's PKI or a real etcd (issue 14): silent
//! connections cannot lock a TLS client with a token out (finding 4), and an expired job's
//! record and stored data leave etcd (finding 6).
#![allow(clippy::unwrap_used, missing_docs)]

use muster_coordinator::Config;
use muster_coordinator::config::{EtcdConfig, StoreKind, TlsConfig};
use muster_coordinator::{EtcdStore, Store};
use muster_proto::security::{ClientSecurity, Credentials};
use muster_proto::v1 as pb;
use muster_tests::etcd::Etcd;
use muster_tests::pki::Pki;
use pb::ops_client::OpsClient;
use std::sync::Arc;
use std::time::Duration;
use tokio::io::AsyncWriteExt as _;
use tonic::Code;
use tonic::transport::Channel;
use tonic_health::pb::{HealthCheckRequest, health_client::HealthClient};

#[tokio::test]
async fn silent_connections_do_not_lock_out_a_tls_client_with_a_token() {
    let dir = std::env::temp_dir().join(format!("muster-limits-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let pki = Pki::generate(&dir, &[]);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let config = Config {
        tls: TlsConfig {
            cert: Some(pki.server_cert.clone()),
            key: Some(pki.server_key.clone()),
            client_ca: None,
        },
        auth_token_file: Some(pki.token_file.clone()),
        max_connections: 20,
        handshake_timeout: Duration::from_millis(500),
        ..Config::default()
    };
    tokio::spawn(muster_coordinator::serve(
        listener,
        config,
        std::future::pending(),
    ));
    // Twenty connections that hold every slot: half send nothing, half stop in the middle of
    // a TLS handshake (a record header announcing a ClientHello that never comes).
    let mut silent = vec![];
    for i in 0..20 {
        let mut s = loop {
            match tokio::net::TcpStream::connect(addr).await {
                Ok(s) => break s,
                Err(_) => tokio::time::sleep(Duration::from_millis(10)).await,
            }
        };
        if i % 2 == 1 {
            s.write_all(&[0x16, 0x03, 0x01, 0x02, 0x00]).await.unwrap();
        }
        silent.push(s);
    }
    // A real client (TLS, the cluster token) gets in once they are closed.
    let security = ClientSecurity::plaintext()
        .with_tls(&pki.ca, None, None)
        .unwrap()
        .with_credentials(Credentials::bearer(Pki::TOKEN).unwrap());
    let started = tokio::time::Instant::now();
    let served = tokio::time::timeout(Duration::from_secs(10), async {
        let channel = security
            .endpoint(&addr.to_string())
            .unwrap()
            .connect()
            .await
            .unwrap();
        HealthClient::new(channel.clone())
            .check(HealthCheckRequest::default())
            .await
            .unwrap();
        let channel = security.wrap(channel);
        OpsClient::new(channel.clone())
            .list_jobs(pb::ListJobsRequest {})
            .await
            .unwrap();
        channel
    })
    .await;
    assert!(
        served.is_ok(),
        "no health check behind 20 silent connections within 10 s"
    );
    eprintln!("served {:?} after the slots filled", started.elapsed());
    // The client's connection, past its first call, is not cut at the handshake timeout: a
    // long poll across it ends at its own deadline, not with a broken connection.
    let channel = served.unwrap();
    pb::rendezvous_client::RendezvousClient::new(channel.clone())
        .join(pb::JoinRequest {
            job_id: "tls".into(),
            node_id: "n0".into(),
            host: "h".into(),
            local_world_size: 1,
            ..Default::default()
        })
        .await
        .unwrap();
    let polled = pb::key_value_client::KeyValueClient::new(channel)
        .get(pb::GetRequest {
            job_id: "tls".into(),
            key: "never".into(),
            wait_ms: 1200,
        })
        .await
        .unwrap_err();
    assert_eq!(polled.code(), Code::DeadlineExceeded, "{polled:?}");
    drop(silent);
    let _ = std::fs::remove_dir_all(&dir);
}

#[tokio::test]
async fn an_expired_job_leaves_no_record_or_data_in_etcd() {
    let Some(etcd) = Etcd::start(1) else { return };
    let etcd_config = EtcdConfig {
        endpoints: etcd.endpoints(),
        prefix: Some("/expiry/".into()),
        ..EtcdConfig::default()
    };
    let store = EtcdStore::connect(&etcd_config).await.unwrap();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let ttl = Duration::from_millis(500);
    let config = Config {
        store: StoreKind::Etcd,
        etcd: etcd_config.clone(),
        finished_job_ttl: ttl,
        ..Config::default()
    };
    tokio::spawn(muster_coordinator::serve_with_store(
        listener,
        config,
        Arc::new(store),
        std::future::pending(),
    ));
    let channel = Channel::from_shared(format!("http://{addr}"))
        .unwrap()
        .connect_lazy();
    // Wait for this replica to lead.
    let t = tokio::time::Instant::now();
    loop {
        let status = HealthClient::new(channel.clone())
            .check(HealthCheckRequest::default())
            .await
            .map(|r| r.into_inner().status);
        if status.ok() == Some(1) {
            break;
        }
        assert!(t.elapsed() < Duration::from_secs(15), "never led");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let answer = pb::rendezvous_client::RendezvousClient::new(channel.clone())
        .join(pb::JoinRequest {
            job_id: "old".into(),
            node_id: "n0".into(),
            host: "h".into(),
            local_world_size: 1,
            config: Some(pb::RendezvousConfig {
                min_nodes: 1,
                max_nodes: 1,
                ..Default::default()
            }),
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(answer.generation, 1);
    pb::key_value_client::KeyValueClient::new(channel.clone())
        .set(pb::SetRequest {
            job_id: "old".into(),
            key: "k".into(),
            value: b"v".to_vec(),
            ..Default::default()
        })
        .await
        .unwrap();
    // A second client of the same etcd prefix sees what the coordinator stored.
    let observer = EtcdStore::connect(&etcd_config).await.unwrap();
    assert!(observer.get("records/old").await.unwrap().is_some());
    assert!(observer.get("jobs/old/kv/k").await.unwrap().is_some());
    OpsClient::new(channel.clone())
        .cancel_job(pb::CancelJobRequest {
            job_id: "old".into(),
            reason: "done with it".into(),
        })
        .await
        .unwrap();
    // It expires: DescribeJob says so, and etcd holds nothing of it any more.
    let t = tokio::time::Instant::now();
    let status = loop {
        let described = OpsClient::new(channel.clone())
            .describe_job(pb::DescribeJobRequest {
                job_id: "old".into(),
                ..Default::default()
            })
            .await;
        if let Err(status) = described {
            break status;
        }
        assert!(t.elapsed() < Duration::from_secs(15), "never expired");
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    assert_eq!(status.code(), Code::NotFound, "{status:?}");
    assert!(
        status.message().contains("job 'old' expired at")
            && status.message().contains("it was cancelled"),
        "{status:?}"
    );
    let t = tokio::time::Instant::now();
    loop {
        let record = observer.get("records/old").await.unwrap();
        let data = observer.list("jobs/old/").await.unwrap();
        if record.is_none() && data.is_empty() {
            break;
        }
        assert!(
            t.elapsed() < Duration::from_secs(10),
            "left in etcd: record {record:?}, data {data:?}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}
