//! Collectives between the ranks of a job: one communicator API over a CPU backend and NCCL.
//!
//! [`Element`] is every type a collective moves (f32, f64, f16, bf16, i32, i64, u8); backends
//! see byte buffers plus a [`DType`], through the crate-internal `Backend` trait, so that one
//! generic API serves every type without `unsafe` (the casts are `bytemuck`'s).

use std::{
    fmt,
    sync::{
        Mutex, MutexGuard, PoisonError,
        atomic::{AtomicU64, Ordering},
    },
};

use crate::{Accelerator, Error, checkpoint::CheckpointState, membership::Quorum};

pub(crate) mod cpu;
pub(crate) mod reduce;
pub(crate) mod shm;

pub use crate::dtype::{DType, Element};

/// How a reduction combines the ranks' values.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ReduceOp {
    /// Element-wise sum.
    Sum,
    /// Element-wise mean over the ranks (integer types divide with truncation).
    Avg,
    /// Element-wise minimum.
    Min,
    /// Element-wise maximum.
    Max,
    /// Element-wise product.
    Product,
}

/// Which implementation carries a communicator's collectives.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum BackendKind {
    /// Sockets between the processes (every machine).
    Cpu,
    /// NCCL on CUDA devices.
    Nccl,
}

impl BackendKind {
    /// "cpu" or "nccl", as `MUSTER_COMM_BACKEND` spells it.
    pub fn name(self) -> &'static str {
        match self {
            BackendKind::Cpu => "cpu",
            BackendKind::Nccl => "nccl",
        }
    }
}

/// What a backend implements: equal-shape collectives over byte buffers. Everything else
/// (typed API, unequal sizes, padding, shape checks) is built on top in this module.
///
/// Buffers hold `len * dtype.size()` bytes, in the native layout of the element type. Every
/// rank calls the same operations in the same order with the same lengths, except where a
/// method says otherwise.
pub(crate) trait Backend: Send {
    /// Which backend this is.
    fn kind(&self) -> BackendKind;
    /// In place: every rank ends with the reduction of every rank's `buf`.
    fn all_reduce(&mut self, buf: &mut [u8], dtype: DType, op: ReduceOp) -> Result<(), Error>;
    /// In place: every rank ends with `root`'s `buf`.
    fn broadcast(&mut self, buf: &mut [u8], root: usize) -> Result<(), Error>;
    /// In place on `root` (the other ranks' `buf` is unspecified afterwards).
    fn reduce(
        &mut self,
        buf: &mut [u8],
        dtype: DType,
        op: ReduceOp,
        root: usize,
    ) -> Result<(), Error>;
    /// `recv` (world_size times `send`'s length) ends with every rank's `send`, in rank order.
    fn all_gather(&mut self, send: &[u8], recv: &mut [u8]) -> Result<(), Error>;
    /// `send` is world_size blocks of `recv`'s length; rank r's `recv` ends with the
    /// reduction of every rank's block r.
    fn reduce_scatter(
        &mut self,
        send: &[u8],
        recv: &mut [u8],
        dtype: DType,
        op: ReduceOp,
    ) -> Result<(), Error>;
    /// Point to point: only this rank and `peer` take part.
    fn send(&mut self, buf: &[u8], peer: usize) -> Result<(), Error>;
    /// Point to point: receives exactly `buf.len()` bytes sent by `peer`.
    fn recv(&mut self, buf: &mut [u8], peer: usize) -> Result<(), Error>;
    /// Says what the next call is at the typed API (its name and element type), for error
    /// messages and shape checks of byte-only calls (`all_gather`, `broadcast`, `send`).
    /// Backends without use for it ignore it.
    fn describe(&mut self, _op: &'static str, _dtype: DType) {}
    /// Returns once every rank has called it. The default is a one-byte all_reduce.
    fn barrier(&mut self) -> Result<(), Error> {
        let mut byte = [0u8];
        self.all_reduce(&mut byte, DType::U8, ReduceOp::Sum)
    }
}

/// The environment variable that picks a backend ("cpu" or "nccl") over the automatic choice.
pub const BACKEND_ENV: &str = muster_core::contract::env::MUSTER_COMM_BACKEND;

/// A group of every rank of the job that runs collectives (PyTorch's process group, Accelerate's
/// `gather`/`reduce`/`pad_across_processes`), over NCCL or the CPU backend.
///
/// Every rank creates its communicators in the same order (the n-th communicator of each rank
/// forms one group) and calls the same collectives in the same order. Calls are blocking;
/// the communicator is `Send + Sync`, and calls from several threads run one at a time.
/// Argument errors (a root or peer out of range, a length that does not divide) are returned
/// before anything is sent. Ranks that call one collective with different shapes all get
/// [`Error::ShapeMismatch`] listing every rank's shape (the CPU backend carries the shapes in
/// the headers it sends anyway; NCCL is wrapped in [`ShapeChecked`]), and a peer that dies
/// gives [`Error::PeerLost`] naming it, never a hang. The CPU backend's algorithms
/// (one-round direct exchange for small messages, pipelined rings and chains for large ones)
/// are described in `comm/cpu.rs`.
pub struct Communicator {
    rank: usize,
    world_size: usize,
    kind: BackendKind,
    /// This communicator's number among the rank's communicators of its kind (the same on
    /// every rank): a rebuilt backend keeps it.
    id: u64,
    /// The membership epoch the backend was built for (in-place recovery).
    epoch: AtomicU64,
    backend: Mutex<Box<dyn Backend>>,
    /// The session's reports, for the heal's (none in single-process mode).
    reports: Option<crate::client::Reports>,
}

impl fmt::Debug for Communicator {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Communicator")
            .field("rank", &self.rank)
            .field("world_size", &self.world_size)
            .field("backend", &self.kind)
            .field("epoch", &self.epoch())
            .finish_non_exhaustive()
    }
}

