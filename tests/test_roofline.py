"""The roofline model (`lookahead_jax.tuning.roofline`) and its benchmark command."""

from __future__ import annotations

import dataclasses
import json
import os

import pytest

from lookahead_jax.store.presets import load_preset
from lookahead_jax.tuning import roofline as rf
from lookahead_jax.tuning.program_cost import (ProgramCost, forward_cost, method_cost,
                                              tree_step_cost)
from models.config import ConfigError, LoopedConfig


def _cost(flops: float, nbytes: float, weight_bytes: int = 1000, cache_bytes: int = 0,
          tokens: int = 1, itemsize: int = 4) -> ProgramCost:
    return ProgramCost(flops=flops, bytes_accessed=nbytes, weight_bytes=weight_bytes,
                       cache_bytes=cache_bytes, argument_bytes=0, output_bytes=0, temp_bytes=0,
                       tokens=tokens, cache_len=0, cache_size=128, itemsize=itemsize,
                       backend="cpu")


@pytest.fixture(scope="module")
def llama7b_plain() -> ProgramCost:
    return method_cost(load_preset("llama7b").model, "ar", cache_len=512)


def test_device_table_is_positive_and_sourced():
    names = [d.name for d in rf.DEVICES]
    assert len(names) == len(set(names)) == 9
    for d in rf.DEVICES:
        assert d.peak_flops > 1e13 and d.bandwidth > 1e11 and d.memory > 1e10, d
        assert d.overhead_s >= 0 and len(d.source) > 20, d
    assert rf.device("H100 SXM").peak_flops == pytest.approx(989e12)  # dense, not sparse
    assert rf.device("L4").peak_flops == pytest.approx(121e12)
    with pytest.raises(ValueError):
        rf.Device("bad", 0.0, 1.0, 1.0, "x")


def test_one_token_llama7b_step_is_memory_bound_on_a100(llama7b_plain):
    a100 = rf.device("A100 80GB SXM")
    mem, comp = rf.memory_time(llama7b_plain, a100), rf.compute_time(llama7b_plain, a100)
    assert mem > 10 * comp
    assert rf.bound(llama7b_plain, a100) == "memory"
    # ~13.5 GB of bfloat16 weights at 2,039 GB/s: about 6.6 ms
    assert 5e-3 < mem < 9e-3
    bare = dataclasses.replace(a100, overhead_s=0.0)
    assert rf.predict_step_time(llama7b_plain, bare, layers=32) == pytest.approx(mem)
    assert rf.predict_step_time(llama7b_plain, a100, layers=32) == pytest.approx(
        mem + 32 * a100.overhead_s)


def test_max_picks_the_larger_side():
    dev = rf.Device("toy", peak_flops=100.0, bandwidth=10.0, memory=1e9, source="toy",
                    overhead_s=0.0)
    memory_bound = _cost(flops=100.0, nbytes=40.0, itemsize=2)  # 4 s of bytes, 1 s of FLOPs
    compute_bound = _cost(flops=1000.0, nbytes=40.0, itemsize=2)  # 4 s of bytes, 10 s
    assert rf.predict_step_time(memory_bound, dev, 2, layers=1) == pytest.approx(4.0)
    assert rf.predict_step_time(compute_bound, dev, 2, layers=1) == pytest.approx(10.0)
    assert rf.bound(compute_bound, dev, 2) == "compute"
    # bytes read from a float32 program scale to bfloat16
    assert rf.memory_time(_cost(0.0, 40.0, itemsize=4), dev, 2) == pytest.approx(2.0)
    with_overhead = dataclasses.replace(dev, overhead_s=0.5)
    assert rf.predict_step_time(memory_bound, with_overhead, 2, layers=3) == pytest.approx(5.5)


def test_speedup_formula():
    assert rf.speedup(2.0, plain_time=1.0, method_time=1.25) == pytest.approx(1.6)
    assert rf.speedup(1.0, 1.0, 1.0) == 1.0
    dev = rf.Device("toy", 100.0, 10.0, 1e9, "toy", overhead_s=0.0)
    plain, la = _cost(1.0, 10.0, itemsize=2), _cost(1.0, 12.0, itemsize=2)
    assert rf.predict_speedup(1.8, plain, la, dev, 2, layers=1) == pytest.approx(1.5)
    with pytest.raises(ValueError):
        rf.speedup(2.0, 0.0, 1.0)


def test_calibrated_overhead_reproduces_the_ratio():
    dev = rf.Device("toy", 1e6, 10.0, 1e9, "toy", overhead_s=0.0)
    plain, la = _cost(0.0, 10.0, itemsize=2), _cost(0.0, 20.0, itemsize=2)  # 1 s and 2 s
    o = rf.calibrate_overhead(plain, la, dev, ratio=1.1, layers=4, itemsize=2)
    cal = dataclasses.replace(dev, overhead_s=o)
    t_p = rf.predict_step_time(plain, cal, 2, layers=4)
    assert rf.predict_step_time(la, cal, 2, layers=4) / t_p == pytest.approx(1.1)
    assert rf.calibrate_overhead(plain, plain, dev, ratio=1.1, layers=4, itemsize=2) == 0.0


