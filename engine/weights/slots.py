"""What a model tells the loader about its checkpoint's tensor names (:class:`CheckpointMap`).

``weight_slots()`` maps each checkpoint tensor name to ``(destination, first row, rows)``: the
file's tensor lands, as it is, in that row range of a (fused) parameter. Some checkpoints keep
one projection of every expert in a single tensor, each expert's weight transposed against the
engine's [E, N, K] stack (Llama 4: ``feed_forward.experts.gate_up_proj`` [E, H, 2I],
``down_proj`` [E, I, H]); other checkpoints of the same model keep one tensor an expert in the
engine's orientation (FP8 hub checkpoints and the engine's own FP8 artifact). A model declares the
first form with :class:`FusedExperts` (``fused_tensors()``): the fused tensor stands for the
per-expert slot names it covers, so either form fills the model; one projection in both forms is
refused as a repeated tensor.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class FusedExperts:
    """A checkpoint tensor [E, K, N] holding every expert's weight transposed, for ``stack``
    [E, N, K] (the parameter); ``scale`` [E, N] float32 when the stack is e4m3 (quantized per
    expert and output channel as it lands); ``covers``: the per-expert slot names it replaces."""

    stack: torch.Tensor
    scale: torch.Tensor | None
    covers: tuple[str, ...]

    @property
    def file_shape(self) -> tuple[int, int, int]:
        e, n, k = self.stack.shape
        return e, k, n


@dataclass(frozen=True)
class CheckpointMap:
    """A model's checkpoint names: ``slots`` (``weight_slots()``), ``fused`` (name → the
    per-expert slots it stands for), ``skipped`` (name prefixes passed over: a vision tower
    beside the text model) and ``prefix`` (where the text model's tensors are: "" or
    ``language_model.``; a tied head saved anyway is ``prefix + "lm_head.weight"``)."""

    slots: dict[str, tuple[torch.Tensor, int, int]]
    fused: dict[str, FusedExperts]
    skipped: tuple[str, ...] = ()
    prefix: str = ""
