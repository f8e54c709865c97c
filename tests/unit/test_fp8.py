"""FP8 (e4m3) on the CPU: the scheme's references (engine/kernels/fp8.py), checked against first
principles and against torch's own ``_scaled_mm``, and the fused kernels' reference paths.

The Triton kernels are checked against these on the GPU (tests/gpu/test_fp8_gpu.py): the
interpreter's float-to-e4m3 conversion rounds some values a binade low, so it cannot judge them.
"""

from __future__ import annotations

import pytest
import torch

from engine.kernels import KernelError, activation, fp8, norm
from engine.kernels import fp8_format as fmt

E4M3 = torch.float8_e4m3fn


def test_weight_scales_are_each_rows_amax_over_448_and_the_rounding_is_e4m3s():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(64, 96, generator=g) * torch.logspace(-3, 1, 64)[:, None]  # rows of very different range
    q, s = fp8.quantize_weight(w)
    assert q.dtype == E4M3 and s.dtype == torch.float32 and s.shape == (64,)
    torch.testing.assert_close(s, w.abs().amax(dim=1) / 448, rtol=1e-6, atol=0)
    assert q.float().abs().amax(dim=1).eq(448).all()  # each row's largest element maps to e4m3's largest
    deq = q.float() * s[:, None]
    # 3 mantissa bits: rounding to nearest is within 1/16 relative for normal codes; below e4m3's
    # smallest normal (2^-6 of the scale) the absolute step 2^-9 * scale bounds it
    err = (deq - w).abs()
    bound = torch.maximum(w.abs() / 16, s[:, None] * 2 ** -10)
    assert (err <= bound * 1.0001).all()


def test_an_all_zero_row_gets_zero_codes_and_a_positive_scale():
    w = torch.randn(3, 32)
    w[1] = 0
    q, s = fp8.quantize_weight(w)
    assert s[1] == fmt.MIN_SCALE and q[1].float().eq(0).all()
    rows = fp8.quantize_rows_ref(w)
    assert rows.scale[1, 0] == fmt.MIN_SCALE and torch.isfinite(rows.dequantize()).all()


def test_row_quantization_writes_into_given_tensors_and_checks_them():
    x = torch.randn(5, 40, dtype=torch.bfloat16)
    out = fmt.Fp8Rows(torch.empty(5, 40, dtype=E4M3), torch.empty(5, 1))
    got = fp8.quantize_rows(x, out)
    want = fp8.quantize_rows_ref(x)
    assert got.q is out.q and torch.equal(out.q.float(), want.q.float()) and torch.equal(out.scale, want.scale)
    with pytest.raises(KernelError):
        fp8.quantize_rows(x, fmt.Fp8Rows(torch.empty(5, 40, dtype=torch.bfloat16), torch.empty(5, 1)))
    with pytest.raises(KernelError):
        fp8.quantize_rows(x, fmt.Fp8Rows(torch.empty(5, 40, dtype=E4M3), torch.empty(5)))
    with pytest.raises(KernelError):
        fp8.quantize_rows(x[0])


@pytest.mark.parametrize("bias", [False, True])
def test_the_reference_linear_is_what_torch_scaled_mm_computes(bias):
    g = torch.Generator().manual_seed(1)
    a = fp8.quantize_rows_ref(torch.randn(7, 64, generator=g))
    w_q, w_s = fp8.quantize_weight(torch.randn(48, 64, generator=g) * 0.1)
    b = torch.randn(48, generator=g) if bias else None
    got = fp8.fp8_linear(a, w_q, w_s, b, out_dtype=torch.float32)  # the CPU reference
    want = torch._scaled_mm(a.q, w_q.t(), scale_a=a.scale, scale_b=w_s.view(1, -1), out_dtype=torch.float32)
    if bias:
        want = want + b
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    # and both are the float32 product of the dequantized operands
    torch.testing.assert_close(got, a.dequantize() @ (w_q.float() * w_s[:, None]).t() + (b if bias else 0),
                               rtol=1e-5, atol=1e-5)


