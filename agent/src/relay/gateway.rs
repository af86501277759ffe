//! The agent's gateway: the coordinator's services, served to the node's workers on a Unix
//! socket beside the relay's (`coordinator.sock`, `muster_core::contract::agent_coordinator`),
//! so that a worker holds no connection to the coordinator and needs no address for it
//! (issue 29).
//!
//! - **A worker's session ends here.** `Session.Attach`'s `register` goes to the coordinator
//!   as a `rank_register` on the node's relay stream, and the answer and every later push for
//!   the rank (`generation_failed`, `membership_changed`, a refusal) come back as `RankEvent`s,
//!   which [`Ranks::deliver`] hands to the rank's stream. `leave` is a `rank_leave`.
//!   Heartbeats stop here: a session that goes silent, or ends without `leave`, is a
//!   `rank_lost` on the relay stream ([`Ranks::lost`]), whose reason the supervisor's report of
//!   the process's end (its exit status) refines. After a coordinator failover the relay registers its ranks again with
//!   `resume` ([`Ranks::attached`]), and the workers never see it.
//! - **Every other call is forwarded** unchanged (path, message bytes, metadata but the
//!   credentials) on the agent's own connection, with its failover policy: a refusal that
//!   proves the call never ran is retried on the leader; any other failure to reach the
//!   coordinator comes back as UNAVAILABLE, which the worker's SDK retries if the call is
//!   idempotent. The worker's client never follows a leader itself
//!   (`Coordinator::through_agent`).
//!
//! The gateway runs on the agent's main runtime; the relay stream is the relay thread's. The
//! two share [`Ranks`] (a mutex held for a few instructions).

use crate::failover::{self, Coordinators};
use bytes::{Buf, BufMut, Bytes};
use futures::channel::mpsc::UnboundedSender;
use muster::client::{Failed, MAX_MESSAGE_BYTES};
use muster_core::failover::{Verdict, classify_call};
use muster_core::failure::{
    AGENT_REPORT_GRACE, HEARTBEATS_PER_TIMEOUT, SESSION_LOST, no_heartbeat,
};
use muster_proto::v1::{self as pb, coordinator_message, worker_message};
use std::collections::HashMap;
use std::pin::Pin;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;
use tokio::sync::{mpsc, oneshot};
use tokio_stream::wrappers::{UnboundedReceiverStream, UnixListenerStream};
use tonic::codec::{Codec, DecodeBuf, Decoder, EncodeBuf, Encoder};
use tonic::{Request, Response, Status, Streaming};

/// How long a worker's `register` waits for the coordinator's answer through the relay.
const REGISTER_TIMEOUT: Duration = Duration::from_secs(10);

/// What a worker's session stream carries back.
type ToWorker = mpsc::UnboundedSender<Result<pb::CoordinatorMessage, Status>>;

/// The coordinator's answer to a worker's `register`: the heartbeat interval it asks for, or
/// its refusal.
type Answer = Result<Duration, Status>;

/// The node's ranks registered through the relay stream, shared by the gateway and the relay
/// thread.
#[derive(Default)]
pub struct Ranks {
    state: Mutex<RanksState>,
}

#[derive(Default)]
struct RanksState {
    /// The relay stream's outbound (replaced when the relay attaches again).
    relay: Option<UnboundedSender<pb::RelayMessage>>,
    routes: HashMap<u32, Route>,
    /// Tells one session of a rank from a later one.
    next_id: u64,
    /// Why the relay gave up, once it has: registrations are refused with it.
    closed: Option<String>,
}

/// One rank's session at the gateway.
struct Route {
    id: u64,
    /// Its `register`, sent again (with `resume`) when the relay attaches again.
    register: pb::Register,
    /// Until the coordinator answers: who waits for it (with the heartbeat interval).
    answer: Option<oneshot::Sender<Answer>>,
    /// The worker's stream.
    to: ToWorker,
}

impl Ranks {
    fn lock(&self) -> MutexGuard<'_, RanksState> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The relay (re-)attached with outbound `relay`. After a failover (`released`: the node's
    /// last released global and node barrier seqs), every rank registers again with `resume`
    /// before anything else goes out, and a registration still unanswered is sent again.
    pub fn attached(&self, relay: UnboundedSender<pb::RelayMessage>, released: Option<(u64, u64)>) {
        let mut st = self.lock();
        if let Some((global, node)) = released {
            for route in st.routes.values() {
                let mut register = route.register.clone();
                if route.answer.is_none() {
                    register.resume = true;
                    register.released_global = global;
                    register.released_node = node;
                    register.replacement = false;
                }
                let _ = relay.unbounded_send(rank_register(register));
            }
        }
        st.relay = Some(relay);
    }

