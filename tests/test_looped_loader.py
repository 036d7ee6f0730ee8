"""Hugging Face checkpoints of looped models (Ouro, Huginn/Raven): the published tensor names,
a write/load round trip that reproduces the logits exactly, configs read from config.json, and
clear errors naming the tensor that is missing, misshapen or unknown."""

from __future__ import annotations

import json
import os

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import load_file, save_file

from models.build import build_looped
from models.config import ConfigError, LoopedConfig
from models.hf_loader import CheckpointError
from models.looped import LoopedLM
from models.looped_loader import (is_looped_checkpoint, load_hf_looped, load_looped_config,
                                  save_hf_looped)

B, T = 2, 7

CONFIGS = {
    "ouro": LoopedConfig(family="ouro", vocab_size=61, hidden_size=32, intermediate_size=40,
                         num_heads=4, num_kv_heads=2, num_loops=3, num_layers=2, rope_theta=1e6,
                         max_position_embeddings=128, bos_token_id=1, eos_token_ids=(2,)),
    "raven": LoopedConfig(family="raven", vocab_size=61, hidden_size=32, intermediate_size=40,
                          num_heads=4, num_kv_heads=4, num_loops=3, prelude_layers=1,
                          core_layers=2, coda_layers=1, qk_bias=True, rope_theta=5e4,
                          tie_word_embeddings=True, max_position_embeddings=128,
                          bos_token_id=1, eos_token_ids=(2,)),
}

# The names of the published modeling code (modeling_ouro.py / raven_modeling_minimal.py),
# spelled out once by hand for layer 0 of each group.
OURO_LAYER0 = {f"model.layers.0.{n}.weight" for n in (
    "input_layernorm", "input_layernorm_2", "post_attention_layernorm",
    "post_attention_layernorm_2", "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
    "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")}
OURO_TOP = {"model.embed_tokens.weight", "model.norm.weight", "model.early_exit_gate.weight",
            "model.early_exit_gate.bias", "lm_head.weight"}
RAVEN_BLOCK = ("norm_1.weight", "attn.Wqkv.weight", "attn.qk_bias", "attn.proj.weight",
               "norm_2.weight", "mlp.fc.weight", "mlp.proj.weight", "norm_3.weight",
               "norm_4.weight")
RAVEN_TOP = {"transformer.wte.weight", "transformer.adapter.weight", "transformer.ln_f.weight"}


def _model(family: str, **overrides) -> LoopedLM:
    import dataclasses  # noqa: PLC0415
    model = build_looped(dataclasses.replace(CONFIGS[family], **overrides), rngs=nnx.Rngs(5))
    rng = np.random.default_rng(2)
    for path, var in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        if path[-1] in ("weight", "bias"):  # norms and the exit gate's bias: not the init values
            w = var.get_value()
            var.set_value(w + 0.3 * jnp.asarray(rng.standard_normal(w.shape), w.dtype))
    return model


def _logits(model: LoopedLM) -> np.ndarray:
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 61, (B, T)), jnp.int32)
    pos = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32)[None], (B, T))
    logits, gates = model.loop_logits(tokens, pos)
    return np.asarray(logits) if gates is None else (np.asarray(logits), np.asarray(gates))


@pytest.fixture(scope="module", params=list(CONFIGS))
def saved(request, tmp_path_factory):
    """(family, model, checkpoint dir, its tensors)."""
    model = _model(request.param)
    path = tmp_path_factory.mktemp(request.param)
    save_hf_looped(model, path)
    return request.param, model, path, load_file(str(path / "model.safetensors"))


def _write(tmp_path, saved, tensors):
    (tmp_path / "config.json").write_text((saved[2] / "config.json").read_text())
    save_file(tensors, str(tmp_path / "model.safetensors"))
    return tmp_path


