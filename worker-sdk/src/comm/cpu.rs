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
//!
//! # In-place recovery
//! A communicator is built for a membership epoch (0 until a rank dies in an in-place job).
//! After a quorum, [`Communicator::reconfigure`](super::Communicator::reconfigure) drops this
//! backend (closing its sockets, unmapping its shared memory) and builds a new one under the
//! quorum's epoch: the key becomes `muster/comm/<generation>.<epoch>/<communicator>/<rank>`,
//! the handshake carries the epoch (an old epoch's connection is refused) and the watcher fires
//! for a `membership_changed` push of a higher epoch, so a collective blocked on a rank that
//! died returns at once with [`Error::MembershipChanged`] naming it.
//!
//! # Files
//! `cpu/setup.rs` makes the mesh and picks the transport, `cpu/conn.rs` holds the connections
//! and their I/O, `cpu/wire.rs` the operation header, `cpu/engine.rs` runs one operation
//! (header exchange, blame, rings), `cpu/collectives.rs` is the [`Backend`](super::Backend)
//! implementation, and `cpu/arena.rs` and `cpu/cma.rs` the same-node fast paths; the backend's
//! state stays here.

use std::{
    collections::HashMap,
    ops::Range,
    sync::{
        Arc, Mutex, PoisonError,
        atomic::{AtomicBool, Ordering},
    },
    time::Duration,
};

use super::{DType, shm::ShmArena};
use crate::{Error, client::FailureWatch};

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

mod collectives;
mod conn;
mod engine;
mod setup;
mod wire;

use conn::{Conn, Peer, broken, wait, write_all_nb};
use wire::{Header, Transport};

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

pub(crate) fn next_communicator_id(job: &str, generation: u64, rank: u32) -> u64 {
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
