"""LoadNotes: the workspace a load measured, kept on disk so a restart books it instead of measuring.

A load's warm-up measures the workspace its weights take at one load shape (graph pools, the
largest step's activations); the warm tier keeps that figure with an unloaded model's weights,
so a reload skips the warm-up and builds its runner beside the weights (engine/runner/prebuild.py).
A restart starts with an empty warm tier: on the H200 its 8B load spent 1.0-1.4 s building the
runner (Triton kernels from their cache, graph capture) after 0.9-1.2 s of weights, plus 0.11 s of
warm-up. With the figure on disk the restart's load takes the same path as a warm reload.

The figures are keyed by what decides them: the computation (``engine.core.loading.workspace_key``:
the model's config and the weights' format on the device; neither its name nor its files), the
load shape, and the software and hardware that measured them (:func:`setting`:
torch, Triton, CUDA, the device, the engine's own source files). Anything else in the file is
ignored. A figure is a :class:`~engine.core.memory_plan.Workspace`, on disk ``[held, step]``.
Bounded (``MAX_NOTES`` entries, oldest dropped; ``MAX_FILE_BYTES``); a file that does not
parse, or whose values are not such pairs of integers (held positive), is ignored whole with a warning and replaced at
the next write, which is atomic (a temporary file, fsync, rename): a killed write leaves the old
file or the new one, never half of one.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
import threading
from pathlib import Path

import torch

from cache.fsync import fsync_dir
from engine.core.memory_plan import Workspace

log = logging.getLogger(__name__)

VERSION = 2  # 1: one figure a note (held and step together)
MAX_NOTES = 256
MAX_FILE_BYTES = 1 << 20
MAX_VALUE = 1 << 50  # a workspace above a petabyte is not a measurement


def setting(device: torch.device, code_root: Path | None = None) -> str:
    """What a measured workspace depends on besides the model and the shape: the versions of
    torch, Triton and CUDA, the device's name, and the engine's code (its files' sizes and mtimes
    under ``code_root``, the engine package unless given: a new build of the engine measures again)."""
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = "none"
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else device.type
    engine = code_root or Path(__file__).resolve().parents[1]
    files = sorted(engine.rglob("*.py"))
    code = hashlib.sha256()
    for f in files:
        st = f.stat()
        code.update(f"{f.relative_to(engine)}:{st.st_size}:{st.st_mtime_ns};".encode())
    return f"torch {torch.__version__}|triton {triton_version}|cuda {torch.version.cuda}|{name}|engine {code.hexdigest()[:16]}"


def _valid(v: object) -> bool:
    """``[held, step]``: ints, held positive, both below MAX_VALUE."""
    return (isinstance(v, list) and len(v) == 2 and all(type(x) is int for x in v)
            and 0 < v[0] < MAX_VALUE and 0 <= v[1] < MAX_VALUE)


class LoadNotes:
    """``get(key, shape)`` / ``put(key, shape, workspace)`` of workspace figures in one JSON file."""

    def __init__(self, path: str | Path, setting: str) -> None:
        self.path = Path(path)
        self.setting = setting
        self._lock = threading.Lock()
        self._notes: dict[str, Workspace] = self._read()

    @staticmethod
    def _id(key: str, shape: str) -> str:
        return hashlib.sha256(f"{key}\0{shape}".encode()).hexdigest()

    def _read(self) -> dict[str, Workspace]:
        try:
            if self.path.stat().st_size > MAX_FILE_BYTES:
                raise ValueError(f"larger than {MAX_FILE_BYTES} bytes")
            doc = json.loads(self.path.read_bytes())
        except FileNotFoundError:
            return {}
        except (OSError, ValueError) as e:
            log.warning("load notes %s ignored: %s", self.path, e)
            return {}
        if not isinstance(doc, dict) or doc.get("version") != VERSION or doc.get("setting") != self.setting:
            return {}  # another engine, device or format: its figures are not ours
        notes = doc.get("notes")
        if not isinstance(notes, dict) or not all(isinstance(k, str) and len(k) == 64 and _valid(v)
                                                  for k, v in notes.items()):
            log.warning("load notes %s ignored: malformed entries", self.path)
            return {}
        return {k: Workspace(*v) for k, v in list(notes.items())[-MAX_NOTES:]}

    def get(self, key: str, shape: str) -> Workspace | None:
        with self._lock:
            return self._notes.get(self._id(key, shape))

    def put(self, key: str, shape: str, value: Workspace) -> bool:
        """Keep ``value`` for (``key``, ``shape``) and write the file; False when the value is out
        of bounds or the write failed (the figure then lives only in this process)."""
        if not isinstance(value, Workspace) or not _valid([value.held, value.step]):
            return False
        with self._lock:
            nid = self._id(key, shape)
            self._notes.pop(nid, None)
            self._notes[nid] = value  # newest last: the oldest go first past MAX_NOTES
            while len(self._notes) > MAX_NOTES:
                del self._notes[next(iter(self._notes))]
            doc = {"version": VERSION, "setting": self.setting,
                   "notes": {k: [w.held, w.step] for k, w in self._notes.items()}}
            try:
                self._write(json.dumps(doc).encode())
            except OSError as e:
                log.warning("load notes %s not written: %s", self.path, e)
                return False
        return True

    def _write(self, data: bytes) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".load-notes-", dir=self.path.parent)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self.path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        fsync_dir(self.path.parent)
