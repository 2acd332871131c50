"""``jscaler train``'s TOML config, training recipe (optimizer, learning-rate schedule,
clipping, gradient accumulation) and metrics (JSONL, TensorBoard, eval loss)."""

import math
import tomllib
from pathlib import Path

import jax
import numpy as np
import pytest
from test_cli import run

import jscaler
import models
from jscaler.cli import main
from jscaler.runtime.metrics_log import MetricsLog, read_jsonl, read_scalars

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def print_config(capsys, *args) -> dict:
    assert main(["train", *args, "--print-config"]) == 0
    return tomllib.loads(capsys.readouterr().out)


# ---- the config file ---------------------------------------------------------------------


def test_the_command_line_overrides_the_file_and_print_config_round_trips(tmp_path, capsys):
    f = tmp_path / "run.toml"
    f.write_text(
        'model = "gpt-tiny"\nsteps = 40\nlr = 3e-4\nlr-schedule = "cosine"\nresume = true\n'
        'plan = "megatron(tp=2, dp=4)"\n'
    )
    merged = print_config(capsys, "--config", str(f), "--steps", "7", "--optimizer", "sgd")
    assert merged["steps"] == 7 and merged["optimizer"] == "sgd"  # the command line wins
    assert merged["lr"] == 3e-4 and merged["lr-schedule"] == "cosine"  # the file's
    assert merged["resume"] is True and merged["plan"] == "megatron(tp=2, dp=4)"
    assert merged["model"] == "gpt-tiny"  # --model is required, and the file gave it
    assert merged["log-every"] == 10 and "batch-size" not in merged  # defaults; unset
    again = tmp_path / "merged.toml"  # the printed config is itself a config file
    assert main(["train", "--config", str(f), "--steps", "7", "--optimizer", "sgd",
                 "--print-config"]) == 0  # fmt: skip
    again.write_text(capsys.readouterr().out)
    assert print_config(capsys, "--config", str(again)) == merged


def test_print_config_without_a_file_shows_the_defaults(capsys):
    merged = print_config(capsys, "--model", "mlp-tiny")
    assert merged["optimizer"] == "adam" and merged["lr"] == 1e-2
    assert merged["lr-schedule"] == "constant" and merged["grad-accum"] == 1
    assert "config" not in merged and "print-config" not in merged


