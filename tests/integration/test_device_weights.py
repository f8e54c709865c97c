"""ops/bench/device_weights.py: a model whose checkpoint is not on disk, loaded through the
engine with its weights made on the device (what the full-size MoE benches need: Qwen3-30B-A3B
in bf16 does not fit the GPU machine's disk)."""

from __future__ import annotations

import pytest
import torch

from engine.core.engine_core import EngineCore
from engine.load_spec import LoadSpec
from engine.options import EngineOptions
from engine.sampling import SamplingParams
from modelgen.make import make_metadata_only
from ops.bench.device_weights import filling_on_device


@pytest.mark.parametrize("quantization", [None, "fp8"])
def test_a_folder_without_weights_loads_and_serves_with_weights_made_in_place(tmp_path, quantization):
    d = make_metadata_only(tmp_path / "m", "qwen3_moe", "tiny")
    assert not list(d.glob("*.safetensors"))
    core = EngineCore(EngineOptions(max_num_batched_tokens=256, block_size=4, seed=0), device="cpu")
    with filling_on_device(seed=1):
        info = core.load_model(LoadSpec("m", str(d), max_model_len=128, max_num_seqs=4, quantization=quantization))
    model = core.slots.get("m").model
    layer = model.layers[0]
    assert torch.equal(layer.input_norm, torch.ones_like(layer.input_norm))  # norms are ones
    assert 0.01 < model.embed.float().std().item() < 0.03  # everything else N(0, 0.02)
    if quantization == "fp8":  # codes and scales, as a load from files quantizes them
        ex = next(x.experts for x in model.layers if x.experts is not None)
        assert ex.gate_up_w.dtype == torch.float8_e4m3fn and (ex.gate_up_s > 0).all() and (ex.down_s > 0).all()
        assert layer.qkv_w.dtype == torch.float8_e4m3fn and (layer.qkv_s > 0).all()
    assert info.device_bytes >= model.nbytes
    core.add_request("r", "m", [5, 6, 7, 8], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))
    got = []
    while core.has_unfinished_requests():
        got += [t for o in core.step() for t in o.new_token_ids]
    assert len(got) == 5
    # outside the block the engine reads files again: this folder has none
    with pytest.raises(Exception, match="safetensors"):
        core.load_model(LoadSpec("again", str(d), max_model_len=128, max_num_seqs=4))


def test_the_metadata_folder_is_refused_where_it_exists(tmp_path):
    from modelgen.make import ModelGenError

    (tmp_path / "m").mkdir()
    with pytest.raises(ModelGenError, match="exists"):
        make_metadata_only(tmp_path / "m", "qwen3_moe", "tiny")
