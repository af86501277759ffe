//! The backend proper ([`NcclBackend`]): device buffers, the private stream, and the wait that
//! polls for completion while watching the coordinator's failure reports.

use std::{ffi::c_int, sync::Arc, time::Duration};

use cudarc::{
    driver::{CudaContext, CudaEvent, CudaSlice, CudaStream, DriverError},
    nccl::sys::ncclResult_t,
};

use crate::comm::{Backend, BackendKind, DType, ReduceOp};
use crate::{Error, NCCL_UNIQUE_ID_BYTES, RankInfo, client::FailureWatch};

use super::{
    MAX_POLL_PAUSE, NAME_THE_PEER_GRACE, SPIN_POLLS, available, backend_error,
    raw::{Call, RawComm},
    types::{divide_integers, nccl_op},
};

/// What ended a wait on the communicator.
pub(super) enum Stop {
    /// The coordinator reported a failure of the generation.
    Failure(Error),
    /// NCCL reported an error (the state `ncclCommGetAsyncError` or an enqueue returned).
    Nccl(ncclResult_t),
    /// A CUDA call failed.
    Driver(&'static str, DriverError),
}

/// Which device buffer an operation uses.
#[derive(Clone, Copy)]
pub(super) enum Slot {
    /// The in-place buffer, and the send side of out-of-place operations.
    First,
    /// The receive side of out-of-place operations.
    Second,
}

/// The NCCL backend of one communicator: one CUDA device (`local_rank`), one stream, one NCCL
/// communicator and two device buffers that grow to the largest operation seen.
///
/// Every operation is synchronous for the caller: it is enqueued, then the calling thread
/// polls the stream, NCCL's asynchronous error state and the coordinator's failure watch until
/// one of them says something. After a failure the communicator is aborted and every later
/// operation fails at once; a new communicator is needed (in practice: the agent restarts the
/// generation).
pub(crate) struct NcclBackend {
    /// `None` once aborted. Declared first: dropped (aborted) before the buffers are freed.
    pub(super) comm: Option<RawComm>,
    /// Why it was aborted, repeated by every later operation.
    pub(super) broken: Option<String>,
    pub(super) buffers: [Option<CudaSlice<u8>>; 2],
    /// Recorded after each operation: its completion is what the poll loop queries.
    pub(super) done: CudaEvent,
    pub(super) stream: Arc<CudaStream>,
    pub(super) context: Arc<CudaContext>,
    pub(super) rank: usize,
    pub(super) world_size: usize,
    pub(super) failures: FailureWatch,
    /// The element type the typed API announced for the next call ([`Backend::describe`]), so
    /// that errors of byte-only calls count elements rather than bytes.
    pub(super) typed: Option<DType>,
    /// Test hook: while set, operations look unfinished, as if a peer never joined them.
    #[cfg(test)]
    pub(super) stall: Arc<std::sync::atomic::AtomicBool>,
}

impl NcclBackend {
    /// Joins communicator `unique_id` as `info.rank` of `info.world_size` on CUDA device
    /// `info.local_rank`, waiting for every rank to join. Nothing aborts the wait when a peer
    /// dies: prefer [`connect`](super::connect), which watches the coordinator's failure reports.
    #[allow(
        dead_code,
        reason = "the dispatcher calls connect(); this is the entry point for callers that \
                  exchange the unique id themselves"
    )]
    pub(crate) fn new(
        info: &RankInfo,
        unique_id: [u8; NCCL_UNIQUE_ID_BYTES],
    ) -> Result<Self, Error> {
        Self::with_failure_watch(info, &[unique_id], FailureWatch::default())
    }

    /// [`NcclBackend::new`] with the communicator's unique ids (one per bootstrap root, see
    /// [`crate::Accelerator::nccl_unique_ids`]), aborting (the join, and every later
    /// operation) when `failures` fires.
    pub(crate) fn with_failure_watch(
        info: &RankInfo,
        unique_ids: &[[u8; NCCL_UNIQUE_ID_BYTES]],
        failures: FailureWatch,
    ) -> Result<Self, Error> {
        available().map_err(backend_error)?;
        let (Ok(rank), Ok(world_size)) =
            (c_int::try_from(info.rank), c_int::try_from(info.world_size))
        else {
            return Err(backend_error(format!(
                "rank {} of world size {} is beyond what NCCL supports",
                info.rank, info.world_size
            )));
        };
        if info.rank >= info.world_size {
            return Err(backend_error(format!(
                "rank {} is not below the world size {}",
                info.rank, info.world_size
            )));
        }
        let device = info.local_rank as usize;
        let devices = CudaContext::device_count()
            .map_err(|e| backend_error(format!("counting CUDA devices failed: {e}")))?;
        if device >= usize::try_from(devices).unwrap_or(0) {
            return Err(backend_error(format!(
                "rank {} (local rank {}) needs CUDA device {device}, but only {devices} are \
                 visible: run one process per GPU (check CUDA_VISIBLE_DEVICES and \
                 --nproc-per-node)",
                info.rank, info.local_rank
            )));
        }
        let cuda = |what: &'static str| {
            move |e: DriverError| backend_error(format!("{what} on CUDA device {device}: {e}"))
        };
        let context = CudaContext::new(device).map_err(cuda("creating a CUDA context"))?;
        let stream = context
            .new_stream()
            .map_err(cuda("creating a CUDA stream"))?;
        let done = context
            .new_event(None)
            .map_err(cuda("creating a CUDA event"))?;
        context
            .bind_to_thread()
            .map_err(cuda("making the CUDA context current"))?;
        let (comm, result) =
            RawComm::start_init(world_size, unique_ids, rank).map_err(backend_error)?;
        let mut backend = Self {
            comm,
            broken: None,
            buffers: [None, None],
            done,
            stream,
            context,
            rank: info.rank as usize,
            world_size: info.world_size as usize,
            failures,
            typed: None,
            #[cfg(test)]
            stall: Arc::default(),
        };
        let what = || {
            format!(
                "joining the NCCL communicator (rank {rank} of {world_size}, CUDA device \
                 {device})"
            )
        };
        if backend.comm.is_none() {
            return Err(backend_error(format!("{}: {result:?}", what())));
        }
        match result {
            ncclResult_t::ncclSuccess | ncclResult_t::ncclInProgress => {}
            error => return Err(backend.fail(&what(), Stop::Nccl(error))),
        }
        backend.wait(&what, false)?;
        tracing::debug!(rank, world_size, device, "joined the NCCL communicator");
        Ok(backend)
    }

    /// The communicator, or the error that aborted it.
    pub(super) fn comm(&self) -> Result<&RawComm, Error> {
        match (&self.comm, &self.broken) {
            (Some(comm), _) => Ok(comm),
            (None, broken) => Err(backend_error(format!(
                "the NCCL communicator was aborted after an earlier failure ({}); create a new \
                 communicator",
                broken.as_deref().unwrap_or("unknown")
            ))),
        }
    }

    /// Element count of a `bytes`-long buffer of `dtype`.
    pub(super) fn count(bytes: usize, dtype: DType, op: &str) -> Result<usize, Error> {
        if !bytes.is_multiple_of(dtype.size()) {
            return Err(backend_error(format!(
                "{op}: a buffer of {bytes} bytes is not a whole number of {dtype} elements"
            )));
        }
        Ok(bytes / dtype.size())
    }

    pub(super) fn check_rank(&self, rank: usize, role: &str, op: &str) -> Result<c_int, Error> {
        match c_int::try_from(rank) {
            Ok(rank_int) if rank < self.world_size => Ok(rank_int),
            _ => Err(backend_error(format!(
                "{op}: {role} rank {rank} is beyond the world size {}",
                self.world_size
            ))),
        }
    }

    /// Copies `data` into the start of device buffer `slot`, growing the buffer if needed.
    pub(super) fn upload(&mut self, slot: Slot, data: &[u8], what: &str) -> Result<(), Error> {
        self.reserve(slot, data.len(), what)?;
        let Some(buffer) = self.buffers[slot as usize].as_mut() else {
            return Err(backend_error(format!("{what}: no device buffer")));
        };
        let result = self
            .stream
            .memcpy_htod(data, &mut buffer.slice_mut(..data.len()));
        result.map_err(|e| self.fail(what, Stop::Driver("copying to the GPU", e)))
    }

    /// Makes device buffer `slot` hold at least `bytes`. Only called with no operation in
    /// flight, so a replaced buffer is not in use.
    pub(super) fn reserve(&mut self, slot: Slot, bytes: usize, what: &str) -> Result<(), Error> {
        let current = self.buffers[slot as usize]
            .as_ref()
            .map_or(0, CudaSlice::len);
        if current >= bytes {
            return Ok(());
        }
        // Round up so that slowly growing sizes do not reallocate every time.
        let size = bytes.next_power_of_two().max(4096);
        self.buffers[slot as usize] = None;
        let buffer = self
            .stream
            .alloc_zeros::<u8>(size)
            .map_err(|e| self.fail(what, Stop::Driver("allocating GPU memory", e)))?;
        self.buffers[slot as usize] = Some(buffer);
        Ok(())
    }

    /// Copies the start of device buffer `slot` into `out`. Only called once the operation
    /// that wrote it finished (a copy to pageable memory would otherwise block on it).
    pub(super) fn download(&mut self, slot: Slot, out: &mut [u8], what: &str) -> Result<(), Error> {
        let Some(buffer) = self.buffers[slot as usize].as_ref() else {
            return Err(backend_error(format!("{what}: no device buffer")));
        };
        let result = self
            .stream
            .memcpy_dtoh(&buffer.slice(..out.len()), out)
            .and_then(|()| self.stream.synchronize());
        result.map_err(|e| self.fail(what, Stop::Driver("copying from the GPU", e)))
    }

    /// Enqueues the call that `make` builds from the device buffers and waits for it.
    pub(super) fn run(
        &mut self,
        what: &dyn Fn() -> String,
        make: impl FnOnce(&mut [Option<CudaSlice<u8>>; 2]) -> Option<Call<'_>>,
    ) -> Result<(), Error> {
        self.comm()?;
        if let Err(e) = self.context.bind_to_thread() {
            return Err(self.fail(&what(), Stop::Driver("making the CUDA context current", e)));
        }
        let result = {
            let Some(comm) = self.comm.as_ref() else {
                return Err(self.comm().err().unwrap_or_else(|| backend_error(what())));
            };
            match make(&mut self.buffers) {
                Some(call) => comm.enqueue(&self.stream, call),
                None => ncclResult_t::ncclInvalidArgument,
            }
        };
        match result {
            ncclResult_t::ncclSuccess | ncclResult_t::ncclInProgress => self.wait(what, true),
            error => Err(self.fail(&what(), Stop::Nccl(error))),
        }
    }

    /// Polls until the communicator is idle and, with `on_stream`, the work enqueued on the
    /// stream finished; aborts the communicator when NCCL or the coordinator reports a failure.
    pub(super) fn wait(&mut self, what: &dyn Fn() -> String, on_stream: bool) -> Result<(), Error> {
        let mut recorded = false;
        let mut polls: u32 = 0;
        loop {
            let comm = self.comm()?;
            match comm.state() {
                ncclResult_t::ncclInProgress => {}
                ncclResult_t::ncclSuccess if !on_stream => return Ok(()),
                ncclResult_t::ncclSuccess => {
                    if !recorded {
                        if let Err(e) = self.done.record(&self.stream) {
                            return Err(self.fail(&what(), Stop::Driver("recording an event", e)));
                        }
                        recorded = true;
                    }
                    match self.done.try_is_complete() {
                        Ok(true) if !self.stalled() => return Ok(()),
                        Ok(_) => {}
                        Err(e) => {
                            return Err(self.fail(&what(), Stop::Driver("waiting for the GPU", e)));
                        }
                    }
                }
                error => return Err(self.fail(&what(), Stop::Nccl(error))),
            }
            if let Some(failure) = self.failures.failed() {
                return Err(self.fail(&what(), Stop::Failure(failure)));
            }
            polls = polls.saturating_add(1);
            if polls < SPIN_POLLS {
                std::thread::yield_now();
            } else {
                let pause =
                    Duration::from_micros(u64::from(polls - SPIN_POLLS) * 20).min(MAX_POLL_PAUSE);
                if let Some(failure) = self.failures.wait_timeout(pause) {
                    return Err(self.fail(&what(), Stop::Failure(failure)));
                }
            }
        }
    }

    #[cfg(test)]
    pub(super) fn stalled(&self) -> bool {
        self.stall.load(std::sync::atomic::Ordering::SeqCst)
    }

    #[cfg(not(test))]
    pub(super) fn stalled(&self) -> bool {
        false
    }

    /// Aborts the communicator and builds the error `stop` means for operation `what`.
    pub(super) fn fail(&mut self, what: &str, stop: Stop) -> Error {
        let detail = self
            .comm
            .as_ref()
            .map(RawComm::last_error)
            .unwrap_or_default();
        let error = match stop {
            Stop::Failure(failure) => peer_lost(failure, what),
            Stop::Nccl(result) => {
                let nccl = if detail.is_empty() {
                    format!("{result:?}")
                } else {
                    format!("{result:?}: {detail}")
                };
                // A network error is usually a peer that died: give the coordinator a moment
                // to say which one, so that the error names it.
                let failure = match result {
                    ncclResult_t::ncclRemoteError
                    | ncclResult_t::ncclSystemError
                    | ncclResult_t::ncclInternalError => {
                        self.failures.wait_timeout(NAME_THE_PEER_GRACE)
                    }
                    _ => self.failures.failed(),
                };
                match failure {
                    Some(failure) => peer_lost(failure, what),
                    None => backend_error(format!("{what} failed: {nccl}")),
                }
            }
            Stop::Driver(doing, e) => backend_error(format!("{what}: {doing} failed: {e}")),
        };
        if self.comm.take().is_some() {
            tracing::warn!(rank = self.rank, %error, "aborting the NCCL communicator");
        }
        self.broken.get_or_insert_with(|| error.to_string());
        error
    }

    pub(super) fn describe(op: &str, count: usize, dtype: DType) -> String {
        format!("{op} of {count} {dtype}")
    }

    /// "1024 f32" when the typed API announced the element type (and it divides), else
    /// "4096 bytes". Consumes the announcement: it is for one call.
    pub(super) fn amount(&mut self, bytes: usize) -> String {
        match self.typed.take() {
            Some(dtype) if bytes.is_multiple_of(dtype.size()) => {
                format!("{} {dtype}", bytes / dtype.size())
            }
            _ => format!("{bytes} bytes"),
        }
    }
}

