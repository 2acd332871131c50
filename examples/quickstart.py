"""The whole loop on a reference model: parallelise, train, evaluate, checkpoint, resume
under another plan on fewer devices, export the weights back into the user's model.

    python examples/quickstart.py
"""

import tempfile

from jscaler.setup import use_cpu_devices

use_cpu_devices(8)  # 8 simulated CPU devices; on GPUs, leave this out

import optax  # noqa: E402
from flax import nnx  # noqa: E402

import jscaler  # noqa: E402
from models import gpt  # noqa: E402
from spaces import megatron, zero  # noqa: E402


def main():
    cfg = gpt.tiny()
    data = lambda step: gpt.synthetic_batch(cfg, 8, seed=step)  # noqa: E731
    model = gpt.GPT(cfg, rngs=nnx.Rngs(0))
    trainer = jscaler.parallelize(
        model, gpt.loss, optax.adam(3e-3), data(0), devices=8, plan=megatron(tp=4, dp=2)
    )
    for step in range(10):
        metrics = trainer.step(data(step))
    print(f"step {trainer.step_count}: loss {metrics['loss']:.4f} under {trainer.plan.name}")
    print(f"eval loss {trainer.eval(data(100))['loss']:.4f}")

    with tempfile.TemporaryDirectory() as ckpt:
        saved = trainer.save(ckpt)  # ckpt/10, atomic
        # resume under ZeRO-3 on 4 devices: the arrays reshard on restore
        resumed = jscaler.parallelize(
            gpt.GPT(cfg, rngs=nnx.Rngs(1)), gpt.loss, optax.adam(3e-3), data(0), devices=4,
            plan=zero(stage=3),
        )  # fmt: skip
        step = resumed.restore(ckpt)
        print(f"restored {saved.name} at step {step} under {resumed.plan.name} on 4 devices")
    a, b = trainer.step(data(10)), resumed.step(data(10))
    print(f"step 11: loss {a['loss']:.6f} (megatron, 8 devices) vs {b['loss']:.6f} (zero-3, 4)")

    nnx.update(model, resumed.export())  # the trained weights, back in the user's model
    print(f"the user's model after export: loss {float(gpt.loss(model, data(100))):.4f}")
    return 0 if abs(a["loss"] - b["loss"]) <= 1e-5 * abs(a["loss"]) else 1


if __name__ == "__main__":
    raise SystemExit(main())
