//! In-place recovery over real gRPC: the recovery mode at join, a rank's death that keeps the
//! generation running (MembershipChanged to the survivors, RankReplace to the node), the
//! replacement's registration, and `Rendezvous.Quorum` (its answer, its long poll and its
//! refusals).
#![allow(clippy::unwrap_used)]

mod common;

use common::*;
use muster_proto::v1 as pb;
use pb::rendezvous_client::RendezvousClient;
use std::time::Duration;
use tonic::Code;
use tonic::transport::Channel;

fn in_place_join(job: &str, node: &str, max_restarts: u32) -> pb::JoinRequest {
    let mut r = join_req(job, node, 1, 3, 3);
    let c = r.config.as_mut().unwrap();
    c.max_restarts = Some(max_restarts);
    c.recovery = pb::RecoveryMode::InPlace as i32;
    r
}

/// Forms an in-place job of 3 single-rank nodes; every session attached.
async fn formed(ch: &Channel, job: &str, max_restarts: u32) -> Vec<Raw> {
    let handles: Vec<_> = (0..3)
        .map(|n| spawn_join(ch, in_place_join(job, &format!("n{n}"), max_restarts)))
        .collect();
    for h in handles {
        let answer = h.await.unwrap().unwrap();
        assert_eq!(answer.recovery, pb::RecoveryMode::InPlace as i32);
    }
    attach_all(ch, job, 1, 3).await
}

async fn report(ch: &Channel, job: &str, rank: u32, code: i32) {
    RendezvousClient::new(ch.clone())
        .report_failure(pb::ReportFailureRequest {
            job_id: job.into(),
            generation: 1,
            rank,
            reason: format!("exited with status {code}"),
            exit_code: Some(code),
            ..Default::default()
        })
        .await
        .unwrap();
}

fn quorum_req(job: &str, rank: u32, epoch: u64, step: Option<u64>) -> pb::QuorumRequest {
    pb::QuorumRequest {
        job_id: job.into(),
        generation: 1,
        rank,
        epoch,
        step,
        released_global: 4,
        released_node: 0,
        wait_ms: 10_000,
    }
}

fn spawn_quorum(
    ch: &Channel,
    req: pb::QuorumRequest,
) -> tokio::task::JoinHandle<Result<pb::QuorumResponse, tonic::Status>> {
    let mut c = RendezvousClient::new(ch.clone());
    tokio::spawn(async move { c.quorum(req).await.map(|r| r.into_inner()) })
}

async fn quorum_err(ch: &Channel, req: pb::QuorumRequest) -> tonic::Status {
    RendezvousClient::new(ch.clone())
        .quorum(req)
        .await
        .unwrap_err()
}

#[tokio::test]
async fn a_mismatched_recovery_mode_is_refused_at_join_and_describe_shows_the_mode() {
    let s = start_default().await;
    let first = spawn_join(&s.channel, in_place_join("mode", "n0", 1));
    // The first join creates the job (and fixes its mode) before the others come.
    let mut ops = pb::ops_client::OpsClient::new(s.channel.clone());
    while ops
        .describe_job(pb::DescribeJobRequest {
            job_id: "mode".into(),
            ..Default::default()
        })
        .await
        .is_err()
    {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    // Another explicit mode is refused naming both; an unset one takes the job's.
    let mut other = in_place_join("mode", "n1", 1);
    other.config.as_mut().unwrap().recovery = pb::RecoveryMode::Restart as i32;
    let refused = RendezvousClient::new(s.channel.clone())
        .join(other)
        .await
        .unwrap_err();
    assert_eq!(refused.code(), Code::FailedPrecondition);
    assert!(
        refused.message().contains("recovery=in-place")
            && refused
                .message()
                .contains("this join asks for 3:3 200 60000 1 restart"),
        "{}",
        refused.message()
    );
    let mut unset = in_place_join("mode", "n1", 1);
    unset.config.as_mut().unwrap().recovery = 0;
    let second = spawn_join(&s.channel, unset);
    let third = spawn_join(&s.channel, in_place_join("mode", "n2", 1));
    for h in [first, second, third] {
        assert_eq!(
            h.await.unwrap().unwrap().recovery,
            pb::RecoveryMode::InPlace as i32
        );
    }
    let d = describe(&s.channel, "mode").await;
    assert_eq!(d.config.unwrap().recovery, pb::RecoveryMode::InPlace as i32);
    // An unknown mode is named.
    let mut bad = in_place_join("other", "n0", 1);
    bad.config.as_mut().unwrap().recovery = 7;
    let e = RendezvousClient::new(s.channel.clone())
        .join(bad)
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::InvalidArgument);
    assert!(
        e.message().contains("recovery 7 is not a recovery mode"),
        "{e:?}"
    );
}

