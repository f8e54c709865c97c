"""Mixture-of-experts MLP on the device: route, group the (token, expert) pairs into tiles of one
expert each, two grouped GEMMs (the first, gate-up, storing SiLU(gate) · up: ``gated``), the
routing weights applied in the second (or, for a sigmoid router, to each pair's input in the
first), the k outputs of a token summed.

Every shape is fixed by the step's token count (``N``), the experts (``E``), ``top_k`` and the
tile height (``BLOCK_M``), never by the routing: the pairs are laid out expert by expert, each
expert's run padded to a multiple of ``BLOCK_M`` inside a buffer of ``N * top_k + E * (BLOCK_M -
1)`` slots (the most padding there can be), so a CUDA graph can capture it. Counting uses a
scatter-add, not ``bincount`` (whose output size makes it read the device).

:func:`route` and :func:`align` are plain torch on any device and one Triton kernel each on CUDA
(engine/kernels/moe_route_triton.py, moe_align_triton.py: decode-sized steps); the GEMMs are
Triton (engine/kernels/moe_triton.py) on CUDA and under ``TRITON_INTERPRET=1``, with
:func:`grouped_gemm_ref` as their reference.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.kernels._dispatch import check, use_triton
from engine.kernels.activation import silu_and_mul_ref

BLOCK_M = 16  # pairs per tile at decode sizes: tl.dot's smallest height
TALL_BLOCK_M = 64  # pairs per tile once the average expert gets that many (prefill steps)
# The most pairs the one-program alignment takes (engine/kernels/moe_align_triton.py): it holds
# them all at once. 4,096 covers every decode bucket of Qwen3-30B-A3B (512 rows × top 8): at 1,024
# its buckets past 128 rows aligned the torch way, some 25 kernels a sparse layer; the program is
# faster at every bucket (0.086 against 0.101 ms at 4,096 pairs on an H100: docs/perf.md,
# 2026-12-06), though it did not move the 6.8 ms of host time Qwen's graph steps take. Past it a
# step is a prefill, big enough that those launches are not its cost.
MAX_ALIGN_PAIRS = 4096


def tile_rows(pairs: int, num_experts: int) -> int:
    """The tile height for a step of ``pairs`` (token, expert) pairs. At decode sizes most experts
    get a few pairs and a taller tile would be padding, so 16. Once the average expert gets 64,
    a 64-row tile makes each weight tile it reads serve four times the rows: with 16-row tiles a
    prefill-sized Qwen3-30B-A3B layer ran at 119 TFLOP/s on an H100 (docs/perf.md, moe_bench),
    an eighth of the tensor cores. A graph's bucket fixes ``pairs``, so a replay never changes it."""
    return TALL_BLOCK_M if pairs >= TALL_BLOCK_M * num_experts else BLOCK_M


@dataclass(frozen=True)
class ExpertStack:
    """One projection of every expert: ``w`` [E, N, K] in the activations' dtype, or e4m3 with
    ``scale`` [E, N] float32, each expert's multiplier per output channel (FP8 experts: the
    weights are widened tile by tile in the GEMM, the scale applied once to its sums)."""

    w: torch.Tensor
    scale: torch.Tensor | None = None


@dataclass(frozen=True)
class Router:
    """How a token picks its experts: ``top_k`` of them, scored by

    - ``"softmax"`` (Qwen3-MoE, Mixtral): softmax over every expert, the k best, renormalised
      to sum to 1 when ``renormalize``; the weights scale the experts' outputs;
    - ``"sigmoid"`` (Llama 4): the k largest logits, each one's sigmoid — rounded to the
      activations' dtype, as the reference model rounds it — scaling the token on its way *into*
      the expert (the SiLU-gated MLP is not linear, so this is not the same as scaling its output).
    """

    top_k: int
    renormalize: bool = False
    scoring: str = "softmax"

    def __post_init__(self) -> None:
        check(self.scoring in ("softmax", "sigmoid"), f"router scoring must be softmax or sigmoid, got {self.scoring!r}")
        check(not (self.renormalize and self.scoring == "sigmoid"),
              "a sigmoid router's weights are each token's own scores, never renormalised")


