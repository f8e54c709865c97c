"""The TP driver: rank 0 runs an EngineCore whose model steps are mirrored on every other rank.

Rank 0 (:class:`TPEngineCore`) owns the scheduler, the requests and the sampling, exactly as
the one-GPU :class:`~engine.core.engine_core.EngineCore` (it *is* one, with sharded model slots). Each step
its :class:`TPRunner` broadcasts the step's SchedulerOutput diff (:mod:`engine.parallel.wire`)
and then runs its own shard; every other rank (:class:`Follower`) receives it and runs the same
:class:`~engine.runner.model_runner.ModelRunner` step on its shard, so the collectives inside the
forward pair up. All ranks end a step with the same all-gathered logits; rank 0 samples (the
followers' steps carry greedy parameters: their argmax ids are dropped).

Loads and unloads are control messages too: a load is a collective (every rank builds its shard,
then the ranks agree, over the CPU group, that all succeeded and on the number of KV pages — the
minimum that fits on every GPU — so the block tables of rank 0 are valid on every rank).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from engine.sched.block_manager import BlockManager, PageAllocator
from engine.config import ModelConfig, load_model_config, usable_len
from engine.core.engine_core import EngineCore
from engine.core.ledger import LoadPlan
from engine.core.loading import DTYPES, scheduler_config
from engine.core.memory_plan import DEFAULT_CPU_BUDGET, GPU_BUDGET_FRACTION, workspace_estimate
from engine.core.slot import ModelSlot
from engine.model_info import ModelInfo
from engine.errors import EngineError, LoadOptionError, RequestError
from engine.kv.kv_cache import KVCache, KVSpec
from engine.load_spec import LoadSpec
from engine.options import EngineOptions
from engine.runner.model_runner import ModelRunner
from engine.runner.step import StepResult
from engine.sampling import SamplingParams
from engine.parallel.group import TPError, TPGroup
from engine.parallel.loader import load_shard
from engine.parallel.shard import TPModel, plan_shards
from engine.parallel.wire import ControlChannel, StepDecoder, StepEncoder, WireError
from engine.sched.scheduler import Scheduler, SchedulerConfigError, SchedulerOutput


@dataclass
class RankShard:
    """What one rank holds of one loaded model."""

    cfg: ModelConfig
    model: TPModel
    kv: KVCache
    runner: ModelRunner
    weight_bytes: int

    @property
    def device_bytes(self) -> int:
        return self.weight_bytes + self.kv.nbytes


def build_shard(group: TPGroup, spec: dict[str, Any], used_bytes: int) -> RankShard:
    """Build this rank's shard of the model described by the load message ``spec`` (a collective).

    Every rank calls it with the same ``spec``; a failure on any rank makes all of them raise
    :class:`TPError` (nobody is left waiting in a collective).
    """
    cfg = None
    model = None
    weight_bytes = 0
    local_pages = 0
    error = ""
    try:
        cfg = load_model_config(spec["model_dir"])
        plan = plan_shards(cfg, group.rank, group.world_size)
        dtype = DTYPES[spec["dtype"]]
        model = TPModel(plan, group, dtype, group.device)
        weight_bytes = load_shard(model, spec["model_dir"])
        model.build_rope_cache(spec["max_len"])
        kv_spec = KVSpec(cfg.num_layers, spec["block_size"], plan.local.num_kv_heads, cfg.head_dim, dtype)
        pages_per_seq = -(-spec["max_len"] // spec["block_size"])
        if spec["num_kv_pages"] is not None:
            local_pages = spec["num_kv_pages"]
        else:
            workspace = workspace_estimate(cfg, spec["max_num_batched_tokens"], spec["max_num_seqs"],
                                           intermediate_size=plan.local.intermediate_size)
            budget = spec["budget"]
            if isinstance(budget, float) and 0 < budget <= 1:  # a fraction of the device (of the CPU default)
                if group.device.type == "cuda":
                    free, total = torch.cuda.mem_get_info(group.device)
                    avail = int(budget * total) - (total - free) - workspace
                else:
                    avail = int(budget * DEFAULT_CPU_BUDGET) - used_bytes - weight_bytes - workspace
            elif budget is not None:
                avail = int(budget) - used_bytes - weight_bytes - workspace
            elif group.device.type == "cuda":
                free, _ = torch.cuda.mem_get_info(group.device)
                avail = int(free * GPU_BUDGET_FRACTION) - workspace
            else:
                avail = DEFAULT_CPU_BUDGET - used_bytes - weight_bytes - workspace
            local_pages = min(max(avail, 0) // kv_spec.page_bytes, pages_per_seq * spec["max_num_seqs"])
    except (EngineError, OSError, ValueError, KeyError, RuntimeError) as e:
        error = f"{type(e).__name__}: {e}"
    ok, pages = group.min_over_ranks([0 if error else 1, local_pages])
    if not ok:
        raise TPError(f"rank {group.rank}: {error}" if error else "another rank failed to load its shard")
    if pages < pages_per_seq:
        raise TPError(f"room for {pages} KV pages on the smallest rank, one {spec['max_len']}-token sequence "
                      f"needs {pages_per_seq}")
    kv = None
    try:
        kv = KVCache.allocate(kv_spec, pages, group.device)
    except (EngineError, RuntimeError) as e:  # e.g. out of memory on this GPU only
        error = f"{type(e).__name__}: {e}"
    if not group.min_over_ranks([0 if kv is None else 1])[0]:
        raise TPError(f"rank {group.rank}: KV cache: {error}" if kv is None else "another rank could not allocate its KV cache")
    # Decode graphs (CUDA) are captured here, in lockstep on every rank: the warm-up forwards
    # run the collectives, so NCCL's communicators exist before the capture starts.
    runner = ModelRunner(model, kv, spec["max_num_batched_tokens"], spec["max_num_seqs"], spec["max_len"],
                         decode_buckets=tuple(spec["decode_buckets"]), cuda_graphs=spec["cuda_graphs"],
                         stream_pool=group.streams)
    return RankShard(cfg, model, kv, runner, weight_bytes)


class TPRunner:
    """Rank 0's runner of a sharded model: broadcast the step, then run the local shard."""

    def __init__(self, name: str, inner: ModelRunner, channel: ControlChannel) -> None:
        self.name = name
        self.inner = inner
        self.channel = channel
        self.encoder = StepEncoder()

    def execute(self, out: SchedulerOutput) -> StepResult:
        if not out.seqs:
            return StepResult([], [])
        self.channel.send({"op": "step", "model": self.name, "out": self.encoder.encode(out)})
        return self.inner.execute(out)

    def __getattr__(self, attr: str) -> Any:  # counters, graphs, buckets: the local runner's
        return getattr(self.inner, attr)


