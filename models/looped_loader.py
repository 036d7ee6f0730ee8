"""Loads (and writes) Hugging Face checkpoints of looped models: Ouro-1.4B / 2.6B
(`OuroForCausalLM`) and Huginn-0125 (`RavenForCausalLM`), into `LoopedLM`.

Tensor names are those of the published modeling code (Ouro: `modeling_ouro.py` of the
ByteDance/Ouro-* hub repositories; Raven: `raven_modeling_minimal.py` of
seal-rg/recurrent-pretraining). One table per family (`hf_table`) maps each name to our
parameter path and says whether it is transposed; the reading itself (lazy, one tensor at a
time, every shape checked) is `models.hf_loader.load_safetensors_into`.

`save_hf_looped` writes the same layout (config.json + model.safetensors) from a `LoopedLM`:
for tests, and for tiny models trained here.
"""

from __future__ import annotations

import json
import math
import os
import re
from typing import Any

import jax.numpy as jnp
import numpy as np
from flax import nnx
from safetensors.numpy import save_file

from models.hf_loader import (CONFIG_FILE, SAFETENSORS_FILE, CheckpointError, config_from_json,
                              load_safetensors_into, read_hf_config_json)
from models.build import build_looped
from models.config import HF_MODEL_TYPES, LoopedConfig
from models.families import Target, TensorTable
from models.looped import LoopedLM

# Recomputed buffers a checkpoint may hold: Ouro's rotary inv_freq, Raven's persistent
# `freqs_cis` (RoPE cos/sin table).
_IGNORED = re.compile(r"(^|\.)rotary_emb\.inv_freq$|^(transformer\.)?freqs_cis$")

# HF tensor name -> (path in our nnx state, transpose?): every looped tensor is one parameter
Pairs = dict[str, tuple[tuple[Any, ...], bool]]


def _ouro_table(cfg: LoopedConfig) -> Pairs:
    t: Pairs = {
        "model.embed_tokens.weight": (("embed_tokens", "embedding"), False),
        "model.norm.weight": (("norm", "weight"), False),
        "model.early_exit_gate.weight": (("early_exit_gate", "kernel"), True),
        "model.early_exit_gate.bias": (("early_exit_gate", "bias"), False),
    }
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        for norm in ("input_layernorm", "input_layernorm_2", "post_attention_layernorm",
                     "post_attention_layernorm_2"):
            t[p + f"{norm}.weight"] = (("layers", i, norm, "weight"), False)
        for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
            t[p + f"self_attn.{proj}.weight"] = (("layers", i, "self_attn", proj, "kernel"), True)
        for proj in ("gate_proj", "up_proj", "down_proj"):
            t[p + f"mlp.{proj}.weight"] = (("layers", i, "mlp", proj, "kernel"), True)
    return t


def _raven_table(cfg: LoopedConfig) -> Pairs:
    t: Pairs = {
        "transformer.wte.weight": (("wte", "embedding"), False),
        "transformer.adapter.weight": (("adapter", "kernel"), True),
        "transformer.ln_f.weight": (("ln_f", "weight"), False),
    }
    for group, n in (("prelude", cfg.prelude_layers), ("core_block", cfg.core_layers),
                     ("coda", cfg.coda_layers)):
        for i in range(n):
            p = f"transformer.{group}.{i}."
            for norm in ("norm_1", "norm_2", "norm_3", "norm_4"):
                t[p + f"{norm}.weight"] = ((group, i, norm, "weight"), False)
            t[p + "attn.Wqkv.weight"] = ((group, i, "attn", "Wqkv", "kernel"), True)
            t[p + "attn.proj.weight"] = ((group, i, "attn", "proj", "kernel"), True)
            if cfg.qk_bias:
                t[p + "attn.qk_bias"] = ((group, i, "attn", "qk_bias"), False)
            t[p + "mlp.fc.weight"] = ((group, i, "mlp", "fc", "kernel"), True)
            t[p + "mlp.proj.weight"] = ((group, i, "mlp", "proj", "kernel"), True)
    return t


def hf_table(cfg: LoopedConfig) -> TensorTable:
    """HF tensor name -> the one parameter it fills (`Target`: path in our nnx state,
    transpose?). lm_head only when untied."""
    t = _ouro_table(cfg) if cfg.family == "ouro" else _raven_table(cfg)
    if not cfg.tie_word_embeddings:
        t["lm_head.weight"] = (("lm_head", "kernel"), True)
    return {name: (Target(path, transpose),) for name, (path, transpose) in t.items()}


def is_looped_checkpoint(path: str | os.PathLike) -> bool:
    """Whether `<path>/config.json` exists and names a looped model_type (ouro, huginn_raven)."""
    try:
        return read_hf_config_json(path).get("model_type") in HF_MODEL_TYPES
    except CheckpointError:
        return False


def load_looped_config(path: str | os.PathLike) -> LoopedConfig:
    """Reads `<path>/config.json` (Ouro or Huginn/Raven) into a `LoopedConfig`.

    Raises CheckpointError if the directory or file is missing or unreadable, or the config
    is not a usable looped-model config (the message names the field).
    """
    return config_from_json(path, LoopedConfig.from_hf)


