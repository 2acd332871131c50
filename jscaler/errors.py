"""jscaler's exception classes.

Every error a user can cause is one of these. A message names the op and its Flax module
path where there is one, what was expected, what was found, and what to do about it.
"""

from __future__ import annotations

__all__ = [
    "AnnotationError",
    "AssignmentError",
    "CheckpointError",
    "ConfigError",
    "CoverageError",
    "CycleError",
    "DataError",
    "DistributedError",
    "JscalerError",
    "LayoutError",
    "MaskError",
    "NonFiniteLossError",
    "OutOfMemoryError",
    "PlanError",
    "ScheduleError",
    "SplitError",
    "TraceError",
    "UnsupportedOpError",
]


class JscalerError(Exception):
    """Base class of every error jscaler raises on purpose."""


class CheckpointError(JscalerError):
    """A checkpoint is missing, damaged, or does not fit the trainer restoring it."""


class ConfigError(JscalerError):
    """A config file cannot be read, names an option that does not exist, or gives one a
    value of the wrong type."""


class DataError(JscalerError):
    """A data file (``jscaler train --data``) is missing, has the wrong format, is too
    short for one window, or holds token ids the model cannot take."""


class TraceError(JscalerError):
    """The loss function could not be traced into a Graph."""


class UnsupportedOpError(TraceError):
    """An op of the traced graph has no dim annotation."""


class AnnotationError(JscalerError):
    """A dim annotation is malformed or does not fit its op's shapes."""


class MaskError(JscalerError):
    """A vTensor mask is malformed or does not fit its pTensor."""


class PlanError(JscalerError):
    """A plan is malformed, inconsistent with its graph, or cannot run as asked."""


class ScheduleError(PlanError):
    """A pipeline schedule misses or repeats a block, misplaces one, or deadlocks."""


class SplitError(PlanError):
    """An op_trans split names a dim that cannot be split, or does not divide it."""


class AssignmentError(PlanError):
    """A sub-op is unassigned, or assigned to a device that does not exist."""


class CycleError(PlanError):
    """Data dependencies and op_order constraints form a cycle."""


class CoverageError(PlanError):
    """Some piece of a consumed tensor is produced on no device."""


class LayoutError(PlanError):
    """The pieces of a tensor cannot be laid out on the plan's device mesh."""


class DistributedError(JscalerError):
    """The processes of a multi-process run disagree (on the plan), or one is gone."""


class OutOfMemoryError(PlanError):
    """The cost model predicts the plan needs more memory per device than the devices have."""


class NonFiniteLossError(JscalerError):
    """A training step produced a NaN or infinite loss or gradient; the step was not
    applied (parameters and optimizer state are the last good ones)."""

    def __init__(self, message: str, step: int):
        super().__init__(message)
        self.step = step
