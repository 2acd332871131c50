"""Schedules drawn as timelines: ``jscaler.report.plot`` writes a PNG, ``jscaler viz`` prints
the bubble beside (p-1)/(m+p-1). No JAX compilation: only the schedule is simulated."""

import matplotlib.image
import pytest

import jscaler
from jscaler.cli import main
from jscaler.report.plot import DPI, figure, plot
from schedules import gpipe, interleaved_1f1b, one_f_one_b, three_f_one_b, zero_bubble

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"

SCHEDULES = {
    "gpipe": lambda: gpipe(4, 8),
    "one_f_one_b": lambda: one_f_one_b(4, 8),
    "zero_bubble": lambda: zero_bubble(4, 8),
    "interleaved": lambda: interleaved_1f1b(4, 8, chunks=2),
    "three_f_one_b": lambda: three_f_one_b(2, 4),
}


def _png_size(path) -> tuple[int, int]:
    """(height, width) in pixels, as matplotlib reads the file back."""
    data = path.read_bytes()
    assert data[:8] == PNG_SIGNATURE
    return matplotlib.image.imread(path).shape[:2]


@pytest.mark.parametrize("name", sorted(SCHEDULES))
def test_plot_writes_a_png_one_row_per_group(name, tmp_path):
    schedule = SCHEDULES[name]()
    path = tmp_path / f"{name}.png"
    timeline = plot(schedule, path)
    assert path.stat().st_size > 1000
    height, width = _png_size(path)
    fig = figure(timeline)
    want_w, want_h = (round(x * DPI) for x in fig.get_size_inches())
    assert abs(width - want_w) <= 2 and abs(height - want_h) <= 2
    assert 300 <= width <= 3000 and 150 <= height <= 1000
    assert width > height  # time runs across, groups down


@pytest.mark.parametrize("name", sorted(SCHEDULES))
def test_plot_returns_the_simulated_timeline(name, tmp_path):
    schedule = SCHEDULES[name]()
    timeline = plot(schedule, tmp_path / "t.png")
    want = jscaler.simulate(schedule)
    assert timeline.bubble() == pytest.approx(want.bubble())
    assert timeline.spans == want.spans and timeline.makespan == want.makespan


def test_plot_with_costs_times_as_simulate_does(tmp_path):
    cost = {"F": 1.0, "B": 3.0, "W": 1.0, "R": 1.0}
    timeline = plot(one_f_one_b(3, 5), tmp_path / "c.png", cost=cost)
    assert timeline.spans == jscaler.simulate(one_f_one_b(3, 5), cost).spans
    assert (tmp_path / "c.png").read_bytes()[:8] == PNG_SIGNATURE


def test_figure_draws_one_box_per_block_and_names_the_bubble():
    timeline = jscaler.simulate(one_f_one_b(4, 8))
    ax = figure(timeline).axes[0]
    assert len(ax.patches) == sum(len(g) for g in timeline.schedule.groups)
    assert ax.get_title(loc="left") == "one_f_one_b: 4 groups, 8 micro-batches, bubble 27.3%"
    assert [t.get_text() for t in ax.get_yticklabels()] == [f"group {g}" for g in range(4)]
    labels = {t.get_text() for t in ax.texts}
    assert {"F0.0", "B3.7"} <= labels
    assert [t.get_text() for t in ax.get_legend().get_texts()] == ["F forward", "B backward"]


def test_cli_viz_prints_the_bubble_and_writes_the_png(tmp_path, capsys):
    path = tmp_path / "1f1b.png"
    argv = ["viz", "--schedule", "one_f_one_b", "--stages", "4", "--microbatches", "8"]
    assert main([*argv, "--out", str(path)]) == 0
    out = capsys.readouterr().out
    assert path.read_bytes()[:8] == PNG_SIGNATURE
    assert "one_f_one_b" in out
    assert "bubble 27.3%" in out and "(p-1)/(m+p-1) = 3/11 = 27.3%" in out
    assert "activations in flight per stage: 4, 3, 2, 1" in out
    assert f"wrote {path}" in out


def test_cli_viz_interleaved_with_arguments(tmp_path, capsys):
    path = tmp_path / "il.png"
    argv = ["viz", "--schedule", "interleaved_1f1b(chunks=2)", "--stages", "4"]
    assert main([*argv, "--microbatches", "8", "--out", str(path)]) == 0
    out = capsys.readouterr().out
    assert "interleaved_1f1b(chunks=2): 8 stages on 4 device groups" in out
    assert "bubble 15.8%" in out and "(p-1)/(m+p-1)" not in out
    assert path.exists()


