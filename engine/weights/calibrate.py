"""Calibrated FP8 checkpoints: an unquantized model written again as e4m3 projections with one
scale per output channel (compressed-tensors ``float-quantized``, ``channel``, dynamic per-token
inputs: what engine/weights/fp8_checkpoint.py loads), the rounding chosen on calibration text
instead of to nearest at load.

**GPTQ on the e4m3 grid** (Frantar et al. 2022, with e4m3's grid in place of an integer one):
each weight row keeps its amax / 448 scale; its columns are rounded in order and each column's
rounding error is spread over the columns not yet rounded through the inverse of XᵀX of the
inputs the projection saw over the calibration text (its "gram", recorded from the engine's own
float32 prefill), so the layer's outputs on inputs like the calibration's err less than with
every weight rounded to nearest.

Measured through the engine on SmolLM2-135M-Instruct (docs/perf.md, 2026-12-03: 8,192 positions,
4,096 calibration tokens taken past them): perplexity ×1.027 → ×1.012 against the unquantized
model (with the FP8 KV cache ×1.037 → ×1.016), top-1 agreement 88.9 → 90.4 %. Smoothing
(SmoothQuant's migration of the activations' range into the weights, folded into the norms and
the v/up rows) was tried with it and measured worse (×1.019), so it is not done. The
activations' own per-token e4m3 rounding at serving is unchanged: on that model it alone holds
top-1 agreement at ~93 %.

``calibrate(model_dir, out, token_ids)``: the caller gives the tokens (``infire-agent quantize``
tokenizes a text file). Float32 on ``device``: an 8B's weights take 32 GB and its grams 33 GB
(its down projections' inputs are 14,336 wide), so an 8B calibrates on a GPU, a small model
anywhere; :func:`calibration_bytes` sizes it before anything loads.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

import torch

from engine.errors import EngineError
from engine.kernels.fp8_format import E4M3_MAX, FP8, MIN_SCALE
from engine.load_spec import LoadSpec

log = logging.getLogger(__name__)

# Calibration bounds: below this many tokens a gram of a wide projection is mostly noise.
MIN_TOKENS = 256
MAX_TOKENS = 1 << 20
GPTQ_BLOCK = 128  # columns rounded together before the rest is updated (GPTQ's lazy batch)
GPTQ_DAMP = 0.01  # of the gram's mean diagonal, added to it: keeps the inverse finite


class CalibrationError(EngineError):
    """A calibration could not run: its inputs are out of bounds or the model unsupported."""


def gptq_e4m3(w: torch.Tensor, gram: torch.Tensor, damp: float = GPTQ_DAMP,
              block: int = GPTQ_BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """``w`` [N, K] → (e4m3 codes [N, K], float32 scales [N]): one scale per row (amax / 448),
    the columns rounded in order, each one's error spread over the later columns through the
    inverse of ``gram`` ([K, K], XᵀX of the inputs). Columns no input ever reached (zero on the
    gram's diagonal) are zeroed: nothing multiplies them."""
    if w.dim() != 2 or gram.shape != (w.shape[1], w.shape[1]):
        raise CalibrationError(f"weight {tuple(w.shape)} and gram {tuple(gram.shape)} do not match")
    w = w.float().clone()
    k = w.shape[1]
    scale = (w.abs().amax(dim=1) / E4M3_MAX).clamp_min(MIN_SCALE)
    h = gram.double().clone()
    dead = torch.diag(h) == 0
    h[dead, dead] = 1.0
    w[:, dead] = 0.0
    if not torch.isfinite(h).all():
        raise CalibrationError("the calibration inputs hold NaN or Inf")
    # the upper Cholesky factor of H⁻¹: row i holds what rounding column i does to the later ones;
    # a gram too close to singular for float64 gets more damping (GPTQ's own remedy)
    mean = torch.diag(h).mean()
    for attempt in range(4):
        hd = h.clone()
        hd.diagonal().add_(damp * 10 ** attempt * mean)
        try:
            u = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(hd)), upper=True).float()
            break
        except torch.linalg.LinAlgError:
            continue
    else:
        raise CalibrationError(f"the inputs' gram stays singular at {damp * 1000:g} x its mean diagonal damping")
    del hd
    # on wᵀ, so each column is a contiguous row updated in place (half the time of the column
    # layout, the same arithmetic and the same codes)
    wt = w.t().contiguous()
    codes = torch.empty((k, w.shape[0]), dtype=FP8, device=w.device)
    inv = 1.0 / scale
    diag = u.diagonal().tolist()
    for b0 in range(0, k, block):
        b1 = min(b0 + block, k)
        wb = wt[b0:b1].clone()
        err = torch.empty_like(wb)
        for j in range(b1 - b0):
            col, e = wb[j], err[j]
            torch.mul(col, inv, out=e).clamp_(-E4M3_MAX, E4M3_MAX)
            c = codes[b0 + j]
            c.copy_(e)  # to e4m3, rounded to nearest
            torch.sub(col, c.float().mul_(scale), out=e).div_(diag[b0 + j])
            if j + 1 < b1 - b0:
                wb[j + 1:].sub_(torch.outer(u[b0 + j, b0 + j + 1:b1], e))
        wt[b1:] -= u[b0:b1, b1:].t() @ err
    return codes.t().contiguous(), scale