class TPEngineCore(EngineCore):
    """Rank 0 of a TP group: an EngineCore whose models are sharded over the group.

    Same API as :class:`EngineCore`; ``device_bytes`` of a model is per GPU (this rank's shard
    and KV pages; the others hold the same amount). A TP slot owns its KV cache (sized at load,
    the minimum over the ranks) and is not booked in the one-GPU ledger or PagePool, so a TP
    worker holds TP slots only. Call :meth:`close` to release the followers. Its device is the
    group's; its steps are synchronous whatever ``options.async_steps`` says (a follower's
    placeholder tokens would come from its own greedy ids).
    """

    def __init__(self, group: TPGroup, options: EngineOptions | None = None,
                 budget: int | float | None = None) -> None:
        if group.rank != 0:
            raise TPError("TPEngineCore runs on rank 0; other ranks run Follower.serve()")
        if options is not None and options.async_on_cpu:
            raise TPError("asynchronous steps are not supported by the TP engine (followers sample nothing)")
        options = dataclasses.replace(options or EngineOptions(), async_steps=False)
        super().__init__(options, device=group.device, budget=budget)
        self.group = group
        self.channel = ControlChannel(group)
        self._closed = False

    def compile_grammar(self, model: str, grammar: str) -> Any:
        """Refused: the step on the wire carries no grammar masks (a follower's forward pass does
        not need them, but the feature is not built for sharded models yet)."""
        raise RequestError("structured outputs and forced tool calls are not supported for tensor-parallel models",
                           "response_format")

    def check_load(self, spec: LoadSpec, evictable: tuple[str, ...] | list[str] = ()) -> LoadPlan:
        """Refused: a TP model is not booked in the one-GPU ledger (its KV pages are agreed by
        the ranks at :meth:`load_model`)."""
        raise TPError("a tensor-parallel engine has no load plan; load_model sizes the model on every rank")

    def begin_load(self, spec: LoadSpec, evictable: tuple[str, ...] | list[str] = ()) -> Any:
        """Refused: a TP load is a collective of every rank, run in one call (:meth:`load_model`)."""
        raise TPError("a tensor-parallel load runs in one call: load_model")

    def load_model(self, spec: LoadSpec, evictable: tuple[str, ...] | list[str] = ()) -> ModelInfo:
        """Load ``spec`` sharded over the group (a collective). ``evictable`` is not used: TP
        slots are not booked in the ledger."""
        if self._closed:
            raise TPError("the TP engine is closed")
        name, max_num_seqs = spec.name, spec.max_num_seqs
        self.loader.check_new(name)
        num_kv_pages = spec.num_kv_pages
        if num_kv_pages is not None and (isinstance(num_kv_pages, bool) or not isinstance(num_kv_pages, int)):
            raise EngineError("num_kv_pages must be an integer")
        cfg = load_model_config(spec.model_dir)
        if cfg.num_experts:
            raise LoadOptionError(f"a mixture-of-experts model ({cfg.family}) is not served tensor-parallel yet")
        plan_shards(cfg, 0, self.group.world_size)  # refuse an unsplittable model before any rank loads
        max_len = usable_len(cfg, spec.max_model_len)
        dtype = self.loader.dtype_for(cfg)
        wire = {"name": name, "model_dir": str(Path(spec.model_dir).resolve()), "max_len": max_len,
                "max_num_seqs": max_num_seqs, "block_size": spec.block_size or self.options.block_size,
                "dtype": next(k for k, v in DTYPES.items() if v == dtype), "num_kv_pages": num_kv_pages,
                "max_num_batched_tokens": self.options.max_num_batched_tokens,
                "decode_buckets": list(self.pools.decode_buckets), "cuda_graphs": self.options.cuda_graphs,
                "budget": self.budget}
        self.channel.send({"op": "load", "spec": wire})
        shard = build_shard(self.group, wire, sum(s.device_bytes for s in self.slots.values()))
        try:
            sched = Scheduler(
                scheduler_config(cfg, self.options, max_num_seqs, max_len),
                BlockManager(wire["block_size"], PageAllocator(shard.kv.num_pages)),
            )
        except SchedulerConfigError as e:
            self.channel.send({"op": "unload", "model": name})
            raise EngineError(str(e)) from None
        runner = TPRunner(name, shard.runner, self.channel)
        info = ModelInfo(name, cfg.vocab_size, max_len, list(cfg.eos_token_ids), shard.device_bytes,
                         shard.kv.num_pages, wire["block_size"])
        self.slots.add(ModelSlot(name, cfg, shard.model, shard.kv, runner, sched, float(spec.weight),
                                 shard.weight_bytes, info, max_num_seqs=max_num_seqs))
        self.picker.add_model(name, float(spec.weight))
        return info

    def unload_model(self, name: str) -> None:
        super().unload_model(name)
        self.channel.send({"op": "unload", "model": name})

    def add_request(self, req_id: str, model: str, prompt_token_ids: list[int], params: SamplingParams,
                    grammar: Any = None, output_token_ids: list[int] | tuple[int, ...] = ()) -> None:
        """As EngineCore's; prompt logprobs are refused: the other ranks would have to run the
        same eager step and LM head for them, which the step message does not carry."""
        if isinstance(params, SamplingParams) and params.prompt_logprobs is not None:
            raise RequestError("prompt_logprobs (echo with logprobs) are not served by a tensor-parallel model",
                               "prompt_logprobs")
        super().add_request(req_id, model, prompt_token_ids, params, grammar, output_token_ids)

    def close(self) -> None:
        """Tell the followers to return from :meth:`Follower.serve` (idempotent)."""
        if not self._closed:
            self._closed = True
            self.channel.send({"op": "stop"})


