"""Checkpoints: saving a trainer's training state, and restoring it under any plan.

The checkpoint of step N is the folder ``<directory>/<N>``, written by orbax-checkpoint:
first under a temporary name, renamed once every array is on disk, so a folder with a plain
step number is complete unless something damaged it later. It holds

* ``arrays``: the parameters, the optimizer state's arrays and the model's non-parameter
  state (BatchNorm statistics, RNG keys and counters), each at its global shape, written
  shard by shard from wherever the trainer keeps it;
* ``jscaler``: JSON metadata: format, jscaler version, plan, step, and the name, shape and
  dtype of every array, so that restoring into another model fails with a message that
  names the first array that differs; and a checksum of every array
  (:mod:`jscaler.runtime.fingerprint`), checked when it is read back, so an array damaged
  on disk is found (a step asked for raises, the newest-usable search skips it) instead
  of restored.

Parameters and optimizer state have the same global shapes under every plan, so a
checkpoint restores under a different plan, device count or process count: orbax reads
each array straight into the restoring trainer's own shardings.

Both read and write a :class:`~jscaler.runtime.state.TrainState` with the shardings it
lives on (``program.shardings()``) and the arrays' :class:`Names`. Every process of a
multi-process run calls :func:`save` and :func:`restore` (through ``trainer.save`` /
``trainer.restore``); orbax coordinates the writes.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import sys
import tempfile
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
from jax.sharding import Sharding

from jscaler.errors import CheckpointError
from jscaler.runtime.fingerprint import fingerprints
from jscaler.runtime.state import TrainState
from jscaler.version import __version__

__all__ = [
    "Names",
    "PendingSave",
    "check_directory",
    "disk_bytes",
    "latest_step",
    "prune",
    "read_params",
    "restore",
    "save",
    "save_async",
]


@dataclass(frozen=True)
class Names:
    """What a trainer calls the arrays of its state: the parameters' and the state
    variables' names (module paths), in the state's order, and the plan's name."""

    params: tuple[str, ...]
    model_state: tuple[str, ...]
    plan: str = ""


FORMAT = 1
ARRAYS = "arrays"  # the orbax item holding every array
META = "jscaler"  # the orbax item holding the JSON metadata
GROUPS = ("params", "opt_state", "state")
_TMP = ocp.path.step.TMP_DIR_SUFFIX  # orbax names a save in progress "<step><_TMP>..."

# One saved array: (label, value, target sharding). The label is a parameter or state
# variable's name, or an optimizer-state leaf's path; a sharding of None keeps a host copy.
Slot = tuple[str, Any, Sharding | None]


def save(directory: str | os.PathLike, state: TrainState, shardings: TrainState,
         names: Names) -> Path:  # fmt: skip
    """Writes ``state`` to ``directory/<step>``; returns that path.

    Returns once the checkpoint is complete on disk. The folder appears under its final
    name only then (orbax writes to a temporary name and renames it), so a save killed
    midway leaves no step folder, only a temporary one that :func:`restore` skips.

    Args:
      directory: the checkpoint folder (created if missing); each step gets a sub-folder.
      state: the training state to save.
      shardings: where its arrays live (a TrainState of shardings, ``None`` for a host
        array): recorded so a restore knows the device count.
      names: the arrays' names, checked on restore.

    Raises:
      CheckpointError: ``directory/<step>`` exists already, or the disk refused the write
        (full, read-only); earlier steps are intact.
    """
    return save_async(directory, state, shardings, names, ocp.Checkpointer).wait()


@dataclass
class PendingSave:
    """A checkpoint being written in the background (:func:`save_async`): the arrays are
    on the host already, so training may go on and change the state."""

    path: Path
    step: int
    checkpointer: Any

    def wait(self) -> Path:
        """Blocks until the step is complete on disk; returns its path.

        Raises:
          CheckpointError: the write failed (full or read-only disk); earlier steps are
            intact."""
        try:
            finish = getattr(self.checkpointer, "wait_until_finished", None)
            if finish is not None:  # an orbax AsyncCheckpointer (the sync one is done)
                with _quiet_orbax():
                    finish()
        except _WRITE_ERRORS as e:
            raise _write_error(self.step, self.path, e) from e
        finally:
            self.checkpointer.close()
        return self.path


