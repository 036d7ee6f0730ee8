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

from lookahead_jax.config import LookaheadConfig


@dataclasses.dataclass(frozen=True)
class StepLayout:
    W: int
    N: int
    G: int

    @classmethod
    def of(cls, cfg: LookaheadConfig) -> "StepLayout":
        return cls(cfg.W, cfg.N, cfg.G)

    @property
    def size(self) -> int:
        """T, the number of tokens in one step."""
        return (self.N - 1) * (self.W + self.G)

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
        t = self.size
        offsets = np.zeros(t, np.int32)
        # For every token: (branch, level-or-token, column-or-candidate). Branch 0 = window.
        branch = np.zeros(t, np.int32)
        row = np.zeros(t, np.int32)
        col = np.zeros(t, np.int32)
        lev, column = np.meshgrid(np.arange(self.N - 1), np.arange(self.W), indexing="ij")
        wi = self.window_index
        offsets[wi] = lev + column
        row[wi], col[wi] = lev, column
        if self.G:
            g, j = np.meshgrid(np.arange(self.G), np.arange(self.N - 1), indexing="ij")
            ci = self.candidate_index
            offsets[ci] = j + 1
            branch[ci], row[ci], col[ci] = 1, j, g
        q = (slice(None), None)
        k = (None, slice(None))
        win_q, win_k = branch[q] == 0, branch[k] == 0
        window_sees = win_q & win_k & (
            ((row[k] == 0) & (col[k] <= col[q])) | ((row[k] >= 1) & (row[k] <= row[q]) & (col[k] == col[q])))
        cand_sees_current = (branch[q] == 1) & (np.arange(t)[k] == 0)
        cand_sees_own = (branch[q] == 1) & (branch[k] == 1) & (col[k] == col[q]) & (row[k] <= row[q])
        mask = window_sees | cand_sees_current | cand_sees_own
        return offsets, mask

    @property
    def offsets(self) -> np.ndarray:
        """[T] int32 position of each step token relative to the current token."""
        return self._tables[0]

    @property
    def mask(self) -> np.ndarray:
        """[T, T] bool, mask[q, k]: step token q sees step token k."""
        return self._tables[1]