def test_llama13b_does_not_fit_an_l4():
    cost = method_cost(load_preset("llama13b").model, "ar", cache_len=512)
    nbytes = rf.model_bytes(cost)  # bfloat16 weights + cache
    assert 24e9 < nbytes < 30e9
    assert not rf.fits(nbytes, rf.device("L4"))
    assert rf.fits(nbytes, rf.device("A100 40GB SXM"))


def test_looped_token_time_is_steps_per_token_times_a_step():
    dev = rf.Device("toy", 1e6, 10.0, 1e9, "toy", overhead_s=0.01)
    step = _cost(4.0, 20.0, itemsize=2)
    t1 = rf.predict_looped_token_time(1.0, step, dev, 2, layers=2)
    assert t1 == pytest.approx(2.0 + 0.02)
    assert rf.predict_looped_token_time(4.0, step, dev, 2, layers=2) == pytest.approx(4 * t1)
    assert rf.predict_looped_token_time(0.25, step, dev, 2, layers=2) == pytest.approx(t1 / 4)
    with pytest.raises(ValueError):
        rf.predict_looped_token_time(-1.0, step, dev, 2, layers=2)


def test_pass_layers_counts_prelude_and_coda_once():
    smol = load_preset("smol_loop").model  # prelude 12, a block of 2 x 4 loops, coda 10
    assert rf.pass_layers(smol, smol.num_loops) == 30  # SmolLM2's own depth
    assert rf.pass_layers(smol, 1) == 24
    ouro = load_preset("tiny_ouro").model
    assert rf.pass_layers(ouro, 1) == ouro.loop_layers
    assert rf.pass_layers(ouro, ouro.num_loops) == ouro.num_loops * ouro.loop_layers


RECURSIVE = LoopedConfig(family="recursive", vocab_size=512, hidden_size=64,
                         intermediate_size=128, num_heads=4, num_kv_heads=2, num_loops=4,
                         prelude_layers=2, core_layers=1, coda_layers=2, rope_theta=1e4,
                         tie_word_embeddings=True, max_position_embeddings=512,
                         bos_token_id=1, eos_token_ids=(2,))


def test_tree_step_reads_the_prelude_block_and_coda():
    """A tree step runs the prelude, one loop and the coda with the head: it reads about every
    weight once, more than a pass of one loop without the readout, and its FLOPs grow with
    the tree's nodes."""
    step = tree_step_cost(RECURSIVE, nodes=8, cache_len=64)
    one_loop = forward_cost(RECURSIVE, tokens=8, cache_len=64, loops=1)
    assert step.tokens == 8 and step.weight_bytes > 0
    assert step.bytes_accessed >= 0.9 * step.weight_bytes
    assert step.bytes_accessed > one_loop.bytes_accessed
    assert step.flops > one_loop.flops
    assert tree_step_cost(RECURSIVE, nodes=16, cache_len=64).flops > 1.5 * step.flops
    with pytest.raises(ConfigError):
        tree_step_cost(load_preset("smollm2_135m").model, nodes=4, cache_len=64)


def test_quick_benchmark_writes_json_and_markdown(tmp_path):
    from benchmarks import roofline as bench

    rec = bench.run(bench.parse_args(["--quick", "--out", str(tmp_path),
                                      "--presets", "smollm2_135m"]))
    with open(os.path.join(tmp_path, "roofline.json"), encoding="utf-8") as f:
        data = json.load(f)
    for key in ("devices", "this_machine", "overhead", "presets", "paper", "cpu", "looped",
                "sweep", "cache_len"):
        assert key in data, key
    assert data["overhead"]["per_layer_s"] >= 0
    row = data["presets"][0]
    for key in ("preset", "device", "setting", "plain_tokens_per_s", "step_ms",
                "step_in_plain", "S", "S_source", "speedup", "fits"):
        assert key in row, key
    assert {r["setting"] for r in data["presets"]} >= {"ar", "lookahead (15,5,15)"}
    assert all(r["speedup"] > 0 for r in data["presets"])
    assert any(r["S"] is not None and r["S"] > 1 for r in data["paper"])
    assert rec["looped"] and {r["method"] for r in rec["looped"]} >= {"plain", "loopahead"}
    with open(os.path.join(tmp_path, "roofline.md"), encoding="utf-8") as f:
        md = f.read()
    for section in ("## Devices", "## Preset x device x setting", "## Paper check",
                    "## This CPU", "## Looped models", "this machine"):
        assert section in md, section
