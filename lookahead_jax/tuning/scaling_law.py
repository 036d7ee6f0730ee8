"""The scaling law of lookahead decoding: step compression S predicted from W, N, G.

The Lookahead Decoding paper (arXiv 2402.02057, the section on its scaling law) models one
step's verification branch as b parallel speculations of g tokens each, every token of a
speculation accepted independently with probability a (the speculative-decoding model of
Leviathan et al.). The expected number of tokens one such step emits is

    E(a, g, b) = (g + 1) - sum_{i=1..g} (1 - a^i)^b,

the expectation of 1 + the longest accepted prefix over b speculations: P(longest >= i)
= 1 - (1 - a^i)^b. At b = 1 it is speculative decoding's (1 - a^(g+1)) / (1 - a); at a = 0
it is 1 (nothing accepted, the step still yields its one token), at a = 1 it is g + 1.
Lookahead decoding verifies G candidates of N - 1 tokens, so g = N - 1 and b = G.

Not every step has b good speculations: the n-gram pool is filled by the lookahead branch
as it goes. The paper puts this as f: good speculations arrive once every f steps, so over
f steps, f - 1 steps emit one token and one emits E tokens, and the step compression is

    S = (f - 1 + E) / f = 1 + (E - 1) / f.

That reading of f follows from the formula itself; the paper's own wording of f could not be
retrieved here, so f (>= 1) and a (0 < a < 1) are treated as fitted parameters: `fit` finds
the (a, f) that best explain measured S over a sweep of (W, N, G) settings by least squares.
Note the law has no W term: W enters only through the pool it fills, which the paper ties
to G by setting G = W (and so does `lookahead_jax.tuning.auto`).

    fit_ = fit([(1, 5, 1, 1.29), (5, 5, 5, 1.85), (15, 5, 15, 2.00)])
    fit_.predict_S(7, 5, 7)

The default fit (`default_fit()`, what `decode --auto` uses without `--auto_fit`) is the one
file `default_fit.json` shipped beside this module as package data, so an installed package
and a checkout behave alike; nothing here reads the repository. It is the pooled fit of the
W sweep `python -m benchmarks.suite --sweep=1,2,3,5,7,10,15 --sweep_N=3,5 --check_auto
--num_prompts=5 --max_new_tokens=96` on SmolLM2-135M-Instruct (2-core CPU, greedy, no prompt
seeding; MT-Bench, HumanEval and GSM8K): 42 settings, in the committed sweep report
`sweep_smollm2_135m.json` among the benchmarks' results. It was chosen over an older fit of
two smaller runs (a HumanEval-only W sweep at N = 5, plus three settings) because it covers
the shape of the candidates `auto` ranks (G = W, N = 3 and 5, W from 1 to 15) on three data
sets, and the same run's `--check_auto` confirmed the settings it picks (within 10% of the
best measured on every data set). `python -m benchmarks.fits` rewrites the file from the
committed results; a test recomputes it and compares.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
from importlib import resources
from typing import Any, Mapping, Sequence

import numpy as np

DEFAULT_FIT_FILE = "default_fit.json"  # package data beside this module (see the docstring)


def _check_a(a) -> np.ndarray:
    a = np.asarray(a, dtype=float)
    if not np.all(np.isfinite(a)) or np.any((a < 0) | (a > 1)):
        raise ValueError(f"scaling law: the acceptance rate a must be in [0, 1], got {a}")
    return a


def expected_accepted(a, g, b) -> np.ndarray:
    """E(a, g, b) = (g + 1) - sum_{i=1..g} (1 - a^i)^b: expected tokens of a step verifying b
    speculations of g tokens, each token accepted with probability a. Broadcasts over a, g, b
    (g >= 0 and b >= 0 integers)."""
    a = _check_a(a)
    g = np.asarray(g)
    b = np.asarray(b)
    if np.any(g < 0) or np.any(b < 0) or np.any(g != np.round(g)) or np.any(b != np.round(b)):
        raise ValueError(f"scaling law: g and b must be integers >= 0, got g={g}, b={b}")
    a, g, b = np.broadcast_arrays(a, g.astype(int), b.astype(int))
    i = np.arange(1, int(g.max(initial=0)) + 1)  # [I]
    terms = (1.0 - a[..., None] ** i) ** b[..., None]  # [..., I]
    terms = np.where(i <= g[..., None], terms, 0.0)
    return (g + 1) - terms.sum(-1)


def step_compression(a, f, N, G) -> np.ndarray:
    """S = (f - 1 + E(a, N - 1, G)) / f, the tokens per step predicted for settings (N, G)."""
    f = np.asarray(f, dtype=float)
    if not np.all(np.isfinite(f)) or np.any(f < 1):
        raise ValueError(f"scaling law: f must be >= 1, got {f}")
    N = np.asarray(N)
    if np.any(N < 2):
        raise ValueError(f"scaling law: N must be >= 2, got {N}")
    e = expected_accepted(a, N - 1, G)
    return (f - 1 + e) / f


@dataclasses.dataclass(frozen=True)
class ScalingFit:
    """Fitted parameters of the law: acceptance rate `a`, good speculations once every `f`
    steps; `rmse` of S over the `points` it was fitted to; `source` says what those were."""

    a: float
    f: float
    rmse: float | None = None
    points: int = 0
    source: str = ""

    def predict_S(self, W, N, G) -> np.ndarray | float:
        """Predicted step compression of settings (W, N, G) (arrays broadcast). W is taken
        for the call's readability and checked, but the law has no W term (see the module
        docstring)."""
        if np.any(np.asarray(W) < 1):
            raise ValueError(f"scaling law: W must be >= 1, got {W}")
        s = step_compression(self.a, self.f, N, G)
        return float(s) if np.ndim(s) == 0 else s

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "ScalingFit":
        try:
            rmse = d.get("rmse")
            out = cls(a=float(d["a"]), f=float(d["f"]),
                      rmse=None if rmse is None else float(rmse),
                      points=int(d.get("points", 0)), source=str(d.get("source", "")))
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"scaling fit: expected a mapping with numbers 'a' and 'f', "
                             f"got {dict(d)!r} ({e})") from None
        _check_a(out.a)
        if not out.f >= 1:
            raise ValueError(f"scaling fit: f must be >= 1, got {out.f}")
        return out


def _as_points(points) -> np.ndarray:
    """[(W, N, G, S), ...] or a dict with arrays W, N, G, S -> float array [P, 4], checked."""
    if isinstance(points, Mapping):
        try:
            points = list(zip(points["W"], points["N"], points["G"], points["S"]))
        except KeyError as e:
            raise ValueError(f"scaling fit: points need W, N, G and S, missing {e}") from None
    try:
        arr = np.asarray(list(points), dtype=float)
    except (TypeError, ValueError):
        raise ValueError("scaling fit: points must be (W, N, G, S) tuples of numbers") from None
    if arr.size == 0:
        return arr.reshape(0, 4)
    if arr.ndim != 2 or arr.shape[1] != 4:
        raise ValueError(f"scaling fit: points must be (W, N, G, S) tuples, got shape "
                         f"{arr.shape}")
    if not np.all(np.isfinite(arr)):
        raise ValueError("scaling fit: points hold NaN or infinite values")
    w, n, g, s = arr.T
    if np.any(w < 1) or np.any(n < 2) or np.any(g < 0):
        raise ValueError("scaling fit: every point needs W >= 1, N >= 2 and G >= 0")
    if np.any(s <= 0):
        raise ValueError("scaling fit: step compression S must be > 0 (tokens per step)")
    return arr


def fit(points, weights: Sequence[float] | None = None, *, source: str = "",
        grid: int = 2000) -> ScalingFit:
    """Least-squares fit of (a, f) to measured step compression.

    points: (W, N, G, S) tuples (or a mapping of W, N, G, S sequences); weights: one per
    point (e.g. its prompts or steps; default equal). For a fixed a, S - 1 = (E - 1) / f is
    linear in c = 1 / f, so c has a closed form (clipped to (0, 1], i.e. f >= 1); a is found
    on a grid over (0, 1) and refined around the best grid point.

    Raises ValueError on bad points, fewer than two points, or S never above 1 (nothing
    was ever accepted: f would be infinite).
    """
    arr = _as_points(points)
    if len(arr) < 2:
        raise ValueError(f"scaling fit: need at least 2 measured settings, got {len(arr)}")
    w_pt = np.ones(len(arr)) if weights is None else np.asarray(weights, dtype=float)
    if w_pt.shape != (len(arr),) or np.any(w_pt < 0) or not np.all(np.isfinite(w_pt)) \
            or w_pt.sum() <= 0:
        raise ValueError("scaling fit: weights must be one finite number >= 0 per point, "
                         "not all 0")
    _, n, g, s = arr.T
    y = s - 1.0
    if not np.any(y > 1e-9):
        raise ValueError("scaling fit: no measured S is above 1 (no candidate was ever "
                         "accepted), so the law cannot be fitted")

    def best_c(a: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        x = expected_accepted(a[:, None], n - 1, g) - 1.0  # [A, P]
        c = (w_pt * x * y).sum(1) / np.maximum((w_pt * x * x).sum(1), 1e-300)
        c = np.clip(c, 1e-9, 1.0)
        sse = (w_pt * (y - c[:, None] * x) ** 2).sum(1)
        return c, sse

    a_grid = np.linspace(0.0, 1.0, grid + 1)[1:-1]
    _, sse = best_c(a_grid)
    k = int(np.argmin(sse))
    lo, hi = a_grid[max(k - 1, 0)], a_grid[min(k + 1, len(a_grid) - 1)]
    fine = np.linspace(lo, hi, 401)
    c, sse = best_c(fine)
    k = int(np.argmin(sse))
    rmse = math.sqrt(float(sse[k]) / float(w_pt.sum()))
    return ScalingFit(a=float(fine[k]), f=float(1.0 / c[k]), rmse=rmse, points=len(arr),
                      source=source)


# -- stored fits ---------------------------------------------------------------------------------
def save_fits(path: str, fits: Mapping[str, ScalingFit], **extra) -> str:
    """Writes {"fits": {name: fit}, **extra} as JSON (`lookahead_jax.tuning.auto` reads "all", else
    the first fit); returns the path."""
    parent = os.path.dirname(os.path.abspath(path))
    os.makedirs(parent, exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        json.dump({"fits": {k: v.to_dict() for k, v in fits.items()}, **extra}, f, indent=2)
        f.write("\n")
    return path


def load_fit(path: str, name: str | None = None) -> ScalingFit:
    """One fit from a JSON file written by `save_fits` (`name`, else "all", else the first),
    or a file holding a single {"a": ..., "f": ...}. Raises ValueError with the path."""
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except FileNotFoundError:
        raise ValueError(f"scaling fit {path}: no such file (write one with `save_fits`, e.g. "
                         f"`python -m benchmarks.suite --sweep=... --fit_out=...`)") from None
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"scaling fit {path}: cannot read it ({e})") from None
    return fit_from_json(data, path, name)


def fit_from_json(data: Any, where: str, name: str | None = None) -> ScalingFit:
    """The fit in parsed JSON `data` (see `load_fit`); `where` names it in errors and in the
    returned fit's `source`."""
    if not isinstance(data, dict):
        raise ValueError(f"scaling fit {where}: expected a JSON object")
    fits = data.get("fits")
    if fits is None:
        out = ScalingFit.from_dict(data)
        return dataclasses.replace(out, source=f"{where}" + (f": {out.source}"
                                                             if out.source else ""))
    if not isinstance(fits, dict) or not fits:
        raise ValueError(f"scaling fit {where}: 'fits' is empty")
    key = name if name is not None else ("all" if "all" in fits else next(iter(fits)))
    if key not in fits:
        raise ValueError(f"scaling fit {where}: no fit named {key!r} (has {', '.join(fits)})")
    out = ScalingFit.from_dict(fits[key])
    return dataclasses.replace(out, source=f"{where} [{key}]" + (f": {out.source}"
                                                                if out.source else ""))


@functools.cache
def default_fit() -> ScalingFit:
    """The one default fit, read from this package's `default_fit.json` (package data; see
    the module docstring for what it was fitted to). Its `source` names the file and the
    measurements."""
    text = resources.files(__package__).joinpath(DEFAULT_FIT_FILE).read_text(encoding="utf-8")
    where = f"default fit {__package__.replace('.', '/')}/{DEFAULT_FIT_FILE}"
    return fit_from_json(json.loads(text), where)
