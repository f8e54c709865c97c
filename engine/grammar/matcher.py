"""One request's grammar state, and the masks of a step's constrained rows.

The scheduler calls :meth:`RequestGrammar.accept` with every token the request gets (the stop
decision: a grammar that can go no further ends the request), the runner calls :func:`fill_masks`
for the rows it samples. Torch-free: masks are written through a pointer into the runner's
pinned buffer (bit ``t`` of row ``r`` set = token ``t`` allowed), by llguidance's own threads,
without the GIL, while the GPU runs the step's forward pass.
"""

from __future__ import annotations

import threading
import time

# Threads that fill a step's masks side by side; a mask is tens of microseconds, so a few are
# plenty for hundreds of constrained rows.
MASK_THREADS = 4

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

    __slots__ = ("matcher", "rejected")

    def __init__(self, matcher) -> None:
        self.matcher = matcher
        self.rejected = False

    def accept(self, token: int) -> bool:
        """Advance by one sampled token; False when the grammar refuses it (a bug upstream: the
        mask allowed it) and from then on, which ends the request."""
        if self.rejected:
            return False
        if not self.matcher.consume_token(int(token)):
            self.rejected = True
        return not self.rejected

    @property
    def finished(self) -> bool:
        """Nothing but the end may follow (the value is complete), or the grammar failed."""
        return self.rejected or self.matcher.is_stopped()


def fill_masks(rows: list[tuple[RequestGrammar, int]], ptr: int, row_bytes: int, num_rows: int) -> float:
    """Write each grammar's next-token mask into row ``r`` of the int32 buffer at ``ptr``
    (``num_rows`` rows of ``row_bytes``); returns the seconds it took."""
    t0 = time.perf_counter()
    if rows:
        _shared_executor().unsafe_compute_mask_ptr([(g.matcher, r) for g, r in rows], ptr, row_bytes, num_rows)
    return time.perf_counter() - t0
