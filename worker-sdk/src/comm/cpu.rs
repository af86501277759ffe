//! The CPU backend: collectives over sockets between the ranks' processes, for machines without
//! GPUs and for CPU tensors.
//!
//! # Connections
//! Every rank listens on an ephemeral TCP port (on its advertised host, `MUSTER_HOST`, when that
//! is an IP address, else on every interface) and on an abstract Unix socket, and publishes
//! both in the job's key-value store under `muster/comm/<generation>/<communicator>/<rank>`
//! (generation-fenced, so a restarted job never reaches a stale rank). Each rank connects to
//! every lower rank and accepts every higher one: a full mesh, made once when the communicator
//! is created. Ranks on the same node (same node rank and host) use the Unix socket, others TCP
//! with `TCP_NODELAY`. The Unix socket skips the TCP/IP stack: on a 2-core test machine, 2 ranks,
//! f32 all_reduce, it gave 1.8 GB/s bus bandwidth at 64 MiB against 1.0 GB/s over loopback TCP,
//! and 3.0-3.6 against 2.0 GB/s at 1 MiB, with the same 4-byte latency (`MUSTER_COMM_TRANSPORT=tcp`
//! forces TCP, to compare). The first bytes on a connection are a handshake (magic, generation,
//! communicator, job hash, both ranks) and a wrong one is refused, so a stray or stale
//! connection can never be mistaken for a peer. The record also gives the rank's process id and
//! the address of 16 probe bytes, for cross-memory attach (below). `MUSTER_COMM_TRANSPORT`
//! picks the same-node transport: `auto` (the default: shared memory for large all_reduce and
//! all_gather, cross-memory attach for the other large collectives, each where it can be set
//! up, else the sockets), `shm` (the same, but creating the communicator fails when shared
//! memory cannot be set up), `cma` (cross-memory attach or fail; no shared memory), `unix` or
//! `tcp` (sockets only).
//!
//! # Shared memory
//! When every rank of the communicator is on one node, large all_reduce and all_gather (above
//! [`SMALL_BYTES`] per rank) run through a shared-memory arena (`comm/shm.rs`: each rank maps
//! one 2 MiB segment of its own in `/dev/shm` and every peer's; the data moves with memcpy and
//! the reduction kernels, no system call per byte). The header exchange still comes first (the
//! arena needs the same lengths on every rank), then the arena runs with a one-byte barrier
//! over the sockets as its sync, which is also how a dead peer shows (`cpu/arena.rs`). Setup
//! creates, maps and unlinks the segments with an agreement (one-byte all_reduce) between the
//! steps, so that a failure on any rank (no tmpfs space, a stale file) leaves every rank on
//! cross-memory attach or the sockets. It is the only `unsafe` of the backend, kept inside
//! `comm/shm.rs`.
//!
//! # Cross-memory attach
//! When every rank of the communicator is on one node, large collectives (all_reduce, reduce,
//! all_gather, reduce_scatter, broadcast) move their data with `process_vm_readv(2)`: a rank
//! reads its peers' buffers directly, one copy instead of a socket's two, and the sockets only
//! carry the headers and two one-byte notifications per operation (`cpu/cma.rs` has the
//! protocol and why it is sound). It needs no `unsafe`. Where shared memory is set up, only
//! reduce, reduce_scatter and broadcast use it (the arena has no path for them yet). At setup
//! every rank reads every peer's probe bytes and the ranks agree (one small all_reduce) to use
//! it only if all succeeded: under Yama `ptrace_scope` >= 1 or a seccomp filter the kernel
//! refuses (EPERM), and every rank keeps the sockets (said at debug level). Jobs on several nodes keep the sockets between all their ranks for now (a
//! hierarchical scheme would use cross-memory attach inside each node).
//!
//! Measured on the 2-core test VM (f32 all_reduce, `allreduce_bench`, bus bandwidth, a busy
//! machine, so ranges): 2 ranks, 1 MiB 4.0-4.4 GB/s against 2.4-3.0 over the Unix-socket rings;
//! 64 MiB 3.2-3.8 against 2.6-3.2 when the machine was quiet, on a par when it was loaded; 4
//! ranks, 1 MiB 1.7-1.9 against 1.0-1.3. The 4-byte latency is unchanged (the small path does
//! not use it). The kernel's copy is the bound: `process_vm_readv` pins the peer's pages on
//! every call and copies at 4-5 GB/s there where memcpy does 10-11, so one such copy costs
//! about as much CPU as the socket's two; memcpy-class bandwidth needs mapped shared memory,
//! hence the shared-memory path above.
//!
//! # Every operation
//! Starts with a header from every rank to every other (op sequence number, kind, reduce op,
//! root, dtype, element count, and the length of any payload that follows). Every rank
//! therefore sees every rank's shape: when they differ, each rank drains what was sent to it
//! (the header says how much), so the connections stay in step, and every rank returns the
//! same [`Error::ShapeMismatch`] listing every rank's shape; nobody hangs, and the
//! communicator stays usable. Large payloads are only sent once all headers agree.
//!
//! # Algorithms
//! - **Small messages** (at most [`SMALL_BYTES`] per rank): one round of direct exchange, the
//!   payload travelling with the header: all_reduce and all_gather send the buffer to every
//!   peer, reduce_scatter sends block j to rank j, broadcast sends from the root, reduce to the
//!   root. Latency is one message delay, the minimum; reductions run in rank order on every
//!   rank, so every rank gets bit-identical results.
//! - **Large all_reduce and all_gather, every rank on one node**: the shared-memory arena
//!   (`comm/shm.rs` has the algorithms), when it was set up.
//! - **Other large messages, every rank on one node**: cross-memory attach, a direct reduce-scatter
//!   (rank r reads chunk r of every peer and reduces it, in rank order) then a direct
//!   all-gather (each rank reads every finished chunk from its owner).
//! - **Large messages otherwise**: bandwidth-optimal rings. all_reduce is a ring reduce-scatter
//!   followed by a ring all-gather (each rank sends and receives 2(n-1)/n of the buffer, the lower
//!   bound); all_gather and reduce_scatter are the respective halves. broadcast is a pipelined
//!   chain from the root and reduce a pipelined chain towards it (each link carries the buffer
//!   once). The ring runs as one stream per neighbour: what a rank sends at step k+1 is the chunk
//!   it received (and reduced) at step k, and it sends each byte of it as soon as that byte is in,
//!   so steps overlap (pipelining without slicing). All I/O is non-blocking on the caller's thread,
//!   multiplexed with `poll`: received data for all-gather steps goes straight into the user's
//!   buffer, and data to reduce goes through one small scratch buffer, so there is no copy besides
//!   that (reduce_scatter's large path works on a copy of its input, which it may not modify).
//! - Why one thread and `poll` rather than a sender thread per connection: on loopback the
//!   kernel copies the data inside the `send` call itself, so a sender thread would only buy
//!   parallelism, and with one rank per core (the usual layout) there is no idle core to run
//!   it; a single thread also keeps the buffer borrows plain safe Rust.
//! - Scale: the mesh and the per-operation header round are O(n^2) messages in all, fine for
//!   the tens of ranks a CPU job has; a `send` larger than the socket buffers returns once the
//!   peer has received most of it (as gloo's does), so two ranks must not both send first.
//!
//! # Failures
//! A connection that ends or breaks during an operation (the syncs of the shared-memory path
//! included), or a peer whose memory cannot be read any more (its process is gone: ESRCH), gives [`Error::PeerLost`] naming the peer; the rank that sees
//! it first records it in the key-value store and shuts all its connections down, so that every
//! other rank's operation ends too (naming the rank that was really lost, read from the store). A
//! watcher thread follows the coordinator's failure reports ([`crate::client::FailureWatch`]): when
//! a rank is reported failed (a crash, or a stopped process that missed its heartbeats) it shuts
//! the connections down, so blocked operations return at once with that rank's name. After such an
//! error the communicator is unusable: every later call fails at once, repeating it.

