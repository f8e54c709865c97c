"""``infire-agent stop``: stop the agent listening on the admin socket, as SIGTERM does.

The agent drains (in-flight requests get ``server.drain_timeout`` to finish), stops its worker,
removes its admin socket and exits. The process to signal is the one the kernel names as the
socket's listener (SO_PEERCRED), checked against the pid the agent reports, so a stale socket or
a recycled pid is never signalled. Under systemd, ``systemctl stop infire-agent`` is the way
(a stop from here is a clean exit, which the unit does not restart). Exit codes: 0 stopped,
1 not running or still running at the deadline, 2 bad config.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time

from agent.commands._admin import EXIT_FAIL, EXIT_OK, EXIT_USAGE, add_common, client


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("stop", help="stop the running agent: it drains its requests, removes its socket and exits "
                                    "(under systemd: systemctl stop infire-agent)",
                       description='Stop the running agent as SIGTERM does: it refuses new requests, lets the ones in flight finish (up to server.drain_timeout), unloads its models, removes its admin socket and exits. Waits until it is gone.')
    add_common(p)
    p.add_argument("--wait-timeout", type=float, default=90.0,
                   help="seconds to wait for it to exit (its drain_timeout, 30s by default, plus the worker's stop)")
    p.set_defaults(func=run)


def _alive(pid: int) -> bool:
    """Running (an exited process its parent has not reaped yet is not)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] != b"Z"
    except (OSError, IndexError):
        return True


def run(args: argparse.Namespace) -> int:
    from agent.admin_client import AdminError, AgentDown

    c = client(args)
    if c is None:
        return EXIT_USAGE
    try:
        pid = c.socket_peer_pid()
        reported = c.status().get("pid")
    except AgentDown as e:
        print(f"infire-agent is not running: {e}", file=sys.stderr)
        return EXIT_FAIL
    except AdminError as e:
        print(f"stop: {e}", file=sys.stderr)
        return EXIT_FAIL
    if reported != pid:
        print(f"stop: the process listening on {c.socket_path} is pid {pid} but the agent reports pid {reported} "
              "(another pid namespace?); stop it where it runs", file=sys.stderr)
        return EXIT_FAIL
    try:
        os.kill(pid, signal.SIGTERM)
    except PermissionError:
        print(f"stop: not allowed to signal pid {pid}; run as its user (or: systemctl stop infire-agent)",
              file=sys.stderr)
        return EXIT_FAIL
    except ProcessLookupError:
        pass
    print(f"stopping infire-agent (pid {pid}): draining requests", flush=True)
    deadline = time.monotonic() + args.wait_timeout
    while _alive(pid):
        if time.monotonic() > deadline:
            print(f"stop: pid {pid} is still running after {args.wait_timeout:g}s", file=sys.stderr)
            return EXIT_FAIL
        time.sleep(0.1)
    print(f"stopped infire-agent (pid {pid})")
    return EXIT_OK
