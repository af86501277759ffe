//! Shared memory between the ranks of one machine: the data path of same-machine collectives
//! that reaches memcpy-class bandwidth, because every rank maps its peers' pages once instead
//! of moving each byte through the kernel (two copies per byte over a Unix socket) or pinning
//! pages per call (`process_vm_readv`).
//!
//! # Layout
//! Every rank creates one file of `seg_bytes` in a tmpfs directory (`/dev/shm`), named
//! `muster-<tag>-<rank>`, mode 0600, fills it with zeros (so a full tmpfs is an `ENOSPC` error
//! now, not a `SIGBUS` later) and maps it read-write: its **segment**. Once every rank has done
//! so, each maps every peer's segment read-only ([`ShmArena::open_peers`]), and once every rank
//! has done that, each removes its own file name ([`ShmArena::unlink`]): the pages live on
//! while mapped and vanish with the last process, so nothing leaks when a process dies. The
//! caller synchronises the ranks between those steps (its socket barrier).
//!
//! A segment is used as two halves; consecutive pieces of work (across calls too) alternate
//! between them. A rank writes only its own segment and reads only its peers'. Segments must
//! hold at least `2 * world * 64` bytes; a few MiB suit large buffers (see the numbers at the
//! end).
//!
//! # all_reduce
//! The buffer is processed in pieces of up to n slots (a slot: a 64-byte multiple, at most
//! 1/n of a half). Each piece is split into n balanced chunks (64-byte aligned, so whole
//! elements of every type and no cache line with two owners); rank r owns chunk r, and chunk
//! j of any piece lives in slot j of the piece's half, whatever the piece's length. Three
//! phases per piece:
//! 1. **Publish**: each rank copies the chunks it does not own from its buffer into its segment.
//! 2. **Reduce**: rank r reduces chunk r in rank order 0..n (from rank 0's data, folding in each
//!    rank's chunk r in turn: its own from its buffer, the others read straight from their
//!    segments), so the result is deterministic; divides for `Avg`; writes the result into its
//!    buffer and into slot r of its segment.
//! 3. **Fetch**: each rank copies every peer j's reduced chunk from j's segment into its buffer.
//!    Every rank ends with the owners' bits, so results are identical on every rank.
//!
//! Phases are pipelined across pieces, one sync between consecutive steps: publish(0); *sync*;
//! then for each piece t: reduce(t), fetch(t-1), publish(t+1); *sync*; and finally fetch(last).
//! That is pieces + 1 syncs per call. Why no step touches bytes another rank uses at the same
//! time (piece t uses half t % 2, h(t+1) = h(t-1)): between two syncs a rank writes slot r of
//! h(t) (reduce) and the other slots of h(t+1) (publish), while its peers read their own slots
//! of its h(t) (reduce) and slot r of its h(t-1) = h(t+1) (fetch): disjoint. Every read is of
//! bytes written before the last sync, and every write hits bytes whose last readers were done
//! before the last sync (the publish of piece t+1 overwrites slots last read by the reduce of
//! piece t-1, the reduce of piece t overwrites slot r last read by the fetch of piece t-2). Calls
//! continue the halves' alternation, so the argument holds across calls (and with all_gather
//! in between), with no extra sync at the end of a call. Fixed slots make it hold for a short
//! last piece too. Memory traffic per rank (n = 2): the buffer is read once and written once
//! from DRAM; the segments' traffic (about 1.25 more copies) stays in the caches when a half is
//! around 1 MiB or less.
//!
//! # all_gather
//! Per piece of a half: each rank copies its `send` piece into its segment; *sync*; copies every
//! peer's piece into its `recv`. One sync per piece, by the same alternation argument.
//!
//! # Why `unsafe` here
//! The workspace denies `unsafe_code`; this module is an exception, because shared mappings are
//! the only way for processes to exchange bulk data at memory bandwidth (NCCL's and Open MPI's
//! shared-memory transports, and gloo's, do the same). The exception is kept small: files are
//! mapped with memmap2's `MmapRaw` (safe to create; it hands out only raw pointers), and the
//! only `unsafe` code is [`Own::write`] and [`Peer::read`], which turn a
//! bounds-checked byte range of a mapping into a slice that lives only for one closure call.
//! Soundness rests on the protocol above:
//! - every byte range of a segment has exactly one writer (its owner) and is never read
//!   between the same two syncs as it is written (this needs every rank to make the same calls
//!   with the same lengths, which the caller checks first, as the CPU backend's header
//!   exchange does);
//! - phases are separated by the caller's sync, a round trip through system calls (socket I/O,
//!   or a `Barrier` in tests) that every rank completes, with `fence(SeqCst)` on both sides, so
//!   a writer's stores happen before the readers' loads and the readers' loads happen before
//!   the writer's next stores;
//! - no Rust reference into shared memory ever lives across a sync: views exist only inside
//!   the closures of `Own::write` / `Peer::read`, and no sync is called from inside one.
//!
//! Assumption: no other process truncates or writes the files. We create and size them
//! ourselves (mode 0600, `O_EXCL`), peers only map them, and the names are removed right after
//! setup; only a process of the same user that deliberately opens them in that window could
//! interfere. Truncation would raise `SIGBUS` (a crash, not silent corruption); writes would
//! corrupt the results of a job that same user runs. Both are outside our threat model (such a
//! process can equally `ptrace` the workers). After an error from `sync` (a peer died) the
//! arena's state is unspecified and it must not be used again; the caller drops it.
//!
//! # Numbers
//! The arena alone (the `bandwidth` test: 2 ranks as threads, `std::sync::Barrier` as the
//! sync, 64 MiB f32 all_reduce, release) on a 2-core AMD EPYC VM that other builds kept busy
//! (load 5-9): 15.5-16 ms, a bus bandwidth of 4.1-4.3 GB/s with segments of 1-4 MiB, against
//! 9.2-9.5 GB/s for a single-thread memcpy of 64 MiB (45%) and 1.9 GB/s for the Unix sockets'
//! ring; 3.0 GB/s with 8 MiB segments (the halves fall out of the caches). About half of the
//! time was spent waiting in syncs, mostly for the other rank while the load had it descheduled.

