"""Prompt lookup decoding: the draft search, losslessness against plain greedy decoding (the
tiny_llama preset's random weights, the embedded SmolLM2), batches, EOS, exact sampling, the
engine and the CLI.

Not vacuous: the repetitive prompts make drafts hit, and the tests require steps that accept
several draft tokens, so a broken draft or commit shows up as a difference from plain decoding.
"""

from __future__ import annotations

import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from lookahead_jax.engine import Engine
from lookahead_jax.registry import build_method
from lookahead_jax.generation import cache_length_for, pad_prompts
from lookahead_jax.prompt_lookup import PromptLookup, find_draft
from lookahead_jax.sampling import Sampling
from lookahead_jax.lookahead.verify import Verdict, verify_sampling
from models import KVCache
from models.config import ConfigError
from models.layers import causal_mask
from test_cli import assert_error, run_cli, run_inproc, stats_lines  # noqa: E402
from test_lookahead import expected  # noqa: E402
from test_lookahead_sampling import chi_square, make_model  # noqa: E402

# -------------------------------------------------------------------------- the search ---


def _find(seqs, max_ngram, num_tokens, width=None):
    """find_draft (jitted) on a list of sequences, right-padded with junk to `width`."""
    width = width or max(len(s) for s in seqs) + 3
    hist = np.full((len(seqs), width), 7, np.int32)  # junk past each sequence: must be ignored
    for i, s in enumerate(seqs):
        hist[i, : len(s)] = s
    fn = jax.jit(functools.partial(find_draft, max_ngram=max_ngram, num_tokens=num_tokens))
    draft, n = fn(jnp.asarray(hist), jnp.asarray([len(s) for s in seqs], jnp.int32))
    return [d[:k].tolist() for d, k in zip(np.asarray(draft), np.asarray(n))], np.asarray(draft)


def reference_draft(seq, max_ngram, num_tokens):
    """The rule, spelled out with Python loops."""
    for n in range(min(max_ngram, len(seq)), 0, -1):
        suffix = seq[len(seq) - n:]
        for end in range(len(seq) - 2, n - 2, -1):  # latest first; never the suffix itself
            if seq[end - n + 1: end + 1] == suffix:
                return seq[end + 1: end + 1 + num_tokens]
    return []


def test_find_draft_hand_made():
    drafts, raw = _find([
        [1, 2, 9, 1, 2, 8, 5, 1, 2],  # "1 2" twice earlier: the latest (then 8 5 1) wins
        [9, 3, 5, 5, 8, 3, 6, 6, 9, 3],  # "9 3" (5 5 8) beats the later "3" (6 6 9)
        [1, 2, 3, 4],  # nothing occurs earlier: no draft
        [5, 6, 5],  # the draft stops at the end of the sequence
        [4],  # one token: nothing earlier
        [7, 7],  # "7" at 0, followed by the current token
    ], max_ngram=3, num_tokens=3)
    assert drafts == [[8, 5, 1], [5, 5, 8], [], [6, 5], [], [7]]
    assert (raw[2] == 0).all() and raw[3, 2] == 0  # zeros past the draft
    # a shorter max_ngram only sees the last token
    assert _find([[9, 3, 5, 5, 8, 3, 6, 6, 9, 3]], max_ngram=1, num_tokens=3)[0] == [[6, 6, 9]]
    # junk past the sequence (here equal to the suffix) never matches
    assert _find([[7, 1, 2, 7]], max_ngram=2, num_tokens=2, width=12)[0] == [[1, 2]]


def test_find_draft_matches_the_reference():
    """Random sequences over a 4-token vocabulary (many matches), many lengths, one batch."""
    rng = np.random.default_rng(0)
    seqs = [rng.integers(0, 4, n).tolist() for n in rng.integers(1, 30, 64)]
    for max_ngram, num_tokens in [(3, 5), (1, 2), (4, 1)]:
        got, _ = _find(seqs, max_ngram, num_tokens, width=32)
        want = [reference_draft(s, max_ngram, num_tokens) for s in seqs]
        assert got == want, (max_ngram, num_tokens)


@pytest.mark.parametrize("kw, fragment", [
    (dict(num_tokens=0), "--pl_tokens"), (dict(max_ngram=0), "--pl_ngram"),
    (dict(num_tokens=2.5), "num_tokens"), (dict(max_ngram=True), "max_ngram")])
def test_bad_settings(kw, fragment):
    with pytest.raises(ConfigError, match=fragment):
        PromptLookup(**kw)


def test_registry_builds_prompt_lookup():
    m = build_method("prompt_lookup", sampling=Sampling(0.5))
    assert m == PromptLookup(Sampling(0.5)) and (m.num_tokens, m.max_ngram) == (10, 3)
    assert m.cache_capacity(None) == 11
    assert build_method("prompt_lookup", pl_tokens=4, pl_ngram=2) == PromptLookup(
        num_tokens=4, max_ngram=2)
    with pytest.raises(ConfigError, match="prompt_lookup"):
        build_method("no_such_method")


