"""Several processes, one training run: a 2-stage pipeline whose stages live in two
processes of 4 CPU devices each, joined by jax.distributed on this machine.

Run as a script, it starts itself twice through ``jscaler launch``'s machinery (the same
as ``jscaler launch --nprocs 2 --devices-per-proc 4 -- python examples/multi_process.py``).
On a cluster, start one copy per host with srun / mpirun instead: ``init_distributed``
joins from the SLURM / Open MPI environment. Every process derives the same plan;
``parallelize`` checks that they agree before compiling.

    python examples/multi_process.py
"""

import os
import sys

from jscaler.setup import init_distributed


def worker():
    import jax
    import optax
    from flax import nnx

    import jscaler
    from models import gpt
    from spaces import megatron

    cfg = gpt.tiny()
    trainer = jscaler.parallelize(
        gpt.GPT(cfg, rngs=nnx.Rngs(0)), gpt.loss, optax.adam(3e-3), gpt.synthetic_batch(cfg, 16),
        plan=megatron(pp=2, dp=4), microbatches=4,
    )  # fmt: skip
    me = jax.process_index()
    stages = [
        sorted({d.process_index for d in st.low.mesh.devices.flat}) for st in trainer.program.stages
    ]
    for step in range(5):
        metrics = trainer.step(gpt.synthetic_batch(cfg, 16, seed=step))
        if me == 0:
            print(f"step {step}: loss {metrics['loss']:.4f}", flush=True)
    if me == 0:
        print(f"{jax.process_count()} processes, {jax.device_count()} devices; stage groups in "
              f"processes {stages}")  # fmt: skip
    return 0


if __name__ == "__main__":
    if "JSCALER_COORDINATOR" not in os.environ and "SLURM_NTASKS" not in os.environ:
        from jscaler.launch import launch

        sys.exit(launch([sys.executable, os.path.abspath(__file__)], 2, 4, timeout=300))
    init_distributed()
    sys.exit(worker())
