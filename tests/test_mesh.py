"""Tensor parallelism with lookahead parallelism on one (lookahead, model) mesh, on 8 CPU devices.

As in test_parallel.py, the 8 devices exist only in a process started with
XLA_FLAGS=--xla_force_host_platform_device_count=8: `test_on_8_cpu_devices` reruns this file
so, and the tests marked `needs8` run there (they skip, saying so, in the parent process).

Pinned there, for meshes (lookahead, model) = (1,8), (2,4), (4,2), (8,1):
  * outputs identical to the single-device run: plain greedy and sampling, lookahead greedy
    and sampling with the same seed, prompt lookup; on a model whose heads the model axis
    divides and on one with 4 query / 2 KV heads (KV heads replicated on a model axis of 8);
  * LoopSpec (on Ouro) and LoopAhead (on Raven), sharded, equal to plain greedy on one
    device;
  * the compiled decoding loop's collectives (`lookahead_jax.tuning.collectives`): two
    all-reduces over the model axis per layer (after the row-parallel o_proj and down_proj),
    lookahead's int32 all-gather over the lookahead axis, no float collective over it, and no
    copy of the KV cache across devices;
  * a Hugging Face checkpoint read straight into sharded parameters, equal to the whole load;
  * the model families' switches (Qwen's biases and q/k norms, Gemma's norms, soft-caps and
    windows) sharded on (2,4), equal to one device;
  * the CLI's --mesh and its errors.
"""

from __future__ import annotations

import os
import sys

import jax
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec

from lookahead_jax.engine import Engine
from lookahead_jax.lookahead.config import LookaheadConfig
from lookahead_jax.looped.loopahead import LoopAhead
from lookahead_jax.mesh import MeshShape, make_mesh, parse_mesh
from lookahead_jax.sampling import Sampling
from lookahead_jax.tuning.collectives import collectives, mesh_axes
from models.build import build_looped
from models.config import ConfigError
from models.sharding import param_specs

sys.path.insert(0, os.path.dirname(__file__))
from multidevice import ON_8_CPU_DEVICES, needs8, rerun_on_8_cpu_devices  # noqa: E402
from test_lookahead import make_model  # noqa: E402  (the structured tiny model)
from test_loopspec import FACTOR, agreeable  # noqa: E402
from test_parallel import _cli  # noqa: E402  (tiny_llama's CLI run)
from test_looped import CONFIGS, _perturb_norms  # noqa: E402

@pytest.mark.skipif(ON_8_CPU_DEVICES, reason="already running on 8 CPU devices")
def test_on_8_cpu_devices():
    rerun_on_8_cpu_devices(__file__, min_passed=18)


# ------------------------------------------------------------------------------- no devices ---
def test_parse_mesh():
    assert parse_mesh("lookahead:2,model:4") == MeshShape(2, 4)
    assert parse_mesh("model:8") == MeshShape(1, 8)
    assert parse_mesh(" model:2 , lookahead:3 ") == MeshShape(3, 2)
    assert str(MeshShape(2, 4)) == "lookahead:2,model:4"
    for bad, msg in (("data:2", "axis:size pairs"), ("model:x", "must be an integer"),
                     ("model:2,model:4", "given twice"), ("model:0", "at least 1"),
                     ("model", "axis:size pairs")):
        with pytest.raises(ConfigError, match=msg):
            parse_mesh(bad)


def test_mesh_needs_devices():
    with pytest.raises(ConfigError, match="needs 64 devices"):
        make_mesh("lookahead:8,model:8")


# ------------------------------------------------------------------------------ on 8 devices --
MESHES = [(1, 8), (2, 4), (4, 2), (8, 1)]
PROMPTS = [[3, 5, 7, 9, 11, 3, 5, 7], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13], [42]]
NEW = 16
LOOK = LookaheadConfig(W=5, N=3, G=5)
SAMPLE = Sampling(temperature=1.0)
RUNS = {  # name -> generate_ids keywords
    "ar": dict(method="ar"),
    "ar_sampling": dict(method="ar", sampling=SAMPLE, seed=3),
    "lookahead": dict(method="lookahead"),
    "lookahead_sampling": dict(method="lookahead", sampling=SAMPLE, seed=3),
    "prompt_lookup": dict(method="prompt_lookup"),
}
SHAPES = {"gqa": {}, "mha8": dict(hidden_size=64, num_heads=8, num_kv_heads=8)}


