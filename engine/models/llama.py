"""One decoder for Llama 3.x, Mistral, Qwen2, Qwen3, their mixtures of experts (Qwen3-MoE,
Mixtral) and Llama 4's text model, over the paged KV cache.

Inputs are flat: N new tokens of B sequences, one after the other, with their positions and
the attention metadata of docs/architecture.md. The model knows nothing of pages except
through :func:`paged_attention_step`, which writes the new K/V into the cache and attends over
it. Weights are fused where the matmuls allow: one QKV projection (with Qwen2's bias) and one
gate-up projection; the loader fills their row ranges in place (:meth:`LlamaModel.weight_slots`).

Llama 4 differs per layer (engine.config.ModelConfig): most layers rotate q and k (on
interleaved pairs), normalise them after rope (weightless RMS) and attend only inside their
chunk of ``attention_chunk`` positions; every fourth ("NoPE") layer does not rotate, scales its
queries by a temperature that grows with the position, and attends to everything before it. Its
sparse layers route each token to one expert by a sigmoid score that scales the token on its way
in, beside a dense shared expert; its checkpoint names the MLP ``feed_forward`` and may keep
each projection of every expert in one transposed tensor (:meth:`LlamaModel.fused_tensors`).

``quantization="fp8"``: the four projections of every layer hold e4m3 weights with one float32
scale per output channel (``*_s``), and the norms and the SiLU-mul hand them per-token
quantized activations (engine.kernels.fp8). Embeddings, norms, the LM head and any bias stay in
the model's dtype: the head is a sixteenth of an 8B's weight bytes and its logits are what the
sampler and the accuracy figures read.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from engine import kernels
from engine.config import ModelConfig, mlp_names
from engine.kernels.fp8 import fp8_linear, quantize_rows
from engine.kernels.fp8_format import FP8
from engine.kernels.moe import ExpertStack, Router, fused_experts
from engine.kv.kv_cache import KVCache
from engine.weights.slots import CheckpointMap, FusedExperts

QUANTIZATIONS = ("fp8",)


@dataclass
class AttentionMetadata:
    """Per-step batch layout (tensors on the model's device; the two maxima are host ints)."""

    slot_mapping: torch.Tensor  # [N] int64, -1 = padding
    query_start_loc: torch.Tensor  # [B+1] int32
    seq_lens: torch.Tensor  # [B] int32, context length after this step
    block_tables: torch.Tensor  # [B, max_pages] int32
    max_query_len: int
    max_seq_len: int
    # a cascade plan's (tiles [T, 2 + R], kv_lo [B]) int32 (engine/runner/cascade.py), or None
    cascade: tuple[torch.Tensor, torch.Tensor] | None = None


def paged_attention_step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                         v_cache: torch.Tensor, meta: AttentionMetadata, scale: float, chunk: int) -> torch.Tensor:
    """Write this step's K/V into the cache, then attend q over cached + new tokens (inside
    chunks of ``chunk`` positions when it is set: a cascade plan's shared prefix is then not
    every row's, so such a layer reads each row's own context)."""
    kernels.write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
    return kernels.paged_attention(q, k_cache, v_cache, meta.query_start_loc, meta.seq_lens,
                                   meta.block_tables, scale, meta.max_query_len, meta.max_seq_len,
                                   None if chunk else meta.cascade, chunk=chunk)


def _empty(*shape: int, dtype: torch.dtype, device: torch.device) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, dtype=dtype, device=device), requires_grad=False)