use std::{
    collections::HashMap,
    io::{self, Read, Write},
    net::{IpAddr, Ipv4Addr, Shutdown, SocketAddr, TcpListener, TcpStream, ToSocketAddrs},
    ops::Range,
    os::{
        fd::{AsFd, BorrowedFd},
        linux::net::SocketAddrExt,
        unix::net::{self as unix, UnixListener, UnixStream},
    },
    sync::{
        Arc, Mutex, PoisonError,
        atomic::{AtomicBool, Ordering},
    },
    time::{Duration, Instant},
};

use nix::poll::{PollFd, PollFlags, PollTimeout, poll};

use super::{
    Backend, BackendKind, DType, ReduceOp,
    reduce::{finish_avg, reduce_into},
    shm::ShmArena,
};
use crate::{Accelerator, Error, client::FailureWatch};

mod arena;
mod cma;

/// Per-rank payloads up to this size use the one-round direct exchange; larger ones the rings.
pub(crate) const SMALL_BYTES: usize = 64 * 1024;
/// How long creating a communicator waits for its peers to appear and connect.
const SETUP_TIMEOUT: Duration = Duration::from_secs(600);
/// How long a handshake may take once connected.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(30);
/// Most bytes moved by one read or write call, so that sending and receiving interleave finely.
const IO_SLICE: usize = 1 << 20;
/// Scratch for data to reduce, in `u64`s (so it is aligned for every element type).
const SCRATCH_WORDS: usize = (256 << 10) / 8;
/// Largest payload a header may announce (a sanity bound against garbage).
const MAX_PAYLOAD: u64 = 1 << 40;
/// What a connection that ended says, for messages.
const CLOSED: &str = "it closed its connection";