# each mesh with one model: KV heads replicated (gqa on a model axis of 8), split (gqa on 2,
# mha8 on 4), and lookahead parallelism alone (model axis 1); every run on some mesh, two runs
# on each (CI's time: each run compiles its programs for the mesh)
MESH_SHAPES = [((1, 8), "gqa", ("ar", "lookahead")), ((2, 4), "mha8", ("ar_sampling", "lookahead")),
               ((4, 2), "gqa", ("lookahead", "lookahead_sampling")),
               ((8, 1), "mha8", ("lookahead_sampling", "prompt_lookup"))]


@pytest.fixture(scope="module")
def single():
    """name of shape -> run -> tokens on one device, for the runs MESH_SHAPES compare."""
    out = {}
    for shape, kw in SHAPES.items():
        engine = Engine(make_model(**kw), eos_ids=(), lookahead=LOOK)
        runs = {run for _, s, rs in MESH_SHAPES if s == shape for run in rs}
        out[shape] = {run: engine.generate_ids(PROMPTS, max_new_tokens=NEW, **g).tokens
                      for run, g in RUNS.items() if run in runs}
    return out


@needs8
@pytest.mark.parametrize("mesh,shape,runs", MESH_SHAPES,
                         ids=[f"{a}x{b}-{s}" for (a, b), s, _ in MESH_SHAPES])
def test_outputs_equal_one_device(single, mesh, shape, runs):
    engine = Engine(make_model(**SHAPES[shape]), eos_ids=(), lookahead=LOOK,
                    mesh=f"lookahead:{mesh[0]},model:{mesh[1]}")
    assert engine.devices == mesh[0]
    for run in runs:
        g = RUNS[run]
        got = engine.generate_ids(PROMPTS, max_new_tokens=NEW, **g)
        assert got.tokens == single[shape][run], (run, mesh)
        if run.startswith("lookahead"):
            assert got.stats.extra.get("devices", 1) == mesh[0]


@needs8
def test_parameters_are_split_over_the_model_axis():
    engine = Engine(make_model(**SHAPES["mha8"]), eos_ids=(), mesh="lookahead:2,model:4")
    specs = param_specs(engine.params, engine.mesh, engine.config)
    flat = {"/".join(str(getattr(k, "key", getattr(k, "name", k))) for k in path): spec
            for path, spec in
            jax.tree_util.tree_flatten_with_path(
                specs, is_leaf=lambda s: isinstance(s, PartitionSpec))[0]}
    layer = "layers/0"
    assert flat[f"{layer}/self_attn/q_proj/kernel/value"] == PartitionSpec(None, "model")
    assert flat[f"{layer}/self_attn/k_proj/kernel/value"] == PartitionSpec(None, "model")
    assert flat[f"{layer}/self_attn/o_proj/kernel/value"] == PartitionSpec("model", None)
    assert flat[f"{layer}/mlp/down_proj/kernel/value"] == PartitionSpec("model", None)
    assert flat["embed_tokens/embedding/value"] == PartitionSpec("model", None)
    assert flat[f"{layer}/input_layernorm/weight/value"] == PartitionSpec()
    q = engine.params["layers"][0]["self_attn"]["q_proj"]["kernel"].get_value()
    assert {s.data.shape for s in q.addressable_shards} == {(64, 16)}  # 64 columns / 4
    # GQA with 2 KV heads on a model axis of 4: K/V projections and cache replicated
    gqa = Engine(make_model(), eos_ids=(), mesh="lookahead:1,model:4")
    k = gqa.params["layers"][0]["self_attn"]["k_proj"]["kernel"].get_value()
    assert k.sharding.is_fully_replicated
    cache = gqa._init_cache(1, 128, np.float32)
    assert cache.k[0].sharding.is_fully_replicated
    assert not Engine(make_model(), eos_ids=(), mesh="model:2")._init_cache(
        1, 128, np.float32).k[0].sharding.is_fully_replicated
    # an engine's compiler options go with its mesh programs too (XLA names the unknown one)
    unknown = Engine(make_model(), eos_ids=(), mesh="model:2",
                     compiler_options={"xla_no_such_option": 1})
    with pytest.raises(Exception, match="xla_no_such_option"):
        unknown.generate_ids([[1, 2, 3]], method="ar", max_new_tokens=2)


# one looped method per family on the mesh (CI's time: each compiles its programs for the
# mesh), so both methods and both families run sharded; each must equal plain greedy decoding
# on one device
LOOPED_ON_MESH = {"ouro": "loopspec", "raven": LoopAhead(r1=1, r2=2)}


