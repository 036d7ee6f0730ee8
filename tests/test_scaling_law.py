"""The scaling law: E(a, g, b) and S(a, f, N, G), the least-squares fit of (a, f), stored fits,
the plot helper."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

from lookahead_jax import scaling_law as sl


def test_expected_accepted_limits():
    for g in range(0, 7):
        for b in range(1, 20, 3):
            assert sl.expected_accepted(0.0, g, b) == pytest.approx(1.0)
            assert sl.expected_accepted(1.0, g, b) == pytest.approx(g + 1)


def test_one_speculation_is_speculative_decoding():
    a, g = 0.6, 4
    assert sl.expected_accepted(a, g, 1) == pytest.approx((1 - a ** (g + 1)) / (1 - a))


def test_expected_accepted_monotone_in_a_and_b():
    a = np.linspace(0.01, 0.99, 50)
    e = sl.expected_accepted(a, 4, 5)
    assert np.all(np.diff(e) > 0)
    b = np.arange(1, 40)
    e = sl.expected_accepted(0.4, 4, b)
    assert np.all(np.diff(e) > 0)
    assert np.all(e < 5)  # bounded by g + 1
    g = np.arange(0, 10)
    assert np.all(np.diff(sl.expected_accepted(0.5, g, 3)) > 0)


def test_expected_accepted_broadcasts():
    e = sl.expected_accepted(0.5, np.array([1, 2, 4]), np.array([[1], [3]]))
    assert e.shape == (2, 3)
    assert e[1, 2] == pytest.approx(sl.expected_accepted(0.5, 4, 3))


def test_step_compression():
    assert sl.step_compression(0.5, 1.0, 5, 3) == pytest.approx(sl.expected_accepted(0.5, 4, 3))
    e = sl.expected_accepted(0.5, 4, 3)
    assert sl.step_compression(0.5, 4.0, 5, 3) == pytest.approx((3 + e) / 4)
    assert sl.step_compression(0.5, 2.0, 5, 0) == pytest.approx(1.0)  # no candidates: S = 1


def synthetic(a, f, noise, seed=0):
    rng = np.random.default_rng(seed)
    pts = []
    for n in (3, 5):
        for w in (1, 2, 3, 5, 7, 10, 15):
            s = float(sl.step_compression(a, f, n, w)) + noise * rng.standard_normal()
            pts.append((w, n, w, s))
    return pts


@pytest.mark.parametrize("a,f", [(0.3, 1.5), (0.55, 3.0), (0.8, 1.1), (0.45, 6.0)])
def test_fit_recovers_parameters(a, f):
    exact = sl.fit(synthetic(a, f, 0.0))
    assert exact.a == pytest.approx(a, abs=2e-3)
    assert exact.f == pytest.approx(f, rel=1e-2)
    assert exact.rmse < 1e-3
    noisy = sl.fit(synthetic(a, f, 0.005, seed=1))
    assert noisy.a == pytest.approx(a, abs=0.05)
    assert noisy.f == pytest.approx(f, rel=0.15)
    assert noisy.points == 14


def test_fit_weights_and_mapping_input():
    pts = synthetic(0.5, 2.0, 0.0)
    w, n, g, s = zip(*pts)
    res = sl.fit({"W": w, "N": n, "G": g, "S": s}, weights=[1.0] * len(pts))
    assert res.a == pytest.approx(0.5, abs=2e-3)
    # a point with weight 0 does not move the fit
    res2 = sl.fit(pts + [(5, 5, 5, 9.0)], weights=[1.0] * len(pts) + [0.0])
    assert res2.a == pytest.approx(0.5, abs=2e-3)


@pytest.mark.parametrize("points,fragment", [
    ([], "at least 2"),
    ([(5, 5, 5, 1.5)], "at least 2"),
    ([(5, 5, 5, 1.0), (7, 5, 7, 1.0)], "no measured S is above 1"),
    ([(5, 5, 5, float("nan")), (7, 5, 7, 1.2)], "NaN"),
    ([(0, 5, 5, 1.5), (7, 5, 7, 1.2)], "W >= 1"),
    ([(5, 1, 5, 1.5), (7, 5, 7, 1.2)], "N >= 2"),
    ([(5, 5, 5, -1.0), (7, 5, 7, 1.2)], "S must be > 0"),
    ([(5, 5, 5)], "(W, N, G, S)"),
    ("nonsense", "(W, N, G, S)"),
    ({"W": [1], "N": [5]}, "missing"),
])
def test_fit_rejects_bad_input(points, fragment):
    with pytest.raises(ValueError, match="scaling fit") as e:
        sl.fit(points)
    assert fragment in str(e.value)


def test_fit_rejects_bad_weights():
    with pytest.raises(ValueError, match="weights"):
        sl.fit(synthetic(0.5, 2.0, 0.0), weights=[1.0])


def test_law_rejects_bad_parameters():
    with pytest.raises(ValueError, match="a must be in"):
        sl.expected_accepted(1.5, 4, 3)
    with pytest.raises(ValueError, match="f must be >= 1"):
        sl.step_compression(0.5, 0.5, 5, 3)
    with pytest.raises(ValueError, match="N must be >= 2"):
        sl.step_compression(0.5, 2.0, 1, 3)
    with pytest.raises(ValueError, match="integers"):
        sl.expected_accepted(0.5, 2.5, 3)
    with pytest.raises(ValueError, match="W must be >= 1"):
        sl.DEFAULT_FIT.predict_S(0, 5, 5)


def test_default_fit_matches_stored_results():
    """DEFAULT_FIT's numbers are the fit of the stored SmolLM2 runs (refit if they change)."""
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    if not all(os.path.exists(os.path.join(repo, p)) for p in sl.DEFAULT_SOURCES):
        pytest.skip("stored benchmark results absent")
    refit = sl.default_fit_from_results(repo)
    assert refit.a == pytest.approx(sl.DEFAULT_A, abs=1e-3)
    assert refit.f == pytest.approx(sl.DEFAULT_F, rel=1e-3)


