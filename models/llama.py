"""The decoder of every Llama-family model in Flax NNX (Llama 2/3, CodeLlama, SmolLM2, Mistral,
Qwen 2.5/3, Gemma 2/3, Phi-3: `LlamaConfig`'s switches), whose forward pass takes positions and
an attention mask.

`Llama.__call__(tokens [B,T], positions [B,T], mask [B,T,S+T], cache)` returns the logits of
the T tokens and their K/V. The mask covers [cache slots | the T new tokens]; the model never
builds a mask of its own, so any decoder (plain, lookahead, tree) chooses what each token sees
(`models.layers.causal_mask` builds the plain causal one). A family's own attention rules (a
sliding window, soft-capping, the score scale) are passed with it to the attention function of
the layers that have them, which applies them on top of the decoder's mask.
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
    """Pre-norm decoder layer: x + attn(norm(x)), then x + mlp(norm(x)).

    Llama names the second norm (the MLP's input) `post_attention_layernorm`. With
    sandwich_norms (Gemma 2/3) the names follow Gemma's: x + post_attention_layernorm(attn(
    input_layernorm(x))), then x + post_feedforward_layernorm(mlp(pre_feedforward_layernorm(x))).
    """

    def __init__(self, cfg: LlamaConfig, *, dtype, rngs: nnx.Rngs):
        def norm():
            return RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype, offset=cfg.norm_offset)

        self.sandwich = cfg.sandwich_norms
        self.input_layernorm = norm()
        self.self_attn = Attention(cfg, dtype=dtype, rngs=rngs, bias=cfg.qkv_bias,
                                   o_bias=cfg.o_bias, qk_norm=cfg.qk_norm,
                                   norm_offset=cfg.norm_offset)
        self.post_attention_layernorm = norm()
        if self.sandwich:
            self.pre_feedforward_layernorm = norm()
            self.post_feedforward_layernorm = norm()
        self.mlp = MLP(cfg, dtype=dtype, rngs=rngs, activation=cfg.hidden_act)

    def __call__(self, x, cos, sin, mask, cached_k, cached_v, attention_fn, rules=None):
        """rules: the layer's own attention rules (`Llama.layer_rules`; None: none)."""
        a, kv = self.self_attn(self.input_layernorm(x), cos, sin, mask, cached_k, cached_v,
                               attention_fn, **(rules or {}))
        if not self.sandwich:
            x = x + a
            return x + self.mlp(self.post_attention_layernorm(x)), kv
        x = x + self.post_attention_layernorm(a)
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x))), kv


def layer_rules(cfg: LlamaConfig, i: int, positions: jax.Array | None) -> dict:
    """The attention rules of layer i of a `cfg` model beyond the decoder's mask (see
    `models.layers.dot_product_attention`): none for a Llama layer."""
    rules: dict = {}
    if cfg.query_scale:
        rules["scale"] = cfg.query_scale
    if cfg.attn_softcap:
        rules["softcap"] = cfg.attn_softcap
    if cfg.layer_kinds[i] == "sliding":
        rules["window"] = cfg.sliding_window
        rules["positions"] = positions
    return rules


class Llama(nnx.Module):
    """Llama-family causal LM. Parameter names follow Hugging Face's `LlamaForCausalLM` (and
    Gemma's for the extra norms); `models.families` maps each family's checkpoint onto them."""

    def __init__(self, cfg: LlamaConfig, *, dtype=jnp.float32, rngs: nnx.Rngs):
        self.config = cfg
        self.dtype = dtype
        self.embed_tokens = embedding(cfg, dtype, rngs)
        self.layers = nnx.List([DecoderLayer(cfg, dtype=dtype, rngs=rngs)
                                for _ in range(cfg.num_layers)])
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype,
                            offset=cfg.norm_offset)
        self.lm_head = (None if cfg.tie_word_embeddings
                        else linear(cfg.hidden_size, cfg.vocab_size, dtype, rngs))

    def layer_rules(self, i: int, positions: jax.Array) -> dict:
        """The attention rules of layer i beyond the decoder's mask: `layer_rules`."""
        return layer_rules(self.config, i, positions)

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
        rope = {False: rope_cos_sin(positions, rope_inv_freq(cfg))}
        if cfg.local_rope_theta and cfg.sliding_layers:  # Gemma 3: the sliding layers' own RoPE
            rope[True] = rope_cos_sin(positions, rope_inv_freq(cfg, local=True))
        x = self.embed_tokens(tokens)
        if cfg.embed_scale != 1.0:  # Gemma: scaled in the activations' dtype, as Hugging Face
            x = x * jnp.asarray(cfg.embed_scale, x.dtype)
        ks, vs = [], []
        for i, layer in enumerate(self.layers):
            ck, cv = (None, None) if cache is None else cache.slots(i)
            cos, sin = rope[cfg.layer_kinds[i] == "sliding" and True in rope]
            x, (k, v) = layer(x, cos, sin, mask, ck, cv, attention_fn,
                              self.layer_rules(i, positions))
            ks.append(k)
            vs.append(v)
        if logits_at is not None:
            x = jnp.take_along_axis(x, logits_at[..., None], axis=1)
        x = self.norm(x)
        if self.lm_head is None:
            logits = self.embed_tokens.attend(x)
        else:
            logits = self.lm_head(x)
        logits = logits.astype(jnp.float32)
        if cfg.final_softcap:
            logits = cfg.final_softcap * jnp.tanh(logits / cfg.final_softcap)
        return logits, NewKV(jnp.stack(ks), jnp.stack(vs))

    def init_cache(self, batch: int, max_len: int, dtype=None) -> KVCache:
        cfg = self.config
        return KVCache.init(cfg.num_layers, batch, max_len, cfg.num_kv_heads, cfg.head_dim,
                            dtype or self.dtype, per_layer=True)
