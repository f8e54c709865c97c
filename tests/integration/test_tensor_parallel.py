"""Tensor parallelism on CPU: 2 gloo ranks against the unsharded engine on the same weights.

Two spawned processes (rank 0: TPEngineCore, rank 1: Follower) load tiny llama, qwen2 (qkv
bias), qwen3 (q/k norms, head_dim ≠ hidden/heads, tied embeddings) and a llama cut to a
509-token vocabulary (rank 1's block padded) split over 2 ranks (each rank one of the 2 KV heads). Checked against ``engine.LLM`` / ``LlamaModel`` in this process:
logits at every prefill position (max abs diff ≤ 1e-5), greedy tokens identical with chunked
prefill and preemption-free batching, logprobs of every step within 1e-5, and seeded sampling
identical. Loader slices, the step diff codec and refusals run without processes.
"""

from __future__ import annotations

import multiprocessing as mp
from pathlib import Path

import pytest
import torch

from engine.config import load_model_config
from engine.kv.kv_cache import KVCache, KVSpec
from engine.models.llama import AttentionMetadata
from engine.sampling import SamplingParams
from engine.sched.scheduler import ScheduledSeq, SchedulerOutput
from engine.load_spec import LoadSpec
from engine.options import EngineOptions

ARCHS = ("llama", "qwen2", "qwen3", "llama-v509")  # the last: a vocabulary that does not split evenly
OPTS = {"max_num_batched_tokens": 32, "block_size": 4, "seed": 0}
LOAD = {"max_model_len": 96, "max_num_seqs": 8, "num_kv_pages": 96}
PROMPTS = [[5, 17, 300, 42, 9, 77, 123, 8, 250, 11, 3, 60, 501, 33, 2, 14, 90, 400, 7, 21, 6, 99, 310, 45,
            12, 18, 230, 81, 64, 500, 1, 222, 111, 37, 93, 402, 16, 55, 71],
           [1, 2, 3], [400, 12], list(range(30, 47)), [7]]
PREFILL_LEN = 21


def _params() -> list[SamplingParams]:
    greedy = [SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=3) for _ in PROMPTS]
    seeded = [SamplingParams(temperature=0.9, top_k=40, top_p=0.95, seed=1234 + i, max_tokens=8, ignore_eos=True)
              for i in range(len(PROMPTS))]
    return greedy + seeded


def _run(core, name: str) -> list[dict]:
    """Every prompt twice (greedy with logprobs, then seeded sampling), all in flight at once."""
    params = _params()
    results = [{"tokens": [], "logprobs": []} for _ in params]
    for i, p in enumerate(params):
        core.add_request(f"r{i}", name, PROMPTS[i % len(PROMPTS)], p)
    while core.has_unfinished_requests():
        for out in core.step():
            r = results[int(out.req_id[1:])]
            r["tokens"].extend(out.new_token_ids)
            r["logprobs"].extend(out.logprobs or [])
    return results


@torch.inference_mode()
def _prefill_logits(model, num_kv_heads: int, cfg) -> torch.Tensor:
    """Logits of every position of one sequence prefilled in one step (model-level check)."""
    n = PREFILL_LEN
    spec = KVSpec(cfg.num_layers, 16, num_kv_heads, cfg.head_dim, torch.float32)
    kv = KVCache.allocate(spec, 2, "cpu")
    meta = AttentionMetadata(torch.arange(n), torch.tensor([0, n], dtype=torch.int32),
                             torch.tensor([n], dtype=torch.int32), torch.tensor([[0, 1]], dtype=torch.int32), n, n)
    ids = torch.tensor(PROMPTS[0][:n])
    return model.compute_logits(model(ids, torch.arange(n), kv, meta))


def _rank_main(rank: int, init_method: str, dirs: dict[str, str], out_path: str) -> None:
    """One TP rank: model-level logits, then the engine (rank 0 drives, rank 1 follows)."""
    torch.set_num_threads(1)
    from engine.parallel.engine import Follower, TPEngineCore
    from engine.parallel.group import destroy_tp_group, init_tp_group
    from engine.parallel.loader import load_shard
    from engine.parallel.shard import TPModel, plan_shards

    group = init_tp_group(rank, 2, init_method, "cpu", timeout_s=120)
    try:
        logits = {}
        for arch, d in dirs.items():
            cfg = load_model_config(d)
            plan = plan_shards(cfg, rank, 2)
            model = TPModel(plan, group, torch.float32, "cpu")
            load_shard(model, d)
            model.build_rope_cache(LOAD["max_model_len"])
            logits[arch] = _prefill_logits(model, plan.local.num_kv_heads, cfg)
        if rank == 1:
            Follower(group).serve()
            return
        core = TPEngineCore(group, EngineOptions(**OPTS))
        engine_out = {}
        for arch, d in dirs.items():
            info = core.load_model(LoadSpec(arch, d, **LOAD))
            engine_out[arch] = {"results": _run(core, arch), "device_bytes": info.device_bytes}
            core.unload_model(arch)
        stats = {"bytes_sent": core.channel.bytes_sent, "messages": core.channel.messages}
        core.close()
        torch.save({"logits": logits, "engine": engine_out, "stats": stats}, out_path)
    finally:
        destroy_tp_group()


