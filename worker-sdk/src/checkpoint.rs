//! Checkpoints: model weights as (sharded) safetensors, and the whole training state.
//!
//! Two layers, as in Accelerate:
//!
//! - **Weights** ([`save_model`], [`load_model`]): a [`StateDict`] of named [`Tensor`]s written
//!   as safetensors in Hugging Face's layout, so that Python's `safetensors` and `transformers`
//!   read it: one `model.safetensors`, or, past `max_shard_size` bytes ([`parse_size`] reads
//!   `"5GB"`), shards named `model-00001-of-00003.safetensors` plus a
//!   `model.safetensors.index.json` holding `{"metadata": {"total_size": N}, "weight_map":
//!   {tensor: shard}}`. Shards are cut as `huggingface_hub` cuts them: tensors in the state
//!   dict's order, a new shard when the next tensor would exceed the limit, and a tensor larger
//!   than the limit alone in a shard of its own.
//! - **Training state** ([`save_state`], [`load_state`], [`Checkpoints`]): every object
//!   registered in a [`CheckpointState`] (models, optimizers, schedulers, loss scalers, data
//!   positions, random generators, anything implementing [`Stateful`]) in one directory laid out
//!   like Accelerate's: `model.safetensors` (sharded like the weights above),
//!   `optimizer.safetensors`, `scheduler.json`, `scaler.json`, `data_position.json`,
//!   `random_states_<rank>.json` (one per process: every rank saves its own generators; all
//!   other state is written by the main process only), `custom_checkpoint_<i>.json` or
//!   `.safetensors`, and `muster_checkpoint.json`, the manifest naming every object and its
//!   files, written last. [`Checkpoints`] adds Accelerate's automatic naming
//!   (`<project>/checkpoints/checkpoint_<n>`) and `total_limit` pruning.
//!
//! **Atomicity.** A checkpoint or weights directory is built under a hidden sibling name
//! (`.<name>.tmp-g<generation>`), every file and the directory fsynced, then renamed into
//! place; an existing directory is first renamed aside (`.<name>.old-…`) and deleted after, so
//! a reader sees the old directory, the new one, or (for the instant between two renames)
//! none, never a mix. Leftovers of a crash are hidden names: never listed or loaded as
//! checkpoints, and cleaned by the next save (an aside copy whose replacement never arrived is
//! renamed back; [`load_state`] reads it if the directory is missing).
//!
//! **Collectives.** [`save_state`] and [`save_model`] must be called by every process: they
//! wait for everyone before writing and after the rename, so every rank can read the
//! checkpoint when they return, and a failure of the main process is reported to every rank.
//! Loading needs no coordination.
//!
//! **Byte order.** safetensors stores little-endian data and [`Tensor`] holds the host's
//! native bytes; muster targets little-endian hosts only (x86-64, aarch64), and refuses to
//! compile elsewhere rather than write wrong files.

use std::{
    collections::{BTreeMap, HashMap},
    fmt,
    fs::{self, File},
    io::{self, BufWriter, Write},
    path::{Path, PathBuf},
    sync::{Arc, Mutex},
    time::{SystemTime, UNIX_EPOCH},
};

use safetensors::{Dtype, SafeTensors, tensor::TensorInfo};
use serde::{Deserialize, Serialize, de::DeserializeOwned};
use serde_json::Value;

use crate::{
    Accelerator, Error,
    comm::{DType, Element},
    train::{LossScaler, SeededRng},
};

#[cfg(not(target_endian = "little"))]
compile_error!(
    "muster's checkpoints write tensors in the host's byte order, and safetensors requires \
     little-endian data: big-endian hosts are not supported"
);

/// The weights file of an unsharded model (Hugging Face's `SAFE_WEIGHTS_NAME`).
pub const MODEL_FILE: &str = "model.safetensors";
/// The index of a sharded model (Hugging Face's `SAFE_WEIGHTS_INDEX_NAME`).
pub const MODEL_INDEX_FILE: &str = "model.safetensors.index.json";
/// The manifest of a training-state checkpoint, written last: a directory without it is not a
/// (complete) checkpoint.
pub const MANIFEST_FILE: &str = "muster_checkpoint.json";
/// What the manifest's `format` field says.
const MANIFEST_FORMAT: &str = "muster-checkpoint";
/// The manifest's version; a newer one is refused rather than misread.
const MANIFEST_VERSION: u32 = 1;
/// The key of a safetensors header's `__metadata__` that holds a [`StateDict`]'s JSON metadata.
const METADATA_KEY: &str = "muster.metadata";
/// The subdirectory of a project that holds [`Checkpoints`]' automatically named checkpoints.
const CHECKPOINTS_DIR: &str = "checkpoints";
/// The prefix of automatically named checkpoints (Accelerate's).
const CHECKPOINT_PREFIX: &str = "checkpoint_";

// ---------------------------------------------------------------------------------------------
// Tensors and state dicts
// ---------------------------------------------------------------------------------------------

/// An owned, dense, row-major tensor: what checkpoints store. `data` holds the elements'
/// bytes in the host's (little-endian) order; typed views go through [`Element`].
#[derive(Clone, PartialEq, Eq)]
pub struct Tensor {
    dtype: DType,
    shape: Vec<usize>,
    data: Vec<u8>,
}

impl fmt::Debug for Tensor {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "Tensor({} {:?}, {} bytes)",
            self.dtype,
            self.shape,
            self.data.len()
        )
    }
}

/// The number of elements of `shape` (1 for a scalar), or `None` on overflow.
fn element_count(shape: &[usize]) -> Option<usize> {
    shape.iter().try_fold(1usize, |n, &d| n.checked_mul(d))
}

