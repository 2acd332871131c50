"""Annotation rules for ops that move data: broadcasts, reshapes, transposes, slicing,
concatenation, padding, gather and scatter.

An axis that an op keeps whole (same extent in and out) keeps its dim; an axis the op cuts,
pads or broadcasts gets fresh '^' dims, since a slice of it is not the same op on a slice.
"""

from __future__ import annotations

import math

from jscaler.ir.registry import Namer, builtin_rule, shapes


@builtin_rule("broadcast_in_dim")
def broadcast_in_dim(eqn):
    ins, (o,) = shapes(eqn)
    nm = Namer()
    out = nm.fresh(len(o))
    operand = []
    for i, size in enumerate(ins[0]):
        j = eqn.params["broadcast_dimensions"][i]
        operand.append(out[j] if size == o[j] else nm.new("^"))
    return nm.build([operand] + [nm.fresh(len(s), "^") for s in ins[1:]], [out])


@builtin_rule("transpose")
def transpose(eqn):
    (s,), _ = shapes(eqn)
    nm = Namer()
    dims = nm.fresh(len(s))
    return nm.build([dims], [[dims[p] for p in eqn.params["permutation"]]])


@builtin_rule("squeeze")
def squeeze(eqn):
    (s,), _ = shapes(eqn)
    nm = Namer()
    gone = {d % len(s) for d in eqn.params["dimensions"]}
    dims = [nm.new("^") if i in gone else nm.new() for i in range(len(s))]
    return nm.build([dims], [[d for i, d in enumerate(dims) if i not in gone]])


@builtin_rule("rev")
def rev(eqn):
    (s,), _ = shapes(eqn)
    nm = Namer()
    flipped = set(eqn.params["dimensions"])
    dims = [nm.new("^") if i in flipped else nm.new() for i in range(len(s))]
    return nm.build([dims], [dims])


def _keep_or_cut(nm: Namer, shape, keep) -> tuple[list[str], list[str]]:
    """Dims for an input and output of equal rank: kept axes share a dim, cut ones don't."""
    ins, outs = [], []
    for i in range(len(shape)):
        if keep(i):
            d = nm.new()
            ins.append(d)
            outs.append(d)
        else:
            ins.append(nm.new("^"))
            outs.append(nm.new("^"))
    return ins, outs


@builtin_rule("slice")
def slice_(eqn):
    (s,), _ = shapes(eqn)
    p = eqn.params
    strides = p["strides"] or (1,) * len(s)

    def keep(i):
        return p["start_indices"][i] == 0 and p["limit_indices"][i] == s[i] and strides[i] == 1

    nm = Namer()
    i_dims, o_dims = _keep_or_cut(nm, s, keep)
    return nm.build([i_dims], [o_dims])


@builtin_rule("pad")
def pad(eqn):
    (s, _pv), _ = shapes(eqn)
    nm = Namer()
    i_dims, o_dims = _keep_or_cut(
        nm, s, lambda i: tuple(eqn.params["padding_config"][i]) == (0, 0, 0)
    )
    return nm.build([i_dims, []], [o_dims])


@builtin_rule("dynamic_slice")
def dynamic_slice(eqn):
    ins, _ = shapes(eqn)
    s = ins[0]
    nm = Namer()
    i_dims, o_dims = _keep_or_cut(nm, s, lambda i: eqn.params["slice_sizes"][i] == s[i])
    return nm.build([i_dims] + [nm.fresh(len(x), "^") for x in ins[1:]], [o_dims])


@builtin_rule("dynamic_update_slice")
def dynamic_update_slice(eqn):
    ins, _ = shapes(eqn)
    s, u = ins[0], ins[1]
    nm = Namer()
    operand, update = [], []
    for i in range(len(s)):
        if u[i] == s[i]:
            d = nm.new()
            operand.append(d)
            update.append(d)
        else:
            operand.append(nm.new("^"))
            update.append(nm.new("^"))
    return nm.build([operand, update] + [nm.fresh(len(x), "^") for x in ins[2:]], [operand])


@builtin_rule("concatenate")
def concatenate(eqn):
    ins, _ = shapes(eqn)
    axis = eqn.params["dimension"]
    nm = Namer()
    common = nm.fresh(len(ins[0]))

    def with_cut(name):
        return [name if i == axis else d for i, d in enumerate(common)]

    return nm.build([with_cut(nm.new("^")) for _ in ins], [with_cut(nm.new("^"))])


@builtin_rule("split")
def split(eqn):
    (s,), outs = shapes(eqn)
    axis = eqn.params["axis"]
    nm = Namer()
    common = nm.fresh(len(s))

    def with_cut(name):
        return [name if i == axis else d for i, d in enumerate(common)]

    return nm.build([with_cut(nm.new("^"))], [with_cut(nm.new("^")) for _ in outs])


