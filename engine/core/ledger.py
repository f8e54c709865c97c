"""MemoryLedger: the GPU budget of the engine worker, split into what each loaded model holds.

Every byte the engine puts on the device is booked here first:

- **weights** of each model, exact (the sum of the tensors the loader will create);
- **workspace** of each model, what it holds while loaded (its CUDA-graph pools, the runner's
  buffers, its streams' library workspaces, room for its sampler's buffers): booked from an
  estimate at load and replaced by what the caller measured after the warm-up. A sum over
  models: each model's captured graphs keep a private pool;
- **step**: what a step of a loaded model takes on top while it runs (its activations, freed into
  the allocator's cache after), booked once for all models: room for ``STEPS_IN_FLIGHT`` steps
  of the largest, not a sum over models. The engine has at most two steps on the device (the one
  it launches and the one before it, which it collects next), and a step's activations are freed
  when it has been launched; the blocks a finished step leaves cached on its model's streams are
  handed back by the allocator before any allocation fails, and the KV range empties the cache
  before it gives a grow up;
- **KV**: the one shared PagePool (``kv_pool_bytes``), of which each model holds a guaranteed
  minimum (``kv_min``); the part of the pool above the sum of minimums is *elastic*: the pool may
  be shrunk to give it to a model being loaded;
- **untracked**: what the device measurably holds for this process beyond every booking above
  (library workspaces, graph pools larger than measured, allocator fragmentation), set by
  :meth:`MemoryLedger.reconcile` from the device's own figure before each load is decided. The
  books estimate; the device is the truth: a load is decided against the larger of the two.

``check_load`` decides a load before anything touches the GPU and returns a ``LoadPlan`` (which
idle models to evict first and how large the KV pool becomes), or raises ``LoadRefused`` with the
numbers. ``verify_against_allocator`` compares the books with torch's caching allocator.

Bookkeeping only, O(models) at worst; a lock makes each call atomic, so the agent-facing thread
of the worker may read ``snapshot()`` while the engine thread books.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from engine.errors import EngineError

GiB = 1024**3


# Steps on the device at once: EngineCore launches a step behind the one in flight at most, and
# collects that one before it launches another (engine/core/engine_core.py, ``step``).
STEPS_IN_FLIGHT = 2


class LedgerError(EngineError):
    """A bad budget or a booking that breaks the ledger's rules (unknown model, negative bytes)."""


def format_bytes(n: int) -> str:
    """``"12.50 GiB (13421772800 B)"``: readable and exact, for messages people act on."""
    sign = "-" if n < 0 else ""
    n = abs(n)
    for unit, size in (("GiB", GiB), ("MiB", 1024**2), ("KiB", 1024)):
        if n >= size:
            return f"{sign}{n / size:.2f} {unit} ({sign}{n} B)"
    return f"{sign}{n} B"


class LoadRefused(EngineError):
    """A load that does not fit the budget, even after evicting every idle model offered.

    Fields, all bytes: ``needed`` (weights + workspace + minimum KV of the new model), ``free``
    (what the budget has for it now, elastic KV included), ``evictable`` (what evicting
    ``evictable_models`` would add), ``budget``; ``short`` = needed - free - evictable.
    ``evict``: when the engine refuses a load that evicting some of the offered idle models
    would make fit, the least recently used prefix of them that would (else empty).
    """

    def __init__(self, model: str, *, needed: int, free: int, evictable: int, budget: int,
                 evictable_models: tuple[str, ...], parts: Mapping[str, int],
                 evict: tuple[str, ...] = ()) -> None:
        self.model = model
        self.needed = needed
        self.free = free
        self.evictable = evictable
        self.budget = budget
        self.evictable_models = evictable_models
        self.parts = dict(parts)
        self.evict = tuple(evict)
        self.short = needed - free - evictable
        detail = " + ".join(f"{k} {format_bytes(v)}" for k, v in self.parts.items())
        if evictable_models:
            names = ", ".join(evictable_models)
            evict = f"evicting idle {names} would free {format_bytes(evictable)}"
        else:
            evict = "no idle model may be evicted (0 B)"
        if self.evict:
            evict += f"; evicting {', '.join(self.evict)} first makes room"
        super().__init__(
            f"cannot load {model!r}: needs {format_bytes(needed)} ({detail}); "
            f"{format_bytes(free)} free of a {format_bytes(budget)} budget; {evict}; "
            f"short by {format_bytes(self.short)}"
        )


