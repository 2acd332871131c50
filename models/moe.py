"""A mixture-of-experts decoder: the Llama-style blocks of :mod:`models.gpt` whose MLPs
are mixture-of-experts layers, written in plain flax.nnx.

Each MoE layer routes every token to ``top_k`` of ``n_experts`` SwiGLU experts:

* **router**: a linear map to one logit per expert, then softmax (Mixtral, Switch) or
  sigmoid (DeepSeek-V3) gating; the top-k gates, optionally normalised to sum to 1;
* **experts**: stacked weights ``w_gate, w_up: [E, d_model, d_ff]``, ``w_down: [E, d_ff,
  d_model]`` (module path ``blocks/<i>/moe/w_gate`` ...);
* **shared expert** (optional): a dense SwiGLU MLP every token also goes through;
* **load-balancing loss** (Switch Transformer): ``E * sum_e f_e * p_e``, with ``f_e`` the
  fraction of routed (token, choice) pairs sent to expert ``e`` and ``p_e`` its mean gate
  probability; the model's loss adds ``aux_loss_coef`` times its mean over layers.

Two dispatch styles, both plain JAX:

* ``"capacity"`` (GShard, Switch): the tokens are dispatched in groups, one sequence each
  (GShard's groups, so a plan that splits the batch splits whole groups and drops the
  same tokens as one device); in each group an expert takes at most ``capacity =
  ceil(capacity_factor * seq_len * top_k / n_experts)`` tokens, filled in order of choice
  then position (every token's first choice before any second choice); one-hot dispatch
  and combine tensors ``[groups, tokens, E, capacity]`` and einsums; a (token, choice)
  over capacity is dropped (its gate contributes nothing).
* ``"dropless"`` (MegaBlocks, MaxText's ``ragged_dot``): the (token, choice) pairs sorted
  by expert, every expert's rows multiplied by its weights with ``jax.lax.ragged_dot``, and
  the results put back in token order; nothing is dropped.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from models import gpt

__all__ = [
    "MoEConfig",
    "tiny",
    "tiny_dropless",
    "small",
    "small_dropless",
    "mixtral_8x7b",
    "CONFIGS",
    "MoE",
    "Block",
    "MoEDecoder",
    "loss",
    "synthetic_batch",
    "expert_load",
    "expert_skew",
]

GATINGS = ("softmax", "sigmoid")
DISPATCHES = ("capacity", "dropless")


@dataclass(frozen=True)
class MoEConfig:
    """Hyper-parameters of the MoE decoder (the attention's are :class:`gpt.GPTConfig`'s).

    Attributes:
        vocab_size, d_model, n_layers, n_heads, seq_len: as in ``GPTConfig``.
        d_ff: Hidden width of one expert (and of the shared expert).
        n_experts: Experts per MoE layer.
        top_k: Experts each token is routed to.
        gating: ``"softmax"`` or ``"sigmoid"``.
        normalize: Rescale a token's top-k gates to sum to 1.
        shared_expert: Add a dense SwiGLU MLP every token goes through.
        dispatch: ``"capacity"`` or ``"dropless"`` (see the module doc).
        capacity_factor: Capacity over a group's even share ``seq_len * top_k / n_experts``.
        aux_loss_coef: Weight of the load-balancing loss in the model's loss.
    """

    vocab_size: int
    d_model: int
    n_layers: int
    n_heads: int
    d_ff: int
    seq_len: int
    n_experts: int = 4
    top_k: int = 2
    gating: str = "softmax"
    normalize: bool = True
    shared_expert: bool = False
    dispatch: str = "capacity"
    capacity_factor: float = 1.25
    aux_loss_coef: float = 0.01
    rope_base: float = 10000.0
    norm_eps: float = 1e-5
    dtype: Any = None  # None: the parameters' (bf16 under a bf16 plan), as in models.gpt
    param_dtype: Any = jnp.float32

    def __post_init__(self) -> None:
        for name in ("n_experts", "top_k"):
            if getattr(self, name) <= 0:
                raise ValueError(f"MoEConfig.{name} must be positive, got {getattr(self, name)}")
        if self.top_k > self.n_experts:
            raise ValueError(
                f"MoEConfig.top_k ({self.top_k}) must be at most n_experts ({self.n_experts})"
            )
        if self.gating not in GATINGS:
            raise ValueError(f"MoEConfig.gating must be one of {GATINGS}, got {self.gating!r}")
        if self.dispatch not in DISPATCHES:
            raise ValueError(
                f"MoEConfig.dispatch must be one of {DISPATCHES}, got {self.dispatch!r}"
            )
        if self.capacity_factor <= 0:
            raise ValueError(
                f"MoEConfig.capacity_factor must be positive, got {self.capacity_factor}"
            )
        self.attention()  # validates the shared fields

    def attention(self) -> gpt.GPTConfig:
        """The config of the dense parts (attention, norms, embedding, shared expert)."""
        return gpt.GPTConfig(
            vocab_size=self.vocab_size,
            d_model=self.d_model,
            n_layers=self.n_layers,
            n_heads=self.n_heads,
            d_ff=self.d_ff,
            seq_len=self.seq_len,
            rope_base=self.rope_base,
            norm_eps=self.norm_eps,
            dtype=self.dtype,
            param_dtype=self.param_dtype,
        )

    def capacity(self, tokens: int) -> int:
        """Tokens one expert takes at most from a group of ``tokens`` (capacity dispatch)."""
        return max(1, math.ceil(self.capacity_factor * tokens * self.top_k / self.n_experts))

    def replace(self, **changes: Any) -> MoEConfig:
        return dataclasses.replace(self, **changes)


def tiny(**changes: Any) -> MoEConfig:
    """A test-sized model: 2 layers, 4 experts of width 64, top-2."""
    cfg = MoEConfig(vocab_size=256, d_model=64, n_layers=2, n_heads=4, d_ff=64, seq_len=32)
    return cfg.replace(**changes)


def tiny_dropless() -> MoEConfig:
    """:func:`tiny` with dropless dispatch."""
    return tiny(dispatch="dropless")


def small(**changes: Any) -> MoEConfig:
    """A benchmark-sized model (~47M parameters, ~21M active): 4 layers, 8 experts, top-2."""
    cfg = MoEConfig(
        vocab_size=8192, d_model=512, n_layers=4, n_heads=8, d_ff=704, seq_len=256, n_experts=8
    )
    return cfg.replace(**changes)


def mixtral_8x7b(**changes: Any) -> MoEConfig:
    """Mixtral-8x7B's shape (for the cost model; multi-head rather than grouped-query
    attention, so ~47B parameters with ~13B active)."""
    cfg = MoEConfig(
        vocab_size=32000,
        d_model=4096,
        n_layers=32,
        n_heads=32,
        d_ff=14336,
        seq_len=4096,
        n_experts=8,
        top_k=2,
        capacity_factor=1.0,
        rope_base=1e6,
    )
    return cfg.replace(**changes)


def small_dropless() -> MoEConfig:
    """:func:`small` with dropless dispatch."""
    return small(dispatch="dropless")


CONFIGS = {
    "tiny": tiny,
    "tiny_dropless": tiny_dropless,
    "small": small,
    "small_dropless": small_dropless,
    "mixtral_8x7b": mixtral_8x7b,
}


def _linear(cfg: MoEConfig, d_in: int, d_out: int, rngs: nnx.Rngs) -> nnx.Linear:
    return nnx.Linear(
        d_in, d_out, use_bias=False, dtype=cfg.dtype, param_dtype=cfg.param_dtype, rngs=rngs
    )


def _experts(cfg: MoEConfig, d_in: int, d_out: int, key: jax.Array) -> nnx.Param:
    """``n_experts`` stacked ``[d_in, d_out]`` kernels, each as ``nnx.Linear`` initialises."""
    init = nnx.initializers.lecun_normal(in_axis=-2, out_axis=-1, batch_axis=(0,))
    return nnx.Param(init(key, (cfg.n_experts, d_in, d_out), cfg.param_dtype))


class MoE(nnx.Module):
    """A mixture-of-experts SwiGLU layer: ``x [batch, seq, d] -> (y, load-balancing loss)``."""

    def __init__(self, cfg: MoEConfig, *, rngs: nnx.Rngs):
        self.cfg = cfg
        dense = cfg.attention()
        self.router = _linear(cfg, cfg.d_model, cfg.n_experts, rngs)
        self.w_gate = _experts(cfg, cfg.d_model, cfg.d_ff, rngs.params())
        self.w_up = _experts(cfg, cfg.d_model, cfg.d_ff, rngs.params())
        self.w_down = _experts(cfg, cfg.d_ff, cfg.d_model, rngs.params())
        self.shared = gpt.MLP(dense, rngs=rngs) if cfg.shared_expert else None

    def route(self, x: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        """``x [tokens, d]`` -> (gates ``[tokens, k]``, experts ``[tokens, k]`` (int32), the
        load-balancing loss)."""
        cfg = self.cfg
        logits = self.router(x).astype(jnp.float32)
        probs = jax.nn.softmax(logits) if cfg.gating == "softmax" else jax.nn.sigmoid(logits)
        gates, experts = jax.lax.top_k(probs, cfg.top_k)
        if cfg.normalize:
            gates = gates / jnp.sum(gates, axis=-1, keepdims=True)
        chosen = jax.nn.one_hot(experts, cfg.n_experts, dtype=jnp.float32).sum(axis=1)
        share = jnp.mean(chosen, axis=0) / cfg.top_k  # f_e: routed pairs per expert
        mean_prob = jnp.mean(probs / jnp.sum(probs, axis=-1, keepdims=True), axis=0)
        aux = cfg.n_experts * jnp.sum(share * mean_prob)
        return gates, experts, aux

    def expert_mlp(self, h: jax.Array) -> jax.Array:
        """The experts on dispatched tokens ``h [E, groups, capacity, d]``."""
        dt = h.dtype
        g = jnp.einsum("egcd,edf->egcf", h, self.w_gate[...].astype(dt))
        u = jnp.einsum("egcd,edf->egcf", h, self.w_up[...].astype(dt))
        return jnp.einsum("egcf,efd->egcd", jax.nn.silu(g) * u, self.w_down[...].astype(dt))

    def capacity_dispatch(self, x, gates, experts) -> jax.Array:
        """Fixed-capacity dispatch of ``x [groups, tokens, d]`` (a group: one sequence):
        one-hot ``[groups, tokens, E, capacity]`` einsums, capacity per group."""
        cfg = self.cfg
        groups, tokens, _ = x.shape
        cap = cfg.capacity(tokens)
        # choice-major: every token's first choice is placed before any second choice
        onehot = jax.nn.one_hot(jnp.moveaxis(experts, -1, 1), cfg.n_experts, dtype=jnp.int32)
        flat = onehot.reshape(groups, cfg.top_k * tokens, cfg.n_experts)  # [G, k*S, E]
        position = (jnp.cumsum(flat, axis=1) - 1).reshape(onehot.shape)  # [G, k, S, E]
        kept = onehot * (position < cap)
        slots = jax.nn.one_hot(jnp.sum(position * kept, axis=-1), cap, dtype=x.dtype)
        dispatch = kept.astype(x.dtype)[..., None] * slots[..., None, :]  # [G, k, S, E, C]
        weights = jnp.moveaxis(gates, -1, 1).astype(x.dtype)[..., None, None]
        combine = jnp.sum(dispatch * weights, axis=1)  # [G, S, E, C]
        dispatch = jnp.sum(dispatch, axis=1)
        expert_out = self.expert_mlp(jnp.einsum("gsec,gsd->egcd", dispatch, x))
        return jnp.einsum("gsec,egcd->gsd", combine, expert_out)

    def dropless_dispatch(self, x, gates, experts) -> jax.Array:
        """Dropless dispatch: (token, choice) rows sorted by expert and ``ragged_dot``."""
        cfg = self.cfg
        tokens, d = x.shape
        flat = experts.reshape(-1)  # [T * k], token-major
        order = jnp.argsort(flat, stable=True)
        rows = x[order // cfg.top_k]  # [T * k, d] grouped by expert
        sizes = jnp.sum(jax.nn.one_hot(flat, cfg.n_experts, dtype=jnp.int32), axis=0)
        dt = x.dtype
        g = jax.lax.ragged_dot(rows, self.w_gate[...].astype(dt), sizes)
        u = jax.lax.ragged_dot(rows, self.w_up[...].astype(dt), sizes)
        out = jax.lax.ragged_dot(jax.nn.silu(g) * u, self.w_down[...].astype(dt), sizes)
        back = jnp.zeros_like(out).at[order].set(out).reshape(tokens, cfg.top_k, d)
        return jnp.sum(back * gates.astype(dt)[..., None], axis=1)

    def __call__(self, x: jax.Array) -> tuple[jax.Array, jax.Array]:
        b, s, d = x.shape
        flat = x.reshape(b * s, d)
        gates, experts, aux = self.route(flat)
        if self.cfg.dispatch == "capacity":
            k = self.cfg.top_k
            y = self.capacity_dispatch(x, gates.reshape(b, s, k), experts.reshape(b, s, k))
        else:
            y = self.dropless_dispatch(flat, gates, experts).reshape(b, s, d)
        if self.shared is not None:
            y = y + self.shared(x)
        return y, aux


class Block(nnx.Module):
    """A pre-norm block: ``x + attn(norm1(x))`` then ``x + moe(norm2(x))``."""

    def __init__(self, cfg: MoEConfig, *, rngs: nnx.Rngs):
        dense = cfg.attention()
        self.norm1 = gpt.RMSNorm(cfg.d_model, eps=cfg.norm_eps, param_dtype=cfg.param_dtype)
        self.attn = gpt.Attention(dense, rngs=rngs)
        self.norm2 = gpt.RMSNorm(cfg.d_model, eps=cfg.norm_eps, param_dtype=cfg.param_dtype)
        self.moe = MoE(cfg, rngs=rngs)

    def __call__(self, x: jax.Array) -> tuple[jax.Array, jax.Array]:
        x = x + self.attn(self.norm1(x))
        y, aux = self.moe(self.norm2(x))
        return x + y, aux


class MoEDecoder(nnx.Module):
    """Embedding, ``n_layers`` MoE blocks, final norm, LM head; returns (logits, the mean
    load-balancing loss over layers)."""

    def __init__(self, cfg: MoEConfig, *, rngs: nnx.Rngs):
        self.cfg = cfg
        self.embed = nnx.Embed(
            cfg.vocab_size, cfg.d_model, dtype=cfg.dtype, param_dtype=cfg.param_dtype, rngs=rngs
        )
        self.embed.dtype = cfg.dtype  # see models.gpt.GPT: nnx.Embed fixes None at construction
        self.blocks = nnx.List([Block(cfg, rngs=rngs) for _ in range(cfg.n_layers)])
        self.norm_f = gpt.RMSNorm(cfg.d_model, eps=cfg.norm_eps, param_dtype=cfg.param_dtype)
        self.lm_head = _linear(cfg, cfg.d_model, cfg.vocab_size, rngs)

    def __call__(self, tokens: jax.Array) -> tuple[jax.Array, jax.Array]:
        x = self.embed(tokens)
        aux = jnp.float32(0)
        for block in self.blocks:
            x, a = block(x)
            aux = aux + a
        return self.lm_head(self.norm_f(x)), aux / len(self.blocks)


def loss(model: MoEDecoder, batch: dict[str, jax.Array]) -> jax.Array:
    """Next-token cross entropy plus ``aux_loss_coef`` x the load-balancing loss."""
    logits, aux = model(batch["tokens"])
    ce = optax.softmax_cross_entropy_with_integer_labels(
        logits.astype(jnp.float32), batch["targets"]
    )
    return ce.mean() + model.cfg.aux_loss_coef * aux


def synthetic_batch(cfg: MoEConfig, batch_size: int, seed: int = 0) -> dict[str, jax.Array]:
    """Token batches from :func:`models.gpt.synthetic_batch`'s fixed Markov chain."""
    return gpt.synthetic_batch(cfg.attention(), batch_size, seed)


