"""Write a pipeline schedule as a Python function and train under it.

A schedule is a function ``(groups, microbatches) -> jscaler.Schedule`` listing, per
device group, the blocks it runs in order: ``Block(stage, microbatch, kind)`` with kind
F (forward), B (backward). ``Schedule.check()`` proves it complete and deadlock-free
before anything runs. This one is GPipe with the backwards newest-first; it trains a
2-stage pipeline (``megatron(pp=2, dp=4)``) equal to one device and draws its timeline.

    python examples/custom_schedule.py
"""

from jscaler.setup import use_cpu_devices

use_cpu_devices(8)

import optax  # noqa: E402
from flax import nnx  # noqa: E402

import jscaler  # noqa: E402
from jscaler import Block, Schedule  # noqa: E402
from jscaler.runtime.reference import compare, reference_steps, trainer_steps  # noqa: E402
from models import gpt  # noqa: E402
from spaces import megatron  # noqa: E402


def reverse_gpipe(p: int, m: int) -> Schedule:
    """Every stage runs all m forwards, then the m backwards newest first."""
    groups = [
        [Block(s, i, "F") for i in range(m)] + [Block(s, i, "B") for i in reversed(range(m))]
        for s in range(p)
    ]
    return Schedule("reverse_gpipe", p, m, groups, placement=tuple(range(p))).check()


def main():
    cfg = gpt.tiny()
    batches = [gpt.synthetic_batch(cfg, 16, seed=s) for s in range(2)]
    make = lambda: gpt.GPT(cfg, rngs=nnx.Rngs(0))  # noqa: E731
    trainer = jscaler.parallelize(
        make(), gpt.loss, optax.sgd(0.1), batches[0], devices=8,
        plan=megatron(pp=2, dp=4), microbatches=4, schedule=reverse_gpipe,
    )  # fmt: skip
    timeline = jscaler.simulate(trainer.program.schedule)
    print(f"{trainer.program.schedule.name}: bubble {timeline.bubble():.1%} (unit costs), "
          f"in flight per stage {timeline.in_flight()}")  # fmt: skip
    est = trainer.timeline("reverse_gpipe.json")  # the cost model's timeline, for Perfetto
    print(f"predicted step {est.step_time * 1e3:.2f} ms on {est.cluster}; wrote reverse_gpipe.json")
    mm = compare(
        trainer_steps(trainer, batches),
        reference_steps(make(), gpt.loss, optax.sgd(0.1), batches),
    )
    print("MATCH with one device" if mm.ok else "MISMATCH:\n" + "\n".join(mm.lines))
    return 0 if mm.ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
