"""Streaming safetensors writer: the header is laid out from shapes, then bytes follow.

The format is an 8-byte little-endian header length, a JSON header naming each tensor's
dtype, shape and ``[begin, end)`` byte range in the data area, then the data area. Because
the header depends only on shapes, a shard can be written one tensor (or one chunk of rows)
at a time, which is what lets ``make-model`` write a 16 GB model with one tensor in memory.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from math import prod
from pathlib import Path

DTYPE_BYTES = {"F32": 4, "BF16": 2, "F16": 2}

# Hugging Face's default shard limit ("5GB" in save_pretrained) is decimal.
DEFAULT_MAX_SHARD_BYTES = 5 * 10**9


class SafetensorsWriteError(ValueError):
    """A tensor plan or its data does not fit the safetensors format."""


@dataclass(frozen=True)
class TensorSpec:
    """One tensor to write: its name, shape, safetensors dtype and how to fill it."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    init: str  # "normal" (std 0.02) or "ones"

    @property
    def nbytes(self) -> int:
        return prod(self.shape) * DTYPE_BYTES[self.dtype]


def plan_shards(specs: list[TensorSpec], max_shard_bytes: int) -> list[list[TensorSpec]]:
    """Split ``specs`` in order into shards of at most ``max_shard_bytes`` of data each.

    A tensor larger than the limit gets a shard of its own (it cannot be split).
    """
    if max_shard_bytes <= 0:
        raise SafetensorsWriteError(f"max_shard_bytes must be positive, got {max_shard_bytes}")
    shards: list[list[TensorSpec]] = []
    current: list[TensorSpec] = []
    size = 0
    for spec in specs:
        if current and size + spec.nbytes > max_shard_bytes:
            shards.append(current)
            current, size = [], 0
        current.append(spec)
        size += spec.nbytes
    if current:
        shards.append(current)
    return shards


def shard_file_names(count: int) -> list[str]:
    """Hugging Face's names: ``model.safetensors`` alone, else ``model-0000i-of-0000n``."""
    if count == 1:
        return ["model.safetensors"]
    return [f"model-{i:05d}-of-{count:05d}.safetensors" for i in range(1, count + 1)]


def encode_header(specs: Iterable[TensorSpec]) -> bytes:
    """The length prefix and JSON header for ``specs`` laid out back to back."""
    header: dict[str, object] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for spec in specs:
        if spec.dtype not in DTYPE_BYTES:
            raise SafetensorsWriteError(f"{spec.name}: unsupported dtype {spec.dtype}")
        if spec.name in header:
            raise SafetensorsWriteError(f"duplicate tensor name {spec.name}")
        header[spec.name] = {
            "dtype": spec.dtype,
            "shape": list(spec.shape),
            "data_offsets": [offset, offset + spec.nbytes],
        }
        offset += spec.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    # Pad with spaces so the data area starts 8-byte aligned (readers may map it in place).
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw


def write_shard(
    path: Path,
    specs: list[TensorSpec],
    chunks_of: Callable[[TensorSpec], Iterator[memoryview | bytes]],
) -> None:
    """Write one shard: header, then each tensor's bytes as ``chunks_of(spec)`` yields them.

    Checks that every tensor received exactly its planned byte count, so a wrong generator
    cannot silently shift the following tensors.
    """
    with open(path, "wb") as f:
        f.write(encode_header(specs))
        for spec in specs:
            written = 0
            for chunk in chunks_of(spec):
                written += f.write(chunk)
            if written != spec.nbytes:
                raise SafetensorsWriteError(
                    f"{spec.name}: wrote {written} bytes, expected {spec.nbytes}"
                )


def index_json(shards: list[list[TensorSpec]], names: list[str]) -> dict[str, object]:
    """``model.safetensors.index.json``: total data size and tensor → file map."""
    weight_map = {spec.name: name for shard, name in zip(shards, names) for spec in shard}
    total = sum(spec.nbytes for shard in shards for spec in shard)
    return {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
