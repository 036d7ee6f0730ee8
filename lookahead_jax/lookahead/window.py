"""The 2D lookahead window: N-1 Jacobi levels x W columns of guessed tokens.

`tokens[:, l, i]` is level l, column i. Level 0 column 0 is the current token's place (the
step writes the current token there), so level 0 holds W-1 guesses and levels 1..N-2 hold W.

Each step the model's argmax at the newest filled level's positions is a new level. During
warm-up (fewer than N-1 filled levels) it is appended below; once full, the window slides:
level l takes level l+1, the new outputs become level N-2, and the column whose n-gram was
just completed leaves (level 0 takes level 1 without its first token, whose place the next
current token takes). Every full step yields W complete n-grams, one per column:
(level 0, level 1, ..., level N-2, new) read down column i.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from lookahead_jax.lookahead.config import LookaheadConfig


@struct.dataclass
class Window:
    tokens: jax.Array  # [B, N-1, W] int32
    filled: jax.Array  # [] int32, levels holding real guesses (1..N-1)

    @classmethod
    def init(cls, key: jax.Array, prompt: jax.Array, lengths: jax.Array, cfg: LookaheadConfig,
             vocab_size: int) -> "Window":
        """Level 0 (and the not-yet-filled levels) get random guesses: tokens drawn from each
        row's prompt (init_fill="prompt") or from the vocabulary ("vocab"), with the run's key."""
        b = prompt.shape[0]
        shape = (b, cfg.N - 1, cfg.W)
        if cfg.init_fill == "vocab":
            tokens = jax.random.randint(key, shape, 0, vocab_size, jnp.int32)
        else:
            u = jax.random.uniform(key, shape)
            idx = jnp.floor(u * lengths[:, None, None]).astype(jnp.int32)
            tokens = jnp.take_along_axis(prompt, idx.reshape(b, -1), axis=1).reshape(shape)
        return cls(tokens, jnp.ones((), jnp.int32))

    @property
    def full(self) -> jax.Array:
        return self.filled == self.tokens.shape[1]

    def with_current(self, token: jax.Array) -> jax.Array:
        """The step's window grid [B, N-1, W]: level 0 column 0 set to the current token [B]."""
        return self.tokens.at[:, 0, 0].set(token)

    def newest_index(self, window_index: jax.Array) -> jax.Array:
        """window_index [N-1, W] (step index of each window token) -> [W], the step indices of
        the newest filled level: the model's argmax there is the next level."""
        return jax.lax.dynamic_index_in_dim(window_index, self.filled - 1, axis=0, keepdims=False)

    def ngrams(self, grid: jax.Array, new: jax.Array) -> jax.Array:
        """The W n-grams completed this step: [B, W, N], column i = (grid[:, :, i], new[:, i])."""
        return jnp.concatenate([grid, new[:, None, :]], axis=1).transpose(0, 2, 1)

    def advance(self, grid: jax.Array, new: jax.Array) -> "Window":
        """Warm-up: append `new` as the next level. Full: slide every level up by one."""
        slid = jnp.concatenate([grid[:, 1:], new[:, None, :]], axis=1)
        grown = jax.lax.dynamic_update_index_in_dim(grid, new, self.filled, axis=1)
        full = self.full
        return Window(jnp.where(full, slid, grown), jnp.where(full, self.filled, self.filled + 1))
