"""SmolLM2-135M-Instruct with two layers looped twice, trained here (`python -m
train_looped.distill --core_layers=2 --kl_every_depth ...`, recipe in checkpoints/README.md): its
embedding and first 14 layers, then a block of two Llama layers run 2 times in place of its
layers 14-15, then its last 14 layers, norm and tied head. The block started as copies of layers
14 and 15 with their output projections halved; loop 1 was trained to read out as SmolLM2
without layer 15 and loop 2 as SmolLM2 itself (KL through the coda), so the second loop does the
work of a layer; further rounds trained it on its own greedy answers, the last four with the
unlikelihood of the 4-grams its prose answers repeat, the last three also of the periodic runs
any answer ends in (code and sums too), the last two, on prompts a quarter of them MBPP's train
split, also of a function an answer defines again under its name or a longer one (rounds 1, 2,
3, 5, 9 and 10 of checkpoints/README.md). Only the block is shipped
(checkpoints/smol_loop_2x2, 14 MB bf16): the other layers and the tokenizer are read from the
embedded SmolLM2 GGUF, checked by sha256. Prompts go through SmolLM2's chat template."""

from lookahead_jax.store.presets import Preset, shipped_checkpoint
from models.config import LoopedConfig


def get_config() -> Preset:
    return Preset(
        name="smol_loop_2x2",
        description=__doc__,
        model=LoopedConfig(
            family="recursive", vocab_size=49152, hidden_size=576, intermediate_size=1536,
            num_heads=9, num_kv_heads=3, prelude_layers=14, core_layers=2, coda_layers=14,
            num_loops=2, rope_theta=100000.0, rms_norm_eps=1e-5, tie_word_embeddings=True,
            max_position_embeddings=8192, bos_token_id=1, eos_token_ids=(2,)),
        lookahead=None,
        checkpoint=shipped_checkpoint("smol_loop_2x2"),
        chat=True,
        dtype="float32",
    )
