"""argparse types for numeric options: a value out of range is a usage error (exit 2,
the option named) at parse time, not a run that silently does something else."""

from __future__ import annotations

import argparse

__all__ = ["at_least_one", "count", "non_negative_float", "positive_int"]


def _int(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None


def positive_int(text: str) -> int:
    """An integer >= 1 (steps, devices, batch size, processes, micro-batches)."""
    n = _int(text)
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {n}")
    return n


def count(text: str) -> int:
    """An integer >= 0, where 0 means "off" (every N steps)."""
    n = _int(text)
    if n < 0:
        raise argparse.ArgumentTypeError(f"must be 0 (off) or more, got {n}")
    return n


def non_negative_float(text: str) -> float:
    """A finite float >= 0."""
    try:
        x = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not x >= 0 or x == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, got {text}")
    return x


def at_least_one(text: str) -> float:
    """A finite float >= 1 (a ratio such as a load imbalance, 1 meaning none)."""
    x = non_negative_float(text)
    if x < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1 (1: balanced), got {text}")
    return x
