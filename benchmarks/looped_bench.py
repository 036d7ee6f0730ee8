"""Looped-model decoding: plain full depth vs LoopSpec vs LoopAhead (and ablations), prompt by
prompt on GSM8K / HumanEval / MT-Bench, greedy.

    python -m benchmarks.looped_bench --config=tiny_ouro --lad=<train_lad workdir> \\
        --num_prompts=5 --max_new_tokens=64

Per method and data set: shared-block calls (loops) per output token, candidate advances per
output token (plain: R of each), tokens/s (prefill + decode, compile excluded, after one
warm-up prompt), speed-up over plain decoding, and whether every output equals plain greedy.
The first token of each prompt (from the prefill) is not counted. Methods:
`loopspec` (d1 = 1), `loopspec_d2` (the dual proposal at 2), `loopahead` (r1 the drafter's
draft depth, r2 = 2 r1; with --lad), `loopspec_matched` (LoopSpec at LoopAhead's depths,
d1 = r1 and d2 = r2; with --lad), `loopahead_nodrafter` (native proposals only),
`loopahead_nosched` (feedback scheduling off). Prints a Markdown table, writes JSON.
"""

from __future__ import annotations

import os
import sys

from absl import app, flags

from benchmarks.common import encoded_prompts, machine_info, markdown_table, write_json
from lookahead_jax.method import Method
from lookahead_jax.sampling import Sampling

FLAGS = flags.FLAGS
SETS = ("gsm8k", "humaneval", "mt_bench")


def define_flags() -> None:
    if "num_prompts" in FLAGS:
        return
    flags.DEFINE_string("config", "tiny_ouro", "Looped preset.")
    flags.DEFINE_string("ckpt", None, "Checkpoint (default: checkpoints/<config>).")
    flags.DEFINE_string("lad", None, "Drafter: a train_lad workdir or its drafter .safetensors "
                        "file (LoopAhead rows).")
    flags.DEFINE_integer("num_prompts", 5, "Prompts per data set.")
    flags.DEFINE_integer("max_new_tokens", 64, "New tokens per prompt.")
    flags.DEFINE_string("data_dir", None, "Prompt sets (default ../shared/data).")
    flags.DEFINE_string("out", None, "JSON output (default benchmarks/results/looped_<config>"
                        ".json).")


def looped_methods(engine, sampling: Sampling, lad: str | None = None) -> dict[str, Method]:
    """name -> Method for a looped model, every one built by the registry
    (`engine.build_method`) with `sampling`: plain, LoopSpec (d1 = 1; d2 = 2 when the model
    has more than 2 loops), and LoopAhead with r1 the drafter's draft depth (1 without a
    drafter) and r2 = 2 r1 (0 when not below the loops): with `lad` (a drafter file or a
    train_lad workdir) `loopahead`, `loopahead_nosched` and `loopspec_matched` (LoopSpec
    proposing at LoopAhead's depths, d1 = r1 and d2 = r2), always `loopahead_nodrafter`."""
    loops = engine.config.num_loops
    out = {"ar": engine.build_method("ar", sampling),
           "loopspec": engine.build_method("loopspec", sampling, d1=1)}
    if loops > 2:
        out["loopspec_d2"] = engine.build_method("loopspec", sampling, d1=1, d2=2)
    drafted = engine.build_method("loopahead", sampling, lad=lad) if lad else None
    r1 = drafted.r1 if drafted is not None else 1  # the registry takes r1 from the drafter
    r2 = 2 * r1 if 2 * r1 < loops else 0
    if drafted is not None:
        out["loopahead"] = engine.build_method("loopahead", sampling, lad=drafted.drafter, r2=r2)
        # LoopSpec at LoopAhead's depths (proposals at r1 and r2): the matched-depth baseline
        out["loopspec_matched"] = engine.build_method("loopspec", sampling, d1=r1, d2=r2)
        out["loopahead_nosched"] = engine.build_method("loopahead", sampling,
                                                       lad=drafted.drafter, r2=r2,
                                                       scheduling=False)
    out["loopahead_nodrafter"] = engine.build_method("loopahead", sampling, r1=r1, r2=r2)
    return out


