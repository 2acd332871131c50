"""``jscaler train --data``: token windows through grain (jscaler.runtime.data), shuffled
with a seed, per-process blocks, resumable at the exact next batch, and the errors."""

import numpy as np
import pytest
from test_cli import run
from test_cli_train import losses

from jscaler.errors import DataError
from jscaler.runtime.data import TokenData, open_tokens, shard_windows

SEQ = 32  # gpt-tiny's seq_len
WINDOWS = 40


@pytest.fixture
def ids(tmp_path):
    """A .npy whose window w starts with the token id w * SEQ (no vocabulary check)."""
    path = tmp_path / "ids.npy"
    np.save(path, np.arange(WINDOWS * SEQ + 1, dtype=np.int32))
    return path


def data(path, seed=0, batch=8, **kw):
    return TokenData(path, seq_len=SEQ, batch_size=batch, seed=seed, **kw)


def test_a_batch_is_windows_of_inputs_and_next_token_targets(ids):
    b = data(ids, process_index=0, process_count=1).batch(0)
    assert set(b) == {"tokens", "targets"}
    for x in b.values():
        assert x.shape == (8, SEQ) and x.dtype == np.int32
    # each row is one window of seq_len + 1 consecutive ids, starting at a window boundary
    np.testing.assert_array_equal(b["targets"], b["tokens"] + 1)
    assert all(row[0] % SEQ == 0 for row in b["tokens"])


def test_the_batch_of_a_step_depends_only_on_the_seed_and_the_step(ids):
    one, again, other = (data(ids, s, process_index=0, process_count=1) for s in (0, 0, 1))
    for step in (0, 3, 17):
        np.testing.assert_array_equal(one.batch(step)["tokens"], again.batch(step)["tokens"])
    assert not np.array_equal(one.batch(0)["tokens"], other.batch(0)["tokens"])
    assert not np.array_equal(one.batch(0)["tokens"], one.batch(1)["tokens"])


