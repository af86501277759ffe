//! libnccl, loaded at run time by muster rather than by cudarc: cudarc looks only for the
//! development name `libnccl.so` (and CUDA-versioned names), which NCCL's runtime packages do
//! not ship. PyTorch's `nvidia-nccl` wheels and the `libnccl2` packages install `libnccl.so.2`
//! alone, so a training machine with a working torch would have been told it has no NCCL.
//!
//! The library is looked for, in order, at `MUSTER_NCCL_LIBRARY` (a path, for a NCCL outside
//! the library path, such as the one in a venv's `nvidia/nccl/lib`), then as `libnccl.so.2` and
//! `libnccl.so` on the library path. Every function the backend calls is resolved once, when
//! the library loads; a library missing one is refused with the symbol's name. cudarc still
//! provides the types (`ncclComm_t`, `ncclConfig_t`, ...), which are NCCL's C ABI.
//!
//! The functions below keep NCCL's names and signatures; each is `unsafe` for the same reasons
//! as the C function it calls, and returns `ncclSystemError` when the library did not load
//! (callers only reach them after [`load`] succeeded).

#![allow(
    non_snake_case,
    reason = "NCCL's own function names, as cudarc's sys module has them"
)]

use std::{
    ffi::{OsString, c_char, c_int, c_void},
    sync::OnceLock,
};

use cudarc::nccl::sys::{
    cudaStream_t, ncclComm_t, ncclConfig_t, ncclDataType_t, ncclRedOp_t, ncclResult_t, ncclUniqueId,
};
use libloading::Library;

/// The environment variable naming the NCCL library's path.
pub(crate) const LIBRARY_ENV: &str = "MUSTER_NCCL_LIBRARY";

/// The names tried on the library path, runtime package first.
const NAMES: [&str; 2] = ["libnccl.so.2", "libnccl.so"];

/// Declares the table of NCCL functions, its loader and one forwarding function per entry.
macro_rules! nccl_functions {
    ($($name:ident($($arg:ident: $ty:ty),*) -> $ret:ty = $fallback:expr;)*) => {
        /// The resolved functions, and the library that keeps them valid.
        struct Nccl {
            /// Which file was loaded (for messages).
            path: String,
            $($name: unsafe extern "C" fn($($ty),*) -> $ret,)*
            /// `ncclCommInitRankScalable`, which only NCCL 2.23 and newer have.
            scalable: Option<InitScalable>,
            _library: Library,
        }

        /// Every function the table holds, by name (for the tests' stand-in library).
        #[cfg(test)]
        const FUNCTIONS: &[&str] = &[$(stringify!($name)),*];

        impl Nccl {
            /// Resolves every function in `library`, or names the first one missing.
            #[allow(unsafe_code)]
            fn resolve(library: Library, path: String) -> Result<Self, String> {
                Ok(Self {
                    $($name: {
                        // SAFETY: the symbol is NCCL's C function of this exact signature (the
                        // one cudarc's bindings declare from nccl.h); the pointer is copied
                        // out and used only while `_library`, stored beside it, stays loaded.
                        let symbol = unsafe {
                            library.get::<unsafe extern "C" fn($($ty),*) -> $ret>(
                                concat!(stringify!($name), "\0").as_bytes(),
                            )
                        };
                        *symbol.map_err(|e| {
                            format!("{path} has no {}: {e}", stringify!($name))
                        })?
                    },)*
                    // SAFETY: as above, for the optional function's signature.
                    scalable: unsafe {
                        library.get::<InitScalable>(b"ncclCommInitRankScalable\0")
                    }
                    .ok()
                    .map(|symbol| *symbol),
                    path,
                    _library: library,
                })
            }
        }

        $(
            /// NCCL's function of this name.
            #[allow(unsafe_code, clippy::too_many_arguments, reason = "NCCL's signature")]
            pub(super) unsafe fn $name($($arg: $ty),*) -> $ret {
                match loaded() {
                    // SAFETY: the caller upholds the C function's contract.
                    Ok(nccl) => unsafe { (nccl.$name)($($arg),*) },
                    Err(_) => $fallback,
                }
            }
        )*
    };
}

