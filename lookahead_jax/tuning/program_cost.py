"""The cost of one decoding step read from the compiled program, for any model shape.

A step's wall clock on an accelerator is set by what the compiled program does: the FLOPs it
runs and the bytes it moves. `forward_cost` builds a model of the given shape from abstract
arrays (no weights are materialised: a 70B model costs nothing to describe), lowers and
compiles the step's forward pass for the current backend and reads XLA's cost analysis
(FLOPs, bytes accessed) and memory analysis (argument, output and temporary bytes):

    cost = method_cost(load_preset("llama7b").model, "lookahead", dict(W=15, N=5, G=15),
                       cache_len=512)
    cost.bytes_accessed / cost.ideal_bytes   # how close to "read the weights and the cache once"

What is counted: the forward pass a step runs (tokens -> logits and the step's K/V, with the
step's mask and logits rows). Not counted: the commit of the accepted tokens' K/V into the cache
(a few tokens written in place; XLA's cost analysis counts a scatter as touching its whole
operand, so including it would charge every step a spurious copy of the cache), nor the
host-free bookkeeping around the forward (n-gram pool, window), which moves kilobytes.

The ideal a memory-bound step approaches is `ideal_bytes`: the weights read once plus the
allocated KV cache read once (dense attention reads every slot and masks; the Pallas kernel
skips empty tiles, so it can do better than this on long, mostly empty caches).

Read the program in float32 (the default here). XLA's CPU backend has no bfloat16 matmul: it
converts bfloat16 weights to float32 into temporaries, so a bfloat16 program compiled on a CPU
reports several times the bytes a GPU or TPU program moves. In float32 the CPU program is the
one an accelerator would run, and bytes scale with the element size (`scaled_bytes`).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Mapping

import jax
import jax.numpy as jnp
from flax import nnx

from lookahead_jax.generation import cache_length_for
from lookahead_jax.lookahead.config import LookaheadConfig
from lookahead_jax.lookahead.layout import StepLayout
from lookahead_jax.lookahead.mask import StepMask, as_dense, dense_attention
from lookahead_jax.prompt_lookup import DEFAULT_TOKENS
from models.build import build_looped
from models.config import ConfigError, LlamaConfig, LoopedConfig
from models.kv_cache import KVCache
from models.layers import causal_mask
from models.llama import Llama

@dataclasses.dataclass(frozen=True)
class ProgramCost:
    """What one compiled forward pass does. Bytes and FLOPs are XLA's cost analysis of the
    program compiled for `backend`; weight_bytes and cache_bytes are the arrays' sizes."""

    flops: float
    bytes_accessed: float
    weight_bytes: int
    cache_bytes: int
    argument_bytes: int
    output_bytes: int
    temp_bytes: int
    tokens: int
    cache_len: int
    cache_size: int
    itemsize: int
    backend: str

    @property
    def ideal_bytes(self) -> int:
        """Weights + the allocated KV cache, each read once."""
        return self.weight_bytes + self.cache_bytes

    @property
    def excess(self) -> float:
        """bytes_accessed / ideal_bytes (1.0: not a byte more than reading both once)."""
        return self.bytes_accessed / self.ideal_bytes

    def scaled_bytes(self, itemsize: int) -> float:
        """bytes_accessed with every array of `itemsize` bytes per element instead of this
        program's (e.g. 2 for a bfloat16 deployment read from a float32 program)."""
        return self.bytes_accessed * itemsize / self.itemsize

    def to_dict(self) -> dict[str, Any]:
        return dict(dataclasses.asdict(self), ideal_bytes=self.ideal_bytes, excess=self.excess)


def _dtype(dtype) -> Any:
    return jnp.dtype({"float32": jnp.float32, "bfloat16": jnp.bfloat16}.get(dtype, dtype))


def abstract_model(model_config: LlamaConfig | LoopedConfig, dtype=jnp.float32):
    """(graphdef, params) of a model of this shape, params as ShapeDtypeStructs."""
    dtype = _dtype(dtype)
    if isinstance(model_config, LoopedConfig):
        def make():
            return build_looped(model_config, dtype=dtype, rngs=nnx.Rngs(0))
    elif isinstance(model_config, LlamaConfig):
        def make():
            return Llama(model_config, dtype=dtype, rngs=nnx.Rngs(0))
    else:
        raise ConfigError(f"program cost: not a model config: {model_config!r}")
    return nnx.split(nnx.eval_shape(make))


def _nbytes(tree) -> int:
    return int(sum(math.prod(x.shape) * jnp.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree)))


