"""The import graph of a package, read from source with `ast`: its cycles and private imports.

Every `import X` and `from X import Y` counts, wherever it stands in a file (inside a function
too); relative imports are resolved. `import pkg.mod` is an edge to `pkg.mod`; `from pkg import
name` is an edge to `pkg.name` when that is a module of the package, else to `pkg`. Only edges
between modules of the package are kept.

    python -m jscaler.tools.imports [ROOT]

prints the module and edge counts, each cycle (a strongly connected component of more than one
module) and each private name (one leading underscore, not a dunder) imported from another module
of the package; it exits with status 1 if there is any cycle or private import.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path


def _modules(root: Path, package: bool = True) -> dict[str, Path]:
    """Module name -> file, for every `.py` file under `root`: a package directory (names
    start with its name), or with `package=False` a directory holding modules and packages."""
    root = Path(root)
    found = {}
    for path in sorted(root.rglob("*.py")):
        parts = ((root.name,) if package else ()) + path.relative_to(root).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        if parts:
            found[".".join(parts)] = path
    return found


def _imports(name: str, path: Path):
    """(module, imported name or None) for each import in the file; module may be outside."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, None
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                parts = parts[: len(parts) - (node.level - 1)]
                base = ".".join(parts + ([base] if base else []))
            for alias in node.names:
                yield base, alias.name


def _target(module: str, name: str | None, modules: dict[str, Path]) -> str | None:
    """The package module an import refers to, or None when it is outside the package."""
    if name is not None and f"{module}.{name}" in modules:
        return f"{module}.{name}"
    while module and module not in modules:
        module = module.rpartition(".")[0]
    return module or None


def import_graph(root) -> dict[str, set[str]]:
    """Module -> the modules of the same package it imports, for the package directory `root`."""
    modules = _modules(Path(root))
    graph = {name: set() for name in modules}
    for name, path in modules.items():
        for module, imported in _imports(name, path):
            target = _target(module, imported, modules)
            if target is not None and target != name:
                graph[name].add(target)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module, each sorted (Tarjan's
    algorithm, iterative)."""
    index, low, on_stack, stack, found = {}, {}, set(), [], []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return sorted(found)


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def private_imports(root, package: str | None = None) -> list[tuple[str, str, str]]:
    """(importer, module, name) for each private name or private module imported from another
    module of the package directory `root`. With `package` (a package name, e.g. "jscaler"),
    `root` is any directory (tests/, examples/): each of its files that imports a private
    name from that package, the importer given as its path under `root`."""
    root = Path(root)
    inside = package is None
    package = package or root.name
    modules = _modules(root, package=inside)
    found = []
    for name, path in modules.items():
        for module, imported in _imports(name, path):
            if module == name or not (module == package or module.startswith(package + ".")):
                continue
            parts = module.split(".") + ([imported] if imported else [])
            if any(_private(part) for part in parts[1:]):
                importer = name if inside else str(path.relative_to(root))
                found.append((importer, module, imported or module))
    return sorted(set(found))


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    root = Path(argv[0]) if argv else Path(__file__).resolve().parent.parent
    graph = import_graph(root)
    found = cycles(graph)
    private = private_imports(root)
    print(f"{len(graph)} modules, {sum(map(len, graph.values()))} edges, {len(found)} cycles")
    for component in found:
        print(f"cycle ({len(component)}): {' '.join(component)}")
    print(f"{len(private)} private imports")
    for importer, module, name in private:
        print(f"private: {importer} imports {name} from {module}")
    return 1 if found or private else 0


if __name__ == "__main__":
    sys.exit(main())