def loop_counts(method: Method, result, r_full: int) -> tuple[int, int, int]:
    """(shared-block calls, candidate advances, verified tokens) of one generation; plain
    decoding runs every token through all r_full loops. The first token (from the prefill)
    is not counted."""
    n = len(result.tokens[0]) - 1
    if method.name == "ar":
        return r_full * n, r_full * n, n
    e = result.stats.extra
    return e["loops"], e["advances"], e["verified_tokens"]


COUNTS = ("loops", "advances", "verified", "accepted", "discarded", "discarded_advances",
          "discarded_full")


def measure_totals(engine, method, prompts: list[list[int]], new: int, seed: int = 0) -> dict:
    """Totals over the prompts (after one warm-up generation): the `COUNTS`, tokens, seconds
    (prefill + decode) and the outputs."""
    engine.generate_ids(prompts[:1], method=method, max_new_tokens=new, seed=seed)
    r_full = engine.config.num_loops
    tot = dict.fromkeys(COUNTS, 0) | {"tokens": 0, "seconds": 0.0, "outputs": []}
    for p in prompts:
        r = engine.generate_ids([p], method=method, max_new_tokens=new, seed=seed)
        lo, ad, ve = loop_counts(method, r, r_full)
        e = r.stats.extra
        acc = e.get("accepted", 0)  # verifications that kept a drafted child
        for k, v in (("loops", lo), ("advances", ad), ("verified", ve), ("accepted", acc),
                     ("discarded", e.get("discarded", 0)),
                     ("discarded_advances", e.get("discarded_advances", 0)),
                     ("discarded_full", e.get("discarded_full", 0))):
            tot[k] += v
        tot["tokens"] += r.stats.total_tokens
        tot["seconds"] += r.stats.prefill_s + r.stats.decode_s
        tot["outputs"].append(r.tokens[0])
    return tot


def measure(engine, method, prompts: list[list[int]], new: int) -> dict:
    """Per output token: loops and candidate advances, tokens/s, and the outputs."""
    tot = measure_totals(engine, method, prompts, new)
    ver = max(tot["verified"], 1)
    return {"loops_per_token": tot["loops"] / ver, "advances_per_token": tot["advances"] / ver,
            "tokens_per_s": tot["tokens"] / tot["seconds"] if tot["seconds"] else float("nan"),
            "outputs": tot["outputs"]}


def main(argv) -> int:
    from lookahead_jax.engine import Engine  # noqa: PLC0415
    ckpt = FLAGS.ckpt or os.path.join("checkpoints", FLAGS.config)
    engine = Engine.from_preset(FLAGS.config, ckpt=ckpt)
    r_full = engine.config.num_loops
    table = looped_methods(engine, Sampling(), FLAGS.lad)
    results, rows = {}, []
    for name in SETS:
        prompts = encoded_prompts(engine, name, FLAGS.num_prompts, FLAGS.data_dir)
        base = None
        for label, method in table.items():
            m = measure(engine, method, prompts, FLAGS.max_new_tokens)
            if label == "ar":
                base = m
            m["exact"] = m["outputs"] == base["outputs"]
            m["speedup"] = m["tokens_per_s"] / base["tokens_per_s"]
            results.setdefault(name, {})[label] = m
            rows.append([name, label, m["loops_per_token"], m["advances_per_token"],
                         m["tokens_per_s"], f"{m['speedup']:.2f}x", m["exact"]])
            print(f"{name} {label}: {({k: v for k, v in m.items() if k != 'outputs'})}",
                  file=sys.stderr, flush=True)
    print(markdown_table(["data set", "method", "loops/token", "advances/token", "tokens/s",
                          "speed-up", "= plain"], rows))
    out = FLAGS.out or os.path.join("benchmarks", "results", f"looped_{FLAGS.config}.json")
    write_json(out, {"config": FLAGS.config, "checkpoint": ckpt, "lad": FLAGS.lad,
                     "num_prompts": FLAGS.num_prompts, "max_new_tokens": FLAGS.max_new_tokens,
                     "num_loops": r_full, "machine": machine_info(), "results": results})
    return 0


if __name__ == "__main__":
    define_flags()
    app.run(main)