def _looped_model(fam):
    return agreeable(_perturb_norms(build_looped(CONFIGS[fam], rngs=nnx.Rngs(3))), FACTOR[fam])


@needs8
@pytest.mark.parametrize("fam", list(CONFIGS))
def test_looped_methods_sharded(fam):
    prompts = [p for p in PROMPTS if max(p) < CONFIGS[fam].vocab_size]
    want = Engine(_looped_model(fam), eos_ids=()).generate_ids(prompts, method="ar",
                                                               max_new_tokens=16).tokens
    engine = Engine(_looped_model(fam), eos_ids=(), mesh="lookahead:2,model:4")
    got = engine.generate_ids(prompts, method=LOOPED_ON_MESH[fam], max_new_tokens=16).tokens
    assert got == want


# --------------------------------------------------------------------------- collectives ---
def _run_program(engine) -> str:
    (run,) = [c for k, c in engine._compiled.items() if k[0] == "run"]
    return run.as_text()


@needs8
@pytest.mark.parametrize("mesh,method", [((1, 8), "ar"), ((2, 4), "lookahead"),
                                         ((4, 2), "lookahead"), ((2, 4), "ar")])
def test_collectives(mesh, method):
    cfg = SHAPES["mha8"]
    engine = Engine(make_model(**cfg), eos_ids=(), lookahead=LOOK,
                    mesh=f"lookahead:{mesh[0]},model:{mesh[1]}")
    engine.generate_ids(PROMPTS[:2], method=method, max_new_tokens=4)
    found = [c for c in collectives(_run_program(engine)) if c.in_loop]
    axes = [(c, mesh_axes(c, engine.mesh)) for c in found]
    layers = engine.config.num_layers
    model_reduces = [c for c, a in axes if c.op == "all-reduce" and a == {"model"}
                     and c.is_float()]
    # o_proj and down_proj per layer, plus the vocabulary-split embedding lookup's sum
    assert len(model_reduces) == 2 * layers + 1, [(c.op, c.dtypes, a) for c, a in axes]
    tokens = 1 if method == "ar" else None
    for c in model_reduces[:-1]:  # activations of the step's tokens: [B, T, hidden]
        assert c.elements % (2 * engine.config.hidden_size) == 0
        if tokens:
            assert c.elements == 2 * tokens * engine.config.hidden_size
    over_lookahead = [(c, a) for c, a in axes if "lookahead" in a]
    assert not any(c.is_float() for c, _ in over_lookahead), over_lookahead
    if method == "lookahead" and mesh[0] > 1:
        gathers = [c for c, a in over_lookahead if c.op == "all-gather"]
        assert len(gathers) == 1 and gathers[0].dtypes == ("s32",), over_lookahead
    else:
        assert not over_lookahead
    # nothing of the KV cache's size moves: one layer's cache is [2, 8, S >= 128, 8] floats
    assert max(c.elements for c in found) < 2 * 8 * 128 * 8 // mesh[1]


# ------------------------------------------------------------------------- model families ---
# The families' switches (#23) on a mesh: biases split with their heads, q/k norms and the extra
# norms replicated, sliding windows and soft-caps applied per shard (`models.sharding`)
FAMILY_SHAPES = {
    "qwen": dict(hidden_size=64, num_heads=8, num_kv_heads=4, qkv_bias=True, o_bias=True,
                 qk_norm=True, sliding_window=6, layer_types=("sliding", "full")),
    "gemma": dict(hidden_size=64, num_heads=8, num_kv_heads=4, head_dim=16, qk_norm=True,
                  norm_offset=1.0, sandwich_norms=True, hidden_act="gelu_tanh", embed_scale=8.0,
                  query_scale=0.2, attn_softcap=20.0, final_softcap=30.0, sliding_window=6,
                  layer_types=("sliding", "full"), local_rope_theta=500.0),
}


def family_model(fam: str):
    """The structured tiny model with a family's switches, its biases and norms random."""
    model = make_model(**FAMILY_SHAPES[fam])
    rng = np.random.default_rng(1)
    for path, var in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        if path[-1] == "bias" or (str(path[-2]).endswith("norm") and path[-1] == "weight"):
            shape = var.get_value().shape
            var.set_value(var.get_value() + 0.3 * rng.normal(size=shape).astype(np.float32))
    return model


