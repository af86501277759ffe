//! A fake systemd notify socket (`$NOTIFY_SOCKET`, sd_notify(3)) for the tests of the daemons'
//! READY, WATCHDOG and STOPPING notifications: a datagram socket in a temporary directory
//! (removed on drop) whose messages can be awaited.

use std::os::unix::net::UnixDatagram;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

/// A bound notify socket: give [`NotifySocket::path`] to a process as `NOTIFY_SOCKET`.
#[derive(Debug)]
pub struct NotifySocket {
    socket: UnixDatagram,
    path: PathBuf,
    dir: PathBuf,
}

impl NotifySocket {
    /// Binds `notify.sock` in a fresh temporary directory named after `tag`; receives time
    /// out after 100 ms, so that the waits below can check their deadlines.
    pub fn bind(tag: &str) -> Self {
        static NEXT: AtomicUsize = AtomicUsize::new(0);
        let dir = std::env::temp_dir().join(format!(
            "muster-notify-{tag}-{}-{}",
            std::process::id(),
            NEXT.fetch_add(1, Ordering::Relaxed)
        ));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir)
            .unwrap_or_else(|e| panic!("cannot create {}: {e}", dir.display()));
        let path = dir.join("notify.sock");
        let socket = UnixDatagram::bind(&path)
            .unwrap_or_else(|e| panic!("cannot bind {}: {e}", path.display()));
        socket
            .set_read_timeout(Some(Duration::from_millis(100)))
            .unwrap_or_else(|e| panic!("cannot set a read timeout on {}: {e}", path.display()));
        Self { socket, path, dir }
    }

    /// The socket's path, the value of `NOTIFY_SOCKET`.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The socket itself, for reads of one's own.
    pub fn socket(&self) -> &UnixDatagram {
        &self.socket
    }

    /// The next message, or `None` when none arrives within the read timeout (100 ms).
    pub fn recv(&self) -> Option<String> {
        let mut buf = [0u8; 4096];
        match self.socket.recv(&mut buf) {
            Ok(n) => Some(String::from_utf8_lossy(&buf[..n]).into_owned()),
            Err(e)
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                ) =>
            {
                None
            }
            Err(e) => panic!("recv on {}: {e}", self.path.display()),
        }
    }

    /// Receives messages until one has the line `want` (`READY=1`, `WATCHDOG=1`, ...) or
    /// `limit` passes; returns every message received, the one with `want` last. Panics,
    /// listing what arrived, when `want` does not.
    pub fn receive_until(&self, want: &str, limit: Duration) -> Vec<String> {
        let t = Instant::now();
        let mut got = vec![];
        while t.elapsed() < limit {
            if let Some(msg) = self.recv() {
                let done = msg.lines().any(|l| l == want);
                got.push(msg);
                if done {
                    return got;
                }
            }
        }
        panic!("no {want} within {limit:?}; received {got:?}");
    }

    /// Every message that arrives within `limit`.
    pub fn receive_for(&self, limit: Duration) -> Vec<String> {
        let t = Instant::now();
        let mut got = vec![];
        while t.elapsed() < limit {
            got.extend(self.recv());
        }
        got
    }
}

impl Drop for NotifySocket {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}
