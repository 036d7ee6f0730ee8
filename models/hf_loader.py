"""Loads a Hugging Face Llama-family checkpoint (`config.json` + safetensors) into `Llama`.

The model is built shape-only (`nnx.eval_shape`), then every parameter is read from the
safetensors file(s) one tensor at a time, converted to the target dtype, placed on the
device, and the host copy dropped. One table (`_hf_table`) maps each Hugging Face tensor
name to our parameter path and says whether it is transposed (HF `nn.Linear.weight` is
[out, in]; our `nnx.Linear.kernel` is [in, out]). The reading itself (`load_safetensors_into`,
`config_from_json`) is shared with the looped models' loader (`models/looped_loader.py`).
"""

from __future__ import annotations

import json
import os
import re
import struct
from typing import Any, Callable, Mapping

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from flax import nnx
from jax.sharding import Mesh
from safetensors import SafetensorError, safe_open

from models.config import ConfigError, LlamaConfig
from models.llama import Llama
from models.sharding import param_sharding

CONFIG_FILE = "config.json"
SAFETENSORS_FILE = "model.safetensors"
SAFETENSORS_INDEX = "model.safetensors.index.json"

# Tensors a checkpoint may hold that the model does not need (recomputed or unused).
_IGNORED = re.compile(r"(^|\.)rotary_emb\.inv_freq$")

# safetensors dtypes numpy cannot represent: read as raw bytes and viewed through ml_dtypes.
_RAW_DTYPES = {"BF16": ml_dtypes.bfloat16, "F8_E4M3": ml_dtypes.float8_e4m3fn,
               "F8_E5M2": ml_dtypes.float8_e5m2}


class CheckpointError(ConfigError):
    """A checkpoint directory, file or tensor that cannot be loaded; the message says which."""


def _hf_table(cfg: LlamaConfig) -> dict[str, tuple[tuple[Any, ...], bool]]:
    """HF tensor name -> (path in our nnx state, transpose?). lm_head only when untied."""
    table: dict[str, tuple[tuple[Any, ...], bool]] = {
        "model.embed_tokens.weight": (("embed_tokens", "embedding"), False),
        "model.norm.weight": (("norm", "weight"), False),
    }
    if not cfg.tie_word_embeddings:
        table["lm_head.weight"] = (("lm_head", "kernel"), True)
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        table[p + "input_layernorm.weight"] = (("layers", i, "input_layernorm", "weight"), False)
        table[p + "post_attention_layernorm.weight"] = (
            ("layers", i, "post_attention_layernorm", "weight"), False)
        for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
            table[p + f"self_attn.{proj}.weight"] = (("layers", i, "self_attn", proj, "kernel"), True)
        for proj in ("gate_proj", "up_proj", "down_proj"):
            table[p + f"mlp.{proj}.weight"] = (("layers", i, "mlp", proj, "kernel"), True)
    return table


