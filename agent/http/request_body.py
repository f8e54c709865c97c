"""A request's body as the API takes it in: ``Expect: 100-continue`` answered from the headers,
the body read within a time and a size limit, decoded from its content coding (gzip and deflate up
to the same limit, anything else a 415), and parsed as a JSON object of bounded nesting, with no
key twice in one object.

Bodies are decoded here, not by aiohttp (the server runs with ``auto_decompress=False``), so that
every refusal is in OpenAI's error shape. The size limit is the one the application is built with
(``server.max_body_bytes``, aiohttp's ``client_max_size``), handed in once from the settings.
"""

from __future__ import annotations

import asyncio
import json
import math
import zlib
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from aiohttp import web
from aiohttp.http import HttpVersion11

from agent.http.api_error import ApiError
from agent.http.api_keys import ApiKeys
from agent.http.openai_schema import json_depth_ok

DECODE_INLINE_BYTES = 65_536  # longer compressed bodies inflate in a thread (zlib drops the GIL)
# Bodies at least this long are parsed, validated and made a prompt in the body threads (below):
# eight 8 MB tool bodies at once held the event loop for seconds when done on it.
HEAVY_BODY_BYTES = 262_144
BODY_THREADS = 2  # its own small pool: never the loop's default executor, which others share
BODY_BYTES = "body_bytes"  # request[...]: the decoded body's length, for the steps after parsing
_T = TypeVar("_T")
_pool: ThreadPoolExecutor | None = None


async def off_loop(size: int, fn: Callable[..., _T], *args: object) -> _T:
    """``fn(*args)``: on the loop for a body under :data:`HEAVY_BODY_BYTES`, else in the body
    threads (one pool of :data:`BODY_THREADS`: many large bodies at once queue there, not on the
    loop). The result and any exception are the same either way."""
    global _pool
    if size < HEAVY_BODY_BYTES:
        return fn(*args)
    if _pool is None:
        _pool = ThreadPoolExecutor(max_workers=BODY_THREADS, thread_name_prefix="body")
    return await asyncio.get_running_loop().run_in_executor(_pool, lambda: fn(*args))
BODY_TIMEOUT_S = 30.0  # a client trickling its body holds a connection, not the server
# Content codings a body may come in, with zlib's window bits for each (gzip header / zlib header).
_CODINGS = {"gzip": 16 + zlib.MAX_WBITS, "x-gzip": 16 + zlib.MAX_WBITS, "deflate": zlib.MAX_WBITS}


_GZIP_MAGIC = b"\x1f\x8b"
# Members one gzip body may have: a client splits a body into a few; 8 MiB of empty 20-byte members
# (420k) took 50 s of decoding, a new decompressor and a copy of the rest each.
MAX_GZIP_MEMBERS = 64


def inflate(raw: bytes, coding: str, limit: int) -> bytes:
    """``raw`` decoded from ``coding``; ApiError past ``limit`` bytes or when it is not that
    coding. A gzip body may be several members one after another (RFC 1952: their texts join);
    anything else after the data is an error, not ignored."""
    out, rest = _inflate_one(raw, coding, limit)
    parts, size = [out], len(out)
    while rest and coding != "deflate" and rest.startswith(_GZIP_MAGIC):
        if len(parts) >= MAX_GZIP_MEMBERS:  # empty members inflate to nothing: count them, not bytes
            raise ApiError(400, f"the gzip body has over {MAX_GZIP_MEMBERS} members", code="invalid_encoding")
        more, rest = _inflate_one(rest, coding, limit - size)
        parts.append(more)
        size += len(more)
    if rest:
        raise ApiError(400, f"the {coding} body has {len(rest)} bytes after its data", code="invalid_encoding")
    return b"".join(parts)


def _inflate_one(raw: bytes, coding: str, limit: int) -> tuple[bytes, bytes]:
    """The first member of ``raw`` decoded, and the bytes after it."""
    wbits = _CODINGS[coding]
    try:
        d = zlib.decompressobj(wbits)
        out = d.decompress(raw, limit + 1)
    except zlib.error:
        if coding != "deflate":
            raise ApiError(400, f"the body is not valid {coding} data", code="invalid_encoding") from None
        try:  # "deflate" is sent both with and without the zlib header
            d = zlib.decompressobj(-zlib.MAX_WBITS)
            out = d.decompress(raw, limit + 1)
        except zlib.error:
            raise ApiError(400, "the body is not valid deflate data", code="invalid_encoding") from None
    if len(out) > limit or d.unconsumed_tail:
        raise ApiError(413, f"the decoded body is larger than {limit} bytes", code="body_too_large")
    if not d.eof:
        raise ApiError(400, f"the {coding} body is truncated", code="invalid_encoding")
    return out, d.unused_data


class DuplicateKey(ValueError):
    def __init__(self, key: str) -> None:
        super().__init__(f"duplicate key {key!r}")
        self.key = key


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """A JSON object's dict, refusing a key given twice (json's default keeps the last: a
    ``{"model": "a", "model": "b"}`` must not be read as one of them)."""
    obj = dict(pairs)
    if len(obj) != len(pairs):
        seen: set[str] = set()
        raise DuplicateKey(next(k for k, _ in pairs if k in seen or seen.add(k)))  # type: ignore[func-returns-value]
    return obj


