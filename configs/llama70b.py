"""Llama-2-70B chat: 80 layers, width 8192, 64 query / 8 KV heads, vocab 32000."""

from lookahead_jax.lookahead.config import LookaheadConfig
from lookahead_jax.store.presets import Preset
from models.config import LlamaConfig


def get_config() -> Preset:
    return Preset(
        name="llama70b",
        description=__doc__,
        model=LlamaConfig(
            vocab_size=32000, hidden_size=8192, intermediate_size=28672, num_layers=80,
            num_heads=64, num_kv_heads=8, rope_theta=10000.0, rms_norm_eps=1e-5,
            max_position_embeddings=4096, bos_token_id=1, eos_token_ids=(2,)),
        # Extrapolated: Table 4 stops at 33/34B (W=7, N=5, G=7); not tuned for 70B.
        lookahead=LookaheadConfig(W=7, N=5, G=7),
        checkpoint=None,  # no weights ship with the package: pass --ckpt
        chat=True,
        dtype="bfloat16",
        weights_hint="Llama-2-70b-chat-hf",
        mesh="model:8",  # about 140 GB of bf16 weights: tensor parallelism over 8 devices
    )
