"""Plain decoding: ours (JAX, `--method=ar`) against Hugging Face transformers greedy (PyTorch).

    python -m benchmarks.plain_vs_hf [--num_prompts=10] [--out=results/plain_vs_hf.json]

Both run the same fp32 weights: the preset's checkpoint (SmolLM2-135M-Instruct by default) is
loaded into our `Llama`, and a `transformers.LlamaForCausalLM` built from the same config gets a
copy of those parameters, so any difference is the implementation, not the weights. For each of
the first `--num_prompts` MT-Bench turn-1 prompts (chat template, `--max_new_tokens` new
tokens, both stop at EOS) ours runs, then Hugging Face's, side by side in one process; one
warm-up prompt runs first and is not counted. Tokens/s = new tokens / wall time of the
generation; our compile time is excluded and reported separately. Also checks the two emit
identical tokens. Prints a Markdown table and writes JSON to `--out`.
"""

from __future__ import annotations

import os
import sys
import time

if __package__ in (None, ""):  # run as a file: make the repository importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from absl import app, flags, logging  # noqa: E402

from benchmarks import common  # noqa: E402

_CONFIG = flags.DEFINE_string("config", "smollm2_135m", "Preset (configs/<name>.py).")
_CKPT = flags.DEFINE_string("ckpt", None, "Checkpoint overriding the preset's.")
_DATA_DIR = flags.DEFINE_string("data_dir", common.DEFAULT_DATA_DIR,
                                "Directory with mt_bench_question.jsonl.")
_NUM_PROMPTS = flags.DEFINE_integer("num_prompts", 10, "Measured prompts (after 1 warm-up).")
_MAX_NEW = flags.DEFINE_integer("max_new_tokens", 128, "New tokens per prompt (at most).")
_THREADS = flags.DEFINE_integer("threads", 0, "PyTorch threads (0 = all cores).")
_BANDWIDTH = flags.DEFINE_string(
    "bandwidth_gbs", "20,37", "This machine's memory read rate, low,high in GB/s, for the "
    "tokens/s ceiling of memory-bound decoding.")
_OUT = flags.DEFINE_string("out", os.path.join(common.REPO, "results", "plain_vs_hf.json"),
                           "JSON output path.")


def hf_model_like(engine):
    """A `transformers.LlamaForCausalLM` (fp32, eval) holding a copy of the engine's parameters."""
    import numpy as np  # noqa: PLC0415
    import torch  # noqa: PLC0415
    import transformers  # noqa: PLC0415
    from flax import nnx  # noqa: PLC0415

    c = engine.config
    rope_scaling = None
    if c.rope_scaling is not None:
        s = c.rope_scaling
        rope_scaling = ({"rope_type": "linear", "factor": s.factor} if s.rope_type == "linear"
                        else {"rope_type": "llama3", "factor": s.factor,
                              "low_freq_factor": s.low_freq_factor,
                              "high_freq_factor": s.high_freq_factor,
                              "original_max_position_embeddings":
                                  s.original_max_position_embeddings})
    hf_cfg = transformers.LlamaConfig(
        vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
        num_hidden_layers=c.num_layers, num_attention_heads=c.num_heads,
        num_key_value_heads=c.num_kv_heads, head_dim=c.head_dim, rope_theta=c.rope_theta,
        rope_scaling=rope_scaling, rms_norm_eps=c.rms_norm_eps,
        tie_word_embeddings=c.tie_word_embeddings,
        max_position_embeddings=c.max_position_embeddings, bos_token_id=c.bos_token_id,
        eos_token_id=list(engine.eos_ids), pad_token_id=engine.eos_ids[0] if engine.eos_ids else 0)
    model = transformers.LlamaForCausalLM(hf_cfg).to(torch.float32).eval()
    state = {}
    for path, var in nnx.to_flat_state(engine.params):
        arr = np.asarray(var.get_value(), np.float32)
        if path == ("embed_tokens", "embedding"):
            state["model.embed_tokens.weight"] = arr
        elif path == ("norm", "weight"):
            state["model.norm.weight"] = arr
        elif path == ("lm_head", "kernel"):
            state["lm_head.weight"] = arr.T
        elif path[0] == "layers":
            name = "model.layers." + ".".join(str(p) for p in path[1:-1])
            state[name + ".weight"] = arr.T if path[-1] == "kernel" else arr
        else:
            raise ValueError(f"no Hugging Face name for parameter {path}")
    missing, unexpected = model.load_state_dict(
        {k: torch.from_numpy(np.array(v, copy=True)) for k, v in state.items()}, strict=False)
    allowed_missing = {"lm_head.weight"} if c.tie_word_embeddings else set()
    if unexpected or set(missing) - allowed_missing:
        raise ValueError(f"parameter copy: missing {missing}, unexpected {unexpected}")
    return model


