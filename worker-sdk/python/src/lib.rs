//! `muster._native`: the Rust worker SDK (`muster`) for Python, wrapped with PyO3. The
//! pure-Python layer (`python/muster/`) gives it Accelerate's names; everything that talks to
//! the agent or the coordinator is here, in the same Rust every Rust worker runs.
//!
//! Waits release the GIL. On the process's main thread a wait runs on a helper thread while
//! the caller checks for signals every 50 ms, so Ctrl-C interrupts it; other threads wait in
//! place. A forked child (a DataLoader worker) gets a clear error instead of the deadlock that
//! the parent's runtime threads, absent after `fork`, would cause.

use std::sync::mpsc::{self, RecvTimeoutError};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use muster::{Error, NCCL_UNIQUE_ID_BYTES, RankInfo, Scope};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict, PyList, PyTuple};

/// How often a wait on the main thread looks for a pending signal (Ctrl-C).
const SIGNAL_POLL: Duration = Duration::from_millis(50);

/// The Python module holding the exception classes (`muster.errors`).
const ERRORS_MODULE: &str = "muster.errors";

/// This process's place in the job and its connection to the agent and the coordinator.
#[pyclass(frozen, module = "muster._native")]
struct Native {
    /// `None` once closed.
    inner: Mutex<Option<Arc<muster::Accelerator>>>,
    /// The process that created it: a forked child must not use its runtime.
    pid: u32,
    info: RankInfo,
}

impl Native {
    /// The accelerator, or why it cannot be used from here.
    fn get(&self, py: Python<'_>) -> PyResult<Arc<muster::Accelerator>> {
        if std::process::id() != self.pid {
            return Err(error(
                py,
                "MusterError",
                &format!(
                    "this muster Accelerator belongs to process {} and cannot be used in its \
                     forked child {} (a DataLoader worker, multiprocessing with fork): the \
                     connection to the agent lives in threads that fork does not copy; use it \
                     from the training process only",
                    self.pid,
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

    /// Runs a blocking SDK call without the GIL; on the main thread, on a helper thread while
    /// this one answers signals.
    fn wait<T: Send + 'static>(
        &self,
        py: Python<'_>,
        f: impl FnOnce(&muster::Accelerator) -> Result<T, Error> + Send + 'static,
    ) -> PyResult<T> {
        let accelerator = self.get(py)?;
        if !on_main_thread() {
            return py.detach(|| f(&accelerator)).map_err(|e| to_py(py, e));
        }
        let (tx, rx) = mpsc::channel();
        std::thread::Builder::new()
            .name("muster-wait".to_owned())
            .spawn(move || {
                let _ = tx.send(f(&accelerator));
            })
            .map_err(|e| {
                error(
                    py,
                    "MusterError",
                    &format!("could not start a thread to wait on: {e}"),
                    None,
                )
            })?;
        let mut rx = rx;
        loop {
            // The receiver goes to the GIL-free closure and back (it is Send, not Sync).
            let (answer, back) = py.detach(move || (rx.recv_timeout(SIGNAL_POLL), rx));
            rx = back;
            match answer {
                Ok(answer) => return answer.map_err(|e| to_py(py, e)),
                // KeyboardInterrupt (or what a handler raises) ends the wait here; the helper
                // thread finishes the call on its own.
                Err(RecvTimeoutError::Timeout) => py.check_signals()?,
                Err(RecvTimeoutError::Disconnected) => {
                    return Err(error(
                        py,
                        "MusterError",
                        "the muster call ended without an answer (its thread panicked)",
                        None,
                    ));
                }
            }
        }
    }
}

/// Whether this is the process's initial thread, the one Python runs signal handlers on.
fn on_main_thread() -> bool {
    nix::unistd::gettid() == nix::unistd::getpid()
}

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
            pid: std::process::id(),
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

    /// Ends this process's part in the job cleanly: ranks still waiting on it get a clear
    /// error. Later calls raise; calling it twice does nothing.
    fn close(&self, py: Python<'_>) -> PyResult<()> {
        if std::process::id() != self.pid {
            // A forked child owns nothing of the parent's connection.
            return Ok(());
        }
        let taken = self
            .inner
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take();
        if let Some(accelerator) = taken {
            // Dropping the last reference sends `leave` (a wait still running on a helper thread
            // holds another, and leaves when it ends).
            py.detach(move || drop(accelerator));
        }
        Ok(())
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

/// The SDK's error as the matching `muster.errors` exception.
fn to_py(py: Python<'_>, e: Error) -> PyErr {
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
        Error::PeerLost {
            rank,
            node_rank,
            host,
            reason,
            ..
        } => error(
            py,
            "RankFailedError",
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

/// `muster._native`.
#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<Native>()?;
    m.add("NCCL_UNIQUE_ID_BYTES", NCCL_UNIQUE_ID_BYTES)?;
    Ok(())
}
