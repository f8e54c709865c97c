"""An HTTP fault proxy in front of moto's S3 server, plus the fixtures the cache tests share.

The proxy forwards every request to the upstream server over real HTTP and counts the body bytes
it sends back, so tests can prove which parts were (not) downloaded. Faults are queued per test:
each matches a method and a path fragment, skips its first ``skip`` matches, then fires ``times``
times. Kinds:

- ``status``: answer ``status`` with an S3 error body and ``headers`` (503 SlowDown, 429 + Retry-After);
- ``reset``: forward ``after`` body bytes, then reset the TCP connection (RST);
- ``truncate``: forward ``after`` body bytes of a longer Content-Length, then close cleanly;
- ``ignore_range``: drop the Range header, so the server answers 200 with the whole object;
- ``wrong_range``: shift the Content-Range the server sent by one byte;
- ``etag``: replace the ETag the server sent (a server that ignores If-Match while the object changes);
- ``stall``: forward ``after`` bytes, then send nothing for ``delay`` seconds;
- ``hang``: answer nothing, not even the headers, for ``delay`` seconds, then forward;
- ``flip``: flip the byte at body offset ``after`` (bit rot or a lying cache: the digest must catch it);
- ``hook``: call ``hook()`` (in a thread) before forwarding, e.g. to replace the object mid-pull.
"""

from __future__ import annotations

import asyncio
import os
import socket
import struct
import threading
import uuid
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import aiohttp
import pytest
from aiohttp import web

os.environ.setdefault("AWS_ACCESS_KEY_ID", "testing")
os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "testing")
os.environ.setdefault("AWS_DEFAULT_REGION", "us-east-1")

_DROP_REQ = {"host", "content-length", "transfer-encoding", "connection", "accept-encoding"}
_DROP_RESP = {"transfer-encoding", "connection", "content-encoding", "server", "date", "keep-alive"}


@dataclass
class Fault:
    kind: str
    match: str = "/blobs/"
    method: str = "GET"
    times: int = 1
    skip: int = 0
    status: int = 503
    headers: dict[str, str] = field(default_factory=dict)
    after: int = 1000
    delay: float = 0.0
    hook: Callable[[], None] | None = None
    fired: int = 0


