"""Tensor parallelism x lookahead parallelism on one device mesh (lookahead x model): the
structure measured here, the step time predicted for 8 accelerators.

    python -m benchmarks.mesh_bench [--quick] [--out benchmarks/results]

Part 1, measured on this machine's 8 devices (on a CPU the script creates 8 XLA host devices
itself, before JAX starts): a small Llama (hidden 256, 8 query / 8 KV heads, 4 layers, vocab
2048, random weights from nnx.Rngs(0), float32) decoded on the meshes (1,1), (1,8), (2,4),
(4,2), (8,1) with plain decoding and lookahead (--lookahead, default (15,5,15)): time per
decode step (decode time over the steps after the prefill, median of --repeats runs after a
warm-up run that compiles), tokens each device feeds per step, parameter and KV-cache bytes per
device (of the placed arrays), whether the output equals plain decoding on one device, and
the collectives of one step read from the compiled loop (`lookahead_jax.tuning.collectives`):
all-reduces over the model axis, integer and float collectives over the lookahead axis.
On a CPU the 8 "devices" share its cores, so this shows the structure (what each device holds
and feeds), not a speed-up.

Part 2, predicted (`lookahead_jax.tuning.roofline`) for --preset (default llama70b) on 8 x
H100 SXM and a TPU v5e-8: tensor parallelism alone (lookahead:1,model:8) and tensor x
lookahead parallelism (lookahead:2,model:4), plain and lookahead. Each step's program is
compiled here for one device of that mesh (`program_cost.forward_cost(..., mesh=...)`, float32,
bytes scaled to bfloat16), and

    step time = max(bytes / HBM bandwidth, FLOPs / peak) + layers x overhead
                + 2 x layers x all-reduce([tokens x hidden] bfloat16 over the interconnect)
    speed-up  = S x plain step time / step time

with S the committed SmolLM2 measurement at the setting (as `benchmarks.roofline` takes it;
lookahead parallelism runs the same algorithm, so the same S) and the per-layer overhead of
the committed roofline run (`results/roofline.json`, the paper-stack calibration).

Part 3 (not with --quick), memory: per-device bytes of a plain bfloat16 decode step with a
4096-slot cache for llama70b on model:8 and codellama34b on model:8 and lookahead:2,model:4,
from the compiled program's memory analysis (abstract shapes, nothing materialised).

Prints the tables and writes mesh_bench.json and mesh_bench.md into --out.
"""

from __future__ import annotations

import os

DEVICES = 8
if "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                               f" --xla_force_host_platform_device_count={DEVICES}").strip()

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from typing import Any, Sequence  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from benchmarks import common  # noqa: E402
from benchmarks.roofline import measured_runs, s_of  # noqa: E402
from lookahead_jax.engine import Engine  # noqa: E402
from lookahead_jax.generation import bucket_length, cache_length_for  # noqa: E402
from lookahead_jax.lookahead.config import LookaheadConfig  # noqa: E402
from lookahead_jax.lookahead.layout import ShardedLayout, StepLayout  # noqa: E402
from lookahead_jax.mesh import (MeshShape, bytes_per_device, make_mesh,  # noqa: E402
                                shard_cache)
from lookahead_jax.store.presets import load_preset  # noqa: E402
from lookahead_jax.tuning import roofline as rf  # noqa: E402
from lookahead_jax.tuning.collectives import collectives, mesh_axes  # noqa: E402
from lookahead_jax.tuning.program_cost import ProgramCost, forward_cost, method_cost  # noqa: E402
from lookahead_jax.tuning.scaling_law import default_fit  # noqa: E402
from models.config import ConfigError, LlamaConfig  # noqa: E402
from models.llama import Llama  # noqa: E402

RESULTS = os.path.join(common.REPO, "benchmarks", "results")
SMALL = LlamaConfig(vocab_size=2048, hidden_size=256, intermediate_size=1024, num_layers=4,
                    num_heads=8, num_kv_heads=8, max_position_embeddings=4096)
