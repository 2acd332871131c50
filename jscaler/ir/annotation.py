"""Dim annotations: an einsum-like signature per op, with nnScaler's split semantics.

An annotation names every axis of every input and output of an op. The same name on
several tensors is the same logical dim: splitting it splits all of them together. Each
name carries a kind:

* ``''``  splittable: sub-op i computes the i-th slice of the outputs from the i-th slices
  of the inputs;
* ``'+'`` splittable into partial sums: a dim that is reduced away (it appears in inputs
  only); sub-op i computes the i-th partial sum of the outputs;
* ``'^'`` not splittable.

An axis may group several dims, ``(h d)``: the axis is h-major. Only the first dim of a
group can be split into contiguous slices, so later dims of a group act as ``'^'`` there.

The text form follows nnScaler: ``"m k+, k+ n -> m n"``; ``()`` is a rank-0 tensor and
``(h d)`` a grouped axis. Example::

    >>> a = Annotation.parse("b (h d), h -> b h d")
    >>> a.bind([(8, 12), (3,)], [(8, 3, 4)]).sizes["d"]
    4
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from types import MappingProxyType

from jscaler.errors import AnnotationError

__all__ = ["Annotation", "KINDS"]

KINDS = ("", "+", "^")
_TOKEN = re.compile(r"\(|\)|[A-Za-z_][A-Za-z0-9_]*[+^]?")
Axis = tuple[str, ...]
TensorDims = tuple[Axis, ...]


@dataclass(frozen=True)
class Annotation:
    """The dim signature of one op.

    Attributes:
      inputs: per input tensor, its axes; each axis is a tuple of dim names (a group).
      outputs: per output tensor, its axes.
      kinds: dim name -> kind (``''``, ``'+'`` or ``'^'``).
      sizes: dim name -> size; empty until :meth:`bind` checks the annotation against
        shapes.
    """

    inputs: tuple[TensorDims, ...]
    outputs: tuple[TensorDims, ...]
    kinds: Mapping[str, str]
    sizes: Mapping[str, int] = field(default_factory=dict)

    def __post_init__(self):
        object.__setattr__(self, "kinds", MappingProxyType(dict(self.kinds)))
        object.__setattr__(self, "sizes", MappingProxyType(dict(self.sizes)))
        names = {d for t in self.inputs + self.outputs for ax in t for d in ax}
        missing = names - set(self.kinds)
        if missing:
            raise AnnotationError(f"dims {sorted(missing)} have no kind in {self}")
        for name, kind in self.kinds.items():
            if kind not in KINDS:
                raise AnnotationError(f"dim {name!r} has kind {kind!r}; expected one of {KINDS}")
        out_names = {d for t in self.outputs for ax in t for d in ax}
        for name in out_names:
            if self.kinds[name] == "+":
                raise AnnotationError(
                    f"dim {name!r} is marked '+' (partial sums) but appears in an output of "
                    f"{self}; '+' is for dims reduced away, mark it '' or '^'"
                )

    @cached_property
    def _key(self) -> tuple:  # annotations key the cost model's caches: made once each
        return (self.inputs, self.outputs, tuple(sorted(self.kinds.items())))

    @cached_property
    def _hash(self) -> int:
        return hash(self._key)

    def __hash__(self):
        return self._hash

    def __eq__(self, other):
        if self is other:
            return True
        return (
            isinstance(other, Annotation) and self._hash == other._hash and self._key == other._key
        )

    # ---- text form -------------------------------------------------------------------

    @classmethod
    def parse(cls, text: str) -> Annotation:
        """Parses ``"m k+, k+ n -> m n"``. Kinds must agree across a name's occurrences."""
        if text.count("->") != 1:
            raise AnnotationError(f"annotation {text!r} needs exactly one '->'")
        lhs, rhs = text.split("->")
        kinds: dict[str, str] = {}
        inputs = tuple(_parse_tensor(t, kinds, text) for t in _split_tensors(lhs))
        outputs = tuple(_parse_tensor(t, kinds, text) for t in _split_tensors(rhs))
        return cls(inputs, outputs, kinds)

    def __str__(self):
        def tensor(t):
            if not t:
                return "()"
            return " ".join(
                " ".join(self._fmt(d) for d in ax)
                if len(ax) == 1
                else "(" + " ".join(self._fmt(d) for d in ax) + ")"
                for ax in t
            )

        return ", ".join(map(tensor, self.inputs)) + " -> " + ", ".join(map(tensor, self.outputs))

    def _fmt(self, name: str) -> str:
        return name + self.kinds[name]

    # ---- queries ---------------------------------------------------------------------

    @property
    def dims(self) -> tuple[str, ...]:
        """Every dim name, in first-appearance order."""
        seen: dict[str, None] = {}
        for t in self.inputs + self.outputs:
            for ax in t:
                for d in ax:
                    seen.setdefault(d)
        return tuple(seen)

    def canonical(self) -> Annotation:
        """The same annotation with dims renamed a, b, c, ... in order of appearance.

        Two annotations that differ only in names have equal canonical forms.
        """
        order = self.dims
        new = {d: _letters(i) for i, d in enumerate(order)}

        def tensor(t):
            return tuple(tuple(new[d] for d in ax) for ax in t)

        return Annotation(
            tuple(map(tensor, self.inputs)),
            tuple(map(tensor, self.outputs)),
            {new[d]: self.kinds[d] for d in order},
            {new[d]: s for d, s in self.sizes.items() if d in new},
        )

    def splittable(self) -> tuple[str, ...]:
        """Dims that can be split: kind '' or '+', and first in every group they appear in."""
        found = self.__dict__.get("_splittable")  # asked per sub-op by the planners: once
        if found is None:
            found = tuple(d for d in self.dims if self.kinds[d] != "^" and self._leads_groups(d))
            object.__setattr__(self, "_splittable", found)
        return found

    def _leads_groups(self, name: str) -> bool:
        return all(ax[0] == name for t in self.inputs + self.outputs for ax in t if name in ax)

    def is_reduction(self, name: str) -> bool:
        """True when ``name`` appears in inputs only (splitting it gives partial sums)."""
        return all(name not in ax for t in self.outputs for ax in t)

    def positions(self, name: str) -> tuple[tuple[str, int, int], ...]:
        """Where a dim occurs: ``(side, tensor index, axis index)`` with side 'in'/'out'."""
        found = []
        for side, tensors in (("in", self.inputs), ("out", self.outputs)):
            for ti, t in enumerate(tensors):
                for ai, ax in enumerate(t):
                    if name in ax:
                        found.append((side, ti, ai))
        return tuple(found)

    # ---- checking against shapes -----------------------------------------------------

    def bind(
        self, in_shapes: Sequence[Sequence[int]], out_shapes: Sequence[Sequence[int]]
    ) -> Annotation:
        """Returns a copy with ``sizes`` filled in, checking every axis against the shapes.

        Raises:
          AnnotationError: tensor counts, ranks or sizes disagree with the shapes.
        """
        for side, dims, shapes in (
            ("inputs", self.inputs, in_shapes),
            ("outputs", self.outputs, out_shapes),
        ):
            if len(dims) != len(shapes):
                raise AnnotationError(
                    f"annotation {self} has {len(dims)} {side}; the op has {len(shapes)}"
                )
        pairs = [
            (ax, int(size))
            for dims, shapes in ((self.inputs, in_shapes), (self.outputs, out_shapes))
            for t, shape in zip(dims, shapes, strict=True)
            for ax, size in _axes_of(self, t, shape)
        ]
        sizes: dict[str, int] = dict(self.sizes)
        changed = True
        while changed:  # single dims fix sizes; groups with one unknown dim solve for it
            changed = False
            for ax, size in pairs:
                unknown = [d for d in ax if d not in sizes]
                if len(unknown) == 1:
                    known = math.prod(sizes[d] for d in ax if d in sizes)
                    if known == 0 or size % known:
                        raise AnnotationError(
                            f"annotation {self}: axis {_fmt_axis(ax)} of size {size} cannot "
                            f"hold the known dims of size {known}"
                        )
                    sizes[unknown[0]] = size // known
                    changed = True
        for ax, size in pairs:
            unknown = [d for d in ax if d not in sizes]
            if unknown:
                raise AnnotationError(
                    f"annotation {self}: cannot infer the sizes of {unknown} in axis "
                    f"{_fmt_axis(ax)}; name them in an ungrouped axis elsewhere"
                )
            if math.prod(sizes[d] for d in ax) != size:
                raise AnnotationError(
                    f"annotation {self}: axis {_fmt_axis(ax)} should have size "
                    f"{math.prod(sizes[d] for d in ax)} (dims {[sizes[d] for d in ax]}) "
                    f"but the op's tensor has {size} there"
                )
        return Annotation(self.inputs, self.outputs, self.kinds, sizes)