    /// Registers a worker's session: sends its `register` on the relay stream. Returns the
    /// session's id and where the coordinator's answer arrives.
    fn register(
        &self,
        register: pb::Register,
        to: ToWorker,
    ) -> Result<(u64, oneshot::Receiver<Answer>), Status> {
        let mut st = self.lock();
        if let Some(why) = &st.closed {
            return Err(Status::unavailable(why.clone()));
        }
        st.next_id += 1;
        let id = st.next_id;
        let (answer, answered) = oneshot::channel();
        if let Some(relay) = &st.relay {
            // A stream that is gone is replaced: `attached` sends it again then.
            let _ = relay.unbounded_send(rank_register(register.clone()));
        }
        // A rank registering again replaces its earlier session (whose stream then ends).
        st.routes.insert(
            register.rank,
            Route {
                id,
                register,
                answer: Some(answer),
                to,
            },
        );
        Ok((id, answered))
    }

    /// A message from the coordinator for a rank registered here: the answer to its
    /// `register` (then, in order, what is pushed to it), or a refusal, which ends its
    /// session.
    pub fn deliver(&self, event: pb::RankEvent) {
        let mut st = self.lock();
        let Some(route) = st.routes.get_mut(&event.rank) else {
            return;
        };
        match event.kind {
            Some(pb::rank_event::Kind::Message(message)) => {
                let interval = match &message.kind {
                    Some(coordinator_message::Kind::Registered(r)) => {
                        Some(Duration::from_millis(r.heartbeat_interval_ms))
                    }
                    _ => None,
                };
                match (interval, route.answer.take()) {
                    // The worker learns it is registered before any push.
                    (Some(interval), Some(answer)) => {
                        let _ = route.to.send(Ok(message));
                        let _ = answer.send(Ok(interval));
                    }
                    // Registered again after a failover: nothing for the worker.
                    (Some(_), None) => {}
                    (None, answer) => {
                        route.answer = answer;
                        let _ = route.to.send(Ok(message));
                    }
                }
            }
            Some(pb::rank_event::Kind::Refused(refused)) => {
                let status = Status::new(refused.code.into(), refused.message);
                if let Some(route) = st.routes.remove(&event.rank) {
                    match route.answer {
                        Some(answer) => {
                            let _ = answer.send(Err(status));
                        }
                        None => {
                            let _ = route.to.send(Err(status));
                        }
                    }
                }
            }
            None => {}
        }
    }

    /// Session `id` of `rank` sent `leave`: the coordinator is told, and its stream ends.
    fn leave(&self, rank: u32, id: u64) {
        let mut st = self.lock();
        if st.routes.get(&rank).is_some_and(|r| r.id == id) {
            st.routes.remove(&rank);
            if let Some(relay) = &st.relay {
                let _ = relay.unbounded_send(pb::RelayMessage {
                    kind: Some(pb::relay_message::Kind::RankLeave(pb::RankLeave { rank })),
                });
            }
        }
    }

    /// Session `id` of `rank` ended: forgotten here ([`Ranks::lost`] says whether it was lost).
    fn gone(&self, rank: u32, id: u64) {
        let mut st = self.lock();
        if st.routes.get(&rank).is_some_and(|r| r.id == id) {
            st.routes.remove(&rank);
        }
    }

    /// A session of `rank` that ended without `leave`, or went silent, is lost (`reason`):
    /// unless the rank registered again since (an in-place replacement), the coordinator is
    /// told on the relay stream, ordered before any later registration of the rank, so the
    /// report can never name the replacement.
    fn lost(&self, rank: u32, reason: String) {
        let st = self.lock();
        if st.routes.contains_key(&rank) {
            return;
        }
        if let Some(relay) = &st.relay {
            // A stream that is gone loses it: the supervisor's report of the exit remains.
            let _ = relay.unbounded_send(pb::RelayMessage {
                kind: Some(pb::relay_message::Kind::RankLost(pb::RankLost {
                    rank,
                    reason,
                })),
            });
        }
    }