/// How long the lost-peer notice may take in the key-value store (it only improves the name
/// in other ranks' errors, so it must not delay this rank's error much).
const NOTICE_TIMEOUT: Duration = Duration::from_millis(500);

const HANDSHAKE_MAGIC: &[u8; 8] = b"MSTRCOM1";
const HEADER_MAGIC: u32 = 0x4d53_4331;
const HEADER_BYTES: usize = 36;
/// Buffer for payloads that are read only to be dropped (after a shape mismatch).
const DRAIN: usize = 64 << 10;

/// How ranks of one node exchange data: unset (or `auto`): when every rank is on this node,
/// shared memory for large all_reduce and all_gather and cross-memory attach for the others,
/// each if it can be set up, else Unix sockets; `shm`: the same, but creating the communicator
/// fails when shared memory cannot be set up; `cma`: cross-memory attach (no shared memory), and
/// creating the communicator fails when it cannot be used (for tests and benchmarks); `unix`:
/// Unix sockets only; `tcp`: TCP only (to compare).
const TRANSPORT_ENV: &str = muster_core::contract::env::MUSTER_COMM_TRANSPORT;
/// What the probe of cross-memory attach reads in every peer at setup (then the job hash).
const PROBE_MAGIC: &[u8; 8] = b"MSTRCMA1";

/// [`TRANSPORT_ENV`], parsed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Transport {
    Auto,
    Shm,
    Cma,
    Unix,
    Tcp,
}

impl Transport {
    fn from_env() -> Result<Self, Error> {
        match std::env::var(TRANSPORT_ENV) {
            Err(_) => Ok(Transport::Auto),
            Ok(v) => match v.as_str() {
                "" | "auto" => Ok(Transport::Auto),
                "shm" => Ok(Transport::Shm),
                "cma" => Ok(Transport::Cma),
                "unix" => Ok(Transport::Unix),
                "tcp" => Ok(Transport::Tcp),
                _ => Err(Error::Config(format!(
                    "{TRANSPORT_ENV}='{v}' is not a transport (use auto, shm, cma, unix or tcp)"
                ))),
            },
        }
    }
}

/// The operations, as headers carry them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
enum Kind {
    AllReduce = 1,
    Broadcast = 2,
    Reduce = 3,
    AllGather = 4,
    ReduceScatter = 5,
    Send = 6,
    Barrier = 7,
}

