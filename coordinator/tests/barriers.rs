//! Barriers against a real coordinator: scale, node scope, failure propagation, divergence,
//! timeouts, departed ranks, heartbeats, sequence checks.
#![allow(clippy::unwrap_used, missing_docs)]

mod common;
use common::*;
use muster_coordinator::Config;
use muster_proto::v1 as pb;
use pb::BarrierScope::{Global, Node};
use pb::barrier_error::Kind;
use std::time::{Duration, Instant};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sixty_four_ranks_pass_a_hundred_barriers() {
    let s = start_default().await;
    form(&s.channel, "big", 4, 16).await;
    let ranks = attach_all(&s.channel, "big", 1, 64).await;
    let tasks: Vec<_> = ranks
        .into_iter()
        .map(|mut r| {
            tokio::spawn(async move {
                for i in 0..100 {
                    assert_eq!(
                        r.barrier(&format!("loop.rs:{i}")).await,
                        None,
                        "rank {} barrier {i}",
                        r.rank
                    );
                }
                r.leave().await;
            })
        })
        .collect();
    for t in tasks {
        t.await.unwrap();
    }
    let d = describe(&s.channel, "big").await;
    assert_eq!(d.summary.unwrap().state, pb::RoundState::Finished as i32);
}

#[tokio::test]
async fn node_barriers_only_wait_for_their_node() {
    let s = start_default().await;
    form(&s.channel, "nodes", 2, 2).await;
    let mut r = attach_all(&s.channel, "nodes", 1, 4).await;
    // Node 0 (ranks 0, 1) passes its node barrier while node 1 never enters.
    r[0].enter(Node, "n", 0).await;
    r[1].enter(Node, "n", 0).await;
    assert_eq!(r[0].result().await, None);
    assert_eq!(r[1].result().await, None);
    // A global barrier needs everyone.
    for x in r.iter_mut().take(3) {
        x.enter(Global, "g", 0).await;
    }
    r[0].no_result_within(Duration::from_millis(200)).await;
    r[3].enter(Global, "g", 0).await;
    for x in &mut r {
        assert_eq!(x.result().await, None);
    }
}

#[tokio::test]
async fn a_dead_rank_fails_every_waiting_barrier_within_two_seconds_naming_it() {
    let s = start_default().await;
    form(&s.channel, "dead", 2, 2).await;
    let mut r = attach_all(&s.channel, "dead", 1, 4).await;
    for x in r.iter_mut().take(3) {
        x.enter(Global, "step", 0).await;
    }
    let victim = r.pop().unwrap();
    let t = Instant::now();
    victim.kill();
    for x in &mut r {
        let e = x.result().await.unwrap();
        assert_eq!(e.kind, Kind::RankFailed as i32);
        assert_eq!(e.rank, 3);
        assert_eq!(e.node_rank, 1);
        assert!(e.message.contains("rank 3 (node 1"), "{}", e.message);
        assert!(e.message.contains("without leave"), "{}", e.message);
    }
    assert!(
        t.elapsed() < Duration::from_secs(2),
        "took {:?}",
        t.elapsed()
    );
    // Later barriers of the generation fail at once too.
    let e = r[0].barrier("next").await.unwrap();
    assert_eq!(e.kind, Kind::RankFailed as i32);
    // Every live session was also told of the failure directly (what collectives outside a
    // barrier wait on).
    for x in &mut r {
        let pushed = x.pushed_failure().await;
        assert_eq!((pushed.kind, pushed.rank), (Kind::RankFailed as i32, 3));
    }
    let d = describe(&s.channel, "dead").await;
    assert_eq!(d.summary.unwrap().state, pb::RoundState::Failed as i32);
    assert_eq!(d.failure.unwrap().rank, Some(3));
}

#[tokio::test]
async fn agent_report_gives_the_precise_reason() {
    let s = start_default().await;
    form(&s.channel, "report", 1, 2).await;
    let mut r = attach_all(&s.channel, "report", 1, 2).await;
    r[0].enter(Global, "b", 0).await;
    pb::rendezvous_client::RendezvousClient::new(s.channel.clone())
        .report_failure(pb::ReportFailureRequest {
            job_id: "report".into(),
            generation: 1,
            rank: 1,
            reason: "exited with status 3".into(),
            exit_code: Some(3),
            signal: None,
            stderr_tail: "Traceback: boom\n".into(),
            ..Default::default()
        })
        .await
        .unwrap();
    let e = r[0].result().await.unwrap();
    assert!(
        e.message.contains("exited with status 3") && e.message.contains("boom"),
        "{}",
        e.message
    );
}

#[tokio::test]
async fn divergent_names_error_every_rank_listing_who_is_where() {
    let s = start_default().await;
    form(&s.channel, "div", 1, 3).await;
    let mut r = attach_all(&s.channel, "div", 1, 3).await;
    r[0].enter(Global, "train.rs:10", 0).await;
    r[1].enter(Global, "train.rs:10", 0).await;
    r[2].enter(Global, "eval.rs:99", 0).await;
    for x in &mut r {
        let e = x.result().await.unwrap();
        assert_eq!(e.kind, Kind::Diverged as i32);
        assert!(
            e.message.contains("[train.rs:10: ranks 0,1]"),
            "{}",
            e.message
        );
        assert!(e.message.contains("[eval.rs:99: ranks 2]"), "{}", e.message);
    }
}