@pytest.mark.parametrize(
    "text, message",
    [
        ("batch_size = 8", "unknown key 'batch_size'; did you mean 'batch-size'?"),
        ("learning-rate = 0.1", "unknown key 'learning-rate'"),
        ("steps = 0", "steps = 0: must be at least 1"),
        ("steps = 2.5", "steps = 2.5: '2.5' is not an integer"),
        ('resume = "yes"', "resume is a flag; write resume = true or false"),
        ('optimizer = "lamb"', "expected one of adam, adamw, sgd"),
        ("lr = [1, 2]", "expected a number, got a list"),
        ("steps = ", "not valid TOML"),
    ],
)
def test_a_bad_config_is_a_clear_error_naming_the_key(tmp_path, capsys, text, message):
    f = tmp_path / "bad.toml"
    f.write_text(f'model = "mlp-tiny"\n{text}\n')
    assert main(["train", "--config", str(f), "--print-config"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("jscaler train: error: ") and str(f) in err
    assert message in err, err
    if "unknown key" in message:  # and lists the valid ones
        assert "valid keys: " in err and "checkpoint-dir" in err and "lr-schedule" in err


def test_print_config_checks_the_recipe_too(tmp_path, capsys):
    f = tmp_path / "run.toml"
    f.write_text('model = "mlp-tiny"\nsteps = 20\nlr-schedule = "cosine"\nwarmup-steps = 30\n')
    assert main(["train", "--config", str(f), "--print-config"]) == 2
    assert "give steps greater than warmup_steps" in capsys.readouterr().err
    assert main(["train", "--config", str(f), "--steps", "40", "--print-config"]) == 0


def test_a_missing_config_file_is_an_error(tmp_path, capsys):
    assert main(["train", "--config", str(tmp_path / "nope.toml")]) == 2
    assert "no such file" in capsys.readouterr().err


def test_a_config_error_is_one_of_jscalers_errors():
    assert issubclass(jscaler.ConfigError, jscaler.JscalerError)
    with pytest.raises(jscaler.ConfigError, match="give steps greater than warmup_steps"):
        jscaler.Recipe(schedule="cosine", warmup_steps=10, steps=10)
    with pytest.raises(jscaler.ConfigError, match="use --optimizer adamw"):
        jscaler.Recipe("adam", weight_decay=0.1)


def test_precision_needs_a_space_with_a_precision_knob(tmp_path, capsys):
    plan = tmp_path / "plan.json"
    plan.write_text("{}")
    assert main(["train", "--model", "mlp-tiny", "--plan", str(plan), "--precision", "bf16"]) == 2
    assert "--precision bf16: the plan" in capsys.readouterr().err


@pytest.mark.parametrize("name", ["gpt-small", "swin", "t5", "moe"])
def test_the_example_configs_parse(capsys, name):
    merged = print_config(capsys, "--config", str(EXAMPLES / f"{name}.toml"))
    assert merged["model"] in models.names()
    assert merged["metrics-dir"] and merged["eval-every"] > 0 and merged["checkpoint-dir"]


def test_an_example_config_trains(tmp_path):
    proc = run(
        "train", "--config", str(EXAMPLES / "moe.toml"), "--steps", "2", "--warmup-steps",
        "0", "--eval-every", "2", "--metrics-dir", str(tmp_path / "m"), "--checkpoint-dir",
        str(tmp_path / "ck"),
    )  # fmt: skip
    assert "plan expert" in proc.stdout and "recipe: adamw, lr 0.003 cosine" in proc.stdout
    assert "eval loss" in proc.stdout and (tmp_path / "ck" / "2").is_dir()
    rows = read_jsonl(tmp_path / "m")
    assert rows[-1]["step"] == 2 and "eval_loss" in rows[-1] and "checkpoint_s" in rows[-1]


# ---- the recipe --------------------------------------------------------------------------


def cosine(update, lr, warmup, steps, min_lr):
    if update < warmup:
        return lr * update / warmup
    t = min(update - warmup, steps - warmup) / (steps - warmup)
    return min_lr + (lr - min_lr) * 0.5 * (1 + math.cos(math.pi * t))


def test_schedule_metrics_tensorboard_and_eval_in_one_run(tmp_path):
    """The JSONL's lr column follows warm-up then cosine; TensorBoard holds the same
    scalars; the eval loss is there every --eval-every steps."""
    d = tmp_path / "m"
    proc = run(
        "train", "--model", "mlp-tiny", "--devices", "2", "--steps", "6", "--log-every", "1",
        "--optimizer", "sgd", "--lr", "0.1", "--lr-schedule", "cosine", "--warmup-steps", "2",
        "--min-lr", "0.01", "--eval-every", "3", "--eval-batches", "2", "--metrics-dir", str(d),
    )  # fmt: skip
    rows = read_jsonl(d)
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6]
    for r in rows:  # step n used the rate of update n - 1
        assert r["lr"] == pytest.approx(cosine(r["step"] - 1, 0.1, 2, 6, 0.01), rel=1e-6)
    assert rows[0]["lr"] == 0 and rows[2]["lr"] == pytest.approx(0.1)
    assert all(r["grad_norm"] > 0 and np.isfinite(r["loss"]) for r in rows)
    assert all(r["samples_per_s"] > 0 and 0 < r["mfu"] < 1 for r in rows[1:])
    assert "samples_per_s" not in rows[0]  # the first step compiles: no rate
    evals = {r["step"]: r["eval_loss"] for r in rows if "eval_loss" in r}
    assert sorted(evals) == [3, 6] and evals[6] < evals[3]
    assert "eval loss" in proc.stdout and "step 3: eval loss" in proc.stdout
    scalars = read_scalars(d)  # the event file, read back
    for name in ("loss", "grad_norm", "lr", "eval_loss"):
        got = dict(scalars[name])
        want = {r["step"]: r[name] for r in rows if name in r}
        assert got.keys() == want.keys(), name
        assert all(got[s] == pytest.approx(v, rel=1e-6) for s, v in want.items()), name
    assert list(d.glob("events.out.tfevents.*"))


def test_grad_accumulation_equals_one_step_on_the_concatenated_batch(tmp_path):
    """--grad-accum 2 of --batch-size 8: each update sums two micro-batches' gradients;
    with SGD the trajectory is the one of --batch-size 16 in one piece, to fp32."""
    common = ["train", "--model", "mlp-tiny", "--devices", "2", "--steps", "3", "--log-every",
              "1", "--optimizer", "sgd", "--lr", "0.5"]  # fmt: skip
    run(*common, "--batch-size", "16", "--metrics-dir", str(tmp_path / "one"))
    out = run(*common, "--batch-size", "8", "--grad-accum", "2", "--metrics-dir",
              str(tmp_path / "acc")).stdout  # fmt: skip
    assert "2 batches accumulated per update, seed 0, fp32" in out
    one, acc = read_jsonl(tmp_path / "one"), read_jsonl(tmp_path / "acc")
    assert [r["step"] for r in acc] == [1, 2, 3]
    for a, b in zip(acc, one):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5)
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-5)
    assert one[2]["loss"] < one[0]["loss"]  # and it trains


def param_delta(trainer, before) -> float:
    after = jax.tree_util.tree_leaves(trainer.params)
    return float(
        math.sqrt(sum(float(np.sum((np.asarray(a) - np.asarray(b)) ** 2))
                      for a, b in zip(after, before)))
    )  # fmt: skip


@pytest.mark.parametrize("clip", [0.0, 0.05])
def test_clipping_bounds_the_update_and_the_logged_norm_is_before_clipping(clip):
    spec = models.get("mlp-tiny")
    recipe = jscaler.Recipe("sgd", lr=1.0, clip_grad_norm=clip)
    batch = spec.batch(16, 0)
    trainer = jscaler.parallelize(spec.init(0), spec.loss, recipe.build(), batch, devices=2)
    before = [np.asarray(x) for x in jax.tree_util.tree_leaves(trainer.params)]
    norm = trainer.step(batch)["grad_norm"]
    moved = param_delta(trainer, before)
    assert norm > 0.05  # the logged norm: the gradient's, not the clipped one
    # SGD at lr 1 moves the parameters by the (clipped) gradient
    assert moved == pytest.approx(clip if clip else norm, rel=1e-4)


def test_metrics_log_writes_lists_per_device_and_leaves_out_none(tmp_path):
    with MetricsLog(tmp_path) as log:
        log.write(1, {"loss": 2.0, "memory_bytes": [10, 20], "mfu": None})
    assert read_jsonl(tmp_path) == [{"step": 1, "loss": 2.0, "memory_bytes": [10, 20]}]
    scalars = read_scalars(tmp_path)
    assert scalars["memory_bytes/1"] == [(1, 20.0)] and "mfu" not in scalars
