"""MeshSpec: the logical device mesh a plan lays tensors out on.

Devices are numbered 0..N-1: device i is the i-th of the devices the plan runs on (the
``devices`` given to ``parallelize``). The mesh arranges them row-major over named axes.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

from jscaler.errors import PlanError

__all__ = ["MeshSpec"]


@dataclass(frozen=True)
class MeshSpec:
    """Named mesh axes over device ids.

    Attributes:
      axes: ``((name, size), ...)``, major to minor.
      devices: device ids in row-major mesh order (a permutation of 0..N-1).

    Example::

        mesh = MeshSpec.create(dp=2, tp=4)     # devices 0..7; tp is the minor axis
        mesh.device_at({"dp": 1, "tp": 2})     # 6
    """

    axes: tuple[tuple[str, int], ...]
    devices: tuple[int, ...]

    def __post_init__(self):
        object.__setattr__(self, "axes", tuple((str(n), int(s)) for n, s in self.axes))
        object.__setattr__(self, "devices", tuple(int(d) for d in self.devices))
        names = [n for n, _ in self.axes]
        if len(set(names)) != len(names):
            raise PlanError(f"mesh axis names must be unique, got {names}")
        if any(s < 1 for _, s in self.axes):
            raise PlanError(f"mesh axis sizes must be >= 1, got {dict(self.axes)}")
        if math.prod(s for _, s in self.axes) != len(self.devices):
            raise PlanError(
                f"mesh {dict(self.axes)} holds {math.prod(s for _, s in self.axes)} devices "
                f"but {len(self.devices)} device ids were given"
            )
        if sorted(self.devices) != list(range(len(self.devices))):
            raise PlanError(f"mesh devices must be a permutation of 0..{len(self.devices) - 1}")

    @classmethod
    def create(cls, **axes: int) -> MeshSpec:
        n = math.prod(axes.values())
        return cls(tuple(axes.items()), tuple(range(n)))

    @property
    def size(self) -> int:
        return len(self.devices)

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(n for n, _ in self.axes)

    @property
    def shape(self) -> dict[str, int]:
        return dict(self.axes)

    def coords(self, device: int) -> dict[str, int]:
        """Mesh coordinates of a device id."""
        flat = self.devices.index(device)
        out = {}
        for name, size in reversed(self.axes):
            out[name] = flat % size
            flat //= size
        return {n: out[n] for n in self.names}

    def device_at(self, coords: dict[str, int]) -> int:
        flat = 0
        for name, size in self.axes:
            flat = flat * size + coords.get(name, 0)
        return self.devices[flat]

    def group(self, **fixed: int) -> tuple[int, ...]:
        """Devices whose coordinates match ``fixed`` (e.g. ``group(dp=1)``: one dp row)."""
        return _group(self, tuple(sorted(fixed.items())))

    def to_json(self) -> dict:
        return {"axes": [list(a) for a in self.axes], "devices": list(self.devices)}

    @classmethod
    def from_json(cls, d: dict) -> MeshSpec:
        return cls(tuple(tuple(a) for a in d["axes"]), tuple(d["devices"]))

    def __str__(self):
        return " x ".join(f"{n}={s}" for n, s in self.axes)


@functools.lru_cache(maxsize=1 << 12)
def _group(mesh: MeshSpec, fixed: tuple[tuple[str, int], ...]) -> tuple[int, ...]:
    """:meth:`MeshSpec.group`, cached: the cost model asks for the same groups per op."""
    return tuple(d for d in mesh.devices if all(mesh.coords(d)[k] == v for k, v in fixed))
