"""The Python package's layout: layers whose imports point down, no import cycle, short modules,
and no module but the optimizer's own that writes the optimizer's private attributes.

The layers, top to bottom (a module may import its own layer and those below):
  public (emsa.optimizers, probe, plan, report, demo, hf, lightning, __main__, __init__)
  _optimizer (the torch.optim.Optimizer the three classes share)
  _engine (the engines, planning and binding, in-backward passes, options, state_dict)
  probe_record (the record's data classes; its check runs the native planner)
  _distributed (process groups, DDP, DTensor)
  _native (the ctypes table and the objects owning library handles)
  leaves (_files, _progress, _run_dir, report: files and plots only)
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "python" / "emsa"

LAYERS = {  # a module's layer: the first prefix that matches its dotted name
    "emsa._native": 1,
    "emsa._distributed": 2,
    "emsa._engine": 3,
    "emsa._optimizer": 4,
}
# Leaves: files and plain data; emsa.report writes and reads run folders from files alone.
LEAVES = {"emsa._files", "emsa._progress", "emsa._run_dir", "emsa.report"}
RECORDS = {"emsa.probe_record": 2.5}  # plain data, checked by the native planner, read by _engine
PUBLIC = 5


def _modules() -> dict[str, Path]:
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE.parent).with_suffix("")
        parts = list(rel.parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _layer(module: str) -> int:
    if module in LEAVES:
        return 0
    if module in RECORDS:
        return RECORDS[module]
    for prefix, layer in LAYERS.items():
        if module == prefix or module.startswith(prefix + "."):
            return layer
    return PUBLIC


def _imports(module: str, path: Path, known: set[str]) -> set[str]:
    """The emsa modules `module` imports anywhere in its file (functions included)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = set()
    for node in ast.walk(tree):
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - node.level + 1]
                stem = ".".join(base + ([node.module] if node.module else []))
            else:
                stem = node.module or ""
            # `from X import a`: the module X.a where it is one, else X itself (a name of it)
            names = [f"{stem}.{a.name}" if f"{stem}.{a.name}" in known else stem
                     for a in node.names]
        for name in names:
            while name and name not in known:
                name = name.rpartition(".")[0]
            if name and name != module:
                found.add(name)
    return found


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    known = set(modules)
    return {m: _imports(m, p, known) for m, p in modules.items()}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan), ignoring a package's
    import of its own submodules' parent (emsa.x importing emsa)."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    sys.setrecursionlimit(10_000)
    for v in graph:
        if v not in index:
            visit(v)
    return out


def test_no_import_cycle_in_the_static_graph():
    graph = {m: {d for d in deps if d != "emsa"} for m, deps in _graph().items()}
    assert _cycles(graph) == []


def test_imports_point_down_the_layers():
    wrong = []
    for module, deps in _graph().items():
        for dep in deps:
            if dep == "emsa":  # the package itself (its __init__), only from public modules
                if _layer(module) != PUBLIC:
                    wrong.append((module, dep))
                continue
            if _layer(dep) > _layer(module):
                wrong.append((module, dep))
    assert wrong == []


def test_only_the_engines_and_the_native_layer_call_the_library():
    callers = []
    for module, path in _modules().items():
        if _layer(module) in (1, 3):
            continue
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            takes_lib = (isinstance(node, ast.ImportFrom) and (node.module or "").endswith(
                "library") and any(a.name in ("lib", "check") for a in node.names))
            calls_lib = (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                         and node.value.id == "lib" and node.attr.startswith("emsa_"))
            if takes_lib or calls_lib:
                callers.append(f"{module} line {node.lineno}")
    assert callers == []


# Imports torch (and the optional trainer libraries) once, then forks one child per module,
# which imports that module alone into an interpreter holding no emsa module yet: a fresh
# interpreter as far as emsa's import order goes, without paying torch's import each time.
_FORK_EACH = r"""
import importlib, os, sys
import torch  # noqa: F401
for optional in ("transformers", "lightning"):
    try:
        importlib.import_module(optional)
    except ImportError:
        pass
failed = []
for module in sys.argv[1:]:
    pid = os.fork()
    if pid == 0:
        try:
            importlib.import_module(module)
        except BaseException as e:  # noqa: BLE001
            sys.stderr.write(f"{module}: {type(e).__name__}: {e}\n")
            os._exit(1)
        os._exit(0)
    _, status = os.waitpid(pid, 0)
    if status != 0:
        failed.append(module)
print(" ".join(failed))
"""


