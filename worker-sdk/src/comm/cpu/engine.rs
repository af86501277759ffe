//! Running one operation: the header exchange every collective starts with, the attribution
//! of a failure to the rank at fault, and the streaming of data around the rings.

use std::{io, ops::Range, sync::PoisonError};

use nix::poll::{PollFd, PollFlags};

use crate::comm::{DType, ReduceOp, reduce::reduce_into};
use crate::{Error, client::FailureWatch};

use super::{
    CLOSED, CpuBackend, DRAIN, HEADER_BYTES, IO_SLICE, NOTICE_TIMEOUT, Recvs, SCRATCH_WORDS, Sends,
    backend_error,
    conn::{Conn, broken, wait},
    wire::{Header, Kind, op_code, shapes},
};

impl CpuBackend {
    pub(super) fn conn(&self, peer: usize) -> &Conn {
        match &self.conns[peer] {
            Some(conn) => conn,
            None => unreachable!("every peer of a communicator is connected"),
        }
    }

    pub(super) fn scratch(&mut self) -> Vec<u64> {
        let mut s = std::mem::take(&mut self.scratch);
        if s.len() < SCRATCH_WORDS {
            s = vec![0; SCRATCH_WORDS];
        }
        s
    }

    /// The header this rank sends for an operation.
    pub(super) fn header(
        &self,
        kind: Kind,
        op: Option<ReduceOp>,
        bytes: usize,
        root: usize,
        dtype: DType,
    ) -> Header {
        let dtype = match (kind, self.context) {
            (Kind::AllGather | Kind::Broadcast | Kind::Send | Kind::Barrier, Some((_, d))) => d,
            _ => dtype,
        };
        Header {
            kind,
            op: op.map_or(0, op_code),
            dtype,
            root: root as u32,
            seq: self.seq,
            count: (bytes / dtype.size()) as u64,
            payload: 0,
        }
    }

    pub(super) fn op_name(&self, header: &Header) -> String {
        match self.context {
            Some((name, _)) if name != header.kind.name() => {
                format!("{} ({})", header.describe(), name)
            }
            _ => header.describe(),
        }
    }

    /// Turns a broken connection into the error every rank should see, and makes this
    /// communicator unusable (shutting every connection down so the other ranks' operations
    /// end too).
    pub(super) fn fail(&mut self, header: &Header, peer: usize, reason: String) -> Error {
        let op = self.op_name(header);
        let error = self.blame(&op, peer, reason);
        if let (
            Some(notices),
            Error::PeerLost {
                rank,
                node_rank,
                host,
                reason,
                ..
            },
        ) = (&self.notices, &error)
        {
            let value = format!("{rank}\n{node_rank}\n{host}\n{reason}");
            let _ = notices.runtime.block_on(async {
                tokio::time::timeout(
                    NOTICE_TIMEOUT,
                    notices.kv.compare_and_set(&notices.key, None, value),
                )
                .await
            });
        }
        self.shared.shutdown_all();
        self.broken = Some(error.to_string());
        error
    }

    /// Who to name: the rank the coordinator reported failed, else the rank another rank
    /// recorded as lost, else the peer of the connection that ended. There is no wait for the
    /// coordinator's report (which would say "exited with status 3"): a peer that closed its
    /// connection either died, or aborted after recording who did, so the peer is the right
    /// name, and the agent stops the surviving workers 500 ms after a death, too soon to wait.
    pub(super) fn blame(&self, op: &str, peer: usize, reason: String) -> Error {
        let reported = |error: Error| match error {
            Error::RankFailed {
                rank,
                node_rank,
                host,
                reason,
            } => Error::PeerLost {
                reason: without_rank_prefix(&reason, rank),
                rank,
                node_rank,
                host,
                op: op.to_owned(),
            },
            other => other,
        };
        let failure = self
            .shared
            .failure
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take();
        if let Some(error) = failure {
            return reported(error);
        }
        if let Some(notices) = &self.notices {
            let got = notices.runtime.block_on(async {
                tokio::time::timeout(NOTICE_TIMEOUT, notices.kv.get(&notices.key)).await
            });
            if let Ok(Ok(Some(value))) = got {
                let value = String::from_utf8_lossy(&value).into_owned();
                let mut lines = value.splitn(4, '\n');
                let rank = lines.next().and_then(|r| r.parse().ok());
                let node_rank = lines.next().and_then(|r| r.parse().ok());
                if let (Some(rank), Some(node_rank)) = (rank, node_rank) {
                    return Error::PeerLost {
                        rank,
                        node_rank,
                        host: lines.next().unwrap_or_default().to_owned(),
                        op: op.to_owned(),
                        reason: lines.next().unwrap_or_default().to_owned(),
                    };
                }
            }
        }
        if let Some(error) = self.watch.as_ref().and_then(FailureWatch::failed) {
            return reported(error);
        }
        let info = &self.peers[peer];
        Error::PeerLost {
            rank: peer as u32,
            node_rank: info.node_rank,
            host: info.host.clone(),
            op: op.to_owned(),
            reason,
        }
    }

