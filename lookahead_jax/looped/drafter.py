"""The lookahead drafter (LAD): a small causal transformer over a looped model's early-loop
states that drafts K future tokens in one pass.

Input at position t: the frozen model's state of token t at loop `draft_depth`, projected to the
drafter's width, plus the embedding of the anchor a_t (the model's native proposal for token
t + 1, the argmax of its readout at that depth). Output at t: K distributions over the draft
vocabulary for tokens t + 2 .. t + K + 1 (the K tokens after the anchor). Causal, so one pass
over a sequence trains (or drafts at) every position.

Two ways to make the K drafts (`DrafterShape.arch`):

- "queries" (the LoopAhead paper's drafter): K future query positions follow the drafting
  position, each a learned query embedding at position t + 1 + k (k = 1..K); the causal
  transformer processes the context and the queries together, query k attending the context
  up to t and queries 1..k, and one output head reads each query's final state as the draft
  of token t + 1 + k. Training builds every position's K queries in one pass (a mask keeps
  each position's queries to their own context); decoding builds the last position's.
- "heads" (the ablation): K linear heads on the drafting position's own final state.

Two anchor embeddings (`DrafterShape.anchor`):

- "table": a trained table with one row per token of the model's vocabulary (vocab x width:
  12.6 M parameters for a 49,152-token vocabulary at width 256).
- "model": the anchor's column of the frozen model's output embedding (`output_embedding`),
  projected to the drafter's width by a trained matrix (model width x drafter width): the
  drafter file then holds no per-token table, and every token has an embedding the model
  learnt.

Two output heads (`DrafterShape.head`):

- "vocab": a trained matrix with one column per draft-vocabulary token. It has no logit for
  any other token, so the draft vocabulary is fixed at training.
- "model": per k, a vector in the looped model's hidden space, scored against the frozen
  model's own output embedding (`output_embedding`: its lm_head, or its tied token embedding)
  at the columns of the tokens asked for. Every token id then has a meaningful logit (the
  output embedding was trained over the whole vocabulary), so at inference the draft
  vocabulary can take in the prompt's tokens, EOS and the committed outputs; training scores
  the draft vocabulary's columns only.

A residual head (`DrafterShape.residual`, Raven's "R4-adapted residual head"): a drafter trained
on the states of one loop (the backbone) drafts from a deeper loop's states, whose tokens are
better guesses, by adding a small bottleneck MLP to its final (normalised) features before the
output head, `y + up(silu(down(y)))`, `up` starting at zero (so the head starts as the
backbone). `train_lad` trains the head alone on the deeper loop's states, the backbone frozen
(`--backbone`); the file then records both depths (`draft_depth`, the deeper one the drafter
now drafts at, and `backbone_depth`).

Calibration (sampling; `Calibration`): how often a drafted token is accepted when decoding
samples at temperature T, by its position k in the chain and the drafter's confidence in it
(the softmax probability of its argmax), measured on held-out data (`train_lad.calibrate`).
LoopAhead reads it to choose, at sampling time, whether to call the drafter and how many of
its tokens to keep (`LoopAhead.retain`).

The drafter file (`save_drafter_file` / `load_drafter_file`): one safetensors file that training
(`train_lad`) writes and decoding loads, with no optimizer or checkpointing library. Tensors: the
network's parameters by dotted path (`state_proj.kernel`, `layers.0.mlp.up_proj.kernel`, ...)
and `draft_vocab` (int32 ids in the looped model's vocabulary). Metadata (strings): `format`
(`lookahead_jax.drafter/1`), the network's shape (`state_size`, `vocab_size`, `hidden_size`,
`num_layers`, `num_heads`, `K`, `head`, `arch`, `anchor`, `residual`; a file without `arch`
holds a "heads" drafter, one without `anchor` a "table" one, one without `residual` no residual
head) and the looped model it drafts for (`model_family`, `model_loops`, and `draft_depth`: the
loop whose states feed it; with a residual head also `backbone_depth`, the loop the rest of the
network was trained on). Optional: `base_digest`, the `params_digest` of the looped model it was
trained on (decoding with another model warns, `check_drafter_model`; files written before it
have none), and the tensors `calibration` [T, K, bins] and `calibration_temperatures` [T], the
drafter's `Calibration`.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import warnings

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from safetensors import SafetensorError, safe_open
from safetensors.numpy import save_file

from models.config import ConfigError, LlamaConfig
from models.layers import RMSNorm, dot_product_attention, rope_cos_sin, rope_inv_freq
from models.llama import DecoderLayer


HEADS = ("vocab", "model")
ARCHS = ("heads", "queries")
ANCHORS = ("table", "model")


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
    arch: str = "heads"  # "heads" | "queries" (see the module docstring)
    anchor: str = "table"  # "table" | "model" (see the module docstring)
    residual: int = 0  # the residual head's bottleneck width (0: none; the module docstring)

    def __post_init__(self):
        if self.head not in HEADS:
            raise ConfigError(f"drafter head must be one of {', '.join(HEADS)}, got {self.head!r}")
        if self.arch not in ARCHS:
            raise ConfigError(f"drafter arch must be one of {', '.join(ARCHS)}, got {self.arch!r}")
        if self.anchor not in ANCHORS:
            raise ConfigError(f"drafter anchor must be one of {', '.join(ANCHORS)}, got "
                              f"{self.anchor!r}")
        if self.residual < 0:
            raise ConfigError(f"drafter residual must be >= 0 (0: no residual head), got "
                              f"{self.residual}")

    @property
    def needs_embedding(self) -> bool:
        """Whether the network reads the looped model's output embedding (head or anchor
        "model"): `features` and `__call__` then take it."""
        return self.head == "model" or self.anchor == "model"

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
        if shape.anchor == "table":
            self.anchor_embed = nnx.Embed(shape.vocab_size, shape.hidden_size, dtype=dtype,
                                          param_dtype=dtype, rngs=rngs,
                                          embedding_init=nnx.initializers.normal(0.02))
        else:  # "model": the anchor's column of the model's output embedding, projected
            self.anchor_proj = nnx.Linear(shape.state_size, shape.hidden_size, use_bias=False,
                                          dtype=dtype, param_dtype=dtype, rngs=rngs)
        self.layers = nnx.List([DecoderLayer(blk, dtype=dtype, rngs=rngs)
                                for _ in range(shape.num_layers)])
        self.norm = RMSNorm(shape.hidden_size, 1e-6, dtype=dtype)
        width = shape.draft_vocab if shape.head == "vocab" else shape.state_size
        if shape.arch == "heads":
            self.heads = nnx.Linear(shape.hidden_size, shape.K * width, dtype=dtype,
                                    param_dtype=dtype, rngs=rngs)
        else:  # "queries": the K future query positions' inputs, and one head for all
            self.query_embed = nnx.Param(
                nnx.initializers.normal(0.02)(rngs.params(), (shape.K, shape.hidden_size), dtype))
            self.query_head = nnx.Linear(shape.hidden_size, width, dtype=dtype,
                                         param_dtype=dtype, rngs=rngs)
        if shape.residual:  # the residual head; `up` starts at zero (the backbone's output)
            self.residual_down = nnx.Linear(shape.hidden_size, shape.residual, dtype=dtype,
                                            param_dtype=dtype, rngs=rngs)
            self.residual_up = nnx.Linear(shape.residual, shape.hidden_size, dtype=dtype,
                                          param_dtype=dtype, rngs=rngs,
                                          kernel_init=nnx.initializers.zeros)

    def final(self, x: jax.Array) -> jax.Array:
        """The last layer's output [..., H] -> the output head's input: normalised, plus the
        residual head's correction when there is one."""
        y = self.norm(x)
        if self.shape.residual:
            y = y + self.residual_up(jax.nn.silu(self.residual_down(y)))
        return y

    def embed_anchors(self, anchors: jax.Array, embedding: jax.Array | None) -> jax.Array:
        """anchors [B,T] -> [B,T,H]: the anchor table's rows, or (anchor "model") the anchors'
        columns of embedding [E_model, V] (`output_embedding`), projected."""
        if self.shape.anchor == "table":
            return self.anchor_embed(anchors)
        if embedding is None:
            raise ConfigError("a drafter with anchor 'model' needs the looped model's output "
                              "embedding")
        cols = jnp.take(embedding, anchors, axis=1)  # [E,B,T]
        return self.anchor_proj(jnp.moveaxis(cols, 0, -1).astype(self.anchor_proj.kernel.dtype))

    def features(self, states: jax.Array, anchors: jax.Array, positions: jax.Array,
                 mask: jax.Array, last_only: bool = False,
                 embedding: jax.Array | None = None) -> jax.Array:
        """states [B,T,E_model]; anchors, positions [B,T] int32; mask [B,T,T] bool (causal);
        embedding [E_model, V]: the looped model's `output_embedding` (anchor "model" only).
        Returns [B,T,K,F] float32 for tokens t + 1 + k (k = 1..K): head "vocab", the logits
        over the draft vocabulary (F = Vd); head "model", vectors to score against the looped
        model's output embedding (F = E_model). last_only: the last position's alone
        ([B,1,K,F], the same values): the last layer then computes only the other positions'
        K/V, not their queries, attention outputs and MLP (decoding drafts at one position)."""
        x = self.state_proj(self.state_norm(states)) + self.embed_anchors(anchors, embedding)
        if self.shape.arch == "queries":
            return self._query_features(x, positions, mask, last_only)
        cos, sin = rope_cos_sin(positions, rope_inv_freq(self.block_cfg))
        n_full = len(self.layers) - 1 if last_only else len(self.layers)
        for layer in list(self.layers)[:n_full]:
            x, _ = layer(x, cos, sin, mask, None, None, dot_product_attention)
        if last_only:
            last = self.layers[n_full]
            k, v = last.self_attn.key_value(last.input_layernorm(x[:, :-1]), cos[:, :-1],
                                            sin[:, :-1])
            # the other positions' K/V serve as the last position's cache (head-major)
            k, v = (a.transpose(0, 2, 1, 3) for a in (k, v))
            x, _ = last(x[:, -1:], cos[:, -1:], sin[:, -1:], mask[:, -1:], k, v,
                        dot_product_attention)
        b, t, _ = x.shape
        return self.heads(self.final(x)).astype(jnp.float32).reshape(b, t, self.shape.K, -1)

    def _query_features(self, x: jax.Array, positions: jax.Array, mask: jax.Array,
                        last_only: bool) -> jax.Array:
        """Arch "queries": x [B,T,H] the context's inputs. The drafting positions (every t, or
        the last alone) each get K query positions; the sequence is [context | queries], query
        (t, k) at position positions[t] + k attending what t attends (mask's row t) and the
        queries (t, 1..k). Every layer but the last runs over the whole sequence; the last
        computes the context's K/V only and runs the queries against them, as their cache."""
        b, t, h = x.shape
        K = self.shape.K
        at = jnp.arange(t - 1, t) if last_only else jnp.arange(t)  # the drafting positions
        n = at.shape[0] * K
        q = jnp.broadcast_to(self.query_embed.get_value().astype(x.dtype)[None, None],
                             (b, at.shape[0], K, h)).reshape(b, n, h)
        q_pos = (positions[:, at, None] + jnp.arange(1, K + 1)[None, None]).reshape(b, n)
        to_context = jnp.repeat(mask[:, at, :t], K, axis=1)  # [B,n,T]
        i = jnp.arange(n)
        own = i // K  # a query's drafting position: it sees that position's earlier queries
        to_queries = (own[:, None] == own[None, :]) & (i[None] <= i[:, None])
        to_queries = jnp.broadcast_to(to_queries[None], (b, n, n))
        q_rows = jnp.concatenate([to_context, to_queries], axis=-1)  # [B,n,T+n]
        c_rows = jnp.concatenate([mask[:, :, :t], jnp.zeros((b, t, n), bool)], axis=-1)
        inv = rope_inv_freq(self.block_cfg)
        seq = jnp.concatenate([x, q], axis=1)
        cos, sin = rope_cos_sin(jnp.concatenate([positions, q_pos], axis=1), inv)
        full_mask = jnp.concatenate([c_rows, q_rows], axis=1)
        for layer in list(self.layers)[:-1]:
            seq, _ = layer(seq, cos, sin, full_mask, None, None, dot_product_attention)
        last = self.layers[len(self.layers) - 1]
        k, v = last.self_attn.key_value(last.input_layernorm(seq[:, :t]), cos[:, :t], sin[:, :t])
        k, v = (a.transpose(0, 2, 1, 3) for a in (k, v))  # the context's K/V as the cache
        out, _ = last(seq[:, t:], cos[:, t:], sin[:, t:], q_rows, k, v, dot_product_attention)
        f = self.query_head(self.final(out)).astype(jnp.float32)
        return f.reshape(b, at.shape[0], K, -1)

    def __call__(self, states: jax.Array, anchors: jax.Array, positions: jax.Array,
                 mask: jax.Array, out_emb: jax.Array | None = None,
                 embedding: jax.Array | None = None) -> jax.Array:
        """As `features`; returns logits [B,T,K,Vd] float32 over the draft vocabulary. Head
        "model" needs out_emb [E_model, Vd]: the output embedding's draft-vocabulary columns;
        anchor "model" needs embedding [E_model, V]: the whole output embedding."""
        f = self.features(states, anchors, positions, mask, embedding=embedding)
        if self.shape.head == "vocab":
            return f
        return model_head_scores(f, out_emb)


