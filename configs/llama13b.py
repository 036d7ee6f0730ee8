"""Llama-2-13B chat: 40 layers, width 5120, 40 heads, vocab 32000."""

from lookahead_jax.lookahead.config import LookaheadConfig
from lookahead_jax.store.presets import Preset
from models.config import LlamaConfig


def get_config() -> Preset:
    return Preset(
        name="llama13b",
        description=__doc__,
        model=LlamaConfig(
            vocab_size=32000, hidden_size=5120, intermediate_size=13824, num_layers=40,
            num_heads=40, num_kv_heads=40, rope_theta=10000.0, rms_norm_eps=1e-5,
            max_position_embeddings=4096, bos_token_id=1, eos_token_ids=(2,)),
        # Lookahead Decoding paper, Table 4 (13B on A100): W=10, N=5, G=10.
        lookahead=LookaheadConfig(W=10, N=5, G=10),
        checkpoint=None,  # no weights ship with the package: pass --ckpt
        chat=True,
        dtype="bfloat16",
        weights_hint="Llama-2-13b-chat-hf",
        parallel=True,  # lookahead parallelism over all local devices (each holds the model)
    )
