"""Loader parity for the looped families: Ouro and Huginn/Raven checkpoints loaded with
`load_hf_looped` give the logits of an independent NumPy float64 forward pass written from the
published modeling code (tests/looped_reference.py), not just of our own writer
(tests/test_looped_loader.py checks the round trip).

The checkpoints are random weights made here in NumPy under the published tensor names, with
config.json dicts in the published field names (Ouro: OuroConfig; Raven: RavenConfig, with
and without `init_values`, `n_heads` or `num_attention_heads`, the persistent `freqs_cis`
buffer the Huginn checkpoint holds), written with `safetensors.numpy.save_file` directly: our
`save_hf_looped` is not involved. Several small configs per family (grouped-query and
multi-head attention, tied and untied embeddings, an explicit Ouro head_dim, Raven with and
without qk_bias, with and without prelude, several loop counts), a prompt of 7 tokens in 2 rows.
Compared: every loop's readout (our `loop_logits`: Ouro's per-loop logits and exit-gate logits,
Raven's `predict_from_latents` of every step), and the full-depth `__call__`, float32 against
float64 within 1e-4 of the logit scale. Raven's initial state is random in the published code:
our deterministic one (`RavenLM.initial_state`) is handed to the reference as its
`input_states`, and checked against the published law's bound (3 std * embed_scale).

So that the comparison cannot pass vacuously, deliberate architectural mistakes planted in
the reference (state and prelude output swapped in Raven's adapter, the other RoPE layout,
no embedding scale, no ln_f before the coda; Ouro's final norm applied once instead of every
loop, a missing sandwich norm, the exit gate read before the norm) must each give an error
at least 100 times the tolerance.
"""

from __future__ import annotations

import json
import math

import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import save_file

from models.looped import LoopedLM, default_mask
from models.looped_loader import load_hf_looped
from looped_reference import (OURO_PLANTS, RAVEN_PLANTS, ouro_forward, raven_forward,
                              raven_init_values)

B, T = 2, 7
TOL = 1e-4  # of the logit scale (max |reference logit|)

OURO_BASE = {"architectures": ["OuroForCausalLM"], "model_type": "ouro", "vocab_size": 61,
             "intermediate_size": 48, "hidden_act": "silu", "rms_norm_eps": 1e-6,
             "rope_scaling": None, "use_sliding_window": False,
             "max_position_embeddings": 128, "early_exit_threshold": 1.0,
             "bos_token_id": 1, "eos_token_id": 2}
OURO = {
    "gqa_untied_4loops": {**OURO_BASE, "hidden_size": 32, "num_attention_heads": 4,
                          "num_key_value_heads": 2, "num_hidden_layers": 2,
                          "total_ut_steps": 4, "tie_word_embeddings": False,
                          "rope_theta": 10000.0},
    "mha_tied_head_dim12_3loops": {**OURO_BASE, "hidden_size": 32, "num_attention_heads": 4,
                                   "num_key_value_heads": 4, "head_dim": 12,
                                   "num_hidden_layers": 1, "total_ut_steps": 3,
                                   "tie_word_embeddings": True, "rope_theta": 1e6,
                                   "rms_norm_eps": 1e-5},
    "mqa_untied_1loop": {**OURO_BASE, "hidden_size": 32, "num_attention_heads": 4,
                         "num_key_value_heads": 1, "num_hidden_layers": 3, "total_ut_steps": 1,
                         "tie_word_embeddings": False, "rope_theta": 10000.0},
}


def _huginn_init_values(e: int, depth: int) -> dict[str, float]:
    """`init_values` as huginn-0125's config.json spells them out."""
    std = math.sqrt(2 / (5 * e))
    return {"std": std, "out_proj": std / math.sqrt(2 * depth), "embedding": std,
            "embed_scale": math.sqrt(e)}


RAVEN_BASE = {"architectures": ["RavenForCausalLM"], "model_type": "huginn_raven",
              "vocab_size": 64, "padding_multiple": 64, "intermediate_size": 48,
              "block_size": 64, "bias": False, "norm_eps": 1e-6,
              "block_class_name": "SandwichBlock", "norm_class_name": "RMSNorm_llama",
              "mlp_class_name": "GatedMLP", "nonlin_name": "SiLU",
              "injection_type": "linear", "state_init": "like-init",
              "bos_token_id": 1, "eos_token_id": 2}
