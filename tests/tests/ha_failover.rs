//! High availability end to end (issue 5): coordinator replicas on a real etcd
//! (`muster_tests::replicas`), lightweight ranks (tasks with the SDK's `Session` and `Kv`)
//! looping on global barriers and key-value calls while the leader is SIGKILLed or SIGSTOPped,
//! a single coordinator is restarted, or etcd itself goes away; and `muster-agent launch`
//! running the `barrier_loop` example through a leader's death. Every test skips, printing
//! why, where etcd is not installed.
//!
//! The tests run one at a time (a lock in this file): each starts etcd, several coordinators
//! and up to 32 ranks, and the failover deadlines they check would not hold on a 2-core
//! machine running several of them at once.
#![allow(clippy::unwrap_used, missing_docs)]

use muster::client::{Coordinator, Kv, Scope, Session, SessionConfig, UniqueIds};
use muster_proto::NCCL_UNIQUE_ID_BYTES;
use muster_proto::v1 as pb;
use muster_tests::etcd::Etcd;
use muster_tests::replicas::{Health, Replicas};
use muster_tests::{Agent, Stream, example_bin};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};
use tonic::Code;
use tonic::transport::Channel;

/// The election lease TTL of every test (etcd's smallest practical TTL is 2 s).
const TTL: Duration = Duration::from_secs(2);
/// How long after the leader's death a standby must lead (the bound).
const TAKEOVER: Duration = Duration::from_secs(4);
/// The barrier name every rank uses.
const BARRIER: &str = "ha-loop";
/// The unique id's communicator name.
const COMMUNICATOR: &str = "world";
/// Barriers every rank completes after the failover before the loop ends.
const AFTER: u64 = 15;

/// One HA test at a time (see the module comment).
static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

// ------------------------------------------------------------------------------------------
// A job of lightweight ranks.
// ------------------------------------------------------------------------------------------

/// A formed generation: what each node asked and was answered.
struct Job {
    id: String,
    generation: u64,
    world: u32,
    requests: Vec<pb::JoinRequest>,
    answers: Vec<pb::JoinResponse>,
}

async fn channel(addr: &str) -> Channel {
    Channel::from_shared(format!("http://{addr}"))
        .unwrap()
        .connect_timeout(Duration::from_secs(2))
        .connect()
        .await
        .unwrap_or_else(|e| panic!("cannot connect to {addr}: {e}"))
}

/// Forms job `id` at the leader `addr`: `nodes` nodes of `local` ranks, each join with a
/// request id of its own.
async fn form(addr: &str, id: &str, nodes: u32, local: u32) -> Job {
    let ch = channel(addr).await;
    let requests: Vec<pb::JoinRequest> = (0..nodes)
        .map(|n| pb::JoinRequest {
            job_id: id.into(),
            node_id: format!("node-{n}"),
            host: "127.0.0.1".into(),
            local_world_size: local,
            requested_node_rank: Some(n),
            config: Some(pb::RendezvousConfig {
                min_nodes: nodes,
                max_nodes: nodes,
                last_call_ms: 0,
                join_timeout_ms: 60_000,
                max_restarts: None,
                recovery: 0,
                ..Default::default()
            }),
            request_id: format!("{id}-{n}-{}-{:?}", std::process::id(), Instant::now()),
            watches: false,
            spare: false,
        })
        .collect();
    let joins: Vec<_> = requests
        .iter()
        .map(|r| {
            let mut client = pb::rendezvous_client::RendezvousClient::new(ch.clone());
            let r = r.clone();
            // As the agent does: a join refused UNAVAILABLE (the coordinator lost its term
            // between the health check and the join, which a starved 2-core machine can
            // cause at TTL 2 s) is sent again with the same request id.
            tokio::spawn(async move {
                let t = Instant::now();
                loop {
                    match client.join(r.clone()).await {
                        Err(e)
                            if e.code() == tonic::Code::Unavailable
                                && t.elapsed() < Duration::from_secs(15) =>
                        {
                            eprintln!("join retried: {}", e.message());
                            tokio::time::sleep(Duration::from_millis(100)).await;
                        }
                        other => return other,
                    }
                }
            })
        })
        .collect();
    let mut answers = Vec::new();
    for j in joins {
        answers.push(j.await.unwrap().expect("join").into_inner());
    }
    answers.sort_by_key(|a| a.node_rank);
    let generation = answers[0].generation;
    assert!(answers.iter().all(|a| a.generation == generation));
    Job {
        id: id.into(),
        generation,
        world: nodes * local,
        requests,
        answers,
    }
}

