//! The whole training state ([`save_state`], [`load_state`]): every object registered in a
//! [`CheckpointState`], laid out like Accelerate's checkpoints, with the manifest written last.

use std::{
    collections::{BTreeMap, HashMap},
    fmt, fs,
    path::{Path, PathBuf},
};

use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::{Accelerator, Error};

use super::{
    MANIFEST_FILE, MANIFEST_FORMAT, MANIFEST_VERSION,
    atomic::{leftovers, on_main_shared, prepare_dir, replace_dir, temp_dir},
    format::{
        header_metadata, read_json, read_weights, write_json, write_safetensors, write_weights,
    },
    stateful::Stateful,
    tensor::{StateDict, Tensor, message_of},
};

/// What a registered object is, which decides its file name and who writes it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub(super) enum Kind {
    Model,
    Optimizer,
    Scheduler,
    Scaler,
    DataPosition,
    Rng,
    Custom,
}

impl Kind {
    pub(super) fn name(self) -> &'static str {
        match self {
            Kind::Model => "model",
            Kind::Optimizer => "optimizer",
            Kind::Scheduler => "scheduler",
            Kind::Scaler => "scaler",
            Kind::DataPosition => "data_position",
            Kind::Rng => "random generator",
            Kind::Custom => "custom object",
        }
    }

    /// The file stem of the `index`-th object of this kind (Accelerate's naming: `model`,
    /// `model_1`, ...; `custom_checkpoint_0`, ...).
    fn stem(self, index: usize) -> String {
        match (self, index) {
            (Kind::Custom, i) => format!("custom_checkpoint_{i}"),
            (Kind::Rng, _) => "random_states".to_owned(),
            (kind, 0) => kind.name().to_owned(),
            (kind, i) => format!("{}_{i}", kind.name()),
        }
    }
}

/// The name of rank `rank`'s file of random generator states.
pub(super) fn rng_file(rank: usize) -> String {
    format!("random_states_{rank}.json")
}

/// The manifest: written last, it makes a directory a checkpoint.
#[derive(Debug, Serialize, Deserialize)]
pub(super) struct Manifest {
    pub(super) format: String,
    pub(super) version: u32,
    pub(super) num_processes: usize,
    pub(super) entries: Vec<ManifestEntry>,
}

#[derive(Debug, Serialize, Deserialize)]
pub(super) struct ManifestEntry {
    pub(super) kind: Kind,
    pub(super) name: String,
    /// Every file of the entry; the first is the one to open (the weights or their index).
    pub(super) files: Vec<String>,
}

pub(super) struct Entry<'a> {
    pub(super) kind: Kind,
    pub(super) name: String,
    pub(super) object: &'a mut dyn Stateful,
}

/// The objects that make up a training state, registered by kind and name (Accelerate's
/// `prepare` plus `register_for_checkpointing`), for [`save_state`] and [`load_state`].
///
/// The registry borrows the objects (`&mut model`) for one save or load: build it right before
/// the call (it costs nothing) and the borrows end with its last use. Objects shared with other
/// threads register as `&mut Arc<Mutex<T>>`. Loading finds each object by kind and name in the
/// checkpoint, so the order of registration may change between runs; a name missing from the
/// checkpoint is an error naming what it holds.
pub struct CheckpointState<'a> {
    pub(super) entries: Vec<Entry<'a>>,
    pub(super) max_shard_size: u64,
}

impl fmt::Debug for CheckpointState<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CheckpointState")
            .field(
                "entries",
                &self
                    .entries
                    .iter()
                    .map(|e| format!("{} '{}'", e.kind.name(), e.name))
                    .collect::<Vec<_>>(),
            )
            .field("max_shard_size", &self.max_shard_size)
            .finish()
    }
}

impl Default for CheckpointState<'_> {
    fn default() -> Self {
        Self::new()
    }
}

impl<'a> CheckpointState<'a> {
    /// An empty registry whose models are saved unsharded.
    pub fn new() -> Self {
        Self {
            entries: Vec::new(),
            max_shard_size: u64::MAX,
        }
    }

    /// Shards models past `bytes` ([`parse_size`](super::parse_size)), as
    /// [`save_model`](super::save_model) does.
    pub fn set_max_shard_size(&mut self, bytes: u64) -> &mut Self {
        self.max_shard_size = bytes;
        self
    }

    fn register(&mut self, kind: Kind, name: String, object: &'a mut dyn Stateful) -> &mut Self {
        self.entries.push(Entry { kind, name, object });
        self
    }

    /// A model: its tensors go to `model.safetensors` (`model_1...` for the next), sharded
    /// like [`save_model`](super::save_model)'s.
    pub fn register_model<T: Stateful>(
        &mut self,
        name: impl Into<String>,
        model: &'a mut T,
    ) -> &mut Self {
        self.register(Kind::Model, name.into(), model)
    }