/// The error for an operation that the coordinator's failure report interrupted: the dead
/// peer, named, when the report is about a rank.
pub(super) fn peer_lost(failure: Error, what: &str) -> Error {
    let reason = |message: &str| {
        format!("the coordinator reported: {message}; the NCCL communicator was aborted")
    };
    match failure {
        Error::RankFailed {
            rank,
            node_rank,
            host,
            reason: message,
        }
        | Error::RankLeft {
            rank,
            node_rank,
            host,
            message,
        } => Error::PeerLost {
            rank,
            node_rank,
            host,
            op: what.to_owned(),
            reason: reason(&message),
        },
        other => other,
    }
}

impl Backend for NcclBackend {
    fn kind(&self) -> BackendKind {
        BackendKind::Nccl
    }

    fn describe(&mut self, _op: &'static str, dtype: DType) {
        self.typed = Some(dtype);
    }

    fn all_reduce(&mut self, buf: &mut [u8], dtype: DType, op: ReduceOp) -> Result<(), Error> {
        let count = Self::count(buf.len(), dtype, "all_reduce")?;
        self.typed = None;
        let what = || Self::describe("all_reduce", count, dtype);
        self.comm()?;
        if count == 0 {
            return Ok(());
        }
        let (nccl_op, divide) = nccl_op(dtype, op);
        self.upload(Slot::First, buf, &what())?;
        self.run(&what, |buffers| {
            Some(Call::AllReduce {
                buf: buffers[0].as_mut()?,
                count,
                dtype,
                op: nccl_op,
            })
        })?;
        self.download(Slot::First, buf, &what())?;
        if divide {
            divide_integers(buf, dtype, self.world_size);
        }
        Ok(())
    }

