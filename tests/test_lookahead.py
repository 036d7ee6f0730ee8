"""Lookahead decoding end to end: lossless against plain greedy decoding, verification, EOS,
no host round-trip inside the compiled loop, bounded memory.

The tiny model is a random Llama (GQA: 4 query heads, 2 K/V heads) whose embedding and LM head
are set so that it prefers a fixed "bigram" successor f(token) while its (scaled-up) random
attention and MLP often override that from context. Its greedy output mixes long f-chains with
context-driven tokens and repeats itself: the window's Jacobi guesses and the pool really hit,
so S > 1 and the lossless checks exercise multi-token accepts, not just the one-token path.
"""

from __future__ import annotations

import functools
import gc
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from lookahead_jax.lookahead.config import LookaheadConfig
from lookahead_jax.engine import Engine
from lookahead_jax.generation import cache_length_for, pad_prompts
from lookahead_jax.lookahead.step import Lookahead
from lookahead_jax.lookahead.verify import verify_greedy
from models import KVCache, Llama, LlamaConfig

V = 80
PROMPT_LENS = (1, 7, 40)
MAX_NEW = 37  # the plain references' length; shorter runs compare with their prefix


def make_model(seed: int = 0, **shape) -> Llama:
    """shape: LlamaConfig fields overriding the default shape (e.g. more heads)."""
    cfg = LlamaConfig(**{**dict(vocab_size=V, hidden_size=32, intermediate_size=64,
                                num_layers=2, num_heads=4, num_kv_heads=2, eos_token_ids=()),
                         **shape})
    model = Llama(cfg, rngs=nnx.Rngs(seed))
    rng = np.random.default_rng(seed)
    succ = rng.permutation(V)  # the bigram preference f
    emb = rng.normal(size=(V, cfg.hidden_size)).astype(np.float32)
    emb /= np.linalg.norm(emb, axis=1, keepdims=True)
    model.embed_tokens.embedding.set_value(jnp.asarray(emb))
    model.lm_head.kernel.set_value(jnp.asarray(10.0 * emb[np.argsort(succ)].T))
    for layer in model.layers:
        for lin in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj,
                    layer.self_attn.o_proj, layer.mlp.gate_proj, layer.mlp.up_proj,
                    layer.mlp.down_proj):
            lin.kernel.set_value(lin.kernel.get_value() * 6.0)
    return model


@pytest.fixture(scope="module")
def model() -> Llama:
    return make_model()


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    rng = np.random.default_rng(1)
    return [rng.integers(0, V, n).tolist() for n in PROMPT_LENS]


@pytest.fixture(scope="module")
def engines(model):
    """One Engine per EOS set (each keeps its own compiled functions)."""
    return functools.lru_cache(maxsize=None)(lambda eos: Engine(model, eos_ids=eos))


@pytest.fixture(scope="module")
def plain(engines, prompts) -> list[list[int]]:
    """Plain greedy output of each prompt alone, MAX_NEW tokens, no EOS: the ground truth."""
    return [engines(()).generate_ids([p], method="ar", max_new_tokens=MAX_NEW).tokens[0]
            for p in prompts]


def expected(ref: list[int], eos: tuple[int, ...], max_new: int) -> list[int]:
    """What any lossless greedy decoder must emit: the plain output cut after the first EOS."""
    out = []
    for t in ref[:max_new]:
        out.append(t)
        if t in eos:
            break
    return out


def first_new_at_or_after(ref: list[int], e: int) -> int:
    """The first position >= e whose token does not occur earlier in ref."""
    found = [i for i in range(e, len(ref)) if ref[i] not in ref[:i]]
    assert found, f"no token first emitted at or after {e}: pick another EOS position"
    return found[0]


# ------------------------------------------------------------------------- lossless ---

