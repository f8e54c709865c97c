"""The loader's warm-tier helpers: stash at unload, restore at load, fall back to the files."""

from __future__ import annotations

import torch

from engine.config import load_model_config
from engine.weights.loader import load_or_restore, load_weights, model_tensors, stash_weights, warm_key
from engine.models.llama import LlamaModel
from engine.weights.warm_tier import WarmTier


def _model(d) -> LlamaModel:
    return LlamaModel(load_model_config(d), torch.float32, "cpu")


def test_restore_from_the_warm_tier_gives_the_same_weights(make_tiny_model):
    d = make_tiny_model("llama")
    ref = _model(d)
    load_weights(ref, d)
    tier = WarmTier(1 << 30, pin=False)
    assert stash_weights(tier, "m", ref) == (True, None)  # a CPU model: nothing in flight
    m = _model(d)
    nbytes, source = load_or_restore(m, d, tier, "m")
    assert source == "warm" and nbytes == ref.nbytes
    for (n, a), b in zip(model_tensors(ref).items(), model_tensors(m).values()):
        assert torch.equal(a, b), n


def test_files_are_read_without_a_stored_copy_or_after_a_mismatch(make_tiny_model):
    d, other = make_tiny_model("llama"), make_tiny_model("qwen3")
    assert load_or_restore(_model(d), d)[1] == "disk"
    tier = WarmTier(1 << 30, pin=False)
    assert stash_weights(None, "m", _model(d)) == (False, None)
    src = _model(other)
    load_weights(src, other)
    stash_weights(tier, "m", src)  # a different model under the same key: shapes differ
    m = _model(d)
    assert load_or_restore(m, d, tier, "m")[1] == "disk"
    assert "m" not in tier
    ref = _model(d)
    load_weights(ref, d)
    assert torch.equal(m.embed, ref.embed)


def test_warm_key_names_the_files_and_their_form_not_the_model(make_tiny_model, tmp_path):
    import shutil

    d = make_tiny_model("llama")
    copy = tmp_path / "m"
    shutil.copytree(d, copy)
    assert warm_key(copy, "bf16") == warm_key(copy, "bf16")
    assert warm_key(copy, "bf16") != warm_key(copy, "fp32")  # other device bytes from the same files
    assert warm_key(copy) != warm_key(d)  # a copy of the bytes is other files (the page cache's view)
    linked = tmp_path / "alias"  # the disk cache's way: another snapshot hard-linking the same blobs
    linked.mkdir()
    for f in copy.iterdir():
        (linked / f.name).hardlink_to(f)
    assert warm_key(linked, "bf16") == warm_key(copy, "bf16")
    before = warm_key(copy)
    for f in copy.glob("*.safetensors"):  # a new version lands under the same path
        data = f.read_bytes()
        f.unlink()
        f.write_bytes(data)
    assert warm_key(copy) != before
