"""Attention regions of a Graph, and ring attention to run one over a sequence-split mesh.

Sequence parallelism splits the sequence axis of the activations. Every op of a
transformer is local along that axis except attention, whose scores pair each query with
every key. :func:`find_attention` finds the ops of each ``softmax(q k^T * scale, mask) v``
in a traced graph, so a plan can replace them as one unit; :func:`ring_attention` is that
unit under ``jax.shard_map``: each device keeps its query block and the key/value blocks
travel round the ring, folded in with an online softmax. :func:`dense_attention` is the
single-device formula both are checked against.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

from jscaler.ir.evaluate import evaluate
from jscaler.ir.graph import Graph, Literal, Op

__all__ = [
    "AttentionAxes",
    "AttentionRegion",
    "dense_attention",
    "find_attention",
    "ring_attention",
]

_F32_MIN = float(np.finfo(np.float32).min)
_CONVERT = "convert_element_type"


def dense_attention(q, k, v, *, causal: bool, scale: float, mask_value: float = _F32_MIN):
    """Softmax attention on ``[batch, seq, heads, head_dim]`` arrays, scores in fp32.

    The reference: ``softmax(where(tril, q k^T * scale, mask_value)) v``, the causal mask
    keeping key positions <= query positions. Returns ``[b, s_q, h, d]`` in ``v.dtype``.
    """
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k, preferred_element_type=jnp.float32) * scale
    if causal:
        keep = jnp.tril(jnp.ones((q.shape[1], k.shape[1]), dtype=bool))
        scores = jnp.where(keep, scores, mask_value)
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    return jnp.einsum("bhqk,bkhd->bqhd", probs, v)


def ring_attention(q, k, v, *, axis_name: str, causal: bool, scale: float, mask_value: float):
    """:func:`dense_attention` inside ``jax.shard_map``, the sequence split over ``axis_name``.

    Device ``i`` of the ``n`` along ``axis_name`` holds rows ``i*s..(i+1)*s`` of q, k and v
    (``[b, s, h, d]`` blocks). In ``n`` steps it scores its queries against one key block,
    folds the block into a running max, sum and output (fp32), and passes the key/value
    block to device ``i+1`` with ``ppermute``. Masked scores are set to ``mask_value``
    exactly as in the dense formula (blocks that are wholly masked are computed, not
    skipped), so the result equals the dense one up to fp32 reordering, and autodiff goes
    through it (``ppermute`` transposes to the reverse ring).

    Returns:
      The local output block ``[b, s, h, d]`` in ``v.dtype``.
    """
    n = jax.lax.axis_size(axis_name)
    me = jax.lax.axis_index(axis_name)
    s = q.shape[1]
    ring = [(j, (j + 1) % n) for j in range(n)]
    rows = me * s + jnp.arange(s)
    m = total = acc = None
    for step in range(n):
        if step:
            k, v = jax.lax.ppermute((k, v), axis_name, ring)
        scores = jnp.einsum("bqhd,bkhd->bhqk", q, k, preferred_element_type=jnp.float32) * scale
        if causal:
            cols = ((me - step) % n) * s + jnp.arange(s)  # the block started on device i-step
            scores = jnp.where(cols[None, :] <= rows[:, None], scores, mask_value)
        # The result does not depend on the running max (it cancels), so it takes no gradient.
        block_max = jax.lax.stop_gradient(scores.max(-1))
        new_m = block_max if m is None else jnp.maximum(m, block_max)
        shift = jnp.where(jnp.isneginf(new_m), 0.0, new_m)  # rows with every score -inf so far
        p = jnp.exp(scores - shift[..., None])
        block_acc = jnp.einsum("bhqk,bkhd->bqhd", p, v, preferred_element_type=jnp.float32)
        if m is None:
            total, acc = p.sum(-1), block_acc
        else:
            fix = jnp.exp(m - shift)
            total = total * fix + p.sum(-1)
            acc = acc * _bqh1(fix) + block_acc
        m = new_m
    return (acc / _bqh1(total)).astype(v.dtype)


def _bqh1(x):
    """``[b, h, q]`` row statistics laid out to scale a ``[b, q, h, d]`` accumulator."""
    return jnp.transpose(x, (0, 2, 1))[..., None]


@dataclass(frozen=True)
class AttentionAxes:
    """Which axis of a 4-D attention tensor is which (for ``out``, ``seq`` is the query).

    The two batch dims of the scores einsum cannot be told apart from the einsum alone;
    the one that comes first in q is called ``batch``, the other ``heads``. Attention
    treats both alike, so naming them the other way round would not change the result.
    """

    batch: int
    seq: int
    heads: int
    head_dim: int

    @property
    def order(self) -> tuple[int, int, int, int]:
        """``jnp.transpose(x, axes.order)`` lays a tensor out as ``[b, s, h, d]``."""
        return (self.batch, self.seq, self.heads, self.head_dim)


@dataclass(frozen=True)
class AttentionRegion:
    """One ``softmax(q k^T * scale, mask) v`` of a graph, found by :func:`find_attention`.

    Attributes:
      q, k, v: tensor ids of the two dot_generals' operands.
      out: the output tensor id of the second dot_general.
      ops: op ids of the region in graph order: the first dot_general to the second, and
        the constant ops (mask, scale) that nothing outside the region uses.
      q_axes, k_axes, v_axes, out_axes: the axis roles of those tensors.
      scale: what the scores are multiplied by (1.0 if nothing).
      causal: the mask is lower-triangular (keys <= queries); False when there is none.
      mask_value: the score given to masked keys (float32 min when there is no mask).
      path: the Flax module path of the first dot_general.
    """

    q: int
    k: int
    v: int
    out: int
    ops: tuple[int, ...]
    q_axes: AttentionAxes
    k_axes: AttentionAxes
    v_axes: AttentionAxes
    out_axes: AttentionAxes
    scale: float
    causal: bool
    mask_value: float
    path: str


def find_attention(graph: Graph) -> list[AttentionRegion]:
    """The attention regions of ``graph``, in graph order.

    A region is ``dot_general(q, k)`` (two batch dims, head_dim contracted) -> any of:
    multiply/divide by a constant scalar, one ``select_n`` with a constant mask, converts ->
    a softmax over the key axis (inlined, or a ``custom_jvp_call`` of the same ops) ->
    converts -> ``dot_general(probs, v)`` contracting the key axis with v's sequence axis.
    The values in between must have no other users.

    Anything else is not a region and is left out without an error, so a caller that
    needs one raises its own: a mask that depends on the batch or the parameters, a mask
    that is neither all-true nor lower-triangular, an unknown op in the middle, a 3-D or
    multi-query layout.
    """
    matcher = _Matcher(graph, *_index(graph))
    found = (matcher.match(op) for op in graph.ops if op.primitive == "dot_general")
    return [r for r in found if r is not None]


class _Matcher:
    """Walks from one dot_general to the softmax and the second dot_general."""

    def __init__(self, graph: Graph, users: dict[int, list[Op]], outputs: set[int]):
        self.g, self._users, self._outputs = graph, users, outputs

    def users(self, t: int) -> list[Op] | None:
        return None if t in self._outputs else self._users.get(t, [])

    def sole(self, t: int, primitive: str) -> Op | None:
        u = self.users(t)
        return u[0] if u and len(u) == 1 and u[0].primitive == primitive else None

    def match(self, first: Op) -> AttentionRegion | None:
        g = self.g
        if len(first.inputs) != 2 or len(first.tensor_inputs) != 2:
            return None
        (lc, rc), (lb, rb) = first.eqn.params["dimension_numbers"]
        if len(lc) != 1 or len(lb) != 2 or any(len(g.tensors[t].shape) != 4 for t in first.inputs):
            return None
        free = [next(a for a in range(4) if a not in (*c, *b)) for c, b in ((lc, lb), (rc, rb))]
        cur = first.outputs[0]
        shape, chain, side = g.tensors[cur].shape, [first.id], []
        scale, keep, mask_value, axis = 1.0, None, _F32_MIN, None
        while True:
            if axis is None and (sm := self.softmax(cur)) is not None:
                cur, chain, axis = sm[0], chain + sm[1], sm[2]
                continue
            u = self.users(cur)
            if not u or len(u) != 1:
                return None
            op, prev, cur = u[0], cur, u[0].outputs[0]
            chain.append(op.id)
            if op.primitive == "dot_general" and axis is not None:
                break
            if g.tensors[cur].shape != shape or (axis is not None and op.primitive != _CONVERT):
                return None
            if op.primitive in ("mul", "div"):
                other = op.inputs[1] if op.inputs[0] == prev else op.inputs[0]
                c = self.scalar(other)
                if c is None or (op.primitive == "div" and other != op.inputs[1]):
                    return None
                c = c if op.primitive == "mul" else 1.0 / c
                scale, mask_value = scale * c, mask_value * c if keep is not None else mask_value
                side.append(other)
            elif op.primitive == "select_n" and keep is None and len(op.inputs) == 3:
                pred, *cases = op.inputs
                if pred == prev or cases.count(prev) != 1:
                    return None
                other = cases[1 - cases.index(prev)]
                mask_value = self.scalar(other)
                keep = self.mask(pred, keep_true=cases.index(prev) == 1)
                if mask_value is None or keep is None:
                    return None
                side += [pred, other]
            elif op.primitive != _CONVERT:
                return None
        if axis not in (2, 3):  # the softmax must run over the key axis, a free axis
            return None
        causal = False
        if keep is not None:
            causal = _is_tril(keep, q_axis=5 - axis, k_axis=axis)
            if not causal and not keep.all():
                return None
        # Scores are [batch dims, lhs free, rhs free]; the softmax axis is k's free axis.
        q_side = 0 if axis == 3 else 1
        qb, kb = (lb, rb) if q_side == 0 else (rb, lb)
        roles = ("batch", "heads") if qb[0] < qb[1] else ("heads", "batch")
        q_axes = _axes(roles, qb, free[q_side], (lc, rc)[q_side][0])
        k_axes = _axes(roles, kb, free[1 - q_side], (lc, rc)[1 - q_side][0])
        second = g.op(chain[-1])
        tail = self.second(second, prev, axis, roles)
        if tail is None:
            return None
        v, v_axes, out_axes = tail
        return AttentionRegion(
            q=first.inputs[q_side],
            k=first.inputs[1 - q_side],
            v=v,
            out=second.outputs[0],
            ops=tuple(sorted(set(chain) | self.constant_ops(side, set(chain)))),
            q_axes=q_axes,
            k_axes=k_axes,
            v_axes=v_axes,
            out_axes=out_axes,
            scale=float(scale),
            causal=causal,
            mask_value=float(mask_value),
            path=first.path,
        )

    def second(self, op: Op, probs: int, axis: int, roles: tuple[str, str]):
        """(v, v axes, out axes) of ``dot_general(probs, v)`` contracting the key axis."""
        if len(op.tensor_inputs) != 2 or len(op.inputs) != 2:
            return None
        (lc, rc), (lb, rb) = op.eqn.params["dimension_numbers"]
        p_side = op.inputs.index(probs)
        v = op.inputs[1 - p_side]
        if v == probs:
            return None
        pc, pb = ((lc, lb), (rc, rb))[p_side]
        vc, vb = ((lc, lb), (rc, rb))[1 - p_side]
        if tuple(pc) != (axis,) or sorted(pb) != [0, 1] or len(self.g.tensors[v].shape) != 4:
            return None
        v_free = next(a for a in range(4) if a not in (*vc, *vb))
        v_roles = {roles[pb[j]]: vb[j] for j in range(2)}
        out_roles = {roles[pb[j]]: j for j in range(2)}
        seq, head_dim = (2, 3) if p_side == 0 else (3, 2)
        v_axes = AttentionAxes(v_roles["batch"], vc[0], v_roles["heads"], v_free)
        return v, v_axes, AttentionAxes(out_roles["batch"], seq, out_roles["heads"], head_dim)

    def softmax(self, x: int):
        """(probs, op ids, axis) when ``x`` feeds a softmax over one axis, else None."""
        u = self.users(x)
        if u and len(u) == 1 and u[0].kind == "call" and u[0].inputs[0] == x:
            call = u[0]
            extra = call.inputs[1:]
            if call.body is None or not all(_is_neg_inf(e) for e in extra):
                return None
            body = _Matcher(call.body, *_index(call.body))
            inner = body.softmax_ops(call.body.inputs[0], set(call.body.inputs[1:]))
            if inner is None or call.body.outputs != (inner[0],):
                return None
            return call.outputs[0], [call.id], inner[2]
        return self.softmax_ops(x, set())

    def softmax_ops(self, x: int, inits: set[int]):
        """The inlined ``exp(x - max) / sum`` of ``jax.nn.softmax``; ``inits`` hold -inf."""
        g, rank = self.g, len(self.g.tensors[x].shape)
        u = self.users(x)
        if not u or sorted(o.primitive for o in u) not in (
            ["reduce_max", "sub"],
            ["reshape", "sub"],
        ):
            return None
        first, sub = sorted(u, key=lambda o: o.primitive)
        if sub.inputs[0] != x or (found := self._row_max(first)) is None:
            return None
        axis, ops, t = found
        if (o := self.sole(t, "stop_gradient")) is not None:  # jax's softmax traced inline
            ops.append(o.id)
            t = o.outputs[0]
        if (o := self.sole(t, "max")) is not None:
            init = o.inputs[0] if o.inputs[1] == t else o.inputs[1]
            while not isinstance(init, Literal) and init not in inits:
                p = g.producer(init)
                if p is None or p.primitive != "convert_element_type":
                    return None
                init = p.inputs[0]
            if isinstance(init, Literal) and not _is_neg_inf(init):
                return None
            ops.append(o.id)
            t = o.outputs[0]
        keep = tuple(a for a in range(rank) if a != axis)
        if (o := self._row_broadcast(t, keep)) is None:
            return None
        ops.append(o.id)
        t = o.outputs[0]
        if (o := self.sole(t, "stop_gradient")) is not None:
            ops.append(o.id)
            t = o.outputs[0]
        if sub.inputs[1] != t or (ex := self.sole(sub.outputs[0], "exp")) is None:
            return None
        e = ex.outputs[0]
        u = self.users(e)
        if not u or sorted(o.primitive for o in u) != ["div", "reduce_sum"]:
            return None
        div, rsum = sorted(u, key=lambda o: o.primitive)
        if tuple(rsum.eqn.params["axes"]) != (axis,) or div.inputs[0] != e:
            return None
        if (o := self._row_broadcast(rsum.outputs[0], keep)) is None or div.inputs[1] != (
            o.outputs[0]
        ):
            return None
        ops += [sub.id, ex.id, rsum.id, o.id, div.id]
        return div.outputs[0], sorted(ops), axis

    def _row_max(self, first: Op) -> tuple[int, list[int], int] | None:
        """(axis, op ids, the max) of a max over one axis that starts at ``first``: one
        ``reduce_max``, or the two levels of :mod:`jscaler.ir.extrema` (a reshape into
        blocks, the max over each block, the max over the blocks), which a long axis (at
        least ``extrema.MIN_LENGTH`` keys) is traced into."""
        if first.primitive == "reduce_max":
            axes = first.eqn.params["axes"]
            return (axes[0], [first.id], first.outputs[0]) if len(axes) == 1 else None
        blocks = self.sole(first.outputs[0], "reduce_max")
        outer = blocks and self.sole(blocks.outputs[0], "reduce_max")
        if outer is None or len(outer.eqn.params["axes"]) != 1:
            return None
        (axis,) = outer.eqn.params["axes"]
        if tuple(blocks.eqn.params["axes"]) != (axis + 1,):
            return None
        return axis, [first.id, blocks.id, outer.id], outer.outputs[0]

    def _row_broadcast(self, t: int, keep: tuple[int, ...]) -> Op | None:
        o = self.sole(t, "broadcast_in_dim")
        return o if o is not None and tuple(o.eqn.params["broadcast_dimensions"]) == keep else None

    def value(self, x) -> tuple[np.ndarray, tuple[int, ...]] | None:
        """A constant's value before its broadcasts, and the axes of ``x`` it fills, or None."""
        dims = () if isinstance(x, Literal) else tuple(range(len(self.g.tensors[x].shape)))
        while not isinstance(x, Literal) and (p := self.g.producer(x)) is not None:
            if p.primitive != "broadcast_in_dim":
                break
            dims = tuple(dims[j] for j in p.eqn.params["broadcast_dimensions"])
            x = p.inputs[0]
        if isinstance(x, Literal):
            return np.asarray(x.value), dims
        ops = self.const_ops(x)
        if ops is None:
            return None
        ops = tuple(sorted(set(ops), key=lambda o: o.id))
        return np.asarray(evaluate(Graph(self.g.tensors, ops, (), (x,), self.g.consts))[0]), dims

    def scalar(self, x) -> float | None:
        """The value of a constant that is one number everywhere, else None."""
        value = self.value(x)
        if value is None or not value[0].size or np.any(value[0] != value[0].flat[0]):
            return None
        return float(value[0].flat[0])

    def mask(self, pred, keep_true: bool) -> np.ndarray | None:
        """The constant keep-mask as a 4-D array broadcastable to the scores, or None."""
        value = self.value(pred)
        if value is None or value[0].ndim != len(value[1]):
            return None
        shape = [1] * 4
        for n, a in zip(value[0].shape, value[1]):
            shape[a] = n
        keep = value[0].astype(bool).reshape(shape)  # broadcast_dimensions are increasing
        return keep if keep_true else ~keep

    def const_ops(self, t: int) -> list[Op] | None:
        """The ops computing ``t`` from literals and constants alone, or None."""
        todo, seen, ops = [t], set(), []
        while todo:
            x = todo.pop()
            if x in seen:
                continue
            seen.add(x)
            p = self.g.producer(x)
            if p is None and x not in self.g.consts or p is not None and p.kind != "op":
                return None  # a parameter or batch input, or a call
            if p is not None:
                ops.append(p)
                todo += p.tensor_inputs
        return ops

    def constant_ops(self, side: list, region: set[int]) -> set[int]:
        """Constant ops feeding the region that nothing outside the region uses."""
        cands = {
            o.id: o for x in side if not isinstance(x, Literal) for o in self.const_ops(x) or ()
        }
        taken = set(region)
        for i in sorted(cands, reverse=True):  # users come after producers
            used = [self.users(t) for t in cands[i].outputs]
            if all(u is not None and {o.id for o in u} <= taken for u in used):
                taken.add(i)
        return taken - region


