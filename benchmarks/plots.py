"""Benchmark plots (matplotlib, written as PNG): the scaling-law fit, the W sweep, the
accepted-length histograms. Each function takes report rows, writes one file and returns its
path; `suite_plots` writes those that apply to a suite report."""

from __future__ import annotations

from typing import Mapping, Sequence

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
from matplotlib.ticker import MaxNLocator  # noqa: E402

from benchmarks.fits import points_from_summary  # noqa: E402
from lookahead_jax.lookahead.layout import tokens_per_step  # noqa: E402
from lookahead_jax.tuning.scaling_law import ScalingFit  # noqa: E402
from lookahead_jax.tuning.step_cost import relative_cost  # noqa: E402

COLORS = plt.rcParams["axes.prop_cycle"].by_key()["color"]


def _save(fig, path: str, dpi: int = 120) -> str:
    fig.tight_layout()
    fig.savefig(path, dpi=dpi)
    plt.close(fig)
    return path


def _finish(axes, integer_x: bool = False) -> None:
    for ax in axes:
        if integer_x:
            ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)


def plot_fit(groups: Mapping[str, tuple[Sequence[tuple], ScalingFit]], path: str, *,
             title: str = "") -> str:
    """Two panels: measured S against predicted S (with y = x), and S against W with each
    group's fitted curve (G = W, one curve per N) beside its measured points.

    groups: name (e.g. a data set) -> ((W, N, G, S) points, the fit to draw for them)."""
    fig, (ax0, ax1) = plt.subplots(1, 2, figsize=(11, 4.2))
    lims = [1.0, 1.0]
    for k, (name, (pts, fit_)) in enumerate(groups.items()):
        color = COLORS[k % len(COLORS)]
        w, n, g, s = np.asarray(pts, dtype=float).reshape(-1, 4).T
        pred = np.atleast_1d(fit_.predict_S(w, n.astype(int), g.astype(int)))
        ax0.scatter(pred, s, color=color, label=f"{name} (a={fit_.a:.2f}, f={fit_.f:.2f})")
        lims = [min(lims[0], pred.min(), s.min()), max(lims[1], pred.max(), s.max())]
        for j, n_val in enumerate(sorted(set(n.astype(int)))):
            sel = n == n_val
            ax1.scatter(w[sel], s[sel], color=color, marker="osd^v<>"[j % 7],
                        label=f"{name} N={n_val} measured")
            ws = np.arange(1, max(int(w.max()), 2) + 1)
            ax1.plot(ws, np.atleast_1d(fit_.predict_S(ws, n_val, ws)), color=color,
                     ls="-" if j == 0 else "--", lw=1.2, label=f"{name} N={n_val} fit (G=W)")
    pad = 0.05 * (lims[1] - lims[0] + 1e-9)
    ax0.plot([lims[0] - pad, lims[1] + pad], [lims[0] - pad, lims[1] + pad], color="gray",
             lw=0.8, label="y = x")
    ax0.set(xlabel="predicted S (fitted law)", ylabel="measured S",
            title="measured against predicted")
    ax1.set(xlabel="W (G = W)", ylabel="step compression S", title="S against W")
    _finish((ax0, ax1))
    if title:
        fig.suptitle(title)
    return _save(fig, path)


def sweep_groups(rows: list[dict]) -> dict[tuple[int, bool], list[dict]]:
    """(N, prompt seeding) -> lookahead rows with G = W, where >= 3 distinct W were measured."""
    groups: dict[tuple[int, bool], list[dict]] = {}
    for r in rows:
        if r.get("W") is not None and r["G"] == r["W"]:
            groups.setdefault((r["N"], bool(r.get("prompt_seeding"))), []).append(r)
    return {k: v for k, v in groups.items() if len({r["W"] for r in v}) >= 3}


