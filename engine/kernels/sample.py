"""Token sampling: greedy at temperature 0, else temperature, top-k, top-p, min-p, then a seeded
exponential race.

Filtering rules (identical in the torch reference and the Triton kernel; ties are all kept):
- ``z = logits / T``; ``top_k`` in (0, V): keep ``z >= (k-th largest z)``;
- ``p = exp(z - max z)`` over the kept tokens (unnormalised, the best token has p = 1);
- ``top_p < 1``: keep token v iff the mass of kept tokens with p strictly above ``p_v`` is below
  ``top_p * sum(p)`` (the sorted-prefix rule with ties widened, renormalised after top-k);
- ``min_p > 0``: keep ``p >= min_p`` (relative to the best token, so order does not matter);
- the token is ``argmax_v p_v / -log(u_v)`` over the kept set, ``u_v = noise(seed, step, v)``.

``noise`` is a fixed uint32 hash (murmur3's finaliser chained over the seed's two halves, the
step and the vocab index) mapped to (0, 1) with 23 bits, so Triton computes the same u bits.
"""

from __future__ import annotations

import torch

from engine.kernels._dispatch import check, use_triton

MASK32 = 0xFFFFFFFF
SEED_SALT = 0x9E3779B9
MIX_C1 = 0x85EBCA6B
MIX_C2 = 0xC2B2AE35


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    # (x * c) mod 2**32 for 0 <= x < 2**32 in int64 without overflowing: split c in 16-bit halves.
    lo = x * (c & 0xFFFF)
    hi = ((x * (c >> 16)) & 0xFFFF) << 16
    return (lo + hi) & MASK32


def _mix32(x: torch.Tensor) -> torch.Tensor:
    x = x ^ (x >> 16)
    x = _mul32(x, MIX_C1)
    x = x ^ (x >> 13)
    x = _mul32(x, MIX_C2)
    return x ^ (x >> 16)


def row_key(seeds: torch.Tensor, steps: torch.Tensor) -> torch.Tensor:
    """Per-row 32-bit key (int64 holding a uint32) from the seed and the step."""
    seeds = seeds.to(torch.int64)
    lo = seeds & MASK32
    hi = (seeds >> 32) & MASK32
    h = _mix32(lo ^ SEED_SALT)
    h = _mix32(h ^ hi)
    return _mix32(h ^ (steps.to(torch.int64) & MASK32))


def noise_uniform(seeds: torch.Tensor, steps: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """u[B, V] in (0, 1), float32: ((hash >> 9) + 0.5) / 2**23, exact in float32 (24 significant bits)."""
    key = row_key(seeds, steps)[:, None]
    v = torch.arange(vocab_size, dtype=torch.int64, device=seeds.device)[None, :]
    h = _mix32(key ^ v)
    return ((h >> 9).to(torch.float32) + 0.5) * (1.0 / 8388608.0)


def filter_ref(logits, temperature, top_k, top_p, min_p):
    """(keep[B, V] bool, p[B, V]) of the filtering rules above; rows with temperature 0 are
    filtered as if T were 1 (the caller takes their argmax instead)."""
    vocab = logits.shape[1]
    logits = logits.float()
    t = torch.where(temperature <= 0, torch.ones_like(temperature), temperature).float()
    z = logits / t[:, None]
    sz, _ = torch.sort(z, dim=-1, descending=True)
    m = sz[:, :1]
    k = top_k.to(torch.int64)
    k = torch.where((k <= 0) | (k >= vocab), torch.full_like(k, vocab), k)
    kth = sz.gather(1, (k - 1)[:, None])
    keep = z >= kth
    p = torch.where(keep, torch.exp(z - m), torch.zeros_like(z))
    ps = torch.where(sz >= kth, torch.exp(sz - m), torch.zeros_like(sz))
    total = ps.sum(dim=-1, keepdim=True)
    cum_excl = torch.cumsum(ps, dim=-1) - ps
    tp = top_p.float()[:, None]
    kept_sorted = cum_excl < tp * total
    kept_sorted[:, 0] = True
    p_thresh = torch.where(kept_sorted, ps, torch.full_like(ps, float("inf"))).amin(dim=-1, keepdim=True)
    keep = keep & ((tp >= 1.0) | (p >= p_thresh))
    keep = keep & (p >= min_p.float()[:, None])
    return keep, p


def sample_ref(logits, temperature, top_k, top_p, min_p, seeds, steps):
    """Torch reference (sorts every row; fine on CPU and for tests)."""
    keep, p = filter_ref(logits, temperature, top_k, top_p, min_p)
    u = noise_uniform(seeds, steps, logits.shape[1])
    score = torch.where(keep, p / -torch.log(u), torch.full_like(p, -1.0))
    sampled = torch.argmax(score, dim=-1)
    return torch.where(temperature <= 0, torch.argmax(logits.float(), dim=-1), sampled)


def sample(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
           min_p: torch.Tensor, seeds: torch.Tensor, steps: torch.Tensor) -> torch.Tensor:
    """ids[B] int64 for logits[B,V] float32; per-row parameters are [B] tensors on the same device."""
    check(logits.dim() == 2, f"logits must be [B, V], got {tuple(logits.shape)}")
    b = logits.shape[0]
    for name, tsr in (("temperature", temperature), ("top_k", top_k), ("top_p", top_p),
                      ("min_p", min_p), ("seeds", seeds), ("steps", steps)):
        check(tsr.shape == (b,), f"{name} must be [{b}], got {tuple(tsr.shape)}")
    if b == 0:
        return torch.empty(0, dtype=torch.int64, device=logits.device)
    if use_triton(logits, temperature, top_k, top_p, min_p, seeds, steps):
        from engine.kernels.sample_triton import sample_triton

        return sample_triton(logits, temperature, top_k, top_p, min_p, seeds, steps)
    return sample_ref(logits, temperature, top_k, top_p, min_p, seeds, steps).to(torch.int64)


def apply_token_bitmask(logits: torch.Tensor, mask: torch.Tensor) -> None:
    """Constrained decoding: ``logits[r, t] = -inf`` where bit ``t % 32`` of ``mask[r, t // 32]``
    is clear, in place (``mask`` [B, ceil(V/32)] int32, one row per row of ``logits`` [B, V]).
    Plain torch on any device: a few elementwise ops over [B, V], small next to the LM head."""
    check(logits.dim() == 2 and mask.dim() == 2 and mask.shape[0] == logits.shape[0],
          f"mask {tuple(mask.shape)} does not fit logits {tuple(logits.shape)}")
    check(mask.dtype == torch.int32 and mask.shape[1] * 32 >= logits.shape[1],
          f"mask must be int32 with {-(-logits.shape[1] // 32)} words a row, got {mask.dtype} {mask.shape[1]}")
    if logits.shape[0] == 0:
        return
    bits = torch.arange(32, dtype=torch.int32, device=mask.device)
    allowed = ((mask[:, :, None] >> bits) & 1).view(mask.shape[0], -1)[:, :logits.shape[1]]
    logits.masked_fill_(allowed == 0, float("-inf"))
