//! Unit tests of the job state machine: final states never change, restarts and drains
//! follow the budget, and what a restored job expects.

#![allow(clippy::unwrap_used)]

use super::*;

pub(super) fn req(node_id: &str) -> JoinReq {
    JoinReq {
        node_id: node_id.into(),
        host: format!("host-{node_id}"),
        local_world_size: 1,
        requested: None,
        request_id: String::new(),
        watches: false,
        spare: false,
    }
}

#[tokio::test]
async fn the_drained_set_is_in_the_record_and_a_restored_job_still_refuses_the_node() {
    let ctx = JobContext {
        incarnation: 1,
        store: None,
        tenure: crate::tenure::Tenure::always(),
        heartbeat_timeout: Duration::from_secs(10),
    };
    let config = RoundConfig {
        min_nodes: 1,
        max_nodes: 2,
        last_call: Duration::from_secs(60),
        join_timeout: Duration::from_secs(60),
        max_restarts: 2,
        recovery: Recovery::Restart,
        hang: Hang::default(),
        max_spares: 0,
    };
    let job = Job::new(JobId::parse("j").unwrap(), config, &ctx);
    let (_, _, a) = job.join(req("a")).unwrap();
    let (_, _, b) = job.join(req("b")).unwrap();
    a.await.unwrap().unwrap();
    b.await.unwrap().unwrap();
    let resp = job.drain(&NodeRef::Id("b".into()), "maintenance").unwrap();
    assert_eq!((resp.generation, resp.remaining_nodes), (1, 1));
    let record = job.record(&job.lock());
    assert_eq!(
        record.drained.get("b").map(String::as_str),
        Some("maintenance")
    );
    assert_eq!((record.generation, record.restarts), (2, 0));
    let restored = Job::restore(&record, 0, &ctx).unwrap();
    let err = tonic::Status::from(restored.join(req("b")).unwrap_err());
    assert_eq!(err.code(), tonic::Code::FailedPrecondition);
    assert!(err.message().contains("was drained"), "{err:?}");
    assert!(err.metadata().contains_key(DRAINED_METADATA));
    assert!(restored.join(req("a")).is_ok());
}

/// The ids of an open round's joiners, in the order `describe` lists them.
fn waiting(job: &Job) -> Vec<String> {
    job.describe()
        .nodes
        .into_iter()
        .map(|n| n.node_id)
        .collect()
}

#[tokio::test]
async fn an_open_round_finds_its_joiners_by_id_and_rank_and_keeps_their_order() {
    let job = Job::new(JobId::parse("j").unwrap(), config(4, 0), &ctx());
    let with = |id: &str, requested: Option<u32>, request_id: &str| JoinReq {
        requested,
        request_id: request_id.into(),
        ..req(id)
    };
    let (generation, first, _a) = job.join(with("a", Some(3), "r-a")).unwrap();
    let (_, _, b) = job.join(with("b", None, "")).unwrap();
    // The same node id, or the same requested node rank, again: refused, naming the holder.
    let (code, msg) = code_and_message(job.join(with("a", None, "")).unwrap_err());
    assert_eq!(code, tonic::Code::AlreadyExists);
    assert!(msg.contains("node 'a' has already joined"), "{msg}");
    let (code, msg) = code_and_message(job.join(with("c", Some(3), "")).unwrap_err());
    assert_eq!(code, tonic::Code::AlreadyExists);
    assert!(
        msg.contains("node rank 3") && msg.contains("node 'a'"),
        "{msg}"
    );
    // A retried join takes the place over: the first call's withdrawal leaves it.
    let (_, retry, _a) = job.join(with("a", Some(3), "r-a")).unwrap();
    job.withdraw(generation, "a", first);
    assert_eq!(waiting(&job), ["a", "b"]);
    // The retry's withdrawal frees the node id and the rank; the others keep their order.
    job.withdraw(generation, "a", retry);
    assert_eq!(waiting(&job), ["b"]);
    let (_, _, c) = job.join(with("c", Some(3), "")).unwrap();
    let (_, _, a) = job.join(with("a", None, "")).unwrap();
    let (_, _, d) = job.join(with("d", None, "")).unwrap();
    // Closed at 4: c holds its rank, the rest fill the others in the order they came.
    let mut ranks = vec![];
    for answer in [a, b, c, d] {
        ranks.push(answer.await.unwrap().unwrap().node_rank);
    }
    assert_eq!(ranks, [1, 0, 3, 2]);
}

pub(super) fn ctx() -> JobContext {
    JobContext {
        incarnation: 1,
        store: None,
        tenure: crate::tenure::Tenure::always(),
        heartbeat_timeout: Duration::from_secs(10),
    }
}

pub(super) fn config(nodes: u32, max_restarts: u32) -> RoundConfig {
    RoundConfig {
        min_nodes: nodes,
        max_nodes: nodes,
        last_call: Duration::from_secs(60),
        join_timeout: Duration::from_secs(60),
        max_restarts,
        recovery: Recovery::Restart,
        hang: Hang::default(),
        max_spares: 0,
    }
}

/// A job of `nodes` single-rank nodes n0.. whose round closed (generation 1).
async fn formed(nodes: u32, max_restarts: u32) -> Arc<Job> {
    let job = Job::new(
        JobId::parse("j").unwrap(),
        config(nodes, max_restarts),
        &ctx(),
    );
    let mut answers = vec![];
    for n in 0..nodes {
        answers.push(job.join(req(&format!("n{n}"))).unwrap().2);
    }
    for a in answers {
        a.await.unwrap().unwrap();
    }
    job
}

/// The job's state, restart count and final message, as DescribeJob and the record show
/// them.
fn outcome(job: &Job) -> (i32, u32, String) {
    let summary = job.summary();
    let record = job.record(&job.lock());
    let why = [record.finished, record.failed, record.cancelled].concat();
    (summary.state, summary.restart_count, why)
}

/// Every late event a final job can meet; none may change it.
async fn every_late_event(job: &Arc<Job>) {
    job.fail_rank(
        1,
        0,
        "exited with status 9".into(),
        Some(FailureDetail {
            exit_code: Some(9),
            ..FailureDetail::default()
        }),
    );
    job.fail_rank(1, 1, "its session was lost".into(), None);
    job.node_lost(1, 0, 0, "its agent disconnected");
    job.node_lost(1, 1, 0, "no heartbeat from its agent for 10.0s");
    job.check_reattached(Duration::from_secs(10));
    job.cancel("too late");
    let _ = job.drain(&NodeRef::Rank(0), "too late");
    let _ = job.join(req("stranger"));
    let _ = job.join(req("n0"));
    job.node_finished(1, 0).await;
}

