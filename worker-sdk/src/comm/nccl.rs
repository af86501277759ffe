//! The NCCL backend of the communicator: host buffers are copied into reusable device buffers,
//! the collective runs on a private CUDA stream, and the calling thread polls for completion
//! while it watches the coordinator's failure reports, so that a dead peer aborts the NCCL
//! communicator (`ncclCommAbort`) and the caller gets [`Error::PeerLost`] naming that peer
//! instead of hanging in a kernel.
//!
//! Nothing here touches libcuda or libnccl until [`available`], [`new_unique_id`], [`connect`]
//! or [`NcclBackend::new`] is called: cudarc loads both at run time (`dynamic-loading`), and
//! [`available`] checks that they can be loaded before calling into them, because cudarc panics
//! when a library or symbol is missing.
//!
//! The communicator is non-blocking (`ncclConfig_t.blocking = 0`): initialisation and every
//! enqueue return at once (possibly with `ncclInProgress`), which is what lets a rank stop
//! waiting for a peer that never arrives. cudarc's safe `Comm` does not fit: it blocks in
//! `ncclCommInitRank`, exposes neither its raw handle nor `ncclCommGetAsyncError`, is not
//! `Send`, panics in `Drop` when the abort fails, and types f16/bf16 only under a cudarc feature
//! this workspace does not enable. The raw calls therefore live in [`RawComm`], each in the
//! smallest `#[allow(unsafe_code)]` item with its SAFETY argument; everything else is safe code.

use std::{
    collections::BTreeMap,
    ffi::{CStr, c_char, c_int, c_void},
    panic, ptr,
    sync::{Arc, Mutex, OnceLock, PoisonError},
    time::Duration,
};

use cudarc::{
    driver::{CudaContext, CudaEvent, CudaSlice, CudaStream, DevicePtr, DevicePtrMut, DriverError},
    nccl::sys::{self, ncclResult_t},
};

use super::{Backend, BackendKind, DType, ReduceOp};
use crate::{Accelerator, Error, NCCL_UNIQUE_ID_BYTES, RankInfo, client::FailureWatch};

/// The backend name errors carry.
const BACKEND: &str = "nccl";

/// The oldest NCCL with non-blocking communicators (`ncclCommInitRankConfig`,
/// `ncclInProgress`), `ncclAvg` and bf16: `NCCL_VERSION(2, 14, 0)`.
const MIN_NCCL_VERSION: c_int = 21_400;

/// `NCCL_VERSION(2, 30, 0)`: the headers cudarc's bindings, and so the `ncclConfig_t` layout
/// below, come from. An older library reads only the prefix of the struct it knows (it clamps
/// `size`), so claiming the newer layout is safe.
const CONFIG_VERSION: u32 = 23_000;

/// `NCCL_API_MAGIC`, which `NCCL_CONFIG_INITIALIZER` writes.
const CONFIG_MAGIC: u32 = 0xcafe_beef;

/// `NCCL_CONFIG_UNDEF_INT`: "let NCCL choose", what `NCCL_CONFIG_INITIALIZER` writes.
const CONFIG_UNDEF: c_int = c_int::MIN;

/// How long a rank whose NCCL reported a network error waits for the coordinator to say which
/// peer died, so that the error can name it.
const NAME_THE_PEER_GRACE: Duration = Duration::from_secs(5);

/// Polls done back to back (yielding the thread) before the poll loop starts sleeping: small
/// collectives finish within these, so they pay no sleep.
const SPIN_POLLS: u32 = 200;

/// The longest sleep between polls of a long collective.
const MAX_POLL_PAUSE: Duration = Duration::from_millis(2);

/// Whether this process can use the NCCL backend: libcuda and libnccl load, the driver
/// initialises, at least one CUDA device is visible and NCCL is 2.14 or newer. `Err` says
/// which of these failed. Never panics; the answer is computed once per process.
pub(crate) fn available() -> Result<(), String> {
    static PROBE: OnceLock<Result<(), String>> = OnceLock::new();
    PROBE
        .get_or_init(|| {
            // `probe` only calls cudarc after checking that the libraries load, but cudarc
            // panics on any missing symbol too (an unusual libcuda or libnccl): a panic is
            // caught and reported like any other reason.
            panic::catch_unwind(probe).unwrap_or_else(|panic| {
                let message = panic
                    .downcast_ref::<String>()
                    .map(String::as_str)
                    .or_else(|| panic.downcast_ref::<&str>().copied())
                    .unwrap_or("unknown panic");
                Err(format!("loading CUDA or NCCL failed: {message}"))
            })
        })
        .clone()
}

