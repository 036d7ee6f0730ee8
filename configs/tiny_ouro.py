"""A tiny Ouro-style looped model (2 shared sandwich-norm layers x 4 loops, width 256, 4 heads,
vocab 4096, tied embeddings, exit gate), trained here by `train_looped` on offline text
(checkpoints/README.md has the recipe and its held-out figures). Weights and the BPE tokenizer:
checkpoints/tiny_ouro; prompts go through its chat template. --ckpt loads another directory
of this shape; --ckpt=random gives random weights (generate with --prompt_ids)."""

from lookahead_jax.store.presets import Preset, shipped_checkpoint
from models.config import LoopedConfig


def get_config() -> Preset:
    return Preset(
        name="tiny_ouro",
        description=__doc__,
        model=LoopedConfig(
            family="ouro", vocab_size=4096, hidden_size=256, intermediate_size=768, num_heads=4,
            num_kv_heads=4, num_layers=2, num_loops=4, rope_theta=10000.0, rms_norm_eps=1e-6,
            tie_word_embeddings=True, max_position_embeddings=2048, bos_token_id=0,
            eos_token_ids=(1,)),
        lookahead=None,
        checkpoint=shipped_checkpoint("tiny_ouro"),
        chat=True,
        dtype="float32",
    )
