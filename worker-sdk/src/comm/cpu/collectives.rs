//! The collectives ([`Backend`] for [`CpuBackend`]): each picks the small-message exchange,
//! shared memory, cross-memory attach or the rings, and runs it through the engine.

use crate::Error;
use crate::comm::{
    Backend, BackendKind, DType, ReduceOp,
    reduce::{finish_avg, reduce_into},
};

use super::{
    CpuBackend, HEADER_BYTES, SMALL_BYTES,
    conn::{read_exact_nb, write_all_nb},
    engine::fold_in_rank_order,
    wire::{Header, Kind, shapes},
};

impl Backend for CpuBackend {
    fn kind(&self) -> BackendKind {
        BackendKind::Cpu
    }

    fn describe(&mut self, op: &'static str, dtype: DType) {
        self.context = Some((op, dtype));
    }

    fn all_reduce(&mut self, buf: &mut [u8], dtype: DType, op: ReduceOp) -> Result<(), Error> {
        let n = self.world;
        let header = self.header(Kind::AllReduce, Some(op), buf.len(), 0, dtype);
        if n == 1 {
            self.check_usable()?;
            if op == ReduceOp::Avg {
                finish_avg(buf, dtype, 1);
            }
            return Ok(());
        }
        let small = buf.len() <= SMALL_BYTES;
        if self.shm.is_some() && !small {
            return self.shm_all_reduce(header, buf, dtype, op);
        }
        if self.cma && !small {
            return self.cma_all_reduce(header, buf, dtype, op, None);
        }
        let len = buf.len();
        // The small path reduces in rank order and needs its own input apart; the ring works
        // in place.
        let source = if small { buf.to_vec() } else { Vec::new() };
        let mine = self.rank;
        let src = &source[..];
        self.run(
            header,
            &|_| small.then_some(0..len),
            src,
            &|_| small,
            |this, header, payloads| {
                if small {
                    fold_in_rank_order(buf, &payloads, &source, mine, dtype, op);
                } else {
                    let elem = dtype.size();
                    let r = this.rank as isize;
                    let chunk = |i: isize| Self::chunk(len, elem, n, this.wrap(i));
                    let mut recvs = Vec::with_capacity(2 * n - 2);
                    for s in 0..n as isize - 1 {
                        recvs.push((chunk(r - 2 - s), true));
                    }
                    for t in 0..n as isize - 1 {
                        recvs.push((chunk(r - 1 - t), false));
                    }
                    let mut sends = vec![(chunk(r - 1), None)];
                    sends.extend(
                        recvs[..2 * n - 3]
                            .iter()
                            .enumerate()
                            .map(|(k, (range, _))| (range.clone(), Some(k))),
                    );
                    let next = this.wrap(r + 1);
                    let prev = this.wrap(r - 1);
                    this.stream(
                        header,
                        buf,
                        Some((next, sends)),
                        Some((prev, recvs)),
                        dtype,
                        op,
                    )?;
                }
                if op == ReduceOp::Avg {
                    finish_avg(buf, dtype, n);
                }
                Ok(())
            },
        )
    }

    fn broadcast(&mut self, buf: &mut [u8], root: usize) -> Result<(), Error> {
        let n = self.world;
        let header = self.header(Kind::Broadcast, None, buf.len(), root, DType::U8);
        if n == 1 {
            return self.check_usable();
        }
        let small = buf.len() <= SMALL_BYTES;
        if self.cma && !small {
            return self.cma_broadcast(header, buf, root);
        }
        let len = buf.len();
        let mine = self.rank;
        let source = if small && mine == root {
            buf.to_vec()
        } else {
            Vec::new()
        };
        self.run(
            header,
            &|_| (small && mine == root).then_some(0..len),
            &source,
            &|peer| small && peer == root,
            |this, header, mut payloads| {
                if small {
                    if mine != root
                        && let Some(data) = payloads[root].take()
                    {
                        buf.copy_from_slice(&data);
                    }
                    return Ok(());
                }
                // Chain root -> root+1 -> ... ; each forwards bytes as they arrive.
                let pos = (mine + n - root) % n;
                let next = (pos + 1 < n).then(|| {
                    (
                        this.wrap(mine as isize + 1),
                        vec![(0..len, (pos > 0).then_some(0))],
                    )
                });
                let prev = (pos > 0).then(|| (this.wrap(mine as isize - 1), vec![(0..len, false)]));
                this.stream(header, buf, next, prev, DType::U8, ReduceOp::Sum)
            },
        )
    }