# name: (config, max_new_tokens, EOS position in prompt 1's plain output or None, mode)
# mode "batch": the 3 prompts (lengths 1, 7, 40) as one batch; "alone": each prompt by itself.
COMBOS = {
    "w5n4g5": (LookaheadConfig(W=5, N=4, G=5), 37, None, "batch"),
    "w5n4g5-alone": (LookaheadConfig(W=5, N=4, G=5), 37, None, "alone"),
    "w4n3g4-seed-vocab-eos": (LookaheadConfig(W=4, N=3, G=4, prompt_seeding=True,
                                              init_fill="vocab"), 37, 10, "batch"),
    "w1n2g1": (LookaheadConfig(W=1, N=2, G=1), 37, None, "batch"),
    "w6n2g6-seed-eos0": (LookaheadConfig(W=6, N=2, G=6, prompt_seeding=True), 37, 0, "batch"),
    "w3n4g0": (LookaheadConfig(W=3, N=4, G=0), 37, None, "batch"),
    "w1n3g0-seed-vocab-new5": (LookaheadConfig(W=1, N=3, G=0, prompt_seeding=True,
                                               init_fill="vocab"), 5, None, "batch"),
    "w7n5g7-eos": (LookaheadConfig(W=7, N=5, G=7), 37, 22, "batch"),
    "w4n3g2-new1": (LookaheadConfig(W=4, N=3, G=2), 1, None, "batch"),
    "w3n3g3-hashed-slots5-seed": (LookaheadConfig(W=3, N=3, G=3, pool_keys=7, pool_slots=5,
                                                  prompt_seeding=True), 37, None, "batch"),
}


@pytest.fixture(scope="module")
def run_combo(engines, prompts, plain):
    """Memoised: name -> (eos ids, per-prompt token lists, list of Stats)."""
    @functools.lru_cache(maxsize=None)
    def run(name):
        cfg, max_new, eos_at, mode = COMBOS[name]
        eos = () if eos_at is None else (plain[1][first_new_at_or_after(plain[1], eos_at)],)
        engine = engines(eos)
        kw = dict(method="lookahead", lookahead=cfg, max_new_tokens=max_new)
        if mode == "batch":
            res = engine.generate_ids(prompts, **kw)
            return eos, res.tokens, [res.stats]
        results = [engine.generate_ids([p], **kw) for p in prompts]
        return eos, [r.tokens[0] for r in results], [r.stats for r in results]
    return run


@pytest.mark.parametrize("name", list(COMBOS))
def test_lossless_vs_plain_greedy(name, run_combo, plain):
    cfg, max_new, eos_at, _ = COMBOS[name]
    eos, tokens, stats = run_combo(name)
    for row, ref in enumerate(plain):
        assert tokens[row] == expected(ref, eos, max_new), (name, row, stats[0].extra)
    if eos:  # the EOS really cut prompt 1's output short, at the chosen position
        assert len(tokens[1]) == first_new_at_or_after(plain[1], eos_at) + 1 < max_new
        assert tokens[1][-1] == eos[0]
    print(f"\n{name}: eos={eos} S={[round(s.step_compression, 2) for s in stats]} "
          f"accepted_hist={[s.extra['accepted_hist'] for s in stats]}")
    for s in stats:
        hist = s.extra["accepted_hist"]
        assert len(hist) == cfg.N
        if cfg.G == 0:
            assert sum(hist[1:]) == 0 and s.extra["pool_hit_rate"] == 0.0


def test_batch_equals_each_prompt_alone(run_combo, plain):
    """3 prompts of lengths 1, 7, 40 in one batch give exactly what each gives alone."""
    _, batch, _ = run_combo("w5n4g5")
    _, alone, _ = run_combo("w5n4g5-alone")
    assert batch == alone
    assert [len(t) for t in batch] == [MAX_NEW] * 3


