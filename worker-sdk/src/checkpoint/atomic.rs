//! Atomic directories: a checkpoint is built under a hidden sibling name and renamed into
//! place, and the leftovers of a crash are recognised and cleaned by the next save.

use std::{
    fs::{self},
    io::{self},
    path::{Path, PathBuf},
    time::{SystemTime, UNIX_EPOCH},
};

use serde::{Serialize, de::DeserializeOwned};

use crate::{Accelerator, Error};

use super::format::{fsync_dir, io_error};

/// The parent and final name of a target directory.
pub(super) fn split_target(target: &Path) -> Result<(PathBuf, String), Error> {
    let name = target
        .file_name()
        .and_then(|n| n.to_str())
        .ok_or_else(|| {
            Error::Usage(format!(
                "{} does not end in a (UTF-8) directory name to save into",
                target.display()
            ))
        })?
        .to_owned();
    let parent = match target.parent() {
        Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
        _ => PathBuf::from("."),
    };
    Ok((parent, name))
}

/// The hidden directory a save of `target` is built in: named by the generation, so every
/// rank of one save agrees on it without talking.
pub(super) fn temp_dir(target: &Path, generation: u64) -> Result<PathBuf, Error> {
    let (parent, name) = split_target(target)?;
    Ok(parent.join(format!(".{name}.tmp-g{generation}")))
}

/// A name no other aside or deletion directory has.
pub(super) fn unique_suffix() -> String {
    let nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos());
    format!("{}-{nanos}", std::process::id())
}

/// The hidden leftovers of earlier saves of `target`: `(path, kind)` with kind `tmp`, `old` or
/// `del`.
pub(super) fn leftovers(target: &Path) -> Result<Vec<(PathBuf, String)>, Error> {
    let (parent, name) = split_target(target)?;
    let prefix = format!(".{name}.");
    let entries = match fs::read_dir(&parent) {
        Ok(entries) => entries,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(io_error(|| format!("listing {}", parent.display()))(e)),
    };
    let mut out = Vec::new();
    for entry in entries.flatten() {
        let file_name = entry.file_name();
        let Some(rest) = file_name.to_str().and_then(|n| n.strip_prefix(&prefix)) else {
            continue;
        };
        for kind in ["tmp", "old", "del"] {
            if rest.starts_with(&format!("{kind}-")) {
                out.push((entry.path(), kind.to_owned()));
            }
        }
    }
    out.sort();
    Ok(out)
}

/// Cleans up after a crashed save of `target`: half-built directories go; an aside copy of
/// the previous checkpoint comes back if its replacement never arrived, and goes otherwise.
pub(super) fn clean_leftovers(
    target: &Path,
    complete: impl Fn(&Path) -> bool,
) -> Result<(), Error> {
    for (path, kind) in leftovers(target)? {
        if kind == "old" && !target.exists() && complete(&path) {
            fs::rename(&path, target).map_err(io_error(|| {
                format!("restoring {} to {}", path.display(), target.display())
            }))?;
            continue;
        }
        fs::remove_dir_all(&path).map_err(io_error(|| format!("removing {}", path.display())))?;
    }
    Ok(())
}

/// Puts the finished `temp` in place of `target`: renamed straight there, or, over an
/// existing directory, after that one is renamed aside (and then deleted).
pub(super) fn replace_dir(temp: &Path, target: &Path) -> Result<(), Error> {
    fsync_dir(temp)?;
    let (parent, name) = split_target(target)?;
    if target.exists() {
        let aside = parent.join(format!(".{name}.old-{}", unique_suffix()));
        fs::rename(target, &aside).map_err(io_error(|| {
            format!("moving {} aside to {}", target.display(), aside.display())
        }))?;
        if let Err(source) = fs::rename(temp, target) {
            // Put the old one back rather than leave nothing.
            let _ = fs::rename(&aside, target);
            return Err(Error::Io {
                what: format!("renaming {} to {}", temp.display(), target.display()),
                source,
            });
        }
        fsync_dir(&parent)?;
        fs::remove_dir_all(&aside).map_err(io_error(|| format!("removing {}", aside.display())))?;
    } else {
        fs::rename(temp, target).map_err(io_error(|| {
            format!("renaming {} to {}", temp.display(), target.display())
        }))?;
    }
    fsync_dir(&parent)
}

/// Removes a directory so that it is never seen half deleted: renamed to a hidden name first.
pub(super) fn remove_dir_whole(dir: &Path) -> Result<(), Error> {
    let (parent, name) = split_target(dir)?;
    let doomed = parent.join(format!(".{name}.del-{}", unique_suffix()));
    fs::rename(dir, &doomed).map_err(io_error(|| format!("removing {}", dir.display())))?;
    fs::remove_dir_all(&doomed).map_err(io_error(|| format!("removing {}", doomed.display())))
}

/// Creates a fresh temporary directory for `target` (and its parent), after cleaning up.
pub(super) fn prepare_dir(
    target: &Path,
    generation: u64,
    complete: impl Fn(&Path) -> bool,
) -> Result<PathBuf, Error> {
    let (parent, _) = split_target(target)?;
    fs::create_dir_all(&parent).map_err(io_error(|| format!("creating {}", parent.display())))?;
    clean_leftovers(target, complete)?;
    let temp = temp_dir(target, generation)?;
    fs::create_dir(&temp).map_err(io_error(|| format!("creating {}", temp.display())))?;
    Ok(temp)
}

/// Runs `f` on the main process and hands its outcome to every process (so that all fail
/// alike). The main process gets its own error back; the others an [`Error::Checkpoint`] with
/// its message.
#[track_caller]
pub(super) fn on_main_shared<T: Serialize + DeserializeOwned>(
    accelerator: &Accelerator,
    what: &str,
    f: impl FnOnce() -> Result<T, Error>,
) -> Result<Result<T, Error>, Error> {
    let mut own_error = None;
    let shared: Result<T, String> = accelerator.main_process_first_share(|| {
        f().map_err(|e| {
            let message = e.to_string();
            own_error = Some(e);
            message
        })
    })?;
    Ok(match (shared, own_error) {
        (Ok(value), _) => Ok(value),
        (Err(_), Some(own)) => Err(own),
        (Err(message), None) => Err(Error::Checkpoint(format!(
            "the main process failed {what}: {message}"
        ))),
    })
}