    fn reduce(
        &mut self,
        buf: &mut [u8],
        dtype: DType,
        op: ReduceOp,
        root: usize,
    ) -> Result<(), Error> {
        let n = self.world;
        let header = self.header(Kind::Reduce, Some(op), buf.len(), root, dtype);
        if n == 1 {
            self.check_usable()?;
            if op == ReduceOp::Avg {
                finish_avg(buf, dtype, 1);
            }
            return Ok(());
        }
        let small = buf.len() <= SMALL_BYTES;
        if self.cma && !small {
            return self.cma_all_reduce(header, buf, dtype, op, Some(root));
        }
        let len = buf.len();
        let mine = self.rank;
        let source = if small { buf.to_vec() } else { Vec::new() };
        self.run(
            header,
            &|peer| (small && peer == root).then_some(0..len),
            &source,
            &|_| small && mine == root,
            |this, header, payloads| {
                if small {
                    if mine == root {
                        fold_in_rank_order(buf, &payloads, &source, mine, dtype, op);
                    }
                } else {
                    // Chain towards the root: root+n-1 -> ... -> root+1 -> root, each reducing.
                    let pos = (mine + n - root) % n;
                    let next = (pos > 0).then(|| {
                        (
                            this.wrap(mine as isize - 1),
                            vec![(0..len, (pos + 1 < n).then_some(0))],
                        )
                    });
                    let prev =
                        (pos + 1 < n).then(|| (this.wrap(mine as isize + 1), vec![(0..len, true)]));
                    this.stream(header, buf, next, prev, dtype, op)?;
                }
                if op == ReduceOp::Avg && mine == root {
                    finish_avg(buf, dtype, n);
                }
                Ok(())
            },
        )
    }

    fn all_gather(&mut self, send: &[u8], recv: &mut [u8]) -> Result<(), Error> {
        let n = self.world;
        let len = send.len();
        let header = self.header(Kind::AllGather, None, len, 0, DType::U8);
        let mine = self.rank;
        if n == 1 {
            self.check_usable()?;
            recv.copy_from_slice(send);
            return Ok(());
        }
        let small = len <= SMALL_BYTES;
        if self.shm.is_some() && !small {
            return self.shm_all_gather(header, send, recv);
        }
        if self.cma && !small {
            return self.cma_all_gather(header, send, recv);
        }
        self.run(
            header,
            &|_| small.then_some(0..len),
            send,
            &|_| small,
            |this, header, payloads| {
                recv[mine * len..(mine + 1) * len].copy_from_slice(send);
                if small {
                    for (peer, payload) in payloads.into_iter().enumerate() {
                        if let Some(data) = payload {
                            recv[peer * len..(peer + 1) * len].copy_from_slice(&data);
                        }
                    }
                    return Ok(());
                }
                let r = mine as isize;
                let slot = |i: isize| {
                    let i = this.wrap(i);
                    i * len..(i + 1) * len
                };
                let recvs: Vec<_> = (1..n as isize).map(|t| (slot(r - t), false)).collect();
                let mut sends = vec![(slot(r), None)];
                sends.extend(
                    recvs[..n - 2]
                        .iter()
                        .enumerate()
                        .map(|(k, (range, _))| (range.clone(), Some(k))),
                );
                let next = this.wrap(r + 1);
                let prev = this.wrap(r - 1);
                this.stream(
                    header,
                    recv,
                    Some((next, sends)),
                    Some((prev, recvs)),
                    DType::U8,
                    ReduceOp::Sum,
                )
            },
        )
    }

