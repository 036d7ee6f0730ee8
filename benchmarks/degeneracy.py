"""How degenerate a model's greedy text is, on the benchmark prompts (#21's yardstick).

    python -m benchmarks.degeneracy [--config smollm2_135m] [--ckpt PATH] [--dtype bfloat16]
        [--num_prompts 20] [--max_new_tokens 128] [--batch_size 5]
        [--sets mt_bench,humaneval,gsm8k,mbpp,classeval] [--data_dir ../shared/data]
        [--out benchmarks/results] [--tag NAME]
    python -m benchmarks.degeneracy --compare A.json B.json [--resamples 10000] [--seed 0]
        [--skip 0]

A looped model trained here is only worth drafting for if it writes text as a real model does:
#21 asks that its greedy outputs be no more degenerate than SmolLM2-135M-Instruct's on the same
prompts, measured the same way. For each data set, the first --num_prompts prompts (MT-Bench
turn 1, GSM8K and MBPP through the chat template, HumanEval and ClassEval raw, as the suite
encodes them) are decoded greedily (plain decoding), --batch_size at a time (5), and each output
is scored:

- cycle: the output (EOS removed) ends in a repeated cycle: for some period p <= 16, its last
  max(3p, 12) tokens repeat with period p (`ends_in_cycle`). "a a a a ...", "x y x y ...", a
  line printed over and over. An output that stopped at EOS can still end in a cycle.
- distinct-4: distinct 4-grams over all 4-grams of the output (`distinct_ngram_ratio`); 1.0 for
  text that never repeats a 4-gram, near 0 for a loop.
- eos: the output ended with an end-of-sequence token before --max_new_tokens.

--dtype runs the model in another dtype than its preset's (bfloat16 for a float32 preset): the
same model with other numerics, a yardstick for how far these statistics move when nothing but
rounding changes. Prompts too long for the model (or for --max_positions) are left out and
counted. Per set: the share of outputs ending in a cycle, the mean distinct-4 ratio, the share
ending at EOS, the mean length. Prints a Markdown table and writes degeneracy_<tag>.json (every
output's ids, text and scores) into --out.

--compare reads two such files (no model is loaded) and pairs their outputs prompt by prompt,
per set and over all sets (when there are two or more): outputs ending in a cycle in each and
the difference of their shares A - B, the mean distinct-4 difference A - B, and the two
differences' 95% paired bootstrap intervals (prompts resampled with replacement, --resamples
times). One output's distinct-4 ranges from under 0.2 to 1.0, so at 20 prompts a set a mean
moves by several hundredths with the prompts drawn; the interval says whether a gap is more
than that. A cycle is rare (a few outputs in a hundred), so one cycle more in A than in B is
well inside its interval: the interval says how many more it would take.
--skip N leaves out each set's first N prompts: run with --num_prompts 80 and compare with
--skip 20 to score a model on prompts the 20-prompt sets do not hold (a development split for
choosing between training runs, so the 20 stay unused for that choice).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Sequence

import numpy as np

from benchmarks import common
from lookahead_jax.generation import bucket_length

MAX_PERIOD = 16
MIN_CYCLE_TOKENS = 12


def ends_in_cycle(ids: Sequence[int], max_period: int = MAX_PERIOD,
                  min_tokens: int = MIN_CYCLE_TOKENS) -> int:
    """The smallest period p <= max_period such that the last max(3p, min_tokens) tokens of
    `ids` repeat with period p (ids[i] == ids[i - p] over that tail), or 0 when there is none
    (or the output is shorter than that tail)."""
    ids = list(ids)
    for p in range(1, max_period + 1):
        tail = max(3 * p, min_tokens)
        if len(ids) < tail:
            return 0
        if all(ids[i] == ids[i - p] for i in range(len(ids) - tail + p, len(ids))):
            return p
    return 0


def distinct_ngram_ratio(ids: Sequence[int], n: int = 4) -> float:
    """Distinct n-grams over all n-grams of `ids` (1.0 when there are none)."""
    grams = [tuple(ids[i:i + n]) for i in range(len(ids) - n + 1)]
    return len(set(grams)) / len(grams) if grams else 1.0


def score(ids: Sequence[int], eos_ids: Sequence[int]) -> dict:
    """One output's scores: cycle period (0: none), distinct-4, length, ended at EOS."""
    ids = list(ids)
    eos = bool(ids) and ids[-1] in set(eos_ids)
    body = ids[:-1] if eos else ids
    return {"cycle": ends_in_cycle(body), "distinct4": round(distinct_ngram_ratio(body), 4),
            "length": len(body), "eos": eos}


def summarize(scores: list[dict]) -> dict:
    n = max(len(scores), 1)
    return {"prompts": len(scores),
            "cycle_share": sum(s["cycle"] > 0 for s in scores) / n,
            "distinct4": sum(s["distinct4"] for s in scores) / n,
            "eos_share": sum(s["eos"] for s in scores) / n,
            "mean_length": sum(s["length"] for s in scores) / n}


