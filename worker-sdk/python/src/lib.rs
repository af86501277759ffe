//! `muster._native`: the Rust worker SDK (`muster`) for Python, wrapped with PyO3. The
//! pure-Python layer (`python/muster/`) gives it Accelerate's names; everything that talks to
//! the agent or the coordinator is here, in the same Rust every Rust worker runs.
//!
//! Waits release the GIL and run in place. On the process's main thread a wait checks for
//! signals every 50 ms (`muster::interrupt`; a barrier reads the relay and checks between
//! reads), so Ctrl-C interrupts it; other threads, and single-process mode, just wait. A
//! forked child (a DataLoader worker) gets a clear error instead of the deadlock that the
//! parent's runtime threads, absent after `fork`, would cause.

use std::cell::RefCell;
use std::sync::{Arc, Mutex, OnceLock, PoisonError};
use std::time::Duration;

use muster::comm::{BackendKind, Communicator, DType, Element, ReduceOp};
use muster::env::RecoveryEnv;
use muster::membership::Quorum;
use muster::{Error, NCCL_UNIQUE_ID_BYTES, RankInfo, Recovery, Scope};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict, PyList, PyTuple};

mod process;
use process::{Owner, on_main_thread};

/// The Python module holding the exception classes (`muster.errors`).
const ERRORS_MODULE: &str = "muster.errors";

/// This process's place in the job and its connection to the agent and the coordinator.
#[pyclass(frozen, module = "muster._native")]
struct Native {
    /// `None` once closed.
    inner: Mutex<Option<Arc<muster::Accelerator>>>,
    /// The process that created it: a forked child must not use its runtime.
    owner: Owner,
    info: RankInfo,
}

impl Native {
    /// The accelerator, or why it cannot be used from here.
    fn get(&self, py: Python<'_>) -> PyResult<Arc<muster::Accelerator>> {
        if !self.owner.is_current() {
            return Err(error(
                py,
                "MusterError",
                &format!(
                    "this muster Accelerator belongs to process {} and cannot be used in its \
                     forked child {} (a DataLoader worker, multiprocessing with fork): the \
                     connection to the agent lives in threads that fork does not copy; use it \
                     from the training process only",
                    self.owner.pid,
                    std::process::id()
                ),
                None,
            ));
        }
        self.inner
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
            .ok_or_else(|| {
                error(
                    py,
                    "MusterError",
                    "this muster Accelerator was closed (after end_training or at exit)",
                    None,
                )
            })
    }

    /// Runs a blocking SDK call without the GIL, in place. On the main thread the call looks
    /// for a pending signal every 50 ms while it waits (`muster::interrupt`), so Ctrl-C
    /// interrupts it: the call is given up and the signal's exception (KeyboardInterrupt)
    /// raised. Single-process mode never blocks (its store and barriers are this process's
    /// own).
    fn wait<T: Send + 'static>(
        &self,
        py: Python<'_>,
        f: impl FnOnce(&muster::Accelerator) -> Result<T, Error> + Send + 'static,
    ) -> PyResult<T> {
        let accelerator = self.get(py)?;
        if !on_main_thread() || !self.info.is_distributed() {
            return py.detach(|| f(&accelerator)).map_err(|e| to_py(py, e));
        }
        let outcome =
            py.detach(|| muster::interrupt::with_check(signal_check(), || f(&accelerator)));
        answer(py, outcome)
    }
}

thread_local! {
    /// What a signal handler raised during the main thread's wait, until the wait returns it.
    static RAISED: RefCell<Option<PyErr>> = const { RefCell::new(None) };
}

/// The main thread's interrupt check: runs the pending signals' handlers (with the GIL) and
/// says stop when one raised, keeping what it raised for [`answer`].
fn signal_check() -> muster::interrupt::Check {
    Box::new(|| match Python::attach(|py| py.check_signals()) {
        Ok(()) => false,
        Err(e) => {
            RAISED.with(|r| *r.borrow_mut() = Some(e));
            true
        }
    })
}

