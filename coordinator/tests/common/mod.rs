//! Test support: a real coordinator on 127.0.0.1:0 and thin wire-level clients for it.
#![allow(dead_code, clippy::unwrap_used, missing_docs)]

use muster_coordinator::Config;
use muster_proto::v1 as pb;
use pb::rendezvous_client::RendezvousClient;
use pb::session_client::SessionClient;
use std::time::Duration;
use tokio::sync::{mpsc, oneshot};
use tokio_stream::wrappers::ReceiverStream;
use tonic::transport::Channel;
use tonic::{Status, Streaming};

pub struct Server {
    pub addr: std::net::SocketAddr,
    pub channel: Channel,
    _stop: oneshot::Sender<()>,
}

pub async fn start(config: Config) -> Server {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let (stop, stopped) = oneshot::channel::<()>();
    tokio::spawn(muster_coordinator::serve(listener, config, async {
        let _ = stopped.await;
    }));
    let channel = connect(addr).await;
    Server {
        addr,
        channel,
        _stop: stop,
    }
}

pub async fn start_default() -> Server {
    start(Config::default()).await
}

pub async fn connect(addr: std::net::SocketAddr) -> Channel {
    for _ in 0..100 {
        if let Ok(c) = Channel::from_shared(format!("http://{addr}"))
            .unwrap()
            .tcp_nodelay(true)
            .connect()
            .await
        {
            return c;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    panic!("coordinator at {addr} did not come up");
}

pub fn join_req(job: &str, node: &str, local: u32, min: u32, max: u32) -> pb::JoinRequest {
    pb::JoinRequest {
        job_id: job.into(),
        node_id: node.into(),
        host: format!("host-{node}"),
        local_world_size: local,
        requested_node_rank: None,
        config: Some(pb::RendezvousConfig {
            min_nodes: min,
            max_nodes: max,
            last_call_ms: 200,
            join_timeout_ms: 60_000,
            max_restarts: None,
            recovery: 0,
            ..Default::default()
        }),
        request_id: String::new(),
        watches: false,
        spare: false,
    }
}

/// Starts a join in the background; the answer arrives on the returned handle.
pub fn spawn_join(
    ch: &Channel,
    req: pb::JoinRequest,
) -> tokio::task::JoinHandle<Result<pb::JoinResponse, Status>> {
    let mut c = RendezvousClient::new(ch.clone());
    tokio::spawn(async move { c.join(req).await.map(|r| r.into_inner()) })
}

/// Forms a job of `nodes` nodes with `local` workers each and returns the assignments by node rank.
pub async fn form(ch: &Channel, job: &str, nodes: u32, local: u32) -> Vec<pb::JoinResponse> {
    let handles: Vec<_> = (0..nodes)
        .map(|i| spawn_join(ch, join_req(job, &format!("n{i}"), local, nodes, nodes)))
        .collect();
    let mut out = vec![];
    for h in handles {
        out.push(h.await.unwrap().unwrap());
    }
    out.sort_by_key(|r| r.node_rank);
    out
}

/// One worker's session at the wire level.
pub struct Raw {
    pub rank: u32,
    tx: Option<mpsc::Sender<pb::WorkerMessage>>,
    rx: Streaming<pb::CoordinatorMessage>,
    seq: [u64; 2],
    pub registered: pb::Registered,
    /// The coordinator's `generation_failed` push, once it came (read past by [`Raw::result`]).
    pub generation_failed: Option<pb::BarrierError>,
}

fn msg(kind: pb::worker_message::Kind) -> pb::WorkerMessage {
    pb::WorkerMessage { kind: Some(kind) }
}

impl Raw {
    pub async fn attach(
        ch: &Channel,
        job: &str,
        generation: u64,
        rank: u32,
    ) -> Result<Raw, Status> {
        Self::attach_with(
            ch,
            pb::Register {
                job_id: job.into(),
                generation,
                rank,
                pid: 1000 + rank,
                host: String::new(),
                ..Default::default()
            },
        )
        .await
    }

    /// Opens a session with `register` as its first message (a replacement's, say).
    pub async fn attach_with(ch: &Channel, register: pb::Register) -> Result<Raw, Status> {
        let rank = register.rank;
        let (tx, rx) = mpsc::channel(16);
        tx.send(msg(pb::worker_message::Kind::Register(register)))
            .await
            .unwrap();
        let mut client = SessionClient::new(ch.clone());
        let mut stream = client.attach(ReceiverStream::new(rx)).await?.into_inner();
        let first = stream
            .message()
            .await?
            .ok_or_else(|| Status::internal("no registered"))?;
        let Some(pb::coordinator_message::Kind::Registered(registered)) = first.kind else {
            return Err(Status::internal("first answer was not registered"));
        };
        Ok(Raw {
            rank,
            tx: Some(tx),
            rx: stream,
            seq: [0; 2],
            registered,
            generation_failed: None,
        })
    }

    pub async fn send(&self, kind: pb::worker_message::Kind) {
        self.tx.as_ref().unwrap().send(msg(kind)).await.unwrap();
    }

    /// Sends a barrier entry (advancing this session's sequence number).
    pub async fn enter(&mut self, scope: pb::BarrierScope, name: &str, timeout_ms: u64) -> u64 {
        let i = if scope == pb::BarrierScope::Global {
            0
        } else {
            1
        };
        self.seq[i] += 1;
        self.enter_seq(scope, self.seq[i], name, timeout_ms).await;
        self.seq[i]
    }

    pub async fn enter_seq(&self, scope: pb::BarrierScope, seq: u64, name: &str, timeout_ms: u64) {
        self.send(pb::worker_message::Kind::Barrier(pb::BarrierEnter {
            scope: scope as i32,
            seq,
            name: name.into(),
            timeout_ms,
            trace_context: Default::default(),
        }))
        .await;
    }

    /// The next barrier result: None on success, the error otherwise. A `generation_failed`
    /// push on the way is kept in [`Raw::generation_failed`].
    pub async fn result(&mut self) -> Option<pb::BarrierError> {
        loop {
            let m = tokio::time::timeout(Duration::from_secs(20), self.rx.message())
                .await
                .expect("no barrier result within 20 s")
                .expect("stream error")
                .expect("stream ended");
            match m.kind {
                Some(pb::coordinator_message::Kind::Barrier(r)) => return r.error,
                Some(pb::coordinator_message::Kind::GenerationFailed(e)) => {
                    self.generation_failed = Some(e);
                }
                other => panic!("unexpected message {other:?}"),
            }
        }
    }

    /// The coordinator's `generation_failed` push: the one already read past, or the next
    /// message, which must be it.
    pub async fn pushed_failure(&mut self) -> pb::BarrierError {
        if let Some(e) = self.generation_failed.take() {
            return e;
        }
        let m = tokio::time::timeout(Duration::from_secs(20), self.rx.message())
            .await
            .expect("no generation_failed within 20 s")
            .expect("stream error")
            .expect("stream ended");
        match m.kind {
            Some(pb::coordinator_message::Kind::GenerationFailed(e)) => e,
            other => panic!("expected generation_failed, got {other:?}"),
        }
    }

    /// The next message pushed on the session, whatever it is.
    pub async fn next(&mut self) -> pb::coordinator_message::Kind {
        tokio::time::timeout(Duration::from_secs(20), self.rx.message())
            .await
            .expect("no message within 20 s")
            .expect("stream error")
            .expect("stream ended")
            .kind
            .expect("a message without kind")
    }

    /// Waits briefly for a result that should not come.
    pub async fn no_result_within(&mut self, d: Duration) {
        if let Ok(m) = tokio::time::timeout(d, self.rx.message()).await {
            panic!("unexpected message {m:?}");
        }
    }

    pub async fn barrier(&mut self, name: &str) -> Option<pb::BarrierError> {
        self.enter(pb::BarrierScope::Global, name, 0).await;
        self.result().await
    }

    /// Leaves cleanly: sends leave, then waits for the coordinator to end the stream (dropping
    /// the stream earlier would reset it and could lose the leave).
    pub async fn leave(mut self) {
        self.send(pb::worker_message::Kind::Leave(pb::Leave {}))
            .await;
        self.tx = None;
        let end = tokio::time::timeout(Duration::from_secs(10), self.rx.message()).await;
        assert!(
            matches!(end, Ok(Ok(None))),
            "stream did not end after leave: {end:?}"
        );
    }

    /// Ends the stream without leave: what a killed process looks like.
    pub fn kill(mut self) {
        self.tx = None;
    }
}

pub async fn attach_all(ch: &Channel, job: &str, generation: u64, world: u32) -> Vec<Raw> {
    let mut v = vec![];
    for r in 0..world {
        v.push(Raw::attach(ch, job, generation, r).await.unwrap());
    }
    v
}

pub async fn describe(ch: &Channel, job: &str) -> pb::DescribeJobResponse {
    pb::ops_client::OpsClient::new(ch.clone())
        .describe_job(pb::DescribeJobRequest {
            job_id: job.into(),
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner()
}

/// A node's relay at the wire level.
pub struct RawRelay {
    tx: mpsc::Sender<pb::RelayMessage>,
    rx: Streaming<pb::RelayEvent>,
}

impl RawRelay {
    pub async fn attach(
        ch: &Channel,
        job: &str,
        generation: u64,
        node_rank: u32,
    ) -> Result<RawRelay, Status> {
        Self::attach_with(
            ch,
            pb::RelayRegister {
                job_id: job.into(),
                generation,
                node_rank,
                ..Default::default()
            },
        )
        .await
    }

    /// Opens a relay with `register` as its first message (one that resumes, say).
    pub async fn attach_with(
        ch: &Channel,
        register: pb::RelayRegister,
    ) -> Result<RawRelay, Status> {
        let (tx, rx) = mpsc::channel(16);
        tx.send(pb::RelayMessage {
            kind: Some(pb::relay_message::Kind::Register(register)),
        })
        .await
        .unwrap();
        let mut stream = pb::relay_client::RelayClient::new(ch.clone())
            .attach(ReceiverStream::new(rx))
            .await?
            .into_inner();
        let first = stream
            .message()
            .await?
            .ok_or_else(|| Status::internal("no registered"))?;
        assert!(
            matches!(first.kind, Some(pb::relay_event::Kind::Registered(_))),
            "{first:?}"
        );
        Ok(RawRelay { tx, rx: stream })
    }

    pub async fn enter(&self, seq: u64, groups: &[(&str, &[u32])], timeout_ms: u64) {
        let groups = groups
            .iter()
            .map(|(name, ranks)| pb::BarrierName {
                name: (*name).into(),
                ranks: ranks.to_vec(),
            })
            .collect();
        self.tx
            .send(pb::RelayMessage {
                kind: Some(pb::relay_message::Kind::Enter(pb::GroupEnter {
                    seq,
                    groups,
                    timeout_ms,
                    trace_context: Default::default(),
                })),
            })
            .await
            .unwrap();
    }

    /// Registers `rank` through this relay (pid 100 + rank) and returns the coordinator's
    /// answer for it.
    pub async fn register_rank(&mut self, job: &str, generation: u64, rank: u32) -> pb::RankEvent {
        self.register_rank_with(pb::Register {
            job_id: job.into(),
            generation,
            rank,
            pid: 100 + rank,
            host: format!("host-{rank}"),
            ..Default::default()
        })
        .await
    }

    /// Sends `register` for a rank through this relay and returns the coordinator's answer.
    pub async fn register_rank_with(&mut self, register: pb::Register) -> pb::RankEvent {
        let rank = register.rank;
        self.tx
            .send(pb::RelayMessage {
                kind: Some(pb::relay_message::Kind::RankRegister(register)),
            })
            .await
            .unwrap();
        match self.event().await {
            pb::relay_event::Kind::Rank(event) => {
                assert_eq!(event.rank, rank, "{event:?}");
                event
            }
            other => panic!("expected a rank event, got {other:?}"),
        }
    }

    /// Says that `rank`, registered through this relay, is lost (`rank_lost`).
    pub async fn lose_rank(&self, rank: u32, reason: &str) {
        self.tx
            .send(pb::RelayMessage {
                kind: Some(pb::relay_message::Kind::RankLost(pb::RankLost {
                    rank,
                    reason: reason.into(),
                })),
            })
            .await
            .unwrap();
    }

    /// Says that `rank`, registered through this relay, began training step `step`.
    pub async fn step(&self, rank: u32, step: u64) {
        self.tx
            .send(pb::RelayMessage {
                kind: Some(pb::relay_message::Kind::RankStep(pb::RankStep {
                    rank,
                    step,
                })),
            })
            .await
            .unwrap();
    }

    /// Sends `leave` for `rank`, registered through this relay.
    pub async fn leave_rank(&self, rank: u32) {
        self.tx
            .send(pb::RelayMessage {
                kind: Some(pb::relay_message::Kind::RankLeave(pb::RankLeave { rank })),
            })
            .await
            .unwrap();
    }

    pub async fn report(&self, barriers: Vec<pb::BarrierInfo>) {
        self.tx
            .send(pb::RelayMessage {
                kind: Some(pb::relay_message::Kind::Waiting(pb::WaitingReport {
                    barriers,
                })),
            })
            .await
            .unwrap();
    }

    pub async fn event(&mut self) -> pb::relay_event::Kind {
        tokio::time::timeout(Duration::from_secs(20), self.rx.message())
            .await
            .expect("no relay event within 20 s")
            .expect("stream error")
            .expect("stream ended")
            .kind
            .expect("empty event")
    }

    /// The next barrier result for `seq`: None on success.
    pub async fn result(&mut self, seq: u64) -> Option<pb::BarrierError> {
        match self.event().await {
            pb::relay_event::Kind::Barrier(b) => {
                assert_eq!(b.seq, seq);
                b.error
            }
            other => panic!("expected a barrier result, got {other:?}"),
        }
    }
}

/// A node agent's watch stream at the wire level.
pub struct RawWatch {
    pub tx: Option<mpsc::Sender<pb::NodeMessage>>,
    pub rx: Streaming<pb::NodeEvent>,
}

impl RawWatch {
    pub async fn attach(
        ch: &Channel,
        job: &str,
        generation: u64,
        node_rank: u32,
        node_id: &str,
    ) -> Result<RawWatch, Status> {
        Self::attach_numbered(ch, job, generation, node_rank, node_id, 0).await
    }

    /// An attach with the agent's number for the open (`NodeAttach.attempt`).
    pub async fn attach_numbered(
        ch: &Channel,
        job: &str,
        generation: u64,
        node_rank: u32,
        node_id: &str,
        attempt: u64,
    ) -> Result<RawWatch, Status> {
        let (tx, rx) = mpsc::channel(16);
        tx.send(pb::NodeMessage {
            kind: Some(pb::node_message::Kind::Attach(pb::NodeAttach {
                job_id: job.into(),
                generation,
                node_rank,
                node_id: node_id.into(),
                resume: false,
                attempt,
            })),
        })
        .await
        .unwrap();
        let mut stream = RendezvousClient::new(ch.clone())
            .watch(ReceiverStream::new(rx))
            .await?
            .into_inner();
        let first = stream
            .message()
            .await?
            .ok_or_else(|| Status::internal("no attached"))?;
        assert!(
            matches!(first.kind, Some(pb::node_event::Kind::Attached(_))),
            "{first:?}"
        );
        Ok(RawWatch {
            tx: Some(tx),
            rx: stream,
        })
    }

    pub async fn heartbeat(&self) {
        self.send(pb::node_message::Kind::Heartbeat(pb::Heartbeat {}))
            .await;
    }

    /// Sends a heartbeat and waits for its answer (other events are skipped).
    pub async fn heartbeat_answered(&mut self) {
        self.heartbeat().await;
        self.next(|kind| match kind {
            pb::node_event::Kind::Heartbeat(_) => Some(()),
            _ => None,
        })
        .await;
    }

    pub async fn send(&self, kind: pb::node_message::Kind) {
        self.tx
            .as_ref()
            .unwrap()
            .send(pb::NodeMessage { kind: Some(kind) })
            .await
            .unwrap();
    }

    /// The next `ended` event (heartbeat answers skipped).
    pub async fn ended(&mut self) -> pb::GenerationEnded {
        self.next(|kind| match kind {
            pb::node_event::Kind::Ended(e) => Some(e),
            _ => None,
        })
        .await
    }

    /// The next `replace` event (heartbeat answers skipped).
    pub async fn replace(&mut self) -> pb::RankReplace {
        self.next(|kind| match kind {
            pb::node_event::Kind::Replace(r) => Some(r),
            _ => None,
        })
        .await
    }

    /// The first event within 20 s that `pick` takes (the others are skipped).
    async fn next<T>(&mut self, pick: impl Fn(pb::node_event::Kind) -> Option<T>) -> T {
        loop {
            let msg = tokio::time::timeout(Duration::from_secs(20), self.rx.message())
                .await
                .expect("no node event within 20 s")
                .expect("stream error")
                .expect("stream ended");
            if let Some(picked) = msg.kind.and_then(&pick) {
                return picked;
            }
        }
    }

    pub async fn nothing_within(&mut self, d: Duration) {
        if let Ok(m) = tokio::time::timeout(d, self.rx.message()).await {
            panic!("unexpected node event: {m:?}");
        }
    }
}
