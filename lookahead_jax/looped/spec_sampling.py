"""The speculative-sampling kit of the looped methods: verify drafted tokens against a target
distribution so that the emitted token is distributed exactly as the target.

`verify_drafts` is the standard speculative-sampling cascade over K drafts (each from its own
distribution q_k); `residual_after` is the target left after a rejection; `draft_chances` is
the cascade in expectation, which LoopAhead uses with an early readout in place of the target
to decide what to propose and which children to pause. LoopSpec and LoopAhead both verify with
`verify_drafts`.
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp

# (uniforms u [B,K], target p [B,V], drafts' distributions q [B,K,V], drafted tokens x [B,K],
#  which drafts exist has [B,K], key) -> (accepted draft [B] int32, -1 for none; token [B])
DraftVerifier = Callable[[jax.Array, jax.Array, jax.Array, jax.Array, jax.Array, jax.Array],
                         tuple[jax.Array, jax.Array]]


def verify_drafts(u: jax.Array, p: jax.Array, q: jax.Array, x: jax.Array, has: jax.Array,
                  key: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Speculative sampling of K drafted tokens in cascade: draft k (when it exists and none
    before it was accepted) is accepted with probability min(1, r(x_k) / q_k(x_k)), r the
    residual target (p at first); on its rejection r becomes normalize(max(r - q_k, 0)).
    With none accepted the token is drawn from the final residual. Keeps p exactly.
    u [B, K] uniform in [0, 1); p [B, V]; q [B, K, V]; x [B, K]; has [B, K]."""
    b, k_drafts = x.shape
    rows = jnp.arange(b)
    res = p
    which = jnp.full((b,), -1, jnp.int32)
    for k in range(k_drafts):
        trial = has[:, k] & (which < 0)
        xk = x[:, k]
        total = res.sum(-1)
        accept = trial & (u[:, k] * q[rows, k, xk] * total < res[rows, xk])  # u < r/q
        which = jnp.where(accept, k, which)
        rejected = trial & ~accept
        res = jnp.where(rejected[:, None], residual_after(res, q[:, k]), res)
    drawn = jax.random.categorical(key, jnp.log(res), axis=-1).astype(jnp.int32)
    token = jnp.where(which >= 0, x[rows, jnp.maximum(which, 0)], drawn)
    return which, token


def residual_after(res: jax.Array, qk: jax.Array) -> jax.Array:
    """The target left after rejecting a draft from qk: max(normalize(res) - qk, 0)
    (unnormalised), or res itself where that is empty (res == qk: the draft is never
    rejected). res, qk [..., V]."""
    total = res.sum(-1, keepdims=True)
    nxt = jnp.maximum(res / jnp.maximum(total, 1e-30) - qk, 0.0)
    return jnp.where(nxt.sum(-1, keepdims=True) > 0, nxt, res)


def draft_chances(p: jax.Array, q: jax.Array, x: jax.Array, has: jax.Array
                  ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """`verify_drafts`'s cascade in expectation, for drafted tokens already drawn: against
    target p [..., V], drafts x [..., K] from q [..., K, V] (where has [..., K]) returns each
    draft's probability of being the accepted one [..., K], the probability that all are
    rejected [...], and the final residual (unnormalised) [..., V], the distribution the
    token is then drawn from. LoopAhead uses it with an early readout in place of p to decide
    which children to pause and what to propose next."""
    res = p
    none = jnp.ones(p.shape[:-1], jnp.float32)
    chances = []
    for k in range(x.shape[-1]):
        xk = x[..., k:k + 1]
        r_x = (jnp.take_along_axis(res, xk, axis=-1)[..., 0]
               / jnp.maximum(res.sum(-1), 1e-30))
        q_x = jnp.take_along_axis(q[..., k, :], xk, axis=-1)[..., 0]
        acc = jnp.where(has[..., k], jnp.minimum(1.0, r_x / jnp.maximum(q_x, 1e-30)), 0.0)
        chances.append(none * acc)
        none = none * (1.0 - acc)
        res = jnp.where(has[..., k:k + 1], residual_after(res, q[..., k, :]), res)
    return jnp.stack(chances, axis=-1), none, res
