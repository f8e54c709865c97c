"""EngineCore's memory side: the budget, what a load needs, and the shared KV pool's size.

Pure functions the loader and the pool keeper share. Everything here is decided before
the device is touched (docs/multi-model.md): a :class:`LoadNeeds` is computed from the model's
config alone (weight bytes of a model built on torch's ``meta`` device, so exact after the dtype
conversion), and the pool's size is a pure function of the ledger and the loaded models.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.config import ModelConfig
from engine.errors import EngineError
from engine.core.ledger import LedgerError, MemoryLedger
from engine.models.llama import LlamaModel
from engine.kv.layout import PAGE_ALIGN, PagePoolError, kv_layout
from engine.runner.prompt_logprobs import ROWS_PER_SLICE

DEFAULT_CPU_BUDGET = 4 << 30
GPU_BUDGET_FRACTION = 0.9


@dataclass(frozen=True)
class Workspace:
    """What a model takes on the device beside its weights and KV pages, in bytes.

    ``held``: what stays while it is loaded (its graph pools, the runner's buffers, its streams'
    library workspaces, room for its sampler's buffers): booked per model. ``step``: what its
    largest eager step takes on top while it runs, freed after: the ledger books room for two
    steps of the largest once for all models, not one per model (engine/core/ledger.py says
    why). A figure not yet measured is the estimate whole in ``held``."""

    held: int
    step: int = 0

    def __post_init__(self) -> None:
        for v in (self.held, self.step):
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ValueError(f"a workspace is non-negative ints of bytes, got {self!r}")


@dataclass(frozen=True)
class LoadNeeds:
    """What one load needs, in bytes and pages, before anything is allocated."""

    page_bytes: int  # of the pool (the pool is (re)created with it when no model is loaded)
    tokens_per_page: int
    weight_bytes: int
    workspace: Workspace  # the estimate until a figure measured at this shape replaces it
    min_pages: int  # guaranteed: one longest sequence (or all of an explicit num_kv_pages)
    want_pages: int  # the most it can ever use: max_num_seqs longest sequences (or num_kv_pages)
    kv_dtype: str = "bfloat16"  # the KV cache's dtype name (the layout above is in it)

    @property
    def min_kv_bytes(self) -> int:
        return self.min_pages * self.page_bytes


def make_ledger(budget: int | float | None, device: torch.device) -> MemoryLedger:
    """The ledger of an engine: ``budget`` in bytes, or a fraction of the CUDA device's total.

    None: on CUDA 90 % of what is free now (other processes keep theirs), on CPU 4 GiB.
    """
    if isinstance(budget, float) and budget > 1 and budget.is_integer():
        budget = int(budget)  # bytes that came through JSON as a float
    try:
        if device.type == "cuda":
            if budget is None:
                free, _ = torch.cuda.mem_get_info(device)
                budget = int(free * GPU_BUDGET_FRACTION)
            return MemoryLedger(budget, device=str(device))
        return MemoryLedger(DEFAULT_CPU_BUDGET if budget is None else budget, device="cpu")
    except LedgerError as e:
        raise EngineError(f"memory budget: {e}") from None


def workspace_estimate(cfg: ModelConfig, max_num_batched_tokens: int, max_num_seqs: int, *,
                       intermediate_size: int | None = None) -> int:
    """Activations of the largest step, with room for the float32 logits of every sequence.
    ``intermediate_size``: of the MLP shard one rank holds (tensor parallel); None: the model's."""
    inter = cfg.intermediate_size if intermediate_size is None else intermediate_size
    return (max_num_batched_tokens * (cfg.hidden_size * 8 + inter * 4) * 4
            + max_num_seqs * cfg.vocab_size * 8)


def workspace_margin(cfg: ModelConfig, max_num_seqs: int) -> int:
    """Added to a measured workspace's held part (its sampler may run in a graph step beside
    another model's eager step, whose activations are the step booking): the warm-up's largest
    step samples every row with temperature; steps it does not take hold more after the forward,
    the larger of: up to two float32 vocabulary rows per sequence (logprobs' log-softmax, the
    penalised copy), or a prompt-logprobs slice (its logits in the model's dtype, at most 2
    bytes, and two float32 copies: engine/runner/prompt_logprobs.py)."""
    return max(2 * max_num_seqs * cfg.vocab_size * 4, ROWS_PER_SLICE * cfg.vocab_size * (2 + 4 + 4))


def weight_bytes(cfg: ModelConfig, dtype: torch.dtype, quantization: str | None = None) -> int:
    """Exact bytes of the model's weights in ``dtype`` (FP8 projections and their scales with
    ``quantization="fp8"``), without allocating them."""
    return LlamaModel(cfg, dtype, torch.device("meta"), quantization).nbytes


def load_needs(cfg: ModelConfig, dtype: torch.dtype, *, max_len: int, max_num_seqs: int,
               max_num_batched_tokens: int, pool_page_bytes: int | None, block_size: int,
               explicit_block_size: bool, num_kv_pages: int | None, quantization: str | None = None,
               kv_dtype: torch.dtype | None = None) -> LoadNeeds:
    """Page geometry and bytes of a load.

    ``pool_page_bytes`` None: this load sizes the pool's pages, ``block_size`` tokens of this
    model each (so a lone model keeps exactly the layout it always had). Otherwise the model
    takes as many tokens as fit a page, or exactly ``block_size`` when the caller chose it.
    """
    dname = str(kv_dtype or dtype).removeprefix("torch.")  # the KV cache's (FP8: a byte an element)
    try:
        probe = kv_layout(1 << 40, num_layers=cfg.num_layers, num_kv_heads=cfg.num_kv_heads,
                          head_dim=cfg.head_dim, dtype=dname)
        if pool_page_bytes is None:
            page_bytes = -(-block_size * probe.bytes_per_token // PAGE_ALIGN) * PAGE_ALIGN
            tpp = block_size
        else:
            page_bytes = pool_page_bytes
            tpp = block_size if explicit_block_size else None
        lay = kv_layout(page_bytes, num_layers=cfg.num_layers, num_kv_heads=cfg.num_kv_heads,
                        head_dim=cfg.head_dim, dtype=dname, tokens_per_page=tpp)
    except PagePoolError as e:
        raise EngineError(f"KV pages of this model: {e}") from None
    per_seq = -(-max_len // lay.tokens_per_page)
    if num_kv_pages is not None:
        if isinstance(num_kv_pages, bool) or not isinstance(num_kv_pages, int) or num_kv_pages < per_seq:
            raise EngineError(f"room for {num_kv_pages} KV pages, one {max_len}-token sequence "
                              f"needs {per_seq}")
        min_pages = want = num_kv_pages
    else:
        min_pages, want = per_seq, per_seq * max_num_seqs
    return LoadNeeds(page_bytes, lay.tokens_per_page, weight_bytes(cfg, dtype, quantization),
                     Workspace(workspace_estimate(cfg, max_num_batched_tokens, max_num_seqs)), min_pages, want, dname)


def pool_target(room_bytes: int, page_bytes: int, wants: list[int]) -> int:
    """Pages the shared pool should have: all the budget leaves beside weights and workspace,
    but never more than the loaded models could use together (a pool nobody can fill is memory
    taken from the next load for nothing)."""
    return max(0, min(room_bytes // page_bytes, sum(wants)))
