"""Annotation rules for contractions and windows: dot_general, convolutions, pooling."""

from __future__ import annotations

from jscaler.ir.registry import Namer, builtin_rule, shapes


@builtin_rule("dot_general")
def dot_general(eqn):
    """Batch dims shared, contracting dims '+', free dims split the output."""
    (ls, rs), _ = shapes(eqn)
    nm = Namer()
    lhs, rhs, out = _dot_dims(nm, ls, rs, eqn.params["dimension_numbers"], "+")
    return nm.build([lhs, rhs], [out])


def _dot_dims(nm: Namer, ls, rs, dimension_numbers, contracting: str):
    """(lhs dims, rhs dims, output dims) of a dot: batch dims shared, contracting dims of
    kind ``contracting``, free dims of each side in the output after the batch dims."""
    (lc, rc), (lb, rb) = dimension_numbers
    lhs: list = [None] * len(ls)
    rhs: list = [None] * len(rs)
    batch = []
    for i, j in zip(lb, rb):
        lhs[i] = rhs[j] = nm.new()
        batch.append(lhs[i])
    for i, j in zip(lc, rc):
        lhs[i] = rhs[j] = nm.new(contracting)
    lfree = [i for i in range(len(ls)) if lhs[i] is None]
    rfree = [j for j in range(len(rs)) if rhs[j] is None]
    for i in lfree:
        lhs[i] = nm.new()
    for j in rfree:
        rhs[j] = nm.new()
    return lhs, rhs, batch + [lhs[i] for i in lfree] + [rhs[j] for j in rfree]


@builtin_rule("ragged_dot_general")
def ragged_dot_general(eqn):
    """A dot whose ragged lhs dim is cut into groups by ``group_sizes`` (dropless MoE).

    As ``dot_general``, except: the ragged dim is '^' (a piece of it would need to know
    where its groups start) and ``group_sizes`` is '^'. The rhs group dim (the experts of
    a dropless MoE) is '+': a piece holding groups ``[a, b)`` computes the rows of those
    groups and zeros elsewhere, and the pieces add up to the whole. A piece needs all of
    ``group_sizes`` and its first group to find its rows (``compile.local.ragged_piece``);
    the group dim stays '^' where that kernel does not apply (several ragged or group
    dims, ``group_sizes`` with batch dims).
    When the ragged dim is contracted (the weight gradient), the output gains a leading
    group axis ('^').
    """
    (ls, rs, gs), _ = shapes(eqn)
    rdn = eqn.params["ragged_dot_dimension_numbers"]
    (lc, rc), (lb, rb) = rdn.dot_dimension_numbers
    ragged = set(rdn.lhs_ragged_dimensions)
    groups = set(rdn.rhs_group_dimensions)
    nm = Namer()
    lhs: list = [None] * len(ls)
    rhs: list = [None] * len(rs)
    batch = []
    for i, j in zip(lb, rb):
        lhs[i] = rhs[j] = nm.new("^" if i in ragged else "")
        batch.append(lhs[i])
    for i, j in zip(lc, rc):
        lhs[i] = rhs[j] = nm.new("^" if i in ragged else "+")
    # one ragged row dim, one group dim, one vector of sizes: what ragged_piece runs
    pieceable = len(ragged) == len(groups) == len(gs) == 1 and not ragged & {*lc, *lb}
    for j in groups:
        rhs[j] = nm.new("+" if pieceable else "^")
    lfree = [i for i in range(len(ls)) if lhs[i] is None]
    rfree = [j for j in range(len(rs)) if rhs[j] is None]
    for i in lfree:
        lhs[i] = nm.new("^" if i in ragged else "")
    for j in rfree:
        rhs[j] = nm.new()
    lead = [nm.new("^")] if ragged & set(lc) else []
    out = lead + batch + [lhs[i] for i in lfree] + [rhs[j] for j in rfree]
    return nm.build([lhs, rhs, nm.fresh(len(gs), "^")], [out])


