"""Memory per device under tensor parallelism, read from the compiled program and from the
placed arrays (`program_cost.forward_cost(..., mesh=...)`, `lookahead_jax.mesh`).

The mesh tests need 8 devices, which XLA creates on CPU only if
XLA_FLAGS=--xla_force_host_platform_device_count=8 is set before JAX starts, so
`test_on_8_cpu_devices` runs this file again in its own process with that flag (as
tests/test_parallel.py does); the tests marked `needs8` skip in the parent process.

Pinned there:
  * Llama-2-70B and CodeLlama-34B in bfloat16, real shapes, lowered from abstract arrays
    (nothing materialised), one plain decode step over a 4096-slot KV cache, on an 8-device
    mesh (model:8; and lookahead:2,model:4 for 34B). XLA's memory analysis of an SPMD program is
    one device's: its argument bytes must equal this test's own count of one device's shards,
    weights split 8 (or 4) ways plus the replicated remainder, the RMSNorm weights
    ((2 x layers + 1) x hidden x 2 bytes: 2.6 MB for 70B, 1.6 MB for 34B), plus the cache
    split over its 8 KV heads, plus the step's token id and length (8 bytes). Arguments and
    outputs must leave three quarters of an 80 GB accelerator free.
  * Temporaries: XLA's CPU backend has no bfloat16 matmul and converts bfloat16 operands to
    float32 temporaries, so the CPU's temp bytes for a bfloat16 program (about 2x the weight
    shard) overstate an accelerator's. They are printed, and only bounded by that conversion
    (at most a float32 copy of the weight shard). What an accelerator would allocate is
    checked on the float32 program of the same 70B step (the program a GPU or TPU runs, with
    no conversion): its temporaries stay under 1% of the cache shard (no copy of the cache or
    of a weight anywhere).
  * A small Llama with real, placed weights on meshes (1,8), (2,4), (4,2), (8,1), with 8 KV
    heads and with 2 (grouped-query attention: K/V projections and the cache are replicated
    where the model axis does not divide the KV heads): each device's bytes
    (`mesh.bytes_per_device`) are total / model axis + the replicated remainder, the
    remainder listed here by parameter name; the compiled program's per-device argument bytes
    agree with the placed shards.
"""

from __future__ import annotations

import dataclasses
import math
import os
import sys

import jax
import jax.numpy as jnp
import pytest
from flax import nnx
from jax.sharding import PartitionSpec

from lookahead_jax.mesh import bytes_per_device, make_mesh, shard_cache, shard_params
from lookahead_jax.store.presets import load_preset
from lookahead_jax.tuning import program_cost as pc
from lookahead_jax.tuning import roofline as rf
from models.config import LlamaConfig
from models.kv_cache import KVCache
from models.llama import Llama

sys.path.insert(0, os.path.dirname(__file__))
from multidevice import ON_8_CPU_DEVICES, needs8, rerun_on_8_cpu_devices  # noqa: E402

SMALL = LlamaConfig(vocab_size=2048, hidden_size=256, intermediate_size=1024, num_layers=4,
                    num_heads=8, num_kv_heads=8, max_position_embeddings=4096)
# grouped-query attention with fewer KV heads than a model axis of 4 or 8: K/V replicated there
SMALL_GQA = dataclasses.replace(SMALL, num_kv_heads=2)


NEEDS8_TESTS = 12  # tests that must pass in the child process (the needs8 ones, at least)


@pytest.mark.skipif(ON_8_CPU_DEVICES, reason="already running on 8 CPU devices")
def test_on_8_cpu_devices():
    rerun_on_8_cpu_devices(__file__, min_passed=NEEDS8_TESTS)