    /// `rank` began training step `step` (its session's step marker): passed on to the
    /// coordinator on the relay stream. A marker sent while the stream is away is not kept
    /// (the next one counts the time since).
    pub(super) fn step(&self, rank: u32, step: u64) {
        self.relay(pb::relay_message::Kind::RankStep(pb::RankStep {
            rank,
            step,
        }));
    }

    /// Passes a rank's one-way report on to the coordinator on the node's relay stream.
    fn relay(&self, kind: pb::relay_message::Kind) {
        let st = self.lock();
        if let Some(relay) = &st.relay {
            let _ = relay.unbounded_send(pb::RelayMessage { kind: Some(kind) });
        }
    }

    /// Sends `message` on session `id` of `rank`, if it is still open.
    fn send(&self, rank: u32, id: u64, message: Result<pb::CoordinatorMessage, Status>) {
        let st = self.lock();
        if let Some(route) = st.routes.get(&rank).filter(|r| r.id == id) {
            let _ = route.to.send(message);
        }
    }

    /// The relay gave up (`why`): every session ends with it, and new ones are refused.
    pub fn close(&self, why: &str) {
        let mut st = self.lock();
        st.closed = Some(why.to_owned());
        st.relay = None;
        for (_, route) in st.routes.drain() {
            let status = Status::unavailable(why.to_owned());
            match route.answer {
                Some(answer) => {
                    let _ = answer.send(Err(status));
                }
                None => {
                    let _ = route.to.send(Err(status));
                }
            }
        }
    }
}

fn rank_register(register: pb::Register) -> pb::RelayMessage {
    pb::RelayMessage {
        kind: Some(pb::relay_message::Kind::RankRegister(register)),
    }
}

/// Passes on global rank 0's steps that come on the agent's step socket
/// (`muster_core::contract::STEP_SOCKET`: decimal text, one step a datagram, from the agent's
/// Python start-up hook) as rank 0's step markers, until `stop` fires. Anything else is
/// dropped: the socket is in the relay's private directory, and a marker is information only.
pub async fn steps(
    socket: tokio::net::UnixDatagram,
    ranks: Arc<Ranks>,
    mut stop: oneshot::Receiver<()>,
) {
    let mut buf = [0u8; 32];
    loop {
        tokio::select! {
            _ = &mut stop => return,
            got = socket.recv(&mut buf) => {
                let Ok(n) = got else { return };
                if let Some(step) = std::str::from_utf8(&buf[..n])
                    .ok()
                    .and_then(|s| s.trim().parse::<u64>().ok())
                {
                    ranks.step(0, step);
                }
            }
        }
    }
}

/// Serves the gateway on `listener` until `stop` fires.
pub async fn serve(
    listener: tokio::net::UnixListener,
    ranks: Arc<Ranks>,
    coordinators: Coordinators,
    stop: oneshot::Receiver<()>,
) {
    let sessions = pb::session_server::SessionServer::new(Sessions { ranks });
    let router = tonic::service::Routes::new(sessions)
        .into_axum_router()
        .fallback(move |request: axum::extract::Request| {
            let coordinators = coordinators.clone();
            async move { forward(coordinators, request).await }
        });
    let served = tonic::transport::Server::builder()
        .add_routes(tonic::service::Routes::from(router))
        .serve_with_incoming_shutdown(UnixListenerStream::new(listener), async {
            let _ = stop.await;
        })
        .await;
    if let Err(e) = served {
        tracing::warn!(error = %e, "the agent's gateway stopped");
    }
}

/// `muster.v1.Session` at the gateway.
struct Sessions {
    ranks: Arc<Ranks>,
}

type AttachStream =
    Pin<Box<dyn tokio_stream::Stream<Item = Result<pb::CoordinatorMessage, Status>> + Send>>;

#[tonic::async_trait]
impl pb::session_server::Session for Sessions {
    type AttachStream = AttachStream;

