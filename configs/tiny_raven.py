"""A tiny Raven-style looped model (prelude 1 + core 2 x 8 recurrences from noise + coda 1,
width 256, 4 heads, vocab 4096, tied embeddings): the shape `train_looped` trains as
`tiny_raven`. Its checkpoint is "random" (weights from nnx.Rngs(0), no tokenizer:
`--prompt_ids=1,2,3`) until the trained weights (checkpoints/tiny_raven) are added; --ckpt
loads a directory of this shape."""

from lookahead_jax.presets import Preset
from models.looped import LoopedConfig


def get_config() -> Preset:
    return Preset(
        name="tiny_raven",
        description=__doc__,
        model=LoopedConfig(
            family="raven", vocab_size=4096, hidden_size=256, intermediate_size=768, num_heads=4,
            num_kv_heads=4, prelude_layers=1, core_layers=2, coda_layers=1, num_loops=8,
            rope_theta=10000.0, rms_norm_eps=1e-6, tie_word_embeddings=True,
            max_position_embeddings=2048, bos_token_id=0, eos_token_ids=(1,)),
        lookahead=None,
        checkpoint="random",
        chat=False,
        dtype="float32",
    )
