"""A run's metrics on disk: a JSONL file and TensorBoard event files with the same scalars.

:class:`MetricsLog` appends one JSON object per logged step to ``DIR/metrics.jsonl``
(``{"step": 10, "loss": 2.31, "lr": 0.001, ...}``; a resumed run appends to the same
file, so its steps carry on) and writes every numeric value as a TensorBoard scalar of
the same name to event files in ``DIR`` (tensorboardX: no TensorFlow needed; open them
with ``tensorboard --logdir DIR``). A list value (one number per device) becomes the
scalars ``name/0``, ``name/1``, ... :func:`read_scalars` reads event files back.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

__all__ = ["JSONL_NAME", "MetricsLog", "read_jsonl", "read_scalars"]

JSONL_NAME = "metrics.jsonl"


class MetricsLog:
    """Writes a run's metrics to ``directory``: ``metrics.jsonl`` and TensorBoard events.

    Example::

        with MetricsLog("runs/a") as log:
            log.write(1, {"loss": 2.3, "lr": 1e-3})
    """

    def __init__(self, directory: str | Path):
        from tensorboardX import SummaryWriter

        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.path = self.directory / JSONL_NAME
        self._jsonl = open(self.path, "a")  # noqa: SIM115  closed by close()
        self._tb = SummaryWriter(str(self.directory), flush_secs=10)

    def write(self, step: int, values: dict) -> None:
        """One JSONL line ``{"step": step, **values}`` and a TensorBoard scalar for each
        number (None values are left out of both)."""
        values = {k: v for k, v in values.items() if v is not None}
        self._jsonl.write(json.dumps({"step": step, **values}) + "\n")
        self._jsonl.flush()
        for name, value in values.items():
            items = enumerate(value) if isinstance(value, list | tuple) else [(None, value)]
            for i, x in items:
                if isinstance(x, int | float) and not isinstance(x, bool):
                    tag = name if i is None else f"{name}/{i}"
                    self._tb.add_scalar(tag, float(x), step)

    def close(self) -> None:
        """Flushes and closes both files."""
        self._jsonl.close()
        self._tb.close()

    def __enter__(self) -> MetricsLog:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def read_jsonl(directory: str | Path) -> list[dict]:
    """The records of ``directory``'s ``metrics.jsonl``, in order."""
    text = (Path(directory) / JSONL_NAME).read_text()
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def _records(path: Path):
    """The payloads of a TFRecord file: each is a little-endian u64 length, its masked
    CRC32C (u32), the bytes, and their masked CRC32C (not checked here)."""
    data = path.read_bytes()
    at = 0
    while at + 12 <= len(data):
        (length,) = struct.unpack_from("<Q", data, at)
        start = at + 12
        yield data[start : start + length]
        at = start + length + 4


def read_scalars(directory: str | Path) -> dict[str, list[tuple[int, float]]]:
    """``{tag: [(step, value), ...]}`` from every TensorBoard event file in ``directory``
    (oldest file first), read with tensorboardX's protobuf classes alone."""
    from tensorboardX.proto.event_pb2 import Event

    found: dict[str, list[tuple[int, float]]] = {}
    for path in sorted(Path(directory).glob("events.out.tfevents.*")):
        for payload in _records(path):
            event = Event.FromString(payload)
            for v in event.summary.value:
                if v.HasField("simple_value"):
                    value = v.simple_value
                    found.setdefault(v.tag, []).append((int(event.step), value))
    return found
