"""The decoder families (#23): Llama 3.x, Mistral, Qwen 2.5, Qwen 3, Gemma 2, Gemma 3 (text and
multimodal checkpoints) and Phi-3, each checked against transformers' own implementation.

Per family, a random tiny configuration with every switch that family has turned on (small
sliding windows, so a 16-token sequence crosses them; soft-caps small enough to bite; norms and
biases perturbed off their initial values) is saved as a Hugging Face checkpoint and loaded:
  * logits within 1e-4 of transformers (CPU torch, float32) for a whole prompt and through
    prefill + one-token cached decoding;
  * greedy lookahead and prompt lookup emit exactly plain greedy's tokens;
  * sliding windows end at the right key, in the model and against transformers;
  * a checkpoint of the wrong family or shape is refused, naming the field.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import warnings

import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from lookahead_jax.engine import Engine  # noqa: E402
from lookahead_jax.generation import prefill  # noqa: E402
from lookahead_jax.lookahead.config import LookaheadConfig  # noqa: E402
from lookahead_jax.store.checkpoint import load_model_and_tokenizer  # noqa: E402
from lookahead_jax.store.presets import load_preset  # noqa: E402
from lookahead_jax.store.tokenizer import encode_prompt  # noqa: E402
from models.config import ConfigError, LlamaConfig, RopeScaling  # noqa: E402
from models.families import Target  # noqa: E402
from models.hf_loader import CheckpointError, _read_part, load_hf_config, load_hf_llama  # noqa: E402
from models.layers import causal_mask  # noqa: E402
from tests.conftest import tiny_bpe_tokenizer  # noqa: E402

B, T = 2, 16
WINDOW = 5  # every sliding window here: a 16-token sequence crosses it
V = 128
BASE = dict(vocab_size=V, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
            initializer_range=0.1, attn_implementation="eager", bos_token_id=1, eos_token_id=2,
            pad_token_id=0)

# family -> (transformers model class, its config class, config overrides, what it exercises)
FAMILIES = {
    "llama3": ("LlamaForCausalLM", "LlamaConfig", dict(
        tie_word_embeddings=True, rope_parameters=dict(
            rope_type="llama3", rope_theta=500000.0, factor=8.0, low_freq_factor=1.0,
            high_freq_factor=4.0, original_max_position_embeddings=32)),
        "llama3 RoPE scaling, tied embeddings (Llama 3.2 1B/3B)"),
    "mistral": ("MistralForCausalLM", "MistralConfig", dict(sliding_window=WINDOW),
                "sliding window on every layer"),
    "qwen2": ("Qwen2ForCausalLM", "Qwen2Config", dict(
        use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1,
        tie_word_embeddings=True),
        "q/k/v biases; layer 0 full, layer 1 sliding (max_window_layers); tied"),
    "qwen3": ("Qwen3ForCausalLM", "Qwen3Config", dict(head_dim=32),
              "q/k RMSNorm; head_dim != hidden / heads"),
    "gemma2": ("Gemma2ForCausalLM", "Gemma2Config", dict(
        head_dim=16, sliding_window=WINDOW, query_pre_attn_scalar=24,
        attn_logit_softcapping=2.0, final_logit_softcapping=3.0,
        hidden_activation="gelu_pytorch_tanh"),
        "(1 + w) norms before and after attention and MLP, GeGLU, sqrt(hidden) embedding scale, "
        "query_pre_attn_scalar, attention and logit soft-caps, sliding/global alternation"),
    "gemma3": ("Gemma3ForCausalLM", "Gemma3TextConfig", dict(
        num_hidden_layers=3, head_dim=16, sliding_window=WINDOW, query_pre_attn_scalar=24,
        layer_types=["sliding_attention", "sliding_attention", "full_attention"],
        rope_parameters={"full_attention": dict(rope_type="linear", factor=2.0, rope_theta=1e6),
                         "sliding_attention": dict(rope_type="default", rope_theta=1e4)}),
        "Gemma 2's layout with q/k norms and no soft-caps, local RoPE base on sliding layers, "
        "linear scaling on global ones"),
    "phi3": ("Phi3ForCausalLM", "Phi3Config", dict(sliding_window=WINDOW),
             "fused qkv_proj and gate_up_proj, sliding window"),
}


def hf_model(family: str, seed: int = 0):
    model_cls, cfg_cls, overrides, _ = FAMILIES[family]
    cfg = getattr(transformers, cfg_cls)(**{**BASE, **overrides})
    torch.manual_seed(seed)
    model = getattr(transformers, model_cls)(cfg).eval()
    perturb(model)
    return model


def perturb(model) -> None:
    """Norm weights and biases off their initial values (ones or zeros), so that a norm or a
    bias loaded wrong, or a missing +1 offset, shows in the logits."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or name.endswith(".bias"):
                p.add_(0.3 * torch.randn_like(p))


