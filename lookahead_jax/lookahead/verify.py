"""The verification branch: which candidate tokens the model agrees with.

Sampling: `verify_sampling`, the multi-candidate rejection scheme, below.

Greedy: candidate g's token j is accepted while it equals the model's argmax at the position
before it; the longest accepted prefix over all candidates wins (the first on ties). The
model's own prediction after the last accepted token is emitted too, so a step always yields
at least one token and a fully matched candidate yields N.

Validity is per candidate ([B, G]: lookahead's pool) or per token ([B, G, N-1], a prefix of
each candidate: prompt lookup's variable-length draft); an invalid token is never accepted.
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
from flax import struct

from lookahead_jax.sampling import Sampling


@struct.dataclass
class Verdict:
    accepted: jax.Array  # [B] int32, candidate tokens accepted (0..N-1)
    best: jax.Array  # [B] int32, the winning candidate
    tokens: jax.Array  # [B, N] int32, accepted tokens then the model's next token
    count: jax.Array  # [B] int32, accepted + 1


def token_validity(valid: jax.Array, n1: int) -> jax.Array:
    """valid [B, G] (whole candidates) or [B, G, N-1] (per token) -> [B, G, N-1] bool."""
    if valid.ndim == 3:
        return valid
    return jnp.broadcast_to(valid[:, :, None], (*valid.shape, n1))


def verify_greedy(next0: jax.Array, cand_preds: jax.Array, cands: jax.Array,
                  valid: jax.Array) -> Verdict:
    """next0 [B]: argmax at the current token; cand_preds [B, G, N-1]: argmax at each
    candidate token; cands [B, G, N-1]: the candidates; valid [B, G] or [B, G, N-1]."""
    b, g, n1 = cands.shape
    if g == 0:
        tokens = jnp.zeros((b, n1 + 1), jnp.int32).at[:, 0].set(next0)
        zero = jnp.zeros((b,), jnp.int32)
        return Verdict(zero, zero, tokens, zero + 1)
    expected = jnp.concatenate([jnp.broadcast_to(next0[:, None, None], (b, g, 1)),
                                cand_preds[:, :, :-1]], axis=2)  # model's token at each slot
    match = (cands == expected) & token_validity(valid, n1)
    lengths = jnp.cumprod(match, axis=2).sum(2).astype(jnp.int32)  # [B, G]
    best = jnp.argmax(lengths, axis=1).astype(jnp.int32)
    rows = jnp.arange(b)
    k = lengths[rows, best]
    # after k accepted tokens the model's next token is its prediction at the k-th one
    bonus_after = jnp.concatenate([next0[:, None], cand_preds[rows, best]], axis=1)  # [B, N]
    bonus = jnp.take_along_axis(bonus_after, k[:, None], axis=1)[:, 0]
    tokens = jnp.concatenate([cands[rows, best], jnp.zeros((b, 1), jnp.int32)], axis=1)
    tokens = jnp.where(jnp.arange(n1 + 1)[None, :] == k[:, None], bonus[:, None], tokens)
    return Verdict(k, best, tokens, k + 1)


def verify_sampling(key: jax.Array, sampling: Sampling, logits0: jax.Array,
                    cand_logits: jax.Array, cands: jax.Array, valid: jax.Array) -> Verdict:
    """Multi-candidate rejection sampling (the paper's Algorithm 4); keeps the target
    distribution exactly for deterministic (greedy-window) drafts.

    At each position the surviving candidates' distinct next tokens are tried in order: token
    c is accepted with probability P(c) under the residual target distribution P (warped by
    `sampling`, renormalised); on rejection P(c) is set to 0. After an accept only the
    candidates carrying that token survive; when every distinct token is rejected, a token is
    drawn from the residual and the step ends. After N-1 accepted tokens the next token is
    drawn from the target at the last one.

    logits0 [B, V]: at the current token; cand_logits [B, G, N-1, V]: at each candidate token;
    cands [B, G, N-1]; valid [B, G] or [B, G, N-1] (a position where no surviving candidate
    has a valid token draws from the residual, ending the step).
    """
    rows = jnp.arange(cands.shape[0])

    def logits_at(j, rep):
        return logits0 if j == 0 else cand_logits[rows, rep, j - 1]

    return sampling_verdict(key, sampling, logits_at, cands, valid)


def sampling_verdict(key: jax.Array, sampling: Sampling,
                     logits_at: Callable[[int, jax.Array], jax.Array], cands: jax.Array,
                     valid: jax.Array, agree: Callable | None = None) -> Verdict:
    """`verify_sampling`'s procedure, with the logits supplied per position.

    logits_at(j, rep) -> [B, V]: the logits that predict candidate token j, read at the
    surviving candidate `rep` [B] (j = 0: at the current token; rep is then unused).
    agree(j, rep, (took, token)) -> (took, token): makes every participant use the decision
    taken from the logits of (j, rep); lookahead parallelism passes one that keeps the
    decision of the device holding candidate `rep` (j = 0: device 0). Default: the identity.
    Every random draw is a function of `key` alone, so all participants draw the same numbers.
    """
    agree = agree or (lambda j, rep, decision: decision)
    b, g, n1 = cands.shape
    rows = jnp.arange(b)
    k_try, k_res = jax.random.split(key)
    u = jax.random.uniform(k_try, (b, n1, max(g, 1)))
    res_keys = jax.random.split(k_res, n1 + 1)

    tok_valid = token_validity(valid, n1)  # [B, G, N-1]
    alive = tok_valid[:, :, 0]
    accepted = jnp.zeros((b,), jnp.int32)
    stopped = jnp.zeros((b,), bool)
    final = jnp.zeros((b,), jnp.int32)
    rep = jnp.zeros((b,), jnp.int32)
    for j in range(n1 if g else 0):
        active = ~stopped
        res = jax.nn.softmax(sampling.log_probs(logits_at(j, rep)), axis=-1)
        decided = ~active
        token_j = jnp.zeros((b,), jnp.int32)
        for gi in range(g):
            c = cands[:, gi, j]
            seen = jnp.zeros((b,), bool)
            for gp in range(gi):  # the same token is never tried twice at one position
                seen = seen | (alive[:, gp] & tok_valid[:, gp, j] & (cands[:, gp, j] == c))
            trial = alive[:, gi] & tok_valid[:, gi, j] & ~decided & ~seen
            p_c = res[rows, c] / jnp.maximum(res.sum(-1), 1e-30)
            accept = trial & (u[:, j, gi] < p_c)
            reject = trial & ~accept
            res = jnp.where(reject[:, None], res.at[rows, c].set(0.0), res)
            token_j = jnp.where(accept, c, token_j)
            decided = decided | accept
        took = decided & active
        drawn = jax.random.categorical(res_keys[j], jnp.log(res), axis=-1).astype(jnp.int32)
        took, token_j = agree(j, rep, (took, jnp.where(took, token_j, drawn)))
        final = jnp.where(active & ~took, token_j, final)
        stopped = stopped | (active & ~took)
        accepted = accepted + took.astype(jnp.int32)
        alive = jnp.where(took[:, None],
                          alive & tok_valid[:, :, j] & (cands[:, :, j] == token_j[:, None]), alive)
        rep = jnp.argmax(alive, axis=1).astype(jnp.int32)
    last = n1 if g else 0
    probs = jax.nn.softmax(sampling.log_probs(logits_at(last, rep)), axis=-1)
    drawn = jax.random.categorical(res_keys[n1], jnp.log(probs), axis=-1).astype(jnp.int32)
    _, drawn = agree(last, rep, (stopped, drawn))
    final = jnp.where(stopped, final, drawn)
    best = rep if g else jnp.zeros((b,), jnp.int32)
    base = cands[rows, best] if g else jnp.zeros((b, n1), jnp.int32)
    tokens = jnp.concatenate([base, jnp.zeros((b, 1), jnp.int32)], axis=1)
    tokens = jnp.where(jnp.arange(n1 + 1)[None, :] == accepted[:, None], final[:, None], tokens)
    return Verdict(accepted, best, tokens, accepted + 1)