    /// An optimizer: `optimizer.safetensors` (`optimizer_1...`), its JSON metadata in the
    /// file's header.
    pub fn register_optimizer<T: Stateful>(
        &mut self,
        name: impl Into<String>,
        optimizer: &'a mut T,
    ) -> &mut Self {
        self.register(Kind::Optimizer, name.into(), optimizer)
    }

    /// A learning-rate scheduler: `scheduler.json` (`.safetensors` if it has tensors).
    pub fn register_scheduler<T: Stateful>(
        &mut self,
        name: impl Into<String>,
        scheduler: &'a mut T,
    ) -> &mut Self {
        self.register(Kind::Scheduler, name.into(), scheduler)
    }

    /// A loss scaler ([`LossScaler`](crate::train::LossScaler)): `scaler.json`.
    pub fn register_scaler<T: Stateful>(
        &mut self,
        name: impl Into<String>,
        scaler: &'a mut T,
    ) -> &mut Self {
        self.register(Kind::Scaler, name.into(), scaler)
    }

    /// The data loader's position ([`DataPosition`](super::DataPosition)): `data_position.json`.
    pub fn register_data_position<T: Stateful>(
        &mut self,
        name: impl Into<String>,
        position: &'a mut T,
    ) -> &mut Self {
        self.register(Kind::DataPosition, name.into(), position)
    }

    /// A random generator ([`SeededRng`](crate::train::SeededRng)): every rank saves its own, into
    /// `random_states_<rank>.json` (all generators of a rank in one file), and loads its own.
    /// Its state must be JSON metadata only.
    pub fn register_rng<T: Stateful>(
        &mut self,
        name: impl Into<String>,
        rng: &'a mut T,
    ) -> &mut Self {
        self.register(Kind::Rng, name.into(), rng)
    }

    /// Any other object: `custom_checkpoint_<i>.json`, or `.safetensors` when its state has
    /// tensors.
    pub fn register_custom<T: Stateful>(
        &mut self,
        name: impl Into<String>,
        object: &'a mut T,
    ) -> &mut Self {
        self.register(Kind::Custom, name.into(), object)
    }

    /// Refuses two objects of one kind under one name: loading could not tell them apart.
    pub(super) fn check_names(&self) -> Result<(), Error> {
        for (i, a) in self.entries.iter().enumerate() {
            if self.entries[..i]
                .iter()
                .any(|b| a.kind == b.kind && a.name == b.name)
            {
                return Err(Error::Usage(format!(
                    "two {}s are registered as '{}' for checkpointing",
                    a.kind.name(),
                    a.name
                )));
            }
        }
        Ok(())
    }
}

/// Writes what the main process saves (everything but random generators) into `temp`, and
/// returns the manifest entries (the generators' with every rank's file).
pub(super) fn write_shared(
    temp: &Path,
    state: &CheckpointState<'_>,
    num_processes: usize,
) -> Result<Vec<ManifestEntry>, Error> {
    let mut counts: HashMap<&'static str, usize> = HashMap::new();
    let mut manifest = Vec::with_capacity(state.entries.len());
    for entry in &state.entries {
        let what = || format!("{} '{}'", entry.kind.name(), entry.name);
        let files = if entry.kind == Kind::Rng {
            (0..num_processes).map(rng_file).collect()
        } else {
            let count = counts.entry(entry.kind.name()).or_default();
            let stem = entry.kind.stem(*count);
            *count += 1;
            let dict = entry
                .object
                .save()
                .map_err(|e| Error::Checkpoint(format!("saving {}: {}", what(), message_of(e))))?;
            match entry.kind {
                Kind::Model => write_weights(temp, &stem, &dict, state.max_shard_size)?.1,
                Kind::Optimizer => write_tensors_file(temp, &stem, &dict)?,
                _ if !dict.is_empty() => write_tensors_file(temp, &stem, &dict)?,
                _ => {
                    let name = format!("{stem}.json");
                    write_json(&temp.join(&name), &dict.metadata)?;
                    vec![name]
                }
            }
        };
        let mut files = files;
        // The weights' index (or single file) first: it is what loading opens.
        if let Some(i) = files.iter().position(|f| f.ends_with(".index.json")) {
            let index = files.remove(i);
            files.insert(0, index);
        }
        manifest.push(ManifestEntry {
            kind: entry.kind,
            name: entry.name.clone(),
            files,
        });
    }
    Ok(manifest)
}

pub(super) fn write_tensors_file(
    temp: &Path,
    stem: &str,
    dict: &StateDict,
) -> Result<Vec<String>, Error> {
    let name = format!("{stem}.safetensors");
    let tensors: Vec<(&str, &Tensor)> = dict.iter().collect();
    write_safetensors(&temp.join(&name), &tensors, header_metadata(dict))?;
    Ok(vec![name])
}

