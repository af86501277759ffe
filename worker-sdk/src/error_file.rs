//! Hands a worker's fatal error to its agent in a file: the JSON PyTorch's `@record` writes to
//! `TORCHELASTIC_ERROR_FILE`, so that `muster-agent` (and torchrun, and TorchX) report the
//! panic message and backtrace as the root cause instead of "exited with status 101".
//!
//! [`install_error_hook`] (which [`crate::Accelerator::from_env`] calls) writes it from a panic
//! hook; [`record_error`] writes it for an error the program handles itself before it exits.
//! The file is `$TORCHELASTIC_ERROR_FILE`, else `$MUSTER_ERROR_FILE`; the agent sets both. The
//! first error wins: an existing file is never overwritten. The format is in
//! `docs/contract.md` ("Worker error files"):
//!
//! ```json
//! {"message": {"message": "panicked at src/main.rs:7:5: boom",
//!              "extraInfo": {"rust_backtrace": "...", "location": "src/main.rs:7:5",
//!                            "timestamp": "1718000000"}}}
//! ```

use std::backtrace::Backtrace;
use std::fmt::Display;
use std::io::Write;
use std::panic::{Location, PanicHookInfo};
use std::path::PathBuf;
use std::sync::Once;
use std::time::{SystemTime, UNIX_EPOCH};

/// The variable PyTorch's launchers set to each worker's error file; read first.
pub const TORCHELASTIC_ERROR_FILE: &str = muster_core::contract::env::TORCHELASTIC_ERROR_FILE;
/// muster's name for the same file (`muster-agent` sets both); read when the first is unset.
pub const MUSTER_ERROR_FILE: &str = muster_core::contract::env::MUSTER_ERROR_FILE;

/// Installs (once per process; later calls do nothing) a panic hook that writes the panic's
/// message, location and backtrace to the worker's error file, when one is set, then runs the
/// hook that was installed before it (by default the one that prints the panic), so output is
/// unchanged. Every panic goes through it, including one a thread or `catch_unwind` recovers
/// from: the agent reads the file only when the worker fails.
pub fn install_error_hook() {
    static INSTALLED: Once = Once::new();
    INSTALLED.call_once(|| {
        let previous = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            record_panic(info);
            previous(info);
        }));
    });
}

/// Writes `error` (its `Display` text), the caller's location and a backtrace to the worker's
/// error file, for a program that ends with an error without panicking (as PyTorch's
/// `ErrorHandler.record_exception`). `Ok(true)` when written; `Ok(false)` when no error file
/// is set or an earlier error already wrote it.
#[track_caller]
pub fn record_error(error: &dyn Display) -> std::io::Result<bool> {
    let location = Location::caller();
    write(&error.to_string(), Some(location))
}

fn record_panic(info: &PanicHookInfo<'_>) {
    let payload = info.payload();
    let text = payload
        .downcast_ref::<&str>()
        .copied()
        .or_else(|| payload.downcast_ref::<String>().map(String::as_str))
        .unwrap_or("Box<dyn Any>");
    let message = match info.location() {
        Some(at) => format!("panicked at {at}: {text}"),
        None => format!("panicked: {text}"),
    };
    // A panic hook has nowhere to report a failed write; the panic still prints.
    let _ = write(&message, info.location());
}

/// The worker's error file, when its launcher gave it one.
fn path() -> Option<PathBuf> {
    [TORCHELASTIC_ERROR_FILE, MUSTER_ERROR_FILE]
        .iter()
        .find_map(|name| std::env::var_os(name).filter(|v| !v.is_empty()))
        .map(PathBuf::from)
}

fn write(message: &str, location: Option<&Location<'_>>) -> std::io::Result<bool> {
    let Some(path) = path() else {
        return Ok(false);
    };
    let mut file = match std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .open(&path)
    {
        Ok(file) => file,
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => return Ok(false),
        Err(e) => return Err(e),
    };
    let json = contents(
        message,
        location.map(ToString::to_string),
        &Backtrace::force_capture().to_string(),
        SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_secs()),
    );
    file.write_all(json.as_bytes())?;
    Ok(true)
}

/// The file's JSON: PyTorch's shape, with Rust's details in `extraInfo`.
fn contents(message: &str, location: Option<String>, backtrace: &str, timestamp: u64) -> String {
    let mut extra = serde_json::Map::new();
    extra.insert("rust_backtrace".to_owned(), backtrace.into());
    if let Some(location) = location {
        extra.insert("location".to_owned(), location.into());
    }
    // A string, as PyTorch writes it.
    extra.insert("timestamp".to_owned(), timestamp.to_string().into());
    serde_json::json!({ "message": { "message": message, "extraInfo": extra } }).to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pytorch_shape() {
        let json = contents(
            "panicked at src/main.rs:7:5: boom \"quoted\"",
            Some("src/main.rs:7:5".to_owned()),
            "   0: main\n",
            1_718_000_000,
        );
        let value: serde_json::Value = serde_json::from_str(&json).expect("valid JSON");
        assert_eq!(
            value,
            serde_json::json!({"message": {
                "message": "panicked at src/main.rs:7:5: boom \"quoted\"",
                "extraInfo": {
                    "rust_backtrace": "   0: main\n",
                    "location": "src/main.rs:7:5",
                    "timestamp": "1718000000",
                },
            }})
        );
    }
}
