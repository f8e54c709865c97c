"""engine/kernels/moe.py: the grouping of (token, expert) pairs into one-expert tiles at shapes the
routing cannot change, and the Triton grouped GEMM under TRITON_INTERPRET=1 against its torch
reference (float32: the interpreter's bf16 dot is not exact), then the whole fused experts
against a token-by-token definition."""

from __future__ import annotations

import math
import os

import pytest
import torch

if torch.cuda.is_available():  # pragma: no cover - the compiled kernel runs in tests/gpu/test_moe_gpu.py
    pytest.skip("interpreter tests run on CPU-only machines", allow_module_level=True)
pytest.importorskip("triton")
_INTERPRET = os.environ.get("TRITON_INTERPRET")
os.environ["TRITON_INTERPRET"] = "1"  # read when the @triton.jit module is imported

from engine.kernels import _dispatch  # noqa: E402
from engine.kernels._dispatch import KernelError  # noqa: E402
from engine.kernels.moe import (  # noqa: E402
    BLOCK_M, TALL_BLOCK_M, ExpertStack, Router, align, fused_experts, grouped_gemm, grouped_gemm_ref, route, tile_rows)
from engine.kernels.moe_triton import grouped_gemm_triton  # noqa: E402

if _INTERPRET is None:
    del os.environ["TRITON_INTERPRET"]
else:
    os.environ["TRITON_INTERPRET"] = _INTERPRET


@pytest.fixture(autouse=True, scope="module")
def _triton_interpreted():
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TRITON_INTERPRET", "1")
        yield


def _routing(n: int, k: int, e: int, seed: int = 0, skew: bool = False):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn((n, e), generator=g)
    if skew:  # most tokens to expert 0: one long run, others empty
        logits[:, 0] += 10.0
    return route(logits, Router(k, renormalize=True))