/// A checked wait's outcome for Python: the signal handler's exception when the check stopped
/// it, else the call's.
fn answer<T>(py: Python<'_>, outcome: Result<T, Error>) -> PyResult<T> {
    let raised = RAISED.with(|r| r.borrow_mut().take());
    match (outcome, raised) {
        (Err(Error::Interrupted { .. }), Some(e)) => Err(e),
        (outcome, _) => outcome.map_err(|e| to_py(py, e)),
    }
}

/// The barrier scope a Python call asks for: this node's ranks, or every rank.
fn scope(node: bool) -> Scope {
    if node { Scope::Node } else { Scope::Global }
}

#[pymethods]
impl Native {
    /// From the launcher's environment (`MUSTER_*`, set by `muster-agent launch`); without it,
    /// a world of one process, as Accelerate has without `accelerate launch`.
    #[new]
    fn new(py: Python<'_>) -> PyResult<Self> {
        let info = RankInfo::from_env().map_err(|e| to_py(py, e))?;
        let accelerator = py
            .detach(|| muster::Accelerator::new(info.clone()))
            .map_err(|e| to_py(py, e))?;
        Ok(Self {
            inner: Mutex::new(Some(Arc::new(accelerator))),
            owner: Owner::current(),
            info,
        })
    }

    /// The rank's place: a dict of `job_id`, `generation`, `rank`, `local_rank`,
    /// `world_size`, `local_world_size`, `node_rank`, `num_nodes`, `restart_count`, `host`,
    /// `distributed`.
    fn info<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let i = &self.info;
        let d = PyDict::new(py);
        d.set_item("job_id", &i.job_id)?;
        d.set_item("generation", i.generation)?;
        d.set_item("rank", i.rank)?;
        d.set_item("local_rank", i.local_rank)?;
        d.set_item("world_size", i.world_size)?;
        d.set_item("local_world_size", i.local_world_size)?;
        d.set_item("node_rank", i.node_rank)?;
        d.set_item("num_nodes", i.num_nodes)?;
        d.set_item("restart_count", i.restart_count)?;
        d.set_item("host", &i.host)?;
        d.set_item("distributed", i.coordinator.is_some())?;
        Ok(d)
    }

    /// A barrier of every rank (`node=False`) or of this node's ranks, under `name` (the
    /// caller's `file:line`); `timeout` in seconds, or None to wait for as long as it takes.
    #[pyo3(signature = (name, node=false, timeout=None))]
    fn barrier(
        &self,
        py: Python<'_>,
        name: String,
        node: bool,
        timeout: Option<f64>,
    ) -> PyResult<()> {
        let timeout = timeout
            .map(seconds)
            .transpose()
            .map_err(PyValueError::new_err)?;
        self.wait(py, move |a| a.barrier_named(scope(node), &name, timeout))
    }

    /// Publishes `value` (already encoded) from the process that computed it.
    #[pyo3(signature = (call_site, value, node=false))]
    fn share_publish(
        &self,
        py: Python<'_>,
        call_site: String,
        value: Vec<u8>,
        node: bool,
    ) -> PyResult<()> {
        self.wait(py, move |a| a.share_publish(scope(node), &call_site, value))
    }

    /// Waits for the value published from `call_site` and returns its bytes.
    #[pyo3(signature = (call_site, node=false))]
    fn share_fetch<'py>(
        &self,
        py: Python<'py>,
        call_site: String,
        node: bool,
    ) -> PyResult<Bound<'py, PyBytes>> {
        let bytes = self.wait(py, move |a| a.share_fetch(scope(node), &call_site))?;
        Ok(PyBytes::new(py, &bytes))
    }

    /// Publishes the NCCL unique id (128 bytes) of `communicator` for this generation.
    fn publish_unique_id(&self, py: Python<'_>, communicator: String, id: Vec<u8>) -> PyResult<()> {
        let id: [u8; NCCL_UNIQUE_ID_BYTES] = id.try_into().map_err(|id: Vec<u8>| {
            PyValueError::new_err(format!(
                "an NCCL unique id is {NCCL_UNIQUE_ID_BYTES} bytes, not {}",
                id.len()
            ))
        })?;
        self.wait(py, move |a| a.publish_nccl_unique_id(&communicator, &id))
    }

    /// Waits for the NCCL unique id of `communicator`.
    fn fetch_unique_id<'py>(
        &self,
        py: Python<'py>,
        communicator: String,
    ) -> PyResult<Bound<'py, PyBytes>> {
        let id = self.wait(py, move |a| a.fetch_nccl_unique_id(&communicator))?;
        Ok(PyBytes::new(py, &id))
    }

    /// Sets `key` to `value`.
    fn kv_set(&self, py: Python<'_>, key: String, value: Vec<u8>) -> PyResult<()> {
        self.wait(py, move |a| a.kv().set(&key, value))
    }

    /// The value of `key`, or None.
    fn kv_get<'py>(&self, py: Python<'py>, key: String) -> PyResult<Option<Bound<'py, PyBytes>>> {
        let value = self.wait(py, move |a| a.kv().get(&key))?;
        Ok(value.map(|v| PyBytes::new(py, &v)))
    }

    /// The value of `key`, waiting up to `timeout` seconds for it to be set.
    fn kv_wait<'py>(
        &self,
        py: Python<'py>,
        key: String,
        timeout: f64,
    ) -> PyResult<Bound<'py, PyBytes>> {
        let wait = seconds(timeout).map_err(PyValueError::new_err)?;
        let value = self.wait(py, move |a| a.kv().get_wait(&key, wait))?;
        Ok(PyBytes::new(py, &value))
    }

    /// The values of `keys`, in their order, waiting up to `timeout` seconds for each to be
    /// set: one concurrent batch of gets (torch's `multi_get`).
    fn kv_wait_many<'py>(
        &self,
        py: Python<'py>,
        keys: Vec<String>,
        timeout: f64,
    ) -> PyResult<Bound<'py, PyList>> {
        let wait = seconds(timeout).map_err(PyValueError::new_err)?;
        let values = self.wait(py, move |a| a.kv().get_wait_many(&keys, wait))?;
        PyList::new(py, values.iter().map(|v| PyBytes::new(py, v)))
    }

    /// Adds `delta` to the integer at `key` (0 when unset); returns the new value.
    fn kv_add(&self, py: Python<'_>, key: String, delta: i64) -> PyResult<i64> {
        self.wait(py, move |a| a.kv().add(&key, delta))
    }

    /// Replaces `key`'s value with `desired` if it is `expected` (None: unset); returns
    /// `(swapped, current)`.
    fn kv_compare_set<'py>(
        &self,
        py: Python<'py>,
        key: String,
        expected: Option<Vec<u8>>,
        desired: Vec<u8>,
    ) -> PyResult<(bool, Option<Bound<'py, PyBytes>>)> {
        let outcome = self.wait(py, move |a| {
            a.kv().compare_and_set(&key, expected.as_deref(), desired)
        })?;
        Ok((
            outcome.swapped,
            outcome.current.map(|v| PyBytes::new(py, &v)),
        ))
    }

    /// Deletes `key`; whether it existed.
    fn kv_delete(&self, py: Python<'_>, key: String) -> PyResult<bool> {
        self.wait(py, move |a| a.kv().delete(&key))
    }

    /// Every `(key, value)` whose key starts with `prefix`.
    fn kv_list<'py>(&self, py: Python<'py>, prefix: String) -> PyResult<Bound<'py, PyList>> {
        let pairs = self.wait(py, move |a| a.kv().list(&prefix))?;
        let items = pairs
            .into_iter()
            .map(|(k, v)| {
                PyTuple::new(
                    py,
                    [
                        k.into_pyobject(py)?.into_any(),
                        PyBytes::new(py, &v).into_any(),
                    ],
                )
            })
            .collect::<PyResult<Vec<_>>>()?;
        PyList::new(py, items)
    }

    /// The job's recovery mode: `"restart"` or `"in-place"` (`MUSTER_RECOVERY`).
    fn recovery(&self, py: Python<'_>) -> PyResult<&'static str> {
        Ok(self.get(py)?.recovery().as_str())
    }

    /// Whether this process replaces a rank that died in place (`MUSTER_EPOCH` > 0): it asks
    /// `quorum(None)` before anything else and is healed.
    fn is_replacement(&self, py: Python<'_>) -> PyResult<bool> {
        Ok(self.get(py)?.is_replacement())
    }

    /// The membership epoch of the last quorum this process took part in.
    fn epoch(&self, py: Python<'_>) -> PyResult<u64> {
        Ok(self.get(py)?.epoch())
    }

    /// The per-step check: whether the coordinator pushed a membership change this process has
    /// not taken part in a quorum for (atomic loads, no coordinator call, the GIL kept).
    fn membership_changed(&self, py: Python<'_>) -> PyResult<bool> {
        Ok(self.get(py)?.membership().changed())
    }

    /// Marks the start of training step `step` for the job's effective training time (rank
    /// 0's markers go to the coordinator on its session; no wait, the GIL kept).
    fn begin_step(&self, py: Python<'_>, step: u64) -> PyResult<()> {
        self.get(py)?.begin_step(step);
        Ok(())
    }

    /// Says that this rank finished healing for the quorum of `epoch` (the recovery's
    /// timeline; no wait, the GIL kept).
    fn healed(&self, py: Python<'_>, epoch: u64) -> PyResult<()> {
        self.get(py)?.healed(epoch);
        Ok(())
    }

    /// Agrees on the new membership with every other rank (blocks until the quorum forms);
    /// `step`: the steps this rank committed, None for a replacement with no state.
    #[pyo3(signature = (step=None))]
    fn quorum(&self, py: Python<'_>, step: Option<u64>) -> PyResult<PyQuorum> {
        let quorum = self.wait(py, move |a| a.membership().quorum(step))?;
        Ok(PyQuorum { inner: quorum })
    }

    /// Ends this process's part in the job cleanly: ranks still waiting on it get a clear
    /// error. Later calls raise; calling it twice does nothing.
    fn close(&self, py: Python<'_>) -> PyResult<()> {
        if !self.owner.is_current() {
            // A forked child owns nothing of the parent's connection.
            return Ok(());
        }
        let taken = self
            .inner
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take();
        if let Some(accelerator) = taken {
            // Dropping the last reference sends `leave` (a wait still running on another thread
            // holds another, and leaves when it ends).
            py.detach(move || drop(accelerator));
        }
        Ok(())
    }
}

