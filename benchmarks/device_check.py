"""One command for a first run on an accelerator: what lookahead decoding costs there.

    python -m benchmarks.device_check --out=DIR               # on a GPU or TPU, about 5-8 min
    python -m benchmarks.device_check --ckpt=/path/to/Llama-2-7b-chat-hf --out=DIR
    python -m benchmarks.device_check --smoke --out=/tmp/dc  # on any machine, tiny shapes, seconds

It needs only this repository and JAX, flax, numpy, absl-py, safetensors, transformers (no
torch, no network; `gguf` only when --ckpt is a GGUF file), and measures, in this order:

  kernel    the Pallas lookahead-attention kernel compiled on the device: its largest error
            against the dense attention (float32, highest matmul precision; and bfloat16), and
            one layer's attention timed against the dense path at (15, 5, 15), Llama-2-7B heads
  plain     a Llama-2-7B-shaped model in bfloat16 with random weights: plain decoding ms per
            token (a 512-token prompt) against the device's HBM roofline: the bytes a token reads
            (every weight but the embedding table, plus the K/V of the 512 cached tokens) over
            the copy bandwidth measured here
  lookahead lookahead steps at (15,5,15), (7,5,7), (5,3,5) on that model, dense and Pallas
            attention: ms per step (the whole step: forward, verification, pool, window) and
            its multiple of a plain step; with the step compression S measured for SmolLM2 at
            the same settings (`benchmarks/results/lookahead_bench.json`) the *implied*
            speed-up S / multiple (random weights accept nothing, so only the cost is measured)
  step_cost one forward pass of T = 1, 2, 4, ..., 256 new tokens over a 512-token cache
  ckpt      with --ckpt (a Hugging Face directory or a GGUF; --config names its preset): plain and
            lookahead greedy decoding of 10 MT-Bench prompts (`benchmarks/data`): tokens/s, S,
            speed-up, and whether every output is token-identical; skipped otherwise

Each part is timed against --budget_s; a part that would start after the budget is spent is
skipped and says so. Results go to DIR/device_check.json and DIR/device_check.md after every
part (a stopped run keeps what it measured), and a summary is printed. The exit status is 1
when the kernel is not exact, an output differs, or a part failed; else 0.

--smoke runs every part on tiny shapes (a 2-layer model, the kernel in the Pallas interpreter
where the platform has no kernel backend) in seconds, so that a test keeps this script
working; its times mean nothing.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import time
import traceback
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags, logging
from flax import nnx

from benchmarks import common
from lookahead_jax.engine import Engine
from lookahead_jax.lookahead.config import LookaheadConfig
from lookahead_jax.lookahead.layout import StepLayout
from lookahead_jax.lookahead.mask import StepMask, dense_attention
from lookahead_jax.store.checkpoint import load_model_and_tokenizer
from lookahead_jax.store.presets import load_preset
from lookahead_jax.tuning.roofline import measure_bandwidth
from lookahead_jax.tuning.step_cost import measure_step_cost
from models import Llama, LlamaConfig
from pallas_kernels.attention import select_attention
from pallas_kernels.gpu_bench import time_call
from pallas_kernels.lookahead_attention import lookahead_attention
from pallas_kernels.platform import KERNEL_BACKENDS

FLAGS = flags.FLAGS
RESULTS = os.path.join(common.REPO, "benchmarks", "results")
PROMPT_DIR = os.path.join(common.REPO, "benchmarks", "data")
SMOLLM2_BENCH = os.path.join(RESULTS, "lookahead_bench.json")


@dataclasses.dataclass(frozen=True)
class Shapes:
    """What one run measures: the full check or the smoke test."""

    model: LlamaConfig
    dtype: str
    prompt_len: int  # tokens in the cache before the measured steps
    new_tokens: int  # per timed generation
    step_tokens: tuple[int, ...]
    settings: tuple[tuple[int, int, int], ...]
    kernel_setting: tuple[int, int, int]
    kernel_heads: tuple[int, int, int]  # query heads, K/V heads, head dim
    kernel_cache: tuple[int, ...]
    copy_bytes: int
    iters: int
    repeats: int


def full_shapes() -> Shapes:
    return Shapes(model=load_preset("llama7b").model, dtype="bfloat16", prompt_len=512,
                  new_tokens=64, step_tokens=(1, 2, 4, 8, 16, 32, 64, 128, 256),
                  settings=((15, 5, 15), (7, 5, 7), (5, 3, 5)), kernel_setting=(15, 5, 15),
                  kernel_heads=(32, 32, 128), kernel_cache=(512, 2048), copy_bytes=2 << 30,
                  iters=20, repeats=5)


def smoke_shapes() -> Shapes:
    return Shapes(model=load_preset("tiny_llama").model, dtype="float32", prompt_len=32,
                  new_tokens=8, step_tokens=(1, 2, 4, 8), settings=((5, 3, 5),),
                  kernel_setting=(5, 3, 5), kernel_heads=(4, 2, 16), kernel_cache=(13,),
                  copy_bytes=8 << 20, iters=2, repeats=2)


def one_line(e: BaseException) -> str:
    return " ".join(f"{type(e).__name__}: {e}".split())[:400]


# -- the parts -----------------------------------------------------------------------------------
def kernel_mode(smoke: bool) -> tuple[str | None, bool]:
    """(kernel backend, interpret) on this platform; (None, False) when there is no kernel."""
    backend = KERNEL_BACKENDS.get(jax.default_backend())
    if backend is not None:
        return backend, False
    return ("triton", True) if smoke else (None, False)


def part_kernel(shapes: Shapes, smoke: bool) -> dict:
    backend, interpret = kernel_mode(smoke)
    if backend is None:
        return {"skipped": f"no Pallas kernel backend on platform {jax.default_backend()!r}"}
    layout = StepLayout(*shapes.kernel_setting)
    h, hkv, d = shapes.kernel_heads
    t = layout.size
    rng = np.random.default_rng(0)
    kernel = jax.jit(lambda q, k, v, m, ck, cv: lookahead_attention(
        q, k, v, m, ck, cv, backend=backend, interpret=interpret))
    dense = jax.jit(dense_attention)
    rows = []
    for cache_len in shapes.kernel_cache:
        shapes_ = ((1, t, h, d), (1, t, hkv, d), (1, t, hkv, d), (1, hkv, cache_len, d),
                   (1, hkv, cache_len, d))
        q32, k32, v32, ck32, cv32 = (jnp.asarray(rng.normal(size=s), jnp.float32)
                                     for s in shapes_)
        mask = StepMask(jnp.full((1,), cache_len, jnp.int32), layout, cache_len)
        with jax.default_matmul_precision("highest"):
            ref = dense(q32, k32, v32, mask, ck32, cv32)
            err32 = float(jnp.max(jnp.abs(kernel(q32, k32, v32, mask, ck32, cv32) - ref)))
        q16, k16, v16, ck16, cv16 = (x.astype(jnp.bfloat16)
                                     for x in (q32, k32, v32, ck32, cv32))
        args = (q16, k16, v16, mask, ck16, cv16)
        err16 = float(jnp.max(jnp.abs(kernel(*args).astype(jnp.float32) - ref)))
        kernel_us = 1e6 * time_call(kernel, args, shapes.iters, shapes.repeats)
        dense_us = 1e6 * time_call(dense, args, shapes.iters, shapes.repeats)
        rows.append({"cache_len": cache_len, "max_err_f32": err32, "max_err_bf16": err16,
                     "kernel_us": kernel_us, "dense_us": dense_us,
                     "dense_over_kernel": dense_us / kernel_us})
    exact = all(r["max_err_f32"] <= 1e-4 and r["max_err_bf16"] <= 5e-2 for r in rows)
    return {"backend": backend, "interpret": interpret, "setting": list(shapes.kernel_setting),
            "T": t, "heads": h, "kv_heads": hkv, "head_dim": d, "tolerance_f32": 1e-4,
            "tolerance_bf16": 5e-2, "exact": exact, "rows": rows}


def random_model(shapes: Shapes) -> Llama:
    return Llama(shapes.model, dtype=jnp.dtype(shapes.dtype), rngs=nnx.Rngs(0))


def prompt_ids(shapes: Shapes) -> list[int]:
    rng = np.random.default_rng(1)
    return rng.integers(3, shapes.model.vocab_size, shapes.prompt_len).tolist()


def decode_ms_per_step(engine: Engine, prompt: list[int], new_tokens: int, **kw) -> dict:
    """One generation: ms per decoding step (the prefill and compilation excluded)."""
    res = engine.generate_ids([prompt], max_new_tokens=new_tokens, **kw)
    st = res.stats
    loop_steps = max(st.steps - 1, 1)  # st.steps counts the prefill
    return {"ms_per_step": 1e3 * st.decode_s / loop_steps, "steps": st.steps,
            "tokens": st.total_tokens, "compile_s": st.compile_s}


def part_plain(shapes: Shapes, model: Llama) -> dict:
    cfg = shapes.model
    params = nnx.state(model, nnx.Param)
    param_bytes = sum(x.nbytes for x in jax.tree.leaves(params))
    embed_bytes = model.embed_tokens.embedding.get_value().nbytes
    itemsize = jnp.dtype(shapes.dtype).itemsize
    kv_bytes = 2 * cfg.num_layers * shapes.prompt_len * cfg.num_kv_heads * cfg.head_dim * itemsize
    # the embedding table is read one row per token (tied weights: the LM head reads it all)
    read = param_bytes - (0 if cfg.tie_word_embeddings else embed_bytes) + kv_bytes
    bw = measure_bandwidth(shapes.copy_bytes, kind="copy", iters=shapes.iters,
                           repeats=shapes.repeats)
    run = decode_ms_per_step(Engine(model, eos_ids=()), prompt_ids(shapes), 2 * shapes.new_tokens,
                             method="ar")
    roofline_ms = 1e3 * read / bw
    return {"params": int(sum(x.size for x in jax.tree.leaves(params))),
            "param_bytes": param_bytes, "kv_bytes": kv_bytes, "bytes_per_token": read,
            "copy_GBps": bw / 1e9, "roofline_ms": roofline_ms, "ms_per_token": run["ms_per_step"],
            "of_roofline": roofline_ms / run["ms_per_step"], "tokens": run["tokens"],
            "compile_s": run["compile_s"]}


def smollm2_step_compression(path: str = SMOLLM2_BENCH) -> dict[str, dict[str, float]]:
    """'(W,N,G)' -> {data set: S} from the committed SmolLM2 lookahead benchmark (greedy, no
    prompt seeding)."""
    if not os.path.isfile(path):
        return {}
    with open(path, encoding="utf-8") as f:
        rec = json.load(f)
    out: dict[str, dict[str, float]] = {}
    for row in rec.get("summary", []):
        if row.get("W") is not None and not row["method"].endswith("+prompt"):
            out.setdefault(row["method"], {})[row["dataset"]] = float(row["S"])
    return out


def part_lookahead(shapes: Shapes, model: Llama, plain_ms: float, smoke: bool,
                   budget: "Budget") -> dict:
    backend, interpret = kernel_mode(smoke)
    attentions: dict[str, Any] = {"dense": "dense"}
    if backend is not None:
        attentions["pallas"] = select_attention("pallas", interpret=interpret)
    measured_s = smollm2_step_compression()
    prompt = prompt_ids(shapes)
    rows = []
    for w, n, g in shapes.settings:
        name = f"({w},{n},{g})"
        row = {"setting": name, "T": StepLayout(w, n, g).size}
        for label, attention in attentions.items():
            if budget.spent():
                row[f"{label}_skipped"] = budget.reason()
                continue
            run = decode_ms_per_step(Engine(model, eos_ids=(), attention=attention), prompt,
                                     shapes.new_tokens, method="lookahead",
                                     lookahead=LookaheadConfig(W=w, N=n, G=g))
            row[f"{label}_ms"] = run["ms_per_step"]
            row[f"{label}_x_plain"] = run["ms_per_step"] / plain_ms
        best = min((row[k] for k in row if k.endswith("_x_plain")), default=None)
        row["smollm2_S"] = measured_s.get(name, {})
        if best:
            row["implied_speedup"] = {ds: s / best for ds, s in row["smollm2_S"].items()}
        rows.append(row)
    return {"plain_ms": plain_ms, "attentions": list(attentions), "kernel_interpret": interpret,
            "S_from": os.path.relpath(SMOLLM2_BENCH, common.REPO), "rows": rows}


def part_step_cost(shapes: Shapes, model: Llama, budget: "Budget") -> dict:
    graphdef, params = nnx.split(model)
    costs, skipped = {}, []
    for t in shapes.step_tokens:
        if budget.spent():
            skipped.append(t)
            continue
        costs.update(measure_step_cost(graphdef, params, [t], cache_len=shapes.prompt_len,
                                       repeats=shapes.repeats))
    base = costs.get(1)
    rows = [{"T": t, "ms": 1e3 * s, "x_T1": s / base if base else None}
            for t, s in sorted(costs.items())]
    out = {"cache_len": shapes.prompt_len, "rows": rows}
    if skipped:
        out["skipped_T"] = skipped
        out["skipped"] = budget.reason()
    return out


def mt_bench_prompts(n: int) -> list[str]:
    return common.mt_bench_turn1(PROMPT_DIR, n)


def part_ckpt(ckpt: str | None, config: str, num_prompts: int, max_new_tokens: int,
              setting: tuple[int, int, int] | None, budget: "Budget") -> dict:
    if not ckpt:
        return {"skipped": "no --ckpt given (a Hugging Face directory or a GGUF file)"}
    preset = load_preset(config)
    model, tokenizer, source = load_model_and_tokenizer(preset, ckpt)
    if tokenizer is None:
        return {"skipped": f"{source} has no tokenizer: the MT-Bench prompts need one"}
    la = LookaheadConfig(*setting) if setting else (preset.lookahead or LookaheadConfig(15, 5, 15))
    engine = Engine(model, tokenizer, chat=preset.chat, attention="auto")
    rows, totals = [], {"plain": [0, 0, 0.0], "lookahead": [0, 0, 0.0]}  # tokens, steps, s
    for i, text in enumerate(mt_bench_prompts(num_prompts)):
        if budget.spent():
            break
        ids = engine.encode(text)
        plain = engine.generate_ids([ids], method="ar", max_new_tokens=max_new_tokens)
        look = engine.generate_ids([ids], method="lookahead", lookahead=la,
                                   max_new_tokens=max_new_tokens)
        for key, res in (("plain", plain), ("lookahead", look)):
            st = res.stats
            totals[key][0] += st.total_tokens
            totals[key][1] += st.steps
            totals[key][2] += st.prefill_s + st.decode_s
        rows.append({"prompt": i, "tokens": look.stats.total_tokens,
                     "S": look.stats.step_compression, "identical": look.tokens == plain.tokens})
    if not rows:
        return {"skipped": budget.reason()}
    tps = {k: v[0] / v[2] for k, v in totals.items()}
    out = {"ckpt": source, "config": config, "dtype": jnp.dtype(model.dtype).name, "setting":
           [la.W, la.N, la.G], "attention": "auto", "prompts": len(rows),
           "max_new_tokens": max_new_tokens, "plain_tokens_per_s": tps["plain"],
           "lookahead_tokens_per_s": tps["lookahead"],
           "S": totals["lookahead"][0] / totals["lookahead"][1],
           "speedup": tps["lookahead"] / tps["plain"],
           "identical": sum(r["identical"] for r in rows), "rows": rows}
    if len(rows) < num_prompts:
        out["stopped"] = f"{len(rows)} of {num_prompts} prompts: {budget.reason()}"
    return out


# -- running and reporting -----------------------------------------------------------------------
class Budget:
    def __init__(self, seconds: float):
        self.seconds = seconds
        self.t0 = time.perf_counter()

    def elapsed(self) -> float:
        return time.perf_counter() - self.t0

    def spent(self) -> bool:
        return self.elapsed() >= self.seconds

    def reason(self) -> str:
        return f"time budget of {self.seconds:.0f} s spent (--budget_s)"


def fmt(v: Any, digits: int = 2) -> str:
    if v is None:
        return "n/a"
    if isinstance(v, float):
        return f"{v:.{digits}e}" if v and abs(v) < 1e-3 else f"{v:.{digits}f}"
    return str(v)


def markdown(rec: dict) -> str:
    dev = rec["device"]
    lines = [f"# device_check: {dev['kind']} ({dev['platform']}, {dev['count']} device(s)), "
             f"JAX {dev['jax']}{', SMOKE (tiny shapes, times mean nothing)' if rec['smoke'] else ''}",
             ""]
    parts = rec["parts"]
    for name in ("kernel", "plain", "lookahead", "step_cost", "ckpt"):
        p = parts.get(name)
        lines.append(f"## {name}")
        if p is None:
            lines += ["not run", ""]
            continue
        if "error" in p:
            lines += [f"FAILED: {p['error']}", ""]
            continue
        if "skipped" in p and len(p) <= 2:
            lines += [f"skipped: {p['skipped']}", ""]
            continue
        if name == "kernel":
            lines.append(f"backend {p['backend']}{' (interpreter)' if p['interpret'] else ''}, "
                         f"setting {tuple(p['setting'])} (T={p['T']}), {p['heads']} heads / "
                         f"{p['kv_heads']} K/V heads x {p['head_dim']}; exact: "
                         f"{'yes' if p['exact'] else 'NO'}")
            lines.append(common.markdown_table(
                ["cache", "max err f32", "max err bf16", "kernel us (bf16)", "dense us (bf16)",
                 "dense / kernel"],
                [[r["cache_len"], fmt(r["max_err_f32"]), fmt(r["max_err_bf16"]),
                  fmt(r["kernel_us"], 1), fmt(r["dense_us"], 1), fmt(r["dense_over_kernel"])]
                 for r in p["rows"]]))
        elif name == "plain":
            lines.append(common.markdown_table(
                ["params", "GB read / token", "copy GB/s", "roofline ms/token",
                 "measured ms/token", "of roofline"],
                [[f"{p['params'] / 1e9:.2f}B", fmt(p["bytes_per_token"] / 1e9, 3),
                  fmt(p["copy_GBps"], 0), fmt(p["roofline_ms"], 3), fmt(p["ms_per_token"], 3),
                  f"{100 * p['of_roofline']:.0f}%"]]))
        elif name == "lookahead":
            att = p["attentions"]
            head = ["setting", "T"] + [f"{a} ms/step" for a in att] + [f"{a} x plain"
                                                                      for a in att]
            datasets = sorted({ds for r in p["rows"] for ds in r.get("smollm2_S", {})})
            head += [f"S {ds} (SmolLM2)" for ds in datasets]
            head += [f"implied speed-up {ds}" for ds in datasets]
            rows = []
            for r in p["rows"]:
                rows.append([r["setting"], r["T"]]
                            + [fmt(r.get(f"{a}_ms")) for a in att]
                            + [fmt(r.get(f"{a}_x_plain")) for a in att]
                            + [fmt(r["smollm2_S"].get(ds)) for ds in datasets]
                            + [fmt(r.get("implied_speedup", {}).get(ds)) for ds in datasets])
            lines.append(f"plain step: {fmt(p['plain_ms'], 3)} ms. Implied speed-up = S measured "
                         f"for SmolLM2 at the setting ({p['S_from']}) / the step's multiple of "
                         f"a plain step (the faster attention): *implied*, not measured here.")
            lines.append(common.markdown_table(head, rows))
        elif name == "step_cost":
            lines.append(f"one forward pass of T new tokens over a {p['cache_len']}-token cache")
            lines.append(common.markdown_table(
                ["T", "ms", "x T=1"], [[r["T"], fmt(r["ms"], 3), fmt(r["x_T1"])]
                                      for r in p["rows"]]))
            if p.get("skipped"):
                lines.append(f"not measured: T = {p['skipped_T']} ({p['skipped']})")
        elif name == "ckpt":
            lines.append(f"{p['ckpt']} ({p['config']}, {p['dtype']}), lookahead "
                         f"{tuple(p['setting'])}, {p['prompts']} MT-Bench prompts x "
                         f"{p['max_new_tokens']} new tokens, greedy")
            lines.append(common.markdown_table(
                ["plain tokens/s", "lookahead tokens/s", "S", "speed-up", "token-identical"],
                [[fmt(p["plain_tokens_per_s"], 1), fmt(p["lookahead_tokens_per_s"], 1),
                  fmt(p["S"]), f"{p['speedup']:.2f}x", f"{p['identical']}/{p['prompts']}"]]))
            if p.get("stopped"):
                lines.append(p["stopped"])
        lines.append(f"({p.get('seconds', 0):.0f} s)")
        lines.append("")
    lines.append(f"total {rec['seconds']:.0f} s; status: {rec['status']}")
    return "\n".join(lines) + "\n"


def failures(rec: dict) -> list[str]:
    out = []
    for name, p in rec["parts"].items():
        if "error" in p:
            out.append(f"{name} failed")
    if rec["parts"].get("kernel", {}).get("exact") is False:
        out.append("kernel not exact")
    ck = rec["parts"].get("ckpt", {})
    if "identical" in ck and ck["identical"] != ck["prompts"]:
        out.append(f"{ck['prompts'] - ck['identical']} outputs differ from plain greedy")
    return out


def write(rec: dict, out_dir: str) -> None:
    rec["seconds"] = rec["budget"].elapsed() if "budget" in rec else rec.get("seconds", 0)
    body = {k: v for k, v in rec.items() if k != "budget"}
    common.write_json(os.path.join(out_dir, "device_check.json"), body)
    with open(os.path.join(out_dir, "device_check.md"), "w", encoding="utf-8") as f:
        f.write(markdown(body))


def run(*, out_dir: str, smoke: bool = False, ckpt: str | None = None, config: str = "llama7b",
        budget_s: float = 450.0, num_prompts: int = 10, max_new_tokens: int = 128,
        log: Callable[[str], None] = lambda s: print(s, file=sys.stderr, flush=True)) -> dict:
    """Runs every part; returns the record (also written to out_dir)."""
    shapes = smoke_shapes() if smoke else full_shapes()
    budget = Budget(budget_s)
    dev = jax.devices()[0]
    rec: dict[str, Any] = {
        "device": {"kind": dev.device_kind, "platform": jax.default_backend(),
                   "count": jax.device_count(), "jax": jax.__version__},
        "machine": common.machine_info(), "smoke": smoke, "budget_s": budget_s,
        "shapes": {"model": dataclasses.asdict(shapes.model), "dtype": shapes.dtype,
                   "prompt_len": shapes.prompt_len, "new_tokens": shapes.new_tokens},
        "parts": {}, "status": "running", "budget": budget}
    os.makedirs(out_dir, exist_ok=True)
    state: dict[str, Any] = {}

    def part(name: str, fn: Callable[[], dict]) -> None:
        if budget.spent():
            rec["parts"][name] = {"skipped": budget.reason()}
        else:
            log(f"[{budget.elapsed():6.1f} s] {name} ...")
            t0 = time.perf_counter()
            try:
                rec["parts"][name] = fn()
            except Exception as e:  # noqa: BLE001 (a failed part is reported; the rest runs)
                rec["parts"][name] = {"error": one_line(e)}
                log(traceback.format_exc())
            rec["parts"][name]["seconds"] = time.perf_counter() - t0
        write(rec, out_dir)

    def need_model() -> Llama:
        if "model" not in state:
            t0 = time.perf_counter()
            state["model"] = random_model(shapes)
            rec["model_init_s"] = time.perf_counter() - t0
        return state["model"]

    part("kernel", lambda: part_kernel(shapes, smoke))

    def plain() -> dict:
        out = part_plain(shapes, need_model())
        state["plain_ms"] = out["ms_per_token"]
        return out

    part("plain", plain)
    part("lookahead", lambda: (
        part_lookahead(shapes, need_model(), state["plain_ms"], smoke, budget)
        if "plain_ms" in state else {"skipped": "needs the plain step time (plain failed)"}))
    part("step_cost", lambda: part_step_cost(shapes, need_model(), budget))
    state.pop("model", None)  # free the random model before a real checkpoint loads
    part("ckpt", lambda: part_ckpt(ckpt, config, num_prompts, max_new_tokens,
                                   shapes.settings[0] if smoke else None, budget))
    bad = failures(rec)
    rec["status"] = "ok" if not bad else "; ".join(bad)
    write(rec, out_dir)
    rec.pop("budget")
    return rec


def define_flags() -> None:
    if "budget_s" in FLAGS:
        return
    flags.DEFINE_string("out", None, "directory for device_check.json and device_check.md "
                        "(default: benchmarks/results/device_check, or device_check_smoke)")
    flags.DEFINE_bool("smoke", False, "tiny shapes, seconds, any platform (times mean nothing)")
    flags.DEFINE_string("ckpt", None, "a real checkpoint (Hugging Face directory or .gguf) for "
                        "the end-to-end MT-Bench part")
    flags.DEFINE_string("config", "llama7b", "the preset that --ckpt matches (e.g. "
                        "smollm2_135m for a SmolLM2 GGUF)")
    flags.DEFINE_float("budget_s", 450.0, "seconds after which no further part starts")
    flags.DEFINE_integer("num_prompts", 10, "MT-Bench prompts for --ckpt (at most 10 ship)")
    flags.DEFINE_integer("max_new_tokens", 128, "new tokens per prompt for --ckpt")


def main(argv: Sequence[str]) -> int:
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments {' '.join(argv[1:])!r}")
    if FLAGS["verbosity"].using_default_value:
        logging.set_verbosity(logging.WARNING)  # absl's INFO default reports a TPU probe
    platform = jax.default_backend()
    if platform == "cpu" and not FLAGS.smoke:
        print("device_check: JAX sees no accelerator here (platform 'cpu'). Install the JAX for "
              "your GPU or TPU (pip install -e '.[cuda12]', '.[cuda13]' or '.[tpu]'), or run "
              "--smoke to check this script on tiny shapes.", file=sys.stderr)
        return 2
    out_dir = FLAGS.out or os.path.join(RESULTS, "device_check_smoke" if FLAGS.smoke
                                        else "device_check")
    rec = run(out_dir=out_dir, smoke=FLAGS.smoke, ckpt=FLAGS.ckpt, config=FLAGS.config,
              budget_s=FLAGS.budget_s, num_prompts=FLAGS.num_prompts,
              max_new_tokens=FLAGS.max_new_tokens)
    with open(os.path.join(out_dir, "device_check.md"), encoding="utf-8") as f:
        print(f.read())
    print(f"written: {os.path.join(out_dir, 'device_check.json')} and device_check.md")
    return 0 if rec["status"] == "ok" else 1


if __name__ == "__main__":
    define_flags()
    app.run(main)
