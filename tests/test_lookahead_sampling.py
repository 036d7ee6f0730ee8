"""Lookahead sampling is exact: the multi-candidate rejection scheme keeps the distribution.

A tiny random Llama with a 6-token vocabulary and high-entropy outputs; 20,000 copies of one
prompt are decoded with lookahead sampling (each row draws independently) and the joint
distribution of the first 3 new tokens is compared with the exact one, enumerated from the
model's logits under the same `Sampling` warping, by a chi-square test. The prompt's n-grams
(prompt_seeding, N = 3) give every first token several candidates with distinct next tokens,
so tokens 2 and 3 are decided by verification, which both accepts and rejects candidates.
The same test, run with deliberately wrong acceptance rules, fails with p-values that are
astronomically small: it can catch a mistake.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from lookahead_jax.lookahead.config import LookaheadConfig
from lookahead_jax.engine import Engine
from lookahead_jax.generation import cache_length_for, pad_prompts
from lookahead_jax.sampling import Sampling
from lookahead_jax.lookahead.step import Lookahead
from lookahead_jax.lookahead.verify import verify_sampling
from models import KVCache, Llama, LlamaConfig
from models.config import ConfigError
from models.layers import causal_mask
from sampling_checks import chi_square, single_device, wrong_verdict

V = 6
NEW = 3  # tokens whose joint distribution is tested
SAMPLES = 20_000
ALPHA = 1e-3  # the correct rule must give p > ALPHA
WRONG_P = 1e-10  # a wrong rule must give p below this
# 16 tokens (one prompt bucket: a cheap prefill for 20,000 rows); for every token its 3 newest
# trigrams have at least 2 distinct middle tokens (checked on the seeded pool below)
PROMPT = [0, 1, 2, 0, 3, 4, 1, 5, 2, 3, 0, 5, 4, 2, 1, 3]
CFG = LookaheadConfig(W=2, N=3, G=3, prompt_seeding=True)
SETTINGS = {"t1": Sampling(1.0), "topk3": Sampling(1.0, top_k=3),
            "topp0.8": Sampling(1.0, top_p=0.8)}


def make_model(seed: int = 0, head: float = 1.2, body: float = 4.0, vocab: int = V) -> Llama:
    """Random Llama, unit-norm embeddings, LM head scaled for high (but not maximal) entropy,
    attention/MLP scaled up so the next-token distribution depends strongly on context."""
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_layers=2,
                      num_heads=4, num_kv_heads=2, eos_token_ids=())
    model = Llama(cfg, rngs=nnx.Rngs(seed))
    rng = np.random.default_rng(seed)
    emb = rng.normal(size=(vocab, cfg.hidden_size)).astype(np.float32)
    emb /= np.linalg.norm(emb, axis=1, keepdims=True)
    model.embed_tokens.embedding.set_value(jnp.asarray(emb))
    head_w = rng.normal(size=(cfg.hidden_size, vocab)).astype(np.float32) / np.sqrt(cfg.hidden_size)
    model.lm_head.kernel.set_value(jnp.asarray(head * head_w))
    for layer in model.layers:
        for lin in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj,
                    layer.self_attn.o_proj, layer.mlp.gate_proj, layer.mlp.up_proj,
                    layer.mlp.down_proj):
            lin.kernel.set_value(lin.kernel.get_value() * body)
    return model


@pytest.fixture(scope="module")
def model() -> Llama:
    return make_model()


# ------------------------------------------------------------------ exact distribution ---

@pytest.fixture(scope="module")
def exact_logits(model):
    """The model's logits after PROMPT, PROMPT+t1 and PROMPT+t1+t2 for every t1, t2: one
    cache-free forward over the 1 + V + V^2 prefixes. Returns [V], [V, V], [V, V, V]."""
    seqs = ([PROMPT] + [PROMPT + [a] for a in range(V)]
            + [PROMPT + [a, b] for a in range(V) for b in range(V)])
    t = len(PROMPT) + 2
    tokens = np.zeros((len(seqs), t), np.int32)
    lengths = np.array([len(s) for s in seqs], np.int32)
    for i, s in enumerate(seqs):
        tokens[i, : len(s)] = s
    positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32)[None], tokens.shape)
    logits, _ = model(jnp.asarray(tokens), positions, causal_mask(jnp.asarray(lengths), t),
                      None, logits_at=jnp.asarray(lengths - 1)[:, None])
    logits = np.asarray(logits[:, 0])
    return logits[0], logits[1: 1 + V], logits[1 + V:].reshape(V, V, V)


def exact_joint(exact_logits, sampling: Sampling) -> np.ndarray:
    """P(t1, t2, t3) [V, V, V] under `sampling`'s warping of the model's logits."""
    l0, l1, l2 = exact_logits

    def p(logits):
        return np.asarray(jax.nn.softmax(sampling.log_probs(jnp.asarray(logits)), axis=-1),
                          np.float64)

    return p(l0)[:, None, None] * p(l1)[:, :, None] * p(l2)


def warp_reference(logits: np.ndarray, s: Sampling) -> np.ndarray:
    """numpy: temperature, then keep the top_k largest, then the smallest set of most likely
    tokens whose mass reaches top_p; renormalised probabilities."""
    x = logits.astype(np.float64) / s.temperature
    order = np.argsort(-x)
    keep = np.ones_like(x, bool)
    if s.top_k:
        keep[order[s.top_k:]] = False
    q = np.where(keep, np.exp(x - x.max()), 0.0)
    q /= q.sum()
    if s.top_p < 1.0:
        mass_before = np.cumsum(q[order]) - q[order]
        keep[order[mass_before >= s.top_p]] = False
    q = np.where(keep, np.exp(x - x.max()), 0.0)
    return q / q.sum()


def test_warping_matches_a_reference():
    """Sampling.log_probs, which both sides of the test below use, against numpy."""
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(50, V)) * 2
    for s in [*SETTINGS.values(), Sampling(0.7, 2, 0.9), Sampling(1.5, 0, 0.3)]:
        got = np.asarray(jax.nn.softmax(s.log_probs(jnp.asarray(logits, jnp.float32)), -1))
        want = np.stack([warp_reference(row, s) for row in logits])
        np.testing.assert_allclose(got, want, atol=2e-6, err_msg=str(s))


def test_chi_square_helper():
    """The chi-square helper (sampling_checks.chi_square): its statistic and p-value on counts
    worked out by hand, a fair die, a loaded one, and the pooling of sparse cells."""
    # (60 - 50)^2 / 50 + (40 - 50)^2 / 50 = 4 on 1 df: p = P(chi2_1 > 4) = 0.0455
    stat, df, p = chi_square(np.array([60, 40]), np.array([0.5, 0.5]))
    assert (stat, df) == (4.0, 1) and abs(p - 0.0455) < 1e-4
    # chi2.sf(18.307, 10) = 0.05: 11 cells
    counts = np.full(11, 100.0)
    counts[0] += np.sqrt(18.307 * 100 * 10 / 11)
    counts[1:] -= np.sqrt(18.307 * 100 * 10 / 11) / 10
    stat, df, p = chi_square(counts, np.ones(11))
    assert df == 10 and abs(p - 0.05) < 2e-3, (stat, p)
    rng = np.random.default_rng(0)
    fair = np.bincount(rng.integers(0, 6, 6000), minlength=6)
    assert chi_square(fair, np.ones(6))[2] > ALPHA
    loaded = np.bincount(rng.choice(6, 6000, p=[0.2, 0.2, 0.2, 0.2, 0.1, 0.1]), minlength=6)
    assert chi_square(loaded, np.ones(6))[2] < 1e-10
    # cells expecting < 5 are pooled
    stat, df, _ = chi_square(np.array([50, 50, 1, 0, 2]), np.array([0.49, 0.49, 0.01, 0.005,
                                                                    0.005]))
    assert df == 1 and stat < 1


# ------------------------------------------------------------------ sampling runs ---

@functools.partial(jax.jit, static_argnums=(0, 1))
def _init(method, graphdef, params, tokens, lengths, cache, key):
    return method.init(graphdef, {"model": params, "method": {}}, tokens, lengths, cache, key,
                       max_new_tokens=NEW, eos_ids=())


@functools.partial(jax.jit, static_argnums=(0, 1))
def _run(method, graphdef, params, state):
    return method.run(graphdef, {"model": params, "method": {}}, state,
                      jnp.asarray(NEW, jnp.int32), eos_ids=())


@pytest.fixture(scope="module")
def initial(model):
    """Memoised: sampling -> the state after prefill (first token drawn, pool seeded with the
    prompt) of SAMPLES copies of PROMPT, seed 0. Shared by the rules compared on it, as
    Engine.generate_ids would build it (the same key, padding and cache size)."""
    graphdef, params = nnx.split(model)

    @functools.lru_cache(maxsize=None)
    def get(sampling: Sampling):
        tokens, lengths = pad_prompts([PROMPT] * SAMPLES)
        c = model.config
        s = cache_length_for(tokens.shape[1], NEW, CFG.N, c.max_position_embeddings,
                             tokens.shape[1] + NEW + CFG.N)
        cache = KVCache.init(c.num_layers, SAMPLES, s, c.num_kv_heads, c.head_dim)
        return _init(Lookahead(sampling, config=CFG), graphdef, params, jnp.asarray(tokens),
                     jnp.asarray(lengths), cache, jax.random.key(0))
    return get


@pytest.fixture(scope="module")
def draw(model, initial):
    """Memoised: (sampling, verifier) -> (first NEW tokens [SAMPLES, NEW], Lookahead stats)."""
    graphdef, params = nnx.split(model)

    @functools.lru_cache(maxsize=None)
    def get(sampling: Sampling, verifier=verify_sampling):
        method = Lookahead(sampling, config=CFG, verifier=verifier)
        state = _run(method, graphdef, params, initial(sampling))
        assert bool(np.asarray(state.out.done).all())
        assert (np.asarray(state.out.count) == NEW).all()
        return np.asarray(state.out.tokens), method.summary(state)
    return get


def joint_counts(tokens: np.ndarray) -> np.ndarray:
    return np.bincount(tokens[:, 0] * V * V + tokens[:, 1] * V + tokens[:, 2],
                       minlength=V ** 3).reshape(V, V, V)


def check(name, exact_logits, tokens, stats=None):
    """-> chi-square p-value of tokens' first-3 joint vs the exact one for SETTINGS[name]."""
    probs = exact_joint(exact_logits, SETTINGS[name])
    counts = joint_counts(tokens)
    outside = int(counts[probs == 0].sum())  # tokens that top-k / top-p removed
    stat, df, p = chi_square(counts[probs > 0], probs[probs > 0])
    shown = f"{p:.3g}" if p > 0 else "< 1e-300 (underflows float64)"
    print(f"\n{name}: chi2={stat:.1f} df={df} p={shown} outside-support={outside} "
          f"stats={stats}")
    return p, outside


