"""Train a lookahead drafter (LAD) for a frozen looped model:

    python -m train_lad.main --config=tiny_ouro [--workdir=...] [--steps=...] [--ckpt=...]
                             [--arch=queries|heads] [--anchor=table|model]
                             [--export_dtype=float32|float16] [--backbone=<drafter>]

Steps: load the looped model named by the config (refused, with the field named, when its
shape differs from the config's), build the data once (`train_lad.data`: prompts, the model's
full-depth greedy continuations, early-loop states; cached in the workdir as `data.npz`), pick
the draft vocabulary, then train (`train_lad.train`) with a progress bar, `metrics.jsonl` and
Orbax checkpoints, then calibrate the drafter for sampling on the development split
(`train_lad.calibrate`). Running the same command again resumes from the last checkpoint. Output in
the workdir: `drafter.safetensors` (the drafter chosen on the development split, written when
training ends: the file decoding loads, `--method=loopahead --lad=<workdir>`,
`lookahead_jax.looped.drafter.load_drafter_file`), `summary.json`, `lad_config.json` (the run's
settings), and for resuming `best/`, `latest/` (Orbax) and `data.npz` (the teacher data and
the draft vocabulary). `--export_dtype=float16` stores the drafter's parameters in half the
bytes (the shipped drafters in `checkpoints/`); a finished workdir run again with it rewrites
`drafter.safetensors` and `summary.json` without training.

Raven's residual head: `--config=tiny_raven_r4` trains only a residual head on loop 4's
states over the frozen shipped depth-2 drafter (`checkpoints/tiny_raven_lad`; `--backbone`
names another), and the drafter it writes drafts at depth 4 (`train_lad.train`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import pathlib
import sys

import jax.numpy as jnp
import numpy as np
from absl import app, flags, logging

from lookahead_jax.store.model_store import default_cache_dir
from models.config import ConfigError
from train_lad import config as lad_config
from train_lad import data as lad_data
from train_lad.data import load_base_model, split_prompts
from lookahead_jax.looped.drafter import DRAFTER_FILE, params_digest
from train_lad.train import check_workdir, train

FLAGS = flags.FLAGS


def define_flags() -> None:
    if "config" in FLAGS:
        return
    flags.DEFINE_string("config", "tiny_ouro", "LAD config name (train_lad.config.CONFIGS).")
    flags.DEFINE_string("workdir", None, "Checkpoints, data and logs (default "
                        "$LOOKAHEAD_JAX_CACHE/train_lad/<config>).")
    flags.DEFINE_string("ckpt", None, "Looped-model checkpoint overriding the config's.")
    flags.DEFINE_integer("steps", None, "Optimizer steps (overrides the config).")
    flags.DEFINE_enum("arch", None, ["queries", "heads"], "The drafter's arch, overriding the "
                      "config's: queries (the paper's K future query positions) or heads (K "
                      "linear heads on the last position, the ablation).")
    flags.DEFINE_enum("export_dtype", "float32", ["float32", "float16"], "The dtype of the "
                      "drafter file's parameters (float16: half the file)")
    flags.DEFINE_enum("anchor", None, ["table", "model"], "The drafter's anchor embedding, "
                      "overriding the config's: table (a trained row per token) or model (the "
                      "looped model's output embedding, projected).")
    flags.DEFINE_string("backbone", None, "For a residual-head config: the frozen drafter "
                        "(file or train_lad workdir) overriding the config's.")


def base_fingerprint(model) -> dict:
    """The frozen model's identity: its config fields and a digest of its parameters (in
    float32: the exact model the teacher data were made with)."""
    cfg = model.config
    fields = {f: getattr(cfg, f) for f in ("family", "hidden_size", "vocab_size", "num_loops")}
    return {**fields, "params_sha256": params_digest(model, jnp.float32)}


def build_data(cfg: lad_config.LadConfig, model, tokenizer, workdir: pathlib.Path,
               fingerprint: dict, log=print) -> tuple[dict, np.ndarray]:
    """(split -> arrays, draft vocabulary), from `data.npz` when it was made by this model."""
    path = workdir / "data.npz"
    if path.exists():
        z = np.load(path, allow_pickle=False)
        if json.loads(str(z["fingerprint"])) == fingerprint:
            data = {s: {k: z[f"{s}_{k}"] for k in ("tokens", "states", "native")}
                    for s in lad_data.SPLITS}
            return data, z["draft_vocab"]
        log(f"{path}: made by another model; rebuilding")
    prompts = split_prompts(cfg, tokenizer)
    data = {}
    for s in lad_data.SPLITS:
        log(f"teacher data: {s} ({len(prompts[s])} prompts)")
        if prompts[s]:
            data[s] = lad_data.teacher_data(model, prompts[s], continuation=cfg.continuation,
                                            draft_depth=cfg.draft_depth)
        else:
            t, e = cfg.seq_len, cfg.model_hidden
            data[s] = {"tokens": np.zeros((0, t), np.int32),
                       "states": np.zeros((0, t, e), np.float16),
                       "native": np.zeros((0, t), np.int32)}
    vocab = lad_data.draft_vocabulary(data["train"]["tokens"], cfg.prompt_len, cfg.draft_vocab,
                                      cfg.model_vocab, model.config.eos_token_ids)
    np.savez(path, fingerprint=json.dumps(fingerprint), draft_vocab=vocab,
             **{f"{s}_{k}": v for s, d in data.items() for k, v in d.items()})
    return data, vocab


# the settings a workdir's checkpoints and data depend on: another value needs a fresh workdir
DRAFTER_SETTINGS = ("arch", "head", "anchor", "residual", "backbone_sha256", "K", "hidden_size",
                    "num_layers", "num_heads",
                    "draft_vocab", "draft_depth", "prompt_len", "continuation", "num_train",
                    "num_dev", "num_confirm", "prompt_source", "seed")


def check_drafter_settings(cfg: lad_config.LadConfig, workdir: pathlib.Path) -> None:
    """Refuses a workdir whose run (its `lad_config.json`) had other drafter or data settings
    than cfg's: its checkpoints would not fit this drafter, or its data this run."""
    path = workdir / "lad_config.json"
    if not path.exists():
        return
    before = {"arch": "heads", "anchor": "table", "residual": 0,  # runs before these settings
              "backbone_sha256": None, **json.loads(path.read_text())}
    mine = {**dataclasses.asdict(cfg), "backbone_sha256": backbone_digest(cfg)}
    for field in DRAFTER_SETTINGS:
        if field in before and before[field] != mine[field]:
            raise ConfigError(f"{workdir}: its run had {field} = {before[field]!r}, this one "
                              f"{mine[field]!r}; use a fresh workdir")


