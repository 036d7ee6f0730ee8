"""One benchmark command: data sets x decoding methods, each prompt decoded by plain greedy
decoding and then by every method, side by side in one run.

    python -m benchmarks.suite --num_prompts=20 \\
        --methods=ar,lookahead:15,5,15,lookahead:7,5,7,lookahead:5,3,5,prompt_lookup
    python -m benchmarks.suite --datasets=mt_bench,humaneval,gsm8k --num_prompts=10 \\
        --sweep=1,2,3,5,7,10,15 --sweep_N=5 --check_auto        # W sweep, fit, --auto check
    python -m benchmarks.suite --config=tiny_ouro --methods=ar,loopspec,loopahead --lad=<dir>

Data sets: mt_bench (turn 1), humaneval, gsm8k, mbpp, classeval (`benchmarks/common.py`).
Methods (`--methods`, commas; a method's own numbers follow its colon):
  ar / plain            plain autoregressive decoding (always run first: the baseline)
  lookahead             the preset's lookahead settings
  lookahead:W,N,G       lookahead at those settings; append +prompt for prompt seeding
  prompt_lookup[:K[,M]] prompt lookup decoding (K draft tokens, suffixes up to M tokens)
  loopspec, loopspec_d2, loopahead, loopahead_nodrafter, loopahead_nosched
                        looped presets only (`benchmarks/looped_bench.py`; --lad: the drafter)
A method that does not apply to the preset (lookahead on a looped model, LoopSpec on Llama) is
skipped with a note.

Reported per data set x method: prompts, steps, tokens, S = tokens / steps (prefill counted),
S predicted by the fitted scaling law, ms per step, tokens/s (prefill + decode; compile
excluded), speed-up over plain, exactness against plain greedy (outputs equal token for
token), and for looped models loops per token. Written as JSON (after every prompt, so a
stopped run keeps what it measured), a Markdown table (`.md` beside it) and plots (`_sweep.png`:
S and speed-up against W with the fitted law beside the points, when the lookahead settings
form a W sweep; `_fit.png`: measured against predicted S; `_hist.png`: accepted-length
histograms per method).

`--sweep=W1,W2,...` runs lookahead at every W with G = W and N from `--sweep_N`, fits the
scaling law per data set and over all of them, and writes the fit for `decode --auto`
(`--fit_out`, default benchmarks/results/scaling_fit.json). `--check_auto` then picks settings
the way `--auto` does (the pooled fit, or `--fit`; this run's step-cost curve), measures them
beside plain decoding on the same prompts if the sweep did not already, and reports whether
their speed-up is within 10% of the best measured lookahead setting on each data set.
"""

from __future__ import annotations

import dataclasses
import os
import statistics
import sys
import time
from typing import Any, Callable, Sequence

from absl import app, flags

from benchmarks import common
from lookahead_jax.config import LookaheadConfig
from lookahead_jax.sampling import Sampling

FLAGS = flags.FLAGS
LOOKAHEAD_DEFAULT = "ar,lookahead:15,5,15,lookahead:7,5,7,lookahead:5,3,5,prompt_lookup"
LOOPED_DEFAULT = "ar,loopspec,loopahead"
LOOPED_NAMES = ("loopspec", "loopspec_d2", "loopahead", "loopahead_nodrafter",
                "loopahead_nosched")
AUTO_TOLERANCE = 0.10  # --check_auto passes when auto's speed-up >= (1 - this) x the best


class SuiteError(Exception):
    """Bad suite settings (methods, sweep, data sets); the message says which and why."""


# -- methods -------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class MethodSpec:
    """One method of the suite: `name` (ar | lookahead | prompt_lookup | a looped method),
    its lookahead settings or its own numbers (`args`), and the label it is reported under."""

    name: str
    lookahead: LookaheadConfig | None = None
    args: tuple[int, ...] = ()

    @property
    def label(self) -> str:
        if self.name == "ar":
            return "plain"
        if self.name == "lookahead" and self.lookahead is not None:
            c = self.lookahead
            return f"lookahead ({c.W},{c.N},{c.G})" + (" +prompt" if c.prompt_seeding else "")
        if self.args:
            return f"{self.name}:{','.join(str(a) for a in self.args)}"
        return self.name

    @property
    def looped(self) -> bool:
        return self.name in LOOPED_NAMES