fn probe() -> Result<(), String> {
    let (cuda, nccl) = libraries_present();
    if !cuda {
        return Err(
            "the CUDA driver library (libcuda.so) cannot be loaded: no NVIDIA driver \
                    on this machine, or it is not on the library path"
                .to_owned(),
        );
    }
    if !nccl {
        return Err(
            "the NCCL library (libnccl.so) cannot be loaded: install NCCL 2.14 or \
                    newer, or add its directory to LD_LIBRARY_PATH"
                .to_owned(),
        );
    }
    cudarc::driver::result::init()
        .map_err(|e| format!("the CUDA driver did not initialise: {e}"))?;
    let devices =
        CudaContext::device_count().map_err(|e| format!("counting CUDA devices failed: {e}"))?;
    if devices < 1 {
        return Err("no CUDA device is visible (check CUDA_VISIBLE_DEVICES)".to_owned());
    }
    let version = cudarc::nccl::result::get_nccl_version()
        .map_err(|e| format!("ncclGetVersion failed: {:?}", e.0))?;
    if version < MIN_NCCL_VERSION {
        return Err(format!(
            "NCCL {} is too old: the nccl backend needs 2.14 or newer (non-blocking \
             communicators, so that a dead peer aborts the communicator instead of hanging it)",
            version_name(version)
        ));
    }
    Ok(())
}

/// Whether libcuda and libnccl can be loaded, checked without calling into cudarc's lazily
/// loaded bindings (which panic when the library is absent).
#[allow(unsafe_code)]
fn libraries_present() -> (bool, bool) {
    // SAFETY: both functions only try `dlopen` on the library's usual names and close it
    // again; loading runs the library's initialisers, which is exactly what cudarc does on the
    // first CUDA or NCCL call. They have no other precondition.
    unsafe {
        (
            cudarc::driver::sys::is_culib_present(),
            sys::is_culib_present(),
        )
    }
}

/// "2.21.5" from NCCL's integer version (`major * 10000 + minor * 100 + patch` since 2.9).
fn version_name(version: c_int) -> String {
    if version >= 10_000 {
        format!(
            "{}.{}.{}",
            version / 10_000,
            version % 10_000 / 100,
            version % 100
        )
    } else {
        format!(
            "{}.{}.{}",
            version / 1_000,
            version % 1_000 / 100,
            version % 100
        )
    }
}

/// A fresh NCCL unique id (`ncclGetUniqueId`), made by the root rank of a communicator and
/// handed to the others (through the coordinator's unique-id service).
#[allow(
    dead_code,
    reason = "used by connect(); drop this once comm/mod.rs's new_nccl calls connect()"
)]
pub(crate) fn new_unique_id() -> Result<[u8; NCCL_UNIQUE_ID_BYTES], Error> {
    available().map_err(backend_error)?;
    let id = cudarc::nccl::result::get_uniqueid()
        .map_err(|e| backend_error(format!("ncclGetUniqueId failed: {:?}", e.0)))?;
    // `c_char` is i8 or u8 depending on the target: a bit-for-bit copy either way.
    Ok(id.internal.map(|byte| byte as u8))
}

/// Creates the NCCL communicator of `accelerator`'s generation: rank 0 makes the unique id and
/// publishes it through the coordinator's generation-fenced unique-id service, the other ranks
/// fetch it, and every rank joins on CUDA device `local_rank`. Failures the coordinator reports
/// (for example a rank that dies before it joins) abort the communicator, here and in every
/// later operation.
///
/// Every rank must create its NCCL communicators in the same order: the n-th one of each rank
/// shares the id published under `muster.comm.nccl.<n>` (counted per job, generation and rank,
/// so that ranks run as threads of one process, as tests do, count independently).
#[allow(
    dead_code,
    reason = "until comm/mod.rs's new_nccl calls it (issue 4); drop this then"
)]
pub(crate) fn connect(accelerator: &Accelerator) -> Result<NcclBackend, Error> {
    static CREATED: Mutex<BTreeMap<(String, u64, u32), u64>> = Mutex::new(BTreeMap::new());
    available().map_err(backend_error)?;
    let info = accelerator.info();
    let index = {
        let mut created = CREATED.lock().unwrap_or_else(PoisonError::into_inner);
        let next = created
            .entry((info.job_id.clone(), info.generation, info.rank))
            .or_insert(0);
        *next += 1;
        *next - 1
    };
    let name = format!("muster.comm.nccl.{index}");
    let id = if info.rank == 0 {
        let id = new_unique_id()?;
        accelerator.publish_nccl_unique_id(&name, &id)?;
        id
    } else {
        accelerator.fetch_nccl_unique_id(&name)?
    };
    NcclBackend::with_failure_watch(info, id, accelerator.failure_watch())
}

fn backend_error(message: impl Into<String>) -> Error {
    Error::Backend {
        backend: BACKEND,
        message: message.into(),
    }
}

