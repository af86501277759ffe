//! The coordinator's resource limits that are not a single check in a handler:
//!
//! - the connection cap: at most `max_connections` client connections are served at once; the
//!   acceptor stops accepting while all are taken, so further clients wait in the kernel's
//!   listen backlog (and then time out in their own connect logic) instead of exhausting the
//!   coordinator's file descriptors and memory;
//! - the per-peer cap: at most `max_connections_per_peer` of them from one IP address (more
//!   are closed as soon as they are accepted), so one host cannot take every slot;
//! - the handshake deadline: a connection that has not finished its TLS and HTTP/2 handshakes
//!   and sent its first call within `handshake_timeout` is closed, so sockets that send
//!   nothing (or stop half-way through a handshake) cannot hold slots (issue 14, finding 4);
//! - the message size check ([`MessageSizeLayer`]), which refuses an oversized request with a
//!   status that names the limit and the flag that raises it;
//! - the stored-bytes account ([`StoredBytes`]) over every job's key-value data and published
//!   values, bounded by `max_total_bytes`.

use futures::Stream;
use std::collections::HashMap;
use std::io;
use std::net::IpAddr;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tonic::Status;
use tonic::transport::server::{Connected, TcpConnectInfo};

use muster_core::model::JobId;

/// The connection limits [`limit_connections`] enforces (from the [`Config`](crate::Config)).
#[derive(Debug, Clone, Copy)]
pub struct ConnectionLimits {
    /// Connections served at once (`max_connections`).
    pub max: usize,
    /// Connections from one peer IP address (`max_connections_per_peer`).
    pub per_peer: usize,
    /// Time to finish the handshakes and send a first call (`handshake_timeout`).
    pub handshake_timeout: Duration,
}

/// A connection that holds one of the cap's permits (and its peer's count) for as long as it
/// lives (the server drops it when the connection ends, which frees the slot), and that fails
/// its reads once its handshake deadline passes before its first call.
pub struct Limited<T> {
    inner: T,
    _permit: OwnedSemaphorePermit,
    _peer: Option<PeerSlot>,
    /// Armed until the first call: when it fires first, reads fail and the server drops the
    /// connection (a TLS handshake in progress included).
    handshake: Option<Pin<Box<tokio::time::Sleep>>>,
    state: Arc<ConnState>,
}

/// What the connection and the calls made on it share.
#[derive(Debug, Default)]
struct ConnState {
    /// A call arrived on this connection: its handshakes are done.
    established: AtomicBool,
}

/// One connection's share of its peer's count; gives it back when dropped.
struct PeerSlot {
    ip: IpAddr,
    peers: Arc<Mutex<HashMap<IpAddr, usize>>>,
}

impl Drop for PeerSlot {
    fn drop(&mut self) {
        let mut peers = self.peers.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(n) = peers.get_mut(&self.ip) {
            *n -= 1;
            if *n == 0 {
                peers.remove(&self.ip);
            }
        }
    }
}

