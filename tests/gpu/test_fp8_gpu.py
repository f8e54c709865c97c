"""FP8 on the GPU: the Triton quantizers and the few-rows GEMM against their torch references,
cuBLASLt's scaled GEMM against the reference, and an FP8 model loaded by the engine (weights
quantized as they stream in, CUDA graphs on) against the same model in bf16.

Codes may differ from the reference by one e4m3 step where Triton's float32 division and torch's
round a value lying on a rounding boundary differently; the tests bound how many do.
Skipped without CUDA or without FP8 tensor cores (compute capability < 8.9).
"""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9),
    reason="needs CUDA with FP8 tensor cores")]

from engine.kernels import activation, fp8, norm  # noqa: E402
from engine.kernels import fp8_format as fmt  # noqa: E402
from engine.kernels.fp8_triton import fp8_linear_small_m  # noqa: E402
from engine.load_spec import LoadSpec  # noqa: E402
from engine.options import EngineOptions

DEV = "cuda"


def assert_codes_match(got: fmt.Fp8Rows, want: fmt.Fp8Rows) -> None:
    assert got.q.dtype == fmt.FP8 and got.scale.shape == want.scale.shape
    torch.testing.assert_close(got.scale, want.scale, rtol=1e-6, atol=0)
    g, w = got.q.float(), want.q.float()
    off = (g != w)
    assert off.float().mean().item() <= 1e-3, off.float().mean().item()
    # where they differ, by one step of e4m3 (3 mantissa bits: 1/8 of the binade, relative)
    assert ((g - w).abs()[off] <= w.abs()[off] / 8 + 2 ** -9).all()


@pytest.mark.parametrize("shape", [(1, 4096), (7, 576), (33, 14336), (256, 4096)])
def test_quantize_rows_matches_reference(shape):
    x = torch.randn(*shape, device=DEV, dtype=torch.bfloat16) * 3
    x[0, :17] = 0
    if shape[0] > 2:
        x[2] = 0  # an all-zero row: codes 0, the floor scale
    assert_codes_match(fp8.quantize_rows(x), fp8.quantize_rows_ref(x))


@pytest.mark.parametrize("residual", [False, True])
@pytest.mark.parametrize("h", [576, 4096])
def test_norm_emits_the_rows_the_reference_quantizes(residual, h):
    x = torch.randn(19, h, device=DEV, dtype=torch.bfloat16)
    r = torch.randn(19, h, device=DEV, dtype=torch.bfloat16)
    w = torch.rand(h, device=DEV, dtype=torch.bfloat16) + 0.5
    if residual:
        got, res = norm.fused_add_rms_norm(x, r, w, 1e-5, quant=True)
        want_plain, want_res = norm.fused_add_rms_norm_ref(x, r, w, 1e-5)
        torch.testing.assert_close(res, want_res, rtol=0, atol=0)
    else:
        got = norm.rms_norm(x, w, 1e-5, quant=True)
        want_plain = norm.rms_norm_ref(x, w, 1e-5)
    assert_codes_match(got, fp8.quantize_rows_ref(want_plain))


@pytest.mark.parametrize("i", [1536, 14336])
def test_silu_mul_emits_the_rows_the_reference_quantizes(i):
    x = torch.randn(23, 2 * i, device=DEV, dtype=torch.bfloat16) * 2
    assert_codes_match(activation.silu_and_mul(x, quant=True),
                       fp8.quantize_rows_ref(activation.silu_and_mul_ref(x)))


def _operands(m, n, k, bias):
    a = fp8.quantize_rows(torch.randn(m, k, device=DEV, dtype=torch.bfloat16))
    w_q, w_s = fp8.quantize_weight(torch.randn(n, k, device=DEV, dtype=torch.bfloat16) * 0.02)
    b = torch.randn(n, device=DEV, dtype=torch.bfloat16) if bias else None
    return a, w_q, w_s, b


def rel_err(out, ref):
    assert torch.isfinite(out).all()
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


@pytest.mark.parametrize("m", [1, 2, 5, 16, 17, 64, 65, 128, 129, 300, 1024])
@pytest.mark.parametrize("n,k", [(6144, 4096), (4096, 14336), (1600, 576)])
def test_fp8_linear_matches_the_dequantized_matmul(m, n, k):
    a, w_q, w_s, b = _operands(m, n, k, bias=m == 5)
    got = fp8.fp8_linear(a, w_q, w_s, b, out_dtype=torch.bfloat16)
    want = fp8.fp8_linear_ref(a, w_q, w_s, b, torch.float32)
    assert got.shape == (m, n) and got.dtype == torch.bfloat16
    assert rel_err(got, want) < 5e-3


