"""The one place a method name and its settings become a `Method`.

    method = build_method("lookahead", sampling=Sampling(0.7), W=7, N=5, G=7)
    method = build_method("loopahead", model_config=engine.config, lad="/path/to/lad_workdir")

The CLI (`--method=... --W=...`), `Engine.generate(method="...")`, the benchmarks and the
notebooks all build methods here, so a method always carries the sampling it was asked for
and a setting that does not apply to the method is refused, never ignored. Settings are named
as the command-line flags:

    ar             (none)
    lookahead      W, N, G, prompt_seeding, pool_slots, pool_keys, init_fill (over `lookahead`,
                   a base LookaheadConfig), attention, devices (> 1: lookahead parallelism),
                   verifier
    prompt_lookup  pl_tokens, pl_ngram, verifier
    loopspec       d1, d2, capacity, verifier
    loopahead      lad (a LadDrafter, a drafter file or a train_lad workdir), r1 (default: the
                   drafter's draft depth, else 1), r2 (default r1 + 1, 0 when that is not
                   below the model's loops), scheduling, max_active, lad_calls, suspend_below,
                   retain, node_cost, window, capacity, verifier

With `model_config` the method is also checked against the model (`Method.check`: a looped
method needs a looped model, depths below its loops; a drafter must fit the model).
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

from lookahead_jax.lookahead.config import LookaheadConfig
from lookahead_jax.lookahead.parallel import ParallelLookahead
from lookahead_jax.lookahead.step import Lookahead
from lookahead_jax.looped.drafter import LadDrafter
from lookahead_jax.looped.loopahead import LoopAhead
from lookahead_jax.looped.loopspec import LoopSpec
from lookahead_jax.method import Method
from lookahead_jax.plain import Plain
from lookahead_jax.prompt_lookup import PromptLookup
from lookahead_jax.sampling import Sampling
from models.config import ConfigError

METHODS = ("ar", "lookahead", "prompt_lookup", "loopspec", "loopahead")
LOOPED_METHODS = ("loopspec", "loopahead")  # looped models only
_LOOKAHEAD_FIELDS = tuple(f.name for f in dataclasses.fields(LookaheadConfig))
SETTINGS = {
    "ar": (),
    "lookahead": (*_LOOKAHEAD_FIELDS, "lookahead", "attention", "devices", "mesh", "verifier"),
    "prompt_lookup": ("pl_tokens", "pl_ngram", "verifier"),
    "loopspec": ("d1", "d2", "capacity", "verifier"),
    "loopahead": ("lad", "r1", "r2", "scheduling", "max_active", "lad_calls", "suspend_below",
                  "retain", "node_cost", "window", "capacity", "verifier"),
}


def check_settings(name: str, settings: dict[str, Any]) -> None:
    """Raises ConfigError for an unknown method or a setting (not None) it does not take."""
    if name not in SETTINGS:
        raise ConfigError(f"unknown method {name!r}: expected one of {', '.join(METHODS)}")
    for key, value in settings.items():
        if value is None or key in SETTINGS[name]:
            continue
        owners = [m for m, keys in SETTINGS.items() if key in keys]
        if not owners:
            raise ConfigError(f"unknown setting {key!r} for method {name!r}")
        raise ConfigError(f"setting {key} (--{key}) only applies to "
                          f"{' or '.join('--method=' + o for o in owners)}, not {name!r}")


def build_method(name: str, *, sampling: Sampling | None = None, model_config=None,
                 **settings: Any) -> Method:
    """A method name and its settings (None: the default) -> a Method carrying `sampling`."""
    # dense attention on one device is what every method does: not a lookahead-only setting
    check_settings(name, {k: v for k, v in settings.items()
                          if (k, v) not in (("attention", "dense"), ("devices", 1))})
    sampling = sampling or Sampling()
    given = {k: v for k, v in settings.items() if v is not None}
    if name == "ar":
        method = Plain(sampling)
    elif name == "lookahead":
        method = _lookahead(sampling, given)
    elif name == "prompt_lookup":
        method = PromptLookup(sampling, **_renamed(given, pl_tokens="num_tokens",
                                                   pl_ngram="max_ngram"))
    elif name == "loopspec":
        method = LoopSpec(sampling, **given)
    else:
        method = _loopahead(sampling, given, model_config)
    if model_config is not None:
        method.check(model_config)
    return method


def _renamed(settings: dict[str, Any], **names: str) -> dict[str, Any]:
    return {names.get(k, k): v for k, v in settings.items()}


def _lookahead(sampling: Sampling, given: dict[str, Any]) -> Method:
    base = given.pop("lookahead", None) or LookaheadConfig()
    fields = {k: given.pop(k) for k in list(given) if k in _LOOKAHEAD_FIELDS}
    config = dataclasses.replace(base, **fields)
    attention = given.pop("attention", "dense")
    devices = given.pop("devices", 1)
    mesh = given.pop("mesh", None)  # a (lookahead, model) mesh: its lookahead axis is `devices`
    if devices < 1:
        raise ConfigError(f"devices must be >= 1, got {devices}")
    if devices > 1:
        if attention != "dense":
            raise ConfigError("lookahead parallelism (devices > 1) uses dense attention only")
        if "verifier" in given:
            raise ConfigError("lookahead parallelism (devices > 1) has its own verifier")
        return ParallelLookahead(sampling, config=config, devices=devices, mesh=mesh)
    return Lookahead(sampling, config=config, attention=attention, **given)


def _loopahead(sampling: Sampling, given: dict[str, Any], model_config) -> Method:
    lad = given.pop("lad", None)
    # a path (drafter file or train_lad workdir) is loaded; a drafter object is used as given
    drafter = LadDrafter.load(lad, model_config) if isinstance(lad, (str, os.PathLike)) else lad
    depth = getattr(drafter, "draft_depth", None)
    r1 = given.pop("r1", depth or 1)
    if "r2" not in given:
        loops = getattr(model_config, "num_loops", None)
        given["r2"] = r1 + 1 if loops is None or r1 + 1 < loops else 0
    return LoopAhead(sampling, r1=r1, drafter=drafter, **given)
