//! The raw NCCL communicator ([`RawComm`]): every FFI call, each in the smallest
//! `#[allow(unsafe_code)]` item with its SAFETY argument, so the rest of the backend is safe code.

use std::{
    ffi::{CStr, c_char, c_int, c_void},
    ptr,
};

use cudarc::{
    driver::{CudaSlice, CudaStream, DevicePtr, DevicePtrMut},
    nccl::sys::{self, ncclResult_t},
};

use crate::NCCL_UNIQUE_ID_BYTES;
use crate::comm::DType;

use super::{CONFIG_MAGIC, CONFIG_UNDEF, CONFIG_VERSION, library, types::nccl_type};

/// An NCCL communicator handle. Dropping it aborts the communicator (`ncclCommAbort`), which
/// is valid in every state of a non-blocking communicator (an unfinished init, hung
/// operations) and never waits for peers; a healthy communicator has no work in flight when it
/// is dropped (every operation is waited for), so aborting it is as clean as destroying it
/// without `ncclCommDestroy`'s risk of waiting on a dead peer.
pub(super) struct RawComm(sys::ncclComm_t);

// SAFETY: an NCCL communicator may be used from any thread as long as calls on it do not
// overlap. A `RawComm` has one owner (an `NcclBackend`, whose operations take `&mut self`)
// and is not `Sync`, so calls on it never overlap.
#[allow(unsafe_code)]
unsafe impl Send for RawComm {}

/// One operation on device buffers. Lengths are in elements of the operation's data type;
/// every variant is checked against the buffers' sizes before NCCL sees a pointer.
pub(super) enum Call<'a> {
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
    /// Starts joining the communicator of unique ids `ids` (one per bootstrap root, in root
    /// order) as `rank` of `world_size` on the CUDA device current on this thread: with one id
    /// through `ncclCommInitRankConfig`, with several through `ncclCommInitRankScalable`
    /// (`Err` when the library predates it). The join finishes in the background: poll
    /// [`RawComm::state`].
    #[allow(unsafe_code)]
    pub(super) fn start_init(
        world_size: c_int,
        ids: &[[u8; NCCL_UNIQUE_ID_BYTES]],
        rank: c_int,
    ) -> Result<(Option<Self>, ncclResult_t), String> {
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
        let mut ids: Vec<sys::ncclUniqueId> = ids
            .iter()
            .map(|id| sys::ncclUniqueId {
                internal: id.map(|byte| byte as c_char),
            })
            .collect();
        let mut comm: sys::ncclComm_t = ptr::null_mut();
        let result = match ids.as_mut_slice() {
            [] => return Err("no unique id to join with".to_owned()),
            // SAFETY: `comm` and `config` are valid for the whole call; NCCL copies the config
            // (at most `size` bytes, clamped to the struct it knows) and the id before
            // returning, and keeps no pointer to either. `world_size` and `rank` were checked
            // by the caller.
            [id] => unsafe {
                library::ncclCommInitRankConfig(&mut comm, world_size, *id, rank, &mut config)
            },
            several => {
                let Some(init) = library::ncclCommInitRankScalable() else {
                    return Err(format!(
                        "the coordinator planned {} bootstrap roots, but this NCCL has no \
                         ncclCommInitRankScalable (NCCL 2.23 or newer): upgrade NCCL, or run \
                         the coordinator with --nccl-ranks-per-root 0",
                        several.len()
                    ));
                };
                let count = c_int::try_from(several.len()).unwrap_or(c_int::MAX);
                // SAFETY: as above; `several` holds `count` ids, which NCCL copies before
                // returning.
                unsafe {
                    init(
                        &mut comm,
                        world_size,
                        rank,
                        count,
                        several.as_mut_ptr(),
                        &mut config,
                    )
                }
            }
        };
        let comm = (!comm.is_null()).then_some(Self(comm));
        Ok((comm, result))
    }

    /// The communicator's state: `ncclInProgress` while an init or an enqueue is still under
    /// way, `ncclSuccess` when it is idle or its work is on the stream, or the error that broke
    /// it (a peer's connection reset, ...).
    #[allow(unsafe_code)]
    pub(super) fn state(&self) -> ncclResult_t {
        let mut state = ncclResult_t::ncclSuccess;
        // SAFETY: `self.0` is a live communicator (only `Drop` releases it) and `state` is
        // valid for writes.
        let result = unsafe { library::ncclCommGetAsyncError(self.0, &mut state) };
        if result == ncclResult_t::ncclSuccess {
            state
        } else {
            result
        }
    }

    /// NCCL's description of the last error on this communicator ("" when it has none).
    #[allow(unsafe_code)]
    pub(super) fn last_error(&self) -> String {
        // SAFETY: `self.0` is a live communicator. NCCL returns null or a NUL-terminated
        // string it owns, valid until its next call; it is copied at once.
        unsafe {
            let message = library::ncclGetLastError(self.0);
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
    pub(super) fn enqueue(&self, stream: &CudaStream, call: Call<'_>) -> ncclResult_t {
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
                    library::ncclAllReduce(
                        ptr,
                        ptr,
                        count,
                        nccl_type(dtype),
                        op,
                        self.0,
                        raw_stream,
                    )
                }
            }
            Call::Broadcast { buf, bytes, root } => {
                if bytes > buf.len() {
                    return invalid;
                }
                let (ptr, _guard) = buf.device_ptr_mut(stream);
                let ptr = ptr as *mut c_void;
                unsafe {
                    library::ncclBroadcast(
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
                    library::ncclReduce(
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
                    library::ncclAllGather(
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
                    library::ncclReduceScatter(
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
                    library::ncclSend(
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
                    library::ncclRecv(
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
        let result = unsafe { library::ncclCommAbort(self.0) };
        if !matches!(
            result,
            ncclResult_t::ncclSuccess | ncclResult_t::ncclInProgress
        ) {
            tracing::warn!(?result, "ncclCommAbort failed");
        }
    }
}
