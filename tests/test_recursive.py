"""The recursive Llama (`models.recursive`): made from a Llama, it is that Llama's forward pass
with the block's layers repeated (R = 1: the Llama itself; R = 2: a Llama whose layer list
repeats the block), to 1e-5 in fp32; it saves and loads under its own names, whole or as its
block alone over a base GGUF (checked by sha256); LoopSpec and LoopAhead decode it exactly as
plain decoding does (the cache and mixed-depth pieces run in tests/test_looped.py)."""

from __future__ import annotations

import dataclasses
import json
import os
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from models.config import LlamaConfig, LoopedConfig
from models.hf_loader import CheckpointError
from models.layers import causal_mask
from models.llama import Llama
from models.looped_loader import load_hf_looped, load_looped_config, save_hf_looped
from models.recursive import RecursiveLM, from_llama
from test_gguf import E, F, H, HKV, L, V, gguf_tensors, hf_weights, write_gguf  # noqa: E402

B, T = 2, 7
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _llama(num_layers: int, seed: int = 0) -> Llama:
    cfg = LlamaConfig(vocab_size=61, hidden_size=32, intermediate_size=40, num_layers=num_layers,
                      num_heads=4, num_kv_heads=2, rope_theta=1e4, tie_word_embeddings=True,
                      max_position_embeddings=128, bos_token_id=1, eos_token_ids=(2,))
    model = Llama(cfg, rngs=nnx.Rngs(seed))
    rng = np.random.default_rng(seed)
    for _, var in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        w = var.get_value()
        if w.ndim == 1:  # norms: not all ones, so a misplaced norm shows
            var.set_value(w + 0.3 * jnp.asarray(rng.standard_normal(w.shape), w.dtype))
    return model


def _cfg(llama: Llama, prelude: int, core: int, coda: int, loops: int) -> LoopedConfig:
    c = llama.config
    return LoopedConfig(family="recursive", vocab_size=c.vocab_size, hidden_size=c.hidden_size,
                        intermediate_size=c.intermediate_size, num_heads=c.num_heads,
                        num_kv_heads=c.num_kv_heads, num_loops=loops, prelude_layers=prelude,
                        core_layers=core, coda_layers=coda, rope_theta=c.rope_theta,
                        rms_norm_eps=c.rms_norm_eps, tie_word_embeddings=True,
                        max_position_embeddings=c.max_position_embeddings, bos_token_id=1,
                        eos_token_ids=(2,))


def _inputs(vocab: int = 61):
    tokens = jnp.asarray(np.random.default_rng(1).integers(0, vocab, (B, T)), jnp.int32)
    pos = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32)[None], (B, T))
    return tokens, pos, causal_mask(jnp.full((B,), T, jnp.int32), T)


def test_one_loop_is_the_llama():
    llama = _llama(4)
    model = from_llama(llama, _cfg(llama, prelude=1, core=2, coda=1, loops=1))
    tokens, pos, mask = _inputs()
    want, _ = llama(tokens, pos, mask)
    got, kv = model(tokens, pos, mask)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5, rtol=0)
    assert kv.k.shape[0] == model.config.cache_slots == 1 + 2 + 1


def test_loops_repeat_the_block():
    """R = 3 loops of layers 1-2 = a Llama with layers [0, 1, 2, 1, 2, 1, 2, 3]; every loop's
    readout = that Llama truncated after the loop, then its last layer (the coda)."""
    base = _llama(4)
    model = from_llama(base, _cfg(base, prelude=1, core=2, coda=1, loops=3))
    order = [0, 1, 2, 1, 2, 1, 2, 3]
    unrolled = _llama(len(order), seed=5)
    for i, j in enumerate(order):
        nnx.update(unrolled.layers[i], nnx.state(base.layers[j]))
    nnx.update(unrolled.embed_tokens, nnx.state(base.embed_tokens))
    nnx.update(unrolled.norm, nnx.state(base.norm))
    tokens, pos, mask = _inputs()
    want, _ = unrolled(tokens, pos, mask)
    got, _ = model(tokens, pos, mask)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5, rtol=0)
    logits, gates = model.loop_logits(tokens, pos)
    assert gates is None and logits.shape[0] == 3
    for r in range(3):  # loop r+1's readout: layers [0] + [1, 2] * (r+1) + [3]
        short = _llama(2 + 2 * (r + 1), seed=6)
        for i, j in enumerate([0] + [1, 2] * (r + 1) + [3]):
            nnx.update(short.layers[i], nnx.state(base.layers[j]))
        nnx.update(short.embed_tokens, nnx.state(base.embed_tokens))
        nnx.update(short.norm, nnx.state(base.norm))
        np.testing.assert_allclose(np.asarray(logits[r]), np.asarray(short(tokens, pos, mask)[0]),
                                   atol=1e-5, rtol=0)