def model_head_scores(features: jax.Array, columns: jax.Array) -> jax.Array:
    """Head "model": features [..., K, E] (`LookaheadDrafter.features`) scored against columns
    [E, V'] of the looped model's output embedding (`output_embedding`) -> logits [..., K, V']
    float32, one per column's token. Training and decoding both score this way."""
    return jnp.einsum("...ke,ev->...kv", features, columns.astype(jnp.float32))


def output_embedding(model) -> jax.Array:
    """A looped model's output embedding [E, V] float32 (the readout's logits are the last
    hidden state times it): its lm_head kernel, or with tied embeddings its token embedding
    (transposed), divided by its mean column norm, so that a head "model" drafter's scores
    start at a useful scale whatever the model's. Training and decoding both use this."""
    if model.lm_head is not None:
        w = model.lm_head.kernel.get_value()
    else:
        w = model.token_embed.embedding.get_value().T
    w = w.astype(jnp.float32)
    return w / jnp.maximum(jnp.linalg.norm(w, axis=0).mean(), 1e-12)


@dataclasses.dataclass(frozen=True)
class Calibration:
    """A drafter's calibrated match probabilities when sampling: table[t, k, b] is the mean
    probability that the full-depth target at temperature temperatures[t] gives the k-th
    drafted token of a chain (so the chance that speculative sampling accepts it, its earlier
    tokens accepted), over held-out drafts whose confidence (the drafter's softmax probability
    of its argmax) fell in bin b of `bins` equal bins of [0, 1]. `train_lad.calibrate` measures
    it."""

    temperatures: np.ndarray  # [T] float32, increasing
    table: np.ndarray  # [T, K, bins] float32 in [0, 1]

    def __post_init__(self):
        t, tab = np.asarray(self.temperatures), np.asarray(self.table)
        if (t.ndim != 1 or tab.ndim != 3 or tab.shape[0] != len(t) or len(t) == 0
                or not (t > 0).all() or not ((tab >= 0) & (tab <= 1)).all()):
            raise ConfigError(f"calibration: temperatures [T] > 0 and a table [T, K, bins] in "
                              f"[0, 1], got {t.shape} and {tab.shape}")

    def arrays(self) -> dict:
        return {"temperatures": jnp.asarray(self.temperatures, jnp.float32),
                "table": jnp.asarray(self.table, jnp.float32)}


