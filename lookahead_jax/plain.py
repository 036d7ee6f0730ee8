"""Plain autoregressive decoding (`--method=ar`): the baseline every faster method must
reproduce exactly. Each step feeds every row's last token, commits its K/V and emits the next
token; the whole generation after the prefill is one `lax.while_loop` (`Method.run`)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx, struct

from lookahead_jax.generation import Output
from lookahead_jax.method import First, Method
from models.kv_cache import KVCache


@struct.dataclass
class PlainState:
    cache: KVCache
    out: Output
    token: jax.Array  # [B] int32, the last emitted token (fed at the next step)
    key: jax.Array  # PRNG key
    steps: jax.Array  # [] int32, forward passes so far (the prefill counts as one)


@dataclasses.dataclass(frozen=True)
class Plain(Method):
    """Plain autoregressive decoding (`--method=ar`)."""

    name = "ar"

    def cache_capacity(self, model_config) -> int:
        return 1

    def start(self, model: nnx.Module, params, first: First) -> PlainState:
        return PlainState(first.cache, first.out, first.token, first.key,
                          jnp.ones((), jnp.int32))

    def step(self, model: nnx.Module, params, state: PlainState, *,
             eos_ids: tuple[int, ...]) -> PlainState:
        """Feeds each row's last token, commits its K/V, emits the next token."""
        cache = state.cache
        tok = state.token[:, None]
        pos = cache.length[:, None]
        mask = jnp.concatenate([cache.visible()[:, None, :], jnp.ones_like(tok, bool)[:, :, None]],
                               -1)
        logits, new_kv = model(tok, pos, mask, cache)
        key, sub = jax.random.split(state.key)
        nxt = self.sampling.sample(sub, logits[:, 0])
        live = (~state.out.done).astype(jnp.int32)
        cache = cache.append(new_kv, jnp.zeros_like(tok), live)
        out, _ = state.out.emit(nxt[:, None], live, eos_ids)
        return PlainState(cache, out, nxt, key, state.steps + 1)