use std::{
    fs::{self, File, OpenOptions},
    io,
    ops::Range,
    os::unix::fs::{FileExt, MetadataExt, OpenOptionsExt},
    path::{Path, PathBuf},
    sync::atomic::{Ordering, fence},
};

use memmap2::{MmapOptions, MmapRaw};

use super::{
    DType, ReduceOp,
    reduce::{finish_avg, reduce_into, reduce_into_after},
};
use crate::Error;

/// Chunk boundaries are multiples of this: a cache line, and a multiple of every element size.
const LINE: usize = 64;
/// Zeros written per call when a segment file is filled.
const FILL: usize = 1 << 20;

/// One rank's view of a communicator's shared-memory arena: its own segment (writable) and
/// every peer's (read-only), each `seg_bytes` long, mapped once.
#[derive(Debug)]
pub(crate) struct ShmArena {
    rank: usize,
    world: usize,
    seg_bytes: usize,
    /// The owner of our file: peers' files must have the same.
    uid: u32,
    /// Bytes of each half of a segment (a multiple of [`LINE`]); half h starts at h * half.
    half: usize,
    /// The half the next piece of work uses (0 or 1).
    next_half: usize,
    /// This rank's file name, until [`ShmArena::unlink`] removes it.
    path: Option<PathBuf>,
    /// The directory and tag, to find the peers' files.
    dir: PathBuf,
    tag: String,
    own: Own,
    /// Every peer's segment, in rank order without this rank (see [`peer`]); empty until
    /// [`ShmArena::open_peers`].
    peers: Vec<Peer>,
}