impl Communicator {
    /// A communicator over every rank of the job, on NCCL when it is usable here (library,
    /// driver and GPU found), else on the CPU backend. `MUSTER_COMM_BACKEND=cpu|nccl` overrides
    /// the choice. Every rank must make the same choice, so set the variable on mixed machines.
    pub fn new(accelerator: &Accelerator) -> Result<Self, Error> {
        let kind = match std::env::var(BACKEND_ENV) {
            Ok(v) if v == "cpu" => BackendKind::Cpu,
            Ok(v) if v == "nccl" => BackendKind::Nccl,
            Ok(v) => {
                return Err(Error::Config(format!(
                    "{BACKEND_ENV}='{v}' is not a communication backend (use cpu or nccl)"
                )));
            }
            Err(_) if nccl_available().is_ok() => BackendKind::Nccl,
            Err(_) => BackendKind::Cpu,
        };
        Self::with_backend(accelerator, kind)
    }

    /// A communicator on the given backend; fails (naming why) when it is not usable.
    ///
    /// It is built for the accelerator's membership epoch ([`Accelerator::epoch`]): a
    /// replacement (in-place recovery) must take part in a quorum first
    /// ([`crate::membership::Membership::quorum`]), and creates its communicators in the same
    /// order as the survivors created theirs. In place, a rank's death while the CPU mesh forms
    /// does not fail the creation: the communicator is returned, and each of its calls fails
    /// with that recoverable error until [`Communicator::reconfigure`] rebuilds it for the next
    /// quorum (so that a loop that goes to its quorum on a recoverable error needs nothing
    /// more).
    pub fn with_backend(accelerator: &Accelerator, kind: BackendKind) -> Result<Self, Error> {
        if accelerator
            .membership
            .awaiting_first
            .load(Ordering::Acquire)
        {
            return Err(Error::Usage(format!(
                "rank {} replaces a rank that died and has not taken part in a quorum yet: call \
                 membership().quorum(None) before creating a communicator",
                accelerator.process_index()
            )));
        }
        let epoch = accelerator.epoch();
        let (backend, id): (Box<dyn Backend>, u64) = match kind {
            BackendKind::Cpu => {
                let info = accelerator.info();
                let id = cpu::next_communicator_id(&info.job_id, info.generation, info.rank);
                let backend: Box<dyn Backend> =
                    match cpu::CpuBackend::create(accelerator, id, epoch) {
                        Ok(backend) => Box::new(backend),
                        // In place, a rank died while the mesh formed: the communicator
                        // exists all the same (under its id, so that every rank goes on
                        // creating communicators in the same order), and every call fails with
                        // that recoverable error until the next quorum's reconfigure rebuilds
                        // it.
                        Err(error)
                            if accelerator.recovery() == crate::env::Recovery::InPlace
                                && error.is_recoverable(crate::env::Recovery::InPlace) =>
                        {
                            Box::new(Retired {
                                kind,
                                why: format!("it was interrupted as it formed: {error}"),
                                interrupted: Some(error),
                            })
                        }
                        Err(error) => return Err(error),
                    };
                (backend, id)
            }
            BackendKind::Nccl => new_nccl(accelerator)?,
        };
        Ok(Self {
            rank: accelerator.process_index(),
            world_size: accelerator.num_processes(),
            kind: backend.kind(),
            id,
            epoch: AtomicU64::new(epoch),
            backend: Mutex::new(backend),
            reports: accelerator.session().map(crate::client::Session::reports),
        })
    }

