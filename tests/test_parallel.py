"""Lookahead parallelism (`lookahead_jax/parallel.py`) on 8 CPU devices.

The multi-device tests need 8 devices, which XLA creates on CPU only if
XLA_FLAGS=--xla_force_host_platform_device_count=8 is set before JAX starts. So in a normal
test run `test_on_8_cpu_devices` runs this file again in its own process with that flag, and
the tests marked `needs8` run there (they skip, saying so, in the parent process).

Pinned there:
  * outputs identical to single-device lookahead (and to plain greedy) for several (W, N, G)
    and device counts, W and G not divisible by the device count included, greedy and
    sampling with the same seed;
  * the compiled program's collectives: every one moves int32 token ids, O((W + G) N) of them
    per step, and no activations; the same inspection flags a program that all-reduces floats;
  * the CLI's --devices.
"""

from __future__ import annotations

import functools
import os
import re
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lookahead_jax.lookahead.config import LookaheadConfig
from lookahead_jax.engine import Engine
from lookahead_jax.registry import build_method
from lookahead_jax.sampling import Sampling
from lookahead_jax.lookahead.step import Lookahead
from models.config import ConfigError

sys.path.insert(0, os.path.dirname(__file__))
from multidevice import (DEVICES, ON_8_CPU_DEVICES, needs8,  # noqa: E402
                         rerun_on_8_cpu_devices)
from test_lookahead import make_model  # noqa: E402  (the structured tiny model)

@pytest.mark.skipif(ON_8_CPU_DEVICES, reason="already running on 8 CPU devices")
def test_on_8_cpu_devices():
    rerun_on_8_cpu_devices(__file__, min_passed=12)


# ------------------------------------------------------------------------------------------
PROMPTS = [[3, 5, 7, 9, 11, 3, 5, 7], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13], [42]]
MAX_NEW = 40


@pytest.fixture(scope="module")
def engine():
    return Engine(make_model(), eos_ids=())


@pytest.fixture(scope="module")
def plain(engine):
    return engine.generate_ids(PROMPTS, method="ar", max_new_tokens=MAX_NEW).tokens


# (W, N, G, devices): W and G divisible by the devices or not, fewer columns than devices,
# N = 2 (no window levels beyond level 0), G = 0 (no verification branch); the settings that
# repeat those cases are marked slow (CI's time: each compiles its own programs on 8 devices)
SETTINGS = [pytest.param(4, 3, 4, 2, False, marks=pytest.mark.slow), (5, 4, 3, 3, True),
            (15, 5, 15, 8, False), (3, 2, 0, 2, True),
            pytest.param(6, 3, 5, 4, False, marks=pytest.mark.slow), (2, 4, 9, 8, True)]


@needs8
@pytest.mark.parametrize("W,N,G,D,seeding", SETTINGS)
def test_greedy_equals_single_device_and_plain(engine, plain, W, N, G, D, seeding):
    cfg = LookaheadConfig(W=W, N=N, G=G, prompt_seeding=seeding)
    single = engine.generate_ids(PROMPTS, method=Lookahead(config=cfg), max_new_tokens=MAX_NEW)
    par = engine.generate_ids(PROMPTS, method=build_method("lookahead", lookahead=cfg, devices=D),
                              max_new_tokens=MAX_NEW)
    assert type(par.stats.extra.get("devices")) is int and par.stats.extra["devices"] == D
    assert par.tokens == single.tokens == plain
    # same pool, same window, same verification: the same number of steps
    assert par.stats.steps == single.stats.steps
    assert par.stats.extra["accepted_hist"] == single.stats.extra["accepted_hist"]
    if G:
        assert max(i for i, c in enumerate(par.stats.extra["accepted_hist"]) if c) >= 1


@needs8
@pytest.mark.parametrize("W,N,G,D,sampling", [  # top-k and top-p: slow (CI's time)
    (7, 5, 7, 8, Sampling(temperature=1.0)),
    pytest.param(5, 4, 6, 4, Sampling(temperature=0.7, top_k=5), marks=pytest.mark.slow),
    pytest.param(6, 3, 5, 3, Sampling(temperature=1.0, top_p=0.9), marks=pytest.mark.slow),
])
def test_sampling_equals_single_device(engine, W, N, G, D, sampling):
    """Same seed, same tokens: every device draws the same random numbers, and each position's
    accept/reject decision comes from the device holding the logits it needs."""
    cfg = LookaheadConfig(W=W, N=N, G=G, prompt_seeding=True)
    for seed in (0, 7):
        single = engine.generate_ids(PROMPTS, method=Lookahead(sampling, config=cfg),
                                     max_new_tokens=MAX_NEW, seed=seed)
        par = engine.generate_ids(PROMPTS, method=build_method("lookahead", sampling=sampling,
                                                               lookahead=cfg, devices=D),
                                  max_new_tokens=MAX_NEW, seed=seed)
        assert par.tokens == single.tokens, seed
        assert par.stats.steps == single.stats.steps
        # the rejection path ran: some steps accepted candidate tokens, some none
        hist = par.stats.extra["accepted_hist"]
        assert hist[0] > 0 and sum(hist[1:]) > 0, hist


