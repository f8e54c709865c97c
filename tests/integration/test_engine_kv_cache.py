"""KV storage: page-major layout with whole-page strides, views over a foreign buffer."""

from __future__ import annotations

import pytest
import torch

from engine import kernels
from engine.errors import EngineError
from engine.kv.kv_cache import KVCache, KVSpec


def spec(**kw) -> KVSpec:
    base = dict(num_layers=3, block_size=4, num_kv_heads=2, head_dim=8, dtype=torch.float32)
    base.update(kw)
    return KVSpec(**base)


def test_views_have_whole_page_stride_and_own_disjoint_memory():
    s = spec()
    kv = KVCache.allocate(s, 5, "cpu")
    assert kv.k(0).shape == (5, 4, 2, 8)
    assert kv.k(1).stride(0) == s.elems_per_page  # the page stride is the whole multi-layer page
    assert s.page_bytes == 3 * 2 * 4 * 2 * 8 * 4 and s.bytes_per_token == s.page_bytes // 4
    assert kv.nbytes == 5 * s.page_bytes
    # Writing one slot of one layer's V touches exactly that slot's bytes of the buffer.
    k = torch.randn(1, 2, 8)
    v = torch.randn(1, 2, 8)
    kernels.write_kv(k, v, kv.k(2), kv.v(2), torch.tensor([3 * 4 + 1]))
    page = kv.buffer.view(5, 3, 2, 4, 2, 8)
    assert torch.equal(page[3, 2, 0, 1], k[0]) and torch.equal(page[3, 2, 1, 1], v[0])
    assert int((kv.buffer != 0).sum()) == 2 * 2 * 8


def test_padding_slot_writes_nothing():
    kv = KVCache.allocate(spec(), 2, "cpu")
    kernels.write_kv(torch.ones(2, 2, 8), torch.ones(2, 2, 8), kv.k(0), kv.v(0), torch.tensor([-1, -1]))
    assert not kv.buffer.any()


def test_from_buffer_is_a_view_of_memory_owned_elsewhere():
    s = spec(dtype=torch.float16)
    pool = torch.zeros(4 * s.elems_per_page, dtype=torch.float16)
    kv = KVCache.from_buffer(s, pool)
    kv.k(0)[2, 3].fill_(1.5)
    assert pool.view(4, -1)[2].eq(1.5).sum() == 2 * 8
    with pytest.raises(EngineError):
        KVCache.from_buffer(s, torch.zeros(s.elems_per_page + 1, dtype=torch.float16))
    with pytest.raises(EngineError):
        KVCache.from_buffer(s, torch.zeros(s.elems_per_page, dtype=torch.float32))
    with pytest.raises(EngineError):
        KVCache.allocate(s, 0, "cpu")


def test_from_views_takes_padded_pages():
    # A shared pool whose page is larger than the model's data: views with a padded page stride.
    s = spec()
    page_elems = s.elems_per_page + 40
    pool = torch.zeros(3 * page_elems)
    layer_elems = 2 * s.block_size * s.num_kv_heads * s.head_dim
    views = []
    for layer in range(s.num_layers):
        def view(kind: int) -> torch.Tensor:
            off = layer * layer_elems + kind * (layer_elems // 2)
            return pool.as_strided((3, s.block_size, s.num_kv_heads, s.head_dim),
                                   (page_elems, s.num_kv_heads * s.head_dim, s.head_dim, 1), off)
        views.append((view(0), view(1)))
    kv = KVCache.from_views(s, views)
    assert kv.num_pages == 3 and kv.nbytes == 3 * s.page_bytes and kv.k(1).stride(0) == page_elems
    kernels.write_kv(torch.ones(1, 2, 8), torch.full((1, 2, 8), 2.0), kv.k(1), kv.v(1), torch.tensor([2 * 4 + 3]))
    assert pool.view(3, page_elems)[2].eq(1).sum() == 16 and pool.view(3, page_elems)[2].eq(2).sum() == 16
    with pytest.raises(EngineError):
        KVCache.from_views(s, views[:2])
    with pytest.raises(EngineError):
        KVCache.from_views(spec(head_dim=4), views)