def calibrated_table(cal: dict, temperature) -> jax.Array:
    """The [K, bins] table of `Calibration.arrays()` at the calibrated temperature nearest to
    `temperature` (a float or a traced scalar)."""
    t = jnp.argmin(jnp.abs(cal["temperatures"] - jnp.asarray(temperature, jnp.float32)))
    return cal["table"][t]


def match_probability(cal: dict, temperature, confidence: jax.Array) -> jax.Array:
    """Calibrated match probabilities [..., K] of drafted tokens with confidences [..., K]
    (`LadDrafter.draft(with_confidence=True)`), read from `calibrated_table`."""
    table = calibrated_table(cal, temperature)
    bins = table.shape[-1]
    b = jnp.clip(jnp.floor(confidence * bins).astype(jnp.int32), 0, bins - 1)
    return table[jnp.arange(table.shape[0]), b]


class LadDrafter:
    """A trained lookahead drafter ready for decoding: its graph, parameters, draft vocabulary
    and `draft_depth` (the loop whose states it drafts from: LoopAhead's r1). Load one with
    `LadDrafter.load` (a drafter file, or a `train_lad` workdir). Hashed by identity (a static
    part of the method; the parameters travel as arrays through `LoopAhead.params()`)."""

    def __init__(self, model: LookaheadDrafter, draft_vocab: np.ndarray, *, draft_depth: int = 1,
                 backbone_depth: int | None = None, calibration: Calibration | None = None,
                 base_digest: str | None = None):
        self.graphdef, params = nnx.split(model)
        self.params = {"net": params, "vocab": jnp.asarray(draft_vocab, jnp.int32)}
        if calibration is not None:
            if calibration.table.shape[1] != model.shape.K:
                raise ConfigError(f"calibration: a table for K = {calibration.table.shape[1]}, "
                                  f"the drafter drafts {model.shape.K}")
            self.params["calibration"] = calibration.arrays()
        self.calibration = calibration
        self.K = model.shape.K
        self.head = model.shape.head
        self.arch = model.shape.arch
        self.anchor = model.shape.anchor
        self.residual = model.shape.residual
        self.draft_depth = int(draft_depth)
        # the loop the network but its residual head was trained on (draft_depth without one)
        self.backbone_depth = int(backbone_depth or draft_depth)
        # the `params_digest` of the looped model it was trained on (None: not recorded)
        self.base_digest = base_digest

    def draft(self, params, states, anchors, positions, mask, *, extra_ids=None,
              out_embedding=None, with_confidence: bool = False):
        """states [B,W,E], anchors, positions [B,W], mask [B,W,W] -> the K tokens after the
        anchor of the last window position, [B,K] (full-vocabulary ids): each the argmax over
        the draft vocabulary and, with head "model", over extra_ids [B,X] too (the request's
        own tokens; -1: an empty slot), every token scored against out_embedding [E,V] (the
        looped model's `output_embedding`, which anchor "model" embeds the anchors with too).
        Head "vocab" has a logit for its own vocabulary's tokens only, so it ignores
        extra_ids. with_confidence: also each drafted token's confidence [B,K], the softmax
        probability of the argmax over the same candidates."""
        net = nnx.merge(self.graphdef, params["net"])
        vocab = params["vocab"]
        f = net.features(states, anchors, positions, mask, last_only=True,
                         embedding=out_embedding)[:, -1]  # [B,K,F]
        if self.head == "vocab":
            ids = vocab[jnp.argmax(f, axis=-1)]
            return (ids, jax.nn.softmax(f, axis=-1).max(-1)) if with_confidence else ids
        w = out_embedding.astype(jnp.float32)
        logits = model_head_scores(f, w[:, vocab])  # [B,K,Vd]
        ids = jnp.broadcast_to(vocab[None], (f.shape[0], vocab.shape[0]))
        if extra_ids is not None:
            cols = jnp.take(w, jnp.maximum(extra_ids, 0), axis=1)  # [E,B,X]: a row's own
            extra = jax.vmap(model_head_scores, in_axes=(0, 1))(f, cols)  # [B,K,X]
            logits = jnp.concatenate(
                [logits, jnp.where(extra_ids[:, None, :] >= 0, extra, -jnp.inf)], axis=-1)
            ids = jnp.concatenate([ids, extra_ids], axis=-1)
        drafted = jnp.take_along_axis(ids, jnp.argmax(logits, axis=-1), axis=1)
        if with_confidence:
            return drafted, jax.nn.softmax(logits, axis=-1).max(-1)
        return drafted

    @classmethod
    def load(cls, path_or_workdir, model_config=None) -> "LadDrafter":
        """A drafter file (`.safetensors`, `save_drafter_file`), or a `train_lad` workdir
        holding one (`drafter.safetensors`, written when its training finishes). With
        model_config (the decoding model's), checks that the drafter fits that model
        (`load_drafter_file`)."""
        path = os.fspath(path_or_workdir)
        if os.path.isdir(path):
            file = os.path.join(path, DRAFTER_FILE)
            if os.path.isfile(file):
                return load_drafter_file(file, model_config)
            if os.path.exists(os.path.join(path, "lad_config.json")):
                raise ConfigError(f"drafter {path}: this train_lad workdir has no {DRAFTER_FILE} "
                                  f"yet (its training has not finished: run the same "
                                  f"python -m train_lad.main command again to finish it)")
            raise ConfigError(f"drafter {path}: a directory without {DRAFTER_FILE} (pass a "
                              f"drafter .safetensors file or a train_lad workdir; train one "
                              f"with python -m train_lad.main)")
        if not os.path.exists(path):
            raise ConfigError(f"drafter {path} does not exist (train one with "
                              f"python -m train_lad.main)")
        if not path.endswith(".safetensors"):
            raise ConfigError(f"drafter {path}: not a .safetensors drafter file or a train_lad "
                              f"workdir (train one with python -m train_lad.main)")
        return load_drafter_file(path, model_config)


