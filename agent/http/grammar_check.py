"""The child process that checks request grammars for the agent (agent/http/structured.py).

llguidance's check of a hostile schema can take seconds and gigabytes (an ``allOf`` of twenty
``.*c.*`` patterns doubles its memory with each one) inside native code that no thread can stop;
here it runs in a process of its own, its address space capped (``argv[1]`` bytes), that the agent
kills when it runs over time or its request goes away. One JSON job a line on stdin, one JSON
answer a line on stdout: ``{"grammar": text}`` or ``{"param": ..., "error": message}``.
"""

from __future__ import annotations

import json
import resource
import sys


def answer(job: dict) -> dict:
    from agent.http.structured import StructuredOutputError, json_grammar, tool_call_grammar
    from text.tool_calls import ToolFormat

    try:
        if job["op"] == "tools":
            name, native = job["fmt"]
            grammar = tool_call_grammar(ToolFormat(name, native), job["tools"], job["parallel"], job["strict"])
        else:
            grammar = json_grammar(job["schema"], job["strict"], job["param"])
    except StructuredOutputError as e:
        return {"param": e.param, "error": e.message}
    except Exception as e:  # a defect of ours, not a bomb: the format's 400 with its name, the child lives
        param = "tools" if job.get("op") == "tools" else job.get("param") or "response_format"
        return {"param": param, "error": f"{param}: the format cannot be checked: {type(e).__name__}: {e}"}
    return {"grammar": grammar}


def main() -> None:
    limit = int(sys.argv[1]) if len(sys.argv) > 1 else 0
    if limit > 0:
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    import agent.http.structured  # noqa: F401  (imported before the first job: its time is not the job's)
    import llguidance  # noqa: F401

    for line in sys.stdin.buffer:
        out = answer(json.loads(line))
        sys.stdout.write(json.dumps(out, separators=(",", ":")) + "\n")
        sys.stdout.flush()


if __name__ == "__main__":
    main()
