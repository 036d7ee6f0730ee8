"""Looped models (Ouro, Raven, recursive Llama): the per-depth pieces compose into the whole-depth forward;
tokens can be held at a depth and resumed, advanced in batches of mixed depths, and decoded
incrementally with the per-depth KV cache, all equal to the no-cache forward (fp32, 1e-5);
Raven's initial state is a function of (seed, position) only; configs are validated; plain
greedy decoding through `Engine` equals a naive argmax loop."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from models.build import build_looped
from models.config import ConfigError, LoopedConfig
from models.kv_cache import KVCache
from models.layers import causal_mask
from models.looped import LoopedLM

ATOL = 1e-5
B, T = 2, 9

CONFIGS = {
    "ouro": LoopedConfig(family="ouro", vocab_size=97, hidden_size=32, intermediate_size=48,
                         num_heads=4, num_kv_heads=2, num_loops=3, num_layers=2, rope_theta=1e4,
                         max_position_embeddings=256, bos_token_id=1, eos_token_ids=(2,)),
    "raven": LoopedConfig(family="raven", vocab_size=97, hidden_size=32, intermediate_size=48,
                          num_heads=4, num_kv_heads=4, num_loops=4, prelude_layers=1,
                          core_layers=2, coda_layers=1, qk_bias=True, rope_theta=5e4,
                          tie_word_embeddings=True, max_position_embeddings=256,
                          bos_token_id=1, eos_token_ids=(2,)),
}
# The recursive Llama's pieces are checked here; the decoders on top (LoopSpec, LoopAhead, the
# tree, the mesh), family-independent, run on CONFIGS (tests/test_recursive.py runs them once).
RECURSIVE = LoopedConfig(family="recursive", vocab_size=97, hidden_size=32, intermediate_size=48,
                         num_heads=4, num_kv_heads=2, num_loops=3, prelude_layers=1,
                         core_layers=2, coda_layers=1, rope_theta=1e4, tie_word_embeddings=True,
                         max_position_embeddings=256, bos_token_id=1, eos_token_ids=(2,))
ALL_CONFIGS = {**CONFIGS, "recursive": RECURSIVE}


def _perturb_norms(model: LoopedLM, seed: int = 1) -> LoopedLM:
    """Non-trivial norm weights, so a norm in the wrong place shows."""
    rng = np.random.default_rng(seed)
    for path, var in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        if path[-1] == "weight" and var.get_value().ndim == 1:
            w = var.get_value()
            var.set_value(w + 0.3 * jnp.asarray(rng.standard_normal(w.shape), w.dtype))
    return model


class Jitted:
    """model.method(*args) compiled (positional array arguments; ints are traced, so a depth
    given as an int takes the model's traced-depth path), so the tests run fast."""

    def __init__(self, model: LoopedLM):
        self.model = model
        self.graphdef, self.params = nnx.split(model)
        self._fns = {}

    def __getattr__(self, name):
        if name not in self._fns:
            graphdef = self.graphdef
            self._fns[name] = jax.jit(
                lambda params, *a: getattr(nnx.merge(graphdef, params), name)(*a))
        return lambda *a: self._fns[name](self.params, *a)


@pytest.fixture(scope="module", params=list(ALL_CONFIGS))
def model(request):
    return _perturb_norms(build_looped(ALL_CONFIGS[request.param], rngs=nnx.Rngs(0)))


@pytest.fixture(scope="module")
def fast(model):
    return Jitted(model)


def _tokens(vocab: int = 97, t: int = T) -> jax.Array:
    return jnp.asarray(np.random.default_rng(0).integers(0, vocab, (B, t)), jnp.int32)


def _positions(t: int = T, start: int = 0) -> jax.Array:
    return jnp.broadcast_to(jnp.arange(start, start + t, dtype=jnp.int32)[None], (B, t))


@pytest.fixture(scope="module")
def reference(fast):
    """loop_logits of the module's model on the standard tokens: [R,B,T,V], gates."""
    return fast.loop_logits(_tokens(), _positions())


def _close(got, want, msg=""):
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=ATOL, rtol=0, err_msg=msg)


# ---- whole depth ----------------------------------------------------------------------------