nccl_functions! {
    ncclGetVersion(version: *mut c_int) -> ncclResult_t = ncclResult_t::ncclSystemError;
    ncclGetUniqueId(unique_id: *mut ncclUniqueId) -> ncclResult_t = ncclResult_t::ncclSystemError;
    ncclCommInitRankConfig(
        comm: *mut ncclComm_t,
        nranks: c_int,
        comm_id: ncclUniqueId,
        rank: c_int,
        config: *mut ncclConfig_t
    ) -> ncclResult_t = ncclResult_t::ncclSystemError;
    ncclCommGetAsyncError(comm: ncclComm_t, async_error: *mut ncclResult_t) -> ncclResult_t
        = ncclResult_t::ncclSystemError;
    ncclGetLastError(comm: ncclComm_t) -> *const c_char = std::ptr::null();
    ncclCommAbort(comm: ncclComm_t) -> ncclResult_t = ncclResult_t::ncclSystemError;
    ncclAllReduce(
        send: *const c_void,
        recv: *mut c_void,
        count: usize,
        datatype: ncclDataType_t,
        op: ncclRedOp_t,
        comm: ncclComm_t,
        stream: cudaStream_t
    ) -> ncclResult_t = ncclResult_t::ncclSystemError;
    ncclBroadcast(
        send: *const c_void,
        recv: *mut c_void,
        count: usize,
        datatype: ncclDataType_t,
        root: c_int,
        comm: ncclComm_t,
        stream: cudaStream_t
    ) -> ncclResult_t = ncclResult_t::ncclSystemError;
    ncclReduce(
        send: *const c_void,
        recv: *mut c_void,
        count: usize,
        datatype: ncclDataType_t,
        op: ncclRedOp_t,
        root: c_int,
        comm: ncclComm_t,
        stream: cudaStream_t
    ) -> ncclResult_t = ncclResult_t::ncclSystemError;
    ncclAllGather(
        send: *const c_void,
        recv: *mut c_void,
        send_count: usize,
        datatype: ncclDataType_t,
        comm: ncclComm_t,
        stream: cudaStream_t
    ) -> ncclResult_t = ncclResult_t::ncclSystemError;
    ncclReduceScatter(
        send: *const c_void,
        recv: *mut c_void,
        recv_count: usize,
        datatype: ncclDataType_t,
        op: ncclRedOp_t,
        comm: ncclComm_t,
        stream: cudaStream_t
    ) -> ncclResult_t = ncclResult_t::ncclSystemError;
    ncclSend(
        send: *const c_void,
        count: usize,
        datatype: ncclDataType_t,
        peer: c_int,
        comm: ncclComm_t,
        stream: cudaStream_t
    ) -> ncclResult_t = ncclResult_t::ncclSystemError;
    ncclRecv(
        recv: *mut c_void,
        count: usize,
        datatype: ncclDataType_t,
        peer: c_int,
        comm: ncclComm_t,
        stream: cudaStream_t
    ) -> ncclResult_t = ncclResult_t::ncclSystemError;
}

/// `ncclCommInitRankScalable`'s signature: a communicator from `nId` unique ids, one per
/// bootstrap root.
type InitScalable = unsafe extern "C" fn(
    *mut ncclComm_t,
    c_int,
    c_int,
    c_int,
    *mut ncclUniqueId,
    *mut ncclConfig_t,
) -> ncclResult_t;

/// NCCL's `ncclCommInitRankScalable(comm, nranks, myrank, nId, commIds, config)`, or `None`
/// when the library did not load or predates it (NCCL before 2.23).
#[allow(unsafe_code, reason = "NCCL's signature")]
pub(super) fn ncclCommInitRankScalable() -> Option<InitScalable> {
    loaded().ok().and_then(|nccl| nccl.scalable)
}

