"""Presets: a named model shape, its recommended lookahead settings and where its weights come from.

Each preset is a Python file `configs/<name>.py` whose `get_config()` returns a `Preset`:

    preset = load_preset("llama7b")
    engine = load_engine("llama7b", ckpt="/models/Llama-2-7b-chat-hf", dtype="bfloat16")

Checkpoint sources (`Preset.checkpoint`, overridden by `ckpt=`):
  "smollm2"  the embedded default model: SmolLM2-135M-Instruct GGUF, fetched by `model_store`
  "random"   random weights (`nnx.Rngs(0)`) of the preset's model shape and no tokenizer: for
             tests and smoke runs only (generate with token ids)
  a path     a `.gguf` file (GGUF loader) or a Hugging Face directory with config.json and
             *.safetensors (HF loader); the tokenizer is read from the same place
             (`shipped_checkpoint(name)`: a directory under the repository's checkpoints/, e.g.
             the tiny looped models trained here)
  None       the preset ships no weights: the caller must pass `ckpt`
"""

from __future__ import annotations

import dataclasses
import importlib
import os
import pkgutil

import jax.numpy as jnp

from lookahead_jax.config import LookaheadConfig
from models.config import ConfigError, LlamaConfig
from models.looped import LoopedConfig

EMBEDDED = "smollm2"
RANDOM = "random"
DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}

# Fields that fix a checkpoint's tensor shapes or meaning; a checkpoint loaded under a preset
# with a model config must agree on all of them (eos/bos ids and max positions come from the
# checkpoint itself).
SHAPE_FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                "num_kv_heads", "head_dim", "rope_theta", "tie_word_embeddings")


@dataclasses.dataclass(frozen=True)
class Preset:
    """A named configuration for `decode` and `Engine.from_preset`.

    model: the expected model shape (a LlamaConfig, or a LoopedConfig for a looped model),
        or None to take it from the checkpoint.
    lookahead: recommended lookahead settings (None: plain decoding is the default method).
    checkpoint: "smollm2" | "random" | a path | None (the user must pass --ckpt).
    chat: wrap prompts in the tokenizer's chat template by default.
    dtype: default parameter dtype, "float32" or "bfloat16".
    weights_hint: the directory name to suggest when weights are missing (e.g. Llama-2-7b-chat-hf).
    parallel: lookahead parallelism over all local devices by default (`--devices`).
    """

    name: str
    description: str
    model: LlamaConfig | LoopedConfig | None
    lookahead: LookaheadConfig | None
    checkpoint: str | None
    chat: bool
    dtype: str = "float32"
    weights_hint: str | None = None
    parallel: bool = False

    def __post_init__(self):
        if self.dtype not in DTYPES:
            raise ConfigError(f"preset {self.name}: dtype must be one of {sorted(DTYPES)}, "
                              f"got {self.dtype!r}")
        if self.checkpoint == RANDOM and self.model is None:
            raise ConfigError(f"preset {self.name}: checkpoint 'random' needs a model config")


