"""The package's layering, read from the source with `ast` (every .py under attncc/ and
runtime/, installed as attncc.runtime; module-level, function-local and TYPE_CHECKING imports
alike):

- serving never imports flex (both may import jit and the reference);
- no private name (`_x`) is imported across rooms: runtime.jit, runtime.flex, runtime.serving,
  runtime.serving.plan, the top-level runtime modules, attncc.ir, attncc.codegen,
  attncc.frontend and the top-level attncc modules are rooms;
- no import cycles among modules (two function-local ones inside the compiler half are known
  and listed in `KNOWN_LOCAL_CYCLE_EDGES`; each must stay function-local);
- attncc.ir imports nothing from frontend, codegen or runtime;
- every attncc module an import names exists;
- the compiler half (frontend, ir, codegen) imports without the CUDA Python bindings.

The checks are functions of an import graph, so `test_checks_catch_violations` can feed them
a synthetic violating graph.
"""
from __future__ import annotations

import ast
import os
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

from tests.helpers import ROOT

SOURCE_ROOTS = (("attncc", ROOT / "attncc"), ("attncc.runtime", ROOT / "runtime"),
                ("attncc.kernels", ROOT / "kernels"))
# attncc/runtime and attncc/kernels may be links to the top-level folders (or absent): the
# runtime is read from runtime/ itself, the kernels hold no Python layering
SKIP_UNDER_ATTNCC = {"runtime", "kernels"}
ROOMS = ("attncc.runtime.serving.plan", "attncc.runtime.serving", "attncc.runtime.flex",
         "attncc.runtime.jit", "attncc.runtime", "attncc.ir", "attncc.codegen",
         "attncc.frontend", "attncc.kernels", "attncc")
COMPILER_HALF = ("attncc.frontend", "attncc.ir", "attncc.codegen")
# Function-local imports that close a cycle inside one compiler-half package (a node's repr
# uses the printer, a proxy's operators dispatch to the torch op table); they run after both
# modules are loaded. The cycle check leaves out exactly these edges, and only while local.
KNOWN_LOCAL_CYCLE_EDGES = {("attncc.ir.nodes", "attncc.ir.printer"),
                           ("attncc.frontend.proxy", "attncc.frontend.torch_ops")}


@dataclass(frozen=True)
class Import:
    """One imported module (`target`) and, for `from target import name`, the name."""

    target: str
    name: str | None
    line: int
    local: bool = False  # inside a function (runs at call time, not at import)


