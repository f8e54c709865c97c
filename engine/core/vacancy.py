"""Vacancy: an unloaded model's device memory and runner, kept for the next load of its kind.

Why it exists: on a node serving many models of one architecture (fine-tunes of one base, or one
checkpoint under several names), most swaps replace a model by another that computes the same
thing at the same shape. Such a swap used to free the leaving model (its weights, step buffers
and graph pools back to the driver: ``return_device_memory``, ~0.1-0.17 s with the cycle
collection) and build the arriving one from nothing: its tensors allocated, its runner built and
its graphs captured on the stepping thread (0.2-0.4 s of an 8B's 0.8-1.2 s engine load on the
H100, docs/perf.md 2026-12-06, every other model's steps waiting behind it). Its weights alone
take ~0.5 s from the page cache and ~0.3 s from the warm tier.

Kept instead, the arriving model is copied into the leaving one's weight tensors, and the runner
over them serves it as it is: CUDA graphs record the addresses of the weights, the KV pool and
the step buffers, never their values (the reason a runner may be built beside half-copied
weights, engine/runner/prebuild.py). "The same thing at the same shape" is the load notes' key
pair: ``workspace_key`` (the configuration and the weights' format on the device) and the load's
shape (dtype, limits, context, page geometry, graph buckets), which decide every tensor's shape
and every kernel launch. The rope table depends only on those, so it is kept too.

Rules (PoolKeeper applies them):
- Kept at an unload of a model on the shared pool that has a runner (not an eager stand-in for
  failed captures); its pages go back to the pool and its KV minimum out of the books, its
  weights and workspace stay booked under the vacancy's own ledger name, flagged vacant: held
  on the device (in ``used``, beside the pool), but ``room`` to a load.
- A load claims the vacancy of its key and shape, if any (its books given up just after the
  device's figure is taken, so the load books the same bytes in their place); the other
  vacancies stay while the load fits beside them with the pool as it is (two loads draining for
  room each take their own victim's) and all go, memory back to the driver, when it needs their
  room; at most ``VACANCIES_MAX`` are kept.
- A load shrinks the pool only when its weights need the room (a resize rebuilds every runner);
  a pool resize since a vacancy was kept leaves its runner stale: the runner goes at the resize
  (its KV views must), the weight tensors stay, and the load that claims it builds a runner.
- The pool's growth after quiet drops every vacancy first: memory nobody loads into is the pool's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from engine.core.memory_plan import Workspace

# A vacancy's name in the ledger: never a model's (a model name has no NUL).
VACANT_PREFIX = "\0vacant:"

# Vacancies on the device at most (the oldest goes first): two loads drain for room at once
# (agent/manager/manager.py, DRAINING_LOADS_MAX) and each takes its own victim's; more would only
# hold room the pool could grow into, on a node too busy for the pool's quiet growth.
VACANCIES_MAX = 2


@dataclass
class Vacancy:
    """What an unloaded model left on the device for the next load of ``compute_key`` at ``shape``."""

    book: str  # its name in the ledger (VACANT_PREFIX + the model's)
    compute_key: str
    shape: str
    model: Any  # the LlamaModel: its weight tensors and rope table
    kv: Any  # the KV views its runner was built on (None once stale)
    runner: Any  # the ModelRunner and its graphs (None once stale)
    generation: int  # the pool's generation the runner was built on
    workspace: Workspace  # measured for this computation at this shape: the claimer books it
    landing: Any = None  # the warm tier's copies from its weights, in flight (WarmTier.put_async)
