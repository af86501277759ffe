//! Rendezvous rounds against a real coordinator: min/max, last call, requested ranks,
//! heterogeneous local sizes, join timeouts, generations, and joins into a running job (a
//! stray join into a full one is refused; a node of the generation joining again restarts it).
#![allow(clippy::unwrap_used, missing_docs)]

mod common;
use common::*;
use muster_proto::v1 as pb;
use std::time::{Duration, Instant};

#[tokio::test]
async fn round_closes_at_max_with_dense_ranks_and_contiguous_offsets() {
    let s = start_default().await;
    let sizes = [2u32, 3, 1];
    let handles: Vec<_> = sizes
        .iter()
        .enumerate()
        .map(|(i, l)| spawn_join(&s.channel, join_req("het", &format!("n{i}"), *l, 3, 3)))
        .collect();
    let mut answers = vec![];
    for h in handles {
        answers.push(h.await.unwrap().unwrap());
    }
    answers.sort_by_key(|a| a.node_rank);
    assert_eq!(
        answers.iter().map(|a| a.node_rank).collect::<Vec<_>>(),
        [0, 1, 2]
    );
    let mut offset = 0;
    for a in &answers {
        assert_eq!(a.rank_offset, offset, "offset of node {}", a.node_rank);
        assert_eq!(a.world_size, 6);
        assert_eq!(a.num_nodes, 3);
        assert_eq!(a.generation, 1);
        assert_eq!(a.restart_count, 0);
        assert_eq!(a.master_host, answers[0].master_host.clone());
        offset += a.local_world_size;
    }
}

#[tokio::test]
async fn round_closes_at_min_after_last_call() {
    let s = start_default().await;
    let t = Instant::now();
    let a = spawn_join(&s.channel, join_req("elastic", "a", 1, 2, 4));
    tokio::time::sleep(Duration::from_millis(50)).await;
    let b = spawn_join(&s.channel, join_req("elastic", "b", 1, 2, 4));
    let (a, b) = (a.await.unwrap().unwrap(), b.await.unwrap().unwrap());
    let took = t.elapsed();
    assert_eq!(a.num_nodes, 2);
    assert_eq!(b.world_size, 2);
    // last_call_ms is 200 in join_req: the round waited for it, but not for the join timeout.
    assert!(
        took >= Duration::from_millis(200),
        "closed after {took:?}, before the last call"
    );
    assert!(took < Duration::from_secs(5), "closed after {took:?}");
}

#[tokio::test]
async fn one_node_below_min_waits() {
    let s = start_default().await;
    let mut a = spawn_join(&s.channel, join_req("wait", "a", 1, 2, 2));
    assert!(
        tokio::time::timeout(Duration::from_millis(400), &mut a)
            .await
            .is_err()
    );
    let d = describe(&s.channel, "wait").await;
    let summary = d.summary.unwrap();
    assert_eq!(summary.state, pb::RoundState::Open as i32);
    assert_eq!(summary.nodes_waiting, 1);
    let b = spawn_join(&s.channel, join_req("wait", "b", 1, 2, 2));
    assert_eq!(a.await.unwrap().unwrap().num_nodes, 2);
    assert_eq!(b.await.unwrap().unwrap().num_nodes, 2);
}

#[tokio::test]
async fn requested_ranks_are_honoured_and_others_fill_gaps() {
    let s = start_default().await;
    let mut r2 = join_req("req", "wants2", 1, 3, 3);
    r2.requested_node_rank = Some(2);
    let mut r0 = join_req("req", "wants0", 1, 3, 3);
    r0.requested_node_rank = Some(0);
    let h2 = spawn_join(&s.channel, r2);
    let hx = spawn_join(&s.channel, join_req("req", "any", 1, 3, 3));
    tokio::time::sleep(Duration::from_millis(50)).await;
    let h0 = spawn_join(&s.channel, r0);
    assert_eq!(h2.await.unwrap().unwrap().node_rank, 2);
    assert_eq!(h0.await.unwrap().unwrap().node_rank, 0);
    assert_eq!(hx.await.unwrap().unwrap().node_rank, 1);
}

