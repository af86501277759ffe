//! The NCCL backend of the communicator: host buffers are copied into reusable device buffers,
//! the collective runs on a private CUDA stream, and the calling thread polls for completion
//! while it watches the coordinator's failure reports, so that a dead peer aborts the NCCL
//! communicator (`ncclCommAbort`) and the caller gets [`Error::PeerLost`] naming that peer
//! instead of hanging in a kernel.
//!
//! Nothing here touches libcuda or libnccl until [`available`], [`new_unique_id`], [`connect`]
//! or [`NcclBackend::new`] is called: cudarc loads libcuda at run time (`dynamic-loading`), and
//! [`available`] checks that it can be loaded before calling into it, because cudarc panics
//! when a library or symbol is missing. libnccl is loaded by `nccl/library.rs`, which also
//! finds the runtime packages' `libnccl.so.2` (cudarc looks only for `libnccl.so`).
//!
//! The communicator is non-blocking (`ncclConfig_t.blocking = 0`): initialisation and every
//! enqueue return at once (possibly with `ncclInProgress`), which is what lets a rank stop
//! waiting for a peer that never arrives. cudarc's safe `Comm` does not fit: it blocks in
//! `ncclCommInitRank`, exposes neither its raw handle nor `ncclCommGetAsyncError`, is not
//! `Send`, panics in `Drop` when the abort fails, and types f16/bf16 only under a cudarc feature
//! this workspace does not enable. The raw calls therefore live in `RawComm` (`nccl/raw.rs`),
//! each in the smallest `#[allow(unsafe_code)]` item with its SAFETY argument; everything else
//! is safe code.

use std::{
    collections::BTreeMap,
    ffi::c_int,
    panic,
    sync::{Mutex, OnceLock, PoisonError},
    time::Duration,
};

use cudarc::{
    driver::CudaContext,
    nccl::sys::{self},
};

use crate::{Accelerator, Error, NCCL_UNIQUE_ID_BYTES};

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
    // SAFETY: only tries `dlopen` on libcuda's usual names and closes it again; loading runs
    // the library's initialisers, which is exactly what cudarc does on the first CUDA call.
    #[allow(unsafe_code)]
    let cuda = unsafe { cudarc::driver::sys::is_culib_present() };
    if !cuda {
        return Err(
            "the CUDA driver library (libcuda.so) cannot be loaded: no NVIDIA driver \
                    on this machine, or it is not on the library path"
                .to_owned(),
        );
    }
    library::load()?;
    cudarc::driver::result::init()
        .map_err(|e| format!("the CUDA driver did not initialise: {e}"))?;
    let devices =
        CudaContext::device_count().map_err(|e| format!("counting CUDA devices failed: {e}"))?;
    if devices < 1 {
        return Err("no CUDA device is visible (check CUDA_VISIBLE_DEVICES)".to_owned());
    }
    let mut version: c_int = 0;
    // SAFETY: `version` is valid for the write ncclGetVersion makes.
    #[allow(unsafe_code)]
    let result = unsafe { library::ncclGetVersion(&mut version) };
    if result != sys::ncclResult_t::ncclSuccess {
        return Err(format!("ncclGetVersion failed: {result:?}"));
    }
    if version < MIN_NCCL_VERSION {
        return Err(format!(
            "NCCL {} is too old: the nccl backend needs 2.14 or newer (non-blocking \
             communicators, so that a dead peer aborts the communicator instead of hanging it)",
            version_name(version)
        ));
    }
    Ok(())
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
pub(crate) fn new_unique_id() -> Result<[u8; NCCL_UNIQUE_ID_BYTES], Error> {
    available().map_err(backend_error)?;
    let mut id = sys::ncclUniqueId {
        internal: [0; NCCL_UNIQUE_ID_BYTES],
    };
    // SAFETY: `id` is valid for the write ncclGetUniqueId makes.
    #[allow(unsafe_code)]
    let result = unsafe { library::ncclGetUniqueId(&mut id) };
    if result != sys::ncclResult_t::ncclSuccess {
        return Err(backend_error(format!("ncclGetUniqueId failed: {result:?}")));
    }
    Ok(id.internal.map(|byte| byte as u8))
}

/// Creates the NCCL communicator of `accelerator`'s generation: its bootstrap roots (rank 0
/// alone up to the coordinator's `nccl_ranks_per_root`, one per that many ranks above) make
/// the unique ids and publish them through the coordinator's generation-fenced unique-id
/// service, the other ranks fetch them, and every rank joins on CUDA device `local_rank`. Failures the coordinator reports
/// (for example a rank that dies before it joins) abort the communicator, here and in every
/// later operation.
///
/// Every rank must create its NCCL communicators in the same order: the n-th one of each rank
/// shares the id published under `muster.comm.nccl.<n>` (counted per job, generation and rank,
/// so that ranks run as threads of one process, as tests do, count independently). Returns the
/// backend and its number `n`, which [`connect_at`] takes to rebuild it.
pub(crate) fn connect(accelerator: &Accelerator) -> Result<(NcclBackend, u64), Error> {
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
    Ok((connect_at(accelerator, index, accelerator.epoch())?, index))
}

/// Creates NCCL communicator number `index` for membership `epoch` (in-place recovery: the old
/// communicator was aborted): the unique id is published under `muster.comm.nccl.<index>` for
/// epoch 0 and `muster.comm.nccl.<index>.e<epoch>` after, so every membership gets a fresh id,
/// and the backend aborts when the membership changes past `epoch`. Untested without a GPU.
pub(crate) fn connect_at(
    accelerator: &Accelerator,
    index: u64,
    epoch: u64,
) -> Result<NcclBackend, Error> {
    available().map_err(backend_error)?;
    let info = accelerator.info();
    let name = if epoch == 0 {
        format!("muster.comm.nccl.{index}")
    } else {
        format!("muster.comm.nccl.{index}.e{epoch}")
    };
    let ids = accelerator.nccl_unique_ids(&name, new_unique_id)?;
    NcclBackend::with_failure_watch(info, &ids, accelerator.failure_watch_at(epoch))
}

fn backend_error(message: impl Into<String>) -> Error {
    Error::Backend {
        backend: BACKEND,
        message: message.into(),
    }
}

mod backend;
mod library;
mod raw;
mod types;

pub(crate) use backend::NcclBackend;

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use std::{
        sync::atomic::{AtomicBool, Ordering},
        thread,
        time::Instant,
    };

    use muster_proto::v1 as pb;

    use super::backend::peer_lost;
    use super::*;
    use crate::{
        RankInfo,
        client::FailureWatch,
        comm::{Backend, DType, ReduceOp},
    };
    use std::sync::Arc;

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
        let error =
            NcclBackend::with_failure_watch(&info(0, 2), &[new_unique_id().unwrap()], watch)
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
        let mut nccl = NcclBackend::with_failure_watch(
            &info(0, 1),
            &[new_unique_id().unwrap()],
            watch.clone(),
        )
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