# ------------------------------------------------------- tiny_llama: lossless greedy ---

MAX_NEW = 40
TINY_PROMPTS = [[5, 6, 7, 8, 9] * 2 + [5, 6, 7],  # repetitive: drafts hit
                np.random.default_rng(0).integers(3, 512, 23).tolist()]  # another bucket


@pytest.fixture(scope="module")
def tiny_model():
    from lookahead_jax.store.checkpoint import load_model_and_tokenizer  # noqa: PLC0415
    from lookahead_jax.store.presets import load_preset  # noqa: PLC0415
    return load_model_and_tokenizer(load_preset("tiny_llama"), None, None)[0]


@pytest.fixture(scope="module")
def engines(tiny_model):
    """One Engine per EOS set (each keeps its own compiled functions)."""
    return functools.lru_cache(maxsize=None)(lambda eos: Engine(tiny_model, eos_ids=eos))


@pytest.fixture(scope="module")
def plain(engines):
    """Plain greedy output of each prompt alone, MAX_NEW tokens, no EOS: the ground truth."""
    return [engines(()).generate_ids([p], method="ar", max_new_tokens=MAX_NEW).tokens[0]
            for p in TINY_PROMPTS]


@pytest.mark.parametrize("num_tokens, max_ngram", [(10, 3), (1, 1), (4, 2)])
def test_tiny_batch_equals_plain_greedy(engines, plain, num_tokens, max_ngram):
    """A batch of 2 prompts of lengths 13 and 23 emits exactly plain greedy's tokens, in fewer
    steps, with multi-token accepts."""
    method = PromptLookup(num_tokens=num_tokens, max_ngram=max_ngram)
    res = engines(()).generate_ids(TINY_PROMPTS, method=method, max_new_tokens=MAX_NEW)
    extra = res.stats.extra
    print(f"\n({num_tokens}, {max_ngram}): steps={res.stats.steps} {extra}")
    assert res.tokens == plain
    hist = extra["accepted_hist"]
    assert len(hist) == num_tokens + 1
    # every live row-step emitted its accepted tokens + 1 (the last ones may be cut by MAX_NEW)
    assert sum((k + 1) * h for k, h in enumerate(hist)) >= res.stats.total_tokens - 2
    assert sum(hist[1:]) > 0 and res.stats.steps < MAX_NEW
    if num_tokens >= 2:
        assert sum(hist[2:]) > 0, extra  # whole runs of draft tokens accepted in one step
    assert 0 < extra["draft_hit_rate"] <= 1 and 0 < extra["draft_acceptance"] <= 1


def test_tiny_alone_equals_batch(engines, plain):
    for p, ref in zip(TINY_PROMPTS, plain):
        res = engines(()).generate_ids([p], method="prompt_lookup", max_new_tokens=MAX_NEW)
        assert res.tokens == [ref]


def test_tiny_eos_and_max_new_tokens(engines, plain):
    """An EOS inside prompt 0's output stops that row right after it (kept); the other row
    goes on to MAX_NEW. A small max_new_tokens cuts accepted runs exactly."""
    ref = plain[0]
    at = next(i for i in range(12, MAX_NEW) if ref[i] not in ref[:i])  # first use of a token
    eos = (ref[at],)
    res = engines(eos).generate_ids(TINY_PROMPTS, method="prompt_lookup", max_new_tokens=MAX_NEW)
    assert res.tokens == [expected(r, eos, MAX_NEW) for r in plain]
    assert len(res.tokens[0]) == at + 1 < MAX_NEW and res.tokens[0][-1] == eos[0]
    assert res.stats.new_tokens == [at + 1, len(res.tokens[1])]
    for max_new in (1, 13):
        res = engines(()).generate_ids(TINY_PROMPTS, method="prompt_lookup",
                                       max_new_tokens=max_new)
        assert res.tokens == [r[:max_new] for r in plain]


# ------------------------------------------------------------------ exact sampling ---

V = 6
# the model's greedy continuation of 0 1 2 3: drafts copied from it are often, not always, what
# the model samples, so verification both accepts and rejects often
PROMPT = [0, 1, 2, 3, 2, 0, 2, 0, 2, 0, 2, 0, 2, 0, 2, 0]
SAMPLES = 10_000
ALPHA = 1e-3  # the correct rule must give p > ALPHA
WRONG_P = 1e-10  # a wrong rule must give p below this


