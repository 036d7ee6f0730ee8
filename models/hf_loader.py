"""Loads a Hugging Face decoder checkpoint (`config.json` + safetensors) of any family in
`models.families` (Llama, Mistral, Qwen 2.5/3, Gemma 2/3, Phi-3) into `Llama`.

The model is built shape-only (`nnx.eval_shape`), then every parameter is read from the
safetensors file(s) one tensor at a time, converted to the target dtype, placed on the
device, and the host copy dropped. One table per family (`models.families.tensor_table`) maps
each Hugging Face tensor name to our parameter path(s), says whether it is transposed (HF
`nn.Linear.weight` is [out, in]; our `nnx.Linear.kernel` is [in, out]) and, for a fused tensor
(Phi-3's qkv_proj), which rows go where. The reading itself (`load_safetensors_into`,
`config_from_json`) is shared with the looped models' loader (`models/looped_loader.py`).
"""

from __future__ import annotations

import functools
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
from models.families import (MULTIMODAL_PARTS, Target, config_from_hf, decoder_prefix,
                             tensor_table)
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
    """Reads `<path>/config.json` (a Hugging Face config of a `models.families` family) into a
    `LlamaConfig`.

    Raises CheckpointError if the directory or file is missing, unreadable, not valid JSON,
    or not a usable Llama-family config.
    """
    return config_from_json(path, config_from_hf)


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


def _hf_shape(targets: tuple[Target, ...], variables) -> tuple[int, ...]:
    """The Hugging Face tensor's shape that `targets` expect: a parameter's shape ([out, in]
    if transposed), with the rows of a fused tensor's parts added up."""
    shapes = []
    for t in targets:
        want = tuple(variables[t.path].get_value().shape)
        shapes.append(want[::-1] if t.transpose else want)
    if targets[0].rows is None:
        return shapes[0]
    return (targets[-1].rows[1], *shapes[0][1:])


def _read_part(source, t: Target, want: tuple[int, ...], target: np.dtype, index=()) -> np.ndarray:
    """The part `index` (slices of our parameter, shape `want`) of Target t, read from
    `source` (a safetensors slice or a memory map of the Hugging Face tensor) as `target`."""
    index = tuple(index) + (slice(None),) * (len(want) - len(index))
    hf = list(index[::-1] if t.transpose else index)  # HF stores [out, in]
    if t.rows is not None:  # a fused tensor: this part is rows [start, stop) of it
        start, stop = t.rows
        first = hf[0].indices(stop - start)
        hf[0] = slice(start + first[0], start + first[1])
    part = np.asarray(source[tuple(hf)]).astype(target, copy=False)
    return np.ascontiguousarray(part.T if t.transpose else part)


def _read_header(file: str) -> dict[str, Any]:
    with open(file, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    header["__header_len__"] = n
    return header


def tensor_names(path: str | os.PathLike) -> list[str]:
    """The tensor names of a checkpoint directory's safetensors file(s) (headers only)."""
    names: list[str] = []
    for file, wanted in _shard_files(os.fspath(path)).items():
        if wanted is not None:
            names += wanted
            continue
        try:
            names += [n for n in _read_header(file) if n not in ("__metadata__", "__header_len__")]
        except (OSError, ValueError, struct.error) as e:
            raise CheckpointError(f"{file}: cannot read safetensors ({type(e).__name__}: {e})"
                                  ) from None
    return names


def load_hf_llama(path: str | os.PathLike, dtype=jnp.float32,
                  config: LlamaConfig | None = None, mesh: Mesh | None = None) -> Llama:
    """Loads a Hugging Face safetensors checkpoint of any `models.families` family
    (`LlamaForCausalLM`, `MistralForCausalLM`, `Qwen2ForCausalLM`, `Qwen3ForCausalLM`,
    `Gemma2ForCausalLM`, `Gemma3ForCausalLM` or the text model of
    `Gemma3ForConditionalGeneration`, `Phi3ForCausalLM`) into a `Llama`.

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
    prefix = decoder_prefix(tensor_names(path)) if cfg.family == "gemma3" else "model."
    multimodal = prefix != "model."

    def skip(name: str) -> bool:
        if _IGNORED.search(name) or (tied and name.endswith("lm_head.weight")):
            return True
        rest = name.removeprefix("model.")
        return multimodal and rest.startswith(MULTIMODAL_PARTS)

    return load_safetensors_into(
        path, lambda: Llama(cfg, dtype=dtype, rngs=nnx.Rngs(0)), tensor_table(cfg, prefix), dtype,
        skip=skip, kind=f"{cfg.family} model", mesh=mesh,
        missing_hint=lambda missing: (" (config has tie_word_embeddings=false)"
                                      if "lm_head.weight" in missing else ""))


def load_safetensors_into(path: str | os.PathLike, build: Callable[[], nnx.Module],
                          table: Mapping[str, tuple[Target, ...]],
                          dtype, *,
                          skip: Callable[[str], bool], kind: str,
                          missing_hint: Callable[[list[str]], str] = lambda missing: "",
                          mesh: Mesh | None = None) -> nnx.Module:
    """Builds `build()` shape-only and fills every parameter from the safetensors file(s) of
    `path`, through `table` (HF tensor name -> its `Target`s: the parameter(s) it fills, see
    `models.families.Target`).

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
                    sl = f.get_slice(name)
                    got = tuple(sl.get_shape())
                    if sl.get_dtype() in _RAW_DTYPES:
                        header = header or _read_header(file)
                        source = _read_raw(file, name, header)  # a memory map: read lazily
                    else:
                        source = sl
                    targets = table[name]
                    want_hf = _hf_shape(targets, variables)
                    if got != want_hf:
                        raise CheckpointError(
                            f"{file}: tensor {name!r} has shape {got}, expected {want_hf} for "
                            f"this config")
                    for t in targets:
                        var = variables[t.path]
                        want = tuple(var.get_value().shape)
                        read = functools.partial(_read_part, source, t, want, target)
                        if mesh is None:
                            var.set_value(jax.device_put(read()))
                        else:  # each process reads only the parts its own devices hold
                            var.set_value(jax.make_array_from_callback(
                                want, param_sharding(t.path, want, mesh, abstract.config), read))
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
