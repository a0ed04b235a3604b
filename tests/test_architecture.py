"""The architecture rules, checked by reading `src/ampkit` with `ast` (ampkit is not imported).

1. Objects keep their privates: no `obj._x` where `obj` is not `self`/`cls`/an imported module,
   no `from ampkit.x import _y`. A small budget is allowed, each use with a comment saying why.
2. No monkey-patching: nothing assigns or `setattr`s onto a class or module at run time
   (`sys.argv`/`sys.path` aside: running a user's script needs them).
3. No import cycle between ampkit modules, lazy (function-level) imports included,
   `if TYPE_CHECKING:` imports aside.
4. Files stay small enough to read whole, and `src/` does not grow.
5. Layers as folders, calls going down only: util/hardware < precision < engine <
   checkpoint/config/inference < accelerator < tools < cli (`ampkit.errors` is a leaf anyone imports;
   `ampkit/__init__.py` is the face over all). Each exception is named in LAYER_EXCEPTIONS with its why.
   Type-only imports (`if TYPE_CHECKING:`) that point up are named too, in TYPE_ONLY_UP.
6. The tools use the engine's public boundary only: from the layers below them (precision, engine,
   checkpoint) a tool imports only the names in TOOL_BOUNDARY.

Run alone with `python -m pytest -m architecture tests/test_architecture.py`.
"""

from __future__ import annotations

import ast
import importlib.util
import io
import tokenize
from collections import defaultdict, deque
from dataclasses import dataclass
from pathlib import Path

import pytest

pytestmark = pytest.mark.architecture

SRC = Path(__file__).resolve().parents[1] / "src"
PACKAGE = "ampkit"

PRIVATE_BUDGET = 10
MAX_FILE_LINES = 400  # formatted code (the tree is checked by ruff format --check)
# Module attributes a user's script legitimately needs set (the doctor runs it as `__main__`).
ALLOWED_MODULE_ASSIGNMENTS = {("sys", "argv"), ("sys", "path")}


# ---------------------------------------------------------------------------------------------
# Reading the package


@dataclass(frozen=True, eq=False)
class Module:
    name: str  # dotted, e.g. "ampkit.tools.doctor.perf.session"
    path: Path
    is_package: bool
    tree: ast.Module
    lines: list[str]
    comment_lines: frozenset[int]  # 1-based lines holding a `#` comment

    @property
    def rel(self) -> str:
        return self.path.relative_to(SRC.parent).as_posix()

    def commented(self, lineno: int) -> bool:
        """A comment on the line itself, or on a comment-only line just above it."""
        if lineno in self.comment_lines:
            return True
        above = lineno - 1
        return above in self.comment_lines and self.lines[above - 1].lstrip().startswith("#")


PRAGMAS = ("type:", "noqa", "pragma:", "fmt:", "pylint:")


def _comment_lines(source: str) -> frozenset[int]:
    """Lines with a comment in words (a bare `# type: ignore` or `# noqa` says no why)."""
    found = set()
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            text = tok.string.lstrip("#").strip()
            if text and not text.startswith(PRAGMAS):
                found.add(tok.start[0])
    return frozenset(found)


def _load() -> dict[str, Module]:
    modules = {}
    for path in sorted((SRC / PACKAGE).rglob("*.py")):
        parts = list(path.relative_to(SRC).with_suffix("").parts)
        is_package = parts[-1] == "__init__"
        if is_package:
            parts = parts[:-1]
        source = path.read_text(encoding="utf-8")
        name = ".".join(parts)
        modules[name] = Module(
            name, path, is_package, ast.parse(source, filename=str(path)), source.splitlines(), _comment_lines(source)
        )
    return modules


MODULES = _load()


