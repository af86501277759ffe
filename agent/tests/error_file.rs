//! The agent reads what the worker SDK writes: this test binary runs itself again as a
//! "worker" that uses `muster`'s panic hook with `TORCHELASTIC_ERROR_FILE` set to the path the
//! agent would give rank 3, and the agent's reader parses the file it leaves.
#![allow(clippy::unwrap_used, missing_docs)]

use muster_agent::error_file::{error_path, read};
use std::process::Command;

/// Set in the child: it is the worker.
const CHILD: &str = "MUSTER_AGENT_ERROR_FILE_CHILD";

#[test]
fn worker_panics() {
    if std::env::var_os(CHILD).is_none() {
        return;
    }
    muster::install_error_hook();
    let shard = "shard-0042";
    panic!("cannot open {shard}: permission denied");
}

#[test]
fn the_agent_reads_the_sdk_panic_file() {
    let dir = std::env::temp_dir().join(format!("muster-agent-error-file-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = error_path(&dir, 3);
    let _ = std::fs::remove_file(&path);
    let out = Command::new(std::env::current_exe().unwrap())
        .args(["--exact", "worker_panics", "--nocapture"])
        .env(CHILD, "1")
        .env("TORCHELASTIC_ERROR_FILE", &path)
        .output()
        .unwrap();
    assert!(!out.status.success());
    let error = read(&path).unwrap_or_else(|| {
        panic!(
            "no readable error file at {}; child stderr:\n{}",
            path.display(),
            String::from_utf8_lossy(&out.stderr)
        )
    });
    assert!(
        error
            .message
            .starts_with("panicked at agent/tests/error_file.rs:")
            && error
                .message
                .ends_with(": cannot open shard-0042: permission denied"),
        "{error:?}"
    );
    assert!(
        error
            .traceback
            .as_deref()
            .is_some_and(|t| t.contains("worker_panics")),
        "{error:?}"
    );
    assert!(
        error.timestamp.is_some_and(|t| t > 1_600_000_000),
        "{error:?}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}
