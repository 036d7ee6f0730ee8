"""GPU benchmark of the lookahead attention kernel: exact against the dense path, and how fast.

    python -m pallas_kernels.gpu_bench                      # llama7b heads, (15,5,15), 512/2048
    python -m pallas_kernels.gpu_bench --dtype=float32 --json_out=/tmp/bench.json

For each cache length, with the cache exactly that long (capacity = length) and with a larger
capacity (--cache_size, most slots still empty, as in a decoder that preallocates), it compiles
the Triton kernel, checks it against the dense reference (float32, highest matmul precision),
then times one step's attention (one layer) for:
  kernel     the block-sparse Pallas kernel (`lookahead_attention`, backend 'triton')
  dense      the model's dense path (`dense_attention`: the mask expanded, two einsums)
  jax_xla    `jax.nn.dot_product_attention(..., mask, implementation='xla')`
  jax_cudnn  the same with implementation='cudnn' (where cuDNN takes the mask)
It prints a table and a JSON record (also written to --json_out). On a machine without a GPU it
says so and exits 0.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags, logging

from lookahead_jax.lookahead.layout import StepLayout
from lookahead_jax.lookahead.mask import StepMask, dense_attention
from pallas_kernels.block_map import BlockMap
from pallas_kernels.lookahead_attention import default_blocks, lookahead_attention


def define_flags() -> None:
    if "kv_heads" in flags.FLAGS:
        return
    flags.DEFINE_integer("W", 15, "Lookahead window width.")
    flags.DEFINE_integer("N", 5, "N-gram size.")
    flags.DEFINE_integer("G", 15, "Verification candidates.")
    flags.DEFINE_list("cache_lens", ["512", "2048"], "Committed cache lengths.")
    flags.DEFINE_integer("cache_size", 4096, "The larger cache capacity also measured (0 = off).")
    flags.DEFINE_integer("batch", 1, "Batch rows.")
    flags.DEFINE_integer("heads", 32, "Query heads (llama-7b: 32).")
    flags.DEFINE_integer("kv_heads", 32, "K/V heads (llama-7b: 32, MHA).")
    flags.DEFINE_integer("head_dim", 128, "Head dimension (llama-7b: 128).")
    flags.DEFINE_enum("dtype", "bfloat16", ["bfloat16", "float32"], "Q/K/V dtype.")
    flags.DEFINE_integer("block_q", None, "Kernel query rows per tile (default: the kernel's).")
    flags.DEFINE_integer("block_k", None, "Kernel keys per tile (default: the kernel's).")
    flags.DEFINE_integer("iters", 50, "Timed calls per measurement.")
    flags.DEFINE_integer("repeats", 5, "Measurements (the median is reported).")
    flags.DEFINE_string("json_out", None, "Also write the JSON record here.")
    flags.DEFINE_bool("interpret", False, "Run the kernel in the Pallas interpreter, on any "
                      "platform (to test this script without a GPU; the times mean nothing).")


def time_call(fn, args, iters: int, repeats: int) -> float:
    """Median seconds per call of a compiled fn."""
    jax.block_until_ready(fn(*args))
    runs = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(iters):
            out = fn(*args)
        jax.block_until_ready(out)
        runs.append((time.perf_counter() - t0) / iters)
    return statistics.median(runs)


def run_bench(f) -> dict:
    layout = StepLayout(f.W, f.N, f.G)
    t, b, h, hkv, d = layout.size, f.batch, f.heads, f.kv_heads, f.head_dim
    dtype = jnp.dtype(f.dtype)
    group = h // hkv
    dq, dk = default_blocks("triton", t * group)
    bq, bk = f.block_q or dq, f.block_k or dk
    tol = 1e-4 if dtype == jnp.float32 else 2e-2
    kernel = jax.jit(lambda q, k, v, m, ck, cv: lookahead_attention(
        q, k, v, m, ck, cv, backend="triton", interpret=f.interpret, block_q=bq, block_k=bk))
    dense = jax.jit(dense_attention)

    def jax_nn(impl):
        """jax's attention over [cache | step] keys joined beforehand (outside the timing)."""
        def fn(q, k, v, m, kv_all):
            return jax.nn.dot_product_attention(q, *kv_all, mask=m.dense()[:, None],
                                                implementation=impl)
        return jax.jit(fn)

    def joined(k, v, ck, cv):
        return tuple(jnp.concatenate([c.transpose(0, 2, 1, 3), x], axis=1)
                     for c, x in ((ck, k), (cv, v)))

    record = {"device": str(jax.devices()[0].device_kind), "W": f.W, "N": f.N, "G": f.G, "T": t,
              "batch": b, "heads": h, "kv_heads": hkv, "head_dim": d, "dtype": f.dtype,
              "block_q": bq, "block_k": bk, "tolerance": tol, "interpret": f.interpret,
              "rows": []}
    rng = np.random.default_rng(0)
    ok = True
    for cache_len in (int(c) for c in f.cache_lens):
        big = max(f.cache_size, cache_len) if f.cache_size else cache_len
        for size in sorted({cache_len, big}):
            q = jnp.asarray(rng.normal(size=(b, t, h, d)), dtype)
            k, v = (jnp.asarray(rng.normal(size=(b, t, hkv, d)), dtype) for _ in range(2))
            ck, cv = (jnp.asarray(rng.normal(size=(b, hkv, size, d)), dtype) for _ in range(2))
            mask = StepMask(jnp.full((b,), cache_len, jnp.int32), layout, size)
            args = (q, k, v, mask, ck, cv)
            with jax.default_matmul_precision("highest"):
                ref = jax.jit(dense_attention)(
                    *(x.astype(jnp.float32) if i != 3 else x for i, x in enumerate(args)))
            err = float(jnp.max(jnp.abs(kernel(*args).astype(jnp.float32) - ref)))
            ok &= err <= tol
            counts = BlockMap.of(layout, group, bq, bk).counts(cache_len, size)
            row = {"cache_len": cache_len, "cache_size": size, "max_abs_err": err,
                   "tiles_computed": counts["computed"], "tiles_total": counts["total"]}
            nn_args = (q, k, v, mask, joined(k, v, ck, cv))
            for name, fn, a in (("kernel", kernel, args), ("dense", dense, args),
                                ("jax_xla", jax_nn("xla"), nn_args),
                                ("jax_cudnn", jax_nn("cudnn"), nn_args)):
                try:
                    row[f"{name}_us"] = 1e6 * time_call(fn, a, f.iters, f.repeats)
                except Exception as e:  # noqa: BLE001 (cuDNN may refuse a mask or a shape)
                    row[f"{name}_us"] = None
                    row[f"{name}_error"] = " ".join(str(e).split())[:200]
            record["rows"].append(row)
    record["exact"] = ok
    return record


