//! The worker's side of the node relay: barriers sent to the local `muster-agent` over a Unix
//! socket (`MUSTER_AGENT_SOCKET`) instead of the coordinator session. The agent completes node
//! barriers itself and hands each global barrier to the coordinator once for the whole node,
//! which makes a barrier a few microseconds of local I/O plus one coordinator round trip per
//! node.
//!
//! The I/O is blocking std I/O on the caller's thread: one `write` of the entry, then
//! `poll(POLLIN)` and `read` until its result — no runtime, no thread hop. (Waiting in `poll`
//! rather than in `read` matters: when the agent reads this rank's entry, Linux signals write
//! space on this socket, which wakes a thread blocked in `read` for nothing; `poll` only wakes
//! for input.) Frames are a 4-byte little-endian length and a prost-encoded message (the
//! contract's framing, `muster_core::contract::frame`, which the agent's relay decodes with the
//! same functions): `WorkerMessage` towards the agent (`register`, then `barrier` entries and
//! finally `leave`), `CoordinatorMessage` back (`registered`, then one `barrier`
//! result per entry with the same scope and seq). A result with scope and seq 0 is a farewell:
//! the agent refuses or drops the connection, and its error message says why. See
//! `docs/contract.md` ("Node relay").
//!
//! A `barrier` entry's `trace_context` (field 5 of `BarrierEnter`, the same map as on the
//! session) carries the caller's W3C `traceparent` and `tracestate` when its `muster.barrier`
//! span is recorded by OpenTelemetry, so that the agent can pass it on to the coordinator with
//! the node's group entry. Untraced, the map is empty and, as proto3 omits empty maps, the
//! frame is byte for byte what it was before the field was used; agents that predate it
//! decode the field and ignore it. Both directions are therefore compatible.
//!
//! Several threads may use one connection: each scope has at most one barrier in flight (as on
//! the session), and whichever waiting thread is reading hands the other scope's result over.

use std::{
    error::Error as StdError,
    io::{self, Read, Write},
    os::{fd::AsFd, unix::net::UnixStream},
    path::Path,
    sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError},
    time::{Duration, Instant},
};

use muster_core::contract::frame::{self, Frame, FrameError, encode as encode_frame};
use muster_proto::v1::{
    self as pb, barrier_error::Kind as BarrierErrorKind, coordinator_message, worker_message,
};
use nix::poll::{PollFd, PollFlags, PollTimeout, poll};
use prost::Message;

use crate::{
    Error,
    client::{Scope, SessionConfig, barrier_error, consumes_seq, register_message},
    trace_context,
};

/// The largest frame body either side accepts; bigger ones end the connection.
pub use muster_core::contract::frame::MAX_FRAME;
/// How long [`RelayConn::connect`] waits for the agent's answer to `register`.
const REGISTER_TIMEOUT: Duration = Duration::from_secs(10);
/// The initial size of the read buffer (results are a few bytes; errors a few hundred).
const READ_BUFFER: usize = 4096;

/// Why the relay connection ended, as the source of an [`Error::Connection`].
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
struct Closed(String);

/// A connection to this node's agent relay, through which the [`crate::Accelerator`] sends its
/// barriers when `MUSTER_AGENT_SOCKET` is set. It must be opened after the rank's coordinator
/// session has registered (the coordinator only accepts relayed entries of live ranks).
pub struct RelayConn {
    /// The socket path, naming the agent in errors.
    path: String,
    rank: u32,
    stream: UnixStream,
    state: Mutex<State>,
    /// Signalled when the reading thread is done (a result for another thread, or its turn).
    turn: Condvar,
}

impl std::fmt::Debug for RelayConn {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RelayConn")
            .field("path", &self.path)
            .field("rank", &self.rank)
            .finish_non_exhaustive()
    }
}

