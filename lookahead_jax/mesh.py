"""The device mesh: lookahead parallelism on one axis, tensor parallelism on the other.

A mesh has two axes, `lookahead` x `model` (`parse_mesh("lookahead:2,model:4")`):

  model      tensor parallelism. Parameters and the KV cache are sharded by `models.sharding`'s
             rules (heads, MLP hidden, vocabulary) and every program runs under `jax.jit`
             with those shardings; XLA's partitioner adds the all-reduces over this axis.
  lookahead  lookahead parallelism (`lookahead_jax.lookahead.parallel`): each group of
             `model` devices runs its share of a lookahead step's window and candidates inside a
             `jax.shard_map` that is manual over this axis only; the groups exchange token ids.
             Methods without lookahead parallelism run replicated over this axis.

The same code runs on one host or many: after `init_distributed` (`jax.distributed`), the mesh
spans every process's devices, each process feeds the same prompts and runs the same program,
and `to_host` reads a result on any process.
"""

from __future__ import annotations

import dataclasses
import math
import os
import socket
import time
from typing import Any

import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from models.config import ConfigError
from models.kv_cache import KVCache
from models.sharding import MODEL, cache_specs, param_specs, shardings

LOOKAHEAD = "lookahead"
AXES = (LOOKAHEAD, MODEL)


@dataclasses.dataclass(frozen=True)
class MeshShape:
    """How many devices each axis has (lookahead x model)."""

    lookahead: int = 1
    model: int = 1

    def __post_init__(self):
        if self.lookahead < 1 or self.model < 1:
            raise ConfigError(f"mesh axes need at least 1 device each, got {self}")

    @property
    def size(self) -> int:
        return self.lookahead * self.model

    def __str__(self) -> str:
        return f"{LOOKAHEAD}:{self.lookahead},{MODEL}:{self.model}"


def parse_mesh(text: str) -> MeshShape:
    """'lookahead:2,model:4' (either axis may be left out: 1 device) -> MeshShape."""
    sizes: dict[str, int] = {}
    for part in (p.strip() for p in text.split(",") if p.strip()):
        name, sep, value = part.partition(":")
        name = name.strip()
        if not sep or name not in AXES:
            raise ConfigError(f"--mesh: expected axis:size pairs over {', '.join(AXES)} "
                              f"(e.g. lookahead:2,model:4), got {text!r}")
        if name in sizes:
            raise ConfigError(f"--mesh: axis {name!r} given twice in {text!r}")
        try:
            sizes[name] = int(value)
        except ValueError:
            raise ConfigError(f"--mesh: the size of {name!r} must be an integer, got "
                              f"{value!r}") from None
    return MeshShape(**sizes)


def make_mesh(shape: MeshShape | str, devices: list | None = None) -> Mesh:
    """A (lookahead, model) Mesh over the first shape.size of `devices` (default: all devices,
    of every process). Devices of one model group are adjacent, so that tensor parallelism's
    all-reduces stay on the closest links."""
    if isinstance(shape, str):
        shape = parse_mesh(shape)
    found = list(jax.devices() if devices is None else devices)
    if shape.size > len(found):
        hint = (" (on CPU, XLA_FLAGS=--xla_force_host_platform_device_count=N creates N devices)"
                if found and found[0].platform == "cpu" else "")
        raise ConfigError(f"mesh {shape} needs {shape.size} devices, {len(found)} available{hint}; "
                          f"choose another with --mesh (Engine(mesh=...))")
    grid = np.array(found[:shape.size], dtype=object).reshape(shape.lookahead, shape.model)
    return Mesh(grid, AXES)


def mesh_shape(mesh: Mesh) -> MeshShape:
    return MeshShape(int(mesh.shape.get(LOOKAHEAD, 1)), int(mesh.shape.get(MODEL, 1)))


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, PartitionSpec())


def put_global(tree: Any, mesh: Mesh, specs: Any = None) -> Any:
    """Host values (the same on every process) -> global arrays on `mesh` with `specs`
    (default: replicated). On one process this is `jax.device_put`; on several, each process
    places only the shards its own devices hold."""
    if specs is None:
        specs = jax.tree.map(lambda _: PartitionSpec(), tree)
    sh = shardings(specs, mesh)

    def put(x, s):
        if jax.process_count() == 1:
            return jax.device_put(x, s)
        if isinstance(x, jax.Array) and x.sharding == s:
            return x
        if isinstance(x, jax.Array) and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
            data = put(jax.random.key_data(x), NamedSharding(mesh, PartitionSpec()))
            return jax.random.wrap_key_data(data, impl=jax.random.key_impl(x))
        host = np.asarray(x)
        return jax.make_array_from_callback(host.shape, s, lambda idx: host[idx])

    return jax.tree.map(put, tree, sh)


def shard_params(params: Any, mesh: Mesh, config) -> Any:
    """A model's parameter state (its config: `config`) placed on `mesh` by `models.sharding`'s
    rules."""
    return put_global(params, mesh, param_specs(params, mesh, config))


