"""Automatic W, N, G (`lookahead_jax.tuning.auto`, `decode --auto`): the ranking under synthetic
step-cost curves, and the CLI flag end to end on the tiny random Llama."""

from __future__ import annotations

import io
import json

import pytest

from lookahead_jax.tuning import auto
from lookahead_jax.lookahead.config import LookaheadConfig
from lookahead_jax.tuning.scaling_law import ScalingFit
from models.config import ConfigError

FIT = ScalingFit(a=0.5, f=2.0)
GRID = auto.candidate_grid((1, 2, 3, 5, 7, 10, 15), (3, 4, 5))


def curve(per_token: float, widest: int = 256) -> dict[int, float]:
    """A step-cost curve: 1 + per_token * (T - 1), in one-token steps."""
    return {t: 1.0 + per_token * (t - 1) for t in (1, 2, 4, 8, 16, 32, 64, 128, widest)}


def test_flat_curve_picks_the_widest_settings():
    ranked = auto.rank(FIT, curve(0.0), GRID)
    best = ranked[0]
    assert (best.W, best.N, best.G) == (15, 5, 15)
    assert best.cost == pytest.approx(1.0)
    assert best.speedup == pytest.approx(FIT.predict_S(15, 5, 15))
    assert [c.speedup for c in ranked] == sorted((c.speedup for c in ranked), reverse=True)


def test_steep_curve_picks_small_settings():
    ranked = auto.rank(FIT, curve(1.0), GRID)  # cost grows as fast as the tokens
    best = ranked[0]
    assert best.W == 1 and best.N == 3
    assert best.tokens == 4
    assert best.speedup < 1  # plain decoding would be faster: the report says so


def test_moderate_curve_peaks_in_between():
    """A GPU-like curve, flat up to 64 tokens then linear: a mid-size window wins."""
    costs = {t: max(1.0, t / 64) for t in (1, 2, 4, 8, 16, 32, 64, 128, 256)}
    best = auto.rank(FIT, costs, GRID)[0]
    assert 1 < best.W < 15 and best.tokens <= 64


def test_ranked_tokens_are_the_layouts_step_tokens():
    from lookahead_jax.lookahead.layout import StepLayout, tokens_per_step
    grid = [(1, 3, 1), (15, 5, 15), (4, 3, 0)]
    for c in auto.rank(FIT, curve(0.0), grid):
        assert c.tokens == tokens_per_step(c.W, c.N, c.G) == StepLayout(c.W, c.N, c.G).size
        assert c.tokens == LookaheadConfig(W=c.W, N=c.N, G=c.G).step_tokens
    two = {c.label: c.tokens for c in auto.rank(FIT, curve(0.0), grid, devices=2)}
    assert two["(15,5,15)"] == tokens_per_step(15, 5, 15, devices=2) < tokens_per_step(15, 5, 15)


def test_candidate_grid_and_measure_points():
    assert auto.candidate_grid((1, 3), (4,)) == [(1, 4, 1), (3, 4, 3)]
    assert auto.candidate_grid((2,), (3,), Gs=(0, 2)) == [(2, 3, 0), (2, 3, 2)]
    assert auto.tokens_to_measure([(15, 5, 15)]) == [1, 2, 4, 8, 16, 32, 64, 120]
    with pytest.raises(ConfigError, match="empty"):
        auto.candidate_grid((), (3,))
    with pytest.raises(ConfigError, match="N"):
        auto.candidate_grid((1,), (1,))


def test_rank_rejects_bad_curves():
    with pytest.raises(ConfigError, match="empty"):
        auto.rank(FIT, {}, GRID)
    with pytest.raises(ConfigError, match="> 0"):
        auto.rank(FIT, {1: 0.0, 8: 1.0}, GRID)


def test_choose_settings_with_a_given_curve_keeps_base_fields():
    class FakeEngine:  # choose_settings only reads these when the curve is given
        class config:
            max_position_embeddings = 512
        lookahead = LookaheadConfig(W=4, N=3, G=4, prompt_seeding=True, pool_slots=4)
        devices = 1

    choice = auto.choose_settings(FakeEngine(), step_costs=curve(0.0), fit=FIT,
                                  grid=auto.candidate_grid((2, 5), (3,)))
    default = auto.choose_settings(FakeEngine(), step_costs=curve(0.0),
                                   grid=auto.candidate_grid((2, 5), (3,)))
    assert default.fit == auto.resolve_fit(None)
    assert f"({default.fit.source})" in default.report()  # says which fit it used
    assert (choice.config.W, choice.config.N, choice.config.G) == (5, 3, 5)
    assert choice.config.prompt_seeding
    assert choice.config.pool_slots == 0  # base's 4 slots < G = 5: reset to the default (G)
    text = choice.report(top=2)
    assert "W=5 N=3 G=5" in text and "predicted speed-up" in text
    json.dumps(choice.to_dict())
    slow = auto.choose_settings(FakeEngine(), step_costs=curve(1.0), fit=FIT,
                                grid=auto.candidate_grid((2, 5), (3,)))
    assert "--method=ar" in slow.report()
    assert slow.config.pool_slots == 4  # 4 >= G = 2: kept