#[tokio::test]
async fn a_dead_rank_is_replaced_in_place_and_the_quorum_heals_it() {
    let s = start_default().await;
    let ch = &s.channel;
    let job = "inplace";
    let mut ranks = formed(ch, job, 2).await;
    let mut watch = RawWatch::attach(ch, job, 1, 1, "n1").await.unwrap();

    // Rank 1 dies: reported by its agent, then its session drops.
    report(ch, job, 1, 9).await;
    let dead = ranks.remove(1);
    dead.kill();
    let order = watch.replace().await;
    assert_eq!(
        (
            order.rank,
            order.epoch,
            order.restart_count,
            order.max_restarts
        ),
        (Some(1), 1, 1, 2)
    );
    assert!(order.message.contains("replacing it in place"), "{order:?}");
    for r in &mut ranks {
        match r.next().await {
            pb::coordinator_message::Kind::MembershipChanged(m) => {
                assert_eq!(m.epoch, 1);
                assert!(
                    m.cause.unwrap().message.contains("exited with status 9"),
                    "rank {}",
                    r.rank
                );
            }
            other => panic!(
                "rank {}: expected membership_changed, got {other:?}",
                r.rank
            ),
        }
    }
    let d = describe(ch, job).await;
    assert_eq!(d.summary.unwrap().state, pb::RoundState::Running as i32);
    assert_eq!((d.restart_count, d.epoch), (1, 1));
    assert_eq!(d.ranks[1].state, pb::RankState::Replacing as i32);

    // Survivors park in Quorum; it does not form while rank 1 is being replaced.
    let q0 = spawn_quorum(ch, quorum_req(job, 0, 0, Some(20)));
    let q2 = spawn_quorum(ch, quorum_req(job, 2, 0, Some(19)));
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert!(!q0.is_finished() && !q2.is_finished());
    let e = quorum_err(ch, quorum_req(job, 1, 1, None)).await;
    assert_eq!(e.code(), Code::FailedPrecondition);
    assert!(e.message().contains("is being replaced"), "{e:?}");

    // A stale worker may not take the rank; its replacement may.
    let register = |replacement, epoch| pb::Register {
        job_id: job.into(),
        generation: 1,
        rank: 1,
        pid: 4242,
        replacement,
        epoch,
        ..Default::default()
    };
    let stale = Raw::attach_with(ch, register(false, 0)).await;
    let e = stale.err().unwrap();
    assert_eq!(e.code(), Code::FailedPrecondition);
    assert!(e.message().contains("this worker is stale"), "{e:?}");
    let _replacement = Raw::attach_with(ch, register(true, 1)).await.unwrap();
    let q1 = spawn_quorum(ch, quorum_req(job, 1, 1, None));
    let answers = [
        q0.await.unwrap().unwrap(),
        q1.await.unwrap().unwrap(),
        q2.await.unwrap().unwrap(),
    ];
    assert!(answers.iter().all(|a| *a == answers[0]), "{answers:?}");
    let a = &answers[0];
    assert_eq!((a.epoch, a.world_size, a.step), (1, 3, Some(20)));
    let heal: Vec<_> = a.heal.iter().map(|h| (h.rank, h.source)).collect();
    assert_eq!(heal, vec![(Some(1), Some(0)), (Some(2), Some(0))]);
    assert_eq!(a.released_global, 4);

    let d = describe(ch, job).await;
    assert_eq!(d.ranks[1].state, pb::RankState::Running as i32);
    let rec = &d.recoveries[0];
    assert_eq!(
        (
            rec.rank,
            rec.replacement_pid,
            rec.quorum_epoch,
            rec.healed_from
        ),
        (Some(1), 4242, 1, Some(0))
    );
    assert_eq!(rec.reason, "exited with status 9");
    // The session drop of the dead worker came after the report: still one restart.
    assert_eq!(d.restart_count, 1);
}