impl ShmArena {
    /// Creates this rank's segment file `<dir>/muster-<tag>-<rank>` (dir: /dev/shm normally) of
    /// `seg_bytes`, mapped read-write.
    ///
    /// Fails if the file exists already (the tag must be unique to the communicator and
    /// generation), if the directory is full, or on bad arguments (`InvalidInput`).
    pub(crate) fn create(
        dir: &Path,
        tag: &str,
        rank: usize,
        world: usize,
        seg_bytes: usize,
    ) -> io::Result<ShmArena> {
        // Each half holds one line-aligned slot per rank at least.
        let min_segment = 2 * world * LINE;
        if rank >= world || seg_bytes < min_segment || tag.is_empty() || tag.contains('/') {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!(
                    "shared-memory arena: bad arguments (rank {rank}, world {world}, segment \
                     {seg_bytes} bytes (at least {min_segment}), tag {tag:?})"
                ),
            ));
        }
        let path = segment_path(dir, tag, rank);
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(&path)
            .map_err(|e| context(e, "creating", &path))?;
        let mapped = fill(&file, seg_bytes).and_then(|()| {
            let uid = file.metadata()?.uid();
            let map = MmapOptions::new()
                .len(seg_bytes)
                .populate()
                .map_raw(&file)?;
            Ok((uid, map))
        });
        let (uid, own) = mapped.map_err(|e| {
            // Best effort: the error that matters is the first one.
            let _ = fs::remove_file(&path);
            context(e, "mapping", &path)
        })?;
        Ok(ShmArena {
            rank,
            world,
            seg_bytes,
            uid,
            half: seg_bytes / 2 / LINE * LINE,
            next_half: 0,
            path: Some(path),
            dir: dir.to_path_buf(),
            tag: tag.to_owned(),
            own: Own(own),
            peers: Vec::new(),
        })
    }

    /// After every rank has created its segment (the caller syncs in between): maps every
    /// peer's segment read-only, then (after the caller's next sync) `unlink()` removes this
    /// rank's file name so nothing leaks if a process dies later.
    ///
    /// A peer's file must be a regular file of exactly `seg_bytes`, owned by our user (else
    /// `InvalidData`): a stale or foreign file is refused rather than mapped.
    pub(crate) fn open_peers(&mut self) -> io::Result<()> {
        let uid = self.uid;
        let mut peers = Vec::with_capacity(self.world - 1);
        for p in (0..self.world).filter(|&p| p != self.rank) {
            let path = segment_path(&self.dir, &self.tag, p);
            let file = File::open(&path).map_err(|e| context(e, "opening", &path))?;
            let meta = file
                .metadata()
                .map_err(|e| context(e, "inspecting", &path))?;
            if !meta.is_file() || meta.len() != self.seg_bytes as u64 || meta.uid() != uid {
                return Err(io::Error::new(
                    io::ErrorKind::InvalidData,
                    format!(
                        "{}: not rank {p}'s segment (a file of {} bytes owned by uid {uid} \
                         expected, found {} bytes owned by uid {})",
                        path.display(),
                        self.seg_bytes,
                        meta.len(),
                        meta.uid()
                    ),
                ));
            }
            let map = MmapOptions::new()
                .len(self.seg_bytes)
                .populate()
                .map_raw_read_only(&file)
                .map_err(|e| context(e, "mapping", &path))?;
            peers.push(Peer(map));
        }
        self.peers = peers;
        Ok(())
    }

    /// Removes this rank's file name (the mappings stay valid). Call it once every peer has
    /// mapped the segment; calling it again does nothing.
    pub(crate) fn unlink(&mut self) -> io::Result<()> {
        if let Some(path) = self.path.take() {
            fs::remove_file(&path).map_err(|e| context(e, "removing", &path))?;
        }
        Ok(())
    }

    /// In place: every rank ends with the reduction of every rank's `buf` (same length on every
    /// rank, checked by the caller). `sync` returns once every rank has called it (the caller's
    /// socket barrier; it also fails if a peer died, which must be propagated).
    ///
    /// Reduces in rank order, so every rank gets the same bits as a sequential fold of rank 0's,
    /// rank 1's, ... buffers with `reduce_into`. Pipelined: pieces + 1 syncs (module doc).
    pub(crate) fn all_reduce(
        &mut self,
        buf: &mut [u8],
        dtype: DType,
        op: ReduceOp,
        sync: &mut dyn FnMut() -> Result<(), Error>,
    ) -> Result<(), Error> {
        debug_assert_eq!(buf.len() % dtype.size(), 0);
        if self.world == 1 {
            // One rank: the reduction is its own buffer (Avg divides by 1).
            return Ok(());
        }
        self.check_open()?;
        let slot = self.half / self.world / LINE * LINE;
        let plan = Plan {
            n: self.world,
            len: buf.len(),
            first: self.next_half,
            half: self.half,
            slot,
            piece: slot * self.world,
        };
        let pieces = buf.len().div_ceil(plan.piece);
        if pieces == 0 {
            return Ok(());
        }
        self.next_half = (plan.first + pieces) % 2;
        self.publish(buf, &plan, 0);
        for t in 0..pieces {
            synced(sync)?;
            self.reduce_chunk(buf, &plan, t, dtype, op);
            if t > 0 {
                self.fetch(buf, &plan, t - 1);
            }
            if t + 1 < pieces {
                self.publish(buf, &plan, t + 1);
            }
        }
        synced(sync)?;
        self.fetch(buf, &plan, pieces - 1);
        Ok(())
    }

    /// Phase 1 of piece `t`: copies the chunks other ranks own into this rank's segment.
    fn publish(&mut self, buf: &[u8], plan: &Plan, t: usize) {
        for j in (0..plan.n).filter(|&j| j != self.rank) {
            let (b, s) = plan.chunk(t, j);
            self.own.write(s, |dst| dst.copy_from_slice(&buf[b]));
        }
    }

    /// Phase 2 of piece `t`: reduces this rank's chunk in rank order 0..n into `buf` and into
    /// its slot of this rank's segment.
    fn reduce_chunk(&mut self, buf: &mut [u8], plan: &Plan, t: usize, dtype: DType, op: ReduceOp) {
        let (n, r) = (plan.n, self.rank);
        let (b, s) = plan.chunk(t, r);
        if b.is_empty() {
            return;
        }
        let mine = &mut buf[b];
        let peers = &self.peers;
        if r <= 1 {
            // Rank 0's or rank 1's buffer can hold the running result itself: x0 (op x1) for
            // rank 0, x0 op x1 by the reversed kernel for rank 1.
            if r == 1 {
                peer(peers, r, 0).read(s.clone(), |src| reduce_into_after(mine, src, dtype, op));
            }
            for p in r + 1..n {
                peer(peers, r, p).read(s.clone(), |src| reduce_into(mine, src, dtype, op));
            }
            if op == ReduceOp::Avg {
                finish_avg(mine, dtype, n);
            }
            self.own.write(s, |dst| dst.copy_from_slice(mine));
        } else {
            // Later ranks fold into their own slot (unused until now), starting from rank 0's
            // data, their own buffer joining at its turn.
            self.own.write(s.clone(), |acc| {
                peer(peers, r, 0).read(s.clone(), |src| acc.copy_from_slice(src));
                for p in 1..n {
                    if p == r {
                        reduce_into(acc, mine, dtype, op);
                    } else {
                        peer(peers, r, p).read(s.clone(), |src| reduce_into(acc, src, dtype, op));
                    }
                }
                if op == ReduceOp::Avg {
                    finish_avg(acc, dtype, n);
                }
                mine.copy_from_slice(acc);
            });
        }
    }

    /// Phase 3 of piece `t`: copies every peer's reduced chunk from its segment into `buf`.
    fn fetch(&self, buf: &mut [u8], plan: &Plan, t: usize) {
        for j in (0..plan.n).filter(|&j| j != self.rank) {
            let (b, s) = plan.chunk(t, j);
            peer(&self.peers, self.rank, j).read(s, |src| buf[b].copy_from_slice(src));
        }
    }

    /// `recv` (world * send.len()) ends with every rank's `send`, in rank order.
    ///
    /// One sync per piece of half a segment.
    pub(crate) fn all_gather(
        &mut self,
        send: &[u8],
        recv: &mut [u8],
        sync: &mut dyn FnMut() -> Result<(), Error>,
    ) -> Result<(), Error> {
        let (n, r, len) = (self.world, self.rank, send.len());
        debug_assert_eq!(recv.len(), n * len);
        recv[r * len..(r + 1) * len].copy_from_slice(send);
        if n == 1 {
            return Ok(());
        }
        self.check_open()?;
        for start in (0..len).step_by(self.half) {
            let end = (start + self.half).min(len);
            let base = self.take_half();
            let s = base..base + (end - start);
            self.own
                .write(s.clone(), |dst| dst.copy_from_slice(&send[start..end]));
            synced(sync)?;
            for j in (0..n).filter(|&j| j != r) {
                let dst = &mut recv[j * len + start..j * len + end];
                peer(&self.peers, r, j).read(s.clone(), |src| dst.copy_from_slice(src));
            }
        }
        Ok(())
    }

    /// The offset of the half the next piece uses, flipping halves for the one after.
    fn take_half(&mut self) -> usize {
        let base = self.next_half * self.half;
        self.next_half ^= 1;
        base
    }

    /// Fails when the peers' segments are not mapped (a bug in the caller).
    fn check_open(&self) -> Result<(), Error> {
        if self.peers.len() + 1 == self.world {
            Ok(())
        } else {
            Err(Error::Backend {
                backend: "cpu",
                message: "shared-memory arena used before its peers were mapped".into(),
            })
        }
    }
}

