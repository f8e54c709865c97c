"""EngineCore's load in phases: begin (books), the weights in a load thread, finish (installs).

A gate in front of ``load_or_restore`` holds a load's weights for as long as a test wants, so
"the other model keeps decoding while this one loads" is checked without any timing.
"""

from __future__ import annotations

import shutil
import threading

import pytest

from engine.core import loading as core_load
from engine.core.engine_core import EngineCore
from engine.options import EngineOptions
from engine.core.pool_keeper import PoolKeeper
from engine.errors import EngineError, WeightsError
from engine.sampling import SamplingParams
from engine.load_spec import LoadSpec

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
PROMPT = [5, 9, 2, 7, 11, 3]


class Gate:
    """Wraps the loader's ``load_or_restore``: each call waits for ``open`` (or its cancel)."""

    def __init__(self) -> None:
        self.open = threading.Event()
        self.entered = threading.Event()
        self.real = core_load.load_or_restore

    def __call__(self, model, model_dir, tier=None, key=None, *, cancel=None):
        self.entered.set()
        while not self.open.wait(0.005):
            if cancel is not None and cancel.is_set():
                break  # the real read below sees the cancel and stops
        return self.real(model, model_dir, tier, key, cancel=cancel)


def _core(**kw) -> EngineCore:
    return EngineCore(EngineOptions(max_num_batched_tokens=64, seed=0, **kw), device="cpu", budget=64 << 20)


def _generate(core: EngineCore, model: str, req: str = "r", prompt=PROMPT) -> list[int]:
    core.add_request(req, model, list(prompt), GREEDY)
    toks: list[int] = []
    while core.has_unfinished_requests():
        for o in core.step():
            toks += o.new_token_ids
    return toks


def _books(core: EngineCore):
    snap = core.pools.ledger.snapshot()
    return (snap.used, dict(snap.weights), dict(snap.workspace), dict(snap.kv_min), snap.kv_pool_bytes,
            core.pools.pool.num_pages if core.pools.pool is not None else None,
            sorted(core.pools.pool.models()) if core.pools.pool is not None else None, sorted(core.models()))


def test_timings_and_a_warm_reload_skip_the_warm_up_at_the_same_shape(make_tiny_model):
    d = make_tiny_model("llama")
    core = _core(warmup=True, warm_tier_bytes=1 << 30)
    core.load_model(LoadSpec("a", d, max_model_len=128, max_num_seqs=4))
    first = core.loader.last_load_timings
    for k in ("config_s", "book_s", "alloc_s", "weights_s", "rope_s", "install_s", "runner_s", "warmup_s", "total_s"):
        assert first[k] >= 0.0, k
    assert first["warm"] == 0.0 and first["warmup_skipped"] == 0.0
    ref = _generate(core, "a")
    core.unload_model("a")
    core.load_model(LoadSpec("a", d, max_model_len=128, max_num_seqs=4))
    again = core.loader.last_load_timings
    assert again["warm"] == 1.0 and again["warmup_skipped"] == 1.0
    assert _generate(core, "a", "r2") == ref
    ws = core.memory().models["a"].workspace
    core.unload_model("a")
    # Another max_num_seqs shapes another workspace: measured again, not carried over.
    core.load_model(LoadSpec("a", d, max_model_len=128, max_num_seqs=2))
    other = core.loader.last_load_timings
    assert other["warm"] == 1.0 and other["warmup_skipped"] == 0.0
    assert core.memory().models["a"].workspace != ws
    assert _generate(core, "a", "r3") == ref


