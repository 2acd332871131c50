"""Annotation rules for elementwise ops, reductions, scans along an axis and generators.

Elementwise ops broadcast rank-0 operands and size-1 axes implicitly (jax >= 0.12 jaxprs
do both), so an operand axis of size 1 under an output axis of size n gets its own
unsplittable dim.

Generators (``iota``, ``random_bits``) are marked splittable along every output axis:
piece i of their output is the same generator with an offset, which the sharding lowering
provides (partitionable threefry for random bits).
"""

from __future__ import annotations

from jscaler.ir.registry import Namer, builtin_rule, shapes

UNARY = (
    "neg sign floor ceil round is_finite exp exp2 log log1p expm1 tanh logistic sin cos tan "
    "asin acos atan sinh cosh asinh acosh atanh sqrt rsqrt cbrt abs not erf erfc erf_inv "
    "lgamma digamma bessel_i0e bessel_i1e integer_pow square convert_element_type "
    "stop_gradient real imag conj population_count clz reduce_precision copy copy_p "
    "sharding_constraint random_seed log2 one_minus_square random_clone name zeros_like "
    "reshard layout_constraint relayout xla_metadata_value "
    "sinpi cospi tanpi asinpi acospi atanpi exp2m1 log2p1"  # jax 0.12.1
).split()
BINARY = (
    "add sub mul div rem max min pow atan2 nextafter and or xor eq ne lt le gt ge shift_left "
    "shift_right_logical shift_right_arithmetic add_any complex igamma igammac "
    "random_gamma_grad polygamma zeta random_fold_in mulhi igamma_grad_a eq_to le_to lt_to tie "
    "atan2pi"  # jax 0.12.1
).split()
TERNARY = "select_n clamp threefry2x32 regularized_incomplete_beta fma fmuladd".split()
# counter-based generators over n words -> m words of one shape
COUNTER = "threefry4x32 philox2x32 philox4x32".split()
# x and rank-0 coefficients
VARIADIC = ("polynomial",)
# ops that move or relabel data without arithmetic
MOVEMENT = {
    "convert_element_type", "stop_gradient", "copy", "copy_p", "sharding_constraint", "name",
    "reshard", "layout_constraint", "relayout", "device_put",
}  # fmt: skip
# the user's placement of a value, which the plan's layout replaces
PLACEMENT = {"sharding_constraint", "reshard", "layout_constraint", "relayout", "device_put"}


@builtin_rule(*UNARY, *BINARY, *TERNARY, *VARIADIC, *COUNTER, "optimization_barrier", "device_put")
def elementwise(eqn):
    """Same dims on every operand and result; broadcast operands get '^' size-1 axes."""
    ins, outs = shapes(eqn)
    nm = Namer()
    out_rank = max((len(s) for s in outs), default=0)
    ref = next((s for s in outs if len(s) == out_rank), ())
    if eqn.primitive.name in ("optimization_barrier", "device_put"):  # n in -> same n out
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


@builtin_rule("bitcast_convert_type")
def bitcast(eqn):
    """Same-width bitcasts keep shape; width changes add or drop a trailing '^' axis."""
    (s,), (o,) = shapes(eqn)
    nm = Namer()
    common = nm.fresh(min(len(s), len(o)))
    return nm.build(
        [common + nm.fresh(len(s) - len(common), "^")],
        [common + nm.fresh(len(o) - len(common), "^")],
    )


@builtin_rule("reduce_sum", "reduce_max", "reduce_min", "reduce_prod", "reduce_and", "reduce_or")
@builtin_rule("reduce_xor", "argmax", "argmin")
def reduce(eqn):
    """Kept axes split freely; a summed axis splits into partial sums ('+'), others '^'."""
    (s,), _ = shapes(eqn)
    axes = set(eqn.params["axes"])
    kind = "+" if eqn.primitive.name == "reduce_sum" else "^"
    nm = Namer()
    dims = [nm.new(kind) if i in axes else nm.new() for i in range(len(s))]
    return nm.build([dims], [[d for i, d in enumerate(dims) if i not in axes]])


@builtin_rule("cumsum", "cumprod", "cummax", "cummin", "cumlogsumexp")
def cumulative(eqn):
    (s,), _ = shapes(eqn)
    nm = Namer()
    dims = [nm.new("^") if i == eqn.params["axis"] else nm.new() for i in range(len(s))]
    return nm.build([dims], [dims])


