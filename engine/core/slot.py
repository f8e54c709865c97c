"""The records EngineCore hands out (:class:`RequestOutput`; :class:`ModelInfo` lives torch-free in
engine/model_info.py) and keeps per loaded model (:class:`ModelSlot`)."""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.config import ModelConfig
from engine.core.memory_plan import LoadNeeds, Workspace
from engine.grammar.compiler import GrammarCompiler
from engine.kv.kv_cache import KVCache
from engine.model_info import ModelInfo
from engine.runner.model_runner import ModelRunner
from engine.models.llama import LlamaModel
from engine.kv.layout import ModelPageSource
from engine.sched.scheduler import Scheduler


@dataclass
class RequestOutput:
    req_id: str
    new_token_ids: list[int]
    finish_reason: str | None  # None | "stop" | "length" | "abort"
    logprobs: list | None  # one entry per new token: {"token_id", "logprob", "top_logprobs"}
    num_prompt_tokens: int
    num_cached_tokens: int = 0  # prompt tokens whose K/V came from the prefix cache
    # With the request's first token when it asked for them: an entry (as ``logprobs``') for each
    # prompt token after the first, in order (None where none was computed).
    prompt_logprobs: list | None = None


@dataclass
class ModelSlot:
    """One loaded model. ``pages`` is set for models on the shared pool; a slot without it
    (the tensor-parallel engine's) owns its KV cache and is not booked in the ledger."""

    name: str
    config: ModelConfig
    model: LlamaModel
    kv: KVCache | None
    runner: ModelRunner | None
    scheduler: Scheduler
    weight: float
    weight_bytes: int
    info: ModelInfo
    steps: int = 0
    last_step_s: float = 1e-3
    pages: ModelPageSource | None = None
    needs: LoadNeeds | None = None
    max_num_seqs: int = 0
    workspace: Workspace = Workspace(0)  # booked for it: measured, carried over, or the estimate
    warm_key: str | None = None  # identity of the weight files, for the warm tier
    last_request_t: float = float("-inf")  # perf_counter of its newest request (StepPolicy)
    broken: str = ""  # why it has no runner (a rebuild after a pool resize failed): never stepped then
    yield_waits: int = 0  # times step() returned with this model's step in flight (EngineCore.yielded)
    yield_wait_s: float = 0.0  # the caller's time from those returns to its next step() call
    model_dir: str = ""  # where its files are (the grammar compiler reads tokenizer.json there)
    grammar: GrammarCompiler | None = None  # made at the model's first constrained request
    # Empty steps collected before their work on the device was done (``PendingStep.written``):
    # EngineCore counts them done with its page source once they are (engine/kv/page_pool.py).
    behind: list = field(default_factory=list)

    @property
    def device_bytes(self) -> int:
        if self.pages is None:
            return self.weight_bytes + (self.kv.nbytes if self.kv is not None else 0)
        return self.weight_bytes + self.workspace.held + self.pages.num_used * self.needs.page_bytes
