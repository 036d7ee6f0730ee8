"""What lookahead decoding would buy on each accelerator: the roofline model, checked.

    python -m benchmarks.roofline [--out benchmarks/results] [--presets a,b] [--quick]

Every step is compiled from abstract shapes (`lookahead_jax.tuning.program_cost`), and its
FLOPs and bytes are read against the devices of `lookahead_jax.tuning.roofline` (vendors'
figures; bfloat16 bytes) and against this machine (measured by probes). It writes
`roofline.json`, `roofline.md` and `roofline_speedup_vs_w.png` into --out and prints the
Markdown. The tables:

  devices      the device table, and this machine as the probes measured it
  presets      preset x device x method setting: plain tokens/s, step time, the step in plain
               steps, speed-up = S x plain / method (with the overhead term, and the bare
               roofline), memory- or compute-bound, whether weights + cache fit
  paper        the paper's A100 figures against the prediction at the paper's settings
  cpu          this CPU: predicted against measured step times and speed-ups for SmolLM2
  looped       plain / LoopSpec / LoopAhead ms per token per device for looped models

S (tokens per step) comes from the committed SmolLM2 measurements where they exist, else from
the fitted scaling law; a column says which. The overhead term is recalibrated on every run
(see `lookahead_jax.tuning.roofline`); its value is in the output.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from typing import Any, Sequence

from benchmarks import common
from lookahead_jax.prompt_lookup import DEFAULT_TOKENS
from lookahead_jax.store.presets import load_preset
from lookahead_jax.tuning import roofline as rf
from lookahead_jax.tuning.program_cost import (ATTENTIONS, ProgramCost, method_cost,
                                              tree_step_cost)
from lookahead_jax.tuning.scaling_law import ScalingFit, default_fit

RESULTS = os.path.join(common.REPO, "benchmarks", "results")
LLAMA_PRESETS = ("smollm2_135m", "llama7b", "llama13b", "codellama7b", "codellama13b",
                 "codellama34b", "llama70b")
LOOPED = (("tiny_ouro", None), ("tiny_raven", None), ("smol_loop", None), ("smol_loop_r2", None),
          ("smol_loop_2x2", None), ("smol_loop_2x4", None),
          ("ouro_1p4b", "tiny_ouro"), ("huginn_0125", "tiny_raven"))
# (preset, the model its loop counts come from: None, its own committed suite run)
SETTINGS = (("ar", ()), ("lookahead", (("W", 15), ("N", 5), ("G", 15))),
            ("lookahead", (("W", 10), ("N", 5), ("G", 10))),
            ("lookahead", (("W", 7), ("N", 5), ("G", 7))),
            ("lookahead", (("W", 5), ("N", 3), ("G", 5))),
            ("prompt_lookup", (("num_tokens", DEFAULT_TOKENS),)))
S_DATASETS = ("mt_bench", "humaneval", "gsm8k")  # the sets every committed SmolLM2 run has
CALIBRATION = ("llama7b", (("W", 15), ("N", 5), ("G", 15)), "A100 80GB SXM")
SWEEP_W = (1, 2, 3, 5, 7, 10, 15)
CPU_CACHE_LEN = 256  # about the contexts of the committed SmolLM2 runs (prompt + output)
LOOPED_METHODS = ("plain", "loopspec", "loopspec_d2", "loopahead", "loopahead_nosched",
                  "loopahead_nodrafter")  # those in a preset's suite file


def label(method: str, settings: tuple) -> str:
    s = dict(settings)
    if method == "lookahead":
        return f"lookahead ({s['W']},{s['N']},{s['G']})"
    if method == "prompt_lookup":
        return f"prompt_lookup {s.get('num_tokens', DEFAULT_TOKENS)}"
    return method


# -- compiled costs, cached for the run -----------------------------------------------------------
class Costs:
    """ProgramCost per (preset, method, settings, cache_len) for one run (compiling llama70b
    takes seconds; each shape is compiled once)."""

    def __init__(self):
        self._memo: dict[tuple, ProgramCost] = {}
        self.compile_s = 0.0

    def _get(self, key, make) -> ProgramCost:
        if key not in self._memo:
            t0 = time.perf_counter()
            self._memo[key] = make()
            self.compile_s += time.perf_counter() - t0
        return self._memo[key]

    def method(self, preset: str, method: str, settings: tuple, cache_len: int,
               attention: str = "dense") -> ProgramCost:
        """attention: 'dense' (the dense path's program) or 'fused' (the Pallas kernel's
        traffic: `program_cost.fused_attention_traffic`)."""
        return self._get((preset, method, settings, cache_len, attention), lambda: method_cost(
            load_preset(preset).model, method, dict(settings), cache_len=cache_len,
            attention=ATTENTIONS[attention]))

    def tree_step(self, preset: str, nodes: int, cache_len: int) -> ProgramCost:
        """One LoopSpec / LoopAhead step of a looped preset over a tree of `nodes` nodes."""
        return self._get((preset, "tree", nodes, cache_len), lambda: tree_step_cost(
            load_preset(preset).model, nodes=nodes, cache_len=cache_len))


# -- S from the committed measurements ------------------------------------------------------------
def _load(results: str, name: str) -> dict | None:
    path = os.path.join(results, name)
    if not os.path.exists(path):
        return None
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def _pooled(summary: list[dict], method: str, datasets=S_DATASETS) -> dict | None:
    """Pooled over `datasets`: S = tokens / steps, and the plain-vs-method time ratio."""
    rows = [r for r in summary if r["method"] == method and r["dataset"] in datasets]
    if {r["dataset"] for r in rows} != set(datasets):
        return None
    tokens = sum(r["tokens"] for r in rows)
    steps = sum(r["steps"] for r in rows)
    time_s = sum(r["steps"] * r["step_ms"] / 1e3 for r in rows)
    return dict(S=tokens / steps, steps=steps, tokens=tokens, time_s=time_s,
                step_ms=1e3 * time_s / steps, step_tokens=rows[0].get("step_tokens"))


def measured_runs(results: str) -> dict[str, dict]:
    """label -> pooled SmolLM2 measurement (S, step ms, speed-up over plain in the same file,
    source), from lookahead_bench.json, then sweep_smollm2_135m.json, then
    suite_smollm2_135m.json (first file that has the setting wins)."""
    out: dict[str, dict] = {}
    files = (("lookahead_bench.json", lambda m: m if m.startswith("(") else None),
             ("sweep_smollm2_135m.json", lambda m: m[len("lookahead "):]
              if m.startswith("lookahead (") else None),
             ("suite_smollm2_135m.json", lambda m: m if m == "prompt_lookup" else None))
    for name, key in files:
        d = _load(results, name)
        if d is None:
            continue
        plain = _pooled(d["summary"], "plain")
        for m in sorted({r["method"] for r in d["summary"]}):
            k = key(m)
            if k is None or "+prompt" in m:
                continue
            lab = f"lookahead {k}" if k.startswith("(") else f"prompt_lookup {DEFAULT_TOKENS}"
            rec = _pooled(d["summary"], m)
            if lab in out or rec is None or plain is None:
                continue
            rec.update(plain_step_ms=plain["step_ms"], speedup=plain["time_s"] / rec["time_s"],
                       source=f"measured: {name} (SmolLM2, {'+'.join(S_DATASETS)})")
            out[lab] = rec
    return out


def s_of(method: str, settings: tuple, measured: dict, fit: ScalingFit) -> tuple[float, str]:
    if method == "ar":
        return 1.0, "plain"
    lab = label(method, settings)
    if lab in measured:
        return measured[lab]["S"], measured[lab]["source"]
    if method == "lookahead":
        s = dict(settings)
        return float(fit.predict_S(s["W"], s["N"], s["G"])), f"fit: {fit.source}"
    raise KeyError(f"no S for {lab}: not measured, and the scaling law is for lookahead only")


# -- the tables ------------------------------------------------------------------------------------
def preset_rows(costs: Costs, presets, devices, cache_len, measured, fit,
                settings_list=SETTINGS) -> list[dict]:
    rows = []
    for name in presets:
        cfg = load_preset(name).model
        layers = rf.layers_of(cfg)
        plain = costs.method(name, "ar", (), cache_len)
        plain_k = costs.method(name, "ar", (), cache_len, "fused")
        for dev in devices:
            t_plain = rf.predict_step_time(plain, dev, layers=layers)
            bare_plain = rf.roofline_time(plain, dev)
            nbytes = rf.model_bytes(plain)
            for method, settings in settings_list:
                cost = costs.method(name, method, settings, cache_len)
                kernel = costs.method(name, method, settings, cache_len, "fused")
                t = rf.predict_step_time(cost, dev, layers=layers)
                S, src = s_of(method, settings, measured, fit)
                t_k, t_plain_k = (rf.predict_step_time(c, dev, layers=layers)
                                  for c in (kernel, plain_k))
                rows.append(dict(
                    preset=name, device=dev.name, setting=label(method, settings),
                    tokens=cost.tokens, plain_tokens_per_s=1.0 / t_plain, step_ms=1e3 * t,
                    step_in_plain=t / t_plain, S=S, S_source=src,
                    speedup=rf.speedup(S, t_plain, t),
                    speedup_bare=rf.speedup(S, bare_plain, rf.roofline_time(cost, dev)),
                    kernel_step_in_plain=t_k / t_plain_k,
                    speedup_kernel=rf.speedup(S, t_plain_k, t_k),
                    speedup_kernel_bare=rf.speedup(S, rf.roofline_time(plain_k, dev),
                                                   rf.roofline_time(kernel, dev)),
                    bound=rf.bound(cost, dev), model_gb=nbytes / 1e9,
                    fits=rf.fits(nbytes, dev)))
    return rows


@dataclasses.dataclass(frozen=True)
class PaperRow:
    """One figure of the paper: a task, the model shape, the paper's setting and result."""

    task: str
    preset: str
    W: int
    N: int
    G: int
    speedup: float
    S: float | None = None  # the paper's S where it gives one
    fit: str = "all"  # which of our fits predicts S otherwise (a data set, or 'all')
    note: str = ""