#[tokio::test]
async fn a_final_state_never_changes() {
    // Finished: every node's workers exited 0.
    let finished = formed(2, 3).await;
    finished.node_finished(1, 0).await;
    assert_eq!(finished.summary().state, pb::RoundState::Running as i32);
    finished.node_finished(1, 1).await;
    let before = outcome(&finished);
    assert_eq!(before.0, pb::RoundState::Finished as i32, "{before:?}");
    assert!(before.2.contains("left cleanly"), "{before:?}");
    every_late_event(&finished).await;
    assert_eq!(outcome(&finished), before);
    assert!(finished.summary().done);
    let e = tonic::Status::from(finished.join(req("n0")).unwrap_err());
    assert_eq!(e.code(), tonic::Code::FailedPrecondition);
    assert!(
        e.message().contains("job 'j' has finished"),
        "{}",
        e.message()
    );

    // Cancelled: a worker stopped by the cancel exits by a signal afterwards.
    let cancelled = formed(2, 3).await;
    assert!(cancelled.cancel("operator"));
    let before = outcome(&cancelled);
    assert_eq!(before.0, pb::RoundState::Cancelled as i32, "{before:?}");
    every_late_event(&cancelled).await;
    assert_eq!(outcome(&cancelled), before);
    // The reason shows everywhere, and the agents' disconnects failed nothing.
    let view = cancelled.describe();
    let summary = view.summary.unwrap();
    assert_eq!(summary.reason, "cancelled by an operator: operator");
    assert!(summary.done);
    assert!(view.failure.is_none(), "{:?}", view.failure);
    for r in &view.ranks {
        assert_ne!(r.state, pb::RankState::Failed as i32, "{r:?}");
        // Node 0 said its workers exited 0 (a late event above); node 1's were stopped.
        if r.node_rank == Some(1) {
            assert_eq!(r.state, pb::RankState::Cancelled as i32, "{r:?}");
            assert_eq!(
                r.activity, "stopped: the job was cancelled by an operator: operator",
                "{r:?}"
            );
        }
    }
    assert_eq!(view.nodes[1].state, pb::NodeState::Cancelled as i32);
    let e = tonic::Status::from(cancelled.join(req("n0")).unwrap_err());
    assert_eq!(e.code(), tonic::Code::FailedPrecondition);
    assert_eq!(
        e.message(),
        "job 'j' was cancelled by an operator: operator"
    );
    assert!(
        e.metadata()
            .contains_key(muster_core::error::CANCELLED_METADATA)
    );

    // Failed with no restarts left.
    let failed = formed(2, 0).await;
    failed.fail_rank(1, 1, "exited with status 3".into(), None);
    let before = outcome(&failed);
    assert_eq!(before.0, pb::RoundState::Failed as i32, "{before:?}");
    every_late_event(&failed).await;
    let after = outcome(&failed);
    assert_eq!((after.0, after.1), (before.0, before.1));
    // Only the first failure's reason may become more precise (the agent's report).
    assert!(after.2.contains("rank 1"), "{after:?}");
}

#[tokio::test]
async fn a_job_restored_finished_expects_no_reattach() {
    let job = formed(2, 0).await;
    for node_rank in 0..2 {
        // As if both agents had watched: a failover must wait for neither.
        let mut st = job.lock();
        let Phase::Running(g) = &mut st.phase else {
            unreachable!()
        };
        g.nodes[node_rank].watched = true;
        g.ranks[node_rank].had_session = true;
    }
    job.node_finished(1, 0).await;
    // Half finished: node 0 is not awaited after a failover, node 1 is.
    let half = Job::restore(&job.record(&job.lock()), 0, &ctx()).unwrap();
    half.check_reattached(Duration::from_secs(10));
    let f = half.describe().failure.unwrap();
    assert_eq!(f.node_rank, Some(1), "{f:?}");
    assert!(f.reason.contains("did not re-attach"), "{f:?}");

    job.node_finished(1, 1).await;
    let record = job.record(&job.lock());
    assert!(record.finished.contains("left cleanly"), "{record:?}");
    let restored = Job::restore(&record, 0, &ctx()).unwrap();
    restored.check_reattached(Duration::from_secs(10));
    let d = restored.describe();
    assert!(d.failure.is_none(), "{:?}", d.failure);
    let summary = d.summary.unwrap();
    assert_eq!(summary.state, pb::RoundState::Finished as i32);
    assert!(summary.done);
    assert_eq!(outcome(&restored), outcome(&job));
}

/// A leader may fall between closing a round and storing the first watch's attach: a node
/// whose join said its agent watches is awaited after the failover all the same, and a
/// bare join's node (no agent, no watch) is not.
#[tokio::test]
async fn a_node_whose_join_promised_a_watch_is_awaited_though_no_attach_was_stored() {
    let job = Job::new(JobId::parse("j").unwrap(), config(2, 0), &ctx());
    let mut answers = vec![];
    for (n, watches) in [("n0", false), ("n1", true)] {
        answers.push(job.join(JoinReq { watches, ..req(n) }).unwrap().2);
    }
    for a in answers {
        a.await.unwrap().unwrap();
    }
    // The record as the round's close stored it: no watch attached yet.
    let restored = Job::restore(&job.record(&job.lock()), 0, &ctx()).unwrap();
    restored.check_reattached(Duration::from_secs(10));
    let f = restored.describe().failure.unwrap();
    assert_eq!(f.node_rank, Some(1), "{f:?}");
    assert!(f.reason.contains("did not re-attach"), "{f:?}");

    // Only the bare join: nothing is awaited.
    let bare = Job::new(JobId::parse("j").unwrap(), config(1, 0), &ctx());
    let answer = bare.join(req("n0")).unwrap().2;
    answer.await.unwrap().unwrap();
    let restored = Job::restore(&bare.record(&bare.lock()), 0, &ctx()).unwrap();
    restored.check_reattached(Duration::from_secs(10));
    assert!(restored.describe().failure.is_none());
}

#[tokio::test]
async fn a_join_into_a_full_running_generation_is_refused_and_changes_nothing() {
    let job = formed(1, 0).await;
    let e = tonic::Status::from(job.join(req("stranger")).unwrap_err());
    assert_eq!(e.code(), tonic::Code::FailedPrecondition);
    for part in ["job 'j' is running", "1 of at most 1 nodes", "'stranger'"] {
        assert!(e.message().contains(part), "{part}: {}", e.message());
    }
    let s = job.summary();
    assert_eq!(
        (s.state, s.generation, s.restart_count),
        (pb::RoundState::Running as i32, 1, 0)
    );
}

#[tokio::test]
async fn a_known_node_joining_again_is_a_restart_within_the_budget() {
    let job = formed(1, 1).await;
    let (generation, _, answer) = job.join(req("n0")).unwrap();
    assert_eq!(generation, 2);
    let answer = answer.await.unwrap().unwrap();
    assert_eq!((answer.generation, answer.restart_count), (2, 1));
    // The budget is spent: the next one ends the job, naming the node.
    let e = tonic::Status::from(job.join(req("n0")).unwrap_err());
    assert_eq!(e.code(), tonic::Code::FailedPrecondition);
    assert!(
        e.message().contains("is over") && e.message().contains("joined the job again"),
        "{}",
        e.message()
    );
    let s = job.summary();
    assert_eq!(
        (s.state, s.restart_count, s.done),
        (pb::RoundState::Failed as i32, 1, true)
    );
}

/// DescribeJob keeps what made each restart: every generation's failure, newest first, not
/// only the current one's.
#[tokio::test]
async fn describe_lists_the_failures_of_earlier_generations_newest_first() {
    let job = formed(1, 2).await;
    let exited = |code| {
        Some(FailureDetail {
            exit_code: Some(code),
            ..FailureDetail::default()
        })
    };
    job.fail_rank(1, 0, "exited with status 3".into(), exited(3));
    let (_, _, answer) = job.join(req("n0")).unwrap();
    assert_eq!(answer.await.unwrap().unwrap().generation, 2);
    job.fail_rank(2, 0, "exited with status 4".into(), exited(4));
    let d = job.describe();
    let seen: Vec<(u64, Option<i32>)> = d
        .recent_failures
        .iter()
        .map(|f| (f.generation, f.exit_code))
        .collect();
    assert_eq!(seen, [(2, Some(4)), (1, Some(3))], "{d:?}");
    // A late report for a generation that already failed adds nothing.
    job.fail_rank(1, 0, "exited with status 9".into(), exited(9));
    assert_eq!(job.describe().recent_failures.len(), 2);
}

// In-place recovery.

use muster_core::requests::QuorumAsk;
use tokio::sync::mpsc::UnboundedReceiver;

type Inbox = UnboundedReceiver<Result<pb::CoordinatorMessage, Status>>;

/// An in-place job of `nodes` single-rank nodes whose round closed, every rank registered
/// (pid 100 + rank): the job, each rank's outbox and inbox, and each rank's session id.
async fn in_place(nodes: u32, max_restarts: u32) -> (Arc<Job>, Vec<(Outbox, Inbox)>, Vec<u64>) {
    let config = RoundConfig {
        recovery: Recovery::InPlace,
        hang: Hang::default(),
        ..config(nodes, max_restarts)
    };
    let job = Job::new(JobId::parse("j").unwrap(), config, &ctx());
    let mut answers = vec![];
    for n in 0..nodes {
        answers.push(job.join(req(&format!("n{n}"))).unwrap().2);
    }
    for a in answers {
        let answer = a.await.unwrap().unwrap();
        assert_eq!(answer.recovery, pb::RecoveryMode::InPlace as i32);
    }
    let (mut sessions, mut ids) = (vec![], vec![]);
    for r in 0..nodes {
        let (tx, rx) = mpsc::unbounded_channel();
        let reg = job
            .register(1, r, 100 + r, String::new(), tx.clone(), None, None)
            .unwrap();
        ids.push(reg.session);
        sessions.push((tx.into(), rx));
    }
    (job, sessions, ids)
}