MESHES = ((1, 1), (1, 8), (2, 4), (4, 2), (8, 1))
QUICK_MESHES = ((1, 1), (1, 8), (2, 4))
PREDICT_DEVICES = ("H100 SXM", "TPU v5e")
PREDICT_MESHES = ((1, 8), (2, 4))
CPU_NOTE = ("On this CPU the 8 devices are XLA host devices sharing its cores: the table shows "
            "the structure (bytes each device holds, tokens each device feeds per step, "
            "identical outputs), not speed. A mesh of 8 devices runs 8 programs on the same "
            "cores and every collective is a copy in host memory, so the times mostly show "
            "that cost (and vary by tens of percent between runs); a speed-up needs one "
            "accelerator per device.")


def mesh_name(shape: tuple[int, int]) -> str:
    return str(MeshShape(*shape))


def setting_label(cfg: LookaheadConfig) -> str:
    return f"lookahead ({cfg.W},{cfg.N},{cfg.G})"


def tokens_per_device(cfg: LookaheadConfig | None, lookahead_devices: int) -> int:
    """Tokens one device feeds per step: 1 for plain decoding; the whole step layout for
    lookahead on one lookahead group; a group's share plus the N-1 re-fed tokens under
    lookahead parallelism (`lookahead_jax.lookahead.parallel`)."""
    if cfg is None:
        return 1
    if lookahead_devices == 1:
        return StepLayout.of(cfg).size
    return cfg.N - 1 + ShardedLayout(cfg.W, cfg.N, cfg.G, lookahead_devices).size


# -- part 1: measured here ------------------------------------------------------------------------
def measure(shapes, cfg: LookaheadConfig, *, max_new_tokens: int, repeats: int,
            prompt_len: int) -> list[dict[str, Any]]:
    """Per mesh shape and method: median decode ms per step, S, bytes per device, exactness."""
    if len(jax.devices()) < max(a * m for a, m in shapes):
        raise ConfigError(f"mesh_bench needs {DEVICES} devices, {len(jax.devices())} found: on "
                          f"CPU run it as `python -m benchmarks.mesh_bench` (it sets XLA_FLAGS="
                          f"--xla_force_host_platform_device_count={DEVICES} before JAX starts)")
    model = Llama(SMALL, rngs=nnx.Rngs(0))
    prompt = [np.random.RandomState(0).randint(3, SMALL.vocab_size, prompt_len).tolist()]
    reference = None
    rows = []
    for shape in shapes:
        engine = Engine(model, eos_ids=(), mesh=mesh_name(shape))
        mesh = engine.mesh
        params_b = max(bytes_per_device(engine.params).values())
        for label, la in (("plain", None), (setting_label(cfg), cfg)):
            method = engine.resolve_method("ar" if la is None else "lookahead", None, la)
            slots = cache_length_for(bucket_length(prompt_len), max_new_tokens,
                                     method.cache_capacity(SMALL), SMALL.max_position_embeddings)
            cache = shard_cache(model.init_cache(1, slots), mesh)
            cache_b = max(bytes_per_device((cache.k, cache.v)).values())
            del cache
            kw = dict(method=method, max_new_tokens=max_new_tokens)
            warm = engine.generate_ids(prompt, **kw)  # compiles
            runs = [engine.generate_ids(prompt, **kw) for _ in range(repeats)]
            per_step = [r.stats.decode_s / max(1, r.stats.steps - 1) for r in runs]
            if reference is None:
                reference = warm.tokens
            rows.append(dict(
                mesh=mesh_name(shape), lookahead_axis=shape[0], model_axis=shape[1],
                method=label, tokens_per_device=tokens_per_device(la, shape[0]),
                step_ms=1e3 * statistics.median(per_step),
                step_ms_runs=[1e3 * s for s in per_step], steps=runs[0].stats.steps,
                S=runs[0].stats.step_compression, compile_s=warm.stats.compile_s,
                params_bytes_per_device=params_b, cache_bytes_per_device=cache_b,
                cache_slots=slots, same_as_plain=all(r.tokens == reference for r in runs),
                **loop_collectives(engine, method)))
            r = rows[-1]
            print(f"{r['mesh']:>20} {label:<22} {r['step_ms']:7.2f} ms/step, S {r['S']:.2f}, "
                  f"params {params_b / 1e6:.2f} MB + cache {cache_b / 1e6:.2f} MB per device, "
                  f"compile {r['compile_s']:.1f}s", file=sys.stderr, flush=True)
    base = {r["method"]: r["step_ms"] for r in rows if r["mesh"] == mesh_name(shapes[0])}
    for r in rows:
        r["step_vs_first_mesh"] = r["step_ms"] / base[r["method"]]
    return rows


