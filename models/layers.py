"""Layers shared by the model families (Llama, Ouro, Raven), and the one causal mask.

Every forward pass here takes explicit positions and an attention mask over
[cache slots | new tokens]; `causal_mask` builds the usual one.

Attention never joins the cache and the new tokens into one key array: an attention function
`fn(q, k, v, mask, cache_k, cache_v)` gets the new tokens' K/V and the cache layer's K/V
separately (the cache head-major, read in place; see `models.kv_cache`) and attends to both
under one softmax. Concatenating them would copy the whole cache once more per layer and step,
traffic a memory-bound accelerator pays for in full.
"""

from __future__ import annotations

import math
from typing import Callable

import jax
import jax.numpy as jnp
from flax import nnx
from jax import lax

from models.config import LlamaConfig, LoopedConfig
from models.kv_cache import KVCache
from models.sharding import EMBED_AXES, HEAD_AXES, KV_AXES, MLP_AXES, constrain

# fn(q, k, v, mask, cache_k, cache_v) -> out; see dot_product_attention
AttentionFn = Callable[..., jax.Array]
ModelConfig = LlamaConfig | LoopedConfig


def causal_mask(lengths: jax.Array, t: int, cache: KVCache | None = None) -> jax.Array:
    """The attention mask of T new tokens per row: [B,T,S+T] over [cache slots | new tokens].

    The new tokens follow the cache and are causal among themselves; new token j of row b is
    valid only if j < lengths[b] (rows padded on the right; lengths [B] int). cache None:
    no cache, [B,T,T]. Otherwise the cache part is `cache.visible()` for every new token.
    """
    i = jnp.arange(t)
    new = (i[None, :] <= i[:, None])[None] & (i[None, None, :] < lengths[:, None, None])
    if cache is None:
        return new
    old = jnp.broadcast_to(cache.visible()[:, None, :], (lengths.shape[0], t, cache.max_len))
    return jnp.concatenate([old, new], axis=-1)


def rope_inv_freq(cfg: ModelConfig) -> jax.Array:
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


def dot_product_attention(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array,
                          cache_k: jax.Array | None = None,
                          cache_v: jax.Array | None = None) -> jax.Array:
    """Dense masked attention with grouped-query heads, over a cache and the new tokens.

    q [B,T,H,D]; k/v [B,T,Hkv,D] the new tokens' keys and values; cache_k/v [B,Hkv,S,D] (one
    cache layer, head-major) or None; mask [B,T,S+T] bool over [cache slots | new tokens]
    ([B,T,T] without a cache) -> [B,T,H,D]. Softmax in float32. A query row with no visible
    key returns zeros.

    The cache is read where it lies: its scores come from one batched matmul with the cache as
    the left operand ([S, D] per row and head, contracted over D) and its values from one with
    the probabilities on the left, the layouts XLA multiplies without relayout; only the scores
    ([.., T, S]) of the two parts are joined.
    """
    b, t, h, d = q.shape
    hkv = k.shape[2]
    g = h // hkv
    qg = q.reshape(b, t, hkv, g, d)
    scores = jnp.einsum("BTKGD,BSKD->BKGTS", qg, k, preferred_element_type=jnp.float32)
    s = 0
    if cache_k is not None:
        s = cache_k.shape[2]
        rows = qg.transpose(0, 2, 3, 1, 4).reshape(b, hkv, g * t, d)  # [B,K,G*T,D]
        old = lax.dot_general(cache_k.astype(q.dtype), rows, (((3,), (3,)), ((0, 1), (0, 1))),
                              preferred_element_type=jnp.float32)  # [B,K,S,G*T]
        old = old.reshape(b, hkv, s, g, t).transpose(0, 1, 3, 4, 2)  # [B,K,G,T,S]
        scores = jnp.concatenate([old, scores], axis=-1)
    scores = scores / math.sqrt(d)
    m = mask[:, None, None, :, :]
    scores = jnp.where(m, scores, -jnp.inf)
    probs = jax.nn.softmax(scores, axis=-1, where=m)
    probs = jnp.where(m, probs, 0.0).astype(v.dtype)
    out = jnp.einsum("BKGTS,BSKD->BTKGD", probs[..., s:], v, preferred_element_type=jnp.float32)
    if cache_v is not None:
        p_old = probs[..., :s].reshape(b, hkv, g * t, s)
        old = lax.dot_general(p_old, cache_v.astype(v.dtype), (((3,), (2,)), ((0, 1), (0, 1))),
                              preferred_element_type=jnp.float32)  # [B,K,G*T,D]
        out = out + old.reshape(b, hkv, g, t, d).transpose(0, 3, 1, 2, 4)
    return out.reshape(b, t, h, d).astype(q.dtype)