/// The NCCL data type of a [`DType`].
fn nccl_type(dtype: DType) -> sys::ncclDataType_t {
    use sys::ncclDataType_t as T;
    match dtype {
        DType::F32 => T::ncclFloat32,
        DType::F64 => T::ncclFloat64,
        DType::F16 => T::ncclFloat16,
        DType::BF16 => T::ncclBfloat16,
        DType::I32 => T::ncclInt32,
        DType::I64 => T::ncclInt64,
        DType::U8 => T::ncclUint8,
    }
}

fn is_float(dtype: DType) -> bool {
    matches!(dtype, DType::F32 | DType::F64 | DType::F16 | DType::BF16)
}

/// The NCCL operation for `op` on `dtype`, and whether the result must still be divided by the
/// world size on the host: NCCL's `ncclAvg` is for floats, so an integer mean is a sum followed
/// by a truncating division, as the CPU backend does.
fn nccl_op(dtype: DType, op: ReduceOp) -> (sys::ncclRedOp_t, bool) {
    use sys::ncclRedOp_t as O;
    match op {
        ReduceOp::Sum => (O::ncclSum, false),
        ReduceOp::Product => (O::ncclProd, false),
        ReduceOp::Min => (O::ncclMin, false),
        ReduceOp::Max => (O::ncclMax, false),
        ReduceOp::Avg if is_float(dtype) => (O::ncclAvg, false),
        ReduceOp::Avg => (O::ncclSum, true),
    }
}

/// Divides every integer element of `buf` by `world_size`, truncating toward zero.
fn divide_integers(buf: &mut [u8], dtype: DType, world_size: usize) {
    match dtype {
        DType::I32 => {
            let divisor = i32::try_from(world_size).unwrap_or(i32::MAX);
            for chunk in buf.chunks_exact_mut(4) {
                let value = i32::from_ne_bytes([chunk[0], chunk[1], chunk[2], chunk[3]]);
                chunk.copy_from_slice(&(value / divisor).to_ne_bytes());
            }
        }
        DType::I64 => {
            let divisor = i64::try_from(world_size).unwrap_or(i64::MAX);
            for chunk in buf.chunks_exact_mut(8) {
                let mut bytes = [0; 8];
                bytes.copy_from_slice(chunk);
                chunk.copy_from_slice(&(i64::from_ne_bytes(bytes) / divisor).to_ne_bytes());
            }
        }
        DType::U8 => {
            let divisor = u8::try_from(world_size).unwrap_or(u8::MAX);
            for byte in buf {
                *byte /= divisor;
            }
        }
        DType::F32 | DType::F64 | DType::F16 | DType::BF16 => {}
    }
}

/// An NCCL communicator handle. Dropping it aborts the communicator (`ncclCommAbort`), which
/// is valid in every state of a non-blocking communicator (an unfinished init, hung
/// operations) and never waits for peers; a healthy communicator has no work in flight when it
/// is dropped (every operation is waited for), so aborting it is as clean as destroying it
/// without `ncclCommDestroy`'s risk of waiting on a dead peer.
struct RawComm(sys::ncclComm_t);

// SAFETY: an NCCL communicator may be used from any thread as long as calls on it do not
// overlap. A `RawComm` has one owner (an `NcclBackend`, whose operations take `&mut self`)
// and is not `Sync`, so calls on it never overlap.
#[allow(unsafe_code)]
unsafe impl Send for RawComm {}

/// One operation on device buffers. Lengths are in elements of the operation's data type;
/// every variant is checked against the buffers' sizes before NCCL sees a pointer.
enum Call<'a> {
    AllReduce {
        buf: &'a mut CudaSlice<u8>,
        count: usize,
        dtype: DType,
        op: sys::ncclRedOp_t,
    },
    Broadcast {
        buf: &'a mut CudaSlice<u8>,
        bytes: usize,
        root: c_int,
    },
    Reduce {
        buf: &'a mut CudaSlice<u8>,
        count: usize,
        dtype: DType,
        op: sys::ncclRedOp_t,
        root: c_int,
    },
    AllGather {
        send: &'a CudaSlice<u8>,
        recv: &'a mut CudaSlice<u8>,
        bytes: usize,
        world_size: usize,
    },
    ReduceScatter {
        send: &'a CudaSlice<u8>,
        recv: &'a mut CudaSlice<u8>,
        count: usize,
        dtype: DType,
        op: sys::ncclRedOp_t,
        world_size: usize,
    },
    Send {
        buf: &'a CudaSlice<u8>,
        bytes: usize,
        peer: c_int,
    },
    Recv {
        buf: &'a mut CudaSlice<u8>,
        bytes: usize,
        peer: c_int,
    },
}

