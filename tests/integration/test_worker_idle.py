"""The worker's ``idle`` gate (engine/worker/main.py): set only while the engine has nothing to do
(no request, no load in flight or queued), cleared as soon as an Add or a Load arrives. The warm
tier's start-up pinning waits on it before every piece, so pinning never runs beside a load or a
step. A real worker loop (in a thread) over a real socketpair, on a CPU engine."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Iterator

from engine.core.engine_core import EngineCore
from engine.options import EngineOptions
from engine.sampling import SamplingParams
from engine.load_spec import LoadSpec
from engine.worker import protocol as P
from engine.worker.main import Worker, _Conn


class Agent:
    """The agent's end of the socket: sends commands, collects every message the worker sends."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock, self.decoder, self.got = sock, P.FrameDecoder(), []
        self.lock = threading.Lock()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        while data := self.sock.recv(1 << 16):
            with self.lock:
                self.got.extend(self.decoder.feed(data))

    def send(self, msg: P.Message) -> None:
        self.sock.sendall(P.encode(msg))

    def wait_for(self, kind: type, timeout: float = 60.0, **match) -> P.Message:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self.lock:
                for m in self.got:
                    if isinstance(m, kind) and all(getattr(m, k) == v for k, v in match.items()):
                        return m
            time.sleep(0.005)
        raise AssertionError(f"no {kind.__name__} {match} in {len(self.got)} messages")


@contextlib.contextmanager
def worker_loop() -> Iterator[tuple[Worker, EngineCore, Agent]]:
    """A CPU engine's worker loop in a thread over a socketpair, and the agent's end; shut down after."""
    ours, theirs = socket.socketpair()
    core = EngineCore(EngineOptions(max_num_batched_tokens=64, seed=0), device="cpu", budget=64 << 20)
    worker = Worker(_Conn(theirs), core)
    loop = threading.Thread(target=worker.run, daemon=True)
    loop.start()
    agent = Agent(ours)
    try:
        yield worker, core, agent
    finally:
        agent.send(P.Shutdown())
        loop.join(30)
        ours.close()


def test_idle_only_while_the_engine_has_nothing_to_do(make_tiny_model):
    with worker_loop() as (worker, core, agent):
        assert worker.idle.wait(5)  # nothing to do yet
        # While a model loads, never idle: sampled all along until Loaded arrives.
        agent.send(P.Load(spec=LoadSpec("m", str(make_tiny_model("llama")), max_model_len=128, max_num_seqs=4)))
        seen_idle_while_loading = []
        while not any(isinstance(m, P.Loaded) for m in list(agent.got)):
            if core.loader.pending is not None:
                seen_idle_while_loading.append(worker.idle.is_set())
            time.sleep(0.001)
        assert seen_idle_while_loading and not any(seen_idle_while_loading)
        assert worker.idle.wait(5)
        # A request: cleared from its Add until its last token is out.
        params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
        agent.send(P.Add(req_id="r", model="m", prompt_token_ids=[5, 9, 2, 7], sampling=params))
        deadline = time.monotonic() + 60
        while not core.has_unfinished_requests() and time.monotonic() < deadline:
            time.sleep(0.0005)
        while core.has_unfinished_requests():  # (idle read first: set only after the last token)
            assert not worker.idle.is_set() or not core.has_unfinished_requests()
            time.sleep(0.001)
        assert worker.idle.wait(5)