@dataclass(frozen=True)
class Routing:
    """The pairs of a step grouped by expert.

    ``pair_ids`` [P]: slot -> pair index (token * top_k + j), or ``N * top_k`` for a padding slot;
    ``tile_expert`` [P / BLOCK_M]: each tile's expert, -1 past the last used tile; ``weights``
    [N * top_k] float32: each pair's routing weight."""

    pair_ids: torch.Tensor
    tile_expert: torch.Tensor
    weights: torch.Tensor
    top_k: int
    block_m: int


def route(router_logits: torch.Tensor, router: Router) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [N, k] float32, experts [N, k] int64) of each token's chosen experts (:class:`Router`):
    one Triton kernel on CUDA (engine/kernels/moe_route_triton.py), the torch formulation below
    elsewhere."""
    if router_logits.shape[0] > 0 and use_triton(router_logits):
        from engine.kernels.moe_route_triton import route_triton

        return route_triton(router_logits, router.top_k, router.scoring == "softmax", router.renormalize)
    if router.scoring == "sigmoid":
        values, experts = router_logits.topk(router.top_k, dim=-1)
        return torch.sigmoid(values.float()).to(router_logits.dtype).float(), experts
    probs = torch.softmax(router_logits.float(), dim=-1)
    weights, experts = probs.topk(router.top_k, dim=-1)
    if router.renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, experts


def align(experts: torch.Tensor, weights: torch.Tensor, num_experts: int, block_m: int = BLOCK_M) -> Routing:
    """Group the pairs of ``experts`` [N, k] by expert into tiles of ``block_m`` (see the module).
    Decode-sized steps on CUDA take one Triton program (engine/kernels/moe_align_triton.py: the
    same slots, the same arrays), the rest the torch formulation below."""
    check(experts.dim() == 2 and experts.shape == weights.shape, "experts and weights must be [N, top_k]")
    n, k = experts.shape
    if n * k <= MAX_ALIGN_PAIRS and use_triton(experts):
        from engine.kernels.moe_align_triton import align_triton

        pair_ids, tile_expert = align_triton(experts, num_experts, block_m)
        return Routing(pair_ids, tile_expert, weights.reshape(-1).float().contiguous(), k, block_m)
    dev = experts.device
    pairs = n * k
    slots = -(-(pairs + num_experts * (block_m - 1)) // block_m) * block_m
    flat = experts.reshape(-1)
    counts = torch.zeros(num_experts, dtype=torch.int64, device=dev).scatter_add_(
        0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    ends = torch.cumsum(padded, 0)
    starts = ends - padded
    first = torch.cumsum(counts, 0) - counts  # each expert's first pair in expert order
    order = torch.argsort(flat, stable=True)
    by_expert = flat[order]
    dest = starts[by_expert] + torch.arange(pairs, device=dev) - first[by_expert]
    pair_ids = torch.full((slots,), pairs, dtype=torch.int32, device=dev)
    pair_ids.scatter_(0, dest, order.to(torch.int32))
    tile_starts = torch.arange(0, slots, block_m, device=dev)
    tile_expert = torch.searchsorted(ends, tile_starts, right=True)
    tile_expert = torch.where(tile_expert < num_experts, tile_expert, -1).to(torch.int32)
    return Routing(pair_ids, tile_expert, weights.reshape(-1).float().contiguous(), k, block_m)


# Where a grouped GEMM applies each pair's routing weight: nowhere, to its output row, or to its
# input row (scaled and rounded to the inputs' dtype before the product: a sigmoid router's).
WEIGHTS = ("none", "output", "input")


def grouped_gemm_ref(a: torch.Tensor, stack: ExpertStack, r: Routing, per_pair_input: bool,
                     weights: str, gated: bool = False) -> torch.Tensor:
    """out[pair] = a[row] @ w[expert].T, the pair's weight applied where ``weights`` says
    (:data:`WEIGHTS`); ``row`` is the pair's token (``a`` [N, K]) or the pair itself
    (``per_pair_input``, ``a`` [N*k, K]). ``gated``: ``w`` is a gate-up stack [E, 2I, K] and the
    output SiLU(gate) · up [pairs, I], of the product rounded to ``a``'s dtype."""
    if gated:
        return silu_and_mul_ref(grouped_gemm_ref(a, stack, r, per_pair_input, weights))
    w, scale = stack.w, stack.scale
    pairs = r.weights.shape[0]
    out = torch.zeros((pairs, w.shape[1]), dtype=a.dtype, device=a.device)
    ids = r.pair_ids.long()
    for t, e in enumerate(r.tile_expert.tolist()):
        if e < 0:
            continue
        p = ids[t * r.block_m:(t + 1) * r.block_m]
        p = p[p < pairs]
        rows = p if per_pair_input else p // r.top_k
        x = a.index_select(0, rows)
        if weights == "input":
            x = (x.float() * r.weights[p, None]).to(a.dtype)
        y = x.float() @ w[e].float().T
        if scale is not None:
            y = y * scale[e]
        if weights == "output":
            y = y * r.weights[p, None]
        out[p] = y.to(a.dtype)
    return out