fn exited(code: i32) -> Option<FailureDetail> {
    Some(FailureDetail {
        exit_code: Some(code),
        ..FailureDetail::default()
    })
}

pub(super) fn ask(rank: u32, epoch: u64, step: Option<u64>) -> QuorumAsk {
    QuorumAsk {
        job_id: JobId::parse("j").unwrap(),
        generation: 1,
        rank,
        epoch,
        step,
        released: [u64::from(rank) + 10, 3],
        wait: Duration::from_secs(5),
    }
}

/// The next message pushed to a session.
fn pushed(inbox: &mut Inbox) -> pb::coordinator_message::Kind {
    inbox.try_recv().unwrap().unwrap().kind.unwrap()
}

fn watch_of(job: &Job, node: u32) -> UnboundedReceiver<Result<pb::NodeEvent, Status>> {
    let (tx, rx) = mpsc::unbounded_channel();
    job.watch(
        1,
        node,
        &format!("n{node}"),
        0,
        tx,
        pb::NodeAttached::default(),
    )
    .unwrap();
    rx
}

/// The replacement orders a watch received (after its `attached`).
fn replaces(rx: &mut UnboundedReceiver<Result<pb::NodeEvent, Status>>) -> Vec<pb::RankReplace> {
    let mut out = vec![];
    while let Ok(Ok(ev)) = rx.try_recv() {
        if let Some(pb::node_event::Kind::Replace(r)) = ev.kind {
            out.push(r);
        }
    }
    out
}

pub(super) fn code_and_message(e: Error) -> (tonic::Code, String) {
    let s = tonic::Status::from(e);
    (s.code(), s.message().to_owned())
}

#[tokio::test]
async fn an_in_place_rank_failure_replaces_the_rank_and_the_quorum_heals_it() {
    let (job, mut s, ids) = in_place(3, 2).await;
    let mut watch1 = watch_of(&job, 1);
    // Rank 0 waits in global barrier #1 when rank 1 dies.
    job.barrier(1, 0, Scope::Global, 1, "step".into(), None, &s[0].0);
    job.fail_rank(1, 1, "exited with status 9".into(), exited(9));

    // The generation goes on: no failure, no end, one restart spent, epoch 1.
    let d = job.describe();
    assert_eq!(d.summary.unwrap().state, pb::RoundState::Running as i32);
    assert_eq!((d.restart_count, d.epoch), (1, 1));
    assert_eq!(d.ranks[1].state, pb::RankState::Replacing as i32);
    assert!(
        d.ranks[1].activity.contains("being replaced"),
        "{:?}",
        d.ranks[1]
    );
    assert_eq!(d.recoveries.len(), 1);
    assert_eq!(
        (
            d.recoveries[0].rank,
            d.recoveries[0].epoch,
            d.recoveries[0].reason.as_str()
        ),
        (Some(1), 1, "exited with status 9")
    );
    // Rank 0's wait was withdrawn (its seq unused), then every live session heard.
    match pushed(&mut s[0].1) {
        pb::coordinator_message::Kind::Barrier(b) => {
            let e = b.error.unwrap();
            assert_eq!(e.kind, ErrKind::MembershipChanged as i32);
            assert!(e.message.contains("rank 1 (node 1"), "{}", e.message);
            assert!(e.message.contains("restart 1 of 2"), "{}", e.message);
        }
        other => panic!("expected the withdrawn wait, got {other:?}"),
    }
    for r in [0, 2] {
        match pushed(&mut s[r].1) {
            pb::coordinator_message::Kind::MembershipChanged(m) => {
                assert_eq!(m.epoch, 1);
                let cause = m.cause.unwrap();
                assert_eq!((cause.kind, cause.rank), (ErrKind::RankFailed as i32, 1));
            }
            other => panic!("rank {r}: expected membership_changed, got {other:?}"),
        }
    }
    let orders = replaces(&mut watch1);
    assert_eq!(orders.len(), 1);
    assert_eq!(
        (
            orders[0].rank,
            orders[0].epoch,
            orders[0].restart_count,
            orders[0].max_restarts
        ),
        (Some(1), 1, 1, 2)
    );
    let record = job.record(&job.lock());
    let running = record.running.unwrap();
    assert_eq!((running.epoch, running.replacing), (1, vec![0b010]));
    assert_eq!(record.recovery, pb::RecoveryMode::InPlace as i32);

    // The dead worker's session ends late: nothing more happens.
    job.session_lost(1, 1, ids[1], "connection lost".into());
    assert_eq!(job.describe().restart_count, 1);
    // While the membership changes, barrier entries are sent to the quorum at once.
    job.barrier(1, 2, Scope::Global, 1, "step".into(), None, &s[2].0);
    match pushed(&mut s[2].1) {
        pb::coordinator_message::Kind::Barrier(b) => {
            assert_eq!(b.error.unwrap().kind, ErrKind::MembershipChanged as i32);
        }
        other => panic!("expected a refused entry, got {other:?}"),
    }

    // Only the replacement may take the rank, and only a REPLACING rank takes one.
    let (tx, mut rx1) = mpsc::unbounded_channel();
    let stale = job.register(1, 1, 999, String::new(), tx.clone(), None, None);
    let (code, msg) = code_and_message(stale.unwrap_err());
    assert_eq!(code, tonic::Code::FailedPrecondition);
    assert!(msg.contains("this worker is stale"), "{msg}");
    let wrong = job.register(1, 0, 999, String::new(), tx.clone(), None, Some(1));
    let (code, msg) = code_and_message(wrong.unwrap_err());
    assert_eq!(code, tonic::Code::FailedPrecondition);
    assert!(
        msg.contains("rank 0 of job 'j' generation 1 is not awaiting a replacement"),
        "{msg}"
    );
    let ahead = job.register(1, 1, 999, String::new(), tx.clone(), None, Some(4));
    assert!(code_and_message(ahead.unwrap_err()).1.contains("epoch 4"));
    let reg = job
        .register(1, 1, 4242, String::new(), tx.clone(), None, Some(1))
        .unwrap();
    assert_ne!(reg.session, ids[1]);
    let d = job.describe();
    assert_eq!(d.ranks[1].state, pb::RankState::Running as i32);
    assert_eq!(
        (d.ranks[1].pid, d.recoveries[0].replacement_pid),
        (4242, 4242)
    );

    // The quorum forms only once every rank called, and answers all of them alike.
    let (_, mut q0) = job.quorum(&ask(0, 0, Some(15))).unwrap();
    let (_, mut q2) = job.quorum(&ask(2, 0, Some(14))).unwrap();
    assert!(q0.try_recv().is_err() && q2.try_recv().is_err());
    let (_, mut q1) = job.quorum(&ask(1, 1, None)).unwrap();
    let answers: Vec<pb::QuorumResponse> = [&mut q0, &mut q1, &mut q2]
        .into_iter()
        .map(|q| q.try_recv().unwrap().unwrap())
        .collect();
    assert!(answers.iter().all(|a| *a == answers[0]));
    let a = &answers[0];
    assert_eq!((a.epoch, a.world_size, a.step), (1, 3, Some(15)));
    let heal: Vec<(Option<u32>, Option<u32>)> = a.heal.iter().map(|h| (h.rank, h.source)).collect();
    assert_eq!(heal, vec![(Some(1), Some(0)), (Some(2), Some(0))]);
    assert_eq!((a.released_global, a.released_node), (10, 3));
    assert_eq!(a.members.len(), 3);
    let d = job.describe();
    let rec = &d.recoveries[0];
    assert_eq!((rec.quorum_epoch, rec.healed_from), (1, Some(0)));
    // The membership is settled: rank 0 enters barrier #1 again (its seq was not used up).
    job.barrier(1, 0, Scope::Global, 1, "step".into(), None, &s[0].0);
    job.barrier(
        1,
        1,
        Scope::Global,
        1,
        "step".into(),
        None,
        &Outbox::Session(tx.clone()),
    );
    job.barrier(1, 2, Scope::Global, 1, "step".into(), None, &s[2].0);
    match pushed(&mut s[0].1) {
        pb::coordinator_message::Kind::Barrier(b) => assert_eq!((b.seq, b.error), (1, None)),
        other => panic!("expected barrier #1 released, got {other:?}"),
    }
    assert!(matches!(
        pushed(&mut rx1),
        pb::coordinator_message::Kind::Barrier(pb::BarrierResult { error: None, .. })
    ));
    // Everyone asking again without a death: a fresh epoch, nobody healed.
    let mut qs = vec![];
    for r in 0..3 {
        qs.push(job.quorum(&ask(r, 1, Some(16))).unwrap().1);
    }
    for mut q in qs {
        let a = q.try_recv().unwrap().unwrap();
        assert_eq!((a.epoch, a.step, a.heal.len()), (2, Some(16), 0));
    }
}

