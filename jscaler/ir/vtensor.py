"""The mask algebra of tensor pieces: nnScaler's pTensor / vTensor.

A :class:`PTensor` is a logical tensor of the traced graph. A :class:`VTensor` is a piece
of one, given by a :class:`Mask`: a half-open slice ``[start, stop)`` per dim plus a
*value partition*, the sub-interval ``[lo, hi)`` of the unit interval that says which part
of the value the piece holds (the full tensor is the sum of its value parts). "Partial sum
k of n" is ``[k/n, (k+1)/n)``; the whole value is ``[0, 1)``.

Treating the value range as one more box dimension (with exact ``Fraction`` endpoints)
makes intersection, containment, subtraction and coverage plain box operations over
(spatial dims x value dim). That is what lets the planner ask, exactly and without
sampling, which producer pieces a consumer piece depends on (:func:`producers_for`) and
whether a set of pieces rebuilds a tensor (:func:`covers`, :func:`is_partition`).
"""

from __future__ import annotations

import operator
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from fractions import Fraction

from jscaler.errors import MaskError

__all__ = [
    "Mask",
    "PTensor",
    "VTensor",
    "covers",
    "is_partition",
    "producers_for",
    "uncovered",
]

_FULL_VALUE = (Fraction(0), Fraction(1))


def _as_int(x: object, what: str) -> int:
    """Converts an index-like value to ``int``; bools and non-integers are MaskErrors."""
    if not isinstance(x, bool):
        try:
            return operator.index(x)
        except TypeError:
            pass
    raise MaskError(f"{what}: expected an int, found {type(x).__name__} {x!r}")


def _as_fraction(x: object, what: str) -> Fraction:
    """Converts an int, Fraction or ``"k/n"`` string to ``Fraction``; floats are refused
    because they cannot say 1/3 exactly."""
    if isinstance(x, Fraction):
        return x
    if isinstance(x, str):
        try:
            return Fraction(x)
        except (ValueError, ZeroDivisionError):
            pass
    elif not isinstance(x, bool | float):
        try:
            return Fraction(operator.index(x))
        except TypeError:
            pass
    raise MaskError(
        f"{what}: expected an int, a Fraction or a 'k/n' string, found {type(x).__name__} {x!r}"
    )


def _pair(x: object, what: str) -> tuple[object, object]:
    if isinstance(x, str | bytes) or not isinstance(x, Sequence) or len(x) != 2:
        raise MaskError(f"{what}: expected a pair (start, stop), found {x!r}")
    return x[0], x[1]


def _frac_str(f: Fraction) -> str:
    return str(f.numerator) if f.denominator == 1 else f"{f.numerator}/{f.denominator}"


def _make(slices: tuple[tuple[int, int], ...], value: tuple[Fraction, Fraction]) -> Mask:
    """Builds a Mask from already-normalised parts, skipping validation (hot paths)."""
    m = object.__new__(Mask)
    object.__setattr__(m, "slices", slices)
    object.__setattr__(m, "value", value)
    return m


@dataclass(frozen=True)
class PTensor:
    """A logical tensor of the traced graph.

    Attributes:
      id: unique within the graph.
      shape: its extent per dim (rank 0 for a scalar).
      dtype: its element type, by name.
    """

    id: int
    shape: tuple[int, ...]
    dtype: str = "float32"

    def __post_init__(self):
        tid = _as_int(self.id, "PTensor id")
        if isinstance(self.shape, str | bytes) or not isinstance(self.shape, Iterable):
            raise MaskError(f"PTensor {tid}: expected a shape tuple, found {self.shape!r}")
        shape = tuple(_as_int(s, f"PTensor {tid} shape") for s in self.shape)
        if any(s < 0 for s in shape):
            raise MaskError(f"PTensor {tid}: expected non-negative extents, found {shape}")
        if not isinstance(self.dtype, str) or not self.dtype:
            raise MaskError(f"PTensor {tid}: expected a dtype name, found {self.dtype!r}")
        object.__setattr__(self, "id", tid)
        object.__setattr__(self, "shape", shape)


