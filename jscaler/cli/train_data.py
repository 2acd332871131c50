"""``jscaler train --data``: a token file instead of the model's synthetic batches; the
model's batch must be token ids (see :mod:`jscaler.runtime.data`)."""

from __future__ import annotations

import argparse

from jscaler.errors import DataError

__all__ = ["add_data", "batches"]


def add_data(p: argparse.ArgumentParser) -> None:
    """``--data PATH`` and ``--eval-data PATH``."""
    p.add_argument(
        "--data",
        default=None,
        metavar="PATH",
        help="train on the token ids of PATH instead of synthetic batches: a 1-D .npy of "
        "integer ids or a nanoGPT .bin (raw uint16), memory-mapped, cut into windows of "
        "seq_len + 1 tokens (inputs and next-token targets), shuffled with --seed (a new "
        "permutation each epoch) and batched through grain; each process reads only its "
        "own block of windows, and the batch of step s depends only on (--seed, s), so "
        "--resume continues with the exact next batch. For token models (gpt-*, moe-*)",
    )
    p.add_argument(
        "--eval-data",
        default=None,
        metavar="PATH",
        help="with --data and --eval-every: the held-out token file the eval loss is "
        "measured on (its first --eval-batches batches; same format as --data)",
    )


def _token_shape(spec, batch_size: int) -> tuple[int, int]:
    """(batch_size, seq_len) of the model's batch, or a DataError when the batch is not
    ``{"tokens", "targets"}`` of integer token ids."""
    import numpy as np

    example = spec.batch(batch_size, 0)
    leaves = list(example.values()) if isinstance(example, dict) else []
    if (
        not isinstance(example, dict)
        or set(example) != {"tokens", "targets"}
        or any(x.ndim != 2 or not np.issubdtype(x.dtype, np.integer) for x in leaves)
        or example["tokens"].shape != example["targets"].shape
    ):
        found = (
            {k: f"{v.dtype}{list(v.shape)}" for k, v in example.items()}
            if isinstance(example, dict)
            else type(example).__name__
        )
        raise DataError(
            f"--data: the model {spec.name!r} does not train on token ids: its batch is "
            f"{found}, and --data gives {{'tokens', 'targets'}} int32[batch, seq_len]; use "
            f"--data with a token model (gpt-tiny, gpt-small, moe-tiny, ...), or drop --data "
            f"to train {spec.name!r} on its synthetic batches"
        )
    return tuple(example["tokens"].shape)


def batches(args, spec, model, batch_size: int):
    """``(train, held_out)``: ``train(step)`` is the batch of step ``step`` (this process's
    rows when there are several), ``held_out`` the eval batches' function of ``k`` or None
    (use the synthetic ones); both None without ``--data``."""
    if args.eval_data and not args.data:
        raise DataError("--eval-data needs --data (without it, eval batches are synthetic)")
    if not args.data:
        return None, None
    if args.eval_every and not args.eval_data:
        raise DataError(
            f"--eval-every {args.eval_every} with --data {args.data}: the eval loss needs "
            f"held-out tokens; add --eval-data PATH (a token file not trained on), or drop "
            f"--eval-every"
        )
    from jscaler.runtime.data import TokenData

    _, seq_len = _token_shape(spec, batch_size)
    vocab = getattr(getattr(model, "cfg", None), "vocab_size", None)

    def load(path):
        return TokenData(
            path, seq_len=seq_len, batch_size=batch_size, seed=args.seed, vocab_size=vocab
        ).batch

    return load(args.data), load(args.eval_data) if args.eval_data else None