def _letters(i: int) -> str:
    return chr(ord("a") + i % 26) + (str(i // 26) if i >= 26 else "")


def _axes_of(ann, t: TensorDims, shape: Sequence[int]):
    if len(t) != len(shape):
        raise AnnotationError(
            f"annotation {ann}: a tensor annotated with {len(t)} axes has shape "
            f"{tuple(shape)} (rank {len(shape)})"
        )
    return zip(t, shape, strict=True)


def _fmt_axis(ax: Axis) -> str:
    return ax[0] if len(ax) == 1 else "(" + " ".join(ax) + ")"


def _split_tensors(side: str) -> list[str]:
    side = side.strip()
    return [] if not side else [s.strip() for s in side.split(",")]


def _parse_tensor(text: str, kinds: dict[str, str], whole: str) -> TensorDims:
    if text.replace(" ", "") == "()":
        return ()
    consumed = "".join(_TOKEN.findall(text))
    if consumed != text.replace(" ", ""):
        raise AnnotationError(f"annotation {whole!r}: cannot read {text!r}")
    axes: list[Axis] = []
    group: list[str] | None = None
    for tok in _TOKEN.findall(text):
        if tok == "(":
            if group is not None:
                raise AnnotationError(f"annotation {whole!r}: nested '(' in {text!r}")
            group = []
            continue
        if tok == ")":
            if not group:
                raise AnnotationError(f"annotation {whole!r}: empty or unopened group in {text!r}")
            axes.append(tuple(group))
            group = None
            continue
        name, kind = (tok[:-1], tok[-1]) if tok[-1] in "+^" else (tok, "")
        if kinds.setdefault(name, kind) != kind:
            raise AnnotationError(
                f"annotation {whole!r}: dim {name!r} is marked both {kinds[name]!r} and "
                f"{kind!r}; a dim has one kind everywhere"
            )
        if group is None:
            axes.append((name,))
        else:
            group.append(name)
    if group is not None:
        raise AnnotationError(f"annotation {whole!r}: unclosed '(' in {text!r}")
    return tuple(axes)