#[tokio::test]
async fn duplicate_and_out_of_range_requested_ranks_are_rejected() {
    let s = start_default().await;
    let mut a = join_req("dup", "a", 1, 2, 2);
    a.requested_node_rank = Some(1);
    let _ha = spawn_join(&s.channel, a);
    tokio::time::sleep(Duration::from_millis(100)).await;
    let mut b = join_req("dup", "b", 1, 2, 2);
    b.requested_node_rank = Some(1);
    let e = spawn_join(&s.channel, b).await.unwrap().unwrap_err();
    assert_eq!(e.code(), tonic::Code::AlreadyExists);
    assert!(e.message().contains("node rank 1"), "{}", e.message());
    let mut c = join_req("dup", "c", 1, 2, 2);
    c.requested_node_rank = Some(2);
    let e = spawn_join(&s.channel, c).await.unwrap().unwrap_err();
    assert_eq!(e.code(), tonic::Code::InvalidArgument);
    assert!(e.message().contains("out of range"), "{}", e.message());
    // The same node id twice.
    let e = spawn_join(&s.channel, join_req("dup", "a", 1, 2, 2))
        .await
        .unwrap()
        .unwrap_err();
    assert_eq!(e.code(), tonic::Code::AlreadyExists);
    // Neither rejected join changed the round.
    assert_eq!(
        describe(&s.channel, "dup")
            .await
            .summary
            .unwrap()
            .nodes_waiting,
        1
    );
}

#[tokio::test]
async fn join_timeout_names_how_many_came() {
    let s = start_default().await;
    let mut r = join_req("late", "only", 1, 3, 3);
    r.config.as_mut().unwrap().join_timeout_ms = 300;
    let t = Instant::now();
    let e = spawn_join(&s.channel, r).await.unwrap().unwrap_err();
    assert_eq!(e.code(), tonic::Code::DeadlineExceeded);
    assert!(
        e.message().contains("1 of at least 3 nodes"),
        "{}",
        e.message()
    );
    assert!(t.elapsed() < Duration::from_secs(5));
}

