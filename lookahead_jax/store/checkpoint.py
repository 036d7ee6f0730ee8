"""Loading a preset's model and tokenizer: the embedded default, random weights, a GGUF file or
a Hugging Face directory (Llama family or looped), checked against the preset's shape.

    model, tokenizer, source = load_model_and_tokenizer(load_preset("smollm2_135m"))
"""

from __future__ import annotations

import os

import jax.numpy as jnp
from flax import nnx

from lookahead_jax.store.model_store import smollm2_gguf
from lookahead_jax.store.presets import EMBEDDED, RANDOM, SHAPE_FIELDS, Preset
from lookahead_jax.store.tokenizer import load_tokenizer
from models.config import ConfigError, LlamaConfig, LoopedConfig
from models.gguf_loader import load_gguf_config, load_gguf_llama
from models.hf_loader import load_hf_config, load_hf_llama
from models.llama import Llama
from models.build import build_looped
from models.looped_loader import (base_model_of, is_looped_checkpoint, load_hf_looped,
                                  load_looped_config)

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}


def resolve_dtype(dtype: str | None, preset: Preset | None = None):
    """"float32" | "bfloat16" (None: the preset's default) -> a jnp dtype."""
    name = dtype if dtype is not None else (preset.dtype if preset else "float32")
    if name not in DTYPES:
        raise ConfigError(f"dtype must be one of {', '.join(DTYPES)}, got {name!r}")
    return DTYPES[name]


def check_model_matches(preset: Preset, found: LlamaConfig | LoopedConfig, source: str) -> None:
    """Raises ConfigError naming the first shape field where `found` differs from the preset
    (a config class's own `SHAPE_FIELDS` where it has them, e.g. LoopedConfig)."""
    if preset.model is None:
        return
    if type(found) is not type(preset.model):
        kind = lambda c: getattr(c, "family", "llama")  # noqa: E731
        raise ConfigError(
            f"checkpoint {source} does not match preset {preset.name}: it is a {kind(found)} "
            f"model, the preset expects {kind(preset.model)} (pick the --config that matches "
            f"these weights)")
    for field in getattr(type(preset.model), "SHAPE_FIELDS", SHAPE_FIELDS):
        want, got = getattr(preset.model, field), getattr(found, field)
        if want != got:
            raise ConfigError(
                f"checkpoint {source} does not match preset {preset.name}: {field} is {got} in "
                f"the checkpoint, {want} in the preset (pick the --config that matches these "
                f"weights)")


def _missing_weights(preset: Preset) -> ConfigError:
    hint = preset.weights_hint or "model"
    return ConfigError(
        f"preset {preset.name} needs weights: pass --ckpt=/path/to/{hint} (a Hugging Face "
        f"directory with config.json and *.safetensors)")


def base_weights(source: str | os.PathLike) -> str | None:
    """The base Llama's weights of a looped checkpoint that ships only its block (its
    config.json's `base_model` names the model store's entry, "smollm2": the embedded GGUF,
    fetched if missing), or None for a whole checkpoint."""
    entry = base_model_of(source)
    if entry is None:
        return None
    if entry.get("store") == "smollm2":
        return os.fspath(smollm2_gguf())
    raise ConfigError(f"checkpoint {source}: its base model {entry.get('name', '?')!r} is not "
                      f"one the model store provides")


def has_tokenizer_files(directory: str | os.PathLike) -> bool:
    """Whether a checkpoint directory ships its own tokenizer (tokenizer.json, or a
    sentencepiece tokenizer.model)."""
    return any(os.path.isfile(os.path.join(directory, name))
               for name in ("tokenizer.json", "tokenizer.model"))


def load_model_and_tokenizer(preset: Preset, ckpt: str | os.PathLike | None = None,
                             dtype: str | None = None, mesh=None):
    """Loads the preset's weights (or `ckpt`) -> (model, tokenizer or None, source description).

    mesh: a Hugging Face checkpoint is read straight into parameters sharded for tensor
    parallelism on that mesh, each process reading only its devices' slices (other sources
    load whole and the engine shards them).

    The model is a `Llama`, or a `LoopedLM` when the preset's model is a LoopedConfig or the
    checkpoint directory's config.json names a looped model (Ouro, Huginn/Raven). A looped
    checkpoint that ships only its block over a base model (`base_weights`) and no tokenizer
    files takes the base model's tokenizer (SmolLM2's, from its GGUF)."""
    jdtype = resolve_dtype(dtype, preset)
    source = os.fspath(ckpt) if ckpt is not None else preset.checkpoint
    if source is None:
        raise _missing_weights(preset)
    if source == RANDOM:
        if preset.model is None:
            raise ConfigError(f"preset {preset.name}: random weights need a model config")
        if isinstance(preset.model, LoopedConfig):
            return build_looped(preset.model, dtype=jdtype, rngs=nnx.Rngs(0)), None, "random weights"
        return Llama(preset.model, dtype=jdtype, rngs=nnx.Rngs(0)), None, "random weights"
    if source == EMBEDDED:
        source = os.fspath(smollm2_gguf())
    looped = isinstance(preset.model, LoopedConfig)
    tokenizer_source = source
    if os.path.isdir(source):
        if looped or is_looped_checkpoint(source):
            check_model_matches(preset, load_looped_config(source), source)
            base = base_weights(source)
            model = load_hf_looped(source, dtype=jdtype, mesh=mesh, base=base)
            if base is not None and not has_tokenizer_files(source):
                tokenizer_source = base  # a block over the base model: the base's tokenizer
        else:
            check_model_matches(preset, load_hf_config(source), source)
            model = load_hf_llama(source, dtype=jdtype, mesh=mesh)
    elif os.path.isfile(source):
        if looped:
            raise ConfigError(f"checkpoint {source}: preset {preset.name} is a looped model; "
                              f"pass a Hugging Face directory (config.json + *.safetensors)")
        if not source.lower().endswith(".gguf"):
            raise ConfigError(
                f"checkpoint {source} is a file but not a .gguf: pass a .gguf file or a Hugging "
                f"Face directory with config.json and *.safetensors")
        check_model_matches(preset, load_gguf_config(source), source)
        model = load_gguf_llama(source, dtype=jdtype)
    elif os.path.exists(source):
        raise ConfigError(f"checkpoint {source} is neither a directory nor a file")
    else:
        raise ConfigError(f"checkpoint {source} does not exist")
    return model, load_tokenizer(tokenizer_source), source