#[tokio::test]
async fn timeout_lists_missing_ranks_and_hosts_and_allows_retry() {
    let s = start_default().await;
    form(&s.channel, "slow", 2, 2).await;
    let mut r = attach_all(&s.channel, "slow", 1, 4).await;
    r[0].enter(Global, "b", 300).await;
    r[1].enter(Global, "b", 0).await;
    let e = r[0].result().await.unwrap();
    assert_eq!(e.kind, Kind::Timeout as i32);
    let missing: Vec<u32> = e.missing.iter().map(pb::RankLocation::rank).collect();
    assert_eq!(missing, [2, 3]);
    assert!(
        e.message.contains("2 (node 1, host host-n1)"),
        "{}",
        e.message
    );
    // Retry the same barrier: everyone arrives, all released.
    r[0].enter_seq(Global, 1, "b", 0).await;
    r[2].enter(Global, "b", 0).await;
    r[3].enter(Global, "b", 0).await;
    for x in &mut r {
        assert_eq!(x.result().await, None, "rank {}", x.rank);
    }
}

#[tokio::test]
async fn a_rank_that_left_fails_barriers_it_can_never_reach() {
    let s = start_default().await;
    form(&s.channel, "left", 1, 2).await;
    let mut r = attach_all(&s.channel, "left", 1, 2).await;
    r[0].enter(Global, "b", 0).await;
    let done = r.pop().unwrap();
    done.leave().await;
    let e = r[0].result().await.unwrap();
    assert_eq!(e.kind, Kind::RankLeft as i32);
    assert!(e.message.contains("rank 1"), "{}", e.message);
}

#[tokio::test]
async fn a_silent_rank_is_failed_after_the_heartbeat_timeout() {
    let config = Config {
        heartbeat_timeout: Duration::from_millis(500),
        ..Config::default()
    };
    let s = start(config).await;
    form(&s.channel, "hb", 1, 2).await;
    let mut r = attach_all(&s.channel, "hb", 1, 2).await;
    assert_eq!(r[0].registered.heartbeat_interval_ms, 166);
    let t = Instant::now();
    r[0].enter(Global, "b", 0).await;
    // Rank 0 keeps sending heartbeats; rank 1 says nothing.
    let e = loop {
        tokio::select! {
            e = r[0].result() => break e.unwrap(),
            _ = tokio::time::sleep(Duration::from_millis(100)) => {
                r[0].send(pb::worker_message::Kind::Heartbeat(pb::Heartbeat {})).await;
            }
        }
    };
    assert_eq!(e.rank, 1);
    assert!(e.message.contains("no heartbeat"), "{}", e.message);
    assert!(
        t.elapsed() < Duration::from_secs(3),
        "took {:?}",
        t.elapsed()
    );
}

#[tokio::test]
async fn out_of_order_sequence_numbers_are_rejected_without_effect() {
    let s = start_default().await;
    form(&s.channel, "seq", 1, 2).await;
    let mut r = attach_all(&s.channel, "seq", 1, 2).await;
    r[0].enter_seq(Global, 5, "b", 0).await;
    let e = r[0].result().await.unwrap();
    assert!(
        e.message.contains("#5") && e.message.contains("last was #0"),
        "{}",
        e.message
    );
    let e = {
        r[1].enter_seq(Global, 1, "b", 0).await;
        r[1].enter_seq(Global, 1, "b", 0).await;
        r[1].result().await.unwrap()
    };
    assert!(e.message.contains("still waiting"), "{}", e.message);
    // Rank 0's bad call changed nothing: its barrier #1 still completes normally.
    r[0].enter_seq(Global, 1, "b", 0).await;
    assert_eq!(r[0].result().await, None);
    assert_eq!(r[1].result().await, None);
}

#[tokio::test]
async fn ops_view_shows_who_waits_where_and_who_is_missing() {
    let s = start_default().await;
    form(&s.channel, "ops", 2, 1).await;
    let mut r = attach_all(&s.channel, "ops", 1, 2).await;
    r[0].enter(Global, "ckpt.rs:7", 0).await;
    tokio::time::sleep(Duration::from_millis(50)).await;
    let d = describe(&s.channel, "ops").await;
    assert_eq!(d.nodes.len(), 2);
    assert_eq!(d.ranks[0].state, pb::RankState::Waiting as i32);
    assert_eq!(d.ranks[1].state, pb::RankState::Running as i32);
    let b = &d.barriers[0];
    assert_eq!(b.names[0].name, "ckpt.rs:7");
    assert_eq!(b.names[0].ranks, [0]);
    assert_eq!(b.missing[0].rank, Some(1));
    assert_eq!(b.missing[0].host, "host-n1");
    let jobs = pb::ops_client::OpsClient::new(s.channel.clone())
        .list_jobs(pb::ListJobsRequest {})
        .await
        .unwrap()
        .into_inner();
    assert_eq!(jobs.jobs[0].job_id, "ops");
    assert_eq!(jobs.jobs[0].world_size, 2);
}