def test_lookahead_actually_speculates(run_combo):
    """Not vacuous: candidates are accepted (multi-token steps) and S > 1 somewhere."""
    names = ["w5n4g5", "w5n4g5-alone", "w4n3g4-seed-vocab-eos", "w1n2g1", "w7n5g7-eos",
             "w3n3g3-hashed-slots5-seed"]
    multi = {n: sum(sum(s.extra["accepted_hist"][1:]) for s in run_combo(n)[2]) for n in names}
    s_best = max(s.step_compression for n in names for s in run_combo(n)[2])
    print("accepted>0 steps:", multi, "best S:", round(s_best, 2))
    assert all(v > 0 for v in multi.values()), multi
    assert s_best > 1.2
    # full-length accepts (N-1 candidate tokens, N tokens in one step) happen too
    assert any(s.extra["accepted_hist"][-1] > 0 for n in names for s in run_combo(n)[2])


# --------------------------------------------------------------------- verification ---

def _verify(next0, cand_preds, cands, valid):
    return jax.tree.map(np.asarray, verify_greedy(
        jnp.asarray(next0, jnp.int32), jnp.asarray(cand_preds, jnp.int32).reshape(
            len(next0), -1, np.shape(cands)[-1]), jnp.asarray(cands, jnp.int32).reshape(
            len(next0), -1, np.shape(cands)[-1]), jnp.asarray(valid, bool).reshape(len(next0), -1)))


def test_verify_greedy_hand_made():
    # N = 4 (3 candidate tokens), G = 3. Candidate token j matches when it equals the model's
    # argmax before it: next0 for j = 0, cand_preds[g, j-1] after.
    next0 = [5, 5, 5, 5]
    cand_preds = [  # model's argmax at each candidate token
        [[6, 9, 9], [6, 7, 8], [6, 7, 1]],   # row 0
        [[6, 7, 2], [6, 0, 0], [6, 7, 3]],   # row 1
        [[6, 7, 8], [6, 4, 4], [0, 0, 0]],   # row 2
        [[1, 1, 1], [1, 1, 1], [1, 1, 1]],   # row 3
    ]
    cands = [
        [[5, 7, 7], [5, 6, 7], [5, 6, 0]],   # lengths 1, 3 (full), 2 -> candidate 1 wins
        [[5, 6, 7], [5, 9, 9], [5, 6, 7]],   # lengths 3, 1, 3 -> tie: the first (0) wins
        [[5, 6, 7], [5, 6, 9], [5, 1, 0]],   # 0 would match fully but is invalid -> 1 (2)
        [[4, 1, 1], [3, 1, 1], [2, 1, 1]],   # nothing matches
    ]
    valid = [[1, 1, 1], [1, 1, 1], [0, 1, 1], [1, 1, 0]]
    v = _verify(next0, cand_preds, cands, valid)
    assert v.accepted.tolist() == [3, 3, 2, 0]
    assert v.best.tolist()[:3] == [1, 0, 1]
    assert v.count.tolist() == [4, 4, 3, 1]
    # accepted tokens, then the bonus: the model's argmax after the last accepted token
    assert v.tokens[0].tolist() == [5, 6, 7, 8]   # full match: N tokens, bonus cand_preds[1,2]
    assert v.tokens[1].tolist() == [5, 6, 7, 2]   # bonus cand_preds[0, 2]
    assert v.tokens[2, :3].tolist() == [5, 6, 4]  # bonus cand_preds[1, 1]
    assert v.tokens[3, 0] == 5                    # no accept: the model's token at current
    # G = 0: always exactly the model's next token
    v0 = verify_greedy(jnp.asarray([3, 9], jnp.int32), jnp.zeros((2, 0, 2), jnp.int32),
                       jnp.zeros((2, 0, 2), jnp.int32), jnp.zeros((2, 0), bool))
    assert np.asarray(v0.accepted).tolist() == [0, 0] and np.asarray(v0.count).tolist() == [1, 1]
    assert np.asarray(v0.tokens)[:, 0].tolist() == [3, 9] and v0.tokens.shape == (2, 3)