/// The membership every rank agreed on after a rank died (`Accelerator.quorum`): the epoch
/// communicators and process groups are rebuilt for, the step every rank continues from, and
/// which ranks heal from which.
#[pyclass(frozen, name = "Quorum", module = "muster._native")]
struct PyQuorum {
    inner: Quorum,
}

#[pymethods]
impl PyQuorum {
    /// The quorum's id: every rank's communicator for it is built under this epoch.
    #[getter]
    fn epoch(&self) -> u64 {
        self.inner.epoch
    }

    /// Ranks in the job (unchanged by an in-place recovery).
    #[getter]
    fn world_size(&self) -> u32 {
        self.inner.world_size
    }

    /// The step every rank continues from (the highest any member committed), or None when
    /// no member had state.
    #[getter]
    fn step(&self) -> Option<u64> {
        self.inner.step
    }

    /// `(rank, source)` pairs: each rank whose state is behind and the rank it heals from.
    #[getter]
    fn heal(&self) -> Vec<(u32, u32)> {
        self.inner.heal.iter().map(|h| (h.rank, h.source)).collect()
    }

    /// `(rank, node, host)` of every rank, by rank (empty when the coordinator does not say).
    #[getter]
    fn members(&self) -> Vec<(u32, u32, String)> {
        self.inner
            .members
            .iter()
            .map(|m| (m.rank, m.node_rank, m.host.clone()))
            .collect()
    }