# -- pure parts (any process) ----------------------------------------------------------------------
def test_split_factor_and_bytes_from_specs():
    sizes = {"lookahead": 2, "model": 4}
    assert pc.split_factor(PartitionSpec(), sizes) == 1
    assert pc.split_factor(PartitionSpec(None, "model"), sizes) == 4
    assert pc.split_factor(PartitionSpec(("lookahead", "model"), None), sizes) == 8
    tree = {"a": jax.ShapeDtypeStruct((16, 8), jnp.bfloat16),
            "b": jax.ShapeDtypeStruct((8,), jnp.float32)}
    specs = {"a": PartitionSpec(None, "model"), "b": PartitionSpec()}
    assert pc.bytes_per_device_from_specs(tree, specs, sizes) == 16 * 8 * 2 // 4 + 8 * 4
    with pytest.raises(ValueError, match="specs"):
        pc.bytes_per_device_from_specs(tree, {"a": PartitionSpec()}, sizes)


def test_one_device_cost_has_whole_model_per_device():
    c = pc.forward_cost(SMALL, tokens=1, cache_len=127)
    assert (c.mesh, c.devices) == ("", 1)
    assert c.weight_bytes_per_device == c.weight_bytes
    assert c.cache_bytes_per_device == c.cache_bytes
    assert c.ideal_bytes == c.weight_bytes + c.cache_bytes


def test_allreduce_terms():
    h100, v5e = rf.device("H100 SXM"), rf.device("TPU v5e")
    assert h100.interconnect == pytest.approx(450e9) and v5e.interconnect == pytest.approx(200e9)
    assert "NVLink" in h100.interconnect_source and "ICI" in v5e.interconnect_source
    assert rf.allreduce_time(1e6, 1, h100) == 0.0
    assert rf.allreduce_time(1e6, 8, h100) == pytest.approx(2 * 7 / 8 * 1e6 / 450e9)
    with pytest.raises(ValueError, match="interconnect"):
        rf.allreduce_time(1e6, 8, rf.device("L4"))
    cfg = load_preset("llama70b").model
    assert rf.tp_allreduce_bytes(cfg, 120) == 120 * 8192 * 2
    # (15,5,15) on 8 H100s: 160 all-reduces of 1.97 MB, about 1.2 ms per step
    t = rf.tp_collective_time(cfg, 120, 8, h100)
    assert t == pytest.approx(160 * 2 * 7 / 8 * 120 * 8192 * 2 / 450e9)
    assert 1e-3 < t < 1.5e-3


# -- 70B and 34B on 8 devices, from abstract shapes ----------------------------------------------
CACHE_LEN = 4095  # committed tokens before the step: with the step's token, 4096 slots
GB80 = 80e9


