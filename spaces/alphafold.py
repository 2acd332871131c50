"""nnScaler's AlphaFold2 plan: pipeline stages over the Evoformer blocks, run with 3F1B.

AlphaFold2 recycles: every step runs the model three times, the first two passes without
gradients. A plain 1F1B pipeline would run each micro-batch's three passes back to back
through all stages (the first stage waiting for the last between passes); the 3F1B
schedule interleaves the passes of consecutive micro-batches so every stage stays busy,
at 1F1B's activation memory (only the last pass keeps activations).

``alphafold_3f1b(pp, tp, dp, dap)`` cuts the Evoformer blocks evenly into ``pp`` stages
on disjoint device groups, each group running ``megatron(tp, dp)`` (tensor parallelism
over attention heads and transition features inside a stage) or, with ``dap`` > 1,
``dap(dap, dp)`` (dynamic axial parallelism: the MSA and pair representations split along
one of their axes, ``spaces.dap``), and names ``three_f_one_b`` as the plan's schedule.
The passes are found in the traced graph by the ``stop_gradient``s between them.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import jscaler
from schedules.three_f_one_b import three_f_one_b
from spaces.dap import dap
from spaces.knobs import check_int
from spaces.megatron import megatron, pipeline


@dataclass(frozen=True)
class AlphaFold3F1B:
    pp: int = 2
    tp: int = 1
    dp: int | None = None
    dap: int = 1
    recompute: float = 0

    def __call__(self, graph: jscaler.Graph, n_devices: int) -> jscaler.PipelinePlan:
        check_int("alphafold_3f1b", "pp", self.pp, least=2, why=" (a pipeline)")
        if n_devices % self.pp:
            raise jscaler.PlanError(
                f"alphafold_3f1b(pp={self.pp}) needs a device count divisible by pp; "
                f"got {n_devices}"
            )
        check_int("alphafold_3f1b", "tp", self.tp)
        check_int("alphafold_3f1b", "dap", self.dap)
        if self.dap > 1 and self.tp > 1:
            raise jscaler.PlanError(
                f"alphafold_3f1b: tp={self.tp} and dap={self.dap} both split inside a stage; "
                f"choose one (dap splits the activations, tp the weights)"
            )
        r = self.recompute
        inner = (
            dap(self.dap, self.dp, r) if self.dap > 1 else megatron(self.tp, self.dp, recompute=r)
        )
        plan = pipeline(graph, inner, self.pp, n_devices)
        dp = plan.groups[0].plan.mesh.shape["dp"]
        split = f"dap={self.dap}" if self.dap > 1 else f"tp={self.tp}"
        name = f"alphafold_3f1b(pp={self.pp}, {split}, dp={dp})"
        return replace(plan, name=name, schedule=three_f_one_b)


def alphafold_3f1b(
    pp: int = 2, tp: int = 1, dp: int | None = None, dap: int = 1, recompute: float = 0
) -> AlphaFold3F1B:
    """``pp`` pipeline stages of Evoformer blocks, each ``megatron(tp, dp)`` (or with
    ``dap`` > 1, ``dap(dap, dp)``) on its own devices, scheduled with 3F1B; ``recompute``:
    the fraction of repeated layers to checkpoint."""
    return AlphaFold3F1B(pp, tp, dp, dap, recompute)
