"""The systems nnScaler is compared with, as spaces: Megatron-LM 3-D and DeepSpeed.

* ``megatron_3d(tp, pp, dp)``: Megatron-LM's plan: data x tensor x pipeline parallelism
  with the repeated layers split evenly over the pipeline stages (1F1B).
* ``deepspeed(tp, dp)``: DeepSpeed ZeRO-3 over the data-parallel devices, on top of
  Megatron tensor parallelism (each device's tensor-parallel shard of every parameter,
  gradient and optimizer state split further over dp, gathered for use).

Both are written with the spaces they are made of; a bare name picks defaults for the
device count (``megatron_3d``: tp=2, pp=2, the rest data parallel; ``deepspeed``: tp=2).
"""

from __future__ import annotations

from spaces.megatron import megatron


def megatron_3d(tp: int = 2, pp: int = 2, dp: int | None = None, recompute: float = 0):
    """Megatron-LM 3-D parallelism: ``dp x tp x pp`` (dp inferred), layers split evenly
    over the ``pp`` stages."""
    return megatron(tp=tp, dp=dp, pp=pp, recompute=recompute)


def deepspeed(tp: int = 2, dp: int | None = None, recompute: float = 0):
    """DeepSpeed: ZeRO-3 over ``dp`` on top of Megatron tensor parallelism ``tp``."""
    return megatron(tp=tp, dp=dp, zero=3, recompute=recompute)