def paper_rows_spec() -> tuple[PaperRow, ...]:
    """The Lookahead Decoding paper's A100 figures (shared/ALGORITHM_NOTES.md). Llama-2 shapes
    for MT-Bench, XSum, CNN/DM and GSM8K at 7B/13B; CodeLlama shapes for the code tasks and
    for every 34B row (the only 34B model)."""
    s7, s13, s34 = (15, 5, 15), (10, 5, 10), (7, 5, 7)
    cal = "calibration row (the overhead is fitted to 1.1 plain steps here)"
    return (
        PaperRow("MT-Bench", "llama7b", *s7, 1.64, fit="mt_bench"),
        PaperRow("MT-Bench", "llama13b", *s13, 1.51, fit="mt_bench"),
        PaperRow("MT-Bench (mission: S 1.96)", "llama7b", *s7, 1.80, S=1.96),
        PaperRow("MT-Bench (mission: S 2.05)", "llama7b", *s7, 1.90, S=2.05),
        PaperRow("XSum greedy", "llama7b", *s7, 1.60, S=1.77, note=cal),
        PaperRow("XSum T=1.0", "llama7b", *s7, 1.50, S=1.67, note=cal),
        PaperRow("CNN/DM greedy", "llama7b", *s7, 1.57, S=1.72, note=cal),
        PaperRow("CNN/DM T=1.0", "llama7b", *s7, 1.46, S=1.64, note=cal),
        PaperRow("GSM8K", "llama7b", *s7, 1.89, fit="gsm8k"),
        PaperRow("GSM8K", "llama13b", *s13, 1.72, fit="gsm8k"),
        PaperRow("GSM8K", "codellama34b", *s34, 1.70, fit="gsm8k"),
        PaperRow("MBPP", "codellama7b", *s7, 1.87),
        PaperRow("MBPP", "codellama13b", *s13, 1.75),
        PaperRow("MBPP", "codellama34b", *s34, 1.76),
        PaperRow("HumanEval completion", "codellama7b", *s7, 2.25, fit="humaneval"),
        PaperRow("HumanEval completion", "codellama13b", *s13, 2.25, fit="humaneval"),
        PaperRow("HumanEval completion", "codellama34b", *s34, 1.72, fit="humaneval"),
        PaperRow("HumanEval infilling", "codellama7b", *s7, 1.55),
        PaperRow("HumanEval infilling", "codellama13b", *s13, 1.40),
    )