class Experts(nn.Module):
    """A mixture-of-experts MLP (Qwen3-MoE, Mixtral, Llama 4): a router picks each token's top-k
    experts (engine.kernels.moe.Router: softmax weights on the outputs, or Llama 4's sigmoid
    scores on the inputs), each expert is a SiLU-gated MLP, and their outputs are summed.

    The experts' weights are stacked ([E, 2I, H] gate-up, [E, H, I] down) and filled from the
    checkpoint's one-tensor-per-expert layout by row ranges of a flat view, or from Llama 4's
    one tensor a projection by transposing copies (:meth:`fused_tensors`). The computation is
    engine/kernels/moe.py: pairs grouped into one-expert tiles at fixed shapes, two grouped GEMMs
    (Triton on CUDA). No shape depends on the routing, so its steps are captured in CUDA graphs
    like a dense model's (tests/gpu/test_moe_gpu.py; docs/engine.md, "Mixture of experts").
    """

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, device: torch.device, fp8: bool = False) -> None:
        super().__init__()
        e, h, inter = cfg.num_experts, cfg.hidden_size, cfg.expert_intermediate_size
        self.num_experts, self.inter = e, inter
        self.router = Router(cfg.experts_per_token, cfg.norm_topk_prob, cfg.router)
        wdt = FP8 if fp8 else dtype
        self.router_w = _empty(e, h, dtype=dtype, device=device)  # the router stays in the model's dtype
        self.gate_up_w = _empty(e, 2 * inter, h, dtype=wdt, device=device)
        self.down_w = _empty(e, h, inter, dtype=wdt, device=device)
        # FP8: a float32 scale per expert and output channel, filled with the codes at load
        self.gate_up_s = _empty(e, 2 * inter, dtype=torch.float32, device=device) if fp8 else None
        self.down_s = _empty(e, h, dtype=torch.float32, device=device) if fp8 else None
        self._row_views: tuple[torch.Tensor, torch.Tensor] | None = None

    def rows(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The gate-up and down stacks as the checkpoint's rows ([E·2I, H], [E·H, I]): the same two
        view objects every call, so that the loader finds an FP8 stack's scales by the view's
        identity (:meth:`row_scales`); made again if a stack was replaced (new storage), so a
        view never writes where the model no longer reads."""
        v = self._row_views
        if v is None or v[0].data_ptr() != self.gate_up_w.data_ptr() or v[1].data_ptr() != self.down_w.data_ptr():
            e, h = self.num_experts, self.down_w.shape[1]
            v = self._row_views = (self.gate_up_w.data.view(e * 2 * self.inter, h),
                                   self.down_w.data.view(e * h, self.inter))
        return v

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return fused_experts(x, ExpertStack(self.gate_up_w, self.gate_up_s), ExpertStack(self.down_w, self.down_s),
                             nn.functional.linear(x, self.router_w), self.router)

    def row_scales(self) -> dict[int, torch.Tensor]:
        """An FP8 stack's scales as rows of the checkpoint's layout, by ``id`` of its row view
        (empty without FP8): see :meth:`LlamaModel.row_scales`."""
        if self.gate_up_s is None:
            return {}
        gu, down = self.rows()
        return {id(gu): self.gate_up_s.data.view(-1), id(down): self.down_s.data.view(-1)}

    def weight_slots(self, prefix: str, cfg: ModelConfig) -> dict[str, tuple[torch.Tensor, int, int]]:
        """The checkpoint's names of this layer's router and experts → row ranges of the stacks."""
        h, inter = cfg.hidden_size, self.inter
        gu, down = self.rows()
        names = mlp_names(cfg.family)
        block, (g, u, d) = prefix + names.experts, names.projections
        slots = {block + names.router: (self.router_w, 0, self.num_experts)}
        for j in range(self.num_experts):
            x = f"{block}experts.{j}."
            slots[x + g + ".weight"] = (gu, j * 2 * inter, inter)
            slots[x + u + ".weight"] = (gu, j * 2 * inter + inter, inter)
            slots[x + d + ".weight"] = (down, j * h, h)
        return slots

    def fused_tensors(self, prefix: str, cfg: ModelConfig) -> dict[str, FusedExperts]:
        """Llama 4's one-tensor forms of the experts (engine.weights.slots): ``experts.gate_up_proj``
        [E, H, 2I] (gate then up along the last axis) and ``experts.down_proj`` [E, I, H]."""
        if cfg.family != "llama4":
            return {}
        names = mlp_names(cfg.family)
        block, (g, u, d) = prefix + names.experts, names.projections
        x = [f"{block}experts.{j}." for j in range(self.num_experts)]
        return {block + "experts.gate_up_proj": FusedExperts(self.gate_up_w, self.gate_up_s, tuple(
                    n for p in x for n in (p + g + ".weight", p + u + ".weight"))),
                block + "experts.down_proj": FusedExperts(self.down_w, self.down_s,
                                                          tuple(p + d + ".weight" for p in x))}


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, device: torch.device,
                 quantization: str | None, index: int) -> None:
        super().__init__()
        h, q, kv = cfg.hidden_size, cfg.q_size, cfg.kv_size
        sparse = index in cfg.sparse_layers
        # a sparse layer's dense MLP, where it has one, is its shared expert (Llama 4)
        inter = cfg.shared_expert_intermediate_size if sparse else cfg.intermediate_size
        self.cfg = cfg
        self.dtype = dtype
        self.fp8 = quantization == "fp8"
        wdt = FP8 if self.fp8 else dtype

        def scales(rows: int) -> nn.Parameter | None:
            return _empty(rows, dtype=torch.float32, device=device) if self.fp8 else None

        self.input_norm = _empty(h, dtype=dtype, device=device)
        self.qkv_w = _empty(q + 2 * kv, h, dtype=wdt, device=device)
        self.qkv_s = scales(q + 2 * kv)
        self.qkv_b = _empty(q + 2 * kv, dtype=dtype, device=device) if cfg.qkv_bias else None
        self.q_norm = _empty(cfg.head_dim, dtype=dtype, device=device) if cfg.qk_norm else None
        self.k_norm = _empty(cfg.head_dim, dtype=dtype, device=device) if cfg.qk_norm else None
        self.o_w = _empty(h, q, dtype=wdt, device=device)
        self.o_s = scales(h)
        self.o_b = _empty(h, dtype=dtype, device=device) if cfg.o_bias else None
        self.post_norm = _empty(h, dtype=dtype, device=device)
        self.rope = index not in cfg.nope_layers
        self.chunk = cfg.attention_chunk if index in cfg.chunked_layers else 0
        # Llama 4's weightless q/k norm after rope: an RMS norm with unit weights (not a checkpoint tensor)
        self.register_buffer("qk_l2", torch.ones(cfg.head_dim, dtype=dtype, device=device)
                             if cfg.qk_l2_norm and self.rope else None, persistent=False)
        self.experts: Experts | None = None
        if sparse:  # the routed experts (and, with a shared expert, the dense MLP beside them)
            self.experts = Experts(cfg, dtype, device, self.fp8)
        if sparse and not inter:
            self.gate_up_w = self.gate_up_s = self.gate_up_b = self.down_w = self.down_s = self.down_b = None
        else:
            self.gate_up_w = _empty(2 * inter, h, dtype=wdt, device=device)
            self.gate_up_s = scales(2 * inter)
            self.gate_up_b = _empty(2 * inter, dtype=dtype, device=device) if cfg.mlp_bias else None
            self.down_w = _empty(h, inter, dtype=wdt, device=device)
            self.down_s = scales(h)
            self.down_b = _empty(h, dtype=dtype, device=device) if cfg.mlp_bias else None
        self.scale = cfg.head_dim ** -0.5

    def _linear(self, x, w: torch.Tensor, s: torch.Tensor | None, b: torch.Tensor | None) -> torch.Tensor:
        if s is None:
            return nn.functional.linear(x, w, b)
        return fp8_linear(x, w, s, b, out_dtype=self.dtype)

    def attention(self, x, positions: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  meta: AttentionMetadata, cos_sin: torch.Tensor, q_temperature: torch.Tensor | None) -> torch.Tensor:
        """``x``: the normed hidden rows (Fp8Rows in an FP8 layer). ``q_temperature`` [N] float32:
        Llama 4's query scale by position, for the layers that do not rotate."""
        cfg = self.cfg
        n = x.shape[0]
        qkv = self._linear(x, self.qkv_w, self.qkv_s, self.qkv_b)
        q, k, v = qkv.split([cfg.q_size, cfg.kv_size, cfg.kv_size], dim=-1)
        q = q.reshape(n, cfg.num_heads, cfg.head_dim)
        k = k.reshape(n, cfg.num_kv_heads, cfg.head_dim)
        v = v.reshape(n, cfg.num_kv_heads, cfg.head_dim)
        if self.q_norm is not None:
            # Qwen3 normalises each head's vector before rotating it.
            q = kernels.rms_norm(q.reshape(-1, cfg.head_dim), self.q_norm, cfg.rms_norm_eps).view_as(q)
            k = kernels.rms_norm(k.reshape(-1, cfg.head_dim), self.k_norm, cfg.rms_norm_eps).view_as(k)
        # Otherwise q, k and v stay views of qkv (row stride q + 2 kv): rope rotates q and k in
        # place there, the KV write and attention read them through their strides.
        if self.rope:
            q, k = kernels.apply_rope(q, k, positions, cos_sin, interleaved=cfg.interleaved_rope)
            if self.qk_l2 is not None:
                q = kernels.rms_norm(q.reshape(-1, cfg.head_dim), self.qk_l2, cfg.rms_norm_eps).view_as(q)
                k = kernels.rms_norm(k.reshape(-1, cfg.head_dim), self.qk_l2, cfg.rms_norm_eps).view_as(k)
        elif q_temperature is not None:
            q.mul_(q_temperature[:, None, None])  # in float32, rounded once, as the reference does
        out = paged_attention_step(q, k, v, k_cache, v_cache, meta, self.scale, self.chunk).reshape(n, cfg.q_size)
        return self._linear(quantize_rows(out) if self.fp8 else out, self.o_w, self.o_s, self.o_b)

    def mlp(self, x) -> torch.Tensor:
        """``x``: the normed hidden rows (Fp8Rows in an FP8 dense layer; the experts take them in
        the model's dtype, and so does a shared expert beside them, quantized here)."""
        routed = None if self.experts is None else self.experts(x)
        if self.gate_up_w is None:
            return routed
        dense_in = quantize_rows(x) if self.fp8 and routed is not None else x
        gu = self._linear(dense_in, self.gate_up_w, self.gate_up_s, self.gate_up_b)
        out = self._linear(kernels.silu_and_mul(gu, quant=self.fp8), self.down_w, self.down_s, self.down_b)
        return out if routed is None else out.add_(routed)


class LlamaModel(nn.Module):
    """The decoder stack and LM head; parameters are allocated empty and filled by the loader.
    ``quantization``: None (weights in ``dtype``) or ``"fp8"`` (see the module docstring)."""

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, device: torch.device | str,
                 quantization: str | None = None) -> None:
        super().__init__()
        if quantization is not None and quantization not in QUANTIZATIONS:
            raise ValueError(f"quantization must be one of {QUANTIZATIONS} or None, got {quantization!r}")
        device = torch.device(device)
        self.cfg = cfg
        self.dtype = dtype
        self.device = device
        self.quantization = quantization
        self.embed = _empty(cfg.vocab_size, cfg.hidden_size, dtype=dtype, device=device)
        self.layers = nn.ModuleList(DecoderLayer(cfg, dtype, device, quantization, i) for i in range(cfg.num_layers))
        self.norm = _empty(cfg.hidden_size, dtype=dtype, device=device)
        self.lm_head = self.embed if cfg.tie_word_embeddings else _empty(cfg.vocab_size, cfg.hidden_size, dtype=dtype, device=device)
        self.cos_sin: torch.Tensor | None = None

    def build_rope_cache(self, max_position: int) -> None:
        """cos/sin rows for positions < max_position (float32: rope is precision-sensitive)."""
        self.cos_sin = kernels.build_cos_sin_cache(self.cfg.head_dim, max_position, self.cfg.rope_theta,
                                                   self.cfg.rope_scaling, self.device, torch.float32)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv: KVCache,
                meta: AttentionMetadata) -> torch.Tensor:
        """Hidden states [N, hidden] after the final norm, for every new token."""
        if self.cos_sin is None:
            raise RuntimeError("build_rope_cache() must run before forward()")
        eps = self.cfg.rms_norm_eps
        fp8 = self.quantization == "fp8"
        residual = nn.functional.embedding(input_ids, self.embed)
        h = kernels.rms_norm(residual, self.layers[0].input_norm, eps, quant=fp8)
        q_temperature = None
        if self.cfg.attn_temperature is not None and self.cfg.nope_layers:
            floor_scale, attn_scale = self.cfg.attn_temperature
            q_temperature = torch.log1p(torch.floor((positions.float() + 1.0) / floor_scale)) * attn_scale + 1.0
        mlp_out = None
        for i, layer in enumerate(self.layers):
            if mlp_out is not None:
                h, residual = kernels.fused_add_rms_norm(mlp_out, residual, layer.input_norm, eps, quant=fp8)
            attn_out = layer.attention(h, positions, kv.k(i), kv.v(i), meta, self.cos_sin, q_temperature)
            # experts take their inputs in the model's dtype (their e4m3 weights are widened)
            h, residual = kernels.fused_add_rms_norm(attn_out, residual, layer.post_norm, eps,
                                                     quant=fp8 and layer.experts is None)
            mlp_out = layer.mlp(h)
        h, _ = kernels.fused_add_rms_norm(mlp_out, residual, self.norm, eps)
        return h

    def compute_logits(self, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """[B, vocab] float32 logits of the given hidden rows (written into ``out`` when given:
        the widening copy is then the write, as ``float()`` would have been)."""
        logits = nn.functional.linear(hidden, self.lm_head)
        return logits.float() if out is None else out.copy_(logits)

    def weight_slots(self) -> dict[str, tuple[torch.Tensor, int, int]]:
        """Checkpoint tensor name (HF naming) → (destination, first row, row count).

        Fused weights appear once per part: q/k/v go to row ranges of ``qkv_w``, gate/up to
        halves of ``gate_up_w``. A tied LM head has no slot of its own. Experts appear one
        tensor an expert (see :meth:`fused_tensors` for Llama 4's other form).
        """
        cfg = self.cfg
        top = cfg.checkpoint_prefix
        q, kv = cfg.q_size, cfg.kv_size
        slots: dict[str, tuple[torch.Tensor, int, int]] = {
            top + "model.embed_tokens.weight": (self.embed, 0, cfg.vocab_size),
            top + "model.norm.weight": (self.norm, 0, cfg.hidden_size)}
        if not cfg.tie_word_embeddings:
            slots[top + "lm_head.weight"] = (self.lm_head, 0, cfg.vocab_size)
        names = mlp_names(cfg.family)
        for i, layer in enumerate(self.layers):
            p = f"{top}model.layers.{i}."
            a = p + "self_attn."
            slots[p + "input_layernorm.weight"] = (layer.input_norm, 0, cfg.hidden_size)
            slots[p + "post_attention_layernorm.weight"] = (layer.post_norm, 0, cfg.hidden_size)
            for part, start, rows in (("q", 0, q), ("k", q, kv), ("v", q + kv, kv)):
                slots[a + f"{part}_proj.weight"] = (layer.qkv_w, start, rows)
                if layer.qkv_b is not None:
                    slots[a + f"{part}_proj.bias"] = (layer.qkv_b, start, rows)
            slots[a + "o_proj.weight"] = (layer.o_w, 0, cfg.hidden_size)
            if layer.o_b is not None:
                slots[a + "o_proj.bias"] = (layer.o_b, 0, cfg.hidden_size)
            if layer.q_norm is not None:
                slots[a + "q_norm.weight"] = (layer.q_norm, 0, cfg.head_dim)
                slots[a + "k_norm.weight"] = (layer.k_norm, 0, cfg.head_dim)
            if layer.experts is not None:
                slots.update(layer.experts.weight_slots(p, cfg))
            if layer.gate_up_w is None:
                continue
            m = p + (names.shared if layer.experts is not None else names.dense)  # a sparse layer's: its shared expert
            inter = layer.gate_up_w.shape[0] // 2
            slots[m + "gate_proj.weight"] = (layer.gate_up_w, 0, inter)
            slots[m + "up_proj.weight"] = (layer.gate_up_w, inter, inter)
            if layer.gate_up_b is not None:
                slots[m + "gate_proj.bias"] = (layer.gate_up_b, 0, inter)
                slots[m + "up_proj.bias"] = (layer.gate_up_b, inter, inter)
            slots[m + "down_proj.weight"] = (layer.down_w, 0, cfg.hidden_size)
            if layer.down_b is not None:
                slots[m + "down_proj.bias"] = (layer.down_b, 0, cfg.hidden_size)
        return slots

    def fused_tensors(self) -> dict[str, FusedExperts]:
        """Checkpoint tensors that hold one projection of every expert at once (Llama 4's
        ``experts.gate_up_proj`` / ``down_proj``; engine.weights.slots), by name; each stands for
        the per-expert names of :meth:`weight_slots` it covers."""
        out: dict[str, FusedExperts] = {}
        for i, layer in enumerate(self.layers):
            if layer.experts is not None:
                out.update(layer.experts.fused_tensors(f"{self.cfg.checkpoint_prefix}model.layers.{i}.", self.cfg))
        return out

    def checkpoint_map(self) -> CheckpointMap:
        """Everything the loader needs of the checkpoint's names (engine.weights.slots)."""
        return CheckpointMap(self.weight_slots(), self.fused_tensors(), self.cfg.skipped_prefixes,
                             self.cfg.checkpoint_prefix)

    def row_scales(self) -> dict[int, torch.Tensor]:
        """Each FP8 weight's per-output-channel scales, by ``id`` of the weight parameter (empty
        for an unquantized model): the loader quantizes a slot's rows into both."""
        out: dict[int, torch.Tensor] = {}
        for layer in self.layers:
            for w, s in ((layer.qkv_w, layer.qkv_s), (layer.o_w, layer.o_s), (layer.gate_up_w, layer.gate_up_s),
                         (layer.down_w, layer.down_s)):
                if s is not None and w is not None:
                    out[id(w)] = s
            if layer.experts is not None:
                out.update(layer.experts.row_scales())
        return out

    @property
    def nbytes(self) -> int:
        seen: set[int] = set()
        total = 0
        for p in self.parameters():
            if id(p) not in seen:
                seen.add(id(p))
                total += p.numel() * p.element_size()
        return total
