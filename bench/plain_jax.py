"""The baselines: training steps written in plain JAX, as users write them.

* ``plain_dp``: ``jax.jit`` with the batch split over every device, parameters replicated.
* ``plain_rules``: parameters sharded by name rules (Megatron-style, as t5x/MaxText
  logical-axis rules do), the batch split over the data axis, GSPMD propagating the rest.
"""

from __future__ import annotations

import re

from flax import nnx
from jax.sharding import PartitionSpec as P

from bench.plain_baselines import BATCH, ParamsStep, mesh

GPT_RULES = [  # (regex on the param path, spec)
    (r"attn/(q|k|v)_proj/kernel$", P(None, "tp")),
    (r"attn/o_proj/kernel$", P("tp", None)),
    (r"mlp/(gate|up)_proj/kernel$", P(None, "tp")),
    (r"mlp/down_proj/kernel$", P("tp", None)),
    (r"embed/embedding$", P("tp", None)),
    (r"lm_head/kernel$", P(None, "tp")),
]


class PlainStep(ParamsStep):
    """:class:`~bench.plain_baselines.ParamsStep` over an nnx model's Params (the loss sees
    the model merged back); mirrors Trainer's interface."""

    def __init__(self, model, loss_fn, optimizer, batch, mesh, param_spec, batch_spec=BATCH):
        graphdef, params, rest = nnx.split(model, nnx.Param, ...)

        def loss_of(p, batch):
            return loss_fn(nnx.merge(graphdef, p, rest), batch)

        super().__init__(params, loss_of, optimizer, batch, mesh, param_spec, batch_spec)


def plain_dp(model, loss_fn, optimizer, batch, n_devices: int) -> PlainStep:
    return PlainStep(
        model, loss_fn, optimizer, batch, mesh(n_devices, 1), lambda path, x: P(), P("dp")
    )


def plain_rules(model, loss_fn, optimizer, batch, dp: int, tp: int, rules=GPT_RULES) -> PlainStep:
    def spec(path, x):
        for pattern, s in rules:
            if re.search(pattern, path):
                return s
        return P()

    return PlainStep(model, loss_fn, optimizer, batch, mesh(dp, tp), spec, P("dp"))
