"""The Swin Transformer reference model (models/swin.py): its shifted windows, its
parameter count, its traced graph, and training under jscaler plans equal to one device.

The parity cases train 3 SGD steps on 8 simulated devices and compare loss, gradients and
updated parameters with the single-device reference (tests/parity.py).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jscaler
import models
from models import swin
from schedules import one_f_one_b
from spaces import coshard, dp, megatron, zero

from parity import assert_parity

CFG = swin.tiny()


def tiny_model(seed: int = 0) -> swin.Swin:
    return swin.Swin(CFG, rngs=nnx.Rngs(seed))


def param_count(model: nnx.Module) -> int:
    return sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))


# ---- configuration --------------------------------------------------------------------


def test_tiny_layout_windows_and_shifts():
    assert CFG.resolutions == (16, 8, 4, 2) and CFG.dims == (32, 64, 128, 256)
    # stages 3 and 4 fit in one window: it is the whole resolution and never shifts
    assert CFG.block_layout() == [
        (0, 4, 0), (0, 4, 2), (1, 4, 0), (1, 4, 2), (2, 4, 0), (2, 4, 0), (3, 2, 0), (3, 2, 0),
    ]  # fmt: skip
    model = tiny_model()
    assert len(model.blocks) == 8 and len(model.merges) == 3
    assert [b.shift for b in model.blocks] == [0, 2, 0, 2, 0, 0, 0, 0]
    assert model.blocks[7].attn.relative_bias.shape == (3 * 3, 32)  # (2w-1)^2 x heads
    assert model.blocks[0].attn.relative_bias.shape == (7 * 7, 4)


def test_heads_and_hidden_widths_split_for_tensor_parallelism():
    for dim, heads in zip(CFG.dims, CFG.num_heads):
        assert heads % 4 == 0 and dim % heads == 0 and (CFG.mlp_ratio * dim) % 8 == 0


@pytest.mark.parametrize(
    "changes, match",
    [
        ({"image_size": 33}, "divisible by patch_size"),
        ({"num_heads": (3, 8, 16, 32)}, "does not divide"),
        ({"depths": (2, 2, 2)}, "same length"),
        ({"window_size": 3}, "not divisible by window_size"),
        ({"image_size": 24, "window_size": 12}, "odd resolution"),
        ({"embed_dim": 0}, "embed_dim"),
    ],
)
def test_config_validation(changes, match):
    with pytest.raises(ValueError, match=match):
        CFG.replace(**changes)


# ---- parameters -----------------------------------------------------------------------


def test_num_params_matches_the_built_model():
    assert swin.num_params(CFG) == param_count(tiny_model())


def test_num_params_of_larger_configs_without_allocating():
    cfg = swin.swin_tiny_224()
    model = nnx.eval_shape(lambda: swin.Swin(cfg, rngs=nnx.Rngs(0)))  # abstract: no arrays
    leaves = jax.tree.leaves(nnx.state(model, nnx.Param))
    assert swin.num_params(cfg) == sum(int(np.prod(x.shape)) for x in leaves)
    # Swin-T has 28,288,354 parameters; this one drops the key bias of its 12 blocks
    key_biases = 2 * 96 + 2 * 192 + 6 * 384 + 2 * 768
    assert swin.num_params(cfg) == 28_288_354 - key_biases
    paper = (swin.paper_4gpu, swin.paper_8gpu, swin.paper_16gpu, swin.paper_32gpu)
    sizes = [swin.num_params(make()) for make in paper]  # configs only, never built
    assert sizes == sorted(sizes) and 1.5e9 < sizes[0] and sizes[-1] < 3e10
    assert [make().depths for make in paper] == [(2, 2, n - 6, 2) for n in (32, 40, 48, 56)]


# ---- windows, shifts and the relative position bias ------------------------------------


def _reference_segments(res: int, w: int, s: int) -> np.ndarray:
    """The official implementation's shifted-window image mask, in numpy."""
    img = np.zeros((res, res))
    cnt = 0
    for hs in (slice(0, -w), slice(-w, -s), slice(-s, None)):
        for ws in (slice(0, -w), slice(-w, -s), slice(-s, None)):
            img[hs, ws] = cnt
            cnt += 1
    n = res // w
    return img.reshape(n, w, n, w).transpose(0, 2, 1, 3).reshape(n * n, w * w)


