"""engine.core.load_notes: measured workspaces kept on disk across processes, for this setting
only, bounded, and never trusted when the file is damaged."""

from __future__ import annotations

import json

import torch

from engine.core import load_notes
from engine.core.load_notes import MAX_NOTES, LoadNotes, setting
from engine.core.memory_plan import Workspace

W = Workspace(123, 45)


def test_round_trip_across_instances_and_only_for_the_same_setting(tmp_path):
    path = tmp_path / "engine" / "load-notes.json"
    a = LoadNotes(path, "s1")
    assert a.get("w", "shape") is None
    assert a.put("w", "shape", W) and a.get("w", "shape") == W
    assert LoadNotes(path, "s1").get("w", "shape") == W  # a new process reads it, both parts
    assert LoadNotes(path, "s1").get("w", "other shape") is None
    assert LoadNotes(path, "s2").get("w", "shape") is None  # another engine, device or version
    assert not a.put("w", "shape", Workspace(0, 5)) and not a.put("w", "shape", 123) and not a.put("w", "shape", True)
    assert not a.put("w", "shape", Workspace(1 << 60)) and not a.put("w", "shape", Workspace(5, 1 << 60))
    assert LoadNotes(path, "s1").get("w", "shape") == W
    assert [p.name for p in path.parent.iterdir()] == ["load-notes.json"]  # no temporary left


def test_a_damaged_file_is_ignored_whole_and_replaced(tmp_path, caplog):
    path = tmp_path / "load-notes.json"
    LoadNotes(path, "s").put("w", "x", Workspace(7, 1))
    good = json.loads(path.read_text())
    key = next(iter(good["notes"]))
    assert good["notes"][key] == [7, 1]
    damaged = [b"{not json", b"[]", json.dumps({**good, "version": 99}).encode(),
               json.dumps({**good, "version": 1, "notes": {key: 7}}).encode(),  # the one-figure format
               json.dumps({**good, "notes": {key: "7"}}).encode(),
               json.dumps({**good, "notes": {key: [7]}}).encode(),
               json.dumps({**good, "notes": {key: [7, 1, 1]}}).encode(),
               json.dumps({**good, "notes": {key: [-1, 1]}}).encode(),
               json.dumps({**good, "notes": {key: [7, -1]}}).encode(),
               json.dumps({**good, "notes": {key: [7, True]}}).encode(),
               json.dumps({**good, "notes": {"short": [7, 1]}}).encode(),
               json.dumps({**good, "notes": {key: [7.5, 1]}}).encode(),
               b" " * (load_notes.MAX_FILE_BYTES + 1)]
    for data in damaged:
        path.write_bytes(data)
        notes = LoadNotes(path, "s")
        assert notes.get("w", "x") is None, data[:40]
        assert notes.put("w", "y", Workspace(9)) and LoadNotes(path, "s").get("w", "y") == Workspace(9)  # rewritten whole


def test_bounded_oldest_first(tmp_path):
    notes = LoadNotes(tmp_path / "n.json", "s")
    for i in range(MAX_NOTES + 10):
        notes.put(f"w{i}", "x", Workspace(i + 1))
    again = LoadNotes(tmp_path / "n.json", "s")
    assert again.get("w0", "x") is None and again.get(f"w{MAX_NOTES + 9}", "x") == Workspace(MAX_NOTES + 10)
    assert sum(again.get(f"w{i}", "x") is not None for i in range(MAX_NOTES + 10)) == MAX_NOTES


def test_a_failed_write_keeps_the_figure_in_this_process_only(tmp_path):
    blocked = tmp_path / "file"
    blocked.write_text("")
    notes = LoadNotes(blocked / "load-notes.json", "s")  # its folder cannot be made
    assert not notes.put("w", "x", Workspace(5))
    assert notes.get("w", "x") == Workspace(5)


def test_the_setting_names_the_versions_and_the_engine_code(tmp_path):
    s = setting(torch.device("cpu"))
    assert f"torch {torch.__version__}" in s and "|cpu|" in s and "engine " in s
    assert setting(torch.device("cpu")) == s  # stable
    tree = tmp_path / "engine"
    (tree / "core").mkdir(parents=True)
    (tree / "core" / "a.py").write_text("x = 1\n")
    before = setting(torch.device("cpu"), tree)
    (tree / "core" / "a.py").write_text("x = 22\n")  # a new build of the engine measures again
    assert setting(torch.device("cpu"), tree) != before


def test_the_key_is_the_computation_not_the_name_the_files_or_the_checkpoint_format(make_tiny_model):
    """Twelve names of one 8B, or its FP8 copy quantized once on disk, share one measurement;
    another config or another quantization on the device does not."""
    import dataclasses

    from engine.config import load_model_config
    from engine.core.loading import workspace_key

    cfg = load_model_config(make_tiny_model("llama"))
    same = workspace_key(cfg, "fp8")
    assert workspace_key(load_model_config(make_tiny_model("llama", seed=1)), "fp8") == same
    assert workspace_key(dataclasses.replace(cfg, fp8_checkpoint="channel", dtype="float8_e4m3fn",
                                             raw={"quantization_config": {}}, eos_token_ids=(7,)), "fp8") == same
    assert workspace_key(dataclasses.replace(cfg, fp8_checkpoint="block128"), "fp8") != same
    assert workspace_key(cfg, None) != same
    assert workspace_key(load_model_config(make_tiny_model("llama", "small")), "fp8") != same
    assert workspace_key(dataclasses.replace(cfg, num_layers=cfg.num_layers + 1), "fp8") != same
