"""The table of annotation rules: primitive name -> rule.

A rule takes the jaxpr equation (``eqn.invars[i].aval.shape``, ``eqn.params``) and
returns an :class:`Annotation` or its text form. jscaler's own rules live in
``rules_*.py``; users add theirs with :func:`register_op`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from jscaler.errors import AnnotationError
from jscaler.ir.annotation import Annotation

__all__ = [
    "AnnotationRule",
    "Namer",
    "register_op",
    "unregister_op",
    "builtin_rule",
    "rule_for",
    "annotate_eqn",
]

AnnotationRule = Callable[[Any], "Annotation | str"]
_RULES: dict[str, AnnotationRule] = {}


def register_op(primitive: Any, annotation_fn: AnnotationRule | str) -> None:
    """Registers the dim annotation of a primitive (a custom one, or to override ours).

    Args:
      primitive: a ``jax.extend.core.Primitive`` or its name.
      annotation_fn: ``fn(eqn) -> Annotation | str`` computing the annotation of one
        equation from its shapes and params, or a fixed annotation string.

    Example::

        jscaler.register_op(my_gelu_p, "a b -> a b")
        jscaler.register_op(
            "my_matmul", lambda eqn: "m k+, k+ n -> m n"
        )
    """
    name = primitive if isinstance(primitive, str) else getattr(primitive, "name", None)
    if not isinstance(name, str):
        raise TypeError(f"register_op: expected a Primitive or its name, got {primitive!r}")
    if isinstance(annotation_fn, str):
        text = annotation_fn
        Annotation.parse(text)  # fail at registration, not at trace time
        _RULES[name] = lambda eqn: text
    elif callable(annotation_fn):
        _RULES[name] = annotation_fn
    else:
        raise TypeError(
            f"register_op({name!r}, ...): expected a function of the eqn or an annotation "
            f"string, got {type(annotation_fn).__name__}"
        )


def unregister_op(primitive: Any) -> None:
    """Removes the rule of a primitive (or its name), as if none had been registered; a
    primitive with no rule is left as it is. Undoes :func:`register_op` (in tests)."""
    name = primitive if isinstance(primitive, str) else getattr(primitive, "name", None)
    _RULES.pop(name, None)


def builtin_rule(*names: str):
    """Decorator for jscaler's built-in rules (``rules_*.py``): registers the function as
    the rule of each primitive in ``names`` that has none yet, so ``register_op`` wins."""

    def deco(fn):
        for n in names:
            _RULES.setdefault(n, fn)
        return fn

    return deco


def rule_for(name: str) -> AnnotationRule | None:
    """The rule registered for a primitive name, or None."""
    return _RULES.get(name)


def annotate_eqn(eqn) -> Annotation | None:
    """Annotates one equation, checked against its shapes; None when no rule exists."""
    rule = _RULES.get(eqn.primitive.name)
    if rule is None:
        return None
    ann = rule(eqn)
    if isinstance(ann, str):
        ann = Annotation.parse(ann)
    if not isinstance(ann, Annotation):
        raise AnnotationError(
            f"the rule for {eqn.primitive.name!r} returned {type(ann).__name__}; expected an "
            f"Annotation or its text"
        )
    return ann.bind([_shape(v) for v in eqn.invars], [_shape(v) for v in eqn.outvars])


def _shape(v) -> tuple[int, ...]:
    return tuple(getattr(v.aval, "shape", ()))


class Namer:
    """Builds annotations programmatically; the result names dims a, b, c, ... in order."""

    def __init__(self):
        self.kinds: dict[str, str] = {}
        self.sizes: dict[str, int] = {}

    def new(self, kind: str = "", size: int | None = None) -> str:
        """A fresh dim name; ``size`` is needed only for dims that appear only in groups."""
        name = f"_{len(self.kinds)}"
        self.kinds[name] = kind
        if size is not None:
            self.sizes[name] = size
        return name

    def fresh(self, n: int, kind: str = "") -> list[str]:
        return [self.new(kind) for _ in range(n)]

    def build(self, inputs, outputs) -> Annotation:
        """``inputs``/``outputs``: per tensor, a list of axes; an axis is a name or a tuple."""

        def tensor(t):
            return tuple((ax,) if isinstance(ax, str) else tuple(ax) for ax in t)

        return Annotation(
            tuple(map(tensor, inputs)), tuple(map(tensor, outputs)), self.kinds, self.sizes
        ).canonical()


def shapes(eqn):
    """(input shapes, output shapes) of an equation."""
    return [_shape(v) for v in eqn.invars], [_shape(v) for v in eqn.outvars]
