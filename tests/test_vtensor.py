"""Tests of the pTensor/vTensor mask algebra against a brute-force point-set oracle.

The oracle turns a mask into the set of its points: every integer point of the spatial box,
crossed with the midpoints ``(2j+1)/(2L)`` of the value grid, where ``L`` is the lcm of the
value denominators in play. All value endpoints are multiples of ``1/L``, so two masks
overlap, contain or cover each other exactly when their point sets do.
"""

from __future__ import annotations

import itertools
import json
import math
import os
from fractions import Fraction

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jscaler.errors import MaskError
from jscaler.ir.vtensor import (
    Mask,
    PTensor,
    VTensor,
    covers,
    is_partition,
    producers_for,
    uncovered,
)

SETTINGS = settings(
    max_examples=int(os.environ.get("JSCALER_HYPOTHESIS_EXAMPLES", "200")), deadline=None
)
DENOMS = (1, 2, 3, 4, 6, 8)


# ---------------------------------------------------------------- oracle


def lcm_of(*masks: Mask) -> int:
    return math.lcm(1, *(f.denominator for m in masks for f in m.value))


def points(m: Mask, L: int) -> set:
    """Every (spatial point, value cell) of ``m`` on a value grid of ``L`` cells."""
    lo, hi = m.value
    assert (lo * L).denominator == 1 and (hi * L).denominator == 1
    cells = range(int(lo * L), int(hi * L))
    spatial = itertools.product(*(range(a, b) for a, b in m.slices))
    return {(p, j) for p in spatial for j in cells}


def union_points(masks, L: int) -> set:
    out = set()
    for m in masks:
        out |= points(m, L)
    return out


# ---------------------------------------------------------------- strategies


@st.composite
def shapes(draw, min_rank=0, max_rank=3):
    return tuple(draw(st.lists(st.integers(1, 5), min_size=min_rank, max_size=max_rank)))


@st.composite
def values(draw):
    n = draw(st.sampled_from(DENOMS))
    lo = draw(st.integers(0, n - 1))
    hi = draw(st.integers(lo + 1, n))
    return (Fraction(lo, n), Fraction(hi, n))


@st.composite
def masks_in(draw, shape):
    slices = []
    for s in shape:
        a = draw(st.integers(0, s - 1))
        b = draw(st.integers(a + 1, s))
        slices.append((a, b))
    full_value = draw(st.booleans())
    return Mask(tuple(slices), (0, 1) if full_value else draw(values()))


@st.composite
def masks_within(draw, outer):
    """A mask inside ``outer`` (so overlaps and near-partitions are common)."""
    local = draw(masks_in(outer.shape))
    olo, w = outer.value[0], outer.value[1] - outer.value[0]
    slices = tuple((a + o, b + o) for (a, b), (o, _) in zip(local.slices, outer.slices))
    return Mask(slices, tuple(olo + v * w for v in local.value))


@st.composite
def mask_pairs(draw):
    shape = draw(shapes())
    return draw(masks_in(shape)), draw(masks_in(shape))


@st.composite
def target_and_pieces(draw):
    """A target mask and 0..6 pieces; half the time the pieces start from a partition of
    the target (some dropped, some extras), so both outcomes of covers() are common."""
    shape = draw(shapes())
    target = draw(masks_in(shape))
    pieces = []
    if draw(st.booleans()):
        dim_splits = []
        for d, e in enumerate(target.shape):
            n = draw(st.sampled_from([k for k in (1, 2, 3) if e % k == 0]))
            dim_splits.append((d, n))
        parts = [target]
        for d, n in dim_splits:
            parts = [p.split(d, n, i) for p in parts for i in range(n)]
        nv = draw(st.integers(1, 2))
        parts = [p.split_value(nv, i) for p in parts for i in range(nv)]
        parts = parts[:6]
        keep = draw(st.lists(st.booleans(), min_size=len(parts), max_size=len(parts)))
        pieces = [p for p, k in zip(parts, keep) if k or draw(st.integers(0, 3)) > 0]
    extras = masks_within(target) if draw(st.booleans()) else masks_in(shape)
    extra = draw(st.lists(extras, max_size=6 - min(len(pieces), 6)))
    pieces = pieces + extra
    return target, draw(st.permutations(pieces)) if pieces else []