def save_async(directory: str | os.PathLike, state: TrainState, shardings: TrainState,
               names: Names, checkpointer=None) -> PendingSave:  # fmt: skip
    """Starts writing ``state`` to ``directory/<step>`` (as :func:`save`) and returns once
    its arrays are copied to the host; ``.wait()`` on the result before relying on the step
    (orbax's asynchronous checkpointing: the folder is renamed to its step only when
    complete, so a run killed meanwhile leaves the previous step usable)."""
    directory = Path(directory).absolute()
    step = int(state.step)
    final = directory / str(step)
    if final.exists():
        raise CheckpointError(
            f"cannot save step {step} to {final}: that checkpoint exists already. Train "
            f"further before saving again, or save to another directory"
        )
    slots = _slots(state, shardings, names)
    arrays = {
        g: {_key(i): _storable(v) for i, (_, v, _) in enumerate(items)}
        for g, items in slots.items()
        if items
    }
    try:
        check_directory(directory, disk_bytes(arrays))
    except CheckpointError as e:
        raise CheckpointError(f"cannot save step {step}: {e}") from e
    meta = {"format": FORMAT, "step": step, **_describe(names, slots)}
    meta["checksums"] = {g: fingerprints([v for _, v, _ in items]) for g, items in slots.items()}
    make = checkpointer or ocp.AsyncCheckpointer
    ckptr = make(ocp.CompositeCheckpointHandler())
    sync = checkpointer is ocp.Checkpointer
    try:
        with _quiet_orbax(), _held_stderr() if sync else contextlib.nullcontext():
            ckptr.save(
                final,
                ocp.args.Composite(
                    **{ARRAYS: ocp.args.StandardSave(arrays), META: ocp.args.JsonSave(meta)}
                ),
            )
    except _WRITE_ERRORS as e:  # a full or read-only disk: the previous steps are intact
        ckptr.close()
        raise _write_error(step, final, e) from e
    return PendingSave(final, step, ckptr)


# What a refused write raises: OSError from Python's own file calls, ValueError (with the
# errno's text, e.g. "RESOURCE_EXHAUSTED: ... No space left on device") from tensorstore.
_WRITE_ERRORS = (OSError, ValueError)


def _write_error(step: int, final: Path, e: Exception) -> CheckpointError:
    """The error for a failed save; removes the step's partial folder (freeing its space)."""
    for partial in final.parent.glob(f"{step}{_TMP}*"):
        shutil.rmtree(partial, ignore_errors=True)
    # the write's other futures failed too; asyncio would log each at exit, with a traceback
    logging.getLogger("asyncio").addFilter(_unretrieved)
    why = getattr(e, "strerror", None) or _os_reason(e)
    return CheckpointError(
        f"cannot save step {step} to {final}: {why} ({type(e).__name__}). Earlier steps "
        f"in {final.parent} are intact and the partial step was removed; free space or fix "
        f"the permissions and save again"
    )


def _os_reason(e: BaseException) -> str:
    """The operating system's words in a tensorstore error ("No space left on device"),
    else its first line."""
    text = str(e)
    for reason in ("No space left on device", "Read-only file system", "Permission denied"):
        if reason in text:
            return reason
    return _first_line(e)


class _OneLine(logging.Filter):
    """Drops the traceback of orbax's background-thread error records: the failure
    reaches the caller as one CheckpointError, which says the same in one line."""

    def filter(self, record: logging.LogRecord) -> bool:
        record.exc_info, record.exc_text = None, None
        return True


def _unretrieved(record: logging.LogRecord) -> bool:
    return "exception was never retrieved" not in record.getMessage()


def disk_bytes(tree) -> int:
    """About what a checkpoint of the arrays in ``tree`` takes on disk: their bytes, a
    quarter more, and 1 MB for orbax's metadata and the file system's blocks."""
    data = sum(int(getattr(x, "nbytes", 0) or 0) for x in jax.tree_util.tree_leaves(tree))
    return int(data * 1.25) + (1 << 20)


