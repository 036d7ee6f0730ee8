"""The tiny looped models: shape and training settings, by name (`--model=tiny_ouro`)."""

from __future__ import annotations

import dataclasses

from models.looped import LoopedConfig
from train_looped.tokenizer import BOS_ID, DEFAULT_VOCAB, EOS_ID
from train_looped.train import TrainConfig

_COMMON = dict(vocab_size=DEFAULT_VOCAB, num_heads=4, num_kv_heads=4, tie_word_embeddings=True,
               max_position_embeddings=2048, bos_token_id=BOS_ID, eos_token_ids=(EOS_ID,))


@dataclasses.dataclass(frozen=True)
class TinyModel:
    name: str
    model: LoopedConfig
    train: TrainConfig
    description: str


MODELS = {
    "tiny_ouro": TinyModel(
        "tiny_ouro",
        LoopedConfig(family="ouro", hidden_size=256, intermediate_size=768, num_layers=2,
                     num_loops=4, **_COMMON),
        TrainConfig(seq_len=512, batch_size=6, steps=300, loss="uniform", peak_lr=3e-3,
                    warmup_steps=30, branch_norm_init=0.1, consistency_weight=10.0,
                    consistency_target="next"),
        "Ouro-style: width 256, 2 shared sandwich-norm layers x 4 loops, exit gate, tied "
        "embeddings"),
    "tiny_raven": TinyModel(
        "tiny_raven",
        LoopedConfig(family="raven", hidden_size=128, intermediate_size=512, prelude_layers=1,
                     core_layers=2, coda_layers=1, num_loops=8, **_COMMON),
        TrainConfig(seq_len=512, batch_size=2, steps=500, loss="uniform", peak_lr=1e-3,
                    warmup_steps=30),
        "Raven-style: width 128, prelude 1, core 2 x 8 recurrences from noise, coda 1 (at "
        "every readout), tied embeddings"),
}


def get(name: str) -> TinyModel:
    if name not in MODELS:
        raise ValueError(f"unknown model {name!r}: one of {', '.join(MODELS)}")
    return MODELS[name]
