"""Lookahead decoding against plain decoding, paired prompt by prompt, on real prompts.

    python -m benchmarks.lookahead_bench --num_prompts=20 --settings=15,5,15:7,5,7:5,3,5 \
        --seeding=off,on --out=benchmarks/results/lookahead_bench.json
    python -m benchmarks.lookahead_bench --datasets=humaneval --num_prompts=10 \
        --settings=1,5,1:3,5,3:5,5,5:7,5,7:10,5,10:15,5,15 --seeding=off \
        --plot=benchmarks/results/sweep_w.png --out=benchmarks/results/sweep_w.json
                                                        # (the last: S and speed-up against W)

For every prompt, plain greedy decoding runs first, then each lookahead setting, so the
machine's noise hits all methods alike. Reported per data set and method: step compression
S = tokens / steps (prefill counted as a step, as the reference counts), tokens/s over
prefill + decode (compile excluded, reported apart), speed-up over plain, and whether every
output equals plain greedy token for token. It also measures the step-cost curve (forward
time against tokens per step) that explains the speed-ups, and writes everything as JSON
after every prompt, so a stopped run keeps what it measured. Plain decoding and every setting
are built by the registry (`Engine.build_method`) with the run's sampling. With greedy
decoding on the reference's preset, the table shows the reference implementation's S and
tokens/s beside ours, read from `benchmarks/reference/lookahead_reference.json` (figures
measured outside this code; the file says where they come from).
"""

from __future__ import annotations

import dataclasses
import json
import os
import time

from absl import app, flags

from benchmarks import common
from lookahead_jax.engine import Engine
from lookahead_jax.lookahead.config import LookaheadConfig
from lookahead_jax.sampling import Sampling
from lookahead_jax.tuning.step_cost import measure_step_cost, relative_cost

FLAGS = flags.FLAGS


def define_flags() -> None:
    if "step_cost_tokens" in FLAGS:
        return
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


REFERENCE_FILE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "reference",
                              "lookahead_reference.json")


def load_reference(path: str = REFERENCE_FILE) -> dict:
    """The reference implementation's figures: {"config": preset, "source": where they come
    from, "by_label": {our method label: {data set: (S, tokens/s)}}} (lookahead rows only;
    labels as `label` writes them)."""
    with open(path, encoding="utf-8") as f:
        data = json.load(f)
    by_label = {}
    for run in data["runs"]:
        if run.get("settings") is None:
            continue
        w, n, g = run["settings"]
        key = label(LookaheadConfig(W=w, N=n, G=g, prompt_seeding=bool(run["prompt_pool"])))
        by_label[key] = {ds: (run["S"][ds], run["tokens_per_s"][ds]) for ds in run["S"]}
    return {"config": data["config"], "source": data["source"], "by_label": by_label}


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


def _resume(report: dict) -> None:
    """--resume: the runs (and step-cost curve) already in --out, if measured alike."""
    with open(FLAGS.out, encoding="utf-8") as f:
        old = json.load(f)
    greedy = dataclasses.asdict(Sampling())
    if ((old["settings"], old["max_new_tokens"], old.get("sampling", greedy))
            != (report["settings"], FLAGS.max_new_tokens, report["sampling"])):
        raise app.UsageError(f"--resume: {FLAGS.out} was measured with other settings")
    report.update(runs=old["runs"], compile_s=old["compile_s"])
    report["step_cost_s"] = {int(k): v for k, v in old.get("step_cost_s", {}).items()}


def _measure_step_cost(engine, report: dict) -> None:
    ts = [int(t) for t in FLAGS.step_cost_tokens]
    costs = measure_step_cost(engine.graphdef, engine.params, ts, cache_len=256)
    report["step_cost_s"] = costs
    print(common.markdown_table(
        ["tokens per step", "forward ms", "x one-token step"],
        [[t, 1e3 * c, c / costs[ts[0]]] for t, c in costs.items()]))


