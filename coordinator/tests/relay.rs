//! Relayed global barriers: an agent enters one group per node; the coordinator answers once
//! per node and pushes generation failures.
#![allow(clippy::unwrap_used, missing_docs)]

mod common;
use common::*;
use muster_proto::v1 as pb;
use pb::BarrierScope::Global;
use pb::barrier_error::Kind;
use std::time::{Duration, Instant};

#[tokio::test]
async fn relayed_groups_and_direct_sessions_meet_at_one_barrier() {
    let s = start_default().await;
    form(&s.channel, "mix", 2, 2).await;
    let mut ranks = attach_all(&s.channel, "mix", 1, 4).await;
    let mut relay = RawRelay::attach(&s.channel, "mix", 1, 0).await.unwrap();
    for seq in 1..=20u64 {
        relay.enter(seq, &[("loop", &[0, 1])], 0).await;
        for r in ranks.iter_mut().skip(2) {
            r.enter(Global, "loop", 0).await;
        }
        assert_eq!(relay.result(seq).await, None, "seq {seq}");
        for r in ranks.iter_mut().skip(2) {
            assert_eq!(r.result().await, None);
        }
    }
    let d = describe(&s.channel, "mix").await;
    assert_eq!(d.ranks[0].global_seq, 20);
}

#[tokio::test]
async fn bad_groups_are_rejected_whole_and_change_nothing() {
    let s = start_default().await;
    form(&s.channel, "badgroup", 2, 2).await;
    let _ranks = attach_all(&s.channel, "badgroup", 1, 3).await; // rank 3 never registers
    let mut relay0 = RawRelay::attach(&s.channel, "badgroup", 1, 0)
        .await
        .unwrap();
    let mut relay1 = RawRelay::attach(&s.channel, "badgroup", 1, 1)
        .await
        .unwrap();
    for (groups, needle) in [
        (vec![("b", vec![0u32, 2])], "rank 2 is on node 1"),
        (vec![("b", vec![0, 0])], "named twice"),
        (
            vec![("b", vec![1]), ("c", vec![0, 1])],
            "rank 1 is named twice",
        ),
        (vec![("b", vec![0, 9])], "outside the world"),
    ] {
        let groups: Vec<(&str, &[u32])> = groups.iter().map(|(n, r)| (*n, r.as_slice())).collect();
        relay0.enter(1, &groups, 0).await;
        let e = relay0.result(1).await.unwrap();
        assert!(
            e.message.contains(needle),
            "{} should contain {needle}",
            e.message
        );
    }
    relay1.enter(1, &[("b", &[2, 3])], 0).await;
    let e = relay1.result(1).await.unwrap();
    assert!(
        e.message.contains("rank 3 has no live session"),
        "{}",
        e.message
    );
    // Nothing was recorded: no barrier is pending and rank 0 can still enter #1.
    assert!(describe(&s.channel, "badgroup").await.barriers.is_empty());
    assert!(
        RawRelay::attach(&s.channel, "badgroup", 1, 0)
            .await
            .is_err(),
        "a second relay for node 0"
    );
    assert!(
        RawRelay::attach(&s.channel, "badgroup", 1, 5)
            .await
            .is_err(),
        "a relay for a node outside"
    );
}

#[tokio::test]
async fn divergence_inside_a_group_errors_everyone() {
    let s = start_default().await;
    form(&s.channel, "gdiv", 2, 2).await;
    let mut ranks = attach_all(&s.channel, "gdiv", 1, 4).await;
    let mut relay = RawRelay::attach(&s.channel, "gdiv", 1, 0).await.unwrap();
    ranks[2].enter(Global, "a.rs:1", 0).await;
    relay
        .enter(1, &[("a.rs:1", &[0]), ("b.rs:2", &[1])], 0)
        .await;
    let e = relay.result(1).await.unwrap();
    assert_eq!(e.kind, Kind::Diverged as i32);
    assert!(
        e.message.contains("[a.rs:1: ranks 2,0]") && e.message.contains("[b.rs:2: ranks 1]"),
        "{}",
        e.message
    );
    let e = ranks[2].result().await.unwrap();
    assert_eq!(e.kind, Kind::Diverged as i32);
    // The late rank gets the same verdict.
    ranks[3].enter(Global, "a.rs:1", 0).await;
    assert_eq!(ranks[3].result().await.unwrap().kind, Kind::Diverged as i32);
}

