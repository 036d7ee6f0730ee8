"""Hugging Face checkpoint loading: logits match transformers' LlamaForCausalLM (fp32, 1e-4),
through a whole prompt and through prefill + one-token cached decoding; bf16 checkpoints;
sharded checkpoints; clear errors for broken checkpoints."""

from __future__ import annotations

import dataclasses
import json
import shutil

import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
from safetensors.numpy import load_file, save_file  # noqa: E402

from lookahead_jax.generation import prefill  # noqa: E402
from models.config import ConfigError, RopeScaling  # noqa: E402
from models.hf_loader import CheckpointError, load_hf_config, load_hf_llama  # noqa: E402
from models.layers import causal_mask  # noqa: E402

B, T = 2, 12
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 32}

VARIANTS = {
    "mha": dict(num_attention_heads=4, num_key_value_heads=4),
    "gqa": dict(num_attention_heads=4, num_key_value_heads=2),
    "tied": dict(num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True),
    "llama3": dict(num_attention_heads=4, num_key_value_heads=2, rope_theta=500000.0,
                   rope_scaling=LLAMA3_ROPE, max_position_embeddings=64),
}


def _hf_model(seed: int = 0, **overrides):
    kw = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
              max_position_embeddings=256, rms_norm_eps=1e-5, initializer_range=0.1,
              tie_word_embeddings=False, attn_implementation="eager")
    kw.update(overrides)
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**kw)).eval()
    with torch.no_grad():  # non-trivial norm weights, so a mis-loaded norm shows
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.add_(0.3 * torch.randn_like(p))
    return model


def _tokens(vocab: int = 128) -> np.ndarray:
    return np.random.default_rng(0).integers(0, vocab, (B, T)).astype(np.int32)


def _hf_logits(model, tokens: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        return model(torch.from_numpy(tokens).long()).logits.float().numpy()


def _full_logits(model, tokens: np.ndarray) -> np.ndarray:
    positions = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32)[None], (B, T))
    mask = causal_mask(jnp.full((B,), T, jnp.int32), T)
    logits, _ = model(jnp.asarray(tokens), positions, mask)
    return np.asarray(logits)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """variant -> (checkpoint dir, HF fp32 logits [B,T,V]), each saved once, on first use."""
    cache = {}

    def get(name):
        if name not in cache:
            hf = _hf_model(**VARIANTS[name])
            path = tmp_path_factory.mktemp(name)
            hf.save_pretrained(path, safe_serialization=True)
            cache[name] = (path, _hf_logits(hf, _tokens()))
        return cache[name]
    return get


@pytest.fixture(params=list(VARIANTS))
def saved(request, checkpoints):
    """(variant, checkpoint dir, HF fp32 logits) for each tiny model."""
    return (request.param, *checkpoints(request.param))


def test_whole_prompt_logits_match(saved):
    name, path, want = saved
    model = load_hf_llama(path)
    got = _full_logits(model, _tokens())
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=0)
    assert (model.lm_head is None) == (name == "tied")


def test_cached_decoding_matches(saved):
    """Prefill rows of different lengths (right-padded), then feed one token at a time."""
    _, path, want = saved
    model = load_hf_llama(path)
    tokens = _tokens()
    lengths = np.array([5, 7], np.int32)
    p = 8
    cache = model.init_cache(B, 16)
    last, cache = prefill(model, jnp.asarray(tokens[:, :p]), jnp.asarray(lengths), cache)
    np.testing.assert_allclose(np.asarray(last), want[np.arange(B), lengths - 1], atol=1e-4, rtol=0)
    one = jnp.ones((B,), jnp.int32)
    for step in range(T - int(lengths.max())):
        pos = lengths + step
        tok = tokens[np.arange(B), pos][:, None]
        logits, new = model(jnp.asarray(tok), jnp.asarray(pos[:, None]), causal_mask(one, 1, cache),
                            cache)
        cache = cache.append(new, jnp.zeros((B, 1), jnp.int32), one)
        np.testing.assert_allclose(np.asarray(logits[:, 0]), want[np.arange(B), pos], atol=1e-4,
                                   rtol=0, err_msg=f"decode step {step}")


def test_llama3_rope_config_parsed_and_matters(checkpoints):
    path, want = checkpoints("llama3")
    hf_json = json.loads((path / "config.json").read_text())
    # transformers 5 writes theta and scaling together under "rope_parameters", and neither
    # a top-level "rope_theta" nor "rope_scaling"
    assert hf_json["rope_parameters"] == {**LLAMA3_ROPE, "rope_theta": 500000.0}
    cfg = load_hf_config(path)
    assert cfg.rope_theta == 500000.0
    assert cfg.rope_scaling == RopeScaling("llama3", 8.0, 1.0, 4.0, 32)
    unscaled = load_hf_llama(path, config=dataclasses.replace(cfg, rope_scaling=None))
    assert np.abs(_full_logits(unscaled, _tokens()) - want).max() > 1e-3


def test_legacy_rope_scaling_fields(tmp_path, checkpoints):
    """transformers 4 style: top-level rope_theta + rope_scaling (with "type" or "rope_type")."""
    path, _ = checkpoints("llama3")
    hf_json = json.loads((path / "config.json").read_text())
    hf_json.pop("rope_parameters")
    legacy = {k: v for k, v in LLAMA3_ROPE.items() if k != "rope_type"}
    hf_json.update(rope_theta=500000.0, rope_scaling={**legacy, "type": "llama3"})
    (tmp_path / "config.json").write_text(json.dumps(hf_json))
    cfg = load_hf_config(tmp_path)
    assert cfg.rope_theta == 500000.0
    assert cfg.rope_scaling == RopeScaling("llama3", 8.0, 1.0, 4.0, 32)


