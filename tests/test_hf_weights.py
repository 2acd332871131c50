"""Hugging Face weights in and out: a safetensors checkpoint loaded into a trainer under a
plan, each device reading only its own slices; a training checkpoint exported back to
safetensors that ``transformers``' own Flax loader reads (its PyTorch-name conversion,
not ours); the export read back in equal to the trainer's weights.

Weights in come both ways: ``save_pretrained(safe_serialization=True)`` (Flax names,
written by transformers) and :func:`safetensors_io.write` (PyTorch names, the Hub's
convention, held to transformers' reader below).
"""

import json
import re

import jax
import numpy as np
import optax
import pytest
import transformers as hf
from flax.traverse_util import flatten_dict

import jscaler
from jscaler.runtime import checkpoint, safetensors_io
from spaces import megatron

hf.logging.set_verbosity_error()

B, S, VOCAB = 8, 16, 128


def _gpt2(seed, n_embd=32):
    cfg = hf.GPT2Config(vocab_size=VOCAB, n_positions=S, n_embd=n_embd, n_layer=2, n_head=4)
    return hf.FlaxGPT2LMHeadModel(cfg, seed=seed)


def _llama(seed):
    cfg = hf.LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=S,
    )  # fmt: skip
    return hf.FlaxLlamaForCausalLM(cfg, seed=seed)


MODELS = {"gpt2": (_gpt2, hf.FlaxGPT2LMHeadModel), "llama": (_llama, hf.FlaxLlamaForCausalLM)}


def _loss(model):
    def loss(params, batch):
        logits = model(batch["ids"], params=params).logits
        return optax.softmax_cross_entropy_with_integer_labels(
            logits[:, :-1], batch["ids"][:, 1:]
        ).mean()

    return loss


def _batch(k):
    return {"ids": jax.random.randint(jax.random.key(k), (B, S), 0, VOCAB)}


def _flat(params) -> dict:
    return {"/".join(k): np.asarray(v) for k, v in flatten_dict(params).items()}


def _trainer(model, plan=None, devices=8, microbatches=1):
    return jscaler.parallelize(
        model.params, _loss(model), optax.sgd(0.1), _batch(0), devices=devices,
        plan=plan or megatron(tp=2, dp=4), microbatches=microbatches,
    )  # fmt: skip


def _equal(got: dict, want: dict):
    assert set(got) == set(want)
    for k in want:
        np.testing.assert_array_equal(np.asarray(got[k]), np.asarray(want[k]), err_msg=k)


def test_hf_name_follows_transformers_pytorch_convention():
    assert safetensors_io.hf_name("transformer/h/0/mlp/c_fc/kernel", 2) == (
        "transformer.h.0.mlp.c_fc.weight",
        (1, 0),
    )
    assert safetensors_io.hf_name("transformer/ln_f/scale", 1) == ("transformer.ln_f.weight", None)
    assert safetensors_io.hf_name("transformer/wte/embedding", 2) == (
        "transformer.wte.weight",
        None,
    )
    assert safetensors_io.hf_name("model/norm/weight", 1) == ("model.norm.weight", None)
    # a conv kernel (kh, kw, in, out) is PyTorch's (out, in, kh, kw)
    assert safetensors_io.hf_name("embedder/conv/kernel", 4)[1] == (2, 3, 1, 0)