def check_logits(engine, hf, ids) -> float:
    """Max |logit difference| between ours and Hugging Face's on one prompt (a sanity check)."""
    import jax.numpy as jnp  # noqa: PLC0415
    import numpy as np  # noqa: PLC0415
    import torch  # noqa: PLC0415
    from flax import nnx  # noqa: PLC0415

    from models.layers import causal_mask  # noqa: PLC0415

    model = nnx.merge(engine.graphdef, engine.params)
    toks = jnp.asarray([ids], jnp.int32)
    pos = jnp.arange(len(ids), dtype=jnp.int32)[None]
    ours, _ = model(toks, pos, causal_mask(jnp.asarray([len(ids)]), len(ids)))
    with torch.inference_mode():
        theirs = hf(torch.tensor([ids])).logits.float().numpy()
    return float(np.abs(np.asarray(ours) - theirs).max())


def run_ours(engine, ids, max_new_tokens):
    r = engine.generate_ids([ids], method="ar", max_new_tokens=max_new_tokens)
    return r.tokens[0], r.stats.prefill_s + r.stats.decode_s, r.stats.compile_s


def run_hf(hf, ids, max_new_tokens, eos_ids):
    import torch  # noqa: PLC0415
    x = torch.tensor([ids])
    with torch.inference_mode():
        t0 = time.perf_counter()
        out = hf.generate(input_ids=x, attention_mask=torch.ones_like(x), do_sample=False,
                          max_new_tokens=max_new_tokens, eos_token_id=list(eos_ids),
                          pad_token_id=eos_ids[0] if eos_ids else 0)
        dt = time.perf_counter() - t0
    return out[0, len(ids):].tolist(), dt


def first_difference(a, b) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def measure_prompts(engine, hf, prompts: list[str], encoded: list[list[int]], n_new: int):
    """Ours then Hugging Face on each prompt. -> (table rows, JSON records, totals, our
    compile seconds)."""
    eos = engine.eos_ids
    compile_s = 0.0
    rows, records = [], []
    tot = {"ours_tokens": 0, "ours_s": 0.0, "hf_tokens": 0, "hf_s": 0.0}
    for i, (text, ids) in enumerate(zip(prompts, encoded), 1):
        ours, ours_s, c = run_ours(engine, ids, n_new)
        compile_s += c
        theirs, hf_s = run_hf(hf, ids, n_new, eos)
        diff = first_difference(ours, theirs)
        ours_tps, hf_tps = len(ours) / ours_s, len(theirs) / hf_s
        tot["ours_tokens"] += len(ours)
        tot["ours_s"] += ours_s
        tot["hf_tokens"] += len(theirs)
        tot["hf_s"] += hf_s
        rows.append([i, common.short(text, 36), len(ids), f"{len(ours)}/{len(theirs)}", ours_tps,
                     hf_tps, f"{ours_tps / hf_tps:.2f}x",
                     "yes" if diff is None else f"no (from token {diff})"])
        records.append({"prompt": text, "prompt_tokens": len(ids), "ours_tokens": ours,
                        "hf_tokens": theirs, "ours_s": ours_s, "hf_s": hf_s,
                        "ours_tokens_per_s": ours_tps, "hf_tokens_per_s": hf_tps,
                        "identical": diff is None, "first_difference": diff})
        print(f"prompt {i}: ours {ours_tps:.1f} tok/s, HF {hf_tps:.1f} tok/s", file=sys.stderr)
    return rows, records, tot, compile_s