# -- the drafter file --------------------------------------------------------------------------

DRAFTER_FORMAT = "lookahead_jax.drafter/1"
DRAFTER_FILE = "drafter.safetensors"  # its name in a train_lad workdir
_SHAPE_META = ("state_size", "vocab_size", "hidden_size", "num_layers", "num_heads", "K")
_MODEL_META = ("draft_depth", "model_loops")
VOCAB_TENSOR = "draft_vocab"
BASE_META = "base_digest"
CAL_TENSOR, CAL_TEMPS_TENSOR = "calibration", "calibration_temperatures"


def _tensor_name(path) -> str:
    return ".".join(str(p) for p in path)


def save_drafter_file(path, net: LookaheadDrafter, draft_vocab, *, draft_depth: int,
                      model_family: str, model_loops: int, dtype=None,
                      backbone_depth: int | None = None,
                      calibration: Calibration | None = None,
                      base_digest: str | None = None) -> None:
    """Writes the drafter network `net`, its draft vocabulary (ids in the looped model's
    vocabulary, one per draft-vocabulary column) and the looped model it drafts for (family,
    loop count, and draft_depth: the loop whose states feed it) to the safetensors file `path`
    (replaced atomically). Format: the module docstring. dtype (e.g. "float16"): the
    parameters are stored in it (half the file; loading casts them to the network's dtype).
    backbone_depth: with a residual head, the loop its backbone was trained on. calibration:
    the drafter's `Calibration`, stored (float32) when given. base_digest: the `params_digest`
    of the looped model it was trained on."""
    shape = net.shape
    if shape.residual and backbone_depth is None:
        raise ValueError("a drafter with a residual head needs its backbone_depth")
    if not shape.residual and backbone_depth not in (None, draft_depth):
        raise ValueError("backbone_depth differs from draft_depth: only a drafter with a "
                         "residual head drafts at another depth than its backbone's")
    vocab = np.asarray(draft_vocab)
    if vocab.ndim != 1 or len(vocab) != shape.draft_vocab:
        raise ValueError(f"draft_vocab: {vocab.shape} ids for a drafter of {shape.draft_vocab} "
                         f"draft-vocabulary tokens")
    if not 1 <= draft_depth < model_loops:
        raise ValueError(f"draft_depth must be in [1, {model_loops}), got {draft_depth}")
    tensors = {_tensor_name(p): np.asarray(v.get_value(), dtype)
               for p, v in nnx.to_flat_state(nnx.state(net, nnx.Param))}
    tensors[VOCAB_TENSOR] = vocab.astype(np.int32)
    if calibration is not None:
        if calibration.table.shape[1] != shape.K:
            raise ValueError(f"calibration: a table for K = {calibration.table.shape[1]}, the "
                             f"drafter drafts {shape.K}")
        tensors[CAL_TENSOR] = np.asarray(calibration.table, np.float32)
        tensors[CAL_TEMPS_TENSOR] = np.asarray(calibration.temperatures, np.float32)
    meta = {"format": DRAFTER_FORMAT, **{k: str(getattr(shape, k)) for k in _SHAPE_META},
            "head": shape.head, "arch": shape.arch, "anchor": shape.anchor,
            "residual": str(int(shape.residual)), "draft_depth": str(int(draft_depth)),
            "model_family": str(model_family), "model_loops": str(int(model_loops))}
    if shape.residual:
        if not 1 <= backbone_depth < model_loops:
            raise ValueError(f"backbone_depth must be in [1, {model_loops}), got "
                             f"{backbone_depth}")
        meta["backbone_depth"] = str(int(backbone_depth))
    if base_digest is not None:
        meta[BASE_META] = _checked_digest(base_digest)
    path = os.fspath(path)
    tmp = f"{path}.tmp"
    save_file(tensors, tmp, metadata=meta)
    os.replace(tmp, path)


