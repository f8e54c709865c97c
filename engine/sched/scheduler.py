"""Token-budget continuous-batching scheduler of one model (no torch import).

Each :meth:`Scheduler.schedule` call fills one step under ``max_num_batched_tokens``:

1. running sequences that are decoding (one token each), oldest first;
2. running sequences still prefilling, one chunk each (at most ``max_prefill_chunk`` tokens):
   the one with the fewest tokens to go first, with at most half of what they may take (a
   prompt admitted in part finishes in a step or two), the others in arrival order (the oldest
   keeps the other half: no long prompt starves); only a step's first chunk may take its one
   token over what it is allowed (a token deep in a long prompt can cost more than a step);
3. waiting sequences, admitted in order while pages, budget and ``max_num_seqs`` allow;
4. what the admissions left of the room kept for them (below) back to the prompts prefilling,
   from free pages only.

So a long prompt is split across steps and shares them with decodes (chunked prefill). Rules
that keep decodes at their pace and new prompts in their turn:

- while a step carries decodes (or the engine caps it: other models wait for it) a chunk is
  costed by its work, not its token count: each of its tokens also attends to every token
  before it, so a chunk of ``n`` tokens from position ``s`` costs
  ``n + attention_cost * n * (s + (n + 1) / 2)`` of the budget, and chunks shrink as a long
  prompt goes deeper (counted by tokens, a 4,096-token chunk 100k tokens deep held every decode
  of its step ~4x as long as one at the start, for an 8B: ``engine.config.attention_pair_cost``);
- beside decodes the budget is ``decode_step_tokens``, not ``max_num_batched_tokens`` (a running
  request's time per token is one such step), of which decodes leave prompts at least a quarter;
- the prompts prefilling leave the waiting prompt at the head of the queue what admitting it
  whole costs, up to half the step: else a long prompt's chunks took the whole budget each
  step and a new short prompt was admitted in the rounding's crumbs, its first token a dozen
  steps late. For a prompt over half a step only while decodes wait: with none, long prompts
  prefill one after another (one started beside another only slows it and takes the pages the
  prompts behind them need).

Alone, a prompt takes whole ``max_num_batched_tokens`` steps. With a
prefix index on the block manager, an admission first looks its leading full blocks up and
starts with the cached pages in its table: only the rest is computed (and counts against the
budget), and at least its last prompt token always is (its logits give the first output). A
block's page is indexed once the block is full, its tokens are known and the step that writes
its K/V is scheduled (the model's steps run in order on the device). When a
running sequence needs a page and none is free, the *newest* running sequence is preempted by
recompute: its pages are freed, it keeps its output tokens and goes back to the front of the
waiting queue, to be prefilled again (prompt + output) when pages are free. A preempted
sequence is never dropped. Aborts free pages at once, whatever state the sequence is in.

The output is a :class:`SchedulerOutput` of plain ints and lists. The scheduler is per model and
holds no global state, so a multi-model EngineCore keeps one per model and picks which to step.
"""

from __future__ import annotations

import bisect
import math
from collections import deque
from dataclasses import dataclass, field

from engine.sched.block_manager import BlockManager
from engine.sched.prefix_index import extend_keys
from engine.sampling import SamplingParams
from engine.sched.sequence import FinishReason, Grammar, Sequence, SequenceStatus


