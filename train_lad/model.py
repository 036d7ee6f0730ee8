"""The lookahead drafter (LAD): a small causal transformer over a looped model's early-loop
states that drafts K future tokens in one pass.

Input at position t: the frozen model's state of token t at loop `draft_depth`, projected to the
drafter's width, plus the embedding of the anchor a_t (the model's native proposal for token
t + 1, the argmax of its readout at that depth). Output at t: K distributions over the draft
vocabulary for tokens t + 2 .. t + K + 1 (the K tokens after the anchor). Causal, so one pass
over a sequence trains (or drafts at) every position.

Two output heads (`DrafterShape.head`):

- "vocab": a trained matrix with one column per draft-vocabulary token. It has no logit for
  any other token, so the draft vocabulary is fixed at training.
- "model": per k, a vector in the looped model's hidden space, scored against the frozen
  model's own output embedding (`output_embedding`: its lm_head, or its tied token embedding)
  at the columns of the tokens asked for. Every token id then has a meaningful logit (the
  output embedding was trained over the whole vocabulary), so at inference the draft
  vocabulary can take in the prompt's tokens, EOS and the committed outputs; training scores
  the draft vocabulary's columns only.
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
    head: str = "vocab"  # "vocab" | "model" (see the module docstring)

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
        width = shape.draft_vocab if shape.head == "vocab" else shape.state_size
        self.heads = nnx.Linear(shape.hidden_size, shape.K * width, dtype=dtype,
                                param_dtype=dtype, rngs=rngs)

    def features(self, states: jax.Array, anchors: jax.Array, positions: jax.Array,
                 mask: jax.Array, last_only: bool = False) -> jax.Array:
        """states [B,T,E_model]; anchors, positions [B,T] int32; mask [B,T,T] bool (causal).
        Returns [B,T,K,F] float32 for tokens t + 1 + k (k = 1..K): head "vocab", the logits
        over the draft vocabulary (F = Vd); head "model", vectors to score against the looped
        model's output embedding (F = E_model). last_only: the last position's alone
        ([B,1,K,F], the same values): the last layer then computes only the other positions'
        K/V, not their queries, attention outputs and MLP (decoding drafts at one position)."""
        x = self.state_proj(self.state_norm(states)) + self.anchor_embed(anchors)
        cos, sin = rope_cos_sin(positions, rope_inv_freq(self.block_cfg))
        n_full = len(self.layers) - 1 if last_only else len(self.layers)
        for layer in list(self.layers)[:n_full]:
            x, _ = layer(x, cos, sin, mask, None, None, dot_product_attention)
        if last_only:
            last = self.layers[n_full]
            k, v = last.self_attn.key_value(last.input_layernorm(x[:, :-1]), cos[:, :-1],
                                            sin[:, :-1])
            x, _ = last(x[:, -1:], cos[:, -1:], sin[:, -1:], mask[:, -1:], k, v,
                        dot_product_attention)
        b, t, _ = x.shape
        return self.heads(self.norm(x)).astype(jnp.float32).reshape(b, t, self.shape.K, -1)

    def __call__(self, states: jax.Array, anchors: jax.Array, positions: jax.Array,
                 mask: jax.Array, out_emb: jax.Array | None = None) -> jax.Array:
        """As `features`; returns logits [B,T,K,Vd] float32 over the draft vocabulary. Head
        "model" needs out_emb [E_model, Vd]: the output embedding's draft-vocabulary columns."""
        f = self.features(states, anchors, positions, mask)
        if self.shape.head == "vocab":
            return f
        return jnp.einsum("btke,ev->btkv", f, out_emb.astype(jnp.float32))


def output_embedding(model) -> jax.Array:
    """A looped model's output embedding [E, V] float32 (the readout's logits are the last
    hidden state times it): its lm_head kernel, or with tied embeddings its token embedding
    (transposed), divided by its mean column norm, so that a head "model" drafter's scores
    start at a useful scale whatever the model's. Training and decoding both use this."""
    if model.lm_head is not None:
        w = model.lm_head.kernel.get_value()
    else:
        table = model.embed_tokens if model.config.family == "ouro" else model.wte
        w = table.embedding.get_value().T
    w = w.astype(jnp.float32)
    return w / jnp.maximum(jnp.linalg.norm(w, axis=0).mean(), 1e-12)