def dataset_fits(results: str) -> dict[str, ScalingFit]:
    """Per-data-set fits of the committed SmolLM2 sweep, plus 'all': the library default."""
    fits = {"all": default_fit()}
    d = _load(results, "sweep_smollm2_135m.json")
    for k, v in ((d or {}).get("fits") or {}).items():
        if k != "all":
            fits[k] = ScalingFit.from_dict(dict(v, source=f"sweep_smollm2_135m.json fit {k}"))
    return fits


def paper_rows(costs: Costs, dev: rf.Device, cache_len: int, fits, presets_ok) -> list[dict]:
    rows = []
    for p in paper_rows_spec():
        if p.preset not in presets_ok:
            continue
        layers = rf.layers_of(load_preset(p.preset).model)
        settings = (("W", p.W), ("N", p.N), ("G", p.G))
        plain = costs.method(p.preset, "ar", (), cache_len)
        cost = costs.method(p.preset, "lookahead", settings, cache_len)
        if p.S is not None:
            S, src = p.S, "paper"
        else:
            fit = fits.get(p.fit, fits["all"])
            S, src = float(fit.predict_S(p.W, p.N, p.G)), f"our fit ({fit.source})"
        t_plain = rf.predict_step_time(plain, dev, layers=layers)
        t = rf.predict_step_time(cost, dev, layers=layers)
        pred = rf.speedup(S, t_plain, t)
        bare = rf.speedup(S, rf.roofline_time(plain, dev), rf.roofline_time(cost, dev))
        rows.append(dict(task=p.task, preset=p.preset, setting=f"({p.W},{p.N},{p.G})", S=S,
                         S_source=src, step_in_plain=t / t_plain, predicted=pred,
                         predicted_bare=bare, paper=p.speedup,
                         rel_error=(pred - p.speedup) / p.speedup,
                         rel_error_bare=(bare - p.speedup) / p.speedup, note=p.note))
    return rows


