"""Model hyperparameters as plain frozen dataclasses: `LlamaConfig` (the decoder families:
Llama 2/3, CodeLlama, SmolLM2, Mistral, Qwen 2.5/3, Gemma 2/3, Phi-3) and `LoopedConfig` (Ouro,
Raven / Huginn-0125).

No jax or flax here, so preset files (`configs/`) import only these definitions.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, ClassVar, Mapping


class ConfigError(ValueError):
    """A model or decoding configuration that cannot work; the message says why."""


def check_heads(num_heads: int, num_kv_heads: int, head_dim: int) -> None:
    """Grouped-query attention needs whole groups; RoPE needs an even head size."""
    if num_heads % num_kv_heads:
        raise ConfigError(f"model config: num_heads ({num_heads}) must be a multiple of "
                          f"num_kv_heads ({num_kv_heads})")
    if head_dim % 2:
        raise ConfigError(f"model config: head_dim must be even for RoPE, got {head_dim}")


def hf_eos_ids(hf: Mapping[str, Any], default: int | None = None) -> tuple[int, ...]:
    """A Hugging Face config.json's `eos_token_id` (an id, a list of ids, or absent: `default`)
    -> a tuple of ids."""
    eos = hf.get("eos_token_id", default)
    if eos is None:
        return ()
    return tuple(int(e) for e in (eos if isinstance(eos, (list, tuple)) else (eos,)))


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """Llama-3 style frequency-dependent RoPE scaling, or plain linear position scaling."""

    rope_type: str = "llama3"  # "llama3" | "linear"
    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


# Decoder families (`LlamaConfig.family`): one model class, `models.llama.Llama`, with the
# switches below; `models.families` reads each family's Hugging Face config and tensor names.
DECODER_FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3", "phi3")
LAYER_TYPES = ("full", "sliding")
ACTIVATIONS = ("silu", "gelu_tanh")  # SwiGLU (Llama, Qwen, Mistral, Phi-3) | GeGLU (Gemma)


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
    """Static shape of a Llama-family decoder (Llama 2/3, CodeLlama, SmolLM2, Mistral, Qwen 2.5
    and 3, Gemma 2 and 3, Phi-3). Hashable, so it can be a jit static argument.

    The family switches (all off for Llama):
      qkv_bias, o_bias   biases on the q/k/v projections (Qwen 2.5) and on the output one
      qk_norm            RMSNorm of each query and key head before RoPE (Qwen 3, Gemma 3)
      norm_offset        every RMSNorm scales by (norm_offset + weight) (Gemma: 1)
      sandwich_norms     norms after attention and after the MLP too (Gemma 2 and 3)
      hidden_act         "silu" (SwiGLU) or "gelu_tanh" (GeGLU, Gemma)
      embed_scale        embeddings multiplied by it (Gemma: sqrt(hidden_size))
      query_scale        attention score scale (0: head_dim ** -0.5; Gemma:
                         query_pre_attn_scalar ** -0.5)
      attn_softcap, final_softcap  tanh soft-capping of attention scores and of the logits
                         (0: none; Gemma 2: 50 and 30)
      sliding_window, layer_types  a "sliding" layer's query at position p sees keys at
                         positions > p - sliding_window; layer_types names each layer "full" or
                         "sliding" (empty: every layer sliding when sliding_window > 0, else
                         full; `layer_kinds` is the list either way)
      local_rope_theta   RoPE base of the sliding layers, which then ignore rope_scaling
                         (Gemma 3: 10000); 0: every layer has the same RoPE
    """

    # Fields that fix a checkpoint's tensors or their meaning: a checkpoint loaded under a preset
    # must agree with it on all of them (`lookahead_jax.store.checkpoint.check_model_matches`).
    SHAPE_FIELDS: ClassVar[tuple[str, ...]] = (
        "family", "vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
        "num_kv_heads", "head_dim", "rope_theta", "tie_word_embeddings", "qkv_bias", "o_bias",
        "qk_norm", "sandwich_norms", "hidden_act", "sliding_window", "layer_kinds")

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int = 0  # 0: hidden_size // num_heads
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    rms_norm_eps: float = 1e-5
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 4096
    bos_token_id: int | None = 1
    eos_token_ids: tuple[int, ...] = (2,)
    family: str = "llama"
    qkv_bias: bool = False
    o_bias: bool = False
    qk_norm: bool = False
    norm_offset: float = 0.0
    sandwich_norms: bool = False
    hidden_act: str = "silu"
    embed_scale: float = 1.0
    query_scale: float = 0.0
    attn_softcap: float = 0.0
    final_softcap: float = 0.0
    sliding_window: int = 0
    layer_types: tuple[str, ...] = ()
    local_rope_theta: float = 0.0

    def __post_init__(self):
        if self.head_dim == 0:
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_heads)
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                     "num_kv_heads", "head_dim"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"model config: {name} must be positive, got {getattr(self, name)}")
        check_heads(self.num_heads, self.num_kv_heads, self.head_dim)
        if self.rope_scaling is not None and self.rope_scaling.rope_type not in ("llama3", "linear"):
            raise ConfigError(f"model config: unsupported rope_scaling type {self.rope_scaling.rope_type!r}")
        if self.family not in DECODER_FAMILIES:
            raise ConfigError(f"model config: family must be one of {DECODER_FAMILIES}, got "
                              f"{self.family!r}")
        if self.hidden_act not in ACTIVATIONS:
            raise ConfigError(f"model config: hidden_act must be one of {ACTIVATIONS}, got "
                              f"{self.hidden_act!r}")
        for name in ("sliding_window", "query_scale", "attn_softcap", "final_softcap",
                     "local_rope_theta", "norm_offset"):
            if getattr(self, name) < 0:
                raise ConfigError(f"model config: {name} must be >= 0, got {getattr(self, name)}")
        if self.embed_scale <= 0:
            raise ConfigError(f"model config: embed_scale must be positive, got {self.embed_scale}")
        types = tuple(self.layer_types)
        object.__setattr__(self, "layer_types", types)
        if types and (len(types) != self.num_layers or any(t not in LAYER_TYPES for t in types)):
            raise ConfigError(f"model config: layer_types must name each of the {self.num_layers} "
                              f"layers one of {LAYER_TYPES}, got {self.layer_types!r}")
        if "sliding" in self.layer_kinds and not self.sliding_window:
            raise ConfigError("model config: sliding layers need sliding_window > 0")
        object.__setattr__(self, "eos_token_ids", tuple(int(e) for e in self.eos_token_ids))

    @property
    def layer_kinds(self) -> tuple[str, ...]:
        """Each layer's type, "full" or "sliding": `layer_types`, or when that is empty every
        layer sliding if sliding_window > 0, else full."""
        if self.layer_types:
            return self.layer_types
        return ("sliding" if self.sliding_window else "full",) * self.num_layers

    @property
    def sliding_layers(self) -> tuple[int, ...]:
        """Indices of the sliding-window layers."""
        return tuple(i for i, t in enumerate(self.layer_kinds) if t == "sliding")


FAMILIES = ("ouro", "raven", "recursive")  # looped-model families
# Hugging Face `model_type` of a looped checkpoint -> its family ("recursive_llama": our own
# format, `models.recursive`)
HF_MODEL_TYPES = {"ouro": "ouro", "huginn_raven": "raven", "recursive_llama": "recursive"}


@dataclasses.dataclass(frozen=True)
class LoopedConfig:
    """Static shape of a looped model. Hashable, so it can be a jit static argument.

    family: "ouro" | "raven" | "recursive". num_loops: R, the full depth.
    ouro: num_layers = the shared stack run once per loop (prelude/core/coda must be 0).
    raven, recursive: prelude_layers, core_layers (the recurrent block), coda_layers
    (num_layers 0).
    embed_scale / state_std: 0 means the family's default (raven: sqrt(hidden) and
    sqrt(2 / (5 hidden)); ouro: 1 and unused). noise_seed: the default seed of Raven's initial
    state (see `models.raven`).
    """

    SHAPE_FIELDS: ClassVar[tuple[str, ...]] = (
        "family", "vocab_size", "hidden_size", "intermediate_size", "num_heads", "num_kv_heads",
        "head_dim", "num_loops", "num_layers", "prelude_layers", "core_layers", "coda_layers",
        "rope_theta", "tie_word_embeddings", "qk_bias")

    family: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    num_loops: int
    num_layers: int = 0
    prelude_layers: int = 0
    core_layers: int = 0
    coda_layers: int = 0
    head_dim: int = 0  # 0: hidden_size // num_heads
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    qk_bias: bool = False  # raven: learned per-head biases added to q and k before RoPE
    embed_scale: float = 0.0
    state_std: float = 0.0
    noise_seed: int = 0
    max_position_embeddings: int = 4096
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    rope_scaling: None = None  # plain RoPE only (read by models.layers.rope_inv_freq)

    def __post_init__(self):
        if self.family not in FAMILIES:
            raise ConfigError(
                f"model config: family must be one of {FAMILIES}, got {self.family!r}")
        if self.head_dim == 0 and self.num_heads > 0:
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_heads)
        raven = self.family == "raven"
        staged = self.family in ("raven", "recursive")  # prelude, core block, coda
        if self.embed_scale == 0:
            scale = math.sqrt(self.hidden_size) if raven and self.hidden_size > 0 else 1.0
            object.__setattr__(self, "embed_scale", scale)
        if self.state_std == 0 and raven and self.hidden_size > 0:
            object.__setattr__(self, "state_std", math.sqrt(2 / (5 * self.hidden_size)))
        object.__setattr__(self, "eos_token_ids", tuple(int(e) for e in self.eos_token_ids))
        needed = ["vocab_size", "hidden_size", "intermediate_size", "num_heads", "num_kv_heads",
                  "head_dim", "num_loops", "num_layers" if not staged else "core_layers"]
        for name in needed:
            if getattr(self, name) <= 0:
                raise ConfigError(
                    f"model config: {name} must be positive, got {getattr(self, name)}")
        if staged:
            for name in ("prelude_layers", "coda_layers"):
                if getattr(self, name) < 0:
                    raise ConfigError(
                        f"model config: {name} must be >= 0, got {getattr(self, name)}")
            if self.num_layers:
                raise ConfigError(f"model config: {self.family} uses prelude_layers/core_layers/"
                                  f"coda_layers, not num_layers (got num_layers={self.num_layers})")
            if self.qk_bias and not raven:
                raise ConfigError(f"model config: {self.family} has no qk_bias")
            if self.qk_bias and self.num_kv_heads != self.num_heads:
                raise ConfigError(f"model config: raven qk_bias needs num_kv_heads == num_heads, "
                                  f"got {self.num_kv_heads} and {self.num_heads}")
        else:
            for name in ("prelude_layers", "core_layers", "coda_layers"):
                if getattr(self, name):
                    raise ConfigError(f"model config: ouro has no {name} (got "
                                      f"{getattr(self, name)}); num_layers is its shared stack")
            if self.qk_bias:
                raise ConfigError("model config: ouro has no qk_bias")
        check_heads(self.num_heads, self.num_kv_heads, self.head_dim)
        if self.rope_scaling is not None:
            raise ConfigError("model config: looped models support plain RoPE only")

    # -- derived shape --------------------------------------------------------------------------
    @property
    def loop_layers(self) -> int:
        """Layers of the recurrent block (ouro: num_layers; raven, recursive: core_layers)."""
        return self.num_layers if self.family == "ouro" else self.core_layers

    @property
    def loop_slot0(self) -> int:
        """Cache slot of loop 0, layer 0 (after Raven's prelude slots)."""
        return self.prelude_layers

    @property
    def coda_slot0(self) -> int:
        """Cache slot of the coda (Raven, recursive) at readout depth 1, layer 0."""
        return self.prelude_layers + self.num_loops * self.loop_layers

    @property
    def cache_slots(self) -> int:
        """Layer axis of the KV cache: every (depth, layer) pair that has K/V."""
        return self.coda_slot0 + self.num_loops * self.coda_layers

    # -- Hugging Face ---------------------------------------------------------------------------
    @classmethod
    def from_hf(cls, hf: Mapping[str, Any]) -> "LoopedConfig":
        """Builds a config from a Hugging Face `config.json` dict: our recursive Llama
        (`model_type` "recursive_llama", `_from_hf_recursive`), Ouro (`model_type` "ouro",
        OuroConfig fields, `total_ut_steps` loops) or Huginn/Raven (`model_type` "huginn_raven",
        RavenConfig fields: n_embd, n_heads, n_layers_in_prelude / _recurrent_block / _coda,
        mean_recurrence loops, rope_base, norm_eps, tie_embeddings, qk_bias, and
        init_values' embed_scale and std where given)."""
        arch = hf.get("model_type")
        if arch not in HF_MODEL_TYPES:
            raise ConfigError(f"config.json: model_type {arch!r} is not a looped model "
                              f"(expected one of {sorted(HF_MODEL_TYPES)})")
        try:
            common = dict(vocab_size=int(hf["vocab_size"]),
                          intermediate_size=int(hf["intermediate_size"]),
                          bos_token_id=hf.get("bos_token_id"),
                          eos_token_ids=hf_eos_ids(hf))
            if arch == "ouro":
                return cls._from_hf_ouro(hf, common)
            if arch == "recursive_llama":
                return cls._from_hf_recursive(hf, common)
            return cls._from_hf_raven(hf, common)
        except KeyError as e:
            raise ConfigError(f"config.json: missing field {e.args[0]!r}") from None

    @classmethod
    def _from_hf_ouro(cls, hf: Mapping[str, Any], common: dict) -> "LoopedConfig":
        theta = hf.get("rope_theta", 10000.0)
        params = hf.get("rope_parameters") or {}  # transformers >= 5
        if params:
            theta = params.get("rope_theta", theta)
            if params.get("rope_type", "default") != "default":
                raise ConfigError(
                    f"config.json: unsupported rope scaling {params.get('rope_type')!r}")
        if hf.get("rope_scaling"):
            raise ConfigError(f"config.json: unsupported rope_scaling {hf['rope_scaling']!r}")
        if hf.get("hidden_act", "silu") != "silu":
            raise ConfigError(f"config.json: unsupported hidden_act {hf['hidden_act']!r}")
        max_pos = int(hf.get("max_position_embeddings", 4096))
        # Sliding-window layers equal full attention while the sequence fits in the window;
        # we implement full attention, so cap positions there (as for Mistral).
        if hf.get("use_sliding_window") or "sliding_attention" in (hf.get("layer_types") or ()):
            max_pos = min(max_pos, int(hf.get("sliding_window") or max_pos))
        heads = int(hf["num_attention_heads"])
        return cls(
            family="ouro", hidden_size=int(hf["hidden_size"]), num_heads=heads,
            num_kv_heads=int(hf.get("num_key_value_heads") or heads),
            head_dim=int(hf.get("head_dim") or 0), num_layers=int(hf["num_hidden_layers"]),
            num_loops=int(hf.get("total_ut_steps", 4)), rope_theta=float(theta),
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            max_position_embeddings=max_pos, **common)

    @classmethod
    def _from_hf_recursive(cls, hf: Mapping[str, Any], common: dict) -> "LoopedConfig":
        """Our recursive Llama (`models.recursive`): LlamaConfig's field names plus
        prelude_layers, core_layers, coda_layers and num_loops."""
        if hf.get("rope_scaling"):
            raise ConfigError(f"config.json: unsupported rope_scaling {hf['rope_scaling']!r}")
        if hf.get("hidden_act", "silu") != "silu":
            raise ConfigError(f"config.json: unsupported hidden_act {hf['hidden_act']!r}")
        heads = int(hf["num_attention_heads"])
        return cls(
            family="recursive", hidden_size=int(hf["hidden_size"]), num_heads=heads,
            num_kv_heads=int(hf.get("num_key_value_heads") or heads),
            head_dim=int(hf.get("head_dim") or 0), prelude_layers=int(hf["prelude_layers"]),
            core_layers=int(hf["core_layers"]), coda_layers=int(hf["coda_layers"]),
            num_loops=int(hf["num_loops"]), rope_theta=float(hf.get("rope_theta", 10000.0)),
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-5)),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            max_position_embeddings=int(hf.get("max_position_embeddings", 4096)), **common)

    @classmethod
    def _from_hf_raven(cls, hf: Mapping[str, Any], common: dict) -> "LoopedConfig":
        def get(*names, default=None):
            for n in names:
                if n in hf:
                    return hf[n]
            if default is None:
                raise KeyError(names[0])
            return default

        if get("bias", default=False):
            raise ConfigError("config.json: raven with bias=true (adapter bias) is not supported")
        if get("injection_type", default="linear") != "linear":
            raise ConfigError(f"config.json: unsupported injection_type {hf['injection_type']!r}")
        for field, want in (("block_class_name", "SandwichBlock"), ("mlp_class_name", "GatedMLP"),
                            ("nonlin_name", "SiLU")):
            if get(field, default=want) != want:
                raise ConfigError(
                    f"config.json: unsupported {field} {hf[field]!r} (expected {want!r})")
        hidden = int(get("n_embd", "hidden_size"))
        heads = int(get("n_heads", "num_attention_heads"))
        # RavenConfig derives init_values from n_embd unless config.json gives them (checkpoints
        # converted from other models do: embed_scale 1); the model scales its embedding by
        # init_values["embed_scale"] and draws its initial state with init_values["std"].
        init = hf.get("init_values") or {}
        scales = {}
        for field, ours in (("embed_scale", "embed_scale"), ("std", "state_std")):
            if field in init:
                scales[ours] = float(init[field])
                if scales[ours] <= 0:
                    raise ConfigError(f"config.json: init_values {field} must be positive, "
                                      f"got {init[field]!r}")
        return cls(
            family="raven", hidden_size=hidden, num_heads=heads,
            num_kv_heads=int(get("num_key_value_heads", default=heads)),
            prelude_layers=int(get("n_layers_in_prelude", default=2)),
            core_layers=int(get("n_layers_in_recurrent_block", default=4)),
            coda_layers=int(get("n_layers_in_coda", default=2)),
            num_loops=int(get("mean_recurrence", default=32)),
            rope_theta=float(get("rope_base", default=50000.0)),
            rms_norm_eps=float(get("norm_eps", default=1e-6)),
            tie_word_embeddings=bool(get("tie_embeddings", "tie_word_embeddings", default=True)),
            qk_bias=bool(get("qk_bias", default=True)),
            max_position_embeddings=int(get("block_size", "max_position_embeddings", default=4096)),
            **scales, **common)
