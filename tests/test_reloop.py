"""train_looped.reloop: a distilled block run more times, its output projections scaled by old
R / new R (`distill.scale_outputs`). The scaling touches exactly the output projections (a block copied at out_scale s
and scaled by f is the block copied at s * f); the source must be a distilled export; the shipped
smol_loop_2x4 is exactly smol_loop_2x2's block halved, run four times in the same place."""

from __future__ import annotations

import json
import os

import jax
import numpy as np
import pytest
from flax import nnx

from models.config import LlamaConfig
from models.llama import Llama
from train_looped import distill, reloop
from train_looped.distill import DistillConfig

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_scaling_touches_exactly_the_output_projections():
    teacher = Llama(LlamaConfig(vocab_size=53, hidden_size=32, intermediate_size=48,
                                num_layers=4, num_heads=4, num_kv_heads=2, rope_theta=1e4,
                                tie_word_embeddings=True, max_position_embeddings=64,
                                bos_token_id=1, eos_token_ids=(2,)), rngs=nnx.Rngs(0))
    cfg = DistillConfig(prelude_layers=1, replaced_layers=2, core_layers=2, num_loops=2,
                        out_scale=0.5, loop_weights=(1.0, 1.0))
    block = distill.init_block(teacher, cfg)
    params = nnx.state(block, nnx.Param)
    params = jax.tree.map(np.asarray, params)  # a copy: scale_outputs works in place
    distill.scale_outputs(block, 0.5)
    got = nnx.state(block, nnx.Param)
    want = nnx.state(distill.init_block(teacher, DistillConfig(
        prelude_layers=1, replaced_layers=2, core_layers=2, num_loops=2, out_scale=0.25,
        loop_weights=(1.0, 1.0))), nnx.Param)
    flat_got = jax.tree_util.tree_flatten_with_path(got)[0]
    flat_want = jax.tree.leaves(want)
    flat_src = jax.tree.leaves(params)
    changed = 0
    for (path, a), b, src in zip(flat_got, flat_want, flat_src, strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
        changed += not np.array_equal(np.asarray(a), np.asarray(src))
    assert changed == 4  # o_proj and down_proj of each of the two layers


def test_the_source_must_be_a_distilled_export(tmp_path):
    with pytest.raises(FileNotFoundError, match="no exported model"):
        reloop.source_config(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"training": {"recipe": "other"}}))
    with pytest.raises(ValueError, match="not a block exported by train_looped.distill"):
        reloop.source_config(tmp_path)
    _, cfg = reloop.source_config(os.path.join(REPO, "checkpoints", "smol_loop_2x2"))
    assert (cfg.prelude_layers, cfg.replaced_layers, cfg.core_layers, cfg.num_loops) == (
        14, 2, 2, 2)


def test_shipped_2x4_is_the_2x2_block_halved():
    """No fitted parameter: every tensor of checkpoints/smol_loop_2x4 is smol_loop_2x2's,
    the output projections halved (exact in bfloat16), and its config runs it 4 times in the
    same place."""
    from safetensors.flax import load_file  # noqa: PLC0415
    src, dst = (os.path.join(REPO, "checkpoints", n) for n in ("smol_loop_2x2", "smol_loop_2x4"))
    a = load_file(os.path.join(src, "model.safetensors"))
    b = load_file(os.path.join(dst, "model.safetensors"))
    assert sorted(a) == sorted(b)
    halved = [k for k in a if k.endswith(("o_proj.weight", "down_proj.weight"))]
    assert len(halved) == 4
    for k in a:
        want = np.asarray(a[k]).astype(np.float32) * (0.5 if k in halved else 1.0)
        np.testing.assert_array_equal(np.asarray(b[k]).astype(np.float32), want, err_msg=k)
    ca, cb = (json.load(open(os.path.join(d, "config.json"))) for d in (src, dst))
    assert cb["num_loops"] == 4 and ca["num_loops"] == 2
    assert cb["base_model"] == ca["base_model"]
    assert cb["training"]["recipe"] == "python -m train_looped.reloop"
    assert cb["training"]["output_projection_scale"] == 0.5
    assert cb["training"]["source"] == ca["training"]
    from lookahead_jax.store.presets import load_preset  # noqa: PLC0415
    preset = load_preset("smol_loop_2x4").model
    for field in ("prelude_layers", "core_layers", "coda_layers", "num_loops"):
        assert getattr(preset, field) == cb[field], field