def test_every_module_imports_alone_in_a_fresh_interpreter():
    modules = [m for m in _modules() if m not in ("emsa.hf", "emsa.lightning")]
    for module, needs in (("emsa.hf", "transformers"), ("emsa.lightning", "lightning")):
        try:
            __import__(needs)
            modules.append(module)
        except ImportError:
            pass
    env = {**os.environ, "PYTHONPATH": str(PACKAGE.parent)}
    r = subprocess.run([sys.executable, "-c", _FORK_EACH, *modules], capture_output=True,
                       text=True, env=env, timeout=600)
    assert r.returncode == 0 and r.stdout.strip() == "", r.stderr[-4000:]


def test_modules_are_short_and_few_outside_the_engine_and_native_layers():
    modules = _modules()
    long = {m: n for m, p in modules.items()
            if (n := len(p.read_text(encoding="utf-8").splitlines())) > 500}
    assert long == {}
    outside = [m for m in modules if _layer(m) not in (1, 3)]
    assert len(outside) <= 20, outside


class _PrivateWrites(ast.NodeVisitor):
    """Assignments to `<name>._attr` (or setattr(<name>, "_attr", ...)) where <name> reads as
    an optimizer: opt, optimizer, or a call of one (self._opt())."""

    NAMES = {"opt", "optimizer", "inner"}

    def __init__(self):
        self.found: list[str] = []

    def _is_optimizer(self, node) -> bool:
        if isinstance(node, ast.Name):
            return node.id in self.NAMES
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            return node.func.attr in ("_opt", "opt")
        return False

    def _target(self, t, line):
        if isinstance(t, ast.Attribute) and t.attr.startswith("_") and self._is_optimizer(t.value):
            self.found.append(f"line {line}: .{t.attr}")
        elif isinstance(t, (ast.Tuple, ast.List)):
            for e in t.elts:
                self._target(e, line)

    def visit_Assign(self, node):
        for t in node.targets:
            self._target(t, node.lineno)
        self.generic_visit(node)

    def visit_AugAssign(self, node):
        self._target(node.target, node.lineno)
        self.generic_visit(node)

    def visit_Call(self, node):
        if (isinstance(node.func, ast.Name) and node.func.id == "setattr" and node.args
                and self._is_optimizer(node.args[0]) and len(node.args) > 1
                and isinstance(node.args[1], ast.Constant)
                and str(node.args[1].value).startswith("_")):
            self.found.append(f"line {node.lineno}: setattr {node.args[1].value}")
        if (isinstance(node.func, ast.Attribute) and node.func.attr in ("add", "append",
                                                                        "update", "clear")
                and isinstance(node.func.value, ast.Attribute)
                and node.func.value.attr.startswith("_")
                and self._is_optimizer(node.func.value.value)):
            self.found.append(f"line {node.lineno}: .{node.func.value.attr}.{node.func.attr}")
        self.generic_visit(node)


def test_no_module_but_the_optimizers_writes_their_private_attributes():
    writes = {}
    for module, path in _modules().items():
        if module in ("emsa._optimizer", "emsa.optimizers"):
            continue
        visitor = _PrivateWrites()
        visitor.visit(ast.parse(path.read_text(encoding="utf-8")))
        if visitor.found:
            writes[module] = visitor.found
    assert writes == {}


@pytest.mark.parametrize("bad", ["opt._x = 1", "opt._warned.add('a')", "self._opt()._y = 2",
                                 "setattr(optimizer, '_z', 3)"])
def test_the_private_write_check_sees_a_write(bad):
    visitor = _PrivateWrites()
    visitor.visit(ast.parse(bad))
    assert visitor.found