def _index(graph: Graph) -> tuple[dict[int, list[Op]], set[int]]:
    """Each tensor's users, and the graph's output tensors (whose users are unknown)."""
    users: dict[int, list[Op]] = {}
    for op in graph.ops:
        for t in dict.fromkeys(op.tensor_inputs):
            users.setdefault(t, []).append(op)
    return users, {t for t in graph.outputs if not isinstance(t, Literal)}


def _axes(roles, batch_dims, seq: int, head_dim: int) -> AttentionAxes:
    named = dict(zip(roles, batch_dims))
    return AttentionAxes(named["batch"], seq, named["heads"], head_dim)


def _is_neg_inf(x) -> bool:
    return isinstance(x, Literal) and np.all(np.isneginf(np.asarray(x.value)))


def _is_tril(keep: np.ndarray, q_axis: int, k_axis: int) -> bool:
    """Whether the keep-mask is ``key <= query`` over the (q, k) axes, the same elsewhere."""
    n = keep.shape[q_axis]
    if n == 1 or keep.shape[k_axis] != n:
        return False
    qi = np.arange(n).reshape([n if a == q_axis else 1 for a in range(4)])
    ki = np.arange(n).reshape([n if a == k_axis else 1 for a in range(4)])
    return bool(np.all(keep == (ki <= qi)))