def main(argv):
    del argv
    if flags.FLAGS["verbosity"].using_default_value:
        logging.set_verbosity(logging.WARNING)  # absl's INFO default reports a TPU probe
    try:
        prompts = common.mt_bench_turn1(_DATA_DIR.value, _NUM_PROMPTS.value + 1)
    except common.DataError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    import torch  # noqa: PLC0415
    import transformers  # noqa: PLC0415

    from lookahead_jax.engine import Engine  # noqa: PLC0415
    from models.config import ConfigError  # noqa: PLC0415

    torch.set_num_threads(_THREADS.value or os.cpu_count())
    transformers.logging.set_verbosity_error()
    try:
        engine = Engine.from_preset(_CONFIG.value, ckpt=_CKPT.value, dtype="float32")
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    hf = hf_model_like(engine)
    n_new = _MAX_NEW.value
    eos = engine.eos_ids
    encoded = [engine.encode(p, chat=True) for p in prompts]
    logit_diff = check_logits(engine, hf, encoded[0])
    print(f"max |logit difference| ours vs Hugging Face on the warm-up prompt: {logit_diff:.2e}",
          file=sys.stderr)

    # warm-up (not counted): compiles ours for this prompt's bucket, warms torch's kernels
    _, _, compile_s = run_ours(engine, encoded[0], n_new)
    run_hf(hf, encoded[0], n_new, eos)

    rows, records, tot, c = measure_prompts(engine, hf, prompts[1:], encoded[1:], n_new)
    compile_s += c

    ours_tps = tot["ours_tokens"] / tot["ours_s"]
    hf_tps = tot["hf_tokens"] / tot["hf_s"]
    matches = sum(r["identical"] for r in records)
    rows.append(["", "**total**", "", f"{tot['ours_tokens']}/{tot['hf_tokens']}", ours_tps, hf_tps,
                 f"{ours_tps / hf_tps:.2f}x", f"{matches}/{len(records)}"])
    headers = ["#", "prompt (MT-Bench turn 1)", "prompt tok", "new tok ours/HF", "ours tok/s",
               "HF tok/s", "ours/HF", "identical"]

    import jax  # noqa: PLC0415
    weight_bytes = sum(x.nbytes for x in jax.tree.leaves(engine.params))
    lo, hi = (float(x) for x in _BANDWIDTH.value.split(","))
    ceil_lo, ceil_hi = lo * 1e9 / weight_bytes, hi * 1e9 / weight_bytes
    print(f"\n## Plain decoding: ours vs Hugging Face greedy ({engine.config.num_layers}-layer "
          f"{_CONFIG.value}, fp32, {n_new} new tokens, {len(records)} prompts)\n")
    print(common.markdown_table(headers, rows))
    print(f"\nidentical outputs: {matches}/{len(records)}; our compile time (excluded above): "
          f"{compile_s:.1f}s; max |logit difference|: {logit_diff:.1e}")
    print(f"bound: this machine reads memory at ~{lo:g}-{hi:g} GB/s; fp32 {_CONFIG.value} = "
          f"{weight_bytes / 1e6:.0f} MB/token -> {ceil_lo:.0f}-{ceil_hi:.0f} tok/s ceiling; "
          f"ours {ours_tps:.1f} tok/s = {100 * ours_tps / ceil_hi:.0f}-"
          f"{100 * ours_tps / ceil_lo:.0f}% "
          f"of it, Hugging Face {hf_tps:.1f} tok/s = {100 * hf_tps / ceil_hi:.0f}-"
          f"{100 * hf_tps / ceil_lo:.0f}%")

    path = common.write_json(_OUT.value, {
        "benchmark": "plain_vs_hf", "config": _CONFIG.value, "checkpoint": _CKPT.value,
        "dtype": "float32", "max_new_tokens": n_new, "data": common.MT_BENCH + " turn 1",
        "num_prompts": len(records), "warmup_prompts": 1, "machine": common.machine_info(),
        "ours_tokens_per_s": ours_tps, "hf_tokens_per_s": hf_tps, "ratio": ours_tps / hf_tps,
        "identical": matches, "compile_s": compile_s, "max_logit_difference": logit_diff,
        "weight_bytes": weight_bytes, "bandwidth_gbs": [lo, hi],
        "ceiling_tokens_per_s": [ceil_lo, ceil_hi], "prompts": records})
    print(f"\nwrote {path}")
    return 0


if __name__ == "__main__":
    app.run(main)
