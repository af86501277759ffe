//! Tensors and state dicts: the owned, typed values a checkpoint stores, and the checks that
//! name a tensor when a saved one does not fit the object loading it.

use std::{collections::HashMap, fmt};

use serde::{Serialize, de::DeserializeOwned};
use serde_json::Value;

use crate::{
    Error,
    dtype::{DType, Element},
};

/// An owned, dense, row-major tensor: what checkpoints store. `data` holds the elements'
/// bytes in the host's (little-endian) order; typed views go through [`Element`].
#[derive(Clone, PartialEq, Eq)]
pub struct Tensor {
    pub(super) dtype: DType,
    pub(super) shape: Vec<usize>,
    pub(super) data: Vec<u8>,
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
pub(super) fn element_count(shape: &[usize]) -> Option<usize> {
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
    pub(super) tensors: Vec<(String, Tensor)>,
    pub(super) index: HashMap<String, usize>,
    pub(super) metadata: Value,
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
pub(super) fn message_of(error: Error) -> String {
    match error {
        Error::Checkpoint(message) | Error::Usage(message) => message,
        other => other.to_string(),
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

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
