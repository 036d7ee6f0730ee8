"""The n-gram pool: a fixed-size on-device table of n-grams keyed by their first token.

Layout: `grams [B, K, C, N]` and `stamp [B, K, C]`. An n-gram (key, t1..t_{N-1}) lives in
bucket `key % K` (K = vocabulary size by default, so one bucket per token id), in one of C
slots; the key is stored with it so hashed buckets (K < V) stay exact. `stamp` is the
insertion clock of a slot (-1 = empty). Inserting an n-gram already present refreshes its
stamp (it becomes the newest); otherwise it replaces the bucket's empty or oldest slot.
Lookup returns the G newest n-grams whose key is the given token.

Memory is B*K*C*(N+1)*4 bytes, fixed at init: e.g. 17.7 MB for V=49152, C=15, N=5, B=1.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct


@struct.dataclass
class NGramPool:
    grams: jax.Array  # [B, K, C, N] int32: key token followed by N-1 tokens
    stamp: jax.Array  # [B, K, C] int32, -1 = empty
    clock: jax.Array  # [] int32, the next stamp

    @classmethod
    def init(cls, batch: int, keys: int, slots: int, n: int) -> "NGramPool":
        return cls(jnp.zeros((batch, keys, slots, n), jnp.int32),
                   jnp.full((batch, keys, slots), -1, jnp.int32), jnp.zeros((), jnp.int32))

    @property
    def nbytes(self) -> int:
        return int(self.grams.size * 4 + self.stamp.size * 4)

    def _insert_one(self, gram: jax.Array, valid: jax.Array) -> "NGramPool":
        """gram [B, N], valid [B] bool."""
        b = jnp.arange(gram.shape[0])
        bucket = gram[:, 0] % self.grams.shape[1]
        rows = self.grams[b, bucket]  # [B, C, N]
        stamps = self.stamp[b, bucket]  # [B, C]
        same = jnp.all(rows == gram[:, None, :], axis=-1) & (stamps >= 0)
        slot = jnp.where(same.any(-1), jnp.argmax(same, -1), jnp.argmin(stamps, -1))
        new_gram = jnp.where(valid[:, None], gram, rows[b, slot])
        new_stamp = jnp.where(valid, self.clock, stamps[b, slot])
        return NGramPool(self.grams.at[b, bucket, slot].set(new_gram),
                         self.stamp.at[b, bucket, slot].set(new_stamp), self.clock + 1)

    def insert(self, grams: jax.Array, valid: jax.Array) -> "NGramPool":
        """Inserts grams [B, M, N] in order m = 0..M-1 where valid [B, M]."""
        def body(m, pool):
            return pool._insert_one(grams[:, m], valid[:, m])
        return jax.lax.fori_loop(0, grams.shape[1], body, self)

    def lookup(self, token: jax.Array, g: int) -> tuple[jax.Array, jax.Array]:
        """token [B] -> candidates [B, g, N-1] (newest first) and their validity [B, g]."""
        b = jnp.arange(token.shape[0])
        bucket = token % self.grams.shape[1]
        rows = self.grams[b, bucket]  # [B, C, N]
        ok = (self.stamp[b, bucket] >= 0) & (rows[..., 0] == token[:, None])
        score = jnp.where(ok, self.stamp[b, bucket], -1)
        top, idx = jax.lax.top_k(score, g)
        cands = jnp.take_along_axis(rows[..., 1:], idx[..., None], axis=1)
        return cands, top >= 0


def prompt_ngrams(tokens: jax.Array, lengths: jax.Array, n: int) -> tuple[jax.Array, jax.Array]:
    """Every n-gram of right-padded prompts tokens [B, P]: grams [B, P-n+1, n], valid [B, P-n+1]."""
    p = tokens.shape[1]
    m = max(p - n + 1, 0)
    idx = jnp.arange(m)[:, None] + jnp.arange(n)[None, :]
    grams = tokens[:, idx]
    return grams, (jnp.arange(m)[None, :] + n) <= lengths[:, None]


def committed_ngrams(history: jax.Array, hist_len: jax.Array, emitted: jax.Array,
                     n_emitted: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """The n-grams ending at each newly committed token, and the updated history.

    history [B, N-1]: the last committed tokens (right-aligned), hist_len [B] how many are real;
    emitted [B, E] with n_emitted [B] valid. Returns grams [B, E, N], valid [B, E],
    new history [B, N-1] and new hist_len [B].
    """
    n1 = history.shape[1]
    e = emitted.shape[1]
    seq = jnp.concatenate([history, emitted], axis=1)  # [B, N-1+E]
    j = jnp.arange(e)
    grams = seq[:, j[:, None] + jnp.arange(n1 + 1)[None, :]]  # [B, E, N]
    valid = (j[None, :] < n_emitted[:, None]) & (hist_len[:, None] + j[None, :] >= n1)
    start = n_emitted[:, None] + jnp.arange(n1)[None, :]  # keep seq[n_emitted : n_emitted+N-1]
    new_history = jnp.take_along_axis(seq, start, axis=1)
    return grams, valid, new_history, jnp.minimum(hist_len + n_emitted, n1)