def test_published_names(saved):
    family, model, _, tensors = saved
    names = set(tensors)
    if family == "ouro":
        assert OURO_TOP | OURO_LAYER0 <= names
        assert len(names) == len(OURO_TOP) + 2 * len(OURO_LAYER0)
        assert tensors["model.early_exit_gate.weight"].shape == (1, 32)
        assert tensors["model.layers.0.self_attn.k_proj.weight"].shape == (16, 32)  # [out, in]
    else:
        blocks = {f"transformer.{g}.0.{n}" for g in ("prelude", "core_block", "coda")
                  for n in RAVEN_BLOCK} | {f"transformer.core_block.1.{n}" for n in RAVEN_BLOCK}
        assert names == RAVEN_TOP | blocks  # tied: no lm_head.weight
        assert tensors["transformer.prelude.0.attn.Wqkv.weight"].shape == (3 * 32, 32)
        assert tensors["transformer.coda.0.attn.qk_bias"].shape == (2, 1, 4, 8)
        assert tensors["transformer.adapter.weight"].shape == (32, 64)
        assert tensors["transformer.core_block.0.mlp.fc.weight"].shape == (80, 32)


def test_config_json_fields(saved):
    family, model, path, _ = saved
    hf = json.loads((path / "config.json").read_text())
    if family == "ouro":
        assert hf["model_type"] == "ouro" and hf["total_ut_steps"] == 3
        assert hf["num_hidden_layers"] == 2 and hf["rope_theta"] == 1e6
    else:
        assert hf["model_type"] == "huginn_raven" and hf["mean_recurrence"] == 3
        assert (hf["n_layers_in_prelude"], hf["n_layers_in_recurrent_block"],
                hf["n_layers_in_coda"]) == (1, 2, 1)
        assert hf["n_embd"] == 32 and hf["rope_base"] == 5e4 and hf["tie_embeddings"]
    assert load_looped_config(path) == model.config
    assert is_looped_checkpoint(path)


def test_round_trip(saved):
    family, model, path, _ = saved
    loaded = load_hf_looped(path)
    got, want = _logits(loaded), _logits(model)
    for g, w in zip(*((got, want) if family == "ouro" else ((got,), (want,)))):
        np.testing.assert_array_equal(g, w)
    m16 = load_hf_looped(path, dtype=jnp.bfloat16)
    assert m16.lm_head is None or m16.lm_head.kernel[...].dtype == jnp.bfloat16


def test_untied_raven_and_tied_ouro(tmp_path):
    for family, tied in (("raven", False), ("ouro", True)):
        model = _model(family, tie_word_embeddings=tied)
        save_hf_looped(model, tmp_path / family)
        assert ("lm_head.weight" in load_file(str(tmp_path / family / "model.safetensors"))) != tied
        loaded = load_hf_looped(tmp_path / family)
        assert (loaded.lm_head is None) == tied
        np.testing.assert_array_equal(np.asarray(_logits(loaded)[0]), np.asarray(_logits(model)[0]))


def test_raven_init_values(tmp_path):
    """Raven's embedding scale and initial-state std travel in config.json's `init_values`, as
    RavenConfig spells them (a converted checkpoint has embed_scale 1): written, read back,
    and used (the loaded model's logits are the original's)."""
    model = _model("raven", embed_scale=1.0, state_std=0.1)
    save_hf_looped(model, tmp_path)
    init = json.loads((tmp_path / "config.json").read_text())["init_values"]
    assert (init["embed_scale"], init["std"]) == (1.0, 0.1)
    loaded = load_hf_looped(tmp_path)
    assert loaded.config == model.config
    np.testing.assert_array_equal(_logits(loaded), _logits(model))
    hf = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**hf, "init_values": {"std": 0.0}}))
    with pytest.raises(CheckpointError, match="init_values std must be positive"):
        load_looped_config(tmp_path)


