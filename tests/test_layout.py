"""The lookahead step layout (`StepLayout`): order, position offsets and the [T, T] mask.

Pinned two ways:
  * against a brute-force construction written here with explicit loops from the documented
    rules (token order, offsets, who sees whom), for several (W, N, G) including N=2, G=0, W=1;
  * semantically: one lookahead forward pass of a random tiny model over [current | window |
    candidates] gives, at window column i level l, the same logits as a plain causal forward of
    the n-gram trajectory (level0[0..i], level1[i], ..., level_l[i]) appended to the same
    cache; and at candidate g token j the same logits as (current, cand_g[0..j]). I.e. the mask
    and offsets make every column and every candidate an independent sequence.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from lookahead_jax.lookahead.config import LookaheadConfig
from lookahead_jax.generation import pad_prompts, prefill
from lookahead_jax.lookahead.layout import ShardedLayout, StepLayout
from models import KVCache, Llama, LlamaConfig, causal_mask

SHAPES = [(1, 2, 0), (1, 2, 1), (3, 2, 2), (4, 3, 0), (2, 4, 3), (5, 5, 5), (1, 5, 2), (3, 3, 1)]


def brute_tokens(W: int, N: int, G: int) -> list[tuple]:
    """Step tokens in the documented order: the current token (level 0 column 0), window level
    l column i row by row, then candidate g token j."""
    toks = []
    for level in range(N - 1):
        for i in range(W):
            toks.append(("current",) if (level, i) == (0, 0) else ("window", level, i))
    for g in range(G):
        for j in range(N - 1):
            toks.append(("cand", g, j))
    return toks


def _as_window(tok: tuple) -> tuple | None:
    """(level, column) of a window token; the current token is level 0 column 0."""
    if tok[0] == "current":
        return 0, 0
    if tok[0] == "window":
        return tok[1], tok[2]
    return None


def brute_offset(tok: tuple) -> int:
    if tok[0] == "cand":
        return tok[2] + 1
    level, i = _as_window(tok)
    return level + i


def brute_sees(q: tuple, k: tuple) -> bool:
    """Does step token q see step token k? (Both see the committed cache regardless.)"""
    qw, kw = _as_window(q), _as_window(k)
    if qw is not None:  # a window token (or the current token)
        if kw is None:
            return False  # the window never sees candidates
        (lq, iq), (lk, ik) = qw, kw
        return (lk == 0 and ik <= iq) or (1 <= lk <= lq and ik == iq)
    # a candidate token (g, j): the current token and its own tokens 0..j
    if k[0] == "current":
        return True
    if k[0] == "cand":
        return k[1] == q[1] and k[2] <= q[2]
    return False


def brute(W: int, N: int, G: int):
    toks = brute_tokens(W, N, G)
    t = len(toks)
    mask = np.zeros((t, t), bool)
    for a, q in enumerate(toks):
        for b, k in enumerate(toks):
            mask[a, b] = brute_sees(q, k)
    offsets = np.array([brute_offset(tok) for tok in toks], np.int32)
    return toks, offsets, mask


@pytest.mark.parametrize("W,N,G", SHAPES)
def test_layout_matches_brute_force(W, N, G):
    layout = StepLayout(W, N, G)
    toks, offsets, mask = brute(W, N, G)
    assert layout.size == len(toks) == (N - 1) * (W + G)
    assert layout.size == LookaheadConfig(W=W, N=N, G=G).step_tokens
    assert StepLayout.of(LookaheadConfig(W=W, N=N, G=G)) == layout
    np.testing.assert_array_equal(layout.offsets, offsets)
    np.testing.assert_array_equal(layout.mask, mask)
    assert layout.mask.dtype == bool and layout.mask.shape == (len(toks), len(toks))
    # index tables agree with the enumeration order
    assert layout.window_index.shape == (N - 1, W)
    assert layout.candidate_index.shape == (G, N - 1)
    for level in range(N - 1):
        for i in range(W):
            assert _as_window(toks[layout.window_index[level, i]]) == (level, i)
    for g in range(G):
        for j in range(N - 1):
            assert toks[layout.candidate_index[g, j]] == ("cand", g, j)


SHARDED = [(15, 5, 15, 8), (7, 5, 7, 3), (4, 3, 4, 8), (5, 4, 3, 2), (3, 2, 0, 2), (6, 3, 5, 4),
           (1, 2, 1, 1)]


def _share_tokens(lay: ShardedLayout, d: int) -> list[tuple]:
    """Device d's step tokens as brute_tokens-style tuples; padding cells get a "dummy" tag."""
    toks = []
    for src in lay.tables["window_src"][d]:
        level, i = divmod(int(src), lay.W_pad)
        tok = ("current",) if (level, i) == (0, 0) else ("window", level, i)
        toks.append(tok if i < lay.W else ("dummy",) + tok)
    for g in range(d * lay.G_d, (d + 1) * lay.G_d):
        for j in range(lay.N - 1):
            toks.append(("cand", g, j) if g < lay.G else ("dummy", "cand", g, j))
    return toks