@pytest.mark.parametrize("split_k", [1, 3, 8])
def test_small_m_kernel_splits_agree(split_k):
    a, w_q, w_s, _ = _operands(4, 4096, 14336, bias=False)
    cfg = {"block_n": 64, "block_k": 256, "split_k": split_k, "num_warps": 4, "num_stages": 4}
    got = fp8_linear_small_m(a, w_q, w_s, None, torch.float32, cfg)
    want = fp8.fp8_linear_ref(a, w_q, w_s, None, torch.float32)
    assert rel_err(got, want) < 1e-4


@pytest.fixture(scope="module")
def small_llama(tmp_path_factory):
    from modelgen.make import make_model

    return make_model(tmp_path_factory.mktemp("fp8") / "m", "llama", "small", seed=0)


def test_an_fp8_model_loads_quantized_and_tracks_bf16(small_llama):
    from engine.core.engine_core import EngineCore
    from engine.options import EngineOptions
    from engine.core.memory_plan import weight_bytes
    from engine.sampling import SamplingParams
    from ops.bench.fp8_accuracy import prefill_logits

    prompts = [list(range(3, 60)), [9, 8, 7, 6, 5], list(range(100, 400, 7))]
    logits, cores = {}, {}
    for q in (None, "fp8"):
        core = EngineCore(EngineOptions(dtype="bfloat16", max_num_batched_tokens=512, seed=0), device="cuda")
        info = core.load_model(LoadSpec("m", small_llama, max_model_len=512, max_num_seqs=8, quantization=q))
        layer = core.slots.get("m").model.layers[1]
        assert layer.qkv_w.dtype == (fmt.FP8 if q else torch.bfloat16)
        assert core.slots.get("m").model.nbytes == weight_bytes(core.slots.get("m").model.cfg, torch.bfloat16, q)
        logits[q] = prefill_logits(core, "m", prompts)
        cores[q] = (core, info)
    assert cores["fp8"][0].slots.get("m").weight_bytes < 0.75 * cores[None][0].slots.get("m").weight_bytes
    cos = torch.nn.functional.cosine_similarity(logits["fp8"].float(), logits[None].float(), dim=-1)
    assert cos.min().item() >= 0.99, cos.min().item()
    # the loaded weights are exactly what quantize_weight makes of the checkpoint's rows
    from safetensors import safe_open

    model = cores["fp8"][0].slots.get("m").model
    with safe_open(str(next(small_llama.glob("*.safetensors"))), "pt", device="cuda") as f:
        name = "model.layers.1.mlp.up_proj.weight"
        if name in f.keys():
            w = f.get_tensor(name)
            q_w, s_w = fp8.quantize_weight(w)
            inter = w.shape[0]
            torch.testing.assert_close(model.layers[1].gate_up_s[inter:], s_w, rtol=1e-6, atol=0)
            assert (model.layers[1].gate_up_w[inter:].float() != q_w.float()).float().mean() <= 1e-3
    # and it serves: CUDA graphs (decode, mixed) replay the FP8 path
    core = cores["fp8"][0]
    for i, p in enumerate(prompts):
        core.add_request(f"g{i}", "m", p, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))
    n = 0
    while core.has_unfinished_requests():
        n += sum(len(o.new_token_ids) for o in core.step())
    assert n == 16 * len(prompts) and core.slots.get("m").runner.graph_steps > 0


@pytest.mark.parametrize("layout", ["channel", "tensor", "block128"])
def test_pre_quantized_checkpoints_load_on_the_gpu(layout, small_llama, tmp_path):
    """The hub layouts through the CUDA weight stream (e4m3 bytes copied as they are, scales
    checked on the host, block scales requantized per row on the device)."""
    from safetensors.torch import load_file

    from engine.core.engine_core import EngineCore
    from engine.weights.fp8_writer import quantize_folder
    from ops.bench.fp8_accuracy import prefill_logits

    ck = quantize_folder(small_llama, tmp_path / layout, layout)
    prompts = [list(range(3, 60)), list(range(100, 400, 7))]
    core = EngineCore(EngineOptions(dtype="bfloat16", max_num_batched_tokens=512, seed=0), device="cuda")
    core.load_model(LoadSpec("bf16", small_llama, max_model_len=512, max_num_seqs=8))
    core.load_model(LoadSpec("ck", ck, max_model_len=512, max_num_seqs=8))
    assert core.slots.get("ck").model.quantization == "fp8"
    cos = torch.nn.functional.cosine_similarity(prefill_logits(core, "ck", prompts),
                                                prefill_logits(core, "bf16", prompts), dim=-1)
    assert cos.min().item() >= 0.99, cos.min().item()
    if layout != "block128":
        (f,) = ck.glob("*.safetensors")
        q = load_file(str(f))["model.layers.1.mlp.down_proj.weight"]
        got = core.slots.get("ck").model.layers[1].down_w
        assert torch.equal(got.view(torch.uint8).cpu(), q.view(torch.uint8))


