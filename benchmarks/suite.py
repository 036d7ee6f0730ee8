"""The benchmark suite: data sets x decoding methods, each prompt decoded by plain decoding
and then by every method, side by side in one run (the other benchmark commands:
benchmarks/README.md).

    python -m benchmarks.suite --num_prompts=20 \\
        --methods=ar,lookahead:15,5,15,lookahead:7,5,7,lookahead:5,3,5,prompt_lookup
    python -m benchmarks.suite --datasets=mt_bench,humaneval,gsm8k --num_prompts=10 \\
        --sweep=1,2,3,5,7,10,15 --sweep_N=5 --check_auto        # W sweep, fit, --auto check
    python -m benchmarks.suite --config=tiny_ouro --methods=ar,loopspec,loopahead --lad=<dir>
    python -m benchmarks.suite --config=tiny_ouro --temperature=0.7 --methods=ar,loopspec

Data sets: mt_bench (turn 1), humaneval, gsm8k, mbpp, classeval (`benchmarks/common.py`).
Methods (`--methods`, commas; a method's own numbers follow its colon):
  ar / plain            plain autoregressive decoding (always run first: the baseline)
  lookahead             the preset's lookahead settings
  lookahead:W,N,G       lookahead at those settings; append +prompt for prompt seeding
  prompt_lookup[:K[,M]] prompt lookup decoding (K draft tokens, suffixes up to M tokens)
  loopspec, loopspec_d2, loopspec_matched, loopahead, loopahead_nodrafter,
  loopahead_nosched     looped presets only (`looped_bench.looped_methods`; --lad: the
                        drafter, whose draft depth is LoopAhead's r1; loopspec_matched:
                        LoopSpec proposing at LoopAhead's depths r1 and r2)
A method that does not apply to the preset (lookahead on a looped model, LoopSpec on Llama) is
skipped with a note. Every method is built by the registry (`Engine.build_method`) with the
run's sampling (--temperature, --top_k, --top_p): each JSON run record says which sampling its
method decoded with, and exactness against plain is reported only when greedy.

Reported per data set x method: prompts, steps, tokens, S = tokens / steps (prefill counted),
S predicted by the fitted scaling law, ms per step, tokens/s (prefill + decode; compile
excluded), speed-up over plain, exactness against plain greedy (outputs equal token for
token), and for looped models loops per token. Written as JSON (after every prompt, so a
stopped run keeps what it measured), a Markdown table (`.md` beside it) and plots (`_sweep.png`:
S and speed-up against W with the fitted law beside the points, when the lookahead settings
form a W sweep; `_fit.png`: measured against predicted S; `_hist.png`: accepted-length
histograms per method).

`--sweep=W1,W2,...` runs lookahead at every W with G = W and N from `--sweep_N`, fits the
scaling law per data set and over all of them (in the JSON's "fits"; `--fit_out` also writes
them as a file for `decode --auto_fit`; `python -m benchmarks.fits` turns the committed
SmolLM2 sweep into the library's default fit). `--check_auto` then picks settings
the way `--auto` does (the pooled fit, or `--fit`; this run's step-cost curve), measures them
beside plain decoding on the same prompts if the sweep did not already, and reports whether
their speed-up is within 10% of the best measured lookahead setting on each data set.
"""

from __future__ import annotations

import os
import sys

from absl import app, flags

from benchmarks import common
from benchmarks.suite_methods import (LOOKAHEAD_DEFAULT, LOOPED_DEFAULT, MethodSpec, SuiteError,
                                      parse_methods, sweep_methods)
from benchmarks.suite_run import SuiteOptions, run_suite
from lookahead_jax.engine import Engine
from lookahead_jax.sampling import Sampling
from lookahead_jax.store.presets import load_preset
from models.config import ConfigError, LoopedConfig

FLAGS = flags.FLAGS
__all__ = ["MethodSpec", "SuiteError", "SuiteOptions", "options_from_flags", "parse_methods",
           "run_suite", "sweep_methods"]