    /// The rank `rank` heals from, or None when it is not healed.
    fn source_of(&self, rank: u32) -> Option<u32> {
        self.inner.source_of(rank)
    }

    /// The ranks `rank` sends its state to, in rank order.
    fn healed_by(&self, rank: u32) -> Vec<u32> {
        self.inner.healed_by(rank)
    }

    fn __repr__(&self) -> String {
        let q = &self.inner;
        format!(
            "Quorum(epoch={}, world_size={}, step={}, heal={:?})",
            q.epoch,
            q.world_size,
            q.step.map_or_else(|| "None".to_owned(), |s| s.to_string()),
            self.heal()
        )
    }
}

/// A buffer handed over by the Python layer (`muster.comm`): the address and length of a
/// C-contiguous CPU buffer (a numpy array, a CPU torch tensor, anything with the buffer
/// protocol) and its element type. The Python layer keeps the object alive and checks that it
/// is contiguous and (for outputs) writable before it calls.
#[derive(Clone, Copy)]
struct RawBuffer {
    addr: usize,
    bytes: usize,
}

impl RawBuffer {
    /// The buffer as a typed slice.
    ///
    /// Sound because: the Python caller holds a reference to the object that owns the memory
    /// for the whole call (the GIL is released, but the object cannot be freed while
    /// referenced), the Python layer refused non-contiguous and read-only outputs, and here the
    /// address is checked for null and alignment and the length for a whole number of elements.
    /// Two buffers of one call may overlap only where the Python layer allows it (never: it
    /// passes distinct objects, or the same one in place).
    #[allow(unsafe_code)]
    fn slice<'a, T: Element>(self, what: &str) -> Result<&'a mut [T], String> {
        let size = std::mem::size_of::<T>();
        if !self.bytes.is_multiple_of(size) {
            return Err(format!(
                "{what}: {} bytes is not a whole number of {} elements",
                self.bytes,
                T::DTYPE
            ));
        }
        if self.bytes == 0 {
            return Ok(&mut []);
        }
        if self.addr == 0 || !self.addr.is_multiple_of(std::mem::align_of::<T>()) {
            return Err(format!(
                "{what}: the buffer at {:#x} is not aligned for {}",
                self.addr,
                T::DTYPE
            ));
        }
        // SAFETY: see above: a live, contiguous, aligned allocation of `bytes` bytes.
        Ok(unsafe { std::slice::from_raw_parts_mut(self.addr as *mut T, self.bytes / size) })
    }
}

