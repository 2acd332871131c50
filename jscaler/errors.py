"""jscaler's exception classes.

Every error a user can cause is one of these. A message names the op and its Flax module
path where there is one, what was expected, what was found, and what to do about it.
"""

from __future__ import annotations

__all__ = [
    "AnnotationError",
    "JscalerError",
    "MaskError",
    "TraceError",
    "UnsupportedOpError",
]


class JscalerError(Exception):
    """Base class of every error jscaler raises on purpose."""


class TraceError(JscalerError):
    """The loss function could not be traced into a Graph."""


class UnsupportedOpError(TraceError):
    """An op of the traced graph has no dim annotation."""


class AnnotationError(JscalerError):
    """A dim annotation is malformed or does not fit its op's shapes."""


class MaskError(JscalerError):
    """A vTensor mask is malformed or does not fit its pTensor."""
