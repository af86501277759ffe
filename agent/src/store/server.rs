//! The agent store's listener and one task per connection: reads requests with
//! [`protocol::parse`], runs them on the [`Backend`] (mutations on the connection's own
//! [`KvLane`]: a connection's requests are sequential) and writes the replies. A blocking
//! `WAIT` (also what a blocking `queue_pop` sends first) keeps reading the connection while it
//! waits, so torch's `CANCEL_WAIT` (sent when the client's timeout runs out) is answered at
//! once.
//!
//! Order across connections ([`Writes`]): torch's server applies each request as it arrives,
//! so a write its client sends without waiting for a reply (`set`, `append`) is seen by every
//! request that arrives after it, from any client. The agent applies a write with a round trip
//! to the coordinator, so every request waits for the unanswered writes that arrived before it
//! (and such writes apply in their order of arrival).

use std::collections::BTreeSet;
use std::sync::{Arc, Mutex};

use muster::client::KvLane;
use tokio::sync::Notify;
use tokio::{
    io::{AsyncReadExt, AsyncWriteExt},
    net::{TcpListener, TcpStream},
};
use tokio_util::sync::CancellationToken;

use super::{
    backend::Backend,
    peers,
    protocol::{self, ProtocolError, Request},
};

/// Accepts until `stop`; each connection runs in its own task, which ends with `stop` too.
pub(super) async fn serve(listener: TcpListener, backend: Backend, stop: CancellationToken) {
    let writes = Arc::new(Writes::default());
    let Ok(store) = listener.local_addr() else {
        tracing::error!("agent store: its listener has no address");
        return;
    };
    loop {
        let accepted = tokio::select! {
            _ = stop.cancelled() => return,
            a = listener.accept() => a,
        };
        match accepted {
            Ok((stream, peer)) => {
                let _ = stream.set_nodelay(true);
                let backend = backend.clone();
                let writes = Arc::clone(&writes);
                let stop = stop.clone();
                // Policy: a connection's failure is logged and ends that connection only.
                tokio::spawn(async move {
                    // Only this agent's workers and their children (`peers`); anyone else's
                    // connection is closed at once, which torch's client reports as its
                    // connection error.
                    let admitted =
                        tokio::task::spawn_blocking(move || peers::admit(store, peer)).await;
                    match admitted {
                        Ok(Ok(())) => {}
                        Ok(Err(who)) => {
                            tracing::warn!(
                                "agent store: refused a connection from {peer}: {who}; only this agent's workers may use the job's store"
                            );
                            return;
                        }
                        Err(_) => return,
                    }
                    tokio::select! {
                        _ = stop.cancelled() => {}
                        r = Connection::new(stream, backend, writes).run() => {
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

/// The store's unanswered writes in their order of arrival, over every connection: see the
/// module's doc.
#[derive(Default)]
struct Writes {
    state: Mutex<WritesState>,
    /// Signalled whenever a write is done.
    done: Notify,
}

#[derive(Default)]
struct WritesState {
    /// The number the next unanswered write gets.
    next: u64,
    /// The unanswered writes not done yet.
    pending: BTreeSet<u64>,
}

/// A request's place in the order: it runs after every unanswered write that arrived before
/// it, and, if it is one, is done when dropped.
struct Turn {
    writes: Arc<Writes>,
    /// The writes that arrived before this request number below this.
    before: u64,
    own: Option<u64>,
}

impl Writes {
    /// The turn of a request arriving now (`write`: an unanswered write).
    fn arrive(self: &Arc<Self>, write: bool) -> Turn {
        let mut st = self.lock();
        let before = st.next;
        let own = write.then(|| {
            st.next += 1;
            st.pending.insert(before);
            before
        });
        Turn {
            writes: Arc::clone(self),
            before,
            own,
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, WritesState> {
        // A panic elsewhere while holding it leaves plain numbers: still usable.
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }
}

impl Turn {
    /// Returns once every unanswered write that arrived before this request is done (applied,
    /// or failed with its connection).
    async fn ready(&self) {
        loop {
            let done = self.writes.done.notified();
            tokio::pin!(done);
            // Registered before the check, so a write done in between still wakes it.
            done.as_mut().enable();
            let waiting = self
                .writes
                .lock()
                .pending
                .first()
                .is_some_and(|&first| first < self.before);
            if !waiting {
                return;
            }
            done.await;
        }
    }
}

impl Drop for Turn {
    fn drop(&mut self) {
        if let Some(own) = self.own {
            self.writes.lock().pending.remove(&own);
            self.writes.done.notify_waiters();
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
    writes: Arc<Writes>,
    /// The connection's lane for mutations that must be applied once across a failover.
    lane: KvLane,
    buf: Vec<u8>,
    validated: bool,
}

impl Connection {
    fn new(stream: TcpStream, backend: Backend, writes: Arc<Writes>) -> Self {
        Self {
            stream,
            writes,
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

    /// Serves until the client leaves. A protocol error before the handshake is written
    /// back as text (a human with `nc` sees what was expected); after it, a torch client
    /// would read text as its reply, so the connection is only closed, as torch's server
    /// closes it (unread bytes make it a reset: the client's call, or its next, raises).
    async fn run(mut self) -> Result<(), ConnError> {
        let result = self.serve().await;
        if let Err(ConnError::Protocol(e)) = &result {
            tracing::error!("agent store refused a client: {e}");
            if !self.validated {
                let _ = self.stream.write_all(format!("{e}\n").as_bytes()).await;
                let _ = self.stream.shutdown().await;
            }
        }
        result
    }

    async fn serve(&mut self) -> Result<(), ConnError> {
        while let Some(request) = self.next().await? {
            let turn = self.writes.arrive(request.is_unanswered_write());
            turn.ready().await;
            let mut out = Vec::new();
            self.handle(request, &mut out).await?;
            drop(turn);
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
            Request::Set { key, value } => b.set(lane, &key, value).await?,
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
            Request::DeleteKey { key } => {
                protocol::put_i64(out, i64::from(b.delete(lane, &key).await?))
            }
            Request::Append { key, value } => b.append(lane, &key, &value).await?,
            Request::MultiGet { keys } => {
                for key in keys {
                    protocol::put_bytes(out, &b.get(&key).await?);
                }
            }
            Request::MultiSet { pairs } => {
                for (key, value) in pairs {
                    b.set(lane, &key, value).await?;
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
