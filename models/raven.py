"""Raven / Huginn-0125 (seal-rg/recurrent-pretraining): a looped LM with a prelude, a
recurrent core block that re-reads the prelude's output every loop, and a coda.

In LoopSpec's terms: P = embedding * sqrt(hidden) followed by `prelude_layers` sandwich
blocks, giving e; the state starts as truncated-normal noise; B = adapter(concat[state, e])
followed by `core_layers` sandwich blocks; C = `ln_f`, the `coda_layers` blocks, `ln_f`
again, `lm_head`. Parameter names follow `RavenForCausalLM` without the `transformer.` prefix.

The initial state is deterministic: the noise of a token depends only on (seed, absolute
position): key = fold_in(key(seed), position), then a standard normal truncated to [-3, 3],
times `state_std * embed_scale` (the published `initialize_state`: trunc_normal(std,
a=-3 std, b=3 std) * emb_scale, with std = sqrt(2 / (5 * hidden))). So every decoding method,
batch row and depth schedule sees the same initial state for the same position and seed.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from models.config import LoopedConfig
from models.kv_cache import KVCache, NewKV
from models.layers import (AttentionFn, RMSNorm, dot_product_attention, embedding, linear,
                           rope_inv_freq)
from models.looped import LoopedLM, Seed, default_mask


def rope_cos_sin_interleaved(positions: jax.Array, inv_freq: jax.Array
                             ) -> tuple[jax.Array, jax.Array]:
    """positions [B,T] -> cos, sin [B,T,1,D/2] for interleaved-pair RoPE (Raven's layout)."""
    angles = positions.astype(jnp.float32)[..., None] * inv_freq
    return jnp.cos(angles)[:, :, None, :], jnp.sin(angles)[:, :, None, :]


def apply_rope_interleaved(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """x [B,T,H,D] rotated by position, pairs (x[2i], x[2i+1]) rotated by frequency i."""
    x32 = x.astype(jnp.float32).reshape(*x.shape[:-1], x.shape[-1] // 2, 2)
    a, b = x32[..., 0], x32[..., 1]
    out = jnp.stack([a * cos - b * sin, b * cos + a * sin], axis=-1)
    return out.reshape(x.shape).astype(x.dtype)


class RavenAttention(nnx.Module):
    """Fused q/k/v projection `Wqkv`, optional `qk_bias` [2,1,H,D] added before interleaved
    RoPE, output projection `proj` (HF `CausalSelfAttention`)."""

    def __init__(self, cfg: LoopedConfig, *, dtype, rngs: nnx.Rngs):
        h, hkv, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = h, hkv, d
        self.Wqkv = linear(cfg.hidden_size, (h + 2 * hkv) * d, dtype, rngs)
        self.qk_bias = (nnx.Param(nnx.initializers.normal(0.02)(rngs.params(), (2, 1, h, d), dtype))
                        if cfg.qk_bias else None)
        self.proj = linear(h * d, cfg.hidden_size, dtype, rngs)

    def __call__(self, x, cos, sin, mask, cached_k, cached_v, attention_fn):
        b, t, _ = x.shape
        h, hkv, d = self.num_heads, self.num_kv_heads, self.head_dim
        qkv = self.Wqkv(x)
        q = qkv[..., : h * d].reshape(b, t, h, d)
        k = qkv[..., h * d: (h + hkv) * d].reshape(b, t, hkv, d)
        v = qkv[..., (h + hkv) * d:].reshape(b, t, hkv, d)
        if self.qk_bias is not None:
            bias = self.qk_bias[...]
            q, k = (q + bias[0]).astype(q.dtype), (k + bias[1]).astype(k.dtype)
        q, k = apply_rope_interleaved(q, cos, sin), apply_rope_interleaved(k, cos, sin)
        out = attention_fn(q, k, v, mask, cached_k, cached_v)
        return self.proj(out.reshape(b, t, -1)), (k, v)


class GatedMLP(nnx.Module):
    """One fused `fc` (hidden -> 2 * intermediate: [gate | up]), silu(gate) * up, `proj`."""

    def __init__(self, cfg: LoopedConfig, *, dtype, rngs: nnx.Rngs):
        self.fc = linear(cfg.hidden_size, 2 * cfg.intermediate_size, dtype, rngs)
        self.proj = linear(cfg.intermediate_size, cfg.hidden_size, dtype, rngs)

    def __call__(self, x):
        gate, up = jnp.split(self.fc(x), 2, axis=-1)
        return self.proj(jax.nn.silu(gate) * up)


class SandwichBlock(nnx.Module):
    """Raven's block: x = norm_2(attn(norm_1(x)) + x); x = norm_4(mlp(norm_3(x)) + x)."""

    def __init__(self, cfg: LoopedConfig, *, dtype, rngs: nnx.Rngs):
        eps = cfg.rms_norm_eps
        self.norm_1 = RMSNorm(cfg.hidden_size, eps, dtype=dtype)
        self.attn = RavenAttention(cfg, dtype=dtype, rngs=rngs)
        self.norm_2 = RMSNorm(cfg.hidden_size, eps, dtype=dtype)
        self.mlp = GatedMLP(cfg, dtype=dtype, rngs=rngs)
        self.norm_3 = RMSNorm(cfg.hidden_size, eps, dtype=dtype)
        self.norm_4 = RMSNorm(cfg.hidden_size, eps, dtype=dtype)

    def __call__(self, x, cos, sin, mask, cached_k, cached_v, attention_fn):
        a, kv = self.attn(self.norm_1(x), cos, sin, mask, cached_k, cached_v, attention_fn)
        x = self.norm_2(a + x)
        return self.norm_4(self.mlp(self.norm_3(x)) + x), kv


class RavenLM(LoopedLM):
    """Raven: `wte`, `prelude`, `adapter`, `core_block` (the loop), `coda`, `ln_f`, `lm_head`."""

    family = "raven"

    def build_layers(self, cfg: LoopedConfig, dtype, rngs: nnx.Rngs) -> None:
        e = cfg.hidden_size
        self.wte = embedding(cfg, dtype, rngs)
        block = lambda: SandwichBlock(cfg, dtype=dtype, rngs=rngs)  # noqa: E731
        self.prelude = nnx.List([block() for _ in range(cfg.prelude_layers)])
        self.adapter = linear(2 * e, e, dtype, rngs)
        self.core_block = nnx.List([block() for _ in range(cfg.core_layers)])
        self.coda = nnx.List([block() for _ in range(cfg.coda_layers)])
        self.ln_f = RMSNorm(e, cfg.rms_norm_eps, dtype=dtype)

    @property
    def token_embed(self) -> nnx.Embed:
        return self.wte

    @property
    def loop_block(self) -> nnx.List:
        return self.core_block

    def rope(self, positions: jax.Array) -> tuple[jax.Array, jax.Array]:
        return rope_cos_sin_interleaved(positions, rope_inv_freq(self.config))

    def embed(self, tokens: jax.Array, positions: jax.Array, mask: jax.Array | None = None,
              cache: KVCache | None = None,
              attention_fn: AttentionFn = dot_product_attention) -> tuple[jax.Array, NewKV | None]:
        """Prelude P: the scaled embedding through the prelude blocks. tokens, positions [B,T];
        mask [B,T,S+T] (None: causal, no cache). Returns e [B,T,E] and the prelude's K/V
        [prelude_layers, B,T,Hkv,D] (None without prelude layers)."""
        mask = default_mask(mask, positions)
        x = self.wte(tokens) * jnp.asarray(self.config.embed_scale, self.dtype)
        cos, sin = self.rope(positions)
        return self._stack(self.prelude, x, cos, sin, mask, cache, 0, None, attention_fn)

    def initial_state(self, e: jax.Array, positions: jax.Array, seed: Seed = None) -> jax.Array:
        """Truncated-normal noise [B,T,E] that is a function of (seed, absolute position) only
        (seed None: config.noise_seed); see the module docstring."""
        cfg = self.config
        seed = cfg.noise_seed if seed is None else seed
        base = jax.random.key(seed)
        keys = jax.vmap(lambda p: jax.random.fold_in(base, p))(positions.reshape(-1))
        noise = jax.vmap(lambda k: jax.random.truncated_normal(k, -3.0, 3.0, (cfg.hidden_size,),
                                                               jnp.float32))(keys)
        noise = noise.reshape(*positions.shape, cfg.hidden_size) * (cfg.state_std * cfg.embed_scale)
        return noise.astype(e.dtype)

    def inject(self, h: jax.Array, e: jax.Array) -> jax.Array:
        """adapter(concat[state, e])."""
        return self.adapter(jnp.concatenate([h, e.astype(h.dtype)], axis=-1))

    def readout_state(self, h, depth, positions, mask, cache, attention_fn):
        """ln_f(coda(ln_f(h))), the coda attending to the readout depth's coda slots (depth
        1..R, one int or [B,T]); returns it and the coda's K/V (None without coda layers)."""
        x, kv = self.run_coda(self.coda, self.ln_f(h), depth, positions, mask, cache,
                              attention_fn)
        return self.ln_f(x), kv
