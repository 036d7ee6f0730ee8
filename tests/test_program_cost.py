"""The cost of a compiled step, read from the program (`lookahead_jax.tuning.program_cost`):
the waste item 1 of #18 removed stays out.

Bounds, and why: a plain decode step of one token must read every weight and every allocated
cache slot once; everything else it touches is one token's activations (kilobytes beside
gigabytes), so its bytes stay within 2% of weights + cache. Before the cache became head-major
and attention stopped joining it to the step, the same program moved 3% more at a 512-token
cache and 27% more at 4K (a copy of every layer's cache per step). A lookahead step adds its
120 tokens' activations; its attention, run by the fused Pallas kernel on an accelerator, is
accounted as a fused kernel's traffic (`fused_attention_traffic`: XLA cannot see inside a Pallas
call). Measured on this CPU's compile: +16% over the plain step at (15,5,15), from the
activations' unfused elementwise passes; the bound is 20%.
"""

from __future__ import annotations

import pytest

from lookahead_jax.lookahead.layout import StepLayout
from lookahead_jax.store.presets import load_preset
from lookahead_jax.tuning import program_cost as pc
from models.config import ConfigError

LLAMA7B = load_preset("llama7b").model


@pytest.fixture(scope="module")
def plain_7b():
    return {s: pc.method_cost(LLAMA7B, "ar", cache_len=s) for s in (512, 3968)}


@pytest.mark.parametrize("cache_len", [512, 3968])
def test_plain_step_reads_weights_and_cache_once(plain_7b, cache_len):
    c = plain_7b[cache_len]
    assert c.tokens == 1 and c.cache_size >= cache_len + 1 and c.cache_size % 128 == 0
    assert c.weight_bytes == pytest.approx(4 * 6.74e9, rel=0.01)  # Llama-2-7B in float32
    assert c.cache_bytes == 2 * 32 * c.cache_size * 4096 * 4
    print(f"\nllama7b plain step, cache {cache_len}: {c.bytes_accessed / 1e9:.2f} GB, "
          f"weights + cache {c.ideal_bytes / 1e9:.2f} GB (x{c.excess:.3f})")
    assert 0.95 <= c.excess <= 1.02
    assert c.temp_bytes < 0.01 * c.cache_bytes  # no copy of the cache anywhere


def test_lookahead_step_moves_little_more_than_a_plain_step(plain_7b):
    fused = pc.ATTENTIONS["fused"]
    plain = pc.method_cost(LLAMA7B, "ar", cache_len=512, attention=fused)
    look = pc.method_cost(LLAMA7B, "lookahead", dict(W=15, N=5, G=15), cache_len=512,
                          attention=fused)
    dense = pc.method_cost(LLAMA7B, "lookahead", dict(W=15, N=5, G=15), cache_len=512)
    assert look.tokens == StepLayout(15, 5, 15).size
    ratio = look.bytes_accessed / plain.bytes_accessed
    print(f"\nllama7b (15,5,15) step / plain step, cache 512: {ratio:.3f} (fused attention), "
          f"{dense.bytes_accessed / plain_7b[512].bytes_accessed:.3f} (dense attention)")
    assert 1.0 < ratio <= 1.20
    assert plain.bytes_accessed == pytest.approx(plain_7b[512].bytes_accessed, rel=0.01)
    # the dense path writes and reads the step's scores [H, T, S] several times: more bytes
    assert dense.bytes_accessed > look.bytes_accessed
    assert look.flops > 50 * plain.flops  # 120 tokens of work for about the bytes of one


def test_step_shapes():
    la = pc.step_shape("lookahead", dict(W=15, N=5, G=15))
    assert la.tokens == 120 and la.layout == StepLayout(15, 5, 15)
    assert la.logits_rows == 1 + 15 + 15 * 4
    assert pc.step_shape("ar") == pc.StepShape(1)
    assert pc.step_shape("prompt_lookup", dict(num_tokens=7)).tokens == 8
    assert pc.step_shape("prompt_lookup").tokens == 11  # the method's default 10-token draft
    with pytest.raises(ConfigError, match="no step shape"):
        pc.step_shape("loopspec")
    with pytest.raises(ConfigError):
        pc.forward_cost(LLAMA7B, tokens=0, cache_len=4)
    with pytest.raises(ConfigError, match="loops"):
        pc.forward_cost(LLAMA7B, tokens=1, cache_len=4, loops=1)


def test_costs_scale_with_element_size_and_loops():
    tiny = load_preset("tiny_ouro").model
    one, two = (pc.forward_cost(tiny, tokens=1, cache_len=64, loops=n) for n in (1, 2))
    assert two.bytes_accessed > one.bytes_accessed and two.flops > one.flops
    assert one.scaled_bytes(2) == pytest.approx(one.bytes_accessed / 2)
    d = one.to_dict()
    assert d["ideal_bytes"] == one.ideal_bytes and d["itemsize"] == 4


def test_program_cost_benchmark_quick(tmp_path):
    import json

    from benchmarks import program_cost as bench

    rec = bench.run(bench.parse_args(["--quick", "--out", str(tmp_path)]))
    data = json.loads((tmp_path / "program_cost.json").read_text())
    assert {(r["attention"], r["setting"]) for r in data["rows"]} == {
        (a, s) for a in ("dense", "fused") for s in ("plain", "(5,3,5)")}
    plain = [r for r in rec["rows"] if r["setting"] == "plain"]
    assert all(r["over_plain"] == 1.0 for r in plain)
    assert all(0.95 <= r["excess"] <= 1.05 for r in plain)  # SmolLM2 too: read once
    md = (tmp_path / "program_cost.md").read_text()
    assert md.startswith("# Program cost of one step") and "| smollm2_135m | 128 |" in md
