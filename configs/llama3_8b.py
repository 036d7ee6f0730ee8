"""Llama-3.1-8B-Instruct (also 3.0 / 3.1 base): 32 layers, width 4096, 32 query / 8 KV heads, vocab
128256, llama3 RoPE scaling (factor 8, 128k positions)."""

from lookahead_jax.lookahead.config import LookaheadConfig
from lookahead_jax.store.presets import Preset
from models.config import LlamaConfig, RopeScaling


def get_config() -> Preset:
    return Preset(
        name="llama3_8b",
        description=__doc__,
        model=LlamaConfig(
            vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_layers=32,
            num_heads=32, num_kv_heads=8, rope_theta=500000.0,
            rope_scaling=RopeScaling("llama3", 8.0, 1.0, 4.0, 8192), rms_norm_eps=1e-5,
            max_position_embeddings=131072, bos_token_id=128000,
            eos_token_ids=(128001, 128008, 128009)),
        # Chosen for an A100 80GB SXM by the scaling law over the roofline model's step cost
        # (python -m benchmarks.family_presets, benchmarks/results/family_presets.json): a
        # 160-token step costs 1.06 plain steps there (kernel attention), predicted
        # 1.80x. W = 20 is the widest the grid tries.
        lookahead=LookaheadConfig(W=20, N=5, G=20),
        checkpoint=None,  # no weights ship with the package: pass --ckpt
        chat=True,
        dtype="bfloat16",
        weights_hint="Llama-3.1-8B-Instruct",
    )