/// Calls `$body` with `$t` bound to the Rust element type of `$dtype`.
macro_rules! with_dtype {
    ($dtype:expr, $t:ident => $body:expr) => {
        match $dtype {
            DType::F32 => {
                type $t = f32;
                $body
            }
            DType::F64 => {
                type $t = f64;
                $body
            }
            DType::F16 => {
                type $t = half::f16;
                $body
            }
            DType::BF16 => {
                type $t = half::bf16;
                $body
            }
            DType::I32 => {
                type $t = i32;
                $body
            }
            DType::I64 => {
                type $t = i64;
                $body
            }
            DType::U8 => {
                type $t = u8;
                $body
            }
        }
    };
}

fn dtype(name: &str) -> PyResult<DType> {
    Ok(match name {
        "f32" => DType::F32,
        "f64" => DType::F64,
        "f16" => DType::F16,
        "bf16" => DType::BF16,
        "i32" => DType::I32,
        "i64" => DType::I64,
        "u8" => DType::U8,
        other => {
            return Err(PyValueError::new_err(format!(
                "element type '{other}' cannot be reduced or moved (use float32, float64, \
                 float16, bfloat16, int32, int64 or uint8)"
            )));
        }
    })
}

fn reduce_op(name: &str) -> PyResult<ReduceOp> {
    Ok(match name {
        "sum" => ReduceOp::Sum,
        "avg" | "mean" => ReduceOp::Avg,
        "min" => ReduceOp::Min,
        "max" => ReduceOp::Max,
        "product" | "prod" => ReduceOp::Product,
        other => {
            return Err(PyValueError::new_err(format!(
                "'{other}' is not a reduction (use sum, avg, min, max or product)"
            )));
        }
    })
}

