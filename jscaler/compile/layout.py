"""From pieces on devices to layouts on a mesh: which mesh axes shard which tensor axis.

A tensor's layout in a plan is the map device -> piece (vTensor mask). On a mesh, the
same information is a PartitionSpec (mesh axes per tensor axis) plus the mesh axes over
which the pieces are partial sums. :func:`layout_of` finds that form or says why there is
none, and checks it by recomputing every device's piece from it.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

from jax.sharding import PartitionSpec

from jscaler.errors import LayoutError
from jscaler.ir.vtensor import Mask
from jscaler.plan.mesh import MeshSpec

__all__ = ["Layout", "layout_of", "reduced_layout", "replicated", "spread_layout"]


@dataclass(frozen=True)
class Layout:
    """Per tensor axis, the mesh axes sharding it (major first); and the partial axes."""

    spec: tuple[tuple[str, ...], ...]
    partial: tuple[str, ...] = ()

    def pspec(self) -> PartitionSpec:
        """The PartitionSpec of the spatial part (partial axes are not in it)."""
        parts = [None if not a else a[0] if len(a) == 1 else a for a in self.spec]
        while parts and parts[-1] is None:
            parts.pop()
        return PartitionSpec(*parts)

    @property
    def reduced(self) -> Layout:
        """This layout once its partial sums are added up (itself when it has none)."""
        return Layout(self.spec) if self.partial else self

    def local_bytes(self, shape, itemsize: int, sizes: dict[str, int]) -> int:
        """Bytes of one device's piece of a tensor of ``shape`` under this layout."""
        parts = math.prod(sizes[a] for axes in self.spec for a in axes)
        return math.prod(shape) * itemsize // parts

    def axes_used(self) -> frozenset[str]:
        return self._axes_used

    @functools.cached_property
    def _axes_used(self) -> frozenset[str]:  # asked of every layout, often: once each
        return frozenset(a for axes in self.spec for a in axes) | frozenset(self.partial)

    def __str__(self):
        s = str(self.pspec())
        return s + (f" partial{list(self.partial)}" if self.partial else "")


def replicated(rank: int) -> Layout:
    return Layout(((),) * rank)


def reduced_layout(produced: Layout, want: Layout | None) -> Layout:
    """The layout a partial result leaves a shard_map region with once reduced: ``want``
    (the layout its consumers agree on) when that only splits one more dim over exactly
    the partial axes (a reduce-scatter), else the reduced layout (an all-reduce)."""
    reduced = produced.reduced
    if want is not None and want != reduced:
        diff = [a for a in range(len(reduced.spec)) if want.spec[a] != reduced.spec[a]]
        if len(diff) == 1 and want.spec[diff[0]] == reduced.spec[diff[0]] + produced.partial:
            return want
    return reduced


def spread_layout(layout: Layout, shape, axes: tuple[tuple[str, int], ...]) -> Layout:
    """``layout`` split further over every mesh axis of ``axes`` (name, size) it does not
    use, each on the first tensor axis that still divides: where a pipeline stage keeps
    its running gradient sum (each micro-batch's gradient reduce-scattered into it, or
    sliced where it is already whole on every device)."""
    spec = [list(a) for a in layout.spec]
    used = layout.axes_used()
    sizes = dict(axes)
    for name, size in axes:
        if name in used or size == 1:
            continue
        for k, n in enumerate(shape):
            parts = math.prod(sizes[a] for a in spec[k]) * size
            if n % parts == 0:
                spec[k].append(name)
                break
    return Layout(tuple(tuple(a) for a in spec))


def layout_of(mesh: MeshSpec, shape: tuple[int, ...], masks: dict[int, Mask], what: str) -> Layout:
    """The layout whose pieces on each mesh device are ``masks[device]``.

    Raises:
      LayoutError: a device has no piece, or the pieces are arranged in a way no
        PartitionSpec on ``mesh`` expresses (e.g. a permuted assignment).
    """
    missing = [d for d in mesh.devices if d not in masks]
    if missing:
        raise LayoutError(
            f"{what} has no piece on devices {missing}: in one SPMD program every device "
            f"of the mesh ({mesh}) runs every op. Assign a piece (or a replica) to each."
        )
    origin = mesh.device_at({})
    m0 = masks[origin]
    per_dim: dict[int, list[tuple[int, str]]] = {}
    partial: list[tuple[float, str]] = []
    for name, size in mesh.axes:
        if size == 1:
            continue
        m1 = masks[mesh.device_at({name: 1})]
        moved = [a for a in range(len(shape)) if m1.slices[a] != m0.slices[a]]
        value_moved = m1.value != m0.value
        if not moved and not value_moved:
            continue
        if len(moved) == 1 and not value_moved:
            a = moved[0]
            per_dim.setdefault(a, []).append((m1.slices[a][0] - m0.slices[a][0], name))
        elif not moved and value_moved:
            partial.append((float(m1.value[0] - m0.value[0]), name))
        else:
            raise LayoutError(_unexpressible(what, mesh, masks))
    spec = tuple(
        tuple(n for _, n in sorted(per_dim.get(a, []), key=lambda x: -x[0]))
        for a in range(len(shape))
    )
    layout = Layout(spec, tuple(n for _, n in sorted(partial, key=lambda x: -x[0])))
    for d in mesh.devices:
        if expected_mask(mesh, shape, layout, d) != masks[d]:
            raise LayoutError(_unexpressible(what, mesh, masks))
    return layout


def expected_mask(mesh: MeshSpec, shape, layout: Layout, device: int) -> Mask:
    """The piece a device holds under a layout."""
    return _expected_mask(mesh, tuple(shape), layout, device)


@functools.lru_cache(maxsize=1 << 16)
def _expected_mask(mesh: MeshSpec, shape, layout: Layout, device: int) -> Mask:
    coords = mesh.coords(device)
    sizes = mesh.shape
    m = Mask.full(shape)
    for a, axes in enumerate(layout.spec):
        if axes:
            n = math.prod(sizes[x] for x in axes)
            i = 0
            for x in axes:
                i = i * sizes[x] + coords[x]
            m = m.split(a, n, i)
    if layout.partial:
        n = math.prod(sizes[x] for x in layout.partial)
        i = 0
        for x in layout.partial:
            i = i * sizes[x] + coords[x]
        m = m.split_value(n, i)
    return m


def _unexpressible(what: str, mesh: MeshSpec, masks: dict[int, Mask]) -> str:
    shown = ", ".join(f"{d}: {masks[d]}" for d in list(mesh.devices)[:8])
    return (
        f"{what}: its pieces ({shown}{', ...' if mesh.size > 8 else ''}) are placed in an "
        f"order no layout on mesh {mesh} expresses. Assign piece i of a split to the i-th "
        f"device along one mesh axis (or choose a mesh whose device order matches)."
    )
