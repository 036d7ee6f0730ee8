"""Hyperparameters of a Llama-family decoder (Llama-2/3, CodeLlama, Mistral-style GQA, SmolLM2)."""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping


class ConfigError(ValueError):
    """A model or decoding configuration that cannot work; the message says why."""


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """Llama-3 style frequency-dependent RoPE scaling, or plain linear position scaling."""

    rope_type: str = "llama3"  # "llama3" | "linear"
    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
    """Static shape of a Llama-family model. Hashable, so it can be a jit static argument."""

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

    def __post_init__(self):
        if self.head_dim == 0:
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_heads)
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                     "num_kv_heads", "head_dim"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"model config: {name} must be positive, got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(
                f"model config: num_heads ({self.num_heads}) must be a multiple of num_kv_heads "
                f"({self.num_kv_heads})")
        if self.head_dim % 2:
            raise ConfigError(f"model config: head_dim must be even for RoPE, got {self.head_dim}")
        if self.rope_scaling is not None and self.rope_scaling.rope_type not in ("llama3", "linear"):
            raise ConfigError(f"model config: unsupported rope_scaling type {self.rope_scaling.rope_type!r}")

    @classmethod
    def from_hf(cls, hf: Mapping[str, Any]) -> "LlamaConfig":
        """Builds a config from a Hugging Face `config.json` dict (LlamaConfig / MistralConfig)."""
        arch = hf.get("model_type", "llama")
        if arch not in ("llama", "mistral"):
            raise ConfigError(f"config.json: model_type {arch!r} is not a Llama-family model")
        try:
            scaling = hf.get("rope_scaling") or None
            if hf.get("rope_parameters"):  # transformers >= 5 stores theta and scaling together
                params = dict(hf["rope_parameters"])
                hf = {**hf, "rope_theta": params.get("rope_theta", hf.get("rope_theta", 10000.0))}
                if params.get("rope_type", "default") != "default":
                    scaling = params
            rope = None
            if scaling:
                rtype = scaling.get("rope_type", scaling.get("type"))
                if rtype == "llama3":
                    rope = RopeScaling(
                        "llama3", float(scaling["factor"]), float(scaling["low_freq_factor"]),
                        float(scaling["high_freq_factor"]),
                        int(scaling["original_max_position_embeddings"]))
                elif rtype == "linear":
                    rope = RopeScaling("linear", float(scaling["factor"]))
                else:
                    raise ConfigError(f"config.json: unsupported rope scaling {rtype!r}")
            eos = hf.get("eos_token_id", 2)
            eos_ids = tuple(eos) if isinstance(eos, (list, tuple)) else ((eos,) if eos is not None else ())
            return cls(
                vocab_size=int(hf["vocab_size"]),
                hidden_size=int(hf["hidden_size"]),
                intermediate_size=int(hf["intermediate_size"]),
                num_layers=int(hf["num_hidden_layers"]),
                num_heads=int(hf["num_attention_heads"]),
                num_kv_heads=int(hf.get("num_key_value_heads") or hf["num_attention_heads"]),
                head_dim=int(hf.get("head_dim") or 0),
                rope_theta=float(hf.get("rope_theta", 10000.0)),
                rope_scaling=rope,
                rms_norm_eps=float(hf.get("rms_norm_eps", 1e-5)),
                tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
                # Mistral's sliding-window attention equals full attention while the sequence
                # fits in the window; we implement full attention, so cap positions there.
                max_position_embeddings=min(int(hf.get("max_position_embeddings", 4096)),
                                            int(hf.get("sliding_window") or 1 << 30)),
                bos_token_id=hf.get("bos_token_id"),
                eos_token_ids=tuple(int(e) for e in eos_ids),
            )
        except KeyError as e:
            raise ConfigError(f"config.json: missing field {e.args[0]!r}") from None
