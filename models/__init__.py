"""Model families: the Llama-family decoders (Llama 2/3.x, CodeLlama, SmolLM2, Mistral, Qwen 2.5
and 3, Gemma 2 and 3, Phi-3) and the looped models Ouro and Raven (Huginn-0125).

  config.py     plain dataclasses: LlamaConfig, LoopedConfig (no jax: presets import them)
  families.py   each decoder family's config.json fields and tensor names (no jax)
  hf_loader.py  Hugging Face safetensors -> Llama (any family); gguf_loader.py, looped_loader.py
  kv_cache.py   KVCache, NewKV
  layers.py     shared layers (RMSNorm, Attention, MLP, RoPE, attention) and `causal_mask`
  llama.py      Llama, the decoder of every family (positions and mask in, new K/V out)
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