# -------------------------------------------------------------- what the devices exchange ---
COLLECTIVE = re.compile(r"=\s*(\(?[^=]*?\)?)\s+(all-gather|all-reduce|collective-permute|"
                        r"all-to-all|reduce-scatter|collective-broadcast)(-start)?\(")
ARRAY = re.compile(r"\b([a-z]+\d*)\[([\d,]*)\]")
INTEGER = ("s32", "u32", "s16", "u16", "s8", "u8", "pred")


def collectives(hlo: str) -> list[tuple[str, str, int]]:
    """(op, dtype, elements) of every array a collective produces in an HLO module's text."""
    found = []
    for line in hlo.splitlines():
        m = COLLECTIVE.search(line)
        if m:
            for dtype, dims in ARRAY.findall(m.group(1)):
                found.append((m.group(2), dtype, int(np.prod([int(x) for x in dims.split(",") if x]))))
    return found


def compiled_run_hlo(method) -> str:
    engine = Engine(make_model(), eos_ids=())  # its own: exactly one compiled run
    engine.generate_ids(PROMPTS[:2], method=method, max_new_tokens=4)
    (runs,) = [c for k, c in engine._compiled.items() if k[0] == "run" and k[1][0] == method]
    return runs.as_text()


@needs8
@pytest.mark.parametrize("W,N,G,D,sampling", [
    (15, 5, 15, 8, Sampling()), (5, 4, 3, 3, Sampling(temperature=1.0))])
def test_collectives_move_only_token_ids(engine, W, N, G, D, sampling):
    cfg = LookaheadConfig(W=W, N=N, G=G)
    method = build_method("lookahead", sampling=sampling, lookahead=cfg, devices=D)
    found = collectives(compiled_run_hlo(method))
    assert found, "no collective found: the steps must exchange token ids"
    assert all(dtype in INTEGER for _, dtype, _ in found), found
    b = len(PROMPTS[:2])
    ints = sum(n for _, _, n in found)
    w_d, g_d = -(-W // D), -(-G // D)
    # the all-gather of argmax ids, plus 2 ints per row and candidate position when sampling
    expect = D * b * (1 + w_d + g_d * (N - 1)) + (0 if sampling.greedy else 2 * b * N)
    assert ints <= expect <= 2 * b * ((W + G) * N + D), (found, expect)
    # for scale: the accepted tokens' K/V alone would be this many floats
    cfgm = engine.config
    kv_floats = 2 * cfgm.num_layers * b * (N - 1) * cfgm.num_kv_heads * cfgm.head_dim
    assert ints < kv_floats


@needs8
def test_the_inspection_catches_activations():
    """Control: a shard_map that all-reduces float activations is flagged."""
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:DEVICES]), ("x",))
    spec = jax.sharding.PartitionSpec("x")

    def f(x):
        return jax.shard_map(lambda a: jax.lax.psum(jnp.tanh(a), "x"), mesh=mesh,
                             in_specs=spec, out_specs=jax.sharding.PartitionSpec())(x)

    hlo = jax.jit(f).lower(jnp.ones((DEVICES * 4, 16))).compile().as_text()
    found = collectives(hlo)
    assert found and any(dtype == "f32" for _, dtype, _ in found), found


# --------------------------------------------------------------------------------- CLI ---
def _cli(**kw):
    import io  # noqa: PLC0415
    from lookahead_jax.decode import Options, run  # noqa: PLC0415
    out, err = io.StringIO(), io.StringIO()
    code = run(Options(config="tiny_llama", prompt_ids="1,2,3,4,5", max_new_tokens=12, **kw),
               stdout=out, stderr=err)
    return code, out.getvalue(), err.getvalue()


@needs8
def test_cli_devices_flag():
    code1, out1, _ = _cli(devices=1)
    code3, out3, err3 = _cli(devices=3)
    assert code1 == code3 == 0, err3
    assert out1 == out3


