"""One lookahead decoding step, and the compiled loop that repeats it.

Each step feeds [current token | window | candidates] (see `layout.py`) through the model in
one forward pass, then:
  1. the window's newest level becomes the argmax at its positions (`window.py`);
  2. once the window is full, its W completed n-grams go into the pool (`ngram_pool.py`);
  3. the candidates, looked up in the pool by the current token, are verified (`verify.py`);
  4. the accepted tokens' K/V are committed from the verification branch itself, and the
     accepted tokens plus the model's next token are emitted.
The whole generation after prefill is one `lax.while_loop` (`Method.run`).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx, struct

from lookahead_jax.lookahead.config import LookaheadConfig
from lookahead_jax.generation import Output
from lookahead_jax.lookahead.layout import StepLayout
from lookahead_jax.method import First, Method
from lookahead_jax.lookahead.ngram_pool import NGramPool, committed_ngrams, prompt_ngrams
from lookahead_jax.sampling import Sampling
from lookahead_jax.lookahead.verify import Verdict, verify_greedy, verify_sampling
from lookahead_jax.lookahead.window import Window
from models.kv_cache import KVCache
from pallas_kernels.attention import resolve_attention
from lookahead_jax.lookahead.mask import StepMask, dense_attention

# (key, sampling, logits at the current token [B,V], at the candidates [B,G,N-1,V],
#  candidates [B,G,N-1], validity [B,G]) -> Verdict
Verifier = Callable[[jax.Array, Sampling, jax.Array, jax.Array, jax.Array, jax.Array], Verdict]


@struct.dataclass
class LookaheadStats:
    accepted_hist: jax.Array  # [N] int32: steps that accepted k candidate tokens, k = 0..N-1
    pool_hits: jax.Array  # [] int32: live row-steps whose current token had a candidate
    row_steps: jax.Array  # [] int32: live row-steps


@struct.dataclass
class LookaheadState:
    cache: KVCache
    out: Output
    token: jax.Array  # [B] int32, the current token: emitted, not yet in the cache
    window: Window
    pool: NGramPool
    history: jax.Array  # [B, N-1] the last committed tokens (for prompt seeding)
    hist_len: jax.Array  # [B]
    key: jax.Array
    steps: jax.Array  # [] int32, forward passes (prefill included)
    stats: LookaheadStats


def lookahead_start(first: First, cfg: LookaheadConfig, vocab_size: int) -> LookaheadState:
    """The state after the prefill and the first token: the initial window (its first
    guesses drawn with `first.start_key`) and the pool (seeded with the prompt's n-grams and
    the first token when enabled)."""
    tokens, lengths = first.tokens, first.lengths
    b = tokens.shape[0]
    window = Window.init(first.start_key, tokens, lengths, cfg, vocab_size)
    pool = NGramPool.init(b, cfg.keys(vocab_size) if cfg.G else 1, cfg.slots, cfg.N)
    n1 = cfg.N - 1
    pos = lengths[:, None] - n1 + jnp.arange(n1)[None, :]
    history = jnp.take_along_axis(tokens, jnp.maximum(pos, 0), axis=1)
    hist_len = jnp.minimum(lengths, n1)
    if cfg.prompt_seeding and cfg.G:
        pool = pool.insert(*prompt_ngrams(tokens, lengths, cfg.N))
        grams, valid, history, hist_len = committed_ngrams(history, hist_len, first.token[:, None],
                                                           jnp.ones_like(lengths))
        pool = pool.insert(grams, valid)
    stats = LookaheadStats(jnp.zeros((cfg.N,), jnp.int32), jnp.zeros((), jnp.int32),
                           jnp.zeros((), jnp.int32))
    return LookaheadState(first.cache, first.out, first.token, window, pool, history, hist_len,
                          first.key, jnp.ones((), jnp.int32), stats)


def step_candidates(state: LookaheadState, cfg: LookaheadConfig) -> tuple[jax.Array, jax.Array]:
    """The pool's candidates for the current token: [B, G, N-1] tokens, [B, G] validity."""
    if cfg.G:
        return state.pool.lookup(state.token, cfg.G)
    b = state.token.shape[0]
    return jnp.zeros((b, 0, cfg.N - 1), jnp.int32), jnp.zeros((b, 0), bool)


