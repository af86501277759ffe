//! Cross-memory attach (CMA): the single-copy data path of the CPU backend when every rank is a
//! process of one machine. A rank reads its peers' buffers directly with `process_vm_readv(2)`
//! (the kernel copies from the peer's pages into ours, once), where a socket copies twice
//! (sender to kernel, kernel to receiver). MPI's vader/CMA and NCCL's shm transports do the same.
//!
//! # Protocol
//! Every operation still starts with the header exchange of `CpuBackend::run` (so shape checks
//! come first), its payload being the address of this rank's buffer. Then, for all_reduce:
//! 1. **Direct reduce-scatter.** Rank r owns chunk r. It reads chunk r of every peer's buffer,
//!    step by step ([`STEP`] bytes, so the scratch stays in cache), and reduces in rank order
//!    0..n (every run gives the same bits), into its own chunk r.
//! 2. **Ready.** It sends one byte to every peer: "my chunk r is final".
//! 3. **Direct all-gather.** As each peer p's ready byte comes in, it reads chunk p of p's
//!    buffer straight into its own buffer's chunk p. Every rank ends with copies of the owners'
//!    chunks, so the results are bit-identical everywhere.
//! 4. **Done.** It sends one byte to every peer ("I read all I need from you") and returns only
//!    once every peer said so: nobody modifies or frees a buffer a peer still reads.
//!
//! all_gather, reduce_scatter and broadcast use the same pieces (reads of the peers' inputs,
//! then the done round); reduce is all_reduce with only the root gathering.
//!
//! # Why this is sound while we hold `&mut [u8]`
//! A peer's `process_vm_readv` reads our memory the way a DMA engine would, outside our
//! process's memory model; what matters is that we never write a region while a peer reads it.
//! In step 1 peers read chunks j != r of our buffer, and we write only chunk r. In step 3
//! peers read our chunk r, which is final and which we no longer write, while we write chunks
//! j != r, each only after its owner j said it finished step 1 (which is when j stopped reading
//! our chunk j). Step 4 keeps our buffer alive and untouched until no peer reads it.
//!
//! A peer that fails mid-operation shuts all its connections down before it returns (before its
//! caller can touch the buffer), and a write to a Unix socket whose other end was shut down
//! fails (EPIPE). Every read of peer p's memory is followed by a write to p (ready or done),
//! and the operation fails if that write fails: so a read that succeeded was made while p's
//! buffer held what it must. (That is why cross-memory attach is used only when every
//! connection is a Unix socket: over TCP such a write could still succeed.) A peer whose
//! process is gone gives ESRCH, named like a closed connection.
//!
//! # When
//! Only when every rank of the communicator is on one node (CMA between ranks on several nodes,
//! with sockets between the nodes, would need a hierarchical scheme; such jobs keep the rings),
//! for payloads above `SMALL_BYTES` (the one-round exchange is faster below), and only when the
//! kernel allows it: a probe at setup reads a few bytes of every peer, and any failure (EPERM
//! under Yama's `ptrace_scope` >= 1 or a seccomp filter, a non-dumpable process) makes every
//! rank keep the sockets.

use std::io::IoSliceMut;

use nix::{
    errno::Errno,
    sys::uio::{RemoteIoVec, process_vm_readv},
    unistd::Pid,
};

use super::{CLOSED, CpuBackend, Header, broken, wait, write_all_nb};
use crate::{
    Error,
    comm::{
        DType, ReduceOp,
        reduce::{finish_avg, reduce_into, reduce_into_after},
    },
};
use nix::poll::{PollFd, PollFlags};

/// Bytes read and reduced per step of the reduce-scatter: two scratch buffers of this size
/// stay in a core's L2 cache.
pub(super) const STEP: usize = 256 << 10;
/// The byte that says "my chunk is final" (step 2).
const READY: u8 = 0xc1;
/// The byte that says "I read all I need from you" (step 4).
const DONE: u8 = 0xd0;

/// What a failed step says: the peer to blame and why.
type Failure = (usize, String);

/// Reads `dst.len()` bytes at address `addr` of process `pid` into `dst`.
pub(super) fn read_remote(pid: i32, addr: usize, dst: &mut [u8]) -> Result<(), String> {
    let mut done = 0;
    while done < dst.len() {
        let rest = &mut dst[done..];
        let remote = [RemoteIoVec {
            base: addr + done,
            len: rest.len(),
        }];
        match process_vm_readv(Pid::from_raw(pid), &mut [IoSliceMut::new(rest)], &remote) {
            Ok(0) => return Err("its memory could not be read (nothing read)".into()),
            Ok(k) => done += k,
            Err(Errno::EINTR) => {}
            Err(Errno::ESRCH) => return Err("its process is gone".into()),
            Err(e) => return Err(format!("its memory could not be read ({e})")),
        }
    }
    Ok(())
}

