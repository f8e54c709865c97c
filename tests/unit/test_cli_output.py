"""What the CLI prints for people: model sizes in sensible units, progress lines that never say
``0 B/s``, and ``make-model`` run again on its own folder saying what to do (``--force``)."""

from __future__ import annotations

from pathlib import Path

from agent.cli import main
from cache.progress import Progress, render_bar
from modelgen.make import size_text


def test_sizes_read_as_people_write_them() -> None:
    assert size_text(585_916) == "572.2 KiB"
    assert size_text(15 << 20) == "15.0 MiB"
    assert size_text(16_070_000_000) == "16.07 GB"
    assert size_text(12) == "12 B"


def test_a_progress_line_never_says_zero_bytes_a_second() -> None:
    base = {"name": "m", "total_bytes": 1 << 20, "eta_s": None, "rate_bytes_s": 0.0, "elapsed_s": 2.0}
    done_all_there = {**base, "done_bytes": 1 << 20, "downloaded_bytes": 0, "eta_s": 0.0}
    done_moved = {**base, "done_bytes": 1 << 20, "downloaded_bytes": 1 << 20, "eta_s": 0.0}
    starting = {**base, "done_bytes": 0, "downloaded_bytes": 0}
    for snap in (done_all_there, done_moved, starting):
        assert "0 B/s" not in render_bar(snap), render_bar(snap)
    assert render_bar(done_all_there).endswith("(all already there)")
    assert render_bar(done_moved).endswith("512.0 KiB/s")
    p = Progress("m", total_bytes=1 << 20)
    p.add_resumed(1 << 20)
    assert "0 B/s" not in render_bar(p.snapshot())


def test_make_model_prints_sizes_and_says_how_to_replace(tmp_path: Path, capsys) -> None:
    out = tmp_path / "tiny"
    args = ["make-model", "--arch", "llama", "--preset", "tiny", "--out", str(out), "--device", "cpu"]
    assert main(args) == 0
    err = capsys.readouterr().err
    assert "KiB)" in err and "0.00 GB" not in err, err
    first = (out / "model.safetensors").stat().st_ino
    assert main(args) == 2  # the README's line run twice: a clear answer, nothing touched
    err = capsys.readouterr().err
    assert "--force" in err and "Traceback" not in err, err
    assert (out / "model.safetensors").stat().st_ino == first
    assert main([*args, "--force", "--seed", "1"]) == 0
    assert (out / "model.safetensors").stat().st_ino != first and (out / "config.json").is_file()
    assert [p.name for p in tmp_path.iterdir()] == ["tiny"]  # nothing left beside it
