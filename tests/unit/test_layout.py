"""The layout's rules (docs/architecture.md, Layout), read off the source as text, nothing imported:

- no import cycle between project modules, counting type-only and in-function imports;
- a package imports only those below it (agent -> engine, text, cache, sandbox; never back);
- engine/ keeps a handful of top-level modules, the rest in subpackages by concept;
- no environment variable switches the step path: the settings do (agent/config.py, engine/options.py);
- no worker protocol message field, nor a field of a record one carries, is typed ``Any`` or a bare
  ``dict`` / ``list`` (one typed value per concept), but for the few named in ``LOOSE_FIELDS``.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("agent", "engine", "text", "cache", "sandbox", "modelgen")
# What each package may import of the others (the rest of the standard library and third parties
# are free). engine -> sandbox: the worker confines itself; engine -> cache: the loader's header check;
# engine -> text: the offline LLM returns text.
MAY_IMPORT = {
    "agent": {"engine", "text", "cache", "sandbox", "modelgen"},
    "engine": {"sandbox", "cache", "text"},
    "modelgen": {"text"},
    "text": set(),
    "cache": set(),
    "sandbox": set(),
}
# Switches that once changed the step path from the environment; the settings replaced them.
RETIRED_SWITCHES = ("INFIRE_URGENT_HOLDS", "INFIRE_SHARED_CAP", "INFIRE_QUIET_WINDOW_MS", "INFIRE_MODEL_STREAMS",
                    "INFIRE_SYNC", "INFIRE_CUDA_GRAPHS", "INFIRE_MIXED_GRAPHS", "INFIRE_GRAPHS_AT_LOAD_MAX",
                    "INFIRE_PREBUILD_RUNNER")
# Protocol fields that stay loosely typed (``Any`` inside), each with the reason and the place its
# values are checked. Every other message field, and every field of a record a message carries, is
# typed all the way down.
LOOSE_FIELDS = {
    # The hot message, one frame per engine step: positional lists, checked by unpack_outputs.
    "Tokens.outputs",
    # At most STARTUP_PHASES_MAX [name, start_s, seconds] lists, checked by unpack_startup.
    "Hello.startup",
    # At most TIMINGS_MAX load phases to seconds, checked by unpack_timings.
    "Loaded.timings",
    # A refused load's figures (needed, free, evictable, budget, short, evict), read by the
    # manager's room planning (agent/manager/room.py); a record once that planning takes one.
    "Error.details",
}
PROTOCOL = ROOT / "engine" / "worker" / "protocol.py"


def _modules() -> dict[str, Path]:
    mods = {}
    for pkg in PACKAGES:
        for path in (ROOT / pkg).rglob("*.py"):
            name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
            mods[name.removesuffix(".__init__")] = path
    return mods


def _imports(mods: dict[str, Path]) -> dict[str, set[str]]:
    """module -> the project modules it imports anywhere in its text."""
    def resolve(name: str) -> str | None:
        while name and name not in mods:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {}
    for mod, path in mods.items():
        package = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
        found: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                found.update(filter(None, (resolve(a.name) for a in node.names)))
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(parts + ([base] if base else []))
                for a in node.names:
                    target = resolve(f"{base}.{a.name}") if f"{base}.{a.name}" in mods else resolve(base)
                    if target:
                        found.add(target)
        found.discard(mod)
        graph[mod] = found
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (iterative Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []
    counter = 0
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            v, children = work[-1]
            for w in children:
                if w not in index:
                    index[w] = low[w] = counter
                    counter += 1
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                    break
                if w in on_stack:
                    low[v] = min(low[v], index[w])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[v])
                if low[v] == index[v]:
                    comp = []
                    while True:
                        w = stack.pop()
                        on_stack.discard(w)
                        comp.append(w)
                        if w == v:
                            break
                    if len(comp) > 1:
                        out.append(sorted(comp))
    return out


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    return _imports(_modules())


def test_cycle_finder_sees_a_cycle() -> None:
    # The checker itself: a two-module loop and a self-contained chain.
    assert _cycles({"a": {"b"}, "b": {"a"}, "c": {"a"}}) == [["a", "b"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycles(graph: dict[str, set[str]]) -> None:
    assert _cycles(graph) == []


def test_packages_import_only_those_below(graph: dict[str, set[str]]) -> None:
    upward = sorted(f"{m} -> {t}" for m, ts in graph.items() for t in ts
                    if t.split(".")[0] != m.split(".")[0] and t.split(".")[0] not in MAY_IMPORT[m.split(".")[0]])
    assert upward == []


def test_engine_keeps_few_top_level_modules() -> None:
    top = sorted(p.name for p in (ROOT / "engine").glob("*.py"))
    assert len(top) <= 12, top
    assert not any(name.startswith(("core_", "page_", "tokenizer", "modelgen", "cuda_graphs", "runner_", "step_"))
                   for name in top), top


def test_no_environment_switches_on_the_step_path() -> None:
    readers = sorted(f"{path.relative_to(ROOT)}: {name}"
                     for pkg in PACKAGES for path in (ROOT / pkg).rglob("*.py")
                     for name in RETIRED_SWITCHES if name in path.read_text(encoding="utf-8"))
    assert readers == []


def _loose(annotation: ast.expr) -> bool:
    """An annotation with ``Any`` in it, or a bare ``dict`` / ``list`` (items of no type)."""
    if isinstance(annotation, ast.Constant) and isinstance(annotation.value, str):
        annotation = ast.parse(annotation.value, mode="eval").body
    for node in ast.walk(annotation):
        if isinstance(node, ast.Name) and node.id == "Any":
            return True
    bare = [annotation] + [n.slice for n in ast.walk(annotation) if isinstance(n, ast.Subscript)]
    bare += [e for n in ast.walk(annotation) if isinstance(n, ast.Tuple) for e in n.elts]
    bare += [side for n in ast.walk(annotation) if isinstance(n, ast.BinOp) for side in (n.left, n.right)]
    return any(isinstance(n, ast.Name) and n.id in ("dict", "list") for n in bare)


def _fields(cls: ast.ClassDef) -> dict[str, ast.expr]:
    return {n.target.id: n.annotation for n in cls.body if isinstance(n, ast.AnnAssign)
            and isinstance(n.target, ast.Name) and not ast.unparse(n.annotation).startswith("ClassVar")}


def _classes(path: Path) -> dict[str, ast.ClassDef]:
    return {c.name: c for c in ast.parse(path.read_text(encoding="utf-8")).body if isinstance(c, ast.ClassDef)}


def test_protocol_messages_carry_typed_values() -> None:
    tree = ast.parse(PROTOCOL.read_text(encoding="utf-8"))
    messages = [c for c in tree.body if isinstance(c, ast.ClassDef)
                and any(isinstance(d, ast.Name) and d.id == "_register" for d in c.decorator_list)]
    assert len(messages) >= 10
    # The records they carry: classes the protocol imports from the engine, and the classes of
    # their modules that those name in turn (MemoryStats.models: ModelMemory).
    records: dict[str, ast.ClassDef] = {}
    todo: list[tuple[ast.ClassDef, dict[str, ast.ClassDef]]] = []
    for node in tree.body:
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("engine."):
            module = _classes(ROOT.joinpath(*node.module.split(".")).with_suffix(".py"))
            todo += [(module[a.name], module) for a in node.names if a.name in module]
    while todo:
        cls, module = todo.pop()
        if cls.name in records:
            continue
        records[cls.name] = cls
        todo += [(module[n.id], module) for ann in _fields(cls).values() for n in ast.walk(ann)
                 if isinstance(n, ast.Name) and n.id in module]
    assert {"SamplingParams", "ModelInfo", "ModelStats", "MemoryStats", "ModelMemory"} <= set(records)
    loose = sorted(f"{c.name}.{f}" for c in messages + list(records.values())
                   for f, ann in _fields(c).items() if _loose(ann))
    assert loose == sorted(LOOSE_FIELDS)
