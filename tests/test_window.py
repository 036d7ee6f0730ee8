"""The lookahead window: init, warm-up fill, full slide and the n-grams it completes.

Pinned against a Python model of the window driven by random "model predictions":
  * warm-up (filled < N-1): the new level is the prediction at level filled-1 (the step
    indices `newest_index` names); it is
    appended as level `filled`, `filled` increments, nothing slides;
  * full: level l takes level l+1, the new level goes at the bottom (level N-2); level 0
    column 0 is the current token's place, replaced by the next current token at the next step;
  * ngrams(): column i is (grid[0, i], ..., grid[N-2, i], new[i]).
And semantically with a bigram oracle (prediction = f(token)): once warm, every column below
level 0 column 0 is an f-trajectory, so the harvested n-grams of columns i >= 1 are exact.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lookahead_jax.lookahead.config import LookaheadConfig
from lookahead_jax.lookahead.window import Window

SHAPES = [(1, 2), (3, 2), (4, 3), (2, 5), (3, 4)]


@jax.jit
def _step(window: Window, current, preds):
    """What a lookahead step does with the window, given the argmax at every window position
    preds [B, N-1, W]: the grid fed, the new level, the completed n-grams, the next window."""
    b, levels, w = preds.shape
    grid = window.with_current(current)
    step_index = jnp.arange(levels * w).reshape(levels, w)  # row-major, as StepLayout
    new = preds.reshape(b, -1)[:, window.newest_index(step_index)]
    return grid, new, window.ngrams(grid, new), window.advance(grid, new)


_init = jax.jit(Window.init, static_argnums=(3, 4))


@pytest.mark.parametrize("fill", ["prompt", "vocab"])
def test_init(fill):
    cfg = LookaheadConfig(W=6, N=4, G=2, init_fill=fill)
    prompt = jnp.asarray([[5, 6, 7, 0, 0, 0, 0, 0], [9, 10, 11, 12, 13, 14, 15, 16]], jnp.int32)
    lengths = jnp.asarray([3, 8], jnp.int32)
    w = _init(jax.random.key(0), prompt, lengths, cfg, 40)
    tok = np.asarray(w.tokens)
    assert tok.shape == (2, 3, 6) and tok.dtype == np.int32
    assert int(w.filled) == 1 and not bool(w.full)
    if fill == "prompt":  # drawn from each row's own real prompt tokens, never the padding
        assert set(tok[0].ravel()) <= {5, 6, 7} and set(tok[1].ravel()) <= set(range(9, 17))
        assert len(set(tok[1].ravel())) > 1
    else:
        assert ((tok >= 0) & (tok < 40)).all() and len(set(tok.ravel())) > 3
    again = _init(jax.random.key(0), prompt, lengths, cfg, 40)
    np.testing.assert_array_equal(np.asarray(again.tokens), tok)  # the run's key decides
    other = _init(jax.random.key(1), prompt, lengths, cfg, 40)
    assert (np.asarray(other.tokens) != tok).any()
    # N = 2: one level, full from the start
    w2 = _init(jax.random.key(0), prompt, lengths, LookaheadConfig(W=3, N=2, G=1), 40)
    assert w2.tokens.shape == (2, 1, 3) and bool(w2.full)


@pytest.mark.parametrize("W,N", SHAPES)
def test_warmup_then_slide_match_python_model(W, N):
    rng = np.random.default_rng(W * 10 + N)
    b, levels = 2, N - 1
    init = rng.integers(0, 100, (b, levels, W)).astype(np.int32)
    window = Window(jnp.asarray(init), jnp.ones((), jnp.int32))
    ref = init.copy()  # Python model of window.tokens
    filled = 1
    for step in range(N + 3):
        current = rng.integers(100, 200, b).astype(np.int32)
        preds = rng.integers(200, 300, (b, levels, W)).astype(np.int32)
        grid, new, grams, window = _step(window, jnp.asarray(current), jnp.asarray(preds))
        grid, new, grams = np.asarray(grid), np.asarray(new), np.asarray(grams)

        want_grid = ref.copy()
        want_grid[:, 0, 0] = current  # the current token is level 0 column 0
        np.testing.assert_array_equal(grid, want_grid)
        np.testing.assert_array_equal(new, preds[:, filled - 1])  # newest filled level's preds
        assert grams.shape == (b, W, N)
        for i in range(W):
            np.testing.assert_array_equal(grams[:, i], np.concatenate(
                [want_grid[:, :, i], new[:, i:i + 1]], axis=1))

        if filled < levels:  # warm-up: append below, no slide
            ref = want_grid.copy()
            ref[:, filled] = new
            filled += 1
        else:  # full: slide up one level, new at the bottom
            ref = np.concatenate([want_grid[:, 1:], new[:, None]], axis=1)
        np.testing.assert_array_equal(np.asarray(window.tokens), ref, err_msg=f"step {step}")
        assert int(window.filled) == filled
        assert bool(window.full) == (filled == levels)


def test_slide_details():
    """Full window, N=4, W=3: level 0 <- level 1, level 1 <- level 2, level 2 <- new; at the next
    step column 0 of level 0 (old level 1's first token) gives way to the current token."""
    tokens = jnp.asarray([[[0, 1, 2], [10, 11, 12], [20, 21, 22]]], jnp.int32)
    w = Window(tokens, jnp.asarray(3, jnp.int32))
    assert bool(w.full)
    grid = w.with_current(jnp.asarray([7], jnp.int32))
    assert np.asarray(grid).tolist() == [[[7, 1, 2], [10, 11, 12], [20, 21, 22]]]
    new = jnp.asarray([[30, 31, 32]], jnp.int32)
    assert np.asarray(w.ngrams(grid, new)).tolist() == [
        [[7, 10, 20, 30], [1, 11, 21, 31], [2, 12, 22, 32]]]
    w = w.advance(grid, new)
    assert np.asarray(w.tokens).tolist() == [[[10, 11, 12], [20, 21, 22], [30, 31, 32]]]
    assert int(w.filled) == 3
    assert np.asarray(w.with_current(jnp.asarray([8], jnp.int32))).tolist() == [
        [[8, 11, 12], [20, 21, 22], [30, 31, 32]]]
    index = jnp.arange(9).reshape(3, 3)
    assert np.asarray(w.newest_index(index)).tolist() == [6, 7, 8]  # the last level's tokens
    warm = Window(tokens, jnp.asarray(2, jnp.int32))
    assert np.asarray(warm.newest_index(index)).tolist() == [3, 4, 5]  # newest filled level


@pytest.mark.parametrize("W,N", [(4, 3), (3, 5)])
def test_bigram_oracle_makes_columns_exact_ngrams(W, N):
    """With predictions f(token) at every window position (a bigram model), once the window is
    full each column i >= 1 it harvests is the exact trajectory (a, f(a), f(f(a)), ...)."""
    vocab = 50
    f = np.random.default_rng(0).permutation(vocab).astype(np.int32)
    rng = np.random.default_rng(1)
    window = Window(jnp.asarray(rng.integers(0, vocab, (1, N - 1, W)), jnp.int32),
                    jnp.ones((), jnp.int32))
    harvested = 0
    for _ in range(N + 4):
        current = jnp.asarray(rng.integers(0, vocab, 1), jnp.int32)
        preds = jnp.asarray(f)[window.with_current(current)]  # f at every window position
        full_before = bool(window.full)
        _, _, grams, window = _step(window, current, preds)
        if full_before:
            for i in range(1, W):
                col = np.asarray(grams)[0, i]
                np.testing.assert_array_equal(col[1:], f[col[:-1]])
                harvested += 1
    assert harvested >= W - 1