# ------------------------------------------------------------------ wrong rules ---

# wrong acceptance rules (sampling_checks.wrong_verdict): "no_renorm" accepts candidate c with
# its original P(c), not its probability under the residual renormalised after earlier
# rejections; "threshold" accepts c exactly when P(c) > 0.2 (no randomness)
WRONG = {rule: single_device(wrong_verdict(rule)) for rule in ("no_renorm", "threshold")}


# ------------------------------------------------------------------ exactness ---

@pytest.mark.parametrize("name", list(SETTINGS))
def test_lookahead_sampling_is_exact(name, initial, draw, exact_logits):
    """The first 3 tokens of 20,000 lookahead samples follow the exact joint distribution."""
    # the seeded pool gives every row's first step >= 2 candidates with distinct 1st tokens
    start = initial(SETTINGS[name])
    cands, valid = start.pool.lookup(start.token, CFG.G)
    first = np.where(np.asarray(valid), np.asarray(cands[:, :, 0]), -1)
    distinct = [len(set(row) - {-1}) for row in first]
    assert min(distinct) >= 2, "the prompt should seed >= 2 distinct candidate tokens"
    tokens, stats = draw(SETTINGS[name])
    p, outside = check(name, exact_logits, tokens, stats)
    assert outside == 0, "sampled a token that top-k / top-p removes"
    assert p > ALPHA, f"{name}: chi-square p = {p:.3g}"
    # not vacuous: verification decided tokens 2-3, accepting and rejecting candidates often
    hist = stats["accepted_hist"]  # steps that accepted 0, 1, 2 candidate tokens
    assert stats["pool_hit_rate"] > 0.9, stats
    assert hist[0] > 0.2 * SAMPLES, stats  # token 2: every candidate token rejected
    assert hist[1] > 0.2 * SAMPLES, stats  # token 2 accepted, token 3's candidate rejected
    assert hist[2] > 0, stats  # tokens 2 and 3 both accepted


