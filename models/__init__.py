"""Reference models and the registry the CLI resolves ``--model NAME`` against.

Each entry is a :class:`ModelSpec`: how to build the model (or its params) from a seed,
its loss, and a deterministic synthetic batch. The models themselves are plain Flax (or
plain JAX) and know nothing about jscaler. Large entries are registered here but only
built when asked for; building one allocates its full parameters (use ``gpt.num_params``
to size one without allocating).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from flax import nnx

from models import convnet, gpt, mlp, recycler

__all__ = ["ModelSpec", "UnknownModelError", "from_factory", "get", "gpt_spec", "names"]


@dataclass(frozen=True)
class ModelSpec:
    """A registered model: everything a driver needs to train it on synthetic data.

    Attributes:
        name: Registry name, such as ``"gpt-tiny"``.
        kind: ``"nnx"`` (``init`` returns an nnx Module), ``"linen"`` or ``"params"``
            (``init`` returns a params pytree).
        init: ``seed -> model`` (nnx) or ``seed -> params``.
        loss: ``loss(model_or_params, batch) -> scalar``.
        batch: ``(batch_size, seed) -> batch`` pytree, deterministic in ``seed``.
        batch_size: Default global batch size for demos and tests (divisible by 8).
        description: One line for listings.
    """

    name: str
    kind: str
    init: Callable[[int], Any]
    loss: Callable[[Any, Any], Any]
    batch: Callable[[int, int], Any]
    batch_size: int
    description: str


class UnknownModelError(KeyError):
    """Raised by :func:`get` for a name that is not registered."""

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0]) if self.args else ""


def gpt_spec(name: str, cfg: gpt.GPTConfig, batch_size: int, what: str) -> ModelSpec:
    """The spec of a :class:`models.gpt.GPT` of config ``cfg`` named ``name`` (``what``
    describes it), trained at ``batch_size`` on synthetic token batches."""
    return ModelSpec(
        name=name,
        kind="nnx",
        init=lambda seed: gpt.GPT(cfg, rngs=nnx.Rngs(seed)),
        loss=gpt.loss,
        batch=lambda size, seed: gpt.synthetic_batch(cfg, size, seed),
        batch_size=batch_size,
        description=(
            f"{what}: {cfg.n_layers} layers, d_model {cfg.d_model}, "
            f"{cfg.n_heads} heads, seq {cfg.seq_len}, vocab {cfg.vocab_size}"
        ),
    )


def _lazy(
    module: str, name: str, make: str, batch_size: int, description: str, config: str = "tiny"
) -> ModelSpec:
    """An nnx model whose module is imported on first use: ``models.<module>`` provides
    the config function ``config``, the class ``make``, ``loss`` and
    ``synthetic_batch(cfg, size, seed)``."""

    def mod():
        return importlib.import_module(f"models.{module}")

    return ModelSpec(
        name=name,
        kind="nnx",
        init=lambda seed: getattr(mod(), make)(getattr(mod(), config)(), rngs=nnx.Rngs(seed)),
        loss=lambda model, batch: mod().loss(model, batch),
        batch=lambda size, seed: mod().synthetic_batch(getattr(mod(), config)(), size, seed),
        batch_size=batch_size,
        description=description,
    )


MOE = "mixture-of-experts decoder: 2 layers, 4 experts, top-2"
MOE_SMALL = "mixture-of-experts decoder for benchmarks: 4 layers, d_model 512, 8 experts, top-2"


def _build() -> dict[str, ModelSpec]:
    conv_cfg, mlp_cfg, rec_cfg = convnet.tiny(), mlp.tiny(), recycler.tiny()
    specs = [
        gpt_spec("gpt-tiny", gpt.tiny(), 8, "Llama-style decoder for tests"),
        gpt_spec("gpt-small", gpt.small(), 16, "Llama-style decoder for benchmarks"),
        gpt_spec(
            "gpt-tiny-scan",
            gpt.tiny().replace(scan_layers=True),
            8,
            "gpt-tiny with its blocks stacked and run by nnx.scan",
        ),
        gpt_spec(
            "gpt-tiny-scan-remat",
            gpt.tiny().replace(scan_layers=True, remat=True),
            8,
            "gpt-tiny-scan with nnx.remat around each block inside the scan",
        ),
        gpt_spec("gpt-1.3b", gpt.gpt_1_3b(), 8, "Llama-style decoder, GPT-3 XL shape"),
        gpt_spec("llama-7b", gpt.llama_7b(), 8, "Llama-7B shape"),
        gpt_spec("llama-13b", gpt.llama_13b(), 8, "Llama-13B shape"),
        ModelSpec(
            name="convnet-tiny",
            kind="linen",
            init=lambda seed: convnet.init(conv_cfg, seed),
            loss=convnet.make_loss(conv_cfg),
            batch=lambda size, seed: convnet.synthetic_batch(conv_cfg, size, seed),
            batch_size=16,
            description="linen conv net (GroupNorm) on 16x16x3 images, 10 classes",
        ),
        ModelSpec(
            name="mlp-tiny",
            kind="params",
            init=lambda seed: mlp.init(mlp_cfg, seed),
            loss=mlp.loss,
            batch=lambda size, seed: mlp.synthetic_batch(mlp_cfg, size, seed),
            batch_size=16,
            description="plain-JAX tanh MLP 32-64-64-8 regressing a random teacher",
        ),
        ModelSpec(
            name="recycler-tiny",
            kind="nnx",
            init=lambda seed: recycler.Recycler(rec_cfg, rngs=nnx.Rngs(seed)),
            loss=recycler.loss,
            batch=lambda size, seed: recycler.synthetic_batch(rec_cfg, size, seed),
            batch_size=8,
            description=(
                f"residual MLP trunk run {rec_cfg.passes} times per step (AlphaFold2-style "
                f"recycling, earlier passes under stop_gradient): for 3F1B"
            ),
        ),
        _lazy("swin", "swin-tiny", "Swin", 8, "Swin Transformer, shifted windows, 4 stages"),
        _lazy(
            "swin",
            "swin-bench",
            "Swin",
            8,
            "Swin at 64x64, 8x8 windows: activations dominate (coshard bench)",
            config="bench",
        ),
        _lazy("t5", "t5-tiny", "T5", 8, "T5 encoder-decoder, relative buckets, tied embedding"),
        _lazy("moe", "moe-tiny", "MoEDecoder", 8, MOE + ", capacity dispatch (tests)"),
        _lazy(
            "moe",
            "moe-tiny-dropless",
            "MoEDecoder",
            8,
            MOE + ", dropless ragged_dot dispatch (tests)",
            config="tiny_dropless",
        ),
        _lazy("moe", "moe-small", "MoEDecoder", 16, MOE_SMALL + ", capacity", config="small"),
        _lazy(
            "moe",
            "moe-small-dropless",
            "MoEDecoder",
            16,
            MOE_SMALL + ", dropless",
            config="small_dropless",
        ),
        _lazy(
            "moe",
            "mixtral-8x7b",
            "MoEDecoder",
            8,
            "MoE decoder, Mixtral-8x7B shape: 32 layers, 8 experts, top-2 (cost model)",
            config="mixtral_8x7b",
        ),
        _lazy(
            "alphafold2",
            "alphafold2-tiny",
            "AlphaFold2",
            8,
            "AlphaFold2: Evoformer + structure head, 3 recycling passes",
        ),
    ]
    return {spec.name: spec for spec in specs}


_REGISTRY: dict[str, ModelSpec] = _build()


def names() -> list[str]:
    """The registered model names, in registration order."""
    return list(_REGISTRY)


def from_factory(expr: str) -> ModelSpec:
    """A model of your own: ``"package.module:factory"`` or ``"path/to/file.py:factory"``.

    ``factory()`` returns ``(model_or_params, loss, batch)``: an nnx Module or a params
    pytree, ``loss(model_or_params, batch) -> scalar``, and an example batch (every step
    of a synthetic run reuses it). The module is imported with the working directory on
    ``sys.path``, as ``python -m`` would.

    Raises:
        UnknownModelError: the module or the factory cannot be found, or the factory does
            not return the three parts.
    """
    import importlib.util
    import os
    import sys

    module_name, _, fn_name = expr.rpartition(":")
    if not module_name or not fn_name:
        raise UnknownModelError(
            f"--model {expr!r}: expected a registered name or 'package.module:factory' / "
            f"'file.py:factory'; known names: {', '.join(names())}"
        )
    try:
        if module_name.endswith(".py"):
            spec = importlib.util.spec_from_file_location(
                os.path.basename(module_name)[:-3], module_name
            )
            if spec is None or not os.path.isfile(module_name):
                raise FileNotFoundError(module_name)
            module = importlib.util.module_from_spec(spec)
            sys.modules[spec.name] = module  # dataclasses (equinox modules) look it up
            spec.loader.exec_module(module)
        else:
            if os.getcwd() not in sys.path:
                sys.path.insert(0, os.getcwd())
            module = importlib.import_module(module_name)
    except (ImportError, FileNotFoundError) as e:
        raise UnknownModelError(f"--model {expr!r}: cannot import {module_name!r} ({e})") from None
    factory = getattr(module, fn_name, None)
    if not callable(factory):
        raise UnknownModelError(f"--model {expr!r}: {module_name} has no function {fn_name!r}")
    built = factory()
    if not isinstance(built, tuple) or len(built) != 3 or not callable(built[1]):
        raise UnknownModelError(
            f"--model {expr!r}: {fn_name}() must return (model_or_params, loss, batch); it "
            f"returned {type(built).__name__}"
        )
    model, loss, example = built
    import jax

    size = int(jax.tree_util.tree_leaves(example)[0].shape[0])

    def batch(n, seed):
        if n != size:
            raise UnknownModelError(
                f"--model {expr!r} comes with a batch of {size} rows; got --batch-size {n}"
            )
        return example

    return ModelSpec(
        name=expr,
        kind="nnx" if isinstance(model, nnx.Module) else "params",
        init=lambda seed: model,
        loss=loss,
        batch=batch,
        batch_size=size,
        description=f"{fn_name} from {module_name}",
    )


def get(name: str) -> ModelSpec:
    """The :class:`ModelSpec` registered as ``name``, or a factory's (:func:`from_factory`)
    for ``"module:factory"``.

    Raises:
        UnknownModelError: (a ``KeyError``) when ``name`` is not registered; the message
            lists the known names.
    """
    if ":" in name and name not in _REGISTRY:
        return from_factory(name)
    try:
        return _REGISTRY[name]
    except KeyError:
        known = ", ".join(names())
        raise UnknownModelError(f"unknown model {name!r}; known models: {known}") from None