def test_loop_logits_contract(model, fast, reference):
    cfg = model.config
    logits, gates = reference
    assert logits.shape == (cfg.num_loops, B, T, cfg.vocab_size) and logits.dtype == jnp.float32
    if cfg.family == "ouro":
        assert gates.shape == (cfg.num_loops, B, T) and gates.dtype == jnp.float32
    else:
        assert gates is None
    # the depths differ: each loop does something
    assert float(jnp.abs(logits[0] - logits[-1]).max()) > 1e-3
    # causal: a later token does not change earlier logits
    other = _tokens().at[:, -1].set(0)
    _close(fast.loop_logits(other, _positions())[0][:, :, :-1], logits[:, :, :-1])


def test_call_is_full_depth(model, reference):
    logits, kv = model(_tokens(), _positions(), causal_mask(jnp.full((B,), T, jnp.int32), T))
    _close(logits, reference[0][-1])
    assert kv.k.shape[0] == model.config.cache_slots
    last = jnp.full((B, 1), T - 1, jnp.int32)
    _close(model(_tokens(), _positions(), causal_mask(jnp.full((B,), T, jnp.int32), T),
                 logits_at=last)[0][:, 0], reference[0][-1][:, -1])


def test_stepwise_equals_whole_depth(model, reference):
    """embed, initial_state, then one loop at a time with a readout in between."""
    tokens, pos = _tokens(), _positions()
    e, _ = model.embed(tokens, pos)
    h = model.initial_state(e, pos)
    for r in range(model.config.num_loops):
        per_token, _ = model.advance(h, e, jnp.full((B, T), r, jnp.int32), pos)
        h, _ = model.advance(h, e, r, pos)
        _close(per_token, h)  # a depth array with equal entries: the same step
        logits, _ = model.readout(h, r + 1, pos)
        _close(logits, reference[0][r], f"depth {r + 1}")
        if model.config.family == "ouro":
            _close(model.exit_gate(h), reference[1][r])


def test_jit_matches_eager(model, reference):
    graphdef, params = nnx.split(model)

    @jax.jit
    def f(params, tokens, pos):
        return nnx.merge(graphdef, params).loop_logits(tokens, pos)[0]
    _close(f(params, _tokens(), _positions()), reference[0])


# ---- cached -------------------------------------------------------------------------------

def _commit_all(cache: KVCache, new, start: int, n: int) -> KVCache:
    """Writes new tokens 0..n-1 (all slots) at positions start..start+n-1 and extends length."""
    src = jnp.broadcast_to(jnp.arange(n, dtype=jnp.int32)[None], (B, n))
    return cache.write(new, src, src + start).replace(length=cache.length + n)


def _prefix_cache(model, fast, p: int, size: int = 32):
    """The first p tokens through all depths, every slot committed."""
    cache = model.init_cache(B, size)
    mask = causal_mask(jnp.full((B,), p, jnp.int32), p, cache)
    _, _, new = fast.forward_all_depths(_tokens()[:, :p], _positions(p), mask, cache)
    return _commit_all(cache, new, 0, p)


def test_cached_incremental_all_depths(model, fast, reference):
    """Prefill 4 tokens, then one token at a time: every depth's readout equals the no-cache
    forward."""
    p = 4
    cache = _prefix_cache(model, fast, p)
    one = jnp.ones((B,), jnp.int32)
    for t in range(p, T):
        mask = causal_mask(one, 1, cache)
        logits, gates, new = fast.forward_all_depths(_tokens()[:, t:t + 1], _positions(1, t),
                                                      mask, cache)
        _close(logits[:, :, 0], reference[0][:, :, t], f"token {t}")
        if gates is not None:
            _close(gates[:, :, 0], reference[1][:, :, t])
        cache = _commit_all(cache, new, t, 1)


def test_cached_full_depth_decoding(model, fast, reference):
    """`__call__` with a cache (what plain decoding runs): prefill right-padded rows of
    different lengths, then feed one token at a time."""
    from lookahead_jax.generation import prefill  # noqa: PLC0415
    lengths = jnp.asarray([3, 5], jnp.int32)
    cache = model.init_cache(B, 16)
    last, cache = prefill(model, _tokens()[:, :8], lengths, cache)
    want = reference[0][-1]
    _close(last, want[jnp.arange(B), lengths - 1])
    one = jnp.ones((B,), jnp.int32)
    for step in range(T - 5):
        pos = lengths + step
        tok = _tokens()[jnp.arange(B), pos][:, None]
        logits, new = fast.__call__(tok, pos[:, None], causal_mask(one, 1, cache), cache)
        cache = cache.append(new, jnp.zeros((B, 1), jnp.int32), one)
        _close(logits[:, 0], want[jnp.arange(B), pos], f"step {step}")


