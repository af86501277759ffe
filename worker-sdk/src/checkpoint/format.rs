//! The on-disk format: shard sizes and plans as Hugging Face cuts them, safetensors and JSON
//! files written durably and read with errors that name the file.

use std::{
    collections::{BTreeMap, HashMap},
    fmt,
    fs::{self, File},
    io::{self, BufWriter, Write},
    path::Path,
};

use safetensors::{Dtype, SafeTensors, tensor::TensorInfo};
use serde::{Deserialize, Serialize, de::DeserializeOwned};
use serde_json::Value;

use crate::{Error, dtype::DType};

use super::{
    METADATA_KEY,
    tensor::{StateDict, Tensor},
};

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
pub(super) fn plan_shards(sizes: &[u64], max: u64) -> Vec<Vec<usize>> {
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
pub(super) fn shard_name(stem: &str, index: usize, count: usize) -> String {
    format!("{stem}-{:05}-of-{count:05}.safetensors", index + 1)
}

/// Whether `name` is one of the weight files of `stem` (single file, index or shard).
pub(super) fn is_weight_file(name: &str, stem: &str) -> bool {
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
pub(super) struct WeightIndex {
    #[serde(default)]
    pub(super) metadata: BTreeMap<String, Value>,
    pub(super) weight_map: BTreeMap<String, String>,
}
pub(super) fn io_error(what: impl FnOnce() -> String) -> impl FnOnce(io::Error) -> Error {
    move |source| Error::Io {
        what: what(),
        source,
    }
}

/// Creates `path`, lets `write` fill it through a buffer, and fsyncs it.
pub(super) fn write_file(
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
pub(super) fn write_json(path: &Path, value: &impl Serialize) -> Result<(), Error> {
    let mut text = serde_json::to_string_pretty(value).map_err(|source| Error::Serialization {
        what: path.display().to_string(),
        source,
    })?;
    text.push('\n');
    write_file(path, |w| w.write_all(text.as_bytes()))
}

/// Reads a whole file; a missing one is a bad checkpoint, not an I/O failure.
pub(super) fn read_file(path: &Path) -> Result<Vec<u8>, Error> {
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

pub(super) fn read_json<T: DeserializeOwned>(path: &Path) -> Result<T, Error> {
    let bytes = read_file(path)?;
    serde_json::from_slice(&bytes)
        .map_err(|e| Error::Checkpoint(format!("{}: not the expected JSON: {e}", path.display())))
}

pub(super) fn fsync_dir(dir: &Path) -> Result<(), Error> {
    File::open(dir)
        .and_then(|d| d.sync_all())
        .map_err(io_error(|| format!("syncing directory {}", dir.display())))
}

pub(super) fn to_safetensors(dtype: DType) -> Dtype {
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

pub(super) fn from_safetensors(dtype: Dtype) -> Option<DType> {
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
pub(super) fn write_safetensors(
    path: &Path,
    tensors: &[(&str, &Tensor)],
    metadata: BTreeMap<String, String>,
) -> Result<(), Error> {
    let (header, order) = safetensors_layout(&path.display(), tensors, metadata)?;
    write_file(path, |w| write_layout(w, &header, &order))
}

/// [`write_safetensors`] into memory: the same bytes, for state sent over the network
/// (in-place recovery's healing). `what` names the state in errors.
pub(super) fn encode_safetensors(
    what: &dyn fmt::Display,
    tensors: &[(&str, &Tensor)],
    metadata: BTreeMap<String, String>,
) -> Result<Vec<u8>, Error> {
    let (header, order) = safetensors_layout(what, tensors, metadata)?;
    let size = 8 + header.len() + order.iter().map(|t| t.nbytes()).sum::<usize>();
    let mut out = Vec::with_capacity(size);
    write_layout(&mut out, &header, &order).map_err(|source| Error::Io {
        what: format!("encoding {what}"),
        source,
    })?;
    Ok(out)
}

fn write_layout(w: &mut impl Write, header: &[u8], order: &[&Tensor]) -> io::Result<()> {
    w.write_all(&(header.len() as u64).to_le_bytes())?;
    w.write_all(header)?;
    for tensor in order {
        w.write_all(tensor.bytes())?;
    }
    Ok(())
}

/// The padded JSON header of a safetensors file of `tensors`, and the tensors in file order.
fn safetensors_layout<'t>(
    what: &dyn fmt::Display,
    tensors: &[(&str, &'t Tensor)],
    metadata: BTreeMap<String, String>,
) -> Result<(Vec<u8>, Vec<&'t Tensor>), Error> {
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
    let bad = |e: &dyn fmt::Display| Error::Checkpoint(format!("{what}: {e}"));
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
    Ok((header, order.into_iter().map(|(_, t)| *t).collect()))
}

/// Tensors with their names, in order.
pub(super) type NamedTensors = Vec<(String, Tensor)>;

/// Reads one safetensors file: its tensors in file order and its `__metadata__`.
pub(super) fn read_safetensors(
    path: &Path,
) -> Result<(NamedTensors, HashMap<String, String>), Error> {
    let bytes = read_file(path)?;
    decode_safetensors(&path.display(), &bytes)
}

/// Parses safetensors bytes (a file's, or state received over the network); `what` names
/// them in errors.
pub(super) fn decode_safetensors(
    what: &dyn fmt::Display,
    bytes: &[u8],
) -> Result<(NamedTensors, HashMap<String, String>), Error> {
    let bad = |e: &dyn fmt::Display| {
        Error::Checkpoint(format!("{what}: not a valid safetensors file: {e}"))
    };
    let (_, header) = SafeTensors::read_metadata(bytes).map_err(|e| bad(&e))?;
    let file = SafeTensors::deserialize(bytes).map_err(|e| bad(&e))?;
    let mut tensors = Vec::with_capacity(file.len());
    for name in header.offset_keys() {
        let view = file.tensor(&name).map_err(|e| bad(&e))?;
        let dtype = from_safetensors(view.dtype()).ok_or_else(|| {
            Error::Checkpoint(format!(
                "{what}: tensor '{name}' has type {}, which muster does not support",
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
pub(super) fn header_metadata(state: &StateDict) -> BTreeMap<String, String> {
    let mut metadata = BTreeMap::from([("format".to_owned(), "pt".to_owned())]);
    if !state.metadata.is_null() {
        metadata.insert(METADATA_KEY.to_owned(), state.metadata.to_string());
    }
    metadata
}

/// Restores a state dict's JSON metadata from a safetensors header.
pub(super) fn metadata_from_header(
    path: &Path,
    header: &HashMap<String, String>,
) -> Result<Value, Error> {
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
pub(super) fn write_weights(
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
pub(super) fn read_weights(dir: &Path, file: &str) -> Result<StateDict, Error> {
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
}