#[tokio::test]
async fn quorum_long_polls_and_refuses_bad_calls_naming_the_problem() {
    let s = start_default().await;
    let ch = &s.channel;
    let job = "poll";
    let _ranks = formed(ch, job, 1).await;

    // Each bad field is named.
    let mut r = quorum_req(job, 0, 0, None);
    r.wait_ms = 600_000;
    let e = quorum_err(ch, r).await;
    assert_eq!(e.code(), Code::InvalidArgument);
    assert!(
        e.message()
            .contains("wait_ms 600000 is above the limit of 60000"),
        "{e:?}"
    );
    let e = quorum_err(ch, quorum_req("nosuch", 0, 0, None)).await;
    assert_eq!(e.code(), Code::NotFound);
    assert!(e.message().contains("job 'nosuch' not found"), "{e:?}");
    let mut r = quorum_req(job, 0, 0, None);
    r.generation = 4;
    let e = quorum_err(ch, r).await;
    assert_eq!(e.code(), Code::FailedPrecondition);
    assert!(
        e.message()
            .contains("generation 4 of job 'poll' does not exist"),
        "{e:?}"
    );
    let e = quorum_err(ch, quorum_req(job, 9, 0, None)).await;
    assert_eq!(e.code(), Code::InvalidArgument);
    assert!(
        e.message().contains("rank 9 is outside job 'poll'"),
        "{e:?}"
    );
    let e = quorum_err(ch, quorum_req(job, 0, 5, None)).await;
    assert_eq!(e.code(), Code::InvalidArgument);
    assert!(e.message().contains("epoch 5 is ahead"), "{e:?}");

    // A call nobody answers runs out of time.
    let mut r = quorum_req(job, 0, 0, Some(1));
    r.wait_ms = 150;
    let e = quorum_err(ch, r).await;
    assert_eq!(e.code(), Code::DeadlineExceeded);
    assert!(
        e.message()
            .contains("no quorum of job 'poll' generation 1 within 150 ms"),
        "{e:?}"
    );

    // A dropped call leaves the table: ranks 1 and 2 alone do not form the quorum.
    let q0 = spawn_quorum(ch, quorum_req(job, 0, 0, Some(1)));
    tokio::time::sleep(Duration::from_millis(100)).await;
    q0.abort();
    let _ = q0.await;
    tokio::time::sleep(Duration::from_millis(100)).await;
    let q1 = spawn_quorum(ch, quorum_req(job, 1, 0, Some(1)));
    let q2 = spawn_quorum(ch, quorum_req(job, 2, 0, Some(1)));
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert!(!q1.is_finished() && !q2.is_finished());
    // Rank 0 asks again: everyone called, nobody died, a fresh epoch.
    let q0 = spawn_quorum(ch, quorum_req(job, 0, 0, Some(1)));
    for q in [q0, q1, q2] {
        let a = q.await.unwrap().unwrap();
        assert_eq!((a.epoch, a.step, a.heal.len()), (1, Some(1), 0));
    }

    // A restart-mode job has no quorum.
    form(ch, "restarting", 1, 1).await;
    let e = quorum_err(ch, quorum_req("restarting", 0, 0, None)).await;
    assert_eq!(e.code(), Code::FailedPrecondition);
    assert!(
        e.message().contains("recovers by restart, not in place"),
        "{e:?}"
    );
}