impl Tensor {
    /// A tensor from raw bytes (as read from elsewhere); fails unless `data` holds exactly the
    /// bytes that `shape` of `dtype` needs.
    pub fn from_bytes(dtype: DType, shape: Vec<usize>, data: Vec<u8>) -> Result<Self, Error> {
        let expected = element_count(&shape).and_then(|n| n.checked_mul(dtype.size()));
        if expected != Some(data.len()) {
            return Err(Error::Usage(format!(
                "a {dtype} tensor of shape {shape:?} needs {} bytes, got {}",
                expected.map_or_else(|| "more than usize::MAX".to_owned(), |n| n.to_string()),
                data.len()
            )));
        }
        Ok(Self { dtype, shape, data })
    }

    /// A tensor of `shape` holding `values` (row-major); fails unless the counts agree.
    pub fn from_slice<T: Element>(shape: &[usize], values: &[T]) -> Result<Self, Error> {
        Self::from_bytes(
            T::DTYPE,
            shape.to_vec(),
            bytemuck::cast_slice(values).to_vec(),
        )
    }

    /// A one-dimensional tensor of `values`.
    pub fn vector<T: Element>(values: &[T]) -> Self {
        Self {
            dtype: T::DTYPE,
            shape: vec![values.len()],
            data: bytemuck::cast_slice(values).to_vec(),
        }
    }

    /// A zero-dimensional tensor (shape `[]`) of one value.
    pub fn scalar<T: Element>(value: T) -> Self {
        Self {
            dtype: T::DTYPE,
            shape: Vec::new(),
            data: bytemuck::bytes_of(&value).to_vec(),
        }
    }

    /// A tensor of zeros (every supported type's zero is all-zero bytes).
    pub fn zeros(dtype: DType, shape: &[usize]) -> Result<Self, Error> {
        let bytes = element_count(shape)
            .and_then(|n| n.checked_mul(dtype.size()))
            .ok_or_else(|| Error::Usage(format!("a tensor of shape {shape:?} is too large")))?;
        Ok(Self {
            dtype,
            shape: shape.to_vec(),
            data: vec![0; bytes],
        })
    }

    /// The element type.
    pub fn dtype(&self) -> DType {
        self.dtype
    }

    /// The shape (empty for a scalar).
    pub fn shape(&self) -> &[usize] {
        &self.shape
    }

    /// The number of elements.
    pub fn numel(&self) -> usize {
        self.data.len() / self.dtype.size()
    }

    /// The size of the data in bytes (what shard limits and `total_size` count).
    pub fn nbytes(&self) -> usize {
        self.data.len()
    }

    /// The raw little-endian bytes.
    pub fn bytes(&self) -> &[u8] {
        &self.data
    }

    /// The raw bytes, without copying.
    pub fn into_bytes(self) -> Vec<u8> {
        self.data
    }

    /// The elements as `T`; fails (naming both types) unless the tensor holds `T`s.
    pub fn to_vec<T: Element>(&self) -> Result<Vec<T>, Error> {
        if self.dtype != T::DTYPE {
            return Err(Error::Checkpoint(format!(
                "the tensor holds {}, not {}",
                self.dtype,
                T::DTYPE
            )));
        }
        // Copies through an aligned buffer: `data` is only byte-aligned.
        Ok(bytemuck::pod_collect_to_vec(&self.data))
    }

    /// Checks the type and shape against what a loader expects, with a message that says both.
    pub fn check(&self, dtype: DType, shape: &[usize]) -> Result<(), Error> {
        if self.dtype != dtype || self.shape != shape {
            return Err(Error::Checkpoint(format!(
                "found {} {:?} where {dtype} {shape:?} was expected",
                self.dtype, self.shape
            )));
        }
        Ok(())
    }
}

/// Named tensors plus JSON metadata: what one checkpointed object saves and loads (a model's
/// parameters, an optimizer's moments and step count, a scheduler's position). Tensors keep
/// their insertion order, which decides how a model is sharded; comparisons ignore it.
#[derive(Debug, Clone, Default)]
pub struct StateDict {
    tensors: Vec<(String, Tensor)>,
    index: HashMap<String, usize>,
    metadata: Value,
}

impl PartialEq for StateDict {
    fn eq(&self, other: &Self) -> bool {
        self.metadata == other.metadata
            && self.tensors.len() == other.tensors.len()
            && self
                .tensors
                .iter()
                .all(|(name, tensor)| other.get(name) == Some(tensor))
    }
}

impl StateDict {
    /// An empty state dict (no tensors, `null` metadata).
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds or replaces (in place, keeping its position) the tensor called `name`; returns the
    /// one it replaced.
    pub fn insert(&mut self, name: impl Into<String>, tensor: Tensor) -> Option<Tensor> {
        let name = name.into();
        if let Some(&i) = self.index.get(&name) {
            return Some(std::mem::replace(&mut self.tensors[i].1, tensor));
        }
        self.index.insert(name.clone(), self.tensors.len());
        self.tensors.push((name, tensor));
        None
    }

    /// [`StateDict::insert`] for building a state dict in one expression.
    pub fn with(mut self, name: impl Into<String>, tensor: Tensor) -> Self {
        self.insert(name, tensor);
        self
    }

    /// The tensor called `name`.
    pub fn get(&self, name: &str) -> Option<&Tensor> {
        self.index.get(name).map(|&i| &self.tensors[i].1)
    }

    /// The tensor called `name`, or an error naming it (for loaders).
    pub fn tensor(&self, name: &str) -> Result<&Tensor, Error> {
        self.get(name)
            .ok_or_else(|| Error::Checkpoint(format!("tensor '{name}' is missing")))
    }

    /// Removes and returns the tensor called `name`.
    pub fn remove(&mut self, name: &str) -> Option<Tensor> {
        let i = self.index.remove(name)?;
        let (_, tensor) = self.tensors.remove(i);
        for (position, (name, _)) in self.tensors.iter().enumerate().skip(i) {
            self.index.insert(name.clone(), position);
        }
        Some(tensor)
    }

    /// Removes the tensor called `name` and returns its elements, after checking that it holds
    /// `T`s of `shape`: the loader's one call per parameter, whose error names the tensor.
    pub fn take<T: Element>(&mut self, name: &str, shape: &[usize]) -> Result<Vec<T>, Error> {
        let tensor = self.tensor(name)?;
        tensor
            .check(T::DTYPE, shape)
            .map_err(|e| Error::Checkpoint(format!("tensor '{name}': {}", message_of(e))))?;
        let values = tensor.to_vec()?;
        self.remove(name);
        Ok(values)
    }

