"""The engine worker process: ``python -m engine.worker --fd N --options JSON``.

The agent starts this process with one end of a unix socketpair on fd N (no path on disk that
anyone else could connect to). The main loop is a plain selector loop, no asyncio: it reads
whatever commands have arrived without blocking (timeout 0 while the engine has work), runs one
``EngineCore.step()``, and sends that step's outputs for all requests as one ``Tokens`` frame.
A side thread sends ``Heartbeat`` frames so the agent can tell "alive but inside a long load"
from "dead". The worker exits when the socket closes, so it never outlives the agent.

A ``Load`` does not stop the loop: ``EngineCore.begin_load`` books it and starts reading the
weights in a load thread, the loop keeps stepping the other models, and when the weights are in
(the thread wakes the selector) ``finish_load`` installs the model and ``Loaded`` is sent. Loads
run one at a time, in arrival order; an ``Unload`` of a model whose load is queued or in flight
cancels it (``Error(op="load", code="cancelled")``, then ``Unloaded``).

``--engine none`` runs the loop with no EngineCore (loads are refused with a clear error): the
agent's supervision tests exercise the process and the protocol without torch."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import selectors
import signal
import socket
import sys
import threading
import time
from collections import deque
from typing import Any

from engine.core import heap
from engine.errors import EngineError, ModelNotLoaded
from engine.model_info import ModelInfo
from engine.worker import protocol as P
from engine.worker.step_waiter import StepWaiter
from engine.worker.setup import confine, make_core

STATUS_INTERVAL_S = 0.25
HEARTBEAT_INTERVAL_S = 0.5
MAX_FAILED_STEPS = 16  # consecutive failed steps after which the worker exits (a restart is the cure)
PIN_PACE_S = 0.1  # the warm tier pins one piece at least this often while the engine is busy
RECV_BYTES = 1 << 20


class _Conn:
    """The socket, with a lock so the heartbeat thread and the main loop never interleave frames."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.lock = threading.Lock()
        self.decoder = P.FrameDecoder()

    def send(self, msg: P.Message) -> None:
        frame = P.encode(msg)
        with self.lock:
            self.sock.sendall(frame)

    def read_available(self) -> list[P.Message] | None:
        """All complete messages readable now; None once the peer has closed."""
        msgs: list[P.Message] = []
        while True:
            try:
                data = self.sock.recv(RECV_BYTES, socket.MSG_DONTWAIT)
            except (BlockingIOError, InterruptedError):
                return msgs
            except (ConnectionResetError, OSError):
                return None
            if not data:
                return None
            msgs.extend(self.decoder.feed(data))


class _Phase:
    """What the main loop is doing, for the heartbeat thread to report."""

    def __init__(self) -> None:
        self.name = "idle"
        self.since = time.monotonic()

    def set(self, name: str) -> None:
        if name != self.name:
            self.name, self.since = name, time.monotonic()


class _StartClock:
    """The worker's start as phases (``Hello.startup``): each ``mark(name)`` ends the phase that
    began at the previous mark, in seconds since this process's exec."""

    def __init__(self) -> None:
        self._offset = P.exec_monotonic()
        self._last = 0.0
        self.phases: list[list[Any]] = []

    def mark(self, name: str) -> None:
        now = time.monotonic() - self._offset
        self.phases.append([name, round(self._last, 6), round(now - self._last, 6)])
        self._last = now


