"""The systems nnScaler is compared with, as spaces: Megatron-LM 3-D, DeepSpeed, Alpa.

* ``megatron_3d(tp, pp, dp)``: Megatron-LM's plan: data x tensor x pipeline parallelism
  with the repeated layers split evenly over the pipeline stages (1F1B).
* ``deepspeed(tp, dp)``: DeepSpeed ZeRO-3 over the data-parallel devices, on top of
  Megatron tensor parallelism (each device's tensor-parallel shard of every parameter,
  gradient and optimizer state split further over dp, gathered for use).
* ``alpa_like(pp, cluster)``: Alpa's plan as the paper ran it: the repeated layers in ``pp``
  even stages, and inside each stage's devices the intra-operator plan an ILP picks
  (``jscaler.intra_op``: every op's split chosen by HiGHS from the cost model of
  ``cluster``). The paper's baseline configuration used even stages (the default);
  ``slicing="dp"`` cuts them as Alpa's dynamic programming does
  (``jscaler.search.slice_stages``: balanced by the cost model's layer costs).

Both are written with the spaces they are made of; a bare name picks defaults for the
device count (``megatron_3d``: tp=2, pp=2, the rest data parallel; ``deepspeed``: tp=2).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import jscaler
from jscaler.search import slice_stages
from spaces.knobs import check_int
from spaces.megatron import megatron, pipeline


def megatron_3d(tp: int = 2, pp: int = 2, dp: int | None = None, recompute: float = 0):
    """Megatron-LM 3-D parallelism: ``dp x tp x pp`` (dp inferred), layers split evenly
    over the ``pp`` stages."""
    return megatron(tp=tp, dp=dp, pp=pp, recompute=recompute)


def deepspeed(tp: int = 2, dp: int | None = None, recompute: float = 0):
    """DeepSpeed: ZeRO-3 over ``dp`` on top of Megatron tensor parallelism ``tp``."""
    return megatron(tp=tp, dp=dp, zero=3, recompute=recompute)


@dataclass(frozen=True)
class AlpaLike:
    pp: int = 1
    cluster: str = "cpu"
    mesh: tuple = ()
    capacity: float | None = None
    slicing: str = "even"
    microbatches: int = 4
    dtype: str = "fp32"
    optimizer_slots: int = 0
    recompute: float = 0
    time_limit: float = 10.0

    def __call__(self, graph: jscaler.Graph, n_devices: int):
        if self.slicing not in ("even", "dp"):
            raise jscaler.PlanError(
                f"alpa_like: slicing must be 'even' or 'dp', got {self.slicing!r}"
            )
        check_int("alpa_like", "pp", self.pp)
        check_int(
            "alpa_like", "optimizer_slots", self.optimizer_slots, least=0,
            why=" (fp32 values of optimizer state per parameter: 2 for Adam)",
        )  # fmt: skip
        if n_devices % self.pp:
            raise jscaler.PlanError(
                f"alpa_like(pp={self.pp}) needs a device count divisible by pp; got {n_devices}"
            )
        capacity = self.capacity
        if self.pp > 1:  # one stage's devices hold ~1/pp of the model: bound the whole graph
            from jscaler.cost import get_cluster

            capacity = self.pp * (capacity or get_cluster(self.cluster).memory)
        inner = jscaler.intra_op(
            dict(self.mesh) or None, self.cluster, capacity, self.dtype, self.optimizer_slots,
            self.time_limit, recompute=self.recompute,
        )  # fmt: skip
        if self.pp == 1:
            plan = inner(graph, n_devices)
            return plan.evolve(name=f"alpa_like({plan.name})")
        plan = pipeline(graph, inner, self.pp, n_devices)
        inner_name = plan.groups[0].plan.name
        cuts = None
        if self.slicing == "dp":
            cuts = slice_stages(
                graph, plan.groups[0].plan, self.pp, self.microbatches, self.cluster, self.dtype
            )
            inner_name += ", dp-sliced"
        return replace(plan, name=f"alpa_like(pp={self.pp}, {inner_name})", cuts=cuts)


def alpa_like(
    pp: int = 1,
    cluster: str = "cpu",
    mesh: dict | None = None,
    capacity: float | None = None,
    slicing: str = "even",
    microbatches: int = 4,
    dtype: str = "fp32",
    optimizer_slots: int = 0,
    recompute: float = 0,
    time_limit: float = 10.0,
) -> AlpaLike:
    """Alpa: ``pp`` pipeline stages (``slicing="even"``, or ``"dp"``: balanced by dynamic
    programming for ``microbatches``), each stage's devices running the op-trans /
    op-assign ILP's plan for ``cluster`` (on ``mesh``, default one axis over the stage's
    devices), costed in ``dtype`` with ``optimizer_slots`` fp32 values of optimizer state
    per parameter; ``recompute``: the fraction of repeated layers checkpointed in the
    searched plan; ``time_limit``: the ILP's work limit per stage mesh (seconds of HiGHS's
    deterministic work: :func:`jscaler.search.ilp.solve`)."""
    return AlpaLike(
        pp, cluster, tuple((mesh or {}).items()), capacity, slicing, microbatches, dtype,
        optimizer_slots, recompute, time_limit,
    )  # fmt: skip
