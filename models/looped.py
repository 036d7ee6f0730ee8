"""Looped (depth-recurrent) language models in Flax NNX: the family-independent machinery.

A looped model reuses one block of layers R times. In LoopSpec's terms: a prelude P embeds
the tokens, a recurrent block B advances the state by one loop, and a readout C turns the
state at any depth 1..R into logits. `LoopedLM` is the base class; the families fill in P, B
and C: `models.ouro.OuroLM` and `models.raven.RavenLM` (`models.build.build_looped(cfg)` picks
the one that `cfg.family` names).

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
"""

from __future__ import annotations

from typing import ClassVar

import jax
import jax.numpy as jnp
from flax import nnx

from models.config import ConfigError, LoopedConfig
from models.kv_cache import KVCache, NewKV
from models.layers import AttentionFn, causal_mask, dot_product_attention, linear

Seed = int | jax.Array | None


# ---- masks and cache helpers ----------------------------------------------------------------

def default_mask(mask: jax.Array | None, positions: jax.Array) -> jax.Array:
    """`mask`, or where it is None the causal mask of positions' [B,T] tokens (no cache)."""
    if mask is not None:
        return mask
    b, t = positions.shape
    return causal_mask(jnp.full((b,), t, jnp.int32), t)


def _cached(cache: KVCache | None, slot) -> tuple[jax.Array | None, jax.Array | None]:
    """K/V [B,Hkv,S,D] of one cache slot (slot may be traced)."""
    if cache is None:
        return None, None
    return cache.slots(slot)


def _all_depths_cached(cache: KVCache, slots: jax.Array) -> tuple[jax.Array, jax.Array]:
    """K/V of the R cache slots `slots` [R] side by side: [B, Hkv, R*S, D] each. A gather (a
    copy of R cache layers): the price of a step whose tokens sit at different depths."""
    def joined(x):
        x = jnp.moveaxis(x[slots], 0, 2)  # [B, Hkv, R, S, D]
        return x.reshape(*x.shape[:2], -1, x.shape[-1])
    return joined(cache.k), joined(cache.v)


def _per_depth_mask(mask: jax.Array, depth: jax.Array, cache: KVCache | None,
                    n_depths: int) -> jax.Array:
    """The mask of a stack run with per-token depths [B,T]: new tokens see each other only at
    equal depth; with a cache, the cache part [B,T,S] is widened to every depth's slots side
    by side ([B,T,R*S]), a query seeing its own depth's only."""
    b, t = depth.shape
    same = depth[:, :, None] == depth[:, None, :]
    if cache is None:
        return mask & same
    s = cache.max_len
    own = depth[:, :, None] == jnp.arange(n_depths)[None, None, :]  # [B,T,R]
    old = (mask[:, :, None, :s] & own[..., None]).reshape(b, t, n_depths * s)
    return jnp.concatenate([old, mask[:, :, s:] & same], axis=-1)


def write_slots(cache: KVCache, new: NewKV, first_slot: jax.Array, src: jax.Array,
                dst: jax.Array) -> KVCache:
    """Copies the K/V of new token src[b, i] (all n layers of `new`, [n, B, T, Hkv, D]) into
    cache slots first_slot[b, i] + 0..n-1 at position dst[b, i]; a dst >= S is dropped.

    first_slot, src, dst: [B, m] int32. `length` is unchanged (as `KVCache.write`).
    """
    n = new.k.shape[0]
    b = jnp.broadcast_to(jnp.arange(src.shape[0])[:, None], src.shape)
    slots = first_slot[None] + jnp.arange(n)[:, None, None]  # [n, B, m]
    # cache[slots, b, :, dst] has shape [n, B, m, Hkv, D] (the indexed axes first)
    k = cache.k.at[slots, b[None], :, dst[None]].set(new.k[:, b, src], mode="drop")
    v = cache.v.at[slots, b[None], :, dst[None]].set(new.v[:, b, src], mode="drop")
    return cache.replace(k=k, v=v)


# ---- the model ------------------------------------------------------------------------------

