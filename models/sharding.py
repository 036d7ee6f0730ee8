"""Tensor-parallel sharding rules for every model family: parameters and KV cache over a mesh
axis named `MODEL` ("model").

The rules live in one place, in two tables (the logical-axis style of MaxText and
jax-llm-examples):

  PARAM_AXES    a parameter's name (its module's name and its own) -> the logical axis of each
                of its dimensions, e.g. q_proj's kernel [embed, heads]
  LOGICAL_RULES a logical axis -> the mesh axis that splits it (None: replicated)

so attention heads and the MLP's hidden dimension are split (q/k/v and gate/up column-parallel,
o and down row-parallel: one all-reduce after each of them per layer), KV heads are split
where their count divides the model axis and replicated where it does not (GQA with fewer KV
heads than devices), and the embedding and the LM head are split over the vocabulary.
A dimension that the mesh axis does not divide is replicated instead (`spec_for` says which).
Norm weights (Gemma's extra norms, Qwen 3's per-head q/k norms), the output projection's bias,
gates and anything unnamed are replicated: they are a vector per layer. The q/k/v biases are
split with their projection's heads.

The rules are layout hints, never semantics: a program over sharded arrays computes the same
function under `jax.jit` whatever the shardings (XLA's partitioner inserts the collectives),
so a rule can only make a model slower, not wrong. Only the order of a row-parallel matmul's
float additions changes (round-off).

Layers are not scanned. The Llama model keeps a Python loop over layers and one KV-cache array
per layer: XLA reads separate arrays where they lie, while a scan's per-layer slice of a
stacked cache inside the decoding loop is copied (#18 measured a whole-cache copy per layer
and step on the CPU program). The price is compile time, which grows with the layer count.
"""

from __future__ import annotations

from typing import Any

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

MODEL = "model"

# (module name, parameter name) -> logical axes of its dimensions
PARAM_AXES: dict[tuple[str, str], tuple[str | None, ...]] = {
    # Llama and Ouro (Hugging Face names); nnx.Linear kernels are [in, out]
    ("q_proj", "kernel"): ("embed", "heads"),
    ("k_proj", "kernel"): ("embed", "kv_heads"),
    ("v_proj", "kernel"): ("embed", "kv_heads"),
    ("o_proj", "kernel"): ("heads", "embed"),
    ("gate_proj", "kernel"): ("embed", "mlp"),
    ("up_proj", "kernel"): ("embed", "mlp"),
    ("down_proj", "kernel"): ("mlp", "embed"),
    ("embed_tokens", "embedding"): ("vocab", "embed"),
    ("lm_head", "kernel"): ("embed", "vocab"),
    # Qwen 2.5's q/k/v biases: split with their projection's output heads
    ("q_proj", "bias"): ("heads",),
    ("k_proj", "bias"): ("kv_heads",),
    ("v_proj", "bias"): ("kv_heads",),
    # Raven (Huginn's names): fused q|k|v, the sandwich block's MLP and projections
    ("Wqkv", "kernel"): ("embed", "qkv"),
    ("fc", "kernel"): ("embed", "mlp"),
    ("wte", "embedding"): ("vocab", "embed"),
}
# Raven reuses the name `proj` for the attention output [heads, embed] and the MLP output
# [mlp, embed]: both row-parallel
PARAM_AXES[("proj", "kernel")] = ("heads", "embed")

# activations: [B, T, H, D] query heads, [B, T, Hkv, D] keys and values, [B, T, F] the MLP's
# hidden layer, [B, T, E] the residual stream (replicated: each row-parallel output is summed)
HEAD_AXES = ("batch", "seq", "heads", None)
KV_AXES = ("batch", "seq", "kv_heads", None)
MLP_AXES = ("batch", "seq", "mlp")
EMBED_AXES = ("batch", "seq", "embed")
# a KV-cache layer [B, Hkv, S, D] (a stacked cache has a layer axis in front)
CACHE_AXES = ("batch", "kv_heads", None, None)

# logical axis -> mesh axis
LOGICAL_RULES: dict[str, str | None] = {
    "heads": MODEL, "kv_heads": MODEL, "qkv": MODEL, "mlp": MODEL, "vocab": MODEL,
    "embed": None,
    "batch": None, "seq": None,
}


def _names(path) -> list[str]:
    """The names along a pytree key path, or along a tuple of plain keys ("layers", 0, ...)."""
    out = []
    for k in path:
        name = k if isinstance(k, (str, int)) else getattr(
            k, "key", getattr(k, "name", getattr(k, "idx", None)))
        out.append(str(name))
    return [n for n in out if n != "value"]


