"""Hugging Face safetensors checkpoints: read into a plan's shardings, written back.

A Hugging Face checkpoint folder holds ``model.safetensors`` (or several files and a
``model.safetensors.index.json``) and ``config.json``. Its tensors are named in one of two
ways, told apart by the file's metadata ``format``:

* ``"pt"`` (what the Hub holds): PyTorch's names and layouts. A Flax parameter at path
  ``transformer/h/0/mlp/c_fc/kernel`` is ``transformer.h.0.mlp.c_fc.weight``, transposed;
  a LayerNorm's ``scale`` and an embedding's ``embedding`` are ``weight``; a conv kernel
  ``(kh, kw, in, out)`` is ``(out, in, kh, kw)``. This is the convention of
  ``transformers``' own PyTorch <-> Flax conversion, which reads what :func:`write` writes.
* ``"flax"`` (``FlaxPreTrainedModel.save_pretrained(safe_serialization=True)``): the Flax
  paths joined by dots, as they are.

:func:`read` builds each parameter straight into its sharding: each addressable device
gets the slice its sharding gives it, read lazily from the file's memory map, so no
device, and no process, holds more of a tensor than it keeps. :func:`write` writes a
parameter dict in the ``"pt"`` convention.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import jax
import numpy as np
from jax.sharding import Sharding

from jscaler.errors import CheckpointError

__all__ = ["LoadReport", "hf_name", "read", "weight_files", "write"]

WEIGHTS = "model.safetensors"
INDEX = "model.safetensors.index.json"
_RENAMED = {"kernel": "weight", "scale": "weight", "embedding": "weight"}


def hf_name(path: str, ndim: int) -> tuple[str, tuple[int, ...] | None]:
    """The PyTorch-convention name of the parameter at Flax ``path`` (``"a/b/kernel"``)
    and the axis permutation ``perm`` with ``flax = torch.transpose(perm)`` (None: the
    same layout).

    >>> hf_name("transformer/h/0/mlp/c_fc/kernel", 2)
    ('transformer.h.0.mlp.c_fc.weight', (1, 0))
    """
    *head, leaf = path.split("/")
    perm = None
    if leaf == "kernel":
        perm = (2, 3, 1, 0) if ndim == 4 else tuple(reversed(range(ndim)))
    return ".".join([*head, _RENAMED.get(leaf, leaf)]), perm


@dataclass
class LoadReport:
    """What :func:`read` read: the files, their naming convention, the tensors used,
    the file's tensors no parameter took, and the bytes each device was given (its own
    slices only: a device holding half a tensor got half its bytes)."""

    files: list[Path]
    format: str
    tensors: int = 0
    unused: list[str] = field(default_factory=list)
    bytes_per_device: dict = field(default_factory=dict)


def weight_files(directory: str | os.PathLike) -> list[Path]:
    """The safetensors files of a Hugging Face checkpoint folder (one, or the shards its
    index names), or the file itself when ``directory`` is a ``.safetensors`` file.

    Raises:
      CheckpointError: no such folder, or no ``model.safetensors`` (nor index) in it.
    """
    path = Path(directory)
    if path.is_file() and path.suffix == ".safetensors":
        return [path]
    if (path / INDEX).is_file():
        weight_map = json.loads((path / INDEX).read_text())["weight_map"]
        return [path / f for f in sorted(set(weight_map.values()))]
    if (path / WEIGHTS).is_file():
        return [path / WEIGHTS]
    found = sorted(p.name for p in path.iterdir())[:8] if path.is_dir() else None
    raise CheckpointError(
        f"{directory}: expected a Hugging Face checkpoint folder holding {WEIGHTS} (or "
        f"{INDEX} and its shards), found "
        f"{'no such folder' if found is None else found or 'an empty folder'}; save one "
        f"with save_pretrained(DIR, safe_serialization=True) or `jscaler export`"
    )


def read(
    directory: str | os.PathLike,
    names: Sequence[str],
    like: Sequence[jax.ShapeDtypeStruct],
    shardings: Sequence[Sharding],
) -> tuple[list[jax.Array], LoadReport]:
    """The parameters ``names`` (Flax paths ``"a/b/kernel"``) from the Hugging Face
    checkpoint in ``directory``, each made on its sharding from the slices its devices
    hold, cast to the dtype of its entry in ``like``.

    A name is looked up as it is (PyTorch convention, or Flax for a ``"flax"`` file); a
    head model's parameters are also found in a checkpoint of its base model (without the
    first path component) and the other way round, as ``transformers`` does.

    Raises:
      CheckpointError: a parameter is missing from the checkpoint, or its shape there
        differs from the model's.
    """
    from safetensors import safe_open

    files = weight_files(directory)
    with contextlib.ExitStack() as stack:
        handles = [stack.enter_context(safe_open(str(f), framework="numpy")) for f in files]
        fmt = (handles[0].metadata() or {}).get("format", "pt")
        where = {key: h for h in handles for key in h.keys()}
        report = LoadReport(files, fmt)
        arrays, used = [], set()
        for name, want, sharding in zip(names, like, shardings, strict=True):
            key, perm = _find(name, len(want.shape), fmt, where, directory)
            what = f"{directory}: parameter {name!r} ({key!r}"
            arrays.append(_place(where[key].get_slice(key), perm, want, sharding, report, what))
            used.add(key)
    report.tensors = len(used)
    report.unused = sorted(set(where) - used)
    return arrays, report


def _place(tensor, perm, want, sharding, report: LoadReport, what: str) -> jax.Array:
    """The parameter ``want`` made on ``sharding`` from ``tensor`` (a lazy safetensors
    slice in the file's layout, ``perm`` from it to the parameter's), each addressable
    device given the slice it keeps; ``what`` names it for errors."""
    shape = tuple(tensor.get_shape())
    mapped = shape if perm is None else tuple(shape[i] for i in perm)
    if mapped != tuple(want.shape):
        how = "" if perm is None else f", {list(shape)} transposed by {perm}"
        raise CheckpointError(
            f"{what}{how}) is {list(mapped)} in the checkpoint and "
            f"{list(want.shape)} in the model; build the model from the checkpoint's "
            f"config.json"
        )
    read_slice = _slicer(tensor, perm, np.dtype(want.dtype))
    pieces = []
    for device, index in sharding.addressable_devices_indices_map(want.shape).items():
        piece = read_slice(index)
        report.bytes_per_device[device] = report.bytes_per_device.get(device, 0) + piece.nbytes
        pieces.append(jax.device_put(piece, device))
    return jax.make_array_from_single_device_arrays(want.shape, sharding, pieces)


def _find(name, ndim, fmt, where, directory) -> tuple[str, tuple[int, ...] | None]:
    """The checkpoint's key for parameter ``name`` and its axis permutation."""
    key, perm = (name.replace("/", "."), None) if fmt == "flax" else hf_name(name, ndim)
    head, _, rest = key.partition(".")
    prefixes = sorted({k.partition(".")[0] for k in where})
    for candidate in [key, rest, *(f"{p}.{key}" for p in prefixes)]:
        if candidate in where:
            return candidate, perm
    stem = key.rpartition(".")[0]
    near = sorted(k for k in where if k.startswith(stem.rpartition(".")[0]))[:4]
    raise CheckpointError(
        f"{directory}: parameter {name!r} is not in the checkpoint: expected the tensor "
        f"{key!r} ({fmt} names; with or without the prefix {head!r}); found "
        f"{near or sorted(where)[:4]}. Build the model that saved the checkpoint, from its "
        f"config.json"
    )


