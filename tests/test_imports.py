"""The import graph of lockserve, read from the source (ast, nothing imported): measurement code
(lockserve.cluster.measure) is imported by no runtime module, and no lockserve module imports
itself through others (a cycle).

Edges: every `import` and `from ... import` of a lockserve module, at module level or inside a
function (a lazy import that closes a cycle is still a cycle), except under `if TYPE_CHECKING:`
(annotations only, never run). `from pkg import name` is an edge to pkg.name when that is a
module, else to pkg. A package's own __init__ is not an edge of its submodules: Python runs it
first whatever they import.
"""

from __future__ import annotations

import ast
from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parents[1]
MEASURE = "lockserve.cluster.measure"
# The `lockserve` command registers the measurement commands: it imports their parsers only
# (measure.commands and measure.eval.command build argparse parsers and import nothing heavy;
# a command's module loads when it runs).
PARSER_IMPORTS = {"lockserve.cluster.cli": {MEASURE, f"{MEASURE}.eval.command"}}


def module_files() -> dict[str, Path]:
    """Module name -> file, from pyproject's package-dir (lockserve.kernels = kernels/, ...)."""
    dirs = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    mods: dict[str, Path] = {}
    for package, folder in dirs.items():
        for path in (ROOT / folder).rglob("*.py"):
            parts = list(path.relative_to(ROOT / folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            mods[".".join([package, *parts])] = path
    return mods


def _nodes(tree: ast.AST):
    """The tree's nodes, less the bodies of `if TYPE_CHECKING:`."""
    stack = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            stack.extend(node.orelse)
            continue
        yield node
        stack.extend(ast.iter_child_nodes(node))


def imports(name: str, path: Path, mods: dict[str, Path]) -> set[str]:
    """The lockserve modules the module `name` (source at path) imports."""
    out: set[str] = set()
    for node in _nodes(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name in mods)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".")[: len(name.split(".")) - node.level + (path.name == "__init__.py")]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            subs = {f"{module}.{a.name}" for a in node.names} & mods.keys()
            out |= subs
            if len(subs) < len(node.names) and module in mods:
                out.add(module)
    return out - {name}


def graph() -> dict[str, set[str]]:
    mods = module_files()
    return {name: imports(name, path, mods) for name, path in mods.items()}


def is_measure(name: str) -> bool:
    return name == MEASURE or name.startswith(MEASURE + ".")


def test_the_graph_is_read():
    g = graph()
    assert "lockserve.workers.engine.engine" in g and "lockserve.cluster.measure.decode.bench" in g, sorted(g)
    assert "lockserve.workers.engine" in g["lockserve.cluster.measure.decode.bench"]


def test_no_runtime_module_imports_measurement_code():
    bad = [f"{name} imports {dep}" for name, deps in sorted(graph().items()) if not is_measure(name)
           for dep in sorted(deps) if is_measure(dep) and dep not in PARSER_IMPORTS.get(name, set())]
    assert not bad, "runtime modules import lockserve.cluster.measure:\n" + "\n".join(bad)


def find_cycles(g: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []
    for root in sorted(g):
        if root in index:
            continue
        work = [(root, iter(sorted(g[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(g.get(w, ())))))
                elif w in on_stack:
                    low[v] = min(low[v], index[w])
                continue
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
                    cycles.append(sorted(comp))
    return cycles


def test_find_cycles_finds_one():
    g = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
    assert find_cycles(g) == [["a", "b", "c"]]
    assert find_cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycles():
    cycles = find_cycles(graph())
    listed = "\n".join(" <-> ".join(c) for c in cycles)
    assert not cycles, f"import cycles between lockserve modules:\n{listed}"
