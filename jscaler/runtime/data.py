"""Token-id data for ``jscaler train --data``: a 1-D ``.npy`` or nanoGPT ``.bin`` (raw
uint16) of token ids, read through grain as shuffled, per-process, resumable batches.

The file is memory-mapped and cut into non-overlapping windows of ``seq_len + 1`` tokens
(window ``w`` starts at token ``w * seq_len``); a window's first ``seq_len`` tokens are the
inputs and its last ``seq_len`` the targets (the next token at each position). The window
index space is split into ``process_count`` contiguous blocks (:func:`shard_windows`);
each process shuffles its own block with the seed (a fresh permutation every epoch,
``grain.MapDataset.shuffle``) and batches it, so the batch of step ``s`` is a pure function
of (file, seed, ``s``, process count): a run resumed at step ``k`` reads batch ``k`` next.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from jscaler.errors import DataError

__all__ = ["TokenData", "check_tokens", "open_tokens", "shard_windows"]


def open_tokens(path: str | Path) -> np.ndarray:
    """The token ids of ``path`` as a read-only 1-D memmap: a ``.npy`` of any integer
    dtype, or a ``.bin`` of raw uint16 (nanoGPT's ``prepare.py`` format).

    Raises:
      DataError: no such file, another suffix, or not a 1-D integer array.
    """
    path = Path(path)
    if not path.is_file():
        raise DataError(f"--data {path}: no such file (a .npy or .bin of token ids)")
    if path.suffix == ".npy":
        try:
            tokens = np.load(path, mmap_mode="r", allow_pickle=False)
        except (ValueError, OSError) as e:
            raise DataError(f"--data {path}: not a readable .npy file ({e})") from None
    elif path.suffix == ".bin":
        if path.stat().st_size % 2:
            raise DataError(
                f"--data {path}: a .bin is raw uint16 token ids (nanoGPT's format), but the "
                f"file has an odd number of bytes ({path.stat().st_size}); write it with "
                f"np.array(ids, dtype=np.uint16).tofile(path), or save a .npy"
            )
        tokens = np.memmap(path, dtype=np.uint16, mode="r")
    else:
        raise DataError(
            f"--data {path}: expected a .npy (np.save of a 1-D integer array) or a .bin (raw "
            f"uint16, nanoGPT's format), got a {path.suffix or 'file without a'} suffix"
        )
    if tokens.ndim != 1 or not np.issubdtype(tokens.dtype, np.integer):
        raise DataError(
            f"--data {path}: expected a 1-D array of integer token ids, found shape "
            f"{tuple(tokens.shape)} of {tokens.dtype}; save it with "
            f"np.save(path, ids.reshape(-1).astype(np.uint16)) (or int32 for a vocab > 65536)"
        )
    return tokens


def check_tokens(
    path: str | Path, *, seq_len: int, vocab_size: int | None = None, process_count: int = 1
) -> np.ndarray:
    """The token ids of ``path`` (:func:`open_tokens`), checked to hold a window of
    ``seq_len + 1`` tokens for each of ``process_count`` processes and, when
    ``vocab_size`` is given, only ids in ``[0, vocab_size)`` (the whole file's min and max:
    one pass over the memmap).

    Raises:
      DataError: as :func:`open_tokens`; too few tokens; an id outside the vocabulary.
    """
    tokens = open_tokens(path)
    if (len(tokens) - 1) // seq_len < process_count:
        need = "one window" if process_count == 1 else f"{process_count} windows (one each)"
        raise DataError(
            f"--data {path}: {len(tokens)} tokens, too few for {need} of seq_len + 1 = "
            f"{seq_len + 1} tokens; the model needs at least {process_count * seq_len + 1} "
            f"tokens: use a longer file"
        )
    if vocab_size is not None:
        low, high = int(tokens.min()), int(tokens.max())
        if low < 0 or high >= vocab_size:
            raise DataError(
                f"--data {path}: holds token id {high if high >= vocab_size else low}, but "
                f"the model's vocabulary is [0, {vocab_size}); tokenize with the model's "
                f"tokenizer (ids below {vocab_size}), or train a model with a larger vocab_size"
            )
    return tokens


def shard_windows(windows: int, process_index: int, process_count: int) -> range:
    """The window indices process ``process_index`` of ``process_count`` reads: the
    ``process_index``-th of ``process_count`` contiguous, near-equal blocks of
    ``range(windows)`` (on one process, all of them)."""
    if not 0 <= process_index < process_count:
        raise ValueError(f"process_index {process_index} is not in [0, {process_count})")
    return range(
        process_index * windows // process_count, (process_index + 1) * windows // process_count
    )


class _Windows:
    """grain's random-access source: window ``i`` of the block ``rows`` of the memmap, as
    ``seq_len + 1`` int32 tokens."""

    def __init__(self, tokens: np.ndarray, seq_len: int, rows: range):
        self.tokens, self.seq_len, self.rows = tokens, seq_len, rows

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> np.ndarray:
        start = self.rows[i % len(self.rows)] * self.seq_len
        return np.asarray(self.tokens[start : start + self.seq_len + 1], dtype=np.int32)


class TokenData:
    """Batches ``{"tokens", "targets"}`` (int32 ``[rows, seq_len]``) of a token file.

    Args:
      path: A ``.npy`` or ``.bin`` of token ids (:func:`open_tokens`).
      seq_len: The model's sequence length; windows are ``seq_len + 1`` tokens.
      batch_size: The global batch size; this process's batches have
        ``batch_size // process_count`` rows.
      seed: The shuffle's seed.
      vocab_size: When given, every id in the file is checked to be in ``[0, vocab_size)``.
      process_index, process_count: This process and how many read the file (default
        ``jax.process_index()`` and ``jax.process_count()``).

    Raises:
      DataError: the file cannot be read, is too short for one window per process, or holds
        an id outside the vocabulary; the batch does not split over the processes.
    """

    def __init__(
        self,
        path: str | Path,
        *,
        seq_len: int,
        batch_size: int,
        seed: int = 0,
        vocab_size: int | None = None,
        process_index: int | None = None,
        process_count: int | None = None,
    ):
        import grain

        if process_index is None or process_count is None:
            import jax

            process_index, process_count = jax.process_index(), jax.process_count()
        self.path, self.seq_len = Path(path), seq_len
        self.tokens = check_tokens(
            path, seq_len=seq_len, vocab_size=vocab_size, process_count=process_count
        )
        self.windows = (len(self.tokens) - 1) // seq_len
        if batch_size % process_count:
            raise DataError(
                f"--data {path}: the global batch size {batch_size} does not split over "
                f"{process_count} processes; use a --batch-size divisible by {process_count}"
            )
        self.rows = shard_windows(self.windows, process_index, process_count)
        self.local_batch_size = batch_size // process_count
        source = _Windows(self.tokens, seq_len, self.rows)
        # shuffle then repeat: epoch e of the block is the permutation with seed + e
        self.dataset = (
            grain.MapDataset.source(source)
            .shuffle(seed=seed % 2**32)
            .repeat()
            .batch(self.local_batch_size)
        )

    def batch(self, step: int) -> dict[str, np.ndarray]:
        """This process's rows of the batch of step ``step``: the rows
        ``step * b ... (step + 1) * b - 1`` of the seeded, repeated shuffle of its block."""
        windows = self.dataset[step]
        return {"tokens": windows[:, :-1], "targets": windows[:, 1:]}
