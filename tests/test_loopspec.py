"""LoopSpec on looped models (Ouro, Raven): greedy output equals plain full-depth greedy
token for token (several draft depths d1, prompts of different lengths in one batch, EOS, a
tree too small for the pipeline); drafted children are both accepted and rejected; loops per
token fall below R; sampling keeps the exact distribution (chi-square test of the joint of
the first 3 tokens of 10,000 samples against the exact one, enumerated from the model), and
the same test catches planted wrong acceptance rules."""

from __future__ import annotations

import dataclasses
import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from lookahead_jax.engine import Engine
from lookahead_jax.generation import pad_prompts
from lookahead_jax.looped.tree import LoopTree
from lookahead_jax.looped.loopspec import LoopSpec
from lookahead_jax.looped.spec_sampling import verify_drafts
from lookahead_jax.sampling import Sampling
from models.build import build_looped
from models.config import ConfigError, LoopedConfig
from models.looped import LoopedLM
from quick_compile import long_run_options  # noqa: E402
from sampling_checks import chi_square  # noqa: E402
from test_looped import CONFIGS, _perturb_norms  # noqa: E402


def agreeable(model: LoopedLM, factor: float) -> LoopedLM:
    """Makes later loops change the state less (ouro: the sandwich layers' output norms;
    raven: the adapter's weight on the previous state), so that early readouts often, but not
    always, agree with the full-depth one: drafts are both accepted and rejected."""
    if model.config.family == "ouro":
        for layer in model.layers:
            for norm in (layer.input_layernorm_2, layer.post_attention_layernorm_2):
                norm.weight.set_value(norm.weight.get_value() * factor)
    else:
        k = model.adapter.kernel.get_value()
        model.adapter.kernel.set_value(k.at[: model.config.hidden_size].multiply(factor))
    return model


FACTOR = {"ouro": 0.03, "raven": 0.3}


@pytest.fixture(scope="module", params=list(CONFIGS))
def engine(request) -> Engine:
    fam = request.param
    model = agreeable(_perturb_norms(build_looped(CONFIGS[fam], rngs=nnx.Rngs(3))), FACTOR[fam])
    return Engine(model, eos_ids=())


PROMPTS = [np.random.default_rng(0).integers(0, 97, n).tolist() for n in (1, 4, 13)]


@pytest.fixture(scope="module")
def plain(engine):
    return engine.generate_ids(PROMPTS, method="ar", max_new_tokens=24)


@pytest.mark.parametrize("d1", [1, 2])
def test_greedy_equals_plain(engine, plain, d1):
    r_full = engine.config.num_loops
    res = engine.generate_ids(PROMPTS, method=LoopSpec(d1=d1), max_new_tokens=24)
    st = res.stats.extra
    print(f"\n{engine.config.family} d1={d1}: {st}")
    assert len({t for row in plain.tokens for t in row}) > 8  # not a trivial cycle
    assert res.tokens == plain.tokens
    assert st["verified_tokens"] == sum(len(t) - 1 for t in plain.tokens)
    assert 0 < st["draft_acceptance"] < 1  # drafts both accepted and rejected
    assert st["loops_per_token"] < r_full
    assert st["advances_per_token"] >= r_full  # every emitted token ran all R loops
    # every draft was the depth-d1 argmax in its true context (no draft went unmade)
    assert st["draft_acceptance"] == pytest.approx(agreement(engine, plain, [d1]))


def agreement(engine: Engine, plain, depths) -> float:
    """The share of verified positions of plain greedy's output where the argmax at one of
    `depths` equals the full-depth argmax: greedy LoopSpec's draft acceptance when every draft
    is the readout's argmax in its true context."""
    model = engine_model(engine)
    agree = total = 0
    for prompt, out in zip(PROMPTS, plain.tokens):
        seq = prompt + out
        logits = model.loop_logits(jnp.asarray([seq]), jnp.arange(len(seq))[None])[0][:, 0]
        top = np.asarray(jnp.argmax(logits, -1))  # [R, T]
        at = np.arange(len(prompt), len(seq) - 1)  # roots that verified a child
        hit = np.zeros(len(at), bool)
        for d in depths:
            hit |= top[d - 1, at] == top[-1, at]
        agree += int(hit.sum())
        total += len(at)
    return agree / total


