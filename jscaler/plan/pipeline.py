"""PipelinePlan: op-assign of whole stages to device groups, each group with its own plan.

A pipeline cuts the forward graph into stages (contiguous in execution order) and assigns
each stage to a device group. Inside a group a stage runs SPMD under the group's
:class:`Plan` (made for the whole graph on the group's own mesh; only the stage's ops
run), so tensor, data and ZeRO parallelism inside a stage are the plans of a single
program. Which group holds which stage is the schedule's ``placement``; groups may
overlap (the interlaced schedule's all-device embedding stage).

Cuts default to balanced repeated layers (``Graph.layers``), or balanced FLOPs for a
model without them; a space may give them explicitly as the op ids that start stages
1..S-1.

A recycling model (AlphaFold2) runs its layers several times per step, every pass but the
last under ``stop_gradient``. :func:`pass_of_ops` finds the passes in the traced graph;
each pass is cut into the same stages (a layer's copies in every pass share its stage,
and so its parameters), and the schedule's ``F(s, m, k)`` runs pass k's ops of stage s.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar

from jscaler.errors import PlanError
from jscaler.ir.graph import Graph, Literal
from jscaler.plan.plan import Plan
from jscaler.plan.validate import validate

__all__ = ["PipelinePlan", "StageGroup", "pass_of_ops", "stage_of_ops"]


@dataclass(frozen=True, eq=False)
class StageGroup:
    """Devices (ids of the devices the trainer runs on) and the plan stages run with
    there: ``plan``'s device i is ``devices[i]``."""

    def __repr__(self):
        return f"StageGroup({list(self.devices)}, {self.plan.name or 'plan'})"

    devices: tuple[int, ...]
    plan: Plan

    def __post_init__(self):
        object.__setattr__(self, "devices", tuple(int(d) for d in self.devices))
        if len(set(self.devices)) != len(self.devices):
            raise PlanError(f"a stage group lists a device twice: {list(self.devices)}")
        if self.plan.mesh.size != len(self.devices):
            raise PlanError(
                f"a stage group of {len(self.devices)} devices {list(self.devices)} got a plan "
                f"for {self.plan.mesh.size} devices ({self.plan.name or 'unnamed'}); make the "
                f"group's plan for its own device count"
            )


@dataclass(frozen=True, eq=False)
class PipelinePlan:
    """Device groups with their plans, and optionally explicit stage cuts.

    Attributes:
      groups: the device groups; a schedule's group g runs on ``groups[g]``.
      name: for tables and logs, e.g. ``megatron(tp=2, dp=2, pp=2)``.
      cuts: op ids of the ops that start stages 1..S-1 (None: balanced).
      whole: groups spanning every device, time-shared with the others (the interlaced
        pipeline's embedding group); a schedule for this plan marks the same groups.
      schedule: the schedule function ``(groups, microbatches) -> Schedule`` the space
        made the plan for, used when :func:`jscaler.parallelize` is given none (None:
        ``one_f_one_b``).
    """

    groups: tuple[StageGroup, ...]
    name: str = ""
    cuts: tuple[int, ...] | None = None
    whole: tuple[int, ...] = ()
    schedule: Callable | None = None
    solved: Any = field(default=None, repr=False)  # as Plan's: how a search found it
    searched: Any = field(default=None, repr=False)
    is_pipeline: ClassVar[bool] = True  # see jscaler.plan.kind.AnyPlan

    def __post_init__(self):
        object.__setattr__(self, "groups", tuple(self.groups))
        object.__setattr__(self, "whole", tuple(self.whole))
        if not self.groups:
            raise PlanError("a pipeline plan needs at least one device group")
        fps = {g.plan.fingerprint for g in self.groups}
        if len(fps) != 1:
            raise PlanError("the groups of a pipeline plan were planned for different graphs")

    def __repr__(self):
        groups = ", ".join(f"{list(g.devices)}: {g.plan.name or 'plan'}" for g in self.groups)
        cuts = f", cuts={list(self.cuts)}" if self.cuts is not None else ""
        return f"PipelinePlan({self.name!r}, groups=[{groups}]{cuts})"

    @property
    def graph(self) -> Graph:
        return self.groups[0].plan.graph

    @property
    def spmd_plans(self) -> tuple:
        """The groups' plans, each once, in group order (see :class:`AnyPlan`)."""
        return tuple({id(g.plan): g.plan for g in self.groups}.values())

    @property
    def pipeline_groups(self) -> int:
        """Groups that partition the devices (the ``p`` a schedule function is given)."""
        return len(self.groups) - len(self.whole)

    @property
    def devices(self) -> tuple[int, ...]:
        """Every device some group uses, in first-use order."""
        return tuple(dict.fromkeys(d for g in self.groups for d in g.devices))

    def describe(self) -> dict:
        """What a process runs under this plan, JSON-able (see :class:`AnyPlan`): every
        group's devices and plan, the cuts and the all-device groups."""
        return {
            "name": self.name,
            "groups": [[list(g.devices), g.plan.to_json()] for g in self.groups],
            "cuts": None if self.cuts is None else list(self.cuts),
            "whole": list(self.whole),
        }

    def validate(self, n_devices: int) -> PipelinePlan:
        """Each group's devices exist and its plan is valid on them."""
        for gi, g in enumerate(self.groups):
            bad = [d for d in g.devices if not 0 <= d < n_devices]
            if bad:
                raise PlanError(
                    f"pipeline {self.name!r}: group {gi} places stages on device {bad[0]}, "
                    f"but the trainer has {n_devices} devices (0..{n_devices - 1}); pass more "
                    f"devices or a plan for {n_devices}"
                )
            validate(g.plan, n_devices=len(g.devices))
        return self


