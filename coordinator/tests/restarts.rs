//! Generations ending and restarting: the node watch stream (lease and news), the per-job
//! restart budget, failures reported by agents and lost nodes.
#![allow(clippy::unwrap_used, missing_docs)]

mod common;

use common::*;
use muster_coordinator::Config;
use muster_proto::v1 as pb;
use pb::generation_ended::Cause;
use pb::rendezvous_client::RendezvousClient;
use std::time::{Duration, Instant};
use tonic::Code;
use tonic::transport::Channel;

fn restart_req(job: &str, node: &str, nodes: u32, max_restarts: u32) -> pb::JoinRequest {
    let mut r = join_req(job, node, 1, nodes, nodes);
    if let Some(c) = &mut r.config {
        c.max_restarts = Some(max_restarts);
    }
    r
}

/// Forms `nodes` single-worker nodes n0..; returns answers by node rank and node ids.
async fn form_budget(
    ch: &Channel,
    job: &str,
    nodes: u32,
    max_restarts: u32,
) -> Vec<(pb::JoinResponse, String)> {
    let handles: Vec<_> = (0..nodes)
        .map(|i| {
            let id = format!("n{i}");
            (
                id.clone(),
                spawn_join(ch, restart_req(job, &id, nodes, max_restarts)),
            )
        })
        .collect();
    let mut out = vec![];
    for (id, h) in handles {
        out.push((h.await.unwrap().unwrap(), id));
    }
    out.sort_by_key(|(r, _)| r.node_rank);
    out
}

async fn report(ch: &Channel, job: &str, generation: u64, rank: u32, code: i32) {
    RendezvousClient::new(ch.clone())
        .report_failure(pb::ReportFailureRequest {
            job_id: job.into(),
            generation,
            rank,
            reason: format!("exited with status {code}"),
            exit_code: Some(code),
            stderr_tail: "Traceback\nValueError: boom".into(),
            error_message: "ValueError: boom".into(),
            error_traceback: "File \"train.py\", line 3".into(),
            ..Default::default()
        })
        .await
        .unwrap();
}

#[tokio::test]
async fn failures_restart_the_job_until_the_budget_is_spent() {
    let s = start_default().await;
    let job = "budget";
    for attempt in 0..=2u32 {
        let generation = u64::from(attempt) + 1;
        let nodes = form_budget(&s.channel, job, 2, 2).await;
        assert_eq!(nodes[0].0.generation, generation);
        assert_eq!(
            nodes[0].0.restart_count, attempt,
            "TORCHELASTIC_RESTART_COUNT"
        );
        assert_eq!(nodes[0].0.max_restarts, 2);
        let mut w0 = RawWatch::attach(&s.channel, job, generation, 0, &nodes[0].1)
            .await
            .unwrap();
        let mut w1 = RawWatch::attach(&s.channel, job, generation, 1, &nodes[1].1)
            .await
            .unwrap();
        report(&s.channel, job, generation, 1, 7).await;
        for w in [&mut w0, &mut w1] {
            let e = w.ended().await;
            assert_eq!(e.cause, Cause::Failed as i32);
            assert_eq!(e.rejoin, attempt < 2, "{e:?}");
            let f = e.failure.unwrap();
            assert_eq!(
                (f.rank, f.node_rank, f.exit_code),
                (Some(1), Some(1), Some(7))
            );
            assert_eq!(f.error_message, "ValueError: boom");
            assert!(f.stderr_tail.ends_with("ValueError: boom"));
            assert_eq!(f.generation, generation);
            assert!(e.message.contains("exited with status 7"), "{}", e.message);
        }
    }
    // Budget spent: the job is over and says why.
    let refused = RendezvousClient::new(s.channel.clone())
        .join(restart_req(job, "n0", 2, 2))
        .await
        .unwrap_err();
    assert_eq!(refused.code(), Code::FailedPrecondition);
    assert!(
        refused.message().contains("no restarts left") && refused.message().contains("rank 1"),
        "{}",
        refused.message()
    );
    let d = describe(&s.channel, job).await;
    let summary = d.summary.unwrap();
    assert!(summary.done);
    assert_eq!((summary.restart_count, summary.max_restarts), (2, 2));
    assert_eq!(d.failure.unwrap().error_message, "ValueError: boom");
}