@st.composite
def splittable(draw):
    """A mask, a dim and a divisor n of its extent in that dim."""
    shape = draw(shapes(min_rank=1))
    m = draw(masks_in(shape))
    dim = draw(st.integers(0, m.ndim - 1))
    e = m.shape[dim]
    n = draw(st.sampled_from([k for k in range(1, e + 1) if e % k == 0]))
    return m, dim, n


# ---------------------------------------------------------------- properties


@SETTINGS
@given(mask_pairs())
def test_intersect_matches_oracle(pair):
    a, b = pair
    L = lcm_of(a, b)
    ab, ba = a.intersect(b), b.intersect(a)
    assert ab == ba
    expected = points(a, L) & points(b, L)
    if ab is None:
        assert not expected
    else:
        assert points(ab, L) == expected
    assert a.intersects(b) == b.intersects(a) == bool(expected)
    assert a.contains(b) == (points(b, L) <= points(a, L))
    assert a.contains(a) and a.intersects(a)


@SETTINGS
@given(mask_pairs())
def test_subtract_matches_oracle(pair):
    a, b = pair
    parts = a.subtract(b)
    assert len(parts) <= 2 * (a.ndim + 1)
    L = lcm_of(a, b, *parts)
    seen = set()
    for p in parts:
        pts = points(p, L)
        assert pts and not (pts & seen), "subtract must give non-empty disjoint boxes"
        seen |= pts
    assert seen == points(a, L) - points(b, L)


@SETTINGS
@given(target_and_pieces())
def test_covers_and_uncovered_match_oracle(case):
    target, pieces = case
    rest = uncovered(pieces, target)
    L = lcm_of(target, *pieces, *rest)
    missing = points(target, L) - union_points(pieces, L)
    assert covers(pieces, target) == (not missing)
    assert (rest == ()) == (not missing)
    seen = set()
    for r in rest:
        assert target.contains(r)
        pts = points(r, L)
        assert not (pts & seen)
        seen |= pts
    assert seen == missing


@SETTINGS
@given(target_and_pieces())
def test_is_partition_matches_oracle(case):
    target, pieces = case
    L = lcm_of(target, *pieces)
    sets = [points(p, L) for p in pieces]
    disjoint = all(not (x & y) for x, y in itertools.combinations(sets, 2))
    exact = set().union(*sets) == points(target, L)
    assert is_partition(pieces, target) == (disjoint and exact)


