"""The lookahead drafter (LAD): a small causal transformer over a looped model's early-loop
states that drafts K future tokens in one pass.

Input at position t: the frozen model's state of token t at loop `draft_depth`, projected to the
drafter's width, plus the embedding of the anchor a_t (the model's native proposal for token
t + 1, the argmax of its readout at that depth). Output at t: K distributions over the draft
vocabulary for tokens t + 2 .. t + K + 1 (the K tokens after the anchor). Causal, so one pass
over a sequence trains (or drafts at) every position.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from models.config import LlamaConfig
from models.llama import DecoderLayer, RMSNorm, dot_product_attention, rope_cos_sin, rope_inv_freq


@dataclasses.dataclass(frozen=True)
class DrafterShape:
    state_size: int  # the looped model's hidden size
    vocab_size: int  # the looped model's vocabulary (anchors)
    hidden_size: int
    num_layers: int
    num_heads: int
    K: int
    draft_vocab: int

    def block_config(self) -> LlamaConfig:
        return LlamaConfig(vocab_size=self.draft_vocab, hidden_size=self.hidden_size,
                           intermediate_size=int(self.hidden_size * 8 / 3) // 8 * 8,
                           num_layers=self.num_layers, num_heads=self.num_heads,
                           num_kv_heads=self.num_heads, eos_token_ids=())


class LookaheadDrafter(nnx.Module):
    def __init__(self, shape: DrafterShape, *, rngs: nnx.Rngs, dtype=jnp.float32):
        self.shape = shape
        blk = shape.block_config()
        self.block_cfg = blk
        self.state_proj = nnx.Linear(shape.state_size, shape.hidden_size, dtype=dtype,
                                     param_dtype=dtype, rngs=rngs)
        self.state_norm = RMSNorm(shape.state_size, 1e-6, dtype=dtype)
        self.anchor_embed = nnx.Embed(shape.vocab_size, shape.hidden_size, dtype=dtype,
                                      param_dtype=dtype, rngs=rngs,
                                      embedding_init=nnx.initializers.normal(0.02))
        self.layers = nnx.List([DecoderLayer(blk, dtype=dtype, rngs=rngs)
                                for _ in range(shape.num_layers)])
        self.norm = RMSNorm(shape.hidden_size, 1e-6, dtype=dtype)
        self.heads = nnx.Linear(shape.hidden_size, shape.K * shape.draft_vocab, dtype=dtype,
                                param_dtype=dtype, rngs=rngs)

    def __call__(self, states: jax.Array, anchors: jax.Array, positions: jax.Array,
                 mask: jax.Array) -> jax.Array:
        """states [B,T,E_model]; anchors, positions [B,T] int32; mask [B,T,T] bool (causal).
        Returns logits [B,T,K,Vd] float32: token t + 1 + k (k = 1..K) over the draft vocab."""
        x = self.state_proj(self.state_norm(states)) + self.anchor_embed(anchors)
        cos, sin = rope_cos_sin(positions, rope_inv_freq(self.block_cfg))
        for layer in self.layers:
            x, _ = layer(x, cos, sin, mask, None, None, dot_product_attention)
        b, t, _ = x.shape
        logits = self.heads(self.norm(x)).astype(jnp.float32)
        return logits.reshape(b, t, self.shape.K, self.shape.draft_vocab)