# -- command line --------------------------------------------------------------------------------
def define_flags(fv: flags.FlagValues = FLAGS) -> None:
    """Defines the suite's flags in `fv` (default: absl's global FLAGS), once."""
    if "sweep_N" in fv:
        return
    kw = {"flag_values": fv}
    flags.DEFINE_string("config", "smollm2_135m", "Preset.", **kw)
    flags.DEFINE_string("ckpt", None, "Checkpoint override.", **kw)
    flags.DEFINE_string("data_dir", None, "Prompt sets (default ../shared/data).", **kw)
    flags.DEFINE_list("datasets", list(common.DATASETS), "Data sets: "
                      + ", ".join(common.DATASETS), **kw)
    flags.DEFINE_integer("num_prompts", 20, "First N prompts of each data set.", **kw)
    flags.DEFINE_integer("max_new_tokens", 128, "New tokens per prompt.", **kw)
    flags.DEFINE_string("methods", None, "Methods, e.g. ar,lookahead:15,5,15,prompt_lookup "
                        f"(default: {LOOKAHEAD_DEFAULT}; looped presets: {LOOPED_DEFAULT}; "
                        "with --sweep: the sweep only).", **kw)
    flags.DEFINE_list("sweep", [], "W sweep: lookahead at these W with G = W (and N from "
                      "--sweep_N); fits the scaling law (the JSON's \"fits\").", **kw)
    flags.DEFINE_list("sweep_N", ["5"], "N values of the --sweep.", **kw)
    flags.DEFINE_bool("seeding", False, "Prompt seeding for the --sweep settings and "
                      "--check_auto's choice.", **kw)
    flags.DEFINE_bool("check_auto", False, "Pick settings as --auto does and compare their "
                      "measured speed-up with the best measured lookahead setting.", **kw)
    flags.DEFINE_string("fit", None, "--check_auto: a stored scaling-law fit (default: this "
                        "run's pooled fit, else the one --auto would use).", **kw)
    flags.DEFINE_string("fit_out", None, "Also write this run's scaling-law fits to this file "
                        "(for decode --auto_fit).", **kw)
    flags.DEFINE_string("out", None, "JSON output (default benchmarks/results/suite_<config>"
                        ".json, sweep_<config>.json with --sweep); .md and PNGs beside it.", **kw)
    flags.DEFINE_string("lad", None, "The LoopAhead drafter: a drafter file or a train_lad "
                        "workdir (its draft depth is LoopAhead's r1).", **kw)
    flags.DEFINE_float("temperature", 0.0, "0: greedy (outputs must equal plain); > 0: "
                       "sampling (exactness not applicable).", **kw)
    flags.DEFINE_integer("top_k", 0, "top-k when sampling (0 = off).", **kw)
    flags.DEFINE_float("top_p", 1.0, "top-p when sampling (1 = off).", **kw)
    flags.DEFINE_bool("step_cost", True, "Measure the step-cost curve (lookahead presets).", **kw)
    flags.DEFINE_bool("progress", True, "Show a progress bar on stderr.", **kw)
    flags.DEFINE_bool("plots", True, "Write PNG plots beside the JSON.", **kw)


def options_from_flags(preset, values: flags.FlagValues = FLAGS) -> SuiteOptions:
    """The parsed flags (`values`, defined by `define_flags`) as
    SuiteOptions for `preset` (its lookahead settings, looped or not)."""
    looped = isinstance(preset.model, LoopedConfig)
    try:
        Ws = [int(w) for w in values.sweep]
        Ns = [int(n) for n in values.sweep_N]
    except ValueError:
        raise SuiteError("--sweep and --sweep_N take integers") from None
    if Ws:
        specs = [MethodSpec("ar")] + sweep_methods(Ws, Ns, values.seeding)
        if values.methods:
            specs += [s for s in parse_methods(values.methods, preset.lookahead)
                      if s not in specs]
    else:
        default = LOOPED_DEFAULT if looped else LOOKAHEAD_DEFAULT
        specs = parse_methods(values.methods or default, preset.lookahead)
    kind = "sweep" if Ws else "suite"
    out = values.out or os.path.join("benchmarks", "results", f"{kind}_{values.config}.json")
    return SuiteOptions(
        methods=specs, datasets=values.datasets, num_prompts=values.num_prompts,
        max_new_tokens=values.max_new_tokens, data_dir=values.data_dir, out=out,
        sampling=Sampling(values.temperature, values.top_k, values.top_p), lad=values.lad,
        step_cost=values.step_cost, check_auto=values.check_auto, seeding=values.seeding,
        fit=values.fit, fit_out=values.fit_out, progress=values.progress, plots=values.plots,
        config=values.config)


def main(argv) -> int:
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments {' '.join(argv[1:])!r}")
    try:
        preset = load_preset(FLAGS.config)
        opts = options_from_flags(preset)
        engine = Engine.from_preset(FLAGS.config, ckpt=FLAGS.ckpt)
        run_suite(engine, opts)
    except (SuiteError, ConfigError, common.DataError, ValueError) as e:
        print(f"error: {' '.join(str(e).split())}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    define_flags()
    app.run(main)
