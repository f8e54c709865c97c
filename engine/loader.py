"""Weights: safetensors files → the model's (fused) parameters, in place.

Only safetensors is read: pickle-based formats (``*.bin``, ``*.pt``, ``*.pth``, ``*.ckpt``)
are refused, never opened. Every file's header is validated by
:func:`cache.safetensors_check.check_file` before a tensor is read. Every parameter slot must
be filled exactly once, with the shape the config implies; anything missing, repeated,
misshapen or unknown is a :class:`WeightsError` naming the tensor and file.

Today a tensor is read through ``safetensors.safe_open`` and copied (with the dtype cast) into
its row range of the destination; the pinned-ring, multi-stream loader of DESIGN §5 replaces
:func:`_copy_file` without changing the slot contract.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from cache.errors import SafetensorsError
from cache.safetensors_check import check_file
from engine.errors import WeightsError

PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")
# Buffers some exporters add that the engine recomputes itself.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
_ST_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}


def weight_files(model_dir: str | Path) -> list[Path]:
    """The safetensors files of a model folder (via the shard index when there is one)."""
    d = Path(model_dir)
    index = d / "model.safetensors.index.json"
    if index.is_file():
        try:
            doc = json.loads(index.read_text(encoding="utf-8"))
            names = sorted(set(doc["weight_map"].values()))
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise WeightsError(f"{index.name} is malformed: {e}") from None
        files = []
        for n in names:
            if not isinstance(n, str) or "/" in n or "\\" in n or n.startswith(".") or not n.endswith(".safetensors"):
                raise WeightsError(f"{index.name} names a bad shard file {n!r}")
            if not (d / n).is_file():
                raise WeightsError(f"shard {n} listed in {index.name} is missing")
            files.append(d / n)
        return files
    files = sorted(d.glob("*.safetensors"))
    if files:
        return files
    pickles = sorted(p.name for p in d.iterdir() if p.suffix in PICKLE_SUFFIXES) if d.is_dir() else []
    if pickles:
        raise WeightsError(f"{d}: only pickle-format weights ({', '.join(pickles[:3])}); safetensors is required")
    raise WeightsError(f"{d}: no *.safetensors weight files")


def _copy_file(path: Path, slots: dict[str, tuple[torch.Tensor, int, int]], filled: set[str]) -> None:
    from safetensors import safe_open

    try:
        header = check_file(path)
    except SafetensorsError as e:
        raise WeightsError(f"{path.name}: {e}") from None
    infos = {t.name: t for t in header.tensors}
    with safe_open(str(path), framework="pt", device="cpu") as f:
        for name, info in infos.items():
            if name.endswith(_IGNORED_SUFFIXES):
                continue
            if name == "lm_head.weight" and name not in slots:
                continue  # a tied head saved anyway: the embedding is the head
            slot = slots.get(name)
            if slot is None:
                raise WeightsError(f"{path.name}: unexpected tensor {name!r} for this architecture")
            if name in filled:
                raise WeightsError(f"{path.name}: tensor {name!r} appears twice in the checkpoint")
            if info.dtype not in _ST_DTYPES:
                raise WeightsError(f"{path.name}: tensor {name!r} has dtype {info.dtype}, expected F32/F16/BF16")
            dest, start, rows = slot
            want = (rows, *dest.shape[1:])
            if tuple(info.shape) != want:
                raise WeightsError(f"{path.name}: tensor {name!r} has shape {list(info.shape)}, expected {list(want)}")
            with torch.no_grad():
                dest[start:start + rows].copy_(f.get_tensor(name))
            filled.add(name)


def load_weights(model: torch.nn.Module, model_dir: str | Path) -> int:
    """Fill ``model.weight_slots()`` from the folder's safetensors; returns the bytes loaded."""
    slots = model.weight_slots()
    filled: set[str] = set()
    for path in weight_files(model_dir):
        _copy_file(path, slots, filled)
    missing = sorted(set(slots) - filled)
    if missing:
        more = f" (+{len(missing) - 3} more)" if len(missing) > 3 else ""
        raise WeightsError(f"{model_dir}: missing weights {', '.join(missing[:3])}{more}")
    return model.nbytes