    pub(super) fn check_usable(&self) -> Result<(), Error> {
        match &self.broken {
            Some(why) => Err(backend_error(format!(
                "this communicator is unusable after an earlier failure: {why}"
            ))),
            None => Ok(()),
        }
    }

    /// Runs one operation: the header exchange (with the small-message payloads `payload_to`
    /// gives per peer), the shape check, then `then` (the large-message data phase) if every
    /// header agrees. Returns the payloads received, by rank.
    pub(super) fn run<R>(
        &mut self,
        header: Header,
        payload_to: &dyn Fn(usize) -> Option<Range<usize>>,
        source: &[u8],
        receive_from: &dyn Fn(usize) -> bool,
        then: impl FnOnce(&mut Self, &Header, Vec<Option<Vec<u8>>>) -> Result<R, Error>,
    ) -> Result<R, Error> {
        self.check_usable()?;
        self.seq += 1;
        let result = self.exchange(header, payload_to, source, receive_from);
        let (headers, payloads) = match result {
            Ok(x) => x,
            Err((peer, reason)) => return Err(self.fail(&header, peer, reason)),
        };
        if headers.iter().any(|h| !h.agrees(&header)) {
            return Err(Error::ShapeMismatch {
                op: self
                    .context
                    .map_or(header.kind.name(), |(name, _)| name)
                    .to_owned(),
                shapes: shapes(&headers),
            });
        }
        then(self, &header, payloads)
    }

    /// Sends `header` (with `source[payload_to(peer)]` after it) to every peer and reads every
    /// peer's header and payload; payloads are kept from peers where `receive_from` says so,
    /// drained otherwise. Errors name the peer whose connection failed.
    #[allow(clippy::type_complexity)]
    pub(super) fn exchange(
        &self,
        header: Header,
        payload_to: &dyn Fn(usize) -> Option<Range<usize>>,
        source: &[u8],
        receive_from: &dyn Fn(usize) -> bool,
    ) -> Result<(Vec<Header>, Vec<Option<Vec<u8>>>), (usize, String)> {
        struct Out {
            head: [u8; HEADER_BYTES],
            body: Range<usize>,
            sent: usize,
        }
        struct In {
            head: [u8; HEADER_BYTES],
            got: usize,
            header: Option<Header>,
            body: Vec<u8>,
            body_got: usize,
            keep: bool,
            done: bool,
        }
        let n = self.world;
        let mut outs: Vec<Option<Out>> = (0..n)
            .map(|peer| {
                (peer != self.rank).then(|| {
                    let body = payload_to(peer).unwrap_or(0..0);
                    let mut h = header;
                    h.payload = body.len() as u64;
                    Out {
                        head: h.encode(),
                        body,
                        sent: 0,
                    }
                })
            })
            .collect();
        let mut ins: Vec<Option<In>> = (0..n)
            .map(|peer| {
                (peer != self.rank).then(|| In {
                    head: [0; HEADER_BYTES],
                    got: 0,
                    header: None,
                    body: Vec::new(),
                    body_got: 0,
                    keep: receive_from(peer),
                    done: false,
                })
            })
            .collect();
        let mut drain = vec![0u8; DRAIN];
        loop {
            let mut progressed = false;
            let mut pending = false;
            for peer in 0..n {
                let Some(conn) = &self.conns[peer] else {
                    continue;
                };
                if let Some(out) = outs[peer].as_mut() {
                    let total = HEADER_BYTES + out.body.len();
                    while out.sent < total {
                        let chunk = if out.sent < HEADER_BYTES {
                            &out.head[out.sent..]
                        } else {
                            let from = out.body.start + out.sent - HEADER_BYTES;
                            &source[from..out.body.end.min(from + IO_SLICE)]
                        };
                        match conn.write(chunk) {
                            Ok(0) => return Err((peer, CLOSED.into())),
                            Ok(k) => {
                                out.sent += k;
                                progressed = true;
                            }
                            Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                            Err(e) => return Err((peer, broken(&e))),
                        }
                    }
                    if out.sent == total {
                        outs[peer] = None;
                    } else {
                        pending = true;
                    }
                }
                if let Some(inp) = ins[peer].as_mut() {
                    while !inp.done {
                        let result = if inp.got < HEADER_BYTES {
                            conn.read(&mut inp.head[inp.got..])
                        } else if inp.keep {
                            conn.read(&mut inp.body[inp.body_got..])
                        } else {
                            let remaining =
                                inp.header.map_or(0, |h| h.payload as usize - inp.body_got);
                            let cap = remaining.min(DRAIN);
                            conn.read(&mut drain[..cap])
                        };
                        match result {
                            Ok(0) => return Err((peer, CLOSED.into())),
                            Ok(k) => {
                                progressed = true;
                                if inp.got < HEADER_BYTES {
                                    inp.got += k;
                                    if inp.got == HEADER_BYTES {
                                        let Some(h) = Header::decode(&inp.head) else {
                                            return Err((peer, "garbled header".into()));
                                        };
                                        inp.header = Some(h);
                                        if inp.keep {
                                            inp.body = vec![0; h.payload as usize];
                                        }
                                    }
                                } else {
                                    inp.body_got += k;
                                }
                            }
                            Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                            Err(e) => return Err((peer, broken(&e))),
                        }
                        if let Some(h) = inp.header
                            && inp.body_got as u64 == h.payload
                        {
                            inp.done = true;
                        }
                    }
                    if !inp.done {
                        pending = true;
                    }
                }
            }
            if !pending {
                break;
            }
            if !progressed {
                let mut fds = Vec::with_capacity(n);
                let mut who = Vec::with_capacity(n);
                for peer in 0..n {
                    let mut events = PollFlags::empty();
                    if outs[peer].is_some() {
                        events |= PollFlags::POLLOUT;
                    }
                    if ins[peer].as_ref().is_some_and(|i| !i.done) {
                        events |= PollFlags::POLLIN;
                    }
                    if !events.is_empty() {
                        fds.push(PollFd::new(self.conn(peer).fd(), events));
                        who.push(peer);
                    }
                }
                wait(&mut fds).map_err(|e| (who[0], e.to_string()))?;
            }
        }
        let mut headers = Vec::with_capacity(n);
        let mut payloads = Vec::with_capacity(n);
        for (peer, inp) in ins.into_iter().enumerate() {
            match inp {
                None => {
                    headers.push(header);
                    payloads.push(None);
                }
                Some(inp) => {
                    debug_assert!(peer != self.rank);
                    headers.push(inp.header.unwrap_or(header));
                    payloads.push(inp.keep.then_some(inp.body));
                }
            }
        }
        Ok((headers, payloads))
    }