def test_each_epoch_is_a_new_permutation_of_every_window(ids):
    d = data(ids, process_index=0, process_count=1)
    per_epoch = WINDOWS // 8
    epochs = [
        np.concatenate([d.batch(e * per_epoch + s)["tokens"][:, 0] // SEQ for s in range(5)])
        for e in range(2)
    ]
    for starts in epochs:
        assert sorted(starts) == list(range(WINDOWS))
    assert list(epochs[0]) != list(epochs[1]) != list(range(WINDOWS))


def test_each_process_reads_its_own_block_of_windows(ids):
    for count in (1, 2, 3, 4):
        blocks = [shard_windows(WINDOWS, i, count) for i in range(count)]
        assert [w for b in blocks for w in b] == list(range(WINDOWS))
        assert max(len(b) for b in blocks) - min(len(b) for b in blocks) <= 1
    for i in range(4):
        d = data(ids, process_index=i, process_count=4)
        starts = np.concatenate([d.batch(s)["tokens"][:, 0] // SEQ for s in range(5)])
        assert d.local_batch_size == 2 and len(starts) == 10
        assert set(starts) == set(range(10 * i, 10 * i + 10))  # its block, all of it
    with pytest.raises(DataError, match="does not split over 3 processes"):
        data(ids, batch=8, process_index=0, process_count=3)


def test_a_nanogpt_bin_reads_as_the_same_npy(tmp_path):
    ids = (np.arange(WINDOWS * SEQ + 1) % 256).astype(np.uint16)
    ids.tofile(tmp_path / "train.bin")
    np.save(tmp_path / "train.npy", ids)
    a, b = (
        data(tmp_path / f, process_index=0, process_count=1) for f in ("train.bin", "train.npy")
    )
    np.testing.assert_array_equal(a.batch(2)["tokens"], b.batch(2)["tokens"])
    np.testing.assert_array_equal(open_tokens(tmp_path / "train.bin"), ids)


def test_files_that_do_not_fit_are_errors_naming_the_file(tmp_path):
    np.save(tmp_path / "short.npy", np.zeros(SEQ, np.uint16))
    with pytest.raises(DataError, match=r"short.npy: 32 tokens, too few for one window.*33"):
        data(tmp_path / "short.npy", process_index=0, process_count=1)
    np.save(tmp_path / "big.npy", np.full(100, 300, np.uint16))
    with pytest.raises(DataError, match=r"big.npy: holds token id 300.*\[0, 256\)"):
        data(tmp_path / "big.npy", vocab_size=256, process_index=0, process_count=1)
    np.save(tmp_path / "two.npy", np.zeros((4, 40), np.uint16))
    with pytest.raises(DataError, match=r"two.npy: expected a 1-D array.*\(4, 40\)"):
        open_tokens(tmp_path / "two.npy")
    (tmp_path / "ids.txt").write_text("1 2 3")
    with pytest.raises(DataError, match="expected a .npy .* or a .bin"):
        open_tokens(tmp_path / "ids.txt")
    with pytest.raises(DataError, match="no such file"):
        open_tokens(tmp_path / "missing.npy")


TRAIN = ["train", "--model", "gpt-tiny", "--devices", "2", "--log-every", "1"]


def test_a_resumed_run_trains_on_the_exact_next_batches(tmp_path):
    path = tmp_path / "tokens.npy"
    np.save(path, np.random.default_rng(0).integers(0, 256, 20_000, dtype=np.uint16))
    whole = run(*TRAIN, "--data", str(path), "--steps", "4", "--seed", "3").stdout
    assert f"data: {path}, shuffled with seed 3" in whole
    ck = str(tmp_path / "ck")
    first = run(*TRAIN, "--data", str(path), "--steps", "2", "--seed", "3", "--checkpoint-dir", ck)
    resumed = run(
        *TRAIN, "--data", str(path), "--steps", "4", "--seed", "3", "--checkpoint-dir", ck,
        "--resume",
    ).stdout  # fmt: skip
    assert f"resumed from {ck}/2 (step 2)" in resumed
    got = losses(first.stdout) | losses(resumed)
    assert got == losses(whole) and sorted(got) == [1, 2, 3, 4]
    synthetic = run(*TRAIN, "--steps", "4", "--seed", "3").stdout
    assert losses(synthetic) != losses(whole)  # the file's batches, not the synthetic ones


def test_data_and_eval_data_come_from_a_config_file(tmp_path):
    np.save(tmp_path / "train.npy", np.zeros(1000, np.uint16))
    np.save(tmp_path / "val.npy", np.ones(1000, np.uint16))
    config = tmp_path / "run.toml"
    config.write_text(f'model = "gpt-tiny"\ndata = "{tmp_path / "train.npy"}"\n')
    shown = run("train", "--config", str(config), "--print-config").stdout
    assert f'data = "{tmp_path / "train.npy"}"' in shown and "# eval-data: not set" in shown
    out = run(
        "train", "--config", str(config), "--devices", "2", "--steps", "2", "--eval-every",
        "2", "--eval-batches", "1", "--eval-data", str(tmp_path / "val.npy"),
    ).stdout  # fmt: skip
    assert f"eval on {tmp_path / 'val.npy'}" in out and "eval loss" in out


def test_data_for_a_model_that_is_not_a_token_model_or_out_of_its_vocabulary(tmp_path):
    path = tmp_path / "tokens.npy"
    np.save(path, np.arange(1000, dtype=np.uint16))  # ids up to 999: gpt-tiny has 256
    wrong = run("train", "--model", "mlp-tiny", "--devices", "2", "--data", str(path), check=False)
    assert wrong.returncode == 2
    assert "the model 'mlp-tiny' does not train on token ids" in wrong.stderr
    big = run(*TRAIN, "--data", str(path), check=False)
    assert big.returncode == 2 and "holds token id 999" in big.stderr
    assert wrong.stdout == big.stdout == ""  # checked before the model and trainer are built
    no_eval = run(*TRAIN, "--data", str(path), "--eval-every", "2", check=False)
    assert no_eval.returncode == 2 and "add --eval-data PATH" in no_eval.stderr


def test_two_processes_train_on_the_batches_their_blocks_make_together(tmp_path):
    """``jscaler launch`` of 2 processes: each reads its block; the global batch of step s
    is process 0's rows of it then process 1's, as one process training on them sees."""
    import subprocess
    import sys

    import jscaler
    import models
    from spaces.parse import parse_plan

    path = tmp_path / "tokens.npy"
    np.save(path, np.random.default_rng(1).integers(0, 256, 20_000, dtype=np.uint16))
    cmd = [sys.executable, "-m", "jscaler.cli", "launch", "--nprocs", "2",
           "--devices-per-proc", "2", "--", "jscaler", "train", "--model", "gpt-tiny",
           "--data", str(path), "--steps", "3", "--log-every", "1"]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    got = losses(proc.stdout)
    blocks = [data(path, process_index=i, process_count=2) for i in range(2)]

    def batch(step):
        rows = [b.batch(step) for b in blocks]
        return {k: np.concatenate([r[k] for r in rows]) for k in ("tokens", "targets")}

    spec = models.get("gpt-tiny")
    trainer = jscaler.parallelize(spec.init(0), spec.loss, jscaler.Recipe().build(),
                                  batch(0), devices=4, plan=parse_plan("dp"))  # fmt: skip
    want = {s + 1: trainer.step(batch(s))["loss"] for s in range(3)}
    assert sorted(got) == [1, 2, 3]
    for step, loss in want.items():  # printed to 4 decimals
        assert got[step] == pytest.approx(loss, abs=2e-4), (step, got, want)