@pytest.mark.parametrize("W,N,G,D", SHARDED)
def test_sharded_layout_is_the_step_layout_split(W, N, G, D):
    """Each device's share obeys the same offsets and visibility as the whole step; level 0 is
    replicated, every other window cell and every candidate token is on exactly one device;
    dummies (padding) are never seen by a real token."""
    lay = ShardedLayout(W, N, G, D)
    tabs = lay.tables
    owned: list[tuple] = []
    for d in range(D):
        toks = _share_tokens(lay, d)
        assert len(toks) == lay.size == tabs["offsets"].shape[1]
        for a, q in enumerate(toks):
            if q[0] == "dummy":
                continue
            assert tabs["offsets"][d, a] == brute_offset(q), (d, q)
            for b, k in enumerate(toks):
                if k[0] == "dummy":
                    assert not tabs["mask"][d, a, b], (d, q, k)
                else:
                    assert tabs["mask"][d, a, b] == brute_sees(q, k), (d, q, k)
        own_cols = range(d * lay.W_d, (d + 1) * lay.W_d)
        for level in range(N - 1):  # `newest`: this device's own column cells at each level
            got = [toks[t] for t in tabs["newest"][d, level]]
            want = [("current",) if (level, i) == (0, 0) else ("window", level, i) for i in own_cols]
            assert [t[-len(w):] if t[0] == "dummy" else t for t, w in zip(got, want)] == want
        for g, row in enumerate(tabs["candidates"][d]):
            assert [toks[t][-3:] for t in row] == [("cand", d * lay.G_d + g, j) for j in range(N - 1)]
        owned += [t for t in toks if t[0] in ("window", "cand") and t[:2] != ("window", 0)]
    whole = [t for t in brute_tokens(W, N, G) if t != ("current",) and not (t[0] == "window" and t[1] == 0)]
    assert sorted(owned) == sorted(whole)  # levels >= 1 and candidates: each exactly once


@pytest.mark.parametrize("W,N,G", SHAPES)
def test_each_token_sees_one_consecutive_sequence(W, N, G):
    """Structural consequences of the rules: causal in step order, every token sees itself, and
    the tokens a token sees sit at offsets 0..its own offset, once each (one n-gram)."""
    layout = StepLayout(W, N, G)
    mask, off = layout.mask, layout.offsets
    assert not np.triu(mask, 1).any()
    assert mask.diagonal().all()
    for q in range(layout.size):
        np.testing.assert_array_equal(np.sort(off[mask[q]]), np.arange(off[q] + 1))
    # window and candidates never see each other; two candidates never see each other
    win = np.zeros(layout.size, bool)
    win[layout.window_index.ravel()] = True
    assert not mask[np.ix_(win, ~win)].any()
    not_current = win.copy()
    not_current[0] = False
    assert not mask[np.ix_(~win, not_current)].any()  # candidates see only the current token
    assert mask[~win, 0].all()
    for g in range(G):
        for h in range(G):
            if g != h:
                assert not mask[np.ix_(layout.candidate_index[g], layout.candidate_index[h])].any()


# ---------------------------------------------------------------------------- semantics ---

@pytest.fixture(scope="module")
def tiny_model():
    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2,
                      num_heads=4, num_kv_heads=2, eos_token_ids=())
    model = Llama(cfg, rngs=nnx.Rngs(3))
    # larger weights than the 0.02 init, so attention is far from uniform and any wrongly
    # visible (or wrongly hidden) token moves the logits well beyond float32 noise
    for path, var in nnx.iter_graph(model):
        if isinstance(var, nnx.Param) and path[-1] == "kernel":
            var.set_value(var.get_value() * 8)
    graphdef, params = nnx.split(model)
    forward = jax.jit(lambda params, *a: nnx.merge(graphdef, params)(*a)[0])
    # two rows with different cached prompts (lengths 5 and 11), shared by every layout
    rng = np.random.default_rng(0)
    tokens, lengths = pad_prompts([rng.integers(0, cfg.vocab_size, n).tolist() for n in (5, 11)])
    cache = KVCache.init(cfg.num_layers, 2, 48, cfg.num_kv_heads, cfg.head_dim)
    _, cache = nnx.jit(prefill)(model, jnp.asarray(tokens), jnp.asarray(lengths), cache)
    return model, lambda *a: forward(params, *a), cache