    /// The membership epoch this communicator is built for (0 until an in-place recovery).
    pub fn epoch(&self) -> u64 {
        self.epoch.load(Ordering::Acquire)
    }

    /// Rebuilds this communicator for `quorum`'s membership (in-place recovery), on every rank
    /// after the same quorum: the old backend is dropped first (its sockets closed, its shared
    /// memory unmapped; NCCL's communicator aborted), then a new one is built under the
    /// quorum's epoch (the CPU backend publishes under `muster/comm/<generation>.<epoch>/...`
    /// and refuses an old epoch's handshake; NCCL shares a new unique id for the epoch). A
    /// quorum of the epoch it already has changes nothing. If building fails, every call
    /// fails until a later reconfigure succeeds. Every rank must pass the same quorum (the
    /// one [`Membership::quorum`](crate::membership::Membership::quorum) returned).
    ///
    /// The NCCL path compiles but is untested here (no GPU).
    pub fn reconfigure(&self, accelerator: &Accelerator, quorum: &Quorum) -> Result<(), Error> {
        if quorum.world_size as usize != self.world_size {
            return Err(self.invalid(format!(
                "reconfigure: the quorum of epoch {} has {} ranks, this communicator {}",
                quorum.epoch, quorum.world_size, self.world_size
            )));
        }
        if self.epoch() == quorum.epoch {
            return Ok(());
        }
        let mut backend = self.backend.lock().unwrap_or_else(PoisonError::into_inner);
        // Drop the old backend before the new one opens anything.
        *backend = Box::new(Retired {
            kind: self.kind,
            why: format!(
                "it is being rebuilt for membership epoch {} and the rebuild did not finish",
                quorum.epoch
            ),
            interrupted: None,
        });
        let rebuilt: Box<dyn Backend> = match self.kind {
            BackendKind::Cpu => {
                Box::new(cpu::CpuBackend::create(accelerator, self.id, quorum.epoch)?)
            }
            BackendKind::Nccl => Box::new(ShapeChecked::new(
                Box::new(nccl::connect_at(accelerator, self.id, quorum.epoch)?),
                self.world_size,
            )),
        };
        *backend = rebuilt;
        self.epoch.store(quorum.epoch, Ordering::Release);
        Ok(())
    }

    /// Heals the ranks `quorum` names (in-place recovery), after [`Communicator::reconfigure`]:
    /// each healed rank receives the whole registered state of its source point to point
    /// ([`Communicator::heal_bytes`]: every object of `state` as the checkpoint module's
    /// [`StateDict`](crate::checkpoint::StateDict)s, in one safetensors blob) and loads it; a
    /// source sends its state to every rank it heals, in rank order; ranks not involved return
    /// at once. Random generators are sent too ([`CheckpointState::heal_bytes`]); a rank not
    /// healed keeps its own as they are, so a loop that drew during the interrupted step
    /// registers a copy taken at the step's start (as `muster.torch.begin_step` keeps in
    /// Python). Every rank of the heal list must call it with the same registry layout (kinds
    /// and names).
    pub fn heal(&self, quorum: &Quorum, state: &mut CheckpointState<'_>) -> Result<(), Error> {
        let me = self.rank as u32;
        if let Some(source) = quorum.source_of(me) {
            return match self.heal_bytes(quorum, None)? {
                Some(blob) => state.load_heal_bytes(&blob, source),
                None => Ok(()),
            };
        }
        // Only a source serialises its state.
        let payload = if quorum.healed_by(me).is_empty() {
            None
        } else {
            Some(state.heal_bytes()?)
        };
        self.heal_bytes(quorum, payload.as_deref()).map(drop)
    }

    /// The heal protocol on opaque bytes, for states the checkpoint registry does not hold
    /// (the Python SDK's pickled or `torch.save`d state dicts): after
    /// [`Communicator::reconfigure`], a source sends `payload` (the length, then the bytes) to
    /// every rank it heals, in rank order, and returns `None`; a healed rank receives its
    /// source's bytes, reports that it healed (the recovery's timeline), and returns them; a
    /// rank not involved returns `None` at once. A source
    /// must pass a payload; what other ranks pass is ignored.
    pub fn heal_bytes(
        &self,
        quorum: &Quorum,
        payload: Option<&[u8]>,
    ) -> Result<Option<Vec<u8>>, Error> {
        if quorum.epoch != self.epoch() {
            return Err(self.invalid(format!(
                "heal: the communicator is at epoch {}, the quorum at {}: reconfigure first",
                self.epoch(),
                quorum.epoch
            )));
        }
        let me = self.rank as u32;
        if let Some(source) = quorum.source_of(me) {
            let mut length = [0u8; 8];
            self.recv(&mut length, source as usize)?;
            let length = usize::try_from(u64::from_le_bytes(length)).map_err(|_| {
                self.invalid(format!(
                    "heal: rank {source} announced a state too large for this machine"
                ))
            })?;
            // The length came from the network: refuse what cannot be allocated rather than
            // abort the process.
            let mut blob = Vec::new();
            blob.try_reserve_exact(length).map_err(|_| {
                self.invalid(format!(
                    "heal: rank {source} announced {length} bytes of state, more than this \
                     process can allocate"
                ))
            })?;
            blob.resize(length, 0);
            self.recv(&mut blob, source as usize)?;
            if let Some(reports) = &self.reports {
                reports.healed(quorum.epoch);
            }
            return Ok(Some(blob));
        }
        let healed = quorum.healed_by(me);
        if healed.is_empty() {
            return Ok(None);
        }
        let Some(blob) = payload else {
            return Err(self.invalid(format!(
                "heal: rank {me} heals ranks {healed:?} but was given no state to send"
            )));
        };
        for rank in healed {
            self.send(&(blob.len() as u64).to_le_bytes(), rank as usize)?;
            self.send(blob, rank as usize)?;
        }
        Ok(None)
    }