def _one_token_mask(cache: KVCache, t: int) -> jax.Array:
    """[B,1,S+1]: a token at position t sees cache positions < t (at its own depth) and itself."""
    vis = jnp.broadcast_to((jnp.arange(cache.max_len) < t)[None, None, :], (B, 1, cache.max_len))
    return jnp.concatenate([vis, jnp.ones((B, 1, 1), bool)], -1)


def test_resume_held_token(model, fast, reference):
    """Token p is advanced to depth d and held; token p+1 runs its first d loops meanwhile
    (reading token p's committed loop K/V); then token p resumes from d to R. Every readout
    equals the straight-through forward."""
    cfg = model.config
    p, d = 4, 2
    cache = _prefix_cache(model, fast, p)
    src = jnp.zeros((B, 1), jnp.int32)

    def start(t):
        nonlocal cache
        pos = _positions(1, t)
        mask = _one_token_mask(cache, t)
        e, pre = fast.embed(_tokens()[:, t:t + 1], pos, mask, cache)
        if pre is not None:
            cache = fast.write_prelude_kv(cache, pre, src, src + t)
        return e, fast.initial_state(e, pos), pos

    def loops(t, e, h, pos, frm, to):
        nonlocal cache
        mask = _one_token_mask(cache, t)
        for r in range(frm, to):
            h, kv = fast.advance(h, e, r, pos, mask, cache)
            cache = fast.write_loop_kv(cache, kv, jnp.full((B, 1), r, jnp.int32), src, src + t)
            logits, ckv = fast.readout(h, r + 1, pos, mask, cache)
            if ckv is not None:
                cache = fast.write_coda_kv(cache, ckv, jnp.full((B, 1), r + 1, jnp.int32), src,
                                            src + t)
            _close(logits[:, 0], reference[0][r, :, t], f"token {t} depth {r + 1}")
        return h

    e0, h0, pos0 = start(p)
    h0 = loops(p, e0, h0, pos0, 0, d)  # held at depth d
    e1, h1, pos1 = start(p + 1)
    h1 = loops(p + 1, e1, h1, pos1, 0, d)  # the next token catches up to d meanwhile
    loops(p, e0, h0, pos0, d, cfg.num_loops)  # resume
    loops(p + 1, e1, h1, pos1, d, cfg.num_loops)


