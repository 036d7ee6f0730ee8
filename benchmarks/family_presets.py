"""The lookahead settings of the model-family presets (#23), chosen for an accelerator by the
scaling law and the roofline model.

    python -m benchmarks.family_presets [--device 'A100 80GB SXM'] [--out benchmarks/results]

For each family preset, the step-cost curve of its model's shape is predicted for --device (the
compiled program's FLOPs and bytes on the roofline, `lookahead_jax.tuning.auto.
predicted_step_costs`) and the (W, N, G = W) grid is ranked by the scaling law's S over that
cost (`choose_for_model`, what `--auto --auto_device=...` does for a loaded model). The attention
is counted as the Pallas kernel's where it runs every layer, else dense: the kernel declines
soft-capped and sliding-window layers (Gemma 2 and 3, Phi-3), which run the dense attention.

The default device is the paper's (A100 80GB SXM; the presets' comments name it). The
70B preset runs on 8 devices (tensor parallelism): its curve here is one device's whole-model
roofline, which puts the same weight on every token count; the collectives a tensor-parallel step
adds per layer are small for token ids and activations (#13's mesh benchmark).

Writes family_presets.json into --out and prints a Markdown table.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

from benchmarks import common
from lookahead_jax.store.presets import load_preset
from lookahead_jax.tuning.auto import choose_for_model
from models.llama import layer_rules
from pallas_kernels.lookahead_attention import PallasAttention

PRESETS = ("llama3_8b", "llama3_70b", "qwen2p5_7b", "qwen3_8b", "gemma2_9b", "gemma3_12b",
           "mistral_7b", "phi3_mini")
DEVICE = "A100 80GB SXM"
PROMPT_LEN, MAX_NEW = 64, 128  # the curve at cache length 128, the middle of such a generation


def kernel_runs_every_layer(cfg) -> bool:
    """Whether the Pallas kernel runs all of the model's layers (it declines soft-capped and
    sliding-window ones)."""
    return not any(PallasAttention.declines(layer_rules(cfg, i, None))
                   for i in range(cfg.num_layers))


def choose(name: str, device: str) -> dict:
    cfg = load_preset(name).model
    kernel = kernel_runs_every_layer(cfg)
    t0 = time.perf_counter()
    choice = choose_for_model(cfg, prompt_len=PROMPT_LEN, max_new_tokens=MAX_NEW, device=device,
                              kernel=kernel)
    best = choice.candidates[0]
    return {"preset": name, "family": cfg.family, "layers": cfg.num_layers,
            "attention": "kernel" if kernel else "dense", "W": best.W, "N": best.N, "G": best.G,
            "tokens": best.tokens, "S": best.S, "cost": best.cost, "speedup": best.speedup,
            "method": choice.method,
            "step_cost_s": {str(k): v for k, v in choice.step_costs.items()},
            "cache_len": choice.cache_len, "fit": choice.fit.source,
            "seconds": round(time.perf_counter() - t0, 1)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default=DEVICE)
    ap.add_argument("--presets", default=",".join(PRESETS))
    ap.add_argument("--out", default=os.path.join(common.REPO, "benchmarks", "results"))
    args = ap.parse_args(argv)
    rows = []
    for name in args.presets.split(","):
        rows.append(choose(name, args.device))
        r = rows[-1]
        print(f"{name}: W={r['W']} N={r['N']} G={r['G']} predicted {r['speedup']:.2f}x "
              f"({r['seconds']} s)", file=sys.stderr, flush=True)
    table = common.markdown_table(
        ["preset", "family", "layers", "attention", "W, N, G", "tokens/step", "S (law)",
         "step / plain step", "predicted speed-up", "method"],
        [[r["preset"], r["family"], r["layers"], r["attention"], f"{r['W']}, {r['N']}, {r['G']}",
          r["tokens"], f"{r['S']:.2f}", f"{r['cost']:.3f}", f"{r['speedup']:.2f}x", r["method"]]
         for r in rows])
    print(f"Lookahead settings for {args.device} (cache {rows[0]['cache_len']}, "
          f"fit: {rows[0]['fit']})\n\n{table}")
    os.makedirs(args.out, exist_ok=True)
    common.write_json(os.path.join(args.out, "family_presets.json"),
                      {"device": args.device, "machine": common.machine_info(), "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
