"""Lookahead decoding settings: W, N, G and the pool, validated once."""

from __future__ import annotations

import dataclasses

from lookahead_jax.lookahead.layout import tokens_per_step
from models.config import ConfigError

INIT_FILLS = ("prompt", "vocab")


@dataclasses.dataclass(frozen=True)
class LookaheadConfig:
    """Static settings of one lookahead decoder (hashable: a jit static argument).

    W (window): lookahead window width, the number of Jacobi columns.
    N (ngram): n-gram size; the window has N-1 levels and candidates have N-1 tokens.
    G (guesses): verification candidates per step (0 = window only, no verification).
    pool_slots: n-grams kept per key (0 = max(G, 1)); the oldest is evicted.
    pool_keys: key buckets of the on-device pool (0 = the vocabulary size, one bucket per
        token id; fewer buckets hash token ids modulo pool_keys, entries store their key).
    prompt_seeding: seed the pool with the prompt's n-grams and every committed n-gram.
    init_fill: where the window's first guesses come from: "prompt" (tokens drawn from the
        prompt with the run's PRNG key) or "vocab" (random vocabulary ids).
    """

    W: int = 15
    N: int = 5
    G: int = 15
    pool_slots: int = 0
    pool_keys: int = 0
    prompt_seeding: bool = False
    init_fill: str = "prompt"

    def __post_init__(self):
        if self.N < 2:
            raise ConfigError(f"lookahead: N (n-gram size) must be >= 2, got {self.N}")
        if self.W < 1:
            raise ConfigError(f"lookahead: W (window width) must be >= 1, got {self.W}")
        if self.G < 0:
            raise ConfigError(f"lookahead: G (verification candidates) must be >= 0, got {self.G}")
        if self.pool_slots < 0 or self.pool_keys < 0:
            raise ConfigError("lookahead: pool_slots and pool_keys must be >= 0")
        if 0 < self.pool_slots < self.G:
            raise ConfigError(f"lookahead: pool_slots ({self.pool_slots}) must be >= G ({self.G})")
        if self.init_fill not in INIT_FILLS:
            raise ConfigError(f"lookahead: init_fill must be one of {INIT_FILLS}, got {self.init_fill!r}")

    @property
    def levels(self) -> int:
        """Window levels (N-1); level 0's first column is the current token."""
        return self.N - 1

    @property
    def step_tokens(self) -> int:
        """Tokens fed to the model per step: [current | window | candidates] = (N-1)(W+G)."""
        return tokens_per_step(self.W, self.N, self.G)

    @property
    def slots(self) -> int:
        return self.pool_slots or max(self.G, 1)

    def keys(self, vocab_size: int) -> int:
        return min(self.pool_keys or vocab_size, vocab_size)

    def check_fits(self, max_positions: int) -> None:
        """Raises if one step feeds more tokens than the model has positions."""
        if self.step_tokens > max_positions:
            raise ConfigError(
                f"lookahead: one step feeds (N-1)(W+G) = {self.step_tokens} tokens, more than the "
                f"model's {max_positions} positions")