def loop_collectives(engine: Engine, method) -> dict[str, int]:
    """The collectives of one decoding step (those inside the compiled loop of `method`'s run
    program), by mesh axis: float all-reduces over the model axis (tensor parallelism), and
    the collectives over the lookahead axis, integer (token ids) and float (activations)."""
    (run,) = [c for k, c in engine._compiled.items() if k[0] == "run" and k[1][0] == method]
    found = [(c, mesh_axes(c, engine.mesh)) for c in collectives(run.as_text()) if c.in_loop]
    over_lookahead = [c for c, axes in found if "lookahead" in axes]
    return dict(
        model_allreduces=sum(c.op == "all-reduce" and c.is_float() and axes == {"model"}
                             for c, axes in found),
        lookahead_int_collectives=sum(not c.is_float() for c in over_lookahead),
        lookahead_float_collectives=sum(c.is_float() for c in over_lookahead))


# -- part 2: predicted for 8 accelerators -----------------------------------------------------
def step_costs(cfg: LlamaConfig, la: LookaheadConfig, cache_len: int,
               shapes) -> dict[tuple, ProgramCost]:
    """(mesh shape, 'plain' | 'lookahead') -> one device's program of that step (float32).
    Under lookahead parallelism a group's step is the forward of its share plus the re-fed
    tokens with its readout rows; a causal mask of that size stands in for the parallel
    step's mask (same shapes, so the same FLOPs and bytes for dense attention)."""
    out = {}
    for shape in shapes:
        mesh = make_mesh(mesh_name(shape))
        out[shape, "plain"] = method_cost(cfg, "ar", cache_len=cache_len, mesh=mesh)
        if shape[0] == 1:
            out[shape, "lookahead"] = method_cost(cfg, "lookahead", dict(W=la.W, N=la.N, G=la.G),
                                                  cache_len=cache_len, mesh=mesh)
        else:
            lay = ShardedLayout(la.W, la.N, la.G, shape[0])
            out[shape, "lookahead"] = forward_cost(
                cfg, tokens=tokens_per_device(la, shape[0]), cache_len=cache_len,
                logits_rows=1 + lay.W_d + lay.G_d * (la.N - 1), mesh=mesh)
    return out


MEMORY_RUNS = (("llama70b", (1, 8)), ("codellama34b", (1, 8)), ("codellama34b", (2, 4)))
MEMORY_CACHE = 4095  # committed tokens: with the step's one, a 4096-slot cache (a 4K context)
GB80 = 80e9