def cpu_section(costs: Costs, here: rf.Device, measured: dict, *, measure_model: bool,
                cache_len: int, settings_list=SETTINGS) -> dict:
    """SmolLM2 on this machine: the overhead calibrated on a one-token step, then every
    committed setting's step time and speed-up predicted against the measured ones."""
    name = "smollm2_135m"
    cfg = load_preset(name).model
    layers = rf.layers_of(cfg)
    itemsize = 4  # the committed runs are float32
    plain = costs.method(name, "ar", (), cache_len)
    chosen = {}  # label -> (method, settings, cost) for the committed settings we model
    for lab in sorted(measured):
        match = [(m, s) for m, s in settings_list if label(m, s) == lab]
        if match:
            m, s = match[0]
            chosen[lab] = (m, s, costs.method(name, m, s, cache_len))
    forward_ms: dict[int, float] = {}
    if measure_model:
        from lookahead_jax.engine import Engine  # noqa: PLC0415 - loads the GGUF weights
        from lookahead_jax.tuning.step_cost import measure_step_cost  # noqa: PLC0415

        engine = Engine.from_preset(name)
        counts = sorted({1} | {c.tokens for _, _, c in chosen.values()})
        forward_ms = {t: 1e3 * s for t, s in measure_step_cost(
            engine.graphdef, engine.params, counts, cache_len=cache_len, repeats=5).items()}
        one_token_ms, calib_src = forward_ms[1], (
            f"one-token SmolLM2 forward measured here (measure_step_cost, cache {cache_len})")
    else:
        lb = measured.get("lookahead (15,5,15)")
        one_token_ms = lb["plain_step_ms"] if lb else 30.0
        calib_src = "plain step ms of the committed lookahead_bench.json (--quick: no model run)"
    over = rf.overhead_from_step(one_token_ms / 1e3, plain, here, layers=layers,
                                 itemsize=itemsize)
    dev = dataclasses.replace(here, overhead_s=over)
    t_plain = rf.predict_step_time(plain, dev, itemsize, layers=layers)
    rows = []
    for lab, (method, settings, cost) in chosen.items():
        rec = measured[lab]
        t = rf.predict_step_time(cost, dev, itemsize, layers=layers)
        mem_ms, comp_ms = (1e3 * rf.memory_time(cost, dev, itemsize),
                           1e3 * rf.compute_time(cost, dev))
        steps_in_plain_meas = rec["step_ms"] / rec["plain_step_ms"]
        rows.append(dict(
            setting=lab, tokens=cost.tokens, S=rec["S"], memory_ms=mem_ms, compute_ms=comp_ms,
            predicted_step_ms=1e3 * t, measured_step_ms=rec["step_ms"],
            measured_forward_ms=forward_ms.get(cost.tokens),
            predicted_step_in_plain=t / t_plain, measured_step_in_plain=steps_in_plain_meas,
            predicted_speedup=rf.speedup(rec["S"], t_plain, t),
            measured_speedup=rec["speedup"], source=rec["source"]))
    return dict(device=dev.to_dict(), overhead_per_layer_s=over, calibration=calib_src,
                one_token_ms=one_token_ms, cache_len=cache_len, itemsize=itemsize,
                plain_predicted_ms=1e3 * t_plain, plain_memory_ms=1e3 * rf.memory_time(
                    plain, dev, itemsize), plain_compute_ms=1e3 * rf.compute_time(plain, dev),
                forward_ms_measured=forward_ms, rows=rows)