    fn reduce_scatter(
        &mut self,
        send: &[u8],
        recv: &mut [u8],
        dtype: DType,
        op: ReduceOp,
    ) -> Result<(), Error> {
        let n = self.world;
        let block = recv.len();
        let header = self.header(Kind::ReduceScatter, Some(op), send.len(), 0, dtype);
        let mine = self.rank;
        if n == 1 {
            self.check_usable()?;
            recv.copy_from_slice(send);
            if op == ReduceOp::Avg {
                finish_avg(recv, dtype, 1);
            }
            return Ok(());
        }
        let small = block <= SMALL_BYTES;
        if self.cma && !small {
            return self.cma_reduce_scatter(header, send, recv, dtype, op);
        }
        self.run(
            header,
            &|peer| small.then_some(peer * block..(peer + 1) * block),
            send,
            &|_| small,
            |this, header, payloads| {
                if small {
                    let own = &send[mine * block..(mine + 1) * block];
                    recv.copy_from_slice(payloads[0].as_deref().unwrap_or(own));
                    for (peer, payload) in payloads.iter().enumerate().skip(1) {
                        let data = if peer == mine {
                            own
                        } else {
                            payload.as_deref().unwrap_or(&[])
                        };
                        reduce_into(recv, data, dtype, op);
                    }
                } else {
                    // Ring reduce-scatter over a working copy; rank r ends with block r.
                    let mut work = send.to_vec();
                    let r = mine as isize;
                    let slot = |i: isize| {
                        let i = this.wrap(i);
                        i * block..(i + 1) * block
                    };
                    let recvs: Vec<_> = (0..n as isize - 1)
                        .map(|s| (slot(r - 2 - s), true))
                        .collect();
                    let mut sends = vec![(slot(r - 1), None)];
                    sends.extend(
                        recvs[..n - 2]
                            .iter()
                            .enumerate()
                            .map(|(k, (range, _))| (range.clone(), Some(k))),
                    );
                    let next = this.wrap(r + 1);
                    let prev = this.wrap(r - 1);
                    this.stream(
                        header,
                        &mut work,
                        Some((next, sends)),
                        Some((prev, recvs)),
                        dtype,
                        op,
                    )?;
                    recv.copy_from_slice(&work[mine * block..(mine + 1) * block]);
                }
                if op == ReduceOp::Avg {
                    finish_avg(recv, dtype, n);
                }
                Ok(())
            },
        )
    }

    fn send(&mut self, buf: &[u8], peer: usize) -> Result<(), Error> {
        self.check_usable()?;
        let mut header = self.header(Kind::Send, None, buf.len(), self.rank, DType::U8);
        header.seq = 0;
        header.payload = buf.len() as u64;
        let head = header.encode();
        let conn = self.conn(peer);
        let result = write_all_nb(conn, &head).and_then(|()| write_all_nb(conn, buf));
        result.map_err(|e| self.fail(&header, peer, e))
    }

    fn recv(&mut self, buf: &mut [u8], peer: usize) -> Result<(), Error> {
        self.check_usable()?;
        let mut expected = self.header(Kind::Send, None, buf.len(), peer, DType::U8);
        expected.seq = 0;
        expected.payload = buf.len() as u64;
        let mut head = [0u8; HEADER_BYTES];
        let conn = self.conn(peer);
        if let Err(e) = read_exact_nb(conn, &mut head) {
            return Err(self.fail(&expected, peer, e));
        }
        let Some(got) = Header::decode(&head) else {
            return Err(self.fail(&expected, peer, "garbled header".into()));
        };
        if got == expected {
            return read_exact_nb(conn, buf).map_err(|e| self.fail(&expected, peer, e));
        }
        // Drain what was sent, so the connection stays in step, and report both shapes.
        let mut left = got.payload as usize;
        let mut drain = vec![0u8; left.min(1 << 20)];
        while left > 0 {
            let k = left.min(drain.len());
            if let Err(e) = read_exact_nb(conn, &mut drain[..k]) {
                return Err(self.fail(&expected, peer, e));
            }
            left -= k;
        }
        let (a, b) = if peer < self.rank {
            (got, expected)
        } else {
            (expected, got)
        };
        let mut shapes = shapes(&[a, b]);
        shapes[0].0 = peer.min(self.rank) as u32;
        shapes[1].0 = peer.max(self.rank) as u32;
        Err(Error::ShapeMismatch {
            op: format!("recv from rank {peer}"),
            shapes,
        })
    }

    fn barrier(&mut self) -> Result<(), Error> {
        let header = self.header(Kind::Barrier, None, 0, 0, DType::U8);
        if self.world == 1 {
            return self.check_usable();
        }
        self.run(header, &|_| None, &[], &|_| false, |_, _, _| Ok(()))
    }
}