@pytest.mark.parametrize("prebuild", ["1", "0"])
def test_a_warm_reload_builds_its_runner_beside_the_weights(make_tiny_model, monkeypatch, prebuild):
    """Where the warm-up is skipped, the load thread builds the runner while the weights are
    restored (``prebuild_runner``; on by default on CUDA): same tokens, same books."""
    d = make_tiny_model("llama")
    core = _core(warmup=True, warm_tier_bytes=1 << 30, prebuild_runner=prebuild == "1")
    core.load_model(LoadSpec("a", d, max_model_len=128, max_num_seqs=4))
    assert core.loader.last_load_timings["prebuilt_runner_s"] == 0.0  # nothing in the tier yet
    ref = _generate(core, "a")
    books = _books(core)
    core.unload_model("a")
    core.pools.drop_vacancies()  # else the reload takes its own runner back (engine/core/vacancy.py)
    core.load_model(LoadSpec("a", d, max_model_len=128, max_num_seqs=4))
    t = core.loader.last_load_timings
    assert t["warmup_skipped"] == 1.0 and t["vacancy"] == 0.0
    assert (t["prebuilt_runner_s"] > 0.0) == (prebuild == "1")
    assert _books(core) == books
    assert _generate(core, "a", "r2") == ref
    core.unload_model("a")
    # At another shape the warm-up runs (a measurement must see the runner): built after.
    core.load_model(LoadSpec("a", d, max_model_len=128, max_num_seqs=2))
    assert core.loader.last_load_timings["prebuilt_runner_s"] == 0.0
    assert _generate(core, "a", "r3") == ref


def test_names_on_the_same_files_share_one_warm_copy_and_other_forms_keep_their_own(make_tiny_model, tmp_path):
    """The tier keeps device bytes, not names: "b", another snapshot hard-linking "a"'s blobs (as
    the disk cache links one set of bytes published under two names), reloads from the copy "a"
    left, and its own unload adds no second copy; the same files quantized to FP8 are other
    bytes, under their own key."""
    d = make_tiny_model("llama")
    alias = tmp_path / "alias"
    alias.mkdir()
    for f in d.iterdir():
        (alias / f.name).hardlink_to(f)
    core = _core(warmup=False, warm_tier_bytes=1 << 30)
    tier = core.loader.warm_tier
    core.load_model(LoadSpec("a", d, max_model_len=128, max_num_seqs=4))
    ref = _generate(core, "a")
    core.load_model(LoadSpec("b", alias, max_model_len=128, max_num_seqs=4))
    assert core.slots.get("b").warm_key == core.slots.get("a").warm_key
    core.unload_model("a")
    one = tier.stats()
    assert one.models == 1
    core.unload_model("b")
    assert tier.stats() == one  # kept as stored, not copied again
    core.load_model(LoadSpec("b", alias, max_model_len=128, max_num_seqs=4))
    assert core.loader.last_load_timings["warm"] == 1.0
    assert _generate(core, "b", "r2") == ref
    core.load_model(LoadSpec("q", d, max_model_len=128, max_num_seqs=4, quantization="fp8"))
    assert core.loader.last_load_timings["warm"] == 0.0
    assert core.slots.get("q").warm_key != core.slots.get("b").warm_key
    core.unload_model("q")
    assert tier.stats().models == 2


def test_files_replaced_while_they_are_read_are_not_stashed_under_the_old_key(make_tiny_model, tmp_path,
                                                                             monkeypatch):
    """A pull commits a new version of "x" (new files) while x's load reads them: what was read
    is the new version, so it is not kept under the key taken from the old files, which "y"
    (another snapshot of the old blobs) still loads by: y reads its own files and answers as
    the old version does."""
    old, new = make_tiny_model("llama"), make_tiny_model("llama", seed=1)
    x, y = tmp_path / "x", tmp_path / "y"
    for d in (x, y):
        d.mkdir()
        for f in old.iterdir():
            (d / f.name).hardlink_to(f)
    ref = _core()
    ref.load_model(LoadSpec("y", y, max_model_len=128, max_num_seqs=4))
    want = _generate(ref, "y")
    gate = Gate()
    monkeypatch.setattr(core_load, "load_or_restore", gate)
    core = _core(warmup=False, warm_tier_bytes=1 << 30)
    pending = core.begin_load(LoadSpec("x", x, max_model_len=128, max_num_seqs=4))
    assert gate.entered.wait(10)
    for f in new.glob("*.safetensors"):  # the new version's files renamed into place: new inodes
        (x / f"{f.name}.tmp").write_bytes(f.read_bytes())
        (x / f"{f.name}.tmp").rename(x / f.name)
    gate.open.set()
    core.finish_load(pending)
    assert core.slots.get("x").warm_key is None
    core.unload_model("x")
    assert core.loader.warm_tier.stats().models == 0
    core.load_model(LoadSpec("y", y, max_model_len=128, max_num_seqs=4))
    assert core.loader.last_load_timings["warm"] == 0.0
    assert _generate(core, "y") == want


