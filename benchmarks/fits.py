"""Scaling-law fits from benchmark reports, and the library's one default fit.

    python -m benchmarks.fits                 # rewrite lookahead_jax/tuning/default_fit.json
    python -m benchmarks.fits --check         # exit 1 if the shipped file differs from a refit

The library ships its default fit as package data (`lookahead_jax/tuning/default_fit.json`,
read by `scaling_law.default_fit()`) and reads nothing from the repository; this module is
the one place that turns the committed results (`DEFAULT_RESULTS`, the SmolLM2 W sweep of
`python -m benchmarks.suite --sweep`) into that file. `tests/test_scaling_law.py` refits
from the same results and compares with the shipped file.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any, Iterable, Mapping

from benchmarks.common import REPO, write_json
from lookahead_jax.tuning.scaling_law import DEFAULT_FIT_FILE, ScalingFit, fit

DEFAULT_RESULTS = "benchmarks/results/sweep_smollm2_135m.json"  # relative to the repository
DEFAULT_FIT_PATH = os.path.join("lookahead_jax", "tuning", DEFAULT_FIT_FILE)
COMMAND = "python -m benchmarks.fits"


def points_from_summary(rows: Iterable[Mapping[str, Any]], *, dataset: str | None = None,
                        prompt_seeding: bool | None = False) -> tuple[list[tuple], list[float]]:
    """(W, N, G, S) points and weights (prompts) from a benchmark summary (the `summary` rows
    of lookahead_bench / suite JSON): lookahead rows only, optionally one data set, and rows
    with the given prompt seeding (None: any; labels ending in '+prompt' are seeded)."""
    pts, weights = [], []
    for r in rows:
        if r.get("W") is None or r.get("N") is None or r.get("G") is None:
            continue
        if dataset is not None and r.get("dataset") != dataset:
            continue
        seeded = bool(r.get("prompt_seeding", str(r.get("method", "")).endswith("+prompt")))
        if prompt_seeding is not None and seeded != prompt_seeding:
            continue
        pts.append((r["W"], r["N"], r["G"], r["S"]))
        weights.append(float(r.get("prompts", 1)))
    return pts, weights


def fit_rows(rows: list[dict]) -> dict[str, Any]:
    """Scaling-law fits of the lookahead rows: one per data set and "all" (pooled), where at
    least two settings with different (N, G) were measured. Rows mixing prompt seeding on and
    off are fitted together (the fit's `source` says so). -> {"fits": {name: ScalingFit},
    "notes": {name: why it could not be fitted}}."""
    fits, notes = {}, {}
    groups = sorted({r["dataset"] for r in rows}) + ["all"]
    for name in groups:
        pts, weights = points_from_summary(rows, dataset=None if name == "all" else name,
                                           prompt_seeding=None)
        if len({(p[1], p[2]) for p in pts}) < 2:
            continue
        try:
            fits[name] = fit(pts, weights, source=f"{name}: {len(pts)} settings")
        except ValueError as e:
            notes[name] = str(e)
    return {"fits": fits, "notes": notes}


def default_fit_from_results(results: str | None = None) -> ScalingFit:
    """The default fit, computed from a suite report (default: DEFAULT_RESULTS in this
    repository): the pooled fit of its lookahead rows, with a `source` naming the file and
    what was measured."""
    path = results or os.path.join(REPO, DEFAULT_RESULTS)
    with open(path, encoding="utf-8") as f:
        report = json.load(f)
    rows = report["summary"]
    pooled = fit_rows(rows)["fits"].get("all")
    if pooled is None:
        raise ValueError(f"{path}: too few lookahead settings for a fit")
    m = report.get("machine", {})
    rel = os.path.relpath(path, REPO) if results is None else path
    source = (f"{rel}: {report.get('config', '?')} on {m.get('jax_backend', '?')} "
              f"({m.get('cpus', '?')} CPUs), {pooled.points} lookahead settings over "
              f"{', '.join(report.get('datasets', []))}, {report.get('num_prompts', '?')} "
              f"prompts each, {report.get('max_new_tokens', '?')} new tokens, pooled")
    return ScalingFit(pooled.a, pooled.f, pooled.rmse, pooled.points, source)


def write_default_fit(out: str | None = None, results: str | None = None) -> str:
    """Writes the default fit (`default_fit_from_results`) as the single-fit JSON that
    `scaling_law.default_fit()` reads; returns the path."""
    fit_ = default_fit_from_results(results)
    return write_json(out or os.path.join(REPO, DEFAULT_FIT_PATH),
                      {**fit_.to_dict(), "written_by": COMMAND})


def main(argv: list[str]) -> int:
    check = "--check" in argv[1:]
    unknown = [a for a in argv[1:] if a != "--check"]
    if unknown:
        print(f"error: unexpected arguments {' '.join(unknown)} (usage: {COMMAND} [--check])",
              file=sys.stderr)
        return 2
    if check:
        from lookahead_jax.tuning.scaling_law import default_fit  # noqa: PLC0415
        shipped, refit = default_fit(), default_fit_from_results()
        same = (shipped.a, shipped.f, shipped.points) == (refit.a, refit.f, refit.points)
        print(f"shipped a={shipped.a} f={shipped.f}; refit a={refit.a} f={refit.f}: "
              f"{'same' if same else 'DIFFERENT (run ' + COMMAND + ')'}")
        return 0 if same else 1
    print(f"default fit: {write_default_fit()}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