    /// Copies the tensor called `name` into `out`, after checking that it holds `T`s of
    /// `shape` (and that `out` has room for exactly that many).
    pub fn read_into<T: Element>(
        &self,
        name: &str,
        shape: &[usize],
        out: &mut [T],
    ) -> Result<(), Error> {
        let tensor = self.tensor(name)?;
        tensor
            .check(T::DTYPE, shape)
            .map_err(|e| Error::Checkpoint(format!("tensor '{name}': {}", message_of(e))))?;
        if out.len() != tensor.numel() {
            return Err(Error::Usage(format!(
                "tensor '{name}' has {} elements but the destination holds {}",
                tensor.numel(),
                out.len()
            )));
        }
        bytemuck::cast_slice_mut::<T, u8>(out).copy_from_slice(tensor.bytes());
        Ok(())
    }

    /// The tensors, in insertion order.
    pub fn iter(&self) -> impl Iterator<Item = (&str, &Tensor)> {
        self.tensors.iter().map(|(name, t)| (name.as_str(), t))
    }

    /// The tensor names, in insertion order.
    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.tensors.iter().map(|(name, _)| name.as_str())
    }

    /// How many tensors.
    pub fn len(&self) -> usize {
        self.tensors.len()
    }

    /// Whether there are no tensors (the metadata may still hold state).
    pub fn is_empty(&self) -> bool {
        self.tensors.is_empty()
    }

    /// The bytes of every tensor together (an index's `total_size`).
    pub fn total_size(&self) -> u64 {
        self.tensors.iter().map(|(_, t)| t.nbytes() as u64).sum()
    }

    /// The JSON metadata (`null` unless set).
    pub fn metadata(&self) -> &Value {
        &self.metadata
    }

    /// Replaces the JSON metadata.
    pub fn set_metadata(&mut self, metadata: Value) {
        self.metadata = metadata;
    }

    /// Sets the metadata to `value` as JSON (an optimizer's hyperparameters, a scheduler's
    /// step), for building a state dict in one expression.
    pub fn with_metadata(mut self, value: &impl Serialize) -> Result<Self, Error> {
        self.metadata = serde_json::to_value(value).map_err(|source| Error::Serialization {
            what: "checkpoint metadata".to_owned(),
            source,
        })?;
        Ok(self)
    }

    /// The metadata decoded as `T`; the error says what did not fit.
    pub fn metadata_as<T: DeserializeOwned>(&self) -> Result<T, Error> {
        T::deserialize(&self.metadata)
            .map_err(|e| Error::Checkpoint(format!("metadata {}: {e}", self.metadata)))
    }
}

/// The message of an error without its variant's prefix (to nest it in another message).
fn message_of(error: Error) -> String {
    match error {
        Error::Checkpoint(message) | Error::Usage(message) => message,
        other => other.to_string(),
    }
}

// ---------------------------------------------------------------------------------------------
// Stateful objects
// ---------------------------------------------------------------------------------------------

/// Something whose state goes into checkpoints (Accelerate's `state_dict()` /
/// `load_state_dict()` protocol): a model, an optimizer, a scheduler, a generator or any user
/// object registered with [`CheckpointState`].
pub trait Stateful {
    /// The state to save.
    fn save(&self) -> Result<StateDict, Error>;

    /// Restores a state that [`Stateful::save`] produced, checking it: a missing tensor, a
    /// wrong type or shape is an [`Error::Checkpoint`] naming the tensor (the checkpoint code
    /// adds the file). [`StateDict::take`] and [`StateDict::metadata_as`] do the checking.
    fn load(&mut self, state: StateDict) -> Result<(), Error>;
}

/// A state dict is its own state. A non-empty one is a template: loading checks that the
/// checkpoint holds exactly its tensor names, with the same types and shapes (strict, like
/// torch's `load_state_dict`), then takes the checkpoint's values; an empty one takes whatever
/// the checkpoint holds.
impl Stateful for StateDict {
    fn save(&self) -> Result<StateDict, Error> {
        Ok(self.clone())
    }

    fn load(&mut self, state: StateDict) -> Result<(), Error> {
        if !self.is_empty() {
            for (name, expected) in self.iter() {
                let found = state.tensor(name)?;
                found
                    .check(expected.dtype(), expected.shape())
                    .map_err(|e| {
                        Error::Checkpoint(format!("tensor '{name}': {}", message_of(e)))
                    })?;
            }
            if let Some(extra) = state.names().find(|name| self.get(name).is_none()) {
                return Err(Error::Checkpoint(format!(
                    "unexpected tensor '{extra}' (the checkpoint holds {} tensors, {} were \
                     expected)",
                    state.len(),
                    self.len()
                )));
            }
            // Keep the template's order: it is the model's.
            let mut state = state;
            let mut ordered = StateDict::new();
            for name in self.names() {
                if let Some(tensor) = state.remove(name) {
                    ordered.insert(name, tensor);
                }
            }
            ordered.metadata = std::mem::take(&mut state.metadata);
            *self = ordered;
            return Ok(());
        }
        *self = state;
        Ok(())
    }
}

/// Saved as `{"state": <u64>}`.
impl Stateful for SeededRng {
    fn save(&self) -> Result<StateDict, Error> {
        StateDict::new().with_metadata(&serde_json::json!({ "state": self.state() }))
    }

    fn load(&mut self, state: StateDict) -> Result<(), Error> {
        #[derive(Deserialize)]
        struct Saved {
            state: u64,
        }
        let saved: Saved = state.metadata_as()?;
        // A generator seeded with its state continues exactly where the saved one stopped.
        *self = SeededRng::new(saved.state);
        Ok(())
    }
}