def load_hf_looped(path: str | os.PathLike, dtype=jnp.float32,
                   config: LoopedConfig | None = None, mesh=None) -> LoopedLM:
    """Loads an Ouro or Huginn/Raven safetensors checkpoint (single file or sharded) into a
    `LoopedLM` with parameters of `dtype`. config: overrides `config.json` (its shapes are
    still checked against every tensor). mesh: load sharded for tensor parallelism (see
    `models.hf_loader.load_safetensors_into`).

    Raises CheckpointError naming the file or tensor for a missing directory / file / shard,
    a tensor whose shape differs from the config's, a tensor the model needs that is absent
    (`lm_head.weight` is optional only with tied embeddings), or an unknown tensor. Recomputed
    RoPE buffers (`rotary_emb.inv_freq`, `freqs_cis`) are skipped.
    """
    path = os.fspath(path)
    cfg = config if config is not None else load_looped_config(path)
    tied = cfg.tie_word_embeddings
    return load_safetensors_into(
        path, lambda: build_looped(cfg, dtype=dtype, rngs=nnx.Rngs(0)), hf_table(cfg), dtype,
        skip=lambda name: bool(_IGNORED.search(name)) or (name == "lm_head.weight" and tied),
        kind=f"{cfg.family} model", mesh=mesh,
        missing_hint=lambda missing: (" (config has untied embeddings)"
                                      if "lm_head.weight" in missing else ""))


# ---- writing --------------------------------------------------------------------------------

def hf_config_dict(cfg: LoopedConfig) -> dict[str, Any]:
    """The Hugging Face `config.json` of a looped config (the published field names)."""
    eos = list(cfg.eos_token_ids)
    eos_field = eos[0] if len(eos) == 1 else (eos or None)
    if cfg.family == "ouro":
        return {
            "architectures": ["OuroForCausalLM"], "model_type": "ouro",
            "vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size,
            "intermediate_size": cfg.intermediate_size, "num_hidden_layers": cfg.num_layers,
            "num_attention_heads": cfg.num_heads, "num_key_value_heads": cfg.num_kv_heads,
            "head_dim": cfg.head_dim, "hidden_act": "silu",
            "max_position_embeddings": cfg.max_position_embeddings,
            "rms_norm_eps": cfg.rms_norm_eps, "rope_theta": cfg.rope_theta, "rope_scaling": None,
            "tie_word_embeddings": cfg.tie_word_embeddings, "use_sliding_window": False,
            "total_ut_steps": cfg.num_loops, "early_exit_threshold": 1.0,
            "bos_token_id": cfg.bos_token_id, "eos_token_id": eos_field,
        }
    if cfg.head_dim * cfg.num_heads != cfg.hidden_size:
        raise CheckpointError("raven config: head_dim * num_heads must equal hidden_size in a "
                              "Hugging Face config.json")
    depth = cfg.prelude_layers + cfg.coda_layers + cfg.core_layers * cfg.num_loops
    return {
        "architectures": ["RavenForCausalLM"], "model_type": "huginn_raven",
        "vocab_size": cfg.vocab_size, "n_embd": cfg.hidden_size, "n_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads,
        "n_layers": cfg.prelude_layers + cfg.core_layers + cfg.coda_layers,
        "n_layers_in_prelude": cfg.prelude_layers,
        "n_layers_in_recurrent_block": cfg.core_layers, "n_layers_in_coda": cfg.coda_layers,
        "mean_recurrence": cfg.num_loops, "intermediate_size": cfg.intermediate_size,
        "block_size": cfg.max_position_embeddings, "padding_multiple": 1,
        "tie_embeddings": cfg.tie_word_embeddings, "bias": False, "qk_bias": cfg.qk_bias,
        "rope_base": cfg.rope_theta, "norm_eps": cfg.rms_norm_eps,
        "block_class_name": "SandwichBlock", "norm_class_name": "RMSNorm_llama",
        "mlp_class_name": "GatedMLP", "nonlin_name": "SiLU", "injection_type": "linear",
        "state_init": "like-init",
        # as RavenConfig spells them out (it reads embed_scale and std; the other two are
        # weight-init scales, derived as it derives them)
        "init_values": {"std": cfg.state_std, "out_proj": cfg.state_std / math.sqrt(2 * depth),
                        "embedding": cfg.state_std, "embed_scale": cfg.embed_scale},
        "bos_token_id": cfg.bos_token_id, "eos_token_id": eos_field,
    }


def hf_state_dict(model: LoopedLM) -> dict[str, np.ndarray]:
    """The model's parameters under their Hugging Face names, as float32 numpy arrays
    (linear weights [out, in])."""
    flat = dict(nnx.to_flat_state(nnx.state(model, nnx.Param)))
    out = {}
    for name, (target,) in hf_table(model.config).items():
        arr = np.asarray(flat[target.path].get_value(), np.float32)
        out[name] = np.ascontiguousarray(arr.T if target.transpose else arr)
    return out


def save_hf_looped(model: LoopedLM, path: str | os.PathLike) -> None:
    """Writes `config.json` and `model.safetensors` (float32) that `load_hf_looped`, and the
    published modeling code, read."""

    path = os.fspath(path)
    os.makedirs(path, exist_ok=True)
    hf = hf_config_dict(model.config)
    with open(os.path.join(path, CONFIG_FILE), "w", encoding="utf-8") as f:
        json.dump(hf, f, indent=2)
    save_file(hf_state_dict(model), os.path.join(path, SAFETENSORS_FILE),
              metadata={"format": "pt"})