/// Accepts from `incoming` only while fewer than `limits.max` accepted connections are alive,
/// and fewer than `limits.per_peer` from the new connection's peer address.
///
/// The permit is taken *before* the next accept, so a full coordinator leaves new connections
/// in the listen backlog rather than accepting and dropping them. A connection over its
/// peer's cap is closed at once (its permit goes to the next accept). Accept errors pass
/// through (the server logs and skips them) and give their permit back.
pub fn limit_connections<S, T>(
    incoming: S,
    limits: ConnectionLimits,
) -> impl Stream<Item = Result<Limited<T>, io::Error>> + Send + 'static
where
    S: Stream<Item = Result<T, io::Error>> + Send + Unpin + 'static,
    T: Connected<ConnectInfo = TcpConnectInfo> + Send + 'static,
{
    use futures::StreamExt as _;
    let slots = Arc::new(Semaphore::new(limits.max));
    let peers: Arc<Mutex<HashMap<IpAddr, usize>>> = Arc::default();
    // Whether the "cap reached" warning is due: once per time the cap fills up.
    let warn = Arc::new(AtomicBool::new(true));
    // When a peer's cap was last warned about: at most one warning per PEER_WARN_EVERY.
    let warn_peer: Arc<Mutex<Option<tokio::time::Instant>>> = Arc::default();
    futures::stream::unfold(incoming, move |mut incoming| {
        let (slots, peers) = (Arc::clone(&slots), Arc::clone(&peers));
        let (warn, warn_peer) = (Arc::clone(&warn), Arc::clone(&warn_peer));
        async move {
            let permit = match Arc::clone(&slots).try_acquire_owned() {
                Ok(p) => {
                    warn.store(true, Ordering::Relaxed);
                    p
                }
                Err(_) => {
                    if warn.swap(false, Ordering::Relaxed) {
                        tracing::warn!(
                            max_connections = limits.max,
                            "connection limit reached; new connections wait until one closes (--max-connections)"
                        );
                    }
                    // The semaphore is never closed, so this only waits.
                    slots.acquire_owned().await.ok()?
                }
            };
            loop {
                let inner = match incoming.next().await? {
                    Ok(inner) => inner,
                    Err(e) => return Some((Err(e), incoming)),
                };
                let ip = inner
                    .connect_info()
                    .remote_addr()
                    .map(|a| a.ip().to_canonical());
                let peer = match ip {
                    Some(ip) => {
                        let mut counts = peers.lock().unwrap_or_else(|e| e.into_inner());
                        let n = counts.entry(ip).or_insert(0);
                        if *n >= limits.per_peer {
                            drop(counts);
                            if due(&warn_peer) {
                                tracing::warn!(
                                    peer = %ip,
                                    max_connections_per_peer = limits.per_peer,
                                    "a peer reached its connection limit; its further connections are closed (--max-connections-per-peer)"
                                );
                            }
                            // Closed here: the permit serves the next accept.
                            drop(inner);
                            continue;
                        }
                        *n += 1;
                        Some(PeerSlot {
                            ip,
                            peers: Arc::clone(&peers),
                        })
                    }
                    None => None,
                };
                let limited = Limited {
                    inner,
                    _permit: permit,
                    _peer: peer,
                    handshake: Some(Box::pin(tokio::time::sleep(limits.handshake_timeout))),
                    state: Arc::default(),
                };
                return Some((Ok(limited), incoming));
            }
        }
    })
}

/// How often the per-peer cap may be warned about.
const PEER_WARN_EVERY: Duration = Duration::from_secs(10);

/// Whether a per-peer cap warning is due now (and records it).
fn due(last: &Mutex<Option<tokio::time::Instant>>) -> bool {
    let now = tokio::time::Instant::now();
    let mut last = last.lock().unwrap_or_else(|e| e.into_inner());
    if last.is_some_and(|at| now.duration_since(at) < PEER_WARN_EVERY) {
        return false;
    }
    *last = Some(now);
    true
}

/// A connection's info as calls see it (in their request extensions): the TCP info, and the
/// handle that [`FirstCallLayer`] marks once a call arrives.
#[derive(Debug, Clone)]
pub struct LimitedInfo<I> {
    inner: I,
    state: Arc<ConnState>,
}

impl<I> LimitedInfo<I> {
    /// The underlying connection's info (peer and local addresses).
    pub fn get_ref(&self) -> &I {
        &self.inner
    }
}

impl<T: Connected> Connected for Limited<T> {
    type ConnectInfo = LimitedInfo<T::ConnectInfo>;

    fn connect_info(&self) -> Self::ConnectInfo {
        LimitedInfo {
            inner: self.inner.connect_info(),
            state: Arc::clone(&self.state),
        }
    }
}

impl<T: AsyncRead + Unpin> AsyncRead for Limited<T> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = &mut *self;
        if let Some(deadline) = &mut this.handshake {
            if this.state.established.load(Ordering::Relaxed) {
                this.handshake = None;
            } else if deadline.as_mut().poll(cx).is_ready() {
                // Every handshake has a read pending while it waits for the peer, so this is
                // where an idle connection ends; the server then drops it and frees its slot.
                return Poll::Ready(Err(io::Error::new(
                    io::ErrorKind::TimedOut,
                    "no call within the handshake timeout (--handshake-timeout-ms)",
                )));
            }
        }
        Pin::new(&mut this.inner).poll_read(cx, buf)
    }
}

impl<T: AsyncWrite + Unpin> AsyncWrite for Limited<T> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write(cx, buf)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }
}

/// A tower layer that marks a connection established when its first call arrives (which
/// disarms its handshake deadline, see [`Limited`]).
#[derive(Debug, Clone, Copy, Default)]
pub struct FirstCallLayer;

impl<S> tower_layer::Layer<S> for FirstCallLayer {
    type Service = FirstCall<S>;

    fn layer(&self, inner: S) -> FirstCall<S> {
        FirstCall(inner)
    }
}

/// The service [`FirstCallLayer`] wraps around the gRPC router.
#[derive(Debug, Clone)]
pub struct FirstCall<S>(S);

