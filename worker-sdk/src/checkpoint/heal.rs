//! A training state in memory, for in-place recovery's healing: every object registered in a
//! [`CheckpointState`] (random generators included) saved into one safetensors blob that a healthy
//! rank sends to a replacement, and loaded from it there. The same `Stateful` protocol and
//! the same safetensors encoding as the checkpoint files, so anything that checkpoints heals.

use std::collections::HashMap;

use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::Error;

use super::{
    format::{decode_safetensors, encode_safetensors},
    state::{CheckpointState, Kind},
    tensor::{StateDict, Tensor, message_of},
};

/// The blob's `__metadata__` key holding its [`BlobEntry`] list.
const HEAL_KEY: &str = "muster.heal";

/// One registered object in the blob: its tensors are named `<index>/<tensor>`.
#[derive(Debug, Serialize, Deserialize)]
struct BlobEntry {
    kind: Kind,
    name: String,
    /// The state dict's JSON metadata.
    metadata: Value,
    /// Its tensors' names, in the state dict's order.
    tensors: Vec<String>,
}

impl CheckpointState<'_> {
    /// Saves every registered object into one safetensors blob: what a healing source sends
    /// ([`Communicator::heal`](crate::comm::Communicator::heal)). Random generators go too, so
    /// a healed rank draws on from its source's state: the same draws as a run without the
    /// failure when every rank's generator follows one sequence (seeded alike). A rank's own
    /// sequence (seeded by rank) cannot be rebuilt from another rank's; the healed rank then
    /// continues its source's.
    pub fn heal_bytes(&self) -> Result<Vec<u8>, Error> {
        self.check_names()?;
        let mut dicts: Vec<(usize, &str, Kind, StateDict)> = Vec::new();
        for (index, entry) in self.entries.iter().enumerate() {
            let dict = entry.object.save().map_err(|e| {
                Error::Checkpoint(format!(
                    "saving {} '{}' to heal a rank: {}",
                    entry.kind.name(),
                    entry.name,
                    message_of(e)
                ))
            })?;
            dicts.push((index, &entry.name, entry.kind, dict));
        }
        let names: Vec<Vec<String>> = dicts
            .iter()
            .map(|(index, _, _, dict)| dict.names().map(|n| format!("{index}/{n}")).collect())
            .collect();
        let mut tensors: Vec<(&str, &Tensor)> = Vec::new();
        let mut listed = Vec::with_capacity(dicts.len());
        for ((_, name, kind, dict), full) in dicts.iter().zip(&names) {
            for (full, (_, tensor)) in full.iter().zip(dict.iter()) {
                tensors.push((full.as_str(), tensor));
            }
            listed.push(BlobEntry {
                kind: *kind,
                name: (*name).to_owned(),
                metadata: dict.metadata().clone(),
                tensors: dict.names().map(str::to_owned).collect(),
            });
        }
        let listed = serde_json::to_string(&listed).map_err(|source| Error::Serialization {
            what: "the state to heal a rank with".to_owned(),
            source,
        })?;
        let metadata = [(HEAL_KEY.to_owned(), listed)].into_iter().collect();
        encode_safetensors(&"the state to heal a rank with", &tensors, metadata)
    }

    /// Loads a blob made by [`CheckpointState::heal_bytes`] on rank `source` into the objects
    /// registered here (found by kind and name, as [`load_state`](super::load_state) finds
    /// them, random generators included). Errors name the object and the source.
    pub fn load_heal_bytes(&mut self, bytes: &[u8], source: u32) -> Result<(), Error> {
        self.check_names()?;
        let what = format!("the state received from rank {source}");
        let (tensors, header) = decode_safetensors(&what, bytes)?;
        let listed: Vec<BlobEntry> = header
            .get(HEAL_KEY)
            .ok_or_else(|| Error::Checkpoint(format!("{what} lists no objects ({HEAL_KEY})")))
            .and_then(|text| {
                serde_json::from_str(text).map_err(|e| {
                    Error::Checkpoint(format!("{what}: its {HEAL_KEY} list is not valid: {e}"))
                })
            })?;
        let mut tensors: HashMap<String, Tensor> = tensors.into_iter().collect();
        let mut dicts: Vec<(BlobEntry, StateDict)> = Vec::with_capacity(listed.len());
        for (index, entry) in listed.into_iter().enumerate() {
            let mut dict = StateDict::new();
            for name in &entry.tensors {
                let tensor = tensors.remove(&format!("{index}/{name}")).ok_or_else(|| {
                    Error::Checkpoint(format!(
                        "{what}: tensor '{name}' of {} '{}' is missing",
                        entry.kind.name(),
                        entry.name
                    ))
                })?;
                dict.insert(name.clone(), tensor);
            }
            dict.set_metadata(entry.metadata.clone());
            dicts.push((entry, dict));
        }
        for target in &mut self.entries {
            let position = dicts
                .iter()
                .position(|(e, _)| e.kind == target.kind && e.name == target.name)
                .ok_or_else(|| {
                    Error::Checkpoint(format!(
                        "{what} holds no {} named '{}'",
                        target.kind.name(),
                        target.name
                    ))
                })?;
            let (_, dict) = dicts.swap_remove(position);
            target.object.load(dict).map_err(|e| {
                Error::Checkpoint(format!(
                    "{what} ({} '{}'): {}",
                    target.kind.name(),
                    target.name,
                    message_of(e)
                ))
            })?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use crate::{checkpoint::DataPosition, train::SeededRng};

    fn model(seed: f32) -> StateDict {
        StateDict::new()
            .with(
                "w",
                Tensor::from_slice(&[2, 2], &[seed, -seed, 1.5 * seed, 0.25]).unwrap(),
            )
            .with("b", Tensor::vector(&[seed as f64, f64::MIN_POSITIVE]))
            .with("steps", Tensor::scalar(7i64))
    }

    #[test]
    fn a_state_moves_bit_identically() {
        let (mut model_a, mut optimizer_a) = (model(0.1), model(3.0));
        let mut position_a = DataPosition { epoch: 2, step: 15 };
        let mut rng_a = SeededRng::new(11);
        rng_a.next_u64();
        let mut state = CheckpointState::new();
        state
            .register_model("model", &mut model_a)
            .register_optimizer("sgd", &mut optimizer_a)
            .register_data_position("data", &mut position_a)
            .register_rng("dropout", &mut rng_a);
        let bytes = state.heal_bytes().unwrap();
        drop(state);

        let (mut model_b, mut optimizer_b) = (model(9.0), model(9.0));
        let mut position_b = DataPosition { epoch: 0, step: 0 };
        let mut rng_b = SeededRng::new(11);
        let mut state = CheckpointState::new();
        state
            .register_rng("dropout", &mut rng_b)
            .register_data_position("data", &mut position_b)
            .register_model("model", &mut model_b)
            .register_optimizer("sgd", &mut optimizer_b);
        state.load_heal_bytes(&bytes, 0).unwrap();
        drop(state);
        assert_eq!(model_b, model_a);
        assert_eq!(optimizer_b, optimizer_a);
        assert_eq!(
            model_b.tensor("w").unwrap().bytes(),
            model_a.tensor("w").unwrap().bytes()
        );
        assert_eq!(position_b, position_a);
        // The generator draws on from the source's state, not from its own start.
        assert_eq!(rng_b, rng_a);
        assert_eq!(rng_b.next_u64(), rng_a.next_u64());

        // An object the source did not send is an error naming it and the source.
        let mut other = model(1.0);
        let mut state = CheckpointState::new();
        state.register_model("other", &mut other);
        let error = state.load_heal_bytes(&bytes, 3).unwrap_err().to_string();
        assert!(
            error.contains("the state received from rank 3 holds no model named 'other'"),
            "{error}"
        );
        let mut state = CheckpointState::new();
        state.register_model("other", &mut other);
        assert!(state.load_heal_bytes(&bytes[..20], 3).is_err());
    }
}