impl Drop for ShmArena {
    /// Removes the file name if [`ShmArena::unlink`] never ran (an error during setup).
    fn drop(&mut self) {
        if let Some(path) = self.path.take() {
            let _ = fs::remove_file(path);
        }
    }
}

/// This rank's segment, mapped read-write.
#[derive(Debug)]
struct Own(MmapRaw);

impl Own {
    /// Runs `f` on bytes `range` of the segment, writable. `&mut self` keeps this process's
    /// views of its own segment from aliasing; the protocol (module doc) keeps other
    /// processes off `range` while the view lives.
    #[allow(unsafe_code)]
    fn write<R>(&mut self, range: Range<usize>, f: impl FnOnce(&mut [u8]) -> R) -> R {
        assert!(range.start <= range.end && range.end <= self.0.len());
        // SAFETY: the pointer is in bounds (checked above) of a live shared mapping of
        // `self.0.len()` bytes that is readable and writable (`map_raw` of a file we opened
        // read-write), non-null and, for `u8`, aligned; its bytes are initialised (the file
        // was zero-filled) and every bit pattern is a valid `u8`. The mapping's length never
        // changes (we never remap; only a malicious same-user process could truncate the file,
        // see the module doc). Exclusivity: within this process, `&mut self` rules out any
        // other view of this segment while `f` runs; across processes, the protocol gives
        // `range` to this rank alone between the current pair of syncs (peers read it only
        // after the next sync, and a sync is never called inside `f`, whose borrow ends before we
        // return).
        let view = unsafe {
            std::slice::from_raw_parts_mut(self.0.as_mut_ptr().add(range.start), range.len())
        };
        f(view)
    }
}

/// A peer's segment, mapped read-only.
#[derive(Debug)]
struct Peer(MmapRaw);

impl Peer {
    /// Runs `f` on bytes `range` of the peer's segment.
    #[allow(unsafe_code)]
    fn read<R>(&self, range: Range<usize>, f: impl FnOnce(&[u8]) -> R) -> R {
        assert!(range.start <= range.end && range.end <= self.0.len());
        // SAFETY: the pointer is in bounds (checked above) of a live, readable shared mapping
        // (`map_raw_read_only`) that never shrinks (see `Own::write`), non-null and aligned for
        // `u8`; the bytes are initialised (the owner zero-filled the file before anyone mapped
        // it) and any bit pattern is a `u8`. Immutability while the view lives: this process
        // maps the peer's pages read-only and never writes them; the peer (their only writer)
        // wrote `range` before the last sync, which we have since left, and writes it
        // again only after a later sync, which we enter only after `f` has returned (no sync is
        // called inside `f`). The fences around every sync order its stores before our loads
        // and our loads before its next stores.
        let view =
            unsafe { std::slice::from_raw_parts(self.0.as_ptr().add(range.start), range.len()) };
        f(view)
    }
}

/// Where the pieces and chunks of one all_reduce lie, in the buffer and in the segments.
///
/// Pieces are `piece` bytes (the last one shorter); chunk j of every piece goes to slot j of a
/// half (`slot` bytes at `j * slot`), whatever the piece's length, so that chunks of pieces of
/// different lengths never overlap in the segment (the pipelining relies on it).
struct Plan {
    n: usize,
    /// The buffer's length.
    len: usize,
    /// The half piece 0 uses; piece t uses half `(first + t) % 2`.
    first: usize,
    half: usize,
    slot: usize,
    piece: usize,
}

