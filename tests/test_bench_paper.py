"""``jscaler bench paper``'s grids and table (the paper-scale searches run in the bench)."""

import math

import pytest

from bench import paper


@pytest.mark.parametrize("model", paper.MODELS)
@pytest.mark.parametrize("n", paper.GPUS)
def test_every_setting_uses_every_gpu(model, n):
    systems = paper.grid(model, n)
    assert systems["nnScaler"] and "DeepSpeed" in systems
    new = {"swin": "coshard", "t5": "interlaced", "alphafold2": "alphafold_3f1b"}[model]
    assert any(name == new for _, name, _, _ in systems["nnScaler"])
    for settings in systems.values():
        for expr, name, kw, size in settings:
            split = kw.get("tp", 1) * kw.get("pp", 1) * kw.get("dap", 1)
            if name == "alpa_like":  # a stage's devices share its micro-batch
                assert size == n // kw["pp"]
            elif name != "dp":
                assert split * size == n, expr
            assert kw.get("recompute") == 1  # the paper recomputes layer by layer everywhere


def _result(tflops: dict):
    """A cell with one setting per system: ``{system: tflops or None (does not fit)}``."""
    systems, settings = {}, {}
    for system, t in tflops.items():
        expr = f"{system.lower()}()"
        systems[system] = [(expr, system.lower(), {}, 1)]
        x = {"plan": expr, "tflops": t or 1.0, "samples_s": 1.0, "gib": 1.0, "fits": t is not None}
        settings[expr] = {"plan_s": 2.0, "dgx2_v100": x, "dgx1_v100": x}
    return {"model": "swin", "gpus": 32, "systems": systems, "settings": settings}


def test_table_takes_the_best_fitting_setting_and_the_speedups():
    r = _result({"nnScaler": 300.0, "Megatron-LM": 100.0, "DeepSpeed": 150.0, "Alpa": None})
    assert paper.best(r, "Alpa", "dgx2_v100") is None
    lines = paper.table([r], clusters=("dgx2_v100",))
    rows = {line.split()[3]: line for line in lines[2:]}
    assert "2.00x best" in rows["nnScaler"] and "1.5x DeepSpeed" in rows["nnScaler"]
    assert "3.00x" in rows["Megatron-LM"] and "OOM" in rows["Alpa"]
    drop = paper.dgx1_drop([r])
    assert any("+0%" in line and "-82%" in line for line in drop)  # Megatron-LM, the paper's
    assert math.isclose(paper.search_seconds(r, "nnScaler"), 2.0)