def test_verify_greedy_rejects_a_wrong_candidate():
    """A candidate that disagrees with the model at token j is cut there, whatever follows;
    blindly accepting it (the planted bug) would have emitted the wrong token."""
    model_says = [11, 12, 13, 14]  # the model's greedy continuation
    wrong = [11, 99, 13]            # right, wrong, right
    v = _verify([model_says[0]], [[model_says[1], model_says[2], model_says[3]]], [[wrong]], [[1]])
    emitted = v.tokens[0, : v.count[0]].tolist()
    assert emitted == model_says[:2] and v.accepted[0] == 1
    # a right candidate is accepted whole: the cut above is the wrong token's doing
    right = _verify([model_says[0]], [[model_says[1], model_says[2], model_says[3]]],
                    [[model_says[:3]]], [[1]])
    assert right.tokens[0, : right.count[0]].tolist() == model_says and right.accepted[0] == 3


# ------------------------------------------------- the compiled functions, by hand ---

def _jitted(graphdef, cfg, max_new, eos):
    """The method's init / run compiled with everything static that must be; both take the
    model's params (bundled with the method's own, none here, as the engine does)."""
    method = Lookahead(config=cfg)
    init = jax.jit(lambda p, *a: method.init(graphdef, {"model": p, "method": {}}, *a,
                                             max_new_tokens=max_new, eos_ids=eos))
    run = jax.jit(lambda p, s, n: method.run(graphdef, {"model": p, "method": {}}, s, n,
                                             eos_ids=eos))
    return init, run


def _inputs(model, prompt_list, cfg, max_new):
    tokens, lengths = pad_prompts(prompt_list)
    c = model.config
    s = cache_length_for(tokens.shape[1], max_new, cfg.N, c.max_position_embeddings)
    cache = KVCache.init(c.num_layers, len(prompt_list), s, c.num_kv_heads, c.head_dim)
    return jnp.asarray(tokens), jnp.asarray(lengths), cache


def test_eos_inside_an_accepted_run_and_wrong_candidates(model, prompts, plain):
    """Plant candidates in the pool after prefill. Row 0 (prompt 1) gets the model's own
    continuation, with the EOS id as its 2nd token: one step accepts all N-1 tokens, yet only
    the tokens up to EOS are emitted. Row 1 (prompt 2) gets a candidate that is wrong at its
    2nd token: it is cut there. Then generation runs on and both rows equal plain greedy."""
    cfg = LookaheadConfig(W=3, N=4, G=2)
    r0, r1 = plain[1], plain[2]
    eos = (r0[2],)
    assert r0[2] not in r0[:2] and r0[2] not in r1[:3], "pick another prompt / position"
    graphdef, params = nnx.split(model)
    init, run = _jitted(graphdef, cfg, MAX_NEW, eos)
    state = init(params, *_inputs(model, [prompts[1], prompts[2]], cfg, MAX_NEW),
                 jax.random.key(0))
    assert np.asarray(state.token).tolist() == [r0[0], r1[0]]
    wrong = (r1[2] + 1) % V
    grams = jnp.asarray([[r0[0], r0[1], r0[2], r0[3]], [r1[0], r1[1], wrong, r1[3]]],
                        jnp.int32)[:, None]
    state = state.replace(pool=state.pool.insert(grams, jnp.ones((2, 1), bool)))

    one = run(params, state, jnp.asarray(1, jnp.int32))
    hist = np.asarray(one.stats.accepted_hist).tolist()
    assert hist == [0, 1, 0, 1], hist  # row 0 accepted 3 tokens, row 1 accepted 1
    counts = np.asarray(one.out.count).tolist()
    out = np.asarray(one.out.tokens)
    assert counts == [3, 3]
    assert out[0, :3].tolist() == r0[:3] and not out[0, 3:].any()  # nothing after EOS
    assert bool(np.asarray(one.out.done)[0]) and not bool(np.asarray(one.out.done)[1])
    assert out[1, :3].tolist() == r1[:3] and wrong != r1[2]

    final = run(params, one, jnp.asarray(200, jnp.int32))
    counts = np.asarray(final.out.count)
    toks = [np.asarray(final.out.tokens)[i, :c].tolist() for i, c in enumerate(counts)]
    assert toks == [expected(r0, eos, MAX_NEW), expected(r1, eos, MAX_NEW)]


