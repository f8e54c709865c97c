"""A local Hugging Face model folder served by name: ``serve DIR`` and ``load DIR``.

The folder is published into a store (read and hashed once; blobs the store has are skipped),
under ``--name`` or a name made from the folder's; the agent then pulls it into its cache like
any other model.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path
from typing import Any

NAME_HELP = "the model's name in the API (default: the folder's name, lower-cased)"


class LocalModelError(Exception):
    """The folder or the name cannot be served; the message says why, in users' words."""


def looks_like_folder(arg: str) -> bool:
    """A path rather than a model name: it names an existing folder, or has a path separator."""
    return "/" in arg or arg in (".", "..") or arg.startswith("~") or Path(arg).is_dir()


def model_name(folder: Path, name: str | None) -> str:
    """``name`` checked, or one made from the folder's name (``SmolLM2-135M`` -> ``smollm2-135m``)."""
    from agent.config import MODEL_NAME_RE

    if name is not None:
        if not MODEL_NAME_RE.fullmatch(name):
            raise LocalModelError(f"--name {name!r} is not a model name: lower-case letters, digits, '.', '_' "
                                  "and '-', starting with a letter or digit, at most 128 characters")
        return name
    made = re.sub(r"[^a-z0-9._-]+", "-", folder.name.lower()).strip("-._")[:128]
    if not made or not MODEL_NAME_RE.fullmatch(made):
        raise LocalModelError(f"cannot make a model name from the folder name {folder.name!r}: pass --name NAME")
    return made


def check_folder(arg: str) -> Path:
    folder = Path(arg).expanduser().resolve()
    if not folder.is_dir():
        raise LocalModelError(f"{arg} is not a folder")
    if not (folder / "config.json").is_file():
        raise LocalModelError(f"{folder} has no config.json: not a Hugging Face model folder")
    return folder


def publish_folder(folder: Path, name: str, store: dict[str, Any], quiet: bool = False) -> str:
    """Publish ``folder`` as ``name`` into the store described by ``store`` (url, endpoint_url,
    region, path_style); the published version (its manifest's digest, what a cache's copy is
    compared with). Raises LocalModelError with the store's or the folder's problem."""
    from cache.errors import CacheError
    from cache.progress import BarPrinter, Progress
    from cache.publish import publish_model
    from cache.store import open_store

    progress = Progress(name)
    try:
        s = open_store(store["url"], store.get("endpoint_url") or None, store.get("region", "auto"),
                       store.get("path_style", False))
        try:
            if quiet:
                manifest = publish_model(s, folder, name, progress)
            else:
                with BarPrinter(progress, sys.stderr):
                    manifest = publish_model(s, folder, name, progress)
        finally:
            s.close()
    except CacheError as e:  # ManifestError and SafetensorsError included: the folder's problem
        raise LocalModelError(f"cannot publish {folder} as {name}: {e}") from None
    return manifest.digest()


def serve_settings(settings: Any, folder: Path, name: str) -> Any:
    """``settings`` with ``name`` configured to load at start and on request (preload, autoload);
    a model of that name in the settings keeps its other keys."""
    from agent.config import ModelSettings

    models = list(settings.models)
    i = next((i for i, m in enumerate(models) if m.name == name), None)
    if i is None:
        models.append(ModelSettings(name=name, preload=True, autoload=True))
    else:
        models[i] = models[i].model_copy(update={"preload": True, "autoload": True})
    return settings.model_copy(update={"models": models})