def test_sharded_checkpoint(tmp_path):
    hf = _hf_model(**VARIANTS["gqa"])
    hf.save_pretrained(tmp_path, safe_serialization=True, max_shard_size="40KB")
    assert (tmp_path / "model.safetensors.index.json").exists()
    assert not (tmp_path / "model.safetensors").exists()
    assert len(list(tmp_path.glob("model-*.safetensors"))) > 1
    got = _full_logits(load_hf_llama(tmp_path), _tokens())
    np.testing.assert_allclose(got, _hf_logits(hf, _tokens()), atol=1e-4, rtol=0)


def test_bf16_checkpoint(tmp_path):
    hf = _hf_model(**VARIANTS["gqa"])
    want = _hf_logits(hf, _tokens())
    hf.to(torch.bfloat16).save_pretrained(tmp_path, safe_serialization=True)
    tol = 5e-2 * np.abs(want).max()
    m32 = load_hf_llama(tmp_path)  # bf16 tensors read and upcast
    assert m32.embed_tokens.embedding[...].dtype == jnp.float32
    assert np.abs(_full_logits(m32, _tokens()) - want).max() < tol
    m16 = load_hf_llama(tmp_path, dtype=jnp.bfloat16)
    assert m16.layers[0].self_attn.q_proj.kernel[...].dtype == jnp.bfloat16
    assert np.abs(_full_logits(m16, _tokens()) - want).max() < tol


# ---- broken checkpoints ---------------------------------------------------------------------

@pytest.fixture(scope="module")
def good(tmp_path_factory):
    """An untied GQA checkpoint: (dir, its tensors as numpy)."""
    path = tmp_path_factory.mktemp("good")
    _hf_model(**VARIANTS["gqa"]).save_pretrained(path, safe_serialization=True)
    return path, load_file(str(path / "model.safetensors"))


def _write(tmp_path, good, tensors):
    shutil.copy(good[0] / "config.json", tmp_path / "config.json")
    save_file(tensors, str(tmp_path / "model.safetensors"))
    return tmp_path


def test_checkpoint_error_is_config_error():
    assert issubclass(CheckpointError, ConfigError)


def test_missing_dir(tmp_path):
    with pytest.raises(CheckpointError, match="does not exist"):
        load_hf_llama(tmp_path / "nope")


def test_missing_or_bad_config(tmp_path):
    with pytest.raises(CheckpointError, match="config.json: not found"):
        load_hf_config(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="config.json: invalid JSON"):
        load_hf_llama(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "vocab_size": 8}))
    with pytest.raises(CheckpointError, match="missing field 'hidden_size'"):
        load_hf_config(tmp_path)


def test_missing_safetensors(tmp_path, good):
    shutil.copy(good[0] / "config.json", tmp_path / "config.json")
    with pytest.raises(CheckpointError, match="no model.safetensors"):
        load_hf_llama(tmp_path)


def test_missing_shard(tmp_path, good):
    shutil.copy(good[0] / "config.json", tmp_path / "config.json")
    index = {"metadata": {}, "weight_map": {k: "model-00001-of-00002.safetensors" for k in good[1]}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match="model-00001-of-00002.safetensors: shard .* missing"):
        load_hf_llama(tmp_path)


def test_corrupt_safetensors(tmp_path, good):
    shutil.copy(good[0] / "config.json", tmp_path / "config.json")
    (tmp_path / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not a header}")
    with pytest.raises(CheckpointError, match="model.safetensors: cannot read safetensors"):
        load_hf_llama(tmp_path)


def test_wrong_shape_names_tensor(tmp_path, good):
    tensors = dict(good[1])
    name = "model.layers.1.self_attn.k_proj.weight"
    tensors[name] = tensors[name].reshape(64, 32)
    _write(tmp_path, good, tensors)
    with pytest.raises(CheckpointError) as e:
        load_hf_llama(tmp_path)
    msg = str(e.value)
    assert name in msg and "(64, 32)" in msg and "(32, 64)" in msg and "\n" not in msg


def test_missing_tensor_named(tmp_path, good):
    tensors = dict(good[1])
    del tensors["model.layers.0.mlp.up_proj.weight"]
    _write(tmp_path, good, tensors)
    with pytest.raises(CheckpointError, match=r"missing .*model\.layers\.0\.mlp\.up_proj\.weight"):
        load_hf_llama(tmp_path)


def test_untied_without_lm_head(tmp_path, good):
    tensors = dict(good[1])
    del tensors["lm_head.weight"]
    _write(tmp_path, good, tensors)
    with pytest.raises(CheckpointError, match=r"lm_head\.weight.*tie_word_embeddings"):
        load_hf_llama(tmp_path)


def test_unknown_tensor_error_and_inv_freq_ignored(tmp_path, good):
    tensors = dict(good[1])
    tensors["model.layers.0.self_attn.rotary_emb.inv_freq"] = np.ones(8, np.float32)
    _write(tmp_path, good, tensors)
    load_hf_llama(tmp_path)  # inv_freq is skipped
    tensors["model.layers.0.self_attn.q_proj.bias"] = np.zeros(64, np.float32)
    _write(tmp_path, good, tensors)
    with pytest.raises(CheckpointError, match=r"q_proj\.bias"):
        load_hf_llama(tmp_path)
