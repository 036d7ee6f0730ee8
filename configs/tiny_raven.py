"""A tiny Raven-style looped model (prelude 1 + core 2 x 8 recurrences from noise + coda 1,
width 128, 4 heads, SwiGLU 512, vocab 4096, tied embeddings), trained here by `train_looped`
on offline text (checkpoints/README.md has the recipe and its held-out figures). Weights and
the BPE tokenizer: checkpoints/tiny_raven; prompts go through its chat template. --ckpt loads
another directory of this shape; --ckpt=random gives random weights (generate with
--prompt_ids)."""

from lookahead_jax.store.presets import Preset, shipped_checkpoint
from models.config import LoopedConfig


def get_config() -> Preset:
    return Preset(
        name="tiny_raven",
        description=__doc__,
        model=LoopedConfig(
            family="raven", vocab_size=4096, hidden_size=128, intermediate_size=512, num_heads=4,
            num_kv_heads=4, prelude_layers=1, core_layers=2, coda_layers=1, num_loops=8,
            rope_theta=10000.0, rms_norm_eps=1e-6, tie_word_embeddings=True,
            max_position_embeddings=2048, bos_token_id=0, eos_token_ids=(1,)),
        lookahead=None,
        checkpoint=shipped_checkpoint("tiny_raven"),
        chat=True,
        dtype="float32",
    )