#[tokio::test]
async fn a_group_timeout_withdraws_the_group_which_may_retry() {
    let s = start_default().await;
    form(&s.channel, "gto", 2, 2).await;
    let mut ranks = attach_all(&s.channel, "gto", 1, 4).await;
    let mut relay = RawRelay::attach(&s.channel, "gto", 1, 0).await.unwrap();
    relay.enter(1, &[("b", &[0, 1])], 200).await;
    let e = relay.result(1).await.unwrap();
    assert_eq!(e.kind, Kind::Timeout as i32);
    assert_eq!(
        e.missing.iter().map(|m| m.rank()).collect::<Vec<_>>(),
        [2, 3]
    );
    assert!(e.message.contains("ranks 0..=1 (node 0)"), "{}", e.message);
    relay.enter(1, &[("b", &[0, 1])], 0).await;
    for r in ranks.iter_mut().skip(2) {
        r.enter(Global, "b", 0).await;
    }
    assert_eq!(relay.result(1).await, None);
    for r in ranks.iter_mut().skip(2) {
        assert_eq!(r.result().await, None);
    }
}

#[tokio::test]
async fn relays_hear_of_a_failure_at_once_even_with_nothing_pending() {
    let s = start_default().await;
    form(&s.channel, "gfail", 2, 2).await;
    let mut ranks = attach_all(&s.channel, "gfail", 1, 4).await;
    let mut relay0 = RawRelay::attach(&s.channel, "gfail", 1, 0).await.unwrap();
    let mut relay1 = RawRelay::attach(&s.channel, "gfail", 1, 1).await.unwrap();
    relay0.enter(1, &[("b", &[0, 1])], 0).await;
    tokio::time::sleep(Duration::from_millis(50)).await;
    let t = Instant::now();
    ranks.pop().unwrap().kill();
    // Node 0's pending group fails, and both relays get the failure event.
    let e = relay0.result(1).await.unwrap();
    assert_eq!((e.kind, e.rank), (Kind::RankFailed as i32, 3));
    for relay in [&mut relay0, &mut relay1] {
        match relay.event().await {
            pb::relay_event::Kind::Failed(e) => {
                assert!(e.message.contains("rank 3 (node 1"), "{}", e.message)
            }
            other => panic!("expected failed, got {other:?}"),
        }
    }
    assert!(t.elapsed() < Duration::from_secs(2));
    // A relay registering after the failure hears of it straight away.
    drop(relay0);
    tokio::time::sleep(Duration::from_millis(100)).await;
    let mut late = RawRelay::attach(&s.channel, "gfail", 1, 0).await.unwrap();
    assert!(matches!(
        late.event().await,
        pb::relay_event::Kind::Failed(_)
    ));
}