#[tokio::test]
async fn the_precise_report_refines_the_death_and_a_dying_replacement_is_a_new_death() {
    let (job, _s, ids) = in_place(2, 3).await;
    let mut watch0 = watch_of(&job, 0);
    // The session drop comes first, then the agent's report of the same death.
    job.session_lost(1, 0, ids[0], "connection lost".into());
    job.fail_rank(1, 0, "killed by signal 9".into(), exited(137));
    let d = job.describe();
    assert_eq!((d.restart_count, d.epoch, d.recoveries.len()), (1, 1, 1));
    assert_eq!(d.recoveries[0].reason, "killed by signal 9");
    assert_eq!(replaces(&mut watch0).len(), 1);
    // Its replacement dies before registering (the agent reports its exit): a new death.
    job.fail_rank(1, 0, "exited with status 3".into(), exited(3));
    let d = job.describe();
    assert_eq!((d.restart_count, d.epoch, d.recoveries.len()), (2, 2, 2));
    assert_eq!(d.recoveries[0].reason, "exited with status 3");
    let orders = replaces(&mut watch0);
    assert_eq!(
        orders
            .iter()
            .map(|o| (o.epoch, o.restart_count))
            .collect::<Vec<_>>(),
        vec![(2, 2)]
    );
}

#[tokio::test]
async fn a_rank_dying_while_others_wait_in_quorum_keeps_them_waiting() {
    let (job, _s, _ids) = in_place(3, 3).await;
    job.fail_rank(1, 2, "exited with status 1".into(), exited(1));
    let (_, mut q0) = job.quorum(&ask(0, 0, Some(5))).unwrap();
    let (_, mut q1) = job.quorum(&ask(1, 0, Some(5))).unwrap();
    // Rank 1 dies while it waits: its call ends, rank 0 keeps waiting, the epoch moves on.
    job.fail_rank(1, 1, "exited with status 1".into(), exited(1));
    let (code, msg) = code_and_message(q1.try_recv().unwrap().unwrap_err());
    assert_eq!(code, tonic::Code::FailedPrecondition);
    assert!(msg.contains("died while it waited"), "{msg}");
    assert!(q0.try_recv().is_err());
    assert_eq!(job.describe().epoch, 2);
    // A REPLACING rank may not ask; the replacements register and ask; then it forms.
    let (code, msg) = code_and_message(job.quorum(&ask(1, 2, None)).unwrap_err());
    assert_eq!(code, tonic::Code::FailedPrecondition);
    assert!(
        msg.contains("rank 1 of job 'j' generation 1 is being replaced"),
        "{msg}"
    );
    let mut replacements = vec![];
    for r in [1, 2] {
        let (tx, rx) = mpsc::unbounded_channel();
        job.register(1, r, 200 + r, String::new(), tx.clone(), None, Some(2))
            .unwrap();
        replacements.push((tx, rx));
    }
    let (_, mut q2) = job.quorum(&ask(2, 1, None)).unwrap();
    assert!(q0.try_recv().is_err());
    let (_, mut q1) = job.quorum(&ask(1, 2, None)).unwrap();
    let a = q0.try_recv().unwrap().unwrap();
    assert_eq!(q1.try_recv().unwrap().unwrap(), a);
    assert_eq!(q2.try_recv().unwrap().unwrap(), a);
    assert_eq!((a.epoch, a.step), (2, Some(5)));
    let healed: Vec<Option<u32>> = a.heal.iter().map(|h| h.rank).collect();
    assert_eq!(healed, vec![Some(1), Some(2)]);
    let d = job.describe();
    assert!(
        d.recoveries.iter().all(|r| r.quorum_epoch == 2),
        "{:?}",
        d.recoveries
    );
}

#[tokio::test]
async fn without_budget_an_in_place_failure_fails_the_generation_and_ends_parked_calls() {
    let (job, mut s, _ids) = in_place(2, 1).await;
    job.fail_rank(1, 1, "exited with status 1".into(), exited(1));
    let (tx, _rx) = mpsc::unbounded_channel();
    job.register(1, 1, 7, String::new(), tx, None, Some(1))
        .unwrap();
    let (_, mut q0) = job.quorum(&ask(0, 0, Some(1))).unwrap();
    // The budget is spent: the next death ends the generation as in restart mode.
    job.fail_rank(1, 1, "exited with status 2".into(), exited(2));
    let (code, msg) = code_and_message(q0.try_recv().unwrap().unwrap_err());
    assert_eq!(code, tonic::Code::FailedPrecondition);
    assert!(msg.contains("exited with status 2"), "{msg}");
    let (state, restarts, why) = outcome(&job);
    assert_eq!((state, restarts), (pb::RoundState::Failed as i32, 1));
    assert!(why.contains("no restarts left"), "{why}");
    // Rank 0 heard the generation fail (after the first death's membership change).
    let mut kinds = vec![];
    while let Ok(Ok(m)) = s[0].1.try_recv() {
        kinds.push(m.kind.unwrap());
    }
    assert!(matches!(
        kinds[0],
        pb::coordinator_message::Kind::MembershipChanged(_)
    ));
    assert!(matches!(
        kinds.last(),
        Some(pb::coordinator_message::Kind::GenerationFailed(_))
    ));
    // A lost node in an in-place job with budget still fails the generation.
    let (job, _s, _ids) = in_place(2, 3).await;
    job.node_lost(1, 1, 0, "its agent disconnected");
    let summary = job.summary();
    assert_eq!(summary.state, pb::RoundState::Failed as i32);
    assert!(!summary.done, "{summary:?}");
    assert_eq!(job.describe().recoveries.len(), 0);
}

