"""Which (query block, key block) tiles of a lookahead step's attention hold a visible key.

The kernel computes attention tile by tile. Its queries are the step's T tokens times the
`group` query heads that share one K/V head (grouped-query attention): query row r is step
token r // group, head r % group of that K/V head, so a [block_q, D] query tile serves all the
group's heads at once and each K/V tile is read once per group. Its keys are the cache
(S slots, padded to a multiple of block_k) followed by the T step tokens (padded likewise).

  * Cache key block c is visible to every query of row b iff c * block_k < cache_len[b]:
    blocks past the cache length are skipped (a dynamic, per-row bound).
  * Step key block s is visible to query block i iff the layout's [T, T] mask has a True in
    that tile (`tiles`, static: derived from `StepLayout.mask`, never described again here).

`block_stats.py` counts the same tiles with `BlockMap.counts`, so what it reports is what the
kernel does.
"""

from __future__ import annotations

import dataclasses
import functools

import numpy as np

from lookahead_jax.lookahead.layout import StepLayout


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclasses.dataclass(frozen=True)
class BlockMap:
    """The static tiling of one step's attention (hashable; built once per shape)."""

    layout: StepLayout
    group: int  # query heads per K/V head (1 = MHA)
    block_q: int  # query rows (token x head-in-group) per tile
    block_k: int  # keys per tile

    def __post_init__(self):
        if self.group < 1 or self.block_q < 1 or self.block_k < 1:
            raise ValueError(f"group, block_q and block_k must be >= 1, got {self.group}, "
                             f"{self.block_q}, {self.block_k}")

    @classmethod
    @functools.lru_cache(maxsize=256)
    def of(cls, layout: StepLayout, group: int, block_q: int, block_k: int) -> "BlockMap":
        return cls(layout, group, block_q, block_k)

    # -- shapes ------------------------------------------------------------------------------
    @property
    def rows(self) -> int:
        """T * group query rows."""
        return self.layout.size * self.group

    @property
    def rows_padded(self) -> int:
        return cdiv(self.rows, self.block_q) * self.block_q

    @property
    def q_blocks(self) -> int:
        return self.rows_padded // self.block_q

    @property
    def step_padded(self) -> int:
        """T rounded up to block_k: the step's keys as the kernel lays them out."""
        return cdiv(self.layout.size, self.block_k) * self.block_k

    @property
    def step_blocks(self) -> int:
        return self.step_padded // self.block_k

    def cache_padded(self, cache_size: int) -> int:
        """S rounded up to block_k: the cache's keys as the kernel lays them out."""
        return cdiv(cache_size, self.block_k) * self.block_k

    # -- the step's tiles (static) ------------------------------------------------------------
    @functools.cached_property
    def row_mask(self) -> np.ndarray:
        """[rows_padded, step_padded] bool: query row r sees step key s (padding sees nothing)."""
        out = np.zeros((self.rows_padded, self.step_padded), bool)
        t = self.layout.size
        out[: self.rows, :t] = np.repeat(self.layout.mask, self.group, axis=0)
        return out

    @functools.cached_property
    def tiles(self) -> np.ndarray:
        """[q_blocks, step_blocks] bool: the tile holds at least one visible step key."""
        m = self.row_mask.reshape(self.q_blocks, self.block_q, self.step_blocks, self.block_k)
        return m.any(axis=(1, 3))

    @functools.cached_property
    def step_index(self) -> tuple[np.ndarray, np.ndarray]:
        """For each query block, the visible step key blocks in order: index [q_blocks, M]
        int32 (padded with its last entry, M >= 1) and count [q_blocks] int32."""
        count = self.tiles.sum(axis=1).astype(np.int32)
        index = np.zeros((self.q_blocks, max(1, int(count.max(initial=0)))), np.int32)
        for i, row in enumerate(self.tiles):
            vis = np.flatnonzero(row)
            if len(vis):
                index[i, : len(vis)] = vis
                index[i, len(vis):] = vis[-1]
        return index, count

    @functools.cached_property
    def step_fetch(self) -> np.ndarray:
        """[q_blocks, step_blocks] int32: the last visible step block <= s, or -1 if none.
        A kernel that walks every tile fetches this block for tile s, so a skipped tile
        re-uses the block already in memory instead of copying one it will not read."""
        out = np.full(self.tiles.shape, -1, np.int32)
        for i, row in enumerate(self.tiles):
            last = -1
            for s, vis in enumerate(row):
                last = s if vis else last
                out[i, s] = last
        return out

    # -- counting (block_stats) -----------------------------------------------------------------
    def counts(self, cache_len: int, cache_size: int | None = None) -> dict:
        """Tiles one (batch row, K/V head) of a step computes and skips, with the cache holding
        `cache_len` committed tokens in `cache_size` slots (default: cache_len)."""
        cache_size = cache_len if cache_size is None else cache_size
        if not 0 <= cache_len <= cache_size:
            raise ValueError(f"need 0 <= cache_len ({cache_len}) <= cache_size ({cache_size})")
        cache_all = self.q_blocks * cdiv(cache_size, self.block_k)
        cache_done = self.q_blocks * cdiv(cache_len, self.block_k)
        step_all = self.q_blocks * self.step_blocks
        step_done = int(self.tiles.sum())
        total = cache_all + step_all
        done = cache_done + step_done
        return {
            "T": self.layout.size, "group": self.group, "block_q": self.block_q,
            "block_k": self.block_k, "cache_len": cache_len, "cache_size": cache_size,
            "q_blocks": self.q_blocks,
            "cache_blocks": {"computed": cache_done, "skipped": cache_all - cache_done,
                             "total": cache_all},
            "step_blocks": {"computed": step_done, "skipped": step_all - step_done,
                            "total": step_all},
            "computed": done, "skipped": total - done, "total": total,
            "skipped_fraction": (total - done) / total if total else 0.0,
        }
