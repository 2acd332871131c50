"""Checksums of arrays wherever they live, the same under every sharding.

A checkpoint records one per array when it is saved and checks it when it is read back, so
a file damaged on disk (flipped bytes, same size) is found instead of restored. The
checksum of an array is the sum, modulo 2^32, of its elements' bit patterns as 32-bit words,
the word at flat position i weighted by 2i+1: changing any one word changes it, and so does
moving words. Integer sums do not depend on the order they are added in, so the value is
the same for any sharding, device count and process count: it is computed where the array
is (each device its shard, then one scalar summed over devices).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["fingerprints"]


def fingerprints(values: list) -> list[int]:
    """One uint32 checksum per array of ``values`` (jax or numpy arrays; typed PRNG keys
    are checksummed by their key data)."""
    if not values:
        return []
    values = [jax.random.key_data(v) if _is_key(v) else v for v in values]
    groups: dict = {}  # one program per device set (a pipeline's stages hold their own)
    for k, v in enumerate(values):
        sharding = getattr(v, "sharding", None)
        key = None if sharding is None else frozenset(sharding.device_set)
        groups.setdefault(key, []).append(k)
    sums = [0] * len(values)
    for ks in groups.values():
        out = _checksums(len(ks))([values[k] for k in ks])
        for k, x in zip(ks, out):
            sums[k] = int(np.asarray(x.addressable_data(0)))
    return sums


def _is_key(v) -> bool:
    return jax.dtypes.issubdtype(v.dtype, jax.dtypes.prng_key)


@functools.cache
def _checksums(n: int):
    return jax.jit(lambda values: [_checksum(v) for v in values])


def _checksum(x):
    words = _words(x)
    index = jnp.zeros(words.shape, jnp.uint32)
    stride = 1
    for axis in reversed(range(words.ndim)):
        index = index + jax.lax.broadcasted_iota(jnp.uint32, words.shape, axis) * np.uint32(
            stride % 2**32
        )
        stride *= words.shape[axis]
    return jnp.sum(words * (2 * index + 1), dtype=jnp.uint32)


def _words(x):
    """``x``'s bits as uint32 words (8-byte elements give a trailing axis of 2)."""
    if jnp.issubdtype(x.dtype, jnp.complexfloating):
        return jnp.stack([_words(jnp.real(x)), _words(jnp.imag(x))], -1)
    if x.dtype == jnp.bool_:
        return x.astype(jnp.uint32)
    size = jnp.dtype(x.dtype).itemsize
    if size == 4 or size == 8:
        return jax.lax.bitcast_convert_type(x, jnp.uint32)
    unsigned = {1: jnp.uint8, 2: jnp.uint16}[size]
    return jax.lax.bitcast_convert_type(x, unsigned).astype(jnp.uint32)