def test_resolve_fit(tmp_path):
    from lookahead_jax.tuning.scaling_law import default_fit, save_fits
    default = auto.resolve_fit(None)
    assert default == default_fit()  # the one default, whatever files the working tree has
    assert "default_fit.json" in default.source
    path = save_fits(str(tmp_path / "fit.json"), {"all": FIT})
    assert (auto.resolve_fit(path).a, auto.resolve_fit(path).f) == (FIT.a, FIT.f)
    assert path in auto.resolve_fit(path).source
    with pytest.raises(ConfigError, match="no such file"):
        auto.resolve_fit(str(tmp_path / "missing.json"))


# -- the CLI, end to end on tiny_llama -----------------------------------------------------------
def run_inproc(**options):
    from lookahead_jax import decode
    out, err = io.StringIO(), io.StringIO()
    code = decode.run(decode.Options(**options), stdin=io.StringIO(""), stdout=out, stderr=err)
    return code, out.getvalue(), err.getvalue()


def test_cli_auto_end_to_end(tmp_path):
    json_out = tmp_path / "out.json"
    code, out, err = run_inproc(config="tiny_llama", prompt_ids="1,5,9,13,17", auto=True,
                                max_new_tokens=6, W=2, json_out=str(json_out))
    assert code == 0, err
    assert "auto: " in err and "best candidates" in err and "W=2" in err
    assert "(default fit lookahead_jax/tuning/default_fit.json: " in err  # the fit it used
    data = json.loads(json_out.read_text())
    tokens = data["results"][0]["tokens"]
    assert [int(t) for t in out.split()] == tokens  # stdout streams the generated ids
    assert 1 <= len(tokens) <= 6
    assert data["auto"]["config"]["W"] == 2
    assert data["method"] == data["auto"]["method"]  # what ran is what auto chose
    if data["method"] == "lookahead":
        assert data["lookahead"]["W"] == 2
    assert data["auto"]["curve_source"].startswith("measured on this cpu")
    assert data["auto"]["fit"]["source"].startswith("default fit ")


def test_cli_auto_with_a_stored_fit(tmp_path):
    from lookahead_jax.tuning.scaling_law import save_fits
    path = save_fits(str(tmp_path / "fit.json"), {"all": FIT})
    code, _, err = run_inproc(config="tiny_llama", prompt_ids="1,2,3", auto=True, auto_fit=path,
                              max_new_tokens=4, W=1, N=3)
    assert code == 0, err
    assert "a=0.500 f=2.00" in err and "W=1 N=3" in err


@pytest.mark.parametrize("options,fragment", [
    (dict(method="ar"), "--auto"),
    (dict(auto_fit="/nonexistent/fit.json"), "no such file"),
    (dict(auto_fit="x.json", auto=False), "--auto_fit"),
    (dict(auto_device="A100 80GB SXM", auto=False), "--auto_device"),
    (dict(auto_device="Z80"), "--auto_device must be one of"),
])
def test_cli_auto_errors(options, fragment):
    opts = dict(config="tiny_llama", prompt_ids="1,2,3", auto=True, max_new_tokens=4)
    opts.update(options)
    code, _, err = run_inproc(**opts)
    assert code == 2
    assert "error:" in err and fragment in err, err


def test_cli_auto_rejects_looped_presets():
    code, _, err = run_inproc(config="tiny_ouro", prompt_ids="1,2,3", auto=True,
                              max_new_tokens=4)
    assert code == 2 and "--auto" in err, err


def test_monotone_costs_removes_small_t_spikes():
    noisy = {1: 5.0, 2: 1.1, 4: 1.0, 8: 1.3, 16: 1.2, 32: 2.0}
    assert auto.monotone_costs(noisy) == {1: 1.0, 2: 1.0, 4: 1.0, 8: 1.2, 16: 1.2, 32: 2.0}
    ranked = {c.label: c for c in auto.rank(FIT, noisy, [(1, 3, 1), (3, 3, 3)])}
    assert ranked["(1,3,1)"].cost == pytest.approx(1.0)  # 4 tokens, not 5x the spike at T=1
    assert ranked["(3,3,3)"].cost == pytest.approx(1.2)  # 12 tokens, between 8 and 16


# -- the method choice: never slower than plain decoding by our choice --------------------------
def cand(speedup: float) -> auto.Candidate:
    return auto.Candidate(3, 3, 3, 12, 1.2, 1.2 / speedup, speedup)


