"""Rotary position embedding: cos/sin cache (default, linear and llama3 scaling) and its application.

The cache row for position p is ``[cos(p * f_0) .. cos(p * f_{D/2-1}), sin(p * f_0) .. sin(...)]``
with the inverse frequencies computed exactly as Hugging Face transformers does (float32,
``theta ** (arange(0, D, 2) / D)``; llama3 smoothing between low and high frequency
wavelengths, none where the two factors are equal). ``apply_rope`` uses the rotate_half
convention by default: the first and second halves of the head dimension are the pair rotated
together, element i with element i + D/2 by angle ``p * f_i``. ``interleaved=True`` (Llama 4,
whose reference rotates ``x`` as complex numbers ``x[2i] + 1j * x[2i + 1]``) rotates the
neighbours 2i and 2i + 1 together by that angle, from the same cache.
"""

from __future__ import annotations

import math

import torch

from engine.kernels._dispatch import KernelError, check, use_triton


def _inv_freq(head_dim: int, theta: float) -> torch.Tensor:
    exps = torch.arange(0, head_dim, 2, dtype=torch.int64).to(torch.float32) / head_dim
    return 1.0 / (theta ** exps)


def _llama3(inv_freq: torch.Tensor, scaling: dict) -> torch.Tensor:
    try:
        factor = float(scaling["factor"])
        low = float(scaling["low_freq_factor"])
        high = float(scaling["high_freq_factor"])
        old_len = float(scaling["original_max_position_embeddings"])
    except KeyError as e:
        raise KernelError(f"llama3 rope scaling needs {e.args[0]!r}") from None
    if high < low:
        raise KernelError(f"llama3 rope scaling: high_freq_factor {high} is below low_freq_factor {low}")
    low_wavelen = old_len / low
    high_wavelen = old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    if high == low:  # no band between the two wavelengths to smooth over (Llama 4 Scout: both 1)
        return scaled
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


def rope_inv_freq(head_dim: int, theta: float, scaling: dict | None) -> torch.Tensor:
    """Inverse frequencies [head_dim // 2] (float32) for a rope_scaling / rope_parameters dict."""
    if head_dim % 2:
        raise KernelError(f"head_dim {head_dim} must be even for rotary embeddings")
    inv = _inv_freq(head_dim, theta)
    kind = None
    if scaling:
        kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind in (None, "default"):
        return inv
    if kind == "linear":
        return inv / float(scaling["factor"])
    if kind == "llama3":
        return _llama3(inv, scaling)
    raise KernelError(f"unsupported rope scaling type {kind!r} (supported: default, linear, llama3)")


def build_cos_sin_cache(head_dim: int, max_position: int, theta: float, scaling: dict | None,
                        device, dtype=torch.float32) -> torch.Tensor:
    """[max_position, head_dim]: cos in the first half, sin in the second (float32 math)."""
    inv = rope_inv_freq(head_dim, theta, scaling)
    pos = torch.arange(max_position, dtype=torch.int64).to(torch.float32)
    freqs = torch.outer(pos, inv)
    return torch.cat([freqs.cos(), freqs.sin()], dim=-1).to(device=device, dtype=dtype)


def _rotate_ref(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool) -> None:
    half = x.shape[-1] // 2
    xf = x.float()
    if interleaved:
        x1, x2 = xf[..., 0::2], xf[..., 1::2]
        out = torch.stack([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).flatten(-2)
    else:
        x1, x2 = xf[..., :half], xf[..., half:]
        out = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
    x.copy_(out.to(x.dtype))


def apply_rope_ref(q, k, positions, cos_sin_cache, interleaved: bool = False):
    half = q.shape[-1] // 2
    cs = cos_sin_cache.index_select(0, positions.to(torch.int64)).float()
    cos, sin = cs[:, None, :half], cs[:, None, half:]
    _rotate_ref(q, cos, sin, interleaved)
    _rotate_ref(k, cos, sin, interleaved)
    return q, k


def apply_rope(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor,
               interleaved: bool = False):
    """Rotate q[N,Hq,D] and k[N,Hkv,D] in place by positions[N]; returns (q, k). ``interleaved``:
    the pairs are (2i, 2i + 1), not (i, i + D/2) (see the module docstring)."""
    check(q.dim() == 3 and k.dim() == 3, "q and k must be [N, H, D]")
    check(q.shape[0] == k.shape[0] == positions.shape[0], "q, k and positions must agree on N")
    check(q.shape[2] == k.shape[2] == cos_sin_cache.shape[1], "head_dim of q, k and the cache must agree")
    check(q.stride(2) == 1 and k.stride(2) == 1, "q and k need a contiguous last dim")
    if q.shape[0] == 0:
        return q, k
    if use_triton(q, k, positions, cos_sin_cache):
        from engine.kernels.rope_triton import apply_rope_triton

        apply_rope_triton(q, k, positions, cos_sin_cache, interleaved=interleaved)
        return q, k
    return apply_rope_ref(q, k, positions, cos_sin_cache, interleaved=interleaved)
