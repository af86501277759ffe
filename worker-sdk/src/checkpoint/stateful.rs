//! The [`Stateful`] protocol (Accelerate's `state_dict()` / `load_state_dict()`) and its
//! implementations for the SDK's own objects and the usual wrappers.

use std::sync::{Arc, Mutex};

use serde::{Deserialize, Serialize};

use crate::{
    Error,
    train::{LossScaler, SeededRng},
};

use super::tensor::{StateDict, message_of};

/// Something whose state goes into checkpoints (Accelerate's `state_dict()` /
/// `load_state_dict()` protocol): a model, an optimizer, a scheduler, a generator or any user
/// object registered with [`CheckpointState`](super::CheckpointState).
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