def test_from_llama_refuses_what_does_not_fit():
    llama = _llama(3)
    with pytest.raises(ValueError, match="no layers"):
        from_llama(llama, _cfg(llama, prelude=2, core=1, coda=2, loops=2))
    other = dataclasses.replace(_cfg(llama, 1, 1, 1, 2), hidden_size=64)
    with pytest.raises(ValueError, match="shape differs"):
        from_llama(llama, other)


def test_save_and_load_whole(tmp_path):
    llama = _llama(4)
    model = from_llama(llama, _cfg(llama, 1, 2, 1, 3))
    save_hf_looped(model, tmp_path)
    hf = json.loads((tmp_path / "config.json").read_text())
    assert hf["model_type"] == "recursive_llama"
    stages = (hf["prelude_layers"], hf["core_layers"], hf["coda_layers"], hf["num_loops"])
    assert stages == (1, 2, 1, 3)
    assert load_looped_config(tmp_path) == model.config
    from safetensors.numpy import load_file  # noqa: PLC0415
    names = set(load_file(str(tmp_path / "model.safetensors")))
    assert {"model.embed_tokens.weight", "model.norm.weight", "model.prelude.0.mlp.up_proj.weight",
            "model.core_block.1.self_attn.o_proj.weight",
            "model.coda.0.post_attention_layernorm.weight"} <= names
    assert len(names) == 2 + 4 * 9  # tied: no lm_head
    tokens, pos, _ = _inputs()
    loaded = load_hf_looped(tmp_path)
    assert isinstance(loaded, RecursiveLM)
    np.testing.assert_array_equal(np.asarray(loaded.loop_logits(tokens, pos)[0]),
                                  np.asarray(model.loop_logits(tokens, pos)[0]))


@pytest.fixture(scope="module")
def base_gguf(tmp_path_factory):
    """A tiny Llama GGUF (tests/test_gguf.py's writer: L layers) and the Llama it loads as."""
    from models.gguf_loader import load_gguf_llama  # noqa: PLC0415
    path = write_gguf(tmp_path_factory.mktemp("base") / "base.gguf", gguf_tensors(hf_weights()))
    return path, load_gguf_llama(path)


def test_block_only_checkpoint_over_a_base_gguf(tmp_path, base_gguf):
    import hashlib  # noqa: PLC0415
    path, llama = base_gguf
    assert L == 2
    cfg = LoopedConfig(family="recursive", vocab_size=V, hidden_size=E, intermediate_size=F,
                       num_heads=H, num_kv_heads=HKV, num_loops=3, prelude_layers=1,
                       core_layers=1, coda_layers=1, rope_theta=50000.0, rms_norm_eps=1e-6,
                       tie_word_embeddings=True, max_position_embeddings=256,
                       bos_token_id=1, eos_token_ids=(0,))
    model = from_llama(llama, cfg, core_from=0)
    layer = model.core_block[0]  # a block unlike any base layer
    layer.mlp.down_proj.kernel[...] = layer.mlp.down_proj.kernel[...] * 0.5
    sha = hashlib.sha256(open(path, "rb").read()).hexdigest()
    save_hf_looped(model, tmp_path, base_model={"name": "tiny", "sha256": sha})
    from safetensors.numpy import load_file  # noqa: PLC0415
    assert set(load_file(str(tmp_path / "model.safetensors"))) == {
        f"model.core_block.0.{n}.weight" for n in (
            "input_layernorm", "post_attention_layernorm", "self_attn.q_proj", "self_attn.k_proj",
            "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj",
            "mlp.down_proj")}
    tokens, pos, _ = _inputs(V)
    loaded = load_hf_looped(tmp_path, base=path)
    np.testing.assert_array_equal(np.asarray(loaded.loop_logits(tokens, pos)[0]),
                                  np.asarray(model.loop_logits(tokens, pos)[0]))
    with pytest.raises(CheckpointError, match="holds only the recurrent block.*base model tiny"):
        load_hf_looped(tmp_path)
    other = write_gguf(tmp_path / "other.gguf", gguf_tensors(hf_weights(seed=1)))
    with pytest.raises(CheckpointError, match="sha256 differs"):
        load_hf_looped(tmp_path, base=other)