def _slicer(tensor, perm, dtype: np.dtype) -> Callable:
    """``index -> array``: the slice of ``tensor`` (a lazy safetensors slice) at a
    parameter's ``index``, read in the file's layout, permuted to the parameter's and
    cast to ``dtype``; each distinct slice is read from the file once."""
    cache: dict = {}

    def read_slice(index):
        index = tuple(index)
        key = tuple((s.start, s.stop, s.step) for s in index)
        if key not in cache:
            if perm is None:
                piece = tensor[index] if index else tensor[:]
            else:
                inverse = [None] * len(perm)
                for flax_axis, torch_axis in enumerate(perm):
                    inverse[torch_axis] = index[flax_axis]
                piece = np.transpose(tensor[tuple(inverse)], perm)
            cache[key] = np.asarray(piece, dtype=dtype)
        return cache[key]

    return read_slice


def write(
    path: str | os.PathLike, params: dict[str, np.ndarray], config: str | os.PathLike | None
) -> Path:
    """Writes ``params`` (Flax path -> host array) to ``path/model.safetensors`` in the
    PyTorch convention (metadata ``format: pt``), which ``transformers`` loads in its
    PyTorch classes and, through its conversion, in its Flax ones; with ``config`` (a
    ``config.json`` or a folder holding one), copies it beside the weights so
    ``from_pretrained(path)`` builds the model. Written to a temporary name and renamed:
    a failed export leaves no partial file. Returns the weights' path."""
    from safetensors.numpy import save_file

    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for flax_path, value in params.items():
        value = np.asarray(value)
        key, perm = hf_name(flax_path, value.ndim)
        if key in tensors:
            raise CheckpointError(
                f"parameters {flax_path!r} and another both map to the tensor {key!r}; "
                f"rename one of them"
            )
        inverse = None if perm is None else tuple(np.argsort(perm))
        tensors[key] = np.ascontiguousarray(value if inverse is None else value.transpose(inverse))
    if config is not None:
        source = Path(config)
        source = source / "config.json" if source.is_dir() else source
        if not source.is_file():
            raise CheckpointError(
                f"--hf-config {config}: no config.json there; name the config.json of the "
                f"model (the --init-from folder holds one)"
            )
        (out / "config.json").write_text(source.read_text())
    target = out / WEIGHTS
    tmp = out / f".{WEIGHTS}.tmp-{os.getpid()}"
    try:
        save_file(tensors, str(tmp), metadata={"format": "pt"})
        os.replace(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)
    return target
