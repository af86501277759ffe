//! Structured worker errors: the JSON file a worker leaves at `TORCHELASTIC_ERROR_FILE` when
//! it fails, written by PyTorch's `@record` (`ErrorHandler.record_exception`) or by muster's
//! SDK (its panic hook and `muster::record_error`), read back by the agent for the failure
//! report.
//!
//! The format (`docs/contract.md`, "Worker error files"), as PyTorch writes it:
//!
//! ```json
//! {"message": {"message": "ValueError: bad batch",
//!              "extraInfo": {"py_callstack": "Traceback ...", "timestamp": "1718000000"}}}
//! ```
//!
//! muster's SDK writes the same shape with `rust_backtrace` (and `location`) in `extraInfo`
//! instead of `py_callstack`, so PyTorch's own tools read it too. An older variant has a plain
//! string `message` and a top-level `timestamp`. Reading is lenient: whatever of the message,
//! traceback and timestamp can be found is returned, and a missing, empty, truncated, huge or
//! otherwise malformed file is `None`, never a panic.

use serde_json::Value;
use std::io::Read;
use std::path::{Path, PathBuf};

/// The most bytes of an error file that are read. A file this large or larger (a runaway
/// traceback, or something else at that path) is not parsed.
pub const MAX_ERROR_FILE_BYTES: u64 = 4 << 20;

/// What a worker said about its failure.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WorkerError {
    /// One line, e.g. `ValueError: bad batch` or `panicked at src/main.rs:7:5: boom`.
    pub message: String,
    /// The Python call stack or Rust backtrace, when the worker wrote one.
    pub traceback: Option<String>,
    /// When the error happened (seconds since the Unix epoch), when the worker wrote it: the
    /// earliest error of a job is its root cause.
    pub timestamp: Option<u64>,
}

/// The error file of global rank `rank` in the agent's error folder `dir`: the path the agent
/// gives the worker (`TORCHELASTIC_ERROR_FILE`) and reads back when the worker fails.
pub fn error_path(dir: &Path, rank: u32) -> PathBuf {
    dir.join(format!("rank_{rank}.json"))
}

