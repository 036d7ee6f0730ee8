"""A Llama-family decoder in Flax NNX whose forward pass takes positions and an attention mask.

`Llama.__call__(tokens [B,T], positions [B,T], mask [B,T,S+T], cache)` returns the logits of
the T tokens and their K/V. The mask covers [cache slots | the T new tokens]; the model never
builds a mask of its own, so any decoder (plain, lookahead, tree) chooses what each token sees
(`models.layers.causal_mask` builds the plain causal one).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from models.config import LlamaConfig
from models.kv_cache import KVCache, NewKV
from models.layers import (MLP, Attention, AttentionFn, RMSNorm, dot_product_attention, embedding,
                           linear, rope_cos_sin, rope_inv_freq)


class DecoderLayer(nnx.Module):
    """Pre-norm decoder layer: x + attn(norm(x)), then x + mlp(norm(x))."""

    def __init__(self, cfg: LlamaConfig, *, dtype, rngs: nnx.Rngs):
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype)
        self.self_attn = Attention(cfg, dtype=dtype, rngs=rngs)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype)
        self.mlp = MLP(cfg, dtype=dtype, rngs=rngs)

    def __call__(self, x, cos, sin, mask, cached_k, cached_v, attention_fn):
        a, kv = self.self_attn(self.input_layernorm(x), cos, sin, mask, cached_k, cached_v,
                               attention_fn)
        x = x + a
        return x + self.mlp(self.post_attention_layernorm(x)), kv


class Llama(nnx.Module):
    """Llama-family causal LM. Parameter names follow Hugging Face's `LlamaForCausalLM`."""

    def __init__(self, cfg: LlamaConfig, *, dtype=jnp.float32, rngs: nnx.Rngs):
        self.config = cfg
        self.dtype = dtype
        self.embed_tokens = embedding(cfg, dtype, rngs)
        self.layers = nnx.List([DecoderLayer(cfg, dtype=dtype, rngs=rngs)
                                for _ in range(cfg.num_layers)])
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype)
        self.lm_head = (None if cfg.tie_word_embeddings
                        else linear(cfg.hidden_size, cfg.vocab_size, dtype, rngs))

    def __call__(self, tokens: jax.Array, positions: jax.Array, mask: jax.Array,
                 cache: KVCache | None = None,
                 attention_fn: AttentionFn = dot_product_attention,
                 logits_at: jax.Array | None = None) -> tuple[jax.Array, NewKV]:
        """One forward pass.

        tokens, positions: [B,T] int32. mask: [B,T,S+T] bool over [cache slots | new tokens]
        (S = 0 without a cache). logits_at: optional [B,R] indices into the T tokens; only
        their logits are computed (the LM head is a large part of a step's cost).
        Returns logits [B,T,V] (or [B,R,V]) float32 and the new tokens' K/V.
        """
        cfg = self.config
        s = 0 if cache is None else cache.max_len
        if mask.shape != (*tokens.shape, s + tokens.shape[1]):
            raise ValueError(f"mask shape {mask.shape} != {(*tokens.shape, s + tokens.shape[1])}")
        cos, sin = rope_cos_sin(positions, rope_inv_freq(cfg))
        x = self.embed_tokens(tokens)
        ks, vs = [], []
        for i, layer in enumerate(self.layers):
            ck, cv = (None, None) if cache is None else cache.slots(i)
            x, (k, v) = layer(x, cos, sin, mask, ck, cv, attention_fn)
            ks.append(k)
            vs.append(v)
        if logits_at is not None:
            x = jnp.take_along_axis(x, logits_at[..., None], axis=1)
        x = self.norm(x)
        if self.lm_head is None:
            logits = self.embed_tokens.attend(x)
        else:
            logits = self.lm_head(x)
        return logits.astype(jnp.float32), NewKV(jnp.stack(ks), jnp.stack(vs))

    def init_cache(self, batch: int, max_len: int, dtype=None) -> KVCache:
        cfg = self.config
        return KVCache.init(cfg.num_layers, batch, max_len, cfg.num_kv_heads, cfg.head_dim,
                            dtype or self.dtype, per_layer=True)
