"""A distilled looped model run more times per token: the block of an exported recursive model
(`train_looped.distill`), its output projections (attention `o_proj`, MLP `down_proj`) scaled by
old R / new R, exported as a model of its own that runs it new R times in the same place.

    # checkpoints/smol_loop_2x4: smol_loop_2x2's block, halved, run 4 times (no training)
    python -m train_looped.reloop --src=checkpoints/smol_loop_2x2 --num_loops=4 \\
        --out=checkpoints/smol_loop_2x4

Why it works: each loop adds the block's output projections to the residual stream, so new R
loops of the block with those projections times old R / new R add about what old R loops of the
original added, in smaller steps (distill's `--out_scale` rule, which starts a block of R loops
near one pass of the layers it copies). It is a construction, not training: nothing is fitted,
and the export's record says so. Scaling by a power of two (2 -> 4 loops: halving) is exact in
bfloat16, so the shipped block is exactly the source's block halved.

The export records the source's config.json entries "training" (under "reloop"'s "source") and
"base_model" (unchanged: the same prelude, replaced layers and coda), and the held-out table of
the new model at every depth on the corpus windows the source was evaluated on
(`distill.evaluate_block`), beside the source's own.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
import shutil
import sys
import time

from absl import app, flags, logging

FLAGS = flags.FLAGS


def source_config(src: pathlib.Path):
    """(config.json of the exported model at src, the DistillConfig that trained it)."""
    from train_looped.distill import DistillConfig  # noqa: PLC0415
    path = pathlib.Path(src) / "config.json"
    if not path.exists():
        raise FileNotFoundError(f"--src: no exported model at {src} (no config.json)")
    config = json.loads(path.read_text())
    trained = config.get("training", {})
    if trained.get("recipe") != "python -m train_looped.distill" or "base_model" not in config:
        raise ValueError(f"--src {src}: not a block exported by train_looped.distill (a recursive "
                         f"model shipped as its block over a base model)")
    fields = {f.name for f in dataclasses.fields(DistillConfig)}
    kw = {k: tuple(v) if isinstance(v, list) else v
          for k, v in trained["config"].items() if k in fields}
    return config, DistillConfig(**kw)


def reloop(src: pathlib.Path, num_loops: int, out: pathlib.Path, workdir: pathlib.Path) -> dict:
    """Writes the re-looped model to `out`; returns its record (also in config.json)."""
    import ml_dtypes  # noqa: PLC0415
    from flax import nnx  # noqa: PLC0415

    from lookahead_jax.store.checkpoint import load_model_and_tokenizer  # noqa: PLC0415
    from lookahead_jax.store.presets import load_preset  # noqa: PLC0415
    from models.looped_loader import save_hf_looped  # noqa: PLC0415
    from models.recursive import from_llama  # noqa: PLC0415
    from train_looped import distill  # noqa: PLC0415
    from train_looped.corpus import separator_id  # noqa: PLC0415

    if num_loops < 1:
        raise ValueError(f"--num_loops must be >= 1, got {num_loops}")
    config, cfg = source_config(src)
    start = time.perf_counter()
    teacher, tok, _ = load_model_and_tokenizer(load_preset(cfg.base))
    block = distill.init_block(teacher, cfg)
    nnx.update(block, distill.start_block(dataclasses.replace(cfg, init_from=str(src))))
    factor = cfg.num_loops / num_loops
    distill.scale_outputs(block, factor)
    graphdef, new = nnx.split(block, nnx.Param)
    new = distill.as_shipped(new)  # the shipped block is bfloat16: evaluate what is shipped
    held = distill.heldout_rows(distill.prepare_data(tok, "heldout", cfg, workdir / "data",
                                                     separator_id(tok)), cfg)
    layout = dataclasses.replace(cfg.layout, num_loops=num_loops)
    table = distill.evaluate_block(teacher, graphdef, layout, new, held)
    model = from_llama(teacher, distill.model_config(layout, teacher.config))
    nnx.update(model.core_block, new)
    record = {
        "recipe": "python -m train_looped.reloop",
        "argv": {"src": str(src), "num_loops": num_loops},
        "output_projection_scale": factor,
        "source_num_loops": cfg.num_loops,
        "heldout": table,
        "seconds": round(time.perf_counter() - start, 1),
        "source": config["training"],
    }
    if out.exists():
        shutil.rmtree(out)
    save_hf_looped(model, out, base_model=config["base_model"], dtype=ml_dtypes.bfloat16,
                   extra={"torch_dtype": "bfloat16", "training": record})
    return record


def define_flags() -> None:
    if "src" in FLAGS:
        return
    flags.DEFINE_string("src", None, "An exported recursive model (train_looped.distill).")
    flags.DEFINE_integer("num_loops", None, "Loops per token of the new model.")
    flags.DEFINE_string("out", None, "Export directory.")
    flags.DEFINE_string("workdir", None, "Held-out token cache (default "
                        "$LOOKAHEAD_JAX_CACHE/distill/reloop).")
    flags.mark_flags_as_required(["src", "num_loops", "out"])


def main(argv) -> int:
    del argv
    logging.set_verbosity(logging.WARNING)
    from lookahead_jax.store.model_store import default_cache_dir  # noqa: PLC0415
    workdir = pathlib.Path(FLAGS.workdir or default_cache_dir() / "distill" / "reloop")
    record = reloop(pathlib.Path(FLAGS.src), FLAGS.num_loops, pathlib.Path(FLAGS.out), workdir)
    held = record["heldout"]
    src_held = record["source"].get("heldout", {})
    print(f"exported {FLAGS.out}: {FLAGS.num_loops} loops, output projections x "
          f"{record['output_projection_scale']:g} ({record['seconds']:.0f} s)", file=sys.stderr)
    print("held-out loss by depth: " + " / ".join(f"{x:.3f}" for x in held["heldout_loop_ce"])
          + " (source: " + " / ".join(f"{x:.3f}" for x in src_held.get("heldout_loop_ce", []))
          + f"; teacher {held['teacher_ce']:.3f})", file=sys.stderr)
    print("top-1 agreement with the teacher: "
          + " / ".join(f"{x:.1%}" for x in held["agree_teacher"]), file=sys.stderr)
    return 0


def run() -> None:
    define_flags()
    app.run(main)


if __name__ == "__main__":
    run()