/// Reads the error file at `path`. `None` when there is none (the worker wrote nothing) or
/// it cannot be understood; the reason is logged at debug level.
pub fn read(path: &Path) -> Option<WorkerError> {
    let mut bytes = Vec::new();
    let read = std::fs::File::open(path)
        .and_then(|f| f.take(MAX_ERROR_FILE_BYTES).read_to_end(&mut bytes));
    match read {
        Ok(_) if bytes.len() as u64 >= MAX_ERROR_FILE_BYTES => {
            tracing::debug!(path = %path.display(), "error file too large; not read");
            None
        }
        Ok(_) => {
            let error = parse(&bytes);
            if error.is_none() {
                tracing::debug!(path = %path.display(), "error file not understood");
            }
            error
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => None,
        Err(e) => {
            tracing::debug!(path = %path.display(), %e, "error file unreadable");
            None
        }
    }
}

/// Parses the contents of an error file (see the module docs for the accepted shapes).
pub fn parse(bytes: &[u8]) -> Option<WorkerError> {
    let root: Value = serde_json::from_slice(bytes).ok()?;
    let (message, extra) = match root.get("message")? {
        Value::String(s) => (Some(s.as_str()), root.get("extraInfo")),
        Value::Object(inner) => (
            inner.get("message").and_then(Value::as_str),
            inner.get("extraInfo"),
        ),
        _ => return None,
    };
    let extra = extra.filter(|e| e.is_object());
    let traceback = extra
        .and_then(|e| {
            ["py_callstack", "rust_backtrace", "traceback"]
                .iter()
                .find_map(|key| e.get(*key).and_then(Value::as_str))
        })
        .map(|t| t.trim_end())
        // What Python's `traceback.format_exc()` gives outside an `except` block.
        .filter(|t| !t.is_empty() && *t != "NoneType: None")
        .map(str::to_owned);
    let timestamp = extra
        .and_then(|e| e.get("timestamp"))
        .or_else(|| root.get("timestamp"))
        .and_then(seconds);
    let message = message
        .map(str::trim)
        .filter(|m| !m.is_empty())
        .map(str::to_owned)
        // No message: the traceback's last line is Python's `ExcType: message`.
        .or_else(|| {
            traceback
                .as_deref()
                .and_then(|t| t.lines().rev().map(str::trim).find(|l| !l.is_empty()))
                .map(str::to_owned)
        })?;
    Some(WorkerError {
        message,
        traceback,
        timestamp,
    })
}

/// A timestamp as PyTorch writes it (a string of whole seconds) or as a number.
fn seconds(value: &Value) -> Option<u64> {
    let number = match value {
        Value::String(s) => s.trim().parse::<f64>().ok()?,
        Value::Number(n) => n.as_f64()?,
        _ => return None,
    };
    // Truncation is the intent: whole seconds; negative and absurd values are dropped.
    (0.0..1e12).contains(&number).then_some(number as u64)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// What `@record` writes for an uncaught exception (PyTorch 2.x).
    const TORCH: &str = r#"{"message": {"message": "ValueError: batch 7 has 3 items, expected 4", "extraInfo": {"py_callstack": "Traceback (most recent call last):\n  File \"/opt/venv/lib/python3.11/site-packages/torch/distributed/elastic/multiprocessing/errors/__init__.py\", line 355, in wrapper\n    return f(*args, **kwargs)\n           ^^^^^^^^^^^^^^^^^^\n  File \"/work/train.py\", line 41, in main\n    raise ValueError(f\"batch {i} has {n} items, expected {b}\")\nValueError: batch 7 has 3 items, expected 4\n", "timestamp": "1718031254"}}}"#;

    fn error(message: &str, traceback: Option<&str>, timestamp: Option<u64>) -> WorkerError {
        WorkerError {
            message: message.to_owned(),
            traceback: traceback.map(str::to_owned),
            timestamp,
        }
    }

    #[test]
    fn pytorch_record() {
        let e = parse(TORCH.as_bytes()).expect("parsed");
        assert_eq!(e.message, "ValueError: batch 7 has 3 items, expected 4");
        assert_eq!(e.timestamp, Some(1_718_031_254));
        let tb = e.traceback.expect("traceback");
        assert!(
            tb.starts_with("Traceback (most recent call last):\n"),
            "{tb}"
        );
        assert!(
            tb.ends_with("ValueError: batch 7 has 3 items, expected 4"),
            "{tb}"
        );
    }

    #[test]
    fn shapes() {
        for (text, expected) in [
            // The agent rewrites the root cause with the exit code (dump_error_file).
            (
                r#"{"message": {"message": "RuntimeError: NCCL error", "errorCode": 1, "extraInfo": {"py_callstack": "tb", "timestamp": "12"}}}"#,
                Some(error("RuntimeError: NCCL error", Some("tb"), Some(12))),
            ),
            // The "new" format: a plain string and a top-level timestamp.
            (
                r#"{"message": "Signal 6 (SIGABRT) received by PID 77", "timestamp": 1718000000}"#,
                Some(error(
                    "Signal 6 (SIGABRT) received by PID 77",
                    None,
                    Some(1_718_000_000),
                )),
            ),
            // muster's SDK.
            (
                r#"{"message": {"message": "panicked at src/main.rs:7:5: boom", "extraInfo": {"rust_backtrace": "   0: main\n", "location": "src/main.rs:7:5", "timestamp": "5"}}}"#,
                Some(error(
                    "panicked at src/main.rs:7:5: boom",
                    Some("   0: main"),
                    Some(5),
                )),
            ),
            // record_exception outside an except block.
            (
                r#"{"message": {"message": "KeyError: 'x'", "extraInfo": {"py_callstack": "NoneType: None\n", "timestamp": "9"}}}"#,
                Some(error("KeyError: 'x'", None, Some(9))),
            ),
            // No message: the traceback's last line stands in.
            (
                r#"{"message": {"extraInfo": {"py_callstack": "Traceback:\n  x\nOSError: disk full\n\n"}}}"#,
                Some(error(
                    "OSError: disk full",
                    Some("Traceback:\n  x\nOSError: disk full"),
                    None,
                )),
            ),
            // Odd timestamps are dropped, not fatal.
            (
                r#"{"message": {"message": "E: x", "extraInfo": {"timestamp": "soon"}}}"#,
                Some(error("E: x", None, None)),
            ),
            (
                r#"{"message": {"message": "E: x", "extraInfo": {"timestamp": -4}}}"#,
                Some(error("E: x", None, None)),
            ),
            (
                r#"{"message": {"message": "E: x", "extraInfo": {"timestamp": 12.9}}}"#,
                Some(error("E: x", None, Some(12))),
            ),
            (
                r#"{"message": {"message": "E: x", "extraInfo": "not an object"}}"#,
                Some(error("E: x", None, None)),
            ),
            // torch's placeholder for "no error file" is a message too.
            (
                r#"{"message": "<NONE>"}"#,
                Some(error("<NONE>", None, None)),
            ),
        ] {
            assert_eq!(parse(text.as_bytes()), expected, "{text}");
        }
    }

    #[test]
    fn malformed_files_are_none() {
        for text in [
            "",
            "   ",
            "null",
            "[]",
            "\"message\"",
            "{}",
            r#"{"message": 3}"#,
            r#"{"message": ""}"#,
            r#"{"message": {"message": "   "}}"#,
            r#"{"message": {"extraInfo": {"py_callstack": "NoneType: None"}}}"#,
            r#"{"message": {"message": "ValueError: cut"#,
            "\u{0}\u{1}binary",
        ] {
            assert_eq!(parse(text.as_bytes()), None, "{text:?}");
        }
        assert_eq!(parse(&[0xff, 0xfe, b'{']), None);
    }

    #[test]
    fn files() {
        let dir = std::env::temp_dir().join(format!("muster-error-file-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("temp dir");
        let path = error_path(&dir, 12);
        assert_eq!(path, dir.join("rank_12.json"));
        assert_eq!(read(&path), None, "no file yet");
        std::fs::write(&path, TORCH).expect("write");
        assert_eq!(
            read(&path).map(|e| e.message),
            Some("ValueError: batch 7 has 3 items, expected 4".to_owned())
        );
        // A huge file is not read, even when it would parse.
        let pad = " ".repeat(usize::try_from(MAX_ERROR_FILE_BYTES).expect("fits"));
        std::fs::write(&path, format!("{TORCH}{pad}")).expect("write");
        assert_eq!(read(&path), None);
        // A directory at the path is not a panic either.
        std::fs::remove_file(&path).expect("remove");
        std::fs::create_dir(&path).expect("mkdir");
        assert_eq!(read(&path), None);
        let _ = std::fs::remove_dir_all(&dir);
    }
}