def test_a_conv_kernel_round_trips_through_the_pytorch_layout(tmp_path):
    kernel = np.arange(3 * 5 * 2 * 4, dtype=np.float32).reshape(3, 5, 2, 4)
    safetensors_io.write(tmp_path, {"conv/kernel": kernel}, None)
    from safetensors.numpy import load_file

    assert load_file(tmp_path / "model.safetensors")["conv.weight"].shape == (4, 2, 3, 5)
    mesh = jax.make_mesh((2, 4), ("a", "b"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(None, None, "a", "b"))
    like = [jax.ShapeDtypeStruct(kernel.shape, kernel.dtype)]
    (got,), report = safetensors_io.read(tmp_path, ["conv/kernel"], like, [sharding])
    np.testing.assert_array_equal(np.asarray(got), kernel)
    assert report.format == "pt" and report.tensors == 1
    assert set(report.bytes_per_device.values()) == {kernel.nbytes // 8}  # its eighth each


@pytest.mark.parametrize("plan", ["megatron(tp=2, dp=4)", "megatron(pp=2, dp=2)"])
def test_init_from_gives_each_device_only_its_slices(plan, tmp_path):
    source = _gpt2(seed=1)
    source.save_pretrained(tmp_path, safe_serialization=True)  # transformers' Flax names
    if plan.startswith("megatron(pp"):  # a pipeline: each stage's devices read its layers
        trainer = _trainer(_gpt2(seed=0), megatron(pp=2, dp=2), devices=4, microbatches=2)
    else:
        trainer = _trainer(_gpt2(seed=0))
    report = trainer.load_safetensors(tmp_path)
    _equal(_flat(trainer.params), _flat(source.params))
    assert report.format == "flax" and report.tensors == len(_flat(source.params))
    # each device was given exactly the bytes of the shards it keeps, not whole tensors
    kept = {}
    for p in trainer.state.params:
        for shard in p.addressable_shards:
            kept[shard.device] = kept.get(shard.device, 0) + shard.data.nbytes
    assert report.bytes_per_device == kept
    whole = sum(v.nbytes for v in _flat(source.params).values())
    assert max(kept.values()) < whole  # tp splits some of them; pp puts layers apart
    # the optimizer starts from the loaded weights, and the first loss is theirs
    loss = trainer.step(_batch(1))["loss"]
    np.testing.assert_allclose(loss, _loss(source)(source.params, _batch(1)), rtol=1e-5)


@pytest.mark.parametrize("name", sorted(MODELS))
def test_weights_in_train_export_reload(name, tmp_path):
    make, cls = MODELS[name]
    source = make(seed=1)
    # weights in, under PyTorch names (the Hub's convention), with the model's config
    safetensors_io.write(tmp_path / "in", _flat(source.params), None)
    source.config.to_json_file(tmp_path / "in" / "config.json")
    trainer = _trainer(make(seed=0))
    report = trainer.load_safetensors(tmp_path / "in")
    assert report.format == "pt" and not report.unused
    _equal(_flat(trainer.params), _flat(source.params))
    for k in range(2):
        trainer.step(_batch(k))
    trainer.save(tmp_path / "ck")
    # export: what `jscaler export` does, read with transformers' own loader
    step, params = checkpoint.read_params(tmp_path / "ck")
    assert step == 2
    safetensors_io.write(tmp_path / "out", params, tmp_path / "in")
    loaded = cls.from_pretrained(tmp_path / "out")
    trained = _flat(trainer.export())
    _equal(_flat(loaded.params), trained)
    assert json.loads((tmp_path / "out" / "config.json").read_text())["vocab_size"] == VOCAB
    # reload: the export into a new trainer equals the trainer's weights
    again = _trainer(make(seed=2))
    again.load_safetensors(tmp_path / "out")
    _equal(_flat(again.params), trained)


def test_a_model_of_another_shape_is_refused_naming_the_parameter(tmp_path):
    _gpt2(seed=1, n_embd=64).save_pretrained(tmp_path, safe_serialization=True)
    trainer = _trainer(_gpt2(seed=0))
    expected = (
        "parameter 'transformer/h/0/attn/c_attn/bias' ('transformer.h.0.attn.c_attn.bias') "
        "is [192] in the checkpoint and [96] in the model"
    )
    with pytest.raises(jscaler.CheckpointError, match=re.escape(expected)):
        trainer.load_safetensors(tmp_path)
    with pytest.raises(jscaler.CheckpointError, match="expected a Hugging Face checkpoint"):
        trainer.load_safetensors(tmp_path / "missing")


def test_a_missing_tensor_is_named_with_the_key_looked_for(tmp_path):
    params = _flat(_gpt2(seed=1).params)
    del params["transformer/ln_f/scale"]
    safetensors_io.write(tmp_path, params, None)
    with pytest.raises(jscaler.CheckpointError, match=r"'transformer\.ln_f\.weight'"):
        _trainer(_gpt2(seed=0)).load_safetensors(tmp_path)


def test_the_commands_name_what_is_missing(tmp_path):
    from test_cli import run

    proc = run("export", "--checkpoint-dir", str(tmp_path / "none"), "--out", str(tmp_path / "o"),
               check=False)  # fmt: skip
    assert proc.returncode == 2 and "no usable checkpoint in" in proc.stderr
    proc = run("train", "--model", "mlp-tiny", "--init-from", str(tmp_path), check=False)
    assert proc.returncode == 2 and "expected a Hugging Face checkpoint folder" in proc.stderr
    assert "plan " not in proc.stdout  # refused before the model is built