def looped_counts(results: str, preset: str) -> dict[str, dict] | None:
    """method -> pooled loops, steps and advances per token and the tree's capacity (nodes
    per step), from suite_<preset>.json; None without that file or when its runs predate
    the capacity field."""
    d = _load(results, f"suite_{preset}.json")
    if d is None:
        return None
    out = {}
    for m in LOOPED_METHODS:
        runs = [r for r in d["runs"] if r["method"] == m and r.get("loops") is not None]
        if not runs:
            continue
        if any("capacity" not in r for r in runs):
            return None
        tokens = sum(r["verified"] for r in runs)
        loops = sum(r["loops"] for r in runs)
        meas = [s for s in d["summary"] if s["method"] == m]
        out[m] = dict(loops_per_token=loops / tokens,
                      steps_per_token=(1.0 if m == "plain" else loops / tokens),
                      advances_per_token=sum(r["advances"] for r in runs) / tokens,
                      capacity=max(r["capacity"] for r in runs), tokens=tokens,
                      measured_speedup=(sum(s["tokens"] for s in meas)
                                        / sum(s["tokens"] / s["speedup"] for s in meas)))
    return out


def looped_rows(costs: Costs, results: str, devices, here: rf.Device | None,
                cache_len: int, presets) -> tuple[list[dict], dict]:
    """Per looped preset x device x method: ms per token = steps per token x one step's
    predicted time. Plain: one step per token running all R loops (`forward_cost`). LoopSpec
    and LoopAhead: one step per block call, over their tree's capacity (`tree_step_cost`:
    embedding / prelude, one loop, readout / coda and head at every node)."""
    rows, counts = [], {}
    for name, source in LOOPED:
        if name not in presets:
            continue
        src = source or name
        if src not in counts:
            counts[src] = looped_counts(results, src)
        c = counts[src]
        if not c or "plain" not in c:
            print(f"looped: no suite_{src}.json with tree capacities in {results}; {name} "
                  f"skipped", file=sys.stderr)
            continue
        cfg = load_preset(name).model
        r_tiny = load_preset(src).model.num_loops
        scale = cfg.num_loops / r_tiny  # tree steps per token carried over as a ratio to R
        devs = list(devices) + ([here] if here is not None and source is None else [])
        for dev in devs:
            itemsize = 4 if dev is here else 2
            per = {}
            for m, v in c.items():
                if m == "plain":
                    step, spt = costs.method(name, "ar", (), cache_len), 1.0
                    layers, lpt = rf.pass_layers(cfg, cfg.num_loops), float(cfg.num_loops)
                else:
                    step = costs.tree_step(name, v["capacity"], cache_len)
                    spt = v["steps_per_token"] * scale
                    layers, lpt = rf.pass_layers(cfg, 1), v["loops_per_token"] * scale
                per[m] = dict(lpt=lpt, spt=spt, nodes=step.tokens, ms=1e3 *
                              rf.predict_looped_token_time(spt, step, dev, itemsize,
                                                           layers=layers),
                              step_ms=1e3 * rf.predict_step_time(step, dev, itemsize,
                                                                  layers=layers))
            for m, v in per.items():
                rows.append(dict(
                    preset=name, loops_from=src + (" (ratio carried over)" if source else
                                                   " (measured here)"),
                    device=dev.name, method=m, loops_per_token=v["lpt"],
                    steps_per_token=v["spt"], nodes_per_step=v["nodes"],
                    step_ms=v["step_ms"], ms_per_token=v["ms"],
                    speedup=per["plain"]["ms"] / v["ms"],
                    measured_speedup=(c[m]["measured_speedup"] if dev is here else None)))
    return rows, counts


def sweep_points(costs: Costs, devices, cache_len: int, fit: ScalingFit, ws) -> list[dict]:
    """Predicted speed-up against W for llama7b, N = 5, G = W, S from the default fit."""
    name = "llama7b"
    layers = rf.layers_of(load_preset(name).model)
    plain = costs.method(name, "ar", (), cache_len)
    out = []
    for w in ws:
        settings = (("W", w), ("N", 5), ("G", w))
        cost = costs.method(name, "lookahead", settings, cache_len)
        S = float(fit.predict_S(w, 5, w))
        for dev in devices:
            out.append(dict(device=dev.name, W=w, S=S, speedup=rf.predict_speedup(
                S, plain, cost, dev, layers=layers)))
    return out


def plot_sweep(points: list[dict], path: str) -> str | None:
    """The W sweep as a PNG; returns a reason when it cannot be drawn."""
    try:
        import matplotlib  # noqa: PLC0415 - optional

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt  # noqa: PLC0415
    except ImportError as e:
        return f"matplotlib is not installed ({e})"
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for dev in dict.fromkeys(p["device"] for p in points):
        ps = [p for p in points if p["device"] == dev]
        ax.plot([p["W"] for p in ps], [p["speedup"] for p in ps], marker="o", label=dev)
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set_xlabel("W (N = 5, G = W)")
    ax.set_ylabel("predicted speed-up over plain")
    ax.set_title("Llama-2-7B shape, bf16: S from the default fit x roofline step cost")
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return None


