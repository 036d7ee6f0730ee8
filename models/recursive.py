"""A recursive Llama: a Llama-family decoder whose middle layers are one shared block of
pre-norm Llama layers run R times (the "recursive transformer" built from a pretrained model,
as in Bae et al. 2024, Relaxed Recursive Transformers, without the per-loop LoRA).

In LoopSpec's terms: P = the token embedding followed by `prelude_layers` Llama layers, giving
e; the state starts as e itself (the residual stream: no adapter, no noise); B = the
`core_layers` layers of `core_block`, the state after a loop being their output; C = the
`coda_layers` layers of `coda`, the final `norm` and the head (tied to the embedding or
`lm_head`). With R = 1 and the block holding a Llama's middle layers, it is that Llama.

Like Raven, the coda runs at every readout depth with its own K/V, so the KV cache holds
[prelude | core loop 0 .. R-1 | coda at readout depth 1 .. R] (`models.looped`).

Parameter names follow `LlamaForCausalLM`'s with the layer groups named as in Raven:
`embed_tokens`, `prelude.{i}`, `core_block.{i}`, `coda.{i}`, `norm`, `lm_head`.
"""

from __future__ import annotations

import jax
from flax import nnx

from models.config import LlamaConfig, LoopedConfig
from models.kv_cache import KVCache, NewKV
from models.layers import (AttentionFn, RMSNorm, dot_product_attention, embedding, rope_cos_sin,
                           rope_inv_freq)
from models.llama import DecoderLayer
from models.looped import LoopedLM, default_mask


def layer_config(cfg: LoopedConfig) -> LlamaConfig:
    """The Llama config every layer of a recursive model is built from (the layer count is
    the model's distinct layers, prelude + core + coda)."""
    return LlamaConfig(
        vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_layers=cfg.prelude_layers + cfg.core_layers + cfg.coda_layers,
        num_heads=cfg.num_heads, num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim,
        rope_theta=cfg.rope_theta, rms_norm_eps=cfg.rms_norm_eps,
        tie_word_embeddings=cfg.tie_word_embeddings,
        max_position_embeddings=cfg.max_position_embeddings, bos_token_id=cfg.bos_token_id,
        eos_token_ids=cfg.eos_token_ids)


class RecursiveLM(LoopedLM):
    """Recursive Llama: `embed_tokens`, `prelude`, `core_block` (the loop), `coda`, `norm`,
    `lm_head`."""

    family = "recursive"

    def build_layers(self, cfg: LoopedConfig, dtype, rngs: nnx.Rngs) -> None:
        lcfg = layer_config(cfg)
        self.embed_tokens = embedding(cfg, dtype, rngs)
        block = lambda: DecoderLayer(lcfg, dtype=dtype, rngs=rngs)  # noqa: E731
        self.prelude = nnx.List([block() for _ in range(cfg.prelude_layers)])
        self.core_block = nnx.List([block() for _ in range(cfg.core_layers)])
        self.coda = nnx.List([block() for _ in range(cfg.coda_layers)])
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype)

    @property
    def token_embed(self) -> nnx.Embed:
        return self.embed_tokens

    @property
    def loop_block(self) -> nnx.List:
        return self.core_block

    def rope(self, positions: jax.Array) -> tuple[jax.Array, jax.Array]:
        return rope_cos_sin(positions, rope_inv_freq(self.config))

    def embed(self, tokens: jax.Array, positions: jax.Array, mask: jax.Array | None = None,
              cache: KVCache | None = None,
              attention_fn: AttentionFn = dot_product_attention) -> tuple[jax.Array, NewKV | None]:
        """Prelude P: the embedding through the prelude layers; returns e [B,T,E] and the
        prelude's K/V (None without prelude layers)."""
        mask = default_mask(mask, positions)
        cos, sin = self.rope(positions)
        return self._stack(self.prelude, self.embed_tokens(tokens), cos, sin, mask, cache, 0,
                           None, attention_fn)

    def readout_state(self, h, depth, positions, mask, cache, attention_fn):
        """norm(coda(h)), the coda attending to the readout depth's coda slots (depth 1..R,
        one int or [B,T]); returns it and the coda's K/V (None without coda layers)."""
        x, kv = self.run_coda(self.coda, h, depth, positions, mask, cache, attention_fn)
        return self.norm(x), kv


def from_llama(llama, cfg: LoopedConfig, core_from: int | None = None) -> RecursiveLM:
    """A recursive model `cfg` whose embedding, prelude, coda and final norm are `llama`'s
    (its first prelude_layers layers and its last coda_layers) and whose block is a copy of
    llama's layers core_from .. core_from + core_layers - 1 (default: right after the prelude).
    Parameters are shared with `llama` only where they are the same arrays (no copies made)."""
    lc = llama.config
    if (lc.hidden_size, lc.intermediate_size, lc.num_heads, lc.num_kv_heads, lc.head_dim,
            lc.vocab_size, lc.tie_word_embeddings) != (
            cfg.hidden_size, cfg.intermediate_size, cfg.num_heads, cfg.num_kv_heads,
            cfg.head_dim, cfg.vocab_size, cfg.tie_word_embeddings):
        raise ValueError("from_llama: the Llama's shape differs from the recursive config's")
    n = lc.num_layers
    core_from = cfg.prelude_layers if core_from is None else core_from
    if cfg.prelude_layers + cfg.coda_layers > n or core_from + cfg.core_layers > n:
        raise ValueError(f"from_llama: a {n}-layer Llama has no layers "
                         f"{cfg.prelude_layers} + {cfg.coda_layers} (prelude + coda) or "
                         f"{core_from}..{core_from + cfg.core_layers - 1} (block)")
    model = nnx.eval_shape(lambda: RecursiveLM(cfg, dtype=llama.dtype, rngs=nnx.Rngs(0)))
    groups = (("prelude", range(cfg.prelude_layers)),
              ("core_block", range(core_from, core_from + cfg.core_layers)),
              ("coda", range(n - cfg.coda_layers, n)))
    for group, src in groups:
        for i, j in enumerate(src):
            nnx.update(getattr(model, group)[i], nnx.state(llama.layers[j]))
    nnx.update(model.embed_tokens, nnx.state(llama.embed_tokens))
    nnx.update(model.norm, nnx.state(llama.norm))
    if not cfg.tie_word_embeddings:
        nnx.update(model.lm_head, nnx.state(llama.lm_head))
    return model
