"""Calibrated FP8 checkpoints (engine/weights/calibrate.py): GPTQ on the e4m3 grid errs less on a
layer's outputs than rounding to nearest and stays on the grid; a calibration writes a
checkpoint the engine loads, or refuses its inputs and writes nothing; ``infire-agent quantize``
tokenizes its text for it."""

from __future__ import annotations

import json

import pytest
import torch

from engine.kernels.fp8_format import E4M3_MAX, FP8
from engine.weights.calibrate import CalibrationError, calibrate, gptq_e4m3
from engine.load_spec import LoadSpec


def _correlated(n: int, k: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, k, generator=g) @ torch.randn(k, k, generator=g)  # as a layer's inputs are


def test_gptq_errs_less_on_the_outputs_than_rounding_to_nearest_and_stays_on_the_grid():
    x = _correlated(2048, 64)
    w = torch.randn(32, 64, generator=torch.Generator().manual_seed(1))
    codes, scale = gptq_e4m3(w, x.T @ x)
    assert codes.dtype == FP8 and scale.shape == (32,)
    torch.testing.assert_close(scale, w.abs().amax(dim=1) / E4M3_MAX)  # the rows' own scales
    nearest = (w / scale[:, None]).to(FP8).float() * scale[:, None]
    err = lambda q: ((x @ (q - w).T) ** 2).sum().item()  # noqa: E731
    assert err(codes.float() * scale[:, None]) < 0.7 * err(nearest)


def test_gptq_in_blocks_rounds_as_column_by_column_does():
    x = _correlated(512, 48, seed=2)
    w = torch.randn(16, 48, generator=torch.Generator().manual_seed(3))
    one, _ = gptq_e4m3(w, x.T @ x, block=48)
    blocks, _ = gptq_e4m3(w, x.T @ x, block=5)
    assert (one.float() != blocks.float()).float().mean() < 0.01  # float32 summation order only


def test_gptq_zeroes_columns_no_input_reached():
    x = _correlated(256, 16)
    x[:, 3] = 0
    w = torch.randn(8, 16)
    codes, _ = gptq_e4m3(w, x.T @ x)
    assert not codes[:, 3].float().any()


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "mistral"])
def test_a_calibrated_checkpoint_is_compressed_tensors_and_serves_close_to_the_unquantized(make_tiny_model, tmp_path,
                                                                                           arch):
    """Each family's slices (qwen2: q/k/v biases; qwen3: q/k norms, a head dim apart from the
    hidden size, tied embeddings) land where the loader reads them."""
    from engine.core.engine_core import EngineCore
    from engine.options import EngineOptions
    from ops.bench.fp8_accuracy import prefill_logits

    tiny_llama_dir = make_tiny_model(arch)
    ids = torch.randint(3, 200, (600,), generator=torch.Generator().manual_seed(0)).tolist()
    report = calibrate(tiny_llama_dir, tmp_path / "cal", ids, window=128, device="cpu")
    assert report["tokens"] == 600 and report["layers"] > 0
    cfg = json.loads((tmp_path / "cal" / "config.json").read_text())["quantization_config"]
    assert cfg["quant_method"] == "compressed-tensors"
    assert cfg["config_groups"]["group_0"]["weights"]["strategy"] == "channel"
    core = EngineCore(EngineOptions(max_num_batched_tokens=256, seed=0), device="cpu")
    core.load_model(LoadSpec("ref", tiny_llama_dir, max_model_len=128, max_num_seqs=2))
    core.load_model(LoadSpec("cal", tmp_path / "cal", max_model_len=128, max_num_seqs=2))  # FP8 from its config
    assert core.slots.get("cal").model.layers[0].qkv_w.dtype == FP8
    prompt = [ids[:100]]
    ref, cal = prefill_logits(core, "ref", prompt), prefill_logits(core, "cal", prompt)
    cos = torch.nn.functional.cosine_similarity(ref, cal, dim=-1)
    assert cos.min() > 0.98, cos.min()


@pytest.mark.parametrize("case", ["few tokens", "outside the vocabulary", "out exists", "quantized", "memory", "experts"])
def test_bad_calibration_inputs_are_refused_and_nothing_is_written(tiny_llama_dir, tmp_path, case, monkeypatch,
                                                                   make_tiny_model):
    from engine.weights import calibrate as mod
    from engine.weights.fp8_writer import quantize_folder

    ids, out, model = list(range(3, 303)), tmp_path / "cal", tiny_llama_dir
    if case == "few tokens":
        ids = ids[:100]
    elif case == "outside the vocabulary":
        ids[7] = 10 ** 9
    elif case == "out exists":
        out.mkdir()
    elif case == "memory":  # more than any host has
        monkeypatch.setattr(mod, "calibration_bytes", lambda cfg: 1 << 60)
    elif case == "experts":  # calibration covers dense projections only
        model = make_tiny_model("qwen3_moe")
    else:
        model = quantize_folder(tiny_llama_dir, tmp_path / "fp8", "channel")
    with pytest.raises(CalibrationError, match="mixture-of-experts" if case == "experts" else ""):
        calibrate(model, out, ids, window=128, device="cpu")
    assert (out.exists() and not any(out.iterdir())) if case == "out exists" else not out.exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".cal")]


