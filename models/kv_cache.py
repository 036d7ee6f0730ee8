"""The preallocated key/value cache and the explicit operation that commits new K/V into it.

The model never writes its own cache: a forward pass returns the K/V of the tokens it was
given (`NewKV`), and the decoder decides which of them to keep (`KVCache.write` / `append`).
That is what lets lookahead decoding compute many speculative tokens and commit only the
accepted ones.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct


@struct.dataclass
class NewKV:
    """K/V of the T tokens of one forward pass."""

    k: jax.Array  # [L, B, T, Hkv, D]
    v: jax.Array  # [L, B, T, Hkv, D]


@struct.dataclass
class KVCache:
    """Static-shape cache. Row b holds its committed tokens in slots [0, length[b])."""

    k: jax.Array  # [L, B, S, Hkv, D]
    v: jax.Array  # [L, B, S, Hkv, D]
    length: jax.Array  # [B] int32, committed tokens per row

    @classmethod
    def init(cls, num_layers: int, batch: int, max_len: int, num_kv_heads: int, head_dim: int,
             dtype=jnp.float32) -> "KVCache":
        shape = (num_layers, batch, max_len, num_kv_heads, head_dim)
        return cls(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype), jnp.zeros((batch,), jnp.int32))

    @property
    def max_len(self) -> int:
        return self.k.shape[2]

    @property
    def batch(self) -> int:
        return self.k.shape[1]

    def visible(self) -> jax.Array:
        """[B, S] bool: the slots holding committed tokens."""
        return jnp.arange(self.max_len)[None, :] < self.length[:, None]

    def write(self, new: NewKV, src: jax.Array, dst: jax.Array) -> "KVCache":
        """Copies new-token K/V `src[b, i]` into slot `dst[b, i]`; a dst >= S is dropped.

        src, dst: [B, n] int32. `length` is unchanged.
        """
        b = jnp.broadcast_to(jnp.arange(src.shape[0])[:, None], src.shape)
        k = self.k.at[:, b, dst].set(new.k[:, b, src], mode="drop")
        v = self.v.at[:, b, dst].set(new.v[:, b, src], mode="drop")
        return self.replace(k=k, v=v)

    def append(self, new: NewKV, src: jax.Array, count: jax.Array) -> "KVCache":
        """Appends new tokens src[b, :count[b]] after row b's committed tokens.

        src: [B, n] int32 indices into the new tokens; count: [B] int32 (0..n).
        """
        i = jnp.arange(src.shape[1])[None, :]
        dst = jnp.where(i < count[:, None], self.length[:, None] + i, self.max_len)
        return self.write(new, src, dst).replace(length=self.length + count)
