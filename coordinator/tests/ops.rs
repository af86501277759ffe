//! The operator's API: draining a node (the job goes on without it, within MIN:MAX, and no
//! restart is counted) and `DescribeJob` saying what every missing rank is doing.
#![allow(clippy::unwrap_used, missing_docs)]

mod common;

use common::*;
use muster_proto::v1 as pb;
use pb::drain_node_request::Node;
use pb::generation_ended::Cause;
use pb::ops_client::OpsClient;
use pb::rendezvous_client::RendezvousClient;
use std::time::Duration;
use tonic::transport::Channel;
use tonic::{Code, Status};

async fn drain(ch: &Channel, job: &str, node: Node) -> Result<pb::DrainNodeResponse, Status> {
    OpsClient::new(ch.clone())
        .drain_node(pb::DrainNodeRequest {
            job_id: job.into(),
            node: Some(node),
            reason: "hardware maintenance".into(),
        })
        .await
        .map(|r| r.into_inner())
}

/// Joins nodes `ids` (one worker each) to `job` with nodes 2:3; answers by node rank.
async fn join_all(ch: &Channel, job: &str, ids: &[&str]) -> Vec<pb::JoinResponse> {
    let handles: Vec<_> = ids
        .iter()
        .map(|id| spawn_join(ch, join_req(job, id, 1, 2, 3)))
        .collect();
    let mut out = vec![];
    for h in handles {
        out.push(h.await.unwrap().unwrap());
    }
    out.sort_by_key(|r| r.node_rank);
    out
}

#[tokio::test]
async fn a_drained_node_stops_and_the_job_continues_on_the_others_without_a_restart() {
    let s = start_default().await;
    let job = "drain3";
    let ids = ["n0", "n1", "n2"];
    let answers = join_all(&s.channel, job, &ids).await;
    assert_eq!(answers[0].num_nodes, 3);
    let d = describe(&s.channel, job).await;
    let ids_by_rank: Vec<String> = d.nodes.iter().map(|n| n.node_id.clone()).collect();
    let mut watches = vec![];
    for (r, id) in ids_by_rank.iter().enumerate() {
        watches.push(
            RawWatch::attach(&s.channel, job, 1, r as u32, id)
                .await
                .unwrap(),
        );
    }
    let mut ranks = attach_all(&s.channel, job, 1, 3).await;
    // Rank 0 waits at a barrier when the drain comes: it is told the generation is stale.
    ranks[0].enter(pb::BarrierScope::Global, "step", 0).await;
    tokio::time::sleep(Duration::from_millis(50)).await;

    let drained = ids_by_rank[1].clone();
    let resp = drain(&s.channel, job, Node::NodeRank(1)).await.unwrap();
    assert_eq!(resp.node_id, drained);
    assert_eq!((resp.generation, resp.remaining_nodes), (1, 2));

    let e = watches[1].ended().await;
    assert_eq!(e.cause, Cause::Drained as i32, "{e:?}");
    assert!(!e.rejoin, "{e:?}");
    assert!(
        e.message.contains("drained") && e.message.contains("hardware maintenance"),
        "{e:?}"
    );
    for w in [0, 2] {
        let e = watches[w].ended().await;
        assert_eq!(e.cause, Cause::Superseded as i32, "{e:?}");
        assert!(e.rejoin, "{e:?}");
        assert_eq!(e.restart_count, 0);
        assert!(e.message.contains(&drained), "{e:?}");
    }
    let err = ranks[0].result().await.expect("the barrier must fail");
    assert!(err.message.contains("superseded"), "{err:?}");

    // The others form generation 2 with two nodes; the drained node may not join again.
    let refused = RendezvousClient::new(s.channel.clone())
        .join(join_req(job, &drained, 1, 2, 3))
        .await
        .unwrap_err();
    assert_eq!(refused.code(), Code::FailedPrecondition, "{refused:?}");
    assert!(refused.message().contains("was drained"), "{refused:?}");
    assert!(refused.metadata().contains_key("muster-drained"));
    let others: Vec<&str> = ids_by_rank
        .iter()
        .filter(|id| **id != drained)
        .map(String::as_str)
        .collect();
    let answers = join_all(&s.channel, job, &others).await;
    assert_eq!(answers[0].generation, 2);
    assert_eq!(answers[0].num_nodes, 2);
    assert_eq!(answers[0].restart_count, 0, "a drain is not a restart");
    let d = describe(&s.channel, job).await;
    assert_eq!(d.restart_count, 0);
    assert_eq!(d.summary.as_ref().unwrap().generation, 2);
    assert_eq!(
        d.drained.get(&drained).map(String::as_str),
        Some("hardware maintenance")
    );
    assert!(d.nodes.iter().all(|n| n.node_id != drained));

    // Two nodes left and min_nodes 2: draining another is refused, naming the numbers.
    let err = drain(&s.channel, job, Node::NodeId(others[0].into()))
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::FailedPrecondition, "{err:?}");
    assert!(
        err.message().contains("with 1 of its 2 nodes") && err.message().contains("min_nodes 2"),
        "{err:?}"
    );
    // And draining the drained node again says so.
    let err = drain(&s.channel, job, Node::NodeId(drained.clone()))
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::FailedPrecondition, "{err:?}");
    assert!(err.message().contains("already drained"), "{err:?}");
}