/// The SDK's CPU communicator (shared memory within a machine, sockets across machines).
#[pyclass(frozen, module = "muster._native")]
struct Comm {
    inner: Communicator,
    owner: Owner,
}

impl Comm {
    /// Runs a collective without the GIL, in this thread (the buffers are the caller's: the
    /// call cannot be abandoned half-way, so Ctrl-C takes effect when it returns).
    fn run(
        &self,
        py: Python<'_>,
        f: impl FnOnce(&Communicator) -> Result<(), Error> + Send,
    ) -> PyResult<()> {
        if !self.owner.is_current() {
            return Err(error(
                py,
                "MusterError",
                "this communicator belongs to the process that made it, not a forked child",
                None,
            ));
        }
        py.detach(|| f(&self.inner)).map_err(|e| to_py(py, e))
    }
}

#[pymethods]
impl Comm {
    /// Connects every rank of the job (a collective call: every rank makes one).
    #[new]
    fn new(py: Python<'_>, native: &Native) -> PyResult<Self> {
        let accelerator = native.get(py)?;
        let inner = py
            .detach(|| Communicator::with_backend(&accelerator, BackendKind::Cpu))
            .map_err(|e| to_py(py, e))?;
        Ok(Self {
            inner,
            owner: Owner::current(),
        })
    }

    /// This rank and the world size.
    fn rank(&self) -> (usize, usize) {
        (self.inner.rank(), self.inner.world_size())
    }

    /// In place: every rank ends with the reduction of every rank's buffer.
    fn all_reduce(
        &self,
        py: Python<'_>,
        addr: usize,
        bytes: usize,
        dtype_name: &str,
        op: &str,
    ) -> PyResult<()> {
        let (dt, op, buf) = (
            dtype(dtype_name)?,
            reduce_op(op)?,
            RawBuffer { addr, bytes },
        );
        with_dtype!(dt, T => {
            let data = buf.slice::<T>("all_reduce").map_err(PyValueError::new_err)?;
            self.run(py, move |c| c.all_reduce(data, op))
        })
    }

    /// In place: every rank ends with `root`'s buffer.
    fn broadcast(
        &self,
        py: Python<'_>,
        addr: usize,
        bytes: usize,
        dtype_name: &str,
        root: usize,
    ) -> PyResult<()> {
        let (dt, buf) = (dtype(dtype_name)?, RawBuffer { addr, bytes });
        with_dtype!(dt, T => {
            let data = buf.slice::<T>("broadcast").map_err(PyValueError::new_err)?;
            self.run(py, move |c| c.broadcast(data, root))
        })
    }

    /// Every rank's input, concatenated in rank order, into the output.
    fn all_gather(
        &self,
        py: Python<'_>,
        input: (usize, usize),
        output: (usize, usize),
        dtype_name: &str,
    ) -> PyResult<()> {
        let dt = dtype(dtype_name)?;
        let (send, recv) = (
            RawBuffer {
                addr: input.0,
                bytes: input.1,
            },
            RawBuffer {
                addr: output.0,
                bytes: output.1,
            },
        );
        with_dtype!(dt, T => {
            let send = send.slice::<T>("all_gather input").map_err(PyValueError::new_err)?;
            let recv = recv.slice::<T>("all_gather output").map_err(PyValueError::new_err)?;
            self.run(py, move |c| c.all_gather_into(send, recv))
        })
    }

