"""Moving gradients from the stages to the optimizer's mesh, and parameters back.

The optimizer runs once per step over the whole tree on a mesh of every pipeline device,
with master parameters and optimizer state split over all of them (ZeRO-1 across the
pipeline). Two ways to get there:

* :class:`DevicePut` (one process): each stage's gradient is ``jax.device_put`` onto the
  update mesh, and each new parameter back onto the stages that read it. Works for any
  groups, overlapping (interlaced) or of different plans.
* :class:`Stacked` (several processes, where ``device_put`` cannot move an array between
  device sets): the update mesh is the groups' meshes stacked along a ``pipe`` axis. A
  gradient enters as one array of shape ``(groups, *shape)`` assembled from the shards the
  groups already hold (zeros on groups that do not read the parameter); the update program
  sums it over ``pipe`` (the collective between groups), and hands every group the new
  parameter the same way back. Needs groups of one mesh shape (e.g. ``megatron(pp=...)``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from jscaler.errors import PlanError

__all__ = ["DevicePut", "Stacked", "handoff_for"]


def handoff_for(stages, devices, pplan, param_ids, shapes, stacked: bool):
    cls = Stacked if stacked else DevicePut
    return cls(stages, devices, pplan, param_ids, shapes)


class DevicePut:
    """One process: device_put between the stages' meshes and a 1-D mesh of all devices."""

    def __init__(self, stages, devices, pplan, param_ids, shapes):
        self.stages = stages
        self.param_ids = param_ids
        self.shapes = dict(zip(param_ids, shapes))
        self.users = {t: [st for st in stages if t in st.params] for t in param_ids}
        self.mesh = self._mesh(stages, devices, pplan)
        self.rep = NamedSharding(self.mesh, PartitionSpec())
        n, axes = self.mesh.size, self.mesh.axis_names
        self.master = [NamedSharding(self.mesh, zero_spec(s, n, axes)) for s in shapes]

    def _mesh(self, stages, devices, pplan) -> Mesh:
        devs = [devices[d] for d in pplan.devices]
        return Mesh(np.array(devs), ("pipe",), axis_types=(AxisType.Auto,))

    def gradients(self, grads) -> list:
        """Per parameter, the parts to sum (one per stage reading it), on the update mesh."""
        return [
            [jax.device_put(grads[st.index][st.params.index(t)], sh) for st in self.users[t]]
            for t, sh in zip(self.param_ids, self.master)
        ]

    @staticmethod
    def reduce(parts):
        return sum(parts[1:], parts[0])

    def broadcast(self, new) -> list:
        return []

    def stage_params(self, master, _extra) -> list[list]:
        by_id = dict(zip(self.param_ids, master))
        return [[jax.device_put(by_id[t], st.sharding(t)) for t in st.params] for st in self.stages]

    def scalar(self, x) -> float:
        return float(x)

    def gathered(self, parts) -> np.ndarray:
        return sum(np.asarray(jax.device_get(p)) for p in parts)