    /// The ring and chain data phase: one stream out to `next` and one in from `prev`
    /// (either may be absent). Send segment k with `Some(j)` as its dependency is the range of
    /// receive segment j and may go out only as far as that segment has been received (and
    /// reduced); receive segments either land in `work` directly or are reduced into it.
    pub(super) fn stream(
        &mut self,
        header: &Header,
        work: &mut [u8],
        next: Option<(usize, Sends)>,
        prev: Option<(usize, Recvs)>,
        dtype: DType,
        op: ReduceOp,
    ) -> Result<(), Error> {
        let mut scratch = self.scratch();
        let result = self.stream_inner(
            work,
            next,
            prev,
            dtype,
            op,
            bytemuck::cast_slice_mut(&mut scratch),
        );
        self.scratch = scratch;
        result.map_err(|(peer, reason)| self.fail(header, peer, reason))
    }

    #[allow(clippy::type_complexity)]
    pub(super) fn stream_inner(
        &self,
        work: &mut [u8],
        next: Option<(usize, Sends)>,
        prev: Option<(usize, Recvs)>,
        dtype: DType,
        op: ReduceOp,
        scratch: &mut [u8],
    ) -> Result<(), (usize, String)> {
        let elem = dtype.size();
        let (out_peer, sends) = next.unwrap_or((usize::MAX, Vec::new()));
        let (in_peer, recvs) = prev.unwrap_or((usize::MAX, Vec::new()));
        let (mut s_seg, mut s_off) = (0usize, 0usize);
        let (mut r_seg, mut r_off) = (0usize, 0usize);
        // Bytes in scratch not yet reduced (less than one element after each reduction).
        let mut fill = 0usize;
        loop {
            // Skip empty segments.
            while s_seg < sends.len() && s_off == sends[s_seg].0.len() {
                s_seg += 1;
                s_off = 0;
            }
            while r_seg < recvs.len() && r_off == recvs[r_seg].0.len() {
                r_seg += 1;
                r_off = 0;
            }
            let send_done = s_seg == sends.len();
            let recv_done = r_seg == recvs.len();
            if send_done && recv_done {
                return Ok(());
            }
            let mut progressed = false;
            // How far the current send segment may go.
            let mut can_send = false;
            if !send_done {
                let (range, dep) = &sends[s_seg];
                let limit = match dep {
                    None => range.len(),
                    Some(j) if *j < r_seg => range.len(),
                    Some(j) if *j == r_seg => r_off,
                    Some(_) => 0,
                };
                if s_off < limit {
                    can_send = true;
                    let from = range.start + s_off;
                    let to = (range.start + limit).min(from + IO_SLICE);
                    match self.conn(out_peer).write(&work[from..to]) {
                        Ok(0) => return Err((out_peer, CLOSED.into())),
                        Ok(k) => {
                            s_off += k;
                            progressed = true;
                        }
                        Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
                        Err(e) if e.kind() == io::ErrorKind::Interrupted => progressed = true,
                        Err(e) => return Err((out_peer, broken(&e))),
                    }
                }
            }
            if !recv_done {
                let (range, reduce) = &recvs[r_seg];
                let result = if *reduce {
                    let want = (range.len() - r_off).min(scratch.len());
                    self.conn(in_peer).read(&mut scratch[fill..want])
                } else {
                    let from = range.start + r_off;
                    let to = range.end.min(from + IO_SLICE);
                    self.conn(in_peer).read(&mut work[from..to])
                };
                match result {
                    Ok(0) => return Err((in_peer, CLOSED.into())),
                    Ok(k) => {
                        progressed = true;
                        if *reduce {
                            fill += k;
                            let whole = fill / elem * elem;
                            let at = range.start + r_off;
                            reduce_into(&mut work[at..at + whole], &scratch[..whole], dtype, op);
                            scratch.copy_within(whole..fill, 0);
                            fill -= whole;
                            r_off += whole;
                        } else {
                            r_off += k;
                        }
                    }
                    Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
                    Err(e) if e.kind() == io::ErrorKind::Interrupted => progressed = true,
                    Err(e) => return Err((in_peer, broken(&e))),
                }
            }
            if !progressed {
                let mut fds = Vec::with_capacity(2);
                let mut who = Vec::with_capacity(2);
                let recv_events = if recv_done {
                    PollFlags::empty()
                } else {
                    PollFlags::POLLIN
                };
                let send_events = if can_send {
                    PollFlags::POLLOUT
                } else {
                    PollFlags::empty()
                };
                if out_peer == in_peer {
                    fds.push(PollFd::new(
                        self.conn(in_peer).fd(),
                        recv_events | send_events,
                    ));
                    who.push(in_peer);
                } else {
                    if !recv_events.is_empty() {
                        fds.push(PollFd::new(self.conn(in_peer).fd(), recv_events));
                        who.push(in_peer);
                    }
                    if !send_events.is_empty() {
                        fds.push(PollFd::new(self.conn(out_peer).fd(), send_events));
                        who.push(out_peer);
                    }
                }
                if fds.is_empty() {
                    // Cannot happen: a send waits only on a receive that is not done.
                    return Err((in_peer.min(out_peer), "stalled stream".into()));
                }
                wait(&mut fds).map_err(|e| (who[0], e.to_string()))?;
            }
        }
    }