def _split_methods(text: str) -> list[str]:
    """"ar,lookahead:15,5,15,prompt_lookup" -> ["ar", "lookahead:15,5,15", "prompt_lookup"]:
    a bare number (or number+suffix) continues the method before it."""
    out: list[str] = []
    for tok in (t.strip() for t in text.replace(";", ",").split(",")):
        if not tok:
            continue
        if tok[0].isdigit() and out:
            out[-1] += "," + tok
        else:
            out.append(tok)
    return out


def parse_methods(text: str, preset_lookahead: LookaheadConfig | None = None) -> list[MethodSpec]:
    """The --methods string -> MethodSpecs (plain first, each method once)."""
    from models.config import ConfigError  # noqa: PLC0415
    specs = [MethodSpec("ar")]
    for item in _split_methods(text):
        seeded = item.endswith("+prompt")
        name, _, rest = (item[: -len("+prompt")] if seeded else item).partition(":")
        name = name.strip().lower()
        try:
            nums = tuple(int(x) for x in rest.split(",")) if rest else ()
        except ValueError:
            raise SuiteError(f"--methods: bad numbers in {item!r}") from None
        if name in ("ar", "plain"):
            if nums:
                raise SuiteError(f"--methods: {item!r}: plain decoding takes no settings")
            continue
        if name == "lookahead":
            if nums and len(nums) != 3:
                raise SuiteError(f"--methods: {item!r}: expected lookahead:W,N,G")
            base = preset_lookahead or LookaheadConfig()
            try:
                cfg = (LookaheadConfig(W=nums[0], N=nums[1], G=nums[2], prompt_seeding=seeded)
                       if nums else dataclasses.replace(base, prompt_seeding=seeded
                                                        or base.prompt_seeding))
            except ConfigError as e:
                raise SuiteError(f"--methods: {item!r}: {e}") from None
            spec = MethodSpec("lookahead", cfg)
        elif name == "prompt_lookup":
            if len(nums) > 2 or any(n < 1 for n in nums):
                raise SuiteError(f"--methods: {item!r}: expected prompt_lookup[:K[,M]] with "
                                 f"K draft tokens and M the longest suffix, both >= 1")
            spec = MethodSpec("prompt_lookup", args=nums)
        elif name in LOOPED_NAMES:
            if nums or seeded:
                raise SuiteError(f"--methods: {item!r}: {name} takes no settings here")
            spec = MethodSpec(name)
        else:
            raise SuiteError(f"--methods: unknown method {name!r} (ar, lookahead[:W,N,G], "
                             f"prompt_lookup[:K[,M]], {', '.join(LOOPED_NAMES)})")
        if seeded and name != "lookahead":
            raise SuiteError(f"--methods: {item!r}: +prompt applies to lookahead only")
        if spec not in specs:
            specs.append(spec)
    return specs


def sweep_methods(Ws: Sequence[int], Ns: Sequence[int], seeding: bool = False) -> list[MethodSpec]:
    """Lookahead at every (W, N) with G = W: the settings of a W sweep (the paper's Figure 8)."""
    from models.config import ConfigError  # noqa: PLC0415
    out = []
    for n in Ns:
        for w in Ws:
            try:
                out.append(MethodSpec("lookahead", LookaheadConfig(W=int(w), N=int(n), G=int(w),
                                                                   prompt_seeding=seeding)))
            except ConfigError as e:
                raise SuiteError(f"--sweep: W={w}, N={n}: {e}") from None
    return out


def applicable(spec: MethodSpec, looped_model: bool) -> str | None:
    """None if `spec` runs on this kind of model, else why not."""
    if spec.name == "ar":
        return None
    if looped_model and not spec.looped:
        return f"{spec.label} needs a Llama-family preset"
    if spec.looped and not looped_model:
        return f"{spec.label} needs a looped preset (e.g. --config=tiny_ouro)"
    return None