def test_devices_errors():
    too_many = len(jax.devices()) + 1
    with pytest.raises(ConfigError, match="devices asked for"):
        build_method("lookahead", devices=too_many)
    with pytest.raises(ConfigError, match="dense attention only"):
        build_method("lookahead", attention="pallas", devices=2)
    for kw, msg in ((dict(devices=0), "devices must be >= 1"),
                    (dict(devices=2, method="ar"), "--devices) only applies to --method=lookahead"),
                    (dict(devices=too_many), "devices asked for")):
        code, _, err = _cli(**kw)
        assert code == 2 and msg in err and "Traceback" not in err, err


# ------------------------------------------- sampling exactness over whole generations ---
# (test_sampling_generations.py: the family of runs, its threshold and the planted faults)
from lookahead_jax.lookahead.parallel import ParallelLookahead  # noqa: E402
from lookahead_jax.lookahead.verify import sampling_verdict  # noqa: E402
from quick_compile import long_run_options  # noqa: E402
from sampling_checks import (SETTINGS, Fault, at_step, exact_checks,  # noqa: E402
                             from_step, markov_llama, next_rows_candidate, planted, power,
                             prompts, report, sampling, threshold, transition, worst,
                             wrong_verdict)

MARKOV_CFG = LookaheadConfig(W=8, N=4, G=8, prompt_seeding=True)  # a column, a candidate each
MARKOV_ROWS, MARKOV_NEW = 3000, 10


@pytest.fixture(scope="module")
def markov():
    model = markov_llama()
    return model, Engine(model, eos_ids=(), compiler_options=long_run_options())


@pytest.fixture(scope="module")
def real_runs(markov):
    """setting -> the real method's run, made once: the distribution test and the planted-fault
    test check the same temperature-1 run."""
    @functools.lru_cache(maxsize=None)
    def run(setting: str):
        return _markov_run(markov[1], ParallelLookahead(sampling(setting), config=MARKOV_CFG,
                                                        devices=DEVICES))
    return run


def _markov_run(engine, method):
    res = engine.generate_ids(prompts(MARKOV_ROWS), method=method, max_new_tokens=MARKOV_NEW,
                              seed=1)
    hist = np.asarray(res.stats.extra["accepted_hist"])
    return np.array(res.tokens), float(hist[1:].sum() / hist.sum())


@needs8
@pytest.mark.parametrize("setting", [pytest.param(s, marks=[pytest.mark.slow] if s != "t1" else [])
                                     for s in SETTINGS])  # top-k, top-p: slow (CI's time)
def test_sampling_whole_generations_follow_the_exact_distribution(markov, real_runs, setting):
    """Lookahead parallelism on 8 devices, sampling 3,000 rows of 10 tokens from the Markov
    Llama: every position, adjacent pair and neighbouring-row pair follows the exact
    distribution (the family threshold of test_sampling_generations)."""
    model, _ = markov
    tokens, share = real_runs(setting)
    checks = exact_checks(tokens, transition(model, sampling(setting)))
    print("\n" + report(f"parallel/{setting}", checks, f"(accepting {share:.2f})"))
    assert worst(checks).p > threshold(checks), report(f"parallel/{setting}", checks)
    assert 0.4 < share < 0.97


@needs8
def test_sampling_planted_faults_of_later_steps_are_caught(markov, real_runs):
    model, engine = markov
    s = sampling("t1")
    faults = {"reused key": Fault(reuse_key=True),
              "no residual update in step 2": Fault(wrong_verdict("no_residual"), at_step(2)),
              "next row's candidate committed from step 2": Fault(next_rows_candidate,
                                                                  from_step(2))}
    method = ParallelLookahead(s, config=MARKOV_CFG, devices=DEVICES)
    assert method.verifier is sampling_verdict
    make = planted(method, faults)
    real, _ = real_runs("t1")
    none, _ = _markov_run(engine, make("none"))
    np.testing.assert_array_equal(none, real)
    p = transition(model, s)
    missed = []
    for fault in faults:
        tokens, share = _markov_run(engine, make(fault))
        checks = exact_checks(tokens, p)
        w, alpha = worst(checks), threshold(checks)
        print("\n" + report(f"parallel/t1 + {fault}", checks,
                            f"power {power(w, alpha):.3f} (accepting {share:.2f})"))
        if w.p >= alpha:
            missed.append(fault)
    assert not missed, f"not caught: {missed}"
