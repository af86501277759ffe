//! Coordinator failover as the SDK sees it, against in-process stand-ins: an address list whose
//! first replica is dead, a follower that refuses every call naming the leader, and a scripted
//! session service whose streams break under waiting barriers. The end-to-end failover of real
//! replicas over etcd is in `tests/tests/ha_failover.rs`.
#![allow(clippy::unwrap_used)]

mod support;

use std::{
    convert::Infallible,
    sync::{
        Arc,
        atomic::{AtomicUsize, Ordering},
    },
    task::{Context, Poll},
    time::Duration,
};

use muster::{
    Error, Scope,
    client::{Coordinator, Kv, Session, SessionConfig},
};
use muster_proto::v1::{
    self as pb, CoordinatorMessage, WorkerMessage, coordinator_message,
    session_server::{Session as SessionService, SessionServer},
    worker_message,
};
use support::TestCoordinator;
use tokio::sync::mpsc;
use tokio_stream::wrappers::{TcpListenerStream, UnboundedReceiverStream};
use tonic::{
    Request, Response, Status, Streaming,
    codegen::{Service, http},
    server::NamedService,
};

/// An address where nothing listens.
fn dead_addr() -> String {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    listener.local_addr().unwrap().to_string()
}

/// Serves `router` on an ephemeral port of this runtime; returns its address.
async fn serve(router: tonic::transport::server::Router) -> String {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    tokio::spawn(router.serve_with_incoming(TcpListenerStream::new(listener)));
    addr
}

fn session_config(job: &str, rank: u32) -> SessionConfig {
    SessionConfig {
        job_id: job.to_owned(),
        generation: 1,
        rank,
        pid: std::process::id(),
        host: support::HOST.to_owned(),
    }
}

/// Forms `job` (one node of `ranks` ranks) at the real coordinator `addr`.
async fn form(addr: &str, job: &str, ranks: u32) {
    let nodes = support::join(addr, job, &[ranks]).await;
    assert_eq!(nodes[0].world_size, ranks);
}

