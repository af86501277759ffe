//! The Prometheus endpoint (`metrics_addr`): a job formed and run through barriers shows in
//! the scraped series; other paths are 404.
#![allow(clippy::unwrap_used, missing_docs)]

mod common;
use common::*;
use muster_coordinator::Config;
use muster_proto::v1 as pb;
use pb::BarrierScope::Global;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

fn free_port() -> std::net::SocketAddr {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
}

/// One HTTP/1.0 request over plain TCP; returns the whole response.
async fn http_get(addr: std::net::SocketAddr, path: &str) -> String {
    let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
    s.write_all(format!("GET {path} HTTP/1.0\r\nHost: x\r\n\r\n").as_bytes())
        .await
        .unwrap();
    let mut out = String::new();
    s.read_to_string(&mut out).await.unwrap();
    out
}

/// The value of the series `series` (name and labels exactly as printed).
fn value(text: &str, series: &str) -> f64 {
    text.lines()
        .find_map(|l| l.strip_prefix(series)?.strip_prefix(' '))
        .unwrap_or_else(|| panic!("no series {series} in:\n{text}"))
        .parse()
        .unwrap()
}

#[tokio::test]
async fn scraped_metrics_show_jobs_ranks_barriers_and_rpcs() {
    let metrics = free_port();
    let s = start(Config {
        metrics_addr: Some(metrics),
        ..Config::default()
    })
    .await;
    form(&s.channel, "metered", 2, 2).await;
    let mut r = attach_all(&s.channel, "metered", 1, 4).await;
    const BARRIERS: usize = 5;
    for i in 0..BARRIERS {
        for w in r.iter_mut() {
            w.enter(Global, &format!("b{i}"), 0).await;
        }
        for w in r.iter_mut() {
            assert_eq!(w.result().await, None);
        }
    }
    let response = http_get(metrics, "/metrics").await;
    let (head, text) = response.split_once("\r\n\r\n").unwrap();
    assert!(
        head.starts_with("HTTP/1.0 200") || head.starts_with("HTTP/1.1 200"),
        "{head}"
    );
    assert!(
        head.to_ascii_lowercase()
            .contains("content-type: application/openmetrics-text")
    );
    assert!(text.ends_with("# EOF\n"), "{text}");
    assert!(
        text.contains("# HELP muster_barrier_wait_seconds "),
        "{text}"
    );
    // Process-wide counters: other tests in this binary may add to them, never take away.
    assert!(value(text, "muster_barrier_wait_seconds_count") >= BARRIERS as f64);
    assert!(value(text, "muster_rendezvous_duration_seconds_count") >= 1.0);
    assert!(
        value(
            text,
            "muster_rpc_duration_seconds_count{method=\"/muster.v1.Rendezvous/Join\"}"
        ) >= 2.0
    );
    assert!(
        value(
            text,
            "muster_rpc_duration_seconds_count{method=\"/muster.v1.Session/Attach\"}"
        ) >= 4.0,
        "{text}"
    );
    assert!(text.contains("muster_store_operation_seconds_count{op=\"get\"}"));
    assert!(text.contains("muster_generation_failures_total{cause=\"node_lost\"}"));
    assert!(text.contains("muster_restarts_total "));
    assert!(text.contains("muster_recoveries_total "), "{text}");
    assert!(
        text.contains("muster_recovery_quorum_seconds_count "),
        "{text}"
    );
    // State gauges come from this coordinator.
    assert_eq!(value(text, "muster_jobs{state=\"running\"}"), 1.0);
    assert_eq!(value(text, "muster_nodes{state=\"running\"}"), 2.0);
    assert_eq!(value(text, "muster_ranks{state=\"running\"}"), 4.0);
    assert_eq!(value(text, "muster_ranks{state=\"failed\"}"), 0.0);
    assert_eq!(value(text, "muster_agents"), 0.0);

    // A failed rank shows as a failure by cause and a failed rank.
    r.pop().unwrap().kill();
    r[0].enter(Global, "after", 0).await;
    assert!(r[0].result().await.is_some());
    let text = http_get(metrics, "/metrics").await;
    assert_eq!(value(&text, "muster_ranks{state=\"failed\"}"), 1.0);
    assert_eq!(value(&text, "muster_jobs{state=\"failed\"}"), 1.0);
    assert!(
        value(
            &text,
            "muster_generation_failures_total{cause=\"session_lost\"}"
        ) >= 1.0
    );

    let other = http_get(metrics, "/").await;
    assert!(
        other.starts_with("HTTP/1.0 404") || other.starts_with("HTTP/1.1 404"),
        "{other}"
    );
}