#[tokio::test]
async fn a_membership_change_supersedes_without_using_the_budget() {
    let s = start_default().await;
    let job = "elastic";
    // One node of at most two: a second node may scale the job up.
    let mut first = restart_req(job, "n0", 1, 0);
    first.config.as_mut().unwrap().max_nodes = 2;
    let first = spawn_join(&s.channel, first).await.unwrap().unwrap();
    assert_eq!(first.num_nodes, 1);
    let mut w = RawWatch::attach(&s.channel, job, 1, 0, "n0").await.unwrap();
    let mut join = restart_req(job, "n9", 1, 0);
    join.config.as_mut().unwrap().max_nodes = 2;
    let next = spawn_join(&s.channel, join);
    let e = w.ended().await;
    assert_eq!(e.cause, Cause::Superseded as i32);
    assert!(e.rejoin);
    let second = next.await.unwrap().unwrap();
    assert_eq!((second.generation, second.restart_count), (2, 0));
}

/// A node of the running generation joining again (its agent lost the generation) restarts
/// the job, and each such restart is counted: once the budget is spent the next one ends the
/// job instead of superseding it again, so agents that keep joining cannot loop for ever.
#[tokio::test]
async fn a_running_node_joining_again_is_a_restart_until_the_budget_is_spent() {
    let s = start_default().await;
    let job = "rejoins";
    let nodes = form_budget(&s.channel, job, 1, 2).await;
    assert_eq!(nodes[0].0.restart_count, 0);
    for restart in 1..=2u32 {
        let generation = u64::from(restart);
        let mut w = RawWatch::attach(&s.channel, job, generation, 0, "n0")
            .await
            .unwrap();
        let next = spawn_join(&s.channel, restart_req(job, "n0", 1, 2));
        let e = w.ended().await;
        assert_eq!(e.cause, Cause::Superseded as i32, "{e:?}");
        assert!(e.rejoin, "{e:?}");
        assert!(
            e.message.contains(&format!("(restart {restart} of 2)")),
            "{}",
            e.message
        );
        let answer = next.await.unwrap().unwrap();
        assert_eq!(
            (answer.generation, answer.restart_count),
            (generation + 1, restart)
        );
    }
    let refused = RendezvousClient::new(s.channel.clone())
        .join(restart_req(job, "n0", 1, 2))
        .await
        .unwrap_err();
    assert_eq!(refused.code(), Code::FailedPrecondition);
    assert!(
        refused.message().contains("no restarts left: 2 of 2 used"),
        "{}",
        refused.message()
    );
    let summary = describe(&s.channel, job).await.summary.unwrap();
    assert!(summary.done);
    assert_eq!((summary.generation, summary.restart_count), (3, 2));
}

#[tokio::test]
async fn a_late_watcher_hears_the_end_at_once_and_strangers_are_refused() {
    let s = start_default().await;
    let job = "late";
    let nodes = form_budget(&s.channel, job, 2, 1).await;
    let stranger = RawWatch::attach(&s.channel, job, 1, 0, "someone-else").await;
    assert_eq!(stranger.err().unwrap().code(), Code::PermissionDenied);
    let outside = RawWatch::attach(&s.channel, job, 1, 5, "n0").await;
    assert_eq!(outside.err().unwrap().code(), Code::InvalidArgument);
    let stale = RawWatch::attach(&s.channel, job, 7, 0, "n0").await;
    assert_eq!(stale.err().unwrap().code(), Code::FailedPrecondition);
    report(&s.channel, job, 1, 0, 1).await;
    let mut w = RawWatch::attach(&s.channel, job, 1, 1, &nodes[1].1)
        .await
        .unwrap();
    let e = w.ended().await;
    assert!(e.rejoin);
    assert_eq!(e.failure.unwrap().rank, Some(0));
}

