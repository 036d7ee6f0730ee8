"""Looped (depth-recurrent) language models in Flax NNX: Ouro and Raven (Huginn-0125).

A looped model reuses one block of layers R times. In LoopSpec's terms (see
ALGORITHM_NOTES.md): a prelude P embeds the tokens, a recurrent block B advances the state by
one loop, and a readout C turns the state at any depth 1..R into logits.

- Ouro (ByteDance): P = the embedding; B = the shared stack of `num_layers` sandwich-norm
  layers followed by the shared final norm (the normed state is fed into the next loop);
  C = `lm_head`. An early-exit gate (`early_exit_gate`, hidden -> 1, with bias) gives one exit
  logit per loop.
- Raven / Huginn-0125 (seal-rg/recurrent-pretraining): P = embedding * sqrt(hidden) followed
  by `prelude_layers` sandwich blocks, giving e; the state starts as truncated-normal noise;
  B = adapter(concat[state, e]) followed by `core_layers` sandwich blocks; C = `ln_f`, the
  `coda_layers` blocks, `ln_f` again, `lm_head`.

The forward pass is exposed at three grains, all with explicit positions, mask and
`attention_fn`, and none writing a cache itself (they return `NewKV`, as `Llama` does):

- `__call__(tokens, positions, mask, cache)`: every token through all R loops and read out at
  full depth. Same signature and contract as `Llama.__call__`, so plain decoding runs on it.
- `embed` / `initial_state` / `advance` / `readout`: the pieces, so a scheduler can hold
  tokens at different depths: `advance` moves each token of a batch from its own depth d to
  d + 1, `readout` reads logits at each token's own depth.
- `loop_logits(tokens, positions)`: no cache, causal, the readout after every loop
  ([R, B, T, V]) and Ouro's exit-gate logits ([R, B, T]); for training and reference.

The KV cache is a `KVCache` whose layer axis is flattened over cache slots (`cache_slots`):
  ouro:  [loop 0 layers 0..L-1 | loop 1 ... | loop R-1]      (slot = loop * L + layer, as
         Ouro's own `UniversalTransformerCache` indexes it)
  raven: [prelude layers | core loop 0 | ... | core loop R-1 | coda at readout depth 1 | ...
          | coda at readout depth R]
A token at loop d attends to earlier tokens' loop-d K/V; a Raven readout at depth d attends to
earlier tokens' coda K/V of readout depth d.

Raven's initial state is deterministic: the noise of a token depends only on (seed, absolute
position): key = fold_in(key(seed), position), then a standard normal truncated to [-3, 3],
times `state_std * embed_scale` (the published `initialize_state`: trunc_normal(std,
a=-3 std, b=3 std) * emb_scale, with std = sqrt(2 / (5 * hidden))). So every decoding method,
batch row and depth schedule sees the same initial state for the same position and seed.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, ClassVar, Mapping

import jax
import jax.numpy as jnp
from flax import nnx

from models.config import ConfigError
from models.kv_cache import KVCache, NewKV
from models.llama import (MLP, Attention, AttentionFn, RMSNorm, _linear, apply_rope,
                          dot_product_attention, rope_cos_sin)

FAMILIES = ("ouro", "raven")
HF_MODEL_TYPES = {"ouro": "ouro", "huginn_raven": "raven"}


@dataclasses.dataclass(frozen=True)
class LoopedConfig:
    """Static shape of a looped model. Hashable, so it can be a jit static argument.

    family: "ouro" | "raven". num_loops: R, the full depth.
    ouro: num_layers = the shared stack run once per loop (prelude/core/coda must be 0).
    raven: prelude_layers, core_layers (the recurrent block), coda_layers (num_layers 0).
    embed_scale / state_std: 0 means the family's default (raven: sqrt(hidden) and
    sqrt(2 / (5 hidden)); ouro: 1 and unused). noise_seed: the default seed of Raven's initial
    state (see the module docstring).
    """

    SHAPE_FIELDS: ClassVar[tuple[str, ...]] = (
        "family", "vocab_size", "hidden_size", "intermediate_size", "num_heads", "num_kv_heads",
        "head_dim", "num_loops", "num_layers", "prelude_layers", "core_layers", "coda_layers",
        "rope_theta", "tie_word_embeddings", "qk_bias")

    family: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    num_loops: int
    num_layers: int = 0
    prelude_layers: int = 0
    core_layers: int = 0
    coda_layers: int = 0
    head_dim: int = 0  # 0: hidden_size // num_heads
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    qk_bias: bool = False  # raven: learned per-head biases added to q and k before RoPE
    embed_scale: float = 0.0
    state_std: float = 0.0
    noise_seed: int = 0
    max_position_embeddings: int = 4096
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    rope_scaling: None = None  # plain RoPE only (read by models.llama.rope_inv_freq)

    def __post_init__(self):
        if self.family not in FAMILIES:
            raise ConfigError(
                f"model config: family must be one of {FAMILIES}, got {self.family!r}")
        if self.head_dim == 0 and self.num_heads > 0:
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_heads)
        raven = self.family == "raven"
        if self.embed_scale == 0:
            scale = math.sqrt(self.hidden_size) if raven and self.hidden_size > 0 else 1.0
            object.__setattr__(self, "embed_scale", scale)
        if self.state_std == 0 and raven and self.hidden_size > 0:
            object.__setattr__(self, "state_std", math.sqrt(2 / (5 * self.hidden_size)))
        object.__setattr__(self, "eos_token_ids", tuple(int(e) for e in self.eos_token_ids))
        needed = ["vocab_size", "hidden_size", "intermediate_size", "num_heads", "num_kv_heads",
                  "head_dim", "num_loops", "num_layers" if not raven else "core_layers"]
        for name in needed:
            if getattr(self, name) <= 0:
                raise ConfigError(
                    f"model config: {name} must be positive, got {getattr(self, name)}")
        if raven:
            for name in ("prelude_layers", "coda_layers"):
                if getattr(self, name) < 0:
                    raise ConfigError(
                        f"model config: {name} must be >= 0, got {getattr(self, name)}")
            if self.num_layers:
                raise ConfigError("model config: raven uses prelude_layers/core_layers/coda_layers, "
                                  f"not num_layers (got num_layers={self.num_layers})")
            if self.qk_bias and self.num_kv_heads != self.num_heads:
                raise ConfigError(f"model config: raven qk_bias needs num_kv_heads == num_heads, "
                                  f"got {self.num_kv_heads} and {self.num_heads}")
        else:
            for name in ("prelude_layers", "core_layers", "coda_layers"):
                if getattr(self, name):
                    raise ConfigError(f"model config: ouro has no {name} (got "
                                      f"{getattr(self, name)}); num_layers is its shared stack")
            if self.qk_bias:
                raise ConfigError("model config: ouro has no qk_bias")
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(
                f"model config: num_heads ({self.num_heads}) must be a multiple of num_kv_heads "
                f"({self.num_kv_heads})")
        if self.head_dim % 2:
            raise ConfigError(f"model config: head_dim must be even for RoPE, got {self.head_dim}")
        if self.rope_scaling is not None:
            raise ConfigError("model config: looped models support plain RoPE only")

    # -- derived shape --------------------------------------------------------------------------
    @property
    def loop_layers(self) -> int:
        """Layers of the recurrent block (ouro: num_layers; raven: core_layers)."""
        return self.num_layers if self.family == "ouro" else self.core_layers

    @property
    def loop_slot0(self) -> int:
        """Cache slot of loop 0, layer 0 (after Raven's prelude slots)."""
        return self.prelude_layers

    @property
    def coda_slot0(self) -> int:
        """Cache slot of Raven's coda at readout depth 1, layer 0."""
        return self.prelude_layers + self.num_loops * self.loop_layers

    @property
    def cache_slots(self) -> int:
        """Layer axis of the KV cache: every (depth, layer) pair that has K/V."""
        return self.coda_slot0 + self.num_loops * self.coda_layers

    # -- Hugging Face ---------------------------------------------------------------------------
    @classmethod
    def from_hf(cls, hf: Mapping[str, Any]) -> "LoopedConfig":
        """Builds a config from a Hugging Face `config.json` dict: Ouro (`model_type` "ouro",
        OuroConfig fields, `total_ut_steps` loops) or Huginn/Raven (`model_type` "huginn_raven",
        RavenConfig fields: n_embd, n_heads, n_layers_in_prelude / _recurrent_block / _coda,
        mean_recurrence loops, rope_base, norm_eps, tie_embeddings, qk_bias)."""
        arch = hf.get("model_type")
        if arch not in HF_MODEL_TYPES:
            raise ConfigError(f"config.json: model_type {arch!r} is not a looped model "
                              f"(expected one of {sorted(HF_MODEL_TYPES)})")
        try:
            eos = hf.get("eos_token_id")
            if isinstance(eos, (list, tuple)):
                eos_ids = tuple(eos)
            else:
                eos_ids = (eos,) if eos is not None else ()
            common = dict(vocab_size=int(hf["vocab_size"]),
                          intermediate_size=int(hf["intermediate_size"]),
                          bos_token_id=hf.get("bos_token_id"),
                          eos_token_ids=tuple(int(e) for e in eos_ids))
            if arch == "ouro":
                return cls._from_hf_ouro(hf, common)
            return cls._from_hf_raven(hf, common)
        except KeyError as e:
            raise ConfigError(f"config.json: missing field {e.args[0]!r}") from None

    @classmethod
    def _from_hf_ouro(cls, hf: Mapping[str, Any], common: dict) -> "LoopedConfig":
        theta = hf.get("rope_theta", 10000.0)
        params = hf.get("rope_parameters") or {}  # transformers >= 5
        if params:
            theta = params.get("rope_theta", theta)
            if params.get("rope_type", "default") != "default":
                raise ConfigError(
                    f"config.json: unsupported rope scaling {params.get('rope_type')!r}")
        if hf.get("rope_scaling"):
            raise ConfigError(f"config.json: unsupported rope_scaling {hf['rope_scaling']!r}")
        if hf.get("hidden_act", "silu") != "silu":
            raise ConfigError(f"config.json: unsupported hidden_act {hf['hidden_act']!r}")
        max_pos = int(hf.get("max_position_embeddings", 4096))
        # Sliding-window layers equal full attention while the sequence fits in the window;
        # we implement full attention, so cap positions there (as for Mistral).
        if hf.get("use_sliding_window") or "sliding_attention" in (hf.get("layer_types") or ()):
            max_pos = min(max_pos, int(hf.get("sliding_window") or max_pos))
        heads = int(hf["num_attention_heads"])
        return cls(
            family="ouro", hidden_size=int(hf["hidden_size"]), num_heads=heads,
            num_kv_heads=int(hf.get("num_key_value_heads") or heads),
            head_dim=int(hf.get("head_dim") or 0), num_layers=int(hf["num_hidden_layers"]),
            num_loops=int(hf.get("total_ut_steps", 4)), rope_theta=float(theta),
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            max_position_embeddings=max_pos, **common)

    @classmethod
    def _from_hf_raven(cls, hf: Mapping[str, Any], common: dict) -> "LoopedConfig":
        def get(*names, default=None):
            for n in names:
                if n in hf:
                    return hf[n]
            if default is None:
                raise KeyError(names[0])
            return default

        if get("bias", default=False):
            raise ConfigError("config.json: raven with bias=true (adapter bias) is not supported")
        if get("injection_type", default="linear") != "linear":
            raise ConfigError(f"config.json: unsupported injection_type {hf['injection_type']!r}")
        for field, want in (("block_class_name", "SandwichBlock"), ("mlp_class_name", "GatedMLP"),
                            ("nonlin_name", "SiLU")):
            if get(field, default=want) != want:
                raise ConfigError(
                    f"config.json: unsupported {field} {hf[field]!r} (expected {want!r})")
        hidden = int(get("n_embd", "hidden_size"))
        heads = int(get("n_heads", "num_attention_heads"))
        return cls(
            family="raven", hidden_size=hidden, num_heads=heads,
            num_kv_heads=int(get("num_key_value_heads", default=heads)),
            prelude_layers=int(get("n_layers_in_prelude", default=2)),
            core_layers=int(get("n_layers_in_recurrent_block", default=4)),
            coda_layers=int(get("n_layers_in_coda", default=2)),
            num_loops=int(get("mean_recurrence", default=32)),
            rope_theta=float(get("rope_base", default=50000.0)),
            rms_norm_eps=float(get("norm_eps", default=1e-6)),
            tie_word_embeddings=bool(get("tie_embeddings", "tie_word_embeddings", default=True)),
            qk_bias=bool(get("qk_bias", default=True)),
            max_position_embeddings=int(get("block_size", "max_position_embeddings", default=4096)),
            **common)


# ---- layers ---------------------------------------------------------------------------------

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


def _rope_inv_freq(cfg: LoopedConfig) -> jax.Array:
    d = cfg.head_dim
    return 1.0 / (cfg.rope_theta ** (jnp.arange(0, d, 2, dtype=jnp.float32) / d))


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


class RavenAttention(nnx.Module):
    """Fused q/k/v projection `Wqkv`, optional `qk_bias` [2,1,H,D] added before interleaved
    RoPE, output projection `proj` (HF `CausalSelfAttention`)."""

    def __init__(self, cfg: LoopedConfig, *, dtype, rngs: nnx.Rngs):
        h, hkv, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = h, hkv, d
        self.Wqkv = _linear(cfg.hidden_size, (h + 2 * hkv) * d, dtype, rngs)
        self.qk_bias = (nnx.Param(nnx.initializers.normal(0.02)(rngs.params(), (2, 1, h, d), dtype))
                        if cfg.qk_bias else None)
        self.proj = _linear(h * d, cfg.hidden_size, dtype, rngs)

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
        keys, values = k, v
        if cached_k is not None:
            keys = jnp.concatenate([cached_k.astype(k.dtype), k], axis=1)
            values = jnp.concatenate([cached_v.astype(v.dtype), v], axis=1)
        out = attention_fn(q, keys, values, mask)
        return self.proj(out.reshape(b, t, -1)), (k, v)


class GatedMLP(nnx.Module):
    """One fused `fc` (hidden -> 2 * intermediate: [gate | up]), silu(gate) * up, `proj`."""

    def __init__(self, cfg: LoopedConfig, *, dtype, rngs: nnx.Rngs):
        self.fc = _linear(cfg.hidden_size, 2 * cfg.intermediate_size, dtype, rngs)
        self.proj = _linear(cfg.intermediate_size, cfg.hidden_size, dtype, rngs)

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


# ---- masks and cache helpers ----------------------------------------------------------------

def causal_mask_new(batch: int, t: int) -> jax.Array:
    """[B,T,T] causal mask among T new tokens (no cache)."""
    return jnp.broadcast_to(jnp.tril(jnp.ones((t, t), bool))[None], (batch, t, t))


def _cached(cache: KVCache | None, slot) -> tuple[jax.Array | None, jax.Array | None]:
    """K/V [B,S,Hkv,D] of one cache slot (slot may be traced)."""
    if cache is None:
        return None, None
    if isinstance(slot, int):
        return cache.k[slot], cache.v[slot]
    return (jax.lax.dynamic_index_in_dim(cache.k, slot, 0, keepdims=False),
            jax.lax.dynamic_index_in_dim(cache.v, slot, 0, keepdims=False))


def write_slots(cache: KVCache, new: NewKV, first_slot: jax.Array, src: jax.Array,
                dst: jax.Array) -> KVCache:
    """Copies the K/V of new token src[b, i] (all n layers of `new`, [n, B, T, Hkv, D]) into
    cache slots first_slot[b, i] + 0..n-1 at position dst[b, i]; a dst >= S is dropped.

    first_slot, src, dst: [B, m] int32. `length` is unchanged (as `KVCache.write`).
    """
    n = new.k.shape[0]
    b = jnp.broadcast_to(jnp.arange(src.shape[0])[:, None], src.shape)
    slots = first_slot[None] + jnp.arange(n)[:, None, None]  # [n, B, m]
    k = cache.k.at[slots, b[None], dst[None]].set(new.k[:, b, src], mode="drop")
    v = cache.v.at[slots, b[None], dst[None]].set(new.v[:, b, src], mode="drop")
    return cache.replace(k=k, v=v)


# ---- the model ------------------------------------------------------------------------------

class LoopedLM(nnx.Module):
    """A looped causal LM (Ouro or Raven). Parameter names follow the published modeling code
    (Ouro: `OuroForCausalLM` without the `model.` prefix; Raven: `RavenForCausalLM` without
    the `transformer.` prefix)."""

    def __init__(self, cfg: LoopedConfig, *, dtype=jnp.float32, rngs: nnx.Rngs):
        self.config = cfg
        self.dtype = dtype
        e = cfg.hidden_size
        embed = lambda: nnx.Embed(  # noqa: E731
            cfg.vocab_size, e, dtype=dtype, param_dtype=dtype, rngs=rngs,
            embedding_init=nnx.initializers.normal(0.02))
        if cfg.family == "ouro":
            self.embed_tokens = embed()
            self.layers = nnx.List([OuroLayer(cfg, dtype=dtype, rngs=rngs)
                                    for _ in range(cfg.num_layers)])
            self.norm = RMSNorm(e, cfg.rms_norm_eps, dtype=dtype)
            self.early_exit_gate = nnx.Linear(e, 1, use_bias=True, dtype=dtype, param_dtype=dtype,
                                              rngs=rngs, kernel_init=nnx.initializers.normal(0.02))
        else:
            self.wte = embed()
            block = lambda: SandwichBlock(cfg, dtype=dtype, rngs=rngs)  # noqa: E731
            self.prelude = nnx.List([block() for _ in range(cfg.prelude_layers)])
            self.adapter = _linear(2 * e, e, dtype, rngs)
            self.core_block = nnx.List([block() for _ in range(cfg.core_layers)])
            self.coda = nnx.List([block() for _ in range(cfg.coda_layers)])
            self.ln_f = RMSNorm(e, cfg.rms_norm_eps, dtype=dtype)
        self.lm_head = None if cfg.tie_word_embeddings else _linear(e, cfg.vocab_size, dtype, rngs)

    # -- small pieces ---------------------------------------------------------------------------
    @property
    def _ouro(self) -> bool:
        return self.config.family == "ouro"

    def _rope(self, positions):
        inv = _rope_inv_freq(self.config)
        if self._ouro:
            return rope_cos_sin(positions, inv)
        return rope_cos_sin_interleaved(positions, inv)

    def _head(self, x: jax.Array) -> jax.Array:
        if self.lm_head is None:
            table = self.embed_tokens if self._ouro else self.wte
            return table.attend(x).astype(jnp.float32)
        return self.lm_head(x).astype(jnp.float32)

    @property
    def _block(self) -> nnx.List:
        return self.layers if self._ouro else self.core_block

    def init_cache(self, batch: int, max_len: int, dtype=None) -> KVCache:
        """An empty cache with one layer slot per (depth, layer) (`LoopedConfig.cache_slots`)."""
        cfg = self.config
        return KVCache.init(cfg.cache_slots, batch, max_len, cfg.num_kv_heads, cfg.head_dim,
                            dtype or self.dtype)

    def loop_slot(self, depth: jax.Array) -> jax.Array:
        """Cache slot of layer 0 of loop `depth` (the loop that takes a token from depth d to
        d + 1); layer l is at + l."""
        cfg = self.config
        return cfg.loop_slot0 + depth * cfg.loop_layers

    def coda_slot(self, depth: jax.Array) -> jax.Array:
        """Raven: cache slot of coda layer 0 for a readout at depth 1..R; layer j is at + j."""
        cfg = self.config
        return cfg.coda_slot0 + (depth - 1) * cfg.coda_layers

    def _stack(self, blocks, x, cos, sin, mask, cache, slot0, depth, attention_fn,
               depth_slot0: int = 0, depth_stride: int = 0):
        """Runs `blocks` over x. depth None: layer l reads cache slot slot0 + l (int or traced)
        for all tokens. depth [B,T] (0..R-1): layer l of token (b,t) reads slot
        depth_slot0 + depth[b,t] * depth_stride + l; the cache part of `mask` ([B,T,S]) then
        refers to each query's own slots (all R depths' slots are read side by side, masked),
        and new tokens see each other only at equal depth. Returns x and NewKV
        [len(blocks), B, T, Hkv, D] (None without blocks)."""
        ks, vs = [], []
        n_depths = None
        if depth is not None:
            b, t = depth.shape
            same = depth[:, :, None] == depth[:, None, :]
            if cache is None:
                mask = mask & same
            else:
                s = cache.max_len
                n_depths = self.config.num_loops
                # every depth's slots side by side: [B, R*S]; a query sees its own depth's only
                own = depth[:, :, None] == jnp.arange(n_depths)[None, None, :]  # [B,T,R]
                old = (mask[:, :, None, :s] & own[..., None]).reshape(b, t, n_depths * s)
                mask = jnp.concatenate([old, mask[:, :, s:] & same], axis=-1)
        for i, blk in enumerate(blocks):
            if cache is None:
                ck = cv = None
            elif n_depths is None:
                ck, cv = _cached(cache, slot0 + i)
            else:
                idx = depth_slot0 + jnp.arange(n_depths) * depth_stride + i
                ck = jnp.moveaxis(cache.k[idx], 0, 1).reshape(cache.batch, -1, *cache.k.shape[3:])
                cv = jnp.moveaxis(cache.v[idx], 0, 1).reshape(cache.batch, -1, *cache.v.shape[3:])
            x, (k, v) = blk(x, cos, sin, mask, ck, cv, attention_fn)
            ks.append(k)
            vs.append(v)
        if not ks:
            return x, None
        return x, NewKV(jnp.stack(ks), jnp.stack(vs))

    # -- LoopSpec pieces ------------------------------------------------------------------------
    def embed(self, tokens: jax.Array, positions: jax.Array, mask: jax.Array | None = None,
              cache: KVCache | None = None,
              attention_fn: AttentionFn = dot_product_attention) -> tuple[jax.Array, NewKV | None]:
        """Prelude P. tokens, positions [B,T]; mask [B,T,S+T] (None: causal, no cache).
        Returns e [B,T,E] (ouro: the embeddings; raven: the prelude's output) and the prelude's
        K/V [prelude_layers, B,T,Hkv,D] (raven; None for ouro or no prelude layers)."""
        if self._ouro:
            return self.embed_tokens(tokens), None
        mask = causal_mask_new(*tokens.shape) if mask is None else mask
        x = self.wte(tokens) * jnp.asarray(self.config.embed_scale, self.dtype)
        cos, sin = self._rope(positions)
        return self._stack(self.prelude, x, cos, sin, mask, cache, 0, None, attention_fn)

    def initial_state(self, e: jax.Array, positions: jax.Array, seed: int | jax.Array | None = None
                      ) -> jax.Array:
        """The state at depth 0, [B,T,E]. ouro: e itself. raven: truncated-normal noise that is
        a function of (seed, absolute position) only (seed None: config.noise_seed)."""
        if self._ouro:
            return e
        cfg = self.config
        seed = cfg.noise_seed if seed is None else seed
        base = jax.random.key(seed)
        keys = jax.vmap(lambda p: jax.random.fold_in(base, p))(positions.reshape(-1))
        noise = jax.vmap(lambda k: jax.random.truncated_normal(k, -3.0, 3.0, (cfg.hidden_size,),
                                                               jnp.float32))(keys)
        noise = noise.reshape(*positions.shape, cfg.hidden_size) * (cfg.state_std * cfg.embed_scale)
        return noise.astype(e.dtype)

    def advance(self, h: jax.Array, e: jax.Array, depth: int | jax.Array, positions: jax.Array,
                mask: jax.Array | None = None, cache: KVCache | None = None,
                attention_fn: AttentionFn = dot_product_attention) -> tuple[jax.Array, NewKV]:
        """Recurrent block B: every token one loop deeper, from its own depth d to d + 1.

        h [B,T,E] the state at depth d; e [B,T,E] from `embed`; depth: one int (traced or not)
        for all tokens, or [B,T] int32 per token (each < R); positions [B,T]; mask [B,T,S+T]
        (None: causal, no cache): the cache part refers to slots of each query's own loop d,
        and with per-token depths new tokens see each other only where their depths are equal.
        Returns the state at d + 1 and the loop's K/V [loop_layers, B,T,Hkv,D] (commit it with
        `write_loop_kv`). Cost: one depth for all tokens reads that loop's cache slots; a
        per-token depth array reads all R loops' slots of each layer side by side, masked.
        """
        mask = causal_mask_new(*positions.shape) if mask is None else mask
        cos, sin = self._rope(positions)
        per_token = jnp.ndim(depth) > 0
        x = h if self._ouro else self.adapter(jnp.concatenate([h, e.astype(h.dtype)], axis=-1))
        slot0 = None if per_token else self.loop_slot(depth)
        x, kv = self._stack(self._block, x, cos, sin, mask, cache, slot0,
                            jnp.asarray(depth, jnp.int32) if per_token else None, attention_fn,
                            self.config.loop_slot0, self.config.loop_layers)
        if self._ouro:
            x = self.norm(x)
        return x, kv

    def readout(self, h: jax.Array, depth: int | jax.Array, positions: jax.Array,
                mask: jax.Array | None = None, cache: KVCache | None = None,
                attention_fn: AttentionFn = dot_product_attention,
                logits_at: jax.Array | None = None) -> tuple[jax.Array, NewKV | None]:
        """Readout C at each token's depth (1..R; one int or [B,T]). ouro: lm_head(h); raven:
        lm_head(ln_f(coda(ln_f(h)))), the coda attending to the readout depth's coda slots
        (mask as in `advance`). logits_at: optional [B,N] token indices to read out.
        Returns logits [B,T,V] (or [B,N,V]) float32 and the coda's K/V (raven with coda layers;
        None otherwise; commit it with `write_coda_kv`)."""
        kv = None
        if self._ouro:
            x = h
        else:
            mask = causal_mask_new(*positions.shape) if mask is None else mask
            cos, sin = self._rope(positions)
            per_token = jnp.ndim(depth) > 0
            d = jnp.asarray(depth, jnp.int32) - 1 if per_token else None
            x, kv = self._stack(self.coda, self.ln_f(h), cos, sin, mask, cache,
                                None if per_token else self.coda_slot(depth), d, attention_fn,
                                self.config.coda_slot0, self.config.coda_layers)
            x = self.ln_f(x)
        if logits_at is not None:
            x = jnp.take_along_axis(x, logits_at[..., None], axis=1)
        return self._head(x), kv

    def exit_gate(self, h: jax.Array) -> jax.Array | None:
        """Ouro's early-exit gate logit of a state, [B,T] float32 (sigmoid: the exit
        probability of that loop); None for raven."""
        if not self._ouro:
            return None
        return self.early_exit_gate(h)[..., 0].astype(jnp.float32)

    def write_loop_kv(self, cache: KVCache, new: NewKV, depth: jax.Array, src: jax.Array,
                      dst: jax.Array) -> KVCache:
        """Commits `advance`'s K/V: new token src[b,i] (which was advanced from depth[b,i]) into
        its loop's slots at position dst[b,i]. depth, src, dst: [B,m] int32."""
        return write_slots(cache, new, self.loop_slot(depth), src, dst)

    def write_coda_kv(self, cache: KVCache, new: NewKV, depth: jax.Array, src: jax.Array,
                      dst: jax.Array) -> KVCache:
        """Commits `readout`'s coda K/V (raven): token src[b,i] read out at depth[b,i] (1..R)."""
        return write_slots(cache, new, self.coda_slot(depth), src, dst)

    def write_prelude_kv(self, cache: KVCache, new: NewKV, src: jax.Array, dst: jax.Array
                         ) -> KVCache:
        """Commits `embed`'s prelude K/V (raven) at position dst[b,i]."""
        return write_slots(cache, new, jnp.zeros_like(src), src, dst)

    # -- whole depth ----------------------------------------------------------------------------
    def forward_all_depths(self, tokens: jax.Array, positions: jax.Array,
                           mask: jax.Array | None = None, cache: KVCache | None = None,
                           attention_fn: AttentionFn = dot_product_attention,
                           seed: int | jax.Array | None = None
                           ) -> tuple[jax.Array, jax.Array | None, NewKV]:
        """Every token through all R loops, read out after each loop.

        tokens, positions [B,T]; mask [B,T,S+T] over [cache slots | new tokens], the same at
        every depth (None: causal, no cache). Returns logits [R,B,T,V] float32, Ouro's
        exit-gate logits [R,B,T] float32 (None for raven) and the K/V of every cache slot,
        [cache_slots, B,T,Hkv,D] (Raven's coda at every readout depth included), to commit
        with `KVCache.write` / `append`.
        """
        mask = causal_mask_new(*tokens.shape) if mask is None else mask
        e, pre_kv = self.embed(tokens, positions, mask, cache, attention_fn)
        h = self.initial_state(e, positions, seed)
        logits, gates, loop_kv, coda_kv = [], [], [], []
        for r in range(self.config.num_loops):
            h, kv = self.advance(h, e, r, positions, mask, cache, attention_fn)
            loop_kv.append(kv)
            lg, ckv = self.readout(h, r + 1, positions, mask, cache, attention_fn)
            logits.append(lg)
            gates.append(self.exit_gate(h))
            if ckv is not None:
                coda_kv.append(ckv)
        kvs = ([pre_kv] if pre_kv is not None else []) + loop_kv + coda_kv
        new = NewKV(jnp.concatenate([kv.k for kv in kvs]), jnp.concatenate([kv.v for kv in kvs]))
        return jnp.stack(logits), (jnp.stack(gates) if self._ouro else None), new

    def loop_logits(self, tokens: jax.Array, positions: jax.Array,
                    seed: int | jax.Array | None = None) -> tuple[jax.Array, jax.Array | None]:
        """No cache, causal among the T tokens: the readout after each loop 1..R.

        tokens, positions: [B,T] int32. seed: Raven's initial-state seed (None:
        config.noise_seed). Returns logits [R,B,T,V] float32 and Ouro's exit-gate logits
        [R,B,T] float32 (None for raven).
        """
        logits, gates, _ = self.forward_all_depths(tokens, positions, seed=seed)
        return logits, gates

    def __call__(self, tokens: jax.Array, positions: jax.Array, mask: jax.Array,
                 cache: KVCache | None = None,
                 attention_fn: AttentionFn = dot_product_attention,
                 logits_at: jax.Array | None = None, seed: int | jax.Array | None = None
                 ) -> tuple[jax.Array, NewKV]:
        """All R loops and the full-depth readout, as `Llama.__call__`.

        tokens, positions [B,T]; mask [B,T,S+T] over [cache slots | new tokens], the same for
        every depth; logits_at optional [B,N]. Returns logits [B,T,V] (or [B,N,V]) float32 and
        K/V for every cache slot, [cache_slots, B,T,Hkv,D] (Raven's coda slots of readout
        depths below R are zeros: this call reads out at full depth only).
        """
        cfg = self.config
        s = 0 if cache is None else cache.max_len
        if mask.shape != (*tokens.shape, s + tokens.shape[1]):
            raise ValueError(f"mask shape {mask.shape} != {(*tokens.shape, s + tokens.shape[1])}")
        e, pre_kv = self.embed(tokens, positions, mask, cache, attention_fn)
        h = self.initial_state(e, positions, seed)

        def one_loop(h, r):
            return self.advance(h, e, r, positions, mask, cache, attention_fn)

        h, loop_kv = jax.lax.scan(one_loop, h, jnp.arange(cfg.num_loops, dtype=jnp.int32))
        logits, coda_kv = self.readout(h, cfg.num_loops, positions, mask, cache, attention_fn,
                                       logits_at)
        flat = lambda a: a.reshape(-1, *a.shape[2:])  # noqa: E731  [R, L, ...] -> [R*L, ...]
        ks, vs = [flat(loop_kv.k)], [flat(loop_kv.v)]
        if pre_kv is not None:
            ks.insert(0, pre_kv.k)
            vs.insert(0, pre_kv.v)
        if coda_kv is not None:
            pad = jnp.zeros(((cfg.num_loops - 1) * cfg.coda_layers, *coda_kv.k.shape[1:]),
                            coda_kv.k.dtype)
            ks += [pad, coda_kv.k]
            vs += [pad, coda_kv.v]
        return logits, NewKV(jnp.concatenate(ks), jnp.concatenate(vs))
