"""Model families: Llama (Llama-2/3, CodeLlama, Mistral-style GQA, SmolLM2) and the looped
models Ouro and Raven (Huginn-0125).

  config.py     plain dataclasses: LlamaConfig, LoopedConfig (no jax: presets import them)
  kv_cache.py   KVCache, NewKV
  layers.py     shared layers (RMSNorm, Attention, MLP, RoPE, attention) and `causal_mask`
  llama.py      Llama
  looped.py     LoopedLM, the base class of the looped families (the loop machinery)
  ouro.py       OuroLM        raven.py   RavenLM
  build.py      build_looped(cfg): the looped family's model

The names below load on first use (PEP 562), so `import models.config` never pulls in jax.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "ConfigError": "models.config",
    "LlamaConfig": "models.config",
    "LoopedConfig": "models.config",
    "RopeScaling": "models.config",
    "KVCache": "models.kv_cache",
    "NewKV": "models.kv_cache",
    "causal_mask": "models.layers",
    "dot_product_attention": "models.layers",
    "Llama": "models.llama",
    "LoopedLM": "models.looped",
    "build_looped": "models.build",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'models' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)


def __dir__() -> list[str]:
    return sorted(list(globals()) + __all__)
