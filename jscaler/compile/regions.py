"""Manual regions: subgraphs lowered with ``shard_map`` and explicit collectives.

:func:`manual_regions` maps each op of a plan's regions to the object that runs it:
``coshard`` and ``shard_map`` regions are layout-driven (:mod:`shard_region`); ring
attention, below, is a kernel of its own.

Layouts cannot say everything. Ring attention keeps every device's queries in place and
passes key/value blocks around a ring of devices with ``ppermute``, folding each block into
an online softmax: no layout of the score matrix describes that. A plan marks such a
subgraph with ``op_trans(plan, ops, manual("ring_attention", axis))``; the lowering runs
the region's kernel in place of its ops (at the position of its last op, when all its
inputs exist) and the layouts resume at its output.

Ring attention's layout: each of q, k and v keeps the batch and head splits it arrives
with; its sequence is split over the region's axis alone (any other mesh axis found on
the sequence moves to the heads, which makes Ulysses x ring, USP, one all-to-all); the
head dim is whole. The output leaves in the same layout.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

from jscaler.compile.attention import (
    AttentionAxes,
    AttentionRegion,
    find_attention,
    ring_attention,
)
from jscaler.compile.layout import Layout, replicated
from jscaler.compile.shard_region import LocalRegion, local_region
from jscaler.errors import LayoutError
from jscaler.plan.plan import Plan, Region

__all__ = ["RingAttention", "manual_regions"]


def _remap(layout: Layout, src: AttentionAxes, dst: AttentionAxes, rank: int) -> Layout:
    """The same split of (batch, seq, heads, head dim) on a tensor with other axis order."""
    spec = [()] * rank
    for role in ("batch", "seq", "heads", "head_dim"):
        spec[getattr(dst, role)] = layout.spec[getattr(src, role)]
    return Layout(tuple(spec))


@dataclass(frozen=True, eq=False)
class RingAttention:
    """A ring-attention region: the plan's region and the attention found in the graph."""

    region: Region
    attention: AttentionRegion
    last: int  # the op producing the attention's output
    layout_driven: bool = False  # the comm table counts its ring hops itself

    def layout(self, arriving: Layout) -> Layout:
        """q's layout inside the region, from the layout q arrives with."""
        a, axis = self.attention.q_axes, self.region.axis
        spec = [tuple(x for x in axes if x != axis) for axes in arriving.spec]
        moved = spec[a.seq] + spec[a.head_dim]
        spec[a.seq], spec[a.head_dim] = (axis,), ()
        spec[a.heads] = spec[a.heads] + moved
        return Layout(tuple(spec))

    def layouts(self, low, arriving: Layout) -> dict[int, Layout]:
        """The layouts of q, k, v and the output inside the region."""
        att = self.attention
        tensors = low.plan.pgraph.graph.tensors
        lay_q = self.layout(arriving)
        out = {att.q: lay_q}
        for t, axes in ((att.k, att.k_axes), (att.v, att.v_axes), (att.out, att.out_axes)):
            out[t] = _remap(lay_q, att.q_axes, axes, len(tensors[t].shape))
        return out

    def run(self, low, env, have) -> None:
        att, axis = self.attention, self.region.axis
        tensors = low.plan.pgraph.graph.tensors
        rank = len(tensors[att.q].shape)
        lays = self.layouts(low, have.get(att.q, replicated(rank)))
        args = []
        for t in (att.q, att.k, att.v):
            v = env[t]
            if have.get(t) != lays[t]:
                v = jax.lax.with_sharding_constraint(v, low.sharding(lays[t]))
            args.append(v)
        back = tuple(int(i) for i in np.argsort(att.out_axes.order))
        dtype = jnp.dtype(tensors[att.out].dtype)

        def body(q, k, v):
            q = jnp.transpose(q, att.q_axes.order)
            k = jnp.transpose(k, att.k_axes.order)
            v = jnp.transpose(v, att.v_axes.order)
            out = ring_attention(
                q, k, v,
                axis_name=axis,
                causal=att.causal,
                scale=att.scale,
                mask_value=att.mask_value,
            )  # fmt: skip
            return jnp.transpose(out, back).astype(dtype)

        specs = tuple(lays[t].pspec() for t in (att.q, att.k, att.v))
        out = jax.shard_map(body, mesh=low.mesh, in_specs=specs, out_specs=lays[att.out].pspec())(
            *args
        )
        env[att.out], have[att.out] = out, lays[att.out]


def manual_regions(plan: Plan) -> dict[int, RingAttention | LocalRegion]:
    """op id -> the manual region running it, for every region of the plan."""
    if not plan.regions:
        return {}
    graph = plan.pgraph.graph
    found = find_attention(graph) if any(r.kind == "ring_attention" for r in plan.regions) else []
    out = {}
    for region in plan.regions:
        if region.kind != "ring_attention":
            local = local_region(plan, region)
            out.update((op_id, local) for op_id in region.ops)
            continue
        where = plan.pgraph.op(region.ops[0]).where
        match = [a for a in found if set(a.ops) <= set(region.ops)]
        if len(match) != 1:
            raise LayoutError(
                f"the ring_attention region at {where} holds {len(match)} attentions the "
                f"matcher recognises (softmax(q k^T * scale [masked]) v with a constant "
                f"causal or no mask); mark exactly the ops of one attention (see "
                f"jscaler.find_attention)"
            )
        att = match[0]
        last = next(o.id for o in graph.ops if att.out in o.outputs)
        size = plan.mesh.shape[region.axis]
        s = graph.tensors[att.q].shape[att.q_axes.seq]
        if s % size:
            raise LayoutError(
                f"ring attention at {where}: the sequence ({s}) does not split into "
                f"{size} blocks over mesh axis {region.axis!r}; use a degree dividing {s}"
            )
        ring = RingAttention(region, att, last)
        for op_id in region.ops:
            out[op_id] = ring
    return out