def test_points_from_summary_filters():
    rows = [{"dataset": "humaneval", "method": "plain", "W": None, "N": None, "G": None,
             "S": 1.0, "prompts": 4},
            {"dataset": "humaneval", "method": "(5,5,5)", "W": 5, "N": 5, "G": 5, "S": 1.8,
             "prompts": 4},
            {"dataset": "gsm8k", "method": "(5,5,5) +prompt", "W": 5, "N": 5, "G": 5, "S": 2.1,
             "prompts": 3}]
    assert sl.points_from_summary(rows) == ([(5, 5, 5, 1.8)], [4.0])
    assert sl.points_from_summary(rows, prompt_seeding=True) == ([(5, 5, 5, 2.1)], [3.0])
    assert len(sl.points_from_summary(rows, prompt_seeding=None)[0]) == 2
    assert sl.points_from_summary(rows, dataset="gsm8k")[0] == []


def test_save_and_load_fits(tmp_path):
    fits = {"humaneval": sl.ScalingFit(0.5, 2.0, 0.01, 6, "x"), "all": sl.ScalingFit(0.4, 3.0)}
    path = sl.save_fits(str(tmp_path / "d" / "fit.json"), fits, note="hi")
    def same(a, b):
        return (a.a, a.f, a.rmse, a.points) == (b.a, b.f, b.rmse, b.points)

    assert same(sl.load_fit(path), fits["all"])
    loaded = sl.load_fit(path, "humaneval")
    assert same(loaded, fits["humaneval"]) and loaded.source == f"{path} [humaneval]: x"
    with pytest.raises(ValueError, match="no fit named"):
        sl.load_fit(path, "mbpp")
    single = tmp_path / "single.json"
    single.write_text(json.dumps({"a": 0.3, "f": 1.5}))
    assert sl.load_fit(str(single)).a == 0.3
    with pytest.raises(ValueError, match="no such file"):
        sl.load_fit(str(tmp_path / "missing.json"))
    bad = tmp_path / "bad.json"
    bad.write_text("{")
    with pytest.raises(ValueError, match="cannot read"):
        sl.load_fit(str(bad))
    bad.write_text(json.dumps({"a": 2.0, "f": 1.5}))
    with pytest.raises(ValueError, match="a must be in"):
        sl.load_fit(str(bad))
    bad.write_text(json.dumps({"a": 0.5}))
    with pytest.raises(ValueError, match="'a' and 'f'"):
        sl.load_fit(str(bad))


def test_plot_fit(tmp_path):
    pts = synthetic(0.5, 2.0, 0.01)
    res = sl.fit(pts)
    path = sl.plot_fit({"synthetic": (pts, res), "other": (pts[:7], sl.DEFAULT_FIT)},
                       str(tmp_path / "fit.png"), title="test")
    assert os.path.getsize(path) > 1000
