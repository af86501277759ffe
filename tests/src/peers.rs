//! Finds the peers' Python (the venv `scripts/install-peers.sh` makes, with PyTorch,
//! Accelerate and safetensors) for the tests that check muster against the real thing. Shared
//! as source with the worker SDK's tests (`worker-sdk/tests/support`), so it uses std only.

use std::path::PathBuf;

/// The venv's Python if it has every one of `packages`; otherwise prints why the calling test
/// is skipped and returns `None`. Looks for the packages' files instead of importing them (an
/// import of torch costs seconds). `MUSTER_PEERS_VENV` overrides `~/.cache/muster-peers`.
pub fn peers_python(packages: &[&str]) -> Option<PathBuf> {
    let venv = std::env::var_os("MUSTER_PEERS_VENV")
        .map(PathBuf::from)
        .or_else(|| {
            std::env::var_os("HOME").map(|home| PathBuf::from(home).join(".cache/muster-peers"))
        });
    let Some(venv) = venv else {
        eprintln!(
            "skipped: neither MUSTER_PEERS_VENV nor HOME is set (run scripts/install-peers.sh)"
        );
        return None;
    };
    let python = venv.join("bin/python");
    if !python.exists() {
        eprintln!(
            "skipped: {} does not exist (run scripts/install-peers.sh)",
            python.display()
        );
        return None;
    }
    let has = |package: &str| {
        std::fs::read_dir(venv.join("lib"))
            .into_iter()
            .flatten()
            .flatten()
            .any(|dir| {
                dir.path()
                    .join("site-packages")
                    .join(package)
                    .join("__init__.py")
                    .exists()
            })
    };
    for package in packages {
        if !has(package) {
            eprintln!(
                "skipped: the venv {} has no {package} (run scripts/install-peers.sh)",
                venv.display()
            );
            return None;
        }
    }
    Some(python)
}