def tokens() -> np.ndarray:
    return np.random.default_rng(0).integers(3, V, (B, T)).astype(np.int32)


def hf_logits(model, toks: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        return model(torch.from_numpy(toks).long()).logits.float().numpy()


def full_logits(model, toks: np.ndarray) -> np.ndarray:
    b, t = toks.shape
    positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32)[None], (b, t))
    logits, _ = model(jnp.asarray(toks), positions, causal_mask(jnp.full((b,), t, jnp.int32), t))
    return np.asarray(logits)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """family -> (checkpoint dir, transformers' float32 logits of `tokens()`), saved once."""
    cache = {}

    def get(family):
        if family not in cache:
            model = hf_model(family)
            path = tmp_path_factory.mktemp(family)
            model.save_pretrained(path)
            cache[family] = (path, hf_logits(model, tokens()))
        return cache[family]
    return get


@pytest.fixture(scope="module")
def loaded(saved):
    cache = {}

    def get(family):
        if family not in cache:
            cache[family] = load_hf_llama(saved(family)[0])
        return cache[family]
    return get


# -- parity with transformers ---------------------------------------------------------------------
@pytest.mark.parametrize("family", list(FAMILIES))
def test_whole_prompt_logits_match_transformers(family, saved, loaded):
    _, want = saved(family)
    got = full_logits(loaded(family), tokens())
    diff = float(np.abs(got - want).max())
    print(f"\n{family}: max |logit difference| whole prompt {diff:.2e}")
    assert diff < 1e-4
    assert np.abs(want).max() > 0.1  # logits that say something


@pytest.mark.parametrize("family", list(FAMILIES))
def test_cached_decoding_matches_transformers(family, saved, loaded):
    """Prefill rows of different lengths (right-padded), then one token at a time past the
    sliding window: each step's logits are transformers' at that position."""
    _, want = saved(family)
    model, toks = loaded(family), tokens()
    lengths = np.array([3, 6], np.int32)
    cache = model.init_cache(B, 32)
    last, cache = prefill(model, jnp.asarray(toks[:, :8]), jnp.asarray(lengths), cache)
    np.testing.assert_allclose(np.asarray(last), want[np.arange(B), lengths - 1], atol=1e-4, rtol=0)
    one = jnp.ones((B,), jnp.int32)
    worst = float(np.abs(np.asarray(last) - want[np.arange(B), lengths - 1]).max())
    for step in range(T - int(lengths.max())):
        pos = lengths + step
        tok = toks[np.arange(B), pos][:, None]
        logits, new = model(jnp.asarray(tok), jnp.asarray(pos[:, None]),
                            causal_mask(one, 1, cache), cache)
        cache = cache.append(new, jnp.zeros((B, 1), jnp.int32), one)
        np.testing.assert_allclose(np.asarray(logits[:, 0]), want[np.arange(B), pos], atol=1e-4,
                                   rtol=0, err_msg=f"{family}: decode step {step}")
        worst = max(worst, float(np.abs(np.asarray(logits[:, 0]) - want[np.arange(B), pos]).max()))
    print(f"\n{family}: max |logit difference| prefill + cached decoding {worst:.2e}")


EXPECTED_CONFIG = {
    "llama3": dict(family="llama", tie_word_embeddings=True, rope_theta=500000.0,
                   rope_scaling=RopeScaling("llama3", 8.0, 1.0, 4.0, 32)),
    "mistral": dict(family="mistral", sliding_window=WINDOW, layer_kinds=("sliding",) * 2),
    "qwen2": dict(family="qwen2", qkv_bias=True, o_bias=False, tie_word_embeddings=True,
                  sliding_window=WINDOW, layer_kinds=("full", "sliding")),
    "qwen3": dict(family="qwen3", qk_norm=True, head_dim=32, layer_kinds=("full",) * 2),
    "gemma2": dict(family="gemma2", norm_offset=1.0, sandwich_norms=True, hidden_act="gelu_tanh",
                   embed_scale=8.0, query_scale=24 ** -0.5, attn_softcap=2.0, final_softcap=3.0,
                   layer_kinds=("sliding", "full"), tie_word_embeddings=True),
    "gemma3": dict(family="gemma3", qk_norm=True, attn_softcap=0.0, final_softcap=0.0,
                   layer_kinds=("sliding", "sliding", "full"), rope_theta=1e6,
                   rope_scaling=RopeScaling("linear", 2.0), local_rope_theta=1e4),
    "phi3": dict(family="phi3", sliding_window=WINDOW, layer_kinds=("sliding",) * 2),
}