    fn broadcast(&mut self, buf: &mut [u8], root: usize) -> Result<(), Error> {
        let bytes = buf.len();
        let amount = self.amount(bytes);
        let what = || format!("broadcast of {amount} from rank {root}");
        let root = self.check_rank(root, "root", "broadcast")?;
        self.comm()?;
        if bytes == 0 {
            return Ok(());
        }
        // Every rank uploads (the non-roots' bytes are overwritten): one code path, and the
        // buffer is sized the same everywhere.
        self.upload(Slot::First, buf, &what())?;
        self.run(&what, |buffers| {
            Some(Call::Broadcast {
                buf: buffers[0].as_mut()?,
                bytes,
                root,
            })
        })?;
        self.download(Slot::First, buf, &what())
    }

    fn reduce(
        &mut self,
        buf: &mut [u8],
        dtype: DType,
        op: ReduceOp,
        root: usize,
    ) -> Result<(), Error> {
        let count = Self::count(buf.len(), dtype, "reduce")?;
        self.typed = None;
        let what = || format!("reduce of {count} {dtype} to rank {root}");
        let root_int = self.check_rank(root, "root", "reduce")?;
        self.comm()?;
        if count == 0 {
            return Ok(());
        }
        let (nccl_op, divide) = nccl_op(dtype, op);
        self.upload(Slot::First, buf, &what())?;
        self.run(&what, |buffers| {
            Some(Call::Reduce {
                buf: buffers[0].as_mut()?,
                count,
                dtype,
                op: nccl_op,
                root: root_int,
            })
        })?;
        if self.rank == root {
            self.download(Slot::First, buf, &what())?;
            if divide {
                divide_integers(buf, dtype, self.world_size);
            }
        }
        Ok(())
    }