def _odd_vocab_copy(src: Path, dst: Path, vocab: int) -> Path:
    """The tiny llama cut to ``vocab`` rows (embedding and head): the last rank's block gets a padding row."""
    import json

    from safetensors.torch import load_file, save_file

    dst.mkdir(parents=True)
    cfg = json.loads((src / "config.json").read_text())
    cfg.update(vocab_size=vocab, eos_token_id=[vocab - 2], bos_token_id=vocab - 3)
    (dst / "config.json").write_text(json.dumps(cfg))
    tensors = load_file(str(src / "model.safetensors"))
    for name in ("model.embed_tokens.weight", "lm_head.weight"):
        tensors[name] = tensors[name][:vocab].contiguous()
    save_file(tensors, str(dst / "model.safetensors"))
    return dst


@pytest.fixture(scope="module")
def tp_results(make_tiny_model, tmp_path_factory) -> dict:
    tmp = tmp_path_factory.mktemp("tp")
    dirs = {arch: str(make_tiny_model(arch)) for arch in ARCHS[:3]}
    dirs["llama-v509"] = str(_odd_vocab_copy(make_tiny_model("llama"), tmp / "llama-v509", 509))
    out = tmp / "rank0.pt"
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_rank_main, args=(r, f"file://{tmp}/rendezvous", dirs, str(out))) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=150)
    for p in procs:
        if p.is_alive():
            p.kill()
    codes = [p.exitcode for p in procs]
    if codes != [0, 0]:
        pytest.fail(f"TP ranks exited with {codes}")
    return {"dirs": dirs, **torch.load(out)}


@pytest.fixture(scope="module")
def reference(tp_results) -> dict:
    """The unsharded engine and model on the same folders, in this process."""
    from engine.llm import LLM
    from engine.weights.loader import load_weights
    from engine.models.llama import LlamaModel

    torch.set_num_threads(1)
    ref = {}
    for arch, d in tp_results["dirs"].items():
        cfg = load_model_config(d)
        model = LlamaModel(cfg, torch.float32, "cpu")
        load_weights(model, d)
        model.build_rope_cache(LOAD["max_model_len"])
        llm = LLM(d, device="cpu", **OPTS, **LOAD)
        ref[arch] = {"logits": _prefill_logits(model, cfg.num_kv_heads, cfg), "results": _run(llm.core, "default"),
                     "device_bytes": llm.info.device_bytes}
    return ref


@pytest.mark.parametrize("arch", ARCHS)
def test_prefill_logits_match_unsharded(tp_results, reference, arch):
    tp, ref = tp_results["logits"][arch], reference[arch]["logits"]
    assert tp.shape == ref.shape == (PREFILL_LEN, load_model_config(tp_results["dirs"][arch]).vocab_size)
    assert (tp - ref).abs().max().item() <= 1e-5


@pytest.mark.parametrize("arch", ARCHS)
def test_engine_tokens_and_logprobs_match_unsharded(tp_results, reference, arch):
    got, want = tp_results["engine"][arch]["results"], reference[arch]["results"]
    assert [r["tokens"] for r in got] == [r["tokens"] for r in want]  # greedy and seeded sampling
    n_greedy = len(PROMPTS)
    for g, w in zip(got[:n_greedy], want[:n_greedy]):
        assert len(g["logprobs"]) == len(w["logprobs"]) == 12
        for a, b in zip(g["logprobs"], w["logprobs"]):
            assert a["token_id"] == b["token_id"]
            assert abs(a["logprob"] - b["logprob"]) <= 1e-5
            assert [t["token_id"] for t in a["top_logprobs"]] == [t["token_id"] for t in b["top_logprobs"]]
            for ta, tb in zip(a["top_logprobs"], b["top_logprobs"]):
                assert abs(ta["logprob"] - tb["logprob"]) <= 1e-5