def read_hf_config_json(path: str | os.PathLike) -> dict[str, Any]:
    """Reads `<path>/config.json` as a dict. Raises CheckpointError if the directory or file is
    missing, unreadable, not valid JSON or not a JSON object."""
    path = os.fspath(path)
    if not os.path.isdir(path):
        raise CheckpointError(f"checkpoint directory {path!r} does not exist")
    file = os.path.join(path, CONFIG_FILE)
    try:
        with open(file, encoding="utf-8") as f:
            hf = json.load(f)
    except FileNotFoundError:
        raise CheckpointError(f"{file}: not found (is {path!r} a Hugging Face checkpoint?)") from None
    except (OSError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{file}: cannot read: {e}") from None
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{file}: invalid JSON: {e}") from None
    if not isinstance(hf, dict):
        raise CheckpointError(f"{file}: expected a JSON object, got {type(hf).__name__}")
    return hf


def config_from_json(path: str | os.PathLike, from_hf: Callable[[dict], Any]) -> Any:
    """`from_hf(config.json dict)`, its ConfigError / ValueError / TypeError raised as a
    CheckpointError naming the file."""
    hf = read_hf_config_json(path)
    try:
        return from_hf(hf)
    except (ValueError, TypeError) as e:  # ConfigError is a ValueError
        msg = str(e).removeprefix("config.json: ").removeprefix("model config: ")
        raise CheckpointError(f"{os.path.join(os.fspath(path), CONFIG_FILE)}: {msg}") from None


def load_hf_config(path: str | os.PathLike) -> LlamaConfig:
    """Reads `<path>/config.json` (a Hugging Face Llama/Mistral config) into a `LlamaConfig`.

    Raises CheckpointError if the directory or file is missing, unreadable, not valid JSON,
    or not a usable Llama-family config.
    """
    return config_from_json(path, LlamaConfig.from_hf)


def _shard_files(path: str) -> dict[str, list[str] | None]:
    """Safetensors file -> the tensor names to take from it (None: all of its tensors)."""
    single = os.path.join(path, SAFETENSORS_FILE)
    if os.path.isfile(single):
        return {single: None}
    index = os.path.join(path, SAFETENSORS_INDEX)
    if not os.path.isfile(index):
        raise CheckpointError(
            f"{path}: no {SAFETENSORS_FILE} or {SAFETENSORS_INDEX} (only safetensors checkpoints "
            f"are supported)")
    try:
        with open(index, encoding="utf-8") as f:
            weight_map = json.load(f)["weight_map"]
        files: dict[str, list[str]] = {}
        for name, shard in weight_map.items():
            files.setdefault(os.path.join(path, shard), []).append(name)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError,
            AttributeError) as e:
        raise CheckpointError(f"{index}: not a valid safetensors index ({e!r})") from None
    for file in files:
        if not os.path.isfile(file):
            raise CheckpointError(f"{file}: shard listed in {SAFETENSORS_INDEX} is missing")
    return files


def _read_raw(file: str, name: str, header: dict[str, Any]) -> np.ndarray:
    """One tensor of a dtype numpy lacks (bf16, fp8), mapped from the file (read on access)."""
    meta = header[name]
    begin, end = meta["data_offsets"]
    dt = np.dtype(_RAW_DTYPES[meta["dtype"]])
    data_start = 8 + header["__header_len__"]
    if end == begin:
        return np.zeros(meta["shape"], dt)
    return np.memmap(file, dtype=dt, mode="r", offset=data_start + begin,
                     shape=tuple(meta["shape"]))