@contextlib.contextmanager
def _held_stderr():
    """Holds what is written to file descriptor 2 while a save runs, and writes it out
    afterwards only if the save succeeded: when a write fails, tensorstore's callbacks
    print a traceback per array ("Event loop is closed") from C++, past Python's hooks,
    and the CheckpointError already says what went wrong."""
    sys.stderr.flush()
    with tempfile.TemporaryFile() as held:
        saved = os.dup(2)
        os.dup2(held.fileno(), 2)
        try:
            yield
        except BaseException:
            os.dup2(saved, 2)
            raise
        else:
            os.dup2(saved, 2)
            held.seek(0)
            if text := held.read():
                os.write(2, text)
        finally:
            os.close(saved)


@contextlib.contextmanager
def _quiet_orbax():
    logger = logging.getLogger("absl")
    one_line = _OneLine()
    logger.addFilter(one_line)
    try:
        yield
    finally:
        logger.removeFilter(one_line)


def check_directory(directory: str | os.PathLike, nbytes: int = 0) -> Path:
    """Checks, before any training, that checkpoints can be written to ``directory``:
    it is (or can be made) a folder, a file can be written there, and its disk has room
    for ``nbytes`` (one checkpoint). Returns the absolute path.

    Raises:
      CheckpointError: naming the directory, what is wrong and how to fix it.
    """
    path = Path(directory).absolute()
    if path.exists() and not path.is_dir():
        raise CheckpointError(
            f"checkpoint directory {path} is a file, not a folder. Name a folder (it is "
            f"created if missing), or move the file away"
        )
    probe = path / f".jscaler-write-check-{os.getpid()}"
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe.write_bytes(b"jscaler")
    except OSError as e:
        raise CheckpointError(
            f"cannot write checkpoints to {path}: {e.strerror or e} ({type(e).__name__}). "
            f"Make it writable, or name another --checkpoint-dir"
        ) from e
    finally:
        # A write that fails midway (a full disk) can leave the probe behind.
        with contextlib.suppress(OSError):
            probe.unlink(missing_ok=True)
    free = shutil.disk_usage(path).free
    if nbytes > free:
        raise CheckpointError(
            f"checkpoint directory {path} has {free / 2**20:.1f} MB free and one checkpoint "
            f"needs about {nbytes / 2**20:.1f} MB. Free some space, or name a directory on "
            f"a larger disk"
        )
    return path


def restore(
    directory: str | os.PathLike,
    like: TrainState,
    shardings: TrainState,
    names: Names,
    step: int | None = None,
) -> TrainState:
    """Reads a checkpoint into a TrainState shaped like ``like`` and laid out on
    ``shardings``; its ``step`` is the step loaded.

    Without ``step``, loads the newest usable checkpoint: folders left by an interrupted
    save, or whose metadata or arrays cannot be read, are skipped with a warning naming
    them. The saving trainer's plan, device count and process count do not matter.

    Args:
      directory: the folder given to :func:`save`.
      like: a state of the same model and optimizer (its values are not read).
      shardings: where the restored arrays go (``None``: a host array).
      names: the arrays' names, which must match the checkpoint's.
      step: the step to load; ``None`` for the newest.

    Raises:
      CheckpointError: no usable checkpoint, the asked step is missing or damaged, or the
        checkpoint's arrays do not fit the model and optimizer.
    """
    directory = Path(directory).absolute()
    slots = _slots(like, shardings, names)
    here = _describe(names, slots)
    candidates, skipped = _candidates(directory, step, "restore")
    for problem in skipped:
        warnings.warn(f"skipping checkpoint {problem}", stacklevel=3)
    for s, meta in candidates:
        path = directory / str(s)
        _check_fits(path, meta, here)
        try:
            restored = _read_arrays(path, slots)
            _check_sums(slots, meta, restored)
        except Exception as e:  # tensorstore and orbax raise many kinds for damaged files
            logging.getLogger("asyncio").addFilter(_unretrieved)  # the other reads' failures
            if isinstance(e, _Damaged):
                reason = str(e)
            else:
                reason = f"its arrays cannot be read ({type(e).__name__}: {_first_line(e)})"
            if step is not None:
                raise CheckpointError(
                    f"cannot restore step {step} from {path}: {reason}. Restore another "
                    f"step, or omit step= to load the newest usable one"
                ) from e
            skipped.append(f"{path}: {reason}")
            warnings.warn(f"skipping checkpoint {skipped[-1]}", stacklevel=3)
            continue
        opt_def = jax.tree_util.tree_structure(like.opt_state)
        return TrainState(
            restored["params"],
            jax.tree_util.tree_unflatten(opt_def, restored["opt_state"]),
            restored["state"],
            int(meta["step"]),
        )
    raise _none_usable(directory, skipped)