def fits(prompt_len: int, max_new_tokens: int, max_positions: int) -> bool:
    """Whether a prompt of prompt_len tokens, padded to its bucket as `generate_ids` pads it,
    and max_new_tokens fit in max_positions."""
    return bucket_length(prompt_len) + max_new_tokens <= max_positions


def run(engine, sets: Sequence[str], num_prompts: int, max_new_tokens: int,
        data_dir: str | None, batch_size: int = 5, max_positions: int | None = None,
        log=lambda m: None) -> dict:
    """{set: {"summary": ..., "outputs": [{prompt, ids, text, scores}], "too_long": [prompt
    indices]}} for greedy plain decoding, batch_size prompts at a time (a batch's prefill
    holds all its prompts' activations). Prompts that do not fit in max_positions (default: the
    model's) are left out and listed; give two models the same max_positions to score both on
    the same prompts."""
    limit = max_positions or engine.config.max_position_embeddings
    out = {}
    for name in sets:
        every = common.encoded_prompts(engine, name, num_prompts, data_dir)
        kept = [i for i, p in enumerate(every) if fits(len(p), max_new_tokens, limit)]
        too_long = sorted(set(range(len(every))) - set(kept))
        prompts = [every[i] for i in kept]
        t0 = time.perf_counter()
        tokens = []
        for i in range(0, len(prompts), batch_size):
            tokens += engine.generate_ids(prompts[i:i + batch_size], method="ar",
                                          max_new_tokens=max_new_tokens).tokens
        outputs = [{"prompt": i, "ids": list(map(int, ids)), "text": engine.decode(ids),
                    "scores": score(ids, engine.eos_ids)}
                   for i, ids in zip(kept, tokens)]
        out[name] = {"summary": summarize([o["scores"] for o in outputs]), "outputs": outputs,
                     "too_long": too_long}
        log(f"{name}: {len(prompts)} prompts in {time.perf_counter() - t0:.0f} s")
    return out


def table(results: dict) -> str:
    rows = []
    for name, r in results.items():
        s = r["summary"]
        rows.append([name, s["prompts"], len(r["too_long"]), f"{s['cycle_share']:.2f}",
                     f"{s['distinct4']:.3f}", f"{s['eos_share']:.2f}", f"{s['mean_length']:.0f}"])
    return common.markdown_table(["set", "prompts", "too long", "ends in a cycle", "distinct-4",
                                  "ends at EOS", "mean length"], rows)


def compare(a: dict, b: dict, resamples: int = 10_000, seed: int = 0, skip: int = 0) -> dict:
    """Paired comparison of two `run` results (A against B) on the prompts both scored, per
    set and over "all" sets (where there are two or more): {set: {prompts, cycles_a, cycles_b,
    cycle_diff, cycle_low, cycle_high, distinct4_a, distinct4_b, diff, low, high}} with
    cycle_diff the difference of the shares of outputs ending in a cycle, A - B, diff the mean
    distinct-4 difference A - B, and [cycle_low, cycle_high], [low, high] their 95% paired
    bootstrap intervals (both from the same resampled prompts). Prompts numbered below `skip`
    (each set's first `skip`) are left out."""
    if resamples < 1:
        raise ValueError(f"resamples must be >= 1, got {resamples}")
    if skip < 0:
        raise ValueError(f"skip must be >= 0, got {skip}")
    rng = np.random.default_rng(seed)
    pairs: dict[str, list] = {}
    for name in a:
        if name not in b:
            continue
        theirs = {o["prompt"]: o["scores"] for o in b[name]["outputs"]}
        pairs[name] = [(o["scores"], theirs[o["prompt"]]) for o in a[name]["outputs"]
                       if o["prompt"] in theirs and o["prompt"] >= skip]
    if not any(pairs.values()):
        raise ValueError("the two results share no scored prompt")
    if sum(bool(v) for v in pairs.values()) > 1:  # one set: "all" would be that set again
        pairs["all"] = [p for v in pairs.values() for p in v]
    out = {}
    for name, ps in pairs.items():
        if not ps:
            continue
        da = np.array([x["distinct4"] for x, _ in ps])
        db = np.array([y["distinct4"] for _, y in ps])
        ca = np.array([x["cycle"] > 0 for x, _ in ps], np.float64)
        cb = np.array([y["cycle"] > 0 for _, y in ps], np.float64)
        d, c = da - db, ca - cb
        draws = rng.integers(0, len(d), size=(resamples, len(d)))  # the same prompts for both
        low, high = np.quantile(d[draws].mean(axis=1), [0.025, 0.975])
        cycle_low, cycle_high = np.quantile(c[draws].mean(axis=1), [0.025, 0.975])
        out[name] = {"prompts": len(ps), "cycles_a": int(ca.sum()), "cycles_b": int(cb.sum()),
                     "cycle_diff": float(c.mean()), "cycle_low": float(cycle_low),
                     "cycle_high": float(cycle_high),
                     "distinct4_a": float(da.mean()), "distinct4_b": float(db.mean()),
                     "diff": float(d.mean()), "low": float(low), "high": float(high)}
    return out