@dataclass(frozen=True)
class LoadPlan:
    """What to do for a load that fits: evict ``evict`` (in order), then book and load.

    ``kv_pool_bytes_after`` is the largest the shared KV pool may be once the model is loaded
    (the budget minus every model's weights and workspace); the engine resizes the pool to
    ``kv_pool_bytes_after // page_bytes`` pages, or leaves it smaller.
    """

    model: str
    weight_bytes: int
    workspace_bytes: int
    min_kv_bytes: int
    step_bytes: int  # its largest step's activations (the step booking: STEPS_IN_FLIGHT x the largest)
    needed: int
    free: int
    evict: tuple[str, ...]
    evict_frees: int
    kv_pool_bytes_after: int


@dataclass(frozen=True)
class LedgerSnapshot:
    """A consistent copy of the books (for stats, metrics and tests)."""

    budget: int
    weights: dict[str, int]
    workspace: dict[str, int]
    kv_min: dict[str, int]
    kv_pool_bytes: int
    used: int  # weights + workspace + step + the whole KV pool + untracked: what is on the device
    free: int  # budget - used
    untracked: int = 0  # measured device bytes no booking explains (reconcile)
    vacant: frozenset[str] = frozenset()  # the entries that are vacancies (engine/core/vacancy.py)
    step: int = 0  # the step booking (STEPS_IN_FLIGHT x the largest step), once for all models


@dataclass(frozen=True)
class AllocatorCheck:
    """The ledger against torch's caching allocator; ``ok`` when the drift is within tolerance."""

    ledger_bytes: int
    allocator_reserved: int | None  # live device bytes; None: no CUDA allocator to compare with
    drift: int  # allocator_reserved - ledger_bytes (0 without CUDA)
    tolerance: int
    ok: bool


@dataclass
class _Model:
    weights: int = 0
    workspace: int = 0
    kv_min: int = 0
    step: int = 0  # its largest step's activations (0 for a vacancy: it takes no steps)
    vacant: bool = False  # an unloaded model's memory kept for the next load (engine/core/vacancy.py)


def _parts(weights: int, workspace: int, step: int, min_kv: int) -> dict[str, int]:
    """A load's bytes for a refusal's message (``step``: what its largest step adds to the step
    booking, shown when it adds anything)."""
    return {"weights": weights, "workspace": workspace, **({"step": step} if step else {}), "min KV": min_kv}