struct State {
    /// The seq of the next barrier per scope (from 1).
    next_seq: [u64; 2],
    /// Whether a barrier call of the scope is in progress.
    busy: [bool; 2],
    /// Whether a thread is blocked reading the socket.
    reading: bool,
    /// Threads waiting on `turn`.
    sleepers: usize,
    /// Results read by one thread for another: (seq, error) per scope.
    results: [Option<(u64, Option<pb::BarrierError>)>; 2],
    /// Set once the connection is gone; every call fails with it.
    lost: Option<Arc<dyn StdError + Send + Sync>>,
    /// The entry being sent: its name's buffer is reused.
    entry: pb::WorkerMessage,
    /// The encoded frame being sent (reused).
    out: Vec<u8>,
    /// Received bytes; taken by the reading thread while it reads.
    input: FrameReader,
}

impl RelayConn {
    /// Connects to the agent at `path` and registers `config`'s rank. Fails with
    /// [`Error::Connection`] naming the socket when it cannot connect, when the agent does not
    /// answer within 10 s, or when it refuses the rank (the message says why: another job or
    /// generation, a rank of another node, a rank that already connected).
    pub fn connect(path: &Path, config: &SessionConfig) -> Result<Self, Error> {
        Self::connect_as(path, config, None, 0)
    }

    /// [`RelayConn::connect`] for a worker respawned in place (in membership `replacement`,
    /// its `MUSTER_EPOCH`) after its first quorum: it registers with `resume` and the released
    /// barrier seqs (global, node) the quorum gave it, so that it continues the node's
    /// sequence where its healthy source is, and its next barrier of each scope is the one
    /// after them.
    pub fn connect_replacement(
        path: &Path,
        config: &SessionConfig,
        released: (u64, u64),
        replacement: u64,
    ) -> Result<Self, Error> {
        Self::connect_as(path, config, Some(released), replacement)
    }

    fn connect_as(
        path: &Path,
        config: &SessionConfig,
        resume: Option<(u64, u64)>,
        replacement: u64,
    ) -> Result<Self, Error> {
        // Absolute, so that errors can tell a socket path from a coordinator address.
        let addr = std::path::absolute(path)
            .unwrap_or_else(|_| path.to_path_buf())
            .display()
            .to_string();
        let failed = |source: Arc<dyn StdError + Send + Sync>| Error::Connection {
            addr: addr.clone(),
            source,
        };
        let stream = UnixStream::connect(path).map_err(|e| failed(Arc::new(e)))?;
        let mut out = Vec::with_capacity(256);
        encode_frame(
            &pb::WorkerMessage {
                // The relay is local: a coordinator failover is the agent's to handle. A
                // replacement resumes its rank's place in the node's barrier sequence.
                kind: Some(worker_message::Kind::Register(register_message(
                    config,
                    resume,
                    replacement,
                ))),
            },
            &mut out,
        );
        (&stream).write_all(&out).map_err(|e| failed(Arc::new(e)))?;
        let mut input = FrameReader::default();
        let first: pb::CoordinatorMessage =
            input.read(&stream, Some(REGISTER_TIMEOUT)).map_err(|e| {
                failed(match e {
                    ReadError::Io(e) if e.kind() == io::ErrorKind::TimedOut => {
                        Arc::new(Closed(format!(
                            "the agent did not answer the registration of rank {} within {} s",
                            config.rank,
                            REGISTER_TIMEOUT.as_secs()
                        )))
                    }
                    e => e.into_source(),
                })
            })?;
        match first.kind {
            Some(coordinator_message::Kind::Registered(_)) => {}
            Some(coordinator_message::Kind::Barrier(pb::BarrierResult {
                error: Some(error),
                ..
            })) => {
                return Err(failed(Arc::new(Closed(format!(
                    "the agent refused rank {}: {}",
                    config.rank, error.message
                )))));
            }
            other => {
                return Err(Error::Protocol(format!(
                    "expected `registered` as the agent's first message, got {other:?}"
                )));
            }
        }
        Ok(Self {
            path: addr,
            rank: config.rank,
            stream,
            state: Mutex::new(State {
                next_seq: resume.map_or([1, 1], |(global, node)| {
                    [global.saturating_add(1), node.saturating_add(1)]
                }),
                busy: [false; 2],
                reading: false,
                sleepers: 0,
                results: [None, None],
                lost: None,
                entry: pb::WorkerMessage {
                    kind: Some(worker_message::Kind::Barrier(pb::BarrierEnter::default())),
                },
                out,
                input,
            }),
            turn: Condvar::new(),
        })
    }

