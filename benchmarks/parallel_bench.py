"""Lookahead parallelism: per-step time against the number of devices, on this machine.

    python -m benchmarks.parallel_bench --devices=1,2,4,8 --settings=15,5,15 --num_prompts=3

On CPU the script creates 8 XLA host devices itself (XLA_FLAGS, before JAX starts). They share
this machine's cores, so the table shows the structure of lookahead parallelism (tokens each
device feeds per step, what a step costs when the step is split), not a speed-up:
strong-scaling figures need one accelerator per device.

Per prompt, side by side: plain greedy, single-device lookahead, then lookahead parallelism on
each device count (1 device = the parallel code path on one device: the difference to
single-device lookahead is the cost of re-feeding the accepted tokens, see parallel.py).
Every output must equal plain greedy. Writes JSON after each prompt.
"""

from __future__ import annotations

import os

if "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                               " --xla_force_host_platform_device_count=8").strip()

import time  # noqa: E402

import jax  # noqa: E402
from absl import app, flags  # noqa: E402

from benchmarks import common  # noqa: E402
from lookahead_jax.engine import Engine  # noqa: E402
from lookahead_jax.lookahead.parallel import ParallelLookahead  # noqa: E402
from lookahead_jax.sampling import Sampling  # noqa: E402

FLAGS = flags.FLAGS


def define_flags() -> None:
    if "devices" in FLAGS:
        return
    flags.DEFINE_string("config", "smollm2_135m", "preset")
    flags.DEFINE_string("ckpt", None, "checkpoint override")
    flags.DEFINE_string("data_dir", None, "prompt sets (default ../shared/data)")
    flags.DEFINE_string("dataset", "humaneval", "mt_bench | humaneval | gsm8k")
    flags.DEFINE_integer("num_prompts", 3, "first N prompts of the data set")
    flags.DEFINE_integer("max_new_tokens", 64, "new tokens per prompt")
    flags.DEFINE_string("settings", "15,5,15", "W,N,G settings separated by ':'")
    flags.DEFINE_list("devices", ["1", "2", "4", "8"], "device counts")
    flags.DEFINE_string("out", "benchmarks/results/parallel_bench.json", "JSON output")


def build_methods(engine, sampling) -> list[tuple[str, object, object]]:
    """(label, LookaheadConfig or None, Method) rows: plain, then per --settings single-device
    lookahead and lookahead parallelism on each --devices count, built by the registry
    (`engine.build_method`) with `sampling` (but for the one-device parallel row)."""
    methods = [("plain", None, engine.build_method("ar", sampling))]
    for cfg in common.parse_settings(FLAGS.settings):
        name = f"({cfg.W},{cfg.N},{cfg.G})"
        methods.append((f"{name} single device", cfg,
                        engine.build_method("lookahead", sampling, lookahead=cfg, devices=1)))
        for d in [int(x) for x in FLAGS.devices]:
            # the registry maps devices=1 to single-device lookahead; this row is the control
            # "the parallel code path on one device", so it is the one built directly
            method = (engine.build_method("lookahead", sampling, lookahead=cfg, devices=d)
                      if d > 1 else ParallelLookahead(sampling, config=cfg, devices=1))
            methods.append((f"{name} {d} device{'s' * (d > 1)}", cfg, method))
    return methods


def main(argv):
    del argv
    engine = Engine.from_preset(FLAGS.config, ckpt=FLAGS.ckpt)
    counts = [int(d) for d in FLAGS.devices]
    if max(counts) > len(jax.local_devices()):
        raise app.UsageError(f"--devices up to {max(counts)}, {len(jax.local_devices())} present")
    prompts = common.encoded_prompts(engine, FLAGS.dataset, FLAGS.num_prompts, FLAGS.data_dir)
    methods = build_methods(engine, Sampling())
    report = {"machine": common.machine_info(), "devices_present": len(jax.local_devices()),
              "config": FLAGS.config, "dataset": FLAGS.dataset,
              "max_new_tokens": FLAGS.max_new_tokens, "runs": []}
    t0 = time.time()
    for i, ids in enumerate(prompts):
        ref = None
        for name, cfg, method in methods:
            res = engine.generate_ids([ids], method=method, max_new_tokens=FLAGS.max_new_tokens)
            ref = ref or res.tokens
            st = res.stats
            d = getattr(method, "devices", 1)
            per_device = st.extra.get("tokens_per_device", cfg.step_tokens if cfg else 1)
            report["runs"].append({
                "prompt": i, "method": name, "devices": d, "tokens": st.total_tokens,
                "steps": st.steps, "decode_s": st.decode_s, "prefill_s": st.prefill_s,
                "compile_s": st.compile_s, "exact": res.tokens == ref,
                "tokens_per_device_step": per_device})
        print(f"prompt {i + 1}/{len(prompts)} ({time.time() - t0:.0f}s)", flush=True)
        common.write_json(FLAGS.out, report)

    rows = []
    for name, cfg, method in methods:
        runs = [r for r in report["runs"] if r["method"] == name]
        steps = sum(r["steps"] - 1 for r in runs)  # decode steps (the prefill is apart)
        decode = sum(r["decode_s"] for r in runs)
        tokens = sum(r["tokens"] for r in runs)
        rows.append({"method": name, "devices": runs[0]["devices"],
                     "tokens_per_device_step": runs[0]["tokens_per_device_step"],
                     "exact": sum(r["exact"] for r in runs), "prompts": len(runs),
                     "S": tokens / sum(r["steps"] for r in runs),
                     "ms_per_step": 1e3 * decode / max(steps, 1),
                     "tokens_per_s": tokens / sum(r["decode_s"] + r["prefill_s"] for r in runs)})
    report["summary"] = rows
    common.write_json(FLAGS.out, report)
    print(common.markdown_table(
        ["method", "tokens per device per step", "exact", "S", "ms/step", "tokens/s"],
        [[r["method"], r["tokens_per_device_step"], f"{r['exact']}/{r['prompts']}", r["S"],
          r["ms_per_step"], r["tokens_per_s"]] for r in rows]))
    print(f"\nJSON: {FLAGS.out} ({report['devices_present']} devices on "
          f"{report['machine'].get('cpus', '?')} CPU cores: structure, not speed-up)")


if __name__ == "__main__":
    define_flags()
    app.run(main)