def test_dual_proposal_greedy_equals_plain(engine, plain):
    """LoopSpec with the second proposal at d2 = 2: still plain greedy's tokens, second drafts
    accepted, fewer loops per token than with d1 alone."""
    one = engine.generate_ids(PROMPTS, method=LoopSpec(d1=1), max_new_tokens=24)
    res = engine.generate_ids(PROMPTS, method=LoopSpec(d1=1, d2=2), max_new_tokens=24)
    print(f"\n{engine.config.family} d1=1 d2=2: {res.stats.extra}")
    assert res.tokens == plain.tokens
    assert res.stats.extra["second_draft_accepted"] > 0
    assert res.stats.extra["draft_acceptance"] == pytest.approx(agreement(engine, plain, [1, 2]))
    assert res.stats.extra["loops_per_token"] < one.stats.extra["loops_per_token"]


def test_plain_loops_per_token_is_r(engine, plain):
    """Plain decoding's own count: R shared-block calls per token (prefill aside)."""
    assert plain.stats.steps == 24  # prefill + 23 steps of R loops each


def test_eos_and_small_tree(engine, plain):
    """A row stops at EOS (taken from plain greedy's output) while the others go on; a tree
    too small for the pipeline (capacity 2) drops drafts but stays exact."""
    eos = plain.tokens[1][5]
    want = [row[: row.index(eos) + 1] if eos in row else row for row in plain.tokens]
    eng = Engine(engine_model(engine), eos_ids=(eos,))
    for method in (LoopSpec(d1=1), LoopSpec(d1=1, capacity=2)):
        res = eng.generate_ids(PROMPTS, method=method, max_new_tokens=24)
        assert res.tokens == want, method


def engine_model(engine: Engine) -> LoopedLM:
    return nnx.merge(engine.graphdef, engine.params)


def test_near_zero_temperature_is_greedy(engine, plain):
    res = engine.generate_ids(PROMPTS, method=LoopSpec(Sampling(1e-6), d1=1), max_new_tokens=24,
                              seed=5)
    assert res.tokens == plain.tokens


def test_bad_settings(engine):
    with pytest.raises(ConfigError, match="d1"):
        LoopSpec(d1=0)
    r_full = engine.config.num_loops
    with pytest.raises(ConfigError, match="d2 must be above"):
        LoopSpec(d1=2, d2=2)
    with pytest.raises(ConfigError, match="below the"):
        engine.generate_ids([[1, 2]], method=LoopSpec(d1=r_full), max_new_tokens=2)
    model = engine_model(engine)
    graphdef, params = nnx.split(model)
    tokens, lengths = pad_prompts([[1, 2]])
    with pytest.raises(ConfigError, match="scratch positions"):  # 16 + 2 + (R + 1) > 20
        LoopSpec(d1=1).init(graphdef, {"model": params, "method": {}}, tokens, lengths,
                            model.init_cache(1, 20), jax.random.key(0), max_new_tokens=2,
                            eos_ids=())


def test_needs_a_looped_model():
    from models.llama import Llama, LlamaConfig  # noqa: PLC0415
    cfg = LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_layers=1,
                      num_heads=2, num_kv_heads=2, eos_token_ids=())
    eng = Engine(Llama(cfg, rngs=nnx.Rngs(0)), eos_ids=())
    with pytest.raises(ConfigError, match="looped model"):
        eng.generate_ids([[1, 2]], method="loopspec", max_new_tokens=2)