def build_methods(engine, specs: Sequence[MethodSpec], sampling: Sampling,
                  lad: str | None = None) -> dict[str, Any]:
    """label -> what `engine.generate_ids(method=...)` takes for each spec."""
    out: dict[str, Any] = {}
    looped = None
    for spec in specs:
        if spec.name == "ar":
            out[spec.label] = "ar"
        elif spec.name == "lookahead":
            out[spec.label] = "lookahead"
        elif spec.name == "prompt_lookup":
            if spec.args:
                from lookahead_jax.prompt_lookup import PromptLookup  # noqa: PLC0415
                kw = {"num_tokens": spec.args[0]}
                if len(spec.args) > 1:
                    kw["max_ngram"] = spec.args[1]
                out[spec.label] = PromptLookup(sampling, **kw)
            else:
                out[spec.label] = "prompt_lookup"
        else:
            if looped is None:
                from benchmarks.looped_bench import methods  # noqa: PLC0415
                looped = methods(engine.config.num_loops, lad, engine.config)
            if spec.name in looped:
                out[spec.label] = looped[spec.name]
            elif spec.name == "loopahead":  # no drafter given: native proposals only
                out[spec.label] = "loopahead"
            else:
                raise SuiteError(f"{spec.name} needs --lad (a train_lad work directory)")
    return out


# -- the run -------------------------------------------------------------------------------------
@dataclasses.dataclass
class SuiteOptions:
    """Everything one suite run needs (`options_from_flags` fills it from the command line)."""

    methods: list[MethodSpec]
    datasets: Sequence[str] = ("mt_bench", "humaneval", "gsm8k")
    num_prompts: int = 20
    max_new_tokens: int = 128
    data_dir: str | None = None
    out: str = "benchmarks/results/suite.json"
    sampling: Sampling = Sampling()
    lad: str | None = None
    step_cost: bool = True  # measure the step-cost curve (lookahead methods only)
    check_auto: bool = False
    seeding: bool = False  # prompt seeding of --check_auto's choice
    fit: str | None = None  # --check_auto: a stored fit instead of this run's
    auto_grid: Sequence[tuple[int, int, int]] | None = None  # --check_auto's candidates
    fit_out: str | None = None  # write this run's fits here (sweep mode)
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


def _record(ds: str, i: int, label: str, spec: MethodSpec | None, res, plain_tokens,
            greedy: bool, r_full: int | None, method) -> dict:
    st = res.stats
    cfg = spec.lookahead if spec is not None else None
    rec = {"dataset": ds, "prompt": i, "method": label, "tokens": st.total_tokens,
           "steps": st.steps, "prefill_s": st.prefill_s, "decode_s": st.decode_s,
           "compile_s": st.compile_s,
           "exact": (res.tokens == plain_tokens) if greedy else None,
           "accepted_hist": st.extra.get("accepted_hist"),
           "W": cfg and cfg.W, "N": cfg and cfg.N, "G": cfg and cfg.G,
           "prompt_seeding": bool(cfg and cfg.prompt_seeding),
           "step_tokens": cfg.step_tokens if cfg else 1}
    if r_full is not None:
        from benchmarks.looped_bench import loop_counts  # noqa: PLC0415
        rec["loops"], rec["advances"], rec["verified"] = loop_counts(method, res, r_full)
    return rec


def measure_pairs(engine, prompts: dict[str, list[list[int]]], specs: Sequence[MethodSpec],
                  opts: SuiteOptions, *, on_prompt: Callable[[list[dict]], None] | None = None,
                  progress: Progress | None = None) -> list[dict]:
    """Per prompt (data sets interleaved): plain decoding, then every spec, on the same ids.
    Returns one record per (prompt, method); `on_prompt(records so far)` after each prompt."""
    from models.looped import LoopedConfig  # noqa: PLC0415
    looped = isinstance(engine.config, LoopedConfig)
    r_full = engine.config.num_loops if looped else None
    built = build_methods(engine, specs, opts.sampling, opts.lad)
    runs: list[dict] = []
    n_max = max((len(p) for p in prompts.values()), default=0)
    for i in range(n_max):
        for ds, ids_list in prompts.items():
            if i >= len(ids_list):
                continue
            ids = ids_list[i]
            kw = dict(max_new_tokens=opts.max_new_tokens, sampling=opts.sampling, seed=i)
            plain = None
            for spec in specs:
                method = built[spec.label]
                res = engine.generate_ids([ids], method=method, lookahead=spec.lookahead, **kw)
                if spec.name == "ar":
                    plain = res
                runs.append(_record(ds, i, spec.label, spec, res, plain.tokens,
                                    opts.sampling.greedy, r_full, method))
                if progress is not None:
                    progress.step(f"{ds} {i + 1}/{len(ids_list)} {spec.label}")
            if on_prompt is not None:
                on_prompt(runs)
    return runs