#[tokio::test]
async fn quorum_calls_are_refused_naming_the_problem() {
    let (job, _s, _ids) = in_place(2, 1).await;
    let check = |a: QuorumAsk, code: tonic::Code, text: &str| {
        let (c, msg) = code_and_message(job.quorum(&a).unwrap_err());
        assert_eq!(c, code, "{msg}");
        assert!(msg.contains(text), "{msg} lacks {text}");
    };
    check(
        QuorumAsk {
            generation: 2,
            ..ask(0, 0, None)
        },
        tonic::Code::FailedPrecondition,
        "generation 2 of job 'j' does not exist",
    );
    check(
        ask(5, 0, None),
        tonic::Code::InvalidArgument,
        "rank 5 is outside job 'j'",
    );
    check(
        ask(0, 3, None),
        tonic::Code::InvalidArgument,
        "epoch 3 is ahead of job 'j' generation 1, whose membership epoch is 0",
    );
    // A newer call of the same rank replaces the older one.
    let (_, mut first) = job.quorum(&ask(0, 0, Some(1))).unwrap();
    let (token, _second) = job.quorum(&ask(0, 0, Some(1))).unwrap();
    let (code, msg) = code_and_message(first.try_recv().unwrap().unwrap_err());
    assert_eq!(code, tonic::Code::Aborted);
    assert!(msg.contains("a newer Quorum call of rank 0"), "{msg}");
    // A withdrawn call is gone: rank 1 alone does not form the quorum.
    job.quorum_withdraw(1, 0, token);
    let (_, mut only) = job.quorum(&ask(1, 0, Some(1))).unwrap();
    assert!(only.try_recv().is_err());
    // A rank that leaves cleanly ends the parked calls: no quorum can form without it.
    job.leave(1, 0);
    let (code, msg) = code_and_message(only.try_recv().unwrap().unwrap_err());
    assert_eq!(code, tonic::Code::FailedPrecondition);
    assert!(
        msg.contains("rank 0 of job 'j' generation 1 has left"),
        "{msg}"
    );
    let (code, _) = code_and_message(job.quorum(&ask(1, 0, Some(1))).unwrap_err());
    assert_eq!(code, tonic::Code::FailedPrecondition);
    // A job that restarts has no quorum.
    let restart = formed(1, 1).await;
    let (c, msg) = code_and_message(restart.quorum(&ask(0, 0, None)).unwrap_err());
    assert_eq!(c, tonic::Code::FailedPrecondition);
    assert!(
        msg.contains("job 'j' recovers by restart, not in place"),
        "{msg}"
    );
}

#[tokio::test]
async fn a_new_leader_keeps_the_epoch_and_sends_the_replacement_order_again() {
    let (job, _s, _ids) = in_place(3, 3).await;
    let mut watch1 = watch_of(&job, 1);
    job.fail_rank(1, 1, "exited with status 1".into(), exited(1));
    // Another rank dies before rank 1's replacement registers: two orders, two epochs.
    job.fail_rank(1, 2, "exited with status 2".into(), exited(2));
    let sent = replaces(&mut watch1);
    let record = job.record(&job.lock());
    let restored = Job::restore(&record, 0, &ctx()).unwrap();
    assert_eq!(restored.config().recovery, Recovery::InPlace);
    let d = restored.describe();
    assert_eq!((d.epoch, d.restart_count), (2, 2));
    assert_eq!(d.ranks[1].state, pb::RankState::Replacing as i32);
    // The agent re-attaches its watch: the very order it had, epoch 1, comes again.
    let orders = replaces(&mut watch_of(&restored, 1));
    assert_eq!(orders, sent);
    assert_eq!(
        (orders[0].rank, orders[0].epoch, orders[0].restart_count),
        (Some(1), 1, 1)
    );
    assert!(replaces(&mut watch_of(&restored, 0)).is_empty());
    let (tx, _rx) = mpsc::unbounded_channel();
    restored
        .register(1, 2, 12, String::new(), tx, None, Some(2))
        .unwrap();
    // A worker that is not its replacement is refused; the replacement registers with the
    // new leader.
    let (tx, _rx) = mpsc::unbounded_channel();
    let stale = restored.register(1, 1, 8, String::new(), tx.clone(), None, None);
    assert!(code_and_message(stale.unwrap_err()).1.contains("stale"));
    restored
        .register(1, 1, 9, String::new(), tx, None, Some(1))
        .unwrap();
    // After another failover the replacement (its rank no longer REPLACING in the record)
    // re-attaches with resume, still saying it is a replacement.
    let record = restored.record(&restored.lock());
    assert!(
        record
            .running
            .as_ref()
            .unwrap()
            .replacing
            .iter()
            .all(|b| *b == 0)
    );
    let again = Job::restore(&record, 0, &ctx()).unwrap();
    assert_eq!(again.describe().epoch, 2);
    let (tx, _rx) = mpsc::unbounded_channel();
    let fresh = again.register(1, 1, 9, String::new(), tx.clone(), None, Some(1));
    assert!(
        code_and_message(fresh.unwrap_err())
            .1
            .contains("is not awaiting a replacement")
    );
    // Quorum calls that reach the new leader before their sessions re-attach are parked; the
    // last session back forms the quorum.
    let (_, mut q0) = again.quorum(&ask(0, 2, Some(7))).unwrap();
    let (_, mut q1) = again.quorum(&ask(1, 2, None)).unwrap();
    let (_, mut q2) = again.quorum(&ask(2, 2, Some(7))).unwrap();
    for r in [0, 2] {
        let (tx, _rx) = mpsc::unbounded_channel();
        again
            .register(1, r, 9, String::new(), tx, Some([0, 0]), None)
            .unwrap();
    }
    assert!(q0.try_recv().is_err());
    again
        .register(1, 1, 9, String::new(), tx, Some([0, 0]), Some(1))
        .unwrap();
    let a = q0.try_recv().unwrap().unwrap();
    assert_eq!((a.epoch, a.step), (3, Some(7)));
    assert_eq!(q1.try_recv().unwrap().unwrap(), a);
    assert_eq!(q2.try_recv().unwrap().unwrap(), a);
    // The record still showed the rank awaiting its replacement when the leader changed: the
    // replacement re-attaching with resume (and no replacement flag) takes it.
    let (tx, _rx) = mpsc::unbounded_channel();
    let late = Job::restore(&job.record(&job.lock()), 0, &ctx()).unwrap();
    late.register(1, 1, 9, String::new(), tx, Some([0, 0]), None)
        .unwrap();
    let d = late.describe();
    assert_eq!(d.ranks[1].state, pb::RankState::Running as i32);
    assert!(replaces(&mut watch_of(&late, 1)).is_empty());
    assert_eq!(
        restored.describe().ranks[1].state,
        pb::RankState::Running as i32
    );
}

/// A memory store whose puts wait while `open` is false: a leader's record write in flight.
/// Counts the puts that landed.
struct Gated {
    inner: crate::MemoryStore,
    open: watch::Sender<bool>,
    puts: std::sync::atomic::AtomicUsize,
}

impl Gated {
    fn new() -> Arc<Self> {
        Arc::new(Gated {
            inner: crate::MemoryStore::default(),
            open: watch::channel(true).0,
            puts: 0.into(),
        })
    }

    fn puts(&self) -> usize {
        self.puts.load(std::sync::atomic::Ordering::SeqCst)
    }

    /// A job context whose durable store is this one.
    fn ctx(self: &Arc<Self>) -> JobContext {
        JobContext {
            store: Some(Arc::clone(self) as Arc<dyn Store>),
            ..ctx()
        }
    }
}

#[async_trait::async_trait]
impl Store for Gated {
    fn durable(&self) -> bool {
        true
    }
    async fn get(&self, key: &str) -> Result<Option<Vec<u8>>, crate::store::StoreError> {
        self.inner.get(key).await
    }
    async fn put(&self, key: &str, value: Vec<u8>) -> Result<(), crate::store::StoreError> {
        let _ = self.open.subscribe().wait_for(|o| *o).await;
        self.puts.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        self.inner.put(key, value).await
    }
    async fn write_all(
        &self,
        entries: Vec<(String, Option<Vec<u8>>)>,
    ) -> Result<(), crate::store::StoreError> {
        self.inner.write_all(entries).await
    }
    async fn create(
        &self,
        key: &str,
        value: Vec<u8>,
    ) -> Result<Option<Vec<u8>>, crate::store::StoreError> {
        self.inner.create(key, value).await
    }
    async fn delete(&self, key: &str) -> Result<bool, crate::store::StoreError> {
        self.inner.delete(key).await
    }
    async fn list(&self, prefix: &str) -> Result<Vec<(String, Vec<u8>)>, crate::store::StoreError> {
        self.inner.list(prefix).await
    }
    async fn delete_prefix(&self, prefix: &str) -> Result<u64, crate::store::StoreError> {
        self.inner.delete_prefix(prefix).await
    }
}

