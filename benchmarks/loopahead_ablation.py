"""LoopAhead's ablation (#21 item 3, the paper's Table 3): the drafter (LAD) on / off x
scheduling on / off, at matched depths (r1 the drafter's draft depth, r2 = 2 r1) and at fixed
budgets (nodes advanced per step), beside plain decoding and LoopSpec at the same depths.

    python -m benchmarks.loopahead_ablation --config=tiny_ouro --lad=checkpoints/tiny_ouro_lad

`--r2` sets the feedback depth (default 2 r1). Greedy by default; `--temperature=0.7` (top-k /
top-p as the CLI's) samples instead, and `--node_costs=0.1,0.3` adds the drafter with
calibrated retention (`retain="calibrated"`, one pair of rows per node cost), and
`--suspend_below=1` sets LoopAhead's sampling suspension threshold (a child the feedback
readout gives at least that chance of acceptance keeps running beside the likeliest; 1: only
the likeliest runs; default the method's: 0, no child pauses, without a budget and 1 under
one, recorded per row). Per
budget and method, over the prompts of each data set: shared-block calls (loops)
per output token relative to plain decoding's R, candidate advances per token, the share of
all advances spent on nodes that verification discarded, the share of discarded nodes that had
reached full depth R (the paper's "discarded candidates reaching R"), the share of verified
tokens that were drafted children (acceptance), whether every output equals plain greedy
(greedy only: a sampled output is one draw; sampling's exactness is pinned by the chi-square
tests of tests/test_loopahead_sampling.py and tests/test_sampling_generations.py), and CPU
tokens/s beside plain's (measured in the same run, one prompt
after another; on this CPU a step's cost grows with its nodes, so loops per token is the
accelerator-relevant figure). "sched gain" is loops per token with scheduling off over loops
per token with it on, the same drafter and budget. Prints Markdown, writes JSON.
"""

from __future__ import annotations

import os
import sys
import time

from absl import app, flags

from benchmarks.common import encoded_prompts, machine_info, markdown_table, write_json
from benchmarks.looped_bench import measure_totals as measure
from lookahead_jax.looped.loopahead import LoopAhead
from lookahead_jax.sampling import Sampling
from models.config import ConfigError

FLAGS = flags.FLAGS


def define_flags() -> None:
    if "budgets" in FLAGS:
        return
    flags.DEFINE_string("config", "tiny_ouro", "Looped preset.")
    flags.DEFINE_string("ckpt", None, "Checkpoint (default: checkpoints/<config>).")
    flags.DEFINE_string("lad", None, "Drafter: a train_lad workdir or its drafter file.")
    flags.DEFINE_list("budgets", ["0", "4", "8"], "Nodes advanced per step (0: no budget).")
    flags.DEFINE_integer("r2", None, "Feedback depth (default 2 r1, or 0 when that is not "
                         "below R).")
    flags.DEFINE_list("node_costs", [], "Sampling: also the drafter with calibrated retention "
                      "(retain=calibrated) at each of these node costs (the drafter needs a "
                      "calibration: python -m train_lad.calibrate).")
    flags.DEFINE_list("sets", ["gsm8k", "humaneval", "mt_bench"], "Prompt sets.")
    flags.DEFINE_integer("num_prompts", 5, "Prompts per data set.")
    flags.DEFINE_integer("max_new_tokens", 64, "New tokens per prompt.")
    flags.DEFINE_float("temperature", 0.0, "Sampling temperature (0: greedy).")
    flags.DEFINE_integer("top_k", 0, "Sampling: top-k (0: off).")
    flags.DEFINE_float("top_p", 1.0, "Sampling: top-p (1: off).")
    flags.DEFINE_integer("seed", 0, "Sampling: the seed of every generation.")
    flags.DEFINE_float("suspend_below", None, "Sampling: LoopAhead's suspension threshold, a "
                       "child given at least this chance keeps running (default: the method's).")
    flags.DEFINE_string("data_dir", None, "Prompt sets (default ../shared/data).")
    flags.DEFINE_string("out", None, "JSON output (default benchmarks/results/"
                        "loopahead_ablation_<config>.json; sampling: "
                        "loopahead_ablation_<config>_t<T>_s<S>.json).")


