"""The ``jscaler`` command, run as a user runs it: in a fresh process."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

JSCALER = Path(sys.executable).with_name("jscaler")


def run(*args, check=True, env=None):
    cmd = [str(JSCALER)] if JSCALER.exists() else [sys.executable, "-m", "jscaler.cli"]
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"} | (env or {})
    proc = subprocess.run(
        [*cmd, *args], capture_output=True, text=True, env=env, timeout=300, check=False
    )
    if check:
        assert proc.returncode == 0, proc.stderr
    return proc


def test_console_script_is_installed():
    assert JSCALER.exists(), "pip install -e . should install the `jscaler` console script"


def test_inspect_gpt_tiny_prints_the_table_with_module_paths():
    out = run("inspect", "--model", "gpt-tiny").stdout
    assert "module path" in out and "annotation" in out
    assert "blocks/0/attn/q_proj" in out and "dot_general" in out
    assert "coverage: 100.0% of ops, 100.0% of FLOPs annotated" in out
    assert "repeated layers: blocks/0, blocks/1, blocks/2, blocks/3" in out


@pytest.mark.parametrize("model", ["convnet-tiny", "mlp-tiny"])
def test_inspect_json_for_other_model_kinds(model):
    data = json.loads(run("inspect", "--model", model, "--json").stdout)
    assert data["coverage"] == {"ops": 1.0, "flops": 1.0}
    assert any(o["primitive"] == "dot_general" for o in data["ops"])


def test_inspect_select_and_a_paper_scale_config_without_allocating():
    out = run("inspect", "--model", "llama-7b", "--select", "blocks/0/mlp/*").stdout
    assert "blocks/0/mlp/gate_proj" in out and "blocks/1/" not in out.split("\n\n")[0]
    assert "params: 6,7" in out  # ~6.7B parameters, from shapes only


def test_unknown_model_is_a_clear_error():
    proc = run("inspect", "--model", "gpt-huge", check=False)
    assert proc.returncode == 2
    assert "unknown model 'gpt-huge'" in proc.stderr and "gpt-tiny" in proc.stderr


def test_train_shows_progress_and_the_loss_falling():
    proc = run(
        "train",
        "--model",
        "gpt-tiny",
        "--devices",
        "8",
        "--plan",
        "megatron(tp=2, dp=4)",
        "--steps",
        "20",
    )
    assert "plan megatron(tp=2, dp=4) on 8 devices (dp=4 x tp=2)" in proc.stdout
    assert "20/20" in proc.stderr  # the progress bar
    first, last = (float(x) for x in proc.stdout.split("loss ")[-1].split(" in ")[0].split(" -> "))
    assert last < 0.8 * first


def test_verify_exit_codes():
    ok = run("verify", "--model", "mlp-tiny", "--plan", "megatron(tp=2, dp=4)", "--devices", "8")
    assert "MATCH" in ok.stdout and "max |diff| grad" in ok.stdout
    bad = run(
        "verify", "--model", "mlp-tiny", "--plan", "zero(stage=3)", "--tol-scale", "0", check=False
    )
    assert bad.returncode == 1 and "MISMATCH" in bad.stdout
    bf16 = run("verify", "--model", "mlp-tiny", "--plan", "zero(stage=3, precision='bf16')")
    assert "bf16" in bf16.stdout and "MATCH" in bf16.stdout
    err = run("verify", "--model", "mlp-tiny", "--plan", "megatron(tp=3)", check=False)
    assert err.returncode == 2 and "divisible by tp=3" in err.stderr
    err = run("verify", "--model", "mlp-tiny", "--plan", "__import__('os')", check=False)
    assert err.returncode == 2 and "expected a call of one of" in err.stderr


def test_plan_expressions_are_parsed_safely():
    from spaces import megatron, zero
    from spaces.parse import parse_plan

    assert parse_plan("megatron(tp=2, dp=4)") == megatron(tp=2, dp=4)
    assert parse_plan("zero") == zero()
    assert parse_plan(" zero(3) ") == zero(3)
    for bad in ("megatron(tp=x)", "megatron(tp=2)()", "lambda: 0", "megatron(tp=2"):
        with pytest.raises(__import__("jscaler").PlanError):
            parse_plan(bad)


def test_bench_spmd_runs_and_prints_ratios():
    out = run(
        "bench",
        "spmd",
        "--model",
        "gpt-tiny",
        "--steps",
        "1",
        "--plan",
        "megatron(tp=4, dp=2)",
        "--devices",
        "8",
    ).stdout
    assert "plain rules tp=8" in out and "plain jit dp" in out
    assert "megatron(tp=4, dp=2)" in out and "comm/rules" in out and "predicted" in out


def test_verify_a_pipeline_plan_with_a_schedule():
    out = run(
        "verify", "--model", "gpt-tiny", "--plan", "megatron(pp=2, dp=4)", "--schedule",
        "interleaved_1f1b(chunks=2)",
    ).stdout  # fmt: skip
    assert "4 stages on groups 0-3 (dp=4 x tp=1), 4-7 (dp=4 x tp=1)" in out
    assert "schedule interleaved_1f1b(chunks=2), 4 micro-batches" in out  # 2*pp by default
    assert "MATCH" in out


def test_verify_three_f_one_b_on_the_recycling_model():
    out = run(
        "verify", "--model", "recycler-tiny", "--plan", "megatron(pp=2, dp=4)", "--schedule",
        "three_f_one_b",
    ).stdout  # fmt: skip
    assert "schedule three_f_one_b, 4 micro-batches" in out and "MATCH" in out


def test_an_unknown_schedule_is_a_clear_error():
    proc = run("verify", "--model", "mlp-tiny", "--plan", "megatron(pp=2)", "--schedule",
               "fast", check=False)  # fmt: skip
    assert proc.returncode == 2
    assert "--schedule 'fast': expected one of" in proc.stderr


def test_plan_predicts_and_searches_with_simulated_figures():
    out = run(
        "plan", "--model", "gpt-small", "--cluster", "dgx2_v100", "--plan", "auto",
        "--mesh", "d=8", "--plan", "dp", "--plan", "megatron(tp=8)", "--explain",
    ).stdout  # fmt: skip
    assert "SIMULATED" in out and "OPTIMAL" in out and "blocks/0/mlp/up_proj" in out
    data = json.loads(
        run("plan", "--model", "gpt-tiny", "--auto", "--plan", "megatron(tp=2)",
            "--json").stdout
    )  # fmt: skip
    tp2, searched = data["plans"]
    assert searched["plan"].startswith("auto: ") and searched["fits"]
    assert searched["tries"] > 50  # the joint search: spaces, ILP, pipelines, schedules
    assert searched["step_ms"] <= tp2["step_ms"]  # the search is never worse than a menu pick
    bad = run("plan", "--model", "gpt-tiny", "--cluster", "tpu", check=False)
    assert bad.returncode == 2 and "unknown cluster 'tpu'" in bad.stderr


def test_plan_ranks_a_spaces_settings():
    data = json.loads(
        run("plan", "--model", "gpt-tiny", "--space", "megatron", "--space", "zero",
            "--json").stdout
    )  # fmt: skip
    names = [r["plan"] for r in data["plans"]]
    assert "megatron(tp=2, dp=4)" in names and "zero(stage=3, dp=8)" in names
    assert any("pp=2" in n for n in names)
    assert all(r["step_ms"] > 0 for r in data["plans"] if "error" not in r)


@pytest.mark.parametrize(
    "args, option",
    [
        (["train", "--model", "mlp-tiny", "--steps", "-5"], "--steps"),
        (["train", "--model", "mlp-tiny", "--batch-size", "0"], "--batch-size"),
        (["train", "--model", "mlp-tiny", "--checkpoint-every", "-1"], "--checkpoint-every"),
        (["train", "--model", "mlp-tiny", "--log-every", "-1"], "--log-every"),
        (["train", "--model", "mlp-tiny", "--devices", "-4"], "--devices"),
        (["train", "--model", "mlp-tiny", "--microbatches", "-2"], "--microbatches"),
        (["verify", "--model", "mlp-tiny", "--steps", "0"], "--steps"),
        (["verify", "--model", "mlp-tiny", "--tol-scale", "-1"], "--tol-scale"),
        (["launch", "--nprocs", "0", "--", "train", "--model", "mlp-tiny"], "--nprocs"),
        (["plan", "--model", "moe-tiny", "--auto", "--expert-skew", "0.5"], "--expert-skew"),
        (
            ["train", "--model", "moe-tiny", "--plan", "auto", "--expert-skew", "nan"],
            "--expert-skew",
        ),
    ],
    ids=lambda x: " ".join(x) if isinstance(x, list) else x,
)
def test_out_of_range_numbers_are_usage_errors(args, option):
    """They were accepted: --steps -5 trained nothing and reported success, --batch-size 0
    trained with 8, verify --steps 0 reported MATCH having compared nothing."""
    proc = run(*args, check=False)
    assert proc.returncode == 2, proc.stderr
    assert f"argument {option}: must be" in proc.stderr


def test_plan_auto_searches_under_an_expert_skew(tmp_path):
    """``--expert-skew`` reaches the joint search (its own cached table: the skew is part
    of the key); on a plan it does not steer (train without --plan auto), a clear error."""
    env = {"JSCALER_CACHE_DIR": str(tmp_path)}
    argv = ["plan", "--model", "moe-tiny-dropless", "--devices", "2", "--auto", "--json"]
    for skew in ("1", "4"):
        data = json.loads(run(*argv, "--expert-skew", skew, env=env).stdout)
        assert data["plans"][0]["plan"].startswith("auto: "), data
    assert len(list(tmp_path.glob("plans/auto-*.json"))) == 2
    bad = run("train", "--model", "moe-tiny", "--plan", "dp", "--expert-skew", "2",
              "--steps", "1", check=False)  # fmt: skip
    assert bad.returncode == 2, bad.stderr
    assert "--expert-skew 2 steers the search of --plan auto" in bad.stderr


def test_an_error_jscaler_does_not_check_for_exits_3_not_verifys_mismatch(tmp_path):
    factory = tmp_path / "boom.py"
    factory.write_text("def factory():\n    raise RuntimeError('boom')\n")
    proc = run("verify", "--model", f"{factory}:factory", "--plan", "dp", check=False)
    assert proc.returncode == 3, proc.stderr
    assert "jscaler verify: unexpected error: RuntimeError: boom" in proc.stderr
    assert "Traceback" not in proc.stderr and "--traceback" in proc.stderr
    shown = run(
        "verify", "--model", f"{factory}:factory", "--plan", "dp", "--traceback", check=False
    )
    assert shown.returncode == 3 and "Traceback" in shown.stderr and "boom.py" in shown.stderr


def test_viz_writes_into_a_folder_it_creates(tmp_path):
    out = tmp_path / "a" / "b" / "s.png"  # was a raw FileNotFoundError
    run(
        "viz",
        "--schedule",
        "one_f_one_b",
        "--stages",
        "2",
        "--microbatches",
        "4",
        "--out",
        str(out),
    )
    assert out.stat().st_size > 1000


def test_inspect_select_matching_nothing_says_so():
    proc = run("inspect", "--model", "gpt-tiny", "--select", "nothing/*", check=False)
    assert proc.returncode == 2, proc.stderr
    assert "--select 'nothing/*' matches no op's module path" in proc.stderr
    assert "blocks/0" in proc.stderr


def test_a_skipped_checkpoint_is_reported_once(tmp_path):
    import orbax.checkpoint as ocp

    (tmp_path / f"7{ocp.path.step.TMP_DIR_SUFFIX}1234").mkdir()  # a killed save
    proc = run(
        "train", "--model", "mlp-tiny", "--steps", "1", "--checkpoint-dir", str(tmp_path),
        "--resume",
    )  # fmt: skip
    assert proc.stderr.count("skipping checkpoint") == 1, proc.stderr