def _lookahead_points(rows: list[dict], dataset: str | None = None) -> tuple[list, list]:
    from lookahead_jax.scaling_law import points_from_summary  # noqa: PLC0415
    return points_from_summary(rows, dataset=dataset, prompt_seeding=None)


def fit_rows(rows: list[dict]) -> dict[str, Any]:
    """Scaling-law fits of the lookahead rows: one per data set and "all" (pooled), where at
    least two settings with different (N, G) were measured. Rows mixing prompt seeding on and
    off are fitted together (the fit's `source` says so)."""
    from lookahead_jax.scaling_law import fit  # noqa: PLC0415
    fits, notes = {}, {}
    groups = sorted({r["dataset"] for r in rows}) + ["all"]
    for name in groups:
        pts, weights = _lookahead_points(rows, None if name == "all" else name)
        if len({(p[1], p[2]) for p in pts}) < 2:
            continue
        try:
            fits[name] = fit(pts, weights, source=f"{name}: {len(pts)} settings")
        except ValueError as e:
            notes[name] = str(e)
    return {"fits": fits, "notes": notes}


def auto_check(engine, prompts, rows: list[dict], step_costs: dict[int, float],
               fit_, opts: SuiteOptions, progress_enabled: bool) -> dict:
    """--check_auto: the settings --auto picks (fit_, this run's step-cost curve), their
    measured speed-up (from the run when it measured them, else measured now beside plain on
    the same prompts) against the best measured lookahead speed-up of each data set."""
    from lookahead_jax import auto  # noqa: PLC0415
    base = LookaheadConfig(prompt_seeding=opts.seeding)
    grid = list(opts.auto_grid) if opts.auto_grid else auto.candidate_grid()
    ranked = auto.rank(fit_, step_costs, grid, devices=getattr(engine, "devices", 1) or 1)
    b = ranked[0]
    cfg = dataclasses.replace(base, W=b.W, N=b.N, G=b.G)
    spec = MethodSpec("lookahead", cfg)
    measured = {r["dataset"]: r for r in rows if r["method"] == spec.label}
    extra_runs: list[dict] = []
    todo = {ds: p for ds, p in prompts.items() if ds not in measured}
    if todo:
        progress = Progress(sum(len(p) for p in todo.values()) * 2, progress_enabled)
        extra_runs = measure_pairs(engine, todo, [MethodSpec("ar"), spec], opts,
                                   progress=progress)
        progress.close()
        for r in common.summarize_runs(extra_runs):
            if r["method"] == spec.label:
                measured[r["dataset"]] = r
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
            "measured_separately": sorted(todo), "datasets": per_ds,
            "passed": bool(per_ds) and all(v["within_10pct"] for v in per_ds.values()),
            "runs": extra_runs}


def _step_cost_tokens(specs: Sequence[MethodSpec], opts: SuiteOptions) -> list[int]:
    from lookahead_jax import auto  # noqa: PLC0415
    grid = [(s.lookahead.W, s.lookahead.N, s.lookahead.G) for s in specs
            if s.lookahead is not None]
    if opts.check_auto:
        grid += list(opts.auto_grid) if opts.auto_grid else auto.candidate_grid()
    return auto.tokens_to_measure(grid) if grid else []