T_PAD, ROWS_PAD, L_PAD = 16, 32, 6  # fixed shapes: one compile serves every layout below


def _lookahead_forward(forward, cache, step_tokens, mask_tt, offsets):
    """The step as `lookahead_step` feeds it: positions = cache length + offsets, mask =
    [committed cache slots | the [T, T] step mask]. Padded to T_PAD tokens (a padding token
    sees only itself and the cache, and nobody sees it); returns the first T logits."""
    b, t = step_tokens.shape
    tokens = jnp.zeros((b, T_PAD), jnp.int32).at[:, :t].set(step_tokens)
    off = np.zeros(T_PAD, np.int32)
    off[:t] = offsets
    mask_p = np.eye(T_PAD, dtype=bool)
    mask_p[:t, :t] = mask_tt
    positions = cache.length[:, None] + jnp.asarray(off)[None, :]
    mask = jnp.concatenate(
        [jnp.broadcast_to(cache.visible()[:, None, :], (b, T_PAD, cache.max_len)),
         jnp.broadcast_to(jnp.asarray(mask_p)[None], (b, T_PAD, T_PAD))], axis=-1)
    return np.asarray(forward(tokens, positions, mask, cache))[:, :t]


def _trajectories(toks, row_tokens):
    """For every step token, the sequence the rules say it continues (ending with itself)."""
    where = {tok: n for n, tok in enumerate(toks)}

    def at(level, i):
        return row_tokens[where[("current",) if (level, i) == (0, 0) else ("window", level, i)]]

    out = []
    for tok in toks:
        if tok[0] == "cand":
            g, j = tok[1], tok[2]
            out.append([at(0, 0)] + [row_tokens[where[("cand", g, jj)]] for jj in range(j + 1)])
        else:
            level, i = _as_window(tok)
            out.append([at(0, c) for c in range(i + 1)] + [at(m, i) for m in range(1, level + 1)])
    return out


def _causal_reference(forward, cache, trajs_per_row):
    """Plain causal forwards of every trajectory appended to its row's cache: [B, T, V] logits
    at each trajectory's last token (one batched call, the cache tiled per trajectory)."""
    b = len(trajs_per_row)
    t = len(trajs_per_row[0])
    lmax = L_PAD
    assert b * t <= ROWS_PAD and max(len(tr) for row in trajs_per_row for tr in row) <= lmax
    tokens = np.zeros((ROWS_PAD, lmax), np.int32)
    lengths = np.ones(ROWS_PAD, np.int32)
    for r, row in enumerate(trajs_per_row):
        for q, tr in enumerate(row):
            tokens[r * t + q, : len(tr)] = tr
            lengths[r * t + q] = len(tr)
    rows = np.minimum(np.arange(ROWS_PAD) // t, b - 1)  # trajectory -> its row's cache
    tiled = KVCache(cache.k[:, rows], cache.v[:, rows], cache.length[rows])
    positions = tiled.length[:, None] + jnp.arange(lmax)[None, :]
    logits = forward(jnp.asarray(tokens), positions,
                     causal_mask(jnp.asarray(lengths), lmax, tiled), tiled)
    last = np.asarray(logits)[np.arange(ROWS_PAD), lengths - 1][: b * t]
    return last.reshape(b, t, -1)


@pytest.mark.parametrize("W,N,G", [(3, 4, 2), (1, 2, 1), (4, 3, 0)])
def test_mask_makes_each_column_and_candidate_an_independent_sequence(tiny_model, W, N, G):
    model, forward, cache = tiny_model
    cfg = model.config
    layout = StepLayout(W, N, G)
    rng = np.random.default_rng(W * 100 + N * 10 + G)
    step_tokens = rng.integers(0, cfg.vocab_size, (2, layout.size)).astype(np.int32)

    got = _lookahead_forward(forward, cache, jnp.asarray(step_tokens), layout.mask, layout.offsets)
    toks = brute_tokens(W, N, G)
    trajs = [_trajectories(toks, step_tokens[r].tolist()) for r in range(2)]
    want = _causal_reference(forward, cache, trajs)
    scale = np.abs(want).max()
    assert scale > 1.0  # logits are not flat: the comparison means something
    np.testing.assert_allclose(got, want, atol=2e-5 * scale, rtol=1e-4)

    # the check can fail: a plain causal mask over the step makes later tokens see the others
    if layout.size > 2:
        wrong = _lookahead_forward(forward, cache, jnp.asarray(step_tokens),
                                   np.tril(np.ones((layout.size,) * 2, bool)), layout.offsets)
        assert np.abs(wrong - want).max() > 1e-2 * scale
