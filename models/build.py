"""Building a looped model from its config: `build_looped(cfg)` picks the family's class.

Its own module, so `models.looped` (the base class) never imports the families that
subclass it.
"""

from __future__ import annotations

import jax.numpy as jnp
from flax import nnx

from models.config import ConfigError, LoopedConfig
from models.looped import LoopedLM
from models.ouro import OuroLM
from models.raven import RavenLM
from models.recursive import RecursiveLM

LOOPED_CLASSES: dict[str, type[LoopedLM]] = {cls.family: cls
                                             for cls in (OuroLM, RavenLM, RecursiveLM)}


def build_looped(cfg: LoopedConfig, *, dtype=jnp.float32, rngs: nnx.Rngs) -> LoopedLM:
    """The looped model of `cfg.family` (an `OuroLM`, `RavenLM` or `RecursiveLM`), parameters
    of `dtype` drawn from `rngs`."""
    try:
        cls = LOOPED_CLASSES[cfg.family]
    except KeyError:
        raise ConfigError(f"model config: no looped model family {cfg.family!r} "
                          f"(one of {sorted(LOOPED_CLASSES)})") from None
    return cls(cfg, dtype=dtype, rngs=rngs)