/// Saved as `{"scale": <f32>, "clean_steps": <u32>}`.
impl Stateful for LossScaler {
    fn save(&self) -> Result<StateDict, Error> {
        let (scale, clean_steps) = self.state();
        StateDict::new()
            .with_metadata(&serde_json::json!({ "scale": scale, "clean_steps": clean_steps }))
    }

    fn load(&mut self, state: StateDict) -> Result<(), Error> {
        #[derive(Deserialize)]
        struct Saved {
            scale: f32,
            clean_steps: u32,
        }
        let saved: Saved = state.metadata_as()?;
        self.set_state(saved.scale, saved.clean_steps);
        Ok(())
    }
}

/// Where the data loader stands, so that a resumed run skips what it already trained on
/// (Accelerate's `skip_first_batches`). The same on every rank; saved by the main process.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct DataPosition {
    /// The epoch in progress.
    pub epoch: u64,
    /// Batches of that epoch already consumed.
    pub step: u64,
}

/// Saved as `{"epoch": <u64>, "step": <u64>}`.
impl Stateful for DataPosition {
    fn save(&self) -> Result<StateDict, Error> {
        StateDict::new().with_metadata(self)
    }

    fn load(&mut self, state: StateDict) -> Result<(), Error> {
        *self = state.metadata_as()?;
        Ok(())
    }
}

/// A mutable reference saves and loads what it points to.
impl<T: Stateful + ?Sized> Stateful for &mut T {
    fn save(&self) -> Result<StateDict, Error> {
        (**self).save()
    }

    fn load(&mut self, state: StateDict) -> Result<(), Error> {
        (**self).load(state)
    }
}

/// An owned object.
impl<T: Stateful + ?Sized> Stateful for Box<T> {
    fn save(&self) -> Result<StateDict, Error> {
        (**self).save()
    }

    fn load(&mut self, state: StateDict) -> Result<(), Error> {
        (**self).load(state)
    }
}

/// An object shared with other threads: locked for the save or load.
impl<T: Stateful + ?Sized> Stateful for Arc<Mutex<T>> {
    fn save(&self) -> Result<StateDict, Error> {
        self.lock()
            .map_err(|_| Error::Usage("a checkpointed object's mutex is poisoned".to_owned()))?
            .save()
    }

    fn load(&mut self, state: StateDict) -> Result<(), Error> {
        self.lock()
            .map_err(|_| Error::Usage("a checkpointed object's mutex is poisoned".to_owned()))?
            .load(state)
    }
}

// ---------------------------------------------------------------------------------------------
// Size parsing and sharding
// ---------------------------------------------------------------------------------------------

/// Parses a shard size the way Hugging Face's `max_shard_size` does: a plain byte count
/// (`"1000"`), decimal units (`"10KB"`, `"500MB"`, `"5GB"`, `"1TB"`: powers of 1000), binary
/// units (`"64KiB"`, `"2GiB"`: powers of 1024), and bits with a lowercase final `b` (`"8Mb"` and
/// `"8mb"` are 1 MB, as in transformers). Units are otherwise case-insensitive.
pub fn parse_size(text: &str) -> Result<u64, Error> {
    let bad = |why: &str| Error::Usage(format!("bad size {text:?}: {why}"));
    let trimmed = text.trim();
    let digits_end = trimmed
        .find(|c: char| !c.is_ascii_digit())
        .unwrap_or(trimmed.len());
    let (number, unit) = trimmed.split_at(digits_end);
    if number.is_empty() {
        return Err(bad(
            "expected a number of bytes, such as \"5GB\" or \"500MB\"",
        ));
    }
    let number: u64 = number.parse().map_err(|_| bad("the number is too large"))?;
    let unit = unit.trim();
    let bits = unit.len() > 1 && unit.ends_with('b') && !unit.ends_with("ib");
    let multiplier: u64 = match unit.to_ascii_uppercase().as_str() {
        "" | "B" => 1,
        "KB" => 1_000,
        "MB" => 1_000_000,
        "GB" => 1_000_000_000,
        "TB" => 1_000_000_000_000,
        "KIB" => 1 << 10,
        "MIB" => 1 << 20,
        "GIB" => 1 << 30,
        "TIB" => 1 << 40,
        _ => {
            return Err(bad(
                "the unit must be one of B, KB, MB, GB, TB, KiB, MiB, GiB, TiB",
            ));
        }
    };
    let bytes = number
        .checked_mul(multiplier)
        .ok_or_else(|| bad("the size is too large"))?;
    Ok(if bits { bytes / 8 } else { bytes })
}

/// Splits tensors (by size in bytes, in order) into shards of at most `max` bytes, as
/// `huggingface_hub.split_state_dict_into_shards_factory` does: a new shard starts when the
/// next tensor would exceed the limit; a tensor larger than the limit gets a shard of its own
/// at once, while the shard being filled stays open. Returns indices into `sizes`.
fn plan_shards(sizes: &[u64], max: u64) -> Vec<Vec<usize>> {
    let mut shards = Vec::new();
    let mut current = Vec::new();
    let mut current_size = 0u64;
    for (i, &size) in sizes.iter().enumerate() {
        if size > max {
            shards.push(vec![i]);
            continue;
        }
        if current_size + size > max {
            shards.push(std::mem::take(&mut current));
            current_size = 0;
        }
        current.push(i);
        current_size += size;
    }
    if !current.is_empty() || shards.is_empty() {
        shards.push(current);
    }
    shards
}

/// Hugging Face's shard name: `model-00001-of-00003.safetensors` for stem `model`.
fn shard_name(stem: &str, index: usize, count: usize) -> String {
    format!("{stem}-{:05}-of-{count:05}.safetensors", index + 1)
}

/// Whether `name` is one of the weight files of `stem` (single file, index or shard).
fn is_weight_file(name: &str, stem: &str) -> bool {
    if name == format!("{stem}.safetensors") || name == format!("{stem}.safetensors.index.json") {
        return true;
    }
    let Some(rest) = name
        .strip_prefix(stem)
        .and_then(|r| r.strip_prefix('-'))
        .and_then(|r| r.strip_suffix(".safetensors"))
    else {
        return false;
    };
    let bytes = rest.as_bytes();
    bytes.len() == 14
        && &bytes[5..9] == b"-of-"
        && bytes[..5].iter().chain(&bytes[9..]).all(u8::is_ascii_digit)
}