impl RawComm {
    /// Starts joining communicator `id` as `rank` of `world_size` on the CUDA device current on
    /// this thread. The join finishes in the background: poll [`RawComm::state`].
    #[allow(unsafe_code)]
    fn start_init(
        world_size: c_int,
        id: &[u8; NCCL_UNIQUE_ID_BYTES],
        rank: c_int,
    ) -> (Option<Self>, ncclResult_t) {
        // NCCL_CONFIG_INITIALIZER, non-blocking.
        let mut config = sys::ncclConfig_t {
            size: std::mem::size_of::<sys::ncclConfig_t>(),
            magic: CONFIG_MAGIC,
            version: CONFIG_VERSION,
            blocking: 0,
            cgaClusterSize: CONFIG_UNDEF,
            minCTAs: CONFIG_UNDEF,
            maxCTAs: CONFIG_UNDEF,
            netName: ptr::null(),
            splitShare: CONFIG_UNDEF,
            trafficClass: CONFIG_UNDEF,
            commName: ptr::null(),
            collnetEnable: CONFIG_UNDEF,
            CTAPolicy: CONFIG_UNDEF,
            shrinkShare: CONFIG_UNDEF,
            nvlsCTAs: CONFIG_UNDEF,
            nChannelsPerNetPeer: CONFIG_UNDEF,
            nvlinkCentricSched: CONFIG_UNDEF,
            graphUsageMode: CONFIG_UNDEF,
            numRmaCtx: CONFIG_UNDEF,
            maxP2pPeers: CONFIG_UNDEF,
        };
        let id = sys::ncclUniqueId {
            internal: id.map(|byte| byte as c_char),
        };
        let mut comm: sys::ncclComm_t = ptr::null_mut();
        // SAFETY: `comm` and `config` are valid for the whole call; NCCL copies the config
        // (at most `size` bytes, clamped to the struct it knows) and the id before returning,
        // and keeps no pointer to either. `world_size` and `rank` were checked by the caller.
        let result =
            unsafe { sys::ncclCommInitRankConfig(&mut comm, world_size, id, rank, &mut config) };
        let comm = (!comm.is_null()).then_some(Self(comm));
        (comm, result)
    }

    /// The communicator's state: `ncclInProgress` while an init or an enqueue is still under
    /// way, `ncclSuccess` when it is idle or its work is on the stream, or the error that broke
    /// it (a peer's connection reset, ...).
    #[allow(unsafe_code)]
    fn state(&self) -> ncclResult_t {
        let mut state = ncclResult_t::ncclSuccess;
        // SAFETY: `self.0` is a live communicator (only `Drop` releases it) and `state` is
        // valid for writes.
        let result = unsafe { sys::ncclCommGetAsyncError(self.0, &mut state) };
        if result == ncclResult_t::ncclSuccess {
            state
        } else {
            result
        }
    }

    /// NCCL's description of the last error on this communicator ("" when it has none).
    #[allow(unsafe_code)]
    fn last_error(&self) -> String {
        // SAFETY: `self.0` is a live communicator. NCCL returns null or a NUL-terminated
        // string it owns, valid until its next call; it is copied at once.
        unsafe {
            let message = sys::ncclGetLastError(self.0);
            if message.is_null() {
                String::new()
            } else {
                CStr::from_ptr(message).to_string_lossy().trim().to_owned()
            }
        }
    }

