"""Offline API: ``LLM(model_dir, **options).generate(prompts, SamplingParams(...))``.

One model in one in-process :class:`EngineCore`. Prompts are text (tokenized with the model's
tokenizer, special tokens added) or token-id lists; results come back in prompt order.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

from engine.core.engine_core import EngineCore
from engine.model_info import ModelInfo
from engine.options import EngineOptions
from engine.errors import EngineError
from engine.sampling import SamplingParams
from engine.load_spec import LoadSpec

_MODEL_NAME = "default"
# Offline generation keeps its own step size: 2048 tokens, the engine's offline shape before the
# serving default (engine.options.EngineOptions, chosen for a quiet model's latency) took its place.
OFFLINE_BATCHED_TOKENS = 2048


@dataclass
class GenerationResult:
    prompt_token_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    logprobs: list | None = None


class LLM:
    """Options: ``device`` ("auto"), ``max_model_len`` (4096, capped by the model),
    ``max_num_seqs`` (256), ``max_num_batched_tokens`` (2048), ``block_size`` (16),
    ``num_kv_pages`` (sized from the memory budget when None), ``max_prefill_chunk``,
    ``dtype`` (None: fp32 on CPU, the checkpoint's half type on GPU), ``memory_budget_bytes``,
    ``seed`` (the stream seeds are drawn from for requests without one), ``quantization``
    (None, or "fp8": e4m3 projections quantized at load), ``kv_cache_dtype`` (None: the model's;
    "fp8": an e4m3 KV cache).
    """

    def __init__(self, model_dir: str | Path, *, device: str = "auto", max_model_len: int = 4096,
                 max_num_seqs: int = 256, max_num_batched_tokens: int = OFFLINE_BATCHED_TOKENS, block_size: int = 16,
                 num_kv_pages: int | None = None, max_prefill_chunk: int | None = None, dtype: str | None = None,
                 memory_budget_bytes: int | None = None, seed: int | None = None,
                 quantization: str | None = None, kv_cache_dtype: str | None = None) -> None:
        self.model_dir = Path(model_dir)
        self.core = EngineCore(EngineOptions(max_num_batched_tokens=max_num_batched_tokens, block_size=block_size,
                                             max_prefill_chunk=max_prefill_chunk, dtype=dtype, seed=seed),
                               device=device, budget=memory_budget_bytes)
        self.info: ModelInfo = self.core.load_model(LoadSpec(
            _MODEL_NAME, self.model_dir, max_model_len=max_model_len, max_num_seqs=max_num_seqs,
            num_kv_pages=num_kv_pages, quantization=quantization, kv_cache_dtype=kv_cache_dtype))
        self._tokenizer: Any = None
        self._next_id = 0

    @property
    def tokenizer(self) -> Any:
        if self._tokenizer is None:
            from text.tokenizer import Tokenizer

            self._tokenizer = Tokenizer.from_dir(self.model_dir)
        return self._tokenizer

    def _prompt_ids(self, prompt: str | Sequence[int]) -> list[int]:
        if isinstance(prompt, str):
            return list(self.tokenizer.encode(prompt, add_special_tokens=True))
        if isinstance(prompt, (list, tuple)):
            return list(prompt)
        raise EngineError(f"a prompt is text or a list of token ids, not {type(prompt).__name__}")

    def generate(self, prompts: str | Sequence[int] | Sequence[str | Sequence[int]],
                 params: SamplingParams | Sequence[SamplingParams] | None = None, *,
                 detokenize: bool = True) -> list[GenerationResult]:
        """Run every prompt to completion; one result per prompt, in order.

        ``params`` is one SamplingParams for all prompts or one per prompt. Bad input raises
        before any request is queued.
        """
        if isinstance(prompts, str) or (isinstance(prompts, (list, tuple)) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # a single prompt
        prompts = list(prompts)
        if params is None:
            params = SamplingParams()
        plist = list(params) if isinstance(params, (list, tuple)) else [params] * len(prompts)
        if len(plist) != len(prompts):
            raise EngineError(f"{len(plist)} sampling params for {len(prompts)} prompts")
        for p in plist:
            if not isinstance(p, SamplingParams):
                raise EngineError("params must be SamplingParams")
        ids = [self._prompt_ids(p) for p in prompts]
        results = [GenerationResult(prompt_token_ids=i) for i in ids]
        by_req: dict[str, GenerationResult] = {}
        try:
            for i, (toks, p) in enumerate(zip(ids, plist)):
                req_id = f"gen-{self._next_id}"
                self._next_id += 1
                self.core.add_request(req_id, _MODEL_NAME, toks, p)
                by_req[req_id] = results[i]
            while self.core.has_unfinished_requests():
                for out in self.core.step():
                    r = by_req.get(out.req_id)
                    if r is None:
                        continue
                    r.token_ids.extend(out.new_token_ids)
                    if out.logprobs is not None:
                        r.logprobs = (r.logprobs or []) + list(out.logprobs)
                    if out.finish_reason is not None:
                        r.finish_reason = out.finish_reason
        except BaseException:
            for req_id in by_req:  # leave no request behind in the engine (e.g. Ctrl-C)
                self.core.abort_request(req_id)
            while self.core.has_unfinished_requests():
                self.core.step()
            raise
        if detokenize and any(r.token_ids for r in results):
            try:
                tok = self.tokenizer
            except (OSError, ValueError):  # a folder without a tokenizer still generates; text stays empty
                tok = None
            if tok is not None:
                for r in results:
                    r.text = tok.decode(r.token_ids)
        return results
