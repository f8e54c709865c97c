"""Start, talk to and supervise the engine worker process.

The agent owns one :class:`WorkerClient`. It spawns ``python -m engine.worker`` with one end of
a unix socketpair, reads frames on the other, and routes each request's outputs to that
request's :class:`EngineRequest` queue. The worker's death is seen at once (EOF on the socket
and the process exit): every in-flight request gets a :class:`WorkerDied` in its queue, pending
loads fail, ``on_down`` runs, and the worker is started again with exponential backoff;
``on_up`` then runs so the model manager can reload what was loaded.
"""

from __future__ import annotations

import asyncio
import subprocess
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from agent.log import get_logger
from agent.worker.mailbox import Mailbox
from agent.worker.spawn import Spawned, forget_worker, spawn_worker
from cache.triton_cache import sweep_triton_cache, triton_cache_dir
from engine.load_spec import LoadSpec
from engine.sampling import SamplingParams
from engine.stats import MemoryStats, ModelStats, WarmTierStats
from engine.worker import protocol as P

HELLO_TIMEOUT_S = 120.0  # importing torch and initialising CUDA on a cold node is slow
HEARTBEAT_STALE_S = 3.0
STALL_S = 20.0  # busy with no engine step for this long: wedged (a first-step kernel compile can take a while)
BACKOFF_MIN_S, BACKOFF_MAX_S, STABLE_S = 0.5, 30.0, 60.0


def _discard_spawned(spawned: Spawned) -> None:
    spawned.sock.close()
    spawned.proc.kill()
    spawned.proc.wait()  # killed: at once


def _discard(fut: asyncio.Future[Spawned]) -> None:
    if not fut.cancelled() and fut.exception() is None:
        _discard_spawned(fut.result())


