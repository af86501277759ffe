//! The agent store's listener and one task per connection: reads requests with
//! [`protocol::parse`], runs them on the [`Backend`] (mutations on the connection's own
//! [`KvLane`]: a connection's requests are sequential) and writes the replies. A blocking `WAIT` (also
//! what a blocking `queue_pop` sends first) keeps reading the connection while it waits, so torch's `CANCEL_WAIT` (sent
//! when the client's timeout runs out) is answered at once.

use muster::client::KvLane;
use tokio::{
    io::{AsyncReadExt, AsyncWriteExt},
    net::{TcpListener, TcpStream},
};
use tokio_util::sync::CancellationToken;

use super::{
    backend::Backend,
    protocol::{self, ProtocolError, Request},
};

/// Accepts until `stop`; each connection runs in its own task, which ends with `stop` too.
pub(super) async fn serve(listener: TcpListener, backend: Backend, stop: CancellationToken) {
    loop {
        let accepted = tokio::select! {
            _ = stop.cancelled() => return,
            a = listener.accept() => a,
        };
        match accepted {
            Ok((stream, peer)) => {
                let _ = stream.set_nodelay(true);
                let backend = backend.clone();
                let stop = stop.clone();
                // Policy: a connection's failure is logged and ends that connection only.
                tokio::spawn(async move {
                    tokio::select! {
                        _ = stop.cancelled() => {}
                        r = Connection::new(stream, backend).run() => {
                            if let Err(e) = r {
                                tracing::warn!(%peer, "agent store connection closed: {e}");
                            }
                        }
                    }
                });
            }
            Err(e) => {
                tracing::warn!("agent store: accept failed: {e}");
                // Out of file descriptors and the like: do not spin.
                tokio::time::sleep(std::time::Duration::from_millis(50)).await;
            }
        }
    }
}

