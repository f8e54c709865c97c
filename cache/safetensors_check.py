"""Validation of a safetensors header before anything reads tensors from the file.

Layout: 8-byte little-endian header length N, N bytes of UTF-8 JSON, then the data section. The
JSON maps tensor names to ``{"dtype", "shape", "data_offsets": [begin, end]}`` (offsets relative to
the data section) plus an optional ``"__metadata__"`` map of strings. We require what a loader
relies on: a header length within bounds and the file, a JSON object without duplicate keys,
known dtypes, shape products that do not overflow and match the byte ranges, and byte ranges that
are sorted, contiguous, start at 0, end at the end of the file: no holes, overlaps or trailing
bytes.
"""

from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass
from pathlib import Path

from cache.errors import SafetensorsError
from cache.strict_json import no_duplicate_keys

MAX_HEADER_BYTES = 100 << 20  # the reference implementation's own bound
MAX_TENSORS = 1_000_000
MAX_RANK = 16
MAX_ELEMENTS = 1 << 62  # far above any real tensor, far below int64 overflow with 8-byte dtypes
DTYPE_BYTES = {
    "BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1,
    "U16": 2, "I16": 2, "F16": 2, "BF16": 2,
    "U32": 4, "I32": 4, "F32": 4,
    "U64": 8, "I64": 8, "F64": 8,
}


@dataclass(frozen=True)
class TensorInfo:
    name: str
    dtype: str
    shape: tuple[int, ...]
    begin: int  # absolute offsets in the file
    end: int


@dataclass(frozen=True)
class SafetensorsHeader:
    header_len: int
    data_start: int
    tensors: tuple[TensorInfo, ...]
    metadata: dict[str, str]


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def parse_header(header: bytes, file_size: int, where: str = "file") -> SafetensorsHeader:
    """Validate the JSON header bytes of a file of ``file_size`` bytes; raises SafetensorsError."""
    n = len(header)
    data_start = 8 + n
    try:
        doc = json.loads(header.decode("utf-8"), object_pairs_hook=no_duplicate_keys("header", SafetensorsError))
    except UnicodeDecodeError:
        raise SafetensorsError(f"{where}: header is not UTF-8") from None
    except json.JSONDecodeError as e:
        raise SafetensorsError(f"{where}: header is not JSON: {e}") from None
    if not isinstance(doc, dict):
        raise SafetensorsError(f"{where}: header is not a JSON object")
    metadata = doc.pop("__metadata__", {})
    if not isinstance(metadata, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()):
        raise SafetensorsError(f"{where}: __metadata__ must map strings to strings")
    if len(doc) > MAX_TENSORS:
        raise SafetensorsError(f"{where}: {len(doc)} tensors (at most {MAX_TENSORS})")
    tensors: list[TensorInfo] = []
    for name, info in doc.items():
        if not isinstance(info, dict) or set(info) != {"dtype", "shape", "data_offsets"}:
            raise SafetensorsError(f"{where}: tensor {name!r} must have exactly dtype, shape, data_offsets")
        dtype, shape, offsets = info["dtype"], info["shape"], info["data_offsets"]
        if not isinstance(dtype, str) or dtype not in DTYPE_BYTES:  # a list or object is unhashable
            raise SafetensorsError(f"{where}: tensor {name!r} has unknown dtype {dtype!r}")
        if not isinstance(shape, list) or len(shape) > MAX_RANK or not all(_is_int(d) and d >= 0 for d in shape):
            raise SafetensorsError(f"{where}: tensor {name!r} shape {shape!r} is not a list of non-negative ints")
        count = 1
        for d in shape:
            count *= d
            if count > MAX_ELEMENTS:
                raise SafetensorsError(f"{where}: tensor {name!r} shape {shape!r} overflows")
        if (not isinstance(offsets, list) or len(offsets) != 2 or not all(_is_int(o) for o in offsets)):
            raise SafetensorsError(f"{where}: tensor {name!r} data_offsets {offsets!r} is not [begin, end]")
        begin, end = offsets
        if begin < 0 or end < begin:
            raise SafetensorsError(f"{where}: tensor {name!r} data_offsets {offsets!r} are reversed or negative")
        if end - begin != count * DTYPE_BYTES[dtype]:
            raise SafetensorsError(f"{where}: tensor {name!r} spans {end - begin} bytes but {dtype}{shape} "
                                   f"needs {count * DTYPE_BYTES[dtype]}")
        if data_start + end > file_size:
            raise SafetensorsError(f"{where}: tensor {name!r} ends past the end of the file")
        tensors.append(TensorInfo(name, dtype, tuple(shape), data_start + begin, data_start + end))
    tensors.sort(key=lambda t: (t.begin, t.end))
    cursor = data_start
    for t in tensors:
        if t.begin < cursor:
            raise SafetensorsError(f"{where}: tensor {t.name!r} overlaps the tensor before it")
        if t.begin > cursor:
            raise SafetensorsError(f"{where}: hole of {t.begin - cursor} bytes before tensor {t.name!r}")
        cursor = t.end
    if cursor != file_size:
        raise SafetensorsError(f"{where}: {file_size - cursor} trailing bytes after the last tensor")
    return SafetensorsHeader(n, data_start, tuple(tensors), metadata)


def check_file(path: str | os.PathLike[str]) -> SafetensorsHeader:
    """Read and validate the header of a safetensors file; raises SafetensorsError."""
    where = Path(path).name
    with open(path, "rb") as f:
        file_size = os.fstat(f.fileno()).st_size
        head = f.read(8)
        if len(head) < 8:
            raise SafetensorsError(f"{where}: {file_size} bytes is too short for a safetensors file")
        (n,) = struct.unpack("<Q", head)
        if n < 2 or n > MAX_HEADER_BYTES:
            raise SafetensorsError(f"{where}: header length {n} is outside [2, {MAX_HEADER_BYTES}]")
        if 8 + n > file_size:
            raise SafetensorsError(f"{where}: header length {n} runs past the end of the file ({file_size} bytes)")
        header = f.read(n)
    if len(header) != n:
        raise SafetensorsError(f"{where}: file shrank while its header was read")
    return parse_header(header, file_size, where)
