"""Llama-3.3-70B-Instruct (also 3.1-70B): 80 layers, width 8192, 64 query / 8 KV heads, vocab 128256,
llama3 RoPE scaling."""

from lookahead_jax.lookahead.config import LookaheadConfig
from lookahead_jax.store.presets import Preset
from models.config import LlamaConfig, RopeScaling


def get_config() -> Preset:
    return Preset(
        name="llama3_70b",
        description=__doc__,
        model=LlamaConfig(
            vocab_size=128256, hidden_size=8192, intermediate_size=28672, num_layers=80,
            num_heads=64, num_kv_heads=8, rope_theta=500000.0,
            rope_scaling=RopeScaling("llama3", 8.0, 1.0, 4.0, 8192), rms_norm_eps=1e-5,
            max_position_embeddings=131072, bos_token_id=128000,
            eos_token_ids=(128001, 128008, 128009)),
        # Chosen for an A100 80GB SXM by the scaling law over the roofline model's step cost
        # (python -m benchmarks.family_presets, benchmarks/results/family_presets.json): a
        # 120-token step costs 1.04 plain steps there (kernel attention), predicted
        # 1.79x. W = 20 is the widest the grid tries.
        lookahead=LookaheadConfig(W=20, N=4, G=20),
        checkpoint=None,  # no weights ship with the package: pass --ckpt
        chat=True,
        dtype="bfloat16",
        weights_hint="Llama-3.3-70B-Instruct",
        mesh="model:8",  # about 140 GB of bf16 weights: tensor parallelism over 8 devices
    )