RAVEN = {
    "huginn_like_qk_bias_tied_4steps": {
        **RAVEN_BASE, "n_embd": 32, "n_heads": 4, "num_key_value_heads": 4, "n_layers": 4,
        "n_layers_in_prelude": 1, "n_layers_in_recurrent_block": 2, "n_layers_in_coda": 1,
        "mean_recurrence": 4, "tie_embeddings": True, "qk_bias": True, "rope_base": 50000,
        "init_values": _huginn_init_values(32, 1 + 1 + 2 * 4)},
    "gqa_untied_no_qk_bias_3steps": {
        **RAVEN_BASE, "n_embd": 32, "n_heads": 4, "num_key_value_heads": 2, "n_layers": 5,
        "n_layers_in_prelude": 2, "n_layers_in_recurrent_block": 1, "n_layers_in_coda": 2,
        "mean_recurrence": 3, "tie_embeddings": False, "qk_bias": False, "rope_base": 10000},
    # the spelling of converted checkpoints: num_attention_heads, no embedding scale
    "embed_scale1_no_prelude_6steps": {
        **RAVEN_BASE, "n_embd": 32, "num_attention_heads": 4, "num_key_value_heads": 4,
        "n_layers": 3, "n_layers_in_prelude": 0, "n_layers_in_recurrent_block": 2,
        "n_layers_in_coda": 1, "mean_recurrence": 6, "tie_embeddings": True, "qk_bias": False,
        "rope_base": 500000.0, "norm_eps": 1e-5,
        "init_values": {"std": math.sqrt(2 / (5 * 32)), "embed_scale": 1.0}},
}


# ---- random checkpoints under the published names --------------------------------------------

class _Draw:
    """Random float32 tensors: weights N(0, 1/in), norm weights 1 + N(0, 0.3^2)."""

    def __init__(self, seed: int):
        self.rng = np.random.default_rng(seed)

    def normal(self, *shape: int, std: float = 1.0) -> np.ndarray:
        return (std * self.rng.standard_normal(shape)).astype(np.float32)

    def linear(self, out: int, inp: int) -> np.ndarray:
        return self.normal(out, inp, std=inp ** -0.5)

    def norm(self, n: int) -> np.ndarray:
        return 1 + self.normal(n, std=0.3)


def ouro_weights(cfg: dict, seed: int = 0) -> dict[str, np.ndarray]:
    """Every tensor of `OuroForCausalLM` (lm_head only when untied), by its published name."""
    d = _Draw(seed)
    e, v, f = cfg["hidden_size"], cfg["vocab_size"], cfg["intermediate_size"]
    h, hkv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    hd = cfg.get("head_dim") or e // h
    w = {"model.embed_tokens.weight": d.normal(v, e), "model.norm.weight": d.norm(e),
         "model.early_exit_gate.weight": d.linear(1, e),
         "model.early_exit_gate.bias": d.normal(1)}
    if not cfg["tie_word_embeddings"]:
        w["lm_head.weight"] = d.linear(v, e)
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        for norm in ("input_layernorm", "input_layernorm_2", "post_attention_layernorm",
                     "post_attention_layernorm_2"):
            w[p + norm + ".weight"] = d.norm(e)
        w[p + "self_attn.q_proj.weight"] = d.linear(h * hd, e)
        w[p + "self_attn.k_proj.weight"] = d.linear(hkv * hd, e)
        w[p + "self_attn.v_proj.weight"] = d.linear(hkv * hd, e)
        w[p + "self_attn.o_proj.weight"] = d.linear(e, h * hd)
        w[p + "mlp.gate_proj.weight"] = d.linear(f, e)
        w[p + "mlp.up_proj.weight"] = d.linear(f, e)
        w[p + "mlp.down_proj.weight"] = d.linear(e, f)
    return w


