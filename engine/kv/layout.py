"""The torch-free vocabulary of the shared KV page pool: its errors, the page-source protocol a
block manager is given, and a model's page geometry. Split from ``engine/kv/page_pool.py`` so the
pool's accounting stays short; these names are imported from here.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Protocol, runtime_checkable

from engine.sched.block_manager import PageError
from engine.errors import EngineError

_ITEMSIZE = MappingProxyType({"float16": 2, "bfloat16": 2, "float32": 4, "float64": 8,
                              "float8_e4m3fn": 1, "float8_e5m2": 1, "int8": 1, "uint8": 1})
PAGE_ALIGN = 16  # every dtype view of a page must start on an element boundary


class PagePoolError(EngineError):
    """Bad pool or model parameters, an unknown model, or a page freed by a non-owner."""


class PoolExhausted(PagePoolError):
    """A guaranteed minimum, a fence or a resize that the free pages cannot honour."""


class PoolBusyError(PagePoolError):
    """The operation needs pages or views that are still in use (unregister, resize)."""


class PageOwnershipError(PagePoolError, PageError):
    """A page freed by a model that does not hold it (double free, or another model's page)."""


@runtime_checkable
class ModelPageSource(Protocol):
    """One model's view of the pool: what its ``BlockManager`` is given as its page source.

    A superset of ``engine.sched.block_manager.PageSource``: ``num_free`` is how many pages this
    model may take right now (its held-back minimum included, its cap and other models'
    minimums respected); ``num_total`` the most it could hold now (``num_used + num_free``,
    less the pages it holds back behind a step, which both count);
    ``allocate()`` returns a global page id or raises ``OutOfPages``; ``try_allocate()``
    returns ``None`` instead; ``free(page_id)`` gives a page back (one the model does not hold
    raises ``PageOwnershipError``, a ``PageError``): at once, or, while a step of the model is on
    the device and other models share the pool, once its steps there are done (the engine says
    when: ``step_launched`` / ``step_done``; engine/kv/page_pool.py says why); ``can_allocate(n)``
    is ``num_free >= n``; ``block_size`` is the model's tokens per page
    (``slot = page_id * block_size + offset``).
    """

    @property
    def block_size(self) -> int: ...

    @property
    def num_free(self) -> int: ...

    @property
    def num_total(self) -> int: ...

    @property
    def num_used(self) -> int: ...

    def allocate(self) -> int: ...

    def try_allocate(self) -> int | None: ...

    def free(self, page_id: int) -> None: ...

    def can_allocate(self, n: int) -> bool: ...

    def step_launched(self) -> None: ...

    def step_done(self) -> None: ...

    @property
    def num_held(self) -> int: ...


@dataclass(frozen=True)
class KVLayout:
    """A registered model's page geometry."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str  # torch dtype name, e.g. "bfloat16"
    itemsize: int
    bytes_per_token: int
    tokens_per_page: int


def _dtype_name(dtype: Any) -> str:
    name = dtype if isinstance(dtype, str) else str(dtype).removeprefix("torch.")
    if name not in _ITEMSIZE:
        raise PagePoolError(f"unsupported KV dtype {dtype!r} (one of {sorted(_ITEMSIZE)})")
    return name


def _positive_int(name: str, value: Any, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise PagePoolError(f"{name} must be an int >= {minimum}, got {value!r}")
    return value


def kv_layout(page_bytes: int, *, num_layers: int, num_kv_heads: int, head_dim: int, dtype: Any,
              tokens_per_page: int | None = None) -> KVLayout:
    """A model's page geometry in pages of ``page_bytes``, before anything is registered (a load
    plan needs its tokens per page to size its guaranteed minimum)."""
    name = _dtype_name(dtype)
    per_token = (_positive_int("num_layers", num_layers) * 2 * _positive_int("num_kv_heads", num_kv_heads)
                 * _positive_int("head_dim", head_dim) * _ITEMSIZE[name])
    fit = page_bytes // per_token
    if fit < 1:
        raise PagePoolError(f"one token needs {per_token} B, more than a {page_bytes} B page")
    tpp = fit if tokens_per_page is None else _positive_int("tokens_per_page", tokens_per_page)
    if tpp > fit:
        raise PagePoolError(f"{tpp} tokens do not fit a page (at most {fit})")
    return KVLayout(num_layers, num_kv_heads, head_dim, name, _ITEMSIZE[name], per_token, tpp)