def _module_name(prefix: str, rel: Path) -> str:
    parts = list(rel.with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join([prefix, *parts])


def source_modules() -> dict[str, Path]:
    """Every attncc module name -> its file."""
    found: dict[str, Path] = {}
    for prefix, top in SOURCE_ROOTS:
        for dirpath, dirnames, filenames in os.walk(top):
            here = Path(dirpath)
            if here == top and prefix == "attncc":
                dirnames[:] = [d for d in dirnames if d not in SKIP_UNDER_ATTNCC]
            dirnames[:] = [d for d in dirnames if d != "__pycache__"]
            for f in filenames:
                if f.endswith(".py"):
                    found[_module_name(prefix, (here / f).relative_to(top))] = here / f
    return found


def _resolve(module: str, is_package: bool, node: ast.ImportFrom) -> str:
    """The absolute module of a (possibly relative) `from ... import`."""
    if not node.level:
        return node.module or ""
    base = module.split(".") if is_package else module.split(".")[:-1]
    base = base[:len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


class _Imports(ast.NodeVisitor):
    """Collects the imports of one module, noting those inside a function."""

    def __init__(self, module: str, is_package: bool, known: set[str]) -> None:
        self.module, self.is_package, self.known = module, is_package, known
        self.depth = 0
        self.found: list[Import] = []

    def _function(self, node: ast.AST) -> None:
        self.depth += 1
        self.generic_visit(node)
        self.depth -= 1

    visit_FunctionDef = visit_AsyncFunctionDef = visit_Lambda = _function

    def visit_Import(self, node: ast.Import) -> None:
        self.found += [Import(a.name, None, node.lineno, self.depth > 0) for a in node.names]

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        target, local = _resolve(self.module, self.is_package, node), self.depth > 0
        self.found.append(Import(target, None, node.lineno, local))
        for a in node.names:
            sub = f"{target}.{a.name}"
            # `from package import module` imports that module; otherwise a name of target
            self.found.append(Import(sub, None, node.lineno, local) if sub in self.known
                              else Import(target, a.name, node.lineno, local))


def imports_of(module: str, path: Path, known: set[str]) -> list[Import]:
    """The attncc imports anywhere in `path` (functions and `if TYPE_CHECKING:` included)."""
    visitor = _Imports(module, path.name == "__init__.py", known)
    visitor.visit(ast.parse(path.read_text(), filename=str(path)))
    return [i for i in visitor.found if i.target == "attncc" or i.target.startswith("attncc.")]


def import_graph() -> dict[str, list[Import]]:
    mods = source_modules()
    return {m: imports_of(m, p, set(mods)) for m, p in mods.items()}


def room(module: str) -> str:
    """The room (subpackage) a module belongs to."""
    return next(r for r in ROOMS if module == r or module.startswith(r + "."))


def _in(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def serving_imports_flex(graph: dict[str, list[Import]]) -> list[str]:
    return [f"{m}:{i.line} imports {i.target}" for m, imps in graph.items()
            if _in(m, "attncc.runtime.serving") for i in imps
            if i.name is None and _in(i.target, "attncc.runtime.flex")]


def private_crossings(graph: dict[str, list[Import]]) -> list[str]:
    return [f"{m}:{i.line} imports {i.target}.{i.name} from another room"
            for m, imps in graph.items() for i in imps
            if i.name and i.name.startswith("_") and not i.name.startswith("__")
            and room(m) != room(i.target)]


def ir_imports_above(graph: dict[str, list[Import]]) -> list[str]:
    above = ("attncc.frontend", "attncc.codegen", "attncc.runtime")
    return [f"{m}:{i.line} imports {i.target}" for m, imps in graph.items()
            if _in(m, "attncc.ir") for i in imps
            if i.name is None and any(_in(i.target, a) for a in above)]


def missing_modules(graph: dict[str, list[Import]]) -> list[str]:
    return [f"{m}:{i.line} imports {i.target}, which does not exist"
            for m, imps in graph.items() for i in imps if i.name is None and i.target not in graph]


def cycles(graph: dict[str, list[Import]],
           allowed: frozenset[tuple[str, str]] | set[tuple[str, str]] = frozenset()
           ) -> list[list[str]]:
    """Strongly connected components of more than one module (or a module importing itself);
    edges in `allowed` are left out where every import making them is function-local."""
    def kept(m: str, target: str) -> bool:
        return (m, target) not in allowed or any(not i.local for i in graph[m]
                                                 if i.target == target)

    edges = {m: sorted({i.target for i in imps if i.target in graph and kept(m, i.target)})
             for m, imps in graph.items()}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:  # Tarjan; the graph is a few dozen modules deep at most
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in edges[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1 or v in edges[v]:
                found.append(sorted(comp))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found


def violations(graph: dict[str, list[Import]]) -> dict[str, list]:
    """Every rule's violations (empty lists when the graph is layered)."""
    return {"serving imports flex": serving_imports_flex(graph),
            "private names across rooms": private_crossings(graph),
            "ir imports frontend/codegen/runtime": ir_imports_above(graph),
            "imports of missing modules": missing_modules(graph),
            "import cycles": cycles(graph, KNOWN_LOCAL_CYCLE_EDGES)}


def test_source_tree_is_layered() -> None:
    graph = import_graph()
    assert "attncc.runtime.serving.batch" in graph and "attncc.ir.nodes" in graph, sorted(graph)
    bad = {rule: found for rule, found in violations(graph).items() if found}
    assert not bad, bad
    for m, target in KNOWN_LOCAL_CYCLE_EDGES:  # still there (else drop it from the list)
        assert any(i.target == target for i in graph[m]), (m, target)


def test_checks_catch_violations() -> None:
    """Each rule reports a synthetic graph that breaks it (and only the broken edge)."""
    def imp(target: str, name: str | None = None) -> Import:
        return Import(target, name, 1)

    graph = {
        "attncc.runtime.serving.batch": [imp("attncc.runtime.flex.gpu_flex"),
                                         imp("attncc.runtime.jit.policy", "spill_bytes")],
        "attncc.runtime.flex.gpu_flex": [imp("attncc.runtime.jit.policy", "_spill_bytes"),
                                         imp("attncc.runtime.flex.prepass", "_private_ok")],
        "attncc.runtime.flex.prepass": [],
        "attncc.runtime.jit.policy": [imp("attncc.runtime.serving.plan.lpt")],
        "attncc.runtime.serving.plan.lpt": [imp("attncc.runtime.serving.batch")],
        "attncc.ir.nodes": [imp("attncc.codegen.cuda_expr"), imp("attncc.runtime.gone")],
        "attncc.codegen.cuda_expr": [],
    }
    got = violations(graph)
    assert got["serving imports flex"] == [
        "attncc.runtime.serving.batch:1 imports attncc.runtime.flex.gpu_flex"]
    assert got["private names across rooms"] == [
        "attncc.runtime.flex.gpu_flex:1 imports attncc.runtime.jit.policy._spill_bytes from "
        "another room"]
    assert got["ir imports frontend/codegen/runtime"] == [
        "attncc.ir.nodes:1 imports attncc.codegen.cuda_expr",
        "attncc.ir.nodes:1 imports attncc.runtime.gone"]
    assert got["imports of missing modules"] == [
        "attncc.ir.nodes:1 imports attncc.runtime.gone, which does not exist"]
    assert got["import cycles"] == [["attncc.runtime.flex.gpu_flex", "attncc.runtime.jit.policy",
                                     "attncc.runtime.serving.batch",
                                     "attncc.runtime.serving.plan.lpt"]]
    assert cycles({"attncc.a": [imp("attncc.a")]}) == [["attncc.a"]]
    # an allowed edge is left out only while it is function-local
    pair = {"attncc.a": [Import("attncc.b", None, 1, local=True)], "attncc.b": [imp("attncc.a")]}
    assert cycles(pair, {("attncc.a", "attncc.b")}) == []
    pair["attncc.a"].append(imp("attncc.b"))
    assert cycles(pair, {("attncc.a", "attncc.b")}) == [["attncc.a", "attncc.b"]]


def test_imports_are_read_everywhere_in_a_file(tmp_path: Path) -> None:
    """Function-local, TYPE_CHECKING and relative imports all count; non-attncc ones do not."""
    src = tmp_path / "batch.py"
    src.write_text(textwrap.dedent("""
        from typing import TYPE_CHECKING
        import numpy
        from ..jit.policy import spill_bytes
        from .plan import scheduler
        if TYPE_CHECKING:
            from ..flex.gpu_flex import LaunchPlan
        def f():
            from attncc.runtime.reference import _private
    """))
    known = {"attncc.runtime.serving.plan.scheduler"}
    got = {(i.target, i.name, i.local)
           for i in imports_of("attncc.runtime.serving.batch", src, known)}
    assert got == {("attncc.runtime.jit.policy", None, False),
                   ("attncc.runtime.jit.policy", "spill_bytes", False),
                   ("attncc.runtime.serving.plan", None, False),
                   ("attncc.runtime.serving.plan.scheduler", None, False),
                   ("attncc.runtime.flex.gpu_flex", None, False),
                   ("attncc.runtime.flex.gpu_flex", "LaunchPlan", False),
                   ("attncc.runtime.reference", None, True),
                   ("attncc.runtime.reference", "_private", True)}


_NO_CUDA = """
import importlib, pkgutil, sys

class NoCuda:
    def find_spec(self, name, path=None, target=None):
        if name == "cuda" or name.startswith("cuda."):
            raise ImportError(f"blocked by the layering test: {name}")
        return None

def cuda_modules():
    return sorted(m for m in sys.modules if m == "cuda" or m.startswith("cuda."))

for m in cuda_modules():  # a site .pth may have made the `cuda` namespace package already
    del sys.modules[m]
sys.meta_path.insert(0, NoCuda())
for pkg in {packages!r}:
    mod = importlib.import_module(pkg)
    for info in pkgutil.walk_packages(getattr(mod, "__path__", []), pkg + "."):
        importlib.import_module(info.name)
assert not cuda_modules(), cuda_modules()
print("ok")
"""


def test_compiler_half_imports_without_cuda() -> None:
    """frontend, ir and codegen (and so `import attncc`, which they run first) and the
    AttentionGym module the tests import import in a process where any import of the `cuda`
    bindings raises."""
    code = _NO_CUDA.replace("{packages!r}", repr(COMPILER_HALF + ("attncc.gym",)))
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=ROOT, timeout=300)  # (-c: attncc from the checkout, as pytest)
    assert res.returncode == 0 and res.stdout.strip() == "ok", res.stderr[-4000:]