def add_calibration(path, calibration: Calibration) -> None:
    """Stores `calibration` in the drafter file `path` (replacing any it held), every other
    tensor and metadata field as they were (replaced atomically)."""
    def update(tensors, meta):
        k = int(meta.get("K", -1))
        if calibration.table.shape[1] != k:
            raise ValueError(f"calibration: a table for K = {calibration.table.shape[1]}, the "
                             f"drafter in {path} drafts {k}")
        tensors[CAL_TENSOR] = np.asarray(calibration.table, np.float32)
        tensors[CAL_TEMPS_TENSOR] = np.asarray(calibration.temperatures, np.float32)
    _rewrite(path, update)


def set_base_digest(path, digest: str) -> None:
    """Records in the drafter file `path` the `params_digest` of the looped model it was
    trained on (replacing any it held), every tensor and other metadata field as they were
    (replaced atomically)."""
    digest = _checked_digest(digest)
    _rewrite(path, lambda tensors, meta: meta.__setitem__(BASE_META, digest))


def _rewrite(path, update) -> None:
    """The drafter file `path` read, changed in place by update(tensors, metadata), written
    back atomically."""
    path = os.fspath(path)
    with safe_open(path, "numpy") as f:
        meta = dict(f.metadata() or {})
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    update(tensors, meta)
    tmp = f"{path}.tmp"
    save_file(tensors, tmp, metadata=meta)
    os.replace(tmp, path)