def test_without_warm_up_nothing_is_skipped(make_tiny_model):
    d = make_tiny_model("llama")
    core = _core(warmup=False, warm_tier_bytes=1 << 30)
    core.load_model(LoadSpec("a", d, max_model_len=128, max_num_seqs=4))
    core.unload_model("a")
    core.load_model(LoadSpec("a", d, max_model_len=128, max_num_seqs=4))
    assert core.loader.last_load_timings["warm"] == 1.0 and core.loader.last_load_timings["warmup_skipped"] == 0.0


def test_a_model_keeps_decoding_while_another_loads(make_tiny_model, monkeypatch):
    da, db = make_tiny_model("llama"), make_tiny_model("llama", seed=1)
    solo = _core()
    solo.load_model(LoadSpec("b", db, max_model_len=128, max_num_seqs=4))
    ref_b = _generate(solo, "b")
    core = _core()
    core.load_model(LoadSpec("a", da, max_model_len=128, max_num_seqs=4))
    ref_a = _generate(core, "a", "warm-a")
    gate = Gate()
    monkeypatch.setattr(core_load, "load_or_restore", gate)
    core.add_request("ra", "a", PROMPT, GREEDY)
    pending = core.begin_load(LoadSpec("b", db, max_model_len=128, max_num_seqs=4))
    assert gate.entered.wait(30)
    toks: list[int] = []
    while core.has_unfinished_requests():
        for o in core.step():
            toks += o.new_token_ids
    assert toks == ref_a and not pending.done()  # every token of A arrived while B was loading
    with pytest.raises(EngineError, match="one load at a time"):
        core.begin_load(LoadSpec("c", da, max_model_len=128, max_num_seqs=4))
    with pytest.raises(EngineError, match="already loading"):
        core.load_model(LoadSpec("b", db, max_model_len=128, max_num_seqs=4))
    gate.open.set()
    core.finish_load(pending)
    assert sorted(core.models()) == ["a", "b"]
    assert _generate(core, "b", "rb") == ref_b
    assert _generate(core, "a", "ra2") == ref_a


def test_a_failed_weight_read_leaves_the_books_as_they_were(make_tiny_model, tmp_path):
    da = make_tiny_model("llama")
    bad = tmp_path / "bad"
    shutil.copytree(make_tiny_model("llama", seed=1), bad)
    for f in bad.glob("*.safetensors"):
        f.write_bytes(f.read_bytes()[:-4096])  # the header still parses; the last tensor is short
    core = _core()
    core.load_model(LoadSpec("a", da, max_model_len=128, max_num_seqs=4))
    core.add_request("ra", "a", PROMPT, GREEDY)
    core.step()  # a's sequence holds pages
    before = _books(core)
    with pytest.raises(WeightsError):
        core.load_model(LoadSpec("b", bad, max_model_len=128, max_num_seqs=4))
    assert _books(core) == before
    pending = core.begin_load(LoadSpec("b", bad, max_model_len=128, max_num_seqs=4))
    assert _books(core) != before  # booked while its weights are read
    with pytest.raises(WeightsError):
        core.finish_load(pending)
    assert _books(core) == before and core.loader.pending is None
    while core.has_unfinished_requests():
        core.step()
    core.load_model(LoadSpec("b", make_tiny_model("llama", seed=1), max_model_len=128, max_num_seqs=4))