    /// Waits until every rank of `scope` has entered this barrier (this rank's n-th of the
    /// scope, under the same `name`), or until `timeout` passes (`None`: as long as every rank
    /// is alive). Errors are those of [`crate::client::Session::barrier`]; a lost connection to
    /// the agent is [`Error::Connection`] naming the socket.
    ///
    /// A timeout error leaves the sequence number as it is, so calling again retries the same
    /// barrier. A timeout of *another* rank of this node can also end this rank's wait at the
    /// coordinator (the node's entry is withdrawn as a whole); while this call's own time is
    /// not up, it then enters again at once instead of returning.
    ///
    /// With an interrupt check on this thread ([`crate::interrupt::with_check`]), the wait
    /// asks it every [`INTERRUPT_CHECK`], between reads; when it says true the wait ends with
    /// [`Error::Interrupted`] and the connection is given up (the interrupted barrier cannot be
    /// resumed). The Python SDK checks for Ctrl-C this way.
    pub fn barrier(
        &self,
        scope: Scope,
        name: &str,
        timeout: Option<Duration>,
    ) -> Result<(), Error> {
        let deadline = timeout.map(|t| Instant::now() + t);
        let idx = scope.index();
        let mut st = self.lock();
        if let Some(reason) = &st.lost {
            return Err(self.lost_error(reason.clone()));
        }
        if st.busy[idx] {
            return Err(Error::BarrierBusy {
                scope,
                rank: self.rank,
            });
        }
        st.busy[idx] = true;
        let (mut st, outcome) = self.enter_and_wait(st, scope, name, deadline);
        st.busy[idx] = false;
        outcome
    }

    /// Ends this rank's part cleanly: tells the agent it leaves, so that local ranks waiting for
    /// it get RANK_LEFT instead of waiting. The connection closes when this is dropped.
    pub fn leave(&self) -> Result<(), Error> {
        let mut st = self.lock();
        if let Some(reason) = &st.lost {
            return Err(self.lost_error(reason.clone()));
        }
        let st = &mut *st;
        encode_frame(
            &pb::WorkerMessage {
                kind: Some(worker_message::Kind::Leave(pb::Leave {})),
            },
            &mut st.out,
        );
        (&self.stream).write_all(&st.out).map_err(|e| {
            let reason: Arc<dyn StdError + Send + Sync> = Arc::new(e);
            st.lost = Some(reason.clone());
            self.lost_error(reason)
        })
    }

    /// Whether the connection to the agent is gone (the agent closed it, exited or was
    /// killed).
    pub fn is_lost(&self) -> bool {
        self.lock().lost.is_some()
    }

    /// The socket path of the agent.
    pub fn path(&self) -> &str {
        &self.path
    }

    /// The sequence number the next barrier of `scope` will use (for diagnostics and tests).
    pub fn next_seq(&self, scope: Scope) -> u64 {
        self.lock().next_seq[scope.index()]
    }