def pass_of_ops(graph: Graph, passes: int) -> dict[int, int]:
    """Forward op id -> the forward pass (0..passes-1) it belongs to.

    The last pass holds every op the loss is differentiated through. An op whose every
    path to the loss crosses ``r`` ``stop_gradient`` ops belongs to pass ``passes-1-r``
    (at least 0), unless it reads a value of a later pass (a ``stop_gradient`` inside
    the last pass, such as a log-sum-exp's max, stays there). Ops of earlier passes thus
    never need a gradient, and every value flows from a pass to the same or a later one.

    Raises:
      PlanError: some pass gets no ops (the model does not recycle ``passes`` times).
    """
    if passes < 1:
        raise PlanError(f"a step needs at least one forward pass, got {passes}")
    ops = graph.ops
    if passes == 1:
        return {o.id: 0 for o in ops}
    depth: dict[int, int] = {}  # tensor -> fewest stop_gradients on a path to the loss
    for t in graph.outputs:
        if not isinstance(t, Literal):
            depth[t] = 0
    rdepth: dict[int, int | None] = {}
    for o in reversed(ops):
        ds = [depth[t] for t in o.outputs if t in depth]
        r = min(ds) if ds else None
        rdepth[o.id] = r
        if r is not None:
            r += o.primitive == "stop_gradient"
            for x in o.tensor_inputs:
                depth[x] = min(depth.get(x, r), r)
    out: dict[int, int] = {}
    made: dict[int, int] = {}
    for o in ops:
        r = rdepth[o.id]
        k = passes - 1 if r is None else max(passes - 1 - r, 0)
        k = max([k, *(made[x] for x in o.tensor_inputs if x in made)])
        out[o.id] = k
        made.update({t: k for t in o.outputs})
    empty = [k for k in range(passes) if k not in out.values()]
    if empty:
        n_sg = sum(o.primitive == "stop_gradient" for o in ops)
        raise PlanError(
            f"the schedule runs {passes} forward passes per micro-batch, but forward pass "
            f"{empty[0]} of this graph has no ops ({n_sg} stop_gradient op(s) found); a "
            f"recycling model runs its layers {passes} times, every pass but the last "
            f"under jax.lax.stop_gradient. Use a one-pass schedule for this model"
        )
    return out