def exact_first3(model, prompt, sampling):
    """P(t1, t2, t3) [V, V, V] of the model's warped distribution: one cache-free forward over
    the 1 + V + V^2 prefixes."""
    seqs = ([prompt] + [prompt + [a] for a in range(V)]
            + [prompt + [a, b] for a in range(V) for b in range(V)])
    t = len(prompt) + 2
    tokens = np.zeros((len(seqs), t), np.int32)
    lengths = np.array([len(s) for s in seqs], np.int32)
    for i, s in enumerate(seqs):
        tokens[i, : len(s)] = s
    positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32)[None], tokens.shape)
    logits, _ = model(jnp.asarray(tokens), positions, causal_mask(jnp.asarray(lengths), t), None,
                      logits_at=jnp.asarray(lengths - 1)[:, None])
    p = np.asarray(jax.nn.softmax(sampling.log_probs(logits[:, 0]), -1), np.float64)
    return p[0][:, None, None] * p[1: 1 + V][:, :, None] * p[1 + V:].reshape(V, V, V)


def resample_from_target(key, sampling, logits0, cand_logits, cands, valid):
    """A WRONG rule for one draft [B, 1, L]: on rejecting draft token x, draws from p itself
    instead of p with x removed (so x comes out too often)."""
    b, _, n = cands.shape
    rows = jnp.arange(b)
    p = jax.nn.softmax(sampling.log_probs(
        jnp.concatenate([logits0[:, None], cand_logits[:, 0]], axis=1)), axis=-1)  # [B, L+1, V]
    k_try, k_draw = jax.random.split(key)
    draft = cands[:, 0]
    p_draft = jnp.take_along_axis(p[:, :n], draft[..., None], axis=-1)[..., 0]
    ok = valid[:, 0] & (jax.random.uniform(k_try, (b, n)) < p_draft)
    k = jnp.cumprod(ok, axis=1).sum(1).astype(jnp.int32)
    drawn = jax.random.categorical(k_draw, jnp.log(p[rows, k])).astype(jnp.int32)
    tokens = jnp.concatenate([draft, jnp.zeros((b, 1), jnp.int32)], axis=1)
    tokens = jnp.where(jnp.arange(n + 1)[None] == k[:, None], drawn[:, None], tokens)
    return Verdict(k, jnp.zeros_like(k), tokens, k + 1)


def sample_first3(sampling, verifier=verify_sampling):
    """-> (first 3 tokens of SAMPLES copies of PROMPT [SAMPLES, 3], summary, exact joint)."""
    model = make_model()
    graphdef, params = nnx.split(model)
    method = PromptLookup(sampling, num_tokens=2, max_ngram=2, verifier=verifier)
    tokens, lengths = pad_prompts([PROMPT] * SAMPLES)
    c = model.config
    capacity = method.cache_capacity(c)
    need = tokens.shape[1] + 3 + capacity  # a small cache for SAMPLES rows
    s = cache_length_for(tokens.shape[1], 3, capacity, c.max_position_embeddings, need)
    cache = KVCache.init(c.num_layers, SAMPLES, s, c.num_kv_heads, c.head_dim)

    @jax.jit
    def go(params, tokens, lengths, cache):
        params = {"model": params, "method": {}}
        st = method.init(graphdef, params, tokens, lengths, cache, jax.random.key(0),
                         max_new_tokens=3, eos_ids=())
        return method.run(graphdef, params, st, jnp.asarray(3, jnp.int32), eos_ids=())

    state = go(params, jnp.asarray(tokens), jnp.asarray(lengths), cache)
    assert (np.asarray(state.out.count) == 3).all()
    return (np.asarray(state.out.tokens), method.summary(state),
            exact_first3(model, PROMPT, sampling))


def check(out, probs, name):
    """-> (chi-square p-value of the first-3 joint against probs, samples outside support)."""
    counts = np.bincount(out[:, 0] * V * V + out[:, 1] * V + out[:, 2],
                         minlength=V ** 3).reshape(V, V, V)
    stat, df, p = chi_square(counts[probs > 0], probs[probs > 0])
    print(f"\n{name}: chi2={stat:.1f} df={df} p={p:.3g}")
    return p, int(counts[probs == 0].sum())


@pytest.mark.parametrize("sampling", [Sampling(1.0), Sampling(1.0, top_k=3)], ids=str)
def test_sampling_is_exact(sampling):
    """The first 3 tokens of 10,000 prompt lookup samples (2-token drafts, so tokens 2 and 3
    are decided by verification) follow the exact joint distribution (chi-square)."""
    out, stats, probs = sample_first3(sampling)
    p, outside = check(out, probs, f"{sampling} {stats}")
    assert outside == 0, "sampled a token that top-k removes"
    assert p > ALPHA
    hist = stats["accepted_hist"]  # token 2 rejected / token 2 accepted / both accepted
    assert 0.5 < stats["draft_hit_rate"] < 1, stats  # some rows have no draft (a plain step)
    assert min(hist) > 0.1 * SAMPLES, stats