def test_mixed_depth_batch(model, fast, reference):
    """A pipeline: each call advances a batch of tokens that are at different depths (each
    with its own positions, reading its own depth's cache slots), commits their K/V at their
    own depths and reads each out at its new depth; some calls hold two tokens at the same
    depth that see each other inside the call. Every readout equals the no-cache forward."""
    r_full = model.config.num_loops
    p = 3
    n = T - p  # tokens p..T-1 of each row ride along in every call; the idle ones are masked
    cache = _prefix_cache(model, fast, p)
    s_len = cache.max_len
    pos = _positions(n, p)
    e, pre = fast.embed(_tokens()[:, p:], pos, jnp.concatenate(
        [jnp.broadcast_to(cache.visible()[:, None, :], (B, n, s_len)),
         causal_mask(jnp.full((B,), n, jnp.int32), n)], -1), cache)
    src = jnp.broadcast_to(jnp.arange(n, dtype=jnp.int32)[None], (B, n))
    if pre is not None:
        cache = fast.write_prelude_kv(cache, pre, src, src + p)
    h = fast.initial_state(e, pos)
    depth = np.zeros((B, n), np.int32)
    committed = np.zeros((B, r_full, s_len), bool)  # K/V present at [row, depth, position]
    committed[:, :, :p] = True
    started = np.zeros(B, np.int32)
    pos_np = np.asarray(pos)
    checked = 0
    for step in range(3 * T):
        # row 0 starts a new token every call; row 1 starts two tokens every other call
        started[0] = min(n, started[0] + 1)
        if step % 2 == 0:
            started[1] = min(n, started[1] + 2)
        valid = (np.arange(n)[None] < started[:, None]) & (depth < r_full)
        if not valid.any():
            break
        d_in = np.minimum(depth, r_full - 1)
        old = committed[np.arange(B)[:, None], d_in] & (np.arange(s_len)[None, None]
                                                        < pos_np[:, :, None])
        new_vis = (pos_np[:, None, :] <= pos_np[:, :, None]) & valid[:, None, :]
        mask = jnp.asarray(np.concatenate([old, new_vis], -1))
        h2, kv = fast.advance(h, e, jnp.asarray(d_in), pos, mask, cache)
        dst = jnp.asarray(np.where(valid, pos_np, s_len), jnp.int32)
        cache = fast.write_loop_kv(cache, kv, jnp.asarray(d_in), src, dst)
        logits, ckv = fast.readout(h2, jnp.asarray(d_in + 1), pos, mask, cache)
        if ckv is not None:
            cache = fast.write_coda_kv(cache, ckv, jnp.asarray(d_in + 1), src, dst)
        for b, i in zip(*np.nonzero(valid)):
            committed[b, depth[b, i], pos_np[b, i]] = True
            depth[b, i] += 1
            _close(logits[b, i], reference[0][depth[b, i] - 1, b, p + i],
                   f"row {b} token {p + i} depth {depth[b, i]}")
            checked += 1
        h = jnp.where(jnp.asarray(valid)[..., None], h2, h)
    assert checked == B * n * r_full
    assert (depth == r_full).all()


# ---- Raven's initial state --------------------------------------------------------------------

def test_raven_noise_is_a_function_of_seed_and_position():
    model = build_looped(CONFIGS["raven"], rngs=nnx.Rngs(0))
    e = jnp.zeros((B, 6, 32))
    pos = _positions(6, 10)
    h = model.initial_state(e, pos)
    # the same position in another row, call shape or offset gets the same state
    _close(h[0], h[1])
    _close(model.initial_state(e[:, :2], pos[:, 3:5]), h[:, 3:5])
    assert float(jnp.abs(h[0, 0] - h[0, 1]).max()) > 0.1  # positions differ
    other = model.initial_state(e, pos, seed=1)
    assert float(jnp.abs(other - h).max()) > 0.1
    cfg = model.config
    std = float(jnp.std(model.initial_state(jnp.zeros((1, 512, 32)), _positions(512)[:1])))
    want = cfg.state_std * cfg.embed_scale * 0.986  # truncation at 3 sigma
    assert abs(std - want) < 0.05 * want
    assert float(jnp.abs(h).max()) <= 3 * cfg.state_std * cfg.embed_scale + 1e-6
    # the seed argument of loop_logits changes Raven's outputs
    fast = Jitted(model)
    lg0 = fast.loop_logits(_tokens(t=4), _positions(4), 0)[0]
    lg1 = fast.loop_logits(_tokens(t=4), _positions(4), 1)[0]
    assert float(jnp.abs(lg0 - lg1).max()) > 1e-4


# ---- config -----------------------------------------------------------------------------------

def test_config_validation():
    base = dict(vocab_size=8, hidden_size=16, intermediate_size=8, num_heads=2, num_kv_heads=2,
                num_loops=2)
    with pytest.raises(ConfigError, match="family"):
        LoopedConfig(family="llama", num_layers=1, **base)
    with pytest.raises(ConfigError, match="num_layers must be positive"):
        LoopedConfig(family="ouro", **base)
    with pytest.raises(ConfigError, match="ouro has no core_layers"):
        LoopedConfig(family="ouro", num_layers=1, core_layers=1, **base)
    with pytest.raises(ConfigError, match="core_layers must be positive"):
        LoopedConfig(family="raven", prelude_layers=1, **base)
    with pytest.raises(ConfigError, match="num_loops must be positive"):
        LoopedConfig(family="ouro", num_layers=1, **{**base, "num_loops": 0})
    with pytest.raises(ConfigError, match="qk_bias needs"):
        LoopedConfig(family="raven", core_layers=1, qk_bias=True, **{**base, "num_kv_heads": 1})
    cfg = LoopedConfig(family="raven", core_layers=2, prelude_layers=1, coda_layers=1, **base)
    with pytest.raises(ConfigError, match="recursive has no qk_bias"):
        LoopedConfig(family="recursive", core_layers=1, qk_bias=True, **base)
    with pytest.raises(ConfigError, match="recursive uses prelude_layers"):
        LoopedConfig(family="recursive", core_layers=1, num_layers=2, **base)
    assert hash(cfg) == hash(dataclasses.replace(cfg))
    assert cfg.embed_scale == pytest.approx(4.0) and cfg.state_std == pytest.approx((2 / 80) ** .5)
    assert cfg.head_dim == 8 and cfg.cache_slots == 1 + 2 * 2 + 2 * 1


