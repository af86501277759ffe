//! Architecture invariants checked on the source tree, so that they stay true rather than
//! stated: only the coordinator's store module knows etcd; the agent uses the coordinator
//! crate only to embed a coordinator; muster-core does no I/O and has no server dependency;
//! the worker-agent contract's variable names are spelled only in muster-core.

use std::path::{Path, PathBuf};

/// The workspace root (this crate is `coordinator/`).
fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .map(Path::to_path_buf)
        .unwrap_or_else(|| panic!("{} has no parent", env!("CARGO_MANIFEST_DIR")))
}

/// Every `.rs` file under `dir`, build outputs and hidden folders left out.
fn rust_sources(dir: &Path, out: &mut Vec<PathBuf>) {
    let entries = std::fs::read_dir(dir).unwrap_or_else(|e| panic!("{}: {e}", dir.display()));
    for entry in entries {
        let path = entry
            .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
            .path();
        let name = path.file_name().and_then(|n| n.to_str()).unwrap_or("");
        if path.is_dir() {
            if name != "target" && !name.starts_with('.') {
                rust_sources(&path, out);
            }
        } else if name.ends_with(".rs") {
            out.push(path);
        }
    }
}

fn read(path: &Path) -> String {
    std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// Where `needle` occurs in `text`, as (line number, what follows it on that line).
fn occurrences<'a>(text: &'a str, needle: &str) -> Vec<(usize, &'a str)> {
    text.lines()
        .enumerate()
        .flat_map(|(i, line)| {
            line.match_indices(needle)
                .map(move |(at, _)| (i + 1, &line[at + needle.len()..]))
        })
        .collect()
}

#[test]
fn only_the_store_module_names_the_etcd_client() {
    let root = root();
    let store = root.join("coordinator/src/store");
    let mut sources = vec![];
    rust_sources(&root, &mut sources);
    let offenders: Vec<String> = sources
        .iter()
        .filter(|p| !p.starts_with(&store))
        .filter_map(|p| {
            let text = read(p);
            // Tests that start a real etcd may talk to it directly (to forge a leader key).
            if text.contains("Etcd::start(") {
                return None;
            }
            let hits = occurrences(&text, "etcd_client");
            let first = hits.first()?;
            Some(format!(
                "{}:{}",
                p.strip_prefix(&root).unwrap_or(p).display(),
                first.0
            ))
        })
        .collect();
    assert!(
        offenders.is_empty(),
        "only coordinator/src/store/ may name etcd_client (ask the Store for what etcd gives), \
         but these do: {offenders:?}"
    );
}

#[test]
fn the_agent_uses_the_coordinator_crate_only_to_embed_one() {
    let root = root();
    let mut sources = vec![];
    rust_sources(&root.join("agent/src"), &mut sources);
    // The embedded coordinator's entry point and its configuration types, and its log target.
    let allowed = |rest: &str| {
        let entry = rest
            .strip_prefix("::serve")
            .is_some_and(|after| !after.starts_with(|c: char| c.is_alphanumeric() || c == '_'));
        entry
            || rest.starts_with("::Config")
            || rest.starts_with("::config::")
            || rest.starts_with('=')
    };
    let mut offenders = vec![];
    for p in &sources {
        for (line, rest) in occurrences(&read(p), "muster_coordinator") {
            if !allowed(rest) {
                offenders.push(format!(
                    "{}:{line}: muster_coordinator{rest}",
                    p.strip_prefix(&root).unwrap_or(p).display()
                ));
            }
        }
    }
    assert!(
        offenders.is_empty(),
        "the agent may use muster_coordinator only for `serve` and its `Config` (shared rules \
         are in muster-core, telemetry in muster-telemetry), but: {offenders:#?}"
    );
}

/// The non-test part of a source file: what precedes its first `#[cfg(test)]` (every file
/// here keeps its tests in a `mod tests` at the end, or in a `tests.rs` of their own).
fn non_test(path: &Path) -> String {
    if path.file_name().is_some_and(|n| n == "tests.rs") {
        return String::new();
    }
    let text = read(path);
    match text.find("#[cfg(test)]") {
        Some(at) => text[..at].to_string(),
        None => text,
    }
}

#[test]
fn muster_core_does_no_io_and_names_no_server() {
    let root = root();
    let manifest = read(&root.join("core/Cargo.toml"));
    let deps = manifest
        .split("[dependencies]")
        .nth(1)
        .and_then(|rest| rest.split("\n[").next())
        .unwrap_or_else(|| panic!("core/Cargo.toml has no [dependencies]"));
    let forbidden_crates = [
        "tokio",
        "etcd-client",
        "hyper",
        "opentelemetry",
        "prometheus-client",
        "muster-coordinator",
        "muster-telemetry",
    ];
    for name in forbidden_crates {
        assert!(
            !deps.lines().any(|l| l.trim_start().starts_with(name)),
            "muster-core must not depend on {name}: it holds rules, not I/O or servers"
        );
    }
    let mut sources = vec![];
    rust_sources(&root.join("core/src"), &mut sources);
    // (`std::process::id` seeds the backoff jitter: not I/O.)
    let forbidden_paths = [
        "tokio::",
        "std::net",
        "std::fs",
        "std::thread",
        "std::process::Command",
    ];
    let mut offenders = vec![];
    for p in &sources {
        let text = non_test(p);
        for needle in forbidden_paths {
            if let Some((line, _)) = occurrences(&text, needle).first() {
                offenders.push(format!(
                    "{}:{line}: {needle}",
                    p.strip_prefix(&root).unwrap_or(p).display()
                ));
            }
        }
    }
    assert!(
        offenders.is_empty(),
        "muster-core is plain data and decisions (time is passed in, I/O stays with its \
         callers), but: {offenders:#?}"
    );
}

#[test]
fn contract_variables_are_spelled_only_in_muster_core() {
    let root = root();
    // Every `pub const NAME: &str = "VALUE";` of the contract.
    let names: Vec<String> = read(&root.join("core/src/contract/env.rs"))
        .lines()
        .filter(|l| l.starts_with("pub const ") && l.contains(": &str = \""))
        .filter_map(|l| l.split('"').nth(1).map(str::to_string))
        .collect();
    assert!(
        names.iter().any(|n| n == "MUSTER_RANK"),
        "core/src/contract/env.rs lists no names: {names:?}"
    );
    let mut sources = vec![];
    for dir in ["agent/src", "worker-sdk/src", "worker-sdk/python/src"] {
        rust_sources(&root.join(dir), &mut sources);
    }
    let mut offenders = vec![];
    for p in &sources {
        let text = non_test(p);
        for name in &names {
            if let Some((line, _)) = occurrences(&text, &format!("\"{name}\"")).first() {
                offenders.push(format!(
                    "{}:{line}: \"{name}\"",
                    p.strip_prefix(&root).unwrap_or(p).display()
                ));
            }
        }
    }
    assert!(
        offenders.is_empty(),
        "the agent and the SDK take the worker environment's names from \
         muster_core::contract::env, but these spell one: {offenders:#?}"
    );
}
