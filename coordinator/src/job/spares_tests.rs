//! Unit tests of spare agents: standing by, taking a lost node's place in place, the
//! fallback to a restart, the replaced agent refused, and spares kept across a failover.

#![allow(clippy::unwrap_used)]

use super::tests::{ask, code_and_message, config, ctx, req};
use super::*;

/// An in-place job of 2 single-rank nodes n0 and n1 that admits `max_spares` spares, its
/// round closed and both ranks registered (their inboxes returned).
async fn two_nodes(max_spares: u32) -> (Arc<Job>, Vec<UnboundedInbox>) {
    let config = RoundConfig {
        recovery: Recovery::InPlace,
        max_spares,
        ..config(2, 3)
    };
    let job = Job::new(JobId::parse("j").unwrap(), config, &ctx());
    let (a, b) = (
        job.join(req("n0")).unwrap().2,
        job.join(req("n1")).unwrap().2,
    );
    a.await.unwrap().unwrap();
    b.await.unwrap().unwrap();
    let mut inboxes = vec![];
    for r in 0..2 {
        let (tx, rx) = mpsc::unbounded_channel();
        job.register(1, r, 100 + r, String::new(), tx, None, None)
            .unwrap();
        inboxes.push(rx);
    }
    (job, inboxes)
}

type UnboundedInbox = mpsc::UnboundedReceiver<Result<pb::CoordinatorMessage, Status>>;

fn spare(node_id: &str) -> JoinReq {
    JoinReq {
        spare: true,
        request_id: format!("req-{node_id}"),
        watches: true,
        ..req(node_id)
    }
}

fn attach(job: &Job, node: u32, node_id: &str) -> Result<(u64, WatchInbox), Error> {
    let (tx, rx) = mpsc::unbounded_channel();
    job.watch(1, node, node_id, 0, tx, pb::NodeAttached::default())
        .map(|id| (id, rx))
}

type WatchInbox = mpsc::UnboundedReceiver<Result<pb::NodeEvent, Status>>;

