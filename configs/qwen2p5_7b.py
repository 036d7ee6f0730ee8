"""Qwen2.5-7B-Instruct: 28 layers, width 3584, 28 query / 4 KV heads, biases on q/k/v, vocab 152064."""

from lookahead_jax.lookahead.config import LookaheadConfig
from lookahead_jax.store.presets import Preset
from models.config import LlamaConfig


def get_config() -> Preset:
    return Preset(
        name="qwen2p5_7b",
        description=__doc__,
        model=LlamaConfig(
            family="qwen2", vocab_size=152064, hidden_size=3584, intermediate_size=18944,
            num_layers=28, num_heads=28, num_kv_heads=4, qkv_bias=True, rope_theta=1000000.0,
            rms_norm_eps=1e-6, max_position_embeddings=32768, bos_token_id=151643,
            eos_token_ids=(151645, 151643)),
        # Chosen for an A100 80GB SXM by the scaling law over the roofline model's step cost
        # (python -m benchmarks.family_presets, benchmarks/results/family_presets.json): a
        # 160-token step costs 1.07 plain steps there (kernel attention), predicted
        # 1.80x. W = 20 is the widest the grid tries.
        lookahead=LookaheadConfig(W=20, N=5, G=20),
        checkpoint=None,  # no weights ship with the package: pass --ckpt
        chat=True,
        dtype="bfloat16",
        weights_hint="Qwen2.5-7B-Instruct",
    )
