"""The check every space makes of its integer knobs."""

from __future__ import annotations

import jscaler


def check_int(space: str, name: str, value, least: int = 1, why: str = "") -> None:
    """Raises a PlanError unless ``value`` is an int (not a bool) of at least ``least``;
    ``why`` follows the bound in the message (``" (a pipeline)"``)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        bound = "a positive int" if least == 1 and not why else f"an int >= {least}{why}"
        raise jscaler.PlanError(f"{space}: {name} must be {bound}, got {value!r}")
