"""Spaces from text: ``parse_plan("megatron(tp=2, dp=4)")``, as ``--plan`` and the benchmarks
take them.

Not imported by ``spaces/__init__`` (this module reads ``SPACES`` from it), so import it as
``from spaces.parse import parse_plan``.
"""

from __future__ import annotations

import ast
import os

from jscaler.errors import PlanError
from jscaler.search import auto, intra_op
from spaces import SPACES

__all__ = ["parse_call", "parse_plan"]


def parse_call(expr: str, flag: str, table: dict, error, expected: str):
    """``(name, args, kwargs)`` of ``"name"`` or ``"name(literal, key=literal)"`` with
    ``name`` in ``table``; args and kwargs are None for a bare name. A malformed ``expr``
    raises ``error`` with a message naming ``flag`` and what was ``expected``."""
    try:
        node = ast.parse(expr.strip(), mode="eval").body
    except SyntaxError as e:
        raise error(f"{flag} {expr!r} is not an expression: {e.msg}") from None
    name = node.id if isinstance(node, ast.Name) else getattr(getattr(node, "func", None), "id", "")
    if not isinstance(node, ast.Name | ast.Call) or name not in table:
        raise error(f"{flag} {expr!r}: expected {expected}")
    if isinstance(node, ast.Name):
        return name, None, None
    try:
        args = [ast.literal_eval(a) for a in node.args]
        kwargs = {k.arg: ast.literal_eval(k.value) for k in node.keywords}
    except ValueError:
        raise error(f"{flag} {expr!r}: arguments must be literals") from None
    return name, args, kwargs


def parse_plan(expr: str):
    """A space from ``"megatron(tp=2, dp=4)"`` (literal arguments only), a bare space
    name, or a plan JSON path (returned as the path)."""
    if os.path.isfile(expr):
        return expr
    table = SPACES | {"intra_op": intra_op, "auto": auto}
    expected = (
        f'a call of one of {sorted(table)} such as "megatron(tp=2)", "auto" (searched), or '
        f"a plan JSON path"
    )
    name, args, kwargs = parse_call(expr, "--plan", table, PlanError, expected)
    if args is None:
        return table[name]()
    try:
        return table[name](*args, **kwargs)
    except TypeError as e:
        raise PlanError(f"--plan {expr!r}: {e}") from None