/// A replacement order starts a process: it reaches the agent only once the record holding
/// it is stored, on the watch it has then (a CI run had a leader die between its order and
/// its write, and the next leader reissue the same epoch for a new decision, which the agent
/// took for a repeat). A leader that dies first sends nothing. Paused time: each sleep only
/// lets the job's tasks run.
#[tokio::test(start_paused = true)]
async fn a_replacement_order_waits_for_its_record() {
    let gate = Gated::new();
    let ctx = gate.ctx();
    let config = RoundConfig {
        recovery: Recovery::InPlace,
        hang: Hang::default(),
        ..config(2, 2)
    };
    let run = |job: Arc<Job>| async move {
        let answers = [
            job.join(req("n0")).unwrap().2,
            job.join(req("n1")).unwrap().2,
        ];
        for a in answers {
            a.await.unwrap().unwrap();
        }
        job
    };
    // Stored late: nothing before the write, on the first watch nor on one attached since;
    // one order after it, on the watch attached last.
    let job = run(Job::new(JobId::parse("j").unwrap(), config, &ctx)).await;
    let mut first = watch_of(&job, 0);
    gate.open.send_replace(false);
    job.fail_rank(1, 0, "exited with status 1".into(), exited(1));
    tokio::time::sleep(Duration::from_millis(50)).await;
    assert!(replaces(&mut first).is_empty());
    let mut second = watch_of(&job, 0);
    assert!(replaces(&mut second).is_empty());
    gate.open.send_replace(true);
    job.persisted().await;
    tokio::time::sleep(Duration::from_millis(20)).await;
    let orders: Vec<_> = replaces(&mut second)
        .iter()
        .map(|o| (o.rank, o.epoch))
        .collect();
    assert_eq!(orders, [(Some(0), 1)]);
    // Attached after the write: the stored order at once.
    assert_eq!(replaces(&mut watch_of(&job, 0)).len(), 1);
    job.retire("test over");
    // Retired before the write (the leader died): never sent.
    let job = run(Job::new(JobId::parse("k").unwrap(), config, &ctx)).await;
    let mut watch = watch_of(&job, 0);
    gate.open.send_replace(false);
    job.fail_rank(1, 0, "exited with status 1".into(), exited(1));
    job.retire("stopped leading");
    gate.open.send_replace(true);
    tokio::time::sleep(Duration::from_millis(50)).await;
    assert!(replaces(&mut watch).is_empty());
}

#[tokio::test]
async fn the_stored_record_carries_the_mode_the_epoch_and_the_replacing_ranks() {
    use prost::Message as _;
    let store: Arc<dyn Store> = Arc::new(crate::MemoryStore::default());
    let ctx = JobContext {
        store: Some(Arc::clone(&store)),
        ..ctx()
    };
    let config = RoundConfig {
        recovery: Recovery::InPlace,
        hang: Hang::default(),
        ..config(2, 2)
    };
    let job = Job::new(JobId::parse("j").unwrap(), config, &ctx);
    let answers = [
        job.join(req("n0")).unwrap().2,
        job.join(req("n1")).unwrap().2,
    ];
    for a in answers {
        a.await.unwrap().unwrap();
    }
    let (tx, _rx) = mpsc::unbounded_channel();
    job.register(1, 0, 1, String::new(), tx, None, None)
        .unwrap();
    job.fail_rank(1, 0, "exited with status 1".into(), exited(1));
    job.persisted().await;
    let bytes = store.get(&record_key(&job.id)).await.unwrap().unwrap();
    let record = pb::JobRecord::decode(bytes.as_slice()).unwrap();
    assert_eq!(record.recovery, pb::RecoveryMode::InPlace as i32);
    assert_eq!(record.restarts, 1);
    let running = record.running.as_ref().unwrap();
    assert_eq!(
        (running.epoch, running.replacing.as_slice()),
        (1, &[0b01u8][..])
    );
    let orders: Vec<_> = running
        .replace_orders
        .iter()
        .map(|o| (o.rank, o.epoch, o.restart_count, o.max_restarts))
        .collect();
    assert_eq!(orders, vec![(Some(0), 1, 1, 2)]);
    job.retire("test over");
    let restored = Job::restore(&record, 0, &ctx).unwrap();
    let d = restored.describe();
    assert_eq!((d.epoch, d.restart_count), (1, 1));
    assert_eq!(d.ranks[0].state, pb::RankState::Replacing as i32);
    // The new leader's ops view still lists the recovery opened before the failover.
    let listed: Vec<_> = d
        .recoveries
        .iter()
        .map(|r| (r.epoch, r.rank, r.reason.as_str(), r.quorum_epoch))
        .collect();
    assert_eq!(listed, [(1, Some(0), "exited with status 1", 0)]);
    restored.retire("test over");
}

#[tokio::test]
async fn a_session_that_does_not_reattach_after_a_failover_is_replaced_in_place() {
    let (job, _s, _ids) = in_place(2, 1).await;
    let record = job.record(&job.lock());
    job.retire("failover");
    let restored = Job::restore(&record, 0, &ctx()).unwrap();
    let _w0 = watch_of(&restored, 0);
    let mut w1 = watch_of(&restored, 1);
    let (tx, _rx) = mpsc::unbounded_channel();
    restored
        .register(1, 0, 1, String::new(), tx, Some([0, 0]), None)
        .unwrap();
    restored.check_reattached(Duration::from_secs(3));
    let d = restored.describe();
    assert_eq!(d.summary.unwrap().state, pb::RoundState::Running as i32);
    assert_eq!((d.restart_count, d.epoch), (1, 1));
    assert_eq!(d.ranks[1].state, pb::RankState::Replacing as i32);
    assert!(
        d.recoveries[0]
            .reason
            .contains("did not re-attach within 3.0s")
    );
    assert_eq!(replaces(&mut w1).len(), 1);
    // Without budget left, the same silence fails the generation as before.
    let record = restored.record(&restored.lock());
    restored.retire("failover");
    let (tx, _rx) = mpsc::unbounded_channel();
    let again = Job::restore(&record, 0, &ctx()).unwrap();
    let (_w0, _w1) = (watch_of(&again, 0), watch_of(&again, 1));
    again
        .register(1, 1, 2, String::new(), tx, None, Some(1))
        .unwrap();
    again.check_reattached(Duration::from_secs(3));
    let (state, restarts, why) = outcome(&again);
    assert_eq!((state, restarts), (pb::RoundState::Failed as i32, 1));
    assert!(
        why.contains("rank 0") && why.contains("did not re-attach"),
        "{why}"
    );
}

/// A formed job of `nodes` single-rank nodes with a hang timeout of [`HANG`] (set directly:
/// below what a join may ask, to keep the tests short) and `action`.
const HANG: Duration = Duration::from_millis(50);

/// A little more than [`HANG`] (the job's clock is the real one).
fn stall() {
    std::thread::sleep(HANG + Duration::from_millis(30));
}

async fn hanging(nodes: u32, max_restarts: u32, action: OnHang) -> Arc<Job> {
    let job = formed(nodes, max_restarts).await;
    job.lock().config.hang = Hang {
        timeout: Some(HANG),
        action,
    };
    job
}

/// Answers the next dump command on `rx` as node `node` would, with `ranks`.
fn answer_dump(
    job: &Job,
    rx: &mut UnboundedReceiver<Result<pb::NodeEvent, Status>>,
    node: u32,
    ranks: Vec<u32>,
) {
    loop {
        let ev = rx.try_recv().unwrap().unwrap();
        if let Some(pb::node_event::Kind::DumpStacks(cmd)) = ev.kind {
            let ranks = ranks
                .iter()
                .map(|&r| pb::RankStack {
                    rank: Some(r),
                    native: format!("/bin/prog{r} (pid {r}) is not Python"),
                    ..Default::default()
                })
                .collect();
            job.stacks_reply(
                1,
                node,
                pb::NodeStacks {
                    request_id: cmd.request_id,
                    ranks,
                },
            );
            return;
        }
    }
}

