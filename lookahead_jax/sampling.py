"""Token selection: greedy, or sampling with temperature, top-k and top-p.

One `Sampling` value describes the target distribution. Plain decoding, lookahead
verification and LoopAhead verification all warp logits through `Sampling.log_probs`, so
"the distribution plain sampling draws from" is defined in exactly one place.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import struct

from models.config import ConfigError


@dataclasses.dataclass(frozen=True)
class Sampling:
    """temperature 0 means greedy (argmax). top_k 0 and top_p 1.0 mean "off"."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0

    def __post_init__(self):
        if not self.temperature >= 0:  # also rejects NaN
            raise ConfigError(f"temperature must be >= 0, got {self.temperature}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise ConfigError(f"top_k must be an integer >= 0 (0 = off), got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise ConfigError(f"top_p must be in (0, 1], got {self.top_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def log_probs(self, logits: jax.Array) -> jax.Array:
        """logits [..., V] -> log-probabilities [..., V] of the warped distribution (float32);
        tokens removed by top-k / top-p get -inf. Order: temperature, top-k, top-p."""
        x = logits.astype(jnp.float32)
        if self.greedy:
            return jnp.where(x == x.max(-1, keepdims=True), 0.0, -jnp.inf)
        # subtract the max first, and never divide by less than the smallest normal float32:
        # a tiny temperature then approaches greedy instead of overflowing to inf / NaN
        tiny = float(jnp.finfo(jnp.float32).tiny)
        x = (x - x.max(-1, keepdims=True)) / max(self.temperature, tiny)
        if self.top_k > 0 and self.top_k < x.shape[-1]:
            kth = jax.lax.top_k(x, self.top_k)[0][..., -1:]
            x = jnp.where(x >= kth, x, -jnp.inf)
        if self.top_p < 1.0:
            sorted_x = jnp.sort(x, axis=-1)[..., ::-1]
            p = jax.nn.softmax(sorted_x, axis=-1)
            before = jnp.cumsum(p, axis=-1) - p  # mass of strictly more likely tokens
            keep = before < self.top_p  # always keeps the most likely token
            threshold = jnp.min(jnp.where(keep, sorted_x, jnp.inf), axis=-1, keepdims=True)
            x = jnp.where(x >= threshold, x, -jnp.inf)
        return jax.nn.log_softmax(x, axis=-1)

    def sample(self, key: jax.Array, logits: jax.Array) -> jax.Array:
        """logits [..., V] -> token ids [...] int32."""
        if self.greedy:
            return jnp.argmax(logits, axis=-1).astype(jnp.int32)
        return jax.random.categorical(key, self.log_probs(logits), axis=-1).astype(jnp.int32)


@struct.dataclass
class SamplingParams:
    """A `Sampling` whose values are arrays: one compiled program serves every temperature,
    top-k and top-p (the server's slots each carry their own). Never greedy (greedy decoding
    takes other branches, so it stays a static `Sampling()`).

    `log_probs` gives exactly `Sampling(temperature, top_k, top_p).log_probs` (the same
    operations on the same values; top-k's threshold is read from a sort instead of
    `lax.top_k`, which returns the same value), so a draw with the same key is the same token.
    """

    temperature: jax.Array  # [] float32, > 0
    top_k: jax.Array  # [] int32, 0 = off
    top_p: jax.Array  # [] float32 in (0, 1]

    greedy = False  # a class attribute, as Sampling.greedy is a property

    @classmethod
    def of(cls, sampling: Sampling) -> "SamplingParams":
        if sampling.greedy:
            raise ConfigError("SamplingParams holds sampling settings; greedy is Sampling()")
        return cls(jnp.float32(sampling.temperature), jnp.int32(sampling.top_k),
                   jnp.float32(sampling.top_p))

    def log_probs(self, logits: jax.Array) -> jax.Array:
        x = logits.astype(jnp.float32)
        v = x.shape[-1]
        tiny = float(jnp.finfo(jnp.float32).tiny)
        x = (x - x.max(-1, keepdims=True)) / jnp.maximum(self.temperature, tiny)
        descending = jnp.sort(x, axis=-1)[..., ::-1]
        k = jnp.clip(self.top_k, 1, v)
        kth = jnp.take_along_axis(descending, jnp.broadcast_to(k - 1, x.shape[:-1])[..., None],
                                  axis=-1)
        x = jnp.where((self.top_k > 0) & (self.top_k < v) & (x < kth), -jnp.inf, x)
        sorted_x = jnp.sort(x, axis=-1)[..., ::-1]
        p = jax.nn.softmax(sorted_x, axis=-1)
        before = jnp.cumsum(p, axis=-1) - p
        threshold = jnp.min(jnp.where(before < self.top_p, sorted_x, jnp.inf), axis=-1,
                            keepdims=True)
        x = jnp.where((self.top_p < 1.0) & (x < threshold), -jnp.inf, x)
        return jax.nn.log_softmax(x, axis=-1)

    def sample(self, key: jax.Array, logits: jax.Array) -> jax.Array:
        return jax.random.categorical(key, self.log_probs(logits), axis=-1).astype(jnp.int32)