#[tokio::test]
async fn a_node_drained_while_its_round_is_open_is_refused_its_join() {
    let s = start_default().await;
    let job = "drain-open";
    let mut c = join_req(job, "a", 1, 2, 4);
    if let Some(cfg) = &mut c.config {
        cfg.last_call_ms = 60_000;
    }
    let a = spawn_join(&s.channel, c.clone());
    let mut c2 = c.clone();
    c2.node_id = "b".into();
    let b = spawn_join(&s.channel, c2.clone());
    let mut c3 = c.clone();
    c3.node_id = "c".into();
    let cj = spawn_join(&s.channel, c3);
    for _ in 0..200 {
        let d = OpsClient::new(s.channel.clone())
            .describe_job(pb::DescribeJobRequest {
                job_id: job.into(),
                ..Default::default()
            })
            .await;
        if d.is_ok_and(|d| d.into_inner().nodes.len() == 3) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let err = drain(&s.channel, job, Node::NodeRank(0)).await.unwrap_err();
    assert_eq!(err.code(), Code::InvalidArgument, "{err:?}");
    let resp = drain(&s.channel, job, Node::NodeId("b".into()))
        .await
        .unwrap();
    assert_eq!(resp.remaining_nodes, 2);
    let refused = b.await.unwrap().unwrap_err();
    assert_eq!(refused.code(), Code::FailedPrecondition);
    assert!(
        refused.metadata().contains_key("muster-drained"),
        "{refused:?}"
    );
    // Two joiners and min 2: draining one more would leave one.
    let err = drain(&s.channel, job, Node::NodeId("a".into()))
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::FailedPrecondition, "{err:?}");
    OpsClient::new(s.channel.clone())
        .cancel_job(pb::CancelJobRequest {
            job_id: job.into(),
            reason: "test over".into(),
        })
        .await
        .unwrap();
    assert!(a.await.unwrap().is_err());
    assert!(cj.await.unwrap().is_err());
}

#[tokio::test]
async fn drain_validates_its_request() {
    let s = start_default().await;
    form(&s.channel, "v", 2, 1).await;
    let err = drain(&s.channel, "nope", Node::NodeRank(0))
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::NotFound, "{err:?}");
    let err = drain(&s.channel, "bad id!", Node::NodeRank(0))
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::InvalidArgument, "{err:?}");
    let err = drain(&s.channel, "v", Node::NodeRank(7)).await.unwrap_err();
    assert_eq!(err.code(), Code::InvalidArgument, "{err:?}");
    assert!(err.message().contains("node rank 7"), "{err:?}");
    let err = drain(&s.channel, "v", Node::NodeId("ghost".into()))
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::InvalidArgument, "{err:?}");
    assert!(err.message().contains("'ghost'"), "{err:?}");
    let err = drain(&s.channel, "v", Node::NodeId("a:b".into()))
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::InvalidArgument, "{err:?}");
    let err = OpsClient::new(s.channel.clone())
        .drain_node(pb::DrainNodeRequest {
            job_id: "v".into(),
            node: None,
            reason: String::new(),
        })
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::InvalidArgument, "{err:?}");
    // 2 nodes, min 2 (form uses nodes:nodes): refused, nothing changed.
    let err = drain(&s.channel, "v", Node::NodeRank(1)).await.unwrap_err();
    assert_eq!(err.code(), Code::FailedPrecondition, "{err:?}");
    let d = describe(&s.channel, "v").await;
    assert_eq!(d.summary.unwrap().generation, 1);
    assert!(d.drained.is_empty());
}