@pytest.mark.parametrize("family", list(FAMILIES))
def test_config_read_from_config_json(family, saved):
    cfg = load_hf_config(saved(family)[0])
    for field, want in EXPECTED_CONFIG[family].items():
        assert getattr(cfg, field) == pytest.approx(want) if isinstance(want, float) else \
            getattr(cfg, field) == want, field


def test_each_switch_matters(saved, loaded):
    """Turning a family's switch off changes the logits: the parity above is not luck."""
    toks = tokens()
    for family, field, off in [("gemma2", "attn_softcap", 0.0), ("gemma2", "final_softcap", 0.0),
                               ("gemma2", "query_scale", 0.0), ("gemma2", "embed_scale", 1.0),
                               ("gemma3", "local_rope_theta", 0.0),
                               ("mistral", "sliding_window", 0), ("qwen2", "sliding_window", 0)]:
        path, want = saved(family)
        cfg = load_hf_config(path)
        changes = {field: off}
        if field == "sliding_window":
            changes["layer_types"] = ()
        model = load_hf_llama(path, config=dataclasses.replace(cfg, **changes))
        assert np.abs(full_logits(model, toks) - want).max() > 1e-3, (family, field)


def test_bf16_sharded_checkpoint(tmp_path):
    """A bfloat16 checkpoint split over several safetensors files loads (read as float32, the
    logits are transformers' on the same bf16-rounded weights)."""
    model = hf_model("qwen2", seed=1).to(torch.bfloat16)
    model.save_pretrained(tmp_path, max_shard_size="40KB")
    assert (tmp_path / "model.safetensors.index.json").exists()
    # transformers' float32 model of the saved bf16 weights (its RoPE tables in float32 again)
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path, dtype=torch.float32, attn_implementation="eager").eval()
    want = hf_logits(reloaded, tokens())
    got = full_logits(load_hf_llama(tmp_path), tokens())
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=0)


def test_fused_rows_read_in_parts():
    """Phi-3's fused tensor [q | k | v] rows: any slice of a part (as a mesh's devices read
    them) is that part's slice of the whole."""
    rng = np.random.default_rng(0)
    fused = rng.normal(size=(4 + 2 + 2, 3)).astype(np.float32)  # [out, in]
    v = Target(("v_proj", "kernel"), True, (6, 8))
    whole = _read_part(fused, v, (3, 2), np.dtype(np.float32))
    np.testing.assert_array_equal(whole, fused[6:8].T)
    part = _read_part(fused, v, (3, 2), np.dtype(np.float32), (slice(0, 3), slice(1, 2)))
    np.testing.assert_array_equal(part, fused[7:8].T)


# -- sliding windows ------------------------------------------------------------------------------
def test_sliding_window_ends_at_the_right_key():
    """One sliding layer of window w: the last position p sees the token at p - w + 1 and not
    the one at p - w (transformers' rule: key position > query position - window)."""
    cfg = LlamaConfig(vocab_size=V, hidden_size=32, intermediate_size=64, num_layers=1,
                      num_heads=2, num_kv_heads=1, sliding_window=4, family="mistral")
    from flax import nnx  # noqa: PLC0415
    from models.llama import Llama  # noqa: PLC0415
    model = Llama(cfg, rngs=nnx.Rngs(0))
    toks = np.random.default_rng(1).integers(3, V, (1, 10)).astype(np.int32)
    base = full_logits(model, toks)[0, -1]
    p = 9
    for pos, seen in ((p - 4, False), (p - 3, True)):
        changed = toks.copy()
        changed[0, pos] = (changed[0, pos] + 1) % V
        moved = np.abs(full_logits(model, changed)[0, -1] - base).max()
        assert (moved > 1e-6) == seen, (pos, moved)


# -- lossless decoding ----------------------------------------------------------------------------
LOSSLESS_FAMILIES = ["llama3", "mistral", "qwen2", "qwen3", "gemma2", "gemma3", "phi3"]
PROMPT_LENS = (3, 9, 14)
MAX_NEW = 24  # sequences well past every sliding window