    /// The last barrier seq of each scope (global, node) this rank was released from.
    pub fn released(&self) -> (u64, u64) {
        let next = self.lock().next_seq;
        (next[0] - 1, next[1] - 1)
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        // Every update under this lock is complete before anything that could panic.
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn lost_error(&self, reason: Arc<dyn StdError + Send + Sync>) -> Error {
        Error::Connection {
            addr: self.path.clone(),
            source: reason,
        }
    }

    /// Sends the entry for the scope's next seq and waits for its result; enters again after a
    /// timeout that is not this call's own.
    fn enter_and_wait<'a>(
        &'a self,
        mut st: MutexGuard<'a, State>,
        scope: Scope,
        name: &str,
        deadline: Option<Instant>,
    ) -> (MutexGuard<'a, State>, Result<(), Error>) {
        let idx = scope.index();
        loop {
            let seq = st.next_seq[idx];
            let timeout_ms = deadline.map_or(0, |d| {
                let left = d.saturating_duration_since(Instant::now());
                u64::try_from(left.as_nanos().div_ceil(1_000_000))
                    .unwrap_or(u64::MAX)
                    .max(1)
            });
            let s = &mut *st;
            if let Some(worker_message::Kind::Barrier(entry)) = &mut s.entry.kind {
                entry.scope = scope.to_wire();
                entry.seq = seq;
                entry.name.clear();
                entry.name.push_str(name);
                entry.timeout_ms = timeout_ms;
                // Empty (nothing sent, nothing allocated) unless the caller is traced.
                trace_context::fill(&mut entry.trace_context);
            }
            encode_frame(&s.entry, &mut s.out);
            if let Err(e) = (&self.stream).write_all(&s.out) {
                let reason: Arc<dyn StdError + Send + Sync> = Arc::new(e);
                s.lost = Some(reason.clone());
                return (st, Err(self.lost_error(reason)));
            }
            let (next, waited) = self.wait(st, scope, seq, name);
            st = next;
            let error = match waited {
                Ok(error) => error,
                Err(e) => return (st, Err(e)),
            };
            if consumes_seq(error.as_ref()) {
                st.next_seq[idx] = seq + 1;
            }
            match error {
                None => return (st, Ok(())),
                Some(e)
                    if e.kind == BarrierErrorKind::Timeout as i32
                        && deadline.is_none_or(|d| Instant::now() < d) => {}
                Some(e) => return (st, Err(barrier_error(e, scope, name, seq))),
            }
        }
    }

    /// Waits for the result of (scope, seq): takes it if another thread read it, else reads
    /// frames itself (one thread at a time), handing over results for the other scope. With an
    /// interrupt check on this thread, reads in slices of [`INTERRUPT_CHECK`] and asks it
    /// between them.
    fn wait<'a>(
        &'a self,
        mut st: MutexGuard<'a, State>,
        scope: Scope,
        seq: u64,
        name: &str,
    ) -> (
        MutexGuard<'a, State>,
        Result<Option<pb::BarrierError>, Error>,
    ) {
        let idx = scope.index();
        let slice = crate::interrupt::installed().then_some(INTERRUPT_CHECK);
        loop {
            if let Some((got, error)) = st.results[idx].take()
                && got == seq
            {
                return (st, Ok(error));
            }
            if let Some(reason) = &st.lost {
                let reason = reason.clone();
                return (st, Err(self.lost_error(reason)));
            }
            if st.reading {
                st.sleepers += 1;
                st = self.turn.wait(st).unwrap_or_else(PoisonError::into_inner);
                st.sleepers -= 1;
                continue;
            }
            st.reading = true;
            let mut input = std::mem::take(&mut st.input);
            drop(st);
            let read = input.read(&self.stream, slice);
            st = self.lock();
            st.input = input;
            st.reading = false;
            match read {
                Ok(msg) => route(&mut st, msg),
                // A slice of an interruptible wait ran out with no frame (a partial one stays
                // in the reader): ask the caller.
                Err(ReadError::Io(e)) if slice.is_some() && e.kind() == io::ErrorKind::TimedOut => {
                    if st.sleepers > 0 {
                        self.turn.notify_all();
                    }
                    drop(st);
                    let stop = crate::interrupt::interrupted();
                    st = self.lock();
                    if stop {
                        st.lost = Some(Arc::new(Closed(format!(
                            "a wait for barrier '{name}' was interrupted, and an interrupted \
                             barrier cannot be resumed"
                        ))));
                        if st.sleepers > 0 {
                            self.turn.notify_all();
                        }
                        return (
                            st,
                            Err(Error::Interrupted {
                                what: format!("barrier '{name}'"),
                            }),
                        );
                    }
                    continue;
                }
                Err(e) => st.lost = Some(e.into_source()),
            }
            if st.sleepers > 0 {
                self.turn.notify_all();
            }
        }
    }
}