/// The index of a sharded model, in Hugging Face's layout.
#[derive(Debug, Serialize, Deserialize)]
struct WeightIndex {
    #[serde(default)]
    metadata: BTreeMap<String, Value>,
    weight_map: BTreeMap<String, String>,
}

// ---------------------------------------------------------------------------------------------
// Files
// ---------------------------------------------------------------------------------------------

fn io_error(what: impl FnOnce() -> String) -> impl FnOnce(io::Error) -> Error {
    move |source| Error::Io {
        what: what(),
        source,
    }
}

/// Creates `path`, lets `write` fill it through a buffer, and fsyncs it.
fn write_file(
    path: &Path,
    write: impl FnOnce(&mut BufWriter<&File>) -> io::Result<()>,
) -> Result<(), Error> {
    let result = (|| {
        let file = File::create(path)?;
        let mut writer = BufWriter::with_capacity(1 << 20, &file);
        write(&mut writer)?;
        writer.flush()?;
        drop(writer);
        file.sync_all()
    })();
    result.map_err(io_error(|| format!("writing {}", path.display())))
}

/// Writes `value` as pretty JSON with a final newline (as transformers writes its index).
fn write_json(path: &Path, value: &impl Serialize) -> Result<(), Error> {
    let mut text = serde_json::to_string_pretty(value).map_err(|source| Error::Serialization {
        what: path.display().to_string(),
        source,
    })?;
    text.push('\n');
    write_file(path, |w| w.write_all(text.as_bytes()))
}

/// Reads a whole file; a missing one is a bad checkpoint, not an I/O failure.
fn read_file(path: &Path) -> Result<Vec<u8>, Error> {
    fs::read(path).map_err(|source| {
        if source.kind() == io::ErrorKind::NotFound {
            Error::Checkpoint(format!("{} is missing", path.display()))
        } else {
            Error::Io {
                what: format!("reading {}", path.display()),
                source,
            }
        }
    })
}

fn read_json<T: DeserializeOwned>(path: &Path) -> Result<T, Error> {
    let bytes = read_file(path)?;
    serde_json::from_slice(&bytes)
        .map_err(|e| Error::Checkpoint(format!("{}: not the expected JSON: {e}", path.display())))
}

fn fsync_dir(dir: &Path) -> Result<(), Error> {
    File::open(dir)
        .and_then(|d| d.sync_all())
        .map_err(io_error(|| format!("syncing directory {}", dir.display())))
}

fn to_safetensors(dtype: DType) -> Dtype {
    match dtype {
        DType::F32 => Dtype::F32,
        DType::F64 => Dtype::F64,
        DType::F16 => Dtype::F16,
        DType::BF16 => Dtype::BF16,
        DType::I32 => Dtype::I32,
        DType::I64 => Dtype::I64,
        DType::U8 => Dtype::U8,
    }
}

fn from_safetensors(dtype: Dtype) -> Option<DType> {
    Some(match dtype {
        Dtype::F32 => DType::F32,
        Dtype::F64 => DType::F64,
        Dtype::F16 => DType::F16,
        Dtype::BF16 => DType::BF16,
        Dtype::I32 => DType::I32,
        Dtype::I64 => DType::I64,
        Dtype::U8 => DType::U8,
        _ => return None,
    })
}

/// Writes one safetensors file, streaming the tensors' bytes (no copy of the whole file in
/// memory). Tensors are laid out as `safetensors::serialize` lays them out (by decreasing
/// alignment, then by name); the header's keys come in a fixed order (unlike the reference
/// writer's, which follow a `HashMap`), so the same state always gives the same bytes.
fn write_safetensors(
    path: &Path,
    tensors: &[(&str, &Tensor)],
    metadata: BTreeMap<String, String>,
) -> Result<(), Error> {
    let mut order: Vec<&(&str, &Tensor)> = tensors.iter().collect();
    order.sort_by(|(a_name, a), (b_name, b)| {
        to_safetensors(b.dtype)
            .cmp(&to_safetensors(a.dtype))
            .then(a_name.cmp(b_name))
    });
    let mut offset = 0;
    let infos: Vec<(String, TensorInfo)> = order
        .iter()
        .map(|(name, tensor)| {
            let info = TensorInfo {
                dtype: to_safetensors(tensor.dtype),
                shape: tensor.shape.clone(),
                data_offsets: (offset, offset + tensor.nbytes()),
            };
            offset += tensor.nbytes();
            ((*name).to_owned(), info)
        })
        .collect();
    let bad = |e: &dyn fmt::Display| Error::Checkpoint(format!("{}: {e}", path.display()));
    let mut header = serde_json::Map::new();
    if !metadata.is_empty() {
        header.insert("__metadata__".to_owned(), serde_json::json!(metadata));
    }
    for (name, info) in &infos {
        header.insert(
            name.clone(),
            serde_json::to_value(info).map_err(|e| bad(&e))?,
        );
    }
    // What the reader will check, checked before anything is written.
    safetensors::tensor::Metadata::new(Some(metadata.into_iter().collect()), infos)
        .map_err(|e| bad(&e))?;
    let mut header = serde_json::to_vec(&header).map_err(|e| bad(&e))?;
    header.resize(header.len().next_multiple_of(8), b' ');
    write_file(path, |w| {
        w.write_all(&(header.len() as u64).to_le_bytes())?;
        w.write_all(&header)?;
        for (_, tensor) in order {
            w.write_all(tensor.bytes())?;
        }
        Ok(())
    })
}

/// Tensors with their names, in order.
type NamedTensors = Vec<(String, Tensor)>;