    /// Enqueues `call` on `stream`. `ncclSuccess` or `ncclInProgress` mean it was accepted
    /// (for the latter, poll [`RawComm::state`] before the next NCCL call); a size that does
    /// not fit its buffers is refused with `ncclInvalidArgument` before NCCL is called.
    #[allow(unsafe_code)]
    fn enqueue(&self, stream: &CudaStream, call: Call<'_>) -> ncclResult_t {
        let invalid = ncclResult_t::ncclInvalidArgument;
        let raw_stream = stream.cu_stream() as sys::cudaStream_t;
        // Every pointer below comes from a `CudaSlice` of this backend's context whose length
        // was checked to cover the operation; the guards `device_ptr*` return stay alive until
        // after the enqueue. SAFETY (for each block): the buffers outlive the operation, because
        // the backend owns them and waits for every operation to finish (or aborts the
        // communicator, after which frees ordered on the same stream still wait for the
        // kernel) before it resizes or frees them; `self.0` is a live communicator.
        match call {
            Call::AllReduce {
                buf,
                count,
                dtype,
                op,
            } => {
                if count
                    .checked_mul(dtype.size())
                    .is_none_or(|n| n > buf.len())
                {
                    return invalid;
                }
                let (ptr, _guard) = buf.device_ptr_mut(stream);
                let ptr = ptr as *mut c_void;
                unsafe {
                    sys::ncclAllReduce(ptr, ptr, count, nccl_type(dtype), op, self.0, raw_stream)
                }
            }
            Call::Broadcast { buf, bytes, root } => {
                if bytes > buf.len() {
                    return invalid;
                }
                let (ptr, _guard) = buf.device_ptr_mut(stream);
                let ptr = ptr as *mut c_void;
                unsafe {
                    sys::ncclBroadcast(
                        ptr,
                        ptr,
                        bytes,
                        sys::ncclDataType_t::ncclUint8,
                        root,
                        self.0,
                        raw_stream,
                    )
                }
            }
            Call::Reduce {
                buf,
                count,
                dtype,
                op,
                root,
            } => {
                if count
                    .checked_mul(dtype.size())
                    .is_none_or(|n| n > buf.len())
                {
                    return invalid;
                }
                let (ptr, _guard) = buf.device_ptr_mut(stream);
                let ptr = ptr as *mut c_void;
                unsafe {
                    sys::ncclReduce(
                        ptr,
                        ptr,
                        count,
                        nccl_type(dtype),
                        op,
                        root,
                        self.0,
                        raw_stream,
                    )
                }
            }
            Call::AllGather {
                send,
                recv,
                bytes,
                world_size,
            } => {
                if bytes > send.len()
                    || bytes.checked_mul(world_size).is_none_or(|n| n > recv.len())
                {
                    return invalid;
                }
                let (send_ptr, _send_guard) = send.device_ptr(stream);
                let (recv_ptr, _recv_guard) = recv.device_ptr_mut(stream);
                unsafe {
                    sys::ncclAllGather(
                        send_ptr as *const c_void,
                        recv_ptr as *mut c_void,
                        bytes,
                        sys::ncclDataType_t::ncclUint8,
                        self.0,
                        raw_stream,
                    )
                }
            }
            Call::ReduceScatter {
                send,
                recv,
                count,
                dtype,
                op,
                world_size,
            } => {
                let Some(recv_bytes) = count.checked_mul(dtype.size()) else {
                    return invalid;
                };
                if recv_bytes > recv.len()
                    || recv_bytes
                        .checked_mul(world_size)
                        .is_none_or(|n| n > send.len())
                {
                    return invalid;
                }
                let (send_ptr, _send_guard) = send.device_ptr(stream);
                let (recv_ptr, _recv_guard) = recv.device_ptr_mut(stream);
                unsafe {
                    sys::ncclReduceScatter(
                        send_ptr as *const c_void,
                        recv_ptr as *mut c_void,
                        count,
                        nccl_type(dtype),
                        op,
                        self.0,
                        raw_stream,
                    )
                }
            }
            Call::Send { buf, bytes, peer } => {
                if bytes > buf.len() {
                    return invalid;
                }
                let (ptr, _guard) = buf.device_ptr(stream);
                unsafe {
                    sys::ncclSend(
                        ptr as *const c_void,
                        bytes,
                        sys::ncclDataType_t::ncclUint8,
                        peer,
                        self.0,
                        raw_stream,
                    )
                }
            }
            Call::Recv { buf, bytes, peer } => {
                if bytes > buf.len() {
                    return invalid;
                }
                let (ptr, _guard) = buf.device_ptr_mut(stream);
                unsafe {
                    sys::ncclRecv(
                        ptr as *mut c_void,
                        bytes,
                        sys::ncclDataType_t::ncclUint8,
                        peer,
                        self.0,
                        raw_stream,
                    )
                }
            }
        }
    }
}

impl Drop for RawComm {
    #[allow(unsafe_code)]
    fn drop(&mut self) {
        // SAFETY: `self.0` came from `ncclCommInitRankConfig` and is released exactly once,
        // here. `ncclCommAbort` is valid in every state of a non-blocking communicator: during
        // its init, with operations hung on a dead peer, or idle.
        let result = unsafe { sys::ncclCommAbort(self.0) };
        if !matches!(
            result,
            ncclResult_t::ncclSuccess | ncclResult_t::ncclInProgress
        ) {
            tracing::warn!(?result, "ncclCommAbort failed");
        }
    }
}