def expert_load(model: MoEDecoder, batch: dict[str, jax.Array]) -> jax.Array:
    """The (token, choice) rows the model's own routers send to each expert on ``batch``:
    ``[n_layers, n_experts]`` (before a capacity dispatch drops any)."""
    x = model.embed(batch["tokens"])
    counts = []
    for block in model.blocks:
        x = x + block.attn(block.norm1(x))
        h = block.norm2(x)
        _, experts, _ = block.moe.route(h.reshape(-1, h.shape[-1]))
        counts.append(jnp.sum(jax.nn.one_hot(experts, model.cfg.n_experts), axis=(0, 1)))
        y, _ = block.moe(h)
        x = x + y
    return jnp.stack(counts)


def expert_skew(model: MoEDecoder, batch: dict[str, jax.Array], ep: int) -> float:
    """The router's load imbalance as expert parallelism over ``ep`` devices meets it:
    per layer, the rows the busiest device's ``n_experts / ep`` experts receive over the
    mean, averaged over the layers (each layer waits for its busiest device; the layers
    add up). 1.0 is balanced, ``ep`` puts every row on one device. Pass it to
    ``jscaler.estimate(..., expert_skew=)``: dropless dispatch's time follows it, a
    capacity dispatch's does not (it drops the excess instead).

    Example::

        skew = expert_skew(nnx.merge(graphdef, params), batch, ep=4)
        jscaler.estimate(plan, "h100_sxm", expert_skew=skew)
    """
    n = model.cfg.n_experts
    if isinstance(ep, bool) or not isinstance(ep, int) or ep < 1 or n % ep:
        raise ValueError(f"expert_skew: ep must be a positive divisor of {n} experts, got {ep!r}")
    per_device = expert_load(model, batch).reshape(-1, ep, n // ep).sum(axis=-1)
    busiest = per_device.max(axis=-1) / per_device.mean(axis=-1)
    return float(busiest.mean())