impl Kind {
    fn from_u8(v: u8) -> Option<Self> {
        Some(match v {
            1 => Kind::AllReduce,
            2 => Kind::Broadcast,
            3 => Kind::Reduce,
            4 => Kind::AllGather,
            5 => Kind::ReduceScatter,
            6 => Kind::Send,
            7 => Kind::Barrier,
            _ => return None,
        })
    }

    fn name(self) -> &'static str {
        match self {
            Kind::AllReduce => "all_reduce",
            Kind::Broadcast => "broadcast",
            Kind::Reduce => "reduce",
            Kind::AllGather => "all_gather",
            Kind::ReduceScatter => "reduce_scatter",
            Kind::Send => "send",
            Kind::Barrier => "barrier",
        }
    }
}

fn op_code(op: ReduceOp) -> u8 {
    match op {
        ReduceOp::Sum => 1,
        ReduceOp::Avg => 2,
        ReduceOp::Min => 3,
        ReduceOp::Max => 4,
        ReduceOp::Product => 5,
    }
}

fn dtype_code(dtype: DType) -> u8 {
    match dtype {
        DType::F32 => 1,
        DType::F64 => 2,
        DType::F16 => 3,
        DType::BF16 => 4,
        DType::I32 => 5,
        DType::I64 => 6,
        DType::U8 => 7,
    }
}

fn dtype_from(code: u8) -> Option<DType> {
    Some(match code {
        1 => DType::F32,
        2 => DType::F64,
        3 => DType::F16,
        4 => DType::BF16,
        5 => DType::I32,
        6 => DType::I64,
        7 => DType::U8,
        _ => return None,
    })
}

/// What every rank says about an operation before any data moves.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Header {
    kind: Kind,
    /// Reduce op code, 0 when none.
    op: u8,
    dtype: DType,
    root: u32,
    seq: u64,
    count: u64,
    /// Bytes that follow this header on this connection.
    payload: u64,
}

impl Header {
    fn encode(&self) -> [u8; HEADER_BYTES] {
        let mut b = [0u8; HEADER_BYTES];
        b[0..4].copy_from_slice(&HEADER_MAGIC.to_le_bytes());
        b[4] = self.kind as u8;
        b[5] = self.op;
        b[6] = dtype_code(self.dtype);
        b[8..12].copy_from_slice(&self.root.to_le_bytes());
        b[12..20].copy_from_slice(&self.seq.to_le_bytes());
        b[20..28].copy_from_slice(&self.count.to_le_bytes());
        b[28..36].copy_from_slice(&self.payload.to_le_bytes());
        b
    }

    fn decode(b: &[u8; HEADER_BYTES]) -> Option<Self> {
        let u32_at = |i: usize| u32::from_le_bytes([b[i], b[i + 1], b[i + 2], b[i + 3]]);
        let u64_at = |i: usize| {
            let mut x = [0u8; 8];
            x.copy_from_slice(&b[i..i + 8]);
            u64::from_le_bytes(x)
        };
        if u32_at(0) != HEADER_MAGIC {
            return None;
        }
        let header = Header {
            kind: Kind::from_u8(b[4])?,
            op: b[5],
            dtype: dtype_from(b[6])?,
            root: u32_at(8),
            seq: u64_at(12),
            count: u64_at(20),
            payload: u64_at(28),
        };
        (header.payload <= MAX_PAYLOAD).then_some(header)
    }

    /// Whether two ranks' headers describe the same operation (payload lengths may differ).
    fn agrees(&self, other: &Header) -> bool {
        (
            self.kind, self.op, self.dtype, self.root, self.seq, self.count,
        ) == (
            other.kind,
            other.op,
            other.dtype,
            other.root,
            other.seq,
            other.count,
        )
    }

    fn describe(&self) -> String {
        format!("{} of {} {}", self.kind.name(), self.count, self.dtype)
    }
}

