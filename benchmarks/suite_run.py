"""One suite run on a loaded engine: prompts x methods measured side by side, then the fits,
the --check_auto verdict, and the JSON / Markdown / PNG outputs (`run_suite`)."""

from __future__ import annotations

import dataclasses
import os
import statistics
import sys
import time
from typing import Any, Callable, Sequence

from benchmarks import common
from benchmarks.fits import fit_rows
from benchmarks.looped_bench import loop_counts
from benchmarks.suite_methods import MethodSpec, SuiteError, applicable, build_methods
from benchmarks.suite_report import markdown_report
from lookahead_jax.lookahead.config import LookaheadConfig
from lookahead_jax.method import Method
from lookahead_jax.sampling import Sampling
from lookahead_jax.tuning import auto
from lookahead_jax.tuning.scaling_law import load_fit, save_fits
from lookahead_jax.tuning.step_cost import measure_step_cost, relative_cost
from models.config import LoopedConfig

AUTO_TOLERANCE = 0.10  # --check_auto passes when auto's speed-up >= (1 - this) x the best


@dataclasses.dataclass
class SuiteOptions:
    """Everything one suite run needs (`suite.options_from_flags` fills it from the flags)."""

    methods: list[MethodSpec]
    datasets: Sequence[str] = ("mt_bench", "humaneval", "gsm8k")
    num_prompts: int = 20
    max_new_tokens: int = 128
    data_dir: str | None = None
    out: str = "benchmarks/results/suite.json"
    sampling: Sampling = Sampling()
    lad: str | None = None  # the LoopAhead drafter: a drafter file or a train_lad workdir
    step_cost: bool = True  # measure the step-cost curve (lookahead methods only)
    check_auto: bool = False
    seeding: bool = False  # prompt seeding of --check_auto's choice
    fit: str | None = None  # --check_auto: a stored fit instead of this run's
    auto_grid: Sequence[tuple[int, int, int]] | None = None  # --check_auto's candidates
    fit_out: str | None = None  # also write this run's fits here (for decode --auto_fit)
    progress: bool = True
    plots: bool = True
    config: str = ""


class Progress:
    """tqdm over generations when available and enabled, else nothing."""

    def __init__(self, total: int, enabled: bool):
        self.bar = None
        if enabled:
            try:
                from tqdm import tqdm  # noqa: PLC0415
                self.bar = tqdm(total=total, unit="gen", file=sys.stderr, dynamic_ncols=True)
            except ImportError:
                pass

    def step(self, text: str) -> None:
        if self.bar is not None:
            self.bar.set_description(text, refresh=False)
            self.bar.update(1)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def _record(ds: str, i: int, spec: MethodSpec, method: Method, res, plain_tokens,
            r_full: int | None) -> dict:
    """One run's JSON record; `sampling` is what the method actually decoded with."""
    st = res.stats
    cfg = spec.lookahead
    rec = {"dataset": ds, "prompt": i, "method": spec.label, "tokens": st.total_tokens,
           "steps": st.steps, "prefill_s": st.prefill_s, "decode_s": st.decode_s,
           "compile_s": st.compile_s, "sampling": dataclasses.asdict(method.sampling),
           "exact": (res.tokens == plain_tokens) if method.sampling.greedy else None,
           "accepted_hist": st.extra.get("accepted_hist"),
           "W": cfg and cfg.W, "N": cfg and cfg.N, "G": cfg and cfg.G,
           "prompt_seeding": bool(cfg and cfg.prompt_seeding),
           "step_tokens": cfg.step_tokens if cfg else 1}
    if r_full is not None:
        rec["loops"], rec["advances"], rec["verified"] = loop_counts(method, res, r_full)
        rec["capacity"] = st.extra.get("capacity", 1)  # tree nodes per step (plain: 1 token)
    return rec


def measure_pairs(engine, prompts: dict[str, list[list[int]]], specs: Sequence[MethodSpec],
                  opts: SuiteOptions, *, on_prompt: Callable[[list[dict]], None] | None = None,
                  progress: Progress | None = None) -> list[dict]:
    """Per prompt (data sets interleaved): plain decoding, then every spec, on the same ids,
    every method built by the registry with opts.sampling. Returns one record per (prompt,
    method); `on_prompt(records so far)` after each prompt."""
    looped = isinstance(engine.config, LoopedConfig)
    r_full = engine.config.num_loops if looped else None
    built = build_methods(engine, specs, opts.sampling, opts.lad)
    runs: list[dict] = []
    n_max = max((len(p) for p in prompts.values()), default=0)
    for i in range(n_max):
        for ds, ids_list in prompts.items():
            if i >= len(ids_list):
                continue
            plain = None
            for spec in specs:
                method = built[spec.label]
                res = engine.generate_ids([ids_list[i]], method=method,
                                          max_new_tokens=opts.max_new_tokens, seed=i)
                if spec.name == "ar":  # specs start with plain decoding
                    plain = res
                runs.append(_record(ds, i, spec, method, res, plain.tokens, r_full))
                if progress is not None:
                    progress.step(f"{ds} {i + 1}/{len(ids_list)} {spec.label}")
            if on_prompt is not None:
                on_prompt(runs)
    return runs