class SchedulerConfigError(ValueError):
    """The scheduler limits are inconsistent (e.g. one max-length sequence cannot fit)."""


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    max_model_len: int = 4096
    max_prefill_chunk: int | None = None  # None: limited by the budget only
    eos_token_ids: tuple[int, ...] = ()
    # Free pages a new admission must leave for the running sequences to grow into, as a
    # fraction of all pages; without it a fresh admission is often preempted the next step.
    admission_watermark: float = 0.01
    # One (query, key) pair of attention as a fraction of one token's pass through the weights
    # (engine.config.attention_pair_cost); 0: chunks counted by their tokens alone.
    attention_cost: float = 0.0
    # The budget of a step that carries decodes (None: max_num_batched_tokens).
    decode_step_tokens: int | None = None

    def validate(self) -> "SchedulerConfig":
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_model_len"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise SchedulerConfigError(f"{name} must be an integer >= 1, got {v!r}")
        if not isinstance(self.admission_watermark, (int, float)) or not 0 <= self.admission_watermark < 1:
            raise SchedulerConfigError(f"admission_watermark must be in [0, 1), got {self.admission_watermark!r}")
        if self.max_prefill_chunk is not None and (not isinstance(self.max_prefill_chunk, int) or self.max_prefill_chunk < 1):
            raise SchedulerConfigError(f"max_prefill_chunk must be None or >= 1, got {self.max_prefill_chunk!r}")
        if not isinstance(self.attention_cost, (int, float)) or not 0 <= self.attention_cost < 1:
            raise SchedulerConfigError(f"attention_cost must be in [0, 1), got {self.attention_cost!r}")
        if self.decode_step_tokens is not None and (not isinstance(self.decode_step_tokens, int)
                                                    or self.decode_step_tokens < 1):
            raise SchedulerConfigError(f"decode_step_tokens must be None or >= 1, got {self.decode_step_tokens!r}")
        return self


@dataclass
class ScheduledSeq:
    """One sequence's share of a step: compute ``token_ids`` at positions ``start_pos..``."""

    seq_id: int
    req_id: str
    token_ids: list[int]
    start_pos: int
    block_table: list[int]  # live table; valid for this step only
    sample: bool  # the chunk reaches the end of the sequence: sample its next token
    output_step: int  # output tokens so far: the counter of seeded sampling
    params: SamplingParams
    grammar: Grammar | None = None  # the request's grammar: the runner masks its row with it
    # A request with logit rules (SamplingParams.has_logit_rules), or a prompt chunk whose
    # logprobs are asked for: its live token list (prompt + output known so far, complete by the
    # time the runner samples it) and its prompt's length.
    history: list[int] | None = None
    num_prompt: int = 0

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def seq_len(self) -> int:
        """Context length after this step (cached + new)."""
        return self.start_pos + len(self.token_ids)


# The input token of a decode whose previous token is still being sampled on the device
# (scheduled ahead, docs/engine.md "Asynchronous steps"): the runner takes it from that step.
PLACEHOLDER = -1


@dataclass
class SchedulerOutput:
    seqs: list[ScheduledSeq] = field(default_factory=list)  # decodes first, then prefill chunks
    num_decodes: int = 0  # the first num_decodes entries are one-token decodes
    num_batched_tokens: int = 0
    preempted_req_ids: list[str] = field(default_factory=list)
    num_placeholders: int = 0  # decode entries whose token_ids is [PLACEHOLDER]
    num_constrained: int = 0  # entries whose request has a grammar (the runner masks those)
    num_ruled: int = 0  # entries whose request has logit rules (penalties, bias, min_tokens)
    num_prompt_logprobs: int = 0  # prompt chunks whose logprobs are asked for (the step runs eagerly)

    @property
    def is_empty(self) -> bool:
        return not self.seqs