def test_tree_spawn_and_prune():
    """LoopTree bookkeeping: children take free slots in order, ancestor sets follow the
    parents, pruning to a subtree frees the rest and clears them from ancestor sets."""
    tree = LoopTree.init(jnp.asarray([7]), jnp.asarray([10]), 4, 8, jnp.float32, 1)
    q = jnp.zeros((1, 4, 1))
    tree, child = tree.spawn(jnp.asarray([[True, False, False, False]]), jnp.full((1, 4), 3), q)
    assert child.tolist() == [[1, -1, -1, -1]]
    tree, _ = tree.spawn(jnp.asarray([[True, True, False, False]]), jnp.asarray([[4, 5, 0, 0]]),
                         q)  # slot 0 gets a second child (slot 2), slot 1 a child (slot 3)
    assert tree.valid.tolist() == [[True] * 4]
    assert tree.parent.tolist() == [[-1, 0, 0, 1]]
    assert tree.token.tolist() == [[7, 3, 4, 5]] and tree.pos.tolist() == [[10, 11, 11, 12]]
    assert tree.anc[0, 3].tolist() == [True, True, False, False]
    tree = tree.keep_subtree(jnp.asarray([True]), jnp.asarray([1]))
    assert tree.valid.tolist() == [[False, True, False, True]] and int(tree.root[0]) == 1
    assert tree.anc[0, 3].tolist() == [False, True, False, False]
    assert tree.parent.tolist()[0][1] == -1


# ------------------------------------------------------------------ sampling ---

V = 6
NEW = 3
SAMPLES = 10_000
ALPHA = 1e-3
WRONG_P = 1e-10
PROMPT = [0, 1, 2, 0, 3, 4, 1, 5]
SETTINGS = {"t1": Sampling(1.0), "topk4": Sampling(1.0, top_k=4)}
SAMPLING_CFG = LoopedConfig(family="ouro", vocab_size=V, hidden_size=32, intermediate_size=48,
                            num_heads=4, num_kv_heads=2, num_loops=3, num_layers=1,
                            max_position_embeddings=64, eos_token_ids=())


@pytest.fixture(scope="module")
def small_model() -> LoopedLM:
    return make_small_model()


def make_small_model(num_loops: int = 3) -> LoopedLM:
    """A 6-token Ouro with 3 loops whose readouts are high-entropy and differ between depth
    1 and depth 3 (so drafts are often rejected and often accepted)."""
    cfg = dataclasses.replace(SAMPLING_CFG, num_loops=num_loops)
    model = _perturb_norms(build_looped(cfg, rngs=nnx.Rngs(0)))
    rng = np.random.default_rng(0)
    emb = rng.normal(size=(V, 32)).astype(np.float32)
    model.embed_tokens.embedding.set_value(jnp.asarray(emb / np.linalg.norm(emb, axis=1,
                                                                           keepdims=True)))
    head = rng.normal(size=(32, V)).astype(np.float32) / np.sqrt(32)
    model.lm_head.kernel.set_value(jnp.asarray(head))
    for layer in model.layers:  # each loop changes the state more
        for norm in (layer.input_layernorm_2, layer.post_attention_layernorm_2):
            norm.weight.set_value(norm.weight.get_value() * 3.0)
    return model


@pytest.fixture(scope="module")
def exact_probs(small_model):
    return exact_joint(small_model)


def exact_joint(small_model):
    """sampling -> P(t1, t2, t3) [V, V, V], from full-depth logits of all 1 + V + V^2
    prefixes (one cache-free forward)."""
    seqs = ([PROMPT] + [PROMPT + [a] for a in range(V)]
            + [PROMPT + [a, b] for a in range(V) for b in range(V)])
    t = len(PROMPT) + 2
    tokens = np.zeros((len(seqs), t), np.int32)
    for i, s in enumerate(seqs):
        tokens[i, : len(s)] = s
    last = np.array([len(s) - 1 for s in seqs])
    pos = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32)[None], tokens.shape)
    logits = np.asarray(small_model.loop_logits(jnp.asarray(tokens), pos)[0][-1])
    logits = logits[np.arange(len(seqs)), last]
    l0, l1, l2 = logits[0], logits[1: 1 + V], logits[1 + V:].reshape(V, V, V)

    def get(sampling):
        def p(x):
            return np.asarray(jax.nn.softmax(sampling.log_probs(jnp.asarray(x)), -1), np.float64)
        return p(l0)[:, None, None] * p(l1)[:, :, None] * p(l2)
    return get