/// Two ranks pass a barrier and use the key-value store through `coordinator`.
async fn exercise(coordinator: &Coordinator, job: &str) {
    let (a, b) = tokio::join!(
        Session::attach(coordinator, session_config(job, 0)),
        Session::attach(coordinator, session_config(job, 1)),
    );
    let (a, b) = (a.unwrap(), b.unwrap());
    let (x, y) = tokio::join!(
        a.barrier(Scope::Global, "start", None),
        b.barrier(Scope::Global, "start", None)
    );
    x.unwrap();
    y.unwrap();
    let kv = a.kv();
    kv.set("k", b"v".to_vec()).await.unwrap();
    assert_eq!(b.kv().get("k").await.unwrap(), Some(b"v".to_vec()));
    assert_eq!(kv.add("n", 2).await.unwrap(), 2);
    assert!(
        kv.compare_and_set("k", Some(b"v"), b"w".to_vec())
            .await
            .unwrap()
            .swapped
    );
    a.leave().await.unwrap();
    b.leave().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_first_replica_is_skipped() {
    let coordinator = TestCoordinator::start();
    form(&coordinator.addr, "dead-first", 2).await;
    let list = format!("{},{}", dead_addr(), coordinator.addr);
    let connection = Coordinator::connect(&list).await.unwrap();
    assert_eq!(connection.addr(), list);
    assert_eq!(&*connection.leader_addr(), coordinator.addr);
    exercise(&connection, "dead-first").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lazy_connection_fails_over_even_for_calls_that_are_not_idempotent() {
    let coordinator = TestCoordinator::start();
    form(&coordinator.addr, "lazy", 2).await;
    let list = format!("{}, {}", dead_addr(), coordinator.addr);
    let connection = Coordinator::connect_lazy(&list).unwrap();
    // The first call goes to the dead replica: a connect error proves nothing was applied, so
    // even `add` moves on to the next replica.
    let kv = Kv::new(connection.clone(), "lazy");
    assert_eq!(kv.add("m", 5).await.unwrap(), 5);
    assert_eq!(&*connection.leader_addr(), coordinator.addr);
    exercise(&connection, "lazy").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_reachable_replica_is_a_connection_error_naming_the_list() {
    let list = format!("{},{}", dead_addr(), dead_addr());
    let error = Coordinator::connect(&list).await.unwrap_err();
    assert!(
        matches!(&error, Error::Connection { addr, .. } if *addr == list),
        "{error:?}"
    );
    let error = Coordinator::connect("127.0.0.1:1,nonsense")
        .await
        .unwrap_err();
    assert_eq!(
        error.to_string(),
        "bad muster environment: coordinator address list \"127.0.0.1:1,nonsense\": \
         entry \"nonsense\" is not host:port"
    );
}

/// A replica that refuses every call of service `NAME` with UNAVAILABLE before any handler,
/// as a follower does, optionally naming the leader.
#[derive(Clone)]
struct Refuser<const SESSION: bool> {
    message: &'static str,
    leader: Option<String>,
    calls: Arc<AtomicUsize>,
}

impl NamedService for Refuser<false> {
    const NAME: &'static str = "muster.v1.KeyValue";
}

impl NamedService for Refuser<true> {
    const NAME: &'static str = "muster.v1.Session";
}

impl<const SESSION: bool> Service<http::Request<tonic::body::Body>> for Refuser<SESSION> {
    type Response = http::Response<tonic::body::Body>;
    type Error = Infallible;
    type Future = std::future::Ready<Result<Self::Response, Infallible>>;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, _: http::Request<tonic::body::Body>) -> Self::Future {
        self.calls.fetch_add(1, Ordering::SeqCst);
        let mut status = Status::unavailable(self.message);
        if let Some(leader) = &self.leader {
            status
                .metadata_mut()
                .insert("muster-leader", leader.parse().unwrap());
        }
        std::future::ready(Ok(status.into_http()))
    }
}

/// Starts a refusing replica for the key-value and session services; returns its address and
/// its call counter.
async fn refuser(message: &'static str, leader: Option<String>) -> (String, Arc<AtomicUsize>) {
    let calls = Arc::new(AtomicUsize::new(0));
    let kv = Refuser::<false> {
        message,
        leader: leader.clone(),
        calls: calls.clone(),
    };
    let session = Refuser::<true> {
        message,
        leader,
        calls: calls.clone(),
    };
    let router = tonic::transport::Server::builder()
        .add_service(kv)
        .add_service(session);
    (serve(router).await, calls)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_follower_naming_the_leader_is_followed() {
    let coordinator = TestCoordinator::start();
    form(&coordinator.addr, "follow", 2).await;
    // The follower is listed first and alone: the leader it names is not even in the list.
    let (follower, calls) = refuser("not the leader", Some(coordinator.addr.clone())).await;
    let connection = Coordinator::connect(&follower).await.unwrap();
    let kv = Kv::new(connection.clone(), "follow");
    // A refusal before any handler proves `add` was not applied: it is retried too.
    assert_eq!(kv.add("m", 1).await.unwrap(), 1);
    assert_eq!(calls.load(Ordering::SeqCst), 1);
    assert_eq!(&*connection.leader_addr(), coordinator.addr);
    exercise(&connection, "follow").await;

    // A session attach that starts at the follower is redirected the same way.
    form(&coordinator.addr, "follow-2", 2).await;
    let list = format!("{follower},{}", coordinator.addr);
    let connection = Coordinator::connect(&list).await.unwrap();
    assert_eq!(&*connection.leader_addr(), follower);
    let before = calls.load(Ordering::SeqCst);
    exercise(&connection, "follow-2").await;
    // Both ranks' attaches may reach the follower before the first refusal moves them on.
    let refused = calls.load(Ordering::SeqCst) - before;
    assert!((1..=2).contains(&refused), "{refused} refusals");
    assert_eq!(&*connection.leader_addr(), coordinator.addr);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ambiguous_failures_retry_only_idempotent_calls_within_the_budget() {
    // UNAVAILABLE without naming a leader or saying there is none: the request may have run.
    let (addr, calls) = refuser("state store unreachable: etcd timed out", None).await;
    let connection = Coordinator::connect(&addr).await.unwrap();
    connection.set_failover_timeout(Duration::from_millis(400));
    let kv = Kv::new(connection.clone(), "job");

    let error = kv.add("n", 1).await.unwrap_err();
    assert_eq!(calls.load(Ordering::SeqCst), 1, "add must not be retried");
    assert!(matches!(error, Error::Connection { .. }), "{error:?}");
    assert!(
        error.to_string().contains("state store unreachable"),
        "{error}"
    );

    let started = std::time::Instant::now();
    let error = kv.set("k", b"v".to_vec()).await.unwrap_err();
    let attempts = calls.load(Ordering::SeqCst) - 1;
    assert!(attempts >= 3, "set was tried {attempts} times");
    assert!(
        started.elapsed() >= Duration::from_millis(400),
        "{:?}",
        started.elapsed()
    );
    assert!(error.to_string().contains(&addr), "{error}");

    // A budget of 0 turns retries off.
    connection.set_failover_timeout(Duration::ZERO);
    let before = calls.load(Ordering::SeqCst);
    kv.get("k").await.unwrap_err();
    assert_eq!(calls.load(Ordering::SeqCst), before + 1);
}

/// One session stream opened at the scripted session service.
struct Stream {
    register: pb::Register,
    inbound: Streaming<WorkerMessage>,
    outbound: mpsc::UnboundedSender<Result<CoordinatorMessage, Status>>,
}

impl Stream {
    fn send(&self, kind: coordinator_message::Kind) {
        self.outbound
            .send(Ok(CoordinatorMessage { kind: Some(kind) }))
            .unwrap();
    }

    fn registered(&self) {
        self.send(coordinator_message::Kind::Registered(pb::Registered {
            heartbeat_interval_ms: 100,
            world_size: 2,
            node_rank: 0,
            num_nodes: 1,
        }));
    }

    /// The next message other than a heartbeat.
    async fn next(&mut self) -> worker_message::Kind {
        loop {
            let message = tokio::time::timeout(Duration::from_secs(10), self.inbound.message())
                .await
                .expect("a session message within 10 s")
                .unwrap()
                .unwrap();
            match message.kind.unwrap() {
                worker_message::Kind::Heartbeat(_) => {}
                kind => return kind,
            }
        }
    }

    async fn barrier(&mut self) -> pb::BarrierEnter {
        match self.next().await {
            worker_message::Kind::Barrier(entry) => entry,
            other => panic!("expected a barrier entry, got {other:?}"),
        }
    }

    fn release(&self, entry: &pb::BarrierEnter) {
        self.send(coordinator_message::Kind::Barrier(pb::BarrierResult {
            scope: entry.scope,
            seq: entry.seq,
            error: None,
        }));
    }
}

/// A session service whose streams the test drives: every attach is handed to the test.
struct Scripted {
    streams: mpsc::UnboundedSender<Stream>,
}

#[tonic::async_trait]
impl SessionService for Scripted {
    type AttachStream = UnboundedReceiverStream<Result<CoordinatorMessage, Status>>;

    async fn attach(
        &self,
        request: Request<Streaming<WorkerMessage>>,
    ) -> Result<Response<Self::AttachStream>, Status> {
        let mut inbound = request.into_inner();
        let register = match inbound.message().await? {
            Some(WorkerMessage {
                kind: Some(worker_message::Kind::Register(register)),
            }) => register,
            other => return Err(Status::invalid_argument(format!("{other:?}"))),
        };
        let (outbound, rx) = mpsc::unbounded_channel();
        let stream = Stream {
            register,
            inbound,
            outbound,
        };
        self.streams
            .send(stream)
            .map_err(|_| Status::internal("test over"))?;
        Ok(Response::new(UnboundedReceiverStream::new(rx)))
    }
}

/// Starts the scripted session service; returns its address and its streams.
async fn scripted() -> (String, mpsc::UnboundedReceiver<Stream>) {
    let (streams, rx) = mpsc::unbounded_channel();
    let router =
        tonic::transport::Server::builder().add_service(SessionServer::new(Scripted { streams }));
    (serve(router).await, rx)
}

async fn next_stream(streams: &mut mpsc::UnboundedReceiver<Stream>) -> Stream {
    tokio::time::timeout(Duration::from_secs(10), streams.recv())
        .await
        .expect("a session stream within 10 s")
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_broken_session_re_attaches_and_resends_its_unanswered_barrier() {
    let (addr, mut streams) = scripted().await;
    let connection = Coordinator::connect(&addr).await.unwrap();
    let attach = tokio::spawn({
        let connection = connection.clone();
        async move { Session::attach(&connection, session_config("scripted", 0)).await }
    });
    let mut first = next_stream(&mut streams).await;
    assert!(!first.register.resume);
    first.registered();
    let session = Arc::new(attach.await.unwrap().unwrap());
    let watch = session.failure_watch();

    // Barrier 1 completes on the first stream.
    let waiter = tokio::spawn({
        let session = session.clone();
        async move { session.barrier(Scope::Global, "one", None).await }
    });
    let entry = first.barrier().await;
    assert_eq!((entry.seq, entry.name.as_str()), (1, "one"));
    first.release(&entry);
    waiter.await.unwrap().unwrap();

    // Barrier 2 (node scope, with a timeout) is entered, then the leader goes away with an
    // UNAVAILABLE refusal: the caller keeps waiting.
    let waiter = tokio::spawn({
        let session = session.clone();
        async move {
            session
                .barrier(Scope::Node, "two", Some(Duration::from_secs(60)))
                .await
        }
    });
    let entry = first.barrier().await;
    first
        .outbound
        .send(Err(Status::unavailable("no leader is elected yet")))
        .unwrap();
    drop(first);

    let mut second = next_stream(&mut streams).await;
    assert!(second.register.resume);
    assert_eq!(
        (
            second.register.rank,
            second.register.released_global,
            second.register.released_node
        ),
        (0, 1, 0)
    );
    second.registered();
    let resent = second.barrier().await;
    assert_eq!(
        resent, entry,
        "the same entry: seq, name, scope and timeout"
    );
    assert!(!waiter.is_finished());
    second.release(&resent);
    waiter.await.unwrap().unwrap();
    assert!(watch.failed().is_none(), "a failover is not a failure");

    // A barrier entered while the stream is down is sent once it is back; an end without
    // `leave` is a failover too.
    drop(second);
    let waiter = tokio::spawn({
        let session = session.clone();
        async move { session.barrier(Scope::Global, "three", None).await }
    });
    let mut third = next_stream(&mut streams).await;
    assert_eq!(
        (third.register.released_global, third.register.released_node),
        (1, 1)
    );
    third.registered();
    let entry = third.barrier().await;
    assert_eq!((entry.seq, entry.name.as_str()), (2, "three"));
    third.release(&entry);
    waiter.await.unwrap().unwrap();
    assert_eq!(session.next_seq(Scope::Global), 3);

    // A pushed failure still fires the watch, and the end that follows is final.
    third.send(coordinator_message::Kind::GenerationFailed(
        pb::BarrierError {
            kind: pb::barrier_error::Kind::RankFailed as i32,
            message: "rank 1 (node 0, host h) failed: exited with status 3".to_owned(),
            rank: 1,
            ..Default::default()
        },
    ));
    let fired = tokio::task::spawn_blocking(move || watch.wait_timeout(Duration::from_secs(10)))
        .await
        .unwrap();
    assert!(
        matches!(fired, Some(Error::RankFailed { rank: 1, .. })),
        "{fired:?}"
    );
    drop(third);
    tokio::time::sleep(Duration::from_millis(300)).await;
    let error = session
        .barrier(Scope::Global, "four", None)
        .await
        .unwrap_err();
    assert!(matches!(error, Error::Connection { .. }), "{error:?}");
    assert!(streams.try_recv().is_err(), "no re-attach after a failure");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_re_attach_loses_the_session_with_the_reason() {
    let (addr, mut streams) = scripted().await;
    let connection = Coordinator::connect(&addr).await.unwrap();
    let attach = tokio::spawn({
        let connection = connection.clone();
        async move { Session::attach(&connection, session_config("refused", 0)).await }
    });
    let first = next_stream(&mut streams).await;
    first.registered();
    let session = Arc::new(attach.await.unwrap().unwrap());
    let waiter = tokio::spawn({
        let session = session.clone();
        async move { session.barrier(Scope::Global, "b", None).await }
    });
    let mut first = first;
    first.barrier().await;
    drop(first);
    let second = next_stream(&mut streams).await;
    assert!(second.register.resume);
    second
        .outbound
        .send(Err(Status::failed_precondition(
            "generation 1 of job refused failed",
        )))
        .unwrap();
    drop(second);
    let error = waiter.await.unwrap().unwrap_err();
    let text = error.to_string();
    assert!(matches!(error, Error::Connection { .. }), "{error:?}");
    assert!(
        text.contains("could not re-attach after failover")
            && text.contains("FailedPrecondition: generation 1 of job refused failed"),
        "{text}"
    );
    assert!(session.failure_watch().failed().is_none());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_session_gives_up_when_the_budget_runs_out() {
    let (addr, mut streams) = scripted().await;
    let connection = Coordinator::connect(&addr).await.unwrap();
    connection.set_failover_timeout(Duration::from_millis(500));
    let attach = tokio::spawn({
        let connection = connection.clone();
        async move { Session::attach(&connection, session_config("budget", 0)).await }
    });
    let first = next_stream(&mut streams).await;
    first.registered();
    let session = attach.await.unwrap().unwrap();
    let started = std::time::Instant::now();
    drop(first);
    // Every re-attach fails as with a replica going away (not a refusal as not the leader,
    // which would prove that nobody leads and be waited out: the next test).
    let refuse = tokio::spawn(async move {
        let mut attempts = 0;
        while let Some(stream) = streams.recv().await {
            attempts += 1;
            let _ = stream
                .outbound
                .send(Err(Status::unavailable("the coordinator is shutting down")));
        }
        attempts
    });
    let error = session.barrier(Scope::Global, "b", None).await.unwrap_err();
    let elapsed = started.elapsed();
    assert!(
        elapsed >= Duration::from_millis(500) && elapsed < Duration::from_secs(5),
        "{elapsed:?}"
    );
    let text = error.to_string();
    assert!(
        text.contains("could not re-attach after failover within 0.5 s")
            && text.contains("the coordinator is shutting down"),
        "{text}"
    );
    refuse.abort();
}

/// An etcd outage: every replica refuses, as not the leader, with no leader elected. Calls
/// wait past their budget for as long as every replica keeps refusing (the census of
/// `muster_core::failover`), several at once on one connection, and fail once a replica stops
/// answering (it may be a leader this worker cannot reach).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn calls_wait_out_replicas_that_all_know_no_leader() {
    const NO_LEADER: &str =
        "coordinator x is not the leader and no leader is elected yet (is etcd reachable?)";
    let mut addrs = Vec::new();
    for _ in 0..3 {
        addrs.push(refuser(NO_LEADER, None).await.0);
    }
    let connection = Coordinator::connect(&addrs.join(",")).await.unwrap();
    connection.set_failover_timeout(Duration::from_millis(300));
    let calls: Vec<_> = (0..4)
        .map(|i| {
            let kv = Kv::new(connection.clone(), "job");
            tokio::spawn(async move { kv.get(&format!("k{i}")).await })
        })
        .collect();
    // Well past the budget (300 ms) and the census's hold (5 s) after the first round.
    tokio::time::sleep(Duration::from_secs(8)).await;
    for call in &calls {
        assert!(
            !call.is_finished(),
            "a call gave up while every replica refused"
        );
    }
    for call in calls {
        call.abort();
    }

    // One replica dead: no round completes, and the budget decides again.
    let partial = format!("{},{},{}", addrs[0], addrs[1], dead_addr());
    let connection = Coordinator::connect(&partial).await.unwrap();
    connection.set_failover_timeout(Duration::from_millis(300));
    let kv = Kv::new(connection, "job");
    let started = std::time::Instant::now();
    let error = tokio::time::timeout(Duration::from_secs(20), kv.get("k"))
        .await
        .expect("the call gave up")
        .unwrap_err();
    assert!(matches!(error, Error::Connection { .. }), "{error:?}");
    assert!(
        started.elapsed() < Duration::from_secs(3),
        "gave up only after {:?}",
        started.elapsed()
    );
}

/// The gateway stand-in's steps: how long each `add` is held, and its answer.
type Script = std::collections::VecDeque<(Duration, Result<i64, Status>)>;

/// A stand-in for a worker's agent gateway: a key-value service on a Unix socket whose `add`s
/// follow a script, each step held for a while and then answered with a failure or a sum.
struct Gateway {
    script: Arc<std::sync::Mutex<Script>>,
    calls: Arc<AtomicUsize>,
}

#[tonic::async_trait]
impl pb::key_value_server::KeyValue for Gateway {
    async fn add(
        &self,
        request: Request<pb::AddRequest>,
    ) -> Result<Response<pb::AddResponse>, Status> {
        self.calls.fetch_add(1, Ordering::SeqCst);
        assert!(
            !request.get_ref().client_id.is_empty(),
            "the add is on a lane"
        );
        let step = self.script.lock().unwrap().pop_front();
        let (hold, answer) = step.expect("an add past the end of the script");
        tokio::time::sleep(hold).await;
        answer.map(|value| Response::new(pb::AddResponse { value }))
    }

    async fn set(&self, _: Request<pb::SetRequest>) -> Result<Response<pb::SetResponse>, Status> {
        Err(Status::unimplemented("set"))
    }

    async fn get(&self, _: Request<pb::GetRequest>) -> Result<Response<pb::GetResponse>, Status> {
        Err(Status::unimplemented("get"))
    }

    async fn compare_and_set(
        &self,
        _: Request<pb::CompareAndSetRequest>,
    ) -> Result<Response<pb::CompareAndSetResponse>, Status> {
        Err(Status::unimplemented("compare_and_set"))
    }

    async fn delete(
        &self,
        _: Request<pb::DeleteRequest>,
    ) -> Result<Response<pb::DeleteResponse>, Status> {
        Err(Status::unimplemented("delete"))
    }

    async fn list(
        &self,
        _: Request<pb::ListRequest>,
    ) -> Result<Response<pb::ListResponse>, Status> {
        Err(Status::unimplemented("list"))
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn time_a_call_spent_at_the_agent_before_it_answered_spends_none_of_the_budget() {
    // The agent answers each attempt itself, after holding it while it retried the
    // coordinator: at once, then twice after most of the worker's budget (as when it waited
    // out an etcd outage, and then the new leader was paused with the call in flight). Held
    // time counted, the worker gave up after the third answer, with the write's outcome
    // unknown, although its lane made it safe to send again.
    let budget = Duration::from_millis(1_000);
    let hold = Duration::from_millis(700);
    let lost = || {
        Err(Status::unavailable(
            "the agent lost the call to the coordinator: http2 error",
        ))
    };
    let script = [
        (Duration::ZERO, lost()),
        (hold, lost()),
        (hold, lost()),
        (Duration::ZERO, Ok(7)),
    ];
    let calls = Arc::new(AtomicUsize::new(0));
    let gateway = Gateway {
        script: Arc::new(std::sync::Mutex::new(script.into_iter().collect())),
        calls: calls.clone(),
    };
    let path = std::env::temp_dir().join(format!(
        "muster-sdk-gateway-{}-{}.sock",
        std::process::id(),
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_nanos()
    ));
    let listener = tokio::net::UnixListener::bind(&path).unwrap();
    tokio::spawn(
        tonic::transport::Server::builder()
            .add_service(pb::key_value_server::KeyValueServer::new(gateway))
            .serve_with_incoming(tokio_stream::wrappers::UnixListenerStream::new(listener)),
    );
    let connection = Coordinator::connect(&format!("unix:{}", path.display()))
        .await
        .unwrap();
    assert!(connection.through_agent());
    connection.set_failover_timeout(budget);
    let mut lane = Kv::new(connection, "job").lane();
    let started = std::time::Instant::now();
    let sum = lane.add("n", 7).await;
    let _ = std::fs::remove_file(&path);
    assert_eq!(sum.unwrap(), 7, "after {:?}", started.elapsed());
    assert_eq!(calls.load(Ordering::SeqCst), 4);
}

/// Runs one `call_if` on a client of two replica addresses (never dialled: each attempt only
/// waits its step's hold on tokio's paused clock and answers), with the default budget of
/// 30 s; returns the result and how many attempts it made.
async fn scripted_call(steps: &[(u64, bool)]) -> (Result<i64, Status>, usize) {
    let connection = Coordinator::connect_lazy("127.0.0.1:9,127.0.0.1:10").unwrap();
    assert_eq!(connection.failover_timeout(), Duration::from_secs(30));
    let script: Vec<(Duration, bool)> = steps
        .iter()
        .map(|&(secs, ok)| (Duration::from_secs(secs), ok))
        .collect();
    let attempts = Arc::new(AtomicUsize::new(0));
    let counter = attempts.clone();
    let result = connection
        .call_if(
            "scripted",
            |_| true,
            |_| {
                let n = counter.fetch_add(1, Ordering::SeqCst);
                let (hold, ok) = script[n.min(script.len() - 1)];
                async move {
                    tokio::time::sleep(hold).await;
                    if ok {
                        Ok(7)
                    } else {
                        Err(Status::unavailable(
                            "coordinator stopped leading; re-attach to the new leader",
                        ))
                    }
                }
            },
        )
        .await
        .map_err(|failed| failed.status);
    (result, attempts.load(Ordering::SeqCst))
}

#[tokio::test(start_paused = true)]
async fn a_long_poll_held_by_a_running_replica_spends_no_budget_but_a_silent_one_does() {
    // A spare's join: refused by a follower at once, then parked at the leader for 20 s
    // until the leader stops, twice, then answered. Each parked attempt's last 6 s (the
    // keep-alive's ping and timeout with several replicas) count: 12 s of the 30.
    let (result, attempts) =
        scripted_call(&[(0, false), (20, false), (20, false), (0, true)]).await;
    assert_eq!(result.unwrap(), 7);
    assert_eq!(attempts, 4);

    // Attempts that fail within the keep-alive's window (a frozen replica, noticed after
    // 6 s) count whole: the budget runs out after 30 s of them.
    let started = tokio::time::Instant::now();
    let (result, attempts) = scripted_call(&[(0, false), (6, false)]).await;
    assert!(result.is_err());
    let spent = started.elapsed();
    assert!(
        spent >= Duration::from_secs(30) && spent < Duration::from_secs(37),
        "{spent:?} over {attempts} attempts"
    );
}
