"""AlphaFold2, small but faithful: the Evoformer trunk, a simplified structure head, and
recycling, in plain flax.nnx.

The model follows the AlphaFold2 paper's supplementary information (Jumper et al., 2021;
algorithm numbers below are its). One forward pass:

1. **Input embedder** (Alg. 3): the target sequence (one-hot ``aatype``) gives the pair
   representation ``z[B, r, r, c_z]`` as an outer sum ``a_i + b_j`` plus a linear
   embedding of the clipped relative position ``i - j`` (Alg. 4-5); the MSA (one-hot
   tokens) gives ``m[B, s, r, c_m]``, plus the target embedding on every row.
2. **Recycling embedder** (Alg. 32): the previous pass's first MSA row and pair
   representation, layer-normalised and passed through a linear layer, are added to
   ``m[:, 0]`` and ``z``.
3. **Evoformer** (Alg. 6), ``n_blocks`` blocks, each a sequence of pre-LayerNorm
   residual updates: MSA row attention with pair bias (gated, Alg. 7), MSA column
   attention (gated, Alg. 8), MSA transition (Alg. 9), outer product mean ``m -> z``
   (Alg. 10), triangle multiplication outgoing and incoming (Alg. 11-12), triangle
   attention around the starting and the ending node (gated, with pair bias, Alg. 13-14)
   and the pair transition (Alg. 15).
4. **Heads**, in the last pass only: a distogram head (Alg. 1, line 21: a linear map of
   ``z_ij + z_ji`` to distance-bin logits) and a structure head that predicts C-alpha
   coordinates.

Recycling (Alg. 2) runs the embedders and the Evoformer ``cfg.passes`` times per step.
Every pass but the last runs under ``jax.lax.stop_gradient``, and its outputs (first MSA
row, pair representation) are embedded and added at the start of the next pass, exactly
the control structure of ``models.recycler``: jscaler finds the passes in the traced
graph by those ``stop_gradient`` ops and the 3F1B schedule runs them as three forwards
and one backward per micro-batch.

Simplifications, each keeping the shapes and the communication pattern of the original:

- No template stack and no extra-MSA stack; the MSA features are the one-hot tokens only
  (no deletion features or cluster profiles), and no MSA clustering or masking (so no
  masked-MSA loss). The first MSA row is the target sequence.
- The structure head replaces invariant point attention and the backbone frames with an
  invariant single-representation transformer: the first MSA row is projected to the
  single representation ``s``, then one layer, applied ``n_structure_layers`` times with
  the same weights as AlphaFold2's IPA layer is, of multi-head attention with a bias
  from the pair representation (IPA without its point terms) and a 3-layer transition,
  as pre-LayerNorm residual updates (Alg. 20 normalises after each residual instead); a
  final LayerNorm and linear layer give C-alpha coordinates in Å. Being shared, the
  layer is not a module list, so the repeated layers jscaler finds are the Evoformer
  blocks.
- Losses: distogram cross-entropy against binned true C-alpha distances (AlphaFold2 bins
  C-beta distances), and instead of FAPE a rotation- and translation-invariant
  distance loss, the mean squared error of all pairwise C-alpha distances (a dRMSD
  squared, in nm). ``loss = distogram_weight * CE + coord_weight * dRMSD²``, each the mean
  over residue pairs and then over the batch. No pLDDT, violation or auxiliary losses.
- Recycling embeds only the first MSA row and the pair representation (no distances of
  the previous pass's structure: the structure head runs in the last pass alone).
- Initialisation: AlphaFold2 zero-initialises the last linear layer of each residual
  update, so that every block starts as the identity; here those kernels are random but
  small (a tenth of the default scale), which keeps the blocks near the identity and
  every gradient non-zero from the first step. Gates use the default initialisers.
- No parameter is invisible to the loss: the LayerNorms that only feed attention
  biases, the last LayerNorm and the coordinate projection have no offset (softmax
  ignores a constant added to every logit, and the distance loss ignores a
  translation), so no gradient is zero by symmetry.
- fp32 throughout, no dropout, deterministic.

Written as plain flax.nnx, with no jscaler imports. Submodule attribute names are part of
the contract: ops are named by module path, such as ``evoformer/0/msa_row_attn/q``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

__all__ = [
    "AlphaFold2Config",
    "tiny",
    "paper",
    "openfold_default",
    "CONFIGS",
    "AlphaFold2",
    "loss",
    "synthetic_batch",
    "num_params",
    "evoformer_params",
    "loss_terms",
    "pairwise_distances",
    "distogram_bins",
]

AATYPES = 21  # 20 amino acids + unknown: the target sequence's tokens
MSA_TOKENS = 22  # the same + a gap


@dataclass(frozen=True)
class AlphaFold2Config:
    """Hyper-parameters (AlphaFold2's names in brackets).

    Attributes:
      n_seq: MSA rows per example ``s`` [N_seq].
      n_res: Residues per protein ``r`` [N_res].
      c_m: Width of the MSA representation.
      c_z: Width of the pair representation.
      c_s: Width of the structure head's single representation.
      n_blocks: Evoformer blocks.
      msa_heads: Heads of the MSA row and column attentions.
      msa_head_dim: Width of one MSA attention head [c].
      pair_heads: Heads of the triangle attentions.
      pair_head_dim: Width of one triangle attention head [c].
      c_opm: Hidden width of the outer product mean [c]; it writes ``c_opm**2`` features
        per residue pair.
      c_tri: Hidden width of the triangle multiplications [c].
      transition: Widening factor of the MSA and pair transitions [n].
      relpos_k: Relative positions are clipped to ``[-relpos_k, relpos_k]``
        (``2 * relpos_k + 1`` classes) [r_max].
      n_structure_layers: Times the structure head's one layer is applied (its weights
        are shared, as AlphaFold2's 8 IPA iterations share theirs).
      structure_heads: Heads of the structure head's attention.
      structure_head_dim: Width of one structure head attention head.
      distogram_bins: Distance bins of the distogram head.
      distogram_min: Lower edge of the first finite bin, in Å (nearer: bin 0).
      distogram_max: Upper edge of the last finite bin, in Å (further: the last bin).
      distogram_weight: Weight of the distogram loss.
      coord_weight: Weight of the pairwise-distance (dRMSD²) loss.
      passes: Forward passes per step (AlphaFold2: 3 or 4 in training, i.e. 2-3
        recycles); all but the last run under ``stop_gradient``.
      norm_eps: Epsilon of every LayerNorm.
    """

    n_seq: int
    n_res: int
    c_m: int
    c_z: int
    c_s: int
    n_blocks: int
    msa_heads: int
    msa_head_dim: int
    pair_heads: int
    pair_head_dim: int
    c_opm: int
    c_tri: int
    transition: int = 4
    relpos_k: int = 32
    n_structure_layers: int = 8
    structure_heads: int = 12
    structure_head_dim: int = 16
    distogram_bins: int = 64
    distogram_min: float = 2.3125
    distogram_max: float = 21.6875
    distogram_weight: float = 0.3
    coord_weight: float = 0.5
    passes: int = 3
    norm_eps: float = 1e-5

    def __post_init__(self) -> None:
        positive = (
            "n_seq",
            "n_res",
            "c_m",
            "c_z",
            "c_s",
            "n_blocks",
            "msa_heads",
            "msa_head_dim",
            "pair_heads",
            "pair_head_dim",
            "c_opm",
            "c_tri",
            "transition",
            "relpos_k",
            "n_structure_layers",
            "structure_heads",
            "structure_head_dim",
            "passes",
        )
        for name in positive:
            if getattr(self, name) <= 0:
                raise ValueError(
                    f"AlphaFold2Config.{name} must be positive, got {getattr(self, name)}"
                )
        if self.distogram_bins < 2:
            raise ValueError(
                f"AlphaFold2Config.distogram_bins must be at least 2, got {self.distogram_bins}"
            )
        if not 0.0 <= self.distogram_min < self.distogram_max:
            raise ValueError(
                "AlphaFold2Config needs 0 <= distogram_min < distogram_max, got "
                f"{self.distogram_min} and {self.distogram_max}"
            )
        if min(self.distogram_weight, self.coord_weight) < 0:
            raise ValueError(
                "AlphaFold2Config loss weights must be non-negative, got "
                f"distogram_weight={self.distogram_weight}, coord_weight={self.coord_weight}"
            )

    def replace(self, **changes: Any) -> AlphaFold2Config:
        """Returns a copy with ``changes`` applied (and validated)."""
        return dataclasses.replace(self, **changes)


def tiny() -> AlphaFold2Config:
    """A test-sized model (~28k parameters): 4 blocks, 4 MSA rows of 8 residues.

    Every head count and hidden width is even, so tensor parallelism of degree 2 can
    split heads and hidden features.
    """
    return AlphaFold2Config(
        n_seq=4,
        n_res=8,
        c_m=16,
        c_z=8,
        c_s=16,
        n_blocks=4,
        msa_heads=2,
        msa_head_dim=8,
        pair_heads=2,
        pair_head_dim=4,
        c_opm=4,
        c_tri=8,
        transition=2,
        relpos_k=8,
        n_structure_layers=2,
        structure_heads=2,
        structure_head_dim=8,
        distogram_bins=16,
        distogram_min=2.0,
        distogram_max=22.0,
        passes=3,
    )


def paper() -> AlphaFold2Config:
    """AlphaFold2's training shape (supplementary Table 4 and section 1.6): 48 Evoformer
    blocks (~88M parameters), crop of 256 residues, 128 MSA rows, 3 passes."""
    return AlphaFold2Config(
        n_seq=128,
        n_res=256,
        c_m=256,
        c_z=128,
        c_s=384,
        n_blocks=48,
        msa_heads=8,
        msa_head_dim=32,
        pair_heads=4,
        pair_head_dim=32,
        c_opm=32,
        c_tri=128,
        passes=3,
    )


def openfold_default() -> AlphaFold2Config:
    """OpenFold's default ("initial training") model config: AlphaFold2's shapes with
    4 forward passes (3 recycles)."""
    return paper().replace(passes=4)


CONFIGS = {"tiny": tiny, "paper": paper, "openfold_default": openfold_default}


# ---- building blocks ----------------------------------------------------------------------


# AlphaFold2 initialises the last linear layer of every residual update to zero, so each
# block starts as the identity. A zero kernel would also zero the first step's gradient
# of everything before it; a small one (a tenth of the default standard deviation) keeps
# the blocks near the identity, with every gradient non-zero from the first step.
_FINAL_INIT = nnx.initializers.variance_scaling(0.01, "fan_in", "truncated_normal")


def _linear(
    d_in: int, d_out: int, rngs: nnx.Rngs, *, bias: bool = True, final: bool = False
) -> nnx.Linear:
    if final:
        return nnx.Linear(d_in, d_out, use_bias=bias, kernel_init=_FINAL_INIT, rngs=rngs)
    return nnx.Linear(d_in, d_out, use_bias=bias, rngs=rngs)


def _norm(dim: int, cfg: AlphaFold2Config, rngs: nnx.Rngs, *, bias: bool = True) -> nnx.LayerNorm:
    return nnx.LayerNorm(dim, epsilon=cfg.norm_eps, use_bias=bias, rngs=rngs)


def _split_heads(x: jax.Array, heads: int) -> jax.Array:
    """``[..., heads * dim] -> [..., heads, dim]``."""
    return x.reshape(*x.shape[:-1], heads, x.shape[-1] // heads)


def _merge_heads(x: jax.Array) -> jax.Array:
    """``[..., heads, dim] -> [..., heads * dim]``."""
    return x.reshape(*x.shape[:-2], x.shape[-2] * x.shape[-1])


class Transition(nnx.Module):
    """``Linear(relu(Linear(LN(x))))`` widening by ``n`` (Alg. 9 and 15)."""

    def __init__(self, dim: int, cfg: AlphaFold2Config, *, rngs: nnx.Rngs):
        self.norm = _norm(dim, cfg, rngs)
        self.up = _linear(dim, cfg.transition * dim, rngs)
        self.down = _linear(cfg.transition * dim, dim, rngs, final=True)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.down(jax.nn.relu(self.up(self.norm(x))))


class MSARowAttention(nnx.Module):
    """Gated self-attention along each MSA row, biased by the pair representation (Alg. 7).

    Residue i of row s attends to the residues j of the same row with logits
    ``q_si . k_sj / sqrt(c) + b_ij`` where ``b = Linear(LN(z))`` has one value per head.
    """

    def __init__(self, cfg: AlphaFold2Config, *, rngs: nnx.Rngs):
        h, c = cfg.msa_heads, cfg.msa_head_dim
        self.heads, self.head_dim = h, c
        self.norm = _norm(cfg.c_m, cfg, rngs)
        # no offset: it would add a constant to every logit, which softmax ignores
        self.pair_norm = _norm(cfg.c_z, cfg, rngs, bias=False)
        self.q = _linear(cfg.c_m, h * c, rngs, bias=False)
        self.k = _linear(cfg.c_m, h * c, rngs, bias=False)
        self.v = _linear(cfg.c_m, h * c, rngs, bias=False)
        self.pair_bias = _linear(cfg.c_z, h, rngs, bias=False)
        self.gate = _linear(cfg.c_m, h * c, rngs)
        self.out = _linear(h * c, cfg.c_m, rngs, final=True)

    def __call__(self, m: jax.Array, z: jax.Array) -> jax.Array:
        x = self.norm(m)
        q = _split_heads(self.q(x), self.heads)  # [B, s, i, h, c]
        k = _split_heads(self.k(x), self.heads)
        v = _split_heads(self.v(x), self.heads)
        bias = self.pair_bias(self.pair_norm(z))  # [B, i, j, h]
        logits = jnp.einsum("bsihc,bsjhc->bshij", q, k) / jnp.sqrt(jnp.float32(self.head_dim))
        logits = logits + jnp.transpose(bias, (0, 3, 1, 2))[:, None]
        probs = jax.nn.softmax(logits, axis=-1)
        o = jnp.einsum("bshij,bsjhc->bsihc", probs, v)
        o = jax.nn.sigmoid(self.gate(x)) * _merge_heads(o)
        return self.out(o)


class MSAColumnAttention(nnx.Module):
    """Gated self-attention along each MSA column: the rows of one residue (Alg. 8)."""

    def __init__(self, cfg: AlphaFold2Config, *, rngs: nnx.Rngs):
        h, c = cfg.msa_heads, cfg.msa_head_dim
        self.heads, self.head_dim = h, c
        self.norm = _norm(cfg.c_m, cfg, rngs)
        self.q = _linear(cfg.c_m, h * c, rngs, bias=False)
        self.k = _linear(cfg.c_m, h * c, rngs, bias=False)
        self.v = _linear(cfg.c_m, h * c, rngs, bias=False)
        self.gate = _linear(cfg.c_m, h * c, rngs)
        self.out = _linear(h * c, cfg.c_m, rngs, final=True)

    def __call__(self, m: jax.Array) -> jax.Array:
        x = self.norm(m)
        q = _split_heads(self.q(x), self.heads)  # [B, s, i, h, c]
        k = _split_heads(self.k(x), self.heads)
        v = _split_heads(self.v(x), self.heads)
        logits = jnp.einsum("bsihc,btihc->bihst", q, k) / jnp.sqrt(jnp.float32(self.head_dim))
        probs = jax.nn.softmax(logits, axis=-1)
        o = jnp.einsum("bihst,btihc->bsihc", probs, v)
        o = jax.nn.sigmoid(self.gate(x)) * _merge_heads(o)
        return self.out(o)


class OuterProductMean(nnx.Module):
    """``z_ij += Linear(flatten(mean_s a_si (x) b_sj))`` with ``a, b = Linear(LN(m))``
    (Alg. 10): how the MSA informs the pair representation."""

    def __init__(self, cfg: AlphaFold2Config, *, rngs: nnx.Rngs):
        self.norm = _norm(cfg.c_m, cfg, rngs)
        self.a = _linear(cfg.c_m, cfg.c_opm, rngs)
        self.b = _linear(cfg.c_m, cfg.c_opm, rngs)
        self.out = _linear(cfg.c_opm * cfg.c_opm, cfg.c_z, rngs, final=True)

    def __call__(self, m: jax.Array) -> jax.Array:
        x = self.norm(m)
        a, b = self.a(x), self.b(x)  # [B, s, r, c]
        outer = jnp.einsum("bsic,bsjd->bijcd", a, b) / m.shape[1]
        return self.out(_merge_heads(outer))


class TriangleMultiplication(nnx.Module):
    """Triangle update with multiplication, outgoing (Alg. 11: ``sum_k a_ik b_jk``) or
    incoming (Alg. 12: ``sum_k a_ki b_kj``) edges, gated."""

    def __init__(self, cfg: AlphaFold2Config, *, outgoing: bool, rngs: nnx.Rngs):
        self.outgoing = outgoing
        self.norm = _norm(cfg.c_z, cfg, rngs)
        self.a_proj = _linear(cfg.c_z, cfg.c_tri, rngs)
        self.a_gate = _linear(cfg.c_z, cfg.c_tri, rngs)
        self.b_proj = _linear(cfg.c_z, cfg.c_tri, rngs)
        self.b_gate = _linear(cfg.c_z, cfg.c_tri, rngs)
        self.gate = _linear(cfg.c_z, cfg.c_z, rngs)
        self.out_norm = _norm(cfg.c_tri, cfg, rngs)
        self.out = _linear(cfg.c_tri, cfg.c_z, rngs, final=True)

    def __call__(self, z: jax.Array) -> jax.Array:
        x = self.norm(z)
        a = jax.nn.sigmoid(self.a_gate(x)) * self.a_proj(x)  # [B, r, r, c]
        b = jax.nn.sigmoid(self.b_gate(x)) * self.b_proj(x)
        if self.outgoing:
            t = jnp.einsum("bikc,bjkc->bijc", a, b)
        else:
            t = jnp.einsum("bkic,bkjc->bijc", a, b)
        return jax.nn.sigmoid(self.gate(x)) * self.out(self.out_norm(t))


class TriangleAttention(nnx.Module):
    """Gated triangle self-attention around the starting node (Alg. 13: edge ij attends
    to the edges ik, biased by jk) or the ending node (Alg. 14: ij attends to kj, biased
    by ki)."""

    def __init__(self, cfg: AlphaFold2Config, *, starting: bool, rngs: nnx.Rngs):
        h, c = cfg.pair_heads, cfg.pair_head_dim
        self.starting, self.heads, self.head_dim = starting, h, c
        self.norm = _norm(cfg.c_z, cfg, rngs)
        self.q = _linear(cfg.c_z, h * c, rngs, bias=False)
        self.k = _linear(cfg.c_z, h * c, rngs, bias=False)
        self.v = _linear(cfg.c_z, h * c, rngs, bias=False)
        self.pair_bias = _linear(cfg.c_z, h, rngs, bias=False)
        self.gate = _linear(cfg.c_z, h * c, rngs)
        self.out = _linear(h * c, cfg.c_z, rngs, final=True)

    def __call__(self, z: jax.Array) -> jax.Array:
        x = self.norm(z)
        q = _split_heads(self.q(x), self.heads)  # [B, i, j, h, c]
        k = _split_heads(self.k(x), self.heads)
        v = _split_heads(self.v(x), self.heads)
        bias = self.pair_bias(x)  # [B, ., ., h]
        scale = jnp.sqrt(jnp.float32(self.head_dim))
        if self.starting:
            logits = jnp.einsum("bijhc,bikhc->bijhk", q, k) / scale
            logits = logits + jnp.transpose(bias, (0, 1, 3, 2))[:, None]  # b_jk
            probs = jax.nn.softmax(logits, axis=-1)
            o = jnp.einsum("bijhk,bikhc->bijhc", probs, v)
        else:
            logits = jnp.einsum("bijhc,bkjhc->bijhk", q, k) / scale
            logits = logits + jnp.transpose(bias, (0, 2, 3, 1))[:, :, None]  # b_ki
            probs = jax.nn.softmax(logits, axis=-1)
            o = jnp.einsum("bijhk,bkjhc->bijhc", probs, v)
        o = jax.nn.sigmoid(self.gate(x)) * _merge_heads(o)
        return self.out(o)


class EvoformerBlock(nnx.Module):
    """One Evoformer block (Alg. 6): MSA stack, the MSA -> pair communication, pair stack;
    every update a pre-LayerNorm residual."""

    def __init__(self, cfg: AlphaFold2Config, *, rngs: nnx.Rngs):
        self.msa_row_attn = MSARowAttention(cfg, rngs=rngs)
        self.msa_col_attn = MSAColumnAttention(cfg, rngs=rngs)
        self.msa_transition = Transition(cfg.c_m, cfg, rngs=rngs)
        self.outer_product_mean = OuterProductMean(cfg, rngs=rngs)
        self.tri_mul_out = TriangleMultiplication(cfg, outgoing=True, rngs=rngs)
        self.tri_mul_in = TriangleMultiplication(cfg, outgoing=False, rngs=rngs)
        self.tri_att_start = TriangleAttention(cfg, starting=True, rngs=rngs)
        self.tri_att_end = TriangleAttention(cfg, starting=False, rngs=rngs)
        self.pair_transition = Transition(cfg.c_z, cfg, rngs=rngs)

    def __call__(self, m: jax.Array, z: jax.Array) -> tuple[jax.Array, jax.Array]:
        m = m + self.msa_row_attn(m, z)
        m = m + self.msa_col_attn(m)
        m = m + self.msa_transition(m)
        z = z + self.outer_product_mean(m)
        z = z + self.tri_mul_out(z)
        z = z + self.tri_mul_in(z)
        z = z + self.tri_att_start(z)
        z = z + self.tri_att_end(z)
        z = z + self.pair_transition(z)
        return m, z


class InputEmbedder(nnx.Module):
    """Target and MSA features -> ``(m, z)`` (Alg. 3-5); features are one-hot tokens, so
    each embedding is a linear layer of a one-hot vector, as in the paper."""

    def __init__(self, cfg: AlphaFold2Config, *, rngs: nnx.Rngs):
        self.relpos_k = cfg.relpos_k
        self.target_i = _linear(AATYPES, cfg.c_z, rngs)
        self.target_j = _linear(AATYPES, cfg.c_z, rngs)
        self.relpos = _linear(2 * cfg.relpos_k + 1, cfg.c_z, rngs)
        self.target_m = _linear(AATYPES, cfg.c_m, rngs)
        self.msa = _linear(MSA_TOKENS, cfg.c_m, rngs)

    def __call__(self, aatype: jax.Array, msa: jax.Array) -> tuple[jax.Array, jax.Array]:
        target = jax.nn.one_hot(aatype, AATYPES, dtype=jnp.float32)  # [B, r, 21]
        z = self.target_i(target)[:, :, None] + self.target_j(target)[:, None, :]
        pos = jnp.arange(aatype.shape[1])
        offset = jnp.clip(pos[:, None] - pos[None, :], -self.relpos_k, self.relpos_k)
        relpos = jax.nn.one_hot(offset + self.relpos_k, 2 * self.relpos_k + 1)
        z = z + self.relpos(relpos)[None]
        m = self.msa(jax.nn.one_hot(msa, MSA_TOKENS, dtype=jnp.float32))
        m = m + self.target_m(target)[:, None]
        return m, z


class RecyclingEmbedder(nnx.Module):
    """Adds ``Linear(LN(prev))`` of the previous pass's first MSA row and pair
    representation (Alg. 32, without its distance embedding)."""

    def __init__(self, cfg: AlphaFold2Config, *, rngs: nnx.Rngs):
        self.msa_norm = _norm(cfg.c_m, cfg, rngs)
        self.msa = _linear(cfg.c_m, cfg.c_m, rngs)
        self.pair_norm = _norm(cfg.c_z, cfg, rngs)
        self.pair = _linear(cfg.c_z, cfg.c_z, rngs)

    def __call__(
        self, m: jax.Array, z: jax.Array, prev_m1: jax.Array, prev_z: jax.Array
    ) -> tuple[jax.Array, jax.Array]:
        first = m[:, :1] + self.msa(self.msa_norm(prev_m1))[:, None]
        m = jnp.concatenate([first, m[:, 1:]], axis=1)
        return m, z + self.pair(self.pair_norm(prev_z))


class StructureLayer(nnx.Module):
    """One layer of the simplified structure head: attention over residues with a bias
    from the pair representation (IPA without its point terms, Alg. 22), then a 3-layer
    ReLU transition (Alg. 20, line 8), each a pre-LayerNorm residual update."""

    def __init__(self, cfg: AlphaFold2Config, *, rngs: nnx.Rngs):
        h, c = cfg.structure_heads, cfg.structure_head_dim
        self.heads, self.head_dim = h, c
        self.attn_norm = _norm(cfg.c_s, cfg, rngs)
        self.q = _linear(cfg.c_s, h * c, rngs, bias=False)
        self.k = _linear(cfg.c_s, h * c, rngs, bias=False)
        self.v = _linear(cfg.c_s, h * c, rngs, bias=False)
        self.pair_bias = _linear(cfg.c_z, h, rngs, bias=False)
        self.out = _linear(h * c, cfg.c_s, rngs, final=True)
        self.transition_norm = _norm(cfg.c_s, cfg, rngs)
        self.t1 = _linear(cfg.c_s, cfg.c_s, rngs)
        self.t2 = _linear(cfg.c_s, cfg.c_s, rngs)
        self.t3 = _linear(cfg.c_s, cfg.c_s, rngs, final=True)

    def __call__(self, s: jax.Array, z: jax.Array) -> jax.Array:
        x = self.attn_norm(s)
        q = _split_heads(self.q(x), self.heads)  # [B, i, h, c]
        k = _split_heads(self.k(x), self.heads)
        v = _split_heads(self.v(x), self.heads)
        logits = jnp.einsum("bihc,bjhc->bhij", q, k) / jnp.sqrt(jnp.float32(self.head_dim))
        logits = logits + jnp.transpose(self.pair_bias(z), (0, 3, 1, 2))
        probs = jax.nn.softmax(logits, axis=-1)
        s = s + self.out(_merge_heads(jnp.einsum("bhij,bjhc->bihc", probs, v)))
        x = self.transition_norm(s)
        return s + self.t3(jax.nn.relu(self.t2(jax.nn.relu(self.t1(x)))))


class StructureHead(nnx.Module):
    """First MSA row and pair representation -> C-alpha coordinates ``[B, r, 3]`` in Å.

    The last LayerNorm and the coordinate projection have no offsets: an offset shared
    by every residue only translates the structure, which the loss cannot see.
    """

    POSITION_SCALE = 10.0  # AlphaFold2's structure module works in nm and outputs Å

    def __init__(self, cfg: AlphaFold2Config, *, rngs: nnx.Rngs):
        self.single = _linear(cfg.c_m, cfg.c_s, rngs)  # Alg. 6's s_i = Linear(m_1i)
        self.single_norm = _norm(cfg.c_s, cfg, rngs)
        self.single_in = _linear(cfg.c_s, cfg.c_s, rngs)
        self.pair_norm = _norm(cfg.c_z, cfg, rngs, bias=False)  # feeds attention biases
        self.n_layers = cfg.n_structure_layers
        self.layer = StructureLayer(cfg, rngs=rngs)  # applied n_layers times
        self.final_norm = _norm(cfg.c_s, cfg, rngs, bias=False)
        self.coords = _linear(cfg.c_s, 3, rngs, bias=False)

    def __call__(self, m1: jax.Array, z: jax.Array) -> jax.Array:
        s = self.single_in(self.single_norm(self.single(m1)))
        z = self.pair_norm(z)
        for _ in range(self.n_layers):
            s = self.layer(s, z)
        return self.POSITION_SCALE * self.coords(self.final_norm(s))


class AlphaFold2(nnx.Module):
    """Embedders and Evoformer run ``cfg.passes`` times (all but the last under
    ``stop_gradient``), then the distogram and structure heads once."""

    def __init__(self, cfg: AlphaFold2Config, *, rngs: nnx.Rngs):
        self.cfg = cfg
        self.input_embedder = InputEmbedder(cfg, rngs=rngs)
        self.recycling_embedder = RecyclingEmbedder(cfg, rngs=rngs)
        self.evoformer = nnx.List([EvoformerBlock(cfg, rngs=rngs) for _ in range(cfg.n_blocks)])
        self.distogram = _linear(cfg.c_z, cfg.distogram_bins, rngs)
        self.structure = StructureHead(cfg, rngs=rngs)

    def initial_recycle(self, aatype: jax.Array) -> tuple[jax.Array, jax.Array]:
        """The zeros the first pass recycles: ``(m1[B, r, c_m], z[B, r, r, c_z])``."""
        b, r = aatype.shape
        return (
            jnp.zeros((b, r, self.cfg.c_m), jnp.float32),
            jnp.zeros((b, r, r, self.cfg.c_z), jnp.float32),
        )

    def trunk(
        self, aatype: jax.Array, msa: jax.Array, prev_m1: jax.Array, prev_z: jax.Array
    ) -> tuple[jax.Array, jax.Array]:
        """One pass of the embedders and the Evoformer: ``(m, z)``."""
        m, z = self.input_embedder(aatype, msa)
        m, z = self.recycling_embedder(m, z, prev_m1, prev_z)
        for block in self.evoformer:
            m, z = block(m, z)
        return m, z

    def heads(self, m: jax.Array, z: jax.Array) -> tuple[jax.Array, jax.Array]:
        """``(distogram logits [B, r, r, bins], C-alpha coordinates [B, r, 3])``."""
        logits = self.distogram(z + jnp.swapaxes(z, 1, 2))
        return logits, self.structure(m[:, 0], z)

    def __call__(self, aatype: jax.Array, msa: jax.Array) -> tuple[jax.Array, jax.Array]:
        """``aatype[B, r]``, ``msa[B, s, r]`` (int32) -> ``(distogram logits, coords)``."""
        prev_m1, prev_z = self.initial_recycle(aatype)
        for _ in range(self.cfg.passes - 1):
            m, z = self.trunk(aatype, msa, prev_m1, prev_z)
            prev_m1, prev_z = jax.lax.stop_gradient(m[:, 0]), jax.lax.stop_gradient(z)
        return self.heads(*self.trunk(aatype, msa, prev_m1, prev_z))


# ---- loss and data ------------------------------------------------------------------------


def pairwise_distances(x: jax.Array) -> jax.Array:
    """``x[..., r, 3] -> [..., r, r]``; smooth at zero distance (the diagonal)."""
    d2 = jnp.sum((x[..., :, None, :] - x[..., None, :, :]) ** 2, axis=-1)
    return jnp.sqrt(d2 + 1e-8)


def distogram_bins(cfg: AlphaFold2Config, distances: jax.Array) -> jax.Array:
    """The bin (int32, 0..bins-1) of each distance: ``bins - 1`` equal finite bins
    between ``distogram_min`` and ``distogram_max``, with everything beyond in the last."""
    edges = jnp.linspace(cfg.distogram_min, cfg.distogram_max, cfg.distogram_bins - 1)
    return jnp.sum(distances[..., None] > edges, axis=-1).astype(jnp.int32)


def loss_terms(
    cfg: AlphaFold2Config, logits: jax.Array, coords: jax.Array, target: jax.Array
) -> dict[str, jax.Array]:
    """Per-example losses ``[B]``: ``"distogram"`` (cross-entropy) and ``"drmsd"``
    (mean squared pairwise-distance error, in nm²)."""
    true_d = pairwise_distances(target)
    labels = jax.nn.one_hot(distogram_bins(cfg, true_d), cfg.distogram_bins)
    ce = -jnp.sum(labels * jax.nn.log_softmax(logits, axis=-1), axis=-1)
    err = (pairwise_distances(coords) - true_d) / StructureHead.POSITION_SCALE
    return {"distogram": jnp.mean(ce, axis=(1, 2)), "drmsd": jnp.mean(err**2, axis=(1, 2))}


def loss(model: AlphaFold2, batch: dict[str, jax.Array]) -> jax.Array:
    """``distogram_weight * CE + coord_weight * dRMSD²``, mean over the batch."""
    cfg = model.cfg
    logits, coords = model(batch["aatype"], batch["msa"])
    terms = loss_terms(cfg, logits, coords, batch["coords"])
    per_example = cfg.distogram_weight * terms["distogram"] + cfg.coord_weight * terms["drmsd"]
    return jnp.mean(per_example)


_STRUCTURE_SEED = 20240807  # fixed: every batch seed folds sequences the same way
CA_CA = 3.8  # Å between consecutive C-alpha atoms


def synthetic_batch(cfg: AlphaFold2Config, batch_size: int, seed: int = 0) -> dict:
    """A deterministic batch of random proteins whose structure follows their sequence.

    Each residue type bends the chain by a fixed random vector, so the C-alpha trace
    (unit steps of 3.8 Å, each the previous direction plus the residue's bend and a little
    noise) is mostly a function of the sequence: there is something to learn. The MSA's
    first row is the sequence; the other rows mutate 20% of the residues to random
    tokens (gaps included).

    Returns:
      ``{"aatype": int32[B, r], "msa": int32[B, s, r], "coords": float32[B, r, 3]}``.
    """
    bend = np.random.default_rng(_STRUCTURE_SEED).normal(size=(AATYPES, 3))
    rng = np.random.default_rng(seed)
    b, s, r = batch_size, cfg.n_seq, cfg.n_res
    aatype = rng.integers(0, AATYPES, size=(b, r))
    mutate = rng.random((b, s, r)) < 0.2
    mutate[:, 0] = False
    msa = np.where(mutate, rng.integers(0, MSA_TOKENS, size=(b, s, r)), aatype[:, None])
    direction = rng.normal(size=(b, 3))
    steps = np.empty((b, r, 3))
    for t in range(r):
        direction = direction / np.linalg.norm(direction, axis=-1, keepdims=True)
        steps[:, t] = direction
        direction = direction + bend[aatype[:, t]] + 0.3 * rng.normal(size=(b, 3))
    coords = CA_CA * np.cumsum(steps, axis=1)
    coords -= coords.mean(axis=1, keepdims=True)
    return {
        "aatype": jnp.asarray(aatype, jnp.int32),
        "msa": jnp.asarray(msa, jnp.int32),
        "coords": jnp.asarray(coords, jnp.float32),
    }


def num_params(cfg: AlphaFold2Config) -> int:
    """The parameter count of ``AlphaFold2(cfg)``, computed from the config alone."""

    def lin(d_in: int, d_out: int, bias: bool = True) -> int:
        return d_in * d_out + (d_out if bias else 0)

    def norm(d: int) -> int:
        return 2 * d

    c_m, c_z, c_s = cfg.c_m, cfg.c_z, cfg.c_s
    hm = cfg.msa_heads * cfg.msa_head_dim
    hz = cfg.pair_heads * cfg.pair_head_dim
    hs = cfg.structure_heads * cfg.structure_head_dim
    col_attn = norm(c_m) + 3 * lin(c_m, hm, False) + lin(c_m, hm) + lin(hm, c_m)
    row_attn = col_attn + c_z + lin(c_z, cfg.msa_heads, False)  # LayerNorm, no offset
    opm = norm(c_m) + 2 * lin(c_m, cfg.c_opm) + lin(cfg.c_opm**2, c_z)
    tri_mul = norm(c_z) + 4 * lin(c_z, cfg.c_tri) + lin(c_z, c_z) + norm(cfg.c_tri)
    tri_mul += lin(cfg.c_tri, c_z)
    tri_att = norm(c_z) + 3 * lin(c_z, hz, False) + lin(c_z, cfg.pair_heads, False)
    tri_att += lin(c_z, hz) + lin(hz, c_z)

    def transition(d: int) -> int:
        return norm(d) + lin(d, cfg.transition * d) + lin(cfg.transition * d, d)

    block = row_attn + col_attn + transition(c_m) + opm + 2 * tri_mul + 2 * tri_att
    block += transition(c_z)
    embed = 2 * lin(AATYPES, c_z) + lin(2 * cfg.relpos_k + 1, c_z)
    embed += lin(AATYPES, c_m) + lin(MSA_TOKENS, c_m)
    recycle = norm(c_m) + lin(c_m, c_m) + norm(c_z) + lin(c_z, c_z)
    layer = 3 * lin(c_s, hs, False) + lin(c_z, cfg.structure_heads, False) + lin(hs, c_s)
    layer += 2 * norm(c_s) + 3 * lin(c_s, c_s)
    structure = lin(c_m, c_s) + norm(c_s) + c_z + lin(c_s, c_s) + c_s + lin(c_s, 3, False)
    structure += layer  # one layer, applied n_structure_layers times
    distogram = lin(c_z, cfg.distogram_bins)
    return embed + recycle + cfg.n_blocks * block + distogram + structure


def evoformer_params(cfg: AlphaFold2Config) -> int:
    """Parameters of the Evoformer blocks alone (AlphaFold2's 48 blocks: ~88M)."""
    per_block = num_params(cfg.replace(n_blocks=2)) - num_params(cfg.replace(n_blocks=1))
    return cfg.n_blocks * per_block
