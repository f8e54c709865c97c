"""SchedulerOutput → tensors → model → logits → sampled ids. The only place objects become tensors.

One step: the flat inputs (token ids, positions, slot mapping) and the attention metadata
(query_start_loc, seq_lens, block_tables) are built on the host as plain lists, copied once
into persistent device buffers sized for the largest step, and the model runs on views of
those buffers. The hidden rows of the last token of each sequence that samples this step go
through the LM head and the sampler; copying the chosen ids back (plus the requested
logprobs) is the step's only host sync.

Persistent buffers (:mod:`engine.runner.step_buffers`) are what CUDA graphs need: a graph
captured for a bucket reads the same addresses every replay. On CUDA with ``cuda_graphs`` on, the
graphs (:mod:`engine.runner.cuda_graphs`) are captured when the runner is built (at model load,
some deferred to their first use): decode graphs replay the decode-only steps of their batch
buckets, mixed-step graphs the forward of the other steps up to their token buckets.

A step is :meth:`ModelRunner.launch` (host lists → buffers, kernels queued, the ids' copy into
pinned host memory queued behind an event) then :meth:`ModelRunner.collect` (wait for that
event, read the ids): a caller can do host work for the next step between the two. A launch has
three phases:

1. plan: :meth:`ModelRunner.step_plan` chooses once, from the step's shape, how it runs (a
   :class:`~engine.runner.step.StepPlan`: eager, a decode graph's batch bucket or a mixed-step
   graph's token bucket, and the padding that goes with it);
2. stage and run: the deferred graph of that bucket is captured (it writes padding into the
   inputs), the inputs are staged (with the step's cascade plan, if any), then the bucket's graph
   is replayed (its cascade variant for a staged cascade plan) or, without one, the same forward
   runs eagerly;
3. sample: the sampled rows' ids are picked on the device and their copy to the host queued (a
   :class:`~engine.runner.step.PendingStep`), or, with grammar masks, left to
   :meth:`ModelRunner.sample_masked` once the step before is collected.

The host time of each launch (and of each masked sampling) is booked once, by ``_spent``.
"""

from __future__ import annotations

import bisect
import contextlib
import itertools
import time

import numpy as np
import torch

from engine import kernels
from engine.errors import EngineError
from engine.kv.kv_cache import KVCache
from engine.models.llama import AttentionMetadata, LlamaModel
from engine.kernels._dispatch import use_triton
from engine.runner.cascade import plan_cascade, rows_per_tile
from engine.runner.cuda_graphs import DEFAULT_MIXED_BUCKETS, DecodeGraphs, MixedGraphs
from engine.runner.logit_rules import apply_logit_rules
from engine.runner.logprobs import logprobs_result
from engine.runner.prompt_logprobs import prompt_logprobs
from engine.grammar.matcher import fill_masks
from engine.runner.step import EAGER, MaskedSample, PendingStep, PreparedStep, StepPlan, StepResult
from engine.runner.step_buffers import StepBuffers, to_device_async
from engine.runner.streams import StepStreams, StreamPool
from engine.sched.scheduler import PLACEHOLDER, SchedulerOutput

__all__ = ["GRAPHS_AT_LOAD_MAX", "ModelRunner", "graph_buckets"]

# Decode-graph buckets up to this batch (the latency buckets) are captured at load, with the
# largest bucket (it sizes the shared pool); the others at their first use.
GRAPHS_AT_LOAD_MAX = 8


def _smallest_at_least(buckets: tuple[int, ...], n: int) -> int | None:
    """The smallest of the sorted ``buckets`` that is >= ``n`` (None: none is)."""
    i = bisect.bisect_left(buckets, n)
    return buckets[i] if i < len(buckets) else None


