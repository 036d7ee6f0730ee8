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

On a device mesh (`forward_cost(..., mesh=make_mesh("lookahead:1,model:8"))`) the pass is
lowered with the parameters and the cache laid out by `models.sharding`'s rules (tensor
parallelism over the mesh's "model" axis, replicated over any other axis) under
`jax.set_mesh(mesh)`, so the models' activation constraints apply too, and XLA's partitioner
turns it into one SPMD program that every device runs on its own shards. XLA's cost and memory
analyses of that program describe ONE device: FLOPs, bytes accessed, argument, output and
temporary bytes are per device (`tests/test_mesh_memory.py` checks the argument bytes against
the shards' sizes). The collectives the partitioner inserts are in the program, but their time
over the interconnect is not in any of these figures (`roofline.allreduce_time` adds it).
`ProgramCost.weight_bytes` / `cache_bytes` stay the whole model's; the `*_per_device` fields
are one device's shards, computed from the specs, and `ideal_bytes` is per device.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Mapping

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from lookahead_jax.generation import cache_length_for
from lookahead_jax.lookahead.config import LookaheadConfig
from lookahead_jax.lookahead.layout import StepLayout
from lookahead_jax.lookahead.mask import StepMask, as_dense, dense_attention
from lookahead_jax.looped.tree import LoopTree
from lookahead_jax.prompt_lookup import DEFAULT_TOKENS
from models.build import build_looped
from models.config import ConfigError, LlamaConfig, LoopedConfig
from models.kv_cache import KVCache
from models.layers import causal_mask
from models.llama import Llama
from models.sharding import MODEL, cache_specs, param_specs, shardings

@dataclasses.dataclass(frozen=True)
class ProgramCost:
    """What one compiled forward pass does. Bytes and FLOPs are XLA's cost analysis of the
    program compiled for `backend`; weight_bytes and cache_bytes are the whole arrays' sizes.

    On a mesh (`mesh` not empty: e.g. "lookahead:2,model:4", over `devices` devices) the
    program is one device's SPMD program, so flops, bytes_accessed, argument_bytes,
    output_bytes and temp_bytes are per device, and so is `ideal_bytes`; weight_bytes and
    cache_bytes stay the whole model's, and weight_bytes_per_device / cache_bytes_per_device
    are the bytes of one device's shards by the specs (each array's size over the product of
    the mesh axes its dimensions are split over; the same on every device). Without a mesh,
    devices is 1 and the per-device sizes equal the totals. argument_bytes counts only the
    arrays the program reads (`jax.jit` drops unused parameters, e.g. a looped model's
    readout in a `loops=` pass), so it can fall below weights + cache."""

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
    mesh: str = ""  # "" (one device) or the mesh's axes, e.g. "lookahead:2,model:4"
    devices: int = 1
    weight_bytes_per_device: int | None = None  # None: weight_bytes (one device)
    cache_bytes_per_device: int | None = None  # None: cache_bytes (one device)

    def __post_init__(self):
        if self.weight_bytes_per_device is None:
            object.__setattr__(self, "weight_bytes_per_device", self.weight_bytes)
        if self.cache_bytes_per_device is None:
            object.__setattr__(self, "cache_bytes_per_device", self.cache_bytes)

    @property
    def ideal_bytes(self) -> int:
        """Weights + the allocated KV cache, each read once, by one device (on a mesh: its
        shards of both; on one device: the whole model and cache)."""
        return self.weight_bytes_per_device + self.cache_bytes_per_device

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


def split_factor(spec: PartitionSpec, mesh_sizes: Mapping[str, int]) -> int:
    """How many pieces a PartitionSpec cuts an array into: the product of the sizes of the
    mesh axes its dimensions are split over (a dimension may name several axes)."""
    n = 1
    for entry in spec:
        for axis in (entry if isinstance(entry, tuple) else (entry,)):
            if axis is not None:
                n *= int(mesh_sizes[axis])
    return n


def bytes_per_device_from_specs(tree, specs, mesh_sizes: Mapping[str, int]) -> int:
    """Bytes of one device's shards of `tree` (arrays or ShapeDtypeStructs) laid out by
    `specs` (a PartitionSpec per leaf) on a mesh of `mesh_sizes` (axis -> devices): each
    array's bytes over its `split_factor`. Dimensions the specs split must divide evenly
    (`models.sharding.spec_for` only splits those)."""
    leaves = jax.tree.leaves(tree)
    spec_leaves = jax.tree.leaves(specs, is_leaf=lambda x: isinstance(x, PartitionSpec))
    if len(leaves) != len(spec_leaves):
        raise ValueError(f"bytes_per_device_from_specs: {len(leaves)} arrays but "
                         f"{len(spec_leaves)} specs")
    total = 0
    for x, spec in zip(leaves, spec_leaves):
        n = math.prod(x.shape) * jnp.dtype(x.dtype).itemsize
        total += n // split_factor(spec, mesh_sizes)
    return int(total)


def mesh_label(mesh: Mesh) -> str:
    """"lookahead:2,model:4" for a Mesh (its axes in order)."""
    return ",".join(f"{name}:{size}" for name, size in mesh.shape.items())


def forward_cost(model_config: LlamaConfig | LoopedConfig, *, tokens: int, cache_len: int,
                 dtype=jnp.float32, batch: int = 1, layout: StepLayout | None = None,
                 logits_rows: int | None = None, loops: int | None = None,
                 attention=dense_attention, mesh: Mesh | None = None) -> ProgramCost:
    """Compiles one forward pass of `tokens` new tokens per row over a cache holding `cache_len`
    tokens and reads its cost.

    layout: a lookahead `StepLayout` (its `StepMask` is the mask; tokens must equal its size);
    None: the causal mask. logits_rows: how many of the tokens get logits (None: all).
    loops: for a looped model, how many loop iterations the pass runs (None: all R, then read
    out); for a Llama model it must be None.
    mesh: a `jax.sharding.Mesh` with a "model" axis (`lookahead_jax.mesh.make_mesh`): the pass
    is compiled as one SPMD program with the parameters and cache sharded by
    `models.sharding` (token ids and lengths replicated), and the cost is ONE device's (see
    `ProgramCost`). None: one device, as before. Nothing is materialised either way.
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
    kv = (cache.k, cache.v)
    per_device: dict[str, Any] = {}
    if mesh is None:
        compiled = jax.jit(forward).lower(*args).compile()
    else:
        if MODEL not in mesh.shape:
            raise ConfigError(f"program cost: the mesh needs a 'model' axis, got axes "
                              f"{tuple(mesh.shape)}")
        p_specs = param_specs(params, mesh, model_config)
        c_specs = cache_specs(cache, mesh)
        rep = NamedSharding(mesh, PartitionSpec())
        in_shardings = (shardings(p_specs, mesh), shardings(c_specs, mesh), rep, rep)
        with jax.set_mesh(mesh):  # the models' `constrain` calls apply
            compiled = jax.jit(forward, in_shardings=in_shardings).lower(*args).compile()
        sizes = dict(mesh.shape)
        per_device = dict(
            mesh=mesh_label(mesh), devices=int(mesh.size),
            weight_bytes_per_device=bytes_per_device_from_specs(params, p_specs, sizes),
            cache_bytes_per_device=bytes_per_device_from_specs(
                kv, (c_specs.k, c_specs.v), sizes))
    return _read_cost(compiled, params, kv, tokens=tokens, cache_len=cache_len, cache_size=size,
                      itemsize=dtype.itemsize, **per_device)


def _read_cost(compiled, params, kv, **fields) -> ProgramCost:
    """A ProgramCost from a compiled program's cost and memory analyses; params and kv: the
    weights and the cache's K/V arrays (their whole sizes)."""
    ca = compiled.cost_analysis()
    ca = ca[0] if isinstance(ca, (list, tuple)) else ca
    mem = compiled.memory_analysis()
    return ProgramCost(
        flops=float(ca.get("flops", 0.0)), bytes_accessed=float(ca.get("bytes accessed", 0.0)),
        weight_bytes=_nbytes(params), cache_bytes=_nbytes(kv),
        argument_bytes=int(getattr(mem, "argument_size_in_bytes", 0)),
        output_bytes=int(getattr(mem, "output_size_in_bytes", 0)),
        temp_bytes=int(getattr(mem, "temp_size_in_bytes", 0)),
        backend=jax.default_backend(), **fields)


def fused_attention_traffic(q, k, v, mask, cache_k=None, cache_v=None, **rules):
    """A stand-in for a fused attention kernel in a cost analysis, never for decoding: it reads
    q, the step's K/V, the cache layer and the mask once and writes an output of q's shape,
    which is the memory traffic of a flash-style kernel (the Pallas kernel's scores and
    probabilities live in registers and on-chip memory). XLA cannot see inside a Pallas call,
    so a program with the real kernel has no readable cost; this one has the kernel's bytes.
    A layer's rules (a sliding window, soft-capping: `models.layers.dot_product_attention`) are
    a few element-wise operations on scores a fused kernel never writes out: no traffic."""
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
                dtype=jnp.float32, batch: int = 1, attention=dense_attention,
                mesh: Mesh | None = None) -> ProgramCost:
    """`forward_cost` of one step of `method` (see `step_shape`); on `mesh`, one device's."""
    shape = step_shape(method, settings)
    return forward_cost(model_config, tokens=shape.tokens, cache_len=cache_len, dtype=dtype,
                        batch=batch, layout=shape.layout, logits_rows=shape.logits_rows,
                        attention=attention, mesh=mesh)


