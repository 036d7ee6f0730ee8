"""Pieces every decoder shares: the output buffer, prompt padding and prefill.

A decoder's whole generation after prefill is one `lax.while_loop`; the host may run it in
chunks of steps (to stream text) but never steps it one token at a time.
"""

from __future__ import annotations

from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx, struct

from models.config import ConfigError
from models.kv_cache import KVCache
from models.layers import causal_mask


@struct.dataclass
class Output:
    """Generated tokens per row; a row is done after EOS or max_new_tokens."""

    tokens: jax.Array  # [B, M] int32
    count: jax.Array  # [B] int32
    done: jax.Array  # [B] bool

    @classmethod
    def init(cls, batch: int, max_new_tokens: int) -> "Output":
        return cls(jnp.zeros((batch, max_new_tokens), jnp.int32), jnp.zeros((batch,), jnp.int32),
                   jnp.zeros((batch,), bool))

    def emit(self, new: jax.Array, n_new: jax.Array, eos_ids: Sequence[int]) -> tuple["Output", jax.Array]:
        """Appends new[b, :n_new[b]] to each row not yet done, stopping after the first EOS
        (which is kept) and at max_new_tokens. new: [B, n]; n_new: [B]. Returns the buffer and
        the number of tokens each row actually took, [B]."""
        b, n = new.shape
        m = self.tokens.shape[1]
        i = jnp.arange(n)[None, :]
        valid = (i < n_new[:, None]) & ~self.done[:, None] & (self.count[:, None] + i < m)
        is_eos = jnp.isin(new, jnp.asarray(eos_ids, jnp.int32)) if eos_ids else jnp.zeros_like(valid)
        eos_here = is_eos & valid
        first_eos = jnp.where(eos_here.any(1), jnp.argmax(eos_here, axis=1), n)
        keep = valid & (i <= first_eos[:, None])
        taken = keep.sum(1).astype(jnp.int32)
        dst = jnp.where(keep, self.count[:, None] + i, m)
        rows = jnp.broadcast_to(jnp.arange(b)[:, None], (b, n))
        tokens = self.tokens.at[rows, dst].set(new, mode="drop")
        count = self.count + taken
        done = self.done | eos_here.any(1) | (count >= m)
        return Output(tokens, count, done), taken


def bucket_length(n: int, minimum: int = 16) -> int:
    """The next power of two >= n (at least `minimum`): prompts padded to few distinct shapes."""
    return max(minimum, 1 << max(0, (n - 1).bit_length()))


def pad_prompts(prompts: Sequence[Sequence[int]], pad_id: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Token lists -> tokens [B, P] (right-padded to a power-of-two bucket), lengths [B]."""
    if not prompts:
        raise ConfigError("no prompts given")
    lengths = np.array([len(p) for p in prompts], np.int32)
    if (lengths == 0).any():
        raise ConfigError("empty prompt: every prompt needs at least one token")
    p = bucket_length(int(lengths.max()))
    tokens = np.full((len(prompts), p), pad_id, np.int32)
    for row, ids in enumerate(prompts):
        tokens[row, : len(ids)] = ids
    return tokens, lengths


def cache_length_for(prompt_bucket: int, max_new_tokens: int, step_tokens: int,
                     max_positions: int, requested: int | None = None) -> int:
    """Static cache size for a run: room for the padded prompt, the new tokens and the widest
    step a decoder feeds, rounded up to 128; or `requested`, checked to be large enough."""
    need = prompt_bucket + max_new_tokens + step_tokens
    if requested:
        if need > requested:
            raise ConfigError(
                f"prompt (padded to {prompt_bucket}) + max_new_tokens ({max_new_tokens}) + "
                f"{step_tokens} step tokens = {need} exceeds the cache length {requested}")
        return requested
    size = -(-need // 128) * 128
    if size > max_positions + 128:
        raise ConfigError(
            f"prompt (padded to {prompt_bucket}) + max_new_tokens ({max_new_tokens}) needs {need} "
            f"positions; the model supports {max_positions}")
    return size


def prefill(model: nnx.Module, tokens: jax.Array, lengths: jax.Array,
            cache: KVCache) -> tuple[jax.Array, KVCache]:
    """Runs the padded prompts [B, P] through the model into an empty cache.

    Returns the logits at each row's last prompt token [B, V] and the cache with
    length = lengths. Padding slots are written but stay invisible and are overwritten later.
    """
    b, p = tokens.shape
    positions = jnp.broadcast_to(jnp.arange(p, dtype=jnp.int32)[None], (b, p))
    last = (lengths - 1).astype(jnp.int32)[:, None]
    logits, new_kv = model(tokens, positions, causal_mask(lengths, p, cache), cache,
                           logits_at=last)
    src = jnp.broadcast_to(jnp.arange(p, dtype=jnp.int32)[None], (b, p))
    cache = cache.write(new_kv, src, src).replace(length=lengths.astype(jnp.int32))
    return logits[:, 0], cache


def run_steps(step, state, max_steps: jax.Array):
    """Applies `step` until every row is done or `max_steps` more steps ran: one while_loop.

    `state` must have `.out` (an Output) and `.steps` (a scalar step counter)."""
    limit = state.steps + max_steps
    return jax.lax.while_loop(lambda s: (~s.out.done.all()) & (s.steps < limit), step, state)
