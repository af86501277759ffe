//! Connections to peers (TCP or Unix sockets), the address record each rank publishes, and
//! the blocking and non-blocking reads and writes the backend does on them.

use std::{
    io::{self, Read, Write},
    net::{Shutdown, TcpStream, ToSocketAddrs},
    os::{
        fd::{AsFd, BorrowedFd},
        linux::net::SocketAddrExt,
        unix::net::{self as unix, UnixStream},
    },
    sync::{Arc, PoisonError, atomic::Ordering},
    time::Duration,
};

use nix::poll::{PollFd, PollFlags, PollTimeout, poll};

use crate::client::FailureWatch;

use super::{CLOSED, HANDSHAKE_TIMEOUT, IO_SLICE, Shared};

/// One connection to a peer.
pub(super) enum Conn {
    Tcp(TcpStream),
    Unix(UnixStream),
}

impl Conn {
    pub(super) fn read(&self, buf: &mut [u8]) -> io::Result<usize> {
        match self {
            Conn::Tcp(s) => (&*s).read(buf),
            Conn::Unix(s) => (&*s).read(buf),
        }
    }

    pub(super) fn write(&self, buf: &[u8]) -> io::Result<usize> {
        match self {
            Conn::Tcp(s) => (&*s).write(buf),
            Conn::Unix(s) => (&*s).write(buf),
        }
    }

    pub(super) fn fd(&self) -> BorrowedFd<'_> {
        match self {
            Conn::Tcp(s) => s.as_fd(),
            Conn::Unix(s) => s.as_fd(),
        }
    }

    pub(super) fn set_nonblocking(&self, on: bool) -> io::Result<()> {
        match self {
            Conn::Tcp(s) => s.set_nonblocking(on),
            Conn::Unix(s) => s.set_nonblocking(on),
        }
    }

    pub(super) fn set_read_timeout(&self, t: Option<Duration>) -> io::Result<()> {
        match self {
            Conn::Tcp(s) => s.set_read_timeout(t),
            Conn::Unix(s) => s.set_read_timeout(t),
        }
    }

    pub(super) fn try_clone(&self) -> io::Result<Conn> {
        Ok(match self {
            Conn::Tcp(s) => Conn::Tcp(s.try_clone()?),
            Conn::Unix(s) => Conn::Unix(s.try_clone()?),
        })
    }

    pub(super) fn shutdown(&self) {
        let _ = match self {
            Conn::Tcp(s) => s.shutdown(Shutdown::Both),
            Conn::Unix(s) => s.shutdown(Shutdown::Both),
        };
    }

    pub(super) fn transport(&self) -> &'static str {
        match self {
            Conn::Tcp(_) => "tcp",
            Conn::Unix(_) => "unix",
        }
    }
}

/// Where a peer runs, for error messages and transport choice.
#[derive(Debug, Clone, Default)]
pub(super) struct Peer {
    pub(super) host: String,
    pub(super) node_rank: u32,
    /// Its process id and the address of its probe bytes, for cross-memory attach (`None`
    /// when its record did not say).
    pub(super) cma: Option<(i32, usize)>,
}

/// A peer's published record: host, TCP port, node rank, Unix socket name, process id and
/// probe address, one per line.
pub(super) fn parse_record(record: &str) -> (Peer, Option<u16>, String) {
    let mut lines = record.lines();
    let host = lines.next().unwrap_or_default().to_owned();
    let port = lines.next().and_then(|p| p.parse::<u16>().ok());
    let node_rank = lines.next().and_then(|n| n.parse::<u32>().ok());
    let name = lines.next().unwrap_or_default().to_owned();
    let pid = lines.next().and_then(|p| p.parse::<i32>().ok());
    let probe = lines.next().and_then(|a| a.parse::<usize>().ok());
    let peer = Peer {
        host,
        node_rank: node_rank.unwrap_or(u32::MAX),
        cma: pid.zip(probe),
    };
    (peer, port.filter(|_| node_rank.is_some()), name)
}

/// What a broken connection says, for messages.
pub(super) fn broken(e: &io::Error) -> String {
    format!("its connection broke ({e})")
}

/// Waits in `poll` for any of `fds`; EINTR counts as a wakeup.
pub(super) fn wait(fds: &mut [PollFd<'_>]) -> io::Result<()> {
    match poll(fds, PollTimeout::NONE) {
        Ok(_) | Err(nix::errno::Errno::EINTR) => Ok(()),
        Err(e) => Err(e.into()),
    }
}

pub(super) fn watcher(watch: FailureWatch, shared: Arc<Shared>) {
    while !shared.stop.load(Ordering::Relaxed) {
        if let Some(error) = watch.wait_timeout(Duration::from_millis(250)) {
            *shared
                .failure
                .lock()
                .unwrap_or_else(PoisonError::into_inner) = Some(error);
            shared.shutdown_all();
            return;
        }
    }
}

pub(super) fn rand_u32() -> u32 {
    let t = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.subsec_nanos());
    t ^ std::process::id().rotate_left(16)
}

pub(super) fn connect(host: &str, port: u16, uds: Option<&str>) -> io::Result<Conn> {
    if let Some(name) = uds {
        let addr = unix::SocketAddr::from_abstract_name(name.as_bytes())?;
        match UnixStream::connect_addr(&addr) {
            Ok(s) => return Ok(Conn::Unix(s)),
            Err(e) => tracing::debug!(error = %e, "unix socket connect failed; using tcp"),
        }
    }
    let mut last = io::Error::new(io::ErrorKind::NotFound, "no address");
    for addr in (host, port).to_socket_addrs()? {
        match TcpStream::connect_timeout(&addr, HANDSHAKE_TIMEOUT) {
            Ok(s) => {
                s.set_nodelay(true)?;
                return Ok(Conn::Tcp(s));
            }
            Err(e) => last = e,
        }
    }
    Err(last)
}

pub(super) fn write_all_blocking(conn: &Conn, mut buf: &[u8]) -> io::Result<()> {
    while !buf.is_empty() {
        match conn.write(buf) {
            Ok(0) => return Err(io::ErrorKind::WriteZero.into()),
            Ok(k) => buf = &buf[k..],
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

pub(super) fn read_exact_blocking(conn: &Conn, mut buf: &mut [u8]) -> io::Result<()> {
    while !buf.is_empty() {
        match conn.read(buf) {
            Ok(0) => return Err(io::ErrorKind::UnexpectedEof.into()),
            Ok(k) => buf = &mut buf[k..],
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}
pub(super) fn write_all_nb(conn: &Conn, mut buf: &[u8]) -> Result<(), String> {
    while !buf.is_empty() {
        match conn.write(&buf[..buf.len().min(IO_SLICE)]) {
            Ok(0) => return Err(CLOSED.into()),
            Ok(k) => buf = &buf[k..],
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                wait(&mut [PollFd::new(conn.fd(), PollFlags::POLLOUT)])
                    .map_err(|e| e.to_string())?;
            }
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(broken(&e)),
        }
    }
    Ok(())
}

pub(super) fn read_exact_nb(conn: &Conn, mut buf: &mut [u8]) -> Result<(), String> {
    while !buf.is_empty() {
        let k = buf.len().min(IO_SLICE);
        match conn.read(&mut buf[..k]) {
            Ok(0) => return Err(CLOSED.into()),
            Ok(k) => buf = &mut buf[k..],
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                wait(&mut [PollFd::new(conn.fd(), PollFlags::POLLIN)])
                    .map_err(|e| e.to_string())?;
            }
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(broken(&e)),
        }
    }
    Ok(())
}