def _run_prompt(engine, methods: list, ds: str, i: int, ids: list[int], report: dict) -> None:
    """Plain decoding then every setting on one prompt; appends one record per method."""
    plain = None
    for cfg, method in methods:
        res = engine.generate_ids([ids], method=method, max_new_tokens=FLAGS.max_new_tokens,
                                  seed=i)
        if cfg is None:  # methods start with plain decoding
            plain = res
        st = res.stats
        report["compile_s"] += st.compile_s
        report["runs"].append({
            "dataset": ds, "prompt": i, "method": label(cfg), "tokens": st.total_tokens,
            "steps": st.steps, "prefill_s": st.prefill_s, "decode_s": st.decode_s,
            "exact": res.tokens == plain.tokens if method.sampling.greedy else None,
            "accepted_hist": st.extra.get("accepted_hist"),
            "W": cfg and cfg.W, "N": cfg and cfg.N, "G": cfg and cfg.G,
            "step_tokens": cfg.step_tokens if cfg else 1})


def _print_table(report: dict, greedy: bool) -> None:
    rows = report["summary"]
    costs = report.get("step_cost_s")
    ref = load_reference()
    refs = ref["by_label"] if greedy and report["config"] == ref["config"] else {}
    table = []
    for r in rows:
        rs = refs.get(r["method"], {}).get(r["dataset"])
        pred = (r["S"] / relative_cost(costs, r["step_tokens"])) if costs else ""
        exact = "n/a" if r["exact"] is None else f"{r['exact']}/{r['prompts']}"
        table.append([r["dataset"], r["method"], exact, r["S"],
                      f"{rs[0]:.2f}" if rs else "", r["step_ms"], r["step_cost"],
                      r["tokens_per_s"], f"{rs[1]:.1f}" if rs else "", r["speedup"], pred])
    print()
    print(common.markdown_table(
        ["data set", "method", "exact", "S", "ref S", "ms/step", "step cost (plain steps)",
         "tokens/s", "ref tokens/s", "speed-up", "S / curve cost"], table))
    if refs:
        print(f"\nref S, ref tokens/s: the reference implementation, measured outside this code "
              f"({os.path.relpath(REFERENCE_FILE)} says where they come from)")


def main(argv):
    del argv
    engine = Engine.from_preset(FLAGS.config, ckpt=FLAGS.ckpt)
    settings = parse_settings()
    data = {ds: load_prompts(engine, ds, FLAGS.num_prompts) for ds in FLAGS.datasets}
    sampling = Sampling(FLAGS.temperature, FLAGS.top_k, FLAGS.top_p)
    methods = [(None, engine.build_method("ar", sampling))]
    methods += [(cfg, engine.build_method("lookahead", sampling, lookahead=cfg))
                for cfg in settings]
    report = {"machine": common.machine_info(), "config": FLAGS.config,
              "sampling": dataclasses.asdict(sampling), "max_new_tokens": FLAGS.max_new_tokens,
              "num_prompts": FLAGS.num_prompts, "settings": [label(c) for c in settings],
              "runs": [], "compile_s": 0.0}
    if FLAGS.resume and os.path.exists(FLAGS.out):
        _resume(report)
    measured = {(r["dataset"], r["prompt"]) for r in report["runs"]}
    if FLAGS.step_cost_tokens and (FLAGS.remeasure_step_cost or not report.get("step_cost_s")):
        _measure_step_cost(engine, report)

    t_start = time.time()
    order = [(i, ds) for i in range(FLAGS.num_prompts) for ds in data if i < len(data[ds])]
    for i, ds in order:  # interleaved, so a stopped run keeps every data set balanced
        if (ds, i) in measured:
            continue
        _run_prompt(engine, methods, ds, i, data[ds][i], report)
        done = [r for r in report["runs"] if r["dataset"] == ds and r["method"] != "plain"]
        exact = (f"exact {sum(r['exact'] for r in done)}/{len(done)}" if sampling.greedy
                 else "sampling")
        print(f"{ds} {i + 1}/{len(data[ds])}: {exact}  ({time.time() - t_start:.0f}s)",
              flush=True)
        report["summary"] = summarize(report["runs"])
        common.write_json(FLAGS.out, report)

    report["summary"] = summarize(report["runs"])
    common.write_json(FLAGS.out, report)
    _print_table(report, sampling.greedy)
    print(f"\ncompile time (excluded above): {report['compile_s']:.0f}s; JSON: {FLAGS.out}")
    if FLAGS.plot:
        from benchmarks.plots import plot_sweep  # noqa: PLC0415  (matplotlib: only when asked)
        path = plot_sweep(report["summary"], FLAGS.datasets, FLAGS.plot)
        print(f"plot: {path or 'none (the settings are not a W sweep: G = W, 3 or more W)'}")


if __name__ == "__main__":
    define_flags()
    app.run(main)
