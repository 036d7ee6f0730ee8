"""An independent NumPy float64 forward pass of the two looped families, written from the
published architecture descriptions, to check `models.looped_loader.load_hf_looped` against
(tests/test_looped_parity.py). NumPy only: nothing from `models/` or `lookahead_jax/`.

Sources read (the published modeling code; nothing copied):
- Ouro: `modeling_ouro.py` of the ByteDance/Ouro-1.4B / 2.6B hub repositories, read in its
  GitHub copies (LoopedLMs/ouro_rl `ouro_rl/modeling/modeling_ouro.py`): `OuroForCausalLM`,
  `OuroModel`, `OuroDecoderLayer`, `OuroAttention`, `OuroRMSNorm`, `OuroRotaryEmbedding`.
- Huginn / Raven: `recpre/raven_modeling_minimal.py` of seal-rg/recurrent-pretraining (the
  modeling file of tomg-group-umd/huginn-0125: `RavenForCausalLM`, `SandwichBlock`,
  `CausalSelfAttention`, `GatedMLP`, `RMSNorm`, `precompute_freqs_cis`,
  `apply_rotary_emb_complex_like`) and its `raven_config_minimal.py` (`RavenConfig`).

What each family does, as those files do it:

Ouro. h = embed_tokens[ids]. One stack of `num_hidden_layers` decoder layers is run
`total_ut_steps` times; after every pass the shared final `norm` is applied and the normed
state both feeds the next pass and is read out: loop r's logits are lm_head(state_r) and its
exit-gate logit early_exit_gate(state_r) (`exit_at_step=r` selects that readout). A layer is
sandwich-normed: h = h + input_layernorm_2(attn(input_layernorm(h))), then
h = h + post_attention_layernorm_2(mlp(post_attention_layernorm(h))). RMSNorm: x / sqrt(mean(x^2)
+ rms_norm_eps) * w. Attention: separate q/k/v/o projections without bias, head_dim from the
config (default hidden / heads), grouped-query (query head j uses kv head j // (H / Hkv)),
rotate-half RoPE with inv_freq = theta^(-2i/D) duplicated over the two halves, scale D^-1/2,
causal. MLP: down(silu(gate(x)) * up(x)). lm_head tied to embed_tokens when
tie_word_embeddings.

Raven. x = wte[ids] * embed_scale (`init_values["embed_scale"]`, default sqrt(n_embd)); the
prelude blocks give e. The state starts as `input_states` (the published default draws it:
trunc_normal(std, a=-3 std, b=3 std) * embed_scale with std = `init_values["std"]`, default
sqrt(2 / (5 n_embd)); random, so it is an argument here). Each of `mean_recurrence` steps:
s = adapter(concat[s, e]) (state first), then the core blocks. Readout of a state s (the
forward at full depth, and `predict_from_latents` at any depth): ln_f(s), the coda blocks,
ln_f again, lm_head (tied to wte when tie_embeddings). SandwichBlock:
x = norm_2(attn(norm_1(x)) + x); x = norm_4(mlp(norm_3(x)) + x). Attention: fused Wqkv
split [n_embd | Hkv*D | Hkv*D], head_dim = n_embd // n_heads, optional qk_bias [2,1,H,D]
added to q and k before RoPE, RoPE on interleaved pairs (x[2i], x[2i+1]) rotated by
frequency i = theta^(-2i/D) (`rope_base`), causal, scale D^-1/2, `proj`. GatedMLP: one fc to
2 * intermediate, split [gate | up], proj(silu(gate) * up). RMSNorm as Ouro's, `norm_eps`.
(The published file's SDPA call has no grouped-query path; with num_key_value_heads < heads
the grouping here is the usual one, kv head j // (H / Hkv), as Llama-derived Raven
conversions use.)

`plant` names a deliberate architectural mistake (tests use it to show that the comparison
can fail); None is the published architecture.
"""

from __future__ import annotations

import math
from typing import Any, Mapping

import numpy as np

Weights = Mapping[str, np.ndarray]

OURO_PLANTS = ("norm_once", "rope_pairs", "no_post_attn_norm", "gate_before_norm")
RAVEN_PLANTS = ("adapter_order", "rope_half", "no_embed_scale", "no_ln_f_before_coda")


# ---- shared pieces (test_smollm2's GGUF reference uses them too) ------------------------------