def test_the_quantize_command_tokenizes_its_text_and_writes_a_loadable_checkpoint(tiny_llama_dir, tmp_path, capsys):
    from agent.cli import main

    text = tmp_path / "cal.txt"
    text.write_text(" ".join(f"word{i % 97} and more text {i}" for i in range(400)))
    rc = main(["quantize", "--model", str(tiny_llama_dir), "--out", str(tmp_path / "q"), "--calibration", str(text),
               "--tokens", "512", "--device", "cpu"])
    assert rc == 0
    report = json.loads(capsys.readouterr().out)
    assert report["tokens"] == 512 and report["out"] == str(tmp_path / "q")
    assert (tmp_path / "q" / "model.safetensors").exists()


@pytest.mark.parametrize("case", ["missing", "not utf-8", "short"])
def test_the_quantize_command_refuses_a_bad_calibration_text(tiny_llama_dir, tmp_path, capsys, case):
    from agent.cli import main

    text = tmp_path / "cal.txt"
    if case == "not utf-8":
        text.write_bytes(b"\xff\xfe" * 2000)
    elif case == "short":
        text.write_text("a few words")
    rc = main(["quantize", "--model", str(tiny_llama_dir), "--out", str(tmp_path / "q"), "--calibration", str(text),
               "--device", "cpu"])
    assert rc == 2 and "quantize:" in capsys.readouterr().err
    assert not (tmp_path / "q").exists()


def test_an_8b_calibration_is_sized_before_it_loads():
    """Float32 weights (32 GB), the grams (33 GB: the down projection's are 14,336² a layer) and
    GPTQ's float64 working set on the widest (7 GB) of an 8B."""
    from engine.config import parse_config
    from engine.weights.calibrate import calibration_bytes
    from modelgen.make import model_config

    from collections import defaultdict

    cfg = parse_config(model_config("llama", "llama-3.1-8b", 128256, defaultdict(int)))
    gib = calibration_bytes(cfg) / 2**30
    assert 60 < gib < 72, gib


@pytest.mark.parametrize("tokens", ["10", "-5", "many", str(1 << 30)])
def test_the_quantize_command_bounds_its_token_count(tiny_llama_dir, tmp_path, capsys, tokens):
    from agent.cli import main

    with pytest.raises(SystemExit) as e:
        main(["quantize", "--model", str(tiny_llama_dir), "--out", str(tmp_path / "q"), "--calibration", "x",
              "--tokens", tokens])
    assert e.value.code == 2 and "tokens must be an integer" in capsys.readouterr().err


def test_a_singular_gram_gets_more_damping_and_a_poisoned_one_is_refused():
    torch.manual_seed(0)
    w = torch.randn(8, 16)
    x = torch.randn(4, 16)  # 4 tokens for 16 inputs: rank 4; at 1e-8 damping H⁻¹ has no Cholesky factor
    codes, _ = gptq_e4m3(w, x.T @ x, damp=1e-9)  # ×10 a retry: 1e-7 succeeds
    assert torch.isfinite(codes.float()).all()
    with pytest.raises(CalibrationError, match="singular"):
        gptq_e4m3(w, x.T @ x, damp=1e-13)  # four tries up to 1e-10: no factor
    bad = x.T @ x
    bad[2, 3] = float("nan")
    with pytest.raises(CalibrationError, match="NaN"):
        gptq_e4m3(w, bad)


def test_the_writer_refuses_calibrated_tensors_that_do_not_cover_the_projections(tiny_llama_dir, tmp_path):
    from engine.weights.fp8_writer import quantize_folder

    with pytest.raises(ValueError, match="no calibrated tensors"):
        quantize_folder(tiny_llama_dir, tmp_path / "q", "channel", replace={})
    assert not (tmp_path / "q").exists() and not list(tmp_path.iterdir())


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a host without CUDA")
def test_quantize_on_cuda_without_a_gpu_is_a_clear_error(tiny_llama_dir, tmp_path, capsys):
    from agent.cli import main

    text = tmp_path / "cal.txt"
    text.write_text(" ".join(f"word{i % 97} and more text {i}" for i in range(400)))
    rc = main(["quantize", "--model", str(tiny_llama_dir), "--out", str(tmp_path / "q"), "--calibration", str(text),
               "--tokens", "512", "--device", "cuda"])
    err = capsys.readouterr().err
    assert rc == 2 and "no CUDA device" in err and "--device cpu" in err, err
    assert not (tmp_path / "q").exists()


def test_a_text_with_no_whitespace_is_tokenized_in_bounded_pieces(tiny_llama_dir):
    """50 MB with no whitespace is one 'word' to BPE (7 GB of RSS whole): tokenized a piece at a
    time, and only until the tokens asked for are in."""
    from agent.commands.quantize import PIECE_CHARS, calibration_ids
    from text.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(tiny_llama_dir)
    seen: list[int] = []
    real = tok.encode

    def encode(text, add_special_tokens=True, **kw):
        seen.append(len(text))
        return real(text, add_special_tokens=add_special_tokens, **kw)

    tok.encode = encode  # type: ignore[method-assign]
    blob = "x" * (50 << 20)
    ids = calibration_ids(tok, blob, 4096)
    assert len(ids) == 4096 and max(seen) <= PIECE_CHARS and sum(seen) < len(blob) // 10, (len(seen), max(seen))
    words = "alpha beta gamma " * 20000  # cut at whitespace: the same ids as in one go
    assert calibration_ids(tok, words, 1 << 20, piece_chars=1000) == real(words, add_special_tokens=False)
