"""Pre-quantized FP8 checkpoints in the hub's layouts (engine/weights/fp8_writer.py writes them,
engine/weights/fp8_checkpoint.py reads them), on the CPU reference path: each layout loads as an
FP8 model whatever the load asked, tracks the unquantized model, and every malformed scale or
misplaced e4m3 tensor is refused naming the tensor, with nothing loaded and nothing booked."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine.core.engine_core import EngineCore
from engine.options import EngineOptions
from engine.errors import ModelConfigError, WeightsError
from engine.kernels import fp8_format as fmt
from engine.weights.fp8_writer import LAYOUTS, quantize_folder
from engine.load_spec import LoadSpec
from ops.bench.fp8_accuracy import prefill_logits
from tests.integration.agent_harness import REPO

PROMPTS = [list(range(3, 40)), [9, 8, 7, 6]]
Q0 = "model.layers.0.self_attn.q_proj"


@pytest.fixture(scope="module")
def folders(tiny_llama_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("fp8ck")
    return {layout: quantize_folder(tiny_llama_dir, root / layout, layout, static_input=layout == "tensor")
            for layout in LAYOUTS}


def _core() -> EngineCore:
    return EngineCore(EngineOptions(max_num_batched_tokens=256, block_size=4, seed=0), device="cpu")


def _file(d):
    (f,) = d.glob("*.safetensors")
    return f


@pytest.mark.parametrize("layout", LAYOUTS)
def test_each_layout_loads_as_fp8_and_tracks_the_unquantized_model(layout, folders, tiny_llama_dir):
    core = _core()
    core.load_model(LoadSpec("ref", tiny_llama_dir, max_model_len=128, max_num_seqs=4))
    core.load_model(LoadSpec("ck", folders[layout], max_model_len=128, max_num_seqs=4))  # no quantization asked
    model = core.slots.get("ck").model
    assert model.quantization == "fp8" and model.layers[0].qkv_w.dtype == fmt.FP8
    cos = torch.nn.functional.cosine_similarity(prefill_logits(core, "ref", PROMPTS),
                                                prefill_logits(core, "ck", PROMPTS), dim=-1)
    assert cos.min().item() >= 0.99, cos.min().item()
    ck = load_file(str(_file(folders[layout])))
    q = ck[Q0 + ".weight"]
    rows = q.shape[0]
    got_q, got_s = model.layers[0].qkv_w[:rows], model.layers[0].qkv_s[:rows]
    if layout == "channel":  # the engine's own scheme: codes and scales as the file has them
        assert torch.equal(got_q.view(torch.uint8), q.view(torch.uint8))
        assert torch.equal(got_s, ck[Q0 + ".weight_scale"].view(-1))
    elif layout == "tensor":
        assert torch.equal(got_q.view(torch.uint8), q.view(torch.uint8))
        assert torch.equal(got_s, ck[Q0 + ".weight_scale"].expand(rows))
    else:  # blocks requantized per row: the same weights within one e4m3 step
        blocks = ck[Q0 + ".weight_scale_inv"]
        want = q.float() * blocks.repeat_interleave(128, 0)[:rows].repeat_interleave(128, 1)[:, :q.shape[1]]
        got = got_q.float() * got_s[:, None]
        assert ((got - want).abs() <= want.abs() / 8 + got_s[:, None] * 2 ** -9).all()


def _broken(folders, tmp_path, layout, mutate, config=None):
    src = folders[layout]
    out = tmp_path / f"broken-{layout}"
    out.mkdir()
    for f in src.iterdir():
        if f.suffix != ".safetensors":
            (out / f.name).write_bytes(f.read_bytes())
    tensors = load_file(str(_file(src)))
    mutate(tensors)
    save_file(tensors, str(out / _file(src).name), metadata={"format": "pt"})
    if config is not None:
        cfg = json.loads((out / "config.json").read_text())
        config(cfg)
        (out / "config.json").write_text(json.dumps(cfg))
    return out


def _set(name, value):
    def f(t):
        t[name] = value
    return f


def _scale(layout):
    return Q0 + (".weight_scale_inv" if layout == "block128" else ".weight_scale")


CASES = [
    ("channel", lambda t: t[_scale("channel")].__setitem__(3, float("nan")), f"{_scale('channel')}.*nan.*finite and positive"),
    ("channel", lambda t: t[_scale("channel")].__setitem__(0, 0.0), "0.0.*finite and positive"),
    ("tensor", lambda t: t[_scale("tensor")].__setitem__(0, -1.0), "-1.0.*finite and positive"),
    ("block128", lambda t: t[_scale("block128")].__setitem__((0, 0), float("inf")), "inf.*finite and positive"),
    ("tensor", lambda t: t[Q0 + ".input_scale"].__setitem__(0, float("nan")), r"input_scale.*nan"),
    ("channel", lambda t: t.__setitem__(_scale("channel"), t[_scale("channel")][:-1]), r"shape \[\d+, 1\], expected"),
    ("block128", lambda t: t.__setitem__(_scale("block128"), t[_scale("block128")][:, :0]), "expected"),
    ("channel", lambda t: t.__setitem__(_scale("channel"), t[_scale("channel")].to(torch.int32)), "dtype I32"),
    ("channel", lambda t: t.pop(_scale("channel")), f"{Q0}.weight'? has no {Q0}.weight_scale"),
    ("channel", lambda t: t.__setitem__(Q0 + ".weight_scale_inv", torch.ones(1, 1)), "does not belong to a channel"),
    ("channel", lambda t: t.__setitem__("model.norm.weight", t["model.norm.weight"].to(torch.float8_e4m3fn)),
     "model.norm.weight.*F8_E4M3; only an FP8 model's projection"),
    ("channel", lambda t: t.__setitem__(Q0 + ".weight", t[Q0 + ".weight"].to(torch.float8_e5m2)), "F8_E5M2; only no tensor"),
    ("channel", lambda t: t[Q0 + ".weight"].view(torch.uint8).__setitem__((2, 5), 0x7F), f"{Q0}.weight'? holds NaN codes"),
    ("block128", lambda t: t[Q0 + ".weight"].view(torch.uint8).__setitem__((0, 0), 0xFF), "holds NaN codes"),
]


@pytest.mark.parametrize("layout,mutate,match", CASES)
def test_a_malformed_checkpoint_is_refused_naming_the_tensor_and_books_nothing(layout, mutate, match, folders,
                                                                             tmp_path, tiny_llama_dir):
    bad = _broken(folders, tmp_path, layout, mutate)
    core = _core()
    core.load_model(LoadSpec("ok", tiny_llama_dir, max_model_len=128, max_num_seqs=4))
    before = core.memory()
    with pytest.raises(WeightsError, match=match):
        core.load_model(LoadSpec("bad", bad, max_model_len=128, max_num_seqs=4))
    assert set(core.models()) == {"ok"} and core.memory() == before


def test_e4m3_weights_need_a_quantization_config_and_the_config_a_known_scheme(folders, tmp_path):
    bad = _broken(folders, tmp_path, "channel", lambda t: None, config=lambda c: c.pop("quantization_config"))
    core = _core()
    with pytest.raises(WeightsError, match="declares no FP8 quantization_config"):
        core.load_model(LoadSpec("bad", bad, max_model_len=128, max_num_seqs=4, quantization="fp8"))
    other = tmp_path / "int8"
    other.mkdir()
    for f in folders["channel"].iterdir():
        (other / f.name).write_bytes(f.read_bytes())
    cfg = json.loads((other / "config.json").read_text())
    cfg["quantization_config"]["config_groups"]["group_0"]["weights"].update(type="int", strategy="channel")
    (other / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelConfigError, match="compressed-tensors, format float-quantized\\) is not supported"):
        core.load_model(LoadSpec("int8", other, max_model_len=128, max_num_seqs=4))
    for change, match in ((lambda q: q.update(kv_cache_scheme={"num_bits": 8, "type": "float"}), "kv_cache_scheme"),
                          (lambda q: q["config_groups"]["group_0"]["weights"].update(symmetric=False), "not supported")):
        cfg = json.loads((folders["channel"] / "config.json").read_text())
        change(cfg["quantization_config"])
        (other / "config.json").write_text(json.dumps(cfg))
        with pytest.raises(ModelConfigError, match=match):
            core.load_model(LoadSpec("odd", other, max_model_len=128, max_num_seqs=4))
    assert not core.models()


def test_make_model_writes_each_fp8_layout(tmp_path):
    for layout in ("channel", "block128"):
        out = tmp_path / layout
        r = subprocess.run([sys.executable, "-m", "agent.cli", "make-model", "--arch", "llama", "--preset", "tiny",
                            "--out", str(out), "--device", "cpu", "--quantize", "fp8", "--fp8-layout", layout],
                           cwd=REPO, capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stderr
        cfg = json.loads((out / "config.json").read_text())
        assert cfg["quantization_config"]["quant_method"] == ("fp8" if layout == "block128" else "compressed-tensors")
        t = load_file(str(_file(out)))
        assert t[Q0 + ".weight"].dtype == torch.float8_e4m3fn and t["model.norm.weight"].dtype != torch.float8_e4m3fn
        assert not list(tmp_path.glob(".*partial*"))


def test_block128_bands_requantized_a_chunk_at_a_time_equal_band_by_band(make_tiny_model, tmp_path, monkeypatch):
    """block128 rows are re-quantized in chunks of whole 128-row bands (one operation per chunk,
    not per band). The small preset's projections have 2-4 bands of rows and 2-4 blocks of
    columns: one band a chunk, two bands a chunk (a ragged last chunk), and the whole tensor in
    one give the same codes and scales to the bit."""
    from engine.weights import fp8_checkpoint

    folder = quantize_folder(make_tiny_model("llama", "small"), tmp_path / "b128", "block128")

    def load(chunk_bytes: int):
        monkeypatch.setattr(fp8_checkpoint, "REQUANT_BYTES", chunk_bytes)
        core = _core()
        core.load_model(LoadSpec("ck", folder, max_model_len=128, max_num_seqs=4))
        return core.slots.get("ck").model

    one_band, chunked = load(1), load(fp8_checkpoint.REQUANT_BYTES)
    two_bands = load(2 * 128 * 256 * 4)  # gate and up (256 columns): 2 chunks of 2 bands; down (512): 1 a chunk
    for a, b in zip(one_band.layers, two_bands.layers):
        assert torch.equal(a.gate_up_w.view(torch.uint8), b.gate_up_w.view(torch.uint8))
        assert torch.equal(a.down_s, b.down_s)
    assert one_band.layers[0].gate_up_w.shape[0] >= 4 * 128
    for a, b in zip(one_band.layers, chunked.layers):
        for w, s in (("qkv_w", "qkv_s"), ("o_w", "o_s"), ("gate_up_w", "gate_up_s"), ("down_w", "down_s")):
            assert torch.equal(getattr(a, w).view(torch.uint8), getattr(b, w).view(torch.uint8)), w
            assert torch.equal(getattr(a, s), getattr(b, s)), s