def test_cli_viz_reports_a_bad_schedule(tmp_path, capsys):
    argv = ["viz", "--schedule", "interleaved_1f1b", "--stages", "4", "--microbatches", "6"]
    assert main([*argv, "--out", str(tmp_path / "x.png")]) == 2
    assert "multiple of 4" in capsys.readouterr().err
    assert not (tmp_path / "x.png").exists()


# plan mode: a plan's step and memory per device as the cost model predicts them


def _estimate(plan: dict, cluster=None):
    """The estimate ``jscaler viz --model gpt-tiny --plan "megatron(**plan)"`` draws: Adam,
    and a pipeline's 2*pp micro-batches of the model's batch size, as the command takes."""
    import optax

    import models
    from spaces import megatron

    spec = models.get("gpt-tiny")
    m = 2 * plan["pp"] if plan.get("pp", 1) > 1 else 1
    batch = spec.batch(spec.batch_size * m, 0)
    trainer = jscaler.parallelize(
        spec.init(0), spec.loss, optax.adam(1e-3), batch, devices=8, plan=megatron(**plan),
        microbatches=m, cluster=cluster,
    )  # fmt: skip
    return trainer.estimate()


def _printed(out: str, what: str) -> dict[str, float]:
    """``name value`` pairs of the summary line starting with ``what``."""
    line = next(ln for ln in out.splitlines() if ln.startswith(what))
    body = line.split(": ", 1)[1]
    pairs = [p.strip().split(" ") for p in body.replace(";", ",").split(",")]
    return {p[0]: float(p[1]) for p in pairs if len(p) >= 2 and p[1][:1].isdigit()}


def test_cli_viz_plan_writes_both_pngs_and_prints_the_estimate(tmp_path, capsys):
    argv = ["viz", "--model", "gpt-tiny", "--plan", "megatron(tp=2, dp=4)"]
    assert main([*argv, "--out", str(tmp_path / "v")]) == 0
    out = capsys.readouterr().out
    for name in ("timeline.png", "memory.png"):
        path = tmp_path / "v" / name
        assert path.stat().st_size > 1000
        height, width = _png_size(path)
        assert width > 300 and height > 200
    assert f"wrote {tmp_path / 'v' / 'timeline.png'} and {tmp_path / 'v' / 'memory.png'}" in out
    est = _estimate({"tp": 2, "dp": 4})
    assert f"predicted step {est.step_time * 1e3:.3f} ms" in out
    assert "memory per device (MiB, Adam" in out
    printed = _printed(out, "memory per device")
    for part in ("params", "optimizer", "batch", "grads", "activations"):
        assert printed[part] == pytest.approx(est.memory[part] / 2**20, abs=5e-4), part
    assert printed["peak"] == pytest.approx(est.memory["total"] / 2**20, abs=5e-4)
    assert est.memory["optimizer"] == 2 * est.memory["params"]  # Adam's two moments


def test_cli_viz_a_pipeline_plan_shows_its_fullest_device_and_the_capacity(tmp_path, capsys):
    argv = ["viz", "--model", "gpt-tiny", "--plan", "megatron(pp=2, dp=4)"]
    assert main([*argv, "--cluster", "a100_80g", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "one_f_one_b, 4 micro-batches" in out and "bubble" in out
    est = _estimate({"pp": 2, "dp": 4}, "a100_80g")
    assert max(m["total"] for m in est.device_memory.values()) == est.memory["total"]
    assert len(est.device_memory) == 8
    printed = _printed(out, "memory per device")
    assert printed["peak"] == pytest.approx(est.memory["total"] / 2**20, abs=5e-4)
    assert "of 80 GiB" in out
    assert (tmp_path / "memory.png").read_bytes()[:8] == PNG_SIGNATURE
    assert (tmp_path / "timeline.png").read_bytes()[:8] == PNG_SIGNATURE


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        ([], "nothing to draw"),
        (["--model", "gpt-tiny", "--plan", "dp", "--stages", "2"], "--stages is schedule mode's"),
        (["--schedule", "gpipe", "--stages", "2", "--cluster", "cpu"], "but --cluster is plan"),
        (["--plan", "dp"], "plan mode needs --model"),
        (["--model", "gpt-tiny"], "plan mode needs --plan"),
        (["--schedule", "gpipe", "--stages", "2"], "schedule mode needs --microbatches"),
    ],
)
def test_cli_viz_mixing_the_modes_is_a_usage_error(argv, message, tmp_path, capsys):
    assert main(["viz", *argv, "--out", str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err
    assert message in err and "--model M --plan P" in err
    assert not (tmp_path / "x").exists()
