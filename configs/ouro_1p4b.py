"""Ouro-1.4B (ByteDance): a looped LM, 24 shared sandwich-norm layers run R = 4 times, width
2048, 16 heads, vocab 49152, RoPE theta 1e6, untied embeddings, an early-exit gate. No weights
ship with the package: pass --ckpt=/path/to/Ouro-1.4B (the Hugging Face directory). Decoding: plain
(`--method=ar`, the default), `--method=loopspec` or `--method=loopahead` (`--lad=`)."""

from lookahead_jax.store.presets import Preset
from models.config import LoopedConfig


def get_config() -> Preset:
    return Preset(
        name="ouro_1p4b",
        description=__doc__,
        model=LoopedConfig(
            family="ouro", vocab_size=49152, hidden_size=2048, intermediate_size=5632,
            num_heads=16, num_kv_heads=16, head_dim=128, num_layers=24, num_loops=4,
            rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=False,
            max_position_embeddings=65536, bos_token_id=0, eos_token_ids=(0,)),
        lookahead=None,  # no lookahead settings: --method=ar (default), loopspec, loopahead
        checkpoint=None,  # pass --ckpt
        chat=False,
        dtype="bfloat16",
        weights_hint="Ouro-1.4B",
    )
