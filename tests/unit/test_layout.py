"""The layout's rules (docs/architecture.md, Layout), read off the source as text, nothing imported:

- no import cycle between project modules, counting type-only and in-function imports;
- a package imports only those below it (agent -> engine, text, cache, sandbox; never back);
- engine/ keeps a handful of top-level modules, the rest in subpackages by concept;
- no environment variable switches the step path: the settings do (agent/config.py, engine/options.py).
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


def _tree(rel: str) -> ast.Module:
    return ast.parse((ROOT / rel).read_text(encoding="utf-8"))


def _class(tree: ast.Module, name: str) -> ast.ClassDef:
    return next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == name)


def _fields(cls: ast.ClassDef) -> dict[str, str]:
    return {n.target.id: ast.unparse(n.annotation) for n in cls.body
            if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)}


def test_a_load_crosses_the_worker_protocol_as_one_record() -> None:
    """``protocol.Load`` carries the load as a LoadSpec (engine/load_spec.py), never a loose map
    or the parameters one by one."""
    fields = _fields(_class(_tree("engine/worker/protocol.py"), "Load"))
    assert fields.get("spec") == "LoadSpec", fields
    assert not [f for f, hint in fields.items() if hint.startswith("dict")], fields
    assert not {"model_dir", "max_model_len", "prefix_caching"} & set(fields), fields


def test_no_function_takes_the_load_parameters_one_by_one() -> None:
    """Outside engine/load_spec.py no function or method of engine/ or agent/ takes
    ``max_model_len`` and ``prefix_caching`` as separate parameters: they travel as one LoadSpec."""
    found = []
    for pkg in ("engine", "agent"):
        for path in sorted((ROOT / pkg).rglob("*.py")):
            if path == ROOT / "engine" / "load_spec.py":
                continue
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    a = node.args
                    names = {x.arg for x in a.posonlyargs + a.args + a.kwonlyargs}
                    if {"max_model_len", "prefix_caching"} <= names:
                        found.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name}")
    assert found == []


def test_the_engine_is_built_from_its_options() -> None:
    """``EngineCore(options, device, budget)``: every switch is an EngineOptions field."""
    init = next(n for n in _class(_tree("engine/core/engine_core.py"), "EngineCore").body
                if isinstance(n, ast.FunctionDef) and n.name == "__init__")
    a = init.args
    assert [x.arg for x in a.posonlyargs + a.args + a.kwonlyargs] == ["self", "options", "device", "budget"]
    assert a.vararg is None and a.kwarg is None


def test_the_loader_books_through_the_pool_keepers_verbs() -> None:
    """engine/core/loading.py never reaches into the PoolKeeper's ledger or pool; its PendingLoad
    is typed (no ``Any``)."""
    tree = _tree("engine/core/loading.py")
    reach = sorted({ast.unparse(n) for n in ast.walk(tree) if isinstance(n, ast.Attribute)
                    and n.attr in ("pool", "ledger") and ast.unparse(n.value).endswith("_pools")})
    assert reach == []
    assert not [f for f, hint in _fields(_class(tree, "PendingLoad")).items() if "Any" in hint]
