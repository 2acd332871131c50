"""The baselines: training steps written in plain JAX, as users write them.

* ``plain_dp``: ``jax.jit`` with the batch split over every device, parameters replicated.
* ``plain_rules``: parameters sharded by name rules (Megatron-style, as t5x/MaxText
  logical-axis rules do), the batch split over the data axis, GSPMD propagating the rest.
"""

from __future__ import annotations

import re

import jax
import numpy as np
import optax
from flax import nnx
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

GPT_RULES = [  # (regex on the param path, spec)
    (r"attn/(q|k|v)_proj/kernel$", P(None, "tp")),
    (r"attn/o_proj/kernel$", P("tp", None)),
    (r"mlp/(gate|up)_proj/kernel$", P(None, "tp")),
    (r"mlp/down_proj/kernel$", P("tp", None)),
    (r"embed/embedding$", P("tp", None)),
    (r"lm_head/kernel$", P(None, "tp")),
]


def _path(keys) -> str:
    parts = []
    for k in keys:
        name = getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))
        if name != "value":
            parts.append(str(name))
    return "/".join(parts)


class PlainStep:
    """A jitted step over nnx params with given shardings; mirrors Trainer's interface."""

    def __init__(self, model, loss_fn, optimizer, batch, mesh, param_spec, batch_spec):
        graphdef, params, rest = nnx.split(model, nnx.Param, ...)
        self.mesh = mesh
        shard = lambda s: NamedSharding(mesh, s)  # noqa: E731
        p_shard = jax.tree_util.tree_map_with_path(
            lambda k, x: shard(param_spec(_path(k), x)), params
        )
        b_shard = jax.tree_util.tree_map(lambda _: shard(batch_spec), batch)
        opt_abstract = jax.eval_shape(optimizer.init, params)
        rep = shard(P())
        o_shard = optax.tree_map_params(
            optimizer, lambda _, s: s, opt_abstract, p_shard, transform_non_params=lambda _: rep
        )

        def step(params, opt_state, batch):
            def loss_of(p):
                return loss_fn(nnx.merge(graphdef, p, rest), batch)

            loss, grads = jax.value_and_grad(loss_of)(params)
            updates, opt_state = optimizer.update(grads, opt_state, params)
            return optax.apply_updates(params, updates), opt_state, loss

        self._fn = jax.jit(
            step,
            in_shardings=(p_shard, o_shard, b_shard),
            out_shardings=(p_shard, o_shard, rep),
            donate_argnums=(0, 1),
        )
        self.params = jax.device_put(params, p_shard)
        self.opt_state = jax.jit(optimizer.init, out_shardings=o_shard)(self.params)
        self._b_shard = b_shard

    def compiled(self, batch):
        b = jax.device_put(batch, self._b_shard)
        return self._fn.lower(self.params, self.opt_state, b).compile()

    def step(self, batch):
        b = jax.device_put(batch, self._b_shard)
        self.params, self.opt_state, loss = self._fn(self.params, self.opt_state, b)
        return {"loss": float(loss)}


def _mesh(dp: int, tp: int) -> Mesh:
    devices = np.array(jax.devices()[: dp * tp]).reshape(dp, tp)
    return Mesh(devices, ("dp", "tp"), axis_types=(AxisType.Auto,) * 2)


def plain_dp(model, loss_fn, optimizer, batch, n_devices: int) -> PlainStep:
    return PlainStep(
        model, loss_fn, optimizer, batch, _mesh(n_devices, 1), lambda path, x: P(), P("dp")
    )


def plain_rules(model, loss_fn, optimizer, batch, dp: int, tp: int, rules=GPT_RULES) -> PlainStep:
    def spec(path, x):
        for pattern, s in rules:
            if re.search(pattern, path):
                return s
        return P()

    return PlainStep(model, loss_fn, optimizer, batch, _mesh(dp, tp), spec, P("dp"))
