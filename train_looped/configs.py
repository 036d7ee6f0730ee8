"""The tiny looped models: training settings by name (`--model=tiny_ouro`).

A model's shape is not written here: it is its preset's (`configs/<name>.py`, read with
`lookahead_jax.store.presets.load_preset`), the one place each tiny model's shape is written,
so that the model trained here is the one decoding expects. The BPE built here
(`train_looped.tokenizer`) must give that shape's vocabulary size and BOS / EOS ids (`get`
checks).
"""

from __future__ import annotations

import dataclasses

from models.config import ConfigError
from train_looped.tokenizer import BOS_ID, EOS_ID
from train_looped.train import TrainConfig


@dataclasses.dataclass(frozen=True)
class TinyModel:
    name: str  # also the preset that gives its shape
    train: TrainConfig

    @property
    def preset(self):
        from lookahead_jax.store.presets import load_preset  # noqa: PLC0415
        return load_preset(self.name)

    @property
    def model(self):
        """The model's shape, a LoopedConfig: its preset's."""
        return self.preset.model

    @property
    def description(self) -> str:
        """The preset's description up to its first sentence's end."""
        text = " ".join(self.preset.description.split())
        return text.split(", trained here")[0].split(". ")[0]


MODELS = {
    "tiny_ouro": TinyModel(
        "tiny_ouro",
        TrainConfig(seq_len=512, batch_size=6, steps=300, loss="uniform", peak_lr=3e-3,
                    warmup_steps=30, branch_norm_init=0.1, consistency_weight=10.0,
                    consistency_target="next")),
    "tiny_raven": TinyModel(
        "tiny_raven",
        TrainConfig(seq_len=512, batch_size=2, steps=500, loss="uniform", peak_lr=1e-3,
                    warmup_steps=30)),
}


def get(name: str) -> TinyModel:
    """The named tiny model; raises ValueError for an unknown name and ConfigError when its
    preset's shape does not fit the tokenizer built here."""
    if name not in MODELS:
        raise ValueError(f"unknown model {name!r}: one of {', '.join(MODELS)}")
    spec = MODELS[name]
    model = spec.model
    for field, want in (("bos_token_id", BOS_ID), ("eos_token_ids", (EOS_ID,))):
        if getattr(model, field) != want:
            raise ConfigError(f"preset {name}: {field} is {getattr(model, field)}, the "
                              f"tokenizer built by train_looped gives {want}")
    return spec