def format_table(rec: dict) -> str:
    lines = [f"{rec['device']}: lookahead attention W={rec['W']} N={rec['N']} G={rec['G']} "
             f"(T={rec['T']}), batch {rec['batch']}, {rec['heads']} heads / {rec['kv_heads']} K/V "
             f"heads x {rec['head_dim']}, {rec['dtype']}, block_q={rec['block_q']} "
             f"block_k={rec['block_k']}",
             f"{'cache':>6} {'slots':>6} {'tiles':>9} {'max err':>9} {'kernel us':>10} "
             f"{'dense us':>9} {'jax xla us':>11} {'cudnn us':>9} {'vs dense':>9}"]
    fmt = lambda x: "n/a" if x is None else f"{x:.1f}"  # noqa: E731
    for r in rec["rows"]:
        kernel_us, dense_us = r.get("kernel_us"), r.get("dense_us")
        speed = f"{dense_us / kernel_us:.2f}x" if kernel_us and dense_us else "n/a"
        lines.append(f"{r['cache_len']:>6} {r['cache_size']:>6} "
                     f"{r['tiles_computed']:>4}/{r['tiles_total']:<4} {r['max_abs_err']:>9.2e} "
                     f"{fmt(kernel_us):>10} {fmt(dense_us):>9} {fmt(r['jax_xla_us']):>11} "
                     f"{fmt(r['jax_cudnn_us']):>9} {speed:>9}")
    lines.append("exact against the dense reference: " + ("yes" if rec["exact"] else "NO"))
    return "\n".join(lines)


def main(argv: Sequence[str]) -> int:
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments {' '.join(argv[1:])!r}")
    platform = jax.default_backend()
    if platform != "gpu" and not flags.FLAGS.interpret:
        print(f"gpu_bench: no GPU on this machine (jax platform {platform!r}); nothing to "
              f"measure. Run it on a machine with a GPU.")
        return 0
    rec = run_bench(flags.FLAGS)
    print(format_table(rec))
    print(json.dumps(rec))
    if flags.FLAGS.json_out:
        with open(flags.FLAGS.json_out, "w", encoding="utf-8") as fh:
            json.dump(rec, fh, indent=1)
            fh.write("\n")
    return 0 if rec["exact"] else 1


def parse_flags(argv: Sequence[str]) -> list[str]:
    try:
        rest = flags.FLAGS(list(argv))
    except flags.Error as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    if flags.FLAGS["verbosity"].using_default_value:  # absl's INFO default is noisy (TPU probe)
        flags.FLAGS.verbosity = logging.WARNING
    return rest


if __name__ == "__main__":
    define_flags()
    app.run(main, flags_parser=parse_flags)
