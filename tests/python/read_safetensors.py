"""Reads a model directory that muster wrote, the way transformers does: model.safetensors, or
the shards listed by model.safetensors.index.json, with Python's safetensors (its torch
backend: numpy has no bfloat16). Checks what transformers checks (the "format" metadata, every
indexed tensor in its shard, total_size) and prints, sorted by name, one line per tensor:

    name<TAB>dtype<TAB>[shape]<TAB>fnv1a-64 of its bytes (16 hex digits)

preceded, for a sharded model, by "total_size<TAB>N". Run by worker-sdk/tests/checkpoint.rs,
which compares the lines with what it wrote.

Usage: read_safetensors.py DIR
"""

import json
import os
import sys

import torch
from safetensors import safe_open

DTYPES = {
    torch.float32: "f32",
    torch.float64: "f64",
    torch.float16: "f16",
    torch.bfloat16: "bf16",
    torch.int32: "i32",
    torch.int64: "i64",
    torch.uint8: "u8",
}


def fnv1a(data: bytes) -> int:
    value = 0xCBF29CE484222325
    for byte in data:
        value = ((value ^ byte) * 0x100000001B3) & 0xFFFFFFFFFFFFFFFF
    return value


def files_of(directory: str):
    """Maps each file to read to the tensors it must hold (None: whatever it holds)."""
    single = os.path.join(directory, "model.safetensors")
    if os.path.exists(single):
        return {single: None}, None
    with open(os.path.join(directory, "model.safetensors.index.json")) as f:
        index = json.load(f)
    assert set(index) == {"metadata", "weight_map"}, index.keys()
    shards = {}
    for tensor, shard in index["weight_map"].items():
        shards.setdefault(os.path.join(directory, shard), set()).add(tensor)
    return shards, index["metadata"]["total_size"]


def main(directory: str) -> None:
    files, total_size = files_of(directory)
    lines = []
    size = 0
    for path, expected in sorted(files.items()):
        with safe_open(path, framework="pt") as f:
            metadata = f.metadata() or {}
            assert metadata.get("format") == "pt", (path, metadata)
            names = set(f.keys())
            if expected is not None:
                assert names == expected, (path, names ^ expected)
            for name in names:
                tensor = f.get_tensor(name)
                data = tensor.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
                size += len(data)
                shape = list(tensor.shape)
                lines.append(f"{name}\t{DTYPES[tensor.dtype]}\t{shape}\t{fnv1a(data):016x}")
    if total_size is not None:
        assert total_size == size, (total_size, size)
        print(f"total_size\t{total_size}")
    for line in sorted(lines):
        print(line)


if __name__ == "__main__":
    main(sys.argv[1])