def test_loopspec_and_loopahead_decode_it_as_plain():
    """The decoders on top of the looped pieces, once on this family: greedy LoopSpec and
    LoopAhead (untrained drafter) equal plain greedy decoding token for token."""
    from lookahead_jax.engine import Engine  # noqa: PLC0415
    from test_looped import RECURSIVE, _perturb_norms  # noqa: PLC0415
    from models.build import build_looped  # noqa: PLC0415
    model = _perturb_norms(build_looped(RECURSIVE, rngs=nnx.Rngs(3)))
    engine = Engine(model, eos_ids=())
    prompts = [[5, 9, 11, 3, 5, 9], [7, 8]]
    plain = engine.generate_ids(prompts, method="ar", max_new_tokens=8).tokens
    for method in ("loopspec", "loopahead"):
        got = engine.generate_ids(prompts, method=method, max_new_tokens=8)
        assert got.tokens == plain, method


def _skip_unless_shipped(name: str) -> None:
    """Skips unless a shipped SmolLM2-made-recursive preset can load: its block is in
    checkpoints/<name>, its other layers in the embedded SmolLM2 GGUF."""
    from lookahead_jax.store.model_store import smollm2_gguf  # noqa: PLC0415
    from lookahead_jax.store.presets import load_preset  # noqa: PLC0415
    from models.config import ConfigError  # noqa: PLC0415
    if not os.path.isdir(load_preset(name).checkpoint):
        pytest.skip(f"checkpoints/{name} not present")
    try:
        smollm2_gguf(download=False)
    except ConfigError as e:
        pytest.skip(f"SmolLM2 not available ({e})")


def _shipped(name: str):
    """The engine of a shipped SmolLM2-made-recursive preset, or skip."""
    from lookahead_jax.engine import Engine  # noqa: PLC0415
    _skip_unless_shipped(name)
    return Engine.from_preset(name)


def test_shipped_block_takes_the_base_models_tokenizer(tmp_path):
    """A shipped SmolLM2-made-recursive checkpoint holds no tokenizer files: the loader gives it
    SmolLM2's, read from the base GGUF (the same vocabulary, chat template and ids as the
    tokenizer.json such checkpoints used to copy); tokenizer files in the directory still take
    precedence."""
    import shutil  # noqa: PLC0415

    from lookahead_jax.store.checkpoint import (has_tokenizer_files,  # noqa: PLC0415
                                                load_model_and_tokenizer)
    from lookahead_jax.store.model_store import smollm2_gguf  # noqa: PLC0415
    from lookahead_jax.store.presets import load_preset  # noqa: PLC0415
    from lookahead_jax.store.tokenizer import encode_prompt, load_tokenizer  # noqa: PLC0415
    _skip_unless_shipped("smol_loop_2x2")
    preset = load_preset("smol_loop_2x2")
    for name in ("smol_loop", "smol_loop_r2", "smol_loop_2x2", "smol_loop_2x4"):
        assert not has_tokenizer_files(load_preset(name).checkpoint), name
    _, tok, _ = load_model_and_tokenizer(preset)
    base = load_tokenizer(smollm2_gguf(download=False))
    assert tok.get_vocab() == base.get_vocab() and tok.chat_template == base.chat_template
    text = "def f(x):\n    return x ** 2  # squares"
    assert encode_prompt(tok, text, chat=True) == encode_prompt(base, text, chat=True)
    assert encode_prompt(tok, text, chat=False) == encode_prompt(base, text, chat=False)
    own = tmp_path / "ckpt"
    shutil.copytree(preset.checkpoint, own)
    for f in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copyfile(os.path.join(REPO, "checkpoints", "tiny_ouro", f), own / f)
    _, tok, _ = load_model_and_tokenizer(preset, own)
    assert len(tok) == len(load_tokenizer(os.path.join(REPO, "checkpoints", "tiny_ouro")))
    assert len(tok) != len(base)


