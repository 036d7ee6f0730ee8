"""Loads a llama.cpp GGUF file (architecture `llama`) into `Llama`, dequantized.

The `gguf` package reads the file (memory-mapped) and dequantizes each tensor
(`gguf.quants.dequantize`: F32, F16, BF16, Q4_0/1, Q5_0/1, Q8_0, the K-quants, IQ*, ...) to
float32 on the host; it is then cast to the requested dtype and placed on the device one
tensor at a time. One table (`_gguf_table`) maps each GGUF tensor name to our parameter path
and says how to convert it.

Layout differences handled here:
- GGUF stores shapes fastest-dimension first; read through numpy, a linear weight is
  [out, in] (as PyTorch), so it is transposed into our `nnx.Linear.kernel` [in, out];
  `token_embd.weight` is [V, E] (our embedding as is).
- llama.cpp's converter permutes the rows of the Q and K projections of a Hugging Face
  checkpoint so that llama.cpp can apply RoPE to interleaved pairs (x0,x1),(x2,x3),...:
      gguf = hf.reshape(n_head, 2, head_dim // 2, in).swapaxes(1, 2).reshape(out, in)
  i.e. GGUF row h*D + 2*j + r holds HF row h*D + r*D/2 + j. Our model uses Hugging Face's
  rotate-half RoPE, so the loader applies the inverse,
      hf = gguf.reshape(n_head, head_dim // 2, 2, in).swapaxes(1, 2).reshape(out, in)
  with n_head = num_heads for Q and num_kv_heads for K (`unpermute_qk`).
- No `output.weight` tensor means tied input/output embeddings.
"""

from __future__ import annotations

import os
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from models.config import ConfigError, LlamaConfig, RopeScaling
from models.llama import Llama

GGUF_MAGIC = b"GGUF"
IM_END = "<|im_end|>"

# conversion kinds
_EMBED, _VECTOR, _LINEAR, _Q, _K = "embed", "vector", "linear", "q", "k"

_LAYER_TENSORS: dict[str, tuple[tuple[str, ...], str]] = {
    "attn_norm": (("input_layernorm", "weight"), _VECTOR),
    "attn_q": (("self_attn", "q_proj", "kernel"), _Q),
    "attn_k": (("self_attn", "k_proj", "kernel"), _K),
    "attn_v": (("self_attn", "v_proj", "kernel"), _LINEAR),
    "attn_output": (("self_attn", "o_proj", "kernel"), _LINEAR),
    "ffn_norm": (("post_attention_layernorm", "weight"), _VECTOR),
    "ffn_gate": (("mlp", "gate_proj", "kernel"), _LINEAR),
    "ffn_up": (("mlp", "up_proj", "kernel"), _LINEAR),
    "ffn_down": (("mlp", "down_proj", "kernel"), _LINEAR),
}


class GGUFError(ConfigError):
    """A GGUF file, its metadata or one of its tensors that cannot be loaded; the message says
    which."""


def _gguf_table(cfg: LlamaConfig) -> dict[str, tuple[tuple[Any, ...], str]]:
    """GGUF tensor name -> (path in our nnx state, conversion kind). `output.weight` only when
    the embeddings are untied."""
    table: dict[str, tuple[tuple[Any, ...], str]] = {
        "token_embd.weight": (("embed_tokens", "embedding"), _EMBED),
        "output_norm.weight": (("norm", "weight"), _VECTOR),
    }
    if not cfg.tie_word_embeddings:
        table["output.weight"] = (("lm_head", "kernel"), _LINEAR)
    for i in range(cfg.num_layers):
        for gname, (path, kind) in _LAYER_TENSORS.items():
            table[f"blk.{i}.{gname}.weight"] = (("layers", i, *path), kind)
    return table