    /// Rank r's output gets the reduction of every rank's block r of the input.
    fn reduce_scatter(
        &self,
        py: Python<'_>,
        input: (usize, usize),
        output: (usize, usize),
        dtype_name: &str,
        op: &str,
    ) -> PyResult<()> {
        let (dt, op) = (dtype(dtype_name)?, reduce_op(op)?);
        let (send, recv) = (
            RawBuffer {
                addr: input.0,
                bytes: input.1,
            },
            RawBuffer {
                addr: output.0,
                bytes: output.1,
            },
        );
        with_dtype!(dt, T => {
            let send = send.slice::<T>("reduce_scatter input").map_err(PyValueError::new_err)?;
            let recv = recv.slice::<T>("reduce_scatter output").map_err(PyValueError::new_err)?;
            self.run(py, move |c| c.reduce_scatter_into(send, recv, op))
        })
    }

    /// Every rank reaches this call before any leaves it (through the communicator's links).
    fn barrier(&self, py: Python<'_>) -> PyResult<()> {
        self.run(py, |c| c.barrier())
    }

    /// The membership epoch the communicator is built for.
    fn epoch(&self) -> u64 {
        self.inner.epoch()
    }

    /// Rebuilds the communicator for `quorum`'s membership (every rank, after the same quorum).
    fn reconfigure(&self, py: Python<'_>, native: &Native, quorum: &PyQuorum) -> PyResult<()> {
        let accelerator = native.get(py)?;
        let quorum = &quorum.inner;
        self.run(py, move |c| c.reconfigure(&accelerator, quorum))
    }

    /// The heal protocol on bytes: a source sends `payload` to every rank it heals (None
    /// back), a healed rank gets its source's bytes, other ranks None at once.
    #[pyo3(signature = (quorum, payload=None))]
    fn heal_bytes<'py>(
        &self,
        py: Python<'py>,
        quorum: &PyQuorum,
        payload: Option<Vec<u8>>,
    ) -> PyResult<Option<Bound<'py, PyBytes>>> {
        if !self.owner.is_current() {
            return Err(error(
                py,
                "MusterError",
                "this communicator belongs to the process that made it, not a forked child",
                None,
            ));
        }
        let quorum = &quorum.inner;
        let received = py
            .detach(|| self.inner.heal_bytes(quorum, payload.as_deref()))
            .map_err(|e| to_py(py, e))?;
        Ok(received.map(|b| PyBytes::new(py, &b)))
    }
}

/// Seconds from Python as a duration, refusing what is not one.
fn seconds(s: f64) -> Result<Duration, String> {
    Duration::try_from_secs_f64(s).map_err(|_| format!("{s} is not a number of seconds"))
}

/// An exception of `muster.errors` by class name, with keyword attributes.
fn error(py: Python<'_>, class: &str, message: &str, attrs: Option<Bound<'_, PyDict>>) -> PyErr {
    let made = py
        .import(ERRORS_MODULE)
        .and_then(|m| m.getattr(class))
        .and_then(|cls| cls.call((message,), attrs.as_ref()));
    match made {
        Ok(instance) => PyErr::from_value(instance),
        Err(e) => e,
    }
}

/// The job's recovery mode, as the worker's environment says (read once; a malformed value
/// already failed the Accelerator, so it reads as restart here).
fn recovery_mode() -> Recovery {
    static MODE: OnceLock<Recovery> = OnceLock::new();
    *MODE.get_or_init(|| RecoveryEnv::from_env().map(|r| r.mode).unwrap_or_default())
}

/// The SDK's error as the matching `muster.errors` exception, its `recoverable` attribute set
/// as [`Error::is_recoverable`] says for the job's recovery mode.
fn to_py(py: Python<'_>, e: Error) -> PyErr {
    let recoverable = e.is_recoverable(recovery_mode());
    let made = to_py_class(py, e);
    if recoverable {
        // The classes default it to False; a failure to set it leaves the exception as made.
        let _ = made.value(py).setattr("recoverable", true);
    }
    made
}

