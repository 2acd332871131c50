"""Pipeline stages: the ops of each stage and its jitted programs on its group's mesh.

A stage is the forward ops :func:`jscaler.plan.pipeline.stage_of_ops` gives it, run with
its group's lowered plan (so the layouts, collectives and manual regions inside a stage
are those of a single-program plan). It reads parameters, state and batch leaves, and
activations of earlier stages; it writes activations later stages read and the graph
outputs it computes (the loss).

Programs (``jax.fwd_and_bwd`` keeps the forward's residuals for the backward):

* ``forward``: outputs only (a forward pass that keeps nothing; the stash of a recomputed
  micro-batch);
* ``forward_res``: outputs and residuals (F, or R for a recomputed micro-batch);
* ``backward``: parameter and input cotangents from the forward's inputs, its residuals
  and output cotangents (B);
* ``backward_input`` / ``backward_weight``: one half each (zero-bubble's B and W; XLA
  drops the other half's work).

A recycling model's step runs several forward passes; each (pass, stage) pair is a
:class:`Stage` of its own (``index`` = pass x stages + stage). The passes of one stage
share its parameters (``params`` lists every parameter any of them reads). Values from
an earlier pass come in as ``frozen`` inputs: they were computed under ``stop_gradient``,
so no cotangent goes back for them, and earlier passes run ``forward`` only.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding

from jscaler.compile.layout import Layout, replicated
from jscaler.compile.lower import Lowered, run_ops
from jscaler.errors import PlanError
from jscaler.ir.graph import Literal, Op

__all__ = ["Stage", "build_stages"]


@dataclass(eq=False)
class Stage:
    """One pipeline stage (of one forward pass) on one device group."""

    index: int
    group: int
    low: Lowered
    ops: list[Op]
    params: list[int]
    state: list[int]
    batch: list[int]
    acts_in: list[int]
    acts_out: list[int]
    outputs: list[int]
    dtypes: dict[int, str] = field(default_factory=dict)
    consumers: dict[int, list[int]] = field(default_factory=dict)  # act -> stages reading it
    frozen: list[int] = field(default_factory=list)  # acts of earlier passes (no gradient)
    stage: int = 0
    pass_: int = 0

    # ---- layouts ------------------------------------------------------------------------

    def layout(self, t: int) -> Layout:
        """The layout tensor ``t`` is handed over in (what this stage's consumers want)."""
        low = self.low
        if t in low.storage:
            return low.storage[t]
        lay = low.targets.get(t)
        return lay if lay is not None else replicated(len(low.plan.pgraph.graph.tensors[t].shape))

    def sharding(self, t: int) -> NamedSharding:
        return self.low.sharding(self.layout(t))

    @cached_property
    def accumulators(self) -> list[NamedSharding]:
        """Per parameter, where the stage keeps its gradient sum over the micro-batches
        (:meth:`Lowered.accumulator`: split over every device of the group); the handoff
        reduces it once more, across stages, for the update."""
        return [self.low.sharding(self.low.accumulator(t)) for t in self.params]

    # ---- the forward --------------------------------------------------------------------

    def _fn(self, params, acts, frozen, state, batch):
        low = self.low
        g = low.plan.pgraph.graph
        env = dict(g.consts)
        have: dict[int, Layout] = {}
        for ids, vals in ((self.params, params), (self.state, state), (self.batch, batch)):
            for t, v in zip(ids, vals):
                env[t], have[t] = v.astype(self.dtypes[t]), low.storage[t]
        for t, v in (*zip(self.acts_in, acts), *zip(self.frozen, frozen)):
            env[t], have[t] = v, self.layout(t)
        run_ops(low, self.ops, env, have)
        out_acts = [
            jax.lax.with_sharding_constraint(env[t], self.sharding(t)) for t in self.acts_out
        ]
        outs = [env[t].astype(jnp.float32) for t in self.outputs]
        return out_acts, outs

    @cached_property
    def forward(self):
        return jax.jit(lambda p, a, f, s, b: self._fn(p, a, f, s, b))

    @cached_property
    def _fwd_bwd(self):
        return jax.fwd_and_bwd(
            lambda p, a, f, s, b: self._fn(p, a, f, s, b), argnums=(0, 1), jitted=False
        )

    @cached_property
    def forward_res(self):
        """``(p, a, f, s, b) -> (outputs, kept)``: the residuals the backward needs, less
        those that are the program's own inputs (the weight ``x @ w`` keeps for ``dx``).
        Returned from a program, such an input would be a copy per micro-batch in flight;
        the caller holds them instead (:meth:`held`) and hands them to the backward."""
        fwd = self._fwd_bwd[0]

        def run(*args):
            outs, vjp = fwd(*args)
            leaves, tree = jax.tree.flatten(vjp)
            given = {id(x): i for i, x in enumerate(jax.tree.leaves(args))}
            taken = [given.get(id(x)) for x in leaves]  # input index, or None: kept
            inputs = sorted({i for i in taken if i is not None})
            slots = [None if i is None else inputs.index(i) for i in taken]
            self._residuals = (tree, slots, inputs)  # set while tracing: the backward rebuilds
            return outs, [x for x, i in zip(leaves, taken) if i is None]

        return jax.jit(run)

    def held(self, args) -> list:
        """The forward's inputs among its residuals (after :attr:`forward_res` ran)."""
        leaves = jax.tree.leaves(args)
        return [leaves[i] for i in self._residuals[2]]

    def _vjp(self, held, kept):
        """The forward's residuals again, from :meth:`held` and what it kept."""
        tree, slots, _ = self._residuals
        kept = iter(kept)
        return jax.tree.unflatten(tree, [next(kept) if k is None else held[k] for k in slots])

    @cached_property
    def backward(self):
        """``(acc, held, kept, cot) -> (acc + d_params, d_acts)``: ``held`` the forward's
        inputs it needs (:meth:`held`), ``kept`` what :attr:`forward_res` returned with its
        outputs, ``acc`` the parameter gradients of earlier micro-batches or None (the
        first). ``acc`` is donated: the sum is written over it inside the program, so a
        stage holds one accumulator and not the old sum, the new gradients and their sum."""
        bwd = self._fwd_bwd[1]

        def run(acc, held, kept, cot):
            d_params, d_acts = bwd(self._vjp(held, kept), cot)
            return _accumulate(acc, d_params, self.accumulators), d_acts

        return jax.jit(run, donate_argnums=0)

    @cached_property
    def backward_input(self):
        bwd = self._fwd_bwd[1]
        return jax.jit(lambda held, kept, cot: bwd(self._vjp(held, kept), cot)[1])

    @cached_property
    def backward_weight(self):
        """``(acc, held, kept, cot) -> acc + d_params``, ``acc`` donated as in
        :attr:`backward`."""
        bwd = self._fwd_bwd[1]

        def run(acc, held, kept, cot):
            return _accumulate(acc, bwd(self._vjp(held, kept), cot)[0], self.accumulators)

        return jax.jit(run, donate_argnums=0)


def _accumulate(acc, grads, shardings):
    """``acc + grads`` leaf by leaf in the accumulators' layouts, inside a stage's backward
    program (``acc``: None for the first micro-batch)."""
    grads = [jax.lax.with_sharding_constraint(g, sh) for g, sh in zip(grads, shardings)]
    return grads if acc is None else [a + g for a, g in zip(acc, grads)]


def build_stages(
    lowered: list[Lowered],
    placement,
    stage_of: dict[int, int],
    dtypes: dict[int, str],
    pass_of: dict[int, int] | None = None,
) -> list[Stage]:
    """Stages 0..S-1 of every forward pass, pass-major (``pass_of``: forward op id ->
    pass; None: one pass); stage s runs with ``lowered[placement[s]]``.

    ``stage_of`` maps the base graph's forward ops to stages; a plan's inserted identity
    ops (ZeRO-3 gathers) join the first stage reading their output.
    """
    n = len(placement)
    pass_of = pass_of or {}
    n_passes = max(pass_of.values(), default=0) + 1
    where: dict[int, dict[int, tuple[int, int]]] = {}  # group -> op id -> (stage, pass)
    stages = []
    for k in range(n_passes):
        for s in range(n):
            gi = placement[s]
            low = lowered[gi]
            g = low.plan.pgraph.graph
            if gi not in where:
                where[gi] = {o.id: _place(o, g, stage_of, pass_of) for o in g.ops}
            ops = [o for o in g.ops if where[gi][o.id] == (s, k)]
            stages.append((k * n + s, gi, low, ops))
    produced_in: dict[int, int] = {}
    for i, _, _, ops in stages:
        for o in ops:
            produced_in.update({t: i for t in o.outputs})
    reads = {
        i: list(dict.fromkeys(x for o in ops for x in o.tensor_inputs)) for i, *_, ops in stages
    }
    # every pass of a stage takes the same parameters and state: what any of them reads
    stage_reads = {
        s: list(dict.fromkeys(x for j in range(s, len(stages), n) for x in reads[j]))
        for s in range(n)
    }
    out = []
    for i, gi, low, ops in stages:
        s, k = i % n, i // n
        g = low.plan.pgraph.graph
        _check_regions(low, ops, s)
        _check_loops(low, ops, s)
        roles = {t: g.tensors[t].role for t in g.inputs}
        read = reads[i]
        mine = {t for o in ops for t in o.outputs}
        outer = [x for x in read if x in produced_in and x not in mine]
        for x in outer:
            if produced_in[x] % n > s and produced_in[x] // n == k:
                raise PlanError(
                    f"stage {s} reads {_name(g, x)}, computed by the later stage "
                    f"{produced_in[x] % n}; stage cuts must follow the data flow"
                )
        outputs = [x for x in g.outputs if not isinstance(x, Literal) and x in mine]
        out.append(
            Stage(
                index=i,
                group=gi,
                low=low,
                ops=ops,
                params=[x for x in stage_reads[s] if roles.get(x) == "param"],
                state=[x for x in stage_reads[s] if roles.get(x) == "state"],
                batch=[x for x in read if roles.get(x) == "batch"],
                acts_in=[x for x in outer if produced_in[x] // n == k],
                acts_out=[],
                outputs=outputs,
                dtypes=dtypes,
                frozen=[x for x in outer if produced_in[x] // n < k],
                stage=s,
                pass_=k,
            )
        )
    for st in out:
        for x in (*st.acts_in, *st.frozen):
            src = out[produced_in[x]]
            if x not in src.acts_out:
                src.acts_out.append(x)
            src.consumers.setdefault(x, []).append(st.index)
    return out


def _place(o: Op, g, stage_of: dict[int, int], pass_of: dict[int, int]) -> tuple[int, int]:
    """(stage, pass) of an op of the plan's graph."""
    if o.id in stage_of:
        return stage_of[o.id], pass_of.get(o.id, 0)
    users = {_place(u, g, stage_of, pass_of) for t in o.outputs for u in g.consumers(t)}
    if not users:
        raise PlanError(f"{o.where} has no consumer and no stage")
    if len(users) > 1 and o.kind == "identity":
        where = sorted(s for s, _ in users)
        raise PlanError(
            f"the gathered parameter of {o.where} is read by stages {where} (or several "
            f"forward passes); a ZeRO-3 gather must serve one stage. Use zero<=2 inside "
            f"pipeline stages"
        )
    return min(users)


def _check_regions(low: Lowered, ops: list[Op], s: int) -> None:
    ids = {o.id for o in ops}
    for region in low.plan.regions:
        inside = [o for o in region.ops if o in ids]
        if inside and len(inside) != len(region.ops):
            op = low.plan.pgraph.op(region.ops[0])
            raise PlanError(
                f"the {region.kind} region starting at {op.where} is cut by the stage "
                f"boundary after stage {s}; cut stages between regions (explicit cuts)"
            )


def _check_loops(low: Lowered, ops: list[Op], s: int) -> None:
    """An exposed scan runs whole in one stage: cut between its chunks, not inside one."""
    g = low.plan.pgraph.graph
    ids = {o.id for o in ops}
    for loop in {o.loop for o in ops if o.loop is not None}:
        region = [x for x in g.ops if x.loop is loop]
        if any(x.id not in ids for x in region):
            chunks = len({x.loop for x in g.ops if x.loop is not None})
            raise PlanError(
                f"stage {s} holds part of one iteration of the scan at {region[0].where}: a "
                f"stack of layers under a scan is cut into whole chunks ({chunks} here, each "
                f"a scan over its share of the layers), so a schedule may have at most that "
                f"many stages; use fewer stages per group (e.g. one_f_one_b) or fewer groups"
            )


def _name(g, t: int) -> str:
    p = g.producer(t)
    return f"the output of {p.where}" if p is not None else f"tensor {t}"
