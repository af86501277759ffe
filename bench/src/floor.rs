//! The transport floor of a barrier over node streams (`scale --paths floor`): a bare `Relay`
//! server with no muster logic, which answers each stream's `register` and releases barrier
//! `s` to every stream once every stream entered it. It runs on a runtime of its own, as the
//! coordinator process does, so what a barrier costs against it is what the scale bench's
//! node-path barrier would cost if the coordinator did nothing but take the entries in and
//! send the results out through tonic and h2.

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};

use muster_proto::v1 as pb;
use tokio::sync::mpsc;
use tokio_stream::wrappers::UnboundedReceiverStream;
use tonic::{Request, Response, Status, Streaming};

/// The floor server, listening on a loopback port; stopped on drop.
pub struct Floor {
    /// Where it listens.
    pub addr: SocketAddr,
    runtime: Option<tokio::runtime::Runtime>,
}

impl Drop for Floor {
    fn drop(&mut self) {
        if let Some(runtime) = self.runtime.take() {
            runtime.shutdown_background();
        }
    }
}

/// One result stream to a node.
type Outbox = mpsc::UnboundedSender<Result<pb::RelayEvent, Status>>;

/// The barrier every node enters in turn.
struct Barrier {
    /// How many streams take part (each barrier is released when all have entered it).
    nodes: usize,
    /// Streams that entered the open barrier.
    entered: usize,
    /// Every attached stream's outbox.
    streams: Vec<Outbox>,
}

#[derive(Clone)]
struct Service(Arc<Mutex<Barrier>>);

#[tonic::async_trait]
impl pb::relay_server::Relay for Service {
    type AttachStream = UnboundedReceiverStream<Result<pb::RelayEvent, Status>>;

    async fn attach(
        &self,
        request: Request<Streaming<pb::RelayMessage>>,
    ) -> Result<Response<Self::AttachStream>, Status> {
        let mut inbound = request.into_inner();
        let (tx, rx) = mpsc::unbounded_channel();
        match inbound.message().await?.and_then(|m| m.kind) {
            Some(pb::relay_message::Kind::Register(_)) => {}
            _ => return Err(Status::invalid_argument("register first")),
        }
        let _ = tx.send(Ok(pb::RelayEvent {
            kind: Some(pb::relay_event::Kind::Registered(pb::Registered::default())),
        }));
        self.0
            .lock()
            .map_err(|_| Status::internal("poisoned"))?
            .streams
            .push(tx);
        let barrier = Arc::clone(&self.0);
        tokio::spawn(async move {
            while let Ok(Some(message)) = inbound.message().await {
                let Some(pb::relay_message::Kind::Enter(entry)) = message.kind else {
                    continue;
                };
                let Ok(mut b) = barrier.lock() else {
                    return;
                };
                b.entered += 1;
                if b.entered < b.nodes {
                    continue;
                }
                b.entered = 0;
                for stream in &b.streams {
                    let _ = stream.send(Ok(pb::RelayEvent {
                        kind: Some(pb::relay_event::Kind::Barrier(pb::BarrierResult {
                            seq: entry.seq,
                            ..Default::default()
                        })),
                    }));
                }
            }
        });
        Ok(Response::new(UnboundedReceiverStream::new(rx)))
    }
}

/// Starts the floor server for `nodes` streams on a loopback port, on a runtime of its own
/// with the coordinator's server settings (no delay, HTTP/2 keep-alive).
pub fn start(nodes: usize) -> anyhow::Result<Floor> {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .thread_name("floor")
        .build()?;
    // Called from the bench's own runtime: the listener is made in this one's context, not
    // by blocking on it.
    let listener = std::net::TcpListener::bind("127.0.0.1:0")?;
    listener.set_nonblocking(true)?;
    let addr = listener.local_addr()?;
    let listener = {
        let _context = runtime.enter();
        tokio::net::TcpListener::from_std(listener)?
    };
    let service = Service(Arc::new(Mutex::new(Barrier {
        nodes,
        entered: 0,
        streams: Vec::with_capacity(nodes),
    })));
    runtime.spawn(
        tonic::transport::Server::builder()
            .tcp_nodelay(true)
            .http2_keepalive_interval(Some(std::time::Duration::from_secs(10)))
            .add_service(pb::relay_server::RelayServer::new(service))
            .serve_with_incoming(tonic::transport::server::TcpIncoming::from(listener)),
    );
    Ok(Floor {
        addr,
        runtime: Some(runtime),
    })
}