def memory(runs=MEMORY_RUNS) -> list[dict[str, Any]]:
    """Per-device bytes of a plain bfloat16 decode step of big presets on an 8-device mesh,
    from the compiled program's memory analysis (abstract shapes, nothing materialised)."""
    rows = []
    for preset, shape in runs:
        cfg = load_preset(preset).model
        c = method_cost(cfg, "ar", cache_len=MEMORY_CACHE, dtype="bfloat16",
                        mesh=make_mesh(mesh_name(shape)))
        rows.append(dict(
            preset=preset, mesh=mesh_name(shape), cache_slots=c.cache_size,
            weights_gb_total=c.weight_bytes / 1e9,
            weights_gb_per_device=c.weight_bytes_per_device / 1e9,
            cache_gb_per_device=c.cache_bytes_per_device / 1e9,
            argument_gb=c.argument_bytes / 1e9, output_mb=c.output_bytes / 1e6,
            cpu_temp_gb=c.temp_bytes / 1e9,
            free_of_80gb=(GB80 - c.argument_bytes - c.output_bytes) / 1e9))
        r = rows[-1]
        print(f"{preset:>14} {r['mesh']:>20}: arguments {r['argument_gb']:.3f} GB per device "
              f"(weights {r['weights_gb_per_device']:.3f} + cache {r['cache_gb_per_device']:.3f})"
              f", {r['free_of_80gb']:.1f} GB of 80 free", file=sys.stderr, flush=True)
    return rows


def overhead_per_layer(results: str) -> tuple[float, str]:
    """The committed roofline run's calibrated per-layer overhead, else the library's."""
    path = os.path.join(results, "roofline.json")
    if os.path.exists(path):
        with open(path, encoding="utf-8") as f:
            over = json.load(f).get("overhead", {})
        if "per_layer_s" in over:
            return float(over["per_layer_s"]), (f"roofline.json (calibrated on "
                                                f"{over.get('calibrated_on', '?')})")
    return rf.PAPER_STACK_OVERHEAD_S, "roofline.PAPER_STACK_OVERHEAD_S"


def predict(preset: str, la: LookaheadConfig, cache_len: int, devices, overhead_s: float,
            results: str, shapes=PREDICT_MESHES) -> list[dict[str, Any]]:
    cfg = load_preset(preset).model
    costs = step_costs(cfg, la, cache_len, shapes)
    settings = (("W", la.W), ("N", la.N), ("G", la.G))
    S, S_src = s_of("lookahead", settings, measured_runs(results), default_fit())
    rows = []
    for name in devices:
        dev = dataclasses.replace(rf.device(name), overhead_s=overhead_s)
        tp8_plain = tp8_bare = None
        for shape in shapes:
            model = shape[1]
            plain = costs[shape, "plain"]
            t_plain = rf.predict_tp_step_time(plain, dev, cfg, model_devices=model)
            bare_plain = rf.roofline_time(plain, dev) + rf.tp_collective_time(
                cfg, plain.tokens, model, dev)
            if tp8_plain is None:  # the first mesh (lookahead:1,model:8): plain on 8-way TP
                tp8_plain, tp8_bare = t_plain, bare_plain
            for method in ("plain", "lookahead"):
                c = costs[shape, method]
                s = 1.0 if method == "plain" else S
                t = rf.predict_tp_step_time(c, dev, cfg, model_devices=model)
                ar = rf.tp_collective_time(cfg, c.tokens, model, dev)
                bare = rf.roofline_time(c, dev) + ar
                per_dev = rf.model_bytes(c)  # bfloat16 weights + cache shards of one device
                rows.append(dict(
                    preset=preset, device=name, mesh=mesh_name(shape), method=(
                        "plain" if method == "plain" else setting_label(la)),
                    tokens_per_device=c.tokens,
                    weights_gb_per_device=c.weight_bytes_per_device * 2 / c.itemsize / 1e9,
                    cache_gb_per_device=c.cache_bytes_per_device * 2 / c.itemsize / 1e9,
                    fits=rf.fits(per_dev, dev), memory_ms=1e3 * rf.memory_time(c, dev),
                    compute_ms=1e3 * rf.compute_time(c, dev), allreduce_ms=1e3 * ar,
                    overhead_ms=1e3 * rf.layers_of(cfg) * dev.overhead_s, step_ms=1e3 * t,
                    bare_step_ms=1e3 * bare, S=s, S_source="plain" if method == "plain" else S_src,
                    tokens_per_s=s / t, speedup=rf.speedup(s, t_plain, t),
                    speedup_bare=rf.speedup(s, bare_plain, bare),
                    speedup_vs_tp8_plain=rf.speedup(s, tp8_plain, t),
                    speedup_bare_vs_tp8_plain=rf.speedup(s, tp8_bare, bare),
                    bound=rf.bound(c, dev), cost=c.to_dict()))
    return rows


