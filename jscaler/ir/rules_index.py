"""Annotation rules for gather and scatter.

The embedding lookup (a gather of whole rows of a table by one index per position) splits
its table by rows into partial sums ('+'): a shard holding rows [a, b) returns its rows for
the indices that fall there and zeros elsewhere, and the pieces add up to the lookup. That
is Megatron's vocabulary-parallel embedding. Other indexed axes are '^'.
"""

from __future__ import annotations

from jscaler.ir.registry import Namer, builtin_rule, shapes


@builtin_rule("gather")
def gather(eqn):
    (operand, indices), (out,) = shapes(eqn)
    p = eqn.params
    dn = p["dimension_numbers"]
    slice_sizes = p["slice_sizes"]
    collapsed = set(dn.collapsed_slice_dims)
    indexed = set(dn.start_index_map)
    op_batch = tuple(getattr(dn, "operand_batching_dims", ()))
    idx_batch = tuple(getattr(dn, "start_indices_batching_dims", ()))
    nm = Namer()
    idx_dims = nm.fresh(len(indices) - 1) + [nm.new("^")]  # last axis: the index vector
    op_dims: list = [None] * len(operand)
    for a, b in zip(op_batch, idx_batch):
        op_dims[a] = idx_dims[b]
    embedding = len(indexed) == 1 and indexed <= collapsed
    offset_axes = []
    for a in range(len(operand)):
        if op_dims[a] is not None:
            continue
        if a in indexed:
            op_dims[a] = nm.new("+" if embedding else "^")
        elif slice_sizes[a] == operand[a]:
            op_dims[a] = nm.new()
        else:
            op_dims[a] = nm.new("^")
        if a not in collapsed:
            offset_axes.append(a)
    out_dims: list = [None] * len(out)
    batch = iter(idx_dims[:-1])
    window = iter(offset_axes)
    for k in range(len(out)):
        if k in dn.offset_dims:
            a = next(window)
            whole = slice_sizes[a] == operand[a] and a not in indexed
            out_dims[k] = op_dims[a] if whole else nm.new("^")
        else:
            out_dims[k] = next(batch)
    return nm.build([op_dims, idx_dims], [out_dims])


@builtin_rule("scatter", "scatter_add", "scatter-add", "scatter_mul", "scatter_min", "scatter_max")
@builtin_rule("scatter_sub", "scatter-mul", "scatter-min", "scatter-max", "scatter-sub")
def scatter(eqn):
    """Window axes kept whole split freely; indexed and scattered axes are '^'."""
    (operand, indices, updates), _ = shapes(eqn)
    dn = eqn.params["dimension_numbers"]
    inserted = set(dn.inserted_window_dims)
    op_batch = set(getattr(dn, "operand_batching_dims", ()))
    nm = Namer()
    op_dims: list = [None] * len(operand)
    window_axes = [a for a in range(len(operand)) if a not in inserted and a not in op_batch]
    up_dims = []
    window = iter(window_axes)
    for k in range(len(updates)):
        if k in dn.update_window_dims:
            a = next(window)
            if updates[k] == operand[a] and a not in dn.scatter_dims_to_operand_dims:
                op_dims[a] = nm.new()
                up_dims.append(op_dims[a])
                continue
        up_dims.append(nm.new("^"))
    op_dims = [d or nm.new("^") for d in op_dims]
    return nm.build([op_dims, nm.fresh(len(indices), "^"), up_dims], [op_dims])