    async fn attach(
        &self,
        request: Request<Streaming<pb::WorkerMessage>>,
    ) -> Result<Response<AttachStream>, Status> {
        let mut inbound = request.into_inner();
        let first = tokio::time::timeout(REGISTER_TIMEOUT, inbound.message())
            .await
            .map_err(|_| Status::deadline_exceeded("no register within 10 s"))??;
        let Some(pb::WorkerMessage {
            kind: Some(worker_message::Kind::Register(register)),
        }) = first
        else {
            return Err(Status::invalid_argument(
                "the first session message must be register",
            ));
        };
        let rank = register.rank;
        let (to, from) = mpsc::unbounded_channel();
        let (id, answered) = self.ranks.register(register, to)?;
        let interval = match tokio::time::timeout(REGISTER_TIMEOUT, answered).await {
            Ok(Ok(Ok(interval))) => interval,
            Ok(Ok(Err(status))) => return Err(status),
            Ok(Err(_)) => {
                return Err(Status::unavailable(format!(
                    "rank {rank}'s session was replaced at the agent before the coordinator answered"
                )));
            }
            Err(_) => {
                self.ranks.gone(rank, id);
                return Err(Status::unavailable(format!(
                    "the coordinator did not answer rank {rank}'s register through the agent within {} s",
                    REGISTER_TIMEOUT.as_secs()
                )));
            }
        };
        let session = Session {
            ranks: Arc::clone(&self.ranks),
            rank,
            id,
            interval,
        };
        // Task policy: one per worker session; ends with the worker's stream, or when the
        // agent stops (the runtime drops it).
        tokio::spawn(session.serve(inbound));
        Ok(Response::new(Box::pin(UnboundedReceiverStream::new(from))))
    }
}

/// A worker's session at the gateway, once registered.
struct Session {
    ranks: Arc<Ranks>,
    rank: u32,
    id: u64,
    /// How often the worker sends heartbeats.
    interval: Duration,
}

impl Session {
    /// Reads the worker's stream: heartbeats stop here (silence past the timeout fails the
    /// rank, as at the coordinator), `leave` is passed on, an end without `leave` fails the
    /// rank after a grace, and a barrier is refused (a worker under an agent enters barriers
    /// on the relay socket).
    async fn serve(self, mut inbound: Streaming<pb::WorkerMessage>) {
        let Self {
            ranks,
            rank,
            id,
            interval,
        } = self;
        let ranks = &ranks;
        loop {
            let received = match heard(interval, &mut inbound).await {
                Some(received) => received,
                None => {
                    ranks.gone(rank, id);
                    tracing::warn!(rank, "a worker's session at the gateway went silent");
                    ranks.lost(rank, no_heartbeat(interval * HEARTBEATS_PER_TIMEOUT));
                    return;
                }
            };
            match received {
            Ok(Some(pb::WorkerMessage { kind })) => match kind {
                Some(worker_message::Kind::Heartbeat(_)) => {}
                Some(worker_message::Kind::Step(pb::StepBegun { step })) => ranks.step(rank, step),
                Some(worker_message::Kind::Healed(pb::Healed { epoch })) => {
                    ranks.relay(pb::relay_message::Kind::RankHealed(pb::RankHealed { rank, epoch }));
                }
                Some(worker_message::Kind::Leave(_)) => {
                    ranks.leave(rank, id);
                    return;
                }
                Some(worker_message::Kind::Barrier(entry)) => ranks.send(
                    rank,
                    id,
                    Ok(pb::CoordinatorMessage {
                        kind: Some(coordinator_message::Kind::Barrier(pb::BarrierResult {
                            scope: entry.scope,
                            seq: entry.seq,
                            error: Some(pb::BarrierError {
                                message: "under muster-agent, barriers are entered on the agent's relay socket (MUSTER_AGENT_SOCKET), not on the session".into(),
                                ..Default::default()
                            }),
                        })),
                    }),
                ),
                Some(worker_message::Kind::Register(_)) | None => {
                    ranks.send(
                        rank,
                        id,
                        Err(Status::invalid_argument(
                            "register may only be the first message of a session",
                        )),
                    );
                    ranks.gone(rank, id);
                    return;
                }
            },
            Ok(None) | Err(_) => {
                // After a grace, so that the supervisor's report of the process's end (exit
                // status, stderr) usually comes first and names the cause.
                ranks.gone(rank, id);
                tokio::time::sleep(AGENT_REPORT_GRACE).await;
                ranks.lost(rank, SESSION_LOST.to_owned());
                return;
            }
            }
        }
    }
}