# -- output ---------------------------------------------------------------------------------------
def render(rec: dict) -> str:
    a = rec["measured"]
    table_a = common.markdown_table(
        ["mesh", "method", "tokens/device/step", "ms/step", "x first mesh", "S",
         "params MB/device", "cache MB/device", "= plain", "model all-reduces/step",
         "lookahead-axis int / float collectives/step"],
        [[r["mesh"], r["method"], r["tokens_per_device"], r["step_ms"],
          f"{r['step_vs_first_mesh']:.2f}", r["S"], f"{r['params_bytes_per_device'] / 1e6:.3f}",
          f"{r['cache_bytes_per_device'] / 1e6:.3f}", "yes" if r["same_as_plain"] else "NO",
          r["model_allreduces"],
          f"{r['lookahead_int_collectives']} / {r['lookahead_float_collectives']}"]
         for r in a["rows"]])
    b = rec["predicted"]
    table_b = common.markdown_table(
        ["device", "mesh", "method", "T/device", "weights GB/dev", "cache GB/dev", "fits",
         "HBM ms", "compute ms", "all-reduce ms", "overhead ms", "step ms", "S", "tokens/s",
         "speed-up", "bare speed-up", "vs TP-8 plain", "bare vs TP-8 plain"],
        [[r["device"], r["mesh"], r["method"], r["tokens_per_device"],
          f"{r['weights_gb_per_device']:.2f}", f"{r['cache_gb_per_device']:.3f}",
          "yes" if r["fits"] else "NO", f"{r['memory_ms']:.2f}", f"{r['compute_ms']:.2f}",
          f"{r['allreduce_ms']:.2f}", f"{r['overhead_ms']:.1f}", f"{r['step_ms']:.1f}",
          f"{r['S']:.2f}", f"{r['tokens_per_s']:.1f}", f"{r['speedup']:.2f}",
          f"{r['speedup_bare']:.2f}", f"{r['speedup_vs_tp8_plain']:.2f}",
          f"{r['speedup_bare_vs_tp8_plain']:.2f}"] for r in b["rows"]])
    devs = "\n".join(f"- {d['name']}: {d['source']}; interconnect: {d['interconnect_source']}"
                     for d in b["devices"])
    mem = rec["memory"]["rows"]
    part_c = [] if not mem else [
        "## Memory per device: big models on 8 devices", "",
        "A plain bfloat16 decode step with a 4096-slot KV cache (a 4K context), compiled here "
        "for one device of the mesh from abstract shapes (nothing materialised); 'arguments' "
        "is XLA's memory analysis of that program (the device's weight and cache shards, plus "
        "8 bytes of token id and length). CPU temp: XLA's CPU backend converts bfloat16 "
        "matmul operands to float32 temporaries, so this overstates an accelerator's (the "
        "float32 program of the same step has temporaries of about 0.5 MB: "
        "tests/test_mesh_memory.py).", "",
        common.markdown_table(
            ["preset", "mesh", "weights GB (total)", "weights GB/device", "cache GB/device",
             "arguments GB/device", "outputs MB", "CPU temp GB", "free of 80 GB"],
            [[r["preset"], r["mesh"], f"{r['weights_gb_total']:.2f}",
              f"{r['weights_gb_per_device']:.3f}", f"{r['cache_gb_per_device']:.3f}",
              f"{r['argument_gb']:.3f}", f"{r['output_mb']:.3f}", f"{r['cpu_temp_gb']:.2f}",
              f"{r['free_of_80gb']:.1f}"] for r in mem]), ""]
    return "\n".join([
        "# Tensor x lookahead parallelism on one mesh (`python -m benchmarks.mesh_bench`)", "",
        f"## Measured here: a small Llama on {a['devices']} devices", "",
        f"Model: {a['model']}; prompt {a['prompt_len']} random ids, {a['max_new_tokens']} new "
        f"tokens, greedy; ms/step is the decode time over the steps after the prefill, median "
        f"of {a['repeats']} run(s) after a warm-up run that compiles. 'x first mesh': the step "
        f"time over the same method's on {a['rows'][0]['mesh']}. '= plain': the output equals "
        f"plain decoding's on {a['rows'][0]['mesh']}.", "",
        f"**{CPU_NOTE}**", "", table_a, "",
        f"## Predicted: {b['preset']} on 8 accelerators", "",
        f"Cache: {b['cache_len']} tokens before the step. Each step's program compiled for one "
        f"device of the mesh (float32 here, bytes scaled to bfloat16). step = max(HBM, compute) "
        f"+ layers x overhead ({b['overhead_per_layer_s'] * 1e3:.3f} ms/layer, from "
        f"{b['overhead_source']}) + 2 all-reduces per layer of [tokens x hidden] bfloat16 "
        f"(ring: 2 (n-1)/n of the buffer each way per device, bandwidth only). S: "
        f"{b['S_source']}. 'speed-up': S x plain step on the same mesh / this step; 'bare': "
        f"the same without the overhead term; 'vs TP-8 plain': against plain decoding on "
        f"lookahead:1,model:8 on the same device (the best plain use of 8 chips here), with "
        f"the overhead and bare.", "",
        table_b, "", "Notes:", "", *[f"- {n}" for n in b["notes"]], "", "Devices:", "", devs,
        "", *part_c])