    /// This process's rank in the group.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// The number of ranks in the group.
    pub fn world_size(&self) -> usize {
        self.world_size
    }

    /// Which backend carries the collectives.
    pub fn backend(&self) -> BackendKind {
        self.kind
    }

    fn lock(&self, op: &'static str, dtype: DType) -> MutexGuard<'_, Box<dyn Backend>> {
        let mut backend = self.backend.lock().unwrap_or_else(PoisonError::into_inner);
        backend.describe(op, dtype);
        backend
    }

    fn invalid(&self, message: String) -> Error {
        Error::Backend {
            backend: self.kind.name(),
            message,
        }
    }

    fn check_root(&self, op: &str, root: usize) -> Result<(), Error> {
        if root >= self.world_size {
            return Err(self.invalid(format!(
                "{op}: root {root} is out of range (world size {})",
                self.world_size
            )));
        }
        Ok(())
    }

    fn check_peer(&self, op: &str, peer: usize) -> Result<(), Error> {
        if peer >= self.world_size {
            return Err(self.invalid(format!(
                "{op}: peer {peer} is out of range (world size {})",
                self.world_size
            )));
        }
        if peer == self.rank {
            return Err(self.invalid(format!("{op}: peer {peer} is this rank itself")));
        }
        Ok(())
    }

    /// In place: every rank ends with the element-wise reduction of every rank's `buf`.
    pub fn all_reduce<T: Element>(&self, buf: &mut [T], op: ReduceOp) -> Result<(), Error> {
        self.lock("all_reduce", T::DTYPE)
            .all_reduce(bytemuck::cast_slice_mut(buf), T::DTYPE, op)
    }

    /// In place: every rank ends with `root`'s `buf`.
    pub fn broadcast<T: Element>(&self, buf: &mut [T], root: usize) -> Result<(), Error> {
        self.check_root("broadcast", root)?;
        self.lock("broadcast", T::DTYPE)
            .broadcast(bytemuck::cast_slice_mut(buf), root)
    }

    /// In place on `root`: it ends with the reduction of every rank's `buf` (the other ranks'
    /// `buf` is unspecified afterwards).
    pub fn reduce<T: Element>(
        &self,
        buf: &mut [T],
        op: ReduceOp,
        root: usize,
    ) -> Result<(), Error> {
        self.check_root("reduce", root)?;
        self.lock("reduce", T::DTYPE)
            .reduce(bytemuck::cast_slice_mut(buf), T::DTYPE, op, root)
    }

    /// Every rank's `send` (all of the same length), concatenated in rank order.
    pub fn all_gather<T: Element>(&self, send: &[T]) -> Result<Vec<T>, Error> {
        let mut recv = vec![T::zeroed(); send.len() * self.world_size];
        self.all_gather_into(send, &mut recv)?;
        Ok(recv)
    }

    /// [`Communicator::all_gather`] into the caller's `recv`, which must hold world-size
    /// times `send`'s length.
    pub fn all_gather_into<T: Element>(&self, send: &[T], recv: &mut [T]) -> Result<(), Error> {
        if recv.len() != send.len() * self.world_size {
            return Err(self.invalid(format!(
                "all_gather: the output holds {} elements, not {} ({} from each of {} ranks)",
                recv.len(),
                send.len() * self.world_size,
                send.len(),
                self.world_size
            )));
        }
        self.lock("all_gather", T::DTYPE)
            .all_gather(bytemuck::cast_slice(send), bytemuck::cast_slice_mut(recv))
    }

    /// Every rank's lengths, in rank order (one small all_gather).
    fn lengths(&self, op: &'static str, len: usize) -> Result<Vec<usize>, Error> {
        let mine = [len as i64];
        let mut all = vec![0i64; self.world_size];
        self.lock(op, DType::I64).all_gather(
            bytemuck::cast_slice(&mine),
            bytemuck::cast_slice_mut(&mut all),
        )?;
        Ok(all.into_iter().map(|l| l as usize).collect())
    }

    /// Every rank's `send`, whatever their lengths, by rank: the lengths are exchanged first,
    /// then the data padded to the longest (one ring all_gather), then cut back.
    pub fn all_gather_varlen<T: Element>(&self, send: &[T]) -> Result<Vec<Vec<T>>, Error> {
        let lengths = self.lengths("all_gather_varlen", send.len())?;
        let longest = lengths.iter().copied().max().unwrap_or(0);
        let mut padded = send.to_vec();
        padded.resize(longest, T::zeroed());
        let mut recv = vec![T::zeroed(); longest * self.world_size];
        self.lock("all_gather_varlen", T::DTYPE).all_gather(
            bytemuck::cast_slice(&padded),
            bytemuck::cast_slice_mut(&mut recv),
        )?;
        Ok(lengths
            .iter()
            .enumerate()
            .map(|(rank, &len)| recv[rank * longest..rank * longest + len].to_vec())
            .collect())
    }

    /// Every rank's `send` (any lengths) on `root`, by rank; `None` on the other ranks. The
    /// lengths are exchanged first, then each rank sends to the root point to point.
    pub fn gather<T: Element>(
        &self,
        send: &[T],
        root: usize,
    ) -> Result<Option<Vec<Vec<T>>>, Error> {
        self.check_root("gather", root)?;
        let lengths = self.lengths("gather", send.len())?;
        let mut backend = self.lock("gather", T::DTYPE);
        if self.rank != root {
            if !send.is_empty() {
                backend.send(bytemuck::cast_slice(send), root)?;
            }
            return Ok(None);
        }
        let mut out = Vec::with_capacity(self.world_size);
        for (peer, &len) in lengths.iter().enumerate() {
            if peer == root {
                out.push(send.to_vec());
                continue;
            }
            let mut buf = vec![T::zeroed(); len];
            if len > 0 {
                backend.recv(bytemuck::cast_slice_mut(&mut buf), peer)?;
            }
            out.push(buf);
        }
        Ok(Some(out))
    }

    /// Rank r gets the reduction of every rank's block r, where `send` is world-size blocks of
    /// equal length (so its length must divide by the world size).
    pub fn reduce_scatter<T: Element>(&self, send: &[T], op: ReduceOp) -> Result<Vec<T>, Error> {
        if !send.len().is_multiple_of(self.world_size) {
            return Err(self.invalid(format!(
                "reduce_scatter: {} elements do not divide into {} equal blocks",
                send.len(),
                self.world_size
            )));
        }
        let mut recv = vec![T::zeroed(); send.len() / self.world_size];
        self.reduce_scatter_into(send, &mut recv, op)?;
        Ok(recv)
    }

    /// [`Communicator::reduce_scatter`] into the caller's `recv`, which must hold `send`'s
    /// length divided by the world size.
    pub fn reduce_scatter_into<T: Element>(
        &self,
        send: &[T],
        recv: &mut [T],
        op: ReduceOp,
    ) -> Result<(), Error> {
        if recv.len() * self.world_size != send.len() {
            return Err(self.invalid(format!(
                "reduce_scatter: {} elements do not make {} blocks of the output's {}",
                send.len(),
                self.world_size,
                recv.len()
            )));
        }
        self.lock("reduce_scatter", T::DTYPE).reduce_scatter(
            bytemuck::cast_slice(send),
            bytemuck::cast_slice_mut(recv),
            T::DTYPE,
            op,
        )
    }

    /// Sends `buf` to `peer`, which must call [`Communicator::recv`] with the same length. A
    /// message larger than the socket buffers returns only once the peer receives it, so two
    /// ranks exchanging large messages must not both send first (order them by rank).
    pub fn send<T: Element>(&self, buf: &[T], peer: usize) -> Result<(), Error> {
        self.check_peer("send", peer)?;
        self.lock("send", T::DTYPE)
            .send(bytemuck::cast_slice(buf), peer)
    }

    /// Receives exactly `buf.len()` elements that `peer` sent with [`Communicator::send`].
    pub fn recv<T: Element>(&self, buf: &mut [T], peer: usize) -> Result<(), Error> {
        self.check_peer("recv", peer)?;
        self.lock("recv", T::DTYPE)
            .recv(bytemuck::cast_slice_mut(buf), peer)
    }

    /// Returns once every rank of the group has called it.
    pub fn barrier(&self) -> Result<(), Error> {
        self.lock("barrier", DType::U8).barrier()
    }

    /// Accelerate's `pad_across_processes` for a 1-D tensor: `data` padded with `pad` to the
    /// longest length of any rank (at the front when `pad_first`), so that it can then be
    /// gathered with [`Communicator::all_gather`].
    pub fn pad_across_processes<T: Element>(
        &self,
        data: &[T],
        pad: T,
        pad_first: bool,
    ) -> Result<Vec<T>, Error> {
        let longest = self
            .lengths("pad_across_processes", data.len())?
            .into_iter()
            .max()
            .unwrap_or(0);
        let padding = std::iter::repeat_n(pad, longest - data.len());
        Ok(if pad_first {
            padding.chain(data.iter().copied()).collect()
        } else {
            data.iter().copied().chain(padding).collect()
        })
    }
}

/// Wraps a backend that cannot see a shape mismatch by itself (NCCL would hang, or read and
/// write past the shorter buffer): before each collective, every rank's (operation, element
/// type, element count, root, reduce op) goes round in one small all_gather of the inner
/// backend, and any difference is an [`Error::ShapeMismatch`] listing every rank's shape,
/// returned by every rank before the real operation starts. On NCCL that costs one 40-byte
/// all_gather (tens of microseconds within a node) per collective: small next to the
/// collectives a training step makes, and the difference between a clear error and a hang.
/// Point-to-point calls are not checked (only two ranks take part; the CPU backend checks
/// those itself).
struct ShapeChecked {
    inner: Box<dyn Backend>,
    world_size: usize,
    /// The typed API's name and element type of the current call ([`Backend::describe`]).
    context: (&'static str, DType),
}

/// What [`ShapeChecked`] compares, as i64s: op code, element type, element count, root, reduce
/// op.
const SHAPE_FIELDS: usize = 5;

impl ShapeChecked {
    fn new(inner: Box<dyn Backend>, world_size: usize) -> Self {
        Self {
            inner,
            world_size,
            context: ("collective", DType::U8),
        }
    }