def expected_shards(cfg: LlamaConfig, model: int, itemsize: int, slots: int) -> dict[str, int]:
    """One device's bytes, counted from the model's shape (not from the specs): every matrix
    (embedding, q/k/v/o, gate/up/down, LM head) split over `model` devices along heads, MLP
    hidden or vocabulary; the RMSNorm weights replicated; the cache split over KV heads."""
    e, f, v, layers = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size, cfg.num_layers
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    for split in (q, kv, f, v, cfg.num_kv_heads):
        assert split % model == 0, (split, model)  # so the rules split every matrix
    matrices = v * e + layers * (e * q + 2 * e * kv + q * e + 3 * e * f) + e * v
    replicated = (2 * layers + 1) * e  # input / post-attention norms, the final norm
    cache = 2 * layers * cfg.num_kv_heads * slots * cfg.head_dim
    return dict(total=(matrices + replicated) * itemsize, replicated=replicated * itemsize,
                weights=(matrices // model + replicated) * itemsize,
                cache=cache // model * itemsize, cache_total=cache * itemsize)


@pytest.fixture(scope="module")
def mesh_costs():
    """(preset, mesh, dtype) -> ProgramCost of a plain step, compiled once per module."""
    memo = {}

    def get(preset: str, mesh: str, dtype: str = "bfloat16"):
        key = (preset, mesh, dtype)
        if key not in memo:
            memo[key] = pc.method_cost(load_preset(preset).model, "ar", cache_len=CACHE_LEN,
                                       dtype=dtype, mesh=make_mesh(mesh))
        return memo[key]

    return get


@needs8
@pytest.mark.parametrize("preset,mesh", [("llama70b", "lookahead:1,model:8"),
                                         pytest.param("codellama34b", "lookahead:1,model:8",
                                                      marks=pytest.mark.slow),  # CI's time
                                         ("codellama34b", "lookahead:2,model:4")])
def test_big_model_fits_per_device(mesh_costs, preset, mesh):
    cfg = load_preset(preset).model
    model = int(mesh.rsplit(":", 1)[1])
    c = mesh_costs(preset, mesh)
    assert (c.mesh, c.devices, c.cache_size, c.itemsize) == (mesh, 8, 4096, 2)
    want = expected_shards(cfg, model, 2, c.cache_size)
    assert c.weight_bytes == want["total"] and c.cache_bytes == want["cache_total"]
    assert c.weight_bytes_per_device == want["weights"]
    assert c.cache_bytes_per_device == want["cache"]
    # the compiled program's arguments are one device's shards (+ token id and length, int32)
    assert abs(c.argument_bytes - (want["weights"] + want["cache"] + 8)) <= 1024
    # outputs: logits and the step's K/V, at most their whole (unsplit) size
    whole_out = 4 * cfg.vocab_size + 2 * 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim
    assert c.output_bytes <= whole_out + 1024
    # the CPU's bfloat16 temporaries: float32 copies of weights, never more than the shard x 2
    assert c.temp_bytes <= 2 * c.weight_bytes_per_device * 1.02
    print(f"\n{preset} {mesh} bf16, 4096-slot cache, per device: arguments "
          f"{c.argument_bytes / 1e9:.3f} GB (weights {c.weight_bytes_per_device / 1e9:.4f} = "
          f"{want['total'] / 1e9:.3f} / {model} + (1 - 1/{model}) x "
          f"{want['replicated'] / 1e6:.2f} MB of replicated RMSNorm weights; cache "
          f"{c.cache_bytes_per_device / 1e6:.1f} MB), outputs {c.output_bytes / 1e3:.1f} kB, "
          f"CPU temp {c.temp_bytes / 1e9:.2f} GB (bf16 upcast; not an accelerator's)")
    assert c.argument_bytes + c.output_bytes < 0.25 * GB80  # three quarters of 80 GB free


@needs8
def test_70b_float32_program_has_no_large_temporaries(mesh_costs):
    """The float32 program is what an accelerator runs for a bfloat16 model (no operand
    conversion); its temporaries are one token's activations."""
    c = mesh_costs("llama70b", "lookahead:1,model:8", "float32")
    print(f"\nllama70b model:8 float32 plain step per device: temp {c.temp_bytes / 1e6:.2f} MB, "
          f"cache shard {c.cache_bytes_per_device / 1e6:.0f} MB, bytes accessed "
          f"{c.bytes_accessed / 1e9:.2f} GB = x{c.excess:.3f} of weights + cache shards")
    assert c.temp_bytes < 0.01 * c.cache_bytes_per_device
    assert 0.95 <= c.excess <= 1.02  # each device reads its shards once


# -- a small model, real weights, every mesh shape ------------------------------------------------
NORMS = ("input_layernorm", "post_attention_layernorm", "norm")  # RMSNorm modules: replicated
KV_PROJ = ("k_proj", "v_proj")  # replicated where the model axis does not divide the KV heads


def _names(path) -> list[str]:
    return [str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))) for k in path]


def _nbytes(x) -> int:
    return math.prod(x.shape) * jnp.dtype(x.dtype).itemsize


def _nbytes_tree(tree) -> int:
    return sum(_nbytes(x) for x in jax.tree.leaves(tree))


def small_cache(cfg: LlamaConfig, slots: int) -> KVCache:
    """The model's KV cache as `Llama.init_cache` lays it out (one array per layer)."""
    return KVCache.init(cfg.num_layers, 1, slots, cfg.num_kv_heads, cfg.head_dim, jnp.float32,
                        per_layer=True)


