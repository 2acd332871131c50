"""Annotation rules for linear algebra and FFTs: batched ops on trailing core axes.

Every ``jax.lax.linalg`` primitive (and ``fft``) maps the trailing axes of each operand
(a matrix, a vector of eigenvalues, a pivot vector) to results while leading axes are a
batch: sub-op i of a batch split factors the i-th matrices. The core axes are '^': no
factorisation of a slice of a matrix is a slice of the factorisation.
"""

from __future__ import annotations

from jscaler.ir.registry import Namer, builtin_rule, shapes

# primitive -> trailing core rank of its first operand (the rest follow from it)
CORE_RANK = {
    "cholesky": 2,
    "cholesky_update": 2,
    "eig": 2,
    "eigh": 2,
    "geqp3": 2,
    "geqrf": 2,
    "hessenberg": 2,
    "householder_product": 2,
    "lu": 2,
    "lu_pivots_to_permutation": 1,
    "ormqr": 2,
    "qr": 2,
    "schur": 2,
    "svd": 2,
    "symmetric_product": 2,
    "triangular_solve": 2,
    "tridiagonal": 2,
    "tridiagonal_solve": 1,
}


@builtin_rule(*CORE_RANK)
def batched_core(eqn):
    """The leading batch axes of the first operand are shared by every operand and result
    (those whose rank holds them); the trailing core axes are '^'."""
    ins, outs = shapes(eqn)
    n_batch = len(ins[0]) - CORE_RANK[eqn.primitive.name]
    return _batched(ins, outs, n_batch)


@builtin_rule("fft")
def fft(eqn):
    """The transformed trailing axes (``fft_lengths``) are '^'; leading axes split."""
    ins, outs = shapes(eqn)
    return _batched(ins, outs, len(ins[0]) - len(eqn.params["fft_lengths"]))


def _batched(ins, outs, n_batch: int):
    nm = Namer()
    batch = nm.fresh(max(n_batch, 0))
    ref = ins[0][:n_batch]

    def dims(shape):
        if len(shape) >= n_batch and tuple(shape[:n_batch]) == tuple(ref):
            return batch + nm.fresh(len(shape) - n_batch, "^")
        return nm.fresh(len(shape), "^")

    return nm.build([dims(s) for s in ins], [dims(s) for s in outs])