# ------------------------------------------- no host round-trip, bounded memory ---

LONG = 2000
LONG_CFG = LookaheadConfig(W=4, N=3, G=4, prompt_seeding=True)


@pytest.fixture(scope="module")
def long_run(model, prompts):
    """The compiled lookahead_run for a 2,000-token generation (no EOS), ahead-of-time."""
    graphdef, params = nnx.split(model)
    init, run = _jitted(graphdef, LONG_CFG, LONG, ())
    state = init(params, *_inputs(model, [prompts[1]], LONG_CFG, LONG), jax.random.key(0))
    chunk = jax.device_put(jnp.asarray(250, jnp.int32))
    compiled = run.lower(params, state, chunk).compile()
    return params, state, chunk, compiled


def _text_checks(hlo: str) -> tuple[bool, list[str]]:
    has_while = re.search(r"\bwhile\(", hlo) is not None
    bad = [line.strip()[:160] for line in hlo.splitlines()
           if re.search(r"\b(infeed|outfeed|send|recv|send-done|recv-done)\(", line)
           or re.search(r'custom_call_target="[^"]*(callback|host|py)[^"]*"', line, re.I)]
    return has_while, bad


def test_compiled_loop_has_no_host_callbacks(long_run):
    _, _, _, compiled = long_run
    has_while, bad = _text_checks(compiled.as_text())
    assert has_while
    assert bad == []
    # the check can fail: a loop with a debug callback inside is caught
    probe = jax.jit(lambda x: jax.lax.fori_loop(
        0, 3, lambda i, a: (jax.debug.callback(lambda v: None, a), a + 1)[1], x))
    probe_hlo = probe.lower(jnp.zeros((), jnp.int32)).compile().as_text()
    assert _text_checks(probe_hlo)[1]


def test_whole_generation_under_transfer_guard_and_bounded_memory(long_run, plain):
    """2,000 tokens in chunks of 250 steps with host-to-device transfers disallowed: nothing is
    fed from the host inside or between chunks; after every chunk the live device bytes and the
    state's leaf shapes are exactly those of the first chunk (static buffers)."""
    params, state, chunk, compiled = long_run
    shapes = [(x.shape, x.dtype) for x in jax.tree.leaves(state)]
    live = []
    chunks = 0
    with jax.transfer_guard("disallow"):
        with pytest.raises(Exception):  # the guard is live on this platform
            compiled(params, state, np.int32(250))
        while not jax.device_get(state.out.done).all():
            state = compiled(params, state, chunk)
            jax.block_until_ready(state)
            chunks += 1
            assert [(x.shape, x.dtype) for x in jax.tree.leaves(state)] == shapes
            gc.collect()
            live.append(sum(a.nbytes for a in jax.live_arrays()))
            assert chunks <= LONG // 250 + 2
    count = int(jax.device_get(state.out.count)[0])
    steps = int(jax.device_get(state.steps))
    summary = Lookahead(config=LONG_CFG).summary(state)
    print(f"\n{count} tokens in {steps} steps (S={count / steps:.2f}), {chunks} chunks, "
          f"live bytes per chunk {sorted(set(live))}, pool_bytes={summary['pool_bytes']}, "
          f"accepted_hist={summary['accepted_hist']}")
    assert count == LONG
    assert len(set(live)) == 1, live
    assert summary["pool_bytes"] == 1 * V * LONG_CFG.slots * (LONG_CFG.N + 1) * 4
    assert chunks >= 2
    # and the long run starts exactly like plain greedy decoding
    assert jax.device_get(state.out.tokens)[0, :MAX_NEW].tolist() == plain[1]