def _projections(layer) -> dict[str, torch.Tensor]:
    """A decoder layer's four projection weights by role (q/k/v and gate/up fused)."""
    return {"qkv": layer.qkv_w, "o": layer.o_w, "gate_up": layer.gate_up_w, "down": layer.down_w}


class _GramRecorder:
    """XᵀX of every projection's inputs, summed over the calibration prefill (float32, on the
    model's device), by layer and projection: each decoder layer's ``_linear`` wrapped."""

    def __init__(self, model) -> None:
        self.grams: list[dict[str, torch.Tensor]] = [{} for _ in model.layers]
        self._restore = []
        for i, layer in enumerate(model.layers):
            roles = {id(w): role for role, w in _projections(layer).items()}
            orig = layer._linear

            def record(x, w, s, b, _orig=orig, _roles=roles, _g=self.grams[i]):
                rows = x.reshape(-1, x.shape[-1]).float()
                role = _roles[id(w)]
                if role not in _g:
                    _g[role] = torch.zeros(rows.shape[1], rows.shape[1], dtype=torch.float32, device=rows.device)
                _g[role].addmm_(rows.T, rows)  # in place: no second gram-sized temporary
                return _orig(x, w, s, b)

            layer._linear = record
            self._restore.append(layer)

    def close(self) -> None:
        for layer in self._restore:
            del layer._linear  # the class's method again


def _collect_grams(core, name: str, token_ids: list[int], window: int) -> list[dict[str, torch.Tensor]]:
    """Prefill ``token_ids`` in windows through the engine (eagerly: no graph hides the layers'
    calls) and return the grams."""
    from engine.sampling import SamplingParams

    slot = core.slots.get(name)
    rec = _GramRecorder(slot.model)
    try:
        for i in range(0, len(token_ids), window):
            chunk = token_ids[i:i + window]
            if len(chunk) < 2:
                break
            core.add_request(f"cal{i}", name, chunk, SamplingParams(temperature=0, max_tokens=1))
            while core.has_unfinished_requests():
                core.step()
    finally:
        rec.close()
    return rec.grams


def calibration_bytes(cfg) -> int:
    """What a calibration holds at once: the float32 weights, every projection's gram (float32),
    and GPTQ's working set on the widest one (a handful of float64 copies of its gram)."""
    from engine.core.memory_plan import weight_bytes

    widths = 2 * cfg.hidden_size ** 2 + cfg.q_size ** 2 + cfg.intermediate_size ** 2  # qkv, gate_up, o, down
    widest = max(cfg.hidden_size, cfg.q_size, cfg.intermediate_size) ** 2
    return weight_bytes(cfg, torch.float32) + 4 * widths * cfg.num_layers + 4 * 8 * widest


def _available_bytes(device: str) -> tuple[int, str]:
    if device == "cuda" or (device == "auto" and torch.cuda.is_available()):
        return torch.cuda.mem_get_info()[0], "free on the GPU"
    try:  # MemAvailable counts the page cache the kernel can reclaim (the model files just read)
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024, "of available host memory"
    except OSError:
        pass
    import os

    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES"), "of free host memory"