@builtin_rule("scaled_dot")
def scaled_dot(eqn):
    """A block-scaled dot (``lhs, rhs, lhs_scale, rhs_scale``): as ``dot_general`` with the
    contracting dims '^' (the scales hold one value per block of them); a scale axis as
    long as its operand's shares that axis's dim, a shorter one is '^'."""
    ins, _ = shapes(eqn)
    ls, rs = ins[0], ins[1]
    nm = Namer()
    lhs, rhs, out = _dot_dims(nm, ls, rs, eqn.params["dimension_numbers"], "^")

    def scale(shape, operand, dims):
        if len(shape) != len(operand):
            return nm.fresh(len(shape), "^")
        out = []
        for a, (n, m) in enumerate(zip(shape, operand)):
            if n == m:
                out.append(dims[a])
            else:
                out.append(nm.new("^"))
                if nm.kinds[dims[a]] == "":
                    nm.kinds[dims[a]] = "^"
        return out

    scales = [scale(s, (ls, rs)[k], (lhs, rhs)[k]) for k, s in enumerate(ins[2:4])]
    return nm.build([lhs, rhs, *scales], [out])


@builtin_rule("conv_general_dilated")
def conv(eqn):
    """Batch and output features split freely; input features give partial sums.

    Spatial axes are '^' (a slice would need halos). With feature groups, the group dim
    leads the feature axes and splits; the per-group input features stay whole.
    """
    (ls, rs), (os_,) = shapes(eqn)
    dn = eqn.params["dimension_numbers"]
    lhs_spec, rhs_spec, out_spec = dn.lhs_spec, dn.rhs_spec, dn.out_spec
    groups = eqn.params["feature_group_count"]
    nm = Namer()
    lhs: list = [None] * len(ls)
    rhs: list = [None] * len(rs)
    out: list = [None] * len(os_)
    if eqn.params["batch_group_count"] != 1:  # only seen in grads of grouped convs
        return nm.build([nm.fresh(len(ls), "^"), nm.fresh(len(rs), "^")], [nm.fresh(len(os_), "^")])
    n = nm.new()
    lhs[lhs_spec[0]] = out[out_spec[0]] = n
    if groups == 1:
        ci, co = nm.new("+"), nm.new()
        lhs[lhs_spec[1]] = rhs[rhs_spec[1]] = ci
        rhs[rhs_spec[0]] = out[out_spec[1]] = co
    else:
        g, ci, co = nm.new(), nm.new("^"), nm.new()
        lhs[lhs_spec[1]] = (g, ci)
        rhs[rhs_spec[1]] = ci
        rhs[rhs_spec[0]] = out[out_spec[1]] = (g, co)
    for spec, dims in ((lhs_spec, lhs), (rhs_spec, rhs), (out_spec, out)):
        for axis in spec[2:]:
            dims[axis] = nm.new("^")
    return nm.build([lhs, rhs], [out])


def _window_whole(p, i) -> bool:
    """True when a window op leaves axis i untouched (window 1, stride 1, no padding)."""
    pad = p.get("padding")
    return (
        p["window_dimensions"][i] == 1
        and p["window_strides"][i] == 1
        and (pad is None or isinstance(pad, str) or tuple(pad[i]) == (0, 0))
        and all(p[k][i] == 1 for k in ("base_dilation", "window_dilation") if k in p)
    )


@builtin_rule("reduce_window_sum", "reduce_window_max", "reduce_window_min", "reduce_window")
def reduce_window(eqn):
    """Pooling: axes without a window (batch, channels) split; windowed axes are '^'."""
    ins, outs = shapes(eqn)
    s = ins[0]
    nm = Namer()
    i_dims, o_dims = [], []
    for i in range(len(s)):
        if _window_whole(eqn.params, i):
            d = nm.new()
            i_dims.append(d)
            o_dims.append(d)
        else:
            i_dims.append(nm.new("^"))
            o_dims.append(nm.new("^"))
    n_operands = len(outs)  # generic reduce_window: operands then init values
    in_dims = [i_dims] * n_operands + [[] for _ in ins[n_operands:]]
    return nm.build(in_dims, [o_dims] * len(outs))


@builtin_rule("select_and_scatter_add", "select_and_gather_add", "select_and_scatter")
def select_and_scatter(eqn):
    """Max-pool gradients: like pooling, windowed axes '^' on every operand."""
    ins, (o,) = shapes(eqn)
    nm = Namer()
    whole = [_window_whole(eqn.params, i) for i in range(len(o))]
    shared = [nm.new() if w else None for w in whole]
    in_dims = [[shared[i] or nm.new("^") for i in range(len(s))] for s in ins]
    return nm.build(in_dims, [[shared[i] or nm.new("^") for i in range(len(o))]])