def run_suite(engine, opts: SuiteOptions, log: Callable[[str], None] = print) -> dict:
    """Runs the suite on a loaded engine; writes JSON, Markdown and plots; returns the report."""
    from lookahead_jax.step_cost import measure_step_cost, relative_cost  # noqa: PLC0415
    from models.looped import LoopedConfig  # noqa: PLC0415
    if opts.num_prompts < 1 or opts.max_new_tokens < 1:
        raise SuiteError("--num_prompts and --max_new_tokens must be >= 1")
    looped = isinstance(engine.config, LoopedConfig)
    specs, skipped = [], []
    for spec in opts.methods:
        why = applicable(spec, looped)
        if why:
            skipped.append(why)
        else:
            specs.append(spec)
    for why in skipped:
        log(f"skipped: {why}")
    specs = [MethodSpec("ar")] + [s for s in specs if s.name != "ar"]  # plain first: baseline
    if opts.check_auto and looped:
        raise SuiteError("--check_auto applies to lookahead decoding (a Llama-family preset)")
    for ds in opts.datasets:
        if ds not in common.PROMPT_SETS:
            raise SuiteError(f"unknown data set {ds!r}: {', '.join(common.PROMPT_SETS)}")
    prompts = {ds: common.encoded_prompts(engine, ds, opts.num_prompts, opts.data_dir)
               for ds in opts.datasets}
    prompts = {ds: p for ds, p in prompts.items() if p}
    if not prompts:
        raise SuiteError("no prompts: every data set is empty")

    report: dict[str, Any] = {
        "config": opts.config, "machine": common.machine_info(),
        "sampling": dataclasses.asdict(opts.sampling), "max_new_tokens": opts.max_new_tokens,
        "num_prompts": opts.num_prompts, "datasets": list(prompts),
        "methods": [s.label for s in specs], "skipped": skipped, "runs": []}
    stem = os.path.splitext(opts.out)[0]

    step_costs: dict[int, float] = {}
    ts = _step_cost_tokens(specs, opts) if (opts.step_cost or opts.check_auto) \
        and not looped else []
    if ts:
        lengths = [len(p) for ps in prompts.values() for p in ps]
        cache_len = int(statistics.median(lengths)) + opts.max_new_tokens // 2
        log(f"step-cost curve at cache length {cache_len}: {ts} tokens per step ...")
        step_costs = measure_step_cost(engine.graphdef, engine.params, ts, cache_len=cache_len)
        report["step_cost_s"] = {str(k): v for k, v in step_costs.items()}
        report["step_cost_cache_len"] = cache_len

    def save(runs):
        report["runs"] = runs
        report["summary"] = common.summarize_runs(runs)
        common.write_json(opts.out, report)

    t0 = time.time()
    total = sum(len(p) for p in prompts.values()) * len(specs)
    progress = Progress(total, opts.progress)
    try:
        runs = measure_pairs(engine, prompts, specs, opts, on_prompt=save, progress=progress)
    finally:
        progress.close()
    save(runs)
    rows = report["summary"]
    report["wall_s"] = time.time() - t0
    report["compile_s"] = sum(r.get("compile_s", 0.0) for r in runs)

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
        from lookahead_jax.scaling_law import save_fits  # noqa: PLC0415
        save_fits(opts.fit_out, fits["fits"], config=opts.config,
                  machine=report["machine"], max_new_tokens=opts.max_new_tokens,
                  num_prompts=opts.num_prompts, datasets=list(prompts),
                  step_cost_s=report.get("step_cost_s"),
                  points=[{k: r[k] for k in ("dataset", "method", "W", "N", "G", "S", "prompts",
                                              "speedup")}
                          for r in rows if r.get("W") is not None])
        log(f"scaling-law fits: {opts.fit_out}")

    if opts.check_auto:
        from lookahead_jax.auto import resolve_fit  # noqa: PLC0415
        from lookahead_jax.scaling_law import load_fit  # noqa: PLC0415
        if opts.fit:
            fit_ = load_fit(opts.fit)
        else:  # this run's pooled fit, else what --auto would use
            fit_ = fits["fits"].get("all") or resolve_fit(None)
        report["auto_check"] = auto_check(engine, prompts, rows, step_costs, fit_, opts,
                                          opts.progress)
    common.write_json(opts.out, report)

    md = markdown_report(report)
    with open(stem + ".md", "w", encoding="utf-8") as f:
        f.write(md + "\n")
    log(md)
    if opts.plots:
        for path in write_plots(report, fits["fits"], step_costs, stem):
            log(f"plot: {path}")
    log(f"JSON: {opts.out}; Markdown: {stem}.md")
    return report


