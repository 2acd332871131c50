"""Annotation rules for elementwise ops, reductions, scans along an axis and generators.

Elementwise ops broadcast rank-0 operands and size-1 axes implicitly (jax >= 0.12 jaxprs
do both), so an operand axis of size 1 under an output axis of size n gets its own
unsplittable dim.

Generators (``iota``, ``random_bits``) are marked splittable along every output axis:
piece i of their output is the same generator with an offset, which the sharding lowering
provides (partitionable threefry for random bits).
"""

from __future__ import annotations

from jscaler.ir.registry import Namer, _rule, shapes

UNARY = (
    "neg sign floor ceil round is_finite exp exp2 log log1p expm1 tanh logistic sin cos tan "
    "asin acos atan sinh cosh asinh acosh atanh sqrt rsqrt cbrt abs not erf erfc erf_inv "
    "lgamma digamma bessel_i0e bessel_i1e integer_pow square convert_element_type "
    "stop_gradient real imag conj population_count clz reduce_precision copy copy_p "
    "sharding_constraint random_seed"
).split()
BINARY = (
    "add sub mul div rem max min pow atan2 nextafter and or xor eq ne lt le gt ge shift_left "
    "shift_right_logical shift_right_arithmetic add_any complex igamma igammac "
    "random_gamma_grad polygamma zeta random_fold_in"
).split()
TERNARY = "select_n clamp threefry2x32".split()
# ops that move or relabel data without arithmetic
MOVEMENT = {"convert_element_type", "stop_gradient", "copy", "copy_p", "sharding_constraint"}


@_rule(*UNARY, *BINARY, *TERNARY, "optimization_barrier")
def elementwise(eqn):
    """Same dims on every operand and result; broadcast operands get '^' size-1 axes."""
    ins, outs = shapes(eqn)
    nm = Namer()
    out_rank = max((len(s) for s in outs), default=0)
    ref = next((s for s in outs if len(s) == out_rank), ())
    if eqn.primitive.name == "optimization_barrier":  # n inputs -> the same n outputs
        dims = [nm.fresh(len(s)) for s in ins]
        return nm.build(dims, dims)
    names = nm.fresh(len(ref))
    in_dims = []
    for s in ins:
        if len(s) == 0:
            in_dims.append([])
        elif len(s) == len(ref):
            in_dims.append([n if a == b else nm.new("^") for n, a, b in zip(names, s, ref)])
        else:  # unexpected rank: nothing of it is splittable
            in_dims.append(nm.fresh(len(s), "^"))
    out_dims = [names if len(s) == len(ref) else nm.fresh(len(s), "^") for s in outs]
    return nm.build(in_dims, out_dims)


@_rule("bitcast_convert_type")
def bitcast(eqn):
    """Same-width bitcasts keep shape; width changes add or drop a trailing '^' axis."""
    (s,), (o,) = shapes(eqn)
    nm = Namer()
    common = nm.fresh(min(len(s), len(o)))
    return nm.build(
        [common + nm.fresh(len(s) - len(common), "^")],
        [common + nm.fresh(len(o) - len(common), "^")],
    )


@_rule("reduce_sum", "reduce_max", "reduce_min", "reduce_prod", "reduce_and", "reduce_or")
@_rule("reduce_xor", "argmax", "argmin")
def reduce(eqn):
    """Kept axes split freely; a summed axis splits into partial sums ('+'), others '^'."""
    (s,), _ = shapes(eqn)
    axes = set(eqn.params["axes"])
    kind = "+" if eqn.primitive.name == "reduce_sum" else "^"
    nm = Namer()
    dims = [nm.new(kind) if i in axes else nm.new() for i in range(len(s))]
    return nm.build([dims], [[d for i, d in enumerate(dims) if i not in axes]])


@_rule("cumsum", "cumprod", "cummax", "cummin", "cumlogsumexp")
def cumulative(eqn):
    (s,), _ = shapes(eqn)
    nm = Namer()
    dims = [nm.new("^") if i == eqn.params["axis"] else nm.new() for i in range(len(s))]
    return nm.build([dims], [dims])


@_rule("sort")
def sort(eqn):
    ins, outs = shapes(eqn)
    nm = Namer()
    dims = [nm.new("^") if i == eqn.params["dimension"] else nm.new() for i in range(len(ins[0]))]
    return nm.build([dims] * len(ins), [dims] * len(outs))


@_rule("top_k")
def top_k(eqn):
    (s,), outs = shapes(eqn)
    nm = Namer()
    lead = nm.fresh(len(s) - 1)
    k = nm.new("^")
    return nm.build([lead + [nm.new("^")]], [lead + [k]] * len(outs))


@_rule("iota", "random_bits")
def generator(eqn):
    ins, (o,) = shapes(eqn)
    nm = Namer()
    return nm.build([nm.fresh(len(s), "^") for s in ins], [nm.fresh(len(o))])


@_rule("random_split")
def random_split(eqn):
    (s,), (o,) = shapes(eqn)
    nm = Namer()
    keys = nm.fresh(len(s))
    return nm.build([keys], [keys + nm.fresh(len(o) - len(s), "^")])


@_rule("random_wrap", "random_unwrap")
def random_wrap(eqn):
    (s,), (o,) = shapes(eqn)
    nm = Namer()
    common = nm.fresh(min(len(s), len(o)))
    return nm.build(
        [common + nm.fresh(len(s) - len(common), "^")],
        [common + nm.fresh(len(o) - len(common), "^")],
    )
