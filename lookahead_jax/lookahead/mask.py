"""The seam between a lookahead step and its attention: a structured mask, not a dense one.

`lookahead_step` does not hand the model a dense [B, T, S+T] boolean mask. It hands it a
`StepMask`: the per-row cache lengths (dynamic) and the step's `StepLayout` (static). That is
all a lookahead step's visibility depends on:

    query q of the step sees key s   iff   s < S and s < cache_len[b]        (committed cache)
                                      or   s >= S and layout.mask[q, s - S]  (the step itself)

The Llama model only passes the mask through to its `attention_fn`, and checks `mask.shape`,
which a `StepMask` provides. Two kinds of attention understand it:
  * `dense_attention` expands it (`StepMask.dense()`) and runs the dense reference
    (`models.layers.dot_product_attention`); any other mask passes straight through;
  * the Pallas kernel (`pallas_kernels.lookahead_attention`) reads the cache lengths and a block
    map derived from the layout, and never computes a block with no visible key.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
from flax import struct

from models.layers import dot_product_attention

if TYPE_CHECKING:  # not imported at run time: lookahead_jax.lookahead.step imports this module
    from lookahead_jax.lookahead.layout import StepLayout


@struct.dataclass
class StepMask:
    """Visibility of one lookahead step: [cache slots 0..S) | the step's T tokens]."""

    cache_len: jax.Array  # [B] int32, committed slots per row (slots >= cache_len are invisible)
    layout: StepLayout = struct.field(pytree_node=False)
    cache_size: int = struct.field(pytree_node=False)  # S, the cache's slots

    @property
    def shape(self) -> tuple[int, int, int]:
        """(B, T, S+T), the shape of the dense mask this stands for."""
        t = self.layout.size
        return (self.cache_len.shape[0], t, self.cache_size + t)

    def dense(self) -> jax.Array:
        """[B, T, S+T] bool, the dense mask: committed cache slots | layout.mask."""
        b, t, _ = self.shape
        cache = jnp.arange(self.cache_size)[None, :] < self.cache_len[:, None]  # [B, S]
        return jnp.concatenate(
            [jnp.broadcast_to(cache[:, None, :], (b, t, self.cache_size)),
             jnp.broadcast_to(jnp.asarray(self.layout.mask)[None], (b, t, t))], axis=-1)


def as_dense(mask) -> jax.Array:
    """A `StepMask` expanded to its [B, T, S+T] bool array; a dense mask unchanged."""
    return mask.dense() if isinstance(mask, StepMask) else mask


def dense_attention(q: jax.Array, k: jax.Array, v: jax.Array, mask,
                    cache_k: jax.Array | None = None, cache_v: jax.Array | None = None,
                    **rules) -> jax.Array:
    """The dense reference for any mask: q [B,T,H,D], k/v [B,T,Hkv,D] (the new tokens),
    cache_k/v [B,Hkv,S,D] or None, mask a `StepMask` or [B,T,S+T] bool -> [B,T,H,D].
    rules: the layer's own (scale, softcap, window and positions), applied on top of the mask
    (`models.layers.dot_product_attention`)."""
    return dot_product_attention(q, k, v, as_dense(mask), cache_k, cache_v, **rules)