    /// Compares this rank's call with every other rank's.
    fn check(
        &mut self,
        code: i64,
        dtype: DType,
        bytes: usize,
        root: Option<usize>,
        op: Option<ReduceOp>,
    ) -> Result<(), Error> {
        if self.world_size == 1 {
            return Ok(());
        }
        let mine: [i64; SHAPE_FIELDS] = [
            code,
            dtype_code(dtype),
            (bytes / dtype.size()) as i64,
            root.map_or(-1, |r| r as i64),
            op.map_or(-1, |o| o as i64),
        ];
        let mut all = vec![0i64; SHAPE_FIELDS * self.world_size];
        self.inner.all_gather(
            bytemuck::cast_slice(&mine),
            bytemuck::cast_slice_mut(&mut all),
        )?;
        let calls: Vec<&[i64]> = all.chunks(SHAPE_FIELDS).collect();
        if calls.iter().all(|c| *c == mine) {
            return Ok(());
        }
        let field_differs = |i: usize| calls.iter().any(|c| c[i] != calls[0][i]);
        let (code_differs, root_differs, op_differs) =
            (field_differs(0), field_differs(3), field_differs(4));
        let shapes = calls
            .iter()
            .enumerate()
            .map(|(rank, c)| {
                let dtype = dtype_from_code(c[1]).map_or("?", DType::name);
                let mut shape = format!("{} {dtype}", c[2]);
                if code_differs {
                    shape = format!("{} of {shape}", op_code_name(c[0]));
                }
                if root_differs {
                    shape.push_str(&format!(" root {}", c[3]));
                }
                if op_differs {
                    shape.push_str(&format!(" op {}", c[4]));
                }
                (rank as u32, shape)
            })
            .collect();
        Err(Error::ShapeMismatch {
            op: self.context.0.to_owned(),
            shapes,
        })
    }
}

const CODE_ALL_REDUCE: i64 = 1;
const CODE_BROADCAST: i64 = 2;
const CODE_REDUCE: i64 = 3;
const CODE_ALL_GATHER: i64 = 4;
const CODE_REDUCE_SCATTER: i64 = 5;
const CODE_BARRIER: i64 = 6;

fn op_code_name(code: i64) -> &'static str {
    match code {
        CODE_ALL_REDUCE => "all_reduce",
        CODE_BROADCAST => "broadcast",
        CODE_REDUCE => "reduce",
        CODE_ALL_GATHER => "all_gather",
        CODE_REDUCE_SCATTER => "reduce_scatter",
        CODE_BARRIER => "barrier",
        _ => "?",
    }
}

const DTYPES: [DType; 7] = [
    DType::F32,
    DType::F64,
    DType::F16,
    DType::BF16,
    DType::I32,
    DType::I64,
    DType::U8,
];

fn dtype_code(dtype: DType) -> i64 {
    DTYPES.iter().position(|d| *d == dtype).unwrap_or(0) as i64
}

fn dtype_from_code(code: i64) -> Option<DType> {
    usize::try_from(code)
        .ok()
        .and_then(|i| DTYPES.get(i).copied())
}

impl Backend for ShapeChecked {
    fn kind(&self) -> BackendKind {
        self.inner.kind()
    }

