"""Qwen3-8B: 36 layers, width 4096, 32 query / 8 KV heads of 128, RMSNorm on q and k heads, vocab
151936."""

from lookahead_jax.lookahead.config import LookaheadConfig
from lookahead_jax.store.presets import Preset
from models.config import LlamaConfig


def get_config() -> Preset:
    return Preset(
        name="qwen3_8b",
        description=__doc__,
        model=LlamaConfig(
            family="qwen3", vocab_size=151936, hidden_size=4096, intermediate_size=12288,
            num_layers=36, num_heads=32, num_kv_heads=8, head_dim=128, qk_norm=True,
            rope_theta=1000000.0, rms_norm_eps=1e-6, max_position_embeddings=40960,
            bos_token_id=151643, eos_token_ids=(151645, 151643)),
        # Chosen for an A100 80GB SXM by the scaling law over the roofline model's step cost
        # (python -m benchmarks.family_presets, benchmarks/results/family_presets.json): a
        # 160-token step costs 1.06 plain steps there (kernel attention), predicted
        # 1.81x. W = 20 is the widest the grid tries.
        lookahead=LookaheadConfig(W=20, N=5, G=20),
        checkpoint=None,  # no weights ship with the package: pass --ckpt
        chat=True,
        dtype="bfloat16",
        weights_hint="Qwen3-8B",
    )