def read_params(directory: str | os.PathLike, step: int | None = None) -> tuple[int, dict]:
    """``(step, {name: host array})``: the parameters alone of the checkpoint of ``step``
    (default the newest usable one) in ``directory``, by the names the saving trainer gave
    them (their module paths), read without building the model, checked against their
    checksums. For exporting weights (``jscaler export``).

    Raises:
      CheckpointError: no usable checkpoint, the step is missing, or a parameter is
        damaged on disk.
    """
    directory = Path(directory).absolute()
    candidates, skipped = _candidates(directory, step, "read")
    if not candidates:
        raise _none_usable(directory, skipped)
    step, meta = candidates[0]
    names = [label for label, _, _ in meta["params"]]
    target = {
        "params": {
            _key(i): np.empty(shape, np.dtype(dtype))
            for i, (_, shape, dtype) in enumerate(meta["params"])
        }
    }
    how = {"params": {k: ocp.RestoreArgs(restore_type=np.ndarray) for k in target["params"]}}
    partial = ocp.args.PyTreeRestore(target, restore_args=how, partial_restore=True)
    with ocp.Checkpointer(ocp.CompositeCheckpointHandler()) as ckptr:
        got = ckptr.restore(directory / str(step), ocp.args.Composite(**{ARRAYS: partial}))
    values = [np.asarray(got[ARRAYS]["params"][_key(i)]) for i in range(len(names))]
    saved = (meta.get("checksums") or {}).get("params")
    if saved is not None:
        for name, want, have in zip(names, saved, fingerprints(values)):
            if want != have:
                raise CheckpointError(
                    f"cannot read step {step} from {directory}: parameter {name!r} is "
                    f"damaged on disk (checksum {have:#010x}, saved as {want:#010x}); "
                    f"export another step (--step)"
                )
    return step, dict(zip(names, values))


def prune(directory: str | os.PathLike, keep: int) -> list[Path]:
    """Deletes all but the newest ``keep`` complete steps in ``directory`` (``keep`` >= 1;
    folders that are not complete steps are left alone); returns the deleted paths.

    Call it after a save has returned: the newest step is then complete on disk, so the
    run can always resume from it. In a multi-process run only process 0 deletes."""
    if keep < 1:
        raise CheckpointError(f"keep={keep}: keep at least the newest checkpoint")
    steps, _ = _scan(Path(directory).absolute())
    old = [Path(directory).absolute() / str(s) for s, _ in steps[keep:]]
    if jax.process_index() == 0:
        for path in old:
            shutil.rmtree(path)
    return old


def latest_step(directory: str | os.PathLike) -> int | None:
    """The newest complete step in ``directory``, or ``None``.

    Complete: saved to the end, with readable metadata (the arrays themselves are read
    only by :func:`restore`). Incomplete folders are skipped with a warning.
    """
    steps, skipped = _scan(Path(directory).absolute())
    for problem in skipped:
        warnings.warn(f"skipping checkpoint {problem}", stacklevel=2)
    return steps[0][0] if steps else None


# ---- what a trainer holds -------------------------------------------------------------


