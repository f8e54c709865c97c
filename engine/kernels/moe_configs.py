"""Launch shapes of the experts' grouped GEMM (engine/kernels/moe_triton.py) by layer shape and
token count, tuned on the GPU by ``ops/gpu/moe_tune.py`` and kept in ``moe_configs/*.json``.

A table is one GEMM shape on one GPU: experts ``E``, output columns ``N``, reduction ``K``, the
weights' dtype (``bf16``, ``fp8``), the GPU's name; its entries map a token count to the best
(``block_n``, ``block_k``, ``num_warps``, ``num_stages``) the tuner timed there. Weights dtypes
are spelled as torch names them (``bfloat16``, ``float8_e4m3fn``). A step of ``n``
tokens takes the entry of the smallest tuned count at or above ``n`` (the largest beyond the
last): a CUDA graph's bucket fixes ``n``, so a replay never changes shape. Without a table for the
shape and GPU the kernel's fixed defaults run (:func:`default_shape`); the tile height (the
routing's alignment, ``moe.tile_rows``: 16 or 64 rows by the step's pairs) is not tuned here, but
a count's entry was timed at the height that count runs with.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from pathlib import Path

import triton

TABLES = Path(__file__).with_name("moe_configs")


@dataclass(frozen=True)
class GemmShape:
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


def default_shape(n_out: int, k_in: int, gated: bool = False) -> GemmShape:
    """The untuned launch: column tiles up to 128 (64 for a gated gate-up stack, whose programs
    keep two accumulators), K steps up to 64, four warps, Triton's default three stages."""
    cols = n_out // 2 if gated else n_out
    return GemmShape(min(64 if gated else 128, max(16, triton.next_power_of_2(cols))),
                     min(64, max(16, triton.next_power_of_2(k_in))), 4, 3)


def weights_name(dtype) -> str:
    """A weights dtype as table names spell it: ``bfloat16``, ``float8_e4m3fn``."""
    return str(dtype).removeprefix("torch.")


def table_name(experts: int, n_out: int, k_in: int, weights: str, gpu: str) -> str:
    """The file a tuned shape lives in: ``E128_N1536_K2048_float8_e4m3fn_NVIDIA-H200.json``."""
    return f"E{experts}_N{n_out}_K{k_in}_{weights}_{gpu.replace(' ', '-')}.json"


@functools.lru_cache(maxsize=64)
def _table(name: str) -> tuple[tuple[int, GemmShape], ...]:
    """A table's entries, read once per process (a model's layers all ask for the same two)."""
    path = TABLES / name
    if not path.is_file():
        return ()
    entries = json.loads(path.read_text())["entries"]
    return tuple(sorted((int(n), GemmShape(**cfg)) for n, cfg in entries.items()))


@functools.lru_cache(maxsize=4096)
def launch_shape(experts: int, n_out: int, k_in: int, weights: str, gpu: str, tokens: int,
                 gated: bool = False) -> GemmShape:
    """The tuned shape for a step of ``tokens`` tokens, or the default without a table. ``n_out``
    is the stack's rows (2I for a gate-up stack, whose table the tuner times gated, as the
    engine runs it). Cached: eager steps ask for it twice a layer, so the lookup is a dict hit,
    not a file name built."""
    table = _table(table_name(experts, n_out, k_in, weights, gpu))
    if not table:
        return default_shape(n_out, k_in, gated)
    for n, shape in table:
        if n >= tokens:
            return shape
    return table[-1][1]
