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
"""

from __future__ import annotations

from dataclasses import dataclass

from jscaler.errors import PlanError
from jscaler.ir.graph import Graph
from jscaler.plan.plan import Plan
from jscaler.plan.validate import validate

__all__ = ["PipelinePlan", "StageGroup", "stage_of_ops"]


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
    """

    groups: tuple[StageGroup, ...]
    name: str = ""
    cuts: tuple[int, ...] | None = None
    whole: tuple[int, ...] = ()

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
    def pipeline_groups(self) -> int:
        """Groups that partition the devices (the ``p`` a schedule function is given)."""
        return len(self.groups) - len(self.whole)

    @property
    def devices(self) -> tuple[int, ...]:
        """Every device some group uses, in first-use order."""
        return tuple(dict.fromkeys(d for g in self.groups for d in g.devices))

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


def stage_of_ops(graph: Graph, n_stages: int, cuts: tuple[int, ...] | None = None) -> dict:
    """Forward op id -> stage, with every tensor flowing from a stage to the same or a
    later one.

    Repeated layers are dealt out in contiguous, balanced runs; ops outside layers join the
    stage of their inputs (or, reading only parameters and batch, of their first
    consumer). A graph without layers is cut at balanced cumulative FLOPs. ``cuts`` (op
    ids starting stages 1..S-1) overrides both.
    """
    ops = graph.ops
    if n_stages < 1:
        raise PlanError(f"a pipeline needs at least one stage, got {n_stages}")
    if cuts is not None:
        seed = _explicit(graph, n_stages, cuts)
    else:
        layers = graph.layers()
        if len(layers) >= n_stages:
            seed = {}
            for i, layer in enumerate(layers):
                s = i * n_stages // len(layers)
                seed.update({o.id: s for o in layer.graph.ops})
        else:
            seed = _by_flops(graph, n_stages)
    producer_stage: dict[int, int] = {}
    stage: dict[int, int | None] = {}
    for o in ops:
        before = [producer_stage[x] for x in o.tensor_inputs if x in producer_stage]
        s = seed.get(o.id)
        if s is None:
            s = max(before, default=None)
        elif before:
            s = max(s, *before)
        stage[o.id] = s
        if s is not None:
            producer_stage.update({t: s for t in o.outputs})
    for o in reversed(ops):  # ops on parameters/batch only: with their first consumer
        if stage[o.id] is None:
            users = [stage[u.id] for t in o.outputs for u in graph.consumers(t)]
            users = [u for u in users if u is not None]
            stage[o.id] = min(users, default=n_stages - 1)
    used = set(stage.values())
    empty = [s for s in range(n_stages) if s not in used]
    if empty:
        raise PlanError(
            f"cannot cut the graph into {n_stages} stages: stage {empty[0]} gets no ops "
            f"({len(graph.layers())} repeated layers, {len(ops)} ops); use fewer stages"
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


def _by_flops(graph: Graph, n_stages: int) -> dict[int, int]:
    total = sum(o.flops for o in graph.ops) or 1.0
    out, acc = {}, 0.0
    for o in graph.ops:
        if o.flops:
            out[o.id] = min(int((acc + o.flops / 2) * n_stages / total), n_stages - 1)
        acc += o.flops
    return out
