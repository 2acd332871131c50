"""``jscaler train --data``: a token file instead of the model's synthetic batches; the
model's batch must be token ids (see :mod:`jscaler.runtime.data`)."""

from __future__ import annotations

import argparse

from jscaler.errors import DataError

__all__ = ["add_data", "batches", "check_data"]


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


def _seq_len(spec) -> int:
    """The sequence length of the model's batch, or a DataError when the batch is not
    ``{"tokens", "targets"}`` of integer token ids."""
    import numpy as np

    example = spec.batch(spec.batch_size, 0)
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
    return int(example["tokens"].shape[1])


def check_data(args) -> None:
    """``--data`` and ``--eval-data`` checked before the trainer is built (a model of
    shapes only): the model trains on token ids, each file reads as token ids, holds a
    window per process and only ids in the model's vocabulary (where the model has a
    ``cfg.vocab_size``)."""
    if args.eval_data and not args.data:
        raise DataError("--eval-data needs --data (without it, eval batches are synthetic)")
    if not args.data:
        return
    if args.eval_every and not args.eval_data:
        raise DataError(
            f"--eval-every {args.eval_every} with --data {args.data}: the eval loss needs "
            f"held-out tokens; add --eval-data PATH (a token file not trained on), or drop "
            f"--eval-every"
        )
    import jax

    import models
    from jscaler.cli.common import abstract_model
    from jscaler.runtime.data import check_tokens

    spec = models.get(args.model)
    seq_len = _seq_len(spec)
    vocab = getattr(getattr(abstract_model(spec), "cfg", None), "vocab_size", None)
    for path in filter(None, (args.data, args.eval_data)):
        check_tokens(path, seq_len=seq_len, vocab_size=vocab, process_count=jax.process_count())


def batches(args, spec, batch_size: int):
    """``(train, held_out)``: ``train(step)`` is the batch of step ``step`` (this process's
    rows when there are several), ``held_out(k)`` the eval batch ``k`` or None (use the
    synthetic ones); both None without ``--data``. The files are :func:`check_data`'s."""
    if not args.data:
        return None, None
    from jscaler.runtime.data import TokenData

    seq_len = _seq_len(spec)

    def load(path):
        return TokenData(path, seq_len=seq_len, batch_size=batch_size, seed=args.seed).batch

    return load(args.data), load(args.eval_data) if args.eval_data else None