def shipped_checkpoint(name: str) -> str:
    """The path of `checkpoints/<name>`, a small checkpoint shipped in this repository."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    return os.path.join(root, "checkpoints", name)


def _configs_dir() -> str:
    import configs  # noqa: PLC0415
    return os.path.dirname(os.path.abspath(configs.__file__))


def available_presets() -> list[str]:
    """Names of the preset files in the `configs` package."""
    return sorted(m.name for m in pkgutil.iter_modules([_configs_dir()])
                  if not m.name.startswith("_"))


def load_preset(name: str) -> Preset:
    """Imports `configs.<name>` and returns its `get_config()`. Unknown names raise ConfigError."""
    names = available_presets()
    if name not in names:
        raise ConfigError(f"unknown preset {name!r}: available presets are {', '.join(names)}")
    module = importlib.import_module(f"configs.{name}")
    preset = module.get_config()
    if not isinstance(preset, Preset):
        raise ConfigError(f"configs/{name}.py: get_config() must return a Preset, "
                          f"got {type(preset).__name__}")
    return preset


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


def load_model_and_tokenizer(preset: Preset, ckpt: str | os.PathLike | None = None,
                             dtype: str | None = None):
    """Loads the preset's weights (or `ckpt`) -> (model, tokenizer or None, source description).

    The model is a `Llama`, or a `LoopedLM` when the preset's model is a LoopedConfig or the
    checkpoint directory's config.json names a looped model (Ouro, Huginn/Raven)."""
    jdtype = resolve_dtype(dtype, preset)
    source = os.fspath(ckpt) if ckpt is not None else preset.checkpoint
    if source is None:
        raise _missing_weights(preset)
    if source == RANDOM:
        if preset.model is None:
            raise ConfigError(f"preset {preset.name}: random weights need a model config")
        from flax import nnx  # noqa: PLC0415
        if isinstance(preset.model, LoopedConfig):
            from models.looped import LoopedLM  # noqa: PLC0415
            return LoopedLM(preset.model, dtype=jdtype, rngs=nnx.Rngs(0)), None, "random weights"
        from models.llama import Llama  # noqa: PLC0415
        return Llama(preset.model, dtype=jdtype, rngs=nnx.Rngs(0)), None, "random weights"
    if source == EMBEDDED:
        from lookahead_jax.model_store import smollm2_gguf  # noqa: PLC0415
        source = os.fspath(smollm2_gguf())
    from lookahead_jax.tokenizer import load_tokenizer  # noqa: PLC0415
    looped = isinstance(preset.model, LoopedConfig)
    if os.path.isdir(source):
        from models.looped_loader import is_looped_checkpoint  # noqa: PLC0415
        if looped or is_looped_checkpoint(source):
            from models.looped_loader import load_hf_looped, load_looped_config  # noqa: PLC0415
            check_model_matches(preset, load_looped_config(source), source)
            model = load_hf_looped(source, dtype=jdtype)
        else:
            from models.hf_loader import load_hf_config, load_hf_llama  # noqa: PLC0415
            check_model_matches(preset, load_hf_config(source), source)
            model = load_hf_llama(source, dtype=jdtype)
    elif os.path.isfile(source):
        if looped:
            raise ConfigError(f"checkpoint {source}: preset {preset.name} is a looped model; "
                              f"pass a Hugging Face directory (config.json + *.safetensors)")
        if not source.lower().endswith(".gguf"):
            raise ConfigError(
                f"checkpoint {source} is a file but not a .gguf: pass a .gguf file or a Hugging "
                f"Face directory with config.json and *.safetensors")
        from models.gguf_loader import load_gguf_config, load_gguf_llama  # noqa: PLC0415
        check_model_matches(preset, load_gguf_config(source), source)
        model = load_gguf_llama(source, dtype=jdtype)
    elif os.path.exists(source):
        raise ConfigError(f"checkpoint {source} is neither a directory nor a file")
    else:
        raise ConfigError(f"checkpoint {source} does not exist")
    return model, load_tokenizer(source), source


def load_engine(name: str, ckpt: str | os.PathLike | None = None, dtype: str | None = None,
                **engine_kw):
    """Preset name (+ optional checkpoint override and dtype) -> a ready `Engine`.

    engine_kw go to `Engine(...)` and may override the preset's `lookahead`, `chat` and
    `devices` (default: all local devices for presets with `parallel`, else 1).
    """
    from lookahead_jax.engine import Engine  # noqa: PLC0415
    preset = load_preset(name)
    model, tokenizer, _ = load_model_and_tokenizer(preset, ckpt, dtype)
    kw = {"lookahead": preset.lookahead, "chat": preset.chat, **engine_kw}
    if preset.parallel and "devices" not in kw:
        import jax  # noqa: PLC0415
        kw["devices"] = len(jax.local_devices())
    return Engine(model, tokenizer, **kw)