def test_unloading_a_model_that_is_loading_cancels_it(make_tiny_model, monkeypatch):
    da, db = make_tiny_model("llama"), make_tiny_model("llama", seed=1)
    core = _core()
    core.load_model(LoadSpec("a", da, max_model_len=128, max_num_seqs=4))
    before = _books(core)
    gate = Gate()
    monkeypatch.setattr(core_load, "load_or_restore", gate)
    pending = core.begin_load(LoadSpec("b", db, max_model_len=128, max_num_seqs=4))
    assert gate.entered.wait(30)
    core.unload_model("b")  # cancels: the read stops at its first chunk
    assert pending.done() and isinstance(pending.future.exception(), WeightsError)
    assert _books(core) == before and core.loader.pending is None
    gate.open.set()
    core.load_model(LoadSpec("b", db, max_model_len=128, max_num_seqs=4))
    assert sorted(core.models()) == ["a", "b"]


def test_an_unload_during_a_load_defers_the_pool_trim(make_tiny_model, monkeypatch):
    da, db, dc = (make_tiny_model("llama", seed=s) for s in (0, 1, 2))
    core = _core()
    core.load_model(LoadSpec("a", da, max_model_len=128, max_num_seqs=4))
    core.load_model(LoadSpec("c", dc, max_model_len=128, max_num_seqs=4))
    gate = Gate()
    monkeypatch.setattr(core_load, "load_or_restore", gate)
    pending = core.begin_load(LoadSpec("b", db, max_model_len=128, max_num_seqs=4))
    core.unload_model("c")
    assert "b" in core.pools.pool.models()  # its minimum stays held
    gate.open.set()
    core.finish_load(pending)
    ref = _core()
    ref.load_model(LoadSpec("b", db, max_model_len=128, max_num_seqs=4))
    assert _generate(core, "b") == _generate(ref, "b")
    core.unload_model("a")
    core.unload_model("b")
    core.pools.grow_when_quiet(0)  # the vacancies go when it is quiet
    assert core.pools.ledger.snapshot().used == 0


def test_a_load_ended_after_its_weights_are_in_releases_everything(make_tiny_model, monkeypatch):
    da, db = make_tiny_model("llama"), make_tiny_model("llama", seed=1)
    core = _core()
    core.load_model(LoadSpec("a", da, max_model_len=128, max_num_seqs=4))
    before = _books(core)
    pending = core.begin_load(LoadSpec("b", db, max_model_len=128, max_num_seqs=4))
    pending.future.result(30)
    core.unload_model("b")  # cancelled with its weights already read
    assert _books(core) == before and pending.done()

    new_runner = PoolKeeper.new_runner

    def broken(self, name, *rest):
        if name == "b":
            raise RuntimeError("capture failed")
        return new_runner(self, name, *rest)  # a's runner, rebuilt when the pool is resized back

    monkeypatch.setattr(PoolKeeper, "new_runner", broken)
    with pytest.raises(RuntimeError, match="capture failed"):
        core.load_model(LoadSpec("b", db, max_model_len=128, max_num_seqs=4))  # fails while installing
    assert _books(core) == before and core.loader.pending is None
    assert _generate(core, "a") == _generate(_ref_core(da), "a")


def _ref_core(d) -> EngineCore:
    core = _core()
    core.load_model(LoadSpec("a", d, max_model_len=128, max_num_seqs=4))
    return core



