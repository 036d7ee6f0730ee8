"""Load on the OpenAI-compatible server: plain vs lookahead vs prompt lookup at 1, 4 and 8
concurrent clients, over MT-Bench prompts, on localhost.

    python -m benchmarks.serve_load [--config=smollm2_135m] [--n=8] [--max_tokens=64]
                                    [--out=benchmarks/results] [--budget_s=1500]

Starts `lookahead_jax.serving.Server` in this process on 127.0.0.1 (any free port) with
--slots slots, then for each method and each concurrency c: --n MT-Bench first turns (chat,
greedy, --max_tokens each, streamed) sent by c clients that each send their next request when
the previous one ends. Per cell: throughput (completion tokens / wall time of the cell),
requests/s, and percentiles over requests of the time to first token (TTFT: request sent ->
first chunk with text), the inter-token latency (ITL: (last chunk - first chunk) / (tokens -
1), per request) and the end-to-end latency; S (tokens per forward pass, the server's own
count). Before any cell each method is warmed (every program a cell will need is compiled:
every prompt's prefill bucket and the step at every row count), so no cell times XLA.

"Batching" is what continuous batching alone gives: a method's throughput at c clients over
its throughput at one request at a time (c = 1); "vs ar" is a method's throughput over plain
decoding's at the same c. Greedy outputs are checked equal across methods (lossless).

Prints the table, writes serve_load.json and serve_load.md into --out, and /metrics after the
run into serve_load_metrics.txt. A cell not started before --budget_s is skipped (said so).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import threading
import time

import numpy as np

from benchmarks.common import machine_info, markdown_table, mt_bench_turn1, write_json

METHODS = ("ar", "lookahead", "prompt_lookup")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="smollm2_135m")
    p.add_argument("--ckpt", default=None)
    p.add_argument("--n", type=int, default=8, help="requests per cell (MT-Bench prompts)")
    p.add_argument("--max_tokens", type=int, default=64)
    p.add_argument("--concurrency", default="1,4,8")
    p.add_argument("--methods", default=",".join(METHODS))
    p.add_argument("--slots", type=int, default=8)
    p.add_argument("--max_len", type=int, default=1024)
    p.add_argument("--data_dir", default=None)
    p.add_argument("--budget_s", type=float, default=1500.0)
    p.add_argument("--out", default="benchmarks/results")
    return p.parse_args(argv)


def percentiles(values: list[float]) -> dict[str, float]:
    if not values:
        return {"p50": float("nan"), "p90": float("nan"), "p99": float("nan")}
    a = np.asarray(values)
    return {f"p{q}": float(np.percentile(a, q)) for q in (50, 90, 99)}


async def one_request(session, url: str, body: dict) -> dict:
    t0 = time.perf_counter()
    first = last = None
    ids, stats = [], {}
    async with session.post(url, json=body) as r:
        if r.status != 200:
            raise RuntimeError(f"HTTP {r.status}: {await r.text()}")
        async for line in r.content:
            line = line.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise RuntimeError(chunk["error"]["message"])
            now = time.perf_counter()
            new = chunk["choices"][0].get("token_ids", [])
            if new:
                first = first if first is not None else now
                last = now
                ids.extend(new)
            stats = chunk.get("lookahead", stats)
    end = time.perf_counter()
    n = len(ids)
    return {"ids": ids, "tokens": n, "ttft": (first or end) - t0, "e2e": end - t0,
            "itl": (last - first) / (n - 1) if n > 1 else float("nan"),
            "steps": stats.get("steps", 0)}


async def run_cell(url: str, bodies: list[dict], concurrency: int) -> tuple[list[dict], float]:
    import aiohttp  # noqa: PLC0415

    todo = list(enumerate(bodies))
    results: dict[int, dict] = {}

    async def client(session):
        while todo:
            i, body = todo.pop(0)
            results[i] = await one_request(session, url, body)

    t0 = time.perf_counter()
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=3600)) as session:
        await asyncio.gather(*(client(session) for _ in range(concurrency)))
    return [results[i] for i in range(len(bodies))], time.perf_counter() - t0


def summarize(method: str, c: int, results: list[dict], wall: float) -> dict:
    tokens = sum(r["tokens"] for r in results)
    steps = sum(r["steps"] for r in results)
    return {"method": method, "concurrency": c, "requests": len(results), "tokens": tokens,
            "wall_s": wall, "tokens_per_s": tokens / wall, "requests_per_s": len(results) / wall,
            "S": tokens / steps if steps else float("nan"),
            "ttft_s": percentiles([r["ttft"] for r in results]),
            "itl_s": percentiles([r["itl"] for r in results if r["tokens"] > 1]),
            "e2e_s": percentiles([r["e2e"] for r in results])}


def main(argv=None) -> int:
    args = parse_args(argv)
    from lookahead_jax import Engine  # noqa: PLC0415
    from lookahead_jax.sampling import Sampling  # noqa: PLC0415
    from lookahead_jax.serving.server import Server  # noqa: PLC0415
    from lookahead_jax.serving.slots import Limits, SlotEngine, SlotRequest  # noqa: PLC0415
    from lookahead_jax.store.tokenizer import encode_messages  # noqa: PLC0415

    start = time.perf_counter()
    methods = [m for m in args.methods.split(",") if m]
    concurrency = [int(c) for c in args.concurrency.split(",")]
    prompts = mt_bench_turn1(args.data_dir, args.n)
    engine = Engine.from_preset(args.config, ckpt=args.ckpt, devices=1)
    la = engine.lookahead
    limits = Limits(max_len=args.max_len, max_tokens=args.max_tokens,
                    **({"W": la.W, "N": la.N, "G": la.G} if la else {}))
    slots = SlotEngine(engine, slots=args.slots, limits=limits)
    server = Server(slots, model_name=args.config, queue_size=max(64, args.n))
    messages = [[{"role": "user", "content": p}] for p in prompts]
    bodies = {m: [{"model": args.config, "messages": msg, "max_tokens": args.max_tokens,
                   "temperature": 0, "stream": True, "return_token_ids": True,
                   "lookahead": {"method": m}} for msg in messages] for m in methods}

    # warm-up, before the server listens: every prompt's prefill bucket and every row count
    t0 = time.perf_counter()
    for m in methods:
        for msg in messages:
            handle, first = slots.admit(SlotRequest(encode_messages(engine.tokenizer, msg),
                                                    method=m, max_tokens=1))
            slots.evict(handle)
        slots.warmup([SlotRequest(encode_messages(engine.tokenizer, messages[0]), method=m,
                                  max_tokens=2, sampling=Sampling())])
    warm_s = time.perf_counter() - t0
    print(f"warm-up (compiling {', '.join(methods)}): {warm_s:.0f} s", flush=True)

    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    port = asyncio.run_coroutine_threadsafe(server.start("127.0.0.1", 0), loop).result()
    url = f"http://127.0.0.1:{port}/v1/chat/completions"

    cells, skipped, outputs = [], [], {}
    for c in concurrency:
        for m in methods:
            if time.perf_counter() - start > args.budget_s:
                skipped.append({"method": m, "concurrency": c})
                print(f"skipped {m} at c={c}: past --budget_s", flush=True)
                continue
            results, wall = asyncio.run(run_cell(url, bodies[m], c))
            cell = summarize(m, c, results, wall)
            cells.append(cell)
            outputs.setdefault(m, [r["ids"] for r in results])
            print(f"{m:>14} c={c}: {cell['tokens_per_s']:.1f} tokens/s, S={cell['S']:.2f}, "
                  f"TTFT p50 {cell['ttft_s']['p50']:.2f} s, ITL p50 "
                  f"{1000 * cell['itl_s']['p50']:.0f} ms", flush=True)
    metrics_text = server.metrics.text().decode()
    asyncio.run_coroutine_threadsafe(server.shutdown(10), loop).result()
    loop.call_soon_threadsafe(loop.stop)

    lossless = all(outputs[m] == outputs[methods[0]] for m in outputs)
    by = {(x["method"], x["concurrency"]): x for x in cells}
    for x in cells:
        one = by.get((x["method"], 1))
        ar = by.get(("ar", x["concurrency"]))
        x["batching"] = x["tokens_per_s"] / one["tokens_per_s"] if one else float("nan")
        x["vs_ar"] = x["tokens_per_s"] / ar["tokens_per_s"] if ar else float("nan")
    headers = ["method", "clients", "tokens/s", "vs ar", "batching", "S", "TTFT p50 s",
               "TTFT p90 s", "ITL p50 ms", "ITL p90 ms", "E2E p50 s", "E2E p90 s"]
    rows = [[x["method"], x["concurrency"], x["tokens_per_s"], x["vs_ar"], x["batching"],
             x["S"], x["ttft_s"]["p50"], x["ttft_s"]["p90"], 1000 * x["itl_s"]["p50"],
             1000 * x["itl_s"]["p90"], x["e2e_s"]["p50"], x["e2e_s"]["p90"]] for x in cells]
    table = markdown_table(headers, rows)
    lines = [f"# Serving load: {args.config}, {args.n} MT-Bench prompts per cell, "
             f"{args.max_tokens} new tokens, greedy, {args.slots} slots", "",
             f"Machine: {machine_info()['processor']}, {os.cpu_count()} CPUs, JAX "
             f"{machine_info()['jax']} ({machine_info()['jax_backend']}). Warm-up (compile) "
             f"{warm_s:.0f} s, not in any cell.", "", table, "",
             "batching: throughput at this many clients / at one client (same method); "
             "vs ar: / plain decoding's at the same clients.", "",
             f"Greedy outputs equal across methods (lossless): {lossless}."]
    if skipped:
        lines.append(f"Skipped (past --budget_s): {skipped}")
    md = "\n".join(lines) + "\n"
    print("\n" + md)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "serve_load.md"), "w") as f:
        f.write(md)
    with open(os.path.join(args.out, "serve_load_metrics.txt"), "w") as f:
        f.write(metrics_text)
    write_json(os.path.join(args.out, "serve_load.json"), {
        "config": args.config, "n": args.n, "max_tokens": args.max_tokens,
        "slots": args.slots, "limits": limits.__dict__, "warmup_s": warm_s, "cells": cells,
        "skipped": skipped, "lossless": lossless, "machine": machine_info(),
        "median_itl_ms": {m: statistics.median(
            [1000 * x["itl_s"]["p50"] for x in cells if x["method"] == m] or [float("nan")])
            for m in methods}})
    return 0 if lossless else 1


if __name__ == "__main__":
    raise SystemExit(main())
