"""Bytes and FLOPs of one decoding step, read from the compiled program, against the ideal.

    python -m benchmarks.program_cost [--out benchmarks/results] [--presets llama7b,llama13b]
                                      [--cache_lens 512,4000] [--quick]

For each preset shape (random weights never materialised: lowered from abstract arrays), cache
length, method setting (plain; lookahead (15,5,15), (7,5,7), (5,3,5)) and attention accounting
(`dense`: the dense path's program as compiled; `fused`: the attention counted as a fused
kernel's traffic, what the Pallas kernel moves on a GPU or TPU), prints and writes
`program_cost.json` / `program_cost.md`: GB accessed, the ideal (weights + the allocated cache,
each read once), their ratio, the step against the plain step, GFLOPs and temporary bytes.
Programs are compiled in float32 for this host (see `lookahead_jax.tuning.program_cost`).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any, Sequence

import jax

from benchmarks import common
from lookahead_jax.store.presets import load_preset
from lookahead_jax.tuning.program_cost import ATTENTIONS, method_cost

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
SETTINGS = (("ar", {}), ("lookahead", dict(W=15, N=5, G=15)),
            ("lookahead", dict(W=7, N=5, G=7)), ("lookahead", dict(W=5, N=3, G=5)))


def label(method: str, settings: dict) -> str:
    return "plain" if method == "ar" else "({W},{N},{G})".format(**settings)


def rows_for(preset: str, cache_len: int, settings=SETTINGS) -> list[dict[str, Any]]:
    cfg = load_preset(preset).model
    out = []
    for attention in ATTENTIONS:
        plain = None
        for method, st in settings:
            c = method_cost(cfg, method, st, cache_len=cache_len, attention=ATTENTIONS[attention])
            if plain is None:  # SETTINGS start with the plain step
                plain = c
            out.append(dict(preset=preset, cache_len=cache_len, attention=attention,
                            setting=label(method, st), tokens=c.tokens, gb=c.bytes_accessed / 1e9,
                            ideal_gb=c.ideal_bytes / 1e9, excess=c.excess,
                            over_plain=c.bytes_accessed / plain.bytes_accessed,
                            gflops=c.flops / 1e9, temp_mb=c.temp_bytes / 1e6,
                            cost=c.to_dict()))
    return out


def render(rec: dict) -> str:
    f = lambda x, n=3: f"{x:.{n}f}"  # noqa: E731
    table = common.markdown_table(
        ["preset", "cache", "attention", "setting", "T", "GB", "ideal GB", "x ideal",
         "x plain", "GFLOP", "temp MB"],
        [[r["preset"], r["cache_len"], r["attention"], r["setting"], r["tokens"], f(r["gb"], 2),
          f(r["ideal_gb"], 2), f(r["excess"]), f(r["over_plain"]), f(r["gflops"], 1),
          f(r["temp_mb"], 0)] for r in rec["rows"]])
    return "\n".join([
        "# Program cost of one step (`python -m benchmarks.program_cost`)", "",
        f"XLA's cost analysis of each step's forward pass compiled on {rec['backend']} in "
        "float32 (bytes scale with the element size). 'ideal': weights + the allocated KV "
        "cache, each read once. 'dense': the dense attention as compiled; 'fused': the "
        "attention counted as a fused kernel's traffic (the Pallas kernel). Not counted: the "
        "commit of accepted K/V (an in-place update of a few slots).", "", table, ""])


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.program_cost", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=RESULTS, help="directory for program_cost.json/.md")
    ap.add_argument("--presets", default="llama7b,llama13b", help="comma-separated presets")
    ap.add_argument("--cache_lens", default="512,4000", help="comma-separated cache lengths")
    ap.add_argument("--quick", action="store_true",
                    help="smollm2_135m at one cache length, plain and (5,3,5) (for a test)")
    return ap.parse_args(argv)


def run(args: argparse.Namespace) -> dict:
    t0 = time.perf_counter()
    presets = ["smollm2_135m"] if args.quick else args.presets.split(",")
    lens = [128] if args.quick else [int(x) for x in args.cache_lens.split(",")]
    settings = (SETTINGS[0], SETTINGS[3]) if args.quick else SETTINGS
    rows = [r for p in presets for s in lens for r in rows_for(p, s, settings)]
    rec = dict(args=vars(args), machine=common.machine_info(), backend=jax.default_backend(),
               rows=rows, wall_s=time.perf_counter() - t0)
    os.makedirs(args.out, exist_ok=True)
    common.write_json(os.path.join(args.out, "program_cost.json"), rec)
    text = render(rec)
    with open(os.path.join(args.out, "program_cost.md"), "w", encoding="utf-8") as fh:
        fh.write(text)
    print(text)
    return rec


def main(argv: Sequence[str] | None = None) -> int:
    run(parse_args(sys.argv[1:] if argv is None else argv))
    return 0


if __name__ == "__main__":
    sys.exit(main())