def lookahead_step(model: nnx.Module, state: LookaheadState, *, cfg: LookaheadConfig,
                   sampling: Sampling, eos_ids: tuple[int, ...],
                   verifier: Verifier = verify_sampling,
                   attention_fn=dense_attention) -> LookaheadState:
    """One forward pass over [current | window | candidates]; emits 1..N tokens per row.

    The model's attention gets a `StepMask` (cache lengths + layout) that `attention_fn`
    (the dense reference or the Pallas kernel, see `pallas_kernels`) understands.

    `verifier` decides the tokens when sampling (temperature > 0); greedy uses verify_greedy.
    """
    layout = StepLayout.of(cfg)
    cache = state.cache
    b = state.token.shape[0]
    live = ~state.out.done
    win_idx = jnp.asarray(layout.window_index)
    cand_idx = jnp.asarray(layout.candidate_index)

    grid = state.window.with_current(state.token)  # [B, N-1, W]
    cands, cand_valid = step_candidates(state, cfg)  # [B, G, N-1], [B, G]
    step_tokens = jnp.zeros((b, layout.size), jnp.int32).at[:, win_idx].set(grid)
    step_tokens = step_tokens.at[:, cand_idx].set(cands)
    positions = cache.length[:, None] + jnp.asarray(layout.offsets)[None, :]
    mask = StepMask(cache.length, layout, cache.max_len)  # [cache.visible() | layout.mask]
    # logits only where they are read: the current token, the newest window level, candidates
    readout = jnp.concatenate([jnp.zeros((1,), jnp.int32), state.window.newest_index(win_idx),
                               cand_idx.reshape(-1)])
    logits, new_kv = model(step_tokens, positions, mask, cache, attention_fn=attention_fn,
                           logits_at=jnp.broadcast_to(readout[None], (b, readout.shape[0])))
    preds = jnp.argmax(logits, axis=-1).astype(jnp.int32)  # [B, 1 + W + G(N-1)]
    next0, new_level = preds[:, 0], preds[:, 1: 1 + cfg.W]
    cand_preds = preds[:, 1 + cfg.W:].reshape(b, cfg.G, cfg.N - 1)

    # 3. verification: greedy, or the rejection scheme that keeps the sampling distribution
    key = state.key
    if sampling.greedy:
        verdict = verify_greedy(next0, cand_preds, cands, cand_valid)
    else:
        key, sub = jax.random.split(key)
        cand_logits = logits[:, 1 + cfg.W:].reshape(b, cfg.G, cfg.N - 1, logits.shape[-1])
        verdict = verifier(sub, sampling, logits[:, 0], cand_logits, cands, cand_valid)

    # 4. commit: the current token's K/V, then the accepted candidate tokens' own K/V
    src = jnp.concatenate([jnp.zeros((b, 1), jnp.int32),
                           cand_idx[verdict.best] if cfg.G else jnp.zeros((b, 0), jnp.int32)],
                          axis=1)
    cache = cache.append(new_kv, src, jnp.where(live, verdict.count, 0))
    return advance_state(state, cfg=cfg, eos_ids=eos_ids, grid=grid, new_level=new_level,
                         cand_valid=cand_valid, verdict=verdict, cache=cache, key=key)


def advance_state(state: LookaheadState, *, cfg: LookaheadConfig, eos_ids: tuple[int, ...],
                  grid: jax.Array, new_level: jax.Array, cand_valid: jax.Array, verdict: Verdict,
                  cache: KVCache, key: jax.Array) -> LookaheadState:
    """Everything a step does once the model has spoken and the cache is committed: harvest
    the window's n-grams into the pool, slide the window, emit the verdict's tokens, seed the
    pool with committed n-grams, count. grid [B, N-1, W] (the step's window), new_level [B, W]
    (the argmax at the newest level), cand_valid [B, G]."""
    b = grid.shape[0]
    live = ~state.out.done
    # 1-2. window: the newest level, and the W n-grams it completes once full
    pool = state.pool
    if cfg.G:
        harvest = jnp.broadcast_to((live & state.window.full)[:, None], (b, cfg.W))
        pool = pool.insert(state.window.ngrams(grid, new_level), harvest)
    window = state.window.advance(grid, new_level)

    out, taken = state.out.emit(verdict.tokens, verdict.count, eos_ids)
    token = verdict.tokens[jnp.arange(b), verdict.accepted]

    history, hist_len = state.history, state.hist_len
    if cfg.prompt_seeding and cfg.G:
        grams, valid, history, hist_len = committed_ngrams(history, hist_len, verdict.tokens, taken)
        pool = pool.insert(grams, valid)

    live_i = live.astype(jnp.int32)
    stats = LookaheadStats(
        state.stats.accepted_hist.at[verdict.accepted].add(live_i),
        state.stats.pool_hits + (cand_valid.any(-1) & live).sum(dtype=jnp.int32),
        state.stats.row_steps + live_i.sum())
    return LookaheadState(cache, out, token, window, pool, history, hist_len, key,
                          state.steps + 1, stats)


@dataclasses.dataclass(frozen=True)
class Lookahead(Method):
    """Lookahead decoding (`--method=lookahead`) with settings `config`.

    attention: the steps' attention, 'dense' | 'pallas' | 'auto' (`--attention`; see
    `pallas_kernels.attention`), or an attention function (e.g. the kernel in interpret mode).
    verifier: the acceptance rule used when sampling (tests plant wrong ones).
    """

    config: LookaheadConfig = LookaheadConfig()
    verifier: Verifier = verify_sampling
    attention: Any = "dense"

    name = "lookahead"

    def __post_init__(self):
        super().__post_init__()
        resolve_attention(self.attention)  # an unknown name or unavailable kernel fails here

    def cache_capacity(self, model_config) -> int:
        return self.config.N  # a step commits the current token and up to N-1 accepted ones

    def check(self, model_config) -> None:
        self.config.check_fits(model_config.max_position_embeddings)

    def start(self, model, params, first: First) -> LookaheadState:
        return lookahead_start(first, self.config, model.config.vocab_size)

    def step(self, model, params, state: LookaheadState, *, eos_ids) -> LookaheadState:
        return lookahead_step(model, state, cfg=self.config, sampling=self.sampling,
                              eos_ids=eos_ids, verifier=self.verifier,
                              attention_fn=resolve_attention(self.attention))

    def summary(self, state: LookaheadState) -> dict:
        return summarize(self.config, state)


def summarize(cfg: LookaheadConfig, state: LookaheadState) -> dict:
    """A finished run's lookahead statistics (host side)."""
    hist = np.asarray(state.stats.accepted_hist)
    row_steps = int(state.stats.row_steps)
    return {
        "W": cfg.W, "N": cfg.N, "G": cfg.G,
        "prompt_seeding": cfg.prompt_seeding,
        "accepted_hist": hist.tolist(),
        "pool_hit_rate": int(state.stats.pool_hits) / row_steps if row_steps else 0.0,
        "pool_bytes": state.pool.nbytes,
    }