@dataclass(frozen=True, repr=False)
class Mask:
    """Which part of a pTensor a piece holds: a box over (spatial dims x value range).

    Attributes:
      slices: ``(start, stop)`` per dim, half-open, ``0 <= start < stop``. Lists, numpy ints
        and the like are normalised to a tuple of int pairs.
      value: ``(lo, hi)`` with ``0 <= lo < hi <= 1``: the piece holds that part of the value
        (the whole tensor is the sum of its value parts). Ints, Fractions and ``"k/n"``
        strings are accepted; the default ``(0, 1)`` is the full value.
    """

    slices: tuple[tuple[int, int], ...]
    value: tuple[Fraction, Fraction] = _FULL_VALUE

    def __post_init__(self):
        raw = self.slices
        if isinstance(raw, str | bytes) or not isinstance(raw, Iterable):
            raise MaskError(f"Mask slices: expected a tuple of (start, stop), found {raw!r}")
        slices = []
        for d, pair in enumerate(raw):
            a, b = _pair(pair, f"Mask slice of dim {d}")
            start = _as_int(a, f"Mask start of dim {d}")
            stop = _as_int(b, f"Mask stop of dim {d}")
            if not 0 <= start < stop:
                raise MaskError(
                    f"Mask slice of dim {d}: expected 0 <= start < stop, found [{start}, {stop})"
                )
            slices.append((start, stop))
        a, b = _pair(self.value, "Mask value range")
        lo = _as_fraction(a, "Mask value lo")
        hi = _as_fraction(b, "Mask value hi")
        if not 0 <= lo < hi <= 1:
            raise MaskError(f"Mask value range: expected 0 <= lo < hi <= 1, found [{lo}, {hi})")
        object.__setattr__(self, "slices", tuple(slices))
        object.__setattr__(self, "value", (lo, hi))

    @classmethod
    def full(cls, shape: Sequence[int]) -> Mask:
        """The whole of a tensor of ``shape``: every element, the full value."""
        if cls is Mask and all(type(s) is int and s > 0 for s in shape):
            return _make(tuple((0, s) for s in shape), _FULL_VALUE)  # nothing to check
        return cls(tuple((0, s) for s in shape))

    @classmethod
    def partial(cls, slices: Sequence[tuple[int, int]], k: int, n: int) -> Mask:
        """The ``slices`` box holding partial sum ``k`` of ``n``: value ``[k/n, (k+1)/n)``."""
        n = _as_int(n, "Mask.partial n")
        k = _as_int(k, "Mask.partial k")
        if n < 1 or not 0 <= k < n:
            raise MaskError(f"Mask.partial: expected n >= 1 and 0 <= k < n, found k={k}, n={n}")
        return cls(slices, (Fraction(k, n), Fraction(k + 1, n)))

    @property
    def ndim(self) -> int:
        return len(self.slices)

    @property
    def shape(self) -> tuple[int, ...]:
        """The extent of the piece per dim (its local array shape)."""
        return tuple(b - a for a, b in self.slices)

    @property
    def is_partial(self) -> bool:
        """Whether the piece holds only part of the value (so pieces must be summed)."""
        return self.value != _FULL_VALUE

    def fits(self, shape: Sequence[int]) -> bool:
        """Whether this mask lies inside a tensor of ``shape`` (same rank, stops in range)."""
        return len(shape) == self.ndim and all(b <= s for (_, b), s in zip(self.slices, shape))

    def _check_rank(self, other: Mask, op: str) -> None:
        if not isinstance(other, Mask):
            raise MaskError(f"Mask.{op}: expected a Mask, found {type(other).__name__}")
        if other.ndim != self.ndim:
            raise MaskError(
                f"Mask.{op}: expected masks of the same rank, found rank {self.ndim} ({self}) "
                f"and rank {other.ndim} ({other})"
            )

    def split(self, dim: int, n: int, i: int) -> Mask:
        """Chunk ``i`` of ``n`` equal contiguous chunks of this mask along ``dim``."""
        dim, n, i = _as_int(dim, "split dim"), _as_int(n, "split n"), _as_int(i, "split i")
        if not -self.ndim <= dim < self.ndim:
            raise MaskError(f"Mask.split: expected dim in [0, {self.ndim}), found {dim}")
        dim %= self.ndim
        if n < 1 or not 0 <= i < n:
            raise MaskError(f"Mask.split: expected n >= 1 and 0 <= i < n, found i={i}, n={n}")
        start, stop = self.slices[dim]
        extent = stop - start
        if extent % n:
            raise MaskError(
                f"Mask.split: dim {dim} has extent {extent}, which n={n} does not divide "
                f"(mask {self})"
            )
        step = extent // n
        slices = list(self.slices)
        slices[dim] = (start + i * step, start + (i + 1) * step)
        return _make(tuple(slices), self.value)

    def split_value(self, n: int, i: int) -> Mask:
        """Part ``i`` of ``n`` equal parts of this mask's value range (nested partial sums)."""
        n, i = _as_int(n, "split_value n"), _as_int(i, "split_value i")
        if n < 1 or not 0 <= i < n:
            raise MaskError(f"Mask.split_value: expected n >= 1 and 0 <= i < n, found i={i}, n={n}")
        lo, hi = self.value
        w = (hi - lo) / n
        return _make(self.slices, (lo + i * w, lo + (i + 1) * w))

    def intersect(self, other: Mask) -> Mask | None:
        """The common box of two masks, or None when they share no point."""
        self._check_rank(other, "intersect")
        slices = []
        for (a, b), (c, d) in zip(self.slices, other.slices):
            lo, hi = max(a, c), min(b, d)
            if lo >= hi:
                return None
            slices.append((lo, hi))
        lo, hi = max(self.value[0], other.value[0]), min(self.value[1], other.value[1])
        if lo >= hi:
            return None
        return _make(tuple(slices), (lo, hi))

    def intersects(self, other: Mask) -> bool:
        """Whether the two masks share a point (so one piece depends on the other)."""
        return self.intersect(other) is not None

    def contains(self, other: Mask) -> bool:
        """Whether every point of ``other`` lies in this mask."""
        self._check_rank(other, "contains")
        return all(a <= c and d <= b for (a, b), (c, d) in zip(self.slices, other.slices)) and (
            self.value[0] <= other.value[0] and other.value[1] <= self.value[1]
        )

    def subtract(self, other: Mask) -> tuple[Mask, ...]:
        """Disjoint boxes covering this mask minus ``other``: at most ``2 * (ndim + 1)``.

        Peels the parts below and above the intersection one dim at a time (value dim
        last), shrinking the remainder to the intersection's range in that dim.
        """
        cut = self.intersect(other)
        if cut is None:
            return (self,)
        rest = [*self.slices, self.value]
        out = []
        for d, ((lo, hi), (clo, chi)) in enumerate(zip(rest, [*cut.slices, cut.value])):
            if lo < clo:
                rest[d] = (lo, clo)
                out.append(_make(tuple(rest[:-1]), rest[-1]))
            if chi < hi:
                rest[d] = (chi, hi)
                out.append(_make(tuple(rest[:-1]), rest[-1]))
            rest[d] = (clo, chi)
        return tuple(out)

    def volume(self) -> Fraction:
        """Number of elements times the value fraction held: exact, so volumes add up."""
        v = self.value[1] - self.value[0]
        for a, b in self.slices:
            v *= b - a
        return v

    def relative_to(self, outer: Mask) -> Mask:
        """This mask in the coordinates of ``outer``, which must contain it.

        The slices become offsets into ``outer``'s local array (for slicing a piece out of
        a bigger held piece); the value range is rescaled so that ``outer``'s range is
        ``[0, 1)`` (e.g. half of a half is ``[0, 1/2)`` relative to that half).
        """
        self._check_rank(outer, "relative_to")
        if not outer.contains(self):
            raise MaskError(f"Mask.relative_to: expected a mask inside {outer}, found {self}")
        slices = tuple((a - o, b - o) for (a, b), (o, _) in zip(self.slices, outer.slices))
        olo, ohi = outer.value
        w = ohi - olo
        return _make(slices, ((self.value[0] - olo) / w, (self.value[1] - olo) / w))

    def to_json(self) -> dict:
        """A JSON-able dict; fractions are ``"k/n"`` strings, so the round trip is exact."""
        return {
            "slices": [[a, b] for a, b in self.slices],
            "value": [f"{f.numerator}/{f.denominator}" for f in self.value],
        }

    @classmethod
    def from_json(cls, d: dict) -> Mask:
        """Inverse of :meth:`to_json`; validates like the constructor."""
        if not isinstance(d, dict) or "slices" not in d:
            raise MaskError(f"Mask.from_json: expected a dict with 'slices', found {d!r}")
        return cls(d["slices"], d.get("value", _FULL_VALUE))

    def __str__(self) -> str:
        body = "[" + ", ".join(f"{a}:{b}" for a, b in self.slices) + "]"
        if self.is_partial:
            body += f" v{_frac_str(self.value[0])}..{_frac_str(self.value[1])}"
        return body

    def __repr__(self) -> str:
        return f"Mask({self})"