def test_wrong_sampling_rule_is_caught():
    """Not vacuous: the same test with the classic mistake fails."""
    out, _, probs = sample_first3(Sampling(1.0), resample_from_target)
    assert check(out, probs, "resample_from_target")[0] < WRONG_P


def test_sampling_seeds(engines):
    def gen(seed):
        return engines(()).generate_ids(TINY_PROMPTS, method="prompt_lookup", max_new_tokens=12,
                                        sampling=Sampling(1.0), seed=seed).tokens
    first = gen(0)
    assert gen(0) == first and gen(1) != first
    assert [len(t) for t in first] == [12, 12]


# -------------------------------------------------------------------------- SmolLM2 ---

SMOL_PROMPTS = ["Repeat this sentence three times: the cat sat on the mat.",
                "Fix the typo and print the list again: apple, banana, chery, date, elderberry, "
                "fig."]


def test_smollm2_equals_plain_greedy():
    """The embedded SmolLM2 (chat template): a batch of 2 prompts that ask for copies of their
    own text gives plain greedy decoding's tokens (each prompt alone), ending at EOS, with
    long runs of draft tokens accepted."""
    from lookahead_jax.store.model_store import smollm2_gguf  # noqa: PLC0415
    from lookahead_jax.engine import Engine  # noqa: PLC0415
    try:
        smollm2_gguf(download=False)
    except ConfigError as e:
        pytest.skip(f"SmolLM2 not available: {e}")
    engine = Engine.from_preset("smollm2_135m")
    ids = [engine.encode(p) for p in SMOL_PROMPTS]
    assert len(ids[0]) != len(ids[1])
    ref = [engine.generate_ids([p], method="ar", max_new_tokens=40).tokens[0] for p in ids]
    res = engine.generate_ids(ids, method="prompt_lookup", max_new_tokens=40)
    print("\n", res.stats.line(), res.stats.extra)
    assert res.tokens == ref
    assert all(t[-1] in engine.eos_ids and len(t) < 40 for t in res.tokens)  # EOS ended both
    assert sum(res.stats.extra["accepted_hist"][4:]) > 0  # runs of >= 4 draft tokens accepted
    assert res.stats.steps < max(len(t) for t in res.tokens)


# ------------------------------------------------------------------------------ CLI ---

def test_cli_matches_ar(tmp_path):
    common = dict(config="tiny_llama", prompt_ids=",".join(map(str, TINY_PROMPTS[0])),
                  max_new_tokens=20)
    ar = run_inproc(**common, method="ar")
    out = tmp_path / "pl.json"
    pl = run_inproc(**common, method="prompt_lookup", pl_tokens=4, pl_ngram=2,
                    json_out=str(out))
    for res in (ar, pl):
        assert res.returncode == 0, res.stderr
        assert "error:" not in res.stderr and len(stats_lines(res)) == 1
    assert pl.stdout == ar.stdout and len(ar.stdout.split()) == 20
    record = json.loads(out.read_text())
    assert record["method"] == "prompt_lookup"
    extra = record["results"][0]["stats"]["extra"]
    assert (extra["num_tokens"], extra["max_ngram"]) == (4, 2) and len(extra["accepted_hist"]) == 5
    assert record["results"][0]["stats"]["steps"] < 20


@pytest.mark.parametrize("options, fragments", [
    (dict(method="prompt_lookup", pl_tokens=0), ["--pl_tokens", ">= 1"]),
    (dict(method="prompt_lookup", pl_ngram=-1), ["--pl_ngram", ">= 1"]),
    (dict(method="ar", pl_tokens=4), ["--pl_tokens", "--method=prompt_lookup"]),
    (dict(pl_ngram=2), ["--pl_ngram", "--method=prompt_lookup"]),  # the preset's lookahead
    (dict(method="prompt_lookup", W=5), ["--W", "--method=lookahead"]),
    (dict(method="prompt_lookup", devices=2), ["--devices"]),
])
def test_cli_bad_settings(options, fragments):
    assert_error(run_inproc(config="tiny_llama", prompt_ids="1,2,3", **options), *fragments)


def test_cli_subprocess():
    """The real entry point: flags parse, the method runs, a bad setting is one error line."""
    res = run_cli("--config=tiny_llama", "--prompt_ids=5,6,7,5,6", "--method=prompt_lookup",
                  "--pl_tokens=3", "--pl_ngram=2", "--max_new_tokens=8")
    assert res.returncode == 0, res.stderr
    assert len(res.stdout.split()) == 8 and len(stats_lines(res)) == 1
    assert_error(run_cli("--config=tiny_llama", "--prompt_ids=1", "--method=prompt_lookup",
                         "--pl_tokens=0"), "--pl_tokens")