def _nonneg(name: str, value: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise LedgerError(f"{name} must be a non-negative int of bytes, got {value!r}")
    return value


def resolve_budget(budget: int | float, *, device_total: int | None,
                   device_free: int | None = None) -> int:
    """Bytes from a byte count or a fraction in (0, 1] of ``device_total``.

    A budget larger than the device, or than what is free on it when ``device_free`` is given
    (another process holds the rest), is refused: the worker must never plan on memory that is
    not there.
    """
    if isinstance(budget, bool) or not isinstance(budget, (int, float)):
        raise LedgerError(f"memory budget must be bytes or a fraction, got {budget!r}")
    if isinstance(budget, float):
        if not 0 < budget <= 1:
            raise LedgerError(f"a fractional memory budget must be in (0, 1], got {budget!r}")
        if device_total is None:
            raise LedgerError("a fractional memory budget needs the device's total memory; "
                              "on CPU give the budget in bytes")
        nbytes = int(budget * device_total)
    else:
        nbytes = budget
    if nbytes <= 0:
        raise LedgerError(f"memory budget must be > 0 bytes, got {nbytes}")
    if device_total is not None and nbytes > device_total:
        raise LedgerError(f"memory budget {format_bytes(nbytes)} exceeds the device's "
                          f"{format_bytes(device_total)}")
    if device_free is not None and nbytes > device_free:
        raise LedgerError(f"memory budget {format_bytes(nbytes)} exceeds the "
                          f"{format_bytes(device_free)} free on the device (another process "
                          "holds the rest)")
    return nbytes


class MemoryLedger:
    """The worker's GPU budget and who holds what of it.

    ``MemoryLedger(budget, device="cuda:0")`` resolves a fractional budget with
    ``torch.cuda.mem_get_info``; on CPU the budget is bytes. ``device_total``/``device_free``
    may be given instead of querying the device (tests, or a caller that already knows).
    """

    def __init__(self, budget: int | float, *, device: str = "cpu",
                 device_total: int | None = None, device_free: int | None = None) -> None:
        self.device = str(device)
        if self.device.startswith("cuda") and device_total is None:
            import torch  # only here and in verify: the ledger is otherwise torch-free

            device_free, device_total = torch.cuda.mem_get_info(torch.device(self.device))
        self.budget = resolve_budget(budget, device_total=device_total, device_free=device_free)
        self._models: dict[str, _Model] = {}
        self._kv_pool = 0
        self._untracked = 0
        self._lock = threading.Lock()

    # -- totals (call with the lock held) ---------------------------------------------------------
    def _largest_step(self, without: Iterable[str] = ()) -> int:
        return max((m.step for n, m in self._models.items() if n not in without), default=0)

    def _step(self, without: Iterable[str] = ()) -> int:
        """The step booking: room for the steps in flight, each the largest of the models (less
        ``without``)."""
        return STEPS_IN_FLIGHT * self._largest_step(without)

    def _step_more(self, step_bytes: int, without: Iterable[str] = ()) -> int:
        """What the step booking grows by when a model whose largest step is ``step_bytes`` joins."""
        return STEPS_IN_FLIGHT * max(0, step_bytes - self._largest_step(without))

    def _net_frees(self, names: Iterable[str], step_bytes: int) -> int:
        """What evicting ``names`` adds to the room of a load whose step is ``step_bytes``: their
        weights, workspace and KV minimums, and what the step booking drops without them, less
        what the load's step then adds to it."""
        names = list(names)
        return (self._committed() - self._committed(names)
                - (self._step_more(step_bytes, names) - self._step_more(step_bytes)))

    def net_frees(self, names: Iterable[str], step_bytes: int = 0) -> int:
        """:meth:`_net_frees`: a refusal's ``evictable``."""
        with self._lock:
            return self._net_frees(names, step_bytes)

    def step_more(self, step_bytes: int) -> int:
        """:meth:`_step_more` against the models booked now (what a load's step adds to the books)."""
        with self._lock:
            return self._step_more(step_bytes)

    def _non_kv(self, without: Iterable[str] = ()) -> int:
        without = set(without)
        return (sum(m.weights + m.workspace for n, m in self._models.items() if n not in without)
                + self._step(without) + self._untracked)

    def _committed(self, without: Iterable[str] = ()) -> int:
        """Bytes nobody else may take: weights, workspace, every guaranteed KV minimum, the step
        booking and what the device holds beyond the books. Not vacancies: a load that needs
        their room drops them before it books (engine/core/vacancy.py)."""
        without = set(without)
        return (sum(m.weights + m.workspace + m.kv_min for n, m in self._models.items()
                    if not m.vacant and n not in without) + self._step(without) + self._untracked)

    # -- the device's own figure ------------------------------------------------------------------
    def reconcile(self, held_bytes: int) -> int:
        """Take the device's figure of what this process holds now (``held_bytes``: beyond the
        start-up baseline, cached free memory the allocator can hand back excluded) as the
        truth: whatever of it no booking explains becomes ``untracked`` and is charged like a
        model's bytes until the next reconcile. Returns the untracked bytes."""
        _nonneg("held_bytes", held_bytes)
        with self._lock:
            # Not the step booking: a finished step's activations are cached free blocks, which
            # ``held_bytes`` leaves out; counted here they would hide a workspace larger than booked.
            booked = sum(m.weights + m.workspace for m in self._models.values()) + self._kv_pool
            self._untracked = max(0, held_bytes - booked)
            return self._untracked

    def _used(self) -> int:
        return self._non_kv() + self._kv_pool

    # -- deciding ---------------------------------------------------------------------------------
    def check_load(self, model: str, weight_bytes: int, workspace_estimate: int, min_kv_bytes: int,
                   evictable: Iterable[str] = (), *, step_bytes: int = 0) -> LoadPlan:
        """Decide a load without touching the GPU.

        ``step_bytes``: the activations of its largest step, which need room only where they
        exceed the largest of the models that stay (the step booking grows by twice that). ``evictable``: idle,
        unpinned, loaded models the caller is willing to evict, least recently used first; the
        plan evicts the shortest prefix that makes room. Raises ``LoadRefused`` when even
        evicting all of them is not enough, and ``LedgerError`` when ``model`` is already booked.
        """
        _nonneg("weight_bytes", weight_bytes)
        _nonneg("workspace_estimate", workspace_estimate)
        _nonneg("min_kv_bytes", min_kv_bytes)
        _nonneg("step_bytes", step_bytes)
        with self._lock:
            if model in self._models:
                raise LedgerError(f"model {model!r} is already booked in the ledger")
            candidates: list[str] = []
            for name in dict.fromkeys(evictable):  # dedupe, keep LRU order
                m = self._models.get(name)
                if m is None or m.vacant:
                    raise LedgerError(f"evictable model {name!r} is not booked in the ledger")
                candidates.append(name)

            def needed_free(evict: list[str]) -> tuple[int, int]:  # with ``evict`` gone
                return (weight_bytes + workspace_estimate + min_kv_bytes + self._step_more(step_bytes, evict),
                        self.budget - self._committed(evict))

            needed, free = needed_free([])
            evict: list[str] = []
            need_after, free_after = needed, free
            while free_after < need_after and len(evict) < len(candidates):
                evict.append(candidates[len(evict)])
                need_after, free_after = needed_free(evict)
            if free_after < need_after:
                raise LoadRefused(
                    model, needed=needed, free=free, evictable=self._net_frees(candidates, step_bytes),
                    budget=self.budget, evictable_models=tuple(candidates),
                    parts=_parts(weight_bytes, workspace_estimate, needed - weight_bytes - workspace_estimate - min_kv_bytes,
                                 min_kv_bytes))
            pool_after = (self.budget - self._non_kv(evict) - weight_bytes - workspace_estimate
                          - self._step_more(step_bytes, evict))
            return LoadPlan(model=model, weight_bytes=weight_bytes,
                            workspace_bytes=workspace_estimate, min_kv_bytes=min_kv_bytes, step_bytes=step_bytes,
                            needed=needed, free=free, evict=tuple(evict), evict_frees=free_after - free,
                            kv_pool_bytes_after=pool_after)

    # -- booking ----------------------------------------------------------------------------------
    def reserve_weights(self, model: str, nbytes: int, *, workspace_estimate: int = 0,
                        min_kv_bytes: int = 0, step_bytes: int = 0) -> None:
        """Book a model's exact weight bytes (and its workspace estimate, KV minimum and largest
        step) before the first weight is copied. Raises ``LoadRefused`` if it does not fit any more
        (another booking happened since ``check_load``), ``LedgerError`` if the KV pool was not
        shrunk to the plan's size first; nothing is booked then."""
        _nonneg("nbytes", nbytes)
        _nonneg("workspace_estimate", workspace_estimate)
        _nonneg("min_kv_bytes", min_kv_bytes)
        _nonneg("step_bytes", step_bytes)
        with self._lock:
            if model in self._models:
                raise LedgerError(f"model {model!r} is already booked in the ledger")
            step_more = self._step_more(step_bytes)
            needed = nbytes + workspace_estimate + min_kv_bytes + step_more
            free = self.budget - self._committed()
            if needed > free:
                raise LoadRefused(model, needed=needed, free=free, evictable=0,
                                  budget=self.budget, evictable_models=(),
                                  parts=_parts(nbytes, workspace_estimate, step_more, min_kv_bytes))
            # It fits the budget, but the weights must also fit beside the pool as it is now,
            # or the copy would run out of memory: the caller shrinks the pool first.
            beside_pool = self.budget - self._used()
            if nbytes + workspace_estimate + step_more > beside_pool:
                target = self._kv_pool - (nbytes + workspace_estimate + step_more - beside_pool)
                raise LedgerError(
                    f"shrink the KV pool to {format_bytes(target)} before booking {model!r}: "
                    f"its weights and workspace need {format_bytes(nbytes + workspace_estimate + step_more)}, "
                    f"{format_bytes(beside_pool)} is left beside the pool")
            self._models[model] = _Model(weights=nbytes, workspace=workspace_estimate,
                                         kv_min=min_kv_bytes, step=step_bytes)

    def record_workspace(self, model: str, nbytes: int, step_bytes: int = 0) -> int:
        """Replace the workspace estimate with what was measured after the warm-up (and the
        largest step's activations with theirs); returns the change of what is booked (positive:
        the estimate was low). The memory is already in use, so this never refuses; a low
        estimate shows up as a smaller ``free`` and in ``verify``."""
        _nonneg("nbytes", nbytes)
        _nonneg("step_bytes", step_bytes)
        with self._lock:
            m = self._get(model)
            before = m.workspace + self._step()
            m.workspace, m.step = nbytes, step_bytes
            return m.workspace + self._step() - before

    def set_kv_minimum(self, model: str, nbytes: int) -> None:
        """The KV bytes guaranteed to ``model`` (its PagePool minimum × page bytes)."""
        _nonneg("nbytes", nbytes)
        with self._lock:
            m = self._get(model)
            others = self._committed() - m.kv_min
            if others + nbytes > self.budget:
                raise LedgerError(f"a KV minimum of {format_bytes(nbytes)} for {model!r} exceeds "
                                  f"the budget's {format_bytes(self.budget - others)} left")
            m.kv_min = nbytes

    def set_kv_pool(self, nbytes: int) -> None:
        """Book the shared KV pool's size (call before allocating a larger pool). It must hold
        every model's minimum and fit beside all weights and workspace."""
        _nonneg("nbytes", nbytes)
        with self._lock:
            kv_min = sum(m.kv_min for m in self._models.values())
            room = self.budget - self._non_kv()
            if nbytes > room:
                raise LedgerError(f"a KV pool of {format_bytes(nbytes)} does not fit: "
                                  f"{format_bytes(room)} left beside weights and workspace")
            if nbytes < kv_min:
                raise LedgerError(f"a KV pool of {format_bytes(nbytes)} cannot hold the models' "
                                  f"guaranteed minimums ({format_bytes(kv_min)})")
            self._kv_pool = nbytes

    def vacate(self, model: str, as_name: str) -> None:
        """A model unloaded whose memory stays for the next load (engine/core/vacancy.py): its
        weights and workspace booked on under ``as_name``, flagged vacant (held on the device, in
        ``used`` and beside the pool; ``room`` to a load, which drops it first if it needs it),
        its KV minimum released."""
        with self._lock:
            if as_name in self._models:
                raise LedgerError(f"{as_name!r} is already booked in the ledger")
            m = self._get(model)
            del self._models[model]
            self._models[as_name] = _Model(weights=m.weights, workspace=m.workspace, vacant=True)  # no steps

    def release(self, model: str) -> int:
        """Forget a model (after its weights and pages are freed); returns the bytes released
        from weights, workspace and its KV minimum. The pool keeps its size until resized."""
        with self._lock:
            m = self._models.pop(model, None)
            if m is None:
                raise LedgerError(f"model {model!r} is not booked in the ledger")
            return m.weights + m.workspace + m.kv_min

    # -- reading ----------------------------------------------------------------------------------
    def __contains__(self, model: object) -> bool:
        with self._lock:
            return model in self._models

    def model_bytes(self, model: str) -> int:
        """Weights + workspace of ``model`` (its KV lives in the shared pool)."""
        with self._lock:
            m = self._get(model)
            return m.weights + m.workspace

    def room(self) -> int:
        """Bytes a load may take without evicting anyone: the budget less every model's weights,
        workspace and guaranteed KV, and what the device holds beyond the books."""
        with self._lock:
            return self.budget - self._committed()

    def snapshot(self) -> LedgerSnapshot:
        with self._lock:
            used = self._used()
            return LedgerSnapshot(
                budget=self.budget,
                weights={n: m.weights for n, m in self._models.items()},
                workspace={n: m.workspace for n, m in self._models.items()},
                kv_min={n: m.kv_min for n, m in self._models.items()},
                kv_pool_bytes=self._kv_pool, used=used, free=self.budget - used,
                untracked=self._untracked, vacant=frozenset(n for n, m in self._models.items() if m.vacant),
                step=self._step())

    def verify_against_allocator(self, *, tolerance: int = 256 * 1024**2,
                                 reserved_bytes: int | None = None) -> AllocatorCheck:
        """Compare the books with the bytes of live tensors, ``torch.cuda.memory_allocated`` (or
        ``reserved_bytes``, a figure the caller has).

        Live bytes above booked + ``tolerance`` mean something on the device is not in the
        ledger (a leak, or a workspace estimate that was never replaced by a measurement); that
        is the only direction that can lead to out-of-memory, so it alone makes ``ok`` false.
        The allocator's cached free segments are not counted: the engine keeps them on purpose
        (a reload takes them back instead of waiting for fresh memory), and the allocator
        releases them by itself when a request needs the room. Without CUDA and without
        ``reserved_bytes`` there is nothing to compare: ``allocator_reserved`` is None and ``ok``
        is true.
        """
        _nonneg("tolerance", tolerance)
        if reserved_bytes is None and self.device.startswith("cuda"):
            import torch

            reserved_bytes = int(torch.cuda.memory_allocated(torch.device(self.device)))
        with self._lock:
            ledger_bytes = self._used()
        if reserved_bytes is None:
            return AllocatorCheck(ledger_bytes, None, 0, tolerance, True)
        drift = reserved_bytes - ledger_bytes
        return AllocatorCheck(ledger_bytes, reserved_bytes, drift, tolerance, drift <= tolerance)

    def _get(self, model: str) -> _Model:
        try:
            return self._models[model]
        except KeyError:
            raise LedgerError(f"model {model!r} is not booked in the ledger") from None
