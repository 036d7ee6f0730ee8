"""The step-cost curve: forward time against the number of tokens in one step.

Lookahead decoding trades more tokens per forward pass for fewer passes. Whether that pays
depends on the device: on a GPU a step of 100 tokens costs about as much as one of 1 token
(memory-bound); on a small CPU it costs much more (compute-bound). `measure_step_cost` times
one forward pass of T tokens over a cache of a given length, for several T, on the current
device; `relative_cost` reads the curve in units of a one-token step (what
`lookahead_jax.tuning.auto` divides the scaling law's step compression S by).
"""

from __future__ import annotations

import statistics
import time
from typing import Sequence

import jax
import jax.numpy as jnp
from flax import nnx

from models.layers import causal_mask


def _forward_fn(graphdef):
    def fwd(params, tokens, cache):
        model = nnx.merge(graphdef, params)
        b, t = tokens.shape
        pos = cache.length[:, None] + jnp.arange(t)[None]
        mask = causal_mask(jnp.full((b,), t, jnp.int32), t, cache)
        logits, new_kv = model(tokens, pos, mask, cache)
        return logits.sum(), new_kv
    return jax.jit(fwd)


def measure_step_cost(graphdef: nnx.GraphDef, params: nnx.State, token_counts: Sequence[int], *,
                      cache_len: int = 256, repeats: int = 5) -> dict[int, float]:
    """Median seconds of one forward pass of T tokens (all with logits) after `cache_len`
    committed tokens, for each T in token_counts. Compile time excluded."""
    size = -(-(cache_len + 1) // 128) * 128
    cache = nnx.merge(graphdef, params).init_cache(1, size, jax.tree.leaves(params)[0].dtype)
    cache = cache.replace(length=jnp.full((1,), cache_len, jnp.int32))
    fwd = _forward_fn(graphdef)
    out = {}
    for t in token_counts:
        tokens = jnp.ones((1, int(t)), jnp.int32)
        jax.block_until_ready(fwd(params, tokens, cache))  # compile + warm
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            jax.block_until_ready(fwd(params, tokens, cache))
            times.append(time.perf_counter() - t0)
        out[int(t)] = statistics.median(times)
    return out


def relative_cost(costs: dict[int, float], tokens: int) -> float:
    """Cost of a step of `tokens` tokens in units of the smallest measured step (T = 1 when
    measured), interpolated linearly between measured T and extrapolated linearly above."""
    ts = sorted(costs)
    base = costs[ts[0]]
    if tokens <= ts[0]:
        return 1.0
    for lo, hi in zip(ts, ts[1:]):
        if tokens <= hi:
            return (costs[lo] + (costs[hi] - costs[lo]) * (tokens - lo) / (hi - lo)) / base
    return costs[ts[-1]] * tokens / ts[-1] / base