def _resolve_from(module: Module, node: ast.ImportFrom) -> str:
    """The absolute module name of `from <here> import ...` (relative imports resolved)."""
    if not node.level:
        return node.module or ""
    base = module.name.split(".")
    if not module.is_package:
        base = base[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


# namedtuple's public API is spelled with an underscore so that it cannot clash with a field.
NAMEDTUPLE_API = {"_fields", "_asdict", "_replace", "_make", "_field_defaults"}


def _is_private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__")) and name not in NAMEDTUPLE_API


def _under_type_checking(node: ast.AST, parents: dict[ast.AST, ast.AST]) -> bool:
    while node in parents:
        parent = parents[node]
        if isinstance(parent, ast.If) and node in parent.body:
            test = parent.test
            if (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
                isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
            ):
                return True
        node = parent
    return False


def _parents(tree: ast.AST) -> dict[ast.AST, ast.AST]:
    return {child: parent for parent in ast.walk(tree) for child in ast.iter_child_nodes(parent)}


def _is_module(name: str) -> bool:
    """Whether `name` is a module: an ampkit file we can see, or importable third-party code
    (`find_spec` imports the parent package, e.g. torch for `from torch import nn`)."""
    if name in MODULES:
        return True
    if name.split(".")[0] == PACKAGE:
        return False
    try:
        return importlib.util.find_spec(name) is not None
    except Exception:  # not installed, or not a package
        return False


@dataclass(frozen=True)
class Bindings:
    """What a module's import statements bind: names that are modules, and all imported names."""

    modules: dict[str, str]  # local name -> dotted module it refers to
    imported: frozenset[str]  # every name bound by an import (modules, classes, functions)
    classes: frozenset[str]  # classes defined in this file


def _bindings(module: Module) -> Bindings:
    modules: dict[str, str] = {}
    imported = set()
    for node in ast.walk(module.tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.asname:
                    modules[alias.asname] = alias.name
                    imported.add(alias.asname)
                else:
                    top = alias.name.split(".")[0]
                    modules[top] = top
                    imported.add(top)
        elif isinstance(node, ast.ImportFrom):
            source = _resolve_from(module, node)
            for alias in node.names:
                local = alias.asname or alias.name
                imported.add(local)
                full = f"{source}.{alias.name}"
                if _is_module(full):
                    modules[local] = full
    classes = frozenset(n.name for n in ast.walk(module.tree) if isinstance(n, ast.ClassDef))
    return Bindings(modules, frozenset(imported), classes)


BINDINGS = {name: _bindings(m) for name, m in MODULES.items()}


def _root(node: ast.AST) -> tuple[ast.AST, list[str]]:
    """`a.b.c` -> (Name a, ["b", "c"]); stops at the first thing that is not an attribute."""
    chain = []
    while isinstance(node, ast.Attribute):
        chain.append(node.attr)
        node = node.value
    return node, chain[::-1]


def _text(module: Module, node: ast.AST) -> str:
    return ast.get_source_segment("\n".join(module.lines), node) or ast.unparse(node)


@dataclass(frozen=True)
class Finding:
    module: Module
    line: int
    text: str

    def __str__(self) -> str:
        return f"{self.module.rel}:{self.line}: {self.text}"


def _sorted(findings: list[Finding]) -> list[Finding]:
    """One finding per expression per line (`a._x if a._x else` is one reach), in file order."""
    return sorted(set(findings), key=lambda f: (f.module.rel, f.line, f.text))


def _report(title: str, findings: list[Finding], note_uncommented: bool = False) -> str:
    per_file: dict[str, int] = defaultdict(int)
    for f in findings:
        per_file[f.module.rel] += 1
    worst = ", ".join(f"{path} {n}" for path, n in sorted(per_file.items(), key=lambda kv: -kv[1]))
    body = "\n".join(
        f"  {f}" + ("   [no comment saying why]" if note_uncommented and not f.module.commented(f.line) else "")
        for f in findings
    )
    return f"{title}: {len(findings)} (per file: {worst})\n{body}"


# ---------------------------------------------------------------------------------------------
# 1. Private attributes


def private_accesses() -> list[Finding]:
    found = []
    for name, module in MODULES.items():
        bound = BINDINGS[name]
        ampkit_modules = {local for local, full in bound.modules.items() if full.split(".")[0] == PACKAGE}
        for node in ast.walk(module.tree):
            if isinstance(node, ast.ImportFrom):
                source = _resolve_from(module, node)
                if source.split(".")[0] == PACKAGE and source != name:
                    for alias in node.names:
                        if _is_private(alias.name) and not _is_module(f"{source}.{alias.name}"):
                            found.append(Finding(module, node.lineno, f"from {source} import {alias.name}"))
            elif isinstance(node, ast.Attribute) and _is_private(node.attr):
                base = node.value
                if isinstance(base, ast.Name) and base.id in ("self", "cls"):
                    continue
                if (
                    isinstance(base, ast.Call)
                    and isinstance(base.func, ast.Name)
                    and base.func.id in ("super", "type")
                    and (
                        base.func.id == "super"
                        or (len(base.args) == 1 and isinstance(base.args[0], ast.Name) and base.args[0].id == "self")
                    )
                ):
                    continue  # super()._x, type(self)._x: this object's own class
                root, chain = _root(base)
                if isinstance(root, ast.Name) and root.id in bound.modules and root.id not in ampkit_modules:
                    continue  # a third-party module attribute: torch._C, torch._foreach_copy_
                # Through an ampkit module it counts: `ampkit.engine.data._helper` is
                # `from ampkit.engine.data import _helper`, `ampkit.engine.data.Loader._x` a class's private.
                found.append(Finding(module, node.lineno, _text(module, node)))
            elif (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Name)
                and node.func.id in ("getattr", "setattr", "hasattr", "delattr")
                and len(node.args) >= 2
                and isinstance(node.args[1], ast.Constant)
                and isinstance(node.args[1].value, str)
                and _is_private(node.args[1].value)
                and not (isinstance(node.args[0], ast.Name) and node.args[0].id in ("self", "cls"))
            ):
                root, _ = _root(node.args[0])
                if isinstance(root, ast.Name) and root.id in bound.modules and root.id not in ampkit_modules:
                    continue
                found.append(Finding(module, node.lineno, _text(module, node)))
    return _sorted(found)


def test_private_access_within_budget():
    found = private_accesses()
    assert len(found) <= PRIVATE_BUDGET, _report(
        f"reaches into another object's privates (budget {PRIVATE_BUDGET})", found, note_uncommented=True
    )


def test_private_access_each_says_why():
    silent = [f for f in private_accesses() if not f.module.commented(f.line)]
    assert not silent, _report("private accesses without a comment saying why", silent)


# ---------------------------------------------------------------------------------------------
# 2. Monkey-patching


def monkey_patches() -> list[Finding]:
    found = []
    for name, module in MODULES.items():
        bound = BINDINGS[name]
        patchable = set(bound.imported) | set(bound.classes)
        for node in ast.walk(module.tree):
            targets: list[ast.AST] = []
            if isinstance(node, (ast.Assign, ast.Delete)):
                targets = list(node.targets)
            elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
                targets = [node.target]
            flat = []
            while targets:
                t = targets.pop()
                if isinstance(t, (ast.Tuple, ast.List)):
                    targets.extend(t.elts)
                elif isinstance(t, ast.Starred):
                    targets.append(t.value)
                else:
                    flat.append(t)
            for target in flat:
                if not isinstance(target, ast.Attribute):
                    continue
                root, chain = _root(target)
                if not isinstance(root, ast.Name):
                    if isinstance(root, ast.Call) and isinstance(root.func, ast.Name) and root.func.id == "type":
                        found.append(Finding(module, node.lineno, _text(module, target)))
                    continue
                if root.id == "cls" or root.id in patchable:
                    if root.id in bound.modules and (bound.modules[root.id], chain[0]) in ALLOWED_MODULE_ASSIGNMENTS:
                        continue
                    found.append(Finding(module, node.lineno, _text(module, target)))
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Name)
                and node.func.id in ("setattr", "delattr")
                and node.args
                and not (isinstance(node.args[0], ast.Name) and node.args[0].id == "self")
            ):
                found.append(Finding(module, node.lineno, _text(module, node)))
    return _sorted(found)


