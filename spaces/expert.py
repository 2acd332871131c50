"""Expert parallelism for mixture-of-experts models.

The devices that hold the data-parallel replicas are arranged as ``dp x ep``: every
activation is split by batch over both, as data parallelism would; the experts' ops (the
per-expert matmuls and what lies between them) are split instead along the expert axis
over ``ep``, so each device holds and runs ``E / ep`` experts. Between the two, the
dispatched tokens ``[E, groups, capacity, d]`` change from a split by groups to a split by
experts over the same ``ep`` devices, which is one all-to-all (and one back after the
experts), implied by the layouts as Ulysses' are. The expert weights' gradients are
reduced over ``dp`` only; the dense weights' over ``dp x ep``. ``tp`` splits the experts'
hidden width and the dense parts' heads and MLPs as Megatron does, ``pp`` cuts the layers
into a pipeline of such stages. ``zero`` shards each weight's optimizer state (1),
gradient (2) and storage (3) over the devices that replicate it: a dense weight over ``dp
x ep`` (8 shards under ``ep=4, dp=2``), an expert weight, already split over ``ep``,
further over ``dp``; with ``dp=1`` ZeRO runs over ``ep`` alone.

Load imbalance: a dropless step waits for the device whose experts the router sends most
rows; ``models.moe.expert_skew`` measures that on a batch and
``jscaler.estimate(..., expert_skew=)`` charges it. A capacity dispatch's time does not
depend on it (it drops the excess).

Dropless dispatch (``models/moe.py``'s ``"dropless"``, MegaBlocks', tunix's Gemma 4):
the (token, choice) rows are sorted by expert over the whole batch and multiplied with
``ragged_dot``. The sort needs every row, so the rows are gathered on every device; each
``ragged_dot`` is split along its groups over ``ep`` (the group dim is '+': a device
computes its own experts' rows, zeros for the others', and the pieces are summed over
``ep``, an all-reduce), so a device still holds and runs ``E / ep`` experts and the result
is exactly one device's. No all-to-all here: every device sees every row.

Experts are found from the graph: a parameter axis that is a batch dimension of a matmul
(``einsum("egcd,edf->egcf")``: each expert's tokens times that expert's weight) or the
group axis of a ``ragged_dot``'s weight, or named with ``experts="blocks/*/moe/w_*"`` (a
glob over parameter names; their leading axis).
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass, replace

import jscaler
from jscaler.plan import (
    DimClasses,
    MeshSpec,
    Plan,
    assign_mesh,
    batch_axes,
    recompute_layers,
    split_classes,
)
from spaces.knobs import check_int
from spaces.megatron import infer_dp, param_source, pipeline, sequence_axes, tp_seeds
from spaces.zero import zero_over


def expert_axes(graph: jscaler.Graph, names: str | None = None) -> list[tuple[int, int]]:
    """``(tensor, axis)`` of the stacked expert weights, as seen by the ops reading them:
    with ``names``, axis 0 of the parameters whose names match the glob; else every
    parameter axis that is a batch dimension of a ``dot_general`` or the group dimension
    of a ``ragged_dot``."""
    found = []
    if names is not None:
        for t in graph.inputs:
            tensor = graph.tensors[t]
            if tensor.role == "param" and fnmatch.fnmatch(tensor.name, names) and tensor.shape:
                found.append((t, 0))
        return found
    for op in graph.ops:
        if op.eqn is None:
            continue
        if op.primitive == "ragged_dot_general":
            groups = op.eqn.params["ragged_dot_dimension_numbers"].rhs_group_dimensions
            x = op.tensor_inputs[1]
            if groups and param_source(graph, x) is not None:
                found.append((x, groups[0]))
            continue
        if op.primitive != "dot_general":
            continue
        _, batch = op.eqn.params["dimension_numbers"]
        for x, dims in zip(op.tensor_inputs[:2], batch):
            if dims and param_source(graph, x) is not None:
                found.append((x, dims[0]))
    return list(dict.fromkeys(found))


@dataclass(frozen=True)
class Expert:
    ep: int = 2
    dp: int | None = None
    tp: int = 1
    pp: int = 1
    zero: int = 0
    recompute: float = 0
    precision: str = "fp32"
    experts: str | None = None

    def __call__(self, graph: jscaler.Graph, n_devices: int) -> Plan | jscaler.PipelinePlan:
        check_int("expert", "ep", self.ep)
        check_int("expert", "tp", self.tp)
        if self.experts is not None and not isinstance(self.experts, str):
            raise jscaler.PlanError(
                f"expert: experts must be a glob of parameter names, got {self.experts!r}"
            )
        dp = infer_dp(n_devices, self.ep * self.tp, self.pp, self.dp, "expert", "ep*tp")
        if self.pp > 1:
            return pipeline(graph, replace(self, pp=1, dp=dp), self.pp, n_devices)
        found = self._experts(graph)
        mesh = MeshSpec.create(dp=dp, ep=self.ep, tp=self.tp)
        zero = f", zero={self.zero}" if self.zero else ""
        name = f"expert(ep={self.ep}, dp={dp}, tp={self.tp}{zero})"
        plan = Plan.create(graph, mesh, name=name)
        classes = DimClasses.for_graph(plan.pgraph.graph)
        plan = split_classes(plan, batch_axes(graph, dp * self.ep), dp, classes=classes)
        experts = {classes.of(*s) for s in found}
        sequence = {classes.of(*s) for s in sequence_axes(graph)}

        def by_expert(op, dim):  # the expert axis only where no token axis is left
            if any(classes.dim_of(op, c) == dim for c in experts):
                return not any(classes.dim_of(op, c) is not None for c in sequence)
            return True

        plan = split_classes(plan, found + batch_axes(graph), self.ep, classes=classes,
                             choose=by_expert)  # fmt: skip
        seeds, _ = tp_seeds(graph, classes)  # one level per mesh axis, tp=1 included
        seeds = [(t, a) for t, a in seeds if graph.tensors[t].shape[a] % self.tp == 0]
        plan = split_classes(plan, seeds, self.tp, classes=classes)
        plan = assign_mesh(plan, ["dp", "ep", "tp"])
        plan = zero_over(plan, graph, self.zero, ("dp", "ep"))  # dense over dp x ep, experts dp
        return recompute_layers(plan, self.recompute)

    def _experts(self, graph: jscaler.Graph) -> list[tuple[int, int]]:
        call = f"expert(ep={self.ep})"
        found = expert_axes(graph, self.experts)
        if not found:
            how = (
                f"no parameter name matches {self.experts!r}"
                if self.experts is not None
                else "no parameter axis is a batch dimension of a matmul (a stacked expert "
                "weight, einsum('egcd,edf->egcf')) or the group axis of a ragged_dot"
            )
            raise jscaler.PlanError(
                f"{call}: the graph has no experts: {how}. Name them with "
                f"experts='<glob of parameter names>', or use dp(), megatron() or zero()"
            )
        for t, axis in found:
            size = graph.tensors[t].shape[axis]
            if size % self.ep:
                raise jscaler.PlanError(
                    f"{call} cannot split the experts of {graph.tensors[t].name!r}: it "
                    f"stacks {size} along axis {axis}, which {self.ep} does not divide. "
                    f"Choose ep among the divisors of {size}"
                )
        return found


def expert(
    ep: int = 2,
    dp: int | None = None,
    tp: int = 1,
    pp: int = 1,
    zero: int = 0,
    recompute: float = 0,
    precision: str = "fp32",
    experts: str | None = None,
) -> Expert:
    """Expert parallelism: experts split over ``ep`` devices (formed from the
    data-parallel ones), tokens sent to them and back with an all-to-all; dense parts
    under data parallelism over ``dp x ep`` (and Megatron's ``tp``); ``zero`` (stage 1-3)
    over every device that replicates a weight: dense ones over ``dp x ep``, experts over
    ``dp``; ``pp`` pipeline stages. ``experts``: a glob of the expert weights' names
    where the graph cannot tell (see the module doc)."""
    return Expert(ep, dp, tp, pp, zero, recompute, precision, experts)