@functools.partial(jax.jit, static_argnums=(0, 1), compiler_options=long_run_options())
def _generate(method, graphdef, params, tokens, lengths, cache, key):
    params = {"model": params, "method": method.params()}  # LoopAhead: the drafter's too
    state = method.init(graphdef, params, tokens, lengths, cache, key, max_new_tokens=NEW,
                        eos_ids=())
    return method.run(graphdef, params, state, jnp.asarray(8 * NEW, jnp.int32), eos_ids=())


def sample_many(model, method):
    """SAMPLES independent generations of NEW tokens after PROMPT with a tree method (LoopSpec
    or LoopAhead), in one batch: tokens [SAMPLES, NEW] and the method's summary."""
    graphdef, params = nnx.split(model)
    tokens, lengths = pad_prompts([PROMPT] * SAMPLES)
    cap = method.tree_capacity(model.config.num_loops)
    cache = model.init_cache(SAMPLES, tokens.shape[1] + NEW + cap)
    state = _generate(method, graphdef, params, jnp.asarray(tokens), jnp.asarray(lengths),
                      cache, jax.random.key(0))
    assert (np.asarray(state.out.count) == NEW).all()
    return np.asarray(state.out.tokens), method.summary(state)


@pytest.fixture(scope="module")
def draw(small_model):
    @functools.lru_cache(maxsize=None)
    def get(sampling, d2=0, verifier=verify_drafts):
        return sample_many(small_model, LoopSpec(sampling, d1=1, d2=d2, verifier=verifier))
    return get


def check(probs, tokens, label, stats):
    counts = np.bincount(tokens[:, 0] * V * V + tokens[:, 1] * V + tokens[:, 2],
                         minlength=V ** 3).reshape(V, V, V)
    outside = int(counts[probs == 0].sum())
    stat, df, p = chi_square(counts[probs > 0], probs[probs > 0])
    print(f"\n{label}: chi2={stat:.1f} df={df} p={p:.3g} outside={outside} {stats}")
    return p, outside


@pytest.mark.parametrize("name", list(SETTINGS))
def test_sampling_is_exact(name, draw, exact_probs):
    tokens, stats = draw(SETTINGS[name])
    p, outside = check(exact_probs(SETTINGS[name]), tokens, name, stats)
    assert outside == 0
    assert p > ALPHA, f"{name}: chi-square p = {p:.3g}"
    # not vacuous: tokens 2 and 3 were verified drafts, often accepted and often rejected
    assert stats["verified_tokens"] == 2 * SAMPLES
    assert 0.2 < stats["draft_acceptance"] < 0.8, stats


def wrong_rule(kind: str):
    """verify_drafts (one draft) with a planted mistake. "accept_p": accepts x with
    probability p(x) instead of min(1, p(x)/q(x)); "target_residual": on rejection draws from
    p itself instead of normalize(max(p - q, 0))."""

    def verify(u, p, q, x, has, key):
        rows = jnp.arange(x.shape[0])
        x0, q0, has0 = x[:, 0], q[:, 0], has[:, 0]
        if kind == "accept_p":  # WRONG
            accept = has0 & (u[:, 0] < p[rows, x0])
            residual = jnp.where(has0[:, None], jnp.maximum(p - q0, 0.0), p)
            residual = jnp.where(residual.sum(-1, keepdims=True) > 0, residual, p)
        else:  # "target_residual", WRONG
            accept = has0 & (u[:, 0] * q0[rows, x0] < p[rows, x0])
            residual = p
        drawn = jax.random.categorical(key, jnp.log(residual), axis=-1).astype(jnp.int32)
        return jnp.where(accept, 0, -1), jnp.where(accept, x0, drawn)

    verify.__name__ = kind
    return verify