@pytest.fixture(scope="module")
def small_params():
    return {cfg.num_kv_heads: nnx.split(Llama(cfg, rngs=nnx.Rngs(0)))[1]
            for cfg in (SMALL, SMALL_GQA)}


@needs8
@pytest.mark.parametrize("cfg", [SMALL, SMALL_GQA], ids=["kv8", "kv2"])
@pytest.mark.parametrize("shape", [(1, 8), (2, 4), (4, 2), (8, 1)])
def test_small_model_bytes_per_device(small_params, cfg, shape):
    """bytes per device = (total - replicated) / model axis + replicated, the replicated
    parameters listed here by name: the RMSNorm weights, and K/V projections where the model
    axis does not divide the KV heads (the cache is then replicated too)."""
    lookahead, model = shape
    mesh = make_mesh(f"lookahead:{lookahead},model:{model}")
    params = small_params[cfg.num_kv_heads]
    kv_split = cfg.num_kv_heads % model == 0
    leaves = jax.tree_util.tree_leaves_with_path(params)
    total = sum(_nbytes(x) for _, x in leaves)
    replicated = sum(_nbytes(x) for p, x in leaves if any(n in NORMS for n in _names(p)))
    assert replicated == (2 * cfg.num_layers + 1) * cfg.hidden_size * 4
    if model > 1 and not kv_split:
        replicated += sum(_nbytes(x) for p, x in leaves if any(n in KV_PROJ for n in _names(p)))
    want = (total - replicated) // model + replicated
    per = bytes_per_device(shard_params(params, mesh, cfg))
    assert sorted(per) == sorted(d.id for d in jax.devices()[:8])
    assert set(per.values()) == {want}, (per, want)
    cache = shard_cache(small_cache(cfg, 128), mesh)
    cache_total = _nbytes_tree((cache.k, cache.v))
    cache_want = cache_total // model if kv_split else cache_total
    assert set(bytes_per_device((cache.k, cache.v)).values()) == {cache_want}
    # the compiled program of a step over the same shapes sees the same shards
    c = pc.forward_cost(cfg, tokens=1, cache_len=127, mesh=mesh)
    assert c.cache_size == 128
    assert c.weight_bytes_per_device == want and c.cache_bytes_per_device == cache_want
    assert c.argument_bytes == want + cache_want + 8


@needs8
def test_mesh_bench_quick(tmp_path):
    """`python -m benchmarks.mesh_bench --quick` end to end (smaller than the committed run)."""
    import json  # noqa: PLC0415

    from benchmarks import mesh_bench  # noqa: PLC0415 - sets XLA_FLAGS on import (already set)

    rec = mesh_bench.run(mesh_bench.parse_args(
        ["--quick", "--max_new_tokens", "8", "--out", str(tmp_path)]))
    rows = json.loads((tmp_path / "mesh_bench.json").read_text())["measured"]["rows"]
    assert {r["mesh"] for r in rows} == {"lookahead:1,model:1", "lookahead:1,model:8",
                                         "lookahead:2,model:4"}
    assert all(r["same_as_plain"] for r in rows)  # greedy: every mesh, every method
    by = {(r["mesh"], r["method"]): r for r in rows}
    one, tp8 = by["lookahead:1,model:1", "plain"], by["lookahead:1,model:8", "plain"]
    assert tp8["params_bytes_per_device"] < one["params_bytes_per_device"] / 7
    assert by["lookahead:2,model:4", "lookahead (15,5,15)"]["tokens_per_device"] == 76
    pred = rec["predicted"]["rows"]
    assert {r["device"] for r in pred} == {"H100 SXM", "TPU v5e"}
    assert all(r["allreduce_ms"] > 0 and r["step_ms"] > r["bare_step_ms"] for r in pred)
    assert (tmp_path / "mesh_bench.md").read_text().startswith("# Tensor x lookahead")