def permute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """What llama.cpp's converter does to a Hugging Face Q/K weight [out, in]."""
    out = w.shape[0]
    return w.reshape(n_head, 2, out // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def unpermute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """The inverse of `permute_qk`: GGUF Q/K weight [out, in] -> Hugging Face row order."""
    out = w.shape[0]
    return w.reshape(n_head, out // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def open_gguf(path: str | os.PathLike):
    """Opens (memory-maps) a GGUF file: -> (path as str, `gguf.GGUFReader`).

    Raises GGUFError for a missing / unreadable / non-GGUF / corrupt file."""
    import gguf  # noqa: PLC0415 (only GGUF users pay for the import)

    path = os.fspath(path)
    if not os.path.exists(path):
        raise GGUFError(f"{path}: GGUF file not found")
    if not os.path.isfile(path):
        raise GGUFError(f"{path}: not a file (expected a .gguf model file)")
    try:
        with open(path, "rb") as f:
            magic = f.read(4)
    except OSError as e:
        raise GGUFError(f"{path}: cannot read: {e.strerror or e}") from None
    if magic != GGUF_MAGIC:
        raise GGUFError(f"{path}: not a GGUF file (starts with {magic!r}, expected {GGUF_MAGIC!r})")
    try:
        return path, gguf.GGUFReader(path, "r")
    except Exception as e:  # truncated / corrupt header, unsupported version
        raise GGUFError(f"{path}: cannot parse GGUF ({type(e).__name__}: {e})") from None


def gguf_field(reader, key: str, default: Any = None) -> Any:
    """The value of metadata `key` (str, number, bool or list), or `default` if absent."""
    f = reader.fields.get(key)
    if f is None:
        return default
    return f.contents()


def _config(path: str, reader) -> LlamaConfig:
    arch = gguf_field(reader, "general.architecture")
    if arch is None:
        raise GGUFError(f"{path}: no general.architecture in the GGUF metadata")
    if arch != "llama":
        raise GGUFError(f"{path}: architecture {arch!r} is not supported (only 'llama')")
    tensor_names = {t.name for t in reader.tensors}

    def need(key: str) -> Any:
        v = gguf_field(reader, f"llama.{key}")
        if v is None:
            raise GGUFError(f"{path}: GGUF metadata lacks llama.{key}")
        return v

    if int(gguf_field(reader, "llama.expert_count", 0) or 0) > 0:
        raise GGUFError(f"{path}: mixture-of-experts llama models are not supported")
    hidden = int(need("embedding_length"))
    heads = int(need("attention.head_count"))
    kv_heads = gguf_field(reader, "llama.attention.head_count_kv", heads)
    if isinstance(kv_heads, list):
        if len(set(kv_heads)) != 1:
            raise GGUFError(f"{path}: per-layer llama.attention.head_count_kv {kv_heads} "
                            f"is not supported")
        kv_heads = kv_heads[0]
    head_dim = int(gguf_field(reader, "llama.attention.key_length", 0) or 0) or hidden // heads
    v_dim = int(gguf_field(reader, "llama.attention.value_length", head_dim) or head_dim)
    if v_dim != head_dim:
        raise GGUFError(f"{path}: value_length {v_dim} != key_length {head_dim} is not supported")
    rot = int(gguf_field(reader, "llama.rope.dimension_count", head_dim) or head_dim)
    if rot != head_dim:
        raise GGUFError(f"{path}: partial RoPE (rope.dimension_count {rot} < head_dim "
                        f"{head_dim}) is not supported")
    rope = None
    stype = gguf_field(reader, "llama.rope.scaling.type", "none") or "none"
    if stype == "linear":
        rope = RopeScaling("linear", float(need("rope.scaling.factor")))
    elif stype != "none":
        raise GGUFError(f"{path}: RoPE scaling {stype!r} is not supported")
    if "rope_freqs.weight" in tensor_names:
        raise GGUFError(f"{path}: tensor 'rope_freqs.weight' (Llama-3 RoPE frequency scaling) "
                        f"is not supported")
    tokens = gguf_field(reader, "tokenizer.ggml.tokens")
    vocab = gguf_field(reader, "llama.vocab_size")
    if vocab is None:
        if tokens is None:
            raise GGUFError(f"{path}: neither llama.vocab_size nor tokenizer.ggml.tokens given")
        vocab = len(tokens)
    bos = gguf_field(reader, "tokenizer.ggml.bos_token_id")
    eos: list[int] = []
    if (e := gguf_field(reader, "tokenizer.ggml.eos_token_id")) is not None:
        eos.append(int(e))
    if tokens is not None and IM_END in tokens and tokens.index(IM_END) not in eos:
        eos.append(tokens.index(IM_END))
    try:
        return LlamaConfig(
            vocab_size=int(vocab),
            hidden_size=hidden,
            intermediate_size=int(need("feed_forward_length")),
            num_layers=int(need("block_count")),
            num_heads=heads,
            num_kv_heads=int(kv_heads),
            head_dim=head_dim,
            rope_theta=float(gguf_field(reader, "llama.rope.freq_base", 10000.0)),
            rope_scaling=rope,
            rms_norm_eps=float(gguf_field(reader, "llama.attention.layer_norm_rms_epsilon", 1e-5)),
            tie_word_embeddings="output.weight" not in tensor_names,
            max_position_embeddings=int(gguf_field(reader, "llama.context_length", 4096)),
            bos_token_id=None if bos is None else int(bos),
            eos_token_ids=tuple(eos),
        )
    except ConfigError as e:
        raise GGUFError(f"{path}: {str(e).removeprefix('model config: ')}") from None


def load_gguf_config(path: str | os.PathLike) -> LlamaConfig:
    """Reads the `llama.*` and `tokenizer.ggml.*` metadata of a GGUF file into a `LlamaConfig`.

    tie_word_embeddings is true when the file has no `output.weight`. eos_token_ids is
    `tokenizer.ggml.eos_token_id` followed by the id of `<|im_end|>` when the vocabulary has
    that token (chat models in ChatML format end their turn with it) and it is not already the
    EOS; bos_token_id is `tokenizer.ggml.bos_token_id` (None if absent).

    Raises GGUFError for a missing / unreadable / non-GGUF file, an architecture other than
    `llama`, or metadata this model cannot represent (MoE, partial or unsupported RoPE).
    """
    path, reader = open_gguf(path)
    return _config(path, reader)


def load_gguf_llama(path: str | os.PathLike, dtype=jnp.float32,
                    config: LlamaConfig | None = None) -> Llama:
    """Loads a llama-architecture GGUF file into a `Llama` with `dtype` parameters.

    Every tensor is dequantized to float32 by the `gguf` package, converted to our layout
    (linear weights transposed to [in, out]; Q/K rows un-permuted, see the module docstring),
    cast to `dtype` and placed on the device. config: overrides the file's metadata (its
    shapes are still checked against every tensor).

    Raises GGUFError naming the file or tensor for: a missing / unreadable / non-GGUF file,
    an unsupported architecture, a tensor whose shape differs from the config's, a tensor
    quantization type the `gguf` package cannot dequantize, a missing tensor or one this
    model has no place for.
    """
    from gguf.quants import dequantize  # noqa: PLC0415

    path, reader = open_gguf(path)
    cfg = config if config is not None else _config(path, reader)
    abstract = nnx.eval_shape(lambda: Llama(cfg, dtype=dtype, rngs=nnx.Rngs(0)))
    graphdef, state = nnx.split(abstract)
    variables = dict(nnx.to_flat_state(state))
    table = _gguf_table(cfg)
    target = np.dtype(dtype)
    unknown = [t.name for t in reader.tensors if t.name not in table
               and not (t.name == "output.weight" and cfg.tie_word_embeddings)]
    if unknown:
        shown = ", ".join(sorted(unknown)[:5]) + (" ..." if len(unknown) > 5 else "")
        raise GGUFError(f"{path}: {len(unknown)} tensor(s) this Llama model has no place for: "
                        f"{shown}")
    present = {t.name for t in reader.tensors}
    missing = [n for n in table if n not in present]
    if missing:
        shown = ", ".join(missing[:5]) + (" ..." if len(missing) > 5 else "")
        raise GGUFError(f"{path}: {len(missing)} tensor(s) missing from the file: {shown}")
    # check every shape before the (slow) dequantization
    for t in reader.tensors:
        if t.name not in table:
            continue
        key, kind = table[t.name]
        want = tuple(variables[key].get_value().shape)
        want_np = want[::-1] if kind in (_LINEAR, _Q, _K) else want
        got = tuple(int(d) for d in reversed(t.shape))  # GGUF lists the fastest dim first
        if got != want_np:
            raise GGUFError(f"{path}: tensor {t.name!r} has shape {got} (as [rows, cols]), "
                            f"expected {want_np} for this config")
    for t in reader.tensors:
        if t.name not in table:
            continue
        key, kind = table[t.name]
        try:
            arr = dequantize(t.data, t.tensor_type)
        except NotImplementedError:
            raise GGUFError(f"{path}: tensor {t.name!r} has quantization type "
                            f"{t.tensor_type.name}, which the gguf package cannot dequantize"
                            ) from None
        except Exception as e:
            raise GGUFError(f"{path}: cannot dequantize tensor {t.name!r} "
                            f"({t.tensor_type.name}: {type(e).__name__}: {e})") from None
        arr = np.asarray(arr, np.float32).reshape(tuple(int(d) for d in reversed(t.shape)))
        if kind == _Q:
            arr = unpermute_qk(arr, cfg.num_heads)
        elif kind == _K:
            arr = unpermute_qk(arr, cfg.num_kv_heads)
        if kind in (_LINEAR, _Q, _K):
            arr = arr.T
        arr = np.ascontiguousarray(arr.astype(target, copy=False))
        variables[key].set_value(jax.device_put(arr))
        del arr
    return nnx.merge(graphdef, state)