def ablation_methods(engine, lad: str, budget: int, loopspec: bool = True,
                     sampling: Sampling = Sampling(), r2: int | None = None,
                     node_costs: tuple[float, ...] = (),
                     suspend_below: float | None = None) -> dict:
    """(label, drafter on, scheduling on, node cost) -> Method: LoopAhead with the drafter on
    / off x scheduling on / off at the drafter's depths (r1 its draft depth, r2 given or 2 r1)
    and the budget (node cost None), the drafter with calibrated retention at each of
    node_costs (sampling), every LoopAhead at `suspend_below` (None: the method's default),
    and (with `loopspec`) LoopSpec proposing at the same depths (None, None, None; it has no
    budget)."""
    drafted = engine.build_method("loopahead", sampling, lad=lad)
    r1, loops = drafted.r1, engine.config.num_loops
    if r2 is None:
        r2 = 2 * r1 if 2 * r1 < loops else 0
    out = {}
    for lad_on, cost in [(True, None), *((True, float(c)) for c in node_costs),
                         (False, None)]:
        for sched in (True, False):
            label = (f"LAD {'on' if lad_on else 'off'}"
                     + ("" if cost is None else f" (calibrated, node cost {cost:g})")
                     + f", scheduling {'on' if sched else 'off'}")
            extra = {} if cost is None else {"retain": "calibrated", "node_cost": cost}
            if suspend_below is not None:
                extra["suspend_below"] = suspend_below
            out[label, lad_on, sched, cost] = engine.build_method(
                "loopahead", sampling, lad=drafted.drafter if lad_on else None, r1=r1, r2=r2,
                scheduling=sched, max_active=budget, **extra)
    if loopspec:
        out[f"LoopSpec (d1={r1}, d2={r2})", None, None, None] = engine.build_method(
            "loopspec", sampling, d1=r1, d2=r2)
    return out


def summarize(tot: dict, plain: dict, r_full: int, greedy: bool = True) -> dict:
    ver = max(tot["verified"], 1)
    return {"loops_vs_plain": tot["loops"] / ver / r_full, "acceptance": tot["accepted"] / ver,
            "advances_per_token": tot["advances"] / ver,
            "discarded_advance_share": tot["discarded_advances"] / max(tot["advances"], 1),
            "discarded_full_share": tot["discarded_full"] / max(tot["discarded"], 1),
            "exact": tot["outputs"] == plain["outputs"] if greedy else None,
            "cpu_speedup": (tot["tokens"] / tot["seconds"]) / (plain["tokens"] / plain["seconds"])}


def run(config: str, lad: str, budgets: list[int], sets: list[str], num_prompts: int,
        new: int, data_dir: str | None = None, ckpt: str | None = None,
        sampling: Sampling = Sampling(), seed: int = 0, r2: int | None = None,
        node_costs: tuple[float, ...] = (), suspend_below: float | None = None,
        log=lambda m: print(m, file=sys.stderr, flush=True)) -> dict:
    from lookahead_jax.engine import Engine  # noqa: PLC0415
    ckpt = ckpt or os.path.join("checkpoints", config)
    engine = Engine.from_preset(config, ckpt=ckpt)
    r_full = engine.config.num_loops
    prompts = [p for s in sets for p in encoded_prompts(engine, s, num_prompts, data_dir)]
    start = time.time()
    plain = measure(engine, engine.build_method("ar", sampling), prompts, new, seed)
    rows = []
    for i, budget in enumerate(budgets):
        methods = ablation_methods(engine, lad, budget, loopspec=i == 0, sampling=sampling,
                                   r2=r2, node_costs=node_costs,
                                   suspend_below=suspend_below)
        for (label, lad_on, sched, cost), method in methods.items():
            row = {"budget": budget if lad_on is not None else None, "method": label,
                   "lad": lad_on, "scheduling": sched, "node_cost": cost,
                   "capacity": method.tree_capacity(r_full),
                   "suspend_below": (None if sampling.greedy or lad_on is None
                                     else method.suspend_below),
                   **summarize(measure(engine, method, prompts, new, seed), plain, r_full,
                               sampling.greedy)}
            rows.append(row)
            log(f"budget {budget} {label}: {row} ({time.time() - start:.0f} s)")
    for row in rows:  # scheduling's effect: off over on, same drafter and budget
        if row["scheduling"]:
            off, = [r for r in rows if (r["budget"], r["lad"], r["node_cost"], r["scheduling"])
                    == (row["budget"], row["lad"], row["node_cost"], False)]
            row["sched_gain"] = off["loops_vs_plain"] / row["loops_vs_plain"]
    return {"config": config, "checkpoint": ckpt, "lad": lad, "num_loops": r_full,
            "sampling": {"temperature": sampling.temperature, "top_k": sampling.top_k,
                         "top_p": sampling.top_p, "seed": seed},
            "suspend_below": threshold_of(rows, sampling, suspend_below),
            "sets": sets, "num_prompts": num_prompts, "max_new_tokens": new,
            "prompts": len(prompts), "machine": machine_info(), "rows": rows}