def backbone_file(cfg: lad_config.LadConfig) -> pathlib.Path | None:
    """The residual head's backbone drafter file (a relative path is the repository's), or
    None without a residual head."""
    if not cfg.backbone:
        return None
    path = pathlib.Path(cfg.backbone)
    if not path.is_absolute() and not path.exists():
        path = pathlib.Path(__file__).resolve().parent.parent / path
    if path.is_dir():
        path = path / DRAFTER_FILE
    if not path.is_file():
        raise ConfigError(f"lad config {cfg.name}: backbone drafter {cfg.backbone} not found "
                          f"(train it first, or pass --backbone)")
    return path


def backbone_digest(cfg: lad_config.LadConfig) -> str | None:
    """A digest of the backbone drafter's network and vocabulary (its calibration, which
    training does not use, left out)."""
    path = backbone_file(cfg)
    if path is None:
        return None
    from safetensors import safe_open  # noqa: PLC0415

    from lookahead_jax.looped.drafter import CAL_TEMPS_TENSOR, CAL_TENSOR  # noqa: PLC0415
    h = hashlib.sha256()
    with safe_open(str(path), "numpy") as f:
        for name in sorted(set(f.keys()) - {CAL_TENSOR, CAL_TEMPS_TENSOR}):
            h.update(name.encode())
            h.update(np.ascontiguousarray(f.get_tensor(name)).tobytes())
    return h.hexdigest()[:16]


