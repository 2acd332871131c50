"""FLOP counts of single ops (forward pass), for coverage and the cost model.

Contractions count a multiply-add as 2 FLOPs (a ``ragged_dot``, a dropless MoE's grouped
matmul, the work of each row's own group); elementwise arithmetic and reductions count one
per element; data movement counts zero.
"""

from __future__ import annotations

import math

from jscaler.ir.rules_elementwise import BINARY, MOVEMENT, TERNARY, UNARY

_ARITH = (set(UNARY) | set(BINARY) | set(TERNARY)) - MOVEMENT
_REDUCE = {
    "reduce_sum",
    "reduce_max",
    "reduce_min",
    "reduce_prod",
    "argmax",
    "argmin",
    "cumsum",
    "cumprod",
    "cummax",
    "cummin",
    "cumlogsumexp",
}


def _size(v) -> int:
    return math.prod(getattr(v.aval, "shape", ()))


def ragged_groups(eqn) -> int:
    """The groups of a ``ragged_dot_general`` (the length of its ``group_sizes``)."""
    shape = eqn.invars[2].aval.shape
    return shape[-1] if shape else 1


def op_flops(eqn) -> float:
    """FLOPs of one primitive equation (call and loop ops sum their bodies instead)."""
    name = eqn.primitive.name
    if name == "dot_general":
        (lc, _), _ = eqn.params["dimension_numbers"]
        lhs = eqn.invars[0].aval.shape
        return 2.0 * _size(eqn.outvars[0]) * math.prod(lhs[i] for i in lc)
    if name == "ragged_dot_general":
        # each row of the ragged dim meets one group's matrix: a weight gradient (the
        # ragged dim contracted, one output per group) does one group's share per output
        rdn = eqn.params["ragged_dot_dimension_numbers"]
        (lc, _), _ = rdn.dot_dimension_numbers
        lhs = eqn.invars[0].aval.shape
        whole = 2.0 * _size(eqn.outvars[0]) * math.prod(lhs[i] for i in lc)
        if set(rdn.lhs_ragged_dimensions) & set(lc):
            whole /= ragged_groups(eqn)
        return whole
    if name == "conv_general_dilated":
        rhs = eqn.invars[1].aval.shape
        spec = eqn.params["dimension_numbers"].rhs_spec
        window = math.prod(rhs[i] for i in spec[2:])
        return 2.0 * _size(eqn.outvars[0]) * window * rhs[spec[1]]
    if name in _ARITH:
        return float(sum(_size(v) for v in eqn.outvars))
    if name in _REDUCE:
        return float(_size(eqn.invars[0]))
    if name.startswith("reduce_window") or name.startswith("select_and_"):
        window = math.prod(eqn.params.get("window_dimensions", (1,)))
        return float(_size(eqn.outvars[0]) * window)
    if name.startswith("scatter"):
        return float(_size(eqn.invars[-1]))
    return 0.0
