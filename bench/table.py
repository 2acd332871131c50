"""Plain-text tables for the benchmarks' output."""

from __future__ import annotations


def columns(cols: list[str], data: list[list[str]], left: int = 1) -> list[str]:
    """Aligned rows under a header and a rule: the first ``left`` columns flush left, the
    rest flush right."""
    widths = [max(len(x) for x in col) for col in zip(cols, *data)]

    def fmt(row):
        return "  ".join(
            c.ljust(w) if i < left else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths))
        )

    lines = [fmt(cols)]
    lines.append("-" * len(lines[-1]))
    lines.extend(fmt(d) for d in data)
    return lines
