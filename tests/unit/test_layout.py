"""The layout's rules (docs/architecture.md, Layout), read off the source as text, nothing imported:

- no import cycle between project modules, counting type-only and in-function imports;
- a package imports only those below it (agent -> engine, text, cache, sandbox; never back);
- engine/ keeps a handful of top-level modules, the rest in subpackages by concept;
- no environment variable switches the step path: the settings do (agent/config.py, engine/options.py);
- one name per concept in engine/: a freed page the prefix index keeps is *cached-free* and a step
  left in flight for a quiet model is *yielded* ("parked" named both), and ``max_tokens`` is a
  request's output limit only (a step's cap is ``token_cap`` / ``max_step_tokens``).
- agent/http reads no private attribute of another object (aiohttp's ``request.app._client_max_size``
  and the like: the limits it needs come from the settings), and the request path's parameters are
  typed (no bare ``Any``);
- text/ imports neither aiohttp nor torch: prompt building stays a pure function of the text.
- no worker protocol message field, nor a field of a record one carries, is typed ``Any`` or a bare
  ``dict`` / ``list`` (one typed value per concept), but for the few named in ``LOOSE_FIELDS``.
- agent/manager/ is the models' state and operations, no view: an entry's state changes only in
  ``ModelEntry.move``, a model's operation starts only in ``ModelManager._run``, nothing polls
  (``asyncio.sleep`` only in the keep-alive tick), and the admin JSON is built in agent/http
  (no ``describe``, no engine stats read).
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
# Third-party packages a package never imports (beside the project packages MAY_IMPORT leaves out).
NEVER_IMPORTS = {"text": {"aiohttp", "torch"}, "engine": {"aiohttp"}}
# The OpenAI request path: transport, body, prompt, decoding, formatting. Their parameters are typed.
HTTP_REQUEST_PATH = ("openai_api", "api_error", "api_keys", "request_body", "prompt_ids", "decoding",
                     "openai_format", "sse", "structured")
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


def _identifiers(path: Path):
    """(line, kind, name) of every name a module binds or reads: definitions, parameters, names,
    attributes and keyword arguments (string constants, such as a stats key, are not names)."""
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            yield node.lineno, "def", node.name
        elif isinstance(node, ast.arg):
            yield node.lineno, "parameter", node.arg
        elif isinstance(node, ast.Name):
            yield node.lineno, "name", node.id
        elif isinstance(node, ast.Attribute):
            own = isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")
            yield node.lineno, "own attribute" if own else "attribute", node.attr
        elif isinstance(node, ast.keyword) and node.arg:
            yield node.lineno, "keyword", node.arg


def test_parked_names_nothing_in_the_engine() -> None:
    """Pages are cached-free (``free_cached``, ``take_cached``), steps yielded (``yielded()``,
    ``yield_waits``); the word is left only to the stats keys and metrics read outside the engine,
    and to no text at all in engine/sched and engine/kv."""
    found = sorted(f"{path.relative_to(ROOT)}:{line} {kind} {name}"
                   for path in (ROOT / "engine").rglob("*.py")
                   for line, kind, name in _identifiers(path) if "park" in name.lower())
    found += sorted(f"{path.relative_to(ROOT)}: in its text"
                    for sub in ("sched", "kv") for path in (ROOT / "engine" / sub).rglob("*.py")
                    if "park" in path.read_text(encoding="utf-8").lower())
    assert found == []


def test_max_tokens_is_only_a_requests_output_limit() -> None:
    """Outside engine/sampling.py, ``max_tokens`` is read off sampling parameters or passed to
    them, never a parameter, a local name or an object's own attribute (a step's token cap is
    ``Scheduler.schedule(token_cap)``, ``ModelRunner.max_step_tokens``)."""
    found = sorted(f"{path.relative_to(ROOT)}:{line} {kind}"
                   for path in (ROOT / "engine").rglob("*.py") if path != ROOT / "engine" / "sampling.py"
                   for line, kind, name in _identifiers(path)
                   if name == "max_tokens" and kind in ("parameter", "name", "own attribute", "def"))
    assert found == []


def test_third_party_imports_stay_where_they_belong() -> None:
    found = []
    for pkg, banned in NEVER_IMPORTS.items():
        for path in (ROOT / pkg).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
                if isinstance(node, ast.Import):
                    names = [a.name for a in node.names]
                elif isinstance(node, ast.ImportFrom) and not node.level:
                    names = [node.module or ""]
                else:
                    continue
                found += [f"{path.relative_to(ROOT)}: {n}" for n in names if n.split(".")[0] in banned]
    assert sorted(found) == []


def test_http_reads_no_private_attribute_of_another_object() -> None:
    # ``x._name`` is only ever the object's own (self, cls): never aiohttp's internals
    # (``request.app._client_max_size``), another module's helpers or a collaborator's state.
    found = []
    for path in sorted((ROOT / "agent" / "http").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if (isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__")
                    and not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"))):
                found.append(f"{path.relative_to(ROOT)}:{node.lineno}: .{node.attr}")
    assert found == []


def test_http_request_path_parameters_are_typed() -> None:
    found = []
    for name in HTTP_REQUEST_PATH:
        path = ROOT / "agent" / "http" / f"{name}.py"
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                a = node.args
                for arg in [*a.posonlyargs, *a.args, *a.kwonlyargs, a.vararg, a.kwarg]:
                    if arg is not None and arg.arg not in ("self", "cls") and (
                            arg.annotation is None or ast.unparse(arg.annotation) == "Any"):
                        found.append(f"{path.relative_to(ROOT)}:{node.lineno}: {node.name}({arg.arg})")
    assert found == []


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


def _tree(rel: str) -> ast.Module:
    return ast.parse((ROOT / rel).read_text(encoding="utf-8"))


def _class(tree: ast.Module, name: str) -> ast.ClassDef:
    return next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == name)


def _field_hints(cls: ast.ClassDef) -> dict[str, str]:
    return {n.target.id: ast.unparse(n.annotation) for n in cls.body
            if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)}


def test_a_load_crosses_the_worker_protocol_as_one_record() -> None:
    """``protocol.Load`` carries the load as a LoadSpec (engine/load_spec.py), never a loose map
    or the parameters one by one."""
    fields = _field_hints(_class(_tree("engine/worker/protocol.py"), "Load"))
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
    assert not [f for f, hint in _field_hints(_class(tree, "PendingLoad")).items() if "Any" in hint]


MANAGER = ROOT / "agent" / "manager"


def _calls_by_function(path: Path) -> list[tuple[str, ast.AST]]:
    """(the qualified name of the function or class around it, node) for every node of a module."""
    out: list[tuple[str, ast.AST]] = []

    def walk(node: ast.AST, where: str) -> None:
        for child in ast.iter_child_nodes(node):
            inner = where
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                inner = f"{where}.{child.name}" if where else child.name
            out.append((inner, child))
            walk(child, inner)

    walk(ast.parse(path.read_text(encoding="utf-8")), "")
    return out


def test_the_manager_changes_state_and_starts_operations_in_one_place_each() -> None:
    """``e.state = ...`` only in ``ModelEntry.move``; ``create_task`` and ``e.task = ...`` only in
    ``ModelManager._run`` (and the keep-alive loop's own task, in ``start``; the cache's derived
    builds, ``CacheSource.want_derived``, which are no model's operation; a load queued behind an
    operation, ``ModelManager._load_after``, which waits and then starts it through ``load``,
    so ``_run``); ``asyncio.sleep``
    only as the keep-alive tick: waiters wait on the entry's change signal."""
    found = []
    for path in sorted(MANAGER.glob("*.py")):
        for where, node in _calls_by_function(path):
            rel = f"{path.relative_to(ROOT)}:{getattr(node, 'lineno', 0)} in {where or 'module'}"
            targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(
                node, (ast.AugAssign, ast.AnnAssign)) else []
            for t in targets:
                for sub in ast.walk(t):
                    if isinstance(sub, ast.Attribute) and sub.attr == "state" and where != "ModelEntry.move":
                        found.append(f"{rel}: assigns .state")
                    if isinstance(sub, ast.Attribute) and sub.attr == "task" and where != "ModelManager._run":
                        found.append(f"{rel}: assigns .task")
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
                call = node.func.attr
                if call == "create_task" and where not in (
                        "ModelManager._run", "ModelManager.start", "ModelManager._load_after",
                        "CacheSource.want_derived"):  # the cache's background builds: no model operation
                    found.append(f"{rel}: {call}")
                if call == "sleep" and where != "ModelManager.run_keep_alive":
                    found.append(f"{rel}: sleep")
    assert found == []


def test_the_manager_builds_no_admin_view() -> None:
    """What the admin API shows is agent/http/admin_view.py's: the manager defines no
    ``describe``, imports nothing of agent/http nor the engine's stats, and reads no worker Status."""
    found = []
    for path in sorted(MANAGER.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            rel = f"{path.relative_to(ROOT)}:{getattr(node, 'lineno', 0)}"
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name in ("describe", "_format"):
                found.append(f"{rel}: def {node.name}")
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith(("agent.http", "engine.stats")):
                found.append(f"{rel}: imports {node.module}")
            if isinstance(node, ast.Attribute) and node.attr in ("stale_models", "memory") and \
                    ast.unparse(node.value).endswith("state"):
                found.append(f"{rel}: reads {ast.unparse(node)}")
    assert found == []
