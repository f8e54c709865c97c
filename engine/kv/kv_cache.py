"""KV-cache storage of one model: per-layer K/V views addressed by page id and slot.

One buffer laid out page-major, ``[num_pages, num_layers, 2, block_size, num_kv_heads, head_dim]``,
which is exactly the page layout of the shared :class:`engine.kv.page_pool.PagePool`
(docs/architecture.md, "KV cache"): a page holds the K and V of ``block_size`` tokens for every
layer. Each layer's K (and V) is a strided view
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
    """K/V views of every layer: ``k(layer)``/``v(layer)`` are ``[num_pages, block_size, kv_heads, head_dim]``."""

    def __init__(self, spec: KVSpec, layers: list[tuple[torch.Tensor, torch.Tensor]],
                 buffer: torch.Tensor | None = None) -> None:
        if len(layers) != spec.num_layers:
            raise EngineError(f"KV cache: {len(layers)} layer views for {spec.num_layers} layers")
        shape = (layers[0][0].shape[0], spec.block_size, spec.num_kv_heads, spec.head_dim) if layers else None
        for k, v in layers:
            for t in (k, v):
                if tuple(t.shape) != shape or t.dtype != spec.dtype or t.stride(3) != 1:
                    raise EngineError(f"KV view {tuple(t.shape)} {t.dtype} does not match {shape} {spec.dtype} "
                                      "with a contiguous head_dim")
        self.spec = spec
        self.num_pages = shape[0] if shape else 0
        self.buffer = buffer
        self._k = [k for k, _ in layers]
        self._v = [v for _, v in layers]

    @classmethod
    def from_buffer(cls, spec: KVSpec, buffer: torch.Tensor) -> "KVCache":
        """Views over a page-major 1-D buffer (owned here, or by the shared PagePool)."""
        if buffer.dtype != spec.dtype or buffer.dim() != 1 or buffer.numel() % spec.elems_per_page:
            raise EngineError("KV buffer must be 1-D, of the spec's dtype and a whole number of pages")
        pages = buffer.numel() // spec.elems_per_page
        shaped = buffer.view(pages, spec.num_layers, 2, spec.block_size, spec.num_kv_heads, spec.head_dim)
        return cls(spec, [(shaped[:, i, 0], shaped[:, i, 1]) for i in range(spec.num_layers)], buffer)

    @classmethod
    def from_views(cls, spec: KVSpec, layers: list[tuple[torch.Tensor, torch.Tensor]]) -> "KVCache":
        """Per-layer (K, V) views made elsewhere, e.g. padded pages of the shared PagePool."""
        return cls(spec, list(layers))

    @classmethod
    def allocate(cls, spec: KVSpec, num_pages: int, device: torch.device | str) -> "KVCache":
        if num_pages < 1:
            raise EngineError(f"a KV cache needs at least one page, got {num_pages}")
        # Zeroed: padding rows of a CUDA-graph batch read page 0, and NaN garbage there would
        # poison softmax sums even when masked out in some kernels.
        return cls.from_buffer(spec, torch.zeros(num_pages * spec.elems_per_page, dtype=spec.dtype, device=device))

    def k(self, layer: int) -> torch.Tensor:
        return self._k[layer]

    def v(self, layer: int) -> torch.Tensor:
        return self._v[layer]

    @property
    def block_size(self) -> int:
        return self.spec.block_size

    @property
    def nbytes(self) -> int:
        """Bytes of this model's K/V data (for views into a shared pool: its pages' share)."""
        if self.buffer is not None:
            return self.buffer.numel() * self.buffer.element_size()
        return self.num_pages * self.spec.page_bytes