    /// Element-aligned byte range of chunk `i` of `n` over `len` bytes of `elem`-byte elements.
    pub(super) fn chunk(len: usize, elem: usize, n: usize, i: usize) -> Range<usize> {
        let count = len / elem;
        (i * count / n * elem)..((i + 1) * count / n * elem)
    }

    pub(super) fn wrap(&self, i: isize) -> usize {
        i.rem_euclid(self.world as isize) as usize
    }
}

/// The small-message reduction: `buf` becomes the reduction of every rank's data in rank order
/// (the same order on every rank, so results are bit-identical), where `payloads[peer]` holds
/// each peer's data and `source` this rank's (`mine`).
pub(super) fn fold_in_rank_order(
    buf: &mut [u8],
    payloads: &[Option<Vec<u8>>],
    source: &[u8],
    mine: usize,
    dtype: DType,
    op: ReduceOp,
) {
    let data = |peer: usize| -> &[u8] {
        if peer == mine {
            source
        } else {
            payloads[peer].as_deref().unwrap_or(&[])
        }
    };
    buf.copy_from_slice(data(0));
    for peer in 1..payloads.len() {
        reduce_into(buf, data(peer), dtype, op);
    }
}

/// The coordinator's failure message without its leading "rank R (node N, host H) [of] ", which
/// [`Error::PeerLost`] already says (and which would otherwise hide the operation).
pub(super) fn without_rank_prefix(reason: &str, rank: u32) -> String {
    let Some(rest) = reason.strip_prefix(&format!("rank {rank} ")) else {
        return reason.to_owned();
    };
    let rest = match rest.strip_prefix('(').and_then(|r| r.split_once(") ")) {
        Some((_, after)) => after,
        None => rest,
    };
    rest.strip_prefix("of ").unwrap_or(rest).to_owned()
}