/// Why a connection ended early.
#[derive(Debug, thiserror::Error)]
enum ConnError {
    #[error("{0}")]
    Protocol(#[from] ProtocolError),
    #[error("the job's store at the coordinator failed: {0}")]
    Backend(#[from] muster::Error),
    #[error("{0}")]
    Io(#[from] std::io::Error),
    #[error("client sent {0} while a wait was pending (only CANCEL_WAIT is allowed)")]
    Unexpected(&'static str),
    #[error("the client sent BARRIER, which this agent store does not serve")]
    Barrier,
}

/// Whether a blocking operation completed or was cancelled by the client.
enum Blocked<T> {
    Done(T),
    Cancelled,
}

struct Connection {
    stream: TcpStream,
    backend: Backend,
    /// The connection's lane for mutations that must be applied once across a failover.
    lane: KvLane,
    buf: Vec<u8>,
    validated: bool,
}

impl Connection {
    fn new(stream: TcpStream, backend: Backend) -> Self {
        Self {
            stream,
            lane: backend.lane(),
            backend,
            buf: Vec::with_capacity(4096),
            validated: false,
        }
    }

    /// The next request; `None` when the client closed the connection.
    async fn next(&mut self) -> Result<Option<Request>, ConnError> {
        loop {
            if let Some(request) = self.parse()? {
                return Ok(Some(request));
            }
            if self.stream.read_buf(&mut self.buf).await? == 0 {
                return Ok(None);
            }
        }
    }

    /// A request from the bytes already read. A protocol error is written back (the client
    /// or a human with `nc` sees what was expected) before the connection closes.
    fn parse(&mut self) -> Result<Option<Request>, ConnError> {
        match protocol::parse(&self.buf, self.validated) {
            Ok(Some((request, used))) => {
                self.buf.drain(..used);
                Ok(Some(request))
            }
            Ok(None) => Ok(None),
            Err(e) => Err(e.into()),
        }
    }

    async fn run(mut self) -> Result<(), ConnError> {
        let result = self.serve().await;
        if let Err(ConnError::Protocol(e)) = &result {
            tracing::error!("agent store refused a client: {e}");
            let _ = self.stream.write_all(format!("{e}\n").as_bytes()).await;
            let _ = self.stream.shutdown().await;
        }
        result
    }

    async fn serve(&mut self) -> Result<(), ConnError> {
        while let Some(request) = self.next().await? {
            let mut out = Vec::new();
            self.handle(request, &mut out).await?;
            if !out.is_empty() {
                self.stream.write_all(&out).await?;
            }
        }
        Ok(())
    }

    async fn handle(&mut self, request: Request, out: &mut Vec<u8>) -> Result<(), ConnError> {
        let b = self.backend.clone();
        let lane = &mut self.lane;
        match request {
            Request::Validate => self.validated = true,
            Request::Ping { nonce } => protocol::put_u32(out, nonce),
            Request::Set { key, value } => b.set(&key, value).await?,
            Request::CompareSet {
                key,
                expected,
                desired,
            } => protocol::put_bytes(out, &b.compare_set(lane, &key, expected, desired).await?),
            Request::Get { key } => protocol::put_bytes(out, &b.get(&key).await?),
            Request::Add { key, delta } => protocol::put_i64(out, b.add(lane, &key, delta).await?),
            Request::Check { keys } => out.push(if b.check(&keys).await? {
                protocol::CHECK_READY
            } else {
                protocol::CHECK_NOT_READY
            }),
            Request::Wait { keys } => match self.blocking(b.wait(&keys)).await? {
                Blocked::Done(()) => out.push(protocol::STOP_WAITING),
                Blocked::Cancelled => out.push(protocol::WAIT_CANCELED),
            },
            // Outside a wait there is nothing to cancel; torch's server answers all the same.
            Request::CancelWait => out.push(protocol::WAIT_CANCELED),
            Request::NumKeys => protocol::put_i64(out, b.num_keys().await?),
            Request::DeleteKey { key } => protocol::put_i64(out, i64::from(b.delete(&key).await?)),
            Request::Append { key, value } => b.append(lane, &key, &value).await?,
            Request::MultiGet { keys } => {
                for key in keys {
                    protocol::put_bytes(out, &b.get(&key).await?);
                }
            }
            Request::MultiSet { pairs } => {
                for (key, value) in pairs {
                    b.set(&key, value).await?;
                }
            }
            Request::QueuePush { key, value } => b.queue_push(lane, &key, value).await?,
            // A count of items (0: empty, the client raises `DistQueueEmptyError`), then the item.
            Request::QueuePop { key } => match b.queue_pop(lane, &key).await? {
                Some(value) => {
                    protocol::put_i64(out, 1);
                    protocol::put_bytes(out, &value);
                }
                None => protocol::put_i64(out, 0),
            },
            Request::QueueLen { key } => protocol::put_i64(out, b.queue_len(&key).await?),
            Request::ListKeys => {
                let keys = b.list_keys().await?;
                protocol::put_i64(out, keys.len() as i64);
                for key in keys {
                    protocol::put_bytes(out, key.as_bytes());
                }
            }
            Request::Barrier { .. } => return Err(ConnError::Barrier),
        }
        Ok(())
    }

    /// Runs `op` while reading the connection: a `CANCEL_WAIT` from the client drops `op`
    /// (every blocking backend operation is cancel-safe) and is answered by the caller; the
    /// client closing the connection ends it.
    async fn blocking<T>(
        &mut self,
        op: impl Future<Output = Result<T, muster::Error>>,
    ) -> Result<Blocked<T>, ConnError> {
        tokio::pin!(op);
        loop {
            if let Some(request) = self.parse()? {
                return match request {
                    Request::CancelWait => Ok(Blocked::Cancelled),
                    _ => Err(ConnError::Unexpected("another request")),
                };
            }
            tokio::select! {
                r = &mut op => return Ok(Blocked::Done(r?)),
                n = self.stream.read_buf(&mut self.buf) => {
                    if n? == 0 {
                        return Err(std::io::Error::from(std::io::ErrorKind::UnexpectedEof).into());
                    }
                }
            }
        }
    }
}