# -- output --------------------------------------------------------------------------------------
def markdown_report(report: dict) -> str:
    """The results as Markdown: the main table, then fits and the --check_auto verdict."""
    rows = report["summary"]
    looped = any("loops_per_token" in r for r in rows)
    law = any("S_law" in r for r in rows)
    headers = ["data set", "method", "prompts", "exact", "steps", "tokens", "S"]
    headers += ["S (law)"] if law else []
    headers += ["ms/step", "tokens/s", "speed-up"]
    headers += ["loops/token", "loops/token vs plain", "advances/token"] if looped else []
    plain_loops = {r["dataset"]: r.get("loops_per_token") for r in rows if r["method"] == "plain"}
    table = []
    for r in rows:
        exact = "n/a (sampling)" if r["exact"] is None else f"{r['exact']}/{r['prompts']}"
        line = [r["dataset"], r["method"], r["prompts"], exact, r["steps"], r["tokens"], r["S"]]
        line += [r.get("S_law", "")] if law else []
        line += [r["step_ms"], r["tokens_per_s"],
                 f"{r['speedup']:.2f}x" if r.get("speedup") is not None else ""]
        if looped:
            lpt, base = r.get("loops_per_token"), plain_loops.get(r["dataset"])
            line += [lpt if lpt is not None else "", round(lpt / base, 3) if lpt and base else "",
                     r.get("advances_per_token", "")]
        table.append(line)
    m = report["machine"]
    out = [f"# Benchmark suite: {report.get('config') or 'engine'}", "",
           f"{m.get('jax_backend')} ({m.get('processor')}, {m.get('cpus')} CPUs), "
           f"{report['max_new_tokens']} new tokens, first {report['num_prompts']} prompts per "
           f"data set, sampling {report['sampling']}; compile time excluded "
           f"({report.get('compile_s', 0):.0f}s).", "", common.markdown_table(headers, table)]
    if report.get("skipped"):
        out += ["", "Skipped: " + "; ".join(report["skipped"]) + "."]
    if report.get("fits"):
        out += ["", "Scaling law S = (f - 1 + E(a, N-1, G)) / f, fitted:", ""]
        out.append(common.markdown_table(
            ["data set", "a", "f", "rmse of S", "settings"],
            [[k, v["a"], v["f"], v["rmse"] if v["rmse"] is not None else "", v["points"]]
             for k, v in report["fits"].items()]))
    chk = report.get("auto_check")
    if chk:
        p = chk["predicted"]
        out += ["", f"--auto picks {chk['label']} (a={chk['fit']['a']:.3f}, "
                    f"f={chk['fit']['f']:.2f}; predicted S {p['S']:.2f}, step cost "
                    f"{p['cost']:.2f}, speed-up {p['speedup']:.2f}x):", ""]
        out.append(common.markdown_table(
            ["data set", "auto speed-up", "best measured", "its speed-up", "auto / best",
             "within 10%"],
            [[ds, f"{v['auto_speedup']:.2f}x", v["best"], f"{v['best_speedup']:.2f}x",
              v["ratio"], "yes" if v["within_10pct"] else "NO"]
             for ds, v in chk["datasets"].items()]))
        out += ["", f"--auto check: {'passed' if chk['passed'] else 'FAILED'}"]
    return "\n".join(out)


def _sweep_groups(rows: list[dict]) -> dict[tuple[int, bool], list[dict]]:
    """(N, prompt seeding) -> lookahead rows with G = W, where >= 3 distinct W were measured."""
    groups: dict[tuple[int, bool], list[dict]] = {}
    for r in rows:
        if r.get("W") is not None and r["G"] == r["W"]:
            groups.setdefault((r["N"], bool(r.get("prompt_seeding"))), []).append(r)
    return {k: v for k, v in groups.items() if len({r["W"] for r in v}) >= 3}


