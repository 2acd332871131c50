"""Write a space: data parallelism over the batch, plus tensor parallelism on the MLPs only.

A space is any function ``(graph, n_devices) -> Plan``; this one is written with the
public helpers over the three primitives (``jscaler.plan``): split the batch's dim class
over ``dp``, split the dim class of every MLP's hidden features over ``tp`` (it follows
the up/gate projections' outputs through the activation into the down projection, which
then produces partial sums), replicate everything else on ``tp``, and place the pieces on
the ``dp x tp`` mesh. It then checks itself against one device.

    python examples/custom_space.py
"""

from jscaler.setup import use_cpu_devices

use_cpu_devices(8)  # 8 simulated CPU devices; on GPUs, leave this out

import optax  # noqa: E402
from flax import nnx  # noqa: E402

import jscaler  # noqa: E402
from jscaler.plan import MeshSpec, Plan, assign_mesh, batch_axes, split_classes  # noqa: E402
from jscaler.report import explain  # noqa: E402
from jscaler.runtime.reference import compare, reference_steps, trainer_steps  # noqa: E402
from models import gpt  # noqa: E402


def dp_and_mlp_tp(dp: int, tp: int):
    """The space: batch over ``dp``, the MLPs' hidden features over ``tp``."""

    def space(graph: jscaler.Graph, n_devices: int) -> Plan:
        if dp * tp != n_devices:
            raise jscaler.PlanError(f"dp_and_mlp_tp({dp}, {tp}) needs {dp * tp} devices")
        plan = Plan.create(graph, MeshSpec.create(dp=dp, tp=tp), name=f"dp{dp}+mlp_tp{tp}")
        plan = split_classes(plan, batch_axes(graph, dp), dp)  # level 1 of every op
        hidden = [(t.id, 1) for t in graph.params() if t.name.endswith("mlp/up_proj/kernel")]
        plan = split_classes(plan, hidden, tp)  # level 2: split where the class is, else replicate
        return assign_mesh(plan, ["dp", "tp"])

    return space


def main():
    cfg = gpt.tiny()
    batches = [gpt.synthetic_batch(cfg, 8, seed=s) for s in range(3)]
    make = lambda: gpt.GPT(cfg, rngs=nnx.Rngs(0))  # noqa: E731
    trainer = jscaler.parallelize(
        make(), gpt.loss, optax.sgd(0.1), batches[0], devices=8, plan=dp_and_mlp_tp(4, 2)
    )
    print(explain(trainer.plan))
    print(trainer.comm_table().format())
    mm = compare(
        trainer_steps(trainer, batches),
        reference_steps(make(), gpt.loss, optax.sgd(0.1), batches),
    )
    print("MATCH with one device" if mm.ok else "MISMATCH:\n" + "\n".join(mm.lines))
    return 0 if mm.ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
