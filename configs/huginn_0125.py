"""Huginn-0125 (seal-rg/recurrent-pretraining, tomg-group-umd/huginn-0125): a depth-recurrent
Raven model, prelude 2 + recurrent core 4 (R = 32 recurrences from a noise state) + coda 2
sandwich blocks, width 5280, 55 heads, vocab 65536, RoPE base 50000, tied embeddings. No
weights ship with the package: pass --ckpt=/path/to/huginn-0125 (the Hugging Face directory).
Decoding: plain (`--method=ar`, the default), loopspec or loopahead. The initial state is
deterministic per (seed, position) (see models/raven.py)."""

from lookahead_jax.store.presets import Preset
from models.config import LoopedConfig


def get_config() -> Preset:
    return Preset(
        name="huginn_0125",
        description=__doc__,
        model=LoopedConfig(
            family="raven", vocab_size=65536, hidden_size=5280, intermediate_size=17920,
            num_heads=55, num_kv_heads=55, prelude_layers=2, core_layers=4, coda_layers=2,
            num_loops=32, rope_theta=50000.0, rms_norm_eps=1e-6, tie_word_embeddings=True,
            qk_bias=True, max_position_embeddings=4096, bos_token_id=65504,
            eos_token_ids=(65505,)),
        lookahead=None,
        checkpoint=None,  # pass --ckpt
        chat=True,
        dtype="bfloat16",
        weights_hint="huginn-0125",
    )