def test_shift_mask_blocks_exactly_the_pairs_from_different_segments():
    res, w, s = 16, 4, 2
    seg = _reference_segments(res, w, s)
    mask = swin.shift_window_mask(res, w, s)
    np.testing.assert_array_equal(mask, seg[:, :, None] == seg[:, None, :])
    n = res // w  # only windows on the last row or column of windows mix segments
    mixed = [i for i in range(n * n) if i // n == n - 1 or i % n == n - 1]
    assert [i for i in range(n * n) if not mask[i].all()] == mixed
    assert mask[n * n - 1].sum() == 4 * (4 * 4)  # four segments of 2x2 tokens
    assert swin.shift_window_mask(res, w, 0).all()


def test_relative_position_index_matches_the_reference():
    w = 4
    coords = np.stack(np.meshgrid(np.arange(w), np.arange(w), indexing="ij")).reshape(2, -1)
    rel = (coords[:, :, None] - coords[:, None, :]).transpose(1, 2, 0) + (w - 1)
    flat = rel[..., 0] * (2 * w - 1) + rel[..., 1]
    rows, cols = swin.relative_position_index(w)
    np.testing.assert_array_equal(rows * (2 * w - 1) + cols, flat)
    attn = tiny_model().blocks[0].attn
    table = np.asarray(attn.relative_bias[...])
    np.testing.assert_array_equal(attn.position_bias(), table[flat].transpose(2, 0, 1))


def test_window_partition_round_trip_and_merge_order():
    x = jax.random.normal(jax.random.key(0), (2, 8, 8, 3))
    windows = swin.window_partition(x, 4)
    assert windows.shape == (2, 4, 16, 3)
    np.testing.assert_array_equal(windows[:, 1].reshape(2, 4, 4, 3), x[:, :4, 4:])
    np.testing.assert_array_equal(swin.window_reverse(windows, 4, 8, 8), x)
    reference = jnp.concatenate(
        [x[:, 0::2, 0::2], x[:, 1::2, 0::2], x[:, 0::2, 1::2], x[:, 1::2, 1::2]], axis=-1
    )
    np.testing.assert_array_equal(swin.merge_neighbourhoods(x), reference)


def _influence(block, x, query, other) -> float:
    """How much ``block``'s output at token ``query`` moves when token ``other`` does
    (by a random vector: a constant one would vanish in the LayerNorm)."""
    bump = jax.random.normal(jax.random.key(2), (x.shape[-1],))
    bumped = x.at[:, other[0], other[1]].add(bump)
    return float(jnp.max(jnp.abs(block(bumped) - block(x))[:, query[0], query[1]]))


def test_shifted_windows_connect_neighbouring_windows_and_mask_wrapped_tokens():
    model = tiny_model()
    plain, shifted = model.blocks[0], model.blocks[1]
    x = jax.random.normal(jax.random.key(1), (1, 16, 16, CFG.embed_dim))
    # (3,3) and (4,4) lie in different windows of the plain block, in one shifted window
    assert _influence(plain, x, (3, 3), (4, 4)) == 0.0
    assert _influence(shifted, x, (3, 3), (4, 4)) > 1e-5
    # the roll brings (15,15) into the window of (0,0), but from another segment: masked
    assert _influence(shifted, x, (0, 0), (15, 15)) == 0.0
    assert _influence(shifted, x, (0, 0), (1, 1)) > 1e-5  # same segment
    unmasked = nnx.clone(shifted)
    unmasked.attn.shift = 0  # the block still rolls; its attention no longer masks
    assert _influence(unmasked, x, (0, 0), (15, 15)) > 1e-5


# ---- the model as a whole ---------------------------------------------------------------


def test_logits_shape_and_batch_layout():
    batch = swin.synthetic_batch(CFG, 4, seed=3)
    assert batch["images"].shape == (4, 32, 32, 3) and batch["images"].dtype == jnp.float32
    assert batch["labels"].shape == (4,) and batch["labels"].dtype == jnp.int32
    logits = nnx.eval_shape(lambda: tiny_model()(batch["images"]))  # abstract: no compiles
    assert logits.shape == (4, CFG.num_classes) and logits.dtype == jnp.float32
    again = swin.synthetic_batch(CFG, 4, seed=3)
    np.testing.assert_array_equal(batch["images"], again["images"])
    np.testing.assert_array_equal(batch["labels"], again["labels"])
    assert not np.array_equal(batch["images"], swin.synthetic_batch(CFG, 4, seed=4)["images"])
    assert len(np.unique(swin.synthetic_batch(CFG, 64)["labels"])) >= 5  # a real teacher


def test_registry_entry():
    spec = models.get("swin-tiny")
    model, batch = spec.init(0), spec.batch(spec.batch_size, 0)
    assert isinstance(model, swin.Swin) and batch["images"].shape[0] == 8
    assert param_count(model) == swin.num_params(CFG)


def test_trace_is_fully_annotated_and_its_layers_are_the_blocks():
    spec = models.get("swin-tiny")
    graph = jscaler.trace(spec.loss, spec.init(0), spec.batch(spec.batch_size, 0))
    assert graph.coverage() == jscaler.Coverage(ops=1.0, flops=1.0), [
        (o.primitive, o.path) for o in graph.unannotated()
    ]
    names = [layer.name for layer in graph.layers()]
    assert [n for n in names if n.startswith("blocks/")] == [f"blocks/{i}" for i in range(8)]
    assert names == [
        "blocks/0", "blocks/1", "merges/0", "blocks/2", "blocks/3", "merges/1",
        "blocks/4", "blocks/5", "merges/2", "blocks/6", "blocks/7",
    ]  # fmt: skip
    block = graph.layers()[1].graph  # a shifted block: its attention, MLP, norms
    paths = {o.path for o in block.ops}
    assert {"blocks/1/attn/q_proj", "blocks/1/mlp/fc2", "blocks/1/norm1"} <= paths


# ---- parity with one device under jscaler plans ------------------------------------------

PLANS = [
    pytest.param(dp(), id="dp"),
    pytest.param(megatron(tp=2, dp=4), id="megatron-tp2"),
    pytest.param(megatron(tp=4, dp=2), id="megatron-tp4"),
    pytest.param(zero(stage=3), id="zero3"),
    pytest.param(coshard(tp=2, colocate=2), id="coshard"),
]


@pytest.mark.parametrize("plan", PLANS)
def test_parity_with_one_device(plan):
    assert_parity("swin-tiny", plan)


def assert_pipeline_parity(model_name, plan, schedule, m):
    return assert_parity(model_name, plan, microbatches=m, schedule=schedule)


def test_pipeline_1f1b_two_stages_matches_one_device():
    trainer = assert_pipeline_parity("swin-tiny", megatron(pp=2), one_f_one_b, 2)
    names = [{trainer.graph.tensors[t].name for t in st.params} for st in trainer.program.stages]
    assert "patch_embed/kernel" in names[0] and "head/kernel" in names[1]
    blocks = [{n.split("/")[1] for n in s if n.startswith("blocks/")} for s in names]
    assert blocks[0] and blocks[1] and not blocks[0] & blocks[1]
    assert [tuple(g) for g in trainer.program.log.blocks] == [
        tuple(g) for g in trainer.program.schedule.groups
    ]


def test_megatron_splits_heads_and_mlp_features_not_the_residual_stream():
    # the patch embedding and the merges are linear layers writing the residual stream;
    # Megatron's regions are each block's attention heads and MLP hidden features
    from jscaler.plan import DimClasses
    from spaces.megatron import tp_regions, tp_seeds

    spec = models.get("swin-tiny")
    graph = jscaler.trace(spec.loss, spec.init(0), spec.batch(spec.batch_size, 0))
    classes = DimClasses(graph)
    seeds, _ = tp_seeds(graph, classes)
    names = [graph.tensors[t].name for t, _ in seeds]
    assert not any(n.startswith(("patch_embed", "merges")) for n in names), names
    per_block = {}
    for ops, _ in tp_regions(classes, seeds, 2):
        block = ops[0].path.split("/")[:2]
        if block[0] == "blocks":
            per_block.setdefault(block[1], set()).add(ops[0].path.split("/")[2])
    assert per_block == {str(i): {"attn", "mlp"} for i in range(len(per_block))}
    assert len(per_block) == 8