def compare_table(cmp: dict) -> str:
    rows = [[name, c["prompts"], f"{c['cycles_a']} / {c['cycles_b']}",
             f"{c['cycle_diff']:+.3f} [{c['cycle_low']:+.3f}, {c['cycle_high']:+.3f}]",
             f"{c['distinct4_a']:.3f} / {c['distinct4_b']:.3f}",
             f"{c['diff']:+.3f} [{c['low']:+.3f}, {c['high']:+.3f}]"] for name, c in cmp.items()]
    return common.markdown_table(["set", "prompts", "end in a cycle: A / B",
                                  "cycle share A - B [95%]", "distinct-4: A / B",
                                  "distinct-4 A - B [95%]"], rows)


def _compare_main(paths: Sequence[str], resamples: int, seed: int, skip: int = 0) -> int:
    docs = []
    for path in paths:
        with open(path) as f:
            docs.append(json.load(f))
        if not isinstance(docs[-1], dict) or "sets" not in docs[-1]:
            raise SystemExit(f"{path} is not a benchmarks.degeneracy results file (no 'sets')")
    cmp = compare(docs[0]["sets"], docs[1]["sets"], resamples, seed, skip)
    said = [f"{p} ({d.get('config')}, {d.get('dtype') or 'its preset dtype'})"
            for p, d in zip(paths, docs)]
    left_out = f"\nEach set's first {skip} prompts left out.\n" if skip else ""
    print(f"A: {said[0]}\nB: {said[1]}\n{left_out}\n{compare_table(cmp)}")
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default="smollm2_135m")
    ap.add_argument("--ckpt", default=None)
    ap.add_argument("--dtype", default=None, choices=("float32", "bfloat16"),
                    help="the weights' and activations' dtype (default: the preset's); the same "
                         "model in another dtype shows how far the statistics move with the "
                         "numerics alone")
    ap.add_argument("--sets", default=",".join(common.DATASETS))
    ap.add_argument("--num_prompts", type=int, default=20)
    ap.add_argument("--max_new_tokens", type=int, default=128)
    ap.add_argument("--batch_size", type=int, default=5)
    ap.add_argument("--max_positions", type=int, default=None,
                    help="leave out prompts that do not fit in this many positions (default: "
                         "the model's); the same value for two models scores the same prompts")
    ap.add_argument("--data_dir", default=None)
    ap.add_argument("--out", default=os.path.join(common.REPO, "benchmarks", "results"))
    ap.add_argument("--tag", default=None, help="file name tag (default: the config)")
    ap.add_argument("--compare", nargs=2, metavar=("A", "B"), default=None,
                    help="compare two degeneracy_*.json files prompt by prompt (no model run)")
    ap.add_argument("--resamples", type=int, default=10_000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--skip", type=int, default=0,
                    help="--compare: leave out each set's first SKIP prompts")
    args = ap.parse_args(argv)
    if args.compare:
        missing = [p for p in args.compare if not os.path.isfile(p)]
        if missing:
            ap.error(f"no such file: {missing[0]}")
        try:
            return _compare_main(args.compare, args.resamples, args.seed, args.skip)
        except ValueError as e:  # compare's own checks: --resamples, --skip, prompts in common
            ap.error(str(e))
    sets = [s.strip() for s in args.sets.split(",") if s.strip()]
    unknown = [s for s in sets if s not in common.PROMPT_SETS]
    if unknown or min(args.num_prompts, args.max_new_tokens, args.batch_size) < 1:
        ap.error(f"unknown data set {unknown[0]!r} (known: {', '.join(common.DATASETS)})"
                 if unknown else "--num_prompts, --max_new_tokens and --batch_size must be >= 1")
    from lookahead_jax.engine import Engine  # noqa: PLC0415
    engine = Engine.from_preset(args.config, ckpt=args.ckpt, dtype=args.dtype)
    results = run(engine, sets, args.num_prompts, args.max_new_tokens, args.data_dir,
                  args.batch_size, args.max_positions,
                  log=lambda m: print(m, file=sys.stderr, flush=True))
    print(f"Greedy outputs of {args.config} (max {args.max_new_tokens} new tokens)\n\n"
          f"{table(results)}")
    os.makedirs(args.out, exist_ok=True)
    path = common.write_json(
        os.path.join(args.out, f"degeneracy_{args.tag or args.config}.json"),
        {"config": args.config, "ckpt": args.ckpt, "dtype": np.dtype(engine.dtype).name,
         "max_new_tokens": args.max_new_tokens,
         "max_positions": args.max_positions,
         "machine": common.machine_info(), "sets": results})
    print(f"wrote {path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
