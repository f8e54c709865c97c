"""Weights: safetensors files → the model's (fused) parameters, in place.

Only safetensors is read: pickle-based formats (``*.bin``, ``*.pt``, ``*.pth``, ``*.ckpt``)
are refused, never opened. Every file's header is validated by
:func:`cache.safetensors_check.check_file` before a tensor is read. Every parameter slot must
be filled exactly once, with the shape the config implies; anything missing, repeated,
misshapen or unknown is a :class:`WeightsError` naming the tensor and file.

Copies go through :func:`engine.weights.weight_stream.stream_to_device`: on CUDA, reader threads fill a
ring of pinned buffers and two streams copy each range straight into its row range of the fused
destination (a dtype cast, when the file's differs, runs on the device); on CPU the readers
``pread`` into the tensors' bytes. The warm tier (:mod:`engine.weights.warm_tier`) keeps unloaded
weights in pinned host RAM: :func:`stash_weights` at unload, :func:`load_or_restore` at load.
"""

from __future__ import annotations

import json
import os
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from cache.errors import SafetensorsError
from cache.safetensors_check import check_file
from engine.errors import WeightsError
from engine.weights import fp8_checkpoint
from engine.weights.slots import CheckpointMap, FusedExperts
from engine.weights.warm_tier import WarmTier, WarmTierError
from engine.weights.weight_stream import CopyJob, stream_to_device

PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")
# Buffers some exporters add that the engine recomputes itself.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
_ST_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}


@dataclass
class WeightsReady:
    """The load thread's result: the filled model and how it was filled."""

    model: torch.nn.Module  # an engine.models.llama.LlamaModel
    nbytes: int
    source: str  # "warm" | "disk"
    ready: Any  # torch.cuda.Event recorded behind the copies and the rope cache (None on CPU)
    runner: Any = None  # (pool generation, kv, runner) built beside the copies, or None
    # the warm-tier key of the bytes now in the model; None: its files were replaced while they
    # were read, so no key names what was read (nothing is stashed for it at unload)
    key: str | None = None


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


def checked_tensors(path: Path, names: CheckpointMap, filled: set[str],
                    scales: dict[str, dict[str, tuple]] | None = None):
    """Validate one file's header, then yield ``(info, slot)`` for each tensor this model takes.

    Refuses (WeightsError, naming file and tensor) a bad header, an unexpected or repeated
    tensor and a dtype other than F32/F16/BF16 (F8_E4M3 for an FP8 model's projection weights);
    marks each yielded name in ``filled``. ``scales`` (an FP8 checkpoint's): its scale tensors are
    collected there (weight name → kind → (path, info)) instead of refused. A fused experts tensor
    (engine.weights.slots) is yielded with its :class:`FusedExperts` as the slot and marks the
    names it covers; tensors under a skipped prefix are passed over. Shapes are the caller's to
    check: a tensor-parallel shard expects slices, not the whole tensor.
    """
    try:
        header = check_file(path)
    except SafetensorsError as e:
        raise WeightsError(f"{path.name}: {e}") from None
    slots = names.slots
    for info in header.tensors:
        name = info.name
        if name.endswith(_IGNORED_SUFFIXES) or (names.skipped and name.startswith(names.skipped)):
            continue
        if name == names.prefix + "lm_head.weight" and name not in slots:
            continue  # a tied head saved anyway: the embedding is the head
        target = fp8_checkpoint.scale_target(name)
        if target is not None and target[0] in slots:
            if scales is None:
                raise WeightsError(f"{path.name}: FP8 scale tensor {name!r} in a checkpoint whose config.json "
                                   f"declares no FP8 quantization_config (or a model loaded without FP8)")
            kinds = scales.setdefault(target[0], {})
            if target[1] in kinds:
                raise WeightsError(f"{path.name}: tensor {name!r} appears twice in the checkpoint")
            kinds[target[1]] = (path, info)
            continue
        group = names.fused.get(name)
        if group is not None:
            if info.dtype not in _ST_DTYPES:
                raise WeightsError(f"{path.name}: tensor {name!r} has dtype {info.dtype}, expected F32/F16/BF16 "
                                   f"(a checkpoint with e4m3 experts keeps one tensor an expert)")
            if name in filled or any(c in filled for c in group.covers):
                raise WeightsError(f"{path.name}: tensor {name!r} appears twice in the checkpoint "
                                   f"(fused, and one tensor an expert)")
            filled.add(name)
            filled.update(group.covers)
            yield info, group
            continue
        slot = slots.get(name)
        if slot is None:
            raise WeightsError(f"{path.name}: unexpected tensor {name!r} for this architecture")
        if name in filled:
            raise WeightsError(f"{path.name}: tensor {name!r} appears twice in the checkpoint")
        if info.dtype.startswith("F8_"):
            fp8_checkpoint.refuse_fp8_dtype(path, name, info.dtype, slot[0])
        elif info.dtype not in _ST_DTYPES:
            raise WeightsError(f"{path.name}: tensor {name!r} has dtype {info.dtype}, expected F32/F16/BF16")
        filled.add(name)
        yield info, slot


