"""SmolLM2-135M-Instruct made recursive, trained here (`python -m train_looped.distill`): its
embedding and first 12 layers, then one block of 2 Llama layers run 4 times in place of its
layers 12-19, then its last 10 layers, norm and tied head. The block was distilled from
SmolLM2's own layers on offline text; only the block is shipped (checkpoints/smol_loop, 14 MB
bf16): the other layers are read from the embedded SmolLM2 GGUF, checked by sha256.
checkpoints/README.md has the recipe and its figures. Prompts go through SmolLM2's chat
template."""

from lookahead_jax.store.presets import Preset, shipped_checkpoint
from models.config import LoopedConfig


def get_config() -> Preset:
    return Preset(
        name="smol_loop",
        description=__doc__,
        model=LoopedConfig(
            family="recursive", vocab_size=49152, hidden_size=576, intermediate_size=1536,
            num_heads=9, num_kv_heads=3, prelude_layers=12, core_layers=2, coda_layers=10,
            num_loops=4, rope_theta=100000.0, rms_norm_eps=1e-5, tie_word_embeddings=True,
            max_position_embeddings=8192, bos_token_id=1, eos_token_ids=(2,)),
        lookahead=None,
        checkpoint=shipped_checkpoint("smol_loop"),
        chat=True,
        dtype="float32",
    )