def test_no_monkey_patching():
    found = monkey_patches()
    assert not found, _report("assignments/setattr onto a class or module at run time", found)


# ---------------------------------------------------------------------------------------------
# 3. Import cycles


@dataclass(frozen=True)
class Edge:
    source: str
    target: str
    line: int
    lazy: bool  # inside a function

    def __str__(self) -> str:
        where = MODULES[self.source].rel
        return f"{self.source} -> {self.target}  ({where}:{self.line}{', lazy' if self.lazy else ''})"


def import_edges() -> list[Edge]:
    """Every ampkit -> ampkit import, as the interpreter runs it.

    `import ampkit.a.b` runs `ampkit.a` and `ampkit.a.b`; the packages above the importing
    module itself are already running when it runs, so that implicit edge is left out: in
    particular `ampkit/__init__.py` re-exporting the public API is a leaf, and a cycle goes
    through it only when a module imports `ampkit` itself or a name from it.
    """
    return [edge for name, module in MODULES.items() for edge in _module_edges(name, module)]


def _module_edges(name: str, module: Module) -> list[Edge]:
    """The ampkit -> ampkit imports of one module (see import_edges)."""
    edges = []
    parents = _parents(module.tree)
    ancestors = {".".join(name.split(".")[:i]) for i in range(1, name.count(".") + 1)}
    if module.is_package:
        ancestors.add(name)

    def add(target: str, node: ast.AST, explicit: bool) -> None:
        if target.split(".")[0] != PACKAGE or target == name:
            return
        if not explicit and target in ancestors:
            return
        lazy = any(
            isinstance(p, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)) for p in _ancestors_of(node, parents)
        )
        edges.append(Edge(name, target, node.lineno, lazy))

    def add_with_packages(target: str, node: ast.AST, explicit_last: bool) -> None:
        parts = target.split(".")
        for i in range(1, len(parts)):
            add(".".join(parts[:i]), node, explicit=False)
        add(target, node, explicit=explicit_last)

    for node in ast.walk(module.tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)) and _under_type_checking(node, parents):
            continue
        if isinstance(node, ast.Import):
            for alias in node.names:
                # `import ampkit` itself is explicit; `import ampkit.a.b` only runs ampkit.
                add_with_packages(alias.name, node, explicit_last=True)
        elif isinstance(node, ast.ImportFrom):
            source = _resolve_from(module, node)
            if source.split(".")[0] != PACKAGE:
                continue
            submodules = [a.name for a in node.names if f"{source}.{a.name}" in MODULES]
            names = [a.name for a in node.names if f"{source}.{a.name}" not in MODULES]
            add_with_packages(source, node, explicit_last=bool(names))
            for sub in submodules:
                add(f"{source}.{sub}", node, explicit=True)
    return edges