impl Plan {
    /// Chunk `j` of piece `t`: its bytes in the buffer and in the owner's or publisher's segment.
    fn chunk(&self, t: usize, j: usize) -> (Range<usize>, Range<usize>) {
        let start = t * self.piece;
        let c = chunk((start + self.piece).min(self.len) - start, self.n, j);
        debug_assert!(c.len() <= self.slot);
        let at = (self.first + t) % 2 * self.half + j * self.slot;
        (start + c.start..start + c.end, at..at + c.len())
    }
}

/// Peer `p`'s segment (`p != rank`) in `peers`, which skips `rank`.
fn peer(peers: &[Peer], rank: usize, p: usize) -> &Peer {
    debug_assert_ne!(p, rank);
    &peers[if p < rank { p } else { p - 1 }]
}

/// Bytes of chunk `j` of a piece of `len` bytes split among `n` owners: boundaries at multiples
/// of [`LINE`] (whole elements, no shared cache line), the last chunks shorter or empty.
fn chunk(len: usize, n: usize, j: usize) -> Range<usize> {
    let per = len.div_ceil(n).next_multiple_of(LINE);
    (j * per).min(len)..((j + 1) * per).min(len)
}

/// The caller's sync, with fences that keep the compiler and the CPU from moving shared-memory
/// accesses across it.
fn synced(sync: &mut dyn FnMut() -> Result<(), Error>) -> Result<(), Error> {
    fence(Ordering::SeqCst);
    let result = sync();
    fence(Ordering::SeqCst);
    result
}

fn segment_path(dir: &Path, tag: &str, rank: usize) -> PathBuf {
    dir.join(format!("muster-{tag}-{rank}"))
}

/// Writes `len` zero bytes into `file`: allocates the tmpfs pages now, so that a full
/// `/dev/shm` is an error here rather than a `SIGBUS` on first touch of the mapping.
fn fill(file: &File, len: usize) -> io::Result<()> {
    let zeros = vec![0u8; FILL.min(len)];
    let mut at = 0;
    while at < len {
        let n = zeros.len().min(len - at);
        file.write_all_at(&zeros[..n], at as u64)?;
        at += n;
    }
    Ok(())
}

fn context(e: io::Error, what: &str, path: &Path) -> io::Error {
    io::Error::new(e.kind(), format!("{what} {}: {e}", path.display()))
}

#[cfg(test)]
mod tests {
    use std::sync::{
        Barrier,
        atomic::{AtomicUsize, Ordering},
    };

    use half::{bf16, f16};

    use super::*;

    const DTYPES: [DType; 7] = [
        DType::F32,
        DType::F64,
        DType::F16,
        DType::BF16,
        DType::I32,
        DType::I64,
        DType::U8,
    ];
    const OPS: [ReduceOp; 5] = [
        ReduceOp::Sum,
        ReduceOp::Avg,
        ReduceOp::Min,
        ReduceOp::Max,
        ReduceOp::Product,
    ];

    /// A directory for segments: tmpfs when there is one.
    fn dir() -> PathBuf {
        let shm = Path::new("/dev/shm");
        if shm.is_dir() {
            shm.to_path_buf()
        } else {
            std::env::temp_dir()
        }
    }

    /// A tag no other test (or test process) uses.
    fn unique_tag() -> String {
        static NEXT: AtomicUsize = AtomicUsize::new(0);
        format!(
            "test-{}-{}",
            std::process::id(),
            NEXT.fetch_add(1, Ordering::Relaxed)
        )
    }

    /// How the test ranks synchronise.
    #[derive(Clone, Copy, PartialEq)]
    enum Sync {
        /// `std::sync::Barrier` (threads sleep).
        Block,
        /// `Block`, then each rank yields a varying number of times, so that ranks drift
        /// apart inside a phase and races between phases would show.
        Jitter,
        /// A spinning barrier: the cheapest sync there is, to time the arena's own work.
        Spin,
    }

    /// A sense-counting spin barrier for `n` threads.
    struct SpinBarrier {
        n: usize,
        arrived: AtomicUsize,
        generation: AtomicUsize,
    }

    impl SpinBarrier {
        fn wait(&self) {
            let generation = self.generation.load(Ordering::Acquire);
            if self.arrived.fetch_add(1, Ordering::AcqRel) + 1 == self.n {
                self.arrived.store(0, Ordering::Relaxed);
                self.generation.fetch_add(1, Ordering::Release);
            } else {
                let mut spins = 0u32;
                while self.generation.load(Ordering::Acquire) == generation {
                    spins += 1;
                    if spins < 1 << 14 {
                        std::hint::spin_loop();
                    } else {
                        std::thread::yield_now();
                    }
                }
            }
        }
    }

    /// Runs `body(arena, sync)` on `world` threads, one rank each, after the real setup
    /// sequence (create, sync, open_peers, sync, unlink), and returns each rank's result.
    fn with_ranks<T: Send>(
        world: usize,
        seg_bytes: usize,
        body: impl Fn(&mut ShmArena, &mut dyn FnMut() -> Result<(), Error>) -> T + std::marker::Sync,
    ) -> Vec<T> {
        with_ranks_using(Sync::Jitter, world, seg_bytes, body)
    }