def grouped_gemm(a: torch.Tensor, stack: ExpertStack, r: Routing, per_pair_input: bool,
                 weights: str, gated: bool = False) -> torch.Tensor:
    w, scale = stack.w, stack.scale
    check(a.dim() == 2 and w.dim() == 3 and a.shape[1] == w.shape[2],
          f"a [rows, K] and w [E, N, K] must agree, got {tuple(a.shape)} and {tuple(w.shape)}")
    check(scale is None or (scale.shape == w.shape[:2] and scale.dtype == torch.float32),
          f"an FP8 stack's scale must be [E, N] float32, got {None if scale is None else tuple(scale.shape)}")
    check((scale is None) == (w.dtype != torch.float8_e4m3fn), "e4m3 expert weights need their scales, and only they")
    check(weights in WEIGHTS, f"weights must be one of {WEIGHTS}, got {weights!r}")
    check(not gated or (w.shape[1] % 2 == 0 and weights != "output"),
          "a gated stack has gate and up rows ([E, 2I, K]) and no weights on its output")
    if use_triton(a, w):
        from engine.kernels.moe_triton import grouped_gemm_triton

        return grouped_gemm_triton(a, w, r.pair_ids, r.tile_expert, r.weights, r.top_k, r.block_m,
                                   per_pair_input, weights, scale, gated)
    return grouped_gemm_ref(a, stack, r, per_pair_input, weights, gated)


def fused_experts(x: torch.Tensor, gate_up: ExpertStack, down: ExpertStack, router_logits: torch.Tensor,
                  router: Router) -> torch.Tensor:
    """The experts' output [N, H] for ``x`` [N, H]: ``gate_up`` [E, 2I, H], ``down`` [E, H, I]."""
    n = x.shape[0]
    weights, experts = route(router_logits, router)
    r = align(experts, weights, gate_up.w.shape[0], tile_rows(n * router.top_k, gate_up.w.shape[0]))
    on_input = router.scoring == "sigmoid"
    h = grouped_gemm(x, gate_up, r, per_pair_input=False, weights="input" if on_input else "none",
                     gated=True)  # [N*k, I]
    y = grouped_gemm(h, down, r, per_pair_input=True, weights="none" if on_input else "output")
    if router.top_k == 1:
        return y
    # one kernel: torch sums half-precision rows in float32 and rounds once, so no float32 copy
    # of y nor a cast after (a node each in every sparse layer of a decode graph)
    return y.view(n, router.top_k, -1).sum(dim=1)
