//! Model weights alone ([`save_model`], [`load_model`]): a state dict in Hugging Face's
//! layout, readable by Python's `safetensors` and `transformers`.

use std::{
    fs::{self},
    io::{self},
    path::Path,
};

use crate::{Accelerator, Error};

use super::{
    MODEL_FILE, MODEL_INDEX_FILE,
    atomic::{on_main_shared, prepare_dir, replace_dir},
    format::{io_error, is_weight_file, read_weights, write_weights},
    tensor::StateDict,
};

/// Writes a model's weights into `dir` in Hugging Face's layout (see the module docs),
/// without coordination: what [`save_model`] runs on the main process, for tools and for
/// single-process code without an [`Accelerator`]. `dir` is replaced as a whole and
/// atomically; other files in an existing `dir` (a `config.json`) are carried over, old weight
/// files are not.
pub fn write_model(dir: &Path, state: &StateDict, max_shard_size: u64) -> Result<(), Error> {
    write_model_in(dir, state, max_shard_size, 0)
}

pub(super) fn write_model_in(
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
pub(super) fn carry_over(old: &Path, new: &Path) -> Result<(), Error> {
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
/// Face's layout, sharded past `max_shard_size` bytes ([`parse_size`](super::parse_size)),
/// written by the main process only, atomically, between two barriers: every process must call
/// it, and every process can read the weights when it returns. See [`write_model`] for what
/// happens to an existing `dir`.
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