@dataclass(frozen=True)
class VTensor:
    """A piece of a pTensor: the tensor and the mask of the part it holds.

    ``tensor`` is normally a :class:`PTensor`; any object with ``id`` and ``shape`` works
    (the graph's own tensor class, say).
    """

    tensor: PTensor
    mask: Mask

    def __post_init__(self):
        t, m = self.tensor, self.mask
        if not (hasattr(t, "id") and hasattr(t, "shape")):
            raise MaskError(f"VTensor: expected a PTensor, found {type(t).__name__}")
        if not isinstance(m, Mask):
            raise MaskError(f"VTensor of pTensor {t.id}: expected a Mask, found {m!r}")
        shape = tuple(t.shape)
        if m.ndim != len(shape):
            raise MaskError(
                f"VTensor: mask {m} has rank {m.ndim}, but pTensor {t.id} has shape {shape} "
                f"(rank {len(shape)})"
            )
        if not m.fits(shape):
            raise MaskError(f"VTensor: mask {m} does not fit pTensor {t.id} of shape {shape}")

    @classmethod
    def full(cls, tensor: PTensor) -> VTensor:
        """The whole of ``tensor``."""
        return cls(tensor, Mask.full(tensor.shape))

    def _check_same(self, other: VTensor, op: str) -> None:
        if not isinstance(other, VTensor) or other.tensor != self.tensor:
            found = other.tensor.id if isinstance(other, VTensor) else type(other).__name__
            raise MaskError(
                f"VTensor.{op}: expected a piece of pTensor {self.tensor.id}, found {found}"
            )

    def intersect(self, other: VTensor) -> VTensor | None:
        """The common piece of two pieces of the same pTensor, or None."""
        self._check_same(other, "intersect")
        m = self.mask.intersect(other.mask)
        return None if m is None else VTensor(self.tensor, m)

    def intersects(self, other: VTensor) -> bool:
        self._check_same(other, "intersects")
        return self.mask.intersects(other.mask)

    def contains(self, other: VTensor) -> bool:
        self._check_same(other, "contains")
        return self.mask.contains(other.mask)

    def __str__(self) -> str:
        return f"t{self.tensor.id}{self.mask}"