@pytest.mark.parametrize("rule", list(WRONG))
def test_wrong_acceptance_rules_are_caught(rule, draw, exact_logits):
    """The same test with a wrong rule (same prompt, same first tokens and pool) fails."""
    tokens, stats = draw(SETTINGS["t1"], WRONG[rule])
    p, _ = check("t1", exact_logits, tokens, stats)
    assert p < WRONG_P, f"{rule}: chi-square p = {p:.3g} did not catch the wrong rule"


# ------------------------------------------------------------------ via the Engine ---

@pytest.fixture(scope="module")
def engine(model) -> Engine:
    return Engine(model, eos_ids=())


def test_temperature_near_zero_is_greedy():
    """Temperature 1e-6 reproduces greedy decoding, for lookahead and for plain decoding
    (a 48-token model with varied, partly repetitive greedy output, so candidates hit)."""
    engine = Engine(make_model(1, head=4.0, body=3.0, vocab=48), eos_ids=())
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 48, n).tolist() for n in (1, 5, 14)]
    greedy = engine.generate_ids(prompts, method="ar", max_new_tokens=24).tokens
    cold = Sampling(1e-6)
    plain = engine.generate_ids(prompts, method="ar", sampling=cold, max_new_tokens=24, seed=3)
    la = engine.generate_ids(prompts, method="lookahead", lookahead=CFG, sampling=cold,
                             max_new_tokens=24, seed=3)
    print("\ngreedy:", greedy, "\nlookahead T=1e-6 accepted_hist:",
          la.stats.extra["accepted_hist"])
    assert len({t for row in greedy for t in row}) > 10  # not a trivial cycle
    assert plain.tokens == greedy
    assert la.tokens == greedy
    assert la.stats.extra["accepted_hist"][2] > 0  # whole candidates were accepted


