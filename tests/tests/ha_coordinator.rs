//! Coordinator replicas over a real etcd, driven at the wire level: followers refuse naming
//! the leader and report NOT_SERVING; a standby (and then a restarted replica) takes over a
//! running job with the same generation, ranks and unique id, a retried join gets the same
//! place, barriers caught in a failover complete exactly once; a leader paused past its lease
//! writes nothing when it wakes and steps down. Skips (printing why) without etcd.
#![allow(clippy::unwrap_used, missing_docs)]

use muster_proto::v1 as pb;
use muster_tests::coordinator::Coordinator;
use muster_tests::etcd::Etcd;
use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;
use std::time::{Duration, Instant};
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::transport::Channel;
use tonic::{Code, Streaming};
use tonic_health::pb::health_check_response::ServingStatus;
use tonic_health::pb::{HealthCheckRequest, health_client::HealthClient};

const TTL_MS: u64 = 2000;

fn replica(etcd: &Etcd, prefix: &str) -> Coordinator {
    Coordinator::start(&[
        "--store",
        "etcd",
        "--etcd-endpoints",
        &etcd.endpoints_arg(),
        "--etcd-prefix",
        prefix,
        "--lease-ttl-ms",
        &TTL_MS.to_string(),
        "--heartbeat-timeout-ms",
        "5000",
    ])
}

