"""The slot engine (continuous batching): every request's tokens equal offline
`Engine.generate` for the same method, settings and seed, while requests join and leave a
running batch; lanes grow and shrink with their live rows; per-row sampling values give the
tokens static `Sampling` gives; bad settings fail naming the field."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from lookahead_jax import Sampling
from lookahead_jax.sampling import SamplingParams
from lookahead_jax.serving.slots import Limits, RequestError, SlotEngine, SlotRequest

LIMITS = Limits(max_len=256, max_tokens=200, W=4, N=3, G=4, pl_tokens=6, pl_ngram=3)  # as
BUDGET = 24  # test_serve's, so the two modules share compiled programs (conftest.served_engine)
DECODINGS = [("ar", {}), ("lookahead", {}), ("lookahead", {"W": 3, "N": 2}), ("prompt_lookup", {})]
SAMPLINGS = [Sampling(), Sampling(0.9, top_p=0.95), Sampling(0.7, top_k=20)]


@pytest.fixture(scope="module")
def engine(served_engine):
    return served_engine


def _requests(n: int, seed: int = 0) -> list[SlotRequest]:
    """Mixed methods, settings, sampling values and budgets; prompts that repeat themselves
    (so prompt lookup and the pool find drafts). Neighbours share a method, so rows with
    different sampling values share a lane."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        ids = rng.integers(3, 300, size=int(rng.integers(2, 9))).tolist()  # one prompt bucket
        method, settings = DECODINGS[(i // 3) % len(DECODINGS)]
        out.append(SlotRequest(ids + ids[:4], method=method, settings=settings,
                               sampling=SAMPLINGS[i % len(SAMPLINGS)], seed=100 + i,
                               max_tokens=int(rng.choice([1, 5, BUDGET]))))
    return out


def _serve(slots: SlotEngine, requests, cancel_after: dict[int, int] | None = None):
    """Runs requests through the slots, admitting whenever a slot is free; returns each
    request's ids (a cancelled one: None) and the largest lane seen."""
    cancel_after = cancel_after or {}
    out, waiting, owner, steps, widest = {}, list(range(len(requests))), {}, 0, 0
    while waiting or slots.live:
        while waiting and slots.free:
            i = waiting.pop(0)
            handle, first = slots.admit(requests[i])
            owner[handle], out[i] = i, list(first.ids)
            if first.done:
                slots.evict(handle)
        for handle, update in slots.step().items():
            i = owner[handle]
            out[i].extend(update.ids)
            if update.done:
                slots.evict(handle)
            elif cancel_after.get(i) == len(out[i]) or (i in cancel_after
                                                        and len(out[i]) > cancel_after[i]):
                slots.evict(handle)
                out[i] = None
        widest = max([widest] + [lane.rows for lane in slots.lanes.values()])
        steps += 1
        assert steps < 2000
    return out, widest


def _offline(engine, slots, request):
    """Offline generation of the request alone, at the common budget, cut to the request's
    own (`test_a_budget_cuts_the_longer_run` shows the cut is the shorter run)."""
    out = engine.generate_ids([request.ids], method=slots.method_for(request),
                              max_new_tokens=BUDGET, seed=request.seed).tokens[0]
    return out[:request.max_tokens]


def test_a_budget_cuts_the_longer_run(engine):
    slots = SlotEngine(engine, slots=1, limits=LIMITS)
    for request in _requests(5, seed=3)[4:]:  # sampled lookahead (W=4, N=3, G=4)
        short = engine.generate_ids([request.ids], method=slots.method_for(request),
                                    max_new_tokens=5, seed=request.seed).tokens[0]
        request.max_tokens = 5
        assert short == _offline(engine, slots, request)


def test_mixed_requests_equal_offline_while_joining_and_leaving(engine):
    slots = SlotEngine(engine, slots=4, limits=LIMITS)
    requests = _requests(12)
    out, widest = _serve(slots, requests)
    assert widest >= 2 and slots.live == 0  # rows with different sampling values shared lanes
    for i, request in enumerate(requests):
        assert out[i] == _offline(engine, slots, request), (i, request)
        assert 1 <= len(out[i]) <= request.max_tokens
    assert all(lane.state is None for lane in slots.lanes.values())  # memory freed


def test_cancelled_requests_free_their_slots_and_leave_the_others_exact(engine):
    slots = SlotEngine(engine, slots=3, limits=LIMITS)
    requests = _requests(8, seed=1)
    for r in requests:
        r.max_tokens = BUDGET
    out, _ = _serve(slots, requests, cancel_after={0: 3, 3: 5, 5: 2})
    assert slots.live == 0 and slots.free == 3
    for i, request in enumerate(requests):
        if i in (0, 3, 5):
            assert out[i] is None
        else:
            assert out[i] == _offline(engine, slots, request)


def test_lanes_grow_and_shrink_by_powers_of_two(engine):
    slots = SlotEngine(engine, slots=5, limits=LIMITS)
    request = SlotRequest([5, 6, 7, 5, 6], method="ar", max_tokens=BUDGET)
    handles = [slots.admit(request)[0] for _ in range(5)]
    (lane,) = slots.lanes.values()
    assert lane.rows == 8 and lane.handles == handles  # grown 1 -> 2 -> 4 -> 8
    done = np.asarray(jax.device_get(lane.state.out.done))[:, 0]
    assert not done[:5].any() and done[5:].all()  # the rows beyond the live ones are inert
    slots.evict(handles[1])  # the last live row moves into row 1
    assert lane.handles == [handles[0], handles[4], handles[2], handles[3]] and lane.rows == 4
    for h in handles[2:4]:
        slots.evict(h)
    assert lane.rows == 2
    update = slots.step()
    assert set(update) == {handles[0], handles[4]}
    slots.evict(handles[0])
    slots.evict(handles[4])
    assert lane.state is None and slots.free == 5


def test_a_full_engine_refuses_and_a_finished_request_frees_its_slot(engine):
    slots = SlotEngine(engine, slots=1, limits=LIMITS)
    handle, first = slots.admit(SlotRequest([5, 6, 7], max_tokens=1))
    assert first.done and len(first.ids) == 1  # max_tokens=1: the prefill's token only
    with pytest.raises(RuntimeError, match="no free slot"):
        slots.admit(SlotRequest([5, 6, 7]))
    slots.evict(handle)
    assert slots.free == 1


@pytest.mark.parametrize("request_kw, param", [
    (dict(ids=[]), "prompt"),
    (dict(ids=[1] * 256), "prompt"),
    (dict(ids=[1, 600]), "prompt"),
    (dict(max_tokens=0), "max_tokens"),
    (dict(max_tokens=201), "max_tokens"),
    (dict(ids=[1] * 100, max_tokens=200), "max_tokens"),
    (dict(method="beam"), "lookahead.method"),
    (dict(method="lookahead", settings={"W": 5}), "lookahead.W"),
    (dict(method="lookahead", settings={"N": 4}), "lookahead.N"),
    (dict(method="lookahead", settings={"N": 1}), "lookahead.N"),
    (dict(method="lookahead", settings={"G": 9}), "lookahead.G"),
    (dict(method="lookahead", settings={"W": 2.5}), "lookahead.W"),
    (dict(method="ar", settings={"W": 2}), "lookahead.W"),
    (dict(method="prompt_lookup", settings={"pl_tokens": 7}), "lookahead.pl_tokens"),
])
def test_bad_requests_name_the_field(engine, request_kw, param):
    slots = SlotEngine(engine, slots=1, limits=LIMITS)
    request = SlotRequest(**{"ids": [5, 6, 7], **request_kw})
    with pytest.raises(RequestError) as err:
        slots.check(request)
    assert err.value.param == param


@pytest.mark.parametrize("sampling", [Sampling(0.3), Sampling(1.0, top_k=1), Sampling(0.9, top_k=7),
                                      Sampling(1.3, top_p=0.5), Sampling(0.8, top_k=40, top_p=0.9),
                                      Sampling(1.0, top_k=600), Sampling(2.0, top_p=0.01)])
def test_sampling_params_match_static_sampling_bit_for_bit(sampling):
    logits = jax.random.normal(jax.random.key(0), (4, 512)) * 4
    static = np.asarray(sampling.log_probs(logits))
    dynamic = np.asarray(jax.jit(lambda sp, x: sp.log_probs(x))(SamplingParams.of(sampling),
                                                                logits))
    assert np.array_equal(static, dynamic)
    for k in range(5):
        key = jax.random.key(k)
        assert np.array_equal(sampling.sample(key, logits),
                              SamplingParams.of(sampling).sample(key, logits))


def test_sampling_params_refuse_greedy():
    with pytest.raises(Exception, match="greedy"):
        SamplingParams.of(Sampling())
