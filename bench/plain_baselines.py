"""Plain-JAX training steps over a params pytree, as users shard them by hand.

A :class:`ParamsStep` is ``jax.jit`` of ``value_and_grad`` + the optax update, with each
parameter (and its optimizer state) placed by a ``spec(path, array) -> PartitionSpec``
function, the batch split over the ``dp`` mesh axis, and GSPMD propagating the rest.
The four layouts of ``jscaler bench plain``:

* ``plain dp``: every parameter replicated (mesh dp=8).
* ``plain fsdp``: each parameter's largest axis that 8 divides sharded over all 8
  devices (mesh dp=8), as ``jax.sharding`` FSDP examples do.
* ``Megatron rules tp=8``: the model's name rules (mesh tp=8), others replicated.
* ``fsdp x tp rules``: mesh dp=2 x tp=4, the name rules over ``tp`` plus each
  parameter's largest other axis over ``dp``.
* ``expert rules``: mesh dp=2 x ep=4 (the mesh's second axis), a mixture-of-experts
  model's stacked expert weights split along the experts by name rules, the batch over
  both axes (``jscaler bench moe``).
"""

from __future__ import annotations

import re

import jax
import numpy as np
import optax
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

BATCH = P("dp")  # every baseline splits the batch over the data axis


def path_name(keys) -> str:
    """``"blocks/0/qkv/kernel"``: a pytree path joined by ``/`` (nnx's ``value`` dropped)."""
    parts = []
    for k in keys:
        name = getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))
        if name != "value":
            parts.append(str(name))
    return "/".join(parts)


class ParamsStep:
    """A jitted training step over a params pytree with the given layouts; ``step`` and
    ``compiled`` as :class:`jscaler.Trainer`'s."""

    def __init__(self, params, loss_fn, optimizer, batch, mesh: Mesh, spec, batch_spec=BATCH):
        shard = lambda s: NamedSharding(mesh, s)  # noqa: E731
        p_shard = jax.tree_util.tree_map_with_path(
            lambda k, x: shard(spec(path_name(k), x)), params
        )
        b_shard = jax.tree_util.tree_map(lambda _: shard(batch_spec), batch)
        rep = shard(P())
        o_shard = optax.tree_map_params(
            optimizer,
            lambda _, s: s,
            jax.eval_shape(optimizer.init, params),
            p_shard,
            transform_non_params=lambda _: rep,
        )

        def step(params, opt_state, batch):
            loss, grads = jax.value_and_grad(loss_fn)(params, batch)
            updates, opt_state = optimizer.update(grads, opt_state, params)
            return optax.apply_updates(params, updates), opt_state, loss

        self.mesh = mesh
        self.shardings = p_shard
        self._fn = jax.jit(
            step,
            in_shardings=(p_shard, o_shard, b_shard),
            out_shardings=(p_shard, o_shard, rep),
            donate_argnums=(0, 1),
        )
        self._b_shard = b_shard
        self.params = jax.device_put(params, p_shard)
        self.opt_state = jax.jit(optimizer.init, out_shardings=o_shard)(self.params)

    def compiled(self, batch):
        b = jax.device_put(batch, self._b_shard)
        return self._fn.lower(self.params, self.opt_state, b).compile()

    def step(self, batch) -> dict[str, float]:
        b = jax.device_put(batch, self._b_shard)
        self.params, self.opt_state, loss = self._fn(self.params, self.opt_state, b)
        return {"loss": float(loss)}


def mesh(dp: int, tp: int) -> Mesh:
    devices = np.array(jax.devices()[: dp * tp]).reshape(dp, tp)
    return Mesh(devices, ("dp", "tp"), axis_types=(AxisType.Auto,) * 2)


def _rule(rules, path: str, x, tp: int) -> list:
    """The first matching rule's spec as a list over ``x``'s axes (``[None] * ndim`` when
    none matches, or when ``tp`` does not divide the axis it splits)."""
    for pattern, s in rules:
        if re.search(pattern, path):
            spec = list(s) + [None] * (x.ndim - len(s))
            if all(a is None or x.shape[i] % tp == 0 for i, a in enumerate(spec)):
                return spec
            break
    return [None] * x.ndim


def _shard_largest(spec: list, x, axis: str, n: int) -> P:
    """``spec`` with ``axis`` on ``x``'s largest free axis that ``n`` divides (if any)."""
    free = [i for i, a in enumerate(spec) if a is None and x.shape[i] % n == 0 and x.shape[i]]
    if free:
        spec = list(spec)
        spec[max(free, key=lambda i: x.shape[i])] = axis
    return P(*spec)


def plain_dp(params, loss_fn, optimizer, batch, n: int, rules=()) -> ParamsStep:
    return ParamsStep(params, loss_fn, optimizer, batch, mesh(n, 1), lambda path, x: P())


def plain_fsdp(params, loss_fn, optimizer, batch, n: int, rules=()) -> ParamsStep:
    return ParamsStep(
        params, loss_fn, optimizer, batch, mesh(n, 1),
        lambda path, x: _shard_largest([None] * x.ndim, x, "dp", n),
    )  # fmt: skip


def plain_tp(params, loss_fn, optimizer, batch, n: int, rules=()) -> ParamsStep:
    return ParamsStep(
        params, loss_fn, optimizer, batch, mesh(1, n), lambda path, x: P(*_rule(rules, path, x, n))
    )


def plain_fsdp_tp(params, loss_fn, optimizer, batch, n: int, rules=()) -> ParamsStep:
    dp, tp = 2, n // 2
    return ParamsStep(
        params, loss_fn, optimizer, batch, mesh(dp, tp),
        lambda path, x: _shard_largest(_rule(rules, path, x, tp), x, "dp", dp),
    )  # fmt: skip


def plain_ep(params, loss_fn, optimizer, batch, n: int, rules=(), ep: int = 4) -> ParamsStep:
    """Experts by name rules over the mesh's second axis (the expert axis, ``ep`` of the
    ``n`` devices), the batch over both axes, GSPMD propagating the rest."""
    return ParamsStep(
        params, loss_fn, optimizer, batch, mesh(n // ep, ep),
        lambda path, x: P(*_rule(rules, path, x, ep)), batch_spec=P(("dp", "tp")),
    )  # fmt: skip


BASELINES = {
    "dp": plain_dp,
    "fsdp": plain_fsdp,
    "tp": plain_tp,
    "fsdp_tp": plain_fsdp_tp,
    "ep": plain_ep,
}


def label(kind: str, n: int) -> str:
    """The table's name of baseline ``kind`` on ``n`` devices."""
    return {
        "dp": "plain dp",
        "fsdp": "plain fsdp",
        "tp": f"plain Megatron rules tp={n}",
        "fsdp_tp": f"plain fsdp x tp rules (dp=2, tp={n // 2})",
        "ep": f"plain expert rules (dp={n // 4}, ep=4)",
    }[kind]
