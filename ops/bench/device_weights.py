"""Random weights made on the device, for benches of checkpoints the GPU machine's disk cannot
hold (Qwen3-30B-A3B in bf16 is 61 GB of a 64 GB disk, beside nothing else).

:func:`filling_on_device` replaces the engine's weight load (``engine.core.loading``'s
``load_or_restore``, and ``warm_key``, which names a copy by its files) for the ``with`` block: every slot of the model's checkpoint layout
(``LlamaModel.weight_slots``) is filled where it lives — norms with ones, everything else with
N(0, 0.02) — and an FP8 model's projections, experts included, are quantized into their codes and
scales as a load from files would (the same ``quantize_rows``). Everything else about the load is
the engine's own: the ledger, the KV pool, the runner, its graphs and the warm-up. A bench that
uses it says so in its report (engine_bench names the model "(random, made on the device)"):
its routing and its outputs are those of random weights.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import torch

from engine.kernels.fp8 import quantize_rows
from engine.kernels.fp8_format import Fp8Rows


def fill_on_device(model: torch.nn.Module, seed: int = 0) -> int:
    """Fill every checkpoint slot of ``model`` on its device; returns the model's bytes."""
    gen = torch.Generator(device=model.device).manual_seed(seed)
    scales = model.row_scales()
    with torch.no_grad():
        for name, (dst, start, rows) in model.weight_slots().items():
            part = dst[start:start + rows]
            scale = scales.get(id(dst))
            if name.endswith("norm.weight"):
                part.fill_(1.0)
            elif scale is None:
                part.copy_(torch.randn(part.shape, generator=gen, device=part.device, dtype=torch.float32) * 0.02)
            else:  # an FP8 slot: its rows quantized into codes and scales, as a load from files does
                src = torch.randn(part.shape, generator=gen, device=part.device, dtype=torch.float32) * 0.02
                n = part.shape[0]
                quantize_rows(src.to(model.dtype).reshape(n, -1),
                              Fp8Rows(part.view(n, -1), scale.data[start:start + rows].view(n, 1)))
    return model.nbytes


@contextlib.contextmanager
def filling_on_device(seed: int = 0) -> Iterator[None]:
    """Within the block, every engine load fills its model on the device instead of reading files."""
    from engine.core import loading

    real = loading.load_or_restore, loading.warm_key

    def fill(model, model_dir: str | Path, tier=None, key=None, *, cancel=None) -> tuple[int, str]:
        return fill_on_device(model, seed), "device"

    def key(model_dir: str | Path, form: str = "") -> str:
        return f"on device|{model_dir}|{form}"  # no files to name the copy by: the seed's bytes

    loading.load_or_restore, loading.warm_key = fill, key
    try:
        yield
    finally:
        loading.load_or_restore, loading.warm_key = real
