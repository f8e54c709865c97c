"""What one FP8 decoder layer's kernels cost beside bf16's, at a few batch sizes (Llama-3.1-8B
shapes), each replayed from a CUDA graph: the norms with and without quantized output, SiLU-mul
with and without, the separate row quantization before o_proj, and each projection's GEMM.

    python ops/gpu/fp8_parts.py [out.json]
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402

from engine.kernels import activation, fp8, norm  # noqa: E402
from ops.gpu.fp8_bench import SHAPES, graph_ms  # noqa: E402


def main() -> int:
    out = Path(sys.argv[1] if len(sys.argv) > 1 else os.path.join(os.environ.get("OUT", "."), "fp8_parts.json"))
    dev, h, inter = "cuda", 4096, 14336
    res: dict = {"gpu": torch.cuda.get_device_name(), "commit": os.environ.get("INFIRE_COMMIT", ""),
                 "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "rows": {}}
    ws = {nm: torch.randn(n, k, device=dev, dtype=torch.bfloat16) * 0.02 for nm, (n, k) in SHAPES.items()}
    qs = {nm: fp8.quantize_weight(w) for nm, w in ws.items()}
    for m in (1, 64, 256, 512):
        x = torch.randn(m, h, device=dev, dtype=torch.bfloat16)
        r = torch.randn(m, h, device=dev, dtype=torch.bfloat16)
        w = torch.rand(h, device=dev, dtype=torch.bfloat16) + 0.5
        gu = torch.randn(m, 2 * inter, device=dev, dtype=torch.bfloat16)
        row = {
            "add_norm_bf16": graph_ms(lambda: norm.fused_add_rms_norm(x, r, w, 1e-5)),
            "add_norm_fp8": graph_ms(lambda: norm.fused_add_rms_norm(x, r, w, 1e-5, quant=True)),
            "silu_bf16": graph_ms(lambda: activation.silu_and_mul(gu)),
            "silu_fp8": graph_ms(lambda: activation.silu_and_mul(gu, quant=True)),
            "quantize_rows_4096": graph_ms(lambda: fp8.quantize_rows(x)),
        }
        for nm, (n, k) in SHAPES.items():
            xa = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
            a = fp8.quantize_rows(xa)
            row[f"{nm}_bf16"] = graph_ms(lambda: torch.nn.functional.linear(xa, ws[nm]))
            row[f"{nm}_fp8"] = graph_ms(lambda: fp8.fp8_linear(a, *qs[nm]))
        row = {k: v * 1e3 for k, v in row.items()}  # microseconds
        layer_bf16 = 2 * row["add_norm_bf16"] + row["silu_bf16"] + sum(row[f"{nm}_bf16"] for nm in SHAPES)
        layer_fp8 = (2 * row["add_norm_fp8"] + row["silu_fp8"] + row["quantize_rows_4096"]
                     + sum(row[f"{nm}_fp8"] for nm in SHAPES))
        row.update(layer_bf16_us=layer_bf16, layer_fp8_us=layer_fp8)
        res["rows"][m] = row
        print(f"M={m:3d} " + "  ".join(f"{k} {v:.1f}" for k, v in row.items()), flush=True)
    out.write_text(json.dumps(res, indent=2) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