def _slots(state: TrainState, shardings: TrainState, names: Names) -> dict[str, list[Slot]]:
    """Per group (``GROUPS``), the arrays to save and the shardings to restore them to."""
    opt = jax.tree_util.tree_flatten_with_path(state.opt_state)[0]
    opt_shard = jax.tree_util.tree_leaves(shardings.opt_state)
    opt_slots = [(jax.tree_util.keystr(p), v, s) for (p, v), s in zip(opt, opt_shard, strict=True)]
    params = zip(names.params, state.params, shardings.params, strict=True)
    model = zip(names.model_state, state.model_state, shardings.model_state, strict=True)
    return {
        "params": list(params),
        "opt_state": opt_slots,
        "state": list(model),
    }


def _describe(names: Names, slots: dict[str, list[Slot]]) -> dict:
    """The metadata that must match between saving and restoring trainers, plus where it
    came from."""
    return {
        "jscaler": __version__,
        "plan": names.plan,
        "devices": len(_devices(slots)),
        "processes": jax.process_count(),
        **{g: [[label, list(np.shape(v)), _dtype(v)] for label, v, _ in slots[g]] for g in GROUPS},
    }


def _devices(slots) -> set:
    return {
        d for items in slots.values() for _, _, s in items if s is not None for d in s.device_set
    }


# ---- checking a checkpoint against a trainer -------------------------------------------

_WHAT = {"params": "parameter", "opt_state": "optimizer state leaf", "state": "state variable"}


def _check_fits(path: Path, meta: dict, here: dict) -> None:
    """Raises a CheckpointError naming the first array whose name, shape or dtype in the
    checkpoint differs from this trainer's."""
    for g in GROUPS:
        theirs = {label: (shape, dtype) for label, shape, dtype in meta[g]}
        ours = {label: (shape, dtype) for label, shape, dtype in here[g]}
        for label in [x[0] for x in here[g]] + [x[0] for x in meta[g]]:
            if theirs.get(label) == ours.get(label):
                continue
            t, o = theirs.get(label), ours.get(label)
            found = "absent" if t is None else f"{_fmt(t)}"
            expected = "absent" if o is None else f"{_fmt(o)}"
            raise CheckpointError(
                f"checkpoint {path} does not fit this trainer: {_WHAT[g]} {label!r} is "
                f"{found} in the checkpoint and {expected} here. Restore into the model and "
                f"optimizer that saved it (plan, device and process count may differ), "
                f"or save to a new directory"
            )


class _Damaged(Exception):
    """An array read back differs from the one saved."""


def _check_sums(slots: dict[str, list[Slot]], meta: dict, restored: dict[str, list]) -> None:
    """Raises :class:`_Damaged` naming the first restored array whose checksum differs
    from the one recorded at save (checkpoints without checksums are not checked)."""
    sums = meta.get("checksums")
    if not isinstance(sums, dict):
        return
    for g in GROUPS:
        saved = sums.get(g, [])
        got = fingerprints(restored[g])
        for (label, _, _), want, have in zip(slots[g], saved, got):
            if want != have:
                raise _Damaged(
                    f"{_WHAT[g]} {label!r} is damaged on disk (checksum {have:#010x}, saved "
                    f"as {want:#010x})"
                )


def _fmt(shape_dtype) -> str:
    shape, dtype = shape_dtype
    return f"{dtype}{list(shape)}"


# ---- the folder ------------------------------------------------------------------------


def _candidates(
    directory: Path, step: int | None, verb: str
) -> tuple[list[tuple[int, dict]], list[str]]:
    """``([(step, metadata)], [skipped folders])`` to try, newest first: ``step``'s alone
    (a CheckpointError naming the steps there when its metadata cannot be read), else
    every complete one (:func:`_scan`)."""
    if step is None:
        return _scan(directory)
    meta, problem = _read_meta(directory / str(step))
    if problem:
        raise CheckpointError(
            f"cannot {verb} step {step} from {directory}: {problem}. Steps there: "
            f"{[s for s, _ in _scan(directory)[0]] or 'none'}; {verb} one of them, or "
            f"omit the step to use the newest"
        )
    return [(step, meta)], []


