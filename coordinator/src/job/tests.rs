//! Unit tests of the job state machine: final states never change, restarts and drains
//! follow the budget, and what a restored job expects.

#![allow(clippy::unwrap_used)]

use super::*;

fn req(node_id: &str) -> JoinReq {
    JoinReq {
        node_id: node_id.into(),
        host: format!("host-{node_id}"),
        local_world_size: 1,
        requested: None,
        request_id: String::new(),
    }
}

#[tokio::test]
async fn the_drained_set_is_in_the_record_and_a_restored_job_still_refuses_the_node() {
    let ctx = JobContext {
        incarnation: 1,
        store: None,
        tenure: crate::tenure::Tenure::always(),
    };
    let config = RoundConfig {
        min_nodes: 1,
        max_nodes: 2,
        last_call: Duration::from_secs(60),
        join_timeout: Duration::from_secs(60),
        max_restarts: 2,
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

fn ctx() -> JobContext {
    JobContext {
        incarnation: 1,
        store: None,
        tenure: crate::tenure::Tenure::always(),
    }
}

fn config(nodes: u32, max_restarts: u32) -> RoundConfig {
    RoundConfig {
        min_nodes: nodes,
        max_nodes: nodes,
        last_call: Duration::from_secs(60),
        join_timeout: Duration::from_secs(60),
        max_restarts,
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