class Scheduler:
    """Waiting and running queues of one model, over its :class:`BlockManager`."""

    def __init__(self, config: SchedulerConfig, block_manager: BlockManager) -> None:
        self.config = config.validate()
        self.blocks = block_manager
        if block_manager.pages_for_tokens(config.max_model_len) > block_manager.num_total_pages:
            raise SchedulerConfigError(
                f"{block_manager.num_total_pages} KV pages of {block_manager.block_size} tokens cannot hold "
                f"one sequence of max_model_len={config.max_model_len}"
            )
        self._eos = frozenset(config.eos_token_ids)
        self._watermark = int(block_manager.num_total_pages * config.admission_watermark)
        self._next_seq_id = 0
        self._seqs: dict[str, Sequence] = {}
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # sorted by arrival, oldest first
        # Times a step found too few KV pages: an admission stopped, or a running sequence was
        # preempted to give another room (the engine grows a pool that can grow: EngineCore).
        self.page_waits = 0

    # -- requests --------------------------------------------------------------------------
    def add(self, req_id: str, prompt_token_ids: list[int], params: SamplingParams,
            grammar: Grammar | None = None, output_token_ids: list[int] | None = None) -> Sequence:
        """Queue a request. The caller validated ids and params; lengths are checked here.
        ``grammar`` (constrained decoding) accepts every token the request gets; the request
        stops once it is finished. ``output_token_ids``: output it already has (a request resumed
        after its model was preempted for another's room): it waits as a sequence this scheduler
        preempted does, its tokens to compute again, counted as output."""
        if req_id in self._seqs:
            raise ValueError(f"request id {req_id!r} is already live")
        if not prompt_token_ids:
            raise ValueError("prompt is empty")
        out = list(output_token_ids or ())
        if len(prompt_token_ids) + len(out) >= self.config.max_model_len:
            raise ValueError(
                f"prompt of {len(prompt_token_ids) + len(out)} tokens leaves no room to generate "
                f"(max_model_len={self.config.max_model_len})"
            )
        if len(out) >= params.max_tokens:
            raise ValueError(f"{len(out)} output tokens already: nothing left of max_tokens={params.max_tokens}")
        seq = Sequence(self._next_seq_id, req_id, list(prompt_token_ids), params, arrival=self._next_seq_id,
                       token_ids=[*prompt_token_ids, *out], grammar=grammar)
        self._next_seq_id += 1
        self._seqs[req_id] = seq
        self.waiting.append(seq)
        return seq

    def abort(self, req_id: str) -> Sequence | None:
        """Finish the request as aborted and free its pages; None when unknown or finished."""
        seq = self._seqs.pop(req_id, None)
        if seq is None:
            return None
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        else:
            self.waiting.remove(seq)
        self.blocks.free(seq.seq_id)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = FinishReason.ABORT
        return seq

    def get(self, req_id: str) -> Sequence | None:
        return self._seqs.get(req_id)

    def has_unfinished(self) -> bool:
        return bool(self._seqs)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def tokens_to_go(self) -> int:
        """The most output tokens one of its requests may still produce (a waiting one's whole
        ``max_tokens``, each capped by the context): the steps it needs, at least, before it is
        idle, unless its requests stop early."""
        return max((min(s.params.max_tokens - s.num_output_tokens, self.config.max_model_len - s.num_tokens)
                    for s in self._seqs.values()), default=0)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    # -- one step --------------------------------------------------------------------------
    def _chunk(self, start: int, most: int, budget: int, costed: bool) -> tuple[int, int]:
        """(tokens, their cost) of the largest chunk of at most ``most`` tokens from position
        ``start`` whose cost fits ``budget``; at least one token (the step moves on even when a
        single token deep in a long prompt costs more than the budget left). Uncosted: its tokens."""
        a = self.config.attention_cost
        if not costed or not a:
            n = min(most, budget)
            return n, n
        # n + a n (start + (n + 1) / 2) <= budget: the quadratic's root in its stable form (no
        # cancellation when a is small), then down while float rounding leaves it a token over
        b = 1 + a * (start + 0.5)
        n = max(1, min(most, int(2 * budget / (b + math.sqrt(b * b + 2 * a * budget)))))
        while n > 1 and n + a * n * (start + (n + 1) / 2) > budget:
            n -= 1
        return n, math.ceil(n + a * n * (start + (n + 1) / 2) - 1e-9)

    def schedule(self, token_cap: int | None = None) -> SchedulerOutput:
        """One step's batch; ``token_cap`` lowers this step's token budget (the engine's cap
        while other models share the device), never below one token."""
        cfg = self.config
        budget = cfg.max_num_batched_tokens if token_cap is None else max(1, min(token_cap, cfg.max_num_batched_tokens))
        chunk_cap = cfg.max_prefill_chunk or budget
        planned: dict[int, tuple[Sequence, int]] = {}  # seq_id -> (seq, tokens); insertion order
        decodes: set[int] = set()  # the seq_ids loop 1 planned
        preempted: list[Sequence] = []

        def reserve(seq: Sequence, n: int) -> bool:
            """Pages for n more tokens of a running seq, preempting newer ones; False: seq itself went."""
            nonlocal budget
            while not self.blocks.ensure_capacity(seq.seq_id, seq.num_computed_tokens + n):
                self.page_waits += 1
                victim = self.running[-1]
                if victim.seq_id in planned:
                    budget += planned.pop(victim.seq_id)[1]
                self._preempt(victim)
                preempted.append(victim)
                if victim is seq:
                    return False
            return True

        # 1. decodes, oldest first. Each running sequence's kind is read once: this loop runs
        # for every running sequence every step (hundreds), so it stays lean.
        prefilling: list[Sequence] = []
        for seq in list(self.running):
            if budget < 1:
                break
            if seq.status is not SequenceStatus.RUNNING:
                continue  # preempted by an older sequence's growth in this loop
            total = len(seq.token_ids) + seq.num_inflight
            if not (seq.num_computed_tokens + 1 == total and total > seq.num_prompt_tokens):
                prefilling.append(seq)
                continue
            if seq.num_inflight and (seq.num_inflight > 1 or self._ends_at(seq, total)):
                continue  # its token in flight is its last (length), or it is already a step ahead
            if reserve(seq, 1):
                planned[seq.seq_id] = (seq, 1)
                decodes.add(seq.seq_id)
                budget -= 1

        # While a decode (or another model) waits for this step: chunks by their work and the
        # decode step's budget. While a prompt waits to be admitted: room kept for it.
        waits = bool(decodes) or token_cap is not None
        costed = self.config.attention_cost > 0 and waits
        if decodes and cfg.decode_step_tokens is not None:
            rows = sum(1 for i in decodes if i in planned)  # (less those preempted since)
            # never all of it to decodes: prompts still move when the decodes alone fill it
            budget = min(budget, max(cfg.decode_step_tokens - rows, cfg.decode_step_tokens // 4))
        share = budget
        kept = 0  # of it, for the waiting prompt
        if self.waiting and len(self.running) < cfg.max_num_seqs and not self.waiting[0].num_inflight:
            # what admitting it whole costs, up to half the step (its prefix-cache hits unknown
            # yet: step 4 gives back what it did not use); for a prompt over half a step only
            # while decodes wait (alone, the long prompts prefill one after another: started
            # beside them it only slows them and takes the pages the prompts behind it need)
            head = self.waiting[0]
            need = self._chunk(head.num_computed_tokens, min(head.num_uncomputed_tokens, chunk_cap), budget, costed)[1]
            if waits or need <= budget // 2:
                kept = min(need, budget // 2)
                share = budget - kept

        # 2. running sequences still prefilling (chunked prefill continues), in arrival order,
        # but the one with the fewest tokens to go first with at most half of their share: a
        # prompt admitted in a step's last tokens finishes in a step or two, where behind the
        # older long prompts' chunks it waited for their whole prefills (36 s behind eight 32k
        # prompts on the H100), and the oldest still gets the other half. Only the first chunk
        # may overrun what it is allowed (a token deep in a long prompt can cost more than a step).
        quick = None
        if len(prefilling) > 1:
            quick = min(prefilling, key=lambda s: s.num_uncomputed_tokens)
            prefilling.remove(quick)
            prefilling.insert(0, quick)
        first = True
        for seq in prefilling:
            if budget < 1 or share < 1:
                break
            if seq.status is not SequenceStatus.RUNNING:
                continue
            allowed = min(budget, max(1, share // 2) if seq is quick else share)
            n, cost = self._chunk(seq.num_computed_tokens, min(seq.num_uncomputed_tokens, chunk_cap), allowed, costed)
            if cost > allowed and not first:
                continue
            if reserve(seq, n):
                planned[seq.seq_id] = (seq, n)
                budget -= cost
                share -= cost
                first = False

        # 3. admissions; a sequence preempted in this very step waits for the next one.
        blocks, prefix, bs = self.blocks, self.blocks.prefix, self.blocks.block_size
        while self.waiting and budget > 0 and len(self.running) < cfg.max_num_seqs:
            seq = self.waiting[0]
            if seq.num_inflight or (seq.num_preemptions and any(seq is p for p in preempted)):
                break  # (a token in flight: preempted mid-step; it resumes once the token is known)
            hits: list[int] = []
            cached_free = 0
            if prefix is not None and seq.params.prompt_logprobs is None:  # (their logits: computed whole)
                # Full blocks before the last token only: that one is always computed.
                extend_keys(seq.block_keys, prefix.root, seq.token_ids, bs, seq.num_tokens - 1)
                hits, cached_free = blocks.cached_prefix(seq.block_keys[:(seq.num_tokens - 1) // bs])
            n, cost = self._chunk(len(hits) * bs, min(seq.num_uncomputed_tokens - len(hits) * bs, chunk_cap), budget,
                                  costed)
            reserve_pages = self._watermark if self.running else 0
            need = blocks.pages_for_tokens(len(hits) * bs + n) - len(hits) + cached_free
            if not blocks.can_allocate(need + reserve_pages):
                self.page_waits += 1
                break
            if hits:
                seq.num_computed_tokens = blocks.take_prefix(seq.seq_id, hits) * bs
                n, cost = self._chunk(seq.num_computed_tokens, min(seq.num_uncomputed_tokens, chunk_cap), budget, costed)
            if not blocks.ensure_capacity(seq.seq_id, seq.num_computed_tokens + n):
                blocks.free(seq.seq_id)
                seq.num_computed_tokens = 0
                break
            if prefix is not None and not seq.num_preemptions:
                # Prompt tokens only: a resumed request's output is found cached too (the K/V of
                # an earlier answer), and usage's cached_tokens counts the prompt's.
                seq.num_cached_tokens = min(seq.num_computed_tokens, seq.num_prompt_tokens)
                prefix.queried_tokens += seq.num_prompt_tokens
                prefix.hit_tokens += seq.num_cached_tokens
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            bisect.insort(self.running, seq, key=lambda s: s.arrival)
            planned[seq.seq_id] = (seq, n)
            budget -= cost

        # 4. what the admissions left (a waiting prompt that needed less than was kept for it, hit
        # the prefix cache, or could not be admitted) goes back to the prompts prefilling, from
        # free pages only (never by preempting what was just admitted)
        if kept:
            for seq in prefilling:
                if budget < 1:
                    break
                if seq.status is not SequenceStatus.RUNNING:
                    continue
                done = planned[seq.seq_id][1] if seq.seq_id in planned else 0
                rest = min(seq.num_uncomputed_tokens, chunk_cap) - done
                if rest < 1:
                    continue
                n, cost = self._chunk(seq.num_computed_tokens + done, rest, budget, costed)
                if cost > budget or not self.blocks.ensure_capacity(seq.seq_id, seq.num_computed_tokens + done + n):
                    break
                planned[seq.seq_id] = (seq, done + n)
                budget -= cost

        # Entries in planning order, which puts loop 1's decodes first.
        out = SchedulerOutput(preempted_req_ids=[s.req_id for s in preempted])
        seqs_out = out.seqs
        table = self.blocks.block_table
        # Tokens count as computed once scheduled (the step's K/V writes are queued in order);
        # a sampling entry adds one token in flight until update() learns its value.
        for seq, n in planned.values():
            start = seq.num_computed_tokens
            toks = seq.token_ids
            total = len(toks) + seq.num_inflight
            chunk = toks[start:start + n]
            if len(chunk) < n:  # only a decode of the token in flight
                chunk = [PLACEHOLDER]
                out.num_placeholders += 1
            sample = start + n == total
            entry = ScheduledSeq(seq.seq_id, seq.req_id, chunk, start, table(seq.seq_id), sample,
                                 total - seq.num_prompt_tokens, seq.params, seq.grammar)
            seqs_out.append(entry)
            seq.num_computed_tokens = start + n
            seq.num_inflight += sample
            if seq.grammar is not None:
                out.num_constrained += 1
            p = seq.params
            if p.reads_history:
                entry.history, entry.num_prompt = toks, seq.num_prompt_tokens
                out.num_ruled += p.has_logit_rules
                # a first prefill's chunk with positions before the prompt's last (a recompute
                # after preemption, once tokens were sent, does not ask again)
                out.num_prompt_logprobs += (p.prompt_logprobs is not None and total == seq.num_prompt_tokens
                                            and start < seq.num_prompt_tokens - 1)
            out.num_batched_tokens += n
            # The next block to index is complete once computed (or queued) with known tokens; one
            # comparison per entry on the way (this loop runs for every running sequence every step).
            if prefix is not None and start + n >= (seq.num_indexed_blocks + 1) * bs <= len(toks):
                full = min(start + n, len(toks)) // bs
                extend_keys(seq.block_keys, prefix.root, toks, bs, full * bs)
                seq.num_indexed_blocks = blocks.index_blocks(seq.seq_id, seq.block_keys, seq.num_indexed_blocks, full)
        out.num_decodes = sum(1 for i in decodes if i in planned)  # a decode may have been preempted since
        return out

    def preempt(self, req_id: str) -> bool:
        """Preempt a running request by recompute (e.g. it holds pages a shrinking pool fences).

        Its pages are freed now; it keeps its output and resumes from the waiting queue's front.
        False when the request is not running.
        """
        seq = self._seqs.get(req_id)
        if seq is None or seq.status is not SequenceStatus.RUNNING:
            return False
        self._preempt(seq)
        return True

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.blocks.free(seq.seq_id)
        seq.status = SequenceStatus.WAITING
        seq.num_computed_tokens = 0
        seq.num_indexed_blocks = 0  # its next table is other pages (or these again, as cache hits)
        seq.num_preemptions += 1
        # Preempted sequences lead the waiting queue, oldest first, ahead of fresh requests.
        i = 0
        while i < len(self.waiting) and self.waiting[i].num_preemptions and self.waiting[i].arrival < seq.arrival:
            i += 1
        self.waiting.insert(i, seq)

    def update(self, out: SchedulerOutput, sampled: list[int]) -> list[Sequence]:
        """Apply a step's results; ``sampled`` holds one id per entry with ``sample`` set, in order.

        Returns the sequences that got a new token (finished ones carry ``finish_reason``).
        Entries whose request was aborted after scheduling are skipped.
        """
        want = sum(1 for s in out.seqs if s.sample)
        if len(sampled) != want:
            raise ValueError(f"expected {want} sampled ids, got {len(sampled)}")
        it = iter(sampled)
        got: list[Sequence] = []
        for s in out.seqs:
            tok = next(it) if s.sample else None
            seq = self._seqs.get(s.req_id)
            if seq is None or seq.seq_id != s.seq_id:
                continue  # aborted or finished after it was scheduled
            if tok is not None:
                seq.num_inflight -= 1
                seq.token_ids.append(tok)
            if tok is None:
                continue
            reason = self._stop_reason(seq, tok)
            if reason is not None:
                self._finish(seq, reason)
            got.append(seq)
        return got

    def _ends_at(self, seq: Sequence, total: int) -> bool:
        """Whether a sequence of ``total`` tokens (its tokens in flight counted) is done by length."""
        return total - seq.num_prompt_tokens >= seq.params.max_tokens or total >= self.config.max_model_len

    def _stop_reason(self, seq: Sequence, tok: int) -> FinishReason | None:
        p = seq.params
        # A grammar ends its request once its value is complete; one that failed (over its mask
        # budget, or without a way on: engine/grammar/matcher.py) aborts it, and the core
        # reports its error. It sees every token first: a failed grammar's mask lets through the
        # end of text alone, which must not end the request as a finished answer.
        if seq.grammar is not None:
            if not seq.grammar.accept(tok):  # False once it has failed, too
                return FinishReason.ABORT
            if seq.grammar.finished:
                return FinishReason.STOP
        if (not p.ignore_eos and tok in self._eos) or tok in p.stop_token_ids:
            return FinishReason.STOP
        if self._ends_at(seq, seq.num_tokens):
            return FinishReason.LENGTH
        return None

    def _finish(self, seq: Sequence, reason: FinishReason) -> None:
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        else:
            self.waiting.remove(seq)
        self.blocks.free(seq.seq_id)
        self._seqs.pop(seq.req_id, None)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