/// No progress for the timeout is a hang, taken once; progress re-arms it; a hang whose
/// generation made progress while its stacks were read is dropped (no decision after the
/// stall ended).
#[tokio::test]
async fn a_stall_is_a_hang_once_and_progress_meanwhile_drops_it() {
    let job = hanging(2, 0, OnHang::Report).await;
    assert!(job.hang_due().is_none(), "not before the timeout");
    stall();
    let due = job.hang_due().expect("a hang after the timeout");
    assert_eq!((due.generation, due.action), (1, OnHang::Report));
    assert!(job.hang_due().is_none(), "the same stall is taken once");
    // Progress came while its stacks were read: nothing is recorded.
    job.node_progress(1);
    let dump = pb::DumpStacksResponse::default();
    assert!(job.record_hang(&due, &dump).is_none());
    assert!(job.describe().hangs.is_empty());
    // A new stall: recorded, pushed to every watch, kept for the view; the job goes on.
    stall();
    let due = job.hang_due().expect("a second stall");
    let mut w0 = watch_of(&job, 0);
    let hang = job.record_hang(&due, &dump).expect("recorded");
    assert!(
        hang.report.starts_with(
            "no progress in generation 1 for 0 s (hang timeout 0 s): reported; the job goes on"
        ),
        "{}",
        hang.report
    );
    let pushed = std::iter::from_fn(|| w0.try_recv().ok())
        .filter_map(|e| e.ok()?.kind)
        .any(|k| matches!(k, pb::node_event::Kind::Hang(_)));
    assert!(pushed, "the agents are told");
    assert_eq!(job.describe().hangs.len(), 1);
    assert_eq!(outcome(&job).0, pb::RoundState::Running as i32);
    // A stale progress notice (another generation) changes nothing.
    job.node_progress(7);
    assert!(job.hang_due().is_none());
}

/// `--on-hang fail` ends the job with the odd rank as the root cause whatever budget is
/// left; `restart` spends a restart.
#[tokio::test]
async fn on_hang_fail_ends_the_job_and_restart_spends_a_restart() {
    let dump = pb::DumpStacksResponse {
        groups: vec![
            pb::StackGroup {
                ranks: vec![1],
                likely_cause: true,
                line: "rank 1 is elsewhere: train.py:9 slow".into(),
                ..Default::default()
            },
            pb::StackGroup {
                ranks: vec![0, 2],
                line: "ranks 0,2 (2 of 3): torch.distributed.barrier".into(),
                ..Default::default()
            },
        ],
        ..Default::default()
    };
    let job = hanging(3, 2, OnHang::Fail).await;
    stall();
    let due = job.hang_due().unwrap();
    let hang = job.record_hang(&due, &dump).unwrap();
    assert_eq!(hang.odd_ranks, [1]);
    let (state, restarts, why) = outcome(&job);
    assert_eq!((state, restarts), (pb::RoundState::Failed as i32, 0));
    assert!(
        why.starts_with("rank 1 (node 1, host host-n1) of job 'j' generation 1 failed: the job hung: no progress for 0 s (hang timeout 0 s); rank 1 is elsewhere: train.py:9 slow"),
        "{why}"
    );
    let f = job.describe().failure.unwrap();
    assert!(f.hang, "{f:?}");

    let job = hanging(3, 2, OnHang::Restart).await;
    stall();
    let due = job.hang_due().unwrap();
    job.record_hang(&due, &dump).unwrap();
    // The generation failed and the job goes on: not over, the nodes told to rejoin.
    assert!(!job.summary().done);
    let (_, _, why) = outcome(&job);
    assert_eq!(why, "", "not a final state");
    let ended = job.record(&job.lock()).ended.unwrap();
    assert!(
        ended.rejoin && ended.failure.unwrap().hang,
        "{:?}",
        ended.message
    );
}

/// A dump asks every watched node and names the silent ones; an answer's ranks outside its
/// node and a stray answer (an unknown request) are dropped.
#[tokio::test]
async fn a_dump_gathers_the_nodes_and_drops_what_is_not_theirs() {
    let job = formed(3, 0).await;
    let mut w0 = watch_of(&job, 0);
    let mut w1 = watch_of(&job, 1);
    // A stray answer changes nothing.
    job.stacks_reply(
        1,
        0,
        pb::NodeStacks {
            request_id: 99,
            ranks: vec![],
        },
    );
    let dumping = {
        let job = Arc::clone(&job);
        tokio::spawn(async move { job.dump_stacks(Default::default()).await })
    };
    tokio::time::sleep(Duration::from_millis(50)).await;
    // Node 0 also claims rank 2 (node 2's): dropped.
    answer_dump(&job, &mut w0, 0, vec![0, 2]);
    answer_dump(&job, &mut w1, 1, vec![1]);
    let r = dumping.await.unwrap().unwrap();
    assert_eq!(
        r.unanswered,
        ["node 2 (host-n2): its agent has no watch attached"]
    );
    assert_eq!(r.ranks.len(), 3);
    assert!(r.ranks[0].native.starts_with("/bin/prog0"));
    assert!(r.ranks[1].native.starts_with("/bin/prog1"));
    assert!(
        r.ranks[2].native.is_empty(),
        "not node 0's to answer: {:?}",
        r.ranks[2]
    );
    assert!(
        r.ranks[2].error.starts_with("no stack from its agent: "),
        "{:?}",
        r.ranks[2]
    );
    assert!(
        r.report
            .ends_with("no answer from node 2 (host-n2): its agent has no watch attached"),
        "{}",
        r.report
    );
}

/// The straggler view: samples of a rank outside its node are dropped; the rank that waits
/// far less than the others is named, with how long.
#[tokio::test]
async fn samples_name_a_straggler_and_only_a_node_speaks_for_its_ranks() {
    let job = formed(3, 0).await;
    let sample = |rank, share| pb::RankSample {
        rank: Some(rank),
        samples: 40,
        waiting_share: share,
        busy_at: format!("train.py:{rank} load"),
        busy_share: 1.0 - share,
        waiting_at: "torch.autograd.backward".into(),
    };
    job.node_samples(1, 0, vec![sample(0, 0.8)]);
    // Node 0 speaking for rank 2: dropped.
    job.node_samples(1, 0, vec![sample(2, 0.05)]);
    job.node_samples(1, 1, vec![sample(1, 0.82)]);
    assert_eq!(job.describe().straggler, "", "rank 2 has no samples yet");
    job.node_samples(1, 2, vec![sample(2, 0.05)]);
    let d = job.describe();
    assert!(
        d.straggler.starts_with("straggler: rank 2 (node 2, host host-n2): waits in 5% of its samples, the others in 82% (median); it spends 95% at train.py:2 load; the others wait at torch.autograd.backward; for 0 s"),
        "{}",
        d.straggler
    );
    assert!((d.ranks[2].sampled.as_ref().unwrap().waiting_share - 0.05).abs() < 1e-9);
    // Balanced again: nobody.
    job.node_samples(1, 2, vec![sample(2, 0.7)]);
    assert_eq!(job.describe().straggler, "");
}

/// Finding 7's guard: an open the agent gave up on (a lower attach number), read by the leader
/// after the agent's next open registered, is refused and does not replace the node's watch,
/// so the abandoned stream's end fails nothing; the newer watch's own end still does.
#[tokio::test]
async fn an_older_attach_read_late_does_not_replace_the_nodes_watch() {
    let job = formed(2, 0).await;
    let attach = |attempt: u64| {
        let (tx, rx) = mpsc::unbounded_channel();
        let id = job.watch(1, 0, "n0", attempt, tx, pb::NodeAttached::default());
        (id, rx)
    };
    let (newer, _rx) = attach(20);
    let newer = newer.unwrap();
    let (older, _) = attach(10);
    let err = tonic::Status::from(older.unwrap_err());
    assert_eq!(err.code(), tonic::Code::AlreadyExists, "{err:?}");
    assert!(err.message().contains("newer watch"), "{err:?}");
    assert_eq!(job.summary().state, pb::RoundState::Running as i32);
    // The same number again is taken, and so is an unnumbered attach (an older agent).
    let (same, _rx2) = attach(20);
    let (unnumbered, _rx3) = attach(0);
    let (same, unnumbered) = (same.unwrap(), unnumbered.unwrap());
    for replaced in [newer, same] {
        job.node_lost(1, 0, replaced, "its agent's stream broke: cancelled");
        assert_eq!(job.summary().state, pb::RoundState::Running as i32);
    }
    job.node_lost(1, 0, unnumbered, "its agent disconnected");
    assert_ne!(job.summary().state, pb::RoundState::Running as i32);
}