/// The shared state of the rank loops.
struct Loop {
    /// The last barrier seq each rank completed.
    progress: Vec<AtomicU64>,
    /// Ranks stop before entering a barrier past this seq (`u64::MAX` until the test says).
    target: AtomicU64,
    /// When the test killed something (for the first-barrier-after measurement), as
    /// microseconds since `epoch`; 0 before.
    fault_us: AtomicU64,
    /// The first barrier completion after the fault, in microseconds since `epoch`.
    first_after_us: AtomicU64,
    epoch: Instant,
}

impl Loop {
    fn new(world: u32) -> Arc<Self> {
        Arc::new(Self {
            progress: (0..world).map(|_| AtomicU64::new(0)).collect(),
            target: AtomicU64::new(u64::MAX),
            fault_us: AtomicU64::new(0),
            first_after_us: AtomicU64::new(u64::MAX),
            epoch: Instant::now(),
        })
    }

    fn now_us(&self) -> u64 {
        u64::try_from(self.epoch.elapsed().as_micros()).unwrap_or(u64::MAX)
    }

    fn min(&self) -> u64 {
        self.progress
            .iter()
            .map(|p| p.load(Ordering::SeqCst))
            .min()
            .unwrap_or(0)
    }

    fn max(&self) -> u64 {
        self.progress
            .iter()
            .map(|p| p.load(Ordering::SeqCst))
            .max()
            .unwrap_or(0)
    }

    fn mark_fault(&self) {
        self.fault_us.store(self.now_us().max(1), Ordering::SeqCst);
    }

    /// From the fault to the first barrier that completed after it.
    fn first_after(&self) -> Option<Duration> {
        let fault = self.fault_us.load(Ordering::SeqCst);
        let first = self.first_after_us.load(Ordering::SeqCst);
        (fault > 0 && first != u64::MAX).then(|| Duration::from_micros(first - fault))
    }