def test_sharded(tmp_path, saved):
    _, model, _, tensors = saved
    names = sorted(tensors)
    half = len(names) // 2
    shards = {"model-00001-of-00002.safetensors": names[:half],
              "model-00002-of-00002.safetensors": names[half:]}
    for file, part in shards.items():
        save_file({n: tensors[n] for n in part}, str(tmp_path / file))
    index = {"metadata": {}, "weight_map": {n: f for f, part in shards.items() for n in part}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    (tmp_path / "config.json").write_text((saved[2] / "config.json").read_text())
    np.testing.assert_array_equal(np.asarray(_logits(load_hf_looped(tmp_path))[0]),
                                  np.asarray(_logits(model)[0]))


# ---- broken checkpoints ---------------------------------------------------------------------

def test_missing_tensor_named(tmp_path, saved):
    family, _, _, tensors = saved
    name = ("model.layers.1.input_layernorm_2.weight" if family == "ouro"
            else "transformer.core_block.1.attn.qk_bias")
    _write(tmp_path, saved, {k: v for k, v in tensors.items() if k != name})
    with pytest.raises(CheckpointError, match=rf"missing .*{name.replace('.', '[.]')}"):
        load_hf_looped(tmp_path)


def test_misshapen_tensor_named(tmp_path, saved):
    family, _, _, tensors = saved
    name = ("model.early_exit_gate.weight" if family == "ouro"
            else "transformer.adapter.weight")
    bad = dict(tensors)
    bad[name] = tensors[name].T.copy()
    _write(tmp_path, saved, bad)
    with pytest.raises(CheckpointError) as e:
        load_hf_looped(tmp_path)
    msg = str(e.value)
    got, want = tuple(bad[name].shape), tuple(tensors[name].shape)
    assert name in msg and str(got) in msg and str(want) in msg and "\n" not in msg


def test_unknown_tensor_error_and_rope_buffers_ignored(tmp_path, saved):
    family, _, _, tensors = saved
    extra = dict(tensors)
    extra["freqs_cis"] = np.zeros((1, 4, 1, 4, 2), np.float32)  # Raven's persistent buffer
    extra["model.rotary_emb.inv_freq"] = np.ones(4, np.float32)
    if family == "raven":
        extra["lm_head.weight"] = tensors["transformer.wte.weight"]  # tied: skipped
    _write(tmp_path, saved, extra)
    load_hf_looped(tmp_path)
    extra["transformer.coda.7.norm_1.weight"] = np.ones(32, np.float32)
    _write(tmp_path, saved, extra)
    with pytest.raises(CheckpointError, match=rf"{family} model has no place for: .*coda[.]7"):
        load_hf_looped(tmp_path)


def test_untied_without_lm_head(tmp_path):
    model = _model("ouro")
    save_hf_looped(model, tmp_path)
    tensors = load_file(str(tmp_path / "model.safetensors"))
    del tensors["lm_head.weight"]
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"lm_head\.weight.*untied"):
        load_hf_looped(tmp_path)


