"""The warm tier's restore speed with the arena pinned in pieces (the start-up pinning) against
one buffer pinned in one registration (a put without an arena), same tensors, same run; and
what pinning the arena costs. Prints one JSON line; the first argument is where it also goes.

    python3 ops/gpu/warm_tier_probe.py $OUT/warm_tier_probe.json
"""

from __future__ import annotations

import json
import sys
import time

import torch

from engine.weights.warm_tier import WarmTier

GiB = 1 << 30


def tensors() -> dict[str, torch.Tensor]:
    """~10 GiB in 8B-like sizes: embedding-sized, MLP-sized and small ones."""
    out = {"embed": torch.randn(128256, 4096, device="cuda", dtype=torch.bfloat16)}
    for i in range(8):
        out[f"mlp{i}"] = torch.randn(28672, 4096, device="cuda", dtype=torch.bfloat16)[:, :4000]
        out[f"attn{i}"] = torch.randn(6144, 4096, device="cuda", dtype=torch.bfloat16)
        out[f"norm{i}"] = torch.randn(4096, device="cuda", dtype=torch.bfloat16)
    return {k: v.contiguous() for k, v in out.items()}


def restore_gbps(tier: WarmTier, name: str, src: dict[str, torch.Tensor], rounds: int = 3) -> list[float]:
    dst = {k: torch.empty_like(v) for k, v in src.items()}
    nbytes = sum(v.numel() * v.element_size() for v in src.values())
    out = []
    for _ in range(rounds):
        torch.cuda.synchronize()
        t = time.perf_counter()
        assert tier.restore(name, dst)
        out.append(round(nbytes / (time.perf_counter() - t) / 1e9, 2))
    assert all(torch.equal(dst[k], src[k]) for k in src)
    return out


def main() -> None:
    src = tensors()
    nbytes = sum(v.numel() * v.element_size() for v in src.values())
    res: dict[str, object] = {"bytes": nbytes}
    arena = WarmTier(nbytes + GiB)
    turns = []
    t = time.perf_counter()
    arena.prepin(lambda: turns.append(time.perf_counter()))
    res["prepin_s"] = round(time.perf_counter() - t, 3)
    res["prepin_pieces"] = len(turns)
    gaps = [b - a for a, b in zip(turns, turns[1:])]
    res["piece_s_max"] = round(max(gaps), 4) if gaps else None
    t = time.perf_counter()
    assert arena.put("m", src)
    res["arena_put_s"] = round(time.perf_counter() - t, 3)
    res["arena_restore_gbps"] = restore_gbps(arena, "m", src)
    del arena
    single = WarmTier(nbytes + GiB)
    t = time.perf_counter()
    assert single.put("m", src)
    res["single_put_s"] = round(time.perf_counter() - t, 3)
    res["single_restore_gbps"] = restore_gbps(single, "m", src)
    line = json.dumps(res)
    print(line)
    if len(sys.argv) > 1:
        open(sys.argv[1], "w").write(line + "\n")


if __name__ == "__main__":
    main()
