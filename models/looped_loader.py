"""Loads (and writes) Hugging Face checkpoints of looped models: Ouro-1.4B / 2.6B
(`OuroForCausalLM`) and Huginn-0125 (`RavenForCausalLM`), into `LoopedLM`.

Tensor names are those of the published modeling code (Ouro: `modeling_ouro.py` of the
ByteDance/Ouro-* hub repositories; Raven: `raven_modeling_minimal.py` of
seal-rg/recurrent-pretraining). One table per family (`hf_table`) maps each name to our
parameter path and says whether it is transposed; the reading itself (lazy, one tensor at a
time, every shape checked) is `models.hf_loader.load_safetensors_into`.

`save_hf_looped` writes the same layout (config.json + model.safetensors) from a `LoopedLM`:
for tests, and for tiny models trained here. Our recursive Llama (`models.recursive`) has its
own names (Llama's, grouped as Raven's) and may ship only its block, the rest of its layers
read from the base Llama it was made from (`base_model` in its config.json).
"""

from __future__ import annotations

import hashlib
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
                              load_hf_llama, load_safetensors_into, read_hf_config_json)
from models.build import build_looped
from models.gguf_loader import load_gguf_llama
from models.config import HF_MODEL_TYPES, LoopedConfig
from models.families import Target, TensorTable
from models.looped import LoopedLM
from models.recursive import from_llama

# Recomputed buffers a checkpoint may hold: Ouro's rotary inv_freq, Raven's persistent
# `freqs_cis` (RoPE cos/sin table).
_IGNORED = re.compile(r"(^|\.)rotary_emb\.inv_freq$|^(transformer\.)?freqs_cis$")

# config.json's entry naming the base Llama of a checkpoint that ships only its block
BASE_MODEL = "base_model"

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


def _recursive_table(cfg: LoopedConfig) -> Pairs:
    t: Pairs = {
        "model.embed_tokens.weight": (("embed_tokens", "embedding"), False),
        "model.norm.weight": (("norm", "weight"), False),
    }
    for group, n in (("prelude", cfg.prelude_layers), ("core_block", cfg.core_layers),
                     ("coda", cfg.coda_layers)):
        for i in range(n):
            p = f"model.{group}.{i}."
            for norm in ("input_layernorm", "post_attention_layernorm"):
                t[p + f"{norm}.weight"] = ((group, i, norm, "weight"), False)
            for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
                t[p + f"self_attn.{proj}.weight"] = ((group, i, "self_attn", proj, "kernel"), True)
            for proj in ("gate_proj", "up_proj", "down_proj"):
                t[p + f"mlp.{proj}.weight"] = ((group, i, "mlp", proj, "kernel"), True)
    return t


_TABLES = {"ouro": _ouro_table, "raven": _raven_table, "recursive": _recursive_table}


def hf_table(cfg: LoopedConfig) -> TensorTable:
    """HF tensor name -> the one parameter it fills (`Target`: path in our nnx state,
    transpose?). lm_head only when untied."""
    t = _TABLES[cfg.family](cfg)
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


def base_model_of(path: str | os.PathLike) -> dict | None:
    """The `base_model` entry of `<path>/config.json`: where a checkpoint that ships only its
    recurrent block takes its other layers from (`load_hf_looped`), or None."""
    return read_hf_config_json(path).get(BASE_MODEL)


def file_sha256(path: str | os.PathLike) -> str:
    """sha256 of a file, read in 4 MB chunks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


def _load_base(base: str | os.PathLike, entry: dict, dtype):
    """The base Llama of a block-only checkpoint, its file's sha256 checked."""
    base = os.fspath(base)
    if os.path.isfile(base):
        want = entry.get("sha256")
        if want and file_sha256(base) != want:
            raise CheckpointError(f"{base}: sha256 differs from the base model this checkpoint "
                                  f"was trained on ({entry.get('name', '?')}, sha256 {want})")
        return load_gguf_llama(base, dtype=dtype)
    if os.path.isdir(base):
        return load_hf_llama(base, dtype=dtype)
    raise CheckpointError(f"base model {base} does not exist")