#[tokio::test]
async fn describe_says_what_each_missing_rank_is_doing() {
    let s = start_default().await;
    let job = "who";
    form(&s.channel, job, 1, 3).await;
    let d = describe(&s.channel, job).await;
    assert_eq!(d.nodes[0].state, pb::NodeState::Starting as i32);
    assert_eq!(d.nodes[0].last_seen_ms_ago, None);
    let w = RawWatch::attach(&s.channel, job, 1, 0, &d.nodes[0].node_id)
        .await
        .unwrap();
    w.heartbeat().await;
    let mut ranks = attach_all(&s.channel, job, 1, 3).await;
    // Everyone passes "init"; then ranks 0 and 1 wait at "step" while rank 2 is at a node
    // barrier "ckpt".
    for r in &mut ranks {
        r.enter(pb::BarrierScope::Global, "init", 0).await;
    }
    for r in &mut ranks {
        assert!(r.result().await.is_none());
    }
    ranks[0].enter(pb::BarrierScope::Global, "step", 0).await;
    ranks[1].enter(pb::BarrierScope::Global, "step", 0).await;
    ranks[2].enter(pb::BarrierScope::Node, "ckpt", 0).await;
    let mut d = describe(&s.channel, job).await;
    for _ in 0..100 {
        if d.barriers.len() == 2
            && d.barriers
                .iter()
                .any(|b| b.names.iter().any(|n| n.ranks.len() == 2))
        {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
        d = describe(&s.channel, job).await;
    }
    assert_eq!(d.nodes[0].state, pb::NodeState::Running as i32);
    assert!(d.nodes[0].last_seen_ms_ago.is_some());
    let step = d
        .barriers
        .iter()
        .find(|b| b.scope == pb::BarrierScope::Global as i32)
        .unwrap();
    assert_eq!(step.missing_detail.len(), 1);
    let m = &step.missing_detail[0];
    assert_eq!(m.rank, Some(2));
    assert_eq!(m.state, pb::RankState::Waiting as i32);
    assert_eq!((m.last_seq, m.last_barrier.as_str()), (1, "init"));
    assert!(
        m.activity
            .starts_with("waiting at node 0 barrier #1 'ckpt'"),
        "{m:?}"
    );
    let ckpt = d
        .barriers
        .iter()
        .find(|b| b.scope == pb::BarrierScope::Node as i32)
        .unwrap();
    assert_eq!(ckpt.missing_detail.len(), 2);
    assert!(
        ckpt.missing_detail.iter().all(|m| m
            .activity
            .starts_with("waiting at global barrier #2 'step'")),
        "{:?}",
        ckpt.missing_detail
    );
    let r2 = &d.ranks[2];
    assert_eq!((r2.local_rank, r2.restart_count), (Some(2), 0));
    assert_eq!(r2.last_barrier, "ckpt");
    assert_eq!(r2.pid, 1002);
    // A rank that goes away shows as failed, with why.
    ranks.pop().unwrap().kill();
    let mut d = describe(&s.channel, job).await;
    for _ in 0..200 {
        if d.ranks[2].state == pb::RankState::Failed as i32 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
        d = describe(&s.channel, job).await;
    }
    assert!(
        d.ranks[2].activity.starts_with("failed"),
        "{:?}",
        d.ranks[2]
    );
    assert_eq!(d.nodes[0].state, pb::NodeState::Failed as i32);
}

async fn describe_unless(
    ch: &Channel,
    job: &str,
    unless: pb::JobSummary,
    wait_ms: u64,
) -> pb::DescribeJobResponse {
    OpsClient::new(ch.clone())
        .describe_job(pb::DescribeJobRequest {
            job_id: job.into(),
            wait_ms,
            unless: Some(unless),
        })
        .await
        .unwrap()
        .into_inner()
}

/// `DescribeJob` as a long poll (`submit --wait` follows a job with it): the answer comes
/// when the summary changes, not on a timer; with no change it comes at `wait_ms` with the
/// current view; a summary that already differs is answered at once.
#[tokio::test]
async fn describe_waits_for_a_change_of_the_summary() {
    let s = start_default().await;
    let job = "long-poll";
    let joined = join_all(&s.channel, job, &["n0", "n1"]).await;
    let seen = describe(&s.channel, job).await.summary.unwrap();
    assert_eq!(seen.state, pb::RoundState::Running as i32);

    // No change: answered at the deadline, with the same summary.
    let t = std::time::Instant::now();
    let d = describe_unless(&s.channel, job, seen.clone(), 300).await;
    assert!(
        t.elapsed() >= Duration::from_millis(250),
        "{:?}",
        t.elapsed()
    );
    assert_eq!(d.summary.unwrap(), seen);

    // A change (the job is cancelled) wakes the poll long before its 20 s deadline.
    let poll = tokio::spawn({
        let (ch, seen) = (s.channel.clone(), seen.clone());
        async move { describe_unless(&ch, job, seen, 20_000).await }
    });
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert!(!poll.is_finished(), "answered before the job changed");
    let t = std::time::Instant::now();
    OpsClient::new(s.channel.clone())
        .cancel_job(pb::CancelJobRequest {
            job_id: job.into(),
            reason: "long poll test".into(),
        })
        .await
        .unwrap();
    let d = tokio::time::timeout(Duration::from_secs(5), poll)
        .await
        .expect("the long poll did not see the cancel")
        .unwrap();
    assert!(t.elapsed() < Duration::from_secs(5));
    let now = d.summary.unwrap();
    assert_ne!(now, seen);
    assert!(now.done, "{now:?}");

    // A stale summary is answered at once.
    let t = std::time::Instant::now();
    describe_unless(&s.channel, job, seen, 20_000).await;
    assert!(t.elapsed() < Duration::from_secs(5), "{:?}", t.elapsed());
    drop(joined);
}