impl CpuBackend {
    /// The header exchange of a CMA operation, carrying the address of this rank's buffer;
    /// returns every rank's buffer address, by rank.
    fn cma_start(&mut self, header: Header, addr: usize) -> Result<Vec<usize>, Error> {
        let mine = self.rank;
        let desc = (addr as u64).to_le_bytes();
        self.run(
            header,
            &|_| Some(0..desc.len()),
            &desc,
            &|_| true,
            |this, header, payloads| {
                let mut addrs = vec![addr; this.world];
                for (peer, payload) in payloads.iter().enumerate() {
                    if peer == mine {
                        continue;
                    }
                    let Some(bytes) = payload.as_deref().and_then(|b| <[u8; 8]>::try_from(b).ok())
                    else {
                        return Err(this.fail(header, peer, "it sent a garbled address".into()));
                    };
                    addrs[peer] = u64::from_le_bytes(bytes) as usize;
                }
                Ok(addrs)
            },
        )
    }

    /// Runs `body` with the CMA scratch, turning its failure into the error every rank sees.
    fn cma_body(
        &mut self,
        header: &Header,
        body: impl FnOnce(&Self, &mut [u8]) -> Result<(), Failure>,
    ) -> Result<(), Error> {
        let mut scratch = std::mem::take(&mut self.cma_scratch);
        if scratch.len() < 2 * STEP / 8 {
            scratch = vec![0u64; 2 * STEP / 8];
        }
        let result = body(self, bytemuck::cast_slice_mut(&mut scratch));
        self.cma_scratch = scratch;
        result.map_err(|(peer, reason)| self.fail(header, peer, reason))
    }

    /// all_reduce (`root` `None`) or reduce to `root` over CMA; see the module documentation.
    pub(super) fn cma_all_reduce(
        &mut self,
        header: Header,
        buf: &mut [u8],
        dtype: DType,
        op: ReduceOp,
        root: Option<usize>,
    ) -> Result<(), Error> {
        let addrs = self.cma_start(header, buf.as_ptr() as usize)?;
        let (n, r, len, elem) = (self.world, self.rank, buf.len(), dtype.size());
        let chunk = |i: usize| Self::chunk(len, elem, n, i);
        self.cma_body(&header, |this, scratch| {
            // Step 1: our chunk r, reduced from every rank's chunk r. Peers read only their
            // own chunks of our buffer meanwhile, never chunk r.
            let mine = chunk(r);
            let at: Vec<usize> = addrs.iter().map(|a| a + mine.start).collect();
            this.reduce_from_peers(&mut buf[mine.clone()], None, &at, dtype, op, scratch)?;
            if op == ReduceOp::Avg {
                finish_avg(&mut buf[mine], dtype, n);
            }
            // Steps 2 and 3: chunk p of peer p once p says it is final. From here on peers
            // read only our chunk r, and we write only the chunks of peers that are ready.
            this.cma_signal(READY, None)?;
            let gather = root.is_none_or(|root| root == r);
            this.cma_await(READY, |peer| {
                if !gather {
                    return Ok(());
                }
                let c = chunk(peer);
                read_remote(this.pids[peer], addrs[peer] + c.start, &mut buf[c])
                    .map_err(|e| (peer, e))
            })?;
            // Step 4.
            this.cma_signal(DONE, None)?;
            this.cma_await(DONE, |_| Ok(()))
        })
    }

    /// all_gather over CMA: every peer's `send`, read straight into `recv`.
    pub(super) fn cma_all_gather(
        &mut self,
        header: Header,
        send: &[u8],
        recv: &mut [u8],
    ) -> Result<(), Error> {
        let addrs = self.cma_start(header, send.as_ptr() as usize)?;
        let (n, r, len) = (self.world, self.rank, send.len());
        self.cma_body(&header, |this, _| {
            recv[r * len..(r + 1) * len].copy_from_slice(send);
            // Start with the next rank, so that the ranks do not all read rank 0 first.
            for k in 1..n {
                let peer = (r + k) % n;
                read_remote(
                    this.pids[peer],
                    addrs[peer],
                    &mut recv[peer * len..(peer + 1) * len],
                )
                .map_err(|e| (peer, e))?;
            }
            this.cma_signal(DONE, None)?;
            this.cma_await(DONE, |_| Ok(()))
        })
    }

    /// reduce_scatter over CMA: block r of every rank's `send`, reduced in rank order into
    /// `recv`.
    pub(super) fn cma_reduce_scatter(
        &mut self,
        header: Header,
        send: &[u8],
        recv: &mut [u8],
        dtype: DType,
        op: ReduceOp,
    ) -> Result<(), Error> {
        let addrs = self.cma_start(header, send.as_ptr() as usize)?;
        let (n, r, block) = (self.world, self.rank, recv.len());
        self.cma_body(&header, |this, scratch| {
            let own = &send[r * block..(r + 1) * block];
            let at: Vec<usize> = addrs.iter().map(|a| a + r * block).collect();
            this.reduce_from_peers(recv, Some(own), &at, dtype, op, scratch)?;
            if op == ReduceOp::Avg {
                finish_avg(recv, dtype, n);
            }
            this.cma_signal(DONE, None)?;
            this.cma_await(DONE, |_| Ok(()))
        })
    }

