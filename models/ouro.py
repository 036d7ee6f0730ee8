"""Ouro (ByteDance): a looped LM whose whole layer stack is the recurrent block.

In LoopSpec's terms: P = the embedding; B = the shared stack of `num_layers` sandwich-norm
layers followed by the shared final norm (the normed state is fed into the next loop);
C = `lm_head`. An early-exit gate (`early_exit_gate`, hidden -> 1, with bias) gives one exit
logit per loop. Parameter names follow `OuroForCausalLM` without the `model.` prefix.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from models.config import LoopedConfig
from models.kv_cache import KVCache, NewKV
from models.layers import (MLP, Attention, AttentionFn, RMSNorm, dot_product_attention, embedding,
                           rope_cos_sin, rope_inv_freq)
from models.looped import LoopedLM


class OuroLayer(nnx.Module):
    """Ouro's sandwich-norm decoder layer: x + norm2(attn(norm1(x))), then the same for the MLP
    (HF `OuroDecoderLayer`: input_layernorm, input_layernorm_2, post_attention_layernorm,
    post_attention_layernorm_2)."""

    def __init__(self, cfg: LoopedConfig, *, dtype, rngs: nnx.Rngs):
        eps = cfg.rms_norm_eps
        self.input_layernorm = RMSNorm(cfg.hidden_size, eps, dtype=dtype)
        self.self_attn = Attention(cfg, dtype=dtype, rngs=rngs)
        self.input_layernorm_2 = RMSNorm(cfg.hidden_size, eps, dtype=dtype)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, eps, dtype=dtype)
        self.mlp = MLP(cfg, dtype=dtype, rngs=rngs)
        self.post_attention_layernorm_2 = RMSNorm(cfg.hidden_size, eps, dtype=dtype)

    def __call__(self, x, cos, sin, mask, cached_k, cached_v, attention_fn):
        a, kv = self.self_attn(self.input_layernorm(x), cos, sin, mask, cached_k, cached_v,
                               attention_fn)
        x = x + self.input_layernorm_2(a)
        return x + self.post_attention_layernorm_2(self.mlp(self.post_attention_layernorm(x))), kv


class OuroLM(LoopedLM):
    """Ouro: `embed_tokens`, `layers` (the loop), `norm`, `early_exit_gate`, `lm_head`."""

    family = "ouro"

    def build_layers(self, cfg: LoopedConfig, dtype, rngs: nnx.Rngs) -> None:
        e = cfg.hidden_size
        self.embed_tokens = embedding(cfg, dtype, rngs)
        self.layers = nnx.List([OuroLayer(cfg, dtype=dtype, rngs=rngs)
                                for _ in range(cfg.num_layers)])
        self.norm = RMSNorm(e, cfg.rms_norm_eps, dtype=dtype)
        self.early_exit_gate = nnx.Linear(e, 1, use_bias=True, dtype=dtype, param_dtype=dtype,
                                          rngs=rngs, kernel_init=nnx.initializers.normal(0.02))

    @property
    def token_embed(self) -> nnx.Embed:
        return self.embed_tokens

    @property
    def loop_block(self) -> nnx.List:
        return self.layers

    def rope(self, positions: jax.Array) -> tuple[jax.Array, jax.Array]:
        return rope_cos_sin(positions, rope_inv_freq(self.config))

    def embed(self, tokens: jax.Array, positions: jax.Array, mask: jax.Array | None = None,
              cache: KVCache | None = None,
              attention_fn: AttentionFn = dot_product_attention) -> tuple[jax.Array, NewKV | None]:
        """Prelude P: the token embeddings [B,T,E]; no K/V (None)."""
        return self.embed_tokens(tokens), None

    def finish_loop(self, x: jax.Array) -> jax.Array:
        """The shared final norm closes every loop."""
        return self.norm(x)

    def readout_state(self, h, depth, positions, mask, cache, attention_fn):
        """Readout C is the LM head alone: the state itself, no K/V."""
        return h, None

    def exit_gate(self, h: jax.Array) -> jax.Array:
        """The early-exit gate logit of a state, [B,T] float32 (sigmoid: the exit probability
        of that loop)."""
        return self.early_exit_gate(h)[..., 0].astype(jnp.float32)