WRONG = {"accept_p": wrong_rule("accept_p"), "target_residual": wrong_rule("target_residual")}


def second_against_target(u, p, q, x, has, key):
    """WRONG cascade: the second draft is tested against p instead of the residual left by
    rejecting the first (and the final draw comes from that residual)."""
    rows = jnp.arange(x.shape[0])
    acc1 = has[:, 0] & (u[:, 0] * q[rows, 0, x[:, 0]] < p[rows, x[:, 0]])
    r1 = jnp.maximum(p - q[:, 0], 0.0)
    r1 = jnp.where(has[:, :1] & (r1.sum(-1, keepdims=True) > 0), r1, p)
    r1 = r1 / r1.sum(-1, keepdims=True)
    acc2 = ~acc1 & has[:, 1] & (u[:, 1] * q[rows, 1, x[:, 1]] < p[rows, x[:, 1]])  # WRONG: p
    r2 = jnp.maximum(r1 - q[:, 1], 0.0)
    r2 = jnp.where(has[:, 1:] & (r2.sum(-1, keepdims=True) > 0), r2, r1)
    drawn = jax.random.categorical(key, jnp.log(r2), axis=-1).astype(jnp.int32)
    which = jnp.where(acc1, 0, jnp.where(acc2, 1, -1))
    return which, jnp.where(acc1, x[:, 0], jnp.where(acc2, x[:, 1], drawn))


@pytest.mark.parametrize("rule", list(WRONG))
def test_wrong_rules_are_caught(rule, draw, exact_probs):
    tokens, stats = draw(SETTINGS["t1"], verifier=WRONG[rule])
    p, _ = check(exact_probs(SETTINGS["t1"]), tokens, rule, stats)
    assert p < WRONG_P, f"{rule}: p = {p:.3g} did not catch the wrong rule"


def test_dual_proposal_sampling_is_exact(draw, exact_probs):
    """With the second proposal at d2 = 2 (cascade verification), still exact; second drafts
    are made and accepted."""
    tokens, stats = draw(SETTINGS["t1"], d2=2)
    p, _ = check(exact_probs(SETTINGS["t1"]), tokens, "t1 d2=2", stats)
    assert p > ALPHA, f"d2: chi-square p = {p:.3g}"
    assert stats["second_draft_accepted"] > 0.02 * SAMPLES, stats


def test_wrong_cascade_is_caught(draw, exact_probs):
    tokens, stats = draw(SETTINGS["t1"], d2=2, verifier=second_against_target)
    p, _ = check(exact_probs(SETTINGS["t1"]), tokens, "second_against_target", stats)
    assert p < WRONG_P, f"p = {p:.3g} did not catch the wrong cascade"


# ------------------------------------------------------------------ command line ---

def test_cli_loopspec(tmp_path):
    """`--method=loopspec` on a looped preset emits plain decoding's tokens and reports its
    loop counts; on a non-looped preset it is one clear error."""
    from test_cli import assert_error, run_inproc  # noqa: PLC0415
    outs = {}
    for method in ("ar", "loopspec"):
        path = tmp_path / f"{method}.json"
        res = run_inproc(config="tiny_raven", ckpt="random", prompt_ids="5,6,7,8,9",
                         method=method, max_new_tokens=8, json_out=str(path))
        assert res.returncode == 0, res.stderr
        with open(path) as f:
            outs[method] = json.load(f)["results"][0]
    assert outs["loopspec"]["tokens"] == outs["ar"]["tokens"]
    extra = outs["loopspec"]["stats"]["extra"]
    assert extra["verified_tokens"] == 7 and extra["loops_per_token"] <= 8
    assert_error(run_inproc(config="tiny_llama", prompt_ids="1,2", method="loopspec"),
                 "--method=loopspec", "looped")
