//! Accelerate's automatic checkpoint naming and `total_limit` pruning ([`Checkpoints`]).

use std::{
    fs, io,
    path::{Path, PathBuf},
};

use crate::{Accelerator, Error};

use super::{
    CHECKPOINT_PREFIX, CHECKPOINTS_DIR, MANIFEST_FILE,
    atomic::remove_dir_whole,
    format::io_error,
    state::{CheckpointState, load_state, save_state_with},
};

/// Accelerate's automatic checkpoint naming (`ProjectConfiguration(automatic_checkpoint_naming=
/// True, total_limit=...)`): checkpoints go to `<project>/checkpoints/checkpoint_<n>` with `n`
/// counting up, the oldest beyond `total_limit` are deleted after each save, and
/// [`Checkpoints::load_latest`] resumes from the newest complete one.
#[derive(Debug, Clone)]
pub struct Checkpoints {
    pub(super) root: PathBuf,
    pub(super) total_limit: Option<usize>,
    pub(super) next: u64,
}

impl Checkpoints {
    /// Checkpoints under `<project_dir>/checkpoints`; numbering continues after the newest
    /// one already there.
    pub fn new(project_dir: impl AsRef<Path>) -> Result<Self, Error> {
        let mut checkpoints = Self {
            root: project_dir.as_ref().join(CHECKPOINTS_DIR),
            total_limit: None,
            next: 0,
        };
        checkpoints.next = checkpoints.list()?.last().map_or(0, |(n, _)| n + 1);
        Ok(checkpoints)
    }

    /// Keeps at most `limit` checkpoints (at least 1): older ones are deleted after a save.
    pub fn with_total_limit(mut self, limit: usize) -> Self {
        self.total_limit = Some(limit.max(1));
        self
    }

    /// The directory holding the checkpoints.
    pub fn root(&self) -> &Path {
        &self.root
    }

    /// The number the next save will use (at least).
    pub fn next_iteration(&self) -> u64 {
        self.next
    }

    /// The complete checkpoints (those with a manifest), oldest first. Hidden leftovers of
    /// crashed saves are never listed.
    pub fn list(&self) -> Result<Vec<(u64, PathBuf)>, Error> {
        let entries = match fs::read_dir(&self.root) {
            Ok(entries) => entries,
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(Vec::new()),
            Err(e) => return Err(io_error(|| format!("listing {}", self.root.display()))(e)),
        };
        let mut out: Vec<(u64, PathBuf)> = entries
            .flatten()
            .filter_map(|entry| {
                let name = entry.file_name();
                let n = name
                    .to_str()?
                    .strip_prefix(CHECKPOINT_PREFIX)?
                    .parse()
                    .ok()?;
                let path = entry.path();
                path.join(MANIFEST_FILE).exists().then_some((n, path))
            })
            .collect();
        out.sort();
        Ok(out)
    }

    /// The newest complete checkpoint.
    pub fn latest(&self) -> Result<Option<PathBuf>, Error> {
        Ok(self.list()?.pop().map(|(_, path)| path))
    }

    /// Saves into the next `checkpoint_<n>` (chosen by the main process, so every rank agrees)
    /// as [`save_state`](super::save_state) does, then prunes to `total_limit`. Every process
    /// must call it. Returns the new checkpoint's directory.
    pub fn save(
        &mut self,
        accelerator: &Accelerator,
        state: &CheckpointState<'_>,
    ) -> Result<PathBuf, Error> {
        let choose = || {
            self.clean_root()?;
            let newest = self.list()?.last().map_or(0, |(n, _)| n + 1);
            let n = self.next.max(newest);
            Ok(self.root.join(format!("{CHECKPOINT_PREFIX}{n}")))
        };
        let prune = |saved: &Path| self.prune(saved);
        let saved = save_state_with(accelerator, state, choose, prune)?;
        if let Some(n) = saved
            .file_name()
            .and_then(|n| n.to_str())
            .and_then(|n| n.strip_prefix(CHECKPOINT_PREFIX))
            .and_then(|n| n.parse::<u64>().ok())
        {
            self.next = n + 1;
        }
        Ok(saved)
    }

    /// Removes hidden leftovers of crashed saves and prunes (`.checkpoint_<n>.tmp-…`,
    /// `.checkpoint_<n>.del-…`) under the root.
    fn clean_root(&self) -> Result<(), Error> {
        let Ok(entries) = fs::read_dir(&self.root) else {
            return Ok(());
        };
        for entry in entries.flatten() {
            let name = entry.file_name();
            let Some(name) = name.to_str() else { continue };
            let leftover = name.starts_with(&format!(".{CHECKPOINT_PREFIX}"))
                && (name.contains(".tmp-") || name.contains(".del-"));
            if leftover {
                let path = entry.path();
                fs::remove_dir_all(&path)
                    .map_err(io_error(|| format!("removing {}", path.display())))?;
            }
        }
        Ok(())
    }

    /// Deletes the oldest checkpoints beyond the limit, never `saved`.
    fn prune(&self, saved: &Path) -> Result<(), Error> {
        let Some(limit) = self.total_limit else {
            return Ok(());
        };
        let list = self.list()?;
        let excess = list.len().saturating_sub(limit);
        for (_, path) in list.into_iter().filter(|(_, p)| p != saved).take(excess) {
            remove_dir_whole(&path)?;
        }
        Ok(())
    }

    /// Loads the newest complete checkpoint into `state` (as [`load_state`] does) and
    /// continues the numbering after it; `None` when there is none yet (a fresh run).
    pub fn load_latest(
        &mut self,
        accelerator: &Accelerator,
        state: &mut CheckpointState<'_>,
    ) -> Result<Option<PathBuf>, Error> {
        let Some((n, path)) = self.list()?.pop() else {
            return Ok(None);
        };
        load_state(accelerator, &path, state)?;
        self.next = self.next.max(n + 1);
        Ok(Some(path))
    }
}
