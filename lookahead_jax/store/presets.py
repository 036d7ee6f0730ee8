"""Presets: a named model shape, its recommended lookahead settings and where its weights come from.

Each preset is a Python file `configs/<name>.py` whose `get_config()` returns a `Preset`:

    preset = load_preset("llama7b")
    engine = Engine.from_preset("llama7b", ckpt="/models/Llama-2-7b-chat-hf")

Loading a preset's weights is `lookahead_jax.store.checkpoint`; this module holds only plain
definitions, so that preset files import nothing heavier than dataclasses.

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
import importlib.resources
import os
import pkgutil

import configs
from lookahead_jax.lookahead.config import LookaheadConfig
from models.config import ConfigError, LlamaConfig, LoopedConfig

EMBEDDED = "smollm2"
RANDOM = "random"
DTYPES = ("float32", "bfloat16")  # parameter dtypes a preset may name

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
    mesh: the default device mesh, "lookahead:A,model:B" (`--mesh`; None: one device), for
        models too big for one accelerator (llama70b: model:8).
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
    mesh: str | None = None

    def __post_init__(self):
        if self.dtype not in DTYPES:
            raise ConfigError(f"preset {self.name}: dtype must be one of {list(DTYPES)}, "
                              f"got {self.dtype!r}")
        if self.checkpoint == RANDOM and self.model is None:
            raise ConfigError(f"preset {self.name}: checkpoint 'random' needs a model config")


def shipped_checkpoint(name: str) -> str:
    """The path of `checkpoints/<name>`, a small checkpoint shipped with the package (the
    `checkpoints` package's data: installed with it, not read from a source checkout)."""
    return os.fspath(importlib.resources.files("checkpoints") / name)


def _configs_dir() -> str:
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