def _read_header(file: str) -> dict[str, Any]:
    with open(file, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    header["__header_len__"] = n
    return header


def load_hf_llama(path: str | os.PathLike, dtype=jnp.float32,
                  config: LlamaConfig | None = None, mesh: Mesh | None = None) -> Llama:
    """Loads a Hugging Face `LlamaForCausalLM` safetensors checkpoint into a `Llama`.

    path: directory with `config.json` and `model.safetensors` or a sharded
    `model.safetensors.index.json`. dtype: parameter dtype of the returned model (each tensor
    is cast to it, whatever the checkpoint stores: f32, f16, bf16). config: overrides
    `config.json` (its shapes are still checked against every tensor). mesh: load sharded
    for tensor parallelism (see `load_safetensors_into`).

    Tensors are read lazily one at a time: peak host memory is one tensor (plus its cast
    copy) on top of the model's parameters. Linear weights [out, in] are transposed into
    kernels [in, out]; `embed_tokens.weight` [V, E] is the embedding as is.

    Raises CheckpointError naming the file or tensor for a missing directory / file / shard,
    a tensor whose shape differs from the config's, a tensor the model needs that is absent
    (`lm_head.weight` is optional only with tie_word_embeddings), or an unknown tensor.
    `rotary_emb.inv_freq` (and `lm_head.weight` of a tied model) are skipped.
    """
    path = os.fspath(path)
    cfg = config if config is not None else load_hf_config(path)
    tied = cfg.tie_word_embeddings
    return load_safetensors_into(
        path, lambda: Llama(cfg, dtype=dtype, rngs=nnx.Rngs(0)), _hf_table(cfg), dtype,
        skip=lambda name: bool(_IGNORED.search(name)) or (name == "lm_head.weight" and tied),
        kind="Llama model", mesh=mesh,
        missing_hint=lambda missing: (" (config has tie_word_embeddings=false)"
                                      if "lm_head.weight" in missing else ""))


def load_safetensors_into(path: str | os.PathLike, build: Callable[[], nnx.Module],
                          table: Mapping[str, tuple[tuple[Any, ...], bool]], dtype, *,
                          skip: Callable[[str], bool], kind: str,
                          missing_hint: Callable[[list[str]], str] = lambda missing: "",
                          mesh: Mesh | None = None) -> nnx.Module:
    """Builds `build()` shape-only and fills every parameter from the safetensors file(s) of
    `path`, through `table` (HF tensor name -> (path in the nnx state, transpose?)).

    Tensors are read lazily one at a time and cast to `dtype`; every shape is checked. Names
    for which `skip(name)` holds are ignored. Raises CheckpointError naming the file or tensor
    for a missing / corrupt file or shard, a misshapen tensor, a tensor the model has no place
    for (`kind` names the model in that message) or one the table needs that is absent
    (`missing_hint(missing names)` is appended to that message).

    mesh: place each parameter sharded by `models.sharding`'s rules; each process then reads
    from the files only the slices its own devices hold (tensor parallelism, multi-host).
    """
    path = os.fspath(path)
    files = _shard_files(path)
    abstract = nnx.eval_shape(build)
    graphdef, state = nnx.split(abstract)
    variables = dict(nnx.to_flat_state(state))
    target = np.dtype(dtype)
    loaded: set[str] = set()
    unknown: list[str] = []
    for file, wanted in files.items():
        try:
            with safe_open(file, framework="numpy") as f:
                names = list(f.keys()) if wanted is None else wanted
                present = set(f.keys())
                header = None
                for name in names:
                    if name not in present:
                        raise CheckpointError(
                            f"{file}: tensor {name!r} listed in {SAFETENSORS_INDEX} is not in "
                            f"this shard")
                    if name not in table:
                        if not skip(name):
                            unknown.append(name)
                        continue
                    key, transpose = table[name]
                    var = variables[key]
                    want = tuple(var.get_value().shape)
                    want_hf = want[::-1] if transpose else want
                    sl = f.get_slice(name)
                    got = tuple(sl.get_shape())
                    if got != want_hf:
                        raise CheckpointError(
                            f"{file}: tensor {name!r} has shape {got}, expected {want_hf} for "
                            f"this config")
                    if sl.get_dtype() in _RAW_DTYPES:
                        header = header or _read_header(file)
                        source = _read_raw(file, name, header)  # a memory map: read lazily
                    else:
                        source = sl

                    def read(index=(), source=source, transpose=transpose):
                        # index: the part of our [in, out] kernel wanted; HF stores [out, in]
                        index = tuple(index) + (slice(None),) * (len(want) - len(index))
                        part = np.asarray(source[index[::-1] if transpose else index])
                        part = part.astype(target, copy=False)
                        return np.ascontiguousarray(part.T if transpose else part)

                    if mesh is None:
                        var.set_value(jax.device_put(read()))
                    else:  # each process reads only the parts its own devices hold
                        var.set_value(jax.make_array_from_callback(
                            want, param_sharding(key, want, mesh, abstract.config), read))
                    loaded.add(name)
        except CheckpointError:
            raise
        except (OSError, ValueError, SafetensorError) as e:  # corrupt / truncated file
            raise CheckpointError(f"{file}: cannot read safetensors ({type(e).__name__}: {e})"
                                  ) from None
    if unknown:
        shown = ", ".join(sorted(unknown)[:5]) + (" ..." if len(unknown) > 5 else "")
        raise CheckpointError(
            f"{path}: {len(unknown)} tensor(s) this {kind} has no place for: {shown}")
    missing = [n for n in table if n not in loaded]
    if missing:
        shown = ", ".join(missing[:5]) + (" ..." if len(missing) > 5 else "")
        raise CheckpointError(f"{path}: {len(missing)} tensor(s) missing from the checkpoint: "
                              f"{shown}{missing_hint(missing)}")
    return nnx.merge(graphdef, state)