def shard_cache(cache: Any, mesh: Mesh) -> Any:
    """A KV cache placed on `mesh`: split over KV heads where the model axis divides them."""
    return put_global(cache, mesh, cache_specs(cache, mesh))


def state_shardings(tree: Any, mesh: Mesh) -> Any:
    """Shardings for a decoding state (or any tree holding a `KVCache`): the cache's K/V by
    `models.sharding.cache_specs`, everything else (token ids, the window, the pool, counters)
    replicated. The engine compiles its programs with these as output shardings, so that a
    state leaves one program laid out as the next one expects it."""
    def one(x):
        if isinstance(x, KVCache):
            return cache_specs(x, mesh)
        return jax.tree.map(lambda _: PartitionSpec(), x)
    specs = jax.tree.map(one, tree, is_leaf=lambda x: isinstance(x, KVCache))
    return shardings(specs, mesh)


def to_host(x: jax.Array) -> np.ndarray:
    """The whole value of a (possibly multi-process) array on this host."""
    if not isinstance(x, jax.Array) or x.is_fully_addressable:
        return np.asarray(x)
    if x.sharding.is_fully_replicated:
        return np.asarray(x.addressable_data(0))
    return np.asarray(multihost_utils.process_allgather(x, tiled=True))


def bytes_per_device(tree: Any) -> dict[int, int]:
    """Device id -> bytes of `tree`'s shards that device holds (this process's devices)."""
    out: dict[int, int] = {}
    for x in jax.tree.leaves(tree):
        for shard in x.addressable_shards:
            out[shard.device.id] = out.get(shard.device.id, 0) + (
                math.prod(shard.data.shape) * shard.data.dtype.itemsize)
    return out


def host_state(state: Any) -> Any:
    """A decoding state with every small leaf read to this host (for `Method.summary` on any
    process); the KV cache and PRNG keys stay where they are."""
    def one(x):
        if isinstance(x, KVCache) or not isinstance(x, jax.Array):
            return x
        if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
            return x
        return to_host(x)
    return jax.tree.map(one, state, is_leaf=lambda x: isinstance(x, KVCache))


# ---- multi-host -------------------------------------------------------------------------------

def init_distributed(coordinator_address: str | None = None, num_processes: int | None = None,
                     process_id: int | None = None, *, timeout_s: int = 60,
                     cpu_collectives: str = "gloo") -> None:
    """`jax.distributed.initialize` with bounded waits and clear errors.

    Arguments left None are read by JAX from its environment (JAX_COORDINATOR_ADDRESS,
    JAX_NUM_PROCESSES, JAX_PROCESS_ID, or a cluster's own variables). On CPU the processes
    exchange data through `cpu_collectives` (gloo). Every wait is bounded by `timeout_s`:
      * a process other than 0 first checks that the coordinator's address accepts a
        connection, and raises ConfigError if it does not within timeout_s (a wrong address);
      * JAX's own join, heartbeat and shutdown timeouts are timeout_s: a process that never
        joins makes the others abort (JAX's DEADLINE_EXCEEDED) after about timeout_s, not hang;
      * after joining, a process told a different process count than the coordinator's
        raises ConfigError.
    """
    if num_processes is not None and num_processes < 1:
        raise ConfigError(f"--num_processes must be >= 1, got {num_processes}")
    if process_id is not None and num_processes is not None and not 0 <= process_id < num_processes:
        raise ConfigError(f"--process_id must be in [0, {num_processes}), got {process_id}")
    if timeout_s < 1:
        raise ConfigError(f"the distributed timeout must be >= 1 s, got {timeout_s}")
    address = coordinator_address or os.environ.get("JAX_COORDINATOR_ADDRESS")
    if address and process_id not in (None, 0):
        wait_for_coordinator(address, timeout_s)
    if cpu_collectives and "cpu" in os.environ.get("JAX_PLATFORMS", "cpu"):
        jax.config.update("jax_cpu_collectives_implementation", cpu_collectives)
    jax.distributed.initialize(coordinator_address=coordinator_address,
                               num_processes=num_processes, process_id=process_id,
                               initialization_timeout=timeout_s,
                               heartbeat_timeout_seconds=timeout_s,
                               shutdown_timeout_seconds=timeout_s)
    if num_processes is not None and jax.process_count() != num_processes:
        raise ConfigError(f"this process was started with --num_processes={num_processes}, but "
                          f"the coordinator at {address} runs {jax.process_count()} processes: "
                          f"give every process the same count")


def wait_for_coordinator(address: str, timeout_s: float) -> None:
    """Returns once host:port accepts a TCP connection; ConfigError after `timeout_s`."""
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise ConfigError(f"coordinator address must be host:port, got {address!r}")
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with socket.create_connection((host.strip("[]"), int(port)), timeout=1.0):
                return
        except OSError as e:
            if time.monotonic() >= deadline:
                raise ConfigError(
                    f"cannot reach the coordinator at {address} within {timeout_s} s "
                    f"({e.strerror or e}): start process 0 there, or fix "
                    f"--coordinator_address") from None
            time.sleep(0.5)