def raven_weights(cfg: dict, seed: int = 0) -> dict[str, np.ndarray]:
    """Every tensor of `RavenForCausalLM` (lm_head only when untied, the persistent
    `freqs_cis` RoPE table as the published checkpoint holds it), by its published name."""
    d = _Draw(seed)
    e, v, f = cfg["n_embd"], cfg["vocab_size"], cfg["intermediate_size"]
    h = cfg.get("n_heads") or cfg["num_attention_heads"]
    hkv, hd = cfg["num_key_value_heads"], e // h
    w = {"transformer.wte.weight": d.normal(v, e, std=e ** -0.5),
         "transformer.adapter.weight": d.linear(e, 2 * e),
         "transformer.ln_f.weight": d.norm(e),
         "freqs_cis": np.zeros((1, cfg["block_size"], 1, hd // 2, 2), np.float32)}
    if not cfg["tie_embeddings"]:
        w["lm_head.weight"] = d.linear(v, e)
    for group, n in (("prelude", cfg["n_layers_in_prelude"]),
                     ("core_block", cfg["n_layers_in_recurrent_block"]),
                     ("coda", cfg["n_layers_in_coda"])):
        for i in range(n):
            p = f"transformer.{group}.{i}."
            for norm in ("norm_1", "norm_2", "norm_3", "norm_4"):
                w[p + norm + ".weight"] = d.norm(e)
            w[p + "attn.Wqkv.weight"] = d.linear((h + 2 * hkv) * hd, e)
            if cfg["qk_bias"]:
                w[p + "attn.qk_bias"] = d.normal(2, 1, h, hd, std=0.5)
            w[p + "attn.proj.weight"] = d.linear(e, h * hd)
            w[p + "mlp.fc.weight"] = d.linear(2 * f, e)
            w[p + "mlp.proj.weight"] = d.linear(e, f)
    return w


def _write(path, cfg: dict, weights: dict[str, np.ndarray]) -> None:
    (path / "config.json").write_text(json.dumps(cfg, indent=2))
    save_file(weights, str(path / "model.safetensors"), metadata={"format": "pt"})


def _ids(vocab: int) -> np.ndarray:
    return np.random.default_rng(7).integers(0, vocab, (B, T))


def _ours(model: LoopedLM, ids: np.ndarray):
    """Our loaded model on ids [B,T] at positions 0..T-1: per-loop logits [R,B,T,V], exit
    gates [R,B,T] (None: raven), full-depth `__call__` logits [B,T,V]."""
    tokens = jnp.asarray(ids, jnp.int32)
    pos = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32)[None], (B, T))
    logits, gates = model.loop_logits(tokens, pos)
    full, _ = model(tokens, pos, default_mask(None, pos))
    return (np.asarray(logits, np.float64), None if gates is None else np.asarray(gates),
            np.asarray(full, np.float64))


def _err(got: np.ndarray, want: np.ndarray) -> float:
    """max |got - want| relative to the logit scale max |want|."""
    return float(np.abs(got - want).max() / np.abs(want).max())


def _checkpoint(configs: dict, name: str, make_weights, tmp_path_factory):
    """(config dict, weights, ids, our model loaded from the checkpoint written for them)."""
    cfg = configs[name]
    weights = make_weights(cfg)
    path = tmp_path_factory.mktemp(name)
    _write(path, cfg, weights)
    return cfg, weights, _ids(cfg["vocab_size"]), load_hf_looped(path)


@pytest.fixture(scope="module", params=list(OURO))
def ouro(request, tmp_path_factory):
    """(config dict, weights, ids, our per-loop logits, gates, full-depth logits)."""
    cfg, weights, ids, model = _checkpoint(OURO, request.param, ouro_weights, tmp_path_factory)
    return (cfg, weights, ids, *_ours(model, ids))


@pytest.fixture(scope="module", params=list(RAVEN))
def raven(request, tmp_path_factory):
    """(config dict, weights, ids, our initial state, per-loop logits, full-depth logits)."""
    cfg, weights, ids, model = _checkpoint(RAVEN, request.param, raven_weights, tmp_path_factory)
    pos = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32)[None], (B, T))
    state = np.asarray(model.initial_state(jnp.zeros((B, T, cfg["n_embd"])), pos), np.float64)
    logits, _, full = _ours(model, ids)
    return cfg, weights, ids, state, logits, full


# ---- parity -----------------------------------------------------------------------------------

def test_ouro_matches_reference(ouro):
    cfg, weights, ids, logits, gates, full = ouro
    want, want_gates = ouro_forward(weights, cfg, ids)
    assert logits.shape == want.shape == (cfg["total_ut_steps"], B, T, cfg["vocab_size"])
    for r in range(len(want)):  # every loop's readout
        assert _err(logits[r], want[r]) < TOL, f"loop {r + 1}"
    assert _err(gates, want_gates) < TOL
    assert _err(full, want[-1]) < TOL


def test_raven_matches_reference(raven):
    cfg, weights, ids, state, logits, full = raven
    init = raven_init_values(cfg)
    assert np.abs(state).max() <= 3 * init["std"] * init["embed_scale"] * (1 + 1e-6)
    want = raven_forward(weights, cfg, ids, state)
    assert logits.shape == want.shape == (cfg["mean_recurrence"], B, T, cfg["vocab_size"])
    for r in range(len(want)):  # every step's readout (predict_from_latents)
        assert _err(logits[r], want[r]) < TOL, f"step {r + 1}"
    assert _err(full, want[-1]) < TOL


@pytest.mark.parametrize("plant", OURO_PLANTS)
def test_planted_ouro_mistake_is_caught(ouro, plant):
    cfg, weights, ids, logits, gates, _ = ouro
    if cfg["total_ut_steps"] == 1 and plant == "norm_once":
        pytest.skip("with one loop the final norm is applied once either way")
    want, want_gates = ouro_forward(weights, cfg, ids, plant=plant)
    assert max(_err(logits, want), _err(gates, want_gates)) > 100 * TOL


@pytest.mark.parametrize("plant", RAVEN_PLANTS)
def test_planted_raven_mistake_is_caught(raven, plant):
    cfg, weights, ids, state, logits, _ = raven
    want = raven_forward(weights, cfg, ids, state, plant=plant)
    if plant == "no_embed_scale" and raven_init_values(cfg)["embed_scale"] == 1.0:
        assert _err(logits, want) < TOL  # a scale of 1 is no scale
    else:
        assert _err(logits, want) > 100 * TOL