#[tokio::test]
async fn without_budget_the_generation_fails_and_parked_quorum_calls_hear_why() {
    let s = start_default().await;
    let ch = &s.channel;
    let job = "nobudget";
    let mut ranks = formed(ch, job, 0).await;
    let mut watch = RawWatch::attach(ch, job, 1, 2, "n2").await.unwrap();
    let q0 = spawn_quorum(ch, quorum_req(job, 0, 0, Some(3)));
    tokio::time::sleep(Duration::from_millis(100)).await;
    report(ch, job, 2, 1).await;
    let e = q0.await.unwrap().unwrap_err();
    assert_eq!(e.code(), Code::FailedPrecondition);
    assert!(e.message().contains("exited with status 1"), "{e:?}");
    let ended = watch.ended().await;
    assert!(!ended.rejoin, "{ended:?}");
    let failed = ranks[0].pushed_failure().await;
    assert_eq!(failed.rank, 2);
    assert_eq!(describe(ch, job).await.recoveries.len(), 0);
}

#[tokio::test]
async fn relays_hear_the_membership_change_and_enter_the_same_barrier_after_the_quorum() {
    let s = start_default().await;
    let ch = &s.channel;
    let job = "relayed";
    let handles: Vec<_> = (0..2)
        .map(|n| {
            let mut r = join_req(job, &format!("n{n}"), 2, 2, 2);
            let c = r.config.as_mut().unwrap();
            c.max_restarts = Some(1);
            c.recovery = pb::RecoveryMode::InPlace as i32;
            spawn_join(ch, r)
        })
        .collect();
    for h in handles {
        h.await.unwrap().unwrap();
    }
    let ranks = attach_all(ch, job, 1, 4).await;
    let mut relay = RawRelay::attach(ch, job, 1, 0).await.unwrap();
    relay.enter(1, &[("step", &[0, 1])], 0).await;
    tokio::time::sleep(Duration::from_millis(100)).await;

    report(ch, job, 3, 9).await;
    let withdrawn = relay.result(1).await.unwrap();
    assert_eq!(
        withdrawn.kind,
        pb::barrier_error::Kind::MembershipChanged as i32
    );
    match relay.event().await {
        pb::relay_event::Kind::Failed(e) => {
            assert_eq!(e.kind, pb::barrier_error::Kind::MembershipChanged as i32);
            assert_eq!(e.rank, 3);
        }
        other => panic!("expected the relay to hear the change, got {other:?}"),
    }
    // While the membership changes, the node's entry is sent back at once.
    relay.enter(1, &[("step", &[0, 1])], 0).await;
    let refused = relay.result(1).await.unwrap();
    assert_eq!(
        refused.kind,
        pb::barrier_error::Kind::MembershipChanged as i32
    );
    assert!(
        refused.message.contains("go to the step boundary"),
        "{refused:?}"
    );

    let replacement = Raw::attach_with(
        ch,
        pb::Register {
            job_id: job.into(),
            generation: 1,
            rank: 3,
            pid: 77,
            replacement: true,
            epoch: 1,
            ..Default::default()
        },
    )
    .await
    .unwrap();
    let quorum: Vec<_> = (0..4)
        .map(|r| spawn_quorum(ch, quorum_req(job, r, u64::from(r == 3), Some(2))))
        .collect();
    for q in quorum {
        assert_eq!(q.await.unwrap().unwrap().epoch, 1);
    }
    // Barrier #1 again, its seq unused by the withdrawal: the node through its relay, rank 2
    // through its session, the replacement too.
    relay.enter(1, &[("step", &[0, 1])], 0).await;
    ranks[2]
        .enter_seq(pb::BarrierScope::Global, 1, "step", 0)
        .await;
    replacement
        .enter_seq(pb::BarrierScope::Global, 1, "step", 0)
        .await;
    assert_eq!(relay.result(1).await, None);
}