def tree_step_cost(model_config: LoopedConfig, *, nodes: int, cache_len: int,
                   dtype=jnp.float32, batch: int = 1) -> ProgramCost:
    """The forward pass of one LoopSpec / LoopAhead step of a looped model: a tree of `nodes`
    nodes (the method's static capacity; every slot is computed) at mixed loop depths over a
    cache holding `cache_len` committed tokens. It is what `looped.tree.loop_advance` runs:
    the embedding (Raven, recursive: the prelude), one call of the shared block with per-node
    depths (so its attention reads every loop's cache slots, masked), and the readout at each
    node's new depth (Raven, recursive: the coda; then the LM head) for every node.

    Not counted, as in `forward_cost`: the K/V writes into the cache (XLA counts a scatter as
    touching its whole operand), the drafter (LoopAhead's LAD: two small layers at the
    drafting rows) and the tree's bookkeeping, which move kilobytes."""
    if not isinstance(model_config, LoopedConfig):
        raise ConfigError("program cost: a tree step is for looped models")
    if nodes < 1 or cache_len < 0 or batch < 1:
        raise ConfigError(f"program cost: need nodes >= 1, cache_len >= 0, batch >= 1; got "
                          f"{nodes}, {cache_len}, {batch}")
    dtype = _dtype(dtype)
    graphdef, params = abstract_model(model_config, dtype)
    r_full = model_config.num_loops
    size = cache_length_for(cache_len, 0, nodes, model_config.max_position_embeddings)
    cache = jax.eval_shape(lambda: KVCache.init(
        model_config.cache_slots, batch, size, model_config.num_kv_heads,
        model_config.head_dim, dtype, per_layer=False))
    tree = jax.eval_shape(lambda: LoopTree.init(
        jnp.zeros((batch,), jnp.int32), jnp.zeros((batch,), jnp.int32), nodes,
        model_config.hidden_size, dtype, 1))

    def step(params, cache, tree, length):
        model = nnx.merge(graphdef, params)
        cache = cache.replace(length=length)
        e, _ = model.embed(tree.token, tree.pos,
                           tree.attention_mask(cache, (~tree.fresh).astype(jnp.int32)), cache)
        h = jnp.where(tree.fresh[..., None], model.initial_state(e, tree.pos), tree.h)
        d_in = jnp.minimum(tree.depth, r_full - 1)
        h, kv = model.advance(h, e, d_in, tree.pos, tree.attention_mask(cache, d_in), cache)
        d_out = jnp.clip(tree.depth + 1, 1, r_full)
        logits, coda_kv = model.readout(h, d_out, tree.pos, tree.attention_mask(cache, d_out),
                                        cache)
        return logits, h, kv, coda_kv

    compiled = jax.jit(step).lower(params, cache, tree,
                                   jax.ShapeDtypeStruct((batch,), jnp.int32)).compile()
    return _read_cost(compiled, params, (cache.k, cache.v), tokens=nodes, cache_len=cache_len,
                      cache_size=size, itemsize=dtype.itemsize)