def test_config_errors(tmp_path, saved):
    with pytest.raises(CheckpointError, match="does not exist"):
        load_hf_looped(tmp_path / "nope")
    with pytest.raises(CheckpointError, match="config.json: not found"):
        load_looped_config(tmp_path)
    assert not is_looped_checkpoint(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(CheckpointError, match="model_type 'llama' is not a looped model"):
        load_looped_config(tmp_path)
    assert not is_looped_checkpoint(tmp_path)
    hf = json.loads((saved[2] / "config.json").read_text())
    hf.pop("intermediate_size")
    (tmp_path / "config.json").write_text(json.dumps(hf))
    with pytest.raises(CheckpointError, match="missing field 'intermediate_size'"):
        load_looped_config(tmp_path)
    assert issubclass(CheckpointError, ConfigError)


def test_config_overrides_and_shape_check(tmp_path, saved):
    """A config that disagrees with the tensors fails on the first misshapen tensor."""
    import dataclasses  # noqa: PLC0415
    family, model, path, _ = saved
    wider = dataclasses.replace(model.config, intermediate_size=44)
    with pytest.raises(CheckpointError, match=r"has shape .*, expected .*(44|88)"):
        load_hf_looped(path, config=wider)


# ---- presets --------------------------------------------------------------------------------

def test_looped_presets():
    from lookahead_jax.store.checkpoint import load_model_and_tokenizer  # noqa: PLC0415
    from lookahead_jax.store.presets import load_preset  # noqa: PLC0415
    shapes = {"ouro_1p4b": ("ouro", 24, 4), "ouro_2p6b": ("ouro", 48, 4),
              "huginn_0125": ("raven", 4, 32), "tiny_ouro": ("ouro", 2, 4),
              "tiny_raven": ("raven", 2, 8)}
    for name, (family, layers, loops) in shapes.items():
        preset = load_preset(name)
        cfg = preset.model
        assert (cfg.family, cfg.loop_layers, cfg.num_loops) == (family, layers, loops)
        assert preset.lookahead is None
        if preset.checkpoint is None:
            hint = preset.weights_hint
            with pytest.raises(ConfigError, match=rf"needs weights: pass --ckpt=.*{hint}"):
                load_model_and_tokenizer(preset)
    huginn = load_preset("huginn_0125").model
    shape = (huginn.prelude_layers, huginn.coda_layers, huginn.head_dim, huginn.qk_bias)
    assert shape == (2, 2, 96, True)
    for name in ("tiny_ouro", "tiny_raven"):  # the models trained here, shipped in checkpoints/
        assert load_preset(name).checkpoint.endswith(os.path.join("checkpoints", name))


def test_preset_loads_looped_checkpoint_and_checks_shape(tmp_path):
    import dataclasses  # noqa: PLC0415

    from lookahead_jax.store.checkpoint import load_model_and_tokenizer
    from lookahead_jax.store.presets import Preset  # noqa: PLC0415
    model = _model("raven")
    save_hf_looped(model, tmp_path)
    preset = Preset("t", "t", model.config, None, str(tmp_path), chat=False)
    with pytest.raises(ConfigError, match="cannot load a tokenizer"):  # the weights loaded first
        load_model_and_tokenizer(preset)
    other = Preset("t", "t", dataclasses.replace(model.config, num_loops=5), None, None, chat=False)
    with pytest.raises(ConfigError, match="num_loops is 3 in the checkpoint, 5 in the preset"):
        load_model_and_tokenizer(other, ckpt=tmp_path)
    ouro = Preset("t", "t", CONFIGS["ouro"], None, None, chat=False)
    with pytest.raises(ConfigError, match="family is raven in the checkpoint, ouro in the preset"):
        load_model_and_tokenizer(ouro, ckpt=tmp_path)


def test_engine_from_tiny_preset():
    from lookahead_jax.engine import Engine  # noqa: PLC0415
    engine = Engine.from_preset("tiny_ouro", ckpt="random")
    assert isinstance(nnx.merge(engine.graphdef, engine.params), LoopedLM)
    result = engine.generate_ids([[3, 4, 5]], max_new_tokens=3)  # the preset's method: plain
    assert len(result.tokens[0]) == 3 and result.stats.steps == 3


@pytest.mark.parametrize("name", ["tiny_ouro", "tiny_raven"])
def test_shipped_tiny_presets_generate_text(name):
    from lookahead_jax.engine import Engine  # noqa: PLC0415
    from lookahead_jax.store.presets import load_preset  # noqa: PLC0415
    if not os.path.isdir(load_preset(name).checkpoint):
        pytest.skip(f"checkpoints/{name} not present")
    engine = Engine.from_preset(name)
    assert engine.tokenizer is not None
    prompt = "How many legs do 3 cats have?"
    result = engine.generate(prompt, max_new_tokens=8)
    ids = engine.encode(prompt)
    assert ids[0] == engine.tokenizer.bos_token_id  # the chat template of the trained tokenizer
    plain = engine.generate_ids([ids], max_new_tokens=8, method="ar")
    assert result.tokens[0] == plain.tokens[0] and result.texts[0] == engine.decode(plain.tokens[0])
