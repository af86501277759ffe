//! The effective training time from rank 0's step markers: on a session and through a node's
//! relay, in `DescribeJob` and in the scraped metrics; other ranks' markers and markers for
//! another node's rank change nothing.
#![allow(clippy::unwrap_used, missing_docs)]

mod common;
use common::*;
use muster_coordinator::Config;
use muster_proto::v1 as pb;
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// The gap between two markers as sent. The coordinator times them as they arrive, so the
/// checks ask only that each interval it measures is not empty (the interval's arithmetic has
/// its unit test in `job/training.rs`).
const GAP: Duration = Duration::from_millis(100);

fn step(step: u64) -> pb::worker_message::Kind {
    pb::worker_message::Kind::Step(pb::StepBegun { step })
}

/// The training view once `check` holds (markers carry no answer to wait for).
async fn training_when(
    ch: &tonic::transport::Channel,
    job: &str,
    check: impl Fn(&pb::TrainingTime) -> bool,
) -> pb::TrainingTime {
    for _ in 0..200 {
        if let Some(t) = describe(ch, job).await.training
            && check(&t)
        {
            return t;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    panic!("{:?}", describe(ch, job).await.training);
}

#[tokio::test]
async fn rank_0s_markers_count_the_steps_that_moved_forward() {
    let metrics = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap();
    let s = start(Config {
        metrics_addr: Some(metrics),
        ..Config::default()
    })
    .await;
    let ch = &s.channel;
    form(ch, "ettr", 1, 2).await;
    let r = attach_all(ch, "ettr", 1, 2).await;
    assert!(describe(ch, "ettr").await.training.is_none());
    // Steps 0, 1, 2; step 2 begun again (an interrupted step), then step 3. Rank 1's marker
    // of a far step is not counted.
    for s in [0, 1, 2, 2, 3] {
        r[0].send(step(s)).await;
        r[1].send(step(100 + s)).await;
        tokio::time::sleep(GAP).await;
    }
    let t = training_when(ch, "ettr", |t| t.last_step == 3).await;
    assert_eq!(t.highest_step, 3, "{t:?}");
    // 0→1, 1→2 and the second 2→3 counted; the first 2→2 lost.
    assert!(t.counted_ms > 0 && t.lost_ms > 0, "{t:?}");
    assert!(t.wall_ms >= t.counted_ms + t.lost_ms, "{t:?}");
    assert!(t.ettr > 0.0 && t.ettr < 1.0, "{t:?}");
    assert_eq!(t.recoveries_ms, 0, "{t:?}");

    // The same ratio is a metric, labelled with the job.
    let mut conn = tokio::net::TcpStream::connect(metrics).await.unwrap();
    conn.write_all(b"GET /metrics HTTP/1.0\r\nHost: x\r\n\r\n")
        .await
        .unwrap();
    let mut text = String::new();
    conn.read_to_string(&mut text).await.unwrap();
    let ratio: f64 = text
        .lines()
        .find_map(|l| l.strip_prefix("muster_job_effective_training_ratio{job=\"ettr\"} "))
        .unwrap_or_else(|| panic!("{text}"))
        .parse()
        .unwrap();
    assert!(ratio > 0.0 && ratio < 1.0, "{ratio}");
}

#[tokio::test]
async fn a_relay_passes_its_rank_0s_markers_and_not_another_nodes() {
    let s = start_default().await;
    let ch = &s.channel;
    form(ch, "relayed-ettr", 2, 2).await;
    let mut relays = [
        RawRelay::attach(ch, "relayed-ettr", 1, 0).await.unwrap(),
        RawRelay::attach(ch, "relayed-ettr", 1, 1).await.unwrap(),
    ];
    for rank in 0..4 {
        let event = relays[rank as usize / 2]
            .register_rank("relayed-ettr", 1, rank)
            .await;
        assert!(
            matches!(event.kind, Some(pb::rank_event::Kind::Message(_))),
            "{event:?}"
        );
    }
    relays[0].step(0, 7).await;
    tokio::time::sleep(GAP).await;
    relays[0].step(0, 8).await;
    let t = training_when(ch, "relayed-ettr", |t| t.last_step == 8).await;
    assert!(t.counted_ms > 0, "{t:?}");

    // Rank 0 is not node 1's: refused, and nothing counted.
    relays[1].step(0, 50).await;
    let pb::relay_event::Kind::Rank(event) = relays[1].event().await else {
        panic!("expected a rank event");
    };
    let Some(pb::rank_event::Kind::Refused(refused)) = event.kind else {
        panic!("{event:?}");
    };
    assert!(
        refused.message.contains("is on node 0, not on node 1"),
        "{}",
        refused.message
    );
    let after = describe(ch, "relayed-ettr").await.training.unwrap();
    assert_eq!((after.last_step, after.highest_step), (8, 8), "{after:?}");
}
