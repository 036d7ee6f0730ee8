"""The shipped form of a tiny looped model: a Hugging Face style directory.

    checkpoints/tiny_ouro/
      config.json            `models.looped_loader.hf_config_dict` (Ouro's / Huginn's field
                             names) plus "training": how the weights were made
      model.safetensors      the published tensor names (`models.looped_loader.hf_table`),
                             bfloat16 by default (half the git size), float32 on request
      tokenizer.json, tokenizer_config.json, chat_template.jinja
      metrics.jsonl          the training log

So `models.looped_loader.load_hf_looped(dir)` loads the model and
`lookahead_jax.store.tokenizer.load_tokenizer(dir)` the tokenizer, like any HF checkpoint.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import shutil
from typing import Any

import jax.numpy as jnp
import ml_dtypes
import numpy as np
from flax import nnx

from models.build import build_looped
from models.config import LoopedConfig
from models.looped import LoopedLM
from models.looped_loader import hf_config_dict, hf_state_dict, load_hf_looped, load_looped_config

WEIGHTS = "model.safetensors"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")
DTYPES = {"bfloat16": ml_dtypes.bfloat16, "float32": np.float32}


def save(out_dir: str | os.PathLike, cfg: LoopedConfig, params, *, tokenizer_dir,
         training: dict[str, Any] | None = None, dtype: str = "bfloat16",
         metrics_file: str | os.PathLike | None = None) -> pathlib.Path:
    """Writes the shipped directory (see the module docstring) of a model `cfg` with
    parameters `params` (an nnx.State of nnx.Param); returns its path."""
    from safetensors.numpy import save_file  # noqa: PLC0415

    out = pathlib.Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model = nnx.eval_shape(lambda: build_looped(cfg, rngs=nnx.Rngs(0)))
    graphdef, _, rest = nnx.split(model, nnx.Param, ...)
    model = nnx.merge(graphdef, params, rest)
    tensors = {k: v.astype(DTYPES[dtype]) for k, v in hf_state_dict(model).items()}
    save_file(tensors, os.fspath(out / WEIGHTS), metadata={"format": "pt"})
    config = {**hf_config_dict(cfg), "torch_dtype": dtype, "training": training or {}}
    (out / "config.json").write_text(json.dumps(config, indent=1) + "\n")
    for name in TOKENIZER_FILES:
        src = pathlib.Path(tokenizer_dir) / name
        if src.exists():
            shutil.copyfile(src, out / name)
    if metrics_file is not None and pathlib.Path(metrics_file).exists():
        shutil.copyfile(metrics_file, out / "metrics.jsonl")
    return out


def load_config(ckpt: str | os.PathLike) -> LoopedConfig:
    return load_looped_config(ckpt)


def load(ckpt: str | os.PathLike, dtype=jnp.float32, num_loops: int | None = None
         ) -> tuple[LoopedLM, LoopedConfig]:
    """(model, config) of a shipped directory, parameters cast to `dtype`. num_loops: run at a
    different full depth than the training one (the parameters do not depend on it)."""
    cfg = load_config(ckpt)
    if num_loops is not None:
        cfg = dataclasses.replace(cfg, num_loops=num_loops)
    return load_hf_looped(ckpt, dtype=dtype, config=cfg), cfg
