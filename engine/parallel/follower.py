"""Process entry of a follower rank, and how rank 0 starts its followers.

    python -m engine.parallel.follower --rank R --world-size W --init-method URL --device cuda:R

joins the group, serves rank 0's control messages until told to stop, and leaves. Rank 0 (the
engine worker of a TP model slot) calls :func:`spawn_followers` *before* joining the group
itself, since joining waits for every rank.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from collections.abc import Sequence

from engine.parallel.group import DEFAULT_TIMEOUT_S, TPConfigError


def spawn_followers(world_size: int, init_method: str, devices: Sequence[str], *, timeout_s: float = DEFAULT_TIMEOUT_S,
                    env: dict[str, str] | None = None, python: str = sys.executable) -> list[subprocess.Popen]:
    """Start ranks 1..world_size-1 (``devices[r]`` each); the caller is rank 0 and owns the processes."""
    if len(devices) != world_size:
        raise TPConfigError(f"{len(devices)} devices for {world_size} ranks")
    child_env = dict(os.environ if env is None else env)
    child_env["NCCL_NVLS_ENABLE"] = "0"
    procs = []
    for rank in range(1, world_size):
        cmd = [python, "-m", "engine.parallel.follower", "--rank", str(rank), "--world-size", str(world_size),
               "--init-method", init_method, "--device", devices[rank], "--timeout", str(timeout_s)]
        procs.append(subprocess.Popen(cmd, env=child_env))
    return procs


def dump_stacks_if_asked() -> None:
    """With ``INFIRE_TP_STACKS_AFTER=S``, dump every thread's stack every S seconds (stderr):
    a hung collective then names its line on each rank."""
    if os.environ.get("INFIRE_TP_STACKS_AFTER"):
        import faulthandler

        faulthandler.dump_traceback_later(float(os.environ["INFIRE_TP_STACKS_AFTER"]), repeat=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="tensor-parallel follower rank")
    ap.add_argument("--rank", type=int, required=True)
    ap.add_argument("--world-size", type=int, required=True)
    ap.add_argument("--init-method", required=True)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT_S)
    a = ap.parse_args(argv)
    dump_stacks_if_asked()
    os.environ["NCCL_NVLS_ENABLE"] = "0"
    from engine.parallel.engine import Follower
    from engine.parallel.group import destroy_tp_group, init_tp_group

    group = init_tp_group(a.rank, a.world_size, a.init_method, a.device, timeout_s=a.timeout)
    try:
        Follower(group).serve()
    finally:
        destroy_tp_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
