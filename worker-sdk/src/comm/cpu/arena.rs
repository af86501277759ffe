//! The shared-memory path of the CPU backend: sets up a [`ShmArena`] when every rank is on one
//! node, and runs large all_reduce and all_gather through it, the sockets carrying only the
//! header exchange and one-byte syncs.
//!
//! # Setup
//! Every rank creates its segment (`muster-<tag>-<rank>` in `/dev/shm`, or the temporary
//! directory where there is no `/dev/shm`), the ranks agree with a one-byte all_reduce (min)
//! that every one succeeded, map their peers' segments, agree again, and remove their own file
//! name. Any step can fail on one rank only (a full tmpfs, a stale file), so the agreements are
//! always made, even by a rank that failed or is on another node; a failure anywhere leaves
//! every rank on cross-memory attach or the sockets (said at debug level), and the arena's
//! `Drop` removes any file it created.
//!
//! # Operations
//! The header exchange of `CpuBackend::run` comes first, as for every operation, so the arena
//! only ever runs on buffers of the same length on every rank (its protocol needs it). The
//! arena's `sync` is a barrier over the sockets: one byte to every peer, then one byte from
//! every peer. A peer that dies ends its connections, so the sync fails with
//! [`Error::PeerLost`] naming it (or the rank the coordinator reported, whose stop makes the
//! failure watcher shut the connections). After such an error the arena is dropped and the
//! communicator is unusable, as after any failure.

use std::path::{Path, PathBuf};

use super::{CpuBackend, Header, TRANSPORT_ENV, Transport, backend_error};
use crate::{
    Error,
    comm::{Backend, DType, ReduceOp, shm::ShmArena},
};

/// Bytes of each rank's segment. The arena alone measured best with 1-4 MiB (a half stays in
/// the caches while it is written and read back); 8 MiB fell out of the caches (about 30%
/// slower) and smaller segments cost more syncs (one per half segment of data).
const SEGMENT_BYTES: usize = 2 << 20;
/// The byte of a sync.
const SYNC: u8 = 0x5c;

/// Where segments live: tmpfs when there is one (memory, never written back to a disk).
fn segment_dir() -> PathBuf {
    let shm = Path::new("/dev/shm");
    if shm.is_dir() {
        shm.to_path_buf()
    } else {
        std::env::temp_dir()
    }
}

impl CpuBackend {
    /// Decides, with every other rank, whether large all_reduce and all_gather use shared
    /// memory (module documentation). `tag` names this communicator's segments: unique to the
    /// job, generation and communicator; `one_node`: every rank is on this node.
    pub(super) fn setup_shm(
        &mut self,
        transport: Transport,
        one_node: bool,
        tag: Option<String>,
        id: u64,
    ) -> Result<(), Error> {
        let mut arena = None;
        let mut why_not = match (transport, tag) {
            _ if !one_node => Some("the ranks are on several nodes".to_owned()),
            (Transport::Auto | Transport::Shm, Some(tag)) => {
                match ShmArena::create(&segment_dir(), &tag, self.rank, self.world, SEGMENT_BYTES) {
                    Ok(a) => {
                        arena = Some(a);
                        None
                    }
                    Err(e) => Some(format!("cannot create the shared-memory segment: {e}")),
                }
            }
            (Transport::Auto | Transport::Shm, None) => {
                Some("rank 0 did not publish its process id".to_owned())
            }
            _ => Some(format!("{TRANSPORT_ENV} says otherwise")),
        };
        // First agreement: every rank created its segment. Then map the peers' and agree again;
        // a dropped arena removes its file.
        if self.agree(why_not.is_none())? {
            if let Some(a) = arena.as_mut()
                && let Err(e) = a.open_peers()
            {
                why_not = Some(format!("cannot map a peer's segment: {e}"));
            }
        } else {
            arena = None;
        }
        let usable = arena.is_some() && self.agree(why_not.is_none())?;
        match arena.filter(|_| usable) {
            Some(mut a) => {
                // Every rank mapped every segment: the names can go. A failure only leaves a
                // file behind; the mappings work.
                if let Err(e) = a.unlink() {
                    tracing::warn!(rank = self.rank, communicator = id, error = %e,
                        "cpu communicator: cannot remove the shared-memory segment's name");
                }
                tracing::debug!(
                    rank = self.rank,
                    communicator = id,
                    "cpu communicator: large all_reduce and all_gather use shared memory"
                );
                self.shm = Some(a);
                Ok(())
            }
            None => {
                let why = why_not.unwrap_or_else(|| "another rank cannot use it".to_owned());
                tracing::debug!(
                    rank = self.rank,
                    communicator = id,
                    reason = %why,
                    "cpu communicator: no shared memory"
                );
                if transport == Transport::Shm {
                    return Err(backend_error(format!(
                        "{TRANSPORT_ENV}=shm, but shared memory is not usable: {why}"
                    )));
                }
                Ok(())
            }
        }
    }

    /// Whether every rank says `ok` (a one-byte all_reduce, min).
    fn agree(&mut self, ok: bool) -> Result<bool, Error> {
        let mut verdict = [u8::from(ok)];
        self.all_reduce(&mut verdict, DType::U8, ReduceOp::Min)?;
        Ok(verdict[0] == 1)
    }

    /// all_reduce through the arena (after the header exchange).
    pub(super) fn shm_all_reduce(
        &mut self,
        header: Header,
        buf: &mut [u8],
        dtype: DType,
        op: ReduceOp,
    ) -> Result<(), Error> {
        self.run(header, &|_| None, &[], &|_| false, |this, header, _| {
            this.with_arena(header, |arena, sync| arena.all_reduce(buf, dtype, op, sync))
        })
    }

    /// all_gather through the arena (after the header exchange).
    pub(super) fn shm_all_gather(
        &mut self,
        header: Header,
        send: &[u8],
        recv: &mut [u8],
    ) -> Result<(), Error> {
        self.run(header, &|_| None, &[], &|_| false, |this, header, _| {
            this.with_arena(header, |arena, sync| arena.all_gather(send, recv, sync))
        })
    }

    /// Runs `body` with the arena taken out of `self` (the sync borrows `self`), putting it
    /// back unless it failed: after a failed sync its state is unspecified.
    fn with_arena(
        &mut self,
        header: &Header,
        body: impl FnOnce(&mut ShmArena, &mut dyn FnMut() -> Result<(), Error>) -> Result<(), Error>,
    ) -> Result<(), Error> {
        let Some(mut arena) = self.shm.take() else {
            return Err(backend_error("the shared-memory arena is gone"));
        };
        let result = body(&mut arena, &mut || self.shm_sync(header));
        if result.is_ok() {
            self.shm = Some(arena);
        }
        result
    }

    /// The arena's sync: a barrier over the sockets, one byte each way with every peer.
    fn shm_sync(&mut self, header: &Header) -> Result<(), Error> {
        let result = self
            .cma_signal(SYNC, None)
            .and_then(|()| self.cma_await(SYNC, |_| Ok(())));
        result.map_err(|(peer, reason)| self.fail(header, peer, reason))
    }
}