class FaultProxy:
    """Runs in its own thread and event loop; ``start()`` returns the endpoint URL."""

    def __init__(self, upstream: str) -> None:
        self.upstream = upstream.rstrip("/")
        self._lock = threading.Lock()
        self._faults: list[Fault] = []
        self._seen: dict[int, int] = defaultdict(int)
        self.body_bytes: dict[str, int] = defaultdict(int)  # path → GET body bytes sent downstream
        self.log: list[tuple[str, str, str, int]] = []  # (method, path, range, status)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self.url = ""

    def add(self, fault: Fault) -> Fault:
        with self._lock:
            self._faults.append(fault)
        return fault

    def clear(self) -> None:
        with self._lock:
            self._faults.clear()
            self.body_bytes.clear()
            self.log.clear()

    def total_blob_bytes(self) -> int:
        with self._lock:
            return sum(v for k, v in self.body_bytes.items() if "/blobs/" in k)

    def statuses(self) -> list[int]:
        with self._lock:
            return [s for _, _, _, s in self.log]

    def _take(self, method: str, path: str) -> Fault | None:
        with self._lock:
            for f in self._faults:
                if f.method == method and f.match in path and f.fired < f.times:
                    n = self._seen[id(f)]
                    self._seen[id(f)] = n + 1
                    if n >= f.skip:
                        f.fired += 1
                        return f
        return None

    def start(self) -> str:
        self._thread.start()
        fut = asyncio.run_coroutine_threadsafe(self._start(), self._loop)
        self.url = fut.result(10)
        return self.url

    async def _start(self) -> str:
        self._session = aiohttp.ClientSession(auto_decompress=False,
                                              connector=aiohttp.TCPConnector(limit=0, force_close=False))
        app = web.Application(client_max_size=1 << 30)
        app.router.add_route("*", "/{tail:.*}", self._handle)
        self._runner = web.AppRunner(app, access_log=None, shutdown_timeout=0.2)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]
        return f"http://127.0.0.1:{port}"

    def stop(self) -> None:
        async def _stop() -> None:
            await self._runner.cleanup()
            await self._session.close()
            # handlers still holding a fault (a hang, a stall) end here, not as "destroyed but pending"
            rest = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for t in rest:
                t.cancel()
            await asyncio.gather(*rest, return_exceptions=True)

        asyncio.run_coroutine_threadsafe(_stop(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)

    def _record(self, request: web.Request, status: int) -> None:
        with self._lock:
            self.log.append((request.method, request.path, request.headers.get("Range", ""), status))

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        fault = self._take(request.method, request.path)
        kind = fault.kind if fault else ""
        if kind == "hook" and fault.hook:
            await asyncio.to_thread(fault.hook)
        if kind == "hang":
            await asyncio.sleep(fault.delay)
        if kind == "status":
            self._record(request, fault.status)
            code = {503: "SlowDown", 429: "TooManyRequests", 403: "AccessDenied"}.get(fault.status, "InternalError")
            body = f"<?xml version='1.0'?><Error><Code>{code}</Code><Message>injected</Message></Error>"
            return web.Response(status=fault.status, text=body, content_type="application/xml",
                                headers=fault.headers)
        headers = {k: v for k, v in request.headers.items() if k.lower() not in _DROP_REQ}
        if kind == "ignore_range":
            headers.pop("Range", None)
        data = await request.read()
        async with self._session.request(request.method, self.upstream + request.path_qs, headers=headers,
                                         data=data if data else None, allow_redirects=False) as up:
            out = {k: v for k, v in up.headers.items() if k.lower() not in _DROP_RESP}
            names = {k.lower(): k for k in out}
            if kind == "wrong_range" and "content-range" in names:
                a, rest = out[names["content-range"]].removeprefix("bytes ").split("-", 1)
                b, total = rest.split("/")
                out[names["content-range"]] = f"bytes {int(a) + 1}-{int(b) + 1}/{total}"
            if kind == "etag" and "etag" in names:
                out[names["etag"]] = '"0123456789abcdef0123456789abcdef"'
            resp = web.StreamResponse(status=up.status, headers=out)
            self._record(request, up.status)
            await resp.prepare(request)
            sent = 0
            async for chunk in up.content.iter_chunked(64 << 10):
                if kind in ("reset", "truncate", "stall") and sent + len(chunk) >= fault.after:
                    head = chunk[: max(0, fault.after - sent)]
                    await resp.write(head)
                    self._count(request, len(head))
                    if kind == "stall":
                        await asyncio.sleep(fault.delay)
                    self._kill(request, rst=(kind == "reset"))
                    return resp
                if kind == "flip" and sent <= fault.after < sent + len(chunk):
                    i = fault.after - sent
                    chunk = chunk[:i] + bytes([chunk[i] ^ 0x01]) + chunk[i + 1:]
                await resp.write(chunk)
                sent += len(chunk)
                self._count(request, len(chunk))
            await resp.write_eof()
            return resp

    def _count(self, request: web.Request, n: int) -> None:
        if request.method == "GET":
            with self._lock:
                self.body_bytes[request.path] += n

    @staticmethod
    def _kill(request: web.Request, rst: bool) -> None:
        transport = request.transport
        if transport is None:
            return
        sock = transport.get_extra_info("socket")
        if rst and sock is not None:
            # Linger 0: close() sends RST instead of FIN, a real connection reset.
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        transport.abort() if rst else transport.close()


# ---------------------------------------------------------------- fixtures and helpers


@pytest.fixture(scope="session")
def moto_endpoint():
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    yield f"http://{host}:{port}"
    server.stop()


@pytest.fixture
def proxy(moto_endpoint):
    p = FaultProxy(moto_endpoint)
    p.start()
    yield p
    p.stop()


@pytest.fixture
def bucket(moto_endpoint):
    import boto3

    name = f"t-{uuid.uuid4().hex[:16]}"
    s3 = boto3.client("s3", endpoint_url=moto_endpoint, region_name="us-east-1")
    s3.create_bucket(Bucket=name)
    yield name


def make_model(folder: Path, data_bytes: int = 1 << 20, seed: int = 0) -> Path:
    """A small model folder: config.json, a valid safetensors with ``data_bytes`` of random U8."""
    import numpy as np
    from safetensors.numpy import save_file

    rng = np.random.default_rng(seed)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text('{"model_type": "llama", "seed": %d}\n' % seed)
    save_file({"embed": rng.integers(0, 256, size=(data_bytes,), dtype=np.uint8),
               "norm": rng.standard_normal(16).astype(np.float32)}, str(folder / "model.safetensors"))
    (folder / "tokenizer").mkdir(exist_ok=True)
    (folder / "tokenizer" / "tokenizer.json").write_text('{"version": "1.0", "seed": %d}\n' % seed)
    return folder


def tree_files(root: Path) -> list[str]:
    """Every file under ``root`` except lock files: proves what a failed operation wrote."""
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file() and "locks" not in p.parts)


def fast_download(**overrides):
    """Tiny parts (many per file) and millisecond backoffs: fault tests stay fast."""
    from cache.downloader import DownloadConfig
    from cache.retry import RetryPolicy

    fields = dict(part_size=64 << 10, concurrency=4, min_concurrency=1, max_concurrency=8,
                  retry=RetryPolicy(attempts=6, base_delay=0.01, max_delay=0.05, max_retry_after=0.5))
    fields.update(overrides)
    return DownloadConfig(**fields)


def s3_store(endpoint: str, bucket: str, read_timeout: float = 5.0, **kw):
    from cache.retry import RetryPolicy
    from cache.store import open_store

    return open_store(f"s3://{bucket}/store", endpoint, "us-east-1", True, read_timeout=read_timeout,
                      connect_timeout=2.0, multipart_threshold=kw.pop("multipart_threshold", 8 << 20),
                      multipart_part_size=kw.pop("multipart_part_size", 5 << 20),
                      retry=RetryPolicy(attempts=6, base_delay=0.01, max_delay=0.05), **kw)
