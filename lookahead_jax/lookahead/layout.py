"""Where each token of a lookahead step sits, and which tokens it may see.

One step feeds T = (N-1)(W+G) tokens, in this order:

    index 0                         the current token (column 0 of level 0)
    l*W + i  (l in 0..N-2, i<W)     window level l, column i   (level 0 column 0 is index 0)
    (N-1)*W + g*(N-1) + j           candidate g, token j        (g < G, j < N-1)

Position offsets from the current token p: window (l, i) sits at p + l + i, candidate
(g, j) at p + 1 + j. So a window column read top to bottom is one n-gram at consecutive
positions, and a candidate continues the current token.

Visibility (besides the committed cache, which every token sees):
  window (l, i) sees level 0 columns 0..i and levels 1..l of its own column i;
  candidate (g, j) sees the current token and candidate g's tokens 0..j;
  the window and the candidates never see each other, nor do two candidates.

This module is the only description of that structure: the dense mask, the Pallas kernel
and the tests all derive it from `StepLayout`.
"""

from __future__ import annotations

import dataclasses
import functools

import numpy as np


def tokens_per_step(W: int, N: int, G: int, devices: int = 1) -> int:
    """Tokens one lookahead step feeds a device: (N-1)(W+G) on one device; with lookahead
    parallelism over `devices`, a device's share (`ShardedLayout.size`) plus the N-1 re-fed
    accepted tokens."""
    if devices <= 1:
        return (N - 1) * (W + G)
    return ShardedLayout(W, N, G, devices).size + N - 1


@dataclasses.dataclass(frozen=True)
class StepLayout:
    W: int
    N: int
    G: int

    @classmethod
    def of(cls, cfg) -> "StepLayout":
        """The layout of a `LookaheadConfig` (anything with W, N, G; config.py imports this
        module, so the type is not imported here)."""
        return cls(cfg.W, cfg.N, cfg.G)

    @property
    def size(self) -> int:
        """T, the number of tokens in one step."""
        return tokens_per_step(self.W, self.N, self.G)

    @property
    def window_index(self) -> np.ndarray:
        """[N-1, W] step index of window level l, column i (index 0 is the current token)."""
        return np.arange((self.N - 1) * self.W, dtype=np.int32).reshape(self.N - 1, self.W)

    @property
    def candidate_index(self) -> np.ndarray:
        """[G, N-1] step index of candidate g's token j."""
        start = (self.N - 1) * self.W
        return (start + np.arange(self.G * (self.N - 1), dtype=np.int32)).reshape(self.G, self.N - 1)

    @functools.cached_property
    def _tables(self) -> tuple[np.ndarray, np.ndarray]:
        lev, column = np.meshgrid(np.arange(self.N - 1), np.arange(self.W), indexing="ij")
        g, j = np.meshgrid(np.arange(self.G), np.arange(self.N - 1), indexing="ij")
        return step_tables(lev.ravel(), column.ravel(), j.ravel(), g.ravel())

    @property
    def offsets(self) -> np.ndarray:
        """[T] int32 position of each step token relative to the current token."""
        return self._tables[0]

    @property
    def mask(self) -> np.ndarray:
        """[T, T] bool, mask[q, k]: step token q sees step token k."""
        return self._tables[1]


