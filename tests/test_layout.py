"""The structure the brief pins: the engine never imports spaces/, schedules/, models/ or
bench/ (only jscaler/cli/ turns names into them); the public API is exported once; no
import cycles under jscaler/ and no private names imported across modules
(``python -m jscaler.tools.imports`` prints both)."""

import ast
from pathlib import Path

import jscaler
from jscaler.tools.imports import cycles, import_graph, private_imports

ROOT = Path(__file__).resolve().parent.parent
OUTSIDE = {"spaces", "schedules", "models", "bench"}


def imported(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.add(node.module.split(".")[0])
    return found


def test_the_engine_does_not_import_spaces_schedules_models_or_bench():
    engine = [
        p for p in (ROOT / "jscaler").rglob("*.py") if "cli" not in p.relative_to(ROOT).parts[1:2]
    ]
    assert len(engine) > 50
    bad = {str(p.relative_to(ROOT)): imported(p) & OUTSIDE for p in engine}
    assert not {k: v for k, v in bad.items() if v}


def test_every_public_name_is_exported_once_and_documented():
    assert len(jscaler.__all__) == len(set(jscaler.__all__))
    for name in jscaler.__all__:
        obj = getattr(jscaler, name)
        if callable(obj):
            assert (obj.__doc__ or "").strip(), f"jscaler.{name} has no docstring"


def test_no_import_cycles_under_jscaler():
    """Counting imports inside functions: a lazy import that closes a cycle is still one."""
    found = cycles(import_graph(ROOT / "jscaler"))
    assert not found, "import cycles:\n" + "\n".join(" ".join(c) for c in found)


def test_no_private_names_imported_across_modules():
    found = private_imports(ROOT / "jscaler")
    for outside in ("tests", "bench", "examples", "spaces", "schedules", "models"):
        found += [
            (f"{outside}/{f}", m, n) for f, m, n in private_imports(ROOT / outside, "jscaler")
        ]
    assert not found, "private imports:\n" + "\n".join(f"{f}: {n} from {m}" for f, m, n in found)


def test_the_import_checker_finds_a_cycle_and_a_private_import(tmp_path):
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from pkg.sub import b\n")
    (pkg / "sub" / "b.py").write_text("def f():\n    from ..c import _hidden\n")
    (pkg / "c.py").write_text("import pkg.a\n_hidden = 1\n")
    (pkg / "d.py").write_text("from pkg import a, _e\n")
    (pkg / "_e.py").write_text("")
    graph = import_graph(pkg)
    assert graph["pkg.sub.b"] == {"pkg.c"} and graph["pkg.d"] == {"pkg.a", "pkg._e"}
    assert cycles(graph) == [["pkg.a", "pkg.c", "pkg.sub.b"]]
    assert private_imports(pkg) == [
        ("pkg.d", "pkg", "_e"),
        ("pkg.sub.b", "pkg.c", "_hidden"),
    ]
    (tmp_path / "user.py").write_text("from pkg.c import _hidden\nimport pkg.a\n")
    assert private_imports(tmp_path, package="pkg") == [
        ("pkg/d.py", "pkg", "_e"),
        ("pkg/sub/b.py", "pkg.c", "_hidden"),
        ("user.py", "pkg.c", "_hidden"),
    ]


def foreign_private_attributes(path: Path, root: Path = ROOT) -> list[str]:
    """``obj._name`` (``obj`` not ``self``/``cls``) where this file defines no ``_name``
    (a function, a class attribute, or ``self._name = ...``): another module's private
    attribute, read or written."""
    tree = ast.parse(path.read_text())
    own = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            own.add(node.name)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            own.add(node.id)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            if isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
                own.add(node.attr)
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Attribute):
            continue
        name = node.attr
        if not name.startswith("_") or name.startswith("__") or name in own:
            continue
        if isinstance(node.value, ast.Name) and node.value.id in ("self", "cls", "os"):
            continue  # os._exit: the standard library's documented exit
        found.append(f"{path.relative_to(root)}:{node.lineno}: {ast.unparse(node)}")
    return found


def test_no_module_or_test_touches_another_modules_private_attributes():
    dirs = ["jscaler", "tests", "bench", "examples", "spaces", "schedules", "models"]
    bad = [hit for d in dirs for p in sorted((ROOT / d).rglob("*.py"))
           for hit in foreign_private_attributes(p)]  # fmt: skip
    assert not bad, "\n".join(bad)


def test_the_private_attribute_check_finds_a_foreign_one(tmp_path):
    (tmp_path / "m.py").write_text(
        "class A:\n    def __init__(self):\n        self._mine = 1\n\n"
        "def f(a, b):\n    return a._mine + b._theirs\n"
    )
    assert foreign_private_attributes(tmp_path / "m.py", tmp_path) == ["m.py:6: b._theirs"]


def test_readme_is_a_front_page_linking_every_docs_page():
    import re

    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 250
    linked = set(re.findall(r"\]\(([^)#\s]+)", readme))
    local = {link for link in linked if "://" not in link}
    assert all((ROOT / link).exists() for link in local), sorted(
        link for link in local if not (ROOT / link).exists()
    )
    pages = {f"docs/{p.name}" for p in (ROOT / "docs").glob("*.md")}
    assert pages <= local, sorted(pages - local)
    for page in (ROOT / "docs").glob("*.md"):  # and the pages' own links resolve
        for link in re.findall(r"\]\(([^)#\s]+)", page.read_text()):
            if "://" not in link:
                assert (page.parent / link).exists(), f"{page.name}: {link}"
