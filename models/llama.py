"""A Llama-family decoder in Flax NNX whose forward pass takes positions and an attention mask.

`Llama.__call__(tokens [B,T], positions [B,T], mask [B,T,S+T], cache)` returns the logits of
the T tokens and their K/V. The mask covers [cache slots | the T new tokens]; the model never
builds a mask of its own, so any decoder (plain, lookahead, tree) chooses what each token sees.
"""

from __future__ import annotations

import math
from typing import Callable

import jax
import jax.numpy as jnp
from flax import nnx

from models.config import LlamaConfig
from models.kv_cache import KVCache, NewKV

AttentionFn = Callable[[jax.Array, jax.Array, jax.Array, jax.Array], jax.Array]


def rope_inv_freq(cfg: LlamaConfig) -> jax.Array:
    """[D/2] float32 inverse frequencies, with Llama-3 or linear scaling applied."""
    d = cfg.head_dim
    inv = 1.0 / (cfg.rope_theta ** (jnp.arange(0, d, 2, dtype=jnp.float32) / d))
    sc = cfg.rope_scaling
    if sc is None:
        return inv
    if sc.rope_type == "linear":
        return inv / sc.factor
    low_wavelen = sc.original_max_position_embeddings / sc.low_freq_factor
    high_wavelen = sc.original_max_position_embeddings / sc.high_freq_factor
    wavelen = 2 * math.pi / inv
    scaled = jnp.where(wavelen > low_wavelen, inv / sc.factor, inv)
    smooth = (sc.original_max_position_embeddings / wavelen - sc.low_freq_factor) / (
        sc.high_freq_factor - sc.low_freq_factor)
    smoothed = (1 - smooth) * scaled / sc.factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return jnp.where(medium, smoothed, scaled)


def rope_cos_sin(positions: jax.Array, inv_freq: jax.Array) -> tuple[jax.Array, jax.Array]:
    """positions [B,T] -> cos, sin [B,T,1,D] (rotate-half layout, as Hugging Face)."""
    angles = positions.astype(jnp.float32)[..., None] * inv_freq  # [B,T,D/2]
    angles = jnp.concatenate([angles, angles], axis=-1)[:, :, None, :]
    return jnp.cos(angles), jnp.sin(angles)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """x [B,T,H,D] rotated by position (rotate-half)."""
    x32 = x.astype(jnp.float32)
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x32[..., half:], x32[..., :half]], axis=-1)
    return (x32 * cos + rotated * sin).astype(x.dtype)