@pytest.mark.parametrize("prebuild", [True, False])
def test_a_restart_books_the_workspace_measured_by_the_process_before(make_tiny_model, tmp_path, prebuild):
    """The load notes on disk carry a measured workspace to the next process: its first load of
    a model of the same config at the same shape skips the warm-up and (``prebuild_runner``) builds the
    runner beside the weights, with the same tokens and the same books; another shape measures."""
    d = make_tiny_model("llama")
    path = tmp_path / "engine" / "load-notes.json"
    first = _core(warmup=True, load_notes_path=path, prebuild_runner=prebuild)
    first.load_model(LoadSpec("a", d, max_model_len=128, max_num_seqs=4))
    assert first.loader.last_load_timings["warmup_skipped"] == 0.0 and path.exists()
    ref, books = _generate(first, "a"), _books(first)
    del first
    second = _core(warmup=True, load_notes_path=path, prebuild_runner=prebuild)  # "after the restart"
    second.load_model(LoadSpec("a", d, max_model_len=128, max_num_seqs=4))
    t = second.loader.last_load_timings
    assert t["warm"] == 0.0 and t["warmup_skipped"] == 1.0
    assert (t["prebuilt_runner_s"] > 0.0) == prebuild
    assert _books(second) == books
    assert _generate(second, "a") == ref
    second.unload_model("a")
    second.load_model(LoadSpec("a", d, max_model_len=128, max_num_seqs=2))
    assert second.loader.last_load_timings["warmup_skipped"] == 0.0
    third = _core(warmup=True, load_notes_path=path)
    third.load_model(LoadSpec("b", make_tiny_model("llama", seed=1), max_model_len=128, max_num_seqs=4))
    # Other weights under another name, of the same config: the computation decides the figure.
    assert third.loader.last_load_timings["warmup_skipped"] == 1.0
    third.load_model(LoadSpec("c", make_tiny_model("llama", "small"), max_model_len=128, max_num_seqs=4))
    assert third.loader.last_load_timings["warmup_skipped"] == 0.0  # another config: its own measurement


def _long_context_copy(src, dst, positions: int):
    """``src`` with a config claiming ``positions`` of context (the weights do not depend on it)."""
    import json

    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    cfg["max_position_embeddings"] = positions
    cfg.pop("rope_scaling", None)
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def test_a_model_loads_at_its_own_context_unless_the_budget_cannot_hold_one_such_sequence(
        make_tiny_model, tmp_path, caplog):
    """No max_model_len: the model's own context when one sequence of it fits beside what is
    loaded; else the longest that fits (whole pages, logged), never below 4,096 tokens; a
    max_model_len given is taken as it is."""
    d = _long_context_copy(make_tiny_model("llama"), tmp_path / "long", 32768)
    roomy = EngineCore(EngineOptions(max_num_batched_tokens=64, seed=0), device="cpu", budget=64 << 20)
    assert roomy.load_model(LoadSpec("a", d, max_num_seqs=2)).max_model_len == 32768
    tight = EngineCore(EngineOptions(max_num_batched_tokens=64, seed=0), device="cpu", budget=8 << 20)
    with caplog.at_level("WARNING", logger="engine.core.loading"):
        info = tight.load_model(LoadSpec("a", d, max_num_seqs=2))
    assert core_load.CONTEXT_FLOOR <= info.max_model_len < 32768 and info.max_model_len % info.block_size == 0
    assert "not its context of 32768" in caplog.text
    assert tight.memory().free >= 0  # its one sequence is booked within the budget
    _generate(tight, "a")
    asked = EngineCore(EngineOptions(max_num_batched_tokens=64, seed=0), device="cpu", budget=8 << 20)
    assert asked.load_model(LoadSpec("a", d, max_model_len=2000, max_num_seqs=2)).max_model_len == 2000


def test_the_cap_is_whole_pages_within_the_room_and_never_below_the_floor():
    cap = core_load.context_cap
    assert cap(131072, 20 << 30, 2 << 20, 16) == 131072  # fits: its own
    assert cap(131072, 1000 * (2 << 20) + 5, 2 << 20, 16) == 16000  # whole pages of the room
    assert cap(131072, 100 * (2 << 20), 2 << 20, 16) == 4096  # 1,600 fit: the floor
    assert cap(131072, 0, 2 << 20, 16) == 4096 and cap(2048, 0, 2 << 20, 16) == 2048