def run(cfg: lad_config.LadConfig, workdir, *, ckpt: str | None = None, log=print,
        progress_bar: bool = True, model=None, tokenizer=None,
        max_steps_now: int | None = None, export_dtype: str | None = None) -> dict:
    """The whole job (see the module docstring). model: an already loaded looped model to
    use instead of the config's (checked against the config the same way)."""
    workdir = pathlib.Path(workdir)
    if model is None:
        model, tokenizer = load_base_model(cfg, ckpt)
    lad_config.check_base_model(cfg, model.config, "the given model")
    workdir.mkdir(parents=True, exist_ok=True)
    fingerprint = base_fingerprint(model)
    check_workdir(workdir, fingerprint)  # before the data are rebuilt for another model
    check_drafter_settings(cfg, workdir)
    data, vocab = build_data(cfg, model, tokenizer, workdir, fingerprint, log)
    backbone = None
    if cfg.residual:
        from lookahead_jax.looped.drafter import load_drafter_file  # noqa: PLC0415
        backbone = load_drafter_file(backbone_file(cfg), model.config)
    (workdir / "lad_config.json").write_text(json.dumps(
        {**dataclasses.asdict(cfg), "backbone_sha256": backbone_digest(cfg),
         "base": fingerprint}, indent=1) + "\n")
    out_embedding = None
    if cfg.head == "model" or cfg.anchor == "model":
        from lookahead_jax.looped.drafter import output_embedding  # noqa: PLC0415
        out_embedding = np.asarray(output_embedding(model), np.float32)
    summary = train(cfg, data, vocab, workdir, base_fingerprint=fingerprint,
                    base_digest=params_digest(model), log=log,
                    progress_bar=progress_bar, max_steps_now=max_steps_now,
                    out_embedding=out_embedding, export_dtype=export_dtype,
                    backbone=backbone)
    drafter_file = workdir / DRAFTER_FILE
    if drafter_file.exists() and len(data["dev"]["tokens"]):  # calibrated for sampling
        from lookahead_jax.looped.drafter import LadDrafter, add_calibration  # noqa: PLC0415
        from train_lad.calibrate import calibrate_drafter  # noqa: PLC0415
        cal, summary["calibration"] = calibrate_drafter(
            cfg, model, LadDrafter.load(drafter_file, model.config), data["dev"])
        add_calibration(drafter_file, cal)
        (workdir / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    log(json.dumps(summary))
    return summary


def main(argv) -> int:
    if len(argv) > 1:
        print(f"error: unexpected arguments {' '.join(argv[1:])!r}", file=sys.stderr)
        return 2
    try:
        cfg = lad_config.get(FLAGS.config)
        if FLAGS.steps is not None:
            cfg = dataclasses.replace(cfg, steps=FLAGS.steps)
        if FLAGS.arch is not None:
            cfg = dataclasses.replace(cfg, arch=FLAGS.arch)
        if FLAGS.anchor is not None:
            cfg = dataclasses.replace(cfg, anchor=FLAGS.anchor)
        if FLAGS.backbone is not None:
            if not cfg.residual:
                raise ConfigError(f"--backbone: lad config {cfg.name} has no residual head")
            cfg = dataclasses.replace(cfg, backbone=FLAGS.backbone)
        workdir = FLAGS.workdir or os.path.join(default_cache_dir(), "train_lad", cfg.name)
        run(cfg, workdir, ckpt=FLAGS.ckpt, log=lambda m: print(m, file=sys.stderr),
            export_dtype=FLAGS.export_dtype)
    except ConfigError as e:
        print(f"error: {' '.join(str(e).split())}", file=sys.stderr)
        return 2
    return 0


def parse_flags(argv):
    rest = FLAGS(list(argv))
    if FLAGS["verbosity"].using_default_value:  # Orbax logs every save at INFO
        FLAGS.verbosity = logging.WARNING
    return rest


def cli() -> None:
    define_flags()
    app.run(main, flags_parser=parse_flags)


if __name__ == "__main__":
    cli()
