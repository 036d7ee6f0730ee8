"""Plain autoregressive decoding: the baseline every faster method must reproduce exactly.

`plain_init` runs the prefill and picks the first token; `plain_run` advances the whole batch
one token per step inside one `lax.while_loop`, for at most `max_steps` steps per call (so a
caller can stream in chunks without recompiling).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx, struct

from lookahead_jax.generation import Output, prefill, run_steps
from lookahead_jax.sampling import Sampling
from models.kv_cache import KVCache


@struct.dataclass
class PlainState:
    cache: KVCache
    out: Output
    token: jax.Array  # [B] int32, the last emitted token (fed at the next step)
    key: jax.Array  # PRNG key
    steps: jax.Array  # [] int32, forward passes so far (the prefill counts as one)


def plain_init(graphdef: nnx.GraphDef, params: nnx.State, tokens: jax.Array, lengths: jax.Array,
               cache: KVCache, key: jax.Array, *, sampling: Sampling, max_new_tokens: int,
               eos_ids: tuple[int, ...]) -> PlainState:
    """Prefill, then sample the first new token. tokens [B,P] (right-padded), lengths [B]."""
    model = nnx.merge(graphdef, params)
    logits, cache = prefill(model, tokens, lengths, cache)
    key, sub = jax.random.split(key)
    first = sampling.sample(sub, logits)
    out, _ = Output.init(tokens.shape[0], max_new_tokens).emit(
        first[:, None], jnp.ones_like(lengths), eos_ids)
    return PlainState(cache, out, first, key, jnp.ones((), jnp.int32))


def plain_step(model: nnx.Module, state: PlainState, *, sampling: Sampling,
               eos_ids: tuple[int, ...]) -> PlainState:
    """Feeds each row's last token, commits its K/V, emits the next token."""
    cache = state.cache
    tok = state.token[:, None]
    pos = cache.length[:, None]
    mask = jnp.concatenate([cache.visible()[:, None, :], jnp.ones_like(tok, bool)[:, :, None]], -1)
    logits, new_kv = model(tok, pos, mask, cache)
    key, sub = jax.random.split(state.key)
    nxt = sampling.sample(sub, logits[:, 0])
    live = (~state.out.done).astype(jnp.int32)
    cache = cache.append(new_kv, jnp.zeros_like(tok), live)
    out, _ = state.out.emit(nxt[:, None], live, eos_ids)
    return PlainState(cache, out, nxt, key, state.steps + 1)


def plain_run(graphdef: nnx.GraphDef, params: nnx.State, state: PlainState, max_steps: jax.Array,
              *, sampling: Sampling, eos_ids: tuple[int, ...]) -> PlainState:
    """Runs up to `max_steps` decode steps (or until every row is done) in one while_loop."""
    model = nnx.merge(graphdef, params)
    return run_steps(lambda s: plain_step(model, s, sampling=sampling, eos_ids=eos_ids), state,
                     max_steps)
