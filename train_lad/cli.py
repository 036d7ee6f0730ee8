"""What train_lad's two commands over an already written drafter (`train_lad.calibrate`,
`train_lad.stamp`) share: their flags naming the drafter and its model, and the file a
`--lad` names."""

from __future__ import annotations

import os

from absl import flags

from lookahead_jax.looped.drafter import DRAFTER_FILE
from models.config import ConfigError

FLAGS = flags.FLAGS


def define_drafter_flags() -> bool:
    """Defines --config, --lad and --ckpt; False when they already are (then nothing is
    defined)."""
    if "lad" in FLAGS:
        return False
    flags.DEFINE_string("config", "tiny_ouro", "LAD config name (train_lad.config.CONFIGS).")
    flags.DEFINE_string("lad", None, "The drafter: a drafter file or train_lad workdir.")
    flags.DEFINE_string("ckpt", None, "Looped-model checkpoint overriding the config's.")
    return True


def drafter_file(lad: str | None) -> str:
    """The drafter file a --lad value names: the file itself, or a workdir's drafter file.
    Raises ConfigError when --lad was not given."""
    if not lad:
        raise ConfigError("--lad (a drafter file or train_lad workdir) is required")
    return os.path.join(lad, DRAFTER_FILE) if os.path.isdir(lad) else lad