/// The loaded library, or why it could not be loaded (computed once per process).
fn loaded() -> Result<&'static Nccl, &'static str> {
    static NCCL: OnceLock<Result<Nccl, String>> = OnceLock::new();
    NCCL.get_or_init(|| load_from(std::env::var_os(LIBRARY_ENV)))
        .as_ref()
        .map_err(String::as_str)
}

/// Loads libnccl (once per process) and returns the path it was loaded from, or a message
/// saying where it was looked for and why each place failed.
pub(super) fn load() -> Result<&'static str, String> {
    loaded()
        .map(|nccl| nccl.path.as_str())
        .map_err(str::to_owned)
}

/// Loads NCCL from `configured` (the value of `MUSTER_NCCL_LIBRARY`) or from the library path.
fn load_from(configured: Option<OsString>) -> Result<Nccl, String> {
    let candidates: Vec<OsString> = match configured.filter(|path| !path.is_empty()) {
        // An explicit path is the operator's choice: no silent fallback to another NCCL.
        Some(path) => vec![path],
        None => NAMES.iter().map(OsString::from).collect(),
    };
    let mut failures = Vec::new();
    for candidate in &candidates {
        let shown = candidate.to_string_lossy().into_owned();
        // SAFETY: loading runs the library's initialisers; NCCL's have no preconditions
        // (cudarc loads the same library the same way).
        #[allow(unsafe_code)]
        let library = unsafe { Library::new(candidate) };
        match library {
            Ok(library) => return Nccl::resolve(library, shown),
            Err(e) => failures.push(format!("{shown}: {e}")),
        }
    }
    Err(format!(
        "the NCCL library could not be loaded ({}); install NCCL 2.14 or newer (its runtime \
         package, or PyTorch's nvidia-nccl wheel), then add its directory to LD_LIBRARY_PATH \
         or set {LIBRARY_ENV} to the library's path",
        failures.join("; ")
    ))
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    /// An explicit path that does not exist is refused naming that path and the variable,
    /// without falling back to the library path.
    #[test]
    fn a_configured_path_that_does_not_load_is_named() {
        let error = load_from(Some("/nonexistent/libnccl.so.2".into()))
            .err()
            .unwrap();
        assert!(error.contains("/nonexistent/libnccl.so.2"), "{error}");
        assert!(error.contains(LIBRARY_ENV), "{error}");
        assert!(!error.contains("libnccl.so:"), "fell back: {error}");
    }

    /// A library that loads but is not NCCL is refused naming the first missing function.
    #[test]
    fn a_library_without_nccls_functions_is_refused_by_name() {
        let error = load_from(Some("libc.so.6".into())).err().unwrap();
        assert!(error.contains("libc.so.6 has no ncclGetVersion"), "{error}");
    }

    /// Without the variable, the runtime name is tried before the development name, and a
    /// machine with neither is told both.
    #[test]
    fn the_runtime_name_is_tried_first() {
        match load_from(None) {
            Ok(nccl) => assert!(nccl.path.starts_with("libnccl.so"), "{}", nccl.path),
            Err(error) => {
                let runtime = error.find("libnccl.so.2:").unwrap();
                let development = error.find("libnccl.so:").unwrap();
                assert!(runtime < development, "{error}");
            }
        }
    }

    /// A library named as NCCL's runtime package names it (`libnccl.so.2`), standing in for
    /// NCCL with every function the backend uses, loads from `MUSTER_NCCL_LIBRARY`'s path and
    /// its functions are called through the resolved table. Built with the C compiler the
    /// workspace's build already needs.
    #[test]
    fn a_runtime_named_library_loads_and_its_functions_are_called() {
        let dir = std::env::temp_dir().join(format!("muster-nccl-library-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let mut c = String::from("int ncclGetVersion(int *v) { *v = 22703; return 0; }\n");
        for name in FUNCTIONS.iter().filter(|name| **name != "ncclGetVersion") {
            c.push_str(&format!("int {name}(void) {{ return 3; }}\n"));
        }
        let path = build_library(&dir, "libnccl.so.2", &c);

        let nccl = load_from(Some(path.clone().into())).unwrap();
        assert_eq!(nccl.path, path.to_string_lossy());
        let mut version = 0;
        // SAFETY: the stand-in's ncclGetVersion writes one int.
        #[allow(unsafe_code)]
        let result = unsafe { (nccl.ncclGetVersion)(&mut version) };
        assert_eq!(result, ncclResult_t::ncclSuccess);
        assert_eq!(version, 22703);
        // SAFETY: the stand-in's ncclCommAbort ignores its argument and returns 3.
        #[allow(unsafe_code)]
        let result = unsafe { (nccl.ncclCommAbort)(std::ptr::null_mut()) };
        assert_eq!(result, ncclResult_t::ncclInternalError);
        // NCCL before 2.23 has no scalable init: it still loads, without it.
        assert!(nccl.scalable.is_none());
        let scalable = build_library(
            &dir,
            "libscalable.so.2",
            &format!("{c}int ncclCommInitRankScalable(void) {{ return 5; }}\n"),
        );
        let nccl = load_from(Some(scalable.into())).unwrap();
        let init = nccl.scalable.unwrap();
        // SAFETY: the stand-in ignores its arguments and returns 5.
        #[allow(unsafe_code)]
        let result = unsafe {
            init(
                std::ptr::null_mut(),
                2,
                0,
                2,
                std::ptr::null_mut(),
                std::ptr::null_mut(),
            )
        };
        assert_eq!(result, ncclResult_t::ncclInvalidUsage);

        // The same library without one function is refused naming it.
        let short = build_library(
            &dir,
            "libshort.so.2",
            "int ncclGetVersion(int *v) { *v = 1; return 0; }\n",
        );
        let error = load_from(Some(short.into())).err().unwrap();
        assert!(error.contains("has no ncclGetUniqueId"), "{error}");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    /// Compiles C `source` into the shared library `dir/name` with the system's `cc`.
    fn build_library(dir: &std::path::Path, name: &str, source: &str) -> std::path::PathBuf {
        let file = dir.join(format!("{name}.c"));
        std::fs::write(&file, source).unwrap();
        let path = dir.join(name);
        let built = std::process::Command::new("cc")
            .args(["-shared", "-fPIC", "-o"])
            .arg(&path)
            .arg(&file)
            .status()
            .unwrap();
        assert!(built.success(), "cc failed: {built}");
        path
    }

    /// The real NCCL that PyTorch's wheel installs (`nvidia/nccl/lib/libnccl.so.2` in the
    /// peers' venv, which scripts/test.sh makes): it loads, every function resolves and it
    /// reports a version new enough. No GPU is needed for that. Skipped, saying so, where the
    /// venv has no NCCL (the fast tier runs before it exists).
    #[test]
    fn pytorchs_nccl_wheel_loads() {
        let venv = std::env::var_os("MUSTER_PEERS_VENV").map_or_else(
            || {
                std::path::PathBuf::from(std::env::var_os("HOME").unwrap_or_default())
                    .join(".cache/muster-peers")
            },
            std::path::PathBuf::from,
        );
        let found = std::fs::read_dir(venv.join("lib"))
            .into_iter()
            .flatten()
            .flatten()
            .map(|python| {
                python
                    .path()
                    .join("site-packages/nvidia/nccl/lib/libnccl.so.2")
            })
            .find(|path| path.exists());
        let Some(path) = found else {
            println!("skipped: no nvidia-nccl wheel in {}", venv.display());
            return;
        };
        let nccl = load_from(Some(path.into())).unwrap();
        let mut version = 0;
        // SAFETY: ncclGetVersion writes one int.
        #[allow(unsafe_code)]
        let result = unsafe { (nccl.ncclGetVersion)(&mut version) };
        assert_eq!(result, ncclResult_t::ncclSuccess);
        assert!(version >= 21_400, "{version}");
        // ncclCommInitRankScalable arrived in 2.23: a wheel that new resolves it.
        assert_eq!(nccl.scalable.is_some(), version >= 22_300, "{version}");
        println!(
            "{} is NCCL {version} (scalable init: {})",
            nccl.path,
            nccl.scalable.is_some()
        );
    }
}