class Follower:
    """Ranks > 0: load, step and unload shards as rank 0's control messages say."""

    def __init__(self, group: TPGroup) -> None:
        if group.rank == 0:
            raise TPError("rank 0 drives the group (TPEngineCore); followers are ranks > 0")
        self.group = group
        self.channel = ControlChannel(group)
        self.shards: dict[str, RankShard] = {}
        self._decoders: dict[str, StepDecoder] = {}
        self.steps = 0

    def handle(self, msg: dict[str, Any]) -> bool:
        """Act on one message; False once told to stop."""
        op = msg["op"]
        if op == "step":
            shard = self.shards.get(msg.get("model"))
            if shard is None:
                raise WireError(f"step for a model this rank has not loaded: {msg.get('model')!r}")
            shard.runner.execute(self._decoders[msg["model"]].decode(msg.get("out")))
            self.steps += 1
        elif op == "load":
            spec = msg.get("spec")
            if not isinstance(spec, dict) or not isinstance(spec.get("name"), str):
                raise WireError("load message without a spec")
            used = sum(s.device_bytes for s in self.shards.values())
            self.shards[spec["name"]] = build_shard(self.group, spec, used)
            self._decoders[spec["name"]] = StepDecoder()
        elif op == "unload":
            self.shards.pop(msg.get("model"), None)
            self._decoders.pop(msg.get("model"), None)
            if self.group.device.type == "cuda":
                torch.cuda.empty_cache()
        elif op == "stop":
            return False
        else:
            raise WireError(f"unknown control op {op!r}")
        return True

    def serve(self) -> None:
        """Run until rank 0 says stop. A failed load is survivable (all ranks raised together);
        anything else ends the loop with the exception (rank 0's collectives then time out)."""
        while True:
            msg = self.channel.recv()
            try:
                if not self.handle(msg):
                    return
            except TPError:
                if msg["op"] != "load":
                    raise
                # A refused load: rank 0 raised the same TPError to its caller; keep serving.