def _ancestors_of(node: ast.AST, parents: dict[ast.AST, ast.AST]):
    while node in parents:
        node = parents[node]
        yield node


def _strongly_connected(graph: dict[str, set[str]]) -> list[list[str]]:
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    result = []
    counter = [0]

    def visit(v: str) -> None:  # recursion depth is bounded by the module count (~50)
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            result.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return [c for c in result if len(c) > 1]


def _shortest_cycle(start: str, graph: dict[str, set[str]], members: set[str]) -> list[str]:
    previous = {start: None}
    queue = deque([start])
    while queue:
        v = queue.popleft()
        for w in sorted(graph[v] & members):
            if w == start:
                path = [v]
                while previous[path[-1]] is not None:
                    path.append(previous[path[-1]])
                return [start] + path[::-1][1:] + [start] if len(path) > 1 else [start, v, start]
            if w not in previous:
                previous[w] = v
                queue.append(w)
    return []


def import_cycles() -> list[str]:
    edges = import_edges()
    graph: dict[str, set[str]] = defaultdict(set)
    by_pair: dict[tuple[str, str], list[Edge]] = defaultdict(list)
    for e in edges:
        graph[e.source].add(e.target)
        graph[e.target]
        by_pair[(e.source, e.target)].append(e)
    reports = []
    for component in _strongly_connected(graph):
        members = set(component)
        cycle = _shortest_cycle(component[0], graph, members)
        lines = [f"cycle of {len(component)} modules: {', '.join(component)}", "  for example:"]
        for a, b in zip(cycle, cycle[1:]):
            lines.append(f"    {by_pair[(a, b)][0]}")
        inside = [e for e in edges if e.source in members and e.target in members]
        lines.append(f"  every import inside it ({len(inside)}):")
        lines.extend(f"    {e}" for e in sorted(inside, key=lambda e: (e.source, e.line)))
        reports.append("\n".join(lines))
    return reports