@needs8
@pytest.mark.parametrize("fam", list(FAMILY_SHAPES))
def test_family_switches_sharded_equal_one_device(fam):
    runs = (dict(method="ar"), dict(method="lookahead"))
    one = Engine(family_model(fam), eos_ids=(), lookahead=LOOK)
    want = [one.generate_ids(PROMPTS, max_new_tokens=NEW, **g).tokens for g in runs]
    # on the mesh, lookahead only (CI's time): it equals the one-device run and plain decoding
    mesh = Engine(family_model(fam), eos_ids=(), lookahead=LOOK, mesh="lookahead:2,model:4")
    assert mesh.generate_ids(PROMPTS, max_new_tokens=NEW, **runs[1]).tokens == want[1]
    assert want[1] == want[0]  # lookahead lossless with the family's rules


# ---------------------------------------------------------------------------- checkpoints ---
@needs8
def test_hf_checkpoint_loads_sharded(hf_ckpt):
    from models.hf_loader import load_hf_config, load_hf_llama  # noqa: PLC0415
    mesh = make_mesh("lookahead:2,model:4")
    whole = nnx.state(load_hf_llama(hf_ckpt))
    sharded = nnx.state(load_hf_llama(hf_ckpt, mesh=mesh))
    specs = param_specs(sharded, mesh, load_hf_config(hf_ckpt))
    for (path, a), b, spec in zip(jax.tree_util.tree_flatten_with_path(whole)[0],
                                  jax.tree.leaves(sharded),
                                  jax.tree.leaves(specs, is_leaf=lambda s: isinstance(
                                      s, PartitionSpec))):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=str(path))
        assert b.sharding.spec == spec, path
    q = sharded["layers"][0]["self_attn"]["q_proj"]["kernel"].get_value()
    assert not q.sharding.is_fully_replicated


# --------------------------------------------------------------------------------- CLI ---
@needs8
def test_cli_mesh_flag():
    code1, out1, _ = _cli()
    for mesh in ("lookahead:2,model:4",):  # the other shapes: test_outputs_equal_one_device
        code, out, err = _cli(mesh=mesh)
        assert code1 == code == 0, err
        assert out == out1, mesh
    code, out, err = _cli(mesh="lookahead:2,model:2", method="ar")
    assert code == 0 and out == out1, err


@needs8
def test_cli_mesh_errors():
    for kw, msg in ((dict(mesh="lookahead:4,model:4"), "needs 16 devices, 8 available"),
                    (dict(mesh="lookahead:2,model:4", devices=4), "disagrees with the mesh"),
                    (dict(mesh="rows:2"), "axis:size pairs")):
        code, _, err = _cli(**kw)
        assert code == 2 and msg in err and "Traceback" not in err, (kw, err)
    with pytest.raises(ConfigError, match="runs dense attention"):
        Engine(make_model(), eos_ids=(), mesh="model:2", attention="pallas")


# ----------------------------------------------------------------------------- serving ---
@needs8
def test_slot_engine_on_a_model_axis_equals_one_device():
    """The server's slot engine on model:4 (parameters and every slot's cache split over KV
    heads): mixed methods, greedy and sampling, requests joining and leaving two slots; each
    request's tokens equal the one-device offline run's."""
    from lookahead_jax.serving.slots import Limits, SlotEngine, SlotRequest  # noqa: PLC0415

    sharded = Engine(make_model(**SHAPES["mha8"]), eos_ids=(), lookahead=LOOK, mesh="model:4")
    slots = SlotEngine(sharded, slots=2, limits=Limits(max_len=64, max_tokens=NEW, W=5, N=3,
                                                       G=5))
    runs = ("lookahead_sampling", "prompt_lookup")  # two lanes (CI's time)
    requests = []
    for run in runs:
        g = RUNS[run]
        for p in PROMPTS[:2]:
            requests.append((run, p, SlotRequest(p, method=g["method"], max_tokens=NEW,
                                                 sampling=g.get("sampling", Sampling()),
                                                 seed=g.get("seed", 0))))
    out, waiting, owner = {}, list(range(len(requests))), {}
    while waiting or slots.live:
        while waiting and slots.free:
            i = waiting.pop(0)
            handle, first = slots.admit(requests[i][2])
            owner[handle], out[i] = i, list(first.ids)
        for handle, update in slots.step().items():
            out[owner[handle]].extend(update.ids)
            if update.done:
                slots.evict(handle)
    assert all(lane.state is None for lane in slots.lanes.values())  # every slot freed
    one = Engine(make_model(**SHAPES["mha8"]), eos_ids=(), lookahead=LOOK)
    for i, (run, p, _) in enumerate(requests):
        assert out[i] == one.generate_ids([p], max_new_tokens=NEW, **RUNS[run]).tokens[0], run