    fn all_reduce(&mut self, buf: &mut [u8], dtype: DType, op: ReduceOp) -> Result<(), Error> {
        self.check(CODE_ALL_REDUCE, dtype, buf.len(), None, Some(op))?;
        self.inner.all_reduce(buf, dtype, op)
    }

    fn broadcast(&mut self, buf: &mut [u8], root: usize) -> Result<(), Error> {
        let dtype = self.context.1;
        self.check(CODE_BROADCAST, dtype, buf.len(), Some(root), None)?;
        self.inner.broadcast(buf, root)
    }

    fn reduce(
        &mut self,
        buf: &mut [u8],
        dtype: DType,
        op: ReduceOp,
        root: usize,
    ) -> Result<(), Error> {
        self.check(CODE_REDUCE, dtype, buf.len(), Some(root), Some(op))?;
        self.inner.reduce(buf, dtype, op, root)
    }

    fn all_gather(&mut self, send: &[u8], recv: &mut [u8]) -> Result<(), Error> {
        let dtype = self.context.1;
        self.check(CODE_ALL_GATHER, dtype, send.len(), None, None)?;
        self.inner.all_gather(send, recv)
    }

    fn reduce_scatter(
        &mut self,
        send: &[u8],
        recv: &mut [u8],
        dtype: DType,
        op: ReduceOp,
    ) -> Result<(), Error> {
        self.check(CODE_REDUCE_SCATTER, dtype, send.len(), None, Some(op))?;
        self.inner.reduce_scatter(send, recv, dtype, op)
    }