/// "N dtype" for each rank, with whatever else differs (operation, root, reduce op, sequence).
fn shapes(headers: &[Header]) -> Vec<(u32, String)> {
    let first = headers[0];
    let differs = |f: &dyn Fn(&Header) -> u64| headers.iter().any(|h| f(h) != f(&first));
    let kind = differs(&|h| h.kind as u64);
    let root = differs(&|h| u64::from(h.root));
    let op = differs(&|h| u64::from(h.op));
    let seq = differs(&|h| h.seq);
    headers
        .iter()
        .enumerate()
        .map(|(rank, h)| {
            let mut s = if kind {
                format!("{} of {} {}", h.kind.name(), h.count, h.dtype)
            } else {
                format!("{} {}", h.count, h.dtype)
            };
            if root {
                s.push_str(&format!(" root {}", h.root));
            }
            if op {
                s.push_str(&format!(" op {}", op_name(h.op)));
            }
            if seq {
                s.push_str(&format!(" (collective #{})", h.seq));
            }
            (rank as u32, s)
        })
        .collect()
}

fn op_name(code: u8) -> &'static str {
    match code {
        1 => "sum",
        2 => "avg",
        3 => "min",
        4 => "max",
        5 => "product",
        _ => "none",
    }
}

/// One connection to a peer.
enum Conn {
    Tcp(TcpStream),
    Unix(UnixStream),
}

impl Conn {
    fn read(&self, buf: &mut [u8]) -> io::Result<usize> {
        match self {
            Conn::Tcp(s) => (&*s).read(buf),
            Conn::Unix(s) => (&*s).read(buf),
        }
    }

    fn write(&self, buf: &[u8]) -> io::Result<usize> {
        match self {
            Conn::Tcp(s) => (&*s).write(buf),
            Conn::Unix(s) => (&*s).write(buf),
        }
    }

    fn fd(&self) -> BorrowedFd<'_> {
        match self {
            Conn::Tcp(s) => s.as_fd(),
            Conn::Unix(s) => s.as_fd(),
        }
    }

    fn set_nonblocking(&self, on: bool) -> io::Result<()> {
        match self {
            Conn::Tcp(s) => s.set_nonblocking(on),
            Conn::Unix(s) => s.set_nonblocking(on),
        }
    }

    fn set_read_timeout(&self, t: Option<Duration>) -> io::Result<()> {
        match self {
            Conn::Tcp(s) => s.set_read_timeout(t),
            Conn::Unix(s) => s.set_read_timeout(t),
        }
    }

    fn try_clone(&self) -> io::Result<Conn> {
        Ok(match self {
            Conn::Tcp(s) => Conn::Tcp(s.try_clone()?),
            Conn::Unix(s) => Conn::Unix(s.try_clone()?),
        })
    }

    fn shutdown(&self) {
        let _ = match self {
            Conn::Tcp(s) => s.shutdown(Shutdown::Both),
            Conn::Unix(s) => s.shutdown(Shutdown::Both),
        };
    }

    fn transport(&self) -> &'static str {
        match self {
            Conn::Tcp(_) => "tcp",
            Conn::Unix(_) => "unix",
        }
    }
}

/// Where a peer runs, for error messages and transport choice.
#[derive(Debug, Clone, Default)]
struct Peer {
    host: String,
    node_rank: u32,
    /// Its process id and the address of its probe bytes, for cross-memory attach (`None`
    /// when its record did not say).
    cma: Option<(i32, usize)>,
}