#[tokio::test]
async fn waits_a_relay_holds_show_in_the_ops_view_until_cleared() {
    let s = start_default().await;
    form(&s.channel, "held", 2, 2).await;
    let _ranks = attach_all(&s.channel, "held", 1, 4).await;
    let relay = RawRelay::attach(&s.channel, "held", 1, 1).await.unwrap();
    let held = pb::BarrierInfo {
        scope: pb::BarrierScope::Node as i32,
        node_rank: Some(1),
        seq: 4,
        names: vec![pb::BarrierName {
            name: "eval.rs:12".into(),
            ranks: vec![2, 0],
        }],
        missing: vec![pb::RankLocation {
            rank: Some(3),
            node_rank: Some(1),
            host: "host-n1".into(),
        }],
        waiting_ms: 1500,
        missing_detail: vec![],
    };
    relay.report(vec![held]).await;
    let mut d = describe(&s.channel, "held").await;
    for _ in 0..50 {
        if !d.barriers.is_empty() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
        d = describe(&s.channel, "held").await;
    }
    let b = &d.barriers[0];
    assert_eq!(
        (b.scope, b.node_rank, b.seq),
        (pb::BarrierScope::Node as i32, Some(1), 4)
    );
    assert_eq!(
        b.names[0].ranks,
        [2],
        "rank 0 is not on node 1 and must be dropped"
    );
    assert_eq!(b.missing[0].rank, Some(3));
    assert_eq!(b.missing_detail[0].rank, Some(3));
    assert!(
        b.missing_detail[0]
            .activity
            .starts_with("running outside barriers"),
        "{:?}",
        b.missing_detail[0]
    );
    assert!(d.ranks[2].activity.contains("relay"), "{:?}", d.ranks[2]);
    assert!(b.waiting_ms >= 1500);
    assert_eq!(d.ranks[2].state, pb::RankState::Waiting as i32);
    assert_eq!(d.ranks[3].state, pb::RankState::Running as i32);
    relay.report(vec![]).await;
    for _ in 0..50 {
        if describe(&s.channel, "held").await.barriers.is_empty() {
            return;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    panic!("an empty report did not clear the held waits");
}

/// Ranks registered through their node's relay need no session of their own (issue 29): each
/// is answered on the relay, refused there when it is not the node's or is already
/// registered, meets the others in relayed barriers, shows in `DescribeJob` with its pid and
/// host, hears the generation's failure as a `RankEvent`, and may leave.
#[tokio::test]
async fn ranks_registered_through_their_relay_need_no_sessions() {
    let s = start_default().await;
    let ch = &s.channel;
    form(ch, "relayed", 2, 2).await;
    let mut relays = vec![
        RawRelay::attach(ch, "relayed", 1, 0).await.unwrap(),
        RawRelay::attach(ch, "relayed", 1, 1).await.unwrap(),
    ];
    for rank in 0..4 {
        let event = relays[rank as usize / 2]
            .register_rank("relayed", 1, rank)
            .await;
        let Some(pb::rank_event::Kind::Message(pb::CoordinatorMessage {
            kind: Some(pb::coordinator_message::Kind::Registered(r)),
        })) = event.kind
        else {
            panic!("rank {rank}: {event:?}");
        };
        assert_eq!((r.world_size, r.node_rank, r.num_nodes), (4, rank / 2, 2));
    }
    // Another node's rank, a rank registered twice, a rank outside the world, another job.
    for (rank, code, needle) in [
        (
            2,
            tonic::Code::InvalidArgument,
            "is on node 1, not on node 0",
        ),
        (1, tonic::Code::AlreadyExists, "already registered"),
        (9, tonic::Code::InvalidArgument, "outside"),
    ] {
        let event = relays[0].register_rank("relayed", 1, rank).await;
        let Some(pb::rank_event::Kind::Refused(refused)) = event.kind else {
            panic!("rank {rank}: {event:?}");
        };
        assert_eq!(refused.code, code as i32, "{}", refused.message);
        assert!(refused.message.contains(needle), "{}", refused.message);
    }
    let event = relays[0].register_rank("other", 1, 0).await;
    assert!(
        matches!(&event.kind, Some(pb::rank_event::Kind::Refused(r)) if r.message.contains("through the relay of job 'relayed'")),
        "{event:?}"
    );
    // A relayed barrier of ranks that have no session.
    for seq in 1..=3 {
        relays[0].enter(seq, &[("step", &[0, 1])], 0).await;
        relays[1].enter(seq, &[("step", &[2, 3])], 0).await;
        for relay in &mut relays {
            assert_eq!(relay.result(seq).await, None, "seq {seq}");
        }
    }
    let d = describe(ch, "relayed").await;
    for rank in &d.ranks {
        let r = rank.rank.unwrap();
        assert_eq!(
            (rank.pid, rank.host.as_str()),
            (100 + r, format!("host-{r}").as_str())
        );
        assert_eq!(rank.global_seq, 3);
    }
    // Rank 1 leaves; rank 3's agent reports its exit: node 0's relay hears the failure for the
    // generation and for its live rank 0, naming rank 3.
    relays[0].leave_rank(1).await;
    pb::rendezvous_client::RendezvousClient::new(ch.clone())
        .report_failure(pb::ReportFailureRequest {
            job_id: "relayed".into(),
            generation: 1,
            rank: 3,
            reason: "exited with status 3".into(),
            exit_code: Some(3),
            ..Default::default()
        })
        .await
        .unwrap();
    let (mut failed, mut pushed) = (None, vec![]);
    while failed.is_none() || pushed.is_empty() {
        match relays[0].event().await {
            pb::relay_event::Kind::Failed(e) => failed = Some(e),
            pb::relay_event::Kind::Rank(pb::RankEvent {
                rank,
                kind:
                    Some(pb::rank_event::Kind::Message(pb::CoordinatorMessage {
                        kind: Some(pb::coordinator_message::Kind::GenerationFailed(e)),
                    })),
            }) => pushed.push((rank, e)),
            other => panic!("{other:?}"),
        }
    }
    assert_eq!(failed.unwrap().rank, 3);
    assert_eq!(pushed.len(), 1, "only rank 0 is live on node 0: {pushed:?}");
    assert_eq!(pushed[0].0, 0);
    assert!(pushed[0].1.message.contains("rank 3"), "{:?}", pushed[0]);
}

/// A node's relay stream that breaks and comes back to the same leader (no failover) takes
/// its ranks back: each registers again with `resume` and gets its pushes on the new stream,
/// while a registration without `resume` is still refused, and so is a rank that had a
/// session of its own.
#[tokio::test]
async fn a_relay_back_on_the_same_leader_takes_its_ranks_back() {
    let s = start_default().await;
    let ch = &s.channel;
    form(ch, "back", 1, 3).await;
    let mut first = RawRelay::attach(ch, "back", 1, 0).await.unwrap();
    for rank in 0..2 {
        let event = first.register_rank("back", 1, rank).await;
        assert!(
            matches!(event.kind, Some(pb::rank_event::Kind::Message(_))),
            "{event:?}"
        );
    }
    let _session = Raw::attach(ch, "back", 1, 2).await.unwrap();
    drop(first);
    // The coordinator notices the old stream's end in its own time.
    let resumed = pb::RelayRegister {
        job_id: "back".into(),
        generation: 1,
        node_rank: 0,
        resume: true,
        released: 0,
        node_id: String::new(),
    };
    let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
    let mut relay = loop {
        match RawRelay::attach_with(ch, resumed.clone()).await {
            Ok(relay) => break relay,
            Err(status) if status.code() == tonic::Code::AlreadyExists => {
                assert!(tokio::time::Instant::now() < deadline, "{status:?}");
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
            Err(status) => panic!("{status:?}"),
        }
    };
    let register = |rank: u32, resume: bool| pb::Register {
        job_id: "back".into(),
        generation: 1,
        rank,
        pid: 100 + rank,
        host: format!("host-{rank}"),
        resume,
        ..Default::default()
    };
    // Without resume, and a rank with a session of its own: refused, nothing changes.
    for (rank, resume) in [(0, false), (2, true)] {
        let event = relay.register_rank_with(register(rank, resume)).await;
        assert!(
            matches!(&event.kind, Some(pb::rank_event::Kind::Refused(r)) if r.code == tonic::Code::AlreadyExists as i32),
            "rank {rank}: {event:?}"
        );
    }
    for rank in 0..2 {
        let event = relay.register_rank_with(register(rank, true)).await;
        assert!(
            matches!(
                &event.kind,
                Some(pb::rank_event::Kind::Message(pb::CoordinatorMessage {
                    kind: Some(pb::coordinator_message::Kind::Registered(_))
                }))
            ),
            "rank {rank}: {event:?}"
        );
    }
    // Rank 2 fails: rank 0 and 1 hear it on the new stream.
    pb::rendezvous_client::RendezvousClient::new(ch.clone())
        .report_failure(pb::ReportFailureRequest {
            job_id: "back".into(),
            generation: 1,
            rank: 2,
            reason: "exited with status 1".into(),
            exit_code: Some(1),
            ..Default::default()
        })
        .await
        .unwrap();
    let mut pushed = vec![];
    while pushed.len() < 2 {
        match relay.event().await {
            pb::relay_event::Kind::Failed(_) => {}
            pb::relay_event::Kind::Rank(pb::RankEvent {
                rank,
                kind:
                    Some(pb::rank_event::Kind::Message(pb::CoordinatorMessage {
                        kind: Some(pb::coordinator_message::Kind::GenerationFailed(e)),
                    })),
            }) => {
                assert!(e.message.contains("rank 2"), "{e:?}");
                pushed.push(rank);
            }
            other => panic!("{other:?}"),
        }
    }
    pushed.sort_unstable();
    assert_eq!(pushed, [0, 1]);
}

/// `rank_lost` (an agent's gateway that lost a worker's session) fails the rank with a first
/// reason, which the agent's report of the exit refines; in the other order the report's
/// reason stands. Another node's rank, or an empty reason, is refused and changes nothing.
#[tokio::test]
async fn a_lost_rank_fails_its_generation_and_its_agents_report_refines_it() {
    let s = start_default().await;
    let ch = &s.channel;
    let reason = |job: &'static str| async move {
        describe(ch, job)
            .await
            .failure
            .map(|f| f.reason)
            .unwrap_or_default()
    };
    let report = |job: &'static str| async move {
        pb::rendezvous_client::RendezvousClient::new(ch.clone())
            .report_failure(pb::ReportFailureRequest {
                job_id: job.into(),
                generation: 1,
                rank: 1,
                reason: "exited with status 3".into(),
                exit_code: Some(3),
                ..Default::default()
            })
            .await
            .unwrap();
    };
    for (job, report_first) in [("lost-first", false), ("report-first", true)] {
        form(ch, job, 2, 2).await;
        let mut relay = RawRelay::attach(ch, job, 1, 0).await.unwrap();
        for rank in 0..2 {
            relay.register_rank(job, 1, rank).await;
        }
        for (rank, why, needle) in [(2, "gone", "not on node 0"), (1, "", "must not be empty")] {
            relay.lose_rank(rank, why).await;
            let event = match relay.event().await {
                pb::relay_event::Kind::Rank(event) => event,
                other => panic!("{other:?}"),
            };
            assert!(
                matches!(&event.kind, Some(pb::rank_event::Kind::Refused(r)) if r.message.contains(needle)),
                "{event:?}"
            );
        }
        assert_eq!(reason(job).await, "", "{job}: a refusal changes nothing");
        if report_first {
            report(job).await;
        }
        relay.lose_rank(1, muster_core::failure::SESSION_LOST).await;
        match relay.event().await {
            pb::relay_event::Kind::Failed(e) => assert_eq!(e.rank, 1, "{e:?}"),
            other => panic!("{other:?}"),
        }
        if !report_first {
            assert_eq!(reason(job).await, muster_core::failure::SESSION_LOST);
            report(job).await;
        }
        assert_eq!(reason(job).await, "exited with status 3", "{job}");
    }
}

/// A thousand workers on one node (issue 29's light clients: its relay registers them all)
/// under a per-peer cap of 4 connections: one stream holds them, so no connection limit is in
/// the way, and a barrier of all of them completes.
#[tokio::test]
async fn a_thousand_ranks_on_one_node_need_one_stream() {
    let s = start(muster_coordinator::Config {
        max_connections_per_peer: 4,
        ..muster_coordinator::Config::default()
    })
    .await;
    let ch = &s.channel;
    form(ch, "wide", 1, 1000).await;
    let mut relay = RawRelay::attach(ch, "wide", 1, 0).await.unwrap();
    for rank in 0..1000 {
        let event = relay.register_rank("wide", 1, rank).await;
        assert!(
            matches!(event.kind, Some(pb::rank_event::Kind::Message(_))),
            "rank {rank}: {event:?}"
        );
    }
    let all: Vec<u32> = (0..1000).collect();
    relay.enter(1, &[("wide", &all)], 0).await;
    assert_eq!(relay.result(1).await, None);
    let d = describe(ch, "wide").await;
    assert_eq!(d.ranks.len(), 1000);
    assert!(
        d.ranks
            .iter()
            .all(|r| r.pid == 100 + r.rank.unwrap() && r.global_seq == 1)
    );
}