    fn with_ranks_using<T: Send>(
        how: Sync,
        world: usize,
        seg_bytes: usize,
        body: impl Fn(&mut ShmArena, &mut dyn FnMut() -> Result<(), Error>) -> T + std::marker::Sync,
    ) -> Vec<T> {
        let (dir, tag) = (dir(), unique_tag());
        let barrier = Barrier::new(world);
        let spin = SpinBarrier {
            n: world,
            arrived: AtomicUsize::new(0),
            generation: AtomicUsize::new(0),
        };
        std::thread::scope(|s| {
            let handles: Vec<_> = (0..world)
                .map(|rank| {
                    let (dir, tag, barrier, spin, body) = (&dir, &tag, &barrier, &spin, &body);
                    s.spawn(move || {
                        let mut calls = rank;
                        let mut sync = || -> Result<(), Error> {
                            if how == Sync::Spin {
                                spin.wait();
                            } else {
                                barrier.wait();
                            }
                            if how == Sync::Jitter {
                                calls = calls.wrapping_mul(2_654_435_761).wrapping_add(12_345);
                                for _ in 0..(calls >> 7) % 4 {
                                    std::thread::yield_now();
                                }
                            }
                            Ok(())
                        };
                        let mut arena =
                            ShmArena::create(dir, tag, rank, world, seg_bytes).expect("create");
                        let path = segment_path(dir, tag, rank);
                        assert!(path.exists());
                        sync().expect("sync");
                        arena.open_peers().expect("open_peers");
                        sync().expect("sync");
                        arena.unlink().expect("unlink");
                        assert!(!path.exists(), "{} is still there", path.display());
                        arena.unlink().expect("a second unlink does nothing");
                        body(&mut arena, &mut sync)
                    })
                })
                .collect();
            handles
                .into_iter()
                .map(|h| h.join().expect("rank thread"))
                .collect()
        })
    }

    /// Rank `rank`'s test value at element `i`: small integers, so every reduction of up to 4
    /// ranks is exact in every type (non-negative for u8).
    fn value(dtype: DType, rank: usize, i: usize) -> i64 {
        if dtype == DType::U8 {
            1 + ((i * 7 + rank * 3) % 3) as i64
        } else {
            ((i * 7 + rank * 3) % 5) as i64 - 2
        }
    }

    fn encode(dtype: DType, vals: impl Iterator<Item = i64>) -> Vec<u8> {
        let mut out = Vec::new();
        for v in vals {
            match dtype {
                DType::F32 => out.extend_from_slice(&(v as f32).to_ne_bytes()),
                DType::F64 => out.extend_from_slice(&(v as f64).to_ne_bytes()),
                DType::F16 => out.extend_from_slice(&f16::from_f32(v as f32).to_ne_bytes()),
                DType::BF16 => out.extend_from_slice(&bf16::from_f32(v as f32).to_ne_bytes()),
                DType::I32 => out.extend_from_slice(&(v as i32).to_ne_bytes()),
                DType::I64 => out.extend_from_slice(&v.to_ne_bytes()),
                DType::U8 => out.push(v as u8),
            }
        }
        out
    }

    fn is_float(dtype: DType) -> bool {
        matches!(dtype, DType::F32 | DType::F64 | DType::F16 | DType::BF16)
    }

    /// The expected all_reduce result at element `i`, computed independently of the kernels.
    fn expected(dtype: DType, op: ReduceOp, n: usize, i: usize) -> Vec<u8> {
        let vals = (0..n).map(|r| value(dtype, r, i));
        let sum: i64 = vals.clone().sum();
        let one = match op {
            ReduceOp::Sum => sum,
            // In floats, to get the sign of zero right (0 * -2 is -0.0).
            ReduceOp::Product if is_float(dtype) => {
                let product: f64 = vals.map(|v| v as f64).product();
                return match dtype {
                    DType::F32 => (product as f32).to_ne_bytes().to_vec(),
                    DType::F64 => product.to_ne_bytes().to_vec(),
                    DType::F16 => f16::from_f64(product).to_ne_bytes().to_vec(),
                    _ => bf16::from_f64(product).to_ne_bytes().to_vec(),
                };
            }
            ReduceOp::Product => vals.product(),
            ReduceOp::Min => vals.min().expect("n >= 1"),
            ReduceOp::Max => vals.max().expect("n >= 1"),
            ReduceOp::Avg => {
                let nf = n as f32;
                return match dtype {
                    DType::F32 => (sum as f32 / nf).to_ne_bytes().to_vec(),
                    DType::F64 => (sum as f64 / n as f64).to_ne_bytes().to_vec(),
                    DType::F16 => f16::from_f32(sum as f32 / nf).to_ne_bytes().to_vec(),
                    DType::BF16 => bf16::from_f32(sum as f32 / nf).to_ne_bytes().to_vec(),
                    // Integers truncate toward zero.
                    _ => encode(dtype, std::iter::once(sum / n as i64)),
                };
            }
        };
        encode(dtype, std::iter::once(one))
    }