def linear(din: int, dout: int, dtype, rngs: nnx.Rngs) -> nnx.Linear:
    """A bias-free projection, initialised N(0, 0.02)."""
    return nnx.Linear(din, dout, use_bias=False, dtype=dtype, param_dtype=dtype, rngs=rngs,
                      kernel_init=nnx.initializers.normal(0.02))


def embedding(cfg: ModelConfig, dtype, rngs: nnx.Rngs) -> nnx.Embed:
    """The token embedding [V, E], initialised N(0, 0.02)."""
    return nnx.Embed(cfg.vocab_size, cfg.hidden_size, dtype=dtype, param_dtype=dtype, rngs=rngs,
                     embedding_init=nnx.initializers.normal(0.02))


class RMSNorm(nnx.Module):
    def __init__(self, dim: int, eps: float, *, dtype=jnp.float32):
        self.weight = nnx.Param(jnp.ones((dim,), dtype))
        self.eps = eps

    def __call__(self, x: jax.Array) -> jax.Array:
        x32 = x.astype(jnp.float32)
        y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return self.weight[...] * y.astype(x.dtype)


class Attention(nnx.Module):
    """Grouped-query attention with separate q/k/v/o projections and rotate-half RoPE."""

    def __init__(self, cfg: ModelConfig, *, dtype, rngs: nnx.Rngs):
        h, hkv, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = h, hkv, d
        self.q_proj = linear(cfg.hidden_size, h * d, dtype, rngs)
        self.k_proj = linear(cfg.hidden_size, hkv * d, dtype, rngs)
        self.v_proj = linear(cfg.hidden_size, hkv * d, dtype, rngs)
        self.o_proj = linear(h * d, cfg.hidden_size, dtype, rngs)

    def key_value(self, x, cos, sin) -> tuple[jax.Array, jax.Array]:
        """The K/V [B,T,Hkv,D] of x [B,T,E] (K rotated), as __call__ computes them."""
        b, t, _ = x.shape
        k = constrain(self.k_proj(x).reshape(b, t, self.num_kv_heads, self.head_dim), KV_AXES)
        v = constrain(self.v_proj(x).reshape(b, t, self.num_kv_heads, self.head_dim), KV_AXES)
        return apply_rope(k, cos, sin), v

    def __call__(self, x, cos, sin, mask, cached_k, cached_v, attention_fn: AttentionFn):
        """x [B,T,E]; cached_k/v [B,Hkv,S,D] (one cache layer) or None; mask [B,T,S+T].
        Returns out, (k, v) of x."""
        b, t, _ = x.shape
        q = constrain(self.q_proj(x).reshape(b, t, self.num_heads, self.head_dim), HEAD_AXES)
        q = apply_rope(q, cos, sin)
        k, v = self.key_value(x, cos, sin)
        out = constrain(attention_fn(q, k, v, mask, cached_k, cached_v), HEAD_AXES)
        return constrain(self.o_proj(out.reshape(b, t, -1)), EMBED_AXES), (k, v)


class MLP(nnx.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    def __init__(self, cfg: ModelConfig, *, dtype, rngs: nnx.Rngs):
        self.gate_proj = linear(cfg.hidden_size, cfg.intermediate_size, dtype, rngs)
        self.up_proj = linear(cfg.hidden_size, cfg.intermediate_size, dtype, rngs)
        self.down_proj = linear(cfg.intermediate_size, cfg.hidden_size, dtype, rngs)

    def __call__(self, x):
        hidden = constrain(jax.nn.silu(self.gate_proj(x)) * self.up_proj(x), MLP_AXES)
        return constrain(self.down_proj(hidden), EMBED_AXES)