/// Reads one safetensors file: its tensors in file order and its `__metadata__`.
fn read_safetensors(path: &Path) -> Result<(NamedTensors, HashMap<String, String>), Error> {
    let bytes = read_file(path)?;
    let bad = |e: &dyn fmt::Display| {
        Error::Checkpoint(format!(
            "{}: not a valid safetensors file: {e}",
            path.display()
        ))
    };
    let (_, header) = SafeTensors::read_metadata(&bytes).map_err(|e| bad(&e))?;
    let file = SafeTensors::deserialize(&bytes).map_err(|e| bad(&e))?;
    let mut tensors = Vec::with_capacity(file.len());
    for name in header.offset_keys() {
        let view = file.tensor(&name).map_err(|e| bad(&e))?;
        let dtype = from_safetensors(view.dtype()).ok_or_else(|| {
            Error::Checkpoint(format!(
                "{}: tensor '{name}' has type {}, which muster does not support",
                path.display(),
                view.dtype()
            ))
        })?;
        let tensor = Tensor {
            dtype,
            shape: view.shape().to_vec(),
            data: view.data().to_vec(),
        };
        tensors.push((name, tensor));
    }
    Ok((tensors, header.metadata().clone().unwrap_or_default()))
}

/// The safetensors `__metadata__` of a state dict's file: transformers' `{"format": "pt"}`
/// (which `from_pretrained` insists on) plus the state dict's JSON metadata, if any.
fn header_metadata(state: &StateDict) -> BTreeMap<String, String> {
    let mut metadata = BTreeMap::from([("format".to_owned(), "pt".to_owned())]);
    if !state.metadata.is_null() {
        metadata.insert(METADATA_KEY.to_owned(), state.metadata.to_string());
    }
    metadata
}

/// Restores a state dict's JSON metadata from a safetensors header.
fn metadata_from_header(path: &Path, header: &HashMap<String, String>) -> Result<Value, Error> {
    match header.get(METADATA_KEY) {
        None => Ok(Value::Null),
        Some(text) => serde_json::from_str(text).map_err(|e| {
            Error::Checkpoint(format!(
                "{}: the {METADATA_KEY} header is not JSON: {e}",
                path.display()
            ))
        }),
    }
}

/// Writes `state` as the weights `<stem>.safetensors`, or as shards and
/// `<stem>.safetensors.index.json` when it exceeds `max_shard_size`, into `dir`. Returns the
/// file to open first (the single file or the index) and every file written.
fn write_weights(
    dir: &Path,
    stem: &str,
    state: &StateDict,
    max_shard_size: u64,
) -> Result<(String, Vec<String>), Error> {
    let sizes: Vec<u64> = state
        .tensors
        .iter()
        .map(|(_, t)| t.nbytes() as u64)
        .collect();
    let shards = plan_shards(&sizes, max_shard_size);
    let metadata = header_metadata(state);
    let tensors_of = |indices: &[usize]| -> Vec<(&str, &Tensor)> {
        indices
            .iter()
            .map(|&i| (state.tensors[i].0.as_str(), &state.tensors[i].1))
            .collect()
    };
    if shards.len() == 1 {
        let name = format!("{stem}.safetensors");
        write_safetensors(&dir.join(&name), &tensors_of(&shards[0]), metadata)?;
        return Ok((name.clone(), vec![name]));
    }
    let mut files = Vec::with_capacity(shards.len() + 1);
    let mut weight_map = BTreeMap::new();
    for (i, shard) in shards.iter().enumerate() {
        let name = shard_name(stem, i, shards.len());
        let tensors = tensors_of(shard);
        write_safetensors(&dir.join(&name), &tensors, metadata.clone())?;
        for (tensor, _) in tensors {
            weight_map.insert(tensor.to_owned(), name.clone());
        }
        files.push(name);
    }
    let index = WeightIndex {
        metadata: BTreeMap::from([("total_size".to_owned(), Value::from(state.total_size()))]),
        weight_map,
    };
    let index_name = format!("{stem}.safetensors.index.json");
    write_json(&dir.join(&index_name), &index)?;
    files.push(index_name.clone());
    Ok((index_name, files))
}

/// Reads weights written by [`write_weights`] (or by transformers): `file` is the single
/// safetensors file or the index. Checks that every tensor of the index is in its shard.
fn read_weights(dir: &Path, file: &str) -> Result<StateDict, Error> {
    let mut state = StateDict::new();
    if !file.ends_with(".index.json") {
        let path = dir.join(file);
        let (tensors, header) = read_safetensors(&path)?;
        for (name, tensor) in tensors {
            state.insert(name, tensor);
        }
        state.metadata = metadata_from_header(&path, &header)?;
        return Ok(state);
    }
    let index_path = dir.join(file);
    let index: WeightIndex = read_json(&index_path)?;
    // Shards in name order (their numbering), each read once.
    let mut shards: BTreeMap<&str, Vec<&str>> = BTreeMap::new();
    for (tensor, shard) in &index.weight_map {
        if shard.contains('/') || shard.contains('\\') || shard == ".." {
            return Err(Error::Checkpoint(format!(
                "{}: shard name {shard:?} of tensor '{tensor}' is not a file name",
                index_path.display()
            )));
        }
        shards.entry(shard).or_default().push(tensor);
    }
    for (shard, expected) in shards {
        let path = dir.join(shard);
        let (tensors, header) = read_safetensors(&path)?;
        let mut found: HashMap<String, Tensor> = tensors.into_iter().collect();
        for tensor in expected {
            let value = found.remove(tensor).ok_or_else(|| {
                Error::Checkpoint(format!(
                    "{}: tensor '{tensor}' is missing (the index {} places it there)",
                    path.display(),
                    index_path.display()
                ))
            })?;
            state.insert(tensor, value);
        }
        if state.metadata.is_null() {
            state.metadata = metadata_from_header(&path, &header)?;
        }
    }
    Ok(state)
}

// ---------------------------------------------------------------------------------------------
// Atomic directories
// ---------------------------------------------------------------------------------------------