#[tokio::test]
async fn a_dropped_watch_fails_the_generation_naming_the_node() {
    let s = start_default().await;
    let job = "dropped";
    let nodes = form_budget(&s.channel, job, 2, 0).await;
    let mut w0 = RawWatch::attach(&s.channel, job, 1, 0, &nodes[0].1)
        .await
        .unwrap();
    let mut w1 = RawWatch::attach(&s.channel, job, 1, 1, &nodes[1].1)
        .await
        .unwrap();
    // An agent heartbeats as soon as it reads `attached` (a stream that ends before that is
    // given the heartbeat timeout: the next test).
    w1.heartbeat_answered().await;
    let t = Instant::now();
    drop(w1);
    let e = w0.ended().await;
    assert!(t.elapsed() < Duration::from_secs(2), "{:?}", t.elapsed());
    assert!(!e.rejoin);
    let f = e.failure.unwrap();
    assert_eq!((f.node_rank, f.node_id.as_str()), (Some(1), "n1"));
    assert!(
        f.reason.contains("node 1") && f.reason.contains("disconnected"),
        "{}",
        f.reason
    );
}

/// Heartbeats on every watch of `watches` every 100 ms, for good.
async fn beat(watches: Vec<&RawWatch>) {
    loop {
        for w in &watches {
            w.heartbeat().await;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// The failure `job` records, polled until it has one or `within` passes.
async fn failure_within(ch: &Channel, job: &str, within: Duration) -> Option<pb::FailureInfo> {
    let t = Instant::now();
    while t.elapsed() < within {
        let d = describe(ch, job).await;
        if d.failure.is_some() {
            return d.failure;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    None
}

/// The fault suite's finding 7: an agent leaves an open that a busy (or frozen) leader has
/// not answered for another replica and numbers each open. A stream that ends before its
/// agent sent anything after the attach may be such a left open: the node gets its heartbeat
/// timeout to attach a newer watch instead of being lost at once, and an older open read after
/// the newer one is refused. Without a newer watch, the node is lost after the timeout.
#[tokio::test]
async fn a_watch_left_before_its_first_heartbeat_is_not_a_lost_node() {
    let hb = Duration::from_millis(1500);
    let s = start(Config {
        heartbeat_timeout: hb,
        ..Config::default()
    })
    .await;
    let ch = &s.channel;
    for (job, reattach) in [("left-open", true), ("left-for-good", false)] {
        let nodes = form_budget(ch, job, 2, 0).await;
        let w0 = RawWatch::attach(ch, job, 1, 0, &nodes[0].1).await.unwrap();
        let left = RawWatch::attach_numbered(ch, job, 1, 1, &nodes[1].1, 10)
            .await
            .unwrap();
        let t = Instant::now();
        drop(left);
        if !reattach {
            let f = tokio::select! {
                f = failure_within(ch, job, hb * 3) => f,
                () = beat(vec![&w0]) => unreachable!(),
            };
            let f = f.expect("the node whose watch was left was never lost");
            assert!(
                t.elapsed() >= hb - Duration::from_millis(100),
                "{:?}",
                t.elapsed()
            );
            assert_eq!(f.node_rank, Some(1), "{f:?}");
            assert!(
                f.reason.contains("before it answered the attach"),
                "{}",
                f.reason
            );
            continue;
        }
        tokio::time::sleep(Duration::from_millis(300)).await;
        let mut newer = RawWatch::attach_numbered(ch, job, 1, 1, &nodes[1].1, 20)
            .await
            .unwrap();
        let older = RawWatch::attach_numbered(ch, job, 1, 1, &nodes[1].1, 5).await;
        let refused = older.err().expect("an older open was taken");
        assert_eq!(refused.code(), Code::AlreadyExists, "{refused:?}");
        assert!(refused.message().contains("newer watch"), "{refused:?}");
        let f = tokio::select! {
            f = failure_within(ch, job, hb * 2) => f,
            () = beat(vec![&w0, &newer]) => unreachable!(),
        };
        assert!(f.is_none(), "the node was lost: {f:?}");
        // The newer watch is the node's lease: its end (after a heartbeat) fails at once.
        newer.heartbeat_answered().await;
        let t = Instant::now();
        drop(newer);
        let f = tokio::select! {
            f = failure_within(ch, job, hb) => f,
            () = beat(vec![&w0]) => unreachable!(),
        };
        let f = f.expect("the newer watch's end did not fail the node");
        assert!(t.elapsed() < hb, "{:?}", t.elapsed());
        assert!(f.reason.contains("disconnected"), "{}", f.reason);
    }
}

/// An agent that said it would hold a lease and stops between its join's answer and its
/// watch is lost once twice the heartbeat timeout has passed, as a silent one is; a node that
/// attached in time is not.
#[tokio::test]
async fn a_node_that_never_attaches_its_watch_is_lost_after_the_heartbeat_timeout() {
    let s = start(Config {
        heartbeat_timeout: Duration::from_millis(600),
        ..Config::default()
    })
    .await;
    let job = "unattached";
    let handles: Vec<_> = (0..2)
        .map(|i| {
            let mut req = restart_req(job, &format!("n{i}"), 2, 0);
            req.watches = true;
            spawn_join(&s.channel, req)
        })
        .collect();
    let mut nodes = vec![];
    for h in handles {
        nodes.push(h.await.unwrap().unwrap());
    }
    assert_eq!(nodes.len(), 2);
    let t = Instant::now();
    let node_id = |rank: u32| {
        // The test's node ids follow the join order, not the node ranks.
        let d = describe(&s.channel, job);
        async move {
            d.await
                .nodes
                .into_iter()
                .find(|n| n.node_rank == Some(rank))
                .unwrap()
                .node_id
        }
    };
    let w0 = RawWatch::attach(&s.channel, job, 1, 0, &node_id(0).await)
        .await
        .unwrap();
    let beat = async {
        loop {
            w0.send(pb::node_message::Kind::Heartbeat(pb::Heartbeat {}))
                .await;
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    };
    let failed = async {
        loop {
            if let Some(f) = describe(&s.channel, job).await.failure {
                break f;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    };
    let f = tokio::time::timeout(Duration::from_secs(6), async {
        tokio::select! {
            f = failed => f,
            () = beat => unreachable!(),
        }
    })
    .await
    .expect("node 1, which never attached its watch, was never declared lost");
    let waited = t.elapsed();
    assert!(
        waited >= Duration::from_millis(1_100) && waited < Duration::from_secs(4),
        "{waited:?}"
    );
    assert_eq!(f.node_rank, Some(1), "{f:?}");
    assert!(
        f.reason.contains("never attached its watch within 1.2s"),
        "{}",
        f.reason
    );
}

#[tokio::test]
async fn a_silent_node_is_declared_dead_after_the_heartbeat_timeout() {
    let s = start(Config {
        heartbeat_timeout: Duration::from_millis(600),
        ..Config::default()
    })
    .await;
    let job = "silent";
    let nodes = form_budget(&s.channel, job, 2, 0).await;
    let w0 = RawWatch::attach(&s.channel, job, 1, 0, &nodes[0].1)
        .await
        .unwrap();
    // Node 1 attaches and then says nothing; node 0 keeps heartbeating.
    let _w1 = RawWatch::attach(&s.channel, job, 1, 1, &nodes[1].1)
        .await
        .unwrap();
    let t = Instant::now();
    let beat = async {
        loop {
            w0.send(pb::node_message::Kind::Heartbeat(pb::Heartbeat {}))
                .await;
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    };
    let ended = async {
        let d = loop {
            let d = describe(&s.channel, job).await;
            if d.failure.is_some() {
                break d;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        };
        d.failure.unwrap()
    };
    let f = tokio::select! {
        f = ended => f,
        () = beat => unreachable!(),
    };
    let waited = t.elapsed();
    assert!(
        waited >= Duration::from_millis(500) && waited < Duration::from_secs(3),
        "{waited:?}"
    );
    assert_eq!(f.node_rank, Some(1), "{f:?}");
    assert!(f.reason.contains("no heartbeat"), "{}", f.reason);
}

#[tokio::test]
async fn a_finished_node_may_go_away() {
    let s = start_default().await;
    let job = "finished";
    let nodes = form_budget(&s.channel, job, 2, 0).await;
    let mut w0 = RawWatch::attach(&s.channel, job, 1, 0, &nodes[0].1)
        .await
        .unwrap();
    let mut w1 = RawWatch::attach(&s.channel, job, 1, 1, &nodes[1].1)
        .await
        .unwrap();
    w1.send(pb::node_message::Kind::Finished(pb::NodeFinished {}))
        .await;
    w1.tx.take();
    // The coordinator ends the finished node's stream, and nobody hears of a failure.
    let end = tokio::time::timeout(Duration::from_secs(5), w1.rx.message())
        .await
        .unwrap();
    assert!(matches!(end, Ok(None)), "{end:?}");
    w0.nothing_within(Duration::from_millis(300)).await;
    let d = describe(&s.channel, job).await;
    assert!(d.failure.is_none());
    let left = d
        .ranks
        .iter()
        .filter(|r| r.state == pb::RankState::Left as i32)
        .count();
    assert_eq!(left, 1);
}

/// The agent keeps its half of the stream open after `finished` (it still heartbeats) and
/// waits for the coordinator to end the stream: that end is its signal to exit. A coordinator
/// that never ends it keeps every finished agent waiting out its own timeout.
#[tokio::test]
async fn finished_is_answered_by_ending_the_stream() {
    let s = start_default().await;
    let job = "finished-ack";
    let nodes = form_budget(&s.channel, job, 2, 0).await;
    let mut w0 = RawWatch::attach(&s.channel, job, 1, 0, &nodes[0].1)
        .await
        .unwrap();
    let mut w1 = RawWatch::attach(&s.channel, job, 1, 1, &nodes[1].1)
        .await
        .unwrap();
    w1.send(pb::node_message::Kind::Finished(pb::NodeFinished {}))
        .await;
    let end = loop {
        // Before the fix the stream stayed open for good (heartbeat answers only), so this
        // waits far longer than the answer takes (about a millisecond).
        let msg = tokio::time::timeout(Duration::from_secs(5), w1.rx.message())
            .await
            .expect("the finished node's stream was not ended within 5 s");
        match msg {
            Ok(Some(pb::NodeEvent {
                kind: Some(pb::node_event::Kind::Heartbeat(_)),
            })) => continue,
            other => break other,
        }
    };
    assert!(matches!(end, Ok(None)), "{end:?}");
    assert!(w1.tx.is_some(), "the agent's half stayed open");
    w0.nothing_within(Duration::from_millis(300)).await;
    let d = describe(&s.channel, job).await;
    assert!(d.failure.is_none(), "{:?}", d.failure);
}

#[tokio::test]
async fn a_second_join_must_agree_on_the_budget() {
    let s = start_default().await;
    let first = spawn_join(&s.channel, restart_req("agree", "n0", 2, 3));
    tokio::time::sleep(Duration::from_millis(50)).await;
    let e = RendezvousClient::new(s.channel.clone())
        .join(restart_req("agree", "n1", 2, 1))
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::FailedPrecondition);
    assert!(e.message().contains("max_restarts=3"), "{}", e.message());
    first.abort();
}