    /// Waits until every rank completed barrier `seq`; panics with `context()` after
    /// `timeout`.
    async fn wait_all(&self, seq: u64, timeout: Duration, context: impl Fn() -> String) {
        let deadline = Instant::now() + timeout;
        while self.min() < seq {
            if Instant::now() >= deadline {
                let progress: Vec<u64> = self
                    .progress
                    .iter()
                    .map(|p| p.load(Ordering::SeqCst))
                    .collect();
                panic!(
                    "the ranks did not all complete barrier {seq} within {timeout:?}; progress per rank: {progress:?}\n{}",
                    context()
                );
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// Lets every rank run `more` barriers past the furthest one, then stop.
    fn finish_after(&self, more: u64) -> u64 {
        let target = self.max() + more;
        self.target.store(target, Ordering::SeqCst);
        target
    }
}

/// What one rank saw.
struct RankReport {
    rank: u32,
    /// Barriers completed (seq 1..=barriers, in order).
    barriers: u64,
    /// The unique id fetched before and after the loop.
    id_before: [u8; NCCL_UNIQUE_ID_BYTES],
    id_after: [u8; NCCL_UNIQUE_ID_BYTES],
    /// The longest barrier.
    slowest: Duration,
    session: Session,
}

/// Attaches every rank of `job` through `addrs` (one SDK `Coordinator` per node, as each
/// node's workers would have), rank 0 publishes `id`, and each rank loops: set its key to the
/// seq, enter global barrier seq, check that the seq advanced by exactly one and that its
/// neighbour's key holds this seq or the next; until the loop's target.
async fn start_ranks(
    addrs: &str,
    job: &Job,
    id: [u8; NCCL_UNIQUE_ID_BYTES],
    state: &Arc<Loop>,
) -> Vec<tokio::task::JoinHandle<Result<RankReport, String>>> {
    let mut sessions = Vec::new();
    for node in &job.answers {
        let coordinator = Coordinator::connect(addrs)
            .await
            .unwrap_or_else(|e| panic!("Coordinator::connect({addrs:?}): {e}"));
        for local in 0..node.local_world_size {
            let rank = node.rank_offset + local;
            let session = Session::attach(
                &coordinator,
                SessionConfig {
                    job_id: job.id.clone(),
                    generation: job.generation,
                    rank,
                    pid: 10_000 + rank,
                    host: "127.0.0.1".into(),
                },
            )
            .await
            .unwrap_or_else(|e| panic!("rank {rank} cannot attach: {e}"));
            sessions.push(session);
        }
    }
    let world = job.world;
    sessions
        .into_iter()
        .map(|session| {
            let state = Arc::clone(state);
            tokio::spawn(rank_loop(session, world, id, state))
        })
        .collect()
}

async fn rank_loop(
    session: Session,
    world: u32,
    id: [u8; NCCL_UNIQUE_ID_BYTES],
    state: Arc<Loop>,
) -> Result<RankReport, String> {
    let rank = session.config().rank;
    let kv: Kv = session.kv();
    let ids: UniqueIds = session.unique_ids();
    if rank == 0 {
        ids.publish(COMMUNICATOR, &id)
            .await
            .map_err(|e| format!("rank 0 cannot publish the unique id: {e}"))?;
    }
    let id_before = ids
        .fetch(COMMUNICATOR, Some(Duration::from_secs(20)))
        .await
        .map_err(|e| format!("rank {rank}: fetching the unique id: {e}"))?;
    let neighbour = format!("rank-{}", (rank + 1) % world);
    let own = format!("rank-{rank}");
    let mut slowest = Duration::ZERO;
    let mut seq = 1;
    while seq <= state.target.load(Ordering::SeqCst) {
        kv.set(&own, seq.to_string())
            .await
            .map_err(|e| format!("rank {rank}: set {own} = {seq}: {e}"))?;
        let next = session.next_seq(Scope::Global);
        if next != seq {
            return Err(format!(
                "rank {rank}: the session's next global seq is {next} before barrier {seq}"
            ));
        }
        let t = Instant::now();
        session
            .barrier(Scope::Global, BARRIER, None)
            .await
            .map_err(|e| format!("rank {rank}: barrier {seq}: {e}"))?;
        slowest = slowest.max(t.elapsed());
        let now = state.now_us();
        if state.fault_us.load(Ordering::SeqCst) > 0 {
            state.first_after_us.fetch_min(now, Ordering::SeqCst);
        }
        let next = session.next_seq(Scope::Global);
        if next != seq + 1 {
            return Err(format!(
                "rank {rank}: barrier {seq} completed but the next seq is {next}"
            ));
        }
        let seen = kv
            .get(&neighbour)
            .await
            .map_err(|e| format!("rank {rank}: get {neighbour}: {e}"))?;
        let seen = seen
            .as_deref()
            .map(|v| String::from_utf8_lossy(v).into_owned());
        let ok = [seq.to_string(), (seq + 1).to_string()];
        if !seen.as_ref().is_some_and(|v| ok.contains(v)) {
            return Err(format!(
                "rank {rank}: after barrier {seq}, {neighbour} = {seen:?} (expected {seq} or {})",
                seq + 1
            ));
        }
        state.progress[rank as usize].store(seq, Ordering::SeqCst);
        seq += 1;
    }
    if let Some(e) = session.failure_watch().failed() {
        return Err(format!("rank {rank}: the failure watch fired: {e}"));
    }
    let id_after = ids
        .fetch(COMMUNICATOR, Some(Duration::from_secs(20)))
        .await
        .map_err(|e| format!("rank {rank}: fetching the unique id again: {e}"))?;
    Ok(RankReport {
        rank,
        barriers: seq - 1,
        id_before,
        id_after,
        slowest,
        session,
    })
}

/// Waits for every rank task (bounded), panicking with the first error and `context()`.
async fn collect(
    tasks: Vec<tokio::task::JoinHandle<Result<RankReport, String>>>,
    timeout: Duration,
    context: impl Fn() -> String,
) -> Vec<RankReport> {
    let deadline = Instant::now() + timeout;
    let mut reports = Vec::new();
    let mut errors = Vec::new();
    for task in tasks {
        match tokio::time::timeout_at(deadline.into(), task).await {
            Ok(Ok(Ok(report))) => reports.push(report),
            Ok(Ok(Err(e))) => errors.push(e),
            Ok(Err(e)) => errors.push(format!("a rank task panicked: {e}")),
            Err(_) => errors.push(format!("a rank did not finish within {timeout:?}")),
        }
    }
    assert!(
        errors.is_empty(),
        "{} rank(s) failed:\n{}\n{}",
        errors.len(),
        errors.join("\n"),
        context()
    );
    reports.sort_by_key(|r| r.rank);
    reports
}

/// A test's unique id: 128 bytes that differ per process.
fn unique_id() -> [u8; NCCL_UNIQUE_ID_BYTES] {
    let seed = u64::from(std::process::id()) ^ 0x9e37_79b9_7f4a_7c15;
    let mut id = [0u8; NCCL_UNIQUE_ID_BYTES];
    let mut x = seed | 1;
    for b in &mut id {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        *b = x.to_le_bytes()[0];
    }
    id
}

/// A unary call on `addr`, retried while it answers UNAVAILABLE (a leader still loading), for
/// at most 10 s.
async fn describe(addr: &str, job: &str) -> pb::DescribeJobResponse {
    let ch = channel(addr).await;
    let mut ops = pb::ops_client::OpsClient::new(ch);
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        match ops
            .describe_job(pb::DescribeJobRequest {
                job_id: job.into(),
                ..Default::default()
            })
            .await
        {
            Ok(r) => return r.into_inner(),
            Err(s) if s.code() == Code::Unavailable && Instant::now() < deadline => {
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            Err(s) => panic!("DescribeJob({job}) at {addr}: {s:?}"),
        }
    }
}

/// Everything that must hold after a fault under a running job, at the leader `addr`: the
/// ranks all ran `barriers` barriers in order with no error and fetched the same unique id
/// before and after; the job keeps its generation, no restart was counted, every rank is
/// registered once on its node and entered exactly `barriers` global barriers; every rank's
/// key holds its last seq; and a join retried with its request id gets its first answer
/// without disturbing the generation.
async fn check_intact(
    addr: &str,
    job: &Job,
    id: [u8; NCCL_UNIQUE_ID_BYTES],
    reports: &[RankReport],
    barriers: u64,
    context: impl Fn() -> String,
) {
    assert_eq!(reports.len(), job.world as usize);
    for r in reports {
        assert_eq!(
            r.barriers, barriers,
            "rank {} ran {} barriers, not {barriers}",
            r.rank, r.barriers
        );
        assert_eq!(r.id_before, id, "rank {}: unique id before", r.rank);
        assert_eq!(r.id_after, id, "rank {}: the unique id changed", r.rank);
    }
    let described = describe(addr, &job.id).await;
    eprintln!(
        "after the fault: {:?}, restart_count {}",
        described.summary, described.restart_count
    );
    let summary = described.summary.clone().unwrap_or_default();
    assert_eq!(
        summary.generation,
        job.generation,
        "the generation changed\n{}",
        context()
    );
    assert_eq!(summary.restart_count, 0, "a restart was counted");
    assert_eq!(described.restart_count, 0, "a restart was counted");
    assert!(!summary.done, "the job is over: {summary:?}");
    assert!(
        described.failure.is_none(),
        "the generation failed: {:?}",
        described.failure
    );
    let mut nodes: Vec<(u32, u32, u32)> = described
        .nodes
        .iter()
        .map(|n| (n.node_rank(), n.rank_offset, n.local_world_size))
        .collect();
    nodes.sort_unstable();
    let expected: Vec<(u32, u32, u32)> = job
        .answers
        .iter()
        .map(|a| (a.node_rank, a.rank_offset, a.local_world_size))
        .collect();
    assert_eq!(nodes, expected, "the nodes' places changed");
    let mut ranks: Vec<u32> = described.ranks.iter().map(pb::RankInfo::rank).collect();
    ranks.sort_unstable();
    assert_eq!(
        ranks,
        (0..job.world).collect::<Vec<_>>(),
        "ranks assigned twice or lost: {:?}",
        described.ranks
    );
    for r in &described.ranks {
        let node = job
            .answers
            .iter()
            .find(|a| (a.rank_offset..a.rank_offset + a.local_world_size).contains(&r.rank()))
            .unwrap();
        assert_eq!(
            r.node_rank(),
            node.node_rank,
            "rank {} moved: {r:?}",
            r.rank()
        );
        assert_eq!(
            r.state,
            pb::RankState::Running as i32,
            "rank {} is not running: {r:?}",
            r.rank()
        );
        assert_eq!(
            r.global_seq,
            barriers,
            "rank {} entered {} global barriers at the coordinator, not {barriers}",
            r.rank(),
            r.global_seq
        );
    }
    // Key-value data: every rank's key holds the last seq it set.
    let kv = Kv::new(Coordinator::connect(addr).await.unwrap(), job.id.clone());
    for rank in 0..job.world {
        let v = kv.get(&format!("rank-{rank}")).await.unwrap();
        assert_eq!(
            v.as_deref(),
            Some(barriers.to_string().as_bytes()),
            "rank-{rank}"
        );
    }
    // A join retried with its request id gets its first answer and changes nothing.
    let ch = channel(addr).await;
    for (request, answer) in job.requests.iter().zip(&job.answers) {
        let mut client = pb::rendezvous_client::RendezvousClient::new(ch.clone());
        let again = tokio::time::timeout(Duration::from_secs(10), client.join(request.clone()))
            .await
            .unwrap_or_else(|_| panic!("retried join of {} hangs", request.node_id))
            .unwrap_or_else(|s| panic!("retried join of {}: {s:?}", request.node_id))
            .into_inner();
        assert_eq!(&again, answer, "a retried join got another answer");
    }
    let after = describe(addr, &job.id).await;
    assert_eq!(
        after.summary.map(|s| s.generation),
        Some(job.generation),
        "retried joins changed the generation"
    );
}

async fn leave_all(reports: Vec<RankReport>) {
    for r in reports {
        let rank = r.rank;
        r.session
            .leave()
            .await
            .unwrap_or_else(|e| panic!("rank {rank} cannot leave: {e}"));
    }
}

// ------------------------------------------------------------------------------------------
// The tests.
// ------------------------------------------------------------------------------------------

/// 32 ranks (8 nodes of 4) on three replicas; the leader is SIGKILLed while they loop.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn leader_sigkill_under_32_ranks_loses_nothing() {
    let _serial = SERIAL.lock().await;
    let Some(etcd) = Etcd::start(1) else { return };
    let started = Instant::now();
    let mut replicas = Replicas::start(&etcd, 3, TTL, &[]);
    let leader = replicas.wait_leader(Duration::from_secs(15), &[]).await;
    eprintln!("replica {leader} leads after {:?}", started.elapsed());
    let job = form(replicas.addr(leader), "ha-kill", 8, 4).await;
    let id = unique_id();
    let state = Loop::new(job.world);
    let tasks = start_ranks(&replicas.addrs(), &job, id, &state).await;
    state
        .wait_all(10, Duration::from_secs(30), || replicas.logs())
        .await;

    let before = state.max();
    state.mark_fault();
    let killed = Instant::now();
    replicas.kill(leader);
    let new = replicas.wait_leader(TAKEOVER + TTL, &[leader]).await;
    let takeover = killed.elapsed();
    eprintln!("replica {new} leads {takeover:?} after the SIGKILL (barrier {before} done)");
    assert!(
        takeover <= TTL + Duration::from_secs(2),
        "the standby led only after {takeover:?} (TTL {TTL:?})"
    );
    state
        .wait_all(before + 3, Duration::from_secs(40), || replicas.logs())
        .await;
    eprintln!(
        "first barrier after the SIGKILL completed after {:?}",
        state.first_after()
    );
    let target = state.finish_after(AFTER);
    let reports = collect(tasks, Duration::from_secs(40), || replicas.logs()).await;
    let slowest = reports.iter().map(|r| r.slowest).max().unwrap_or_default();
    eprintln!("{target} barriers per rank, slowest {slowest:?}");
    check_intact(replicas.addr(new), &job, id, &reports, target, || {
        replicas.logs()
    })
    .await;
    leave_all(reports).await;
    eprintln!("test took {:?}", started.elapsed());
}

/// The leader is SIGSTOPped past its lease and a standby takes over; once resumed, the old
/// leader refuses calls (UNAVAILABLE), reports NOT_SERVING, and neither a write sent to it
/// while it was stopped nor one sent after it resumed lands.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_paused_old_leader_is_fenced_and_steps_down() {
    let _serial = SERIAL.lock().await;
    let Some(etcd) = Etcd::start(1) else { return };
    let mut replicas = Replicas::start(&etcd, 2, TTL, &[]);
    let old = replicas.wait_leader(Duration::from_secs(15), &[]).await;
    let job = form(replicas.addr(old), "ha-stop", 1, 1).await;
    let set = |key: &str, value: &str| pb::SetRequest {
        job_id: job.id.clone(),
        key: key.into(),
        value: value.as_bytes().to_vec(),
        ..Default::default()
    };
    // A connection to the old leader, opened while it leads: a client that has not noticed.
    let mut to_old = pb::key_value_client::KeyValueClient::new(channel(replicas.addr(old)).await);
    to_old.set(set("k", "v0")).await.expect("set at the leader");

    replicas.stop(old);
    let stopped = Instant::now();
    // Sent while it is stopped: it waits in the old leader's socket until it resumes.
    let mut in_flight = to_old.clone();
    let request = set("in-flight", "stale");
    let in_flight = tokio::spawn(async move { in_flight.set(request).await });
    let new = replicas.wait_leader(TAKEOVER + TTL, &[old]).await;
    let takeover = stopped.elapsed();
    eprintln!("replica {new} leads {takeover:?} after the SIGSTOP of replica {old}");
    assert!(
        takeover <= TTL + Duration::from_secs(2),
        "the standby led only after {takeover:?}"
    );
    let kv_new = Kv::new(
        Coordinator::connect(replicas.addr(new)).await.unwrap(),
        job.id.clone(),
    );
    assert_eq!(
        kv_new.get("k").await.unwrap().as_deref(),
        Some(&b"v0"[..]),
        "the new leader lost a write of the old one"
    );
    kv_new.set("k", "v1").await.unwrap();
    // Well past the old lease before resuming.
    tokio::time::sleep(Duration::from_millis(500)).await;

    replicas.cont(old);
    let refused = tokio::time::timeout(Duration::from_secs(10), to_old.set(set("k", "stale")))
        .await
        .expect("the old leader answers after SIGCONT");
    let status = refused.expect_err("the old leader accepted a write after losing its lease");
    eprintln!("old leader's answer: {status:?}");
    assert_eq!(status.code(), Code::Unavailable, "{status:?}");
    if let Some(named) = status.metadata().get("muster-leader") {
        assert_eq!(
            named.to_str().unwrap(),
            replicas.addr(new),
            "the old leader names the wrong leader"
        );
    }
    let in_flight = tokio::time::timeout(Duration::from_secs(10), in_flight)
        .await
        .expect("the write sent during the pause gets an answer")
        .unwrap();
    eprintln!("the write sent during the pause: {in_flight:?}");
    let in_flight = in_flight.expect_err("the old leader applied a write sent while it was paused");

    // It steps down for good: NOT_SERVING (overall and for a leader-only service).
    let deadline = Instant::now() + Duration::from_secs(3);
    loop {
        let overall = replicas.health(old, "").await;
        let kv = replicas.health(old, "muster.v1.KeyValue").await;
        if overall == Health::NotServing && kv == Health::NotServing {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the old leader says {overall:?} / {kv:?}\n{}",
            replicas.logs()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(replicas.health(new, "").await, Health::Serving);
    assert_eq!(
        kv_new.get("k").await.unwrap().as_deref(),
        Some(&b"v1"[..]),
        "a write of the old leader landed"
    );
    assert_eq!(
        kv_new.get("in-flight").await.unwrap(),
        None,
        "the write sent to the paused leader landed"
    );
    // Refused as a non-leader (so that clients fail over), not answered from the state it
    // dropped when it stepped down (NOT_FOUND would end a worker's job).
    assert_eq!(
        in_flight.code(),
        Code::Unavailable,
        "the write sent during the pause: {in_flight:?}"
    );
}

/// A single coordinator on etcd is SIGKILLed and started again on the same port under a
/// running job: sessions resume, barriers go on, key-value data and unique ids survive.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_restarted_single_coordinator_continues_the_job() {
    let _serial = SERIAL.lock().await;
    let Some(etcd) = Etcd::start(1) else { return };
    let started = Instant::now();
    let mut replicas = Replicas::start(&etcd, 1, TTL, &[]);
    replicas.wait_leader(Duration::from_secs(15), &[]).await;
    let addr = replicas.addr(0).to_owned();
    let job = form(&addr, "ha-restart", 2, 2).await;
    let id = unique_id();
    let state = Loop::new(job.world);
    let tasks = start_ranks(&addr, &job, id, &state).await;
    state
        .wait_all(10, Duration::from_secs(30), || replicas.logs())
        .await;
    let before = state.max();
    state.mark_fault();
    let killed = Instant::now();
    replicas.kill(0);
    tokio::time::sleep(Duration::from_millis(300)).await;
    replicas.restart(0);
    replicas.wait_leader(Duration::from_secs(15), &[]).await;
    eprintln!(
        "the restarted coordinator serves {:?} after the SIGKILL (barrier {before} done)",
        killed.elapsed()
    );
    state
        .wait_all(before + 3, Duration::from_secs(40), || replicas.logs())
        .await;
    eprintln!(
        "first barrier after the SIGKILL completed after {:?}",
        state.first_after()
    );
    let target = state.finish_after(AFTER);
    let reports = collect(tasks, Duration::from_secs(40), || replicas.logs()).await;
    check_intact(&addr, &job, id, &reports, target, || replicas.logs()).await;
    leave_all(reports).await;
    eprintln!("test took {:?}", started.elapsed());
}

/// etcd is SIGKILLed under a running job: the coordinator reports NOT_SERVING and answers
/// UNAVAILABLE naming the store; when etcd is back it recovers by itself and the job goes on
/// with nothing lost or duplicated.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn etcd_outage_is_not_serving_then_recovers() {
    let _serial = SERIAL.lock().await;
    let Some(mut etcd) = Etcd::start(1) else {
        return;
    };
    let started = Instant::now();
    let replicas = Replicas::start(&etcd, 1, TTL, &[]);
    replicas.wait_leader(Duration::from_secs(15), &[]).await;
    let addr = replicas.addr(0).to_owned();
    let job = form(&addr, "ha-etcd", 2, 2).await;
    let id = unique_id();
    let state = Loop::new(job.world);
    let tasks = start_ranks(&addr, &job, id, &state).await;
    state
        .wait_all(10, Duration::from_secs(30), || replicas.logs())
        .await;

    let before = state.max();
    state.mark_fault();
    let killed = Instant::now();
    etcd.kill(0);
    // NOT_SERVING once it knows its state may be stale: at the latest when its lease ends.
    let deadline = killed + TTL + Duration::from_secs(3);
    loop {
        let h = replicas.health(0, "").await;
        if h == Health::NotServing {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the coordinator still says {h:?} {:?} after etcd died\n{}",
            killed.elapsed(),
            replicas.logs()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    eprintln!("NOT_SERVING {:?} after etcd died", killed.elapsed());
    assert_eq!(
        replicas.health(0, "muster.v1.KeyValue").await,
        Health::NotServing
    );
    let mut kv = pb::key_value_client::KeyValueClient::new(channel(&addr).await);
    let refused = tokio::time::timeout(
        Duration::from_secs(10),
        kv.get(pb::GetRequest {
            job_id: job.id.clone(),
            key: "rank-0".into(),
            wait_ms: 0,
        }),
    )
    .await
    .expect("a call answers while etcd is down")
    .expect_err("a call succeeded from state that may be stale");
    eprintln!("while etcd is down: {refused:?}");
    assert_eq!(refused.code(), Code::Unavailable, "{refused:?}");
    let message = refused.message().to_lowercase();
    assert!(
        ["etcd", "store", "leader"]
            .iter()
            .any(|w| message.contains(w)),
        "the message does not say why: {refused:?}"
    );
    let stalled = state.max();

    tokio::time::sleep(Duration::from_secs(1)).await;
    tokio::task::block_in_place(|| etcd.restart_retrying(0));
    let restarted = Instant::now();
    replicas.wait_leader(Duration::from_secs(20), &[]).await;
    eprintln!(
        "SERVING again {:?} after etcd restarted ({:?} after it died; ranks were at barrier {before} then, {stalled} during the outage)",
        restarted.elapsed(),
        killed.elapsed()
    );
    state
        .wait_all(stalled + 3, Duration::from_secs(40), || replicas.logs())
        .await;
    let target = state.finish_after(AFTER);
    let reports = collect(tasks, Duration::from_secs(40), || replicas.logs()).await;
    check_intact(&addr, &job, id, &reports, target, || replicas.logs()).await;
    leave_all(reports).await;
    eprintln!("test took {:?}", started.elapsed());
}

/// Two `muster-agent launch` nodes of 4 `barrier_loop` workers, given both replicas'
/// addresses; the leader is SIGKILLed while the workers loop. The job exits 0 without a
/// restart (each worker starts once and prints its result).
#[test]
fn agent_launch_survives_leader_sigkill() {
    let Some(barrier_loop) = example_bin("barrier_loop") else {
        println!("skipped: worker-sdk/examples/barrier_loop.rs does not exist");
        return;
    };
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let _serial = runtime.block_on(SERIAL.lock());
    let Some(etcd) = Etcd::start(1) else { return };
    let started = Instant::now();
    let mut replicas = Replicas::start(&etcd, 2, TTL, &[]);
    let leader = runtime.block_on(replicas.wait_leader(Duration::from_secs(15), &[]));
    let addrs = replicas.addrs();
    let script = format!(
        "echo ready rank=$RANK gen=$MUSTER_GENERATION restarts=$TORCHELASTIC_RESTART_COUNT; exec {} --iters 4000 --warmup 5",
        barrier_loop.display()
    );
    let agents: Vec<Agent> = (0..2)
        .map(|node| {
            let node = node.to_string();
            Agent::start_with_env(
                &[
                    "launch",
                    "--coordinator",
                    &addrs,
                    "--job-id",
                    "ha-launch",
                    "--nnodes",
                    "2",
                    "--node-rank",
                    &node,
                    "--nproc-per-node",
                    "4",
                    "--grace-period-ms",
                    "1000",
                    "--",
                    "sh",
                    "-c",
                    &script,
                ],
                &[("NO_COLOR", "1")],
            )
        })
        .collect();
    for agent in &agents {
        agent.wait_for_lines(Stream::Stdout, 4, Duration::from_secs(30), |l| {
            l.contains("] ready ")
        });
    }
    std::thread::sleep(Duration::from_millis(500));
    let mut agents = agents;
    for (i, agent) in agents.iter_mut().enumerate() {
        assert!(
            !agent.exited(),
            "agent {i} finished before the leader was killed: raise --iters\n{}",
            agent.output()
        );
    }
    let killed = Instant::now();
    replicas.kill(leader);
    let new = runtime.block_on(replicas.wait_leader(TAKEOVER + TTL, &[leader]));
    eprintln!(
        "replica {new} leads {:?} after the SIGKILL",
        killed.elapsed()
    );
    let deadline = Instant::now() + Duration::from_secs(60);
    let runs: Vec<_> = agents.into_iter().map(|a| a.finish_by(deadline)).collect();
    eprintln!("the job ended {:?} after the SIGKILL", killed.elapsed());
    for (i, run) in runs.iter().enumerate() {
        assert_eq!(
            run.code(),
            Some(0),
            "agent {i}: {}\n{}",
            run.dump(),
            replicas.logs()
        );
    }
    let ready: Vec<&String> = runs
        .iter()
        .flat_map(|r| &r.stdout)
        .filter(|l| l.contains("] ready "))
        .collect();
    assert_eq!(ready.len(), 8, "workers restarted: {ready:#?}");
    assert!(
        ready
            .iter()
            .all(|l| l.contains("gen=") && l.contains("restarts=0")),
        "{ready:#?}"
    );
    let results: Vec<&String> = runs
        .iter()
        .flat_map(|r| &r.stdout)
        .filter(|l| l.contains("iters=4000"))
        .collect();
    eprintln!("{results:#?}");
    assert_eq!(results.len(), 8, "not every worker finished its loop");
    eprintln!("test took {:?}", started.elapsed());
}

/// Issue 28's long fault run: a node's watch that, after its leader's death, opens at a replica
/// that answers nothing (here a follower SIGSTOPped beforehand; in the run, a replica frozen
/// right after it took the lead) leaves it for another replica after half its lease of
/// silence, and re-attaches to the new leader within the lease. It used to wait on that open
/// until the lease ran out, and the node stopped its workers while another replica led. One
/// `muster-agent launch` node (lease 6 s), given the replicas as [leader, frozen, other].
#[test]
fn a_watch_opening_at_a_frozen_replica_moves_on_within_the_lease() {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let _serial = runtime.block_on(SERIAL.lock());
    let Some(etcd) = Etcd::start(1) else { return };
    let mut replicas = Replicas::start(&etcd, 3, TTL, &[]);
    let leader = runtime.block_on(replicas.wait_leader(Duration::from_secs(15), &[]));
    let (frozen, other) = ((leader + 1) % 3, (leader + 2) % 3);
    let addrs = [leader, frozen, other]
        .map(|i| replicas.addr(i).to_owned())
        .join(",");
    let flag = std::env::temp_dir().join(format!("muster-frozen-open-{}", std::process::id()));
    let _ = std::fs::remove_file(&flag);
    let script = format!(
        "echo ready gen=$MUSTER_GENERATION; while [ ! -e {} ]; do sleep 0.1; done",
        flag.display()
    );
    let lease = Duration::from_secs(6);
    let lease_ms = lease.as_millis().to_string();
    let mut agent = Agent::start_with_env(
        &[
            "launch",
            "--coordinator",
            &addrs,
            "--job-id",
            "ha-frozen-open",
            "--nproc-per-node",
            "1",
            "--lease-ms",
            &lease_ms,
            "--",
            "sh",
            "-c",
            &script,
        ],
        &[("NO_COLOR", "1")],
    );
    agent.wait_for_lines(Stream::Stdout, 1, Duration::from_secs(30), |l| {
        l.contains("ready gen=")
    });
    replicas.stop(frozen);
    let killed = Instant::now();
    replicas.kill(leader);
    let new = runtime.block_on(replicas.wait_leader(TAKEOVER + TTL, &[leader, frozen]));
    assert_eq!(new, other);
    // Past the lease (and the new leader's re-attach window for the node, its heartbeat
    // timeout of 10 s): the node kept its worker and re-attached to the other replica.
    let reattached = format!("re-attached to the coordinator at {}", replicas.addr(other));
    while killed.elapsed() < Duration::from_secs(12) {
        assert!(
            !agent.exited(),
            "the node gave up:\n{}\n{}",
            agent.output(),
            replicas.logs()
        );
        std::thread::sleep(Duration::from_millis(200));
    }
    let took = agent
        .lines(Stream::Stderr)
        .iter()
        .any(|l| l.contains(&reattached));
    replicas.cont(frozen);
    std::fs::write(&flag, b"").unwrap();
    let run = agent.finish(Duration::from_secs(30));
    let _ = std::fs::remove_file(&flag);
    assert!(took, "no re-attach to the other replica:\n{}", run.dump());
    assert_eq!(run.code(), Some(0), "{}\n{}", run.dump(), replicas.logs());
    let ready: Vec<&String> = run
        .stdout
        .iter()
        .filter(|l| l.contains("ready gen="))
        .collect();
    assert_eq!(ready.len(), 1, "the worker restarted: {ready:?}");
}
