"""What LoopSpec and LoopAhead share: a method over a candidate tree of a looped model.

`TreeMethod` sizes the cache from the tree's capacity (its scratch positions), checks that the
model is looped and that the method's loop depths lie below its R loops, and builds the first
tree; `LoopStats` / `loop_summary` count loops and candidate advances per output token, and the
drafted nodes verification throws away (`discard_counts`).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from lookahead_jax.looped.tree import LoopTree
from lookahead_jax.method import First, Method
from models.config import ConfigError
from models.kv_cache import KVCache


@struct.dataclass
class LoopStats:
    loops: jax.Array  # [B] int32, shared-block calls while the row was live
    advances: jax.Array  # [B] int32, node-loops (candidate advances) of the row
    verified: jax.Array  # [B] int32, full-depth verifications (= tokens emitted after the first)
    accepted: jax.Array  # [B] int32, drafted children that survived verification
    accepted_second: jax.Array  # [B] int32, of which second (d2) / drafter (LoopAhead) drafts
    discarded: jax.Array  # [B] int32, drafted nodes thrown away by verification
    discarded_advances: jax.Array  # [B] int32, the loops those nodes had run
    discarded_full: jax.Array  # [B] int32, of them, nodes that had reached full depth R

    @classmethod
    def zeros(cls, b: int) -> "LoopStats":
        z = jnp.zeros((b,), jnp.int32)
        return cls(z, z, z, z, z, z, z, z)

    def step(self, live: jax.Array, active: jax.Array, verified: jax.Array,
             accepted: jax.Array, accepted_second: jax.Array, lost: tuple) -> "LoopStats":
        """The counts after one step: live [B] rows ran a loop, active [B, C] nodes advanced,
        verified / accepted / accepted_second [B] this step, lost = `discard_counts`' sums."""
        i32 = lambda x: x.astype(jnp.int32)  # noqa: E731
        return LoopStats(self.loops + i32(live), self.advances + i32(active).sum(1),
                         self.verified + i32(verified), self.accepted + i32(accepted),
                         self.accepted_second + i32(accepted_second),
                         self.discarded + lost[0], self.discarded_advances + lost[1],
                         self.discarded_full + lost[2])


def discard_counts(tree: LoopTree, drop: jax.Array, r_full: int) -> tuple:
    """Per row [B]: how many nodes drop [B, C] holds, the loops they had run (their depths),
    and how many had reached full depth r_full."""
    i32 = jnp.int32
    return (drop.sum(1, dtype=i32), jnp.where(drop, tree.depth, 0).sum(1, dtype=i32),
            (drop & (tree.depth == r_full)).sum(1, dtype=i32))


def check_looped(model_config) -> None:
    if not hasattr(model_config, "num_loops"):
        raise ConfigError("loopspec / loopahead need a looped model (an Ouro or Raven preset, "
                          "e.g. --config=tiny_ouro); this model is not looped")


def check_scratch_room(cache: KVCache, prompt_bucket: int, max_new_tokens: int,
                       capacity: int) -> None:
    """The tree's scratch positions (the last `capacity` of the cache) must lie beyond every
    position a committed token can take."""
    room = cache.max_len - prompt_bucket - max_new_tokens
    if capacity > room:
        raise ConfigError(f"the candidate tree needs {capacity} scratch positions after the "
                          f"prompt (padded to {prompt_bucket}) and {max_new_tokens} new tokens, "
                          f"but the cache of {cache.max_len} leaves {room}: raise cache_len")


def loop_summary(stats: LoopStats, num_loops: int | None = None) -> dict:
    """Host side: loops and candidate advances per output token (the first token, from the
    prefill, not counted), the share of verifications that kept the drafted child, and the
    work thrown away: drafted nodes discarded by verification, the share of all advances they
    had taken (`discarded_advance_share`) and the share of them that had reached full depth
    (`discarded_full_share`, the paper's "discarded candidates reaching R")."""
    loops, adv = int(np.sum(stats.loops)), int(np.sum(stats.advances))
    ver, acc = int(np.sum(stats.verified)), int(np.sum(stats.accepted))
    lost, lost_adv = int(np.sum(stats.discarded)), int(np.sum(stats.discarded_advances))
    lost_full = int(np.sum(stats.discarded_full))
    d = {"loops": loops, "advances": adv, "verified_tokens": ver, "accepted": acc,
         "loops_per_token": loops / ver if ver else float("nan"),
         "advances_per_token": adv / ver if ver else float("nan"),
         "draft_acceptance": acc / ver if ver else float("nan"),
         "second_draft_accepted": int(np.sum(stats.accepted_second)),
         "discarded": lost, "discarded_advances": lost_adv, "discarded_full": lost_full,
         "discarded_advance_share": lost_adv / adv if adv else float("nan"),
         "discarded_full_share": lost_full / lost if lost else 0.0}
    if num_loops is not None:
        d["plain_loops_per_token"] = num_loops
    return d


@dataclasses.dataclass(frozen=True)
class TreeMethod(Method):
    """Base of the looped methods: a subclass gives `tree_capacity(num_loops)` and `depths()`
    (its named loop depths, 0 meaning off)."""

    def tree_capacity(self, num_loops: int) -> int:
        raise NotImplementedError

    def depths(self) -> dict[str, int]:
        raise NotImplementedError

    def cache_capacity(self, model_config) -> int:
        check_looped(model_config)
        return self.tree_capacity(model_config.num_loops)  # the tree's scratch positions

    def check(self, model_config) -> None:
        check_looped(model_config)
        depths = self.depths()
        if max(depths.values()) >= model_config.num_loops:
            named = " and ".join(f"{k} ({v})" for k, v in depths.items())
            raise ConfigError(f"{self.name}: {named} must be below the model's "
                              f"{model_config.num_loops} loops")

    def new_tree(self, model, first: First) -> LoopTree:
        """A one-node tree per row: the first token at its position, depth 0, in a tree of
        `tree_capacity` nodes whose scratch positions must fit the cache."""
        cfg = model.config
        capacity = self.tree_capacity(cfg.num_loops)
        check_scratch_room(first.cache, first.tokens.shape[1], first.out.tokens.shape[1],
                           capacity)
        return LoopTree.init(first.token, first.lengths.astype(jnp.int32), capacity,
                             cfg.hidden_size, model.dtype,
                             1 if self.sampling.greedy else cfg.vocab_size)