class Worker:
    def __init__(self, conn: _Conn, core: Any) -> None:
        self.conn = conn
        self.core = core
        self.phase = _Phase()
        self.steps = 0
        self.running = True
        self._last_status = 0.0
        self._queued: deque[P.Load] = deque()  # loads waiting for the one in flight
        self._loading: tuple[P.Load, Any, float] | None = None  # (message, PendingLoad, start)
        # The load thread writes a byte here when its weights are in, so an idle loop wakes up
        # (a pipe, not a socket: the sandbox may deny creating sockets).
        self._wake_r, self._wake_w = os.pipe()
        for end in (self._wake_r, self._wake_w):
            os.set_blocking(end, False)
        self._waiter: StepWaiter | None = None  # made at the first yielded step
        # Constrained requests whose grammar compiles on the model's grammar thread (never on
        # this loop): added to the engine once compiled, dropped if aborted meanwhile (and the
        # compile cancelled when it has not started: a client that left costs no compile).
        self._compiling: dict[str, P.Add] = {}
        self._compile_futures: dict[str, Any] = {}
        self._compiled: deque[tuple[P.Add, Any]] = deque()  # (message, future), appended by that thread
        # Set while the engine has nothing to do (no request, no load in flight or queued): the
        # warm tier's start-up pinning runs only then (see main), because each page-locking call
        # holds the driver up and a step or a load behind it waits (measured on the H200: a
        # canary request behind 40 GiB of pinning took 8.9 s).
        self.idle = threading.Event()
        # Whether a runner may still have graphs deferred to their first use (captured while
        # idle, before the pinning above starts: a capture behind a page-locking call waits).
        # Set by each load; not at start, where the first turn must wait for the agent's Load
        # rather than declare the engine idle (the pinning would start under the first load:
        # on the H200 that made a warm-tier restart's load 2.7-4.1 s instead of 1.3).
        self._graphs_left = False
        self._failed_steps = 0  # consecutive steps that raised (MAX_FAILED_STEPS: the device is not well)

    # --- commands ---------------------------------------------------------------------------

    def handle(self, msg: P.Message) -> None:
        if isinstance(msg, (P.Add, P.Load)):
            self.idle.clear()  # before the work starts: the pinning stops at its next piece
        if isinstance(msg, P.Add):
            self._add(msg)
        elif isinstance(msg, P.Abort):
            if self.core is not None:
                for rid in msg.req_ids:
                    if self._compiling.pop(rid, None) is None:
                        self.core.abort_request(rid)
                    else:
                        self._compile_futures.pop(rid).cancel()
        elif isinstance(msg, P.Load):
            self._load(msg)
        elif isinstance(msg, P.Unload):
            self._unload(msg)
        elif isinstance(msg, P.Expedite):
            if self.core is not None:
                self.core.expedite(msg.model, msg.on)
        elif isinstance(msg, P.DropPrefixCache):
            self._drop_prefix_cache(msg)
        elif isinstance(msg, P.Shutdown):
            self.running = False
        else:
            self.conn.send(P.Error(op=msg.TAG, message=f"the worker does not accept {msg.TAG!r}", code="protocol"))

    def _no_engine(self, op: str, **ids: str) -> bool:
        if self.core is None:
            self.conn.send(P.Error(op=op, message="the worker runs without an engine", code="no_engine", **ids))
            return True
        return False

    def _add(self, msg: P.Add) -> None:
        if self._no_engine("add", req_id=msg.req_id, model=msg.model):
            return
        try:
            if msg.grammar:
                if msg.req_id in self._compiling:
                    raise ValueError(f"request {msg.req_id!r} is already in flight")
                future = self.core.compile_grammar(msg.model, msg.grammar)
                self._compiling[msg.req_id] = msg
                self._compile_futures[msg.req_id] = future
                future.add_done_callback(lambda f: (self._compiled.append((msg, f)), self._wake()))
                return
            self.core.add_request(msg.req_id, msg.model, msg.prompt_token_ids, msg.sampling,
                                  output_token_ids=msg.output_token_ids)
        except Exception as e:  # EngineError: the request's fault, not ours
            self._add_failed(msg, e)

    def _add_failed(self, msg: P.Add, e: Exception) -> None:
        self.conn.send(P.Error(op="add", message=str(e), code=type(e).__name__, req_id=msg.req_id, model=msg.model))

    def _add_compiled(self) -> None:
        """Admit the constrained requests whose grammars are compiled (and not aborted since)."""
        while self._compiled:
            msg, future = self._compiled.popleft()
            if self._compiling.get(msg.req_id) is not msg:
                continue  # aborted while compiling
            del self._compiling[msg.req_id]
            del self._compile_futures[msg.req_id]
            if future.cancelled():  # the model's grammar pool shut with its unload
                self._add_failed(msg, ModelNotLoaded(f"model {msg.model!r} was unloaded while the request's "
                                                     "grammar compiled", "model"))
                continue
            try:
                self.core.add_request(msg.req_id, msg.model, msg.prompt_token_ids,
                                      msg.sampling, grammar=future.result(), output_token_ids=msg.output_token_ids)
            except Exception as e:  # GrammarError, or the model went away meanwhile
                self._add_failed(msg, e)

    def _load(self, msg: P.Load) -> None:
        if not self._no_engine("load", model=msg.model):
            self._queued.append(msg)
            self._next_load()

    def _load_failed(self, msg: P.Load, e: Exception) -> None:
        from engine.worker.load_refusal import refusal_details

        details = refusal_details(self.core, e, msg.spec, offered=list(msg.evictable))
        code = "no_room" if details is not None else type(e).__name__
        self.conn.send(P.Error(op="load", message=f"{type(e).__name__}: {e}", code=code, model=msg.model,
                               details=P.plain(details or {})))

    def _next_load(self) -> None:
        """Begin the oldest queued load when none is in flight (refusals are answered at once)."""
        while self._loading is None and self._queued:
            msg = self._queued.popleft()
            t0 = time.monotonic()
            try:
                pending = self.core.begin_load(msg.spec, list(msg.evictable))
            except Exception as e:
                self._load_failed(msg, e)
                continue
            self._loading = (msg, pending, t0)
            pending.future.add_done_callback(lambda _f: self._wake())

    def _wake(self) -> None:
        with contextlib.suppress(OSError):  # the loop is gone, or a wake-up is already pending
            os.write(self._wake_w, b"x")

    def _finish_load(self) -> None:
        """Install the load in flight once its weights are in."""
        if self._loading is None or not self._loading[1].done():
            return
        msg, pending, t0 = self._loading
        self._loading = None
        try:
            self._loaded(msg, self.core.finish_load(pending), t0)
        except Exception as e:
            self._load_failed(msg, e)
        self._next_load()

    def _loaded(self, msg: P.Load, info: ModelInfo, t0: float) -> None:
        self._graphs_left = True  # its runner may defer some to their first use
        heap.freeze()  # the model's objects live until its unload (whose collection thaws them)
        timings = {str(k): float(v) for k, v in P.plain(self.core.loader.last_load_timings).items()
                   if isinstance(v, (int, float)) and v >= 0}  # figures only: the agent refuses the rest
        self._status_now()
        self.conn.send(P.Loaded(model=msg.model, info=info, seconds=time.monotonic() - t0,
                                timings=timings))

    def _cancel_load(self, model: str) -> bool:
        """Cancel a queued or in-flight load of ``model`` (its ``Load`` is answered with
        ``Error(code="cancelled")``); True when there was one."""
        queued = [m for m in self._queued if m.model == model]
        for m in queued:
            self._queued.remove(m)
        flight = self._loading is not None and self._loading[0].model == model
        if not (queued or flight):
            return False
        try:
            if flight:
                pending, self._loading = self._loading[1], None
                self.core.cancel_load(pending)  # waits for the load thread to let go of the weights
        finally:
            self.conn.send(P.Error(op="load", message=f"the load of {model!r} was cancelled by an unload",
                                   code="cancelled", model=model))
            self._next_load()
        return True

    def _drop_prefix_cache(self, msg: P.DropPrefixCache) -> None:
        if self._no_engine("drop_prefix_cache", model=msg.model):
            return
        try:
            entries = self.core.drop_prefix_cache(msg.model)
        except Exception as e:
            self.conn.send(P.Error(op="drop_prefix_cache", message=str(e), code=type(e).__name__, model=msg.model))
            return
        self.conn.send(P.PrefixCacheDropped(model=msg.model, entries=entries))

    def _unload(self, msg: P.Unload) -> None:
        if self._no_engine("unload", model=msg.model):
            return
        try:
            if self._cancel_load(msg.model):
                self.conn.send(P.Unloaded(model=msg.model))
                return
            self.core.unload_model(msg.model)
        except Exception as e:
            self.conn.send(P.Error(op="unload", message=str(e), code=type(e).__name__, model=msg.model))
            return
        # Requests the unload aborted surface in the next step's outputs; flush them now so the
        # agent is not left waiting on a model that is gone.
        if self.core.has_unfinished_requests():
            self._step()
        self._status_now()
        self.conn.send(P.Unloaded(model=msg.model))

    # --- loop -------------------------------------------------------------------------------

    def _step(self) -> None:
        self.phase.set("stepping")
        try:
            outs = self.core.step()
        except EngineError as e:
            self._step_failed(e)
            return
        if any(o.new_token_ids for o in outs):
            self._failed_steps = 0  # a step that produced tokens: the device works
        self.steps += 1
        errors = self.core.grammar_errors
        if errors:  # over their mask budget: an error for the request, not an abort
            for o in [o for o in outs if o.req_id in errors]:
                outs.remove(o)
                self.conn.send(P.Error(op="add", message=errors.pop(o.req_id), code="GrammarError",
                                       req_id=o.req_id))
        if outs:
            packed = [
                P.pack_output(o.req_id, list(o.new_token_ids), o.finish_reason, P.plain(o.logprobs),
                              o.num_prompt_tokens, o.num_cached_tokens, P.plain(o.prompt_logprobs))
                for o in outs
            ]
            self.conn.send(P.Tokens(step=self.steps, outputs=packed))

    def _step_failed(self, e: EngineError) -> None:
        """One model's step failed (an out-of-memory in a capture, a kernel's refusal): the core
        aborted that batch's requests (their outputs come with the next step) and every other
        model goes on. Only a device that no longer runs anything (a sticky CUDA error), or steps
        that keep failing, end the process (the agent restarts it)."""
        self._failed_steps += 1
        print(f"engine.worker: {e}", file=sys.stderr, flush=True)
        if self._failed_steps >= MAX_FAILED_STEPS or not self.core.device_usable():
            raise e

    def _busy(self) -> bool:
        return self.core is not None and self.core.has_unfinished_requests()

    def _status_now(self) -> None:
        """A status ahead of a load's or an unload's answer, so the agent's view of the budget
        is the new one when it answers (with the periodic status alone it lagged by up to
        ``STATUS_INTERVAL_S``)."""
        self._last_status = 0.0
        self._maybe_status(self._busy())

    def _maybe_status(self, busy: bool) -> None:
        now = time.monotonic()
        if now - self._last_status < STATUS_INTERVAL_S:
            return
        self._last_status = now
        models = self.core.stats() if self.core is not None else {}
        memory = self.core.memory().largest(P.STATUS_MEMORY_MODELS) if self.core is not None else None
        tier = self.core.loader.warm_tier if self.core is not None else None
        self.conn.send(P.Status(steps=self.steps, busy=busy, models=models, memory=memory,
                                warm_tier=tier.stats() if tier is not None else None))

    def run(self) -> int:
        sel = selectors.DefaultSelector()
        sel.register(self.conn.sock, selectors.EVENT_READ)
        sel.register(self._wake_r, selectors.EVENT_READ)
        while self.running:
            busy = self._busy()
            if not busy:
                self.phase.set(f"loading:{self._loading[0].model}" if self._loading else "idle")
            for key, _ in sel.select(self._wait_for(busy)):
                if key.fileobj == self._wake_r:
                    self._drain_wake()
                    continue
                msgs = self.conn.read_available()
                if msgs is None:
                    return 0  # the agent is gone: nothing left to serve
                for m in msgs:
                    self.handle(m)
            self._finish_load()
            self._add_compiled()
            if self._busy():
                self._step()
            elif self._loading is None and not self._queued and not self._compiling:
                self._capture_idle()
            busy = self._busy()
            self._maybe_status(busy)
            if busy or self._loading is not None or self._queued or self._compiling or self._graphs_left:
                self.idle.clear()
            else:
                self.idle.set()
        return 0

    def _wait_for(self, busy: bool) -> float | None:
        """How long the next select may sleep: not at all while steps are due; while a step is
        yielded (EngineCore.yielded) until it is done (the waiter's wake-up) or a request comes;
        idle, until the next status."""
        step = self.core.yielded() if busy else None
        if step is not None:
            if self._waiter is None:
                self._waiter = StepWaiter(self._wake)
            self._waiter.watch(step)
            return STATUS_INTERVAL_S
        return 0 if busy or self._graphs_left else STATUS_INTERVAL_S

    def _capture_idle(self) -> None:
        """While nothing else is to do: the KV pool grown into the room unloads left once loads
        are quiet (EngineCore.grow_idle_pool), else one deferred CUDA graph (then the loop comes
        straight back for the next): captured after ready instead of at their first busy steps.
        A failed capture is reported; that bucket then runs eagerly."""
        if self.core is None:
            self._graphs_left = False
            return
        try:
            if self.core.grow_idle_pool():
                self._graphs_left = True  # (off a GPU the runners were rebuilt: their deferred graphs again)
                return
            self._graphs_left = self.core.capture_idle_graph()
        except Exception as e:
            self._graphs_left = True  # the bucket is dropped from the deferred ones: go on with the rest
            self.conn.send(P.Error(op="capture", message=str(e), code=type(e).__name__))

    def _drain_wake(self) -> None:
        with contextlib.suppress(BlockingIOError, InterruptedError):
            while os.read(self._wake_r, 4096):
                pass


