//! Creating a communicator: listening, publishing this rank's addresses, the full mesh of
//! handshaken connections, and the choice of same-node transport (shared memory, cross-memory
//! attach or the sockets).

use std::{
    net::{IpAddr, Ipv4Addr, SocketAddr, TcpListener},
    os::{
        fd::AsFd,
        linux::net::SocketAddrExt,
        unix::net::{self as unix, UnixListener},
    },
    sync::{Arc, PoisonError},
    time::Instant,
};

use nix::poll::{PollFd, PollFlags, PollTimeout, poll};

use crate::comm::{Backend, DType, ReduceOp};
use crate::{Accelerator, Error, client::FailureWatch};

use super::{
    CpuBackend, HANDSHAKE_MAGIC, HANDSHAKE_TIMEOUT, Notices, PROBE_MAGIC, SETUP_TIMEOUT, Shared,
    TRANSPORT_ENV, backend_error,
    conn::{
        Conn, Peer, connect, parse_record, rand_u32, read_exact_blocking, watcher,
        write_all_blocking,
    },
    fnv,
    wire::Transport,
};

impl CpuBackend {
    /// Creates this rank's end of a new communicator: listens, publishes its addresses,
    /// connects to every lower rank and accepts every higher one. Every rank must call it (the
    /// n-th communicator of each rank forms one communicator).
    ///
    /// Creates communicator number `id` (every rank numbers its communicators alike: see
    /// [`next_communicator_id`]) for membership `epoch`: its addresses are published under
    /// `muster/comm/<generation>/<id>/<rank>` for epoch 0 and
    /// `muster/comm/<generation>.<epoch>/<id>/<rank>` after an in-place recovery, its
    /// handshake carries the epoch (a connection of another epoch is refused), and its failure
    /// watcher fires for membership changes above `epoch`.
    ///
    /// A setup that fails because a rank died meanwhile (a refused or broken connection, a
    /// record that never comes) returns the coordinator's report of that death instead
    /// ([`Error::MembershipChanged`] in an in-place job, which the caller recovers from),
    /// waiting up to [`NAME_THE_DEAD_GRACE`] for it.
    pub(crate) fn create(accelerator: &Accelerator, id: u64, epoch: u64) -> Result<Self, Error> {
        let watch = accelerator.failure_watch_at(epoch);
        Self::connect_mesh(accelerator, id, epoch, &watch).map_err(|error| {
            match error {
                // Already the report, or an error of this rank's own making.
                Error::MembershipChanged { .. } | Error::RankFailed { .. } | Error::Config(_) => {
                    error
                }
                error if accelerator.is_distributed() => {
                    watch.wait_timeout(NAME_THE_DEAD_GRACE).unwrap_or(error)
                }
                error => error,
            }
        })
    }