def write_plots(report: dict, fits: dict, step_costs: dict[int, float], stem: str) -> list[str]:
    """The sweep, fit and histogram PNGs that apply to this report; returns their paths."""
    import matplotlib  # noqa: PLC0415
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415
    import numpy as np  # noqa: PLC0415
    from matplotlib.ticker import MaxNLocator  # noqa: PLC0415

    from lookahead_jax.step_cost import relative_cost  # noqa: PLC0415
    rows = report["summary"]
    paths = []
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    datasets = report["datasets"]

    sweeps = _sweep_groups(rows)
    if sweeps:
        fig, (ax0, ax1) = plt.subplots(1, 2, figsize=(11, 4.2))
        for k, ds in enumerate(datasets):
            color = colors[k % len(colors)]
            for (n, seeded), grp in sorted(sweeps.items()):
                pts = sorted((r["W"], r["S"], r["speedup"]) for r in grp if r["dataset"] == ds)
                if not pts:
                    continue
                tag = f"{ds} N={n}" + (" +prompt" if seeded else "")
                w = [p[0] for p in pts]
                ax0.plot(w, [p[1] for p in pts], "o", color=color, label=f"{tag} measured")
                ax1.plot(w, [p[2] for p in pts], "o-", color=color, label=f"{tag} measured")
                fit_ = fits.get(ds)
                if fit_ is not None:
                    ws = np.arange(1, max(w) + 1)
                    s_law = np.atleast_1d(fit_.predict_S(ws, n, ws))
                    ax0.plot(ws, s_law, "-", color=color, lw=1.2,
                             label=f"{tag} law a={fit_.a:.2f} f={fit_.f:.2f}")
                    if step_costs:
                        cost = [relative_cost(step_costs, (n - 1) * 2 * int(x)) for x in ws]
                        ax1.plot(ws, s_law / np.asarray(cost), "--", color=color, lw=1.0,
                                 label=f"{tag} law / step-cost curve")
        ax0.set(xlabel="W (G = W)", ylabel="step compression S", title="S against W")
        ax1.axhline(1.0, color="gray", lw=0.8)
        ax1.set(xlabel="W (G = W)", ylabel="speed-up over plain (wall clock)",
                title="speed-up against W")
        for ax in (ax0, ax1):
            ax.xaxis.set_major_locator(MaxNLocator(integer=True))
            ax.grid(alpha=0.3)
            ax.legend(fontsize=7)
        fig.tight_layout()
        paths.append(stem + "_sweep.png")
        fig.savefig(paths[-1], dpi=120)
        plt.close(fig)

    if fits:
        from lookahead_jax.scaling_law import plot_fit  # noqa: PLC0415
        groups = {}
        for ds in datasets:
            pts, _ = _lookahead_points(rows, ds)
            if pts and ds in fits:
                groups[ds] = (pts, fits[ds])
            elif pts and "all" in fits:  # too few settings (or S never above 1) for its own
                groups[f"{ds} (pooled fit)"] = (pts, fits["all"])
        if groups:
            paths.append(plot_fit(groups, stem + "_fit.png",
                                  title="scaling law: fitted per data set"))

    hist_rows = [r for r in rows if r.get("accepted_hist")]
    if hist_rows:
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
                ax.bar(x, h / max(h.sum(), 1), width=width, label=r["dataset"],
                       color=colors[datasets.index(r["dataset"]) % len(colors)]
                       if r["dataset"] in datasets else None)
            ax.set(title=method, xlabel="accepted draft tokens per step",
                   ylabel="fraction of steps")
            ax.xaxis.set_major_locator(MaxNLocator(integer=True))
            ax.grid(alpha=0.3, axis="y")
            ax.legend(fontsize=7)
        for ax in axes.ravel()[len(methods):]:
            ax.axis("off")
        fig.tight_layout()
        paths.append(stem + "_hist.png")
        fig.savefig(paths[-1], dpi=110)
        plt.close(fig)
    return paths