@pytest.mark.parametrize("n, k, e, skew", [(1, 1, 4, False), (5, 2, 8, False), (33, 2, 8, True), (40, 4, 16, False)])
def test_every_pair_lands_once_in_a_tile_of_its_expert(n, k, e, skew):
    weights, experts = _routing(n, k, e, skew=skew)
    r = align(experts, weights, e)
    pairs = n * k
    slots = -(-(pairs + e * (BLOCK_M - 1)) // BLOCK_M) * BLOCK_M
    assert r.pair_ids.shape == (slots,) and r.tile_expert.shape == (slots // BLOCK_M,)  # the routing decides no shape
    ids = r.pair_ids.long()
    real = ids[ids < pairs]
    assert sorted(real.tolist()) == list(range(pairs))  # each pair once; the rest is padding
    flat = experts.reshape(-1)
    for t, ex in enumerate(r.tile_expert.tolist()):
        tile = ids[t * BLOCK_M:(t + 1) * BLOCK_M]
        tile = tile[tile < pairs]
        if ex < 0:
            assert tile.numel() == 0
        else:
            assert tile.numel() > 0 and (flat[tile] == ex).all()
    used = r.tile_expert >= 0
    assert not used[used.long().argmin():].any() or used.all()  # used tiles first, then -1s
    assert torch.allclose(r.weights.view(n, k).sum(-1), torch.ones(n))


@pytest.mark.parametrize("n, k, e, block_m, skew", [(1, 8, 128, BLOCK_M, False), (5, 2, 8, BLOCK_M, False),
                                                    (33, 2, 8, BLOCK_M, True), (128, 8, 128, BLOCK_M, False),
                                                    (40, 4, 16, BLOCK_M, True), (9, 1, 16, TALL_BLOCK_M, False),
                                                    (100, 2, 8, TALL_BLOCK_M, True), (3, 2, 5, BLOCK_M, False),
                                                    (512, 8, 128, BLOCK_M, False), (300, 8, 128, BLOCK_M, True)])
def test_the_one_program_alignment_lays_the_pairs_out_as_the_torch_one_does(n, k, e, block_m, skew, monkeypatch):
    """Decode-sized steps on the Triton path align in one program (interpreted here): the same
    pair_ids and tile_expert, slot for slot, as the torch formulation, skewed routing (one long
    run, empty experts) and an expert count that is not a power of two included."""
    from engine.kernels.moe import MAX_ALIGN_PAIRS

    weights, experts = _routing(n, k, e, seed=n + e, skew=skew)
    assert n * k <= MAX_ALIGN_PAIRS
    monkeypatch.setattr(_dispatch, "_forced", "torch")
    want = align(experts, weights, e, block_m)
    monkeypatch.setattr(_dispatch, "_forced", "triton")
    got = align(experts, weights, e, block_m)
    assert torch.equal(got.pair_ids, want.pair_ids) and torch.equal(got.tile_expert, want.tile_expert)
    assert torch.equal(got.weights, want.weights)


def test_a_step_past_the_one_programs_pairs_aligns_the_torch_way(monkeypatch):
    from engine.kernels import moe_align_triton
    from engine.kernels.moe import MAX_ALIGN_PAIRS

    calls = []
    real = moe_align_triton.align_triton
    monkeypatch.setattr(moe_align_triton, "align_triton", lambda *a: calls.append(a) or real(*a))
    monkeypatch.setattr(_dispatch, "_forced", "triton")
    weights, experts = _routing(MAX_ALIGN_PAIRS // 2 + 1, 2, 8)
    r = align(experts, weights, 8)
    assert not calls and sorted(r.pair_ids[r.pair_ids < experts.numel()].tolist()) == list(range(experts.numel()))
    weights, experts = _routing(MAX_ALIGN_PAIRS // 2, 2, 8)
    align(experts, weights, 8)
    assert len(calls) == 1


@pytest.mark.parametrize("per_pair, weights_at", [(False, "none"), (True, "output"), (False, "input")])
@pytest.mark.parametrize("n, k, e, h, out, block_m", [(5, 2, 8, 32, 48, BLOCK_M), (33, 2, 4, 64, 16, BLOCK_M),
                                                      (17, 4, 16, 48, 40, BLOCK_M), (150, 2, 4, 32, 48, TALL_BLOCK_M)])
def test_the_triton_grouped_gemm_matches_its_reference(per_pair, weights_at, n, k, e, h, out, block_m):
    weights, experts = _routing(n, k, e, seed=n)
    r = align(experts, weights, e, block_m)
    g = torch.Generator().manual_seed(1)
    a = torch.randn((n * k if per_pair else n, h), generator=g)
    w = torch.randn((e, out, h), generator=g) * 0.1
    want = grouped_gemm_ref(a, ExpertStack(w), r, per_pair, weights_at)
    got = grouped_gemm_triton(a, w, r.pair_ids, r.tile_expert, r.weights, r.top_k, r.block_m, per_pair, weights_at)
    assert not torch.isnan(got).any()
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_fused_experts_is_the_definition_token_by_token(monkeypatch):
    """With the Triton GEMMs (interpreted) and with the torch reference: out[t] = sum over t's k
    experts of weight * down(silu(gate x) * up x)."""
    n, k, e, h, inter = 9, 2, 4, 32, 16
    g = torch.Generator().manual_seed(3)
    x = torch.randn((n, h), generator=g)
    gate_up = torch.randn((e, 2 * inter, h), generator=g) * 0.2
    down = torch.randn((e, h, inter), generator=g) * 0.2
    logits = torch.randn((n, e), generator=g)
    weights, experts = route(logits, Router(k))
    want = torch.zeros(n, h)
    for t in range(n):
        for j in range(k):
            ex = experts[t, j]
            gu = gate_up[ex] @ x[t]
            want[t] += weights[t, j] * (down[ex] @ (torch.nn.functional.silu(gu[:inter]) * gu[inter:]))
    for backend in ("torch", "triton"):
        monkeypatch.setattr(_dispatch, "_forced", backend)
        got = fused_experts(x, ExpertStack(gate_up), ExpertStack(down), logits, Router(k))
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4, msg=backend)


def test_a_sigmoid_router_scales_each_token_into_its_expert(monkeypatch):
    """Llama 4's routing: the top-k logits, each one's sigmoid rounded to the activations' dtype,
    the token scaled by it (and rounded) *before* the expert's MLP; the outputs summed unweighted.
    A weight applied to the output instead gives another answer (the MLP is not linear)."""
    n, e, h, inter = 11, 4, 32, 16
    g = torch.Generator().manual_seed(5)
    x = torch.randn((n, h), generator=g).to(torch.float16)
    gate_up = (torch.randn((e, 2 * inter, h), generator=g) * 0.2).to(torch.float16)
    down = (torch.randn((e, h, inter), generator=g) * 0.2).to(torch.float16)
    logits = torch.randn((n, e), generator=g).to(torch.float16)
    for k in (1, 2):
        weights, experts = route(logits, Router(k, scoring="sigmoid"))
        top, idx = logits.topk(k, dim=-1)
        assert torch.equal(experts, idx)
        assert torch.equal(weights, torch.sigmoid(top.float()).to(torch.float16).float())
        want = torch.zeros(n, h)
        on_output = torch.zeros(n, h)
        for t in range(n):
            for j in range(k):
                ex = experts[t, j]
                xin = (x[t].float() * weights[t, j]).to(torch.float16).float()
                gu = gate_up[ex].float() @ xin
                want[t] += down[ex].float() @ (torch.nn.functional.silu(gu[:inter]) * gu[inter:])
                gu = gate_up[ex].float() @ x[t].float()
                on_output[t] += weights[t, j] * (down[ex].float() @ (torch.nn.functional.silu(gu[:inter]) * gu[inter:]))
        assert (want - on_output).abs().max() > 1e-2  # the test tells the two placements apart
        for backend in ("torch", "triton"):
            monkeypatch.setattr(_dispatch, "_forced", backend)
            got = fused_experts(x, ExpertStack(gate_up), ExpertStack(down), logits, Router(k, scoring="sigmoid"))
            torch.testing.assert_close(got.float(), want, atol=2e-2, rtol=2e-2, msg=f"{backend} k={k}")


def test_tiles_grow_tall_once_the_average_expert_gets_their_height():
    assert tile_rows(1, 128) == tile_rows(64 * 128 - 1, 128) == BLOCK_M  # decode sizes: a few pairs an expert
    assert tile_rows(64 * 128, 128) == tile_rows(16384 * 8, 128) == TALL_BLOCK_M  # prefill sizes


def test_a_prefill_sized_step_runs_tall_tiles_and_gives_the_same_experts_output(monkeypatch):
    """Enough pairs that ``fused_experts`` aligns them in 64-row tiles: the Triton GEMMs
    (interpreted) and the reference agree with 16-row tiles of the same routing."""
    n, k, e, h, inter = 160, 2, 4, 32, 16
    assert tile_rows(n * k, e) == TALL_BLOCK_M
    from engine.kernels import moe

    heights = []
    real_align = moe.align
    monkeypatch.setattr(moe, "align", lambda *a: heights.append(a[3]) or real_align(*a))
    g = torch.Generator().manual_seed(9)
    x = torch.randn((n, h), generator=g)
    gate_up = torch.randn((e, 2 * inter, h), generator=g) * 0.2
    down = torch.randn((e, h, inter), generator=g) * 0.2
    logits = torch.randn((n, e), generator=g)
    weights, chosen = route(logits, Router(k, renormalize=True))
    short = align(chosen, weights, e, BLOCK_M)
    gu = grouped_gemm_ref(x, ExpertStack(gate_up), short, False, "none")
    from engine.kernels.activation import silu_and_mul

    want = grouped_gemm_ref(silu_and_mul(gu), ExpertStack(down), short, True, "output").view(n, k, -1).sum(1)
    for backend in ("torch", "triton"):
        monkeypatch.setattr(_dispatch, "_forced", backend)
        got = fused_experts(x, ExpertStack(gate_up), ExpertStack(down), logits, Router(k, renormalize=True))
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4, msg=backend)
    assert heights == [TALL_BLOCK_M, TALL_BLOCK_M]  # the step ran 64-row tiles, both backends


def test_a_grouped_gemm_is_told_where_the_weights_go_by_name():
    weights, experts = _routing(4, 1, 4)
    r = align(experts, weights, 4)
    with pytest.raises(KernelError, match="weights must be one of"):
        grouped_gemm(torch.randn(4, 16), ExpertStack(torch.randn(4, 8, 16)), r, False, True)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_a_sigmoid_weight_scales_the_input_and_the_product_is_rounded_before_the_dot(backend, monkeypatch):
    """Llama 4 rounds the scaled token to the activations' dtype before its expert: with x = 1 +
    2^-10 in float16, weight 0.75 and W = 3·I, that rounding gives 2.25390625 where scaling the
    float32 sums instead would give 2.251953125."""
    n, e, h = 8, 2, 16
    x = torch.full((n, h), 1 + 2 ** -10, dtype=torch.float16)
    r = align(torch.zeros(n, 1, dtype=torch.int64), torch.full((n, 1), 0.75), e, BLOCK_M)
    w = (3 * torch.eye(h, dtype=torch.float16))[None].repeat(e, 1, 1)
    monkeypatch.setattr(_dispatch, "_forced", backend)
    got = grouped_gemm(x, ExpertStack(w), r, False, "input")
    assert torch.equal(got, torch.full((n, h), 2.25390625, dtype=torch.float16))


def test_a_router_of_an_unknown_scoring_is_refused():
    with pytest.raises(KernelError, match="softmax or sigmoid"):
        Router(1, scoring="relu")
    with pytest.raises(KernelError, match="never renormalised"):
        Router(1, renormalize=True, scoring="sigmoid")


def _fp8_stack(w: torch.Tensor) -> ExpertStack:
    """``w`` [E, N, K] as e4m3 codes with a scale per expert and output channel (what the loader
    makes of a bf16 checkpoint's experts)."""
    from engine.kernels.fp8 import quantize_weight

    e, n, k = w.shape
    q, s = quantize_weight(w.reshape(e * n, k))
    return ExpertStack(q.view(e, n, k), s.view(e, n))


@pytest.mark.parametrize("per_pair, weights_at", [(False, "none"), (True, "output")])
@pytest.mark.parametrize("h, out", [(48, 40), (160, 300)])
def test_fp8_experts_are_their_dequantized_weights(per_pair, weights_at, h, out):
    """An e4m3 stack with channel scales: the Triton GEMM (interpreted) and the reference both
    give what the dequantized float32 weights give — each column times its own expert's scale,
    so a scale read from the wrong expert or channel shows (160 x 300: three column tiles and
    three K blocks, so a column tile reading the first tile's scales shows too)."""
    n, k, e = 17, 2, 8
    weights, experts = _routing(n, k, e, seed=5)
    r = align(experts, weights, e)
    g = torch.Generator().manual_seed(2)
    a = torch.randn((n * k if per_pair else n, h), generator=g)
    # channels and experts of very different magnitudes: their scales differ by 100x
    w = torch.randn((e, out, h), generator=g) * torch.logspace(-2, 0, e * out).view(e, out, 1)
    stack = _fp8_stack(w)
    dequant = stack.w.float() * stack.scale[..., None]
    want = grouped_gemm_ref(a, ExpertStack(dequant), r, per_pair, weights_at)
    torch.testing.assert_close(grouped_gemm_ref(a, stack, r, per_pair, weights_at), want, atol=1e-4, rtol=1e-4)
    got = grouped_gemm_triton(a, stack.w, r.pair_ids, r.tile_expert, r.weights, r.top_k, r.block_m, per_pair,
                              weights_at, stack.scale)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_an_fp8_stack_without_its_scales_is_refused():
    from engine.kernels._dispatch import KernelError

    weights, experts = _routing(3, 1, 2)
    r = align(experts, weights, 2)
    stack = _fp8_stack(torch.randn(2, 16, 16))
    with pytest.raises(KernelError, match="scales"):
        grouped_gemm(torch.randn(3, 16), ExpertStack(stack.w), r, False, "none")
    with pytest.raises(KernelError, match="scale"):
        grouped_gemm(torch.randn(3, 16), ExpertStack(stack.w, stack.scale[:, :8]), r, False, "none")


def test_a_tuned_table_gives_each_token_count_its_shape_and_none_gives_the_default(tmp_path, monkeypatch):
    """engine/kernels/moe_configs.py: a step of n tokens takes the entry of the smallest tuned
    count at or above n (the largest beyond the last); a shape or GPU without a table runs the
    default; a tuned shape computes what the default does."""
    import json

    from engine.kernels import moe_configs as mc

    monkeypatch.setattr(mc, "TABLES", tmp_path)
    mc._table.cache_clear(), mc.launch_shape.cache_clear()
    assert mc.launch_shape(8, 40, 48, "float32", "cpu", 17) == mc.default_shape(40, 48) == mc.GemmShape(64, 64, 4, 3)
    small, big = {"block_n": 16, "block_k": 16, "num_warps": 2, "num_stages": 2}, {"block_n": 32, "block_k": 32,
                                                                                    "num_warps": 4, "num_stages": 3}
    (tmp_path / mc.table_name(8, 40, 48, "float32", "cpu")).write_text(json.dumps({"entries": {"8": small, "64": big}}))
    mc._table.cache_clear(), mc.launch_shape.cache_clear()
    got = [mc.launch_shape(8, 40, 48, "float32", "cpu", n) for n in (1, 8, 9, 64, 1000)]
    assert got == [mc.GemmShape(**small)] * 2 + [mc.GemmShape(**big)] * 3
    assert mc.launch_shape(8, 40, 48, "float32", "NVIDIA H200", 8) == mc.default_shape(40, 48)  # another GPU's
    # the kernel (interpreted) under the table's shape: the reference's output
    weights, experts = _routing(17, 2, 8, seed=9)
    r = align(experts, weights, 8)
    g = torch.Generator().manual_seed(4)
    a = torch.randn((17, 48), generator=g)
    w = torch.randn((8, 40, 48), generator=g) * 0.1
    want = grouped_gemm_ref(a, ExpertStack(w), r, False, "none")
    got = grouped_gemm_triton(a, w, r.pair_ids, r.tile_expert, r.weights, r.top_k, r.block_m, False, "none")
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    mc._table.cache_clear(), mc.launch_shape.cache_clear()


@pytest.mark.parametrize("n, e, k, renormalize", [(1, 128, 8, True), (37, 128, 8, False), (5, 8, 2, True),
                                                  (20, 5, 2, False), (3, 16, 1, False), (70, 16, 6, True)])
def test_the_one_kernel_routing_picks_and_weighs_as_the_torch_one(n, e, k, renormalize, monkeypatch):
    """Softmax routing on the Triton path (interpreted): the same experts in the same order and
    the same weights as softmax → top-k → renormalise, across programs (n past a program's
    rows), an expert count that is not a power of two and a k that is not one."""
    logits = torch.randn((n, e), generator=torch.Generator().manual_seed(n * e + k))
    router = Router(k, renormalize=renormalize)
    monkeypatch.setattr(_dispatch, "_forced", "torch")
    want_w, want_e = route(logits, router)
    monkeypatch.setattr(_dispatch, "_forced", "triton")
    got_w, got_e = route(logits, router)
    assert got_e.dtype == torch.int64 and got_w.dtype == torch.float32
    assert torch.equal(got_e, want_e)
    torch.testing.assert_close(got_w, want_w, atol=1e-7, rtol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("k", [1, 2])
def test_the_one_kernel_sigmoid_routing_rounds_its_weights_to_the_logits_dtype(dtype, k, monkeypatch):
    """Llama 4's router on the Triton path: the k largest logits, each one's sigmoid rounded to
    the logits' dtype — the torch formulation's weights exactly. Half-precision logits tie often
    (16 experts, 64 tokens), so a tie may go to another expert of the same logit: the chosen
    logits are the top k all the same."""
    logits = (torch.randn((64, 16), generator=torch.Generator().manual_seed(k)) * 3).to(dtype)
    router = Router(k, scoring="sigmoid")
    monkeypatch.setattr(_dispatch, "_forced", "torch")
    want_w, want_e = route(logits, router)
    monkeypatch.setattr(_dispatch, "_forced", "triton")
    got_w, got_e = route(logits, router)
    assert torch.equal(logits.gather(1, got_e), logits.gather(1, want_e))
    if dtype == torch.float16:
        assert torch.equal(got_w, want_w)
    else:  # the interpreter's float32 -> bfloat16 cast truncates (the GPU's rounds: tests/gpu/test_moe_gpu.py)
        ulp = 2.0 ** (torch.floor(torch.log2(want_w)) - 7)
        assert ((got_w - want_w).abs() <= ulp).all()
    assert got_w.unique().numel() > 8  # the weights are the logits' own, not one value


@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("weights_at, block_m", [("none", BLOCK_M), ("input", BLOCK_M), ("none", TALL_BLOCK_M)])
def test_a_gated_gate_up_gemm_stores_the_activation_of_its_two_products(fp8, weights_at, block_m):
    """The gate-up GEMM as served (``gated``): each program multiplies by the gate's and the up
    projection's columns of its tile and stores SiLU(gate) · up — the unfused product's rows
    (rounded to the inputs' dtype) through the activation. 2I = 2·40 over column tiles of 32
    (a partial one) and, FP8, the up half's scales read 40 channels past the gate's."""
    n, k, e, h, inter = 37, 2, 4, 48, 40
    weights, experts = _routing(n, k, e, seed=11)
    r = align(experts, weights, e, block_m)
    g = torch.Generator().manual_seed(6)
    a = torch.randn((n, h), generator=g)
    w = torch.randn((e, 2 * inter, h), generator=g) * torch.logspace(-1, 0, e * 2 * inter).view(e, 2 * inter, 1)
    stack = _fp8_stack(w) if fp8 else ExpertStack(w)
    from engine.kernels.activation import silu_and_mul_ref
    from engine.kernels.moe_configs import GemmShape

    want = silu_and_mul_ref(grouped_gemm_ref(a, stack, r, False, weights_at))
    torch.testing.assert_close(grouped_gemm_ref(a, stack, r, False, weights_at, gated=True), want)
    got = grouped_gemm_triton(a, stack.w, r.pair_ids, r.tile_expert, r.weights, r.top_k, r.block_m, False,
                              weights_at, stack.scale, gated=True, shape=GemmShape(32, 16, 4, 2))
    assert got.shape == (n * k, inter)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_a_gated_stack_refuses_weights_on_its_output():
    weights, experts = _routing(4, 1, 4)
    r = align(experts, weights, 4)
    with pytest.raises(KernelError, match="gated"):
        grouped_gemm(torch.randn(4, 16), ExpertStack(torch.randn(4, 8, 16)), r, False, "output", gated=True)


@pytest.mark.parametrize("scoring", ["softmax", "sigmoid"])
def test_a_nan_logit_is_routed_first_as_torch_ranks_it_never_past_the_experts(scoring, monkeypatch):
    """A step's warm-up may route garbage: a NaN logit goes first (torch.topk's order), every
    index stays below E (an index past E is a write out of bounds in the alignment)."""
    logits = torch.randn((6, 16), generator=torch.Generator().manual_seed(2))
    logits[1, 5] = float("nan")
    logits[3] = float("nan")
    router = Router(4, renormalize=scoring == "softmax", scoring=scoring)
    monkeypatch.setattr(_dispatch, "_forced", "triton")
    got_w, got_e = route(logits, router)
    assert got_e.min() >= 0 and got_e.max() < 16
    assert got_e[1, 0] == 5
    if scoring == "sigmoid":  # the NaN's weight is NaN, as torch's is, not the sigmoid of a stand-in
        assert torch.isnan(got_w[1, 0]) and torch.isfinite(got_w[1, 1:]).all()
    monkeypatch.setattr(_dispatch, "_forced", "torch")
    _, want_e = route(logits, router)
    clean = torch.tensor([0, 2, 4, 5])  # torch's picks in a softmax over a NaN are anyone's
    assert torch.equal(got_e[clean], want_e[clean])
    if scoring == "sigmoid":  # top-k of the logits themselves: torch puts the NaN first too
        assert want_e[1, 0] == 5


@pytest.mark.parametrize("gated", [False, True])
def test_bf16_inputs_over_fp8_experts_dot_in_float16_and_lose_nothing(gated):
    """bfloat16 activations over e4m3 experts run float16 dots (e4m3 widens to float16 in one
    instruction, to bfloat16 only through float32): every bfloat16 value of float16's range and
    every e4m3 code are exact there, so the products are the bfloat16 ones — the reference's
    output within the output's rounding — and an activation past float16's range is clamped,
    not turned to inf."""
    n, k, e, h, out = 9, 2, 4, 64, 48
    weights, experts = _routing(n, k, e, seed=13)
    r = align(experts, weights, e)
    g = torch.Generator().manual_seed(7)
    a = torch.randn((n, h), generator=g).to(torch.bfloat16)
    a[0, 0] = 1e6  # past float16's 65504
    stack = _fp8_stack(torch.randn((e, 2 * out if gated else out, h), generator=g) * 0.1)
    want = grouped_gemm_ref(a, stack, r, False, "none", gated=gated)
    got = grouped_gemm_triton(a, stack.w, r.pair_ids, r.tile_expert, r.weights, r.top_k, r.block_m, False,
                              "none", stack.scale, gated=gated)
    assert torch.isfinite(got).all()
    rows = torch.arange(n * k) // k != 0  # token 0's rows differ by the clamp
    # within a few bfloat16 roundings: the interpreter's float16 dot sums in float16 (compiled, the
    # sums are float32: tests/gpu/test_moe_gpu.py holds FP8 experts to the bf16 model)
    torch.testing.assert_close(got[rows].float(), want[rows].float(), atol=3e-2, rtol=2e-2)


def test_the_one_kernel_routing_breaks_ties_low_and_never_picks_an_expert_twice(monkeypatch):
    """Equal logits go to the lower expert, in order; a row with fewer finite logits than k still
    gets k different experts (a chosen expert is out of the running whatever its logit)."""
    logits = torch.tensor([[0.0, 1.0, 0.0, 2.0, 0.0, 0.0, 0.0, 2.0],
                           [1.0, -float("inf"), -float("inf"), -float("inf"), -float("inf"), 0.5,
                            -float("inf"), -float("inf")]])
    monkeypatch.setattr(_dispatch, "_forced", "triton")
    w, ex = route(logits, Router(3, renormalize=True))
    assert ex[0].tolist() == [3, 7, 1]
    assert ex[1, :2].tolist() == [0, 5] and len(set(ex[1].tolist())) == 3
    top2 = 1 + math.exp(-0.5)  # the two finite experts' softmax, renormalised; the third's weight is 0
    torch.testing.assert_close(w[1], torch.tensor([1 / top2, math.exp(-0.5) / top2, 0.0]))


def test_the_gated_product_is_rounded_before_the_activation_exactly():
    """SiLU(gate) · up reads each product rounded to the inputs' dtype, as the unfused product's
    stored rows were: float16 inputs whose dots are exact integers, so the kernel's output is
    the reference's bit for bit (an unrounded product gives other bits)."""
    n, k, e, h, inter = 8, 2, 4, 16, 16
    weights, experts = _routing(n, k, e, seed=21)
    r = align(experts, weights, e)
    g = torch.Generator().manual_seed(8)
    a = torch.randint(-4, 5, (n, h), generator=g).to(torch.float16)
    gate = torch.randint(-256, 257, (e, inter, h), generator=g).float()
    up = torch.randint(-256, 257, (e, inter, h), generator=g).float() / 4096
    w = torch.cat([gate, up], dim=1).to(torch.float16)
    want = grouped_gemm_ref(a, ExpertStack(w), r, False, "none", gated=True)
    got = grouped_gemm_triton(a, w, r.pair_ids, r.tile_expert, r.weights, r.top_k, r.block_m, False, "none",
                              gated=True)
    assert torch.equal(got, want)