def test_each_rank_holds_half_the_kv_heads_and_a_share_of_weights(tp_results, reference):
    for arch in ARCHS:
        tp_bytes = tp_results["engine"][arch]["device_bytes"]
        assert tp_bytes < reference[arch]["device_bytes"]
    # A step diff is small: the whole run moved well under 1 MB of control bytes.
    assert 0 < tp_results["stats"]["bytes_sent"] < 1 << 20


def _follower_cli_run(make_tiny_model, tmp_path, num_kv_pages: int) -> tuple[list, list, list[int]]:
    """qwen3 over rank 0 here-in-a-child and rank 1 started by ``spawn_followers`` (the CLI)."""
    d = str(make_tiny_model("qwen3"))
    out = tmp_path / "cli.pt"
    ctx = mp.get_context("spawn")
    rank0 = ctx.Process(target=_cli_rank0, args=(f"file://{tmp_path}/rdv", d, str(out), num_kv_pages))
    rank0.start()
    rank0.join(timeout=120)
    if rank0.is_alive():
        rank0.kill()
    if rank0.exitcode != 0:
        pytest.fail(f"rank 0 exited with {rank0.exitcode}")
    got = torch.load(out)
    from engine.llm import LLM

    llm = LLM(d, device="cpu", **OPTS, **{**LOAD, "num_kv_pages": num_kv_pages})
    return got["results"], _run(llm.core, "default"), got["follower_codes"]


def _cli_rank0(init_method: str, d: str, out_path: str, num_kv_pages: int) -> None:
    torch.set_num_threads(1)
    from engine.parallel.engine import TPEngineCore
    from engine.parallel.follower import spawn_followers
    from engine.parallel.group import TPError, destroy_tp_group, init_tp_group

    procs = spawn_followers(2, init_method, ["cpu", "cpu"], timeout_s=120)
    group = init_tp_group(0, 2, init_method, "cpu", timeout_s=120)
    try:
        core = TPEngineCore(group, EngineOptions(**OPTS))
        try:  # a load that fails on every rank leaves the group usable
            core.load_model(LoadSpec("m", d, **{**LOAD, "num_kv_pages": 3}))
            raise RuntimeError("a 3-page cache should have been refused")
        except TPError:
            pass
        core.load_model(LoadSpec("m", d, **{**LOAD, "num_kv_pages": num_kv_pages}))
        results = _run(core, "m")
        core.close()
    finally:
        destroy_tp_group()
    codes = [p.wait(timeout=60) for p in procs]
    torch.save({"results": results, "follower_codes": codes}, out_path)


def test_follower_cli_with_preemption_matches_unsharded(make_tiny_model, tmp_path):
    # 24 pages hold exactly one 96-token sequence: ten requests in flight force preemptions.
    got, want, codes = _follower_cli_run(make_tiny_model, tmp_path, num_kv_pages=24)
    assert codes == [0]
    assert [r["tokens"] for r in got] == [r["tokens"] for r in want]


def _seq(seq_id: int, table: list[int], tokens: list[int], start: int) -> ScheduledSeq:
    return ScheduledSeq(seq_id, f"q{seq_id}", tokens, start, table, True, 0,
                        SamplingParams(temperature=0.5, seed=7, logprobs=2))


def test_step_diff_sends_only_new_pages_and_resets_after_preemption():
    from engine.parallel.wire import StepDecoder, StepEncoder

    enc, dec = StepEncoder(), StepDecoder()
    steps = [
        SchedulerOutput([_seq(1, [4, 5], [1, 2, 3, 4, 5], 0), _seq(2, [9], [8], 3)], num_decodes=0, num_batched_tokens=6),
        SchedulerOutput([_seq(1, [4, 5, 6], [7], 5), _seq(2, [9], [8], 4)], num_decodes=2, num_batched_tokens=2),
        # seq 1 preempted and readmitted on other pages; seq 2 absent this step.
        SchedulerOutput([_seq(1, [2, 3], [1, 2, 3, 4, 5, 7], 0)], num_decodes=0, num_batched_tokens=6),
        SchedulerOutput([_seq(2, [9, 10], [3], 5)], num_decodes=1, num_batched_tokens=1),
    ]
    sent = []
    for out in steps:
        wire = enc.encode(out)
        sent.append([(s[3], s[4]) for s in wire["seqs"]])
        back = dec.decode(wire)
        assert [(s.seq_id, s.block_table, s.token_ids, s.start_pos, s.sample, s.output_step) for s in back.seqs] == \
            [(s.seq_id, list(s.block_table), s.token_ids, s.start_pos, s.sample, s.output_step) for s in out.seqs]
        assert all(b.params.temperature == 0 and b.params.logprobs is None for b in back.seqs)  # rank 0 samples
        assert (back.num_decodes, back.num_batched_tokens) == (out.num_decodes, out.num_batched_tokens)
    assert sent == [[(-1, [4, 5]), (-1, [9])], [(2, [6]), (1, [])], [(-1, [2, 3])], [(-1, [9, 10])]]


