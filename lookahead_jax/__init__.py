"""lookahead_jax: faster LLM decoding in JAX without changing a single output token.

    from lookahead_jax import Engine, Sampling
    engine = Engine.from_preset("smollm2_135m")
    result = engine.generate("Write a haiku about JAX.", max_new_tokens=64)

Where things are:
  engine.py, method.py, registry.py   the Engine, the `Method` base class, name -> Method
  sampling.py, generation.py          the target distribution; the output buffer and prefill
  plain.py, prompt_lookup.py          plain decoding, prompt lookup decoding
  lookahead/                          Lookahead Decoding (config, layout, mask, window,
                                      n-gram pool, verifier, step, parallel)
  looped/                             looped models: the tree, speculative sampling, LoopSpec,
                                      LoopAhead, the drafter
  tuning/                             the scaling law, the step-cost curve, --auto
  store/                              presets, checkpoints, tokenizer, the default model
  serving/                            continuous batching (slots.py: the slot engine), the
                                      scheduler, the OpenAI-compatible HTTP server
  decode.py, serve.py                 the command lines: decode, and the server

The names below load on first use (PEP 562), so `import pallas_kernels` or `import models`
never pulls in the engine.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "Engine": "lookahead_jax.engine",
    "Result": "lookahead_jax.engine",
    "Stats": "lookahead_jax.engine",
    "Method": "lookahead_jax.method",
    "build_method": "lookahead_jax.registry",
    "Sampling": "lookahead_jax.sampling",
    "Plain": "lookahead_jax.plain",
    "PromptLookup": "lookahead_jax.prompt_lookup",
    "LookaheadConfig": "lookahead_jax.lookahead.config",
    "Lookahead": "lookahead_jax.lookahead.step",
    "LoopSpec": "lookahead_jax.looped.loopspec",
    "LoopAhead": "lookahead_jax.looped.loopahead",
    "LadDrafter": "lookahead_jax.looped.drafter",
    "DrafterModelWarning": "lookahead_jax.looped.drafter",
    "SlotEngine": "lookahead_jax.serving.slots",
    "SlotRequest": "lookahead_jax.serving.slots",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'lookahead_jax' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)


def __dir__() -> list[str]:
    return sorted(list(globals()) + __all__)