def _fused_jobs(path: Path, info, group: FusedExperts) -> list[CopyJob]:
    """One transposing copy job an expert of a fused experts tensor."""
    if tuple(info.shape) != group.file_shape:
        raise WeightsError(f"{path.name}: tensor {info.name!r} has shape {list(info.shape)}, "
                           f"expected {list(group.file_shape)}")
    src = _ST_DTYPES[info.dtype]
    stack = group.stack.data
    each = (info.end - info.begin) // stack.shape[0]
    return [CopyJob(path, info.begin + e * each, each, stack[e], src_dtype=None if src == stack.dtype else src,
                    scale=None if group.scale is None else group.scale.data[e], transposed=True)
            for e in range(stack.shape[0])]


def _file_jobs(path: Path, names: CheckpointMap, filled: set[str], scales: dict[int, torch.Tensor] | None = None,
               fp8: _Fp8Files | None = None) -> list[CopyJob]:
    """One copy job per tensor of the file (a row range of its slot), shapes checked. ``scales``
    (``LlamaModel.row_scales``): a slot found there is quantized to FP8 as it lands, unless the
    file's tensor is e4m3 already (``fp8``: an FP8 checkpoint's; its scales come from the file).
    A fused experts tensor: one transposing job an expert."""
    jobs = []
    for info, slot in checked_tensors(path, names, filled, fp8.scales if fp8 else None):
        if isinstance(slot, FusedExperts):
            jobs.extend(_fused_jobs(path, info, slot))
            continue
        dest, start, rows = slot
        want = (rows, *dest.shape[1:])
        if tuple(info.shape) != want:
            raise WeightsError(f"{path.name}: tensor {info.name!r} has shape {list(info.shape)}, expected {list(want)}")
        view = dest.data[start:start + rows]
        scale = (scales or {}).get(id(dest))
        if fp8_checkpoint.is_fp8(info.dtype):
            if fp8 is None:
                raise WeightsError(f"{path.name}: e4m3 tensor {info.name!r} in a checkpoint whose config.json "
                                   f"declares no FP8 quantization_config")
            fp8.fills.append(fp8_checkpoint.ScaleFill(info.name, path, view, scale.data[start:start + rows]))
            jobs.append(CopyJob(path, info.begin, info.end - info.begin, view))
            continue
        src = _ST_DTYPES[info.dtype]
        jobs.append(CopyJob(path, info.begin, info.end - info.begin, view,
                            src_dtype=None if src == dest.dtype else src,
                            scale=None if scale is None else scale.data[start:start + rows]))
    return jobs


@dataclass
class _Fp8Files:
    """What an FP8 checkpoint's files hold beside the weights (engine.weights.fp8_checkpoint)."""

    layout: str
    scales: dict[str, dict[str, tuple]] = field(default_factory=dict)
    fills: list = field(default_factory=list)


def reader_threads() -> int:
    """Reader threads of a weight stream: 8 where the host has the cores (on the H200's host, a
    warm 16 GB stream reached 31.7 GB/s with 8 against 20.8 with 4: docs/perf.md, load_bench)."""
    return max(1, min(8, os.cpu_count() or 1))


