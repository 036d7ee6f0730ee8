"""Llama-2-7B chat: 32 layers, width 4096, 32 heads, vocab 32000."""

from lookahead_jax.lookahead.config import LookaheadConfig
from lookahead_jax.store.presets import Preset
from models.config import LlamaConfig


def get_config() -> Preset:
    return Preset(
        name="llama7b",
        description=__doc__,
        model=LlamaConfig(
            vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_layers=32,
            num_heads=32, num_kv_heads=32, rope_theta=10000.0, rms_norm_eps=1e-5,
            max_position_embeddings=4096, bos_token_id=1, eos_token_ids=(2,)),
        # Lookahead Decoding paper, Table 4 (7B on A100): W=15, N=5, G=15.
        lookahead=LookaheadConfig(W=15, N=5, G=15),
        checkpoint=None,  # no weights ship with the package: pass --ckpt
        chat=True,
        dtype="bfloat16",
        weights_hint="Llama-2-7b-chat-hf",
        parallel=True,  # lookahead parallelism over all local devices (each holds the model)
    )