def notes(rows: list[dict], preset: str) -> list[str]:
    cfg = load_preset(preset).model
    out = []
    for dev in sorted({r["device"] for r in rows}):
        mem = rf.device(dev).memory / 1e9
        for mesh in sorted({r["mesh"] for r in rows}):
            r = next(x for x in rows if x["device"] == dev and x["mesh"] == mesh)
            model = int(mesh.rsplit(":", 1)[1])
            total = r["weights_gb_per_device"] + r["cache_gb_per_device"]
            out.append(f"{preset} on {dev}, {mesh} (split {model} ways): "
                       f"{r['weights_gb_per_device']:.2f} GB of bfloat16 weights + "
                       f"{r['cache_gb_per_device']:.3f} GB of cache = {total:.2f} GB per device: "
                       + (f"fits in one {mem:.0f} GB device." if r["fits"] else
                          f"does NOT fit in one {mem:.0f} GB device (the row is what the step "
                          f"would cost if it did: it needs more devices or smaller weights)."))
    out += [
        "Under lookahead parallelism the plain row runs the same TP step on each lookahead "
        "group (the groups duplicate it); the lookahead row is one group's share of the step "
        "plus the N-1 re-fed tokens, exchanging token ids only between groups (a few hundred "
        "bytes per step, not counted).",
        f"The per-layer overhead is the paper stack's (PyTorch, one launch per op), calibrated "
        f"on one A100; TP does not shrink it, so it dominates a TP step of {preset} "
        f"({cfg.num_layers} layers) and hides most of what TP saves. The bare columns are the "
        f"roofline alone; a compiled JAX decode loop sits between the two.",
        "Bytes are XLA's CPU cost analysis of each device's program, which counts the traffic "
        "of unfused intermediates: a step of ~100 tokens moves its activations several times, "
        "and with the weights split 4 or 8 ways that is a larger share of a device's bytes, "
        "so the lookahead rows' HBM time (and the bare speed-up) is pessimistic.",
        "All-reduce latency (microseconds per call, 2 x layers calls per step) is not counted, "
        "nor the embedding's all-reduce or the logits' exchange over the vocabulary split; "
        "the TPU v5e ICI figure is the chip's total over its 4 ports, an upper bound for "
        "rings on a 2x4 torus.",
    ]
    return out


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.mesh_bench", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=RESULTS, help="directory for mesh_bench.json/.md")
    ap.add_argument("--quick", action="store_true",
                    help="meshes (1,1), (1,8), (2,4); 16 new tokens, 1 repeat; the prediction "
                    "for llama7b unless --preset (quicker to compile; for a test)")
    ap.add_argument("--preset", default=None, help="Llama-family preset to predict "
                    "(default llama70b; --quick: llama7b)")
    ap.add_argument("--lookahead", default="15,5,15", help="W,N,G of the lookahead rows")
    ap.add_argument("--max_new_tokens", type=int, default=None, help="default 64 (quick: 16)")
    ap.add_argument("--repeats", type=int, default=None, help="timed runs (default 3; quick 1)")
    ap.add_argument("--prompt_len", type=int, default=16, help="random prompt ids")
    ap.add_argument("--cache_len", type=int, default=512,
                    help="cached tokens before a predicted step")
    ap.add_argument("--results", default=RESULTS,
                    help="where the committed measurements (S, roofline overhead) are")
    return ap.parse_args(argv)


