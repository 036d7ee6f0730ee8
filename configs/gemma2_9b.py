"""Gemma-2-9B-it: 42 layers, width 3584, 16 query / 8 KV heads of 256, sliding (4096) and global
layers alternating, attention (50) and logit (30) soft-capping, vocab 256000."""

from lookahead_jax.lookahead.config import LookaheadConfig
from lookahead_jax.store.presets import Preset
from models.config import LlamaConfig


def get_config() -> Preset:
    return Preset(
        name="gemma2_9b",
        description=__doc__,
        model=LlamaConfig(
            family="gemma2", vocab_size=256000, hidden_size=3584, intermediate_size=14336,
            num_layers=42, num_heads=16, num_kv_heads=8, head_dim=256, norm_offset=1.0,
            sandwich_norms=True, hidden_act="gelu_tanh", embed_scale=3584 ** 0.5,
            query_scale=256 ** -0.5, attn_softcap=50.0, final_softcap=30.0,
            sliding_window=4096, layer_types=("sliding", "full") * 21, rope_theta=10000.0,
            rms_norm_eps=1e-6, tie_word_embeddings=True, max_position_embeddings=8192,
            bos_token_id=2, eos_token_ids=(1, 107)),
        # Chosen for an A100 80GB SXM by the scaling law over the roofline model's step cost
        # (python -m benchmarks.family_presets, benchmarks/results/family_presets.json): a
        # 160-token step costs 1.10 plain steps there (dense attention), predicted
        # 1.74x. W = 20 is the widest the grid tries.
        lookahead=LookaheadConfig(W=20, N=5, G=20),
        checkpoint=None,  # no weights ship with the package: pass --ckpt
        chat=True,
        dtype="bfloat16",
        weights_hint="gemma-2-9b-it",
    )