/// The worker's next message, or `None` when it sent nothing for the heartbeat timeout
/// (`HEARTBEATS_PER_TIMEOUT` intervals) and then for one more interval. The extra interval
/// is for a pause of the agent itself: when a stopped agent runs again its timers may fire
/// before it has read the heartbeats waiting in the socket, and they arrive within it.
async fn heard(
    interval: Duration,
    inbound: &mut Streaming<pb::WorkerMessage>,
) -> Option<Result<Option<pb::WorkerMessage>, Status>> {
    // `Streaming::message` is cancel-safe: a message half read stays in the stream.
    match tokio::time::timeout(interval * HEARTBEATS_PER_TIMEOUT, inbound.message()).await {
        Ok(received) => Some(received),
        Err(_) => tokio::time::timeout(interval, inbound.message()).await.ok(),
    }
}

/// Forwards one unary call to the coordinator (see the module doc).
async fn forward(
    coordinators: Coordinators,
    request: axum::extract::Request,
) -> http::Response<tonic::body::Body> {
    let path = request.uri().path().to_owned();
    // The coordinator bounds what it takes and what it sends; the gateway passes both on.
    tonic::server::Grpc::new(Raw)
        .max_decoding_message_size(MAX_MESSAGE_BYTES)
        .max_encoding_message_size(MAX_MESSAGE_BYTES)
        .unary(Forward { coordinators, path }, request)
        .await
}

/// One forwarded call.
struct Forward {
    coordinators: Coordinators,
    path: String,
}

impl tonic::server::UnaryService<Bytes> for Forward {
    type Response = Bytes;
    type Future = Pin<Box<dyn Future<Output = Result<Response<Bytes>, Status>> + Send>>;

    fn call(&mut self, request: Request<Bytes>) -> Self::Future {
        let coordinators = self.coordinators.clone();
        let path = self.path.clone();
        Box::pin(async move {
            let path: http::uri::PathAndQuery = path
                .parse()
                .map_err(|_| Status::unimplemented(format!("no method {path}")))?;
            let (mut metadata, _, body) = request.into_parts();
            // The agent's own credentials go with the call.
            metadata.remove("authorization");
            let result = coordinators
                .call_if(
                    path.as_str(),
                    |status| classify_call(status) == Verdict::NotApplied,
                    |channel| {
                        let request = Request::from_parts(
                            metadata.clone(),
                            tonic::Extensions::default(),
                            body.clone(),
                        );
                        let path = path.clone();
                        async move {
                            let mut grpc = tonic::client::Grpc::new(channel)
                                .max_decoding_message_size(MAX_MESSAGE_BYTES)
                                .max_encoding_message_size(MAX_MESSAGE_BYTES);
                            grpc.ready().await.map_err(|e| {
                                Status::unavailable(format!("the coordinator is not ready: {e}"))
                            })?;
                            grpc.unary(request, path, Raw).await
                        }
                    },
                )
                .await;
            match result {
                Ok(response) => Ok(Response::new(response.into_inner())),
                Err(Failed { status, .. }) if classify_call(&status) == Verdict::Final => {
                    Err(Status::new(status.code(), status.message()))
                }
                Err(Failed { status, addr }) => {
                    // The coordinator may or may not have run it: the worker's SDK decides
                    // whether to send it again, and finds the agent on the next replica.
                    let leader = failover::leader_hint(&status);
                    coordinators.failed(&addr, leader.as_deref());
                    Err(Status::unavailable(format!(
                        "the agent lost the call to the coordinator: {}",
                        status.message()
                    )))
                }
            }
        })
    }
}

/// Messages as their encoded bytes: the gateway forwards them without decoding.
#[derive(Debug, Clone, Copy, Default)]
struct Raw;

impl Codec for Raw {
    type Encode = Bytes;
    type Decode = Bytes;
    type Encoder = Raw;
    type Decoder = Raw;

    fn encoder(&mut self) -> Raw {
        Raw
    }

    fn decoder(&mut self) -> Raw {
        Raw
    }
}

impl Encoder for Raw {
    type Item = Bytes;
    type Error = Status;

    fn encode(&mut self, item: Bytes, dst: &mut EncodeBuf<'_>) -> Result<(), Status> {
        dst.put(item);
        Ok(())
    }
}

impl Decoder for Raw {
    type Item = Bytes;
    type Error = Status;

    fn decode(&mut self, src: &mut DecodeBuf<'_>) -> Result<Option<Bytes>, Status> {
        Ok(Some(src.copy_to_bytes(src.remaining())))
    }
}
