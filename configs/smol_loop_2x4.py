"""SmolLM2-135M-Instruct with two layers looped four times: smol_loop_2x2's block (its tenth
round) with its output projections halved, run 4 times in place of SmolLM2's layers 14-15 where
smol_loop_2x2 runs it twice (`python -m train_looped.reloop --src=checkpoints/smol_loop_2x2
--num_loops=4 --out=checkpoints/smol_loop_2x4`; no training: four half steps of the block add
about what two whole ones do). Its role: a looped model with four loops that writes real text,
so that LoopAhead's scheduling and dual-proposal LoopSpec (which need a depth between the first
and the last) are measured on real text. Only the block is shipped (checkpoints/smol_loop_2x4,
14 MB bf16): the other layers and the tokenizer are read from the embedded SmolLM2 GGUF, checked
by sha256. Prompts go through SmolLM2's chat template."""

from lookahead_jax.store.presets import Preset, shipped_checkpoint
from models.config import LoopedConfig


def get_config() -> Preset:
    return Preset(
        name="smol_loop_2x4",
        description=__doc__,
        model=LoopedConfig(
            family="recursive", vocab_size=49152, hidden_size=576, intermediate_size=1536,
            num_heads=9, num_kv_heads=3, prelude_layers=14, core_layers=2, coda_layers=14,
            num_loops=4, rope_theta=100000.0, rms_norm_eps=1e-5, tie_word_embeddings=True,
            max_position_embeddings=8192, bos_token_id=1, eos_token_ids=(2,)),
        lookahead=None,
        checkpoint=shipped_checkpoint("smol_loop_2x4"),
        chat=True,
        dtype="float32",
    )