def _none_usable(directory: Path, skipped: list[str]) -> CheckpointError:
    found = "; ".join(skipped) if skipped else "no step folder"
    return CheckpointError(
        f"no usable checkpoint in {directory}: expected step folders written by "
        f"trainer.save() (jscaler train --checkpoint-dir), found {found}. Check the path, "
        f"or start from scratch"
    )


def _scan(directory: Path) -> tuple[list[tuple[int, dict]], list[str]]:
    """(step, metadata) of every complete step folder, newest first; and, for every other
    folder a save left, ``"<path>: <why it is unusable>"``."""
    if not directory.is_dir():
        return [], []
    steps, skipped = [], []
    for entry in sorted(directory.iterdir(), key=lambda p: p.name):
        if _TMP in entry.name:
            skipped.append(f"{entry}: an unfinished save (killed, or still running)")
        elif entry.name.isdigit():
            meta, problem = _read_meta(entry)
            if problem:
                skipped.append(f"{entry}: {problem}")
            else:
                steps.append((int(entry.name), meta))
    return sorted(steps, key=lambda sm: -sm[0]), skipped


def _read_meta(path: Path) -> tuple[dict | None, str | None]:
    """The step folder's metadata, or why it is not a usable checkpoint."""
    if not path.is_dir():
        return None, "no such folder"
    if not ocp.path.step.is_path_finalized(path):
        return None, "an unfinished save"
    if not (path / ARRAYS).is_dir():
        return None, f"its {ARRAYS!r} folder is missing"
    try:
        with ocp.Checkpointer(ocp.CompositeCheckpointHandler()) as ckptr:
            meta = ckptr.restore(path, ocp.args.Composite(**{META: ocp.args.JsonRestore()}))[META]
    except Exception as e:  # a missing or garbled JSON file
        return None, f"its metadata cannot be read ({type(e).__name__}: {_first_line(e)})"
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        return None, f"its metadata is not jscaler checkpoint format {FORMAT}"
    if meta.get("step") != int(path.name) or any(not isinstance(meta.get(g), list) for g in GROUPS):
        return None, "its metadata is inconsistent"
    return meta, None


def _read_arrays(path: Path, slots: dict[str, list[Slot]]) -> dict[str, list]:
    """The checkpoint's arrays, read into the slots' shardings (host arrays where None)."""
    target = {
        g: {_key(i): _abstract(v, s) for i, (_, v, s) in enumerate(items)}
        for g, items in slots.items()
        if items
    }
    with ocp.Checkpointer(ocp.CompositeCheckpointHandler()) as ckptr:
        got = ckptr.restore(path, ocp.args.Composite(**{ARRAYS: ocp.args.StandardRestore(target)}))
    got = got[ARRAYS]
    return {
        g: [_from_storable(got[g][_key(i)], v, s) for i, (_, v, s) in enumerate(items)]
        if items
        else []
        for g, items in slots.items()
    }


# ---- array conversions -----------------------------------------------------------------


def _key(i: int) -> str:
    return f"{i:05d}"


def _is_key(v) -> bool:
    return jax.dtypes.issubdtype(v.dtype, jax.dtypes.prng_key)


def _dtype(v) -> str:
    return str(v.dtype)


def _storable(v):
    """What orbax writes for ``v``: typed PRNG keys as their raw ``uint32`` data."""
    return jax.random.key_data(v) if _is_key(v) else v


def _abstract(v, sharding):
    """The restore target for a slot holding ``v``."""
    stored = jax.eval_shape(jax.random.key_data, v) if _is_key(v) else v
    if sharding is None:
        return np.empty(stored.shape, stored.dtype)  # read as a host array
    return jax.ShapeDtypeStruct(stored.shape, stored.dtype, sharding=sharding)


def _from_storable(x, like, sharding):
    if _is_key(like):
        x = jax.random.wrap_key_data(x, impl=jax.random.key_impl(like))
        if sharding is not None:
            x = jax.device_put(x, sharding)
    return x


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return text[0][:200] if text else ""