# -- Markdown --------------------------------------------------------------------------------------
def f2(x, nd=2):
    return "" if x is None else f"{x:.{nd}f}"


def render(rec: dict) -> str:
    t = common.markdown_table
    o = rec["overhead"]
    out = [
        "# Roofline predictions (`python -m benchmarks.roofline`)", "",
        f"Cache length {rec['cache_len']} tokens (an MT-Bench-like context; `--cache_len`). "
        "Bytes are the compiled program's (XLA cost analysis, float32) scaled to bfloat16; "
        "FLOPs as compiled. Step time = max(bytes / bandwidth, FLOPs / peak) + layers x "
        f"overhead. Overhead: {o['per_layer_s'] * 1e3:.3f} ms per layer per step, calibrated "
        f"so a {o['calibrated_on']} step costs {o['ratio']} plain steps (the paper's 7B XSum / "
        f"CNN/DM figures); the library constant is {o['library_constant_s'] * 1e3:.3f} ms. It "
        "stands for the paper's PyTorch stack; the 'bare' columns drop it.", ""]
    out += ["## Devices", "", t(
        ["device", "bf16 TFLOP/s", "HBM GB/s", "memory GB", "ridge FLOP/B", "overhead ms/layer",
         "source"],
        [[d["name"], f2(d["peak_flops"] / 1e12, 1), f2(d["bandwidth"] / 1e9, 0),
          f2(d["memory"] / 1e9, 1), f2(d["ridge"], 0), f2(d["overhead_s"] * 1e3, 3),
          d["source"]] for d in rec["devices"] + [rec["this_machine"]]]), "",
        "This machine's peak is a float32 matmul (what its programs run), not bfloat16.", ""]
    out += ["## Preset x device x setting", "",
            "S: measured on SmolLM2-135M (pooled over MT-Bench, HumanEval, GSM8K) where the "
            "committed runs have the setting, else the default scaling-law fit; a bigger model "
            "accepts more, so S is likely low for the 7B-70B shapes. 'fits': bfloat16 weights "
            "+ the cache in the device's memory. 'step ms' .. 'bare': the dense attention's "
            "program (what the paper's stack ran, and `--attention=dense`); 'kernel' columns: "
            "the attention counted as a fused kernel's traffic (the Pallas kernel, "
            "`--attention=auto` on a GPU or TPU; `program_cost.fused_attention_traffic`).", "",
            t(["preset", "device", "setting", "T", "plain tok/s", "step ms", "step in plain",
               "S", "speed-up", "bare", "kernel: step in plain", "kernel: speed-up",
               "kernel: bare", "bound", "GB", "fits", "S from"],
              [[r["preset"], r["device"], r["setting"], r["tokens"],
                f2(r["plain_tokens_per_s"], 1), f2(r["step_ms"]), f2(r["step_in_plain"]),
                f2(r["S"]), f2(r["speedup"]), f2(r["speedup_bare"]),
                f2(r["kernel_step_in_plain"]), f2(r["speedup_kernel"]),
                f2(r["speedup_kernel_bare"]), r["bound"],
                f2(r["model_gb"], 1), "yes" if r["fits"] else "no", r["S_source"]]
               for r in rec["presets"]]), ""]
    if rec["paper"]:
        errs = [abs(r["rel_error"]) for r in rec["paper"] if not r["note"]]
        out += ["## Paper check (A100 80GB SXM)", "",
                "The paper's speed-up over Hugging Face greedy at its recommended settings "
                "against the prediction. Where the paper gives S the row checks the step-cost "
                "model alone; elsewhere S is our SmolLM2 fit's (per data set where the sweep "
                "has one), a 135M model's acceptance, so those rows also test S.", "",
                t(["task", "model shape", "setting", "S", "S from", "step in plain",
                   "predicted", "bare roofline", "paper", "error", "error (bare)", "note"],
                  [[r["task"], r["preset"], r["setting"], f2(r["S"]), r["S_source"],
                    f2(r["step_in_plain"]), f2(r["predicted"]), f2(r["predicted_bare"]),
                    f2(r["paper"]), f"{100 * r['rel_error']:+.0f}%",
                    f"{100 * r['rel_error_bare']:+.0f}%", r["note"]] for r in rec["paper"]]),
                "", f"Mean absolute error outside the calibration rows: "
                f"{100 * sum(errs) / max(1, len(errs)):.0f}% over {len(errs)} rows.", ""]
    c = rec.get("cpu")
    if c:
        out += ["## This CPU: predicted against measured (SmolLM2-135M, float32)", "",
                f"Overhead {c['overhead_per_layer_s'] * 1e3:.3f} ms per layer, from a "
                f"{c['one_token_ms']:.1f} ms {c['calibration']}. Plain step: predicted "
                f"{c['plain_predicted_ms']:.1f} ms (memory {c['plain_memory_ms']:.1f} ms, "
                f"compute {c['plain_compute_ms']:.1f} ms). Cache {c['cache_len']}. 'measured "
                "step' is the whole step of the committed runs; 'forward here' one forward "
                "pass of T tokens timed now (causal mask, all logits).", "",
                t(["setting", "T", "S", "memory ms", "compute ms", "predicted step ms",
                   "measured step ms", "forward here ms", "pred. in plain", "meas. in plain",
                   "predicted speed-up", "measured speed-up", "source"],
                  [[r["setting"], r["tokens"], f2(r["S"]), f2(r["memory_ms"], 1),
                    f2(r["compute_ms"], 1), f2(r["predicted_step_ms"], 1),
                    f2(r["measured_step_ms"], 1), f2(r["measured_forward_ms"], 1),
                    f2(r["predicted_step_in_plain"]), f2(r["measured_step_in_plain"]),
                    f2(r["predicted_speedup"]), f2(r["measured_speedup"]), r["source"]]
                   for r in c["rows"]]), "", rec["cpu_notes"], ""]
    if rec["looped"]:
        out += ["## Looped models: predicted ms per token", "",
                "Per-token time = steps per token x one step's predicted time. Plain "
                "decoding: one step per token, all R loops (and the prelude, coda and head) "
                "in it. LoopSpec / LoopAhead: one step per call of the shared block, over the "
                "whole candidate tree (its capacity: every slot is computed), with the "
                "embedding or prelude before the call and the readout (coda, head) at every "
                "node after it (`program_cost.tree_step_cost`; the K/V writes and the "
                "drafter are not counted). Steps per token are pooled over the committed "
                "suite runs (`suite_<preset>.json`); for ouro_1p4b and huginn_0125 they are "
                "the tiny model's ratio to its plain R, carried over to the big model's R "
                "(an assumption, not a measurement). 'measured' is the committed speed-up on "
                "this CPU.", "",
                t(["preset", "loops from", "device", "method", "loops/token", "steps/token",
                   "nodes/step", "step ms", "ms/token", "speed-up", "measured"],
                  [[r["preset"], r["loops_from"], r["device"], r["method"],
                    f2(r["loops_per_token"]), f2(r["steps_per_token"]), r["nodes_per_step"],
                    f2(r["step_ms"], 3), f2(r["ms_per_token"], 3), f2(r["speedup"]),
                    f2(r["measured_speedup"])] for r in rec["looped"]]), ""]
    if rec.get("sweep"):
        skipped = rec.get("plot_skipped")
        drawn = f" (not drawn: {skipped})" if skipped else ""
        out += ["## Speed-up against W (llama7b, N = 5, G = W)", "",
                f"`roofline_speedup_vs_w.png`{drawn}; S from the default fit.", "",
                t(["device"] + [f"W={w}" for w in rec["sweep_W"]],
                  [[dev] + [f2(next(p["speedup"] for p in rec["sweep"]
                                    if p["device"] == dev and p["W"] == w))
                            for w in rec["sweep_W"]]
                   for dev in dict.fromkeys(p["device"] for p in rec["sweep"])]), ""]
    return "\n".join(out)