    fn all_gather(&mut self, send: &[u8], recv: &mut [u8]) -> Result<(), Error> {
        let bytes = send.len();
        let amount = self.amount(bytes);
        let what = || format!("all_gather of {amount} per rank");
        if bytes.checked_mul(self.world_size) != Some(recv.len()) {
            return Err(backend_error(format!(
                "{}: the receive buffer holds {} bytes, not {} ranks times {bytes}",
                what(),
                recv.len(),
                self.world_size
            )));
        }
        self.comm()?;
        if bytes == 0 {
            return Ok(());
        }
        let world_size = self.world_size;
        self.upload(Slot::First, send, &what())?;
        self.reserve(Slot::Second, recv.len(), &what())?;
        self.run(&what, |buffers| {
            let [first, second] = buffers;
            Some(Call::AllGather {
                send: first.as_ref()?,
                recv: second.as_mut()?,
                bytes,
                world_size,
            })
        })?;
        self.download(Slot::Second, recv, &what())
    }

    fn reduce_scatter(
        &mut self,
        send: &[u8],
        recv: &mut [u8],
        dtype: DType,
        op: ReduceOp,
    ) -> Result<(), Error> {
        let count = Self::count(recv.len(), dtype, "reduce_scatter")?;
        self.typed = None;
        let what = || format!("reduce_scatter of {count} {dtype} per rank");
        if recv.len().checked_mul(self.world_size) != Some(send.len()) {
            return Err(backend_error(format!(
                "{}: the send buffer holds {} bytes, not {} ranks times {}",
                what(),
                send.len(),
                self.world_size,
                recv.len()
            )));
        }
        self.comm()?;
        if count == 0 {
            return Ok(());
        }
        let (nccl_op, divide) = nccl_op(dtype, op);
        let world_size = self.world_size;
        self.upload(Slot::First, send, &what())?;
        self.reserve(Slot::Second, recv.len(), &what())?;
        self.run(&what, |buffers| {
            let [first, second] = buffers;
            Some(Call::ReduceScatter {
                send: first.as_ref()?,
                recv: second.as_mut()?,
                count,
                dtype,
                op: nccl_op,
                world_size,
            })
        })?;
        self.download(Slot::Second, recv, &what())?;
        if divide {
            divide_integers(recv, dtype, self.world_size);
        }
        Ok(())
    }