def _load_block_only(path: str, cfg: LoopedConfig, dtype, base, entry: dict) -> LoopedLM:
    """A recursive model whose block comes from `path` and everything else from the base
    Llama: its first prelude_layers layers, its last coda_layers, embedding, norm (and head)."""
    if cfg.family != "recursive":
        raise CheckpointError(f"{path}: only recursive models are shipped block-only "
                              f"(this config is {cfg.family})")
    if base is None:
        raise CheckpointError(f"{path} holds only the recurrent block; it is built on the base "
                              f"model {entry.get('name', '?')}: pass its weights as base=")
    llama = _load_base(base, entry, dtype)
    table = {k: v for k, v in hf_table(cfg).items() if k.startswith("model.core_block.")}
    block = load_safetensors_into(
        path, lambda: build_looped(cfg, dtype=dtype, rngs=nnx.Rngs(0)), table, dtype,
        skip=lambda name: False, kind="recursive model's block")
    model = from_llama(llama, cfg)
    nnx.update(model.core_block, nnx.state(block.core_block))
    return model


def load_hf_looped(path: str | os.PathLike, dtype=jnp.float32,
                   config: LoopedConfig | None = None, mesh=None,
                   base: str | os.PathLike | None = None) -> LoopedLM:
    """Loads an Ouro or Huginn/Raven safetensors checkpoint (single file or sharded) into a
    `LoopedLM` with parameters of `dtype`. config: overrides `config.json` (its shapes are
    still checked against every tensor). mesh: load sharded for tensor parallelism (see
    `models.hf_loader.load_safetensors_into`).

    Raises CheckpointError naming the file or tensor for a missing directory / file / shard,
    a tensor whose shape differs from the config's, a tensor the model needs that is absent
    (`lm_head.weight` is optional only with tied embeddings), or an unknown tensor. Recomputed
    RoPE buffers (`rotary_emb.inv_freq`, `freqs_cis`) are skipped.

    A recursive model whose config.json has a `base_model` entry ships only its block
    (`save_hf_looped(..., base_model=)`): `base` is then the base Llama's weights (a GGUF file,
    whose sha256 must match the entry's, or a Hugging Face directory), from which the prelude,
    coda, embedding and norm are taken (loaded whole: mesh does not apply).
    """
    path = os.fspath(path)
    cfg = config if config is not None else load_looped_config(path)
    entry = base_model_of(path)
    if entry is not None:
        return _load_block_only(path, cfg, dtype, base, entry)
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
    if cfg.family == "recursive":
        return {
            "architectures": ["RecursiveLlamaForCausalLM"], "model_type": "recursive_llama",
            "vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size,
            "intermediate_size": cfg.intermediate_size, "num_attention_heads": cfg.num_heads,
            "num_key_value_heads": cfg.num_kv_heads, "head_dim": cfg.head_dim,
            "hidden_act": "silu", "max_position_embeddings": cfg.max_position_embeddings,
            "rms_norm_eps": cfg.rms_norm_eps, "rope_theta": cfg.rope_theta, "rope_scaling": None,
            "tie_word_embeddings": cfg.tie_word_embeddings,
            "prelude_layers": cfg.prelude_layers, "core_layers": cfg.core_layers,
            "coda_layers": cfg.coda_layers, "num_loops": cfg.num_loops,
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


def save_hf_looped(model: LoopedLM, path: str | os.PathLike, *, base_model: dict | None = None,
                   dtype=np.float32, extra: dict | None = None) -> None:
    """Writes `config.json` and `model.safetensors` (`dtype`, float32 by default) that
    `load_hf_looped`, and the published modeling code, read.

    base_model (recursive models only): write only the block's tensors and record this entry
    ({"name", "sha256", ...}: the base Llama the other layers are taken from when loading).
    extra: more config.json fields (e.g. how the weights were made)."""

    path = os.fspath(path)
    os.makedirs(path, exist_ok=True)
    hf = hf_config_dict(model.config)
    tensors = hf_state_dict(model)
    if base_model is not None:
        if model.config.family != "recursive":
            raise ValueError("base_model: only a recursive model ships its block alone")
        hf[BASE_MODEL] = base_model
        tensors = {k: v for k, v in tensors.items() if k.startswith("model.core_block.")}
    hf.update(extra or {})
    with open(os.path.join(path, CONFIG_FILE), "w", encoding="utf-8") as f:
        json.dump(hf, f, indent=2)
    save_file({k: v.astype(dtype) for k, v in tensors.items()},
              os.path.join(path, SAFETENSORS_FILE), metadata={"format": "pt"})