/// The effective training time's counts are in the job record: a new leader goes on counting
/// from them instead of from its first marker.
#[tokio::test]
async fn a_restored_job_keeps_its_training_counts() {
    let job = formed(1, 0).await;
    for step in 0..3 {
        job.step_begun(1, 0, step);
        std::thread::sleep(Duration::from_millis(20));
    }
    let before = job.describe().training.unwrap();
    assert_eq!(before.highest_step, 2);
    assert!(before.counted_ms >= 40, "{before:?}");
    let record = job.record(&job.lock());
    let restored = Job::restore(&record, 0, &ctx()).unwrap();
    let after = restored.describe().training.unwrap();
    assert_eq!(
        (after.counted_ms, after.highest_step, after.last_step),
        (before.counted_ms, 2, 2)
    );
    assert!(after.wall_ms >= before.wall_ms, "{after:?} {before:?}");
    restored.step_begun(1, 0, 3);
    let on = restored.describe().training.unwrap();
    assert!(on.counted_ms > before.counted_ms, "{on:?}");
}

/// Issue 30's timeline: an in-place recovery records the death, the replacement's
/// registration, the quorum, the heal report, training again and the first full step; a
/// restart records the failure, the next round, every rank registered, training again and the
/// first full step; the lost time is split into those parts, and a new leader keeps both.
#[tokio::test]
async fn recoveries_and_restarts_record_each_phase_and_split_the_lost_time() {
    let pause = || std::thread::sleep(Duration::from_millis(15));
    let (job, _s, _ids) = in_place(2, 2).await;
    for step in 0..3 {
        job.step_begun(1, 0, step);
        pause();
    }
    job.fail_rank(1, 1, "exited with status 9".into(), exited(9));
    pause();
    let (tx, _rx) = mpsc::unbounded_channel();
    job.register(1, 1, 4242, String::new(), tx, None, Some(1))
        .unwrap();
    pause();
    let (_, mut q0) = job.quorum(&ask(0, 0, Some(2))).unwrap();
    let (_, mut q1) = job.quorum(&ask(1, 1, None)).unwrap();
    assert_eq!(q0.try_recv().unwrap().unwrap().epoch, 1);
    q1.try_recv().unwrap().unwrap();
    // Reports that name no open heal change nothing: another rank, another epoch.
    job.healed(1, 0, 1);
    job.healed(1, 1, 7);
    job.healed(9, 1, 1);
    assert_eq!(job.describe().recoveries[0].healed_ms, 0);
    pause();
    job.healed(1, 1, 1);
    pause();
    // Step 2 begun again, then step 3: training again, then the first full step.
    job.step_begun(1, 0, 2);
    pause();
    job.step_begun(1, 0, 3);
    let d = job.describe();
    let r = &d.recoveries[0];
    assert!(
        0 < r.respawn_ms
            && r.respawn_ms <= r.quorum_ms
            && r.quorum_ms <= r.healed_ms
            && r.healed_ms <= r.resumed_ms
            && r.resumed_ms < r.full_step_ms,
        "{r:?}"
    );
    let t = d.training.unwrap();
    assert_eq!(t.detection_ms, 0, "a worker's death is known at once");
    assert_eq!(t.respawn_ms, r.respawn_ms, "{t:?}");
    assert_eq!(t.heal_ms, r.resumed_ms - r.respawn_ms, "{t:?}");
    assert_eq!(t.recoveries_ms, r.resumed_ms, "{t:?}");
    assert_eq!(t.restarts_ms, 0);
    assert!(t.lost_ms >= t.recoveries_ms, "{t:?}");
    assert!(d.recent_restarts.is_empty());

    // A restart: the failure, the round closing again, the rank registering, two markers.
    let job = formed(1, 1).await;
    job.step_begun(1, 0, 0);
    pause();
    let detail = FailureDetail {
        exit_code: Some(3),
        stderr_tail: "loss diverged".into(),
        ..FailureDetail::default()
    };
    job.fail_rank(1, 0, "exited with status 3".into(), Some(detail));
    let d = job.describe();
    assert_eq!(d.recent_restarts.len(), 1);
    assert_eq!(
        (
            d.recent_restarts[0].failed_generation,
            d.recent_restarts[0].generation
        ),
        (1, 0)
    );
    // Without the worker's stderr: the timeline is on the unauthenticated web view.
    assert_eq!(
        d.recent_restarts[0].reason,
        "rank 0 (node 0, host host-n0) exited with status 3"
    );
    pause();
    let (_, _, answer) = job.join(req("n0")).unwrap();
    assert_eq!(answer.await.unwrap().unwrap().generation, 2);
    pause();
    let (tx, _rx) = mpsc::unbounded_channel();
    job.register(2, 0, 77, String::new(), tx, None, None)
        .unwrap();
    pause();
    // A late marker of the failed generation is not the new one's first.
    job.step_begun(1, 0, 5);
    job.step_begun(2, 0, 0);
    pause();
    job.step_begun(2, 0, 1);
    let d = job.describe();
    let r = &d.recent_restarts[0];
    assert_eq!(r.generation, 2);
    assert!(
        0 < r.formed_ms
            && r.formed_ms < r.registered_ms
            && r.registered_ms < r.resumed_ms
            && r.resumed_ms < r.full_step_ms,
        "{r:?}"
    );
    let t = d.training.unwrap();
    assert!(
        t.restarts_ms >= r.resumed_ms && t.restarts_ms <= t.lost_ms,
        "{t:?}"
    );
    assert_eq!(t.recoveries_ms, 0);

    // A new leader keeps the timeline and the parts.
    let record = job.record(&job.lock());
    let restored = Job::restore(&record, 0, &ctx()).unwrap().describe();
    assert_eq!(restored.recent_restarts, d.recent_restarts);
    assert_eq!(restored.training.unwrap().restarts_ms, t.restarts_ms);
}

/// A job's record is built by its writer, from the state as it is when a write can start (a
/// rank's registration only counts a version): registrations made while a write is in flight
/// land together, in one record that holds them all, and `persisted` waits for it. What this
/// saves (a record built per registration starved a 16,384-rank coordinator on etcd of its
/// lease) is measured by `bench scale --etcd`. Paused time: each sleep only lets the writer
/// run.
#[tokio::test(start_paused = true)]
async fn registrations_during_a_record_write_are_written_together() {
    let gate = Gated::new();
    let ctx = gate.ctx();
    let job = Job::new(JobId::parse("j").unwrap(), config(1, 0), &ctx);
    let (generation, _, answer) = job
        .join(JoinReq {
            local_world_size: 64,
            ..req("n0")
        })
        .unwrap();
    answer.await.unwrap().unwrap();
    job.persisted().await;
    let before = gate.puts();
    gate.open.send_replace(false);
    let mut outboxes = vec![];
    for rank in 0..64 {
        let (tx, rx) = mpsc::unbounded_channel();
        job.register(generation, rank, 100 + rank, String::new(), tx, None, None)
            .unwrap();
        outboxes.push(rx);
    }
    tokio::time::sleep(Duration::from_millis(20)).await;
    gate.open.send_replace(true);
    job.persisted().await;
    // The write held at the gate (built at the first registration) and one more for the
    // other 63: not one per registration.
    let writes = gate.puts() - before;
    assert!(
        (1..=2).contains(&writes),
        "{writes} record writes for 64 registrations"
    );
    let stored = gate.inner.get(&record_key(&job.id)).await.unwrap().unwrap();
    let record = <pb::JobRecord as prost::Message>::decode(stored.as_slice()).unwrap();
    let sessions = record.running.unwrap().sessions;
    assert_eq!(
        sessions,
        vec![0xff; 8],
        "every registration is in the stored record"
    );
}
