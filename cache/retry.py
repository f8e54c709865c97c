"""Retry policy for store calls: exponential backoff with full jitter, honouring Retry-After."""

from __future__ import annotations

import random
import threading
from dataclasses import dataclass
from typing import Callable, TypeVar

from cache.errors import Aborted, StoreError

T = TypeVar("T")


@dataclass(frozen=True)
class RetryPolicy:
    attempts: int = 8  # tries per operation (or per download part), the first included
    base_delay: float = 0.25
    max_delay: float = 20.0
    max_retry_after: float = 60.0  # a server asking for longer is capped, not obeyed blindly

    def delay(self, attempt: int, err: StoreError | None = None, rng: random.Random | None = None) -> float:
        """Seconds to wait before try number ``attempt + 1`` (attempt counts from 1)."""
        r = rng or random
        backoff = r.uniform(0, min(self.max_delay, self.base_delay * (2 ** (attempt - 1))))
        if err is not None and err.retry_after is not None:
            return max(backoff, min(err.retry_after, self.max_retry_after))
        return backoff


def call_with_retries(fn: Callable[[], T], policy: RetryPolicy, what: str,
                      on_retry: Callable[[int, StoreError, float], None] | None = None,
                      abort: threading.Event | None = None) -> T:
    """Run ``fn`` (blocking), retrying retryable StoreErrors under ``policy``. ``abort`` set
    (the caller gave up: a cancelled pull, a stopping agent) ends the wait before the next try
    with Aborted, so no thread goes on calling the store for a caller that is gone."""
    abort = abort or threading.Event()
    attempt = 0
    while True:
        attempt += 1
        try:
            return fn()
        except StoreError as e:
            if not e.retryable or attempt >= policy.attempts:
                raise
            d = policy.delay(attempt, e)
            if on_retry:
                on_retry(attempt, e, d)
            if abort.wait(d):
                raise Aborted(f"{what}: cancelled after {attempt} tries ({e})") from None