def dot_product_attention(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array) -> jax.Array:
    """Dense masked attention with grouped-query heads.

    q [B,T,H,D], k/v [B,S,Hkv,D], mask [B,T,S] bool -> [B,T,H,D]. Softmax in float32.
    A query row with no visible key returns zeros.
    """
    b, t, h, d = q.shape
    hkv = k.shape[2]
    qg = q.reshape(b, t, hkv, h // hkv, d)
    scores = jnp.einsum("BTKGD,BSKD->BKGTS", qg, k, preferred_element_type=jnp.float32)
    scores = scores / math.sqrt(d)
    m = mask[:, None, None, :, :]
    scores = jnp.where(m, scores, -jnp.inf)
    probs = jax.nn.softmax(scores, axis=-1, where=m)
    probs = jnp.where(m, probs, 0.0).astype(v.dtype)
    out = jnp.einsum("BKGTS,BSKD->BTKGD", probs, v, preferred_element_type=jnp.float32)
    return out.reshape(b, t, h, d).astype(q.dtype)


class RMSNorm(nnx.Module):
    def __init__(self, dim: int, eps: float, *, dtype=jnp.float32):
        self.weight = nnx.Param(jnp.ones((dim,), dtype))
        self.eps = eps

    def __call__(self, x: jax.Array) -> jax.Array:
        x32 = x.astype(jnp.float32)
        y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return self.weight[...] * y.astype(x.dtype)


def _linear(din: int, dout: int, dtype, rngs: nnx.Rngs) -> nnx.Linear:
    return nnx.Linear(din, dout, use_bias=False, dtype=dtype, param_dtype=dtype, rngs=rngs,
                      kernel_init=nnx.initializers.normal(0.02))


class Attention(nnx.Module):
    def __init__(self, cfg: LlamaConfig, *, dtype, rngs: nnx.Rngs):
        h, hkv, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = h, hkv, d
        self.q_proj = _linear(cfg.hidden_size, h * d, dtype, rngs)
        self.k_proj = _linear(cfg.hidden_size, hkv * d, dtype, rngs)
        self.v_proj = _linear(cfg.hidden_size, hkv * d, dtype, rngs)
        self.o_proj = _linear(h * d, cfg.hidden_size, dtype, rngs)

    def key_value(self, x, cos, sin) -> tuple[jax.Array, jax.Array]:
        """The K/V [B,T,Hkv,D] of x [B,T,E] (K rotated), as __call__ computes them."""
        b, t, _ = x.shape
        k = apply_rope(self.k_proj(x).reshape(b, t, self.num_kv_heads, self.head_dim), cos, sin)
        return k, self.v_proj(x).reshape(b, t, self.num_kv_heads, self.head_dim)

    def __call__(self, x, cos, sin, mask, cached_k, cached_v, attention_fn: AttentionFn):
        """x [B,T,E]; cached_k/v [B,S,Hkv,D] or None; mask [B,T,S+T]. Returns out, (k, v) of x."""
        b, t, _ = x.shape
        q = apply_rope(self.q_proj(x).reshape(b, t, self.num_heads, self.head_dim), cos, sin)
        k, v = self.key_value(x, cos, sin)
        keys, values = k, v
        if cached_k is not None:
            keys = jnp.concatenate([cached_k.astype(k.dtype), k], axis=1)
            values = jnp.concatenate([cached_v.astype(v.dtype), v], axis=1)
        out = attention_fn(q, keys, values, mask)
        return self.o_proj(out.reshape(b, t, -1)), (k, v)


class MLP(nnx.Module):
    def __init__(self, cfg: LlamaConfig, *, dtype, rngs: nnx.Rngs):
        self.gate_proj = _linear(cfg.hidden_size, cfg.intermediate_size, dtype, rngs)
        self.up_proj = _linear(cfg.hidden_size, cfg.intermediate_size, dtype, rngs)
        self.down_proj = _linear(cfg.intermediate_size, cfg.hidden_size, dtype, rngs)

    def __call__(self, x):
        return self.down_proj(jax.nn.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nnx.Module):
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
        self.embed_tokens = nnx.Embed(cfg.vocab_size, cfg.hidden_size, dtype=dtype,
                                      param_dtype=dtype, rngs=rngs,
                                      embedding_init=nnx.initializers.normal(0.02))
        self.layers = nnx.List([DecoderLayer(cfg, dtype=dtype, rngs=rngs)
                                for _ in range(cfg.num_layers)])
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype)
        self.lm_head = (None if cfg.tie_word_embeddings
                        else _linear(cfg.hidden_size, cfg.vocab_size, dtype, rngs))

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
            ck = None if cache is None else cache.k[i]
            cv = None if cache is None else cache.v[i]
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
                            dtype or self.dtype)


def causal_mask(lengths: jax.Array, t: int, cache: KVCache | None = None) -> jax.Array:
    """[B,T,S+T] mask for T new tokens per row appended after the cache, causal among themselves,
    with new token j of row b valid only if j < lengths[b] (rows padded on the right)."""
    i = jnp.arange(t)
    new = (i[None, :] <= i[:, None])[None] & (i[None, None, :] < lengths[:, None, None])
    if cache is None:
        return new
    old = jnp.broadcast_to(cache.visible()[:, None, :], (lengths.shape[0], t, cache.max_len))
    return jnp.concatenate([old, new], axis=-1)