def step_tables(win_level: np.ndarray, win_column: np.ndarray, cand_token: np.ndarray,
                cand_index: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Offsets [T] and mask [T, T] of a step holding the given window cells, then the given
    candidate tokens, in that order: the visibility rules above, in one place.

    win_level/win_column: the window cells (level l, column i), cell (0, 0) being the current
    token; cand_token/cand_index: candidate g's token j. `StepLayout` passes every cell and
    candidate; lookahead parallelism (`ShardedLayout`) passes a device's share.
    """
    nw = len(win_level)
    branch = np.concatenate([np.zeros(nw, np.int32), np.ones(len(cand_token), np.int32)])
    row = np.concatenate([win_level, cand_token]).astype(np.int32)
    col = np.concatenate([win_column, cand_index]).astype(np.int32)
    offsets = np.where(branch == 0, row + col, row + 1).astype(np.int32)
    q = (slice(None), None)
    k = (None, slice(None))
    win_q, win_k = branch[q] == 0, branch[k] == 0
    window_sees = win_q & win_k & (
        ((row[k] == 0) & (col[k] <= col[q])) | ((row[k] >= 1) & (row[k] <= row[q]) & (col[k] == col[q])))
    is_current = (branch == 0) & (row == 0) & (col == 0)
    cand_sees_current = (branch[q] == 1) & is_current[k]
    cand_sees_own = (branch[q] == 1) & (branch[k] == 1) & (col[k] == col[q]) & (row[k] <= row[q])
    return offsets, window_sees | cand_sees_current | cand_sees_own


@dataclasses.dataclass(frozen=True)
class ShardedLayout:
    """One device's share of a step under lookahead parallelism (`parallel.py`).

    The window's columns and the candidates are split into `devices` contiguous blocks of
    `W_d = ceil(W / devices)` columns and `G_d = ceil(G / devices)` candidates (padded: columns
    >= W and candidates >= G are dummies whose outputs are dropped). Device d feeds

        level 0, all W_pad = devices * W_d columns (column 0 is the current token)
        levels 1..N-2 of its own columns [d * W_d, (d+1) * W_d)
        its own candidates [d * G_d, (d+1) * G_d), N-1 tokens each

    Level 0 is replicated because a window token of column i sees level 0's columns 0..i; the
    other levels and the candidates are not. Every device's share has the same size, so the
    per-device tables below stack into [devices, ...] arrays indexed by the device's axis index.
    """

    W: int
    N: int
    G: int
    devices: int

    @property
    def W_d(self) -> int:
        return -(-self.W // self.devices)

    @property
    def G_d(self) -> int:
        return -(-self.G // self.devices)

    @property
    def W_pad(self) -> int:
        return self.W_d * self.devices

    @property
    def G_pad(self) -> int:
        return self.G_d * self.devices

    @property
    def size(self) -> int:
        """Tokens one device feeds per step (the step's pending block not included)."""
        return self.W_pad + (self.N - 2) * self.W_d + self.G_d * (self.N - 1)

    def _cells(self, d: int) -> tuple[np.ndarray, np.ndarray]:
        own = d * self.W_d + np.arange(self.W_d)
        lev = [np.zeros(self.W_pad, np.int32)] + [np.full(self.W_d, l, np.int32)
                                                   for l in range(1, self.N - 1)]
        col = [np.arange(self.W_pad, dtype=np.int32)] + [own.astype(np.int32)] * (self.N - 2)
        return np.concatenate(lev), np.concatenate(col)

    @functools.cached_property
    def tables(self) -> dict[str, np.ndarray]:
        """Per-device tables, each stacked over devices:
        offsets [D, T], mask [D, T, T] (as `StepLayout`'s, for this device's tokens);
        window_src [D, T_win]: flat index l * W_pad + i of each window token in the padded grid;
        newest [D, N-1, W_d]: step index of the device's own column cells at each level;
        candidates [D, G_d, N-1]: step index of the device's candidate tokens."""
        n1 = self.N - 1
        out: dict[str, list[np.ndarray]] = {k: [] for k in ("offsets", "mask", "window_src",
                                                             "newest", "candidates")}
        for d in range(self.devices):
            lev, col = self._cells(d)
            g, j = np.meshgrid(d * self.G_d + np.arange(self.G_d), np.arange(n1), indexing="ij")
            offsets, mask = step_tables(lev, col, j.ravel(), g.ravel())
            out["offsets"].append(offsets)
            out["mask"].append(mask)
            out["window_src"].append((lev * self.W_pad + col).astype(np.int32))
            own = d * self.W_d + np.arange(self.W_d)
            index = {(l, i): t for t, (l, i) in enumerate(zip(lev.tolist(), col.tolist()))}
            out["newest"].append(np.array([[index[(l, i)] for i in own] for l in range(n1)],
                                          np.int32).reshape(n1, self.W_d))
            out["candidates"].append(
                (len(lev) + np.arange(self.G_d * n1, dtype=np.int32)).reshape(self.G_d, n1))
        return {k: np.stack(v) for k, v in out.items()}
