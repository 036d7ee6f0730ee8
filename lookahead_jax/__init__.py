"""lookahead_jax: faster LLM decoding in JAX without changing a single output token.

    from lookahead_jax import Engine, LookaheadConfig, Sampling
    engine = Engine.from_preset("smollm2_135m")
    result = engine.generate("Write a haiku about JAX.", max_new_tokens=64)
"""

from lookahead_jax.config import LookaheadConfig
from lookahead_jax.engine import Engine, Plain, Result, Stats
from lookahead_jax.sampling import Sampling
from lookahead_jax.step import Lookahead

__all__ = ["Engine", "Lookahead", "LookaheadConfig", "Plain", "Result", "Sampling", "Stats"]
