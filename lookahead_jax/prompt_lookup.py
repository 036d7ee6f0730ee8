"""Prompt lookup decoding (`--method=prompt_lookup`): a draft copied from the sequence itself.

The cheap, model-free baseline of Hugging Face's `prompt_lookup_num_tokens`, in our framework.
At each step the last n tokens of the sequence so far (prompt + generated, ending with the
current token) are searched for in that same sequence, n = max_ngram down to 1: the most
recent earlier occurrence of the longest suffix that occurs proposes the (up to) `num_tokens`
tokens that followed it (`find_draft`; no occurrence: an empty draft, a plain step). One
forward pass over [current token | draft] with a causal mask scores the draft, and the
verifier of lookahead decoding (`verify.py`, the draft as its single candidate, valid token by
token) decides:

  greedy:   the longest draft prefix the model's argmax agrees with is accepted;
  sampling: draft token x is accepted with probability p(x) (p the `Sampling`-warped target),
            else the step's last token is drawn from p with x removed, renormalised; this is
            the rejection rule for a deterministic draft, so the distribution is exact.

Either way the model's own next token follows the accepted ones, so a step emits 1 to
num_tokens + 1 tokens, and the accepted tokens' K/V are committed straight from the forward
pass (`KVCache.append`). Greedy output equals plain greedy decoding token for token.

State is static-shaped: the sequence lives in a history buffer [B, prompt bucket +
max_new_tokens] and the search is vectorised over all its positions at once, so the whole
generation after the prefill is one `lax.while_loop` (`Method.run`), for any batch.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx, struct

from lookahead_jax.generation import Output
from lookahead_jax.method import First, Method
from lookahead_jax.lookahead.verify import verify_greedy, verify_sampling
from models.config import ConfigError
from models.kv_cache import KVCache
from models.layers import causal_mask

DEFAULT_TOKENS = 10  # draft length L (`--pl_tokens`)
DEFAULT_NGRAM = 3  # longest suffix searched for (`--pl_ngram`)


def find_draft(history: jax.Array, length: jax.Array, *, max_ngram: int,
               num_tokens: int) -> tuple[jax.Array, jax.Array]:
    """The draft for each row: what followed the latest earlier occurrence of the sequence's
    last n tokens, for the largest n <= max_ngram that occurs.

    history [B, H] int32: row b's sequence in history[b, :length[b]] (the current token last;
    the rest of the row is ignored); length [B] int32, >= 1. An occurrence must end before the
    last token (so at least one token follows it and the suffix never matches itself).
    Returns draft [B, num_tokens] int32 (zeros past the draft) and draft_len [B] int32 (0 when
    nothing matches; else min(num_tokens, tokens after the occurrence)).
    """
    b, h = history.shape
    rows = jnp.arange(b)
    end = jnp.arange(h, dtype=jnp.int32)[None, :]  # [1, H] last position of an occurrence
    match = end < (length - 1)[:, None]  # [B, H] occurrences of the empty suffix
    best = jnp.full((b,), -1, jnp.int32)  # end of the chosen occurrence, -1: none
    for i in range(max_ngram):  # match now holds occurrences of the last i + 1 tokens
        want = history[rows, jnp.maximum(length - 1 - i, 0)]  # the suffix's (i+1)-th last
        back = jnp.pad(history, ((0, 0), (i, 0)))[:, :h]  # back[:, e] = history[:, e - i]
        match = match & (end >= i) & (i < length)[:, None] & (back == want[:, None])
        found = match.any(axis=1)
        latest = (h - 1 - jnp.argmax(match[:, ::-1], axis=1)).astype(jnp.int32)
        best = jnp.where(found, latest, best)  # a longer suffix that occurs wins
    start = best + 1
    draft_len = jnp.where(best >= 0, jnp.minimum(num_tokens, length - start), 0)
    j = jnp.arange(num_tokens, dtype=jnp.int32)[None, :]
    draft = jnp.take_along_axis(history, jnp.clip(start[:, None] + j, 0, h - 1), axis=1)
    return jnp.where(j < draft_len[:, None], draft, 0), draft_len.astype(jnp.int32)


@struct.dataclass
class PromptLookupStats:
    accepted_hist: jax.Array  # [L+1] int32: live row-steps that accepted k draft tokens
    draft_hits: jax.Array  # [] int32: live row-steps with a non-empty draft
    drafted: jax.Array  # [] int32: draft tokens proposed to live rows
    row_steps: jax.Array  # [] int32: live row-steps


@struct.dataclass
class PromptLookupState:
    cache: KVCache
    out: Output
    token: jax.Array  # [B] int32, the current token: emitted, not yet in the cache
    history: jax.Array  # [B, P + M] int32: prompt + emitted tokens (the current one last)
    hist_len: jax.Array  # [B] int32
    key: jax.Array
    steps: jax.Array  # [] int32, forward passes (prefill included)
    stats: PromptLookupStats


@dataclasses.dataclass(frozen=True)
class PromptLookup(Method):
    """Prompt lookup decoding with drafts of up to `num_tokens` tokens, found by the sequence's
    last `max_ngram` .. 1 tokens. Greedy or sampling (exact, see the module docstring)."""

    num_tokens: int = DEFAULT_TOKENS
    max_ngram: int = DEFAULT_NGRAM
    verifier: Callable = verify_sampling  # the acceptance rule used when sampling (step.Verifier)

    name = "prompt_lookup"

    def __post_init__(self):
        super().__post_init__()
        for name, flag in (("num_tokens", "pl_tokens"), ("max_ngram", "pl_ngram")):
            value = getattr(self, name)
            if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"prompt lookup: {name} (--{flag}) must be an integer >= 1, "
                                  f"got {value!r}")

    def cache_capacity(self, model_config) -> int:
        return self.num_tokens + 1  # a step commits the current token and the accepted draft

    def start(self, model, params, first: First) -> PromptLookupState:
        """The history buffer (prompt + first token) beside the prefilled cache."""
        tokens, lengths = first.tokens, first.lengths
        b, p = tokens.shape
        m = first.out.tokens.shape[1]
        history = jnp.zeros((b, p + m), jnp.int32).at[:, :p].set(tokens)
        history = history.at[jnp.arange(b), lengths].set(first.token)
        stats = PromptLookupStats(jnp.zeros((self.num_tokens + 1,), jnp.int32),
                                  *(jnp.zeros((), jnp.int32) for _ in range(3)))
        return PromptLookupState(first.cache, first.out, first.token, history,
                                 (lengths + 1).astype(jnp.int32), first.key,
                                 jnp.ones((), jnp.int32), stats)

    def step(self, model: nnx.Module, params, state: PromptLookupState, *,
             eos_ids: tuple[int, ...]) -> PromptLookupState:
        """One forward pass over [current | draft]; emits 1..num_tokens + 1 tokens per row."""
        n = self.num_tokens
        cache = state.cache
        b = state.token.shape[0]
        rows = jnp.arange(b)
        live = ~state.out.done
        draft, draft_len = find_draft(state.history, state.hist_len, max_ngram=self.max_ngram,
                                      num_tokens=n)
        fed = jnp.concatenate([state.token[:, None], draft], axis=1)  # [B, L+1]
        offsets = jnp.arange(n + 1, dtype=jnp.int32)
        positions = cache.length[:, None] + offsets[None, :]
        mask = causal_mask(jnp.full((b,), n + 1, jnp.int32), n + 1, cache)
        logits, new_kv = model(fed, positions, mask, cache)  # [B, L+1, V]

        # the draft is the verifier's one candidate, valid token by token
        cands = draft[:, None, :]  # [B, 1, L]
        valid = (offsets[None, :n] < draft_len[:, None])[:, None, :]  # [B, 1, L]
        key = state.key
        if self.sampling.greedy:
            preds = jnp.argmax(logits, axis=-1).astype(jnp.int32)
            verdict = verify_greedy(preds[:, 0], preds[:, None, 1:], cands, valid)
        else:
            key, sub = jax.random.split(key)
            verdict = self.verifier(sub, self.sampling, logits[:, 0], logits[:, None, 1:],
                                    cands, valid)

        # commit the current token's and the accepted draft tokens' K/V: step slots 0..k
        cache = cache.append(new_kv, jnp.broadcast_to(offsets[None], (b, n + 1)),
                             jnp.where(live, verdict.count, 0))
        out, taken = state.out.emit(verdict.tokens, verdict.count, eos_ids)
        token = verdict.tokens[rows, verdict.accepted]
        dst = jnp.where(offsets[None, :] < taken[:, None], state.hist_len[:, None] + offsets,
                        state.history.shape[1])
        history = state.history.at[rows[:, None], dst].set(verdict.tokens, mode="drop")

        live_i = live.astype(jnp.int32)
        stats = PromptLookupStats(
            state.stats.accepted_hist.at[verdict.accepted].add(live_i),
            state.stats.draft_hits + ((draft_len > 0) & live).sum(dtype=jnp.int32),
            state.stats.drafted + jnp.where(live, draft_len, 0).sum(dtype=jnp.int32),
            state.stats.row_steps + live_i.sum())
        return PromptLookupState(cache, out, token, history, state.hist_len + taken, key,
                                 state.steps + 1, stats)

    def summary(self, state: PromptLookupState) -> dict:
        """A finished run's statistics (host side)."""
        hist = np.asarray(state.stats.accepted_hist)
        row_steps = int(state.stats.row_steps)
        drafted = int(state.stats.drafted)
        accepted = int((hist * np.arange(len(hist))).sum())
        return {
            "num_tokens": self.num_tokens, "max_ngram": self.max_ngram,
            "accepted_hist": hist.tolist(),
            "draft_hit_rate": int(state.stats.draft_hits) / row_steps if row_steps else 0.0,
            "draft_acceptance": accepted / drafted if drafted else 0.0,
        }