@pytest.mark.parametrize("family", LOSSLESS_FAMILIES)
def test_lookahead_and_prompt_lookup_equal_plain_greedy(family, loaded):
    rng = np.random.default_rng(2)
    prompts = [rng.integers(3, V, n).tolist() for n in PROMPT_LENS]
    # a repeated stretch, so that prompt lookup and prompt seeding have something to draft
    prompts[2] = prompts[2][:7] + prompts[2][:7]
    engine = Engine(loaded(family), eos_ids=())
    plain = engine.generate_ids(prompts, method="ar", max_new_tokens=MAX_NEW).tokens
    la = engine.generate_ids(prompts, method="lookahead", max_new_tokens=MAX_NEW,
                             lookahead=LookaheadConfig(W=4, N=3, G=4, prompt_seeding=True))
    pl = engine.generate_ids(prompts, method="prompt_lookup", max_new_tokens=MAX_NEW)
    assert la.tokens == plain, family
    assert pl.tokens == plain, family
    assert la.stats.steps < sum(len(t) for t in plain)  # it did run lookahead steps


def test_pallas_kernel_declines_softcap_and_window_layers(loaded):
    """Gemma 3 with the Pallas kernel (interpreted): its sliding layers run dense (a warning
    says so), its global layer the kernel; output equals plain greedy's."""
    from pallas_kernels.lookahead_attention import KernelDeclined, PallasAttention  # noqa: PLC0415
    kernel = PallasAttention("triton", interpret=True)
    assert kernel.declines({"window": 5, "scale": 0.2}) == ("window",)
    assert kernel.declines({"softcap": 2.0}) == ("softcap",)
    assert kernel.declines({"scale": 0.2}) == ()
    engine = Engine(loaded("gemma3"), eos_ids=())
    prompt = [[5, 9, 17, 5, 9, 17, 5, 9]]
    plain = engine.generate_ids(prompt, method="ar", max_new_tokens=8).tokens
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = Engine(loaded("gemma3"), eos_ids=(), attention=kernel).generate_ids(
            prompt, method="lookahead", max_new_tokens=8,
            lookahead=LookaheadConfig(W=3, N=3, G=3, prompt_seeding=True)).tokens
    assert out == plain
    assert any(issubclass(w.category, KernelDeclined) and "window" in str(w.message)
               for w in caught)


# -- refusing the wrong checkpoint ----------------------------------------------------------------
def test_wrong_family_for_the_preset_is_refused(saved):
    with pytest.raises(ConfigError, match=r"family is qwen2 in the checkpoint, llama in the "
                                          r"preset"):
        load_model_and_tokenizer(load_preset("llama7b"), ckpt=saved("qwen2")[0])


def test_wrong_shape_for_the_preset_is_refused(saved):
    with pytest.raises(ConfigError, match=r"preset qwen2p5_7b: vocab_size is 128 in the "
                                          r"checkpoint, 152064 in the preset"):
        load_model_and_tokenizer(load_preset("qwen2p5_7b"), ckpt=saved("qwen2")[0])


def test_tensors_of_another_family_are_refused(saved, tmp_path):
    """config.json says qwen2 but the tensors are Llama's: the missing biases are named."""
    src = saved("llama3")[0]
    for f in src.iterdir():
        shutil.copy(f, tmp_path / f.name)
    hf = json.loads((tmp_path / "config.json").read_text())
    hf["model_type"] = "qwen2"
    (tmp_path / "config.json").write_text(json.dumps(hf))
    with pytest.raises(CheckpointError, match=r"missing from the checkpoint: "
                                              r"model\.layers\.0\.self_attn\.q_proj\.bias"):
        load_hf_llama(tmp_path)


@pytest.mark.parametrize("field, value, match", [
    ("model_type", "falcon", r"model_type 'falcon' is not a supported decoder family"),
    ("partial_rotary_factor", 0.75, r"partial_rotary_factor = 0.75 is not supported"),
    ("hidden_act", "relu", r"unsupported hidden_act 'relu'"),
    ("layer_types", ["chunked_attention", "full_attention"], r"unsupported layer type "
                                                             r"'chunked_attention'"),
])
def test_unsupported_config_fields_are_named(saved, tmp_path, field, value, match):
    family = "qwen2" if field == "layer_types" else "phi3"  # qwen2 reads layer_types
    hf = json.loads((saved(family)[0] / "config.json").read_text())
    hf[field] = value
    if field == "partial_rotary_factor":
        hf.setdefault("rope_parameters", {})["partial_rotary_factor"] = value
    (tmp_path / "config.json").write_text(json.dumps(hf))
    with pytest.raises(CheckpointError, match=match):
        load_hf_config(tmp_path)


