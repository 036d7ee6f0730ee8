"""Sampling keeps the distribution over whole generations, not only in the first step.

Each method samples several thousand rows of 8-10 new tokens (several verification steps each)
from a Markov test model whose exact distribution over the whole generation is known
(`sampling_checks`), in batches mixing two prompt lengths, for three sampling settings
(temperature, top-k, top-p): every position's and every adjacent pair's distribution, per
prompt, and the independence of neighbouring rows are checked by chi-square tests, with one
Bonferroni threshold for the whole family of runs (1% false alarms in all). The same checks
run on planted faults of the later steps (a reused key, the residual update skipped in one
later step, a row committing its neighbour's candidate, a suspended LoopAhead branch verified
against a stale proposal distribution) and must fail on each. Lookahead parallelism's runs are
in test_parallel.py (8 CPU devices). A two-sample test compares lookahead and prompt lookup
with plain sampling on a model whose next token depends on the whole context.

`pytest -s tests/test_sampling_generations.py` prints every run's smallest p-value, its
threshold and, for the faults, the estimated power of the failing check.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
from typing import Callable

import numpy as np
import pytest
from flax import nnx

from lookahead_jax.engine import Engine
from lookahead_jax.lookahead.config import LookaheadConfig
from lookahead_jax.lookahead.step import Lookahead
from lookahead_jax.looped.loopahead import LoopAhead
from lookahead_jax.looped.loopspec import LoopSpec
from lookahead_jax.prompt_lookup import PromptLookup
from lookahead_jax.sampling import Sampling
from quick_compile import long_run_options
from sampling_checks import (SETTINGS, V, Fault, StaleLoopAhead, after_verification, at_step,
                             at_verification, cascade, exact_checks, from_step, markov_llama,
                             markov_logits, markov_ouro, next_rows_candidate, next_rows_draft,
                             next_token_logits, planted, power, prompts, report, sampling,
                             single_device, threshold, transition, two_sample_checks, worst,
                             wrong_verdict)


class TableDrafter:
    """A deterministic LoopAhead drafter: after anchor a it proposes a+1, a+2 (the chain's
    likeliest continuation), so its chains are often, not always, accepted."""

    K = 2

    def __init__(self):
        table = np.stack([(np.arange(V) + 1) % V, (np.arange(V) + 2) % V], axis=1)
        self.params = {"table": np.asarray(table, np.int32)}

    def draft(self, params, states, anchors, positions, mask, **_):
        return params["table"][anchors[:, -1]]


DRAFTER = TableDrafter()  # one instance: methods holding it compare equal (one compile)


@dataclasses.dataclass(frozen=True)
class Spec:
    """A method as the family runs it: how to build it, on which model, rows and new tokens,
    the share of row-steps (lookahead-like) or verifications (looped) that must accept a
    drafted token, and its planted faults."""

    make: Callable[[Sampling], object]
    model: str
    rows: int
    new: int
    min_accepting: float
    faults: Callable[[], dict]


def _lookahead_faults(residual_step: int) -> dict:
    return {
        "reused key": Fault(reuse_key=True),
        f"no residual update in step {residual_step}": Fault(
            single_device(wrong_verdict("no_residual")), at_step(residual_step)),
        "next row's candidate committed from step 2": Fault(
            single_device(next_rows_candidate), from_step(2)),
    }


def _looped_faults(stale: bool = False) -> dict:
    faults = {
        "reused key": Fault(reuse_key=True),
        "no residual update in each row's 2nd verification": Fault(
            cascade(keep_target=True), at_verification(2)),
        "next row's draft committed from each row's 2nd verification": Fault(
            next_rows_draft, after_verification(1)),
    }
    if stale:
        faults["suspended branches keep a stale q"] = Fault(stale_branches=True)
    return faults


# rows: few enough for CI's time, enough that each planted fault's weakest failing check has an
# estimated power of at least 0.999 (`pytest -s` prints it; the least: 0.9995, unseeded
# lookahead's step-5 residual fault at 8,000 rows)
SPECS = {
    "lookahead": Spec(
        lambda s: Lookahead(s, config=LookaheadConfig(W=4, N=4, G=4, prompt_seeding=True)),
        "llama", 3000, 10, 0.4, lambda: _lookahead_faults(2)),
    "lookahead_unseeded": Spec(
        lambda s: Lookahead(s, config=LookaheadConfig(W=4, N=3, G=4, prompt_seeding=False)),
        "llama", 8000, 10, 0.1, lambda: _lookahead_faults(5)),
    "prompt_lookup": Spec(
        lambda s: PromptLookup(s, num_tokens=4, max_ngram=2),
        "llama", 3000, 10, 0.4, lambda: _lookahead_faults(2)),
    "loopspec": Spec(
        lambda s: LoopSpec(s, d1=1, d2=2),
        "ouro", 3000, 8, 0.2, lambda: _looped_faults()),
    # by default no child pauses when sampling; suspending (only the likeliest child of a
    # feedback readout runs): whole generations with suspended branches, and the stale-q fault
    "loopahead": Spec(
        lambda s: LoopAhead(s, r1=1, r2=2, drafter=DRAFTER, window=8),
        "ouro", 3000, 8, 0.2, lambda: _looped_faults()),
    "loopahead_suspending": Spec(
        lambda s: LoopAhead(s, r1=1, r2=2, drafter=DRAFTER, window=8, suspend_below=1.0),
        "ouro", 3000, 8, 0.2, lambda: _looped_faults(stale=True)),
}


CONTEXT = 30.0  # the context model's attention scale (next-token distributions then move, with
# the context, by a total variation of about 0.13 on average)


@pytest.fixture(scope="module")
def engines() -> dict[str, Engine]:
    return {"llama": Engine(markov_llama(), eos_ids=(), compiler_options=long_run_options()),
            "ouro": Engine(markov_ouro(), eos_ids=(), compiler_options=long_run_options())}


@pytest.fixture(scope="module")
def models(engines):
    return {k: nnx.merge(e.graphdef, e.params) for k, e in engines.items()}


@pytest.fixture(scope="module")
def exact(models):
    """(model name, setting) -> the warped transition matrix (memoised)."""
    return functools.lru_cache(maxsize=None)(
        lambda name, setting: transition(models[name], sampling(setting)))


@pytest.fixture(scope="module")
def real_runs(engines) -> Callable[[str, str], tuple]:
    """(method, setting) -> the real method's generation (seed 1), made once: the distribution
    test and the planted-fault test check the same run."""
    @functools.lru_cache(maxsize=None)
    def run(name: str, setting: str):
        spec = SPECS[name]
        return generate(engines[spec.model], spec, spec.make(sampling(setting)))
    return run


def generate(engine: Engine, spec: Spec, method, seed: int = 1):
    res = engine.generate_ids(prompts(spec.rows), method=method, max_new_tokens=spec.new,
                              seed=seed)
    tokens = np.array(res.tokens)
    assert tokens.shape == (spec.rows, spec.new)
    return tokens, res.stats.extra


def accepting_share(extra: dict) -> float:
    """Lookahead-like: the share of row-steps that accepted >= 1 drafted token; looped: the
    share of verifications that kept a drafted child."""
    if "accepted_hist" in extra:
        hist = np.asarray(extra["accepted_hist"])
        return float(hist[1:].sum() / hist.sum())
    return extra["draft_acceptance"]


def softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def test_the_test_models_are_markov(models):
    """The exact distributions are exact: after random contexts of random lengths, the next-
    token logits of both Markov models depend on the last token alone (and equal
    `markov_logits`-based transitions); the context model's do not."""
    rng = np.random.default_rng(0)
    seqs = [rng.integers(0, V, n).tolist() for n in rng.integers(1, 20, 40)]
    for name, model in models.items():
        got = next_token_logits(model, seqs)
        alone = next_token_logits(model, [[s[-1]] for s in seqs])
        np.testing.assert_allclose(got, alone, atol=2e-5, err_msg=name)
        # (up to the final RMSNorm's epsilon; the checks use the model's own logits)
        np.testing.assert_allclose(next_token_logits(model, [[a] for a in range(V)]),
                                   markov_logits(), atol=1e-3, err_msg=name)
        p = transition(model, Sampling(1.0))
        assert (p.max(1) > 0.6).all() and (np.sort(p, 1)[:, -2] > 0.2).all(), name
    context = next_token_logits(markov_llama(attention=CONTEXT), seqs)
    markov = next_token_logits(markov_llama(), seqs)
    tv = 0.5 * np.abs(softmax(context) - softmax(markov)).sum(-1)
    assert tv.mean() > 0.1, tv


