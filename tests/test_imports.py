"""The packages' import graph: no cycles (lazy imports inside functions included), and the layers point one way.

The graph is read from the source (ast), not by importing: every `import` / `from ... import` anywhere in a module
of recjax/, compression/ or pallas_kernels/, resolved to the module it names (`from pkg import sub` is the submodule
`pkg.sub` when that is a module, else the package's `__init__`).
"""

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGES = ("recjax", "compression", "pallas_kernels")


def module_files(root: pathlib.Path = ROOT, packages: tuple[str, ...] = PACKAGES) -> dict[str, pathlib.Path]:
    files = {}
    for package in packages:
        for path in sorted((root / package).rglob("*.py")):
            parts = path.relative_to(root).with_suffix("").parts
            files[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return files


def import_graph(files: dict[str, pathlib.Path]) -> dict[str, set[str]]:
    """{module: the project modules it imports}."""
    graph = {}
    for name, path in files.items():
        is_package = path.name == "__init__.py"
        edges = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            targets = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # relative: from the module's package
                    package = name.split(".") if is_package else name.split(".")[:-1]
                    package = package[: len(package) - (node.level - 1)]
                    base = ".".join(package + ([base] if base else []))
                targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in files else base for alias in node.names]
            for target in targets:
                while target and target not in files:  # `import a.b.c` of a non-module attribute path
                    target = target.rpartition(".")[0]
                if target and target != name:
                    edges.add(target)
        graph[name] = edges
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
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
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_cycle_finder_finds_a_planted_cycle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
    assert cycles(graph) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_the_graph_sees_lazy_relative_and_submodule_imports(tmp_path):
    (tmp_path / "pkg" / "sub").mkdir(parents=True)
    (tmp_path / "pkg" / "__init__.py").write_text("from pkg import a\n")
    (tmp_path / "pkg" / "a.py").write_text("import os\n\ndef f():\n    from pkg.sub import b\n    return b\n")
    (tmp_path / "pkg" / "sub" / "__init__.py").write_text("")
    (tmp_path / "pkg" / "sub" / "b.py").write_text("from .. import a\nfrom ..a import f\nimport pkg.sub.c as c\n")
    (tmp_path / "pkg" / "sub" / "c.py").write_text("from pkg.sub import b\n")
    graph = import_graph(module_files(tmp_path, ("pkg",)))
    assert graph == {"pkg": {"pkg.a"}, "pkg.a": {"pkg.sub.b"}, "pkg.sub": set(),
                     "pkg.sub.b": {"pkg.a", "pkg.sub.c"}, "pkg.sub.c": {"pkg.sub.b"}}
    assert cycles(graph) == [["pkg.a", "pkg.sub.b", "pkg.sub.c"]]


def test_no_import_cycles():
    found = cycles(import_graph(module_files()))
    assert not found, "import cycles: " + "; ".join(" <-> ".join(c) for c in found)


def test_layers_point_down():
    """pallas_kernels imports no other project package; compression never imports recjax (DESIGN.md)."""
    graph = import_graph(module_files())
    for module, edges in graph.items():
        if module.startswith("pallas_kernels"):
            assert all(e.startswith("pallas_kernels") for e in edges), (module, edges)
        if module.startswith("compression"):
            assert not any(e.startswith("recjax") for e in edges), (module, edges)