def uncovered(pieces: Iterable[Mask], target: Mask) -> tuple[Mask, ...]:
    """Disjoint boxes of ``target`` that no piece covers (``()`` when fully covered).

    Box subtraction: the remainder starts as ``target``; each piece in turn is subtracted
    from every remainder box it intersects. The pieces may overlap each other and stick out
    of the target. Exact, since all endpoints are ints or Fractions.
    """
    remaining = [target]
    for p in pieces:
        target._check_rank(p, "uncovered")
        nxt = []
        for r in remaining:
            nxt.extend(r.subtract(p))
        remaining = nxt
        if not remaining:
            break
    return tuple(remaining)


def covers(pieces: Iterable[Mask], target: Mask) -> bool:
    """Whether the union of ``pieces`` holds every point of ``target`` (spatial x value)."""
    return not uncovered(pieces, target)


def producers_for(consumer: Mask, producers: Sequence[Mask]) -> tuple[int, ...]:
    """Indices, in order, of the producer pieces whose masks intersect ``consumer``'s."""
    return tuple(i for i, p in enumerate(producers) if consumer.intersects(p))


def is_partition(pieces: Iterable[Mask], target: Mask) -> bool:
    """Whether ``pieces`` are pairwise disjoint and together are exactly ``target``.

    Pieces inside the target and pairwise disjoint cover it iff their volumes sum to its
    volume, which is exact with Fractions.
    """
    pieces = list(pieces)
    if not all(target.contains(p) for p in pieces):
        return False
    for i, p in enumerate(pieces):
        for q in pieces[i + 1 :]:
            if p.intersects(q):
                return False
    return sum((p.volume() for p in pieces), Fraction(0)) == target.volume()
