"""``jscaler bench gpu``: the benchmark itself, on CPU (its figures need a GPU)."""

from types import SimpleNamespace

import pytest

import jscaler
from bench import gpu


@pytest.mark.parametrize(
    "kind,preset",
    [
        ("NVIDIA H200", "h200"),
        ("NVIDIA H100 80GB HBM3", "h100_sxm"),
        ("NVIDIA A100-SXM4-80GB", "a100_80g"),
        ("Tesla V100-SXM2-32GB", "dgx2_v100"),
    ],
)
def test_a_gpu_is_predicted_on_its_preset(kind, preset):
    assert gpu.cluster_of(SimpleNamespace(platform="gpu", device_kind=kind)) == preset


def test_an_unknown_gpu_asks_for_a_cluster():
    with pytest.raises(jscaler.PlanError, match="--cluster"):
        gpu.cluster_of(SimpleNamespace(platform="gpu", device_kind="Some Accelerator 9000"))


def test_a_case_is_measured_beside_its_prediction():
    row = gpu.measure("gpt-tiny", 8, "dp", "cpu", steps=2)
    assert row.step_ms > 0 and row.predicted_ms > 0 and row.compile_s > 0
    assert abs(row.memory_error) < 0.25, row  # XLA:CPU's memory, the model tuned to it
    line = gpu.table([row])[-1]
    assert line.startswith("gpt-tiny") and f"{row.memory_error:+.0%}" in line