/// How often an interruptible barrier wait asks whether to stop: the same as every
/// interruptible call's.
pub use crate::interrupt::INTERRUPT_CHECK;

/// Files one message from the agent: a result for its scope, or a farewell.
fn route(st: &mut State, msg: pb::CoordinatorMessage) {
    let Some(coordinator_message::Kind::Barrier(result)) = msg.kind else {
        return;
    };
    if result.seq == 0 {
        let why = result
            .error
            .map_or_else(|| "no reason given".to_owned(), |e| e.message);
        st.lost = Some(Arc::new(Closed(format!(
            "the agent closed the relay connection: {why}"
        ))));
        return;
    }
    match Scope::from_wire(result.scope).ok() {
        Some(scope) => st.results[scope.index()] = Some((result.seq, result.error)),
        None => {
            st.lost = Some(Arc::new(Closed(format!(
                "the agent sent a result with the unknown scope {}",
                result.scope
            ))));
        }
    }
}

/// Why reading a frame failed.
#[derive(Debug)]
enum ReadError {
    Io(io::Error),
    Eof,
    TooLarge(usize),
    Decode(prost::DecodeError),
}

impl ReadError {
    fn into_source(self) -> Arc<dyn StdError + Send + Sync> {
        match self {
            ReadError::Io(e) => Arc::new(e),
            ReadError::Eof => Arc::new(Closed(
                "the agent closed the relay connection (muster-agent exited or was killed)"
                    .to_owned(),
            )),
            ReadError::TooLarge(len) => Arc::new(Closed(format!(
                "the agent sent a frame of {len} bytes (the limit is {MAX_FRAME})"
            ))),
            ReadError::Decode(e) => {
                Arc::new(Closed(format!("the agent sent a malformed frame: {e}")))
            }
        }
    }
}

/// Waits until `stream` has input (or is closed), up to `timeout`.
fn wait_readable(stream: &UnixStream, timeout: Option<Duration>) -> Result<(), ReadError> {
    let timeout = match timeout {
        None => PollTimeout::NONE,
        Some(t) => PollTimeout::try_from(t).unwrap_or(PollTimeout::MAX),
    };
    let mut fds = [PollFd::new(stream.as_fd(), PollFlags::POLLIN)];
    loop {
        match poll(&mut fds, timeout) {
            Ok(0) => return Err(ReadError::Io(io::ErrorKind::TimedOut.into())),
            Ok(_) => return Ok(()),
            Err(nix::errno::Errno::EINTR) => {}
            Err(e) => return Err(ReadError::Io(e.into())),
        }
    }
}

/// Received bytes not yet decoded: `buf[start..end]`.
#[derive(Default)]
struct FrameReader {
    buf: Vec<u8>,
    start: usize,
    end: usize,
}