def _heartbeat_loop(conn: _Conn, phase: _Phase, stop: threading.Event) -> None:
    seq = 0
    while not stop.wait(HEARTBEAT_INTERVAL_S):
        seq += 1
        try:
            conn.send(P.Heartbeat(seq=seq, phase=phase.name, phase_seconds=time.monotonic() - phase.since))
        except OSError:
            return


def _die_with_parent() -> None:
    """Ask the kernel to SIGKILL us if the agent dies (Linux), so a worker never lingers."""
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        PR_SET_PDEATHSIG = 1
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):
        pass


def main(argv: list[str] | None = None) -> int:
    clock = _StartClock()
    clock.mark("python")  # the interpreter and this module's imports
    ap = argparse.ArgumentParser(prog="engine.worker")
    ap.add_argument("--fd", type=int, required=True, help="inherited unix socket")
    ap.add_argument("--options", default="{}", help="JSON engine options")
    ap.add_argument("--engine", choices=["core", "none"], default="core")
    args = ap.parse_args(argv)
    options = json.loads(args.options)
    if not isinstance(options, dict):
        print("--options must be a JSON object", file=sys.stderr)
        return 2
    options["engine"] = args.engine
    _die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the agent decides when we stop
    sock = socket.socket(fileno=args.fd)
    sock.setblocking(True)
    os.dup(sock.fileno())  # never closed: EOF must mean the process is gone
    conn = _Conn(sock)
    core, device, err = make_core(options, clock.mark)
    clock.mark("device")  # the CUDA context and the budget (nothing more on CPU)
    if core is not None:
        confine(options)
        clock.mark("sandbox")
    budget = core.pools.ledger.budget if core is not None and core.budget is not None else 0
    conn.send(P.Hello(pid=os.getpid(), device=device, engine_error=err, budget_bytes=budget,
                      startup=clock.phases))
    worker = Worker(conn, core)
    heap.freeze()  # torch's, Triton's and the engine's modules: never garbage
    if core is not None and core.loader.warm_tier is not None and core.device.type == "cuda":
        # Pin it now (confined, not at the first unload), a piece at a time while the engine is
        # idle: the first load after a restart must not wait for 40 GiB of pinning. Under
        # traffic that never pauses, one piece every PIN_PACE_S still goes (64 MiB, ~30 ms on
        # the H200: at most ~25 % of the time, 0.6 GB/s), and each piece serves puts as soon as
        # it is locked: at one piece a second, 12 bf16 8Bs swapping under traffic had none of
        # a 64 GiB tier pinned two minutes in, and an unpinned tier stores nothing (its pageable
        # copies cost 15 s an unload: docs/perf.md, density warm at 187541c).
        core.loader.warm_tier.prepin_async(lambda: worker.idle.wait(PIN_PACE_S))
    stop = threading.Event()
    hb = threading.Thread(target=_heartbeat_loop, args=(conn, worker.phase, stop), daemon=True, name="heartbeat")
    hb.start()
    try:
        return worker.run()
    except (BrokenPipeError, ConnectionResetError):
        return 0
    finally:
        stop.set()


if __name__ == "__main__":
    sys.exit(main())
