"""Driving an EngineCore to the end in tests: every request's outputs, in order."""

from __future__ import annotations

from typing import Any


def run_outputs(core: Any, reqs: dict) -> dict[str, list]:
    """Add ``reqs`` ({req_id: (prompt ids, SamplingParams)}) to model ``"m"`` and step until
    none is left; {req_id: its RequestOutputs}."""
    for rid, (prompt, p) in reqs.items():
        core.add_request(rid, "m", prompt, p)
    got: dict[str, list] = {r: [] for r in reqs}
    while core.has_unfinished_requests():
        for o in core.step():
            got[o.req_id].append(o)
    return got