/// A peer's published record: host, TCP port, node rank, Unix socket name, process id and
/// probe address, one per line.
fn parse_record(record: &str) -> (Peer, Option<u16>, String) {
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

/// What the watcher thread shares with the backend.
#[derive(Default)]
struct Shared {
    /// The coordinator's failure report, once the watcher saw it.
    failure: Mutex<Option<Error>>,
    /// Clones of every connection, so the watcher can shut them down.
    conns: Mutex<Vec<Conn>>,
    stop: AtomicBool,
}

impl Shared {
    fn shutdown_all(&self) {
        for conn in self
            .conns
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .iter()
        {
            conn.shutdown();
        }
    }
}

/// Access to the job's key-value store outside the `Accelerator` (for the lost-peer notice).
struct Notices {
    kv: crate::client::Kv,
    runtime: tokio::runtime::Runtime,
    key: String,
}

/// Per process: how many communicators each (job, generation, rank) created, so that every
/// rank numbers its communicators alike (ranks may be threads of one process in tests).
static COMMUNICATORS: Mutex<Option<Counters>> = Mutex::new(None);

/// Communicators created, by (job, generation, rank).
type Counters = HashMap<(String, u64, u32), u64>;
/// A stream's send segments: byte ranges of the work buffer, each with the receive segment
/// (same range) it waits on, if any.
type Sends = Vec<(Range<usize>, Option<usize>)>;
/// A stream's receive segments: byte ranges of the work buffer, and whether to reduce into
/// them (else the data lands there as is).
type Recvs = Vec<(Range<usize>, bool)>;

fn next_communicator_id(job: &str, generation: u64, rank: u32) -> u64 {
    let mut map = COMMUNICATORS.lock().unwrap_or_else(PoisonError::into_inner);
    let counter = map
        .get_or_insert_with(HashMap::new)
        .entry((job.to_owned(), generation, rank))
        .or_insert(0);
    *counter += 1;
    *counter
}

fn fnv(s: &str) -> u64 {
    s.bytes().fold(0xcbf2_9ce4_8422_2325, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
    })
}

fn backend_error(message: impl Into<String>) -> Error {
    Error::Backend {
        backend: "cpu",
        message: message.into(),
    }
}

/// The CPU backend of one communicator.
pub(crate) struct CpuBackend {
    rank: usize,
    world: usize,
    /// By peer rank; `None` for this rank.
    conns: Vec<Option<Conn>>,
    peers: Vec<Peer>,
    /// Collectives so far (every rank counts alike).
    seq: u64,
    /// What the typed API says the next call is (for messages): operation name and dtype.
    context: Option<(&'static str, DType)>,
    /// Set once a failure made the communicator unusable.
    broken: Option<String>,
    shared: Arc<Shared>,
    watch: Option<FailureWatch>,
    notices: Option<Notices>,
    scratch: Vec<u64>,
    /// Whether large collectives use cross-memory attach (every rank agreed at setup).
    cma: bool,
    /// Every rank's process id, by rank (for cross-memory attach).
    pids: Vec<i32>,
    /// What peers read to probe cross-memory attach: [`PROBE_MAGIC`] and the job hash.
    probe: Box<[u8; 16]>,
    /// Scratch of the cross-memory attach path, in `u64`s (aligned for every element type).
    cma_scratch: Vec<u64>,
    /// The shared-memory arena of large all_reduce and all_gather, when every rank set it up
    /// (`cpu/arena.rs`); taken out during an operation, dropped after a failed one.
    shm: Option<ShmArena>,
}

impl Drop for CpuBackend {
    fn drop(&mut self) {
        self.shared.stop.store(true, Ordering::Relaxed);
    }
}

impl CpuBackend {
    /// Creates this rank's end of a new communicator: listens, publishes its addresses,
    /// connects to every lower rank and accepts every higher one. Every rank must call it (the
    /// n-th communicator of each rank forms one communicator).
    pub(crate) fn new(accelerator: &Accelerator) -> Result<Self, Error> {
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
        let id = next_communicator_id(&info.job_id, info.generation, info.rank);
        let prefix = format!("muster/comm/{}/{}", info.generation, id);
        let watch = Some(accelerator.failure_watch());

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
            "muster-comm-{:016x}-{}-{}-{}-{}-{:08x}",
            job_hash,
            info.generation,
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
            let mut b = [0u8; 40];
            b[0..8].copy_from_slice(HANDSHAKE_MAGIC);
            b[8..16].copy_from_slice(&info.generation.to_le_bytes());
            b[16..24].copy_from_slice(&id.to_le_bytes());
            b[24..32].copy_from_slice(&job_hash.to_le_bytes());
            b[32..36].copy_from_slice(&(from as u32).to_le_bytes());
            b[36..40].copy_from_slice(&(to as u32).to_le_bytes());
            b
        };
        let force_tcp = transport == Transport::Tcp;

