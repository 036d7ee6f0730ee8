"""The scaling law: E(a, g, b) and S(a, f, N, G), the least-squares fit of (a, f), stored fits,
the one default fit (package data, equal to a refit of the committed results), and the
benchmarks' fit helpers and plot."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

from benchmarks import fits as bench_fits
from lookahead_jax.tuning import scaling_law as sl

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


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
        sl.default_fit().predict_S(0, 5, 5)


def test_default_fit_is_the_shipped_package_data():
    """One default fit: the package's default_fit.json, read as package data (not through a
    repository path), naming where it comes from."""
    from importlib import resources
    shipped = json.loads(resources.files("lookahead_jax.tuning")
                         .joinpath(sl.DEFAULT_FIT_FILE).read_text())
    fit_ = sl.default_fit()
    assert (fit_.a, fit_.f, fit_.rmse, fit_.points) == (
        shipped["a"], shipped["f"], shipped["rmse"], shipped["points"])
    assert fit_.source.startswith("default fit lookahead_jax/tuning/default_fit.json: ")
    assert bench_fits.DEFAULT_RESULTS in fit_.source and shipped["points"] == 42
    assert 0 < fit_.a < 1 and fit_.f >= 1


def test_default_fit_matches_committed_results():
    """The shipped default fit equals a refit of the committed sweep it names (rewrite it with
    `python -m benchmarks.fits` when the results change)."""
    results = os.path.join(REPO, bench_fits.DEFAULT_RESULTS)
    if not os.path.exists(results):
        pytest.skip(f"{bench_fits.DEFAULT_RESULTS} absent (an installed package, not a checkout)")
    refit = bench_fits.default_fit_from_results()
    shipped = sl.default_fit()
    assert refit.a == pytest.approx(shipped.a, rel=1e-12)
    assert refit.f == pytest.approx(shipped.f, rel=1e-12)
    assert refit.rmse == pytest.approx(shipped.rmse, rel=1e-12)
    assert refit.points == shipped.points
    assert shipped.source.endswith(refit.source)
    # and it is the sweep's own pooled fit, as the suite recorded it
    with open(results, encoding="utf-8") as f:
        stored = json.load(f)["fits"]["all"]
    assert (stored["a"], stored["f"]) == (pytest.approx(refit.a), pytest.approx(refit.f))


def test_write_default_fit_round_trips(tmp_path):
    results = os.path.join(REPO, bench_fits.DEFAULT_RESULTS)
    if not os.path.exists(results):
        pytest.skip(f"{bench_fits.DEFAULT_RESULTS} absent")
    path = bench_fits.write_default_fit(str(tmp_path / "fit.json"))
    loaded = sl.load_fit(path)
    assert (loaded.a, loaded.f, loaded.points) == (sl.default_fit().a, sl.default_fit().f, 42)


def test_points_from_summary_filters():
    rows = [{"dataset": "humaneval", "method": "plain", "W": None, "N": None, "G": None,
             "S": 1.0, "prompts": 4},
            {"dataset": "humaneval", "method": "(5,5,5)", "W": 5, "N": 5, "G": 5, "S": 1.8,
             "prompts": 4},
            {"dataset": "gsm8k", "method": "(5,5,5) +prompt", "W": 5, "N": 5, "G": 5, "S": 2.1,
             "prompts": 3}]
    points = bench_fits.points_from_summary
    assert points(rows) == ([(5, 5, 5, 1.8)], [4.0])
    assert points(rows, prompt_seeding=True) == ([(5, 5, 5, 2.1)], [3.0])
    assert len(points(rows, prompt_seeding=None)[0]) == 2
    assert points(rows, dataset="gsm8k")[0] == []


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
    from benchmarks.plots import plot_fit
    pts = synthetic(0.5, 2.0, 0.01)
    res = sl.fit(pts)
    path = plot_fit({"synthetic": (pts, res), "other": (pts[:7], sl.default_fit())},
                    str(tmp_path / "fit.png"), title="test")
    with open(path, "rb") as f:
        head = f.read(24)
    assert head[:8] == b"\x89PNG\r\n\x1a\n"
    assert (int.from_bytes(head[16:20], "big"), int.from_bytes(head[20:24], "big")) == (
        1320, 504)  # figsize (11, 4.2) at 120 dpi


def test_fits_command_checks_the_shipped_file(capsys):
    if not os.path.exists(os.path.join(REPO, bench_fits.DEFAULT_RESULTS)):
        pytest.skip(f"{bench_fits.DEFAULT_RESULTS} absent")
    assert bench_fits.main(["fits", "--check"]) == 0
    assert "same" in capsys.readouterr().out
    assert bench_fits.main(["fits", "--nope"]) == 2
