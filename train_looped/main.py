"""Train a tiny looped model and export it (the defaults reproduce the shipped checkpoints):

    python -m train_looped.main --model=tiny_ouro --out=checkpoints/tiny_ouro

Builds what is missing first (the corpus, the BPE and the token arrays, `train_looped.tokenizer`),
trains with a progress bar (per-loop loss), saving an Orbax checkpoint to --workdir every few
minutes and on Ctrl-C; running the same command again resumes from the latest one. At the end
the parameters, config and tokenizer are exported to --out (`train_looped.export`).
--steps=0 --minutes=M chooses the step count from a wall-clock budget after timing the first
steps (and stores it in the checkpoint, so a resumed run keeps the schedule). A --steps larger
than the checkpoint's step count extends the run, a finished one too, on the longer run's
schedule (`train.planned_total`): resume a --steps=0 run with --steps=0, not the model's default.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import pathlib
import sys

from absl import app, flags, logging

from lookahead_jax.store.model_store import default_cache_dir

FLAGS = flags.FLAGS


def define_flags() -> None:
    if "model" in FLAGS:
        return
    flags.DEFINE_string("model", "tiny_ouro", "Model name in train_looped.configs.MODELS.")
    flags.DEFINE_string("out", None, "Export directory (default checkpoints/<model>).")
    flags.DEFINE_string("workdir", None, "Orbax checkpoints and metrics.jsonl (default "
                        "$LOOKAHEAD_JAX_CACHE/train_looped/<model>).")
    flags.DEFINE_integer("steps", None, "Total optimizer steps (default: the model's; 0: from "
                         "--minutes; more than a workdir recorded: extends its run).")
    flags.DEFINE_float("minutes", None, "Wall-clock budget used to choose --steps=0.")
    flags.DEFINE_integer("batch_size", None, "Sequences per step (default: the model's).")
    flags.DEFINE_integer("seq_len", None, "Tokens per sequence (default: the model's).")
    flags.DEFINE_enum("loss", None, ["uniform", "ouro"], "Per-loop loss (default: the model's).")
    flags.DEFINE_float("peak_lr", None, "Peak learning rate (default: the model's).")
    flags.DEFINE_float("consistency_weight", None, "Weight of the loop-consistency KL term "
                       "(default: the model's).")
    flags.DEFINE_enum("consistency_target", None, ["last", "next"], "KL(full depth || loop r) "
                      "with a fixed teacher, or KL(loop r+1 || loop r) (default: the model's).")
    flags.DEFINE_float("branch_norm_init", None, "Ouro: initial weight of the residual-branch "
                       "norms (LayerScale; default: the model's).")
    flags.DEFINE_integer("seed", None, "Data order seed (default: the model's).")
    flags.DEFINE_integer("init_seed", 0, "Parameter initialisation seed.")
    flags.DEFINE_integer("max_steps_this_run", None, "Stop after this many steps (resumable).")
    flags.DEFINE_enum("export_dtype", "bfloat16", ["bfloat16", "float32"],
                      "dtype of the exported weights.")
    flags.DEFINE_bool("progress", True, "Show a progress bar.")


def train_config(base):
    overrides = {k: getattr(FLAGS, k) for k in ("steps", "minutes", "batch_size", "seq_len",
                                                 "loss", "peak_lr", "seed",
                                                 "consistency_weight", "consistency_target",
                                                 "branch_norm_init")
                 if getattr(FLAGS, k) is not None}
    return dataclasses.replace(base, **overrides)


def eval_batch(data_dir: pathlib.Path, seq_len: int, per_source: int = 2):
    """A fixed held-out batch: `per_source` evenly spaced windows from each held-out source."""
    import numpy as np  # noqa: PLC0415
    rows = []
    for f in sorted(data_dir.glob("heldout_*.npy")):
        toks = np.load(f)
        if toks.size <= seq_len + 1:
            continue
        for i in range(per_source):
            start = (toks.size - seq_len - 1) * i // per_source
            rows.append(toks[start:start + seq_len + 1].astype(np.int32))
    return np.stack(rows)


def _sha256(path: pathlib.Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def main(argv) -> int:
    del argv
    logging.set_verbosity(logging.WARNING)  # Orbax logs every checkpoint step at INFO
    import jax  # noqa: PLC0415
    import numpy as np  # noqa: PLC0415
    from flax import nnx  # noqa: PLC0415

    from models.build import build_looped  # noqa: PLC0415
    from train_looped import configs, export, train, tokenizer  # noqa: PLC0415

    spec = configs.get(FLAGS.model)
    cfg = train_config(spec.train)
    out = pathlib.Path(FLAGS.out or f"checkpoints/{spec.name}")
    workdir = pathlib.Path(FLAGS.workdir or default_cache_dir() / "train_looped" / spec.name)
    data = tokenizer.prepare(spec.model.vocab_size)
    train_tokens = np.load(data / "train.npy")
    model = build_looped(spec.model, rngs=nnx.Rngs(FLAGS.init_seed))
    if cfg.branch_norm_init != 1.0:
        train.init_branch_norms(model, cfg.branch_norm_init)
    n_params = sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
    print(f"{spec.name}: {spec.description}; {n_params:,} parameters; {train_tokens.size:,} "
          f"training tokens; workdir {workdir}", file=sys.stderr)
    workdir.mkdir(parents=True, exist_ok=True)
    (workdir / "run.json").write_text(json.dumps(
        {"model": spec.name, "train": dataclasses.asdict(cfg), "argv": sys.argv}, indent=1))
    state = train.train(model, cfg, train_tokens, workdir,
                        eval_batch=eval_batch(data, cfg.seq_len), progress=FLAGS.progress,
                        max_steps_this_run=FLAGS.max_steps_this_run)
    if state.step < state.total_steps:
        print(f"stopped at step {state.step} of {state.total_steps}; run the same command "
              f"again to resume", file=sys.stderr)
        return 0
    manifest = json.loads((data.parent / "manifest.json").read_text())
    training = {
        "model": spec.name, "train_config": dataclasses.asdict(cfg), "steps": state.step,
        "tokens_seen": state.tokens_seen, "train_seconds": round(state.elapsed_s, 1),
        "init_seed": FLAGS.init_seed,
        "corpus_sha256": {"train": manifest["train"]["sha256"],
                          "heldout": manifest["heldout"]["sha256"]},
        "tokenizer_sha256": _sha256(data / "tokenizer.json"),
    }
    export.save(out, spec.model, state.params, tokenizer_dir=data, training=training,
                dtype=FLAGS.export_dtype, metrics_file=workdir / "metrics.jsonl")
    print(f"exported {out} ({sum(f.stat().st_size for f in out.iterdir()) / 1e6:.1f} MB) after "
          f"{state.step} steps, {state.tokens_seen:,} tokens, {state.elapsed_s / 60:.1f} min",
          file=sys.stderr)
    return 0


def run() -> None:
    define_flags()
    app.run(main)


if __name__ == "__main__":
    run()