#[tokio::test]
async fn a_spare_stands_by_then_takes_a_lost_nodes_ranks_in_place() {
    let (job, mut inboxes) = two_nodes(1).await;
    let (old_watch, _old) = attach(&job, 1, "n1").unwrap();
    let (_, _, mut answer) = job.join(spare("s")).unwrap();
    assert!(answer.try_recv().is_err(), "a spare's join waits");
    let d = job.describe();
    assert_eq!((d.spares.len(), d.max_spares), (1, 1));
    assert_eq!(
        (d.spares[0].node_id.as_str(), d.spares[0].connected),
        ("s", true)
    );
    assert_eq!(d.summary.unwrap().world_size, 2, "a spare takes no ranks");
    // A second spare, a spare asking for a node rank, and a spare named like a node are
    // refused, naming why.
    let (code, msg) = code_and_message(job.join(spare("t")).unwrap_err());
    assert_eq!(code, tonic::Code::FailedPrecondition);
    assert!(
        msg.contains("already has 1 spares standing by (max_spares 1)"),
        "{msg}"
    );
    let asks = JoinReq {
        requested: Some(0),
        ..spare("u")
    };
    let (code, msg) = code_and_message(job.join(asks).unwrap_err());
    assert_eq!(code, tonic::Code::InvalidArgument);
    assert!(msg.contains("a spare takes no node rank"), "{msg}");
    let (code, _) = code_and_message(job.join(spare("n0")).unwrap_err());
    assert_eq!(code, tonic::Code::AlreadyExists);

    job.node_lost(1, 1, old_watch, "its agent's stream broke: disconnected");
    let placed = answer.try_recv().unwrap().unwrap();
    assert_eq!(
        (placed.node_rank, placed.rank_offset, placed.world_size),
        (1, 1, 2)
    );
    let took = placed.took_over.unwrap();
    assert_eq!((took.node_id.as_str(), took.epoch), ("n1", 1));
    let d = job.describe();
    assert!(d.failure.is_none(), "{:?}", d.failure);
    assert!(d.spares.is_empty());
    assert_eq!((d.epoch, d.restart_count), (1, 1));
    assert_eq!(d.nodes[1].node_id, "s");
    assert_eq!(d.ranks[1].state, pb::RankState::Replacing as i32);
    assert_eq!(d.ranks[0].state, pb::RankState::Running as i32);
    let rec = &d.recoveries[0];
    assert_eq!(
        (rec.rank, rec.spare_node_id.as_str(), rec.epoch),
        (Some(1), "s", 1)
    );
    assert!(
        rec.reason
            .starts_with("node 1 (host host-n1, agent n1) was lost")
    );
    assert!(d.replaced["n1"].contains("replaced by spare 's'"));
    // The survivor hears of the membership change, naming the spare.
    let changed = inboxes[0].try_recv().unwrap().unwrap().kind.unwrap();
    let pb::coordinator_message::Kind::MembershipChanged(m) = changed else {
        panic!("{changed:?}")
    };
    assert_eq!(m.epoch, 1);
    assert!(m.cause.unwrap().message.contains("spare 's'"));

    // The lost agent is refused everywhere, named as replaced; its watch's late end loses
    // nothing.
    let (code, msg) = code_and_message(job.join(req("n1")).unwrap_err());
    assert_eq!(code, tonic::Code::PermissionDenied);
    assert!(msg.contains("was replaced by spare 's'"), "{msg}");
    assert!(msg.contains("--spare"), "{msg}");
    let (code, _) = code_and_message(attach(&job, 1, "n1").unwrap_err());
    assert_eq!(code, tonic::Code::PermissionDenied);
    let (code, msg) = code_and_message(job.check_reporter(1, 1, "n1").unwrap_err());
    assert_eq!(code, tonic::Code::PermissionDenied);
    assert!(msg.contains("replaced by spare"), "{msg}");
    job.check_reporter(1, 1, "s").unwrap();
    let (spare_watch, _w) = attach(&job, 1, "s").unwrap();
    job.node_lost(1, 1, old_watch, "a late end of the old stream");
    assert!(job.describe().failure.is_none());
    assert_eq!(job.describe().nodes[1].node_id, "s");

    // The spare's replacement registers for the epoch, and the quorum heals it from rank 0.
    let (tx, _rx) = mpsc::unbounded_channel();
    job.register(1, 1, 300, String::new(), tx, None, Some(1))
        .unwrap();
    let (_, mut q0) = job.quorum(&ask(0, 1, Some(5))).unwrap();
    let (_, mut q1) = job.quorum(&ask(1, 1, None)).unwrap();
    let formed = q0.try_recv().unwrap().unwrap();
    assert_eq!(q1.try_recv().unwrap().unwrap(), formed);
    assert_eq!(
        formed.heal,
        vec![pb::Heal {
            rank: Some(1),
            source: Some(0)
        }]
    );
    let d = job.describe();
    assert_eq!(d.recoveries[0].replacement_pid, 300);
    assert_eq!(d.recoveries[0].healed_from, Some(0));
    // The spare's own loss later, with no spare left, restarts the generation, saying why.
    job.node_lost(1, 1, spare_watch, "no heartbeat from its agent for 10.0s");
    let f = job.describe().failure.unwrap();
    assert!(
        f.reason
            .contains("no spare of 1 slots stands by (0 standing by), so the generation restarts"),
        "{}",
        f.reason
    );
}

#[tokio::test]
async fn without_spares_a_lost_node_restarts_and_a_spare_of_another_size_is_not_used() {
    let (job, _inboxes) = two_nodes(0).await;
    let (code, msg) = code_and_message(job.join(spare("s")).unwrap_err());
    assert_eq!(code, tonic::Code::FailedPrecondition);
    assert!(msg.contains("admits no spares"), "{msg}");
    job.node_lost(1, 1, 0, "its agent disconnected");
    let f = job.describe().failure.unwrap();
    assert!(
        f.reason.contains("admits no spares (--max-spares)"),
        "{}",
        f.reason
    );

    let (job, _inboxes) = two_nodes(1).await;
    let wide = JoinReq {
        local_world_size: 2,
        ..spare("wide")
    };
    let (_, _, mut answer) = job.join(wide).unwrap();
    job.node_lost(1, 1, 0, "its agent disconnected");
    assert!(
        answer.try_recv().is_err(),
        "a spare of 2 slots cannot take a node of 1"
    );
    let f = job.describe().failure.unwrap();
    assert!(f.reason.contains("(1 standing by)"), "{}", f.reason);
    // The spare stands by into the next generation.
    assert_eq!(job.describe().spares.len(), 1);
}

