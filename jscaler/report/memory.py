"""A plan's predicted memory per device as a stacked bar chart, SIMULATED by the cost model.

One bar per device, one segment per part of :attr:`jscaler.Estimate.memory` (parameters,
optimizer state, batch, gradients, activations); a mark at the predicted peak, which is
lower than the sum when gradients and activations are not all alive at once
(:func:`jscaler.cost.memory.memory_breakdown`); and the device's capacity when the chart
can show it beside the bars.
"""

from __future__ import annotations

from matplotlib.figure import Figure

from jscaler.cost.estimate import Estimate

__all__ = ["PARTS", "device_memory", "write_memory_breakdown"]

# drawn bottom to top: what is held all step, then what the step's phases hold
PARTS = ("params", "optimizer", "batch", "grads", "activations")
COLORS = {
    "params": "#4c72b0",
    "optimizer": "#55a868",
    "batch": "#8172b3",
    "grads": "#dd8452",
    "activations": "#c44e52",
}


def device_memory(est: Estimate, devices) -> dict[int, dict]:
    """Each device's memory dict (bytes): a pipeline's from its estimate, an SPMD plan's
    ``est.memory`` on every one of ``devices`` (its devices hold the same)."""
    if est.device_memory:
        return {int(d): m for d, m in est.device_memory.items()}
    return {int(d): est.memory for d in devices}


def unit_of(nbytes: float) -> tuple[str, float]:
    """The binary unit that shows ``nbytes`` as a number from 1 to 1024: (name, bytes)."""
    for name, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if nbytes >= size:
            return name, size
    return "bytes", 1


def write_memory_breakdown(
    per_device: dict[int, dict],
    path,
    title: str,
    capacity: float | None = None,
    labels: dict[int, str] | None = None,
) -> None:
    """Draws ``per_device`` (device -> memory dict, bytes) as stacked bars to the PNG
    ``path``; ``capacity`` (bytes per device) is drawn as a line when it is within 3x of
    the tallest bar, else named in the legend as off the scale; ``labels``: each bar's
    name (default ``dev N``)."""
    devices = sorted(per_device)
    tallest = max(sum(m.get(p, 0.0) for p in PARTS) for m in per_device.values())
    unit, size = unit_of(max(tallest, 1.0))
    fig = Figure(figsize=(max(5.0, 1.0 + 0.7 * len(devices)), 4.2))
    ax = fig.add_subplot()
    x = range(len(devices))
    bottom = [0.0] * len(devices)
    for part in PARTS:
        values = [per_device[d].get(part, 0.0) / size for d in devices]
        if not any(values):
            continue
        ax.bar(x, values, 0.7, bottom=bottom, color=COLORS[part], label=part)
        bottom = [b + v for b, v in zip(bottom, values)]
    peaks = [per_device[d]["total"] / size for d in devices]
    ax.scatter(x, peaks, marker="_", s=900, linewidths=2.5, color="black", zorder=3)
    ax.scatter([], [], marker="_", s=100, color="black", label="predicted peak")
    if capacity:
        if capacity <= 3 * tallest:
            ax.axhline(capacity / size, color="black", linestyle="--", linewidth=1)
            ax.plot([], [], color="black", linestyle="--", label="device capacity")
        else:
            cap_unit, cap_size = unit_of(capacity)
            ax.plot([], [], " ", label=f"capacity {capacity / cap_size:.0f} {cap_unit} (off scale)")
    ax.set_xticks(list(x))
    labels = labels or {}
    ax.set_xticklabels([labels.get(d, f"dev {d}") for d in devices], fontsize=8)
    ax.set_ylabel(f"{unit} per device")
    ax.set_title(title, fontsize=9)
    handles, labels = ax.get_legend_handles_labels()
    ax.legend(handles[::-1], labels[::-1], fontsize=7, loc="upper left", bbox_to_anchor=(1, 1))
    ax.set_ylim(0, max(tallest / size, *peaks) * 1.08)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