@builtin_rule("reshape")
def reshape(eqn):
    """Groups axes whose products match: ``(b, s*h) -> (b, s, h)`` is ``b (s h) -> b s h``.

    With ``dimensions`` the operand is transposed first (``lax.reshape(x, shape,
    dimensions)``): the groups are found on the transposed axes.
    """
    (s0,), (o,) = shapes(eqn)
    perm = eqn.params.get("dimensions") or tuple(range(len(s0)))
    s = [s0[p] for p in perm]
    nm = Namer()
    in_axes: list = [None] * len(s)
    out_axes: list = [None] * len(o)
    for gi, go in _reshape_groups(s, o):
        refined = _refine([s[i] for i in gi], [o[j] for j in go])
        if refined is None:  # no common refinement: nothing here is splittable
            for i in gi:
                in_axes[i] = nm.new("^")
            for j in go:
                out_axes[j] = nm.new("^")
            continue
        sizes, in_parts, out_parts = refined
        names = [nm.new(size=size) for size in sizes]
        for i, part in zip(gi, in_parts):
            in_axes[i] = tuple(names[k] for k in part) or (nm.new("^"),)
        for j, part in zip(go, out_parts):
            out_axes[j] = tuple(names[k] for k in part) or (nm.new("^"),)
    operand: list = [None] * len(s)
    for k, p in enumerate(perm):
        operand[p] = in_axes[k]
    return nm.build([operand], [out_axes])


def _reshape_groups(s, o):
    """Pairs (input axes, output axes) split at the prefix products both shapes share."""
    cs = [math.prod(s[:k]) for k in range(len(s) + 1)]
    co = [math.prod(o[:k]) for k in range(len(o) + 1)]
    bounds = sorted(set(cs) & set(co))
    if len(bounds) < 2 or 0 in bounds:
        return [(list(range(len(s))), list(range(len(o))))]

    def group_of(prefix):  # the group whose [lo, hi) holds this prefix product
        return next((k for k in range(len(bounds) - 1) if prefix < bounds[k + 1]), -1)

    groups = [([], []) for _ in bounds[1:]]
    for i in range(len(s)):
        groups[group_of(cs[i])][0].append(i)
    for j in range(len(o)):
        groups[group_of(co[j])][1].append(j)
    return groups


def _refine(a: list[int], b: list[int]):
    """Common refinement of two factorizations of one number, or None.

    Returns (sizes, parts_a, parts_b): ``sizes`` are the refined factors (size-1 axes get
    their own factor); each part lists the factor indices making up one axis.
    """
    if math.prod(a) != math.prod(b) or 0 in a or 0 in b:
        return None
    cuts_a = {math.prod(a[: k + 1]) for k in range(len(a))}
    cuts_b = {math.prod(b[: k + 1]) for k in range(len(b))}
    cuts = sorted(c for c in cuts_a | cuts_b if c > 1)
    prev = 1
    for c in cuts:
        if c % prev:
            return None
        prev = c
    sizes = [c2 // c1 for c1, c2 in zip([1] + cuts[:-1], cuts)]

    def parts(axes):
        out, k, acc = [], 0, 1
        for size in axes:
            part = []
            if size == 1:
                out.append(part)
                continue
            target = acc * size
            while acc < target:
                part.append(k)
                acc *= sizes[k]
                k += 1
            out.append(part)
        return out

    return sizes, parts(a), parts(b)


@builtin_rule("stack")
def stack(eqn):
    """n operands of one shape -> a new axis of size n: the other axes keep their dims;
    the new axis is '^' (piece k of it is operand k, not a slice of every operand)."""
    ins, (o,) = shapes(eqn)
    axis = eqn.params["axis"] % len(o)
    nm = Namer()
    common = nm.fresh(len(ins[0]))
    out = common[:axis] + [nm.new("^")] + common[axis:]
    return nm.build([common] * len(ins), [out])


@builtin_rule("unstack")
def unstack(eqn):
    """One operand -> its slices along ``axis`` (``a, b = x``): the other axes keep
    their dims; the unstacked axis is '^'."""
    (s,), outs = shapes(eqn)
    axis = eqn.params["axis"] % len(s)
    nm = Namer()
    common = nm.fresh(len(s) - 1)
    return nm.build([common[:axis] + [nm.new("^")] + common[axis:]], [common] * len(outs))


@builtin_rule("tile")
def tile(eqn):
    """``jnp.tile``: an axis repeated once keeps its dim; a repeated axis is '^' (each
    output piece would need the whole input along it)."""
    (s,), (o,) = shapes(eqn)
    nm = Namer()
    lead = len(o) - len(s)  # reps longer than the rank add leading axes
    extra = nm.fresh(lead, "^")
    i_dims, o_dims = _keep_or_cut(nm, s, lambda i: o[lead + i] == s[i])
    return nm.build([i_dims], [extra + o_dims])