impl<S, B> tower_service::Service<http::Request<B>> for FirstCall<S>
where
    S: tower_service::Service<http::Request<B>>,
{
    type Response = S::Response;
    type Error = S::Error;
    type Future = S::Future;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.0.poll_ready(cx)
    }

    fn call(&mut self, request: http::Request<B>) -> Self::Future {
        type Info = LimitedInfo<TcpConnectInfo>;
        let ext = request.extensions();
        let state = ext.get::<Info>().map(|i| &i.state).or_else(|| {
            ext.get::<tonic::transport::server::TlsConnectInfo<Info>>()
                .map(|i| &i.get_ref().state)
        });
        if let Some(state) = state {
            state.established.store(true, Ordering::Relaxed);
        }
        self.0.call(request)
    }
}

/// A tower layer that refuses a request message longer than `max` bytes with OUT_OF_RANGE
/// (tonic's code for it, kept for clients that test it) naming the limit and the flag that
/// raises it (tonic's own check, which stays behind it, says only "decoded message length too
/// large").
///
/// It reads the gRPC framing (a flag byte and a 4-byte big-endian length before every
/// message) as the request body streams in, so a stream's oversized message is refused the
/// same way as a unary call's, before its bytes are buffered.
#[derive(Debug, Clone, Copy)]
pub struct MessageSizeLayer {
    /// The largest message accepted (`max_message_bytes`).
    pub max: usize,
}

impl<S> tower_layer::Layer<S> for MessageSizeLayer {
    type Service = MessageSize<S>;

    fn layer(&self, inner: S) -> MessageSize<S> {
        MessageSize {
            inner,
            max: self.max,
        }
    }
}

/// The service [`MessageSizeLayer`] wraps around the gRPC router.
#[derive(Debug, Clone)]
pub struct MessageSize<S> {
    inner: S,
    max: usize,
}

impl<S> tower_service::Service<http::Request<tonic::body::Body>> for MessageSize<S>
where
    S: tower_service::Service<http::Request<tonic::body::Body>>,
{
    type Response = S::Response;
    type Error = S::Error;
    type Future = S::Future;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: http::Request<tonic::body::Body>) -> Self::Future {
        let max = self.max;
        self.inner.call(request.map(|body| {
            tonic::body::Body::new(Framed {
                inner: body,
                max,
                header: [0; 5],
                have: 0,
                remaining: 0,
            })
        }))
    }
}

/// A request body whose gRPC message lengths are checked as they arrive.
struct Framed {
    inner: tonic::body::Body,
    max: usize,
    /// The message header being read, and how many of its 5 bytes are in.
    header: [u8; 5],
    have: usize,
    /// Bytes of the current message still to come.
    remaining: usize,
}

impl Framed {
    /// Follows the framing through `data`; the error is the status the caller sees.
    fn check(&mut self, data: &[u8]) -> Result<(), Status> {
        let mut at = 0;
        while at < data.len() {
            if self.remaining > 0 {
                let n = self.remaining.min(data.len() - at);
                self.remaining -= n;
                at += n;
                continue;
            }
            self.header[self.have] = data[at];
            self.have += 1;
            at += 1;
            if self.have == self.header.len() {
                self.have = 0;
                let [_, a, b, c, d] = self.header;
                let len = u32::from_be_bytes([a, b, c, d]) as usize;
                if len > self.max {
                    return Err(too_large(len, self.max));
                }
                self.remaining = len;
            }
        }
        Ok(())
    }
}

/// The status of a request message of `len` bytes over the limit of `max`.
pub fn too_large(len: usize, max: usize) -> Status {
    Status::out_of_range(format!(
        "request message is {len} bytes; the coordinator's limit is {max} bytes (max_message_bytes: raise it with --max-message-bytes, MUSTER_COORDINATOR_MAX_MESSAGE_BYTES or max_message_bytes in the config file, up to 1073741824)"
    ))
}