#[tokio::test]
async fn joiner_that_goes_away_is_removed() {
    let s = start_default().await;
    let h = spawn_join(&s.channel, join_req("gone", "a", 1, 2, 2));
    tokio::time::sleep(Duration::from_millis(100)).await;
    h.abort();
    let mut left = 1;
    for _ in 0..50 {
        left = describe(&s.channel, "gone")
            .await
            .summary
            .unwrap()
            .nodes_waiting;
        if left == 0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(left, 0, "the abandoned joiner is still in the round");
}

/// Forms `job` of `nodes` nodes n0.. of `local` ranks with a restart budget.
async fn form_budget(
    ch: &tonic::transport::Channel,
    job: &str,
    nodes: u32,
    local: u32,
    max_restarts: u32,
) -> Vec<pb::JoinResponse> {
    let handles: Vec<_> = (0..nodes)
        .map(|i| {
            let mut r = join_req(job, &format!("n{i}"), local, nodes, nodes);
            r.config.as_mut().unwrap().max_restarts = Some(max_restarts);
            spawn_join(ch, r)
        })
        .collect();
    let mut out = vec![];
    for h in handles {
        out.push(h.await.unwrap().unwrap());
    }
    out.sort_by_key(|r| r.node_rank);
    out
}

#[tokio::test]
async fn joining_a_running_job_opens_the_next_generation_and_fences_the_old() {
    let s = start_default().await;
    let first = form_budget(&s.channel, "gens", 1, 2, 1).await;
    assert_eq!(first[0].generation, 1);
    let mut ranks = attach_all(&s.channel, "gens", 1, 2).await;
    ranks[0].enter(pb::BarrierScope::Global, "x", 0).await;
    let second = form(&s.channel, "gens", 1, 2).await;
    assert_eq!(second[0].generation, 2);
    // The generation's own node joined again (its agent lost the generation): a restart.
    assert_eq!(second[0].restart_count, 1);
    // The old generation's waiter learns it was superseded.
    let e = ranks[0].result().await.unwrap();
    assert_eq!(e.kind, pb::barrier_error::Kind::StaleGeneration as i32);
    assert!(
        e.message.contains("superseded by generation 2"),
        "{}",
        e.message
    );
    // Old-generation calls are fenced with FAILED_PRECONDITION naming the current one.
    let e = Raw::attach(&s.channel, "gens", 1, 1).await.err().unwrap();
    assert_eq!(e.code(), tonic::Code::FailedPrecondition);
    assert!(e.message().contains("generation 2"), "{}", e.message());
    let e = pb::unique_ids_client::UniqueIdsClient::new(s.channel.clone())
        .publish(pb::PublishUniqueIdRequest {
            job_id: "gens".into(),
            generation: 1,
            rank: 0,
            communicator: "world".into(),
            unique_id: vec![1; 128],
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert_eq!(e.code(), tonic::Code::FailedPrecondition);
    assert!(
        e.message().contains("stale") && e.message().contains("generation 2"),
        "{}",
        e.message()
    );
    // The new generation works.
    let mut ranks = attach_all(&s.channel, "gens", 2, 2).await;
    for r in &mut ranks {
        r.enter(pb::BarrierScope::Global, "y", 0).await;
    }
    for r in &mut ranks {
        assert!(r.result().await.is_none());
    }
}

/// A join into a running generation that has its most nodes (here from 50 strangers, as a
/// second agent started with the same job id would send) is refused naming the job, its
/// node count and that it runs, and leaves the generation alone: no agent hears of it, the
/// barriers go on, the generation and restart count stay. Before, each such join superseded
/// the running generation (the workers were stopped and started again, without end).
#[tokio::test]
async fn a_stray_join_into_a_full_running_job_is_refused_and_disturbs_nothing() {
    let s = start_default().await;
    let job = "full";
    form_budget(&s.channel, job, 2, 1, 3).await;
    let mut watches = vec![];
    for n in 0..2 {
        watches.push(
            RawWatch::attach(&s.channel, job, 1, n, &format!("n{n}"))
                .await
                .unwrap(),
        );
    }
    let mut ranks = attach_all(&s.channel, job, 1, 2).await;
    for i in 0..50 {
        let e = spawn_join(&s.channel, join_req(job, &format!("stray-{i}"), 2, 2, 2))
            .await
            .unwrap()
            .unwrap_err();
        assert_eq!(e.code(), tonic::Code::FailedPrecondition, "{e:?}");
        for part in [
            "job 'full' is running",
            "generation 1",
            "2 of at most 2 nodes",
            &format!("node 'stray-{i}'"),
        ] {
            assert!(e.message().contains(part), "{part}: {}", e.message());
        }
    }
    for w in &mut watches {
        w.nothing_within(Duration::from_millis(300)).await;
    }
    for r in &mut ranks {
        r.enter(pb::BarrierScope::Global, "after-the-strays", 0)
            .await;
    }
    for r in &mut ranks {
        assert!(r.result().await.is_none());
    }
    let d = describe(&s.channel, job).await;
    let summary = d.summary.unwrap();
    assert_eq!(
        (
            summary.state,
            summary.generation,
            summary.restart_count,
            summary.num_nodes
        ),
        (pb::RoundState::Running as i32, 1, 0, 2)
    );
}

/// A node of the running generation joining again with no restart left ends the job (a
/// restart it may not have), naming the node; the other agents hear it at once.
#[tokio::test]
async fn a_node_joining_again_without_budget_ends_the_job_naming_it() {
    let s = start_default().await;
    let job = "no-budget";
    form_budget(&s.channel, job, 2, 1, 0).await;
    let mut w0 = RawWatch::attach(&s.channel, job, 1, 0, "n0").await.unwrap();
    let e = spawn_join(&s.channel, join_req(job, "n1", 1, 2, 2))
        .await
        .unwrap()
        .unwrap_err();
    assert_eq!(e.code(), tonic::Code::FailedPrecondition, "{e:?}");
    assert!(
        e.message().contains("job 'no-budget' is over")
            && e.message().contains("agent n1")
            && e.message().contains("joined the job again"),
        "{}",
        e.message()
    );
    let ended = w0.ended().await;
    assert_eq!(ended.cause, pb::generation_ended::Cause::Failed as i32);
    assert!(!ended.rejoin, "{ended:?}");
    let summary = describe(&s.channel, job).await.summary.unwrap();
    assert!(summary.done);
    assert_eq!(summary.state, pb::RoundState::Failed as i32);
}