class BodyReader:
    """Reads the bodies of one API's requests; ``max_bytes`` bounds a body before and after decoding."""

    def __init__(self, max_bytes: int, keys: ApiKeys) -> None:
        """``max_bytes``: the application's ``client_max_size`` (the same setting); ``keys``: who
        may send a body at all (an ``Expect`` is refused before the body for a missing key)."""
        self.max_bytes = max_bytes
        self._keys = keys

    def _too_large(self) -> ApiError:
        return ApiError(413, f"the body is larger than {self.max_bytes} bytes", code="body_too_large")

    async def expect(self, request: web.Request) -> web.StreamResponse | None:
        """aiohttp's ``expect_handler`` for ``Expect: 100-continue``: a refusal the headers already
        decide (no key, a body over the limit) is answered now, so the client never sends the
        body; else 100 Continue."""
        expect = request.headers.get("Expect", "").lower()
        if expect != "100-continue":
            err = ApiError(417, f"Expect: {expect[:40]!r} is not understood (only 100-continue)",
                           param="Expect", code="expectation_failed")
        elif request.content_length is not None and request.content_length > self.max_bytes:
            err = self._too_large()
        else:
            try:
                self._keys.check(request)
            except ApiError as e:
                err = e
            else:
                if request.version == HttpVersion11:
                    await request.writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
                    request.writer.output_size = 0  # the answer proper has not started
                return None
        resp = err.response()
        resp.force_close()  # the body will not come: the connection cannot carry another request
        return resp

    async def read_json(self, request: web.Request) -> dict[str, Any]:
        """The body as a JSON object, with the size (before and after decoding), the content
        coding and the nesting depth bounded; ApiError otherwise."""
        # asyncio.timeout, not wait_for: wait_for reads in a task of its own, and a refused body's
        # exception then sits in a cycle (task -> exception -> traceback -> frames -> task) that
        # keeps the partial body alive until the cyclic GC runs: ~20 MB per refused 100 MB upload.
        err: ApiError | None = None
        try:
            async with asyncio.timeout(BODY_TIMEOUT_S):
                raw = await request.read()
        except web.HTTPRequestEntityTooLarge:
            err = self._too_large()
        except TimeoutError:
            err = ApiError(408, f"the body did not arrive within {BODY_TIMEOUT_S:g}s", code="body_timeout")
        if err is not None:  # raised outside the handler: no link back to the frames that held the body
            raise err
        raw = await self._decode(request, raw)
        request[BODY_BYTES] = len(raw)
        return await off_loop(len(raw), parse_json, raw)

    async def _decode(self, request: web.Request, raw: bytes) -> bytes:
        coding = request.headers.get("Content-Encoding", "identity").strip().lower()
        if coding in ("", "identity"):
            return raw
        if coding not in _CODINGS:
            raise ApiError(415, f"Content-Encoding {coding[:40]!r} is not supported; send identity, gzip or deflate",
                           param="Content-Encoding", code="unsupported_content_encoding")
        if len(raw) <= DECODE_INLINE_BYTES:
            return inflate(raw, coding, self.max_bytes)
        return await asyncio.to_thread(inflate, raw, coding, self.max_bytes)


class _NonFinite:
    """Where the body had ``NaN``, ``Infinity``, ``-Infinity`` or a number past a double's range
    (``1e400``): none is JSON (RFC 8259), though Python's parser takes them. Parsed as this marker
    and refused naming where it was: a ``NaN`` temperature was told "must be <= 2", one in a
    tool's schema reached the prompt as ``Infinity``."""

    def __init__(self, text: str) -> None:
        self.text = text


def _number(text: str) -> float | _NonFinite:
    value = float(text)
    return value if math.isfinite(value) else _NonFinite(text)


def _non_finite_at(obj: object, path: tuple[str, ...] = ()) -> tuple[tuple[str, ...], _NonFinite] | None:
    """The first marker in ``obj`` and its path (iterative: the body's nesting is bounded, but a
    list of a million ids is long)."""
    stack = [(obj, path)]
    while stack:
        value, where = stack.pop()
        if isinstance(value, _NonFinite):
            return where, value
        if isinstance(value, dict):
            stack.extend((v, (*where, str(k)[:64])) for k, v in reversed(value.items())
                         if isinstance(v, (dict, list, _NonFinite)))
        elif isinstance(value, list):
            stack.extend((v, (*where, str(i))) for i, v in reversed(list(enumerate(value)))
                         if isinstance(v, (dict, list, _NonFinite)))
    return None


def parse_json(raw: bytes) -> dict[str, Any]:
    """The body as a JSON object of bounded nesting; ApiError otherwise. Blocking (a large body
    runs it in the body threads: :func:`off_loop`)."""
    odd: list[_NonFinite] = []  # any marker made: only then is the body walked for it

    def mark(value: float | _NonFinite) -> float | _NonFinite:
        if isinstance(value, _NonFinite):
            odd.append(value)
        return value

    try:
        obj = json.loads(raw, object_pairs_hook=_unique_keys, parse_constant=lambda t: mark(_NonFinite(t)),
                         parse_float=lambda t: mark(_number(t)))
    except DuplicateKey as e:
        raise ApiError(400, f"the JSON body has the key {e.key[:64]!r} twice in one object",
                       param=e.key[:64], code="invalid_json") from None
    except RecursionError:
        raise ApiError(400, "the JSON body nests too deeply", code="invalid_json") from None
    except ValueError as e:
        raise ApiError(400, f"the body is not valid JSON: {e}", code="invalid_json") from None
    if not json_depth_ok(obj):
        raise ApiError(400, "the JSON body nests too deeply", code="invalid_json")
    if not isinstance(obj, dict):
        raise ApiError(400, "the body must be a JSON object", code="invalid_json")
    found = _non_finite_at(obj) if odd else None
    if found is not None:
        where, value = found
        param = ".".join(where)[:256]  # keys cut at 64 characters each, as the duplicate-key error does
        raise ApiError(400, f"{param}: must be a finite number ({value.text[:32]} is not JSON)", param=param,
                       code="invalid_value")
    return obj