#[tokio::test]
async fn a_spare_that_goes_away_is_withdrawn_and_an_ending_job_sends_spares_away() {
    let (job, _inboxes) = two_nodes(2).await;
    let (generation, attempt, _answer) = job.join(spare("s")).unwrap();
    job.withdraw(generation, "s", attempt);
    assert!(job.describe().spares.is_empty());
    let (_, _, cancelled) = job.join(spare("t")).unwrap();
    assert!(job.cancel("maintenance"));
    let e = tonic::Status::from(cancelled.await.unwrap().unwrap_err());
    assert!(
        e.metadata()
            .contains_key(muster_core::error::CANCELLED_METADATA)
    );

    let (job, _inboxes) = two_nodes(2).await;
    let (_, _, finished) = job.join(spare("s")).unwrap();
    job.leave(1, 0);
    job.leave(1, 1);
    let e = tonic::Status::from(finished.await.unwrap().unwrap_err());
    assert!(e.message().contains("spare 's' was not needed"), "{e:?}");
    assert!(
        e.metadata()
            .contains_key(muster_core::error::FINISHED_METADATA)
    );
}

#[tokio::test]
async fn a_full_in_place_job_takes_a_new_agent_as_a_spare() {
    let (job, _inboxes) = two_nodes(1).await;
    let (_, _, mut answer) = job.join(req("late")).unwrap();
    assert!(answer.try_recv().is_err());
    assert_eq!(job.describe().spares[0].node_id, "late");
    // Without room, the refusal of a full job stands.
    let (code, msg) = code_and_message(job.join(req("later")).unwrap_err());
    assert_eq!(code, tonic::Code::FailedPrecondition);
    assert!(msg.contains("the job is full"), "{msg}");
    // A failover cuts such a spare's call: its join sent again (the same request id) to the
    // new leader stands by again, though the spare it is fills the room (the fault suite's
    // finding: it was refused as "full", and its agent exited 1 when the job finished).
    let late = JoinReq {
        request_id: "req-late".into(),
        ..req("late2")
    };
    let (job, _inboxes) = two_nodes(1).await;
    let (_, _, _first) = job.join(late.clone()).unwrap();
    let restored = Job::restore(&job.record(&job.lock()), 0, &ctx()).unwrap();
    let (_, _, mut again) = restored.join(late).unwrap();
    assert!(again.try_recv().is_err(), "it stands by");
    assert!(restored.describe().spares[0].connected);
    assert!(restored.cancel("done"));
    let e = tonic::Status::from(again.await.unwrap().unwrap_err());
    assert!(
        e.metadata()
            .contains_key(muster_core::error::CANCELLED_METADATA),
        "{e:?}"
    );
}

#[tokio::test]
async fn spares_and_a_takeover_are_in_the_record_a_new_leader_restores() {
    let (job, _inboxes) = two_nodes(1).await;
    let (_, _, _answer) = job.join(spare("s")).unwrap();
    let record = job.record(&job.lock());
    assert_eq!(record.max_spares, 1);
    assert_eq!(record.spares[0].request_id, "req-s");
    // A new leader knows the spare; its agent's join sent again (same request id) is its.
    let restored = Job::restore(&record, 0, &ctx()).unwrap();
    let d = restored.describe();
    assert_eq!((d.spares.len(), d.spares[0].connected), (1, false));
    let (_, _, mut again) = restored.join(spare("s")).unwrap();
    assert!(restored.describe().spares[0].connected);
    restored.node_lost(1, 1, 0, "its agent disconnected");
    let placed = again.try_recv().unwrap().unwrap();
    assert_eq!(placed.took_over.as_ref().unwrap().node_id, "n1");
    // After another failover the spare's join, sent again, gets the same place; the lost
    // agent is still refused.
    let record = restored.record(&restored.lock());
    assert_eq!(record.running.as_ref().unwrap().nodes[1].node_id, "s");
    let last = Job::restore(&record, 0, &ctx()).unwrap();
    let (_, _, same) = last.join(spare("s")).unwrap();
    assert_eq!(same.await.unwrap().unwrap(), placed);
    let (code, _) = code_and_message(last.join(req("n1")).unwrap_err());
    assert_eq!(code, tonic::Code::PermissionDenied);
    assert_eq!(
        last.describe().ranks[1].state,
        pb::RankState::Replacing as i32
    );
}
