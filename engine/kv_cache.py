"""KV-cache storage of one model: per-layer K/V views addressed by page id and slot.

One buffer laid out page-major, ``[num_pages, num_layers, 2, block_size, num_kv_heads, head_dim]``,
which is exactly the page layout of the shared PagePool of DESIGN §5: a page holds the K and V
of ``block_size`` tokens for every layer. Each layer's K (and V) is a strided view
``[num_pages, block_size, num_kv_heads, head_dim]`` whose page stride is the whole page, so the
model and the kernels already run on the pool's layout; the pool will only hand a different
buffer (and global page ids) to :meth:`KVCache.from_buffer`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.errors import EngineError


@dataclass(frozen=True)
class KVSpec:
    num_layers: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype

    @property
    def elems_per_page(self) -> int:
        return self.num_layers * 2 * self.block_size * self.num_kv_heads * self.head_dim

    @property
    def page_bytes(self) -> int:
        return self.elems_per_page * torch.empty((), dtype=self.dtype).element_size()

    @property
    def bytes_per_token(self) -> int:
        return self.page_bytes // self.block_size


class KVCache:
    """K/V views of every layer over one page-major buffer of ``num_pages`` pages."""

    def __init__(self, spec: KVSpec, buffer: torch.Tensor) -> None:
        if buffer.dtype != spec.dtype or buffer.dim() != 1 or buffer.numel() % spec.elems_per_page:
            raise EngineError("KV buffer must be 1-D, of the spec's dtype and a whole number of pages")
        self.spec = spec
        self.num_pages = buffer.numel() // spec.elems_per_page
        self.buffer = buffer
        shaped = buffer.view(self.num_pages, spec.num_layers, 2, spec.block_size, spec.num_kv_heads, spec.head_dim)
        self._k = [shaped[:, i, 0] for i in range(spec.num_layers)]
        self._v = [shaped[:, i, 1] for i in range(spec.num_layers)]

    @classmethod
    def allocate(cls, spec: KVSpec, num_pages: int, device: torch.device | str) -> "KVCache":
        if num_pages < 1:
            raise EngineError(f"a KV cache needs at least one page, got {num_pages}")
        # Zeroed: padding rows of a CUDA-graph batch read page 0, and NaN garbage there would
        # poison softmax sums even when masked out in some kernels.
        return cls(spec, torch.zeros(num_pages * spec.elems_per_page, dtype=spec.dtype, device=device))

    @classmethod
    def from_buffer(cls, spec: KVSpec, buffer: torch.Tensor) -> "KVCache":
        """Views over memory owned elsewhere (the shared PagePool)."""
        return cls(spec, buffer)

    def k(self, layer: int) -> torch.Tensor:
        return self._k[layer]

    def v(self, layer: int) -> torch.Tensor:
        return self._v[layer]

    @property
    def block_size(self) -> int:
        return self.spec.block_size

    @property
    def nbytes(self) -> int:
        return self.buffer.numel() * self.buffer.element_size()