    fn connect_mesh(
        accelerator: &Accelerator,
        id: u64,
        epoch: u64,
        watch: &FailureWatch,
    ) -> Result<Self, Error> {
        let info = accelerator.info();
        let rank = info.rank as usize;
        let world = info.world_size as usize;
        let mut peers = vec![Peer::default(); world];
        let transport = Transport::from_env()?;
        let job_hash = fnv(&info.job_id);
        let mut probe = Box::new([0u8; 16]);
        probe[..8].copy_from_slice(PROBE_MAGIC);
        probe[8..].copy_from_slice(&job_hash.to_le_bytes());
        let pid = std::process::id() as i32;
        peers[rank] = Peer {
            host: info.host.clone(),
            node_rank: info.node_rank,
            cma: Some((pid, probe.as_ptr() as usize)),
        };
        let shared = Arc::new(Shared::default());
        let mut backend = Self {
            rank,
            world,
            conns: (0..world).map(|_| None).collect(),
            peers,
            seq: 0,
            context: None,
            broken: None,
            shared,
            watch: None,
            notices: None,
            scratch: Vec::new(),
            cma: false,
            pids: vec![pid; world],
            probe,
            cma_scratch: Vec::new(),
            shm: None,
        };
        if world == 1 {
            return Ok(backend);
        }
        let prefix = comm_prefix(info.generation, epoch, id);
        let watch = Some(watch.clone());

        // Listen: TCP on the advertised IP (or everywhere: a host name, or an address that is
        // not this machine's, as behind NAT), and an abstract Unix socket.
        let everywhere = IpAddr::V4(Ipv4Addr::UNSPECIFIED);
        let bind_ip = info.host.parse::<IpAddr>().unwrap_or(everywhere);
        let tcp = TcpListener::bind(SocketAddr::new(bind_ip, 0))
            .or_else(|_| TcpListener::bind(SocketAddr::new(everywhere, 0)))
            .map_err(|e| backend_error(format!("cannot listen on {bind_ip}: {e}")))?;
        let port = tcp
            .local_addr()
            .map_err(|e| backend_error(format!("listener address: {e}")))?
            .port();
        let uds_name = format!(
            "muster-comm-{:016x}-{}.{}-{}-{}-{}-{:08x}",
            job_hash,
            info.generation,
            epoch,
            id,
            rank,
            std::process::id(),
            rand_u32()
        );
        let uds = unix::SocketAddr::from_abstract_name(uds_name.as_bytes())
            .and_then(|addr| UnixListener::bind_addr(&addr))
            .map_err(|e| backend_error(format!("cannot listen on a Unix socket: {e}")))?;
        tcp.set_nonblocking(true)
            .and_then(|()| uds.set_nonblocking(true))
            .map_err(|e| backend_error(format!("listener: {e}")))?;
        let record = format!(
            "{}\n{}\n{}\n{}\n{}\n{}\n",
            info.host,
            port,
            info.node_rank,
            uds_name,
            pid,
            backend.probe.as_ptr() as usize
        );
        accelerator.kv().set(&format!("{prefix}/{rank}"), record)?;

        let handshake = |from: usize, to: usize| {
            Hello {
                generation: info.generation,
                epoch,
                id,
                job_hash,
                from: from as u32,
                to: to as u32,
            }
            .encode()
        };
        let force_tcp = transport == Transport::Tcp;

        // Connect to every lower rank.
        for peer in 0..rank {
            let record = wait_for_record(accelerator, &format!("{prefix}/{peer}"), &watch)?;
            let record = String::from_utf8_lossy(&record).into_owned();
            let (parsed, port, name) = parse_record(&record);
            let Some(port) = port else {
                return Err(backend_error(format!(
                    "rank {peer} published a malformed address: {record:?}"
                )));
            };
            let (host, node_rank) = (parsed.host.clone(), parsed.node_rank);
            backend.peers[peer] = parsed;
            let same_node = node_rank == info.node_rank && host == info.host && !force_tcp;
            let conn = connect(&host, port, same_node.then_some(name.as_str())).map_err(|e| {
                backend_error(format!(
                    "cannot connect to rank {peer} (node {node_rank}, host {host}, port {port}): {e}"
                ))
            })?;
            let mut reply = [0u8; 4];
            let hs = (|| {
                conn.set_read_timeout(Some(HANDSHAKE_TIMEOUT))?;
                write_all_blocking(&conn, &handshake(rank, peer))?;
                read_exact_blocking(&conn, &mut reply)
            })();
            if hs.is_err() || u32::from_le_bytes(reply) != peer as u32 {
                return Err(backend_error(format!(
                    "rank {peer} (host {host}) refused the connection of communicator {id} of \
                     generation {} epoch {epoch} ({})",
                    info.generation,
                    hs.err()
                        .map_or("wrong answer".to_owned(), |e| e.to_string())
                )));
            }
            backend.conns[peer] = Some(conn);
        }

        // Accept every higher rank.
        let deadline = Instant::now() + SETUP_TIMEOUT;
        let mut missing = world - rank - 1;
        while missing > 0 {
            if let Some(error) = watch.as_ref().and_then(FailureWatch::failed) {
                return Err(error);
            }
            if Instant::now() > deadline {
                return Err(backend_error(format!(
                    "timed out waiting for {missing} higher ranks to connect"
                )));
            }
            let mut fds = [
                PollFd::new(tcp.as_fd(), PollFlags::POLLIN),
                PollFd::new(uds.as_fd(), PollFlags::POLLIN),
            ];
            match poll(&mut fds, PollTimeout::from(200u16)) {
                Ok(_) | Err(nix::errno::Errno::EINTR) => {}
                Err(e) => return Err(backend_error(format!("poll: {e}"))),
            }
            let mut accepted = Vec::new();
            while let Ok((s, _)) = tcp.accept() {
                let _ = s.set_nodelay(true);
                accepted.push(Conn::Tcp(s));
            }
            while let Ok((s, _)) = uds.accept() {
                accepted.push(Conn::Unix(s));
            }
            for conn in accepted {
                let mut hello = [0u8; HELLO_BYTES];
                let ok = conn.set_nonblocking(false).is_ok()
                    && conn.set_read_timeout(Some(HANDSHAKE_TIMEOUT)).is_ok()
                    && read_exact_blocking(&conn, &mut hello).is_ok();
                let from = Hello::from_of(&hello) as usize;
                if !ok
                    || from <= rank
                    || from >= world
                    || hello != handshake(from, rank)
                    || backend.conns[from].is_some()
                {
                    tracing::warn!(
                        rank,
                        communicator = id,
                        epoch,
                        "refused a connection with a wrong handshake (another communicator, \
                         generation or membership epoch)"
                    );
                    continue;
                }
                if write_all_blocking(&conn, &(rank as u32).to_le_bytes()).is_err() {
                    continue;
                }
                backend.conns[from] = Some(conn);
                missing -= 1;
            }
        }
        // Peers above us: their records give host and node for messages.
        for peer in rank + 1..world {
            if let Ok(Some(record)) = accelerator.kv().get(&format!("{prefix}/{peer}")) {
                let (mut parsed, _, _) = parse_record(&String::from_utf8_lossy(&record));
                if parsed.node_rank == u32::MAX {
                    parsed.node_rank = 0;
                }
                backend.peers[peer] = parsed;
            }
        }
        let mut clones = Vec::new();
        for conn in backend.conns.iter().flatten() {
            conn.set_read_timeout(None)
                .and_then(|()| conn.set_nonblocking(true))
                .map_err(|e| backend_error(format!("socket setup: {e}")))?;
            if let Ok(clone) = conn.try_clone() {
                clones.push(clone);
            }
        }
        *backend
            .shared
            .conns
            .lock()
            .unwrap_or_else(PoisonError::into_inner) = clones;
        tracing::debug!(
            rank,
            communicator = id,
            transports = ?backend.conns.iter().map(|c| c.as_ref().map(Conn::transport)).collect::<Vec<_>>(),
            "cpu communicator connected"
        );

        if let Some(watch) = watch {
            backend.watch = Some(watch.clone());
            let shared = backend.shared.clone();
            std::thread::Builder::new()
                .name(format!("muster-comm-watch-{rank}"))
                .spawn(move || watcher(watch, shared))
                .map_err(|e| backend_error(format!("cannot start the failure watcher: {e}")))?;
        }
        if let Some(session) = accelerator.session()
            && let Ok(runtime) = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
        {
            backend.notices = Some(Notices {
                kv: session.kv(),
                runtime,
                key: format!("{prefix}/lost"),
            });
        }
        let one_node = backend.setup_cma(transport, id)?;
        // Unique to the job, generation and communicator, and to rank 0's process (so that two
        // runs of one job id on one machine never meet).
        let tag = backend.peers[0]
            .cma
            .map(|(pid0, _)| format!("{job_hash:016x}-{}.{epoch}-{id}-{pid0}", info.generation));
        backend.setup_shm(transport, one_node, tag, id)?;
        Ok(backend)
    }