/// What ended a wait on the communicator.
enum Stop {
    /// The coordinator reported a failure of the generation.
    Failure(Error),
    /// NCCL reported an error (the state `ncclCommGetAsyncError` or an enqueue returned).
    Nccl(ncclResult_t),
    /// A CUDA call failed.
    Driver(&'static str, DriverError),
}

/// Which device buffer an operation uses.
#[derive(Clone, Copy)]
enum Slot {
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
    comm: Option<RawComm>,
    /// Why it was aborted, repeated by every later operation.
    broken: Option<String>,
    buffers: [Option<CudaSlice<u8>>; 2],
    /// Recorded after each operation: its completion is what the poll loop queries.
    done: CudaEvent,
    stream: Arc<CudaStream>,
    context: Arc<CudaContext>,
    rank: usize,
    world_size: usize,
    failures: FailureWatch,
    /// The element type the typed API announced for the next call ([`Backend::describe`]), so
    /// that errors of byte-only calls count elements rather than bytes.
    typed: Option<DType>,
    /// Test hook: while set, operations look unfinished, as if a peer never joined them.
    #[cfg(test)]
    stall: Arc<std::sync::atomic::AtomicBool>,
}

impl NcclBackend {
    /// Joins communicator `unique_id` as `info.rank` of `info.world_size` on CUDA device
    /// `info.local_rank`, waiting for every rank to join. Nothing aborts the wait when a peer
    /// dies: prefer [`connect`], which watches the coordinator's failure reports.
    #[allow(
        dead_code,
        reason = "the dispatcher calls connect(); this is the entry point for callers that \
                  exchange the unique id themselves"
    )]
    pub(crate) fn new(
        info: &RankInfo,
        unique_id: [u8; NCCL_UNIQUE_ID_BYTES],
    ) -> Result<Self, Error> {
        Self::with_failure_watch(info, unique_id, FailureWatch::default())
    }

    /// [`NcclBackend::new`], aborting (the join, and every later operation) when `failures`
    /// fires.
    pub(crate) fn with_failure_watch(
        info: &RankInfo,
        unique_id: [u8; NCCL_UNIQUE_ID_BYTES],
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
        let (comm, result) = RawComm::start_init(world_size, &unique_id, rank);
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
    fn comm(&self) -> Result<&RawComm, Error> {
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
    fn count(bytes: usize, dtype: DType, op: &str) -> Result<usize, Error> {
        if !bytes.is_multiple_of(dtype.size()) {
            return Err(backend_error(format!(
                "{op}: a buffer of {bytes} bytes is not a whole number of {dtype} elements"
            )));
        }
        Ok(bytes / dtype.size())
    }

    fn check_rank(&self, rank: usize, role: &str, op: &str) -> Result<c_int, Error> {
        match c_int::try_from(rank) {
            Ok(rank_int) if rank < self.world_size => Ok(rank_int),
            _ => Err(backend_error(format!(
                "{op}: {role} rank {rank} is beyond the world size {}",
                self.world_size
            ))),
        }
    }

    /// Copies `data` into the start of device buffer `slot`, growing the buffer if needed.
    fn upload(&mut self, slot: Slot, data: &[u8], what: &str) -> Result<(), Error> {
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
    fn reserve(&mut self, slot: Slot, bytes: usize, what: &str) -> Result<(), Error> {
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
    fn download(&mut self, slot: Slot, out: &mut [u8], what: &str) -> Result<(), Error> {
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
    fn run(
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
    fn wait(&mut self, what: &dyn Fn() -> String, on_stream: bool) -> Result<(), Error> {
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
    fn stalled(&self) -> bool {
        self.stall.load(std::sync::atomic::Ordering::SeqCst)
    }

    #[cfg(not(test))]
    fn stalled(&self) -> bool {
        false
    }

    /// Aborts the communicator and builds the error `stop` means for operation `what`.
    fn fail(&mut self, what: &str, stop: Stop) -> Error {
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

    fn describe(op: &str, count: usize, dtype: DType) -> String {
        format!("{op} of {count} {dtype}")
    }

    /// "1024 f32" when the typed API announced the element type (and it divides), else
    /// "4096 bytes". Consumes the announcement: it is for one call.
    fn amount(&mut self, bytes: usize) -> String {
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
fn peer_lost(failure: Error, what: &str) -> Error {
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

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use std::{
        sync::atomic::{AtomicBool, Ordering},
        thread,
        time::Instant,
    };

    use muster_proto::v1 as pb;

    use super::*;

    /// The reason the GPU tests skip, or `None` when they can run.
    fn skip() -> Option<String> {
        available().err()
    }

    fn info(rank: u32, world_size: u32) -> RankInfo {
        RankInfo {
            coordinator: None,
            job_id: "nccl-test".to_owned(),
            generation: 1,
            rank,
            local_rank: 0,
            world_size,
            local_world_size: world_size,
            node_rank: 0,
            num_nodes: 1,
            restart_count: 0,
            host: "localhost".to_owned(),
            agent_socket: None,
        }
    }

    fn rank_failed(rank: u32) -> pb::BarrierError {
        pb::BarrierError {
            kind: pb::barrier_error::Kind::RankFailed as i32,
            message: format!("exited with status 9 (simulated for rank {rank})"),
            rank,
            node_rank: 0,
            host: "peer-host".to_owned(),
            missing: Vec::new(),
        }
    }

    fn fire_after(watch: &FailureWatch, delay: Duration, rank: u32) -> thread::JoinHandle<()> {
        let watch = watch.clone();
        thread::spawn(move || {
            thread::sleep(delay);
            watch.fire(rank_failed(rank));
        })
    }

    #[test]
    fn probing_never_panics_and_gives_the_same_answer() {
        let first = available();
        assert_eq!(first, available());
        if let Err(reason) = &first {
            assert!(!reason.is_empty());
            println!("nccl unavailable: {reason}");
            // Without NCCL, the constructors fail with the same reason instead of panicking.
            let error = new_unique_id().unwrap_err();
            assert!(error.to_string().contains(reason.as_str()), "{error}");
            let error = NcclBackend::new(&info(0, 1), [0; NCCL_UNIQUE_ID_BYTES]).unwrap_err();
            assert!(
                matches!(
                    error,
                    Error::Backend {
                        backend: "nccl",
                        ..
                    }
                ),
                "{error}"
            );
        }
    }

    #[test]
    fn integer_means_truncate_toward_zero() {
        let mut buf: Vec<u8> = [7i32, -7, 9, 0]
            .iter()
            .flat_map(|v| v.to_ne_bytes())
            .collect();
        divide_integers(&mut buf, DType::I32, 2);
        let got: Vec<i32> = buf
            .chunks_exact(4)
            .map(|c| i32::from_ne_bytes([c[0], c[1], c[2], c[3]]))
            .collect();
        assert_eq!(got, [3, -3, 4, 0]);

        let mut buf: Vec<u8> = [-10i64, 11].iter().flat_map(|v| v.to_ne_bytes()).collect();
        divide_integers(&mut buf, DType::I64, 3);
        assert_eq!(&buf[..8], &(-3i64).to_ne_bytes());
        assert_eq!(&buf[8..], &3i64.to_ne_bytes());

        let mut buf = vec![255u8, 4];
        divide_integers(&mut buf, DType::U8, 4);
        assert_eq!(buf, [63, 1]);
    }

    #[test]
    fn averages_use_ncclavg_only_for_floats() {
        for dtype in [DType::F32, DType::F64, DType::F16, DType::BF16] {
            assert_eq!(
                nccl_op(dtype, ReduceOp::Avg),
                (sys::ncclRedOp_t::ncclAvg, false)
            );
        }
        for dtype in [DType::I32, DType::I64, DType::U8] {
            assert_eq!(
                nccl_op(dtype, ReduceOp::Avg),
                (sys::ncclRedOp_t::ncclSum, true)
            );
            assert_eq!(
                nccl_op(dtype, ReduceOp::Max),
                (sys::ncclRedOp_t::ncclMax, false)
            );
        }
        assert_eq!(nccl_type(DType::BF16), sys::ncclDataType_t::ncclBfloat16);
        assert_eq!(nccl_type(DType::F16), sys::ncclDataType_t::ncclFloat16);
        assert_eq!(nccl_type(DType::U8), sys::ncclDataType_t::ncclUint8);
        assert_eq!(version_name(22_105), "2.21.5");
        assert_eq!(version_name(2_804), "2.8.4");
    }

    #[test]
    fn a_peer_reported_failed_names_the_rank_and_the_operation() {
        let failure = Error::RankFailed {
            rank: 3,
            node_rank: 1,
            host: "b".to_owned(),
            reason: "rank 3 (node 1, host b) of job 'j' generation 2 failed: killed".to_owned(),
        };
        let error = peer_lost(failure, "all_reduce of 4096 f32");
        assert!(
            matches!(&error, Error::PeerLost { rank: 3, node_rank: 1, host, op, .. }
                if host == "b" && op == "all_reduce of 4096 f32"),
            "{error:?}"
        );
        let text = error.to_string();
        assert!(
            text.starts_with("rank 3 (node 1, host b) was lost during all_reduce of 4096 f32"),
            "{text}"
        );
        assert!(
            text.contains("killed") && text.contains("aborted"),
            "{text}"
        );
    }

    /// Sample values of each type (small integers, exact in every type).
    fn sample(dtype: DType, n: usize, seed: usize) -> Vec<u8> {
        (0..n)
            .flat_map(|i| {
                let v = ((i * 7 + seed * 3) % 13) as i32 - 4;
                match dtype {
                    DType::F32 => (v as f32).to_ne_bytes().to_vec(),
                    DType::F64 => f64::from(v).to_ne_bytes().to_vec(),
                    DType::F16 => half::f16::from_f32(v as f32).to_ne_bytes().to_vec(),
                    DType::BF16 => half::bf16::from_f32(v as f32).to_ne_bytes().to_vec(),
                    DType::I32 => v.to_ne_bytes().to_vec(),
                    DType::I64 => i64::from(v).to_ne_bytes().to_vec(),
                    DType::U8 => vec![v.unsigned_abs() as u8],
                }
            })
            .collect()
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
    const OPS: [ReduceOp; 5] = [
        ReduceOp::Sum,
        ReduceOp::Avg,
        ReduceOp::Min,
        ReduceOp::Max,
        ReduceOp::Product,
    ];

    /// World size 1: every reduction is the identity, a gather is a copy. Checks the dtype and
    /// op mapping, the buffer handling (sizes that grow, odd lengths) and the poll loop against
    /// a real GPU.
    #[test]
    fn every_operation_and_type_on_one_rank() {
        if let Some(reason) = skip() {
            println!("skipped: {reason}");
            return;
        }
        let id = new_unique_id().unwrap();
        let mut nccl = NcclBackend::new(&info(0, 1), id).unwrap();
        for dtype in DTYPES {
            for n in [1, 3, 1000, 70_001] {
                let input = sample(dtype, n, n);
                for op in OPS {
                    let mut buf = input.clone();
                    nccl.all_reduce(&mut buf, dtype, op).unwrap();
                    assert_eq!(buf, input, "all_reduce {op:?} of {n} {dtype}");
                    let mut buf = input.clone();
                    nccl.reduce(&mut buf, dtype, op, 0).unwrap();
                    assert_eq!(buf, input, "reduce {op:?} of {n} {dtype}");
                    let mut recv = vec![0xAA; input.len()];
                    nccl.reduce_scatter(&input, &mut recv, dtype, op).unwrap();
                    assert_eq!(recv, input, "reduce_scatter {op:?} of {n} {dtype}");
                }
                let mut buf = input.clone();
                nccl.broadcast(&mut buf, 0).unwrap();
                assert_eq!(buf, input, "broadcast of {n} {dtype}");
                let mut recv = vec![0x55; input.len()];
                nccl.all_gather(&input, &mut recv).unwrap();
                assert_eq!(recv, input, "all_gather of {n} {dtype}");
            }
        }
        // Empty buffers are no-ops; bad arguments are refused without breaking the
        // communicator.
        nccl.all_reduce(&mut [], DType::F32, ReduceOp::Sum).unwrap();
        assert!(nccl.broadcast(&mut [1, 2], 1).is_err());
        assert!(nccl.send(&[1, 2], 0).is_err());
        assert!(
            nccl.all_reduce(&mut [1, 2, 3], DType::F32, ReduceOp::Sum)
                .is_err()
        );
        let mut buf = sample(DType::F32, 8, 1);
        nccl.all_reduce(&mut buf, DType::F32, ReduceOp::Sum)
            .unwrap();
    }

    /// Rank 1 of a 2-rank communicator never joins and is then reported failed: rank 0's join
    /// (a non-blocking `ncclCommInitRankConfig` waiting for rank 1) is aborted and names it.
    #[test]
    fn a_join_waiting_for_a_dead_peer_is_aborted() {
        if let Some(reason) = skip() {
            println!("skipped: {reason}");
            return;
        }
        let watch = FailureWatch::default();
        let firing = fire_after(&watch, Duration::from_millis(500), 1);
        let started = Instant::now();
        let error = NcclBackend::with_failure_watch(&info(0, 2), new_unique_id().unwrap(), watch)
            .unwrap_err();
        firing.join().unwrap();
        assert!(
            started.elapsed() < Duration::from_secs(30),
            "{:?}",
            started.elapsed()
        );
        assert!(
            matches!(&error, Error::PeerLost { rank: 1, host, op, .. }
                if host == "peer-host" && op.starts_with("joining the NCCL communicator")),
            "{error:?}"
        );
    }

    /// A collective that cannot finish (simulated: the test hook keeps it looking unfinished,
    /// as a collective whose peer died would be) is aborted when the coordinator reports the
    /// failure, names the dead rank, and every later operation fails at once.
    #[test]
    fn a_hung_collective_is_aborted_when_a_peer_is_reported_failed() {
        if let Some(reason) = skip() {
            println!("skipped: {reason}");
            return;
        }
        let watch = FailureWatch::default();
        let mut nccl =
            NcclBackend::with_failure_watch(&info(0, 1), new_unique_id().unwrap(), watch.clone())
                .unwrap();
        let mut buf = sample(DType::F32, 1024, 0);
        nccl.all_reduce(&mut buf, DType::F32, ReduceOp::Sum)
            .unwrap();

        nccl.stall = Arc::new(AtomicBool::new(true));
        let firing = fire_after(&watch, Duration::from_millis(300), 7);
        let error = nccl
            .all_reduce(&mut buf, DType::F32, ReduceOp::Sum)
            .unwrap_err();
        firing.join().unwrap();
        assert!(
            matches!(&error, Error::PeerLost { rank: 7, op, .. } if op == "all_reduce of 1024 f32"),
            "{error:?}"
        );
        assert!(nccl.comm.is_none(), "the communicator was not aborted");

        nccl.stall.store(false, Ordering::SeqCst);
        let later = nccl.broadcast(&mut buf, 0).unwrap_err();
        assert!(
            later
                .to_string()
                .contains("aborted after an earlier failure"),
            "{later}"
        );
    }
}
