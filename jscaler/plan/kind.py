"""What every plan kind declares: the interface a :class:`Plan` (one SPMD program) and a
:class:`PipelinePlan` (stages on device groups) share, so the runtime asks a plan what it
is instead of testing its class, and branches on it in one place
(:mod:`jscaler.runtime.builder`)."""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from jscaler.ir.graph import Graph

__all__ = ["AnyPlan"]


@runtime_checkable
class AnyPlan(Protocol):
    """A plan of either kind.

    Attributes:
      name: the plan's name (for tables and messages).
      is_pipeline: True for a plan whose stages run as separate programs.
    """

    name: str
    is_pipeline: bool

    @property
    def graph(self) -> Graph:
        """The traced graph the plan was made for."""
        ...

    @property
    def spmd_plans(self) -> tuple:
        """The SPMD plans it runs: the plan itself, or each pipeline group's plan once."""
        ...

    def describe(self) -> dict:
        """A JSON-able description of everything a process will run (the plan's JSON, for a
        pipeline every group's devices and plan): hashed to check processes agree."""
        ...