    fn send(&mut self, buf: &[u8], peer: usize) -> Result<(), Error> {
        let bytes = buf.len();
        let amount = self.amount(bytes);
        let what = || format!("send of {amount} to rank {peer}");
        let peer_int = self.check_rank(peer, "peer", "send")?;
        if peer == self.rank {
            return Err(backend_error(format!(
                "{}: a rank cannot send to itself",
                what()
            )));
        }
        self.comm()?;
        if bytes == 0 {
            return Ok(());
        }
        self.upload(Slot::First, buf, &what())?;
        self.run(&what, |buffers| {
            Some(Call::Send {
                buf: buffers[0].as_ref()?,
                bytes,
                peer: peer_int,
            })
        })
    }

    fn recv(&mut self, buf: &mut [u8], peer: usize) -> Result<(), Error> {
        let bytes = buf.len();
        let amount = self.amount(bytes);
        let what = || format!("recv of {amount} from rank {peer}");
        let peer_int = self.check_rank(peer, "peer", "recv")?;
        if peer == self.rank {
            return Err(backend_error(format!(
                "{}: a rank cannot receive from itself",
                what()
            )));
        }
        self.comm()?;
        if bytes == 0 {
            return Ok(());
        }
        self.reserve(Slot::First, bytes, &what())?;
        self.run(&what, |buffers| {
            Some(Call::Recv {
                buf: buffers[0].as_mut()?,
                bytes,
                peer: peer_int,
            })
        })?;
        self.download(Slot::First, buf, &what())
    }
}

impl std::fmt::Debug for NcclBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NcclBackend")
            .field("rank", &self.rank)
            .field("world_size", &self.world_size)
            .field("device", &self.context.ordinal())
            .field("aborted", &self.comm.is_none())
            .finish_non_exhaustive()
    }
}
