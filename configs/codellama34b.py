"""CodeLlama-34B: 48 layers, width 8192, 64 query / 8 KV heads, RoPE base 1e6, vocab 32000."""

from lookahead_jax.lookahead.config import LookaheadConfig
from lookahead_jax.store.presets import Preset
from models.config import LlamaConfig


def get_config() -> Preset:
    return Preset(
        name="codellama34b",
        description=__doc__,
        model=LlamaConfig(
            vocab_size=32000, hidden_size=8192, intermediate_size=22016, num_layers=48,
            num_heads=64, num_kv_heads=8, rope_theta=1000000.0, rms_norm_eps=1e-5,
            max_position_embeddings=16384, bos_token_id=1, eos_token_ids=(2,)),
        # Lookahead Decoding paper, Table 4 (33/34B on A100): W=7, N=5, G=7.
        lookahead=LookaheadConfig(W=7, N=5, G=7),
        checkpoint=None,  # no weights ship with the package: pass --ckpt
        chat=False,
        dtype="bfloat16",
        weights_hint="CodeLlama-34b-hf",
        parallel=True,  # lookahead parallelism over all local devices (each holds the model)
    )