def load_drafter_file(path, model_config=None) -> LadDrafter:
    """The drafter of a file written by `save_drafter_file`. Every tensor's name and shape is
    checked against the network its metadata describe. With model_config (a looped model's
    config), checks that the drafter fits that model: the same family, hidden size (the
    drafter's state_size), vocabulary, and draft_depth below its loop count; a mismatch raises
    ConfigError naming the field."""
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise ConfigError(f"drafter file {path} does not exist (train one with "
                          f"python -m train_lad.main)")
    try:
        with safe_open(path, "numpy") as f:
            meta = dict(f.metadata() or {})
            tensors = {k: f.get_tensor(k) for k in f.keys()}
    except (SafetensorError, OSError, ValueError) as e:
        raise ConfigError(f"drafter file {path}: not a readable safetensors file ({e})") from e
    if meta.get("format") != DRAFTER_FORMAT:
        raise ConfigError(f"drafter file {path}: format is {meta.get('format')!r}, expected "
                          f"{DRAFTER_FORMAT!r}")
    ints = {}
    for k in (*_SHAPE_META, *_MODEL_META):
        try:
            ints[k] = int(meta[k])
        except (KeyError, ValueError):
            raise ConfigError(f"drafter file {path}: metadata {k} is {meta.get(k)!r}, expected "
                              f"an integer") from None
    if meta.get("head") not in HEADS:
        raise ConfigError(f"drafter file {path}: metadata head is {meta.get('head')!r}, "
                          f"expected 'vocab' or 'model'")
    arch = meta.get("arch", "heads")  # files written before the "queries" drafter
    if arch not in ARCHS:
        raise ConfigError(f"drafter file {path}: metadata arch is {arch!r}, expected "
                          f"'heads' or 'queries'")
    anchor = meta.get("anchor", "table")  # files written before the "model" anchor
    if anchor not in ANCHORS:
        raise ConfigError(f"drafter file {path}: metadata anchor is {anchor!r}, expected "
                          f"'table' or 'model'")
    extra_ints = {}
    for k in ("residual", "backbone_depth"):  # absent in files without a residual head
        if k in meta:
            try:
                extra_ints[k] = int(meta[k])
            except ValueError:
                raise ConfigError(f"drafter file {path}: metadata {k} is {meta[k]!r}, expected "
                                  f"an integer") from None
    residual = extra_ints.get("residual", 0)
    if residual < 0 or (residual and "backbone_depth" not in extra_ints):
        raise ConfigError(f"drafter file {path}: metadata residual is {residual}; a residual "
                          f"head (residual > 0) needs backbone_depth too")
    if not meta.get("model_family"):
        raise ConfigError(f"drafter file {path}: no metadata model_family")
    if not 1 <= ints["draft_depth"] < ints["model_loops"]:
        raise ConfigError(f"drafter file {path}: metadata draft_depth {ints['draft_depth']} is "
                          f"not in [1, model_loops = {ints['model_loops']})")
    calibration = None
    if CAL_TENSOR in tensors or CAL_TEMPS_TENSOR in tensors:
        table, temps = tensors.pop(CAL_TENSOR, None), tensors.pop(CAL_TEMPS_TENSOR, None)
        if table is None or temps is None or table.ndim != 3 or table.shape[1] != ints["K"]:
            raise ConfigError(f"drafter file {path}: {CAL_TENSOR} [T, K = {ints['K']}, bins] "
                              f"and {CAL_TEMPS_TENSOR} [T] go together")
        calibration = Calibration(temps.astype(np.float32), table.astype(np.float32))
    vocab = tensors.pop(VOCAB_TENSOR, None)
    if vocab is None or vocab.ndim != 1 or not np.issubdtype(vocab.dtype, np.integer):
        raise ConfigError(f"drafter file {path}: no 1-D integer tensor {VOCAB_TENSOR}")
    if len(vocab) == 0 or vocab.min() < 0 or vocab.max() >= ints["vocab_size"]:
        raise ConfigError(f"drafter file {path}: {VOCAB_TENSOR} holds ids outside the model's "
                          f"vocabulary of {ints['vocab_size']}")
    if model_config is not None:
        check_drafter_fits(path, meta["model_family"], ints["state_size"], ints["vocab_size"],
                           ints["draft_depth"], model_config)
    shape = DrafterShape(**{k: ints[k] for k in _SHAPE_META}, draft_vocab=len(vocab),
                         head=meta["head"], arch=arch, anchor=anchor, residual=residual)
    abstract = nnx.eval_shape(lambda: LookaheadDrafter(shape, rngs=nnx.Rngs(0)))
    graphdef, state = nnx.split(abstract)
    want = {_tensor_name(p): (p, v) for p, v in nnx.to_flat_state(state)}
    missing = sorted(set(want) - set(tensors))
    extra = sorted(set(tensors) - set(want))
    if missing or extra:
        raise ConfigError(f"drafter file {path}: tensors do not match its drafter's shape "
                          f"(missing: {', '.join(missing) or 'none'}; unexpected: "
                          f"{', '.join(extra) or 'none'})")
    flat = []
    for name, (p, v) in want.items():
        spec, got = v.get_value(), tensors[name]
        if tuple(got.shape) != tuple(spec.shape):
            raise ConfigError(f"drafter file {path}: tensor {name} has shape {tuple(got.shape)}, "
                              f"its drafter's shape needs {tuple(spec.shape)}")
        flat.append((p, v.replace(jnp.asarray(got, spec.dtype))))
    net = nnx.merge(graphdef, nnx.from_flat_state(flat))
    base_digest = meta.get(BASE_META)
    if base_digest is not None and not _is_digest(base_digest):
        raise ConfigError(f"drafter file {path}: metadata {BASE_META} is {base_digest!r}, "
                          f"expected {DIGEST_CHARS} hex digits (a params_digest)")
    return LadDrafter(net, vocab.astype(np.int32), draft_depth=ints["draft_depth"],
                      backbone_depth=extra_ints.get("backbone_depth"), calibration=calibration,
                      base_digest=base_digest)


