"""`Method`: what every decoding method is to the `Engine`, with the parts they share written once.

A method is a frozen dataclass of static settings (hashable: it is a `jax.jit` static
argument) that carries the `Sampling` it was built with. The engine calls, under `jax.jit`:

    state = method.init(graphdef, params, tokens, lengths, cache, key, ...)   # once
    state = method.run(graphdef, params, state, max_steps, eos_ids=...)       # per chunk

`params` is `{"model": the model's nnx.State, "method": method.params()}`: a method with
weights of its own (LoopAhead's drafter) declares them in `params()`, and they travel as
arrays, never as static settings.

`init` (written here, once): the method's prefill, the first token sampled from the prefill
logits, the output buffer holding it, then `start` builds the method's own state. `run`
(written here, once): `lax.while_loop` over `step` until every row is done or `max_steps`
more steps ran. A subclass implements:

    cache_capacity(model_config)  cache slots beyond the committed tokens that a step writes
                                  (accepted tokens' K/V, or a tree's scratch positions): the
                                  engine sizes the cache from it before the cache exists
    start(model, params, first)   the state after the prefill (`First` holds what is known)
    step(model, params, state, eos_ids=...)   one step
    summary(state)                host-side statistics of a finished run

and may override `check` (refuse a model it cannot decode), `prefill` (looped methods write
every depth's K/V), `params` and `prepare` (loop-invariant values computed once per `run`).
Every state has `.out` (an `Output`) and `.steps` (forward passes, the prefill counted).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx, struct

from lookahead_jax.generation import Output, prefill, run_steps
from lookahead_jax.sampling import Sampling, SamplingParams
from models.config import ConfigError
from models.kv_cache import KVCache


@struct.dataclass
class First:
    """What `Method.init` knows after the prefill and the first token, handed to `start`.

    tokens [B, P] right-padded prompts, lengths [B]; cache holds the prompts; token [B] the
    first new token (emitted, not yet in the cache); out the output buffer holding it; key the
    run's PRNG key after the first token's draw; start_key a key for `start` alone (e.g. the
    lookahead window's first guesses); aux what the method's `prefill` returned beside the
    logits (None for the plain prefill)."""

    tokens: jax.Array
    lengths: jax.Array
    cache: Any
    token: jax.Array
    out: Output
    key: jax.Array
    start_key: jax.Array
    aux: Any = None


@dataclasses.dataclass(frozen=True)
class Method:
    """Base class of decoding methods (see the module docstring)."""

    sampling: Sampling = Sampling()

    name = "method"  # the registry name (a class attribute, not a field)

    def __post_init__(self):
        if not isinstance(self.sampling, (Sampling, SamplingParams)):  # e.g. a config passed
            # positionally; SamplingParams: the server's per-slot values, inside its programs
            raise ConfigError(f"{type(self).__name__}: sampling must be a Sampling, got "
                              f"{self.sampling!r} (pass other settings by keyword)")

    # -- what a subclass provides ---------------------------------------------------------------
    def cache_capacity(self, model_config) -> int:
        """Cache slots beyond the committed tokens that one step may write."""
        raise NotImplementedError

    def start(self, model: nnx.Module, params: Any, first: First) -> Any:
        raise NotImplementedError

    def step(self, model: nnx.Module, params: Any, state: Any, *, eos_ids: tuple[int, ...]):
        raise NotImplementedError

    def summary(self, state: Any) -> dict:
        return {}

    # -- optional hooks -------------------------------------------------------------------------
    def check(self, model_config) -> None:
        """Raises ConfigError when this method cannot decode a model of `model_config`."""

    def params(self) -> Any:
        """Arrays the method owns (a drafter's weights), bundled with the model's."""
        return {}

    def prefill(self, model: nnx.Module, tokens: jax.Array, lengths: jax.Array,
                cache: KVCache) -> tuple[jax.Array, Any, Any]:
        """-> (logits at each row's last prompt token [B, V], the cache, aux for `start`)."""
        logits, cache = prefill(model, tokens, lengths, cache)
        return logits, cache, None

    def prepare(self, model: nnx.Module, params: Any) -> Any:
        """What `step` receives as `params`: loop-invariant values computed once per `run`."""
        return params

    # -- written once ---------------------------------------------------------------------------
    def init(self, graphdef: nnx.GraphDef, params: dict, tokens: jax.Array, lengths: jax.Array,
             cache: Any, key: jax.Array, *, max_new_tokens: int, eos_ids: tuple[int, ...]):
        """Prefill, first token, output buffer, then `start`. tokens [B, P] right-padded,
        lengths [B]."""
        model = nnx.merge(graphdef, params["model"])
        self.check(model.config)
        logits, cache, aux = self.prefill(model, tokens, lengths, cache)
        key, k_first, k_start = jax.random.split(key, 3)
        token = self.sampling.sample(k_first, logits)
        out, _ = Output.init(tokens.shape[0], max_new_tokens).emit(
            token[:, None], jnp.ones_like(lengths), eos_ids)
        return self.start(model, params["method"],
                          First(tokens, lengths, cache, token, out, key, k_start, aux))

    def run(self, graphdef: nnx.GraphDef, params: dict, state: Any, max_steps: jax.Array, *,
            eos_ids: tuple[int, ...]):
        """Up to `max_steps` steps (or until every row is done) in one `lax.while_loop`."""
        model = nnx.merge(graphdef, params["model"])
        own = self.prepare(model, params["method"])
        return run_steps(lambda s: self.step(model, own, s, eos_ids=eos_ids), state, max_steps)