    #[test]
    fn all_reduce_matches_a_reference_for_every_type_op_size_and_world() {
        const SEGMENT: usize = 4 << 10;
        for world in 1..=4 {
            let failures = with_ranks(world, SEGMENT, |arena, sync| {
                let mut failures = Vec::new();
                for dtype in DTYPES {
                    let size = dtype.size();
                    // Empty, one element, not a multiple of n, and several pieces with a
                    // short last one (a half segment is 2 KiB).
                    for elems in [0, 1, world + 1, (10 << 10) / size + 3] {
                        for op in OPS {
                            let rank = arena.rank;
                            let mut buf = encode(dtype, (0..elems).map(|i| value(dtype, rank, i)));
                            arena
                                .all_reduce(&mut buf, dtype, op, sync)
                                .expect("all_reduce");
                            let want: Vec<u8> = (0..elems)
                                .flat_map(|i| expected(dtype, op, world, i))
                                .collect();
                            if buf != want {
                                failures.push(format!(
                                    "rank {rank}: {dtype} {op:?} of {elems} elements"
                                ));
                            }
                        }
                    }
                }
                failures
            });
            let failures: Vec<String> = failures.into_iter().flatten().collect();
            assert!(failures.is_empty(), "world {world}: {failures:#?}");
        }
    }

    #[test]
    fn all_reduce_folds_in_rank_order_and_every_rank_gets_the_same_bits() {
        // Random floats: sums depend on the order, so compare with a sequential fold.
        const ELEMS: usize = 3000;
        let data = |rank: usize| -> Vec<u8> {
            let mut x = 0x9e37_79b9_7f4a_7c15u64 ^ (rank as u64 + 1);
            let v: Vec<f32> = (0..ELEMS)
                .map(|_| {
                    x ^= x << 13;
                    x ^= x >> 7;
                    x ^= x << 17;
                    (x % 1_000_000) as f32 * 1e-3 - 500.0 + (x >> 40) as f32 * 1e-9
                })
                .collect();
            bytemuck::cast_slice(&v).to_vec()
        };
        for world in 3..=4 {
            for op in [ReduceOp::Sum, ReduceOp::Avg, ReduceOp::Product] {
                let mut want = data(0);
                for r in 1..world {
                    reduce_into(&mut want, &data(r), DType::F32, op);
                }
                if op == ReduceOp::Avg {
                    finish_avg(&mut want, DType::F32, world);
                }
                let got = with_ranks(world, 2 << 10, |arena, sync| {
                    let mut buf = data(arena.rank);
                    arena
                        .all_reduce(&mut buf, DType::F32, op, sync)
                        .expect("all_reduce");
                    buf
                });
                for (rank, buf) in got.iter().enumerate() {
                    assert!(*buf == want, "world {world} {op:?}: rank {rank} differs");
                }
            }
        }
    }

    #[test]
    fn all_gather_concatenates_in_rank_order() {
        for world in 1..=4 {
            let got = with_ranks(world, 512, |arena, sync| {
                let mut results = Vec::new();
                // A half segment is 256 bytes: several pieces, a short last one.
                for len in [0, 1, 129, 1000] {
                    let send: Vec<u8> = (0..len).map(|i| (i * 31 + arena.rank * 7) as u8).collect();
                    let mut recv = vec![0xAA; world * len];
                    arena
                        .all_gather(&send, &mut recv, sync)
                        .expect("all_gather");
                    let want: Vec<u8> = (0..world)
                        .flat_map(|r| (0..len).map(move |i| (i * 31 + r * 7) as u8))
                        .collect();
                    results.push(recv == want);
                }
                results
            });
            for (rank, ok) in got.iter().enumerate() {
                assert!(ok.iter().all(|&ok| ok), "world {world} rank {rank}: {ok:?}");
            }
        }
    }

    #[test]
    fn collectives_interleave_on_one_arena() {
        // all_gather and all_reduce share the halves' alternation.
        let got = with_ranks(3, 512, |arena, sync| {
            let rank = arena.rank;
            let mut ok = true;
            for round in 0..5usize {
                let send = vec![(rank + round) as u8; 300 + round];
                let mut recv = vec![0; 3 * send.len()];
                arena
                    .all_gather(&send, &mut recv, sync)
                    .expect("all_gather");
                ok &= recv
                    .chunks(send.len())
                    .enumerate()
                    .all(|(r, c)| c.iter().all(|&b| b == (r + round) as u8));
                let mut buf = encode(DType::I32, (0..500).map(|i| (i + rank) as i64));
                arena
                    .all_reduce(&mut buf, DType::I32, ReduceOp::Sum, sync)
                    .expect("all_reduce");
                ok &= buf == encode(DType::I32, (0..500).map(|i| 3 * i as i64 + 3));
            }
            ok
        });
        assert_eq!(got, [true; 3]);
    }

    #[test]
    fn a_failed_sync_is_returned_and_a_dropped_arena_leaves_no_file() {
        let (dir, tag) = (dir(), unique_tag());
        let mut a = ShmArena::create(&dir, &tag, 0, 2, 1024).expect("create 0");
        let mut b = ShmArena::create(&dir, &tag, 1, 2, 1024).expect("create 1");
        a.open_peers().expect("open_peers 0");
        b.open_peers().expect("open_peers 1");
        let mut failing = || -> Result<(), Error> { Err(Error::Usage("peer died".into())) };
        let mut buf = vec![0u8; 64];
        let err = a
            .all_reduce(&mut buf, DType::U8, ReduceOp::Sum, &mut failing)
            .expect_err("the sync failed");
        assert!(err.to_string().contains("peer died"), "{err}");
        let err = a
            .all_gather(&buf, &mut [0; 128], &mut failing)
            .expect_err("the sync failed");
        assert!(err.to_string().contains("peer died"), "{err}");
        drop((a, b));
        assert!(!segment_path(&dir, &tag, 0).exists());
        assert!(!segment_path(&dir, &tag, 1).exists());
    }