def test_the_linear_refuses_operands_of_the_wrong_kind():
    a = fp8.quantize_rows_ref(torch.randn(2, 32))
    w_q, w_s = fp8.quantize_weight(torch.randn(16, 32))
    for bad in (
        lambda: fp8.fp8_linear(a.dequantize(), w_q, w_s),  # not Fp8Rows
        lambda: fp8.fp8_linear(a, w_q.float(), w_s),  # a weight not in e4m3
        lambda: fp8.fp8_linear(a, w_q[:, :16], w_s),  # K differs
        lambda: fp8.fp8_linear(a, w_q, w_s[:8]),  # a scale per row
        lambda: fp8.fp8_linear(a, w_q, w_s.double()),
        lambda: fp8.fp8_linear(fmt.Fp8Rows(a.q, a.scale.view(-1)), w_q, w_s),
        lambda: fp8.fp8_linear(a, w_q, w_s, torch.zeros(3)),
    ):
        with pytest.raises(KernelError):
            bad()
    assert fp8.fp8_linear(fp8.quantize_rows_ref(torch.randn(0, 32)), w_q, w_s).shape == (0, 16)


def test_fused_norms_and_silu_mul_emit_their_rounded_output_quantized():
    g = torch.Generator().manual_seed(2)
    x, r = torch.randn(6, 64, generator=g, dtype=torch.bfloat16), torch.randn(6, 64, generator=g, dtype=torch.bfloat16)
    w = torch.rand(64, generator=g, dtype=torch.bfloat16) + 0.5
    rows, res = norm.fused_add_rms_norm(x, r, w, 1e-5, quant=True)
    plain, res_plain = norm.fused_add_rms_norm(x, r, w, 1e-5)
    assert torch.equal(res, res_plain)
    want = fp8.quantize_rows_ref(plain)
    assert torch.equal(rows.q.float(), want.q.float()) and torch.equal(rows.scale, want.scale)
    rows = norm.rms_norm(x, w, 1e-5, quant=True)
    assert torch.equal(rows.q.float(), fp8.quantize_rows_ref(norm.rms_norm(x, w, 1e-5)).q.float())
    gu = torch.randn(6, 128, generator=g, dtype=torch.bfloat16)
    rows = activation.silu_and_mul(gu, quant=True)
    want = fp8.quantize_rows_ref(activation.silu_and_mul(gu))
    assert torch.equal(rows.q.float(), want.q.float()) and torch.equal(rows.scale, want.scale)


def test_fp8_runs_on_the_cpu_reference():
    assert fp8.fp8_supported(torch.device("cpu")) == (True, "")
    ok, why = fp8.fp8_supported(torch.device("meta"))
    assert not ok and "meta" in why


def test_an_fp8_kv_write_stores_each_element_saturated_at_unit_scale():
    from engine.kernels import kv_write

    kc = torch.zeros(4, 2, 1, 8, dtype=E4M3)  # [pages, block, Hkv, D]
    vc = torch.zeros(4, 2, 1, 8, dtype=E4M3)
    k = torch.tensor([[[0.3, -1.1, 17.3, 500.0, -1e4, 2 ** -10, 0.0, 448.0]]], dtype=torch.bfloat16)
    v = -k
    kv_write.write_kv(k, v, kc, vc, torch.tensor([5]))  # page 2, offset 1
    got = kc[2, 1, 0].float()
    want = k[0, 0].float().clamp(-448, 448).to(E4M3).float()
    assert torch.equal(got, want) and got[3] == 448 and got[4] == -448
    assert torch.equal(vc[2, 1, 0].float(), -want)
    assert kc.float().abs().sum() == got.abs().sum()  # nothing else written
    with pytest.raises(KernelError):
        kv_write.write_kv(k, v, kc.view(torch.uint8), vc.view(torch.uint8), torch.tensor([5]))


def test_a_gpu_without_fp8_tensor_cores_is_refused_with_the_reason(monkeypatch):
    """What a load on an A100 (compute capability 8.0) hears; the check reads only the device's
    capability and name, so those two are what this test sets."""
    from engine.core.loading import check_quantization, kv_dtype_for
    from engine.errors import EngineError

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100-SXM4-80GB")
    ok, why = fp8.fp8_supported(torch.device("cuda"))
    assert not ok and "A100" in why and "8.0" in why and "8.9" in why
    with pytest.raises(EngineError, match="quantization 'fp8': NVIDIA A100.*no FP8 tensor cores"):
        check_quantization("fp8", None, torch.device("cuda"))
    with pytest.raises(EngineError, match="kv_cache_dtype 'fp8': NVIDIA A100"):
        kv_dtype_for("fp8", torch.device("cuda"))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    assert fp8.fp8_supported(torch.device("cuda")) == (True, "")