# CI runs every method at temperature 1 and lookahead at all three settings; the other
# methods' top-k and top-p runs are marked slow (`pytest -m slow`): the faults are caught by
# the temperature-1 runs, and CI's time is kept
RUNS = [pytest.param(name, setting, id=f"{name}-{setting}",
                     marks=[pytest.mark.slow] if setting != "t1" and name != "lookahead" else [])
        for name in SPECS for setting in SETTINGS]


@pytest.mark.parametrize("name,setting", RUNS)
def test_whole_generations_follow_the_exact_distribution(name, setting, real_runs, exact):
    spec = SPECS[name]
    tokens, extra = real_runs(name, setting)
    checks = exact_checks(tokens, exact(spec.model, setting))
    share = accepting_share(extra)
    print("\n" + report(f"{name}/{setting}", checks, f"(accepting {share:.2f})"))
    assert worst(checks).p > threshold(checks), report(f"{name}/{setting}", checks)
    # not vacuous: drafted tokens were accepted at many steps and rejected at others
    assert spec.min_accepting < share < 0.99, extra


# LoopAhead's planted faults are slow (CI's time: its generations are the longest to compile);
# wrong acceptance rules in LoopAhead are caught in CI by test_loopahead_sampling
@pytest.mark.parametrize("name", [pytest.param(n, marks=[pytest.mark.slow]
                                               if n.startswith("loopahead") else [])
                                  for n in SPECS])