    fn send(&mut self, buf: &[u8], peer: usize) -> Result<(), Error> {
        self.inner.send(buf, peer)
    }

    fn recv(&mut self, buf: &mut [u8], peer: usize) -> Result<(), Error> {
        self.inner.recv(buf, peer)
    }

    fn describe(&mut self, op: &'static str, dtype: DType) {
        self.context = (op, dtype);
        self.inner.describe(op, dtype);
    }

    fn barrier(&mut self) -> Result<(), Error> {
        self.check(CODE_BARRIER, DType::U8, 0, None, None)?;
        self.inner.barrier()
    }
}

/// Whether NCCL can run here; `Err` says why not (no libnccl, libcuda or GPU).
fn nccl_available() -> Result<(), String> {
    nccl::available()
}

/// The NCCL backend of a new communicator: rank 0 makes the unique id and publishes it through
/// the coordinator (generation-fenced), the others fetch it, and every rank joins.
fn new_nccl(accelerator: &Accelerator) -> Result<(Box<dyn Backend>, u64), Error> {
    let (backend, index) = nccl::connect(accelerator)?;
    Ok((
        Box::new(ShapeChecked::new(
            Box::new(backend),
            accelerator.num_processes(),
        )),
        index,
    ))
}

/// What a communicator holds between dropping its old backend and building the new one
/// ([`Communicator::reconfigure`]): every call fails, saying why.
/// Also what a communicator holds when a death interrupted its creation (in place): every
/// call then fails with a copy of that recoverable error.
struct Retired {
    kind: BackendKind,
    why: String,
    interrupted: Option<Error>,
}

impl Retired {
    fn error(&self) -> Error {
        match &self.interrupted {
            Some(Error::MembershipChanged {
                epoch,
                rank,
                node_rank,
                host,
                reason,
            }) => Error::MembershipChanged {
                epoch: *epoch,
                rank: *rank,
                node_rank: *node_rank,
                host: host.clone(),
                reason: reason.clone(),
            },
            Some(Error::PeerLost {
                rank,
                node_rank,
                host,
                op,
                reason,
            }) => Error::PeerLost {
                rank: *rank,
                node_rank: *node_rank,
                host: host.clone(),
                op: op.clone(),
                reason: reason.clone(),
            },
            _ => Error::Backend {
                backend: self.kind.name(),
                message: format!("this communicator is unusable: {}", self.why),
            },
        }
    }
}

impl Backend for Retired {
    fn kind(&self) -> BackendKind {
        self.kind
    }
    fn all_reduce(&mut self, _: &mut [u8], _: DType, _: ReduceOp) -> Result<(), Error> {
        Err(self.error())
    }
    fn broadcast(&mut self, _: &mut [u8], _: usize) -> Result<(), Error> {
        Err(self.error())
    }
    fn reduce(&mut self, _: &mut [u8], _: DType, _: ReduceOp, _: usize) -> Result<(), Error> {
        Err(self.error())
    }
    fn all_gather(&mut self, _: &[u8], _: &mut [u8]) -> Result<(), Error> {
        Err(self.error())
    }
    fn reduce_scatter(
        &mut self,
        _: &[u8],
        _: &mut [u8],
        _: DType,
        _: ReduceOp,
    ) -> Result<(), Error> {
        Err(self.error())
    }
    fn send(&mut self, _: &[u8], _: usize) -> Result<(), Error> {
        Err(self.error())
    }
    fn recv(&mut self, _: &mut [u8], _: usize) -> Result<(), Error> {
        Err(self.error())
    }
}

pub(crate) mod nccl;

#[cfg(test)]
mod recovery_tests;

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use std::sync::{
        Arc, Barrier,
        atomic::{AtomicBool, Ordering},
    };