# -- command line --------------------------------------------------------------------------------
def define_flags() -> None:
    if "sweep_N" in FLAGS:
        return
    flags.DEFINE_string("config", "smollm2_135m", "Preset.")
    flags.DEFINE_string("ckpt", None, "Checkpoint override.")
    flags.DEFINE_string("data_dir", None, "Prompt sets (default ../shared/data).")
    flags.DEFINE_list("datasets", list(common.DATASETS), "Data sets: "
                      + ", ".join(common.DATASETS))
    flags.DEFINE_integer("num_prompts", 20, "First N prompts of each data set.")
    flags.DEFINE_integer("max_new_tokens", 128, "New tokens per prompt.")
    flags.DEFINE_string("methods", None, "Methods, e.g. ar,lookahead:15,5,15,prompt_lookup "
                        f"(default: {LOOKAHEAD_DEFAULT}; looped presets: {LOOPED_DEFAULT}; "
                        "with --sweep: the sweep only).")
    flags.DEFINE_list("sweep", [], "W sweep: lookahead at these W with G = W (and N from "
                      "--sweep_N); fits the scaling law and writes --fit_out.")
    flags.DEFINE_list("sweep_N", ["5"], "N values of the --sweep.")
    flags.DEFINE_bool("seeding", False, "Prompt seeding for the --sweep settings and "
                      "--check_auto's choice.")
    flags.DEFINE_bool("check_auto", False, "Pick settings as --auto does and compare their "
                      "measured speed-up with the best measured lookahead setting.")
    flags.DEFINE_string("fit", None, "--check_auto: a stored scaling-law fit (default: this "
                        "run's pooled fit, else the one --auto would use).")
    flags.DEFINE_string("fit_out", None, "Write this run's scaling-law fits here (default with "
                        "--sweep: benchmarks/results/scaling_fit.json).")
    flags.DEFINE_string("out", None, "JSON output (default benchmarks/results/suite_<config>"
                        ".json, sweep_<config>.json with --sweep); .md and PNGs beside it.")
    flags.DEFINE_string("lad", None, "train_lad work directory: the LoopAhead drafter.")
    flags.DEFINE_float("temperature", 0.0, "0: greedy (outputs must equal plain); > 0: "
                       "sampling (exactness not applicable).")
    flags.DEFINE_integer("top_k", 0, "top-k when sampling (0 = off).")
    flags.DEFINE_float("top_p", 1.0, "top-p when sampling (1 = off).")
    flags.DEFINE_bool("step_cost", True, "Measure the step-cost curve (lookahead presets).")
    flags.DEFINE_bool("progress", True, "Show a progress bar on stderr.")
    flags.DEFINE_bool("plots", True, "Write PNG plots beside the JSON.")


def options_from_flags(preset) -> SuiteOptions:
    from models.looped import LoopedConfig  # noqa: PLC0415
    looped = isinstance(preset.model, LoopedConfig)
    try:
        Ws = [int(w) for w in FLAGS.sweep]
        Ns = [int(n) for n in FLAGS.sweep_N]
    except ValueError:
        raise SuiteError("--sweep and --sweep_N take integers") from None
    if Ws:
        specs = [MethodSpec("ar")] + sweep_methods(Ws, Ns, FLAGS.seeding)
        if FLAGS.methods:
            specs += [s for s in parse_methods(FLAGS.methods, preset.lookahead)
                      if s not in specs]
    else:
        default = LOOPED_DEFAULT if looped else LOOKAHEAD_DEFAULT
        specs = parse_methods(FLAGS.methods or default, preset.lookahead)
    kind = "sweep" if Ws else "suite"
    out = FLAGS.out or os.path.join("benchmarks", "results", f"{kind}_{FLAGS.config}.json")
    fit_out = FLAGS.fit_out or (os.path.join("benchmarks", "results", "scaling_fit.json")
                                if Ws else None)
    return SuiteOptions(
        methods=specs, datasets=FLAGS.datasets, num_prompts=FLAGS.num_prompts,
        max_new_tokens=FLAGS.max_new_tokens, data_dir=FLAGS.data_dir, out=out,
        sampling=Sampling(FLAGS.temperature, FLAGS.top_k, FLAGS.top_p), lad=FLAGS.lad,
        step_cost=FLAGS.step_cost, check_auto=FLAGS.check_auto, seeding=FLAGS.seeding,
        fit=FLAGS.fit, fit_out=fit_out, progress=FLAGS.progress, plots=FLAGS.plots,
        config=FLAGS.config)


def main(argv) -> int:
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments {' '.join(argv[1:])!r}")
    from lookahead_jax.presets import load_engine, load_preset  # noqa: PLC0415
    from models.config import ConfigError  # noqa: PLC0415
    try:
        preset = load_preset(FLAGS.config)
        opts = options_from_flags(preset)
        engine = load_engine(FLAGS.config, ckpt=FLAGS.ckpt)
        run_suite(engine, opts)
    except (SuiteError, ConfigError, common.DataError, ValueError) as e:
        print(f"error: {' '.join(str(e).split())}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    define_flags()
    app.run(main)
