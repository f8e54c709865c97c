"""Where Triton keeps the engine's compiled kernels: under the agent's cache directory, so a
restart finds every kernel already compiled; and a sweep that takes out what would break a load.

Torch-free: the agent runs the sweep (in a thread, while its new worker imports torch: off the
start's path) and holds the worker's first load until it is done; the worker points Triton here.

Triton keys each kernel's directory by its source, its options, the Triton version and the
target GPU, so kernels of another GPU or version are never picked (they only take room), and it
writes each file through a temporary directory and a rename. What it does not survive is a
damaged file (a disk fault, a copy cut short): a group record that still parses but names a
metadata file that does not, or an empty binary, makes the kernel's first call raise instead of
recompiling. :func:`sweep_triton_cache` removes such kernel directories (Triton compiles them
again) and the temporary directories of writers that died mid-write.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Mapping
from pathlib import Path

MAX_GROUP_BYTES = 1 << 20  # a group record lists a few file paths


def triton_cache_dir(cache_dir: str | os.PathLike, env: Mapping[str, str] | None = None) -> str:
    """The directory Triton's compile cache is in for a process with environment ``env`` (default:
    this one's): ``TRITON_CACHE_DIR`` when set (an operator's), else ``<cache_dir>/triton``."""
    env = os.environ if env is None else env
    return env.get("TRITON_CACHE_DIR") or str(Path(cache_dir) / "triton")


def set_triton_cache_dir(cache_dir: str | os.PathLike) -> str:
    """Point this process's Triton at :func:`triton_cache_dir` (made if missing). Call before the
    first kernel compiles (the worker does it at start). Returns the directory in effect."""
    path = triton_cache_dir(cache_dir)
    Path(path).mkdir(parents=True, exist_ok=True)
    os.environ["TRITON_CACHE_DIR"] = path
    return path


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _broken(group: Path) -> str | None:
    """Why the kernel a group record describes cannot be loaded (None: it can, or it is not a
    record this sweep understands, which it leaves alone)."""
    try:
        if group.stat().st_size > MAX_GROUP_BYTES:
            return "group record too large"
        children = json.loads(group.read_bytes()).get("child_paths")
    except (OSError, ValueError, AttributeError):
        return None  # Triton itself treats an unreadable record as a miss and recompiles
    if not isinstance(children, dict):
        return None
    for name, path in children.items():
        p = Path(path) if isinstance(path, str) else None
        if p is None or not p.is_file():
            return None  # Triton misses on this too
        if p.stat().st_size == 0:
            return f"{name} is empty"
        if name.endswith(".json"):
            try:
                json.loads(p.read_bytes())
            except ValueError:
                return f"{name} does not parse"
    return None


def sweep_triton_cache(path: str | os.PathLike) -> list[str]:
    """Remove the kernel directories under ``path`` that a load would fail on, and the
    temporary directories of writers no longer alive; returns what was removed, with why."""
    root = Path(path)
    removed: list[str] = []
    try:
        entries = list(root.iterdir())
    except OSError:
        return removed
    for d in entries:
        if not d.is_dir() or d.is_symlink():
            continue
        try:
            inner = list(d.iterdir())
        except OSError:
            continue
        why = None
        for f in inner:
            if f.is_dir() and f.name.startswith("tmp.pid_"):
                pid = f.name[len("tmp.pid_"):].split("_", 1)[0]
                if pid.isdigit() and not _pid_alive(int(pid)):
                    shutil.rmtree(f, ignore_errors=True)
                    removed.append(f"{f}: left by a writer that died")
            elif f.name.startswith("__grp__") and f.is_file():
                why = why or _broken(f)
        if why is not None:
            shutil.rmtree(d, ignore_errors=True)
            removed.append(f"{d}: {why}")
    return removed