def _auto_measured(engine, prompts, rows: list[dict], spec: MethodSpec, opts: SuiteOptions,
                   progress_enabled: bool) -> tuple[dict[str, dict], list[dict], list[str]]:
    """Summary rows of `spec` per data set: from `rows` where the run measured it, else
    measured now beside plain decoding. -> (rows by data set, the extra runs, data sets
    measured now)."""
    measured = {r["dataset"]: r for r in rows if r["method"] == spec.label}
    todo = {ds: p for ds, p in prompts.items() if ds not in measured}
    extra_runs: list[dict] = []
    if todo:
        progress = Progress(sum(len(p) for p in todo.values()) * 2, progress_enabled)
        extra_runs = measure_pairs(engine, todo, [MethodSpec("ar"), spec], opts,
                                   progress=progress)
        progress.close()
        for r in common.summarize_runs(extra_runs):
            if r["method"] == spec.label:
                measured[r["dataset"]] = r
    return measured, extra_runs, sorted(todo)


def auto_check(engine, prompts, rows: list[dict], step_costs: dict[int, float],
               fit_, opts: SuiteOptions, progress_enabled: bool) -> dict:
    """--check_auto: the settings --auto picks (fit_, this run's step-cost curve), their
    measured speed-up (from the run when it measured them, else measured now beside plain on
    the same prompts) against the best measured lookahead speed-up of each data set."""
    grid = list(opts.auto_grid) if opts.auto_grid else auto.candidate_grid()
    ranked = auto.rank(fit_, step_costs, grid, devices=getattr(engine, "devices", 1) or 1)
    b = ranked[0]
    cfg = LookaheadConfig(W=b.W, N=b.N, G=b.G, prompt_seeding=opts.seeding)
    spec = MethodSpec("lookahead", cfg)
    measured, extra_runs, todo = _auto_measured(engine, prompts, rows, spec, opts,
                                                progress_enabled)
    per_ds = {}
    for ds in prompts:
        best = max((r for r in rows if r["dataset"] == ds and r.get("W") is not None),
                   key=lambda r: r["speedup"], default=None)
        mine = measured.get(ds)
        if best is None or mine is None:
            continue
        if mine["speedup"] > best["speedup"]:
            best = mine
        ratio = mine["speedup"] / best["speedup"]
        per_ds[ds] = {"auto": spec.label, "auto_speedup": mine["speedup"],
                      "auto_S": mine["S"], "best": best["method"],
                      "best_speedup": best["speedup"], "ratio": ratio,
                      "within_10pct": ratio >= 1 - AUTO_TOLERANCE,
                      "exact": mine["exact"], "prompts": mine["prompts"]}
    return {"choice": dataclasses.asdict(cfg), "label": spec.label,
            "fit": fit_.to_dict(), "predicted": dataclasses.asdict(b),
            "candidates": [dataclasses.asdict(c) for c in ranked[:10]],
            "measured_separately": todo, "datasets": per_ds,
            "passed": bool(per_ds) and all(v["within_10pct"] for v in per_ds.values()),
            "runs": extra_runs}


def _select_specs(opts: SuiteOptions, looped: bool) -> tuple[list[MethodSpec], list[str]]:
    """The specs that apply to this kind of model (plain first: the baseline), and why the
    others were skipped."""
    specs, skipped = [], []
    for spec in opts.methods:
        why = applicable(spec, looped)
        if why:
            skipped.append(why)
        elif spec.name != "ar":
            specs.append(spec)
    return [MethodSpec("ar")] + specs, skipped


def _load_prompts(engine, opts: SuiteOptions) -> dict[str, list[list[int]]]:
    for ds in opts.datasets:
        if ds not in common.PROMPT_SETS:
            raise SuiteError(f"unknown data set {ds!r}: {', '.join(common.PROMPT_SETS)}")
    prompts = {ds: common.encoded_prompts(engine, ds, opts.num_prompts, opts.data_dir)
               for ds in opts.datasets}
    prompts = {ds: p for ds, p in prompts.items() if p}
    if not prompts:
        raise SuiteError("no prompts: every data set is empty")
    return prompts


def _step_costs(engine, prompts, specs: Sequence[MethodSpec], opts: SuiteOptions,
                report: dict, log: Callable[[str], None]) -> dict[int, float]:
    """The step-cost curve at the token counts of the lookahead specs (and --check_auto's
    grid), at the middle of a typical generation; recorded in `report`. {} when not asked."""
    grid = [(s.lookahead.W, s.lookahead.N, s.lookahead.G) for s in specs
            if s.lookahead is not None]
    if opts.check_auto:
        grid += list(opts.auto_grid) if opts.auto_grid else auto.candidate_grid()
    if not grid or not (opts.step_cost or opts.check_auto):
        return {}
    ts = auto.tokens_to_measure(grid)
    lengths = [len(p) for ps in prompts.values() for p in ps]
    cache_len = int(statistics.median(lengths)) + opts.max_new_tokens // 2
    log(f"step-cost curve at cache length {cache_len}: {ts} tokens per step ...")
    step_costs = measure_step_cost(engine.graphdef, engine.params, ts, cache_len=cache_len)
    report["step_cost_s"] = {str(k): v for k, v in step_costs.items()}
    report["step_cost_cache_len"] = cache_len
    return step_costs


