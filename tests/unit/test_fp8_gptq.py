"""The GPTQ variant of ops/bench/fp8_accuracy.py: e4m3 weights whose rounding errors are spread
over the columns still to round, so the layer's outputs on correlated inputs err less than with
each weight rounded to nearest — on the same per-channel scales and grid."""

from __future__ import annotations

import torch

from ops.bench.fp8_accuracy import E4M3_MAX, fp8_round, fp8_round_gptq


def test_gptq_rounding_errs_less_on_the_outputs_and_stays_on_the_grid():
    g = torch.Generator().manual_seed(0)
    mix = torch.randn(64, 64, generator=g)
    x = torch.randn(2048, 64, generator=g) @ mix  # correlated inputs, as a layer's are
    w = torch.randn(32, 64, generator=g)
    h = (x.T @ x).double()
    plain, gptq = fp8_round(w, dim=1), fp8_round_gptq(w, h)
    err = lambda q: ((x @ (q - w).T) ** 2).sum().item()  # noqa: E731
    assert err(gptq) < 0.7 * err(plain)
    scale = w.abs().amax(dim=1, keepdim=True) / E4M3_MAX
    codes = gptq / scale
    # every weight an e4m3 value × its row's scale (up to the float32 division)
    torch.testing.assert_close(codes.to(torch.float8_e4m3fn).float(), codes, rtol=1e-5, atol=1e-5)
