"""Lookahead decoding against plain decoding, paired prompt by prompt, on real prompts.

    python -m benchmarks.lookahead_bench --num_prompts=20 \
        --settings=15,5,15:7,5,7:5,3,5 --seeding=off,on --out=benchmarks/results/lookahead_bench.json
    python -m benchmarks.lookahead_bench --datasets=humaneval --num_prompts=10 \
        --settings=1,5,1:3,5,3:5,5,5:7,5,7:10,5,10:15,5,15 --seeding=off \
        --plot=benchmarks/results/sweep_w.png --out=benchmarks/results/sweep_w.json     # S and speed-up against W

For every prompt, plain greedy decoding runs first, then each lookahead setting, so the
machine's noise hits all methods alike. Reported per data set and method: step compression
S = tokens / steps (prefill counted as a step, as the reference counts), tokens/s over
prefill + decode (compile excluded, reported apart), speed-up over plain, and whether every
output equals plain greedy token for token. It also measures the step-cost curve (forward
time against tokens per step) that explains the speed-ups, and writes everything as JSON
after every prompt, so a stopped run keeps what it measured.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time

from absl import app, flags

from benchmarks import common
from lookahead_jax.config import LookaheadConfig
from lookahead_jax.sampling import Sampling
from lookahead_jax.step_cost import measure_step_cost, relative_cost

FLAGS = flags.FLAGS
flags.DEFINE_string("config", "smollm2_135m", "preset")
flags.DEFINE_string("ckpt", None, "checkpoint override")
flags.DEFINE_string("data_dir", None, "prompt sets (default ../shared/data)")
flags.DEFINE_list("datasets", ["mt_bench", "humaneval", "gsm8k"], "data sets")
flags.DEFINE_integer("num_prompts", 20, "first N prompts of each data set")
flags.DEFINE_integer("max_new_tokens", 128, "new tokens per prompt")
flags.DEFINE_string("settings", "15,5,15:7,5,7:5,3,5", "W,N,G settings separated by ':'")
flags.DEFINE_list("seeding", ["off", "on"], "prompt seeding: off, on or both")
flags.DEFINE_list("step_cost_tokens", ["1", "2", "4", "8", "16", "32", "64", "96", "128"],
                  "tokens per step for the step-cost curve (empty: skip)")
flags.DEFINE_string("out", "benchmarks/results/lookahead_bench.json", "JSON output")
flags.DEFINE_string("plot", None, "PNG of S and speed-up against W (for a W sweep)")
flags.DEFINE_float("temperature", 0.0, "0: greedy (outputs must equal plain); > 0: sampling, "
                   "compared with plain sampling (outputs differ by design)")
flags.DEFINE_integer("top_k", 0, "top-k when sampling (0 = off)")
flags.DEFINE_float("top_p", 1.0, "top-p when sampling (1 = off)")
flags.DEFINE_bool("remeasure_step_cost", False, "with --resume: measure the step-cost curve "
                  "again instead of keeping the stored one")
flags.DEFINE_bool("resume", False, "keep the runs already in --out (same settings) and "
                  "measure only the prompts it lacks")

# The reference PyTorch implementation on this model and machine (shared/ALGORITHM_NOTES.md):
# (15,5,15) without prompt seeding, S and tokens/s, first 20 prompts, 128 new tokens.
REFERENCE = {"mt_bench": (1.64, 8.7), "humaneval": (1.82, 9.5), "gsm8k": (1.94, 10.2)}


def load_prompts(engine, name: str, n: int) -> list[list[int]]:
    try:
        return common.encoded_prompts(engine, name, n, FLAGS.data_dir)
    except ValueError as e:
        raise app.UsageError(str(e)) from None


def parse_settings() -> list[LookaheadConfig]:
    return common.parse_settings(FLAGS.settings, [s == "on" for s in FLAGS.seeding])


def label(cfg: LookaheadConfig | None) -> str:
    if cfg is None:
        return "plain"
    return f"({cfg.W},{cfg.N},{cfg.G})" + (" +prompt" if cfg.prompt_seeding else "")


def summarize(runs: list[dict]) -> list[dict]:
    """Per (data set, method): totals and ratios over its prompts (`common.summarize_runs`)."""
    return common.summarize_runs(runs)


def plot_sweep(rows: list[dict], path: str) -> None:
    import matplotlib  # noqa: PLC0415
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ds in sorted({r["dataset"] for r in rows}):
        pts = sorted((r["W"], r["S"], r["speedup"]) for r in rows
                     if r["dataset"] == ds and r["method"] != "plain")
        axes[0].plot([p[0] for p in pts], [p[1] for p in pts], "o-", label=ds)
        axes[1].plot([p[0] for p in pts], [p[2] for p in pts], "o-", label=ds)
    axes[0].set(xlabel="W (N=5, G=W)", ylabel="step compression S", title="S against W")
    axes[1].axhline(1.0, color="gray", lw=0.8)
    axes[1].set(xlabel="W (N=5, G=W)", ylabel="speed-up over plain (wall clock)",
                title="speed-up against W")
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv):
    del argv
    from lookahead_jax.presets import load_engine  # noqa: PLC0415
    engine = load_engine(FLAGS.config, ckpt=FLAGS.ckpt)
    settings = parse_settings()
    data = {ds: load_prompts(engine, ds, FLAGS.num_prompts) for ds in FLAGS.datasets}
    sampling = Sampling(FLAGS.temperature, FLAGS.top_k, FLAGS.top_p)
    report = {"machine": common.machine_info(), "config": FLAGS.config,
              "sampling": dataclasses.asdict(sampling), "max_new_tokens": FLAGS.max_new_tokens, "num_prompts": FLAGS.num_prompts,
              "settings": [label(c) for c in settings], "runs": [], "compile_s": 0.0}
    if FLAGS.resume and os.path.exists(FLAGS.out):
        with open(FLAGS.out, encoding="utf-8") as f:
            old = json.load(f)
        if ((old["settings"], old["max_new_tokens"], old.get("sampling", dataclasses.asdict(Sampling())))
                != (report["settings"], FLAGS.max_new_tokens, report["sampling"])):
            raise app.UsageError(f"--resume: {FLAGS.out} was measured with other settings")
        report.update(runs=old["runs"], compile_s=old["compile_s"])
        report["step_cost_s"] = {int(k): v for k, v in old.get("step_cost_s", {}).items()}
    measured = {(r["dataset"], r["prompt"]) for r in report["runs"]}

    if FLAGS.step_cost_tokens and (FLAGS.remeasure_step_cost or not report.get("step_cost_s")):
        ts = [int(t) for t in FLAGS.step_cost_tokens]
        costs = measure_step_cost(engine.graphdef, engine.params, ts, cache_len=256)
        report["step_cost_s"] = costs
        print(common.markdown_table(
            ["tokens per step", "forward ms", "x one-token step"],
            [[t, 1e3 * c, c / costs[ts[0]]] for t, c in costs.items()]))

    t_start = time.time()
    order = [(i, ds) for i in range(FLAGS.num_prompts) for ds in data if i < len(data[ds])]
    for i, ds in order:  # interleaved, so a stopped run keeps every data set balanced
        ids = data[ds][i]
        if (ds, i) in measured:
            continue
        common_kw = dict(max_new_tokens=FLAGS.max_new_tokens, sampling=sampling, seed=i)
        plain = engine.generate_ids([ids], method="ar", **common_kw)
        runs = [(None, plain)]
        for cfg in settings:
            runs.append((cfg, engine.generate_ids([ids], method="lookahead", lookahead=cfg,
                                                  **common_kw)))
        for cfg, res in runs:
            st = res.stats
            report["compile_s"] += st.compile_s
            report["runs"].append({
                "dataset": ds, "prompt": i, "method": label(cfg), "tokens": st.total_tokens,
                "steps": st.steps, "prefill_s": st.prefill_s, "decode_s": st.decode_s,
                "exact": res.tokens == plain.tokens if sampling.greedy else None,
                "accepted_hist": st.extra.get("accepted_hist"),
                "W": cfg and cfg.W, "N": cfg and cfg.N, "G": cfg and cfg.G,
                "step_tokens": cfg.step_tokens if cfg else 1})
        done = [r for r in report["runs"] if r["dataset"] == ds and r["method"] != "plain"]
        exact = (f"exact {sum(r['exact'] for r in done)}/{len(done)}" if sampling.greedy
                 else "sampling")
        print(f"{ds} {i + 1}/{len(data[ds])}: {exact}  ({time.time() - t_start:.0f}s)",
              flush=True)
        report["summary"] = summarize(report["runs"])
        common.write_json(FLAGS.out, report)

    rows = report["summary"] = summarize(report["runs"])
    common.write_json(FLAGS.out, report)
    costs = report.get("step_cost_s")
    table = []
    for r in rows:
        ref = (REFERENCE.get(r["dataset"]) if r["method"] == "(15,5,15)" and sampling.greedy
               else None)
        pred = (r["S"] / relative_cost(costs, r["step_tokens"])) if costs else ""
        exact = "n/a" if r["exact"] is None else f"{r['exact']}/{r['prompts']}"
        table.append([r["dataset"], r["method"], exact, r["S"],
                      f"{ref[0]:.2f}" if ref else "", r["step_ms"], r["step_cost"],
                      r["tokens_per_s"], f"{ref[1]:.1f}" if ref else "", r["speedup"], pred])
    print()
    print(common.markdown_table(
        ["data set", "method", "exact", "S", "ref S", "ms/step", "step cost (plain steps)",
         "tokens/s", "ref tokens/s", "speed-up", "S / curve cost"], table))
    print(f"\ncompile time (excluded above): {report['compile_s']:.0f}s; "
          f"JSON: {FLAGS.out}")
    if FLAGS.plot:
        plot_sweep(rows, FLAGS.plot)
        print(f"plot: {FLAGS.plot}")


if __name__ == "__main__":
    app.run(main)
