"""Kernels of the engine: each public function picks its Triton kernel on CUDA tensors and its
plain-torch reference elsewhere (``INFIRE_KERNELS=torch|triton`` overrides). Signatures and the
KV/metadata layout are fixed in docs/architecture.md; design notes in docs/kernels.md."""

from engine.kernels._dispatch import KernelError, backend_for
from engine.kernels.activation import silu_and_mul
from engine.kernels.attention import paged_attention
from engine.kernels.kv_write import write_kv
from engine.kernels.norm import fused_add_rms_norm, rms_norm
from engine.kernels.rope import apply_rope, build_cos_sin_cache
from engine.kernels.sample import apply_token_bitmask, sample

__all__ = [
    "KernelError", "backend_for", "silu_and_mul", "paged_attention", "write_kv", "fused_add_rms_norm",
    "rms_norm", "apply_rope", "build_cos_sin_cache", "sample", "apply_token_bitmask",
]
