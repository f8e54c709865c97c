"""Write a model folder as a pre-quantized FP8 checkpoint in a hub layout:
``quantize_folder(src, out, layout)``, from a bf16/float32 folder — rounded to nearest
(``make-model --quantize fp8``, tests and benches), or with the calibrated tensors
engine/weights/calibrate.py hands in (``replace``; ``infire-agent quantize``).

Layouts (what engine/weights/fp8_checkpoint.py reads):
- ``channel`` / ``tensor``: compressed-tensors ``float-quantized``: ``P.weight`` e4m3 and
  ``P.weight_scale`` ([N, 1] per output channel, or [1] for the whole tensor), ``P.input_scale``
  [1] with ``static_input=True``; ``quantization_config.quant_method = "compressed-tensors"``.
- ``block128``: ``quant_method: "fp8"``, ``weight_block_size [128, 128]``: ``P.weight`` e4m3 and
  ``P.weight_scale_inv`` [ceil(N/128), ceil(K/128)], the multiplier of each block.

Only the decoder projections are quantized, the experts' too; embeddings, norms, biases, the
routers and the LM head stay as they are. Experts kept in one tensor a projection (Llama 4's
``experts.gate_up_proj`` [E, H, 2I] and ``experts.down_proj`` [E, I, H]) are written one tensor an
expert, ``experts.{j}.gate_proj`` / ``up_proj`` / ``down_proj``, as the hub's FP8 checkpoints of
such models keep them (``ignore`` lists the LM head and the routers, as the
hub's checkpoints do; the engine reads no ``ignore``: a tensor's dtype says what it is).
Written next to ``out`` and renamed into place, so a failure leaves nothing under the final name.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

import torch

from engine.config import LLAMA4_SKIPPED_PREFIXES, LLAMA4_TEXT_PREFIX, ROUTER_SUFFIXES, mlp_names
from engine.kernels.fp8 import quantize_weight
from engine.kernels.fp8_format import E4M3_MAX, FP8, MIN_SCALE

LAYOUTS = ("channel", "tensor", "block128")
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
EXPERT_PROJECTIONS = mlp_names("mixtral").projections  # w1, w3, w2: gate, up, down (its router, "gate", stays)


# where a checkpoint's decoder layers are: a text model's, or the one inside an image-and-text
# checkpoint (whose vision tower's projections are not the engine's and stay as they are)
_DECODER = ("model.layers.", LLAMA4_TEXT_PREFIX + "model.layers.")


def _is_projection(name: str) -> bool:
    if not (name.startswith(_DECODER) and name.endswith(".weight")):
        return False
    part = name.split(".")[-2]
    return part in PROJECTIONS or (".experts." in name and part in EXPERT_PROJECTIONS)


def unfused(name: str, t: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """A checkpoint tensor as the per-expert [N, K] weights it holds, if it holds every expert's
    projection at once (see the module docstring); else itself."""
    if not name.startswith(_DECODER) or t.dim() != 3:
        return [(name, t)]
    if name.endswith(".experts.gate_up_proj"):
        base, inter = name[: -len("gate_up_proj")], t.shape[2] // 2
        return [(f"{base}{j}.{part}.weight", t[j, :, cols].t())
                for j in range(t.shape[0]) for part, cols in (("gate_proj", slice(0, inter)),
                                                             ("up_proj", slice(inter, None)))]
    if name.endswith(".experts.down_proj"):
        base = name[: -len("down_proj")]
        return [(f"{base}{j}.down_proj.weight", t[j].t()) for j in range(t.shape[0])]
    return [(name, t)]


def quantize_tensor(w: torch.Tensor, layout: str) -> dict[str, torch.Tensor]:
    """``{"weight": e4m3, scale name: float32}`` of one [N, K] weight in ``layout``."""
    wf = w.float()
    if layout == "channel":  # the scheme a load quantizes to
        q, s = quantize_weight(wf)
        return {"weight": q, "weight_scale": s[:, None]}
    if layout == "tensor":
        s = (wf.abs().amax() / E4M3_MAX).clamp_min(MIN_SCALE).reshape(1)
        return {"weight": (wf / s).clamp(-E4M3_MAX, E4M3_MAX).to(FP8), "weight_scale": s}
    n, k = wf.shape
    pr, pc = -n % 128, -k % 128
    x = torch.nn.functional.pad(wf, (0, pc, 0, pr)).reshape((n + pr) // 128, 128, (k + pc) // 128, 128)
    s = (x.abs().amax(dim=(1, 3)) / E4M3_MAX).clamp_min(MIN_SCALE)
    q = (x / s[:, None, :, None]).clamp(-E4M3_MAX, E4M3_MAX).reshape(n + pr, k + pc)[:n, :k]
    return {"weight": q.to(FP8), "weight_scale_inv": s}


def quantization_config(layout: str, static_input: bool, ignore: tuple[str, ...]) -> dict:
    """The config.json entry of ``layout``; ``ignore``: the Linear modules left unquantized (the
    LM head, the routers of a model with experts, a vision tower's as ``re:`` patterns), as the
    hub's checkpoints list them."""
    skip = list(ignore)
    if layout == "block128":
        return {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "static" if static_input else "dynamic",
                "weight_block_size": [128, 128], "ignore": skip}
    return {"quant_method": "compressed-tensors", "format": "float-quantized", "ignore": skip,
            "config_groups": {"group_0": {
                "targets": ["Linear"],
                "weights": {"num_bits": 8, "type": "float", "strategy": layout, "dynamic": False, "symmetric": True},
                "input_activations": {"num_bits": 8, "type": "float", "strategy": "tensor" if static_input else "token",
                                      "dynamic": not static_input, "symmetric": True}}}}


def quantize_folder(src: str | os.PathLike, out: str | os.PathLike, layout: str, static_input: bool = False,
                    replace: dict[str, dict[str, torch.Tensor]] | None = None, overwrite: bool = True) -> Path:
    """``src`` (an unquantized model folder) written again at ``out`` as an FP8 checkpoint.
    ``replace``: the tensors written in place of each decoder projection's weight, by its name
    (a calibration's codes and scales: engine/weights/calibrate.py) — then every projection must
    have an entry and every entry a projection. ``overwrite`` False: an ``out`` that exists
    when the folder is ready to move there is an error, not replaced."""
    from safetensors.torch import load_file, save_file

    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    src, out = Path(src), Path(out)
    tmp = out.parent / f".{out.name}.partial-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        weight_map: dict[str, str] = {}
        used: set[str] = set()
        kept: set[str] = set()  # Linear modules left unquantized (listed in ``ignore``)
        config = None
        for f in sorted(src.iterdir()):
            if f.suffix == ".safetensors":
                tensors = {}
                for name, t in (one for item in load_file(str(f)).items() for one in unfused(*item)):
                    if _is_projection(name):
                        base = name[: -len(".weight")]
                        if replace is None:
                            parts = {f"{base}.{part}": v for part, v in quantize_tensor(t, layout).items()}
                        elif name in replace:
                            parts = replace[name]
                            used.add(name)
                        else:
                            raise ValueError(f"no calibrated tensors for {name}")
                        tensors.update({k: v.contiguous() for k, v in parts.items()})
                        if static_input:
                            tensors[f"{base}.input_scale"] = torch.ones(1)
                    else:
                        tensors[name] = t
                        if name.endswith(ROUTER_SUFFIXES) or name.endswith("lm_head.weight"):
                            kept.add(name[: -len(".weight")])
                        elif name.startswith(LLAMA4_SKIPPED_PREFIXES):  # a vision tower or projector, whole
                            kept.add(f"re:{re.escape(name.split('.')[0] + '.')}.*")
                save_file(tensors, str(tmp / f.name), metadata={"format": "pt"})
                weight_map.update({n: f.name for n in tensors})
            elif f.name == "config.json":
                config = json.loads(f.read_text())  # written once every tensor's name is known
            elif f.name == "model.safetensors.index.json":
                continue  # written below, with the new tensor names
            elif f.is_file():
                shutil.copy2(f, tmp / f.name)
        if config is not None:
            # a tied head has no tensor of its own, but it is a Linear module left as it is
            wrapped = any(n.startswith(LLAMA4_TEXT_PREFIX) for n in weight_map)
            kept.add((LLAMA4_TEXT_PREFIX if wrapped else "") + "lm_head")
            config["quantization_config"] = quantization_config(layout, static_input, tuple(sorted(kept)))
            (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        if replace is not None and set(replace) != used:
            raise ValueError(f"calibrated tensors for names the checkpoint lacks: {sorted(set(replace) - used)[:3]}")
        if (src / "model.safetensors.index.json").exists():
            (tmp / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
        if out.exists():
            if not overwrite:
                raise FileExistsError(f"{out} appeared while it was being written")
            shutil.rmtree(out)
        tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def main(argv: list[str] | None = None) -> int:
    """``python -m engine.weights.fp8_writer SRC OUT [--layout channel]``: the quantize-once build
    of a cached model's FP8 checkpoint (cache/derived.py), rounded to nearest as a load would."""
    import argparse
    import sys

    ap = argparse.ArgumentParser(prog="python -m engine.weights.fp8_writer",
                                 description="Write an unquantized model folder as an FP8 checkpoint.")
    ap.add_argument("src", help="the model folder (bf16 or float32 safetensors)")
    ap.add_argument("out", help="the folder to write (must not exist)")
    ap.add_argument("--layout", choices=LAYOUTS, default="channel")
    a = ap.parse_args(argv)
    try:
        quantize_folder(a.src, a.out, a.layout, overwrite=False)
    except (OSError, ValueError) as e:
        print(f"fp8_writer: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