def test_no_import_cycles():
    cycles = import_cycles()
    assert not cycles, f"{len(cycles)} import cycle(s) between ampkit modules:\n" + "\n".join(cycles)


# ---------------------------------------------------------------------------------------------
# 4. Size


def _line_counts() -> dict[str, int]:
    return {
        p.relative_to(SRC.parent).as_posix(): len(p.read_text(encoding="utf-8").splitlines())
        for p in sorted(SRC.rglob("*.py"))
    }


def test_no_file_over_limit():
    counts = _line_counts()
    big = sorted(((n, p) for p, n in counts.items() if n > MAX_FILE_LINES), reverse=True)
    assert not big, f"{len(big)} file(s) over {MAX_FILE_LINES} lines:\n" + "\n".join(f"  {p}: {n}" for n, p in big)


# ---------------------------------------------------------------------------------------------
# The checker itself, on small sources (so a rule that silently finds nothing is caught).


def _scan(tmp_path, files: dict[str, str], monkeypatch):
    root = tmp_path / "src"
    for rel, text in files.items():
        path = root / PACKAGE / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    monkeypatch.setitem(globals(), "SRC", root)
    monkeypatch.setitem(globals(), "MODULES", _load())
    monkeypatch.setitem(globals(), "BINDINGS", {n: _bindings(m) for n, m in MODULES.items()})


def test_checker_sees_each_rule(tmp_path, monkeypatch):
    _scan(
        tmp_path,
        {
            "__init__.py": "from ampkit.a import A\n",
            "a.py": (
                "import torch\n"
                "import warnings\n"
                "import sys\n"
                "from ampkit.b import _helper, B\n"
                "class A:\n"
                "    def f(self, other):\n"
                "        self._mine = 1\n"
                "        torch._foreach_copy_\n"
                "        other._theirs  # why: fixture\n"
                "        A.patched = 1\n"
                "        warnings.showwarning = print\n"
                "        sys.argv = ['x']\n"
                "        setattr(B, 'x', 1)\n"
                "        setattr(self, 'x', 1)\n"
            ),
            "b.py": "def _helper(): pass\nclass B: pass\ndef g():\n    from ampkit import a\n",
            "c.py": "from ampkit import A\n",
        },
        monkeypatch,
    )
    privates = [(f.module.name, f.text) for f in private_accesses()]
    assert privates == [("ampkit.a", "from ampkit.b import _helper"), ("ampkit.a", "other._theirs")]
    assert [f.module.commented(f.line) for f in private_accesses()] == [False, True]
    assert [f.text for f in monkey_patches()] == ["A.patched", "warnings.showwarning", "setattr(B, 'x', 1)"]
    cycles = import_cycles()
    assert len(cycles) == 1 and "cycle of 2 modules: ampkit.a, ampkit.b\n" in cycles[0]
    assert "(src/ampkit/b.py:4, lazy)" in cycles[0]