@SETTINGS
@given(splittable())
def test_split_is_partition(case):
    m, dim, n = case
    parts = [m.split(dim, n, i) for i in range(n)]
    assert is_partition(parts, m)
    assert all(p.value == m.value and p.shape[dim] == m.shape[dim] // n for p in parts)
    assert m.split(dim - m.ndim, n, 0) == parts[0]  # negative dims count from the end


@SETTINGS
@given(shapes(), st.data())
def test_split_value_partition_and_nesting(shape, data):
    m = data.draw(masks_in(shape))
    n = data.draw(st.integers(1, 6))
    parts = [m.split_value(n, i) for i in range(n)]
    assert is_partition(parts, m)
    assert all(p.slices == m.slices for p in parts)
    k = data.draw(st.integers(0, n - 1))
    k_of_n = parts[k]
    q = data.draw(st.integers(1, 4))
    sub = [k_of_n.split_value(q, j) for j in range(q)]
    assert all(k_of_n.contains(s) for s in sub)
    assert is_partition(sub, k_of_n)
    assert all(not s.intersects(parts[i]) for s in sub for i in range(n) if i != k)


def test_partial_helper_is_k_of_n():
    m = Mask.partial(((0, 4),), 1, 3)
    assert m.value == (Fraction(1, 3), Fraction(2, 3))
    assert m == Mask.full((4,)).split_value(3, 1)
    assert Mask.partial(((0, 4),), 0, 1) == Mask.full((4,))
    with pytest.raises(MaskError, match="0 <= k < n"):
        Mask.partial(((0, 4),), 3, 3)


@SETTINGS
@given(shapes(), st.data())
def test_producers_for_matches_oracle(shape, data):
    consumer = data.draw(masks_in(shape))
    producers = data.draw(st.lists(masks_in(shape), max_size=8))
    L = lcm_of(consumer, *producers)
    cpts = points(consumer, L)
    expected = tuple(i for i, p in enumerate(producers) if points(p, L) & cpts)
    assert producers_for(consumer, producers) == expected


@SETTINGS
@given(shapes(), st.data())
def test_relative_to_slices_locally(shape, data):
    outer = data.draw(masks_in(shape))
    inner = data.draw(masks_in(shape))
    inner = outer.intersect(inner) or outer
    rel = inner.relative_to(outer)
    arr = np.arange(math.prod(shape)).reshape(shape)
    outer_arr = arr[tuple(slice(a, b) for a, b in outer.slices)]
    local = outer_arr[tuple(slice(a, b) for a, b in rel.slices)]
    assert np.array_equal(local, arr[tuple(slice(a, b) for a, b in inner.slices)])
    olo, ohi = outer.value
    assert tuple(olo + v * (ohi - olo) for v in rel.value) == inner.value
    assert rel.fits(outer.shape)


@SETTINGS
@given(shapes(), st.data())
def test_json_round_trip_and_hash(shape, data):
    m = data.draw(masks_in(shape))
    d = json.loads(json.dumps(m.to_json()))
    back = Mask.from_json(d)
    assert back == m and hash(back) == hash(m)
    assert all(isinstance(v, Fraction) for v in back.value)
    # equal masks built from different spellings are equal and hash equal
    spelled = Mask([list(s) for s in m.slices], tuple(str(v) for v in m.value))
    assert spelled == m and hash(spelled) == hash(m)
    assert len({m, back, spelled}) == 1


@SETTINGS
@given(shapes(), st.data())
def test_volume_is_oracle_count(shape, data):
    m = data.draw(masks_in(shape))
    L = lcm_of(m)
    assert m.volume() == Fraction(len(points(m, L)), L)


# ---------------------------------------------------------------- examples


def test_str_is_compact():
    assert str(Mask(((0, 4), (8, 16)))) == "[0:4, 8:16]"
    assert str(Mask(((0, 4), (8, 16)), (Fraction(1, 2), 1))) == "[0:4, 8:16] v1/2..1"
    assert str(Mask((), (0, Fraction(1, 2)))) == "[] v0..1/2"
    assert repr(Mask(((0, 2),))) == "Mask([0:2])"
    t = PTensor(3, (4,))
    assert str(VTensor(t, Mask(((0, 2),)))) == "t3[0:2]"


def test_properties():
    m = Mask(((2, 6), (0, 3)), (Fraction(1, 4), Fraction(1, 2)))
    assert m.ndim == 2 and m.shape == (4, 3) and m.is_partial
    assert m.volume() == 3
    assert m.fits((6, 3)) and not m.fits((5, 3)) and not m.fits((6,))
    assert not Mask.full((4, 3)).is_partial


def test_rank0_scalar_masks():
    s = Mask.full(())
    assert s == Mask(()) and s.ndim == 0 and s.shape == () and s.volume() == 1
    halves = [s.split_value(2, i) for i in range(2)]
    assert is_partition(halves, s) and covers(halves, s)
    assert not covers(halves[:1], s)
    assert uncovered(halves[:1], s) == (halves[1],)
    assert halves[0].intersect(halves[1]) is None
    assert s.intersect(halves[0]) == halves[0]
    assert s.subtract(halves[0]) == (halves[1],)
    assert producers_for(halves[1], [s, halves[0], halves[1]]) == (0, 2)
    assert Mask.from_json(halves[1].to_json()) == halves[1]
    assert VTensor.full(PTensor(0, ())).mask == s
    with pytest.raises(MaskError, match="dim"):
        s.split(0, 1, 0)


def test_is_partition_needs_disjointness_not_just_volume():
    # volumes add up to the target's (2 + 2 = 4) but [1:2] is doubled and [3:4] missing
    target = Mask(((0, 4),))
    assert not is_partition([Mask(((0, 2),)), Mask(((1, 3),))], target)
    assert not is_partition([Mask(((0, 2),)), Mask(((2, 4),)), Mask(((1, 2),))], target)
    assert not is_partition([Mask(((0, 2),)), Mask(((2, 5),))], target)  # sticks out
    assert is_partition([Mask(((0, 2),)), Mask(((2, 4),))], target)
    halves = [Mask.partial(((0, 4),), k, 2) for k in range(2)]
    assert is_partition(halves, target) and not is_partition(halves + halves[:1], target)


def test_covers_overlapping_and_outside_pieces():
    target = Mask(((2, 6),))
    assert covers([Mask(((0, 4),)), Mask(((3, 8),))], target)
    assert uncovered([Mask(((0, 4),)), Mask(((5, 8),))], target) == (Mask(((4, 5),)),)
    assert not covers([], target) and uncovered([], target) == (target,)


def test_vtensor_ops():
    t = PTensor(1, (8, 4))
    a = VTensor(t, Mask(((0, 4), (0, 4))))
    b = VTensor(t, Mask(((2, 8), (0, 4))))
    assert a.intersect(b) == VTensor(t, Mask(((2, 4), (0, 4))))
    assert a.intersects(b) and VTensor.full(t).contains(a) and not a.contains(b)
    assert VTensor(t, Mask(((4, 8), (0, 4)))).intersect(a) is None
    other = VTensor.full(PTensor(2, (8, 4)))
    for op in (a.intersect, a.intersects, a.contains):
        with pytest.raises(MaskError, match="pTensor 1"):
            op(other)


# ---------------------------------------------------------------- errors


@pytest.mark.parametrize(
    "slices, fragment",
    [
        (((3, 3),), r"start < stop, found \[3, 3\)"),
        (((4, 2),), r"start < stop, found \[4, 2\)"),
        (((-1, 2),), r"0 <= start"),
        (((0, 2), (1, 1)), "dim 1"),
        (((0, 1, 2),), "pair"),
        (((0.0, 2),), "expected an int"),
        (((True, 2),), "expected an int"),
        ("0:4", "tuple of"),
    ],
)
def test_bad_slices(slices, fragment):
    with pytest.raises(MaskError, match=fragment):
        Mask(slices)


@pytest.mark.parametrize(
    "value, fragment",
    [
        ((Fraction(1, 2), Fraction(1, 2)), r"lo < hi"),
        ((0, 2), r"hi <= 1"),
        ((-1, 1), r"0 <= lo"),
        ((0, 0.5), "found float"),
        (("1/0", 1), "'k/n' string"),
        ((0,), "pair"),
    ],
)
def test_bad_value(value, fragment):
    with pytest.raises(MaskError, match=fragment):
        Mask(((0, 2),), value)


def test_split_errors():
    m = Mask(((0, 6), (2, 7)))
    with pytest.raises(MaskError, match="dim 1 has extent 5, which n=2 does not divide"):
        m.split(1, 2, 0)
    with pytest.raises(MaskError, match="dim in"):
        m.split(2, 1, 0)
    with pytest.raises(MaskError, match="0 <= i < n"):
        m.split(0, 2, 2)
    with pytest.raises(MaskError, match="n >= 1"):
        m.split_value(0, 0)


def test_rank_mismatch_errors():
    a, b = Mask(((0, 2),)), Mask(((0, 2), (0, 2)))
    for op in (a.intersect, a.intersects, a.contains, a.subtract, a.relative_to):
        with pytest.raises(MaskError, match="same rank, found rank 1"):
            op(b)
    with pytest.raises(MaskError, match="same rank"):
        covers([b], a)
    with pytest.raises(MaskError, match="same rank"):
        producers_for(a, [a, b])


def test_relative_to_requires_containment():
    with pytest.raises(MaskError, match=r"inside \[0:2\], found \[1:3\]"):
        Mask(((1, 3),)).relative_to(Mask(((0, 2),)))


def test_vtensor_mask_must_fit():
    t = PTensor(7, (4, 4))
    with pytest.raises(MaskError, match=r"pTensor 7 has shape \(4, 4\) \(rank 2\)"):
        VTensor(t, Mask(((0, 4),)))
    with pytest.raises(MaskError, match=r"does not fit pTensor 7 of shape \(4, 4\)"):
        VTensor(t, Mask(((0, 4), (2, 5))))
    with pytest.raises(MaskError, match="expected a Mask"):
        VTensor(t, ((0, 4), (0, 4)))


def test_ptensor_validation():
    assert PTensor(1, [2, 3]).shape == (2, 3)
    with pytest.raises(MaskError, match="non-negative"):
        PTensor(1, (2, -1))
    with pytest.raises(MaskError, match="PTensor id"):
        PTensor("x", (2,))
    with pytest.raises(MaskError, match="dtype"):
        PTensor(1, (2,), "")


def test_from_json_errors():
    with pytest.raises(MaskError, match="'slices'"):
        Mask.from_json({"value": ["0/1", "1/1"]})
    with pytest.raises(MaskError, match="start < stop"):
        Mask.from_json({"slices": [[2, 1]]})
