"""The package's modules import each other without cycles: every import (module level or inside a
function) of a ``spear_compile`` module is an edge, and no strongly connected set of modules may exist."""
import ast
import os

import spear_compile

ROOT = os.path.dirname(spear_compile.__file__)
PKG = "spear_compile"


def _modules() -> dict:
    mods = {}
    for d, _, files in os.walk(ROOT):
        for f in files:
            if f.endswith(".py"):
                rel = os.path.relpath(os.path.join(d, f), os.path.dirname(ROOT))[:-3].replace(os.sep, ".")
                mods[rel[:-len(".__init__")] if rel.endswith(".__init__") else rel] = os.path.join(d, f)
    return mods


def import_graph() -> dict:
    """module -> the package modules it imports (a package's ``__init__`` counts as the package;
    ``from pkg import mod`` is an edge to ``pkg.mod``, as Python resolves it)."""
    mods = _modules()
    graph = {m: set() for m in mods}
    for mod, path in mods.items():
        is_pkg = path.endswith("__init__.py")
        base = mod.split(".") if is_pkg else mod.split(".")[:-1]
        for node in ast.walk(ast.parse(open(path).read(), path)):
            targets = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    parent = base[:len(base) - node.level + 1]
                    src = ".".join(parent + ([node.module] if node.module else []))
                else:
                    src = node.module or ""
                # ``from pkg import mod`` depends on pkg.mod; ``from mod import name`` on mod
                subs = [f"{src}.{a.name}" for a in node.names if f"{src}.{a.name}" in mods]
                targets = subs + ([src] if len(subs) < len(node.names) else [])
            for t in targets:
                if t.startswith(PKG):
                    while t not in mods and "." in t:  # "pkg.mod.name" -> "pkg.mod"
                        t = t.rsplit(".", 1)[0]
                    if t in mods and t != mod:
                        graph[mod].add(t)
    return graph


def cycles(graph: dict) -> list:
    """The strongly connected sets of more than one module (Tarjan), each sorted."""
    index, low, stack, on, out, n = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = n[0]
        n[0] += 1
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

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def _edges_within(graph: dict, comp: list) -> list:
    return sorted(f"{a} -> {b}" for a in comp for b in graph[a] if b in comp)


def test_no_import_cycles():
    graph = import_graph()
    found = cycles(graph)
    assert not found, "import cycles:\n" + "\n".join(
        f"  {' / '.join(c)}\n    " + "\n    ".join(_edges_within(graph, c)) for c in found)


def test_the_walker_sees_function_level_and_relative_imports():
    g = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert cycles(g) == [["a", "b", "c"]]
    graph = import_graph()
    assert "spear_compile.dispatch.table" in graph["spear_compile.dispatch.route"]


# The layers of docs/design.md, lowest first: a module may import its own layer and the ones below it.
LAYERS = {"envs": 0, "config": 0, "errors": 0, "_version": 0, "ops": 1, "lowering": 2, "dispatch": 3, "quant": 4,
          "compensators": 5, "passes": 6, "runtime": 7, "parallel": 7, "inspect": 8, "serve": 9}


def upward_imports(graph: dict) -> list:
    """``a -> b`` edges from a module of a lower layer to one of a higher layer."""
    def layer(m):
        parts = m.split(".")
        return LAYERS.get(parts[1]) if len(parts) > 1 else None

    return sorted(f"{a} -> {b}" for a, bs in graph.items() for b in bs
                  if layer(a) is not None and layer(b) is not None and layer(b) > layer(a))


def test_layers_depend_downward_only():
    """ops (schemas, references, the weight format) <- kernels (lowering) <- dispatch (route, table, tuning)
    <- quant <- compensators <- passes <- runtime / parallel <- inspect <- serve: the kernels never read the
    tuned table (the route hands them their config), the ops never import a quantizer."""
    found = upward_imports(import_graph())
    assert not found, "imports from a lower layer to a higher one:\n  " + "\n  ".join(found)
    assert upward_imports({"spear_compile.lowering.x": {"spear_compile.dispatch.table"}}) == [
        "spear_compile.lowering.x -> spear_compile.dispatch.table"]