impl hyper::body::Body for Framed {
    type Data = hyper::body::Bytes;
    type Error = Status;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<hyper::body::Frame<Self::Data>, Self::Error>>> {
        let this = &mut *self;
        let frame = match Pin::new(&mut this.inner).poll_frame(cx) {
            Poll::Ready(Some(Ok(frame))) => frame,
            Poll::Ready(Some(Err(e))) => return Poll::Ready(Some(Err(e))),
            Poll::Ready(None) => return Poll::Ready(None),
            Poll::Pending => return Poll::Pending,
        };
        if let Some(data) = frame.data_ref()
            && let Err(status) = this.check(data)
        {
            return Poll::Ready(Some(Err(status)));
        }
        Poll::Ready(Some(Ok(frame)))
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> hyper::body::SizeHint {
        self.inner.size_hint()
    }
}

/// The account of stored bytes (key-value data and published values) over every job, bounded
/// by `max_total_bytes`: a write reserves its growth here before it reaches the store, and a
/// removed job gives its bytes back. One small lock, never held across an `.await`.
#[derive(Debug)]
pub struct StoredBytes {
    max: usize,
    state: Mutex<Account>,
}

#[derive(Debug, Default)]
struct Account {
    total: usize,
    by_job: HashMap<JobId, usize>,
}

impl StoredBytes {
    /// An empty account with a bound of `max` bytes.
    pub fn new(max: usize) -> Self {
        Self {
            max,
            state: Mutex::default(),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Account> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Reserves `grow` more bytes for `job`, or says which limit refuses them (`what`: the
    /// write, for the message). Give them back with [`StoredBytes::release`] if the write
    /// does not happen.
    pub fn reserve(&self, job: &JobId, grow: usize, what: &str) -> Result<(), Status> {
        if grow == 0 {
            return Ok(());
        }
        let mut a = self.lock();
        let next = a.total.saturating_add(grow);
        if next > self.max {
            return Err(Status::resource_exhausted(format!(
                "{what} in job '{job}' would bring the coordinator's stored bytes over all jobs to {next}; the limit is {} (max_total_bytes: raise it with --max-total-bytes, or delete keys; finished jobs' data goes when they expire, --finished-job-ttl-ms)",
                self.max
            )));
        }
        a.total = next;
        *a.by_job.entry(job.clone()).or_insert(0) += grow;
        Ok(())
    }

    /// Gives back `shrink` bytes of `job` (a deleted or smaller value, or a reservation whose
    /// write did not happen).
    pub fn release(&self, job: &JobId, shrink: usize) {
        let mut a = self.lock();
        let Some(n) = a.by_job.get_mut(job) else {
            return;
        };
        let shrink = shrink.min(*n);
        *n -= shrink;
        if *n == 0 {
            a.by_job.remove(job);
        }
        a.total -= shrink;
    }

    /// Forgets `job` (it was removed); returns the bytes it held.
    pub fn forget(&self, job: &JobId) -> usize {
        let mut a = self.lock();
        let n = a.by_job.remove(job).unwrap_or(0);
        a.total -= n;
        n
    }

    /// Replaces the whole account (a new leader loaded the jobs from the store).
    pub fn reset(&self, by_job: HashMap<JobId, usize>) {
        let mut a = self.lock();
        a.total = by_job.values().sum();
        a.by_job = by_job;
    }

    /// Bytes stored over all jobs.
    pub fn total(&self) -> usize {
        self.lock().total
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    fn frame(len: u32) -> Vec<u8> {
        let mut v = vec![0];
        v.extend_from_slice(&len.to_be_bytes());
        v
    }

    #[tokio::test]
    async fn framing_is_followed_across_chunks() {
        let mut f = Framed {
            inner: tonic::body::Body::empty(),
            max: 10,
            header: [0; 5],
            have: 0,
            remaining: 0,
        };
        // Two messages of 10 and 3 bytes, split at awkward places.
        let mut bytes = frame(10);
        bytes.extend_from_slice(&[1; 10]);
        bytes.extend(frame(3));
        bytes.extend_from_slice(&[2; 3]);
        for chunk in bytes.chunks(3) {
            f.check(chunk).unwrap();
        }
        // A header split over two chunks that declares 11 bytes.
        let big = frame(11);
        f.check(&big[..2]).unwrap();
        let e = f.check(&big[2..]).unwrap_err();
        assert_eq!(e.code(), tonic::Code::OutOfRange);
        assert!(e.message().contains("--max-message-bytes"), "{e:?}");
    }

    #[test]
    fn stored_bytes_are_bounded_and_given_back() {
        let a = JobId::parse("a").unwrap();
        let b = JobId::parse("b").unwrap();
        let s = StoredBytes::new(100);
        s.reserve(&a, 60, "a write").unwrap();
        let e = s.reserve(&b, 41, "set 'k'").unwrap_err();
        assert_eq!(e.code(), tonic::Code::ResourceExhausted);
        assert!(e.message().contains("job 'b'") && e.message().contains("--max-total-bytes"));
        s.reserve(&b, 40, "a write").unwrap();
        s.release(&a, 10);
        assert_eq!(s.total(), 90);
        assert_eq!(s.forget(&a), 50);
        assert_eq!(s.total(), 40);
        s.reset(HashMap::from([(a.clone(), 7)]));
        assert_eq!(s.total(), 7);
    }
}
