"""Layers shared by the model families (the Llama-family decoders, Ouro, Raven), and the one
causal mask.

Every forward pass here takes explicit positions and an attention mask over
[cache slots | new tokens]; `causal_mask` builds the usual one.

Attention never joins the cache and the new tokens into one key array: an attention function
`fn(q, k, v, mask, cache_k, cache_v)` gets the new tokens' K/V and the cache layer's K/V
separately (the cache head-major, read in place; see `models.kv_cache`) and attends to both
under one softmax. Concatenating them would copy the whole cache once more per layer and step,
traffic a memory-bound accelerator pays for in full.
"""

from __future__ import annotations

import functools
import math
from typing import Callable

import jax
import jax.numpy as jnp
from flax import nnx
from jax import lax

from models.config import LlamaConfig, LoopedConfig
from models.kv_cache import KVCache
from models.sharding import EMBED_AXES, HEAD_AXES, KV_AXES, MLP_AXES, constrain

# fn(q, k, v, mask, cache_k, cache_v, **rules) -> out; see dot_product_attention. rules (scale,
# softcap, window with positions) come only from the layers of the families that have them
# (Gemma, sliding-window layers): an attention function for Llama-shaped models needs none.
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


def rope_inv_freq(cfg: ModelConfig, local: bool = False) -> jax.Array:
    """[D/2] float32 inverse frequencies, with Llama-3 or linear scaling applied. local: those
    of the sliding layers of a config with its own local RoPE base (`local_rope_theta`, Gemma
    3), which have no scaling."""
    d = cfg.head_dim
    local_theta = getattr(cfg, "local_rope_theta", 0.0)
    theta = local_theta if local and local_theta else cfg.rope_theta
    inv = 1.0 / (theta ** (jnp.arange(0, d, 2, dtype=jnp.float32) / d))
    sc = cfg.rope_scaling
    if sc is None or (local and local_theta):
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
                          cache_v: jax.Array | None = None, *, scale: float | None = None,
                          softcap: float | None = None, window: int | None = None,
                          positions: jax.Array | None = None) -> jax.Array:
    """Dense masked attention with grouped-query heads, over a cache and the new tokens.

    q [B,T,H,D]; k/v [B,T,Hkv,D] the new tokens' keys and values; cache_k/v [B,Hkv,S,D] (one
    cache layer, head-major) or None; mask [B,T,S+T] bool over [cache slots | new tokens]
    ([B,T,T] without a cache) -> [B,T,H,D]. Softmax in float32. A query row with no visible
    key returns zeros.

    A model family's own rules, passed by the model for the layers that have them:
    scale: the score scale (default D ** -0.5); softcap: scores -> softcap * tanh(scores /
    softcap) before the mask (Gemma 2); window with positions [B,T] (the new tokens'
    positions): a sliding-window layer, where a query at position p also needs the key's
    position > p - window. Cache slot s holds the row's token at position s (`KVCache` keeps
    a row's tokens in slots 0..length), so the window composes with any mask the decoder
    gives.

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
    scores = scores * (scale if scale is not None else 1.0 / math.sqrt(d))
    if softcap:
        scores = softcap * jnp.tanh(scores / softcap)
    if window:
        mask = mask & in_window(positions, s, window)
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


def in_window(positions: jax.Array, cache_size: int, window: int) -> jax.Array:
    """[B,T,S+T] bool: which keys [cache slots | new tokens] lie in the sliding window of the
    new tokens at `positions` [B,T]: key position > query position - window (slot s holds
    position s; a new token's key has its own position)."""
    b = positions.shape[0]
    slots = jnp.broadcast_to(jnp.arange(cache_size, dtype=positions.dtype)[None], (b, cache_size))
    keys = jnp.concatenate([slots, positions], axis=1)  # [B, S+T]
    return keys[:, None, :] > positions[:, :, None] - window


def linear(din: int, dout: int, dtype, rngs: nnx.Rngs, *, bias: bool = False) -> nnx.Linear:
    """A projection (bias-free unless asked), initialised N(0, 0.02)."""
    return nnx.Linear(din, dout, use_bias=bias, dtype=dtype, param_dtype=dtype, rngs=rngs,
                      kernel_init=nnx.initializers.normal(0.02))


def embedding(cfg: ModelConfig, dtype, rngs: nnx.Rngs) -> nnx.Embed:
    """The token embedding [V, E], initialised N(0, 0.02)."""
    return nnx.Embed(cfg.vocab_size, cfg.hidden_size, dtype=dtype, param_dtype=dtype, rngs=rngs,
                     embedding_init=nnx.initializers.normal(0.02))


class RMSNorm(nnx.Module):
    """RMSNorm over the last axis. offset 0 (Llama): weight * normalized, the product in x's
    dtype; offset 1 (Gemma, whose weights are stored as scale - 1): normalized * (1 + weight)
    in float32, then cast, as the Hugging Face implementations do."""

    def __init__(self, dim: int, eps: float, *, dtype=jnp.float32, offset: float = 0.0):
        self.weight = nnx.Param(jnp.full((dim,), 1.0 - offset, dtype))
        self.eps = eps
        self.offset = offset

    def __call__(self, x: jax.Array) -> jax.Array:
        x32 = x.astype(jnp.float32)
        y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        if self.offset:
            return (y * (self.offset + self.weight[...].astype(jnp.float32))).astype(x.dtype)
        return self.weight[...] * y.astype(x.dtype)


class Attention(nnx.Module):
    """Grouped-query attention with separate q/k/v/o projections and rotate-half RoPE.

    bias / o_bias: biases on q/k/v (Qwen 2.5) / on the output projection. qk_norm: RMSNorm of
    every query and key head before RoPE (Qwen 3, Gemma 3), with `norm_offset` and `eps`.
    """

    def __init__(self, cfg: ModelConfig, *, dtype, rngs: nnx.Rngs, bias: bool = False,
                 o_bias: bool = False, qk_norm: bool = False, norm_offset: float = 0.0):
        h, hkv, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = h, hkv, d
        self.q_proj = linear(cfg.hidden_size, h * d, dtype, rngs, bias=bias)
        self.k_proj = linear(cfg.hidden_size, hkv * d, dtype, rngs, bias=bias)
        self.v_proj = linear(cfg.hidden_size, hkv * d, dtype, rngs, bias=bias)
        self.o_proj = linear(h * d, cfg.hidden_size, dtype, rngs, bias=o_bias)
        if qk_norm:
            self.q_norm = RMSNorm(d, cfg.rms_norm_eps, dtype=dtype, offset=norm_offset)
            self.k_norm = RMSNorm(d, cfg.rms_norm_eps, dtype=dtype, offset=norm_offset)
        else:
            self.q_norm = self.k_norm = None

    def key_value(self, x, cos, sin) -> tuple[jax.Array, jax.Array]:
        """The K/V [B,T,Hkv,D] of x [B,T,E] (K normed and rotated), as __call__ computes them."""
        b, t, _ = x.shape
        k = constrain(self.k_proj(x).reshape(b, t, self.num_kv_heads, self.head_dim), KV_AXES)
        v = constrain(self.v_proj(x).reshape(b, t, self.num_kv_heads, self.head_dim), KV_AXES)
        if self.k_norm is not None:
            k = self.k_norm(k)
        return apply_rope(k, cos, sin), v

    def __call__(self, x, cos, sin, mask, cached_k, cached_v, attention_fn: AttentionFn,
                 **rules):
        """x [B,T,E]; cached_k/v [B,Hkv,S,D] (one cache layer) or None; mask [B,T,S+T].
        rules: the layer's own attention rules (scale, softcap, window and positions; see
        `dot_product_attention`), passed on to attention_fn only when given.
        Returns out, (k, v) of x."""
        b, t, _ = x.shape
        q = constrain(self.q_proj(x).reshape(b, t, self.num_heads, self.head_dim), HEAD_AXES)
        if self.q_norm is not None:
            q = self.q_norm(q)
        q = apply_rope(q, cos, sin)
        k, v = self.key_value(x, cos, sin)
        out = constrain(attention_fn(q, k, v, mask, cached_k, cached_v, **rules), HEAD_AXES)
        return constrain(self.o_proj(out.reshape(b, t, -1)), EMBED_AXES), (k, v)


# gate activations: SwiGLU's silu; GeGLU's tanh-approximated gelu (`gelu_pytorch_tanh`)
ACTIVATION_FNS = {"silu": jax.nn.silu, "gelu_tanh": functools.partial(jax.nn.gelu, approximate=True)}


class MLP(nnx.Module):
    """Gated MLP: down(act(gate(x)) * up(x)); act silu (SwiGLU) or gelu_tanh (GeGLU)."""

    def __init__(self, cfg: ModelConfig, *, dtype, rngs: nnx.Rngs, activation: str = "silu"):
        self.gate_proj = linear(cfg.hidden_size, cfg.intermediate_size, dtype, rngs)
        self.up_proj = linear(cfg.hidden_size, cfg.intermediate_size, dtype, rngs)
        self.down_proj = linear(cfg.intermediate_size, cfg.hidden_size, dtype, rngs)
        self.activation = activation

    def __call__(self, x):
        act = ACTIVATION_FNS[self.activation]
        hidden = constrain(act(self.gate_proj(x)) * self.up_proj(x), MLP_AXES)
        return constrain(self.down_proj(hidden), EMBED_AXES)