def test_planted_faults_of_later_steps_are_caught(name, engines, real_runs, exact):
    """Each planted fault fails the checks (p below the family threshold); the planted
    program with no fault gives the real method's tokens."""
    spec = SPECS[name]
    s = sampling("t1")
    engine = engines[spec.model]
    p = exact(spec.model, "t1")
    faults = spec.faults()
    make = planted(spec.make(s), faults)
    real, _ = real_runs(name, "t1")
    none, _ = generate(engine, spec, make("none"))
    np.testing.assert_array_equal(none, real)
    missed = []
    for fault in faults:
        tokens, extra = generate(engine, spec, make(fault))
        checks = exact_checks(tokens, p)
        w, alpha = worst(checks), threshold(checks)
        share = accepting_share(extra)
        print("\n" + report(f"{name}/t1 + {fault}", checks,
                            f"power {power(w, alpha):.3f} (accepting {share:.2f})"))
        if w.p >= alpha:
            missed.append(fault)
    assert not missed, f"{name}: not caught: {missed}"


def test_the_stale_branch_fault_overrides_the_real_feedback():
    """`StaleLoopAhead` (the planted stale-q fault, whose test above is slow) overrides
    LoopAhead's sampling feedback with the same parameters, so a change to the real method's
    signature fails here, in CI, rather than only in the slow run."""
    def names(fn):
        return list(inspect.signature(fn).parameters)

    assert names(StaleLoopAhead._feedback_sampling) == names(LoopAhead._feedback_sampling)


TWO_SAMPLE_ROWS = 6000


@pytest.fixture(scope="module")
def context_engine() -> Engine:
    return Engine(markov_llama(attention=CONTEXT), eos_ids=(),
                  compiler_options=long_run_options())


@pytest.fixture(scope="module")
def plain_samples(context_engine):
    res = context_engine.generate_ids(prompts(TWO_SAMPLE_ROWS), method="ar",
                                      sampling=Sampling(1.0), max_new_tokens=10, seed=2)
    return np.array(res.tokens)


@pytest.mark.parametrize("name", ["lookahead", pytest.param("prompt_lookup",
                                                             marks=pytest.mark.slow)])
def test_two_sample_against_plain_sampling(name, context_engine, plain_samples):
    """On a model whose next token depends on the whole context (no exact distribution),
    lookahead / prompt lookup samples and plain samples (another seed) agree position by
    position and pair by pair; the same test catches a step-2 fault."""
    spec = dataclasses.replace(SPECS[name], rows=TWO_SAMPLE_ROWS)
    s = Sampling(1.0)
    tokens, extra = generate(context_engine, spec, spec.make(s), seed=3)
    checks = two_sample_checks(tokens, plain_samples)
    share = accepting_share(extra)
    print("\n" + report(f"{name}_vs_plain/t1", checks, f"(accepting {share:.2f})"))
    assert worst(checks).p > threshold(checks)
    assert share > 0.3, extra
    fault = "no residual update in step 2"
    bad, _ = generate(context_engine, spec, planted(spec.make(s), spec.faults())(fault), seed=3)
    checks = two_sample_checks(bad, plain_samples)
    print(report(f"{name}_vs_plain/t1 + {fault}", checks))
    assert worst(checks).p < threshold(checks)