async fn channel(addr: &str) -> Channel {
    let endpoint = Channel::from_shared(format!("http://{addr}")).unwrap();
    for _ in 0..200 {
        if let Ok(c) = endpoint.connect().await {
            return c;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    panic!("coordinator at {addr} did not come up");
}

async fn health(ch: &Channel, service: &str) -> Option<ServingStatus> {
    let r = HealthClient::new(ch.clone())
        .check(HealthCheckRequest {
            service: service.into(),
        })
        .await
        .ok()?;
    ServingStatus::try_from(r.into_inner().status).ok()
}

/// Waits until one of `replicas` reports SERVING; returns its index.
async fn leader(replicas: &[&Coordinator], limit: Duration) -> usize {
    let t = Instant::now();
    loop {
        for (i, r) in replicas.iter().enumerate() {
            let endpoint = Channel::from_shared(format!("http://{}", r.addr)).unwrap();
            if let Ok(ch) = endpoint.connect().await
                && health(&ch, "").await == Some(ServingStatus::Serving)
            {
                return i;
            }
        }
        assert!(t.elapsed() < limit, "no leader within {limit:?}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

fn join_req(job: &str, node: u32, request_id: &str) -> pb::JoinRequest {
    pb::JoinRequest {
        job_id: job.into(),
        node_id: format!("n{node}"),
        host: format!("host-{node}"),
        local_world_size: 2,
        requested_node_rank: Some(node),
        config: Some(pb::RendezvousConfig {
            min_nodes: 2,
            max_nodes: 2,
            last_call_ms: 0,
            join_timeout_ms: 60_000,
            max_restarts: None,
            recovery: 0,
            ..Default::default()
        }),
        request_id: request_id.into(),
        watches: false,
        spare: false,
    }
}

async fn join(ch: &Channel, job: &str, node: u32, request_id: &str) -> pb::JoinResponse {
    pb::rendezvous_client::RendezvousClient::new(ch.clone())
        .join(join_req(job, node, request_id))
        .await
        .unwrap()
        .into_inner()
}

/// One rank's session at the wire level.
struct Rank {
    tx: mpsc::Sender<pb::WorkerMessage>,
    rx: Streaming<pb::CoordinatorMessage>,
}

fn worker(kind: pb::worker_message::Kind) -> pb::WorkerMessage {
    pb::WorkerMessage { kind: Some(kind) }
}

impl Rank {
    async fn attach(
        ch: &Channel,
        job: &str,
        generation: u64,
        rank: u32,
        resume: Option<u64>,
    ) -> Self {
        let (tx, rx) = mpsc::channel(16);
        tx.send(worker(pb::worker_message::Kind::Register(pb::Register {
            job_id: job.into(),
            generation,
            rank,
            pid: 100 + rank,
            host: "127.0.0.1".into(),
            resume: resume.is_some(),
            released_global: resume.unwrap_or(0),
            released_node: 0,
            replacement: false,
            epoch: 0,
        })))
        .await
        .unwrap();
        let mut rx = pb::session_client::SessionClient::new(ch.clone())
            .attach(ReceiverStream::new(rx))
            .await
            .unwrap()
            .into_inner();
        match rx.message().await.unwrap().unwrap().kind {
            Some(pb::coordinator_message::Kind::Registered(r)) => assert_eq!(r.world_size, 4),
            other => panic!("expected registered, got {other:?}"),
        }
        Self { tx, rx }
    }

    async fn enter(&self, seq: u64) {
        self.tx
            .send(worker(pb::worker_message::Kind::Barrier(
                pb::BarrierEnter {
                    scope: pb::BarrierScope::Global as i32,
                    seq,
                    name: "loop".into(),
                    timeout_ms: 0,
                    trace_context: Default::default(),
                },
            )))
            .await
            .unwrap();
    }

    /// The next barrier result: its seq and error.
    async fn result(&mut self) -> (u64, Option<pb::BarrierError>) {
        let m = tokio::time::timeout(Duration::from_secs(10), self.rx.message())
            .await
            .expect("a barrier result within 10 s")
            .unwrap()
            .unwrap();
        match m.kind {
            Some(pb::coordinator_message::Kind::Barrier(b)) => (b.seq, b.error),
            other => panic!("expected a barrier result, got {other:?}"),
        }
    }

    async fn no_result_within(&mut self, d: Duration) {
        if let Ok(m) = tokio::time::timeout(d, self.rx.message()).await {
            panic!("unexpected message: {m:?}");
        }
    }
}

async fn unique_id(ch: &Channel, job: &str, generation: u64) -> Vec<u8> {
    pb::unique_ids_client::UniqueIdsClient::new(ch.clone())
        .fetch(pb::FetchUniqueIdRequest {
            job_id: job.into(),
            generation,
            rank: 3,
            communicator: "world".into(),
            wait_ms: 0,
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner()
        .unique_id
}

async fn kv_get(ch: &Channel, job: &str, key: &str) -> Result<Vec<u8>, tonic::Status> {
    pb::key_value_client::KeyValueClient::new(ch.clone())
        .get(pb::GetRequest {
            job_id: job.into(),
            key: key.into(),
            wait_ms: 0,
        })
        .await
        .map(|r| r.into_inner().value)
}

async fn kv_set(ch: &Channel, job: &str, key: &str, value: &str) -> Result<(), tonic::Status> {
    pb::key_value_client::KeyValueClient::new(ch.clone())
        .set(pb::SetRequest {
            job_id: job.into(),
            key: key.into(),
            value: value.as_bytes().to_vec(),
            ..Default::default()
        })
        .await
        .map(drop)
}

/// Asserts that the replica behind `ch` refuses calls UNAVAILABLE and, once it has seen the
/// leader key (within a second or two of a change), names `leader` in message and metadata.
async fn assert_names_leader(ch: &Channel, leader: &str) {
    let t = Instant::now();
    loop {
        let e = kv_get(ch, "any", "k").await.unwrap_err();
        assert_eq!(e.code(), Code::Unavailable, "{e:?}");
        if let Some(named) = e.metadata().get("muster-leader") {
            assert_eq!(named.to_str().unwrap(), leader);
            assert!(
                e.message().contains(&format!("the leader is {leader}")),
                "{e:?}"
            );
            return;
        }
        assert!(t.elapsed() < Duration::from_secs(3), "{e:?}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

async fn job_summary(ch: &Channel, job: &str) -> pb::JobSummary {
    pb::ops_client::OpsClient::new(ch.clone())
        .list_jobs(pb::ListJobsRequest {})
        .await
        .unwrap()
        .into_inner()
        .jobs
        .into_iter()
        .find(|j| j.job_id == job)
        .expect("the job is known")
}

#[tokio::test]
async fn a_standby_and_a_restarted_replica_take_over_a_running_job() {
    let Some(etcd) = Etcd::start(1) else {
        return;
    };
    let mut replicas = [replica(&etcd, "/ha1/"), replica(&etcd, "/ha1/")];
    let l = leader(&[&replicas[0], &replicas[1]], Duration::from_secs(10)).await;
    let f = 1 - l;
    let lch = channel(&replicas[l].addr).await;
    let fch = channel(&replicas[f].addr).await;

    // The follower refuses, naming the leader, and is NOT_SERVING for every muster service.
    assert_eq!(health(&fch, "").await, Some(ServingStatus::NotServing));
    assert_eq!(
        health(&fch, "muster.v1.Session").await,
        Some(ServingStatus::NotServing)
    );
    assert_eq!(
        health(&lch, "muster.v1.Session").await,
        Some(ServingStatus::Serving)
    );
    assert_names_leader(&fch, &replicas[l].addr).await;

    // A job of 2 nodes x 2 ranks on the leader; barrier 1; a unique id; a key.
    let (a0, a1) = tokio::join!(join(&lch, "ha", 0, "req-0"), join(&lch, "ha", 1, "req-1"));
    let generation = a0.generation;
    assert_eq!((a0.rank_offset, a1.rank_offset), (0, 2));
    let mut ranks = vec![];
    for r in 0..4 {
        ranks.push(Rank::attach(&lch, "ha", generation, r, None).await);
    }
    for r in &ranks {
        r.enter(1).await;
    }
    for r in &mut ranks {
        assert_eq!(r.result().await, (1, None));
    }
    let id: Vec<u8> = (0..128).map(|i| i as u8).collect();
    pb::unique_ids_client::UniqueIdsClient::new(lch.clone())
        .publish(pb::PublishUniqueIdRequest {
            job_id: "ha".into(),
            generation,
            rank: 0,
            communicator: "world".into(),
            unique_id: id.clone(),
            ..Default::default()
        })
        .await
        .unwrap();
    kv_set(&lch, "ha", "k", "v1").await.unwrap();
    // Ranks 0 and 1 are inside barrier 2 when the leader dies.
    ranks[0].enter(2).await;
    ranks[1].enter(2).await;
    tokio::time::sleep(Duration::from_millis(100)).await;

    let t = Instant::now();
    kill(Pid::from_raw(replicas[l].pid() as i32), Signal::SIGKILL).unwrap();
    let now = leader(&[&replicas[f]], Duration::from_millis(TTL_MS + 2000)).await;
    assert_eq!(now, 0);
    let took = t.elapsed();
    eprintln!("standby leads {took:?} after the leader's SIGKILL");
    assert!(took < Duration::from_millis(TTL_MS + 2000), "{took:?}");
    let ch = fch;

    // Same job, generation, places (a retried join gets the same answer), unique id, key.
    let s = job_summary(&ch, "ha").await;
    assert_eq!(
        (s.generation, s.restart_count, s.world_size),
        (generation, 0, 4)
    );
    let again = join(&ch, "ha", 1, "req-1").await;
    assert_eq!(again, a1);
    assert_eq!(unique_id(&ch, "ha", generation).await, id);
    assert_eq!(kv_get(&ch, "ha", "k").await.unwrap(), b"v1");
    assert_eq!(job_summary(&ch, "ha").await.generation, generation);

    // Every rank re-attaches (released from barrier 1); 0 and 1 send barrier 2 again.
    let mut ranks = vec![];
    for r in 0..4 {
        ranks.push(Rank::attach(&ch, "ha", generation, r, Some(1)).await);
    }
    ranks[0].enter(2).await;
    ranks[1].enter(2).await;
    ranks[0].no_result_within(Duration::from_millis(200)).await;
    ranks[2].enter(2).await;
    ranks[3].enter(2).await;
    for r in &mut ranks {
        assert_eq!(r.result().await, (2, None));
    }
    // Barrier 3 completes; then the replica dies again with ranks 0 and 1 "not told".
    for r in &ranks {
        r.enter(3).await;
    }
    for r in &mut ranks {
        assert_eq!(r.result().await, (3, None));
    }
    replicas[l] = replica(&etcd, "/ha1/");
    tokio::time::sleep(Duration::from_millis(300)).await;
    let t = Instant::now();
    kill(Pid::from_raw(replicas[f].pid() as i32), Signal::SIGKILL).unwrap();
    leader(&[&replicas[l]], Duration::from_millis(TTL_MS + 2000)).await;
    eprintln!(
        "restarted replica leads {:?} after the SIGKILL",
        t.elapsed()
    );
    let ch = channel(&replicas[l].addr).await;
    // Ranks 0 and 1 lost barrier 3's answer: they re-attach released from 2 and send 3 again;
    // ranks 2 and 3 got it. Barrier 3 is answered at once to 0 and 1 (it completed), once.
    let mut r0 = Rank::attach(&ch, "ha", generation, 0, Some(2)).await;
    let mut r1 = Rank::attach(&ch, "ha", generation, 1, Some(2)).await;
    r0.enter(3).await;
    r1.enter(3).await;
    r0.no_result_within(Duration::from_millis(200)).await;
    let mut r2 = Rank::attach(&ch, "ha", generation, 2, Some(3)).await;
    assert_eq!(r0.result().await, (3, None));
    assert_eq!(r1.result().await, (3, None));
    let mut r3 = Rank::attach(&ch, "ha", generation, 3, Some(3)).await;
    // And barrier 4 is an ordinary one.
    for r in [&r0, &r1, &r2, &r3] {
        r.enter(4).await;
    }
    for r in [&mut r0, &mut r1, &mut r2, &mut r3] {
        assert_eq!(r.result().await, (4, None));
    }
    assert_eq!(unique_id(&ch, "ha", generation).await, id);
    let s = job_summary(&ch, "ha").await;
    assert_eq!((s.generation, s.restart_count), (generation, 0));
}

#[tokio::test]
async fn a_leader_paused_past_its_lease_writes_nothing_and_steps_down() {
    let Some(etcd) = Etcd::start(1) else {
        return;
    };
    let replicas = [replica(&etcd, "/ha2/"), replica(&etcd, "/ha2/")];
    let l = leader(&[&replicas[0], &replicas[1]], Duration::from_secs(10)).await;
    let f = 1 - l;
    let lch = channel(&replicas[l].addr).await;
    let (a0, _) = tokio::join!(join(&lch, "pause", 0, "a"), join(&lch, "pause", 1, "b"));
    kv_set(&lch, "pause", "k", "before").await.unwrap();

    let pid = Pid::from_raw(replicas[l].pid() as i32);
    kill(pid, Signal::SIGSTOP).unwrap();
    let t = Instant::now();
    leader(&[&replicas[f]], Duration::from_millis(TTL_MS + 3000)).await;
    eprintln!("standby leads {:?} after the leader's SIGSTOP", t.elapsed());
    let fch = channel(&replicas[f].addr).await;
    kv_set(&fch, "pause", "k", "new-leader").await.unwrap();
    tokio::time::sleep(Duration::from_millis(TTL_MS)).await;

    // The old leader wakes and is asked to write at once: refused, and nothing lands.
    kill(pid, Signal::SIGCONT).unwrap();
    let e = kv_set(&lch, "pause", "k", "old-leader").await.unwrap_err();
    assert_eq!(e.code(), Code::Unavailable, "{e:?}");
    eprintln!("the woken leader answered: {}", e.message());
    assert_eq!(kv_get(&fch, "pause", "k").await.unwrap(), b"new-leader");
    // It steps down: NOT_SERVING, and it names the new leader.
    let t = Instant::now();
    while health(&lch, "").await != Some(ServingStatus::NotServing) {
        assert!(
            t.elapsed() < Duration::from_secs(2),
            "the old leader still serves"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_names_leader(&lch, &replicas[f].addr).await;
    // The job is intact at the new leader.
    let s = job_summary(&fch, "pause").await;
    assert_eq!((s.generation, s.world_size), (a0.generation, 4));
}

#[tokio::test]
async fn every_store_write_is_fenced_by_the_leader_key() {
    use muster_coordinator::config::EtcdConfig;
    use muster_coordinator::election::etcd_client::{Compare, CompareOp};
    use muster_coordinator::{EtcdStore, Store};
    let Some(etcd) = Etcd::start(1) else {
        return;
    };
    let store = EtcdStore::connect(&EtcdConfig {
        endpoints: etcd.endpoints(),
        prefix: Some("/fence/".into()),
        ..EtcdConfig::default()
    })
    .await
    .unwrap();
    store.put("records/j", b"kept".to_vec()).await.unwrap();
    let mut client = store.client();
    let leader = client
        .put("/fence/election/leader", "me", None)
        .await
        .unwrap();
    let token = leader.header().unwrap().revision();
    // The current term's fence: writes land.
    let fence = |t| Compare::create_revision("/fence/election/leader", CompareOp::Equal, t);
    store.set_fence(Some(fence(token)));
    store.put("records/j", b"term-1".to_vec()).await.unwrap();
    assert_eq!(store.create("jobs/j/x", b"1".to_vec()).await.unwrap(), None);
    let pair = |v: &[u8]| {
        vec![
            ("jobs/j/kv/n".to_owned(), Some(v.to_vec())),
            ("jobs/j/applied/lane".to_owned(), Some(v.to_vec())),
        ]
    };
    store.write_all(pair(b"1")).await.unwrap();
    // A new term (the key re-created): every kind of write of the old term is refused and
    // changes nothing.
    client.delete("/fence/election/leader", None).await.unwrap();
    client
        .put("/fence/election/leader", "other", None)
        .await
        .unwrap();
    let refused = [
        store.put("records/j", b"stale".to_vec()).await.err(),
        store.create("jobs/j/y", b"1".to_vec()).await.err(),
        store.delete("jobs/j/x").await.err(),
        store.delete_prefix("jobs/").await.err(),
        // A value and its lane record: neither is written.
        store.write_all(pair(b"stale")).await.err(),
    ];
    for e in refused {
        let e = e.expect("a stale term's write is refused");
        assert!(e.0.contains("no longer the leader"), "{e}");
    }
    assert_eq!(
        store.get("records/j").await.unwrap(),
        Some(b"term-1".to_vec())
    );
    assert_eq!(store.get("jobs/j/x").await.unwrap(), Some(b"1".to_vec()));
    assert_eq!(store.get("jobs/j/y").await.unwrap(), None);
    for (key, _) in pair(b"") {
        assert_eq!(store.get(&key).await.unwrap(), Some(b"1".to_vec()), "{key}");
    }
}

#[tokio::test]
async fn a_rank_that_does_not_reattach_after_a_failover_fails_the_generation() {
    let Some(etcd) = Etcd::start(1) else {
        return;
    };
    let replicas = [replica(&etcd, "/ha3/"), replica(&etcd, "/ha3/")];
    let l = leader(&[&replicas[0], &replicas[1]], Duration::from_secs(10)).await;
    let f = 1 - l;
    let lch = channel(&replicas[l].addr).await;
    let (a0, _) = tokio::join!(join(&lch, "gone", 0, "a"), join(&lch, "gone", 1, "b"));
    let generation = a0.generation;
    let mut ranks = vec![];
    for r in 0..4 {
        ranks.push(Rank::attach(&lch, "gone", generation, r, None).await);
    }
    // Wait for the "first session" records to land, then kill the leader (the sessions
    // still open: their ends must not count).
    tokio::time::sleep(Duration::from_millis(300)).await;
    kill(Pid::from_raw(replicas[l].pid() as i32), Signal::SIGKILL).unwrap();
    drop(ranks);
    leader(&[&replicas[f]], Duration::from_millis(TTL_MS + 2000)).await;
    let t = Instant::now();
    let ch = channel(&replicas[f].addr).await;
    // Ranks 0..=2 come back; rank 3 died while no one led.
    let mut back = vec![];
    for r in 0..3 {
        back.push(Rank::attach(&ch, "gone", generation, r, Some(0)).await);
    }
    back[0].enter(1).await;
    let (seq, error) = back[0].result().await;
    let error = error.expect("the barrier fails");
    eprintln!("after {:?}: {}", t.elapsed(), error.message);
    assert_eq!((seq, error.rank), (1, 3));
    assert!(
        error.message.contains("did not re-attach"),
        "{}",
        error.message
    );
    // Within the heartbeat timeout (5 s here) and a margin, not after a fixed long wait.
    assert!(t.elapsed() < Duration::from_secs(7), "{:?}", t.elapsed());
}
