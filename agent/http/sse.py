"""Server-sent events as the OpenAI streaming API frames them: ``data: <json>\\n\\n`` lines ended by
``data: [DONE]``. One encoder for the server, one line parser for the clients that read it
(the demo, the serving benchmark)."""

from __future__ import annotations

import json
from typing import Any

DONE = object()  # parse_line's answer to ``data: [DONE]``


def encode(objs: list[dict[str, Any]]) -> bytes:
    """Frame JSON objects as SSE events, compactly."""
    return b"".join(b"data: " + json.dumps(o, separators=(",", ":")).encode() + b"\n\n" for o in objs)


def parse_line(line: bytes) -> dict[str, Any] | object | None:
    """One line of a stream: the event's JSON object, ``DONE`` at the end, or None for a line that
    carries no data (blank separators, comments)."""
    if not line.startswith(b"data: "):
        return None
    data = line[6:].strip()
    return DONE if data == b"[DONE]" else json.loads(data)
