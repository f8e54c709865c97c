"""The API keys that ``/v1`` requests must present (``Authorization: Bearer <key>``), when any are
configured (``server.api_keys``)."""

from __future__ import annotations

import hmac
from collections.abc import Iterable

from aiohttp import web

from agent.http.api_error import ApiError


class ApiKeys:
    def __init__(self, keys: Iterable[str]) -> None:
        """``keys``: the accepted keys; empty ones are ignored, and none at all lets every request in."""
        self._keys = [k.encode() for k in keys if k]

    def check(self, request: web.Request) -> None:
        """Raise a 401 :class:`ApiError` unless ``request`` carries one of the keys."""
        if not self._keys:
            return
        auth = request.headers.get("Authorization", "")
        # Header bytes that are not UTF-8 arrive as surrogate escapes: encode them back to bytes.
        given = auth[7:].strip().encode("utf-8", "surrogateescape") if auth[:7].lower() == "bearer " else b""
        # Compare against every key so the time taken says nothing about which one was close.
        ok = False
        for k in self._keys:
            ok |= hmac.compare_digest(given, k)
        if not ok:
            raise ApiError(401, "a valid API key is required (Authorization: Bearer ...)", code="invalid_api_key")