def test_step_decoder_refuses_a_diff_without_its_base():
    from engine.parallel.wire import StepDecoder, WireError

    with pytest.raises(WireError):
        StepDecoder().decode({"seqs": [[1, [3], 4, 2, [7], True, 0]], "nd": 1, "nt": 1})
    with pytest.raises(WireError):
        StepDecoder().decode({"seqs": [["x"]], "nd": 0, "nt": 0})


def test_unsplittable_models_are_refused(make_tiny_model):
    from engine.parallel.group import TPConfigError
    from engine.parallel.shard import plan_shards

    cfg = load_model_config(make_tiny_model("llama"))  # 4 heads, 2 KV heads, MLP 128
    with pytest.raises(TPConfigError, match="num_attention_heads"):
        plan_shards(cfg, 0, 3)
    with pytest.raises(TPConfigError, match="num_key_value_heads"):
        plan_shards(cfg, 0, 4)
    with pytest.raises(TPConfigError):
        plan_shards(cfg, 2, 2)


def test_fp8_checkpoints_are_refused_before_any_rank_loads(make_tiny_model, tmp_path):
    from engine.parallel.group import TPConfigError
    from engine.parallel.shard import plan_shards
    from engine.weights.fp8_writer import quantize_folder

    cfg = load_model_config(quantize_folder(make_tiny_model("llama"), tmp_path / "fp8", "channel"))
    with pytest.raises(TPConfigError, match="pre-quantized FP8 checkpoint .*channel.* one GPU"):
        plan_shards(cfg, 0, 2)


def test_shards_concatenate_to_the_checkpoint(make_tiny_model):
    """Rank 0's and rank 1's slices, put back together, are the unsharded weights (no processes)."""
    from engine.weights.loader import load_weights
    from engine.models.llama import LlamaModel
    from engine.parallel.group import TPGroup
    from engine.parallel.loader import load_shard
    from engine.parallel.shard import TPModel, plan_shards

    d = make_tiny_model("qwen2")  # qkv bias: biases split with their rows
    cfg = load_model_config(d)
    full = LlamaModel(cfg, torch.float32, "cpu")
    load_weights(full, d)
    shards = []
    for r in range(2):
        m = TPModel(plan_shards(cfg, r, 2), TPGroup(r, 2, torch.device("cpu"), "gloo", None, None), torch.float32, "cpu")
        load_shard(m, d)
        shards.append(m.inner)
    q, kv, inter = cfg.q_size, cfg.kv_size, cfg.intermediate_size
    for i, f in enumerate(full.layers):
        a, b = shards[0].layers[i], shards[1].layers[i]
        for lo, n in ((0, q), (q, kv), (q + kv, kv)):
            la = lo // 2
            assert torch.equal(torch.cat([a.qkv_w[la:la + n // 2], b.qkv_w[la:la + n // 2]]), f.qkv_w[lo:lo + n])
            assert torch.equal(torch.cat([a.qkv_b[la:la + n // 2], b.qkv_b[la:la + n // 2]]), f.qkv_b[lo:lo + n])
        for lo in (0, inter):  # gate then up: each rank keeps [its gate; its up]
            la = lo // 2
            assert torch.equal(torch.cat([a.gate_up_w[la:la + inter // 2], b.gate_up_w[la:la + inter // 2]]),
                               f.gate_up_w[lo:lo + inter])
        assert torch.equal(torch.cat([a.o_w, b.o_w], 1), f.o_w)
        assert torch.equal(torch.cat([a.down_w, b.down_w], 1), f.down_w)
        assert torch.equal(a.input_norm, f.input_norm) and torch.equal(b.post_norm, f.post_norm)
    v = cfg.vocab_size
    assert torch.equal(torch.cat([shards[0].embed, shards[1].embed])[:v], full.embed)
    assert torch.equal(torch.cat([shards[0].lm_head, shards[1].lm_head])[:v], full.lm_head)