def run(args: argparse.Namespace) -> dict:
    t0 = time.perf_counter()
    w, n, g = (int(x) for x in args.lookahead.split(","))
    la = LookaheadConfig(W=w, N=n, G=g)
    quick = args.quick
    shapes = QUICK_MESHES if quick else MESHES
    max_new = args.max_new_tokens or (16 if quick else 64)
    repeats = args.repeats or (1 if quick else 3)
    rows_a = measure(shapes, la, max_new_tokens=max_new, repeats=repeats,
                     prompt_len=args.prompt_len)
    preset = args.preset or ("llama7b" if quick else "llama70b")
    over, over_src = overhead_per_layer(args.results)
    t1 = time.perf_counter()
    rows_b = predict(preset, la, args.cache_len, PREDICT_DEVICES, over, args.results)
    rows_c = [] if quick else memory()
    rec: dict[str, Any] = dict(
        args=vars(args), machine=common.machine_info(), quick=quick,
        measured=dict(devices=len(jax.devices()), model=(
            f"Llama, hidden {SMALL.hidden_size}, {SMALL.num_heads} heads / "
            f"{SMALL.num_kv_heads} KV heads, {SMALL.num_layers} layers, vocab "
            f"{SMALL.vocab_size}, float32, random weights (nnx.Rngs(0))"),
            config=dataclasses.asdict(SMALL),
            prompt_len=args.prompt_len, max_new_tokens=max_new, repeats=repeats,
            lookahead=[w, n, g], note=CPU_NOTE, rows=rows_a),
        predicted=dict(preset=preset, cache_len=args.cache_len, overhead_per_layer_s=over,
                       overhead_source=over_src, S_source=next(
                           r["S_source"] for r in rows_b if r["method"] != "plain"),
                       devices=[rf.device(d).to_dict() for d in PREDICT_DEVICES],
                       compile_s=time.perf_counter() - t1, rows=rows_b,
                       notes=notes(rows_b, preset)),
        memory=dict(cache_slots=MEMORY_CACHE + 1, dtype="bfloat16", rows=rows_c))
    rec["wall_s"] = time.perf_counter() - t0
    md = render(rec)
    os.makedirs(args.out, exist_ok=True)
    common.write_json(os.path.join(args.out, "mesh_bench.json"), rec)
    with open(os.path.join(args.out, "mesh_bench.md"), "w", encoding="utf-8") as f:
        f.write(md)
    print(md)
    return rec


def main(argv: Sequence[str] | None = None) -> int:
    try:
        run(parse_args(argv))
    except ConfigError as e:
        print(f"mesh_bench: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