CPU_NOTES = (
    "Where the model misses on this CPU: a 2-core CPU's roofline ridge is low (matmul FLOP/s "
    "over read bandwidth), so every lookahead step here is compute-bound in the model. The "
    "matmul probe is a large square float32 matmul; a decode step's matmuls are skinny (T x "
    "576 by 576 x 1536 for SmolLM2), attention runs over a dense mask, and the step has "
    "hundreds of small ops (norms, RoPE, softmax, the lookahead bookkeeping) that run far "
    "below peak, so the measured step costs more plain steps than predicted and the predicted "
    "speed-up is optimistic. The plain step is calibrated, so its error is zero by "
    "construction.")


# -- main ------------------------------------------------------------------------------------------
def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.roofline", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=RESULTS, help="directory for roofline.json/.md/.png")
    ap.add_argument("--presets", default=None,
                    help="comma-separated Llama-family presets (default: "
                    f"{','.join(LLAMA_PRESETS)})")
    ap.add_argument("--cache_len", type=int, default=512, help="cached tokens before a step")
    ap.add_argument("--results", default=RESULTS, help="where the committed measurements are")
    ap.add_argument("--quick", action="store_true",
                    help="few presets, devices and settings, small probes, no model run, the CPU "
                    "table at --cache_len (for a test)")
    ap.add_argument("--no_model", action="store_true",
                    help="do not load SmolLM2 to time steps here (use the committed plain step)")
    return ap.parse_args(argv)