def stage_of_ops(
    graph: Graph,
    n_stages: int,
    cuts: tuple[int, ...] | None = None,
    pass_of: dict[int, int] | None = None,
) -> dict:
    """Forward op id -> stage, with every tensor flowing from a stage to the same or a
    later one within a forward pass.

    Repeated layers are dealt out in contiguous, balanced runs (a layer's copies in every
    pass of ``pass_of`` get the same stage; with one pass, a recycling model's layer runs,
    :meth:`Graph.layer_runs`, are dealt out instead); ops outside layers join the stage of their
    inputs from the same pass (or, reading none, of their first consumer in it). A graph
    without layers is cut at balanced cumulative FLOPs per pass. ``cuts`` (op ids
    starting stages 1..S-1) overrides both.
    """
    ops = graph.ops
    if n_stages < 1:
        raise PlanError(f"a pipeline needs at least one stage, got {n_stages}")
    pass_of = pass_of or {o.id: 0 for o in ops}
    n_passes = max(pass_of.values(), default=0) + 1
    if cuts is not None:
        if n_passes > 1:
            raise PlanError(
                "explicit stage cuts name ops of one forward pass; a recycling model's "
                f"{n_passes} passes are cut by its repeated layers (leave cuts=None)"
            )
        seed = _explicit(graph, n_stages, cuts)
    else:
        layers = graph.layers()
        # one forward pass: deal the layers' runs (a recycling model's layer runs once per
        # pass, and a stage takes ops in execution order); several: each pass's copies of
        # a layer on the same stage
        units = [ids for _, ids in graph.layer_runs()] if n_passes == 1 else []
        units = units or [[o.id for o in layer.graph.ops] for layer in layers]
        if len(units) >= n_stages:
            seed = {}
            for i, ids in enumerate(units):
                s = i * n_stages // len(units)
                seed.update({o: s for o in ids})
        else:
            seed = {}
            for k in range(n_passes):
                seed.update(_by_flops([o for o in ops if pass_of[o.id] == k], n_stages))
    producer: dict[int, tuple[int, int]] = {}  # tensor -> (pass, stage)
    stage: dict[int, int | None] = {}
    for o in ops:
        k = pass_of[o.id]
        before = [producer[x][1] for x in o.tensor_inputs if producer.get(x, (-1,))[0] == k]
        s = seed.get(o.id)
        if s is None:
            s = max(before, default=None)
        elif before:
            s = max(s, *before)
        stage[o.id] = s
        if s is not None:
            producer.update({t: (k, s) for t in o.outputs})
    for o in reversed(ops):  # ops reading nothing of their pass: with their first consumer
        if stage[o.id] is None:
            k = pass_of[o.id]
            users = [
                stage[u.id]
                for t in o.outputs
                for u in graph.consumers(t)
                if pass_of[u.id] == k and stage[u.id] is not None
            ]
            stage[o.id] = min(users, default=n_stages - 1)
    for k in range(n_passes):
        used = {stage[o.id] for o in ops if pass_of[o.id] == k}
        empty = [s for s in range(n_stages) if s not in used]
        if empty:
            what = f" in forward pass {k}" if n_passes > 1 else ""
            raise PlanError(
                f"cannot cut the graph into {n_stages} stages: stage {empty[0]} gets no "
                f"ops{what} ({len(graph.layers())} repeated layers, {len(ops)} ops); use "
                f"fewer stages"
            )
    return stage


def _explicit(graph: Graph, n_stages: int, cuts) -> dict[int, int]:
    cuts = tuple(int(c) for c in cuts)
    ids = [o.id for o in graph.ops]
    if len(cuts) != n_stages - 1:
        raise PlanError(
            f"{len(cuts)} cut(s) {list(cuts)} for {n_stages} stages; give the op ids that "
            f"start stages 1..{n_stages - 1}"
        )
    pos = []
    for c in cuts:
        if c not in ids:
            raise PlanError(f"cut at op {c}: the graph has no forward op with that id")
        pos.append(ids.index(c))
    if pos != sorted(set(pos)):
        raise PlanError(f"cuts {list(cuts)} must name distinct ops in execution order")
    out, s = {}, 0
    for k, o in enumerate(graph.ops):
        while s < len(pos) and k >= pos[s]:
            s += 1
        out[o.id] = s
    return out


def _by_flops(ops, n_stages: int) -> dict[int, int]:
    total = sum(o.flops for o in ops) or 1.0
    out, acc = {}, 0.0
    for o in ops:
        if o.flops:
            out[o.id] = min(int((acc + o.flops / 2) * n_stages / total), n_stages - 1)
        acc += o.flops
    return out