def test_checker_counts_the_package_init_only_when_imported_for_a_name(tmp_path, monkeypatch):
    """`ampkit/__init__.py` re-exporting is a leaf; `from ampkit import Name` inside makes a cycle."""
    _scan(
        tmp_path,
        {
            "__init__.py": "from ampkit.a import A\nfrom ampkit.b import B\n",
            "a.py": "from ampkit.b import B\nclass A: pass\n",
            "b.py": "class B: pass\ndef f():\n    from ampkit import errors\n",
            "errors.py": "",
        },
        monkeypatch,
    )
    assert import_cycles() == []
    (tmp_path / "src" / PACKAGE / "b.py").write_text("class B: pass\ndef f():\n    from ampkit import A\n")
    monkeypatch.setitem(globals(), "MODULES", _load())
    cycles = import_cycles()
    assert len(cycles) == 1 and "cycle of 3 modules: ampkit, ampkit.a, ampkit.b\n" in cycles[0], cycles


# ---------------------------------------------------------------------------------------------
# 5. Layers as folders

#: The folder (or face module) under `ampkit.` -> its layer; a module may import its own layer and below.
LAYERS = {
    "util": 0,
    "hardware": 0,
    "errors": 0,
    "precision": 1,
    "optim": 2,
    "engine": 2,
    "checkpoint": 3,
    "config": 3,
    "inference": 3,
    "accelerator": 4,
    "tools": 5,
    "cli": 6,
}
FACE = 99  # ampkit/__init__.py re-exports the public API from every layer

#: (importing module, imported module) pairs that point up at run time, each with the reason it stays.
LAYER_EXCEPTIONS: dict[tuple[str, str], str] = {}

#: Type-only imports that point up: annotations of the object a helper is handed. Each is a seam still
#: to narrow (ARCHITECTURE.md names them); the list may shrink, never grow.
TYPE_ONLY_UP: dict[tuple[str, str], str] = {
    ("ampkit.engine.events", "ampkit.accelerator"): "watch_created hands the doctor the script's Accelerator",
}


def layer_of(name: str) -> int:
    parts = name.split(".")
    return FACE if len(parts) == 1 else LAYERS[parts[1]]


def test_every_module_is_in_a_layer():
    unplaced = sorted(n for n in MODULES if n != PACKAGE and n.split(".")[1] not in LAYERS)
    assert not unplaced, f"modules outside the layers (add a folder to LAYERS or move them): {unplaced}"


def _excepted(source: str, target: str) -> bool:
    """A named exception covers its module and the packages above it that the import runs."""
    return any(s == source and (t == target or t.startswith(target + ".")) for s, t in LAYER_EXCEPTIONS)


ORDER = "util/hardware/errors < precision < engine < checkpoint/config/inference < accelerator < tools < cli"


def upward_imports() -> list[str]:
    return sorted(
        {
            str(e)
            for e in import_edges()
            if layer_of(e.target) > layer_of(e.source) and not _excepted(e.source, e.target)
        }
    )


def type_only_upward() -> set[tuple[str, str]]:
    found = set()
    for name, module in MODULES.items():
        parents = _parents(module.tree)
        for node in ast.walk(module.tree):
            if isinstance(node, ast.ImportFrom) and _under_type_checking(node, parents):
                source = _resolve_from(module, node)
                if source.split(".")[0] == PACKAGE and layer_of(source) > layer_of(name):
                    found.add((name, source))
    return found


def test_imports_go_down_the_layers():
    up = upward_imports()
    assert not up, f"imports from a higher layer ({ORDER}):\n" + "\n".join(f"  {u}" for u in up)


def test_the_named_exceptions_are_all_still_needed():
    edges = {(e.source, e.target) for e in import_edges()}
    stale = [pair for pair in LAYER_EXCEPTIONS if pair not in edges]
    stale += [pair for pair in TYPE_ONLY_UP if pair not in type_only_upward()]
    assert not stale, f"exceptions no longer needed (remove them): {stale}"


def test_type_only_imports_up_are_named():
    unnamed = sorted(type_only_upward() - set(TYPE_ONLY_UP))
    assert not unnamed, f"type-only imports from a higher layer, not in TYPE_ONLY_UP: {unnamed}"


# ---------------------------------------------------------------------------------------------
# 6. The tools' boundary