def test_choose_method_falls_back_to_prompt_lookup_then_plain():
    flat = curve(0.0)  # prompt lookup's 11 tokens cost one step: S 1.12 -> 1.12x
    assert auto.choose_method([cand(1.5)], flat) == ("lookahead", pytest.approx(1.12))
    assert auto.choose_method([cand(1.1)], flat)[0] == "prompt_lookup"  # 1.12x beats 1.1x
    assert auto.choose_method([cand(1.04)], curve(1.0))[0] == "ar"  # under the 1.05 margin
    assert auto.choose_method([cand(1.04)], curve(1.0), min_speedup=1.0)[0] == "lookahead"
    # 11 tokens cost 1.05 steps: 1.12 / 1.05 = 1.07x; 1.2 steps: 0.93x
    assert auto.choose_method([cand(0.6)], curve(0.005))[0] == "prompt_lookup"
    assert auto.choose_method([cand(0.6)], curve(0.02))[0] == "ar"


def test_choice_report_says_why_it_falls_back():
    class FakeEngine:
        class config:
            max_position_embeddings = 512
        lookahead = None
        devices = 1

    grid = auto.candidate_grid((1, 2, 5), (3,))
    steep = auto.choose_settings(FakeEngine(), step_costs=curve(1.0), fit=FIT, grid=grid)
    assert steep.method == "ar"
    text = steep.report()
    assert text.startswith("auto: plain decoding (--method=ar): neither")
    assert "prompt lookup: predicted S 1.12" in text and "step cost given" in text
    assert steep.to_dict()["method"] == "ar"
    flat = auto.choose_settings(FakeEngine(), step_costs=curve(0.0), fit=FIT, grid=grid)
    assert flat.method == "lookahead" and flat.report().startswith("auto: lookahead W=5")


def test_auto_predicts_for_a_device_with_the_roofline():
    """For a device this host is not, the curve is the roofline's prediction from the compiled
    program of the model's shape: Llama-2-7B's layers on an A100 are memory-bound, so a
    120-token step costs little more than a plain one and lookahead wins; the report says where
    the curve came from. Four of its 32 layers (CI's time: each point compiles the program; a
    layer's cost, and so the curve's shape, is the same in a 4-layer model)."""
    import dataclasses

    from lookahead_jax.store.presets import load_preset

    class Engine7B:
        config = dataclasses.replace(load_preset("llama7b").model, num_layers=4)
        lookahead = None
        devices = 1

    grid = auto.candidate_grid((1, 7, 15), (5,))
    choice = auto.choose_settings(Engine7B(), prompt_len=256, max_new_tokens=256, grid=grid,
                                  device="A100 80GB SXM")
    assert choice.curve_source == ("predicted for A100 80GB SXM by the roofline model "
                                   "(dense attention)")
    assert choice.method == "lookahead" and choice.best.W == 15
    costs = auto.monotone_costs(choice.step_costs)
    assert costs[max(costs)] / costs[1] < 1.5  # (15,5,15): 120 tokens
    assert "predicted for A100 80GB SXM" in choice.report()
    # with the kernel (--attention=auto on the GPU) the wide step moves fewer bytes
    Engine7B.attention = "auto"
    kernel = auto.choose_settings(Engine7B(), prompt_len=256, max_new_tokens=256, grid=grid,
                                  device="A100 80GB SXM")
    assert kernel.curve_source.endswith("(the Pallas kernel)")
    k = auto.monotone_costs(kernel.step_costs)
    assert k[max(k)] / k[1] < costs[max(costs)] / costs[1]


@pytest.mark.slow
def test_auto_on_this_cpu_is_never_slower_than_plain_decoding():
    """#18's check: on this CPU, --auto's choice (its step-cost curve measured here, SmolLM2)
    runs within 10% of plain decoding's speed or faster, measured side by side (best of 3,
    interleaved). A choice of lookahead here would be 0.2-0.8x (the committed suite).
    Marked slow: it times decoding (about a minute), which CI's default run leaves to the
    benchmarks; `-m slow` runs it."""
    import time

    from lookahead_jax.engine import Engine
    from lookahead_jax.store.model_store import smollm2_gguf

    try:
        smollm2_gguf(download=False)
    except Exception as e:  # noqa: BLE001
        pytest.skip(f"SmolLM2-135M-Instruct GGUF not available ({e})")
    engine = Engine.from_preset("smollm2_135m")
    ids = engine.encode("Write a Python function that reverses a list.", True)
    choice = auto.choose_settings(engine, prompt_len=len(ids), max_new_tokens=32, repeats=3)
    print("\n" + choice.report(top=3))
    chosen = engine.build_method(choice.method, **(
        {"lookahead": choice.config} if choice.method == "lookahead" else {}))
    plain = engine.build_method("ar")
    times = {"plain": [], "chosen": []}
    for m in (plain, chosen):
        engine.generate_ids([ids], method=m, max_new_tokens=32)  # compiled, warm
    for _ in range(3):
        for name, m in (("plain", plain), ("chosen", chosen)):
            t0 = time.perf_counter()
            out = engine.generate_ids([ids], method=m, max_new_tokens=32)
            times[name].append(time.perf_counter() - t0)
            assert len(out.tokens[0]) == 32
    ratio = min(times["plain"]) / min(times["chosen"])
    print(f"auto chose {choice.method}: {ratio:.2f}x plain decoding's speed")
    assert ratio >= 0.9