/// Writes this rank's random generator states, if any are registered.
pub(super) fn write_rngs(
    temp: &Path,
    state: &CheckpointState<'_>,
    rank: usize,
) -> Result<(), Error> {
    let mut states = BTreeMap::new();
    for entry in state.entries.iter().filter(|e| e.kind == Kind::Rng) {
        let dict = entry.object.save()?;
        if !dict.is_empty() {
            return Err(Error::Usage(format!(
                "random generator '{}' saved tensors; generator states must be JSON metadata",
                entry.name
            )));
        }
        states.insert(entry.name.clone(), dict.metadata);
    }
    if states.is_empty() {
        return Ok(());
    }
    write_json(&temp.join(rng_file(rank)), &states)
}

/// Saves every registered object into the checkpoint directory `dir` (Accelerate's
/// `save_state(output_dir)`): every process must call it. After a barrier, the main process
/// writes the shared state and each process its random generators into a hidden temporary
/// directory; after a second barrier the main process checks that every file is there, writes
/// the manifest and renames the directory into place (replacing an existing `dir` whole); a
/// third barrier lets every process read the checkpoint once this returns. A failure on the
/// main process is returned on every process.
pub fn save_state(
    accelerator: &Accelerator,
    dir: impl AsRef<Path>,
    state: &CheckpointState<'_>,
) -> Result<(), Error> {
    let dir = dir.as_ref().to_path_buf();
    save_state_with(accelerator, state, || Ok(dir), |_| Ok(())).map(drop)
}

/// The collective save: `choose` picks the directory on the main process, `after` runs there
/// once it is in place (pruning).
pub(super) fn save_state_with(
    accelerator: &Accelerator,
    state: &CheckpointState<'_>,
    choose: impl FnOnce() -> Result<PathBuf, Error>,
    after: impl FnOnce(&Path) -> Result<(), Error>,
) -> Result<PathBuf, Error> {
    state.check_names()?;
    let generation = accelerator.generation();
    let num_processes = accelerator.num_processes();
    accelerator.wait_for_everyone()?;
    let prepared = on_main_shared(accelerator, "to prepare the checkpoint", || {
        let target = choose()?;
        prepare_dir(&target, generation, |p| p.join(MANIFEST_FILE).exists())?;
        Ok(target)
    })?;
    // Every process writes its part even if another failed, and always reaches the barriers,
    // so that a failure is reported everywhere instead of leaving the others waiting.
    let mut own_error = None;
    let mut manifest_entries = None;
    if let Ok(target) = &prepared {
        let written = temp_dir(target, generation).and_then(|temp| {
            write_rngs(&temp, state, accelerator.process_index())?;
            if accelerator.is_main_process() {
                manifest_entries = Some(write_shared(&temp, state, num_processes)?);
            }
            Ok(())
        });
        if let Err(e) = written {
            own_error = Some(e);
        }
    }
    accelerator.wait_for_everyone()?;
    let finished = on_main_shared(accelerator, "to save the checkpoint", || {
        let Ok(target) = &prepared else {
            return Err(Error::Checkpoint(
                "preparing the checkpoint failed".to_owned(),
            ));
        };
        let temp = temp_dir(target, generation)?;
        let result = (|| {
            if let Some(e) = own_error.take() {
                return Err(e);
            }
            let entries = manifest_entries.take().unwrap_or_default();
            finish_checkpoint(&temp, target, entries, num_processes)?;
            after(target)
        })();
        if result.is_err() {
            let _ = fs::remove_dir_all(&temp);
        }
        result.map(|()| target.clone())
    })?;
    accelerator.wait_for_everyone()?;
    // The first failure in order: preparing (everywhere), this process's part, finishing.
    prepared?;
    if let Some(e) = own_error {
        return Err(e);
    }
    finished
}

/// Checks that every rank's files are there, writes the manifest and renames into place.
pub(super) fn finish_checkpoint(
    temp: &Path,
    target: &Path,
    entries: Vec<ManifestEntry>,
    num_processes: usize,
) -> Result<(), Error> {
    for entry in &entries {
        for file in &entry.files {
            if !temp.join(file).exists() {
                return Err(Error::Checkpoint(format!(
                    "{file} of {} '{}' was not written (did its process fail?)",
                    entry.kind.name(),
                    entry.name
                )));
            }
        }
    }
    let manifest = Manifest {
        format: MANIFEST_FORMAT.to_owned(),
        version: MANIFEST_VERSION,
        num_processes,
        entries,
    };
    write_json(&temp.join(MANIFEST_FILE), &manifest)?;
    replace_dir(temp, target)
}

