"""One request's grammar state, and the masks of a step's constrained rows.

The scheduler calls :meth:`RequestGrammar.accept` with every token the request gets (the stop
decision: a grammar that can go no further ends the request), the runner calls :func:`fill_masks`
for the rows it samples. Torch-free: masks are written through a pointer into the runner's
pinned buffer (bit ``t`` of row ``r`` set = token ``t`` allowed), by llguidance's own threads,
without the GIL, while the GPU runs the step's forward pass.

Masks have a budget, so that a grammar costly to mask with (a long literal, a long counted
repetition: 15 ms a step for a 60,000-character ``const``) slows only its own request, briefly:
a request's mask may take ``MASK_ROW_BUDGET_S`` a step, and once its masks have gone over that by
``MASK_EXCESS_S`` in all, its grammar fails (``error``) and the request ends with that error. The
step's rows are filled together by llguidance's threads; when that batch takes longer than its
budget, its rows are watched: each is filled and timed on its own the next step, and those found
within the budget go back to the batch. The agent refuses most such schemas before they come
(agent/http/structured.py ``schema_bounds``); this is what holds for the rest.
"""

from __future__ import annotations

import threading
import time

# Threads that fill a step's masks side by side; a mask is tens of microseconds, so a few are
# plenty for hundreds of constrained rows.
MASK_THREADS = 4
# A constrained row's mask time a step (a typical mask is 20-50 µs, a fresh grammar's first one up
# to ~2 ms), and how far over it one request's masks may go in all before its grammar fails.
MASK_ROW_BUDGET_S = 0.002
MASK_EXCESS_S = 0.05

_executor = None
_executor_lock = threading.Lock()


def _shared_executor():
    global _executor
    with _executor_lock:
        if _executor is None:
            import llguidance

            _executor = llguidance.LLExecutor(num_threads=MASK_THREADS)
        return _executor


class RequestGrammar:
    """A compiled matcher advanced by the request's tokens (a copy of the compiler's)."""

    __slots__ = ("matcher", "watched", "mask_excess", "error")

    def __init__(self, matcher) -> None:
        self.matcher = matcher
        self.watched = False  # filled and timed on its own (its batch went over budget)
        self.mask_excess = 0.0  # seconds its masks took beyond MASK_ROW_BUDGET_S a step
        self.error: str | None = None  # the grammar failed: the request ends with this error

    def accept(self, token: int) -> bool:
        """Advance by one sampled token; False, with ``error`` set, when the grammar refuses it.
        The mask allowed only tokens it takes, so a refusal, or a matcher in error (whose
        mask allows the end of text alone, and which then takes it), means the grammar had no
        way on: a schema with no finite value that the agent's check did not prove, llguidance's
        own failure. The answer so far is not a value, so the request ends with an error, never
        as a finished answer."""
        if self.error is not None:
            return False
        if not self.matcher.consume_token(int(token)) or self.matcher.is_error():
            self.error = ("the response format allows no further token: its grammar has no way to "
                          "complete the value (a schema no finite value satisfies?)")
        return self.error is None

    @property
    def finished(self) -> bool:
        """Nothing but the end may follow (the value is complete), or the grammar failed."""
        return self.error is not None or self.matcher.is_stopped()

    def _charge(self, seconds: float) -> None:
        """Book one step's mask time; a request over its budget gets ``error``."""
        over = seconds - MASK_ROW_BUDGET_S
        if over <= 0:
            self.watched = False
            return
        self.mask_excess += over
        if self.mask_excess > MASK_EXCESS_S and self.error is None:
            self.error = (f"the response format is too costly to enforce: its token masks took over "
                          f"{MASK_ROW_BUDGET_S * 1e3:g} ms a step, {self.mask_excess * 1e3:.0f} ms beyond that in all")


def fill_masks(rows: list[tuple[RequestGrammar, int]], ptr: int, row_bytes: int, num_rows: int) -> float:
    """Write each grammar's next-token mask into row ``r`` of the int32 buffer at ``ptr``
    (``num_rows`` rows of ``row_bytes``), within the mask budget (see the module); returns the
    seconds it took."""
    t0 = time.perf_counter()
    watched = [(g, r) for g, r in rows if g.watched]
    batch = [(g, r) for g, r in rows if not g.watched]
    if batch:
        _shared_executor().unsafe_compute_mask_ptr([(g.matcher, r) for g, r in batch], ptr, row_bytes, num_rows)
        dt = time.perf_counter() - t0
        # over the batch's budget (its threads share the rows): a lone row is charged, several
        # are watched (each timed on its own next step) to find the costly ones
        if len(batch) == 1:
            batch[0][0]._charge(dt)
            batch[0][0].watched = dt > MASK_ROW_BUDGET_S
        elif dt > MASK_ROW_BUDGET_S * max(1.0, len(batch) / MASK_THREADS):
            for g, _ in batch:
                g.watched = True
    for g, r in watched:
        t1 = time.perf_counter()
        g.matcher.unsafe_compute_mask_ptr(ptr + r * row_bytes, row_bytes)
        g._charge(time.perf_counter() - t1)
    return time.perf_counter() - t0
