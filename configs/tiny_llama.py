"""A tiny random-weight Llama (2 layers, width 64, GQA 4/2 heads, vocab 512) for tests and smoke
runs. Its checkpoint is "random": weights from nnx.Rngs(0) and no tokenizer, so it generates
from token ids only (`--prompt_ids=1,2,3`). Pass --ckpt to load a real checkpoint of this
shape instead (e.g. one written by the tests, with a tokenizer)."""

from lookahead_jax.lookahead.config import LookaheadConfig
from lookahead_jax.store.presets import Preset
from models.config import LlamaConfig


def get_config() -> Preset:
    return Preset(
        name="tiny_llama",
        description=__doc__,
        model=LlamaConfig(
            vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
            num_kv_heads=2, rope_theta=10000.0, rms_norm_eps=1e-5, max_position_embeddings=512,
            bos_token_id=1, eos_token_ids=(2,)),
        lookahead=LookaheadConfig(W=4, N=3, G=4),  # small, so tests compile fast
        checkpoint="random",
        chat=False,
        dtype="float32",
    )