@pytest.mark.parametrize("name,margin", [("smol_loop", 0.1), ("smol_loop_r2", 0.05),
                                         ("smol_loop_2x2", 0.05), ("smol_loop_2x4", 0.1)])
def test_shipped_smol_loop_writes_text_and_uses_its_loops(name, margin):
    """The shipped model loads over the GGUF, its last loop predicts a fixed prose passage
    better than its first (by more than `margin` nats; smol_loop_r2 reads 3.52 -> 3.45 here, and
    on the 24 held-out windows of checkpoints/README.md smol_loop gains 0.57, smol_loop_r2
    0.105, smol_loop_2x2 0.198, smol_loop_2x4 0.239) and its greedy chat reply is words, which
    LoopSpec and LoopAhead (no drafter) reproduce, and so does LoopAhead with the model's shipped
    drafter, checkpoints/<name>_lad (the suite checks them on more prompts: benchmarks/results)."""
    engine = _shipped(name)
    tok = engine.tokenizer
    model = nnx.merge(engine.graphdef, engine.params)
    text = ("The Python standard library contains modules for working with files, dates and "
            "times, regular expressions, networking and many other everyday programming tasks. "
            "Most of them are written in Python itself, and reading their source is a good way "
            "to learn how experienced programmers structure their code.")
    ids = jnp.asarray([tok.encode(text, add_special_tokens=False)], jnp.int32)
    pos = jnp.arange(ids.shape[1], dtype=jnp.int32)[None]
    logits, _ = model.loop_logits(ids[:, :-1], pos[:, :-1])
    lp = jax.nn.log_softmax(logits, axis=-1)
    ce = -np.asarray(jnp.take_along_axis(lp, ids[None, :, 1:, None], axis=-1)).mean(axis=(1, 2, 3))
    assert ce[-1] < ce[0] - margin, ce
    prompt = engine.encode("Name three colours of the rainbow.")
    plain = engine.generate_ids([prompt], method="ar", max_new_tokens=16)
    words = tok.decode(plain.tokens[0])
    assert sum(w.isalpha() for w in words.split()) >= 3, words
    from lookahead_jax.store.presets import load_preset  # noqa: PLC0415
    from lookahead_jax.looped.drafter import DrafterModelWarning, params_digest  # noqa: PLC0415
    lad = load_preset(name).checkpoint.rstrip("/") + "_lad"
    with warnings.catch_warnings():
        warnings.simplefilter("error", DrafterModelWarning)  # it records this very model
        drafted = engine.build_method("loopahead", lad=lad)
    assert drafted.drafter.base_digest == params_digest(model)
    for method in ("loopspec", "loopahead", drafted):
        got = engine.generate_ids([prompt], method=method, max_new_tokens=16)
        assert got.tokens == plain.tokens, method
    if name == "smol_loop_2x4":  # smol_loop's drafter has this model's shape, not its weights
        with pytest.warns(DrafterModelWarning):
            engine.build_method("loopahead", lad=os.path.join(REPO, "checkpoints",
                                                              "smol_loop_lad"))
        # Raven's residual head on this model: the drafter above, frozen, drafting from loop
        # 2's states through a trained residual head (feedback at depth 3)
        with warnings.catch_warnings():
            warnings.simplefilter("error", DrafterModelWarning)
            deeper = engine.build_method("loopahead", lad=os.path.join(
                REPO, "checkpoints", "smol_loop_2x4_d2_lad"), r2=3)
        assert (deeper.r1, deeper.r2, deeper.drafter.backbone_depth) == (2, 3, 1)
        got = engine.generate_ids([prompt], method=deeper, max_new_tokens=16)
        assert got.tokens == plain.tokens