def logical_axes(path) -> tuple[str | None, ...] | None:
    """The logical axes of the parameter at a pytree key path, or at a tuple of plain keys as
    `nnx.to_flat_state` gives them (None: replicated)."""
    names = _names(path)
    if len(names) < 2:
        return None
    return PARAM_AXES.get((names[-2], names[-1]))


def head_units(config) -> dict[str, int]:
    """How many heads a dimension of each head axis holds, for a model config: a projection's
    [.., H * D] dimension is split only where the heads divide the mesh axis (never inside a
    head)."""
    h, hkv = config.num_heads, config.num_kv_heads
    return {"heads": h, "kv_heads": hkv, "qkv": h + 2 * hkv}


def spec_for(shape: tuple[int, ...], axes: tuple[str | None, ...] | None,
             mesh_shape: dict[str, int], units: dict[str, int] | None = None) -> PartitionSpec:
    """The PartitionSpec of an array of `shape` with logical `axes`: each logical axis mapped by
    LOGICAL_RULES to a mesh axis of `mesh_shape`, kept only where that axis has more than one
    device and divides the dimension, and divides `units[axis]` (the heads the dimension holds,
    `head_units`) where given; otherwise the dimension is replicated."""
    if axes is None or len(axes) != len(shape):
        return PartitionSpec()
    units = units or {}
    out = []
    for dim, ax in zip(shape, axes):
        mesh_axis = LOGICAL_RULES.get(ax) if ax is not None else None
        size = mesh_shape.get(mesh_axis, 1) if mesh_axis else 1
        ok = size > 1 and dim % size == 0 and units.get(ax, size) % size == 0
        out.append(mesh_axis if ok else None)
    return PartitionSpec(*out)


def constrain(x: jax.Array, axes: tuple[str | None, ...]) -> jax.Array:
    """x kept at the sharding its logical `axes` map to on the current mesh (`jax.set_mesh`,
    which the engine sets when it has one); without a mesh, or without a model axis, x as is.
    The models mark their activations with it (heads and the MLP hidden split, the residual
    stream replicated), so the partitioner splits every layer the same way, column-parallel in
    and row-parallel out, instead of choosing per program."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or mesh.shape.get(MODEL, 1) == 1:
        return x
    return jax.lax.with_sharding_constraint(x, spec_for(tuple(x.shape), axes, dict(mesh.shape)))


def param_specs(params: Any, mesh: Mesh, config) -> Any:
    """A PartitionSpec for every leaf of a model's parameter state (`nnx.split(model)[1]`) of
    a model with `config` (its head counts decide where projections split)."""
    shape, units = dict(mesh.shape), head_units(config)
    return jax.tree_util.tree_map_with_path(
        lambda path, x: spec_for(tuple(x.shape), logical_axes(path), shape, units), params)


def param_sharding(key, shape: tuple[int, ...], mesh: Mesh, config) -> NamedSharding:
    """The sharding of one parameter (`key`: its path in the nnx state) of a model with `config`
    on `mesh`; what the checkpoint loaders read each device's part of the tensor into."""
    return NamedSharding(mesh, spec_for(shape, logical_axes(key), dict(mesh.shape),
                                        head_units(config)))


def cache_spec(cache_shape: tuple[int, ...], mesh: Mesh) -> PartitionSpec:
    """A KV-cache array's spec: [B, Hkv, S, D] (one layer) or [L, B, Hkv, S, D] (stacked), split
    over KV heads where the model axis divides them, else replicated."""
    axes = (None,) * (len(cache_shape) - 4) + CACHE_AXES
    return spec_for(cache_shape, axes, dict(mesh.shape))


def cache_specs(cache: Any, mesh: Mesh) -> Any:
    """Specs for a `KVCache`: the K/V arrays by `cache_spec`, everything else replicated."""
    def one(path, x):
        names = _names(path)
        if names and names[0] in ("k", "v") and x.ndim >= 4:
            return cache_spec(tuple(x.shape), mesh)
        return PartitionSpec()
    return jax.tree_util.tree_map_with_path(one, cache)


def shardings(specs: Any, mesh: Mesh) -> Any:
    """NamedShardings on `mesh` for a tree of PartitionSpecs."""
    return jax.tree.map(lambda s: NamedSharding(mesh, s), specs,
                        is_leaf=lambda s: isinstance(s, PartitionSpec))