def rms_norm(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    """x / sqrt(mean(x^2) + eps) * w over the last axis."""
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w


def silu(x: np.ndarray) -> np.ndarray:
    """x * sigmoid(x)."""
    return x / (1.0 + np.exp(-x))


def linear(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """x @ w.T: a torch Linear without bias (w [out, in])."""
    return x @ w.T


def inv_freq(head_dim: int, theta: float) -> np.ndarray:
    """[D/2] theta^(-2i/D)."""
    return 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)


def rope_rotate_half(x: np.ndarray, positions: np.ndarray, theta: float) -> np.ndarray:
    """x [B,T,H,D] rotated, Hugging Face layout: x*cos + rotate_half(x)*sin with the angles
    duplicated over the two halves. positions [T]."""
    ang = positions[:, None] * inv_freq(x.shape[-1], theta)[None, :]  # [T, D/2]
    ang = np.concatenate([ang, ang], axis=-1)[None, :, None, :]
    half = x.shape[-1] // 2
    rotated = np.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * np.cos(ang) + rotated * np.sin(ang)


def rope_pairs(x: np.ndarray, positions: np.ndarray, theta: float) -> np.ndarray:
    """x [B,T,H,D] rotated, complex-pair layout: (x[2i], x[2i+1]) as a complex number times
    exp(i * pos * theta^(-2i/D)). positions [T]."""
    ang = positions[:, None] * inv_freq(x.shape[-1], theta)[None, :]  # [T, D/2]
    cos, sin = np.cos(ang)[None, :, None, :], np.sin(ang)[None, :, None, :]
    re, im = x[..., 0::2], x[..., 1::2]
    out = np.empty_like(x)
    out[..., 0::2] = re * cos - im * sin
    out[..., 1::2] = im * cos + re * sin
    return out


def causal_attention(q: np.ndarray, k: np.ndarray, v: np.ndarray) -> np.ndarray:
    """q [B,T,H,D], k/v [B,T,Hkv,D] -> [B,T,H,D]; query head j reads kv head j // (H/Hkv);
    softmax(q k^T / sqrt(D)) over keys at or before the query."""
    h, hkv = q.shape[2], k.shape[2]
    k = np.repeat(k, h // hkv, axis=2)
    v = np.repeat(v, h // hkv, axis=2)
    scores = np.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(q.shape[-1])
    t = q.shape[1]
    scores = np.where(np.tril(np.ones((t, t), bool))[None, None], scores, -np.inf)
    scores = scores - scores.max(axis=-1, keepdims=True)
    p = np.exp(scores)
    p /= p.sum(axis=-1, keepdims=True)
    return np.einsum("bhqk,bkhd->bqhd", p, v)


def _as64(weights: Weights) -> dict[str, np.ndarray]:
    return {name: np.asarray(w, np.float64) for name, w in weights.items()}


# ---- Ouro -------------------------------------------------------------------------------------

def ouro_forward(weights: Weights, config: Mapping[str, Any], ids: np.ndarray,
                 plant: str | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Ouro's forward pass read out after every loop.

    weights: {published tensor name: array} (`model.layers.{i}.self_attn.q_proj.weight`, ...);
    config: the published config.json dict; ids [B,T] token ids at positions 0..T-1.
    Returns logits [R,B,T,V] and exit-gate logits [R,B,T], float64 (R = total_ut_steps; the
    last loop's logits are the model's output).
    """
    if plant is not None and plant not in OURO_PLANTS:
        raise ValueError(f"unknown plant {plant!r}")
    w = _as64(weights)
    e = int(config["hidden_size"])
    n_heads = int(config["num_attention_heads"])
    n_kv = int(config.get("num_key_value_heads") or n_heads)
    head_dim = int(config.get("head_dim") or e // n_heads)
    eps = float(config.get("rms_norm_eps", 1e-6))
    theta = float(config.get("rope_theta", 10000.0))
    n_layers = int(config["num_hidden_layers"])
    loops = int(config.get("total_ut_steps", 4))
    head = w.get("lm_head.weight")
    if head is None or config.get("tie_word_embeddings", False):
        head = w["model.embed_tokens.weight"]
    rope = rope_pairs if plant == "rope_pairs" else rope_rotate_half

    b, t = ids.shape
    pos = np.arange(t, dtype=np.float64)
    h = w["model.embed_tokens.weight"][ids]
    logits, gates = [], []
    for _ in range(loops):
        for i in range(n_layers):
            p = f"model.layers.{i}."
            x = rms_norm(h, w[p + "input_layernorm.weight"], eps)
            q = linear(x, w[p + "self_attn.q_proj.weight"]).reshape(b, t, n_heads, head_dim)
            k = linear(x, w[p + "self_attn.k_proj.weight"]).reshape(b, t, n_kv, head_dim)
            v = linear(x, w[p + "self_attn.v_proj.weight"]).reshape(b, t, n_kv, head_dim)
            a = causal_attention(rope(q, pos, theta), rope(k, pos, theta), v)
            a = linear(a.reshape(b, t, n_heads * head_dim), w[p + "self_attn.o_proj.weight"])
            if plant != "no_post_attn_norm":
                a = rms_norm(a, w[p + "input_layernorm_2.weight"], eps)
            h = h + a
            x = rms_norm(h, w[p + "post_attention_layernorm.weight"], eps)
            m = linear(silu(linear(x, w[p + "mlp.gate_proj.weight"]))
                       * linear(x, w[p + "mlp.up_proj.weight"]), w[p + "mlp.down_proj.weight"])
            h = h + rms_norm(m, w[p + "post_attention_layernorm_2.weight"], eps)
        normed = rms_norm(h, w["model.norm.weight"], eps)
        gate_in = h if plant == "gate_before_norm" else normed
        gates.append((linear(gate_in, w["model.early_exit_gate.weight"])
                      + w["model.early_exit_gate.bias"])[..., 0])
        logits.append(linear(normed, head))
        if plant != "norm_once":
            h = normed  # the normed state is what the next loop reads
    return np.stack(logits), np.stack(gates)


# ---- Raven ------------------------------------------------------------------------------------

def raven_init_values(config: Mapping[str, Any]) -> dict[str, float]:
    """`init_values` as `RavenConfig` makes them: derived from n_embd, overridden by the
    config.json's own `init_values` where it has them."""
    e = int(config.get("n_embd", config.get("hidden_size", 0)))
    values = {"std": math.sqrt(2 / (5 * e)), "embed_scale": math.sqrt(e)}
    values.update({k: float(v) for k, v in (config.get("init_values") or {}).items()})
    return values


def _raven_block(w: dict[str, np.ndarray], p: str, x: np.ndarray, dims: tuple[int, int, int],
                 eps: float, theta: float, qk_bias: bool, plant: str | None) -> np.ndarray:
    """One SandwichBlock (prefix p, e.g. "transformer.core_block.0.")."""
    n_heads, n_kv, head_dim = dims
    b, t, e = x.shape
    pos = np.arange(t, dtype=np.float64)
    qkv = linear(rms_norm(x, w[p + "norm_1.weight"], eps), w[p + "attn.Wqkv.weight"])
    q = qkv[..., :n_heads * head_dim].reshape(b, t, n_heads, head_dim)
    k = qkv[..., n_heads * head_dim:(n_heads + n_kv) * head_dim].reshape(b, t, n_kv, head_dim)
    v = qkv[..., (n_heads + n_kv) * head_dim:].reshape(b, t, n_kv, head_dim)
    if qk_bias:
        bias = w[p + "attn.qk_bias"]  # [2, 1, H, D]
        q, k = q + bias[0], k + bias[1]
    rope = rope_rotate_half if plant == "rope_half" else rope_pairs
    a = causal_attention(rope(q, pos, theta), rope(k, pos, theta), v)
    a = linear(a.reshape(b, t, n_heads * head_dim), w[p + "attn.proj.weight"])
    x = rms_norm(a + x, w[p + "norm_2.weight"], eps)
    gate, up = np.split(linear(rms_norm(x, w[p + "norm_3.weight"], eps),
                               w[p + "mlp.fc.weight"]), 2, axis=-1)
    return rms_norm(linear(silu(gate) * up, w[p + "mlp.proj.weight"]) + x,
                    w[p + "norm_4.weight"], eps)


def raven_forward(weights: Weights, config: Mapping[str, Any], ids: np.ndarray,
                  initial_state: np.ndarray, plant: str | None = None) -> np.ndarray:
    """Raven's forward pass read out after every recurrence step.

    weights: {published tensor name: array} (`transformer.core_block.0.attn.Wqkv.weight`,
    ...); config: the published config.json dict; ids [B,T] token ids at positions 0..T-1;
    initial_state [B,T,E]: the state before the first step (the published `input_states`).
    Returns logits [R,B,T,V] float64 (R = mean_recurrence): step r's latent state read out
    as `predict_from_latents` does; the last one is the model's output.
    """
    if plant is not None and plant not in RAVEN_PLANTS:
        raise ValueError(f"unknown plant {plant!r}")
    w = _as64(weights)
    e = int(config.get("n_embd", config.get("hidden_size", 0)))
    n_heads = int(config.get("n_heads", config.get("num_attention_heads", 0)))
    n_kv = int(config.get("num_key_value_heads") or n_heads)
    dims = (n_heads, n_kv, e // n_heads)
    eps = float(config.get("norm_eps", 1e-6))
    theta = float(config.get("rope_base", 50000.0))
    qk_bias = bool(config.get("qk_bias", True))
    steps = int(config.get("mean_recurrence", 32))
    scale = 1.0 if plant == "no_embed_scale" else raven_init_values(config)["embed_scale"]
    head = w.get("lm_head.weight")
    if head is None or config.get("tie_embeddings", config.get("tie_word_embeddings", True)):
        head = w["transformer.wte.weight"]

    def blocks(group: str, n: int, x: np.ndarray) -> np.ndarray:
        for i in range(n):
            x = _raven_block(w, f"transformer.{group}.{i}.", x, dims, eps, theta, qk_bias, plant)
        return x

    def readout(s: np.ndarray) -> np.ndarray:
        x = s if plant == "no_ln_f_before_coda" else rms_norm(s, w["transformer.ln_f.weight"], eps)
        x = blocks("coda", int(config.get("n_layers_in_coda", 2)), x)
        return linear(rms_norm(x, w["transformer.ln_f.weight"], eps), head)

    emb = blocks("prelude", int(config.get("n_layers_in_prelude", 2)),
                 w["transformer.wte.weight"][ids] * scale)
    s = np.asarray(initial_state, np.float64)
    logits = []
    for _ in range(steps):
        joined = [emb, s] if plant == "adapter_order" else [s, emb]
        s = linear(np.concatenate(joined, axis=-1), w["transformer.adapter.weight"])
        s = blocks("core_block", int(config.get("n_layers_in_recurrent_block", 4)), s)
        logits.append(readout(s))
    return np.stack(logits)