/// The parent and final name of a target directory.
fn split_target(target: &Path) -> Result<(PathBuf, String), Error> {
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
fn temp_dir(target: &Path, generation: u64) -> Result<PathBuf, Error> {
    let (parent, name) = split_target(target)?;
    Ok(parent.join(format!(".{name}.tmp-g{generation}")))
}

/// A name no other aside or deletion directory has.
fn unique_suffix() -> String {
    let nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos());
    format!("{}-{nanos}", std::process::id())
}

/// The hidden leftovers of earlier saves of `target`: `(path, kind)` with kind `tmp`, `old` or
/// `del`.
fn leftovers(target: &Path) -> Result<Vec<(PathBuf, String)>, Error> {
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
fn clean_leftovers(target: &Path, complete: impl Fn(&Path) -> bool) -> Result<(), Error> {
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
fn replace_dir(temp: &Path, target: &Path) -> Result<(), Error> {
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
fn remove_dir_whole(dir: &Path) -> Result<(), Error> {
    let (parent, name) = split_target(dir)?;
    let doomed = parent.join(format!(".{name}.del-{}", unique_suffix()));
    fs::rename(dir, &doomed).map_err(io_error(|| format!("removing {}", dir.display())))?;
    fs::remove_dir_all(&doomed).map_err(io_error(|| format!("removing {}", doomed.display())))
}

/// Creates a fresh temporary directory for `target` (and its parent), after cleaning up.
fn prepare_dir(
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
fn on_main_shared<T: Serialize + DeserializeOwned>(
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

// ---------------------------------------------------------------------------------------------
// Weights
// ---------------------------------------------------------------------------------------------

/// Writes a model's weights into `dir` in Hugging Face's layout (see the module docs),
/// without coordination: what [`save_model`] runs on the main process, for tools and for
/// single-process code without an [`Accelerator`]. `dir` is replaced as a whole and
/// atomically; other files in an existing `dir` (a `config.json`) are carried over, old weight
/// files are not.
pub fn write_model(dir: &Path, state: &StateDict, max_shard_size: u64) -> Result<(), Error> {
    write_model_in(dir, state, max_shard_size, 0)
}

fn write_model_in(
    dir: &Path,
    state: &StateDict,
    max_shard_size: u64,
    generation: u64,
) -> Result<(), Error> {
    let temp = prepare_dir(dir, generation, |path| {
        path.join(MODEL_FILE).exists() || path.join(MODEL_INDEX_FILE).exists()
    })?;
    let result = (|| {
        write_weights(&temp, "model", state, max_shard_size)?;
        carry_over(dir, &temp)?;
        replace_dir(&temp, dir)
    })();
    if result.is_err() {
        let _ = fs::remove_dir_all(&temp);
    }
    result
}

/// Hard-links (or copies) the regular files of `old` that are not model weights into `new`.
fn carry_over(old: &Path, new: &Path) -> Result<(), Error> {
    let entries = match fs::read_dir(old) {
        Ok(entries) => entries,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(()),
        Err(e) => return Err(io_error(|| format!("listing {}", old.display()))(e)),
    };
    for entry in entries.flatten() {
        let name = entry.file_name();
        let keep = entry.file_type().is_ok_and(|t| t.is_file())
            && name.to_str().is_some_and(|n| !is_weight_file(n, "model"));
        if keep {
            let (from, to) = (entry.path(), new.join(&name));
            fs::hard_link(&from, &to)
                .or_else(|_| fs::copy(&from, &to).map(drop))
                .map_err(io_error(|| {
                    format!("copying {} to {}", from.display(), to.display())
                }))?;
        }
    }
    Ok(())
}

/// Saves a model's weights into `dir` (Accelerate's `save_model`): safetensors in Hugging
/// Face's layout, sharded past `max_shard_size` bytes ([`parse_size`]), written by the main
/// process only, atomically, between two barriers: every process must call it, and every
/// process can read the weights when it returns. See [`write_model`] for what happens to an
/// existing `dir`.
pub fn save_model(
    accelerator: &Accelerator,
    dir: impl AsRef<Path>,
    state: &StateDict,
    max_shard_size: u64,
) -> Result<(), Error> {
    let dir = dir.as_ref();
    accelerator.wait_for_everyone()?;
    let outcome = on_main_shared(accelerator, "to save the model", || {
        write_model_in(dir, state, max_shard_size, accelerator.generation())
    })?;
    accelerator.wait_for_everyone()?;
    outcome
}

/// Loads a model's weights from `dir`, written by [`save_model`] or by transformers'
/// `save_pretrained`: `model.safetensors` if present (as transformers prefers it), else the
/// shards listed by `model.safetensors.index.json`. Tensors come in file order.
pub fn load_model(dir: impl AsRef<Path>) -> Result<StateDict, Error> {
    let dir = dir.as_ref();
    if dir.join(MODEL_FILE).exists() {
        return read_weights(dir, MODEL_FILE);
    }
    if dir.join(MODEL_INDEX_FILE).exists() {
        return read_weights(dir, MODEL_INDEX_FILE);
    }
    Err(Error::Checkpoint(format!(
        "{} holds neither {MODEL_FILE} nor {MODEL_INDEX_FILE}",
        dir.display()
    )))
}

// ---------------------------------------------------------------------------------------------
// Training state
// ---------------------------------------------------------------------------------------------

/// What a registered object is, which decides its file name and who writes it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
enum Kind {
    Model,
    Optimizer,
    Scheduler,
    Scaler,
    DataPosition,
    Rng,
    Custom,
}

impl Kind {
    fn name(self) -> &'static str {
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
fn rng_file(rank: usize) -> String {
    format!("random_states_{rank}.json")
}

/// The manifest: written last, it makes a directory a checkpoint.
#[derive(Debug, Serialize, Deserialize)]
struct Manifest {
    format: String,
    version: u32,
    num_processes: usize,
    entries: Vec<ManifestEntry>,
}

#[derive(Debug, Serialize, Deserialize)]
struct ManifestEntry {
    kind: Kind,
    name: String,
    /// Every file of the entry; the first is the one to open (the weights or their index).
    files: Vec<String>,
}

struct Entry<'a> {
    kind: Kind,
    name: String,
    object: &'a mut dyn Stateful,
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
    entries: Vec<Entry<'a>>,
    max_shard_size: u64,
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

    /// Shards models past `bytes` ([`parse_size`]), as [`save_model`] does.
    pub fn set_max_shard_size(&mut self, bytes: u64) -> &mut Self {
        self.max_shard_size = bytes;
        self
    }

    fn register(&mut self, kind: Kind, name: String, object: &'a mut dyn Stateful) -> &mut Self {
        self.entries.push(Entry { kind, name, object });
        self
    }

    /// A model: its tensors go to `model.safetensors` (`model_1...` for the next), sharded
    /// like [`save_model`]'s.
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

    /// A loss scaler ([`LossScaler`]): `scaler.json`.
    pub fn register_scaler<T: Stateful>(
        &mut self,
        name: impl Into<String>,
        scaler: &'a mut T,
    ) -> &mut Self {
        self.register(Kind::Scaler, name.into(), scaler)
    }

    /// The data loader's position ([`DataPosition`]): `data_position.json`.
    pub fn register_data_position<T: Stateful>(
        &mut self,
        name: impl Into<String>,
        position: &'a mut T,
    ) -> &mut Self {
        self.register(Kind::DataPosition, name.into(), position)
    }

    /// A random generator ([`SeededRng`]): every rank saves its own, into
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
    fn check_names(&self) -> Result<(), Error> {
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
fn write_shared(
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

fn write_tensors_file(temp: &Path, stem: &str, dict: &StateDict) -> Result<Vec<String>, Error> {
    let name = format!("{stem}.safetensors");
    let tensors: Vec<(&str, &Tensor)> = dict.iter().collect();
    write_safetensors(&temp.join(&name), &tensors, header_metadata(dict))?;
    Ok(vec![name])
}

/// Writes this rank's random generator states, if any are registered.
fn write_rngs(temp: &Path, state: &CheckpointState<'_>, rank: usize) -> Result<(), Error> {
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
fn save_state_with(
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
fn finish_checkpoint(
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
fn resolve_checkpoint(dir: &Path) -> Result<PathBuf, Error> {
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

// ---------------------------------------------------------------------------------------------
// Automatic naming
// ---------------------------------------------------------------------------------------------

/// Accelerate's automatic checkpoint naming (`ProjectConfiguration(automatic_checkpoint_naming=
/// True, total_limit=...)`): checkpoints go to `<project>/checkpoints/checkpoint_<n>` with `n`
/// counting up, the oldest beyond `total_limit` are deleted after each save, and
/// [`Checkpoints::load_latest`] resumes from the newest complete one.
#[derive(Debug, Clone)]
pub struct Checkpoints {
    root: PathBuf,
    total_limit: Option<usize>,
    next: u64,
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
    /// as [`save_state`] does, then prunes to `total_limit`. Every process must call it.
    /// Returns the new checkpoint's directory.
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

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn sizes_parse_like_hugging_face() {
        for (text, bytes) in [
            ("1000", 1000),
            ("10KB", 10_000),
            ("500MB", 500_000_000),
            ("5GB", 5_000_000_000),
            ("5Gb", 625_000_000),
            ("5gb", 625_000_000),
            ("2GiB", 2 << 30),
            ("64KiB", 64 << 10),
            ("8Mb", 1_000_000),
            (" 7 B ", 7),
        ] {
            assert_eq!(parse_size(text).unwrap(), bytes, "{text}");
        }
        for text in ["", "GB", "5XB", "-5GB", "99999999999999999999GB"] {
            assert!(parse_size(text).is_err(), "{text}");
        }
    }

    #[test]
    fn shards_are_cut_like_huggingface_hub() {
        assert_eq!(plan_shards(&[4, 4, 4], 8), vec![vec![0, 1], vec![2]]);
        // A tensor over the limit stands alone, at once; the open shard stays open.
        assert_eq!(
            plan_shards(&[2, 20, 2, 6], 8),
            vec![vec![1], vec![0, 2], vec![3]]
        );
        assert_eq!(plan_shards(&[], 8), vec![Vec::<usize>::new()]);
        assert_eq!(plan_shards(&[8, 0, 1], 8), vec![vec![0, 1], vec![2]]);
    }

    #[test]
    fn weight_files_are_recognised() {
        assert!(is_weight_file("model.safetensors", "model"));
        assert!(is_weight_file("model.safetensors.index.json", "model"));
        assert!(is_weight_file("model-00001-of-00002.safetensors", "model"));
        assert!(!is_weight_file("model-0001-of-00002.safetensors", "model"));
        assert!(!is_weight_file("config.json", "model"));
        assert!(!is_weight_file("model_1.safetensors", "model"));
    }

    #[test]
    fn state_dicts_check_types_and_shapes() {
        let mut dict = StateDict::new()
            .with(
                "w",
                Tensor::from_slice(&[2, 2], &[1.0f32, 2.0, 3.0, 4.0]).unwrap(),
            )
            .with("b", Tensor::scalar(7i64));
        assert_eq!(dict.names().collect::<Vec<_>>(), ["w", "b"]);
        let error = dict.take::<f32>("w", &[4]).unwrap_err().to_string();
        assert!(
            error.contains("tensor 'w'") && error.contains("[2, 2]"),
            "{error}"
        );
        let error = dict.take::<f64>("b", &[]).unwrap_err().to_string();
        assert!(error.contains("i64") && error.contains("f64"), "{error}");
        assert_eq!(dict.take::<i64>("b", &[]).unwrap(), [7]);
        assert_eq!(dict.names().collect::<Vec<_>>(), ["w"]);
        assert!(
            dict.take::<f32>("b", &[])
                .unwrap_err()
                .to_string()
                .contains("missing")
        );
        assert!(Tensor::from_slice(&[3], &[1u8, 2]).is_err());
    }
}