# -- chat template and the multimodal Gemma 3 -----------------------------------------------------
GEMMA_TEMPLATE = ("{% for m in messages %}<start_of_turn>{{ m['role'] }}\n"
                  "{{ m['content'] }}<end_of_turn>\n{% endfor %}"
                  "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}")


def with_tokenizer(src, dst):
    """A copy of checkpoint `src` in `dst` with tokenizer files whose chat template is Gemma's."""
    for f in src.iterdir():
        shutil.copy(f, dst / f.name)
    tok = tiny_bpe_tokenizer(["<start_of_turn>user hello<end_of_turn> model: hi there"], 120)
    tok.chat_template = GEMMA_TEMPLATE
    tok.save_pretrained(dst)
    return dst


def test_chat_template_read_from_the_tokenizer_files(saved, tmp_path):
    """A checkpoint's tokenizer files bring its chat template (Gemma's turn markers here)."""
    path = with_tokenizer(saved("gemma2")[0], tmp_path)
    preset = dataclasses.replace(load_preset("gemma2_9b"), model=None)
    model, tokenizer, _ = load_model_and_tokenizer(preset, ckpt=path)
    ids = encode_prompt(tokenizer, "hello", chat=True)
    assert tokenizer.decode(ids) == "<start_of_turn>user\nhello<end_of_turn>\n<start_of_turn>model\n"
    assert model.config.family == "gemma2"


def test_multimodal_gemma3_checkpoint_loads_its_text_model(tmp_path):
    """A Gemma3ForConditionalGeneration checkpoint (vision tower and all): the text model is
    loaded, its logits on text are transformers'."""
    _, _, overrides, _ = FAMILIES["gemma3"]
    text = transformers.Gemma3TextConfig(**{**BASE, **overrides})
    vision = transformers.SiglipVisionConfig(hidden_size=16, intermediate_size=32,
                                             num_hidden_layers=1, num_attention_heads=2,
                                             image_size=16, patch_size=8)
    cfg = transformers.Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4,
                                    image_token_index=V - 1, boi_token_index=V - 2,
                                    eoi_token_index=V - 3)
    torch.manual_seed(0)
    model = transformers.Gemma3ForConditionalGeneration(cfg).eval()
    perturb(model)
    model.save_pretrained(tmp_path)
    want = hf_logits(model, tokens())
    ours = load_hf_llama(tmp_path)
    assert ours.config.family == "gemma3"
    np.testing.assert_allclose(full_logits(ours, tokens()), want, atol=1e-4, rtol=0)


# -- presets --------------------------------------------------------------------------------------
FAMILY_PRESETS = {"llama3_8b": "llama", "llama3_70b": "llama", "qwen2p5_7b": "qwen2",
                  "qwen3_8b": "qwen3", "gemma2_9b": "gemma2", "gemma3_12b": "gemma3",
                  "mistral_7b": "mistral", "phi3_mini": "phi3"}


def test_family_presets_carry_the_settings_chosen_for_their_shape():
    """Each family preset's lookahead setting is the one `python -m benchmarks.family_presets`
    chose for its model's shape (committed in benchmarks/results/family_presets.json), and the
    preset without weights names the directory to pass."""
    import os  # noqa: PLC0415
    path = os.path.join(os.path.dirname(__file__), "..", "benchmarks", "results",
                        "family_presets.json")
    rows = {r["preset"]: r for r in json.loads(open(path).read())["rows"]}
    assert set(rows) == set(FAMILY_PRESETS)
    for name, family in FAMILY_PRESETS.items():
        preset = load_preset(name)
        assert preset.model.family == family
        la = preset.lookahead
        assert [la.W, la.N, la.G] == [rows[name][k] for k in "WNG"], name
        with pytest.raises(ConfigError, match=rf"preset {name} needs weights: pass "
                                              rf"--ckpt=/path/to/{preset.weights_hint}"):
            load_model_and_tokenizer(preset)


def test_hf_preset_takes_any_family_and_size(saved, tmp_path):
    """`--config=hf`: the model (family and shape) comes from the checkpoint."""
    path = with_tokenizer(saved("qwen3")[0], tmp_path)
    model, _, _ = load_model_and_tokenizer(load_preset("hf"), ckpt=path, dtype="float32")
    assert model.config.family == "qwen3" and model.config.hidden_size == 64
