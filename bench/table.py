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


def mb(x) -> str:
    """Bytes as MB with one decimal; ``-`` for none."""
    return "-" if x is None else f"{x / 1e6:.1f}"


def times(r) -> str:
    """A ratio as ``1.23x``; ``-`` for none."""
    return "-" if r is None else f"{r:.2f}x"


def percent(r, digits: int = 1) -> str:
    """A relative error as ``+1.2%``; ``-`` for none."""
    return "-" if r is None else f"{r:+.{digits}%}"