/// Where to read a checkpoint `dir` from: `dir` itself, or, if a crash left it renamed aside
/// with no replacement, that aside copy.
pub(super) fn resolve_checkpoint(dir: &Path) -> Result<PathBuf, Error> {
    if dir.exists() {
        return Ok(dir.to_path_buf());
    }
    for (path, kind) in leftovers(dir)? {
        if kind == "old" && path.join(MANIFEST_FILE).exists() {
            return Ok(path);
        }
    }
    Err(Error::Checkpoint(format!(
        "{} does not exist",
        dir.display()
    )))
}

/// Restores every registered object from the checkpoint directory `dir` (Accelerate's
/// `load_state(input_dir)`): each object's state is found by kind and name in the manifest,
/// read and handed to its [`Stateful::load`]; random generators come from this rank's
/// `random_states_<rank>.json`. Needs no coordination. Errors name the file and the tensor:
/// an incomplete directory (no manifest), a missing file, an object the checkpoint does not
/// hold, a wrong type or shape.
pub fn load_state(
    accelerator: &Accelerator,
    dir: impl AsRef<Path>,
    state: &mut CheckpointState<'_>,
) -> Result<(), Error> {
    load_state_as(dir, accelerator.process_index(), state)
}

/// [`load_state`] for the process of rank `rank`, without an [`Accelerator`] (tools that
/// inspect or convert checkpoints).
pub fn load_state_as(
    dir: impl AsRef<Path>,
    rank: usize,
    state: &mut CheckpointState<'_>,
) -> Result<(), Error> {
    state.check_names()?;
    let dir = resolve_checkpoint(dir.as_ref())?;
    let manifest_path = dir.join(MANIFEST_FILE);
    if !manifest_path.exists() {
        return Err(Error::Checkpoint(format!(
            "{} is not a complete muster checkpoint: {MANIFEST_FILE} is missing",
            dir.display()
        )));
    }
    let manifest: Manifest = read_json(&manifest_path)?;
    if manifest.format != MANIFEST_FORMAT || manifest.version > MANIFEST_VERSION {
        return Err(Error::Checkpoint(format!(
            "{}: format {:?} version {} is not one this muster reads ({MANIFEST_FORMAT:?} \
             version {MANIFEST_VERSION})",
            manifest_path.display(),
            manifest.format,
            manifest.version
        )));
    }
    let mut rng_states: Option<BTreeMap<String, Value>> = None;
    for entry in &mut state.entries {
        let Some(saved) = manifest
            .entries
            .iter()
            .find(|s| s.kind == entry.kind && s.name == entry.name)
        else {
            let held: Vec<String> = manifest
                .entries
                .iter()
                .filter(|s| s.kind == entry.kind)
                .map(|s| format!("'{}'", s.name))
                .collect();
            return Err(Error::Checkpoint(format!(
                "{} holds no {} named '{}' (it holds {})",
                dir.display(),
                entry.kind.name(),
                entry.name,
                if held.is_empty() {
                    "none".to_owned()
                } else {
                    held.join(", ")
                }
            )));
        };
        let (path, dict) = if entry.kind == Kind::Rng {
            let file = rng_file(rank);
            let path = dir.join(&file);
            if !saved.files.contains(&file) {
                return Err(Error::Checkpoint(format!(
                    "{}: no random generator state for rank {rank} (the checkpoint was saved \
                     by {} processes)",
                    dir.display(),
                    manifest.num_processes
                )));
            }
            let mut states = match rng_states.take() {
                Some(states) => states,
                None => read_json::<BTreeMap<String, Value>>(&path)?,
            };
            let metadata = states.remove(&entry.name).ok_or_else(|| {
                Error::Checkpoint(format!(
                    "{}: random generator '{}' is missing",
                    path.display(),
                    entry.name
                ))
            })?;
            rng_states = Some(states);
            let mut dict = StateDict::new();
            dict.metadata = metadata;
            (path, dict)
        } else {
            let file = saved.files.first().ok_or_else(|| {
                Error::Checkpoint(format!(
                    "{}: {} '{}' lists no file",
                    manifest_path.display(),
                    entry.kind.name(),
                    entry.name
                ))
            })?;
            let path = dir.join(file);
            let dict = if entry.kind == Kind::Model || file.ends_with(".safetensors") {
                read_weights(&dir, file)?
            } else {
                let mut dict = StateDict::new();
                dict.metadata = read_json(&path)?;
                dict
            };
            (path, dict)
        };
        entry.object.load(dict).map_err(|e| match e {
            Error::Checkpoint(message) => Error::Checkpoint(format!(
                "{} ({} '{}'): {message}",
                path.display(),
                entry.kind.name(),
                entry.name
            )),
            other => other,
        })?;
    }
    Ok(())
}