    #[test]
    fn setup_refuses_bad_arguments_and_foreign_files() {
        let (dir, tag) = (dir(), unique_tag());
        for (rank, world, seg) in [(2, 2, 1024), (0, 2, 64)] {
            let err = ShmArena::create(&dir, &tag, rank, world, seg).expect_err("bad arguments");
            assert_eq!(err.kind(), io::ErrorKind::InvalidInput);
        }
        let _a = ShmArena::create(&dir, &tag, 0, 2, 1024).expect("create");
        let err = ShmArena::create(&dir, &tag, 0, 2, 1024).expect_err("exists");
        assert_eq!(err.kind(), io::ErrorKind::AlreadyExists);
        // A peer file of the wrong size is refused; a missing one too.
        let mut c = ShmArena::create(&dir, &tag, 1, 2, 2048).expect("create");
        let mut a2 = ShmArena::create(&dir, &unique_tag(), 0, 2, 1024).expect("create");
        assert_eq!(
            a2.open_peers().expect_err("missing").kind(),
            io::ErrorKind::NotFound
        );
        let err = c.open_peers().expect_err("wrong size");
        assert_eq!(err.kind(), io::ErrorKind::InvalidData, "{err}");
    }

    /// Release timing of the arena alone: 2 threads, 64 MiB f32 all_reduce, against memcpy of
    /// 64 MiB (one thread alone, and two at once, as the ranks run). Best of `ITERS` (the
    /// slowest rank's time per iteration), to see through other load on the machine.
    /// `cargo test --release -p muster --lib shm::tests::bandwidth -- --ignored --nocapture`
    #[test]
    #[ignore = "timing; run in release with --nocapture"]
    fn bandwidth() {
        use std::{hint::black_box, time::Instant};
        const BYTES: usize = 64 << 20;
        const ITERS: usize = 12;
        let gbs = |bytes: f64, secs: f64| bytes / secs / 1e9;
        let memcpy = |_: usize| {
            let src = vec![1u8; BYTES];
            let mut dst = vec![0u8; BYTES];
            (0..ITERS)
                .map(|_| {
                    let t = Instant::now();
                    black_box(&mut dst).copy_from_slice(black_box(&src));
                    t.elapsed().as_secs_f64()
                })
                .fold(f64::MAX, f64::min)
        };
        let one = gbs(BYTES as f64, memcpy(0));
        let two = std::thread::scope(|s| {
            let handles: Vec<_> = (0..2).map(|i| s.spawn(move || memcpy(i))).collect();
            let times: Vec<f64> = handles
                .into_iter()
                .map(|h| h.join().expect("memcpy"))
                .collect();
            gbs(BYTES as f64, times.into_iter().fold(0.0, f64::max))
        });
        println!("memcpy 64 MiB: 1 thread {one:.2} GB/s, 2 threads at once {two:.2} GB/s each");
        let world = 2;
        for how in [Sync::Block, Sync::Spin] {
            for seg in [512 << 10, 1 << 20, 2 << 20, 4 << 20, 8 << 20] {
                let times = with_ranks_using(how, world, seg, |arena, sync| {
                    let mut buf =
                        bytemuck::cast_slice::<f32, u8>(&vec![1.0f32; BYTES / 4]).to_vec();
                    arena
                        .all_reduce(&mut buf, DType::F32, ReduceOp::Sum, sync)
                        .expect("warm-up");
                    (0..ITERS)
                        .map(|_| {
                            sync().expect("sync");
                            let (mut syncs, mut in_sync) = (0, 0.0);
                            let mut timed = || {
                                let t = Instant::now();
                                let result = sync();
                                in_sync += t.elapsed().as_secs_f64();
                                syncs += 1;
                                result
                            };
                            let t = Instant::now();
                            arena
                                .all_reduce(&mut buf, DType::F32, ReduceOp::Sum, &mut timed)
                                .expect("all_reduce");
                            (t.elapsed().as_secs_f64(), in_sync, syncs)
                        })
                        .collect::<Vec<_>>()
                });
                // The iteration whose slowest rank was fastest.
                let (best, in_sync, syncs) = (0..ITERS)
                    .map(|i| {
                        times
                            .iter()
                            .map(|t| t[i])
                            .fold((0.0, 0.0, 0), |a, b| if b.0 > a.0 { b } else { a })
                    })
                    .fold((f64::MAX, 0.0, 0), |a, b| if b.0 < a.0 { b } else { a });
                let bus = gbs(BYTES as f64 * 2.0 * (world - 1) as f64 / world as f64, best);
                println!(
                    "all_reduce 64 MiB f32, {world} threads, {:5} sync, segment {:>5} KiB: \
                     {:6.2} ms ({syncs} syncs, {:6.2} ms in them), bus bandwidth {bus:.2} GB/s \
                     ({:.0}% of 1-thread memcpy)",
                    if how == Sync::Spin { "spin" } else { "block" },
                    seg >> 10,
                    best * 1e3,
                    in_sync * 1e3,
                    100.0 * bus / one
                );
            }
        }
    }
}