def check_drafter_fits(source: str, family: str, state_size: int, vocab_size: int,
                       draft_depth: int, model_config) -> None:
    """Raises ConfigError naming the first field where the looped model (model_config) does
    not fit a drafter trained for a `family` model of hidden size state_size and vocabulary
    vocab_size, on the states of loop draft_depth."""
    if not hasattr(model_config, "num_loops"):
        raise ConfigError(f"drafter {source} drafts for a looped model; the decoding model is "
                          f"not one")
    for field, want in (("family", family), ("hidden_size", state_size),
                        ("vocab_size", vocab_size)):
        got = getattr(model_config, field)
        if got != want:
            raise ConfigError(f"drafter {source} does not match the decoding model: {field} is "
                              f"{got} in the model, {want} in the drafter")
    if draft_depth >= model_config.num_loops:
        raise ConfigError(f"drafter {source} does not match the decoding model: num_loops is "
                          f"{model_config.num_loops}, the drafter's draft_depth "
                          f"{draft_depth} must be below it")


# -- which model a drafter was trained on ------------------------------------------------------

DIGEST_CHARS = 16  # hex digits of a params_digest


class DrafterModelWarning(UserWarning):
    """A drafter is used with a looped model other than the one it was trained on."""


def params_digest(model, dtype=jnp.bfloat16) -> str:
    """A digest of `model`'s parameters (its `nnx.Param`s): sha256 over each one's path and its
    values cast to dtype, in path order; the first 16 hex digits. bfloat16, the default and what
    a drafter file records, gives the same digest whether a checkpoint is loaded in float32 or
    bfloat16. Costs one pass over the parameters (about a second for 135M on a CPU)."""
    h = hashlib.sha256()
    leaves = jax.tree_util.tree_leaves_with_path(nnx.state(model, nnx.Param))
    for path, leaf in sorted(leaves, key=lambda kv: jax.tree_util.keystr(kv[0])):
        h.update(jax.tree_util.keystr(path).encode())
        h.update(np.asarray(jnp.asarray(leaf, dtype)).tobytes())
    return h.hexdigest()[:DIGEST_CHARS]


def check_drafter_model(drafter, digest: str, source: str = "the decoding model") -> bool:
    """True when `drafter` (a LadDrafter) records no base model or records `digest` (the
    decoding model's `params_digest`); otherwise warns (DrafterModelWarning) and returns False.
    Decoding with another model's drafter stays exact, since full-depth verification decides
    every token, but its drafts are guesses for a different model."""
    want = getattr(drafter, "base_digest", None)
    if want is None or want == digest:
        return True
    warnings.warn(DrafterModelWarning(
        f"the drafter was trained on a looped model with parameter digest {want}; {source} has "
        f"{digest}. Decoding stays exact (full-depth verification decides every token), but "
        f"its drafts will rarely be accepted: use the drafter trained for this model"),
        stacklevel=3)
    return False


def _is_digest(value) -> bool:
    return (isinstance(value, str) and len(value) == DIGEST_CHARS
            and all(c in "0123456789abcdef" for c in value))


def _checked_digest(value) -> str:
    if not _is_digest(value):
        raise ValueError(f"a params_digest is {DIGEST_CHARS} lowercase hex digits, got {value!r}")
    return value