impl FrameReader {
    /// The next message: from bytes already read, or read from `stream`, waiting up to
    /// `timeout` (`None`: for ever) for each read.
    fn read<M: Message + Default>(
        &mut self,
        mut stream: &UnixStream,
        timeout: Option<Duration>,
    ) -> Result<M, ReadError> {
        if self.buf.is_empty() {
            self.buf = vec![0; READ_BUFFER];
        }
        loop {
            let need = match frame::decode::<M>(&self.buf[self.start..self.end]) {
                Ok(Frame::Complete { message, len }) => {
                    self.start += len;
                    if self.start == self.end {
                        self.start = 0;
                        self.end = 0;
                    }
                    return Ok(message);
                }
                Ok(Frame::Partial { needed }) => needed,
                Err(FrameError::TooLarge(len)) => return Err(ReadError::TooLarge(len)),
                Err(FrameError::Malformed(e)) => return Err(ReadError::Decode(e)),
            };
            if self.start + need > self.buf.len() {
                self.buf.copy_within(self.start..self.end, 0);
                self.end -= self.start;
                self.start = 0;
                if need > self.buf.len() {
                    self.buf.resize(need, 0);
                }
            }
            wait_readable(stream, timeout)?;
            let n = loop {
                match stream.read(&mut self.buf[self.end..]) {
                    Ok(n) => break n,
                    Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                    Err(e) => return Err(ReadError::Io(e)),
                }
            };
            if n == 0 {
                return Err(ReadError::Eof);
            }
            self.end += n;
        }
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    /// Frames split at every byte boundary and run together decode the same.
    #[test]
    fn frames_survive_any_split() {
        let messages: Vec<pb::CoordinatorMessage> = (1..=3u64)
            .map(|seq| pb::CoordinatorMessage {
                kind: Some(coordinator_message::Kind::Barrier(pb::BarrierResult {
                    scope: Scope::Global.to_wire(),
                    seq,
                    error: (seq == 2).then(|| pb::BarrierError {
                        message: "x".repeat(5000),
                        ..Default::default()
                    }),
                })),
            })
            .collect();
        let mut wire = Vec::new();
        let mut frame = Vec::new();
        for m in &messages {
            encode_frame(m, &mut frame);
            wire.extend_from_slice(&frame);
        }
        for split in [1, 3, 4, 5, 100, 4096, wire.len()] {
            let (mut a, b) = UnixStream::pair().unwrap();
            let writer = {
                let wire = wire.clone();
                std::thread::spawn(move || {
                    for chunk in wire.chunks(split) {
                        a.write_all(chunk).unwrap();
                    }
                })
            };
            let mut reader = FrameReader::default();
            for m in &messages {
                let got: pb::CoordinatorMessage = reader.read(&b, None).unwrap();
                assert_eq!(&got, m, "split {split}");
            }
            writer.join().unwrap();
            assert!(matches!(
                reader.read::<pb::CoordinatorMessage>(&b, None),
                Err(ReadError::Eof)
            ));
        }
    }

    /// An interruptible barrier that nobody answers ends when the check says so, and gives
    /// the connection up: a later barrier says that one was interrupted.
    #[test]
    fn an_interrupted_barrier_ends_and_gives_the_connection_up() {
        let dir = std::env::temp_dir().join(format!("muster-relay-int-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("agent.sock");
        let _ = std::fs::remove_file(&path);
        let listener = std::os::unix::net::UnixListener::bind(&path).unwrap();
        // A silent agent: it registers the rank, then reads and never answers.
        let agent = std::thread::spawn(move || {
            let (stream, _) = listener.accept().unwrap();
            let mut input = FrameReader::default();
            let _: pb::WorkerMessage = input.read(&stream, None).unwrap();
            let mut out = Vec::new();
            encode_frame(
                &pb::CoordinatorMessage {
                    kind: Some(coordinator_message::Kind::Registered(
                        pb::Registered::default(),
                    )),
                },
                &mut out,
            );
            (&stream).write_all(&out).unwrap();
            while input.read::<pb::WorkerMessage>(&stream, None).is_ok() {}
        });
        let config = SessionConfig {
            job_id: "j".into(),
            generation: 1,
            rank: 0,
            pid: 1,
            host: "h".into(),
        };
        let relay = RelayConn::connect(&path, &config).unwrap();
        let checks = std::rc::Rc::new(std::cell::Cell::new(0));
        let start = Instant::now();
        let counted = std::rc::Rc::clone(&checks);
        let got = crate::interrupt::with_check(
            Box::new(move || {
                counted.set(counted.get() + 1);
                counted.get() == 3
            }),
            || relay.barrier(Scope::Global, "b", None),
        );
        assert!(matches!(got, Err(Error::Interrupted { .. })), "{got:?}");
        assert_eq!(checks.get(), 3);
        assert!(
            start.elapsed() >= INTERRUPT_CHECK * 3,
            "{:?}",
            start.elapsed()
        );
        let again = relay.barrier(Scope::Global, "b2", None);
        assert!(
            matches!(&again, Err(e @ Error::Connection { .. }) if e.to_string().contains("interrupted")),
            "{again:?}"
        );
        drop(relay);
        agent.join().unwrap();
        let _ = std::fs::remove_dir_all(&dir);
    }

    /// A replacement registers with `resume`, the quorum's released seqs and its epoch, and
    /// its next barrier of each scope is the one after them.
    #[test]
    fn a_replacement_resumes_the_node_sequence() {
        let dir = std::env::temp_dir().join(format!("muster-relay-repl-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("agent.sock");
        let _ = std::fs::remove_file(&path);
        let listener = std::os::unix::net::UnixListener::bind(&path).unwrap();
        let agent = std::thread::spawn(move || {
            let (stream, _) = listener.accept().unwrap();
            let mut input = FrameReader::default();
            let register: pb::WorkerMessage = input.read(&stream, None).unwrap();
            let mut out = Vec::new();
            let reply = |out: &mut Vec<u8>, kind| {
                encode_frame(&pb::CoordinatorMessage { kind: Some(kind) }, out);
                (&stream).write_all(out).unwrap();
            };
            reply(
                &mut out,
                coordinator_message::Kind::Registered(pb::Registered::default()),
            );
            let entry: pb::WorkerMessage = input.read(&stream, None).unwrap();
            let Some(worker_message::Kind::Barrier(entry)) = entry.kind else {
                panic!("expected a barrier entry, got {entry:?}");
            };
            reply(
                &mut out,
                coordinator_message::Kind::Barrier(pb::BarrierResult {
                    scope: entry.scope,
                    seq: entry.seq,
                    error: None,
                }),
            );
            (register, entry)
        });
        let config = SessionConfig {
            job_id: "j".into(),
            generation: 1,
            rank: 3,
            pid: 1,
            host: "h".into(),
        };
        let relay = RelayConn::connect_replacement(&path, &config, (4, 2), 7).unwrap();
        assert_eq!(relay.released(), (4, 2));
        relay.barrier(Scope::Global, "after-heal", None).unwrap();
        assert_eq!(relay.released(), (5, 2));
        let (register, entry) = agent.join().unwrap();
        let Some(worker_message::Kind::Register(register)) = register.kind else {
            panic!("expected register first");
        };
        assert!(register.resume && register.replacement);
        assert_eq!(
            (
                register.released_global,
                register.released_node,
                register.epoch,
                register.rank
            ),
            (4, 2, 7, 3)
        );
        assert_eq!(entry.seq, 5);
        drop(relay);
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn oversized_frames_are_refused() {
        let (mut a, b) = UnixStream::pair().unwrap();
        a.write_all(&((MAX_FRAME as u32) + 1).to_le_bytes())
            .unwrap();
        let got = FrameReader::default().read::<pb::CoordinatorMessage>(&b, None);
        assert!(matches!(got, Err(ReadError::TooLarge(n)) if n == MAX_FRAME + 1));
        // A silent peer is a timeout when one is given.
        let (_a, b) = UnixStream::pair().unwrap();
        let got = FrameReader::default()
            .read::<pb::CoordinatorMessage>(&b, Some(Duration::from_millis(10)));
        assert!(
            matches!(&got, Err(ReadError::Io(e)) if e.kind() == io::ErrorKind::TimedOut),
            "{got:?}"
        );
    }
}