def threshold_of(rows: list[dict], sampling: Sampling, given: float | None):
    """The run's suspension threshold: None when greedy, else the one given, else the LoopAhead
    rows' (the method's default, which follows the budget), "auto" when they differ."""
    if sampling.greedy:
        return None
    if given is not None:
        return given
    used = {r["suspend_below"] for r in rows if r["suspend_below"] is not None}
    return used.pop() if len(used) == 1 else "auto"


def table(rec: dict) -> str:
    head = ["budget", "method", "loops/token vs plain", "sched gain", "advances/token",
            "advances on discarded", "discarded reaching R", "acceptance", "= plain",
            "CPU speed-up"]
    budget = {None: "n/a", 0: "none"}
    body = [[budget.get(r["budget"], r["budget"]), r["method"], f"{r['loops_vs_plain']:.3f}",
             f"{r['sched_gain']:.3f}x" if "sched_gain" in r else "",
             r["advances_per_token"], f"{100 * r['discarded_advance_share']:.1f}%",
             f"{100 * r['discarded_full_share']:.1f}%", f"{r['acceptance']:.2f}",
             "n/a (sampling)" if r["exact"] is None else r["exact"],
             f"{r['cpu_speedup']:.2f}x"] for r in rec["rows"]]
    return markdown_table(head, body)


def result_name(rec: dict) -> str:
    """loopahead_ablation_<config>, and when sampling _t<T>_s<S> (S: LoopAhead's suspension
    threshold, given or the method's default; "auto" when the default differs by budget)."""
    name = f"loopahead_ablation_{rec['config']}"
    threshold = rec["suspend_below"]
    if threshold is not None:  # sampling
        s = threshold if isinstance(threshold, str) else f"{threshold:g}"
        name += f"_t{rec['sampling']['temperature']:g}_s{s}"
    return name


def main(argv) -> int:
    if not FLAGS.lad:
        print("error: --lad (a drafter file or train_lad workdir) is required", file=sys.stderr)
        return 2
    sampling = Sampling(FLAGS.temperature, top_k=FLAGS.top_k, top_p=FLAGS.top_p)
    if FLAGS.suspend_below is not None and sampling.greedy:
        print("error: --suspend_below applies to sampling (greedy feedback runs only the "
              "argmax child): give a --temperature", file=sys.stderr)
        return 2
    if FLAGS.suspend_below is not None:
        try:  # LoopAhead's own check, before minutes of plain decoding
            LoopAhead(sampling, suspend_below=FLAGS.suspend_below)
        except ConfigError as e:
            print(f"error: --suspend_below: {e}", file=sys.stderr)
            return 2
    if FLAGS.node_costs and sampling.greedy:
        print("error: --node_costs (calibrated retention) applies to sampling: give a "
              "--temperature", file=sys.stderr)
        return 2
    rec = run(FLAGS.config, FLAGS.lad, [int(b) for b in FLAGS.budgets], FLAGS.sets,
              FLAGS.num_prompts, FLAGS.max_new_tokens, FLAGS.data_dir, FLAGS.ckpt,
              sampling=sampling, seed=FLAGS.seed, r2=FLAGS.r2,
              node_costs=tuple(float(c) for c in FLAGS.node_costs),
              suspend_below=FLAGS.suspend_below)
    mode = "greedy" if sampling.greedy else f"sampling ({sampling})"
    if rec["suspend_below"] == "auto":
        mode += ", suspend_below the default (0 without a budget, 1 under one)"
    elif rec["suspend_below"] is not None:
        mode += f", suspend_below {rec['suspend_below']:g}"
    md = (f"# LoopAhead ablation: {rec['config']} (R = {rec['num_loops']}), {rec['prompts']} "
          f"prompts ({', '.join(rec['sets'])}), {rec['max_new_tokens']} new tokens, {mode}\n\n"
          + table(rec) + "\n")
    print(md)
    out = FLAGS.out or os.path.join("benchmarks", "results", result_name(rec) + ".json")
    write_json(out, rec)
    with open(os.path.splitext(out)[0] + ".md", "w", encoding="utf-8") as f:
        f.write(md)
    return 0


if __name__ == "__main__":
    define_flags()
    app.run(main)
