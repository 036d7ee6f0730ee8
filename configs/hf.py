"""Any supported decoder checkpoint, of any size: the model's family and shape are read from the
Hugging Face directory passed with --ckpt (Llama 2/3.x, CodeLlama, SmolLM2, Mistral, Qwen 2.5/3,
Gemma 2/3, Phi-3; `models.families`)."""

from lookahead_jax.lookahead.config import LookaheadConfig
from lookahead_jax.store.presets import Preset


def get_config() -> Preset:
    return Preset(
        name="hf",
        description=__doc__,
        model=None,  # taken from the checkpoint's config.json
        # The paper's 7B setting (Table 4, A100); `--auto` or `--auto_device=...` chooses one
        # for the loaded model and the device instead.
        lookahead=LookaheadConfig(W=15, N=5, G=15),
        checkpoint=None,  # pass --ckpt
        chat=True,
        dtype="bfloat16",
        weights_hint="a Hugging Face model directory",
    )
