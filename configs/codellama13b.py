"""CodeLlama-13B: the Llama-2-13B shape, RoPE base 1e6, vocab 32016 (infilling tokens)."""

from lookahead_jax.lookahead.config import LookaheadConfig
from lookahead_jax.store.presets import Preset
from models.config import LlamaConfig


def get_config() -> Preset:
    return Preset(
        name="codellama13b",
        description=__doc__,
        model=LlamaConfig(
            vocab_size=32016, hidden_size=5120, intermediate_size=13824, num_layers=40,
            num_heads=40, num_kv_heads=40, rope_theta=1000000.0, rms_norm_eps=1e-5,
            max_position_embeddings=16384, bos_token_id=1, eos_token_ids=(2,)),
        # Lookahead Decoding paper, Table 4 (13B on A100): W=10, N=5, G=10.
        lookahead=LookaheadConfig(W=10, N=5, G=10),
        checkpoint=None,  # no weights ship with the package: pass --ckpt
        chat=False,
        dtype="bfloat16",
        weights_hint="CodeLlama-13b-hf",
        parallel=True,  # lookahead parallelism over all local devices (each holds the model)
    )