#: What a tool may import from the layers below the face (precision, engine, checkpoint); util,
#: hardware, errors, config, inference and the accelerator are open to them.
TOOL_BOUNDARY: dict[str, frozenset[str]] = {
    "ampkit.engine.events": frozenset({"Listener", "Run", "watch_created"}),  # the engine's events, their view
    # running a user's script as __main__, with checkpoints of its own
    "ampkit.engine.launch": frozenset({"run_as_main", "own_checkpoints"}),
    "ampkit.engine.optim": frozenset({"AmpOptimizer"}),  # the type of acc.optimizers
    "ampkit.engine.data": frozenset({"DeviceLoader"}),  # the type of acc.loaders
    # the lost-update detector: the trackers sample it, the numerics doctor watches every step with it
    "ampkit.engine.lost_updates": frozenset({"LOST_SHARE_ALARM", "LostUpdateDetector"}),
    "ampkit.precision.outcomes": frozenset({"Outcome"}),  # what on_outcome receives
    "ampkit.precision.fp8": frozenset({"E4M3_FLUSH", "E5M2_FLUSH"}),  # what scaling to fp8 rounds to 0
    "ampkit.precision.policy": frozenset({"PRESETS", "dtype_name", "short_dtype_name", "fp8_problem"})
    | frozenset({"resolve_precision"}),  # presets as data
    "ampkit.checkpoint.folder": frozenset({"remove_folder"}),  # removing only what ampkit wrote
    # micro_batch="auto": the planner registers its sizer with the engine
    "ampkit.engine.micro": frozenset({"BatchDoesNotFitError", "MARGIN", "rows_of", "tensor_bytes", "use_sizer"}),
    # plan strategy="fsdp": which presets shard, and the units FSDP2 wraps
    "ampkit.engine.distributed": frozenset({"FSDP_PRESETS", "fsdp_units"}),
}
BOUNDED_LAYERS = {"precision", "engine", "checkpoint"}


def boundary_reaches() -> list[str]:
    found = []
    for name, module in MODULES.items():
        if not name.startswith(f"{PACKAGE}.tools"):
            continue
        for node in ast.walk(module.tree):
            targets: list[tuple[str, str]] = []
            if isinstance(node, ast.ImportFrom):
                source = _resolve_from(module, node)
                targets = [(source, a.name) for a in node.names]
            elif isinstance(node, ast.Import):
                targets = [(a.name, "*") for a in node.names]
            for source, imported in targets:
                parts = source.split(".")
                if parts[0] != PACKAGE or len(parts) < 2 or parts[1] not in BOUNDED_LAYERS:
                    continue
                if imported not in TOOL_BOUNDARY.get(source, frozenset()):
                    found.append(f"{module.rel}:{node.lineno}: {source}.{imported}")
    return sorted(found)


def test_tools_use_only_the_public_boundary():
    reaches = boundary_reaches()
    assert not reaches, "tools importing past the engine's public boundary (TOOL_BOUNDARY):\n" + "\n".join(
        f"  {r}" for r in reaches
    )


def test_checker_sees_layers_and_the_boundary(tmp_path, monkeypatch):
    _scan(
        tmp_path,
        {
            "__init__.py": "",
            "engine/__init__.py": "",
            "engine/step.py": "from ampkit.tools.compare import x\n",
            "engine/events.py": "class Listener: pass\n",
            "engine/optim.py": "def secret(): pass\n",
            "tools/__init__.py": "",
            "tools/compare.py": (
                "x = 1\nfrom ampkit.engine.events import Listener\nfrom ampkit.engine.optim import secret\n"
            ),
        },
        monkeypatch,
    )
    assert upward_imports() == [
        "ampkit.engine.step -> ampkit.tools  (src/ampkit/engine/step.py:1)",
        "ampkit.engine.step -> ampkit.tools.compare  (src/ampkit/engine/step.py:1)",
    ]
    assert boundary_reaches() == ["src/ampkit/tools/compare.py:3: ampkit.engine.optim.secret"]
