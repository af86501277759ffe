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
//!
//! **Layout.** `tensor.rs` (tensors and state dicts), `stateful.rs` (the [`Stateful`] protocol),
//! `format.rs` (shard plans and the safetensors and JSON files), `atomic.rs` (building a
//! directory aside and renaming it into place), `weights.rs` (weights alone), `state.rs` (the
//! whole training state and its manifest), `heal.rs` (the training state as one in-memory
//! safetensors blob, which in-place recovery sends to a replacement) and `naming.rs` (automatic naming and pruning); the
//! file names and format constants every part shares stay here.

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

mod atomic;
mod format;
mod heal;
mod naming;
mod state;
mod stateful;
mod tensor;
mod weights;

pub use format::parse_size;
pub use naming::Checkpoints;
pub use state::{CheckpointState, load_state, load_state_as, save_state};
pub use stateful::{DataPosition, Stateful};
pub use tensor::{StateDict, Tensor};
pub use weights::{load_model, save_model, write_model};