def test_a_model_calibrated_on_the_gpu_serves_close_to_bf16(small_llama, tmp_path):
    """engine/weights/calibrate.py on CUDA (float32 prefill for the grams, GPTQ on the device),
    then its checkpoint served in bf16 with graphs beside the unquantized model."""
    from engine.core.engine_core import EngineCore
    from engine.sampling import SamplingParams
    from engine.weights.calibrate import calibrate
    from ops.bench.fp8_accuracy import prefill_logits

    ids = torch.randint(3, 400, (1024,), generator=torch.Generator().manual_seed(0)).tolist()
    calibrate(small_llama, tmp_path / "cal", ids, window=256, device="cuda")
    prompts = [list(range(3, 60)), list(range(100, 400, 7))]
    core = EngineCore(EngineOptions(dtype="bfloat16", max_num_batched_tokens=512, seed=0), device="cuda")
    core.load_model(LoadSpec("bf16", small_llama, max_model_len=512, max_num_seqs=8))
    core.load_model(LoadSpec("cal", tmp_path / "cal", max_model_len=512, max_num_seqs=8))
    assert core.slots.get("cal").model.quantization == "fp8"
    cos = torch.nn.functional.cosine_similarity(prefill_logits(core, "cal", prompts),
                                                prefill_logits(core, "bf16", prompts), dim=-1)
    assert cos.min().item() >= 0.99, cos.min().item()
    core.add_request("g", "cal", prompts[0], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    n = 0
    while core.has_unfinished_requests():
        n += sum(len(o.new_token_ids) for o in core.step())
    assert n == 8


@pytest.mark.parametrize("case", ["decode-split", "decode", "prefill", "mixed"])
def test_attention_over_an_e4m3_cache_matches_the_reference(case):
    """bf16 q over an e4m3 cache on the GPU: float16 dots, V widened by the inline-assembly
    conversion (ASM_V); the reference computes float32 attention over the same q and cache. Each
    case: one split and many (decode), prefill chunks over cached context, and a mixed step."""
    from engine.kernels import attention
    from engine.kernels.attention_triton import _DECODE_LAUNCH, paged_attention_triton
    from tests.unit.test_kernels_ref import build_batch, make_pool

    assert _DECODE_LAUNCH.compiled
    gen = torch.Generator().manual_seed(11)
    block, hq, hkv, d = 16, 32, 8, 128
    q_lens, seq_lens = {"decode-split": ([1, 1], [700, 1500]), "decode": ([1] * 40, [100 + 13 * i for i in range(40)]),
                        "prefill": ([70, 300], [200, 300]), "mixed": ([1, 37, 1, 64], [900, 37, 20, 400])}[case]
    pages = sum((s + block - 1) // block for s in seq_lens) + 4
    _, kc, vc = make_pool(pages, 2, block, hkv, d, torch.float32)
    kc8, vc8 = (kc * 3).to(fmt.FP8).cuda(), (vc * 3).to(fmt.FP8).cuda()
    tables, _, qsl, sl = build_batch(q_lens, seq_lens, block, pages, gen)
    tables, qsl, sl = tables.cuda(), qsl.cuda(), sl.cuda()
    q = torch.randn(sum(q_lens), hq, d, device="cuda").to(torch.bfloat16)
    splits = 16 if case == "decode-split" else None
    out = paged_attention_triton(q, kc8, vc8, qsl, sl, tables, d ** -0.5, max(q_lens), max(seq_lens), num_splits=splits)
    ref = attention.paged_attention_ref(q.float(), kc8, vc8, qsl, sl, tables, d ** -0.5)
    err = ((out.float() - ref).norm() / ref.norm()).item()
    assert err < 1e-2, (case, err)