def forward_cost(model_config: LlamaConfig | LoopedConfig, *, tokens: int, cache_len: int,
                 dtype=jnp.float32, batch: int = 1, layout: StepLayout | None = None,
                 logits_rows: int | None = None, loops: int | None = None,
                 attention=dense_attention) -> ProgramCost:
    """Compiles one forward pass of `tokens` new tokens per row over a cache holding `cache_len`
    tokens and reads its cost.

    layout: a lookahead `StepLayout` (its `StepMask` is the mask; tokens must equal its size);
    None: the causal mask. logits_rows: how many of the tokens get logits (None: all).
    loops: for a looped model, how many loop iterations the pass runs (None: all R, then read
    out); for a Llama model it must be None.
    """
    if tokens < 1 or cache_len < 0 or batch < 1:
        raise ConfigError(f"program cost: need tokens >= 1, cache_len >= 0, batch >= 1; got "
                          f"{tokens}, {cache_len}, {batch}")
    if layout is not None and layout.size != tokens:
        raise ConfigError(f"program cost: the layout has {layout.size} tokens, not {tokens}")
    looped = isinstance(model_config, LoopedConfig)
    if loops is not None and not looped:
        raise ConfigError("program cost: loops= is for looped models")
    dtype = _dtype(dtype)
    graphdef, params = abstract_model(model_config, dtype)
    # the slots the engine allocates for `cache_len` committed tokens and a step of `tokens`
    size = cache_length_for(cache_len, 0, tokens, model_config.max_position_embeddings)
    layers = model_config.cache_slots if looped else model_config.num_layers
    cache = jax.eval_shape(lambda: KVCache.init(layers, batch, size, model_config.num_kv_heads,
                                                model_config.head_dim, dtype,
                                                per_layer=not looped))  # as the models do
    rows = tokens if logits_rows is None else int(logits_rows)

    def forward(params, cache, tokens_, length):
        model = nnx.merge(graphdef, params)
        cache = cache.replace(length=length)
        b, t = tokens_.shape
        if layout is None:
            positions = length[:, None] + jnp.arange(t)[None]
            mask = causal_mask(jnp.full((b,), t, jnp.int32), t, cache)
        else:
            positions = length[:, None] + jnp.asarray(layout.offsets)[None]
            mask = StepMask(length, layout, cache.max_len)
        at = None if rows == t else jnp.broadcast_to(jnp.arange(rows)[None], (b, rows))
        if not looped:
            return model(tokens_, positions, mask, cache, attention_fn=attention, logits_at=at)
        if loops is None:
            return model(tokens_, positions, mask, cache, attention_fn=attention)
        _, states = model.loop_states(tokens_, positions, mask, cache, attention, loops=loops)
        return states[-1][0]

    args = (params, cache, jax.ShapeDtypeStruct((batch, tokens), jnp.int32),
            jax.ShapeDtypeStruct((batch,), jnp.int32))
    compiled = jax.jit(forward).lower(*args).compile()
    ca = compiled.cost_analysis()
    ca = ca[0] if isinstance(ca, (list, tuple)) else ca
    mem = compiled.memory_analysis()
    return ProgramCost(
        flops=float(ca.get("flops", 0.0)), bytes_accessed=float(ca.get("bytes accessed", 0.0)),
        weight_bytes=_nbytes(params), cache_bytes=_nbytes((cache.k, cache.v)),
        argument_bytes=int(getattr(mem, "argument_size_in_bytes", 0)),
        output_bytes=int(getattr(mem, "output_size_in_bytes", 0)),
        temp_bytes=int(getattr(mem, "temp_size_in_bytes", 0)),
        tokens=tokens, cache_len=cache_len, cache_size=size, itemsize=dtype.itemsize,
        backend=jax.default_backend())


def fused_attention_traffic(q, k, v, mask, cache_k=None, cache_v=None):
    """A stand-in for a fused attention kernel in a cost analysis, never for decoding: it reads
    q, the step's K/V, the cache layer and the mask once and writes an output of q's shape,
    which is the memory traffic of a flash-style kernel (the Pallas kernel's scores and
    probabilities live in registers and on-chip memory). XLA cannot see inside a Pallas call,
    so a program with the real kernel has no readable cost; this one has the kernel's bytes."""
    total = k.astype(jnp.float32).sum() + v.astype(jnp.float32).sum()
    total = total + jnp.where(as_dense(mask), 1.0, 0.0).sum()
    if cache_k is not None:
        total = total + cache_k.astype(jnp.float32).sum() + cache_v.astype(jnp.float32).sum()
    return (q * total.astype(q.dtype)).astype(q.dtype)


ATTENTIONS = {"dense": dense_attention, "fused": fused_attention_traffic}


@dataclasses.dataclass(frozen=True)
class StepShape:
    """What one step of a method hands the model: tokens, the lookahead layout (None: causal)
    and how many of the tokens get logits."""

    tokens: int
    layout: StepLayout | None = None
    logits_rows: int | None = None


def step_shape(method: str, settings: Mapping[str, Any] | None = None) -> StepShape:
    """The forward pass of one step of `method` ('ar', 'lookahead', 'prompt_lookup') with
    `settings` (lookahead: W, N, G; prompt_lookup: num_tokens, the method's default draft)."""
    settings = dict(settings or {})
    if method in ("ar", "plain"):
        return StepShape(1)
    if method == "lookahead":
        cfg = LookaheadConfig(**{k: settings[k] for k in ("W", "N", "G") if k in settings})
        layout = StepLayout.of(cfg)
        return StepShape(layout.size, layout, 1 + cfg.W + cfg.G * (cfg.N - 1))
    if method == "prompt_lookup":
        return StepShape(1 + int(settings.get("num_tokens", DEFAULT_TOKENS)))
    raise ConfigError(f"program cost: no step shape for method {method!r} (ar, lookahead, "
                      f"prompt_lookup)")


def method_cost(model_config: LlamaConfig | LoopedConfig, method: str,
                settings: Mapping[str, Any] | None = None, *, cache_len: int,
                dtype=jnp.float32, batch: int = 1, attention=dense_attention) -> ProgramCost:
    """`forward_cost` of one step of `method` (see `step_shape`)."""
    shape = step_shape(method, settings)
    return forward_cost(model_config, tokens=shape.tokens, cache_len=cache_len, dtype=dtype,
                        batch=batch, layout=shape.layout, logits_rows=shape.logits_rows,
                        attention=attention)
