"""The e4m3 format as the engine uses it, and row-quantized activations: what the FP8 references
(engine.kernels.fp8) and the Triton kernels (engine.kernels.fp8_triton) share, so neither imports
the other."""

from __future__ import annotations

from typing import NamedTuple

import torch

FP8 = torch.float8_e4m3fn
E4M3_MAX = 448.0  # e4m3's largest finite value: a scale is amax / E4M3_MAX
MIN_SCALE = 1e-12  # the floor of a scale: an all-zero row quantizes to zeros, not to a division by zero


class Fp8Rows(NamedTuple):
    """Row-quantized activations: ``q`` [M, K] e4m3 and ``scale`` [M, 1] float32."""

    q: torch.Tensor
    scale: torch.Tensor

    @property
    def shape(self) -> torch.Size:
        return self.q.shape

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return (self.q.float() * self.scale).to(dtype)