def run(args: argparse.Namespace) -> dict:
    t0 = time.perf_counter()
    costs = Costs()
    quick = args.quick
    presets = (args.presets.split(",") if args.presets else
               (["smollm2_135m"] if quick else list(LLAMA_PRESETS)))
    paper_presets = {"llama7b"} if quick else {p.preset for p in paper_rows_spec()}
    looped_presets = {"tiny_ouro"} if quick else {n for n, _ in LOOPED}
    measured = measured_runs(args.results)
    fit = default_fit()

    # the overhead term, recalibrated on this checkout's program costs
    cal_preset, cal_settings, cal_dev = CALIBRATION
    plain7 = costs.method(cal_preset, "ar", (), args.cache_len)
    la7 = costs.method(cal_preset, "lookahead", cal_settings, args.cache_len)
    over = rf.calibrate_overhead(plain7, la7, rf.device(cal_dev), ratio=rf.PAPER_STEP_RATIO,
                                 layers=rf.layers_of(load_preset(cal_preset).model))
    devices = [dataclasses.replace(d, overhead_s=over) for d in rf.DEVICES]
    if quick:
        devices = [d for d in devices if d.name in ("A100 80GB SXM", "L4")]

    here = rf.measure_device(copy_bytes=(64 << 20) if quick else (512 << 20),
                             matmul_n=1024 if quick else 2048, repeats=3 if quick else 5)
    print(f"overhead {over * 1e3:.3f} ms/layer; this machine: {here.source}", file=sys.stderr)

    settings_list = SETTINGS if not quick else tuple(SETTINGS[i] for i in (0, 1, 4, 5))
    cpu = cpu_section(costs, here, measured, measure_model=not (quick or args.no_model),
                      cache_len=args.cache_len if quick else CPU_CACHE_LEN,
                      settings_list=settings_list)
    here_cal = dataclasses.replace(here, overhead_s=cpu["overhead_per_layer_s"])
    rec: dict[str, Any] = dict(
        args=vars(args), machine=common.machine_info(), cache_len=args.cache_len,
        quick=quick,
        overhead=dict(per_layer_s=over, library_constant_s=rf.PAPER_STACK_OVERHEAD_S,
                      ratio=rf.PAPER_STEP_RATIO,
                      calibrated_on=f"{cal_preset} (15,5,15) on {cal_dev}"),
        devices=[d.to_dict() for d in devices], this_machine=here_cal.to_dict(),
        measured_S={k: v for k, v in measured.items()}, default_fit=fit.to_dict())
    rec["presets"] = preset_rows(costs, presets, devices, args.cache_len, measured, fit,
                                 settings_list)
    a100 = dataclasses.replace(rf.device(cal_dev), overhead_s=over)
    rec["paper"] = paper_rows(costs, a100, args.cache_len, dataset_fits(args.results),
                              paper_presets)
    rec["cpu"], rec["cpu_notes"] = cpu, CPU_NOTES
    rec["looped"], counts = looped_rows(costs, args.results, devices, here_cal,
                                        args.cache_len, looped_presets)
    rec["looped_counts"] = counts
    ws = (5, 15) if quick else SWEEP_W
    rec["sweep_W"] = list(ws)
    rec["sweep"] = sweep_points(costs, devices, args.cache_len, fit, ws)
    os.makedirs(args.out, exist_ok=True)
    rec["plot_skipped"] = plot_sweep(rec["sweep"], os.path.join(args.out,
                                                                 "roofline_speedup_vs_w.png"))
    if rec["plot_skipped"]:
        print(f"plot skipped: {rec['plot_skipped']}", file=sys.stderr)
    rec["compile_s"], rec["wall_s"] = costs.compile_s, time.perf_counter() - t0
    md = render(rec)
    common.write_json(os.path.join(args.out, "roofline.json"), rec)
    with open(os.path.join(args.out, "roofline.md"), "w", encoding="utf-8") as f:
        f.write(md + "\n")
    print(md)
    return rec


def main(argv: Sequence[str] | None = None) -> int:
    run(parse_args(argv))
    return 0


if __name__ == "__main__":
    sys.exit(main())
