//! The connection cap: at most `max_connections` client connections are served at once; the
//! acceptor stops accepting while all are taken, so further clients wait in the kernel's
//! listen backlog (and then time out in their own connect logic) instead of exhausting the
//! coordinator's file descriptors and memory.

use futures::Stream;
use std::io;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::task::{Context, Poll};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tonic::transport::server::Connected;

/// A connection that holds one of the cap's permits for as long as it lives (the server drops
/// it when the HTTP/2 connection ends, which frees the slot).
pub struct Limited<T> {
    inner: T,
    _permit: OwnedSemaphorePermit,
}

/// Accepts from `incoming` only while fewer than `max` accepted connections are alive.
///
/// The permit is taken *before* the next accept, so a full coordinator leaves new connections
/// in the listen backlog rather than accepting and dropping them. Accept errors pass through
/// (the server logs and skips them) and give their permit back.
pub fn limit_connections<S, T>(
    incoming: S,
    max: usize,
) -> impl Stream<Item = Result<Limited<T>, io::Error>> + Send + 'static
where
    S: Stream<Item = Result<T, io::Error>> + Send + Unpin + 'static,
    T: Send + 'static,
{
    use futures::StreamExt as _;
    let slots = Arc::new(Semaphore::new(max));
    // Whether the "cap reached" warning is due: once per time the cap fills up.
    let warn = Arc::new(AtomicBool::new(true));
    futures::stream::unfold(incoming, move |mut incoming| {
        let slots = Arc::clone(&slots);
        let warn = Arc::clone(&warn);
        async move {
            let permit = match Arc::clone(&slots).try_acquire_owned() {
                Ok(p) => {
                    warn.store(true, Ordering::Relaxed);
                    p
                }
                Err(_) => {
                    if warn.swap(false, Ordering::Relaxed) {
                        tracing::warn!(
                            max_connections = max,
                            "connection limit reached; new connections wait until one closes"
                        );
                    }
                    // The semaphore is never closed, so this only waits.
                    slots.acquire_owned().await.ok()?
                }
            };
            let next = incoming.next().await?;
            Some((
                next.map(|inner| Limited {
                    inner,
                    _permit: permit,
                }),
                incoming,
            ))
        }
    })
}

impl<T: Connected> Connected for Limited<T> {
    type ConnectInfo = T::ConnectInfo;

    fn connect_info(&self) -> Self::ConnectInfo {
        self.inner.connect_info()
    }
}

impl<T: AsyncRead + Unpin> AsyncRead for Limited<T> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_read(cx, buf)
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