class LoopedLM(nnx.Module):
    """A looped causal LM: the loop machinery shared by the families. A family subclass sets
    `family` and defines `build_layers`, `token_embed`, `loop_block`, `rope`, `embed` and
    `readout_state`; it may override `initial_state`, `inject`, `finish_loop` and `exit_gate`.
    Parameter names follow the family's published modeling code."""

    family: ClassVar[str] = ""

    def __init__(self, cfg: LoopedConfig, *, dtype=jnp.float32, rngs: nnx.Rngs):
        if not type(self).family:
            raise TypeError("LoopedLM is the base class of the looped families; build a model "
                            "with models.build.build_looped(cfg)")
        if cfg.family != self.family:
            raise ConfigError(f"model config: family {cfg.family!r} given to "
                              f"{type(self).__name__} (family {self.family!r})")
        self.config = cfg
        self.dtype = dtype
        self.build_layers(cfg, dtype, rngs)
        self.lm_head = (None if cfg.tie_word_embeddings
                        else linear(cfg.hidden_size, cfg.vocab_size, dtype, rngs))

    # -- what a family defines ------------------------------------------------------------------
    def build_layers(self, cfg: LoopedConfig, dtype, rngs: nnx.Rngs) -> None:
        """Creates the family's parameters (all but `lm_head`, which comes last)."""
        raise NotImplementedError

    @property
    def token_embed(self) -> nnx.Embed:
        """The token embedding (the output embedding too, when tied)."""
        raise NotImplementedError

    @property
    def loop_block(self) -> nnx.List:
        """The recurrent block's layers, run once per loop."""
        raise NotImplementedError

    def rope(self, positions: jax.Array) -> tuple[jax.Array, jax.Array]:
        """RoPE cos, sin of positions [B,T] in the layout the family's attention uses."""
        raise NotImplementedError

    def embed(self, tokens: jax.Array, positions: jax.Array, mask: jax.Array | None = None,
              cache: KVCache | None = None,
              attention_fn: AttentionFn = dot_product_attention) -> tuple[jax.Array, NewKV | None]:
        """Prelude P. tokens, positions [B,T]; mask [B,T,S+T] (None: causal, no cache).
        Returns e [B,T,E] and the prelude's K/V [prelude_layers, B,T,Hkv,D] (None without
        prelude layers)."""
        raise NotImplementedError

    def readout_state(self, h: jax.Array, depth: int | jax.Array, positions: jax.Array,
                      mask: jax.Array | None, cache: KVCache | None,
                      attention_fn: AttentionFn) -> tuple[jax.Array, NewKV | None]:
        """The readout C up to the LM head: the final hidden [B,T,E] and K/V of any layers
        it runs (None if none)."""
        raise NotImplementedError

    def initial_state(self, e: jax.Array, positions: jax.Array, seed: Seed = None) -> jax.Array:
        """The state at depth 0, [B,T,E]: here e itself."""
        return e

    def inject(self, h: jax.Array, e: jax.Array) -> jax.Array:
        """The recurrent block's input from the state h and the prelude output e: here h."""
        return h

    def finish_loop(self, x: jax.Array) -> jax.Array:
        """The state after a loop from the recurrent block's output: here x itself."""
        return x

    def exit_gate(self, h: jax.Array) -> jax.Array | None:
        """The early-exit gate logit of a state, [B,T] float32, or None (no gate)."""
        return None

    # -- small pieces ---------------------------------------------------------------------------
    def _head(self, x: jax.Array) -> jax.Array:
        if self.lm_head is None:
            return self.token_embed.attend(x).astype(jnp.float32)
        return self.lm_head(x).astype(jnp.float32)

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

    def run_coda(self, blocks, x, depth, positions, mask, cache, attention_fn):
        """Runs the coda `blocks` over x at readout depth `depth` (1..R, one int or [B,T]), each
        depth's own coda cache slots (Raven, recursive): x and the coda's K/V (None without
        coda layers)."""
        mask = default_mask(mask, positions)
        cos, sin = self.rope(positions)
        per_token = jnp.ndim(depth) > 0
        d = jnp.asarray(depth, jnp.int32) - 1 if per_token else None
        return self._stack(blocks, x, cos, sin, mask, cache,
                           None if per_token else self.coda_slot(depth), d, attention_fn,
                           self.config.coda_slot0, self.config.coda_layers)

    def _stack(self, blocks, x, cos, sin, mask, cache, slot0, depth, attention_fn,
               depth_slot0: int = 0, depth_stride: int = 0):
        """Runs `blocks` over x. depth None: layer l reads cache slot slot0 + l (int or traced)
        for all tokens. depth [B,T] (0..R-1): layer l of token (b,t) reads slot
        depth_slot0 + depth[b,t] * depth_stride + l; the cache part of `mask` ([B,T,S]) then
        refers to each query's own slots (all R depths' slots are read side by side, masked),
        and new tokens see each other only at equal depth. Returns x and NewKV
        [len(blocks), B, T, Hkv, D] (None without blocks)."""
        n_depths = self.config.num_loops
        if depth is not None:
            mask = _per_depth_mask(mask, depth, cache, n_depths)
        ks, vs = [], []
        for i, blk in enumerate(blocks):
            if cache is None:
                ck = cv = None
            elif depth is None:
                ck, cv = _cached(cache, slot0 + i)
            else:
                slots = depth_slot0 + jnp.arange(n_depths) * depth_stride + i
                ck, cv = _all_depths_cached(cache, slots)
            x, (k, v) = blk(x, cos, sin, mask, ck, cv, attention_fn)
            ks.append(k)
            vs.append(v)
        if not ks:
            return x, None
        return x, NewKV(jnp.stack(ks), jnp.stack(vs))

    # -- LoopSpec pieces ------------------------------------------------------------------------
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
        mask = default_mask(mask, positions)
        cos, sin = self.rope(positions)
        per_token = jnp.ndim(depth) > 0
        slot0 = None if per_token else self.loop_slot(depth)
        x, kv = self._stack(self.loop_block, self.inject(h, e), cos, sin, mask, cache, slot0,
                            jnp.asarray(depth, jnp.int32) if per_token else None, attention_fn,
                            self.config.loop_slot0, self.config.loop_layers)
        return self.finish_loop(x), kv

    def readout(self, h: jax.Array, depth: int | jax.Array, positions: jax.Array,
                mask: jax.Array | None = None, cache: KVCache | None = None,
                attention_fn: AttentionFn = dot_product_attention,
                logits_at: jax.Array | None = None) -> tuple[jax.Array, NewKV | None]:
        """Readout C at each token's depth (1..R; one int or [B,T]), mask as in `advance`.
        logits_at: optional [B,N] token indices to read out. Returns logits [B,T,V] (or
        [B,N,V]) float32 and the K/V of the readout's layers (Raven's coda; None otherwise;
        commit it with `write_coda_kv`)."""
        x, kv = self.readout_state(h, depth, positions, mask, cache, attention_fn)
        if logits_at is not None:
            x = jnp.take_along_axis(x, logits_at[..., None], axis=1)
        return self._head(x), kv

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
    def loop_states(self, tokens: jax.Array, positions: jax.Array,
                    mask: jax.Array | None = None, cache: KVCache | None = None,
                    attention_fn: AttentionFn = dot_product_attention, seed: Seed = None,
                    loops: int | None = None) -> tuple[NewKV | None, list[tuple[jax.Array, NewKV]]]:
        """Every token through the prelude and `loops` loops (default all R), no readout: the
        prelude's K/V (None: ouro) and, for each loop r = 1..loops, the state after it [B,T,E]
        with that loop's K/V. The readouts are the caller's (`forward_all_depths` reads out
        every depth; the looped methods' prefill only the depths they use). mask as in
        `forward_all_depths`."""
        mask = default_mask(mask, positions)
        e, pre_kv = self.embed(tokens, positions, mask, cache, attention_fn)
        h = self.initial_state(e, positions, seed)
        states = []
        for r in range(self.config.num_loops if loops is None else loops):
            h, kv = self.advance(h, e, r, positions, mask, cache, attention_fn)
            states.append((h, kv))
        return pre_kv, states

    def forward_all_depths(self, tokens: jax.Array, positions: jax.Array,
                           mask: jax.Array | None = None, cache: KVCache | None = None,
                           attention_fn: AttentionFn = dot_product_attention, seed: Seed = None
                           ) -> tuple[jax.Array, jax.Array | None, NewKV]:
        """Every token through all R loops, read out after each loop.

        tokens, positions [B,T]; mask [B,T,S+T] over [cache slots | new tokens], the same at
        every depth (None: causal, no cache). Returns logits [R,B,T,V] float32, the exit-gate
        logits [R,B,T] float32 (None without a gate: raven) and the K/V of every cache slot,
        [cache_slots, B,T,Hkv,D] (Raven's coda at every readout depth included), to commit
        with `KVCache.write` / `append`.
        """
        mask = default_mask(mask, positions)
        pre_kv, states = self.loop_states(tokens, positions, mask, cache, attention_fn, seed)
        logits, gates, loop_kv, coda_kv = [], [], [], []
        for r, (h, kv) in enumerate(states):
            loop_kv.append(kv)
            lg, ckv = self.readout(h, r + 1, positions, mask, cache, attention_fn)
            logits.append(lg)
            gates.append(self.exit_gate(h))
            if ckv is not None:
                coda_kv.append(ckv)
        kvs = ([pre_kv] if pre_kv is not None else []) + loop_kv + coda_kv
        new = NewKV(jnp.concatenate([kv.k for kv in kvs]), jnp.concatenate([kv.v for kv in kvs]))
        return jnp.stack(logits), (None if gates[0] is None else jnp.stack(gates)), new

    def loop_logits(self, tokens: jax.Array, positions: jax.Array, seed: Seed = None
                    ) -> tuple[jax.Array, jax.Array | None]:
        """No cache, causal among the T tokens: the readout after each loop 1..R.

        tokens, positions: [B,T] int32. seed: Raven's initial-state seed (None:
        config.noise_seed). Returns logits [R,B,T,V] float32 and the exit-gate logits
        [R,B,T] float32 (None without a gate: raven).
        """
        logits, gates, _ = self.forward_all_depths(tokens, positions, seed=seed)
        return logits, gates

    def __call__(self, tokens: jax.Array, positions: jax.Array, mask: jax.Array,
                 cache: KVCache | None = None,
                 attention_fn: AttentionFn = dot_product_attention,
                 logits_at: jax.Array | None = None, seed: Seed = None
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
