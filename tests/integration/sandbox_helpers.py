"""Run ``sandbox.selftest`` in a fresh, confined subprocess and check kernel features up front."""

from __future__ import annotations

import ctypes
import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]


@dataclass
class Layout:
    ro: Path
    rw: Path
    tmp: Path
    secret: Path

    @classmethod
    def make(cls, root: Path) -> "Layout":
        lay = cls(root / "ro", root / "rw", root / "tmp", root / "outside" / "secret.txt")
        for d in (lay.ro, lay.rw, lay.tmp, lay.secret.parent):
            d.mkdir(parents=True, exist_ok=True)
        (lay.ro / "weights.safetensors").write_text("allowed\n")
        lay.secret.write_text("token=hunter2\n")
        return lay

    def env(self) -> dict[str, str]:
        # TMPDIR and the Triton cache move under the test dir, so /tmp itself (where the
        # "outside" file lives) is not in the policy's read-write set.
        return {**os.environ, "TMPDIR": str(self.tmp), "TRITON_CACHE_DIR": str(self.tmp / "triton"), "PYTHONPATH": str(REPO)}


def run_selftest(lay: Layout, *extra: str, timeout: float = 60) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "sandbox.selftest", "--ro", str(lay.ro), "--rw", str(lay.rw), "--outside", str(lay.secret), *extra]
    proc = subprocess.run(cmd, cwd=lay.tmp, env=lay.env(), capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise AssertionError(f"selftest failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout)


def landlock_abi() -> int:
    from sandbox.landlock import abi_version

    return abi_version()


def seccomp_filter_supported() -> bool:
    try:
        with open("/proc/self/status") as f:
            return any(line.startswith("Seccomp:") for line in f)
    except OSError:
        return False


def netns_permitted() -> bool:
    """Whether unshare(CLONE_NEWNET) works here, tried in a throwaway child."""
    pid = os.fork()
    if pid == 0:
        libc = ctypes.CDLL(None, use_errno=True)
        os._exit(0 if libc.unshare(0x40000000) == 0 else 1)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status) == 0