    /// Decides, with every other rank, whether large collectives use cross-memory attach: only
    /// when every rank is on this node (same node rank and host) and every rank could read
    /// every peer's probe bytes. Ranks agree with one all_reduce (min) of their verdicts, always
    /// made (even across nodes, so that no rank can skip it), so a single refusal (EPERM under
    /// Yama or seccomp) keeps every rank on the sockets.
    ///
    /// Returns whether every rank is on this node.
    pub(super) fn setup_cma(&mut self, transport: Transport, id: u64) -> Result<bool, Error> {
        let me = &self.peers[self.rank];
        let one_node = self
            .peers
            .iter()
            .all(|p| p.node_rank == me.node_rank && p.host == me.host);
        let tcp = self
            .conns
            .iter()
            .flatten()
            .any(|c| matches!(c, Conn::Tcp(_)));
        let mut why_not = match transport {
            _ if !one_node => Some("the ranks are on several nodes".to_owned()),
            // The failure protocol needs a Unix socket's EPIPE (see `cpu/cma.rs`).
            _ if tcp => Some("a connection is TCP, not a Unix socket".to_owned()),
            Transport::Auto | Transport::Shm | Transport::Cma => None,
            Transport::Unix | Transport::Tcp => Some(format!("{TRANSPORT_ENV} says sockets")),
        };
        for (peer, info) in self.peers.iter().enumerate() {
            if why_not.is_some() || peer == self.rank {
                continue;
            }
            let Some((pid, addr)) = info.cma else {
                why_not = Some(format!("rank {peer} did not publish its process id"));
                continue;
            };
            self.pids[peer] = pid;
            let mut got = [0u8; 16];
            why_not = match super::cma::read_remote(pid, addr, &mut got) {
                Ok(()) if got == *self.probe => None,
                Ok(()) => Some(format!("rank {peer}'s probe bytes are wrong")),
                Err(e) => Some(format!("cannot read rank {peer}'s memory: {e}")),
            };
        }
        let mut verdict = [u8::from(why_not.is_none())];
        self.all_reduce(&mut verdict, DType::U8, ReduceOp::Min)?;
        self.cma = verdict[0] == 1;
        match (&why_not, self.cma) {
            (_, true) => tracing::debug!(
                rank = self.rank,
                communicator = id,
                "cpu communicator: large collectives use cross-memory attach"
            ),
            (Some(why), false) => tracing::debug!(
                rank = self.rank,
                communicator = id,
                reason = %why,
                "cpu communicator: no cross-memory attach; large collectives use sockets"
            ),
            (None, false) => tracing::debug!(
                rank = self.rank,
                communicator = id,
                "cpu communicator: another rank cannot use cross-memory attach; large \
                 collectives use sockets"
            ),
        }
        if !self.cma && transport == Transport::Cma {
            return Err(backend_error(format!(
                "{TRANSPORT_ENV}=cma, but cross-memory attach is not usable: {}",
                why_not.as_deref().unwrap_or("another rank cannot use it")
            )));
        }
        Ok(one_node)
    }
}

