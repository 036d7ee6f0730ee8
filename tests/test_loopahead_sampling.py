"""LoopAhead sampling keeps the exact distribution: a chi-square test of the joint of the first
3 emitted tokens of 10,000 samples against the exact full-depth distribution, enumerated from
a 6-token, 3-loop Ouro (the model and the enumeration of test_loopspec), with native
proposals only and with a drafter whose chains are verified too, scheduling on and off;
the same test catches planted wrong acceptance rules (the inverted ratio min(1, q/p), no
residual between drafts). (At a near-zero temperature the sampling path emits
plain greedy's tokens: tests/test_loopahead.py.)"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lookahead_jax.looped.loopahead import LoopAhead
from lookahead_jax.looped.spec_sampling import draft_chances, verify_drafts
from sampling_checks import cascade
from test_loopspec import (ALPHA, SAMPLES, SETTINGS, V, WRONG_P, check,  # noqa: F401
                           exact_joint, exact_probs, make_small_model, sample_many,
                           small_model)

K = 2


class AnchorTableDrafter:
    """A deterministic drafter: the K tokens after anchor a are table[a] [K]."""

    def __init__(self, table: np.ndarray):
        self.params = {"table": jnp.asarray(table, jnp.int32)}
        self.K = table.shape[1]

    def draft(self, params, states, anchors, positions, mask, **_):
        return params["table"][anchors[:, -1]]


@pytest.fixture(scope="module")
def drafter(exact_probs) -> AnchorTableDrafter:
    return table_drafter(exact_probs)


def table_drafter(exact_probs) -> AnchorTableDrafter:
    """After anchor a (a draft of token 2) it proposes the likeliest token 3 given token 2 = a
    (so its chains are often, not always, accepted), then token 0."""
    joint = exact_probs(SETTINGS["t1"])  # [V, V, V]
    table = np.zeros((V, K), np.int32)
    table[:, 0] = joint.sum(0).argmax(-1)
    return AnchorTableDrafter(table)


@pytest.fixture(scope="module")
def draw(small_model, drafter):
    @functools.lru_cache(maxsize=None)
    def get(sampling, use_drafter=True, scheduling=True, verifier=verify_drafts,
            suspend_below=0.0):
        return sample_many(small_model, LoopAhead(
            sampling, r1=1, r2=2, drafter=drafter if use_drafter else None,
            scheduling=scheduling, window=8, verifier=verifier, suspend_below=suspend_below))
    return get


# the default (no child paused when sampling), and with suspension: only the likeliest child
# of an r2 readout runs (suspend_below=1, the greedy rule's counterpart)
@pytest.mark.parametrize("name,use_drafter,scheduling,suspend_below",
                         [("t1", True, True, 0.0), ("topk4", False, True, 1.0),
                          ("t1", True, False, 0.0)],
                         ids=["t1", "topk4_nodrafter_suspending", "t1_noscheduling"])
def test_sampling_is_exact(name, use_drafter, scheduling, suspend_below, draw, exact_probs):
    tokens, stats = draw(SETTINGS[name], use_drafter, scheduling, suspend_below=suspend_below)
    p, outside = check(exact_probs(SETTINGS[name]), tokens, name, stats)
    assert outside == 0
    assert p > ALPHA, f"{name}: chi-square p = {p:.3g}"
    # not vacuous: tokens 2 and 3 were verified, drafts often accepted and often rejected
    assert stats["verified_tokens"] == 2 * SAMPLES
    assert 0.2 < stats["draft_acceptance"] < 0.9, stats
    if use_drafter:  # the drafter's chains are verified and sometimes kept
        assert stats["drafter_accepted"] > 0.02 * SAMPLES, stats


def test_sampling_is_exact_with_later_readouts_a_budget_and_two_calls():
    """On the model with 4 loops the depth-3 readout judges the children again (pauses and
    resumes them); a budget of 3 nodes per step, two drafter calls per row and step, children
    with a chance of at least 0.3 kept running: the scheduler decides which nodes advance and
    when, never what is emitted."""
    model = make_small_model(num_loops=4)
    exact = exact_joint(model)
    tokens, stats = sample_many(model, LoopAhead(
        SETTINGS["t1"], r1=1, r2=2, drafter=table_drafter(exact), max_active=3, lad_calls=2,
        suspend_below=0.3, window=8))
    p, outside = check(exact(SETTINGS["t1"]), tokens, "4 loops, budget 3, 2 calls", stats)
    assert outside == 0
    assert p > ALPHA, f"chi-square p = {p:.3g}"
    assert stats["max_active"] == 3 and stats["lad_calls"] == 2
    assert 0.2 < stats["draft_acceptance"] < 0.9, stats
    assert stats["drafter_accepted"] > 0.02 * SAMPLES, stats


class CalibratedTableDrafter(AnchorTableDrafter):
    """AnchorTableDrafter with confidences (0.9 after an even anchor, 0.1 after an odd one)
    and a `Calibration` whose match probability is 0.9 in the upper half of confidences, 0.02
    in the lower: `retain="calibrated"` keeps the chains after even anchors (as a node's cost
    allows) and drops the others."""

    def __init__(self, table: np.ndarray):
        super().__init__(table)
        from lookahead_jax.looped.drafter import Calibration  # noqa: PLC0415
        k = table.shape[1]
        self.calibration = Calibration(np.asarray([0.5, 1.0], np.float32),
                                       np.tile(np.asarray([0.02, 0.9], np.float32), (2, k, 1)))
        self.params = {**self.params, "calibration": self.calibration.arrays()}

    def draft(self, params, states, anchors, positions, mask, with_confidence=False, **_):
        ids = params["table"][anchors[:, -1]]
        conf = jnp.where(anchors[:, -1:] % 2 == 0, 0.9, 0.1) * jnp.ones(ids.shape)
        return (ids, conf) if with_confidence else ids


@pytest.mark.parametrize("node_cost", [0.2, 1.5])
def test_sampling_is_exact_with_calibrated_retention(node_cost, exact_probs, small_model):
    """retain="calibrated": whether the drafter is called and how much of its chain is kept
    depend on the anchor's chance and the drafter's confidences (never on the verdict), so
    sampling stays exact; at a node cost of 0.2 some chains are kept and accepted, at 1.5
    (more than any token can earn) the drafter is never called."""
    drafter = CalibratedTableDrafter(np.asarray(table_drafter(exact_probs).params["table"]))
    tokens, stats = sample_many(small_model, LoopAhead(
        SETTINGS["t1"], r1=1, r2=2, drafter=drafter, retain="calibrated", node_cost=node_cost,
        window=8))
    p, outside = check(exact_probs(SETTINGS["t1"]), tokens, f"calibrated {node_cost}", stats)
    assert outside == 0
    assert p > ALPHA, f"chi-square p = {p:.3g}"
    assert stats["retain"] == "calibrated" and stats["node_cost"] == node_cost
    if node_cost < 1:
        assert stats["drafter_accepted"] > 0.02 * SAMPLES, stats
    else:
        assert stats["drafter_accepted"] == 0, stats


def test_retained_length():
    """The chain length maximising expected accepted tokens minus node_cost per node, the
    shorter on ties; match probabilities read at the nearest calibrated temperature."""
    from lookahead_jax.looped.drafter import Calibration, match_probability  # noqa: PLC0415
    from lookahead_jax.looped.loopahead import retained_length  # noqa: PLC0415
    a = jnp.asarray([1.0, 1.0, 0.5, 1.0, 1.0])
    m = jnp.asarray([[0.9, 0.9, 0.9], [0.9, 0.1, 0.9], [0.9, 0.9, 0.9], [0.5, 1.0, 1.0],
                     [0.0, 0.0, 0.0]])
    # row 0: survivals .9 .81 .73 all > .3; row 1: .9 .09 (< .3) .08; row 2: .45 .41 .36 > .3;
    # row 3: .5 .5 .5 = .5 each: ties at cost .5 keep none; row 4: nothing to gain
    assert retained_length(a, m, 0.3).tolist() == [3, 1, 3, 3, 0]
    assert retained_length(a, m, 0.5).tolist() == [3, 1, 0, 0, 0]
    assert retained_length(a, m, 0.0).tolist() == [3, 3, 3, 3, 0]
    table = np.stack([np.full((3, 4), 0.1), np.tile([0.2, 0.4, 0.6, 0.8], (3, 1))])
    cal = Calibration(np.asarray([0.5, 1.0], np.float32), table.astype(np.float32)).arrays()
    conf = jnp.asarray([[0.0, 0.3, 0.99], [0.5, 0.74, 1.0]])
    np.testing.assert_allclose(match_probability(cal, 0.9, conf),
                               [[0.2, 0.4, 0.8], [0.6, 0.6, 0.8]])
    np.testing.assert_allclose(match_probability(cal, 0.6, conf), np.full((2, 3), 0.1))


def test_calibrated_retention_is_checked(drafter):
    """retain="calibrated" needs sampling and a calibrated drafter; bad values are refused."""
    from models.config import ConfigError  # noqa: PLC0415
    from lookahead_jax.sampling import Sampling  # noqa: PLC0415
    with pytest.raises(ConfigError, match="greedy decoding keeps every drafted token"):
        LoopAhead(Sampling(), drafter=drafter, retain="calibrated")
    with pytest.raises(ConfigError, match="needs a drafter with a calibration"):
        LoopAhead(SETTINGS["t1"], drafter=drafter, retain="calibrated")
    with pytest.raises(ConfigError, match="retain must be one of all, calibrated"):
        LoopAhead(SETTINGS["t1"], drafter=drafter, retain="some")
    with pytest.raises(ConfigError, match="node_cost must be >= 0"):
        LoopAhead(SETTINGS["t1"], drafter=drafter, node_cost=-1.0)


# sampling_checks.cascade: verify_drafts with a planted mistake (the inverted ratio
# min(1, q/r); no residual update after a rejection)
WRONG = {"inverted_ratio": cascade(inverted=True), "target_residual": cascade(keep_target=True)}


@pytest.mark.parametrize("rule", list(WRONG))
def test_wrong_rules_are_caught(rule, draw, exact_probs):
    tokens, stats = draw(SETTINGS["t1"], verifier=WRONG[rule])
    p, _ = check(exact_probs(SETTINGS["t1"]), tokens, rule, stats)
    assert p < WRONG_P, f"{rule}: p = {p:.3g} did not catch the wrong rule"


def test_draft_chances_match_the_cascade():
    """draft_chances is verify_drafts in expectation: over many verify_drafts draws, each
    draft's acceptance frequency matches its chance, and the token drawn when both are
    rejected follows the residual."""
    rng = np.random.default_rng(1)
    p = rng.dirichlet(np.ones(8) * 5)  # a flat target, peaked drafts: both often rejected
    q = rng.dirichlet(np.ones(8) * 0.5, size=2)
    x = np.argmax(q, axis=1)
    chance, none, res = draft_chances(jnp.asarray(p), jnp.asarray(q), jnp.asarray(x),
                                      jnp.asarray([True, True]))
    res = np.asarray(res) / np.asarray(res).sum()
    assert (np.asarray(chance) > 0.1).all() and float(none) > 0.1 and (res > 0.1).sum() >= 3
    n = 200_000
    which, token = verify_drafts(jax.random.uniform(jax.random.key(1), (n, 2)),
                                 jnp.broadcast_to(jnp.asarray(p, jnp.float32), (n, 8)),
                                 jnp.broadcast_to(jnp.asarray(q, jnp.float32), (n, 2, 8)),
                                 jnp.broadcast_to(jnp.asarray(x), (n, 2)),
                                 jnp.ones((n, 2), bool), jax.random.key(2))
    which, token = np.asarray(which), np.asarray(token)
    freq = [(which == k).mean() for k in (0, 1)] + [(which < 0).mean()]
    np.testing.assert_allclose(freq, [*np.asarray(chance), float(none)], atol=5e-3)
    drawn = np.bincount(token[which < 0], minlength=8) / (which < 0).sum()
    np.testing.assert_allclose(drawn, res, atol=1e-2)