class WorkerError(Exception):
    """The worker refused a command (bad request, load failure); ``code`` is its error type and
    ``details`` its structured figures (a load refused for room: ``code == "no_room"``)."""

    def __init__(self, message: str, code: str = "internal", details: dict[str, Any] | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.details = dict(details or {})


class Preempted(WorkerError):
    """A request's model was preempted for another's room (:meth:`WorkerClient.preempt`): the
    request left the engine and resumes once the model is back (agent/worker/generation.py)."""

    def __init__(self, req_id: str, model: str) -> None:
        super().__init__(f"the model {model!r} was preempted for another model's room", "preempted")
        self.req_id = req_id


class WorkerDied(WorkerError):
    """The worker exited (or is not running) while the command or request was in flight."""

    def __init__(self, message: str) -> None:
        super().__init__(message, code="worker_died")


class OutputSink(Protocol):
    """Where a request's outputs go as the reader gets them, on the loop: a :class:`Mailbox` to
    await, or the request's generation itself (agent/worker/generation.py). Must not raise."""

    def put_nowait(self, item: P.TokenOutput | Exception) -> None: ...


@dataclass
class EngineRequest:
    """One request in the engine: outputs (``TokenOutput``) or a final exception arrive on ``queue``."""

    req_id: str
    model: str
    queue: OutputSink = field(default_factory=Mailbox)
    finished: bool = False
    resumable: bool = False  # its sink takes Preempted and sends it again (Generation)
    tokens_left: int = 0  # its max_tokens less the tokens received: how far it is from its end


@dataclass
class WorkerState:
    pid: int | None = None
    alive: bool = False
    device: str = ""
    engine_error: str = ""
    budget_bytes: int = 0
    started_at: float = 0.0
    last_frame: float = 0.0
    phase: str = "idle"
    phase_seconds: float = 0.0
    steps: int = 0
    busy: bool = False
    last_progress: float = 0.0
    models: dict[str, ModelStats] = field(default_factory=dict)  # the engine's, per model (Status.models)
    memory: MemoryStats | None = None  # the engine's ledger split (Status.memory); None: none known
    warm_tier: WarmTierStats | None = None  # the warm tier's host memory (Status.warm_tier); None: none
    # Models loaded or unloaded since the last Status: their rows there describe the load before
    # (a model's own view reads its Loaded info instead until the next Status).
    stale_models: set[str] = field(default_factory=set)
    restarts: int = 0
    last_exit: str = ""
    # This worker's start (monotonic): the exec asked for, the exec done, Hello received; and the
    # worker's own phases from Hello.startup, (name, start_s, seconds) since its exec.
    spawn_at: float = 0.0
    spawned_at: float = 0.0
    hello_at: float = 0.0
    startup: list[tuple[str, float, float]] = field(default_factory=list)


Hook = Callable[[], Awaitable[None]]


class WorkerClient:
    def __init__(
        self,
        options: dict[str, Any],
        *,
        engine: str = "core",
        env: dict[str, str] | None = None,
        on_up: Hook | None = None,
        on_down: Hook | None = None,
        on_restart: Callable[[], None] | None = None,
        first: Spawned | None = None,
        hang_timeout_s: float | None = None,
    ) -> None:
        """``first``: a worker already started with ``spawn_worker`` (the serve command's, before
        its event loop existed), supervised as the first one. ``hang_timeout_s``: a worker that
        sent no frame for this long (its heartbeat thread writes one every 0.5 s whatever the
        main loop does, so a long step or load is not a hang) is killed and replaced
        (``server.worker_hang_timeout``; None: never, for tools that drive a worker by hand)."""
        self.options = options
        self.engine = engine
        self.env = env  # the worker's environment (None: the agent's)
        self.on_up = on_up
        self.on_down = on_down
        self.on_restart = on_restart
        self.hang_timeout_s = hang_timeout_s
        self.hangs = 0  # workers killed for silence
        self.state = WorkerState()
        self.last_decode: dict[str, float] = {}
        self.load_timings: dict[str, dict[str, float]] = {}  # each model's last load, by phase (Loaded.timings)
        self._log = get_logger("worker_client")
        self._first = first
        self._proc: subprocess.Popen | None = None
        self._exited: asyncio.Future[int] | None = None  # the current process's exit status, once it exits
        self._swept: asyncio.Future[None] | None = None  # the current worker's kernel sweep (loads wait on it)
        self._writer: asyncio.StreamWriter | None = None
        self._streams: dict[str, EngineRequest] = {}
        self._pending: dict[tuple[str, str], asyncio.Future[Any]] = {}
        self._aborts: list[str] = []
        self._hello: asyncio.Future[P.Hello] | None = None
        self._supervisor: asyncio.Task[None] | None = None
        self._stopping = False
        self._kill_reason = ""  # why the agent killed the current worker, for its exit's message
        self._spawned = asyncio.Event()  # the first worker process exists
        self._up = asyncio.Event()  # set while a worker is alive (said Hello, not exited)

    async def wait_alive(self, timeout: float) -> bool:
        """Wait (at most ``timeout`` seconds) until a worker is alive; whether one is."""
        try:
            await asyncio.wait_for(self._up.wait(), timeout)
        except asyncio.TimeoutError:
            pass
        return self.alive

    async def spawned(self) -> None:
        """Return once the first worker process was started (or supervision ended before that)."""
        if self._supervisor is None:
            raise RuntimeError("start() the client first")
        await asyncio.wait([asyncio.ensure_future(self._spawned.wait()), self._supervisor],
                           return_when=asyncio.FIRST_COMPLETED)

    # --- lifecycle --------------------------------------------------------------------------

    async def start(self, wait: bool = True) -> None:
        """Start supervising (once: a second call only waits); with ``wait``, return once the
        first worker said Hello."""
        if self._supervisor is None:
            self._supervisor = asyncio.create_task(self._supervise(), name="worker-supervisor")
        if wait:
            await asyncio.wait(
                [asyncio.ensure_future(self._up.wait()), self._supervisor],
                return_when=asyncio.FIRST_COMPLETED,
            )

    async def stop(self, timeout: float = 10.0) -> None:
        """Ask the worker to exit, kill it after ``timeout``, and stop supervising."""
        self._stopping = True
        if self._first is not None:  # never supervised (stopped before the supervisor ran)
            _discard_spawned(self._first)
            forget_worker(self.options, self._first.proc.pid)
            self._first = None
        proc, exited = self._proc, self._exited
        if proc is not None and exited is not None and not exited.done():
            try:
                self._send(P.Shutdown())
            except WorkerDied:
                proc.terminate()  # not talking yet (still starting): nothing to finish cleanly
            try:
                await asyncio.wait_for(asyncio.shield(exited), timeout)
            except asyncio.TimeoutError:
                proc.kill()
                await exited
        if proc is not None:  # gone now, or already (a restart was pending)
            forget_worker(self.options, proc.pid)
        if self._supervisor is not None:
            self._supervisor.cancel()
            try:
                await self._supervisor
            except (asyncio.CancelledError, Exception):
                pass
        self._fail_all("the agent is shutting down")

    async def _supervise(self) -> None:
        delay = BACKOFF_MIN_S
        while not self._stopping:
            started = time.monotonic()
            try:
                await self._run_once()
            except asyncio.CancelledError:
                raise
            except Exception as e:  # keep supervising whatever went wrong with one worker
                self._log.error("worker_failed", error=f"{type(e).__name__}: {e}")
            if self._stopping:
                return
            if time.monotonic() - started > STABLE_S:
                delay = BACKOFF_MIN_S
            self._log.warning("worker_restart_scheduled", delay_s=delay, last_exit=self.state.last_exit)
            await asyncio.sleep(delay)
            delay = min(delay * 2, BACKOFF_MAX_S)
            self.state.restarts += 1
            if self.on_restart:
                self.on_restart()

    async def _run_once(self) -> None:
        spawned, self._first = self._first, None
        if spawned is None:
            spawning = asyncio.ensure_future(asyncio.to_thread(spawn_worker, self.options, self.engine, self.env))
            try:
                spawned = await asyncio.shield(spawning)
            except asyncio.CancelledError:  # stopped while it waits for a previous worker: ours must not outlive us
                spawning.add_done_callback(_discard)
                raise
        for event, fields in spawned.notes:
            self._log.warning(event, **fields)
        proc = self._proc = spawned.proc
        self._exited = asyncio.ensure_future(asyncio.to_thread(proc.wait))
        self._spawned.set()
        self._swept = asyncio.ensure_future(self._sweep_kernels())
        reader, self._writer = await asyncio.open_unix_connection(sock=spawned.sock)
        self.state = WorkerState(pid=proc.pid, started_at=time.monotonic(), restarts=self.state.restarts,
                                 spawn_at=spawned.spawn_at, spawned_at=spawned.spawned_at)
        self._hello = asyncio.get_running_loop().create_future()
        read_task = asyncio.create_task(self._read_loop(reader), name="worker-reader")
        up_task: asyncio.Task[None] | None = None
        try:
            hello = await asyncio.wait_for(asyncio.shield(self._hello), HELLO_TIMEOUT_S)
            self.state.alive = True
            self.state.device, self.state.engine_error = hello.device, hello.engine_error
            self.state.budget_bytes = hello.budget_bytes
            self.state.last_frame = self.state.last_progress = time.monotonic()
            self._log.info("worker_up", pid=hello.pid, device=hello.device, engine_error=hello.engine_error or None)
            self._up.set()
            if self.on_up:
                up_task = asyncio.create_task(self.on_up(), name="worker-on-up")
            # Either the socket closing or the process exiting means the worker is gone; a worker
            # silent past the bound is killed (then it exits like any other).
            watch = asyncio.create_task(self._watch_hang(proc), name="worker-hang-watch")
            try:
                await asyncio.wait([read_task, self._exited], return_when=asyncio.FIRST_COMPLETED)
            finally:
                watch.cancel()
        except asyncio.TimeoutError:
            self._log.error("worker_no_hello", timeout_s=HELLO_TIMEOUT_S)
        finally:
            await self._reap(proc, read_task, up_task)

    async def _watch_hang(self, proc: subprocess.Popen) -> None:
        """Kill the worker once no frame came for ``hang_timeout_s`` (stopped, deadlocked, or a
        main loop that holds the GIL); the reap then fails its requests and a new one starts."""
        bound = self.hang_timeout_s
        if bound is None:
            return
        while True:
            silent = time.monotonic() - self.state.last_frame
            if silent >= bound:
                break
            await asyncio.sleep(min(1.0, bound - silent + 0.01))
        self.hangs += 1
        self._kill_reason = f"it sent nothing for {silent:.0f} s (server.worker_hang_timeout {bound:g} s)"
        self._log.error("worker_hung", pid=proc.pid, silent_s=round(silent, 1), bound_s=bound)
        proc.kill()

    async def _sweep_kernels(self) -> None:
        """Take damaged compiled kernels out of the worker's Triton cache (they would fail its
        first load instead of compiling again), in a thread while the worker starts (reading a
        few hundred kernels' records: ~0.3 s, which the worker's start no longer waits for)."""
        cache_dir = (self.options.get("sandbox_options") or {}).get("cache_dir")
        if not cache_dir:
            return
        try:
            removed = await asyncio.to_thread(sweep_triton_cache, triton_cache_dir(cache_dir, self.env))
        except Exception as e:  # never a reason to hold loads: Triton itself recompiles what it misses
            self._log.warning("triton_cache_sweep_failed", error=f"{type(e).__name__}: {e}")
            return
        for line in removed:
            self._log.warning("triton_cache_removed", entry=line)

    async def _reap(self, proc: subprocess.Popen, read_task: asyncio.Task[None], up_task: Any) -> None:
        was_alive = self.state.alive
        self.state.alive = False
        # What the dead worker last said it held is held no more: mirrored on, it re-created the
        # per-model series the manager forgot and the node's bytes, until the respawn's Status.
        self.state.models, self.state.memory, self.state.warm_tier = {}, None, None
        self._up.clear()
        assert self._exited is not None
        if not self._exited.done():
            proc.kill()
        rc = await asyncio.shield(self._exited)
        read_task.cancel()
        if up_task is not None:
            up_task.cancel()
        if self._writer is not None:
            self._writer.close()
            self._writer = None
        how = f"signal {-rc}" if rc < 0 else f"exit code {rc}"
        if self._kill_reason:
            how, self._kill_reason = f"killed: {self._kill_reason}", ""
        self.state.last_exit = how
        if not self._stopping:
            self._log.error("worker_exited", pid=proc.pid, how=how)
        self._fail_all(f"the engine worker exited ({how}); the request was aborted")
        if was_alive and self.on_down and not self._stopping:
            await self.on_down()

    def _fail_all(self, message: str) -> None:
        streams, self._streams = self._streams, {}
        for s in streams.values():
            s.finished = True
            s.queue.put_nowait(WorkerDied(message))
        pending, self._pending = self._pending, {}
        for fut in pending.values():
            if not fut.done():
                fut.set_exception(WorkerDied(message))
        if self._hello is not None and not self._hello.done():
            self._hello.cancel()

    # --- reading ----------------------------------------------------------------------------

    async def _read_loop(self, reader: asyncio.StreamReader) -> None:
        try:
            while True:
                n = P.frame_length(await reader.readexactly(P.HEADER_BYTES))
                self._dispatch(P.decode(await reader.readexactly(n)))
        except asyncio.IncompleteReadError:
            return  # EOF: the worker is gone
        except P.ProtocolError as e:
            self._log.error("worker_protocol_error", error=str(e))
            if self._proc is not None and self._proc.returncode is None:
                self._proc.kill()  # a worker that speaks garbage is not trusted further

    def _dispatch(self, msg: P.Message) -> None:
        now = time.monotonic()
        st = self.state
        st.last_frame = now
        if isinstance(msg, P.Tokens):
            for out in P.unpack_outputs(msg):
                req = self._streams.get(out.req_id)
                if req is None:
                    continue  # aborted on our side already
                if out.new_token_ids:
                    self.last_decode[req.model] = now
                    req.tokens_left -= len(out.new_token_ids)
                if out.finish_reason is not None:
                    req.finished = True
                    del self._streams[out.req_id]
                req.queue.put_nowait(out)
        elif isinstance(msg, P.Heartbeat):
            st.phase, st.phase_seconds = msg.phase, msg.phase_seconds
        elif isinstance(msg, P.Status):
            if msg.steps != st.steps:
                st.last_progress = now
            st.steps, st.busy, st.models, st.memory = msg.steps, msg.busy, msg.models, msg.memory
            st.warm_tier = msg.warm_tier
            st.stale_models = set()
        elif isinstance(msg, P.Hello):
            st.startup, st.hello_at = P.unpack_startup(msg), now  # a bad record: a protocol error
            if self._hello is not None and not self._hello.done():
                self._hello.set_result(msg)
        elif isinstance(msg, (P.Loaded, P.Unloaded)):
            st.stale_models.add(msg.model)  # the last Status's row of it is the load before
            if isinstance(msg, P.Loaded):
                self.load_timings[msg.model] = P.unpack_timings(msg)
                self._resolve(("load", msg.model), msg)
            else:
                self._resolve(("unload", msg.model), msg)
        elif isinstance(msg, P.PrefixCacheDropped):
            self._resolve(("drop_prefix_cache", msg.model), msg)
        elif isinstance(msg, P.Error):
            self._on_error(msg)
        else:
            self._log.warning("worker_unexpected_message", tag=msg.TAG)

    def _resolve(self, key: tuple[str, str], value: Any) -> None:
        fut = self._pending.pop(key, None)
        if fut is not None and not fut.done():
            fut.set_result(value)

    def _on_error(self, msg: P.Error) -> None:
        err = WorkerError(msg.message, msg.code, msg.details)
        if msg.req_id:
            req = self._streams.pop(msg.req_id, None)
            if req is not None:
                req.finished = True
                req.queue.put_nowait(err)
            return
        fut = self._pending.pop((msg.op, msg.model), None)
        if fut is not None and not fut.done():
            fut.set_exception(err)
        else:
            self._log.error("worker_error", op=msg.op, code=msg.code, message=msg.message)

    # --- commands ---------------------------------------------------------------------------

    def _send(self, msg: P.Message) -> None:
        if self._writer is None or not self.state.alive or self._writer.is_closing():
            raise WorkerDied("the engine worker is not running")
        self._writer.write(P.encode(msg))

    def broken_models(self) -> dict[str, str]:
        """Models the engine's last status says cannot run (``ModelStats.broken``: their runner
        could not be rebuilt), with the reason; rows of models loaded or unloaded since that
        status describe the load before and are left out."""
        st = self.state
        return {n: s.broken for n, s in st.models.items() if s.broken and n not in st.stale_models}

    def tokens_to_go(self) -> dict[str, int]:
        """Per model in the engine's last status, the most tokens one of its requests may still
        produce (``ModelStats.tokens_to_go``: how far it is from idle); rows of models loaded or
        unloaded since are left out."""
        st = self.state
        return {n: s.tokens_to_go for n, s in st.models.items() if n not in st.stale_models}

    def add(self, req_id: str, model: str, prompt_token_ids: list[int], sampling: SamplingParams,
            queue: OutputSink | None = None, grammar: str = "", output_token_ids: list[int] | None = None,
            resumable: bool = False) -> EngineRequest:
        """Send one request to the engine; raises WorkerDied when no worker is up.

        Requests may share one ``queue`` (the choices of one HTTP request); outputs carry req_id.
        ``grammar``: constrains the output (agent/http/structured.py); "" for free text.
        ``output_token_ids``: the output it had when its model was preempted (it resumes after
        them); ``resumable``: its ``queue`` takes :class:`Preempted` and resumes it (:meth:`preempt`).
        """
        if req_id in self._streams:
            raise WorkerError(f"duplicate request id {req_id!r}", "duplicate")
        self._send(P.Add(req_id=req_id, model=model, prompt_token_ids=prompt_token_ids, sampling=sampling,
                         grammar=grammar, output_token_ids=list(output_token_ids or ())))
        req = EngineRequest(req_id, model) if queue is None else EngineRequest(req_id, model, queue)
        req.resumable = resumable
        req.tokens_left = sampling.max_tokens - len(output_token_ids or ())
        self._streams[req_id] = req
        return req

    def preemptible(self, model: str, min_tokens_left: int = 0) -> int:
        """How many of ``model``'s requests are in the engine when every one of them may be
        preempted (:meth:`preempt`) and one of them may still produce more than
        ``min_tokens_left`` tokens (this client's count: the engine's status may be a period
        old), else 0."""
        mine = [r for r in self._streams.values() if r.model == model]
        if not all(r.resumable for r in mine) or max((r.tokens_left for r in mine), default=0) <= min_tokens_left:
            return 0
        return len(mine)

    def preempt(self, model: str) -> int:
        """Take every request of ``model`` out of the engine (aborted there; the outputs it sent
        meanwhile are dropped: each resumes from what its sink had) and give each sink
        :class:`Preempted`; nothing when one of them cannot resume (:meth:`preemptible`). The
        requests preempted."""
        if not self.preemptible(model):
            return 0
        mine = [r for r in self._streams.values() if r.model == model]
        for r in mine:
            del self._streams[r.req_id]
            r.finished = True
        try:
            self._send(P.Abort(req_ids=[r.req_id for r in mine]))  # before any Add that resumes one
        except WorkerDied:
            pass  # nothing left to abort; the sinks resume on the next worker
        for r in mine:
            r.queue.put_nowait(Preempted(r.req_id, model))
        return len(mine)

    def abort(self, req_id: str) -> None:
        """Abort in the engine (no-op when finished). Aborts of one loop turn share one frame."""
        req = self._streams.pop(req_id, None)
        if req is None:
            return
        req.finished = True
        if not self._aborts:
            asyncio.get_running_loop().call_soon(self._flush_aborts)
        self._aborts.append(req_id)

    def abort_all(self, message: str, code: str) -> int:
        """Abort every request in the engine and fail its stream with ``WorkerError(code)``."""
        streams, self._streams = self._streams, {}
        for req in streams.values():
            req.finished = True
            req.queue.put_nowait(WorkerError(message, code))
        if streams:
            try:
                self._send(P.Abort(req_ids=list(streams)))
            except WorkerDied:
                pass
        return len(streams)

    def _flush_aborts(self) -> None:
        ids, self._aborts = self._aborts, []
        try:
            self._send(P.Abort(req_ids=ids))
        except WorkerDied:
            pass  # nothing to abort in a dead worker

    async def _command(self, key: tuple[str, str], msg: P.Message, timeout: float | None) -> Any:
        if key in self._pending:
            raise WorkerError(f"a {key[0]} of {key[1]!r} is already in progress", "busy")
        fut: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._send(msg)
        self._pending[key] = fut
        try:
            return await asyncio.wait_for(asyncio.shield(fut), timeout)
        finally:
            if self._pending.get(key) is fut:
                del self._pending[key]

    async def load(self, spec: LoadSpec, evictable: list[str] | None = None, *,
                   timeout: float | None = None) -> P.Loaded:
        """Load ``spec`` in the worker. ``evictable``: models the caller would unload to make
        room, least recently used first. The first load of a worker waits for its kernel sweep."""
        if self._swept is not None:
            await asyncio.shield(self._swept)
        return await self._command(("load", spec.name), P.Load(spec=spec, evictable=list(evictable or [])), timeout)

    async def drop_prefix_cache(self, model: str, timeout: float | None = 30.0) -> int:
        """Forget ``model``'s prefix cache in the engine; the entries it had."""
        return (await self._command(("drop_prefix_cache", model), P.DropPrefixCache(model=model), timeout)).entries

    def expedite(self, model: str, on: bool = True) -> None:
        """Ask the engine to step ``model``'s requests ahead of the others' until it has none
        (a model draining for a load's room), or (``on`` False) in turn again (that drain called
        off); no answer, nothing to do in a dead worker."""
        try:
            self._send(P.Expedite(model=model, on=on))
        except WorkerDied:
            pass

    async def unload(self, model: str, timeout: float | None = 60.0) -> None:
        await self._command(("unload", model), P.Unload(model=model), timeout)
        self.last_decode.pop(model, None)

    # --- health -----------------------------------------------------------------------------

    @property
    def alive(self) -> bool:
        return self.state.alive

    @property
    def pid(self) -> int | None:
        return self.state.pid if self.state.alive else None

    def heartbeat_fresh(self, now: float | None = None) -> bool:
        now = time.monotonic() if now is None else now
        return self.state.alive and now - self.state.last_frame < HEARTBEAT_STALE_S

    def progressing(self, now: float | None = None) -> bool:
        """Fresh, and either idle, loading, or stepping: the systemd watchdog's condition."""
        now = time.monotonic() if now is None else now
        st = self.state
        if not self.heartbeat_fresh(now):
            return False
        if st.phase.startswith("loading:"):
            return True
        return not st.busy or now - st.last_progress < STALL_S

    def in_flight(self, model: str | None = None) -> int:
        if model is None:
            return len(self._streams)
        return sum(1 for r in self._streams.values() if r.model == model)