    /// Ranks as threads of one process whose only collective is all_gather (through shared
    /// memory and a barrier), and whose all_reduce records that it ran: enough to see what
    /// [`ShapeChecked`] lets through.
    struct Threads {
        rank: usize,
        slots: Arc<Mutex<Vec<Vec<u8>>>>,
        barrier: Arc<Barrier>,
        reduced: Arc<AtomicBool>,
    }

    impl Backend for Threads {
        fn kind(&self) -> BackendKind {
            BackendKind::Nccl
        }
        fn all_reduce(&mut self, _: &mut [u8], _: DType, _: ReduceOp) -> Result<(), Error> {
            self.reduced.store(true, Ordering::SeqCst);
            Ok(())
        }
        fn broadcast(&mut self, _: &mut [u8], _: usize) -> Result<(), Error> {
            Ok(())
        }
        fn reduce(&mut self, _: &mut [u8], _: DType, _: ReduceOp, _: usize) -> Result<(), Error> {
            Ok(())
        }
        fn all_gather(&mut self, send: &[u8], recv: &mut [u8]) -> Result<(), Error> {
            self.slots.lock().unwrap()[self.rank] = send.to_vec();
            self.barrier.wait();
            recv.copy_from_slice(&self.slots.lock().unwrap().concat());
            self.barrier.wait();
            Ok(())
        }
        fn reduce_scatter(
            &mut self,
            _: &[u8],
            _: &mut [u8],
            _: DType,
            _: ReduceOp,
        ) -> Result<(), Error> {
            Ok(())
        }
        fn send(&mut self, _: &[u8], _: usize) -> Result<(), Error> {
            Ok(())
        }
        fn recv(&mut self, _: &mut [u8], _: usize) -> Result<(), Error> {
            Ok(())
        }
    }

    /// Runs one all_reduce per rank with the given (dtype, length) and returns each rank's
    /// outcome and whether the inner backend ran.
    fn all_reduce(calls: &[(DType, usize)]) -> Vec<(Result<(), Error>, bool)> {
        let slots = Arc::new(Mutex::new(vec![vec![]; calls.len()]));
        let barrier = Arc::new(Barrier::new(calls.len()));
        let threads: Vec<_> = calls
            .iter()
            .enumerate()
            .map(|(rank, &(dtype, len))| {
                let reduced = Arc::new(AtomicBool::new(false));
                let inner = Threads {
                    rank,
                    slots: slots.clone(),
                    barrier: barrier.clone(),
                    reduced: reduced.clone(),
                };
                std::thread::spawn(move || {
                    let mut checked = ShapeChecked::new(Box::new(inner), 3);
                    checked.describe("all_reduce", dtype);
                    let mut buf = vec![0u8; len * dtype.size()];
                    let outcome = checked.all_reduce(&mut buf, dtype, ReduceOp::Sum);
                    (outcome, reduced.load(Ordering::SeqCst))
                })
            })
            .collect();
        threads.into_iter().map(|t| t.join().unwrap()).collect()
    }

    #[test]
    fn equal_shapes_pass_and_a_mismatch_lists_every_rank_before_the_operation() {
        for (outcome, reduced) in all_reduce(&[(DType::F32, 4); 3]) {
            outcome.unwrap();
            assert!(reduced);
        }
        let results = all_reduce(&[(DType::F32, 4), (DType::F32, 5), (DType::F16, 4)]);
        for (outcome, reduced) in results {
            assert!(!reduced, "the operation must not start");
            let error = outcome.unwrap_err();
            assert_eq!(
                error.to_string(),
                "all_reduce: shapes differ across ranks: rank 0: 4 f32, rank 1: 5 f32, rank 2: 4 f16"
            );
        }
    }
}