    /// broadcast over CMA: every other rank reads the root's buffer, then tells the root.
    pub(super) fn cma_broadcast(
        &mut self,
        header: Header,
        buf: &mut [u8],
        root: usize,
    ) -> Result<(), Error> {
        let addrs = self.cma_start(header, buf.as_ptr() as usize)?;
        self.cma_body(&header, |this, _| {
            if this.rank == root {
                return this.cma_await(DONE, |_| Ok(()));
            }
            read_remote(this.pids[root], addrs[root], buf).map_err(|e| (root, e))?;
            this.cma_signal(DONE, Some(root))
        })
    }

    /// `dst` = x_0 (op) x_1 (op) ... (op) x_(n-1), in rank order, where this rank's x is `own`
    /// (`None`: `dst` itself holds it) and peer p's is at `at[p]` in its process. Works in
    /// steps of [`STEP`] bytes through `scratch` (2 [`STEP`]s, aligned for every type), so that
    /// what is read from peers is reduced while it is in cache.
    fn reduce_from_peers(
        &self,
        dst: &mut [u8],
        own: Option<&[u8]>,
        at: &[usize],
        dtype: DType,
        op: ReduceOp,
        scratch: &mut [u8],
    ) -> Result<(), Failure> {
        let (n, r) = (self.world, self.rank);
        let (acc, tmp) = scratch.split_at_mut(STEP);
        let read = |p: usize, offset: usize, into: &mut [u8]| {
            read_remote(self.pids[p], at[p] + offset, into).map_err(|e| (p, e))
        };
        let mut start = 0;
        while start < dst.len() {
            let end = (start + STEP).min(dst.len());
            let (acc, tmp) = (&mut acc[..end - start], &mut tmp[..end - start]);
            let out = &mut dst[start..end];
            // `out` starts as the reduction of ranks 0..=r, then takes the others in order.
            match own {
                None if r == 0 => {}
                None => {
                    // Ranks 0..r in the scratch, then folded in before our own values.
                    read(0, start, acc)?;
                    for p in 1..r {
                        read(p, start, tmp)?;
                        reduce_into(acc, tmp, dtype, op);
                    }
                    reduce_into_after(out, acc, dtype, op);
                }
                Some(own) => {
                    let own = &own[start..end];
                    if r == 0 {
                        out.copy_from_slice(own);
                    } else {
                        read(0, start, out)?;
                        for p in 1..r {
                            read(p, start, tmp)?;
                            reduce_into(out, tmp, dtype, op);
                        }
                        reduce_into(out, own, dtype, op);
                    }
                }
            }
            for p in r + 1..n {
                read(p, start, tmp)?;
                reduce_into(out, tmp, dtype, op);
            }
            start = end;
        }
        Ok(())
    }

    /// Sends `byte` to every peer, or only to `to`.
    pub(super) fn cma_signal(&self, byte: u8, to: Option<usize>) -> Result<(), Failure> {
        for peer in 0..self.world {
            if peer != self.rank && to.is_none_or(|to| to == peer) {
                write_all_nb(self.conn(peer), &[byte]).map_err(|e| (peer, e))?;
            }
        }
        Ok(())
    }

    /// Waits for `byte` from every peer (exactly one byte from each: what follows belongs to
    /// the next operation), calling `then` with each peer as its byte arrives.
    pub(super) fn cma_await(
        &self,
        byte: u8,
        mut then: impl FnMut(usize) -> Result<(), Failure>,
    ) -> Result<(), Failure> {
        let mut pending: Vec<usize> = (0..self.world).filter(|&p| p != self.rank).collect();
        while !pending.is_empty() {
            let mut progressed = false;
            let mut i = 0;
            while i < pending.len() {
                let peer = pending[i];
                let mut got = [0u8];
                match self.conn(peer).read(&mut got) {
                    Ok(0) => return Err((peer, CLOSED.into())),
                    Ok(_) if got[0] == byte => {
                        pending.swap_remove(i);
                        progressed = true;
                        then(peer)?;
                        continue;
                    }
                    Ok(_) => {
                        return Err((
                            peer,
                            format!(
                                "it is out of step (sent {:#04x} where {byte:#04x} was due)",
                                got[0]
                            ),
                        ));
                    }
                    Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
                    Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                    Err(e) => return Err((peer, broken(&e))),
                }
                i += 1;
            }
            if !progressed && !pending.is_empty() {
                let mut fds: Vec<PollFd<'_>> = pending
                    .iter()
                    .map(|&p| PollFd::new(self.conn(p).fd(), PollFlags::POLLIN))
                    .collect();
                wait(&mut fds).map_err(|e| (pending[0], e.to_string()))?;
            }
        }
        Ok(())
    }
}