def test_from_hf():
    ouro = LoopedConfig.from_hf({
        "model_type": "ouro", "vocab_size": 49152, "hidden_size": 2048, "intermediate_size": 5632,
        "num_hidden_layers": 24, "num_attention_heads": 16, "num_key_value_heads": 16,
        "head_dim": 128, "rope_theta": 1000000.0, "rms_norm_eps": 1e-6,
        "tie_word_embeddings": False, "max_position_embeddings": 65536, "total_ut_steps": 4,
        "use_sliding_window": False, "rope_scaling": None, "bos_token_id": 1, "eos_token_id": 2})
    assert (ouro.family, ouro.num_layers, ouro.num_loops, ouro.rope_theta) == ("ouro", 24, 4, 1e6)
    assert ouro.cache_slots == 96 and ouro.eos_token_ids == (2,)
    raven = LoopedConfig.from_hf({  # the fields of raven_config_minimal.json
        "model_type": "huginn_raven", "vocab_size": 65536, "n_embd": 5280,
        "num_attention_heads": 55, "num_key_value_heads": 55, "intermediate_size": 17920,
        "block_size": 4096, "tie_embeddings": True, "bias": False, "norm_eps": 0.000001,
        "n_layers_in_recurrent_block": 4, "mean_recurrence": 32, "n_layers_in_prelude": 2,
        "n_layers_in_coda": 2, "qk_bias": True, "injection_type": "linear",
        "block_class_name": "SandwichBlock", "mlp_class_name": "GatedMLP", "nonlin_name": "SiLU"})
    shape = (raven.prelude_layers, raven.core_layers, raven.coda_layers, raven.num_loops)
    assert shape == (2, 4, 2, 32)
    assert raven.head_dim == 96 and raven.rope_theta == 50000.0 and raven.tie_word_embeddings
    assert raven.embed_scale == pytest.approx(5280 ** .5)
    with pytest.raises(ConfigError, match="model_type 'llama'"):
        LoopedConfig.from_hf({"model_type": "llama"})
    with pytest.raises(ConfigError, match="missing field 'hidden_size'"):
        LoopedConfig.from_hf({"model_type": "ouro", "vocab_size": 8, "intermediate_size": 8,
                              "num_attention_heads": 2})


# ---- plain decoding through the engine ----------------------------------------------------------

@pytest.mark.parametrize("family", list(ALL_CONFIGS))
def test_engine_greedy_equals_naive_argmax(family):
    from lookahead_jax.engine import Engine  # noqa: PLC0415
    model = _perturb_norms(build_looped(ALL_CONFIGS[family], rngs=nnx.Rngs(3)))
    fast = Jitted(model)
    prompts = [[5, 9, 11, 3], [7, 8]]
    new = 6
    result = Engine(model, eos_ids=()).generate_ids(prompts, method="ar", max_new_tokens=new)
    width = max(map(len, prompts)) + new  # one shape: causal, so the padding is not seen
    pos = jnp.arange(width, dtype=jnp.int32)[None]
    for prompt, got in zip(prompts, result.tokens):
        seq = list(prompt)
        for _ in range(new):
            toks = jnp.asarray([seq + [0] * (width - len(seq))], jnp.int32)
            seq.append(int(jnp.argmax(fast.loop_logits(toks, pos)[0][-1, 0, len(seq) - 1])))
        assert got == seq[len(prompt):]
    assert result.stats.steps == new
