"""The decoder families a Hugging Face checkpoint may hold: how each one's `config.json` maps to a
`LlamaConfig`, and its tensor-name table.

One model class (`models.llama.Llama`) runs them all; a family is a set of switches on
`LlamaConfig` (see its docstring) plus the names its checkpoints give the tensors:

  family   model_type             what differs from Llama
  llama    llama                  (Llama 2/3.x, CodeLlama, SmolLM2; llama3 RoPE scaling; tied
                                  embeddings for the small Llama 3.2)
  mistral  mistral                sliding-window attention on every layer (when set)
  qwen2    qwen2                  biases on q/k/v; sliding layers above max_window_layers (off
                                  unless use_sliding_window)
  qwen3    qwen3                  RMSNorm of each q and k head before RoPE
  gemma2   gemma2                 norms scale by (1 + weight), norms after attention and MLP
                                  too, GeGLU, embeddings times sqrt(hidden), scores scaled by
                                  query_pre_attn_scalar ** -0.5, attention and logit soft-capping,
                                  sliding and global layers alternating
  gemma3   gemma3_text, gemma3    Gemma 2's layout without soft-capping, with q/k norms, five
                                  sliding layers per global one, a local RoPE base on sliding
                                  layers (global: rope_theta and its scaling); "gemma3" is the
                                  multimodal checkpoint, of which the text model is loaded
  phi3     phi3                   fused qkv_proj and gate_up_proj (split when loaded)

Plain data only (no jax): presets and `models.config` import it freely.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, Mapping

from models.config import ConfigError, LlamaConfig, RopeScaling, hf_eos_ids

# Hugging Face model_type -> family
MODEL_TYPES = {"llama": "llama", "mistral": "mistral", "qwen2": "qwen2", "qwen3": "qwen3",
               "gemma2": "gemma2", "gemma3_text": "gemma3", "gemma3": "gemma3", "phi3": "phi3"}
# Hugging Face activation names -> ours
_ACTIVATIONS = {"silu": "silu", "swish": "silu", "gelu_pytorch_tanh": "gelu_tanh"}
# Hugging Face layer_types entries -> ours
_LAYER_TYPES = {"full_attention": "full", "sliding_attention": "sliding"}


@dataclasses.dataclass(frozen=True)
class Target:
    """Where one Hugging Face tensor (or a part of a fused one) goes in the model's state.

    path: the parameter's path in the nnx state, e.g. ("layers", 0, "self_attn", "q_proj",
    "kernel"). transpose: an `nn.Linear.weight` [out, in] becomes an `nnx.Linear.kernel`
    [in, out]. rows: for a fused tensor (Phi-3's qkv_proj, gate_up_proj), the [start, stop)
    rows of the Hugging Face tensor that this parameter is.
    """

    path: tuple[Any, ...]
    transpose: bool = False
    rows: tuple[int, int] | None = None


# Hugging Face tensor name -> the parameter(s) it fills
TensorTable = dict[str, tuple[Target, ...]]


# -- config.json ----------------------------------------------------------------------------------
def _rope(params: Mapping[str, Any], theta: float) -> tuple[float, RopeScaling | None]:
    """(rope_theta, scaling) of a rope_parameters / rope_scaling dict (None or {}: default)."""
    params = dict(params or {})
    theta = float(params.get("rope_theta", theta))
    rtype = params.get("rope_type", params.get("type", "default"))
    if rtype in (None, "default"):
        return theta, None
    if rtype == "llama3":
        return theta, RopeScaling("llama3", float(params["factor"]), float(params["low_freq_factor"]),
                                  float(params["high_freq_factor"]),
                                  int(params["original_max_position_embeddings"]))
    if rtype == "linear":
        return theta, RopeScaling("linear", float(params["factor"]))
    raise ConfigError(f"config.json: unsupported rope scaling {rtype!r} (supported: default, "
                      f"llama3, linear)")


def _global_rope(hf: Mapping[str, Any], default_theta: float = 10000.0):
    """The RoPE of a config whose layers share one: transformers >= 5 writes `rope_parameters`
    (theta and scaling together), older ones `rope_theta` and `rope_scaling`."""
    theta = float(hf.get("rope_theta", default_theta))
    params = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    if "full_attention" in params:  # per layer type (Gemma 3's form)
        params = params["full_attention"] or {}
    return _rope(params, theta)


def _activation(hf: Mapping[str, Any], field: str) -> str:
    name = hf.get(field, "silu")
    if name not in _ACTIVATIONS:
        raise ConfigError(f"config.json: unsupported {field} {name!r} (supported: "
                          f"{', '.join(_ACTIVATIONS)})")
    return _ACTIVATIONS[name]


def _layer_types(hf: Mapping[str, Any], n: int, default: Callable[[int], str]) -> tuple[str, ...]:
    """Each layer's type, from `layer_types` (transformers >= 4.54) or the family's rule."""
    given = hf.get("layer_types")
    if not given:
        return tuple(default(i) for i in range(n))
    try:
        types = tuple(_LAYER_TYPES[t] for t in given)
    except KeyError as e:
        raise ConfigError(f"config.json: unsupported layer type {e.args[0]!r} in layer_types "
                          f"(supported: {', '.join(_LAYER_TYPES)})") from None
    if len(types) != n:
        raise ConfigError(f"config.json: layer_types names {len(types)} layers, "
                          f"num_hidden_layers is {n}")
    return types


def _refuse(hf: Mapping[str, Any], field: str, ok: Callable[[Any], bool], why: str) -> None:
    if field in hf and not ok(hf[field]):
        raise ConfigError(f"config.json: {field} = {hf[field]!r} is not supported ({why})")


def _common(hf: Mapping[str, Any]) -> dict[str, Any]:
    out = dict(vocab_size=int(hf["vocab_size"]), hidden_size=int(hf["hidden_size"]),
               intermediate_size=int(hf["intermediate_size"]),
               num_layers=int(hf["num_hidden_layers"]))
    heads = int(hf["num_attention_heads"])
    return dict(
        out, num_heads=heads, num_kv_heads=int(hf.get("num_key_value_heads") or heads),
        head_dim=int(hf.get("head_dim") or 0), rms_norm_eps=float(hf.get("rms_norm_eps", 1e-5)),
        max_position_embeddings=int(hf.get("max_position_embeddings", 4096)),
        bos_token_id=hf.get("bos_token_id"))


def _llama(hf, c):
    _refuse(hf, "mlp_bias", lambda v: not v, "biases on the MLP")
    bias = bool(hf.get("attention_bias", False))
    theta, scaling = _global_rope(hf)
    return dict(c, family="llama", hidden_act=_activation(hf, "hidden_act"), qkv_bias=bias,
                o_bias=bias, rope_theta=theta, rope_scaling=scaling,
                tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
                eos_token_ids=hf_eos_ids(hf, default=2))


def _mistral(hf, c):
    theta, scaling = _global_rope(hf)
    return dict(c, family="mistral", hidden_act=_activation(hf, "hidden_act"), rope_theta=theta,
                rope_scaling=scaling, sliding_window=int(hf.get("sliding_window") or 0),
                tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
                eos_token_ids=hf_eos_ids(hf, default=2))


def _qwen(hf, c, family: str):
    theta, scaling = _global_rope(hf)
    n = c["num_layers"]
    window = int(hf.get("sliding_window") or 0) if hf.get("use_sliding_window") else 0
    if window:
        first = int(hf.get("max_window_layers", n))
        types = _layer_types(hf, n, lambda i: "sliding" if i >= first else "full")
    else:  # transformers drops the window when use_sliding_window is false
        types = ("full",) * n
    bias = bool(hf.get("attention_bias", False))
    return dict(c, family=family, hidden_act=_activation(hf, "hidden_act"), rope_theta=theta,
                rope_scaling=scaling, sliding_window=window, layer_types=types,
                qkv_bias=True if family == "qwen2" else bias,
                o_bias=False if family == "qwen2" else bias, qk_norm=family == "qwen3",
                rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
                tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
                eos_token_ids=hf_eos_ids(hf))


def _gemma(hf, c, family: str):
    n = c["num_layers"]
    bias = bool(hf.get("attention_bias", False))
    hidden = c["hidden_size"]
    out = dict(c, family=family, hidden_act=_activation(hf, "hidden_activation"),
               qkv_bias=bias, o_bias=bias, norm_offset=1.0, sandwich_norms=True,
               embed_scale=math.sqrt(hidden),
               query_scale=float(hf.get("query_pre_attn_scalar", 256)) ** -0.5,
               attn_softcap=float(hf.get("attn_logit_softcapping") or 0.0),
               final_softcap=float(hf.get("final_logit_softcapping") or 0.0),
               sliding_window=int(hf.get("sliding_window") or 0),
               rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
               tie_word_embeddings=bool(hf.get("tie_word_embeddings", True)),
               eos_token_ids=hf_eos_ids(hf, default=1))
    _refuse(hf, "use_bidirectional_attention", lambda v: not v, "a causal decoder is loaded")
    if family == "gemma2":
        out["rope_theta"], out["rope_scaling"] = _global_rope(hf)
        out["layer_types"] = _layer_types(hf, n, lambda i: "sliding" if (i + 1) % 2 else "full")
        return out
    pattern = int(hf.get("sliding_window_pattern", 6))
    out["layer_types"] = _layer_types(hf, n, lambda i: "sliding" if (i + 1) % pattern else "full")
    out["qk_norm"] = True
    params = hf.get("rope_parameters") or {}
    if "full_attention" in params or "sliding_attention" in params:  # transformers >= 5
        out["rope_theta"], out["rope_scaling"] = _rope(params.get("full_attention"), 1e6)
        local, local_scaling = _rope(params.get("sliding_attention"), 1e4)
        if local_scaling is not None:
            raise ConfigError("config.json: RoPE scaling on gemma3's sliding layers is not "
                              "supported")
    else:
        out["rope_theta"], out["rope_scaling"] = _rope(hf.get("rope_scaling"),
                                                       float(hf.get("rope_theta", 1e6)))
        local = float(hf.get("rope_local_base_freq", 1e4))
    out["local_rope_theta"] = local
    return out


def _phi3(hf, c):
    theta, scaling = _global_rope(hf)
    params = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    partial = float(params.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0)))
    if partial != 1.0:
        raise ConfigError(f"config.json: partial_rotary_factor = {partial} is not supported "
                          f"(RoPE on the whole head only)")
    return dict(c, family="phi3", hidden_act=_activation(hf, "hidden_act"), rope_theta=theta,
                rope_scaling=scaling, sliding_window=int(hf.get("sliding_window") or 0),
                tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
                eos_token_ids=hf_eos_ids(hf, default=32000))


_PARSERS: dict[str, Callable[[Mapping[str, Any], dict], dict]] = {
    "llama": _llama, "mistral": _mistral, "phi3": _phi3,
    "qwen2": lambda hf, c: _qwen(hf, c, "qwen2"), "qwen3": lambda hf, c: _qwen(hf, c, "qwen3"),
    "gemma2": lambda hf, c: _gemma(hf, c, "gemma2"), "gemma3": lambda hf, c: _gemma(hf, c, "gemma3"),
}


def text_config(hf: Mapping[str, Any]) -> Mapping[str, Any]:
    """The language model's part of a config.json: a multimodal Gemma 3's `text_config` (with
    the top-level token ids where it lacks its own), else the config itself."""
    if hf.get("model_type") != "gemma3":
        return hf
    text = dict(hf.get("text_config") or {})
    if not text:
        raise ConfigError("config.json: a gemma3 checkpoint without text_config")
    for key in ("bos_token_id", "eos_token_id"):
        if key in hf and key not in text:
            text[key] = hf[key]
    text.setdefault("model_type", "gemma3_text")
    return text


def config_from_hf(hf: Mapping[str, Any]) -> LlamaConfig:
    """A Hugging Face `config.json` dict of any supported decoder family -> `LlamaConfig`.
    Raises ConfigError naming the field for an unknown model_type, a missing field or a
    feature the model does not implement."""
    arch = hf.get("model_type", "llama")
    if arch not in MODEL_TYPES:
        raise ConfigError(f"config.json: model_type {arch!r} is not a supported decoder family "
                          f"(supported: {', '.join(sorted(MODEL_TYPES))})")
    family = MODEL_TYPES[arch]
    hf = text_config(hf)
    try:
        return LlamaConfig(**_PARSERS[family](hf, _common(hf)))
    except KeyError as e:
        raise ConfigError(f"config.json: missing field {e.args[0]!r}") from None


# -- tensor names ---------------------------------------------------------------------------------
def tensor_table(cfg: LlamaConfig, prefix: str = "model.") -> TensorTable:
    """Hugging Face tensor name -> the parameter(s) it fills, for `cfg`'s family. prefix: the
    decoder's name prefix ("model."; a multimodal Gemma 3 stores it under
    "language_model.model." or "model.language_model.")."""

    def one(path, transpose=False):
        return (Target(path, transpose),)

    table: TensorTable = {
        prefix + "embed_tokens.weight": one(("embed_tokens", "embedding")),
        prefix + "norm.weight": one(("norm", "weight")),
    }
    if not cfg.tie_word_embeddings:
        table["lm_head.weight"] = one(("lm_head", "kernel"), True)
    norms = ["input_layernorm", "post_attention_layernorm"]
    if cfg.sandwich_norms:
        norms += ["pre_feedforward_layernorm", "post_feedforward_layernorm"]
    q, kv, f = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.intermediate_size
    for i in range(cfg.num_layers):
        p, ours = f"{prefix}layers.{i}.", ("layers", i)
        attn, mlp = ours + ("self_attn",), ours + ("mlp",)
        for norm in norms:
            table[p + norm + ".weight"] = one(ours + (norm, "weight"))
        if cfg.family == "phi3":  # fused [q | k | v] and [gate | up] rows
            table[p + "self_attn.qkv_proj.weight"] = (
                Target(attn + ("q_proj", "kernel"), True, (0, q)),
                Target(attn + ("k_proj", "kernel"), True, (q, q + kv)),
                Target(attn + ("v_proj", "kernel"), True, (q + kv, q + 2 * kv)))
            table[p + "mlp.gate_up_proj.weight"] = (
                Target(mlp + ("gate_proj", "kernel"), True, (0, f)),
                Target(mlp + ("up_proj", "kernel"), True, (f, 2 * f)))
        else:
            for proj in ("q_proj", "k_proj", "v_proj"):
                table[p + f"self_attn.{proj}.weight"] = one(attn + (proj, "kernel"), True)
            for proj in ("gate_proj", "up_proj"):
                table[p + f"mlp.{proj}.weight"] = one(mlp + (proj, "kernel"), True)
        table[p + "self_attn.o_proj.weight"] = one(attn + ("o_proj", "kernel"), True)
        table[p + "mlp.down_proj.weight"] = one(mlp + ("down_proj", "kernel"), True)
        if cfg.qkv_bias:
            for proj in ("q_proj", "k_proj", "v_proj"):
                table[p + f"self_attn.{proj}.bias"] = one(attn + (proj, "bias"))
        if cfg.o_bias:
            table[p + "self_attn.o_proj.bias"] = one(attn + ("o_proj", "bias"))
        if cfg.qk_norm:
            for norm in ("q_norm", "k_norm"):
                table[p + f"self_attn.{norm}.weight"] = one(attn + (norm, "weight"))
    return table


# Tensors a multimodal checkpoint holds besides its language model (skipped when loading it)
MULTIMODAL_PARTS = ("vision_tower.", "multi_modal_projector.")
# Where a multimodal Gemma 3 keeps the decoder: the Hub's files, and transformers >= 5's
DECODER_PREFIXES = ("model.", "language_model.model.", "model.language_model.")


def decoder_prefix(names) -> str:
    """The decoder's prefix among a checkpoint's tensor names (see DECODER_PREFIXES)."""
    for prefix in DECODER_PREFIXES[1:]:
        if any(n.startswith(prefix + "layers.") for n in names):
            return prefix
    return DECODER_PREFIXES[0]
