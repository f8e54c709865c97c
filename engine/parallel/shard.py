"""How a model splits over TP ranks, and the sharded model a rank runs.

A rank's shard is an ordinary :class:`~engine.models.llama.LlamaModel` built on a *local*
config: ``num_heads / tp`` query heads, ``num_kv_heads / tp`` KV heads, ``intermediate / tp``
MLP columns and ``ceil(vocab / tp)`` vocabulary rows. Its fused QKV and gate-up weights are then
exactly the column-parallel slices (heads of q, k and v; the gate and up halves of this rank's
columns, keeping the ``[gate; up]`` layout ``silu_and_mul`` expects), and its o_proj / down_proj
are the row-parallel slices (``[hidden, local_in]``). :class:`TPModel` runs the shard's layers
and adds what sharding needs around them: a vocab-parallel embedding (masked lookup, one
all-reduce), one all-reduce after o_proj and one after down_proj per layer (row-parallel biases
are loaded on rank 0 only, so the sum adds them once), and a vocab-parallel LM head whose logits
are all-gathered, so every rank holds the full ``[S, vocab]`` float32 logits and the sampler runs
unchanged (greedy, seeded sampling and logprobs are those of the unsharded model).

The KV cache of a rank holds only its KV heads: :attr:`ShardPlan.local` is the config its
``KVSpec`` is built from.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from torch import nn

from engine import kernels
from engine.config import ModelConfig
from engine.kv.kv_cache import KVCache
from engine.models.llama import AttentionMetadata, LlamaModel
from engine.parallel.group import TPConfigError, TPGroup


@dataclass(frozen=True)
class ShardPlan:
    """The split of ``full`` for ``rank`` of ``world_size``; ``local`` is the shard's own config."""

    full: ModelConfig
    local: ModelConfig
    rank: int
    world_size: int

    @property
    def vocab_per_rank(self) -> int:
        return self.local.vocab_size

    @property
    def vocab_start(self) -> int:
        return self.rank * self.vocab_per_rank

    @property
    def vocab_end(self) -> int:
        """End of this rank's real vocabulary rows (the last rank's shard may be padded past it)."""
        return min(self.vocab_start + self.vocab_per_rank, self.full.vocab_size)


def plan_shards(cfg: ModelConfig, rank: int, world_size: int) -> ShardPlan:
    """Split ``cfg`` over ``world_size`` ranks; :class:`TPConfigError` when it does not divide."""
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise TPConfigError(f"world_size must be an integer >= 1, got {world_size!r}")
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < world_size:
        raise TPConfigError(f"rank must be in [0, {world_size}), got {rank!r}")
    if cfg.fp8_checkpoint:
        raise TPConfigError(f"a pre-quantized FP8 checkpoint ({cfg.fp8_checkpoint} scales) does not load "
                            "tensor-parallel: FP8 models run on one GPU")
    for what, n in (("num_attention_heads", cfg.num_heads), ("num_key_value_heads", cfg.num_kv_heads),
                    ("intermediate_size", cfg.intermediate_size)):
        if n % world_size:
            raise TPConfigError(f"{what}={n} does not split over {world_size} ranks "
                                "(KV-head replication is not implemented)")
    local = dataclasses.replace(cfg, num_heads=cfg.num_heads // world_size,
                                num_kv_heads=cfg.num_kv_heads // world_size,
                                intermediate_size=cfg.intermediate_size // world_size,
                                vocab_size=-(-cfg.vocab_size // world_size))
    return ShardPlan(cfg, local, rank, world_size)


class TPModel(nn.Module):
    """One rank's shard, with the model interface the runner uses (``forward``, ``compute_logits``).

    Parameters start zeroed (padding vocabulary rows and the row-parallel biases of ranks > 0
    stay zero) and are filled by :func:`engine.parallel.loader.load_shard`.
    """

    def __init__(self, plan: ShardPlan, group: TPGroup, dtype: torch.dtype, device: torch.device | str) -> None:
        super().__init__()
        if plan.world_size != group.world_size or plan.rank != group.rank:
            raise TPConfigError(f"plan for rank {plan.rank}/{plan.world_size} used on rank {group.rank}/{group.world_size}")
        self.plan = plan
        self.group = group
        self.inner = LlamaModel(plan.local, dtype, device)
        with torch.no_grad():
            for p in self.inner.parameters():
                p.zero_()
        self.cfg = plan.full
        self.dtype = dtype
        self.device = self.inner.device

    def build_rope_cache(self, max_position: int) -> None:
        self.inner.build_rope_cache(max_position)

    def weight_slots(self) -> dict[str, tuple[torch.Tensor, int, int]]:
        """The shard's slots in local coordinates (see :meth:`LlamaModel.weight_slots`)."""
        return self.inner.weight_slots()

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Vocab-parallel lookup: rows outside this rank's range read as zero, then one all-reduce."""
        w = self.inner.embed
        if self.plan.world_size == 1:
            return nn.functional.embedding(input_ids, w)
        start = self.plan.vocab_start
        local = input_ids - start
        inside = (local >= 0) & (local < self.plan.vocab_per_rank)
        out = nn.functional.embedding(local.clamp(0, self.plan.vocab_per_rank - 1), w)
        out = out * inside.unsqueeze(-1).to(out.dtype)
        return self.group.all_reduce(out)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv: KVCache,
                meta: AttentionMetadata) -> torch.Tensor:
        """Hidden states [N, hidden] after the final norm (replicated on every rank)."""
        m = self.inner
        if m.cos_sin is None:
            raise RuntimeError("build_rope_cache() must run before forward()")
        eps = self.cfg.rms_norm_eps
        residual = self.embed(input_ids)
        h = kernels.rms_norm(residual, m.layers[0].input_norm, eps)
        mlp_out = None
        for i, layer in enumerate(m.layers):
            if mlp_out is not None:
                h, residual = kernels.fused_add_rms_norm(mlp_out, residual, layer.input_norm, eps)
            # no query temperature: Llama 4, the one family with it, has experts, which TP refuses
            attn_out = self.group.all_reduce(layer.attention(h, positions, kv.k(i), kv.v(i), meta, m.cos_sin, None))
            h, residual = kernels.fused_add_rms_norm(attn_out, residual, layer.post_norm, eps)
            mlp_out = self.group.all_reduce(layer.mlp(h))
        h, _ = kernels.fused_add_rms_norm(mlp_out, residual, m.norm, eps)
        return h

    def compute_logits(self, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """[B, vocab] float32 logits: this rank's vocabulary block, all-gathered, padding cut off
        (written into ``out`` when given)."""
        local = nn.functional.linear(hidden, self.inner.lm_head).float()
        full = self.group.all_gather_cols(local)
        v = self.plan.full.vocab_size
        if out is not None:
            return out.copy_(full[:, :v])
        return full[:, :v].contiguous() if full.shape[1] != v else full

    @property
    def nbytes(self) -> int:
        """Bytes of this rank's weights (what the GPU of this rank holds)."""
        return self.inner.nbytes
