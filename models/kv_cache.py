"""The preallocated key/value cache and the explicit operation that commits new K/V into it.

The model never writes its own cache: a forward pass returns the K/V of the tokens it was
given (`NewKV`), and the decoder decides which of them to keep (`KVCache.write` / `append`).
That is what lets lookahead decoding compute many speculative tokens and commit only the
accepted ones.

The cache is head-major, [L, B, Hkv, S, D]: for each (row, K/V head) the S slots are one
contiguous [S, D] matrix, which is what attention multiplies by (a batched matmul over rows and
heads). A sequence-major cache ([L, B, S, Hkv, D]) would have to be transposed, that is copied,
by every layer of every step before its matmuls; head-major, attention reads it in place.

Two ways to hold the layers: `per_layer=True` (what `Llama` uses) keeps one array per layer,
`k = (k_0, ..., k_{L-1})`, so a layer's attention reads its array directly; stacked
(`per_layer=False`, one [L, B, Hkv, S, D] array) is for models that pick a layer slot by a
traced index (the looped models: a token's depth decides its slot). Reading a slice of a
stacked array costs a copy of that layer on backends that do not multiply strided views in
place (XLA's CPU backend copies it), which is why the static-layer model keeps them apart.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from models.sharding import CACHE_AXES, constrain


@struct.dataclass
class NewKV:
    """K/V of the T tokens of one forward pass."""

    k: jax.Array  # [L, B, T, Hkv, D]
    v: jax.Array  # [L, B, T, Hkv, D]


@struct.dataclass
class KVCache:
    """Static-shape cache. Row b holds its committed tokens in slots [0, length[b])."""

    k: jax.Array | tuple[jax.Array, ...]  # [L, B, Hkv, S, D], or L arrays [B, Hkv, S, D]
    v: jax.Array | tuple[jax.Array, ...]  # as k
    length: jax.Array  # [B] int32, committed tokens per row

    @classmethod
    def init(cls, num_layers: int, batch: int, max_len: int, num_kv_heads: int, head_dim: int,
             dtype=jnp.float32, *, per_layer: bool = False) -> "KVCache":
        shape = (batch, num_kv_heads, max_len, head_dim)
        if per_layer:
            k = tuple(jnp.zeros(shape, dtype) for _ in range(num_layers))
            v = tuple(jnp.zeros(shape, dtype) for _ in range(num_layers))
        else:
            k = jnp.zeros((num_layers, *shape), dtype)
            v = jnp.zeros((num_layers, *shape), dtype)
        return cls(k, v, jnp.zeros((batch,), jnp.int32))

    @property
    def per_layer(self) -> bool:
        return isinstance(self.k, tuple)

    @property
    def num_layers(self) -> int:
        return len(self.k) if self.per_layer else self.k.shape[0]

    @property
    def max_len(self) -> int:
        return self.k[0].shape[2]

    @property
    def batch(self) -> int:
        return self.k[0].shape[0]

    def visible(self) -> jax.Array:
        """[B, S] bool: the slots holding committed tokens."""
        return jnp.arange(self.max_len)[None, :] < self.length[:, None]

    def write(self, new: NewKV, src: jax.Array, dst: jax.Array) -> "KVCache":
        """Copies new-token K/V `src[b, i]` into slot `dst[b, i]`; a dst >= S is dropped.

        src, dst: [B, n] int32. `length` is unchanged.
        """
        b = jnp.broadcast_to(jnp.arange(src.shape[0])[:, None], src.shape)
        if self.per_layer:  # layer[b, :, dst] has shape [B, n, Hkv, D]
            k = tuple(c.at[b, :, dst].set(n[b, src], mode="drop") for c, n in zip(self.k, new.k))
            v = tuple(c.at[b, :, dst].set(n[b, src], mode="drop") for c, n in zip(self.v, new.v))
        else:  # cache[:, b, :, dst] has shape [B, n, L, Hkv, D] (the indexed axes first)
            k = self.k.at[:, b, :, dst].set(jnp.moveaxis(new.k[:, b, src], 0, 2), mode="drop")
            v = self.v.at[:, b, :, dst].set(jnp.moveaxis(new.v[:, b, src], 0, 2), mode="drop")
        # on a mesh, every write keeps K/V split over KV heads (`models.sharding`), so the
        # decoding loop's partitioner never lays the cache out another way
        k, v = jax.tree.map(lambda a: constrain(a, (None,) * (a.ndim - 4) + CACHE_AXES), (k, v))
        return self.replace(k=k, v=v)

    def slots(self, layer) -> tuple[jax.Array, jax.Array]:
        """K, V [B, Hkv, S, D] of one layer slot (an int; traced only for a stacked cache)."""
        if isinstance(layer, int) or self.per_layer:
            k, v = self.k[layer], self.v[layer]
        else:
            k = jax.lax.dynamic_index_in_dim(self.k, layer, 0, keepdims=False)
            v = jax.lax.dynamic_index_in_dim(self.v, layer, 0, keepdims=False)
        return constrain(k, CACHE_AXES), constrain(v, CACHE_AXES)  # as `write` keeps them

    def append(self, new: NewKV, src: jax.Array, count: jax.Array) -> "KVCache":
        """Appends new tokens src[b, :count[b]] after row b's committed tokens.

        src: [B, n] int32 indices into the new tokens; count: [B] int32 (0..n).
        """
        i = jnp.arange(src.shape[1])[None, :]
        dst = jnp.where(i < count[:, None], self.length[:, None] + i, self.max_len)
        return self.write(new, src, dst).replace(length=self.length + count)