@builtin_rule("sort")
def sort(eqn):
    """The sorted axis is '^' and its output is another axis than its input: position i of
    the result is not position i of the operand (a permutation of it), so what is split
    along the operand's axis (the batch, for tokens sorted by expert) is not split along
    the result's. Every other axis splits freely, in and out alike."""
    ins, outs = shapes(eqn)
    nm = Namer()
    axis = eqn.params["dimension"]
    dims = [nm.new("^") if i == axis else nm.new() for i in range(len(ins[0]))]
    out = list(dims)
    out[axis] = nm.new("^")
    return nm.build([dims] * len(ins), [out] * len(outs))


@builtin_rule("top_k", "approx_top_k")
def top_k(eqn):
    """The selected axis (``top_k``'s ``axis``, ``approx_top_k``'s ``reduction_dimension``,
    the last by default) is '^' in and out; every other axis splits freely."""
    (s,), outs = shapes(eqn)
    p = eqn.params
    axis = p.get("axis", p.get("reduction_dimension", -1)) % len(s)
    nm = Namer()
    lead = nm.fresh(len(s) - 1)

    def at(name):
        return lead[:axis] + [name] + lead[axis:]

    k = nm.new("^")
    return nm.build([at(nm.new("^"))], [at(k)] * len(outs))


@builtin_rule("reduce")
def generic_reduce(eqn):
    """``lax.reduce`` with a user computation over n operands and n initial values: kept
    axes split freely; reduced axes are '^' (the computation need not be a sum)."""
    ins, outs = shapes(eqn)
    n = len(outs)
    axes = set(eqn.params["dimensions"])
    nm = Namer()
    dims = [nm.new("^") if i in axes else nm.new() for i in range(len(ins[0]))]
    kept = [d for i, d in enumerate(dims) if i not in axes]
    return nm.build([dims] * n + [[] for _ in ins[n:]], [kept] * n)


@builtin_rule("iota", "random_bits", "empty", "empty2", "platform_index")
@builtin_rule("iota_2x32_shape")
def generator(eqn):
    """Outputs made from shapes (and scalar operands): split along every output axis."""
    ins, outs = shapes(eqn)
    nm = Namer()
    return nm.build([nm.fresh(len(s), "^") for s in ins], [nm.fresh(len(o)) for o in outs])


@builtin_rule("rng_bit_generator")
def rng_bit_generator(eqn):
    """A key -> (the next key, bits): the key is '^', the bits split like a generator's."""
    (k,), (k2, bits) = shapes(eqn)
    nm = Namer()
    return nm.build([nm.fresh(len(k), "^")], [nm.fresh(len(k2), "^"), nm.fresh(len(bits))])


@builtin_rule("random_gamma")
def random_gamma(eqn):
    """Gamma samples for each ``alpha``: the samples split with ``alpha``; the key's axes
    are shared where it holds one key per sample, '^' where it is broadcast."""
    (k, a), _ = shapes(eqn)
    nm = Namer()
    dims = nm.fresh(len(a))
    key = dims if tuple(k) == tuple(a) else nm.fresh(len(k), "^")
    return nm.build([key, dims], [dims])


@builtin_rule("random_split")
def random_split(eqn):
    (s,), (o,) = shapes(eqn)
    nm = Namer()
    keys = nm.fresh(len(s))
    return nm.build([keys], [keys + nm.fresh(len(o) - len(s), "^")])


# random_poisson, raw_bits (jax 0.12.1): samples whose values depend on the whole shape
@builtin_rule("custom_linear_solve", "pure_callback", "rng_uniform", "random_poisson", "raw_bits")
def whole(eqn):
    """Ops whose insides jscaler does not read (a linear solve given as functions, a host
    callback) or whose values depend on when they run (the stateful ``rng_uniform``):
    every axis '^', so the op runs on whole operands wherever it runs."""
    ins, outs = shapes(eqn)
    nm = Namer()
    return nm.build([nm.fresh(len(s), "^") for s in ins], [nm.fresh(len(o), "^") for o in outs])


@builtin_rule("debug_print")
def debug_print(eqn):
    """``jax.debug.print``: no results; its operands take any layout (it prints the
    whole values wherever they are split)."""
    ins, _ = shapes(eqn)
    nm = Namer()
    return nm.build([nm.fresh(len(s)) for s in ins], [])


@builtin_rule("random_wrap", "random_unwrap", "from_edtype", "to_edtype")
def random_wrap(eqn):
    (s,), (o,) = shapes(eqn)
    nm = Namer()
    common = nm.fresh(min(len(s), len(o)))
    return nm.build(
        [common + nm.fresh(len(s) - len(common), "^")],
        [common + nm.fresh(len(o) - len(common), "^")],
    )
