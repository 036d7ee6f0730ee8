"""Record in a drafter file the looped model it was trained on, for drafters written before
drafter files recorded it:

    python -m train_lad.stamp --config=tiny_ouro --lad=checkpoints/tiny_ouro_lad [--ckpt=DIR]

Decoding warns when a drafter's recorded model (`base_digest`, a `params_digest` of the model's
parameters) is not the decoding model (`drafter.check_drafter_model`); `train_lad.main` records
it in every drafter it writes. This command loads the config's looped model (or `--ckpt`),
and, when the drafter sits in its train_lad workdir, first checks that the workdir's training
record (`lad_config.json`'s `base.params_sha256`, the float32 digest of the model its teacher
data came from) names this model; a drafter trained on another model is refused. It rewrites
the drafter file's metadata only (its tensors, calibration included, are unchanged).
"""

from __future__ import annotations

import json
import os
import sys

import jax.numpy as jnp
from absl import app, flags

from lookahead_jax.looped.drafter import LadDrafter, params_digest, set_base_digest
from models.config import ConfigError
from train_lad import config as lad_config
from train_lad.cli import define_drafter_flags, drafter_file
from train_lad.data import load_base_model

FLAGS = flags.FLAGS


def define_flags() -> None:
    define_drafter_flags()


def stamp(cfg: lad_config.LadConfig, lad: str, ckpt: str | None = None, model=None) -> dict:
    """Records the looped model's `params_digest` in the drafter `lad` (file or workdir) after
    the checks of the module docstring. model: an already loaded looped model to use instead
    of the config's. -> {"drafter": path, "base_digest": digest, "record": what was checked}."""
    if model is None:
        model, _ = load_base_model(cfg, ckpt)
    LadDrafter.load(lad, model.config)  # readable, and fits the model's shape
    path = drafter_file(lad)
    record_file = os.path.join(os.path.dirname(os.path.abspath(path)), "lad_config.json")
    record = None
    if os.path.isfile(record_file):
        record = json.loads(open(record_file).read()).get("base", {}).get("params_sha256")
        here = None if record is None else params_digest(model, jnp.float32)
        if record is not None and record != here:
            raise ConfigError(f"{record_file}: the drafter's teacher data came from a model "
                              f"with float32 digest {record}, not this one ({here}): it was "
                              f"trained on another model")
    digest = params_digest(model)
    set_base_digest(path, digest)
    return {"drafter": path, "base_digest": digest,
            "record": "lad_config.json matches" if record else "no training record beside it"}


def main(argv) -> int:
    if len(argv) > 1:
        print(f"error: unexpected arguments {' '.join(argv[1:])!r}", file=sys.stderr)
        return 2
    try:
        drafter_file(FLAGS.lad)  # --lad given
        info = stamp(lad_config.get(FLAGS.config), FLAGS.lad, FLAGS.ckpt)
    except (ConfigError, ValueError) as e:
        print(f"error: {' '.join(str(e).split())}", file=sys.stderr)
        return 2
    print(json.dumps(info))
    return 0


if __name__ == "__main__":
    define_flags()
    app.run(main)