def plot_sweep(rows: list[dict], datasets: Sequence[str], path: str, *,
               fits: Mapping[str, ScalingFit] | None = None,
               step_costs: Mapping[int, float] | None = None) -> str | None:
    """S and speed-up against W (G = W) per data set and N, with each data set's fitted law
    (and law / step-cost curve) beside the points; None when the rows hold no W sweep."""
    sweeps = sweep_groups(rows)
    if not sweeps:
        return None
    fits = fits or {}
    fig, (ax0, ax1) = plt.subplots(1, 2, figsize=(11, 4.2))
    for k, ds in enumerate(datasets):
        color = COLORS[k % len(COLORS)]
        for (n, seeded), grp in sorted(sweeps.items()):
            pts = sorted((r["W"], r["S"], r["speedup"]) for r in grp if r["dataset"] == ds)
            if not pts:
                continue
            tag = f"{ds} N={n}" + (" +prompt" if seeded else "")
            w = [p[0] for p in pts]
            fit_ = fits.get(ds)
            ax0.plot(w, [p[1] for p in pts], "o" if fit_ else "o-", color=color,
                     label=f"{tag} measured")
            ax1.plot(w, [p[2] for p in pts], "o-", color=color, label=f"{tag} measured")
            if fit_ is None:
                continue
            ws = np.arange(1, max(w) + 1)
            s_law = np.atleast_1d(fit_.predict_S(ws, n, ws))
            ax0.plot(ws, s_law, "-", color=color, lw=1.2,
                     label=f"{tag} law a={fit_.a:.2f} f={fit_.f:.2f}")
            if step_costs:
                cost = [relative_cost(step_costs, tokens_per_step(int(x), n, int(x)))
                        for x in ws]
                ax1.plot(ws, s_law / np.asarray(cost), "--", color=color, lw=1.0,
                         label=f"{tag} law / step-cost curve")
    ax0.set(xlabel="W (G = W)", ylabel="step compression S", title="S against W")
    ax1.axhline(1.0, color="gray", lw=0.8)
    ax1.set(xlabel="W (G = W)", ylabel="speed-up over plain (wall clock)",
            title="speed-up against W")
    _finish((ax0, ax1), integer_x=True)
    return _save(fig, path)


def plot_histograms(rows: list[dict], datasets: Sequence[str], path: str) -> str | None:
    """Accepted draft tokens per step, one panel per method, one bar group per data set;
    None when no row holds a histogram."""
    hist_rows = [r for r in rows if r.get("accepted_hist")]
    if not hist_rows:
        return None
    methods = list(dict.fromkeys(r["method"] for r in hist_rows))
    cols = min(3, len(methods))
    nrows = -(-len(methods) // cols)
    fig, axes = plt.subplots(nrows, cols, figsize=(4.2 * cols, 3.2 * nrows), squeeze=False)
    for ax, method in zip(axes.ravel(), methods):
        grp = [r for r in hist_rows if r["method"] == method]
        width = 0.8 / len(grp)
        for k, r in enumerate(grp):
            h = np.asarray(r["accepted_hist"], float)
            x = np.arange(len(h)) + (k - (len(grp) - 1) / 2) * width
            color = (COLORS[list(datasets).index(r["dataset"]) % len(COLORS)]
                     if r["dataset"] in datasets else None)
            ax.bar(x, h / max(h.sum(), 1), width=width, label=r["dataset"], color=color)
        ax.set(title=method, xlabel="accepted draft tokens per step",
               ylabel="fraction of steps")
        ax.grid(alpha=0.3, axis="y")
    _finish([ax for ax in axes.ravel()[:len(methods)]], integer_x=True)
    for ax in axes.ravel()[len(methods):]:
        ax.axis("off")
    return _save(fig, path, dpi=110)


def suite_plots(report: dict, fits: Mapping[str, ScalingFit],
                step_costs: Mapping[int, float], stem: str) -> list[str]:
    """The sweep (`_sweep.png`), fit (`_fit.png`) and histogram (`_hist.png`) plots that
    apply to a suite report; returns their paths."""
    rows, datasets = report["summary"], report["datasets"]
    paths = [plot_sweep(rows, datasets, stem + "_sweep.png", fits=fits, step_costs=step_costs)]
    groups = {}
    for ds in datasets:
        pts, _ = points_from_summary(rows, dataset=ds, prompt_seeding=None)
        if pts and ds in fits:
            groups[ds] = (pts, fits[ds])
        elif pts and "all" in fits:  # too few settings (or S never above 1) for its own
            groups[f"{ds} (pooled fit)"] = (pts, fits["all"])
    if groups:
        paths.append(plot_fit(groups, stem + "_fit.png",
                              title="scaling law: fitted per data set"))
    paths.append(plot_histograms(rows, datasets, stem + "_hist.png"))
    return [p for p in paths if p is not None]
