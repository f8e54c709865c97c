"""Pre-quantized FP8 checkpoints as the hub publishes them, read into the engine's FP8 scheme
(e4m3 projections with one float32 scale per output channel: engine.kernels.fp8).

Layouts (``ModelConfig.fp8_checkpoint``, from config.json's ``quantization_config``):

- ``"channel"`` (compressed-tensors float-quantized, channel strategy): ``P.weight`` e4m3 [N, K]
  and ``P.weight_scale`` [N, 1] (or [N]): the engine's own scheme; codes and scales are copied.
- ``"tensor"`` (the same, tensor strategy): ``P.weight_scale`` [1] (or []): every row gets it.
- ``"block128"`` (``quant_method: "fp8"``): ``P.weight_scale_inv`` [ceil(N/128), ceil(K/128)], one
  multiplier per 128 x 128 block. The engine's GEMMs take a scale per row, so each 128-row band
  is dequantized and quantized again per row on the device after the copy: exact where a band's
  blocks share a scale, one more rounding where they do not.

``P.input_scale`` (static activation scales) is checked and not used: activations are quantized
per token, dynamically, by the kernels that produce them. A projection the checkpoint left
unquantized (``ignore``) arrives in bf16 and is quantized at load as any bf16 checkpoint's.

Every scale tensor is read and checked (dtype float32/bfloat16/float16, its shape, every value
finite and positive) before a byte of weights is copied; a problem is a WeightsError naming the
tensor and its file, and nothing is loaded.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from engine.errors import WeightsError
from engine.kernels.fp8 import quantize_rows
from engine.kernels.fp8_format import FP8, Fp8Rows

SCALE_SUFFIXES = (".weight_scale_inv", ".weight_scale", ".input_scale")
_SCALE_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}
BLOCK = 128


def scale_target(name: str) -> tuple[str, str] | None:
    """``("P.weight", kind)`` for a scale tensor's name (kind ``weight_scale``,
    ``weight_scale_inv`` or ``input_scale``), None for any other name."""
    for suffix in SCALE_SUFFIXES:
        if name.endswith(suffix):
            return name[: -len(suffix)] + ".weight", suffix[1:]
    return None


@dataclass
class ScaleFill:
    """An e4m3 checkpoint tensor copied into rows of an FP8 weight, whose scales come from the file."""

    weight: str  # the checkpoint name, "model.layers.0.self_attn.q_proj.weight"
    path: Path
    dest: torch.Tensor  # the rows of the model's FP8 weight the tensor fills
    scale: torch.Tensor  # the same rows of its float32 scales
    scale_rows: torch.Tensor | None = None  # [rows] float32, read and checked: channel / tensor layouts
    blocks: torch.Tensor | None = None  # [ceil(rows/128), ceil(K/128)] float32: the block128 layout


class _Files:
    """One open descriptor per checkpoint file while its scales are read (a model has hundreds)."""

    def __init__(self, stack: contextlib.ExitStack) -> None:
        self._stack, self._fds = stack, {}

    def pread(self, path: Path, n: int, offset: int) -> bytes:
        if path not in self._fds:
            self._fds[path] = os.open(path, os.O_RDONLY)
            self._stack.callback(os.close, self._fds[path])
        return os.pread(self._fds[path], n, offset)


def _read(files: _Files, path: Path, begin: int, end: int, dtype: str, shape: tuple[int, ...],
          name: str) -> torch.Tensor:
    if dtype not in _SCALE_DTYPES:
        raise WeightsError(f"{path.name}: scale tensor {name!r} has dtype {dtype}, expected F32/BF16/F16")
    raw = files.pread(path, end - begin, begin)
    if len(raw) != end - begin:
        raise WeightsError(f"{path.name}: scale tensor {name!r} ends early")
    t = (torch.frombuffer(bytearray(raw), dtype=_SCALE_DTYPES[dtype]) if raw
         else torch.empty(0, dtype=_SCALE_DTYPES[dtype])).reshape(shape).float()
    bad = ~torch.isfinite(t) | (t <= 0)
    if bad.any():
        v = t[bad][0].item()
        raise WeightsError(f"{path.name}: scale tensor {name!r} holds {v!r}; every scale must be finite and positive")
    return t


def read_scales(layout: str, fills: list[ScaleFill], scale_infos: dict[str, dict[str, tuple]]) -> None:
    """Read and check the scales of every e4m3 weight in ``fills`` (``scale_infos``: weight name →
    kind → (path, TensorInfo)); set each fill's ``scale_rows`` or ``blocks``. Refuses a missing
    scale, one of the wrong kind, shape or dtype, a non-finite or non-positive value."""
    with contextlib.ExitStack() as stack:
        _read_scales(layout, fills, scale_infos, _Files(stack))


def _read_scales(layout: str, fills: list[ScaleFill], scale_infos: dict[str, dict[str, tuple]], files: _Files) -> None:
    want = "weight_scale_inv" if layout == "block128" else "weight_scale"
    fp8_weights = {f.weight for f in fills}
    for weight, kinds in scale_infos.items():
        if weight not in fp8_weights:
            names = ", ".join(sorted(kinds))
            raise WeightsError(f"{next(iter(kinds.values()))[0].name}: {names} of {weight!r}, which is not an e4m3 "
                               f"projection weight of this checkpoint")
        for kind in kinds:
            if kind not in (want, "input_scale"):
                raise WeightsError(f"{kinds[kind][0].name}: {weight[:-len('.weight')]}.{kind} does not belong to a "
                                   f"{layout} checkpoint (its weights carry {want})")
    for f in fills:
        kinds = scale_infos.get(f.weight, {})
        if want not in kinds:
            raise WeightsError(f"{f.path.name}: e4m3 tensor {f.weight!r} has no {f.weight[:-len('.weight')]}.{want}")
        path, info = kinds[want]
        name = info.name
        t = _read(files, path, info.begin, info.end, info.dtype, tuple(info.shape), name)
        rows, cols = f.dest.shape[0], f.dest.shape[1]
        if layout == "channel":
            if tuple(t.shape) not in ((rows, 1), (rows,)):
                raise WeightsError(f"{path.name}: scale tensor {name!r} has shape {list(t.shape)}, expected [{rows}, 1]")
            f.scale_rows = t.reshape(rows)
        elif layout == "tensor":
            if t.numel() != 1 or t.dim() > 1:
                raise WeightsError(f"{path.name}: scale tensor {name!r} has shape {list(t.shape)}, expected [1]")
            f.scale_rows = t.reshape(1).expand(rows).contiguous()
        else:
            shape = (-(-rows // BLOCK), -(-cols // BLOCK))
            if tuple(t.shape) != shape:
                raise WeightsError(f"{path.name}: scale tensor {name!r} has shape {list(t.shape)}, expected {list(shape)}")
            f.blocks = t
        if "input_scale" in kinds:
            p2, i2 = kinds["input_scale"]
            s = _read(files, p2, i2.begin, i2.end, i2.dtype, tuple(i2.shape), i2.name)
            if s.numel() != 1:
                raise WeightsError(f"{p2.name}: scale tensor {i2.name!r} has shape {list(s.shape)}, expected [1]")


# Rows of a block128 tensor re-quantized in one operation: float32 bands of at most this many
# bytes (a hub MoE checkpoint has ~18k expert tensors of 6-16 bands: one op a band was ~170k ops)
REQUANT_BYTES = 32 << 20


def apply(fills: list[ScaleFill]) -> None:
    """After the copy: each fill's scales into the model (block128: its rows requantized per row).
    A weight holding e4m3's NaN code (S.1111.111) is refused naming it: a corrupt file, which
    would otherwise give NaN logits. The NaN checks are read back once, for all fills."""
    with torch.no_grad():
        if fills:  # one model's weights: one device, one read back
            bad = torch.stack([((f.dest.view(torch.uint8) & 0x7F) == 0x7F).any() for f in fills]).tolist()
            for f, hit in zip(fills, bad):
                if hit:
                    raise WeightsError(f"{f.path.name}: e4m3 tensor {f.weight!r} holds NaN codes")
        for f in fills:
            if f.blocks is None:
                f.scale.copy_(f.scale_rows.to(f.scale.device))
                continue
            blocks = f.blocks.to(f.dest.device)
            rows, cols = f.dest.shape
            step = max(1, REQUANT_BYTES // (BLOCK * cols * 4)) * BLOCK  # whole bands a chunk
            for r0 in range(0, rows, step):
                r1 = min(r0 + step, rows)
                mult = blocks[r0 // BLOCK:-(-r1 // BLOCK)].repeat_interleave(BLOCK, 0)[:r1 - r0]
                band = f.dest[r0:r1].float() * mult.repeat_interleave(BLOCK, 1)[:, :cols]
                quantize_rows(band, Fp8Rows(f.dest[r0:r1], f.scale[r0:r1].view(-1, 1)))


def is_fp8(dtype: str) -> bool:
    return dtype == "F8_E4M3"


def refuse_fp8_dtype(path: Path, name: str, dtype: str, dest: torch.Tensor | None) -> None:
    """An e4m3 tensor is only ever an FP8 model's projection weight; F8_E5M2 never."""
    if dtype == "F8_E4M3" and dest is not None and dest.dtype == FP8:
        return
    what = "an FP8 model's projection weights" if dtype == "F8_E4M3" else "no tensor of this engine"
    raise WeightsError(f"{path.name}: tensor {name!r} has dtype {dtype}; only {what} may")