/// Where communicator `id` of `generation` publishes its ranks' addresses in membership
/// `epoch`: today's key for epoch 0, `<generation>.<epoch>` after an in-place recovery, so that
/// a rebuilt communicator never reaches an address of the old membership.
pub(super) fn comm_prefix(generation: u64, epoch: u64, id: u64) -> String {
    if epoch == 0 {
        format!("muster/comm/{generation}/{id}")
    } else {
        format!("muster/comm/{generation}.{epoch}/{id}")
    }
}

/// Bytes of a connection's first message.
pub(super) const HELLO_BYTES: usize = 48;

/// The first message on a new connection, from the connecting (higher) rank: which job,
/// generation, membership epoch and communicator it means and who it is. The accepting rank
/// refuses any difference, so a stray or stale connection (an old epoch's rank) is never
/// mistaken for a peer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Hello {
    pub(super) generation: u64,
    pub(super) epoch: u64,
    pub(super) id: u64,
    pub(super) job_hash: u64,
    pub(super) from: u32,
    pub(super) to: u32,
}

impl Hello {
    pub(super) fn encode(&self) -> [u8; HELLO_BYTES] {
        let mut b = [0u8; HELLO_BYTES];
        b[0..8].copy_from_slice(HANDSHAKE_MAGIC);
        b[8..16].copy_from_slice(&self.generation.to_le_bytes());
        b[16..24].copy_from_slice(&self.epoch.to_le_bytes());
        b[24..32].copy_from_slice(&self.id.to_le_bytes());
        b[32..40].copy_from_slice(&self.job_hash.to_le_bytes());
        b[40..44].copy_from_slice(&self.from.to_le_bytes());
        b[44..48].copy_from_slice(&self.to.to_le_bytes());
        b
    }

    /// The sender's rank as a hello claims it (to look up what it should have said).
    pub(super) fn from_of(hello: &[u8; HELLO_BYTES]) -> u32 {
        u32::from_le_bytes([hello[40], hello[41], hello[42], hello[43]])
    }
}

/// How long a failed setup waits for the coordinator to report the death that explains it.
const NAME_THE_DEAD_GRACE: std::time::Duration = std::time::Duration::from_secs(2);
/// How long one wait for a peer's record lasts before the failure watch is checked again.
const RECORD_SLICE: std::time::Duration = std::time::Duration::from_millis(250);

/// Waits for a peer's address record under `key` (up to [`SETUP_TIMEOUT`]) in slices, so that
/// a peer that died before publishing it (its replacement publishes under the next epoch's
/// key) ends the wait as soon as `watch` fires, rather than after the setup timeout.
fn wait_for_record(
    accelerator: &Accelerator,
    key: &str,
    watch: &Option<FailureWatch>,
) -> Result<Vec<u8>, Error> {
    let deadline = Instant::now() + SETUP_TIMEOUT;
    loop {
        if let Some(error) = watch.as_ref().and_then(FailureWatch::failed) {
            return Err(error);
        }
        let left = deadline.saturating_duration_since(Instant::now());
        match accelerator.kv().get_wait(key, left.min(RECORD_SLICE)) {
            Err(error) if error.is_timeout() && !left.is_zero() => {}
            other => return other,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_and_handshakes_carry_the_epoch() {
        assert_eq!(comm_prefix(3, 0, 1), "muster/comm/3/1");
        assert_eq!(comm_prefix(3, 2, 1), "muster/comm/3.2/1");
        let now = Hello {
            generation: 3,
            epoch: 2,
            id: 1,
            job_hash: 7,
            from: 2,
            to: 0,
        };
        let old = Hello { epoch: 1, ..now };
        assert_eq!(Hello::from_of(&now.encode()), 2);
        // What the accepting rank compares: an old epoch's hello is not the expected one.
        assert_ne!(old.encode(), now.encode());
        assert_eq!(Hello::from_of(&old.encode()), 2);
    }
}