        // Connect to every lower rank.
        for peer in 0..rank {
            let record = accelerator
                .kv()
                .get_wait(&format!("{prefix}/{peer}"), SETUP_TIMEOUT)?;
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
                     generation {} ({})",
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
                let mut hello = [0u8; 40];
                let ok = conn.set_nonblocking(false).is_ok()
                    && conn.set_read_timeout(Some(HANDSHAKE_TIMEOUT)).is_ok()
                    && read_exact_blocking(&conn, &mut hello).is_ok();
                let from =
                    u32::from_le_bytes([hello[32], hello[33], hello[34], hello[35]]) as usize;
                if !ok
                    || from <= rank
                    || from >= world
                    || hello != handshake(from, rank)
                    || backend.conns[from].is_some()
                {
                    tracing::warn!(
                        rank,
                        communicator = id,
                        "refused a connection with a wrong handshake"
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
            .map(|(pid0, _)| format!("{job_hash:016x}-{}-{id}-{pid0}", info.generation));
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
    fn setup_cma(&mut self, transport: Transport, id: u64) -> Result<bool, Error> {
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
            why_not = match cma::read_remote(pid, addr, &mut got) {
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

    fn conn(&self, peer: usize) -> &Conn {
        match &self.conns[peer] {
            Some(conn) => conn,
            None => unreachable!("every peer of a communicator is connected"),
        }
    }

    fn scratch(&mut self) -> Vec<u64> {
        let mut s = std::mem::take(&mut self.scratch);
        if s.len() < SCRATCH_WORDS {
            s = vec![0; SCRATCH_WORDS];
        }
        s
    }

    /// The header this rank sends for an operation.
    fn header(
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

    fn op_name(&self, header: &Header) -> String {
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
    fn fail(&mut self, header: &Header, peer: usize, reason: String) -> Error {
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
    fn blame(&self, op: &str, peer: usize, reason: String) -> Error {
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

    fn check_usable(&self) -> Result<(), Error> {
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
    fn run<R>(
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
    fn exchange(
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
    fn stream(
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
    fn stream_inner(
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
    fn chunk(len: usize, elem: usize, n: usize, i: usize) -> Range<usize> {
        let count = len / elem;
        (i * count / n * elem)..((i + 1) * count / n * elem)
    }

    fn wrap(&self, i: isize) -> usize {
        i.rem_euclid(self.world as isize) as usize
    }
}

/// The small-message reduction: `buf` becomes the reduction of every rank's data in rank order
/// (the same order on every rank, so results are bit-identical), where `payloads[peer]` holds
/// each peer's data and `source` this rank's (`mine`).
fn fold_in_rank_order(
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
fn without_rank_prefix(reason: &str, rank: u32) -> String {
    let Some(rest) = reason.strip_prefix(&format!("rank {rank} ")) else {
        return reason.to_owned();
    };
    let rest = match rest.strip_prefix('(').and_then(|r| r.split_once(") ")) {
        Some((_, after)) => after,
        None => rest,
    };
    rest.strip_prefix("of ").unwrap_or(rest).to_owned()
}

/// What a broken connection says, for messages.
fn broken(e: &io::Error) -> String {
    format!("its connection broke ({e})")
}

/// Waits in `poll` for any of `fds`; EINTR counts as a wakeup.
fn wait(fds: &mut [PollFd<'_>]) -> io::Result<()> {
    match poll(fds, PollTimeout::NONE) {
        Ok(_) | Err(nix::errno::Errno::EINTR) => Ok(()),
        Err(e) => Err(e.into()),
    }
}

fn watcher(watch: FailureWatch, shared: Arc<Shared>) {
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

fn rand_u32() -> u32 {
    let t = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.subsec_nanos());
    t ^ std::process::id().rotate_left(16)
}

fn connect(host: &str, port: u16, uds: Option<&str>) -> io::Result<Conn> {
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

fn write_all_blocking(conn: &Conn, mut buf: &[u8]) -> io::Result<()> {
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

fn read_exact_blocking(conn: &Conn, mut buf: &mut [u8]) -> io::Result<()> {
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

fn write_all_nb(conn: &Conn, mut buf: &[u8]) -> Result<(), String> {
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

fn read_exact_nb(conn: &Conn, mut buf: &mut [u8]) -> Result<(), String> {
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
