//! The SDK's error file, written by a real process: this test binary runs itself again with
//! `TORCHELASTIC_ERROR_FILE` (or `MUSTER_ERROR_FILE`) pointing at a temporary file and one of
//! the `child_*` tests selected, which panics or records an error; the parent checks the JSON.
#![allow(clippy::unwrap_used, missing_docs)]

use serde_json::Value;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

/// Set in the child: which `child_*` test should act.
const CHILD: &str = "MUSTER_SDK_ERROR_FILE_CHILD";

fn is_child(name: &str) -> bool {
    std::env::var(CHILD).is_ok_and(|v| v == name)
}

fn temp_file(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("muster-sdk-error-file-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join(format!("{name}.json"));
    let _ = std::fs::remove_file(&path);
    path
}

/// Runs the `child` test in a new process of this binary with `var=path`.
fn run_child(child: &str, var: &str, path: &Path) -> Output {
    Command::new(std::env::current_exe().unwrap())
        .args(["--exact", child, "--nocapture", "--test-threads", "1"])
        .env(CHILD, child)
        .env_remove("TORCHELASTIC_ERROR_FILE")
        .env_remove("MUSTER_ERROR_FILE")
        .env(var, path)
        .output()
        .unwrap()
}

fn read_json(path: &Path) -> Value {
    let text = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("{e}: {text}"))
}

#[test]
fn child_panics() {
    if !is_child("child_panics") {
        return;
    }
    muster::install_error_hook();
    muster::install_error_hook();
    let batch = 7;
    panic!("batch {batch} is empty");
}

#[test]
fn child_records_then_panics() {
    if !is_child("child_records_then_panics") {
        return;
    }
    muster::install_error_hook();
    let written = muster::record_error(&"checkpoint directory is read-only").unwrap();
    assert!(written);
    // The first error wins: neither a second record nor the panic overwrites it.
    assert!(!muster::record_error(&"second").unwrap());
    panic!("after the record");
}

#[test]
fn a_panic_writes_the_pytorch_json_and_still_prints() {
    let path = temp_file("panic");
    let out = run_child("child_panics", "TORCHELASTIC_ERROR_FILE", &path);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{stderr}");
    // The previous hook still ran: the usual panic message is on stderr.
    assert!(stderr.contains("batch 7 is empty"), "{stderr}");
    let json = read_json(&path);
    let message = json["message"]["message"].as_str().unwrap();
    assert!(
        message.starts_with("panicked at worker-sdk/tests/error_file.rs:")
            && message.ends_with(": batch 7 is empty"),
        "{message}"
    );
    let extra = &json["message"]["extraInfo"];
    let location = extra["location"].as_str().unwrap();
    assert!(
        message.contains(location) && location.starts_with("worker-sdk/tests/error_file.rs:"),
        "{location}"
    );
    assert!(
        extra["rust_backtrace"]
            .as_str()
            .unwrap()
            .contains("child_panics"),
        "{extra}"
    );
    let timestamp: u64 = extra["timestamp"].as_str().unwrap().parse().unwrap();
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs();
    assert!(timestamp <= now && now - timestamp < 600, "{timestamp}");
}

#[test]
fn record_error_writes_once_and_muster_error_file_is_read_too() {
    let path = temp_file("record");
    let out = run_child("child_records_then_panics", "MUSTER_ERROR_FILE", &path);
    assert!(!out.status.success(), "the child panics at the end");
    let json = read_json(&path);
    assert_eq!(
        json["message"]["message"].as_str(),
        Some("checkpoint directory is read-only"),
        "{json}"
    );
    let location = json["message"]["extraInfo"]["location"].as_str().unwrap();
    assert!(
        location.starts_with("worker-sdk/tests/error_file.rs:"),
        "{location}"
    );
}

#[test]
fn without_an_error_file_nothing_is_written() {
    // This process has neither variable unless the test runner was given one.
    if std::env::var_os("TORCHELASTIC_ERROR_FILE").is_some()
        || std::env::var_os("MUSTER_ERROR_FILE").is_some()
    {
        return;
    }
    assert!(!muster::record_error(&"nowhere to go").unwrap());
}