def _add_fits(report: dict, step_costs: dict[int, float], opts: SuiteOptions,
              log: Callable[[str], None]) -> dict:
    """Fits the scaling law to the summary rows, annotates each row with its law prediction
    and curve cost, and writes the fits to opts.fit_out when asked. -> the fits by name."""
    rows = report["summary"]
    fits = fit_rows(rows)
    report["fits"] = {k: v.to_dict() for k, v in fits["fits"].items()}
    if fits["notes"]:
        report["fit_notes"] = fits["notes"]
    for r in rows:
        f = fits["fits"].get(r["dataset"])
        if r.get("W") is not None and f is not None:
            r["S_law"] = float(f.predict_S(r["W"], r["N"], r["G"]))
        if r.get("W") is not None and step_costs:
            r["curve_cost"] = relative_cost(step_costs, r["step_tokens"])
    if opts.fit_out and fits["fits"]:
        save_fits(opts.fit_out, fits["fits"], config=opts.config,
                  machine=report["machine"], max_new_tokens=opts.max_new_tokens,
                  num_prompts=opts.num_prompts, datasets=report["datasets"],
                  step_cost_s=report.get("step_cost_s"),
                  points=[{k: r[k] for k in ("dataset", "method", "W", "N", "G", "S", "prompts",
                                              "speedup")}
                          for r in rows if r.get("W") is not None])
        log(f"scaling-law fits: {opts.fit_out}")
    return fits["fits"]


def run_suite(engine, opts: SuiteOptions, log: Callable[[str], None] = print) -> dict:
    """Runs the suite on a loaded engine; writes JSON, Markdown and plots; returns the report."""
    if opts.num_prompts < 1 or opts.max_new_tokens < 1:
        raise SuiteError("--num_prompts and --max_new_tokens must be >= 1")
    looped = isinstance(engine.config, LoopedConfig)
    if opts.check_auto and looped:
        raise SuiteError("--check_auto applies to lookahead decoding (a Llama-family preset)")
    specs, skipped = _select_specs(opts, looped)
    for why in skipped:
        log(f"skipped: {why}")
    prompts = _load_prompts(engine, opts)
    report: dict[str, Any] = {
        "config": opts.config, "machine": common.machine_info(),
        "sampling": dataclasses.asdict(opts.sampling), "max_new_tokens": opts.max_new_tokens,
        "num_prompts": opts.num_prompts, "datasets": list(prompts),
        "methods": [s.label for s in specs], "skipped": skipped, "runs": []}
    step_costs = {} if looped else _step_costs(engine, prompts, specs, opts, report, log)

    def save(runs):
        report["runs"] = runs
        report["summary"] = common.summarize_runs(runs)
        common.write_json(opts.out, report)

    t0 = time.time()
    progress = Progress(sum(len(p) for p in prompts.values()) * len(specs), opts.progress)
    try:
        runs = measure_pairs(engine, prompts, specs, opts, on_prompt=save, progress=progress)
    finally:
        progress.close()
    save(runs)
    report["wall_s"] = time.time() - t0
    report["compile_s"] = sum(r.get("compile_s", 0.0) for r in runs)
    fits = _add_fits(report, step_costs, opts, log)
    if opts.check_auto:  # a stored fit, else this run's pooled fit, else --auto's default
        fit_ = load_fit(opts.fit) if opts.fit else fits.get("all") or auto.resolve_fit(None)
        report["auto_check"] = auto_check(engine, prompts, report["summary"], step_costs,
                                          fit_, opts, opts.progress)
    _write_outputs(report, fits, step_costs, opts, log)
    return report


def _write_outputs(report: dict, fits: dict, step_costs: dict[int, float],
                   opts: SuiteOptions, log: Callable[[str], None]) -> None:
    """The JSON report, its Markdown table (`.md` beside it) and, with opts.plots, the PNGs."""
    common.write_json(opts.out, report)
    stem = os.path.splitext(opts.out)[0]
    md = markdown_report(report)
    with open(stem + ".md", "w", encoding="utf-8") as f:
        f.write(md + "\n")
    log(md)
    if opts.plots:
        from benchmarks.plots import suite_plots  # noqa: PLC0415  (matplotlib: only when asked)
        for path in suite_plots(report, fits, step_costs, stem):
            log(f"plot: {path}")
    log(f"JSON: {opts.out}; Markdown: {stem}.md")
