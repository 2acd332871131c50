"""The structure the brief pins: the engine never imports spaces/, schedules/, models/ or
bench/ (only jscaler/cli/ turns names into them); the public API is exported once."""

import ast
from pathlib import Path

import jscaler

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