@pytest.mark.parametrize("method", ["lookahead", "ar"])
def test_seeds(engine, method):
    """The same seed gives the same samples; another seed, other samples; the rows of a batch
    (copies of one prompt) draw independently."""
    def gen(seed):
        return engine.generate_ids([PROMPT] * 8, method=method,
                                   lookahead=CFG if method == "lookahead" else None,
                                   sampling=SETTINGS["t1"], max_new_tokens=12, seed=seed).tokens

    first = gen(0)
    assert gen(0) == first
    assert gen(1) != first
    assert len({tuple(t) for t in first}) > 1
    assert all(len(t) == 12 for t in first)


# ------------------------------------------------------------------ bad input ---
# (the CLI's one-line errors for --temperature/--top_p/--top_k are in tests/test_cli.py)

@pytest.mark.parametrize("kw, field", [
    (dict(temperature=-0.5), "temperature"),
    (dict(temperature=float("nan")), "temperature"),
    (dict(temperature=1.0, top_p=0.0), "top_p"),
    (dict(temperature=1.0, top_p=-0.1), "top_p"),
    (dict(temperature=1.0, top_p=1.5), "top_p"),
    (dict(temperature=1.0, top_p=float("nan")), "top_p"),
    (dict(temperature=1.0, top_k=-1), "top_k"),
    (dict(temperature=1.0, top_k=2.5), "top_k"),
])
def test_bad_sampling_settings(kw, field):
    with pytest.raises(ConfigError, match=field):
        Sampling(**kw)


def test_edge_sampling_settings_are_valid():
    for s in (Sampling(), Sampling(0.0, 0, 1.0), Sampling(1e-6), Sampling(2.0, 1, 1e-3)):
        assert s.greedy == (s.temperature == 0)


@pytest.mark.parametrize("temperature", [1e-37, 1e-39])
def test_tiny_temperatures_are_greedy(temperature):
    """Any valid temperature > 0, however small, samples the argmax (like 1e-6 does)."""
    s = Sampling(temperature)
    logits = jnp.asarray([[1.0, 50.0, -3.0, 49.0]])
    lp = np.asarray(s.log_probs(logits))
    assert np.isfinite(lp[0, 1]) and lp[0, 1] > -1e-6
    assert int(s.sample(jax.random.key(0), logits)[0]) == 1