def _preflight(model_dir: str | Path, token_ids: list[int], device: str) -> None:
    """What can be refused from the model's config, before any weight loads: a checkpoint
    already quantized, tokens outside its vocabulary, a device too small
    (:func:`calibration_bytes`, with a tenth to spare)."""
    from engine.config import load_model_config

    cfg = load_model_config(model_dir)
    if cfg.fp8_checkpoint is not None:
        raise CalibrationError(f"{model_dir} is already quantized (FP8, {cfg.fp8_checkpoint})")
    if cfg.num_experts:
        raise CalibrationError(f"{model_dir} is a mixture-of-experts model ({cfg.family}): calibration covers dense "
                               "projections only; load it with quantization = fp8 (each expert rounded to nearest)")
    bad = next((t for t in token_ids if not 0 <= t < cfg.vocab_size), None)
    if bad is not None:
        raise CalibrationError(f"calibration token {bad} is outside the vocabulary (0..{cfg.vocab_size - 1})")
    need = int(calibration_bytes(cfg) * 1.1)
    have, where = _available_bytes(device)
    if need > have:
        raise CalibrationError(f"calibrating {model_dir} needs ~{need / 2**30:.1f} GiB (float32 weights, grams, "
                               f"GPTQ's working set); {have / 2**30:.1f} GiB {where}")


def calibrate(model_dir: str | Path, out: str | Path, token_ids: list[int], *, window: int = 512,
              device: str = "auto") -> dict:
    """Write ``model_dir`` (unquantized) at ``out`` as a calibrated FP8 checkpoint; a report of
    what was done. ``out`` must not exist; nothing is left there when this fails."""
    if not MIN_TOKENS <= len(token_ids) <= MAX_TOKENS:
        raise CalibrationError(f"calibration needs {MIN_TOKENS}..{MAX_TOKENS} tokens, got {len(token_ids)}")
    out = Path(out)
    if out.exists():
        raise CalibrationError(f"{out} exists")
    _preflight(model_dir, token_ids, device)
    try:
        return _calibrate(model_dir, out, token_ids, window, device)
    except torch.OutOfMemoryError as e:
        raise CalibrationError(f"calibrating {model_dir} ran out of device memory: {e}") from None


def _calibrate(model_dir: str | Path, out: Path, token_ids: list[int], window: int, device: str) -> dict:
    from engine.core.engine_core import EngineCore
    from engine.options import EngineOptions
    from engine.weights.fp8_writer import quantize_folder

    t0 = time.perf_counter()
    core = EngineCore(EngineOptions(dtype="float32", max_num_batched_tokens=window, cuda_graphs=False), device=device)
    core.load_model(LoadSpec("calibrate", model_dir, max_model_len=window + 8, max_num_seqs=2, prefix_caching=False))
    slot = core.slots.get("calibrate")
    model = slot.model
    grams = _collect_grams(core, "calibrate", token_ids, window)
    t_grams = time.perf_counter() - t0
    quantized: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # by id of the fused weight: (codes, scales)
    for i, (layer, g) in enumerate(zip(model.layers, grams)):
        if set(g) != {"qkv", "o", "gate_up", "down"}:
            raise CalibrationError(f"layer {i}: the calibration prefill reached {sorted(g)} only")
        for role, w in _projections(layer).items():
            quantized[id(w)] = tuple(t.cpu() for t in gptq_e4m3(w.detach(), g[role]))
    # each checkpoint projection's rows of its fused weight, as the loader maps them
    replace: dict[str, dict[str, torch.Tensor]] = {}
    for name, (dst, start, rows) in model.weight_slots().items():
        if id(dst) in quantized:
            codes, scale = quantized[id(dst)]
            part = slice(start, start + rows)
            replace[name] = {name: codes[part].contiguous(),
                             name.removesuffix(".weight") + ".weight_scale": scale[part, None].contiguous()}
    layers = len(model.layers)
    del core, slot, model, grams
    try:
        quantize_folder(model_dir, out, "channel", replace=replace, overwrite=False)
    except FileExistsError as e:
        raise CalibrationError(str(e)) from None
    seconds = time.perf_counter() - t0
    log.info("calibrated %s → %s: %d tokens, %.1f s (grams %.1f s)", model_dir, out, len(token_ids), seconds, t_grams)
    return {"tokens": len(token_ids), "layers": layers, "seconds": seconds, "grams_seconds": t_grams,
            "scheme": "fp8 e4m3, a scale per output channel, GPTQ-rounded; inputs per token at serving"}