def graph_buckets(device: torch.device, cuda_graphs: bool, decode_buckets: tuple[int, ...],
                  mixed_buckets: tuple[int, ...]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The decode and the mixed-step buckets a runner captures graphs for: all of them on CUDA
    with ``cuda_graphs`` on, none otherwise (graphs exist only on CUDA; off turns off both kinds)."""
    if not cuda_graphs or device.type != "cuda":
        return (), ()
    return decode_buckets, mixed_buckets


class ModelRunner:
    """Runs one model's steps over its KV cache."""

    def __init__(self, model: LlamaModel, kv: KVCache, max_num_batched_tokens: int, max_num_seqs: int,
                 max_model_len: int, decode_buckets: tuple[int, ...] = (), cuda_graphs: bool = True,
                 mixed_buckets: tuple[int, ...] | None = None, stream_pool: StreamPool | None = None) -> None:
        """``decode_buckets``: the batch sizes decode steps are padded to (() runs exact shapes);
        ``cuda_graphs``: on CUDA, capture the decode graphs of those buckets and the mixed-step
        graphs of ``mixed_buckets`` (None: :data:`DEFAULT_MIXED_BUCKETS`); False captures neither.
        ``stream_pool``: where its streams come from, the core's, shared by its runners; required
        on CUDA (None elsewhere)."""
        self.model = model
        self.max_model_len = max_model_len
        # Batch sizes decode steps are padded to (the CUDA-graph buckets); () runs exact shapes.
        self.decode_buckets = tuple(sorted(b for b in decode_buckets if 0 < b <= min(max_num_seqs, max_num_batched_tokens)))
        self.kv = kv
        self.device = model.device
        self.block_size = kv.block_size
        self.max_step_tokens = max_num_batched_tokens
        self.max_seqs = max_num_seqs
        self.max_pages = -(-max_model_len // self.block_size)
        dev = self.device
        i64 = torch.int64
        self._pin = dev.type == "cuda"
        if self._pin and stream_pool is None:
            raise EngineError("a runner on CUDA needs the core's stream pool")
        # The persistent inputs every step (and every captured graph) reads, and their staging.
        # Cascade plans where the Triton attention kernels run (the reference reads every row's
        # whole context whatever the plan).
        cfg = model.cfg
        per_tile = rows_per_tile(cfg.num_heads, cfg.num_kv_heads) if use_triton(kv.k(0)) else 0
        self.bufs = StepBuffers(dev, self.max_step_tokens, self.max_seqs, self.max_pages, max_model_len,
                                cfg.vocab_size, per_tile)
        self.cascade_rows = 0  # rows that read a shared prefix through a cascade tile
        self.cascade_steps = 0  # steps with a cascade plan
        self.cascade_long_rows = 0  # rows whose own long context a cascade tile split (engine/runner/cascade.py)
        self.streams = StepStreams(dev, stream_pool) if self._pin else None
        # Two pinned id buffers (and events), alternating, so step N+1 can launch before N is collected.
        self._ids_host = [torch.empty(self.max_seqs, dtype=i64).pin_memory() for _ in range(2)] if self._pin else []
        # Waiting for the ids yields the core (blocking sync) instead of spinning on it: a
        # spinning wait costs a whole CPU core for the GPU's whole step.
        self._ids_ready = [torch.cuda.Event(blocking=True) for _ in range(2)] if self._pin else []
        self._flip = 0
        # Grammar masks of constrained rows: two pinned int32 buffers [max_seqs, ceil(V/32)],
        # alternating like the ids (made at the first constrained step).
        self._mask_host: list[torch.Tensor | None] = [None, None]
        self._mask_flip = 0
        # Prompt logprobs computed by prefill chunks, by request and prompt position, until the
        # core hands them out with the request's first token (or drops them at its abort).
        self.prompt_logprobs: dict[str, dict[int, dict]] = {}
        self.mask_seconds = 0.0  # host seconds filling masks
        self.masked_rows = 0
        self.masked_steps = 0
        # The last launched step's sampled ids on the device, and each sampling sequence's row in
        # them: a step scheduled ahead takes its placeholder input tokens from there.
        self._prev_ids: torch.Tensor | None = None
        self._prev_rows: dict[int, int] = {}
        # Host seconds spent building and launching steps, and blocked waiting for their ids.
        self.host_seconds = 0.0
        self.host_graph_seconds = 0.0  # the share of host_seconds spent on graph-replayed steps
        self.wait_seconds = 0.0
        self.steps = 0  # launched (decode graphs, mixed graphs and eager alike)
        self.graph_steps = 0
        self.mixed_graph_steps = 0
        self.graphs: DecodeGraphs | None = None
        self.mixed: MixedGraphs | None = None
        if mixed_buckets is None:
            mixed_buckets = DEFAULT_MIXED_BUCKETS
        # Token buckets of the mixed-step graphs (engine/runner/cuda_graphs.py), on CUDA with graphs.
        self.mixed_buckets = tuple(sorted(b for b in mixed_buckets if 0 < b <= self.max_step_tokens))
        decode_now, mixed_now = graph_buckets(dev, cuda_graphs, self.decode_buckets, self.mixed_buckets)
        if decode_now:
            # At load: the largest bucket (it sizes the shared pool) and those up to
            # GRAPHS_AT_LOAD_MAX (the latency buckets); the rest at first use.
            self.graphs = DecodeGraphs(dev, self.bufs, model, kv, stream_pool)
            self.graphs.capture(decode_now, defer=tuple(b for b in decode_now if b > GRAPHS_AT_LOAD_MAX))
        if mixed_now:
            self.mixed = MixedGraphs(dev, self.bufs, model, kv, stream_pool,
                                     pool=self.graphs.pool if self.graphs is not None else None)
            self.mixed.capture(mixed_now)

    def vacate(self) -> None:
        """Forget every request it served: its model was unloaded and the runner is kept for the
        next load of the same computation and shape (engine/core/vacancy.py), whose requests'
        sequence ids start again. Graphs, buffers and kernels stay; the counters start over."""
        self._prev_ids, self._prev_rows = None, {}
        self.prompt_logprobs.clear()
        self.mask_seconds = self.host_seconds = self.host_graph_seconds = self.wait_seconds = 0.0
        self.masked_rows = self.masked_steps = self.steps = self.graph_steps = self.mixed_graph_steps = 0

    def decode_bucket(self, num_seqs: int) -> int | None:
        """The smallest decode bucket holding ``num_seqs`` sequences (None: none does)."""
        return _smallest_at_least(self.decode_buckets, num_seqs)

    def capture_deferred_graphs(self) -> float:
        """Capture every graph still deferred to its first use (decode and mixed); the seconds."""
        t = time.perf_counter()
        with self._on_last():  # after the last step, which may still read the input buffers
            if self.graphs is not None:
                for b in sorted(self.graphs.deferred, reverse=True):
                    self.graphs.capture_deferred(b)
            if self.mixed is not None:
                for b in sorted(self.mixed.deferred, reverse=True):
                    self.mixed.capture_deferred(b)
        return time.perf_counter() - t

    def capture_next_deferred(self) -> bool:
        """Capture the largest graph still deferred (decode first, then mixed); False when none
        is left or the capture gate is shut. The engine calls this while it is idle, so the
        first busy steps after a load need not stop for captures (each one a few ms of host and
        device time). A failed capture counts as done (that bucket runs eagerly)."""
        for graphs in (self.graphs, self.mixed):
            if graphs is not None and graphs.deferred:
                with self._on_last():
                    return graphs.capture_deferred(max(graphs.deferred))
        return False

    def wait_device(self) -> None:
        """Block until every step launched here has run on the device (on CPU they ran at launch)."""
        if self.streams is not None:
            self.streams.wait()

    def _on_last(self):
        return self.streams.on_last() if self.streams is not None else contextlib.nullcontext()

    @property
    def graph_tokens(self) -> int:
        """The most tokens a step can have and still replay a graph (0: none captured)."""
        mixed = self.mixed_buckets[-1] if self.mixed is not None and self.mixed_buckets else 0
        decode = self.decode_buckets[-1] if self.graphs is not None and self.decode_buckets else 0
        return max(mixed, decode)

    def mixed_bucket(self, num_tokens: int) -> int | None:
        """The smallest mixed-step graph bucket holding ``num_tokens`` tokens (None: none does)."""
        return _smallest_at_least(self.mixed_buckets, num_tokens) if self.mixed is not None else None

    def prepare(self, out: SchedulerOutput, pad_to: int | None = None,
                pad_tokens: int | None = None) -> PreparedStep:
        """Flat inputs and attention metadata of a step, in the persistent device buffers.

        ``pad_to`` (decode-only steps) pads the batch to that many one-token sequences, the
        fixed shape a captured decode graph replays: padding tokens write nowhere (slot -1) and
        attend to one position of page 0; their rows are never sampled. Block tables then take
        the full ``max_pages`` width. ``pad_tokens`` (a mixed-step graph's bucket) pads the
        tokens to that count with slot -1 and fills ``query_start_loc`` / ``seq_lens`` for all
        ``max_num_seqs`` sequences (the rest empty), block tables at full width.
        """
        bufs = self.bufs
        arena = bufs.inputs
        bs = self.block_size
        seqs = out.seqs
        b = len(seqs)
        if pad_to is not None and (out.num_decodes != b or not b <= pad_to <= self.max_seqs):
            raise ValueError(f"pad_to={pad_to} needs a decode-only step of at most that many sequences")
        if pad_to is not None and pad_tokens is not None:
            raise ValueError("pad_to and pad_tokens exclude each other")
        rows_total = pad_to or b
        ids: list[int] = []
        for s in seqs:
            ids.extend(s.token_ids)
        n_tok = np.ones(rows_total, dtype=np.int64)
        n_tok[:b] = np.fromiter((len(s.token_ids) for s in seqs), dtype=np.int64, count=b)
        starts = np.zeros(rows_total, dtype=np.int64)
        starts[:b] = np.fromiter((s.start_pos for s in seqs), dtype=np.int64, count=b)
        seq_lens = starts + n_tok
        qsl = np.zeros(rows_total + 1, dtype=np.int64)
        np.cumsum(n_tok, out=qsl[1:])
        n = int(qsl[-1])
        max_seq = int(seq_lens.max())
        full_width = pad_to is not None or pad_tokens is not None
        max_pages = self.max_pages if full_width else -(-max_seq // bs)
        if (n > self.max_step_tokens or rows_total > self.max_seqs or -(-max_seq // bs) > self.max_pages
                or (pad_tokens is not None and not n <= pad_tokens <= self.max_step_tokens)):
            raise ValueError("step larger than the runner's buffers (scheduler limits disagree with the runner)")
        tables = np.zeros((rows_total, max_pages), dtype=np.int32)
        if b:
            # every row's first pages in one pass: flat page list, then a row-major mask fill
            bts = [s.block_table for s in seqs]
            lens = np.fromiter(map(len, bts), dtype=np.int64, count=b)
            if int(lens.max()) > max_pages:
                bts = [t[:max_pages] for t in bts]
                lens = np.minimum(lens, max_pages)
            flat = np.fromiter(itertools.chain.from_iterable(bts), dtype=np.int32, count=int(lens.sum()))
            tables[:b][np.arange(max_pages) < lens[:, None]] = flat
        seq_of_tok = np.repeat(np.arange(rows_total), n_tok)
        pos = np.arange(n, dtype=np.int64) - np.repeat(qsl[:-1] - starts, n_tok)
        slots = tables[seq_of_tok, pos // bs].astype(np.int64) * bs + pos % bs
        if rows_total > b:
            slots[len(ids):] = -1
            ids.extend([0] * (rows_total - b))
        entries = [i for i, s in enumerate(seqs) if s.sample]
        rows = qsl[1:][entries] - 1 if entries else np.zeros(0, dtype=np.int64)
        if pad_tokens is not None:  # a mixed graph samples a fixed row count: the rest read row 0
            rows = np.concatenate([rows, np.zeros(bufs.sampled_rows(pad_tokens) - len(rows), dtype=np.int64)])
        if pad_tokens is not None and pad_tokens > n:
            slots = np.concatenate([slots, np.full(pad_tokens - n, -1, dtype=np.int64)])
            pos = np.concatenate([pos, np.zeros(pad_tokens - n, dtype=np.int64)])
            ids.extend([0] * (pad_tokens - n))
        cascade = self._plan_cascade(tables[:b], seq_lens[:b], n_tok[:b],
                                     self.max_seqs if pad_tokens is not None else rows_total)
        if pad_tokens is not None:
            qsl_full = np.full(self.max_seqs + 1, n, dtype=np.int64)
            qsl_full[:b + 1] = qsl
            lens_full = np.zeros(self.max_seqs, dtype=np.int64)
            lens_full[:b] = seq_lens
            qsl, seq_lens = qsl_full, lens_full
        meta = AttentionMetadata(
            slot_mapping=arena.stage("slots", slots),
            query_start_loc=arena.stage("qsl", qsl),
            seq_lens=arena.stage("seq_lens", seq_lens),
            block_tables=arena.stage("block_tables", tables),
            # a mixed graph's route: the prefill kernel, whatever the rows' lengths
            max_query_len=max(int(n_tok.max()), 2) if pad_tokens is not None else int(n_tok.max()),
            # A padded decode step runs with the captured graphs' bound, so eager and replayed
            # bucket steps launch identical kernels (same split layout, same bits).
            max_seq_len=self.max_model_len if pad_to is not None else max_seq,
            cascade=cascade,
        )
        fill = self._placeholders(out, ids) if out.num_placeholders else None
        step = PreparedStep(
            input_ids=arena.stage("input_ids", np.asarray(ids, dtype=np.int64)),
            positions=arena.stage("positions", pos),
            meta=meta,
            logits_rows=arena.stage("rows", rows.astype(np.int64, copy=False)),
            sample_entries=entries,
            is_decode_only=out.num_decodes == b,
        )
        if fill is not None:
            dst, src = arena.stage("fill_dst", fill[0]), arena.stage("fill_src", fill[1])
        arena.upload()
        if fill is not None:
            bufs.input_ids.index_copy_(0, dst, self._prev_ids.index_select(0, src))
        return step

    def _plan_cascade(self, tables: np.ndarray, seq_lens: np.ndarray, q_lens: np.ndarray,
                      rows: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Stage the step's cascade plan (engine/runner/cascade.py) for a batch of ``rows`` rows
        (a graph's full count: its cascade variant reads that many tiles and rows); None when
        it plans no row (the plain kernels, or graph, run)."""
        bufs = self.bufs
        num_tiles = bufs.cascade_tiles_for(rows)
        if not num_tiles:
            return None
        plan = plan_cascade(tables, seq_lens, q_lens, self.block_size, bufs.cascade_rows, num_tiles)
        if not plan.rows:
            return None
        self.cascade_rows += plan.shared
        self.cascade_long_rows += plan.long
        self.cascade_steps += 1
        kv_all = np.zeros(rows, dtype=np.int32)
        kv_all[:len(plan.kv_lo)] = plan.kv_lo
        return bufs.inputs.stage("cascade_tiles", plan.tiles), bufs.inputs.stage("kv_lo", kv_all)

    def _placeholders(self, out: SchedulerOutput, ids: list[int]) -> tuple[np.ndarray, np.ndarray]:
        """Token positions of the step's placeholder inputs (decode rows: row i is token i) and
        their rows in the previous launch's sampled ids; the host ids get 0 there."""
        dst, src = [], []
        rows = self._prev_rows
        for i in range(out.num_decodes):
            e = out.seqs[i]
            if e.token_ids[0] == PLACEHOLDER:
                r = rows.get(e.seq_id)
                if r is None or self._prev_ids is None:
                    raise ValueError(f"sequence {e.seq_id}: placeholder input without a launched step sampling it")
                dst.append(i)
                src.append(r)
                ids[i] = 0
        if len(dst) != out.num_placeholders:
            raise ValueError("placeholder inputs outside the decode rows")
        return np.asarray(dst, dtype=np.int64), np.asarray(src, dtype=np.int64)

    @torch.inference_mode()
    def forward_logits(self, step: PreparedStep) -> torch.Tensor:
        """[S, vocab] float32 logits of the sampled rows."""
        hidden = self.model(step.input_ids, step.positions, self.kv, step.meta)
        return self.model.compute_logits(hidden.index_select(0, step.logits_rows))

    def launch(self, out: SchedulerOutput, urgent: bool = False, eager: bool = False) -> PendingStep:
        """Queue the step's work on the device; returns before the GPU is done. On CUDA it runs
        on this runner's own streams (engine/runner/streams.py), the high-priority one if
        ``urgent``, so steps of different models run side by side. ``eager``: run the forward
        eagerly whatever :meth:`step_plan` would choose (the warm-up's, on each stream)."""
        self.steps += 1
        if self.streams is None:
            return self._launch(out, eager)
        with torch.cuda.stream(self.streams.enter(urgent, self._prev_ids)):
            return self._launch(out, eager)

    def step_plan(self, out: SchedulerOutput) -> StepPlan:
        """How ``out`` runs, chosen once before its inputs are staged: a decode-only step whose
        rows all sample replays the decode graph of its batch bucket; another step the mixed-step
        graph of its token bucket; a step beyond the largest buckets runs eagerly. A decode-only
        step is padded to its decode bucket whether or not it replays a graph (same kernels)."""
        b = len(out.seqs)
        if not b or out.num_prompt_logprobs:  # (logits at every position of those chunks: no graph does that)
            return EAGER
        pad = self.decode_bucket(b) if out.num_decodes == b else None
        if pad is not None and self.graphs is not None and all(s.sample for s in out.seqs):
            return StepPlan(self.graphs, pad, pad_to=pad)
        mixed = self.mixed_bucket(sum(len(s.token_ids) for s in out.seqs))
        if mixed is not None:
            return StepPlan(self.mixed, mixed, pad_tokens=mixed)
        return EAGER if pad is None else StepPlan(pad_to=pad)

    @torch.inference_mode()
    def _launch(self, out: SchedulerOutput, eager: bool) -> PendingStep:
        t0 = time.perf_counter()
        plan = EAGER if eager else self.step_plan(out)
        if plan.graphs is not None:
            plan.graphs.capture_deferred(plan.bucket)  # before prepare: this capture writes padding into the inputs
        step = self.prepare(out, pad_to=plan.pad_to, pad_tokens=plan.pad_tokens)
        self._prev_ids, self._prev_rows = None, {}
        logits, ids, graph = self._forward(plan, step, out)
        entries = step.sample_entries
        if not entries:
            self._spent(t0, graph)
            written = None
            if self._pin:
                written = torch.cuda.Event(blocking=True)
                written.record()
            return PendingStep.empty(written)
        if ids is not None:  # a graph's rows (or the padded forward's): the step's sampled rows lead
            s = len(entries)
            logits, ids = logits[:s], ids[:s]
        rows = [(k, out.seqs[i].grammar) for k, i in enumerate(entries)
                if out.seqs[i].grammar is not None] if out.num_constrained else []
        ruled = [(k, out.seqs[i]) for k, i in enumerate(entries)
                 if out.seqs[i].params.has_logit_rules] if out.num_ruled else []
        if rows or ruled:
            # sampled by sample_masked, once the step before has advanced the grammars and
            # completed the ruled rows' token lists
            self._spent(t0, graph)
            stream = torch.cuda.current_stream(self.device) if self._pin else None
            return PendingStep.awaiting_masks(MaskedSample(out, entries, logits, rows, graph, stream, ruled))
        return self._sample(out, entries, logits, ids, graph, t0)

    def _forward(self, plan: StepPlan, step: PreparedStep,
                 out: SchedulerOutput) -> tuple[torch.Tensor | None, torch.Tensor | None, bool]:
        """Run the staged ``step`` as ``plan`` says: (the logits of its sampled rows, or of a
        graph's rows with those first; a graph's greedy ids, else None; whether a graph replayed).
        A step that staged a cascade plan replays the bucket's cascade variant (captured now if
        it can be); a bucket or variant without a graph runs the same forward eagerly."""
        cascade = step.meta.cascade is not None
        graphs = plan.graphs
        if graphs is not None and graphs.ready(plan.bucket, cascade):
            logits, ids = graphs.replay(plan.bucket, cascade)
            if graphs is self.graphs:
                self.graph_steps += 1
            else:
                self.mixed_graph_steps += 1
            return logits, ids, True
        if plan.pad_tokens is not None:  # no graph for it (yet): the forward its capture records, eagerly
            logits, ids = graphs.run_eager(plan.bucket, cascade)
            return logits, ids, False
        if out.num_prompt_logprobs:  # eager and unpadded (step_plan): the hidden states of every position
            hidden = self.model(step.input_ids, step.positions, self.kv, step.meta)
            for req_id, got in prompt_logprobs(self.model, hidden, out.seqs).items():
                self.prompt_logprobs.setdefault(req_id, {}).update(got)
            if not step.sample_entries:
                return None, None, False
            return self.model.compute_logits(hidden.index_select(0, step.logits_rows)), None, False
        if step.sample_entries:  # unpadded, or a padded decode step whose bucket has no (cascade) graph
            return self.forward_logits(step), None, False
        self.model(step.input_ids, step.positions, self.kv, step.meta)  # a prefill chunk that samples nothing
        return None, None, False

    def _spent(self, t0: float, graph: bool) -> None:
        """Book the host seconds since ``t0`` (building, launching or sampling a step) to
        ``host_seconds``, and to ``host_graph_seconds`` for a step that replayed a graph."""
        dt = time.perf_counter() - t0
        self.host_seconds += dt
        if graph:
            self.host_graph_seconds += dt

    def sample_masked(self, pending: PendingStep) -> None:
        """Sample a step launched with constrained rows (``pending.masked``): fill each grammar's
        mask on the host (its tokens so far are all accepted by now: the caller has collected
        every earlier step of this model), copy the masks over, mask those rows' logits on the
        device, then sample and copy the ids as ``launch`` does; the step takes them over
        (:meth:`PendingStep.sampled`). No-op when the step has no masks pending. The forward
        pass runs on the GPU meanwhile."""
        m = pending.masked
        if m is None:
            return
        t0 = time.perf_counter()
        ctx = torch.cuda.stream(m.stream) if m.stream is not None else contextlib.nullcontext()
        with ctx, torch.inference_mode():
            apply_logit_rules(m.logits, m.ruled, self.model.cfg.eos_token_ids)
            if not m.rows:
                pending.sampled(self._sample(m.out, m.entries, m.logits, None, m.graph, t0))
                return
            n, vocab = len(m.rows), m.logits.shape[1]
            words = -(-vocab // 32)
            self._mask_flip ^= 1
            if self._mask_host[self._mask_flip] is None or self._mask_host[self._mask_flip].shape[1] != words:
                self._mask_host[self._mask_flip] = torch.empty((self.max_seqs, words), dtype=torch.int32,
                                                               pin_memory=self._pin)
            host = self._mask_host[self._mask_flip][:n]
            todo = []
            for j, (_, g) in enumerate(m.rows):
                if g.finished:  # ended by the step before: its row is dropped, any mask will do
                    host[j].fill_(-1)
                else:
                    todo.append((g, j))
            self.mask_seconds += fill_masks(todo, host.data_ptr(), words * 4, n)
            self.masked_rows += n
            self.masked_steps += 1
            idx = to_device_async(np.fromiter((k for k, _ in m.rows), np.int64, n), self.device)
            mask = host.to(self.device, non_blocking=True)
            sub = m.logits.index_select(0, idx)
            kernels.apply_token_bitmask(sub, mask)
            m.logits.index_copy_(0, idx, sub)
            pending.sampled(self._sample(m.out, m.entries, m.logits, None, m.graph, t0))

    def _sample(self, out: SchedulerOutput, entries: list[int], logits: torch.Tensor, ids: torch.Tensor | None,
                graph: bool, t0: float) -> PendingStep:
        """Sample the rows of ``entries`` (``ids``: a graph's greedy picks, when it made them),
        keep the ids for the next step's placeholders, start their copy to the host."""
        params = [out.seqs[i].params for i in entries]
        if not all(p.temperature == 0 for p in params):
            a, n = self.bufs.sampling, len(params)
            f32, i64 = np.float32, np.int64
            temperature = a.stage("temperature", np.fromiter((p.temperature for p in params), f32, n))
            top_p = a.stage("top_p", np.fromiter((p.top_p for p in params), f32, n))
            min_p = a.stage("min_p", np.fromiter((p.min_p for p in params), f32, n))
            top_k = a.stage("top_k", np.fromiter((p.top_k for p in params), i64, n))
            seed = a.stage("seed", np.fromiter((p.seed or 0 for p in params), i64, n))
            step = a.stage("step", np.fromiter((out.seqs[i].output_step for i in entries), i64, n))
            a.upload()
            ids = kernels.sample(logits, temperature, top_k, top_p, min_p, seed, step)
        elif ids is None:
            ids = logits.argmax(dim=-1)
        # the next step, scheduled before this one's ids reach the host, reads them from here
        self._prev_ids = ids
        self._prev_rows = {out.seqs[i].seq_id: k for k, i in enumerate(entries)}
        want_lp = [p.logprobs for p in params]
        if any(n is not None for n in want_lp):
            self._spent(t0, graph)
            return PendingStep.with_logprobs(ids, logits, want_lp)
        host = ready = None
        if self._pin:
            self._flip ^= 1
            host = self._ids_host[self._flip][:len(params)]
            host.copy_(ids, non_blocking=True)
            ready = self._ids_ready[self._flip]
            ready.record()
        self._spent(t0, graph)
        return PendingStep.copying(len(params), ids, host, ready)

    def collect(self, pending: PendingStep) -> StepResult:
        """Wait for a launched step's ids (the step's only host sync) and return them; a step
        still waiting for its masks is sampled first."""
        if pending.num_sampled == 0:
            return StepResult([], [])
        self.sample_masked(pending)
        t0 = time.perf_counter()
        try:
            if pending.want_logprobs is not None:
                with self._on_last():
                    return logprobs_result(pending.logits, pending.ids, pending.want_logprobs)
            if pending.ready is not None:
                pending.ready.synchronize()
                return StepResult(pending.ids_host.tolist(), [None] * pending.num_sampled)
            return StepResult(pending.ids.tolist(), [None] * pending.num_sampled)
        finally:
            self.wait_seconds += time.perf_counter() - t0

    def execute(self, out: SchedulerOutput, urgent: bool = False, eager: bool = False) -> StepResult:
        """Run a batch to its end (synchronous steps; ``urgent``, ``eager``: as :meth:`launch`
        takes them): a step that samples nothing is waited for too, since its collect returns at
        once, and its model's pages freed next may go to another model's step at once
        (engine/kv/page_pool.py holds them only behind launched steps)."""
        if not out.seqs:
            return StepResult([], [])
        pending = self.launch(out, urgent, eager)
        if pending.written is not None:
            pending.written.synchronize()
        return self.collect(pending)
