"""Gemma-3-12B-it, its text model (the multimodal checkpoint loads; the vision tower is skipped):
48 layers, width 3840, 16 query / 8 KV heads of 256, q/k norms, five sliding (1024) layers per
global one, local RoPE base 10000, global 1e6 with linear scaling 8, vocab 262208."""

from lookahead_jax.lookahead.config import LookaheadConfig
from lookahead_jax.store.presets import Preset
from models.config import LlamaConfig, RopeScaling


def get_config() -> Preset:
    return Preset(
        name="gemma3_12b",
        description=__doc__,
        model=LlamaConfig(
            family="gemma3", vocab_size=262208, hidden_size=3840, intermediate_size=15360,
            num_layers=48, num_heads=16, num_kv_heads=8, head_dim=256, qk_norm=True,
            norm_offset=1.0, sandwich_norms=True, hidden_act="gelu_tanh",
            embed_scale=3840 ** 0.5, query_scale=256 ** -0.5, sliding_window=1024,
            layer_types=(("sliding",) * 5 + ("full",)) * 8, rope_theta=1000000.0,
            rope_scaling=RopeScaling("linear", 8.0), local_rope_theta=10000.0,
            rms_norm_eps=1e-6, tie_word_embeddings=True, max_position_embeddings=131072,
            bos_token_id=2, eos_token_ids=(1, 106)),
        # Chosen for an A100 80GB SXM by the scaling law over the roofline model's step cost
        # (python -m benchmarks.family_presets, benchmarks/results/family_presets.json): a
        # 160-token step costs 1.10 plain steps there (dense attention), predicted
        # 1.74x. W = 20 is the widest the grid tries.
        lookahead=LookaheadConfig(W=20, N=5, G=20),
        checkpoint=None,  # no weights ship with the package: pass --ckpt
        chat=True,
        dtype="bfloat16",
        weights_hint="gemma-3-12b-it",
    )