class Stacked(DevicePut):
    """Several processes: the groups' meshes stacked along ``pipe``; arrays assembled from
    the shards each group holds, so no array changes device set outside a program."""

    def __init__(self, stages, devices, pplan, param_ids, shapes):
        super().__init__(stages, devices, pplan, param_ids, shapes)
        # the layout each parameter has on its groups (one plan per group shape)
        self.spec = {t: self.users[t][0].sharding(t).spec for t in param_ids}

    def _mesh(self, stages, devices, pplan) -> Mesh:
        if pplan.whole:
            raise PlanError(
                f"pipeline {pplan.name!r}: an all-device group cannot hand its arrays to the "
                f"other groups across processes; run the interlaced plan in one process"
            )
        meshes = [
            next(st.low.mesh for st in stages if st.group == g) for g in range(len(pplan.groups))
        ]
        first = meshes[0]
        for g, m in enumerate(meshes):
            if m.axis_names != first.axis_names or m.devices.shape != first.devices.shape:
                raise PlanError(
                    f"pipeline {pplan.name!r}: group {g} has mesh {dict(m.shape)}, group 0 "
                    f"{dict(first.shape)}; across processes every group needs one mesh shape"
                )
        self.groups = meshes
        names = ("pipe", *first.axis_names)
        stacked = np.stack([m.devices for m in meshes])
        return Mesh(stacked, names, axis_types=(AxisType.Auto,) * len(names))

    def _stacked_sharding(self, spec) -> NamedSharding:
        return NamedSharding(self.mesh, PartitionSpec("pipe", *spec))

    def _assemble(self, shape, spec, per_group: dict, dtype) -> jax.Array:
        """A (groups, *shape) array from each group's array (zeros where absent)."""
        sharding = self._stacked_sharding(spec)
        local = []
        for g, mesh in enumerate(self.groups):
            value = per_group.get(g)
            held = {} if value is None else {s.device: s.data for s in value.addressable_shards}
            inner = NamedSharding(mesh, PartitionSpec(*spec))
            for d in mesh.devices.flat:
                if d.process_index != jax.process_index():
                    continue
                if value is None:
                    piece = jnp.zeros((1, *inner.shard_shape(shape)), dtype, device=d)
                else:
                    piece = held[d][None]
                local.append(piece)
        return jax.make_array_from_single_device_arrays(
            (len(self.groups), *shape), sharding, local, dtype=dtype
        )

    def gradients(self, grads) -> list:
        out = []
        for t in self.param_ids:
            per_group: dict = {}
            for st in self.users[t]:
                # the parameter's own layout, on the group's mesh (same devices: no transfer)
                g = jax.device_put(grads[st.index][st.params.index(t)], st.sharding(t))
                per_group[st.group] = g if st.group not in per_group else per_group[st.group] + g
            some = next(iter(per_group.values()))
            out.append([self._assemble(self.shapes[t], self.spec[t], per_group, some.dtype)])
        return out

    @staticmethod
    def reduce(parts):
        return parts[0].sum(0)

    def broadcast(self, new) -> list:
        """Inside the update: every new parameter stacked once per group."""
        n = len(self.groups)
        return [
            jax.lax.with_sharding_constraint(
                jnp.broadcast_to(p[None], (n, *p.shape)), self._stacked_sharding(self.spec[t])
            )
            for t, p in zip(self.param_ids, new)
        ]

    def stage_params(self, master, stacked) -> list[list]:
        by_id = dict(zip(self.param_ids, stacked))
        out = []
        for st in self.stages:
            row = []
            for t in st.params:
                sh = st.sharding(t)
                mine = {d for d in sh.device_set if d.process_index == jax.process_index()}
                shards = [s.data[0] for s in by_id[t].addressable_shards if s.device in mine]
                row.append(
                    jax.make_array_from_single_device_arrays(
                        self.shapes[t], sh, shards, dtype=by_id[t].dtype
                    )
                )
            out.append(row)
        return out

    def scalar(self, x) -> float:
        """A scalar held by one group, read in every process."""
        g = next(
            k for k, m in enumerate(self.groups) if set(m.devices.flat) == x.sharding.device_set
        )
        arr = self._assemble((), (), {g: x}, x.dtype)
        total = _sum0(arr, self.rep)
        return float(np.asarray(total.addressable_data(0)))

    def gathered(self, parts) -> np.ndarray:
        return np.asarray(multihost_utils.process_allgather(parts[0].sum(0), tiled=True))


def _sum0(x, sharding):
    return jax.jit(lambda a: a.sum(0), out_shardings=sharding)(x)


def zero_spec(shape, n: int, axes) -> PartitionSpec:
    """Split the first axis divisible by n over ``axes`` (every device), else replicate."""
    for k, s in enumerate(shape):
        if s % n == 0:
            return PartitionSpec(*([None] * k), tuple(axes) if len(axes) > 1 else axes[0])
    return PartitionSpec()
