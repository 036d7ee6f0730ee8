"""Model families: Llama (Llama-2/3, CodeLlama, Mistral-style GQA, SmolLM2)."""

from models.config import ConfigError, LlamaConfig, RopeScaling
from models.kv_cache import KVCache, NewKV
from models.llama import Llama, causal_mask, dot_product_attention

__all__ = ["ConfigError", "KVCache", "Llama", "LlamaConfig", "NewKV", "RopeScaling",
           "causal_mask", "dot_product_attention"]