fn to_py_class(py: Python<'_>, e: Error) -> PyErr {
    let in_place = recovery_mode() == Recovery::InPlace;
    let message = e.to_string();
    let rank_attrs = |rank: u32, node: u32, host: &str, cause: &str| -> Option<Bound<'_, PyDict>> {
        let d = PyDict::new(py);
        d.set_item("rank", rank).ok()?;
        d.set_item("node", node).ok()?;
        d.set_item("host", host).ok()?;
        d.set_item("cause", cause).ok()?;
        Some(d)
    };
    match &e {
        Error::RankFailed {
            rank,
            node_rank,
            host,
            reason,
        } => error(
            py,
            "RankFailedError",
            &message,
            rank_attrs(*rank, *node_rank, host, reason),
        ),
        Error::MembershipChanged {
            epoch,
            rank,
            node_rank,
            host,
            reason,
        } => {
            let attrs = rank_attrs(*rank, *node_rank, host, reason);
            if let Some(attrs) = &attrs
                && *epoch > 0
            {
                let _ = attrs.set_item("epoch", *epoch);
            }
            error(py, "MembershipChangedError", &message, attrs)
        }
        // In place, a lost peer is a membership change whose push has not arrived yet.
        Error::PeerLost {
            rank,
            node_rank,
            host,
            reason,
            ..
        } => error(
            py,
            if in_place {
                "MembershipChangedError"
            } else {
                "RankFailedError"
            },
            &message,
            rank_attrs(*rank, *node_rank, host, reason),
        ),
        Error::RankLeft {
            rank,
            node_rank,
            host,
            message: why,
        } => error(
            py,
            "RankLeftError",
            &message,
            rank_attrs(*rank, *node_rank, host, why),
        ),
        Error::Diverged { .. } => error(py, "DivergedError", &message, None),
        Error::Timeout { missing, .. } => {
            let attrs = PyDict::new(py);
            let missing: Vec<(u32, u32, String)> = missing
                .iter()
                .map(|m| (m.rank, m.node_rank, m.host.clone()))
                .collect();
            match attrs.set_item("missing", missing) {
                Ok(()) => error(py, "WaitTimeoutError", &message, Some(attrs)),
                Err(e) => e,
            }
        }
        Error::StaleGeneration { .. } => error(py, "StaleGenerationError", &message, None),
        Error::Cancelled { .. } => error(py, "JobCancelledError", &message, None),
        Error::Connection { .. } => error(py, "CoordinatorConnectionError", &message, None),
        Error::Unauthorized { .. } => error(py, "UnauthorizedError", &message, None),
        Error::Config(_) => error(py, "ConfigError", &message, None),
        Error::NotFound { .. } => error(py, "NotFoundError", &message, None),
        _ => error(py, "MusterError", &message, None),
    }
}

/// The `muster-agent` command with `args` (the program name first); its exit status. Runs
/// without the GIL: the command owns the process until it returns.
#[pyfunction]
fn agent_main(py: Python<'_>, args: Vec<String>) -> u8 {
    let args = args.into_iter().map(Into::into).collect();
    py.detach(|| muster_agent::entry::main(args))
}

/// The `muster-coordinator` command with `args` (the program name first); its exit status.
#[pyfunction]
fn coordinator_main(py: Python<'_>, args: Vec<String>) -> u8 {
    py.detach(|| muster_coordinator::cli::main(args.into_iter().map(std::ffi::OsString::from)))
}

/// `muster._native`.
#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<Native>()?;
    m.add_class::<Comm>()?;
    m.add_class::<PyQuorum>()?;
    m.add_function(wrap_pyfunction!(agent_main, m)?)?;
    m.add_function(wrap_pyfunction!(coordinator_main, m)?)?;
    m.add("NCCL_UNIQUE_ID_BYTES", NCCL_UNIQUE_ID_BYTES)?;
    Ok(())
}