def load_weights(model: torch.nn.Module, model_dir: str | Path, *, threads: int | None = None, streams: int = 2,
                 cancel: threading.Event | None = None) -> int:
    """Fill ``model.weight_slots()`` from the folder's safetensors; returns the bytes loaded.
    An FP8 model's projections are quantized on the way (per output channel, on its device).

    Every header is checked and every tensor matched to its slot before a byte is copied; then
    one :func:`stream_to_device` call moves all files' ranges straight into the (fused) weights.
    ``cancel`` set stops the copy at its next chunk (:class:`WeightStreamError`).
    """
    names = model.checkpoint_map()
    scales = model.row_scales()
    layout = getattr(model.cfg, "fp8_checkpoint", None)
    fp8 = _Fp8Files(layout) if layout and scales else None
    filled: set[str] = set()
    jobs: list[CopyJob] = []
    for path in weight_files(model_dir):
        jobs.extend(_file_jobs(path, names, filled, scales, fp8))
    missing = sorted(set(names.slots) - filled)
    if missing:
        more = f" (+{len(missing) - 3} more)" if len(missing) > 3 else ""
        raise WeightsError(f"{model_dir}: missing weights {', '.join(missing[:3])}{more}")
    if fp8 is not None:
        fp8_checkpoint.read_scales(fp8.layout, fp8.fills, fp8.scales)  # every scale checked before a copy
    stream_to_device(jobs, threads=threads or reader_threads(), streams=streams, cancel=cancel)
    if fp8 is not None:
        fp8_checkpoint.apply(fp8.fills)
    return model.nbytes


def model_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The model's weight tensors by parameter name, each once (a tied head is the embedding)."""
    out: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    for name, p in model.named_parameters():
        if id(p) not in seen:
            seen.add(id(p))
            out[name] = p.data
    return out


def warm_key(model_dir: str | Path, form: str = "") -> str:
    """The warm-tier key of a model's device bytes: the identity of its weight files and ``form``,
    what turns those files into the bytes on the device (the loader passes the computation's key,
    which holds the quantization, and the device dtype). Not the model's name: names that load
    the same files the same way (aliases of one checkpoint, one set of bytes published under
    several names) share one copy, as they share the disk cache's blobs and the page cache; an
    unload of one keeps the copy another left (no second device-to-host copy beside the steps).

    Files are hard links into content-addressed blobs, so (device, inode, size, mtime) changes
    when a new version of the model is pulled into the same snapshot path: a stale copy is never
    restored.
    """
    parts = [form]
    for f in weight_files(model_dir):
        st = f.stat()
        parts.append(f"{f.name}:{st.st_dev}:{st.st_ino}:{st.st_size}:{st.st_mtime_ns}")
    return "|".join(parts)


def stash_weights(tier: WarmTier | None, key: str, model: torch.nn.Module) -> tuple[bool, torch.cuda.Event | None]:
    """At unload: keep a host copy of the model's weights in the warm tier: (stored, the event of
    its copies' landing, None when none is in flight). False: no tier or no room.

    The copies are not waited for (:meth:`WarmTier.put_async`): whoever writes into the model's
    tensors next waits for the event. A copy already stored under ``key`` is kept as it is: the
    key names the files' identity and the engine never writes weights, so the bytes are the same
    (a 16 GB re-copy costs seconds).
    """
    if tier is None:
        return False, None
    tensors = model_tensors(model)
    if tier.keep(key, tensors):
        return True, None
    return tier.put_async(key, tensors)


def load_or_restore(model: torch.nn.Module, model_dir: str | Path, tier: WarmTier | None = None,
                    key: str | None = None, *, cancel: threading.Event | None = None) -> tuple[int, str]:
    """Fill the model from the warm tier when it holds ``key``, else from the files.

    Returns (bytes, source) with source "warm" or "disk". The tier's copy stays (most recently
    used); a copy whose shapes no longer match (the folder changed) is discarded and the files read.
    """
    if tier is not None and key is not None:
        try:
            if tier.restore(key, model_tensors(model)):
                return model.nbytes, "warm"
        except WarmTierError:
            tier.discard(key)
    return load_weights(model, model_dir, cancel=cancel), "disk"
